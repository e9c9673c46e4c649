"""BlockingConnection (kvpool/transports/blocking.py): a caller thread's own connection.

How: a real MasterServer on its own event loop thread, with and without a cluster token, asked
from this thread, directly or through a relay that changes its first frame; and raw sockets
playing a server that authenticates and then never answers, or answers garbage. Every failure
must be a typed error within the bound, and leave the connection closed so that a late reply
never answers the next request.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import uvloop
from conftest import raw_server, requests_read

from kvpool import limits
from kvpool.config import MasterConfig
from kvpool.errors import ConnectFailed, ErrorCode, InvalidParams, ObjectNotFound, RpcFailed, RpcTimeout, Unauthorized
from kvpool.master.server import MasterServer
from kvpool.protocol import auth
from kvpool.protocol.frames import NEED_DATA, FrameDecoder, encode_frame
from kvpool.protocol.messages import (
    AuthChallenge,
    CountReply,
    ErrorReply,
    ExistKeys,
    ExistsReply,
    GetReplicaList,
    ListObjects,
    LongestPrefix,
)
from kvpool.transports.blocking import BlockingConnection
from kvpool.transports.connection import connect

TOKEN = "blocking-test-token"


@contextlib.contextmanager
def master_on_a_thread(token: str | None = None) -> Iterator[str]:
    """A MasterServer served by an event loop on another thread; yields its endpoint."""
    loop = uvloop.new_event_loop()
    ready: list[str] = []
    stop = threading.Event()

    async def serve() -> None:
        master = MasterServer(MasterConfig(), port=0, token=token)
        await master.start()
        ready.append(master.endpoint)
        while not stop.is_set():
            await asyncio.sleep(0.01)
        await master.stop()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),))
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not ready and time.monotonic() < deadline and thread.is_alive():
            time.sleep(0.01)
        assert ready, "the master did not start"
        yield ready[0]
    finally:
        stop.set()
        thread.join(30)
        loop.close()


def test_requests_and_error_replies_on_the_unix_socket_and_on_tcp() -> None:
    with master_on_a_thread(TOKEN) as endpoint:
        key = auth.cluster_key(TOKEN)
        local = BlockingConnection.open(endpoint, key=key, timeout_ms=2_000, prefer_local=True)
        tcp = BlockingConnection.open(endpoint, key=key, timeout_ms=2_000, prefer_local=False)
        assert local.peer == f"{endpoint} (same-host socket)" and tcp.peer == endpoint
        for conn in (local, tcp):
            assert conn.request(ExistKeys(["a", "b"]), 2_000) == ExistsReply([False, False])
            assert conn.request(LongestPrefix(["a"]), 2_000) == CountReply(0)
            with pytest.raises(InvalidParams):  # the master's error answer, typed
                conn.request(ListObjects("", 0), 2_000)
            assert conn.request(ExistKeys(["a"]), 2_000) == ExistsReply([False])  # still usable
            conn.close()
            assert conn.is_closed() and not conn.is_usable()
            with pytest.raises(ConnectFailed):  # never sent
                conn.request(ExistKeys(["a"]), 2_000)


def test_a_batch_over_the_limit_closes_its_connection_at_once_and_others_are_served() -> None:
    """A request of more keys than a batch takes (BATCH_KEYS_MAX) is refused by the decoder
    before it reads a key, and its connection closed. A 64 MiB ExistKeys of 22 million
    one-byte keys used to be decoded whole, then refused: 4 s of the master's loop (helper-52),
    during which nodes' heartbeats timed out."""
    with master_on_a_thread() as endpoint:
        hostile = BlockingConnection.open(endpoint, key=None, timeout_ms=2_000, prefer_local=False)
        other = BlockingConnection.open(endpoint, key=None, timeout_ms=2_000, prefer_local=False)
        started_s = time.monotonic()
        with pytest.raises(RpcFailed, match="closed the connection"):
            hostile.request(ExistKeys(["k"] * 20_000_000), 10_000)
        assert time.monotonic() - started_s < 3.0  # sending 40 MB, not decoding 20 million keys
        assert hostile.is_closed()
        assert other.request(ExistKeys(["a"]), 2_000) == ExistsReply([False])
        other.close()


def test_a_token_that_does_not_match_is_refused_either_way() -> None:
    with master_on_a_thread(TOKEN) as endpoint:
        with pytest.raises(Unauthorized):  # no token for a server that requires one
            BlockingConnection.open(endpoint, key=None, timeout_ms=2_000, prefer_local=True)
        with pytest.raises(Unauthorized, match="wrong cluster token"):  # said before the server closes
            BlockingConnection.open(endpoint, key=auth.cluster_key("wrong"), timeout_ms=2_000, prefer_local=True)
    with master_on_a_thread(None) as endpoint:
        with pytest.raises(Unauthorized):  # a token, and a server that has none to prove
            BlockingConnection.open(endpoint, key=auth.cluster_key(TOKEN), timeout_ms=2_000, prefer_local=False)


def assert_both_shells_fail(endpoint: str, key: bytes, error: type[Exception], match: str) -> None:
    """A connect to `endpoint` fails with `error` (its message matching `match`) in the
    blocking shell and in the event loop's."""
    with pytest.raises(error, match=match):
        BlockingConnection.open(endpoint, key=key, timeout_ms=2_000, prefer_local=False)

    async def connect_async() -> None:
        with pytest.raises(error, match=match):
            await connect(endpoint, key=key, timeout_ms=2_000)

    uvloop.run(connect_async())


def test_a_handshake_answered_with_an_error_no_server_sends_is_a_connect_failure_in_both_shells(capfd) -> None:
    """A relay (or a broken peer) that answers a client's proof with an error other than the
    refusal of its token: the client of either shell fails to connect (ConnectFailed, which
    callers retry), where the event loop's printed a "Fatal error on transport" traceback."""
    listener = socket.create_server(("127.0.0.1", 0))
    endpoint = f"127.0.0.1:{listener.getsockname()[1]}"

    def answer_with_an_error() -> None:
        for _ in range(2):  # once per shell
            conn, _ = listener.accept()
            with conn:
                conn.sendall(encode_frame(AuthChallenge(os.urandom(32), True, ""), 0))
                conn.recv(4096)  # the client's proof
                conn.sendall(encode_frame(ErrorReply(int(ErrorCode.INTERNAL_ERROR), "no such luck"), 0, is_reply=True))
                conn.recv(4096)  # until the client closes

    thread = threading.Thread(target=answer_with_an_error, daemon=True)
    thread.start()
    key = auth.cluster_key(TOKEN)
    try:
        assert_both_shells_fail(endpoint, key, ConnectFailed, "answered the handshake with error")
    finally:
        listener.close()
        thread.join(10)
    assert "Traceback" not in capfd.readouterr().err


@contextlib.contextmanager
def challenge_changed(endpoint: str, **fields: object) -> Iterator[str]:
    """A relay in front of `endpoint` that sets these fields of the server's challenge (its
    first frame) and forwards every other byte unchanged; yields its endpoint."""
    host, port = endpoint.rsplit(":", 1)
    listener = socket.create_server(("127.0.0.1", 0))
    sockets = [listener]

    def pipe(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
            sink.shutdown(socket.SHUT_RDWR)

    def relay() -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection((host, int(port)))
            sockets.extend((client, upstream))
            decoder = FrameDecoder()
            while (frame := decoder.next_event()) is NEED_DATA:
                decoder.receive_data(upstream.recv(4096))
            client.sendall(encode_frame(msgspec.structs.replace(frame.message, **fields), 0))
            for ends in ((client, upstream), (upstream, client)):
                threading.Thread(target=pipe, args=ends, daemon=True).start()

    threading.Thread(target=relay, daemon=True).start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        for sock in sockets:
            sock.close()


@pytest.mark.parametrize("field", ["local_name", "local_host"])
def test_a_challenge_changed_on_the_way_fails_the_handshake_in_both_shells(field: str) -> None:
    """The server's proof covers every field of its challenge, so a client of either shell
    that received a changed one refuses the server, and its connection closes. Before, only
    the nonces were covered: a relay could name a same-host socket of its own, or make a
    server on another host look like this host's, and the handshake went through."""
    key = auth.cluster_key(TOKEN)
    changed = {"local_name": "\0kvpool-a-relays-own", "local_host": "another-boot-id/4026531840"}[field]
    with master_on_a_thread(TOKEN) as endpoint:
        with challenge_changed(endpoint) as untouched:  # a relay alone fails nothing
            BlockingConnection.open(untouched, key=key, timeout_ms=2_000, prefer_local=False).close()
        with challenge_changed(endpoint, **{field: changed}) as relayed:
            assert_both_shells_fail(relayed, key, Unauthorized, "changed on the way")


def test_is_usable_sees_a_peer_that_closed_without_waiting() -> None:
    closing = threading.Event()
    with raw_server(lambda conn: closing.wait(10)) as endpoint:
        conn = BlockingConnection.open(endpoint, key=None, timeout_ms=5_000, prefer_local=False)
        started = time.monotonic()
        assert conn.is_usable() and conn.is_usable()
        assert time.monotonic() - started < 0.5  # a peek, not a wait for the timeout
        assert not conn.is_closed()  # the peeks leave it open
        closing.set()  # the server closes its end
        deadline = time.monotonic() + 5
        while conn.is_usable() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert conn.is_closed()
        with pytest.raises(ConnectFailed):  # nothing is sent on a closed connection
            conn.request(ExistKeys(["a"]), 1_000)


def test_a_server_that_never_answers_is_a_timeout_within_the_bound() -> None:
    done = threading.Event()
    with raw_server(lambda conn: done.wait(10)) as endpoint:
        conn = BlockingConnection.open(endpoint, key=None, timeout_ms=2_000, prefer_local=False)
        started = time.monotonic()
        with pytest.raises(RpcTimeout):
            conn.request(ExistKeys(["a"]), 300)
        assert 0.25 < time.monotonic() - started < 2
        assert conn.is_closed()  # a late reply cannot answer the next request
        done.set()


def test_a_server_not_yet_authenticated_may_not_send_a_large_control_message() -> None:
    """Until the handshake is over the decoder takes control messages of 64 KiB at most
    (HANDSHAKE_CONTROL_SIZE_BYTES_MAX), as Connection's does: a first frame that announced
    72 MiB, from a server or whatever a client was steered to, was waited for and decoded.
    Once authenticated, a reply of more than that is taken as before."""
    listener = socket.create_server(("127.0.0.1", 0))
    endpoint = f"127.0.0.1:{listener.getsockname()[1]}"

    def announce_a_large_challenge() -> None:
        conn, _ = listener.accept()
        with conn:
            header = struct.pack(limits.FRAME_HEADER_FMT, limits.FRAME_MAGIC, limits.FRAME_VERSION, 0, 0,
                                 limits.FRAME_CONTROL_SIZE_BYTES_MAX, 0)  # fmt: skip
            conn.sendall(header + bytes(64 * 1024))
            conn.recv(1)  # until the client closes

    server = threading.Thread(target=announce_a_large_challenge, daemon=True)
    server.start()
    started_s = time.monotonic()
    with pytest.raises(ConnectFailed, match="too large"):  # not the timeout, waiting for 72 MiB
        BlockingConnection.open(endpoint, key=None, timeout_ms=5_000, prefer_local=False)
    assert time.monotonic() - started_s < 2
    server.join(10)
    listener.close()

    def answer_large(conn: socket.socket) -> None:
        request_id = requests_read(conn, 1)[0].request_id
        reply = ErrorReply(int(ErrorCode.OBJECT_NOT_FOUND), "x" * 200_000)  # over the handshake's 64 KiB
        conn.sendall(encode_frame(reply, request_id, is_reply=True))
        time.sleep(0.2)

    with raw_server(answer_large) as endpoint:
        conn = BlockingConnection.open(endpoint, key=None, timeout_ms=2_000, prefer_local=False)
        with pytest.raises(ObjectNotFound, match="x" * 1000):  # the reply, whole
            conn.request(ExistKeys(["a"]), 2_000)
        conn.close()


@pytest.mark.parametrize("answer", ["garbage", "wrong request id", "closed"])
def test_a_server_that_breaks_the_protocol_is_a_failure_and_closes_the_connection(answer: str) -> None:
    def reply(conn: socket.socket) -> None:
        conn.recv(4096)  # the request (id 1)
        if answer == "garbage":
            conn.sendall(b"\xff" * 64)
        elif answer == "wrong request id":
            conn.sendall(encode_frame(ExistsReply([True]), 7, is_reply=True))
        time.sleep(0.2)

    with raw_server(reply) as endpoint:
        conn = BlockingConnection.open(endpoint, key=None, timeout_ms=2_000, prefer_local=False)
        with pytest.raises(RpcFailed):
            conn.request(ExistKeys(["a"]), 2_000)
        assert conn.is_closed()


def test_requests_in_flight_together_get_their_own_replies() -> None:
    """Several requests sent before any reply is read (a large get's lookups): each reply
    answers its own request, from a real master, in any order the asking takes."""
    with master_on_a_thread(None) as endpoint:
        conn = BlockingConnection.open(endpoint, key=None, timeout_ms=2_000, prefer_local=True)
        deadline = time.monotonic() + 5
        ids = conn.send([ExistKeys(["k"] * n) for n in (1, 2, 3)], deadline)
        assert conn.reply(ids[0], deadline) == ExistsReply([False])
        assert conn.reply(ids[2], deadline) == ExistsReply([False] * 3)  # the one between is kept
        assert conn.reply(ids[1], deadline) == ExistsReply([False] * 2)
        assert conn.request(LongestPrefix(["a"]), 2_000) == CountReply(0)  # and nothing is left over


def test_replies_out_of_order_each_answer_their_own_request() -> None:
    """A server may answer a later request first (the master's put_start that waits for room
    answers after the next request)."""

    def answer_backwards(conn: socket.socket) -> None:
        for frame in reversed(requests_read(conn, 3)):
            conn.sendall(encode_frame(CountReply(len(frame.message.keys)), frame.request_id, is_reply=True))
        time.sleep(0.2)

    with raw_server(answer_backwards) as endpoint:
        conn = BlockingConnection.open(endpoint, key=None, timeout_ms=2_000, prefer_local=False)
        deadline = time.monotonic() + 5
        ids = conn.send([LongestPrefix(["k"] * n) for n in (1, 2, 3)], deadline)
        assert [conn.reply(request_id, deadline) for request_id in ids] == [CountReply(1), CountReply(2), CountReply(3)]


def test_a_reply_to_no_request_in_flight_is_a_failure() -> None:
    def answer_twice(conn: socket.socket) -> None:
        request_id = requests_read(conn, 1)[0].request_id
        conn.sendall(encode_frame(CountReply(1), request_id, is_reply=True) * 2)  # the second answers nothing
        time.sleep(0.2)

    with raw_server(answer_twice) as endpoint:
        conn = BlockingConnection.open(endpoint, key=None, timeout_ms=2_000, prefer_local=False)
        deadline = time.monotonic() + 5
        first, second = conn.send([LongestPrefix(["a"]), LongestPrefix(["b"])], deadline)
        assert conn.reply(first, deadline) == CountReply(1)
        with pytest.raises(RpcFailed):
            conn.reply(second, deadline)
        assert conn.is_closed()


def test_a_second_reply_to_a_request_whose_reply_waits_is_a_failure() -> None:
    def answer_the_second_twice(conn: socket.socket) -> None:
        requests = requests_read(conn, 2)
        conn.sendall(encode_frame(CountReply(2), requests[1].request_id, is_reply=True) * 2)
        time.sleep(0.2)

    with raw_server(answer_the_second_twice) as endpoint:
        conn = BlockingConnection.open(endpoint, key=None, timeout_ms=2_000, prefer_local=False)
        deadline = time.monotonic() + 5
        first, _ = conn.send([LongestPrefix(["a"]), LongestPrefix(["b", "c"])], deadline)
        with pytest.raises(RpcFailed):
            conn.reply(first, deadline)
        assert conn.is_closed() and not conn.awaits_replies()


def test_replies_with_payloads_land_in_their_own_sinks_in_any_order() -> None:
    """A node's answers to reads (reply_into): each payload lands in its request's sinks,
    also when it comes in many pieces and when a later request is answered first; an error
    reply counts against its request alone (a payload it carries is discarded, not landed) and
    leaves the connection usable; a payload that is not the size of its sinks is a failure that
    closes the connection."""
    from kvpool.protocol.messages import ErrorReply, ReadReply

    first, second = os.urandom(300_000), os.urandom(5)

    def answer(conn: socket.socket) -> None:
        requests = requests_read(conn, 3)
        conn.sendall(encode_frame(ReadReply(len(second)), requests[1].request_id, is_reply=True, payload_size=5))
        conn.sendall(second)
        error = ErrorReply(int(InvalidParams.code), "out of range")  # with a payload, to be discarded
        conn.sendall(encode_frame(error, requests[2].request_id, is_reply=True, payload_size=10) + b"x" * 10)
        header = encode_frame(ReadReply(len(first)), requests[0].request_id, is_reply=True, payload_size=len(first))
        data = header + first
        for at in range(0, len(data), 7_000):  # in many pieces
            conn.sendall(data[at : at + 7_000])
        request_id = requests_read(conn, 1)[0].request_id
        conn.sendall(encode_frame(ReadReply(3), request_id, is_reply=True, payload_size=3) + b"abc")
        time.sleep(0.2)

    with raw_server(answer) as endpoint:
        conn = BlockingConnection.open(endpoint, key=None, timeout_ms=2_000, prefer_local=False)
        deadline = time.monotonic() + 5
        landed = [bytearray(100_000), bytearray(200_000), bytearray(5), bytearray(8)]
        ids = conn.send([ExistKeys(["a"]), ExistKeys(["b"]), ExistKeys(["c"])], deadline)
        sinks = {ids[0]: [memoryview(landed[0]), memoryview(landed[1])], ids[1]: [memoryview(landed[2])],
                 ids[2]: [memoryview(landed[3])]}  # fmt: skip
        answered = {}
        while sinks:
            request_id, reply = conn.reply_into(sinks, deadline)
            answered[request_id] = reply
            del sinks[request_id]
        assert list(answered) == [ids[1], ids[2], ids[0]]
        assert bytes(landed[0] + landed[1]) == first and bytes(landed[2]) == second
        assert isinstance(answered[ids[2]], ErrorReply) and not conn.is_closed()
        assert landed[3] == bytearray(8)  # the error's payload went nowhere
        (request_id,) = conn.send([ExistKeys(["d"])], deadline)
        with pytest.raises(RpcFailed):  # 3 bytes for sinks of 4
            conn.reply_into({request_id: [memoryview(bytearray(4))]}, deadline)
        assert conn.is_closed()


def test_a_reply_still_streaming_in_at_the_deadline_is_a_timeout_not_an_overrun() -> None:
    """Past its deadline a request took whatever the socket held, call after call, with a 1 µs
    timeout each: a large reply that kept coming was landed whole, however long after the
    deadline (here 1 GiB, several times the bound). It is now a timeout shortly after it."""
    from kvpool.protocol.messages import ReadReply

    chunk = os.urandom(limits.MIB)
    size = 1024 * limits.MIB

    def answer(conn: socket.socket) -> None:
        request_id = requests_read(conn, 1)[0].request_id
        conn.sendall(encode_frame(ReadReply(size), request_id, is_reply=True, payload_size=size))
        with contextlib.suppress(OSError):  # until the client gives up and closes
            for _ in range(size // len(chunk)):
                conn.sendall(chunk)

    with raw_server(answer) as endpoint:
        conn = BlockingConnection.open(endpoint, key=None, timeout_ms=2_000, prefer_local=False)
        sink = memoryview(bytearray(limits.MIB))  # every MiB of the payload lands here
        started = time.monotonic()
        deadline = started + 0.1
        (request_id,) = conn.send([ExistKeys(["a"])], deadline)
        with pytest.raises(RpcTimeout):
            conn.reply_into({request_id: [sink] * (size // limits.MIB)}, deadline)
        assert time.monotonic() - started < 0.1 + 0.5
        assert conn.is_closed()


def test_a_request_with_a_payload_of_many_parts_arrives_whole(monkeypatch) -> None:
    """send_payload (a node's write): the header and every part (an empty one too), gathered a
    few buffers per sendmsg and resumed where a partial send stopped (8 MiB fill the socket's
    buffer), arrive as one frame whose payload is the parts in order; its reply comes back by
    reply_into."""
    from kvpool.protocol.messages import CodesReply
    from kvpool.transports import blocking

    monkeypatch.setattr(blocking, "IOV_PARTS_MAX", 3)
    parts = [os.urandom(size) for size in (1, 4096, 0, 5_000_000, 7, 3_000_000, 100, 0)]
    received: list[bytes] = []

    def receive(conn: socket.socket) -> None:
        decoder = FrameDecoder()
        frame = None
        while frame is None or frame is NEED_DATA:
            decoder.receive_data(conn.recv(1 << 16))
            frame = decoder.next_event()
        payload = bytearray(frame.payload_size)
        decoder.set_payload_sinks([memoryview(payload)])
        while decoder.next_event() is NEED_DATA:
            decoder.receive_data(conn.recv(1 << 20))
        received.append(bytes(payload))
        conn.sendall(encode_frame(CodesReply([0]), frame.request_id, is_reply=True))
        time.sleep(0.2)

    with raw_server(receive) as endpoint:
        conn = BlockingConnection.open(endpoint, key=None, timeout_ms=2_000, prefer_local=False)
        deadline = time.monotonic() + 10
        views = [memoryview(p) for p in parts]
        sent: list[int] = []
        sending = threading.Thread(
            target=lambda: sent.append(conn.send_payload(ExistKeys(["k"]), views, 0, deadline)), daemon=True
        )
        sending.start()
        sending.join(10)
        assert not sending.is_alive(), "send_payload did not return (a trailing empty part must not spin)"
        (request_id,) = sent
        assert conn.reply_into({request_id: []}, deadline) == (request_id, CodesReply([0]))
        assert received == [b"".join(parts)] and not conn.awaits_replies()


def test_close_from_another_thread_wakes_a_waiting_request() -> None:
    done = threading.Event()
    with raw_server(lambda conn: done.wait(10)) as endpoint:
        conn = BlockingConnection.open(endpoint, key=None, timeout_ms=2_000, prefer_local=False)
        threading.Timer(0.2, conn.close).start()
        started = time.monotonic()
        with pytest.raises((RpcFailed, ConnectFailed)):
            conn.request(ExistKeys(["a"]), 5_000)
        assert time.monotonic() - started < 2
        done.set()


def test_frames_decode_as_the_loop_side_sends_them() -> None:
    """The blocking side and Connection share one codec: a reply encoded for one decodes in
    the other (a guard against the two shells drifting apart)."""
    decoder = FrameDecoder()
    decoder.receive_data(encode_frame(CountReply(3), 5, is_reply=True))
    frame = decoder.next_event()
    assert frame.message == CountReply(3) and frame.request_id == 5 and frame.is_reply


def test_requests_that_fill_the_socket_while_replies_come_are_sent_whole_and_answered() -> None:
    """Pipelined requests larger than the sockets' buffers, to a peer that answers each as it
    reads it and stops reading while its replies go unread (as a kvpool server does): the
    sender wrote them all before reading any reply, and both sides waited on each other
    until the deadline. Replies that come while requests still go out are kept; a send the
    peer does not take by the deadline is an RpcTimeout, never the builtin TimeoutError."""
    ours, theirs = socket.socketpair()
    for sock in (ours, theirs):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    requests = [GetReplicaList([f"{i:04d}-{n:04d}".ljust(1000, "k") for n in range(64)]) for i in range(16)]

    def answering_peer() -> None:  # blocking writes: it stops reading while a reply waits to go
        decoder = FrameDecoder()
        answered = 0
        while answered < len(requests):
            received = theirs.recv_into(decoder.get_buffer())
            if not received:
                return
            decoder.buffer_updated(received)
            while (frame := decoder.next_event()) is not NEED_DATA:
                reply = ErrorReply(int(ErrorCode.OBJECT_NOT_FOUND), "x" * 100_000)  # a large reply
                theirs.sendall(encode_frame(reply, frame.request_id, is_reply=True))
                answered += 1

    peer = threading.Thread(target=answering_peer, daemon=True)
    peer.start()
    conn = BlockingConnection("peer:1", ours, "peer")
    conn._decoder.limit_control_size(limits.FRAME_CONTROL_SIZE_BYTES_MAX)  # as its handshake would (none here)
    deadline = time.monotonic() + 10
    request_ids = conn.send(requests, deadline)  # 1 MB of requests, 1.6 MB of replies
    for request_id in request_ids:
        with pytest.raises(ObjectNotFound):
            conn.reply(request_id, deadline)
    peer.join(10)
    silent, _ = socket.socketpair()  # a peer that reads nothing: the send times out, typed
    with pytest.raises(RpcTimeout):
        BlockingConnection("peer:2", silent, "peer").send(requests, time.monotonic() - 1)
