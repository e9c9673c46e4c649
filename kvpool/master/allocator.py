"""The offset allocator of one segment: which byte ranges of its data area are free.

This module is a pure best-fit allocator over `[0, capacity_bytes)`. It keeps the *free*
extents only, coalesced, indexed by offset and by end (dicts, for O(1) coalescing), by size
(sortedcontainers, for best fit) and, on demand, sorted by offset (for `allocate_at`), plus one
counter of used bytes. It is not a record of what is allocated: it keeps nothing per
allocated range, so that the master's memory does not grow with the number of objects, and it
cannot tell who owns a range or catch a double allocation by itself. The layer above
(`MasterService`, which knows every replica) owns that bookkeeping, and its
`check_invariants()` proves that allocated and free ranges tile each segment.

Every range is rounded up to `align_bytes` (a range's *footprint*), both when it is allocated
and when it is freed, so callers pass the object's own size each time:

    offset 0                                                          capacity_bytes
    |[used 192]|[free 256 ...........]|[used 64]|[used 4096 .......]|[free ...]|
                ^ a free extent starts   footprint_bytes(1) == 64
                  on an aligned offset   (allocate takes the start of the best-fit extent)

Costs: `allocate` and `free` are O(log f) for f free extents; `allocate_at` is O(log f) once
its index is built; `check_invariants()` is O(f log f).
"""

from __future__ import annotations

from collections.abc import Iterator

from sortedcontainers import SortedList

from kvpool import limits

# The by-size index holds one int per free extent, `size << _OFFSET_BITS | offset`, so that
# best fit is one bisect over plain ints (several times faster than tuples) and equal sizes
# are ordered by offset: best fit takes the lowest-addressed extent among the smallest that fit.
_OFFSET_BITS = 48
_OFFSET_MASK = (1 << _OFFSET_BITS) - 1
assert limits.SEGMENT_SIZE_BYTES_MAX <= _OFFSET_MASK


def footprint_bytes(size_bytes: int, align_bytes: int = limits.ALLOCATION_ALIGN_BYTES) -> int:
    """The bytes a range of `size_bytes` occupies: rounded up to the alignment."""
    return (size_bytes + align_bytes - 1) // align_bytes * align_bytes


class OffsetAllocator:
    """Free extents of one segment's data area, and the count of bytes in use.

    Holds `_starts` (offset -> size) and `_ends` (end -> offset) of every free extent, plain
    dicts for the O(1) neighbour lookups of coalescing; `_by_size` (the extents keyed by size,
    then offset) for best fit; and `_by_offset`, the sorted offsets of the free extents, built
    only when `allocate_at` needs it (mounts) and dropped by the next allocate or free, so the
    hot paths pay for one sorted index instead of two. Invariants: free extents lie inside the
    capacity, start on an aligned offset, never overlap and never touch (they are coalesced on
    free); the indexes hold the same extents; free_bytes + used_bytes == capacity_bytes.

    Args:
        capacity_bytes: size of the data area; rounded down to `align_bytes` (the tail that
            does not fill an aligned unit is never handed out).
        align_bytes: every offset and footprint is a multiple of this (a power of two).
    """

    __slots__ = (
        "_align_bytes",
        "_capacity_bytes",
        "_used_bytes",
        "_starts",
        "_ends",
        "_by_size",
        "_by_offset",
    )

    def __init__(self, capacity_bytes: int, align_bytes: int = limits.ALLOCATION_ALIGN_BYTES):
        assert align_bytes > 0, align_bytes
        assert align_bytes & (align_bytes - 1) == 0, f"align_bytes {align_bytes} not a power of two"
        assert 0 <= capacity_bytes <= _OFFSET_MASK, capacity_bytes
        self._align_bytes = align_bytes
        self._capacity_bytes = capacity_bytes - capacity_bytes % align_bytes
        self._used_bytes = 0
        self._starts: dict[int, int] = {}
        self._ends: dict[int, int] = {}
        self._by_size: SortedList = SortedList()
        self._by_offset: SortedList | None = None
        if self._capacity_bytes > 0:
            self._insert_extent(0, self._capacity_bytes)

    # --- properties ---------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    @property
    def align_bytes(self) -> int:
        return self._align_bytes

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def free_bytes(self) -> int:
        return self._capacity_bytes - self._used_bytes

    @property
    def largest_free_bytes(self) -> int:
        """The largest footprint `allocate` can satisfy now (0 when full)."""
        if not self._by_size:
            return 0
        return self._by_size[-1] >> _OFFSET_BITS

    @property
    def free_extent_count(self) -> int:
        return len(self._starts)

    def footprint_bytes(self, size_bytes: int) -> int:
        """The bytes a range of `size_bytes` occupies in this allocator."""
        return footprint_bytes(size_bytes, self._align_bytes)

    def hole_bytes_if_freed(self, offset: int, size_bytes: int) -> int:
        """The free extent that freeing the range allocated at `offset` for `size_bytes` would
        make: its footprint and the free extents it touches. O(1)."""
        footprint = self.footprint_bytes(size_bytes)
        before = self._ends.get(offset)
        return footprint + (0 if before is None else offset - before) + self._starts.get(offset + footprint, 0)

    def iter_free_extents(self) -> Iterator[tuple[int, int]]:
        """(offset, size_bytes) of every free extent, by offset. O(f log f)."""
        return iter(sorted(self._starts.items()))

    # --- operations ---------------------------------------------------------------------

    def allocate(self, size_bytes: int) -> int | None:
        """Best fit: the offset of a new range of `size_bytes`, or None when no extent fits.

        The range taken is `footprint_bytes(size_bytes)` long, from the *start* of the smallest
        free extent that holds it (the lowest-addressed one among equals). So ranges allocated
        one after another lie in ascending order, as a run's keys do inside it: objects put in
        turn sit in address order, and eviction, which takes the oldest first, frees ranges
        that coalesce (taking the end put runs in descending order around ascending keys, and
        a window of victims spanning two runs freed two holes). O(log f).
        """
        assert size_bytes > 0, f"allocate of {size_bytes} bytes"
        align = self._align_bytes
        footprint = (size_bytes + align - 1) // align * align
        by_size = self._by_size
        index = by_size.bisect_left(footprint << _OFFSET_BITS)
        if index == len(by_size):
            return None
        self._by_offset = None
        packed = by_size.pop(index)
        offset = packed & _OFFSET_MASK
        rest = (packed >> _OFFSET_BITS) - footprint
        del self._starts[offset]
        if rest:
            rest_offset = offset + footprint
            self._starts[rest_offset] = rest
            self._ends[rest_offset + rest] = rest_offset
            by_size.add(rest << _OFFSET_BITS | rest_offset)
        else:
            del self._ends[offset + footprint]
        self._used_bytes += footprint
        return offset

    def allocate_at(self, offset: int, size_bytes: int) -> bool:
        """Take the range at `offset` (a node's inventory entry); False if any byte is not free.

        Also False for a range that is not aligned or does not lie inside the capacity: an
        inventory arrives from the network, so its entries are checked, not asserted.
        O(log f), plus O(f log f) to build the by-offset index on the first call after an
        allocate or free (a mount's entries come in a row, so one build serves them all).
        """
        if size_bytes <= 0 or offset < 0 or offset % self._align_bytes != 0:
            return False
        footprint = self.footprint_bytes(size_bytes)
        end = offset + footprint
        if end > self._capacity_bytes:
            return False
        by_offset = self._by_offset
        if by_offset is None:
            by_offset = self._by_offset = SortedList(self._starts)
        index = by_offset.bisect_right(offset) - 1
        if index < 0:
            return False
        extent_offset = by_offset[index]
        extent_end = extent_offset + self._starts[extent_offset]
        if end > extent_end:
            return False
        self._remove_extent(extent_offset, extent_end - extent_offset)
        by_offset.remove(extent_offset)
        if extent_offset < offset:
            self._insert_extent(extent_offset, offset - extent_offset)
            by_offset.add(extent_offset)
        if end < extent_end:
            self._insert_extent(end, extent_end - end)
            by_offset.add(end)
        self._used_bytes += footprint
        return True

    def allocate_many_at(self, ranges: list[tuple[int, int]]) -> list[bool]:
        """`allocate_at` for a whole inventory: one bool per (offset, size_bytes), in order.

        Ranges are taken in offset order (of two that overlap, the lower offset wins); a range
        fails for the same reasons as in `allocate_at`. One sweep over the sorted ranges and
        the sorted free extents, then the indexes are rebuilt: O((k + f) log(k + f)) for k
        ranges, against O(k log f) Python-level index updates for k calls of allocate_at.
        """
        results = [False] * len(ranges)
        if not ranges or not self._starts:
            return results
        align, capacity = self._align_bytes, self._capacity_bytes
        free_pieces: list[tuple[int, int]] = []  # (offset, size) of the free extents after.
        extents = sorted(self._starts.items())
        extent_index = 0
        piece_start, piece_size = extents[0]
        piece_end = piece_start + piece_size
        used_bytes = 0
        for offset, size_bytes, index in sorted((r[0], r[1], i) for i, r in enumerate(ranges)):
            if size_bytes <= 0 or offset < 0 or offset % align != 0:
                continue
            end = offset + (size_bytes + align - 1) // align * align
            if end > capacity:
                continue
            while piece_end <= offset and extent_index < len(extents):
                if piece_start < piece_end:
                    free_pieces.append((piece_start, piece_end - piece_start))
                extent_index += 1
                if extent_index < len(extents):
                    piece_start, piece_size = extents[extent_index]
                    piece_end = piece_start + piece_size
                else:
                    piece_start = piece_end = capacity
            if offset < piece_start or end > piece_end:
                continue  # Some byte is allocated, or taken by an earlier range of this call.
            if piece_start < offset:
                free_pieces.append((piece_start, offset - piece_start))
            piece_start = end
            used_bytes += end - offset
            results[index] = True
        if piece_start < piece_end:
            free_pieces.append((piece_start, piece_end - piece_start))
        free_pieces.extend(extents[extent_index + 1 :])
        self._starts = dict(free_pieces)
        self._ends = {offset + size: offset for offset, size in free_pieces}
        self._by_size = SortedList(size << _OFFSET_BITS | offset for offset, size in free_pieces)
        self._by_offset = None
        self._used_bytes += used_bytes
        return results

    def free(self, offset: int, size_bytes: int) -> None:
        """Return the range allocated at `offset` for `size_bytes`, coalescing with neighbours.

        O(log f). Freeing a range that is not allocated is a programmer error; the part of it
        this allocator can see cheaply (a free extent starting or ending inside it at its
        edges) fails an assertion.
        """
        assert size_bytes > 0, f"free of {size_bytes} bytes"
        align = self._align_bytes
        assert offset % align == 0, f"free at unaligned offset {offset}"
        footprint = (size_bytes + align - 1) // align * align
        end = offset + footprint
        starts, ends, by_size = self._starts, self._ends, self._by_size
        assert end <= self._capacity_bytes, f"free past capacity: {offset}+{footprint}"
        assert footprint <= self._used_bytes, f"free of {footprint} > used {self._used_bytes}"
        assert offset not in starts, f"double free at {offset}"
        assert end not in ends, f"double free ending at {end}"
        self._by_offset = None
        self._used_bytes -= footprint
        next_size = starts.pop(end, 0)
        if next_size:
            del ends[end + next_size]
            by_size.remove(next_size << _OFFSET_BITS | end)
            end += next_size
        prev_offset = ends.pop(offset, None)
        if prev_offset is None:
            self._insert_extent(offset, end - offset)
            return
        # The previous extent grows in place.
        by_size.remove((offset - prev_offset) << _OFFSET_BITS | prev_offset)
        size = end - prev_offset
        starts[prev_offset] = size
        ends[end] = prev_offset
        by_size.add(size << _OFFSET_BITS | prev_offset)

    def free_many(self, ranges: list[tuple[int, int]]) -> None:
        """free() each (offset, size_bytes), ranges that follow each other (by footprint) as
        one: a run of objects allocated together and dropped together (eviction takes the
        oldest first) costs one index update instead of one per object. O(r log r + m log f)
        for r ranges making m runs."""
        footprint = self.footprint_bytes
        run_start = run_end = -1
        for offset, size_bytes in sorted(ranges):
            if offset != run_end:
                if run_end > run_start:
                    self.free(run_start, run_end - run_start)
                run_start = run_end = offset
            run_end += footprint(size_bytes)
        if run_end > run_start:
            self.free(run_start, run_end - run_start)

    def check_invariants(self) -> None:
        """O(f log f): extents aligned, inside capacity, disjoint, coalesced; indexes agree."""
        assert 0 <= self._used_bytes <= self._capacity_bytes, (self._used_bytes, self._capacity_bytes)
        count = len(self._starts)
        assert count == len(self._by_size) == len(self._ends), (count, len(self._by_size), len(self._ends))
        if self._by_offset is not None:
            assert list(self._by_offset) == sorted(self._starts), "by-offset index out of date"
        free_total = 0
        prev_end = -1
        for offset, size in sorted(self._starts.items()):
            assert size > 0, (offset, size)
            assert offset % self._align_bytes == 0, offset
            assert size % self._align_bytes == 0, (offset, size)
            assert offset > prev_end, f"free extents touch or overlap at {offset} (prev end {prev_end})"
            prev_end = offset + size
            assert prev_end <= self._capacity_bytes, (offset, size, self._capacity_bytes)
            assert self._ends.get(prev_end) == offset, (offset, size)
            assert (size << _OFFSET_BITS | offset) in self._by_size, (offset, size)
            free_total += size
        assert free_total == self.free_bytes, (free_total, self.free_bytes)

    def __repr__(self) -> str:
        return (
            f"<OffsetAllocator used={self._used_bytes}/{self._capacity_bytes} "
            f"extents={len(self._starts)} largest={self.largest_free_bytes}>"
        )

    # --- internals ------------------------------------------------------------------------

    def _insert_extent(self, offset: int, size: int) -> None:
        self._starts[offset] = size
        self._ends[offset + size] = offset
        self._by_size.add(size << _OFFSET_BITS | offset)

    def _remove_extent(self, offset: int, size: int) -> None:
        del self._starts[offset]
        del self._ends[offset + size]
        self._by_size.remove(size << _OFFSET_BITS | offset)
