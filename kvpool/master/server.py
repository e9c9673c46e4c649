"""The master process's I/O shell: RPC server, node calls, ticks and the HTTP endpoints.

All decisions are MasterService's (service.py, pure). This module only moves messages: it
feeds requests to the service with the wall clock (its times leave this host: a grant's
expiry and a move's deadline are checked by nodes), and node liveness and drains with
`liveness_clock_ms` (service.py's Clocks), sends the service's outbox to nodes
(CommitObjects at put_end, DropObjects before a range is reused) on the connection each node
opened, runs `tick` periodically, and serves /metrics, /health and /status over HTTP.

Tiers (docs/tiers.md): the service's move outbox (offloads, promotions) is sent as MoveObjects
to the node that holds the bytes, in the background after each tick; a put that found no room
waits (bounded) for the moves in flight and their drops before it tries again; a put_end with
write-through copies replies once its copies are done. With a DFS directory the master mounts
the shared filesystem as one more segment, rebuilt from the directory's files whenever a
service starts (at start, and each new term), and removes DFS files itself when the service
drops DFS replicas.

With an `ElectionConfig` the master is one candidate of an HA group (election.py): while it
is not the leader, or past its leadership deadline, every request gets NotLeader and nothing
reaches a node; each term of leadership starts from a fresh MasterService that the nodes
re-mount into, and takes puts and removes once the takeover (takeover.py) is over. A flow
that awaits a node keeps the service of the term it started in, so a late reply can never
touch the state of a later term.

Durations of this process alone (the takeover's grace, a node link's silence, when to look at
the DFS again) run on `local_clock_ms`, which no clock step moves: a wall clock stepped
forward opened a takeover at once, and one stepped back held puts off for as long.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import random
import secrets
import socket
import threading
import time
from collections.abc import Awaitable, Sequence

import msgspec

from kvpool import limits
from kvpool.config import MasterConfig, check_busy_poll_us
from kvpool.discovery import LeaderRecord
from kvpool.errors import ErrorCode, InvalidParams, InvalidRequest, KVPoolError, NotLeader
from kvpool.master.election import ElectionConfig, Elector, lease_clock_ms
from kvpool.master.metrics import MasterMetrics, start_http
from kvpool.master.removed_at_start import RemovedAtStart
from kvpool.master.service import MasterService, Removal
from kvpool.master.takeover import Takeover
from kvpool.process import raise_open_files_limit
from kvpool.protocol import auth, objectfile
from kvpool.protocol.messages import (
    TIER_DFS,
    TIER_DRAM,
    ClusterStatus,
    CodesReply,
    CommitObjects,
    CountReply,
    DrainSegment,
    DropObjects,
    ExistKeys,
    FilesystemReport,
    GetReplicaList,
    GetReplicaListReply,
    Heartbeat,
    InventoryEntry,
    ListObjects,
    LongestPrefix,
    Message,
    MountReply,
    MountSegment,
    MoveItem,
    MoveObjects,
    OkReply,
    PutEnd,
    PutRevoke,
    PutStart,
    PutStartReply,
    QueryObjects,
    ReleaseLeases,
    Remove,
    RemoveAll,
    RemoveByRegex,
    ReportBadReplicas,
    SegmentInfo,
    UnmountSegment,
    VerifyObjects,
)
from kvpool.repeated_log import RepeatedLog
from kvpool.transports import files
from kvpool.transports.connection import Connection, HandlerResult, Listener, Reply, refuse_open_listen, start_server
from kvpool.transports.dfs import DfsDirectory

log = logging.getLogger(__name__)
# Puts refused for want of room: errors_total counts each; the log says it now and then.
_no_room = RepeatedLog(log, logging.INFO)

TICK_INTERVAL_MS = 200
# A tick this late says the master itself did not run (nodes' TTLs are not charged for it).
STALL_EXCUSED_MS_MIN = 1_000
NODE_CALL_TIMEOUT_MS = limits.RPC_TIMEOUT_MS_DEFAULT
# How long a remove waits for its nodes to forget what it removed before it answers all the same
# (_removed): a node answers a drop in a millisecond or two; one that stops answering must not
# take the client's whole RPC timeout (its drops go on, kept as tombstones if its segment goes).
REMOVE_DROPS_WAIT_MS = 1_000
# What a new leader refuses until its takeover is over: requests that change what exists.
_TAKEOVER_REFUSED = (PutStart, Remove, RemoveByRegex, RemoveAll)
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")
_GONE_OR_UNKNOWN = (ErrorCode.OK, ErrorCode.OBJECT_NOT_FOUND)
# How long a master without election remembers its removes for the nodes that re-mount after
# its restart (RemovedAtStart): they try to reach it at most every RECONNECT_BACKOFF_MS_MAX,
# and a master adopting many inventories at once takes their mounts up late. Only a memory
# bound: a segment's first mount holds nothing put since, however late it comes.
REMOUNT_WINDOW_MS = 15_000
# The same for a new leader, from its election: the nodes of a predecessor that froze notice
# only when a heartbeat times out (the RPC timeout), after the takeover may have opened on its
# grace, then look the leader up and connect.
TAKEOVER_REMOUNT_WINDOW_MS = limits.HEARTBEAT_INTERVAL_MS_DEFAULT + limits.RPC_TIMEOUT_MS_DEFAULT + REMOUNT_WINDOW_MS
# A put that found no room waits at most this long for moves and drops in flight to free some
# (in at most limits.PUT_ROOM_ROUNDS_MAX rounds).
PUT_ROOM_WAIT_MS = limits.RPC_TIMEOUT_MS_DEFAULT // 2
# Inventory entries per MountSegment of the DFS (its files, scanned at start).
_DFS_MOUNT_CHUNK = limits.BATCH_KEYS_MAX
_DFS_UNLINK_CHUNK = 1_024  # refused files unlinked between two looks at the DFS's liveness
# How often a running master removes the DFS's temporary files whose writer is gone (a node
# killed mid-copy leaves its in-flight ones, up to its move budget): the scan at start removes
# them too, and a master that ran for weeks let them fill the share meanwhile.
DFS_TEMP_SWEEP_INTERVAL_MS = limits.DFS_TEMP_FILE_AGE_MS_MAX
# How often at most it walks the DFS for the temporary files of nodes gone mid-copy (their
# names say whose they are: objectfile.temp_name), sooner than their hour: each walk lists
# every file of the share, and a node crash-looping would otherwise have one walk per run.
DFS_GONE_WRITERS_SWEEP_INTERVAL_MS = 60_000
# Nodes whose DFS copies went unanswered, remembered at most (the oldest forgotten, their files
# left to the hourly sweep): one per node killed mid-copy, forgotten once it is walked for.
DFS_WRITERS_UNANSWERED_MAX = 10_000


class _RoomWaiter:
    """A put waiting for room: its request, its reply so far, and the indexes of its keys
    still without room (MasterServer._put_start_after_drops)."""

    __slots__ = ("service", "message", "reply", "retry", "served")

    def __init__(self, service: MasterService, message: PutStart, reply: PutStartReply, retry: list[int]) -> None:
        self.service = service
        self.message = message
        self.reply = reply
        self.retry = retry
        self.served = asyncio.Event()  # set once room that landed took its last key


def _short_of_room(service: MasterService, message: PutStart, reply: PutStartReply) -> list[int]:
    """The indexes of a put's keys that found no room and may yet (eviction, a node's mount):
    one larger than every segment never would."""
    fits = service.fits_a_segment
    return [i for i, code in enumerate(reply.codes) if code == ErrorCode.NO_AVAILABLE_HANDLE and fits(message.sizes[i])]


async def _wait_unless_served(waiter: _RoomWaiter, tasks: list[asyncio.Task[None]], deadline_s: float) -> None:
    """Until `tasks` are done, room that landed took the waiter's last key (a node slow to
    answer may hold up its own moves or drops long after), or the deadline (loop time)."""
    loop = asyncio.get_running_loop()
    every = asyncio.ensure_future(asyncio.wait(tasks))
    served = asyncio.ensure_future(waiter.served.wait())
    await asyncio.wait((every, served), timeout=max(0.0, deadline_s - loop.time()), return_when=asyncio.FIRST_COMPLETED)
    every.cancel()  # the wait, not the tasks: they go on
    served.cancel()


def _log_task_failure(task: asyncio.Task[None], *, doing: str) -> None:
    """A background task's end (its done callback): a KVPoolError is an operating error,
    tried again at the next tick; anything else a bug, said loudly."""
    exc = None if task.cancelled() else task.exception()
    if isinstance(exc, KVPoolError):
        log.warning("%s: %s (tried again at the next tick)", doing, exc)
    elif exc is not None:
        log.error("%s failed", doing, exc_info=exc)


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


# The clock of a node's liveness and a drain's deadline in the service (service.py's Clocks):
# CLOCK_MONOTONIC, the event loop's, on which _tick_forever measures the master's own stalls
# that it excuses from node TTLs; no step of the wall clock moves it, and neither does a
# suspend of the host (its nodes could not be heard). It reads as the wall clock did when this
# module loaded, so a caller that mounts segments in server.service on the wall clock alone (a
# test) sees them timed out alike.
_LIVENESS_EPOCH_MS = time.time_ns() // 1_000_000 - time.monotonic_ns() // 1_000_000


def liveness_clock_ms() -> int:
    return time.monotonic_ns() // 1_000_000 + _LIVENESS_EPOCH_MS


# The clock of durations on this host (the module docstring): the election's, so that a
# takeover's grace and the leadership it began with count the same time.
local_clock_ms = lease_clock_ms


def _not_back_soon(message: Message, result: Message) -> bool:
    """Whether the client, once answered, will not be back within a busy-poll window: a node's
    heartbeat (the next comes in a second: polling after each would keep a master of a thousand
    nodes busy a fifth of the time), or a client that moves so many bytes before its next
    request (a put's writes, a get's reads) that polling would only take CPU from its copies."""
    if isinstance(message, Heartbeat):
        return True
    if isinstance(message, PutStart):
        return sum(message.sizes) >= limits.BUSY_POLL_HOLD_OFF_BYTES
    if isinstance(result, GetReplicaListReply):
        return sum(result.sizes) >= limits.BUSY_POLL_HOLD_OFF_BYTES
    return False


@dataclasses.dataclass(slots=True)
class _NodeLink:
    """The connection a segment's node mounted it on (only that connection changes it, see
    MasterServer._check_segment_owner), and when the node last mounted or heartbeat on it
    (local_clock_ms)."""

    conn: Connection
    heard_ms: int


class MasterServer:
    """Serves one MasterService. Holds, per mounted segment, the connection its node opened."""

    def __init__(
        self,
        config: MasterConfig = MasterConfig(),
        *,
        host: str = "127.0.0.1",
        port: int = limits.MASTER_PORT_DEFAULT,
        http_port: int | None = None,
        http_host: str | None = None,
        token: str | None = None,
        accepted_tokens: Sequence[str] = (),
        seed: int | None = None,
        debug_invariants: bool = False,
        election: ElectionConfig | None = None,
        advertise_host: str | None = None,
        dfs_dir: str | None = None,
        dfs_bytes: int = 0,
        busy_poll_us: int = limits.BUSY_POLL_US_DEFAULT,
    ) -> None:
        self.config = config
        # Check every structure after every request (KVPOOL_DEBUG_INVARIANTS=1): O(n) each.
        self.debug_invariants = debug_invariants
        self.host = host
        self.port = port
        self.http_port = http_port
        self.http_host = http_host or host  # /metrics, /health, /status: read-only, no token
        check_busy_poll_us(busy_poll_us)
        self.busy_poll_us = busy_poll_us  # transports/busy_poll.py
        # `token` signs grants; it and `accepted_tokens` (rotating in or out) are accepted from peers.
        self._keyring = auth.Keyring.of([token, *accepted_tokens] if token else [])
        self._seed = seed
        self.service = MasterService(
            config, random.Random(seed), self._keyring.primary, term=_new_term_id(), local_clock=True
        )
        self.metrics = MasterMetrics(self.service, lambda: self.role)
        self.advertise_host = advertise_host
        self._election = election
        self.elector: Elector | None = None
        # A mount in parts under way: its objects re-adopted and rejected so far (_log_mount).
        self._mount_counts: dict[str, tuple[int, int]] = {}
        self._takeover: Takeover | None = None
        self._removed_at_start = RemovedAtStart(0)  # set at start, or at each election
        self._node_links: dict[str, _NodeLink] = {}  # per segment id
        self._unsent_drops: dict[str, list[InventoryEntry]] = {}
        self._drops_failing: set[str] = set()  # segment ids whose last drop failed (logged once)
        self._server: Listener | None = None
        self._http = None
        self._tick_task: asyncio.Task[None] | None = None
        self._sweep_task: asyncio.Task[None] | None = None
        self._drop_tasks: dict[str, asyncio.Task[None]] = {}  # segment id -> its drops in flight
        self._drops_moving: asyncio.Future[None] | None = None  # done when drops move on (_removed)
        # Puts waiting for room, oldest first: room that lands is theirs before any new put's.
        self._room_waiters: list[_RoomWaiter] = []
        # A master without election, just started: a put that finds no segment waits a moment
        # for its nodes' mounts until then (local clock; 0: not waiting), `_node_mounted` says one came.
        self._first_mounts_until_ms = 0
        self._node_mounted = asyncio.Event()
        # Tiers: the moves being sent, the DFS directory, and the service it is mounted in.
        self._move_tasks: set[asyncio.Task[None]] = set()
        self._verify_tasks: set[asyncio.Task[None]] = set()  # checks of reported replicas
        self._dfs_mark_task: asyncio.Task[None] | None = None  # replace_tokens's
        self._dfs_opened_marks: list[str] = []  # the marks the DFS was opened with (start)
        self._is_stopping = False
        self._dfs_dir = dfs_dir
        self._dfs_bytes = dfs_bytes
        self._dfs: DfsDirectory | None = None
        self._dfs_info: SegmentInfo | None = None
        self._dfs_service: MasterService | None = None
        self._dfs_free_due_ms = 0  # when to look at the DFS's free space next
        self._dfs_task: asyncio.Task[None] | None = None  # its mount, or a look at it, in flight
        self._dfs_temps_due_ms = 0  # when to remove dead writers' temporary files next
        self._dfs_temps_task: asyncio.Task[None] | None = None  # that removal, in flight
        # DFS writers: a node's DRAM segment id names its temporary files there. Per open
        # connection, the one its node mounted; those this term asked for DFS copies that went
        # unanswered (killed mid-copy?), oldest first, with a number per record, forgotten once
        # their node answers or mounts again (it removes its own late copies) or a walk for them
        # ends; and, per tag, those the walk in flight removes the files of (with their number).
        self._dfs_writer_of_conn: dict[Connection, str] = {}
        self._dfs_writers_unanswered: dict[str, int] = {}
        self._dfs_writers_recorded = 0  # records so far: each record's number
        self._dfs_writers_over = False  # past DFS_WRITERS_UNANSWERED_MAX (logged once a term)
        self._dfs_tags_gone: dict[str, tuple[str, int]] = {}
        self._dfs_writers_due_ms = 0  # when the next walk for them may start

    def __repr__(self) -> str:
        return f"<MasterServer {self.endpoint} {self.role} nodes={len(self._node_links)}>"

    @property
    def endpoint(self) -> str:
        """Where it listens, "host:port", an IPv6 host in brackets as the node writes its own."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def advertised_endpoint(self) -> str:
        """What the leader record tells clients and nodes to dial."""
        host = self.advertise_host or self.host
        if host in _WILDCARD_HOSTS:
            host = socket.gethostname()
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def role(self) -> str:
        """"single" (no election), "leader", "recovering" (leader, takeover not over) or "standby"."""
        if self.elector is None:
            return "single"
        if not self.elector.is_leader():
            return "standby"
        takeover = self._takeover
        return "leader" if takeover is not None and takeover.is_open(local_clock_ms()) else "recovering"

    async def start(self) -> None:
        refuse_open_listen(self.host, self._keyring.primary)
        if self.http_port is not None:
            refuse_open_listen(self.http_host, self._keyring.primary, " for /metrics, /health and /status")
        if self._election is None:  # before the DFS mounts: its remounts are then not first mounts
            self._removed_at_start = RemovedAtStart(local_clock_ms() + REMOUNT_WINDOW_MS)
            self._first_mounts_until_ms = local_clock_ms() + REMOUNT_WINDOW_MS
        if self._dfs_dir:
            await self._open_dfs()
            await self._ensure_dfs()
        self._server = await start_server(
            self.host, self.port, self, keyring=self._keyring, name="master", busy_poll_us=self.busy_poll_us,
            not_back_soon=_not_back_soon, flags="--host, --port",
        )  # fmt: skip
        self.metrics.busy_poll = self._server.busy_poll
        self.port = self._server.port
        if self.http_port is not None:
            self._http, self.http_port = await start_http(self.http_host, self.http_port, self)
        self._tick_task = asyncio.get_running_loop().create_task(self._tick_forever())
        if self._dfs is not None and self._keyring.marks() != self._dfs_opened_marks:
            # Tokens replaced while the DFS opened (a SIGUSR1 during a slow share's start):
            # replace_tokens left the marking to start(), whose open read the old marks.
            self._dfs_mark_task = asyncio.get_running_loop().create_task(self._mark_dfs(self._dfs))
        http_host = f"[{self.http_host}]" if ":" in self.http_host else self.http_host
        http = f", /metrics on http://{http_host}:{self.http_port}" if self._http is not None else ""
        auth_said = f"on, token mark {self._keyring.first_mark()}" if self._keyring else "off"
        log.info("master listening on %s (auth %s, open files limit %d%s)", self.endpoint,
                 auth_said, raise_open_files_limit(), http)  # fmt: skip
        if self._election is not None:
            http = f"{self.advertised_endpoint.rpartition(':')[0]}:{self.http_port or 0}"
            record = LeaderRecord(self.advertised_endpoint, http, secrets.token_hex(6))
            mark, *also = self._keyring.marks()
            election = dataclasses.replace(self._election, cluster_mark=mark, also_marks=tuple(also))
            self.elector = Elector(election, record, self)
            self.elector.start()
            log.info("master %s is a candidate of cluster %s (etcd %s)", record.endpoint,
                     self._election.cluster_id, ",".join(self._election.etcd_endpoints))  # fmt: skip

    def replace_tokens(self, tokens: Sequence[str]) -> None:
        """Accept these cluster tokens from now on and sign grants with the first (a token
        rotating in or out: docs/operations.md "Rotating the token"). Connections whose peer
        proved a token no longer accepted are closed; the DFS's and etcd's marks of the cluster
        follow the first token (retried until they do), so that a master restarted with it
        alone still finds them its own. Before start() has started its tick (the signal came
        early) only the tokens change: start() marks with them.

        Raises:
            InvalidParams: no token for a master started with one, or one for a master started
                without (auth.Keyring.replace).
        """
        self._keyring.replace(tokens)
        self.service.set_cluster_key(self._keyring.primary)
        server = self._server
        closed = server.close_unaccepted(self._keyring) if server is not None else 0
        if self._tick_task is not None and not self._is_stopping:  # started, not stopping
            if self.elector is not None:
                self.elector.rotate_marks(self._keyring.marks())
            if self._dfs is not None and (self._dfs_mark_task is None or self._dfs_mark_task.done()):
                self._dfs_mark_task = asyncio.get_running_loop().create_task(self._mark_dfs(self._dfs))
        log.info("master %s: cluster tokens replaced: %d accepted, grants signed with the first (mark %s); %d "
                 "connections closed (their token is no longer accepted)",
                 self.endpoint, len(self._keyring.keys), self._keyring.first_mark(), closed)  # fmt: skip

    async def _mark_dfs(self, dfs: DfsDirectory) -> None:
        """Mark the DFS with the first token's mark, until it is (a share that does not answer
        is tried again): the marks are read again at each try, so the latest tokens win."""
        while True:
            mark, *also = self._keyring.marks()
            try:
                await asyncio.to_thread(dfs.mark_owner, mark, also)
            except (OSError, KVPoolError) as exc:
                log.warning("the DFS %s: its cluster mark not updated for the new token yet (%s); trying "
                            "again in %d s", dfs.path, exc, limits.CLUSTER_MARK_RETRY_MS // 1000)  # fmt: skip
                await asyncio.sleep(limits.CLUSTER_MARK_RETRY_MS / 1000)
                continue
            if self._keyring.marks()[0] == mark:
                log.info("the DFS %s: marked with the first cluster token's mark (%s)", dfs.path, mark[:8])
                return

    async def stop(self) -> None:
        self._is_stopping = True
        if self.elector is not None:
            await self.elector.stop()  # A leader revokes its lease: a standby takes over now.
        if self._tick_task is not None:
            self._tick_task.cancel()
        if self._sweep_task is not None:
            self._sweep_task.cancel()
        for task in [*self._move_tasks, *self._verify_tasks, *self._drop_tasks.values(), self._dfs_task,
                     self._dfs_temps_task, self._dfs_mark_task]:  # fmt: skip
            if task is not None:
                task.cancel()
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
        # Meanwhile nothing new is placed on its segments, and objects held only there read
        # as missing (service.node_link_lost).
        lost = [segment_id for segment_id, link in self._node_links.items() if link.conn is conn]
        for segment_id in lost:
            del self._node_links[segment_id]
        self._dfs_writer_of_conn.pop(conn, None)
        if lost and self.service.node_link_lost(lost):
            log.info(
                "lost the connection to the node of %s: no puts there, and objects held only there read as "
                "missing, until it speaks again", ", ".join(lost),
            )  # fmt: skip

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
        if isinstance(reply, Reply) and reply.then is not None:
            then = reply.then

            def then_checked() -> None:
                then()
                self.service.check_invariants()

            reply = reply._replace(then=then_checked)
        return reply

    def _dispatch(self, conn: Connection, message: Message) -> HandlerResult | Awaitable[HandlerResult]:
        now_ms = wall_clock_ms()
        if self.elector is not None:
            self._check_leading(message)
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
                reply = service.remove(message, now_ms)
                # Gone, or unknown here (it may be on a node not back yet); not one a reader kept.
                gone = [key for key, code in zip(message.keys, reply.codes) if code in _GONE_OR_UNKNOWN]
                self._removed_at_start.removed(gone, now_ms=local_clock_ms())
                return self._removed(reply)
            case RemoveByRegex() | RemoveAll():
                removal = service.removal(message)
                pattern = message.pattern if isinstance(message, RemoveByRegex) else None
                self._removed_at_start.removed(pattern=pattern, is_all=pattern is None, now_ms=local_clock_ms())
                return self._remove_in_steps(service, removal)
            case QueryObjects():
                return service.query_objects(message, now_ms)
            case ListObjects():
                return service.list_objects(message, now_ms)
            case ClusterStatus():
                return service.cluster_status(message, now_ms)
            case MountSegment():
                self._check_segment_owner(conn, message.segment.segment_id)
                self._dfs_writer_mounts(conn, message.segment)
                reply = self._mount(service, message, now_ms)
                heard_ms = local_clock_ms()
                self._node_links[message.segment.segment_id] = _NodeLink(conn, heard_ms)
                # Its node's other segments on this link are not silent either: the parts of a
                # large disk tier's mount (a million objects: 5-10 s) timed out the DRAM segment
                # mounted before them, and its next mount, after the heartbeat said so, again.
                siblings = [s for s, link in self._node_links.items() if link.conn is conn]
                for segment_id in siblings:
                    self._node_links[segment_id].heard_ms = heard_ms
                service.hear(siblings, liveness_clock_ms())
                if self._takeover is not None and message.is_last:  # its inventory is whole
                    self._takeover.mounted(message.segment.segment_id)
                if message.is_last:
                    self._node_mounted.set()
                self._log_mount(message, reply)
                return reply
            case Heartbeat():
                # A node binds its segments to its connection by mounting them (it mounts on
                # every new connection, before it heartbeats): a heartbeat counts only for the
                # segments bound to its own connection, and those the master does not know
                # (the reply has the node mount them). Another peer's heartbeat once took a
                # segment whose link was gone, with the drops and commits meant for its node,
                # and kept the node's own mount refused while it went on heartbeating.
                owned = []
                heard_ms = local_clock_ms()
                for segment_id in message.segment_ids:
                    link = self._node_links.get(segment_id)
                    if link is not None and link.conn is conn:
                        link.heard_ms = heard_ms
                        owned.append(segment_id)
                    elif not service.has_segment(segment_id):
                        owned.append(segment_id)
                if len(owned) < len(message.segment_ids):
                    message = Heartbeat(owned, {s: r for s, r in message.filesystems.items() if s in owned})
                self._removed_at_start.settled(owned)  # it read its mount's replies
                return service.heartbeat(message, now_ms, liveness_clock_ms())
            case UnmountSegment():
                self._check_segment_owner(conn, message.segment_id)
                reply = service.unmount_segment(message, now_ms)
                self._node_links.pop(message.segment_id, None)
                self._unsent_drops.pop(message.segment_id, None)
                self._drops_failing.discard(message.segment_id)
                return reply
            case DrainSegment():
                self._check_segment_owner(conn, message.segment_id)
                return service.drain_segment(message, now_ms, liveness_clock_ms())
            case ReportBadReplicas():
                return self._verify_reported(message, now_ms)
            case ReleaseLeases():
                return service.release_leases(message, now_ms)
        raise InvalidParams(f"the master does not serve {type(message).__name__}")

    def _log_mount(self, mount: MountSegment, reply: MountReply) -> None:
        """One line per mount, at its last part, with the counts of all its parts: a node of
        40,000 objects logged a line per part of 16,384, the last saying "7232 objects
        re-adopted", which read like a loss."""
        segment = mount.segment
        before = self._mount_counts.pop(segment.segment_id, (0, 0))
        adopted, rejected = (0, 0) if mount.is_first else before
        adopted += len(mount.inventory) - len(reply.rejected)
        rejected += len(reply.rejected)
        if not mount.is_last:
            self._mount_counts[segment.segment_id] = (adopted, rejected)
            return
        log.info("mounted segment %s of %s (%d bytes, %d objects re-adopted, %d rejected)",
                 segment.segment_id, segment.endpoint, segment.capacity_bytes, adopted, rejected)  # fmt: skip

    def _mount(self, service: MasterService, mount: MountSegment, now_ms: int) -> MountReply:
        """service.mount_segment, less the entries a remove of this master's first moments
        named (RemovedAtStart), which its reply rejects too, so that the node (or the DFS sweep)
        drops them."""
        segment_id, local_ms = mount.segment.segment_id, local_clock_ms()  # one time for both calls
        inventory, removed = self._removed_at_start.mounting(segment_id, mount.inventory, local_ms)
        reply = service.mount_segment(msgspec.structs.replace(mount, inventory=inventory) if removed else mount,
                                      now_ms, liveness_clock_ms())  # fmt: skip
        self._removed_at_start.mounted(segment_id, mount.is_last, local_ms)
        if not removed:
            return reply
        service.counters.refused_returns += len(removed)
        log.info("segment %s mounted holding %d objects removed since this master started or was elected: refused",
                 segment_id, len(removed))  # fmt: skip
        return msgspec.structs.replace(reply, rejected=[*reply.rejected, *removed])

    def _node_conn(self, segment_id: str) -> Connection | None:
        link = self._node_links.get(segment_id)
        return None if link is None else link.conn

    def _check_segment_owner(self, conn: Connection, segment_id: str) -> None:
        """Refuse a mount, unmount or drain of a segment that another connection serves, live:
        open, and heard (a mount or heartbeat) within a third of the node TTL. Any peer that
        holds the cluster token could otherwise take a node's segment (its commits went to the
        taker, and a master restart lost every object put meanwhile) or unmount it. A node that
        reconnects while its old link lingers half-open is refused until that link is silent
        that long (it retries with backoff). The master's own DFS segment is nobody's to change.

        Raises:
            InvalidRequest: the segment is another live connection's, or the DFS tier's.
        """
        if self._dfs_info is not None and segment_id == self._dfs_info.segment_id:
            raise InvalidRequest(f"segment {segment_id} is the master's DFS tier: no peer mounts or unmounts it")
        bound = self._node_links.get(segment_id)
        if bound is None or bound.conn is conn or bound.conn.is_closed():
            return
        silent_ms = local_clock_ms() - bound.heard_ms
        if silent_ms < self.config.node_ttl_ms // 3:
            raise InvalidRequest(
                f"segment {segment_id} is served by another connection, heard {silent_ms} ms ago: "
                f"only its node changes it (a node that reconnected is taken once its old link "
                f"closes or stays silent {self.config.node_ttl_ms // 3} ms)"
            )

    # --- flows that call nodes ----------------------------------------------------------------

    def _put_start(self, message: PutStart) -> PutStartReply | Awaitable[PutStartReply]:
        service = self.service
        reply = service.put_start(message, wall_clock_ms())
        retry = _short_of_room(service, message, reply)
        if not retry:
            if self._waits_for_first_mounts(service, reply):
                return self._put_start_after_a_mount(service, message, reply)
            return service.put_start_settled(reply)  # the common case answers at once, without a task
        if not self._is_room_coming(service):
            _no_room.log("put of %d keys: no room, and none coming (nothing evictable)", len(retry))
            return service.put_start_settled(reply)
        return self._put_start_after_drops(service, message, reply, retry)

    def _waits_for_first_mounts(self, service: MasterService, reply: PutStartReply) -> bool:
        """Whether a put some of whose keys found no segment at all waits for a node's mount:
        right after a master without election started (REMOUNT_WINDOW_MS), before any node
        mounted. It was refused in the second its nodes took to mount again, and a serving
        engine's saves with it (walk-through helper-147)."""
        return (
            not self._node_mounted.is_set()
            and local_clock_ms() < self._first_mounts_until_ms
            and ErrorCode.NO_AVAILABLE_HANDLE in reply.codes
            and not service.fits_a_segment(1)  # no segment takes puts
        )

    async def _put_start_after_a_mount(
        self, service: MasterService, message: PutStart, reply: PutStartReply
    ) -> PutStartReply:
        """_put_start's keys that found no segment, placed again once a node mounted, as any
        put is: a node back after a restart brings its whole inventory, a full cache's, and
        keys short of room wait for eviction's. The mount and the room share one wait,
        PUT_ROOM_WAIT_MS (within the client's default RPC timeout). Replicas are best effort:
        the first node to mount takes them all (review helper-158)."""
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + min(PUT_ROOM_WAIT_MS, self._first_mounts_until_ms - local_clock_ms()) / 1000
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(deadline_s):
                await self._node_mounted.wait()
        retry = _short_of_room(service, message, reply)
        if retry and service is self.service:
            retry = service.put_start_again(message, reply, retry, wall_clock_ms())
            if retry and self._is_room_coming(service) and loop.time() < deadline_s:
                return await self._put_start_after_drops(service, message, reply, retry, deadline_s)
        return self._settled_late(service, reply)

    def _are_drops_coming(self, service: MasterService) -> bool:
        # Eviction scheduled drops, or drops are in flight, or wait to be sent (again: a node
        # did not answer).
        return service.has_pending_drops() or bool(self._drop_tasks) or bool(self._unsent_drops)

    def _is_room_coming(self, service: MasterService) -> bool:
        # Drops are coming, or moves (offloads to a slower tier) are on their way: their drops
        # will follow ...
        is_coming = self._are_drops_coming(service) or service.has_unsent_moves() or bool(self._move_tasks)
        # ... or eviction for room is backed off for a moment (a long scan found too few: leases
        # given back meanwhile make objects evictable again).
        return is_coming or service.evict_back_off_left_ms(wall_clock_ms()) > 0

    async def _put_start_after_drops(
        self,
        service: MasterService,
        message: PutStart,
        reply: PutStartReply,
        retry: list[int],
        deadline_s: float | None = None,
    ) -> PutStartReply:
        """Try the keys that found no room again once the room coming is there: in rounds
        (limits.PUT_ROOM_ROUNDS_MAX, PUT_ROOM_WAIT_MS in all), each waiting for the moves in flight
        (offloads free their DRAM ranges once copied), then flushing the drops (a range is free
        once its node forgot the object). Meanwhile room that lands is given to the waiting
        puts first, oldest first (_give_room_to_waiters), so that new puts do not take it from
        under them round after round. `deadline_s` (loop time): the end of a wait begun before
        (PUT_ROOM_WAIT_MS from now by default)."""
        loop = asyncio.get_running_loop()
        if deadline_s is None:
            deadline_s = loop.time() + PUT_ROOM_WAIT_MS / 1000
        waiter = _RoomWaiter(service, message, reply, retry)
        self._room_waiters.append(waiter)
        rounds = 0
        try:
            for rounds in range(limits.PUT_ROOM_ROUNDS_MAX):
                if service.has_unsent_moves() or self._move_tasks:
                    self._send_moves()
                    tasks = list(self._move_tasks)
                    if tasks:
                        await _wait_unless_served(waiter, tasks, deadline_s)
                elif not self._are_drops_coming(service):
                    # Only the back-off: wait it out (within the put's wait), then evict.
                    back_off_s = service.evict_back_off_left_ms(wall_clock_ms()) / 1000
                    await asyncio.sleep(min(back_off_s, max(0.0, deadline_s - loop.time())))
                # The drops go on if the put's wait ends first (a node slow to acknowledge).
                drops = self._send_drops()
                if drops:
                    await _wait_unless_served(waiter, drops, deadline_s)
                if service is not self.service:
                    return reply  # The term ended meanwhile: those keys stay NO_AVAILABLE_HANDLE.
                if waiter.retry:
                    waiter.retry = service.put_start_again(message, reply, waiter.retry, wall_clock_ms())
                else:
                    service.room_round_waited()
                if not waiter.retry or not self._is_room_coming(service) or loop.time() >= deadline_s:
                    break
        finally:
            self._room_waiters.remove(waiter)
            if not self._room_waiters:
                service.forget_room_claims()
        if waiter.retry:  # why, for an operator whose errors_total climbs (and a test that fails)
            why = "none coming" if not self._is_room_coming(service) else "the wait is over"
            _no_room.log("put of %d keys: no room after %d rounds (%s)", len(waiter.retry), rounds + 1, why)
        return self._settled_late(service, reply)

    @staticmethod
    def _settled_late(service: MasterService, reply: PutStartReply) -> PutStartReply:
        """put_start_settled of a put answered after a wait: its grants' life is what is left
        of it now, not what it was before the wait."""
        settled = service.put_start_settled(reply)
        if settled.grants:
            settled.grant_ttl_ms = max(1, min(grant.expiry_ms for grant in settled.grants) - wall_clock_ms())
        return settled

    def _give_room_to_waiters(self, service: MasterService) -> None:
        """Room landed (a node acknowledged drops): the puts waiting for room take what they
        can of it now, before the loop serves any other request. Evicts nothing: their own
        rounds do that."""
        now_ms = wall_clock_ms()
        for waiter in self._room_waiters:
            if waiter.retry and waiter.service is service:
                waiter.retry = service.put_start_again(waiter.message, waiter.reply, waiter.retry, now_ms, evict=False)
                if not waiter.retry:
                    waiter.served.set()

    async def _put_end(self, message: PutEnd) -> CodesReply | Reply:
        # The term's service finishes what it started, even if the term ends meanwhile.
        #
        # The answer does not wait for the nodes: once every CommitObjects frame is in the
        # kernel (the node receives it even if this master dies next), the objects are made
        # visible and the put is answered. A node that then refuses an entry (its bytes do
        # not hash to the writer's checksum: a write that broke off, a broken or stale
        # writer) gets that replica dropped, the object too if it has no other
        # (refuse_commits); readers verify checksums, so until then a bad replica is a miss,
        # never wrong bytes. A node the master has no connection to, or a frame
        # still queued in this process, is waited for as before. This takes the nodes'
        # verification (a hash of every byte) and a round trip off the put's critical path.
        # Entering the objects into the table waits until the reply is written (Reply.then):
        # no request is handled in between, and the writer is not kept waiting for it.
        service = self.service
        now_ms = wall_clock_ms()
        pending = service.put_end(message, now_ms)
        hashed = set(message.hashed_in_place)
        calls = {s: asyncio.ensure_future(self._commit(s, e, s in hashed)) for s, e in pending.commits.items()}
        if calls:
            await asyncio.sleep(0)  # each call's first step writes its frame, in order
        results: dict[str, list[int]] = {}
        later: list[tuple[str, asyncio.Future[list[int] | None]]] = []
        for segment_id, call in calls.items():
            conn = self._node_conn(segment_id)
            if call.done() or conn is None or conn.is_write_buffered():
                codes = await call
                if codes is not None:  # else no answer: finish_put_end drops them before reuse
                    results[segment_id] = codes
            else:
                results[segment_id] = [int(ErrorCode.OK)] * len(pending.commits[segment_id])
                later.append((segment_id, call))
        reply = service.settle_put_end(pending, results)
        for segment_id, call in later:
            entries = pending.commits[segment_id]
            call.add_done_callback(lambda done, s=segment_id, e=entries: self._commit_answered(service, s, e, done))
        if not any(put.copy_tiers for put in pending.puts.values()):
            return Reply(reply, then=lambda: service.publish_put_end(pending, wall_clock_ms()))
        service.publish_put_end(pending, wall_clock_ms())
        copies = service.start_copies(pending, reply, wall_clock_ms())
        if copies:
            # Write-through: the put returns once its copies are on disk (or DFS), or failed.
            await asyncio.gather(*(self._move(service, s, items) for s, items in copies.items()))
        return reply

    def _commit_answered(
        self,
        service: MasterService,
        segment_id: str,
        entries: list[InventoryEntry],
        call: asyncio.Future[list[int] | None],
    ) -> None:
        """A node answered a commit the put did not wait for: drop what it refused. No answer
        (the link broke) is no verdict: the object stays, its bytes checked by every read."""
        codes = None if call.cancelled() else call.result()
        if codes is None:
            return
        refused = [entry for entry, code in zip(entries, codes) if code != ErrorCode.OK]
        if refused and service is self.service:
            replicas, objects = service.refuse_commits(segment_id, refused, wall_clock_ms())
            log.warning(
                "segment %s refused %d commits after the put was answered (their writes broke off?): "
                "%d replicas dropped, %d objects with no other", segment_id, len(refused), replicas, objects,
            )  # fmt: skip

    async def _commit(
        self, segment_id: str, entries: list[InventoryEntry], is_hashed_in_place: bool = False
    ) -> list[int] | None:
        return await self._node_codes(CommitObjects(segment_id, entries, is_hashed_in_place))

    async def _node_codes(self, message: CommitObjects | VerifyObjects) -> list[int] | None:
        """The node's code for each of the message's entries, or None when it did not answer
        (no connection, not leading, broken, timed out, the wrong number of codes)."""
        segment_id, entries = message.segment_id, message.entries
        conn = self._node_conn(segment_id)
        if conn is None or not self._is_leading():
            return None
        try:
            reply = await conn.request(message, timeout_ms=NODE_CALL_TIMEOUT_MS)
        except KVPoolError as exc:
            log.warning("%s to segment %s failed: %s", type(message).__name__, segment_id, exc)
            return None
        if not isinstance(reply, CodesReply):  # a node of another version, or a broken one
            log.warning("segment %s answered %s with %s", segment_id, type(message).__name__, type(reply).__name__)
            return None
        if len(reply.codes) != len(entries):
            log.warning("segment %s answered %d codes for %d entries", segment_id, len(reply.codes), len(entries))
            return None
        return reply.codes

    def _send_drops(self) -> list[asyncio.Task[None]]:
        """Send the service's drop outbox, a task per segment, so that a node slow to answer
        (up to NODE_CALL_TIMEOUT_MS) holds up its own drops only; returns the tasks in flight.
        Drops for a segment whose task runs wait in _unsent_drops: that task sends them next.
        Ranges are freed as each node acknowledges.

        A task that is done no longer sends anything, though it stays in _drop_tasks until its
        done callback runs (a later turn of the loop): a new one is started in its place. Taken
        for one still sending, it left the drops of a remove read in between unsent until the
        next tick, and the remove was answered as done meanwhile (_answer_when_dropped no longer
        waited once the callback took the task out): a leader killed then left the objects on
        their node, and its successor served the removed keys again."""
        service = self.service
        self._take_drops()
        dfs_id = self._dfs_info.segment_id if self._dfs_info is not None else None
        tasks = self._drop_tasks
        for segment_id in [s for s in self._unsent_drops if s not in tasks or tasks[s].done()]:
            entries = self._unsent_drops.pop(segment_id)
            is_dfs = segment_id == dfs_id
            send = self._drop_dfs(service, entries) if is_dfs else self._drop(service, segment_id, entries)
            task = asyncio.get_running_loop().create_task(send)
            self._drop_tasks[segment_id] = task
            task.add_done_callback(functools.partial(self._drop_task_done, segment_id))
            task.add_done_callback(functools.partial(_log_task_failure, doing=f"sending drops to segment {segment_id}"))
        return list(self._drop_tasks.values())

    def _take_drops(self) -> dict[str, list[InventoryEntry]]:
        """Move the service's drop outbox into _unsent_drops; returns what it moved."""
        taken = self.service.take_drops()
        for segment_id, entries in taken.items():
            self._unsent_drops.setdefault(segment_id, []).extend(entries)
        return taken

    def _drop_task_done(self, segment_id: str, task: asyncio.Task[None]) -> None:
        if self._drop_tasks.get(segment_id) is task:
            del self._drop_tasks[segment_id]
        self._drops_moved()

    def _drops_moved(self) -> None:
        """Wake what waits for drops (_removed): some were acknowledged, or a segment's
        sending ended."""
        moving, self._drops_moving = self._drops_moving, None
        if moving is not None and not moving.done():
            moving.set_result(None)

    def _removed(self, reply: CodesReply | CountReply) -> HandlerResult | Awaitable[HandlerResult]:
        """A remove's reply, once the nodes that held what it removed have forgotten it (or
        REMOVE_DROPS_WAIT_MS passed, or a node could not be reached: its drops go on, or wait as
        tombstones). Answered before, at the next tick's drops, a master that died in between
        left the objects on their nodes, and its successor took them back when they mounted
        again: removed keys came back, and a key put again since could come back with its old
        bytes and its new put lost (helper-49)."""
        removed = reply.count if isinstance(reply, CountReply) else sum(c == ErrorCode.OK for c in reply.codes)
        if not removed:
            return reply
        taken = self._take_drops()  # the remove's drops, and any scheduled before them
        self._send_drops()
        return self._answer_when_dropped(reply, self.service, taken)

    async def _remove_in_steps(self, service: MasterService, removal: Removal) -> CountReply:
        """A remove_all or remove_by_regex, a step at a time with other requests between
        (service.Removal), answered as _removed answers. Each step's drops are taken at once,
        so that the tick does not send them unseen by the wait for them."""
        taken: dict[str, list[InventoryEntry]] = {}
        while True:
            is_done = removal.step(wall_clock_ms())
            for segment_id, entries in self._take_drops().items():
                taken.setdefault(segment_id, []).extend(entries)
            self._send_drops()
            if is_done:
                break
            await asyncio.sleep(0)
            if service is not self.service:  # a term that ended meanwhile removes no more
                raise NotLeader(f"master {self.advertised_endpoint} stopped leading part way through this removal: "
                                "some keys were removed, some not; ask the leader")  # fmt: skip
        reply = CountReply(removal.count)
        if not removal.count:
            return reply
        return await self._answer_when_dropped(reply, service, taken)

    async def _answer_when_dropped(
        self, reply: CodesReply | CountReply, service: MasterService, taken: dict[str, list[InventoryEntry]]
    ) -> CodesReply | CountReply:
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + REMOVE_DROPS_WAIT_MS / 1000
        resume = dict.fromkeys(taken, 0)  # per segment, the first of its drops that may still wait
        while service is self.service and loop.time() < deadline_s:
            waiting = False
            for segment_id, entries in taken.items():
                if segment_id in self._drop_tasks:
                    resume[segment_id] = service.first_dropping(segment_id, entries, resume[segment_id])
                    waiting = waiting or resume[segment_id] < len(entries)
            if not waiting:
                break
            if self._drops_moving is None:
                self._drops_moving = loop.create_future()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._drops_moving), deadline_s - loop.time())
        if self.elector is not None and not self._leads_as(service):
            # The term ended (or its deadline passed) meanwhile: it sends no more drops, and its
            # successor rebuilds from the nodes, which still hold what was not dropped. Answered
            # as done, the remove's keys came back with the next leader.
            # A segment gone meanwhile took its unacknowledged drops along as tombstones, which
            # die with the term too.
            def is_unsure(segment_id: str, entries: list[InventoryEntry]) -> bool:
                if not service.has_segment(segment_id):
                    return bool(entries)
                return service.first_dropping(segment_id, entries, resume.get(segment_id, 0)) < len(entries)

            if any(is_unsure(segment_id, entries) for segment_id, entries in taken.items()):
                raise NotLeader(f"master {self.advertised_endpoint} stopped leading before its nodes dropped what "
                                f"this remove took: nothing is sure to be removed; ask the leader")  # fmt: skip
        return reply

    async def _drop(self, service: MasterService, segment_id: str, entries: list[InventoryEntry]) -> None:
        """A segment's drops, then those that came for it meanwhile, until one fails."""
        while entries and await self._drop_batch(service, segment_id, entries):
            entries = self._unsent_drops.pop(segment_id, []) if service is self.service else []

    async def _drop_batch(self, service: MasterService, segment_id: str, entries: list[InventoryEntry]) -> bool:
        """Send drops to a segment's node; False if some were not acknowledged."""
        entries = service.drops_due(segment_id, entries)
        conn = self._node_conn(segment_id)
        sent = 0
        if conn is not None:
            try:
                while sent < len(entries):
                    if not self._leads_as(service):
                        return False  # The term is over: its drops die with its state.
                    chunk = entries[sent : sent + limits.DROP_ENTRIES_PER_REQUEST_MAX]
                    await conn.request(DropObjects(segment_id, chunk), timeout_ms=NODE_CALL_TIMEOUT_MS)
                    service.drops_done(segment_id, chunk, wall_clock_ms())
                    self._drops_moved()
                    sent += len(chunk)
                    self._drops_through(segment_id)
                    if self._room_waiters:
                        self._give_room_to_waiters(service)
            except KVPoolError as exc:
                self._drops_deferred(segment_id, exc, logging.INFO)
        if sent < len(entries) and service is self.service and service.has_segment(segment_id):
            # Kept until the node is back, or its segment is gone (the ranges go with it, the
            # entries stay as tombstones: tombstones.py).
            self._unsent_drops.setdefault(segment_id, []).extend(entries[sent:])
        elif not service.has_segment(segment_id):
            self._drops_failing.discard(segment_id)
        return sent == len(entries)

    async def _tick_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:  # Runs until stop() cancels it.
            asleep_s = loop.time()
            await asyncio.sleep(TICK_INTERVAL_MS / 1000)
            # Woken this late: the loop was held (not merely busy awaiting nodes).
            stalled_ms = int((loop.time() - asleep_s) * 1000) - TICK_INTERVAL_MS
            if stalled_ms >= STALL_EXCUSED_MS_MIN:
                log.warning("the master did not run for %d ms: nodes' silence meanwhile is excused", stalled_ms)
                self.service.excuse_stall(stalled_ms)
            if self._dfs is not None and self._is_leading():
                self._tend_dfs()
            if self.elector is not None and self.role != "leader":
                continue  # A standby keeps no state; a new leader waits for its nodes first.
            try:
                self.service.expire_segments(liveness_clock_ms())
                self.service.tick(wall_clock_ms())
                self._removed_at_start.expire(local_clock_ms())
                self._send_moves()
                self._send_drops()  # not awaited: a node slow to answer holds up no tick
                if self.debug_invariants:
                    self.service.check_invariants()
            except KVPoolError as exc:
                log.warning("tick: %s", exc)
            except Exception:  # a bug: say so loudly; a tick that stopped for good would stop
                # evictions, node TTLs, zombie discards and the release of quarantined ranges
                log.exception("tick failed; the next one goes on")
            if self.service.is_sweeping and (self._sweep_task is None or self._sweep_task.done()):
                self._sweep_task = asyncio.get_running_loop().create_task(self._sweep(self.service))

    async def _sweep(self, service: MasterService) -> None:
        """Unmount leaving segments a step at a time, serving requests between the steps."""
        started = time.monotonic()
        try:
            while service is self.service and service.sweep_step():
                await asyncio.sleep(0)
                if self.debug_invariants:
                    service.check_invariants()
        except Exception:  # a bug: say so loudly, the next tick starts over
            log.exception("sweeping leaving segments failed")
            return
        log.info("leaving segments swept in %.2f s", time.monotonic() - started)


    # --- replicas a reader found bad ------------------------------------------------------------

    def _verify_reported(self, message: ReportBadReplicas, now_ms: int) -> OkReply:
        """Have the reported replicas hashed, in the background (by their node, or here for
        the DFS); answered at once. At most VERIFY_TASKS_MAX checks run at a time: more reports
        wait for the next bad read."""
        service = self.service
        for segment_id, entries in service.suspect_replicas(message, now_ms).items():
            if len(self._verify_tasks) >= limits.VERIFY_TASKS_MAX:
                log.info("ignoring a bad-replica report for segment %s: checks in flight", segment_id)
                break
            task = asyncio.get_running_loop().create_task(self._verify(service, segment_id, entries))
            self._verify_tasks.add(task)
            task.add_done_callback(self._verify_tasks.discard)
            task.add_done_callback(functools.partial(_log_task_failure, doing=f"checking replicas on {segment_id}"))
        return OkReply()

    async def _verify(self, service: MasterService, segment_id: str, entries: list[InventoryEntry]) -> None:
        """Hash these replicas where they are: a node's DRAM range or disk file by asking the
        node, a DFS file here (no node owns it: the master keeps the DFS index). Drop those
        found bad (an object keeps its other replicas, service.drop_bad_replicas)."""
        dfs = self._dfs
        if dfs is not None and self._dfs_info is not None and segment_id == self._dfs_info.segment_id:
            sound = await asyncio.to_thread(
                lambda: [files.holds_object(dfs.path_of(e.key, e.offset), e.key, e.size, e.checksum) for e in entries]
            )
            codes: list[int] | None = [int(ErrorCode.OK if ok else ErrorCode.TRANSFER_FAIL) for ok in sound]
        else:
            codes = await self._node_codes(VerifyObjects(segment_id, entries))
        if codes is None:
            return
        bad = [entry for entry, code in zip(entries, codes) if code == ErrorCode.TRANSFER_FAIL]
        if bad and service is self.service:
            replicas, objects = service.drop_bad_replicas(segment_id, bad, wall_clock_ms())
            log.warning("segment %s: %d replicas read bad and confirmed by a check where they are; "
                        "%d dropped, %d objects with them", segment_id, len(bad), replicas, objects)  # fmt: skip

    # --- tiers: moves and the DFS (docs/tiers.md) ---------------------------------------------

    def _send_moves(self) -> None:
        """Send the service's move outbox in the background (a move may take seconds)."""
        service = self.service
        for segment_id, items in service.take_moves().items():
            task = asyncio.get_running_loop().create_task(self._move(service, segment_id, items))
            self._move_tasks.add(task)
            task.add_done_callback(self._move_tasks.discard)
            task.add_done_callback(functools.partial(_log_task_failure, doing=f"moving objects on {segment_id}"))

    async def _move(self, service: MasterService, segment_id: str, items: list[MoveItem]) -> None:
        """One node's moves, in requests of at most MOVE_ITEMS_PER_REQUEST_MAX items; every
        item gets a code back into `service` (TRANSFER_FAIL when its request failed)."""
        conn = self._node_conn(segment_id)
        # The node's DRAM segment id names its DFS temporary files; taken now: a link that
        # closes leaves _dfs_writer_of_conn.
        writer = self._dfs_writer_of_conn.get(conn) if conn is not None else None
        dfs_id = self._dfs_info.segment_id if self._dfs_info is not None else None
        for start in range(0, len(items), limits.MOVE_ITEMS_PER_REQUEST_MAX):
            chunk = items[start : start + limits.MOVE_ITEMS_PER_REQUEST_MAX]
            if conn is None or not self._leads_as(service):
                service.finish_moves(segment_id, chunk, [int(ErrorCode.TRANSFER_FAIL)] * len(chunk), wall_clock_ms())
                continue  # never sent
            codes: list[int] | None = None  # no answer: the node may have recorded some
            # The node's clock judges it (it keeps its offset to the master's wall clock).
            deadline_ms = wall_clock_ms() + limits.MOVE_TIMEOUT_MS - limits.MOVE_DECIDED_BEFORE_TIMEOUT_MS
            try:
                reply = await conn.request(MoveObjects(chunk, deadline_ms), timeout_ms=limits.MOVE_TIMEOUT_MS)
                if isinstance(reply, CodesReply) and len(reply.codes) == len(chunk):
                    codes = reply.codes
            except KVPoolError as exc:
                log.warning("moves on segment %s failed: %s", segment_id, exc)
            if writer is not None and codes is not None:  # alive: it removes its own late copies
                self._dfs_writers_unanswered.pop(writer, None)
            elif writer is not None and any(item.dst_segment_id == dfs_id for item in chunk):
                self._dfs_writer_unanswered(service, writer)
            service.finish_moves(segment_id, chunk, codes, wall_clock_ms())
        if service is self.service and service.has_pending_drops():
            # The offloaded replicas: their room is what puts wait for (those waiting for room
            # wait on the drop tasks themselves). Not awaited: a write-through put, which
            # awaits its copies, would wait on every node's drops, a slow node's included.
            self._send_drops()

    async def _open_dfs(self) -> None:
        assert self._dfs_dir
        self._dfs_opened_marks = self._keyring.marks()
        mark, *also = self._dfs_opened_marks
        try:
            self._dfs = await asyncio.to_thread(DfsDirectory.create_or_open, self._dfs_dir, self._dfs_bytes, mark, also)
        except InvalidParams as exc:  # named by the setting (the CLI says its flag)
            raise InvalidParams(f"dfs_dir: {exc}") from None
        identity = self._dfs.identity()
        assert identity is not None
        self._dfs_info = SegmentInfo(
            segment_id=identity.segment_id, node_id="dfs", hostname="", endpoint="",
            shm_path=str(self._dfs.path), shm_token=identity.token,
            capacity_bytes=identity.capacity_bytes, tier=TIER_DFS,
        )  # fmt: skip

    def _tend_dfs(self) -> None:
        """_ensure_dfs in a task of its own, one at a time. A network filesystem that stops
        answering (an NFS server down under a hard mount) blocks every call on it for as long:
        awaited by the tick, it held node TTLs, eviction and zombie discards with it. Meanwhile
        the DFS has no heartbeat: after the node TTL it is unmounted like a silent node, and
        mounted again from a scan once it answers."""
        if self._dfs_task is None or self._dfs_task.done():
            self._dfs_task = asyncio.get_running_loop().create_task(self._ensure_dfs())
            self._dfs_task.add_done_callback(functools.partial(_log_task_failure, doing="tending the DFS"))
        now_ms = local_clock_ms()
        is_mounted = self._dfs_service is self.service  # its mount's scan sweeps as well: not twice
        if not is_mounted or (self._dfs_temps_task is not None and not self._dfs_temps_task.done()):
            return
        is_due = now_ms >= self._dfs_temps_due_ms
        gone = self._dfs_writers_gone() if now_ms >= self._dfs_writers_due_ms else {}
        if is_due or gone:
            # A task of its own: the walk of every file of the share may outlast the node TTL,
            # which the DFS's heartbeat (_ensure_dfs) must not.
            self._dfs_temps_due_ms = now_ms + DFS_TEMP_SWEEP_INTERVAL_MS
            self._dfs_writers_due_ms = now_ms + DFS_GONE_WRITERS_SWEEP_INTERVAL_MS
            self._dfs_tags_gone = gone
            self._dfs_temps_task = asyncio.get_running_loop().create_task(self._remove_dfs_temporaries(gone))
            self._dfs_temps_task.add_done_callback(
                functools.partial(_log_task_failure, doing="removing the DFS's stale temporary files")
            )

    def _dfs_writer_mounts(self, conn: Connection, segment: SegmentInfo) -> None:
        """A node mounts its DRAM segment, whose id names its DFS temporary files: it is alive
        (the id is new at each start) and judges the copies it began before as late, removing
        their files itself (node/moves.py). Called before the reply, hence before the node is
        sent any new copy: the walk in flight spares every file that node writes from now on."""
        if self._dfs_info is None or segment.tier != TIER_DRAM:
            return
        writer = segment.segment_id
        self._dfs_writer_of_conn[conn] = writer
        self._dfs_writers_unanswered.pop(writer, None)
        if self._dfs_tags_gone:
            self._dfs_tags_gone.pop(objectfile.writer_tag(writer), None)

    def _dfs_writer_unanswered(self, service: MasterService, writer: str) -> None:
        """Remember that `writer` left DFS copies of `service`'s term unanswered."""
        if service is not self.service:
            return  # an earlier term's request: its records went with it (_new_term)
        records = self._dfs_writers_unanswered
        records.pop(writer, None)
        self._dfs_writers_recorded += 1
        records[writer] = self._dfs_writers_recorded  # the newest last
        if len(records) <= DFS_WRITERS_UNANSWERED_MAX:
            return
        if not self._dfs_writers_over:
            self._dfs_writers_over = True
            log.warning("more than %d nodes left DFS copies unanswered: the oldest are forgotten, their "
                        "temporary files removed after an hour", DFS_WRITERS_UNANSWERED_MAX)  # fmt: skip
        del records[next(iter(records))]

    def _dfs_writers_gone(self) -> dict[str, tuple[str, int]]:
        """Per writer tag, the records of _dfs_writers_unanswered whose DRAM segment is not
        mounted (timed out, or left): the master cannot tell a node killed from one cut off,
        and one that comes back mounts again (_dfs_writer_mounts). A node cut off past the
        TTL but alive loses, at most, copies the master has given up on (their rename fails)."""
        service = self.service
        return {
            objectfile.writer_tag(writer): (writer, number)
            for writer, number in self._dfs_writers_unanswered.items()
            if not service.has_segment(writer)
        }

    async def _remove_dfs_temporaries(self, gone: dict[str, tuple[str, int]]) -> None:
        """Remove the DFS's temporary files whose writer is gone: those named after a tag of
        `gone` (_dfs_writers_gone; looked up at each file, while its writer may come back),
        and any older than DFS_TEMP_FILE_AGE_MS_MAX (a node killed mid-copy; a live one
        renames or removes its own well before). Then forgets the records walked for, those
        still gone and unchanged (a node that came back, or left copies unanswered since, may
        have written files the walk had passed).
        The walk, in a thread, stops at the next file once this task is cancelled (the master
        stops: its executor would wait for the walk of a hung share) or the term ends."""
        dfs, service, cancelled = self._dfs, self.service, threading.Event()
        assert dfs is not None

        def keep_going() -> bool:
            return not cancelled.is_set() and self._leads_as(service)

        try:
            removed, failed = await asyncio.to_thread(
                dfs.remove_stale_temporaries, limits.DFS_TEMP_FILE_AGE_MS_MAX, keep_going, gone
            )
        except asyncio.CancelledError:
            cancelled.set()
            raise
        except KVPoolError as exc:  # the share itself (its objects directory) cannot be read
            log.warning("removing the DFS's stale temporary files: %s (tried again at the next sweep)", exc)
            return
        finally:
            if self._dfs_tags_gone is gone:
                self._dfs_tags_gone = {}
        records = self._dfs_writers_unanswered
        for writer, number in gone.values():  # those mounted again meanwhile left `gone`
            if records.get(writer) == number:
                del records[writer]
        if removed or failed:
            log.info("removed %d temporary files of DFS writers gone (nodes killed mid-copy); %d could not be "
                     "removed", removed, failed)  # fmt: skip

    async def _ensure_dfs(self) -> None:
        """Mount the DFS in the current service (once per service: at start, each new term),
        from a scan of its files, and keep it alive (it has no node to heartbeat for it)."""
        service, dfs, info = self.service, self._dfs, self._dfs_info
        assert dfs is not None and info is not None
        if self._dfs_service is service and service.has_segment(info.segment_id):
            report = await self._dfs_filesystem()
            service.heartbeat(Heartbeat([info.segment_id], report), wall_clock_ms(), liveness_clock_ms())
            return
        self._removed_at_start.scanning(info.segment_id, local_clock_ms())  # the scan may end past the window
        entries = await asyncio.to_thread(lambda: list(dfs.scan(limits.DFS_TEMP_FILE_AGE_MS_MAX)))
        if service is not self.service or (self._dfs_service is service and service.has_segment(info.segment_id)):
            return  # A new term began during the scan (or another call mounted it): next tick.
        rejected: list[InventoryEntry] = []
        for start in range(0, len(entries), _DFS_MOUNT_CHUNK):
            if start:
                # Requests between the parts, as between a node's (a part is ~75 ms of work):
                # a share of millions of files held the loop for as many seconds, every term.
                # A remove meanwhile is remembered for the parts to come (RemovedAtStart).
                await asyncio.sleep(0)
                if service is not self.service:
                    return  # A new term began: it mounts the DFS from a scan of its own.
            chunk = MountSegment(info, entries[start : start + _DFS_MOUNT_CHUNK], is_last=False, is_first=start == 0)
            rejected.extend(self._mount(service, chunk, wall_clock_ms()).rejected)
        failed = 0
        for start in range(0, len(rejected), _DFS_UNLINK_CHUNK):
            # Before the last part, which opens the DFS to new copies: a refused file's range is
            # free, and a new copy of its key there would take its name (and be unlinked). The
            # DFS has no heartbeat until it is whole: each chunk keeps it alive (on a slow share
            # a remove_all's millions of unlinks outlast the node TTL).
            failed += await asyncio.to_thread(_remove_refused, dfs, rejected[start : start + _DFS_UNLINK_CHUNK])
            if service is not self.service:
                return
            service.hear([info.segment_id], liveness_clock_ms())
        if failed:
            log.warning("the DFS %s: %d refused files could not be removed (the next scan removes them, "
                        "or refuses them again)", info.segment_id, failed)  # fmt: skip
        self._mount(service, MountSegment(info, [], is_last=True, is_first=not entries), wall_clock_ms())
        self._dfs_service = service
        self._dfs_temps_due_ms = local_clock_ms() + DFS_TEMP_SWEEP_INTERVAL_MS  # the scan removed them
        if self._takeover is not None:
            self._takeover.mounted(info.segment_id)
        log.info("mounted the DFS %s at %s: %d objects, %d files rejected", info.segment_id, dfs.path,
                 len(entries) - len(rejected), len(rejected))  # fmt: skip

    async def _dfs_filesystem(self) -> dict[str, FilesystemReport]:
        """For the DFS's heartbeat: what its filesystem can take (Heartbeat.filesystems). Read
        once a heartbeat interval (on a network filesystem a statvfs may be a round trip); no
        news between."""
        dfs, info, now_ms = self._dfs, self._dfs_info, local_clock_ms()
        assert dfs is not None and info is not None
        if now_ms < self._dfs_free_due_ms:
            return {}
        self._dfs_free_due_ms = now_ms + limits.HEARTBEAT_INTERVAL_MS_DEFAULT
        self.service.filesystem_look_begins(info.segment_id)
        return {info.segment_id: await asyncio.to_thread(files.filesystem_report, dfs.path)}

    async def _drop_dfs(self, service: MasterService, entries: list[InventoryEntry]) -> None:
        """The DFS's drops, then those that came for it meanwhile, until a batch fails (as
        _drop does for a node's: a remove read while this ran was answered as done once the
        task ended, its files left for the next tick, and a master killed then left them to
        its successor's scan)."""
        assert self._dfs_info is not None
        dfs_id = self._dfs_info.segment_id
        while entries and await self._drop_dfs_batch(service, entries):
            entries = self._unsent_drops.pop(dfs_id, []) if service is self.service else []

    async def _drop_dfs_batch(self, service: MasterService, entries: list[InventoryEntry]) -> bool:
        """Remove DFS files of dropped replicas, then free their ranges; False if some were not.

        Each removal first checks that `service`'s term still leads: the DFS is shared, and a
        successor scans it as it takes over, so a file this term dropped may be the
        successor's since. A removal on a slow share (a hard NFS mount) can take minutes, and
        the whole batch used to go on after the term ended, removing files the successor had
        adopted. At most the one removal in flight at the step-down still lands."""
        dfs, info = self._dfs, self._dfs_info
        assert dfs is not None and info is not None
        entries = service.drops_due(info.segment_id, entries)

        def remove_while_leading() -> list[InventoryEntry]:
            removed = []
            for entry in entries:
                if not self._leads_as(service):
                    break  # the term is over: its drops die with its state
                dfs.remove(entry.key, entry.offset)
                removed.append(entry)
            return removed

        try:
            removed = await asyncio.to_thread(remove_while_leading)
        except KVPoolError as exc:
            self._drops_deferred(info.segment_id, exc, logging.WARNING)
            if service is self.service:
                self._unsent_drops.setdefault(info.segment_id, []).extend(entries)
            return False
        self._drops_through(info.segment_id)
        service.drops_done(info.segment_id, removed, wall_clock_ms())
        self._drops_moved()
        return len(removed) == len(entries)

    def _drops_deferred(self, segment_id: str, exc: KVPoolError, level: int) -> None:
        """A drop failed; it is sent again at each flush. Logged once until one goes through
        (a read-only disk tier fails every one: docs/tiers.md)."""
        if segment_id not in self._drops_failing:
            self._drops_failing.add(segment_id)
            log.log(level, "drops on segment %s deferred, sent again until they go through: %s", segment_id, exc)

    def _drops_through(self, segment_id: str) -> None:
        if segment_id in self._drops_failing:
            self._drops_failing.discard(segment_id)
            log.info("drops on segment %s go through again", segment_id)

    # --- high availability (election.py calls these; see the module docstring) --------------

    def _is_leading(self) -> bool:
        return self.elector is None or self.elector.is_leader()

    def _leads_as(self, service: MasterService) -> bool:
        """Whether the term of `service` is still this master's, and it leads: work a flow of
        that term does on shared state (nodes' drops, moves, the DFS) stops once it is not."""
        return service is self.service and self._is_leading()

    def _check_leading(self, message: Message) -> None:
        """Raise NotLeader unless this master may answer `message` now."""
        elector = self.elector
        assert elector is not None
        if not elector.is_leader():
            leader = elector.leader
            where = f"; the leader is {leader.endpoint}" if leader is not None else ""
            raise NotLeader(f"master {self.advertised_endpoint} is not the leader of cluster "
                            f"{elector.config.cluster_id}{where}")  # fmt: skip
        if not isinstance(message, _TAKEOVER_REFUSED):
            return
        takeover = self._takeover
        # None: leading, but elected() has not installed the term (the Elector calls it before
        # its first await, so never seen; were it, the term's service would be a throwaway).
        if takeover is None:
            raise NotLeader(f"new leader {self.advertised_endpoint} takes no {type(message).__name__} yet")
        local_ms = local_clock_ms()
        if not takeover.is_open(local_ms):
            waiting = takeover.waiting_count()
            raise NotLeader(
                f"new leader {self.advertised_endpoint} takes {type(message).__name__} once "
                + (f"{waiting} more node(s) re-mount" if waiting >= 0 else "its predecessor's nodes re-mount")
                + f", within {takeover.remaining_ms(local_ms)} ms"
            )

    def elected(self, term: int) -> None:
        # The term's state from now on, closed to puts and removes: segments that mount while
        # the predecessor's record is read count (a service made after them would not know
        # them, and a remove it took could miss their replicas).
        self._new_term()
        now_ms = local_clock_ms()
        self._takeover = Takeover(now_ms, self.config.remount_grace_ms)
        # Once the takeover opens on its grace, a remove misses the replicas of the nodes not
        # back yet (a frozen predecessor's notice it after the grace): they came back with them.
        window_ms = max(TAKEOVER_REMOUNT_WINDOW_MS, self.config.remount_grace_ms + REMOUNT_WINDOW_MS)
        self._removed_at_start = RemovedAtStart(now_ms + window_ms)
        if self._dfs_info is not None:
            # The term's DFS scan may begin past the window (the last term's may still run:
            # one at a time), and a remove before its last part must reach its files.
            self._removed_at_start.scanning(self._dfs_info.segment_id, now_ms)
        log.info("master %s leads (term %d); reading its predecessor's segment record",
                 self.advertised_endpoint, term)  # fmt: skip

    def predecessor_record(self, expected_segment_ids: list[str] | None) -> None:
        takeover = self._takeover
        assert takeover is not None, "the predecessor's record before elected()"
        takeover.expect(expected_segment_ids)
        waiting = takeover.waiting_count()
        log.info("master %s waits for %s more segment(s) to re-mount before taking puts (at "
                 "most %d ms since elected)", self.advertised_endpoint,
                 "unknown" if waiting < 0 else waiting, self.config.remount_grace_ms)  # fmt: skip

    def deposed(self, reason: str) -> None:
        # Requests were refused from the deadline on; now end every conversation of the term
        # so that clients and nodes look for the new leader, and forget the term's state.
        if self._server is not None:
            for conn in list(self._server.connections):
                conn.close(f"master stepped down: {reason}")
        self._new_term()
        self._takeover = None
        self._removed_at_start = RemovedAtStart(0)

    def live_segment_ids(self) -> list[str] | None:
        takeover = self._takeover
        if takeover is None or not takeover.is_open(local_clock_ms()):
            return None
        return [counters.segment_id for counters in self.service.segment_counters()]

    def _new_term(self) -> None:
        self.service = MasterService(self.config, random.Random(self._seed), self._keyring.primary, term=_new_term_id(),
                                    local_clock=True)
        busy_poll = self.metrics.busy_poll  # the listener's, set once at start: it outlives terms
        self.metrics = MasterMetrics(self.service, lambda: self.role)
        self.metrics.busy_poll = busy_poll
        self._node_links = {}
        self._unsent_drops = {}
        self._drops_failing = set()
        self._drop_tasks = {}  # the old term's tasks end by themselves
        self._dfs_writers_unanswered = {}
        self._dfs_writers_over = False
        self._dfs_tags_gone = {}  # a walk in flight stops at its next file


def _remove_refused(dfs: DfsDirectory, refused: list[InventoryEntry]) -> int:
    """Unlink the files of DFS entries a mount refused; how many could not be. Blocks."""
    failed = 0
    for entry in refused:
        try:
            dfs.remove(entry.key, entry.offset)
        except KVPoolError:
            failed += 1
    return failed


def _new_term_id() -> int:
    """A fresh name for a master term (MasterService `term`): 63 random bits, never 0."""
    return secrets.randbits(63) | 1
