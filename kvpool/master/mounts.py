"""Segments joining and leaving the master: a node's inventory adopted at mount, a segment's
replicas let go at unmount.

This module turns a MountSegment's inventory into replicas of complete objects (checked
against the table, allocated exactly where the node holds them) and takes a segment's replicas
away when it leaves (unmount, TTL, a new incarnation). It holds references only: the registry,
the table, the tier flow and the counters belong to MasterService, which validates requests
and decides when a segment mounts or goes (service.py).
"""

from __future__ import annotations

from kvpool.master.counters import MasterCounters
from kvpool.master.membership import Segment, SegmentRegistry, SegmentState
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
from kvpool.protocol.messages import PIN_HARD, PIN_SOFT, TIER_DRAM, InventoryEntry, SegmentInfo


class MountFlow:
    """Adopts inventories and unmounts segments over the master's shared structures."""

    __slots__ = ("_counters", "_registry", "_table", "_tiers")

    def __init__(self, registry: SegmentRegistry, table: ObjectTable, tiers: TierFlow, counters: MasterCounters):
        self._registry = registry
        self._table = table
        self._tiers = tiers
        self._counters = counters

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
        size and checksum as the object's other replicas, at most one offset per key here),
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

    def unmount(self, segment: Segment) -> None:
        """Remove a segment: its replicas vanish (O(n) scan when it holds any object), puts in
        flight lose their ranges there, its quarantine and drops go with it."""
        index = segment.index
        table = self._table
        if segment.object_count:
            # The master serves no one meanwhile, so in bulk: 0.3-0.45 s for 122k of 1M objects,
            # about 2x faster than removing them one by one (benchmarks/master_memory.py).
            lost, kept = table.on_segment(index)
            table.remove_many(lost)
            self._tiers.promotions.forget_many(lost)
            self._counters.lost += len(lost)
            for key, meta in kept:
                meta.set_replicas([r for r in meta.replica_tuple() if replica_segment_index(r) != index])
                self._tiers.place(key, meta)
        for put in table.pending.values():
            if any(seg is segment for seg, _ in put.replicas):
                put.replicas = [(seg, offset) for seg, offset in put.replicas if seg is not segment]
        segment.object_count = 0
        segment.transition(SegmentState.UNMOUNTED)
        self._registry.remove(segment)
