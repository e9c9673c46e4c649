"""The listener of the master's and nodes' read-only HTTP surface (/metrics, /health, /status).

One aiohttp runner on sockets bound to every address of the host on one port (connection.py
`bind_listening_sockets`: aiohttp's TCPSite gave each address a port of its own).

Its connections are bounded apart from the RPC's (docs/operations.md "Connections are
bounded"): the port takes no token, and with aiohttp's defaults (no bound, no deadline for a
request's head) whoever reached it held every descriptor of the process by opening connections
that send half a request. A port holds HTTP_CONNECTIONS_MAX connections at once and closes
those past it as they come; it closes one whose first request's head has not all come within
HTTP_REQUEST_HEAD_TIMEOUT_MS, and one idle between requests for HTTP_KEEPALIVE_TIMEOUT_MS
(aiohttp's keepalive_timeout, which also ends a later request's head that stalls).
"""

from __future__ import annotations

import asyncio
import logging
import socket

from aiohttp import web

from kvpool import limits
from kvpool.errors import InvalidParams
from kvpool.repeated_log import RepeatedLog
from kvpool.transports.connection import bind_listening_sockets

log = logging.getLogger(__name__)
# Connections refused past the bound, and those closed for want of a request in time.
_refused_for_room = RepeatedLog(log, logging.WARNING)
_no_request_in_time = RepeatedLog(log, logging.WARNING)

# A request's head ends at its first empty line (RFC 9112 section 2).
_HEAD_END = b"\r\n\r\n"


async def serve_http(app: web.Application, host: str, port: int, flag: str) -> tuple[web.AppRunner, int]:
    """Serve `app` on host:port (0: ephemeral); returns the runner (for cleanup) and the bound port.

    Raises:
        InvalidParams: the port cannot be bound (busy, an address not of this host), naming
            `flag`, the option that set it.
    """
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=limits.HTTP_KEEPALIVE_TIMEOUT_MS / 1000)
    await runner.setup()
    sockets: list[socket.socket] = []
    try:
        sockets = await bind_listening_sockets(host, port)
        assert runner.server is not None, "set up above"
        bound = _ConnectionBound(runner.server, f"HTTP port {sockets[0].getsockname()[1]} ({flag})")
        for sock in sockets:
            await _BoundedSockSite(runner, sock, bound).start()
    except BaseException as exc:
        await runner.cleanup()
        for sock in sockets:  # those not started yet (a started site's are closed already)
            sock.close()
        if isinstance(exc, OSError):  # a busy port (9100 is also node_exporter's default)
            reason = exc.strerror or str(exc)
            raise InvalidParams(f"cannot listen on {host}:{port} for /metrics ({flag}): {reason}") from None
        raise
    return runner, runner.addresses[0][1]


class _ConnectionBound:
    """The protocol factory of one HTTP port's listening sockets: aiohttp's request handler for
    each connection while fewer than HTTP_CONNECTIONS_MAX are open (`open_count`, counted from
    the accept to the close); past it a connection is closed as it comes."""

    def __init__(self, server: web.Server, name: str) -> None:
        self._server = server
        self.name = name
        self.open_count = 0

    def __call__(self) -> asyncio.Protocol:
        if self.open_count >= limits.HTTP_CONNECTIONS_MAX:
            return _Refused(self)
        self.open_count += 1
        return _HttpConnection(self, self._server())


class _Refused(asyncio.Protocol):
    """A connection past the bound: closed, with a logged reason. (Not answered 503: its request,
    come and unread, would turn the close into a reset that loses the answer.)"""

    def __init__(self, bound: _ConnectionBound) -> None:
        self._bound = bound

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        _refused_for_room.log(
            "%s: refusing %s: it holds %d connections, the most it may: a client that opens connections "
            "and sends no request?", self._bound.name, _peer(transport), self._bound.open_count,
        )  # fmt: skip
        transport.close()


class _HttpConnection(asyncio.Protocol):
    """One connection within the bound: the transport's events go to aiohttp's handler, and the
    connection is closed when its first request's head has not all come within
    HTTP_REQUEST_HEAD_TIMEOUT_MS of the accept, however slowly its bytes trickle in (aiohttp
    3.9, the oldest this project takes, waits for it forever; its keepalive_timeout covers the
    requests after the first)."""

    def __init__(self, bound: _ConnectionBound, handler: asyncio.Protocol) -> None:
        self._bound = bound
        self._handler = handler
        self._transport: asyncio.BaseTransport | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_tail = b""  # the last bytes received, while the first head is not all here

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._head_timer = asyncio.get_running_loop().call_later(
            limits.HTTP_REQUEST_HEAD_TIMEOUT_MS / 1000, self._head_overdue
        )
        self._handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._head_timer is not None:
            received = self._head_tail + data
            if _HEAD_END in received:
                self._head_timer.cancel()
                self._head_timer = None
            self._head_tail = received[-len(_HEAD_END) + 1 :]  # an end split between two reads
        self._handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self._handler.eof_received()

    def pause_writing(self) -> None:
        self._handler.pause_writing()

    def resume_writing(self) -> None:
        self._handler.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._bound.open_count -= 1
        assert self._bound.open_count >= 0, self._bound.open_count
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._handler.connection_lost(exc)

    def _head_overdue(self) -> None:
        self._head_timer = None
        assert self._transport is not None, "timer set at connection_made"
        _no_request_in_time.log(
            "%s: closing %s: no complete request within %d ms", self._bound.name, _peer(self._transport),
            limits.HTTP_REQUEST_HEAD_TIMEOUT_MS,
        )  # fmt: skip
        self._transport.close()


def _peer(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if peer else "?"


class _BoundedSockSite(web.BaseSite):
    """aiohttp's SockSite, its connections made by a _ConnectionBound rather than by the
    runner's server as they come (aiohttp's sites take no protocol factory)."""

    def __init__(self, runner: web.AppRunner, sock: socket.socket, bound: _ConnectionBound) -> None:
        super().__init__(runner)
        self._sock = sock
        self._bound = bound

    @property
    def name(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    async def start(self) -> None:
        await super().start()
        self._server = await asyncio.get_running_loop().create_server(self._bound, sock=self._sock)
