"""Mounted segments: their state, liveness, and the ranges waiting to be freed on each.

This module is the master's view of membership: which segments are mounted, by which node,
whether they still take allocations (active), only serve reads until a deadline (draining),
or are being unmounted a step at a time (leaving, mounts.py), and when their node last spoke.
Each `Segment` also owns the byte-range accounting that is not an object: its offset
allocator, its quarantined ranges (discarded puts whose writer may still be writing) and its
drops (ranges of removed or evicted objects that its node must forget before they are reused).
It is not where objects live (metadata.py) nor where the decisions are made (service.py).

    segment data area, as the master accounts it (check_invariants proves the tiling):
    |[object replica]|[free]|[pending put]|[quarantined]|[drop sent, not acked]|[move]|...|
     ObjectMeta       allocator  PendingPut  Segment.quarantined  Segment.drops_*   tiers.Move

A segment lives in a tier (SegmentInfo.tier: a DRAM segment, a node's disk tier, the DFS);
only DRAM segments take puts (`active`), the others are filled by moves (tiers.py), and each
tier's active segments are listed apart (`active_by_tier`).
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Iterator

from kvpool.master.allocator import OffsetAllocator, footprint_bytes
from kvpool.master.metadata import SEGMENT_COUNT_MAX, ObjectMeta, replica_segment_index
from kvpool.protocol.messages import TIER_DRAM, TIERS, InventoryEntry, SegmentInfo


class SegmentState(enum.Enum):
    ACTIVE = "active"  # takes allocations and serves reads.
    DRAINING = "draining"  # serves reads until drain_deadline_ms; no new allocations.
    # Unmounted, its replicas being taken away a step at a time (mounts.py): no allocations;
    # until a replica is taken, readers of an object with another replica are still sent to it
    # (as in a dead node's TTL), and an object only here reads as missing (Segment.is_readable).
    LEAVING = "leaving"
    UNMOUNTED = "unmounted"  # gone: its replicas were removed; the record is dead.


_TRANSITIONS: dict[SegmentState, frozenset[SegmentState]] = {
    SegmentState.ACTIVE: frozenset({SegmentState.DRAINING, SegmentState.LEAVING, SegmentState.UNMOUNTED}),
    SegmentState.DRAINING: frozenset({SegmentState.LEAVING, SegmentState.UNMOUNTED}),
    SegmentState.LEAVING: frozenset({SegmentState.UNMOUNTED}),
    SegmentState.UNMOUNTED: frozenset(),
}


class Segment:
    """One mounted segment and the byte ranges of it that are not free.

    Fields: `index` (the small int that packed replicas carry), `info` (as the node sent it),
    `allocator`, `state`, `last_seen_ms` (last mount or heartbeat) and `drain_deadline_ms`
    (both on the master's local monotonic clock: service.py's Clocks),
    `object_count` (complete objects with a replica here), `quarantined` (offset -> size of
    ranges of discarded puts, freed at their release time), `drops_unsent` (entries the node
    must forget, not yet taken by the server), `drops_sent` (offset -> entry, taken but not yet
    acknowledged) and `drop_bytes` (footprint of both, and of the replicas an offload is moving
    out of here: `leaving_bytes`; eviction counts all of them as room already coming). Every
    allocated byte belongs to exactly one of: an object replica, a pending put, a quarantined
    range, a drop, a move's range (tiers.py), a range a LEAVING segment let go (`taken`).
    """

    __slots__ = (
        "index",
        "tier",
        "leaving_bytes",
        "info",
        "allocator",
        "state",
        "last_seen_ms",
        "drain_deadline_ms",
        "object_count",
        "quarantined",
        "quarantined_bytes",
        "drops_unsent",
        "drops_sent",
        "drop_bytes",
        "taken",
        "is_reachable",
        "has_whole_inventory",
        "is_gone_for_good",
        "is_kept",
    )

    def __init__(self, index: int, info: SegmentInfo, allocator: OffsetAllocator, heard_ms: int):
        self.index = index
        self.tier = info.tier
        self.leaving_bytes = 0
        self.info = info
        self.allocator = allocator
        self.state = SegmentState.ACTIVE
        self.last_seen_ms = heard_ms
        self.drain_deadline_ms = 0
        self.object_count = 0
        self.quarantined: dict[int, int] = {}
        self.quarantined_bytes = 0
        self.drops_unsent: list[InventoryEntry] = []
        self.drops_sent: dict[int, InventoryEntry] = {}
        self.drop_bytes = 0
        self.taken: list[tuple[int, int]] = []  # (offset, size) of replicas a LEAVING one let go
        # Whether the master holds a connection to the node (see SegmentRegistry.set_reachable).
        self.is_reachable = True
        # Whether its node's inventory came whole (SegmentRegistry.set_inventory_whole).
        self.has_whole_inventory = True
        # Leaving, and never to mount again (MountFlow.leave): nothing is left behind for it.
        self.is_gone_for_good = False
        # Its node keeps a DRAM segment for its restart (DrainSegment.is_kept): not gone for good.
        self.is_kept = False

    @property
    def segment_id(self) -> str:
        return self.info.segment_id

    @property
    def is_active(self) -> bool:
        return self.state is SegmentState.ACTIVE

    @property
    def is_mounted(self) -> bool:
        return self.state is not SegmentState.UNMOUNTED

    @property
    def takes_new_replicas(self) -> bool:
        """ACTIVE, reachable, its inventory whole: puts and offloads may be placed here."""
        return self.state is SegmentState.ACTIVE and self.is_reachable and self.has_whole_inventory

    @property
    def is_readable(self) -> bool:
        """Its replicas can be read: the master holds its node's connection, and it is not
        leaving (its replicas about to go). Readers of an object with a replica elsewhere are
        still sent to one that is not (they find out for themselves); an object with none
        elsewhere reads as missing (MasterService.exist_keys) and a put of it writes it anew
        (PutFlow.start)."""
        return self.is_reachable and self.state is not SegmentState.LEAVING

    @property
    def status(self) -> str:
        """The state as operators see it: an ACTIVE or DRAINING segment whose node's
        connection is lost (before the node TTL decides) reads "unreachable": its replicas
        cannot be read, which matters more than whether it takes puts."""
        if self.is_reachable or self.state is SegmentState.LEAVING or self.state is SegmentState.UNMOUNTED:
            return self.state.value
        return "unreachable"

    def transition(self, to: SegmentState) -> None:
        assert to in _TRANSITIONS[self.state], f"segment {self.segment_id}: {self.state} -> {to}"
        self.state = to

    # --- quarantine: ranges of discarded puts ---------------------------------------------

    def quarantine(self, offset: int, size_bytes: int) -> None:
        assert offset not in self.quarantined, f"{self.segment_id}: quarantine twice at {offset}"
        self.quarantined[offset] = size_bytes
        self.quarantined_bytes += self.allocator.footprint_bytes(size_bytes)

    def release(self, offset: int) -> None:
        """Free a quarantined range: its writer's grant has long expired."""
        size_bytes = self.quarantined.pop(offset)
        self.quarantined_bytes -= self.allocator.footprint_bytes(size_bytes)
        self.allocator.free(offset, size_bytes)

    # --- drops: ranges of removed objects, freed once the node forgot them ---------------

    def schedule_drop(self, entry: InventoryEntry) -> None:
        self.drops_unsent.append(entry)
        self.drop_bytes += self.allocator.footprint_bytes(entry.size)

    def take_drops(self) -> list[InventoryEntry]:
        entries = self.drops_unsent
        self.drops_unsent = []
        for entry in entries:
            assert entry.offset not in self.drops_sent, f"{self.segment_id}: drop twice at {entry.offset}"
            self.drops_sent[entry.offset] = entry
        return entries

    def finish_drops(self, entries: list[InventoryEntry]) -> int:
        """The node forgot these entries: free their ranges (adjacent ones at once). An entry
        that matches no drop sent and not yet acknowledged is ignored, so a repeated ack never
        frees twice. Returns how many were freed."""
        sent_drops, footprint = self.drops_sent, self.allocator.footprint_bytes
        freed: list[tuple[int, int]] = []
        for entry in entries:
            sent = sent_drops.get(entry.offset)
            if sent is None or sent.key != entry.key or sent.size != entry.size:
                continue
            del sent_drops[entry.offset]
            self.drop_bytes -= footprint(sent.size)
            freed.append((sent.offset, sent.size))
        self.allocator.free_many(freed)
        return len(freed)

    # --- replicas moving out (an offload in flight) ----------------------------------------

    def start_leaving(self, size_bytes: int) -> None:
        footprint = self.allocator.footprint_bytes(size_bytes)
        self.leaving_bytes += footprint
        self.drop_bytes += footprint

    def end_leaving(self, size_bytes: int) -> None:
        footprint = self.allocator.footprint_bytes(size_bytes)
        self.leaving_bytes -= footprint
        self.drop_bytes -= footprint
        assert self.leaving_bytes >= 0, self

    def iter_held_ranges(self) -> Iterator[tuple[int, int]]:
        """(offset, size_bytes) of the quarantined and dropped ranges, and of the replicas a
        leaving segment let go (allocated until it goes: nothing allocates there)."""
        yield from self.taken
        yield from self.quarantined.items()
        for entry in self.drops_unsent:
            yield entry.offset, entry.size
        for entry in self.drops_sent.values():
            yield entry.offset, entry.size

    def check_invariants(self, object_ranges: list[tuple[int, int]]) -> None:
        """O(r log r): the object and pending-put ranges given, plus this segment's quarantined
        ranges, drops and free extents, tile the data area exactly; the byte counts agree."""
        allocator = self.allocator
        allocator.check_invariants()
        assert self.quarantined_bytes == sum(footprint_bytes(size) for size in self.quarantined.values()), (
            self
        )
        drop_sizes = [entry.size for entry in self.drops_unsent]
        drop_sizes += [entry.size for entry in self.drops_sent.values()]
        assert self.drop_bytes == sum(footprint_bytes(size) for size in drop_sizes) + self.leaving_bytes, self
        pieces = [(offset, footprint_bytes(size), True) for offset, size in object_ranges]
        pieces += [(offset, footprint_bytes(size), True) for offset, size in self.iter_held_ranges()]
        used_bytes = sum(size for _, size, _ in pieces)
        assert used_bytes == allocator.used_bytes, (self, used_bytes)
        pieces += [(offset, size, False) for offset, size in allocator.iter_free_extents()]
        pieces.sort()
        end = 0
        for offset, size, is_used in pieces:
            assert offset == end, f"{self}: gap or overlap at {offset} (expected {end}, used={is_used})"
            end = offset + size
        assert end == allocator.capacity_bytes, (self, end)

    def __repr__(self) -> str:
        return (
            f"<Segment {self.segment_id!r} #{self.index} {self.state.value} "
            f"objects={self.object_count} used={self.allocator.used_bytes}/"
            f"{self.allocator.capacity_bytes} quarantined={self.quarantined_bytes} "
            f"drops={self.drop_bytes}>"
        )


class Quarantine:
    """When each quarantined range may be freed: a heap of (release_ms, seq, segment, offset).

    A discarded put's writer may still hold an unexpired grant, so its ranges are freed only
    at put_start + put_release_timeout_ms. Entries of a segment unmounted meanwhile are
    skipped when they come due (the ranges went with the segment). A range is released only
    through its own entry, so an entry never frees a later quarantine at the same offset.
    """

    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Segment, int]] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, segment: Segment, offset: int, size_bytes: int, release_ms: int) -> None:
        segment.quarantine(offset, size_bytes)
        self._seq += 1
        heapq.heappush(self._heap, (release_ms, self._seq, segment, offset))

    def releases_of(self, segment: Segment) -> dict[int, int]:
        """offset -> release time of `segment`'s quarantined ranges. O(q)."""
        return {offset: release_ms for release_ms, _, quarantined, offset in self._heap if quarantined is segment}

    def release_due(self, now_ms: int) -> int:
        """Free every range due by `now_ms`; returns how many. O(due log q)."""
        heap = self._heap
        count = 0
        while heap and heap[0][0] <= now_ms:
            _, _, segment, offset = heapq.heappop(heap)
            if segment.is_mounted:
                segment.release(offset)
                count += 1
        return count

    def check_invariants(self, registry: SegmentRegistry) -> None:
        """Every quarantined range of a mounted segment has exactly one entry here."""
        live = [(segment.index, offset) for _, _, segment, offset in self._heap if segment.is_mounted]
        assert len(set(live)) == len(live), "two quarantine entries for one range"
        assert len(live) == sum(len(segment.quarantined) for segment in registry), len(live)
        for index, offset in live:
            assert offset in registry.by_index(index).quarantined, (index, offset)


class SegmentRegistry:
    """Every mounted segment by id and by index, and the active ones for placement.

    Holds `_by_id`, `_by_index` (a list with None holes; freed indexes are reused), `active`
    (the ACTIVE DRAM segments whose node is reachable, in mount order: where puts go),
    `active_by_hostname` (the same, by host), `active_by_tier` (the ACTIVE reachable segments
    of each tier: where offloads go), `_active_by_node` (node id and tier -> its ACTIVE
    reachable segment: where a node's offloads and promotions go) and `_unreadable_indexes`
    (of the segments not is_readable: an object only there is missing). Invariants: the maps
    agree with one another; no UNMOUNTED segment is registered; `active` is exactly the ACTIVE
    reachable DRAM ones. Mount, unmount, drain and a lost node connection are rare, so the
    placement views are rebuilt (O(s)) at the first look after a change: rebuilt at each
    change, the mounts of s segments cost O(s^2) (a master whose 3,000 segments re-mount, a
    replay of 3,000 instances: 85 s).
    """

    __slots__ = (
        "_by_id", "_by_index", "_free_indexes", "_active", "_active_by_hostname", "_active_by_tier",
        "_active_by_node", "_capacity_max", "_unreadable_indexes", "_is_stale",
    )  # fmt: skip

    def __init__(self) -> None:
        self._by_id: dict[str, Segment] = {}
        self._by_index: list[Segment | None] = []
        self._free_indexes: list[int] = []
        self._active: list[Segment] = []
        self._active_by_hostname: dict[str, list[Segment]] = {}
        self._active_by_tier: dict[str, list[Segment]] = {tier: [] for tier in TIERS}
        self._active_by_node: dict[tuple[str, str], Segment] = {}
        self._capacity_max = 0
        self._unreadable_indexes: frozenset[int] = frozenset()  # of the segments not is_readable
        self._is_stale = False  # the views above are rebuilt before they are next read

    @property
    def active(self) -> list[Segment]:
        if self._is_stale:
            self._rebuild_views()
        return self._active

    @property
    def active_by_hostname(self) -> dict[str, list[Segment]]:
        if self._is_stale:
            self._rebuild_views()
        return self._active_by_hostname

    @property
    def active_by_tier(self) -> dict[str, list[Segment]]:
        if self._is_stale:
            self._rebuild_views()
        return self._active_by_tier

    @property
    def capacity_max(self) -> int:
        """Of the `active` segments: a larger object fits in none of them."""
        if self._is_stale:
            self._rebuild_views()
        return self._capacity_max

    @property
    def has_unreadable(self) -> bool:
        """Whether a segment is not readable (Segment.is_readable): only then does a put of a
        complete key, or a lookup of one, look at where its replicas are (a put_start of 128
        existing keys took 170 us instead of 38 when each looked)."""
        if self._is_stale:
            self._rebuild_views()
        return bool(self._unreadable_indexes)

    def has_readable_replica(self, meta: ObjectMeta) -> bool:
        """Whether a replica of the object lies on a readable segment (Segment.is_readable).
        Always true unless `has_unreadable`, so hot paths ask that once first."""
        if self._is_stale:
            self._rebuild_views()
        unreadable = self._unreadable_indexes
        replicas = meta.replicas
        if type(replicas) is int:  # one replica: the common case
            return replica_segment_index(replicas) not in unreadable
        return any(replica_segment_index(packed) not in unreadable for packed in replicas)

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Segment]:
        return iter(list(self._by_id.values()))

    def get(self, segment_id: str) -> Segment | None:
        return self._by_id.get(segment_id)

    def by_index(self, index: int) -> Segment:
        segment = self._by_index[index]
        assert segment is not None, f"no segment at index {index}"
        return segment

    def is_full(self) -> bool:
        return len(self._by_id) >= SEGMENT_COUNT_MAX

    def add(self, info: SegmentInfo, allocator: OffsetAllocator, heard_ms: int) -> Segment:
        assert info.segment_id not in self._by_id, f"segment {info.segment_id} mounted twice"
        assert not self.is_full(), "too many segments"
        if self._free_indexes:
            index = self._free_indexes.pop()
        else:
            index = len(self._by_index)
            self._by_index.append(None)
        segment = Segment(index, info, allocator, heard_ms)
        self._by_index[index] = segment
        self._by_id[info.segment_id] = segment
        self._is_stale = True
        return segment

    def remove(self, segment: Segment) -> None:
        """Forget an unmounted segment; the caller already removed every reference to its index."""
        assert segment.state is SegmentState.UNMOUNTED, segment
        assert self._by_id.get(segment.segment_id) is segment, segment
        del self._by_id[segment.segment_id]
        self._by_index[segment.index] = None
        self._free_indexes.append(segment.index)
        self._is_stale = True

    def set_leaving(self, segment: Segment) -> None:
        segment.transition(SegmentState.LEAVING)
        self._is_stale = True

    def set_reachable(self, segment: Segment, is_reachable: bool) -> bool:
        """Whether the master holds a connection to the segment's node. An unreachable one
        keeps its state and its replicas (the node TTL decides whether it is gone; a node that
        reconnects speaks again within a heartbeat), but leaves the placement views: a put
        placed there, or an offload, would wait on a node that may be dead, and the room its
        unacknowledged drops would free is not coming until it is back. Returns whether that
        changed anything."""
        if segment.is_reachable == is_reachable:
            return False
        segment.is_reachable = is_reachable
        self._is_stale = True
        return True

    def set_inventory_whole(self, segment: Segment, is_whole: bool) -> None:
        """Whether the node's inventory of the segment has come whole (MountSegment.is_last).
        Until it has, nothing is placed there: a range the node has not reported yet may hold
        an object, and a put granted there would be refused by the node (and the object
        rejected when its entry came)."""
        if segment.has_whole_inventory != is_whole:
            segment.has_whole_inventory = is_whole
            self._is_stale = True

    def set_draining(self, segment: Segment, deadline_ms: int) -> None:
        if segment.state is SegmentState.ACTIVE:
            segment.transition(SegmentState.DRAINING)
        segment.drain_deadline_ms = deadline_ms
        self._is_stale = True

    def replace_info(self, segment: Segment, info: SegmentInfo) -> None:
        assert info.segment_id == segment.segment_id, (info.segment_id, segment.segment_id)
        segment.info = info
        self._is_stale = True

    def active_of_node(self, node_id: str, tier: str) -> Segment | None:
        """The node's ACTIVE segment in `tier` whose node is reachable, if any (a node mounts
        one per tier)."""
        if self._is_stale:
            self._rebuild_views()
        return self._active_by_node.get((node_id, tier))

    def check_invariants(self) -> None:
        count = 0
        for index, segment in enumerate(self._by_index):
            if segment is None:
                assert index in self._free_indexes, index
                continue
            count += 1
            assert segment.index == index, (segment, index)
            assert self._by_id.get(segment.segment_id) is segment, segment
            assert segment.is_mounted, segment
        assert count == len(self._by_id), (count, len(self._by_id))
        assert len(set(self._free_indexes)) == len(self._free_indexes), self._free_indexes
        active = [seg for seg in self._by_id.values() if seg.takes_new_replicas and seg.tier == TIER_DRAM]
        assert active == self.active, (active, self.active)
        for tier, segments in self.active_by_tier.items():
            assert segments == [s for s in self._by_id.values() if s.takes_new_replicas and s.tier == tier], tier
        unreadable = frozenset(s.index for s in self._by_id.values() if not s.is_readable)
        assert self.has_unreadable == bool(unreadable), unreadable
        assert self._unreadable_indexes == unreadable, (self._unreadable_indexes, unreadable)
        by_host = sum(len(segs) for segs in self.active_by_hostname.values())
        assert by_host == len(active), (by_host, len(active))
        for hostname, segments in self.active_by_hostname.items():
            for segment in segments:
                assert segment.info.hostname == hostname and segment.takes_new_replicas, segment

    def _rebuild_views(self) -> None:
        by_tier: dict[str, list[Segment]] = {tier: [] for tier in TIERS}
        by_node: dict[tuple[str, str], Segment] = {}
        for seg in self._by_id.values():
            if seg.takes_new_replicas:
                by_tier.setdefault(seg.tier, []).append(seg)
                by_node[(seg.info.node_id, seg.tier)] = seg
        self._active_by_tier = by_tier
        self._active_by_node = by_node
        self._active = by_tier[TIER_DRAM]
        self._capacity_max = max((segment.allocator.capacity_bytes for segment in self._active), default=0)
        self._unreadable_indexes = frozenset(seg.index for seg in self._by_id.values() if not seg.is_readable)
        by_host: dict[str, list[Segment]] = {}
        for segment in self._active:
            by_host.setdefault(segment.info.hostname, []).append(segment)
        self._active_by_hostname = by_host
        self._is_stale = False
