"""Tombstones: the drops a segment left with, so that what was removed stays removed when its
node comes back.

A removed or evicted object's replica is forgotten by its node on a drop (membership.py), and
its range is freed when the node acknowledges it. A segment that goes before then (its node
died, was timed out, restarted on the same disk tier, or unmounted) takes its unacknowledged
drops with it, yet its node may still hold those objects: a disk tier re-adopts its files on
restart, and a node the master timed out while it was cut off mounts its DRAM segment again,
everything in it. The master keeps, per segment id, the key and offset of each such drop, and
refuses the inventory entries that match one when the segment mounts again (MountReply's
`rejected`: the node drops them, and a disk tier removes their files).

A segment's tombstones go
- all at its first heartbeat after a mount: a node sends its whole inventory before it
  heartbeats, and heartbeats only once it read every reply, so the entries refused are
  dropped and what is left matched nothing the node holds (a refusal does not spend its
  tombstone: a node whose reply was lost mounts again, and is refused again);
- TOMBSTONE_TTL_MS after the segment's last burial (a node that stays away longer comes back
  with what was removed meanwhile: the cost of keeping no state forever), or
  TOMBSTONE_DRAM_TTL_MS for a DRAM segment: its id is new at each start of its node, so only
  a node cut off from the master and mounting again meets them;
- beyond TOMBSTONES_MAX, the oldest segment's first (and a warning is logged).

A segment that goes also leaves behind its replicas of objects that live on elsewhere: no
drop was due, yet its node may come back with them. Each is kept as a replica left behind
(for as long as a tombstone would be) and becomes a tombstone once its object is removed or
evicted (`gone`); else a remove answered as done was undone when the node came back with its
replica (the history checker: k033). Those of a segment go at its first heartbeat after it
mounts again, as its tombstones do.

Not kept across a restart of the master or a change of leader (in memory, as the drops were);
nor can a remove reach an object whose node the master had already timed out (the remove
finds no such key). A burial is stamped with the time of the master's last tick.

removed_at_start.py covers the other way an object removed comes back: a master takes a remove
right after its restart (or election), before a node re-mounted with a replica of it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Collection, Iterable

from kvpool import limits
from kvpool.protocol.messages import InventoryEntry

log = logging.getLogger(__name__)


class _Graves:
    """One segment's tombstones: key -> offset, oldest first."""

    __slots__ = ("offsets", "expiry_ms")

    def __init__(self) -> None:
        self.offsets: dict[str, int] = {}
        self.expiry_ms = 0


class Tombstones:
    """Per segment id, the drops its node never acknowledged (the module)."""

    __slots__ = ("_segments", "_left", "_left_count", "_mounted", "_count", "_now_ms", "_is_over", "_is_left_over",
                 "entries_max")  # fmt: skip

    def __init__(self, entries_max: int = limits.TOMBSTONES_MAX) -> None:
        assert entries_max > 0, entries_max
        self.entries_max = entries_max
        self._segments: dict[str, _Graves] = {}  # by last burial, oldest first
        self._left: dict[str, _Graves] = {}  # replicas left behind (the module), oldest first
        self._left_count = 0
        self._mounted: set[str] = set()  # ids whose mount looked at their tombstones or what they left
        self._count = 0
        self._now_ms = 0
        self._is_over = False  # entries_max was reached (logged once until under again)
        self._is_left_over = False  # the same for the replicas left behind

    def __len__(self) -> int:
        return self._count

    def bury(self, segment_id: str, entries: Iterable[InventoryEntry], ttl_ms: int) -> None:
        """The segment is going with these drops unacknowledged; its tombstones are kept
        `ttl_ms` from now."""
        assert ttl_ms > 0, ttl_ms
        graves = self._segments.pop(segment_id, None) or _Graves()
        graves.expiry_ms = max(graves.expiry_ms, self._now_ms + ttl_ms)
        offsets = graves.offsets
        before = len(offsets)
        for entry in entries:
            offsets[entry.key] = entry.offset
        self._count += len(offsets) - before
        if offsets:
            self._segments[segment_id] = graves
        if self._count > self.entries_max:
            self._forget_oldest(self._count - self.entries_max)

    def leave_behind(self, segment_id: str, replicas: Iterable[tuple[str, int]], ttl_ms: int) -> None:
        """The segment is going with these replicas, (key, offset), of objects that live on
        elsewhere: each becomes a tombstone if its object goes within `ttl_ms` (`gone`)."""
        assert ttl_ms > 0, ttl_ms
        graves = self._left.pop(segment_id, None) or _Graves()
        graves.expiry_ms = self._now_ms + ttl_ms
        before = len(graves.offsets)
        graves.offsets.update(replicas)
        self._left_count += len(graves.offsets) - before
        if graves.offsets:
            self._left[segment_id] = graves
        if self._left_count > self.entries_max and not self._is_left_over:
            self._is_left_over = True
            log.warning("more than %d replicas left behind by segments that went: the oldest are forgotten, "
                        "and objects removed while their node was away may come back with it",
                        self.entries_max)  # fmt: skip
        while self._left_count > self.entries_max:  # the oldest segment's go whole: a rare cap
            gone_id = next(iter(self._left))
            self._left_count -= len(self._left.pop(gone_id).offsets)
            self._unmark_if_none(gone_id)

    def gone(self, keys: Collection[str]) -> None:
        """These objects were removed or evicted: their replicas left behind become tombstones.
        O(1) without any left behind, else O(the smaller of keys and each segment's left)."""
        if not self._left:
            return
        keys = list(dict.fromkeys(keys))  # each once: a second pop of one would fail
        key_set: set[str] | None = None
        for segment_id, graves in list(self._left.items()):
            offsets = graves.offsets
            if len(keys) <= len(offsets):
                found_keys = [key for key in keys if key in offsets]
            else:
                key_set = set(keys) if key_set is None else key_set
                found_keys = [key for key in offsets if key in key_set]
            if not found_keys:
                continue
            found = [(key, offsets.pop(key)) for key in found_keys]
            self._left_count -= len(found)
            if not offsets:
                del self._left[segment_id]
            entries = [InventoryEntry(key, offset, 0, 0) for key, offset in found]
            self.bury(segment_id, entries, max(1, graves.expiry_ms - self._now_ms))

    def unearth(
        self, segment_id: str, inventory: list[InventoryEntry]
    ) -> tuple[list[InventoryEntry], list[InventoryEntry]]:
        """A mount of the segment: (the entries to adopt, the entries a tombstone refuses).
        Every tombstone stays until the segment's next heartbeat, a refused entry's too: its node
        drops the entry only once it reads the reply, and one that did not (a reply lost, late)
        mounts again and is refused again. A replica left behind that the mount shows is an
        ordinary replica again (a remove's drop reaches it now): it is no longer watched."""
        left = self._left.get(segment_id)
        if left is not None:
            self._mounted.add(segment_id)  # settle forgets the rest, and what `gone` buries meanwhile
            shown = [entry.key for entry in inventory if left.offsets.get(entry.key) == entry.offset]
            for key in shown:
                del left.offsets[key]
            self._left_count -= len(shown)
            if not left.offsets:
                del self._left[segment_id]
        graves = self._segments.get(segment_id)
        if graves is None:
            self._unmark_if_none(segment_id)
            return inventory, []
        self._mounted.add(segment_id)
        offsets = graves.offsets
        adopted: list[InventoryEntry] = []
        refused: list[InventoryEntry] = []
        for entry in inventory:
            (refused if offsets.get(entry.key) == entry.offset else adopted).append(entry)
        return adopted, refused

    def settle(self, segment_id: str) -> None:
        """The segment's node heartbeats: a mount before it sent the whole inventory, so the
        tombstones it did not match are forgotten, and so are its replicas left behind."""
        left = self._left.pop(segment_id, None) if self._left else None
        if left is not None:
            self._left_count -= len(left.offsets)
        if segment_id in self._mounted:
            self._mounted.discard(segment_id)
            graves = self._segments.pop(segment_id, None)
            if graves is not None:
                self._count -= len(graves.offsets)

    def expire(self, now_ms: int) -> None:
        """Forget the segments whose tombstones' time is up; `now_ms` stamps later burials.
        O(segments with tombstones): few (those that went with drops unacknowledged)."""
        self._now_ms = now_ms
        segments = self._segments
        for segment_id in [s for s, graves in segments.items() if graves.expiry_ms <= now_ms]:
            graves = segments[segment_id]
            log.debug("tombstones of segment %s expired: %d objects removed while it was away may come back with it",
                     segment_id, len(graves.offsets))  # fmt: skip
            del segments[segment_id]
            self._unmark_if_none(segment_id)
            self._count -= len(graves.offsets)
        for segment_id in [s for s, graves in self._left.items() if graves.expiry_ms <= now_ms]:
            self._left_count -= len(self._left.pop(segment_id).offsets)
            self._unmark_if_none(segment_id)
        if self._is_over and self._count < self.entries_max:
            self._is_over = False
        if self._is_left_over and self._left_count < self.entries_max:
            self._is_left_over = False

    def _forget_oldest(self, count: int) -> None:
        if not self._is_over:
            self._is_over = True
            log.warning("more than %d tombstones: the oldest are forgotten, and objects removed while their "
                        "node was away may come back with it", self.entries_max)  # fmt: skip
        segments = self._segments
        while count > 0:
            segment_id, graves = next(iter(segments.items()))
            offsets = graves.offsets
            if len(offsets) <= count:
                del segments[segment_id]
                self._unmark_if_none(segment_id)
                self._count -= len(offsets)
                count -= len(offsets)
                continue
            # Rebuilt rather than popped from the front, which costs a CPython dict O(n) a pop.
            graves.offsets = dict(itertools.islice(offsets.items(), count, None))
            self._count -= count
            count = 0

    def _unmark_if_none(self, segment_id: str) -> None:
        if segment_id not in self._segments and segment_id not in self._left:
            self._mounted.discard(segment_id)

    def check_invariants(self) -> None:
        assert self._count == sum(len(g.offsets) for g in self._segments.values()), self._count
        assert all(g.offsets for g in self._segments.values()), "a segment without tombstones is kept"
        assert self._count <= self.entries_max, (self._count, self.entries_max)
        watched = self._segments.keys() | self._left.keys()
        assert self._mounted <= watched, self._mounted - watched
        assert self._left_count == sum(len(g.offsets) for g in self._left.values()), self._left_count
        assert self._left_count <= self.entries_max, (self._left_count, self.entries_max)
