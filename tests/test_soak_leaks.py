"""What a long, messy run must not leave behind (found by a soak: a master and two nodes under
mixed load for 4 minutes, client processes and nodes killed with SIGKILL, one remove_all).

That soak found the servers' descriptors, threads and memory flat, and the master's records in
step with what the nodes and the DFS hold. What stayed behind after its owner died: the
temporary files of the DFS writes a killed node had in flight (3 to 30 at a time under load),
which only a master's start removed; and the segment file of a killed serving process's
embedded node (its host memory with it), which only a node's start removed.
"""

from __future__ import annotations

import asyncio
import os
import time

import uvloop
from conftest import segment_owner

from kvpool import limits
from kvpool.config import MasterConfig, NodeConfig
from kvpool.master import server as server_module
from kvpool.master.server import MasterServer
from kvpool.node import server as node_server_module
from kvpool.node.server import Node
from kvpool.transports.dfs import DfsDirectory


def test_a_running_master_removes_the_dfs_temporary_files_of_a_writer_that_died(tmp_path, monkeypatch):
    """A node killed mid-offload leaves the temporary files of its DFS copies in flight; nothing
    but a master's start-up scan removed them, so a master that ran for weeks let every node
    crash leave up to its move queue (512 MiB) in the share. Now a running master removes
    them too, once they are older than any live writer's."""
    monkeypatch.setattr(server_module, "DFS_TEMP_SWEEP_INTERVAL_MS", 100, raising=False)
    payload = [memoryview(b"kv" * 2048)]
    long_ago_s = time.time() - limits.DFS_TEMP_FILE_AGE_MS_MAX / 1000 - 60

    async def main() -> None:
        master = MasterServer(MasterConfig(), port=0, dfs_dir=str(tmp_path / "dfs"))
        await master.start()  # its scan: nothing to remove yet
        try:
            dfs = DfsDirectory(tmp_path / "dfs")
            dead = dfs.write_temporary("killed/writer", 0, 1, payload, is_durable=False)
            os.utime(dead, (long_ago_s, long_ago_s))
            live = dfs.write_temporary("slow/writer", 4096, 1, payload, is_durable=False)  # written just now
            kept = dfs.write_temporary("old/object", 8192, 1, payload, is_durable=False)
            dfs.publish("old/object", 8192, kept, is_durable=False)
            published = dfs.path_of("old/object", 8192)
            os.utime(published, (long_ago_s, long_ago_s))
            loop = asyncio.get_running_loop()
            deadline_s = loop.time() + 5
            while dead.exists() and loop.time() < deadline_s:
                await asyncio.sleep(0.05)
            assert not dead.exists(), "a dead writer's temporary file stayed in the DFS"
            assert live.exists() and published.exists()
        finally:
            await master.stop()

    uvloop.run(main())


def test_a_sweep_of_dfs_temporaries_passes_a_file_it_cannot_remove_and_stops_when_told(tmp_path):
    """One stale temporary file that cannot be removed ended the whole walk every hour (those
    after it stayed for good); and the walk, in a thread, went on after the master stopped or
    its term ended (a stopping master's executor waits for it: on a hung share, for ever)."""
    dfs = DfsDirectory.create_or_open(tmp_path / "dfs", 64 * limits.MIB)
    payload = [memoryview(b"kv" * 2048)]
    long_ago_s = time.time() - limits.DFS_TEMP_FILE_AGE_MS_MAX / 1000 - 60
    stale = [dfs.write_temporary(f"dead/{i}", 4096 * i, 1, payload, is_durable=False) for i in range(3)]
    stuck = stale[0].with_name(stale[0].name.replace(".tmp", "0.tmp"))
    stuck.mkdir()  # a stale "file" unlink cannot remove
    for path in (*stale, stuck):
        os.utime(path, (long_ago_s, long_ago_s))
    assert dfs.remove_stale_temporaries(limits.DFS_TEMP_FILE_AGE_MS_MAX, lambda: False) == (0, 0)
    assert all(path.exists() for path in stale)
    assert dfs.remove_stale_temporaries(limits.DFS_TEMP_FILE_AGE_MS_MAX, lambda: True) == (3, 1)
    assert not any(path.exists() for path in stale) and stuck.exists()


def test_a_running_node_removes_the_segment_file_of_a_process_killed_on_its_host(tmp_path, monkeypatch):
    """A serving process killed with SIGKILL leaves its embedded segment's file in /dev/shm,
    and the host memory under it. Only a node's start removed such files: a host whose engine
    was killed and rescheduled elsewhere kept that memory taken for as long as its other kvpool
    processes ran. Now every running node removes them; a live owner's file stays."""
    monkeypatch.setattr(node_server_module, "STALE_SEGMENTS_SWEEP_INTERVAL_MS", 100, raising=False)
    killed, killed_path = segment_owner(tmp_path, "killed-engine")
    alive, alive_path = segment_owner(tmp_path, "live-engine")

    async def main() -> None:
        master = MasterServer(MasterConfig(), port=0)
        await master.start()
        node = Node(NodeConfig(master_endpoint=master.endpoint, memory_bytes=limits.MIB, shm_dir=str(tmp_path)))
        try:
            await node.start()  # its start's removal finds nothing stale
            killed.kill()
            killed.wait(10)
            loop = asyncio.get_running_loop()
            deadline_s = loop.time() + 5
            while killed_path.exists() and loop.time() < deadline_s:
                await asyncio.sleep(0.05)
            assert not killed_path.exists(), "a killed process's segment file stayed"
            assert alive_path.exists() and node.segment.path.exists()
        finally:
            await node.stop()
            await master.stop()

    try:
        uvloop.run(main())
    finally:
        for child in (killed, alive):
            child.kill()
            child.wait(10)
