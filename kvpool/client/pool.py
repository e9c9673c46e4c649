"""Pooled connections to peers: the master link and a few lanes per node.

`PeerPool` keeps up to `connections_per_peer` authenticated connections per endpoint, opened
on demand, and hands out the least busy one, so that a batch moves on several lanes at once.
Dead connections are dropped and replaced on the next call. `MasterLink` is the client's single
multiplexed connection to the master, re-opened when it breaks. Neither retries a request on
its own beyond what the caller asks: timeouts and retries are the caller's policy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvpool import limits
from kvpool.errors import ConnectFailed, RpcFailed
from kvpool.protocol.messages import Message
from kvpool.transports.connection import Connection, ReplySinks, connect


class PeerPool:
    """Connections by endpoint. Invariant: no closed connection stays in `_conns`."""

    def __init__(self, key: bytes | None, connections_per_peer: int, connect_timeout_ms: int) -> None:
        assert 1 <= connections_per_peer <= limits.CONNECTIONS_PER_PEER_MAX, connections_per_peer
        self._key = key
        self._size = connections_per_peer
        self._connect_timeout_ms = connect_timeout_ms
        self._conns: dict[str, list[Connection]] = {}

    def __repr__(self) -> str:
        return f"<PeerPool {sum(len(c) for c in self._conns.values())} connections>"

    async def lanes(self, endpoint: str, count: int) -> list[Connection]:
        """Up to `count` distinct live connections to `endpoint` (at least one).

        Raises:
            ConnectFailed, Unauthorized: no connection could be opened.
        """
        count = max(1, min(count, self._size))
        conns = self._conns.setdefault(endpoint, [])
        conns[:] = [c for c in conns if not c.is_closed()]  # in place: shared by concurrent calls
        while len(conns) < count:
            try:
                conn = await self._open(endpoint)
            except ConnectFailed:
                if conns:
                    break
                raise
            # Another call may have filled the pool while this one connected.
            if len(conns) >= self._size:
                conn.close("pool full")
                break
            conns.append(conn)
        return sorted(conns, key=Connection.inflight_count)[:count]

    async def _open(self, endpoint: str) -> Connection:
        return await connect(
            endpoint, key=self._key, timeout_ms=self._connect_timeout_ms, name="client"
        )

    def drop(self, endpoint: str) -> None:
        for conn in self._conns.pop(endpoint, []):
            conn.close("dropped by pool")

    def close(self) -> None:
        for endpoint in list(self._conns):
            self.drop(endpoint)


class MasterLink:
    """The client's connection to the master, reconnected on demand."""

    def __init__(self, endpoint: str, key: bytes | None, connect_timeout_ms: int, rpc_timeout_ms: int):
        self.endpoint = endpoint
        self._key = key
        self._connect_timeout_ms = connect_timeout_ms
        self._rpc_timeout_ms = rpc_timeout_ms
        self._conn: Connection | None = None
        self._lock = asyncio.Lock()

    async def _connection(self) -> Connection:
        if self._conn is not None and not self._conn.is_closed():
            return self._conn
        async with self._lock:
            if self._conn is None or self._conn.is_closed():
                self._conn = await connect(
                    self.endpoint, key=self._key, timeout_ms=self._connect_timeout_ms, name="master"
                )
            return self._conn

    async def call(self, message: Message, *, is_idempotent: bool, timeout_ms: int | None = None) -> Message:
        """One request to the master.

        An idempotent request is retried once on a fresh connection if the first one broke
        (a master restart); a put is not, since its first attempt may have taken effect.

        Raises:
            ConnectFailed, RpcFailed, RpcTimeout, or the master's error for the request.
        """
        timeout_ms = timeout_ms or self._rpc_timeout_ms
        attempts = 2 if is_idempotent else 1
        for attempt in range(attempts):
            conn = await self._connection()
            try:
                return await conn.request(message, timeout_ms=timeout_ms)
            except RpcFailed:
                if attempt + 1 == attempts:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close("client closed")


async def request_on_lanes(
    lanes: Sequence[Connection],
    requests: Sequence[tuple[Message, Sequence[memoryview], ReplySinks | None]],
    timeout_ms: int,
) -> list[Message | BaseException]:
    """Send requests spread round-robin over lanes; results (or exceptions) in request order."""
    calls = [
        lanes[i % len(lanes)].request(m, payload, reply_sinks=sinks, timeout_ms=timeout_ms)
        for i, (m, payload, sinks) in enumerate(requests)
    ]
    return await asyncio.gather(*calls, return_exceptions=True)
