"""The two-phase put on the master: grants at put_start, commits at put_end, and the ends of a
put that never finished (revoke, zombie discard).

This module moves a key through its put states and the ranges through the allocators:

    put_start --grant--> writing --put_end--> committing --finish_put_end--> complete (table)
                            |                                         \\--> none ok: key free
                            |-- put_revoke ----------> ranges freed now
                            |-- discard (timeout,   -> ranges quarantined until
                            |   or forced remove)      start + put_release_timeout_ms

A committing put cannot be discarded or revoked: a node may be adding it to its inventory, and
a range in an inventory must never be reused before it is dropped. A put of a complete key
writes nothing (keys are content hashes), unless no replica of the object can be read (every
one on a segment whose node's connection is lost, or leaving): then the key is written anew
and the old object dropped, as a remove drops it (see PutFlow.start). This module is not the
request surface (service.py validates requests and runs eviction) and it decides no placement
order (placement.py).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Mapping, Sequence

from kvpool import limits
from kvpool.config import MasterConfig
from kvpool.master import codes
from kvpool.master.allocator import footprint_bytes
from kvpool.master.counters import MasterCounters
from kvpool.master.membership import Quarantine, Segment, SegmentRegistry
from kvpool.master.metadata import (
    ObjectMeta,
    ObjectTable,
    PendingPut,
    is_valid_checksum,
    is_valid_key,
    is_valid_size,
    pack_replica,
)
from kvpool.master.placement import candidate_segments
from kvpool.protocol import auth
from kvpool.protocol.messages import (
    PIN_HARD,
    PIN_SOFT,
    TIER_DFS,
    TIER_DISK,
    CodesReply,
    InventoryEntry,
    PutStartReply,
    ReplicateConfig,
    SegmentInfo,
    WriteGrant,
)


def _unwritten_by_index(unwritten: Sequence[tuple[int, str]], key_count: int) -> dict[int, set[str]] | None:
    """PutEnd.unwritten as key index -> segment ids; None if an index is out of range."""
    by_index: dict[int, set[str]] = {}
    for index, segment_id in unwritten:
        if not 0 <= index < key_count:
            return None
        by_index.setdefault(index, set()).add(segment_id)
    return by_index


def copy_tiers_of(config: ReplicateConfig) -> tuple[str, ...]:
    """The slower tiers a put asked for a write-through copy on, fastest first."""
    tiers: tuple[str, ...] = ()
    if config.with_disk_copy:
        tiers += (TIER_DISK,)
    if config.with_dfs_copy:
        tiers += (TIER_DFS,)
    return tiers


@dataclasses.dataclass(slots=True)
class PendingCommit:
    """What put_end decided, and what the server must ask the nodes before finish_put_end.

    `codes` has one code per key of the PutEnd, in order; keys whose commit is in flight hold
    OK until finish_put_end gives their final code. `commits` maps a segment id to the entries
    to send in one CommitObjects to that segment's node; the server passes back the node's
    per-entry codes in the same order. The other fields are the master's own.
    """

    keys: list[str]
    codes: list[int]
    commits: dict[str, list[InventoryEntry]]
    awaiting: list[int] = dataclasses.field(default_factory=list, repr=False)
    puts: dict[str, PendingPut] = dataclasses.field(default_factory=dict, repr=False)
    segments: dict[str, Segment] = dataclasses.field(default_factory=dict, repr=False)
    is_finished: bool = False


# Keys of one put_start are allocated in runs: consecutive accepted keys whose footprints add up
# to at most this many bytes share one extent per replica and one signed grant per extent. That
# is one allocation and one HMAC per run instead of per key (128 keys of 4 KiB: one of each
# instead of 128, the bulk of put_start's cost), and a run's replica is one contiguous range, so
# its bytes travel as one slice. Runs are small enough that a large batch still spreads over
# the segments (a run fills about one client frame, client/transfer.py FRAME_BYTES_TARGET).
RUN_BYTES_MAX = 4 * limits.MIB


class _Grants:
    """put_start's answer, built run by run (per key a code and its placements, the grants and
    the segments they name), and the PendingPuts of the request's keys."""

    __slots__ = ("codes", "placements", "grants", "segments", "no_room_bytes", "_key", "_term", "_now_ms",
                 "_expiry_ms", "_is_soft_pinned", "_is_hard_pinned", "_copy_tiers", "_put_id")  # fmt: skip

    def __init__(
        self,
        key_count: int,
        cluster_key: bytes | None,
        term: int,
        now_ms: int,
        expiry_ms: int,
        config: ReplicateConfig,
        put_id: int,
    ):
        self.codes = [codes.OK] * key_count
        self.placements: list[list[tuple[int, int]]] = [[] for _ in range(key_count)]
        self.grants: list[WriteGrant] = []
        self.segments: dict[str, SegmentInfo] = {}
        # The smallest run (footprint bytes) that found no room in this put_start: none as
        # large will, since the request's own allocations only take room.
        self.no_room_bytes = 1 << 62
        self._key = cluster_key
        self._term = term
        self._now_ms = now_ms
        self._expiry_ms = expiry_ms
        self._is_hard_pinned = bool(config.with_hard_pin)
        self._is_soft_pinned = bool(config.with_soft_pin) and not self._is_hard_pinned
        self._copy_tiers = copy_tiers_of(config)
        self._put_id = put_id

    def add(self, segment: Segment, offset: int, size_bytes: int) -> int:
        """Sign a grant for a range of `segment`; returns its index in the reply."""
        info = segment.info
        self.grants.append(
            auth.sign_grant(self._key, info.segment_id, offset, size_bytes, self._expiry_ms, self._term)
        )
        self.segments[info.segment_id] = info
        return len(self.grants) - 1

    def new_put(self, size_bytes: int, replicas: list[tuple[Segment, int]]) -> PendingPut:
        return PendingPut(
            size_bytes, replicas, self._now_ms, self._is_soft_pinned, self._is_hard_pinned, self._copy_tiers,
            put_id=self._put_id,
        )

    def reply(self) -> PutStartReply:
        return PutStartReply(self.codes, self.placements, self.grants, self.segments, self._expiry_ms - self._now_ms)


def merge_retried(reply: PutStartReply, again: PutStartReply, retried: list[int]) -> None:
    """Fold the answer to a second put_start of some keys (`retried`: their indexes in the
    first, in order) into the first answer."""
    base = len(reply.grants)
    for position, index in enumerate(retried):
        reply.codes[index] = again.codes[position]
        reply.placements[index] = [(base + g, start) for g, start in again.placements[position]]
    reply.grants.extend(again.grants)
    reply.segments.update(again.segments)


class PutFlow:
    """Moves puts through their states over the master's shared structures.

    Holds references only (the registry, the table, the quarantine and the counters belong to
    MasterService); its own state is nothing. Requests reach it validated at request level
    (batch length, replica config); per-key validation happens here. `drop_objects` takes
    complete objects out as a remove does (MasterService._drop_objects: their replicas to
    the drop outbox).
    """

    __slots__ = (
        "_config", "_rng", "cluster_key", "_term", "_registry", "_table", "_quarantine", "_counters", "_moving",
        "_drop_objects",
    )  # fmt: skip

    def __init__(
        self,
        config: MasterConfig,
        rng: random.Random,
        cluster_key: bytes | None,
        term: int,
        registry: SegmentRegistry,
        table: ObjectTable,
        quarantine: Quarantine,
        counters: MasterCounters,
        moving: Mapping[str, object],
        drop_objects: Callable[[list[str]], object],
    ):
        self._config = config
        self._term = term
        self._rng = rng
        self.cluster_key = cluster_key  # signs grants; replaced when the token rotates (auth.Keyring)
        self._registry = registry
        self._table = table
        self._quarantine = quarantine
        self._counters = counters
        self._moving = moving  # keys with a move in flight (TierFlow.moves.by_key)
        self._drop_objects = drop_objects

    def start(
        self,
        keys: list[str],
        sizes: list[int],
        config: ReplicateConfig,
        client_hostname: str,
        now_ms: int,
        put_id: int,
    ) -> tuple[PutStartReply, int]:
        """Allocate and grant; returns the reply and the footprint bytes that found no room.

        Accepted keys are allocated in runs (see RUN_BYTES_MAX): one extent per replica for the
        whole run, carved into the keys' ranges in key order, and one grant per extent.

        A complete key is OBJECT_ALREADY_EXISTS while a replica of it can be read
        (Segment.is_readable). When none can (their node's connection is lost; the node TTL
        drops it only later), a put answered OK without writing left every get missing until
        then: so the key is put like a new one, and its old object is dropped (as a remove
        drops it) once the key has its grants, or kept when it found no room; the new put
        keeps the old object's pins, the stronger of its own and theirs standing (_keep_pins).
        The old replicas' ranges are held until their node, back, forgets them (a re-mount
        listing them meanwhile is refused: mounts.py), or go with it as tombstones. A read lease does
        not stop this: a reader of the old replicas gets no bytes from the lost node, or once
        their range was reused a checksum that does not match (a miss, as after a forced remove).
        """
        table = self._table
        objects, lower, pending, moving = table.objects, table.lower, table.pending, self._moving
        grants = _Grants(
            len(keys), self.cluster_key, self._term, now_ms, now_ms + self._config.put_discard_timeout_ms, config,
            put_id,
        )
        is_every_segment_readable = not self._registry.has_unreadable
        accepted: set[str] = set()
        unreadable: list[int] = []  # indexes of accepted keys whose object no reader can find
        run: list[tuple[int, int]] = []  # (key index, where its range starts in the run)
        run_bytes = 0
        shortfall_bytes = 0
        for index, (key, size) in enumerate(zip(keys, sizes)):
            if not is_valid_key(key):
                code = codes.INVALID_KEY
            elif not is_valid_size(size):
                code = codes.INVALID_PARAMS
            elif (key in objects or key in lower) and (is_every_segment_readable or self._has_readable_replica(key)):
                code = codes.OBJECT_ALREADY_EXISTS
            elif key in pending or key in accepted or key in moving:
                # A move of the object removed meanwhile is still running: its node will
                # record the copy under this key, over the entry of a new put of it (a node's
                # inventory holds one entry per key), and a master restart would lose the new
                # object. So the key waits for the move, as it waits for another writer (and so
                # does an object no reader can find: its move, on the lost node, ends first).
                code = codes.REPLICA_IS_NOT_READY
            elif footprint_bytes(size) > self._registry.capacity_max:
                code = codes.NO_AVAILABLE_HANDLE  # fits in no segment: evicting would not help
            else:
                footprint = footprint_bytes(size)
                if run_bytes + footprint > RUN_BYTES_MAX and run:
                    shortfall_bytes += self._grant_run(grants, keys, sizes, run, run_bytes, config, client_hostname)
                    run, run_bytes = [], 0
                accepted.add(key)
                if key in objects or key in lower:
                    unreadable.append(index)
                run.append((index, run_bytes))
                run_bytes += footprint
                continue
            grants.codes[index] = code
            if code in (codes.INVALID_KEY, codes.INVALID_PARAMS):  # NO_AVAILABLE_HANDLE: once settled
                self._counters.errors += 1
        if run:
            shortfall_bytes += self._grant_run(grants, keys, sizes, run, run_bytes, config, client_hostname)
        if unreadable:  # now, before anything sees a key both pending and complete (ObjectTable)
            replaced = [keys[index] for index in unreadable if grants.codes[index] == codes.OK]
            if replaced:
                for key in replaced:
                    self._keep_pins(key, now_ms)
                self._drop_objects(replaced)
        return grants.reply(), shortfall_bytes

    def _keep_pins(self, key: str, now_ms: int) -> None:
        """The put writing a complete key anew takes the old object's pins: a hard pin, or a
        soft pin not lapsed, unless its own is stronger. An engine's put of the key names no
        pin, and the node's pinned copy is refused on re-mount (mounts.py): without them the
        key was evicted like any other. A kept soft pin runs a whole soft_pin_ttl_ms from
        the commit, as a new one does (soft_pin_order stays in expiry order)."""
        old = self._table.get(key)
        assert old is not None, f"{key!r} is no complete object"
        put = self._table.pending[key]
        if old.is_hard_pinned:
            put.is_hard_pinned = True
            put.is_soft_pinned = False  # a hard-pinned object is not soft-pinned (ObjectTable)
        elif old.soft_pin_expiry_ms > now_ms and not put.is_hard_pinned:
            put.is_soft_pinned = True

    def _has_readable_replica(self, key: str) -> bool:
        """Whether a replica of the complete object `key` lies on a readable segment."""
        meta = self._table.get(key)
        assert meta is not None, f"{key!r} is no complete object"
        return self._registry.has_readable_replica(meta)

    def _grant_run(
        self,
        grants: _Grants,
        keys: list[str],
        sizes: list[int],
        run: list[tuple[int, int]],
        run_bytes: int,
        config: ReplicateConfig,
        client_hostname: str,
    ) -> int:
        """Allocate and grant one run of keys; returns the footprint bytes that found no room.

        The whole run on each replica's segment when it fits there in one piece. Else (a
        fragmented segment: eviction frees the oldest objects wherever they lie, around the
        ones reads keep) in pieces. One replica: each piece as many of its keys, in order, as
        the largest hole holds: the fewest pieces, so the fewest grants to sign and check and
        the fewest runs for the node to record (halves, down to single keys, cut a run in about
        twice as many pieces and filled the smallest holes with them: `bench_paths.py
        fragmentation`). Several replicas: each half of the run the same way, down to single
        keys (halves spread a run over segments of unequal room; pieces as large as the
        largest hole would fill two segments with one piece and leave the rest of the run a
        single replica). A run that found no room tells the smaller ones to come that nothing
        of its size or larger will (`grants.no_room_bytes`)."""
        if run_bytes < grants.no_room_bytes:
            size = sizes[run[0][0]] if len(run) == 1 else run_bytes
            extents = self._allocate_replicas(size, config, client_hostname)
            if extents:
                self._grant_extents(grants, keys, sizes, run, size, extents)
                return 0
            grants.no_room_bytes = run_bytes
        if len(run) == 1:
            index = run[0][0]
            grants.codes[index] = codes.NO_AVAILABLE_HANDLE  # an error once no round finds room
            return footprint_bytes(sizes[index])
        if config.replica_num > 1:
            half = len(run) // 2
            second_start = run[half][1]
            second = [(index, position - second_start) for index, position in run[half:]]
            return self._grant_run(grants, keys, sizes, run[:half], second_start, config, client_hostname) + (
                self._grant_run(grants, keys, sizes, second, run_bytes - second_start, config, client_hostname)
            )
        return self._grant_pieces(grants, keys, sizes, run, config, client_hostname)

    def _grant_pieces(
        self,
        grants: _Grants,
        keys: list[str],
        sizes: list[int],
        run: list[tuple[int, int]],
        config: ReplicateConfig,
        client_hostname: str,
    ) -> int:
        """A run of one replica with no hole its size: as many of its keys at a time as the
        largest hole holds (of the first segment in placement order with room for the next
        key: a local-first or preferred put stays where it asked while it can); returns the
        footprint bytes that found no room."""
        at = 0
        while at < len(run):
            room = self._room_for(footprint_bytes(sizes[run[at][0]]), config, client_hostname)
            base = run[at][1]
            end = at  # the piece is run[at:end], its footprint piece_bytes
            piece_bytes = 0
            while end < len(run):
                last, position = run[end]
                through = position - base + footprint_bytes(sizes[last])
                if through > room:
                    break
                piece_bytes = through
                end += 1
            size = sizes[run[at][0]] if end == at + 1 else piece_bytes
            extents = self._allocate_replicas(size, config, client_hostname) if end > at else []
            if not extents:
                for index, _ in run[at:]:
                    grants.codes[index] = codes.NO_AVAILABLE_HANDLE  # an error once no round finds room
                return sum(footprint_bytes(sizes[index]) for index, _ in run[at:])
            piece = [(index, position - base) for index, position in run[at:end]]
            self._grant_extents(grants, keys, sizes, piece, size, extents)
            at = end
        return 0

    def _room_for(self, footprint: int, config: ReplicateConfig, client_hostname: str) -> int:
        """The largest hole of the first segment in placement order that holds `footprint`
        bytes; 0 when none does."""
        for segment in candidate_segments(
            self._registry, config.placement, 1, self._rng, client_hostname, config.preferred_segments
        ):
            room = segment.allocator.largest_free_bytes
            if room >= footprint:
                return room
        return 0

    def _grant_extents(
        self,
        grants: _Grants,
        keys: list[str],
        sizes: list[int],
        run: list[tuple[int, int]],
        grant_bytes: int,
        extents: list[tuple[Segment, int]],
    ) -> None:
        """Grant a run the extents allocated for it (one per replica), each key at its position."""
        pending, placements, new_put = self._table.pending, grants.placements, grants.new_put
        grant_indexes = [grants.add(segment, offset, grant_bytes) for segment, offset in extents]
        if len(extents) == 1:  # one replica, the common case: no per-key comprehensions
            (segment, offset), grant_index = extents[0], grant_indexes[0]
            for index, position in run:
                pending[keys[index]] = new_put(sizes[index], [(segment, offset + position)])
                placements[index] = [(grant_index, position)]
            return
        for index, position in run:
            places = [(segment, offset + position) for segment, offset in extents]
            pending[keys[index]] = new_put(sizes[index], places)
            placements[index] = [(g, position) for g in grant_indexes]

    def end(
        self, keys: list[str], checksums: list[int], put_id: int, unwritten: Sequence[tuple[int, str]] = ()
    ) -> PendingCommit:
        """Decide what can be decided now; list the commits for the rest (see service.put_end).
        A key whose put in flight is not `put_id`'s is not this writer's to end. `unwritten`
        (PutEnd's): replicas the writer failed to write, left out of the commits."""
        table = self._table
        pending = table.pending
        unwritten_at = _unwritten_by_index(unwritten, len(keys))
        is_length_ok = len(checksums) == len(keys) and unwritten_at is not None
        commit = PendingCommit(keys=list(keys), codes=[], commits={})
        commits, segments, puts, awaiting = commit.commits, commit.segments, commit.puts, commit.awaiting
        ok, invalid, failed = codes.OK, codes.INVALID_PARAMS, codes.TRANSFER_FAIL
        for index, key in enumerate(keys):
            put = pending.get(key)
            if not is_length_ok:
                code = invalid
            elif put is None or put.put_id != put_id:
                code = codes.OBJECT_ALREADY_EXISTS if key in table else codes.OBJECT_NOT_FOUND
            elif put.is_committing:
                code = codes.REPLICA_IS_NOT_READY
            elif not is_valid_checksum(checksums[index]):
                code = invalid
            elif not put.replicas:
                del pending[key]  # Every segment it was granted on is gone.
                code = failed
            elif index in unwritten_at and not self._leave_out(key, put, unwritten_at[index]):
                code = failed  # no replica was written: discarded, as a revoke would
            else:
                checksum = checksums[index]
                pins = PIN_HARD if put.is_hard_pinned else PIN_SOFT if put.is_soft_pinned else 0
                put.is_committing = True
                put.checksum = checksum
                for segment, offset in put.replicas:
                    segment_id = segment.info.segment_id
                    entry = InventoryEntry(key, offset, put.size_bytes, checksum, pins)
                    if segment_id in commits:
                        commits[segment_id].append(entry)
                    else:
                        commits[segment_id] = [entry]
                        segments[segment_id] = segment
                puts[key] = put
                awaiting.append(index)
                code = ok
            if code == invalid or code == failed:
                self._counters.errors += 1
            commit.codes.append(code)
        return commit

    def _leave_out(self, key: str, put: PendingPut, segment_ids: set[str]) -> bool:
        """Take the replicas on `segment_ids` out of `put`, their ranges quarantined as a
        revoked write's (the write may land yet). False: none was left, and the put is
        discarded."""
        kept = [replica for replica in put.replicas if replica[0].info.segment_id not in segment_ids]
        if not kept:
            self.discard(key, put, is_fenced=True)
            return False
        release_ms = self._release_ms(put, is_fenced=True)
        for segment, offset in put.replicas:
            if segment.info.segment_id in segment_ids:
                self._quarantine.add(segment, offset, put.size_bytes, release_ms)
        put.replicas = kept
        return True

    def finish(self, pending: PendingCommit, results: dict[str, list[int]], now_ms: int) -> CodesReply:
        """Apply the nodes' codes and make the objects visible (see service.finish_put_end)."""
        reply = self.settle(pending, results)
        self.publish(pending, now_ms)
        return reply

    def settle(self, pending: PendingCommit, results: dict[str, list[int]]) -> CodesReply:
        """Apply the nodes' codes and decide each key's; `publish` must follow, with nothing
        in between (see service.settle_put_end)."""
        assert not pending.is_finished, "finish_put_end called twice for one put_end"
        pending.is_finished = True
        for segment_id, entries in pending.commits.items():
            segment = pending.segments[segment_id]
            node_codes = results.get(segment_id)
            is_answered = node_codes is not None and len(node_codes) == len(entries)
            if not is_answered:
                node_codes = [codes.TRANSFER_FAIL] * len(entries)
            elif not any(node_codes):
                continue  # every entry committed (codes.OK is 0): nothing to take back
            for entry, code in zip(entries, node_codes):
                put = pending.puts[entry.key]
                replica = (segment, entry.offset)
                if replica not in put.replicas:
                    continue  # Its segment was unmounted meanwhile; the range went with it.
                if code != codes.OK:
                    put.replicas.remove(replica)
                    if is_answered:  # refused: never entered the node's inventory
                        segment.allocator.free(entry.offset, entry.size)
                    else:  # the node may have recorded it (a late answer): dropped before reuse
                        segment.schedule_drop(entry)
        codes_out = list(pending.codes)
        keys, puts = pending.keys, pending.puts
        for index in pending.awaiting:
            if not puts[keys[index]].replicas:
                codes_out[index] = codes.TRANSFER_FAIL
                self._counters.errors += 1
        return CodesReply(codes_out)

    def publish(self, pending: PendingCommit, now_ms: int) -> None:
        """Enter the settled puts that kept a replica into the table; the others' keys are
        free again."""
        keys, puts, writing, insert = pending.keys, pending.puts, self._table.pending, self._table.insert
        soft_pin_ttl_ms = self._config.soft_pin_ttl_ms
        done = done_bytes = 0
        awaiting = pending.awaiting
        for index in reversed(awaiting) if self._table.policy.enters_batches_last_key_first else awaiting:
            key = keys[index]
            put = puts[key]
            assert writing.get(key) is put, f"committing put of {key!r} vanished"
            del writing[key]
            if not put.replicas:
                continue
            packed = []
            for segment, offset in put.replicas:
                packed.append(pack_replica(segment.index, offset))
                segment.object_count += 1
            soft_pin_expiry_ms = max(1, now_ms + soft_pin_ttl_ms) if put.is_soft_pinned else 0
            replicas = packed[0] if len(packed) == 1 else tuple(packed)
            insert(key, ObjectMeta(put.size_bytes, put.checksum, replicas, soft_pin_expiry_ms, put.is_hard_pinned))
            done += 1
            done_bytes += put.size_bytes
        self._counters.puts += done
        self._counters.put_bytes += done_bytes

    def revoke(self, keys: list[str], writes_in_flight: bool, put_id: int) -> CodesReply:
        """Forget writing puts of `put_id`: free their ranges at once, or with
        `writes_in_flight` (writes to nodes that may land yet) quarantine them until the nodes
        take no more of them: the grants' expiry plus REVOKED_WRITES_FENCE_MARGIN_MS (a
        minute after put_start by default, where it was the release timeout, 10 minutes)."""
        table = self._table
        codes_out: list[int] = []
        for key in keys:
            put = table.pending.get(key)
            if put is None or put.put_id != put_id:
                codes_out.append(
                    codes.OBJECT_ALREADY_EXISTS if key in table else codes.OBJECT_NOT_FOUND
                )
            elif put.is_committing:
                codes_out.append(codes.REPLICA_IS_NOT_READY)
            elif writes_in_flight:
                # Writes to nodes only (the writer's same-host copies are done): fenced by the
                # nodes at the grants' expiry (limits.REVOKED_WRITES_FENCE_MARGIN_MS).
                self.discard(key, put, is_fenced=True)
                codes_out.append(codes.OK)
            else:
                del table.pending[key]
                for segment, offset in put.replicas:
                    segment.allocator.free(offset, put.size_bytes)
                codes_out.append(codes.OK)
        return CodesReply(codes_out)

    def discard(self, key: str, put: PendingPut, is_fenced: bool = False) -> None:
        """Forget a writing put; quarantine its ranges until its writer cannot write any more
        (_release_ms)."""
        assert not put.is_committing, f"discard of committing put {key!r}"
        assert self._table.pending.get(key) is put, f"discard of unknown put {key!r}"
        del self._table.pending[key]
        release_ms = self._release_ms(put, is_fenced)
        for segment, offset in put.replicas:
            self._quarantine.add(segment, offset, put.size_bytes, release_ms)

    def _release_ms(self, put: PendingPut, is_fenced: bool) -> int:
        """When `put`'s ranges may be reused: start + put_release_timeout_ms (its grants expired
        at start + put_discard_timeout_ms, but a same-host writer stalled mid-copy is stopped
        by nothing), or, `is_fenced` (its writes went through nodes, which fence them: see
        revoke), the grants' expiry plus REVOKED_WRITES_FENCE_MARGIN_MS if that is earlier."""
        release_ms = put.start_ms + self._config.put_release_timeout_ms
        if is_fenced:
            fenced_ms = put.start_ms + self._config.put_discard_timeout_ms + limits.REVOKED_WRITES_FENCE_MARGIN_MS
            release_ms = min(release_ms, fenced_ms)
        return release_ms

    def discard_zombies(self, now_ms: int) -> int:
        """Discard writing puts older than put_discard_timeout_ms; returns how many.

        O(discarded + committing + 1): `pending` is in put_start order, so the scan stops at
        the first young writing put (a wall clock that stepped back only delays a discard).
        """
        discard_before_ms = now_ms - self._config.put_discard_timeout_ms
        zombies: list[tuple[str, PendingPut]] = []
        for key, put in self._table.pending.items():
            if put.is_committing:
                continue
            if put.start_ms > discard_before_ms:
                break
            zombies.append((key, put))
        for key, put in zombies:
            self.discard(key, put)
        return len(zombies)

    def _allocate_replicas(
        self, size_bytes: int, config: ReplicateConfig, client_hostname: str
    ) -> list[tuple[Segment, int]]:
        """Up to replica_num ranges on distinct active segments, in placement order."""
        replica_num = config.replica_num
        chosen: list[tuple[Segment, int]] = []
        tried: set[int] = set()
        active = self._registry.active
        if config.placement == "random" and replica_num == 1 and active:
            # The common case, without the generator: one draw that usually fits.
            segment = active[int(self._rng.random() * len(active))]
            offset = segment.allocator.allocate(size_bytes)
            if offset is not None:
                return [(segment, offset)]
            tried.add(segment.index)
        for segment in candidate_segments(
            self._registry,
            config.placement,
            replica_num,
            self._rng,
            client_hostname,
            config.preferred_segments,
        ):
            if segment.index in tried:
                continue
            tried.add(segment.index)
            offset = segment.allocator.allocate(size_bytes)
            if offset is None:
                continue
            chosen.append((segment, offset))
            if len(chosen) == replica_num:
                break
        return chosen
