"""`AsyncStore`: the client library on asyncio. `Store` (sync.py) drives the same phases.

A put asks the master for space (put_start), writes the bytes straight to every replica (a
memcpy into a mapped segment on the same host, TCP frames to other nodes) and makes them
visible (put_end). A get asks for replicas under a read lease (get_replica_list), reads the
nearest one, verifies the checksum and that the lease held, and only then returns bytes. A miss
is `None` (or a negative code in batch forms), never partial or stale bytes.

This module holds the public API and the I/O; replica choice, framing and checks live in
transfer.py, connections in pool.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import numbers
import operator
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence

import msgspec

from kvpool import limits
from kvpool.client.buffers import BufferRegistry
from kvpool.client.directories import HostDirectories
from kvpool.client.leases import RELEASE_DELAY_MS, LeaseReleases
from kvpool.client.pool import MasterLink, PeerPool, request_on_lanes
from kvpool.client.slow_nodes import SlowNodes
from kvpool.client.transfer import (
    GetJob,
    PutJob,
    RemoteBatch,
    first_occurrences,
    new_put_id,
    now_monotonic_ms,
    write_landing,
)
from kvpool.config import ClientConfig, exact_size
from kvpool.errors import (
    ErrorCode,
    InvalidKey,
    InvalidParams,
    InvalidRequest,
    KVPoolError,
    RpcTimeout,
    SegmentNotFound,
    StoreClosed,
    error_from_code,
)
from kvpool.node.segment import Segment
from kvpool.process import forks
from kvpool.protocol import auth
from kvpool.protocol.messages import (
    ClusterStatus,
    ClusterStatusReply,
    CodesReply,
    CountReply,
    ExistKeys,
    ExistsReply,
    GetReplicaList,
    GetReplicaListReply,
    ListObjects,
    ListReply,
    LongestPrefix,
    Message,
    PutRevoke,
    PutStart,
    PutStartReply,
    QueryObjects,
    QueryReply,
    ReleaseLeases,
    Remove,
    RemoveAll,
    RemoveByRegex,
    ReplicateConfig,
    ReportBadReplicas,
    SegmentInfo,
    WriteSlices,
)
from kvpool.transports.connection import LateReply

log = logging.getLogger(__name__)

# A get of GET_PIECES_FROM_KEYS keys or more (a put: PUT_PIECES_FROM_KEYS), of objects up to
# PIECE_OBJECT_BYTES_MAX on average, goes in up to PIECES_MAX pieces of at least
# PIECE_KEYS_MIN keys (batch_pieces).
PIECE_KEYS_MIN = 64
PIECES_MAX = 8
PIECE_OBJECT_BYTES_MAX = 16 << 10
GET_PIECES_FROM_KEYS = 2 * PIECE_KEYS_MIN
PUT_PIECES_FROM_KEYS = 4 * PIECE_KEYS_MIN

BytesLike = bytes | bytearray | memoryview

# A closing store waits this long for its last lease releases and bad-replica reports (a
# master on the network answers in a millisecond or two); one that does not answer in time
# loses only their early effect: the leases lapse after their TTL, a bad read reports again.
CLOSE_BACKGROUND_WAIT_MS = 250
# A closing store lets the puts in flight finish for this long (their objects stored), then
# ends their transfers: each then gives back what it held through the master, for as long
# again. Cut off at once, a put's keys refused puts until the master's discard (30 s) and its
# ranges stayed out of use for the release timeout (10 minutes).
CLOSE_PUTS_WAIT_MS = 250
# A segment whose file is gone is unmapped this long after it is found so: longer than any
# get or put begun before may copy from it (their transfers are bounded by 30 s).
MAPPED_SEGMENT_RETIRE_MS = 60_000
# A store remembers, per segment it met, whether it is mapped here: of this many segments at
# most, so that a long-lived client of a cluster whose nodes come and go does not remember
# them without end (_map_segment; directories.py bounds its directories alike).
SEGMENTS_REMEMBERED_MAX = 65_536
# While a segment is mapped, whether its file is gone is looked at this often: a node stopped
# for good (scaled down, moved) held its whole segment's memory in /dev/shm in every
# long-lived same-host client until the client mapped another segment.
MAPPED_SEGMENT_SWEEP_MS = 10_000


class AsyncStore:
    """A connection to a kvpool cluster. Create with `await AsyncStore.open(...)`.

    Holds the master link, pooled node connections, mapped same-host segments and registered
    buffers. Safe to use from many tasks of one event loop; `aclose()` ends it. Keys are str
    (another type raises InvalidKey: key_list).
    """

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self.hostname = config.hostname or socket.gethostname()
        # Every token its file holds, the first first (auth.Keyring: a token being rotated).
        self._keys = auth.Keyring.of([config.token, *config.other_tokens] if config.token else [])
        self._master = MasterLink(
            config.master, self._keys, config.connect_timeout_ms, config.rpc_timeout_ms, config.shm_enabled
        )
        self._peers = PeerPool(
            self._keys, config.connections_per_peer, config.connect_timeout_ms, config.shm_enabled
        )
        self._mapped: dict[str, Segment | None] = {}
        self._retired: set[Segment] = set()  # unlinked, unmapped soon (_retire_unlinked)
        self._mapping = threading.Lock()
        self._sweep: asyncio.TimerHandle | None = None  # the next look for unlinked segments
        # Disk and DFS segments whose object files this host can open (docs/tiers.md).
        self.directories = HostDirectories(self.hostname, config.shm_enabled, config.dfs_dir)
        self.buffers = BufferRegistry()
        self._embedded_node = None
        self._reports: set[asyncio.Task] = set()  # bad-replica reports and lease releases in flight
        self._releases: set[asyncio.Task] = set()  # the lease releases among them
        self._is_closed = False
        self._puts_in_flight = 0  # on the loop: puts under way here, which aclose lets finish
        self._leases = LeaseReleases()  # leases of finished gets, to give back (client/leases.py)
        self._get_pieces = GetPieces(config.shm_enabled)
        self.slow_nodes = SlowNodes()  # read last for a while (client/slow_nodes.py)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._opened_in = forks()  # an AsyncStore belongs to its process (process.py)

    def __repr__(self) -> str:
        return f"<AsyncStore master={self.config.master} mapped={len(self._mapped)} {self._peers!r}>"

    @classmethod
    async def open(cls, master: str | None = None, **options: object) -> AsyncStore:
        """Connect to the cluster whose master is at `master` ("host:port").

        Options are ClientConfig fields (token, shm_enabled, embedded_memory_bytes, ...).

        Raises:
            ConnectFailed, Unauthorized: the master cannot be reached or rejects the token.
            InvalidParams: an option that ClientConfig does not have, or of another type; a
                `master` that is a node's address.
        """
        if master is not None:
            options["master"] = master
        store = cls(client_config(options))
        await store._start()
        return store

    async def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            await self._master.call(ClusterStatus(), is_idempotent=True)
        except InvalidParams:  # a master answers it always; a node's port takes the handshake, refuses the rest
            master = self.config.master
            raise InvalidParams(f"{master} is a kvpool node, not a master: give the master's address") from None
        if self.config.embedded_memory_bytes:
            from kvpool.config import NodeConfig
            from kvpool.node.server import Node

            self._embedded_node = Node(
                NodeConfig(
                    master_endpoint=self.config.master,
                    memory_bytes=self.config.embedded_memory_bytes,
                    token=self.config.token or None,  # "": none
                    accepted_tokens=self.config.other_tokens,
                    shm_enabled=self.config.shm_enabled,
                    busy_poll_us=0,  # the application's loop: a spinning one would hold the GIL
                ),
                # The store's keys, shared: a token being rotated is accepted and connected with
                # alike (its master link moves to the next token once refused, as the store does).
                keyring=self._keys,
            )
            await self._embedded_node.start()

    @property
    def embedded_segment(self) -> SegmentInfo | None:
        """The segment this client contributes in embedded mode (None otherwise)."""
        node = self._embedded_node
        return node.segment_info if node is not None else None

    async def aclose(self) -> None:
        """Refuse new puts; let those in flight finish (CLOSE_PUTS_WAIT_MS), then end their
        transfers and let them give back what they held (as long again); give back the
        leases of the last gets; then close everything. Waits at most
        CLOSE_BACKGROUND_WAIT_MS for the calls still in the background (releases, reports,
        revokes), then cancels them and lets them end here: a call left pending would run on
        after the store (reconnecting to the master), or die with the caller's loop. In a
        forked child it only marks the store closed: what it holds is the parent's (process.py)."""
        if self._opened_in != forks():
            self._is_closed = True
            self._master.close()
            self._peers.close()
            return
        if self._loop is not None and self._loop is not asyncio.get_running_loop():
            if not self._loop.is_closed():
                raise InvalidRequest("an AsyncStore belongs to the event loop it was opened on: close it there")
            self._close_after_its_loop()
            return
        self._is_closed = True
        await self._puts_settled(CLOSE_PUTS_WAIT_MS)
        self._peers.close()  # writes still in flight end now; their puts revoke through the master
        await self._puts_settled(CLOSE_PUTS_WAIT_MS)
        self._send_releases()  # now, rather than when the leases lapse
        background = list(self._reports)
        if background:
            _, pending = await asyncio.wait(background, timeout=CLOSE_BACKGROUND_WAIT_MS / 1000)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=CLOSE_BACKGROUND_WAIT_MS / 1000)
        if self._embedded_node is not None:
            await self._embedded_node.stop()
        self._master.close()
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        self._unmap_all()

    def _unmap_all(self) -> None:
        for segment in [*self._mapped.values(), *self._retired]:
            if segment is not None:
                segment.close()
        self._mapped.clear()
        self._retired.clear()

    def _close_after_its_loop(self) -> None:
        """aclose() after the loop the store was opened on has closed (an AsyncStore used in
        one asyncio.run and closed in a later one): nothing runs there any more, so the
        segments are unmapped and the store marked closed; its connections cannot be aborted
        through that loop, and their sockets close when the store is collected. It raised
        RuntimeError half-way before, the segments left mapped."""
        self._is_closed = True
        for link in (self._master, self._peers):
            with contextlib.suppress(RuntimeError):  # "Event loop is closed"
                link.close()
        self._unmap_all()

    async def _puts_settled(self, timeout_ms: int) -> None:
        """Wait until no put of this store is under way on its loop, at most `timeout_ms`."""
        deadline = time.monotonic() + timeout_ms / 1000
        while self._puts_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.002)

    @contextlib.contextmanager
    def _put_under_way(self) -> Iterator[None]:
        """Count a put (or its network phases) as under way, for aclose. On the loop."""
        self._puts_in_flight += 1
        try:
            yield
        finally:
            self._puts_in_flight -= 1

    async def __aenter__(self) -> AsyncStore:
        self._check_not_closed()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # --- plain bytes API ------------------------------------------------------------------

    async def put(self, key: str, value: BytesLike, config: ReplicateConfig | None = None) -> None:
        """Store `value` under `key`. A key that exists already is left as it is (success).

        Raises:
            NoAvailableHandle: no room even after eviction. InvalidKey, InvalidParams.
            TransportError: the master or every replica node failed.
        """
        code = (await self.put_batch([key], [value], config))[0]
        if code != ErrorCode.OK:
            raise key_error(code, "put", key, memoryview(value).nbytes)

    async def put_batch(
        self, keys: Sequence[str], values: Sequence[BytesLike], config: ReplicateConfig | None = None
    ) -> list[int]:
        """Store many objects with one master round trip per phase; one ErrorCode per key. A key
        that exists already is left as it is (OK); a key given twice is stored once, with its
        first value (both OK); a key another put has in flight is REPLICA_IS_NOT_READY."""
        if len(keys) != len(values):
            raise InvalidParams(f"{len(keys)} keys but {len(values)} values")
        return await self._put_parts(keys, value_views(values), config)

    async def get(self, key: str) -> bytes | None:
        """The object's bytes, or None on a miss (absent, evicted, lease lapsed, bad replica)."""
        return (await self.get_batch([key]))[0]

    async def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        jobs = await self._get_parts(keys, [None] * len(keys))
        return [r if isinstance(r, bytes) else None for job in jobs for r in job.results]

    # --- zero-copy API --------------------------------------------------------------------

    def register_buffer(self, buffer: object | int, size_bytes: int | None = None) -> int:
        """Register caller memory (an address and size, ints or numpy integers, or a writable
        C-contiguous buffer object, not empty) for the zero-copy calls. Returns its address.
        Raises InvalidParams, and registers nothing then; StoreClosed once closed."""
        self._check_not_closed()
        return self.buffers.register(buffer, size_bytes)

    def unregister_buffer(self, address: int) -> None:
        """Forget a registered range. Raises InvalidParams if none starts at `address`, or while
        a call in flight uses it (a transfer may read or write it until that call returned:
        free the memory only after unregistering).
        StoreClosed once closed."""
        self._check_not_closed()
        self.buffers.unregister(address)

    def _check_not_closed(self) -> None:
        """For the calls that reach no server (those that do are refused by their links): a
        registration after aclose() was taken, and kept the caller's buffer alive, where the
        Store refuses it (StoreClosed)."""
        if self._is_closed:
            raise StoreClosed("the store is closed")

    async def put_from(
        self, key: str, address: int, size_bytes: int, config: ReplicateConfig | None = None
    ) -> int:
        return (await self.batch_put_from([key], [address], [size_bytes], config))[0]

    async def get_into(self, key: str, address: int, size_bytes: int) -> int:
        """Read an object into registered memory. Returns its size, or a negative ErrorCode."""
        return (await self.batch_get_into([key], [address], [size_bytes]))[0]

    async def batch_put_from(
        self,
        keys: Sequence[str],
        addresses: Sequence[int],
        sizes: Sequence[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """Put each key from one registered range; one ErrorCode per key. Addresses and sizes
        are ints or numpy integers (a numpy array of them will do), in every zero-copy call."""
        with self._lent(keys, addresses, sizes) as views:
            return await self._put_parts(keys, views, config)

    async def batch_get_into(
        self, keys: Sequence[str], addresses: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        """Get each key into one registered range; per key its size or a negative ErrorCode."""
        with self._lent(keys, addresses, sizes, is_written=True) as views:
            jobs = await self._get_parts(keys, views, buffer_starts(addresses, per_key=False))
        return [result for job in jobs for result in get_into_results(job)]

    async def batch_put_from_multi_buffers(
        self,
        keys: Sequence[str],
        addresses: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """Put each key gathered from several registered ranges (e.g. one per layer)."""
        with self._lent(keys, addresses, sizes, per_key=True) as views:
            return await self._put_parts(keys, views, config)

    async def batch_get_into_multi_buffers(
        self, keys: Sequence[str], addresses: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        """Get each key scattered into several registered ranges, filled in order."""
        with self._lent(keys, addresses, sizes, per_key=True, is_written=True) as views:
            jobs = await self._get_parts(keys, views, buffer_starts(addresses))
        return [result for job in jobs for result in get_into_results(job)]

    def _lent(
        self,
        keys: Sequence[str],
        addresses: Sequence,
        sizes: Sequence,
        *,
        per_key: bool = False,
        is_written: bool = False,
    ) -> contextlib.AbstractContextManager[list[list[memoryview]]]:
        """The registered ranges of a zero-copy call, as views, held in use for its duration
        (BufferRegistry.lent): one range per key, or with `per_key` several; `is_written` (a
        get's): refused if two overlap."""
        if not len(keys) == len(addresses) == len(sizes):
            raise InvalidParams("keys, buffers and sizes differ in length")
        return self.buffers.lent(addresses, sizes, per_key=per_key, is_written=is_written)

    # --- metadata API ---------------------------------------------------------------------

    async def exists(self, key: str) -> bool:
        return (await self.batch_exists([key]))[0]

    async def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return exists_flags(await self._master.call(ExistKeys(key_list(keys)), is_idempotent=True))

    async def longest_prefix(
        self, keys: Sequence[str], hold_ms: int = 0, hold_reads: int = 1, timeout_ms: int | None = None
    ) -> int:
        """How many leading keys are present, in one round trip (engines' prefix lookup).
        With `hold_ms`, what was found is kept from eviction for that long (at most the
        master's lease TTL), or until `hold_reads` reads of it have begun and their readers
        have given their leases back: for the load that follows the lookup (an engine's
        scheduler looks up, its workers load moments later; `hold_reads` is how many ranks
        load each object, all the TP ranks of an MLA model, which share its blocks).
        `timeout_ms`: the call's own bound on the master's answer (call_bound), shorter than
        the RPC timeout for an engine's loop that waits on the lookup; it bounds the whole
        call, finding the master again and connecting included (_call_within).

        Raises:
            RpcTimeout: no answer within `timeout_ms`. ConnectFailed and the like, as any call.
        """
        checked_args(hold_ms=(hold_ms, int), hold_reads=(hold_reads, int))
        bound = call_bound(timeout_ms)
        message = LongestPrefix(key_list(keys), hold_ms, hold_reads)
        return prefix_count(await self._call_within(message, bound))

    async def get_size(self, key: str) -> int:
        """Raises ObjectNotFound."""
        return object_size(await self._master.call(QueryObjects(key_list([key])), is_idempotent=True), key)

    async def query(self, keys: Sequence[str], timeout_ms: int | None = None) -> QueryReply:
        """Each key's replicas. `timeout_ms`: as longest_prefix."""
        bound = call_bound(timeout_ms)
        return query_reply(await self._call_within(QueryObjects(key_list(keys)), bound))

    async def remove(self, key: str, force: bool = False) -> None:
        """Raises ObjectNotFound, or ObjectHasLease while a reader holds it (unless force)."""
        code = (await self.batch_remove([key], force))[0]
        if code != ErrorCode.OK:
            raise key_error(code, "remove", key)

    async def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        checked_args(force=(force, bool))
        keys = key_list(keys)
        await self._leases_given_back(force)
        reply = await self._master.call(Remove(keys, force), is_idempotent=False)
        assert isinstance(reply, CodesReply)
        return reply.codes

    async def remove_by_regex(self, pattern: str, force: bool = False, timeout_ms: int | None = None) -> int:
        """Remove the objects whose keys match (RE2), leased ones only with `force`; how many.
        The master removes a few microseconds an object between other requests, so millions
        take seconds: `timeout_ms` (at most limits.CALL_TIMEOUT_MS_MAX, a week) waits that
        long for it instead of the RPC timeout."""
        checked_args(pattern=(pattern, str), force=(force, bool))
        bound = call_bound(timeout_ms)
        await self._leases_given_back(force)
        message = RemoveByRegex(pattern, force)
        reply = await self._master.call(message, is_idempotent=False, timeout_ms=bound)
        assert isinstance(reply, CountReply)
        return reply.count

    async def remove_all(self, force: bool = False, timeout_ms: int | None = None) -> int:
        """Remove every object, leased ones only with `force`; how many. `timeout_ms`: as
        remove_by_regex."""
        checked_args(force=(force, bool))
        bound = call_bound(timeout_ms)
        await self._leases_given_back(force)
        reply = await self._master.call(RemoveAll(force), is_idempotent=False, timeout_ms=bound)
        assert isinstance(reply, CountReply)
        return reply.count

    async def _leases_given_back(self, force: bool) -> None:
        """Before a remove that spares leased objects: give back the leases of this store's
        finished gets now, not RELEASE_DELAY_MS later with the gets after them, and wait for
        those the flush gave back already, so that a remove right after the store's own get
        is not refused (OBJECT_HAS_LEASE) for a read that is over. The flush's releases may
        not be out yet (a remove whose task starts in the turn of the loop that flushed sends
        its frame first: the master took it before them). A release that fails leaves the
        lease to its TTL, as it would have; a remove cancelled meanwhile leaves them going."""
        if force:
            return
        for message in self._leases.take():
            self._release(message)
        if self._releases:  # together: one bound for all, however many
            await asyncio.wait(set(self._releases))

    async def list_objects(self, pattern: str = "", limit: int = 1000) -> ListReply:
        checked_args(pattern=(pattern, str), limit=(limit, int))
        reply = await self._master.call(ListObjects(pattern, limit), is_idempotent=True)
        assert isinstance(reply, ListReply)
        return reply

    async def cluster_status(self, timeout_ms: int | None = None) -> ClusterStatusReply:
        """`timeout_ms`: as longest_prefix."""
        bound = call_bound(timeout_ms)
        reply = await self._call_within(ClusterStatus(), bound)
        assert isinstance(reply, ClusterStatusReply)
        return reply

    async def _call_within(
        self,
        message: Message,
        timeout_ms: int | None,
        is_idempotent: bool = True,
        late_reply: LateReply | None = None,
    ) -> Message:
        """The master's answer within `timeout_ms` (a call's own bound, call_bound) in all,
        finding the master and connecting to it included: MasterLink.call grants a call a
        connect timeout on top of its bound, and a lookup that had to find a killed leader's
        successor took 2-3 s of an engine's lookup_timeout_ms of 1 s. None: MasterLink.call's
        bound (the connect timeout, then the RPC timeout).

        Raises:
            RpcTimeout: no answer within `timeout_ms` (a connect under way goes on, for the
                next call).
            As MasterLink.call otherwise.
        """
        call = self._master.call(message, is_idempotent=is_idempotent, timeout_ms=timeout_ms, late_reply=late_reply)
        if timeout_ms is None:
            return await call
        try:
            async with asyncio.timeout(timeout_ms / 1000):
                return await call
        except TimeoutError:
            raise RpcTimeout(
                f"{type(message).__name__}: no answer from the master within the call's bound ({timeout_ms} ms)"
            ) from None

    # --- phases (also driven by the sync Store) ---------------------------------------------

    async def _put_parts(
        self,
        keys: Sequence[str],
        parts: Sequence[Sequence[memoryview]],
        config: ReplicateConfig | None,
    ) -> list[int]:
        """A whole put, every phase on this loop."""
        if self._is_closed:  # closing: the puts under way may finish, no new one starts
            raise StoreClosed("the store is closed")
        keys = key_list(keys)  # before first_occurrences: an unhashable key is an InvalidKey too
        config = checked_config(config)
        unique, positions = first_occurrences(keys)
        if len(unique) < len(keys):
            codes = await self._put_parts([keys[i] for i in unique], [parts[i] for i in unique], config)
            return [codes[p] for p in positions]
        with self._put_under_way():
            job = await self._put_start(keys, parts, config)
            try:
                with self.closed_meanwhile():
                    job.copy_local()
            except BaseException:  # a close meanwhile, Ctrl-C: the keys go back at once (the sync Store's way)
                self._give_up(job)
                raise
            return await self._put_finish(job)

    async def _get_parts(
        self,
        keys: Sequence[str],
        targets: Sequence[list[memoryview] | None],
        starts: Sequence[int | None] | None = None,
    ) -> list[GetJob]:
        """A whole get, every phase on this loop: a job per piece of the batch (GetPieces), in
        order. `starts`: see buffer_starts."""
        with self.closed_meanwhile():  # a close meanwhile unmapped the segments
            if len(keys) < GET_PIECES_FROM_KEYS:
                return await self._got([await self._located(keys, targets, starts)], False)
            with self._get_pieces.pieces(keys, targets) as pieces:
                if len(pieces) == 1:
                    return await self._got([await self._located(keys, targets, starts)], True)
                return await self._got(await self._located_in_pieces(keys, targets, starts, pieces), True)

    async def _located(
        self,
        keys: Sequence[str],
        targets: Sequence[list[memoryview] | None],
        starts: Sequence[int | None] | None,
    ) -> GetJob:
        """The get's job, its same-host copies done."""
        job = await self._locate(keys, targets, starts)
        if (copying := self._copy_local(job)) is not None:
            with self.leases_back_if_abandoned([job]):
                await copying
        return job

    async def _located_in_pieces(
        self,
        keys: Sequence[str],
        targets: Sequence[list[memoryview] | None],
        starts: Sequence[int | None] | None,
        pieces: list[tuple[int, int]],
    ) -> list[GetJob]:
        """Every piece's lookup sent at once, each piece's same-host copies done as its
        answer comes, while the master looks up the next."""
        lease_start_ms = now_monotonic_ms()
        keys_of_pieces = [key_list(keys[start:end]) for start, end in pieces]
        lookups = [asyncio.ensure_future(self._look_up(piece_keys)) for piece_keys in keys_of_pieces]
        jobs: list[GetJob] = []
        try:
            with self.leases_back_if_abandoned(jobs):  # cancelled, or a lookup failed
                for piece, lookup in zip(pieces, lookups):
                    reply = await lookup
                    await self.directories.wait_async(self.directory_looks(reply))
                    jobs.append(job := self._get_job(reply, lease_start_ms, keys, targets, starts, piece))
                    if (copying := self._copy_local(job)) is not None:
                        await copying
        finally:  # the lookups of pieces not reached (cancelled, or one failed) are not wanted:
            for piece_keys, lookup in list(zip(keys_of_pieces, lookups))[len(jobs) :]:
                if not lookup.done():
                    lookup.cancel()  # an answer still to come gives its leases back (late_reply)
                elif not lookup.cancelled() and lookup.exception() is None:
                    self._give_back_late_leases(piece_keys, lookup.result())
        return jobs

    async def _got(self, jobs: list[GetJob], is_telling: bool) -> list[GetJob]:
        """Finish the jobs of a get whose same-host copies are done: read the rest over TCP,
        check the leases, report bad replicas, give the leases back. `is_telling`: a get large
        enough to go in pieces, whose objects tell the next such get what to expect."""
        remote = [job for job in jobs if job.pending_indexes()]
        if remote:
            with self.leases_back_if_abandoned(jobs):  # no read of a cancelled get goes on
                await asyncio.gather(*(self._read_remote(job) for job in remote))
        now_ms = now_monotonic_ms()
        for job in jobs:
            job.finish(now_ms)
            self.report_bad_replicas(job)
            self.release_leases(job)
        if is_telling:
            self._get_pieces.found(jobs, not remote)
        return jobs

    def report_bad_replicas(self, job: GetJob) -> None:
        """Tell the master which replicas read bad (it has them hashed again where they are, and
        drops those the check confirms), in the background: the get has its answer already. On
        the loop."""
        if not job.bad_replicas:
            return
        bad = job.bad_replicas[: limits.BATCH_KEYS_MAX]  # a key may read bad on several replicas
        keys = [key for key, _ in bad]
        segment_ids = [replica.segment_id for _, replica in bad]
        offsets = [replica.offset for _, replica in bad]
        report = ReportBadReplicas(keys, segment_ids, offsets)
        self._in_background(report, True, "reporting bad replicas failed (the next bad read reports them again)")

    @contextlib.contextmanager
    def closed_meanwhile(self) -> Iterator[None]:
        """A put or get whose same-host copy found its mapped segments unmapped by a close
        from another thread or task (aclose unmaps them once closed) raises StoreClosed, as a
        call begun after the close does: not the ValueError of a released memoryview (a
        serving engine that shuts down while its threads still load and store blocks). Memory
        is never at stake: a copy under way holds a view, and the mapping outlives it."""
        try:
            yield
        except ValueError as exc:
            if self._is_closed:
                raise StoreClosed("the store was closed during the call") from exc
            raise

    @contextlib.contextmanager
    def leases_back_if_abandoned(self, jobs: Sequence[GetJob]) -> Iterator[None]:
        """A get that ends in the block without its answer (cancelled, timed out, interrupted,
        a step failed) gives the read leases of `jobs` (as they are then) back at once, not at
        their TTL: until then eviction and a plain remove skip those objects. Any thread."""
        try:
            yield
        except BaseException:
            for job in jobs:
                self.release_leases(job)
            raise

    def release_leases(self, job: GetJob) -> None:
        """Give the master back the read leases of a finished get, batched with those of the
        gets of the next RELEASE_DELAY_MS (client/leases.py). Any thread."""
        self._give_back_leases(job.reply, job.keys)

    def _give_back_leases(self, reply: GetReplicaListReply, keys: Sequence[str]) -> None:
        if not self.config.release_leases:
            return
        if self._leases.add(reply, keys) and self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.call_later, RELEASE_DELAY_MS / 1000, self._send_releases)

    def _send_releases(self) -> None:
        for message in self._leases.take():
            self._release(message)

    def _release(self, message: ReleaseLeases) -> None:
        """Give leases back in the background; a remove waits for those in flight."""
        task = self._in_background(message, False, "giving back read leases failed (they run out instead)")
        if task is not None:
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)

    def _in_background(self, message: Message, is_idempotent: bool, failure: str) -> asyncio.Task | None:
        """Send `message` to the master without waiting for its answer; log `failure` if it
        fails (a report or a release the get's caller has no use for). On the loop. Not once
        the master's link is closed (a get that finished meanwhile): its leases lapse instead;
        a closing store's puts still give back what they held (aclose). Returns the task
        sending it, if any."""
        if self._master.is_closed:
            return None
        task = asyncio.ensure_future(self._master.call(message, is_idempotent=is_idempotent))
        self._reports.add(task)
        task.add_done_callback(functools.partial(self._background_done, failure))
        return task

    def _background_done(self, failure: str, task: asyncio.Task) -> None:
        self._reports.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.info("%s: %s", failure, task.exception())

    async def _put_start(
        self,
        keys: Sequence[str],
        parts: Sequence[Sequence[memoryview]],
        config: ReplicateConfig | None,
    ) -> PutJob:
        message = self._put_start_message(keys, parts, config)
        late_reply = functools.partial(self._revoke_granted, message)
        sent_ms = now_monotonic_ms()
        reply = await self._master.call(message, is_idempotent=False, late_reply=late_reply)
        return self._put_job(message, parts, reply, sent_ms)

    def _revoke_granted(self, message: PutStart, reply: Message) -> None:
        """A put_start answered after its caller was cancelled or timed out: nothing was
        written into what it granted, so the keys and their ranges are given back at once.
        Else the keys would refuse puts (REPLICA_IS_NOT_READY) until the master discarded
        them, and the space stay quarantined until the release timeout."""
        if isinstance(reply, PutStartReply):
            granted = [key for key, code in zip(message.keys, reply.codes) if code == ErrorCode.OK]
            if granted:
                revoke = PutRevoke(granted, put_id=message.put_id)
                self._in_background(revoke, False, "revoking a put whose caller gave up failed")

    def _put_start_message(
        self,
        keys: Sequence[str],
        parts: Sequence[Sequence[memoryview]],
        config: ReplicateConfig | None,
        put_id: int | None = None,
    ) -> PutStart:
        """`put_id`: the put's, shared by its pieces (sync.py); a new one if None."""
        sizes = [len(kp[0]) if len(kp) == 1 else sum(len(p) for p in kp) for kp in parts]
        # The keys were checked where the put came in (key_list: _put_parts, Store._put).
        return PutStart(list(keys), sizes, config or ReplicateConfig(), self.hostname, put_id or new_put_id())

    def _put_job(
        self, message: PutStart, parts: Sequence[Sequence[memoryview]], reply: Message, sent_ms: int
    ) -> PutJob:
        """The put the master's answer to `message` (sent at `sent_ms`, monotonic) describes.
        Any thread (the sync Store's)."""
        assert isinstance(reply, PutStartReply)
        return PutJob(message.keys, parts, reply, self._local_segment, message.put_id, sent_ms)

    async def _put_finish(self, job: PutJob) -> list[int]:
        """Write the remote replicas, then put_end what was written and revoke the rest."""
        with self._put_under_way():
            return await self._put_written(job)

    async def _put_written(self, job: PutJob) -> list[int]:
        try:
            failed = await self._run_batches(job.remote, job.write_timeout_ms(self.config.transfer_timeout_ms))
        except asyncio.CancelledError:
            self._give_up(job)
            raise
        end, revoke = job.settle_writes(failed)
        if end:
            try:
                reply = await self._master.call(job.put_end(end), is_idempotent=False)
            except BaseException:
                # Revoked in the background, so that a put of them again succeeds at once
                # rather than finding them pending until the master's discard timeout.
                self._give_up(job)
                raise
            job.ended(end, reply)
        if revoke:
            try:
                await self._master.call(job.put_revoke(revoke), is_idempotent=False)
            except KVPoolError as exc:
                # The master discards the put at its timeout, then holds its ranges until the release timeout.
                log.info("put_revoke failed (the master will discard the put): %s", exc)
            if self._peers.is_closed:  # its writes were ended by a close (aclose), not by their nodes
                raise StoreClosed("the store was closed during the put")
        return job.codes

    def _give_up(self, job: PutJob) -> None:
        """A put cancelled (or timed out) while its writes to other hosts were in flight, or
        whose put_end failed: its keys are revoked at once, in the background, so that a put
        of them again succeeds (a put_end the master did take made them objects, which a
        revoke leaves alone).
        The ranges of keys with a write in flight stay quarantined (one may land yet); those
        written only here (same-host copies, done) are free at once."""
        abandoned, revoked = job.unwritten_ends()
        failure = "revoking a cancelled put failed (the master discards it at its timeout)"
        if abandoned:
            self._in_background(PutRevoke(abandoned, writes_in_flight=True, put_id=job.put_id), False, failure)
        if revoked:
            self._in_background(PutRevoke(revoked, put_id=job.put_id), False, failure)

    async def _locate(
        self,
        keys: Sequence[str],
        targets: Sequence[list[memoryview] | None],
        starts: Sequence[int | None] | None = None,
    ) -> GetJob:
        lease_start_ms = now_monotonic_ms()
        reply = await self._look_up(key_list(keys))
        await self.directories.wait_async(self.directory_looks(reply))
        return self._get_job(reply, lease_start_ms, keys, targets, starts)

    def _look_up(self, keys: list[str]) -> Awaitable[Message]:
        """The master's GetReplicaList answer; one that comes after the caller was cancelled or
        timed out gives its read leases back at once (else eviction skips those objects until
        the leases run out)."""
        late_reply = functools.partial(self._give_back_late_leases, keys)
        return self._master.call(GetReplicaList(keys), is_idempotent=True, late_reply=late_reply)

    def _give_back_late_leases(self, keys: list[str], reply: Message) -> None:
        if isinstance(reply, GetReplicaListReply):
            self._give_back_leases(reply, keys)

    def _get_job(
        self,
        reply: Message,
        lease_start_ms: int,
        keys: Sequence[str],
        targets: Sequence[list[memoryview] | None],
        starts: Sequence[int | None] | None,
        piece: tuple[int, int] | None = None,
    ) -> GetJob:
        """The get of `keys` the master's GetReplicaList answer describes (a lease taken at
        `lease_start_ms` or later); with `piece` (start, end), of keys[start:end] (their
        targets and starts likewise). Its reads over TCP end within one transfer timeout from
        `lease_start_ms`, all replicas together, however long the lease: within the sync
        Store's bound on a call; its reads of object files here too (GetJob). Any thread: the
        sync Store builds it in the caller's."""
        assert isinstance(reply, GetReplicaListReply)
        if piece is not None:
            start, end = piece
            keys, targets = keys[start:end], targets[start:end]
            starts = None if starts is None else starts[start:end]
        span = self.buffers.view if starts is not None else None
        return GetJob(
            reply, targets, lease_start_ms, self._local_segment, keys, self.directories.find, starts, span,
            self.slow_nodes.is_slow, lease_start_ms + self.config.transfer_timeout_ms,
        )  # fmt: skip

    async def _read_remote(self, job: GetJob) -> None:
        """Fetch every pending key over TCP, falling back replica by replica."""
        for _ in range(limits.REPLICA_NUM_MAX):
            batches = job.remote_batches()
            if not batches:
                return
            asked = {i for batch in batches for owners in batch.owners for i in owners}
            failed: set[int] = set()
            timeout_ms = job.round_timeout_ms(now_monotonic_ms(), self.config.transfer_timeout_ms)
            if not timeout_ms:
                return  # the lease lapsed: misses (job.finish)
            budget_ms = self.slow_nodes.budget_ms
            timeouts_ms = [budget_ms(b.endpoint, timeout_ms, functools.partial(job.bytes_of, b)) for b in batches]
            for outcome in await asyncio.gather(*map(self._run_batch, batches, timeouts_ms)):
                failed |= outcome
            job.remote_done(asked, failed)
            if (copying := self._copy_local(job)) is not None:
                await copying

    def _copy_local(self, job: GetJob) -> Awaitable[None] | None:
        """The job's same-host copies: done inline from mapped segments (None), or on a worker
        thread when it reads object files (a disk's latency must not stall the event loop):
        await what is returned."""
        if job.reads_files():
            return self._copy_on_a_worker(job)
        job.copy_local(read_files=False)
        if job.reads_files():  # a mapped copy failed its checksum, and the next replica is a file here
            return self._copy_on_a_worker(job)
        return None

    async def _copy_on_a_worker(self, job: GetJob) -> None:
        """job.copy_local on a worker thread. A get cancelled meanwhile (or timed out) gives
        its file reads up (a hung disk or DFS mount's: they end on their threads, writing
        nothing of the caller's) and returns once the worker stopped writing into the caller's
        buffers, as a cancelled read over TCP does (Connection.request): the caller may reuse
        them the moment it has its error.

        A worker that does not stop within the transfer timeout (a chunk's copy into memory
        that does not answer) is left to it: the call returns, but the buffers stay in use for
        unregister_buffer until it has, so that their memory is not freed under its write
        (BufferRegistry.hold).
        """
        loop = asyncio.get_running_loop()
        copying = loop.run_in_executor(None, job.copy_local)
        try:
            await asyncio.shield(copying)
        except asyncio.CancelledError:
            if not job.give_up():  # not begun (queued behind other workers): it never will
                raise
            release = self.buffers.hold(view for target in job.targets if target is not None for view in target)
            copying.add_done_callback(lambda _: release())
            deadline = loop.time() + self.config.transfer_timeout_ms / 1000
            while not copying.done() and (left_s := deadline - loop.time()) > 0:
                with contextlib.suppress(asyncio.CancelledError):  # cancelled again: the same wait
                    await asyncio.wait([copying], timeout=left_s)
            if not copying.done():
                log.warning(
                    "a cancelled get's copy into its buffers had not ended within %d ms: they "
                    "stay in use until it has", self.config.transfer_timeout_ms,
                )  # fmt: skip
            raise

    async def _run_batches(self, batches: Sequence[RemoteBatch], timeout_ms: int | None = None) -> list[set[int]]:
        """Send every batch's frames over lanes to its endpoint, all endpoints at once, within
        `timeout_ms` (the transfer timeout by default). Returns, per batch, the key indexes
        whose frames failed."""
        timeout_ms = timeout_ms or self.config.transfer_timeout_ms
        return list(await asyncio.gather(*(self._run_batch(b, timeout_ms) for b in batches)))

    async def _run_batch(self, batch: RemoteBatch, timeout_ms: int) -> set[int]:
        started_s = time.monotonic()
        try:
            lanes = await self._peers.lanes(batch.endpoint, len(batch.frames), timeout_ms)
        except KVPoolError as exc:
            log.info("node %s unreachable: %s", batch.endpoint, exc)
            self.slow_nodes.timed_out(batch.endpoint, timeout_ms, started_s)  # a stopped node's handshake never ends
            return {i for owners in batch.owners for i in owners}
        requests = []
        for frame, (message, views) in enumerate(batch.frames):
            if isinstance(message, WriteSlices):
                requests.append((message, views, None, write_landing(message), None))
            else:
                requests.append((message, [], _fixed_sinks(views), None, batch.on_landed(frame)))
        results = await request_on_lanes(lanes, requests, timeout_ms)
        failed: set[int] = set()
        for owners, result in zip(batch.owners, results):
            if isinstance(result, BaseException):
                if not isinstance(result, (KVPoolError, asyncio.TimeoutError)):
                    raise result
                if isinstance(result, (RpcTimeout, asyncio.TimeoutError)):
                    self.slow_nodes.timed_out(batch.endpoint, timeout_ms, started_s)
                log.info("transfer to %s failed: %s", batch.endpoint, result)
                failed.update(owners)
        if not failed:
            self.slow_nodes.answered(batch.endpoint)
        return failed

    def directory_looks(self, reply: Message) -> list:
        """The looks at disk and DFS directories a get must wait for (HostDirectories.wait)
        before it chooses among the replicas `reply` (its GetReplicaList answer) names."""
        if not isinstance(reply, GetReplicaListReply) or not reply.segments:
            return []
        return self.directories.looks_for(reply.segments.values())

    def _local_segment(self, info: SegmentInfo) -> Segment | None:
        """The mapped segment if it is on this host and its token matches, else None."""
        if not self.config.shm_enabled or not info.shm_path:
            return None
        # One lookup, not `in` and then [ ]: _retire_unlinked (another thread's, under
        # _mapping) may delete the entry between the two. None is cached too (not mappable).
        try:
            return self._mapped[info.segment_id]
        except KeyError:
            pass
        with self._mapping:  # the sync Store's caller threads build gets too (_get_job)
            return self._map_segment(info)

    def _map_segment(self, info: SegmentInfo) -> Segment | None:
        if info.segment_id in self._mapped:
            return self._mapped[info.segment_id]
        if self._is_closed:  # nothing is mapped again once closed (a get finishing meanwhile)
            return None
        segment = None
        if info.hostname == self.hostname:
            try:
                segment = Segment.open_mapped(info.shm_path, info.shm_token)
            except SegmentNotFound as exc:
                log.info("segment %s not mappable, using TCP: %s", info.segment_id, exc)
        if segment is not None:
            self._retire_unlinked()
            if self._sweep is None and self._loop is not None:
                with contextlib.suppress(RuntimeError):  # the loop closed
                    self._loop.call_soon_threadsafe(self._schedule_sweep)
        if len(self._mapped) >= SEGMENTS_REMEMBERED_MAX:
            self._forget_unmapped()
        self._mapped[info.segment_id] = segment
        return segment

    def _forget_unmapped(self) -> None:
        """Forget the segments remembered as not mappable here (other hosts'), to make room:
        a segment met again is looked at again, a name compare. Before, past
        SEGMENTS_REMEMBERED_MAX nothing more was remembered, and every get or put that met
        a segment of this host mapped its whole file again. Under self._mapping."""
        for segment_id, segment in list(self._mapped.items()):
            if segment is None:
                del self._mapped[segment_id]

    def _schedule_sweep(self) -> None:
        """On the loop: look for unlinked segments MAPPED_SEGMENT_SWEEP_MS from now, and on
        while any segment is mapped."""
        if self._sweep is None and not self._is_closed:
            self._sweep = asyncio.get_running_loop().call_later(MAPPED_SEGMENT_SWEEP_MS / 1000, self._sweep_unlinked)

    def _sweep_unlinked(self) -> None:
        self._sweep = None
        # Not blocking the loop: a caller thread may be mapping a large segment (populated
        # page by page); then the next sweep looks.
        if not self._mapping.acquire(blocking=False):
            self._schedule_sweep()
            return
        try:
            self._retire_unlinked()
            is_mapping = any(segment is not None for segment in self._mapped.values())
        finally:
            self._mapping.release()
        if is_mapping:
            self._schedule_sweep()

    def _retire_unlinked(self) -> None:
        """Forget the mapped segments whose file is gone (a node that stopped or restarted:
        a new segment is being mapped, or the periodic sweep), and unmap them MAPPED_SEGMENT_RETIRE_MS later, when no
        copy begun before can still be using them. Kept, each held its whole size of memory
        and a descriptor in every long-lived same-host client, per node restart (helper-53:
        6 mappings and 201 MiB of /dev/shm after 5 restarts of a 32 MiB node). Under
        self._mapping."""
        loop = self._loop
        for segment_id, segment in list(self._mapped.items()):
            if segment is None or not segment.is_unlinked() or loop is None:
                continue
            del self._mapped[segment_id]
            self._retired.add(segment)
            with contextlib.suppress(RuntimeError):  # the loop closed: aclose unmaps it
                loop.call_soon_threadsafe(loop.call_later, MAPPED_SEGMENT_RETIRE_MS / 1000, self._unmap, segment)

    def _unmap(self, segment: Segment) -> None:
        if segment in self._retired:
            self._retired.discard(segment)
            segment.close()


# What the master's answers to metadata requests mean, for AsyncStore and the sync Store alike.


def exists_flags(reply: Message) -> list[bool]:
    assert isinstance(reply, ExistsReply)
    return reply.flags


def key_list(keys: Iterable[str]) -> list[str]:
    """`keys` as the list a request carries, each a str: the master takes a request with a key
    of another type (bytes, say) for a malformed frame and drops the connection, which the
    caller would see as RpcFailed; so would it a batch of more than BATCH_KEYS_MAX keys (the
    decoder refuses it, protocol/messages.py Batch). A str or bytes is refused whole: taken as
    its characters (get_batch("abc") read keys "a", "b" and "c"), it is one key passed where a
    batch form wants a list. Raises InvalidKey, InvalidParams."""
    if isinstance(keys, (str, bytes, bytearray, memoryview)):
        raise InvalidParams(f"keys must be a list of keys, not a {type(keys).__name__}: {keys!r:.100}")
    listed = list(keys)
    if len(listed) > limits.BATCH_KEYS_MAX:
        raise InvalidParams(f"{len(listed)} keys in one batch > {limits.BATCH_KEYS_MAX}")
    try:
        "".join(listed).encode()  # in C: stops at the first key that is not a str, or not UTF-8
    except TypeError:
        bad = next(key for key in listed if not isinstance(key, str))
        raise InvalidKey(f"a key must be a str, not {type(bad).__name__}: {bad!r:.100}") from None
    except UnicodeEncodeError:  # a lone surrogate ("\udc80": bytes decoded with surrogateescape)
        bad = next(key for key in listed if not _is_utf8(key))
        raise InvalidKey(f"a key must be valid UTF-8 text: {bad!r:.100}") from None
    return listed


def _is_utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def value_views(values: Sequence[BytesLike]) -> list[list[memoryview]]:
    """Each value as the one byte view a put sends. Raises InvalidParams, naming the first
    value that is not a contiguous bytes-like object (a str, None, a strided numpy view),
    where memoryview's TypeError came out of the put before. (A size out of range is the
    master's per-key INVALID_PARAMS, as for the other keys of a batch.)"""
    try:
        return [[memoryview(value).cast("B")] for value in values]
    except TypeError:
        for index, value in enumerate(values):
            try:
                memoryview(value).cast("B")
            except TypeError as exc:
                raise InvalidParams(f"value {index}: {type(value).__name__} is not contiguous bytes ({exc})") from None
        raise


def call_bound(timeout_ms: int | None) -> int | None:
    """A call's own bound on the master's answer (None: the RPC timeout), the same check for
    Store and AsyncStore. Raises InvalidParams."""
    if timeout_ms is not None:
        if type(timeout_ms) is not int:
            checked_args(timeout_ms=(timeout_ms, int))  # raises: of another type
        if not 0 < timeout_ms <= limits.CALL_TIMEOUT_MS_MAX:  # a negative one said as 0 is
            raise InvalidParams(
                f"timeout_ms {timeout_ms} not in 1..{limits.CALL_TIMEOUT_MS_MAX} (None: the store's RPC timeout)"
            )
    return timeout_ms


def checked_args(**args: tuple[object, type]) -> None:
    """Each argument (value, its type) is of that exact type, and an int one fits msgpack: the
    master takes a request with a field of another type for a malformed frame and drops the
    connection (RpcFailed for the caller, and every call in flight on it); a str must be UTF-8
    (one with a lone surrogate, as bytes decoded with surrogateescape, cannot be encoded: a
    UnicodeEncodeError from deep in the frame encoder). Raises InvalidParams."""
    for name, (value, kind) in args.items():
        if type(value) is not kind:
            article = "an" if kind.__name__[0] in "aeiou" else "a"
            raise InvalidParams(f"{name} must be {article} {kind.__name__}, not {type(value).__name__}: {value!r:.100}")
        if kind is int and not 0 <= value < 2**63:  # type: ignore[operator]
            raise InvalidParams(f"{name} {value} is out of range")
        if kind is str and not _is_utf8(value):  # type: ignore[arg-type]  # a lone surrogate: no frame holds it
            raise InvalidParams(f"{name} must be valid UTF-8 text: {value!r:.100}")


_config_codec = (msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(ReplicateConfig))


def checked_config(config: ReplicateConfig | None) -> ReplicateConfig | None:
    """`config`, checked as the master decodes it (one encode and decode, ~2 µs): a field of
    another type ("no" for a bool) would make the whole request a malformed frame, which the
    master answers by dropping the connection (the caller would see RpcFailed). Raises
    InvalidParams, naming the field (found field by field, which costs ~150 µs: errors only)."""
    if config is None:
        return None
    if not isinstance(config, ReplicateConfig):
        raise InvalidParams(f"config must be a ReplicateConfig or None, not {type(config).__name__}: {config!r:.100}")
    encoder, decoder = _config_codec
    try:
        decoder.decode(encoder.encode(config))
        return config
    except (msgspec.ValidationError, OverflowError, TypeError):
        pass
    for field in msgspec.structs.fields(config):
        value = getattr(config, field.name)
        try:
            msgspec.convert(value, field.type)
        except msgspec.ValidationError as exc:
            raise InvalidParams(f"ReplicateConfig.{field.name}: {exc}") from None
        if type(value) is int and not -(2**63) <= value < 2**64:  # what msgpack can carry
            raise InvalidParams(f"ReplicateConfig.{field.name}: {value} is out of range")
    raise InvalidParams(f"{config!r:.200} cannot be sent")


def client_config(options: dict[str, object]) -> ClientConfig:
    """The ClientConfig of a Store's or AsyncStore's options, each checked against its field
    first: a timeout read from the environment as "5000" came out of ClientConfig as "'<='
    not supported between instances of 'str' and 'int'", a master or token of another type as
    an AttributeError, and shm_enabled="false" turned the same-host paths on. An integer may be
    numpy's (taken as an int), a path a PathLike (dfs_dir=Path(...)); a bool is not an integer.
    Raises InvalidParams, naming the option."""
    names = [field.name for field in dataclasses.fields(ClientConfig)]
    if unknown := sorted(options.keys() - set(names)):
        raise InvalidParams(f"no option {unknown[0]!r}: a Store takes {', '.join(names)}")
    plain = {name: _plain_option(value) for name, value in options.items()}
    try:
        return msgspec.convert(plain, ClientConfig, strict=True)
    except msgspec.ValidationError as exc:
        raise InvalidParams(f"a Store's options: {exc}") from None


def _plain_option(value: object) -> object:
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return operator.index(value)
    return value


# What a code means to the caller of a one-key call, where its name alone leaves it a riddle.
_WHY_BY_ACTION_CODE = {
    ("put", ErrorCode.NO_AVAILABLE_HANDLE): "no segment has room for it even after eviction (what is "
    "left is leased, pinned, being written, or held after puts cut short while writing: "
    "kvpool_master_segment_quarantined_bytes), or it is larger than every segment, or no segment is mounted "
    "(no node runs, or none mounted within the wait of a master that just started)",
    ("put", ErrorCode.REPLICA_IS_NOT_READY): "another put of this key is in flight (or, just after a remove "
    "of it, a node's move of the removed object: at most a minute)",
    ("put", ErrorCode.TRANSFER_FAIL): "no replica could be written (its nodes refused the bytes or did not answer, "
    "or the writer was stalled past its grants)",
    ("put", ErrorCode.OBJECT_NOT_FOUND): "the master had given the put up before it ended (its writes took "
    "longer than their grants)",
    ("remove", ErrorCode.OBJECT_HAS_LEASE): "a read lease is on it: a get in flight, a lookup's hold "
    "(longest_prefix hold_ms), or a get just ended (its lease goes back within milliseconds, or at the lease "
    "TTL from a client that keeps them); it ends by itself: try again shortly, or force=True removes it anyway",
    ("put", ErrorCode.INVALID_KEY): f"a key holds 1 to {limits.KEY_SIZE_BYTES_MAX} bytes of UTF-8",
    ("put", ErrorCode.INVALID_PARAMS): f"an object holds 1 to {limits.OBJECT_SIZE_BYTES_MAX} bytes (empty objects "
    "are not stored)",
}


def key_error(code: int, action: str, key: str, size_bytes: int | None = None) -> KVPoolError:
    """The error of a one-key call whose key came back with `code` (not OK), for `action`
    (a put: of `size_bytes`)."""
    try:
        reason = ErrorCode(code).name
    except ValueError:
        reason = f"code {code}"
    if why := _WHY_BY_ACTION_CODE.get((action, code)):
        reason = f"{reason}: {why}"
    if size_bytes is not None and code == ErrorCode.NO_AVAILABLE_HANDLE:  # to set against the segments' sizes
        reason = f"{reason} (this object: {exact_size(size_bytes)})"
    if (action, code) == ("put", ErrorCode.INVALID_KEY):  # key_list let it by: a str of UTF-8
        reason = f"{reason} (this one: {len(key.encode())})"
    return error_from_code(code, f"{action} {key!r:.100} failed: {reason}")


def prefix_count(reply: Message) -> int:
    assert isinstance(reply, CountReply)
    return reply.count


def object_size(reply: Message, key: str) -> int:
    """Raises ObjectNotFound: absent, or still being put (as exists() says it is absent)."""
    assert isinstance(reply, QueryReply)
    code = reply.codes[0]
    if code == ErrorCode.REPLICA_IS_NOT_READY:  # a put under way: not an object yet
        code = ErrorCode.OBJECT_NOT_FOUND
    if code != ErrorCode.OK:
        raise key_error(code, "size of", key)
    return reply.sizes[0]


def query_reply(reply: Message) -> QueryReply:
    assert isinstance(reply, QueryReply)
    return reply


def _fixed_sinks(views: list[memoryview]) -> Callable[[object], list[memoryview]]:
    return lambda _reply: views


def batch_pieces(key_count: int, object_bytes: int, is_local: bool, from_keys: int) -> list[tuple[int, int]]:
    """The pieces (start, end) a get or put of `key_count` keys of `object_bytes` each (a
    mean) goes in; `is_local`: its copies are expected here, in mapped segments (the last
    get's or put's were); `from_keys`: the fewest keys that go in pieces. A batch of small
    objects copied here goes in several pieces whose requests leave at once: the master
    looks up (or allocates) the next piece while the caller copies the last, instead of each
    waiting for the other. From one thread through a sync Store, 4 KiB pages (`python
    benchmarks/bench_paths.py pieces`, six runs): gets in batches of 128 and 512, 1.06-1.18x
    and 1.19-1.38x the objects/s of one request each; puts of 512, 0.99-1.30x, but of 128 in
    two pieces 0.86-1.08x (a put's pieces share one put_end: only the allocation overlaps a
    copy). Over TCP each piece's reads cost the node a request more (0.88-1.09x), and larger
    objects' copies dwarf the master's work (64 KiB gets: 0.95-1.04x): those go whole."""
    if not is_local or key_count < max(from_keys, 2) or object_bytes > PIECE_OBJECT_BYTES_MAX:
        return [(0, key_count)]
    if key_count > limits.BATCH_KEYS_MAX:
        return [(0, key_count)]  # refused whole, as it always was
    size = max(PIECE_KEYS_MIN, -(-key_count // PIECES_MAX))
    return [(start, min(start + size, key_count)) for start in range(0, key_count, size)]


class GetPieces:
    """Whether a store's gets of GET_PIECES_FROM_KEYS keys or more go in pieces
    (batch_pieces): only one with no other as large in flight (concurrent gets overlap the
    master's work with their copies already, and pieces only add requests: four threads' gets
    of 4 KiB pages in batches of 128 ran 80-94k/s in pieces against 107-120k whole in two
    bench_core runs alternating with the code before, ad hoc), after gets that found small
    objects and read them here. Thread-safe (a sync Store's callers share one)."""

    __slots__ = ("_lock", "_in_flight", "_object_bytes", "_was_local")

    def __init__(self, is_local: bool) -> None:
        self._lock = threading.Lock()
        self._in_flight = 0
        self._object_bytes = 0  # the mean size of what the last such get found
        self._was_local = is_local  # and whether it read all of it here

    @contextlib.contextmanager
    def pieces(
        self, keys: Sequence[str], targets: Sequence[list[memoryview] | None]
    ) -> Iterator[list[tuple[int, int]]]:
        """The pieces of a get of `keys` into `targets` (None: plain, the size unknown), held
        as in flight for the block."""
        with self._lock:
            is_alone = not self._in_flight
            self._in_flight += 1
        try:
            pieces = [(0, len(keys))]
            if is_alone:
                object_bytes = self._object_bytes
                if targets[0] is not None:  # the targets' room says
                    object_bytes = sum(len(view) for target in targets for view in target) // len(keys)  # type: ignore[union-attr]
                pieces = batch_pieces(len(keys), object_bytes, self._was_local, GET_PIECES_FROM_KEYS)
            yield pieces
        finally:
            with self._lock:
                self._in_flight -= 1

    def found(self, jobs: Sequence[GetJob], is_local: bool) -> None:
        """What a get of GET_PIECES_FROM_KEYS keys or more found, all of it here or not."""
        sizes = [size for job in jobs for size in job.reply.sizes if size]
        if sizes:
            self._object_bytes = sum(sizes) // len(sizes)
            self._was_local = is_local


def buffer_starts(addresses: Sequence, per_key: bool = True) -> list[int | None]:
    """Per key of a zero-copy get: its buffer's address when it is one registered range, so
    that replies for keys laid out back to back land in one receive (GetJob). Python ints, as
    BufferRegistry.lent took them (it checked them): numpy's plus a size may be a float."""
    if not per_key:
        return list(map(operator.index, addresses))
    return [operator.index(a[0]) if len(a) == 1 else None for a in addresses]


def get_into_results(job: GetJob) -> list[int]:
    """Per key: bytes read, or the negative ErrorCode of the miss."""
    return [
        int(r) if code == ErrorCode.OK and isinstance(r, int) else int(code)
        for r, code in zip(job.results, job.codes)
    ]

