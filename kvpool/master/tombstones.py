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
  a node cut off from the master and mounting again meets them, or one started again after a
  stop that kept its segment (UnmountSegment.is_kept, node/segment.py);
- beyond TOMBSTONES_MAX, the oldest segment's first (and a warning is logged).

A segment that goes also leaves behind what its node may come back with though no drop was
due: its replicas of objects that live on elsewhere, the keys of objects lost with it (it held
their only replica: a remove meanwhile finds no such key), and the targets there of moves in
flight (an offload into its disk tier, a promotion into its DRAM: mounts.py, tiers.py). Each is
kept (for as long as a tombstone would be) and becomes a tombstone once its key is removed (by
key, found or not, by a pattern or remove_all) or evicted (`gone`); else a remove answered as
done was undone when the node came back with its replica (the history checker: k033). A key
put again meanwhile is a new object: its remove or eviction buries the old replica too, and
without one the node's copy meets the adopt rules (the same bytes are a second replica, others
are refused). Those of a segment go once it mounts again with its whole inventory (what that
did not show its node does not hold), their tombstones at its first heartbeat. The ranges
there of moves whose object was removed (their end would have dropped them) are buried at once.

Lost keys, and the tombstones a remove makes of them, have a budget of their own
(LOST_KEYS_MAX): a node timed out with a disk tier of millions of objects forgets the oldest of
those no remove named yet, and only once none is left the oldest of their tombstones (a warning
is logged), never a replica left behind of an object that lives on nor a drop's tombstone. The
replicas left behind are bounded by TOMBSTONES_MAX too (the oldest first).

Not kept across a restart of the master or a change of leader (in memory, as the drops were).
A burial is stamped with the time of the master's last tick.

removed_at_start.py covers the other way an object removed comes back: a master takes a remove
right after its restart (or election), before a node re-mounted with a replica of it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Collection, Iterable, Iterator
from typing import TypeVar

from kvpool import limits
from kvpool.protocol.messages import InventoryEntry

log = logging.getLogger(__name__)


class _Graves:
    """One segment's entries: key -> offset, oldest first."""

    __slots__ = ("offsets", "expiry_ms")

    def __init__(self) -> None:
        self.offsets: dict[str, int] = {}
        self.expiry_ms = 0

    def __len__(self) -> int:
        return len(self.offsets)


class _Lost(_Graves):
    """One segment's lost keys: `offsets` those no remove named yet, `buried` those one did
    (tombstones: refused at its mount)."""

    __slots__ = ("buried",)

    def __init__(self) -> None:
        super().__init__()
        self.buried: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.offsets) + len(self.buried)


_G = TypeVar("_G", bound=_Graves)


class Tombstones:
    """Per segment id, the drops its node never acknowledged and what it left behind (the module)."""

    __slots__ = ("_segments", "_left", "_left_count", "_lost", "_lost_count", "_mounted", "_count", "_now_ms",
                 "_is_over", "_is_left_over", "_is_lost_over", "entries_max", "lost_keys_max")  # fmt: skip

    def __init__(self, entries_max: int = limits.TOMBSTONES_MAX, lost_keys_max: int = limits.LOST_KEYS_MAX) -> None:
        assert entries_max > 0 and lost_keys_max > 0, (entries_max, lost_keys_max)
        self.entries_max = entries_max
        self.lost_keys_max = lost_keys_max
        self._segments: dict[str, _Graves] = {}  # by last burial, oldest first
        self._left: dict[str, _Graves] = {}  # replicas left behind (the module), oldest first
        self._left_count = 0
        self._lost: dict[str, _Lost] = {}  # keys lost with a segment (the module), oldest first
        self._lost_count = 0
        self._mounted: set[str] = set()  # ids whose mount looked at their tombstones or what they left
        self._count = 0
        self._now_ms = 0
        self._is_over = False  # entries_max was reached (logged once until under again)
        self._is_left_over = False  # the same for the replicas left behind
        self._is_lost_over = False  # lost_keys_max, for the lost keys

    def __len__(self) -> int:
        """The tombstones: of drops, and of lost keys a remove named. O(segments with lost keys)."""
        return self._count + sum(len(lost.buried) for lost in self._lost.values())

    def bury(self, segment_id: str, entries: Iterable[InventoryEntry], ttl_ms: int) -> None:
        """The segment is going with these drops unacknowledged, oldest first (a key keeps
        one tombstone, its last: a node holds one entry per key); its tombstones are kept
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
        elsewhere: each becomes a tombstone if its key is removed or evicted within `ttl_ms` (`gone`)."""
        assert ttl_ms > 0, ttl_ms
        graves = self._left.pop(segment_id, None) or _Graves()
        graves.expiry_ms = self._now_ms + ttl_ms
        before = len(graves.offsets)
        graves.offsets.update(replicas)
        self._left_count += len(graves.offsets) - before
        if graves.offsets:
            self._left[segment_id] = graves
        if self._left_count > self.entries_max:
            if not self._is_left_over:
                self._is_left_over = True
                log.warning("more than %d replicas left behind by segments that went: the oldest are forgotten, "
                            "and objects removed while their node was away may come back with it",
                            self.entries_max)  # fmt: skip
            self._left_count -= self._forget_front(self._left, self._left_count - self.entries_max, "offsets")

    def leave_lost(self, segment_id: str, replicas: Iterable[tuple[str, int]], ttl_ms: int) -> None:
        """The segment is going with the only replicas, (key, offset), of these objects: each
        becomes a tombstone if its key is removed within `ttl_ms` (`gone`). Beyond lost_keys_max,
        the oldest lost keys no remove named are forgotten first (the module)."""
        assert ttl_ms > 0, ttl_ms
        lost = self._lost.pop(segment_id, None) or _Lost()
        lost.expiry_ms = max(lost.expiry_ms, self._now_ms + ttl_ms)
        before = len(lost.offsets)
        lost.offsets.update(replicas)
        self._lost_count += len(lost.offsets) - before
        if len(lost):
            self._lost[segment_id] = lost
        if self._lost_count > self.lost_keys_max:
            self._forget_oldest_lost(self._lost_count - self.lost_keys_max)

    def lost_keys(self) -> Iterator[str]:
        """The lost keys no remove named yet, one lost with several segments more than once:
        to copy at once (a change meanwhile breaks the iteration)."""
        return itertools.chain.from_iterable(lost.offsets for lost in self._lost.values())

    def gone(self, keys: Collection[str]) -> None:
        """These keys were removed (found or not) or evicted: their replicas left behind and lost
        keys become tombstones. O(1) with none of either, else O(the smaller of keys and each
        segment's)."""
        if not self._left and not self._lost:
            return
        unique = dict.fromkeys(keys)  # each once (a second pop of one would fail), and a set
        for segment_id, graves in list(self._left.items()):
            found = _pop_found(graves.offsets, unique)
            if not found:
                continue
            self._left_count -= len(found)
            if not graves.offsets:
                del self._left[segment_id]
            entries = [InventoryEntry(key, offset, 0, 0) for key, offset in found]
            self.bury(segment_id, entries, max(1, graves.expiry_ms - self._now_ms))
        for lost in self._lost.values():
            found = _pop_found(lost.offsets, unique)
            if found:  # on the lost budget still: no drop's tombstone is pushed out
                before = len(lost.buried)
                lost.buried.update(found)
                self._lost_count -= len(found) - (len(lost.buried) - before)  # one buried already

    def unearth(
        self, segment_id: str, inventory: list[InventoryEntry], is_whole: bool = False
    ) -> tuple[list[InventoryEntry], list[InventoryEntry]]:
        """A mount of the segment: (the entries to adopt, the entries a tombstone refuses).
        Every tombstone stays until the segment's next heartbeat, a refused entry's too: its node
        drops the entry only once it reads the reply, and one that did not (a reply lost, late)
        mounts again and is refused again. A replica left behind or lost key that the mount
        shows is an ordinary replica again (a remove's drop reaches it now): it is no longer
        watched; nor is any once the inventory `is_whole` (its node holds none of the others,
        and a remove before the heartbeat must not bury one: a put of the key may land there)."""
        left = self._left.get(segment_id)
        lost = self._lost.get(segment_id)
        graves = self._segments.get(segment_id)
        if left is None and lost is None and graves is None:
            return inventory, []
        self._mounted.add(segment_id)  # settle forgets the rest, and what `gone` buries meanwhile
        if left is not None:
            self._left_count -= _unwatch(left.offsets, inventory, is_whole)
            if not left.offsets:
                del self._left[segment_id]
        if lost is not None:
            self._lost_count -= _unwatch(lost.offsets, inventory, is_whole)
            if not len(lost):
                del self._lost[segment_id]
        buried = graves.offsets if graves is not None else {}
        lost_buried = lost.buried if lost is not None else {}
        if not buried and not lost_buried:
            self._unmark_if_none(segment_id)
            return inventory, []
        adopted: list[InventoryEntry] = []
        refused: list[InventoryEntry] = []
        for entry in inventory:
            key, offset = entry.key, entry.offset
            is_buried = buried.get(key) == offset or lost_buried.get(key) == offset
            (refused if is_buried else adopted).append(entry)
        return adopted, refused

    def settle(self, segment_id: str) -> None:
        """The segment's node heartbeats: a mount before it sent the whole inventory, so the
        tombstones it did not match are forgotten, and so are its replicas left behind and lost keys."""
        left = self._left.pop(segment_id, None) if self._left else None
        if left is not None:
            self._left_count -= len(left.offsets)
        lost = self._lost.pop(segment_id, None) if self._lost else None
        if lost is not None:
            self._lost_count -= len(lost)
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
        for segment_id in [s for s, lost in self._lost.items() if lost.expiry_ms <= now_ms]:
            self._lost_count -= len(self._lost.pop(segment_id))
            self._unmark_if_none(segment_id)
        if self._is_over and self._count < self.entries_max:
            self._is_over = False
        if self._is_left_over and self._left_count < self.entries_max:
            self._is_left_over = False
        if self._is_lost_over and self._lost_count < self.lost_keys_max:
            self._is_lost_over = False

    def _forget_oldest(self, count: int) -> None:
        if not self._is_over:
            self._is_over = True
            log.warning("more than %d tombstones: the oldest are forgotten, and objects removed while their "
                        "node was away may come back with it", self.entries_max)  # fmt: skip
        self._count -= self._forget_front(self._segments, count, "offsets")

    def _forget_oldest_lost(self, count: int) -> None:
        """Forget `count` lost keys: those no remove named yet first, the oldest segment's
        first (one is only an object that may come back, a buried one a remove answered as
        done); only then the buried ones, the oldest first. Only lost keys. O(segments with
        lost keys + count)."""
        if not self._is_lost_over:
            self._is_lost_over = True
            log.warning("more than %d keys of objects lost with segments that went: the oldest are forgotten, "
                        "and those removed while their node was away may come back with it",
                        self.lost_keys_max)  # fmt: skip
        forgotten = self._forget_front(self._lost, count, "offsets")
        if forgotten < count:  # every lost key left is buried
            forgotten += self._forget_front(self._lost, count - forgotten, "buried")
        self._lost_count -= forgotten

    def _forget_front(self, segments: dict[str, _G], count: int, field: str) -> int:
        """Forget up to `count` entries of the `field` dicts ("offsets", "buried") of `segments`,
        the oldest segment's first, and the segments left with none of any kind; how many
        entries went. The caller keeps its count. O(segments looked at + count), plus the
        slots earlier calls emptied at the front of a dict still trimmed (CPython keeps them
        until the dict grows: 0.6 ms a call after a million, in review)."""
        forgotten = 0
        emptied: list[str] = []
        for segment_id, graves in segments.items():
            if forgotten == count:
                break
            entries: dict[str, int] = getattr(graves, field)
            taken = min(count - forgotten, len(entries))
            # The front, deleted in place and listed first: a pop of the first key at a time
            # scans the slots emptied before it, and a rebuild copied the whole rest of the
            # segment's on each call over the cap (a large segment leaving in steps).
            for key in list(itertools.islice(entries, taken)):
                del entries[key]
            forgotten += taken
            if not len(graves):
                emptied.append(segment_id)
        for segment_id in emptied:
            del segments[segment_id]
            self._unmark_if_none(segment_id)
        return forgotten

    def _unmark_if_none(self, segment_id: str) -> None:
        if segment_id not in self._segments and segment_id not in self._left and segment_id not in self._lost:
            self._mounted.discard(segment_id)

    def check_invariants(self) -> None:
        assert self._count == sum(len(g.offsets) for g in self._segments.values()), self._count
        assert all(g.offsets for g in self._segments.values()), "a segment without tombstones is kept"
        assert self._count <= self.entries_max, (self._count, self.entries_max)
        watched = self._segments.keys() | self._left.keys() | self._lost.keys()
        assert self._mounted <= watched, self._mounted - watched
        assert self._left_count == sum(len(g.offsets) for g in self._left.values()), self._left_count
        assert self._left_count <= self.entries_max, (self._left_count, self.entries_max)
        assert all(len(lost) for lost in self._lost.values()), "a segment without lost keys is kept"
        assert self._lost_count == sum(len(lost) for lost in self._lost.values()), self._lost_count
        assert self._lost_count <= self.lost_keys_max, (self._lost_count, self.lost_keys_max)


def _pop_found(offsets: dict[str, int], keys: dict[str, None]) -> list[tuple[str, int]]:
    """Take `keys` out of `offsets`: [(key, offset)] of those it held. O(the smaller)."""
    if len(keys) <= len(offsets):
        found = [key for key in keys if key in offsets]
    else:
        found = [key for key in offsets if key in keys]
    return [(key, offsets.pop(key)) for key in found]


def _unwatch(offsets: dict[str, int], inventory: list[InventoryEntry], is_whole: bool) -> int:
    """Forget the entries of `offsets` the inventory shows (all of them when it `is_whole`);
    how many went."""
    if is_whole:
        count = len(offsets)
        offsets.clear()
        return count
    count = 0
    for entry in inventory:
        if offsets.get(entry.key) == entry.offset:  # once: a repeated entry finds it gone
            del offsets[entry.key]
            count += 1
    return count
