"""Connection (kvpool/transports/connection.py): once a call has ended, nothing of it goes on.

A caller that has its answer, its error or its cancellation may reuse (or free) its buffers at
once, and a server must release what a reply held when the connection goes. How: raw sockets
from conftest play a peer that answers twice or reads slowly, or a client that hangs up; the
Connection runs on uvloop as the servers and the sync Store do (uvloop's writelines keeps the
caller's buffers, where asyncio on Python 3.11 copies them).
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import uvloop
from conftest import raw_server, requests_read

from kvpool.protocol.auth import Keyring
from kvpool.protocol.frames import encode_frame
from kvpool.protocol.messages import (
    AuthResponse,
    ReadItem,
    ReadReply,
    ReadSlices,
    WriteGrant,
    WriteItem,
    WriteSlices,
)
from kvpool.transports.connection import Reply, connect, start_server
from kvpool.transports.files import FileRange

SIZE = 4096


def test_a_second_reply_to_one_request_closes_the_connection_and_lands_nowhere():
    """A peer (a buggy or hostile node) answers one read twice: the second reply's payload was
    given the caller's buffer and overwrote it after the get had returned, checksum passed."""

    def answer_twice(sock: socket.socket) -> None:
        (request,) = requests_read(sock, 1)
        reply = encode_frame(ReadReply(SIZE), request.request_id, is_reply=True, payload_size=SIZE)
        sock.sendall(reply + b"A" * SIZE + reply)  # the second header with the first reply
        time.sleep(0.2)
        try:
            sock.sendall(b"B" * SIZE)
        except OSError:  # closed by the client already: what the fix does
            pass

    async def main(endpoint: str) -> tuple[bytes, bytes, bool, str]:
        conn = await connect(endpoint, key=None, timeout_ms=2_000)
        buffer = bytearray(SIZE)
        await conn.request(ReadSlices([ReadItem("s", 0, SIZE)]), reply_sinks=lambda _: [memoryview(buffer)])
        returned = bytes(buffer)
        await asyncio.sleep(0.5)
        return returned, bytes(buffer), conn.is_closed(), conn.close_reason

    with raw_server(answer_twice) as endpoint:
        returned, later, is_closed, reason = uvloop.run(asyncio.wait_for(main(endpoint), 30))
    assert returned == b"A" * SIZE
    assert later == returned, "a reply to an answered request wrote into the caller's buffer"
    assert is_closed and "a second reply to request" in reason, reason


def test_a_cancelled_write_sends_no_more_of_the_callers_buffer():
    """A put whose payload the peer has not taken yet, cancelled (the sync Store's call bound,
    Ctrl-C): the rest of its frame went on out of the caller's buffer after the cancel, so
    bytes the caller wrote there afterwards reached the node."""
    size = 32 << 20  # more than the loopback socket buffers hold
    received = bytearray()
    reading = threading.Event()

    def read_late(sock: socket.socket) -> None:
        reading.wait(10)
        while chunk := sock.recv(1 << 20):
            received.extend(chunk)

    async def main(endpoint: str) -> bool:
        conn = await connect(endpoint, key=None, timeout_ms=2_000)
        buffer = bytearray(b"A" * size)
        write = WriteSlices([WriteItem(WriteGrant("s", 0, size, 2**40), 0, size)])
        task = asyncio.ensure_future(conn.request(write, [memoryview(buffer)], timeout_ms=10_000))
        await asyncio.sleep(0.1)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        buffer[:] = b"Z" * size  # the caller's buffer is its own again
        reading.set()
        await asyncio.sleep(0.5)
        return conn.is_closed()

    with raw_server(read_late) as endpoint:
        is_closed = uvloop.run(asyncio.wait_for(main(endpoint), 30))
    assert is_closed
    assert 0 < len(received) < size and b"Z" not in received, (len(received), received.count(b"Z"))


def test_a_file_reply_not_sent_before_the_client_hangs_up_closes_its_file(tmp_path):
    """A disk tier's read (a reply naming a file range, whose descriptor the Connection owns)
    queued behind a large reply the client never read: the client hung up, and the descriptor
    stayed open (a deleted object file kept its disk space, and the node neared EMFILE)."""
    big = bytes(32 << 20)
    path = tmp_path / "object"
    path.write_bytes(b"x" * SIZE)
    opened: list[int] = []

    class Handler:
        def connection_closed(self, conn) -> None:
            pass

        def handle(self, conn, message):
            if message.items[0].offset == 1:
                return Reply(ReadReply(len(big)), [memoryview(big)])
            return file_reply()  # ready once the large reply is queued: a disk read opens off the loop

    async def file_reply() -> Reply:
        opened.append(os.open(path, os.O_RDONLY))
        return Reply(ReadReply(SIZE), [FileRange(opened[-1], 0, SIZE)])

    def client(port: int) -> None:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.recv(4096)  # the challenge
            sock.sendall(encode_frame(AuthResponse(os.urandom(32), b""), 0))
            time.sleep(0.2)
            reads = [ReadSlices([ReadItem("s", offset, 1)]) for offset in (0, 1)]  # the file's, the large
            sock.sendall(b"".join(encode_frame(read, i + 1) for i, read in enumerate(reads)))
            time.sleep(0.5)  # reads nothing, then gives up

    async def main() -> None:
        listener = await start_server("127.0.0.1", 0, Handler(), keyring=Keyring(), name="test")
        try:
            await asyncio.get_running_loop().run_in_executor(None, client, listener.port)
            while listener.connections:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # the file sender's wait for the drain polls every 1 ms
        finally:
            await listener.close()

    uvloop.run(asyncio.wait_for(main(), 30))
    assert len(opened) == 1
    try:
        os.fstat(opened[0])
    except OSError:
        return  # closed, as it must be
    os.close(opened[0])
    raise AssertionError("the reply's file descriptor is still open")
