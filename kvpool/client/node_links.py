"""`NodeLinks`: a sync Store's transfers with other hosts' nodes, from the caller's own thread.

A get's reads of other hosts' nodes, and a lone put's writes there, went through the Store's
loop thread: the caller handed the job over, the loop sent each node its frame on a pooled
connection, took the replies in epoll-driven callbacks and handed the job back. For a batch of
KV pages that hand-off and the loop's machinery cost more than the transfer: 4 KiB pages over
TCP in batches of 128, gets 1.05-1.53x (median 1.16) and puts 0.97-1.68x (median 1.25) the
objects/s of the loop's way when done here (ten alternating rounds each in one cluster,
2026-12-02; `python benchmarks/bench_paths.py caller-thread` runs the comparison, with one node
and with two; docs/performance.md). So each caller thread keeps a blocking connection of its own
to each node it talks to (transports/blocking.py), sends the node its frame and takes the
reply: a read's payload lands straight in the job's buffers (recv_into), a write's leaves
straight from the caller's (sendmsg), as a plain socket pair moves bytes. The loop is not woken.

Only one frame (up to transfer.FRAME_BYTES_TARGET, 4 MiB) for a node goes here: several go
through the loop's lanes, which carry them side by side (1 MiB objects in batches of 32, eight
frames a node: reads 0.76-1.25x, median 0.96, and writes 0.88-1.21x, median 0.98, of the loop's
GB/s when done here; ad hoc, 2026-12-02). A round of several nodes (a get's keys on several, a
put's replicas) sends each node what its socket takes, then more to whichever has room, and
lands each reply as it starts to come (selectors), so that a node that stops reading or
answering holds none of the others' frames or replies.

The rules are the loop's (AsyncStore._read_remote, _put_finish): a frame that fails (the node
refused it, the connection broke, the deadline passed) fails its keys: a read's move on to their
next replica, round after round, all within one transfer timeout; a write's key fails when no
replica was written, and is revoked. A round that finds no connection here (this thread is not
one of the Store's NODE_LINK_THREADS_MAX, it holds NODE_LINKS_PER_THREAD_MAX connections to
live nodes already, or opening one failed in the last NODE_RETRY_AFTER_S) sends nothing: it goes
through the loop.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import selectors
import time
from collections.abc import Callable

from kvpool import limits
from kvpool.client.slow_nodes import SLOW_NODE_OPEN_MS, SlowNodes
from kvpool.client.thread_links import ThreadLink, ThreadLinks
from kvpool.client.transfer import GetJob, PutJob, RemoteBatch, now_monotonic_ms, write_landing
from kvpool.config import ClientConfig
from kvpool.errors import (
    ConnectFailed,
    KVPoolError,
    RpcFailed,
    RpcTimeout,
    StoreClosed,
    Unauthorized,
    error_from_code,
)
from kvpool.protocol.auth import Keyring
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
# A round that waits on several nodes looks this often whether the Store was closed: a close
# from another thread closes the round's connections, which takes them out of its selector
# without waking it (a round of one node wakes at once: its receive ends).
CLOSED_CHECK_S = 0.1


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
    """Each caller thread's blocking connections to the nodes it reads from and writes to
    (see the module)."""

    def __init__(self, keys: Keyring, config: ClientConfig, slow_nodes: SlowNodes) -> None:
        self._keys = keys  # its current one (a refused token's next is found through the loop)
        self._slow_nodes = slow_nodes
        self._open_timeout_ms = min(config.connect_timeout_ms, NODE_OPEN_TIMEOUT_MS)
        self._transfer_timeout_ms = config.transfer_timeout_ms
        self._prefer_local = config.shm_enabled
        self._links = ThreadLinks(_ThreadNodes, NODE_LINK_THREADS_MAX, NODE_RETRY_AFTER_S)

    def read(self, job: GetJob) -> bool:
        """Read the job's keys that wait for other hosts' nodes from this thread, replica after
        replica, each round within its share of the lease (GetJob.round_timeout_ms). True:
        done (each key read, or a miss); False: a round was not for this thread (see the
        module) and nothing of it was sent: the caller reads the rest through the loop."""
        for _ in range(limits.REPLICA_NUM_MAX):
            batches = job.remote_batches()
            if not batches:
                return True
            budget_ms = job.round_timeout_ms(now_monotonic_ms(), self._transfer_timeout_ms)
            if not budget_ms:
                return True  # the lease lapsed: misses (job.finish)
            now = time.monotonic()
            conns = self._connections(batches, now + budget_ms / 1000)
            if conns is None:
                return False
            slow_budget_ms, bytes_of = self._slow_nodes.budget_ms, job.bytes_of
            budgets = [slow_budget_ms(b.endpoint, budget_ms, functools.partial(bytes_of, b)) for b in batches]
            failed = self._round(batches, conns, now, budgets)
            self._check_open()
            job.remote_done({i for batch in batches for i in batch.owners[0]}, set().union(*failed))
            job.copy_local()  # a failed key's next replica may be mapped (or a file) here
        return True

    def write(self, job: PutJob) -> list[set[int]] | None:
        """Write a put's frames for other hosts' nodes (job.remote: one per node, a replica
        each) from this thread, within its write timeout (PutJob.write_timeout_ms): per
        batch, the key indexes whose frame failed; None when it is not for this thread (see
        the module) and nothing was sent: the caller writes through the loop."""
        batches = job.remote
        timeout_ms = job.write_timeout_ms(self._transfer_timeout_ms)
        now = time.monotonic()
        conns = self._connections(batches, now + timeout_ms / 1000)
        if conns is None:
            return None
        failed = self._round(batches, conns, now, [timeout_ms] * len(batches))
        self._check_open()
        return failed

    def _round(
        self, batches: list[RemoteBatch], conns: list[BlockingConnection], started: float, budgets_ms: list[int]
    ) -> list[set[int]]:
        """Send each node its frame and take its reply, each within its budget from `started`
        (a node marked slow has a shorter one: SlowNodes.budget_ms); per batch, the key
        indexes whose frame failed (the node refused it, the connection broke, its deadline
        passed), none or all.

        One node: plain blocking calls. Several: each is sent what its socket takes, then
        whichever has room is sent more, and each reply is landed as it starts to come
        (selectors), so that a node that stops reading or answering holds none of the
        others' frames or replies, nor the round past its own deadline."""
        deadlines = [started + budget_ms / 1000 for budget_ms in budgets_ms]
        if len(batches) == 1:
            return [self._transfer(batches[0], conns[0], deadlines[0], budgets_ms[0])]
        # Every batch fails until its reply says otherwise.
        failed: list[set[int]] = [set(batch.owners[0]) for batch in batches]
        pending: dict[int, list] = {}  # by descriptor: [batch index, connection, request id, parts unsent, sinks]
        for index, (batch, conn) in enumerate(zip(batches, conns)):
            ((message, views),) = batch.frames
            try:
                descriptor = conn.fileno()  # before it may close: -1 then, and begin raises
                if isinstance(message, WriteSlices):
                    request_id, parts = conn.begin(message, views, write_landing(message))
                    sinks = []
                else:
                    (request_id, parts), sinks = conn.begin(message), views
                pending[descriptor] = [index, conn, request_id, conn.send_some(parts), sinks]
            except KVPoolError as exc:
                failed[index] = self._failed(batch, conn, exc, budgets_ms[index])
        try:
            with selectors.DefaultSelector() as selector:
                for descriptor, (index, conn, _, parts, _) in list(pending.items()):
                    if not self._watch(selector.register, descriptor, parts):
                        failed[index] = self._closed_meanwhile(batches[index], conn, budgets_ms[index])
                        del pending[descriptor]
                while pending and not self._links.is_closed:
                    now = time.monotonic()
                    for descriptor in [d for d, (index, *_) in pending.items() if deadlines[index] <= now]:
                        with contextlib.suppress(KeyError, OSError, ValueError):  # past its deadline
                            selector.unregister(descriptor)
                        self._late(batches, pending.pop(descriptor)[0], budgets_ms, failed)
                    if not pending:
                        break
                    remaining_s = min(deadlines[index] for index, *_ in pending.values()) - now
                    for key, _ in selector.select(min(remaining_s, CLOSED_CHECK_S)):
                        exchange = pending[key.fd]
                        index, conn, request_id, parts, sinks = exchange
                        budget_ms = budgets_ms[index]
                        if parts:  # room for more of the frame
                            try:
                                exchange[3] = conn.send_some(parts)
                            except KVPoolError as exc:
                                failed[index] = self._failed(batches[index], conn, exc, budget_ms)
                            else:
                                if exchange[3]:
                                    continue
                                if self._watch(selector.modify, key.fd, []):  # sent: wait for the reply
                                    continue
                                failed[index] = self._closed_meanwhile(batches[index], conn, budget_ms)
                        else:
                            failed[index] = self._reply(
                                batches[index], conn, request_id, sinks, deadlines[index], budget_ms
                            )
                        with contextlib.suppress(KeyError, OSError, ValueError):
                            selector.unregister(key.fd)
                        del pending[key.fd]
        finally:  # not done (interrupted, or the Store closed): a late reply must not answer the next
            now = time.monotonic()
            for index, *_ in pending.values():
                self._late(batches, index, budgets_ms if now >= deadlines[index] else None, failed)
        return failed

    def _late(
        self, batches: list[RemoteBatch], index: int, budgets_ms: list[int] | None, failed: list[set[int]]
    ) -> None:
        """A round's batch given up before its reply came, past its deadline (`budgets_ms`, by
        which its node is marked slow) or not (None: interrupted, or the Store closed): its
        connection goes, so that a late reply does not answer the next request."""
        self._links.link().drop(batches[index].endpoint)
        if budgets_ms is not None:
            self._slow_nodes.timed_out(batches[index].endpoint, budgets_ms[index])
        failed[index] = set(batches[index].owners[0])
        log.info("transfer with %s failed: not done in time", batches[index].endpoint)

    @staticmethod
    def _watch(how: Callable[[int, int], object], descriptor: int, parts: list[memoryview]) -> bool:
        """`how` (the selector's register or modify) of a round's connection, for room to send
        its frame's `parts` (none: for its reply). False when its descriptor was closed under
        the round: a close of the Store from another thread closes this thread's connections
        (the number may even be another file's by now, which the round then leaves alone)."""
        try:
            how(descriptor, selectors.EVENT_WRITE if parts else selectors.EVENT_READ)
        except (OSError, ValueError):
            return False
        return True

    def _closed_meanwhile(self, batch: RemoteBatch, conn: BlockingConnection, budget_ms: int) -> set[int]:
        conn.close()
        return self._failed(batch, conn, RpcFailed(f"connection to {batch.endpoint} closed meanwhile"), budget_ms)

    def _check_open(self) -> None:
        """After a round: StoreClosed if a close of the Store from another thread came during it
        (its connections closed under it, its frames failed), rather than the keys' misses."""
        if self._links.is_closed:
            raise StoreClosed("the store was closed during the call")

    def _transfer(self, batch: RemoteBatch, conn: BlockingConnection, deadline: float, budget_ms: int) -> set[int]:
        """Send the batch's frame and take the node's reply: the key indexes whose frame failed
        (the node refused it, the connection broke, the deadline passed), none or all."""
        ((message, views),) = batch.frames
        try:
            if isinstance(message, WriteSlices):
                request_id, sinks = conn.send_payload(message, views, write_landing(message), deadline), []
            else:
                (request_id,), sinks = conn.send([message], deadline), views
        except KVPoolError as exc:
            return self._failed(batch, conn, exc, budget_ms)
        return self._reply(batch, conn, request_id, sinks, deadline, budget_ms)

    def _reply(
        self,
        batch: RemoteBatch,
        conn: BlockingConnection,
        request_id: int,
        sinks: list[memoryview],
        deadline: float,
        budget_ms: int,
    ) -> set[int]:
        """Take the node's reply to the batch's frame: the key indexes that failed, none or all."""
        try:
            _, reply = conn.reply_into({request_id: sinks}, deadline, {request_id: batch.on_landed(0)})
            if isinstance(reply, ErrorReply):  # the node refused the frame; the connection is clean
                raise error_from_code(reply.code, reply.message)
        except KVPoolError as exc:
            return self._failed(batch, conn, exc, budget_ms)
        except BaseException:  # interrupted: a reply may still come, and must not answer the next
            self._links.link().drop(batch.endpoint)
            raise
        self._slow_nodes.answered(batch.endpoint)
        return set()

    def _failed(self, batch: RemoteBatch, conn: BlockingConnection, exc: KVPoolError, budget_ms: int) -> set[int]:
        log.info("transfer with %s failed: %s", batch.endpoint, exc)
        if isinstance(exc, RpcTimeout):
            self._slow_nodes.timed_out(batch.endpoint, budget_ms)
        if conn.is_closed():
            self._links.link().drop(batch.endpoint)
        return set(batch.owners[0])

    def _connections(self, batches: list[RemoteBatch], deadline: float) -> list[BlockingConnection] | None:
        """This thread's connection to each node of a round, opened when needed; None when
        the round is not for this thread (see the module)."""
        if any(len(batch.frames) != 1 for batch in batches):
            return None  # several frames for a node: the loop's lanes carry them side by side
        link = self._links.link()
        if not link.is_admitted or self._links.is_closed:
            return None
        conns = []
        for endpoint in [batch.endpoint for batch in batches]:
            conn = link.conns.get(endpoint)
            if conn is not None and (conn.awaits_replies() or not conn.is_usable()):  # a node that restarted
                link.drop(endpoint)
                conn = None
            if conn is None:
                open_by = deadline
                if self._slow_nodes.is_slow(endpoint):  # a frozen node's handshake never ends
                    open_by = min(deadline, time.monotonic() + SLOW_NODE_OPEN_MS / 1000)
                conn = self._open(link, endpoint, open_by)
            if conn is None:
                return None
            conns.append(conn)
        return conns

    def _open(self, link: _ThreadNodes, endpoint: str, deadline: float) -> BlockingConnection | None:
        now = time.monotonic()
        if now < link.retry_at.get(endpoint, 0.0):
            return None
        if len(link.conns) >= NODE_LINKS_PER_THREAD_MAX:  # make room: drop those nodes closed
            for stale in [e for e, conn in link.conns.items() if not conn.is_usable()]:
                link.drop(stale)
            if len(link.conns) >= NODE_LINKS_PER_THREAD_MAX:
                return None
        timeout_ms = min(self._open_timeout_ms, int((deadline - now) * 1000))
        if timeout_ms <= 0:
            return None
        try:
            conn = BlockingConnection.open(
                endpoint, key=self._keys.primary, timeout_ms=timeout_ms, prefer_local=self._prefer_local
            )
        except (ConnectFailed, Unauthorized) as exc:
            if self._links.is_closed:  # by another thread meanwhile: not through the loop either
                raise StoreClosed("the store was closed during the call") from None
            log.info("no connection of this thread to node %s (through the loop): %s", endpoint, exc)
            link.retry_at = {e: at for e, at in link.retry_at.items() if at > now}  # forget the lapsed
            link.retry_at[endpoint] = now + NODE_RETRY_AFTER_S
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
