"""A simulated cluster: the real `MasterService` with mounted fake segments, driven by a
simulated clock, with nodes that always commit and forget at once. No bytes are moved.

Each segment stands for the DRAM one serving instance contributes. The master code is the
production code path for every request a replay makes (longest_prefix, exist_keys,
query_objects, get_replica_list, put_start / put_end / finish_put_end, tick, heartbeat,
take_drops / drops_done); what this module simulates is only what the server and the nodes
would do around it: CommitObjects are acknowledged OK, DropObjects are acknowledged
immediately, a put_start that found no room is retried once after its drops (as
server.py's `_put_start` does), and `tick` runs every TICK_INTERVAL_MS of simulated time with
a heartbeat from every node. It is not a network or failure simulator.

Every object of a replay is one KV-cache block of `object_size_bytes` (all equal, so that a
segment of `capacity_blocks * object_size_bytes` holds exactly `capacity_blocks` of them: the
size is a multiple of the allocator's 64-byte alignment). Real bytes per block only matter for
reporting, so large models are simulated with small objects at the same block count.
"""

from __future__ import annotations

import dataclasses
import random

from kvpool import limits
from kvpool.config import MasterConfig
from kvpool.errors import ErrorCode, InvalidParams
from kvpool.master.eviction import EvictionPolicy
from kvpool.master.puts import merge_retried
from kvpool.master.service import MasterService
from kvpool.protocol.messages import (
    ExistKeys,
    GetReplicaList,
    Heartbeat,
    LongestPrefix,
    MountSegment,
    PutEnd,
    PutStart,
    QueryObjects,
    ReplicateConfig,
    SegmentInfo,
)

# The master server ticks every 200 ms (server.py TICK_INTERVAL_MS); nodes heartbeat each second.
TICK_INTERVAL_MS = 200
# Objects of a simulated block: at least this, so that small pools still mount (segments are
# at least limits.SEGMENT_SIZE_BYTES_MIN).
SIM_OBJECT_SIZE_BYTES_MIN = 4 * limits.KIB
# A simulated jump in time runs at most this many ticks; a longer idle gap is one tick (the
# master's tick does the same work either way: nothing is leased or in flight between requests).
TICKS_PER_ADVANCE_MAX = 64


def sim_object_size_bytes(capacity_blocks: int) -> int:
    """Object size that lets a segment of `capacity_blocks` objects reach the minimum segment
    size, rounded up to the allocator alignment (and a page, so a live node can map it too)."""
    assert capacity_blocks > 0, capacity_blocks
    need = -(-limits.SEGMENT_SIZE_BYTES_MIN // capacity_blocks)
    size = max(SIM_OBJECT_SIZE_BYTES_MIN, need)
    return -(-size // limits.PAGE_SIZE_BYTES) * limits.PAGE_SIZE_BYTES


@dataclasses.dataclass(slots=True)
class ReadOutcome:
    """Objects found by one get_replica_list: leading run, and where each hit lies."""

    found_count: int = 0  # keys found, anywhere
    leading_count: int = 0  # keys found before the first miss
    remote_indexes: list[int] = dataclasses.field(default_factory=list)  # found on another segment


@dataclasses.dataclass(slots=True)
class WriteOutcome:
    """One put of a run of keys."""

    stored_count: int = 0
    failed_count: int = 0  # no room even after eviction (everything leased or pinned)
    remote_indexes: list[int] = dataclasses.field(default_factory=list)  # stored on another segment


class SimCluster:
    """One master, `segment_count` mounted fake segments, and the simulated clock.

    Holds the service and the segment ids, in mount order (segment `i` belongs to serving
    instance `i` of the pool). `now_ms` only moves forward (advance); every request goes to
    the service at the current `now_ms`. Puts prefer the writer's own segment
    ("preferred" placement, then random), as an instance that contributes its DRAM would.

    Args:
        segment_count: segments to mount (one per serving instance sharing this master).
        capacity_blocks: objects each segment holds.
        object_size_bytes: size of each object (a multiple of the page size).
        config: the master's configuration (leases, watermarks, TTLs).
        policy: the eviction policy; the master's default when None.
        seed: the master's rng (placement).
        check_every: run check_invariants() after every `check_every` calls (0: never).
    """

    def __init__(
        self,
        segment_count: int,
        capacity_blocks: int,
        object_size_bytes: int,
        config: MasterConfig,
        policy: EvictionPolicy | None = None,
        seed: int = 0,
        check_every: int = 0,
    ) -> None:
        if segment_count <= 0 or capacity_blocks <= 0:
            raise InvalidParams(f"need segments and capacity: {segment_count} x {capacity_blocks}")
        if object_size_bytes % limits.PAGE_SIZE_BYTES:
            raise InvalidParams(f"object size {object_size_bytes} not a multiple of a page")
        self.service = MasterService(config, random.Random(seed), None, policy=policy)
        self.policy = policy
        self.object_size_bytes = object_size_bytes
        self.capacity_blocks = capacity_blocks
        self.now_ms = 0
        self._next_tick_ms = TICK_INTERVAL_MS
        self._check_every = check_every
        self._calls = 0
        self.segment_ids = [f"sim-segment-{index}" for index in range(segment_count)]
        self._configs = [
            ReplicateConfig(replica_num=1, placement="preferred", preferred_segments=[segment_id])
            for segment_id in self.segment_ids
        ]
        for index, segment_id in enumerate(self.segment_ids):
            info = SegmentInfo(
                segment_id, f"sim-node-{index}", f"sim-host-{index}", "sim", "", b"sim",
                capacity_blocks * object_size_bytes,
            )  # fmt: skip
            self.service.mount_segment(MountSegment(info, []), 0)
        self._checked()

    def __repr__(self) -> str:
        return f"<SimCluster now={self.now_ms} ms {self.service!r}>"

    @property
    def evictions(self) -> int:
        return self.service.counters.evictions

    def advance(self, now_ms: int) -> None:
        """Move the clock to `now_ms`, running the ticks (and heartbeats) due on the way."""
        if now_ms < self.now_ms:
            raise InvalidParams(f"time goes forward only: {now_ms} < {self.now_ms}")
        ticks = 0
        while self._next_tick_ms <= now_ms:
            ticks += 1
            if ticks > TICKS_PER_ADVANCE_MAX:
                # Idle gap: the remaining ticks would find the same nothing to do.
                self._next_tick_ms = now_ms - now_ms % TICK_INTERVAL_MS
            tick_ms = self._next_tick_ms
            self.service.heartbeat(Heartbeat(self.segment_ids), tick_ms)
            self.service.tick(tick_ms)
            self._ack_drops(tick_ms)
            self._next_tick_ms = tick_ms + TICK_INTERVAL_MS
        self.now_ms = now_ms
        self._checked()

    def longest_prefix(self, keys: list[str]) -> int:
        count = self.service.longest_prefix(LongestPrefix(keys), self.now_ms).count
        self._checked()
        return count

    def exist(self, keys: list[str]) -> list[bool]:
        flags = self.service.exist_keys(ExistKeys(keys), self.now_ms).flags
        self._checked()
        return flags

    def local_prefix(self, keys: list[str], segment_index: int) -> int:
        """Leading keys with a replica on segment `segment_index` (no lease, not an access)."""
        reply = self.service.query_objects(QueryObjects(keys), self.now_ms)
        segment_id = self.segment_ids[segment_index]
        count = 0
        for code, replicas in zip(reply.codes, reply.replicas):
            if code != ErrorCode.OK or all(r.segment_id != segment_id for r in replicas):
                break
            count += 1
        return count

    def read(self, keys: list[str], segment_index: int) -> ReadOutcome:
        """get_replica_list: leases and counts as an access; reads from the nearest replica."""
        reply = self.service.get_replica_list(GetReplicaList(keys), self.now_ms)
        own = self.segment_ids[segment_index]
        outcome = ReadOutcome()
        is_leading = True
        for index, (code, replicas) in enumerate(zip(reply.codes, reply.replicas)):
            if code != ErrorCode.OK:
                is_leading = False
                continue
            outcome.found_count += 1
            outcome.leading_count += is_leading
            if all(r.segment_id != own for r in replicas):
                outcome.remote_indexes.append(index)
        self._checked()
        return outcome

    def write(self, keys: list[str], segment_index: int) -> WriteOutcome:
        """The two-phase put of `keys` (absent ones), as a writer on segment `segment_index`:
        put_start, one retry of keys without room once their drops are acknowledged, then
        put_end and the nodes' commits. Returns where the objects landed."""
        service, now_ms = self.service, self.now_ms
        config = self._configs[segment_index]
        sizes = [self.object_size_bytes] * len(keys)
        hostname = f"sim-host-{segment_index}"
        reply = service.put_start(PutStart(keys, sizes, config, hostname), now_ms)
        retry = [i for i, code in enumerate(reply.codes) if code == ErrorCode.NO_AVAILABLE_HANDLE]
        if retry and service.has_pending_drops():
            self._ack_drops(now_ms)
            again = service.put_start(
                PutStart([keys[i] for i in retry], [sizes[i] for i in retry], config, hostname), now_ms
            )
            merge_retried(reply, again, retry)
        self._ack_drops(now_ms)
        outcome = WriteOutcome()
        granted: list[str] = []
        own = self.segment_ids[segment_index]
        for index, (key, code) in enumerate(zip(keys, reply.codes)):
            if code == ErrorCode.OK:
                granted.append(key)
                if reply.replicas_of(index)[0][0].segment_id != own:
                    outcome.remote_indexes.append(index)
            elif code == ErrorCode.NO_AVAILABLE_HANDLE:
                outcome.failed_count += 1
            else:
                raise AssertionError(f"put_start of an absent key {key!r} answered {ErrorCode(code).name}")
        if granted:
            pending = service.put_end(PutEnd(granted, [1] * len(granted)), now_ms)
            results = {segment_id: [0] * len(entries) for segment_id, entries in pending.commits.items()}
            codes = service.finish_put_end(pending, results, now_ms).codes
            assert all(code == ErrorCode.OK for code in codes), codes
            outcome.stored_count = len(granted)
        self._checked()
        return outcome

    def _ack_drops(self, now_ms: int) -> None:
        service = self.service
        for segment_id, entries in service.take_drops().items():
            service.drops_done(segment_id, entries, now_ms)

    def _checked(self) -> None:
        if self._check_every:
            self._calls += 1
            if self._calls % self._check_every == 0:
                self.service.check_invariants()

    def check_invariants(self) -> None:
        self.service.check_invariants()
        assert not self.service.has_pending_drops(), "a drop left unacknowledged"
