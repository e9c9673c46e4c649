"""Segments joining and leaving the master: a node's inventory adopted at mount, a segment's
replicas let go at unmount.

This module turns a MountSegment's inventory into replicas of complete objects (checked
against the table, allocated exactly where the node holds them) and takes a segment's replicas
away when it leaves (unmount, TTL, a new incarnation). It holds references only: the registry,
the table, the tier flow and the counters belong to MasterService, which validates requests
and decides when a segment mounts or goes (service.py).

Finding a segment's objects means a pass over the whole table (objects do not list their
segments: that index would cost every object bytes), and the master serves no one while it
runs: 0.3-0.45 s for a segment holding 122k of 1M objects. So when the table holds more keys
than one step looks at (UNMOUNT_SWEEP_KEYS_PER_STEP), a segment with objects leaves in steps
(`leave`, then `sweep_step` between requests): it turns LEAVING at once (no allocations, no
pending put keeps a range there), then each step takes the replicas of a slice of a snapshot
of the table, and the last step unmounts it. The ranges let go meanwhile stay allocated
(Segment.taken): the whole allocator goes with the segment. Until a replica is taken, readers
of an object with a replica elsewhere are still sent to it, as they are during a dead node's
TTL (a failed read is a miss or the next replica); an object with none elsewhere reads as
missing already (Segment.is_readable).

A DRAM segment that goes and may mount again with the same file (its node cut off, or keeping
it for its restart: UnmountSegment.is_kept) leaves fences: the ranges writers may still write
into (its puts in flight, its quarantined ranges), quarantined again until their release times
in the allocator it mounts with again (`fence`), before its inventory is adopted.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvpool import limits
from kvpool.master.counters import MasterCounters
from kvpool.master.membership import Quarantine, Segment, SegmentRegistry, SegmentState
from kvpool.master.metadata import (
    ObjectMeta,
    ObjectTable,
    is_valid_checksum,
    is_valid_key,
    is_valid_size,
    pack_replica,
    replica_segment_index,
)
from kvpool.master.tiers import TierFlow
from kvpool.master.tombstones import Tombstones
from kvpool.protocol.messages import PIN_HARD, PIN_SOFT, TIER_DRAM, InventoryEntry, SegmentInfo


class _Sweep:
    """A leaving segment's progress: the objects still to look at (a snapshot of the table's
    keys and records, taken by the first step; each step takes its slice off the end, so the
    references go a slice at a time too), and the objects left for the last step (a move of
    them in flight holds ranges there)."""

    __slots__ = ("segment", "keys", "metas", "deferred")

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self.keys: list[str] = []
        self.metas: list[ObjectMeta] | None = None
        self.deferred: list[tuple[str, ObjectMeta]] = []


class MountFlow:
    """Adopts inventories and unmounts segments over the master's shared structures."""

    __slots__ = ("_counters", "_registry", "_table", "_tiers", "_tombstones", "_sweeps", "_quarantine",
                 "_release_timeout_ms", "_fences", "_away")  # fmt: skip

    def __init__(
        self,
        registry: SegmentRegistry,
        table: ObjectTable,
        tiers: TierFlow,
        tombstones: Tombstones,
        counters: MasterCounters,
        quarantine: Quarantine,
        release_timeout_ms: int,
    ):
        self._registry = registry
        self._table = table
        self._tiers = tiers
        self._tombstones = tombstones
        self._counters = counters
        self._sweeps: list[_Sweep] = []  # leaving segments, the first being swept
        self._quarantine = quarantine
        self._release_timeout_ms = release_timeout_ms
        # segment id -> (its file's token, [(offset, size, release_ms)]): `fences`.
        self._fences: dict[str, tuple[bytes, dict[int, tuple[int, int]]]] = {}
        # segment id -> (its file's token, objects it went with alone, when they count as lost
        # (0: not set yet)): a node that keeps its segment for its restart brings them back, and
        # they are counted lost only if it does not come back with that file (`fence`,
        # `forget_fences`).
        self._away: dict[str, tuple[bytes, int, int]] = {}

    @property
    def is_sweeping(self) -> bool:
        return bool(self._sweeps)

    @staticmethod
    def is_new_incarnation(old: SegmentInfo, info: SegmentInfo) -> bool:
        """A slower tier mounted again by a new node (a restart with the same directory): the
        same id and token, proven by the directory's identity file, under another node id."""
        return (
            old.tier != TIER_DRAM
            and info.tier == old.tier
            and old.node_id != info.node_id
            and bool(info.shm_token)
            and old.shm_token == info.shm_token
            and old.capacity_bytes == info.capacity_bytes
        )

    def adopt(
        self, segment: Segment, inventory: list[InventoryEntry], soft_pin_expiry_ms: int
    ) -> list[InventoryEntry]:
        """Take a node's inventory entries as replicas on `segment`; returns the rejected ones.
        An object new to the table keeps the pins its entry records (a soft pin until
        `soft_pin_expiry_ms`).

        First every entry is checked against the table (valid fields, no put in flight, same
        size and checksum as the object's other replicas, at most one offset per key here, no
        move of the key in flight into this segment),
        then the survivors' ranges are allocated in one sweep, then the objects are recorded.
        An entry already recorded at the same place is accepted as is (a refresh).
        """
        table = self._table
        rejected: list[InventoryEntry] = []
        candidates: list[InventoryEntry] = []
        first_of_key: dict[str, InventoryEntry] = {}
        repeats: list[tuple[InventoryEntry, InventoryEntry]] = []
        for entry in inventory:
            key, offset, size, checksum = entry.key, entry.offset, entry.size, entry.checksum
            if not is_valid_key(key) or not is_valid_size(size) or type(offset) is not int:
                rejected.append(entry)
                continue
            first = first_of_key.get(key)
            if first is not None:
                if (first.offset, first.size, first.checksum) == (offset, size, checksum):
                    repeats.append((entry, first))  # The same line twice: as its first fares.
                else:
                    rejected.append(entry)
                continue
            meta = table.get(key)
            if not is_valid_checksum(checksum) or key in table.pending:
                rejected.append(entry)  # A put of it in flight would race the node's copy.
            elif meta is not None and (meta.size_bytes != size or meta.checksum != checksum):
                rejected.append(entry)
            else:
                first_of_key[key] = entry
                here = None if meta is None else meta.offset_on(segment.index)
                if here is None:
                    if self._is_moving_into(key, segment):
                        rejected.append(entry)
                    elif meta is not None and len(meta.replica_tuple()) >= limits.REPLICAS_PER_OBJECT_MAX:
                        rejected.append(entry)  # copies enough: what a reply lists per key (messages.py)
                    else:
                        candidates.append(entry)
                elif here != offset:
                    rejected.append(entry)
        results = segment.allocator.allocate_many_at([(entry.offset, entry.size) for entry in candidates])
        for entry, is_allocated in zip(candidates, results):
            if not is_allocated:
                rejected.append(entry)
                continue
            packed = pack_replica(segment.index, entry.offset)
            meta = table.get(entry.key)
            if meta is None:
                is_hard_pinned = bool(entry.pins & PIN_HARD)
                soft_pin_ms = soft_pin_expiry_ms if entry.pins & PIN_SOFT and not is_hard_pinned else 0
                meta = ObjectMeta(entry.size, entry.checksum, packed, soft_pin_ms, is_hard_pinned)
                table.insert(entry.key, meta, (segment.tier,))
            else:
                meta.set_replicas([*meta.replica_tuple(), packed])
                self._tiers.place(entry.key, meta)
            segment.object_count += 1
        if repeats:
            rejected_ids = {id(entry) for entry in rejected}
            rejected.extend(entry for entry, first in repeats if id(first) in rejected_ids)
        return rejected

    def _is_moving_into(self, key: str, segment: Segment) -> bool:
        """Whether a move of `key` in flight writes into `segment`. Its node will record the
        copy under the key there, displacing any other entry of it (one entry per key): an
        entry adopted meanwhile would be listed by the master and held by no node (or twice
        here, should the move add its copy too). Like a put of the key, it waits for the move."""
        move = self._tiers.moves.by_key.get(key)
        return move is not None and any(target is segment for target, _ in move.targets)

    def leave(self, segment: Segment, for_good: bool = False) -> None:
        """Unmount a segment: at once when it holds no object or the table is small, else in
        steps (the module). A segment already leaving is left as it is. `for_good`: it can
        never mount again (a DRAM segment its node unmounted without keeping it: its file is
        gone, and the next start of the node mounts a new id), so nothing it goes with is left behind for its
        return (tombstones.py): the keys lost with a large one took the budget of lost keys
        (LOST_KEYS_MAX) from the disk tiers', whose nodes do come back with them."""
        segment.is_gone_for_good = segment.is_gone_for_good or for_good
        if segment.state is SegmentState.LEAVING:
            return
        if not segment.object_count or len(self._table) <= limits.UNMOUNT_SWEEP_KEYS_PER_STEP:
            self.unmount(segment)
            return
        self._registry.set_leaving(segment)
        segment.taken += self._strip_pending_puts(segment)
        self._sweeps.append(_Sweep(segment))

    def sweep_step(self) -> bool:
        """One step of the first leaving segment's sweep (UNMOUNT_SWEEP_KEYS_PER_STEP keys
        looked at); True while steps remain."""
        keys_max = limits.UNMOUNT_SWEEP_KEYS_PER_STEP
        while self._sweeps:
            sweep = self._sweeps[0]
            segment = sweep.segment
            if self._registry.get(segment.segment_id) is not segment:
                self._sweeps.pop(0)  # unmounted meanwhile (mounted again: service.py)
                continue
            if sweep.metas is None:
                table = self._table
                sweep.keys = [*table.objects, *table.lower]
                sweep.metas = [*table.objects.values(), *table.lower.values()]
                return True
            keys, metas = sweep.keys[-keys_max:], sweep.metas[-keys_max:]
            del sweep.keys[-keys_max:], sweep.metas[-keys_max:]
            self._take_replicas(segment, zip(keys, metas), sweep.deferred)
            if sweep.keys:
                return True
            self._sweeps.pop(0)
            self._take_replicas(segment, sweep.deferred, None)
            self.unmount(segment)  # scans the table only if objects came meanwhile (none should)
            return bool(self._sweeps)
        return False

    def _take_replicas(
        self,
        segment: Segment,
        among: Iterable[tuple[str, ObjectMeta]],
        deferred: list[tuple[str, ObjectMeta]] | None,
    ) -> None:
        """Take the replicas on the leaving `segment` of the objects `among` that have one: an
        object is lost when it was its only one. Their ranges stay allocated, held as taken
        (Segment.taken) until the segment goes. With `deferred`, an object whose move is in
        flight waits there for the last step (the move holds ranges); without, the move's
        ranges here go with the segment."""
        index = segment.index
        lost, kept = self._table.on_segment(index, among)
        if deferred is not None and self._tiers.moves:
            moving = self._tiers.moves
            deferred += [(key, meta) for key, meta in lost + kept if key in moving]
            lost = [(key, meta) for key, meta in lost if key not in moving]
            kept = [(key, meta) for key, meta in kept if key not in moving]
        if deferred is not None:
            segment.taken += [(meta.offset_on(index), meta.size_bytes) for _, meta in lost + kept]  # type: ignore[misc]
        self._let_go(segment, lost, kept)

    def _let_go(
        self, segment: Segment, lost: list[tuple[str, ObjectMeta]], kept: list[tuple[str, ObjectMeta]]
    ) -> None:
        """Objects lose their replica on `segment`: `lost` had no other and go; `kept` live on
        elsewhere. Both are left behind (tombstones.py): its node may come back with them after
        their keys were removed (a remove of a lost key finds none, yet must reach it)."""
        index = segment.index
        segment_id, ttl_ms = segment.segment_id, _tombstone_ttl_ms(segment)
        if lost and not segment.is_gone_for_good:
            self._tombstones.leave_lost(segment_id, _offsets_on(index, lost), ttl_ms)
        if kept and not segment.is_gone_for_good:
            self._tombstones.leave_behind(segment_id, _offsets_on(index, kept), ttl_ms)
        lost_keys = [key for key, _ in lost]
        self._table.remove_many(lost_keys)
        self._tiers.promotions.forget_many(lost_keys)
        if segment.is_kept and lost:  # a node restarting with its DRAM (--keep-ms) brings them back
            token, count, _ = self._away.get(segment.segment_id, (segment.info.shm_token, 0, 0))
            self._away[segment.segment_id] = (token, count + len(lost), 0)
        else:
            self._counters.lost += len(lost)
        for key, meta in kept:
            meta.set_replicas([r for r in meta.replica_tuple() if replica_segment_index(r) != index])
            self._tiers.place(key, meta)
        segment.object_count -= len(lost) + len(kept)

    def _strip_pending_puts(self, segment: Segment) -> list[tuple[int, int]]:
        """Puts in flight lose their ranges on `segment` (kept as fences, with its quarantined
        ranges: _keep_fences); returns them, (offset, size)."""
        ranges: list[tuple[int, int]] = []
        writing: list[tuple[int, int, int]] = []  # (offset, size, release_ms)
        for put in self._table.pending.values():
            if any(seg is segment for seg, _ in put.replicas):
                for seg, offset in put.replicas:
                    if seg is segment:
                        ranges.append((offset, put.size_bytes))
                        writing.append((offset, put.size_bytes, put.start_ms + self._release_timeout_ms))
                put.replicas = [(seg, offset) for seg, offset in put.replicas if seg is not segment]
        self._keep_fences(segment, writing)
        return ranges

    def unmount(self, segment: Segment) -> None:
        """Remove a segment: its replicas vanish (O(n) scan when it holds any object), puts in
        flight lose their ranges there, its quarantine goes with it, and its drops its node has
        not acknowledged become tombstones (tombstones.py), as do the ranges there of moves of
        removed objects; the targets there of the other moves in flight are left behind."""
        ttl_ms = _tombstone_ttl_ms(segment)
        targets, removed = self._tiers.stranded_on(segment)
        if segment.is_gone_for_good:
            targets, removed = [], []  # (drops unacknowledged: not buried either, below)
        elif segment.drops_unsent or segment.drops_sent or removed:
            # Oldest first, as a later tombstone of a key replaces an earlier (its node holds one
            # entry per key, the last written): drops_sent holds those taken before any of
            # drops_unsent was scheduled. A key removed, put again there and removed again,
            # neither drop acknowledged, came back with its newer copy. The ranges of moves
            # cancelled meanwhile, `removed`, last: a key is not put again while its move runs.
            drops = [*segment.drops_sent.values(), *segment.drops_unsent, *removed]
            self._tombstones.bury(segment.segment_id, drops, ttl_ms)
        if targets:  # those of objects lost meanwhile are lost keys, on their budget
            lost: list[tuple[str, int]] = []
            live: list[tuple[str, int]] = []
            for key, offset in targets:
                (live if key in self._table else lost).append((key, offset))
            if lost:
                self._tombstones.leave_lost(segment.segment_id, lost, ttl_ms)
            if live:
                self._tombstones.leave_behind(segment.segment_id, live, ttl_ms)
        index = segment.index
        table = self._table
        if segment.object_count:
            # In bulk (about 2x faster than one by one): 0.3-0.45 s for 122k of 1M objects
            # (benchmarks/master_memory.py); a large table's segments leave in steps instead.
            self._let_go(segment, *table.on_segment(index))
        self._strip_pending_puts(segment)
        segment.object_count = 0
        segment.transition(SegmentState.UNMOUNTED)
        self._registry.remove(segment)


    def _keep_fences(self, segment: Segment, writing: list[tuple[int, int, int]]) -> None:
        """Remember the ranges writers may still write into, of a DRAM segment going whose file
        may mount again (its node cut off, or keeping it for its restart): those of its puts in
        flight (`writing`: offset, size, release time) and its quarantined ranges, each until
        its release time. A same-host writer
        copies into the file itself, and a TCP write's grant stays good under the same segment
        id: the allocator the segment mounts with again would have handed those ranges out
        while such a write may still land (a review's reproduction, helper-150: an object put
        after a node's restart destroyed by a copy granted before it)."""
        if segment.tier != TIER_DRAM or segment.is_gone_for_good:
            return
        token, fences = self._fences.setdefault(segment.segment_id, (segment.info.shm_token, {}))
        if token != segment.info.shm_token:
            self._fences[segment.segment_id] = (segment.info.shm_token, fences := {})
        for offset, size_bytes, release_ms in writing:
            fences[offset] = (size_bytes, release_ms)
        releases = self._quarantine.releases_of(segment) if segment.quarantined else {}
        for offset, size_bytes in segment.quarantined.items():
            fences[offset] = (size_bytes, releases.get(offset, 0))
        if not fences:
            del self._fences[segment.segment_id]

    def fence(self, segment: Segment, now_ms: int) -> None:
        """Quarantine in a segment mounting anew (a new allocator) the ranges `_keep_fences`
        kept of it, until their release times, when it mounts with the same file (token)."""
        token, count, _ = self._away.pop(segment.segment_id, (b"", 0, 0))
        if token != segment.info.shm_token:  # not the file it kept: what it went with is lost
            self._counters.lost += count
        token, fences = self._fences.pop(segment.segment_id, (b"", {}))
        if token != segment.info.shm_token:
            return
        for offset, (size_bytes, release_ms) in sorted(fences.items()):
            if release_ms > now_ms and segment.allocator.allocate_at(offset, size_bytes):
                self._quarantine.add(segment, offset, size_bytes, release_ms)

    def forget_fences(self, now_ms: int) -> None:
        """Forget the fences all of whose ranges are released by `now_ms` (a segment that never
        mounted again), and count lost the objects of a kept segment that did not come back
        while its tombstones last (past the longest keep, limits.KEEP_MS_MAX: its node was
        killed before it kept it, or never started again): the node said it would keep them,
        and may not have (review helper-156)."""
        for segment_id, (_, fences) in list(self._fences.items()):
            if all(release_ms <= now_ms for _, release_ms in fences.values()):
                del self._fences[segment_id]
        for segment_id, (token, count, lost_at_ms) in list(self._away.items()):
            if not lost_at_ms:  # the first tick since it went
                self._away[segment_id] = (token, count, now_ms + limits.TOMBSTONE_DRAM_TTL_MS)
            elif now_ms >= lost_at_ms:
                del self._away[segment_id]
                self._counters.lost += count


def _tombstone_ttl_ms(segment: Segment) -> int:
    """How long what a segment went with is kept: a DRAM segment's id is new at each start of
    its node, so only a node cut off and mounting again meets its tombstones (tombstones.py)."""
    return limits.TOMBSTONE_DRAM_TTL_MS if segment.tier == TIER_DRAM else limits.TOMBSTONE_TTL_MS


def _offsets_on(index: int, objects: list[tuple[str, ObjectMeta]]) -> list[tuple[str, int]]:
    """(key, offset) of the objects' replicas on the segment at `index` (each has one)."""
    return [(key, meta.offset_on(index)) for key, meta in objects]  # type: ignore[misc]
