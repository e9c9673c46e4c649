"""How a batch's bytes move: the put and get jobs, their same-host copies and TCP frames.

A put or get runs in phases so that the sync `Store` can do the same-host memcpy in the
caller's thread while the event loop only does I/O (STYLE.md: no sync/async duplication):

    put:  plan_put(reply)  ->  job.copy_local()  ->  send remote frames  ->  put_end
    get:  plan_get(reply)  ->  job.copy_local()  ->  fetch remote frames ->  job.finish()

This module holds the jobs and the pure parts (which replica to read, how to cut a batch into
frames and slices, checksum and lease checks); the I/O itself is AsyncStore's. Each job is
owned by one call and is never shared between threads at the same time.

With slower tiers (docs/tiers.md) a get tries replicas nearest first: local DRAM (mapped),
remote DRAM, local disk, remote disk, DFS. "Local" disk and DFS replicas are object files this
host can open (a same-host node's disk directory, this host's mount of the DFS), read by
copy_local on the file-reading threads, within the get's deadline, and copied on into the
caller's buffers only while the get waits (GetJob._read_files); remote disk replicas come over TCP
like DRAM ones (the node sends them with sendfile). A DFS replica this host cannot open is
skipped: no node serves it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import dataclasses
import logging
import mmap
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import xxhash

from kvpool import limits, page_advice
from kvpool.checksums import (
    COPY_CHUNK_BYTES,
    SIMD_COPY_BYTES_MIN,
    SIMD_COPY_INTO_SEGMENT_BYTES_MIN,
    SMALL_COPY_BYTES_MAX,
    checksum_of,
    checksums_of,
    copies_checksummed,
    copy_bytes,
    copy_small_checksummed,
)
from kvpool.errors import ErrorCode, KVPoolError
from kvpool.node.segment import Segment
from kvpool.process import ThreadPool
from kvpool.protocol import objectfile
from kvpool.protocol.frames import PAGE_BYTES, buffer_address
from kvpool.protocol.messages import (
    TIER_DFS,
    TIER_DISK,
    TIER_DRAM,
    TIERS,
    CodesReply,
    GetReplicaListReply,
    Message,
    PutEnd,
    PutRevoke,
    PutStartReply,
    ReadItem,
    ReadSlices,
    Replica,
    SegmentInfo,
    WriteItem,
    WriteSlices,
)
from kvpool.repeated_log import RepeatedLog
from kvpool.transports import files

log = logging.getLogger(__name__)

_OK = int(ErrorCode.OK)
_FILE_TIERS = (TIER_DISK, TIER_DFS)

# A batch is cut into frames of about this many bytes, so that it spreads over the lanes.
FRAME_BYTES_TARGET = 4 * limits.MIB

# Plain gets over TCP of objects up to this size land together, one buffer per frame
# (GetJob._page_frames); larger ones land in the bytes object returned (_new_bytes).
SMALL_LANDING_BYTES_MAX = 16 * limits.KIB


# Small same-host copies look at their grants' deadline once per this many (a clock read per
# 4 KiB page cost 10% of copy_local: 133 -> 149 us per batch of 128, ad hoc); larger ones each.
DEADLINE_CHECK_EVERY = 64

LocalSegments = Callable[[SegmentInfo], Segment | None]
# A view of registered memory: (address, size) -> memoryview; raises KVPoolError when the range
# is not inside one registered buffer (BufferRegistry.view).
Span = Callable[[int, int], memoryview]
# A get advises this many bytes of the object files it is about to read, ahead of reading them,
# and reads them on this many threads.
FILE_PREFETCH_BYTES_MAX = 64 * limits.MIB
FILE_READ_THREADS = 4
# The directory of a disk or DFS segment's object files if this host can open them, else None.
LocalDirectories = Callable[[SegmentInfo], Path | None]


def first_occurrences(keys: Sequence[str]) -> tuple[list[int], list[int]]:
    """Indexes of each key's first occurrence, and for every position the index of its key
    among those. A key repeated in one batch is put once (keys name immutable content)."""
    if len(set(keys)) == len(keys):  # the common case: no repeats
        every = list(range(len(keys)))
        return every, every.copy()
    slot_of: dict[str, int] = {}
    unique: list[int] = []
    positions: list[int] = []
    for index, key in enumerate(keys):
        if key not in slot_of:
            slot_of[key] = len(unique)
            unique.append(index)
        positions.append(slot_of[key])
    return unique, positions


def now_monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


@dataclasses.dataclass
class RemoteBatch:
    """Frames to one endpoint: each frame is (message, views) where views are the payload
    (writes) or the reply sinks (reads); `owners[i]` lists the key index of each item, and
    `item_bytes[i]` its size. A read's frame may have a `landing[i]`: what its reply's
    payload is shown to as it lands (FrameDecoder.set_payload_sinks), None for none."""

    endpoint: str
    frames: list[tuple[WriteSlices | ReadSlices, list[memoryview]]]
    owners: list[list[int]]
    item_bytes: list[list[int]] = dataclasses.field(default_factory=list)
    landing: list[Callable[[memoryview], None] | None] = dataclasses.field(default_factory=list)

    def on_landed(self, frame: int) -> Callable[[memoryview], None] | None:
        return self.landing[frame] if frame < len(self.landing) else None


class _FrameCutter:
    """Cuts objects into items of at most a slice and items into frames of about
    FRAME_BYTES_TARGET bytes. An item covers a contiguous range of one object and may span
    several of its buffers (one per layer, say): the payload is a plain concatenation, so the
    node sees one range however the caller's memory is split. An item that continues the
    frame's last one in the segment (the next key of a run, master/puts.py) extends it
    (`join`): a batch of 128 pages of one run is one item, not 128 for both sides to encode,
    decode and check."""

    def __init__(
        self,
        endpoint: str,
        make_item: Callable[[object, int, int], WriteItem | ReadItem],
        make_message: Callable[[list, list[memoryview]], WriteSlices | ReadSlices],
        join: Callable[[WriteItem | ReadItem, object, int, int], bool],
        span: Span | None = None,
    ) -> None:
        self.batch = RemoteBatch(endpoint, [], [])
        self._make_item = make_item
        self._join = join
        self._make_message = make_message
        self._span = span
        self._items: list = []
        self._views: list[memoryview] = []
        self._addresses: list[int | None] = []  # per view, where it starts in registered memory
        self._owners: list[int] = []
        self._item_bytes: list[int] = []
        self._frame_bytes = 0

    def add(self, key_index: int, target: object, parts: Sequence[memoryview], address: int | None = None) -> None:
        """`address`: where a one-part object's buffer starts in registered memory, if known;
        with a `span`, the reply sinks of objects that follow each other there become one."""
        if len(parts) == 1 and 0 < len(parts[0]) <= limits.SLICE_SIZE_BYTES_MAX:  # the common case
            self._add_item(key_index, target, 0, len(parts[0]), parts, address)
            return
        start = 0
        item_views: list[memoryview] = []
        item_bytes = 0
        for part in parts:
            position = 0
            while position < len(part):
                take = min(len(part) - position, limits.SLICE_SIZE_BYTES_MAX - item_bytes)
                item_views.append(part[position : position + take])
                item_bytes += take
                position += take
                if item_bytes == limits.SLICE_SIZE_BYTES_MAX:
                    self._add_item(key_index, target, start, item_bytes, item_views)
                    start, item_views, item_bytes = start + item_bytes, [], 0
        if item_bytes:
            self._add_item(key_index, target, start, item_bytes, item_views)

    def finish(self) -> RemoteBatch:
        if self._items:
            self._close_frame()
        return self.batch

    def _add_item(
        self,
        key_index: int,
        target: object,
        start: int,
        size: int,
        views: Sequence[memoryview],
        address: int | None = None,
    ) -> None:
        if not self._items or not self._join(self._items[-1], target, start, size):
            self._items.append(self._make_item(target, start, size))
        self._views += views
        if self._span is not None:
            self._addresses += [address] if len(views) == 1 else [None] * len(views)
        self._owners.append(key_index)
        self._item_bytes.append(size)
        self._frame_bytes += size
        if self._frame_bytes >= FRAME_BYTES_TARGET or len(self._owners) >= limits.BATCH_KEYS_MAX:
            self._close_frame()

    def _close_frame(self) -> None:
        views = self._views if self._span is None else _coalesced(self._views, self._addresses, self._span)
        self.batch.frames.append((self._make_message(self._items, views), views))
        self.batch.owners.append(self._owners)
        self.batch.item_bytes.append(self._item_bytes)
        self._items, self._views, self._owners, self._item_bytes, self._frame_bytes = [], [], [], [], 0
        self._addresses = []


class _LandingHasher:
    """Hashes the objects of one read frame as its reply's payload lands (FrameDecoder's
    `on_landed`), each piece while it is still in the core's cache, instead of reading the
    whole batch back from memory once it is in. Records the checksum of each object whose
    bytes are all in this frame (its item is the whole object) in `sums`; the part of an
    object larger than a slice is hashed afterwards, as before."""

    __slots__ = ("_owners", "_item_bytes", "_is_whole", "_sums", "_at", "_left", "_hasher")

    def __init__(self, owners: list[int], item_bytes: list[int], sizes: Sequence[int], sums: dict[int, int]) -> None:
        self._owners = owners
        self._item_bytes = item_bytes
        self._is_whole = [size == sizes[index] for index, size in zip(owners, item_bytes)]
        self._sums = sums
        self._at = -1  # the item landing now
        self._left = 0  # its bytes still to come
        self._hasher = xxhash.xxh3_64()

    def __call__(self, view: memoryview) -> None:
        while len(view):
            if not self._left:
                self._at += 1
                self._left = self._item_bytes[self._at]
                self._hasher.reset()
            take = min(len(view), self._left)
            if self._is_whole[self._at]:
                self._hasher.update(view if take == len(view) else view[:take])
            self._left -= take
            view = view[take:]
            if not self._left and self._is_whole[self._at]:
                self._sums[self._owners[self._at]] = self._hasher.intdigest()


def _coalesced(views: list[memoryview], addresses: list[int | None], span: Span) -> list[memoryview]:
    """The views, with each run that follows on in registered memory made one view: a
    zero-copy get of pages laid out back to back then lands in a few large receives instead
    of one per page (and the decoder's staging copy for small ones)."""
    out: list[memoryview] = []
    run: list[memoryview] = []
    run_start = run_end = -1

    def close_run() -> None:
        if len(run) > 1:
            try:
                out.append(span(run_start, run_end - run_start))
                return
            except KVPoolError:
                pass  # two registered buffers back to back: a view spans one only
        out.extend(run)

    for view, address in zip(views, addresses):
        if address is not None and address == run_end:
            run.append(view)
            run_end += len(view)
            continue
        close_run()
        run = [view]
        run_start, run_end = (address, address + len(view)) if address is not None else (-1, -1)
    close_run()
    return out


def new_put_id() -> int:
    """A put's id (PutStart.put_id): from the OS's randomness, so that writers never share
    one. Not the `random` module's: applications seed it (vLLM's workers to 0), and every
    instance would then draw the same ids."""
    return secrets.randbits(63) | 1


class PutJob:
    """One put batch after put_start: where every key's bytes go, and what became of them.

    `codes[i]` is OK until a step fails for key i. Keys whose object already existed are done
    (OK) and write nothing. `put_id` is the PutStart's, for its PutEnd and PutRevoke.
    """

    def __init__(
        self,
        keys: Sequence[str],
        parts: Sequence[Sequence[memoryview]],
        reply: PutStartReply,
        local_segments: LocalSegments,
        put_id: int,
        sent_ms: int | None = None,
    ) -> None:
        """`sent_ms`: the monotonic time the put_start left (before its answer: None, now)."""
        self.keys = list(keys)
        self.put_id = put_id
        self.parts = parts
        # When writes to other hosts must end by (monotonic ms): two thirds of the grants' life
        # from now (the put_start was answered just before), the rest left for the put_end.
        # A writer that waited the whole transfer timeout (30 s, as long as the grants) on one
        # stalled node raced the master's discard: the replicas it did write were lost with
        # the put, and every key failed.
        grant_ttl_ms = reply.grant_ttl_ms or limits.PUT_DISCARD_TIMEOUT_MS_DEFAULT
        self.writes_deadline_ms = now_monotonic_ms() + grant_ttl_ms * 2 // 3
        # When copies into mapped segments must have begun by (monotonic ns): the grants'
        # life from when the put_start left, before the master started it (see copy_local).
        sent_ms = now_monotonic_ms() if sent_ms is None else sent_ms
        self.copies_deadline_ns = (sent_ms + grant_ttl_ms) * 1_000_000
        self.checksums: list[int] = []
        self.codes: list[int] = []
        self.needs_end: list[bool] = []
        self.hashed_in_place: list[str] = []  # see PutEnd; known after copy_local
        self.unwritten: list[tuple[int, str]] = []  # see PutEnd; known after settle_writes
        self._reply = reply
        # The same-host replicas, in three lists of ints rather than a tuple and a view each:
        # a batch of pages then keeps fewer objects alive for the garbage collector to find
        # and promote (each promotion brings the next full collection of the whole heap
        # nearer; see copy_local).
        self._local_keys: list[int] = []  # key index
        self._local_grants: list[int] = []  # grant index (its mapped segment's data)
        self._local_offsets: list[int] = []  # where the replica starts in that data
        self._sizes = [0] * len(self.keys)
        cutters: dict[str, _FrameCutter] = {}
        # Per grant (keys of a run share one): the mapped segment's data, or None (TCP).
        self._mapped_data = mapped_data = [
            segment.data if (segment := local_segments(reply.segments[grant.segment_id])) else None
            for grant in reply.grants
        ]
        self.granted_segments = [grant.segment_id for grant in reply.grants]
        for index, code in enumerate(reply.codes):
            if code == ErrorCode.OBJECT_ALREADY_EXISTS:
                self.codes.append(_OK)
                self.needs_end.append(False)
                continue
            self.codes.append(code)
            self.needs_end.append(code == _OK)
            if code != _OK:
                continue
            key_parts = parts[index]
            size = len(key_parts[0]) if len(key_parts) == 1 else sum(len(part) for part in key_parts)
            self._sizes[index] = size
            for grant_index, start in reply.placements[index]:
                grant = reply.grants[grant_index]
                if mapped_data[grant_index] is not None:
                    self._local_keys.append(index)
                    self._local_grants.append(grant_index)
                    self._local_offsets.append(grant.offset + start)
                    continue
                endpoint = reply.segments[grant.segment_id].endpoint
                cutter = cutters.get(endpoint)
                if cutter is None:
                    cutter = cutters[endpoint] = _FrameCutter(endpoint, _write_item, _write_slices, _joined_write)
                cutter.add(index, (grant, start), key_parts)
        self.remote = [cutter.finish() for cutter in cutters.values()]

    def copy_local(self) -> None:
        """Copy the same-host replicas into the mapped segments and checksum every key to be
        written. Runs in the caller's thread (and the hashing pool's, for a large batch). A key
        with a local replica is hashed chunk by chunk as it is copied (checksums.py).

        A page (one part, up to SMALL_COPY_BYTES_MAX) is copied into a view of its range made
        for that copy alone: a batch of 128 pages kept ~9 tracked objects per key alive here,
        so the cyclic collector ran during nearly every batch and promoted them, and a full
        collection of the client's heap (~25 ms for 32,000 objects on this VM) came every
        ~80 batches: 0.2-0.36 ms per batch, 15-25% of the client's CPU (ad hoc, gc.callbacks).

        A copy into a mapped segment goes straight into the node's memory: no node checks its
        grant, so each object's copy is refused here once the grants may have lapsed
        (copies_deadline_ns; a caller stalled since its put_start, by SIGSTOP or swapping): the
        master may have discarded the put by then and, after the release timeout, granted the
        range to another put, whose bytes the copy would overwrite. The key fails as a write
        the node refuses for its expired grant does (TRANSFER_FAIL, revoked). A stall in the
        middle of the copies (those larger than a page go in one call) still lands
        late: only the release timeout covers that (10 minutes by default, against the grants' 30 s).
        """
        checksums = [0] * len(self.keys)
        local_keys, grants, offsets, sizes = self._local_keys, self._local_grants, self._local_offsets, self._sizes
        mapped_data, parts = self._mapped_data, self.parts
        deadline_ns, clock = self.copies_deadline_ns, time.monotonic_ns
        # Key index -> position of its first local replica (-1: late, not copied).
        first: dict[int, int] = {}
        larger: list[int] = []  # positions of first replicas not a page
        late: set[int] = set()  # key indexes whose copies came after their grants
        for position, index in enumerate(local_keys):
            if index in first:
                continue
            if position % DEADLINE_CHECK_EVERY == 0 and clock() > deadline_ns:  # and the keys after it
                for later in local_keys[position:]:
                    if later not in first:
                        first[later] = -1
                        late.add(later)
                break
            first[index] = position
            key_parts = parts[index]
            if len(key_parts) == 1 and sizes[index] <= SMALL_COPY_BYTES_MAX:
                start = offsets[position]
                destination = mapped_data[grants[position]][start : start + sizes[index]]  # type: ignore[index]
                checksums[index] = copy_small_checksummed(key_parts[0], destination)
            else:
                larger.append(position)
        # One call for all of them, spread over the copying threads (in pieces of 8 MiB, each
        # after a look at the deadline, same-host puts of 1 MiB ran at 0.77 of the numpy copy
        # against 0.84, medians of six bench_core runs alternating, 2026-12-06): the grants' 30 s
        # do not end in the few ms a batch's copy takes but by a stall, and one in the middle
        # of a copy is not caught anyway (the docstring).
        if larger and clock() > deadline_ns:
            late.update(local_keys[p] for p in larger)
        elif larger:
            sources = [parts[local_keys[p]] for p in larger]
            destinations = [[self._destination(p)] for p in larger]
            landed = copies_checksummed(sources, destinations, SIMD_COPY_INTO_SEGMENT_BYTES_MIN)
            for position, checksum in zip(larger, landed):
                checksums[local_keys[position]] = checksum
        hashed, copied = set(), set()
        for position, index in enumerate(local_keys):
            segment_id = self.granted_segments[grants[position]]
            if first[index] == position:
                hashed.add(segment_id)
            elif index in late:
                continue
            elif (
                position % DEADLINE_CHECK_EVERY == 0 or sizes[index] > SMALL_COPY_BYTES_MAX
            ) and clock() > deadline_ns:
                late.add(index)
            else:  # a second same-host replica: copy the first (not hashed where it landed)
                self._destination(position)[:] = self._destination(first[index])
                copied.add(segment_id)
        self.hashed_in_place = sorted(hashed - copied)
        if late:
            self._fail_late(late)
        remote_only = [i for i, needs_end in enumerate(self.needs_end) if needs_end and i not in first]
        for index, checksum in zip(remote_only, checksums_of([parts[i] for i in remote_only])):
            checksums[index] = checksum
        self.checksums = checksums

    def _fail_late(self, late: set[int]) -> None:
        """These keys' copies into mapped segments were refused, past their grants: they fail."""
        for index in late:
            self.codes[index] = int(ErrorCode.TRANSFER_FAIL)
        late_ms = (time.monotonic_ns() - self.copies_deadline_ns) // 1_000_000
        log.warning(
            "%d keys of a put not copied into this host's segments: %d ms past their grants (was this "
            "process stopped or swapped out?); they fail", len(late), late_ms,
        )  # fmt: skip

    def _destination(self, position: int) -> memoryview:
        """The range of the same-host replica at `position` in the mapped segment."""
        start = self._local_offsets[position]
        data = self._mapped_data[self._local_grants[position]]
        return data[start : start + self._sizes[self._local_keys[position]]]  # type: ignore[index]

    def settle_writes(self, failed: Sequence[set[int]]) -> tuple[list[int], list[int]]:
        """Given, per remote batch, the key indexes whose frames failed: the keys to put_end
        and the keys to revoke. A key fails only if every replica failed; the replicas that
        failed of a key put_end'ed are named in its PutEnd (`unwritten`), and the master
        leaves them out."""
        written_somewhere = set(self._local_keys)
        tried: set[int] = set()
        failed_at: list[tuple[int, str]] = []  # (key index, endpoint)
        for batch, failed_keys in zip(self.remote, failed):
            keys = {i for owners in batch.owners for i in owners}
            tried |= keys
            written_somewhere |= keys - failed_keys
            failed_at += [(index, batch.endpoint) for index in failed_keys]
        for index in tried - written_somewhere:
            self.codes[index] = int(ErrorCode.TRANSFER_FAIL)
        end = [i for i, needs in enumerate(self.needs_end) if needs and self.codes[i] == _OK]
        revoke = [i for i, needs in enumerate(self.needs_end) if needs and self.codes[i] != _OK]
        self.unwritten = self._replicas_at(failed_at)
        return end, revoke

    def _replicas_at(self, failed_at: list[tuple[int, str]]) -> list[tuple[int, str]]:
        """(key index, segment id) of the replicas of the keys still OK on the endpoints where
        their writes failed (a node's DRAM and disk tier share its endpoint)."""
        reply, codes = self._reply, self.codes
        return [
            (index, grant.segment_id)
            for index, endpoint in failed_at
            if codes[index] == _OK
            for grant_index, _ in reply.placements[index]
            if reply.segments[(grant := reply.grants[grant_index]).segment_id].endpoint == endpoint
        ]

    def write_timeout_ms(self, transfer_timeout_ms: int) -> int:
        """How long the writes to other hosts may take from now: the transfer timeout, within
        writes_deadline_ms (at least 1 ms: a write that cannot end in time fails, not hangs)."""
        return max(1, min(transfer_timeout_ms, self.writes_deadline_ms - now_monotonic_ms()))

    def unwritten_ends(self) -> tuple[list[str], list[str]]:
        """The keys of a put given up before its put_end: those with a write to another host
        (in flight, or it may be), and those written only into mapped segments (done)."""
        remote = {i for batch in self.remote for owners in batch.owners for i in owners}
        needed = [i for i, needs in enumerate(self.needs_end) if needs]
        return [self.keys[i] for i in needed if i in remote], [self.keys[i] for i in needed if i not in remote]

    def put_end(self, end: Sequence[int]) -> PutEnd:
        """The PutEnd of the keys at `end` (indexes), with their checksums and the replicas
        among them that settle_writes found unwritten."""
        unwritten: list[tuple[int, str]] = []
        if self.unwritten:  # rare: a node failed mid-put
            at = {key_index: position for position, key_index in enumerate(end)}
            unwritten = [(at[index], segment_id) for index, segment_id in self.unwritten if index in at]
        return PutEnd(
            [self.keys[i] for i in end], [self.checksums[i] for i in end], self.hashed_in_place, self.put_id,
            unwritten[: limits.BATCH_KEYS_MAX],
        )  # fmt: skip

    def put_revoke(self, revoke: Sequence[int]) -> PutRevoke:
        """The PutRevoke of the keys at `revoke` (indexes): every write of theirs failed, but a
        write that timed out or broke mid-frame may land yet, so their ranges are quarantined."""
        return PutRevoke([self.keys[i] for i in revoke], writes_in_flight=True, put_id=self.put_id)

    def ended(self, end: Sequence[int], reply: Message) -> None:
        """Take the master's codes for the keys of put_end(end)."""
        assert isinstance(reply, CodesReply)
        for index, code in zip(end, reply.codes):
            self.codes[index] = code


def put_end_of_each(ends: Sequence[tuple[PutJob, list[int]]]) -> PutEnd:
    """One PutEnd for the keys at `end` of each job (the pieces of one put, sync.py, which
    share a put id). A segment counts as hashed in place only where every job granted a range
    of it hashed there."""
    (put_id,) = {job.put_id for job, _ in ends}
    keys: list[str] = []
    checksums: list[int] = []
    unwritten: list[tuple[int, str]] = []
    hashed: set[str] = set()
    not_hashed: set[str] = set()
    for job, end in ends:
        message = job.put_end(end)
        unwritten += [(len(keys) + index, segment_id) for index, segment_id in message.unwritten]
        keys += message.keys
        checksums += message.checksums
        hashed.update(job.hashed_in_place)
        not_hashed.update(set(job.granted_segments) - set(job.hashed_in_place))
    return PutEnd(keys, checksums, sorted(hashed - not_hashed), put_id, unwritten[: limits.BATCH_KEYS_MAX])


def ended_each(ends: Sequence[tuple[PutJob, list[int]]], reply: Message) -> None:
    """Hand each job its share of the codes of put_end_of_each(ends)."""
    assert isinstance(reply, CodesReply)
    at = 0
    for job, end in ends:
        job.ended(end, CodesReply(reply.codes[at : at + len(end)]))
        at += len(end)


# What a get keeps of its read lease for each replica after the one it reads (round_timeout_ms):
# time to read a healthy replica when the first node stopped answering.
READ_FALLBACK_RESERVE_MS = 2_000


class GetJob:
    """One get batch after get_replica_list: replica choice, copies, checks, results.

    `results[i]` is the object's bytes (plain API) or its size (into-buffer API) once read and
    verified; `codes[i]` is OK or why key i is a miss. Nothing unverified is ever returned:
    bytes land in `_landed[i]` (plain API) or the caller's buffers, and become a result only
    once their checksum matches.

    copy_local returns by the reads' deadline whatever a filesystem does, or soon after
    give_up(), and writes nothing into the caller's buffers once it returned (_read_files):
    a sync Store's caller thread must return within its bound, and an AsyncStore get that
    was cancelled, or timed out, hands its buffers straight back to an engine that reuses
    them (a late write there corrupts another request's KV cache unseen).
    """

    def __init__(
        self,
        reply: GetReplicaListReply,
        targets: Sequence[list[memoryview] | None],
        lease_start_ms: int,
        local_segments: LocalSegments,
        keys: Sequence[str] = (),
        local_directories: LocalDirectories | None = None,
        starts: Sequence[int | None] | None = None,
        span: Span | None = None,
        is_slow: Callable[[str], bool] | None = None,
        reads_deadline_ms: int | None = None,
    ) -> None:
        self.reply = reply
        self._is_slow = is_slow  # a node endpoint that stopped answering in time (slow_nodes.py)
        self.targets = targets
        # Where each key's target starts in registered memory (one-buffer targets), and a view
        # of that memory: reply sinks that follow each other there are received as one.
        self._starts = starts
        self._span = span
        self.keys = keys
        self._local_directories = local_directories
        self.codes = list(reply.codes)
        self.results: list[bytes | int | None] = [None] * len(reply.codes)
        self.lease_deadline_ms = lease_start_ms + reply.lease_ttl_ms
        # When every round of TCP reads must have ended (round_timeout_ms), whatever the lease.
        self.reads_deadline_ms = self.lease_deadline_ms if reads_deadline_ms is None else reads_deadline_ms
        # Done once the get's caller stopped waiting (give_up): copy_local ends its reads at once.
        self._given_up: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._copying = False  # a copy_local runs (give_up says so), under _giving_up
        self._giving_up = threading.Lock()
        self._local_segments = local_segments
        # Per key its replicas nearest first, and how many of them were tried: the next to
        # read is candidates[i][tried[i]] (the reply's own list when there is nothing to order:
        # no copy per key, see messages.py on gc=False).
        self._candidates: list[list[Replica]] = []
        self._tried = [0] * len(reply.codes)
        self._landed: list[bytes | memoryview | None] = [None] * len(reply.codes)
        self._reading: dict[int, Replica] = {}  # key index -> the replica its bytes came from
        # Key index -> the checksum of what landed for it over TCP, hashed as it landed.
        self._landed_sums: dict[int, int] = {}
        # (key, replica) whose bytes did not match the object's checksum: for the master to
        # have the node check them, and drop the replica if the node agrees (report_bad).
        self.bad_replicas: list[tuple[str, Replica]] = []
        self._failures = 0  # replicas whose read failed (_next_candidate): copy_local goes on after one
        # Per segment id: the mapped segment, or None (looked up once per segment, not per key).
        self._mapped: dict[str, Segment | None] = {}
        self._has_file_tiers = False  # any disk or DFS segment among the replicas
        for info in reply.segments.values():
            if info.tier in _FILE_TIERS:
                self._has_file_tiers = True
                break
        codes, candidates = self.codes, self._candidates
        for index, (code, replicas) in enumerate(zip(reply.codes, reply.replicas)):
            if code != _OK:
                candidates.append([])
                continue
            target = targets[index]
            room = 0 if target is None else len(target[0]) if len(target) == 1 else sum(map(len, target))
            if target is not None and reply.sizes[index] > room:
                codes[index] = int(ErrorCode.BUFFER_OVERFLOW)
            elif not replicas:
                codes[index] = int(ErrorCode.OBJECT_NOT_FOUND)
            if codes[index] != _OK:
                candidates.append([])
            elif len(replicas) == 1 and not self._has_file_tiers:
                candidates.append(replicas)  # the common case: nothing to order (the reply's own list)
            else:
                candidates.append(self._order(replicas))
                if not candidates[index]:
                    codes[index] = int(ErrorCode.TRANSFER_FAIL)  # only DFS replicas, no DFS here

    def _order(self, replicas: list[Replica]) -> list[Replica]:
        """Nearest first: local DRAM, remote DRAM, local disk, remote disk, DFS (each in the
        master's order), but replicas on a node that stopped answering in time last; a DFS
        replica this host cannot open is left out."""
        segments = self.reply.segments
        if len(replicas) == 1 and segments[replicas[0].segment_id].tier != TIER_DFS:
            return list(replicas)  # The common case: nothing to order, nothing to leave out.
        ranked: list[tuple[int, Replica]] = []
        for replica in replicas:
            info = segments[replica.segment_id]
            tier = info.tier if info.tier in TIERS else TIERS[0]
            if tier == TIERS[0]:
                is_local = self._local_segments(info) is not None
            else:
                is_local = self._local_directories is not None and self._local_directories(info) is not None
                if tier == TIER_DFS and not is_local:
                    continue
            rank = 2 * TIERS.index(tier) + (0 if is_local else 1)
            if self._is_slow is not None and tier != TIER_DFS and self._is_slow(info.endpoint):
                rank += 2 * len(TIERS)
            ranked.append((rank, replica))
        ranked.sort(key=lambda pair: pair[0])
        return [replica for _, replica in ranked]

    def pending_indexes(self) -> list[int]:
        results = self.results
        return [i for i, c in enumerate(self.codes) if c == _OK and results[i] is None]

    def reads_files(self) -> bool:
        """Whether copy_local would read object files here (disk or DFS replicas)."""
        return self._has_file_tiers and any(self._file_path(i) is not None for i in self.pending_indexes())

    def copy_local(self, read_files: bool = True) -> None:
        """Read every pending key whose next candidate replica is here (a mapped segment, an
        object file this host opens, unless not `read_files`), then verify. A key whose read
        fails goes on to its next candidate, read in another pass when that one is here too (a
        rotted disk file, then the DFS copy): with one pass it went to the TCP reads, which
        have no way to a DFS file (a sync get raised InvalidParams, an async one missed).
        Without `read_files` (on an event loop, where a disk's latency must not stall it), keys
        whose next candidate is a file here are left for a call that reads them (reads_files)."""
        with self._giving_up:
            if self._given_up.done():
                return
            self._copying = True
        try:
            while not self._given_up.done():
                failures = self._failures
                self._copy_local_pass(read_files)
                if self._failures == failures:
                    return
        finally:
            with self._giving_up:
                self._copying = False

    def give_up(self) -> bool:
        """The get's caller stopped waiting (an AsyncStore get cancelled): a copy_local under
        way on another thread stops waiting for its file reads and returns within a chunk's
        copy (_Handover.close), writing nothing more into the caller's buffers, and one not
        begun yet (a worker still queued) does nothing. Whether one was under way (then wait
        for it to return). Any thread."""
        with self._giving_up:
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # given up before
                self._given_up.set_result(None)
            return self._copying

    def _copy_local_pass(self, read_files: bool) -> None:
        reply = self.reply
        segments, sizes, checksums = reply.segments, reply.sizes, reply.checksums
        reads: list[tuple[int, Path]] = []  # object files this host can open
        mapped: list[int] = []  # keys whose next candidate is in a mapped DRAM segment
        candidates, tried, targets, mapped_by_id = self._candidates, self._tried, self.targets, self._mapped
        results, reading = self.results, self._reading
        digest = xxhash.xxh3_64_intdigest
        for index in self.pending_indexes():
            replica = candidates[index][tried[index]]
            segment_id = replica.segment_id
            if segment_id in mapped_by_id:  # a mapped DRAM segment (or a remote one: None)
                segment = mapped_by_id[segment_id]
            else:
                info = segments[segment_id]
                if info.tier in _FILE_TIERS:
                    path = self._file_path(index) if read_files else None
                    if path is not None:
                        reads.append((index, path))
                    continue  # else a remote disk replica (over TCP), or one to read later
                segment = mapped_by_id[segment_id] = self._local_segments(info)
            if segment is None:
                continue
            size, target = sizes[index], targets[index]
            if size <= SMALL_COPY_BYTES_MAX and (target is None or len(target) == 1):
                # A KV page: copy, hash, check, inline (what _check does): a batch of pages is
                # hot, and this keeps no object per page alive (see messages.py on gc=False).
                reading[index] = replica
                tried[index] += 1
                source = segment.data[replica.offset : replica.offset + size]
                if target is None:
                    data = source.tobytes()
                    is_sound = digest(data) == checksums[index]
                else:
                    data = size
                    is_sound = copy_small_checksummed(source, target[0][:size]) == checksums[index]
                if is_sound:
                    results[index] = data
                else:
                    self._found_bad(index)
            else:
                mapped.append(index)
        if reads:
            self._read_files(reads)
        if mapped and not self._given_up.done():
            self._copy_mapped(mapped)

    def _to_prefetch(self, reads: list[tuple[int, Path]]) -> list[Path]:
        """The files of `reads` to advise ahead of reading them: the first FILE_PREFETCH_BYTES_MAX."""
        paths: list[Path] = []
        prefetched_bytes = 0
        for index, path in reads:
            if prefetched_bytes >= FILE_PREFETCH_BYTES_MAX:
                break
            paths.append(path)
            prefetched_bytes += self.reply.sizes[index]
        return paths

    def _read_files(self, reads: list[tuple[int, Path]]) -> None:
        """Read these keys from their object files here, and check them, by the reads'
        deadline or give_up(), whatever a filesystem does: a read stuck in the kernel (a hung
        NFS or DFS mount) held a sync Store's caller thread for good, past the bound every
        call promises, and went on writing into an AsyncStore caller's buffers after its
        cancelled get returned. The files are read on the file-reading threads, into
        memory of their own, and copied from there into the caller's buffers only while this
        thread waits for them (_Handover), so that a read that ends after the get returned
        writes nothing of the caller's. A read not ended by the deadline is given up: its
        key goes on to its next replica (a miss when none is left or the time is up; not
        reported bad, a slow mount is no rotted file), and the read ends on its thread. While
        such reads hold every file-reading thread, the reads of a get are given up at once
        (_HeldReaders)."""
        sizes, keys, targets = self.reply.sizes, self.keys, self.targets
        for index, _ in reads:
            self._take_next(index)
        left_ms = min(self.lease_deadline_ms, self.reads_deadline_ms) - now_monotonic_ms()
        readings: dict[concurrent.futures.Future[tuple[bytes | None, int]], int] = {}  # -> its key's index
        handover = _Handover()
        # Why reads not taken were given up, for the log: a hung mount is the likely cause,
        # but not of a get whose time was up before it began (a slow lookup) or that its
        # caller gave up (None).
        why: str | None = None
        if left_ms <= 0 or self._given_up.done():
            pass
        elif _held_readers.are_all_held():
            why = "every file-reading thread is held by reads given up before"
        else:
            why = "not done by the get's deadline"
            readers = _file_readers.executor()
            advised = self._to_prefetch(reads)  # by the first read, ahead of its own: the device has them all at once
            for index, path in reads:
                target = None if targets[index] is None else _prefix(targets[index], sizes[index])  # type: ignore[arg-type]
                reading = readers.submit(_read_object_apart, path, keys[index], sizes[index], target, handover, advised)
                readings[reading], advised = index, []
        taken: set[int] = set()
        overran = False  # the deadline passed with reads under way (not the caller giving up)
        try:  # each checked as it comes, while the others are read
            waited_for = [*readings, self._given_up] if readings else []
            for reading in concurrent.futures.as_completed(waited_for, timeout=max(0, left_ms) / 1000):
                if reading is self._given_up:
                    break
                index = readings[reading]
                taken.add(index)
                try:
                    self._landed[index], checksum = reading.result()
                except KVPoolError:  # Gone, cut short or unreadable: reported (its node checks), the next replica.
                    self._found_bad(index)
                else:
                    self._check(index, checksum)
                if len(taken) == len(readings):
                    break  # (as_completed would wait on for _given_up)
        except TimeoutError:
            overran = True
        finally:  # the deadline passed, given up, or Ctrl-C: a read not started yet never starts, none goes on writing
            for reading in readings:
                # Only a read that overran its deadline counts as held (a hung mount, perhaps):
                # a get given up meanwhile says nothing of the mount, and four such made every
                # get of the process a miss until their reads ended.
                if not reading.cancel() and not reading.done() and overran:
                    _held_readers.hold(reading)
            handover.close()
        given_up = [(index, path) for index, path in reads if index not in taken]
        if given_up and why is not None and not self._given_up.done():
            _given_up_log.log(
                "%d object file reads (%s, ...) given up: %s (a hung mount?)", len(given_up), given_up[0][1], why
            )
        for index, _ in given_up:
            self._next_candidate(index, ErrorCode.TRANSFER_FAIL)

    def _copy_mapped(self, mapped: list[int]) -> None:
        """Copy these keys (larger than a page, or into several buffers) out of the mapped
        segments of their next candidates, and check them."""
        sizes, targets, segments = self.reply.sizes, self.targets, self._mapped
        indexes: list[int] = []  # hashed as they land: their sources and targets
        sources: list[list[memoryview]] = []
        destinations: list[list[memoryview]] = []
        copied: list[int] = []  # plain gets up to a chunk, hashed after
        fresh: set[int] = set()  # positions in `indexes` of plain gets, landing in new bytes
        for index in mapped:
            replica = self._take_next(index)
            size = sizes[index]
            source = segments[replica.segment_id].data[replica.offset : replica.offset + size]  # type: ignore[union-attr]
            target = targets[index]
            if target is None and size <= COPY_CHUNK_BYTES:
                self._landed[index] = source.tobytes()  # one malloc and memcpy, still in cache
                copied.append(index)
                continue
            if target is None:  # a large plain get: the one copy lands in the bytes returned
                self._landed[index], view = _new_bytes(size)
                target = [view]
                fresh.add(len(indexes))
            indexes.append(index)
            sources.append([source])
            destinations.append(target)
        for index, checksum in zip(indexes, copies_checksummed(sources, destinations, fresh=fresh)):
            self._check(index, checksum)
        self._verify(copied)

    def _file_path(self, index: int) -> Path | None:
        """The object file of key `index`'s next candidate, if it is a disk or DFS replica
        this host can open; else None (DRAM, or read over TCP)."""
        replica = self._candidates[index][self._tried[index]]
        info = self.reply.segments[replica.segment_id]
        if info.tier not in (TIER_DISK, TIER_DFS) or self._local_directories is None:
            return None
        directory = self._local_directories(info)
        if directory is None:
            return None
        if info.tier == TIER_DISK:
            return directory / objectfile.OBJECTS_DIR / objectfile.disk_name(replica.offset)
        return directory / objectfile.dfs_relative_path(self.keys[index], replica.offset)

    def bytes_of(self, batch: RemoteBatch) -> int:
        """The bytes of the objects a batch of remote_batches reads."""
        sizes = self.reply.sizes
        return sum([sizes[index] for index in {index for owners in batch.owners for index in owners}])

    def remote_batches(self) -> list[RemoteBatch]:
        """TCP frames for pending keys whose next candidate is remote, grouped by endpoint."""
        pending = self.pending_indexes()
        if not pending:
            return []
        cutters: dict[str, _FrameCutter] = {}
        pages: dict[str, list[int]] = {}  # plain gets of small objects, by endpoint
        segments, sizes, targets, candidates = self.reply.segments, self.reply.sizes, self.targets, self._candidates
        tried = self._tried
        starts = self._starts
        join = _read_joiner(segments)
        for index in pending:
            replica = candidates[index][tried[index]]
            endpoint = segments[replica.segment_id].endpoint
            if not endpoint:  # a DFS file this host cannot open (no --dfs-dir here): no node serves it
                self._take_next(index)
                self._next_candidate(index, ErrorCode.TRANSFER_FAIL)
                continue
            size = sizes[index]
            target = targets[index]
            if target is None and size <= SMALL_LANDING_BYTES_MAX:
                pages.setdefault(endpoint, []).append(index)
                continue
            if target is None:
                self._landed[index], view = _new_bytes(size)
                parts = [view]
            else:
                parts = _prefix(target, size)
            cutter = cutters.get(endpoint)
            if cutter is None:
                cutter = cutters[endpoint] = _FrameCutter(endpoint, _read_item, _read_slices, join, self._span)
            cutter.add(index, replica, parts, starts[index] if starts is not None and target is not None else None)
        batches = {endpoint: cutter.finish() for endpoint, cutter in cutters.items()}
        sums = self._landed_sums
        for batch in batches.values():
            for owners, item_bytes in zip(batch.owners, batch.item_bytes):
                for index in owners:
                    sums.pop(index, None)  # a sum of an earlier replica's bytes
                batch.landing.append(_LandingHasher(owners, item_bytes, sizes, sums))
        for endpoint, indexes in pages.items():
            batch = batches.setdefault(endpoint, RemoteBatch(endpoint, [], []))
            self._page_frames(batch, indexes, join)
        return list(batches.values())

    def _page_frames(
        self, batch: RemoteBatch, indexes: list[int], join: Callable[[ReadItem, Replica, int, int], bool]
    ) -> None:
        """Frames for plain gets of small objects (KV pages): each frame's payload lands in one
        buffer of the job's own, one receive instead of a sink per object, and each object's
        view of it is hashed, checked and copied into the bytes returned (_verify). Pages that
        follow each other in a DRAM segment are read as one item (`join`, up to a slice)."""
        sizes, candidates, tried, landed = self.reply.sizes, self._candidates, self._tried, self._landed
        frames: list[list[int]] = []
        frame: list[int] = []
        at = 0
        for index in indexes:
            if frame and (at >= FRAME_BYTES_TARGET or len(frame) >= limits.BATCH_KEYS_MAX):
                frames.append(frame)
                frame, at = [], 0
            frame.append(index)
            at += sizes[index]
        frames.append(frame)
        for frame in frames:
            _, arena = _new_bytes(max(2, sum([sizes[index] for index in frame])))
            items: list[ReadItem] = []
            at = 0
            for index in frame:
                replica, size = candidates[index][tried[index]], sizes[index]
                if not items or not join(items[-1], replica, 0, size):
                    items.append(ReadItem(replica.segment_id, replica.offset, size))
                landed[index] = arena[at : at + size]
                at += size
            batch.frames.append((_read_slices(items, [arena]), [arena[:at]]))
            batch.owners.append(frame)

    def remote_done(self, key_indexes: set[int], failed: set[int]) -> None:
        """TCP reads of `key_indexes` finished; those in `failed` did not arrive whole."""
        arrived = []
        for index in sorted(key_indexes):
            self._take_next(index)
            if index in failed:
                self._landed_sums.pop(index, None)  # of bytes that came before it failed
                self._next_candidate(index, ErrorCode.TRANSFER_FAIL)
            else:
                arrived.append(index)
        self._verify(arrived)

    def round_timeout_ms(self, now_ms: int, transfer_timeout_ms: int) -> int:
        """How long the next round of TCP reads may take: within the transfer timeout and what
        is left of the lease (bytes that land after it lapsed are not returned) and of the
        job's reads_deadline_ms (all rounds together: a lease longer than the sync Store's
        bound on a call, 45 s by default, had rounds of a transfer timeout each run past it,
        RpcTimeout instead of a miss), less READ_FALLBACK_RESERVE_MS for each replica still
        to try after this one, so that a node that stopped answering leaves the next replica
        time to be read instead of taking the whole get down; but at least an equal share of
        the time left. A read slower than that is given up for the next replica: on a KV
        cache, bytes that take seconds to come are worth less than the prefill that
        recomputes them. 0: no time is left, so there is nothing to read for (misses)."""
        candidates, tried = self._candidates, self._tried
        rounds = max((len(candidates[i]) - tried[i] for i in self.pending_indexes()), default=1)
        left_ms = min(self.lease_deadline_ms, self.reads_deadline_ms) - now_ms
        share_ms = max(left_ms // max(1, rounds), left_ms - READ_FALLBACK_RESERVE_MS * (rounds - 1))
        return max(0, min(transfer_timeout_ms, share_ms))

    def finish(self, now_ms: int) -> None:
        """The lease must still hold after the copies; otherwise the bytes may be stale."""
        expired = now_ms > self.lease_deadline_ms
        for index, code in enumerate(self.codes):
            if code == ErrorCode.OK and (expired or self.results[index] is None):
                self.codes[index] = int(ErrorCode.LEASE_EXPIRED if expired else ErrorCode.TRANSFER_FAIL)
                self.results[index] = None

    def _verify(self, indexes: list[int]) -> None:
        """Checksum what landed for these keys (one batch, on several threads when large).
        Pages landed for a plain get are hashed, checked and made bytes in one tight loop
        (what _check does), the rest together."""
        landed, targets, expected, results = self._landed, self.targets, self.reply.checksums, self.results
        digest = xxhash.xxh3_64_intdigest
        others = []
        for index in indexes:
            data = landed[index]
            if targets[index] is not None or type(data) is not memoryview or len(data) > SMALL_LANDING_BYTES_MAX:
                others.append(index)
            elif digest(data) == expected[index]:
                results[index] = bytes(data)
                landed[index] = None
            else:
                self._found_bad(index)
        sums, unhashed = self._landed_sums, []
        for index in others:
            checksum = sums.pop(index, None)
            if checksum is None:
                unhashed.append(index)
            else:  # hashed as it landed (_LandingHasher)
                self._check(index, checksum)
        if unhashed:
            for index, checksum in zip(unhashed, checksums_of([self._landed_views(i) for i in unhashed])):
                self._check(index, checksum)

    def _landed_views(self, index: int) -> list:
        target = self.targets[index]
        if target is None:
            return [self._landed[index]]
        return _prefix(target, self.reply.sizes[index])

    def _check(self, index: int, checksum: int) -> None:
        """Key `index`'s bytes landed with this checksum: a result, or the next replica."""
        if checksum != self.reply.checksums[index]:
            self._found_bad(index)
        elif self.targets[index] is not None:
            self.results[index] = self.reply.sizes[index]
        else:
            data = self._landed[index]
            self.results[index] = data if isinstance(data, bytes) else bytes(data)  # type: ignore[arg-type]
            self._landed[index] = None

    def _found_bad(self, index: int) -> None:
        """Key `index`'s bytes do not match its checksum, or its file here could not be read
        whole: note the replica (report_bad_replicas: where it lives, it is checked, and
        dropped if the check agrees), then try the next one."""
        replica = self._reading.get(index)
        if replica is not None and self.keys:
            self.bad_replicas.append((self.keys[index], replica))
        self._next_candidate(index, ErrorCode.TRANSFER_FAIL)

    def _take_next(self, index: int) -> Replica:
        """Key `index`'s next candidate, now the one its bytes are read from."""
        replica = self._reading[index] = self._candidates[index][self._tried[index]]
        self._tried[index] += 1
        return replica

    def _next_candidate(self, index: int, code: ErrorCode) -> None:
        self._failures += 1
        self._landed[index] = None
        if self._tried[index] >= len(self._candidates[index]):
            self.codes[index] = int(code)


_new_bytes_object = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes_object.restype = ctypes.py_object
_new_bytes_object.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
_BYTES_DATA_OFFSET = bytes.__basicsize__ - 1  # where a bytes object's data starts (ob_sval)


def _new_bytes(size: int) -> tuple[bytes, memoryview]:
    """A new bytes object of `size` bytes and a writable view of its data, so that a plain
    get's payload lands in the very object returned to the caller: no bytearray to zero and
    fault in, and no second copy into bytes (8x faster at 4 MiB here). The view holds the
    object alive. It is written only while the object is still the job's own (a reply that
    misses its deadline while landing closes its connection, transports/connection.py) and
    is never handed out. `size` > 1: CPython shares its empty and one-byte bytes objects."""
    data = _new_bytes_object(None, size)
    address = id(data) + _BYTES_DATA_OFFSET
    page_advice.advise_huge_pages(address, size)
    array = (ctypes.c_char * size).from_address(address)
    array._owner = data  # type: ignore[attr-defined]
    return data, memoryview(array).cast("B")


def _write_slices(items: list[WriteItem], views: list[memoryview]) -> WriteSlices:
    return WriteSlices(items)


def _read_slices(items: list[ReadItem], sinks: list[memoryview]) -> ReadSlices:
    """Telling the node where the reply lands (a page offset: no address leaves the process)
    lets it pad the reply for the copy into `sinks` (frames.payload_padding)."""
    return ReadSlices(items, buffer_address(sinks[0]) % PAGE_BYTES)


def write_landing(message: WriteSlices) -> int:
    """Where a node lands the payload of `message`, modulo a page: its segment's mapping starts
    a page (node/segment.py), the data a header after it."""
    item = message.items[0]
    return (limits.SEGMENT_HEADER_SIZE_BYTES + item.grant.offset + item.start) % PAGE_BYTES


def _write_item(placement: object, start: int, size: int) -> WriteItem:
    grant, key_start = placement  # type: ignore[misc]
    return WriteItem(grant, key_start + start, size)


def _read_item(replica: Replica, start: int, size: int) -> ReadItem:
    return ReadItem(replica.segment_id, replica.offset + start, size)


def _joined_write(last: WriteItem, placement: object, start: int, size: int) -> bool:
    """Extend `last` by the item _write_item(placement, start, size) would make if that item
    follows it under the same grant (within a slice)."""
    grant, key_start = placement  # type: ignore[misc]
    return last.grant is grant and last.start + last.size == key_start + start and _grown(last, size)


def _read_joiner(segments: dict[str, SegmentInfo]) -> Callable[[ReadItem, Replica, int, int], bool]:
    """Extend the last read item by the item _read_item(replica, start, size) would make if that
    item follows it in the same DRAM segment (within a slice). Not in a disk tier: there each
    object is a file of its own."""

    def join(last: ReadItem, replica: Replica, start: int, size: int) -> bool:
        return (
            last.segment_id == replica.segment_id
            and last.offset + last.size == replica.offset + start
            and segments[replica.segment_id].tier == TIER_DRAM
            and _grown(last, size)
        )

    return join


def _grown(last: WriteItem | ReadItem, size: int) -> bool:
    """Grow `last` by `size` bytes, unless that makes it more than a slice."""
    if last.size + size > limits.SLICE_SIZE_BYTES_MAX:
        return False
    last.size += size
    return True


# The process's threads that read disk and DFS object files for gets (preadv releases the
# GIL): a batch's files are read at once, as the device prefers.
_file_readers = ThreadPool(FILE_READ_THREADS, "kvpool-file-read")


# A read apart into the caller's buffers (_read_object_apart) comes through memory of its
# thread's own this many bytes at a time, in cache (a core's L2 here), and is copied on from
# there. Batches of 4 MiB objects read from a same-host disk tier into registered buffers:
# 2.2-2.6 GB/s cold and 3.3-3.7 warm, as straight into them; the extra copy shows in a get of
# one 4 MiB object (7-10% slower) and in batches of 64 KiB objects (10-20%) (interleaved runs
# on this VM, ad hoc; 256 KiB at a time, 4 MiB batches were 0.8x warm).
BOUNCE_BYTES = limits.MIB
HANDOVER_CLOSE_WAIT_S = 1.0  # _Handover.close
_bounces = threading.local()  # each file-reading thread's (page-aligned: preadv's fast case)


class _Handover:
    """The caller's buffers of one get, lent to the file-reading threads that read into them
    apart (_read_files) for as long as the get waits for them. A thread writes into them
    only between begin() and end(), a copy out of its own memory (no filesystem call), and
    begins none once the get closed the handover; close() returns once no copy is under way.
    So nothing writes the caller's buffers after the get returned, whatever a filesystem does."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._copies = 0  # under way
        self._is_closed = False

    def begin(self) -> bool:
        """Whether the caller's buffers may be written now (then call end() after)."""
        with self._changed:
            if self._is_closed:
                return False
            self._copies += 1
            return True

    def end(self) -> None:
        with self._changed:
            self._copies -= 1
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._is_closed = True
            # A copy of a chunk ends in microseconds; one that does not writes memory that
            # does not answer (a buffer mapped from a hung filesystem): said, not waited for.
            if not self._changed.wait_for(lambda: not self._copies, timeout=HANDOVER_CLOSE_WAIT_S):
                log.warning("a copy into a get's buffers had not ended %.0f s after it gave up", HANDOVER_CLOSE_WAIT_S)


class _HeldReaders:
    """How many file-reading threads a read apart holds that its get gave up (a hung mount).
    With every one held, a get gives its reads of files up at once, rather than queue them
    behind reads that may never end: each get waited out its deadline (a transfer timeout,
    30 s by default) for a miss, and the queue grew with every get for as long as the mount
    hung. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    def are_all_held(self) -> bool:
        return self._count >= FILE_READ_THREADS

    def hold(self, reading: concurrent.futures.Future) -> None:
        """`reading`, given up while it ran, holds its thread until it ends."""
        with self._lock:
            self._count += 1
        reading.add_done_callback(self._ended)

    def _ended(self, _: concurrent.futures.Future) -> None:
        with self._lock:
            self._count -= 1

    def forget(self) -> None:
        """In a forked child: the held threads are the parent's (process.ThreadPool)."""
        self._lock = threading.Lock()
        self._count = 0


_held_readers = _HeldReaders()
os.register_at_fork(after_in_child=_held_readers.forget)
_given_up_log = RepeatedLog(log, logging.WARNING)  # each get says it while a mount hangs


def _read_object_apart(
    path: Path, key: str, size: int, target: list[memoryview] | None, handover: _Handover, advised: list[Path]
) -> tuple[bytes | None, int]:
    """Read an object from its file on a file-reading thread (_read_files), hashing it
    as it comes, after advising the files `advised` (files.prefetch). For a plain get
    (`target` None): a new bytes object, and its checksum (a large object's made by
    _new_bytes, which faults in a few huge pages rather than 4 KiB at a time). Into the
    caller's buffers (`target`, exactly `size` bytes): through this thread's bounce memory,
    each chunk copied on while `handover` allows; None and the checksum. A read whose get
    gave up meanwhile stops at its next chunk (its answer then is of no use).

    Raises:
        KVPoolError: as files.open_object and files.read_range_into.
    """
    for advised_path in advised:
        files.prefetch(advised_path)
    if target is None:
        if size <= SMALL_LANDING_BYTES_MAX:
            data = files.read_object_bytes(path, key, size)
        else:
            data, view = _new_bytes(size)
            files.read_object_into(path, key, size, [view])
        return data, checksum_of([data])
    bounce: memoryview | None = getattr(_bounces, "view", None)
    if bounce is None:
        bounce = _bounces.view = memoryview(mmap.mmap(-1, BOUNCE_BYTES))
    hasher = xxhash.xxh3_64()
    fd, header = files.open_object(path, key, size)
    try:
        position = header.header_size
        for part in target:
            at = 0
            while at < len(part):
                chunk = bounce[: min(BOUNCE_BYTES, len(part) - at)]
                files.read_range_into(files.FileRange(fd, position, len(chunk)), [chunk])
                hasher.update(chunk)
                if not handover.begin():
                    return None, 0
                try:
                    if len(chunk) >= SIMD_COPY_BYTES_MIN:
                        copy_bytes(chunk, part[at : at + len(chunk)])
                    else:
                        part[at : at + len(chunk)] = chunk
                finally:
                    handover.end()
                at += len(chunk)
                position += len(chunk)
    finally:
        os.close(fd)
    return None, hasher.intdigest()


def _prefix(parts: Sequence[memoryview], size: int) -> list[memoryview]:
    """The first `size` bytes of a list of buffers, as views."""
    if len(parts) == 1 and len(parts[0]) == size:
        return parts  # type: ignore[return-value]  # the common case: one buffer, the object's size
    out = []
    for part in parts:
        if size <= 0:
            break
        take = min(size, len(part))
        out.append(part[:take])
        size -= take
    return out
