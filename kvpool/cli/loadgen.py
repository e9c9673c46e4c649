"""A load generator: a client process that puts and gets KV-cache-sized objects and checks every byte.

`python -m kvpool.cli.loadgen --master ADDR --out-dir DIR --worker-id N ...` runs one sync
`Store` for a bounded time (or until SIGTERM), one operation at a time: a put of a new key with
probability `put_ratio`, else a get of a key some worker acknowledged. A value is a pure function
of its key (size and bytes drawn from a PRNG seeded with the key's hash), so any process checks
any object it reads without sharing data. Each acknowledged key is appended to
`DIR/acked-N.tsv` with the segments of its replicas at acknowledgement (so a fault injector can
tell a legitimately lost object from a lost acknowledged one); workers read one another's files
to choose what to get. At the end it writes `DIR/stats-N.json`: counters, the longest call, and
every operation as (start ms, kind, latency ms, outcome, size bytes) for figures over any
window.

It is neither a test nor a benchmark: tests/test_chaos.py and benchmarks/mixed_load.py drive it,
and decide what its figures must be.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import xxhash

from kvpool.errors import ErrorCode, KVPoolError

# Outcomes of one operation, as stored in the op log.
OK, MISS, WRONG, ERROR = 0, 1, 2, 3
PUT, GET = 0, 1
# Bound on the op log kept in memory (an entry is 5 numbers): ~3 hours at 100 ops/s.
OPS_LOGGED_MAX = 1_000_000
_ACKED_REFRESH_S = 0.5


def value_size(key: str, size_min: int, size_max: int) -> int:
    return size_min + xxhash.xxh64_intdigest(key.encode(), seed=1) % (size_max - size_min + 1)


def value_of(key: str, size_min: int, size_max: int) -> bytes:
    """The one value `key` ever has in a load run."""
    seed = xxhash.xxh64_intdigest(key.encode())
    return np.random.default_rng(seed).bytes(value_size(key, size_min, size_max))


def read_acked(out_dir: Path) -> dict[str, list[str]]:
    """Every acknowledged key of every worker in `out_dir`, with its replica segments then."""
    acked: dict[str, list[str]] = {}
    for path in sorted(out_dir.glob("acked-*.tsv")):
        for line in path.read_text().splitlines():
            key, _, segments = line.partition("\t")
            if key:
                acked[key] = [s for s in segments.split(",") if s]
    return acked


class AckedKeys:
    """The keys acknowledged so far by all workers, read incrementally from their files."""

    def __init__(self, out_dir: Path) -> None:
        self._out_dir = out_dir
        self._offsets: dict[Path, int] = {}
        self.keys: list[str] = []
        self._refreshed_at = 0.0

    def refresh(self, now: float) -> None:
        if now - self._refreshed_at < _ACKED_REFRESH_S:
            return
        self._refreshed_at = now
        for path in self._out_dir.glob("acked-*.tsv"):
            offset = self._offsets.get(path, 0)
            with open(path, "rb") as file:
                file.seek(offset)
                chunk = file.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits
            self._offsets[path] = offset + len(complete)
            for line in complete.decode().splitlines():
                self.keys.append(line.partition("\t")[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", required=True)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--worker-id", type=int, default=0)
    parser.add_argument("--run-id", default="load")
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--put-ratio", type=float, default=0.2)
    parser.add_argument("--size-min", type=int, default=64 * 1024)
    parser.add_argument("--size-max", type=int, default=512 * 1024)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--puts-max", type=int, default=100_000, help="stop putting after this many")
    parser.add_argument("--rate", type=float, default=0.0, help="ops/s at most (0: as fast as it goes)")
    parser.add_argument("--shm", type=int, default=1)
    parser.add_argument("--rpc-timeout-ms", type=int, default=3_000)
    parser.add_argument("--connect-timeout-ms", type=int, default=1_000)
    parser.add_argument("--transfer-timeout-ms", type=int, default=3_000)
    parser.add_argument("--token-file", default=None)
    args = parser.parse_args(argv)
    assert 0.0 <= args.put_ratio <= 1.0 and 0 < args.size_min <= args.size_max, args

    from kvpool.client.sync import Store
    from kvpool.config import tokens_from
    from kvpool.protocol.messages import ReplicateConfig

    stopping = False

    def stop(_signum, _frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    acked_path = args.out_dir / f"acked-{args.worker_id}.tsv"
    stats_path = args.out_dir / f"stats-{args.worker_id}.json"
    rng = random.Random(f"{args.run_id}/{args.worker_id}")
    config = ReplicateConfig(replica_num=args.replicas)
    tokens = tokens_from(None, args.token_file)  # every line: a rotation's next token too
    store = Store(
        args.master,
        token=tokens[0] if tokens else None,
        other_tokens=tuple(tokens[1:]),
        shm_enabled=bool(args.shm),
        rpc_timeout_ms=args.rpc_timeout_ms,
        connect_timeout_ms=args.connect_timeout_ms,
        transfer_timeout_ms=args.transfer_timeout_ms,
    )
    bound_ms = args.transfer_timeout_ms + 3 * args.rpc_timeout_ms  # sync.Store's outer bound
    acked = AckedKeys(args.out_dir)
    counts: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    wrong_keys: list[str] = []
    ops: list[tuple[int, int, float, int, int]] = []
    puts = 0
    started = time.monotonic()
    epoch_ms = time.time() * 1000
    print("ready", flush=True)
    with open(acked_path, "a", buffering=1) as acked_file:
        while not stopping and time.monotonic() - started < args.duration_s:
            begin = time.monotonic()
            acked.refresh(begin)
            is_put = puts < args.puts_max and (not acked.keys or rng.random() < args.put_ratio)
            if is_put:
                key = f"{args.run_id}/w{args.worker_id}/{puts}"
                puts += 1
                value = value_of(key, args.size_min, args.size_max)
                begin = time.monotonic()
                try:
                    code = store.put_batch([key], [value], config)[0]
                    outcome = OK if code == ErrorCode.OK else ERROR
                    if outcome == ERROR:
                        errors[f"put:{ErrorCode(code).name}"] += 1
                except KVPoolError as exc:
                    outcome = ERROR
                    errors[f"put:{type(exc).__name__}"] += 1
                latency_ms = (time.monotonic() - begin) * 1000
                if outcome == OK:
                    segments = ""
                    try:
                        reply = store.query([key])
                        segments = ",".join(r.segment_id for r in reply.replicas[0])
                    except KVPoolError:
                        pass  # holders unknown: the injector then does not count this key
                    acked_file.write(f"{key}\t{segments}\n")
                kind = PUT
            elif acked.keys:
                key = rng.choice(acked.keys)
                begin = time.monotonic()
                try:
                    data = store.get(key)
                    if data is None:
                        outcome = MISS
                    elif data == value_of(key, args.size_min, args.size_max):
                        outcome = OK
                    else:
                        outcome = WRONG
                        wrong_keys.append(key)
                except KVPoolError as exc:
                    outcome = ERROR
                    errors[f"get:{type(exc).__name__}"] += 1
                latency_ms = (time.monotonic() - begin) * 1000
                kind = GET
            else:
                time.sleep(0.01)
                continue
            counts[f"{'put' if kind == PUT else 'get'}_{('ok', 'miss', 'wrong', 'error')[outcome]}"] += 1
            if len(ops) < OPS_LOGGED_MAX:
                size = value_size(key, args.size_min, args.size_max)
                ops.append((int((begin - started) * 1000), kind, round(latency_ms, 3), outcome, size))
            if args.rate > 0:
                pause = begin + 1.0 / args.rate - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
    elapsed_s = time.monotonic() - started
    try:
        store.close()
    except KVPoolError:
        pass  # The cluster may be down at the end of a chaos run: the figures are what matter.
    stats = {
        "worker_id": args.worker_id,
        "started_epoch_ms": epoch_ms,
        "elapsed_s": elapsed_s,
        "bound_ms": bound_ms,
        "max_latency_ms": max((op[2] for op in ops), default=0.0),
        "counts": dict(counts),
        "errors": dict(errors),
        "wrong_keys": wrong_keys[:100],
        "size_min": args.size_min,
        "size_max": args.size_max,
        "ops": ops,
    }
    temporary = stats_path.with_suffix(".tmp")
    temporary.write_text(json.dumps(stats))
    temporary.rename(stats_path)
    return 0


def percentile(values: list[float], fraction: float) -> float:
    """The nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def summarize(stats: list[dict], window_ms: tuple[float, float] | None = None) -> dict:
    """Throughput and latency of the workers' ops, over a window of epoch ms if given."""
    latencies: dict[int, list[float]] = {PUT: [], GET: []}
    outcomes: Counter[str] = Counter()
    span_s = 0.0
    moved_bytes = 0
    for worker in stats:
        base = worker["started_epoch_ms"]
        for start_ms, kind, latency_ms, outcome, size in worker["ops"]:
            when = base + start_ms
            if window_ms is not None and not window_ms[0] <= when < window_ms[1]:
                continue
            latencies[kind].append(latency_ms)
            if outcome == OK:
                moved_bytes += size
            outcomes[f"{'put' if kind == PUT else 'get'}_{('ok', 'miss', 'wrong', 'error')[outcome]}"] += 1
        span_s = max(span_s, worker["elapsed_s"])
    if window_ms is not None:
        span_s = (window_ms[1] - window_ms[0]) / 1000
    done = outcomes["put_ok"] + outcomes["get_ok"]
    both = latencies[PUT] + latencies[GET]
    return {
        "ops": sum(outcomes.values()),
        "ops_per_s": round(sum(outcomes.values()) / span_s, 1) if span_s else 0.0,
        "ok_ops_per_s": round(done / span_s, 1) if span_s else 0.0,
        "mib_per_s": round(moved_bytes / span_s / (1 << 20), 1) if span_s else 0.0,
        "put_p50_ms": round(percentile(latencies[PUT], 0.50), 2),
        "put_p99_ms": round(percentile(latencies[PUT], 0.99), 2),
        "get_p50_ms": round(percentile(latencies[GET], 0.50), 2),
        "get_p99_ms": round(percentile(latencies[GET], 0.99), 2),
        "all_p50_ms": round(percentile(both, 0.50), 2),
        "all_p99_ms": round(percentile(both, 0.99), 2),
        "max_ms": round(max(both, default=0.0), 1),
        "outcomes": dict(outcomes),
    }


if __name__ == "__main__":
    sys.exit(main())
