"""What a master removed in its first moments, for the segments still on their way to mount.

After a restart (or an election) a master knows no object until the nodes mount their
segments again, and they come back over seconds: a node tries again at most every
limits.RECONNECT_BACKOFF_MS_MAX, the nodes of a frozen predecessor notice only when a
heartbeat times out, a master adopting many inventories takes their mounts up late, and a DFS
is mounted from a scan of its files. A remove taken meanwhile missed the replicas of the
segments not back yet, and the objects came back with them.

A segment that mounts for the first time since the start (or election) holds nothing put
through this master, so nothing put after any of its removes: its entries that such a remove
names are refused, as a tombstone's are (tombstones.py), and its node drops them. Kept for a
window from the start (a memory bound only: the reasoning holds however late a segment comes),
a mount begun in it filtered to its last part, with the removes taken until then too; at most
`keys_max` keys and PATTERNS_MAX patterns (past them a remove is not remembered, and the log
says so once).
"""

from __future__ import annotations

import logging
from collections.abc import Collection

import re2

from kvpool import limits, patterns
from kvpool.protocol.messages import InventoryEntry

log = logging.getLogger(__name__)

PATTERNS_MAX = 64
# A node sends its inventory's parts back to back: a mount begun in the window with no part
# this long after its last was abandoned (its node died), and no longer holds the window's memory.
MOUNT_PARTS_WAIT_MS = 60_000



class RemovedAtStart:
    """The window's removes (the module), and the segments that mounted in it."""

    __slots__ = ("_until_ms", "_keys_max", "_keys", "_patterns", "_searches", "_search", "_is_all", "_mounting",
                 "_mounted", "_refused", "_is_full")  # fmt: skip

    def __init__(self, until_ms: int, keys_max: int = limits.TOMBSTONES_MAX) -> None:
        self._until_ms = until_ms
        self._keys_max = keys_max
        self._keys: set[str] = set()
        self._patterns: list[str] = []
        self._searches: list = []  # each pattern's own search
        self._search = None  # one search for every pattern: 64 searched one by one cost 90 us an entry
        self._is_all = False  # a remove_all came in the window
        # segment id -> when its last part came; None: a scan's, filtered however late it ends
        self._mounting: dict[str, int | None] = {}
        self._mounted: set[str] = set()  # segments whose whole inventory mounted
        # Per segment, when and which (key, offset) were refused, until its heartbeat: its node
        # drops them once it reads the reply, and one that did not mounts again.
        self._refused: dict[str, tuple[int, set[tuple[str, int]]]] = {}
        self._is_full = False

    def removed(self, keys: Collection[str] = (), pattern: str | None = None, is_all: bool = False,
                now_ms: int = 0) -> None:  # fmt: skip
        """A remove that took or did not find `keys`, of the keys `pattern` (RE2, as the
        remove searched it) finds, or of all (`is_all`). Past the window, while a mount begun
        in it still comes in (a DFS scan of a large share, a node's many parts): it found none
        of that mount's objects, and the parts to come would bring them back."""
        if now_ms >= self._until_ms and not self._mounting:
            return
        self._is_all |= is_all
        if pattern is not None and pattern not in self._patterns:
            if len(self._patterns) < PATTERNS_MAX:
                self._add_pattern(pattern)
            else:
                self._full(f"more than {PATTERNS_MAX} patterns")
        new = [key for key in keys if key not in self._keys]
        room = self._keys_max - len(self._keys)
        self._keys.update(new[:room])
        if len(new) > room:
            self._full(f"more than {self._keys_max} keys")

    def _add_pattern(self, pattern: str) -> None:
        self._patterns.append(pattern)
        self._searches.append(re2.compile(pattern, patterns.OPTIONS).search)  # the remove compiled it so
        try:
            self._search = re2.compile("|".join(f"(?:{p})" for p in self._patterns), patterns.OPTIONS).search
        except re2.error:  # together they do not compile (too large; a \Q left open takes the ")")
            searches = self._searches
            self._search = lambda key: any(search(key) for search in searches)

    def scanning(self, segment_id: str, now_ms: int) -> None:
        """A segment whose mount will come from a scan that may end long after the window (the
        DFS's): filtered whenever its parts come, until its last."""
        if self._filters(segment_id, now_ms):
            self._mounting[segment_id] = None

    def mounting(
        self, segment_id: str, inventory: list[InventoryEntry], now_ms: int
    ) -> tuple[list[InventoryEntry], list[InventoryEntry]]:
        """A part of the segment's mount: (the entries to adopt, those the window removed).
        `mounted` says whether the master took the part; what was refused is refused again
        until the segment's heartbeat (`settled`)."""
        adopted: list[InventoryEntry] = []
        refused: list[InventoryEntry] = []
        if not self._filters(segment_id, now_ms):
            _, again = self._refused.get(segment_id, (0, None))
            if not again:
                return inventory, []
            for entry in inventory:
                (refused if (entry.key, entry.offset) in again else adopted).append(entry)
            return adopted, refused
        if not (self._keys or self._search or self._is_all):
            return inventory, []
        keys, search, is_all = self._keys, self._search, self._is_all
        for entry in inventory:
            if is_all or entry.key in keys or (search is not None and search(entry.key)):
                refused.append(entry)
            else:
                adopted.append(entry)
        if refused:
            _, already = self._refused.setdefault(segment_id, (now_ms, set()))
            already.update((entry.key, entry.offset) for entry in refused)
        return adopted, refused

    def settled(self, segment_ids: Collection[str]) -> None:
        """These segments' node heartbeats: it read every reply to its mount."""
        if self._refused:
            for segment_id in segment_ids:
                self._refused.pop(segment_id, None)

    def mounted(self, segment_id: str, is_last: bool, now_ms: int) -> None:
        """The master took that part of the segment's mount (a part it refused leaves the
        segment as it was, to be filtered when its node tries again)."""
        if not self._filters(segment_id, now_ms):
            return
        if is_last:
            self._mounting.pop(segment_id, None)
            self._mounted.add(segment_id)
        elif self._mounting.get(segment_id, 0) is not None:
            self._mounting[segment_id] = now_ms

    def _filters(self, segment_id: str, now_ms: int) -> bool:
        if segment_id in self._mounting:
            return True
        return now_ms < self._until_ms and segment_id not in self._mounted

    def expire(self, now_ms: int) -> None:
        """Past the window, forget what no mount still being filtered needs (the master's tick)."""
        if now_ms < self._until_ms:
            return
        for segment_id, last_ms in list(self._mounting.items()):
            if last_ms is not None and now_ms - last_ms > MOUNT_PARTS_WAIT_MS:
                del self._mounting[segment_id]
        for segment_id, (since_ms, _) in list(self._refused.items()):
            if now_ms - since_ms > MOUNT_PARTS_WAIT_MS:  # its node never heartbeat: it died
                del self._refused[segment_id]
        if not self._mounting and (self._keys or self._patterns or self._mounted or self._is_all):
            self._keys, self._mounted, self._is_all = set(), set(), False
            self._patterns, self._searches, self._search = [], [], None

    def _full(self, what: str) -> None:
        if not self._is_full:
            self._is_full = True
            log.warning("removes of %s since this master started or was elected are not remembered: a segment "
                        "that mounts later may bring their objects back", what)  # fmt: skip
