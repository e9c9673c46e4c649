"""The node's disk tier and the DFS directory, from the file format up to a whole get.

How: the object file format is fed whole, byte by byte and corrupted (pure, no I/O); the file
I/O of transports/files.py runs on pytest's tmp_path, with socketpairs for sendfile and two
writer processes racing on one name for the torn-file check; the disk tier is opened, filled,
littered with what a crash leaves (temporary and truncated files) and re-opened; and an
in-process cluster (a real MasterServer and Nodes on one uvloop over loopback, as in
test_client_api.py) proves offload on evict, reads by sendfile and by same-host files,
promotion and write-through end to end, with the master checking its invariants after every
request.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import multiprocessing
import os
import select
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import uvloop
import xxhash

from kvpool import AsyncStore, ReplicateConfig, limits
from kvpool.config import MasterConfig, NodeConfig
from kvpool.errors import ChecksumMismatch, FilesystemFull, InvalidParams, ObjectNotFound, RpcFailed, TransferFailed
from kvpool.master.server import MasterServer
from kvpool.node import disk as disk_module
from kvpool.node.disk import DiskTier
from kvpool.node.server import Node
from kvpool.protocol import auth, objectfile
from kvpool.protocol.frames import is_slow_copy
from kvpool.protocol.messages import TIER_DISK, ClusterStatus, InventoryEntry, ReadItem, ReadReply, ReadSlices
from kvpool.transports import files
from kvpool.transports.connection import Connection, connect
from kvpool.transports.dfs import DfsDirectory
from kvpool.transports.files import FileRange

MIB = 1 << 20


# --- the format (pure) -------------------------------------------------------------------


def test_header_round_trips_and_rejects_every_prefix_and_every_flipped_byte():
    header = objectfile.encode_header("prefix/äöü/0", 12345, 2**64 - 1)
    assert len(header) % objectfile.ALIGN_BYTES == 0
    decoded = objectfile.decode_header(header)
    assert decoded == objectfile.ObjectHeader("prefix/äöü/0", 12345, 2**64 - 1, len(header))
    assert objectfile.decode_header(header + b"trailing bytes") == decoded
    used = objectfile.FIXED_SIZE_BYTES + len("prefix/äöü/0".encode())
    for cut in range(used):
        assert objectfile.decode_header(header[:cut]) is None, cut
    for position in range(used):
        corrupt = bytearray(header)
        corrupt[position] ^= 0x40
        assert objectfile.decode_header(bytes(corrupt)) is None, position
    long_key = "k" * 4096
    assert objectfile.decode_header(objectfile.encode_header(long_key, 1, 0)).key == long_key


def test_names_round_trip():
    assert objectfile.disk_offset_of(objectfile.disk_name(123_456)) == 123_456
    assert objectfile.disk_offset_of("000000000001.kvo.ab12.tmp") is None
    assert objectfile.disk_offset_of("zz.kvo") is None
    path = objectfile.dfs_relative_path("a/key", 4096)
    bucket, name = path.split("/")[1:]
    assert objectfile.dfs_offset_of(name) == 4096 and name.startswith(bucket)
    assert objectfile.dfs_relative_path("a/key", 4096) != objectfile.dfs_relative_path("a/key", 8192)


# --- files --------------------------------------------------------------------------------


def write(directory: Path, name: str, key: str, data: bytes, **options) -> Path:
    files.write_object(directory, name, key, xxhash.xxh3_64_intdigest(data), [memoryview(data)],
                       is_durable=options.get("is_durable", True))  # fmt: skip
    return directory / name


def test_object_files_are_written_whole_and_read_back_checked(tmp_path):
    data = os.urandom(300_000)
    path = write(tmp_path, "a.kvo", "key-a", data)
    assert not list(tmp_path.glob("*.tmp"))
    assert files.read_object_bytes(path, "key-a", len(data)) == data
    target = bytearray(len(data) + 10)
    files.read_object_into(path, "key-a", len(data), [memoryview(target)[:1000], memoryview(target)[1000:]])
    assert bytes(target[: len(data)]) == data
    with pytest.raises(ChecksumMismatch):
        files.read_object_bytes(path, "another-key", len(data))
    with pytest.raises(ChecksumMismatch):
        files.read_object_bytes(path, "key-a", len(data) + 1)
    with pytest.raises(ObjectNotFound):
        files.read_object_bytes(tmp_path / "absent.kvo", "key-a", 1)
    header = files.read_header(path)
    assert header is not None and header.checksum == xxhash.xxh3_64_intdigest(data)
    os.truncate(path, header.file_size - 1)  # what a power loss without fsync may leave
    assert files.read_header(path) is None


def test_a_write_into_a_full_filesystem_says_so_and_leaves_nothing(small_filesystem):
    directory = small_filesystem("1m")
    write(directory, "small.kvo", "small", os.urandom(200_000))
    with pytest.raises(FilesystemFull, match="No space left"):  # not TransferFailed: the master caps the tier
        write(directory, "large.kvo", "large", os.urandom(2_000_000))
    assert sorted(p.name for p in directory.iterdir()) == ["small.kvo"]  # no temporary file either
    with pytest.raises(TransferFailed):  # other failures are what they were
        write(directory / "absent", "a.kvo", "a", b"x")


def test_a_rename_or_a_bucket_that_finds_the_filesystem_full_says_so(tmp_path, monkeypatch):
    """A rename into a directory that must grow, or a DFS bucket made, on a full filesystem is
    a full filesystem too (the master then caps the tier and keeps the object), not a failed
    copy that loses the object being offloaded (review helper-149)."""
    temporary = tmp_path / "a.tmp"
    temporary.write_bytes(b"x")
    dfs = DfsDirectory.create_or_open(tmp_path / "dfs", 64 * 1024 * 1024)

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "rename", full)
    with pytest.raises(FilesystemFull, match="No space left"):
        files.publish(temporary, tmp_path / "a.kvo")
    assert not temporary.exists()
    monkeypatch.setattr(os, "mkdir", full)
    with pytest.raises(FilesystemFull, match="No space left"):
        dfs.write_temporary("k", 0, 1, [memoryview(b"x")], is_durable=False)


def test_read_ahead_advice_refused_fails_no_read(tmp_path, monkeypatch):
    """posix_fadvise is advice: its refusal raised an OSError (no KVPoolError), and the reader
    got no reply but its timeout (review helper-149)."""
    tier = DiskTier.open(tmp_path / "d", 16 * 1024 * 1024, "n1", is_durable=False)
    try:
        data = os.urandom(10_000)
        entry = InventoryEntry("k", 0, len(data), xxhash.xxh3_64_intdigest(data))
        tier.publish(entry, tier.write_temporary(entry, [memoryview(data)]))
        tier.record([entry])

        def refused(*_args) -> None:
            raise OSError(errno.EINVAL, "Invalid argument")

        monkeypatch.setattr(os, "posix_fadvise", refused)
        part = tier.open_range(entry, 0, len(data))
        try:
            assert os.pread(part.fd, part.size, part.offset) == data
        finally:
            files.close_parts([part])
    finally:
        tier.close()


@pytest.mark.parametrize("shift", [0, 16, 40, 4080], ids=lambda shift: f"{shift}-past-a-page")
def test_reads_into_buffers_at_any_offset_of_a_page_land_whole(tmp_path, monkeypatch, shift):
    """Into a buffer at a slow offset from the file's pages (16, 40), reads go through the
    bounce buffer, here made small so that one object takes several rounds; the bytes land
    whole either way, and a file that ends early is TransferFailed on both paths."""
    monkeypatch.setattr(files, "BOUNCE_BUFFER_BYTES", 100_000)
    monkeypatch.setattr(files, "BOUNCE_READ_BYTES_MIN", 64 * 1024)
    monkeypatch.setattr(files, "_bounce", threading.local())
    bounced = []
    through_bounce = files._read_through_bounce
    monkeypatch.setattr(files, "_read_through_bounce", lambda *args: bounced.append(args[2]) or through_bounce(*args))
    data = os.urandom(1_000_003)
    path = write(tmp_path, "a.kvo", "key-a", data)
    arena = np.zeros(len(data) + 3 * 4096, dtype=np.uint8)
    start = -arena.ctypes.data % 4096 + shift
    views = [memoryview(arena)[start : start + 70_000], memoryview(arena)[start + 70_000 : start + len(data)]]
    files.read_object_into(path, "key-a", len(data), views)
    assert arena[start : start + len(data)].tobytes() == data
    assert arena[:start].sum() == 0 and arena[start + len(data) :].sum() == 0  # nothing beyond
    assert bool(bounced) == is_slow_copy(objectfile.header_size_for("key-a"), start + arena.ctypes.data)
    os.truncate(path, objectfile.header_size_for("key-a") + len(data) - 5)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(TransferFailed):
            files.read_range_into(FileRange(fd, objectfile.header_size_for("key-a"), len(data)), views)
    finally:
        os.close(fd)


def test_a_file_range_is_copied_in_the_kernel(tmp_path):
    data = os.urandom(2 * MIB + 3)
    source = write(tmp_path, "src.kvo", "k", data)
    fd, header = files.open_object(source, "k", len(data))
    try:
        files.write_object(tmp_path, "dst.kvo", "k", 7, FileRange(fd, header.header_size, len(data)), is_durable=False)
    finally:
        os.close(fd)
    assert files.read_object_bytes(tmp_path / "dst.kvo", "k", len(data)) == data


def test_send_some_mixes_buffers_and_file_ranges_on_a_non_blocking_socket(tmp_path):
    """A slow reader makes room in time: send_some waits for it in its thread and sends
    everything, in order, in one call or a few (the caller waits for room between)."""
    data = os.urandom(5 * MIB)
    path = write(tmp_path, "a.kvo", "k", data)
    fd, header = files.open_object(path, "k", len(data))
    left, right = socket.socketpair()
    left.setblocking(False)
    received = bytearray()

    def drain() -> None:
        while len(received) < 6 + len(data) - 100:
            chunk = right.recv(1 << 20)
            if not chunk:
                return
            received.extend(chunk)
            time.sleep(0.001)  # a slow reader: the sender must wait for room

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        parts = [b"head", FileRange(fd, header.header_size + 100, len(data) - 100), b"!!"]
        position: files.SendPosition | None = files.SEND_START
        deadline_s = time.monotonic() + 5
        while position is not None and time.monotonic() < deadline_s:
            position = files.send_some(left.fileno(), parts, position)
            if position is not None:
                select.select([], [left], [], 1)
    finally:
        reader.join(10)
        files.close_parts([FileRange(fd, 0, 0)])
        left.close()
        right.close()
    assert bytes(received) == b"head" + data[100:] + b"!!"


WRITERS_ROUNDS = 150


def _racing_writer(directory: str, seed: int) -> None:
    dfs = DfsDirectory(directory)
    for round_ in range(WRITERS_ROUNDS):
        data = bytes([seed]) * (64 * 1024 + round_)
        checksum = xxhash.xxh3_64_intdigest(data)
        written = dfs.write_temporary("same-key", 4096, checksum, [memoryview(data)], is_durable=False)
        dfs.publish("same-key", 4096, written, is_durable=False)


def test_two_writers_of_one_key_never_produce_a_torn_file(tmp_path):
    DfsDirectory.create_or_open(tmp_path, 64 * MIB)
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_racing_writer, args=(str(tmp_path), seed)) for seed in (1, 2)]
    for writer in writers:
        writer.start()
    dfs = DfsDirectory(tmp_path)
    path = dfs.path_of("same-key", 4096)
    seen = 0
    deadline = time.monotonic() + 30
    while any(w.is_alive() for w in writers) and time.monotonic() < deadline:
        try:
            header, data = files.read_object_file(path)  # one version of the file
        except ObjectNotFound:
            continue  # between the two writers' first renames
        assert header.key == "same-key"
        assert xxhash.xxh3_64_intdigest(data) == header.checksum  # whole: one writer's bytes
        assert len(set(data)) == 1
        seen += 1
    for writer in writers:
        writer.join(30)
        assert writer.exitcode == 0
    assert seen > 0
    assert list(dfs.scan(10**9)) and not list(path.parent.glob("*.tmp"))


# --- the disk tier ------------------------------------------------------------------------


def test_the_removal_of_a_refused_entry_spares_the_object_a_move_published_at_its_offset(tmp_path):
    """A node re-mounts its disk tier; the master refuses an entry (removed while the node was
    away) and, the range free in its view, grants it to a move at once: the move's file was
    published at the entry's offset (files are named by offset) before the refused entry's
    removal ran, which deleted it, and the master listed a replica without a file (a history
    run under every fault). A removal now takes a file only while it holds its own object."""
    tier = DiskTier.open(tmp_path / "d", 16 * MIB, "node-1", is_durable=True)
    old, new = os.urandom(50_000), os.urandom(60_000)
    refused = InventoryEntry("removed-while-away", 4096, len(old), xxhash.xxh3_64_intdigest(old))
    tier.publish(refused, tier.write_temporary(refused, [memoryview(old)]))
    assert tier.record([refused]) == []
    forgotten = tier.forget([refused])  # the mount reply's refusal, on the loop
    moved = InventoryEntry("moved-in", 4096, len(new), xxhash.xxh3_64_intdigest(new))
    tier.publish(moved, tier.write_temporary(moved, [memoryview(new)]))  # the move, first
    assert tier.remove_files(forgotten) == []  # the refusal's removal, after
    assert tier.record([moved]) == []
    assert files.holds_object(tier.path_of(4096), "moved-in", len(new), moved.checksum)
    assert tier.remove_files([moved]) == [] and not tier.path_of(4096).exists()  # its own file: removed
    tier.close()


def test_disk_tier_keeps_its_identity_refuses_a_second_user_and_cleans_up_after_a_crash(tmp_path):
    with pytest.raises(InvalidParams, match="no disk tier yet: give its size"):  # a new one needs a size
        DiskTier.open(tmp_path / "d", 0, "node-1", is_durable=True)
    assert not (tmp_path / "d").exists()  # and nothing was left behind
    tier = DiskTier.open(tmp_path / "d", 16 * MIB, "node-1", is_durable=True)
    segment_id, token = tier.segment_id, tier.token
    assert segment_id.endswith("/disk") and len(token) == 16
    with pytest.raises(InvalidParams):
        DiskTier.open(tmp_path / "d", 16 * MIB, "node-2", is_durable=True)  # locked
    data = os.urandom(100_000)
    entry = InventoryEntry("k1", 4096, len(data), xxhash.xxh3_64_intdigest(data))
    tier.publish(entry, tier.write_temporary(entry, [memoryview(data)]))
    assert tier.record([entry]) == []
    objects = tier.objects_path
    # What a kill -9 can leave: a temporary file, a file with a torn tail, a foreign file.
    (objects / f"{objectfile.disk_name(8192)}.dead{objectfile.TEMP_SUFFIX}").write_bytes(b"partial")
    torn = InventoryEntry("k2", 1 << 20, len(data), 1)
    tier.publish(torn, tier.write_temporary(torn, [memoryview(data)]))
    os.truncate(tier.path_of(torn.offset), 4096 + 10)
    (objects / "README").write_text("not ours")
    tier.close()
    again = DiskTier.open(tmp_path / "d", 0, "node-2", is_durable=True)  # a restart: size kept
    assert (again.segment_id, again.token, again.capacity_bytes) == (segment_id, token, 16 * MIB)
    assert again.inventory.entries() == [entry]
    assert sorted(p.name for p in objects.iterdir()) == ["000000001000.kvo", "README"]
    info = again.info("node-2", "host", "h:1", is_shared=True)
    assert info.tier == TIER_DISK and info.shm_token == token
    rng = again.open_range(entry, entry.offset + 10, 20)
    try:
        assert os.pread(rng.fd, 20, rng.offset) == data[10:30]
    finally:
        os.close(rng.fd)
    with pytest.raises(ObjectNotFound):
        again.containing(0, 10)
    assert again.forget([entry]) == [entry]
    assert again.remove_files([entry]) == []
    assert not again.path_of(entry.offset).exists()
    again.close()
    with pytest.raises(InvalidParams):
        DiskTier.open(tmp_path / "new", 0, "node-3", is_durable=True)  # a new tier needs a size


def test_a_disk_tier_adopting_many_files_at_start_says_how_far_it_is(tmp_path, monkeypatch, caplog):
    """A million files take a node tens of seconds to adopt before it serves: it says so as it
    goes, not only once done (a node silent that long looks hung)."""
    tier = DiskTier.open(tmp_path / "d", 16 * MIB, "node-1", is_durable=False)
    data = b"x" * 100
    checksum = xxhash.xxh3_64_intdigest(data)
    for i in range(1_100):
        entry = InventoryEntry(f"k{i}", i * 4096, len(data), checksum)
        tier.publish(entry, tier.write_temporary(entry, [memoryview(data)]))
    tier.close()
    monkeypatch.setattr(disk_module, "ADOPT_PROGRESS_LOG_INTERVAL_S", 0.0)
    with caplog.at_level(logging.INFO, logger="kvpool.node.disk"):
        again = DiskTier.open(tmp_path / "d", 0, "node-1", is_durable=False)
    again.close()
    assert "adopting its files, 1024 read" in caplog.text
    assert "adopted 1100 objects" in caplog.text


def test_a_restarted_disk_tier_removes_the_older_of_two_files_that_collide(tmp_path):
    """Two files of one key, and two files whose ranges overlap (what a lost drop can leave):
    at adoption the newer file wins, and the older one's file is removed, not left on disk
    outside the inventory for good (before, both survived every restart)."""
    tier = DiskTier.open(tmp_path / "d", 16 * MIB, "node-1", is_durable=False)
    data = os.urandom(100_000)
    checksum = xxhash.xxh3_64_intdigest(data)
    old_copy = InventoryEntry("a", 0, len(data), checksum)
    new_copy = InventoryEntry("a", 4 * MIB, len(data), checksum)  # one key in two files
    under = InventoryEntry("x", 8 * MIB, len(data), checksum)
    over = InventoryEntry("y", 8 * MIB + 4096, len(data), checksum)  # over the end of x's range
    long_ago_s = time.time() - 100
    for entry in (old_copy, under):
        tier.publish(entry, tier.write_temporary(entry, [memoryview(data)]))
        os.utime(tier.path_of(entry.offset), (long_ago_s, long_ago_s))
    for entry in (new_copy, over):
        tier.publish(entry, tier.write_temporary(entry, [memoryview(data)]))
    tier.close()
    for _ in range(2):  # and again: nothing more goes at the next restart
        again = DiskTier.open(tmp_path / "d", 0, "node-1", is_durable=False)
        try:
            assert again.inventory.entries() == [new_copy, over]
            assert sorted(p.name for p in again.objects_path.iterdir()) == [
                objectfile.disk_name(new_copy.offset), objectfile.disk_name(over.offset),
            ]  # fmt: skip
            for entry in (new_copy, over):
                assert files.read_object_bytes(again.path_of(entry.offset), entry.key, entry.size) == data
        finally:
            again.close()


# --- end to end, in process ---------------------------------------------------------------


@contextlib.asynccontextmanager
async def tiered_cluster(tmp_path: Path, memory_bytes: int = 2 * MIB, **master_options):
    master = MasterServer(MasterConfig(**master_options), port=0, seed=1, debug_invariants=True,
                          dfs_dir=str(tmp_path / "dfs"))  # fmt: skip
    await master.start()
    node = Node(
        NodeConfig(
            master_endpoint=master.endpoint, memory_bytes=memory_bytes, disk_dir=str(tmp_path / "disk"),
            disk_bytes=32 * MIB, dfs_dir=str(tmp_path / "dfs"),
        )
    )  # fmt: skip
    try:
        await node.start()
        await node.wait_mounted(5_000)
        yield master, node
    finally:
        await node.stop()
        await master.stop()


def run(coroutine):
    return uvloop.run(asyncio.wait_for(coroutine, 60))


async def wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def tier_of(store: AsyncStore, keys: list[str]) -> dict[str, list[str]]:
    reply = await store.query(keys)
    status = await store.cluster_status()
    tiers = {s.segment.segment_id: s.segment.tier for s in status.segments}
    return {key: sorted(tiers[r.segment_id] for r in replicas) for key, replicas in zip(keys, reply.replicas)}


def test_objects_evicted_from_dram_are_read_from_disk_by_sendfile_and_by_file(tmp_path):
    async def main():
        async with tiered_cluster(tmp_path) as (master, node):
            values = {f"k{i}": os.urandom(128 * 1024) for i in range(40)}  # 5 MiB through 2 MiB
            async with await AsyncStore.open(master.endpoint) as writer:
                for key, value in values.items():
                    await writer.put(key, value)
            async with await AsyncStore.open(master.endpoint, shm_enabled=False) as store:
                where = await tier_of(store, list(values))
                on_disk = [k for k, tiers in where.items() if tiers == [TIER_DISK]]
                assert len(on_disk) >= 20
                # A batch mixing DRAM and disk objects: one frame per node, both kinds of items.
                assert await store.get_batch(list(values)) == list(values.values())
                assert node.tier_metrics.disk_read_requests._value.get() >= len(on_disk)
                # Into registered buffers, scattered over three of them.
                parts = [np.zeros(n, dtype=np.uint8) for n in (1000, 60_000, 71_000)]
                addresses = [store.register_buffer(p) for p in parts]
                key = on_disk[0]
                sizes = [[p.nbytes for p in parts]]
                assert await store.batch_get_into_multi_buffers([key], [addresses], sizes) == [128 * 1024]
                assert np.concatenate(parts)[: 128 * 1024].tobytes() == values[key]
            reads_before = node.tier_metrics.disk_read_requests._value.get()
            async with await AsyncStore.open(master.endpoint) as local:  # same host: the files
                assert await local.get_batch(on_disk) == [values[k] for k in on_disk]
            assert node.tier_metrics.disk_read_requests._value.get() == reads_before
            status = (await store_status(master)).to_dict()
            disk = next(t for t in status["tiers"] if t["tier"] == TIER_DISK)
            assert disk["offloads"] >= len(on_disk) and disk["hits"] >= len(on_disk)
            # Bytes rotted on the device are never served: the checksum check makes it a miss.
            rotten = on_disk[1]
            entry = node.disk.inventory.get(rotten)
            path = node.disk.path_of(entry.offset)
            with open(path, "r+b") as file:
                file.seek(objectfile.header_size_for(rotten) + 1000)
                byte = file.read(1)
                file.seek(-1, os.SEEK_CUR)
                file.write(bytes([byte[0] ^ 1]))
            for shm_enabled in (False, True):  # through sendfile, and through the file
                async with await AsyncStore.open(master.endpoint, shm_enabled=shm_enabled) as store:
                    assert await store.get(rotten) is None
                    assert await store.get(on_disk[2]) == values[on_disk[2]]

    run(main())


async def store_status(master: MasterServer):
    async with await AsyncStore.open(master.endpoint) as store:
        return await store.cluster_status()


def test_an_object_read_often_from_disk_is_promoted_back_into_dram(tmp_path):
    async def main():
        async with tiered_cluster(tmp_path, promote_reads=2) as (master, _):
            values = {f"p{i}": os.urandom(256 * 1024) for i in range(16)}
            async with await AsyncStore.open(master.endpoint, shm_enabled=False) as store:
                for key, value in values.items():
                    await store.put(key, value)
                where = await tier_of(store, list(values))
                cold = next(k for k, tiers in where.items() if tiers == [TIER_DISK])
                for _ in range(2):
                    assert await store.get(cold) == values[cold]

                async def promoted() -> bool:
                    return "dram" in (await tier_of(store, [cold]))[cold]

                await wait_for(promoted)
                assert await store.get(cold) == values[cold]
                status = (await store.cluster_status()).to_dict()
                assert next(t for t in status["tiers"] if t["tier"] == "dram")["promotions"] >= 1

    run(main())


def test_write_through_puts_return_with_their_disk_and_dfs_copies(tmp_path):
    async def main():
        async with tiered_cluster(tmp_path, memory_bytes=8 * MIB) as (master, node):
            async with await AsyncStore.open(master.endpoint, dfs_dir=str(tmp_path / "dfs")) as store:
                data = os.urandom(300_000)
                config = ReplicateConfig(with_disk_copy=True, with_dfs_copy=True)
                await store.put("durable", data, config)
                assert (await tier_of(store, ["durable"]))["durable"] == ["dfs", "disk", "dram"]
                assert len(node.disk.inventory) == 1
                dfs_files = list((tmp_path / "dfs" / "objects").rglob("*.kvo"))
                assert len(dfs_files) == 1
                await store.remove("durable")

                async def gone() -> bool:
                    return not list((tmp_path / "dfs" / "objects").rglob("*.kvo")) and not len(node.disk.inventory)

                await wait_for(gone)

    run(main())


def test_a_disk_that_stops_answering_does_not_silence_its_nodes_heartbeat(tmp_path, monkeypatch):
    """A disk whose statvfs hangs (a failing device): the heartbeat awaited the look at its
    filesystem, fell silent, and the master dropped the node after its TTL, DRAM segment and
    all. Now a heartbeat waits for that look at most FILESYSTEM_LOOK_WAIT_MS and goes without
    it; a look overdue (FILESYSTEM_LOOK_OVERDUE_MS, 1 s here) reports the tier as taking no
    writes, and once the disk answers its news comes with a later heartbeat."""
    answering = threading.Event()
    real_report = DiskTier.filesystem_report

    def hung_report(tier: DiskTier):
        answering.wait(10)
        return real_report(tier)

    async def main():
        async with tiered_cluster(tmp_path, node_ttl_ms=3_000) as (master, node):
            monkeypatch.setattr(DiskTier, "filesystem_report", hung_report)
            monkeypatch.setattr(limits, "FILESYSTEM_LOOK_OVERDUE_MS", 1_000)

            async def disk_is_writable() -> bool:
                status = master.service.cluster_status(ClusterStatus(), 0)
                (disk,) = [s for s in status.segments if s.segment.tier == TIER_DISK]
                return disk.is_writable

            try:
                await asyncio.sleep(4.5)  # past the TTL: heartbeats went on
                assert all(master.service.has_segment(segment_id) for segment_id in node._segment_ids())
                assert not await disk_is_writable()  # overdue: no more moves there
            finally:
                answering.set()
            await wait_for(disk_is_writable)

    run(main())


# --- disk reads: descriptors and back-pressure --------------------------------------------


def adopt_object(directory: Path, key: str, data: bytes) -> InventoryEntry:
    """Leave one object file in a disk tier at `directory`, for a node started on it to adopt."""
    tier = DiskTier.open(directory, 32 * MIB, "node-1", is_durable=False)
    try:
        entry = InventoryEntry(key, 0, len(data), xxhash.xxh3_64_intdigest(data))
        tier.publish(entry, tier.write_temporary(entry, [memoryview(data)]))
    finally:
        tier.close()
    return entry


async def until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def descriptors_open_on(path: Path) -> int:
    count = 0
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            count += os.readlink(f"/proc/self/fd/{name}") == str(path)
    return count


async def read_disk(conn: Connection, items: list[ReadItem], sink: bytearray) -> None:
    reply = await conn.request(ReadSlices(items), reply_sinks=lambda _: [memoryview(sink)], timeout_ms=30_000)
    assert isinstance(reply, ReadReply) and reply.size == len(sink), reply


def test_a_reader_that_stalls_holds_a_few_descriptors_and_gets_every_reply_once_it_reads(tmp_path):
    """A client asks for a disk object larger than the socket buffers, stops reading, and
    sends more reads of 256 pages of that object each. The node opens the file once per
    frame (not once per page), and stops reading that client's requests once HELD_FRAMES_MAX
    replies wait behind the one being sent; once the client reads, every reply arrives whole.
    (Before, each request opened 256 descriptors, held until sent, with no end to requests.)"""
    pages = 256
    requests = limits.HELD_FRAMES_MAX + 4
    data = os.urandom(8 * MIB)
    adopt_object(tmp_path / "disk", "big", data)

    async def main():
        async with tiered_cluster(tmp_path) as (_, node):
            segment_id = node.disk_info.segment_id
            path = node.disk.path_of(0)
            conn = await connect(node.endpoint, key=None)
            try:
                # A reader that stalls, with a small window: the first reply fills the socket.
                conn._transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
                conn._transport.pause_reading()
                whole = bytearray(len(data))
                reads = [asyncio.ensure_future(read_disk(conn, [ReadItem(segment_id, 0, len(data))], whole))]
                (served,) = node._server.connections
                await until(lambda: served._held is not None)  # the first is being sent
                sinks = [bytearray(pages * 4096) for _ in range(requests)]
                items = [ReadItem(segment_id, (7 * page) * 4096, 4096) for page in range(pages)]
                reads += [asyncio.ensure_future(read_disk(conn, items, sink)) for sink in sinks]
                await until(lambda: served._held is not None and len(served._held) >= limits.HELD_FRAMES_MAX)
                assert not served._transport.is_reading()  # the rest wait in the socket
                assert len(served._held) == limits.HELD_FRAMES_MAX
                assert descriptors_open_on(path) <= limits.HELD_FRAMES_MAX + 1  # one per frame
                conn._transport.resume_reading()
                await asyncio.gather(*reads)
                expected = b"".join(data[7 * page * 4096 : (7 * page + 1) * 4096] for page in range(pages))
                is_every_byte_right = whole == data and all(sink == expected for sink in sinks)
                assert is_every_byte_right
                await until(lambda: descriptors_open_on(path) == 0)
                assert served._transport.is_reading()
            finally:
                conn.close()

    run(main())


def test_a_replica_check_without_descriptors_gives_no_verdict(tmp_path, monkeypatch):
    """A bad-replica check (the node's of its disk files, the master's of DFS files) that
    cannot open the file for want of descriptors says nothing about the file: it raises,
    where a False would have had a sound replica dropped. A file gone is bad."""
    data = os.urandom(4096)
    path = write(tmp_path, "x.kvo", "k", data)
    checksum = xxhash.xxh3_64_intdigest(data)
    assert files.holds_object(path, "k", len(data), checksum)
    real_open = os.open

    def open_without_descriptors(name, flags, *args, **kwargs):
        if str(name) == str(path):
            raise OSError(errno.EMFILE, "Too many open files", str(name))
        return real_open(name, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_without_descriptors)
    with pytest.raises(TransferFailed, match="no file descriptor"):
        files.holds_object(path, "k", len(data), checksum)
    monkeypatch.setattr(os, "open", real_open)
    path.unlink()
    assert not files.holds_object(path, "k", len(data), checksum)


def test_a_disk_read_the_node_cannot_open_is_a_clean_error_never_zeros(tmp_path, monkeypatch):
    """A node out of file descriptors (EMFILE) answers a disk read with an error, which the
    reader falls back from, not with zeros in place of a sound object (which the reader would
    report as a bad replica); the connection serves on. A frame naming more disk items than a
    client's frame can hold is refused with InvalidParams."""
    data = os.urandom(64 * 1024)
    adopt_object(tmp_path / "disk", "small", data)
    real_open = os.open

    def open_without_descriptors(path, flags, *args, **kwargs):
        if str(path).endswith(objectfile.SUFFIX):
            raise OSError(errno.EMFILE, "Too many open files", str(path))
        return real_open(path, flags, *args, **kwargs)

    async def main():
        async with tiered_cluster(tmp_path) as (_, node):
            segment_id = node.disk_info.segment_id
            conn = await connect(node.endpoint, key=None)
            try:
                sink = bytearray(len(data))
                monkeypatch.setattr(os, "open", open_without_descriptors)
                with pytest.raises(TransferFailed, match="no file descriptor left"):
                    await read_disk(conn, [ReadItem(segment_id, 0, len(data))], sink)
                monkeypatch.setattr(os, "open", real_open)
                assert sink == bytes(len(sink))  # nothing landed
                await read_disk(conn, [ReadItem(segment_id, 0, len(data))], sink)
                assert sink == data
                assert not conn.is_closed()
                # More items than a frame takes: the decoder refuses the request before it reads
                # an item (protocol/messages.py Batch) and closes that connection only.
                too_many = [ReadItem(segment_id, 0, 1)] * (limits.DISK_ITEMS_PER_FRAME_MAX + 1)
                with pytest.raises(RpcFailed, match="closed"):
                    await read_disk(conn, too_many, bytearray(len(too_many)))
                conn.close()
                conn = await connect(node.endpoint, key=None)
                await read_disk(conn, [ReadItem(segment_id, 0, len(data))], sink)
                assert sink == data
            finally:
                conn.close()

    run(main())


def test_a_dfs_directory_whose_parent_is_missing_is_refused_not_made_up(tmp_path):
    """A master started with --dfs-dir on a shared filesystem not mounted made the whole path up
    on its own disk, and served a DFS tier no node could see; its own directory it still makes."""
    with pytest.raises(InvalidParams, match="is not a directory .is the shared filesystem mounted"):
        DfsDirectory.create_or_open(tmp_path / "not-mounted" / "kvpool", 64 * MIB)
    assert not (tmp_path / "not-mounted").exists()
    master = MasterServer(MasterConfig(), port=0, dfs_dir=str(tmp_path / "not-mounted" / "kvpool"))
    with pytest.raises(InvalidParams, match="is not a directory .is the shared filesystem mounted"):
        uvloop.run(master.start())
    assert not (tmp_path / "not-mounted").exists()
    DfsDirectory.create_or_open(tmp_path / "kvpool", 64 * MIB)
    assert (tmp_path / "kvpool" / objectfile.OBJECTS_DIR).is_dir()


def test_a_dfs_share_gone_from_under_its_mount_point_takes_no_write(tmp_path):
    """A share unmounted under a running node leaves its mount point, an empty directory of
    this host's disk. The node's next DFS writes made the whole tree up there, answered "ok",
    and the master indexed objects no other host could read (helper-48)."""
    mount_point = tmp_path / "mnt"
    mount_point.mkdir()
    share = DfsDirectory.create_or_open(mount_point / "kvpool", 64 * MIB)
    data = os.urandom(10_000)
    checksum = xxhash.xxh3_64_intdigest(data)
    share.publish("before", 4096, share.write_temporary("before", 4096, checksum, [memoryview(data)], is_durable=False),
                  is_durable=False)  # fmt: skip
    assert share.read_bytes("before", 4096, len(data)) == data
    mount_point.rename(tmp_path / "share-elsewhere")  # what the node sees of an unmount
    mount_point.mkdir()
    with pytest.raises(TransferFailed, match="is gone .is the shared filesystem mounted"):
        share.write_temporary("after", 8192, checksum, [memoryview(data)], is_durable=False)
    assert list(mount_point.iterdir()) == []


def test_a_disk_tier_whose_objects_directory_was_removed_reports_no_room(tmp_path):
    """Every offload into it failed, and the object it carried was lost, while the tier still
    reported itself writable: the master went on sending moves (helper-48). Its whole
    directory removed was already reported so."""
    tier = DiskTier.open(tmp_path / "d", 16 * MIB, "node-1", is_durable=False)
    try:
        assert tier.filesystem_report().is_writable
        tier.objects_path.rmdir()
        assert not tier.filesystem_report().is_writable
    finally:
        tier.close()


def test_a_dfs_directory_is_refused_to_another_cluster_with_or_without_a_token(tmp_path):
    """Each master allocates the DFS tier's offsets alone and indexes every file in it: two
    clusters on one directory served and removed each other's objects. A cluster without a
    token is one too (helper-51: its mark was "", as a directory from before marks, and any
    cluster took it)."""
    with_token, without = auth.cluster_mark(auth.cluster_key("a-token")), auth.cluster_mark(None)
    for first, second in ((with_token, without), (without, with_token)):
        path = tmp_path / first / "kvpool"
        path.parent.mkdir()
        DfsDirectory.create_or_open(path, 64 * MIB, first)
        DfsDirectory.create_or_open(path, 64 * MIB, first)  # its own, again
        with pytest.raises(InvalidParams, match="is the DFS tier of another cluster"):
            DfsDirectory.create_or_open(path, 64 * MIB, second)
    # A directory from before marks is taken by the first master that opens it.
    path = tmp_path / "old" / "kvpool"
    path.parent.mkdir()
    old = DfsDirectory.create_or_open(path, 64 * MIB, "").identity()
    assert old is not None and old.owner == ""
    DfsDirectory.create_or_open(path, 64 * MIB, without)
    with pytest.raises(InvalidParams, match="another cluster"):
        DfsDirectory.create_or_open(path, 64 * MIB, with_token)
