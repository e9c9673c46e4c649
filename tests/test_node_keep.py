"""A node restarted after a stop with --keep-ms serves its DRAM objects again (node/segment.py
`Segment.keep` and `Segment.adopt`, node/server.py).

How: the segment functions on files in pytest's tmp_path (a kept file, its record, the stale
sweep, a file whose bytes changed while no node held it); then real master and node processes
on loopback: objects put, the node stopped with SIGTERM and started again with the same
--node-id, every object read back by a same-host client (which kept its mapping of the file)
and a TCP-only one, without any client writing them again, while what was removed or put anew
during the restart stays so. A node killed with SIGKILL keeps nothing.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import xxhash
from conftest import wait_until

from kvpool import Store
from kvpool.errors import InvalidParams, ObjectNotFound
from kvpool.node import segment as segment_module
from kvpool.node.segment import Segment, remove_stale_segments
from kvpool.protocol.messages import PIN_SOFT, InventoryEntry
from tests.test_cluster import kvpool_cli, values_for
from tests.test_cluster_disk import master_metric

MIB = 1024 * 1024
OBJECT_SIZE = 64 * 1024


def filled(directory: Path, name: str = "n1", objects: int = 8) -> tuple[Segment, list[InventoryEntry]]:
    """A new segment holding `objects` objects of random bytes, and their entries."""
    segment = Segment.create(str(directory), name, 4 * MIB, os.urandom(16))
    entries = []
    for i in range(objects):
        data = os.urandom(OBJECT_SIZE - i)
        offset = i * OBJECT_SIZE
        segment.data[offset : offset + len(data)] = data
        checksum = xxhash.xxh3_64_intdigest(data)
        entries.append(InventoryEntry(f"key-{i}", offset, len(data), checksum, PIN_SOFT * (i % 2)))
    return segment, entries


def now_ms() -> int:
    return int(time.time() * 1000)


def test_a_kept_segment_is_adopted_whole_with_its_id_token_and_entries(tmp_path):
    segment, entries = filled(tmp_path)
    token, path = segment.token, segment.path
    expected = {e.key: bytes(segment.data[e.offset : e.offset + e.size]) for e in entries}
    segment.keep("n1-0a0b0c0d", entries, now_ms() + 60_000)
    assert path.exists() and (tmp_path / "kvpool-n1.kept").exists()
    assert remove_stale_segments(str(tmp_path)) == []  # unlocked, but kept: the sweep leaves it
    adopted, segment_id, kept_entries, until_ms = Segment.adopt(str(tmp_path), "n1", 4 * MIB)
    try:
        assert (segment_id, kept_entries, adopted.token, adopted.path) == ("n1-0a0b0c0d", entries, token, path)
        assert until_ms > now_ms() + 50_000
        assert (tmp_path / "kvpool-n1.kept").exists()  # until verified: a kill meanwhile takes it again
        adopted.kept_taken()
        assert not (tmp_path / "kvpool-n1.kept").exists()  # a kill from now on leaves a stale file
        assert {e.key: bytes(adopted.data[e.offset : e.offset + e.size]) for e in entries} == expected
        assert adopted.verified(kept_entries, "test") == (entries, 0)
        # The owner again: it holds the lock (a sweep passes it by), and closing unlinks it.
        assert remove_stale_segments(str(tmp_path)) == []
        with pytest.raises(InvalidParams, match="another node with the id 'n1'"):
            Segment.create(str(tmp_path), "n1", 4 * MIB, os.urandom(16))
    finally:
        adopted.close()
    assert not path.exists()


def test_a_kept_segment_held_by_a_running_node_is_not_taken(tmp_path, monkeypatch):
    """Nor touched: the node holding it may be writing its record (a new node started before
    the old one had finished stopping removed that record's temporary file, and the old one's
    keep then failed and unlinked the segment: review helper-151)."""
    segment, entries = filled(tmp_path)
    segment.keep("n1-1", entries, now_ms() + 60_000)
    first = Segment.adopt(str(tmp_path), "n1", 4 * MIB)
    assert first is not None
    being_written = tmp_path / "kvpool-n1.kept.999.tmp"
    being_written.write_bytes(b"the holder's record, half written")
    monkeypatch.setattr(segment_module, "_ADOPT_LOCK_TRIES", 2)
    try:
        with pytest.raises(InvalidParams, match="in use: another node with the id 'n1'"):
            Segment.adopt(str(tmp_path), "n1", 4 * MIB)
        assert being_written.exists()
    finally:
        first[0].close()


@pytest.mark.parametrize(
    "spoil, reason",
    [
        (lambda path, record: None, "kept until a moment past"),
        (lambda path, record: record.unlink(), "no record"),
        (lambda path, record: record.write_bytes(b"\x92\x01junk"), "unreadable"),
    ],
    ids=["deadline-passed", "no-record", "bad-record"],
)
def test_a_kept_segment_that_cannot_be_taken_is_removed_and_the_node_starts_empty(tmp_path, caplog, spoil, reason):
    caplog.set_level(logging.INFO, logger="kvpool.node.segment")  # (a file without a record: a killed node's)
    segment, entries = filled(tmp_path)
    path, record = segment.path, tmp_path / "kvpool-n1.kept"
    until_ms = now_ms() + (60_000 if reason != "kept until a moment past" else -1)
    segment.keep("n1-2", entries, until_ms)
    spoil(path, record)
    assert Segment.adopt(str(tmp_path), "n1", 4 * MIB) is None
    assert reason in caplog.text
    assert not path.exists() and not record.exists()


def test_a_kept_segment_of_another_size_is_refused_and_stays(tmp_path):
    """It was removed, every object kept for the restart with it: one mistyped size, and no
    undoing it (walk-through helper-155). The start is refused, the file and record stay."""
    segment, entries = filled(tmp_path)
    segment.keep("n1-3", entries, now_ms() + 60_000)
    kept_files = sorted(tmp_path.iterdir())
    with pytest.raises(InvalidParams, match=f"{len(entries)} objects\\) holds 4 MiB, memory_bytes asks for 8 MiB"):
        Segment.adopt(str(tmp_path), "n1", 8 * MIB)
    assert sorted(tmp_path.iterdir()) == kept_files
    adopted, segment_id, kept_entries, _ = Segment.adopt(str(tmp_path), "n1", 4 * MIB)  # the right size takes it
    try:
        assert (segment_id, kept_entries) == ("n1-3", entries)
    finally:
        adopted.close()


def test_the_sweep_removes_a_kept_segment_once_its_deadline_passed(tmp_path):
    segment, entries = filled(tmp_path)
    path = segment.path
    segment.keep("n1-4", entries, now_ms() + 300)
    assert remove_stale_segments(str(tmp_path)) == []
    wait_until(lambda: remove_stale_segments(str(tmp_path)) == [path], 5)
    assert list(tmp_path.iterdir()) == []


def test_a_record_names_its_file_only(tmp_path):
    """A file made at the path after the record was written (the kept one removed by hand, then
    a node of that name started and killed) is not the one kept: the sweep removes it."""
    segment, entries = filled(tmp_path)
    path = segment.path
    segment.keep("n1-5", entries, now_ms() + 60_000)
    path.unlink()
    dead = Segment.create(str(tmp_path), "n1", 4 * MIB, os.urandom(16))
    dead.is_owner = False  # "killed": its file stays, and its lock goes
    dead.close()
    assert remove_stale_segments(str(tmp_path)) == [path]  # the record does not save it
    assert Segment.adopt(str(tmp_path), "n1", 4 * MIB) is None


def test_objects_whose_bytes_changed_while_kept_are_not_served_again(tmp_path):
    segment, entries = filled(tmp_path)
    segment.keep("n1-6", entries, now_ms() + 60_000)
    with open(segment.path, "r+b") as file:  # any process of the user could write it meanwhile
        file.seek(4096 + entries[3].offset + 100)
        file.write(b"\xff" * 8)
    adopted, _, kept_entries, _ = Segment.adopt(str(tmp_path), "n1", 4 * MIB)
    try:
        outside = InventoryEntry("outside", 4 * MIB - 10, 20, 0)
        good, bad = adopted.verified([*kept_entries, outside], "test")
        assert good == [e for e in entries if e.key != "key-3"]
        assert bad == 2
    finally:
        adopted.close()


def node_args(shm_dir: Path, *extra: str) -> tuple[str, ...]:
    return ("--shm-dir", str(shm_dir), "--node-id", "kept", *extra)


@pytest.fixture
def kept(make_cluster, tmp_path):
    """A master and one node run with --keep-ms, its segment file in tmp_path/shm:
    (cluster, shm_dir, node)."""
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    cluster = make_cluster(0, "16MiB")
    return cluster, shm_dir, cluster.start_node(node_args(shm_dir, "--keep-ms", "60000"))


def test_a_node_restarted_after_a_stop_with_keep_serves_its_objects_again(kept):
    cluster, shm_dir, node = kept
    values = values_for("warm", 40, OBJECT_SIZE)
    with Store(cluster.master_endpoint) as same_host, Store(cluster.master_endpoint, shm_enabled=False) as remote:
        same_host.put_batch(list(values), list(values.values()))
        assert same_host.get_batch(list(values)) == list(values.values())  # it maps the segment file now
        cluster.start_node()  # another node, for what is put while the first is away
        puts_before = master_metric(cluster, "kvpool_master_puts_total")
        lost_before = master_metric(cluster, "kvpool_master_lost_total")
        node.stop()  # SIGTERM: it unmounts, and keeps its segment
        assert "kept in" in node.log_tail(5)
        assert sum(remote.batch_exists(list(values))) == 0  # gone from the pool meanwhile...
        with pytest.raises(ObjectNotFound):  # what is removed meanwhile (not found: it is away)
            remote.remove("warm-3")  # stays removed,
        fresh = os.urandom(OBJECT_SIZE)
        remote.put("warm-5", fresh)  # and what is put anew stays the new bytes
        restarted = cluster.start_node(node_args(shm_dir))
        assert restarted.info["segment_id"] == node.info["segment_id"]
        expected = {**values, "warm-5": fresh}
        del expected["warm-3"]
        wait_until(lambda: all(remote.batch_exists(list(expected))))  # ...and back, as they were
        for store in (same_host, remote):
            assert store.get_batch(list(expected)) == list(expected.values())
            assert store.get("warm-3") is None
        assert master_metric(cluster, "kvpool_master_puts_total") == puts_before + 1  # the one put anew
        # Not lost, but away a moment: a loss alert must not fire at every upgrade (walk-through helper-155).
        assert master_metric(cluster, "kvpool_master_lost_total") == lost_before
    restarted.stop()  # without --keep-ms this time: the file goes
    assert list(shm_dir.iterdir()) == []


def test_a_whole_cluster_restarted_serves_the_kept_objects(kept):
    """An upgrade: every process stopped, the master started again, then the node."""
    cluster, shm_dir, node = kept
    values = values_for("upgrade", 20, OBJECT_SIZE)
    with Store(cluster.master_endpoint) as store:
        store.put_batch(list(values), list(values.values()))
    node.stop()
    cluster.master.stop()
    cluster.start_master()  # on the same port, knowing nothing
    cluster.start_node(node_args(shm_dir, "--keep-ms", "60000"))
    with Store(cluster.master_endpoint, shm_enabled=False) as store:
        assert store.get_batch(list(values)) == list(values.values())


def kept_until_ms(shm_dir: Path) -> int:
    """The deadline in a kept segment's record (segment.py: magic, version, then until_ms)."""
    return struct.unpack_from("<Q", (shm_dir / "kvpool-kept.kept").read_bytes(), 12)[0]


def test_a_start_that_fails_after_taking_a_kept_segment_keeps_it_again(kept):
    """A start that failed after the node took its kept segment (here its metrics port is
    taken) unlinked the file: the objects were lost to a typo (review helper-150)."""
    cluster, shm_dir, node = kept
    data = os.urandom(OBJECT_SIZE)
    with Store(cluster.master_endpoint) as store:
        store.put("survivor", data)
    node.stop()
    until_ms = kept_until_ms(shm_dir)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        failed = kvpool_cli("node", "--master", cluster.master_endpoint, "--memory", "16MiB", *node_args(shm_dir),
                            "--keep-ms", "60000", "--metrics-port", str(taken.getsockname()[1]))  # fmt: skip
    assert failed.returncode == 1 and b"took the segment" in failed.stderr, failed.stderr
    assert kept_until_ms(shm_dir) == until_ms  # kept again, as long as it was
    other_size = kvpool_cli("node", "--master", cluster.master_endpoint, "--memory", "32MiB", *node_args(shm_dir))
    assert other_size.returncode == 1 and b"holds 16 MiB, --memory asks for 32 MiB" in other_size.stderr, \
        other_size.stderr  # fmt: skip
    cluster.start_node(node_args(shm_dir))
    with Store(cluster.master_endpoint) as store:
        assert store.get("survivor") == data


def test_a_run_that_never_mounted_keeps_the_segment_no_longer_than_it_was_kept(kept, tmp_path):
    """A node that took its kept segment, never reached a master and was stopped again kept it
    for a whole new window, past the master's tombstones of it, which refuse what was removed
    meanwhile only for so long (review helper-150)."""
    _, shm_dir, node = kept
    node.stop()
    until_ms = kept_until_ms(shm_dir)
    log_path = tmp_path / "lost.log"
    with socket.socket() as closed:  # a port nothing listens on: the master is not there
        closed.bind(("127.0.0.1", 0))
        nowhere = f"127.0.0.1:{closed.getsockname()[1]}"
    with open(log_path, "wb") as log_file:
        lost = subprocess.Popen(
            [sys.executable, "-m", "kvpool.cli.main", "node", "--master", nowhere, "--memory", "16MiB",
             *node_args(shm_dir), "--keep-ms", "300000"], stderr=log_file,
        )  # fmt: skip
    try:
        wait_until(lambda: b"took the segment" in log_path.read_bytes(), 30)
    finally:
        lost.terminate()
        assert lost.wait(30) == 0
    assert kept_until_ms(shm_dir) == until_ms


def test_a_node_killed_keeps_nothing(kept):
    cluster, shm_dir, node = kept
    with Store(cluster.master_endpoint) as store:
        store.put("lost", b"x" * OBJECT_SIZE)
        node.kill()  # no stop ran: nothing says the bytes are whole
        cluster.start_node(node_args(shm_dir))
        assert store.get("lost") is None
        store.put("lost", b"y" * OBJECT_SIZE)
        assert store.get("lost") == b"y" * OBJECT_SIZE


def test_keep_ms_needs_a_node_id_and_is_bounded():
    refused = kvpool_cli("node", "--master", "127.0.0.1:1", "--keep-ms", "1000")
    assert refused.returncode == 1 and b"--keep-ms needs --node-id" in refused.stderr
    too_long = kvpool_cli("node", "--master", "127.0.0.1:1", "--node-id", "n", "--keep-ms", "300001")
    assert too_long.returncode == 2 and b"less than or equal to 300000" in too_long.stderr
    bad_id = kvpool_cli("node", "--master", "127.0.0.1:1", "--node-id", "a/b")
    assert bad_id.returncode == 1 and b"--node-id 'a/b'" in bad_id.stderr
