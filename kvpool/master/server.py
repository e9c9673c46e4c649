"""The master process's I/O shell: RPC server, node calls, ticks and the HTTP endpoints.

All decisions are MasterService's (service.py, pure). This module only moves messages: it
feeds requests to the service with the wall clock, sends the service's outbox to nodes
(CommitObjects at put_end, DropObjects before a range is reused) on the connection each node
opened, runs `tick` periodically, and serves /metrics, /health and /status over HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable

from kvpool import limits
from kvpool.config import MasterConfig
from kvpool.errors import ErrorCode, InvalidParams, KVPoolError
from kvpool.master.metrics import MasterMetrics, start_http
from kvpool.master.service import MasterService
from kvpool.protocol import auth
from kvpool.protocol.messages import (
    ClusterStatus,
    CodesReply,
    CommitObjects,
    DrainSegment,
    DropObjects,
    ExistKeys,
    GetReplicaList,
    Heartbeat,
    InventoryEntry,
    ListObjects,
    LongestPrefix,
    Message,
    MountSegment,
    PutEnd,
    PutRevoke,
    PutStart,
    PutStartReply,
    QueryObjects,
    Remove,
    RemoveAll,
    RemoveByRegex,
    UnmountSegment,
)
from kvpool.transports.connection import Connection, HandlerResult, Listener, start_server

log = logging.getLogger(__name__)

TICK_INTERVAL_MS = 200
NODE_CALL_TIMEOUT_MS = limits.RPC_TIMEOUT_MS_DEFAULT


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class MasterServer:
    """Serves one MasterService. Holds, per mounted segment, the connection its node opened."""

    def __init__(
        self,
        config: MasterConfig = MasterConfig(),
        *,
        host: str = "127.0.0.1",
        port: int = limits.MASTER_PORT_DEFAULT,
        http_port: int | None = None,
        token: str | None = None,
        seed: int | None = None,
        debug_invariants: bool = False,
    ) -> None:
        self.config = config
        # Check every structure after every request (KVPOOL_DEBUG_INVARIANTS=1): O(n) each.
        self.debug_invariants = debug_invariants
        self.host = host
        self.port = port
        self.http_port = http_port
        self._key = auth.cluster_key(token) if token else None
        self.service = MasterService(config, random.Random(seed), self._key)
        self.metrics = MasterMetrics(self.service)
        self._node_conns: dict[str, Connection] = {}
        self._unsent_drops: dict[str, list[InventoryEntry]] = {}
        self._server: Listener | None = None
        self._http = None
        self._tick_task: asyncio.Task[None] | None = None
        self._flush_lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"<MasterServer {self.endpoint} nodes={len(self._node_conns)}>"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        self._server = await start_server(self.host, self.port, self, key=self._key, name="master")
        self.port = self._server.port
        if self.http_port is not None:
            self._http, self.http_port = await start_http(self.host, self.http_port, self)
        self._tick_task = asyncio.get_running_loop().create_task(self._tick_forever())
        log.info("master listening on %s (auth %s)", self.endpoint, "on" if self._key else "off")

    async def stop(self) -> None:
        if self._tick_task is not None:
            self._tick_task.cancel()
        if self._server is not None:
            await self._server.close()
        if self._http is not None:
            await self._http.cleanup()

    # --- RequestHandler ---------------------------------------------------------------------

    def payload_sinks(self, conn: Connection, message: Message) -> None:
        raise InvalidParams(f"the master takes no payload ({type(message).__name__})")

    def payload_received(self, conn: Connection, message: Message) -> None:
        raise AssertionError("payload_sinks refuses every payload")

    def connection_closed(self, conn: Connection) -> None:
        # The node may reconnect and re-mount; liveness (node TTL) decides when it is gone.
        for segment_id, node_conn in list(self._node_conns.items()):
            if node_conn is conn:
                del self._node_conns[segment_id]

    def handle(self, conn: Connection, message: Message) -> HandlerResult | Awaitable[HandlerResult]:
        result = self._dispatch(conn, message)
        if not self.debug_invariants:
            return result
        if isinstance(result, Awaitable):
            return self._checked_later(result)
        self.service.check_invariants()
        return result

    async def _checked_later(self, result: Awaitable[HandlerResult]) -> HandlerResult:
        reply = await result
        self.service.check_invariants()
        return reply

    def _dispatch(self, conn: Connection, message: Message) -> HandlerResult | Awaitable[HandlerResult]:
        now_ms = wall_clock_ms()
        service = self.service
        self.metrics.count_request(type(message).__name__)
        match message:
            case GetReplicaList():
                return service.get_replica_list(message, now_ms)
            case PutStart():
                return self._put_start(message)
            case PutEnd():
                return self._put_end(message)
            case ExistKeys():
                return service.exist_keys(message, now_ms)
            case LongestPrefix():
                return service.longest_prefix(message, now_ms)
            case PutRevoke():
                return service.put_revoke(message, now_ms)
            case Remove():
                return service.remove(message, now_ms)
            case RemoveByRegex():
                return service.remove_by_regex(message, now_ms)
            case RemoveAll():
                return service.remove_all(message, now_ms)
            case QueryObjects():
                return service.query_objects(message, now_ms)
            case ListObjects():
                return service.list_objects(message, now_ms)
            case ClusterStatus():
                return service.cluster_status(message, now_ms)
            case MountSegment():
                reply = service.mount_segment(message, now_ms)
                self._node_conns[message.segment.segment_id] = conn
                log.info(
                    "mounted segment %s of %s (%d bytes, %d objects re-adopted, %d rejected)",
                    message.segment.segment_id, message.segment.endpoint,
                    message.segment.capacity_bytes, len(message.inventory) - len(reply.rejected),
                    len(reply.rejected),
                )  # fmt: skip
                return reply
            case Heartbeat():
                for segment_id in message.segment_ids:
                    self._node_conns[segment_id] = conn  # rebinds after a node reconnects
                return service.heartbeat(message, now_ms)
            case UnmountSegment():
                reply = service.unmount_segment(message, now_ms)
                self._node_conns.pop(message.segment_id, None)
                self._unsent_drops.pop(message.segment_id, None)
                return reply
            case DrainSegment():
                return service.drain_segment(message, now_ms)
        raise InvalidParams(f"the master does not serve {type(message).__name__}")

    # --- flows that call nodes ----------------------------------------------------------------

    def _put_start(self, message: PutStart) -> PutStartReply | Awaitable[PutStartReply]:
        reply = self.service.put_start(message, wall_clock_ms())
        retry = [i for i, code in enumerate(reply.codes) if code == ErrorCode.NO_AVAILABLE_HANDLE]
        # Room is coming if eviction scheduled drops, or drops are in flight (a tick's flush
        # holds the lock): wait for their acknowledgements, then try those keys once more.
        is_room_coming = self.service.has_pending_drops() or self._flush_lock.locked()
        if not retry or not is_room_coming:
            return reply  # the common case answers at once, without a task
        return self._put_start_after_drops(message, reply, retry)

    async def _put_start_after_drops(
        self, message: PutStart, reply: PutStartReply, retry: list[int]
    ) -> PutStartReply:
        # Eviction scheduled drops; their space is free once the nodes forgot the objects.
        await self._flush_drops()
        again = self.service.put_start(
            PutStart(
                [message.keys[i] for i in retry],
                [message.sizes[i] for i in retry],
                message.config,
                message.client_hostname,
            ),
            wall_clock_ms(),
        )
        for position, index in enumerate(retry):
            reply.codes[index] = again.codes[position]
            reply.grants[index] = again.grants[position]
        reply.segments.update(again.segments)
        return reply

    async def _put_end(self, message: PutEnd) -> CodesReply:
        pending = self.service.put_end(message, wall_clock_ms())
        segment_ids = list(pending.commits)
        outcomes = await asyncio.gather(
            *(self._commit(s, pending.commits[s]) for s in segment_ids)
        )
        results = dict(zip(segment_ids, outcomes))
        return self.service.finish_put_end(pending, results, wall_clock_ms())

    async def _commit(self, segment_id: str, entries: list[InventoryEntry]) -> list[int]:
        failed = [int(ErrorCode.TRANSFER_FAIL)] * len(entries)
        conn = self._node_conns.get(segment_id)
        if conn is None:
            return failed
        try:
            reply = await conn.request(
                CommitObjects(segment_id, entries), timeout_ms=NODE_CALL_TIMEOUT_MS
            )
        except KVPoolError as exc:
            log.warning("commit to segment %s failed: %s", segment_id, exc)
            return failed
        assert isinstance(reply, CodesReply)
        if len(reply.codes) != len(entries):
            log.warning("segment %s answered %d codes for %d entries", segment_id, len(reply.codes), len(entries))
            return failed
        return reply.codes

    async def _flush_drops(self) -> None:
        """Send the service's drop outbox; ranges are freed as each node acknowledges."""
        async with self._flush_lock:
            for segment_id, entries in self.service.take_drops().items():
                self._unsent_drops.setdefault(segment_id, []).extend(entries)
            batches = list(self._unsent_drops.items())
            self._unsent_drops = {}
            await asyncio.gather(*(self._drop(s, e) for s, e in batches))

    async def _drop(self, segment_id: str, entries: list[InventoryEntry]) -> None:
        conn = self._node_conns.get(segment_id)
        sent = 0
        if conn is not None:
            try:
                while sent < len(entries):
                    chunk = entries[sent : sent + limits.BATCH_KEYS_MAX]
                    await conn.request(DropObjects(segment_id, chunk), timeout_ms=NODE_CALL_TIMEOUT_MS)
                    self.service.drops_done(segment_id, chunk, wall_clock_ms())
                    sent += len(chunk)
            except KVPoolError as exc:
                log.info("drop on segment %s deferred: %s", segment_id, exc)
        if sent < len(entries) and self.service.has_segment(segment_id):
            # Kept until the node is back, or its segment is gone (the ranges go with it).
            self._unsent_drops.setdefault(segment_id, []).extend(entries[sent:])

    async def _tick_forever(self) -> None:
        while True:  # Runs until stop() cancels it.
            await asyncio.sleep(TICK_INTERVAL_MS / 1000)
            try:
                self.service.tick(wall_clock_ms())
                await self._flush_drops()
                if self.debug_invariants:
                    self.service.check_invariants()
            except KVPoolError as exc:
                log.warning("tick: %s", exc)

