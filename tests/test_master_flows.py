"""The master server's flows with nodes (MasterServer: puts that wait for room in rounds of
eviction, drops sent to nodes, commits), through a fake node connection. The service's own
rules are test_master_service's and test_master_eviction's.

The put-room scenarios were found by a review (2026-12-02) and confirmed by a script before
their fix: in a cluster test, four threads putting into a full cache lost a batch of 128 now
and then. The node-reply one by fuzzing the wire protocol.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import threading
import time

import pytest

from kvpool import limits
from kvpool.config import MasterConfig
from kvpool.errors import ErrorCode, RpcTimeout
from kvpool.master import server as server_module
from kvpool.master.server import MasterServer, _NodeLink, wall_clock_ms
from kvpool.protocol.messages import (
    CodesReply,
    CommitObjects,
    DropObjects,
    GetReplicaList,
    MountSegment,
    OkReply,
    PutEnd,
    PutStart,
    ReleaseLeases,
    Remove,
    RemoveByRegex,
    ReplicateConfig,
    SegmentInfo,
)
from kvpool.transports.connection import Reply

PAGE = 4096
NO_ROOM = ErrorCode.NO_AVAILABLE_HANDLE


class FakeNode:
    """A node's connection as the master sees it: acknowledges drops (the first `failing`
    DropObjects time out, as a node slow past the RPC timeout) and commits (with `commit_reply`
    instead of codes, when given: a broken node)."""

    def __init__(self, failing: int = 0, commit_reply=None) -> None:
        self.failing = failing
        self.commit_reply = commit_reply

    def is_write_buffered(self) -> bool:
        # A commit frame still queued here: the put waits for the node's codes (server.py).
        return self.commit_reply is not None

    async def request(self, message, timeout_ms=0):
        await asyncio.sleep(0.001)
        if isinstance(message, DropObjects):
            if self.failing:
                self.failing -= 1
                raise RpcTimeout("DropObjects timed out")
            return OkReply()
        assert isinstance(message, CommitObjects), message
        return self.commit_reply or CodesReply([0] * len(message.entries))


def put_start(keys: list[str]) -> PutStart:
    return PutStart(keys, [PAGE] * len(keys), ReplicateConfig(), "host")


def stored(server: MasterServer, keys: list[str]) -> list[int]:
    """put_start, put_end and commit at once, without waiting for room: the put_start codes."""
    service = server.service
    reply = service.put_start(put_start(keys), wall_clock_ms())
    granted = [key for key, code in zip(keys, reply.codes) if code == ErrorCode.OK]
    if granted:
        pending = service.put_end(PutEnd(granted, [7] * len(granted)), wall_clock_ms())
        service.finish_put_end(pending, {s: [0] * len(e) for s, e in pending.commits.items()}, wall_clock_ms())
    return reply.codes


def empty_server(node: FakeNode | None = None) -> MasterServer:
    """A master (no sockets) with one 8 MiB segment on a fake node."""
    server = MasterServer(MasterConfig(), seed=1)
    info = SegmentInfo("seg", "node", "host", "host:1", "/dev/shm/none", b"t", 8 * limits.MIB)
    server.service.mount_segment(MountSegment(info, []), wall_clock_ms())
    server._node_links["seg"] = _NodeLink(node or FakeNode(), 0)
    return server


def full_server(node: FakeNode | None = None) -> MasterServer:
    """empty_server with its segment full of 4 KiB objects."""
    server = empty_server(node)
    for batch in range(8 * limits.MIB // PAGE // 128):
        assert stored(server, [f"old-{batch}-{i}" for i in range(128)]) == [ErrorCode.OK] * 128
    assert server.service.segment_counters()[0].free_bytes == 0
    return server


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 30))


def test_room_that_lands_goes_to_the_waiting_put_before_any_new_one():
    """Each time the drops of a waiting put's eviction landed, a new put read in the next loop
    iteration took the room, round after round, until the waiting one gave up."""

    async def main():
        server = full_server()
        service, loop = server.service, asyncio.get_running_loop()
        newcomers: list[int] = []
        drops_done = service.drops_done

        def drops_done_then_a_new_put(segment_id, entries, now_ms):
            drops_done(segment_id, entries, now_ms)
            # Another client's put, read by the loop before the waiting put's task resumes.
            loop.call_soon(lambda: newcomers.append(stored(server, [f"new-{len(newcomers)}-{i}" for i in range(128)])))

        service.drops_done = drops_done_then_a_new_put
        waiting = server._put_start(put_start([f"a-{i}" for i in range(128)]))
        assert asyncio.iscoroutine(waiting)  # no room: it waits for its eviction's drops
        reply = await waiting
        assert reply.codes == [ErrorCode.OK] * 128
        assert service.counters.errors == 0
        service.check_invariants()

    run(main())


def test_a_put_during_the_eviction_back_off_waits_it_out_instead_of_failing():
    """A long scan that found too few victims (nearly everything leased) backs eviction off
    for 250 ms; readers give their leases back meanwhile. A put then was refused at once ("no
    room, and none coming") with some 1,900 objects evictable."""
    server = full_server()
    service = server.service
    keys = [key for key, _ in service._table.items()]
    leased = keys[100:]  # a reader holds all but 100
    parts = [leased[:1024], leased[1024:]]
    leases = [service.get_replica_list(GetReplicaList(part), wall_clock_ms()) for part in parts]
    first = put_start([f"x-{i}" for i in range(128)])
    reply = service.put_start(first, wall_clock_ms())
    assert service.evict_back_off_left_ms(wall_clock_ms()) > 0  # the scan fell short
    for segment_id, entries in service.take_drops().items():
        service.drops_done(segment_id, entries, wall_clock_ms())
    service.put_start_again(first, reply, [i for i, c in enumerate(reply.codes) if c == NO_ROOM], wall_clock_ms())
    service.release_leases(
        ReleaseLeases([r.lease_granted_ms for r in leases], list(map(len, parts)), leased), wall_clock_ms()
    )
    waiting = server._put_start(put_start([f"y-{i}" for i in range(8)]))
    assert asyncio.iscoroutine(waiting)  # the back-off ends soon: room may come
    assert run(waiting).codes == [ErrorCode.OK] * 8
    assert service.counters.errors == 0


def test_drops_that_a_node_did_not_acknowledge_are_room_still_coming():
    """A DropObjects that timed out leaves its drops counted as room in flight and kept for the
    next flush; a put short of room counted on that room, evicted nothing, and was refused at
    once as if nothing were evictable."""

    async def main():
        server = full_server(FakeNode(failing=1))
        service = server.service
        service.remove(Remove([key for key, _ in service._table.items()][:128]), wall_clock_ms())
        await asyncio.wait(server._send_drops())  # the node times out: the drops wait for the next flush
        assert server._unsent_drops
        waiting = server._put_start(put_start([f"b-{i}" for i in range(64)]))
        assert asyncio.iscoroutine(waiting)
        settled = await waiting
        assert settled.codes == [ErrorCode.OK] * 64
        # What is left of the grants' life as it answers, after the wait: the writer's bound.
        assert 0 < settled.grant_ttl_ms <= min(g.expiry_ms for g in settled.grants) - wall_clock_ms() + 50

    run(main())


class DropRecordingNode(FakeNode):
    """A FakeNode that records the keys of the drops it acknowledged."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped: list[str] = []

    async def request(self, message, timeout_ms=0):
        reply = await super().request(message, timeout_ms)
        if isinstance(message, DropObjects):
            self.dropped.extend(entry.key for entry in message.entries)
        return reply


@pytest.mark.parametrize("remove", [Remove(["b"]), RemoveByRegex("^b$")], ids=["remove", "remove_by_regex"])
def test_a_remove_read_as_its_segments_drop_task_ends_is_answered_once_its_node_dropped(monkeypatch, remove):
    """A remove whose handler ran after a segment's drop task had sent its last batch, but
    before that task's done callback took it out of _drop_tasks (a client's frame read in the
    same turn of the loop as the node's last acknowledgement): _send_drops took the finished
    task for one still sending and started none, so the remove's drops waited for the next
    tick (200 ms), and the wait for them, woken when the task was taken out, answered the
    remove as done. A leader SIGKILLed in between left the objects on their node, and its
    successor served a removed value again (an HA history run, seed 10: k022 and k023 back
    on a node whose link never broke)."""

    async def main():
        node = DropRecordingNode()
        server = empty_server(node)
        assert stored(server, ["a", "b"]) == [ErrorCode.OK] * 2
        drop = MasterServer._drop
        answers: list[asyncio.Future] = []

        def read_remove() -> None:  # a client's frame, dispatched as the connection does
            result = server.handle(None, remove)
            answers.append(asyncio.ensure_future(result))

        async def drop_then_a_remove_comes(self, service, segment_id, entries):
            await drop(self, service, segment_id, entries)
            if not answers and isinstance(remove, Remove):
                # handled in a callback that runs before the task's done callbacks
                asyncio.get_running_loop().call_soon(read_remove)
            elif not answers:
                # a remove_by_regex is a task: its first step runs before those callbacks
                read_remove()

        monkeypatch.setattr(MasterServer, "_drop", drop_then_a_remove_comes)
        first = server.handle(None, Remove(["a"]))  # its drop task starts at once
        assert asyncio.iscoroutine(first)
        assert (await first).codes == [ErrorCode.OK]
        assert answers, "the remove came as the drop task ended"
        reply = await asyncio.wait_for(answers[0], 5)
        removed = reply.count if isinstance(remove, RemoveByRegex) else reply.codes.count(ErrorCode.OK)
        assert removed == 1
        # Answered as done: the node acknowledged the drop, none waits for a tick.
        assert "b" in node.dropped
        assert not server._unsent_drops.get("seg")

    run(main())


class HeldDfs:
    """A DFS directory as the master's drops use it: its first file removal waits for `go`
    (a slow share), and it records the keys whose files it removed."""

    def __init__(self) -> None:
        self.removed: list[str] = []
        self.go = threading.Event()

    def remove(self, key: str, offset: int) -> bool:
        if not self.removed:
            self.go.wait(5)
        self.removed.append(key)
        return True


def test_a_remove_whose_dfs_drops_wait_behind_another_is_answered_once_their_files_are_gone():
    """The DFS's drop task removed one batch of files and ended: drops that came for it while
    it ran (a second remove) waited for the next tick, and the second remove, woken as the
    task ended, was answered as done with its files still there (a master killed then left
    them to its successor's scan, and the removed keys came back)."""

    async def main():
        server = empty_server()
        assert stored(server, ["a", "b"]) == [ErrorCode.OK] * 2
        dfs = HeldDfs()
        server._dfs = dfs  # the segment stands for the master's DFS tier
        server._dfs_info = SegmentInfo("seg", "dfs", "", "", "/dfs", b"t", 8 * limits.MIB, tier="dfs")
        first = asyncio.ensure_future(server.handle(None, Remove(["a"])))
        await _until_true(lambda: "seg" in server._drop_tasks)
        second = asyncio.ensure_future(server.handle(None, Remove(["b"])))
        await asyncio.sleep(0.05)
        assert not second.done()  # its drop waits behind the first's
        dfs.go.set()
        assert (await asyncio.wait_for(first, 5)).codes == [ErrorCode.OK]
        assert (await asyncio.wait_for(second, 5)).codes == [ErrorCode.OK]
        assert dfs.removed == ["a", "b"]  # both files gone when both removes were answered
        assert not server._unsent_drops.get("seg")

    run(main())


async def _until_true(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "not within the bound"
        await asyncio.sleep(0.01)


def test_room_claimed_by_puts_that_no_longer_wait_is_no_ones():
    """A put short of room claims its shortfall of the drops in flight so that the next one
    evicts for its own. The claim outlived the put: drops a remove scheduled later counted as
    claimed, and the next put short of room evicted 128 objects it did not need."""

    async def main():
        server = full_server()
        service = server.service
        waiting = server._put_start(put_start([f"a-{i}" for i in range(128)]))
        assert (await waiting).codes == [ErrorCode.OK] * 128
        service.remove(Remove([key for key, _ in service._table.items()][:128]), wall_clock_ms())
        evictions = service.counters.evictions
        reply = service.put_start(put_start([f"b-{i}" for i in range(128)]), wall_clock_ms())
        assert reply.codes == [NO_ROOM] * 128  # the remove's drops are still in flight
        assert service.counters.evictions == evictions  # they will do: nothing more evicted

    run(main())


def test_a_tick_that_fails_unexpectedly_does_not_stop_the_next_ones(monkeypatch, caplog):
    """The tick caught only KVPoolError: any other exception ended its task for good, and with
    it evictions at the watermark, node TTLs, zombie discards and quarantine releases."""

    async def main():
        monkeypatch.setattr(server_module, "TICK_INTERVAL_MS", 10)
        server = empty_server()
        ticks = []
        tick = server.service.tick

        def failing_once(now_ms):
            ticks.append(now_ms)
            if len(ticks) == 2:
                raise RuntimeError("a bug in one tick")
            tick(now_ms)

        server.service.tick = failing_once
        task = asyncio.get_running_loop().create_task(server._tick_forever())
        await asyncio.sleep(0.3)
        assert not task.done()
        task.cancel()
        assert len(ticks) > 5

    with caplog.at_level(logging.ERROR, logger="kvpool.master.server"):
        run(main())
    assert "tick failed" in caplog.text


def test_a_node_that_answers_a_commit_with_the_wrong_reply_fails_the_put_not_the_master():
    """A node answering CommitObjects with an OkReply tripped an assertion in the master: the
    put_end was never answered and its keys stayed committing (every put, revoke and forced
    remove of them refused) until the master restarted."""

    async def main():
        server = empty_server(FakeNode(commit_reply=OkReply()))
        service = server.service
        keys = [f"k{i}" for i in range(4)]
        assert service.put_start(put_start(keys), wall_clock_ms()).codes == [ErrorCode.OK] * 4
        reply = await server._put_end(PutEnd(keys, [7] * 4))
        if isinstance(reply, Reply):  # written, then the objects published (Reply.then)
            reply.then()
            reply = reply.message
        codes = reply.codes
        assert codes == [ErrorCode.TRANSFER_FAIL] * 4
        assert service.pending_count == 0
        assert service.put_start(put_start(keys), wall_clock_ms()).codes == [ErrorCode.OK] * 4  # free again

    run(main())


def test_a_stall_of_the_master_itself_does_not_count_against_its_nodes(monkeypatch, caplog):
    """A request that held the master's loop for longer than the node TTL (a pattern that
    backtracked for 26 s) made it drop every node when it woke: their heartbeats had waited
    in its sockets. Its own stall is excused; a node silent on its own is still dropped."""

    async def main():
        monkeypatch.setattr(server_module, "TICK_INTERVAL_MS", 10)
        server = MasterServer(MasterConfig(node_ttl_ms=1_000), seed=1)
        info = SegmentInfo("seg", "node", "host", "host:1", "/dev/shm/none", b"t", 8 * limits.MIB)
        server.service.mount_segment(MountSegment(info, []), wall_clock_ms())
        ticking = asyncio.get_running_loop().create_task(server._tick_forever())
        try:
            await asyncio.sleep(0.05)
            time.sleep(1.5)  # the master's loop held, as by a long request
            await asyncio.sleep(0.05)
            assert server.service.has_segment("seg")
            await asyncio.sleep(1.2)  # now the node is silent on its own
            assert not server.service.has_segment("seg")
        finally:
            ticking.cancel()

    with caplog.at_level(logging.WARNING, logger="kvpool.master.server"):
        run(main())
    assert "did not run for" in caplog.text


def test_a_dfs_that_stops_answering_holds_up_no_tick(monkeypatch, tmp_path):
    """A network filesystem whose server is down blocks every call on it (an NFS hard mount;
    here the master's look at the DFS's free space blocks until released). That look, awaited
    by the tick, held node TTLs, eviction and zombie discards for as long. Now it runs on its
    own: a silent node is still dropped after its TTL, so is the DFS, silent too, and once the
    DFS answers again it is mounted again from a scan of its files."""
    answering = threading.Event()
    real_report = server_module.files.filesystem_report

    def hung_report(path):
        answering.wait(10)
        return real_report(path)

    async def main():
        monkeypatch.setattr(server_module, "TICK_INTERVAL_MS", 10)
        dfs_dir = str(tmp_path / "dfs")
        server = MasterServer(MasterConfig(node_ttl_ms=1_000), seed=1, dfs_dir=dfs_dir, dfs_bytes=limits.GIB)
        await server._open_dfs()
        await server._ensure_dfs()
        dfs_id = server._dfs_info.segment_id
        info = SegmentInfo("seg", "node", "host", "host:1", "/dev/shm/none", b"t", 8 * limits.MIB)
        server.service.mount_segment(MountSegment(info, []), wall_clock_ms())
        monkeypatch.setattr(server_module.files, "filesystem_report", hung_report)
        ticking = asyncio.get_running_loop().create_task(server._tick_forever())
        try:
            await asyncio.sleep(1.5)
            assert not server.service.has_segment("seg")  # the node's TTL went on
            assert not server.service.has_segment(dfs_id)  # and the DFS's
            answering.set()
            for _ in range(100):
                await asyncio.sleep(0.02)
                if server.service.has_segment(dfs_id):
                    break
            assert server.service.has_segment(dfs_id)
        finally:
            answering.set()
            ticking.cancel()
            await server.stop()

    run(main())


def test_another_peers_heartbeat_does_not_take_a_nodes_segment_link():
    """Any authenticated peer could send a Heartbeat naming a node's segment: the master bound
    that segment to the peer's connection, sent it the node's drops, took its acknowledgement
    and reused ranges the node still held (every later put there failed). Only a mount binds
    a segment: a heartbeat counts for the segments bound to its own connection (and those the
    master does not know, which the reply has the node mount). A peer's heartbeat took a
    segment whose link had closed, then kept the node's own mount refused."""
    from kvpool.errors import InvalidRequest
    from kvpool.protocol.messages import Heartbeat, MountSegment, SegmentInfo, UnmountSegment

    class Peer:
        def __init__(self) -> None:
            self.closed = False

        def is_closed(self) -> bool:
            return self.closed

    server = empty_server()
    info = SegmentInfo("own", "node-1", "host", "127.0.0.1:1", "", b"t-own", 1 << 20)
    node_link, rogue = Peer(), Peer()
    server._dispatch(node_link, MountSegment(info, [], True))
    assert server._node_links["own"].conn is node_link
    server._dispatch(rogue, Heartbeat(["own"]))
    assert server._node_links["own"].conn is node_link
    node_link.closed = True  # the node's link breaks: a heartbeat of another peer takes nothing
    server.connection_closed(node_link)
    assert server._dispatch(rogue, Heartbeat(["own"])).unknown_segment_ids == []
    assert "own" not in server._node_links
    reconnected = Peer()
    server._dispatch(reconnected, MountSegment(info, [], True))  # the node's own mount binds it
    assert server._node_links["own"].conn is reconnected
    server._dispatch(rogue, Heartbeat(["own"]))
    with pytest.raises(InvalidRequest, match="served by another connection"):
        server._dispatch(rogue, UnmountSegment("own"))
    assert server._node_links["own"].conn is reconnected


def test_the_master_raises_its_open_files_limit_as_a_node_does(caplog):
    """Every client process and node holds a connection, a descriptor each: at the usual soft
    limit of 1,024 the thousandth client was refused ("connection closed by peer")."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = len(os.listdir("/proc/self/fd")) + 512  # room for this test's own
    if hard == resource.RLIM_INFINITY or hard <= low:
        pytest.skip(f"hard limit {hard}: nothing to raise to")

    async def main() -> None:
        server = MasterServer(host="127.0.0.1", port=0, http_port=None)
        await server.start()
        try:
            assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
        finally:
            await server.stop()

    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        with caplog.at_level(logging.INFO, logger="kvpool.master.server"):
            run(main())
        assert f"open files limit {hard}" in caplog.text
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
