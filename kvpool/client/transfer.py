"""How a batch's bytes move: the put and get jobs, their same-host copies and TCP frames.

A put or get runs in phases so that the sync `Store` can do the same-host memcpy in the
caller's thread while the event loop only does I/O (STYLE.md: no sync/async duplication):

    put:  plan_put(reply)  ->  job.copy_local()  ->  send remote frames  ->  put_end
    get:  plan_get(reply)  ->  job.copy_local()  ->  fetch remote frames ->  job.finish()

This module holds the jobs and the pure parts (which replica to read, how to cut a batch into
frames and slices, checksum and lease checks); the I/O itself is AsyncStore's. Each job is
owned by one call and is never shared between threads at the same time.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import xxhash

from kvpool import limits
from kvpool.errors import ErrorCode
from kvpool.node.segment import Segment
from kvpool.protocol.messages import (
    GetReplicaListReply,
    PutStartReply,
    ReadItem,
    ReadSlices,
    Replica,
    SegmentInfo,
    WriteGrant,
    WriteItem,
    WriteSlices,
)

# A batch is cut into frames of about this many bytes, so that it spreads over the lanes.
FRAME_BYTES_TARGET = 4 * limits.MIB

LocalSegments = Callable[[SegmentInfo], Segment | None]


def checksum_of(parts: Sequence[memoryview]) -> int:
    """xxh3-64 of the concatenation of `parts`."""
    if len(parts) == 1:
        return xxhash.xxh3_64_intdigest(parts[0])
    hasher = xxhash.xxh3_64()
    for part in parts:
        hasher.update(part)
    return hasher.intdigest()


def now_monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


@dataclasses.dataclass
class RemoteBatch:
    """Frames to one endpoint: each frame is (message, views) where views are the payload
    (writes) or the reply sinks (reads); `owners[i]` lists the key index of each item."""

    endpoint: str
    frames: list[tuple[WriteSlices | ReadSlices, list[memoryview]]]
    owners: list[list[int]]


def _cut_frames(
    endpoint: str,
    pieces: Sequence[tuple[int, object, int, memoryview]],
    make_item: Callable[[object, int, int], WriteItem | ReadItem],
    make_message: Callable[[list], WriteSlices | ReadSlices],
) -> RemoteBatch:
    """Cut (key index, target, start, view) pieces into frames of ~FRAME_BYTES_TARGET bytes,
    splitting any view larger than a slice."""
    batch = RemoteBatch(endpoint, [], [])
    items: list = []
    views: list[memoryview] = []
    owners: list[int] = []
    frame_bytes = 0
    for key_index, target, start, view in pieces:
        position = 0
        while position < len(view):
            size = min(len(view) - position, limits.SLICE_SIZE_BYTES_MAX)
            items.append(make_item(target, start + position, size))
            views.append(view[position : position + size])
            owners.append(key_index)
            frame_bytes += size
            position += size
            if frame_bytes >= FRAME_BYTES_TARGET or len(items) >= limits.BATCH_KEYS_MAX:
                batch.frames.append((make_message(items), views))
                batch.owners.append(owners)
                items, views, owners, frame_bytes = [], [], [], 0
    if items:
        batch.frames.append((make_message(items), views))
        batch.owners.append(owners)
    return batch


class PutJob:
    """One put batch after put_start: where every key's bytes go, and what became of them.

    `codes[i]` is OK until a step fails for key i. Keys whose object already existed are done
    (OK) and write nothing.
    """

    def __init__(
        self,
        keys: Sequence[str],
        parts: Sequence[Sequence[memoryview]],
        reply: PutStartReply,
        local_segments: LocalSegments,
    ) -> None:
        self.keys = list(keys)
        self.parts = parts
        self.checksums: list[int] = []
        self.codes: list[int] = []
        self.needs_end: list[bool] = []
        self.local: list[tuple[int, memoryview]] = []  # (key index, destination in a segment)
        pieces_by_endpoint: dict[str, list[tuple[int, WriteGrant, int, memoryview]]] = {}
        for index, code in enumerate(reply.codes):
            if code == ErrorCode.OBJECT_ALREADY_EXISTS:
                self.codes.append(int(ErrorCode.OK))
                self.needs_end.append(False)
                continue
            self.codes.append(code)
            self.needs_end.append(code == ErrorCode.OK)
            if code != ErrorCode.OK:
                continue
            for grant in reply.grants[index]:
                info = reply.segments[grant.segment_id]
                segment = local_segments(info)
                if segment is not None:
                    self.local.append((index, segment.data[grant.offset : grant.offset + grant.size]))
                    continue
                start = 0
                for part in parts[index]:
                    pieces_by_endpoint.setdefault(info.endpoint, []).append((index, grant, start, part))
                    start += len(part)
        self.remote = [
            _cut_frames(endpoint, pieces, WriteItem, WriteSlices)
            for endpoint, pieces in pieces_by_endpoint.items()
        ]

    def copy_local(self) -> None:
        """Copy the same-host replicas (one memcpy per part into the mapped segment) and
        checksum every key to be written. Runs in the caller's thread. A key with a local
        replica is hashed from its fresh copy, still in cache, rather than from the source."""
        checksums = [0] * len(self.keys)
        hashed = [False] * len(self.keys)
        for index, destination in self.local:
            position = 0
            for part in self.parts[index]:
                destination[position : position + len(part)] = part
                position += len(part)
            if not hashed[index]:
                checksums[index] = xxhash.xxh3_64_intdigest(destination)
                hashed[index] = True
        for index, needs_end in enumerate(self.needs_end):
            if needs_end and not hashed[index]:
                checksums[index] = checksum_of(self.parts[index])
        self.checksums = checksums

    def fail_keys(self, key_indexes: Sequence[int], code: ErrorCode) -> None:
        # A failed replica write is caught again at commit (the node's checksum check), so a
        # key fails only when none of its replicas can be written; see AsyncStore._put_finish.
        for index in key_indexes:
            self.codes[index] = int(code)


@dataclasses.dataclass
class _Target:
    """Where key i's bytes land: registered-buffer parts, or None for a new bytes object."""

    parts: list[memoryview] | None


class GetJob:
    """One get batch after get_replica_list: replica choice, copies, checks, results.

    `results[i]` is the object's bytes (plain API) or its size (into-buffer API) once read and
    verified; `codes[i]` is OK or why key i is a miss. Nothing unverified is ever returned.
    """

    def __init__(
        self,
        reply: GetReplicaListReply,
        targets: Sequence[list[memoryview] | None],
        lease_start_ms: int,
        local_segments: LocalSegments,
    ) -> None:
        self.reply = reply
        self.targets = targets
        self.codes = list(reply.codes)
        self.results: list[bytes | int | None] = [None] * len(reply.codes)
        self.lease_deadline_ms = lease_start_ms + reply.lease_ttl_ms
        self._local_segments = local_segments
        self._candidates: list[list[Replica]] = []
        self._buffers: list[bytearray | None] = [None] * len(reply.codes)
        for index, code in enumerate(reply.codes):
            if code == ErrorCode.OK and targets[index] is not None:
                capacity = sum(len(p) for p in targets[index])  # type: ignore[union-attr]
                if reply.sizes[index] > capacity:
                    self.codes[index] = int(ErrorCode.BUFFER_OVERFLOW)
            self._candidates.append(self._order(reply.replicas[index]) if self.codes[index] == 0 else [])

    def _order(self, replicas: list[Replica]) -> list[Replica]:
        """Local (mapped) replicas first, then the others in the master's order."""
        local = [r for r in replicas if self._local_segments(self.reply.segments[r.segment_id])]
        return local + [r for r in replicas if r not in local]

    def pending_indexes(self) -> list[int]:
        return [i for i, c in enumerate(self.codes) if c == ErrorCode.OK and self.results[i] is None]

    def copy_local(self) -> None:
        """Read every pending key whose next candidate replica is mapped here."""
        for index in self.pending_indexes():
            replica = self._candidates[index][0]
            segment = self._local_segments(self.reply.segments[replica.segment_id])
            if segment is None:
                continue
            self._candidates[index].pop(0)
            size = self.reply.sizes[index]
            source = segment.data[replica.offset : replica.offset + size]
            target = self.targets[index]
            if target is None:
                data = source.tobytes()
                if xxhash.xxh3_64_intdigest(data) == self.reply.checksums[index]:
                    self.results[index] = data
                else:
                    self._next_candidate(index, ErrorCode.TRANSFER_FAIL)
                continue
            _scatter(source, target)
            self._verify_target(index)

    def remote_batches(self) -> list[RemoteBatch]:
        """TCP frames for pending keys whose next candidate is remote, grouped by endpoint."""
        pieces_by_endpoint: dict[str, list[tuple[int, ReadItem, int, memoryview]]] = {}
        for index in self.pending_indexes():
            replica = self._candidates[index][0]
            info = self.reply.segments[replica.segment_id]
            size = self.reply.sizes[index]
            target = self.targets[index]
            if target is None:
                buffer = bytearray(size)
                self._buffers[index] = buffer
                parts = [memoryview(buffer)]
            else:
                parts = _prefix(target, size)
            start = 0
            item = ReadItem(replica.segment_id, replica.offset, size)
            for part in parts:
                pieces_by_endpoint.setdefault(info.endpoint, []).append((index, item, start, part))
                start += len(part)
        return [
            _cut_frames(
                endpoint,
                pieces,
                lambda item, start, size: ReadItem(item.segment_id, item.offset + start, size),
                ReadSlices,
            )
            for endpoint, pieces in pieces_by_endpoint.items()
        ]

    def remote_done(self, key_indexes: set[int], failed: set[int]) -> None:
        """TCP reads of `key_indexes` finished; those in `failed` did not arrive whole."""
        for index in key_indexes:
            self._candidates[index].pop(0)
            if index in failed:
                self._next_candidate(index, ErrorCode.TRANSFER_FAIL)
                continue
            buffer = self._buffers[index]
            if buffer is None:
                self._verify_target(index)
            elif xxhash.xxh3_64_intdigest(buffer) == self.reply.checksums[index]:
                self.results[index] = bytes(buffer)
                self._buffers[index] = None
            else:
                self._next_candidate(index, ErrorCode.TRANSFER_FAIL)

    def finish(self, now_ms: int) -> None:
        """The lease must still hold after the copies; otherwise the bytes may be stale."""
        expired = now_ms > self.lease_deadline_ms
        for index, code in enumerate(self.codes):
            if code == ErrorCode.OK and (expired or self.results[index] is None):
                self.codes[index] = int(ErrorCode.LEASE_EXPIRED if expired else ErrorCode.TRANSFER_FAIL)
                self.results[index] = None

    def _verify_target(self, index: int) -> None:
        size = self.reply.sizes[index]
        parts = _prefix(self.targets[index], size)  # type: ignore[arg-type]
        if checksum_of(parts) == self.reply.checksums[index]:
            self.results[index] = size
        else:
            self._next_candidate(index, ErrorCode.TRANSFER_FAIL)

    def _next_candidate(self, index: int, code: ErrorCode) -> None:
        if not self._candidates[index]:
            self.codes[index] = int(code)


def _prefix(parts: Sequence[memoryview], size: int) -> list[memoryview]:
    """The first `size` bytes of a list of buffers, as views."""
    out = []
    for part in parts:
        if size <= 0:
            break
        take = min(size, len(part))
        out.append(part[:take])
        size -= take
    return out


def _scatter(source: memoryview, parts: Sequence[memoryview]) -> None:
    position = 0
    for part in parts:
        take = min(len(part), len(source) - position)
        if take <= 0:
            break
        part[:take] = source[position : position + take]
        position += take
