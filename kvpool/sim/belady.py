"""Belady's offline optimum as an eviction policy of the real master: evict the object whose
next use lies furthest in the future.

It reads the future, so it is a bound for simulation, never a policy for a running master:
the replay announces, before serving each request, when every block of that request will be
used next (`announce`); `BeladyPolicy` then orders the master's objects by that next use. It
runs inside `MasterService` like any policy (leases, pins and the judge all apply), so its hit
rate is the best any policy can reach with the same master, the same trace and the same
capacity, given that every block a request brings is stored (no bypass).

Ties (the many blocks never used again) go deepest block first, then highest block id, so that
a prefix keeps its head as long as possible and two runs of the same replay agree exactly.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from kvpool.master.eviction import EvictionPolicy, Judge, Verdict

if TYPE_CHECKING:
    from kvpool.master.metadata import ObjectMeta, ObjectTable

# (next use, depth, block id): larger is evicted first.
Priority = tuple[int, int, int]
# The heap is rebuilt when stale entries outnumber live ones by this factor.
_HEAP_STALE_RATIO_MAX = 2


class BeladyPolicy(EvictionPolicy):
    """Furthest next use first, from the priorities the replay announced.

    Holds `_priority` (key -> (next use, depth, block id) of every object in the table) and two
    heaps of (-next use, -depth, -block id, key) entries: `_heap` for the objects not
    soft-pinned, `_pinned_heap` for the soft-pinned ones, which only the last pass scans (as
    the master's own policies keep them out of their orders, eviction.py: skipped in the first
    pass, they used up its bound). Some entries are stale (a key re-announced, removed, or its
    pin lapsed); an entry is live when it equals the key's current priority and its heap is
    the one of the key's pin state now. Invariants: the keys of `_priority` are the table's
    objects; every live priority has a live entry in its heap. Costs: on_insert, on_access and
    on_unpin O(log n); select_victims O(k log n) for k candidates examined.
    """

    def __init__(self) -> None:
        self._table: ObjectTable | None = None
        self._announced: dict[str, Priority] = {}
        self._priority: dict[str, Priority] = {}
        self._heap: list[tuple[int, int, int, str]] = []
        self._pinned_heap: list[tuple[int, int, int, str]] = []

    def announce(self, priorities: dict[str, Priority]) -> None:
        """The next use of each key of the request about to be served. A key keeps its last
        announced next use until it is used again: an object a move puts back in DRAM later (a
        failed offload, with a disk tier) is placed by it."""
        self._announced.update(priorities)

    def attach(self, table: ObjectTable) -> None:
        assert self._table is None, "policy attached twice"
        self._table = table

    def on_insert(self, key: str, meta: ObjectMeta) -> None:
        self._set(key, meta)

    def on_access(self, key: str, meta: ObjectMeta) -> None:
        self._set(key, meta)

    def on_remove(self, key: str, meta: ObjectMeta) -> None:
        del self._priority[key]

    def on_unpin(self, key: str, meta: ObjectMeta) -> None:
        next_use, depth, block_id = self._priority[key]
        heapq.heappush(self._heap, (-next_use, -depth, -block_id, key))

    def _set(self, key: str, meta: ObjectMeta) -> None:
        priority = self._announced.get(key)
        assert priority is not None, f"{key!r} used without an announced next use"
        self._priority[key] = priority
        next_use, depth, block_id = priority
        heap = self._pinned_heap if meta.soft_pin_expiry_ms else self._heap
        heapq.heappush(heap, (-next_use, -depth, -block_id, key))
        if len(self._heap) + len(self._pinned_heap) > _HEAP_STALE_RATIO_MAX * len(self._priority) + 1_024:
            self._rebuild()

    def _rebuild(self) -> None:
        """Both heaps again from the live priorities alone."""
        objects = self._table.objects  # type: ignore[union-attr]
        self._heap, self._pinned_heap = [], []
        for k, (n, d, b) in self._priority.items():
            (self._pinned_heap if objects[k].soft_pin_expiry_ms else self._heap).append((-n, -d, -b, k))
        heapq.heapify(self._heap)
        heapq.heapify(self._pinned_heap)

    def _is_live(self, entry: tuple[int, int, int, str], is_pinned_heap: bool) -> bool:
        key = entry[3]
        if self._priority.get(key) != (-entry[0], -entry[1], -entry[2]):
            return False
        return bool(self._table.objects[key].soft_pin_expiry_ms) == is_pinned_heap  # type: ignore[union-attr]

    def select_victims(self, judge: Judge, scan_max: int) -> list[str]:
        assert scan_max > 0, scan_max
        table = self._table
        assert table is not None, "policy not attached"
        objects = table.objects
        victims: list[str] = []
        scanned = 0
        stopped = False
        # Objects not soft-pinned first; once they ran out, the soft-pinned ones, each in
        # furthest-next-use order.
        for heap, is_pinned_heap in ((self._heap, False), (self._pinned_heap, True)):
            held: list[tuple[int, int, int, str]] = []
            while heap and scanned < scan_max:
                entry = heapq.heappop(heap)
                if not self._is_live(entry, is_pinned_heap):
                    continue
                scanned += 1
                key = entry[3]
                meta = objects[key]
                if meta.is_hard_pinned:
                    held.append(entry)
                    continue
                verdict = judge(key, meta)
                # Every entry goes back, a victim's too: with a disk tier a victim stays in the
                # table, offloaded (or its offload refused), and one taken out of the heap for
                # good left its object unevictable ("no live entry in the heap"); one removed
                # is a stale entry from then on.
                held.append(entry)
                if verdict is Verdict.TAKE:
                    victims.append(key)
                elif verdict is Verdict.STOP:
                    stopped = True
                    break
            for entry in held:
                heapq.heappush(heap, entry)
            if stopped or scanned >= scan_max:
                break
        return victims

    def check_invariants(self) -> None:
        table = self._table
        assert table is not None, "policy not attached"
        assert self._priority.keys() == table.objects.keys(), "Belady priorities differ from the table"
        for heap, is_pinned_heap in ((self._heap, False), (self._pinned_heap, True)):
            live = {entry[3] for entry in heap if self._is_live(entry, is_pinned_heap)}
            pinned = {key for key in self._priority if bool(table.objects[key].soft_pin_expiry_ms) == is_pinned_heap}
            assert live == pinned, "an object has no live entry in the heap of its pin state"
