"""`NodeLinks`: a sync Store's transfers with other hosts' nodes, from the caller's own thread.

A get's reads of other hosts' nodes, and a lone put's writes there, went through the Store's
loop thread: the caller handed the job over, the loop sent each node its frame on a pooled
connection, took the replies in epoll-driven callbacks and handed the job back. For a batch of
KV pages that hand-off and the loop's machinery cost more than the transfer: 4 KiB pages over
TCP in batches of 128, gets 1.05-1.53x (median 1.16) and puts 0.97-1.68x (median 1.25) the
objects/s of the loop's way when done here (ten alternating rounds each in one cluster,
2026-12-02; docs/performance.md). So each caller thread keeps a blocking connection of its own
to each node it talks to (transports/blocking.py), sends every node of a round its frame at
once, and takes each reply in turn: a read's payload lands straight in the job's buffers
(recv_into), a write's leaves straight from the caller's (sendmsg), as a plain socket pair
moves bytes. The loop is not woken.

Only rounds of one frame per node (up to transfer.FRAME_BYTES_TARGET, 4 MiB, for each) go
here: a larger one goes through the loop, whose lanes carry a node's frames side by side
(1 MiB objects in batches of 32, eight frames a node: 0.76-1.25x, median 0.96, of the loop's
GB/s when read here; ten alternating rounds, 2026-12-02).

The rules are the loop's (AsyncStore._read_remote, _put_finish): a frame that fails (the node
refused it, the connection broke, the transfer deadline passed) fails its keys: a read's move
on to their next replica, replica by replica; a write's key fails when no replica was written,
and is revoked. A round that finds no connection here for one of its nodes (this thread is not
one of the Store's NODE_LINK_THREADS_MAX, it talks to more than NODE_LINKS_PER_THREAD_MAX
nodes, or opening one failed in the last NODE_RETRY_AFTER_S) sends nothing: it goes through
the loop.
"""

from __future__ import annotations

import logging
import time

from kvpool import limits
from kvpool.client.thread_links import ThreadLink, ThreadLinks
from kvpool.client.transfer import GetJob, RemoteBatch, write_landing
from kvpool.config import ClientConfig
from kvpool.errors import ConnectFailed, KVPoolError, Unauthorized, error_from_code
from kvpool.protocol.messages import ErrorReply, WriteSlices
from kvpool.transports.blocking import BlockingConnection

log = logging.getLogger(__name__)

# How many threads of a Store, and nodes per thread, hold a connection of their own. A thread
# beyond either reads through the loop (a process of many threads and many nodes would
# otherwise hold threads x nodes sockets).
NODE_LINK_THREADS_MAX = 16
NODE_LINKS_PER_THREAD_MAX = 16
# After a failed open, or no free place for the thread: read through the loop for this long
# before trying again.
NODE_RETRY_AFTER_S = 5.0
NODE_OPEN_TIMEOUT_MS = 1_000


class _ThreadNodes(ThreadLink):
    """One caller thread's connections to nodes."""

    __slots__ = ("conns", "retry_at")

    def __init__(self) -> None:
        super().__init__()
        self.conns: dict[str, BlockingConnection] = {}
        self.retry_at: dict[str, float] = {}  # endpoint -> when to try opening it again

    def drop(self, endpoint: str) -> None:
        conn = self.conns.pop(endpoint, None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        for endpoint in list(self.conns):
            self.drop(endpoint)


class NodeLinks:
    """Each caller thread's blocking connections to the nodes it reads from (see the module)."""

    def __init__(self, key: bytes | None, config: ClientConfig) -> None:
        self._key = key
        self._open_timeout_ms = min(config.connect_timeout_ms, NODE_OPEN_TIMEOUT_MS)
        self._transfer_timeout_ms = config.transfer_timeout_ms
        self._prefer_local = config.shm_enabled
        self._links = ThreadLinks(_ThreadNodes, NODE_LINK_THREADS_MAX, NODE_RETRY_AFTER_S)

    def read(self, job: GetJob) -> bool:
        """Read the job's keys that wait for other hosts' nodes from this thread, replica after
        replica. True: done (each key read, or a miss); False: a round was not for this thread
        (see the module) and nothing of it was sent: the caller reads the rest through the loop.
        """
        for _ in range(limits.REPLICA_NUM_MAX):
            batches = job.remote_batches()
            if not batches:
                return True
            conns = self._connections(batches)
            if conns is None:
                return False
            failed = self._round(batches, conns)
            job.remote_done({i for batch in batches for i in batch.owners[0]}, set().union(*failed))
            job.copy_local()  # a failed key's next replica may be mapped (or a file) here
        return True

    def write(self, batches: list[RemoteBatch]) -> list[set[int]] | None:
        """Write a put's frames for other hosts' nodes (PutJob.remote) from this thread: per
        batch, the key indexes whose frame failed; None when they are not for this thread (see
        the module) and nothing was sent: the caller writes through the loop."""
        conns = self._connections(batches)
        return None if conns is None else self._round(batches, conns)

    def _round(self, batches: list[RemoteBatch], conns: list[BlockingConnection]) -> list[set[int]]:
        """Send each node its frame, then take the replies in turn: per batch, the key indexes
        whose frame failed (the node refused it, the connection broke, the deadline passed)."""
        deadline = time.monotonic() + self._transfer_timeout_ms / 1000
        failed: list[set[int]] = [set() for _ in batches]
        sent: list[tuple[int, BlockingConnection, int, list[memoryview]]] = []
        for index, (batch, conn) in enumerate(zip(batches, conns)):
            ((message, views),) = batch.frames
            try:
                if isinstance(message, WriteSlices):
                    sent.append((index, conn, conn.send_payload(message, views, write_landing(message), deadline), []))
                else:
                    (request_id,) = conn.send([message], deadline)
                    sent.append((index, conn, request_id, views))
            except KVPoolError as exc:
                self._failed(batches[index], exc, failed[index])
        for index, conn, request_id, sinks in sent:
            try:
                _, reply = conn.reply_into({request_id: sinks}, deadline)
                if isinstance(reply, ErrorReply):  # the node refused the frame
                    raise error_from_code(reply.code, reply.message)
            except KVPoolError as exc:
                self._failed(batches[index], exc, failed[index])
        return failed

    def _failed(self, batch: RemoteBatch, exc: KVPoolError, failed: set[int]) -> None:
        log.info("transfer with %s failed: %s", batch.endpoint, exc)
        failed.update(batch.owners[0])
        link = self._links.link()
        conn = link.conns.get(batch.endpoint)
        if conn is not None and conn.is_closed():
            link.drop(batch.endpoint)

    def _connections(self, batches: list[RemoteBatch]) -> list[BlockingConnection] | None:
        """This thread's connection to each batch's node, opened when needed; None when the
        batches are not for this thread (see the module)."""
        if any(len(batch.frames) != 1 for batch in batches):
            return None  # over a frame for a node: the loop's lanes carry its frames side by side
        link = self._links.link()
        if not link.is_admitted or self._links.is_closed:
            return None
        conns = []
        for endpoint in [batch.endpoint for batch in batches]:
            conn = link.conns.get(endpoint)
            if conn is None or not conn.is_usable():  # a node that restarted closed it
                link.drop(endpoint)
                conn = self._open(link, endpoint)
                if conn is None:
                    return None
            conns.append(conn)
        return conns

    def _open(self, link: _ThreadNodes, endpoint: str) -> BlockingConnection | None:
        if len(link.conns) >= NODE_LINKS_PER_THREAD_MAX or time.monotonic() < link.retry_at.get(endpoint, 0.0):
            return None
        try:
            conn = BlockingConnection.open(
                endpoint, key=self._key, timeout_ms=self._open_timeout_ms, prefer_local=self._prefer_local
            )
        except (ConnectFailed, Unauthorized) as exc:
            log.info("no connection of this thread to node %s (reading through the loop): %s", endpoint, exc)
            link.retry_at[endpoint] = time.monotonic() + NODE_RETRY_AFTER_S
            return None
        link.conns[endpoint] = conn
        if self._links.is_closed:  # closed meanwhile by another thread
            link.close()
            return None
        return conn

    def connections(self) -> list[BlockingConnection]:
        """The open connections of live threads."""
        return [conn for link in self._links.admitted() for conn in link.conns.values() if not conn.is_closed()]

    def close(self) -> None:
        self._links.close()


__all__ = ["NodeLinks"]
