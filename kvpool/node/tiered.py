"""The node's request handlers for its slower tiers, in front of transfer.py's DRAM handlers.

A node with a disk tier (or a DFS directory) serves more than its DRAM segment:

- `TieredTransferHandler`, on the transfer server: a ReadSlices whose items name the disk
  segment is answered with file ranges, which the Connection sends with os.sendfile from a
  worker thread (zero copy from the file to the socket; see transports/files.py); items of the
  DRAM segment in the same frame are views of the mapping, as before. Everything else (every
  write, DRAM-only reads) goes to the DRAM `TransferHandler` unchanged.
- `TieredMasterCalls`, on the node's connection to the master: DropObjects of the disk segment
  (forget the entries, remove their files, sync the directory, then acknowledge: the master
  reuses the range only after that) and MoveObjects (node/moves.py); CommitObjects and DRAM
  drops go to the DRAM `MasterCallHandler`. A large commit is verified off the loop; the calls
  that come after it wait until it is recorded, so that a drop or a move of an object never
  overtakes its commit (the master answers a put before its commit is verified, and may drop
  the object right after).

It is not where bytes are copied (moves.py) or files laid out (disk.py), and decides nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence

from kvpool import limits
from kvpool.errors import ErrorCode, InvalidParams, KVPoolError, ObjectNotFound, SegmentNotFound, TransferFailed
from kvpool.node.disk import DiskTier
from kvpool.node.metrics import TierMetrics
from kvpool.node.moves import Mover
from kvpool.node.transfer import MasterCallHandler, TransferHandler
from kvpool.protocol.messages import (
    TIER_DRAM,
    CodesReply,
    CommitObjects,
    DropObjects,
    InventoryEntry,
    Message,
    MoveObjects,
    OkReply,
    ReadItem,
    ReadReply,
    ReadSlices,
    VerifyObjects,
)
from kvpool.transports import files
from kvpool.transports.connection import Connection, HandlerResult, Reply
from kvpool.transports.files import FileRange

log = logging.getLogger(__name__)



class TieredTransferHandler:
    """Client requests: disk tier reads here, everything else to the DRAM handler."""

    def __init__(self, dram: TransferHandler, disk: DiskTier | None, mover: Mover, metrics: TierMetrics) -> None:
        self.dram = dram
        self.disk = disk
        self.mover = mover
        self.metrics = metrics

    def __repr__(self) -> str:
        return f"<TieredTransferHandler {self.dram!r} {self.disk!r}>"

    @property
    def connections(self) -> set[Connection]:
        return self.dram.connections

    def close(self) -> None:
        self.dram.close()

    def connection_closed(self, conn: Connection) -> None:
        self.dram.connection_closed(conn)

    def payload_sinks(self, conn: Connection, message: Message) -> Sequence[memoryview] | None:
        return self.dram.payload_sinks(conn, message)  # Clients write to DRAM only.

    def payload_received(self, conn: Connection, message: Message) -> HandlerResult | Awaitable[HandlerResult]:
        return self.dram.payload_received(conn, message)

    def payload_refused(self, conn: Connection, message: Message) -> None:
        self.dram.payload_refused(conn, message)

    def handle(self, conn: Connection, message: Message) -> HandlerResult | Awaitable[HandlerResult]:
        disk = self.disk
        if (
            disk is None
            or not isinstance(message, ReadSlices)
            or not any(item.segment_id == disk.segment_id for item in message.items)
        ):
            return self.dram.handle(conn, message)
        self.dram.connections.add(conn)
        try:
            plan = self._plan_read(message.items, disk)
        except KVPoolError as exc:
            self.dram.metrics.count_error(exc)
            raise
        return self._read(plan, message.landing_offset)

    def _plan_read(self, items: list[ReadItem], disk: DiskTier) -> list:
        """Validate every item first (DESIGN.md §7): DRAM ranges inside the segment, disk
        ranges inside one object each. Returns per item a DRAM view or (the disk entry, or
        None where the tier holds no such object now: sent as zeros, see _read; the item)."""
        self.dram._check_open()
        disk_items = sum(1 for item in items if item.segment_id == disk.segment_id)
        if disk_items > limits.DISK_ITEMS_PER_FRAME_MAX:
            raise InvalidParams(
                f"read of {disk_items} disk items exceeds one frame's {limits.DISK_ITEMS_PER_FRAME_MAX}"
            )
        total = 0
        plan: list = []
        data = self.dram.segment.data
        for index, item in enumerate(items):
            if item.segment_id == disk.segment_id:
                if item.size <= 0 or item.offset < 0:
                    raise InvalidParams(f"read item {index}: [{item.offset}, +{item.size})")
                try:
                    entry: InventoryEntry | None = disk.containing(item.offset, item.size)
                except ObjectNotFound:  # dropped or moved since the reader's lookup
                    entry = None
                plan.append((entry, item))
            else:
                self.dram._check_segment_id(item.segment_id)
                self.dram._check_range(item.offset, item.size, f"read item {index}")
                plan.append(data[item.offset : item.offset + item.size])
            total += item.size
        if total > limits.FRAME_PAYLOAD_SIZE_BYTES_MAX:
            raise InvalidParams(f"read of {total} bytes exceeds one frame ({limits.FRAME_PAYLOAD_SIZE_BYTES_MAX})")
        return plan

    async def _read(self, plan: list, landing: int | None) -> HandlerResult:
        """Open the disk files in a thread (opening may touch the disk), then reply: the
        Connection sends the ranges with sendfile and closes them. Each file is opened once
        per frame, its items sharing the descriptor. A file that cannot be opened whole (gone,
        cut short, another object's) is sent as zeros: the frame's other items still arrive,
        and the reader, whose checksum that item fails, reports the replica, which the master
        then has checked here (_verify_disk) and dropped. Reading on after a cut-short file
        had been opened would close the connection mid-frame. A node out of descriptors fails
        the whole request instead (TransferFailed; the reader tries another replica): zeros
        would have a sound replica reported, and dropped."""
        disk = self.disk
        assert disk is not None

        def open_all() -> list:
            payload: list = []
            opened: dict[int, tuple[int, int]] = {}  # DiskTier.open_range
            unopened: set[int] = set()  # files (entry offsets) found gone or torn: said once
            try:
                for step in plan:
                    if isinstance(step, memoryview):
                        payload.append(step)
                        continue
                    entry, item = step
                    if entry is None or entry.offset in unopened:
                        payload.append(memoryview(bytes(item.size)))
                        continue
                    try:
                        payload.append(disk.open_range(entry, item.offset, item.size, opened))
                    except KVPoolError as exc:
                        if files.is_out_of_descriptors(exc):
                            log.warning("disk tier %s: read of %r refused: %s", disk.segment_id, entry.key, exc)
                            raise TransferFailed(f"node has no file descriptor left to read {entry.key!r}") from exc
                        log.warning("disk tier %s: %r sent as zeros: %s", disk.segment_id, entry.key, exc)
                        unopened.add(entry.offset)
                        payload.append(memoryview(bytes(item.size)))
            except BaseException:
                files.close_parts([*payload, *(FileRange(fd, 0, 0) for fd, _ in opened.values())])
                raise
            return payload

        payload = await self.mover.read_in_thread(open_all)
        assert isinstance(payload, list)
        disk_bytes = sum(part.size for part in payload if type(part) is FileRange)
        self.metrics.disk_read_bytes.inc(disk_bytes)
        self.metrics.disk_read_requests.inc(sum(1 for part in payload if type(part) is FileRange))
        # The frame's DRAM items, counted as the DRAM handler counts a frame of its own.
        dram_bytes = sum(step.nbytes for step in plan if isinstance(step, memoryview))
        if dram_bytes:
            self.dram.metrics.read_requests.inc()
            self.dram.metrics.read_bytes.inc(dram_bytes)
        total = sum(step.size if type(step) is FileRange else len(step) for step in payload)
        return Reply(ReadReply(total), payload, landing)


class TieredMasterCalls:
    """The master's calls: disk drops and moves here, commits and DRAM drops to the DRAM
    handler."""

    def __init__(self, dram: MasterCallHandler, disk: DiskTier | None, mover: Mover) -> None:
        self.dram = dram
        self.disk = disk
        self.mover = mover
        # Commits are refused where a promotion's copy may still write (node/moving.py).
        dram.moving = mover.moving[TIER_DRAM]
        self._is_closed = False
        # Set while a commit (or a call queued behind one) has not started or finished: the
        # next call starts after it (see the module docstring).
        self._gate: asyncio.Future | None = None

    def __repr__(self) -> str:
        return f"<TieredMasterCalls {self.dram!r} {self.disk!r}>"

    def close(self) -> None:
        self._is_closed = True
        self.dram.close()

    def connection_closed(self, conn: Connection) -> None:
        self.dram.connection_closed(conn)

    def payload_sinks(self, conn: Connection, message: Message) -> Sequence[memoryview] | None:
        return self.dram.payload_sinks(conn, message)

    def payload_received(self, conn: Connection, message: Message) -> HandlerResult | Awaitable[HandlerResult]:
        return self.dram.payload_received(conn, message)

    def payload_refused(self, conn: Connection, message: Message) -> None:
        self.dram.payload_refused(conn, message)

    def handle(self, conn: Connection, message: Message) -> HandlerResult | Awaitable[HandlerResult]:
        gate = self._gate
        if gate is None or gate.done():
            result, commit = self._start(conn, message)
            if commit is not None:
                self._gate = commit
            return result
        # Behind a commit being verified: start in turn, and hold the next call until then.
        turn = asyncio.get_running_loop().create_future()
        self._gate = turn
        return self._in_turn(gate, turn, conn, message)

    async def _in_turn(
        self, previous: asyncio.Future, turn: asyncio.Future[None], conn: Connection, message: Message
    ) -> HandlerResult:
        """Run `message` once the call before it started (a commit: finished); the call
        after it waits on `turn` likewise."""
        is_turn_handed_over = False
        try:
            await asyncio.wait([previous])
            result, commit = self._start(conn, message)
            if commit is not None:
                commit.add_done_callback(lambda _: turn.done() or turn.set_result(None))
                is_turn_handed_over = True
                return await commit
            turn.set_result(None)
            return await result if isinstance(result, Awaitable) else result
        finally:
            if not is_turn_handed_over and not turn.done():
                turn.set_result(None)

    def _start(
        self, conn: Connection, message: Message
    ) -> tuple[HandlerResult | Awaitable[HandlerResult], asyncio.Future | None]:
        """Dispatch `message`; a commit verified off the loop also comes back as the task the
        calls after it must wait for."""
        result = self._dispatch(conn, message)
        if isinstance(message, CommitObjects) and isinstance(result, Awaitable):
            commit = asyncio.ensure_future(result)
            return commit, commit
        return result, None

    def _dispatch(self, conn: Connection, message: Message) -> HandlerResult | Awaitable[HandlerResult]:
        if isinstance(message, MoveObjects):
            if self._is_closed:
                raise SegmentNotFound("node is stopping")
            return self.mover.move(message)
        disk = self.disk
        if isinstance(message, DropObjects) and disk is not None and message.segment_id == disk.segment_id:
            if self._is_closed:
                raise SegmentNotFound("node is stopping")
            return self._drop_disk(disk, message)
        if isinstance(message, VerifyObjects) and disk is not None and message.segment_id == disk.segment_id:
            return self._verify_disk(disk, message)
        return self.dram.handle(conn, message)

    async def _verify_disk(self, disk: DiskTier, message: VerifyObjects) -> HandlerResult:
        """VerifyObjects on the disk tier: read each held object's file on a disk thread and
        hash it; a file gone, torn or unreadable is as bad as one that hashes wrong."""
        held = [disk.entry_at(entry.key, entry.offset) for entry in message.entries]

        def check(entry: InventoryEntry | None) -> ErrorCode:
            if entry is None:
                return ErrorCode.OBJECT_NOT_FOUND
            is_sound = files.holds_object(disk.path_of(entry.offset), entry.key, entry.size, entry.checksum)
            return ErrorCode.OK if is_sound else ErrorCode.TRANSFER_FAIL

        codes = await self.mover.run_in_thread(lambda: [check(entry) for entry in held])
        return CodesReply([int(code) for code in codes])  # type: ignore[union-attr]

    async def _drop_disk(self, disk: DiskTier, message: DropObjects) -> HandlerResult:
        # Forgotten now (no read is served from them from here on), acknowledged once the
        # files are gone for good: the master may hand the range to a new object right after.
        # A file that cannot be removed (a read-only filesystem) fails the drop; the master
        # sends it again until it can (DiskTier.unremoved), and keeps it as a tombstone should
        # the node restart meanwhile, so that the object does not come back.
        tried_before = {entry.offset for entry in message.entries if entry.offset in disk.unremoved}
        forgotten, left = await self.mover.drop_disk_files(message.entries)
        if left:
            is_new = any(entry.offset not in tried_before for entry in left)
            reason = (f"disk tier {disk.segment_id}: {len(left)} of {forgotten} dropped objects' files "
                      f"could not be removed (read-only filesystem?); no longer served")  # fmt: skip
            if is_new:
                log.warning("%s; the drop is acknowledged once they are gone", reason)
            raise TransferFailed(reason)
        log.debug("disk tier %s: dropped %d of %d objects", disk.segment_id, forgotten, len(message.entries))
        return OkReply()
