"""Live replay: the replay protocol of replay.py against a real local cluster of processes.

Each configuration gets fresh processes on 127.0.0.1 (cli/launcher.py): "pooled" sharing is
one master with one node per serving instance, "local" sharing is one master and one node per
instance. Each instance is a `Store` of this process; its puts prefer its own node's segment.
Every block is a real object of `block_size_bytes` (scaled down from the model's size so that the
whole pool fits in LIVE_MEMORY_BYTES_MAX), whose bytes are derived from its key and checked on
every read, so a wrong byte fails the replay. Requests run one after another in trace order;
`speedup` compresses the trace's clock (0: as fast as the cluster answers).

With a disk tier per instance (`disk_capacity_blocks`), each node gets `--disk-dir` (in the
cluster's temporary directory) and `--disk-size` for that many blocks, and the master offloads
to it as it would in production.

It reports what the simulation reports (hit rates, tokens saved, bytes at the model's size)
plus requests per second, bytes per second actually moved, and latencies (lookup + load, and
the whole request). With the master's watermark at 1.0 (eviction only for room) and a read
lease short enough that only the blocks of the last few requests are leased, the hit rates
equal the simulation's for the same configuration (tests/test_replay_live.py checks this).
Not a load generator: one request at a time, so throughput is the round trips of one client.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import xxhash

from kvpool import limits
from kvpool.cli.launcher import LocalCluster, StartedInContext
from kvpool.client.sync import Store
from kvpool.errors import ErrorCode, InvalidParams, MembershipError, TransferFailed
from kvpool.master.eviction import POLICIES
from kvpool.protocol.messages import TIER_DISK, TIER_DRAM, ReplicateConfig
from kvpool.sim.cluster import ReadOutcome, WriteOutcome, leading_on
from kvpool.sim.replay import (
    BLOCK_KEY_PREFIX,
    ReplayConfig,
    ReplayResult,
    resolve_capacity_blocks,
    run_protocol,
)
from kvpool.sim.trace import TraceRequest

# The nodes of one live replay hold at most this much in all (segments live in /dev/shm; disk
# tiers, in files under the temporary directory, count towards it too).
LIVE_MEMORY_BYTES_MAX = 256 * limits.MIB
LIVE_BLOCK_SIZE_BYTES_MIN = 4 * limits.KIB
LIVE_BLOCK_SIZE_BYTES_MAX = 64 * limits.KIB
# The master's read lease in a live replay. The simulation's reads take no time (a lease of
# 1 ms); live, a lease must outlast the read, yet every block read within the lease is out of
# eviction's reach, which the simulation does not model. 100 ms covers a read of a few MiB
# from shared memory many times over and spans only the last ~10-20 requests; a read that
# outlives it anyway is retried (LIVE_READ_ATTEMPTS_MAX), as an engine would.
LIVE_LEASE_TTL_MS = 100
LIVE_READ_ATTEMPTS_MAX = 3
# A paced replay never sleeps longer than this at once (the trace's longest gap is seconds).
PACING_SLEEP_S_MAX = 5.0
_HEADER_SIZE_BYTES = 16


def live_block_size_bytes(capacity_blocks: int, instance_count: int) -> int:
    """The largest block size (a multiple of a page, at most 64 KiB) at which the pool fits
    in LIVE_MEMORY_BYTES_MAX (`capacity_blocks`: each instance's DRAM and disk tier together).

    Raises:
        InvalidParams: even 4 KiB blocks do not fit (ask for less capacity, or fewer requests).
    """
    blocks = capacity_blocks * instance_count
    size = LIVE_MEMORY_BYTES_MAX // blocks // limits.PAGE_SIZE_BYTES * limits.PAGE_SIZE_BYTES
    size = min(size, LIVE_BLOCK_SIZE_BYTES_MAX)
    if size < LIVE_BLOCK_SIZE_BYTES_MIN:
        raise InvalidParams(
            f"{blocks} blocks of {LIVE_BLOCK_SIZE_BYTES_MIN} bytes exceed the live replay's "
            f"{LIVE_MEMORY_BYTES_MAX >> 20} MiB: lower the capacity or replay fewer requests"
        )
    # A segment is at least SEGMENT_SIZE_BYTES_MIN: grow the blocks of a small pool to fit.
    floor = -(-limits.SEGMENT_SIZE_BYTES_MIN // capacity_blocks)
    floor = -(-floor // limits.PAGE_SIZE_BYTES) * limits.PAGE_SIZE_BYTES
    return max(size, floor)


def block_value(key: str, block_size_bytes: int) -> bytes:
    """The bytes of a block: a 16-byte digest of its key, then zeros (cheap to build and check)."""
    return xxhash.xxh128_digest(key.encode()) + bytes(block_size_bytes - _HEADER_SIZE_BYTES)


class LiveBackend:
    """The replay's Backend over Stores: one per serving instance.

    Args:
        stores: one Store per instance (in "local" sharing, each on its own cluster).
        segment_ids: the segment of each instance's own node.
        disk_segment_ids: the disk tier of each instance's own node (none without).
        is_pooled: whether the stores share one master.
        block_size_bytes: size of every object.
        speedup: trace milliseconds per wall millisecond (0: no pacing).
    """

    def __init__(
        self,
        stores: list[Store],
        segment_ids: list[str],
        is_pooled: bool,
        block_size_bytes: int,
        speedup: float,
        disk_segment_ids: list[str] | None = None,
    ) -> None:
        self._stores = stores
        self._segment_ids = segment_ids
        self._disk_segment_ids = disk_segment_ids or []
        self._is_pooled = is_pooled
        self._block_size_bytes = block_size_bytes
        self._speedup = speedup
        self._configs = [
            ReplicateConfig(replica_num=1, placement="preferred", preferred_segments=[segment_id])
            for segment_id in segment_ids
        ]
        self._started = time.monotonic()
        self._origin_ms: int | None = None  # the first request's timestamp: pacing starts there
        self.read_bytes = 0
        self.written_bytes = 0
        self.read_retries = 0

    def advance(self, now_ms: int) -> None:
        if self._speedup <= 0:
            return
        if self._origin_ms is None:  # a trace's clock need not start at 0 (its tail, a capture)
            self._origin_ms, self._started = now_ms, time.monotonic()
        delay_s = self._started + (now_ms - self._origin_ms) / self._speedup / 1000 - time.monotonic()
        if delay_s > 0:
            time.sleep(min(delay_s, PACING_SLEEP_S_MAX))

    def longest_prefix(self, instance: int, keys: list[str]) -> int:
        return self._stores[instance].longest_prefix(keys)

    def local_prefix(self, instance: int, keys: list[str]) -> int:
        if not self._is_pooled:
            return self._stores[instance].longest_prefix(keys)
        return leading_on(self._stores[instance].query(keys), self._own_segments(instance))

    def exist(self, instance: int, keys: list[str]) -> list[bool]:
        return self._stores[instance].batch_exists(keys)

    def read(self, instance: int, keys: list[str]) -> ReadOutcome:
        store = self._stores[instance]
        values = store.get_batch(keys)
        for _ in range(LIVE_READ_ATTEMPTS_MAX - 1):
            missing = [key for key, value in zip(keys, values) if value is None]
            if not missing or not any(store.batch_exists(missing)):
                break
            # The lease lapsed during the read (a slow moment): read the whole batch again, in
            # the same order, so that eviction order is as if the first read had succeeded.
            self.read_retries += 1
            values = store.get_batch(keys)
        outcome = ReadOutcome()
        is_leading = True
        for key, value in zip(keys, values):
            if value is None:
                is_leading = False
                continue
            if len(value) != self._block_size_bytes or value[:_HEADER_SIZE_BYTES] != xxhash.xxh128_digest(key.encode()):
                raise TransferFailed(f"block {key!r} read back wrong")
            outcome.found_count += 1
            outcome.leading_count += is_leading
            self.read_bytes += len(value)
        if (self._is_pooled or self._disk_segment_ids) and outcome.found_count:
            own, disks = self._own_segments(instance), set(self._disk_segment_ids)
            reply = store.query(keys)
            for index, (code, replicas) in enumerate(zip(reply.codes, reply.replicas)):
                if code != ErrorCode.OK:
                    continue
                if self._is_pooled and all(r.segment_id not in own for r in replicas):
                    outcome.remote_indexes.append(index)
                if disks and all(r.segment_id in disks for r in replicas):
                    outcome.disk_indexes.append(index)
        return outcome

    def _own_segments(self, instance: int) -> set[str]:
        """The segments of instance `instance`'s own node: DRAM, and its disk tier if any."""
        return {self._segment_ids[instance], *self._disk_segment_ids[instance : instance + 1]}

    def write(self, instance: int, keys: list[str]) -> WriteOutcome:
        store = self._stores[instance]
        block_size_bytes = self._block_size_bytes
        codes = store.put_batch(keys, [block_value(key, block_size_bytes) for key in keys], self._configs[instance])
        outcome = WriteOutcome()
        for index, (key, code) in enumerate(zip(keys, codes)):
            if code == ErrorCode.OK:
                outcome.stored_count += 1
                self.written_bytes += block_size_bytes
            elif code == ErrorCode.NO_AVAILABLE_HANDLE:
                outcome.failed_indexes.append(index)
            else:
                raise TransferFailed(f"put {key!r}: {ErrorCode(code).name}")
        if self._is_pooled and outcome.stored_count:
            own = self._segment_ids[instance]
            reply = store.query(keys)
            for index, (code, replicas) in enumerate(zip(reply.codes, reply.replicas)):
                if code == ErrorCode.OK and replicas and replicas[0].segment_id != own:
                    outcome.remote_indexes.append(index)
        return outcome

    def evictions(self) -> int:
        stores = self._stores if not self._is_pooled else self._stores[:1]
        return sum(store.cluster_status().evicted_count for store in stores)

    def tier_counters(self) -> tuple[int, int]:
        stores = self._stores if not self._is_pooled else self._stores[:1]
        offloads = promotions = 0
        for store in stores:
            tiers = {status.tier: status for status in store.cluster_status().tiers}
            offloads += tiers[TIER_DISK].offloads
            promotions += tiers[TIER_DRAM].promotions
        return offloads, promotions


class LiveCluster(StartedInContext):
    """The processes of one configuration (module docstring) and a Store per instance.

    `start()` spawns them (clusters side by side), `stop()` ends every process it started,
    whatever happened; use as a context manager.
    """

    def __init__(self, config: ReplayConfig, capacity_blocks: int, block_size_bytes: int) -> None:
        self.config = config
        self.block_size_bytes = block_size_bytes
        self.disk_size_bytes = config.disk_capacity_blocks * block_size_bytes
        memory = str(capacity_blocks * block_size_bytes)
        master_args = (
            "--evict-watermark-high", str(config.evict_watermark_ratio_high),
            "--lease-ttl-ms", str(max(config.lease_ttl_ms, LIVE_LEASE_TTL_MS)),
            "--eviction-policy", config.policy,
        )  # fmt: skip
        self.is_pooled = config.sharing == "pooled"
        cluster_count = 1 if self.is_pooled else config.instance_count
        nodes_per_cluster = config.instance_count if self.is_pooled else 1
        # Nodes with a disk tier each need their own directory: started with their flags (starters).
        self._nodes_per_cluster = nodes_per_cluster
        node_count = 0 if self.disk_size_bytes else nodes_per_cluster
        self.clusters = [LocalCluster(node_count, memory, master_args=master_args) for _ in range(cluster_count)]
        self.stores: list[Store] = []
        self.segment_ids: list[str] = []
        self.disk_segment_ids: list[str] = []

    def start(self) -> None:
        start_all(self.starters())
        self.bind()

    def starters(self) -> list[Callable[[], None]]:
        """One call per cluster that starts its processes (run them side by side)."""
        return [functools.partial(self._start_cluster, cluster) for cluster in self.clusters]

    def _start_cluster(self, cluster: LocalCluster) -> None:
        cluster.start()
        if self.disk_size_bytes:
            cluster.start_nodes([
                ("--disk-dir", str(cluster.workdir / f"disk{index}"), "--disk-size", str(self.disk_size_bytes))
                for index in range(self._nodes_per_cluster)
            ])  # fmt: skip

    def check_whole(self) -> None:
        """Raises MembershipError: a master or node of the replay exited during it. A node
        killed mid-run left a table of lower hit rates and exit status 0, which read as the
        configuration's."""
        for cluster in self.clusters:
            for process in [*cluster.masters, *cluster.nodes]:
                if not process.is_alive():
                    raise MembershipError(
                        f"{process.name} of the live replay exited (status {process.popen.returncode}) during it: "
                        f"its hit rates are not the configuration's (its log: {process.log_path})"
                    )

    def bind(self) -> None:
        """Open a Store per instance on clusters already started."""
        for instance in range(self.config.instance_count):
            cluster = self.clusters[0] if self.is_pooled else self.clusters[instance]
            node = cluster.nodes[instance if self.is_pooled else 0]
            self.segment_ids.append(node.info["segment_id"])
            if self.disk_size_bytes:
                self.disk_segment_ids.append(node.info["disk_segment_id"])
            self.stores.append(Store(cluster.master_endpoint, token=cluster.client_token))

    def stop(self) -> None:
        for store in self.stores:
            store.close()
        self.stores = []
        for cluster in self.clusters:
            cluster.stop()


def start_all(starters: Sequence[Callable[[], None]]) -> None:
    """Start local clusters side by side (LiveCluster.starters: each is a few process starts,
    mostly imports)."""
    with ThreadPoolExecutor(max_workers=max(1, len(starters))) as pool:
        list(pool.map(lambda start: start(), starters))


def check_live_config(requests: Sequence[TraceRequest], config: ReplayConfig) -> None:
    """Raises InvalidParams for a configuration replay_live cannot run: a policy no master
    process runs (belady), or a pool that does not fit in LIVE_MEMORY_BYTES_MAX."""
    if config.policy not in POLICIES:
        raise InvalidParams(
            f"a master process runs {sorted(POLICIES)} (kvpool master --eviction-policy); "
            f"simulate {config.policy!r} with --mode sim"
        )
    capacity_blocks = resolve_capacity_blocks(requests, config.capacity_blocks)
    live_block_size_bytes(capacity_blocks + config.disk_capacity_blocks, config.instance_count)


def _replay_on(
    requests: Sequence[TraceRequest],
    live: LiveCluster,
    capacity_blocks: int,
    speedup: float,
    on_progress: Callable[[int], None] | None,
) -> ReplayResult:
    backend = LiveBackend(
        live.stores, live.segment_ids, live.is_pooled, live.block_size_bytes, speedup, live.disk_segment_ids
    )
    result = run_protocol(requests, live.config, capacity_blocks, backend, BLOCK_KEY_PREFIX, on_progress, mode="live")
    live.check_whole()
    result.block_size_bytes_live = live.block_size_bytes
    result.read_retries_live = backend.read_retries
    if result.runtime_s:
        result.loaded_bytes_per_s = round(backend.read_bytes / result.runtime_s, 1)
        result.stored_bytes_per_s = round(backend.written_bytes / result.runtime_s, 1)
    return result


def replay_live(
    requests: Sequence[TraceRequest],
    config: ReplayConfig,
    speedup: float = 0.0,
    block_size_bytes: int | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Replay `requests` against fresh local processes (module docstring); stops them all.

    Args:
        requests: the trace (or a prefix of it), in timestamp order.
        config: as for the simulation (policy: one a master process runs, not belady); the
            policy, lease and watermark are passed to the master.
        speedup: trace ms per wall ms (0: as fast as possible).
        block_size_bytes: real bytes per block (None: live_block_size_bytes()).
        on_progress: called with the count of requests served so far.

    Raises:
        InvalidParams: a policy the master process cannot run, or a pool too large.
        ConnectFailed: a process did not start.
        TransferFailed: a block was read back wrong.
        MembershipError: a master or node exited during the replay (LiveCluster.check_whole).
    """
    check_live_config(requests, config)
    capacity_blocks = resolve_capacity_blocks(requests, config.capacity_blocks)
    block_size_bytes = block_size_bytes or live_block_size_bytes(
        capacity_blocks + config.disk_capacity_blocks, config.instance_count
    )
    with LiveCluster(config, capacity_blocks, block_size_bytes) as live:
        return _replay_on(requests, live, capacity_blocks, speedup, on_progress)


def replay_live_side_by_side(
    requests: Sequence[TraceRequest], configs: Sequence[ReplayConfig], speedup: float = 0.0
) -> list[ReplayResult]:
    """Several live replays whose processes all start at once (then replay one at a time):
    the start-up, mostly Python imports, is paid once. All pools together stay within
    LIVE_MEMORY_BYTES_MAX. Raises as replay_live."""
    for config in configs:
        check_live_config(requests, config)
    capacities = [resolve_capacity_blocks(requests, config.capacity_blocks) for config in configs]
    all_blocks = sum(
        (capacity + config.disk_capacity_blocks) * config.instance_count
        for capacity, config in zip(capacities, configs)
    )
    block_size_bytes = min(live_block_size_bytes(capacity, 1) for capacity in capacities)
    block_size_bytes = min(block_size_bytes, live_block_size_bytes(all_blocks, 1))
    if any(capacity * block_size_bytes < limits.SEGMENT_SIZE_BYTES_MIN for capacity in capacities):
        raise InvalidParams("a pool this small needs blocks larger than the others': replay it alone")
    lives = [LiveCluster(config, capacity, block_size_bytes) for config, capacity in zip(configs, capacities)]
    try:
        start_all([start for live in lives for start in live.starters()])
        for live in lives:
            live.bind()
        return [_replay_on(requests, live, capacity, speedup, None) for live, capacity in zip(lives, capacities)]
    finally:
        for live in lives:
            live.stop()
