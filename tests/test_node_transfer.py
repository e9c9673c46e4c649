"""The storage node end to end: kvpool/node/server.py, transfer.py and metrics.py over real TCP.

How: each test runs one asyncio loop (`asyncio.run` under `asyncio.wait_for`, so every test is
bounded in time) holding a real `Node` on 127.0.0.1 with an ephemeral port and a segment file in
pytest's tmp_path, a tiny fake master (a RequestHandler served with start_server that answers
MountSegment and Heartbeat, records every call, and calls CommitObjects / DropObjects back on the
node's own connection), and clients that are plain `connect()`ed Connections. Malformed input is
sent over raw asyncio streams after a hand-made handshake. Every test checks the segment file is
gone after stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import resource
import signal
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import xxhash
from conftest import python_child, sealed_by_hand, segment_owner
from prometheus_client.parser import text_string_to_metric_families

from kvpool import limits
from kvpool.config import NodeConfig
from kvpool.errors import (
    ConnectFailed,
    ErrorCode,
    InvalidParams,
    RpcFailed,
    SegmentNotFound,
    Unauthorized,
)
from kvpool.node import server as node_server
from kvpool.node.clock import CLOCK_OFFSET_SAMPLES_MAX, MasterClock, wall_clock_ms
from kvpool.node.segment import Segment, remove_stale_segments
from kvpool.node.server import Node, NodeState
from kvpool.protocol import auth
from kvpool.protocol.frames import NEED_DATA, Frame, FrameDecoder, FrameSeal, encode_frame, payload_tag
from kvpool.protocol.messages import (
    AuthChallenge,
    AuthResponse,
    CodesReply,
    CommitObjects,
    DrainSegment,
    DropObjects,
    ErrorReply,
    Heartbeat,
    HeartbeatReply,
    InventoryEntry,
    Message,
    MountReply,
    MountSegment,
    OkReply,
    ReadItem,
    ReadReply,
    ReadSlices,
    UnmountSegment,
    VerifyObjects,
    WriteGrant,
    WriteItem,
    WriteSlices,
)
from kvpool.transports.connection import Connection, connect, is_loopback, start_server

TOKEN = "test-cluster-token"
KEY = auth.cluster_key(TOKEN)
MEMORY_BYTES = 1 * limits.MIB
TEST_TIMEOUT_S = 20


def run(main: Callable[[], Awaitable[None]], timeout_s: float = TEST_TIMEOUT_S) -> None:
    asyncio.run(asyncio.wait_for(main(), timeout_s))


async def until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll `predicate` every 10 ms; fail the test after timeout_s."""
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"condition not met within {timeout_s} s")


class FakeMaster:
    """Just enough master for a node: mounts, heartbeats, and calls back on the node's link."""

    def __init__(self, key: bytes | None = KEY) -> None:
        self.key = key
        self.calls: list[Message] = []
        self.mounts: list[MountSegment] = []
        self.conns: list[Connection] = []
        self.node_conn: Connection | None = None
        self.unknown = False  # Answer heartbeats with "unknown segment" (a restarted master).
        self.rejected: list[InventoryEntry] = []  # What the next MountReply rejects.
        self.term = 0  # The master term MountReply names (0: none).
        self.server: asyncio.Server | None = None
        self.port = 0

    def payload_sinks(self, conn: Connection, message: Message) -> None:
        return None

    def handle(self, conn: Connection, message: Message) -> Message:
        self.calls.append(message)
        if conn not in self.conns:
            self.conns.append(conn)
        if isinstance(message, MountSegment):
            self.mounts.append(message)
            self.node_conn = conn
            self.unknown = False
            rejected, self.rejected = self.rejected, []
            return MountReply(rejected, self.term)
        if isinstance(message, Heartbeat):
            return HeartbeatReply(list(message.segment_ids) if self.unknown else [])
        if isinstance(message, (UnmountSegment, DrainSegment)):
            return OkReply()
        raise InvalidParams(f"fake master does not do {type(message).__name__}")

    def connection_closed(self, conn: Connection) -> None:
        pass

    def of_type(self, cls: type) -> list[Any]:
        return [m for m in self.calls if isinstance(m, cls)]

    async def start(self, port: int = 0) -> None:
        keyring = auth.Keyring([self.key] if self.key else [])
        self.server = await start_server("127.0.0.1", port, self, keyring=keyring, name="fake master")
        self.port = self.server.port

    async def stop(self) -> None:
        assert self.server is not None
        await self.server.close()
        self.conns.clear()

    async def commit(
        self, segment_id: str, entries: list[InventoryEntry], is_hashed_in_place: bool = False
    ) -> list[int]:
        assert self.node_conn is not None
        message = CommitObjects(segment_id, entries, is_hashed_in_place)
        reply = await self.node_conn.request(message, timeout_ms=2_000)
        assert isinstance(reply, CodesReply)
        return reply.codes

    async def drop(self, segment_id: str, entries: list[InventoryEntry]) -> None:
        assert self.node_conn is not None
        reply = await self.node_conn.request(DropObjects(segment_id, entries), timeout_ms=2_000)
        assert isinstance(reply, OkReply)


def node_config(
    shm_dir: Path, master_port: int, token: str | None = TOKEN, **options: Any
) -> NodeConfig:
    options.setdefault("heartbeat_interval_ms", 50)
    options.setdefault("rpc_timeout_ms", 1_000)
    options.setdefault("connect_timeout_ms", 500)
    return NodeConfig(
        master_endpoint=f"127.0.0.1:{master_port}", memory_bytes=MEMORY_BYTES, shm_dir=str(shm_dir),
        token=token, **options,
    )  # fmt: skip


def segment_files(shm_dir: Path) -> list[Path]:
    return list(shm_dir.glob("kvpool-*.seg"))


@contextlib.asynccontextmanager
async def cluster(
    shm_dir: Path, token: str | None = TOKEN, **options: Any
) -> AsyncIterator[tuple[FakeMaster, Node]]:
    master = FakeMaster(auth.cluster_key(token) if token else None)
    await master.start()
    node = Node(node_config(shm_dir, master.port, token, **options))
    await node.start()
    try:
        assert node.is_mounted, node
        yield master, node
    finally:
        await node.stop()
        await master.stop()
        assert node.state is NodeState.STOPPED
        assert segment_files(shm_dir) == []


def grant_for(node: Node, offset: int, size: int, *, key: bytes | None = KEY,
              expiry_ms: int | None = None, segment_id: str | None = None, term: int = 0) -> WriteGrant:  # fmt: skip
    expiry = wall_clock_ms() + 60_000 if expiry_ms is None else expiry_ms
    return auth.sign_grant(key, segment_id or node.segment_id, offset, size, expiry, term)


async def write(conn: Connection, grant: WriteGrant, data: bytes, start: int = 0) -> list[int]:
    reply = await conn.request(WriteSlices([WriteItem(grant, start, len(data))]), [data],
                               timeout_ms=2_000)  # fmt: skip
    assert isinstance(reply, CodesReply)
    return reply.codes


async def read(conn: Connection, segment_id: str, offset: int, size: int) -> bytes:
    buffer = bytearray(size)
    reply = await conn.request(
        ReadSlices([ReadItem(segment_id, offset, size)]),
        reply_sinks=lambda message: [memoryview(buffer)],
        timeout_ms=2_000,
    )
    assert isinstance(reply, ReadReply) and reply.size == size
    return bytes(buffer)


def entry(key: str, offset: int, data: bytes) -> InventoryEntry:
    return InventoryEntry(key, offset, len(data), xxhash.xxh3_64_intdigest(data))


async def put(
    master: FakeMaster, node: Node, conn: Connection, key: str, offset: int, data: bytes
) -> None:
    """What a client and the master do for one replica: grant, write, commit."""
    assert await write(conn, grant_for(node, offset, len(data)), data) == [0]
    assert await master.commit(node.segment_id, [entry(key, offset, data)]) == [0]


# --- raw sockets for malformed input ------------------------------------------------------------


async def read_frame(reader: asyncio.StreamReader, decoder: FrameDecoder | None = None) -> Frame:
    """The next frame (of a handshake when no `decoder` carries the connection's state)."""
    decoder = decoder or FrameDecoder()
    while True:
        event = decoder.next_event()
        if event is not NEED_DATA:
            assert isinstance(event, Frame)
            return event
        data = await asyncio.wait_for(reader.read(4096), 2)
        assert data, "connection closed"
        decoder.receive_data(data)


class RawPeer:
    """A raw connection past the handshake, ready to send anything: `frame` and `sealed` make
    a frame this connection's next (its tag, with a key), `read_frame` reads the replies."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seals) -> None:
        self.reader, self.writer = reader, writer
        self._seal, incoming = seals or (None, None)
        self._decoder = FrameDecoder()
        if incoming is not None:
            self._decoder.expect_seal(incoming)

    def frame(self, message, request_id: int, **options) -> bytes:
        return encode_frame(message, request_id, seal=self._seal, **options)

    def sealed(self, frame: bytes) -> bytes:
        return sealed_by_hand(self._seal, frame)

    def payload_mac(self):
        """The MAC of the payload of the frame `frame` made last."""
        assert self._seal is not None
        return self._seal.payload_mac()

    async def read_frame(self) -> Frame:
        return await read_frame(self.reader, self._decoder)


async def raw_connect(endpoint: str, key: bytes | None = KEY) -> RawPeer:
    host, port = endpoint.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    challenge = (await read_frame(reader)).message
    assert isinstance(challenge, AuthChallenge)
    nonce = os.urandom(limits.AUTH_NONCE_SIZE_BYTES)
    mac = auth.client_proof(key, challenge.nonce, nonce) if key else b""
    writer.write(encode_frame(AuthResponse(nonce, mac), 0))
    await read_frame(reader)  # AuthOk
    return RawPeer(reader, writer, key and auth.frame_seals(key, challenge.nonce, nonce, is_server=False))


async def is_closed_by_peer(reader: asyncio.StreamReader, timeout_s: float = 3.0) -> bool:
    try:
        while True:
            data = await asyncio.wait_for(reader.read(65536), timeout_s)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except asyncio.TimeoutError:
        return False


def header(control_size: int, payload_size: int = 0, *, flags: int = 0, magic: int = limits.FRAME_MAGIC,
           version: int = limits.FRAME_VERSION) -> bytes:  # fmt: skip
    return struct.pack(limits.FRAME_HEADER_FMT, magic, version, flags, 7, control_size, payload_size)


# --- tests --------------------------------------------------------------------------------------


def test_write_commit_read_roundtrip(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path) as (master, node):
            info = node.segment_info
            assert master.mounts[0].segment == info and master.mounts[0].inventory == []
            assert info.endpoint == node.endpoint and info.capacity_bytes == MEMORY_BYTES
            # The shm path is real: a same-host client maps it and sees the written bytes.
            mapped = Segment.open_mapped(info.shm_path, info.shm_token)
            conn = await connect(node.endpoint, key=KEY, name="client")
            data = os.urandom(10_000)
            # One grant, two slices in one frame: the payload lands straight in the segment.
            grant = grant_for(node, 4096, len(data))
            items = [WriteItem(grant, 0, 6_000), WriteItem(grant, 6_000, 4_000)]
            reply = await conn.request(WriteSlices(items), [data[:6_000], data[6_000:]])
            assert isinstance(reply, CodesReply) and reply.codes == [0, 0]
            assert await master.commit(node.segment_id, [entry("obj", 4096, data)]) == [0]
            assert node.inventory.entries() == [entry("obj", 4096, data)]
            node.inventory.check_invariants()
            assert await read(conn, node.segment_id, 4096, len(data)) == data
            assert bytes(mapped.data[4096 : 4096 + len(data)]) == data
            mapped.close()
            # Several ranges in one read come back concatenated, in item order.
            buffer = bytearray(300)
            reply = await conn.request(
                ReadSlices([ReadItem(node.segment_id, 4096 + 100, 200),
                            ReadItem(node.segment_id, 4096, 100)]),
                reply_sinks=lambda m: [memoryview(buffer)],
            )  # fmt: skip
            assert bytes(buffer) == data[100:300] + data[:100]
            metrics = node.metrics.render().decode()
            assert "kvpool_node_write_bytes_total 10000.0" in metrics
            assert "kvpool_node_read_bytes_total 10300.0" in metrics
            assert "kvpool_node_segment_used_bytes 10000.0" in metrics
            assert "kvpool_node_objects 1.0" in metrics
            conn.close()

    run(main)


def test_a_run_of_small_objects_lands_in_one_view_and_every_slice_in_its_place(tmp_path: Path) -> None:
    """Items that follow each other in the segment (the keys of a run) are received into one
    view; items out of order or with gaps between them each get theirs."""

    async def main() -> None:
        async with cluster(tmp_path) as (_, node):
            conn = await connect(node.endpoint, key=KEY, name="client")
            sinks_given: list[int] = []
            real_sinks_for = node._transfer._sinks_for

            def recording_sinks_for(message):
                sinks = real_sinks_for(message)
                sinks_given.append(len(sinks))
                return sinks

            node._transfer._sinks_for = recording_sinks_for  # type: ignore[method-assign]
            run_grant = grant_for(node, 0, 128 * 4096)
            objects = [os.urandom(4096) for _ in range(128)]
            items = [WriteItem(run_grant, i * 4096, 4096) for i in range(128)]
            reply = await conn.request(WriteSlices(items), objects)
            assert isinstance(reply, CodesReply) and reply.codes == [0] * 128
            # Out of order, and with a gap: three views, each slice where its item says.
            other = grant_for(node, 600 * 1024, 3 * 4096)
            parts = [os.urandom(4096), os.urandom(100), os.urandom(4096)]
            items = [WriteItem(other, 2 * 4096, 4096), WriteItem(other, 4096, 100), WriteItem(other, 0, 4096)]
            reply = await conn.request(WriteSlices(items), parts)
            assert isinstance(reply, CodesReply) and reply.codes == [0, 0, 0]
            assert sinks_given == [1, 3]
            assert await read(conn, node.segment_id, 0, 128 * 4096) == b"".join(objects)
            assert await read(conn, node.segment_id, 600 * 1024, 4096) == parts[2]
            assert await read(conn, node.segment_id, 600 * 1024 + 4096, 100) == parts[1]
            assert await read(conn, node.segment_id, 600 * 1024 + 2 * 4096, 4096) == parts[0]
            conn.close()

    run(main)


def test_forged_expired_and_misrouted_grants_are_refused(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path) as (master, node):
            conn = await connect(node.endpoint, key=KEY, name="client")
            data = b"\xab" * 4096
            other_key = auth.cluster_key("another cluster")
            forged = [
                grant_for(node, 0, 4096, key=other_key),
                grant_for(node, 0, 4096, key=None),  # unsigned, on a cluster with a key
                grant_for(node, 0, 4096, expiry_ms=wall_clock_ms() - 1),  # expired
            ]
            real = grant_for(node, 0, 4096)
            forged.append(WriteGrant(real.segment_id, 0, 8192, real.expiry_ms, real.mac))  # widened
            for grant in forged:
                with pytest.raises(Unauthorized):
                    await write(conn, grant, data)
            with pytest.raises(SegmentNotFound):
                await write(conn, grant_for(node, 0, 4096, segment_id="elsewhere"), data)
            # The payloads were discarded: not one byte landed, and the connection still works.
            assert await read(conn, node.segment_id, 0, 4096) == bytes(4096)
            # One bad item fails the whole frame before any byte is read.
            items = [WriteItem(grant_for(node, 0, 4096), 0, 4096), WriteItem(forged[0], 0, 4096)]
            with pytest.raises(Unauthorized):
                await conn.request(WriteSlices(items), [data, data])
            assert await read(conn, node.segment_id, 0, 4096) == bytes(4096)
            # A valid grant over a committed object is stale: the object stays intact.
            await put(master, node, conn, "kept", 8192, b"\x01" * 512)
            with pytest.raises(Unauthorized):
                await write(conn, grant_for(node, 8000, 1024), b"\x02" * 1024)
            assert await read(conn, node.segment_id, 8192, 512) == b"\x01" * 512
            metrics = node.metrics.render().decode()
            assert 'kvpool_node_errors_total{code="ILLEGAL_CLIENT"} 6.0' in metrics
            conn.close()

    run(main)


def test_out_of_range_requests_get_invalid_params_and_others_keep_working(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path) as (master, node):
            bad = await connect(node.endpoint, key=KEY, name="bad client")
            good = await connect(node.endpoint, key=KEY, name="good client")
            await put(master, node, good, "a", 0, b"A" * 1000)
            cap = node.segment.capacity_bytes
            sid = node.segment_id
            writes = [
                (grant_for(node, 4096, 100), 50, 100),  # slice runs past the grant
                (grant_for(node, 2048, 100), -1, 10),  # negative start
                (grant_for(node, cap - 100, 200), 0, 100),  # grant past the segment
                (grant_for(node, -64, 128), 64, 64),  # grant before the segment
            ]
            for grant, start, size in writes:
                with pytest.raises(InvalidParams):
                    await bad.request(WriteSlices([WriteItem(grant, start, size)]), [bytes(size)])
            with pytest.raises(InvalidParams):  # an empty slice, with no payload at all
                await bad.request(WriteSlices([WriteItem(grant_for(node, 2048, 100), 0, 0)]))
            reads = [(cap - 10, 11), (-1, 10), (0, 0), (cap, 1), (0, cap + 1)]
            for offset, size in reads:
                with pytest.raises(InvalidParams):
                    await bad.request(ReadSlices([ReadItem(sid, offset, size)]))
            with pytest.raises(SegmentNotFound):
                await bad.request(ReadSlices([ReadItem("nope", 0, 10)]))
            # More than one frame's payload in one read.
            count = limits.FRAME_PAYLOAD_SIZE_BYTES_MAX // cap + 1
            with pytest.raises(InvalidParams):
                await bad.request(ReadSlices([ReadItem(sid, 0, cap)] * count))
            # A request kind the transfer server does not serve.
            with pytest.raises(InvalidParams):
                await bad.request(Heartbeat([sid]))
            assert await bad.request(WriteSlices([])) == CodesReply([])
            assert await read(bad, sid, 0, 1000) == b"A" * 1000
            assert await read(good, sid, 0, 1000) == b"A" * 1000
            assert node.inventory.entries() == [entry("a", 0, b"A" * 1000)]
            bad.close()
            good.close()

    run(main)


def test_commit_verifies_checksum_and_bounds_and_drop_forgets(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path) as (master, node):
            conn = await connect(node.endpoint, key=KEY, name="client")
            sid = node.segment_id
            one, two = os.urandom(700), os.urandom(900)
            assert await write(conn, grant_for(node, 0, 700), one) == [0]
            assert await write(conn, grant_for(node, 1024, 900), two) == [0]
            wrong = InventoryEntry("bad", 1024, 900, xxhash.xxh3_64_intdigest(two) ^ 1)
            outside = InventoryEntry("out", node.segment.capacity_bytes - 10, 20, 0)
            codes = await master.commit(sid, [entry("one", 0, one), wrong, outside])
            assert codes == [ErrorCode.OK, ErrorCode.TRANSFER_FAIL, ErrorCode.INVALID_PARAMS]
            assert [x.key for x in node.inventory.entries()] == ["one"]
            # Committing more bytes than were written fails too: length is part of the check.
            longer = InventoryEntry("two", 1024, 901, xxhash.xxh3_64_intdigest(two))
            assert await master.commit(sid, [longer]) == [ErrorCode.TRANSFER_FAIL]
            assert await master.commit(sid, [entry("two", 1024, two)]) == [0]
            assert len(node.inventory) == 2
            # A commit for another segment is refused whole.
            with pytest.raises(SegmentNotFound):
                await master.commit("elsewhere", [entry("one", 0, one)])
            # Drops match key and offset; unknown entries are ignored.
            await master.drop(sid, [entry("one", 0, one), InventoryEntry("zz", 5, 5, 0),
                                    InventoryEntry("two", 0, 900, 0)])  # fmt: skip
            assert [x.key for x in node.inventory.entries()] == ["two"]
            await master.drop(sid, [entry("two", 1024, two)])
            assert len(node.inventory) == 0 and node.inventory.used_bytes == 0
            # The range is free again: a fresh grant may overwrite it now.
            assert await write(conn, grant_for(node, 1024, 900), one + one[:200]) == [0]
            metrics = node.metrics.render().decode()
            assert 'kvpool_node_commits_total{result="checksum"} 2.0' in metrics
            conn.close()

    run(main)


def test_a_commit_hashed_in_place_by_its_writer_is_recorded_without_hashing(tmp_path: Path) -> None:
    """PutEnd.hashed_in_place: the writer copied through the mapping and hashed the bytes
    there, so the node takes its checksum (readers verify every read); bounds still hold."""
    async def main() -> None:
        async with cluster(tmp_path) as (master, node):
            sid = node.segment_id
            data = os.urandom(700)
            node.segment.data[0:700] = data  # as a same-host writer copies
            claimed = InventoryEntry("k", 0, 700, xxhash.xxh3_64_intdigest(data) ^ 1)
            assert await master.commit(sid, [claimed]) == [ErrorCode.TRANSFER_FAIL]  # hashed
            outside = InventoryEntry("out", node.segment.capacity_bytes - 10, 20, 0)
            codes = await master.commit(sid, [claimed, outside], is_hashed_in_place=True)
            assert codes == [ErrorCode.OK, ErrorCode.INVALID_PARAMS]
            assert [(x.key, x.checksum) for x in node.inventory.entries()] == [("k", claimed.checksum)]

    run(main)


def test_verify_hashes_what_the_inventory_holds_at_that_key_and_offset(tmp_path: Path) -> None:
    """VerifyObjects (a reader's report, passed on by the master): OK for intact bytes,
    TRANSFER_FAIL for bytes that changed after the commit, OBJECT_NOT_FOUND for an entry the
    inventory does not hold there; nothing is dropped by the node itself."""
    async def main():
        async with cluster(tmp_path) as (master, node):
            sid = node.segment_id
            data = os.urandom(700)
            node.segment.data[0:700] = data
            assert await master.commit(sid, [entry("k", 0, data)]) == [ErrorCode.OK]
            ask = [entry("k", 0, data), InventoryEntry("k", 4096, 700, 0), InventoryEntry("nope", 0, 700, 0)]
            reply = await master.node_conn.request(VerifyObjects(sid, ask), timeout_ms=2_000)
            assert reply.codes == [ErrorCode.OK, ErrorCode.OBJECT_NOT_FOUND, ErrorCode.OBJECT_NOT_FOUND]
            node.segment.data[5] ^= 1
            reply = await master.node_conn.request(VerifyObjects(sid, ask[:1]), timeout_ms=2_000)
            assert reply.codes == [ErrorCode.TRANSFER_FAIL]
            assert [x.key for x in node.inventory.entries()] == ["k"]  # the master decides
            with pytest.raises(SegmentNotFound):
                await master.node_conn.request(VerifyObjects("elsewhere", ask[:1]), timeout_ms=2_000)

    run(main)


def test_malformed_frames_close_only_that_connection(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path) as (master, node):
            good = await connect(node.endpoint, key=KEY, name="good client")
            stored = os.urandom(5000)
            await put(master, node, good, "stored", 0, stored)
            sid = node.segment_id
            free_grant = grant_for(node, 8192, 100)
            body = msgspec.msgpack.encode([99, "what"])  # an unknown message tag
            # Each attack is its connection's next frame, sealed where it must get past the tag.
            attacks: dict[str, Callable[[RawPeer], bytes]] = {
                "random bytes": lambda peer: os.urandom(4096),
                "bad magic": lambda peer: header(0, magic=0x1234),
                "bad version": lambda peer: header(0, version=99),
                "unknown flags": lambda peer: header(0, flags=0x80),
                "huge control size": lambda peer: header(limits.FRAME_CONTROL_SIZE_BYTES_MAX + 1),
                "huge payload size": lambda peer: header(10, limits.FRAME_PAYLOAD_SIZE_BYTES_MAX + 1),
                "no tag": lambda peer: encode_frame(ReadSlices([]), 3),
                "a tag of another key": lambda peer: encode_frame(ReadSlices([]), 3, seal=FrameSeal(os.urandom(32))),
                "undecodable control": lambda peer: peer.sealed(header(5) + b"\xc1" * 5),
                "unknown message tag": lambda peer: peer.sealed(header(len(body)) + body),
                "reply flag on a request": lambda peer: peer.sealed(
                    encode_frame(ReadSlices([]), 3)[:2] + b"\x01\x01" + encode_frame(ReadSlices([]), 3)[4:]
                ),
                "second handshake": lambda peer: peer.frame(AuthResponse(b"x", b"y"), 0),
            }
            # A payload whose size differs from its items is refused with a reply; the payload
            # is discarded and the connection stays usable.
            peer = await raw_connect(node.endpoint)
            short_write = peer.frame(WriteSlices([WriteItem(free_grant, 0, 100)]), 3, payload_size=50)
            peer.writer.write(short_write + bytes(50) + payload_tag(peer.payload_mac(), [bytes(50)]))
            refusal = await peer.read_frame()
            assert isinstance(refusal.message, ErrorReply), refusal
            assert refusal.message.code == ErrorCode.INVALID_PARAMS
            peer.writer.write(peer.frame(ReadSlices([ReadItem(sid, 0, len(stored))]), 4))
            reply = await peer.read_frame()
            assert isinstance(reply.message, ReadReply)
            peer.writer.close()
            assert bytes(node.segment.data[8192 : 8192 + 100]) == bytes(100)
            for name, attack in attacks.items():
                peer = await raw_connect(node.endpoint)
                peer.writer.write(attack(peer))
                assert await is_closed_by_peer(peer.reader), name
                peer.writer.close()
                # The server keeps serving everyone else, and nothing it stores changed.
                assert await read(good, sid, 0, len(stored)) == stored, name
            # Garbage instead of a handshake.
            host, port = node.endpoint.rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(os.urandom(100))
            assert await is_closed_by_peer(reader)
            writer.close()
            # A frame cut short by the peer hanging up.
            peer = await raw_connect(node.endpoint)
            frame = peer.frame(ReadSlices([ReadItem(sid, 0, 10)]), 5)
            peer.writer.write(frame[: len(frame) - 3])
            peer.writer.write_eof()
            assert await is_closed_by_peer(peer.reader)
            peer.writer.close()
            # A truncated frame that just sits there holds only its own connection.
            peer = await raw_connect(node.endpoint)
            peer.writer.write(frame[:10])
            await peer.writer.drain()
            assert await read(good, sid, 0, len(stored)) == stored
            peer.writer.close()
            assert bytes(node.segment.data[8192 : 8192 + 100]) == bytes(100)
            assert node.inventory.entries() == [entry("stored", 0, stored)]
            good.close()

    run(main)


def test_a_write_whose_payload_was_changed_on_the_way_is_never_answered(tmp_path: Path) -> None:
    """A relay that changes a write's payload (its frame's tag does not cover it, and xxh3
    checksums can be forged to match): the payload's own tag fails, and the node closes the
    connection without answering the write, so its writer revokes the put rather than commit
    it (a put_end follows only writes answered OK); the same write unchanged is taken."""

    async def main() -> None:
        async with cluster(tmp_path) as (master, node):
            data = os.urandom(70_000)
            changed = bytearray(data)
            changed[1234] ^= 0x01
            for payload, offset in ((bytes(changed), 0), (data, 131_072)):
                peer = await raw_connect(node.endpoint)
                grant = grant_for(node, offset, len(data))
                write = peer.frame(WriteSlices([WriteItem(grant, 0, len(data))]), 3, payload_size=len(data))
                tag = payload_tag(peer.payload_mac(), [data])  # made by the writer, over what it wrote
                peer.writer.write(write + payload + tag)
                if payload is data:
                    reply = await peer.read_frame()
                    assert isinstance(reply.message, CodesReply) and reply.message.codes == [0], reply
                else:
                    assert await is_closed_by_peer(peer.reader)
                peer.writer.close()
            assert await master.commit(node.segment_id, [entry("taken", 131_072, data)]) == [0]
            reader = await connect(node.endpoint, key=KEY)
            assert await read(reader, node.segment_id, 131_072, len(data)) == data
            reader.close()

    run(main)


def test_a_frame_left_half_sent_closes_its_connection_at_the_frame_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer that sent part of a large control message and stalled held that buffer (up to
    64 MiB a connection) until it hung up. A frame must now be complete within
    FRAME_RECEIVE_TIMEOUT_MS of its first bytes, however slowly they trickle in, and whether
    or not the peer reads its replies; frames that each come in time are served, and so is
    everyone else."""
    monkeypatch.setattr(limits, "FRAME_RECEIVE_TIMEOUT_MS", 1_500)

    async def main() -> None:
        async with cluster(tmp_path) as (master, node):
            loop = asyncio.get_running_loop()
            good = await connect(node.endpoint, key=KEY, name="good client")
            stored = os.urandom(5000)
            await put(master, node, good, "stored", 0, stored)
            sid = node.segment_id
            # Half of a 1 MiB control message, then silence.
            peer = await raw_connect(node.endpoint)
            peer.writer.write(header(limits.MIB) + bytes(limits.MIB // 2))
            await peer.writer.drain()
            started_s = loop.time()
            assert await is_closed_by_peer(peer.reader, timeout_s=6)
            assert 1.3 < loop.time() - started_s < 5
            peer.writer.close()
            # A byte every 100 ms: bytes keep coming, the frame never completes in time.
            peer = await raw_connect(node.endpoint)
            request = peer.frame(ReadSlices([]), 5)  # its reply has no payload to skip
            assert len(request) > 20
            closed = asyncio.ensure_future(is_closed_by_peer(peer.reader, timeout_s=6))
            started_s = loop.time()
            with contextlib.suppress(ConnectionError):
                for byte in request[:-1]:
                    if closed.done():
                        break
                    peer.writer.write(bytes([byte]))
                    await asyncio.sleep(0.1)
            assert await closed
            assert loop.time() - started_s < 2.5
            peer.writer.close()
            # Replies left unread until the node stops reading (its buffers full), then half a
            # frame: stalled both ways, it is closed all the same.
            peer = await raw_connect(node.endpoint)
            local = "%s:%d" % peer.writer.get_extra_info("sockname")[:2]
            assert node._server is not None
            (conn,) = [c for c in node._server.connections if c.peer == local]
            reads = b"".join(peer.frame(ReadSlices([ReadItem(sid, 0, len(stored))]), 6) for _ in range(4_000))
            peer.writer.write(reads + header(limits.MIB) + bytes(1_000))  # 20 MB of replies
            await until(conn.is_closed, timeout_s=8)
            assert conn.close_reason.startswith("frame not complete within 1500 ms"), conn.close_reason
            peer.writer.close()
            # Two requests, each sent in halves a second apart: each in time, together not.
            peer = await raw_connect(node.endpoint)
            for _ in range(2):
                request = peer.frame(ReadSlices([]), 5)
                peer.writer.write(request[:10])
                await asyncio.sleep(1.0)
                peer.writer.write(request[10:])
                reply = await peer.read_frame()
                assert isinstance(reply.message, ReadReply), reply
            peer.writer.close()
            assert await read(good, sid, 0, len(stored)) == stored
            good.close()

    run(main)


def test_wrong_cluster_token_is_rejected(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path) as (master, node):
            with pytest.raises((ConnectFailed, Unauthorized)):
                await connect(node.endpoint, key=auth.cluster_key("wrong"), timeout_ms=1_000)
            with pytest.raises(Unauthorized):
                await connect(node.endpoint, key=None, timeout_ms=1_000)
            conn = await connect(node.endpoint, key=KEY)
            assert await read(conn, node.segment_id, 0, 10) == bytes(10)
            conn.close()
            # A node with the wrong token never mounts, but starts and serves its own clients.
            other = Node(node_config(tmp_path, master.port, "wrong token"))
            await other.start()
            assert not other.is_mounted
            assert [m.segment.segment_id for m in master.mounts] == [node.segment_id]
            wrong_key = auth.cluster_key("wrong token")
            conn = await connect(other.endpoint, key=wrong_key)
            assert await read(conn, other.segment_id, 0, 10) == bytes(10)
            conn.close()
            await other.stop()

    run(main)


def test_node_remounts_when_master_forgets_its_segment(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path) as (master, node):
            conn = await connect(node.endpoint, key=KEY)
            data = os.urandom(3000)
            await put(master, node, conn, "survivor", 64, data)
            await put(master, node, conn, "refused", 8192, b"r" * 100)
            assert len(master.mounts) == 1
            master.unknown = True  # The master restarted behind the same connection.
            master.rejected = [entry("refused", 8192, b"r" * 100)]
            await until(lambda: len(master.mounts) == 2)
            remount = master.mounts[1]
            assert remount.segment == node.segment_info
            refused = entry("refused", 8192, b"r" * 100)
            assert remount.inventory == [entry("survivor", 64, data), refused]
            # What the master rejected is dropped from the node's inventory.
            await until(lambda: len(node.inventory) == 1)
            assert node.inventory.entries() == [entry("survivor", 64, data)]
            assert node.is_mounted
            conn.close()

    run(main)


def test_large_inventory_remounts_in_several_frames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(node_server, "_MOUNT_ENTRIES_MAX", 2)

    async def main() -> None:
        async with cluster(tmp_path) as (master, node):
            conn = await connect(node.endpoint, key=KEY)
            held = [entry(f"k{i}", i * 1024, bytes([i]) * 100) for i in range(5)]
            for i, e in enumerate(held):
                await put(master, node, conn, e.key, e.offset, bytes([i]) * 100)
            master.unknown = True
            master.rejected = [held[3]]
            await until(lambda: len(master.mounts) == 4)
            await node.wait_mounted(2_000)
            # Each part lists what the node still holds when it is sent: k3, refused in the
            # first part's reply, is in no later part.
            assert [m.inventory for m in master.mounts[1:]] == [held[0:2], held[2:3], held[4:5]]
            assert node.inventory.entries() == held[:3] + held[4:]
            conn.close()

    run(main)


def test_inventory_chunks_respect_the_frame_size(monkeypatch: pytest.MonkeyPatch) -> None:
    assert list(node_server._inventory_chunks([])) == [[]]
    monkeypatch.setattr(node_server, "_MOUNT_CHUNK_SIZE_BYTES_MAX", 100)
    entries = [InventoryEntry("k" * 30, i * 64, 64, 0) for i in range(5)]  # 62 bytes each
    assert list(node_server._inventory_chunks(entries)) == [[e] for e in entries]


def test_node_survives_master_restart_and_remounts_with_inventory(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path) as (master, node):
            conn = await connect(node.endpoint, key=KEY)
            data = os.urandom(2000)
            await put(master, node, conn, "survivor", 128, data)
            port = master.port
            await master.stop()
            await until(lambda: not node.is_mounted)
            # With the master down the node keeps serving what it holds.
            await asyncio.sleep(0.2)
            assert await read(conn, node.segment_id, 128, len(data)) == data
            restarted = FakeMaster()
            await restarted.start(port)
            try:
                await node.wait_mounted(5_000)
                assert len(restarted.mounts) == 1
                assert restarted.mounts[0].inventory == [entry("survivor", 128, data)]
                assert restarted.mounts[0].segment.segment_id == node.segment_id
                # The new master can call the node back on the new link.
                await restarted.drop(node.segment_id, [entry("survivor", 128, data)])
                assert len(node.inventory) == 0
            finally:
                master.conns = restarted.conns  # so that cluster() closes the live ones
                master.server = restarted.server
            conn.close()

    run(main)


def test_node_starts_before_its_master(tmp_path: Path) -> None:
    async def main() -> None:
        with socket.socket() as probe:  # a port with nobody listening (yet)
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        node = Node(node_config(tmp_path, port))
        await node.start()
        try:
            assert node.state is NodeState.SERVING and not node.is_mounted
            conn = await connect(node.endpoint, key=KEY)
            assert await write(conn, grant_for(node, 0, 10), b"0123456789") == [0]
            master = FakeMaster()
            await master.start(port)
            await node.wait_mounted(5_000)
            assert master.mounts[0].segment == node.segment_info
            conn.close()
            await node.stop()
            assert [type(m) for m in master.calls][-1] is UnmountSegment
            await master.stop()
        finally:
            await node.stop()
        assert segment_files(tmp_path) == []

    run(main)


def test_stop_unmounts_closes_connections_and_unlinks(tmp_path: Path) -> None:
    async def main() -> None:
        master = FakeMaster()
        await master.start()
        node = Node(node_config(tmp_path, master.port))
        await node.start()
        path = Path(node.segment_info.shm_path)
        assert path.exists() and (path.stat().st_mode & 0o777) == 0o600
        conn = await connect(node.endpoint, key=KEY)
        assert await read(conn, node.segment_id, 0, 10) == bytes(10)
        idle = await connect(node.endpoint, key=KEY)  # never sends a request before the stop
        await node.stop()
        assert master.of_type(UnmountSegment) == [UnmountSegment(node.segment_id)]
        assert not path.exists()
        await until(conn.is_closed)
        with pytest.raises(RpcFailed):
            await read(conn, node.segment_id, 0, 10)
        # The handler never saw the idle connection, so stop() could not close it; it is
        # answered with a clean error, never with bytes of an unmapped segment.
        with pytest.raises((RpcFailed, SegmentNotFound)):
            await read(idle, node.segment_id, 0, 10)
        idle.close()
        with pytest.raises(ConnectFailed):
            await connect(node.endpoint, key=KEY, timeout_ms=500)
        await node.stop()  # idempotent
        await master.stop()

    run(main)


def test_drain_then_unmount_while_serving_reads(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path) as (master, node):
            conn = await connect(node.endpoint, key=KEY)
            await put(master, node, conn, "k", 0, b"x" * 64)
            drain = asyncio.ensure_future(node.drain(300))
            await until(lambda: bool(master.of_type(DrainSegment)))
            assert node.state is NodeState.DRAINING
            assert master.of_type(DrainSegment)[0].segment_id == node.segment_id
            assert await read(conn, node.segment_id, 0, 64) == b"x" * 64
            assert not master.of_type(UnmountSegment)
            await drain
            assert master.of_type(UnmountSegment) == [UnmountSegment(node.segment_id)]
            assert not node.is_mounted
            conn.close()

    run(main)


@pytest.mark.parametrize("host", ["0.0.0.0", "127.example.com"])
def test_no_token_on_a_non_loopback_address_is_refused(tmp_path: Path, host: str) -> None:
    """A name that only starts with "127." passed for loopback, and may resolve to any address."""

    async def main() -> None:
        node = Node(node_config(tmp_path, 1, token=None, listen_host=host))
        with pytest.raises(Unauthorized):
            await node.start()
        assert node.state is NodeState.STOPPED
        assert segment_files(tmp_path) == []
        await node.stop()

    run(main)


def test_loopback_is_an_address_not_a_prefix() -> None:
    assert all(map(is_loopback, ["localhost", "127.0.0.1", "127.1.2.3", "::1"]))
    assert not any(map(is_loopback, ["127.example.com", "127", "0.0.0.0", "10.0.0.5", "::", ""]))


def test_wildcard_listen_advertises_a_dialable_address(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, listen_host="0.0.0.0", advertise_host="127.0.0.1") as (_, node):
            assert node.endpoint.startswith("127.0.0.1:")
        async with cluster(tmp_path, listen_host="0.0.0.0") as (_, node):
            host = node.endpoint.rsplit(":", 1)[0]
            assert host and host not in ("0.0.0.0", "")

    run(main)


def test_shm_disabled_hides_the_segment_file(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, token=None, shm_enabled=False) as (master, node):
            assert node.segment_info.shm_path == "" and node.segment_info.shm_token == b""
            assert master.mounts[0].segment.shm_path == ""
            conn = await connect(node.endpoint, key=None)
            await put(master, node, conn, "k", 0, b"no token, loopback only")
            assert await read(conn, node.segment_id, 0, 23) == b"no token, loopback only"
            conn.close()

    run(main)


def test_stale_segment_files_are_removed_at_start(tmp_path: Path) -> None:
    async def main() -> None:
        stale = Segment.create(str(tmp_path), "dead", MEMORY_BYTES, os.urandom(16))
        stale_path = stale.path
        stale.is_owner = False  # leave the file behind, as a SIGKILLed node would
        stale.close()
        with open(stale_path, "r+b") as file:  # rewrite the owner pid to one that cannot exist
            file.seek(40)
            file.write(struct.pack("<Q", 2**22 + 12345))
        async with cluster(tmp_path, node_id="dead") as (_, node):
            # The same path now holds this node's fresh segment (its token, its pid).
            assert segment_files(tmp_path) == [stale_path]
            fresh = Segment.open_mapped(str(stale_path), node.segment_info.shm_token)
            fresh.close()

    run(main)


def test_a_segment_file_whose_owner_lives_in_another_pid_namespace_is_not_stale(tmp_path: Path) -> None:
    """Containers that share /dev/shm (docker --ipc=host) each see their own pids: the pid in a
    live node's header may name no process here. The owner's flock on its file says it lives:
    a node starting here removed the live segment, and same-host clients lost its shm path."""
    owner, path = segment_owner(tmp_path, "elsewhere", MEMORY_BYTES)
    try:
        with open(path, "r+b") as file:  # its pid, as this namespace sees it: no such process
            file.seek(40)
            file.write(struct.pack("<Q", 2**22 + 12345))
        assert remove_stale_segments(str(tmp_path)) == [] and path.exists()
    finally:
        owner.kill()
        owner.wait(10)
    assert remove_stale_segments(str(tmp_path)) == [path]  # its owner is gone: stale now
    assert not path.exists()


def test_a_dead_owners_segment_file_is_stale_though_a_process_it_forked_lives(tmp_path: Path) -> None:
    """The owner's lock is its own: a worker it forked (a serving process with an embedded node)
    shares its open files, and kept a SIGKILLed owner's file from ever being found stale. The
    worker lets go of its copy as it starts (os.register_at_fork): the owner reports once the
    worker runs, since a worker not yet scheduled on a loaded machine still holds it (a full
    run beside two busy loops failed here once)."""
    owner = python_child(
        "import os, sys, time; from kvpool.node.segment import Segment; "
        f"s = Segment.create({str(tmp_path)!r}, 'forker', {MEMORY_BYTES}, os.urandom(16)); "
        "running, started = os.pipe(); worker = os.fork()\n"
        "if worker == 0: os.write(started, b'.'); time.sleep(60); os._exit(0)\n"
        "os.read(running, 1); print(s.path, worker, flush=True); sys.stdin.read()"
    )
    path_text, worker_text = owner.stdout.readline().split()
    path, worker = Path(path_text), int(worker_text)
    try:
        owner.kill()
        owner.wait(10)
        assert Path(f"/proc/{worker}").exists()
        assert remove_stale_segments(str(tmp_path)) == [path]
    finally:
        os.kill(worker, signal.SIGKILL)


def test_a_write_whose_payload_outlives_its_grant_is_cut_off_and_lands_no_more(tmp_path: Path) -> None:
    """A writer that stalls mid-payload past its grant's expiry: the node closes its connection
    then, so the rest can never land. (Fuzzing: a writer stalled past the put's release
    timeout, then sent the rest into the range of an object placed there since: destroyed.)"""
    from kvpool.transports.blocking import BlockingConnection

    async def main() -> None:
        async with cluster(tmp_path) as (_, node):
            size = 64 * 1024
            grant = grant_for(node, 0, size, expiry_ms=wall_clock_ms() + 300)
            writer = await asyncio.to_thread(
                BlockingConnection.open, node.endpoint, key=KEY, timeout_ms=2_000, prefer_local=False
            )
            sock = writer._socket
            header = encode_frame(WriteSlices([WriteItem(grant, 0, size)]), 1, payload_size=size, seal=writer._seal)
            sock.sendall(header + b"\x01" * (size // 2))
            await asyncio.sleep(0.8)  # the grant expired meanwhile
            node.segment.data[size // 2 : size] = b"\x00" * (size // 2)  # the range's new tenant
            with contextlib.suppress(OSError):
                sock.sendall(b"\x02" * (size // 2))
            await asyncio.sleep(0.2)
            assert bytes(node.segment.data[size // 2 : size]) == b"\x00" * (size // 2)
            sock.settimeout(2)
            try:
                answer = sock.recv(4096)
            except ConnectionResetError:
                answer = b""
            assert answer == b""  # closed by the node, no reply
            writer.close()

    run(main)


def test_a_refused_write_leaves_no_grant_timer_to_close_the_connection_later(tmp_path: Path) -> None:
    """A write whose payload size does not match its items is refused (InvalidParams) before
    any byte lands; the timer its grant armed must go with it. (Before, it stayed armed, and at
    that grant's expiry closed the connection under the valid writes and reads that followed.)"""

    async def main() -> None:
        async with cluster(tmp_path) as (_, node):
            conn = await connect(node.endpoint, key=KEY)
            expiry_ms = wall_clock_ms() + 600
            short = grant_for(node, 0, 4096, expiry_ms=expiry_ms)
            with pytest.raises(InvalidParams, match="does not match"):
                await conn.request(WriteSlices([WriteItem(short, 0, 4096)]), [bytes(4095)], timeout_ms=2_000)
            assert node._transfer._payload_deadlines == {}  # nothing armed for a refused payload
            data = os.urandom(4096)
            assert await write(conn, grant_for(node, 8192, 4096), data) == [0]
            await until(lambda: wall_clock_ms() > expiry_ms + 300 or conn.is_closed())
            assert not conn.is_closed(), conn.close_reason
            assert await read(conn, node.segment_id, 8192, 4096) == data
            conn.close()

    run(main)


def test_a_node_raises_its_open_files_limit_to_the_hard_limit(tmp_path: Path, caplog) -> None:
    """Each disk read holds descriptors until it is sent, each connection one: a node does not
    stay at the usual soft limit of 1,024 when the hard limit allows more, and says what it has."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = len(os.listdir("/proc/self/fd")) + 512  # room for this test's own
    if hard == resource.RLIM_INFINITY or hard <= low:
        pytest.skip(f"hard limit {hard}: nothing to raise to")

    async def main() -> None:
        async with cluster(tmp_path):
            assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)

    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        with caplog.at_level(logging.INFO, logger="kvpool.node.server"):
            run(main)
        assert f"open files limit {hard}" in caplog.text
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_node_warns_when_its_advertised_address_does_not_reach_it(tmp_path: Path, caplog) -> None:
    """--advertise-host naming an address the node does not listen on: clients would fail every
    transfer with it (11 of 20 puts failed in a probe) while the master and `kvpool stat` saw a
    working node, and nothing said why."""

    async def main() -> None:
        with caplog.at_level(logging.INFO, logger="kvpool.node.server"):
            async with cluster(tmp_path, advertise_host="127.0.0.9") as (_, node):
                assert node.endpoint.startswith("127.0.0.9:")
        assert "advertised address 127.0.0.9" in caplog.text and "check --advertise-host" in caplog.text
        assert "listening on 127.0.0.1" in caplog.text
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kvpool.node.server"):
            async with cluster(tmp_path):  # advertises what it listens on: no warning
                pass
        assert "advertised address" not in caplog.text

    run(main)


def test_metrics_and_health_over_http(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, metrics_port=0) as (master, node):
            conn = await connect(node.endpoint, key=KEY)
            await put(master, node, conn, "k", 0, b"m" * 128)
            with pytest.raises(Unauthorized):
                await write(conn, grant_for(node, 0, 10, key=None), bytes(10))
            base = f"http://{node.metrics_endpoint}"
            async with aiohttp.ClientSession() as session:
                async with session.get(base + "/metrics") as response:
                    assert response.status == 200
                    text = await response.text()
                async with session.get(base + "/health") as response:
                    assert response.status == 200
                    health = json.loads(await response.text())
            samples = {
                (sample.name, tuple(sorted(sample.labels.items()))): sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples
            }
            expected = {
                "kvpool_node_segment_capacity_bytes": MEMORY_BYTES,
                "kvpool_node_segment_used_bytes": 128,
                "kvpool_node_objects": 1,
                "kvpool_node_write_bytes_total": 128,
                "kvpool_node_write_requests_total": 1,
                "kvpool_node_read_requests_total": 0,
                "kvpool_node_master_connected": 1,
                "kvpool_node_mounts_total": 1,
            }
            for name, value in expected.items():
                assert samples[(name, ())] == value, name
            assert samples[("kvpool_node_errors_total", (("code", "ILLEGAL_CLIENT"),))] == 1
            info = (("endpoint", node.endpoint), ("node_id", node.node_id),
                    ("segment_id", node.segment_id))  # fmt: skip
            assert samples[("kvpool_node_info", info)] == 1
            assert health["status"] == "ok" and health["mounted"] is True
            assert health["segment_id"] == node.segment_id and health["objects"] == 1
            conn.close()

    run(main)


def test_two_nodes_in_one_process(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path) as (master, first):
            second = Node(node_config(tmp_path, master.port))
            await second.start()
            assert second.is_mounted and second.segment_id != first.segment_id
            assert len(segment_files(tmp_path)) == 2
            await second.stop()

    run(main)


def test_node_config_validates() -> None:
    with pytest.raises(InvalidParams):
        NodeConfig(master_endpoint="127.0.0.1:1", memory_bytes=1)
    with pytest.raises(InvalidParams):
        NodeConfig(master_endpoint="127.0.0.1:1", memory_bytes=MEMORY_BYTES, heartbeat_interval_ms=0)
    with pytest.raises(InvalidParams):
        NodeConfig(master_endpoint="127.0.0.1:1", memory_bytes=MEMORY_BYTES, node_id="../evil")
    with pytest.raises(InvalidParams):
        NodeConfig(master_endpoint="127.0.0.1:1", memory_bytes=MEMORY_BYTES, token="")
    a = NodeConfig(master_endpoint="127.0.0.1:1", memory_bytes=MEMORY_BYTES)
    b = NodeConfig(master_endpoint="127.0.0.1:1", memory_bytes=MEMORY_BYTES)
    assert a.node_id != b.node_id and len(a.node_id) == 12


def test_a_drop_never_overtakes_the_commit_before_it(tmp_path: Path) -> None:
    """A large commit is verified off the loop. The master answers puts before commits are
    verified and may drop an object right after: that drop, sent behind the commit on the same
    link, is applied after it, so the node never keeps an object the master dropped."""

    async def main() -> None:
        import dataclasses

        master = FakeMaster()
        await master.start()
        node = Node(dataclasses.replace(node_config(tmp_path, master.port), memory_bytes=8 * limits.MIB))
        await node.start()
        try:
            data = os.urandom(4 * limits.MIB)  # past checksums.PARALLEL_BYTES_MIN: hashed off the loop
            node.segment.data[: len(data)] = data  # as a same-host writer does, through the mapping
            entry = InventoryEntry("big", 0, len(data), xxhash.xxh3_64_intdigest(data))
            commit = asyncio.ensure_future(master.commit(node.segment_id, [entry]))
            await asyncio.sleep(0)  # the commit's frame leaves first
            await master.drop(node.segment_id, [entry])
            assert await commit == [ErrorCode.OK]
            assert node.inventory.get("big") is None
            # And a commit behind another commit keeps its place too.
            first = asyncio.ensure_future(master.commit(node.segment_id, [entry]))
            await asyncio.sleep(0)
            small_bytes = bytes(node.segment.data[len(data) : len(data) + 64])
            second = InventoryEntry("small", len(data), 64, xxhash.xxh3_64_intdigest(small_bytes))
            assert await master.commit(node.segment_id, [second]) == [ErrorCode.OK]
            assert await first == [ErrorCode.OK]
            assert sorted(e.key for e in node.inventory.entries()) == ["big", "small"]
        finally:
            await node.stop()
            await master.stop()

    run(main)


def test_grants_of_an_earlier_master_term_are_refused_after_a_remount(tmp_path: Path) -> None:
    """A writer stalled across a master restart or failover holds a grant of the old term; the
    new master may give that range to another put. Once the node has re-mounted with the new
    master, it takes grants of the new term only (signed: a writer cannot relabel one)."""

    async def main() -> None:
        async with cluster(tmp_path) as (master, node):
            master.term = 7
            master.unknown = True  # re-mount: the node learns term 7
            await until(lambda: len(master.mounts) == 2)
            await node.wait_mounted(2_000)
            conn = await connect(node.endpoint, key=KEY)
            assert await write(conn, grant_for(node, 0, 100, term=7), b"a" * 100) == [ErrorCode.OK]
            stalled = grant_for(node, 4096, 100, term=7)
            master.term = 8  # the master restarted (or another one leads now)
            master.unknown = True
            await until(lambda: len(master.mounts) == 3)
            await node.wait_mounted(2_000)
            with pytest.raises(Unauthorized, match="term"):
                await write(conn, stalled, b"s" * 100)
            relabelled = WriteGrant(stalled.segment_id, stalled.offset, stalled.size, stalled.expiry_ms,
                                    stalled.mac, term=8)  # fmt: skip
            with pytest.raises(Unauthorized):
                await write(conn, relabelled, b"s" * 100)
            assert await write(conn, grant_for(node, 4096, 100, term=8), b"n" * 100) == [ErrorCode.OK]
            assert await read(conn, node.segment_id, 4096, 100) == b"n" * 100
            conn.close()

    run(main)


def test_same_host_connections_move_to_the_unix_socket_and_fall_back_to_tcp(tmp_path: Path) -> None:
    """A server announces its abstract Unix socket in its first frame; a client that prefers
    it moves there (same handshake, same token), one that does not stays on TCP, and one that
    cannot reach the name (another host or network namespace) stays on TCP too."""

    async def main() -> None:
        master = FakeMaster()
        await master.start()
        try:
            endpoint = f"127.0.0.1:{master.port}"
            local = await connect(endpoint, key=KEY, prefer_local=True)
            tcp = await connect(endpoint, key=KEY)
            assert local.peer == f"{endpoint} (same-host socket)" and tcp.peer == endpoint
            assert tcp.local_name.startswith("\0kvpool-")
            for conn in (local, tcp):
                assert isinstance(await conn.request(Heartbeat([]), timeout_ms=2_000), HeartbeatReply)
            # The Unix socket asks for the token like TCP: a wrong one is refused there too.
            loop = asyncio.get_running_loop()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            await loop.sock_connect(sock, tcp.local_name)
            _, stranger = await loop.create_unix_connection(
                lambda: Connection(None, key=auth.cluster_key("another token"), is_server=False), sock=sock
            )
            with pytest.raises((ConnectFailed, Unauthorized)):
                await stranger.wait_ready(2_000)
            # A name nobody listens on (as on another host): the TCP connection is kept.
            original = Connection._on_handshake

            def elsewhere(self: Connection, frame: Frame) -> None:
                original(self, frame)
                if self.local_name:
                    self.local_name = "\0kvpool-nobody-listens-here"

            Connection._on_handshake = elsewhere  # type: ignore[method-assign]
            try:
                fallback = await connect(endpoint, key=KEY, prefer_local=True)
            finally:
                Connection._on_handshake = original  # type: ignore[method-assign]
            assert fallback.peer.startswith("127.0.0.1:") and not fallback.is_closed()
            for conn in (local, tcp, fallback):
                conn.close()
        finally:
            await master.stop()

    run(main)


def open_sockets() -> int:
    """This process's open socket descriptors."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own descriptor, closed since
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return count


def test_a_connect_that_fails_or_is_cancelled_on_its_way_to_the_unix_socket_leaves_no_socket_open() -> None:
    """The move to the same-host socket can stall (a server that accepts and never speaks:
    a wedged process) and its caller can give up: a timeout keeps the TCP connection and
    closes the Unix one; a cancellation (a Store closed meanwhile) closes both. Before, the
    Unix connection of a timed-out handshake, and both on a cancellation, stayed open
    until garbage collection, warning then of an event loop already closed."""

    async def main() -> None:
        master = FakeMaster()
        await master.start()
        before = open_sockets()
        silent_name = f"\0kvpool-silent-{os.getpid()}"
        accepted: list[asyncio.Protocol] = []

        def accept() -> asyncio.Protocol:
            accepted.append(asyncio.Protocol())
            return accepted[-1]

        silent = await asyncio.get_running_loop().create_unix_server(accept, silent_name)
        original = Connection._on_handshake

        def wedged(self: Connection, frame: Frame) -> None:
            original(self, frame)
            if self.local_name:
                self.local_name = silent_name

        Connection._on_handshake = wedged  # type: ignore[method-assign]
        try:
            endpoint = f"127.0.0.1:{master.port}"
            kept = await connect(endpoint, key=KEY, prefer_local=True, timeout_ms=300)
            assert kept.peer.startswith("127.0.0.1:") and not kept.is_closed()
            kept.close()
            connecting = asyncio.create_task(connect(endpoint, key=KEY, prefer_local=True, timeout_ms=30_000))
            await until(lambda: len(accepted) == 2)  # on its way: TCP done, the Unix handshake waiting
            connecting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await connecting
            silent.close()
            await silent.wait_closed()
            await until(lambda: open_sockets() == before)
        finally:
            Connection._on_handshake = original  # type: ignore[method-assign]
            await master.stop()

    run(main)


def test_the_master_clock_is_the_least_upper_bound_of_the_replies_and_warns_once(caplog):
    clock = MasterClock("node n")
    clock.observe(1_000, 0)  # a master that does not say its time
    assert clock.offset_ms == 0
    clock.observe(1_000, 61_020)  # a reply 20 ms on its way: the offset is at most 60,020
    clock.observe(2_000, 62_003)
    assert clock.offset_ms == 60_003  # the tightest bound
    with caplog.at_level(logging.INFO, logger="kvpool.node.clock"):
        clock.observe(3_000, 63_500)  # a slow reply moves nothing
        clock.observe(4_000, 5_000)  # the master's clock was set right
    assert clock.offset_ms == 1_000
    assert abs(clock.now_ms() - (wall_clock_ms() + 1_000)) < 1_000
    for sent in range(5_000, 5_000 + CLOCK_OFFSET_SAMPLES_MAX):
        clock.observe(sent, sent + 10)
    assert clock.offset_ms == 10  # old samples age out
    clock.forget()  # another master
    clock.observe(6_000, 5_000)
    assert clock.offset_ms == -1_000
    assert "within 1000 ms of the master's again" in caplog.text
