"""`Store`: the synchronous, thread-safe client, driving AsyncStore on a private loop thread.

Every process has one loop thread (started on first use) that runs all its Stores' I/O. A call
submits its network phases there and waits with a bound; the same-host memcpy and checksum
work of a put or get runs in the caller's own thread, so that many threads copy in parallel
and the loop only does I/O. A get's reads of object files here (disk and DFS replicas) run
on file-reading threads within the get's deadline, and only the caller's thread copies what
they read into its buffers: a read stuck on a hung mount never holds the caller's thread,
nor writes its buffers after the call returned (GetJob._read_files). The methods
mirror AsyncStore's one for one (see there for semantics); nothing here decides anything on
its own.

Requests to the master take a shorter way: each caller thread keeps a blocking connection of
its own to the master the loop is connected to (transports/blocking.py) and asks there,
without waking the loop thread; on this project's VM that halves their latency. The lookups of
gets, exists, longest_prefix and sizes go this way, and the put_start and put_end of a put
with no other in flight (concurrent puts go through the loop, which carries them on one
connection). When the connection fails (a master restart, a new leader), a lookup goes through the
loop, which finds the master again; a put_start or put_end goes there only if the master
never saw it. At most DIRECT_LINKS_MAX threads of a Store hold such a connection.

On that connection a large batch of small objects copied here goes in pieces whose requests
leave together (store.py, batch_pieces): the master looks up, or allocates, the next piece
while the caller copies the last, where one request per batch had each wait for the other.

A get's reads of other hosts' nodes, and a lone put's writes to them, take the same shorter
way (client/node_links.py): each caller thread reads and writes over blocking connections of
its own, straight into and out of the caller's buffers, when each node's share is one frame;
the rest goes through the loop.

A child forked from the process that opened a Store (multiprocessing's workers) has none of
its threads: the Store opens itself anew there on the child's first call, and never uses nor
closes what the child inherited of the parent's (Store._reopen_after_fork).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import uvloop

from kvpool.client.node_links import NODE_OPEN_TIMEOUT_MS, NodeLinks
from kvpool.client.pool import MasterLink
from kvpool.client.store import (
    CLOSE_PUTS_WAIT_MS,
    GET_PIECES_FROM_KEYS,
    PUT_PIECES_FROM_KEYS,
    AsyncStore,
    BytesLike,
    batch_pieces,
    buffer_starts,
    call_bound,
    checked_args,
    checked_config,
    client_config,
    exists_flags,
    get_into_results,
    key_error,
    key_list,
    object_size,
    prefix_count,
    query_reply,
    value_views,
)
from kvpool.client.thread_links import ThreadLink, ThreadLinks
from kvpool.client.transfer import GetJob, PutJob, ended_each, new_put_id, now_monotonic_ms, put_end_of_each
from kvpool.config import ClientConfig
from kvpool.errors import (
    ConnectFailed,
    ErrorCode,
    InvalidParams,
    InvalidRequest,
    KVPoolError,
    NotLeader,
    RpcFailed,
    RpcTimeout,
    StoreClosed,
    Unauthorized,
)
from kvpool.process import forks
from kvpool.protocol.auth import Keyring
from kvpool.protocol.messages import (
    ClusterStatusReply,
    ExistKeys,
    GetReplicaList,
    ListReply,
    LongestPrefix,
    Message,
    PutStart,
    QueryObjects,
    QueryReply,
    ReplicateConfig,
    SegmentInfo,
)
from kvpool.transports.blocking import BlockingConnection
from kvpool.transports.connection import LateReply

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long a caller whose call ran past its bound waits for the call's cancellation to end
# on the loop (_LoopThread._cancel): a cancelled call's own clean-up is quick and local.
CANCEL_WAIT_MS = 2_000
# Batches up to this many bytes are copied on the loop thread in the same hand-off as their
# round trips; larger ones are copied here, in the caller's thread, in parallel with others.
INLINE_COPY_BYTES_MAX = 1 << 20


class _LoopThread:
    """The process's private event loop, on a daemon thread."""

    _instance: _LoopThread | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(
            target=self._run, args=(started,), name="kvpool-loop", daemon=True
        )
        self.thread.start()
        started.wait()

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(started.set)
        self.loop.run_forever()  # Runs for the life of the process (daemon thread).

    @classmethod
    def get(cls) -> _LoopThread:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    @classmethod
    def _forget_after_fork(cls) -> None:
        """In a forked child: the parent's loop has no thread here, and is never run or
        closed (its epoll instance is the parent's too: see Store._reopen_after_fork)."""
        if cls._instance is not None:
            _inherited.append(cls._instance)
        cls._instance = None
        cls._lock = threading.Lock()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_ms: int) -> T:
        assert threading.current_thread() is not self.thread, "Store used from its own loop"
        call = _Call(coroutine)
        self.loop.call_soon_threadsafe(call.start)
        try:
            finished = call.finished.acquire(timeout=timeout_ms / 1000)
        except BaseException:  # KeyboardInterrupt in the caller: the call must not run on
            self._cancel(call)
            raise
        if not finished:
            self._cancel(call)
            raise RpcTimeout(f"call did not finish within {timeout_ms} ms")
        if call.error is not None:
            raise call.error
        return call.result  # type: ignore[return-value]

    def _cancel(self, call: _Call) -> None:
        """Cancel `call` on the loop and wait (bounded) until it has ended: a get whose reply
        is landing in the caller's buffers closes its connection when cancelled, and the
        caller, once it has its error, may reuse those buffers (a serving engine hands a
        block that failed to load to another request). Only a loop that does not run at all
        outlasts the wait, and such a loop lands nothing."""
        self.loop.call_soon_threadsafe(call.cancel)
        if not call.finished.acquire(timeout=CANCEL_WAIT_MS / 1000):
            log.warning("a call cancelled after its bound had not ended within %d ms", CANCEL_WAIT_MS)


# What a forked child inherited of the parent's Stores and loop, kept as it is for the
# child's life: closing any of it would act on the parent's connections (a socket's shutdown
# ends it for both processes; uvloop unregistering a socket from the epoll instance both
# share would leave the parent's loop deaf to it). A few file descriptors a Store.
_inherited: list[object] = []
# Taken to reopen a Store in a forked child, and to close one: one at a time, so that a Store
# closed while another thread reopens it stays closed.
_reopening = threading.Lock()


def _after_fork_in_child() -> None:
    global _reopening
    _reopening = threading.Lock()
    _LoopThread._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Call:
    """One coroutine run on the loop for a caller thread that blocks on a plain lock.

    Lighter than run_coroutine_threadsafe (no concurrent Future, no chained callbacks): on
    this project's VM a hand-off costs ~120 µs instead of ~160 µs (two thread wake-ups either
    way). A call cancelled before it started never starts.
    """

    __slots__ = ("coroutine", "finished", "result", "error", "task", "is_cancelled")

    def __init__(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        self.coroutine = coroutine
        self.finished = threading.Lock()
        self.finished.acquire()  # released by _done, on the loop
        self.result: Any = None
        self.error: BaseException | None = None
        self.task: asyncio.Task[Any] | None = None
        self.is_cancelled = False

    def start(self) -> None:
        if self.is_cancelled:
            self.coroutine.close()
            self.error = RpcTimeout("call cancelled")
            self.finished.release()
            return
        self.task = asyncio.get_running_loop().create_task(self.coroutine)
        self.task.add_done_callback(self._done)

    def cancel(self) -> None:
        self.is_cancelled = True
        if self.task is not None:
            self.task.cancel()

    def _done(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            self.error = RpcTimeout("call cancelled")
        else:
            self.error = task.exception()
            if self.error is None:
                self.result = task.result()
        self.finished.release()


# A thread whose connection to the master could not be opened asks through the loop for this
# long before it tries again (a master that is down is not dialled twice per request).
DIRECT_RETRY_AFTER_S = 5.0
# A thread opens its connection within this bound (at most the connect timeout): a master the
# loop reached moments ago answers a handshake in milliseconds, and one that stopped answering
# must not add a whole connect timeout to the call's bound before the loop path is tried.
DIRECT_OPEN_TIMEOUT_MS = 1_000
# At most this many threads of one Store hold a connection of their own to the master (a
# serving process may run large thread pools; the master's connections stay bounded); the
# others ask through the loop, and try again for a free place after DIRECT_RETRY_AFTER_S.
DIRECT_LINKS_MAX = 16


class _ThreadMasterLink(ThreadLink):
    """One caller thread's connection to the master."""

    __slots__ = ("conn", "retry_at")

    def __init__(self) -> None:
        super().__init__()
        self.conn: BlockingConnection | None = None
        self.retry_at = 0.0  # after a failed open: ask through the loop until then

    def close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.close()


class _DirectLinks:
    """Each caller thread's blocking connection to the master the loop's MasterLink is
    connected to (see the module). Connections follow that link: when it moves to another
    master, a thread's next request opens a connection there."""

    def __init__(self, master: MasterLink, keys: Keyring, config: ClientConfig) -> None:
        self._master = master
        self._keys = keys  # its current one (a refused token's next is found through the loop)
        self._open_timeout_ms = min(config.connect_timeout_ms, DIRECT_OPEN_TIMEOUT_MS)
        self._rpc_timeout_ms = config.rpc_timeout_ms
        self._prefer_local = config.shm_enabled
        self._links = ThreadLinks(_ThreadMasterLink, DIRECT_LINKS_MAX, DIRECT_RETRY_AFTER_S)

    def ask(
        self,
        message: Message,
        is_idempotent: bool = True,
        late_reply: LateReply | None = None,
        timeout_ms: int | None = None,
    ) -> Message | None:
        """The master's reply, or None when the master has not seen the request from here
        (no working connection in this thread, or NotLeader): the caller then asks through
        the loop. A request that is not idempotent is sent only on a connection that is
        still open at the other end, and not sent again when it broke after leaving.

        `late_reply`: see BlockingConnection.request. `timeout_ms`: a bound on opening a
        connection and the answer together (None: the open's own, then the RPC timeout).

        Raises:
            RpcTimeout: the master did not answer within the RPC timeout.
            RpcFailed: a request that is not idempotent left, and the connection broke.
            KVPoolError subclass: the master's answer was an error (but NotLeader: None).
        """
        deadline = time.monotonic() + timeout_ms / 1000 if timeout_ms else None
        link, conn = self._link_and_connection(is_idempotent, timeout_ms)
        if conn is None:
            return None
        if deadline is not None:
            timeout_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            return conn.request(message, timeout_ms or self._rpc_timeout_ms, late_reply)
        except BaseException as exc:
            if not self._may_ask_through_the_loop(link, conn, exc, is_idempotent):
                raise
            return None

    def ask_each(
        self,
        messages: Sequence[Message],
        on_reply: Callable[[int, Message], None],
        is_idempotent: bool = True,
        late_reply: Callable[[int], LateReply] | None = None,
    ) -> list[int]:
        """`ask` of several requests, sent at once: each reply is handed in turn to
        `on_reply(index, reply)` while the master works on the next. Returns the indexes of
        the requests the master has not seen from here, in order (see `ask`; after NotLeader,
        that one and the rest). `late_reply(index)`: the `late_reply` of `ask` for request
        `index`, for those still unanswered at a timeout.

        Raises:
            As `ask`, and whatever on_reply raises.
        """
        link, conn = self._link_and_connection(is_idempotent)
        if conn is None:
            return list(range(len(messages)))
        deadline = time.monotonic() + self._rpc_timeout_ms / 1000
        answered = 0
        try:
            request_ids = conn.send(messages, deadline)
            # The requests still unanswered, for a timeout to hand their replies over.
            late = {rid: late_reply(i) for i, rid in enumerate(request_ids)} if late_reply else None
            for index, request_id in enumerate(request_ids):
                on_reply(index, conn.reply(request_id, deadline, late))
                if late is not None:
                    del late[request_id]
                answered += 1
        except BaseException as exc:
            if not self._may_ask_through_the_loop(link, conn, exc, is_idempotent):
                raise
            return list(range(answered, len(messages)))
        return []

    def _link_and_connection(
        self, is_idempotent: bool, open_timeout_ms: int | None = None
    ) -> tuple[_ThreadMasterLink, BlockingConnection | None]:
        """This thread's link, and its connection if it has a working one (one opened now
        within `open_timeout_ms`, if shorter than the open's own bound). A request that is
        not idempotent gets one that is still open at the other end."""
        link = self._links.link()
        conn = self._connection(link, open_timeout_ms)
        if conn is not None and not is_idempotent and not conn.is_usable():
            conn = self._connection(link, open_timeout_ms)  # the master restarted: a new connection, or None
        return link, conn

    def _may_ask_through_the_loop(
        self, link: _ThreadMasterLink, conn: BlockingConnection, exc: BaseException, is_idempotent: bool
    ) -> bool:
        """After `exc` on this thread's connection: whether the requests it did not answer
        may be asked through the loop (the master has not seen them, or they are
        idempotent); the connection is closed then, and otherwise unless it is clean (an
        error answer, nothing left to read) so that a late reply never answers another. A
        timeout has the leader looked up again (MasterLink.suspect)."""
        if isinstance(exc, RpcTimeout):
            self._master.suspect(conn.endpoint)
        if isinstance(exc, (ConnectFailed, NotLeader)) or (isinstance(exc, RpcFailed) and is_idempotent):
            log.debug("direct link to %s: %s; asking through the loop", conn.endpoint, exc)
            link.close()
            return True
        if conn.is_closed() or conn.awaits_replies():
            link.close()
        return False

    def connections(self) -> list[BlockingConnection]:
        """The open connections of live threads."""
        return [link.conn for link in self._links.admitted() if link.conn is not None and not link.conn.is_closed()]

    def _connection(self, link: _ThreadMasterLink, open_timeout_ms: int | None = None) -> BlockingConnection | None:
        endpoint = self._master.connected_endpoint()
        if endpoint is None or self._links.is_closed or not link.is_admitted:
            return None
        conn = link.conn
        if conn is not None and conn.endpoint == endpoint and not conn.is_closed():
            return conn
        link.close()
        if time.monotonic() < link.retry_at:
            return None
        try:
            conn = BlockingConnection.open(
                endpoint,
                key=self._keys.primary,
                timeout_ms=min(self._open_timeout_ms, open_timeout_ms or self._open_timeout_ms),
                prefer_local=self._prefer_local,
            )
        except (ConnectFailed, Unauthorized) as exc:
            log.info("no direct link to the master at %s (asking through the loop): %s", endpoint, exc)
            link.retry_at = time.monotonic() + DIRECT_RETRY_AFTER_S
            return None
        link.conn = conn
        if self._links.is_closed:  # closed meanwhile by another thread
            link.close()
            return None
        return conn

    def close(self) -> None:
        self._links.close()


class Store:
    """A synchronous, thread-safe handle on a kvpool cluster (see AsyncStore).

    Example:
        with Store("127.0.0.1:50051") as store:
            store.put("k", b"bytes")
            assert store.get("k") == b"bytes"
    """

    def __init__(self, master: str | None = None, **options: Any) -> None:
        self._loop = _LoopThread.get()
        config = client_config({**options, **({"master": master} if master else {})})
        # The outer bound covers a whole batch: lookups, transfers and the closing round trip.
        self._timeout_ms = config.transfer_timeout_ms + 3 * config.rpc_timeout_ms
        self._opened: AsyncStore = self._loop.run(AsyncStore.open(**vars(config)), self._timeout_ms)
        self._direct = _DirectLinks(self._opened._master, self._opened._keys, config)
        self._nodes = NodeLinks(self._opened._keys, config, self._opened.slow_nodes)
        self._in_flight_lock = threading.Lock()
        self._puts_in_flight = 0  # puts of this Store under way, from all threads (_put)
        self._closing = False  # close() began: no new put starts, those under way may finish
        self._put_was_local = config.shm_enabled  # whether the last large put wrote all here (batch_pieces)
        # process.forks() when the Store was opened (or reopened) in this process; None once closed.
        self._opened_in: int | None = forks()

    def __repr__(self) -> str:
        return f"<Store {self._opened!r}>"

    @property
    def _async(self) -> AsyncStore:
        """The AsyncStore this Store drives, this process's own: every use checks first."""
        self._check_open()
        return self._opened

    def _check_open(self) -> None:
        """Every call starts here, or with _async (before it touches anything this process's
        own): a Store opened by a process this one was forked from is opened anew first
        (_reopen_after_fork); a closed one raises StoreClosed."""
        if self._opened_in != forks():
            self._reopen_after_fork()

    def _reopen_after_fork(self) -> None:
        """Open this Store again in a child forked from the process that opened it (as
        multiprocessing's workers are): a loop thread of its own, a connection of its own to
        the master, and its threads' own connections; the registered buffers carry over (the
        same addresses in the child's copy of the memory). The child's copies of the parent's
        connections are left as they are, never used nor closed (_inherited). A Store that
        contributes a segment is refused: its node serves from the parent.

        One thread of the child does it (_reopening) while its others wait for it.

        Raises:
            StoreClosed: the Store was closed (here or in the parent).
            InvalidRequest: the Store contributes a segment (embedded mode).
            ConnectFailed, Unauthorized: as when it was opened (the next call tries again).
        """
        if self._opened_in is None:
            raise StoreClosed("the Store is closed")
        with _reopening:
            if self._opened_in is None:  # closed while this thread waited
                raise StoreClosed("the Store is closed")
            if self._opened_in == forks():  # another of the child's threads did it meanwhile
                return
            inherited = self._opened
            if inherited.embedded_segment is not None:
                raise InvalidRequest(
                    "this Store contributes a segment from the process it was opened in: "
                    "open a Store of its own in a forked child"
                )
            loop = _LoopThread.get()
            fresh: AsyncStore = loop.run(AsyncStore.open(**vars(inherited.config)), self._timeout_ms)
            fresh.buffers = inherited.buffers.copy_after_fork()
            _inherited.append((inherited, self._direct, self._nodes))
            self._loop, self._opened = loop, fresh
            self._direct = _DirectLinks(fresh._master, fresh._keys, fresh.config)
            self._nodes = NodeLinks(fresh._keys, fresh.config, fresh.slow_nodes)
            self._in_flight_lock = threading.Lock()  # another parent thread may have held it
            self._puts_in_flight = 0
            self._opened_in = forks()

    def _run(self, coroutine: Coroutine[Any, Any, T], call_timeout_ms: int | None = None) -> T:
        """Run a coroutine of this Store's AsyncStore (made through _async, which checked);
        one with a master call of its own bound (`call_timeout_ms`, checked: call_bound)
        gets that much longer."""
        return self._loop.run(coroutine, self._timeout_ms + (call_timeout_ms or 0))

    def _ask(
        self,
        message: Message,
        is_idempotent: bool = True,
        late_reply: LateReply | None = None,
        timeout_ms: int | None = None,
    ) -> Message:
        """The master's reply: on this thread's own connection, or through the loop when the
        master did not see the request there (see the module and _DirectLinks.ask).
        `late_reply`: given the reply if it comes after the call timed out, either way (on a
        thread of its own, or on the loop: it must not raise). `timeout_ms` (checked:
        call_bound): the call's own bound, both ways together and connecting included,
        instead of the RPC timeout (and a connect timeout).

        Raises:
            RpcTimeout: no answer within `timeout_ms` (or the RPC timeout).
            As _DirectLinks.ask and MasterLink.call otherwise.
        """
        self._check_open()
        started = time.monotonic()
        reply = self._direct.ask(message, is_idempotent, late_reply, timeout_ms)
        if reply is not None:
            return reply
        if timeout_ms is None:
            call = self._async._master.call(message, is_idempotent=is_idempotent, late_reply=late_reply)
            return self._run(call)
        # What the direct try left of the bound, for the loop to find the master again and ask:
        # each used to have a bound of its own, and the loop's a connect timeout more (2-3 s
        # for a lookup of 1 s after a leader was killed).
        left_ms = max(1, timeout_ms - int((time.monotonic() - started) * 1000))
        return self._run(self._async._call_within(message, left_ms, is_idempotent, late_reply), left_ms)

    def close(self) -> None:
        """Close every connection; a later call raises StoreClosed. Idempotent.

        Puts other threads have under way may finish first (CLOSE_PUTS_WAIT_MS, their objects
        stored); those still under way then end with StoreClosed, and give back what they held
        (as an interrupted put does) before the master's connection closes."""
        if self._opened_in == forks():
            self._closing = True
            self._puts_settled()
        with _reopening:
            opened_in, self._opened_in = self._opened_in, None
        if opened_in != forks():  # closed already, or opened by the parent and never used here
            return
        self._direct.close()
        self._nodes.close()
        # Those cut off queue their give-backs on the loop, ahead of aclose (a thread opening
        # a connection to a node that does not answer ends at the open's timeout).
        self._puts_settled(NODE_OPEN_TIMEOUT_MS + CLOSE_PUTS_WAIT_MS)
        self._loop.run(self._opened.aclose(), self._timeout_ms)

    def _puts_settled(self, timeout_ms: int = CLOSE_PUTS_WAIT_MS) -> None:
        """Wait until no put of this Store is under way, at most `timeout_ms`."""
        deadline = time.monotonic() + timeout_ms / 1000
        while self._puts_in_flight and time.monotonic() < deadline:
            time.sleep(0.002)

    def __enter__(self) -> Store:
        self._check_open()  # a closed one raises StoreClosed, as every call does (it was taken)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def hostname(self) -> str:
        return self._async.hostname

    @property
    def embedded_segment(self) -> SegmentInfo | None:
        """The segment this client contributes in embedded mode (None otherwise)."""
        return self._async.embedded_segment

    # --- bytes API ------------------------------------------------------------------------

    def put(self, key: str, value: BytesLike, config: ReplicateConfig | None = None) -> None:
        code = self.put_batch([key], [value], config)[0]
        if code != ErrorCode.OK:
            raise key_error(code, "put", key, memoryview(value).nbytes)

    def put_batch(
        self, keys: Sequence[str], values: Sequence[BytesLike], config: ReplicateConfig | None = None
    ) -> list[int]:
        if len(keys) != len(values):
            raise InvalidParams(f"{len(keys)} keys but {len(values)} values")
        return self._put(value_views(values), keys, config)

    def get(self, key: str) -> bytes | None:
        return self.get_batch([key])[0]

    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        jobs = self._get(keys, [None] * len(keys))
        return [r if isinstance(r, bytes) else None for job in jobs for r in job.results]

    # --- zero-copy API --------------------------------------------------------------------

    def register_buffer(self, buffer: object | int, size_bytes: int | None = None) -> int:
        return self._async.register_buffer(buffer, size_bytes)

    def unregister_buffer(self, address: int) -> None:
        """As AsyncStore.unregister_buffer: refused while a call in flight uses the range."""
        self._async.unregister_buffer(address)

    def put_from(
        self, key: str, address: int, size_bytes: int, config: ReplicateConfig | None = None
    ) -> int:
        return self.batch_put_from([key], [address], [size_bytes], config)[0]

    def get_into(self, key: str, address: int, size_bytes: int) -> int:
        return self.batch_get_into([key], [address], [size_bytes])[0]

    def batch_put_from(
        self,
        keys: Sequence[str],
        addresses: Sequence[int],
        sizes: Sequence[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        store = self._async
        with store._lent(keys, addresses, sizes) as views:
            return self._put(views, keys, config)

    def batch_get_into(
        self, keys: Sequence[str], addresses: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        store = self._async
        with store._lent(keys, addresses, sizes, is_written=True) as views:
            jobs = self._get(keys, views, buffer_starts(addresses, per_key=False))
        return [result for job in jobs for result in get_into_results(job)]

    def batch_put_from_multi_buffers(
        self,
        keys: Sequence[str],
        addresses: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        store = self._async
        with store._lent(keys, addresses, sizes, per_key=True) as views:
            return self._put(views, keys, config)

    def batch_get_into_multi_buffers(
        self, keys: Sequence[str], addresses: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        store = self._async
        with store._lent(keys, addresses, sizes, per_key=True, is_written=True) as views:
            jobs = self._get(keys, views, buffer_starts(addresses))
        return [result for job in jobs for result in get_into_results(job)]

    # --- metadata API ---------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key])[0]

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return exists_flags(self._ask(ExistKeys(key_list(keys))))

    def longest_prefix(
        self, keys: Sequence[str], hold_ms: int = 0, hold_reads: int = 1, timeout_ms: int | None = None
    ) -> int:
        checked_args(hold_ms=(hold_ms, int), hold_reads=(hold_reads, int))
        bound = call_bound(timeout_ms)
        return prefix_count(self._ask(LongestPrefix(key_list(keys), hold_ms, hold_reads), timeout_ms=bound))

    def get_size(self, key: str) -> int:
        return object_size(self._ask(QueryObjects(key_list([key]))), key)

    def query(self, keys: Sequence[str], timeout_ms: int | None = None) -> QueryReply:
        return query_reply(self._ask(QueryObjects(key_list(keys)), timeout_ms=call_bound(timeout_ms)))

    def remove(self, key: str, force: bool = False) -> None:
        self._run(self._async.remove(key, force))

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        return self._run(self._async.batch_remove(keys, force))

    def remove_by_regex(self, pattern: str, force: bool = False, timeout_ms: int | None = None) -> int:
        bound = call_bound(timeout_ms)
        return self._run(self._async.remove_by_regex(pattern, force, bound), bound)

    def remove_all(self, force: bool = False, timeout_ms: int | None = None) -> int:
        bound = call_bound(timeout_ms)
        return self._run(self._async.remove_all(force, bound), bound)

    def list_objects(self, pattern: str = "", limit: int = 1000) -> ListReply:
        return self._run(self._async.list_objects(pattern, limit))

    def cluster_status(self, timeout_ms: int | None = None) -> ClusterStatusReply:
        bound = call_bound(timeout_ms)
        return self._run(self._async.cluster_status(bound), bound)

    # --- the two data paths: network phases on the loop, copies here -------------------------

    def _put(
        self,
        parts: Sequence[Sequence[memoryview]],
        keys: Sequence[str],
        config: ReplicateConfig | None,
    ) -> list[int]:
        self._check_open()
        if self._closing:  # the puts under way may finish, no new one starts
            raise StoreClosed("the Store is closed")
        keys = key_list(keys)  # before set(keys) below: an unhashable key is an InvalidKey too
        config = checked_config(config)
        with self._in_flight_lock:
            is_alone = not self._puts_in_flight
            self._puts_in_flight += 1
        try:
            with self._opened.closed_meanwhile():  # a close from another thread unmapped the segments
                repeats_a_key = len(set(keys)) < len(keys)
                if is_alone and not repeats_a_key:
                    codes = self._put_direct(parts, keys, config)
                    if codes is not None:
                        return codes
                if repeats_a_key or sum(len(p) for ps in parts for p in ps) <= INLINE_COPY_BYTES_MAX:
                    # Small batches: the copies cost less than a second thread hand-off (~50 us).
                    # (Batches that repeat a key go this way too: the loop side puts each key once.)
                    return self._run(self._async._put_parts(keys, parts, config))
                # Taken once: a close from another thread during the copy makes self._async
                # raise, and the put must still end (or give its keys back) on its AsyncStore.
                async_store = self._async
                job = self._run(async_store._put_start(keys, parts, config))
                try:
                    job.copy_local()
                except BaseException:  # Ctrl-C in the copy, a close meanwhile: the keys go back (_put_direct's way)
                    self._give_up([job])
                    raise
                return self._run(async_store._put_finish(job))
        finally:
            with self._in_flight_lock:
                self._puts_in_flight -= 1

    def _put_direct(
        self,
        parts: Sequence[Sequence[memoryview]],
        keys: Sequence[str],
        config: ReplicateConfig | None,
    ) -> list[int] | None:
        """put_start and put_end from this thread (see the module), the same-host copies here,
        and the writes to other hosts' nodes over this thread's own connections when they are
        one frame a node (node_links.py; else they go through the loop, and so does the
        put_end after them). None: the master never saw the put_start (no direct link); put through
        the loop.

        A batch of small objects goes in pieces (batch_pieces): the put_starts of all at
        once, each piece copied while the master allocates the next, then one put_end for
        the pieces written here.

        Only a put with no other in flight from this Store comes here: concurrent ones go
        through the loop, which carries them on one connection and copies small ones on its
        thread (four threads putting 4 KiB pages: 62-85k puts/s through the loop against
        39-52k on four direct connections, three alternating runs, ad hoc)."""
        async_store = self._async
        if len(keys) >= PUT_PIECES_FROM_KEYS:
            object_bytes = sum(len(p) for ps in parts for p in ps) // len(keys)
            pieces = batch_pieces(len(keys), object_bytes, self._put_was_local, PUT_PIECES_FROM_KEYS)
            if len(pieces) > 1:
                return self._put_in_pieces(parts, keys, config, pieces)
        message = async_store._put_start_message(keys, parts, config)
        sent_ms = now_monotonic_ms()
        reply = self._direct.ask(message, False, functools.partial(self._revoke_granted, message))
        if reply is None:
            return None
        job = self._put_job(message, parts, reply, sent_ms)
        try:
            job.copy_local()
            if len(keys) >= PUT_PIECES_FROM_KEYS:
                self._put_was_local = not job.remote
            failed = self._nodes.write(job) if job.remote else []
        except BaseException:  # Ctrl-C in a copy or a write, a write that raised: the keys go back
            self._give_up([job])
            raise
        if failed is None:  # not for this thread's own connections: through the loop
            return self._run(async_store._put_finish(job))
        return self._put_settled(job, failed)

    def _put_job(
        self, message: PutStart, parts: Sequence[Sequence[memoryview]], reply: Message, sent_ms: int
    ) -> PutJob:
        """The job of an answered put_start. If making it raises (Ctrl-C while it maps a node's
        segment, on a Store's first put there), its grants go back, as a late reply's do:
        before, they stayed pending 30 s, then quarantined for the release timeout (10
        minutes), and a cache under that much less room evicted what it stored next."""
        try:
            return self._async._put_job(message, parts, reply, sent_ms)
        except BaseException:
            self._revoke_granted(message, reply)
            raise

    def _revoke_granted(self, message: PutStart, reply: Message) -> None:
        """A put_start of this thread answered after it timed out: its grants are given back
        from the loop (AsyncStore._revoke_granted). Any thread; never raises (a late reply's
        callback must not), so not through _async, which does once the Store is closed."""
        self._soon_on_the_loop(self._opened._revoke_granted, message, reply)

    def _soon_on_the_loop(self, function: Callable[..., object], *args: object) -> None:
        """`function(*args)` on the loop thread, soon, from any thread; never raises. Once the
        loop is closed nothing runs: what it would give back, the master discards in time."""
        with contextlib.suppress(RuntimeError):
            self._loop.loop.call_soon_threadsafe(function, *args)

    def _put_settled(self, job: PutJob, failed: list[set[int]]) -> list[int]:
        """Given, per remote batch, the keys whose writes failed: put_end what was written and
        revoke the rest, from this thread (AsyncStore._put_finish does the same on the loop)."""
        end, revoke = job.settle_writes(failed)
        if end:
            try:
                reply = self._ask(job.put_end(end), is_idempotent=False)
            except BaseException:
                self._give_up([job])
                raise
            job.ended(end, reply)
        self._revoke(job, revoke)
        return job.codes

    def _revoke(self, job: PutJob, revoke: list[int]) -> None:
        """Revoke the keys at `revoke` (indexes) of `job`, whose writes failed, from this thread."""
        if revoke:
            try:
                self._ask(job.put_revoke(revoke), is_idempotent=False)
            except KVPoolError as exc:  # the master discards the put at its timeout anyway
                log.info("put_revoke failed (the master will discard the put): %s", exc)

    def _put_in_pieces(
        self,
        parts: Sequence[Sequence[memoryview]],
        keys: Sequence[str],
        config: ReplicateConfig | None,
        pieces: list[tuple[int, int]],
    ) -> list[int] | None:
        """_put_direct in pieces: the put_starts of all at once, each piece copied while the
        master allocates the next, then one put_end for the pieces written here (those with
        writes to other hosts' nodes end through the loop).

        If any step fails or times out, the pieces whose put_start was answered are revoked
        (_give_up) and those answered late too (_revoke_granted), before the error is raised."""
        async_store = self._async
        put_id = new_put_id()  # one put: one PutEnd for its pieces
        starts = [async_store._put_start_message(keys[a:b], parts[a:b], config, put_id) for a, b in pieces]
        sent_ms = now_monotonic_ms()
        jobs: list[PutJob] = [None] * len(pieces)  # type: ignore[list-item]
        answered: list[PutJob] = []

        def started(index: int, reply: Message) -> None:
            start, end = pieces[index]
            job = jobs[index] = self._put_job(starts[index], parts[start:end], reply, sent_ms)
            answered.append(job)
            job.copy_local()

        def revoke_late(index: int) -> LateReply:
            return functools.partial(self._revoke_granted, starts[index])

        try:
            unanswered = self._direct.ask_each(starts, started, False, revoke_late)
            if len(unanswered) == len(pieces):
                return None
            self._ask_through_the_loop(starts, unanswered, started, False, revoke_late)  # the master changed
            remote = [job for job in jobs if job.remote]
            if remote:
                self._run(_each(async_store._put_finish, remote))
            settled = [(job, *job.settle_writes([])) for job in jobs if not job.remote]
            ends = [(job, end) for job, end, _ in settled if end]
            if ends:
                ended_each(ends, self._ask(put_end_of_each(ends), is_idempotent=False))
            for job, _, revoke in settled:  # copies refused past their grants (PutJob.copy_local)
                self._revoke(job, revoke)
        except BaseException:
            self._give_up(answered)
            raise
        self._put_was_local = not remote
        return [code for job in jobs for code in job.codes]

    def _give_up(self, jobs: Sequence[PutJob]) -> None:
        """A put whose step failed or timed out after these jobs' put_starts were answered:
        their keys are revoked at once, from the loop (AsyncStore._give_up), so that a put of
        them again succeeds; else they refused puts (REPLICA_IS_NOT_READY) until the master
        discarded them, and their ranges stayed quarantined until the release timeout. Those
        with writes to other hosts stay quarantined (one may land yet); keys of a job already
        ended or revoked are left as they are (the put id says). Any thread."""
        for job in jobs:
            self._soon_on_the_loop(self._opened._give_up, job)

    def _get(
        self,
        keys: Sequence[str],
        targets: Sequence[list[memoryview] | None],
        starts: Sequence[int | None] | None = None,
    ) -> list[GetJob]:
        """Look up, copy what is mapped here, read the rest over TCP: a job per piece of the
        batch (the AsyncStore's GetPieces decides, for both), in order."""
        with self._async.closed_meanwhile():  # a close from another thread unmapped the segments
            if len(keys) < GET_PIECES_FROM_KEYS:
                return self._get_whole(keys, targets, starts)
            with self._async._get_pieces.pieces(keys, targets) as pieces:
                if len(pieces) > 1:
                    return self._get_in_pieces(keys, targets, starts, pieces)
                return self._get_whole(keys, targets, starts)

    def _get_whole(
        self,
        keys: Sequence[str],
        targets: Sequence[list[memoryview] | None],
        starts: Sequence[int | None] | None,
    ) -> list[GetJob]:
        async_store = self._async
        lease_start_ms = now_monotonic_ms()
        lookup = GetReplicaList(key_list(keys))
        reply = self._ask(lookup, late_reply=functools.partial(async_store._give_back_late_leases, lookup.keys))
        async_store.directories.wait(async_store.directory_looks(reply))
        job = async_store._get_job(reply, lease_start_ms, keys, targets, starts)
        # Interrupted while it waits for its file reads (Ctrl-C on a hung mount), the get gives
        # its read leases back at once, not at their TTL.
        with async_store.leases_back_if_abandoned([job]):
            job.copy_local()
        return self._got([job], len(keys) >= GET_PIECES_FROM_KEYS)

    def _get_in_pieces(
        self,
        keys: Sequence[str],
        targets: Sequence[list[memoryview] | None],
        starts: Sequence[int | None] | None,
        pieces: list[tuple[int, int]],
    ) -> list[GetJob]:
        async_store = self._async
        lookups = [GetReplicaList(key_list(keys[start:end])) for start, end in pieces]
        lease_start_ms = now_monotonic_ms()
        jobs: list[GetJob] = [None] * len(pieces)  # type: ignore[list-item]
        answered: list[GetJob] = []

        def found(index: int, reply: Message) -> None:
            async_store.directories.wait(async_store.directory_looks(reply))
            job = jobs[index] = async_store._get_job(reply, lease_start_ms, keys, targets, starts, pieces[index])
            answered.append(job)
            job.copy_local()

        def leases_back_late(index: int) -> LateReply:
            return functools.partial(async_store._give_back_late_leases, lookups[index].keys)

        with async_store.leases_back_if_abandoned(answered):  # a later piece timed out, or failed
            unanswered = self._direct.ask_each(lookups, found, True, leases_back_late)
            self._ask_through_the_loop(lookups, unanswered, found, True, leases_back_late)
        return self._got(jobs, True)

    def _ask_through_the_loop(
        self,
        messages: Sequence[Message],
        indexes: list[int],
        on_reply: Callable[[int, Message], None],
        is_idempotent: bool,
        late_reply: Callable[[int], LateReply],
    ) -> None:
        """Ask the master the messages at `indexes` (those the thread's own connection did not
        answer: none, or all when this thread has none) through the loop, together in one
        hand-off, and hand each reply to `on_reply(index, reply)` in order. If one fails or
        they time out, every reply goes to `late_reply(index)` instead (_each_answered)."""
        if not indexes:
            return
        asked = [messages[index] for index in indexes]
        late_replies = [late_reply(index) for index in indexes]
        replies = self._run(_each_answered(self._async._master, asked, is_idempotent, late_replies))
        for index, reply in zip(indexes, replies):
            on_reply(index, reply)

    def _got(self, jobs: list[GetJob], is_telling: bool) -> list[GetJob]:
        """Finish the jobs of a get whose same-host copies are done: read the rest over TCP
        (from this thread, else through the loop), check the leases, report bad replicas, give
        the leases back. `is_telling`: a get large enough to go in pieces, whose objects tell
        the next such get what to expect."""
        remote = [job for job in jobs if job.pending_indexes()]
        with self._async.leases_back_if_abandoned(jobs):  # timed out, interrupted
            through_the_loop = [job for job in remote if not self._nodes.read(job)]
            if through_the_loop:
                self._run(_each(self._async._read_remote, through_the_loop))
        now_ms = now_monotonic_ms()
        for job in jobs:
            job.finish(now_ms)
            if job.bad_replicas:
                self._loop.loop.call_soon_threadsafe(self._async.report_bad_replicas, job)
            self._async.release_leases(job)
        if is_telling:
            self._async._get_pieces.found(jobs, not remote)
        return jobs


async def _each(function: Callable[[Any], Awaitable[T]], items: Sequence[Any]) -> list[T]:
    """`function(item)` of every item, together, on the loop (where the coroutines are made:
    a call cancelled before it starts leaves none never awaited)."""
    return list(await asyncio.gather(*(function(item) for item in items)))


async def _each_answered(
    master: MasterLink, messages: Sequence[Message], is_idempotent: bool, late_replies: Sequence[LateReply]
) -> list[Message]:
    """The master's replies to `messages`, asked together, on the loop. When one fails or the
    whole is cancelled (its caller's bound ran out), the caller gets none of them: those that
    came go to their `late_replies` (for what they grant to be given back), and those still
    waited for are cancelled (theirs go there when they come, Connection.request)."""
    calls = [
        asyncio.ensure_future(master.call(message, is_idempotent=is_idempotent, late_reply=late_reply))
        for message, late_reply in zip(messages, late_replies)
    ]
    try:
        return list(await asyncio.gather(*calls))
    except BaseException:
        for call, late_reply in zip(calls, late_replies):
            if not call.done():
                call.cancel()
            elif not call.cancelled() and call.exception() is None:
                late_reply(call.result())
        raise


__all__ = ["Store", "ClientConfig"]
