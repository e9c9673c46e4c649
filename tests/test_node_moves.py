"""The node's Mover (node/moves.py) against a real segment and disk tier: a request whose copies
finish after its deadline records nothing and leaves no file, a promotion of a key whose
old DRAM entry's drop has not come yet records the new place, and a disk drop's removal of
files is waited for by the same drop sent again and lets no move land in its ranges."""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from kvpool import limits
from kvpool.errors import ErrorCode, TransferFailed
from kvpool.node.disk import DiskTier
from kvpool.node.inventory import Inventory
from kvpool.node.metrics import NodeMetrics, TierMetrics
from kvpool.node.moves import Mover
from kvpool.node.segment import Segment
from kvpool.protocol.messages import TIER_DISK, InventoryEntry, MoveItem, MoveObjects
from kvpool.transports import files
from kvpool.transports.dfs import DfsDirectory

MIB = 1 << 20
SIZE = 64 * 1024


class Tiers:
    """A node's DRAM segment and disk tier, and a Mover over them whose clock (the master's,
    as the node estimates it) the test sets."""

    def __init__(self, root: Path, dfs: DfsDirectory | None = None, is_durable: bool = False) -> None:
        (root / "shm").mkdir(parents=True)
        self.segment = Segment.create(str(root / "shm"), "n1", 4 * MIB, secrets.token_bytes(16))
        self.inventory = Inventory(self.segment.capacity_bytes)
        self.disk = DiskTier.open(root / "disk", 16 * MIB, "n1", is_durable=is_durable)
        self.now_ms = 1_000
        self.mover = Mover(
            self.segment, "n1-dram", self.inventory, self.disk, dfs, TierMetrics(NodeMetrics().registry),
            is_durable=is_durable, clock_ms=lambda: self.now_ms,
        )  # fmt: skip

    def in_dram(self, key: str, offset: int) -> InventoryEntry:
        data = os.urandom(SIZE)
        self.segment.data[offset : offset + SIZE] = data
        entry = InventoryEntry(key, offset, SIZE, xxhash.xxh3_64_intdigest(data))
        self.inventory.add([entry])
        return entry

    def on_disk(self, key: str, offset: int, data: bytes | None = None) -> InventoryEntry:
        data = os.urandom(SIZE) if data is None else data
        entry = InventoryEntry(key, offset, SIZE, xxhash.xxh3_64_intdigest(data))
        self.disk.publish(entry, self.disk.write_temporary(entry, [memoryview(data)]))
        self.disk.record([entry])
        return entry

    def offload(self, entry: InventoryEntry, to_offset: int) -> MoveItem:
        return MoveItem(entry.key, SIZE, entry.checksum, "n1-dram", entry.offset, self.disk.segment_id, to_offset)

    def promote(self, entry: InventoryEntry, to_offset: int) -> MoveItem:
        return MoveItem(entry.key, SIZE, entry.checksum, self.disk.segment_id, entry.offset, "n1-dram", to_offset)

    def close(self) -> None:
        self.mover.close()
        self.disk.close()
        self.segment.close()


@pytest.fixture
def tiers(tmp_path: Path) -> Iterator[Tiers]:
    made = Tiers(tmp_path)
    yield made
    made.close()


def test_copies_that_finish_after_the_deadline_are_not_recorded_and_leave_no_file(tiers: Tiers) -> None:
    """The master gives up on a MoveObjects a little after its deadline and drops the targets
    before reusing their ranges: a copy recorded later would be an entry in a range the master
    hands out again (a put there refused as a stale grant), or a file no one accounts for."""
    hot = tiers.in_dram("hot", 0)
    cold = tiers.on_disk("cold", 0)
    items = [tiers.offload(hot, 4 * MIB), tiers.promote(cold, MIB)]

    real_plan = tiers.mover._plan

    def slow_plan(item: MoveItem):
        plan = real_plan(item)
        copy = plan.copy

        def copy_past_the_deadline() -> None:
            copy()
            tiers.now_ms = 3_000  # the copy took longer than the master waits

        plan.copy = copy_past_the_deadline
        return plan

    tiers.mover._plan = slow_plan  # type: ignore[method-assign]
    reply = asyncio.run(tiers.mover.move(MoveObjects(items, deadline_ms=2_000)))
    assert reply.codes == [ErrorCode.TRANSFER_FAIL] * 2
    assert tiers.disk.entry_at("hot", 4 * MIB) is None and not tiers.disk.path_of(4 * MIB).exists()
    assert tiers.inventory.get("cold") is None  # the promotion's DRAM range is left free
    assert tiers.inventory.get("hot") == hot and tiers.disk.entry_at("cold", 0) == cold  # sources kept


def test_a_request_that_finishes_in_time_is_recorded(tiers: Tiers) -> None:
    hot = tiers.in_dram("hot", 0)
    reply = asyncio.run(tiers.mover.move(MoveObjects([tiers.offload(hot, 4 * MIB)], deadline_ms=2_000)))
    assert reply.codes == [ErrorCode.OK]
    assert tiers.disk.entry_at("hot", 4 * MIB) is not None and tiers.disk.path_of(4 * MIB).exists()


def test_a_promotion_of_a_key_whose_old_dram_entry_is_still_held_records_the_new_place(tiers: Tiers) -> None:
    """The master evicted the key from DRAM (its drop goes in the background, behind others)
    and promotes it back from disk to another range before the node got the drop: the new
    entry replaces the old one, and the late drop of the old one then matches nothing."""
    old = tiers.in_dram("k", 0)
    on_disk = tiers.on_disk("k", 0, bytes(tiers.segment.data[:SIZE]))  # offloaded before the eviction
    reply = asyncio.run(tiers.mover.move(MoveObjects([tiers.promote(on_disk, MIB)])))
    assert reply.codes == [ErrorCode.OK]
    held = tiers.inventory.get("k")
    assert held is not None and held.offset == MIB
    assert tiers.inventory.drop([old]) == []  # the old entry's drop, when it comes
    assert tiers.inventory.get("k") == held


def stalled_removal(monkeypatch, path: Path) -> tuple[threading.Event, threading.Event]:
    """Make the unlink of `path` wait (a disk that stalls): (entered, released)."""
    entered, released = threading.Event(), threading.Event()
    real = files.remove

    def remove(target: Path) -> bool:
        if Path(target) == path:
            entered.set()
            assert released.wait(10)
        return real(target)

    monkeypatch.setattr(files, "remove", remove)
    return entered, released


def test_a_drop_sent_again_is_acknowledged_only_once_the_first_removed_the_files(tiers: Tiers, monkeypatch) -> None:
    """The master sends a drop again when its wait for the first ran out (a stalled unlink):
    before, the second found nothing left to forget and was acknowledged at once, the files
    still there, and a restart brought the objects back (review helper-149)."""
    a, k = tiers.on_disk("A", 0), tiers.on_disk("K", MIB)
    entered, released = stalled_removal(monkeypatch, tiers.disk.path_of(0))

    async def main() -> None:
        first = asyncio.ensure_future(tiers.mover.drop_disk_files([a, k]))
        assert await asyncio.to_thread(entered.wait, 10)
        second = asyncio.ensure_future(tiers.mover.drop_disk_files([a, k]))
        await asyncio.sleep(0.2)
        assert not second.done()  # it waits for the first's removal
        released.set()
        assert await first == (2, []) and await second == (0, [])
        assert not tiers.disk.path_of(0).exists() and not tiers.disk.path_of(MIB).exists()

    try:
        asyncio.run(asyncio.wait_for(main(), 20))
    finally:
        released.set()


def test_no_move_lands_in_a_range_whose_old_file_is_being_removed(tiers: Tiers, monkeypatch) -> None:
    """The master refuses a disk entry at a mount and may place a move there at once, of the
    same key even: the move's new file was removed as the old one, and the master listed a
    replica without a file (review helper-149). The move is refused while the removal runs."""
    refused = tiers.on_disk("K", 0)
    entered, released = stalled_removal(monkeypatch, tiers.disk.path_of(0))
    source = tiers.in_dram("K", 0)

    async def main() -> None:
        removal = asyncio.ensure_future(tiers.mover.drop_disk_files([refused]))
        assert await asyncio.to_thread(entered.wait, 10)
        reply = await tiers.mover.move(MoveObjects([tiers.offload(source, 0)], deadline_ms=60_000))
        assert reply.codes == [int(ErrorCode.TRANSFER_FAIL)]
        released.set()
        assert await removal == (1, [])
        reply = await tiers.mover.move(MoveObjects([tiers.offload(source, 0)], deadline_ms=60_000))
        assert reply.codes == [int(ErrorCode.OK)]
        assert tiers.disk.path_of(0).exists() and tiers.disk.entry_at("K", 0) is not None

    try:
        asyncio.run(asyncio.wait_for(main(), 20))
    finally:
        released.set()


def test_a_removal_leaves_a_range_a_move_holds_to_the_move(tiers: Tiers) -> None:
    """The other order: a move holds the range first (its copy running); the removal leaves
    that file to the move's rename, reported as not removed."""
    refused = tiers.on_disk("K", 0)
    tiers.mover.moving[TIER_DISK].hold(0, SIZE)

    async def main() -> None:
        assert await tiers.mover.drop_disk_files([refused]) == (1, [refused])

    asyncio.run(main())
    assert tiers.disk.path_of(0).exists() and tiers.disk.unremoved == {0: refused}


@pytest.fixture
def with_dfs(tmp_path: Path) -> Iterator[tuple[Tiers, str]]:
    """A node's tiers with a DFS (its identity not read yet, as at a node's start), and the
    DFS's segment id."""
    dfs_id = DfsDirectory.create_or_open(tmp_path / "dfs", 64 * MIB).identity().segment_id
    made = Tiers(tmp_path / "node", DfsDirectory(tmp_path / "dfs"), is_durable=True)
    yield made, dfs_id
    made.close()


def to_dfs(tiers: Tiers, entry: InventoryEntry, dfs_id: str, offset: int) -> MoveObjects:
    return MoveObjects([MoveItem(entry.key, SIZE, entry.checksum, "n1-dram", entry.offset, dfs_id, offset)], 60_000)


def test_a_dfs_that_hangs_holds_no_move_on_the_event_loop(with_dfs, monkeypatch) -> None:
    """The DFS identity is read on a thread: read on the event loop at the first DFS move, a
    share that hung froze the node, its heartbeats with it (review helper-149)."""
    tiers, dfs_id = with_dfs
    entry = tiers.in_dram("K", 0)
    real = files.load_identity

    def hung(directory: Path):
        time.sleep(1.0)
        return real(directory)

    monkeypatch.setattr(files, "load_identity", hung)

    async def main() -> float:
        loop = asyncio.get_running_loop()
        stalls, last = [0.0], loop.time()

        async def tick() -> None:
            nonlocal last
            while True:
                await asyncio.sleep(0.02)
                stalls.append(loop.time() - last)
                last = loop.time()

        ticker = asyncio.ensure_future(tick())
        reply = await tiers.mover.move(to_dfs(tiers, entry, dfs_id, 0))
        ticker.cancel()
        assert reply.codes == [int(ErrorCode.OK)]
        return max(stalls)

    assert asyncio.run(main()) < 0.5


def test_a_dfs_file_whose_bucket_sync_failed_is_not_left_behind(with_dfs, monkeypatch) -> None:
    """The rename done, the bucket's fsync fails: the move fails, and its file goes (left whole
    there, it was in no index and no free-space count, and the master's next start adopted it)."""
    tiers, dfs_id = with_dfs
    entry = tiers.in_dram("K", 0)
    real = files.sync_directory

    def failing(directory: Path) -> None:
        if "objects/" in str(directory):
            raise TransferFailed("fsync: Input/output error (EIO)")
        real(directory)

    monkeypatch.setattr(files, "sync_directory", failing)
    reply = asyncio.run(tiers.mover.move(to_dfs(tiers, entry, dfs_id, 7 * MIB)))
    assert reply.codes == [int(ErrorCode.TRANSFER_FAIL)]
    assert list(DfsDirectory(tiers.mover.dfs.path).scan(3_600_000)) == []


def test_dfs_copies_stalled_on_a_hung_share_hold_up_no_disk_drop_nor_offload(with_dfs, monkeypatch) -> None:
    """The DFS has threads of its own: four copies stalled on a hung share held every disk
    thread, and the disk tier's drops and offloads waited for the share (review helper-149)."""
    tiers, dfs_id = with_dfs
    on_disk = tiers.on_disk("D", 0)
    released, entered = threading.Event(), threading.Semaphore(0)
    real = files._write_all

    def stalled(fd: int, views, position: int):
        if position and "/dfs/" in os.readlink(f"/proc/self/fd/{fd}"):
            entered.release()
            assert released.wait(10)
        return real(fd, views, position)

    monkeypatch.setattr(files, "_write_all", stalled)

    async def main() -> None:
        copies = [
            asyncio.ensure_future(tiers.mover.move(to_dfs(tiers, tiers.in_dram(f"c{i}", i * SIZE), dfs_id, i * MIB)))
            for i in range(limits.DISK_IO_THREADS)
        ]
        for _ in copies:
            assert await asyncio.to_thread(entered.acquire, True, 10)
        assert await asyncio.wait_for(tiers.mover.drop_disk_files([on_disk]), 5) == (1, [])
        offload = tiers.offload(tiers.in_dram("L", 8 * SIZE), MIB)
        reply = await asyncio.wait_for(tiers.mover.move(MoveObjects([offload], 60_000)), 5)
        assert reply.codes == [int(ErrorCode.OK)]
        released.set()
        assert [r.codes for r in await asyncio.gather(*copies)] == [[int(ErrorCode.OK)]] * len(copies)

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        released.set()


def test_a_copy_into_dram_is_counted_until_its_thread_ends_whatever_became_of_its_request(tiers: Tiers, monkeypatch):
    """A node keeping its segment for a restart must know no copy still writes into it: a
    request cancelled at the stop leaves its thread running (review helper-151)."""
    on_disk = tiers.on_disk("P", 0)
    entered, released = threading.Event(), threading.Event()
    real = DiskTier.open_range

    def stalled(self, *args, **kwargs):
        entered.set()
        assert released.wait(10)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DiskTier, "open_range", stalled)

    async def main() -> None:
        move = asyncio.ensure_future(tiers.mover.move(MoveObjects([tiers.promote(on_disk, MIB)], 60_000)))
        assert await asyncio.to_thread(entered.wait, 10)
        move.cancel()  # the stop's cancellation: the thread goes on
        await asyncio.gather(move, return_exceptions=True)
        assert await tiers.mover.copies_into_dram_left(0) == 1
        released.set()
        assert await tiers.mover.copies_into_dram_left(10_000) == 0

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        released.set()


def test_drops_sent_again_twice_are_acknowledged_only_once_the_file_is_gone(tiers: Tiers, monkeypatch) -> None:
    """Three drops of one file whose removal fails (a read-only disk): the second and the third
    waited on the first; when it ended, the second took the entry back and removed again, and
    the third found nothing to forget and was acknowledged, the file still there (review
    helper-151). None is acknowledged while the file stays."""
    entry = tiers.on_disk("A", 0)
    path = tiers.disk.path_of(0)
    entered, released = threading.Event(), threading.Event()

    def read_only(target: Path) -> bool:
        if Path(target) == path:
            entered.set()
            assert released.wait(10)
            raise TransferFailed("Read-only file system (EROFS)")
        return True

    monkeypatch.setattr(files, "remove", read_only)

    async def main() -> list:
        drops = [asyncio.ensure_future(tiers.mover.drop_disk_files([entry]))]
        assert await asyncio.to_thread(entered.wait, 10)
        drops += [asyncio.ensure_future(tiers.mover.drop_disk_files([entry])) for _ in range(2)]
        await asyncio.sleep(0.1)
        released.set()
        return await asyncio.gather(*drops)

    try:
        results = asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        released.set()
    assert all(left == [entry] for _, left in results), results  # each one fails: the master sends it again
    assert path.exists() and tiers.disk.unremoved == {0: entry}
