"""Pooled connections to peers: the master link and a few lanes per node.

`PeerPool` keeps up to `connections_per_peer` authenticated connections per endpoint, opened
on demand (concurrent calls share each connect under way), and hands out the least busy one,
so that a batch moves on several lanes at once. Dead connections are dropped and replaced on
the next call. `MasterLink` is the client's single
multiplexed connection to the master, re-opened when it breaks; given `etcd://...` it dials
the elected leader (discovery.py) and follows a failover within the bound of each call.
Neither retries a request on its own beyond what is said here: timeouts are the caller's.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from kvpool import limits
from kvpool.discovery import MasterResolver
from kvpool.errors import (
    ConnectFailed,
    InvalidRequest,
    KVPoolError,
    NotLeader,
    RpcFailed,
    RpcTimeout,
    StoreClosed,
)
from kvpool.process import forks
from kvpool.protocol.auth import Keyring
from kvpool.protocol.messages import Message
from kvpool.transports.connection import Connection, LateReply, OnLanded, ReplySinks, connect_with

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class _ClosedForGood:
    """What a client's master link and its pool of node connections share: closed for good
    by close() (a call after it raises StoreClosed, and opens nothing), and made in one
    process: in a child forked since (process.py) its connections are the parent's, never
    used nor closed there (a sync Store opens itself anew in a child; an AsyncStore belongs
    to its process and loop)."""

    def __init__(self) -> None:
        self._is_closed = False
        self._opened_in = forks()

    @property
    def is_closed(self) -> bool:
        return self._is_closed

    def _check_usable(self) -> None:
        """Raises StoreClosed once closed, and InvalidRequest in a process forked since."""
        if self._is_closed:
            raise StoreClosed("the store is closed")
        if self._opened_in != forks():
            raise InvalidRequest("this store was opened by the parent of this forked process: open one here")

    def _kept(self, conn: Connection) -> Connection:
        """`conn`, just opened by a call, unless close() came meanwhile: then it is closed
        and the call raises StoreClosed (it keeps nothing open)."""
        if self._is_closed:
            conn.close("client closed")
            raise StoreClosed("the store is closed")
        return conn

    def _close_for_good(self) -> bool:
        """Mark closed; whether the connections are this process's to close."""
        self._is_closed = True
        return self._opened_in == forks()

    @staticmethod
    def _shared_attempt(coroutine: Coroutine[Any, Any, _T], name: str) -> asyncio.Task[_T]:
        """A connect that every call in want of it waits for (`_wait_for`), started now."""
        task = asyncio.get_running_loop().create_task(coroutine, name=name)
        # Its error is every waiting call's; retrieved here in case none waits any more.
        task.add_done_callback(lambda done: done.cancelled() or done.exception())
        return task

    async def _wait_for(self, attempt: asyncio.Task[_T], wait_s: float, too_late: str) -> _T:
        """`attempt`'s outcome, waited for `wait_s` at most by this call, the attempt going on for
        the others.

        Raises:
            ConnectFailed: `too_late`, past `wait_s`; or the attempt's error.
            StoreClosed: close() cancelled the attempt.
        """
        try:
            # shield: a call that gives up (timeout, cancelled) leaves the attempt to the others.
            # asyncio.timeout, not wait_for: Python 3.11's wait_for drops a cancel that comes in
            # the loop step the connect completes, and the cancelled call sent its request.
            async with asyncio.timeout(max(wait_s, 0.001)):
                return await asyncio.shield(attempt)
        except TimeoutError:
            raise ConnectFailed(too_late) from None
        except asyncio.CancelledError:
            # close() cancelled the attempt, not this call's caller: say what happened.
            if attempt.cancelled() and self._is_closed and not asyncio.current_task().cancelling():
                raise StoreClosed("the store was closed during the call") from None
            raise


class PeerPool(_ClosedForGood):
    """Connections by endpoint. Invariant: no closed connection stays in `_conns`."""

    def __init__(
        self, keys: Keyring, connections_per_peer: int, connect_timeout_ms: int, prefer_local: bool
    ) -> None:
        assert 1 <= connections_per_peer <= limits.CONNECTIONS_PER_PEER_MAX, connections_per_peer
        super().__init__()
        self._keys = keys
        self._prefer_local = prefer_local
        self._size = connections_per_peer
        self._connect_timeout_ms = connect_timeout_ms
        self._conns: dict[str, list[Connection]] = {}
        # Per endpoint, the connect under way that the calls finding too few connections share
        # (`_one_more`), ended by close(): a burst of 360 gets on an empty pool opened 360
        # connections to one node, whose oldest handshakes past 256 were closed, and their gets
        # missed.
        self._adding: dict[str, asyncio.Task[None]] = {}

    def __repr__(self) -> str:
        return f"<PeerPool {sum(len(c) for c in self._conns.values())} connections>"

    async def lanes(self, endpoint: str, count: int, timeout_ms: int | None = None) -> list[Connection]:
        """Up to `count` distinct live connections to `endpoint` (at least one), those it opens
        within `timeout_ms` in all (at most the connect timeout).

        Raises:
            ConnectFailed, Unauthorized: no connection could be opened.
            StoreClosed, InvalidRequest: closed, or in a forked child (_ClosedForGood).
        """
        self._check_usable()
        count = max(1, min(count, self._size))
        wait_ms = min(timeout_ms or self._connect_timeout_ms, self._connect_timeout_ms)
        deadline = time.monotonic() + wait_ms / 1000  # one bound for them all: a connect each took N of them
        for _ in range(count - len(self._live(endpoint))):
            try:
                await self._one_more(endpoint, deadline)
            except ConnectFailed:
                if self._live(endpoint):
                    break
                raise
        conns = self._live(endpoint)
        if not conns:  # opened, and closed by the peer at once
            raise ConnectFailed(f"{endpoint} closed every connection opened to it")
        return sorted(conns, key=Connection.inflight_count)[:count]

    def _live(self, endpoint: str) -> list[Connection]:
        """The pool's open connections to `endpoint` (its list, the closed ones dropped)."""
        conns = self._conns.setdefault(endpoint, [])
        conns[:] = [c for c in conns if not c.is_closed()]  # in place: shared by concurrent calls
        return conns

    async def _one_more(self, endpoint: str, deadline: float) -> None:
        """One more connection to `endpoint` in the pool: the one being opened by another
        call, else one opened now, within the connect timeout (not the first caller's bound,
        which failed every call that shared its connect); waited for until `deadline`
        (time.monotonic()) by each caller, the connect going on for the others.

        Raises:
            ConnectFailed, Unauthorized: not opened (in time).
            StoreClosed: closed before or during the connect.
        """
        adding = self._adding.get(endpoint)
        if adding is None or adding.done():
            adding = self._adding[endpoint] = self._shared_attempt(self._add(endpoint), f"kvpool connect {endpoint}")
        wait_s = deadline - time.monotonic()
        await self._wait_for(adding, wait_s, f"no connection to {endpoint} within the call's bound")

    async def _add(self, endpoint: str) -> None:
        """A new connection in the pool, within the connect timeout (a shared attempt: close()
        cancels it, and its callers get StoreClosed: a closing store's puts wait for their
        transfers to end, AsyncStore.aclose, and a connect to a node that does not answer took
        its whole timeout)."""
        conn = self._kept(await connect_with(
            self._keys, endpoint, timeout_ms=self._connect_timeout_ms, name="client", prefer_local=self._prefer_local
        ))  # fmt: skip
        conns = self._live(endpoint)
        if len(conns) >= self._size:
            conn.close("pool full")
        else:
            conns.append(conn)

    def drop(self, endpoint: str) -> None:
        for conn in self._conns.pop(endpoint, []):
            conn.close("dropped by pool")

    def close(self) -> None:
        """For good (_ClosedForGood), connects under way too."""
        if self._close_for_good():
            for adding in list(self._adding.values()):
                adding.cancel()
            for endpoint in list(self._conns):
                self.drop(endpoint)


class MasterLink(_ClosedForGood):
    """The client's connection to the master, reconnected on demand.

    `endpoint` is "host:port", or "etcd://host:port[,...][/cluster-id]" to follow the elected
    leader. Every call is bounded by connect_timeout_ms + its RPC timeout, whatever happens:

    - NotLeader (a standby, a deposed leader, or a new leader not yet taking puts) means the
      master did nothing, so any request is sent again, to the leader etcd names then;
    - no connection (refused, timed out, no leader in etcd) means nothing was sent: with etcd
      the leader is looked up again and the request retried, with a fixed address it fails;
    - a connection that broke after the request left may have carried it out: only an
      idempotent request is sent again (once, as before etcd: a master restart).

    Between attempts it backs off from MASTER_RESOLVE_BACKOFF_MS_MIN, doubling, to
    MASTER_RESOLVE_BACKOFF_MS_MAX, for at most MASTER_CALL_ATTEMPTS_MAX attempts, and starts
    one only with MASTER_ATTEMPT_MS_MIN of the bound left (else the last answer stands).
    """

    def __init__(
        self, endpoint: str, keys: Keyring, connect_timeout_ms: int, rpc_timeout_ms: int, prefer_local: bool
    ):
        super().__init__()
        self.endpoint = endpoint
        self._prefer_local = prefer_local
        self._resolver = MasterResolver(endpoint)
        self._keys = keys
        self._connect_timeout_ms = connect_timeout_ms
        self._rpc_timeout_ms = rpc_timeout_ms
        self._conn: Connection | None = None
        self._conn_endpoint = ""
        # Set when the master answered NotLeader: look the leader up again before the next
        # request, but keep the connection if it still is the leader (one still recovering).
        self._is_stale = False
        # The look-up and connect under way, shared by every call that finds no usable
        # connection. Calls used to queue on a lock and each redo both: the Nth call to a
        # master that accepts TCP but does not answer took N connect timeouts.
        self._opening: asyncio.Task[Connection] | None = None
        # The last look-up and connect's error, until one succeeds: a call whose bound ends
        # while the next attempt waits says it (it said only "no connection").
        self._open_failure: KVPoolError | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop of the first call: the link's

    def __repr__(self) -> str:
        return f"<MasterLink {self._resolver!r} {self._conn!r}>"

    def connected_endpoint(self) -> str | None:
        """"host:port" of the master this link is connected to now, or None (not yet, broken,
        or the leader is being looked up again). Plain attribute reads: safe from any thread."""
        return self._conn_endpoint if self._usable() is not None else None

    def suspect(self, endpoint: str) -> None:
        """A request to the master at `endpoint` timed out. With etcd, the leader is looked up
        again before the next request: a leader that hangs (SIGSTOP, a host gone behind a
        network black hole) closes no connection, and every later call of this store timed
        out on it while a standby led. The connection is kept if it still leads. Plain
        attribute writes, made from any thread (the sync Store's direct links): one that races
        the loop's own look-up may be lost, and the next timeout makes it again."""
        if self._resolver.is_dynamic and endpoint == self._conn_endpoint:
            self._is_stale = True
            self._resolver.forget()

    def _usable(self) -> Connection | None:
        conn = self._conn
        if conn is None or conn.is_closed() or self._is_stale:
            return None
        return conn

    async def _connection(self, deadline: float) -> Connection:
        """The usable connection, else the one being opened (an attempt is started if none
        is under way), waited for until `deadline` (time.monotonic()) at most.

        Raises:
            ConnectFailed: the deadline came first (the attempt goes on for later calls), or
                the attempt's error (ConnectFailed, RpcTimeout, NotLeader...).
            StoreClosed: closed before or during the attempt.
        """
        conn = self._usable()
        if conn is not None:
            return conn
        if self._is_closed:
            raise StoreClosed("the store is closed")
        opening = self._opening
        if opening is None or opening.done():
            opening = self._opening = self._shared_attempt(self._open(), "kvpool master connect")
        too_late = f"no connection to the master {self.endpoint} within the call's bound"
        if self._open_failure is not None:  # what stands in the way (etcd not answering, say)
            too_late += f" (the last failed attempt: {type(self._open_failure).__name__}: {self._open_failure})"
        return await self._wait_for(opening, deadline - time.monotonic(), too_late)

    async def _open(self) -> Connection:
        """Look the master up and connect, within connect_timeout_ms in all; the link's
        connection from then on."""
        deadline = time.monotonic() + self._connect_timeout_ms / 1000
        try:
            endpoint = await self._resolver.resolve(self._connect_timeout_ms)
            old = self._conn
            if old is not None and not old.is_closed() and endpoint == self._conn_endpoint:
                self._is_stale = False  # Still the leader: other calls keep their connection.
                self._open_failure = None
                return old
            timeout_ms = max(1, int((deadline - time.monotonic()) * 1000))
            conn = self._kept(await connect_with(
                self._keys, endpoint, timeout_ms=timeout_ms, name="master", prefer_local=self._prefer_local
            ))  # fmt: skip
        except KVPoolError as exc:
            self._open_failure = exc
            raise
        self._open_failure = None
        if old is not None:
            old.close("the master moved")
        self._conn, self._conn_endpoint, self._is_stale = conn, endpoint, False
        return conn

    def _drop(self, conn: Connection | None, reason: str) -> None:
        """Forget a connection that failed us (not a newer one another task opened since)."""
        if conn is not None:
            conn.close(reason)
        current = self._conn
        if current is None or current is conn or current.is_closed():
            self._conn = None
            self._resolver.forget()

    async def call(
        self,
        message: Message,
        *,
        is_idempotent: bool,
        timeout_ms: int | None = None,
        late_reply: LateReply | None = None,
    ) -> Message:
        """One request to the master, within connect_timeout_ms + timeout_ms (see the class).
        `late_reply`: see Connection.request.

        Raises:
            ConnectFailed, RpcFailed, RpcTimeout, NotLeader, or the master's error for the
            request.
            StoreClosed, InvalidRequest: closed (before or during the call), or in a forked
                child (_ClosedForGood); InvalidRequest also from another event loop than the
                first call's (its connection is that loop's).
        """
        self._check_usable()
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None:
                raise InvalidRequest("an AsyncStore belongs to the event loop it was opened on: open one on this loop")
            self._loop = loop
        timeout_ms = timeout_ms or self._rpc_timeout_ms
        deadline = time.monotonic() + (self._connect_timeout_ms + timeout_ms) / 1000
        is_dynamic = self._resolver.is_dynamic
        broken_retries = 1 if is_idempotent else 0
        backoff_ms = limits.MASTER_RESOLVE_BACKOFF_MS_MIN
        for _ in range(limits.MASTER_CALL_ATTEMPTS_MAX):
            conn: Connection | None = None
            try:
                conn = await self._connection(deadline)
                remaining_ms = max(1, min(timeout_ms, int((deadline - time.monotonic()) * 1000)))
                return await conn.request(message, timeout_ms=remaining_ms, late_reply=late_reply)
            except NotLeader as exc:
                # Nothing was done; a fixed address has nowhere else to go.
                if not is_dynamic:
                    raise
                self._resolver.forget()
                if conn is not None and conn is self._conn:
                    self._is_stale = True
                error: Exception = exc
            except (ConnectFailed, RpcTimeout) as exc:
                if conn is not None:
                    if conn is self._conn:
                        self.suspect(self._conn_endpoint)
                    if isinstance(exc, RpcTimeout) and remaining_ms < timeout_ms:  # what earlier tries left
                        raise RpcTimeout(
                            f"{type(message).__name__} to {conn.peer}: no answer within the call's bound "
                            f"({timeout_ms} ms, after {self._connect_timeout_ms} ms to connect)"
                        ) from None
                    raise  # The request may be running: the call's time is spent anyway.
                self._drop(None, f"unreachable: {exc}")
                if not is_dynamic:
                    raise
                error = exc
            except RpcFailed as exc:
                if self._is_closed:  # by close() under the call: say so, as a call after it does
                    raise StoreClosed("the store was closed during the call") from exc
                self._drop(conn, f"broken: {exc}")
                if not broken_retries:
                    raise
                broken_retries -= 1
                error = exc
                continue  # A broken connection is retried at once (a restarted master).
            pause_ms = backoff_ms // 2 + random.randrange(backoff_ms // 2 + 1)
            if (deadline - time.monotonic()) * 1000 <= pause_ms + limits.MASTER_ATTEMPT_MS_MIN:
                raise error
            log.debug("master call %s: %s; retrying in %d ms", type(message).__name__, error, pause_ms)
            await asyncio.sleep(pause_ms / 1000)
            backoff_ms = min(backoff_ms * 2, limits.MASTER_RESOLVE_BACKOFF_MS_MAX)
        raise error

    def close(self) -> None:
        """For good (_ClosedForGood): a call after this raises StoreClosed instead of connecting
        again. A connect under way is cancelled (its socket closed), and its callers get
        StoreClosed: left running, it held a socket to the master up to the connect timeout."""
        if not self._close_for_good():
            return
        if self._opening is not None:
            self._opening.cancel()
        if self._conn is not None:
            self._conn.close("client closed")


async def request_on_lanes(
    lanes: Sequence[Connection],
    requests: Sequence[tuple[Message, Sequence[memoryview], ReplySinks | None, int | None, OnLanded]],
    timeout_ms: int,
) -> list[Message | BaseException]:
    """Send requests spread round-robin over lanes; results (or exceptions) in request order.
    A request is (message, payload, reply sinks, where the peer lands the payload, what the
    reply's payload is shown to as it lands)."""
    calls = [
        lanes[i % len(lanes)].request(
            m, payload, reply_sinks=sinks, timeout_ms=timeout_ms, landing=landing, on_landed=on_landed
        )
        for i, (m, payload, sinks, landing, on_landed) in enumerate(requests)
    ]
    return await asyncio.gather(*calls, return_exceptions=True)
