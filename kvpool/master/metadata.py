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
                    |<----- up to 40 bits ----->|<---- 16 bits ---->|
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from kvpool import limits

if TYPE_CHECKING:
    from kvpool.master.eviction import EvictionPolicy
    from kvpool.master.membership import Segment

SEGMENT_INDEX_BITS = 16
# Segments mounted at the same time; an index is reused only after every replica on the
# segment that held it is gone (membership.py), so a packed replica never points at a stranger.
SEGMENT_COUNT_MAX = 1 << SEGMENT_INDEX_BITS
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

    A msgspec Struct with gc=False rather than a __slots__ class: 64 bytes instead of 80 (no
    GC header), and the cyclic garbage collector never traverses the millions of them, which
    measured ~7 us per put at 1M objects. Its fields hold ints only, so it can never be part
    of a reference cycle (the condition for gc=False).

    Fields:
        size_bytes: the object's size as put (not its footprint).
        checksum: the 64-bit checksum the writer reported at put_end and the node verified.
        replicas: one packed replica (int), or a tuple of them on distinct segments.
        soft_pin_expiry_ms: wall clock until which the object is evicted last; 0 = not pinned.
        is_hard_pinned: never evicted (removable, though).
        lease_expiry_ms: wall clock until which a reader may be copying the bytes; 0 = none.
    """

    size_bytes: int
    checksum: int
    replicas: int | tuple[int, ...]
    soft_pin_expiry_ms: int = 0
    is_hard_pinned: bool = False
    lease_expiry_ms: int = 0

    def replica_tuple(self) -> tuple[int, ...]:
        replicas = self.replicas
        return (replicas,) if type(replicas) is int else replicas

    def has_lease(self, now_ms: int) -> bool:
        return self.lease_expiry_ms > now_ms

    def has_replica_on(self, segment_index: int) -> bool:
        replicas = self.replicas
        if type(replicas) is int:
            return replicas & _SEGMENT_INDEX_MASK == segment_index
        return any(r & _SEGMENT_INDEX_MASK == segment_index for r in replicas)

    def set_replicas(self, replicas: list[int]) -> None:
        assert replicas, "an object keeps at least one replica"
        self.replicas = replicas[0] if len(replicas) == 1 else tuple(replicas)


class PendingPut:
    """A put between put_start and its end (finish_put_end, revoke, discard).

    States: writing (the client is writing, `is_committing` False) -> committing (put_end
    came, the nodes are verifying; the server owes a finish_put_end). A committing put cannot
    be discarded, revoked or removed, because a node may be adding it to its inventory.
    `replicas` are (segment, offset) of the ranges granted; a segment lost meanwhile is removed
    from the list, so a put can end up with none.
    """

    __slots__ = (
        "size_bytes",
        "replicas",
        "start_ms",
        "checksum",
        "is_committing",
        "is_soft_pinned",
        "is_hard_pinned",
    )

    def __init__(
        self,
        size_bytes: int,
        replicas: list[tuple[Segment, int]],
        start_ms: int,
        is_soft_pinned: bool,
        is_hard_pinned: bool,
    ):
        self.size_bytes = size_bytes
        self.replicas = replicas
        self.start_ms = start_ms
        self.checksum = 0
        self.is_committing = False
        self.is_soft_pinned = is_soft_pinned
        self.is_hard_pinned = is_hard_pinned

    def __repr__(self) -> str:
        where = [(seg.segment_id, offset) for seg, offset in self.replicas]
        state = "committing" if self.is_committing else "writing"
        return f"<PendingPut {state} size={self.size_bytes} start={self.start_ms} replicas={where}>"


class ObjectTable:
    """Every complete object by key, every put in flight by key, and the soft-pinned objects.

    Holds `objects` (key -> ObjectMeta; its order belongs to the eviction policy, which the
    table notifies of every insert, access and remove), `pending` (key -> PendingPut, in
    put_start order) and `soft_pinned` (keys of soft-pinned objects, in last-access order,
    hence in soft-pin expiry order). Invariants: a key is never both complete and pending;
    `soft_pinned` holds exactly the objects whose `soft_pin_expiry_ms` is set; a hard-pinned
    object is not soft-pinned.
    """

    __slots__ = ("objects", "pending", "soft_pinned", "policy")

    def __init__(self, policy: EvictionPolicy):
        self.objects: dict[str, ObjectMeta] = {}
        self.pending: dict[str, PendingPut] = {}
        self.soft_pinned: dict[str, None] = {}
        self.policy = policy
        policy.attach(self)

    def __len__(self) -> int:
        return len(self.objects)

    def insert(self, key: str, meta: ObjectMeta) -> None:
        assert key not in self.objects, f"insert of existing object {key!r}"
        assert key not in self.pending, f"insert of pending object {key!r}"
        assert not (meta.is_hard_pinned and meta.soft_pin_expiry_ms), key
        self.objects[key] = meta
        if meta.soft_pin_expiry_ms:
            self.soft_pinned[key] = None
        self.policy.on_insert(key, meta)

    def remove(self, key: str) -> ObjectMeta:
        meta = self.objects.pop(key)
        if meta.soft_pin_expiry_ms:
            del self.soft_pinned[key]
        self.policy.on_remove(key, meta)
        return meta

    def access(
        self, key: str, meta: ObjectMeta, now_ms: int, lease_ttl_ms: int, soft_pin_ttl_ms: int
    ) -> None:
        """A read: extend the lease, refresh the soft pin, tell the eviction policy."""
        lease_expiry_ms = now_ms + lease_ttl_ms
        if lease_expiry_ms > meta.lease_expiry_ms:
            meta.lease_expiry_ms = lease_expiry_ms
        if meta.soft_pin_expiry_ms:
            meta.soft_pin_expiry_ms = now_ms + soft_pin_ttl_ms
            soft_pinned = self.soft_pinned
            del soft_pinned[key]
            soft_pinned[key] = None
        self.policy.on_access(key, meta)

    def expire_soft_pins(self, now_ms: int) -> int:
        """Unpin soft pins not refreshed for the TTL; returns how many. O(expired + 1).

        `soft_pinned` is in last-access order, so the scan stops at the first live pin (a wall
        clock that stepped back only delays an expiry, never advances one).
        """
        expired: list[str] = []
        for key in self.soft_pinned:
            if self.objects[key].soft_pin_expiry_ms > now_ms:
                break
            expired.append(key)
        for key in expired:
            del self.soft_pinned[key]
            meta = self.objects[key]
            meta.soft_pin_expiry_ms = 0
            self.policy.on_unpin(key, meta)
        return len(expired)

    def check_invariants(self) -> None:
        """O(n): the key sets agree; pins are consistent; the policy agrees with the table."""
        objects = self.objects
        for key in self.pending:
            assert key not in objects, f"{key!r} both pending and complete"
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
        assert soft_count == len(self.soft_pinned), (soft_count, len(self.soft_pinned))
        self.policy.check_invariants()
