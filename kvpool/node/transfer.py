"""The node's request handlers: client reads and writes of the segment, and the master's calls.

Two `RequestHandler`s (transports/connection.py) sit on the two kinds of connection a node has:

- `TransferHandler`, on the transfer server clients dial: `WriteSlices` (payload lands straight
  in the segment, zero copy) and `ReadSlices` (reply payload is memoryviews of the mapping,
  zero copy). Every item is validated before any byte moves (DESIGN.md §7): a write needs a
  grant for this segment, signed with the cluster key and unexpired, and must stay inside both
  the grant and the segment and off every committed object; a read must stay inside the segment.
- `MasterCallHandler`, on the connection the node opened to the master: `CommitObjects`
  (verify each entry's size and checksum against the bytes, then record it in the inventory:
  STYLE.md "pair the checks") and `DropObjects`.

It is not the allocator (the master decides where objects go), not the server loop (server.py)
and not a transport: it never touches a socket. Each request is handled synchronously in the
event loop, in arrival order, so a commit and a later drop of the same range never reorder.

Write path, one frame:

    WriteSlices(items) + payload ─► payload_sinks(): validate all items ─┬─ ok: views into
                                                                         │   segment.data
                                                                         └─ error: remembered,
                                                                             payload discarded
                                    handle(): CodesReply([0] * n)  or  ErrorReply(remembered)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from kvpool import checksums, limits
from kvpool.errors import (
    ErrorCode,
    InvalidParams,
    KVPoolError,
    SegmentNotFound,
    TransferFailed,
    Unauthorized,
)
from kvpool.node.clock import monotonic_ms, wall_clock_ms
from kvpool.node.inventory import Inventory
from kvpool.node.metrics import NodeMetrics
from kvpool.node.moving import MovingRanges
from kvpool.node.segment import Segment
from kvpool.protocol import auth
from kvpool.protocol.messages import (
    CodesReply,
    CommitObjects,
    DropObjects,
    InventoryEntry,
    Message,
    OkReply,
    ReadReply,
    ReadSlices,
    VerifyObjects,
    WriteGrant,
    WriteSlices,
)
from kvpool.transports.connection import Connection, HandlerResult, Reply

log = logging.getLogger(__name__)


class _SegmentHandler:
    """What both handlers share: the segment, its id, the inventory, and payload verdicts.

    A payload-bearing request is judged in `payload_sinks` before its bytes arrive. A refusal
    (raised) is the reply, sent by the Connection; once an accepted payload has landed the
    Connection calls `payload_received`.
    """

    def __init__(self, segment: Segment, segment_id: str, inventory: Inventory, metrics: NodeMetrics):
        assert inventory.capacity_bytes == segment.capacity_bytes, (
            inventory.capacity_bytes, segment.capacity_bytes,
        )  # fmt: skip
        self.segment = segment
        self.segment_id = segment_id
        self.inventory = inventory
        self.metrics = metrics
        self.connections: set[Connection] = set()
        self._is_closed = False
        # The DRAM targets of moves whose copies still run (moving.py): nothing lands there.
        # Its own until the node hands it the Mover's (node/server.py, tiered.py).
        self.moving = MovingRanges()

    def close(self) -> None:
        """Refuse every later request (the segment is about to be unmapped)."""
        self._is_closed = True

    def connection_closed(self, conn: Connection) -> None:
        self.connections.discard(conn)

    def payload_sinks(self, conn: Connection, message: Message) -> Sequence[memoryview] | None:
        self.connections.add(conn)
        try:
            self._check_open()
            sinks = self._sinks_for(message)
        except KVPoolError as exc:
            self.metrics.count_error(exc)
            raise
        return sinks

    def handle(self, conn: Connection, message: Message) -> HandlerResult:
        self.connections.add(conn)
        try:
            self._check_open()
            return self._handle(message)
        except KVPoolError as exc:
            self.metrics.count_error(exc)
            raise

    def payload_received(self, conn: Connection, message: Message) -> HandlerResult:
        try:
            self._check_open()
            return self._handle_landed(message)
        except KVPoolError as exc:
            self.metrics.count_error(exc)
            raise

    def payload_refused(self, conn: Connection, message: Message) -> None:
        """The Connection refused a payload `payload_sinks` accepted (RequestHandler)."""

    def _check_open(self) -> None:
        if self._is_closed:
            raise SegmentNotFound(f"segment {self.segment_id} is being unmounted")

    def _check_segment_id(self, segment_id: str) -> None:
        if segment_id != self.segment_id:
            raise SegmentNotFound(f"segment {segment_id[:100]!r} is not on this node ({self.segment_id})")

    def _check_range(self, offset: int, size_bytes: int, what: str) -> None:
        if offset < 0 or size_bytes <= 0 or offset + size_bytes > self.segment.capacity_bytes:
            raise InvalidParams(
                f"{what} [{offset}, +{size_bytes}) is outside segment {self.segment_id} "
                f"of {self.segment.capacity_bytes} bytes"
            )

    # Subclasses: --------------------------------------------------------------------------

    def _sinks_for(self, message: Message) -> Sequence[memoryview]:
        """Validate a payload-bearing request; the views its payload goes into."""
        raise InvalidParams(f"{type(message).__name__} carries no payload")

    def _handle_landed(self, message: Message) -> HandlerResult:
        """Reply to a request whose payload has landed in the views `_sinks_for` gave."""
        raise AssertionError(f"no payload handling for {type(message).__name__}")

    def _handle(self, message: Message) -> HandlerResult:
        raise InvalidParams(f"unexpected {type(message).__name__} request")


class TransferHandler(_SegmentHandler):
    """Serves clients on the node's transfer server: WriteSlices and ReadSlices.

    Args:
        segment: the mapped segment (owned by the Node).
        segment_id: the id the master knows it by; grants and reads must name it.
        inventory: committed objects; a write must not touch one.
        metrics: where requests and bytes are counted.
        keyring: the cluster keys a grant may be signed with (auth.Keyring), or none (grants
            then need only be unexpired).
        clock_ms: the master's wall clock in ms, as the node estimates it (grant expiries are
            the master's times: node/clock.py).
    """

    def __init__(
        self,
        segment: Segment,
        segment_id: str,
        inventory: Inventory,
        metrics: NodeMetrics,
        *,
        keyring: auth.Keyring,
        clock_ms: Callable[[], int] = wall_clock_ms,
    ) -> None:
        super().__init__(segment, segment_id, inventory, metrics)
        self._keyring = keyring
        self._clock_ms = clock_ms
        # The term of the master this segment is mounted with (MountReply); 0 until then.
        self.term = 0
        # Per connection whose write payload is arriving: the timer that closes it when the
        # write's grants expire first (payload_sinks).
        self._payload_deadlines: dict[Connection, asyncio.TimerHandle] = {}

    def __repr__(self) -> str:
        return f"<TransferHandler {self.segment_id} connections={len(self.connections)}>"

    def payload_sinks(self, conn: Connection, message: Message) -> Sequence[memoryview] | None:
        """A write's grants are checked as its header comes; its payload must also come whole
        before they expire: else the connection is closed, and no byte of it lands later. (A
        writer that stalled mid-payload past its grant's expiry and the put's release timeout
        wrote into the range of another object the master had placed there since.)"""
        sinks = super().payload_sinks(conn, message)
        if isinstance(message, WriteSlices) and message.items:
            # One payload at a time per connection: a timer left from an earlier one is over.
            self._payload_over(conn)
            expiry_ms = min(item.grant.expiry_ms for item in message.items)
            delay_s = max(0.0, (expiry_ms - self._clock_ms()) / 1000)
            self._payload_deadlines[conn] = asyncio.get_running_loop().call_later(
                delay_s, conn.close, "a write's grant expired before its payload came whole"
            )
        return sinks

    def payload_received(self, conn: Connection, message: Message) -> HandlerResult:
        self._payload_over(conn)
        return super().payload_received(conn, message)

    def payload_refused(self, conn: Connection, message: Message) -> None:
        # Its size did not match its items: discarded, so its timer must not close the
        # connection at that grant's expiry, under the requests that followed.
        self._payload_over(conn)

    def connection_closed(self, conn: Connection) -> None:
        self._payload_over(conn)
        super().connection_closed(conn)

    def _payload_over(self, conn: Connection) -> None:
        if (deadline := self._payload_deadlines.pop(conn, None)) is not None:
            deadline.cancel()

    def _sinks_for(self, message: Message) -> Sequence[memoryview]:
        if not isinstance(message, WriteSlices):
            return super()._sinks_for(message)
        self._check_write(message)
        # The payload lands in the mapping itself: no staging copy, no per-slice bytes object.
        # Items that follow each other in the segment (the keys of one run, master/puts.py)
        # share one view, so that a batch of small objects is received in place in a few
        # large reads (protocol/frames.py sends sinks under 64 KiB through its staging).
        ranges: list[list[int]] = []
        for item in message.items:
            start = item.grant.offset + item.start
            if ranges and ranges[-1][1] == start:
                ranges[-1][1] = start + item.size
            else:
                ranges.append([start, start + item.size])
        data = self.segment.data
        return [data[start:end] for start, end in ranges]

    def _handle_landed(self, message: Message) -> HandlerResult:
        assert isinstance(message, WriteSlices), type(message).__name__
        self.metrics.write_requests.inc()
        self.metrics.write_bytes.inc(sum(item.size for item in message.items))
        return CodesReply([ErrorCode.OK] * len(message.items))

    def _handle(self, message: Message) -> HandlerResult:
        if isinstance(message, ReadSlices):
            return self._read(message)
        if isinstance(message, WriteSlices):
            # No payload came (a frame with payload goes through payload_sinks): valid only
            # for an empty batch, and _check_write says why otherwise.
            self._check_write(message)
            return CodesReply([])
        return super()._handle(message)

    def _check_write(self, message: WriteSlices) -> None:
        """Every item of a write, before any byte is read.

        Raises:
            SegmentNotFound: a grant for another segment (misrouted, or this node restarted).
            Unauthorized: a forged or expired grant, a grant of another master term, or a
                range holding a committed object (a stale grant: the master drops an object
                before it reuses its range).
            InvalidParams: a range outside the grant or the segment.
            TransferFailed: a range a move's copy may still write (moving.py).
        """
        now_ms = self._clock_ms()
        # The slices of one object, and the objects of one run (master/puts.py), share a grant:
        # check each distinct grant once.
        checked: set[tuple[int, int, int, bytes]] = set()
        for index, item in enumerate(message.items):
            grant = item.grant
            self._check_segment_id(grant.segment_id)
            fields = (grant.offset, grant.size, grant.expiry_ms, grant.mac)
            if fields not in checked:
                self._check_grant(index, grant, now_ms)
                checked.add(fields)
            if item.start < 0 or item.size <= 0 or item.start + item.size > grant.size:
                raise InvalidParams(
                    f"item {index}: slice [{item.start}, +{item.size}) is outside its grant of "
                    f"{grant.size} bytes"
                )
        # The payload must equal the sum of the sizes; the Connection enforces it when it hands
        # our views to the decoder (a mismatch is refused with InvalidParams: payload_refused).

    def _check_grant(self, index: int, grant: WriteGrant, now_ms: int) -> None:
        if not self._keyring.is_valid_grant(grant, now_ms):
            raise Unauthorized(
                f"item {index}: grant for [{grant.offset}, +{grant.size}) is forged or expired"
            )
        if self.term and grant.term != self.term:
            # Granted by an earlier master (before a restart or failover): the master this
            # segment is mounted with now may have given the range to another put since.
            raise Unauthorized(f"item {index}: grant of master term {grant.term}, mounted with {self.term}")
        capacity = self.segment.capacity_bytes
        if grant.offset < 0 or grant.size <= 0 or grant.offset + grant.size > capacity:
            raise InvalidParams(
                f"item {index}: grant [{grant.offset}, +{grant.size}) is outside the segment "
                f"of {capacity} bytes"
            )
        # A granted range was free when granted, and its objects commit only after their
        # writes: a committed object inside it means the grant is stale (the master drops an
        # object before it reuses its range), or its writer is writing after its put_end.
        held = self.inventory.overlapping(grant.offset, grant.size)
        if held:
            raise Unauthorized(
                f"item {index}: grant [{grant.offset}, +{grant.size}) holds committed object "
                f"{held[0].key!r}: stale grant"
            )
        if self.moving.is_held(grant.offset, grant.size):
            # The master gave up on a promotion there and granted the range again, but its
            # copy (a read stalled on a hung disk or share) may still land: the put fails.
            raise TransferFailed(
                f"item {index}: grant [{grant.offset}, +{grant.size}) is the target of a move's copy still running"
            )

    def _read(self, message: ReadSlices) -> HandlerResult:
        total = 0
        for index, item in enumerate(message.items):
            self._check_segment_id(item.segment_id)
            self._check_range(item.offset, item.size, f"read item {index}")
            total += item.size
        if total > limits.FRAME_PAYLOAD_SIZE_BYTES_MAX:
            raise InvalidParams(
                f"read of {total} bytes exceeds one frame ({limits.FRAME_PAYLOAD_SIZE_BYTES_MAX})"
            )
        data = self.segment.data
        views = [data[item.offset : item.offset + item.size] for item in message.items]
        self.metrics.read_requests.inc()
        self.metrics.read_bytes.inc(total)
        return Reply(ReadReply(total), views, message.landing_offset)


class MasterCallHandler(_SegmentHandler):
    """Serves the master's calls on the node's own connection: CommitObjects and DropObjects.

    A commit hashes the committed bytes (xxh3 runs at memory speed, 12-14 GB/s here), off the
    loop when the commit is large, unless the writer hashed them in this segment as they
    landed (a same-host copy: PutEnd.hashed_in_place). Only the hashing leaves the loop:
    entries enter the inventory on the loop, and the master never drops an object whose
    commit is unanswered.
    """

    def __repr__(self) -> str:
        return f"<MasterCallHandler {self.segment_id} {self.inventory!r}>"

    def _handle(self, message: Message) -> HandlerResult:
        if isinstance(message, CommitObjects):
            return self._commit(message)
        if isinstance(message, DropObjects):
            self._check_segment_id(message.segment_id)
            dropped = self.inventory.drop(message.entries)
            log.debug("segment %s: dropped %d of %d objects", self.segment_id, len(dropped),
                      len(message.entries))  # fmt: skip
            return OkReply()
        if isinstance(message, VerifyObjects):
            return self._verify(message)
        return super()._handle(message)

    async def _verify(self, message: VerifyObjects) -> HandlerResult:
        """Hash the objects a reader found bad (ReportBadReplicas), off the loop; only what the
        inventory holds at that key and offset is hashed, against its committed checksum."""
        self._check_segment_id(message.segment_id)
        data = self.segment.data
        held = [self.inventory.get(entry.key) for entry in message.entries]
        found = [h if h is not None and h.offset == e.offset else None for h, e in zip(held, message.entries)]
        views = [[data[h.offset : h.offset + h.size]] for h in found if h is not None]
        sums = iter(await asyncio.get_running_loop().run_in_executor(None, _checksums_in_turn, views))
        codes = []
        for entry in found:
            if entry is None:
                codes.append(ErrorCode.OBJECT_NOT_FOUND)
            elif next(sums) != entry.checksum:
                codes.append(ErrorCode.TRANSFER_FAIL)
                log.warning("segment %s: %r at %d+%d does not hash to its checksum",
                            self.segment_id, entry.key, entry.offset, entry.size)  # fmt: skip
            else:
                codes.append(ErrorCode.OK)
        return CodesReply(codes)

    def _commit(self, message: CommitObjects) -> HandlerResult | Awaitable[HandlerResult]:
        self._check_segment_id(message.segment_id)
        entries = message.entries
        capacity_bytes = self.segment.capacity_bytes
        in_bounds = [0 <= e.offset and 0 < e.size and e.offset + e.size <= capacity_bytes for e in entries]
        is_hashed_in_place = message.is_hashed_in_place
        moving: frozenset[int] = frozenset()
        if self.moving:  # a move's copy runs into this segment, or ran late (rare): moving.py
            moving, is_hashed_in_place = self._check_moving(entries, is_hashed_in_place)
            in_bounds = [ok and index not in moving for index, ok in enumerate(in_bounds)]
        if is_hashed_in_place:  # the writer hashed these bytes here (PutEnd.hashed_in_place)
            codes = [ErrorCode.OK if ok else ErrorCode.INVALID_PARAMS for ok in in_bounds]
            self.metrics.commits_hashed_in_place.inc(sum(in_bounds))
            return self._record(entries, codes, moving)
        data = self.segment.data
        views = [[data[e.offset : e.offset + e.size]] for e, ok in zip(entries, in_bounds) if ok]
        if sum(e.size for e, ok in zip(entries, in_bounds) if ok) < checksums.PARALLEL_BYTES_MIN:
            return self._record(entries, self._codes(entries, in_bounds, checksums.checksums_of(views)), moving)
        return self._commit_later(entries, in_bounds, views, moving)

    def _check_moving(self, entries: list[InventoryEntry], is_hashed_in_place: bool) -> tuple[frozenset[int], bool]:
        """Entries in a range a move's copy may still write are refused (their bytes may be
        overwritten after any check); entries where a late copy wrote are hashed even if the
        writer hashed them in place (a same-host writer may have copied before that copy
        landed). Returns the indexes refused, and whether to take the writer's hash."""
        moving = self.moving
        refused = frozenset(index for index, e in enumerate(entries) if moving.is_held(e.offset, e.size))
        if is_hashed_in_place:
            now_ms = monotonic_ms()
            is_hashed_in_place = not any(moving.is_written_late(e.offset, e.size, now_ms) for e in entries)
        return refused, is_hashed_in_place

    async def _commit_later(
        self, entries: list[InventoryEntry], in_bounds: list[bool], views: list[list[memoryview]],
        moving: frozenset[int],
    ) -> HandlerResult:  # fmt: skip
        """A large commit is hashed off the loop, on one thread: the put was answered already
        (master/server.py), so this is background work, and the cores go to the clients."""
        sums = await asyncio.get_running_loop().run_in_executor(None, _checksums_in_turn, views)
        return self._record(entries, self._codes(entries, in_bounds, sums), moving)

    @staticmethod
    def _codes(entries: list[InventoryEntry], in_bounds: list[bool], sums: list[int]) -> list[int]:
        """Per entry: OK when in bounds and its bytes hash to its checksum."""
        found = iter(sums)
        codes = []
        for entry, ok in zip(entries, in_bounds):
            if not ok:
                codes.append(ErrorCode.INVALID_PARAMS)
            elif next(found) != entry.checksum:
                codes.append(ErrorCode.TRANSFER_FAIL)
            else:
                codes.append(ErrorCode.OK)
        return codes

    def _record(
        self, entries: list[InventoryEntry], codes: list[int], moving: frozenset[int] = frozenset()
    ) -> HandlerResult:
        """Add the verified entries to the inventory; log and count the refused ones (`moving`:
        the indexes refused for a move's copy still running there: TRANSFER_FAIL)."""
        verified = []
        for index, (entry, code) in enumerate(zip(entries, codes)):
            if code == ErrorCode.OK:
                verified.append(entry)
                continue
            if index in moving:
                codes[index] = code = ErrorCode.TRANSFER_FAIL
                reason = "moving"
            else:
                reason = "bounds" if code == ErrorCode.INVALID_PARAMS else "checksum"
            log.warning("segment %s: refusing commit of %r at %d+%d: %s",
                        self.segment_id, entry.key, entry.offset, entry.size, reason)  # fmt: skip
            self.metrics.commits.labels(result=reason).inc()
        self.metrics.commits.labels(result="ok").inc(len(verified))  # once per batch: hot path
        displaced = self.inventory.add(verified)
        # A key put again after a remove replaces its old entry before the old entry's drop
        # arrives (the drop then matches nothing): normal. A displaced *range* is not: the
        # master drops a range before reusing it (DESIGN.md §4), so it did not, or a drop was
        # lost. The newest commit wins either way.
        committed_keys = {entry.key for entry in verified} if displaced else set()
        displaced = [entry for entry in displaced if entry.key not in committed_keys]
        if displaced:
            log.warning(
                "segment %s: commit displaced %d objects without a drop: %s",
                self.segment_id, len(displaced), [e.key for e in displaced[:8]],
            )  # fmt: skip
        return CodesReply(codes)


def _checksums_in_turn(views: list[list[memoryview]]) -> list[int]:
    return [checksums.checksum_of(parts) for parts in views]
