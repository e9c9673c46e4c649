"""A simulated cluster: the real `MasterService` with mounted fake segments, driven by a
simulated clock, with nodes that always commit and forget at once. No bytes are moved.

Each segment stands for the DRAM one serving instance contributes, and, when the replay gives
instances a disk tier, a second segment of tier "disk" on the same node stands for its NVMe
(docs/tiers.md). The master code is the production code path for every request a replay
makes (longest_prefix, exist_keys, query_objects, get_replica_list, put_start / put_end /
finish_put_end, tick, heartbeat, take_drops / drops_done, take_moves / finish_moves); what
this module simulates is only what the server and the nodes would do around it:
CommitObjects are acknowledged OK, DropObjects and MoveObjects (offloads to disk, promotions
back to DRAM) are acknowledged OK at once, a put_start that found no room is retried after
its moves and drops, in rounds (as server.py's `_put_start` does), and `tick` runs every
TICK_INTERVAL_MS of simulated time with a heartbeat from every node. It is not a network or
failure simulator.

Every object of a replay is one KV-cache block of `object_size_bytes` (all equal, so that a
segment of `capacity_blocks * object_size_bytes` holds exactly `capacity_blocks` of them: the
size is a multiple of the allocator's 64-byte alignment). Real bytes per block only matter for
reporting, so large models are simulated with small objects at the same block count.
"""

from __future__ import annotations

import dataclasses
import random

import msgspec

from kvpool import limits
from kvpool.config import MasterConfig
from kvpool.errors import ErrorCode, InvalidParams
from kvpool.master.eviction import EvictionPolicy
from kvpool.master.service import MasterService
from kvpool.protocol.messages import (
    TIER_DISK,
    TIER_DRAM,
    ClusterStatus,
    ExistKeys,
    GetReplicaList,
    Heartbeat,
    LongestPrefix,
    MountSegment,
    PutEnd,
    PutStart,
    QueryObjects,
    QueryReply,
    ReplicateConfig,
    SegmentInfo,
)

# The master server ticks every 200 ms (server.py TICK_INTERVAL_MS); nodes heartbeat each second.
TICK_INTERVAL_MS = 200
# Objects of a simulated block: at least this, so that small pools still mount (segments are
# at least limits.SEGMENT_SIZE_BYTES_MIN).
SIM_OBJECT_SIZE_BYTES_MIN = 4 * limits.KIB
# The most objects a simulated segment (a DRAM segment or a disk tier) holds: the largest
# segment the master mounts, in objects of the smallest size (2**35 blocks: 17.6T tokens).
SIM_CAPACITY_BLOCKS_MAX = limits.SEGMENT_SIZE_BYTES_MAX // SIM_OBJECT_SIZE_BYTES_MIN
# Moves finish at once, and may start drops (an offload's source) that let more moves start:
# settle() runs this many rounds at most (one or two suffice).
SETTLE_ROUNDS_MAX = 8
# A simulated jump in time runs at most this many ticks; a longer idle gap is one tick (the
# master's tick does the same work either way: nothing is leased or in flight between requests).
TICKS_PER_ADVANCE_MAX = 64


def sim_object_size_bytes(capacity_blocks: int, disk_capacity_blocks: int = 0) -> int:
    """Object size that lets a segment of `capacity_blocks` objects (and a disk tier of
    `disk_capacity_blocks`, if any) reach the minimum segment size, rounded up to the allocator
    alignment (and a page, so a live node can map it too)."""
    assert capacity_blocks > 0 and disk_capacity_blocks >= 0, (capacity_blocks, disk_capacity_blocks)
    smallest = min(capacity_blocks, disk_capacity_blocks) if disk_capacity_blocks else capacity_blocks
    need = -(-limits.SEGMENT_SIZE_BYTES_MIN // smallest)
    size = max(SIM_OBJECT_SIZE_BYTES_MIN, need)
    return -(-size // limits.PAGE_SIZE_BYTES) * limits.PAGE_SIZE_BYTES


def leading_on(reply: QueryReply, segment_ids: set[str]) -> int:
    """How many leading keys of a query have a replica on one of `segment_ids` (a serving
    instance's own segments: the prefix cache-aware routing counts)."""
    count = 0
    for code, replicas in zip(reply.codes, reply.replicas):
        if code != ErrorCode.OK or all(r.segment_id not in segment_ids for r in replicas):
            break
        count += 1
    return count


@dataclasses.dataclass(slots=True)
class ReadOutcome:
    """Objects found by one get_replica_list: leading run, and where each hit lies."""

    found_count: int = 0  # keys found, anywhere
    leading_count: int = 0  # keys found before the first miss
    remote_indexes: list[int] = dataclasses.field(default_factory=list)  # found on another node only
    disk_indexes: list[int] = dataclasses.field(default_factory=list)  # found on a disk tier only


@dataclasses.dataclass(slots=True)
class WriteOutcome:
    """One put of a run of keys."""

    stored_count: int = 0
    failed_indexes: list[int] = dataclasses.field(default_factory=list)  # no room even after eviction
    remote_indexes: list[int] = dataclasses.field(default_factory=list)  # stored on another segment


class SimCluster:
    """One master, `segment_count` mounted fake segments, and the simulated clock.

    Holds the service and the segment ids, in mount order (segment `i` belongs to serving
    instance `i` of the pool, and so does disk segment `i` when instances have a disk tier:
    both on node `i`). `now_ms` only moves forward (advance); every request goes to
    the service at the current `now_ms`. Puts prefer the writer's own segment
    ("preferred" placement, then random), as an instance that contributes its DRAM would.

    Args:
        segment_count: segments to mount (one per serving instance sharing this master).
        capacity_blocks: objects each segment holds.
        disk_capacity_blocks: objects each instance's disk tier holds (0: no disk tier).
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
        disk_capacity_blocks: int = 0,
    ) -> None:
        if segment_count <= 0 or capacity_blocks <= 0 or disk_capacity_blocks < 0:
            raise InvalidParams(
                f"need segments and capacity: {segment_count} x {capacity_blocks} (disk {disk_capacity_blocks})"
            )
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
        self.disk_segment_ids = [f"sim-disk-{index}" for index in range(segment_count)] if disk_capacity_blocks else []
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
            if disk_capacity_blocks:
                disk = msgspec.structs.replace(
                    info, segment_id=self.disk_segment_ids[index],
                    capacity_bytes=disk_capacity_blocks * object_size_bytes, tier=TIER_DISK,
                )  # fmt: skip
                self.service.mount_segment(MountSegment(disk, []), 0)
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
            self.service.heartbeat(Heartbeat(self.segment_ids + self.disk_segment_ids), tick_ms)
            self.service.tick(tick_ms)
            self._settle(tick_ms)
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
        """Leading keys with a replica on instance `segment_index`'s own segment or disk tier
        (no lease, not an access)."""
        reply = self.service.query_objects(QueryObjects(keys), self.now_ms)
        own = {self.segment_ids[segment_index], *self.disk_segment_ids[segment_index : segment_index + 1]}
        return leading_on(reply, own)

    def read(self, keys: list[str], segment_index: int) -> ReadOutcome:
        """get_replica_list: leases and counts as an access; reads from the nearest replica."""
        reply = self.service.get_replica_list(GetReplicaList(keys), self.now_ms)
        own_node = f"sim-node-{segment_index}"
        segments = reply.segments
        outcome = ReadOutcome()
        is_leading = True
        for index, (code, replicas) in enumerate(zip(reply.codes, reply.replicas)):
            if code != ErrorCode.OK:
                is_leading = False
                continue
            outcome.found_count += 1
            outcome.leading_count += is_leading
            if all(segments[r.segment_id].node_id != own_node for r in replicas):
                outcome.remote_indexes.append(index)
            if all(segments[r.segment_id].tier == TIER_DISK for r in replicas):
                outcome.disk_indexes.append(index)
        self._checked()
        return outcome

    def write(self, keys: list[str], segment_index: int) -> WriteOutcome:
        """The two-phase put of `keys` (absent ones), as a writer on segment `segment_index`:
        put_start, retries of keys without room once the moves and drops in flight are
        acknowledged (rounds, as server.py's `_put_start` does), then put_end and the nodes'
        commits. Returns where the objects landed."""
        service, now_ms = self.service, self.now_ms
        config = self._configs[segment_index]
        sizes = [self.object_size_bytes] * len(keys)
        hostname = f"sim-host-{segment_index}"
        message = PutStart(keys, sizes, config, hostname)
        reply = service.put_start(message, now_ms)
        retry = [i for i, code in enumerate(reply.codes) if code == ErrorCode.NO_AVAILABLE_HANDLE]
        for _ in range(limits.PUT_ROOM_ROUNDS_MAX):
            if not retry or not (service.has_pending_drops() or service.has_unsent_moves()):
                break
            self._settle(now_ms)
            retry = service.put_start_again(message, reply, retry, now_ms)
        service.put_start_settled(reply)
        self._settle(now_ms)
        outcome = WriteOutcome()
        granted: list[str] = []
        own = self.segment_ids[segment_index]
        for index, (key, code) in enumerate(zip(keys, reply.codes)):
            if code == ErrorCode.OK:
                granted.append(key)
                if reply.replicas_of(index)[0][0].segment_id != own:
                    outcome.remote_indexes.append(index)
            elif code == ErrorCode.NO_AVAILABLE_HANDLE:  # everything evictable was leased or pinned
                outcome.failed_indexes.append(index)
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

    def _settle(self, now_ms: int) -> None:
        """Acknowledge every move (OK: the node copied it) and drop the master asked for."""
        service = self.service
        for _ in range(SETTLE_ROUNDS_MAX):
            if not service.has_unsent_moves() and not service.has_pending_drops():
                return
            for segment_id, items in service.take_moves().items():
                service.finish_moves(segment_id, items, [int(ErrorCode.OK)] * len(items), now_ms)
            for segment_id, entries in service.take_drops().items():
                service.drops_done(segment_id, entries, now_ms)

    def tier_counters(self) -> tuple[int, int]:
        """Objects offloaded to a disk tier, and promoted back into DRAM, so far."""
        tiers = {status.tier: status for status in self.service.cluster_status(ClusterStatus(), self.now_ms).tiers}
        return tiers[TIER_DISK].offloads, tiers[TIER_DRAM].promotions

    def _checked(self) -> None:
        if self._check_every:
            self._calls += 1
            if self._calls % self._check_every == 0:
                self.service.check_invariants()

    def check_invariants(self) -> None:
        self.service.check_invariants()
        assert not self.service.has_pending_drops(), "a drop left unacknowledged"
        assert not self.service.has_unsent_moves(), "a move left unacknowledged"
