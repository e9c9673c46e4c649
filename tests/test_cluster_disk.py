"""The node disk tier as operators run it: a master and nodes as real processes on loopback,
each node with `--disk-dir` under pytest's tmp_path, clients in this process (TCP only where a
test says so, so that disk objects come through the owning node's transfer server).

How: DRAM is filled past its high watermark and everything is read back; a node is killed with
SIGKILL while it is offloading and restarted on the same directory; a node is stopped and
restarted and its disk objects are read without any client writing them again. Every check is
on the bytes a user gets back (equal to what was put, or a clean miss) and on what the master
reports per tier. Sizes are small (tens of MiB) and every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import xxhash

from kvpool import AsyncStore, ErrorCode, Store
from kvpool.protocol import objectfile
from kvpool.transports import files
from tests.test_cluster import kvpool_cli, values_for, wait_until

OBJECT_SIZE = 256 * 1024
FILLER = 0xA5  # what a buffer holds before a get that must leave it untouched
LOOP_WORKERS = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor's threads


def disk_args(path: Path, size: str = "64MiB") -> tuple[str, ...]:
    return ("--disk-dir", str(path), "--disk-size", size)


def tiers_of(store: Store) -> dict[str, dict]:
    return {t["tier"]: t for t in store.cluster_status().to_dict()["tiers"]}


def disk_keys(store: Store, keys: list[str], disk_segment_id: str) -> list[str]:
    reply = store.query(keys)
    return [k for k, rs in zip(keys, reply.replicas) if any(r.segment_id == disk_segment_id for r in rs)]


def object_files(disk_dir: Path) -> dict[str, tuple[int, int]]:
    """name -> (inode, mtime_ns) of the whole object files of a disk tier."""
    return {
        p.name: (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in (disk_dir / objectfile.OBJECTS_DIR).iterdir()
        if p.name.endswith(objectfile.SUFFIX)
    }


def temp_files(disk_dir: Path) -> list[str]:
    return [p.name for p in (disk_dir / objectfile.OBJECTS_DIR).iterdir() if objectfile.is_temp_name(p.name)]


def master_lines(cluster) -> list[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.http_port}/metrics", timeout=5) as response:
        return response.read().decode().splitlines()


def master_metric(cluster, name: str) -> float:
    for line in master_lines(cluster):
        if line.startswith((name + " ", name + "{")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def only_on_disk(make_cluster, tmp_path: Path, key: str, data: bytes, master_args: tuple[str, ...] = ()):
    """A cluster whose one node holds `key` on its disk tier only (put with a disk copy, then
    the node restarted: its DRAM is gone, its disk re-adopted)."""
    from kvpool import ReplicateConfig

    cluster = make_cluster(0, "8MiB", master_args=master_args)
    node = cluster.start_node(disk_args(tmp_path / "disk"))
    with Store(cluster.master_endpoint) as store:
        assert store.put_batch([key], [data], ReplicateConfig(with_disk_copy=True)) == [ErrorCode.OK]
    node.stop()
    cluster.start_node(disk_args(tmp_path / "disk"))
    return cluster


@pytest.mark.parametrize("token", ["", "disk-tier-token"], ids=["no-token", "token"])
def test_dram_filled_past_the_watermark_is_read_back_from_disk_by_another_client(make_cluster, tmp_path, token):
    """With a token, the disk replies' payloads (sent with sendfile) carry their tag too, made
    by the sending thread from the files (transports/files.py payload_tag_of)."""
    cluster = make_cluster(0, "8MiB", token=token or None)
    cluster.start_nodes([disk_args(tmp_path / f"disk{index}") for index in range(2)])
    values = values_for("fill", 96, OBJECT_SIZE)  # 24 MiB through 16 MiB of DRAM
    with Store(cluster.master_endpoint, token=token) as writer:
        for key, value in values.items():
            writer.put(key, value)
        # The tick's watermark eviction brings DRAM below 0.90 by moving objects to disk.
        wait_until(lambda: tiers_of(writer)["dram"]["used_bytes"] <= 0.9 * 16 * 1024 * 1024)
    with Store(cluster.master_endpoint, shm_enabled=False, token=token) as reader:  # TCP only
        assert reader.get_batch(list(values)) == list(values.values())
        tiers = tiers_of(reader)
        assert tiers["disk"]["object_count"] >= 96 - 64
        assert tiers["disk"]["offloads"] == tiers["dram"]["evictions"] >= 32
        assert tiers["disk"]["hits"] >= 32 and tiers["dram"]["hits"] + tiers["disk"]["hits"] >= 96
        assert tiers["disk"]["capacity_bytes"] == 2 * 64 * 1024 * 1024
    stat = kvpool_cli("stat", "--json", "--master", cluster.master_endpoint, env={"KVPOOL_TOKEN": token})
    assert stat.returncode == 0, stat.stderr.decode()
    assert {t["tier"] for t in json.loads(stat.stdout)["tiers"]} == {"dram", "disk", "dfs"}
    assert master_metric(cluster, 'kvpool_master_tier_offloads_total{tier="disk"}') >= 32


def test_node_killed_mid_offload_restarts_on_its_disk_and_serves_only_whole_objects(make_cluster, tmp_path):
    cluster = make_cluster(0, "8MiB", master_args=("--node-ttl-ms", "2000"))
    disk = tmp_path / "disk"
    args = (*disk_args(disk), "--no-shm")  # no same-host reads: the token alone proves the disk
    victim = cluster.start_node(args)
    values = values_for("crash", 120, OBJECT_SIZE)  # 30 MiB through 8 MiB: offloads all along
    errors: list[BaseException] = []

    def write() -> None:
        try:
            with Store(cluster.master_endpoint, rpc_timeout_ms=2_000) as writer:
                for key, value in values.items():
                    writer.put_batch([key], [value])  # codes, not exceptions: the node dies
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    writer = threading.Thread(target=write)
    writer.start()
    # SIGKILL while a file is being written (a temporary file exists), once the master has
    # heard of a few offloads done: a file renamed whose move was not answered yet is rejected
    # at the restart, as it must be, so renamed files alone (as until 2026-12-05) left fewer
    # than four on a loaded machine (2 of 14 runs beside a busy loop).
    with Store(cluster.master_endpoint) as watcher:
        wait_until(lambda: tiers_of(watcher)["disk"]["object_count"] >= 4, 30)
    wait_until(lambda: temp_files(disk), 30, interval_s=0.0005)
    victim.kill()
    writer.join(60)
    assert not writer.is_alive()
    restarted = cluster.start_node(args)
    disk_segment = restarted.info["disk_segment_id"]
    assert disk_segment == victim.info["disk_segment_id"]  # the same disk tier, re-adopted
    assert not temp_files(disk)  # the restart removed what the kill left half-written
    with Store(cluster.master_endpoint, shm_enabled=False) as reader:
        reported = disk_keys(reader, list(values), disk_segment)
        assert len(reported) >= 4
        assert len(reported) == len(object_files(disk))
        got = reader.get_batch(reported)
        assert got == [values[key] for key in reported]  # every one whole, none wrong
        # The rest is readable or a clean miss (the dead node's DRAM), never other bytes.
        for key, data in zip(values, reader.get_batch(list(values))):
            assert data in (values[key], None)
    assert not errors, errors


def test_restarted_node_serves_its_disk_objects_without_any_client_writing_them_again(make_cluster, tmp_path):
    cluster = make_cluster(0, "8MiB")
    disk = tmp_path / "disk"
    node = cluster.start_node(disk_args(disk))
    values = values_for("keep", 64, OBJECT_SIZE)  # 16 MiB through 8 MiB
    with Store(cluster.master_endpoint) as writer:
        for key, value in values.items():
            writer.put(key, value)
        # Settled: below the watermark, and no object half-way (an offload in flight counts
        # in DRAM only, a finished one in disk only; nothing was read, so none kept both).
        wait_until(lambda: tiers_of(writer)["dram"]["used_bytes"] <= 0.9 * 8 * 1024 * 1024
                   and sum(t["object_count"] for t in tiers_of(writer).values()) == 64)  # fmt: skip
        on_disk = disk_keys(writer, list(values), node.info["disk_segment_id"])
    assert len(on_disk) >= 32
    before = object_files(disk)
    puts_before = master_metric(cluster, "kvpool_master_puts_total")
    node.stop()  # SIGTERM: the node unmounts both its segments and leaves
    with Store(cluster.master_endpoint) as store:
        assert sum(store.batch_exists(on_disk)) == 0  # gone with the node...
    restarted = cluster.start_node(disk_args(disk))
    with Store(cluster.master_endpoint, shm_enabled=False) as reader:
        wait_until(lambda: all(reader.batch_exists(on_disk)))  # ...and back with its disk
        assert reader.get_batch(on_disk) == [values[key] for key in on_disk]
        assert tiers_of(reader)["disk"]["object_count"] == len(on_disk)
    assert restarted.info["disk_segment_id"] == node.info["disk_segment_id"]
    assert object_files(disk) == before  # the very same files: nothing rewritten
    assert master_metric(cluster, "kvpool_master_puts_total") == puts_before


def test_write_through_put_and_same_host_reads_of_the_disk_files(make_cluster, tmp_path, monkeypatch):
    cluster = make_cluster(0, "8MiB")
    node = cluster.start_node(disk_args(tmp_path / "disk"))
    data = os.urandom(3 * 1024 * 1024 + 5)
    (tmp_path / "in").write_bytes(data)
    with Store(cluster.master_endpoint) as store:
        from kvpool import ReplicateConfig

        assert store.put_batch(["wt"], [data], ReplicateConfig(with_disk_copy=True)) == [ErrorCode.OK]
        replicas = store.query(["wt"]).replicas[0]
        assert {r.segment_id for r in replicas} == {node.info["segment_id"], node.info["disk_segment_id"]}
    assert len(object_files(tmp_path / "disk")) == 1
    node.stop()
    restarted = cluster.start_node(disk_args(tmp_path / "disk"))
    # Same host, shared memory allowed: the client reads the file itself (the CLI, too).
    out = tmp_path / "out"
    got = kvpool_cli("get", "wt", "-o", str(out), "--master", cluster.master_endpoint)
    assert got.returncode == 0, got.stderr.decode()
    assert out.read_bytes() == data
    # AsyncStore reads the file too, on a worker thread: a disk's latency never stalls the loop.
    read_on: list[int] = []
    real_open = files.open_object

    def recording_open(*args):
        read_on.append(threading.get_ident())
        return real_open(*args)

    monkeypatch.setattr(files, "open_object", recording_open)  # every way of reading a file opens so

    async def read_async() -> tuple[bytes | None, int]:
        async with await AsyncStore.open(cluster.master_endpoint) as store:
            return await store.get("wt"), threading.get_ident()

    got_async, loop_thread = asyncio.run(read_async())
    assert got_async == data
    assert read_on and loop_thread not in read_on
    del restarted


def test_a_put_preferring_the_disk_tiers_segment_is_stored_in_dram(make_cluster, tmp_path):
    """ClusterStatus lists the disk tier's segment, and a client may name it as its preferred
    segment: the put is stored in DRAM and read back (before, the master granted the write on
    the disk tier, the node refused it, and the put failed)."""
    from kvpool import ReplicateConfig

    cluster = make_cluster(0, "8MiB")
    node = cluster.start_node(disk_args(tmp_path / "disk"))
    data = os.urandom(OBJECT_SIZE)
    with Store(cluster.master_endpoint) as store:
        disk_id = node.info["disk_segment_id"]
        assert disk_id in {s.segment.segment_id for s in store.cluster_status().segments}
        config = ReplicateConfig(placement="preferred", preferred_segments=[disk_id])
        assert store.put_batch(["preferred"], [data], config) == [ErrorCode.OK]
        assert [r.segment_id for r in store.query(["preferred"]).replicas[0]] == [node.info["segment_id"]]
        assert store.get("preferred") == data


def test_an_async_get_into_whose_disk_file_hangs_returns_in_time_and_never_writes_after(
    make_cluster, tmp_path, monkeypatch
):
    """An engine cancels a load from a slow disk (or DFS mount), or sees it time out, and reuses
    the buffer at once. The same-host read of the object file ran on a worker thread straight
    into the buffer, which neither stops: an AsyncStore get without a bound of the caller's
    waited for a hung read for good; a cancelled one waited up to the transfer timeout, then
    returned with the buffer held (unregister refused it) until the read ended and wrote there,
    over whatever the engine had put in it meanwhile. Now the read runs on a file-reading
    thread into memory of its own: a get returns a miss by its deadline, a cancelled one at
    once, and the read, when the disk answers, writes nothing of the caller's."""
    data = os.urandom(1536 * 1024)  # more than one chunk of a reading thread's memory (BOUNCE_BYTES)
    cluster = only_on_disk(make_cluster, tmp_path, "k", data, ("--promote-reads", "0"))  # read from disk, always
    with Store(cluster.master_endpoint) as store:
        assert wait_until(lambda: store.exists("k"), 10)  # re-adopted from the disk
    reading, release, read_ended = threading.Event(), threading.Event(), threading.Event()
    real_open = files.open_object

    def slow_open(*args):
        reading.set()
        try:
            assert release.wait(30)  # the disk answers when the test says
            return real_open(*args)
        finally:
            read_ended.set()

    async def a_late_read_wrote_nothing(buffer: bytearray) -> bool:
        for event in (reading, read_ended):
            event.clear()
        release.set()
        assert await asyncio.to_thread(read_ended.wait, 10)
        await asyncio.sleep(0.05)  # what the late read does next, if it writes anything
        release.clear()
        return buffer.count(FILLER) == len(buffer)

    async def checks() -> None:
        transfer_timeout_s = 1.0
        async with await AsyncStore.open(cluster.master_endpoint, transfer_timeout_ms=1_000) as store:
            buffer = bytearray([FILLER]) * len(data)
            address = store.register_buffer(buffer)
            assert await store.get_into("k", address, len(data)) == len(data) and buffer == data
            buffer[:] = bytes([FILLER]) * len(data)
            monkeypatch.setattr(files, "open_object", slow_open)
            loop = asyncio.get_running_loop()
            # Timed out: a miss by the deadline.
            started = loop.time()
            assert await store.get_into("k", address, len(data)) == ErrorCode.TRANSFER_FAIL
            assert loop.time() - started < transfer_timeout_s + 0.5
            assert await a_late_read_wrote_nothing(buffer), "the timed-out get's read wrote into the buffer"
            # Cancelled: returns at once, the buffer free again.
            task = asyncio.ensure_future(store.get_into("k", address, len(data)))
            assert await asyncio.to_thread(reading.wait, 10)
            started = loop.time()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert loop.time() - started < 0.5
            store.unregister_buffer(address)  # nothing writes there any more
            assert await a_late_read_wrote_nothing(buffer), "the cancelled get's read wrote into the buffer"
            address = store.register_buffer(buffer)
            # More gets than the loop's worker threads, then all cancelled: each returns at once
            # (one still queued for a worker waited for the transfer timeout), and the reads they
            # leave under way, cancelled not overdue, hold no reading thread: the next get waits
            # for the disk and reads (four such made every get of the process an instant miss).
            reading.clear()
            gets = [asyncio.ensure_future(store.get_into("k", address, len(data))) for _ in range(LOOP_WORKERS + 2)]
            assert await asyncio.to_thread(reading.wait, 10)
            await asyncio.sleep(0.2)  # every reading thread in its open(), the last gets queued for a worker
            for cancelled in (gets[-2:], gets[:-2]):  # those queued first, while the others wait on
                started = loop.time()
                for get in cancelled:
                    get.cancel()
                ended = await asyncio.gather(*cancelled, return_exceptions=True)
                assert all(isinstance(outcome, asyncio.CancelledError) for outcome in ended), ended
                assert loop.time() - started < 0.5
            loop.call_later(0.3, release.set)
            assert await store.get_into("k", address, len(data)) == len(data) and buffer == data
            monkeypatch.undo()

    async def main() -> None:
        try:
            await checks()
        finally:
            release.set()  # a failed check leaves no read waiting

    asyncio.run(main())


def _files_opened_with_looks_by(load_identity, monkeypatch) -> list:
    """Directories looked at with `load_identity`: the list of the object files opened since."""
    real_open, opened = files.open_object, []

    def counted_open(*args):
        opened.append(args)
        return real_open(*args)

    monkeypatch.setattr(files, "load_identity", load_identity)
    monkeypatch.setattr(files, "open_object", counted_open)
    return opened


@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_disk_directory_that_hangs_when_first_looked_at_is_read_through_its_node_meanwhile(
    make_cluster, tmp_path, monkeypatch, api
):
    """The first get of a same-host disk (or DFS) segment's object reads the directory's
    identity file, to know it may open the files: on a hung mount that read held the get for
    good (an AsyncStore's event loop with it: every call of the store). Now a get waits
    LOOK_WAIT_MS for the look, then reads through the node; once the look answers,
    gets open the files here."""
    from kvpool.client.directories import LOOK_WAIT_MS

    data = os.urandom(256 * 1024)
    cluster = only_on_disk(make_cluster, tmp_path, "k", data, ("--promote-reads", "0"))  # read from disk, always
    looking, release = threading.Event(), threading.Event()
    real_load = files.load_identity

    def hung_load(directory):
        looking.set()
        assert release.wait(30)  # the mount answers when the test says
        return real_load(directory)

    opened = _files_opened_with_looks_by(hung_load, monkeypatch)

    async def checks(store) -> None:
        async def get() -> bytes | None:
            return await store.get("k") if api == "async" else store.get("k")

        started = time.monotonic()
        assert await get() == data  # through the node
        assert time.monotonic() - started < LOOK_WAIT_MS / 1000 + 1.0
        assert looking.is_set() and not opened
        started = time.monotonic()
        assert await get() == data  # the look still hangs: not waited for again
        assert time.monotonic() - started < LOOK_WAIT_MS / 1000 / 2 and not opened
        release.set()
        for _ in range(100):
            if opened:
                break
            assert await get() == data
            await asyncio.sleep(0.05)
        assert opened, "the files were never opened here once the look answered"

    try:
        if api == "sync":
            with Store(cluster.master_endpoint) as store:
                assert wait_until(lambda: store.exists("k"), 10)  # the node's re-adopted disk object
                asyncio.run(checks(store))
        else:

            async def main() -> None:
                async with await AsyncStore.open(cluster.master_endpoint) as store:
                    await checks(store)

            asyncio.run(main())
    finally:
        release.set()


# A client whose look at a disk directory never answers (a hung mount): its get, then its exit.
_HUNG_LOOK_CLIENT = """
import sys, threading
import xxhash
from kvpool import Store
from kvpool.transports import files
files.load_identity = lambda directory: threading.Event().wait()
with Store(sys.argv[1]) as store:
    assert xxhash.xxh3_64_hexdigest(store.get("k")) == sys.argv[2]
print("done", flush=True)
"""


def test_first_gets_at_once_all_wait_for_a_directory_look_and_a_hung_one_does_not_hold_the_exit(
    make_cluster, tmp_path, monkeypatch
):
    """Gets that meet a look at a directory under way wait for it as the first does (they went
    on without it, and read a DFS object as a miss); a look that never answers lets its process
    exit (the pool of threads it ran on held the interpreter's exit until the mount answered)."""
    data = os.urandom(64 * 1024)
    cluster = only_on_disk(make_cluster, tmp_path, "k", data, ("--promote-reads", "0"))
    real_load = files.load_identity

    def slow_load(directory):
        time.sleep(0.3)
        return real_load(directory)

    opened = _files_opened_with_looks_by(slow_load, monkeypatch)
    with Store(cluster.master_endpoint) as store:
        assert wait_until(lambda: store.exists("k"), 10)
        with ThreadPoolExecutor(8) as threads:
            assert list(threads.map(lambda _: store.get("k"), range(8))) == [data] * 8
        assert len(opened) == 8  # every get read the file here

    client = subprocess.Popen(
        [sys.executable, "-c", _HUNG_LOOK_CLIENT, cluster.master_endpoint, xxhash.xxh3_64_hexdigest(data)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = client.communicate(timeout=30)
    finally:
        client.kill()
    assert client.returncode == 0 and out == b"done\n", err.decode()


def test_a_disk_file_that_reads_bad_is_confirmed_by_its_node_and_dropped(make_cluster, tmp_path):
    """An object only on the disk tier (the node restarted: its DRAM is gone) whose file rots:
    a same-host reader gets a miss, never the bytes; its report has the node re-read and hash
    the file, the master drops the object, and the key can be put again."""
    data = os.urandom(300 * 1024)
    cluster = only_on_disk(make_cluster, tmp_path, "rot", data)
    (name,) = object_files(tmp_path / "disk")
    path = tmp_path / "disk" / objectfile.OBJECTS_DIR / name
    with open(path, "r+b") as file:  # the last byte of the object's data
        file.seek(-1, os.SEEK_END)
        last = file.read(1)
        file.seek(-1, os.SEEK_END)
        file.write(bytes([last[0] ^ 0x10]))
    with Store(cluster.master_endpoint) as store:
        assert wait_until(lambda: store.exists("rot"), 10)  # re-adopted from the disk
        assert store.get("rot") is None
        assert wait_until(lambda: not store.exists("rot"), 5)
        store.put("rot", data)
        assert store.get("rot") == data


@pytest.mark.parametrize("shm", [True, False], ids=["same-host", "tcp"])
def test_disk_files_cut_short_or_deleted_miss_alone_and_are_dropped(make_cluster, tmp_path, shm):
    """Disk-only objects whose files are cut short or deleted behind the node's back: a batch
    get misses those keys and only those (over TCP they share one frame with the healthy ones,
    which the node still sends whole), the readers' reports have the node check the files and
    the master drop the objects, and the keys can be put again."""
    from kvpool import ReplicateConfig

    cluster = make_cluster(0, "8MiB")
    node = cluster.start_node(disk_args(tmp_path / "disk"))
    keys = [f"file-{i}" for i in range(4)]
    values = [os.urandom(300 * 1024) for _ in keys]
    with Store(cluster.master_endpoint) as store:
        assert store.put_batch(keys, values, ReplicateConfig(with_disk_copy=True)) == [ErrorCode.OK] * 4
        offsets = {key: replicas[0].offset for key, replicas in zip(keys, store.query(keys).replicas)}
    node.stop()
    cluster.start_node(disk_args(tmp_path / "disk"))  # DRAM gone: every object is on disk only
    objects = tmp_path / "disk" / objectfile.OBJECTS_DIR
    os.truncate(objects / objectfile.disk_name(offsets["file-1"]), 100_000)
    (objects / objectfile.disk_name(offsets["file-2"])).unlink()
    with Store(cluster.master_endpoint, shm_enabled=shm) as store:
        assert wait_until(lambda: all(store.batch_exists(keys)), 10)  # re-adopted from the disk
        assert store.get_batch(keys) == [values[0], None, None, values[3]]
        assert wait_until(lambda: store.batch_exists(keys) == [True, False, False, True], 5)
        assert store.put_batch(keys[1:3], values[1:3]) == [ErrorCode.OK] * 2
        assert store.get_batch(keys) == values


def test_puts_find_room_when_dram_and_the_disk_tier_are_both_full(make_cluster, tmp_path):
    # Eviction only for room (watermark 1.0), so every put past the first 48 objects needs the
    # disk tier to drop objects, DRAM to offload into the room, and DRAM to drop what it moved,
    # within the one put_start (the master's rounds). They used to fail with NO_AVAILABLE_HANDLE.
    cluster = make_cluster(0, "4MiB", master_args=("--evict-watermark-high", "1.0"))
    cluster.start_node(disk_args(tmp_path / "disk", "8MiB"))  # 16 + 32 objects of 256 KiB
    values = values_for("full", 96, OBJECT_SIZE)
    keys = list(values)
    with Store(cluster.master_endpoint) as store:
        for start in range(0, len(keys), 8):
            batch = keys[start : start + 8]
            assert store.put_batch(batch, [values[k] for k in batch]) == [ErrorCode.OK] * 8, start
        tiers = tiers_of(store)
        assert tiers["disk"]["used_bytes"] == tiers["disk"]["capacity_bytes"]
        assert store.cluster_status().evicted_count >= 96 - 48
        newest = keys[-16:]  # the last two batches: in DRAM, or offloaded whole
        assert store.get_batch(newest) == [values[k] for k in newest]
        assert all(v is None or v == values[k] for k, v in zip(keys, store.get_batch(keys)))


# Eviction only for room (watermark 1.0): the puts' offloads go one at a time, in the order
# DRAM evicts. The tick's eviction above the watermark sent its own alongside, a node ends
# concurrent requests in any order, and a tier orders its objects by when they landed: a
# newer object went before an older one, and a run found a hole among the newest (2026-12-06).
FOR_ROOM_ONLY = ("--evict-watermark-high", "1.0")


def newest_kept(keys: list[str], kept: list[str]) -> list[str]:
    """The longest run of the newest keys (`keys` in put order) that were all kept."""
    missing = [index for index, key in enumerate(keys) if key not in kept]
    return keys[missing[-1] + 1 :] if missing else keys


def put_through_a_full_filesystem(
    cluster, mount: Path, disk_dir: Path | None, wait_for_report: bool
) -> tuple[list[str], list[str]]:
    """Another program fills 9 MiB of the 16 MiB filesystem under a slower tier (the disk
    tier at `disk_dir`, else the DFS at `mount`), then 40 objects of 512 KiB (20 MiB) go
    through 8 MiB of DRAM. Returns the keys in put order and those read back, after checking
    that every read is the object or a clean miss. With `wait_for_report`, the puts start once
    the master has heard of the free space."""
    (mount / "other-files").write_bytes(os.urandom(9 * 1024 * 1024))
    if wait_for_report:
        assert wait_until(lambda: "its filesystem has" in cluster.master.log_tail(200), 10)
    values = values_for("full-fs", 40, 512 * 1024)
    keys = list(values)
    with Store(cluster.master_endpoint, dfs_dir=str(mount) if disk_dir is None else "") as store:
        for key, value in values.items():
            store.put(key, value)
        if disk_dir is not None:
            wait_until(lambda: not temp_files(disk_dir))
        found = dict(zip(keys, store.get_batch(keys)))
    assert all(found[key] in (None, values[key]) for key in keys)  # a miss, never other bytes
    kept = [key for key in keys if found[key] is not None]
    assert len(kept) >= 20, kept
    return keys, kept


def test_a_disk_tier_whose_filesystem_fills_up_keeps_the_newest_objects(make_cluster, small_filesystem):
    # A 12 MiB disk tier on a 16 MiB filesystem that another program fills with 9 MiB: writes
    # to the tier would fail with ENOSPC long before its capacity. Before: every offload after
    # that failed (a warning per object), so the tier kept its oldest objects for good and
    # lost every object evicted from DRAM since. Now the master caps the tier's room, by the
    # free space the node's heartbeats report or, at the latest, by the first moves that find
    # the disk full; offloads then evict the tier's oldest objects to make room.
    mount = small_filesystem("16m")
    cluster = make_cluster(0, "8MiB", master_args=FOR_ROOM_ONLY)
    node = cluster.start_node((*disk_args(mount / "disk", "12MiB"), "--metrics-port", "0"))
    keys, kept = put_through_a_full_filesystem(cluster, mount, mount / "disk", wait_for_report=False)
    # Least recently used first: what is kept is the newest objects, and older ones only where
    # an offload found the filesystem full (if no report came first): such an object stays in
    # DRAM, entered there again, and goes after the unread (docs/tiers.md). Nothing else:
    # before, 13 of the newest were lost. (Counting the newest missing after the oldest kept
    # was wrong: that oldest is such an object, and every object the tier evicted, least
    # recently used first, since it failed counted as missing: it failed a run, 2026-12-06.)
    with Store(cluster.master_endpoint) as store:
        failed = tiers_of(store)["disk"]["failed_moves"]
        older = [key for key in kept if key not in newest_kept(keys, kept)]
        tiers = {s.segment.segment_id: s.segment.tier for s in store.cluster_status().segments}
        held_in = [[tiers[r.segment_id] for r in replicas] for replicas in store.query(older).replicas]
        assert len(older) <= failed and held_in == [["dram"]] * len(older), (
            [keys.index(key) for key in kept],
            held_in,
            failed,
            [line for line in cluster.master.log_tail(200).splitlines() if "filesystem" in line],
        )
        # And once capped, the tier fails no more moves: the next 20 DRAM victims are
        # offloaded, each evicting the tier's oldest objects to make room.
        offloads = tiers_of(store)["disk"]["offloads"]
        for key, value in values_for("after-full", 20, 512 * 1024).items():
            store.put(key, value)
        wait_until(lambda: tiers_of(store)["disk"]["offloads"] >= offloads + 20, 10)
        assert tiers_of(store)["disk"]["failed_moves"] == failed
    master_log = cluster.master.log_tail(200)
    assert "its filesystem has" in master_log or "its filesystem is full" in master_log
    # One warning per request, naming how many more failed alike, not one line per object.
    failures = [line for line in node.log_tail(200).splitlines() if "No space left" in line]
    named = [1 + int(line.split("(and ")[1].split()[0]) if "more like it)" in line else 1 for line in failures]
    assert sum(named) == failed, failures
    # What an operator alerts on: the filesystem nearly full (the tier holds what it can, less
    # up to the moves in flight at the last report: the master counts those as not landed, so
    # on a loaded machine it keeps a few objects fewer) ...
    free = files.free_bytes(mount)
    assert free < 3 * 1024 * 1024

    def node_free() -> float:
        with urllib.request.urlopen(f"http://{node.info['metrics_endpoint']}/metrics", timeout=5) as response:
            metrics = response.read().decode()
        (line,) = [line for line in metrics.splitlines() if line.startswith("kvpool_node_disk_filesystem_free_bytes ")]
        return float(line.split()[1])

    assert wait_until(lambda: node_free() == files.free_bytes(mount), 10)  # ... in the node's metrics ...
    # ... and in the master's view of every node's, from the next heartbeat (the disk segment's).
    prefix = "kvpool_master_segment_filesystem_free_bytes{"

    def master_free() -> list[float]:
        return [float(line.rsplit(" ", 1)[1]) for line in master_lines(cluster) if line.startswith(prefix)]

    assert wait_until(lambda: master_free() == [files.free_bytes(mount)], 10)


@pytest.mark.parametrize("tier", ["disk", "dfs"])
def test_the_reported_free_space_of_a_filling_filesystem_costs_no_object(make_cluster, small_filesystem, tier):
    # The same filesystem, but the master has heard of its free space (the node's heartbeat
    # for its disk tier, the master's own look for the DFS) before the puts: no move finds it
    # full, so no object evicted from DRAM is lost among the newest.
    mount = small_filesystem("16m")
    if tier == "disk":
        cluster = make_cluster(0, "8MiB", master_args=FOR_ROOM_ONLY)
        node = cluster.start_node((*disk_args(mount / "disk", "12MiB"), "--metrics-port", "0"))
    else:
        dfs_args = ("--dfs-dir", str(mount), "--dfs-size", "12MiB")
        cluster = make_cluster(0, "8MiB", master_args=(*dfs_args, *FOR_ROOM_ONLY))
        node = cluster.start_node(("--dfs-dir", str(mount), "--metrics-port", "0"))
    keys, kept = put_through_a_full_filesystem(cluster, mount, mount / "disk" if tier == "disk" else None, True)
    assert kept == newest_kept(keys, kept)  # the newest, none lost among them
    assert "No space left" not in node.log_tail(200)
    assert "its filesystem is full" not in cluster.master.log_tail(200)
    with urllib.request.urlopen(f"http://{node.info['metrics_endpoint']}/metrics", timeout=5) as response:
        assert 'result="failed"' not in response.read().decode()


def test_a_disk_tier_whose_filesystem_turns_read_only_is_skipped_and_still_read(make_cluster, small_filesystem):
    # ext4 remounts itself read-only on I/O errors. Before: every offload failed (EROFS, one
    # TRANSFER_FAIL each), so every object evicted from DRAM was lost after a failed write.
    # Now the node's heartbeat says its filesystem takes no writes: offloads skip the tier
    # (dropped here, as without one), what it holds is read as before, and once it is
    # writable again, offloads go there again.
    mount = small_filesystem("32m")
    cluster = make_cluster(0, "8MiB")
    node = cluster.start_node((*disk_args(mount / "disk", "24MiB"), "--metrics-port", "0"))
    early = values_for("early", 24, 512 * 1024)
    with Store(cluster.master_endpoint) as store:
        for key, value in early.items():
            store.put(key, value)
        assert wait_until(lambda: tiers_of(store)["disk"]["object_count"] >= 8, 10)

        def offloads_done() -> bool:
            # DRAM back under its watermark, and no offload finished for half a second: no
            # move is left for the remount to catch half-way.
            before = tiers_of(store)
            time.sleep(0.5)
            after = tiers_of(store)
            is_under = after["dram"]["used_bytes"] <= 0.9 * after["dram"]["capacity_bytes"]
            return is_under and before["disk"]["offloads"] == after["disk"]["offloads"]

        assert wait_until(offloads_done, 10)
        tiers = {s.segment.segment_id: s.segment.tier for s in store.cluster_status().segments}
        on_disk = [key for key, replicas in zip(early, store.query(list(early)).replicas)
                   if [tiers[r.segment_id] for r in replicas] == ["disk"]]  # fmt: skip
        assert len(on_disk) >= 8
        remount = subprocess.run(["mount", "-o", "remount,ro", str(mount)], capture_output=True, text=True)
        assert remount.returncode == 0, remount.stderr  # the node holds no file there open for writing
        assert wait_until(lambda: "takes no writes" in cluster.master.log_tail(200), 10)
        late = values_for("late", 24, 512 * 1024)
        for key, value in late.items():
            store.put(key, value)
        assert store.get_batch(on_disk) == [early[key] for key in on_disk]  # read as before
        found = store.get_batch(list(late))
        assert all(got in (None, late[key]) for key, got in zip(late, found))
        assert found[-8:] == list(late.values())[-8:]  # the newest, in DRAM
        assert "Read-only file system" not in node.log_tail(200)
        with urllib.request.urlopen(f"http://{node.info['metrics_endpoint']}/metrics", timeout=5) as response:
            assert 'result="failed"' not in response.read().decode()
        # What operators see: the master's status, metrics and `kvpool stat`.
        (disk_status,) = [s for s in store.cluster_status().segments if s.segment.tier == "disk"]
        assert not disk_status.is_writable
        disk_id = disk_status.segment.segment_id
        prefix = "kvpool_master_segment_writable{"
        writable = [line for line in master_lines(cluster) if line.startswith(prefix) and disk_id in line]
        assert [line.rsplit(" ", 1)[1] for line in writable] == ["0.0"]
        stat = kvpool_cli("stat", "--master", cluster.master_endpoint)
        assert stat.returncode == 0 and "read-only" in stat.stdout.decode(), stat

        subprocess.run(["mount", "-o", "remount,rw", str(mount)], check=True)
        assert wait_until(lambda: "takes writes again" in cluster.master.log_tail(200), 10)
        (disk_status,) = [s for s in store.cluster_status().segments if s.segment.tier == "disk"]
        assert disk_status.is_writable and disk_status.filesystem_free_bytes > 0
        held = tiers_of(store)["disk"]["offloads"]
        for key, value in values_for("again", 8, 512 * 1024).items():
            store.put(key, value)
        assert wait_until(lambda: tiers_of(store)["disk"]["offloads"] > held, 10)


def test_disk_tiers_of_two_nodes_on_one_filesystem_share_its_free_space(make_cluster, small_filesystem):
    # Two nodes on this host with their disk tiers on one 16 MiB filesystem, 9 MiB of it taken
    # by other files. Each node reports the same free space; counted per tier, each would
    # take all of it, and together they would overfill the disk.
    mount = small_filesystem("16m")
    cluster = make_cluster(0, "4MiB")
    nodes = cluster.start_nodes([disk_args(mount / f"disk{i}", "8MiB") for i in range(2)])
    (mount / "other-files").write_bytes(os.urandom(9 * 1024 * 1024))
    assert wait_until(lambda: cluster.master.log_tail(200).count("its filesystem has") >= 2, 10)
    values = values_for("shared", 40, 512 * 1024)  # 20 MiB through 8 MiB of DRAM
    with Store(cluster.master_endpoint) as store:
        for key, value in values.items():
            store.put(key, value)
        found = store.get_batch(list(values))
        assert all(got in (None, value) for got, value in zip(found, values.values()))
        assert tiers_of(store)["disk"]["object_count"] >= 8  # the disk is used, to the brim
    assert all("No space left" not in node.log_tail(200) for node in nodes)
    assert "its filesystem is full" not in cluster.master.log_tail(200)
