"""The bounds of a sync Store's calls where they used to overrun: a get whose same-host read of
an object file never ends (a hung NFS or DFS mount), and a lookup with a bound of its own that
must find the master again.

How: real processes on loopback (LocalCluster: a master and a node with a disk tier; two masters
on etcd for the failover). The hung read is a named pipe put where the object file was: its
open() blocks in the kernel until a writer comes, as a read on a hung mount does. A read that
ends late is one made to wait on an Event (in this process only) before it reads the real file.
Each call is timed: it returns within its bound, with a miss or a timeout, and the caller's
buffer is never written after it returned.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import uvloop
from conftest import wait_until

from kvpool import AsyncStore, ReplicateConfig, Store
from kvpool.client.transfer import FILE_READ_THREADS
from kvpool.errors import ErrorCode, ObjectHasLease, TransportError
from kvpool.integrations.breaker import LookupBreaker
from kvpool.transports import files
from tests.test_cluster_disk import disk_args
from tests.test_ha import TTL_MS, new_cluster_id

# The get's deadline for its reads (one transfer timeout from its lookup), and what a call may
# take past its bound on a loaded CI machine.
TRANSFER_TIMEOUT_MS = 1_000
SLACK_S = 0.25
FILLER = 0xA5

# Every test here times calls against their bound (conftest.steady_heap).
pytestmark = pytest.mark.usefixtures("steady_heap")


def disk_only(make_cluster, tmp_path: Path, size_bytes: int, keys: list[str]) -> tuple[object, bytes, list[Path]]:
    """A cluster whose node holds `keys` in its disk tier only (put with a disk copy, then the
    node restarted: its DRAM is gone, its disk re-adopted), where reads never bring them back
    into DRAM; their bytes (the same for each), and their object files."""
    data = os.urandom(size_bytes)
    cluster = make_cluster(0, "8MiB", master_args=("--promote-reads", "0"))
    node = cluster.start_node(disk_args(tmp_path / "disk"))
    with Store(cluster.master_endpoint) as store:
        codes = store.put_batch(keys, [data] * len(keys), ReplicateConfig(with_disk_copy=True))
        assert codes == [ErrorCode.OK] * len(keys)
    node.stop()
    cluster.start_node(disk_args(tmp_path / "disk"))
    return cluster, data, sorted((tmp_path / "disk" / "objects").glob("*.kvo"))


def timed_get_into(
    store: Store, keys: list[str], size_bytes: int, bound_s: float
) -> tuple[list[int] | None, float, list[bytearray]]:
    """batch_get_into of `keys` on a thread of its own, waited for `bound_s` at most: its
    result (None: still running), how long it took, and the buffers."""
    buffers = [bytearray([FILLER]) * size_bytes for _ in keys]
    addresses = [store.register_buffer(buffer) for buffer in buffers]
    outcome: list[list[int]] = []
    started = time.monotonic()
    getter = threading.Thread(
        target=lambda: outcome.append(store.batch_get_into(keys, addresses, [size_bytes] * len(keys))), daemon=True
    )
    getter.start()
    getter.join(bound_s)
    return (outcome[0] if outcome else None), time.monotonic() - started, buffers


def is_untouched(buffers: list[bytearray]) -> bool:
    """Whether `buffers` hold what timed_get_into filled them with (a bool: pytest's diff of
    megabytes takes minutes)."""
    return all(buffer.count(FILLER) == len(buffer) for buffer in buffers)


def test_a_sync_get_whose_object_files_hang_returns_misses_by_its_deadline(make_cluster, tmp_path):
    """A same-host read of a disk or DFS object file ran in the caller's thread, unbounded: a
    read stuck in the kernel held it for good. Now it runs on a file-reading thread, and the
    get returns misses at its deadline, its buffers left as they were. While such reads hold
    every file-reading thread, a get gives its file reads up at once."""
    keys = [f"k{i}" for i in range(FILE_READ_THREADS)]
    cluster, data, paths = disk_only(make_cluster, tmp_path, 64 * 1024, keys)
    with Store(cluster.master_endpoint, transfer_timeout_ms=TRANSFER_TIMEOUT_MS) as store:
        assert wait_until(lambda: all(store.batch_exists(keys)), 10)  # re-adopted from the disk
        assert store.get_batch(keys) == [data] * len(keys)  # read from the files here
        for path in paths:
            path.rename(path.with_suffix(".aside"))
            os.mkfifo(path)  # open() blocks until a writer comes
        try:
            results, took_s, buffers = timed_get_into(store, keys, len(data), TRANSFER_TIMEOUT_MS / 1000 + 2)
            assert results is not None, "the get was still blocked on the object files"
            assert results == [ErrorCode.TRANSFER_FAIL] * len(keys), results  # misses
            assert took_s < TRANSFER_TIMEOUT_MS / 1000 + SLACK_S, took_s
            assert is_untouched(buffers)
            results, took_s, _ = timed_get_into(store, keys[:1], len(data), 2)  # every reading thread held
            assert results == [ErrorCode.TRANSFER_FAIL] and took_s < SLACK_S, (results, took_s)
        finally:
            for path in paths:
                os.close(os.open(path, os.O_RDWR))  # a writer comes and goes: the blocked open()s end
        for path in paths:
            path.unlink()
            path.with_suffix(".aside").rename(path)
        assert wait_until(lambda: store.get_batch(keys) == [data] * len(keys), 5)  # the threads are free again
        assert is_untouched(buffers)


def test_a_sync_get_writes_nothing_into_the_buffer_after_it_returned(make_cluster, tmp_path, monkeypatch):
    """A file read given up at the get's deadline that ends later (a mount that recovers)
    lands in memory of the get's own, never in the caller's buffer, which the caller may hand
    to another request the moment the get returned."""
    cluster, data, _ = disk_only(make_cluster, tmp_path, 1536 * 1024, ["k"])  # more than one chunk (BOUNCE_BYTES)
    disk_answers, read_ended = threading.Event(), threading.Event()

    def waiting(open_object):
        def open_when_the_disk_answers(*args):
            try:
                assert disk_answers.wait(30)
                return open_object(*args)
            finally:
                read_ended.set()

        return open_when_the_disk_answers

    with Store(cluster.master_endpoint, transfer_timeout_ms=TRANSFER_TIMEOUT_MS) as store:
        assert wait_until(lambda: store.exists("k"), 10)
        # Read whole, into one buffer and into uneven parts (chunks end where parts do).
        assert store.get("k") == data
        parts = [bytearray(n) for n in (100_000, 1_200_000, len(data) - 1_300_000)]
        addresses = [store.register_buffer(part) for part in parts]
        assert store.batch_get_into_multi_buffers(["k"], [addresses], [[len(p) for p in parts]]) == [len(data)]
        assert b"".join(parts) == data
        monkeypatch.setattr(files, "open_object", waiting(files.open_object))  # every way of reading opens so
        try:
            results, took_s, buffers = timed_get_into(store, ["k"], len(data), TRANSFER_TIMEOUT_MS / 1000 + 2)
            assert results is not None, "the get was still blocked on the object file"
            assert results == [ErrorCode.TRANSFER_FAIL], results  # a miss
            assert took_s < TRANSFER_TIMEOUT_MS / 1000 + SLACK_S, took_s
        finally:
            disk_answers.set()
        assert read_ended.wait(10)
        time.sleep(0.05)  # what the late read does next, if it writes anything
        assert is_untouched(buffers), "the late read wrote into the caller's buffer"
        monkeypatch.undo()
        assert store.get("k") == data


def test_a_lookup_that_must_find_a_new_leader_keeps_its_bound(make_cluster, etcd_endpoint):
    """A lookup with timeout_ms (an engine's lookup_timeout_ms) right after the leader was
    killed tried this thread's connection, then the loop, each with a bound of its own, and
    the loop a connect timeout more: 2-3 s for a bound of 1 s (2 s for one of 300 ms here).
    Now every way of one call shares its bound, through the breaker as well, in Store and
    AsyncStore alike: a miss or an error within it."""
    cluster = make_cluster(0, "16MiB", etcd_endpoint=etcd_endpoint, cluster_id=new_cluster_id(),
                           master_count=2, master_args=("--etcd-lease-ttl-ms", str(TTL_MS)))  # fmt: skip
    leader = cluster.wait_leader()
    bound_ms = 300

    def lookup_within_its_bound(lookup) -> None:
        started = time.monotonic()
        try:
            lookup()
        except TransportError:
            pass  # the new leader is not found yet: a miss for the engine
        took_s = time.monotonic() - started
        assert took_s < bound_ms / 1000 + SLACK_S, f"a lookup of {bound_ms} ms took {took_s * 1000:.0f} ms"

    loop = uvloop.new_event_loop()
    try:
        with Store(cluster.master_address) as store:
            async_store = loop.run_until_complete(AsyncStore.open(cluster.master_address))
            assert store.longest_prefix(["a"], timeout_ms=bound_ms) == 0  # this thread's own connection
            assert loop.run_until_complete(async_store.longest_prefix(["a"], timeout_ms=bound_ms)) == 0
            breaker = LookupBreaker("test lookups", 1_000, 1_000)
            leader.signal(signal.SIGKILL)
            lookup_within_its_bound(
                lambda: breaker.ask(lambda: store.longest_prefix(["a"], timeout_ms=bound_ms), 0, lambda exc: None)
            )
            for _ in range(2):
                lookup_within_its_bound(lambda: store.longest_prefix(["a"], timeout_ms=bound_ms))
                lookup_within_its_bound(lambda: store.query(["a"], timeout_ms=bound_ms))
                lookup_within_its_bound(
                    lambda: loop.run_until_complete(async_store.longest_prefix(["a"], timeout_ms=bound_ms))
                )
            loop.run_until_complete(async_store.aclose())
    finally:
        loop.close()


# A process whose sync get of key "k" hangs in its file read (in this process only), until
# Ctrl-C: it says "reading" once the read hangs, then what the get raised.
_INTERRUPTED_GET = """
import signal, sys, threading
from kvpool import Store
from kvpool.transports import files

# Ctrl-C as at a terminal: a test runner started in the background (`cmd &` in a script)
# ignores SIGINT, and so would this process, which inherits that.
signal.signal(signal.SIGINT, signal.default_int_handler)

hung = threading.Event()
def open_when_the_disk_answers(*args):
    hung.set()
    threading.Event().wait()  # never answers

with Store(sys.argv[1], transfer_timeout_ms=10_000) as store:
    assert store.get("k") is not None  # read from the file here
    files.open_object = open_when_the_disk_answers
    threading.Thread(target=lambda: hung.wait() and print("reading", flush=True), daemon=True).start()
    try:
        store.get("k")
        print("returned", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
"""


def test_a_sync_get_interrupted_while_its_file_read_hangs_gives_its_lease_back_at_once(make_cluster, tmp_path):
    """Ctrl-C during a get's wait for a hung file read: the read lease went back only at its
    TTL (10 s), and until then a remove (and eviction) skipped the object. (The read hangs in
    the getting process only: a FIFO in the tier's directory was read by its node too. In a
    process of its own, which takes SIGINT: run in the test runner's, it failed whenever the
    runner had been started in the background, which ignores SIGINT.)"""
    cluster, _, _ = disk_only(make_cluster, tmp_path, 64 * 1024, ["k"])
    getter = subprocess.Popen(
        [sys.executable, "-c", _INTERRUPTED_GET, cluster.master_endpoint], stdout=subprocess.PIPE, text=True
    )
    try:
        assert getter.stdout.readline() == "reading\n"
        getter.send_signal(signal.SIGINT)
        assert getter.stdout.readline() == "interrupted\n"
        with Store(cluster.master_endpoint) as store:

            def removed() -> bool:
                try:
                    store.remove("k")  # refused while a lease holds it
                except ObjectHasLease:
                    return False
                return True

            assert wait_until(removed, 2), "the interrupted get's lease was kept"  # given back within ~10 ms
    finally:
        getter.kill()
        getter.wait()
