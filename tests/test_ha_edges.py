"""HA edges: a takeover's grace on a stepped wall clock, a new leader's wait for the shared
DFS, and a deposed term's DFS drops that must not remove what its successor adopted.

How: a real etcd (the `etcd_endpoint` fixture), masters and a client in-process on one event
loop over loopback sockets (as tests/test_ha_leading.py). The DFS is a directory under
tmp_path; a slow share is a DfsDirectory.remove that blocks in its thread until released.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest

from kvpool.checksums import checksum_of
from kvpool.client.store import AsyncStore
from kvpool.config import MasterConfig
from kvpool.discovery import encode_segments_record, segments_key
from kvpool.errors import NotLeader
from kvpool.master import server as server_module
from kvpool.master.election import ElectionConfig
from kvpool.master.server import MasterServer
from kvpool.protocol import auth
from kvpool.protocol.messages import ListObjects
from kvpool.transports import files
from kvpool.transports.dfs import DfsDirectory
from kvpool.transports.etcd import EtcdClient
from tests.test_ha import _recorded, _wait_for, _wait_for_async, new_cluster_id, run

DFS_BYTES = 64 << 20
HOUR_MS = 3_600_000


def _candidate(etcd_endpoint: str, cluster_id: str, dfs_dir: str | None = None, **config) -> MasterServer:
    election = ElectionConfig((etcd_endpoint,), cluster_id, lease_ttl_ms=3_000)
    return MasterServer(MasterConfig(**config), port=0, seed=1, election=election, debug_invariants=True,
                        dfs_dir=dfs_dir, dfs_bytes=DFS_BYTES)  # fmt: skip


def test_a_wall_clock_step_neither_opens_a_takeover_early_nor_holds_it_past_its_grace(etcd_endpoint, monkeypatch):
    """The predecessor recorded a node that is not coming back: the new leader takes puts once
    its grace (1.5 s) is over. The grace ran on the wall clock: stepped an hour forward, the
    leader took puts at once; stepped back, it refused them for an hour."""
    step_ms = 0
    monkeypatch.setattr(server_module, "wall_clock_ms", lambda: time.time_ns() // 1_000_000 + step_ms)

    async def main():
        nonlocal step_ms
        cluster_id = new_cluster_id()
        async with EtcdClient([etcd_endpoint]) as etcd:
            await etcd.put(segments_key(cluster_id), encode_segments_record(1, ["gone-node-1234"]))
        master = _candidate(etcd_endpoint, cluster_id, remount_grace_ms=1_500)
        await master.start()
        store = None
        try:
            await _wait_for(lambda: master.role in ("recovering", "leader"))
            assert master.role == "recovering"
            step_ms = HOUR_MS
            assert master.role == "recovering"
            store = await AsyncStore.open(f"etcd://{etcd_endpoint}/{cluster_id}", rpc_timeout_ms=300,
                                          connect_timeout_ms=300)  # fmt: skip
            with pytest.raises(NotLeader, match="re-mount"):
                await store.put("early", b"x")
            step_ms = -HOUR_MS
            await _wait_for(lambda: master.role == "leader", 3.0)
        finally:
            if store is not None:
                await store.aclose()
            await master.stop()

    run(main())


def test_a_new_leader_waits_for_no_node_to_mount_the_dfs_its_predecessor_recorded(etcd_endpoint, tmp_path):
    """The DFS has no node to re-mount it: the leader mounts it itself, from a scan. A new
    leader whose predecessor recorded it must take puts once it has scanned it, not after
    the whole grace (20 s here)."""

    async def main():
        cluster_id = new_cluster_id()
        dfs = str(tmp_path / "dfs")
        first = _candidate(etcd_endpoint, cluster_id, dfs, remount_grace_ms=20_000)
        second = _candidate(etcd_endpoint, cluster_id, dfs, remount_grace_ms=20_000)
        await first.start()
        try:
            await _wait_for(lambda: first.role == "leader", 25.0)
            assert first._dfs_info is not None
            dfs_id = first._dfs_info.segment_id
            async with EtcdClient([etcd_endpoint]) as etcd:
                await _wait_for_async(lambda: _recorded(etcd, cluster_id), lambda ids: ids == [dfs_id])
            await second.start()
            await _wait_for(lambda: second.elector.leader is not None)
            await first.stop()
            await _wait_for(lambda: second.role in ("recovering", "leader"), 5.0)
            started = time.monotonic()
            await _wait_for(lambda: second.role == "leader", 5.0)
            assert time.monotonic() - started < 5.0
        finally:
            await second.stop()
            await first.stop()

    run(main())


def test_a_deposed_terms_dfs_drops_leave_the_files_its_successor_adopted(etcd_endpoint, tmp_path, monkeypatch):
    """The leader removes "a" and "b", both DFS files; their removal hangs on the first (a slow
    share) and the leader steps down. Its successor scans the DFS and adopts both (the one
    whose removal was under way too). The hung removal then goes on: it used to remove the
    other file too, an object the new leader lists, and every read of it missed."""
    dfs_path = tmp_path / "dfs"
    dfs = DfsDirectory.create_or_open(dfs_path, DFS_BYTES, auth.cluster_mark(None))
    values = {"a": b"A" * 5000, "b": b"B" * 7000}
    offsets = {"a": 0, "b": 1 << 20}
    for key, value in values.items():
        written = dfs.write_temporary(key, offsets[key], checksum_of([value]), [memoryview(value)], is_durable=False)
        dfs.publish(key, offsets[key], written, is_durable=False)
    entered, release = threading.Event(), threading.Event()
    removing: list[str] = []  # the keys whose files the old leader removed, in order

    async def main():
        # Threads of our own, so that the test can wait for every one (the hung removal's
        # included) to finish.
        executor = concurrent.futures.ThreadPoolExecutor(8)
        asyncio.get_running_loop().set_default_executor(executor)
        cluster_id = new_cluster_id()
        first = _candidate(etcd_endpoint, cluster_id, str(dfs_path))
        second = _candidate(etcd_endpoint, cluster_id, str(dfs_path))
        store = None
        await first.start()
        try:
            await _wait_for(lambda: first.role == "leader", 10.0)
            await second.start()
            await _wait_for(lambda: second.elector.leader is not None)
            remove = first._dfs.remove

            def hung_remove(key: str, offset: int) -> bool:
                removing.append(key)
                entered.set()
                release.wait(30)
                return remove(key, offset)

            monkeypatch.setattr(first._dfs, "remove", hung_remove)
            store = await AsyncStore.open(f"etcd://{etcd_endpoint}/{cluster_id}", dfs_dir=str(dfs_path))
            await _wait_for(lambda: len(first.service.list_objects(ListObjects(), 0).keys) == 2)  # DFS scanned
            assert await store.remove_all() == 2  # answered within a second, drops or not
            assert await asyncio.to_thread(entered.wait, 10)
            await first.stop()  # revokes its lease: the standby wins at once
            await _wait_for(lambda: second.role == "leader", 10.0)
            assert await store.exists("a") and await store.exists("b")  # adopted by the new leader
            release.set()
            executor.shutdown(wait=True)  # the hung removal went on, and ended
            asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(8))
            [other] = set(values) - {removing[0]}  # the removal under way landed: not the other
            assert removing == [removing[0]]
            path = dfs.path_of(other, offsets[other])
            assert files.holds_object(path, other, len(values[other]), checksum_of([values[other]]))
            assert await store.get(other) == values[other]
        finally:
            release.set()
            if store is not None:
                await store.aclose()
            await second.stop()
            await first.stop()

    run(main())
