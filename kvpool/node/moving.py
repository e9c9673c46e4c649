"""The ranges of one tier that a move's copy may still write: nothing else may land there.

A move's target range is the master's to give out again once it gives up on the move (at its
MOVE_TIMEOUT_MS, or when it timed the node out and the node mounted again). The copy does not
stop then: a read stalled on a hung filesystem finishes whenever it does, straight into the
DRAM segment, and a disk write renames its file into place. So from when a move is planned
until its copy has ended (renamed or removed), its target is held here, and the node refuses
what would land there meanwhile: a client's write (its grant), a commit, another move. Each
refusal is a clean failure the master already handles (a put that fails, a failed move).

A same-host writer copies into the segment without asking the node, so a DRAM copy that ends
after its move was given up may have overwritten such a writer's bytes: its range is marked
`written_late`, and commits there are hashed even when the writer hashed them in place
(PutEnd.hashed_in_place), for PUT_RELEASE_TIMEOUT_MS_DEFAULT (the master's bound on a slow
writer's range). It is a pure core: no I/O; callers pass `now_ms`. It is not the inventory
(complete objects) nor the master's allocator.
"""

from __future__ import annotations

from sortedcontainers import SortedDict

from kvpool import limits

# How long a range a late copy wrote stays marked: no put granted before that copy ended
# is committed later than the release timeout after its start (master/puts.py).
WRITTEN_LATE_MS = limits.PUT_RELEASE_TIMEOUT_MS_DEFAULT
# Marks kept at most (each is a DRAM copy that ended after its move was given up: a stalled
# disk or share, rare); beyond, the oldest goes, and a bad commit there is left to readers'
# checksums.
WRITTEN_LATE_MAX = 4_096


class MovingRanges:
    """The targets of one tier's moves in flight, and (DRAM) the ranges late copies wrote.

    Holds `_held` (start -> end, by start) and `_written_late` ([start, end, until_ms], oldest
    first). Invariant: held ranges never overlap (a target overlapping one is refused, so two
    copies never write the same bytes).
    """

    def __init__(self) -> None:
        self._held: SortedDict[int, int] = SortedDict()
        self._written_late: list[tuple[int, int, int]] = []

    def __repr__(self) -> str:
        return f"<MovingRanges held={len(self._held)} written_late={len(self._written_late)}>"

    def __bool__(self) -> bool:
        """Anything held or marked (the hot paths look no further when not)."""
        return bool(self._held) or bool(self._written_late)

    def is_held(self, offset: int, size_bytes: int) -> bool:
        """Whether [offset, offset + size_bytes) shares a byte with a held range. O(log n)."""
        held = self._held
        if not held:
            return False
        index = held.bisect_left(offset + size_bytes) - 1  # the last range starting before the end
        return index >= 0 and held.peekitem(index)[1] > offset

    def hold(self, offset: int, size_bytes: int) -> None:
        assert size_bytes > 0, size_bytes
        assert not self.is_held(offset, size_bytes), ("held twice", offset, size_bytes)
        self._held[offset] = offset + size_bytes

    def release(self, offset: int, size_bytes: int, *, written_late_at_ms: int | None = None) -> None:
        """The copy into [offset, +size_bytes) has ended. `written_late_at_ms`: it ended then,
        after its move was given up (DRAM only: see the module)."""
        end = self._held.pop(offset)
        assert end == offset + size_bytes, (offset, size_bytes, end)
        if written_late_at_ms is not None:
            if len(self._written_late) >= WRITTEN_LATE_MAX:
                del self._written_late[0]
            self._written_late.append((offset, end, written_late_at_ms + WRITTEN_LATE_MS))

    def is_written_late(self, offset: int, size_bytes: int, now_ms: int) -> bool:
        """Whether a copy that ended late wrote into the range (expired marks are forgotten)."""
        marks = self._written_late
        if not marks:
            return False
        marks[:] = [mark for mark in marks if mark[2] > now_ms]
        end = offset + size_bytes
        return any(start < end and offset < stop for start, stop, _ in marks)

    def check_invariants(self) -> None:
        ranges = list(self._held.items())
        for (start, end), (next_start, _) in zip(ranges, ranges[1:]):
            assert start < end <= next_start, (start, end, next_start)
