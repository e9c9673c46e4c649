"""`kvpool replay`: hit rates of a FAST'25 request trace, in simulation or on a live cluster.

Reads the command line, runs one replay per (capacity, sharing, routing, policy), shows a
progress bar and a table, and writes `replay.json`, `replay.md` and `replay.png` (hit rate
against pool capacity, one curve per configuration) into --out. The replays themselves are
kvpool/sim's (replay.py for --mode sim, live.py for --mode live); main.py registers `replay`.

Capacities are per instance: tokens with decimal suffixes (1M = 1,000,000 tokens = 1953
blocks of 512), bytes with a B suffix (64GiB, at --bytes-per-token), or "unbounded"; so are
disk tier sizes (--disk-capacity), which are never unbounded.
"""

from __future__ import annotations

import errno
import io
import re
import shlex
import sys
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from kvpool import limits
from kvpool.config import parse_size
from kvpool.errors import InvalidParams, KVPoolError
from kvpool.process import discard_stdout

_TOKENS_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]?)\s*(?:tokens?)?\s*$", re.IGNORECASE)
_TOKEN_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}
_UNBOUNDED = ("unbounded", "inf", "all")
PLOT_TITLE_MAX = 100
CONSOLE_WIDTH_NOT_TERMINAL = 240  # the widest table: disk tier and blocks not stored
POLICIES_SIM_DEFAULT = "lru,probation,belady"
OUT_FILES = ("replay.json", "replay.md", "replay.png")


def parse_capacity_tokens(text: str, bytes_per_token: int) -> int | None:
    """Tokens per instance from "1M" (decimal), "64GiB" (bytes) or "unbounded" (None).

    Raises:
        InvalidParams: neither a token count nor a size.
    """
    text = text.strip()
    if text.lower() in _UNBOUNDED:
        return None
    if text.upper().endswith("B"):
        return parse_size(text) // bytes_per_token
    match = _TOKENS_RE.match(text)
    if match is None:
        raise InvalidParams(f"not a capacity: {text!r} (try 1M, 3M tokens, 64GiB or unbounded)")
    number, unit = match.groups()
    # Exact (a float made 999999999999G 999,999,999,999,000,051,712 tokens, and 10**400 an
    # OverflowError).
    return int(Fraction(number) * _TOKEN_UNITS[unit.upper()])


# The ReplayConfig fields behind this command's options: its errors name the options typed.
_CONFIG_FLAGS = {"instance_count": "--instances", "check_every": "--check-every"}


def _in_flags(exc: InvalidParams) -> InvalidParams:
    """`exc` with each ReplayConfig field it names spelt as its option (cli/main.py does the same
    for the servers' config records)."""
    pattern = r"\b(" + "|".join(_CONFIG_FLAGS) + r")\b"
    return InvalidParams(re.sub(pattern, lambda match: _CONFIG_FLAGS[match.group(1)], str(exc)))


def _items(text: str, what: str) -> list[str]:
    """The items of a comma-separated option; InvalidParams if there are none ("," or "")."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise InvalidParams(f"no {what} given")
    return items


def _names(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    names = _items(text, what)
    for name in names:
        if name not in allowed:
            raise InvalidParams(f"{what} {name!r} not one of {', '.join(allowed)}")
    return list(dict.fromkeys(names))


def replay(
    trace: Annotated[Path, typer.Argument(help="Trace file (FAST'25 JSON lines).", exists=True, dir_okay=False)],
    instances: Annotated[int, typer.Option("--instances", "-n", help="Serving instances.")] = 1,
    capacity: Annotated[
        str, typer.Option(help="Per-instance capacities, comma-separated: tokens (1M), bytes (64GiB) or unbounded.")
    ] = "1M,3M,10M",
    disk_capacity: Annotated[
        str,
        typer.Option(
            help="A disk tier under each instance's DRAM, per instance, comma-separated "
            "(tokens or bytes as --capacity; 0: none). DRAM evicts to it; reads there are hits.",
        ),
    ] = "0",
    bytes_per_token: Annotated[
        str, typer.Option(help="KV-cache bytes per token (320KiB: a 70B model in fp16).")
    ] = "320KiB",
    routing: Annotated[
        str, typer.Option(help="round-robin, random, cache-aware (comma-separated for several).")
    ] = "round-robin",
    policy: Annotated[
        str | None,
        typer.Option(
            help="Eviction policies, comma-separated: lru, probation (kvpool's default), belady "
            "(offline optimum, sim only). Default: all three (sim), probation (live).",
        ),
    ] = None,
    sharing: Annotated[
        str, typer.Option(help="local (each instance alone), pooled (one pool), or both.")
    ] = "local,pooled",
    mode: Annotated[str, typer.Option(help="sim (the master code, simulated clock) or live (real processes).")] = "sim",
    limit: Annotated[int | None, typer.Option(help="Replay only N requests (after --skip).")] = None,
    skip: Annotated[int, typer.Option(help="Leave out the first N requests (the trace's clock restarts at 0).")] = 0,
    out: Annotated[
        Path, typer.Option(help="Directory for replay.json, replay.md and replay.png.")
    ] = Path("replay-out"),
    watermark_high: Annotated[
        float, typer.Option(help="Master eviction watermark (1.0: evict only for room; the master ships 0.9).")
    ] = 1.0,
    speedup: Annotated[float, typer.Option(help="Live: trace ms per wall ms (0: as fast as possible).")] = 0.0,
    seed: Annotated[int, typer.Option(help="Routing and placement randomness.")] = 0,
    check_every: Annotated[
        int, typer.Option(help="Sim: check the master's invariants every N calls (0: at the end).")
    ] = 0,
) -> None:
    """Replay a request trace: hit rates of local caches vs one pool, per capacity and policy."""
    from kvpool.cli.launcher import sigterm_as_interrupt

    stdout = _ForgivingStdout()
    console = Console(file=stdout, emoji=False)
    if not console.is_terminal:  # a log file: do not fold the table
        console = Console(file=stdout, width=CONSOLE_WIDTH_NOT_TERMINAL, emoji=False)
    errors = Console(stderr=True, soft_wrap=True, emoji=False)
    try:
        # Live, SIGTERM stops the clusters as SIGINT does (no process or segment outlives it).
        with sigterm_as_interrupt():
            _run(
                console, trace, instances, capacity, disk_capacity, bytes_per_token, routing, policy, sharing,
                mode, limit, skip, out, watermark_high, speedup, seed, check_every,
            )  # fmt: skip
    except KVPoolError as exc:
        errors.print(f"[red]error:[/red] {exc}")  # one line, for logs
        raise typer.Exit(1) from None
    if stdout.failure is not None:  # the files are written; the table and progress were not all shown
        if stdout.failure.errno != errno.EPIPE:  # a reader that left (`| head`) wants no word of it
            errors.print(f"[red]error:[/red] cannot write to standard output: {stdout.failure.strerror}")
        raise typer.Exit(1)


class _ForgivingStdout(io.TextIOBase):
    """Standard output that a reader who left (`| head`, quitting `less`) or a full disk does
    not stop: a replay's results are its files, and a failed print of its progress or table
    ended the run before they were written. What is not written goes to /dev/null; `failure`
    says why, for the exit status."""

    def __init__(self) -> None:
        self.failure: OSError | None = None

    def write(self, text: str) -> int:
        self._tried(lambda: sys.stdout.write(text))
        return len(text)

    def flush(self) -> None:
        self._tried(sys.stdout.flush)

    def isatty(self) -> bool:
        return sys.stdout.isatty()

    def _tried(self, output) -> None:
        if self.failure is not None:
            return
        try:
            output()
        except OSError as exc:
            self.failure = exc
            discard_stdout()


def _run(
    console: Console, trace: Path, instances: int, capacity: str, disk_capacity: str, bytes_per_token_text: str,
    routing: str, policy: str | None, sharing: str, mode: str, limit: int | None, skip: int, out: Path,
    watermark_high: float, speedup: float, seed: int, check_every: int,
) -> list:  # fmt: skip
    import msgspec

    from kvpool.master.eviction import POLICY_DEFAULT
    from kvpool.sim import report
    from kvpool.sim.replay import POLICY_NAMES, SHARINGS, ReplayConfig
    from kvpool.sim.replay import replay as replay_sim
    from kvpool.sim.routing import ROUTINGS
    from kvpool.sim.trace import BLOCK_TOKENS, load_trace

    if mode not in ("sim", "live"):
        raise InvalidParams(f"mode {mode!r} not sim or live")
    per_token = parse_size(bytes_per_token_text)
    if per_token <= 0:
        raise InvalidParams("bytes per token must be positive")
    # The master's own check, said here before anything runs (the simulation found it at its
    # first configuration, a live master at its start) and in this command's terms.
    if not limits.EVICT_RATIO_DEFAULT < watermark_high <= 1.0:
        raise InvalidParams(
            f"--watermark-high {watermark_high}: give a ratio above {limits.EVICT_RATIO_DEFAULT} (the part of a "
            "segment one eviction frees) and at most 1"
        )
    if not speedup >= 0:  # NaN too
        raise InvalidParams(f"--speedup {speedup}: give 0 (as fast as possible) or more trace ms per wall ms")
    policies = _names(policy or (POLICY_DEFAULT if mode == "live" else POLICIES_SIM_DEFAULT), POLICY_NAMES, "policy")
    # Checked with one instance too, where nothing is shared or routed: a misspelt name is an
    # error whatever the instance count.
    sharings = _names(sharing, SHARINGS, "sharing")
    routings = _names(routing, ROUTINGS, "routing")
    if instances == 1:
        sharings, routings = ["pooled"], ["round-robin"]
    capacities = []
    for text in _items(capacity, "capacity"):
        tokens = parse_capacity_tokens(text, per_token)
        if tokens is not None and tokens < BLOCK_TOKENS:
            raise InvalidParams(f"a capacity of {tokens} tokens holds no 512-token block")
        _check_capacity_max("--capacity", text, tokens)
        capacities.append(tokens)
    disk_blocks = []
    for text in _items(disk_capacity, "disk capacity"):
        tokens = parse_capacity_tokens(text, per_token)
        if tokens is None:
            raise InvalidParams("a disk tier has a size: give tokens (10M) or bytes (2TiB)")
        if 0 < tokens < BLOCK_TOKENS:
            raise InvalidParams(f"a disk tier of {tokens} tokens holds no 512-token block")
        _check_capacity_max("--disk-capacity", text, tokens)
        disk_blocks.append(tokens // BLOCK_TOKENS)
    if skip < 0 or (limit is not None and limit <= 0):
        raise InvalidParams("--skip must be >= 0 and --limit > 0")
    try:
        configs = [
            ReplayConfig(
                instance_count=instances,
                capacity_blocks=None if tokens is None else tokens // BLOCK_TOKENS,
                disk_capacity_blocks=disk, sharing=share, routing=route, policy=name, bytes_per_token=per_token,
                evict_watermark_ratio_high=watermark_high, seed=seed, check_every=check_every,
            )
            for share in sharings
            for route in routings
            for name in policies
            for disk in dict.fromkeys(disk_blocks)
            for tokens in capacities
        ]  # fmt: skip
    except InvalidParams as exc:
        raise _in_flags(exc) from None
    requests = load_trace(trace)
    requests = requests[skip : None if limit is None else skip + limit]
    if not requests:
        raise InvalidParams(f"{trace}: no requests to replay")
    if skip:
        origin = requests[0].timestamp
        requests = [msgspec.structs.replace(r, timestamp=r.timestamp - origin) for r in requests]
    configs = _runnable(console, configs, requests, mode, is_policy_default=policy is None)
    _check_out(out)
    if mode == "live":
        from kvpool.sim.live import replay_live

        def run_one(config, on_progress):
            return replay_live(requests, config, speedup=speedup, on_progress=on_progress)
    else:

        def run_one(config, on_progress):
            return replay_sim(requests, config, on_progress)

    console.print(
        f"[bold]kvpool replay[/bold] ({mode}): {len(requests)} requests of {trace}, "
        f"{len(configs)} configurations, {instances} instance(s)"
    )
    results = []
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True,
    ) as progress:  # fmt: skip
        overall = progress.add_task("all", total=len(configs) * len(requests))
        for config in configs:
            capacity_text = (
                "unbounded"
                if config.capacity_blocks is None
                else report.human_tokens(config.capacity_blocks * BLOCK_TOKENS)
            )
            task = progress.add_task(f"{config.label} @ {capacity_text}", total=len(requests))
            done = [0]

            def on_progress(count: int, task=task, done=done) -> None:
                progress.update(task, completed=count)
                progress.advance(overall, count - done[0])
                done[0] = count

            results.append(run_one(config, on_progress))
            progress.remove_task(task)
    # The files first: a stdout closed or full (`| head`, quitting `less`) failed the printing,
    # and with it a whole sweep's results.
    is_cli = len(sys.argv) > 1 and sys.argv[1] == "replay"
    command = "kvpool replay " + " ".join(shlex.quote(arg) for arg in sys.argv[2:]) if is_cli else ""
    meta = {"trace": str(trace), "skip": skip, "requests": len(requests), "mode": mode, "command": command}
    report.write_json(out / "replay.json", results, meta)
    report.write_markdown(out / "replay.md", results, meta)
    title = f"{trace.name}: {len(requests)} requests, {instances} instance(s), {mode}"[:PLOT_TITLE_MAX]
    report.plot_hit_rates(out / "replay.png", results, title)
    table = Table(*report.table_columns(results), title=f"hit rates ({mode})")
    for row in report.table_rows(results):
        table.add_row(*row)
    console.print(table)
    live = report.live_rows(results)
    if live:
        live_table = Table(*report.LIVE_COLUMNS, title="live throughput and latency")
        for row in live:
            live_table.add_row(*row)
        console.print(live_table)
    console.print(f"wrote {out / 'replay.json'}, {out / 'replay.md'}, {out / 'replay.png'}")
    return results


def _check_capacity_max(flag: str, text: str, tokens: int | None) -> None:
    """Raises InvalidParams: more tokens than one instance's segment holds (the master's largest
    segment, in blocks of the smallest object; a live replay's limit is lower, checked later)."""
    from kvpool.sim.cluster import SIM_CAPACITY_BLOCKS_MAX
    from kvpool.sim.trace import BLOCK_TOKENS

    tokens_max = SIM_CAPACITY_BLOCKS_MAX * BLOCK_TOKENS
    if tokens is not None and tokens > tokens_max:
        raise InvalidParams(
            f"{flag} {text}: {tokens} tokens, more than an instance holds (at most {tokens_max} tokens per instance)"
        )


def _runnable(console: Console, configs: list, requests: list, mode: str, is_policy_default: bool) -> list:
    """The configurations to replay, every one checked before the first runs: an impossible
    one found after the others ran lost all their results. With the default policies, one
    that cannot run (belady with local caches and cache-aware routing) is left out, saying
    so; a policy asked for with --policy is an error there.

    Raises:
        InvalidParams: a configuration that cannot run (live: a policy no master runs, or a
            pool over the live replay's memory).
    """
    from kvpool.sim.replay import check_config

    runnable, left_out = [], {}
    for config in configs:
        try:
            check_config(config)
        except InvalidParams as exc:
            if not is_policy_default:
                raise
            left_out[str(exc)] = left_out.get(str(exc), 0) + 1
            continue
        if mode == "live":
            from kvpool.sim.live import check_live_config

            check_live_config(requests, config)
        runnable.append(config)
    for reason, count in left_out.items():
        console.print(f"[dim]left out {count} configuration(s): {reason} (--policy to choose)[/dim]")
    return runnable


def _check_out(out: Path) -> None:
    """Make --out and prove it takes the files, before the replay rather than after it.

    Raises:
        InvalidParams: it is not a directory (or cannot be made one), or cannot be written.
    """
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except FileExistsError:
        raise InvalidParams(f"--out {out}: not a directory") from None
    except OSError as exc:
        raise InvalidParams(f"--out {out}: {(exc.strerror or str(exc)).lower()}") from None
    for name in OUT_FILES:
        if (out / name).is_dir():
            raise InvalidParams(f"--out {out}: {name} is a directory")


# --- the end of `kvpool demo`: a short live replay, pooled vs local caches ------------------

# The trace's last requests reuse each other's blocks the most (earlier ones reuse blocks of
# requests outside any short window), so a short demo replays the tail: 150 requests, 2
# instances of 512 blocks (256K tokens) each. Measured: local 0.22, pooled 0.51 (block hits).
DEMO_REQUESTS = 150
DEMO_INSTANCES = 2
DEMO_CAPACITY_BLOCKS = 512
TRACE_ENV = "KVPOOL_TRACE"


def find_trace() -> Path | None:
    """The FAST'25 trace: $KVPOOL_TRACE, else the shared data folder next to the repository."""
    import os

    candidates = [os.environ.get(TRACE_ENV, "")]
    repo = Path(__file__).resolve().parents[2]
    candidates += [
        str(repo.parent / "shared" / "data" / "synthetic_trace.jsonl"),
        str(repo / "data" / "synthetic_trace.jsonl"),
    ]
    named = os.environ.get(TRACE_ENV, "")
    if named and not Path(named).is_file():  # a typo fell back to the shipped trace without a word
        raise InvalidParams(f"{TRACE_ENV}={named}: no such file")
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def run_demo_replay(console: Console) -> None:
    """Replay the trace's tail live, each instance with its own cache and then all sharing one
    pool, and print both hit rates. Skips (saying why) when no trace is found."""
    import msgspec

    from kvpool.sim import report
    from kvpool.sim.live import replay_live_side_by_side
    from kvpool.sim.replay import ReplayConfig
    from kvpool.sim.trace import BLOCK_TOKENS, load_trace

    trace = find_trace()
    if trace is None:
        console.print(f"[dim]trace replay skipped: no trace found (set {TRACE_ENV}=.../synthetic_trace.jsonl)[/dim]")
        return
    requests = load_trace(trace)[-DEMO_REQUESTS:]
    if not requests:
        raise InvalidParams(f"{trace}: no requests in the trace")
    origin = requests[0].timestamp
    requests = [msgspec.structs.replace(r, timestamp=r.timestamp - origin) for r in requests]
    tokens = report.human_tokens(DEMO_CAPACITY_BLOCKS * BLOCK_TOKENS)
    console.print(
        f"[bold]trace replay[/bold]: the last {len(requests)} requests of {trace.name}, "
        f"{DEMO_INSTANCES} serving instances x {tokens} tokens of KV cache, live processes"
    )
    configs = [
        ReplayConfig(instance_count=DEMO_INSTANCES, capacity_blocks=DEMO_CAPACITY_BLOCKS, sharing=sharing)
        for sharing in ("local", "pooled")
    ]
    local, pooled = replay_live_side_by_side(requests, configs)
    table = Table("caches", "block hit rate", "token hit rate", "prefill saved", "req/s", "lookup+load p50")
    for name, result in (("each instance its own", local), ("one kvpool pool", pooled)):
        table.add_row(
            name, f"{result.block_hit_rate:.3f}", f"{result.token_hit_rate:.3f}",
            f"{report.human_tokens(result.prefill_tokens_saved)} tokens", f"{result.requests_per_s:.0f}",
            f"{result.lookup_load_ms_p50:.2f} ms",
        )  # fmt: skip
    console.print(table)
    if local.block_hit_rate:
        gain = pooled.block_hit_rate / local.block_hit_rate
        console.print(f"[green]pooling the same memory: {gain:.1f}x the hit rate of local caches[/green]")
    else:  # "infx": a trace whose tail reuses nothing locally
        rate = f"{pooled.block_hit_rate:.3f}"
        console.print(f"[green]pooling the same memory: a hit rate of {rate} against none in local caches[/green]")
