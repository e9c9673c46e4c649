"""The DFS's temporary files: a node killed mid-copy does not leave its half-written file on
the shared filesystem for an hour.

A node writes a DFS file under a temporary name that names the writer (its DRAM segment id,
new at each start), then renames it into place. The master removes a writer's temporary files
once that writer is gone (its DFS copies went unanswered and its segment is unmounted, after
the node TTL), and no other writer's, nor those a writer that came back writes; files of
unknown writers still wait for the hourly sweep. Real processes: a node is SIGKILLed while it
writes a write-through copy into the DFS. In process (a master and a node on one loop): a
node that comes back while the walk runs, one that answers again, and the master's records.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import uvloop
import xxhash

from kvpool import AsyncStore, ReplicateConfig, Store, limits
from kvpool.config import MasterConfig, NodeConfig
from kvpool.errors import TransferFailed
from kvpool.master import server
from kvpool.master.server import MasterServer
from kvpool.node.moves import Mover
from kvpool.node.server import Node
from kvpool.protocol import objectfile
from kvpool.transports import files
from kvpool.transports.dfs import DfsDirectory
from tests.test_cluster import wait_until

# Big enough that writing it (and its fdatasync) takes tens of milliseconds: the test stops
# the node while its temporary file is there.
COPY_SIZE = 64 * limits.MIB
ATTEMPTS_MAX = 5
YOUNG_MS = limits.DFS_TEMP_FILE_AGE_MS_MAX
TIMEOUT_S = 20
WITH_DFS_COPY = ReplicateConfig(with_dfs_copy=True)


def temporaries(bucket: Path) -> list[str]:
    try:
        return [name for name in os.listdir(bucket) if objectfile.is_temp_name(name)]
    except FileNotFoundError:
        return []


def tagged_name(final_name: str, writer_id: str) -> str:
    """A temporary file's name as a node writes it (the on-disk format, spelled out)."""
    return f"{final_name}.{xxhash.xxh3_64_hexdigest(writer_id.encode())}.{'ab' * 6}.tmp"


def test_temporary_names_fit_a_filesystem_and_say_their_writer(tmp_path):
    dfs = DfsDirectory.create_or_open(tmp_path, 1 << 30)
    writer_id = "n" * 200 + "-0123abcd"  # a node id as long as one gets: the name is not longer
    data = memoryview(os.urandom(4096))
    temporary = dfs.write_temporary("k", 0, 0, [data], is_durable=False, writer_id=writer_id)
    assert len(temporary.name.encode()) == objectfile.NAME_BYTES_MAX <= 255
    assert temporary.name.startswith(tagged_name(dfs.path_of("k", 0).name, writer_id)[: -len("abababababab.tmp")])
    assert objectfile.temp_writer_of(temporary.name) == objectfile.writer_tag(writer_id)
    assert objectfile.dfs_offset_of(temporary.name) is None  # never taken for an object
    # Names without a writer: a DFS file written before, a disk tier's.
    assert objectfile.temp_writer_of(f"{dfs.path_of('k', 0).name}.{'cd' * 6}.tmp") is None
    assert objectfile.temp_writer_of(f"{objectfile.disk_name(0)}.{'cd' * 6}.tmp") is None


def test_a_gone_writers_temporaries_go_and_no_one_elses(tmp_path):
    dfs = DfsDirectory.create_or_open(tmp_path, 1 << 30)
    data = [memoryview(os.urandom(4096))]
    checksum = xxhash.xxh3_64_intdigest(data[0])
    gone = dfs.write_temporary("a", 0, checksum, data, is_durable=False, writer_id="gone-1")
    live = dfs.write_temporary("a", 8192, checksum, data, is_durable=False, writer_id="live-1")
    unknown = dfs.path_of("b", 0).with_name(f"{dfs.path_of('b', 0).name}.{'ef' * 6}.tmp")
    unknown.parent.mkdir(exist_ok=True)
    unknown.write_bytes(b"an old writer's")
    dfs.publish("c", 0, dfs.write_temporary("c", 0, checksum, data, is_durable=False, writer_id="live-1"),
                is_durable=False)  # fmt: skip
    # The scan lists the object only, and leaves young temporary files alone.
    assert [entry.key for entry in dfs.scan(YOUNG_MS)] == ["c"]
    assert dfs.remove_stale_temporaries(YOUNG_MS, lambda: True, {objectfile.writer_tag("gone-1")}) == (1, 0)
    assert not gone.exists()
    assert live.exists() and unknown.exists() and dfs.path_of("c", 0).exists()
    assert dfs.remove_stale_temporaries(YOUNG_MS, lambda: True) == (0, 0)


def test_a_node_killed_mid_dfs_copy_leaves_no_temporary_file_after_its_ttl(make_cluster, tmp_path):
    dfs = tmp_path / "dfs"
    cluster = make_cluster(0, "160MiB", master_args=("--dfs-dir", str(dfs), "--node-ttl-ms", "1500"))
    live = cluster.start_node(("--dfs-dir", str(dfs)))
    victim = cluster.start_node(("--dfs-dir", str(dfs)))
    on_victim = ReplicateConfig(placement="preferred", preferred_segments=[victim.info["segment_id"]],
                                with_dfs_copy=True)  # fmt: skip
    value = os.urandom(COPY_SIZE)
    with Store(cluster.master_endpoint, dfs_dir=str(dfs)) as store:
        for attempt in range(ATTEMPTS_MAX):
            key = f"big-{attempt}"
            bucket = dfs / Path(objectfile.dfs_relative_path(key, 0)).parent
            put = threading.Thread(target=store.put, args=(key, value, on_victim), daemon=True)
            put.start()
            while put.is_alive() and not temporaries(bucket):
                pass
            victim.signal(signal.SIGSTOP)
            left = temporaries(bucket)  # the stopped node renames nothing
            if left:
                break
            victim.signal(signal.SIGCONT)  # it was faster than this loop: again, another key
            put.join()
        assert left, f"no copy seen in flight in {ATTEMPTS_MAX} attempts"
        # Files of other writers in the same directory: a live node's, and one of an unknown
        # writer (written before, or whose master restarted since); both stay.
        final_name = Path(objectfile.dfs_relative_path(key, 0)).name
        others = [tagged_name(final_name, live.info["segment_id"]), f"{final_name}.{'ef' * 6}.tmp"]
        for name in others:
            (bucket / name).write_bytes(b"being written")
        victim.kill()
        put.join()
        # Within the node TTL and a tick (wait_until's 15 s), not an hour; then the walk is over.
        master_log = Path(cluster.master.log_path)
        wait_until(lambda: "removed 1 temporary files" in master_log.read_text())
        assert sorted(temporaries(bucket)) == sorted(others)


def test_a_bucket_that_cannot_be_listed_stops_no_other(tmp_path, monkeypatch):
    """One bucket the master cannot list (EACCES, ESTALE, EIO) aborted the whole walk, which
    then came back every minute; now it counts as one failure and the walk goes on."""
    dfs = DfsDirectory.create_or_open(tmp_path, 1 << 30)
    data = [memoryview(os.urandom(4096))]
    keys, buckets = [], set()
    for index in range(1000):
        bucket = dfs.path_of(f"k{index}", 0).parent
        if bucket not in buckets:
            buckets.add(bucket)
            keys.append(f"k{index}")
        if len(keys) == 8:
            break
    for key in keys:
        dfs.write_temporary(key, 0, 0, data, is_durable=False, writer_id="gone")
    unreadable = dfs.path_of(keys[3], 0).parent
    scan = files.scan

    def scan_but_one(directory):
        if Path(directory) == unreadable:
            raise TransferFailed(f"{directory}: Permission denied")
        return scan(directory)

    monkeypatch.setattr(files, "scan", scan_but_one)
    assert dfs.remove_stale_temporaries(YOUNG_MS, lambda: True, {objectfile.writer_tag("gone")}) == (7, 1)
    assert [key for key in keys if temporaries(dfs.path_of(key, 0).parent)] == [keys[3]]


# --- in process: the master's records of gone writers ------------------------------------------


@contextlib.asynccontextmanager
async def master_and_node(tmp_path: Path, node_ttl_ms: int = limits.NODE_TTL_MS_DEFAULT):
    """An in-process master with a DFS and one node that writes into it (4 MiB of DRAM)."""
    dfs_dir = str(tmp_path / "dfs")
    master = MasterServer(MasterConfig(node_ttl_ms=node_ttl_ms), port=0, dfs_dir=dfs_dir)
    await master.start()
    node = Node(NodeConfig(master_endpoint=master.endpoint, memory_bytes=4 * limits.MIB, shm_dir=str(tmp_path),
                           heartbeat_interval_ms=200, dfs_dir=dfs_dir))  # fmt: skip
    try:
        await node.start()
        await node.wait_mounted(5_000)
        async with await AsyncStore.open(master.endpoint, shm_enabled=False) as store:
            yield master, node, store
    finally:
        await node.stop()
        await master.stop()


async def until(predicate, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def fail_next_move(monkeypatch: pytest.MonkeyPatch) -> None:
    """The node's next MoveObjects ends in an error reply: the master has no codes for it, as
    from a node killed mid-copy, and remembers the node as a writer that left copies unanswered."""
    move = Mover.move
    failed = []

    def move_or_fail(self, message):
        if not failed:
            failed.append(message)
            raise TransferFailed("the test fails this request")
        return move(self, message)

    monkeypatch.setattr(Mover, "move", move_or_fail)


def dfs_objects(tmp_path: Path) -> list[str]:
    return [path.name for path in (tmp_path / "dfs" / "objects").rglob(f"*{objectfile.SUFFIX}")]


def test_a_node_back_while_the_walk_runs_keeps_the_copies_it_makes_since(tmp_path, monkeypatch):
    """The walk for a node gone (its DFS copies unanswered, then timed out) took its writers
    once, at its start. The node came back meanwhile (same DRAM segment id: the same process,
    silent for a while), was sent a new copy, and the walk removed that copy's temporary file:
    the copy failed (for an offload, its DRAM replica was given up: an object evicted for
    nothing). Now a node that mounts again leaves the walk's writers before it is answered."""
    walking, walk_goes_on = threading.Event(), threading.Event()
    renaming, walked = threading.Event(), threading.Event()
    walk, publish = DfsDirectory.remove_stale_temporaries, DfsDirectory.publish

    def held_walk(self, temp_age_ms_max, keep_going, tags_gone=()):
        if tags_gone:  # a walk for gone writers (not the hourly sweep): a slow share
            walking.set()
            assert walk_goes_on.wait(TIMEOUT_S)
        return walk(self, temp_age_ms_max, keep_going, tags_gone)

    def held_publish(self, key, offset, temporary, *, is_durable):
        if key == "new":  # the node's copy, written: its rename waits for the walk
            renaming.set()
            assert walked.wait(TIMEOUT_S)
        return publish(self, key, offset, temporary, is_durable=is_durable)

    monkeypatch.setattr(DfsDirectory, "remove_stale_temporaries", held_walk)
    monkeypatch.setattr(DfsDirectory, "publish", held_publish)

    async def main() -> None:
        async with master_and_node(tmp_path, node_ttl_ms=1_000) as (master, node, store):
            fail_next_move(monkeypatch)
            await store.put("old", os.urandom(4096), WITH_DFS_COPY)
            writer = node.segment_id
            assert writer in master._dfs_writers_unanswered

            async def silent_until_walking():  # the node heartbeats after its filesystems' news
                await until(walking.is_set)
                return {}

            node._filesystems = silent_until_walking  # silent past its TTL: unmounted
            await until(walking.is_set)
            await until(lambda: master.service.has_segment(writer))  # back on its next heartbeat
            put = asyncio.ensure_future(store.put("new", os.urandom(4096), WITH_DFS_COPY))
            await until(renaming.is_set)
            walk_goes_on.set()
            await until(master._dfs_temps_task.done)
            walked.set()
            await put
            assert len(dfs_objects(tmp_path)) == 1  # the new copy, renamed into place
            assert writer not in master._dfs_writers_unanswered

    try:
        uvloop.run(asyncio.wait_for(main(), 60))
    finally:
        walk_goes_on.set()
        walked.set()


def test_a_node_that_answers_again_is_not_walked_for(tmp_path, monkeypatch):
    """A node that left DFS copies unanswered but answers a later request is alive, and
    removes its own late copies: it is forgotten, and its clean stop later (or a drain, a
    rolling restart) starts no walk of the whole share."""

    async def main() -> None:
        async with master_and_node(tmp_path) as (master, node, store):
            fail_next_move(monkeypatch)
            await store.put("failed", os.urandom(4096), WITH_DFS_COPY)
            writer = node.segment_id
            assert writer in master._dfs_writers_unanswered
            await store.put("copied", os.urandom(4096), WITH_DFS_COPY)
            assert writer not in master._dfs_writers_unanswered
            await node.stop()
            assert not master.service.has_segment(writer)
            master._tend_dfs()
            assert master._dfs_temps_task is None  # no walk

    uvloop.run(asyncio.wait_for(main(), 60))


def test_a_master_remembers_gone_writers_for_its_term_only_and_boundedly(monkeypatch, caplog):
    monkeypatch.setattr(server, "DFS_WRITERS_UNANSWERED_MAX", 3)
    master = MasterServer(MasterConfig(), port=0)
    term = master.service
    master._dfs_writer_unanswered(term, "w0")
    master._new_term()  # deposed, or elected: the records were the last term's
    assert not master._dfs_writers_unanswered
    master._dfs_writer_unanswered(term, "w1")  # a late reply of that term's request
    assert not master._dfs_writers_unanswered
    with caplog.at_level(logging.WARNING, logger="kvpool.master.server"):
        for index in range(6):
            master._dfs_writer_unanswered(master.service, f"w{index}")
    assert list(master._dfs_writers_unanswered) == ["w3", "w4", "w5"]  # the oldest forgotten
    assert sum("left DFS copies unanswered" in record.getMessage() for record in caplog.records) == 1
