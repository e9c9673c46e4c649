"""The listener of the master's and nodes' read-only HTTP surface (/metrics, /health, /status).

One aiohttp runner on sockets bound to every address of the host on one port (connection.py
`bind_listening_sockets`: aiohttp's TCPSite gave each address a port of its own).
"""

from __future__ import annotations

import socket

from aiohttp import web

from kvpool.errors import InvalidParams
from kvpool.transports.connection import bind_listening_sockets


async def serve_http(app: web.Application, host: str, port: int, flag: str) -> tuple[web.AppRunner, int]:
    """Serve `app` on host:port (0: ephemeral); returns the runner (for cleanup) and the bound port.

    Raises:
        InvalidParams: the port cannot be bound (busy, an address not of this host), naming
            `flag`, the option that set it.
    """
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sockets: list[socket.socket] = []
    try:
        sockets = await bind_listening_sockets(host, port)
        for sock in sockets:
            await web.SockSite(runner, sock).start()
    except BaseException as exc:
        await runner.cleanup()
        for sock in sockets:  # those not started yet (a started site's are closed already)
            sock.close()
        if isinstance(exc, OSError):  # a busy port (9100 is also node_exporter's default)
            reason = exc.strerror or str(exc)
            raise InvalidParams(f"cannot listen on {host}:{port} for /metrics ({flag}): {reason}") from None
        raise
    return runner, runner.addresses[0][1]
