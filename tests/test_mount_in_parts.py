"""A segment mounted in parts (MountSegment.is_last): a large inventory, a node's or the DFS
scan's, goes to the master in several messages, and things happen between them.

How: an in-process master and node on real sockets, parts of one or two entries.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from kvpool import AsyncStore, limits
from kvpool.config import MasterConfig, NodeConfig
from kvpool.errors import ErrorCode
from kvpool.master import server as master_server
from kvpool.master.removed_at_start import RemovedAtStart
from kvpool.master.server import MasterServer, local_clock_ms, wall_clock_ms
from kvpool.node import server as node_server
from kvpool.node.server import Node
from kvpool.protocol.messages import ExistKeys, MountSegment, Remove
from kvpool.transports.connection import Connection

TIMEOUT_MS = 10_000


def test_an_object_removed_between_the_parts_of_its_nodes_mount_is_not_listed_again(tmp_path: Path, monkeypatch):
    """The node built every part before sending the first: a drop that reached it between
    parts made it forget the object and answer, and a later part listed the object again: the
    master adopted it back, a removed key served from a replica the node no longer held."""
    monkeypatch.setattr(node_server, "_MOUNT_ENTRIES_MAX", 1)
    remove_between_parts: list[str] = []  # the key to remove once the first part is in
    mounted_again = asyncio.Event()
    request = Connection.request

    async def request_then_remove(conn, message, *args, **kwargs):
        reply = await request(conn, message, *args, **kwargs)
        if isinstance(message, MountSegment) and not message.is_last and remove_between_parts:
            await store.remove(remove_between_parts.pop())  # answered once its node dropped it
        if isinstance(message, MountSegment) and message.is_last and not remove_between_parts:
            mounted_again.set()
        return reply

    async def main() -> None:
        nonlocal store
        async with _master_and_node(tmp_path, MasterConfig(), heartbeat_interval_ms=200) as (master, node):
            async with await AsyncStore.open(master.endpoint, shm_enabled=False) as store:
                for key in ("a", "k"):
                    await store.put(key, key.encode() * 4096)
                last = node.inventory.entries()[-1].key  # in the last part
                remove_between_parts.append(last)
                monkeypatch.setattr(Connection, "request", request_then_remove)
                await _mount_again(node, mounted_again)
                assert node.inventory.get(last) is None  # its drop came between the parts
                assert not await store.exists(last)
                assert await store.exists(({"a", "k"} - {last}).pop())

    store: AsyncStore | None = None
    asyncio.run(main())


def test_a_mount_in_parts_is_one_log_line_with_every_parts_counts(tmp_path: Path, monkeypatch, caplog) -> None:
    """A node of 40,000 objects mounted in parts of 16,384 logged a line per part, the last
    saying "7232 objects re-adopted", which read like a loss: one line now, at the last part,
    counting them all."""
    monkeypatch.setattr(node_server, "_MOUNT_ENTRIES_MAX", 1)
    mounted_again = asyncio.Event()
    request = Connection.request

    async def request_noting_the_last(conn, message, *args, **kwargs):
        reply = await request(conn, message, *args, **kwargs)
        if isinstance(message, MountSegment) and message.is_last:
            mounted_again.set()
        return reply

    async def main() -> None:
        async with _master_and_node(tmp_path, MasterConfig(), heartbeat_interval_ms=200) as (master, node):
            async with await AsyncStore.open(master.endpoint, shm_enabled=False) as store:
                for key in ("a", "b", "c"):
                    await store.put(key, key.encode() * 4096)
            monkeypatch.setattr(Connection, "request", request_noting_the_last)
            caplog.clear()
            await _mount_again(node, mounted_again)
            lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("mounted segment")]
            assert len(lines) == 1 and "3 objects re-adopted, 0 rejected" in lines[0], lines

    with caplog.at_level("INFO", logger="kvpool.master.server"):
        asyncio.run(main())


def test_the_dfs_scan_is_mounted_whole_only_with_its_last_part(tmp_path: Path, monkeypatch) -> None:
    """Every part of the DFS's scan said is_last: the master took its inventory as whole after
    the first, and a mount's is_whole forgets what the segment left behind that later parts show.
    The last part comes alone, once the files the parts refused are gone (it opens the DFS to
    new copies, which could take a refused file's name)."""
    monkeypatch.setattr(master_server, "_DFS_MOUNT_CHUNK", 2)

    async def main() -> None:
        server = await _master_with_dfs_files(tmp_path, "abc")
        mount_segment = server.service.mount_segment
        parts: list[bool] = []

        def seen(mount: MountSegment, *args, **kwargs):
            parts.append(mount.is_last)
            return mount_segment(mount, *args, **kwargs)

        monkeypatch.setattr(server.service, "mount_segment", seen)
        await server._ensure_dfs()
        assert parts == [False, False, True]

    asyncio.run(main())


def test_the_dfs_mount_serves_requests_between_its_parts(tmp_path: Path, monkeypatch) -> None:
    """The DFS's parts were mounted in one go: a share of millions of files held the master's
    loop for as many seconds at each start and term (requests timed out meanwhile). A remove
    read between two parts still reaches the objects of the parts to come, and the files those
    parts refused are gone before the last part, the DFS kept alive meanwhile."""
    monkeypatch.setattr(master_server, "_DFS_MOUNT_CHUNK", 1)
    monkeypatch.setattr(master_server, "_DFS_UNLINK_CHUNK", 1)

    async def main() -> None:
        server = await _master_with_dfs_files(tmp_path, "abc")
        server._removed_at_start = RemovedAtStart(local_clock_ms() + 60_000)  # as start() sets it
        dfs = server._dfs
        assert dfs is not None
        mount_segment = server.service.mount_segment
        turns = [0]  # loop turns of a task beside the mount
        seen_at: list[int] = []  # the turn each part was mounted at
        part_keys: list[list[str]] = []  # what each part adopted
        files_left: list[str] = []  # the DFS's files when its last part came
        removes: list = []

        def seen(mount: MountSegment, *args, **kwargs):
            seen_at.append(turns[0])
            part_keys.append([entry.key for entry in mount.inventory])
            if mount.is_last:  # the refused files are gone by then
                files_left.extend(entry.key for entry in dfs.scan(limits.DFS_TEMP_FILE_AGE_MS_MAX))
                heard_before_last.extend(heard)
            return mount_segment(mount, *args, **kwargs)

        hear = server.service.hear
        heard: list[str] = []  # the segments kept alive while the refused files were unlinked
        heard_before_last: list[str] = []

        def hearing(segment_ids: list[str], local_ms: int) -> None:
            heard.extend(segment_ids)
            hear(segment_ids, local_ms)

        async def count_turns() -> None:  # and read a remove once the first part is in
            while True:
                turns[0] += 1
                if len(part_keys) == 1 and not removes:
                    removes.append(server._dispatch(None, Remove(["a", "b", "c"])))
                await asyncio.sleep(0)

        monkeypatch.setattr(server.service, "mount_segment", seen)
        monkeypatch.setattr(server.service, "hear", hearing)
        counter = asyncio.ensure_future(count_turns())
        await server._ensure_dfs()
        counter.cancel()
        assert len(seen_at) == 4 and seen_at[0] < seen_at[1] < seen_at[2]  # requests ran between parts
        assert [len(keys) for keys in part_keys] == [1, 0, 0, 0]  # the later parts' keys: refused, as removed
        reply = removes[0] if not asyncio.iscoroutine(removes[0]) else await removes[0]
        (first,) = part_keys[0]  # mounted before the remove: found; the others came after it
        assert [code == ErrorCode.OK for code in reply.codes] == [key == first for key in "abc"]
        assert set(files_left) <= {first}  # the refused ones' files were gone before the last part
        assert server._dfs_info is not None and heard_before_last == [server._dfs_info.segment_id] * 2
        assert server.service.exist_keys(ExistKeys(["a", "b", "c"]), wall_clock_ms()).flags == [False] * 3

    asyncio.run(main())


def test_a_mount_whose_segment_times_out_between_parts_starts_again_from_the_first(tmp_path: Path, monkeypatch):
    """The first part went to the incarnation that timed out (its objects lost again), the last
    to a new one, which took the inventory as whole: the objects of the first part were unknown
    to the master though their node held them, a remove of one found nothing, and the node's
    next mount brought it back. The segment mounts again on the same link (it used to close
    the link and mount every segment again after a backoff)."""
    monkeypatch.setattr(node_server, "_MOUNT_ENTRIES_MAX", 2)
    held_up = [True]  # the first part of the next mount waits until its segment timed out
    mounted_again = asyncio.Event()
    mount_links: dict[int, Connection] = {}  # the connections the mounts after the cut went on (kept: ids stay theirs)
    request = Connection.request

    async def request_slowly(conn, message, *args, **kwargs):
        if isinstance(message, MountSegment):
            mount_links[id(conn)] = conn
        reply = await request(conn, message, *args, **kwargs)
        if isinstance(message, MountSegment) and not message.is_last and held_up:
            held_up.pop()
            await _until(lambda: not master.service.has_segment(node.segment_info.segment_id))
        elif isinstance(message, MountSegment) and message.is_last and not held_up:
            mounted_again.set()
        return reply

    async def main() -> None:
        nonlocal master, node
        async with _master_and_node(tmp_path, MasterConfig(node_ttl_ms=1_000), heartbeat_interval_ms=100) as (
            master,
            node,
        ):
            async with await AsyncStore.open(master.endpoint, shm_enabled=False) as store:
                keys = ["a", "b", "c", "d"]
                for key in keys:
                    await store.put(key, key.encode() * 4096)
                monkeypatch.setattr(Connection, "request", request_slowly)
                await _mount_again(node, mounted_again)
                assert [await store.exists(key) for key in keys] == [True] * 4  # all its node holds
                assert len(mount_links) == 1, list(mount_links.values())
                await store.remove("a")
                mounted_again.clear()
                await _mount_again(node, mounted_again)
                assert [await store.exists(key) for key in keys] == [False, True, True, True]

    master: MasterServer | None = None
    node: Node | None = None
    asyncio.run(main())


def test_a_disk_mount_longer_than_the_node_ttl_keeps_the_dram_segment_mounted_before_it(tmp_path: Path, monkeypatch):
    """A node mounts its DRAM segment, then its disk tier's inventory in parts: with a million
    disk objects that takes longer than the node TTL. The DRAM segment, heard from at its own
    mount only, timed out meanwhile (its objects lost), and the heartbeat after had the node
    mount everything again, which timed it out again: the node never came back whole."""
    monkeypatch.setattr(node_server, "_MOUNT_ENTRIES_MAX", 1)
    part_gap_s = 0.3  # under the node TTL between parts, past it over the disk's whole mount
    dram_mounts: list[MountSegment] = []
    disk_mounted = asyncio.Event()
    request = Connection.request

    async def request_slowly(conn, message, *args, **kwargs):
        reply = await request(conn, message, *args, **kwargs)
        if not isinstance(message, MountSegment):
            return reply
        if message.segment.tier == "dram" and message.is_first:
            dram_mounts.append(message)
        elif message.segment.tier == "disk" and not message.is_last:
            await asyncio.sleep(part_gap_s)
        elif message.segment.tier == "disk":
            disk_mounted.set()
        return reply

    async def main() -> None:
        async with _master_and_node(
            tmp_path, MasterConfig(node_ttl_ms=1_000), heartbeat_interval_ms=100, disk_bytes=64 * limits.MIB
        ) as (master, node):
            async with await AsyncStore.open(master.endpoint, shm_enabled=False) as store:
                await _offloaded(store, node, 24, on_disk=6)  # 12 MiB into 4 MiB of DRAM
                assert node._disk is not None
                in_dram, *others = [entry.key for entry in node.inventory.entries()]
                for key in others:  # room in DRAM: nothing is evicted from it while the disk mounts
                    await store.remove(key)
                monkeypatch.setattr(Connection, "request", request_slowly)
                await _mount_again(node, disk_mounted)
                assert len(node._disk.inventory) * part_gap_s > 1.5  # the disk's mount outlasted the TTL
                await asyncio.sleep(0.5)  # heartbeats: a DRAM segment timed out would be mounted again
                assert len(dram_mounts) == 1, dram_mounts
                assert master.service.has_segment(node.segment_info.segment_id)
                assert await store.get(in_dram) is not None

    asyncio.run(main())


def test_a_disk_part_refused_after_the_node_went_silent_mounts_every_segment_again(tmp_path: Path, monkeypatch):
    """The node went silent past its TTL between two parts of its disk tier's mount: both its
    segments timed out. It mounts both again from the first part on the same link, and tells
    its mover at each attempt (a move the master placed into the DRAM segment of the attempt
    before must not be recorded into the one rebuilt after)."""
    monkeypatch.setattr(node_server, "_MOUNT_ENTRIES_MAX", 1)
    held_up = [True]  # a disk part of the next mount waits until its segments timed out
    mounted_again = asyncio.Event()
    first_parts: list[tuple[str, int]] = []  # (tier, connection id) of each first part after the cut
    request = Connection.request

    async def request_slowly(conn, message, *args, **kwargs):
        if isinstance(message, MountSegment) and message.is_first:
            first_parts.append((message.segment.tier, id(conn)))
        reply = await request(conn, message, *args, **kwargs)
        if isinstance(message, MountSegment) and message.segment.tier == "disk":
            if not message.is_first and not message.is_last and held_up:
                held_up.pop()
                await _until(lambda: not master.service.has_segment(message.segment.segment_id))
            elif message.is_last and not held_up:
                mounted_again.set()
        return reply

    async def main() -> None:
        nonlocal master
        async with _master_and_node(
            tmp_path, MasterConfig(node_ttl_ms=1_000), heartbeat_interval_ms=100, disk_bytes=64 * limits.MIB
        ) as (master, node):
            async with await AsyncStore.open(master.endpoint, shm_enabled=False) as store:
                await _offloaded(store, node, 12, on_disk=3)  # 6 MiB into 4 MiB of DRAM
                assert node._disk is not None and node._mover is not None
                remounts: list[None] = []
                remounted = node._mover.remounted
                monkeypatch.setattr(node._mover, "remounted", lambda: (remounts.append(None), remounted()))
                monkeypatch.setattr(Connection, "request", request_slowly)
                await _mount_again(node, mounted_again)
                assert [tier for tier, _ in first_parts] == ["dram", "disk", "dram", "disk"], first_parts
                assert len({link for _, link in first_parts}) == 1, first_parts  # on one link
                assert len(remounts) == 2
                segments = [node.segment_info.segment_id, node._disk.segment_id]
                assert all(master.service.has_segment(segment_id) for segment_id in segments)
                held = [entry.key for entry in (*node.inventory.entries(), *node._disk.inventory.entries())]
                assert held and await store.batch_exists(held) == [True] * len(held)  # the master lists them all

    master: MasterServer | None = None
    asyncio.run(main())


async def _master_with_dfs_files(tmp_path: Path, keys: str) -> MasterServer:
    """A master (no sockets) over a DFS directory holding a file of 4 KiB for each key, 1 MiB apart."""
    server = MasterServer(MasterConfig(), seed=1, dfs_dir=str(tmp_path), dfs_bytes=limits.GIB)
    await server._open_dfs()
    dfs = server._dfs
    assert dfs is not None
    for index, key in enumerate(keys):
        source = [memoryview(key.encode() * 4096)]
        dfs.publish(key, index * limits.MIB, dfs.write_temporary(key, index * limits.MIB, 1, source,
                                                                 is_durable=False), is_durable=False)  # fmt: skip
    return server


@contextlib.asynccontextmanager
async def _master_and_node(
    tmp_path: Path, config: MasterConfig, heartbeat_interval_ms: int, disk_bytes: int = 0
) -> AsyncIterator[tuple[MasterServer, Node]]:
    """A master and a node of 4 MiB (over a disk tier of `disk_bytes`, if any), in process on
    real sockets, the node mounted."""
    master = MasterServer(config, port=0)
    await master.start()
    disk = {"disk_dir": str(tmp_path / "disk"), "disk_bytes": disk_bytes} if disk_bytes else {}
    node = Node(NodeConfig(master_endpoint=master.endpoint, memory_bytes=4 * limits.MIB, shm_dir=str(tmp_path),
                           heartbeat_interval_ms=heartbeat_interval_ms, **disk))  # fmt: skip
    try:
        await node.start()
        await node.wait_mounted(TIMEOUT_MS)
        yield master, node
    finally:
        await node.stop()
        await master.stop()


async def _offloaded(store: AsyncStore, node: Node, count: int, on_disk: int) -> None:
    """Put `count` objects of 512 KiB; wait until the node's disk tier holds `on_disk` of them
    and its DRAM one at least."""
    for i in range(count):
        await store.put(f"k{i}", bytes([i]) * (512 * 1024))
    await _until(lambda: node._disk is not None and len(node._disk.inventory) >= on_disk and len(node.inventory) >= 1)


async def _mount_again(node: Node, mounted: asyncio.Event) -> None:
    """Cut the node's master link: it reconnects and mounts again; wait until it has."""
    assert node._master_conn is not None
    node._master_conn.close("the test cuts the link: the node mounts again")
    await asyncio.wait_for(mounted.wait(), TIMEOUT_MS / 1000)
    await node.wait_mounted(TIMEOUT_MS)


async def _until(predicate, timeout_s: float = TIMEOUT_MS / 1000) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)
