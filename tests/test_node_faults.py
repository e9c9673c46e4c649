"""The node's tiers under faults: a copy that fails with an unexpected error, a backlog of
offloads in front of a client's disk read, a master clock that steps.

How: a real DRAM segment and disk tier under a Mover (node/moves.py) whose copies the test
makes fail or stall (monkeypatched, with threading.Event as the only synchronisation), an
in-process Node (real sockets over loopback) for the reads, and MasterClock fed by an
injected clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvloop
import xxhash
from test_node_moves import SIZE
from test_node_moves import Tiers as MoverTiers

from kvpool import AsyncStore
from kvpool.config import MasterConfig, NodeConfig
from kvpool.errors import ErrorCode
from kvpool.master.server import MasterServer
from kvpool.node.clock import MasterClock, monotonic_ms, wall_clock_ms
from kvpool.node.server import Node
from kvpool.protocol import objectfile
from kvpool.protocol.messages import InventoryEntry, MoveItem, MoveObjects, ReadItem, ReadReply, ReadSlices
from kvpool.transports import files
from kvpool.transports.connection import connect

MIB = 1 << 20


class Tiers(MoverTiers):
    """test_node_moves' DRAM segment, disk tier and Mover, and the disk tier's files."""

    def object_files(self) -> set[int]:
        """The offsets of the object files in the disk tier's directory (temporary ones too)."""
        names = os.listdir(self.disk.objects_path)
        assert not [name for name in names if objectfile.is_temp_name(name)], names
        return {objectfile.disk_offset_of(name) for name in names}


@pytest.fixture
def tiers(tmp_path: Path) -> Iterator[Tiers]:
    made = Tiers(tmp_path)
    yield made
    made.close()


# --- 1. a copy that fails with an error that is not kvpool's ------------------------------


@pytest.mark.parametrize("failing", [0, 1], ids=["first-fails", "second-fails"])
def test_a_copy_failing_unexpectedly_fails_its_item_alone_and_leaves_no_unrecorded_file(tiers, failing):
    """A copy that raised something other than a KVPoolError (a bug) failed the whole
    request after the other items' files had been renamed into place: those stayed on disk,
    in no inventory (their space held until a restart adopted them, the master unaware of
    them). Now that item alone fails, and every file in the tier is one it records."""
    entries = [tiers.in_dram("a", 0), tiers.in_dram("b", SIZE)]
    real_plan = tiers.mover._plan
    planned = []

    def plan_failing_one(item: MoveItem):
        plan = real_plan(item)
        if len(planned) == failing:

            def broken_copy():
                raise RuntimeError("a bug in a copy")

            plan.copy = broken_copy
        planned.append(item)
        return plan

    tiers.mover._plan = plan_failing_one  # type: ignore[method-assign]
    items = [tiers.offload(entries[0], 0), tiers.offload(entries[1], MIB)]
    reply = asyncio.run(tiers.mover.move(MoveObjects(items)))
    expected = [ErrorCode.OK, ErrorCode.OK]
    expected[failing] = ErrorCode.TRANSFER_FAIL
    assert reply.codes == expected
    good = items[1 - failing]
    assert tiers.disk.entry_at(good.key, good.dst_offset) is not None
    assert tiers.object_files() == {good.dst_offset}  # recorded, and nothing else on disk
    assert not tiers.mover.moving["disk"]  # targets released


# --- 2. a backlog of offloads in front of a client's disk read ----------------------------


@contextlib.asynccontextmanager
async def node_with_disk(root: Path):
    """An in-process master and node (64 MiB of DRAM, a disk tier of 64 MiB under `root`)."""
    master = MasterServer(MasterConfig(), port=0, seed=1, debug_invariants=True)
    await master.start()
    node = Node(NodeConfig(master_endpoint=master.endpoint, memory_bytes=64 * MIB,
                           disk_dir=str(root / "disk"), disk_bytes=64 * MIB))  # fmt: skip
    try:
        await node.start()
        await node.wait_mounted(5_000)
        yield node
    finally:
        await node.stop()
        await master.stop()


async def until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_a_clients_disk_read_does_not_wait_behind_a_backlog_of_offloads(tmp_path):
    """Offloads (4 MiB files written and fdatasync'ed each), clients' disk reads and drops
    shared the node's 4 disk threads, first come first served: a read queued behind every copy
    a burst of offloads had admitted (up to 512 MiB: 0.3 s on this VM's disk against 1 ms
    idle, and as many seconds as the device takes on a slow one). Here the copies stall (a
    slow disk) holding every disk thread; a client's read of a disk object still comes back."""
    data = os.urandom(MIB)
    stalled = threading.Event()
    copying = []

    async def main():
        async with node_with_disk(tmp_path) as node:
            disk, segment, mover = node.disk, node._segment, node._mover
            cold = InventoryEntry("cold", 0, MIB, xxhash.xxh3_64_intdigest(data))
            disk.publish(cold, disk.write_temporary(cold, [memoryview(data)]))
            disk.record([cold])
            hot = []
            for index in range(8):  # more copies than disk threads
                payload = os.urandom(SIZE)
                segment.data[index * SIZE : (index + 1) * SIZE] = payload
                hot.append(InventoryEntry(f"hot{index}", index * SIZE, SIZE, xxhash.xxh3_64_intdigest(payload)))
            node._inventory.add(hot)
            write_temporary = disk.write_temporary

            def slow_write(entry, source):
                copying.append(entry.key)
                stalled.wait(30)
                return write_temporary(entry, source)

            disk.write_temporary = slow_write
            items = [MoveItem(e.key, SIZE, e.checksum, node._segment_id, e.offset, disk.segment_id, (2 + i) * MIB)
                     for i, e in enumerate(hot)]  # fmt: skip
            offloads = asyncio.ensure_future(mover.move(MoveObjects(items)))
            conn = await connect(node.endpoint, key=None)
            try:
                await until(lambda: len(copying) == 4)  # every copy thread is held
                sink = bytearray(MIB)
                started = time.monotonic()
                read = ReadSlices([ReadItem(disk.segment_id, 0, MIB)])
                reply = await asyncio.wait_for(conn.request(read, reply_sinks=lambda _: [memoryview(sink)]), 5)
                read_s = time.monotonic() - started
                assert isinstance(reply, ReadReply) and sink == data
            finally:
                stalled.set()
                conn.close()
            assert (await offloads).codes == [ErrorCode.OK] * len(items)
            assert read_s < 5

    try:
        uvloop.run(asyncio.wait_for(main(), 60))
    finally:
        stalled.set()


# --- 5. an offload that finds the filesystem full -----------------------------------------


def test_an_object_whose_offload_found_the_filesystem_full_stays_readable(tmp_path, small_filesystem, caplog):
    """Another program fills the filesystem under the disk tier between two of the node's
    reports of its free space (here: the node never reports it), so an offload fails with
    ENOSPC. The object's DRAM replica was dropped all the same, and the object lost though
    it was whole; now it stays in DRAM (the tier's room is capped, so the next offloads make
    room there instead of failing)."""
    mount = small_filesystem("8m")
    value_bytes = 256 * 1024

    async def main():
        master = MasterServer(MasterConfig(), port=0, seed=1, debug_invariants=True)
        await master.start()
        node = Node(NodeConfig(master_endpoint=master.endpoint, memory_bytes=2 * MIB, disk_dir=str(mount / "disk"),
                               disk_bytes=6 * MIB, disk_fsync=False))  # fmt: skip
        try:
            await node.start()
            report = node.disk.filesystem_report()
            node.disk.filesystem_report = lambda: report  # the burst comes between two reports
            await node.wait_mounted(5_000)
            with open(mount / "ballast", "wb") as ballast:  # leaves room for a few object files
                ballast.write(bytes(report.free_bytes - MIB))
            async with await AsyncStore.open(master.endpoint, shm_enabled=False) as store:
                values: dict[str, bytes] = {}
                for index in range(40):
                    key = f"k{index}"
                    values[key] = os.urandom(value_bytes)
                    await store.put(key, values[key])
                    status = await store.cluster_status()
                    (disk,) = [tier for tier in status.tiers if tier.tier == "disk"]
                    if disk.failed_moves:
                        break
                assert disk.failed_moves, "no offload found the filesystem full"
                failed = [r.getMessage().split("'")[1] for r in caplog.records if "No space left" in r.getMessage()]
                assert failed
                for key in failed:
                    assert await store.get(key) == values[key], key
        finally:
            await node.stop()
            await master.stop()

    with caplog.at_level(logging.WARNING, logger="kvpool.node.moves"):
        uvloop.run(asyncio.wait_for(main(), 60))


# --- 3. readers that stop reading: the sending half ----------------------------------------


def test_send_some_stops_where_the_socket_is_full_and_goes_on_from_there(tmp_path):
    """files.send_some sends what a non-blocking socket takes and returns where it stopped,
    so that the caller waits for room without holding a thread; called again from there, the
    bytes arrive whole and in order (buffers and file ranges mixed)."""
    data = os.urandom(4 * MIB)
    path = tmp_path / "data"
    path.write_bytes(data)
    sender, receiver = socket.socketpair()
    fd = os.open(path, os.O_RDONLY)
    try:
        sender.setblocking(False)
        parts = [b"head", files.FileRange(fd, 0, len(data)), memoryview(b"tail")]
        position = files.send_some(sender.fileno(), parts, files.SEND_START)
        assert position is not None and position.part == 1  # the socket is full mid-file
        received = bytearray()
        while position is not None:
            received += receiver.recv(1 << 20)
            position = files.send_some(sender.fileno(), parts, position)
        while len(received) < len(data) + 8:
            received += receiver.recv(1 << 20)
        assert received == b"head" + data + b"tail"
    finally:
        os.close(fd)
        sender.close()
        receiver.close()


# --- 4. a clock that steps ----------------------------------------------------------------


class Clocks:
    """The master's wall clock and the node's local one, as the test sets them; a request
    takes `trip_ms` each way."""

    def __init__(self) -> None:
        self.master_ms = wall_clock_ms()  # (a far one would log a warning)
        self.local_ms = 5_000
        self.clock = MasterClock("node n", local_ms=lambda: self.local_ms)

    def heartbeat(self, trip_ms: int = 1) -> None:
        sent_ms = self.local_ms
        self.tick(trip_ms)
        master_time_ms = self.master_ms
        self.tick(trip_ms)
        self.clock.observe(sent_ms, master_time_ms, self.local_ms)

    def tick(self, ms: int) -> None:
        self.master_ms += ms
        self.local_ms += ms

    def error_ms(self) -> int:
        """How far the node's estimate of the master's time is from it (negative: behind)."""
        return self.clock.now_ms() - self.master_ms


@pytest.mark.parametrize("step_ms", [-10_000, 10_000], ids=["node-clock-back", "master-clock-forward"])
def test_the_masters_time_is_right_again_one_reply_after_a_clock_steps(step_ms):
    """Offsets were the least of the last 8 replies' upper bounds: after the node's clock
    stepped back by 10 s (or the master's forward), the node read the master's time 10 s
    behind for 8 replies (8 s of heartbeats), taking write grants 10 s past their expiry and
    recording moves past their deadline. A reply's lower bound (sent before it arrived) now
    proves the old samples stale. (The node measures against its monotonic clock, which no
    one steps; the injected clock here steps all the same, as a wall clock would.)"""
    clocks = Clocks()
    for _ in range(8):
        clocks.heartbeat(trip_ms=5)
        clocks.tick(1_000)
    assert -2 <= clocks.error_ms() <= 10  # erring early, by a trip at most
    if step_ms < 0:
        clocks.local_ms += step_ms  # the node's clock steps back
    else:
        clocks.master_ms += step_ms  # the master's clock steps forward
    assert clocks.error_ms() == pytest.approx(-10_000, abs=10)
    clocks.heartbeat()
    assert 0 <= clocks.error_ms() <= 2


def test_replies_slow_or_fast_keep_the_tightest_bound_while_no_clock_steps():
    clocks = Clocks()
    for trip_ms in [40, 1, 300, 2, 25, 1_000, 3, 7, 500]:
        clocks.heartbeat(trip_ms)
        clocks.tick(1_000)
        assert 0 <= clocks.error_ms() <= 2 * 40  # the least trip seen so far bounds it
    assert clocks.error_ms() <= 2  # the fast replies' bound: a slow one moves nothing


def test_a_node_checks_grants_against_its_monotonic_clock():
    """The node's wall clock is not what its estimate of the master's time moves with; until
    a master says its time (one that does not), that estimate is the wall clock."""
    node = Node(NodeConfig(master_endpoint="127.0.0.1:1", memory_bytes=MIB))
    clock = node._master_clock
    assert clock.local_ms is monotonic_ms
    clock.observe(monotonic_ms(), 0)
    assert abs(clock.now_ms() - wall_clock_ms()) < 1_000


# --- 3. readers that stop reading their sockets -------------------------------------------


def test_readers_that_stop_reading_hold_no_sender_thread(tmp_path):
    """A disk read's reply is sent with sendfile from one of the process's 8 sender threads.
    A thread waited there for room in the socket, up to 30 s: 8 clients that stopped reading
    mid-reply held all 8, and every other client's disk read waited (29 s measured). Now a
    thread sends what the socket takes and the wait for room is on the event loop. Here 8
    readers stall, another client's read comes back at once, and the 8 get every byte once
    they read again."""
    from kvpool.transports.connection import FILE_SENDER_THREADS

    big = os.urandom(8 * MIB)
    small = os.urandom(MIB)

    async def main():
        async with node_with_disk(tmp_path) as node:
            disk = node.disk
            entries = [InventoryEntry("big", 0, len(big), xxhash.xxh3_64_intdigest(big)),
                       InventoryEntry("small", 16 * MIB, MIB, xxhash.xxh3_64_intdigest(small))]  # fmt: skip
            for entry, data in zip(entries, (big, small)):
                disk.publish(entry, disk.write_temporary(entry, [memoryview(data)]))
            disk.record(entries)
            stalled = []
            try:
                for _ in range(FILE_SENDER_THREADS):
                    conn = await connect(node.endpoint, key=None)
                    stalled.append(conn)
                    conn._transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
                    conn._transport.pause_reading()
                sinks = [bytearray(len(big)) for _ in stalled]
                reads = [
                    asyncio.ensure_future(read_disk(conn, ReadItem(disk.segment_id, 0, len(big)), sink))
                    for conn, sink in zip(stalled, sinks)
                ]
                served = node._server.connections
                await until(lambda: sum(conn._held is not None for conn in served) == len(stalled))  # all mid-reply
                other = await connect(node.endpoint, key=None)
                stalled.append(other)
                sink = bytearray(MIB)
                await asyncio.wait_for(read_disk(other, ReadItem(disk.segment_id, 16 * MIB, MIB), sink), 5)
                assert sink == small
                for conn in stalled:
                    conn._transport.resume_reading()
                await asyncio.gather(*reads)
                assert all(sink == big for sink in sinks)
            finally:
                for conn in stalled:
                    conn.close()

    uvloop.run(asyncio.wait_for(main(), 60))


async def read_disk(conn, item: ReadItem, sink: bytearray) -> None:
    reply = await conn.request(ReadSlices([item]), reply_sinks=lambda _: [memoryview(sink)], timeout_ms=30_000)
    assert isinstance(reply, ReadReply) and reply.size == len(sink), reply
