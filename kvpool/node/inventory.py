"""The node's own record of the complete objects in its segment: the truth a master rebuilds from.

`Inventory` maps each key to the `InventoryEntry(key, offset, size, checksum)` of the object
the node holds, and keeps the entries ordered by offset, in runs, so that an overlap check
costs O(log n). It is a pure core: no I/O, no clocks, no logging. It is not the allocator (the master
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

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator
from itertools import pairwise
from operator import attrgetter

from sortedcontainers import SortedDict

from kvpool import limits
from kvpool.protocol.messages import InventoryEntry

# Most commits are runs of keys the master allocated as one range (master/puts.py): such a run
# enters the offset index as one item, not one per entry (a sorted insert costs 1-3 µs in
# Python; a 4 KiB put paid it per key). A run is split into spans of at most this many entries,
# so that dropping its entries one by one moves few pointers.
SPAN_ENTRIES_MAX = 256

_offset_of = attrgetter("offset")


def _contiguous_runs(entries: list[InventoryEntry]) -> Iterator[list[InventoryEntry]]:
    """The entries cut where one does not start right after the one before (within the
    allocation alignment: the padding of a footprint holds no other object)."""
    start = 0
    for i in range(1, len(entries)):
        before = entries[i - 1]
        gap = entries[i].offset - (before.offset + before.size)
        if not 0 <= gap < limits.ALLOCATION_ALIGN_BYTES:
            yield entries[start:i]
            start = i
    if entries:
        yield entries[start:]


class Inventory:
    """Complete objects of one segment, by key and by offset.

    Holds `_by_key` (key -> entry) and `_spans` (start -> a list of entries at ascending
    offsets, sorted by start). A span covers [start, end of its last entry); its start is at or
    before its first entry (dropping the first entry leaves the start where it was).
    Invariants: both indexes hold the same entries; spans are not empty and do not overlap;
    every entry has size > 0 and lies in [0, capacity_bytes); no two entries overlap;
    `used_bytes` is the sum of the entries' sizes.
    """

    def __init__(self, capacity_bytes: int) -> None:
        assert capacity_bytes > 0, capacity_bytes
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._by_key: dict[str, InventoryEntry] = {}
        self._spans: SortedDict[int, list[InventoryEntry]] = SortedDict()

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
        return (entry for span in self._spans.values() for entry in span)

    def get(self, key: str) -> InventoryEntry | None:
        return self._by_key.get(key)

    @property
    def span_count(self) -> int:
        """Spans in the offset index: one per committed run until drops and cuts split them
        (every lookup and insert costs more with more spans)."""
        return len(self._spans)

    def entries(self) -> list[InventoryEntry]:
        """Every entry, by ascending offset (what a MountSegment carries)."""
        return list(self)

    def overlapping(self, offset: int, size_bytes: int) -> list[InventoryEntry]:
        """The entries that share at least one byte with [offset, offset + size_bytes).

        O(log n + k): spans never overlap, so at most one starts at or before `offset` and
        reaches into the range; the others start inside it.
        """
        if size_bytes <= 0:
            return []
        end = offset + size_bytes
        found = []
        for start in self._spans_over(offset, end):
            span = self._spans[start]
            index = max(bisect_right(span, offset, key=_offset_of) - 1, 0)
            while index < len(span) and span[index].offset < end:
                entry = span[index]
                if entry.offset + entry.size > offset:
                    found.append(entry)
                index += 1
        return found

    def _spans_over(self, offset: int, end: int) -> list[int]:
        """The starts of the spans that cover a byte of [offset, end), in order. irange walks
        the sorted keys without positional indexing, which would make sortedcontainers keep an
        index tree that every later insert pays to update."""
        spans = self._spans
        starts = list(spans.irange(offset, end, inclusive=(False, False)))
        before = next(spans.irange(maximum=offset, reverse=True), None)
        if before is not None:
            last = spans[before][-1]
            if last.offset + last.size > offset:
                starts.insert(0, before)
        return starts

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
        # Keys put again after a remove, before the drops of their old entries came (the master
        # sends drops in the background): the old entries go first, and the run is fresh again.
        # Entry by entry, each re-put key cut the spans around it and the node fell behind its
        # commits: a client re-putting 6,144 keys per round saw commits wait up to 5 s.
        displaced = self._remove_moved_keys(entries)
        if displaced and self._add_fresh_run(entries):
            return displaced
        # Several runs (the master splits a run over a fragmented segment's holes): each one
        # that is fresh at once, the others entry by entry, in order.
        for run in _contiguous_runs(entries):
            if not self._add_fresh_run(run):
                displaced += self._add_one_by_one(run)
        return displaced

    def _remove_moved_keys(self, entries: list[InventoryEntry]) -> list[InventoryEntry]:
        """Remove the held entries of these keys that lie elsewhere; returns them."""
        by_key = self._by_key
        moved: list[InventoryEntry] = []
        start: int | None = None  # the span of the previous removal: old runs go in runs too
        for entry in entries:
            same = by_key.get(entry.key)
            if same is not None and same != entry:
                start = self._remove(same, start)
                moved.append(same)
        return moved

    def _add_one_by_one(self, entries: list[InventoryEntry]) -> list[InventoryEntry]:
        """add() without the run shortcut: each entry checked against what is held."""
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
            self._insert_run([entry])
        return displaced

    def _add_fresh_run(self, entries: list[InventoryEntry]) -> bool:
        """The common commit, in one step: new keys that follow each other (as _contiguous_runs
        cuts) over a range that holds no entry (a run of keys the master allocated as one
        range, master/puts.py). One overlap check for the range instead of one per entry.
        False: nothing was added. Entries with gaps between them are refused at once: the
        range from the first to the last would take in every object between them (a commit
        scattered over a fragmented segment spans most of it: checking that range cost over
        200 us per key at 16,384 objects, `bench_paths.py node-commit`)."""
        if not entries:
            return True
        by_key = self._by_key
        span_start = entries[0].offset
        end = span_start
        align = limits.ALLOCATION_ALIGN_BYTES
        for entry in entries:
            if not 0 <= entry.offset - end < align or entry.key in by_key or entry.size <= 0:
                return False
            end = entry.offset + entry.size
        if span_start < 0 or end > self.capacity_bytes or self.overlapping(span_start, end - span_start):
            return False
        if len({entry.key for entry in entries}) != len(entries):
            return False
        self._insert_run(entries)
        return True

    def _insert_run(self, entries: list[InventoryEntry]) -> None:
        """Index new entries at ascending, disjoint offsets over a range that holds no entry.

        A span that covers part of that range with none of its entries (a gap left by drops or
        by a commit that was refused) is cut around it first, so that spans stay disjoint."""
        spans = self._spans
        start = entries[0].offset
        end = entries[-1].offset + entries[-1].size
        for old_start in self._spans_over(start, end):
            span = spans[old_start]
            cut = bisect_left(span, start, key=_offset_of)  # its entries from here lie past the run
            after = span[cut:]
            if cut:
                del span[cut:]
            else:
                del spans[old_start]
            if after:
                spans[after[0].offset] = after
        by_key = self._by_key
        size_bytes = 0
        for entry in entries:
            by_key[entry.key] = entry
            size_bytes += entry.size
        self.used_bytes += size_bytes
        for first in range(0, len(entries), SPAN_ENTRIES_MAX):
            chunk = entries[first : first + SPAN_ENTRIES_MAX]
            spans[chunk[0].offset] = chunk

    def drop(self, entries: Iterable[InventoryEntry]) -> list[InventoryEntry]:
        """Forget objects, matched by key and offset; entries not held are ignored.

        Returns:
            The entries actually removed.
        """
        dropped = []
        by_key = self._by_key
        start: int | None = None  # the span of the previous drop: evictions go in runs
        for entry in entries:
            held = by_key.get(entry.key)
            if held is None or held.offset != entry.offset:
                continue
            start = self._remove(held, start)
            dropped.append(held)
        return dropped

    def clear(self) -> None:
        self._by_key.clear()
        self._spans.clear()
        self.used_bytes = 0

    def check_invariants(self) -> None:
        """O(n) whole-structure check (STYLE.md): raises AssertionError on a broken invariant."""
        count = total = 0
        previous_end = 0
        for start, span in self._spans.items():
            assert span, f"empty span at {start}"
            assert previous_end <= start <= span[0].offset, (previous_end, start, span[0])
            for entry in span:
                assert self._by_key.get(entry.key) is entry, f"the offset index holds a stale {entry}"
                assert entry.size > 0, entry
                assert entry.offset >= 0, entry
                assert entry.offset + entry.size <= self.capacity_bytes, (self.capacity_bytes, entry)
                total += entry.size
            for a, b in pairwise(span):  # entries never overlap
                assert a.offset + a.size <= b.offset, (a, b)
            count += len(span)
            previous_end = span[-1].offset + span[-1].size
        assert count == len(self._by_key), (count, len(self._by_key))
        assert total == self.used_bytes, (total, self.used_bytes)

    def _remove(self, entry: InventoryEntry, start: int | None = None) -> int | None:
        """Forget a held entry. `start` may name the span to look in first (what the previous
        call returned); returns the start of the span it left, None when that span is gone."""
        del self._by_key[entry.key]
        self.used_bytes -= entry.size
        spans, offset = self._spans, entry.offset
        span = spans.get(start) if start is not None and start <= offset else None
        if span is None or span[-1].offset < offset:
            start = next(spans.irange(maximum=offset, reverse=True))
            span = spans[start]
        index = bisect_left(span, offset, key=_offset_of)
        assert span[index] is entry, f"{entry} is not where the offset index says"
        del span[index]
        if span:
            return start
        del spans[start]
        return None
