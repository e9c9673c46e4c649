"""A connection steered through someone without the token (a network path, DNS, a leader record
in etcd) is theirs to relay, not to use: every frame after the handshake carries its tag
(protocol/frames.py FrameSeal), so frames they inject, replay or alter close the connection
and change nothing stored; nor can they send a client to a same-host socket of their own (the
master's proof covers its first frame). Real processes: a master and a node with a token, a
Store (or either I/O shell) that dials a relay in this test, which forwards its bytes to the
master and adds its own or changes the master's. And a client without the token is named in
the master's log."""

from __future__ import annotations

import asyncio
import os
import socket
import threading

import msgspec
import pytest
from conftest import requests_read, wait_until

from kvpool import Store, limits
from kvpool.errors import KVPoolError, Unauthorized
from kvpool.protocol import auth
from kvpool.protocol.frames import FLAG_SEALED, NEED_DATA, FrameDecoder, FrameSeal, encode_frame
from kvpool.protocol.messages import AuthResponse, Remove, RemoveAll
from kvpool.transports import same_host
from kvpool.transports.blocking import BlockingConnection
from kvpool.transports.connection import connect

TOKEN = "relayed-connections-token"


class Relay:
    """Forwards each connection it accepts to `upstream`, byte for byte, and keeps, per
    connection, its upstream socket and every byte the client sent it (`sent`). It listens on
    TCP, or on the abstract Unix socket `unix_name`; `challenge_changes` are set in the
    server's first frame on the way."""

    def __init__(self, upstream: tuple[str, int], unix_name: str = "", **challenge_changes: object) -> None:
        self._upstream = upstream
        self._challenge_changes = challenge_changes
        if unix_name:
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._listener.bind(unix_name)
            self._listener.listen()
        else:
            self._listener = socket.create_server(("127.0.0.1", 0))
            self.endpoint = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.links: list[tuple[socket.socket, bytearray, threading.Event]] = []
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            up = socket.create_connection(self._upstream)
            sent, closed = bytearray(), threading.Event()
            self._sockets += [client, up]
            if self._challenge_changes:
                decoder = FrameDecoder()
                while (challenge := decoder.next_event()) is NEED_DATA:
                    decoder.receive_data(up.recv(4096))
                changed = msgspec.structs.replace(challenge.message, **self._challenge_changes)
                client.sendall(encode_frame(changed, 0))
            self.links.append((up, sent, closed))
            threading.Thread(target=self._pipe, args=(client, up, sent, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(up, client, None, closed), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket, kept: bytearray | None, closed: threading.Event | None):
        try:
            while data := source.recv(65536):
                if kept is not None:
                    kept += data
                sink.sendall(data)
        except OSError:
            pass
        finally:
            if closed is not None:
                closed.set()  # the master closed its end
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()


def _frames_sent(data: bytes) -> list[bytes]:
    """The frames in what a client sent, each as its bytes, split by their headers' sizes."""
    frames, offset = [], 0
    while offset < len(data):
        control_size = int.from_bytes(data[offset + 8 : offset + 12], "little")
        payload_size = int.from_bytes(data[offset + 12 : offset + 20], "little")
        size = limits.FRAME_HEADER_SIZE_BYTES + control_size + payload_size
        frames.append(bytes(data[offset : offset + size]))
        offset += size
    return frames


def _message_of(frame: bytes):
    """The message of a sealed frame without payload, its tag not checked (this test is not
    an end of that connection)."""
    tag_size = limits.FRAME_TAG_SIZE_BYTES
    control_size = int.from_bytes(frame[8:12], "little") - tag_size
    unsealed = bytearray(frame[: limits.FRAME_HEADER_SIZE_BYTES + control_size])
    unsealed[3] &= ~FLAG_SEALED
    unsealed[8:12] = control_size.to_bytes(4, "little")
    decoder = FrameDecoder()
    decoder.receive_data(bytes(unsealed))
    return decoder.next_event().message


@pytest.fixture
def relayed(make_cluster):
    cluster = make_cluster(1, "16MiB", token=TOKEN)
    host, port = cluster.master_endpoint.rsplit(":", 1)
    relay = Relay((host, int(port)))
    yield cluster, relay
    relay.close()


@pytest.mark.parametrize("forged_with", ["no tag", "a key of its own"])
def test_frames_injected_into_a_relayed_connection_close_it_and_remove_nothing(relayed, forged_with):
    cluster, relay = relayed
    keys = [f"held/{i}" for i in range(8)]
    with Store(relay.endpoint, token=TOKEN, shm_enabled=False) as victim:
        victim.put_batch(keys, [bytes([i]) * 4096 for i in range(8)])
        assert relay.links, "the Store dialled the relay"
        # Whoever relays holds authenticated connections: it sends a RemoveAll of its own.
        seal = None if forged_with == "no tag" else FrameSeal(os.urandom(32))
        forged = encode_frame(RemoveAll(force=True), 4_000_000_000, seal=seal)
        for up, _, _ in relay.links:
            up.sendall(forged)
        for _, _, closed in relay.links:
            assert closed.wait(10), "the master kept a connection that carried a forged frame"
        assert wait_until(lambda: "does not hold" in cluster.master.log_tail(100) or "without its tag"
                          in cluster.master.log_tail(100), 5), cluster.master.log_tail(30)  # fmt: skip
    with Store(cluster.master_endpoint, token=TOKEN, shm_enabled=False) as owner:
        assert [owner.get(key) for key in keys] == [bytes([i]) * 4096 for i in range(8)]


def test_a_request_replayed_on_its_connection_closes_it_and_acts_once(relayed):
    """The relay records a Remove the client sent, the client writes that key again, and the
    relay sends the recorded frame again: a frame's tag holds for its place in the sequence
    only, so the master refuses it instead of removing the key a second time."""
    cluster, relay = relayed
    with Store(relay.endpoint, token=TOKEN, shm_enabled=False) as victim:
        victim.put("phoenix", b"first life")
        victim.remove("phoenix")
        victim.put("phoenix", b"second life")
        removes = [
            (up, closed, frame)
            for up, sent, closed in relay.links
            for frame in _frames_sent(bytes(sent))[1:]  # the first is the handshake's answer
            if isinstance(_message_of(frame), Remove)
        ]
        assert len(removes) == 1, "the relay saw the client's Remove"
        up, closed, remove = removes[0]
        up.sendall(remove)
        assert closed.wait(10), "the master took a replayed frame"
        assert victim.get("phoenix") == b"second life"  # on a new connection
    with Store(cluster.master_endpoint, token=TOKEN, shm_enabled=False) as owner:
        assert owner.get("phoenix") == b"second life"



@pytest.mark.skipif(not same_host.host_identity(), reason="no boot id or network namespace to read here")
@pytest.mark.parametrize("shell", ["blocking", "event loop"])
def test_a_same_host_socket_named_by_a_relay_is_never_taken(relayed, shell):
    """A relay names, in the master's first frame, an abstract Unix socket it bound itself
    (the master runs on this host, so the client would move there), behind which it forwards
    to the master. The master's proof covers the name: the client of either shell refuses the
    master, and sends through that socket nothing but its answer to the challenge. Before, the
    proof covered the nonces only, and the client moved to the relay's socket for good."""
    cluster, _ = relayed
    host, port = cluster.master_endpoint.rsplit(":", 1)
    relays_own = f"\0kvpool-relays-own-{os.urandom(8).hex()}"
    behind = Relay((host, int(port)), unix_name=relays_own)
    relay = Relay((host, int(port)), local_name=relays_own)
    key = auth.cluster_key(TOKEN)

    async def connected() -> None:
        (await connect(relay.endpoint, key=key, timeout_ms=5_000, prefer_local=True)).close()

    try:
        with pytest.raises(Unauthorized, match="changed on the way"):
            if shell == "blocking":
                BlockingConnection.open(relay.endpoint, key=key, timeout_ms=5_000, prefer_local=True).close()
            else:
                asyncio.run(connected())
        assert relay.links, "the client dialled the relay"
        assert all(len(_frames_sent(bytes(sent))) <= 1 for _, sent, _ in behind.links), "a request went through"
    finally:
        relay.close()
        behind.close()


def test_a_client_without_the_token_is_named_in_the_masters_log_once_a_while(make_cluster):
    """A client without the token, at a master that has one, is refused, and the master says
    why in one line that names the peer, however many such clients come (repeated_log.py).
    Before, it logged nothing: the client closed at the challenge, and an operator asking why
    a client does not connect found nothing on the master's side."""
    cluster = make_cluster(0, token=TOKEN)
    host, port = cluster.master_endpoint.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:  # as a client without the token answers
        requests_read(sock, 1)  # the challenge
        sock.sendall(encode_frame(AuthResponse(os.urandom(limits.AUTH_NONCE_SIZE_BYTES), b""), 0))
        (refusal,) = requests_read(sock, 1)
        assert "requires a cluster token" in refusal.message.message, refusal
        first = "%s:%d" % sock.getsockname()
    for _ in range(20):  # a flood of them
        with pytest.raises(Unauthorized, match="requires a cluster token"):
            BlockingConnection.open(cluster.master_endpoint, key=None, timeout_ms=5_000, prefer_local=False)
    said = f"peer {first} sent no token; this cluster requires one"
    assert wait_until(lambda: said in cluster.master.log_tail(200), 10), cluster.master.log_tail(30)
    assert cluster.master.log_tail(200).count("sent no token") == 1, cluster.master.log_tail(30)


@pytest.mark.parametrize("shell", ["blocking", "asyncio"])
def test_a_client_of_another_wire_version_is_named_in_the_masters_log(make_cluster, monkeypatch, shell):
    """Peers of two wire versions refuse each other. The client, which hears first, said why
    and closed; the master logged nothing, and an operator who upgraded it saw only nodes go
    missing. The client now sends a frame header of its own version before it closes, and the
    master says what it speaks."""
    cluster = make_cluster(0)
    monkeypatch.setattr(limits, "FRAME_VERSION", limits.FRAME_VERSION + 1)  # this process: a newer release
    with pytest.raises(KVPoolError, match=f"wire version {limits.FRAME_VERSION - 1}, this process"):
        if shell == "blocking":
            BlockingConnection.open(cluster.master_endpoint, key=None, timeout_ms=5_000, prefer_local=False)
        else:
            asyncio.run(connect(cluster.master_endpoint, key=None, timeout_ms=5_000))
    said = f"the peer speaks wire version {limits.FRAME_VERSION}, this process {limits.FRAME_VERSION - 1}"
    assert wait_until(lambda: said in cluster.master.log_tail(50), 10), cluster.master.log_tail(30)
