"""Connection (kvpool/transports/connection.py): every request ends within its own bound.

How: raw sockets from conftest play a peer that authenticates and then reads nothing (what a
master or node frozen by SIGSTOP, or one whose event loop stalls, looks like from the other
end of the socket), on uvloop as the servers run; the request must fail with a typed error
within its timeout, not sit in the wait for the peer to drain the connection.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import uvloop
from conftest import raw_server, wait_until

from kvpool.errors import RpcTimeout
from kvpool.protocol.auth import Keyring
from kvpool.protocol.frames import NEED_DATA, FrameDecoder, encode_frame
from kvpool.protocol.messages import AuthChallenge, AuthOk, AuthResponse, Heartbeat
from kvpool.transports.connection import connect


def test_a_request_the_peer_does_not_read_times_out_within_its_own_bound():
    """A frame larger than the socket buffers pauses writing; the request used to wait for the
    drain for the transfer timeout (30 s), whatever its own timeout, and then raise a bare
    TimeoutError, which a node's master link does not catch (its task ended)."""
    release = threading.Event()
    # Larger than the loopback socket buffers of both ends together (a few MiB each).
    heartbeat = Heartbeat([f"segment-{i:0240d}" for i in range(100_000)])

    async def main(endpoint: str) -> tuple[BaseException | None, float, bool]:
        conn = await connect(endpoint, key=None, timeout_ms=2_000)
        started_s = time.monotonic()
        error: BaseException | None = None
        try:
            await asyncio.wait_for(conn.request(heartbeat, timeout_ms=500), 20)
        except BaseException as exc:  # noqa: BLE001 (the test reports whatever came out)
            error = exc
        return error, time.monotonic() - started_s, conn.is_closed()

    with raw_server(lambda sock: release.wait(30)) as endpoint:
        try:
            error, took_s, is_closed = uvloop.run(main(endpoint))
        finally:
            release.set()
    assert isinstance(error, RpcTimeout), repr(error)
    assert took_s < 3, took_s
    assert is_closed, "a frame half sent must not be followed by the next request"


def test_a_server_lets_go_of_a_closed_connection_at_once():
    """A server's handshake timer (AUTH_TIMEOUT_MS, 2 s) held every connection it accepted,
    closed or not, and its buffers, until it fired: ~19 KiB each, 76 MiB of a master's RSS
    under 500 connections a second (helper-53). It is cancelled once moot."""
    import gc
    import weakref

    from kvpool.transports.connection import start_server

    class Handler:  # asked nothing: the connections only shake hands
        def connection_closed(self, conn) -> None:
            pass

    async def main() -> list:
        listener = await start_server("127.0.0.1", 0, Handler(), keyring=Keyring(), name="test")
        try:
            endpoint = f"127.0.0.1:{listener.port}"
            accepted = []
            for _ in range(5):
                client = await connect(endpoint, key=None)
                while not listener.connections:
                    await asyncio.sleep(0.01)
                accepted.extend(weakref.ref(conn) for conn in listener.connections)
                client.close()
                while listener.connections:
                    await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            gc.collect()
            return [ref for ref in accepted if ref() is not None]
        finally:
            await listener.close()

    alive = uvloop.run(asyncio.wait_for(main(), 30))
    assert alive == [], alive  # well within the 2 s of the handshake timer


def test_a_handshake_frame_with_a_payload_closes_the_connection_saying_so():
    """Nothing takes a handshake frame's payload: the server closes the connection, naming
    what the peer sent (it said "set_payload_sinks must follow a Frame with a payload", a
    complaint about itself)."""
    import os

    from kvpool.protocol.frames import encode_frame
    from kvpool.protocol.messages import AuthResponse
    from kvpool.transports.connection import start_server

    reasons: list[str] = []

    class Handler:
        def connection_closed(self, conn) -> None:
            reasons.append(conn.close_reason)

    async def main() -> None:
        listener = await start_server("127.0.0.1", 0, Handler(), keyring=Keyring(), name="test")
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            await reader.read(4096)  # the challenge
            writer.write(encode_frame(AuthResponse(os.urandom(32), b""), 0, payload_size=10) + b"x" * 10)
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, nothing answered
            writer.close()
            while not reasons:
                await asyncio.sleep(0.01)
        finally:
            await listener.close()

    uvloop.run(asyncio.wait_for(main(), 30))
    assert reasons == ["AuthResponse with a payload during the handshake"], reasons


# The open files limit of the master below: it holds at most a quarter of it, 128 authenticated
# connections (connection.authenticated_connections_max), and ran out of descriptors at about 490.
MASTER_OPEN_FILES = 512
MASTER_CONNECTIONS_MAX = 128


def _authenticated(endpoint: str) -> socket.socket | None:
    """A raw connection that shakes hands (no token) and then says nothing, as a client that
    opens a connection and never closes it; None when the server closed it instead."""
    import os

    host, port = endpoint.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    decoder = FrameDecoder()
    try:
        for answer in range(2):  # the challenge, then AuthOk
            while (frame := decoder.next_event()) is NEED_DATA:
                data = sock.recv(65536)
                if not data:
                    raise ConnectionError("closed")
                decoder.receive_data(data)
            assert isinstance(frame.message, (AuthChallenge, AuthOk)[answer]), frame.message
            if answer == 0:
                sock.sendall(encode_frame(AuthResponse(os.urandom(32), b""), 0))
    except OSError:
        sock.close()
        return None
    sock.setblocking(False)  # for _is_open
    return sock


def _is_open(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def test_idle_connections_past_the_bound_crowd_out_their_own_kind_not_a_node(tmp_path):
    """Authenticated connections were uncapped: idle ones that a client never closed took every
    descriptor of the master, and then no client nor node could connect. Now a master holds
    at most a share of its open files limit; past it, the connections silent the longest go,
    never a live node's link, and newcomers (a client, a node) get in."""
    from kvpool import Store
    from kvpool.cli.launcher import spawn
    from kvpool.errors import KVPoolError

    wrapper = ("prlimit", f"--nofile={MASTER_OPEN_FILES}:{MASTER_OPEN_FILES}")
    master = spawn("master", ["master", "--port", "0", "--http-port", "0"], tmp_path, wrapper=wrapper)
    processes, held = [master], []
    try:
        endpoint = master.info["endpoint"]
        processes.append(spawn("node1", ["node", "--master", endpoint, "--memory", "16MiB"], tmp_path))
        value = b"v" * 1_000
        with Store(endpoint, token="", shm_enabled=False) as store:
            store.put("kept", value)
            for opened in range(MASTER_OPEN_FILES + 100):  # more than the master has descriptors for
                if (sock := _authenticated(endpoint)) is not None:
                    held.append(sock)
                if opened % 100 == 0:
                    assert store.get("kept") == value  # an established client is served throughout
            # Those of the node and of the store among them.
            wait_until(lambda: sum(map(_is_open, held)) <= MASTER_CONNECTIONS_MAX - 2)

            def a_newcomer_sees_the_node() -> bool:
                try:
                    with Store(endpoint, token="", shm_enabled=False) as newcomer:
                        return [s.state for s in newcomer.cluster_status().segments] == ["active"]
                except KVPoolError:  # refused: no connection silent long enough to go yet
                    return False

            wait_until(a_newcomer_sees_the_node)
            processes.append(spawn("node2", ["node", "--master", endpoint, "--memory", "16MiB"], tmp_path))
            assert store.get("kept") == value  # its connection may have gone: it opens another
        said = master.log_path.read_text()
        assert "the least recently heard of" in said and "a client that does not close its connections?" in said
        assert "lost the connection to the node" not in said, said  # node1's link was never closed
    finally:
        for sock in held:
            sock.close()
        for process in reversed(processes):
            process.stop()
