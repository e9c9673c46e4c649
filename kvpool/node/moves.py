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
copy recorded after that drop would be an entry in a range the master hands out again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
from collections.abc import Callable

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
)
from kvpool.node.clock import wall_clock_ms
from kvpool.node.disk import DiskTier
from kvpool.node.inventory import Inventory
from kvpool.node.metrics import TierMetrics
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
    """One item, validated: which tiers, how to copy (in a thread), and what to record."""

    item: MoveItem
    src: str
    dst: str
    copy: Callable[[], None]
    entry: InventoryEntry  # the destination, as the destination tier records it


class Mover:
    """Runs MoveObjects for one node. Holds the node's tiers (the DRAM segment and its
    inventory, the disk tier if any, the DFS directory if any), a thread pool and the count of
    admitted bytes. Invariant: 0 <= `_admitted_bytes` <= max(MOVE_QUEUE_BYTES_MAX, the
    largest single request in flight)."""

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
        self._admitted_bytes = 0
        self._room = asyncio.Condition()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            limits.DISK_IO_THREADS, thread_name_prefix="kvpool-disk"
        )

    def __repr__(self) -> str:
        return f"<Mover {self.segment_id} admitted={self._admitted_bytes}>"

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def run_in_thread(self, function: Callable, *args: object) -> object:
        """Run blocking file I/O on this node's disk threads."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, function, *args)

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
        codes: list[int] = [int(ErrorCode.OK)] * len(items)
        plans: list[tuple[int, _Plan]] = []
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
        failed: dict[tuple[str, str, str], list[tuple[str, object]]] = {}  # (src, dst, why) -> (key, outcome)
        await self._admit(size_bytes, self._wait_ms(message.deadline_ms))
        try:
            outcomes = await asyncio.gather(
                *(self.run_in_thread(plan.copy) for _, plan in plans), return_exceptions=True
            )
            if message.deadline_ms and self._clock_ms() >= message.deadline_ms:
                return await self._too_late(plans, outcomes, codes)
            to_disk: list[InventoryEntry] = []
            to_dram: list[InventoryEntry] = []
            for (index, plan), outcome in zip(plans, outcomes):
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
        finally:
            self._release(size_bytes)
        # One line per kind of failure and request, not per object: a full disk fails every
        # move of a request alike.
        for (src, dst, _), failures in failed.items():
            key, outcome = failures[0]
            more = f" (and {len(failures) - 1} more like it)" if len(failures) > 1 else ""
            log.warning("move of %r from %s to %s failed: %s%s", key, src, dst, outcome, more)
        return CodesReply(codes)

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
        self, plans: list[tuple[int, _Plan]], outcomes: list[object], codes: list[int]
    ) -> CodesReply:
        """The copies finished after the request's deadline: record none, remove the files
        they wrote (a DRAM copy is bytes in a range the inventory leaves free), fail them all."""
        written = [plan for (_, plan), outcome in zip(plans, outcomes) if outcome is None]
        # A disk file goes unless an entry the tier holds lies there: then it is not this copy's.
        disk = self.disk
        to_disk = [
            p.entry for p in written
            if p.dst == TIER_DISK and disk is not None and disk.inventory.is_range_free(p.entry.offset, p.entry.size)
        ]  # fmt: skip
        to_dfs = [p.entry for p in written if p.dst == TIER_DFS]
        await self.run_in_thread(self._remove_written, to_disk, to_dfs)
        for index, plan in plans:
            codes[index] = int(ErrorCode.TRANSFER_FAIL)
            self.metrics.moves.labels(src=plan.src, dst=plan.dst, result="late").inc()
        if plans:
            log.warning("moves of %d objects (%r first) finished after their deadline: not recorded",
                        len(plans), plans[0][1].item.key)  # fmt: skip
        return CodesReply(codes)

    def _remove_written(self, to_disk: list[InventoryEntry], to_dfs: list[InventoryEntry]) -> None:
        """Remove the files of copies not recorded (a worker thread), the disk tier's as its
        drops do (DiskTier.remove_files: then the directory is synced)."""
        left = []
        if to_disk:
            assert self.disk is not None
            try:
                left = self.disk.remove_files(to_disk)
            except KVPoolError as exc:  # the directory's sync
                log.warning("removing files of moves too late to record: %s", exc)
        for entry in to_dfs:
            assert self.dfs is not None
            try:
                self.dfs.remove(entry.key, entry.offset)
            except KVPoolError:
                left.append(entry)
        if left:
            log.warning("could not remove the files of %d moves too late to record (%r first)", len(left), left[0].key)

    def _wait_ms(self, deadline_ms: int) -> int:
        """How long admission may wait: MOVE_TIMEOUT_MS, and not past the deadline."""
        if not deadline_ms:
            return limits.MOVE_TIMEOUT_MS
        return max(0, min(limits.MOVE_TIMEOUT_MS, deadline_ms - self._clock_ms()))

    def _code_of(self, plan: _Plan, outcome: object) -> int:
        if outcome is None:
            result, code = "ok", ErrorCode.OK
        elif isinstance(outcome, _SourceGone):
            result, code = "source_gone", ErrorCode.OBJECT_NOT_FOUND
        elif isinstance(outcome, KVPoolError):
            result, code = "failed", outcome.code
        elif isinstance(outcome, BaseException):
            raise outcome  # A bug: let it crash the request (the master sees a failure).
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

    def _tier_of(self, segment_id: str) -> str:
        if segment_id == self.segment_id:
            return TIER_DRAM
        if self.disk is not None and segment_id == self.disk.segment_id:
            return TIER_DISK
        if self.dfs is not None and self.dfs.is_segment(segment_id):
            return TIER_DFS
        # The master learns from this code that the DFS is not mounted here (tiers.py).
        raise SegmentNotFound(f"segment {segment_id!r} is not a tier of this node")

    def _plan(self, item: MoveItem) -> _Plan:
        src = self._tier_of(item.src_segment_id)
        dst = self._tier_of(item.dst_segment_id)
        if src == dst or item.size <= 0:
            raise InvalidParams(f"move from {src} to {dst} of {item.size} bytes")
        entry = InventoryEntry(item.key, item.dst_offset, item.size, item.checksum)
        read = self._source(item, src)
        if dst == TIER_DISK:
            disk = self.disk
            assert disk is not None
            if not 0 <= item.dst_offset <= disk.capacity_bytes - item.size:
                raise InvalidParams(f"disk range [{item.dst_offset}, +{item.size}) outside the tier")

            def copy() -> None:
                with read() as source:
                    disk.write_file(entry, source)

        elif dst == TIER_DFS:
            dfs = self.dfs
            assert dfs is not None

            def copy() -> None:
                with read() as source:
                    dfs.write(item.key, item.dst_offset, item.checksum, source, is_durable=self.is_durable)

        else:
            if not 0 <= item.dst_offset <= self.segment.capacity_bytes - item.size:
                raise InvalidParams(f"DRAM range [{item.dst_offset}, +{item.size}) outside the segment")
            if not self.inventory.is_range_free(item.dst_offset, item.size):
                raise InvalidParams(f"DRAM range [{item.dst_offset}, +{item.size}) holds an object")
            target = self.segment.data[item.dst_offset : item.dst_offset + item.size]

            def copy() -> None:
                with read() as source:
                    if isinstance(source, FileRange):
                        files.read_range_into(source, [target])
                    else:
                        target[:] = source[0]
                if xxhash.xxh3_64_intdigest(target) != item.checksum:
                    raise _SourceGone(f"bytes of {item.key!r} do not match its checksum")

        return _Plan(item, src, dst, copy, entry)

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
