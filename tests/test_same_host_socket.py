"""A server's same-host Unix socket is taken only where it is the server's own
(transports/same_host.py). An abstract Unix socket has no owner: a security review had a user
without the cluster token bind, on a client's host, the name a master on another host
announced, relay the master's handshake through it and keep the authenticated connection
(RemoveAll: every object gone). How: a raw TCP server plays the master (it announces the name
and answers the handshake on TCP), and the test binds that name itself, as the squatter did."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from kvpool.protocol.frames import encode_frame
from kvpool.protocol.messages import AuthChallenge, AuthOk
from kvpool.transports import same_host
from kvpool.transports.blocking import BlockingConnection
from kvpool.transports.connection import connect


@contextlib.contextmanager
def squatted(challenge: Callable[[str], AuthChallenge]) -> Iterator[tuple[str, list[socket.socket]]]:
    """A TCP server that sends `challenge(name)` for a fresh abstract name and completes the
    handshake (no token) on TCP; and a listener on that name in this process, the squatter:
    what it accepts is in the list."""
    name = f"\0kvpool-test-{os.urandom(8).hex()}"
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(name)
    squatter.listen()
    squatter.settimeout(0.2)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        conns = []
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conns.append(conn)
            conn.settimeout(5)
            conn.sendall(encode_frame(challenge(name), 0))
            conn.recv(4096)  # the AuthResponse
            conn.sendall(encode_frame(AuthOk(b""), 0))
        for conn in conns:
            conn.close()

    def squat() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                accepted.append(squatter.accept()[0])

    threads = [threading.Thread(target=serve, daemon=True), threading.Thread(target=squat, daemon=True)]
    for thread in threads:
        thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}", accepted
    finally:
        stop.set()
        listener.close()
        for thread in threads:
            thread.join(5)
        squatter.close()
        for conn in accepted:
            conn.close()


def _opened_both_ways(endpoint: str) -> list[str]:
    """The peers of a blocking and an asyncio connection opened with prefer_local."""
    blocking = BlockingConnection.open(endpoint, key=None, timeout_ms=2_000, prefer_local=True)

    async def opened() -> str:
        conn = await connect(endpoint, key=None, prefer_local=True)
        conn.close()
        return conn.peer

    peers = [blocking.peer, asyncio.run(opened())]
    blocking.close()
    return peers


@pytest.mark.skipif(not same_host.host_identity(), reason="no boot id or network namespace to read here")
def test_a_name_announced_from_another_host_is_never_dialled() -> None:
    other_host = "another-boot-id/4026531840"
    with squatted(lambda name: AuthChallenge(os.urandom(16), False, name, other_host)) as (at, took):
        assert not any("same-host" in peer for peer in _opened_both_ways(at))
    assert took == []  # not even dialled


def test_an_older_server_that_says_nothing_of_its_host_is_kept_on_tcp() -> None:
    with squatted(lambda name: AuthChallenge(os.urandom(16), False, name)) as (at, took):
        assert not any("same-host" in peer for peer in _opened_both_ways(at))
    assert took == []
