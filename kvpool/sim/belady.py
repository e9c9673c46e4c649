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

    Holds `_priority` (key -> (next use, depth, block id) of every object in the table) and a
    heap of (-next use, -depth, -block id, key) entries, some stale (a key re-announced or
    removed); an entry is live when it equals the key's current priority. Invariants: the
    keys of `_priority` are the table's objects; every live priority has a heap entry.
    Costs: on_insert/on_access O(log n); select_victims O(k log n) for k candidates examined.
    """

    def __init__(self) -> None:
        self._table: ObjectTable | None = None
        self._announced: dict[str, Priority] = {}
        self._priority: dict[str, Priority] = {}
        self._heap: list[tuple[int, int, int, str]] = []

    def announce(self, priorities: dict[str, Priority]) -> None:
        """The next use of each key of the request about to be served (replaces the last)."""
        self._announced = priorities

    def attach(self, table: ObjectTable) -> None:
        assert self._table is None, "policy attached twice"
        self._table = table

    def on_insert(self, key: str, meta: ObjectMeta) -> None:
        self._set(key)

    def on_access(self, key: str, meta: ObjectMeta) -> None:
        self._set(key)

    def on_remove(self, key: str, meta: ObjectMeta) -> None:
        del self._priority[key]

    def _set(self, key: str) -> None:
        priority = self._announced.get(key)
        assert priority is not None, f"{key!r} used without an announced next use"
        self._priority[key] = priority
        next_use, depth, block_id = priority
        heapq.heappush(self._heap, (-next_use, -depth, -block_id, key))
        if len(self._heap) > _HEAP_STALE_RATIO_MAX * len(self._priority) + 1_024:
            self._heap = [(-n, -d, -b, k) for k, (n, d, b) in self._priority.items()]
            heapq.heapify(self._heap)

    def select_victims(self, judge: Judge, scan_max: int) -> list[str]:
        assert scan_max > 0, scan_max
        table = self._table
        assert table is not None, "policy not attached"
        objects, heap, priority = table.objects, self._heap, self._priority
        victims: list[str] = []
        held: list[tuple[int, int, int, str]] = []
        soft_pinned: list[tuple[int, int, int, str]] = []
        scanned = 0
        while heap and scanned < scan_max:
            entry = heapq.heappop(heap)
            key = entry[3]
            if priority.get(key) != (-entry[0], -entry[1], -entry[2]):
                continue  # stale
            scanned += 1
            meta = objects[key]
            if meta.is_hard_pinned:
                held.append(entry)
                continue
            if meta.soft_pin_expiry_ms:
                soft_pinned.append(entry)
                continue
            verdict = judge(key, meta)
            if verdict is Verdict.TAKE:
                victims.append(key)
            elif verdict is Verdict.STOP:
                held.append(entry)
                break
            else:
                held.append(entry)
        else:
            # Unpinned candidates ran out: soft-pinned ones next, in the same order.
            for position, entry in enumerate(soft_pinned):
                if scanned >= scan_max:
                    break
                scanned += 1
                verdict = judge(entry[3], objects[entry[3]])
                if verdict is Verdict.TAKE:
                    victims.append(entry[3])
                    soft_pinned[position] = None  # type: ignore[call-overload]
                elif verdict is Verdict.STOP:
                    break
        for entry in held:
            heapq.heappush(heap, entry)
        for entry in soft_pinned:
            if entry is not None:
                heapq.heappush(heap, entry)
        return victims

    def check_invariants(self) -> None:
        table = self._table
        assert table is not None, "policy not attached"
        assert self._priority.keys() == table.objects.keys(), "Belady priorities differ from the table"
        live = {entry[3] for entry in self._heap if self._priority.get(entry[3]) == (-entry[0], -entry[1], -entry[2])}
        assert live == self._priority.keys(), "an object has no live heap entry"
