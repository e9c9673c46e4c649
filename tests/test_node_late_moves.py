"""Moves whose copies outlive the master's interest in them (node/moves.py, node/moving.py).

How: the node's own handlers (Mover, TieredMasterCalls over a MasterCallHandler, a
TransferHandler) on one asyncio loop, over a real segment file and a real disk tier in pytest's
tmp_path, with the master's clock set by the test; a hung device or share is a monkeypatched
stall of transports/files.py's read or write, held until the test releases it. The re-mount
case also runs through a real Node and a fake master over loopback sockets. What is checked is
what users rely on: an object the master placed after giving up on a move is never overwritten,
replaced or displaced by that move, and no file of it comes back after a restart.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash
from test_node_transfer import KEY, FakeMaster, cluster, grant_for, until, write

from kvpool.errors import ErrorCode
from kvpool.node.disk import DiskTier
from kvpool.node.inventory import Inventory
from kvpool.node.metrics import NodeMetrics, TierMetrics
from kvpool.node.moves import Mover
from kvpool.node.segment import Segment
from kvpool.node.tiered import TieredMasterCalls
from kvpool.node.transfer import MasterCallHandler, TransferHandler
from kvpool.protocol import auth
from kvpool.protocol.messages import (
    TIER_DRAM,
    CodesReply,
    CommitObjects,
    DropObjects,
    InventoryEntry,
    MoveItem,
    MoveObjects,
    WriteItem,
    WriteSlices,
)
from kvpool.transports import files
from kvpool.transports.connection import connect

MIB = 1 << 20
DRAM_ID = "n1-dram"
DEADLINE_MS = 56_000  # the master's MOVE_TIMEOUT_MS after the test's time 1_000, less its margin
TIMEOUT_S = 20


class Node:
    """A node's DRAM segment and disk tier, and its master-call handlers over them, whose clock
    (the master's, as the node estimates it) the test sets."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "shm").mkdir()
        self.segment = Segment.create(str(root / "shm"), "n1", 4 * MIB, secrets.token_bytes(16))
        self.inventory = Inventory(self.segment.capacity_bytes)
        self.disk = DiskTier.open(root / "disk", 16 * MIB, "n1", is_durable=True)
        self.now_ms = 1_000
        metrics = NodeMetrics()
        self.mover = Mover(
            self.segment, DRAM_ID, self.inventory, self.disk, None, TierMetrics(metrics.registry),
            is_durable=True, clock_ms=lambda: self.now_ms,
        )  # fmt: skip
        self.calls = TieredMasterCalls(
            MasterCallHandler(self.segment, DRAM_ID, self.inventory, metrics), self.disk, self.mover
        )

    def close(self) -> None:
        self.mover.close()
        self.disk.close()
        self.segment.close()

    async def call(self, message):
        result = self.calls.handle(None, message)  # type: ignore[arg-type]
        return await result if asyncio.isfuture(result) or asyncio.iscoroutine(result) else result

    def in_dram(self, key: str, offset: int, size: int = MIB) -> tuple[InventoryEntry, bytes]:
        data = os.urandom(size)
        self.segment.data[offset : offset + size] = data
        entry = InventoryEntry(key, offset, size, xxhash.xxh3_64_intdigest(data))
        self.inventory.add([entry])
        return entry, data

    def offload(self, entry: InventoryEntry, to_offset: int) -> MoveObjects:
        item = MoveItem(entry.key, entry.size, entry.checksum, DRAM_ID, entry.offset, self.disk.segment_id, to_offset)
        return MoveObjects([item], deadline_ms=self.now_ms + 55_000)

    def disk_objects_after_restart(self) -> list[InventoryEntry]:
        self.disk.close()
        self.disk = DiskTier.open(self.root / "disk", 16 * MIB, "n1", is_durable=True)
        return self.disk.inventory.entries()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    made = Node(tmp_path)
    yield made
    made.close()


class Stall:
    """Holds the worker thread in `function` of transports/files.py when `when(*args)`, until
    released: a device or share that stopped answering."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, function: str, when) -> None:
        self.entered = threading.Event()
        self.released = threading.Event()
        real = getattr(files, function)

        def stalled(*args):
            if when(*args):
                self.entered.set()
                assert self.released.wait(TIMEOUT_S), "stall never released"
            return real(*args)

        monkeypatch.setattr(files, function, stalled)

    async def reached(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, TIMEOUT_S), "the copy never reached the stall"


def writing(data: bytes):
    """For Stall on files._write_all: the write of `data`'s bytes (not the file's header)."""
    return lambda fd, views, position: position and bytes(views[0][:16]) == data[:16]


def run(main) -> None:
    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))


def test_a_promotion_stalled_past_its_deadline_never_overwrites_what_the_master_put_there(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DFS/disk -> DRAM promotion whose read hangs: the master gives up, drops the target and
    grants the range to a put. While the read may still land, the put is refused (its commit,
    and a TCP write's grant), never recorded over bytes about to be overwritten; once the read
    has ended, the range takes puts again, and a same-host writer's commit there is hashed, not
    taken on the writer's word."""
    x = os.urandom(MIB)
    on_disk = InventoryEntry("X", 0, MIB, xxhash.xxh3_64_intdigest(x))
    node.disk.publish(on_disk, node.disk.write_temporary(on_disk, [memoryview(x)]))
    node.disk.record([on_disk])
    stall = Stall(monkeypatch, "read_range_into", lambda *args: True)

    async def main() -> None:
        item = MoveItem("X", MIB, on_disk.checksum, node.disk.segment_id, 0, DRAM_ID, 0)
        promotion = asyncio.ensure_future(node.call(MoveObjects([item], deadline_ms=DEADLINE_MS)))
        await stall.reached()
        node.now_ms = 61_000  # the master gave up, and drops the target (nothing to forget)
        await node.call(DropObjects(DRAM_ID, [InventoryEntry("X", 0, MIB, on_disk.checksum)]))
        # A same-host put C is granted [0, 1 MiB), copies its bytes there and commits.
        c = os.urandom(MIB)
        node.segment.data[0:MIB] = c
        entry_c = InventoryEntry("C", 0, MIB, xxhash.xxh3_64_intdigest(c))
        reply = await node.call(CommitObjects(DRAM_ID, [entry_c], is_hashed_in_place=True))
        assert reply.codes == [ErrorCode.TRANSFER_FAIL]  # the put fails: C is never served
        assert node.inventory.get("C") is None
        # A TCP write granted there is refused before any byte lands.
        transfer = node_transfer_handler(node)
        with pytest.raises(Exception, match="still running"):
            transfer._check_write(write_message(0, MIB))
        stall.released.set()
        assert (await promotion).codes == [ErrorCode.TRANSFER_FAIL]
        assert node.inventory.get("X") is None
        # Another same-host put wrote there while the read hung, and commits only now, hashed
        # in place: its bytes were overwritten, so it must be hashed and refused.
        reply = await node.call(CommitObjects(DRAM_ID, [entry_c], is_hashed_in_place=True))
        assert reply.codes == [ErrorCode.TRANSFER_FAIL]
        # The read has ended: the range takes a put again, whole.
        node.segment.data[0:MIB] = c
        assert (await node.call(CommitObjects(DRAM_ID, [entry_c]))).codes == [ErrorCode.OK]
        assert bytes(node.segment.data[0:MIB]) == c and node.inventory.get("C") == entry_c

    run(main)


def node_transfer_handler(node: Node) -> TransferHandler:
    """The client-facing handler of the node, sharing the Mover's DRAM targets (node/server.py)."""
    handler = TransferHandler(node.segment, DRAM_ID, node.inventory, NodeMetrics(), keyring=auth.Keyring(),
                              clock_ms=lambda: node.now_ms)  # fmt: skip
    handler.moving = node.mover.moving[TIER_DRAM]
    return handler


def write_message(offset: int, size: int) -> WriteSlices:
    grant = auth.sign_grant(None, DRAM_ID, offset, size, 10**15, 0)
    return WriteSlices([WriteItem(grant, 0, size)])


@pytest.mark.parametrize("b_offset, b_size", [(0, MIB), (0, 2 * MIB)], ids=["same_offset", "overlapping"])
def test_a_disk_move_that_ends_late_never_replaces_the_newer_object_nor_comes_back(
    node: Node, monkeypatch: pytest.MonkeyPatch, b_offset: int, b_size: int
) -> None:
    """An offload whose disk write hangs past the master's timeout: the master drops its
    target and places another object B there (the same offset, or a larger range over it).
    What the master was told is on disk is what the disk tier serves, before and after a
    restart: the late file neither replaces B's nor stays as an orphan that a restart adopts."""
    a_entry, a = node.in_dram("A", 0)
    b_entry, b = node.in_dram("B", MIB, b_size)
    a_target = b_offset + b_size - MIB  # A's range: B's start (same offset) or B's last MiB
    stall = Stall(monkeypatch, "_write_all", writing(a))

    async def main() -> None:
        late = asyncio.ensure_future(node.call(node.offload(a_entry, a_target)))
        await stall.reached()
        node.now_ms += 60_000  # the master gave up and drops A's target
        await node.call(DropObjects(node.disk.segment_id, [InventoryEntry("A", a_target, MIB, a_entry.checksum)]))
        told_ok: list[InventoryEntry] = []  # what the master lists on disk
        offload_b = node.offload(b_entry, b_offset)
        if (await node.call(offload_b)).codes == [ErrorCode.OK]:
            told_ok.append(InventoryEntry("B", b_offset, b_size, b_entry.checksum))
        stall.released.set()
        assert (await late).codes == [ErrorCode.TRANSFER_FAIL]
        if not told_ok:  # refused while A's write could still land: the master offloads B again
            assert (await node.call(node.offload(b_entry, b_offset))).codes == [ErrorCode.OK]
            told_ok.append(InventoryEntry("B", b_offset, b_size, b_entry.checksum))
        for entries in (node.disk.inventory.entries(), node.disk_objects_after_restart()):
            assert entries == told_ok
        assert files.read_object_bytes(node.disk.path_of(b_offset), "B", b_size) == b
        assert sorted(p.name for p in node.disk.objects_path.iterdir()) == [node.disk.path_of(b_offset).name]

    run(main)


def test_a_move_begun_before_the_node_mounted_again_is_not_recorded(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The master timed the node out (its TTL is shorter than a move's timeout) while an offload
    ran, and rebuilt the disk segment from the inventory the node mounted again with, which has
    no entry for that move: the old move's target is free to the new master state, which
    offloads another object there. The old move, ending later, within its own deadline, must
    not be recorded over the new object, nor leave its file."""
    k0, data0 = node.in_dram("k0", 0)
    k3, data3 = node.in_dram("k3", MIB)
    stall = Stall(monkeypatch, "_write_all", writing(data0))

    async def main() -> None:
        old = asyncio.ensure_future(node.call(node.offload(k0, 0)))
        await stall.reached()
        node.mover.remounted()  # the node mounts again (node/server.py _mount)
        told_ok = (await node.call(node.offload(k3, 0))).codes == [ErrorCode.OK]
        stall.released.set()
        assert (await old).codes == [ErrorCode.TRANSFER_FAIL]
        if not told_ok:
            assert (await node.call(node.offload(k3, 0))).codes == [ErrorCode.OK]
        assert node.disk.inventory.entries() == [InventoryEntry("k3", 0, MIB, k3.checksum)]
        assert files.read_object_bytes(node.disk.path_of(0), "k3", MIB) == data3
        assert node.disk_objects_after_restart() == [InventoryEntry("k3", 0, MIB, k3.checksum)]

    run(main)


def test_a_real_node_that_mounts_again_records_no_move_begun_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same through a real Node and sockets: the master forgets the node's segments (a
    heartbeat answered "unknown"), the node mounts again, and the offload it was running when
    it did is answered as failed, its target left free, with no file."""
    size = 256 * 1024
    data = os.urandom(size)
    stall = Stall(monkeypatch, "_write_all", writing(data))

    async def main() -> None:
        async with cluster(tmp_path, disk_dir=str(tmp_path / "disk"), disk_bytes=16 * MIB) as (master, node):
            conn = await connect(node.endpoint, key=KEY)
            assert await write(conn, grant_for(node, 0, size), data) == [0]
            checksum = xxhash.xxh3_64_intdigest(data)
            assert await master.commit(node.segment_id, [InventoryEntry("k0", 0, size, checksum)]) == [0]
            assert isinstance(master, FakeMaster) and master.node_conn is not None
            item = MoveItem("k0", size, checksum, node.segment_id, 0, node.disk.segment_id, 0)
            move = asyncio.ensure_future(master.node_conn.request(MoveObjects([item]), timeout_ms=TIMEOUT_S * 1000))
            await stall.reached()
            mounts = len(master.mounts)
            master.unknown = True  # timed out by the master: the node mounts again
            await until(lambda: len(master.mounts) >= mounts + 2)  # its DRAM segment and disk tier
            stall.released.set()
            reply = await move
            assert isinstance(reply, CodesReply) and reply.codes == [ErrorCode.TRANSFER_FAIL]
            assert node.disk.inventory.entries() == []
            assert list(node.disk.objects_path.iterdir()) == []
            conn.close()

    run(main)
