"""Eviction policies: the order in which the master offers complete objects for eviction.

A policy decides *order* only. It is not where eviction is decided: the master service's
judge says whether a candidate may go (a read lease, a segment that needs no room) and when
enough is freed, and the service removes the victims. Whatever the policy, these rules hold
(DESIGN.md section 5): never an object under a read lease, hard-pinned or mid-write (pending
puts are not in the table at all); soft-pinned objects only after every unpinned candidate.

The default, `LruPolicy`, is least-recently-accessed first and costs no memory: it keeps its
order in the object table's own dict (insertion-ordered; an access moves the key to the end).
Another policy (say S3-FIFO or an LFU measured on traces) subclasses `EvictionPolicy` and keeps
its own structures.

Scans are bounded (`select_victims(scan_max)`), so that an allocation failure never costs
O(all objects). Candidates that cannot go now are moved behind the others when the scan ends,
so the next bounded scan starts on fresh ones: hard-pinned objects (never candidates) and
leased ones (read within the lease TTL, so the move hardly changes the LRU order). Soft-pinned
objects stay in place, so that a lapsed pin competes by its true last access; a scan skips
them in pass 1, which costs O(soft-pinned objects ahead of the victims).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvpool.master.allocator import footprint_bytes
from kvpool.master.metadata import replica_segment_index

if TYPE_CHECKING:
    from kvpool.master.membership import Segment
    from kvpool.master.metadata import ObjectMeta, ObjectTable

# At most this many candidates are examined by an eviction that a put_start triggers (hot
# path: ~0.2 us each, so a few ms at worst), and by a watermark eviction in tick(). These
# belong in limits.py; they live here until that file is open to this module's owner.
EVICT_SCAN_CANDIDATES_PUT_MAX = 16_384
EVICT_SCAN_CANDIDATES_TICK_MAX = 262_144
# After an eviction that could not free what it needed (everything leased or pinned), the next
# one of the same kind waits this long: leases last seconds, and a scan that finds nothing
# would otherwise run on every put and every tick.
EVICT_SHORTFALL_BACKOFF_MS = 250


class Verdict(enum.Enum):
    """The judge's answer about one candidate."""

    TAKE = "take"  # evict it.
    SKIP = "skip"  # not useful now (no replica where room is needed): leave it in place.
    DEFER = "defer"  # cannot go now (read lease): the policy may move it out of the way.
    STOP = "stop"  # enough was taken: end the scan (this candidate is not taken).


Judge = Callable[[str, "ObjectMeta"], Verdict]


class EvictionPolicy(abc.ABC):
    """The order of eviction candidates among the complete objects of an `ObjectTable`.

    The table calls `attach` once, then the hooks on every change; `select_victims` never
    changes the table's key set (the caller removes the victims afterwards).
    """

    @abc.abstractmethod
    def attach(self, table: ObjectTable) -> None:
        """Bind to the (empty) table whose objects this policy orders."""

    @abc.abstractmethod
    def on_insert(self, key: str, meta: ObjectMeta) -> None:
        """A complete object entered the table (put finished, or adopted from an inventory)."""

    @abc.abstractmethod
    def on_access(self, key: str, meta: ObjectMeta) -> None:
        """The object was read (get_replica_list); existence checks do not count."""

    @abc.abstractmethod
    def on_remove(self, key: str, meta: ObjectMeta) -> None:
        """The object left the table (removed, evicted, or lost with its segments)."""

    def on_unpin(self, key: str, meta: ObjectMeta) -> None:
        """The object's soft pin expired; it competes with unpinned objects from now on."""

    @abc.abstractmethod
    def select_victims(self, judge: Judge, scan_max: int) -> list[str]:
        """Offer candidates to `judge` in eviction order; return the keys it took, in order.

        Order: every unpinned object first, then the soft-pinned ones; never a hard-pinned
        one. The scan ends when the judge says STOP, after `scan_max` candidates, or when
        candidates run out. The judge must not change the table.
        """

    def check_invariants(self) -> None:
        """O(n) self-check against the attached table."""


class LruPolicy(EvictionPolicy):
    """Least recently accessed first, ordered by the object table's own dict.

    Holds no structure of its own: the table's `objects` dict is in access order (oldest
    first) because every access re-inserts its key at the end, and the table's `soft_pinned`
    dict is in access order among soft-pinned objects. Costs: on_access O(1); select_victims
    O(candidates examined) <= O(scan_max).
    """

    def __init__(self) -> None:
        self._table: ObjectTable | None = None

    def attach(self, table: ObjectTable) -> None:
        assert self._table is None, "policy attached twice"
        assert not table.objects, "attach to an empty table"
        self._table = table

    def on_insert(self, key: str, meta: ObjectMeta) -> None:
        pass  # A new key is at the end of the dict already: the most recent.

    def on_access(self, key: str, meta: ObjectMeta) -> None:
        objects = self._table.objects  # type: ignore[union-attr]
        del objects[key]
        objects[key] = meta

    def on_remove(self, key: str, meta: ObjectMeta) -> None:
        pass

    def select_victims(self, judge: Judge, scan_max: int) -> list[str]:
        assert scan_max > 0, scan_max
        table = self._table
        assert table is not None, "policy not attached"
        objects = table.objects
        victims: list[str] = []
        deferred: list[str] = []
        scanned = 0
        stopped = False
        # Pass 1: unpinned objects, least recently accessed first.
        for key, meta in objects.items():
            if scanned >= scan_max:
                stopped = True
                break
            scanned += 1
            if meta.is_hard_pinned:
                deferred.append(key)  # Never a candidate: out of the way for good.
                continue
            if meta.soft_pin_expiry_ms:
                # Left in place: when its pin lapses it competes by its real last access.
                continue
            verdict = judge(key, meta)
            if verdict is Verdict.TAKE:
                victims.append(key)
            elif verdict is Verdict.DEFER:
                deferred.append(key)
            elif verdict is Verdict.STOP:
                stopped = True
                break
        # Pass 2: soft-pinned objects, least recently accessed first.
        if not stopped:
            for key in table.soft_pinned:
                if scanned >= scan_max:
                    break
                scanned += 1
                verdict = judge(key, objects[key])
                if verdict is Verdict.TAKE:
                    victims.append(key)
                elif verdict is Verdict.STOP:
                    break
        # Move what could not go behind everything else, so the next scan starts on fresh
        # candidates instead of re-reading the same pinned or leased ones.
        for key in deferred:
            objects[key] = objects.pop(key)
        return victims

    def check_invariants(self) -> None:
        table = self._table
        assert table is not None, "policy not attached"


# --- what to evict: the judges of the two triggers ---------------------------------------


def select_for_room(
    policy: EvictionPolicy, active: list[Segment], shortfall_bytes: int, now_ms: int
) -> tuple[list[str], bool]:
    """Victims after an allocation failure: objects with replicas on active segments, until
    `shortfall_bytes` more are scheduled for freeing than the drops already in flight.

    Returns the victims and whether they fall short of the need. Nothing when the drops in
    flight cover the shortfall: once the server flushes them and the nodes acknowledge, the
    room is there. Bounded by EVICT_SCAN_CANDIDATES_PUT_MAX.
    """
    remaining = shortfall_bytes - sum(segment.drop_bytes for segment in active)
    if remaining <= 0:
        return [], False
    active_indexes = {segment.index for segment in active}

    def judge(key: str, meta: ObjectMeta) -> Verdict:
        nonlocal remaining
        if remaining <= 0:
            return Verdict.STOP
        if meta.lease_expiry_ms > now_ms:
            return Verdict.DEFER
        useful = sum(1 for r in meta.replica_tuple() if replica_segment_index(r) in active_indexes)
        if not useful:
            return Verdict.SKIP  # Only on draining segments: evicting it frees nothing usable.
        remaining -= useful * footprint_bytes(meta.size_bytes)
        return Verdict.TAKE

    victims = policy.select_victims(judge, EVICT_SCAN_CANDIDATES_PUT_MAX)
    return victims, remaining > 0


def select_above_watermark(
    policy: EvictionPolicy, active: list[Segment], ratio_high: float, ratio: float, now_ms: int
) -> tuple[list[str], bool]:
    """Victims for the active segments above the high watermark, and whether they fall short.

    A segment at used ratio u > ratio_high needs max(ratio, u - ratio_high + ratio) of its
    capacity scheduled for freeing (Mooncake's BatchEvict target, master_service.cpp), counting
    its drops in flight, so that a slow acknowledgement never evicts twice for the same need.
    Candidates are the objects with a replica on such a segment; one eviction frees every
    replica. Bounded by EVICT_SCAN_CANDIDATES_TICK_MAX.
    """
    goals: dict[int, int] = {}
    for segment in active:
        allocator = segment.allocator
        used_ratio = allocator.used_bytes / allocator.capacity_bytes
        if used_ratio <= ratio_high:
            continue
        goal = int(max(ratio, used_ratio - ratio_high + ratio) * allocator.capacity_bytes)
        goal -= segment.drop_bytes
        if goal > 0:
            goals[segment.index] = goal
    if not goals:
        return [], False

    def judge(key: str, meta: ObjectMeta) -> Verdict:
        if not goals:
            return Verdict.STOP
        if meta.lease_expiry_ms > now_ms:
            return Verdict.DEFER
        replicas = meta.replica_tuple()
        if not any(replica_segment_index(r) in goals for r in replicas):
            return Verdict.SKIP
        footprint = footprint_bytes(meta.size_bytes)
        for packed in replicas:
            index = replica_segment_index(packed)
            if index in goals:
                goals[index] -= footprint
                if goals[index] <= 0:
                    del goals[index]
        return Verdict.TAKE

    victims = policy.select_victims(judge, EVICT_SCAN_CANDIDATES_TICK_MAX)
    return victims, bool(goals)
