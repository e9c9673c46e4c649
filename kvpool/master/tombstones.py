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
- one by one, as its mount refuses the entries they match;
- all at its first heartbeat after a mount: a node sends its whole inventory before it
  heartbeats, so what is left matched nothing the node holds;
- TOMBSTONE_TTL_MS after the segment's last burial (a node that stays away longer comes back
  with what was removed meanwhile: the cost of keeping no state forever), or
  TOMBSTONE_DRAM_TTL_MS for a DRAM segment: its id is new at each start of its node, so only
  a node cut off from the master and mounting again meets them;
- beyond TOMBSTONES_MAX, the oldest segment's first (and a warning is logged).

Not kept across a restart of the master or a change of leader (in memory, as the drops were);
nor can a remove reach an object whose node the master had already timed out (the remove
finds no such key). A burial is stamped with the time of the master's last tick.

`RemovedAtStart` covers the other way an object removed comes back: a master takes a remove
right after its restart (or election), before a node re-mounted with a replica of it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Collection, Iterable

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

    __slots__ = ("_segments", "_mounted", "_count", "_now_ms", "_is_over", "entries_max")

    def __init__(self, entries_max: int = limits.TOMBSTONES_MAX) -> None:
        assert entries_max > 0, entries_max
        self.entries_max = entries_max
        self._segments: dict[str, _Graves] = {}  # by last burial, oldest first
        self._mounted: set[str] = set()  # ids whose mount looked at their tombstones
        self._count = 0
        self._now_ms = 0
        self._is_over = False  # entries_max was reached (logged once until under again)

    def __len__(self) -> int:
        return self._count

    def bury(self, segment_id: str, entries: Iterable[InventoryEntry], ttl_ms: int) -> None:
        """The segment is going with these drops unacknowledged; its tombstones are kept
        `ttl_ms` from now."""
        assert ttl_ms > 0, ttl_ms
        graves = self._segments.pop(segment_id, None) or _Graves()
        graves.expiry_ms = self._now_ms + ttl_ms
        offsets = graves.offsets
        before = len(offsets)
        for entry in entries:
            offsets[entry.key] = entry.offset
        self._count += len(offsets) - before
        if offsets:
            self._segments[segment_id] = graves
        if self._count > self.entries_max:
            self._forget_oldest(self._count - self.entries_max)

    def unearth(
        self, segment_id: str, inventory: list[InventoryEntry]
    ) -> tuple[list[InventoryEntry], list[InventoryEntry]]:
        """A mount of the segment: (the entries to adopt, the entries a tombstone refuses).
        A refused entry's tombstone goes; the rest stay until the segment's next heartbeat."""
        graves = self._segments.get(segment_id)
        if graves is None:
            return inventory, []
        self._mounted.add(segment_id)
        offsets = graves.offsets
        adopted: list[InventoryEntry] = []
        refused: list[InventoryEntry] = []
        for entry in inventory:
            if offsets.get(entry.key) == entry.offset:
                del offsets[entry.key]
                refused.append(entry)
            else:
                adopted.append(entry)
        self._count -= len(refused)
        if not offsets:
            del self._segments[segment_id]
            self._mounted.discard(segment_id)
        return adopted, refused

    def settle(self, segment_id: str) -> None:
        """The segment's node heartbeats: a mount before it sent the whole inventory, so the
        tombstones it did not match are forgotten."""
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
            self._mounted.discard(segment_id)
            self._count -= len(graves.offsets)
        if self._is_over and self._count < self.entries_max:
            self._is_over = False

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
                self._mounted.discard(segment_id)
                self._count -= len(offsets)
                count -= len(offsets)
                continue
            # Rebuilt rather than popped from the front, which costs a CPython dict O(n) a pop.
            graves.offsets = dict(itertools.islice(offsets.items(), count, None))
            self._count -= count
            count = 0

    def check_invariants(self) -> None:
        assert self._count == sum(len(g.offsets) for g in self._segments.values()), self._count
        assert all(g.offsets for g in self._segments.values()), "a segment without tombstones is kept"
        assert self._count <= self.entries_max, (self._count, self.entries_max)
        assert self._mounted <= self._segments.keys(), self._mounted - self._segments.keys()


class RemovedAtStart:
    """What a master removed in its first moments (after its start, or its election), while
    nodes that held objects before it may still be on their way to mount: a segment that
    mounts for the first time since holds only objects put before, so before any of those
    removes, and its entries that one of them names are refused, as a tombstone's are. Else a
    remove taken before a node came back missed that node's replicas, and the objects came
    back with it.

    Removes are remembered until `until_ms` (a node back later was away, as the module says),
    a segment's mount that began by then is filtered to its last part; at most `keys_max`
    keys and PATTERNS_MAX patterns (the rest are logged, not remembered).
    """

    PATTERNS_MAX = 64  # each is searched in every entry a first mount brings

    __slots__ = ("_until_ms", "_keys_max", "_keys", "_searches", "_is_all", "_mounting", "_mounted", "_is_full")

    def __init__(self, until_ms: int, keys_max: int = limits.TOMBSTONES_MAX) -> None:
        self._until_ms = until_ms
        self._keys_max = keys_max
        self._keys: set[str] = set()
        self._searches: dict[str, Callable[[str], object]] = {}  # by pattern
        self._is_all = False  # a remove_all came in the window
        self._mounting: set[str] = set()  # segments whose first part came in the window
        self._mounted: set[str] = set()  # segments whose whole inventory mounted in the window
        self._is_full = False  # a remove went unremembered (logged once)

    def removed(
        self,
        keys: Collection[str] = (),
        pattern: str | None = None,
        search: Callable[[str], object] | None = None,
        is_all: bool = False,
        now_ms: int = 0,
    ) -> None:
        """A remove of `keys`, of the keys `search` (of `pattern`) finds, or of all."""
        if now_ms >= self._until_ms:
            return
        self._is_all |= is_all
        if pattern is not None and search is not None and pattern not in self._searches:
            if len(self._searches) < self.PATTERNS_MAX:
                self._searches[pattern] = search
            else:
                self._full(f"more than {self.PATTERNS_MAX} patterns")
        if len(self._keys) + len(keys) <= self._keys_max:
            self._keys.update(keys)
        elif keys:
            self._full(f"more than {self._keys_max} keys")

    def mounting(
        self, segment_id: str, inventory: list[InventoryEntry], now_ms: int, is_last: bool
    ) -> tuple[list[InventoryEntry], list[InventoryEntry]]:
        """A part of the segment's mount: (the entries to adopt, those removed before it came)."""
        if segment_id not in self._mounting:
            if now_ms >= self._until_ms or segment_id in self._mounted:
                self._forget_if_over(now_ms)
                return inventory, []
            self._mounting.add(segment_id)
        if is_last:
            self._mounting.discard(segment_id)
            self._mounted.add(segment_id)
        if not (self._keys or self._searches or self._is_all):
            return inventory, []
        keys, searches = self._keys, list(self._searches.values())
        adopted: list[InventoryEntry] = []
        refused: list[InventoryEntry] = []
        for entry in inventory:
            key = entry.key
            if self._is_all or key in keys or any(search(key) for search in searches):
                refused.append(entry)
            else:
                adopted.append(entry)
        return adopted, refused

    def _forget_if_over(self, now_ms: int) -> None:
        if now_ms >= self._until_ms and not self._mounting and (self._keys or self._searches or self._mounted):
            self._keys, self._searches, self._mounted = set(), {}, set()
            self._is_all = False

    def _full(self, what: str) -> None:
        if not self._is_full:
            self._is_full = True
            log.warning("removes of %s since this master started or was elected are not remembered: "
                        "a node that mounts later may bring their objects back", what)  # fmt: skip
