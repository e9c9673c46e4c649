"""Trace replay: serving instances reuse KV-cache blocks through kvpool, request by request.

This module is the replay protocol and its accounting, written once for both modes: the
simulation (`SimBackend`: the real MasterService with fake segments, see cluster.py) and the
live replay against real processes (live.py). It is not a serving engine: nothing is computed,
a request only looks up, loads and stores its prompt's blocks, and output tokens are not cached.

One request, served by the instance the router picked (routing.py), does what a serving engine
with a kvpool backend does, in this order:

    1. lookup    longest_prefix(blocks)            -> hit_blocks (the reusable prefix)
    2. load      get_replica_list(blocks[:hit])    (leases; an access for eviction)
    3. store     for the rest, in runs: blocks already cached are touched (get_replica_list),
                 absent ones are put (put_start / put_end), in prompt order

Step 3 touches cached blocks beyond the prefix because the model behind the reference
figures (../shared/data/README.md) inserts every block of a request after its lookup; with
one instance and LRU this protocol reproduces those figures exactly (tests/test_sim_anchor.py).

Two ways to share: "local" gives each instance its own cache (one master and one segment
each: an instance sees only what it stored), "pooled" gives all instances one master with one
segment each (every instance sees every block; a put prefers the writer's own segment). The
capacity is per instance either way, so both configurations own the same memory in all.

Accounting: a block hit is a block of the reusable prefix; token hits are the prompt tokens
those blocks cover (the last block of a prompt may be partial); prefill tokens saved are the
token hits. Bytes are reported at `bytes_per_token` of the model (default 320 KiB, a 70B
model in fp16: 80 layers x 8 KV heads x 128 x 2 (K and V) x 2 bytes): bytes loaded (the
prefix), bytes stored (new blocks), and of each the part that crossed to another instance's
segment (pooled mode only).

A disk tier per instance (`disk_capacity_blocks`) puts a second, slower tier under each
instance's DRAM, as `kvpool node --disk-dir` does: the master offloads what DRAM evicts to the
node's disk and promotes what is read there often back into DRAM (docs/tiers.md). A block
found on disk only is a hit (counted apart: `block_hits_disk`); a block leaves the pool only
when the disk tier evicts it too.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec

from kvpool.config import MasterConfig
from kvpool.errors import InvalidParams
from kvpool.master.eviction import POLICIES, POLICY_DEFAULT, make_policy
from kvpool.sim.belady import BeladyPolicy
from kvpool.sim.cluster import (
    ReadOutcome,
    SimCluster,
    WriteOutcome,
    sim_object_size_bytes,
)
from kvpool.sim.routing import ROUTINGS, Router
from kvpool.sim.trace import BLOCK_TOKENS, TraceRequest, next_uses, unique_block_count

SHARINGS = ("local", "pooled")
# The offline optimum is a simulation-only policy: it reads the trace's future.
POLICY_NAMES = (*POLICIES, "belady")
BYTES_PER_TOKEN_DEFAULT = 320 * 1024
# Reads in a simulation take no time: a read holds its lease for the rest of its millisecond,
# so it cannot be evicted by the request that reads it, and never by a later one.
SIM_LEASE_TTL_MS = 1
PROGRESS_EVERY_REQUESTS = 64
# Keys of blocks, in both modes: the same keys give the same eviction order (ProbationLru's
# ghost filter hashes keys, and its rare false positives must be the same ones).
BLOCK_KEY_PREFIX = "block/"


def human_tokens(tokens: int) -> str:
    """3 significant digits, decimal units: 999,936 tokens (1953 blocks) is "1M"."""
    rounded = float(f"{tokens:.3g}")
    for unit, size in (("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if rounded >= size:
            return f"{rounded / size:g}{unit}"
    return f"{rounded:g}"


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
    """One configuration of a replay (one point of one curve).

    Fields:
        instance_count: serving instances.
        capacity_blocks: blocks each instance contributes (None: unbounded, i.e. every
            distinct block of the trace fits in each instance).
        disk_capacity_blocks: blocks each instance's disk tier holds under its DRAM (0: no
            disk tier).
        sharing: "local" (each instance alone) or "pooled" (one pool of all instances).
        routing: "round-robin", "random" or "cache-aware".
        policy: "probation" (kvpool's default), "lru", or "belady" (simulation only).
        bytes_per_token: KV-cache bytes per token of the model (for reporting).
        evict_watermark_ratio_high: the master's watermark; 1.0 evicts only for room, so that
            the capacity is exactly capacity_blocks (the master's shipped default is 0.9).
        lease_ttl_ms: the master's read lease.
        seed: routing and placement randomness.
        check_every: check the master's invariants after every `check_every` calls (0: only
            at the end).
    """

    instance_count: int = 1
    capacity_blocks: int | None = None
    disk_capacity_blocks: int = 0
    sharing: str = "pooled"
    routing: str = "round-robin"
    policy: str = POLICY_DEFAULT
    bytes_per_token: int = BYTES_PER_TOKEN_DEFAULT
    evict_watermark_ratio_high: float = 1.0
    lease_ttl_ms: int = SIM_LEASE_TTL_MS
    seed: int = 0
    check_every: int = 0

    def __post_init__(self) -> None:
        if self.instance_count <= 0:
            raise InvalidParams(f"instance_count {self.instance_count}: give 1 or more")
        if self.check_every < 0:  # it checked after every call (calls % -1 == 0), slowly
            raise InvalidParams(f"check_every {self.check_every}: give 0 (only at the end) or more")
        if self.capacity_blocks is not None and self.capacity_blocks <= 0:
            raise InvalidParams(f"capacity_blocks {self.capacity_blocks} <= 0")
        if self.disk_capacity_blocks < 0:
            raise InvalidParams(f"disk_capacity_blocks {self.disk_capacity_blocks} < 0")
        if self.sharing not in SHARINGS:
            raise InvalidParams(f"sharing {self.sharing!r} not one of {SHARINGS}")
        if self.routing not in ROUTINGS:
            raise InvalidParams(f"routing {self.routing!r} not one of {ROUTINGS}")
        if self.policy not in POLICY_NAMES:
            raise InvalidParams(f"policy {self.policy!r} not one of {POLICY_NAMES}")
        if self.bytes_per_token <= 0:
            raise InvalidParams(f"bytes_per_token {self.bytes_per_token} <= 0")

    @property
    def label(self) -> str:
        """One curve of a plot: everything but the (DRAM) capacity."""
        disk = f", + disk {human_tokens(self.disk_capacity_blocks * BLOCK_TOKENS)}" if self.disk_capacity_blocks else ""
        if self.instance_count == 1:
            return f"1 instance, {self.policy}{disk}"
        return f"{self.instance_count} x {self.sharing}, {self.routing}, {self.policy}{disk}"

    def master_config(self) -> MasterConfig:
        return MasterConfig(
            lease_ttl_ms=self.lease_ttl_ms, evict_watermark_ratio_high=self.evict_watermark_ratio_high
        )


class ReplayResult(msgspec.Struct, kw_only=True):
    """What one replay measured. Rates are fractions; bytes at the model's bytes per token."""

    mode: str  # "sim" or "live"
    label: str
    instance_count: int
    sharing: str
    routing: str
    policy: str
    capacity_blocks: int  # per instance
    capacity_tokens: int  # per instance
    disk_capacity_blocks: int  # per instance (0: no disk tier)
    pool_capacity_tokens: int  # all instances
    bytes_per_token: int
    requests: int
    blocks: int
    block_hits: int
    block_hit_rate: float
    block_hits_disk: int  # of block_hits: found on a disk tier only
    tokens: int
    token_hits: int
    token_hit_rate: float
    prefill_tokens_saved: int
    loaded_bytes: int
    loaded_bytes_remote: int
    stored_bytes: int
    stored_bytes_remote: int
    blocks_not_stored: int  # no room even after eviction
    evictions: int  # objects that left the pool (from its lowest tier)
    offloads: int  # objects DRAM evicted to a disk tier
    promotions: int  # objects read often on disk, copied back into DRAM
    requests_per_instance: list[int]
    runtime_s: float
    # Live mode only (0 in simulation):
    requests_per_s: float = 0.0
    loaded_bytes_per_s: float = 0.0
    stored_bytes_per_s: float = 0.0
    lookup_load_ms_p50: float = 0.0
    lookup_load_ms_p99: float = 0.0
    request_ms_p50: float = 0.0
    request_ms_p99: float = 0.0
    block_size_bytes_live: int = 0
    read_retries_live: int = 0  # reads whose lease lapsed mid-read, read again


class Backend(Protocol):
    """Where a replay's requests go: a simulated cluster or a live one. `instance` is the
    serving instance in [0, instance_count); keys are the blocks of one request, in order."""

    def advance(self, now_ms: int) -> None: ...
    def longest_prefix(self, instance: int, keys: list[str]) -> int: ...
    def local_prefix(self, instance: int, keys: list[str]) -> int: ...
    def exist(self, instance: int, keys: list[str]) -> list[bool]: ...
    def read(self, instance: int, keys: list[str]) -> ReadOutcome: ...
    def write(self, instance: int, keys: list[str]) -> WriteOutcome: ...
    def evictions(self) -> int: ...
    def tier_counters(self) -> tuple[int, int]: ...


class SimBackend:
    """Simulation: SimClusters (one per instance in "local" sharing, one in "pooled").

    Args:
        config: the replay configuration.
        capacity_blocks: blocks per instance (resolved: never None here).
        object_size_bytes: size of each simulated object (see cluster.py).
    """

    def __init__(self, config: ReplayConfig, capacity_blocks: int, object_size_bytes: int) -> None:
        disk_blocks = config.disk_capacity_blocks
        master_config = config.master_config()
        count = config.instance_count
        self.policies: list[BeladyPolicy] = []

        def policy():
            if config.policy == "belady":
                belady = BeladyPolicy()
                self.policies.append(belady)
                return belady
            return make_policy(config.policy)

        if config.sharing == "local":
            self.clusters = [
                SimCluster(
                    1, capacity_blocks, object_size_bytes, master_config, policy(), config.seed + i,
                    config.check_every, disk_blocks,
                )
                for i in range(count)
            ]  # fmt: skip
            self._where = [(self.clusters[i], 0) for i in range(count)]
        else:
            cluster = SimCluster(
                count, capacity_blocks, object_size_bytes, master_config, policy(), config.seed,
                config.check_every, disk_blocks,
            )  # fmt: skip
            self.clusters = [cluster]
            self._where = [(cluster, i) for i in range(count)]

    def belady_of(self, instance: int) -> BeladyPolicy:
        cluster = self._where[instance][0]
        policy = cluster.policy
        assert isinstance(policy, BeladyPolicy), policy
        return policy

    def advance(self, now_ms: int) -> None:
        for cluster in self.clusters:
            cluster.advance(now_ms)

    def longest_prefix(self, instance: int, keys: list[str]) -> int:
        return self._where[instance][0].longest_prefix(keys)

    def local_prefix(self, instance: int, keys: list[str]) -> int:
        cluster, segment = self._where[instance]
        if len(self.clusters) > 1:
            return cluster.longest_prefix(keys)  # a local cache is all local
        return cluster.local_prefix(keys, segment)

    def exist(self, instance: int, keys: list[str]) -> list[bool]:
        return self._where[instance][0].exist(keys)

    def read(self, instance: int, keys: list[str]) -> ReadOutcome:
        cluster, segment = self._where[instance]
        return cluster.read(keys, segment)

    def write(self, instance: int, keys: list[str]) -> WriteOutcome:
        cluster, segment = self._where[instance]
        return cluster.write(keys, segment)

    def evictions(self) -> int:
        return sum(cluster.evictions for cluster in self.clusters)

    def tier_counters(self) -> tuple[int, int]:
        counts = [cluster.tier_counters() for cluster in self.clusters]
        return sum(offloads for offloads, _ in counts), sum(promotions for _, promotions in counts)

    def check_invariants(self) -> None:
        for cluster in self.clusters:
            cluster.check_invariants()


@dataclasses.dataclass
class _Tally:
    blocks: int = 0
    block_hits: int = 0
    block_hits_disk: int = 0
    tokens: int = 0
    token_hits: int = 0
    tokens_loaded_remote: int = 0
    tokens_stored: int = 0
    tokens_stored_remote: int = 0
    blocks_not_stored: int = 0
    lookup_load_s: list[float] = dataclasses.field(default_factory=list)
    request_s: list[float] = dataclasses.field(default_factory=list)


def resolve_capacity_blocks(requests: Sequence[TraceRequest], capacity_blocks: int | None) -> int:
    """Blocks per instance; unbounded means every distinct block of the trace."""
    if capacity_blocks is not None:
        return capacity_blocks
    return max(1, unique_block_count(requests))


def block_key(prefix: str, block: int) -> str:
    return f"{prefix}{block}"


def check_config(config: ReplayConfig) -> None:
    """Raises InvalidParams for a configuration no replay can run: belady with local caches and
    cache-aware routing (each cache's future depends on routes that depend on the caches)."""
    if config.policy != "belady" or config.sharing != "local" or config.instance_count == 1:
        return
    if Router(config.routing, config.instance_count, random.Random(config.seed)).is_state_dependent:
        raise InvalidParams("belady with local caches needs routes known ahead: not cache-aware")


def replay(
    requests: Sequence[TraceRequest],
    config: ReplayConfig,
    on_progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Replay `requests` (timestamp order) in simulation, on the real master code.

    Args:
        requests: the trace, as load_trace returns it.
        config: instances, capacity, sharing, routing, policy.
        on_progress: called with the count of requests served so far, now and then.

    Raises:
        InvalidParams: a bad configuration (e.g. belady with local caches and cache-aware
            routing: its future depends on the routes).
    """
    capacity_blocks = resolve_capacity_blocks(requests, config.capacity_blocks)
    object_size_bytes = sim_object_size_bytes(capacity_blocks, config.disk_capacity_blocks)
    backend = SimBackend(config, capacity_blocks, object_size_bytes)
    started = time.perf_counter()
    result = run_protocol(requests, config, capacity_blocks, backend, BLOCK_KEY_PREFIX, on_progress, mode="sim")
    backend.check_invariants()
    result.runtime_s = round(time.perf_counter() - started, 3)
    return result


def run_protocol(
    requests: Sequence[TraceRequest],
    config: ReplayConfig,
    capacity_blocks: int,
    backend: Backend,
    key_prefix: str,
    on_progress: Callable[[int], None] | None,
    mode: str,
) -> ReplayResult:
    """Serve every request through `backend` (module docstring) and account for it."""
    check_config(config)
    router = Router(config.routing, config.instance_count, random.Random(config.seed))
    routes: list[int] | None = None
    futures: list[list[int]] | None = None
    if config.policy == "belady":
        assert isinstance(backend, SimBackend), "belady runs in simulation only"
        if config.sharing == "local" and config.instance_count > 1:
            routes = [router.route(_no_prefix) for _ in requests]
            futures = _next_uses_per_instance(requests, routes, config.instance_count)
        else:
            futures = next_uses(requests)
    tally = _Tally()
    per_instance = [0] * config.instance_count
    started = time.perf_counter()
    for index, request in enumerate(requests):
        keys = [block_key(key_prefix, block) for block in request.hash_ids]
        backend.advance(request.timestamp)
        began = time.perf_counter()
        if routes is not None:
            instance = routes[index]
        else:
            instance = router.route(functools.partial(_local_prefix_of, backend, keys))
        per_instance[instance] += 1
        if futures is not None:
            assert isinstance(backend, SimBackend)
            backend.belady_of(instance).announce(
                {
                    key: (future, depth, block)
                    for depth, (key, future, block) in enumerate(zip(keys, futures[index], request.hash_ids))
                }
            )  # fmt: skip
        _serve(backend, instance, request, keys, tally, began)
        if on_progress is not None and (index + 1) % PROGRESS_EVERY_REQUESTS == 0:
            on_progress(index + 1)
    if on_progress is not None:
        on_progress(len(requests))
    elapsed_s = time.perf_counter() - started
    return _result(config, capacity_blocks, len(requests), tally, per_instance, backend, mode, elapsed_s)


def _serve(
    backend: Backend, instance: int, request: TraceRequest, keys: list[str], tally: _Tally, began: float
) -> None:
    hit_count = backend.longest_prefix(instance, keys)
    if hit_count:
        loaded = backend.read(instance, keys[:hit_count])
        hit_count = loaded.leading_count  # live: a block may vanish between lookup and load
        tally.tokens_loaded_remote += sum(request.block_tokens(i) for i in loaded.remote_indexes if i < hit_count)
        tally.block_hits_disk += sum(1 for i in loaded.disk_indexes if i < hit_count)
    lookup_load_s = time.perf_counter() - began
    position = hit_count
    while position < len(keys):  # bounded: every pass consumes at least one key
        flags = backend.exist(instance, keys[position:])
        is_cached = flags[0]
        length = 1
        while length < len(flags) and flags[length] == is_cached:
            length += 1
        run = keys[position : position + length]
        if is_cached:
            backend.read(instance, run)
        else:
            written = backend.write(instance, run)
            # Only what was stored: a put refused for room (NO_AVAILABLE_HANDLE) moved nothing.
            failed = set(written.failed_indexes)
            tally.tokens_stored += sum(request.block_tokens(position + i) for i in range(length) if i not in failed)
            tally.tokens_stored_remote += sum(request.block_tokens(position + i) for i in written.remote_indexes)
            tally.blocks_not_stored += len(failed)
        position += length
    tally.blocks += len(keys)
    tally.block_hits += hit_count
    tally.tokens += request.input_length
    tally.token_hits += request.prefix_tokens(hit_count)
    tally.lookup_load_s.append(lookup_load_s)
    tally.request_s.append(time.perf_counter() - began)


def _no_prefix(instance: int) -> int:
    return 0


def _local_prefix_of(backend: Backend, keys: list[str], instance: int) -> int:
    return backend.local_prefix(instance, keys)


def _next_uses_per_instance(
    requests: Sequence[TraceRequest], routes: list[int], instance_count: int
) -> list[list[int]]:
    """next_uses, restricted to the requests each instance serves (local caches)."""
    never = len(requests)
    following: list[dict[int, int]] = [{} for _ in range(instance_count)]
    result: list[list[int]] = [[] for _ in requests]
    for index in range(len(requests) - 1, -1, -1):
        table = following[routes[index]]
        ids = requests[index].hash_ids
        result[index] = [table.get(block, never) for block in ids]
        for block in ids:
            table[block] = index
    return result


def _percentile_ms(values: list[float], fraction: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return round(values[0] * 1000, 3)
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return round(cuts[min(98, int(fraction * 100) - 1)] * 1000, 3)


def _result(
    config: ReplayConfig,
    capacity_blocks: int,
    request_count: int,
    tally: _Tally,
    per_instance: list[int],
    backend: Backend,
    mode: str,
    elapsed_s: float,
) -> ReplayResult:
    per_token = config.bytes_per_token
    offloads, promotions = backend.tier_counters()
    capacity_tokens = capacity_blocks * BLOCK_TOKENS
    result = ReplayResult(
        mode=mode,
        label=config.label,
        instance_count=config.instance_count,
        sharing=config.sharing,
        routing=config.routing,
        policy=config.policy,
        capacity_blocks=capacity_blocks,
        capacity_tokens=capacity_tokens,
        disk_capacity_blocks=config.disk_capacity_blocks,
        pool_capacity_tokens=capacity_tokens * config.instance_count,
        bytes_per_token=per_token,
        requests=request_count,
        blocks=tally.blocks,
        block_hits=tally.block_hits,
        block_hit_rate=tally.block_hits / tally.blocks if tally.blocks else 0.0,
        block_hits_disk=tally.block_hits_disk,
        tokens=tally.tokens,
        token_hits=tally.token_hits,
        token_hit_rate=tally.token_hits / tally.tokens if tally.tokens else 0.0,
        prefill_tokens_saved=tally.token_hits,
        loaded_bytes=tally.token_hits * per_token,
        loaded_bytes_remote=tally.tokens_loaded_remote * per_token,
        stored_bytes=tally.tokens_stored * per_token,
        stored_bytes_remote=tally.tokens_stored_remote * per_token,
        blocks_not_stored=tally.blocks_not_stored,
        evictions=backend.evictions(),
        offloads=offloads,
        promotions=promotions,
        requests_per_instance=per_instance,
        runtime_s=round(elapsed_s, 3),
    )
    if mode == "live":
        result.requests_per_s = round(request_count / elapsed_s, 1) if elapsed_s else 0.0
        result.lookup_load_ms_p50 = _percentile_ms(tally.lookup_load_s, 0.50)
        result.lookup_load_ms_p99 = _percentile_ms(tally.lookup_load_s, 0.99)
        result.request_ms_p50 = _percentile_ms(tally.request_s, 0.50)
        result.request_ms_p99 = _percentile_ms(tally.request_s, 0.99)
    return result
