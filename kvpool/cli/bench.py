"""`kvpool bench`: put and get throughput, and one-object get latency, of a running cluster.

An operator's check of a deployment, from the host it runs on, through one Store: it puts
`--total` bytes as objects of `--size` in batches of `--batch` with the zero-copy API, reads
them back into a second buffer, checks every byte, then times gets of one object at a time.
Each round removes what it wrote before the next, and the run removes its keys however it ends
(`kvpool-bench/<run id>/...`, an error or Ctrl-C included), so the cache's own objects are not
touched. A run that would fill the DRAM tier past the eviction watermark is refused before
anything is written: it would evict cached objects to measure itself.

The figures are the client's view: a TCP client measures the network and the nodes, a
same-host client (shm, the default) the memory copies. benchmarks/ holds the side-by-side
measurements against the machine's own limits.
"""

from __future__ import annotations

import os
import secrets
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table

from kvpool import limits
from kvpool.client.sync import Store
from kvpool.config import exact_size
from kvpool.errors import ErrorCode, InvalidParams, TransferFailed
from kvpool.protocol.messages import TIER_DRAM, ClusterStatusReply, ReplicateConfig

KEY_PREFIX = "kvpool-bench/"
# One-object gets: this many at most, for at most this long.
SINGLE_GETS_MAX = 200
SINGLE_GETS_SECONDS_MAX = 2.0
# The run holds two copies of --total (what it puts, what it reads back): at most this share
# of the machine's memory.
MEMORY_SHARE_MAX = 0.5


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


def plan_bench(object_size: int, total_bytes: int, batch: int, rounds: int, replica_num: int) -> BenchPlan:
    """The run the flags ask for.

    Raises:
        InvalidParams: a size no object can have, fewer bytes than one object, a batch or a
            replica count the master refuses, or more than this machine can hold twice.
    """
    if not 0 < object_size <= limits.OBJECT_SIZE_BYTES_MAX:
        largest = exact_size(limits.OBJECT_SIZE_BYTES_MAX)
        raise InvalidParams(f"--size {exact_size(object_size)}: an object holds 1 byte to {largest}")
    if total_bytes < object_size:
        raise InvalidParams(
            f"--total {exact_size(total_bytes)}: less than one object of --size {exact_size(object_size)}"
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


def dram_room_bytes(status: ClusterStatusReply, watermark: float = limits.EVICT_WATERMARK_RATIO_HIGH_DEFAULT) -> int:
    """Bytes the active DRAM segments take before the master starts evicting (at the default
    watermark: the master's own is not reported)."""
    room = 0
    for segment in status.segments:
        if segment.segment.tier == TIER_DRAM and segment.state == "active":
            room += max(0, int(segment.segment.capacity_bytes * watermark) - segment.used_bytes)
    return room


def check_room(plan: BenchPlan, status: ClusterStatusReply) -> None:
    """Raises InvalidParams when the run would push DRAM past the eviction watermark."""
    needed = plan.total_bytes * plan.replica_num
    room = dram_room_bytes(status)
    if needed > room:
        raise InvalidParams(
            f"--total {exact_size(plan.total_bytes)} x {plan.replica_num} replica(s) is more than the "
            f"cluster's DRAM takes before it evicts ({room >> 20} MiB free below the watermark): the run "
            "would evict cached objects; give a smaller --total"
        )


def run_bench(store: Store, plan: BenchPlan, console: Console) -> dict:
    """Put, get and check `plan` through `store`, `plan.rounds` times, then time one-object
    gets; returns the figures (medians over the rounds, and each round's). Removes its keys
    on the way out, whatever happens.

    Raises:
        TransferFailed: a put was refused or a get missed or read other bytes.
        KVPoolError: the cluster failed the run (the master unreachable, ...).
    """
    run_id = secrets.token_hex(4)
    prefix = f"{KEY_PREFIX}{run_id}/"
    keys = [f"{prefix}{i:08d}" for i in range(plan.object_count)]
    size = plan.object_size
    source = np.random.default_rng().integers(0, 256, plan.total_bytes, dtype=np.uint8)
    target = np.zeros_like(source)
    sources = store.register_buffer(source)
    targets = store.register_buffer(target)
    config = ReplicateConfig(replica_num=plan.replica_num)
    rounds: list[dict[str, float]] = []
    try:
        for round_index in range(plan.rounds):
            label = f"round {round_index + 1}/{plan.rounds}"

            def put(start: int, end: int) -> None:
                codes = store.batch_put_from(
                    keys[start:end], [sources + i * size for i in range(start, end)], [size] * (end - start), config
                )
                failed = [ErrorCode(c).name for c in codes if c != ErrorCode.OK]
                if failed:
                    raise TransferFailed(f"{len(failed)} of {len(codes)} puts refused: {Counter(failed)}")

            def get(start: int, end: int) -> None:
                got = store.batch_get_into(
                    keys[start:end], [targets + i * size for i in range(start, end)], [size] * (end - start)
                )
                missed = [keys[start + i] for i, n in enumerate(got) if n != size]
                if missed:
                    raise TransferFailed(f"{len(missed)} of {len(got)} gets missed, the first {missed[0]!r}")

            put_s = _timed_batches(console, f"{label}: put", plan, put)
            get_s = _timed_batches(console, f"{label}: get", plan, get)
            if not np.array_equal(source, target):
                raise TransferFailed("a get read back other bytes than were put")
            target.fill(0)  # so that the next round's gets are checked too
            rounds.append({"put_s": put_s, "get_s": get_s})
            if round_index + 1 < plan.rounds:
                store.remove_by_regex(f"^{prefix}", force=True)
        single_us = _single_gets_us(store, keys, targets, size)
        placement = _replicas_by_segment(store, keys)
    finally:
        store.remove_by_regex(f"^{prefix}", force=True)
        store.unregister_buffer(sources)
        store.unregister_buffer(targets)
    return _figures(plan, rounds, single_us, placement)


def _timed_batches(console: Console, label: str, plan: BenchPlan, action: Callable[[int, int], None]) -> float:
    # A bar where someone watches; nothing in a log or a pipe.
    with Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task(label, total=plan.object_count)
        started = time.perf_counter()
        for start in range(0, plan.object_count, plan.batch):
            end = min(start + plan.batch, plan.object_count)
            action(start, end)
            progress.advance(task, end - start)
        return time.perf_counter() - started


def _single_gets_us(store: Store, keys: list[str], targets: int, size: int) -> list[float]:
    """Latencies of gets of one object, the objects in turn."""
    samples: list[float] = []
    deadline_s = time.perf_counter() + SINGLE_GETS_SECONDS_MAX
    while len(samples) < SINGLE_GETS_MAX and time.perf_counter() < deadline_s:
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


def _figures(plan: BenchPlan, rounds: list[dict[str, float]], single_us: list[float], placement: dict) -> dict:
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
            "p50": round(ordered[len(ordered) // 2], 1),
            "p99": round(ordered[min(len(ordered) - 1, len(ordered) * 99 // 100)], 1),
        },
        "replicas_by_segment": placement,
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
