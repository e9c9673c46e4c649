"""`kvpool bench`: put and get throughput, and one-object get latency, of a running cluster.

An operator's check of a deployment, from the host it runs on, through one Store: it puts
`--total` bytes as objects of `--size` in batches of `--batch` with the zero-copy API, reads
them back into a second buffer, checks every byte, then times gets of one object at a time.

It leaves the cache's own objects alone:
- Its keys (`kvpool-bench/<run id>/...`) are removed after each round, and however the run
  ends: an error, or SIGINT or SIGTERM, which stop the run between two calls, never inside one
  (a put cut in its middle holds its ranges at the master for minutes, pending and then
  quarantined, and a cache evicts for that room).
- Each batch goes to the DRAM segments with the most room left below the eviction watermark
  (placement "preferred"), planned before each round from what the master reports, so that no
  segment passes the watermark; a run that does not fit is refused before anything is
  written. The master evicts segment by segment, so the room of one segment cannot stand in
  for another's, and a batch goes whole to each of its segments: one segment's room bounds
  --batch, and a refusal says the largest that fits. The watermark is the one the master
  reports; writers other than the bench use room meanwhile: what it keeps clear of is the
  room at the start of each round.

The figures are the client's view: a TCP client measures the network and the nodes, a
same-host client (shm, the default) the memory copies. GB/s count each object once, whatever
its replicas. benchmarks/ holds the side-by-side measurements against the machine's limits.
"""

from __future__ import annotations

import contextlib
import heapq
import math
import os
import secrets
import signal
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table

from kvpool import limits
from kvpool.client.sync import Store
from kvpool.config import exact_size
from kvpool.errors import ErrorCode, InvalidParams, KVPoolError, TransferFailed
from kvpool.master.allocator import footprint_bytes
from kvpool.protocol.messages import TIER_DRAM, ClusterStatusReply, ReplicateConfig

KEY_PREFIX = "kvpool-bench/"
# Objects a run may hold: each is a key on the client and a record at the master.
OBJECTS_MAX = 1 << 20
# One-object gets: this many at most, for at most this long.
SINGLE_GETS_MAX = 200
SINGLE_GETS_SECONDS_MAX = 2.0
# The run holds two copies of --total (what it puts, what it reads back): at most this share
# of the machine's memory.
MEMORY_SHARE_MAX = 0.5
# After a round's keys are removed, their room comes back once the nodes acknowledge the
# drops: the next round waits for it this long at most.
ROOM_WAIT_S = 5.0
ROOM_POLL_S = 0.05


@dataclass(frozen=True)
class BenchPlan:
    """What one run moves: `object_count` objects of `object_size` bytes, `batch` a call."""

    object_size: int
    object_count: int
    batch: int
    rounds: int
    replica_num: int

    @property
    def total_bytes(self) -> int:
        return self.object_size * self.object_count

    def batches(self) -> Iterator[tuple[int, int]]:
        """(start, end) of each call's objects."""
        for start in range(0, self.object_count, self.batch):
            yield start, min(start + self.batch, self.object_count)


class Interrupted(Exception):
    """SIGINT or SIGTERM came during the run; it stopped between two calls."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def plan_bench(object_size: int, total_bytes: int, batch: int, rounds: int, replica_num: int) -> BenchPlan:
    """The run the flags ask for (`total_bytes` rounded down to whole objects).

    Raises:
        InvalidParams: a size no object can have, fewer bytes than one object, more objects
            than a run holds, a batch or a replica count the master refuses, or more than this
            machine can hold twice.
    """
    if not 0 < object_size <= limits.OBJECT_SIZE_BYTES_MAX:
        largest = exact_size(limits.OBJECT_SIZE_BYTES_MAX)
        raise InvalidParams(f"--size {exact_size(object_size)}: an object holds 1 byte to {largest}")
    if total_bytes < object_size:
        raise InvalidParams(
            f"--total {exact_size(total_bytes)}: less than one object of --size {exact_size(object_size)}"
        )
    if total_bytes // object_size > OBJECTS_MAX:
        raise InvalidParams(
            f"--total {exact_size(total_bytes)} / --size {exact_size(object_size)}: more than {OBJECTS_MAX:,} "
            "objects; give a larger --size or a smaller --total"
        )
    if not 0 < batch <= limits.BATCH_KEYS_MAX:
        raise InvalidParams(f"--batch {batch}: a batch holds 1 to {limits.BATCH_KEYS_MAX} objects")
    if rounds < 1:
        raise InvalidParams(f"--rounds {rounds}: at least 1")
    if not 1 <= replica_num <= limits.REPLICA_NUM_MAX:
        raise InvalidParams(f"--replicas {replica_num}: 1 to {limits.REPLICA_NUM_MAX}")
    plan = BenchPlan(object_size, total_bytes // object_size, batch, rounds, replica_num)
    memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if 2 * plan.total_bytes > MEMORY_SHARE_MAX * memory_bytes:
        raise InvalidParams(
            f"--total {exact_size(plan.total_bytes)}: the run holds it twice (written, read back), more "
            f"than {MEMORY_SHARE_MAX:.0%} of this machine's {exact_size(memory_bytes)} of memory"
        )
    return plan


def room_below_watermark(status: ClusterStatusReply) -> dict[str, int]:
    """Per active DRAM segment, the bytes it takes before the master starts evicting from it
    (at the master's watermark; the default's, from a master too old to report it)."""
    watermark = status.evict_watermark_high or limits.EVICT_WATERMARK_RATIO_HIGH_DEFAULT
    return {
        s.segment.segment_id: int(s.segment.capacity_bytes * watermark) - s.used_bytes
        for s in status.segments
        if s.segment.tier == TIER_DRAM and s.state == "active"
    }


def place_batches(plan: BenchPlan, room: dict[str, int]) -> list[list[str]]:
    """For each batch, the segments of its replicas: those with the most room left after the
    batches before it, so that none passes the watermark. A batch goes whole to each of its
    segments: the room of one segment, not the cluster's, bounds it.

    Raises:
        InvalidParams: the batches do not fit (said in terms of the flags: what fits instead).
    """
    if not room:
        raise InvalidParams("the cluster has no active DRAM segment to measure")
    if len(room) < plan.replica_num:
        raise InvalidParams(f"--replicas {plan.replica_num}: the cluster has {_segments(len(room))}")
    left = [(-bytes_left, segment_id) for segment_id, bytes_left in room.items()]
    heapq.heapify(left)
    footprint = footprint_bytes(plan.object_size)
    placed: list[list[str]] = []
    for start, end in plan.batches():
        need = footprint * (end - start)
        chosen = [heapq.heappop(left) for _ in range(plan.replica_num)]
        if -chosen[-1][0] < need:
            raise InvalidParams(_batches_do_not_fit(plan, room, footprint, start))
        for bytes_left, segment_id in chosen:
            heapq.heappush(left, (bytes_left + need, segment_id))
        placed.append([segment_id for _, segment_id in chosen])
    return placed


def _batches_do_not_fit(plan: BenchPlan, room: dict[str, int], footprint: int, placed_count: int) -> str:
    """Why place_batches refused, with what to change: the first batch larger than the room of
    the segments it needs (a smaller --batch or --size), or all of them more than the segments
    hold once cut in batches (a smaller --total, or a smaller --batch that leaves less room
    unused). `placed_count`: the objects whose batches fit before the one that did not."""
    # The replica_num-th roomiest segment: each batch needs that many with room for it whole.
    segment_room = max(0, sorted(room.values(), reverse=True)[plan.replica_num - 1])
    if plan.replica_num == 1:
        where = f"each batch goes whole to one segment, and the roomiest has {_mib(segment_room)} there"
    else:
        where = (f"each batch goes whole to one segment per replica, and the {plan.replica_num} roomiest have "
                 f"{_mib(segment_room)} there at least")  # fmt: skip
    where += f" ({_mib(max(0, sum(room.values())))} in all, on {_segments(len(room))})"
    refused = "the run would evict cached objects"
    size = exact_size(plan.object_size)
    if placed_count == 0:  # not even the first batch
        first_batch = min(plan.batch, plan.object_count)
        batch_max = segment_room // footprint
        advice = f"give --batch {batch_max} or less, or a smaller --size" if batch_max else "give a smaller --size"
        return (f"a batch of {first_batch} objects of --size {size} ({exact_size(first_batch * footprint)}) does not "
                f"fit below the eviction watermark: {where}; {refused}: {advice}")  # fmt: skip
    return (f"--total {exact_size(plan.total_bytes)} x {plan.replica_num} replica(s) in batches of {plan.batch} does "
            f"not fit below the eviction watermark: {where}; batches of {plan.batch} fit "
            f"{exact_size(placed_count * plan.object_size)} of --total; {refused}: give a smaller --total, or a "
            "smaller --batch (less room left unused at each segment's end)")  # fmt: skip


def _mib(size_bytes: int) -> str:
    return f"{size_bytes / (1 << 20):.1f} MiB"


def _segments(count: int) -> str:
    return f"{count} DRAM segment{'' if count == 1 else 's'}"


@contextlib.contextmanager
def interrupts_between_calls() -> Iterator[Callable[[], None]]:
    """Within the block, SIGINT and SIGTERM are noted instead of raised; the `check` it yields
    raises Interrupted once one came. A second one raises KeyboardInterrupt at once (a cleanup
    that hangs can still be cut short). Outside the main thread it changes nothing."""
    came: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        if came:
            raise KeyboardInterrupt
        came.append(signum)

    def check() -> None:
        if came:
            raise Interrupted(came[0])

    if threading.current_thread() is not threading.main_thread():
        yield check
        return
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield check
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_bench(store: Store, plan: BenchPlan, console: Console, check: Callable[[], None] = lambda: None) -> dict:
    """Put, get and check `plan` through `store`, `plan.rounds` times, then time one-object
    gets; returns the figures (medians over the rounds, and each round's). `check` is called
    between two calls, and may raise to stop the run. Removes its keys on the way out,
    whatever happens (a key it cannot remove is said, with the command that removes it).

    Raises:
        InvalidParams: the run does not fit the cluster's room (place_batches).
        TransferFailed: a put was refused, or a get missed or read other bytes.
        KVPoolError: the cluster failed the run (the master unreachable, ...).
        Interrupted: `check` raised.
    """
    placement = place_batches(plan, room_below_watermark(store.cluster_status()))  # before the buffers
    prefix = f"{KEY_PREFIX}{secrets.token_hex(4)}/"
    keys = [f"{prefix}{i:08d}" for i in range(plan.object_count)]
    source = np.random.default_rng().integers(0, 256, plan.total_bytes, dtype=np.uint8)
    target = np.zeros_like(source)
    sources = store.register_buffer(source)
    try:
        targets = store.register_buffer(target)
        try:
            return _run_rounds(store, plan, console, check, placement, keys, sources, targets, source, target)
        finally:
            store.unregister_buffer(targets)
    finally:
        store.unregister_buffer(sources)


def _run_rounds(
    store: Store,
    plan: BenchPlan,
    console: Console,
    check: Callable[[], None],
    placement: list[list[str]],
    keys: list[str],
    sources: int,
    targets: int,
    source: np.ndarray,
    target: np.ndarray,
) -> dict:
    size = plan.object_size
    rounds: list[dict[str, float]] = []

    def put(index: int, start: int, end: int) -> None:
        config = ReplicateConfig(
            replica_num=plan.replica_num, placement="preferred", preferred_segments=placement[index]
        )
        addresses = [sources + i * size for i in range(start, end)]
        codes = store.batch_put_from(keys[start:end], addresses, [size] * (end - start), config)
        failed = [ErrorCode(c).name for c in codes if c != ErrorCode.OK]
        if failed:
            raise TransferFailed(f"{len(failed)} of {len(codes)} puts refused: {dict(Counter(failed))}")

    def get(index: int, start: int, end: int) -> None:
        addresses = [targets + i * size for i in range(start, end)]
        got = store.batch_get_into(keys[start:end], addresses, [size] * (end - start))
        missed = [keys[start + i] for i, n in enumerate(got) if n != size]
        if missed:
            raise TransferFailed(f"{len(missed)} of {len(got)} gets missed, the first {missed[0]!r}")

    try:
        for round_index in range(plan.rounds):
            label = f"round {round_index + 1}/{plan.rounds}"
            if round_index:  # the first round's placement was planned before the buffers
                placement = _placement_when_room(store, plan, check)
            put_s = _timed_batches(console, f"{label}: put", plan, put, check)
            get_s = _timed_batches(console, f"{label}: get", plan, get, check)
            if not np.array_equal(source, target):
                raise TransferFailed("a get read back other bytes than were put")
            target.fill(0)  # so that the next round's gets are checked too
            rounds.append({"put_s": put_s, "get_s": get_s})
            if round_index + 1 < plan.rounds:
                _remove(store, keys)
        single_us = _single_gets_us(store, keys, targets, size, check)
        held = _replicas_by_segment(store, keys)
    except BaseException:
        with contextlib.suppress(KVPoolError):  # said below, if it failed; the first error wins
            _remove(store, keys)
        if _left_behind(store, keys):
            _say_left_behind(console, keys)
        raise
    _remove(store, keys)
    return _figures(plan, rounds, single_us, held)


def _placement_when_room(store: Store, plan: BenchPlan, check: Callable[[], None]) -> list[list[str]]:
    """The batches' segments from the room the master reports now. After a round, its removed
    keys' room comes back as their nodes acknowledge the drops: it is waited for, a while."""
    deadline_s = time.monotonic() + ROOM_WAIT_S
    while True:
        try:
            return place_batches(plan, room_below_watermark(store.cluster_status()))
        except InvalidParams:
            if time.monotonic() >= deadline_s:
                raise
        check()
        time.sleep(ROOM_POLL_S)


def _remove(store: Store, keys: list[str]) -> None:
    """Remove the run's keys (with force: those under a lease of its own gets, and any put
    of them still in flight), a batch at a time: the master looks up each key, where a
    pattern would have it scan its whole table."""
    for start in range(0, len(keys), limits.BATCH_KEYS_MAX):
        store.batch_remove(keys[start : start + limits.BATCH_KEYS_MAX], force=True)


def _left_behind(store: Store, keys: list[str]) -> bool:
    """Whether any of the run's keys may still be in the cluster (True when it cannot tell)."""
    try:
        for start in range(0, len(keys), limits.BATCH_KEYS_MAX):
            if any(store.batch_exists(keys[start : start + limits.BATCH_KEYS_MAX])):
                return True
    except KVPoolError:
        return True
    return False


def _say_left_behind(console: Console, keys: list[str]) -> None:
    prefix = keys[0].rsplit("/", 1)[0] + "/"
    console.print(
        f"bench: its objects may be left in the cluster; remove them with "
        f"kvpool rm --regex '^{prefix}' --force",
        markup=False,
    )


def _timed_batches(
    console: Console,
    label: str,
    plan: BenchPlan,
    action: Callable[[int, int, int], None],
    check: Callable[[], None],
) -> float:
    """Seconds `action(index, start, end)` took over the plan's batches, `check` between them
    (untimed). A bar where someone watches; nothing in a log or a pipe."""
    elapsed = 0.0
    with Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task(label, total=plan.object_count)
        for index, (start, end) in enumerate(plan.batches()):
            check()
            started = time.perf_counter()
            action(index, start, end)
            elapsed += time.perf_counter() - started
            progress.advance(task, end - start)
    return elapsed


def _single_gets_us(
    store: Store, keys: list[str], targets: int, size: int, check: Callable[[], None]
) -> list[float]:
    """Latencies of gets of one object, the objects in turn."""
    samples: list[float] = []
    deadline_s = time.perf_counter() + SINGLE_GETS_SECONDS_MAX
    while len(samples) < SINGLE_GETS_MAX and time.perf_counter() < deadline_s:
        check()
        index = len(samples) % len(keys)
        started = time.perf_counter_ns()
        got = store.get_into(keys[index], targets + index * size, size)
        samples.append((time.perf_counter_ns() - started) / 1000)
        if got != size:
            raise TransferFailed(f"a get of {keys[index]!r} missed")
    return samples


def _replicas_by_segment(store: Store, keys: list[str]) -> dict[str, int]:
    held: Counter[str] = Counter()
    for start in range(0, len(keys), limits.BATCH_KEYS_MAX):
        reply = store.query(keys[start : start + limits.BATCH_KEYS_MAX])
        held.update(replica.segment_id for replicas in reply.replicas for replica in replicas)
    return dict(sorted(held.items()))


def _percentile(ordered: list[float], fraction: float) -> float:
    """The nearest-rank percentile of sorted samples."""
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def _figures(plan: BenchPlan, rounds: list[dict[str, float]], single_us: list[float], held: dict) -> dict:
    total, count = plan.total_bytes, plan.object_count

    def rates(phase: str) -> dict[str, float]:
        seconds = [r[f"{phase}_s"] for r in rounds]
        return {
            "gbps": round(total / statistics.median(seconds) / 1e9, 3),
            "objects_per_s": round(count / statistics.median(seconds)),
            "gbps_min": round(total / max(seconds) / 1e9, 3),
            "gbps_max": round(total / min(seconds) / 1e9, 3),
        }

    ordered = sorted(single_us)
    return {
        "object_size_bytes": plan.object_size,
        "objects": count,
        "batch_objects": plan.batch,
        "replica_num": plan.replica_num,
        "rounds": len(rounds),
        "put": rates("put"),
        "get": rates("get"),
        "single_get_us": {
            "count": len(ordered),
            "p50": round(statistics.median(ordered), 1),
            "p99": round(_percentile(ordered, 0.99), 1),
        },
        "replicas_by_segment": held,
        "seconds_per_round": [{k: round(v, 6) for k, v in r.items()} for r in rounds],
    }


def print_figures(figures: dict, console: Console) -> None:
    size, count = figures["object_size_bytes"], figures["objects"]
    console.print(
        f"{count} objects of {exact_size(size)} in batches of {figures['batch_objects']}, "
        f"{figures['replica_num']} replica(s), {figures['rounds']} round(s); medians, the range in brackets"
    )
    table = Table("phase", "GB/s", "objects/s")
    for phase in ("put", "get"):
        r = figures[phase]
        table.add_row(phase, f"{r['gbps']:.2f} ({r['gbps_min']:.2f}-{r['gbps_max']:.2f})", f"{r['objects_per_s']:,}")
    console.print(table)
    single = figures["single_get_us"]
    console.print(f"one-object get: p50 {single['p50']:.0f} µs, p99 {single['p99']:.0f} µs ({single['count']} gets)")
    held = Table("segment", "replicas held")
    for segment_id, replicas in figures["replicas_by_segment"].items():
        held.add_row(escape(segment_id), str(replicas))
    console.print(held)
