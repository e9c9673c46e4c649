#!/usr/bin/env python3
"""KV cache written by one serving instance, reused by another: kvpool's mission in one run.

    python examples/kv_reuse.py                     # a 1,024-token prompt, 64-token pages
    python examples/kv_reuse.py --prompt-tokens 2048 --layers 8

What happens:
  1. A kvpool master starts on 127.0.0.1 (no storage nodes of its own).
  2. Instance A, a separate process, builds a small Llama from a config (random weights, seeded,
     no download), contributes a 256 MiB segment to the pool (embedded mode), prefills the
     prompt and stores its KV cache page by page: one object per page, keys chained by the
     hash of every token up to the end of the page.
  3. Instance B, another process with its own segment (so another node of the pool), gets the
     same prompt plus a new turn. It asks the pool how many leading pages it has (one round
     trip), reads them over TCP from A's node straight into one tensor, and computes only the
     tokens after them. It also recomputes everything from scratch and checks that the
     next-token logits match (torch.allclose).
  4. The prefill time saved is printed.

Needs `pip install torch==2.13.0 transformers` (or `pip install -e '.[integrations]'`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

SEED = 1234
SEGMENT_SIZE_BYTES = 256 << 20
MODEL_ID = "tiny-llama-random"
INSTANCE_TIMEOUT_S = 300


def build_model(args: argparse.Namespace):
    """The same random-weight model in every process: the same config and seed."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 2),
        max_position_embeddings=args.prompt_tokens + args.turn_tokens + 64,
    )  # fmt: skip
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config).eval(), config


def prompt_tokens(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    import torch

    generator = torch.Generator().manual_seed(SEED + 1)
    tokens = torch.randint(0, args.vocab, (args.prompt_tokens + args.turn_tokens,), generator=generator)
    return tokens[: args.prompt_tokens].tolist(), tokens[args.prompt_tokens :].tolist()


def run_instance_a(args: argparse.Namespace) -> None:
    """Prefill the prompt, store its pages, report, then keep serving the segment until told."""
    import torch

    from kvpool import Store
    from kvpool.integrations.transformers_cache import PageLayout, save_pages

    torch.set_num_threads(args.threads)
    model, config = build_model(args)
    prompt, _ = prompt_tokens(args)
    layout = PageLayout.from_config(MODEL_ID, config, args.page_tokens, torch.float32)
    with Store(args.master, embedded_memory_bytes=SEGMENT_SIZE_BYTES) as store:
        started = time.perf_counter()
        with torch.no_grad():
            output = model(torch.tensor([prompt]), use_cache=True)
        prefill_s = time.perf_counter() - started
        started = time.perf_counter()
        codes = save_pages(store, layout, output.cache, prompt)
        save_s = time.perf_counter() - started
        segments = [s.segment.segment_id for s in store.cluster_status().segments]
        report(role="a", pages_saved=sum(c == 0 for c in codes), page_count=len(codes),
               prefill_ms=prefill_s * 1e3, save_ms=save_s * 1e3, segments=segments,
               page_size_bytes=layout.page_size_bytes)  # fmt: skip
        sys.stdin.readline()  # serve the segment until the driver says we are done


def run_instance_b(args: argparse.Namespace) -> None:
    """Reuse A's pages for the prompt, compute the new turn, and check against a recompute."""
    import torch

    from kvpool import Store
    from kvpool.integrations.transformers_cache import PageLayout, load_pages

    torch.set_num_threads(args.threads)
    model, config = build_model(args)
    prompt, turn = prompt_tokens(args)
    tokens = prompt + turn
    layout = PageLayout.from_config(MODEL_ID, config, args.page_tokens, torch.float32)
    # shm off: the pages travel over TCP from A's node, as they would between two servers.
    with Store(args.master, embedded_memory_bytes=SEGMENT_SIZE_BYTES, shm_enabled=False) as store:
        with torch.no_grad():
            started = time.perf_counter()
            cache, cached_tokens = load_pages(store, layout, tokens)
            load_s = time.perf_counter() - started
            started = time.perf_counter()
            rest = torch.tensor([tokens[cached_tokens:]])
            reused = model(rest, cache=cache, use_cache=True).logits[0, -1]
            compute_s = time.perf_counter() - started
            started = time.perf_counter()
            full = model(torch.tensor([tokens])).logits[0, -1]
            full_s = time.perf_counter() - started
        keys = layout.page_keys(tokens)[: cached_tokens // args.page_tokens]
        replica_segments = sorted({rs[0].segment_id for rs in store.query(keys).replicas}) if keys else []
        segments = [s.segment.segment_id for s in store.cluster_status().segments]
        report(
            role="b", cached_tokens=cached_tokens, computed_tokens=len(tokens) - cached_tokens,
            total_tokens=len(tokens), load_ms=load_s * 1e3, compute_ms=compute_s * 1e3,
            full_prefill_ms=full_s * 1e3, allclose=bool(torch.allclose(reused, full, atol=1e-4, rtol=1e-4)),
            max_abs_diff=float((reused - full).abs().max()),
            same_next_token=int(reused.argmax()) == int(full.argmax()),
            replica_segments=replica_segments, segments=segments,
        )  # fmt: skip


def report(**values: object) -> None:
    print("RESULT " + json.dumps(values), flush=True)


def read_result(process: subprocess.Popen, deadline: float) -> dict:
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"instance (pid {process.pid}) gave no result")


def instance(role: str, args: argparse.Namespace, master: str) -> subprocess.Popen:
    command = [sys.executable, str(Path(__file__).resolve()), "--role", role, "--master", master,
               *(f"--{name.replace('_', '-')}={value}" for name, value in vars(args).items()
                 if name not in ("role", "master"))]  # fmt: skip
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def run_demo(args: argparse.Namespace) -> dict:
    """Start a master, then A, then B; return both instances' reports."""
    from kvpool.cli.launcher import LocalCluster

    deadline = time.monotonic() + INSTANCE_TIMEOUT_S
    with LocalCluster(node_count=0) as cluster:
        a = instance("a", args, cluster.master_endpoint)
        try:
            result_a = read_result(a, deadline)
            b = instance("b", args, cluster.master_endpoint)
            try:
                result_b = read_result(b, deadline)
                b.wait(max(1.0, deadline - time.monotonic()))
            finally:
                if b.poll() is None:
                    b.kill()
                    b.wait(10)
            assert a.stdin is not None
            a.stdin.write("done\n")
            a.stdin.flush()
            a.wait(max(1.0, deadline - time.monotonic()))
        finally:
            if a.poll() is None:
                a.kill()
                a.wait(10)
    return {"a": result_a, "b": result_b, "pids": [a.pid, b.pid]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--turn-tokens", type=int, default=32)
    parser.add_argument("--page-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per instance")
    parser.add_argument("--role", choices=["a", "b"], help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role == "a":
        run_instance_a(args)
        return 0
    if args.role == "b":
        run_instance_b(args)
        return 0
    results = run_demo(args)
    a, b = results["a"], results["b"]
    reuse_ms = b["load_ms"] + b["compute_ms"]
    print(f"instance A (pid {results['pids'][0]}): prefilled {args.prompt_tokens} tokens in "
          f"{a['prefill_ms']:.0f} ms, stored {a['pages_saved']} pages of {args.page_tokens} tokens "
          f"({a['page_size_bytes'] / 1024:.0f} KiB each) in {a['save_ms']:.0f} ms")
    print(f"instance B (pid {results['pids'][1]}): reused {b['cached_tokens']} of "
          f"{b['total_tokens']} tokens from A's node, computed {b['computed_tokens']}: "
          f"load {b['load_ms']:.0f} ms + compute {b['compute_ms']:.0f} ms = {reuse_ms:.0f} ms")
    print(f"full recompute on B: {b['full_prefill_ms']:.0f} ms -> prefill time saved: "
          f"{b['full_prefill_ms'] - reuse_ms:.0f} ms ({b['full_prefill_ms'] / max(reuse_ms, 1e-3):.1f}x faster)")
    print(f"next-token logits match a full recompute: {b['allclose']} "
          f"(max |diff| {b['max_abs_diff']:.2e}, same next token: {b['same_next_token']})")
    return 0 if b["allclose"] and b["cached_tokens"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
