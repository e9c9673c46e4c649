"""Connection (kvpool/transports/connection.py): a reply's `then` (Reply.then).

The master answers a put_end before it enters the objects into its table, and does that in
`then`: the writer must not wait for it, yet every request handled after the reply must find
the objects there. So `then` must run once the reply is on its way, before the loop handles
anything else, and even when the connection closed before the reply could be written.
How: a real server and client Connection over loopback TCP, on uvloop as the servers run.
"""

from __future__ import annotations

import asyncio
import os
import socket

import uvloop

from kvpool.protocol.auth import Keyring
from kvpool.protocol.messages import ExistKeys, Heartbeat, Message, OkReply
from kvpool.transports.connection import Connection, Reply, connect, start_server


class _Handler:
    """Heartbeat: answered after `release`, with a `then` that records what it saw;
    ExistKeys: records that it was handled."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.release = asyncio.Event()
        self.release.set()
        self.client_socket: socket.socket | None = None
        self.reply_was_readable: bool | None = None

    def payload_sinks(self, conn: Connection, message: Message) -> None:
        return None

    def handle(self, conn: Connection, message: Message):
        if isinstance(message, Heartbeat):
            return self._answer_later()
        self.events.append("next request")
        return OkReply()

    async def _answer_later(self) -> Reply:
        await self.release.wait()
        return Reply(OkReply(), then=self._then)

    def _then(self) -> None:
        self.events.append("then")
        if self.client_socket is not None:  # is the reply already in the client's socket?
            try:
                self.reply_was_readable = bool(self.client_socket.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
            except BlockingIOError:
                self.reply_was_readable = False

    def connection_closed(self, conn: Connection) -> None:
        pass


def test_then_runs_after_the_reply_is_written_and_before_the_next_request():
    async def main() -> _Handler:
        handler = _Handler()
        server = await start_server("127.0.0.1", 0, handler, keyring=Keyring(), name="test")
        try:
            conn = await connect(f"127.0.0.1:{server.port}", key=None, timeout_ms=2_000)
            # uvloop's transport socket cannot recv: peek through a duplicate of it
            handler.client_socket = socket.socket(fileno=os.dup(conn._transport.get_extra_info("socket").fileno()))
            assert isinstance(await conn.request(Heartbeat([]), timeout_ms=2_000), OkReply)
            assert isinstance(await conn.request(ExistKeys(["k"]), timeout_ms=2_000), OkReply)
            conn.close()
            handler.client_socket.close()
        finally:
            await server.close()
        return handler

    handler = uvloop.run(main())
    assert handler.events == ["then", "next request"]
    assert handler.reply_was_readable, "then ran before its reply was written"


def test_then_runs_when_the_connection_closed_before_the_reply():
    async def main() -> _Handler:
        handler = _Handler()
        handler.release.clear()
        server = await start_server("127.0.0.1", 0, handler, keyring=Keyring(), name="test")
        try:
            conn = await connect(f"127.0.0.1:{server.port}", key=None, timeout_ms=2_000)
            request = asyncio.ensure_future(conn.request(Heartbeat([]), timeout_ms=2_000))
            await asyncio.sleep(0.05)  # the server is preparing its answer
            conn.close()
            await asyncio.gather(request, return_exceptions=True)
            await asyncio.sleep(0.05)  # the server sees the close
            handler.release.set()
            for _ in range(100):
                if handler.events:
                    break
                await asyncio.sleep(0.01)
        finally:
            await server.close()
        return handler

    assert uvloop.run(main()).events == ["then"]
