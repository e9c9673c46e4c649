"""The master's object records: complete objects, puts in flight, leases and pins.

This module holds the per-object state of the master and the one table that indexes it. It is
not where decisions are made (placement, eviction, what a put or remove returns: service.py),
nor where byte ranges are accounted (allocator.py and membership.py): a record only says where
its replicas lie.

Memory is the design constraint here: the master indexes millions of objects, so a complete
object is one record of six fields (64 bytes, never traversed by the GC), its replicas are
packed ints rather than `Replica` structs, one replica is stored without a tuple, a segment is
named by a small index rather than its id string, and absent times are the cached int 0:

    replica (int) = offset << SEGMENT_INDEX_BITS | segment_index
                    |<----- up to 47 bits ----->|<---- 16 bits ---->|

(a Python int: 8 bytes of digits below 2**60, so offsets past 16 TiB cost 4 bytes more).

With slower tiers (docs/tiers.md) the table is split by where an object lives, so that each
tier's eviction scans only its own objects: `objects` holds the objects with a DRAM replica
(the eviction policy's domain, as before), `lower` the others (on disk or DFS only), and a
`TierView` per slower tier holds its objects for that tier's own LRU:

    ObjectTable.objects   key -> meta   has a DRAM replica        EvictionPolicy (pluggable)
    ObjectTable.lower     key -> meta   no DRAM replica
    views["disk"].objects key -> meta   has a disk replica        LruPolicy over the view
    views["dfs"].objects  key -> meta   has a DFS replica         LruPolicy over the view

A cluster without slower tiers pays nothing: `lower` and the views stay empty.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import msgspec

from kvpool import limits
from kvpool.protocol.messages import TIER_DRAM

if TYPE_CHECKING:
    from kvpool.master.eviction import EvictionPolicy
    from kvpool.master.membership import Segment

SEGMENT_INDEX_BITS = 16
# Segments mounted at the same time; an index is reused only after every replica on the
# segment that held it is gone (membership.py), so a packed replica never points at a stranger.
SEGMENT_COUNT_MAX = 1 << SEGMENT_INDEX_BITS
assert SEGMENT_COUNT_MAX == limits.SEGMENTS_MAX  # what a reply may list
_SEGMENT_INDEX_MASK = SEGMENT_COUNT_MAX - 1
CHECKSUM_MAX = 2**64 - 1


def is_valid_key(key: object) -> bool:
    """A key is a non-empty str of at most KEY_SIZE_BYTES_MAX bytes of UTF-8."""
    if type(key) is not str or not key:
        return False
    if key.isascii():
        return len(key) <= limits.KEY_SIZE_BYTES_MAX
    try:
        return len(key.encode()) <= limits.KEY_SIZE_BYTES_MAX
    except UnicodeEncodeError:  # A lone surrogate: not UTF-8, cannot go on the wire.
        return False


def is_valid_size(size_bytes: object) -> bool:
    return type(size_bytes) is int and 0 < size_bytes <= limits.OBJECT_SIZE_BYTES_MAX


def is_valid_checksum(checksum: object) -> bool:
    return type(checksum) is int and 0 <= checksum <= CHECKSUM_MAX


def pack_replica(segment_index: int, offset: int) -> int:
    assert 0 <= segment_index < SEGMENT_COUNT_MAX, segment_index
    assert 0 <= offset <= limits.SEGMENT_SIZE_BYTES_MAX, offset
    return offset << SEGMENT_INDEX_BITS | segment_index


def replica_segment_index(replica: int) -> int:
    return replica & _SEGMENT_INDEX_MASK


def replica_offset(replica: int) -> int:
    return replica >> SEGMENT_INDEX_BITS


class ObjectMeta(msgspec.Struct, gc=False):
    """One complete (readable) object.

    A msgspec Struct with gc=False rather than a __slots__ class: 80 bytes instead of 96 (no
    GC header; with pymalloc's 16-byte size classes, 72 bytes took 80 too, so `held_reads`
    cost no memory), and the cyclic garbage collector never traverses the millions of them, which
    measured ~7 us per put at 1M objects. Its fields hold ints only, so it can never be part
    of a reference cycle (the condition for gc=False).

    Fields:
        size_bytes: the object's size as put (not its footprint).
        checksum: the 64-bit checksum the writer reported at put_end and the node verified.
        replicas: one packed replica (int), or a tuple of them on distinct segments.
        soft_pin_expiry_ms: wall clock until which the object is evicted last; 0 = not pinned.
        is_hard_pinned: never evicted (removable, though).
        lease_expiry_ms: wall clock until which a reader may be copying the bytes; 0 = none.
        readers: leases granted since the lease last lapsed and not given back yet
            (ReleaseLeases): the lease ends when the last is given back, once no read is
            still awaited.
        held_reads: reads a lookup's hold still awaits (LongestPrefix.hold_reads: the ranks
            that load an object they share); each read that begins takes one.
    """

    size_bytes: int
    checksum: int
    replicas: int | tuple[int, ...]
    soft_pin_expiry_ms: int = 0
    is_hard_pinned: bool = False
    lease_expiry_ms: int = 0
    readers: int = 0
    held_reads: int = 0

    def replica_tuple(self) -> tuple[int, ...]:
        replicas = self.replicas
        return (replicas,) if type(replicas) is int else replicas

    def has_lease(self, now_ms: int) -> bool:
        return self.lease_expiry_ms > now_ms

    def extend_lease(self, now_ms: int, until_ms: int) -> None:
        """Lease the object until at least `until_ms` (a read, or a lookup's hold). A lease
        that had lapsed starts a new count of readers and of reads awaited: the old ones no
        longer hold it."""
        if self.lease_expiry_ms <= now_ms:
            self.readers = 0
            self.held_reads = 0
        if until_ms > self.lease_expiry_ms:
            self.lease_expiry_ms = until_ms

    def hold_for_reads(self, now_ms: int, until_ms: int, reads: int) -> None:
        """A lookup's hold: leased until at least `until_ms`, or until `reads` reads have
        begun and been given back. Holds of the same object do not add up (an engine looks
        a waiting request up again every step); the most reads awaited stand."""
        self.extend_lease(now_ms, until_ms)
        if reads > self.held_reads:
            self.held_reads = reads

    def has_replica_on(self, segment_index: int) -> bool:
        replicas = self.replicas
        if type(replicas) is int:
            return replicas & _SEGMENT_INDEX_MASK == segment_index
        return any(r & _SEGMENT_INDEX_MASK == segment_index for r in replicas)

    def offset_on(self, segment_index: int) -> int | None:
        """The offset of the replica on that segment, or None."""
        for packed in self.replica_tuple():
            if packed & _SEGMENT_INDEX_MASK == segment_index:
                return packed >> SEGMENT_INDEX_BITS
        return None

    def set_replicas(self, replicas: list[int]) -> None:
        assert replicas, "an object keeps at least one replica"
        self.replicas = replicas[0] if len(replicas) == 1 else tuple(replicas)


class PendingPut(msgspec.Struct, gc=False):
    """A put between put_start and its end (finish_put_end, revoke, discard).

    States: writing (the client is writing, `is_committing` False) -> committing (put_end
    came, the nodes are verifying; the server owes a finish_put_end). A committing put cannot
    be discarded, revoked or removed, because a node may be adding it to its inventory.
    `replicas` are (segment, offset) of the ranges granted; a segment lost meanwhile is removed
    from the list, so a put can end up with none. `copy_tiers` are the slower tiers a copy is
    asked for once the object is complete (write-through, docs/tiers.md).

    A msgspec Struct with gc=False, as ObjectMeta: built in C (a put_start makes one per key),
    and not tracked by the cyclic collector (a segment never refers back to a put, so it
    is never part of a cycle).
    """

    size_bytes: int
    replicas: list[tuple[Segment, int]]
    start_ms: int
    is_soft_pinned: bool
    is_hard_pinned: bool
    copy_tiers: tuple[str, ...] = ()
    checksum: int = 0
    is_committing: bool = False
    put_id: int = 0  # the writer's (PutStart.put_id): only its put_end and put_revoke act on it

    def __repr__(self) -> str:
        where = [(seg.segment_id, offset) for seg, offset in self.replicas]
        state = "committing" if self.is_committing else "writing"
        return f"<PendingPut {state} size={self.size_bytes} start={self.start_ms} replicas={where}>"


class TierView:
    """The objects resident in one slower tier: what an LruPolicy orders that tier's eviction
    of (it reads `objects` and `soft_pinned`, like a table).

    `objects` (key -> meta) is in the order they entered the tier, `soft_pinned` (the
    soft-pinned among them) in last-access order. Invariant: `soft_pinned` holds exactly the
    keys of `objects` whose soft pin is set.
    """

    __slots__ = ("tier", "objects", "soft_pinned", "policy")

    def __init__(self, tier: str, policy: EvictionPolicy):
        self.tier = tier
        self.objects: dict[str, ObjectMeta] = {}
        self.soft_pinned: dict[str, None] = {}
        self.policy = policy
        policy.attach(self)  # type: ignore[arg-type]  # table-like: objects, soft_pinned

    def __repr__(self) -> str:
        return f"<TierView {self.tier} objects={len(self.objects)} soft_pinned={len(self.soft_pinned)}>"


class ObjectTable:
    """Every complete object by key, every put in flight by key, and the soft-pinned objects.

    Holds `objects` (key -> ObjectMeta of objects with a DRAM replica, in the order they
    entered; the eviction policy keeps its own order, and the table notifies it of every
    insert, access, remove and lapsed soft pin),
    `lower` (key -> ObjectMeta of the complete objects without one), `views` (per slower
    tier, its resident objects), `pending` (key -> PendingPut, in
    put_start order), `soft_pin_order` (keys of every soft-pinned object, whatever its tier, in
    last-access order, hence in soft-pin expiry order) and `soft_pinned` (those of `objects`,
    for eviction's last pass: in last-access order, a promoted one from its promotion on).
    One order across tiers because a dict only appends: a pin moved from one tier's order to
    the end of another's was out of expiry order, and the scan that stops at the first live pin
    kept it up to a TTL too long (a dict entry more per soft-pinned object in DRAM).
    Invariants: a key is in at most one of `objects`, `lower` and `pending`; the soft-pin
    sets hold exactly the objects whose `soft_pin_expiry_ms` is set; a hard-pinned object is
    not soft-pinned. Which tiers an object is resident in is the service's to say (`place`).
    """

    __slots__ = ("objects", "lower", "pending", "soft_pinned", "soft_pin_order", "policy", "views")

    def __init__(self, policy: EvictionPolicy, view_policies: dict[str, EvictionPolicy] | None = None):
        self.objects: dict[str, ObjectMeta] = {}
        self.lower: dict[str, ObjectMeta] = {}
        self.pending: dict[str, PendingPut] = {}
        self.soft_pinned: dict[str, None] = {}
        self.soft_pin_order: dict[str, None] = {}
        self.policy = policy
        policy.attach(self)
        self.views = {tier: TierView(tier, p) for tier, p in (view_policies or {}).items()}
        assert TIER_DRAM not in self.views, "views are of the slower tiers (insert relies on it)"

    def __len__(self) -> int:
        return len(self.objects) + len(self.lower)

    def __contains__(self, key: object) -> bool:
        return key in self.objects or key in self.lower

    def get(self, key: str) -> ObjectMeta | None:
        meta = self.objects.get(key)
        return meta if meta is not None else self.lower.get(key)

    def items(self) -> list[tuple[str, ObjectMeta]]:
        """Every complete object: DRAM-resident ones, then the others. O(n)."""
        return [*self.objects.items(), *self.lower.items()]

    def insert(self, key: str, meta: ObjectMeta, tiers: frozenset[str] | tuple[str, ...] = (TIER_DRAM,)) -> None:
        """A new complete object, resident in `tiers` (a put's: DRAM)."""
        assert key not in self.objects and key not in self.lower, f"insert of existing object {key!r}"
        assert key not in self.pending, f"insert of pending object {key!r}"
        assert not (meta.is_hard_pinned and meta.soft_pin_expiry_ms), key
        if meta.soft_pin_expiry_ms:
            self.soft_pin_order[key] = None
        if TIER_DRAM in tiers:
            self.objects[key] = meta
            if meta.soft_pin_expiry_ms:
                self.soft_pinned[key] = None
            self.policy.on_insert(key, meta)
            if len(tiers) == 1:
                return  # a new object in DRAM alone (a put's): in no tier view
        else:
            self.lower[key] = meta
        self._place_views(key, meta, tiers)

    def _pop(self, key: str) -> tuple[ObjectMeta, bool]:
        """Take `key` out of `objects` or `lower` (and the soft-pin orders); whether it had a
        DRAM replica. The policy and the views are the caller's."""
        meta = self.objects.pop(key, None)
        is_in_dram = meta is not None
        if meta is None:
            meta = self.lower.pop(key)
        if meta.soft_pin_expiry_ms:
            del self.soft_pin_order[key]
            if is_in_dram:
                del self.soft_pinned[key]
        return meta, is_in_dram

    def on_segment(
        self, segment_index: int, among: Iterable[tuple[str, ObjectMeta]] | None = None
    ) -> tuple[list[tuple[str, ObjectMeta]], list[tuple[str, ObjectMeta]]]:
        """The objects with a replica on a segment, among all or among `among` ((key, meta)
        pairs taken from the table earlier: those no longer current are skipped), as (key,
        meta): (those with no other replica, the others). One pass with the packed-int test
        inline (a leaving segment's objects among millions: mounts.py)."""
        mask = _SEGMENT_INDEX_MASK
        sources = [self.objects.items(), self.lower.items()] if among is None else [among]
        hits = [
            (key, meta)
            for source in sources
            for key, meta in source
            if (
                meta.replicas & mask == segment_index
                if type(meta.replicas) is int
                else any(r & mask == segment_index for r in meta.replicas)
            )
        ]
        if among is not None:
            get = self.get
            hits = [(key, meta) for key, meta in hits if get(key) is meta]
        only_there = [(key, meta) for key, meta in hits if type(meta.replicas) is int]
        also_elsewhere = [(key, meta) for key, meta in hits if type(meta.replicas) is not int]
        return only_there, also_elsewhere

    def remove_many(self, keys: list[str]) -> list[ObjectMeta]:
        """Take complete objects out (of the table, the policy, the tier views); their metas,
        in order. The policy is told once (EvictionPolicy.on_remove_many), and the tier views
        are visited only when one holds anything."""
        has_views = any(view.objects for view in self.views.values())
        from_dram: list[tuple[str, ObjectMeta]] = []
        metas: list[ObjectMeta] = []
        for key in keys:
            meta, was_in_dram = self._pop(key)
            metas.append(meta)
            if was_in_dram:
                from_dram.append((key, meta))
            if has_views:
                self._place_views(key, meta, ())
        self.policy.on_remove_many(from_dram)
        return metas

    def place(self, key: str, meta: ObjectMeta, tiers: frozenset[str] | tuple[str, ...]) -> None:
        """Re-index an object after its replicas changed: it is resident in `tiers` now (an
        empty set while its only replicas are moving out)."""
        assert self.get(key) is meta, f"place of unknown object {key!r}"
        is_in_dram = key in self.objects
        if TIER_DRAM in tiers and not is_in_dram:
            del self.lower[key]
            self.objects[key] = meta
            if meta.soft_pin_expiry_ms:
                self.soft_pinned[key] = None
            self.policy.on_insert(key, meta)
        elif TIER_DRAM not in tiers and is_in_dram:
            del self.objects[key]
            self.lower[key] = meta
            if meta.soft_pin_expiry_ms:
                del self.soft_pinned[key]
            self.policy.on_remove(key, meta)
        self._place_views(key, meta, tiers)

    def _place_views(self, key: str, meta: ObjectMeta, tiers: frozenset[str] | tuple[str, ...]) -> None:
        for tier, view in self.views.items():
            is_in_view = key in view.objects
            if tier in tiers:
                if not is_in_view:
                    view.objects[key] = meta
                    if meta.soft_pin_expiry_ms:
                        view.soft_pinned[key] = None
                    view.policy.on_insert(key, meta)
            elif is_in_view:
                del view.objects[key]
                view.soft_pinned.pop(key, None)
                view.policy.on_remove(key, meta)

    def access(
        self, key: str, meta: ObjectMeta, now_ms: int, lease_ttl_ms: int, soft_pin_ttl_ms: int
    ) -> None:
        """A read: extend the lease (one more reader, one read fewer awaited by a hold),
        refresh the soft pin, tell the eviction policies."""
        meta.extend_lease(now_ms, now_ms + lease_ttl_ms)
        meta.readers += 1
        if meta.held_reads:
            meta.held_reads -= 1
        is_in_dram = key in self.objects
        if meta.soft_pin_expiry_ms:
            meta.soft_pin_expiry_ms = now_ms + soft_pin_ttl_ms
            del self.soft_pin_order[key]
            self.soft_pin_order[key] = None
            if is_in_dram:
                del self.soft_pinned[key]
                self.soft_pinned[key] = None
        if is_in_dram:
            self.policy.on_access(key, meta)
        for view in self.views.values():
            if key in view.objects:
                if key in view.soft_pinned:
                    del view.soft_pinned[key]
                    view.soft_pinned[key] = None
                view.policy.on_access(key, meta)

    def expire_soft_pins(self, now_ms: int) -> int:
        """Unpin soft pins not refreshed for the TTL; returns how many. O(expired + 1).

        `soft_pin_order` is in last-access order, so the scan stops at the first live pin (a
        wall clock that stepped back only delays an expiry, never advances one).
        """
        expired: list[tuple[str, ObjectMeta]] = []
        get = self.get
        for key in self.soft_pin_order:
            meta = get(key)
            assert meta is not None, key
            if meta.soft_pin_expiry_ms > now_ms:
                break
            expired.append((key, meta))
        for key, meta in expired:
            del self.soft_pin_order[key]
            meta.soft_pin_expiry_ms = 0
            if key in self.soft_pinned:
                del self.soft_pinned[key]
                self.policy.on_unpin(key, meta)
            for view in self.views.values():
                if key in view.soft_pinned:
                    del view.soft_pinned[key]
                    view.policy.on_unpin(key, meta)
        return len(expired)

    def check_invariants(self) -> None:
        """O(n): the key sets agree; pins are consistent; the policies agree with the table."""
        objects, lower = self.objects, self.lower
        for key in self.pending:
            assert key not in objects, f"{key!r} both pending and complete"
            assert key not in lower, f"{key!r} both pending and complete (lower)"
        for key, meta in lower.items():
            assert key not in objects, f"{key!r} both in DRAM and lower"
            assert meta.size_bytes > 0, (key, meta)
            assert (key in self.soft_pin_order) == bool(meta.soft_pin_expiry_ms), key
            assert key not in self.soft_pinned, f"{key!r}: no DRAM replica, in DRAM's soft pins"
        for tier, view in self.views.items():
            for key, meta in view.objects.items():
                assert self.get(key) is meta, f"view {tier} holds stale {key!r}"
                assert (key in view.soft_pinned) == bool(meta.soft_pin_expiry_ms), (tier, key)
            assert all(key in view.objects for key in view.soft_pinned), f"view {tier}: stale soft pin"
            view.policy.check_invariants()
        soft_count = 0
        for key, meta in objects.items():
            assert meta.size_bytes > 0, (key, meta)
            assert 0 <= meta.checksum <= CHECKSUM_MAX, (key, meta)
            replicas = meta.replica_tuple()
            assert replicas, key
            assert type(meta.replicas) is int or len(replicas) > 1, f"{key!r}: 1-tuple replicas"
            indexes = [replica_segment_index(r) for r in replicas]
            assert len(set(indexes)) == len(indexes), f"{key!r}: two replicas on one segment"
            if meta.soft_pin_expiry_ms:
                soft_count += 1
                assert not meta.is_hard_pinned, key
                assert key in self.soft_pinned, key
                assert key in self.soft_pin_order, key
        assert soft_count == len(self.soft_pinned), (soft_count, len(self.soft_pinned))
        pinned_lower = sum(1 for meta in lower.values() if meta.soft_pin_expiry_ms)
        assert soft_count + pinned_lower == len(self.soft_pin_order), "stale soft pin in the expiry order"
        self.policy.check_invariants()
