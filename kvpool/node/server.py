"""The storage node: a DRAM segment, its transfer server, and its link to the master.

`Node` is the asyncio I/O shell around the node's cores (segment.py, inventory.py, and the
handlers of transfer.py). It runs as a process (`kvpool node`, cli/main.py) or embedded in
a client's event loop (a Store that contributes memory). It is not a place for policy: the
master decides where objects go and when they leave; the node stores bytes, checks every
request, and keeps the inventory that lets a restarted master rebuild (DESIGN.md §4).

Life of a node:

    start():  remove stale segment files ─► create + pre-fault the segment ─► transfer server
              ─► master link task: connect ─► MountSegment(info, inventory) ─► heartbeats
    master link (until stop): every heartbeat_interval_ms Heartbeat(segment ids, disk tier's room);
              reply says "unknown" (master restarted) ─► re-mount with the whole inventory;
              link lost or master unreachable ─► reconnect with bounded backoff ─► re-mount;
              the handshake refused over the cluster token ─► before the first mount,
              wait_mounted raises it (`kvpool node` exits); after one, the link retries on,
              keeping the segment and its objects, "refused" on /health and /ready (503)
              until a master takes it again: a refusal comes before the master proved the token, so it may
              be a relay's (docs/operations.md "Security"), and exiting lost every object;
              likewise a node's port at the master's address (it refuses the mount).
              With `etcd://...` each reconnect dials the leader etcd names (discovery.py),
              looking again at most every MASTER_RESOLVE_BACKOFF_MS_MAX during a failover.
              Reads and writes keep being served whatever the master's state.
    drain():  DrainSegment ─► wait (still serving reads) ─► UnmountSegment
    stop():   UnmountSegment ─► close server and connections ─► close segment (unlinks file)

States (transitions in `_TRANSITIONS`): NEW ─► STARTING ─► SERVING ─► DRAINING ─► STOPPED, and
any state ─► STOPPED.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import math
import random
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from kvpool import limits
from kvpool.config import NodeConfig
from kvpool.discovery import MasterResolver, parse_master_address
from kvpool.errors import InvalidParams, KVPoolError, RemoteProtocolError, RpcTimeout, SegmentNotFound, Unauthorized
from kvpool.node.clock import MasterClock, monotonic_ms
from kvpool.node.disk import DiskTier
from kvpool.node.inventory import Inventory
from kvpool.node.metrics import NodeMetrics, TierMetrics
from kvpool.node.moves import Mover
from kvpool.node.segment import MEMORY_FILESYSTEM_MAGICS, Segment, filesystem_magic, remove_stale_segments
from kvpool.node.tiered import TieredMasterCalls, TieredTransferHandler
from kvpool.node.transfer import MasterCallHandler, TransferHandler
from kvpool.process import raise_open_files_limit
from kvpool.protocol import auth
from kvpool.protocol.messages import (
    TIER_DRAM,
    DrainSegment,
    ExistKeys,
    FilesystemReport,
    Heartbeat,
    HeartbeatReply,
    InventoryEntry,
    Message,
    MountReply,
    MountSegment,
    SegmentInfo,
    UnmountSegment,
)
from kvpool.transports.connection import (
    Connection,
    Listener,
    connect_with,
    is_loopback,
    refuse_open_listen,
    start_server,
)
from kvpool.transports.dfs import DfsDirectory

if TYPE_CHECKING:
    from kvpool.node.metrics_http import MetricsServer

log = logging.getLogger(__name__)

# First retry delay after the master link fails; it doubles up to RECONNECT_BACKOFF_MS_MAX,
# with jitter so that the nodes of a cluster do not all re-mount on a new master at once.
_RECONNECT_BACKOFF_MS_MIN = 50
# How long stop() waits for client connections to finish closing after it aborted them.
_SERVER_CLOSE_WAIT_MS_MAX = 500
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")
# A master link that keeps failing (a node started before its master) logs the first failure,
# then at most one every this many seconds.
LINK_FAILURE_LOG_INTERVAL_S = 30
# How often a running node removes the segment files of processes that died on its host (a
# serving process killed with its embedded segment): their memory stays taken until then.
STALE_SEGMENTS_SWEEP_INTERVAL_MS = 30_000
# How long a node stopping with keep_ms waits for copies into its DRAM segment to end.
KEEP_COPIES_WAIT_MS = 5_000
# How long a node tries to reach its own advertised address at start (_warn_if_unreachable).
ADVERTISE_CHECK_TIMEOUT_MS = 1_000
# A MountSegment is one control frame (FRAME_CONTROL_SIZE_BYTES_MAX): a larger inventory goes
# in several, which the master merges into one segment (MasterService.mount_segment). Half the
# frame limit leaves room for msgpack's overhead, estimated at 32 bytes an entry.
_MOUNT_ENTRIES_MAX = limits.BATCH_KEYS_MAX
_MOUNT_CHUNK_SIZE_BYTES_MAX = limits.FRAME_CONTROL_SIZE_BYTES_MAX // 2
_MOUNT_ENTRY_OVERHEAD_BYTES = 32

_M = TypeVar("_M", bound=Message)
_T = TypeVar("_T")


class NodeState(enum.Enum):
    NEW = "NEW"
    STARTING = "STARTING"
    SERVING = "SERVING"
    DRAINING = "DRAINING"
    STOPPED = "STOPPED"


_TRANSITIONS: dict[NodeState, tuple[NodeState, ...]] = {
    NodeState.NEW: (NodeState.STARTING, NodeState.STOPPED),
    NodeState.STARTING: (NodeState.SERVING, NodeState.STOPPED),
    NodeState.SERVING: (NodeState.DRAINING, NodeState.STOPPED),
    NodeState.DRAINING: (NodeState.STOPPED,),
    NodeState.STOPPED: (),
}


class Node:
    """One node: its segment, inventory, transfer server, master link and metrics.

    Holds the segment (owned: closing it unlinks the file), the inventory of complete objects
    in it, the asyncio server clients dial, and one background task that keeps the node
    mounted on the master. Invariant: while SERVING or DRAINING, the segment is mapped and the
    transfer server listens; `is_mounted` is True only while a master has accepted our
    MountSegment on the current link.
    """

    def __init__(self, config: NodeConfig, keyring: auth.Keyring | None = None) -> None:
        """`keyring`: the keys of the client process that embeds this node, shared with it (a
        Store's, which moves to its next token once a server refuses one), in place of
        config's tokens."""
        self.config = config
        self.metrics = NodeMetrics()
        # Connects with the first (the next once refused); its servers accept each (a token
        # rotating: replace_tokens).
        self._keyring = keyring or auth.Keyring.of([config.token, *config.accepted_tokens] if config.token else [])
        self._state = NodeState.NEW
        self._segment: Segment | None = None
        self._segment_id = ""
        self._filesystem_look: asyncio.Future[FilesystemReport] | None = None  # for the heartbeat
        self._filesystem_look_since_s = 0.0  # when it began (loop time)
        # What the last look found free, for /metrics: a scrape must not look itself (a
        # statvfs that hangs froze the event loop, and the master dropped the node).
        self._filesystem_free_bytes = math.nan
        # What write grants are checked against; measured on the monotonic clock, which no one steps.
        self._master_clock = MasterClock(f"node {config.node_id}", local_ms=monotonic_ms)
        self._segment_info: SegmentInfo | None = None
        self._inventory: Inventory | None = None
        self._transfer: TransferHandler | None = None
        self._master_calls: TieredMasterCalls | None = None
        # The slower tiers (docs/tiers.md): the disk tier, if configured, mounts as a second
        # segment on the same master link; moves between tiers run on the mover's threads.
        self._disk: DiskTier | None = None
        self._disk_info: SegmentInfo | None = None
        self._mover: Mover | None = None
        self.tier_metrics = TierMetrics(self.metrics.registry)
        self._server: Listener | None = None
        self._metrics_server: MetricsServer | None = None
        self._endpoint = ""
        self._master_conn: Connection | None = None
        self._resolver: MasterResolver | None = None  # set by start()
        self._master_task: asyncio.Task[None] | None = None
        self._stale_segments_task: asyncio.Task[None] | None = None
        self._mounted = asyncio.Event()
        self._first_attempt = asyncio.Event()
        # Why the master link was refused for good since the last mount: the cluster token, or
        # a node's port at the master's address (wait_mounted raises it; /health says it); and
        # when the link's failures were last logged.
        self._refusal: KVPoolError | None = None
        self._refused = asyncio.Event()
        self._mounted_once = False
        self._failure_logged_s = -LINK_FAILURE_LOG_INTERVAL_S
        self._leave = asyncio.Event()
        self._drain_deadline_ms = 0
        # The deadline of the kept segment this run took, until it mounts: a run that never
        # mounted keeps it no longer than that (the master's tombstones of it run out).
        self._kept_until_ms: int | None = None

    def __repr__(self) -> str:
        return (
            f"<Node {self.config.node_id} {self._state.value} segment={self._segment_id} "
            f"endpoint={self._endpoint} mounted={self.is_mounted} {self._inventory!r}>"
        )

    # --- properties ------------------------------------------------------------------------

    @property
    def state(self) -> NodeState:
        return self._state

    @property
    def node_id(self) -> str:
        return self.config.node_id

    @property
    def segment_id(self) -> str:
        return self._segment_id

    @property
    def endpoint(self) -> str:
        """The transfer server's advertised "host:port" (set by start)."""
        assert self._endpoint, "Node.endpoint read before start()"
        return self._endpoint

    @property
    def segment_info(self) -> SegmentInfo:
        """What the node mounts on the master, and what clients are told (set by start)."""
        assert self._segment_info is not None, "Node.segment_info read before start()"
        return self._segment_info

    @property
    def disk_info(self) -> SegmentInfo | None:
        """The disk tier's segment (set by start), or None without a disk tier."""
        return self._disk_info

    @property
    def disk(self) -> DiskTier | None:
        return self._disk

    @property
    def segment(self) -> Segment:
        assert self._segment is not None, "Node.segment read before start()"
        return self._segment

    @property
    def inventory(self) -> Inventory:
        assert self._inventory is not None, "Node.inventory read before start()"
        return self._inventory

    @property
    def is_mounted(self) -> bool:
        return self._mounted.is_set()

    def replace_tokens(self, tokens: Sequence[str]) -> None:
        """Accept these cluster tokens from now on, and connect with the first (a token rotating
        in or out: docs/operations.md "Rotating the token"). Connections whose peer proved a
        token no longer accepted are closed; the link to the master stays (the master closes it
        once it no longer accepts its token, and the node connects again with its first); a
        link its master refused tries the new first token at its next attempt. The segment and
        its objects stay.

        Raises:
            InvalidParams: no token for a node started with one, or one for a node started
                without (auth.Keyring.replace).
        """
        self._keyring.replace(tokens)
        closed = self._server.close_unaccepted(self._keyring) if self._server is not None else 0
        log.info("node %s: cluster tokens replaced: %d accepted, connecting with the first (mark %s); %d "
                 "connections closed (their token is no longer accepted)",
                 self.node_id, len(self._keyring.keys), self._keyring.first_mark(), closed)  # fmt: skip

    @property
    def refusal(self) -> KVPoolError | None:
        """Why the master link is refused for good since the last mount (said at once in an ERROR
        line; wait_mounted raises it), or None."""
        return self._refusal

    @property
    def metrics_endpoint(self) -> str:
        """The HTTP "host:port" of /metrics, /health and /ready, or "" when metrics are off."""
        return self._metrics_server.endpoint if self._metrics_server is not None else ""

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Create the segment, listen, and mount on the master.

        Returns once the first mount succeeded or the first attempt failed (bounded by the
        connect and RPC timeouts); a master that is down is retried in the background, so a
        node can start before its master.

        Raises:
            Unauthorized: a non-loopback listen host without a cluster token.
            InvalidParams: a bad master endpoint, or the segment cannot be created.
            ConnectFailed: the listen address cannot be bound.
            After an exception everything started is torn down and the node is STOPPED.
        """
        self._set_state(NodeState.STARTING)
        try:
            await self._start()
        except BaseException:
            # A segment its previous run kept is kept again, as it was: not lost to a start
            # that failed after taking it (a port in use, a bad disk tier).
            await self._teardown(is_kept=self._kept_until_ms is not None)
            self._set_state(NodeState.STOPPED)
            raise
        self._set_state(NodeState.SERVING)

    async def _start(self) -> None:
        config = self.config
        self._resolver = MasterResolver(parse_master_address(config.master_endpoint))
        master_host = self._resolver.address.probe_host
        # start_server refuses too; saying it first leaves no segment file behind.
        refuse_open_listen(config.listen_host, self._keyring.primary)
        if config.metrics_port is not None:
            refuse_open_listen(config.metrics_host or config.listen_host, self._keyring.primary, " for /metrics")
        kept = Segment.adopt(config.shm_dir, config.node_id, config.memory_bytes)  # a stop with keep_ms left it
        remove_stale_segments(config.shm_dir)
        magic = filesystem_magic(config.shm_dir)
        if magic is not None and magic not in MEMORY_FILESYSTEM_MAGICS:  # taken unsaid (walk-through helper-155)
            log.warning("node %s: its segment's directory %s (--shm-dir) is not on tmpfs or hugetlbfs (filesystem "
                        "type 0x%x, `stat -f` names it): the kernel writes the segment's pages back to that disk",
                        config.node_id, config.shm_dir, magic)  # fmt: skip
        log.info("node %s: open files limit %d", config.node_id, raise_open_files_limit())
        if kept is None:
            token = secrets.token_bytes(limits.SEGMENT_TOKEN_SIZE_BYTES)
            self._segment = Segment.create(config.shm_dir, config.node_id, config.memory_bytes, token)
            # A new id per incarnation: a restarted node's DRAM is empty, so it must never be
            # mistaken for the segment (and replicas) its previous run had mounted.
            self._segment_id = f"{config.node_id}-{secrets.token_hex(4)}"
            self._inventory = Inventory(self._segment.capacity_bytes)
        else:
            # The segment its previous run kept: the same id, so that the master's tombstones
            # of it refuse what was removed while the node was away (master/tombstones.py).
            self._segment, self._segment_id, entries, self._kept_until_ms = kept
            self._inventory = self._adopted_inventory(entries)
            self._segment.kept_taken()  # verified: a kill from here on leaves a stale file
        self._transfer = TransferHandler(
            self._segment, self._segment_id, self._inventory, self.metrics, keyring=self._keyring,
            clock_ms=self._master_clock.now_ms,
        )  # fmt: skip
        if config.disk_dir:
            self._disk = DiskTier.open(config.disk_dir, config.disk_bytes, config.node_id,
                                       is_durable=config.disk_fsync)  # fmt: skip
        self._mover = Mover(
            self._segment, self._segment_id, self._inventory, self._disk,
            DfsDirectory(config.dfs_dir) if config.dfs_dir else None, self.tier_metrics,
            is_durable=config.disk_fsync, clock_ms=self._master_clock.now_ms,
        )  # fmt: skip
        # Writes are refused where a promotion's copy may still land (node/moving.py).
        self._transfer.moving = self._mover.moving[TIER_DRAM]
        self._master_calls = TieredMasterCalls(
            MasterCallHandler(self._segment, self._segment_id, self._inventory, self.metrics),
            self._disk, self._mover,
        )  # fmt: skip
        self._server = await start_server(
            config.listen_host, config.listen_port,
            TieredTransferHandler(self._transfer, self._disk, self._mover, self.tier_metrics),
            keyring=self._keyring, name=f"node {config.node_id}", busy_poll_us=config.busy_poll_us,
            # A disk read holds its files open from when it is prepared until it is sent.
            replies_owed_max=limits.HELD_FRAMES_MAX, flags="--host, --port",
        )  # fmt: skip
        port = self._server.port
        host = await _advertise_host(config, master_host)
        self._endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        shm_enabled = config.shm_enabled
        self._segment_info = SegmentInfo(
            segment_id=self._segment_id,
            node_id=config.node_id,
            hostname=config.hostname,
            endpoint=self._endpoint,
            shm_path=str(self._segment.path) if shm_enabled else "",
            shm_token=self._segment.token if shm_enabled else b"",
            capacity_bytes=self._segment.capacity_bytes,
        )
        if self._disk is not None:
            self._disk_info = self._disk.info(config.node_id, config.hostname, self._endpoint, shm_enabled)
        self._init_metrics()
        if config.metrics_port is not None:
            from kvpool.node.metrics_http import MetricsServer  # brings aiohttp: only when asked for

            self._metrics_server = MetricsServer(self.metrics, self._health)
            await self._metrics_server.start(config.metrics_host or config.listen_host,
                                             config.metrics_port)  # fmt: skip
        log.info(
            "node %s serving segment %s (%d bytes) on %s (listening on %s:%d), shm %s%s",
            config.node_id, self._segment_id, self._segment.capacity_bytes, self._endpoint,
            config.listen_host, port, self._segment_info.shm_path or "off",
            f", /metrics on http://{self.metrics_endpoint}" if self.metrics_endpoint else "",
        )  # fmt: skip
        await _warn_if_unreachable(config.node_id, host, port, config.listen_host)
        self._master_task = asyncio.get_running_loop().create_task(
            self._master_link(), name=f"kvpool node {config.node_id} master link"
        )
        self._master_task.add_done_callback(_log_task_death)
        self._stale_segments_task = asyncio.get_running_loop().create_task(
            self._remove_stale_segments_forever(), name=f"kvpool node {config.node_id} stale segments"
        )
        self._stale_segments_task.add_done_callback(_log_task_death)
        first_attempt_ms = config.connect_timeout_ms + config.rpc_timeout_ms + 1_000
        try:
            await asyncio.wait_for(self._first_attempt.wait(), first_attempt_ms / 1000)
        except asyncio.TimeoutError:
            log.warning("node %s: not mounted yet; retrying in the background", config.node_id)

    def _adopted_inventory(self, entries: list[InventoryEntry]) -> Inventory:
        """The inventory of a kept segment: the recorded entries whose bytes still match."""
        segment = self.segment
        good, bad = segment.verified(entries, f"node {self.node_id}: kept segment {self._segment_id}")
        inventory = Inventory(segment.capacity_bytes)
        displaced = inventory.add(good)
        log.info("node %s: took the segment %s its last run kept: %d objects (%d bytes)%s", self.node_id,
                 self._segment_id, len(inventory), inventory.used_bytes,
                 f"; {bad + len(displaced)} dropped (bad checksum or overlap)" if bad or displaced else "")  # fmt: skip
        return inventory

    async def wait_mounted(self, timeout_ms: int) -> None:
        """Wait until a master has accepted the segment (the link goes on retrying meanwhile).

        Raises:
            RpcTimeout: not mounted within timeout_ms.
            Unauthorized: the node and its master do not share a cluster token (not mounted).
            InvalidParams: the master's address is a kvpool node's (not mounted).
        """
        mounted = asyncio.ensure_future(self._mounted.wait())
        refused = asyncio.ensure_future(self._refused.wait())
        try:
            await asyncio.wait((mounted, refused), timeout=timeout_ms / 1000, return_when=asyncio.FIRST_COMPLETED)
        finally:
            mounted.cancel()
            refused.cancel()
        if self._mounted.is_set():
            return
        if self._refusal is not None:
            raise self._refusal
        raise RpcTimeout(f"node {self.node_id} not mounted on {self.config.master_endpoint} after {timeout_ms} ms")

    async def drain(self, timeout_ms: int = limits.DRAIN_TIMEOUT_MS_DEFAULT) -> None:
        """Leave gracefully: no new allocations here, reads served for timeout_ms, then unmount.

        The node keeps its segment and server until `stop()`; call it next. If the master
        link is down the drain request is re-sent when the node re-mounts within timeout_ms.
        """
        assert timeout_ms >= 0, timeout_ms
        if self._state is not NodeState.SERVING:
            return
        self._set_state(NodeState.DRAINING)
        self._drain_deadline_ms = monotonic_ms() + timeout_ms  # (a wall clock stepped back kept it going)
        conn = self._master_conn
        if conn is not None and self.is_mounted:
            await self._send_drain(conn)
        else:
            log.warning("node %s: draining without a master link", self.node_id)
        # Reads of what we hold keep being served while we wait: this is the point of a drain.
        await asyncio.sleep(timeout_ms / 1000)
        await self._leave_master()

    async def stop(self) -> None:
        """Unmount, close the server and every connection, close the segment (unlinks it).

        Idempotent. Bounded: the unmount waits at most rpc_timeout_ms; an unreachable master
        drops the node after its TTL instead.
        """
        if self._state is NodeState.STOPPED:
            return
        if self._state is NodeState.NEW:
            self._set_state(NodeState.STOPPED)
            return
        await self._leave_master()
        is_kept = self.config.keep_ms > 0 or self._kept_until_ms is not None
        await self._teardown(is_kept=is_kept and self._state is not NodeState.STARTING)
        self._set_state(NodeState.STOPPED)
        log.info("node %s stopped", self.node_id)

    # --- master link -----------------------------------------------------------------------

    async def _master_link(self) -> None:
        """Keep the node mounted. Runs until `_leave` is set: the node outlives master outages."""
        backoff_ms = _RECONNECT_BACKOFF_MS_MIN
        resolver = self._resolver
        assert resolver is not None, "master link started before start()"
        while not self._leave.is_set():
            conn: Connection | None = None
            endpoint = self.config.master_endpoint
            try:
                endpoint = await resolver.resolve(self.config.connect_timeout_ms)
                conn = await connect_with(
                    self._keyring, endpoint, handler=self._master_calls,
                    timeout_ms=self.config.connect_timeout_ms, name=f"node {self.node_id}",
                    prefer_local=self.config.shm_enabled,
                )  # fmt: skip
                self._master_conn = conn
                await self._mount(conn)
                backoff_ms = _RECONNECT_BACKOFF_MS_MIN
                self._first_attempt.set()
                await self._heartbeat(conn)
            except Unauthorized as exc:
                self._link_failed(exc, self._refusal_of(exc))
            except InvalidParams as exc:  # a mount the master cannot take, or a node's port
                not_a_master = await self._not_a_master(conn, endpoint)
                # A node's port that etcd named is a stale record (its port taken since), not for good.
                self._link_failed(not_a_master or exc, None if resolver.is_dynamic else not_a_master)
            except KVPoolError as exc:
                self._link_failed(exc)
            except Exception:  # a bug, or an error no layer below typed: the node must not stay unmounted
                log.exception("node %s: master link failed unexpectedly (retrying with backoff)", self.node_id)
            finally:
                self._set_unmounted()
                self._master_conn = None
                if conn is not None:
                    conn.close("master link closed")
                resolver.forget()  # With etcd: the leader may have changed.
            self._first_attempt.set()
            if self._leave.is_set():
                return
            delay_ms = backoff_ms // 2 + random.randrange(backoff_ms // 2 + 1)
            backoff_ms = min(backoff_ms * 2, resolver.retry_backoff_ms_max)
            try:
                await asyncio.wait_for(self._leave.wait(), delay_ms / 1000)
            except asyncio.TimeoutError:
                pass  # Time to try again.

    def _link_failed(self, exc: KVPoolError, refusal: KVPoolError | None = None) -> None:
        """Log a failed attempt of the master link: the first, then at most one every
        LINK_FAILURE_LOG_INTERVAL_S (a node started before its master retries every 2 s, for as
        long as it takes). A `refusal` (the one line of a failure that retrying does not end:
        the cluster token, a node's port) is recorded for wait_mounted and /health, and logged
        at once when it is news: it had to wait for the slot of the "Connection refused" of the
        master's restart before it (30 s)."""
        if refusal is not None:
            is_news = self._refusal is None
            self._refusal = refusal
            self._refused.set()
            if is_news:
                self._failure_logged_s = time.monotonic()
                log.error("%s", self._refusal)
                return
        now_s = time.monotonic()
        if now_s - self._failure_logged_s < LINK_FAILURE_LOG_INTERVAL_S:
            return
        self._failure_logged_s = now_s
        log.warning("node %s: master link to %s: %s: %s (retrying with backoff; said again at most every %d s)",
                    self.node_id, self.config.master_endpoint, type(exc).__name__, exc,
                    LINK_FAILURE_LOG_INTERVAL_S)  # fmt: skip

    def _refusal_of(self, exc: Unauthorized) -> Unauthorized:
        """A refusal of the handshake as the node's one line. The handshake's words say which
        side holds no token, or that the two differ; a node with a token is not refused by a
        master without one, it refuses that master ("has no cluster token"), so the remedy
        names neither side as the one without."""
        kept = " (it keeps its objects and retries)" if self._mounted_once else ""
        return Unauthorized(
            f"node {self.node_id} cannot mount on the master at {self.config.master_endpoint}{kept}: {exc} "
            "(the master and its nodes need the same cluster token: --token-file or KVPOOL_TOKEN_FILE)"
        )

    async def _not_a_master(self, conn: Connection | None, endpoint: str) -> InvalidParams | None:
        """After an InvalidParams on the link: the refusal to say when `endpoint` is a kvpool
        node's port, else None. A node takes the handshake and refuses every request of a
        master's (InvalidParams: "unexpected MountSegment request"); a master refuses a mount it
        cannot take with InvalidParams too, but answers an ExistKeys of no key (the client asks
        ClusterStatus, AsyncStore._start: a reply of every segment, too much to ask at each retry)."""
        if conn is None or conn.is_closed():
            return None
        try:
            await conn.request(ExistKeys([]), timeout_ms=self.config.rpc_timeout_ms)
        except InvalidParams:
            if self._resolver is not None and self._resolver.is_dynamic:
                return InvalidParams(f"node {self.node_id} cannot mount on {endpoint}, which etcd's leader record "
                                     "names: it is a kvpool node, not a master (a master gone, its address taken "
                                     "since?); retrying")  # fmt: skip
            kept = " (it keeps its objects and retries)" if self._mounted_once else ""
            return InvalidParams(f"node {self.node_id} cannot mount on {endpoint}{kept}: it is a kvpool node, not a "
                                 "master: give the master's address")  # fmt: skip
        except KVPoolError:
            pass  # not a node's answer: the link's own failure is said
        return None

    async def _heartbeat(self, conn: Connection) -> None:
        """Heartbeat until the link closes (return to reconnect) or the node leaves (unmount)."""
        interval_s = self.config.heartbeat_interval_ms / 1000
        closed = asyncio.ensure_future(conn.wait_closed())
        leave = asyncio.ensure_future(self._leave.wait())
        try:
            while True:  # Ends when the link closes or the node leaves.
                await asyncio.wait((closed, leave), timeout=interval_s,
                                   return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
                if leave.done():
                    await self._unmount(conn)
                    return
                if closed.done():
                    log.warning("node %s: master link lost: %s", self.node_id, conn.close_reason)
                    return
                heartbeat = Heartbeat(self._segment_ids(), await self._filesystems())
                sent_ms = self._master_clock.local_ms()
                reply = _expect(await conn.request(heartbeat, timeout_ms=self.config.rpc_timeout_ms), HeartbeatReply)
                self._observe_master_clock(sent_ms, reply.master_time_ms)
                if reply.unknown_segment_ids:
                    log.warning("node %s: master does not know segment %s (restarted?); "
                                "re-mounting", self.node_id, self._segment_id)  # fmt: skip
                    self._set_unmounted()
                    await self._mount(conn)
        finally:
            closed.cancel()
            leave.cancel()

    async def _mount(self, conn: Connection) -> None:
        """Mount (or re-mount) the segment with everything the inventory holds.

        Raises:
            KVPoolError: the master refused or the link failed (the caller reconnects).
        """
        self._master_clock.forget()
        assert self._mover is not None
        for restart in range(limits.MOUNT_RESTARTS_MAX + 1):
            if self._state is NodeState.DRAINING and self._drain_remaining_ms() == 0:
                # The master ended our drain by unmounting us, for good (MountFlow.leave): coming
                # back would invite allocations, and bring back what was removed meanwhile.
                log.info("node %s: drain over, not re-mounting", self.node_id)
                return
            # The master rebuilds the segments from the inventories sent now: a move begun
            # before must not be recorded after (its target is not in them, and may be given
            # out again). So at each restart too: the master may have placed moves into the
            # segments of the attempt before.
            self._mover.remounted()
            try:
                for info, inventory in self._mounts():
                    await self._mount_segment(conn, info, inventory)
                break
            except SegmentNotFound as exc:  # a later part: the node was silent past its TTL since the first
                if restart == limits.MOUNT_RESTARTS_MAX or self._leave.is_set():
                    raise
                # Every segment again: those mounted before went silent as long (a heartbeat
                # would find them unknown and have them mounted again after this one).
                log.warning("node %s: %s; mounting every segment again", self.node_id, exc)
        inventory = self.inventory
        self._mounted.set()
        self._mounted_once = True
        self._kept_until_ms = None
        self._refusal = None
        self._refused.clear()
        self._failure_logged_s = -LINK_FAILURE_LOG_INTERVAL_S  # the next failure is news
        self.metrics.master_connected.set(1)
        self.metrics.mounts.inc()
        log.info("node %s: segment %s mounted on %s with %d objects", self.node_id,
                 self._segment_id, self.config.master_endpoint, len(inventory))  # fmt: skip
        if self._state is NodeState.DRAINING:
            await self._send_drain(conn)

    async def _mount_segment(self, conn: Connection, info: SegmentInfo, inventory: Inventory) -> None:
        """Mount one segment with its inventory, in parts of at most _MOUNT_ENTRIES_MAX entries.

        Raises:
            SegmentNotFound: the master refused a part after the first (MountSegment.is_first):
                the node was silent past its TTL; `_mount` mounts every segment again.
            KVPoolError: the master refused otherwise or the link failed.
        """
        chunks = list(_inventory_chunks(inventory.entries()))
        for index, chunk in enumerate(chunks):
            # What the inventory still holds as the part goes: the master sends drops on this
            # link once a part is in, and a later part listing an entry dropped meanwhile had
            # the master adopt it again (a removed key back, its replica no longer held).
            held = [entry for entry in chunk if inventory.get(entry.key) == entry]
            mount = MountSegment(info, held, is_last=index == len(chunks) - 1, is_first=index == 0)
            sent_ms = self._master_clock.local_ms()
            reply = _expect(await conn.request(mount, timeout_ms=self.config.rpc_timeout_ms), MountReply)
            self._observe_master_clock(sent_ms, reply.master_time_ms)
            if info.segment_id == self._segment_id and self._transfer is not None:
                self._transfer.term = reply.term  # grants of earlier masters are refused now
            if reply.rejected:
                dropped = await self._drop_rejected(info, reply.rejected)
                log.warning("node %s: master rejected %d inventory entries; dropped %d",
                            self.node_id, len(reply.rejected), dropped)  # fmt: skip

    def _observe_master_clock(self, sent_ms: int, master_time_ms: int) -> None:
        clock = self._master_clock
        clock.observe(sent_ms, master_time_ms, clock.local_ms())
        self.metrics.master_clock_offset.set(clock.wall_offset_ms / 1000)

    def _drain_remaining_ms(self) -> int:
        return max(0, self._drain_deadline_ms - monotonic_ms())

    async def _send_drain(self, conn: Connection) -> None:
        try:
            await conn.request(DrainSegment(self._segment_id, self._drain_remaining_ms(), self.config.keep_ms > 0),
                               timeout_ms=self.config.rpc_timeout_ms)  # fmt: skip
        except KVPoolError as exc:
            log.warning("node %s: drain request failed: %s", self.node_id, exc)

    async def _unmount(self, conn: Connection) -> None:
        if not self.is_mounted:
            return
        try:
            for segment_id in self._segment_ids():
                # A DRAM segment kept for the node's restart (config.keep_ms, Segment.keep) comes
                # back: the master keeps what was removed meanwhile, to refuse it then.
                is_kept = self.config.keep_ms > 0 and segment_id == self._segment_id
                await conn.request(UnmountSegment(segment_id, is_kept),
                                   timeout_ms=self.config.rpc_timeout_ms)  # fmt: skip
        except KVPoolError as exc:
            # The master drops a silent node after its TTL: nothing is lost by carrying on.
            log.warning("node %s: unmount failed (%s); the master will time us out",
                        self.node_id, exc)  # fmt: skip
        self._set_unmounted()

    async def _leave_master(self) -> None:
        """Unmount and end the master link, within one RPC timeout plus a margin."""
        self._leave.set()
        task = self._master_task
        if task is None or task.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), self.config.rpc_timeout_ms / 1000 + 1)
        except asyncio.TimeoutError:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def _set_unmounted(self) -> None:
        self._mounted.clear()
        self.metrics.master_connected.set(0)

    # --- the node's segments: DRAM, and the disk tier (docs/tiers.md) -------------------------

    def _segment_ids(self) -> list[str]:
        """Every segment this node mounts: its DRAM segment, then its disk tier."""
        return [info.segment_id for info, _ in self._mounts()]

    def _mounts(self) -> list[tuple[SegmentInfo, Inventory]]:
        mounts = [(self.segment_info, self.inventory)]
        if self._disk is not None and self._disk_info is not None:
            mounts.append((self._disk_info, self._disk.inventory))
        return mounts

    async def _filesystems(self) -> dict[str, FilesystemReport]:
        """For the master's heartbeat: what the filesystem under the disk tier can take (other
        files may fill it before the tier's capacity does). One look at a time, waited for at
        most FILESYSTEM_LOOK_WAIT_MS: a disk that stops answering (a statvfs that hangs on a
        failing device) silenced the heartbeat, and the master dropped the node's DRAM segment
        with its disk tier. No news then; the look goes on, for a later heartbeat. A look
        overdue by FILESYSTEM_LOOK_OVERDUE_MS reports the tier as taking no writes, so that
        the master moves nothing more to a disk that hangs (reads of it still fall through)."""
        disk = self._disk
        if disk is None:
            return {}
        loop = asyncio.get_running_loop()
        look = self._filesystem_look
        if look is None:
            look = self._filesystem_look = _in_daemon_thread(disk.filesystem_report)
            self._filesystem_look_since_s = loop.time()
        done, _ = await asyncio.wait((look,), timeout=limits.FILESYSTEM_LOOK_WAIT_MS / 1000)
        if done:
            self._filesystem_look = None
            report = look.result()
            self._filesystem_free_bytes = report.free_bytes  # 0 where it takes no writes
            return {disk.segment_id: report}
        if loop.time() - self._filesystem_look_since_s >= limits.FILESYSTEM_LOOK_OVERDUE_MS / 1000:
            return {disk.segment_id: FilesystemReport(is_writable=False)}
        return {}

    async def _drop_rejected(self, info: SegmentInfo, rejected: list[InventoryEntry]) -> int:
        """Forget inventory entries the master refused (a disk tier removes their files)."""
        disk = self._disk
        if disk is not None and info.segment_id == disk.segment_id:
            assert self._mover is not None
            forgotten, left = await self._mover.drop_disk_files(rejected)
            if left:
                log.warning("node %s: the files of %d refused objects are not removed (a read-only filesystem? a "
                            "move's file there?): not served, but offered again at the next start", self.node_id,
                            len(left))  # fmt: skip
            return forgotten - len(left)
        return len(self.inventory.drop(rejected))

    async def _remove_stale_segments_forever(self) -> None:
        """Remove the segment files whose owner died, as start() does, every
        STALE_SEGMENTS_SWEEP_INTERVAL_MS. A serving process killed with its embedded segment
        (or a node killed with SIGKILL) left its file, and the host memory under it, until the
        next node started on this host: a killed engine rescheduled elsewhere, never."""
        while True:  # until _teardown cancels it
            await asyncio.sleep(STALE_SEGMENTS_SWEEP_INTERVAL_MS / 1000)
            try:
                # In a thread: unlinking a large tmpfs file frees all its pages first.
                await asyncio.to_thread(remove_stale_segments, self.config.shm_dir)
            except Exception as exc:  # noqa: BLE001 (the next sweep tries again; this one is not the node's end)
                log.warning("looking for stale segment files in %s: %s", self.config.shm_dir, exc)

    # --- teardown, state, metrics ----------------------------------------------------------

    async def _teardown(self, is_kept: bool = False) -> None:
        """Release whatever start() acquired, in reverse order. Safe on a partial start.
        `is_kept`: leave the segment for a restart (config.keep_ms), its file and objects."""
        self._leave.set()
        for task in (self._master_task, self._stale_segments_task):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._master_conn is not None:
            self._master_conn.close("node stopping")
        for handler in (self._transfer, self._master_calls):
            if handler is not None:
                handler.close()
        if self._server is not None:
            await self._server.close(_SERVER_CLOSE_WAIT_MS_MAX)
        if self._metrics_server is not None:
            await self._metrics_server.stop()
        if self._mover is not None:
            self._mover.close()
            if is_kept:
                is_kept = await self._copies_into_dram_ended()
        if self._disk is not None:
            self._disk.close()
        if self._segment is not None:
            if is_kept and self._inventory is not None and self._segment.is_owner:
                self._keep_segment()
            else:
                self._segment.close()

    async def _copies_into_dram_ended(self) -> bool:
        """Whether the copies into the DRAM segment still running (a promotion from a disk or
        share that stalls) ended within KEEP_COPIES_WAIT_MS: a segment with one still running
        is not kept, as its copy could land in a range the restarted node's master hands out
        again (review helper-151)."""
        assert self._mover is not None
        left = await self._mover.copies_into_dram_left(KEEP_COPIES_WAIT_MS)
        if left:
            log.warning("node %s: %d copies into its DRAM segment still run after %d ms (a disk or share that "
                        "stalls): the segment is not kept, its objects are gone", self.node_id, left,
                        KEEP_COPIES_WAIT_MS)  # fmt: skip
        return not left

    def _keep_segment(self) -> None:
        """Leave the segment for the node started again with this id (no byte changes now:
        the transfer server and the mover are closed)."""
        segment, inventory = self.segment, self.inventory
        until_ms = int(time.time() * 1000) + self.config.keep_ms
        if self._kept_until_ms is not None:  # taken and never mounted: as long as it was kept
            until_ms = self._kept_until_ms if not self.config.keep_ms else min(until_ms, self._kept_until_ms)
        try:
            segment.keep(self._segment_id, inventory.entries(), until_ms)
        except InvalidParams as exc:
            log.error("node %s: could not keep its segment for a restart (%s): its objects are gone", self.node_id, exc)
            return
        log.info("node %s: segment %s kept in %s with %d objects (%d bytes) for %d ms: start the node again with "
                 "--node-id %s to serve them", self.node_id, self._segment_id, segment.path, len(inventory),
                 inventory.used_bytes, until_ms - int(time.time() * 1000), self.node_id)  # fmt: skip

    def _set_state(self, state: NodeState) -> None:
        assert state in _TRANSITIONS[self._state], f"node state {self._state} -> {state}"
        self._state = state

    def _init_metrics(self) -> None:
        inventory = self.inventory
        self.metrics.segment_capacity_bytes.set(self.segment.capacity_bytes)
        self.metrics.track_inventory(lambda: inventory.used_bytes, lambda: len(inventory))
        if self._server is not None and self._server.busy_poll is not None:
            self.metrics.track_busy_poll(self._server.busy_poll)
        self.metrics.info.labels(
            node_id=self.node_id, segment_id=self._segment_id, endpoint=self._endpoint
        ).set(1)
        disk = self._disk
        if disk is not None:
            self.tier_metrics.track_disk(
                disk.capacity_bytes, lambda: disk.inventory.used_bytes, lambda: len(disk.inventory),
                lambda: self._filesystem_free_bytes,
            )  # fmt: skip

    def _health(self) -> dict[str, Any]:
        inventory = self._inventory
        status = "ok" if self._state in (NodeState.SERVING, NodeState.DRAINING) else "down"
        if status == "ok" and self._refusal is not None:
            status = "refused"  # by its master over the cluster token, or a node's port: not serving the cluster
        elif status == "ok" and not self.is_mounted:
            status = "unmounted"  # no master holds its segment (yet, or since its link broke): no new puts
        return {
            "status": status,
            "refusal": str(self._refusal or ""),
            "state": self._state.value,
            "node_id": self.node_id,
            "segment_id": self._segment_id,
            "endpoint": self._endpoint,
            "mounted": self.is_mounted,
            "objects": len(inventory) if inventory is not None else 0,
            "used_bytes": inventory.used_bytes if inventory is not None else 0,
            "capacity_bytes": inventory.capacity_bytes if inventory is not None else 0,
        }


def _in_daemon_thread(function: Callable[[], _T]) -> asyncio.Future[_T]:
    """`function()` on a daemon thread of its own, its outcome in the returned future. Not
    asyncio.to_thread: asyncio.run and the interpreter join its executor's threads at exit, and
    a node whose disk hung in statvfs did not exit on SIGTERM until the statvfs returned. The
    caller bounds how many run at once (_filesystems: one look at a time)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[_T] = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not future.done():  # else cancelled meanwhile: nobody waits for it
            outcome()

    def run() -> None:
        try:
            result = function()
        except BaseException as exc:  # handed to the waiter, as to_thread would
            outcome = functools.partial(future.set_exception, exc)
        else:
            outcome = functools.partial(future.set_result, result)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(settle, outcome)

    threading.Thread(target=run, name="kvpool-filesystem-look", daemon=True).start()
    return future


async def _advertise_host(config: NodeConfig, master_host: str) -> str:
    """The host clients dial: configured, else the listen host, else (wildcard) our address.

    For a wildcard listen host: the hostname's first non-loopback IPv4 address, else the
    address of the interface that routes to the master, else the hostname itself.
    """
    if config.advertise_host:
        return config.advertise_host
    if config.listen_host not in _WILDCARD_HOSTS:
        return config.listen_host
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(config.hostname, None, family=socket.AF_INET,
                                       type=socket.SOCK_STREAM)  # fmt: skip
    except OSError:  # Not mapped: a failed lookup only means "try the next way".
        infos = []
    for *_, sockaddr in infos:
        if not is_loopback(sockaddr[0]):
            return str(sockaddr[0])
    try:
        # Connecting a UDP socket sends nothing; it only picks the route to the master.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master_host, 9))
            address = str(probe.getsockname()[0])
        if not is_loopback(address):
            return address
    except OSError:  # Not mapped: as above.
        pass
    return config.hostname


async def _warn_if_unreachable(node_id: str, host: str, port: int, listen_host: str) -> None:
    """Say so loudly when the advertised address does not reach this node's own transfer
    server (e.g. --advertise-host naming an address it does not listen on): clients would
    fail every read and write there, and the master would take it for a working node. Only a
    warning: behind NAT a node may not reach its own public address."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), ADVERTISE_CHECK_TIMEOUT_MS / 1000)
    except (OSError, asyncio.TimeoutError) as exc:
        log.warning(
            "node %s: its advertised address %s:%d does not reach its transfer server (listening on %s:%d): "
            "%s. Clients will fail to read and write this node: check --advertise-host",
            node_id, host, port, listen_host, port, exc or "timed out",
        )  # fmt: skip
        return
    writer.close()


def _inventory_chunks(entries: list[InventoryEntry]) -> Iterator[list[InventoryEntry]]:
    """`entries` cut into MountSegment-sized lists, in order; always at least one list."""
    chunk: list[InventoryEntry] = []
    chunk_size_bytes = 0
    for entry in entries:
        entry_size_bytes = len(entry.key.encode()) + _MOUNT_ENTRY_OVERHEAD_BYTES
        is_full = chunk_size_bytes + entry_size_bytes > _MOUNT_CHUNK_SIZE_BYTES_MAX
        if chunk and (len(chunk) == _MOUNT_ENTRIES_MAX or is_full):
            yield chunk
            chunk, chunk_size_bytes = [], 0
        chunk.append(entry)
        chunk_size_bytes += entry_size_bytes
    yield chunk


def _expect(reply: Message, cls: type[_M]) -> _M:
    if not isinstance(reply, cls):
        raise RemoteProtocolError(f"expected {cls.__name__}, got {type(reply).__name__}")
    return reply


def _log_task_death(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.critical("node task %r died", task.get_name(), exc_info=task.exception())


__all__ = ["Node", "NodeState"]
