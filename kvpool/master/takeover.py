"""When a newly elected leader starts taking puts.

A new leader knows nothing until the nodes re-mount with their inventories (DESIGN.md §4).
It serves reads of what it already knows at once, but holds back puts and removes until it
has read its predecessor's record of live segments in etcd and every segment named there has
re-mounted, or until a grace period has passed (MasterConfig.remount_grace_ms), whichever
comes first. Taking a put earlier would place it without knowing a node's contents, and a
remove could miss a replica that is about to come back. This is a pure core (time is
`now_ms`, of a clock no step of the wall clock moves: the grace is a duration on this host);
it is not the election (election.py) and decides nothing about reads.
"""

from __future__ import annotations

from collections.abc import Iterable


class Takeover:
    """The segments a new leader still waits for, and when it stops waiting.

    Made at the election, closed: the predecessor's record is read after (`expect`), and the
    segments that mount meanwhile are remembered so that they count. `expect(None)` means the
    record could not be read: wait out the whole grace period. An empty record (a first
    leader) opens at once. Invariant: once open, stays open.
    """

    __slots__ = ("_expected", "_mounted", "_deadline_ms", "_is_open", "_is_record_read")

    def __init__(self, elected_ms: int, grace_ms: int) -> None:
        assert grace_ms >= 0, grace_ms
        self._expected: set[str] | None = None
        self._mounted: set[str] = set()
        self._deadline_ms = elected_ms + grace_ms
        self._is_open = False
        self._is_record_read = False

    def __repr__(self) -> str:
        waiting = "unknown" if self._expected is None else self.waiting_count()
        return f"<Takeover open={self._is_open} waiting={waiting} deadline={self._deadline_ms}>"

    def expect(self, segment_ids: Iterable[str] | None) -> None:
        """The predecessor's record of live segments (None: unreadable). Set once."""
        assert not self._is_record_read, "the predecessor's record given twice"
        self._is_record_read = True
        if segment_ids is not None:
            self._expected = set(segment_ids)
            if self._expected <= self._mounted:
                self._is_open = True

    def mounted(self, segment_id: str) -> None:
        """A segment re-mounted (or mounted for the first time)."""
        if self._is_open:
            return  # nothing to wait for: remember no more
        self._mounted.add(segment_id)
        if self._expected is not None and self._expected <= self._mounted:
            self._is_open = True

    def is_open(self, now_ms: int) -> bool:
        """True once puts may be taken."""
        if not self._is_open and now_ms >= self._deadline_ms:
            self._is_open = True
        return self._is_open

    def waiting_count(self) -> int:
        """Segments still awaited; -1 when unknown (no record read, or none readable)."""
        return -1 if self._expected is None else len(self._expected - self._mounted)

    def remaining_ms(self, now_ms: int) -> int:
        return 0 if self.is_open(now_ms) else self._deadline_ms - now_ms
