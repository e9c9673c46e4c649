"""NodeLinks (kvpool/client/node_links.py): a sync Store's reads and writes of several nodes
from the calling thread, none held by a node that stops.

How: raw sockets play two nodes (conftest.raw_server). Reads: one never answers, the other
answers a read larger than the socket buffers hold, so that its sender waits for the reader.
Writes: one never reads (its socket's buffers fill long before the frame is sent), the other
reads the frame and answers. Cluster tests (test_cluster.py) cover the same paths against real
node processes.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import xxhash
from conftest import raw_server, requests_read

from kvpool.client.node_links import NodeLinks
from kvpool.client.slow_nodes import SlowNodes
from kvpool.client.transfer import GetJob, PutJob, now_monotonic_ms
from kvpool.config import ClientConfig
from kvpool.errors import ErrorCode
from kvpool.protocol.auth import Keyring
from kvpool.protocol.frames import NEED_DATA, FrameDecoder, PayloadDone, encode_frame
from kvpool.protocol.messages import (
    GetReplicaListReply,
    OkReply,
    PutStartReply,
    ReadReply,
    Replica,
    SegmentInfo,
    WriteGrant,
)  # fmt: skip

MIB = 1 << 20


def test_a_node_that_never_answers_holds_none_of_another_nodes_reply() -> None:
    """A read of two nodes: the first asked never answers; the second's reply (3 MiB from a
    sender whose buffer holds 256 KiB: it can only finish while the reader reads) still lands
    whole within the deadline, and only the silent node's key fails. (With a 16 KiB buffer the
    3 MiB took 0.5-1.0 s on an idle machine, up to 1.2 s on a busy one, against the deadline of
    1.5 s: the CI run of 17187e4 failed one test whose output fits this one's, every key of the
    answering node missed; with 256 KiB, 5-17 ms on the busy machine.)"""
    stored = os.urandom(3 * MIB)  # what the answering node holds at offset 0
    silent_value = os.urandom(MIB)
    released = threading.Event()

    def never_answer(conn: socket.socket) -> None:
        requests_read(conn, 1)
        released.wait(10)

    def answer(conn: socket.socket) -> None:
        (request,) = requests_read(conn, 1)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 256 * 1024)
        payload = b"".join(stored[item.offset : item.offset + item.size] for item in request.message.items)
        frame = encode_frame(ReadReply(len(payload)), request.request_id, is_reply=True, payload_size=len(payload))
        conn.sendall(frame + payload)
        released.wait(10)

    with raw_server(never_answer) as silent, raw_server(answer) as answering:
        infos = {
            "A": SegmentInfo("A", "node-A", "elsewhere", silent, "", b"t", 1 << 30),
            "B": SegmentInfo("B", "node-B", "elsewhere", answering, "", b"t", 1 << 30),
        }
        values = [silent_value] + [stored[i * MIB : (i + 1) * MIB] for i in range(3)]
        reply = GetReplicaListReply(
            [0] * 4, [MIB] * 4, [xxhash.xxh3_64_intdigest(v) for v in values],
            [[Replica("A", 0)]] + [[Replica("B", i * MIB)] for i in range(3)], 10_000, infos,
        )  # fmt: skip
        job = GetJob(reply, [None] * 4, now_monotonic_ms(), lambda info: None, ["a", "b0", "b1", "b2"])
        job.copy_local()  # nothing is mapped here
        assert [batch.endpoint for batch in job.remote_batches()] == [silent, answering]  # the silent first
        links = NodeLinks(Keyring(), ClientConfig(shm_enabled=False, transfer_timeout_ms=1_500), SlowNodes())
        try:
            started = time.monotonic()
            assert links.read(job)
            assert time.monotonic() - started < 3
            job.finish(now_monotonic_ms())
            assert job.results[1:] == values[1:]
            assert job.results[0] is None and job.codes[0] == ErrorCode.TRANSFER_FAIL
            assert [conn.peer for conn in links.connections()] == [answering]  # the silent one's is closed
        finally:
            released.set()
            links.close()


def request_with_payload_read(conn: socket.socket, payload: bytearray) -> int:
    """A raw node's read of one request frame with its payload (into `payload`): its id."""
    decoder = FrameDecoder()
    while (frame := decoder.next_event()) is NEED_DATA:
        decoder.receive_data(conn.recv(1 << 16))
    payload[:] = bytes(frame.payload_size)
    decoder.set_payload_sinks([payload])
    while not isinstance(decoder.next_event(), PayloadDone):
        decoder.receive_data(conn.recv(1 << 16))
    return frame.request_id


@pytest.mark.parametrize(
    "transfer_timeout_ms, grant_ttl_ms",
    [(1_500, 0), (30_000, 1_500)],
    ids=["the transfer timeout", "two thirds of the grants' life"],
)
def test_a_node_that_never_reads_holds_none_of_another_nodes_write(transfer_timeout_ms, grant_ttl_ms) -> None:
    """A put of one 4 MiB key with a replica on each of two nodes: the first never reads (a
    frame of 4 MiB cannot fit the socket buffers), the second reads it and answers. The second
    replica is written within the deadline, the first fails, and the key counts as written.
    The deadline is the sooner of the transfer timeout and two thirds of the grants' life: a
    writer that waited a 30 s transfer timeout out on a stalled node raced the master's
    discard of its put (30 s too), which took the written replica with it."""
    value = os.urandom(4 * MIB)
    landed = bytearray()
    released = threading.Event()

    def never_read(conn: socket.socket) -> None:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
        released.wait(10)

    def read_and_answer(conn: socket.socket) -> None:
        request_id = request_with_payload_read(conn, landed)
        conn.sendall(encode_frame(OkReply(), request_id, is_reply=True))
        released.wait(10)

    with raw_server(never_read) as silent, raw_server(read_and_answer) as answering:
        segments = {
            "A": SegmentInfo("A", "node-A", "elsewhere", silent, "", b"t", 1 << 30),
            "B": SegmentInfo("B", "node-B", "elsewhere", answering, "", b"t", 1 << 30),
        }
        grants = [WriteGrant("A", 0, 4 * MIB, 0), WriteGrant("B", 0, 4 * MIB, 0)]
        reply = PutStartReply([0], [[(0, 0), (1, 0)]], grants, segments, grant_ttl_ms)
        job = PutJob(["k"], [[memoryview(value)]], reply, lambda info: None, put_id=1)
        assert [batch.endpoint for batch in job.remote] == [silent, answering]  # the silent first
        config = ClientConfig(shm_enabled=False, transfer_timeout_ms=transfer_timeout_ms)
        links = NodeLinks(Keyring(), config, SlowNodes())
        try:
            started = time.monotonic()
            failed = links.write(job)
            assert time.monotonic() - started < 3
            assert failed == [{0}, set()]
            assert bytes(landed) == value
            assert job.settle_writes(failed) == ([0], [])  # written on one node: the key is put
            assert [conn.peer for conn in links.connections()] == [answering]  # the silent one's is closed
        finally:
            released.set()
            links.close()


def test_a_slow_mark_shortens_reads_by_their_size_and_lapses_whatever_timeouts_come_meanwhile(monkeypatch):
    """A node marked slow gets SLOW_NODE_BUDGET_MS a read and SLOW_NODE_MS_PER_MIB more per
    MiB. A read that overran that shorter budget kept re-marking it: a node that was only busy
    (a long prefix's load takes more than a second) stayed marked for as long as such reads came,
    and each missed part of its keys. A timeout while marked does not extend the mark."""
    from kvpool.client import slow_nodes
    from kvpool.client.slow_nodes import SLOW_NODE_BUDGET_MS, SLOW_NODE_MS, SLOW_NODE_MS_PER_MIB

    now = [1_000.0]
    monkeypatch.setattr(slow_nodes.time, "monotonic", lambda: now[0])
    nodes = SlowNodes()

    def unasked() -> int:
        raise AssertionError("the size of a read of a node not marked is not needed")

    assert nodes.budget_ms("a", 8_000, unasked) == 8_000
    nodes.timed_out("a", 200)  # too short a budget to say anything of the node
    assert nodes.budget_ms("a", 8_000, unasked) == 8_000
    nodes.timed_out("a", 8_000)
    assert nodes.budget_ms("a", 8_000, lambda: 64 << 10) == SLOW_NODE_BUDGET_MS
    assert nodes.budget_ms("a", 8_000, lambda: 1 << 30) == SLOW_NODE_BUDGET_MS + 1024 * SLOW_NODE_MS_PER_MIB
    assert nodes.budget_ms("a", 2_500, lambda: 1 << 30) == 2_500
    assert nodes.budget_ms("b", 8_000, unasked) == 8_000
    now[0] += SLOW_NODE_MS / 1000 - 0.5
    nodes.timed_out("a", SLOW_NODE_BUDGET_MS)  # a read under the shorter budget overran it
    now[0] += 0.6
    assert not nodes.is_slow("a")  # SLOW_NODE_MS after it was marked
    now[0] += 0.5
    nodes.timed_out("a", 1_500)  # begun while it was marked, ended after
    assert not nodes.is_slow("a")
    now[0] += 1.0
    nodes.timed_out("a", 1_000)  # begun after the mark ended
    assert nodes.is_slow("a")
    began_marked = now[0]
    now[0] += 0.1
    nodes.answered("a")  # a transfer in time
    assert nodes.budget_ms("a", 8_000, unasked) == 8_000
    now[0] += 1.0
    nodes.timed_out("a", 1_100, began_marked)  # begun before the answer, while marked
    assert not nodes.is_slow("a")
    now[0] += 4.0
    nodes.timed_out("a", 10_000, now[0] - 2)  # a connect that failed after 2 s of a 10 s round
    assert nodes.is_slow("a")  # (dated 10 s back, it fell in the mark the answer ended: nothing)
