"""LandedSums (kvpool/node/landed.py): the sums a node took as TCP writes landed, each good for
one commit of exactly its object, while its grant holds, and never more of them than SUMS_MAX."""

from __future__ import annotations

import os

import xxhash

from kvpool.node.landed import LandedSums, WriteHasher
from kvpool.protocol.messages import InventoryEntry, WriteGrant, WriteItem, WriteSlices

NOW_MS = 1_000_000


def landed_write(sums: LandedSums, offset: int, objects: list[bytes], expiry_ms: int = NOW_MS + 1_000) -> None:
    """A write of `objects` back to back from `offset`, landed in pieces of 7 bytes."""
    size = sum(len(o) for o in objects)
    grant = WriteGrant("s", offset, size, expiry_ms)
    message = WriteSlices([WriteItem(grant, 0, size)], [len(o) for o in objects])
    located = LandedSums.objects_of(message)
    sums.forget(located)
    hasher = WriteHasher(located)
    payload = memoryview(b"".join(objects))
    for at in range(0, len(payload), 7):
        hasher(payload[at : at + 7])
    sums.record(hasher)


def entry(offset: int, data: bytes) -> InventoryEntry:
    return InventoryEntry("k", offset, len(data), xxhash.xxh3_64_intdigest(data))


def test_a_sum_is_good_once_for_exactly_its_object_while_its_grant_holds():
    now = [NOW_MS]
    sums = LandedSums(lambda: now[0])
    a, b = os.urandom(100), os.urandom(50)
    landed_write(sums, 0, [a, b])
    assert sums.take(entry(0, a)) and not sums.take(entry(0, a))  # taken once
    assert not sums.take(entry(100, b[:49]))  # another size: not this sum (and it is gone)
    landed_write(sums, 0, [a, b])
    assert not sums.take(InventoryEntry("k", 0, 100, xxhash.xxh3_64_intdigest(a) ^ 1))
    now[0] = NOW_MS + 1_000  # the grant's expiry
    assert not sums.take(entry(100, b))


def test_a_later_write_from_the_same_offset_replaces_the_sum_and_the_oldest_go_first():
    sums = LandedSums(lambda: NOW_MS, sums_max=3)
    old, new = os.urandom(64), os.urandom(64)
    landed_write(sums, 0, [old])
    landed_write(sums, 0, [new])
    assert not sums.take(entry(0, old))
    landed_write(sums, 0, [new])
    objects = [os.urandom(10) for _ in range(3)]
    landed_write(sums, 1000, objects)  # four sums for room for three: the first goes
    assert len(sums) == 3
    assert not sums.take(entry(0, new))
    assert all(sums.take(entry(1000 + 10 * i, o)) for i, o in enumerate(objects))
