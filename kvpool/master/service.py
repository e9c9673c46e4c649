"""The master's pure metadata service: every request of the control protocol, as method calls.

`MasterService` is the whole brain of the master: segments and their allocators, objects and
their replicas, puts in flight, read leases, pins, eviction, node liveness and drains. It takes
decoded messages and `now_ms` (wall-clock milliseconds) and returns reply messages; it does no
I/O, reads no clock or environment, and draws randomness only from the `rng` it is given, so
tests and the simulator drive it directly. The put flow (puts.py), the tier flow (tiers.py) and
mounts (mounts.py) are its parts over the same structures. It is not the server: server.py owns sockets,
timers, the node connections that carry CommitObjects and DropObjects, and retries.

Two exchanges need the nodes in the middle, so the service hands the server an outbox:

    put_end(msg)          -> PendingCommit: codes decided now + CommitObjects to send per segment
    finish_put_end(p, r)  <- per segment, the node's per-entry codes (none: no answer; the
                             server passes OK for commits it did not wait for, see server.py);
                             the server runs it as settle_put_end, then publish_put_end once
                             the reply is written
    refuse_commits(seg,e) <- entries a node refused after the put was answered: drop those
                             replicas (an object left with none goes)
    take_drops()          -> per segment, DropObjects entries (removed/evicted objects)
    drops_done(seg, e)    <- the node forgot them: only now are their ranges free for reuse

Errors: a malformed request raises a typed `KVPoolError` (nothing changed); batch requests
return one `ErrorCode` per key (partial failure is normal). Costs per key (put, get, exists)
are O(log f) in free extents plus O(replicas); O(n) paths are named where they are: unmount of
a segment that holds objects (in steps of UNMOUNT_SWEEP_KEYS_PER_STEP keys when the table is
larger: sweep_step), remove_by_regex / remove_all / list_objects, check_invariants.

Clocks. `now_ms` is the master's wall clock: a grant's expiry and a move's deadline leave this
host and nodes check them against their estimate of it (node/clock.py); read leases, lookup
holds, soft pins, put discard and release timeouts and eviction back-offs share it. A node's
liveness (its TTL) and a drain's deadline are counted on `local_ms` instead, a monotonic clock
of this host that the server passes to mount_segment, heartbeat and drain_segment and with
which it runs expire_segments each tick (a service made with `local_clock`): they drop a
segment with its replicas when they run out, so a wall clock stepped forward past the node
TTL (an NTP step, a VM restored from a snapshot) dropped every node at the next tick, and one
stepped back kept a silent node for as long. A caller that drives the service with one clock
(tests, the simulator) leaves `local_ms` out: it is then `now_ms`, and tick expires segments.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable, Iterator

import re2

from kvpool import limits
from kvpool.config import MasterConfig
from kvpool.errors import (
    InvalidParams,
    KVPoolError,
    SegmentAlreadyExists,
    SegmentNotFound,
)
from kvpool.master import codes
from kvpool.master.allocator import OffsetAllocator, footprint_bytes
from kvpool.master.counters import MasterCounters, SegmentCounters
from kvpool.master.eviction import (
    EVICT_SHORTFALL_BACKOFF_MS,
    EvictionPolicy,
    LruPolicy,
    drop_bytes_in_flight,
    make_policy,
    select_above_watermark,
    select_for_room,
)
from kvpool.master.membership import Quarantine, Segment, SegmentRegistry, SegmentState
from kvpool.master.metadata import (
    ObjectMeta,
    ObjectTable,
    is_valid_key,
    replica_offset,
    replica_segment_index,
)
from kvpool.master.mounts import MountFlow
from kvpool.master.puts import PendingCommit, PutFlow, merge_retried
from kvpool.master.tiers import FULL_TIER_RETRY_MS, SLOWER_TIERS, Move, TierFlow
from kvpool.master.tombstones import Tombstones
from kvpool.patterns import compile_pattern
from kvpool.protocol.messages import (
    PLACEMENTS,
    TIER_DFS,
    TIER_DRAM,
    TIERS,
    ClusterStatus,
    ClusterStatusReply,
    CodesReply,
    CountReply,
    DrainSegment,
    ExistKeys,
    ExistsReply,
    FilesystemReport,
    GetReplicaList,
    GetReplicaListReply,
    Heartbeat,
    HeartbeatReply,
    InventoryEntry,
    ListObjects,
    ListReply,
    LongestPrefix,
    MountReply,
    MountSegment,
    MoveItem,
    OkReply,
    PutEnd,
    PutRevoke,
    PutStart,
    PutStartReply,
    QueryObjects,
    QueryReply,
    ReleaseLeases,
    Remove,
    RemoveAll,
    RemoveByRegex,
    Replica,
    ReplicateConfig,
    ReportBadReplicas,
    SegmentInfo,
    SegmentStatus,
    TierStatus,
    UnmountSegment,
)

log = logging.getLogger(__name__)


class Removal:
    """A remove_all or remove_by_regex under way (MasterService.removal): the keys of the
    complete objects when it began, and of those lost with segments that went, removed in
    steps. A step removes those of its keys that are still complete objects when it runs, and
    match, and are not leased (unless forced): a key put again between steps goes too, and so
    does a lost key put again after it began, or mounted again by its node partway (each
    counted); a key put first meanwhile stays. A matching key that is no object turns what
    segments that went left behind of it into tombstones (tombstones.py)."""

    def __init__(self, service: MasterService, keys: list[str], search, force: bool) -> None:
        self.keys = keys
        self.count = 0  # removed so far
        self._service = service
        self._search = search
        self._force = force
        self._next = 0

    @property
    def search(self):
        """The pattern's re2 search function; None for remove_all."""
        return self._search

    def step(self, now_ms: int, max_keys: int = limits.REMOVE_STEP_KEYS) -> bool:
        """Remove among the next `max_keys` keys; True once every key was looked at."""
        end = min(self._next + max_keys, len(self.keys))
        self.count += self._service._remove_matching(self.keys[self._next : end], self._search, self._force, now_ms)
        self._next = end
        return end == len(self.keys)

    def run(self, now_ms: int) -> int:
        """Every step that is left, at once; how many were removed in all."""
        self.step(now_ms, len(self.keys))
        return self.count


class MasterService:
    """The master's metadata: segments, objects, puts in flight, leases, pins, drops.

    Holds `_registry` (mounted segments), `_table` (complete objects in eviction order, puts in
    flight, soft pins), `_quarantine` (release times of the ranges of discarded puts) and
    `_puts` (the put state machine over those). Invariants (check_invariants, O(n log n)): in
    every segment the object replicas, pending-put ranges, quarantined ranges, drops and free
    extents tile the data area exactly; per-segment counts add up; every replica names a
    mounted segment, and an object's replicas lie on distinct segments; a key is either
    complete or pending, never both.

    Args:
        config: timeouts, TTLs and watermarks.
        rng: the only source of randomness (placement).
        cluster_key: signs write grants (auth.cluster_key); None in a cluster without a token.
        policy: eviction order; eviction.POLICY_DEFAULT (probation LRU) when None.
        term: names this service (the server draws a new one per start and leadership term);
            every write grant carries it and a mounted node takes only this term's grants,
            so a writer stalled across a failover cannot write into a range reallocated since.
        local_clock: the caller runs expire_segments on its local clock (the module
            docstring's Clocks) before each tick, which then leaves that to it.
    """

    def __init__(
        self,
        config: MasterConfig,
        rng: random.Random,
        cluster_key: bytes | None,
        policy: EvictionPolicy | None = None,
        term: int = 0,
        local_clock: bool = False,
    ):
        self.config = config
        self.term = term
        self._local_clock = local_clock
        self.counters = MasterCounters()
        self._registry = SegmentRegistry()
        # DRAM eviction follows `policy`; each slower tier has its own LRU (docs/tiers.md).
        self._table = ObjectTable(
            policy if policy is not None else make_policy(config.eviction_policy),
            {tier: LruPolicy() for tier in SLOWER_TIERS},
        )
        self._quarantine = Quarantine()
        # Set when an eviction fell short (everything leased or pinned): see eviction.py.
        self._evict_for_room_after_ms = 0
        self._room_claimed_bytes = 0  # of the drops in flight, by puts waiting for room
        # When this service granted its first lease: a lease given back from before was granted
        # by an earlier master (a restart, a new term), whose readers this one does not count.
        self._first_lease_ms = 0
        self._evict_watermark_after_ms = 0
        self._tiers = TierFlow(config, rng, self._registry, self._table, self._evict)
        self._puts = PutFlow(
            config, rng, cluster_key, term, self._registry, self._table, self._quarantine, self.counters,
            self._tiers.moves.by_key, self._drop_objects,
        )  # fmt: skip
        self.tombstones = Tombstones()
        self._mounts = MountFlow(self._registry, self._table, self._tiers, self.tombstones, self.counters,
                                 self._quarantine, config.put_release_timeout_ms)  # fmt: skip

    # --- gauges -------------------------------------------------------------------------

    @property
    def object_count(self) -> int:
        return len(self._table)

    @property
    def pending_count(self) -> int:
        return len(self._table.pending)

    def policy_stats(self) -> dict[str, int]:
        """The DRAM eviction policy's own figures (EvictionPolicy.stats), for /metrics."""
        return self._table.policy.stats()

    def segment_counters(self) -> list[SegmentCounters]:
        return [
            SegmentCounters(
                segment_id=seg.segment_id,
                node_id=seg.info.node_id,
                state=seg.status,
                capacity_bytes=seg.allocator.capacity_bytes,
                used_bytes=seg.allocator.used_bytes,
                free_bytes=seg.allocator.free_bytes,
                object_count=seg.object_count,
                quarantined_bytes=seg.quarantined_bytes,
                drop_bytes=seg.drop_bytes,
                free_extent_count=seg.allocator.free_extent_count,
                largest_free_bytes=seg.allocator.largest_free_bytes,
            )
            for seg in self._registry
        ]

    # --- node side ----------------------------------------------------------------------

    def mount_segment(self, msg: MountSegment, now_ms: int, local_ms: int | None = None) -> MountReply:
        """Mount a segment, or re-mount one (after a node or master restart) with its inventory.

        A known segment id from the same node with the same capacity and segment token is
        refreshed (liveness, info) and its inventory merged, so a node may also send a large
        inventory as several MountSegments. A different shm_token means the node made a new
        segment file: the old incarnation is unmounted first (its replicas are gone).
        Nothing is placed on the segment until its inventory's last part
        (MountSegment.is_last). Inventory entries become replicas of complete objects, allocated
        exactly where the node holds them; an entry that overlaps another range, lies outside the segment, disagrees
        on size or checksum with the object's other replicas, or was removed or evicted while
        the segment was away (tombstones.py) is returned in `rejected`.

        Raises:
            InvalidParams: malformed segment info, or too many segments.
            SegmentAlreadyExists: the id is mounted by another node or with another capacity.
            SegmentNotFound: a part after the first (MountSegment.is_first), the segment not
                mounting since one: its node mounts again from the first part.
        """
        heard_ms = now_ms if local_ms is None else local_ms  # liveness: the module docstring's Clocks
        info = msg.segment
        self._check_segment_info(info)
        segment = self._registry.get(info.segment_id)
        if segment is not None and (
            segment.state is SegmentState.LEAVING or MountFlow.is_new_incarnation(segment.info, info)
        ):
            # Leaving: its node came back; the sweep ends here, the inventory is the truth (as
            # it is for a restarted node's disk tier, a new incarnation).
            self._mounts.unmount(segment)
            segment = None
        if not msg.is_first and (segment is None or segment.has_whole_inventory):
            # The earlier parts reached an incarnation that went (timed out between parts): the
            # last part's is_whole would forget lost keys they showed, which its node holds.
            raise self._count_error(SegmentNotFound(f"segment {info.segment_id!r} is not mounting: "
                                                    "mount again from the first part"))  # fmt: skip
        if segment is not None:
            old = segment.info
            if old.node_id != info.node_id or old.capacity_bytes != info.capacity_bytes or old.tier != info.tier:
                raise self._count_error(
                    SegmentAlreadyExists(
                        f"segment {info.segment_id!r} is mounted by node {old.node_id!r} "
                        f"with {old.capacity_bytes} bytes"
                    )
                )
            if old.shm_token != info.shm_token:
                self._mounts.unmount(segment)
                segment = None
            else:
                self._registry.replace_info(segment, info)
                self._registry.set_reachable(segment, True)
                segment.last_seen_ms = heard_ms
        if segment is None:
            if self._registry.is_full():
                raise self._count_error(InvalidParams("too many segments mounted"))
            self._check_token_unique(info)
            segment = self._registry.add(info, OffsetAllocator(info.capacity_bytes), heard_ms)
            self._mounts.fence(segment, now_ms)  # before its inventory: writes granted before may land
        inventory, removed = self.tombstones.unearth(info.segment_id, msg.inventory, msg.is_last)
        if removed:
            self.counters.refused_returns += len(removed)
            log.info("segment %s (node %s) mounted again holding %d objects removed or evicted while it was away: "
                     "refused (its node drops them)", info.segment_id, info.node_id, len(removed))  # fmt: skip
        soft_pin_expiry_ms = max(1, now_ms + self.config.soft_pin_ttl_ms)
        rejected = removed + self._mounts.adopt(segment, inventory, soft_pin_expiry_ms)
        self._registry.set_inventory_whole(segment, msg.is_last)
        return MountReply(rejected, self.term, now_ms)

    def _check_token_unique(self, info: SegmentInfo) -> None:
        """Refuse a new segment whose file token another segment holds. Same-host clients map a
        segment's file by its path and check that token, so a second segment id naming another
        node's file (with a token copied from ClusterStatus) would have had puts placed in it
        by an allocator of its own, over that node's objects (helper-52: 32 of 200 destroyed).

        Raises:
            SegmentAlreadyExists: the token is another segment's.
        """
        if not info.shm_token or not info.shm_path:  # no file to map (TCP only, the simulator)
            return
        for other in self._registry:
            if (
                other.info.shm_token == info.shm_token
                and other.info.shm_path
                and other.info.segment_id != info.segment_id
            ):
                raise self._count_error(
                    SegmentAlreadyExists(
                        f"segment {info.segment_id!r} names the file of segment {other.info.segment_id!r} "
                        f"(node {other.info.node_id!r}): refused"
                    )
                )

    def filesystem_look_begins(self, segment_id: str) -> None:
        """The master begins a look at slower-tier `segment_id`'s free space (the DFS's), which
        a heartbeat brings: the moves that end there meanwhile are not counted twice."""
        segment = self._registry.get(segment_id)
        if segment is not None:
            self._tiers.look_begins(segment)

    def heartbeat(self, msg: Heartbeat, now_ms: int, local_ms: int | None = None) -> HeartbeatReply:
        """Refresh the liveness of the node's segments (on `local_ms`); unknown ids are returned
        (re-mount them)."""
        self._check_batch(msg.segment_ids)
        heard_ms = now_ms if local_ms is None else local_ms
        unknown: list[str] = []
        for segment_id in msg.segment_ids:
            segment = self._registry.get(segment_id)
            if segment is None or segment.state is SegmentState.LEAVING:
                unknown.append(segment_id)
            else:
                segment.last_seen_ms = heard_ms
                self._registry.set_reachable(segment, True)  # it speaks: its connection is back
                self.tombstones.settle(segment_id)
                report = msg.filesystems.get(segment_id)
                if report is not None and segment.tier != TIER_DRAM:
                    self._report_filesystem(segment, report, now_ms)
        return HeartbeatReply(unknown, now_ms)

    def hear(self, segment_ids: list[str], local_ms: int) -> None:
        """The node of these segments spoke (on `local_ms`): a part of a mount on their link.
        Liveness only: a heartbeat also says that its node read every mount reply (tombstones)."""
        for segment_id in segment_ids:
            segment = self._registry.get(segment_id)
            if segment is not None and segment.state is not SegmentState.LEAVING:
                segment.last_seen_ms = max(segment.last_seen_ms, local_ms)

    def _report_filesystem(self, segment: Segment, report: FilesystemReport, now_ms: int) -> None:
        """What a slower tier's filesystem can take, from its node's heartbeat (or the master's
        own look at the DFS): logged when the tier's room changes."""
        change = self._tiers.report_writable(segment, report.is_writable)
        if report.is_writable:
            self._report_free(segment, report.free_bytes, report.device, now_ms)
        if change is not None:
            log.log(logging.INFO if change else logging.WARNING,
                    "%s segment %s (node %s): its filesystem %s", segment.tier, segment.segment_id,
                    segment.info.node_id, "takes writes again" if change else
                    "takes no writes (read-only, its directory cannot be read, or it does not answer): objects "
                    "evicted from DRAM skip it, to the DFS or dropped; what it holds is read as before")  # fmt: skip

    def _report_free(self, segment: Segment, free_bytes: int, device: int, now_ms: int) -> None:
        """A slower tier's free filesystem space: logged when it starts or stops capping the
        tier's room."""
        change = self._tiers.report_free(segment, free_bytes, device, now_ms)
        if change is None:
            return
        room_bytes = min(segment.allocator.used_bytes + free_bytes, segment.allocator.capacity_bytes)
        then = "make room by evicting its oldest objects once it holds that much" if change else "use it all again"
        # A DFS's capacity is its filesystem's size unless given, so a share that holds other
        # files caps it from its first look on: said, not warned of, at every start.
        log.log(logging.WARNING if change and segment.tier != TIER_DFS else logging.INFO,
                "%s segment %s (node %s): its filesystem has %d bytes free, room for %d of its %d bytes; "
                "offloads there %s", segment.tier, segment.segment_id, segment.info.node_id, free_bytes, room_bytes,
                segment.allocator.capacity_bytes, then)  # fmt: skip

    def node_link_lost(self, segment_ids: list[str]) -> list[str]:
        """The master's connection to these segments' node closed. Until the node speaks
        again (a heartbeat on a new connection) or the node TTL drops it, nothing new is placed
        there (SegmentRegistry.set_reachable): puts go to the other segments at once instead
        of to a node that is probably dead, and eviction no longer counts on the room its
        unacknowledged drops would free. Reads of an object with a replica elsewhere still go
        to its replicas (a client finds out for itself, and moves on to the next replica); an
        object with no other replica reads as missing (exist_keys) and a put of it writes it
        anew (PutFlow.start). Returns the ids that changed."""
        changed = []
        for segment_id in segment_ids:
            segment = self._registry.get(segment_id)
            if segment is not None and self._registry.set_reachable(segment, False):
                changed.append(segment_id)
        return changed

    def unmount_segment(self, msg: UnmountSegment, now_ms: int) -> OkReply:
        """Unmount: replicas there vanish, objects left with none are removed; at once, or in
        steps for a segment with objects among many (sweep_step, mounts.py).

        Raises:
            SegmentNotFound: the id is not mounted.
        """
        segment = self._segment_or_raise(msg.segment_id)
        log.info("segment %s unmounted by its node (%d objects%s)", msg.segment_id, segment.object_count,
                 ", kept for its restart" if msg.is_kept else "")  # fmt: skip
        # A DRAM segment's file goes with its node, unless the node keeps it for its restart:
        # then what it held is left behind for its return (mounts.py, tombstones.py).
        segment.is_kept = msg.is_kept  # its objects are not counted lost then: they come back
        self._mounts.leave(segment, for_good=segment.tier == TIER_DRAM and not msg.is_kept)
        return OkReply()

    @property
    def is_sweeping(self) -> bool:
        """A segment is leaving: sweep_step has work (the server runs it between requests)."""
        return self._mounts.is_sweeping

    def sweep_step(self) -> bool:
        """Take away the replicas of a slice of the table's keys on the first leaving segment
        (unmounting it after the last slice). True while steps remain."""
        return self._mounts.sweep_step()

    def drain_segment(self, msg: DrainSegment, now_ms: int, local_ms: int | None = None) -> OkReply:
        """Stop allocating on a segment; it serves reads until now + timeout_ms (on `local_ms`),
        then tick() unmounts it. Draining again moves the deadline.

        Raises:
            SegmentNotFound: the id is not mounted.
            InvalidParams: a negative timeout.
        """
        segment = self._segment_or_raise(msg.segment_id)
        if segment.state is SegmentState.LEAVING:
            raise self._count_error(SegmentNotFound(f"segment {msg.segment_id!r} is being unmounted"))
        if type(msg.timeout_ms) is not int or msg.timeout_ms < 0:
            raise self._count_error(InvalidParams(f"drain timeout_ms {msg.timeout_ms!r}"))
        self._registry.set_draining(segment, (now_ms if local_ms is None else local_ms) + msg.timeout_ms)
        segment.is_kept = msg.is_kept
        return OkReply()

    # --- client side: puts --------------------------------------------------------------

    def put_start(self, msg: PutStart, now_ms: int, evict: bool = True) -> PutStartReply:
        """Allocate replicas for each key and grant the writes.

        Per key: OK with one grant per replica (1..replica_num, on distinct active segments,
        each signed until now + put_discard_timeout_ms); OBJECT_ALREADY_EXISTS (complete:
        nothing to write; but a key none of whose replicas can be read, their node's connection
        lost, is written anew and its old object dropped: PutFlow.start); REPLICA_IS_NOT_READY
        (another put of it is in flight, or a move of the object it named before a remove is
        still running: docs/tiers.md); INVALID_KEY / INVALID_PARAMS; NO_AVAILABLE_HANDLE. When
        a key finds no room, least recently used objects are evicted into the drop outbox; their
        ranges are free only after drops_done, so the server flushes the drops and retries those
        keys. Without `evict`, keys that find no room evict nothing (a retry given room that
        landed, between rounds).

        Raises:
            InvalidParams: keys and sizes differ in length, too many keys, bad replica config
                (nothing is allocated).
        """
        self._check_batch(msg.keys)
        if len(msg.sizes) != len(msg.keys):
            raise self._count_error(InvalidParams(f"{len(msg.keys)} keys but {len(msg.sizes)} sizes"))
        self._check_replicate_config(msg.config)
        reply, shortfall_bytes = self._puts.start(
            msg.keys, msg.sizes, msg.config, msg.client_hostname, now_ms, msg.put_id
        )
        if shortfall_bytes and evict and now_ms >= self._evict_for_room_after_ms:
            # Each put waiting for room claims its shortfall of the drops in flight, so the next
            # one evicts for its own instead of counting on the same room (concurrent putters
            # into a full cache lost 2-8% of their puts). Room that landed is no one's any
            # more: the claims shrink with the drops in flight.
            active = self._registry.active
            claimed_bytes = min(self._room_claimed_bytes, drop_bytes_in_flight(active))
            hole_bytes = max(
                footprint_bytes(size)
                for size, code in zip(msg.sizes, reply.codes)
                if code == codes.NO_AVAILABLE_HANDLE and self.fits_a_segment(size)
            )
            victims, back_off = select_for_room(
                self._table.policy, active, shortfall_bytes, now_ms, claimed_bytes, hole_bytes
            )
            self._room_claimed_bytes = claimed_bytes + shortfall_bytes
            self._tiers.demote_all(victims, TIER_DRAM, now_ms)
            # Only a long scan that found too little waits: victims whose offload could not
            # start yet (the slower tier is dropping to take them, or the node's move budget
            # is spent) are tried again by the put's next round (server.py), which must not
            # find eviction backed off.
            if back_off:
                self._evict_for_room_after_ms = now_ms + EVICT_SHORTFALL_BACKOFF_MS
        return reply

    def put_start_again(
        self, msg: PutStart, reply: PutStartReply, retry: list[int], now_ms: int, evict: bool = True
    ) -> list[int]:
        """put_start of the keys of `msg` at `retry` (indexes of keys that found no room in
        `reply`), folded into `reply`; returns the indexes of those still without room.

        A put short of room is tried in rounds as room comes (the server, the simulation);
        the caller ends them with put_start_settled. Without `evict` the keys take room that
        landed, if any, and evict nothing (the server gives landed room to the puts waiting
        for it before any other request can take it). Each call with `evict` counts as a round
        waited (room_round_waited counts one without a call)."""
        if evict:
            self.counters.put_room_rounds += 1
        again = self.put_start(
            PutStart(
                [msg.keys[i] for i in retry], [msg.sizes[i] for i in retry], msg.config, msg.client_hostname,
                msg.put_id,
            ),
            now_ms,
            evict,
        )
        merge_retried(reply, again, retry)
        return [i for i in retry if reply.codes[i] == codes.NO_AVAILABLE_HANDLE]

    def fits_a_segment(self, size_bytes: int) -> bool:
        """Whether an object of this size fits in some segment that takes puts, empty: one that
        fits in none is refused at once (NO_AVAILABLE_HANDLE), without evicting anything."""
        return footprint_bytes(size_bytes) <= self._registry.capacity_max

    def room_round_waited(self) -> None:
        """A put waited a round for room, and room that landed meanwhile was enough for it."""
        self.counters.put_room_rounds += 1

    def evict_back_off_left_ms(self, now_ms: int) -> int:
        """How long puts short of room do not scan for victims (a long scan found too few)."""
        return max(0, self._evict_for_room_after_ms - now_ms)

    def forget_room_claims(self) -> None:
        """No put waits for room any more: the room they claimed of the drops in flight is no
        one's (else the next put short of room evicts its whole shortfall again, not counting
        drops a remove or the watermark scheduled)."""
        self._room_claimed_bytes = 0

    def put_start_settled(self, reply: PutStartReply) -> PutStartReply:
        """The last round of a put_start is over: its keys still without room count as errors
        (a key a later round stores is none, and a Prometheus counter never goes back)."""
        self.counters.errors += reply.codes.count(codes.NO_AVAILABLE_HANDLE)
        return reply

    def set_cluster_key(self, cluster_key: bytes | None) -> None:
        """Sign later puts' grants with this key: the cluster's token rotated (auth.Keyring);
        grants given already stay valid where the nodes accept the old key too."""
        self._puts.cluster_key = cluster_key

    def put_end(self, msg: PutEnd, now_ms: int) -> PendingCommit:
        """End the writes of each key: decide what can be decided, and list the commits.

        Per key, decided now: OBJECT_NOT_FOUND (no put in flight: never started, revoked or
        discarded), OBJECT_ALREADY_EXISTS (complete already), REPLICA_IS_NOT_READY (its
        put_end is already being committed), INVALID_PARAMS (bad checksum, or the checksum
        list does not match the keys, or `unwritten` names a key index out of range),
        TRANSFER_FAIL (every replica's segment is gone, or `unwritten` names them all). The
        other keys go into `commits` and get their code from finish_put_end; until then they
        are neither visible nor discardable.

        Raises:
            InvalidParams: too many keys.
        """
        self._check_batch(msg.keys)
        return self._puts.end(msg.keys, msg.checksums, msg.put_id, msg.unwritten)

    def finish_put_end(
        self, pending: PendingCommit, results: dict[str, list[int]], now_ms: int
    ) -> CodesReply:
        """Apply the nodes' answers to a put_end's commits and make the objects visible.

        Args:
            pending: what put_end returned; finish it exactly once.
            results: per segment id of `pending.commits`, the node's code for each entry in
                order. A missing segment (no answer) or a list of the wrong length counts as
                TRANSFER_FAIL for all of its entries, whose ranges are then dropped from the
                node before reuse (it may have recorded them); a refused entry's range is
                free at once.

        Returns:
            One code per key of the PutEnd: OK when at least one replica committed (the
            others' ranges are freed: they never entered a node's inventory), TRANSFER_FAIL
            when none did (the key is free again), or the code put_end decided.
        """
        return self._puts.finish(pending, results, now_ms)

    def settle_put_end(self, pending: PendingCommit, results: dict[str, list[int]]) -> CodesReply:
        """finish_put_end in two steps, so that the server can answer between them: this one
        applies the nodes' codes and returns the reply; `publish_put_end` must follow before
        any other call (the server runs it right after writing the reply, in the same step of
        the loop, so no request sees the objects missing after the writer was answered)."""
        return self._puts.settle(pending, results)

    def publish_put_end(self, pending: PendingCommit, now_ms: int) -> None:
        """The second step of finish_put_end: make the settled objects visible."""
        self._puts.publish(pending, now_ms)

    def refuse_commits(self, segment_id: str, entries: list[InventoryEntry], now_ms: int) -> tuple[int, int]:
        """A node refused these commits after their put was answered (the server answers once
        the commits are on their way, master/server.py): its bytes do not hash to the writer's
        checksum (a buffer changed during its send; a write that broke off mid-frame is named
        by its writer in PutEnd.unwritten and never committed). Each such
        replica goes; its object keeps the others, which their own nodes verify at their
        commits (or the writer hashed where they landed). Until 2026-12-07 the whole object
        went: a replicated put lost its good copies when a node that froze during it woke.
        Returns (replicas dropped, objects left with none and dropped)."""
        replicas, objects = self._drop_replicas(segment_id, entries)
        self.counters.errors += replicas
        return replicas, objects

    def drop_bad_replicas(self, segment_id: str, entries: list[InventoryEntry], now_ms: int) -> tuple[int, int]:
        """A node confirmed that these replicas no longer hash to their object's checksum (a
        reader found them bad: a bit flip, a stale writer). Returns (replicas dropped, objects
        dropped), as refuse_commits."""
        replicas, objects = self._drop_replicas(segment_id, entries)
        self.counters.bad_replicas += replicas
        self.counters.errors += replicas
        return replicas, objects

    def _drop_replicas(self, segment_id: str, entries: list[InventoryEntry]) -> tuple[int, int]:
        """Each entry's replica that is still there goes, and its object keeps its other
        replicas, each checked on its own (at its commit, and on every read); an object left
        with none (or in the middle of a move) goes whole. Returns (replicas, objects) dropped."""
        replicas = objects = 0
        for segment, entry, meta in self._replicas_still_at(segment_id, entries):
            if len(meta.replica_tuple()) > 1 and not self._tiers.is_moving(entry.key):
                self._tiers.drop_replicas(entry.key, meta, [(segment, entry.offset)])
            else:
                self._drop_object(entry.key)
                objects += 1
            replicas += 1
        return replicas, objects

    def _replicas_still_at(
        self, segment_id: str, entries: list[InventoryEntry]
    ) -> Iterator[tuple[Segment, InventoryEntry, ObjectMeta]]:
        """(segment, entry, object) for each entry whose object still has a replica at that
        offset of that segment, looked up as the caller goes (not removed or moved meanwhile:
        a removed object's drop is on its way already), and is still the object checked (its
        size and checksum: a key removed and put again, placed at that very offset while the
        check ran, had its new replica dropped for the old one's bad bytes)."""
        segment = self._registry.get(segment_id)
        if segment is None:
            return
        for entry in entries:
            meta = self._table.get(entry.key)
            if (
                meta is not None
                and meta.offset_on(segment.index) == entry.offset
                and (meta.size_bytes, meta.checksum) == (entry.size, entry.checksum)
            ):
                yield segment, entry, meta

    def suspect_replicas(self, msg: ReportBadReplicas, now_ms: int) -> dict[str, list[InventoryEntry]]:
        """The reported replicas that still are what a reader read (the object has a replica at
        that offset of that segment), by segment id, as the entries to hash again where they
        are (the master's size and checksum). O(keys). Nothing changes until a check agrees.

        Raises:
            InvalidParams: too many keys, or lists of different lengths.
        """
        self._check_batch(msg.keys)
        if not len(msg.keys) == len(msg.segment_ids) == len(msg.offsets):
            raise self._count_error(InvalidParams("keys, segment_ids and offsets differ in length"))
        suspects: dict[str, list[InventoryEntry]] = {}
        seen: set[tuple[str, str]] = set()
        for key, segment_id, offset in zip(msg.keys, msg.segment_ids, msg.offsets):
            segment = self._registry.get(segment_id) if type(segment_id) is str else None
            meta = self._table.get(key) if is_valid_key(key) else None
            if segment is None or meta is None or (key, segment_id) in seen:
                continue
            if type(offset) is int and meta.offset_on(segment.index) == offset:
                seen.add((key, segment_id))
                suspects.setdefault(segment_id, []).append(
                    InventoryEntry(key, offset, meta.size_bytes, meta.checksum)
                )
        return suspects

    def put_revoke(self, msg: PutRevoke, now_ms: int) -> CodesReply:
        """The writer gave up: the keys are free at once, and so are their ranges when it says
        no write of its may still land (else they are quarantined until the nodes take no more
        of its writes: PutRevoke.writes_in_flight, puts.revoke).

        Per key: OK; OBJECT_NOT_FOUND (no put in flight); OBJECT_ALREADY_EXISTS (complete:
        use remove); REPLICA_IS_NOT_READY (its put_end is being committed).

        Raises:
            InvalidParams: too many keys.
        """
        self._check_batch(msg.keys)
        return self._puts.revoke(msg.keys, msg.writes_in_flight, msg.put_id)

    # --- client side: reads -------------------------------------------------------------

    def get_replica_list(self, msg: GetReplicaList, now_ms: int) -> GetReplicaListReply:
        """Where each object's replicas are, under a read lease of `lease_ttl_ms`.

        Per key: OK (lease extended to max(old, now + lease_ttl_ms), last access updated);
        REPLICA_IS_NOT_READY (a put is in flight); OBJECT_NOT_FOUND, also for an object none
        of whose replicas can be read (as exist_keys: no lease, no access). Replicas on a
        draining segment are listed: they stay readable until the drain deadline.

        Raises:
            InvalidParams: too many keys.
        """
        keys = msg.keys
        self._check_batch(keys)
        table = self._table
        objects, lower, pending = table.objects, table.lower, table.pending
        by_index = self._registry.by_index
        in_dram, in_lower = objects.get, lower.get
        is_every_segment_readable = not self._registry.has_unreadable
        if not is_every_segment_readable:
            in_dram, in_lower = self._readable_only(in_dram), self._readable_only(in_lower)
        tier_of_nearest = self._tiers.tier_of_nearest
        access = table.access
        lease_ttl_ms, soft_pin_ttl_ms = self.config.lease_ttl_ms, self.config.soft_pin_ttl_ms
        if not self._first_lease_ms:
            self._first_lease_ms = now_ms
        codes_out: list[int] = []
        sizes: list[int] = []
        checksums: list[int] = []
        replica_lists: list[list[Replica]] = []
        infos: dict[str, SegmentInfo] = {}
        hits = 0
        accessed: list[tuple[str, ObjectMeta]] = []  # touched once the batch is read (its order)
        tier_counters = self._tiers.counters
        dram_hits = 0
        for key in keys:
            meta = in_dram(key)
            if meta is not None:
                if is_every_segment_readable:
                    dram_hits += 1
                else:  # its DRAM replicas may all be on lost nodes: served from a slower tier then
                    tier_counters[tier_of_nearest(meta)].hits += 1
            else:
                meta = in_lower(key)
                if meta is None:
                    codes_out.append(codes.REPLICA_IS_NOT_READY if key in pending else codes.OBJECT_NOT_FOUND)
                    sizes.append(0)
                    checksums.append(0)
                    replica_lists.append([])
                    continue
                # Not in DRAM: served from a slower tier, and counted towards a promotion.
                tier_counters[tier_of_nearest(meta)].hits += 1
                self._tiers.count_read(key, now_ms)
            hits += 1
            accessed.append((key, meta))
            packed = meta.replicas
            if type(packed) is int:  # one replica: the common case
                info = by_index(replica_segment_index(packed)).info
                infos[info.segment_id] = info
                replicas = [Replica(info.segment_id, replica_offset(packed))]
            else:
                replicas = []
                for one in packed:
                    info = by_index(replica_segment_index(one)).info
                    infos[info.segment_id] = info
                    replicas.append(Replica(info.segment_id, replica_offset(one)))
            codes_out.append(codes.OK)
            sizes.append(meta.size_bytes)
            checksums.append(meta.checksum)
            replica_lists.append(replicas)
        if table.policy.enters_batches_last_key_first:
            accessed.reverse()
        for key, meta in accessed:
            access(key, meta, now_ms, lease_ttl_ms, soft_pin_ttl_ms)
        self.counters.gets += len(keys)
        self.counters.hits += hits
        self.counters.misses += len(keys) - hits
        tier_counters[TIER_DRAM].hits += dram_hits
        return GetReplicaListReply(codes_out, sizes, checksums, replica_lists, lease_ttl_ms, infos, now_ms)

    def release_leases(self, msg: ReleaseLeases, now_ms: int) -> OkReply:
        """Readers give back the leases granted at `msg.granted_ms[i]` on the `msg.counts[i]`
        keys that follow in `msg.keys` (InvalidParams if the counts do not add up): each
        object's count of readers drops by one, and its lease ends with the last, unless a
        lookup's hold still awaits reads (LongestPrefix.hold_reads).

        A lease that lapsed before its release came is ignored: its reader no longer counted
        (a later read started a new count), and giving it back would end the lease of a reader
        still copying. While a reader's lease runs the object's lease has not lapsed (it is the
        latest expiry of all), so its count still holds that reader. So is a lease granted
        before this service's first (by an earlier master). A release names keys, not versions:
        one for a key removed and put again within the TTL counts against the new object's
        readers, who then risk a miss (bytes are checked), never wrong bytes.
        """
        counts, keys = msg.counts, msg.keys
        if len(counts) != len(msg.granted_ms) or min(counts, default=0) < 0 or sum(counts) != len(keys):
            raise self._count_error(
                InvalidParams(f"ReleaseLeases of {len(keys)} keys: {len(counts)} counts (none negative, their sum "
                              f"the keys) for {len(msg.granted_ms)} grant times")  # fmt: skip
            )
        lease_ttl_ms = self.config.lease_ttl_ms
        in_dram, in_lower = self._table.objects.get, self._table.lower.get
        released = 0
        end = 0
        for granted_ms, count in zip(msg.granted_ms, counts):
            start, end = end, end + count
            if not self._first_lease_ms <= granted_ms <= now_ms or granted_ms + lease_ttl_ms <= now_ms:
                continue  # not this master's, lapsed, or from a clock that stepped back
            for key in keys[start:end]:
                meta = in_dram(key) or in_lower(key)  # (an ObjectMeta is always true)
                if meta is None or meta.readers <= 0 or meta.lease_expiry_ms <= now_ms:
                    continue
                meta.readers -= 1  # (inline: a get's release comes for every key it read)
                if not meta.readers and not meta.held_reads:
                    meta.lease_expiry_ms = 0
                    released += 1
        self.counters.leases_released += released
        return OkReply()

    def exist_keys(self, msg: ExistKeys, now_ms: int) -> ExistsReply:
        """Whether each key is a complete object that can be read. Grants no lease and is not
        an access, so existence checks can never keep objects from eviction.

        An object none of whose replicas can be read (Segment.is_readable: every one on a node
        whose connection is lost, until the node TTL drops it, or on a leaving segment) is
        answered missing, here and by every lookup (longest_prefix, query_objects,
        get_replica_list): an engine that checks before it saves would otherwise skip the put
        that writes it anew (PutFlow.start), and miss on every get until the TTL.

        Raises:
            InvalidParams: too many keys.
        """
        self._check_batch(msg.keys)
        table = self._table
        objects, lower = table.objects, table.lower
        # The common case looks at no replica: 128 keys took 3.6 us, and 35 when each looked.
        if not self._registry.has_unreadable:
            return ExistsReply([key in objects or key in lower for key in msg.keys])
        find = self._readable_only(table.get)
        return ExistsReply([find(key) is not None for key in msg.keys])

    def longest_prefix(self, msg: LongestPrefix, now_ms: int) -> CountReply:
        """The number of leading keys that are complete objects that can be read (as
        exist_keys answers). Not an access (eviction order is untouched). With msg.hold_ms,
        those objects are held (LongestPrefix): their lease runs at least min(hold_ms,
        lease_ttl_ms) from now, with no reader counted, and awaits msg.hold_reads reads: the
        release that leaves no reader and no read awaited ends the hold too (the load read
        what was held).

        Raises:
            InvalidParams: too many keys, a negative hold, or hold_reads outside 1..LOOKUP_HOLD_READS_MAX.
        """
        self._check_batch(msg.keys)
        if msg.hold_ms < 0:
            raise self._count_error(InvalidParams(f"hold_ms must be >= 0, not {msg.hold_ms}"))
        if not 1 <= msg.hold_reads <= limits.LOOKUP_HOLD_READS_MAX:
            raise self._count_error(
                InvalidParams(f"hold_reads must be in 1..{limits.LOOKUP_HOLD_READS_MAX}, not {msg.hold_reads}")
            )
        in_dram, in_lower = self._table.objects.get, self._table.lower.get
        if self._registry.has_unreadable:
            in_dram, in_lower = self._readable_only(in_dram), self._readable_only(in_lower)
        found: list[ObjectMeta] = []
        for key in msg.keys:
            meta = in_dram(key) or in_lower(key)  # (an ObjectMeta is always true)
            if meta is None:
                break
            found.append(meta)
        if msg.hold_ms:
            held_until_ms = now_ms + min(msg.hold_ms, self.config.lease_ttl_ms)
            for meta in found:
                meta.hold_for_reads(now_ms, held_until_ms, msg.hold_reads)
            self.counters.lookup_holds += len(found)
        return CountReply(len(found))

    def query_objects(self, msg: QueryObjects, now_ms: int) -> QueryReply:
        """Size and replicas of each key, without a lease and without counting as an access.
        OBJECT_NOT_FOUND for an object none of whose replicas can be read (as exist_keys).

        Raises:
            InvalidParams: too many keys.
        """
        self._check_batch(msg.keys)
        table = self._table
        find = self._readable_only(table.get) if self._registry.has_unreadable else table.get
        codes_out: list[int] = []
        sizes: list[int] = []
        replica_lists: list[list[Replica]] = []
        for key in msg.keys:
            meta = find(key)
            if meta is None:
                codes_out.append(
                    codes.REPLICA_IS_NOT_READY if key in table.pending else codes.OBJECT_NOT_FOUND
                )
                sizes.append(0)
                replica_lists.append([])
                continue
            codes_out.append(codes.OK)
            sizes.append(meta.size_bytes)
            replica_lists.append(self._replicas_of(meta))
        return QueryReply(codes_out, sizes, replica_lists)

    def list_objects(self, msg: ListObjects, now_ms: int) -> ListReply:
        """Complete objects that can be read (as exist_keys answers) whose key matches `pattern`
        (RE2 search; "" matches all), at most `limit` and LIST_OBJECTS_KEY_BYTES_MAX of keys (a
        reply frame's worth), in eviction order (least recently accessed first under LRU). O(n).

        Raises:
            InvalidParams: a bad pattern, or a limit outside 1..LIST_OBJECTS_MAX.
        """
        if type(msg.limit) is not int or not 0 < msg.limit <= limits.LIST_OBJECTS_MAX:
            raise self._count_error(
                InvalidParams(f"list limit {msg.limit!r} not in 1..{limits.LIST_OBJECTS_MAX}")
            )
        search = self._compile(msg.pattern).search if msg.pattern else None
        keys: list[str] = []
        sizes: list[int] = []
        truncated = False
        room_bytes = limits.LIST_OBJECTS_KEY_BYTES_MAX
        is_readable = self._registry.has_readable_replica if self._registry.has_unreadable else None
        for key, meta in self._table.items():
            if search is not None and search(key) is None:
                continue
            if is_readable is not None and not is_readable(meta):
                continue
            room_bytes -= len(key.encode())
            if len(keys) == msg.limit or room_bytes < 0:
                truncated = True
                break
            keys.append(key)
            sizes.append(meta.size_bytes)
        return ListReply(keys, sizes, truncated)

    def cluster_status(self, msg: ClusterStatus, now_ms: int) -> ClusterStatusReply:
        statuses = [
            SegmentStatus(
                seg.info, seg.status, seg.allocator.used_bytes, seg.object_count, *self._tiers.filesystem_of(seg)
            )
            for seg in self._registry
        ]
        return ClusterStatusReply(
            statuses, len(self._table), len(self._table.pending), self.counters.evictions,
            self._tier_statuses(), self.config.evict_watermark_ratio_high,
        )

    # --- client side: removes -----------------------------------------------------------

    def remove(self, msg: Remove, now_ms: int) -> CodesReply:
        """Remove objects; their replicas go to the drop outbox (ranges freed at drops_done).

        Per key: OK; OBJECT_HAS_LEASE (a reader holds a lease; `force` overrides; an object
        none of whose replicas can be read goes all the same, as a put writes it anew: it is
        missing to every lookup, exist_keys);
        OBJECT_NOT_FOUND; REPLICA_IS_NOT_READY (a put is in flight; with `force` a writing put
        is discarded: the key is free at once, its ranges are quarantined like a zombie's
        because the writer may still be writing; a committing put is never removed).

        Raises:
            InvalidParams: too many keys.
        """
        self._check_batch(msg.keys)
        table = self._table
        codes_out: list[int] = []
        absent: list[str] = []  # removed without an object here: a node away may hold one
        spares_leased = self._spares_leased(msg.force, now_ms)
        for key in msg.keys:
            meta = table.get(key)
            if meta is not None:
                if spares_leased(meta):
                    codes_out.append(codes.OBJECT_HAS_LEASE)
                    continue
                self._drop_object(key)
                self.counters.removes += 1
                codes_out.append(codes.OK)
                continue
            put = table.pending.get(key)
            if put is None:
                codes_out.append(codes.OBJECT_NOT_FOUND)
                absent.append(key)
            elif put.is_committing or not msg.force:
                codes_out.append(codes.REPLICA_IS_NOT_READY)
            else:
                self._puts.discard(key, put)
                codes_out.append(codes.OK)
                absent.append(key)
        if absent:
            self.tombstones.gone(absent)  # an object lost with a segment that went: not to come back
        return CodesReply(codes_out)

    def remove_by_regex(self, msg: RemoveByRegex, now_ms: int) -> CountReply:
        """Remove every complete object whose key matches (RE2 search, as Mooncake's
        std::regex_search), skipping leased ones unless `force`. O(n).

        Raises:
            InvalidParams: the pattern is too long or does not compile.
        """
        return CountReply(self.removal(msg).run(now_ms))

    def remove_all(self, msg: RemoveAll, now_ms: int) -> CountReply:
        """Remove every complete object, skipping leased ones unless `force`. O(n)."""
        return CountReply(self.removal(msg).run(now_ms))

    def removal(self, msg: RemoveAll | RemoveByRegex) -> Removal:
        """remove_all or remove_by_regex in steps (Removal.step), so that a server answers other
        requests between them: in one go, 400,000 objects held every other request for 0.7 s.

        Raises:
            InvalidParams: the pattern is too long or does not compile.
        """
        search = self._compile(msg.pattern).search if isinstance(msg, RemoveByRegex) else None
        table = self._table
        # And the keys lost with segments that went (mounts.py): their nodes may come back with
        # them. As they are, O(lost keys) copied: a step tells those put again from the others.
        return Removal(self, [*table.objects, *table.lower, *self.tombstones.lost_keys()], search, msg.force)

    # --- time ---------------------------------------------------------------------------

    def excuse_stall(self, stalled_ms: int) -> None:
        """The master itself did not run for `stalled_ms` (a long request, a pause of its
        process): no node could be heard meanwhile, so that silence does not count toward
        their TTL (a stall longer than the TTL dropped every node, and their objects)."""
        for segment in self._registry:
            segment.last_seen_ms += stalled_ms

    def tick(self, now_ms: int) -> None:
        """Housekeeping, every 100-500 ms: unmount segments of silent nodes and finished drains
        (expire_segments, unless the service has a `local_clock`), discard zombie puts, release
        quarantined ranges, expire soft pins, evict above the high watermark.
        O(s + expired + eviction scan)."""
        if not self._local_clock:
            self.expire_segments(now_ms)
        self._puts.discard_zombies(now_ms)
        self._quarantine.release_due(now_ms)
        self.tombstones.expire(now_ms)
        self._mounts.forget_fences(now_ms)
        self._table.expire_soft_pins(now_ms)
        self._evict_above_watermark(now_ms)
        self._tiers.evict_above_watermark(now_ms)
        self._tiers.promote_due(now_ms)

    def expire_segments(self, local_ms: int) -> None:
        """Unmount the segments of nodes silent for the node TTL and those of finished drains,
        both on `local_ms` (the module docstring's Clocks). O(s)."""
        config = self.config
        for segment in self._registry:
            if segment.state is SegmentState.LEAVING:
                continue
            if segment.last_seen_ms + config.node_ttl_ms <= local_ms:
                log.warning(
                    "segment %s of node %s at %s silent for %d ms (node TTL %d ms): unmounted, with its "
                    "replicas of %d objects", segment.info.segment_id, segment.info.node_id, segment.info.endpoint,
                    local_ms - segment.last_seen_ms, config.node_ttl_ms, segment.object_count,
                )  # fmt: skip
                self._mounts.leave(segment)
            elif segment.state is SegmentState.DRAINING and segment.drain_deadline_ms <= local_ms:
                log.info("segment %s: drain over, unmounted (%d objects)", segment.info.segment_id,
                         segment.object_count)  # fmt: skip
                # (its node is stopping: a DRAM segment's file goes with it, unless kept)
                self._mounts.leave(segment, for_good=segment.tier == TIER_DRAM and not segment.is_kept)

    # --- tiers: moves outbox (docs/tiers.md) ---------------------------------------------

    def take_moves(self) -> dict[str, list[MoveItem]]:
        """Per segment id (whose node runs them), the moves started since the last call:
        offloads (eviction), promotions (tick). Send each list as MoveObjects on that segment's
        node connection, then pass the codes to finish_moves. A move whose object went before
        it was sent ends here instead. O(moves taken)."""
        return self._tiers.take_unsent()

    def has_unsent_moves(self) -> bool:
        return self._tiers.moves.has_unsent()

    def moves_in_flight(self) -> int:
        return len(self._tiers.moves)

    def start_copies(self, pending: PendingCommit, reply: CodesReply, now_ms: int) -> dict[str, list[MoveItem]]:
        """After finish_put_end: the write-through copies its puts asked for
        (with_disk_copy, with_dfs_copy), per segment id of the node that copies them. The put's
        reply waits for them (finish_moves) but does not depend on them: an object whose copy
        failed is still stored."""
        moves: list[Move] = []
        for index in pending.awaiting:
            key = pending.keys[index]
            copy_tiers = pending.puts[key].copy_tiers
            if copy_tiers and reply.codes[index] == codes.OK:
                move = self._tiers.start_copy(key, copy_tiers, now_ms)
                if move is not None:
                    moves.append(move)
        return self._tiers.moves.take(moves) if moves else {}

    def finish_moves(
        self, segment_id: str, items: list[MoveItem], results: list[int] | None, now_ms: int
    ) -> None:
        """The node's codes for the items sent to `segment_id`, or None when the request got
        no answer (or a broken one). A successful offload drops the replicas it replaced
        (unless a reader holds a lease), a promotion or copy adds a replica; a failed one
        frees its target, at once when the node answered, else once the node dropped it (it
        may have recorded the copy). Items already finished or unknown are ignored."""
        if results is not None and len(results) != len(items):
            results = None
        self._tiers.finish(items, results, now_ms)
        for segment, room_bytes in self._tiers.newly_full.values():
            log.warning(
                "%s segment %s (node %s): its filesystem is full with %d of its %d bytes held; moves "
                "there now make room by evicting its oldest objects (for %d s, then it is tried again)",
                segment.tier, segment.segment_id, segment.info.node_id, room_bytes,
                segment.allocator.capacity_bytes, FULL_TIER_RETRY_MS // 1000,
            )  # fmt: skip
        self._tiers.newly_full.clear()

    def _tier_statuses(self) -> list[TierStatus]:
        statuses = {tier: TierStatus(tier) for tier in TIERS}
        for segment in self._registry:
            status = statuses.get(segment.tier)
            if status is None:
                continue
            status.capacity_bytes += segment.allocator.capacity_bytes
            status.used_bytes += segment.allocator.used_bytes
            status.object_count += segment.object_count
        for tier, counters in self._tiers.counters.items():
            status = statuses[tier]
            status.hits = counters.hits
            status.offloads = counters.offloads
            status.promotions = counters.promotions
            status.evictions = counters.evictions
            status.failed_moves = counters.failed_moves
            status.copies = counters.copies
        return list(statuses.values())

    # --- drops outbox -------------------------------------------------------------------

    def take_drops(self) -> dict[str, list[InventoryEntry]]:
        """Per segment id, the objects its node must forget (send as DropObjects). Their
        ranges stay allocated until drops_done. O(s)."""
        return {seg.segment_id: seg.take_drops() for seg in self._registry if seg.drops_unsent}

    def drops_done(self, segment_id: str, entries: list[InventoryEntry], now_ms: int) -> None:
        """The node forgot these entries: free their ranges. Entries not sent or already acked
        are ignored; so is a segment unmounted meanwhile (its ranges went with it)."""
        segment = self._registry.get(segment_id)
        if segment is None:
            return
        segment.finish_drops(entries)

    def drops_due(self, segment_id: str, entries: list[InventoryEntry]) -> list[InventoryEntry]:
        """Of drops taken for `segment_id` (take_drops), those the segment mounted under that
        id now still waits on: the others went with an earlier incarnation (as tombstones),
        and sent to this one they could make its node forget an object put there since."""
        segment = self._registry.get(segment_id)
        if segment is None:
            return []
        sent = segment.drops_sent
        return [entry for entry in entries if sent.get(entry.offset) is entry]

    def first_dropping(self, segment_id: str, entries: list[InventoryEntry], start: int = 0) -> int:
        """The index of the first of these drops (taken by take_drops), from `start` on, that
        still waits for its node's acknowledgement on the segment mounted under that id;
        len(entries) when none does. An acknowledged drop never waits again, so a caller that
        asks as acknowledgements come resumes where it stopped: a linear scan in all, not one
        per acknowledgement (a remove_all of 400,000 objects took the master 1.9 s of CPU)."""
        segment = self._registry.get(segment_id)
        if segment is not None:
            sent = segment.drops_sent
            for index in range(start, len(entries)):
                if sent.get(entries[index].offset) is entries[index]:
                    return index
        return len(entries)

    def has_segment(self, segment_id: str) -> bool:
        return self._registry.get(segment_id) is not None

    def has_pending_drops(self) -> bool:
        """True when take_drops() has something to send."""
        return any(seg.drops_unsent for seg in self._registry)

    # --- invariants ---------------------------------------------------------------------

    def check_invariants(self) -> None:
        """O(n log n): every segment is tiled exactly by object replicas, pending-put ranges,
        quarantined ranges, drops and free extents; counts and indexes agree."""
        registry, table = self._registry, self._table
        registry.check_invariants()
        table.check_invariants()
        ranges: dict[int, list[tuple[int, int]]] = {seg.index: [] for seg in registry}
        object_counts: dict[int, int] = {seg.index: 0 for seg in registry}
        for key, meta in table.items():
            for packed in meta.replica_tuple():
                index = replica_segment_index(packed)
                assert index in ranges, f"{key!r} has a replica on unmounted segment #{index}"
                ranges[index].append((replica_offset(packed), meta.size_bytes))
                object_counts[index] += 1
        for segment, offset, size_bytes, _ in self._tiers.iter_held_ranges():
            ranges[segment.index].append((offset, size_bytes))
        for key, put in table.pending.items():
            segment_ids = [seg.segment_id for seg, _ in put.replicas]
            assert len(set(segment_ids)) == len(segment_ids), f"{key!r}: two replicas on one segment"
            for segment, offset in put.replicas:
                assert registry.get(segment.segment_id) is segment, f"{key!r} pending on dead {segment}"
                ranges[segment.index].append((offset, put.size_bytes))
        for segment in registry:
            assert segment.object_count == object_counts[segment.index], segment
            segment.check_invariants(ranges[segment.index])
        self._quarantine.check_invariants(registry)
        self.tombstones.check_invariants()
        self._tiers.check_invariants()
        for name, value in dataclasses.asdict(self.counters).items():
            assert value >= 0, (name, value)
        assert self.counters.hits + self.counters.misses == self.counters.gets, self.counters

    def __repr__(self) -> str:
        return (
            f"<MasterService segments={len(self._registry)} objects={len(self._table)} "
            f"pending={len(self._table.pending)} quarantined={len(self._quarantine)}>"
        )

    # --- internals: validation ----------------------------------------------------------

    def _count_error(self, exc: KVPoolError) -> KVPoolError:
        self.counters.errors += 1
        return exc

    def _check_batch(self, keys: list) -> None:
        if len(keys) > limits.BATCH_KEYS_MAX:
            raise self._count_error(InvalidParams(f"{len(keys)} keys in one batch > {limits.BATCH_KEYS_MAX}"))

    def _check_replicate_config(self, config: ReplicateConfig) -> None:
        if type(config.replica_num) is not int or not 1 <= config.replica_num <= limits.REPLICA_NUM_MAX:
            raise self._count_error(
                InvalidParams(f"replica_num {config.replica_num!r} not in 1..{limits.REPLICA_NUM_MAX}")
            )
        if config.placement not in PLACEMENTS:
            raise self._count_error(InvalidParams(f"placement {config.placement!r} not one of {PLACEMENTS}"))
        if len(config.preferred_segments) > limits.BATCH_KEYS_MAX:
            raise self._count_error(InvalidParams("too many preferred segments"))

    def _check_segment_info(self, info: SegmentInfo) -> None:
        if info.tier not in TIERS:
            raise self._count_error(InvalidParams(f"segment tier {info.tier!r} not one of {TIERS}"))
        if not is_valid_key(info.segment_id) or not isinstance(info.node_id, str) or not info.node_id:
            raise self._count_error(
                InvalidParams(f"bad segment or node id: {info.segment_id[:100]!r} {str(info.node_id)[:100]!r}")
            )
        for name in ("node_id", "hostname", "endpoint", "shm_path"):
            if len(getattr(info, name)) > limits.SEGMENT_NAME_SIZE_BYTES_MAX:
                raise self._count_error(
                    InvalidParams(f"segment {name} longer than {limits.SEGMENT_NAME_SIZE_BYTES_MAX} characters")
                )
        capacity = info.capacity_bytes
        if (
            type(capacity) is not int
            or not limits.SEGMENT_SIZE_BYTES_MIN <= capacity <= limits.SEGMENT_SIZE_BYTES_MAX
        ):
            raise self._count_error(
                InvalidParams(
                    f"segment capacity {capacity!r} not in "
                    f"{limits.SEGMENT_SIZE_BYTES_MIN}..{limits.SEGMENT_SIZE_BYTES_MAX}"
                )
            )

    def _compile(self, pattern: str) -> re2._Regexp:
        """A key pattern (patterns.py), its refusal counted as an error."""
        try:
            return compile_pattern(pattern)
        except InvalidParams as exc:
            raise self._count_error(exc) from None

    def _segment_or_raise(self, segment_id: str) -> Segment:
        segment = self._registry.get(segment_id)
        if segment is None:
            raise self._count_error(SegmentNotFound(f"segment {segment_id!r} is not mounted"))
        return segment

    # --- internals: placement and objects -----------------------------------------------

    def _readable_only(self, find: Callable[[str], ObjectMeta | None]) -> Callable[[str], ObjectMeta | None]:
        """`find`, but None for an object none of whose replicas can be read: the lookups'
        miss (exist_keys). A call more per key: the lookups take it only while `has_unreadable`."""
        has_readable_replica = self._registry.has_readable_replica

        def find_readable(key: str) -> ObjectMeta | None:
            meta = find(key)
            return meta if meta is not None and has_readable_replica(meta) else None

        return find_readable

    def _replicas_of(self, meta: ObjectMeta) -> list[Replica]:
        by_index = self._registry.by_index
        return [
            Replica(by_index(replica_segment_index(packed)).segment_id, replica_offset(packed))
            for packed in meta.replica_tuple()
        ]

    def _drop_object(self, key: str) -> ObjectMeta:
        return self._drop_objects([key])[0]

    def _drop_objects(self, keys: list[str]) -> list[ObjectMeta]:
        """Remove complete objects; each replica goes to its segment's drop outbox (but the
        ranges a move of one holds: the move drops those when it ends, tiers.py). Their metas,
        in order."""
        metas = self._table.remove_many(keys)
        self.tombstones.gone(keys)  # replicas a segment left behind with them must not come back
        held = self._tiers.release_for_removal(keys)
        by_index = self._registry.by_index
        for key, meta in zip(keys, metas):
            key_held = held.get(key, ())
            for packed in meta.replica_tuple():
                segment = by_index(replica_segment_index(packed))
                segment.object_count -= 1
                if packed not in key_held:
                    segment.schedule_drop(InventoryEntry(key, replica_offset(packed), meta.size_bytes, meta.checksum))
        return metas

    def _spares_leased(self, force: bool, now_ms: int) -> Callable[[ObjectMeta], bool]:
        """Whether a remove keeps an object for its lease: without `force`, one under a lease
        that a reader could still be served from (an object no replica of which can be read
        is missing to every lookup and goes, as a put of its key drops it: PutFlow.start)."""
        if force:
            return lambda meta: False
        if not self._registry.has_unreadable:
            return lambda meta: meta.has_lease(now_ms)
        has_readable_replica = self._registry.has_readable_replica
        return lambda meta: meta.has_lease(now_ms) and has_readable_replica(meta)

    def _remove_matching(self, keys: list[str], search, force: bool, now_ms: int) -> int:
        """Remove those of `keys` still complete objects that `search` finds (all without one),
        skipping leased ones unless `force`; how many went. Those found that are no object any
        more still go from the replicas segments that went left behind (tombstones.py). A key
        may come twice (lost, then put again): it goes once."""
        get = self._table.get
        spares_leased = self._spares_leased(force, now_ms)
        doomed: dict[str, None] = {}
        absent = []
        for key in keys:
            if search is not None and search(key) is None:
                continue
            meta = get(key)
            if meta is None:
                absent.append(key)
            elif not spares_leased(meta):
                doomed[key] = None
        if absent:
            self.tombstones.gone(absent)
        self._drop_objects(list(doomed))
        self.counters.removes += len(doomed)
        return len(doomed)

    # --- internals: eviction ------------------------------------------------------------

    def _evict_above_watermark(self, now_ms: int) -> None:
        """DRAM eviction down to the watermark (the tick's), backed off after a scan that fell
        short. Not run by a put short of room: with a large segment it evicts up to
        EVICT_VICTIMS_TICK_MAX objects at once, a stall that put would wait on."""
        if now_ms < self._evict_watermark_after_ms:
            return
        config = self.config
        victims, is_short = select_above_watermark(
            self._table.policy, self._registry.active, config.evict_watermark_ratio_high, config.evict_ratio, now_ms
        )
        is_done = self._tiers.demote_all(victims, TIER_DRAM, now_ms)
        if is_short or not is_done:
            self._evict_watermark_after_ms = now_ms + EVICT_SHORTFALL_BACKOFF_MS

    def _evict(self, keys: list[str]) -> None:
        """Evict whole objects (TierFlow's, for those with nowhere lower to go)."""
        evicted_bytes = 0
        for meta in self._drop_objects(keys):
            evicted_bytes += footprint_bytes(meta.size_bytes) * len(meta.replica_tuple())
        self.counters.evictions += len(keys)
        self.counters.evicted_bytes += evicted_bytes
