"""The node's side of moving objects between tiers: it runs the master's MoveObjects.

The master decides every move (an offload on eviction, a promotion after repeated reads, a
write-through copy at put) and allocates its destination; the node that holds the bytes copies
them, in worker threads, and records the destination in that tier's inventory once the copy is
whole and durable. `Mover` is that executor: validation on the event loop, copies in threads,
bookkeeping back on the loop, one code per item. It is not a policy (the master's) and never
changes a source: the master drops an offloaded source afterwards, like any other replica.

    source (this node's)          destination (this node's)       how
    DRAM segment  ───────────────► disk tier file                 pwritev from the mapping
    DRAM segment  ───────────────► DFS file                       pwritev from the mapping
    disk tier file ──────────────► DFS file                       copy_file_range
    disk tier / DFS file ────────► DRAM segment                   preadv into the mapping,
                                                                  checksum verified

Back-pressure: at most MOVE_QUEUE_BYTES_MAX bytes of moves are admitted at once; a request
beyond that waits for room (bounded by MOVE_TIMEOUT_MS), so the queue between DRAM and disk
never grows without bound. The master keeps its own, smaller, budget per node
(MOVE_INFLIGHT_BYTES_PER_NODE_MAX), so offloads rarely wait here.

Deadline: a request's copies that finish after its `deadline_ms` (the master's clock, as this
node estimates it: node/clock.py) are not recorded, and the files they wrote are removed. The
master gives up on the request a little later and drops its targets before reusing them; a
copy recorded after that drop would be an entry in a range the master hands out again. A
request begun before the node's latest mount (`remounted`: the master timed the node out, or
restarted, and rebuilt the segment from an inventory without the target) is as late.

A copy the master gave up on still runs until it ends (a read stalled on a hung share), so:

    plan (loop)         hold the target (moving.py): no write, commit or move lands there
    copy (thread)       DRAM: into the mapping; disk, DFS: into a temporary file
    check (loop)        late? remove the temporary files; else rename them (thread) into place
    check again (loop)  late? remove the renamed files; else record the entries
    end (loop)          release the targets (a DRAM one a late copy wrote: marked, moving.py)

A late file is never renamed over the file of an object placed there since, and nothing the
master hands out again while the copy runs can be overwritten by it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path

import xxhash

from kvpool import limits
from kvpool.errors import (
    ChecksumMismatch,
    ErrorCode,
    InvalidParams,
    KVPoolError,
    NoAvailableHandle,
    ObjectNotFound,
    SegmentNotFound,
    TransferFailed,
)
from kvpool.node.clock import monotonic_ms, wall_clock_ms
from kvpool.node.disk import DiskTier
from kvpool.node.inventory import Inventory
from kvpool.node.metrics import TierMetrics
from kvpool.node.moving import MovingRanges
from kvpool.node.segment import Segment
from kvpool.protocol.messages import (
    TIER_DFS,
    TIER_DISK,
    TIER_DRAM,
    CodesReply,
    InventoryEntry,
    MoveItem,
    MoveObjects,
)
from kvpool.transports import files
from kvpool.transports.dfs import DfsDirectory
from kvpool.transports.files import FileRange

log = logging.getLogger(__name__)


class _SourceGone(Exception):
    """The source could not be read as the object (gone, or not its bytes): the master
    should forget that replica. Raised and caught inside this module only."""


@dataclasses.dataclass
class _Plan:
    """One item, validated, its target held: which tiers, how to copy (in a thread: returns
    the temporary file written, or None for DRAM), how to rename that file into place, and
    what to record."""

    item: MoveItem
    src: str
    dst: str
    copy: Callable[[], Path | None]
    publish: Callable[[Path], None] | None
    entry: InventoryEntry  # the destination, as the destination tier records it
    is_started: bool = False  # its copy ran (may have written its target)


class Mover:
    """Runs MoveObjects for one node. Holds the node's tiers (the DRAM segment and its
    inventory, the disk tier if any, the DFS directory if any), the node's disk threads
    (copies, drops, checks; and those of clients' reads) and the count of admitted bytes.
    Invariant: 0 <= `_admitted_bytes` <= max(MOVE_QUEUE_BYTES_MAX, the
    largest single request in flight); `moving` holds the target of every planned item until
    its copy (and rename) has ended."""

    def __init__(
        self,
        segment: Segment,
        segment_id: str,
        inventory: Inventory,
        disk: DiskTier | None,
        dfs: DfsDirectory | None,
        metrics: TierMetrics,
        *,
        is_durable: bool,
        clock_ms: Callable[[], int] = wall_clock_ms,
    ) -> None:
        self.segment = segment
        self.segment_id = segment_id
        self.inventory = inventory
        self.disk = disk
        self.dfs = dfs
        self.metrics = metrics
        self.is_durable = is_durable
        self._clock_ms = clock_ms  # the master's clock, as estimated here (deadlines are its)
        # The targets of moves in flight, per tier; DRAM's is shared with the handlers that
        # take writes and commits there (node/transfer.py).
        self.moving = {TIER_DRAM: MovingRanges(), TIER_DISK: MovingRanges(), TIER_DFS: MovingRanges()}
        # Mounts begun so far: a request begun under an earlier one is late (the module).
        self._mount_number = 0
        self._admitted_bytes = 0
        self._room = asyncio.Condition()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            limits.DISK_IO_THREADS, thread_name_prefix="kvpool-disk"
        )
        # Clients' disk reads have threads of their own: behind the copies, they waited for
        # the whole backlog a burst of offloads queued (up to MOVE_QUEUE_BYTES_MAX), 0.3 s on
        # this VM's disk for 512 MiB, longer on a slower device or share, for an open and a
        # read-ahead of a millisecond.
        self._read_pool = concurrent.futures.ThreadPoolExecutor(
            limits.DISK_IO_THREADS, thread_name_prefix="kvpool-disk-read"
        )
        # The DFS's copies, renames and removals have threads of their own too: on the disk
        # threads, four copies stalled on a hung share held every one of them, and the disk
        # tier's drops and offloads waited for as long as the share did.
        self._dfs_pool = concurrent.futures.ThreadPoolExecutor(limits.DISK_IO_THREADS, thread_name_prefix="kvpool-dfs")
        # The threads' futures of copies into the DRAM segment still running (copies_into_dram_left).
        self._into_dram: set[concurrent.futures.Future] = set()
        # Disk offsets whose files a drop is removing -> that removal (drop_disk_files).
        self._removing: dict[int, asyncio.Future[list[InventoryEntry]]] = {}

    def __repr__(self) -> str:
        return f"<Mover {self.segment_id} admitted={self._admitted_bytes}>"

    def close(self) -> None:
        for pool in (self._pool, self._read_pool, self._dfs_pool):
            pool.shutdown(wait=False, cancel_futures=True)

    def remounted(self) -> None:
        """The node is mounting its segments (again): the master it mounts on allocates from
        the inventories it is sent, which hold no target of a move in flight, so no move begun
        before is recorded (it is late)."""
        self._mount_number += 1

    async def run_in_thread(self, function: Callable, *args: object) -> object:
        """Run blocking file I/O on this node's disk threads."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, function, *args)

    async def _run_for(self, plan: _Plan, function: Callable, *args: object) -> object:
        """Run a move's file I/O on the DFS's threads when it reads or writes the DFS. A copy
        into the DRAM segment is counted until its thread is done, whatever became of the
        request (`copies_into_dram_left`)."""
        pool = self._dfs_pool if TIER_DFS in (plan.src, plan.dst) else self._pool
        future = pool.submit(function, *args)
        if plan.dst == TIER_DRAM:
            self._into_dram.add(future)
            future.add_done_callback(self._into_dram.discard)
        return await asyncio.wrap_future(future)

    async def copies_into_dram_left(self, wait_ms: int) -> int:
        """How many copies into the DRAM segment still run after waiting for them at most
        `wait_ms` (a request cancelled at stop does not stop its thread): a segment kept for
        the node's restart must have none."""
        running = list(self._into_dram)
        if running:
            await asyncio.wait([asyncio.wrap_future(future) for future in running], timeout=wait_ms / 1000)
        return len(self._into_dram)

    async def read_in_thread(self, function: Callable, *args: object) -> object:
        """Run a client's disk read (opening its files) on the threads kept for reads."""
        return await asyncio.get_running_loop().run_in_executor(self._read_pool, function, *args)

    async def drop_disk_files(self, entries: list[InventoryEntry]) -> tuple[int, list[InventoryEntry]]:
        """Forget disk tier entries (a drop of the master's, or entries it refused at a mount)
        and remove their files, then sync the directory. Returns how many were forgotten and
        those whose file is not removed (kept in DiskTier.unremoved, for the drop sent again).

        The removal runs to its end whatever becomes of its caller, and a drop of the same
        entries sent again (the master's wait for the first ran out: a stalled unlink or
        sync) waits for it: before, that one found nothing left to forget and was acknowledged
        at once, the files still there, and a restart brought the objects back. Each range is
        held (`moving`) until its file is gone, so that no move renames a file into it first
        (a refused entry's range is free at the master at once: a move of the same key there
        had its new file removed as the old). A range a move holds already is left to it (its
        rename replaces the file), as a file not removed."""
        disk = self.disk
        assert disk is not None
        # Until none covers them: a drop sent a third time that woke with the second, after the
        # first's removal left a file, found the second's removal under way, and nothing to
        # forget (a review's reproduction, helper-151).
        while earlier := {job for entry in entries if (job := self._removing.get(entry.offset)) is not None}:
            await asyncio.wait(earlier)
        forgotten = disk.forget(entries)
        moving = self.moving[TIER_DISK]
        held: list[InventoryEntry] = []
        taken: list[InventoryEntry] = []
        for entry in forgotten:
            if moving.is_held(entry.offset, entry.size):
                taken.append(entry)
            else:
                moving.hold(entry.offset, entry.size)
                held.append(entry)
        job = asyncio.ensure_future(self._remove_disk_files(held))
        for entry in held:
            self._removing[entry.offset] = job

        def done(_: asyncio.Future) -> None:
            for entry in held:
                moving.release(entry.offset, entry.size)
                if self._removing.get(entry.offset) is job:
                    del self._removing[entry.offset]

        job.add_done_callback(done)
        disk.unremoved.update((entry.offset, entry) for entry in taken)
        left = await asyncio.shield(job)
        return len(forgotten), [*taken, *left]

    async def _remove_disk_files(self, entries: list[InventoryEntry]) -> list[InventoryEntry]:
        disk = self.disk
        assert disk is not None
        try:
            left = await self.run_in_thread(disk.remove_files, entries)
        except KVPoolError:  # the directory's sync: the unlinks are not durable yet
            disk.unremoved.update((entry.offset, entry) for entry in entries)
            raise
        assert isinstance(left, list)
        disk.unremoved.update((entry.offset, entry) for entry in left)
        return left

    async def move(self, message: MoveObjects) -> CodesReply:
        """Copy each item; one code per item (see messages.MoveObjects).

        Raises:
            InvalidParams: too many items.
            NoAvailableHandle: no room in the queue within MOVE_TIMEOUT_MS, or before the
                deadline (nothing was done).
        """
        items = message.items
        if len(items) > limits.MOVE_ITEMS_PER_REQUEST_MAX:
            raise InvalidParams(f"{len(items)} move items > {limits.MOVE_ITEMS_PER_REQUEST_MAX}")
        mount_number = self._mount_number
        codes: list[int] = [int(ErrorCode.OK)] * len(items)
        plans: list[tuple[int, _Plan]] = []
        await self._look_at_dfs(items)
        try:
            for index, item in enumerate(items):
                try:
                    plans.append((index, self._plan(item)))
                except _SourceGone as exc:
                    log.info("move of %r: %s", item.key, exc)
                    codes[index] = int(ErrorCode.OBJECT_NOT_FOUND)
                except KVPoolError as exc:
                    log.warning("refusing move of %r: %s", item.key, exc)
                    codes[index] = int(exc.code)
            size_bytes = sum(plan.item.size for _, plan in plans)
            await self._admit(size_bytes, self._wait_ms(message.deadline_ms))
            try:
                return await self._run(plans, codes, message.deadline_ms, mount_number)
            finally:
                self._release(size_bytes)
        finally:
            # Every copy and rename of the request has ended here (each is awaited: the reply
            # task is never cancelled while the node serves, Connection._reply_later).
            is_late = self._is_late(message.deadline_ms, mount_number)
            for _, plan in plans:
                item = plan.item
                is_written_late = is_late and plan.dst == TIER_DRAM and plan.is_started
                self.moving[plan.dst].release(
                    item.dst_offset, item.size, written_late_at_ms=monotonic_ms() if is_written_late else None
                )

    async def _run(
        self, plans: list[tuple[int, _Plan]], codes: list[int], deadline_ms: int, mount_number: int
    ) -> CodesReply:
        """Copy, check, rename, check again, record (the module's diagram)."""
        if self._is_late(deadline_ms, mount_number):  # admitted too late: copy nothing
            return await self._too_late(plans, [None] * len(plans), codes)
        for _, plan in plans:
            plan.is_started = True
        outcomes = await asyncio.gather(*(self._run_for(plan, plan.copy) for _, plan in plans), return_exceptions=True)
        if self._is_late(deadline_ms, mount_number):
            return await self._too_late(plans, outcomes, codes)
        failed: dict[tuple[str, str, str], list[tuple[str, object]]] = {}  # (src, dst, why) -> (key, outcome)
        written = [(plan, outcome) for (_, plan), outcome in zip(plans, outcomes) if isinstance(outcome, Path)]
        renamed = await self._publish(written) if written else {}
        if self._is_late(deadline_ms, mount_number):
            return await self._too_late(plans, outcomes, codes, renamed=renamed)
        to_disk: list[InventoryEntry] = []
        to_dram: list[InventoryEntry] = []
        for (index, plan), outcome in zip(plans, outcomes):
            if isinstance(outcome, Path):
                outcome = renamed[id(plan)]
            codes[index] = self._code_of(plan, outcome)
            if codes[index] != ErrorCode.OK:
                failed.setdefault((plan.src, plan.dst, type(outcome).__name__), []).append((plan.item.key, outcome))
                continue
            self.metrics.move_bytes.labels(src=plan.src, dst=plan.dst).inc(plan.item.size)
            if plan.dst == TIER_DISK:
                to_disk.append(plan.entry)
            elif plan.dst == TIER_DRAM:
                to_dram.append(plan.entry)
        if to_dram:
            self._record_promotions(to_dram)
        if to_disk:
            assert self.disk is not None
            displaced = self.disk.record(to_disk)
            # The master hears of the files only once their renames are durable.
            await self.run_in_thread(self.disk.remove_files, displaced)
            await self.run_in_thread(self.disk.sync)
        # One line per kind of failure and request, not per object: a full disk fails every
        # move of a request alike.
        for (src, dst, _), failures in failed.items():
            key, outcome = failures[0]
            more = f" (and {len(failures) - 1} more like it)" if len(failures) > 1 else ""
            log.warning("move of %r from %s to %s failed: %s%s", key, src, dst, outcome, more)
        return CodesReply(codes)

    async def _publish(self, written: list[tuple[_Plan, Path]]) -> dict[int, object]:
        """Rename the temporary files into place (a worker thread); by id(plan): None, or the
        error that left it unrenamed (its temporary file removed)."""

        def rename_all(some: list[tuple[_Plan, Path]]) -> dict[int, object]:
            renamed: dict[int, object] = {}
            for plan, temporary in some:
                assert plan.publish is not None
                try:
                    plan.publish(temporary)
                    renamed[id(plan)] = None
                except Exception as exc:  # any failure is that item's alone (_code_of)
                    renamed[id(plan)] = exc
            return renamed

        renamed: dict[int, object] = {}
        to_dfs = [(plan, temporary) for plan, temporary in written if plan.dst == TIER_DFS]
        to_disk = [(plan, temporary) for plan, temporary in written if plan.dst != TIER_DFS]
        for some in await asyncio.gather(
            *(self._run_for(group[0][0], rename_all, group) for group in (to_dfs, to_disk) if group)
        ):
            assert isinstance(some, dict)
            renamed.update(some)
        return renamed

    def _is_late(self, deadline_ms: int, mount_number: int) -> bool:
        """The master gave up on the request, or rebuilt the segment without its targets."""
        if mount_number != self._mount_number:
            return True
        return bool(deadline_ms) and self._clock_ms() >= deadline_ms

    def _record_promotions(self, entries: list[InventoryEntry]) -> None:
        """Record copies into DRAM. One displacing its own key's older entry is normal: the
        master evicted the object there, and its drop (sent in the background) then matches
        nothing. Displacing another key is not (the master drops a range before reusing it):
        the newest wins, as for commits (node/transfer.py)."""
        promoted = {entry.key for entry in entries}
        displaced = [entry for entry in self.inventory.add(entries) if entry.key not in promoted]
        if displaced:
            log.warning("segment %s: promotions displaced %d objects without a drop: %s",
                        self.segment_id, len(displaced), [e.key for e in displaced[:8]])  # fmt: skip

    async def _too_late(
        self,
        plans: list[tuple[int, _Plan]],
        outcomes: list[object],
        codes: list[int],
        renamed: dict[int, object] | None = None,
    ) -> CodesReply:
        """The request is late (_is_late): record none, remove the files its copies wrote,
        renamed into place (`renamed`: by id(plan), None where it was) or not yet, fail them
        all. A DRAM copy leaves bytes in a range the inventory leaves free."""
        temporaries: list[Path] = []
        dfs_temporaries: list[Path] = []
        to_disk: list[InventoryEntry] = []
        to_dfs: list[InventoryEntry] = []
        disk = self.disk
        for (_, plan), outcome in zip(plans, outcomes):
            if not isinstance(outcome, Path):
                continue
            if renamed is None or id(plan) not in renamed:
                (dfs_temporaries if plan.dst == TIER_DFS else temporaries).append(outcome)
            elif renamed[id(plan)] is None:
                if plan.dst == TIER_DFS:
                    to_dfs.append(plan.entry)
                # A file stays only when the tier holds an entry at that very place for that
                # key (its file: the same bytes); any other at that name is this copy's.
                elif disk is not None and disk.entry_at(plan.entry.key, plan.entry.offset) is None:
                    to_disk.append(plan.entry)
        loop = asyncio.get_running_loop()
        await asyncio.gather(
            self.run_in_thread(self._remove_written, temporaries, to_disk, []),
            loop.run_in_executor(self._dfs_pool, self._remove_written, dfs_temporaries, [], to_dfs),
        )
        for index, plan in plans:
            codes[index] = int(ErrorCode.TRANSFER_FAIL)
            self.metrics.moves.labels(src=plan.src, dst=plan.dst, result="late").inc()
        if plans:
            log.warning("moves of %d objects (%r first) finished after their deadline, or began before the node "
                        "mounted again: not recorded", len(plans), plans[0][1].item.key)  # fmt: skip
        return CodesReply(codes)

    def _remove_written(
        self, temporaries: list[Path], to_disk: list[InventoryEntry], to_dfs: list[InventoryEntry]
    ) -> None:
        """Remove the files of copies not recorded (a worker thread), the disk tier's as its
        drops do (DiskTier.remove_files: then the directory is synced)."""
        left: list[object] = []
        for temporary in temporaries:
            try:
                files.remove(temporary)
            except KVPoolError:
                left.append(temporary)
        if to_disk:
            assert self.disk is not None
            try:
                left += self.disk.remove_files(to_disk)
            except KVPoolError as exc:  # the directory's sync
                log.warning("removing files of moves too late to record: %s", exc)
        for entry in to_dfs:
            assert self.dfs is not None
            try:
                self.dfs.remove(entry.key, entry.offset)
            except KVPoolError:
                left.append(entry)
        if left:
            log.warning("could not remove the files of %d moves too late to record (%r first)", len(left), left[0])

    def _wait_ms(self, deadline_ms: int) -> int:
        """How long admission may wait: MOVE_TIMEOUT_MS, and not past the deadline."""
        if not deadline_ms:
            return limits.MOVE_TIMEOUT_MS
        return max(0, min(limits.MOVE_TIMEOUT_MS, deadline_ms - self._clock_ms()))

    def _code_of(self, plan: _Plan, outcome: object) -> int:
        if outcome is None:  # copied (and, into a file, renamed)
            result, code = "ok", ErrorCode.OK
        elif isinstance(outcome, _SourceGone):
            result, code = "source_gone", ErrorCode.OBJECT_NOT_FOUND
        elif isinstance(outcome, KVPoolError):
            result, code = "failed", outcome.code
        elif isinstance(outcome, BaseException):
            # A bug, that item's alone: raised, it failed the whole request after the other
            # items' files were renamed into place, and left them on disk unrecorded (their
            # space held until a restart adopted them, the master unaware of them).
            log.error("move of %r from %s to %s failed unexpectedly", plan.item.key, plan.src, plan.dst,
                      exc_info=outcome)  # fmt: skip
            result, code = "failed", ErrorCode.TRANSFER_FAIL
        else:
            raise AssertionError(f"unexpected copy outcome {outcome!r}")
        self.metrics.moves.labels(src=plan.src, dst=plan.dst, result=result).inc()
        return int(code)

    # --- admission -------------------------------------------------------------------------

    async def _admit(self, size_bytes: int, wait_ms: int) -> None:
        async with self._room:
            try:
                await asyncio.wait_for(
                    self._room.wait_for(
                        lambda: self._admitted_bytes == 0
                        or self._admitted_bytes + size_bytes <= limits.MOVE_QUEUE_BYTES_MAX
                    ),
                    wait_ms / 1000,
                )
            except asyncio.TimeoutError:
                raise NoAvailableHandle(
                    f"move queue full ({self._admitted_bytes} bytes) for {wait_ms} ms"
                ) from None
            self._admitted_bytes += size_bytes
            self.metrics.move_queue_bytes.set(self._admitted_bytes)

    def _release(self, size_bytes: int) -> None:
        self._admitted_bytes -= size_bytes
        assert self._admitted_bytes >= 0, self._admitted_bytes
        self.metrics.move_queue_bytes.set(self._admitted_bytes)

        async def notify() -> None:
            async with self._room:
                self._room.notify_all()

        asyncio.get_running_loop().create_task(notify())

    # --- planning (event loop) -------------------------------------------------------------

    async def _look_at_dfs(self, items: list[MoveItem]) -> None:
        """Read the DFS directory's identity (on its threads) where `items` name a segment that
        may be the DFS's and it is not known yet: the first DFS move, or one after the master
        made the identity anew. Read on the event loop (`_tier_of`), a share that hung froze
        the node: no heartbeat, and the master dropped its segments."""
        dfs = self.dfs
        if dfs is None:
            return
        known = {self.segment_id, self.disk.segment_id if self.disk is not None else "", dfs.known_segment_id()}
        loop = asyncio.get_running_loop()
        for segment_id in {i.src_segment_id for i in items} | {i.dst_segment_id for i in items}:
            if segment_id not in known:
                await loop.run_in_executor(self._dfs_pool, dfs.is_segment, segment_id)

    def _tier_of(self, segment_id: str) -> str:
        if segment_id == self.segment_id:
            return TIER_DRAM
        if self.disk is not None and segment_id == self.disk.segment_id:
            return TIER_DISK
        if self.dfs is not None and self.dfs.known_segment_id() == segment_id:  # read by _look_at_dfs
            return TIER_DFS
        # The master learns from this code that the DFS is not mounted here (tiers.py).
        raise SegmentNotFound(f"segment {segment_id!r} is not a tier of this node")

    def _plan(self, item: MoveItem) -> _Plan:
        """Check an item and hold its target (released by `move` once its copy has ended).

        Raises:
            _SourceGone: the source is not there. SegmentNotFound, InvalidParams: as named.
            TransferFailed: a copy of an earlier move still runs into the target (one the
                master gave up on: the range is not its to give out again until that ends).
        """
        src = self._tier_of(item.src_segment_id)
        dst = self._tier_of(item.dst_segment_id)
        if src == dst or item.size <= 0:
            raise InvalidParams(f"move from {src} to {dst} of {item.size} bytes")
        entry = InventoryEntry(item.key, item.dst_offset, item.size, item.checksum)
        read = self._source(item, src)
        publish: Callable[[Path], None] | None = None
        if dst == TIER_DISK:
            disk = self.disk
            assert disk is not None
            if not 0 <= item.dst_offset <= disk.capacity_bytes - item.size:
                raise InvalidParams(f"disk range [{item.dst_offset}, +{item.size}) outside the tier")

            def copy() -> Path | None:
                with read() as source:
                    return disk.write_temporary(entry, source)

            publish = functools.partial(disk.publish, entry)

        elif dst == TIER_DFS:
            dfs = self.dfs
            assert dfs is not None

            def copy() -> Path | None:
                with read() as source:
                    # Named after this run's DRAM segment: the master removes the file once
                    # that segment is gone, should this node die before it does.
                    return dfs.write_temporary(item.key, item.dst_offset, item.checksum, source,
                                               is_durable=self.is_durable, writer_id=self.segment_id)  # fmt: skip

            publish = functools.partial(dfs.publish, item.key, item.dst_offset, is_durable=self.is_durable)

        else:
            if not 0 <= item.dst_offset <= self.segment.capacity_bytes - item.size:
                raise InvalidParams(f"DRAM range [{item.dst_offset}, +{item.size}) outside the segment")
            if not self.inventory.is_range_free(item.dst_offset, item.size):
                raise InvalidParams(f"DRAM range [{item.dst_offset}, +{item.size}) holds an object")
            target = self.segment.data[item.dst_offset : item.dst_offset + item.size]

            def copy() -> Path | None:
                with read() as source:
                    if isinstance(source, FileRange):
                        files.read_range_into(source, [target])
                    else:
                        target[:] = source[0]
                if xxhash.xxh3_64_intdigest(target) != item.checksum:
                    raise _SourceGone(f"bytes of {item.key!r} do not match its checksum")
                return None

        moving = self.moving[dst]
        if moving.is_held(item.dst_offset, item.size):
            raise TransferFailed(
                f"{dst} range [{item.dst_offset}, +{item.size}) is the target of a copy still running"
            )
        moving.hold(item.dst_offset, item.size)
        return _Plan(item, src, dst, copy, publish, entry)

    def _source(self, item: MoveItem, src: str) -> Callable[[], _Source]:
        """Check the source on the loop; returns how a thread opens it."""
        if src == TIER_DRAM:
            held = self.inventory.get(item.key)
            if held is None or (held.offset, held.size, held.checksum) != (item.src_offset, item.size, item.checksum):
                raise _SourceGone(f"DRAM holds no {item.key!r} at {item.src_offset}")
            view = self.segment.data[item.src_offset : item.src_offset + item.size]
            return lambda: _Source([view])
        if src == TIER_DISK:
            disk = self.disk
            assert disk is not None
            entry = disk.entry_at(item.key, item.src_offset)
            if entry is None or (entry.size, entry.checksum) != (item.size, item.checksum):
                raise _SourceGone(f"disk tier holds no {item.key!r} at {item.src_offset}")
            return lambda: _Source(None, lambda: disk.open_range(entry, entry.offset, entry.size))
        dfs = self.dfs
        assert dfs is not None
        path = dfs.path_of(item.key, item.src_offset)

        def open_dfs() -> FileRange:
            fd, header = files.open_object(path, item.key, item.size)
            return FileRange(fd, header.header_size, item.size)

        return lambda: _Source(None, open_dfs)


class _Source:
    """A copy's source, opened in the worker thread: views of the mapping, or a file range
    (closed on exit). A missing or foreign file becomes _SourceGone."""

    def __init__(self, views: list[memoryview] | None, opener: Callable[[], FileRange] | None = None):
        self._views = views
        self._opener = opener
        self._range: FileRange | None = None

    def __enter__(self) -> list[memoryview] | FileRange:
        if self._views is not None:
            return self._views
        assert self._opener is not None
        try:
            self._range = self._opener()
        except (ObjectNotFound, ChecksumMismatch) as exc:
            raise _SourceGone(str(exc)) from exc
        return self._range

    def __exit__(self, *exc: object) -> None:
        if self._range is not None:
            os.close(self._range.fd)
            self._range = None
