"""The node's own record of the complete objects in its segment: the truth a master rebuilds from.

`Inventory` maps each key to the `InventoryEntry(key, offset, size, checksum)` of the object
the node holds, and keeps the entries ordered by offset so that an overlap check costs
O(log n). It is a pure core: no I/O, no clocks, no logging. It is not the allocator (the master
owns allocation) and it does not verify bytes (transfer.py checks size and checksum before it
adds an entry).

    segment data area (offsets handed out by the master)
    0                                                                   capacity_bytes
    +--------+-----------+---------------+----------+-------------------+
    | key a  |   free    |     key b     |  key c   |       free        |
    +--------+-----------+---------------+----------+-------------------+
    ^offset a            ^offset b       ^offset c
    entries never overlap; gaps are free or being written (not yet committed)

The master drops an object from the inventory before it reuses its range (DESIGN.md §4), so an
add that overlaps an existing entry should not happen. `add` is defensive anyway: the newer
entry wins and the entries it displaces are returned, for the caller to log.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import pairwise

from sortedcontainers import SortedDict

from kvpool.protocol.messages import InventoryEntry


class Inventory:
    """Complete objects of one segment, by key and by offset.

    Holds `_by_key` (key -> entry) and `_by_offset` (offset -> entry, sorted). Invariants: both
    indexes hold the same entries; every entry has size > 0 and lies in [0, capacity_bytes);
    no two entries overlap; `used_bytes` is the sum of the entries' sizes.
    """

    def __init__(self, capacity_bytes: int) -> None:
        assert capacity_bytes > 0, capacity_bytes
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._by_key: dict[str, InventoryEntry] = {}
        self._by_offset: SortedDict[int, InventoryEntry] = SortedDict()
        self._offsets = self._by_offset.keys()  # a live, indexable sorted view

    def __repr__(self) -> str:
        return (
            f"<Inventory objects={len(self._by_key)} used={self.used_bytes}"
            f"/{self.capacity_bytes} bytes>"
        )

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def __iter__(self) -> Iterator[InventoryEntry]:
        return iter(self._by_offset.values())

    def get(self, key: str) -> InventoryEntry | None:
        return self._by_key.get(key)

    def entries(self) -> list[InventoryEntry]:
        """Every entry, by ascending offset (what a MountSegment carries)."""
        return list(self._by_offset.values())

    def overlapping(self, offset: int, size_bytes: int) -> list[InventoryEntry]:
        """The entries that share at least one byte with [offset, offset + size_bytes).

        O(log n + k): entries never overlap, so at most one starts before `offset` and reaches
        into the range; the others start inside it.
        """
        if size_bytes <= 0:
            return []
        end = offset + size_bytes
        offsets = self._offsets
        index = self._by_offset.bisect_left(offset)
        found = []
        if index > 0:
            entry = self._by_offset[offsets[index - 1]]
            if entry.offset + entry.size > offset:
                found.append(entry)
        while index < len(offsets) and offsets[index] < end:
            found.append(self._by_offset[offsets[index]])
            index += 1
        return found

    def is_range_free(self, offset: int, size_bytes: int) -> bool:
        """True when no complete object lies in [offset, offset + size_bytes)."""
        return not self.overlapping(offset, size_bytes)

    def add(self, entries: Iterable[InventoryEntry]) -> list[InventoryEntry]:
        """Record complete objects, in order; a later entry wins over an earlier one.

        An entry replaces an existing entry with the same key, and displaces every entry whose
        range it overlaps (the master should have dropped those first).

        Args:
            entries: objects whose bytes the caller has verified; each must lie inside the
                segment and have size > 0 (a caller bug otherwise: AssertionError).

        Returns:
            The entries displaced by overlap or by a different offset for the same key
            (re-adding an identical entry displaces nothing).
        """
        entries = list(entries)
        if self._add_fresh_run(entries):
            return []
        displaced: list[InventoryEntry] = []
        for entry in entries:
            assert entry.size > 0, f"inventory entry without bytes: {entry}"
            assert entry.offset >= 0, f"inventory entry before the segment: {entry}"
            assert entry.offset + entry.size <= self.capacity_bytes, (
                f"inventory entry past the segment end {self.capacity_bytes}: {entry}"
            )
            same = self._by_key.get(entry.key)
            if same is not None and same == entry:
                continue
            if same is not None:
                self._remove(same)
                displaced.append(same)
            for old in self.overlapping(entry.offset, entry.size):
                self._remove(old)
                displaced.append(old)
            self._by_key[entry.key] = entry
            self._by_offset[entry.offset] = entry
            self.used_bytes += entry.size
        return displaced

    def _add_fresh_run(self, entries: list[InventoryEntry]) -> bool:
        """The common commit, in one step: new keys at ascending, disjoint offsets over a span
        that holds no entry (a run of keys the master allocated as one range, master/puts.py).
        One overlap check for the span instead of one per entry. False: nothing was added."""
        if not entries:
            return True
        by_key = self._by_key
        span_start = entries[0].offset
        end = span_start
        for entry in entries:
            if entry.offset < end or entry.key in by_key or entry.size <= 0:
                return False
            end = entry.offset + entry.size
        if span_start < 0 or end > self.capacity_bytes or self.overlapping(span_start, end - span_start):
            return False
        if len({entry.key for entry in entries}) != len(entries):
            return False
        for entry in entries:
            by_key[entry.key] = entry
        self._by_offset.update((entry.offset, entry) for entry in entries)
        self.used_bytes += sum(entry.size for entry in entries)
        return True

    def drop(self, entries: Iterable[InventoryEntry]) -> list[InventoryEntry]:
        """Forget objects, matched by key and offset; entries not held are ignored.

        Returns:
            The entries actually removed.
        """
        dropped = []
        for entry in entries:
            held = self._by_key.get(entry.key)
            if held is None or held.offset != entry.offset:
                continue
            self._remove(held)
            dropped.append(held)
        return dropped

    def clear(self) -> None:
        self._by_key.clear()
        self._by_offset.clear()
        self.used_bytes = 0

    def check_invariants(self) -> None:
        """O(n) whole-structure check (STYLE.md): raises AssertionError on a broken invariant."""
        assert len(self._by_key) == len(self._by_offset), (len(self._by_key), len(self._by_offset))
        total = 0
        for offset, entry in self._by_offset.items():
            assert entry.offset == offset, (offset, entry)
            assert self._by_key.get(entry.key) is entry, f"offset index holds a stale {entry}"
            assert entry.size > 0, entry
            assert entry.offset >= 0, entry
            assert entry.offset + entry.size <= self.capacity_bytes, (self.capacity_bytes, entry)
            total += entry.size
        assert total == self.used_bytes, (total, self.used_bytes)
        for a, b in pairwise(self._by_offset.values()):  # entries never overlap
            assert a.offset + a.size <= b.offset, (a, b)

    def _remove(self, entry: InventoryEntry) -> None:
        del self._by_key[entry.key]
        del self._by_offset[entry.offset]
        self.used_bytes -= entry.size
