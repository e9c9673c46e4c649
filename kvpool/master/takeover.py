"""When a newly elected leader starts taking puts.

A new leader knows nothing until the nodes re-mount with their inventories (DESIGN.md §4).
It serves reads of what it already knows at once, but holds back puts and removes until
every segment that its predecessor recorded as live in etcd has re-mounted, or until a grace
period has passed (MasterConfig.remount_grace_ms), whichever comes first. Taking a put
earlier would place it without knowing a node's contents, and a remove could miss a replica
that is about to come back. This is a pure core (time is `now_ms`); it is not the election
(election.py) and decides nothing about reads.
"""

from __future__ import annotations

from collections.abc import Iterable


class Takeover:
    """The segments a new leader still waits for, and when it stops waiting.

    `expected` None means the predecessor's record could not be read: wait out the whole grace
    period. An empty record (a first leader) opens at once. Invariant: once open, stays open.
    """

    __slots__ = ("_waiting", "_deadline_ms", "_is_open", "expected_count")

    def __init__(self, expected: Iterable[str] | None, elected_ms: int, grace_ms: int) -> None:
        assert grace_ms >= 0, grace_ms
        self._waiting = set(expected) if expected is not None else None
        self.expected_count = len(self._waiting) if self._waiting is not None else -1
        self._deadline_ms = elected_ms + grace_ms
        self._is_open = self._waiting is not None and not self._waiting

    def __repr__(self) -> str:
        waiting = "unknown" if self._waiting is None else len(self._waiting)
        return f"<Takeover open={self._is_open} waiting={waiting} deadline={self._deadline_ms}>"

    def mounted(self, segment_id: str) -> None:
        """A segment re-mounted (or mounted for the first time)."""
        if self._waiting is not None:
            self._waiting.discard(segment_id)
            if not self._waiting:
                self._is_open = True

    def is_open(self, now_ms: int) -> bool:
        """True once puts may be taken."""
        if not self._is_open and now_ms >= self._deadline_ms:
            self._is_open = True
        return self._is_open

    def waiting_count(self) -> int:
        """Segments still awaited; -1 when unknown (no record read)."""
        return -1 if self._waiting is None else len(self._waiting)

    def remaining_ms(self, now_ms: int) -> int:
        return 0 if self.is_open(now_ms) else self._deadline_ms - now_ms
