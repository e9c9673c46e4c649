"""What a node hashed as clients' writes landed, so that their commits need not read the bytes
again.

A commit checks every object's bytes against the writer's checksum (node/transfer.py,
`MasterCallHandler`). A same-host writer hashes them in the segment as it copies
(PutEnd.hashed_in_place); a TCP write used to be hashed at commit, its bytes read back from
memory, a pass over every byte that competes with the next writes for the node's core. A
write whose frame says where its objects begin (WriteSlices.object_bytes) is hashed here
instead, object by object, as each piece lands in the segment and is still in the core's
cache (the FrameDecoder's `on_landed`), and the commit compares the writer's checksum with
this one. Batches of 32 x 1 MiB put over TCP through a sync Store, eleven runs alternating
with the code before (ad hoc): a median of 1.06x the throughput (0.84-1.45x), and the node's
pass over every committed byte is gone.

A sum stands for the range its object landed in while the write's grant holds: every byte
of a write lands before its grant expires (TransferHandler closes the connection otherwise),
and the master grants a range to one put at a time, so nothing else writes there meanwhile
but a client that writes after revoking its own put. A commit whose sum is missing, expired
or different is hashed as before. A sum no commit takes (a revoked or abandoned put) goes
when a later write starts at its offset, or when SUMS_MAX are held. Whatever a sum said,
readers check every read against the object's checksum (DESIGN.md §7).
"""

from __future__ import annotations

from collections.abc import Callable

import xxhash

from kvpool.errors import InvalidParams
from kvpool.protocol.messages import InventoryEntry, WriteSlices

# Sums held at most (about 100 bytes each): the objects landed and not committed yet, a few
# batches' worth on a busy node.
SUMS_MAX = 65_536


class WriteHasher:
    """Hashes one write's payload object by object as it lands (a FrameDecoder `on_landed`).
    `sums` is each object's (segment offset, size, checksum, grant expiry) once all landed."""

    __slots__ = ("_objects", "_at", "_left", "_hasher", "_checksums")

    def __init__(self, objects: list[tuple[int, int, int]]) -> None:
        self._objects = objects  # (segment offset, size, grant expiry ms), in payload order
        self._at = -1
        self._left = 0
        self._hasher = xxhash.xxh3_64()
        self._checksums: list[int] = []

    def __call__(self, view: memoryview) -> None:
        while len(view):
            if not self._left:
                self._at += 1
                self._left = self._objects[self._at][1]
                self._hasher.reset()
            take = min(len(view), self._left)
            self._hasher.update(view if take == len(view) else view[:take])
            self._left -= take
            view = view[take:]
            if not self._left:
                self._checksums.append(self._hasher.intdigest())

    def sums(self) -> list[tuple[int, int, int, int]]:
        assert len(self._checksums) == len(self._objects), "sums asked before the payload landed"
        objects, checksums = self._objects, self._checksums
        return [(offset, size, checksum, expiry) for (offset, size, expiry), checksum in zip(objects, checksums)]


class LandedSums:
    """The sums of objects written over TCP and not committed yet, by segment offset."""

    def __init__(self, clock_ms: Callable[[], int], sums_max: int = SUMS_MAX) -> None:
        self._clock_ms = clock_ms  # the master's clock as the node estimates it (grant expiries)
        self._sums_max = sums_max
        self._sums: dict[int, tuple[int, int, int]] = {}  # offset -> (size, checksum, grant expiry ms)

    def __len__(self) -> int:
        return len(self._sums)

    @staticmethod
    def objects_of(message: WriteSlices) -> list[tuple[int, int, int]]:
        """Where each object of the write lies: (segment offset, size, grant expiry ms), in
        payload order; none when the frame does not say (WriteSlices.object_bytes).

        Raises:
            InvalidParams: object sizes that are not whole objects of its items (not positive,
                not adding up to the payload, or one across two items).
        """
        if not message.object_bytes:
            return []
        objects = []
        sizes = iter(message.object_bytes)
        for index, item in enumerate(message.items):
            offset, left = item.grant.offset + item.start, item.size
            while left > 0:
                size = next(sizes, 0)
                if size <= 0 or size > left:
                    raise InvalidParams(f"object_bytes do not cut item {index} ({item.size} bytes) into whole objects")
                objects.append((offset, size, item.grant.expiry_ms))
                offset += size
                left -= size
        if next(sizes, None) is not None:
            raise InvalidParams(f"object_bytes name {len(message.object_bytes)} objects, the items hold {len(objects)}")
        return objects

    def forget(self, objects: list[tuple[int, int, int]]) -> None:
        """A write of these objects is about to land: sums of what was there before go."""
        for offset, _, _ in objects:
            self._sums.pop(offset, None)

    def record(self, hasher: WriteHasher) -> None:
        sums = self._sums
        for offset, size, checksum, expiry_ms in hasher.sums():
            sums.pop(offset, None)  # the newest last, for the oldest to go first
            sums[offset] = (size, checksum, expiry_ms)
        while len(sums) > self._sums_max:
            del sums[next(iter(sums))]

    def take(self, entry: InventoryEntry) -> bool:
        """Whether `entry`'s bytes landed whole and hash to its checksum, per the sum taken
        as they landed (which goes either way: a commit takes it once)."""
        found = self._sums.pop(entry.offset, None)
        return found is not None and found[:2] == (entry.size, entry.checksum) and self._clock_ms() < found[2]
