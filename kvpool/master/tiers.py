"""The master's record of objects moving between tiers, and of reads that earn a promotion.

A replica lives in a tier: a DRAM segment, a node's disk tier, or the shared filesystem (DFS),
fastest first (messages.TIERS). Objects move between tiers by copies the master asks a node to
make (MoveObjects); this module holds those moves while they are in flight, and counts the
reads of objects that are not in DRAM. It is pure (no I/O, no clock: `now_ms` is passed in) and
decides nothing: service.py starts moves, finishes them and places objects.

    kind      source            targets                  when                  after success
    OFFLOAD   last copy in a    the node's disk tier,    evicted from its      retiring replicas
              full tier         else the DFS             tier                  dropped (unless leased)
    PROMOTE   disk or DFS       a DRAM segment           read often enough     both kept
    COPY      the DRAM replica  disk tier and/or DFS     put with_disk_copy /  both kept
                                                         with_dfs_copy

While a move is in flight its source range is never reused (a remove of the object defers the
source's drop to the move's end), its targets' ranges are allocated to it, and its retiring
replicas still serve reads but no longer count as the object's residence (the object is not an
eviction candidate of their tier). One move per key at a time.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Iterator
from typing import NamedTuple

from kvpool import limits
from kvpool.config import MasterConfig
from kvpool.errors import ErrorCode
from kvpool.master.allocator import footprint_bytes
from kvpool.master.counters import TierCounters
from kvpool.master.eviction import (
    EVICT_SHORTFALL_BACKOFF_MS,
    select_above_watermark,
    select_for_room,
)
from kvpool.master.membership import Segment, SegmentRegistry
from kvpool.master.metadata import (
    SEGMENT_COUNT_MAX,
    ObjectMeta,
    ObjectTable,
    pack_replica,
    replica_offset,
    replica_segment_index,
)
from kvpool.protocol import objectfile
from kvpool.protocol.messages import (
    TIER_DFS,
    TIER_DISK,
    TIER_DRAM,
    TIERS,
    InventoryEntry,
    MoveItem,
)

# A slower tier whose filesystem filled up before its capacity did (other files on that disk, a
# DFS quota) fails a move there with NO_AVAILABLE_HANDLE (the node's FilesystemFull). Its room
# is then capped at what it held, so that an offload makes room by evicting its oldest objects,
# which frees space on that filesystem: else every move there would fail, the tier would keep
# its oldest objects for good, and every object evicted to it since would be lost. The cap is
# lifted after this long (the space may be back); if it is not, the next move fails and sets it
# again. Before that happens, the free space a node reports in its heartbeats (and the master
# reads of the DFS) caps the room the same way, so that a filesystem filling up usually costs no
# failed move at all (report_free).
FULL_TIER_RETRY_MS = 60_000

# What an object file takes beyond the object's bytes: its header (protocol/objectfile.py; one
# page for keys shorter than 4 KiB - 48 bytes). A tier of 4 KiB pages takes twice its bytes.
FILE_OVERHEAD_BYTES = objectfile.ALIGN_BYTES

# Where an object evicted from a tier goes, in order of preference (none: it is dropped).
LOWER_TIERS: dict[str, tuple[str, ...]] = {TIER_DRAM: (TIER_DISK, TIER_DFS), TIER_DISK: (TIER_DFS,), TIER_DFS: ()}
SLOWER_TIERS = (TIER_DISK, TIER_DFS)

# A move's result when its request got no answer (no ErrorCode is positive): the node may have
# recorded the copy, so its target is dropped from the node before the range is reused.
UNANSWERED = 1


class FreeReport(NamedTuple):
    """A slower segment's free filesystem space as last reported (TierFlow.report_free), and
    which filesystem that is: (hostname, device), shared by the disk tiers of nodes on one host
    and disk."""

    segment: Segment
    free_bytes: int
    filesystem: tuple[str, int]
    is_capped: bool  # less than the segment's capacity


class MoveKind(enum.Enum):
    OFFLOAD = "offload"
    PROMOTE = "promote"
    COPY = "copy"


Place = tuple[Segment, int]  # (segment, offset)


class Move:
    """One object's copy from `source` to `targets`, run by the node of `executor`.

    `meta` is the object's record when the move started: a move whose object was removed (or
    removed and put again) meanwhile is cancelled, and its targets are dropped. `retiring`
    are the replicas an offload removes once it succeeded (the source among them). `results`
    collects the node's code per target index.
    """

    __slots__ = (
        "key", "meta", "kind", "source", "retiring", "targets", "executor", "results",
        "is_sent", "is_cancelled",
    )  # fmt: skip

    def __init__(
        self, key: str, meta: ObjectMeta, kind: MoveKind, source: Place, retiring: list[Place],
        targets: list[Place], executor: Segment,
    ) -> None:
        assert targets, f"move of {key!r} without a target"
        assert kind is MoveKind.OFFLOAD or not retiring, (kind, retiring)
        self.key = key
        self.meta = meta
        self.kind = kind
        self.source = source
        self.retiring = retiring
        self.targets = targets
        self.executor = executor
        self.results: dict[int, int] = {}
        self.is_sent = False
        self.is_cancelled = False

    def __repr__(self) -> str:
        source = (self.source[0].segment_id, self.source[1])
        targets = [(segment.segment_id, offset) for segment, offset in self.targets]
        return f"<Move {self.kind.value} {self.key!r} {source} -> {targets} cancelled={self.is_cancelled}>"

    @property
    def budget_key(self) -> str:
        """The node whose disk threads run it: moves in flight are bounded per node."""
        return self.executor.info.node_id

    def held(self) -> list[Place]:
        """Ranges the move keeps from reuse until it ends: its source and retiring replicas."""
        return [self.source, *[place for place in self.retiring if place != self.source]]

    def items(self) -> list[MoveItem]:
        size_bytes, checksum = self.meta.size_bytes, self.meta.checksum
        source_segment, source_offset = self.source
        return [
            MoveItem(
                self.key, size_bytes, checksum, source_segment.segment_id, source_offset,
                segment.segment_id, offset,
            )
            for segment, offset in self.targets
        ]


class MoveBook:
    """The moves in flight: by key, the unsent ones in start order, the bytes in flight per
    executing node, and how many are coming into each segment. Invariants (check_invariants):
    every unsent move is in `by_key` and not sent; the bytes per node are the sum of its
    moves' sizes; per segment id, the count and footprint of their targets there."""

    __slots__ = ("by_key", "_unsent", "_inflight_bytes", "_arriving")

    def __init__(self) -> None:
        self.by_key: dict[str, Move] = {}
        self._unsent: list[Move] = []
        self._inflight_bytes: dict[str, int] = {}
        self._arriving: dict[str, tuple[int, int]] = {}  # segment id -> (targets, their bytes)

    def __len__(self) -> int:
        return len(self.by_key)

    def __contains__(self, key: object) -> bool:
        return key in self.by_key

    def __iter__(self) -> Iterator[Move]:
        return iter(list(self.by_key.values()))

    def has_room(self, executor: Segment, size_bytes: int) -> bool:
        """Whether a move of `size_bytes` fits the executing node's budget (an object larger
        than the whole budget goes alone)."""
        inflight = self._inflight_bytes.get(executor.info.node_id, 0)
        return inflight == 0 or inflight + size_bytes <= limits.MOVE_INFLIGHT_BYTES_PER_NODE_MAX

    def inflight_bytes(self) -> int:
        return sum(self._inflight_bytes.values())

    def arriving(self, segment: Segment) -> tuple[int, int]:
        """How many moves in flight write into `segment` (each a file, in a slower tier), and
        the footprint of what they write."""
        return self._arriving.get(segment.segment_id, (0, 0))

    def _arrive(self, move: Move, sign: int) -> None:
        footprint = footprint_bytes(move.meta.size_bytes)
        for segment, _ in move.targets:
            count, size_bytes = self._arriving.get(segment.segment_id, (0, 0))
            if count + sign:
                self._arriving[segment.segment_id] = (count + sign, size_bytes + sign * footprint)
            else:
                del self._arriving[segment.segment_id]

    def add(self, move: Move) -> None:
        assert move.key not in self.by_key, f"two moves of {move.key!r}"
        self.by_key[move.key] = move
        self._unsent.append(move)
        budget_key = move.budget_key
        self._inflight_bytes[budget_key] = self._inflight_bytes.get(budget_key, 0) + move.meta.size_bytes
        self._arrive(move, 1)

    def take_unsent(self) -> dict[str, list[MoveItem]]:
        """Per executing segment id, the items of every move not yet sent (now sent)."""
        batches: dict[str, list[MoveItem]] = {}
        for move in self._unsent:
            move.is_sent = True
            batches.setdefault(move.executor.segment_id, []).extend(move.items())
        self._unsent = []
        return batches

    def take(self, moves: list[Move]) -> dict[str, list[MoveItem]]:
        """Like take_unsent, for these moves only (a put_end's copies, sent by its flow)."""
        batches: dict[str, list[MoveItem]] = {}
        chosen = {id(move) for move in moves}
        self._unsent = [move for move in self._unsent if id(move) not in chosen]
        for move in moves:
            assert not move.is_sent, move
            move.is_sent = True
            batches.setdefault(move.executor.segment_id, []).extend(move.items())
        return batches

    def has_unsent(self) -> bool:
        return bool(self._unsent)

    def unsent(self) -> list[Move]:
        return list(self._unsent)

    def target_index(self, move: Move, item: MoveItem) -> int | None:
        for index, (segment, offset) in enumerate(move.targets):
            if segment.segment_id == item.dst_segment_id and offset == item.dst_offset:
                return index
        return None

    def end(self, move: Move) -> None:
        assert self.by_key.get(move.key) is move, f"end of unknown move {move!r}"
        del self.by_key[move.key]
        if not move.is_sent:
            self._unsent.remove(move)
        budget_key = move.budget_key
        left = self._inflight_bytes[budget_key] - move.meta.size_bytes
        assert left >= 0, (budget_key, left)
        if left:
            self._inflight_bytes[budget_key] = left
        else:
            del self._inflight_bytes[budget_key]
        self._arrive(move, -1)

    def check_invariants(self) -> None:
        for move in self._unsent:
            assert self.by_key.get(move.key) is move, move
            assert not move.is_sent, move
        totals: dict[str, int] = {}
        arriving: dict[str, tuple[int, int]] = {}
        for move in self.by_key.values():
            totals[move.budget_key] = totals.get(move.budget_key, 0) + move.meta.size_bytes
            assert len(move.results) < len(move.targets), move
            for segment, _ in move.targets:
                count, size_bytes = arriving.get(segment.segment_id, (0, 0))
                arriving[segment.segment_id] = (count + 1, size_bytes + footprint_bytes(move.meta.size_bytes))
        assert totals == self._inflight_bytes, (totals, self._inflight_bytes)
        assert arriving == self._arriving, (arriving, self._arriving)


class PromotionCounter:
    """Reads of objects outside DRAM, per key, within a window; keys that reached the
    threshold wait in `_due` (insertion order) for a tick to promote them.

    Bounded: at most PROMOTION_CANDIDATES_MAX keys are counted; when the window ends or the
    counts fill up they restart from zero (an approximate, cheap way to age them).
    """

    __slots__ = ("_threshold", "_window_ms", "_window_end_ms", "_counts", "_due")

    def __init__(self, threshold: int, window_ms: int) -> None:
        assert threshold >= 1, threshold
        assert window_ms > 0, window_ms
        self._threshold = threshold
        self._window_ms = window_ms
        self._window_end_ms = 0
        self._counts: dict[str, int] = {}
        self._due: dict[str, None] = {}

    def __len__(self) -> int:
        return len(self._due)

    def count(self, key: str, now_ms: int) -> None:
        if now_ms >= self._window_end_ms or len(self._counts) >= limits.PROMOTION_CANDIDATES_MAX:
            self._counts.clear()
            self._window_end_ms = now_ms + self._window_ms
        count = self._counts.get(key, 0) + 1
        if count >= self._threshold:
            self._counts.pop(key, None)
            if len(self._due) < limits.PROMOTION_CANDIDATES_MAX:
                self._due[key] = None
        else:
            self._counts[key] = count

    def take_due(self, count_max: int) -> list[str]:
        """Up to `count_max` keys due for promotion, oldest first (they leave the queue)."""
        taken: list[str] = []
        for key in self._due:
            if len(taken) == count_max:
                break
            taken.append(key)
        for key in taken:
            del self._due[key]
        return taken

    def retry(self, key: str) -> None:
        """A due key that could not be promoted now (no room yet): due again, last."""
        if len(self._due) < limits.PROMOTION_CANDIDATES_MAX:
            self._due[key] = None

    def forget(self, key: str) -> None:
        self._counts.pop(key, None)
        self._due.pop(key, None)

    def forget_many(self, keys: list[str]) -> None:
        counts, due = self._counts, self._due
        if counts or due:
            for key in keys:
                counts.pop(key, None)
                due.pop(key, None)


class Room(enum.Enum):
    """Why no range was found in a tier: none there at all, or room is on its way (evictions
    or moves in flight there, or the executing node's move budget is spent)."""

    NONE = "none"
    LATER = "later"


class TierFlow:
    """Moves objects between tiers over the master's shared structures (like puts.PutFlow).

    Holds references to the registry and the table (MasterService's) and owns the moves in
    flight (`moves`), the read counts that earn promotions (`promotions`) and the per-tier
    counters (`counters`). Every replica change goes through `place`, which keeps the table's
    split by residence true. `evict_objects` is the service's whole-object eviction, for
    objects that have nowhere lower to go.
    """

    __slots__ = (
        "_config", "_rng", "_registry", "_table", "_evict_objects", "moves", "promotions",
        "counters", "_watermark_after_ms", "_room_after_ms", "_without_dfs", "_full", "newly_full",
        "_reported", "_sharing", "_filesystem_room", "_landed", "_unwritable",
    )  # fmt: skip

    def __init__(
        self, config: MasterConfig, rng: random.Random, registry: SegmentRegistry, table: ObjectTable,
        evict_objects: Callable[[list[str]], None],
    ) -> None:  # fmt: skip
        self._config = config
        self._rng = rng
        self._registry = registry
        self._table = table
        self._evict_objects = evict_objects
        self.moves = MoveBook()
        self.promotions = PromotionCounter(max(1, config.promote_reads), config.promotion_window_ms)
        self.counters = {tier: TierCounters() for tier in TIERS}
        self._watermark_after_ms = {tier: 0 for tier in SLOWER_TIERS}
        self._room_after_ms = {tier: 0 for tier in TIERS}
        # Nodes that answered a DFS move with SEGMENT_NOT_FOUND: the DFS is not mounted there
        # (or its identity could not be read), so no DFS moves are asked of them until when
        # (FULL_TIER_RETRY_MS: a share mounted late, or an NFS hiccup, is tried again; it was
        # never, until the master restarted). Bounded: forgotten when it fills up.
        self._without_dfs: dict[str, int] = {}
        # Segments whose filesystem is full (FULL_TIER_RETRY_MS): id -> (segment, the bytes it
        # may hold, until when); and those found full since the service last logged them, by
        # id, with the bytes they may hold.
        self._full: dict[str, tuple[Segment, int, int]] = {}
        self.newly_full: dict[str, tuple[Segment, int]] = {}
        # The last report of each slower segment's free filesystem space (report_free); per
        # filesystem, the segments on it and the file bytes they may take, until when: a
        # filesystem none reported for FULL_TIER_RETRY_MS caps nothing (a node that cannot
        # read it stops reporting).
        self._reported: dict[str, FreeReport] = {}
        self._sharing: dict[tuple[str, int], dict[str, Segment]] = {}
        self._filesystem_room: dict[tuple[str, int], tuple[int, int]] = {}
        # Per slower segment whose look at its filesystem is under way (look_begins: the DFS's,
        # which the master takes), the file bytes of the moves that ended there since it began.
        self._landed: dict[str, int] = {}
        # Slower segments whose filesystem takes no writes, by their node's last report
        # (report_writable): nothing is moved there until a report says it does again.
        self._unwritable: dict[str, Segment] = {}

    # --- residence -------------------------------------------------------------------------

    def resident_tiers(self, key: str, meta: ObjectMeta) -> frozenset[str]:
        """The tiers of the object's replicas, less those an offload is moving out."""
        move = self.moves.by_key.get(key)
        retiring = (
            {(seg.index, offset) for seg, offset in move.retiring if self._is_live(seg)} if move is not None else ()
        )
        by_index = self._registry.by_index
        tiers = set()
        for packed in meta.replica_tuple():
            index = replica_segment_index(packed)
            if retiring and (index, replica_offset(packed)) in retiring:
                continue
            tiers.add(by_index(index).tier)
        return frozenset(tiers)

    def place(self, key: str, meta: ObjectMeta) -> None:
        self._table.place(key, meta, self.resident_tiers(key, meta))

    def tier_of_nearest(self, meta: ObjectMeta) -> str:
        """The fastest tier holding a readable replica (what a get will most likely read);
        the object must have one (SegmentRegistry.has_readable_replica). One on a lost node
        or a leaving segment is skipped: its readers are served by the next."""
        by_index = self._registry.by_index
        segments = [by_index(replica_segment_index(p)) for p in meta.replica_tuple()]
        ranks = [TIERS.index(segment.tier) for segment in segments if segment.is_readable]
        assert ranks, "tier_of_nearest of an object with no readable replica"
        return TIERS[min(ranks)]

    # --- eviction: down a tier -------------------------------------------------------------

    def demote(self, key: str, tier: str, now_ms: int, asked: dict[int, int] | None = None) -> bool:
        """An eviction victim of `tier`: make its replicas there go.

        With a replica in another tier, those replicas are dropped. Otherwise the object is
        offloaded to the next tier down that has room (the node's disk tier, then the DFS),
        and dropped only when there is none. A replica elsewhere that cannot be read
        (Segment.is_readable: its node's connection lost, or leaving) does not count while one
        here can (_is_readable_elsewhere): dropped for it, the only readable replicas left the
        object missing. Without room below they are dropped all the same, the unreadable
        ones kept (their node may speak again). Returns False when nothing could be done now
        (room is coming, or the node's move budget is spent): the tick backs off, a put tries
        again in its next round (server.py).
        `asked`: the room the victims before it in the same eviction asked of each lower
        segment (by segment index; see _room_in).
        """
        table = self._table
        meta = table.get(key)
        if meta is None or key in self.moves:
            return True
        by_index = self._registry.by_index
        here: list[Place] = []
        elsewhere = False
        for packed in meta.replica_tuple():
            segment = by_index(replica_segment_index(packed))
            if segment.tier == tier:
                here.append((segment, replica_offset(packed)))
            else:
                elsewhere = True
        if not here:
            return True
        counters = self.counters[tier]
        if elsewhere and self._is_readable_elsewhere(meta, tier):
            self._drop_replicas(key, meta, here)
            counters.evictions += len(here)
            self.place(key, meta)
            return True
        source = here[0]
        size_bytes = meta.size_bytes
        for lower in LOWER_TIERS[tier]:
            if not self.moves.has_room(source[0], size_bytes):
                return False  # Back-pressure: the DRAM stays full until the node catches up.
            room = self._room_in(lower, source[0], size_bytes, now_ms, asked)
            if room is Room.LATER:
                return False
            if room is Room.NONE:
                continue
            for segment, _ in here:
                segment.start_leaving(size_bytes)
            # Counted as evictions when it ends (_end): one that finds the filesystem full
            # leaves them where they are.
            self.moves.add(Move(key, meta, MoveKind.OFFLOAD, source, here, [room], source[0]))
            self.place(key, meta)
            return True
        counters.evictions += len(here)
        if elsewhere:  # on segments no reader can find now: kept, their node may speak again
            self._drop_replicas(key, meta, here)
            self.place(key, meta)
        else:
            self._evict_objects([key])
        return True

    def _is_readable_elsewhere(self, meta: ObjectMeta, tier: str) -> bool:
        """Whether the object stays as readable without its replicas in `tier`: one in another
        tier can be read (Segment.is_readable), or none in `tier` can. Always true unless the
        registry `has_unreadable`, so the common case looks at no segment."""
        if not self._registry.has_unreadable:
            return True
        by_index = self._registry.by_index
        is_readable_here = False
        for packed in meta.replica_tuple():
            segment = by_index(replica_segment_index(packed))
            if segment.is_readable:
                if segment.tier != tier:
                    return True
                is_readable_here = True
        return not is_readable_here

    def demote_all(self, keys: list[str], tier: str, now_ms: int) -> bool:
        """demote() each key (every one, even after one could not go); False if any could not.

        DRAM victims held in DRAM alone and not moving, while no slower tier has an active
        segment to offload to, are evicted together: what demote() would do to each, at a
        fraction of the cost (a full cache evicts as fast as it is written)."""
        if tier == TIER_DRAM and not any(self._registry.active_by_tier[lower] for lower in SLOWER_TIERS):
            keys = self._evict_dram_only(keys)
        is_done = True
        asked: dict[int, int] = {}
        for key in keys:
            is_done = self.demote(key, tier, now_ms, asked) and is_done
        return is_done

    def _evict_dram_only(self, keys: list[str]) -> list[str]:
        """Evict those of `keys` with one replica (in DRAM: they are DRAM victims) and no move;
        returns the others, for demote()."""
        objects, moving = self._table.objects, self.moves.by_key
        plain: list[str] = []
        others: list[str] = []
        for key in keys:
            meta = objects.get(key)
            if meta is not None and type(meta.replicas) is int and key not in moving:
                plain.append(key)
            else:
                others.append(key)
        if plain:
            self.counters[TIER_DRAM].evictions += len(plain)
            self._evict_objects(plain)
        return others

    def _room_in(
        self, tier: str, near: Segment, size_bytes: int, now_ms: int, asked: dict[int, int] | None = None
    ) -> Place | Room:
        """A range in `tier` for an object held on `near`'s node: its own disk tier, or the
        DFS. When that tier is full its own eviction runs (bounded), and the answer is LATER
        if that frees room, NONE if not.

        The victims of one eviction ask one after the other (`asked` adds up what those before
        asked of each segment): each needs room of its own, or a whole batch would wait on the
        first one's; room the drops in flight will free counts towards it, so an eviction
        repeated before they land (another put's) evicts nothing more."""
        if tier == TIER_DISK:
            segment = self._registry.active_of_node(near.info.node_id, TIER_DISK)
        elif self._is_without_dfs(near.info.node_id, now_ms):
            return Room.NONE
        else:
            segments = self._registry.active_by_tier[tier]
            segment = segments[0] if segments else None
        if segment is None or self._unwritable.get(segment.segment_id) is segment:
            return Room.NONE
        footprint = footprint_bytes(size_bytes)
        over_bytes = self._over_bytes(segment, footprint, now_ms)
        offset = segment.allocator.allocate(size_bytes) if over_bytes <= 0 else None
        if offset is not None:
            return (segment, offset)
        asked_before = 0
        if asked is not None:
            asked_before = asked.get(segment.index, 0)
            asked[segment.index] = asked_before + footprint
        if now_ms >= self._room_after_ms[tier]:
            need_bytes = asked_before + max(footprint, over_bytes)
            victims, back_off = select_for_room(
                self._table.views[tier].policy, [segment], need_bytes, now_ms, hole_bytes=footprint
            )
            is_done = self.demote_all(victims, tier, now_ms)
            if back_off or not is_done:
                self._room_after_ms[tier] = now_ms + EVICT_SHORTFALL_BACKOFF_MS
        return Room.LATER if segment.drop_bytes else Room.NONE

    def _over_bytes(self, segment: Segment, footprint: int, now_ms: int) -> int:
        """By how many bytes one more object of `footprint` would overfill `segment`'s
        filesystem (0: it fits, as far as the master knows), beyond its capacity's own check."""
        over_bytes = 0
        reported = self._reported.get(segment.segment_id)
        if reported is not None and reported.segment is segment:
            room_bytes, until_ms = self._filesystem_room[reported.filesystem]
            if now_ms < until_ms:
                file_bytes = sum(self._file_bytes(s) for s in self._on_filesystem(reported.filesystem))
                over_bytes = file_bytes + footprint + FILE_OVERHEAD_BYTES - room_bytes
        full_bytes = self._full_bytes(segment, now_ms)
        if full_bytes is not None:
            over_bytes = max(over_bytes, segment.allocator.used_bytes + footprint - full_bytes)
        return max(0, over_bytes)

    def _full_bytes(self, segment: Segment, now_ms: int) -> int | None:
        """The bytes `segment` may hold while its filesystem is found full (FULL_TIER_RETRY_MS)."""
        full = self._full.get(segment.segment_id)
        if full is None:
            return None
        held_by, room_bytes, until_ms = full
        if held_by is not segment or now_ms >= until_ms:
            del self._full[segment.segment_id]
            return None
        return room_bytes

    def _found_full(self, segment: Segment, now_ms: int) -> None:
        """A move into `segment` found its filesystem full: cap its room at what it holds."""
        room_bytes = segment.allocator.used_bytes
        before = self._full_bytes(segment, now_ms)
        if before is None:
            for segment_id, (held_by, _, _) in list(self._full.items()):
                if not self._is_live(held_by):
                    del self._full[segment_id]
        else:
            room_bytes = min(before, room_bytes)
        if before is None or segment.segment_id in self.newly_full:
            # Logged once, with the room left once every move in flight failed alike.
            self.newly_full[segment.segment_id] = (segment, room_bytes)
        self._full[segment.segment_id] = (segment, room_bytes, now_ms + FULL_TIER_RETRY_MS)

    def _file_bytes(self, segment: Segment, with_unsettled: bool = True) -> int:
        """What the files of slower-tier `segment` take on its filesystem, as the master counts
        them: a footprint and a header each, for its objects, the files its node is yet to
        delete and those moves are writing there; or, without the unsettled ones, only what
        is surely there while its node looks at its free space: not the files being written
        (maybe not there yet), nor those whose drop was sent (maybe deleted already, their
        room counted free: counted twice, it went to two objects, and a move found the disk
        full)."""
        arriving, arriving_bytes = self.moves.arriving(segment)
        files = segment.object_count + len(segment.drops_unsent) + len(segment.drops_sent) + arriving
        file_bytes = segment.allocator.used_bytes + files * FILE_OVERHEAD_BYTES
        if with_unsettled:
            return file_bytes
        footprint = segment.allocator.footprint_bytes
        deleting_bytes = sum(footprint(entry.size) for entry in segment.drops_sent.values())
        unsettled = arriving + len(segment.drops_sent)
        return file_bytes - arriving_bytes - deleting_bytes - unsettled * FILE_OVERHEAD_BYTES

    def report_writable(self, segment: Segment, is_writable: bool) -> bool | None:
        """Whether slower-tier `segment`'s filesystem takes writes: while it does not (mounted
        read-only, its directory gone), no move goes there, and what it holds stays readable;
        its evictions are not stopped (they drop replicas, or move them to the DFS). Returns
        the new state when it changed, else None (for the log)."""
        was_writable = self._unwritable.get(segment.segment_id) is not segment
        if is_writable:
            self._unwritable.pop(segment.segment_id, None)
        else:
            for segment_id, held_by in list(self._unwritable.items()):
                if not self._is_live(held_by):
                    del self._unwritable[segment_id]
            self._unwritable[segment.segment_id] = segment
        return None if is_writable == was_writable else is_writable

    def report_free(self, segment: Segment, free_bytes: int, device: int, now_ms: int) -> bool | None:
        """The filesystem under slower-tier `segment` (`device` on its node's host; -1: not
        said) has `free_bytes` left: the objects of every segment on it may take what their
        files take now and that much more. Counted in file bytes (an object's footprint and its
        header), so that a tier of small objects does not overfill it; and per filesystem, so
        that the disk tiers of nodes sharing a disk do not each count its free space as theirs.
        Block rounding is not counted (KV pages are whole blocks): what the count misses, a
        failed move catches (_found_full).

        Returns True when the filesystem starts to hold less than the segment's capacity, False
        when it stops, None when neither (for the log)."""
        segment_id = segment.segment_id
        filesystem = (segment.info.hostname, device) if device >= 0 else (segment_id, -1)
        before = self._reported.get(segment_id)
        if before is None:
            for other_id, report in list(self._reported.items()):
                if not self._is_live(report.segment):
                    self._forget_report(other_id)
        elif before.filesystem != filesystem:
            self._forget_report(segment_id)
        was_capped = before is not None and before.segment is segment and before.is_capped
        free_bytes = max(0, free_bytes)
        is_capped = segment.allocator.used_bytes + free_bytes < segment.allocator.capacity_bytes
        self._reported[segment_id] = FreeReport(segment, free_bytes, filesystem, is_capped)
        self._sharing.setdefault(filesystem, {})[segment_id] = segment
        # Files being written may not have taken their space yet, and files being deleted may
        # have given theirs back: counted as still to come, and as gone. Files that landed
        # while the look ran (look_begins) are counted as still to come too: the look may
        # have counted their room free (counted twice, it went to two objects, and a move
        # found the disk full).
        landed_bytes = self._landed.pop(segment_id, 0)
        file_bytes = sum(self._file_bytes(s, with_unsettled=False) for s in self._on_filesystem(filesystem))
        file_bytes -= landed_bytes
        self._filesystem_room[filesystem] = (file_bytes + free_bytes, now_ms + FULL_TIER_RETRY_MS)
        return None if is_capped == was_capped else is_capped

    def _on_filesystem(self, filesystem: tuple[str, int]) -> list[Segment]:
        """The live segments whose last report named `filesystem`."""
        return [s for s in self._sharing[filesystem].values() if self._is_live(s)]

    def look_begins(self, segment: Segment) -> None:
        """A look at slower-tier `segment`'s free space begins, which its next report_free
        brings: the moves that end there meanwhile are counted as not there yet. Known for
        the DFS only, whose look the master takes: a node looks, then heartbeats, and the
        moves that land between are counted twice (docs/tiers.md)."""
        self._landed[segment.segment_id] = 0

    def _forget_report(self, segment_id: str) -> None:
        report = self._reported.pop(segment_id)
        sharing = self._sharing[report.filesystem]
        del sharing[segment_id]
        if not sharing:
            del self._sharing[report.filesystem]
            del self._filesystem_room[report.filesystem]

    def filesystem_of(self, segment: Segment) -> tuple[int, bool]:
        """What the last report said of `segment`'s filesystem: its free bytes (-1: none, as
        for a DRAM segment or from an older node) and whether it takes writes."""
        report = self._reported.get(segment.segment_id)
        free_bytes = report.free_bytes if report is not None and report.segment is segment else -1
        return free_bytes, self._unwritable.get(segment.segment_id) is not segment

    def evict_above_watermark(self, now_ms: int) -> None:
        """The slower tiers' own watermark eviction (tick); DRAM's is the service's."""
        config = self._config
        for tier in SLOWER_TIERS:
            if now_ms < self._watermark_after_ms[tier]:
                continue
            segments = self._registry.active_by_tier[tier]
            if not segments:
                continue
            victims, is_short = select_above_watermark(
                self._table.views[tier].policy, segments, config.evict_watermark_ratio_high,
                config.evict_ratio, now_ms,
            )  # fmt: skip
            is_done = self.demote_all(victims, tier, now_ms)
            if is_short or not is_done:
                self._watermark_after_ms[tier] = now_ms + EVICT_SHORTFALL_BACKOFF_MS

    def is_moving(self, key: str) -> bool:
        return key in self.moves

    def drop_replicas(self, key: str, meta: ObjectMeta, places: list[Place]) -> None:
        """Drop some (not all) of an object's replicas, and place it by those left (an object
        that lost its last DRAM replica leaves the DRAM table)."""
        self._drop_replicas(key, meta, places)
        self.place(key, meta)

    def _drop_replicas(self, key: str, meta: ObjectMeta, places: list[Place]) -> None:
        """Drop some (not all) of an object's replicas: to their segments' drop outboxes."""
        doomed = {pack_replica(segment.index, offset) for segment, offset in places}
        kept = [packed for packed in meta.replica_tuple() if packed not in doomed]
        assert kept, f"dropping every replica of {key!r}: that is an eviction"
        for segment, offset in places:
            segment.schedule_drop(InventoryEntry(key, offset, meta.size_bytes, meta.checksum))
            segment.object_count -= 1
        meta.set_replicas(kept)

    # --- promotion: up to DRAM -------------------------------------------------------------

    def count_read(self, key: str, now_ms: int) -> None:
        """A get found `key` outside DRAM."""
        if self._config.promote_reads:
            self.promotions.count(key, now_ms)

    def promote_due(self, now_ms: int) -> None:
        """Copy back into DRAM the objects read often enough (at most PROMOTIONS_PER_TICK_MAX
        a tick). A promotion keeps DRAM below its high watermark: without room it evicts the
        least valuable DRAM objects (by the DRAM policy; they move down a tier) and waits for
        a later tick. An object read `promote_reads` times is worth more than the one the
        policy offers first, else it would not be offered first."""
        if not self._config.promote_reads:
            return
        table, registry = self._table, self._registry
        ratio_high = self._config.evict_watermark_ratio_high
        waiting: list[str] = []
        for key in self.promotions.take_due(limits.PROMOTIONS_PER_TICK_MAX):
            meta = table.lower.get(key)
            if meta is None or key in self.moves:
                continue
            source = self._fastest_lower_replica(meta)
            if source is None:
                continue
            if source[0].tier == TIER_DISK:
                target = registry.active_of_node(source[0].info.node_id, TIER_DRAM)
                executor = source[0]
            else:
                active = registry.active
                target = active[int(self._rng.random() * len(active))] if active else None
                executor = target
                if target is not None and self._is_without_dfs(target.info.node_id, now_ms):
                    continue  # That node cannot read the DFS; another draw next time.
            if target is None or executor is None:
                continue
            allocator = target.allocator
            footprint = allocator.footprint_bytes(meta.size_bytes)
            excess_bytes = allocator.used_bytes + footprint - int(ratio_high * allocator.capacity_bytes)
            offset = None
            if excess_bytes <= 0 and self.moves.has_room(executor, meta.size_bytes):
                offset = allocator.allocate(meta.size_bytes)
            if offset is None:
                if excess_bytes > 0 and now_ms >= self._room_after_ms[TIER_DRAM]:
                    victims, back_off = select_for_room(table.policy, [target], excess_bytes, now_ms)
                    is_done = self.demote_all(victims, TIER_DRAM, now_ms)
                    if back_off or not is_done:
                        self._room_after_ms[TIER_DRAM] = now_ms + EVICT_SHORTFALL_BACKOFF_MS
                waiting.append(key)
                continue
            self.moves.add(Move(key, meta, MoveKind.PROMOTE, source, [], [(target, offset)], executor))
        for key in waiting:
            self.promotions.retry(key)

    def _fastest_lower_replica(self, meta: ObjectMeta) -> Place | None:
        by_index = self._registry.by_index
        best: Place | None = None
        for packed in meta.replica_tuple():
            segment = by_index(replica_segment_index(packed))
            if segment.tier == TIER_DISK:
                return (segment, replica_offset(packed))
            if segment.tier == TIER_DFS and best is None:
                best = (segment, replica_offset(packed))
        return best

    # --- write-through: copies at put_end --------------------------------------------------

    def start_copy(self, key: str, tiers: tuple[str, ...], now_ms: int) -> Move | None:
        """Copy a just-put object from its DRAM replica to `tiers` (its node's disk tier, the
        DFS). Tiers without room now are skipped (and not counted). None: nothing to copy."""
        meta = self._table.objects.get(key)
        if meta is None or key in self.moves:
            return None
        by_index = self._registry.by_index
        packed = meta.replica_tuple()[0]
        source = (by_index(replica_segment_index(packed)), replica_offset(packed))
        targets: list[Place] = []
        for tier in tiers:
            room = self._room_in(tier, source[0], meta.size_bytes, now_ms)
            if isinstance(room, tuple):
                targets.append(room)
        if not targets:
            return None
        move = Move(key, meta, MoveKind.COPY, source, [], targets, source[0])
        self.moves.add(move)
        return move

    # --- the end of a move -----------------------------------------------------------------

    def finish(self, items: list[MoveItem], codes: list[int] | None, now_ms: int) -> None:
        """The executing node's codes for sent items, or None for items that never got an
        answer. Items of unknown or already finished moves are ignored."""
        assert codes is None or len(items) == len(codes), (len(items), len(codes))
        moves = self.moves
        for item, code in zip(items, codes if codes is not None else [UNANSWERED] * len(items)):
            move = moves.by_key.get(item.key)
            if move is None or not move.is_sent:
                continue
            index = moves.target_index(move, item)
            if index is None or index in move.results:
                continue
            move.results[index] = code
            if len(move.results) == len(move.targets):
                self._end(move, now_ms)

    def release_for_removal(self, keys: list[str]) -> dict[str, set[int]]:
        """The objects are being removed: cancel their moves, and return the packed replicas
        each move holds, by key (the move drops them, not the remove). A move not sent yet
        ends now; one sent ends when its node answers, and until then its key takes no new
        put (puts.py): the node records the copy under that key whatever the master does."""
        self.promotions.forget_many(keys)
        held: dict[str, set[int]] = {}
        if not self.moves:
            return held
        by_key = self.moves.by_key
        for key in keys:
            move = by_key.get(key)
            if move is not None:
                move.is_cancelled = True
                held[key] = {pack_replica(s.index, offset) for s, offset in move.held() if self._is_live(s)}
                if not move.is_sent:
                    self._end_unsent(move)
        return held

    def take_unsent(self) -> dict[str, list[MoveItem]]:
        """MoveBook.take_unsent, less the moves whose object went since they started (lost with
        a segment that left): those end here, never sent."""
        for move in self.moves.unsent():
            if not self._is_current(move):
                self._end_unsent(move)
        return self.moves.take_unsent()

    def _end_unsent(self, move: Move) -> None:
        """End a move of an object that went, before any node was asked to make it: its
        targets were never written (free at once), the ranges it held are dropped."""
        assert not move.is_sent, move
        assert not self._is_current(move), move
        self.moves.end(move)
        size_bytes, checksum = move.meta.size_bytes, move.meta.checksum
        for segment, _ in move.retiring:
            if self._is_live(segment):
                segment.end_leaving(size_bytes)
        for segment, offset in move.targets:
            if self._is_live(segment):
                segment.allocator.free(offset, size_bytes)
        for segment, offset in move.held():
            if self._is_live(segment):
                segment.schedule_drop(InventoryEntry(move.key, offset, size_bytes, checksum))

    def _is_current(self, move: Move) -> bool:
        """Whether the move's object is still the one it copies (not removed, nor lost)."""
        return not move.is_cancelled and self._table.get(move.key) is move.meta

    def _is_without_dfs(self, node_id: str, now_ms: int) -> bool:
        return self._without_dfs.get(node_id, 0) > now_ms

    def _is_live(self, segment: Segment) -> bool:
        return self._registry.get(segment.segment_id) is segment

    def _end(self, move: Move, now_ms: int) -> None:
        self.moves.end(move)
        key, meta = move.key, move.meta
        size_bytes, checksum = meta.size_bytes, meta.checksum
        is_current = self._is_current(move)
        for segment, _ in move.retiring:
            if self._is_live(segment):
                segment.end_leaving(size_bytes)
        added: list[int] = []
        is_source_gone = False
        for index, (segment, offset) in enumerate(move.targets):
            code = move.results[index]
            is_source_gone |= code == ErrorCode.OBJECT_NOT_FOUND
            if code == ErrorCode.SEGMENT_NOT_FOUND and TIER_DFS in (segment.tier, move.source[0].tier):
                if len(self._without_dfs) >= SEGMENT_COUNT_MAX:
                    self._without_dfs.clear()
                self._without_dfs[move.executor.info.node_id] = now_ms + FULL_TIER_RETRY_MS
            if not self._is_live(segment):
                continue
            if segment.segment_id in self._landed and code in (ErrorCode.OK, UNANSWERED):  # a file there now
                self._landed[segment.segment_id] += footprint_bytes(size_bytes) + FILE_OVERHEAD_BYTES
            if code not in (ErrorCode.OK, ErrorCode.OBJECT_NOT_FOUND):  # the source gone is no failure
                self.counters[segment.tier].failed_moves += 1
            if code == UNANSWERED:  # the node may have recorded it: dropped before reuse
                segment.schedule_drop(InventoryEntry(key, offset, size_bytes, checksum))
            elif code != ErrorCode.OK:
                segment.allocator.free(offset, size_bytes)  # Never recorded by the node.
                if code == ErrorCode.NO_AVAILABLE_HANDLE and segment.tier in SLOWER_TIERS:
                    self._found_full(segment, now_ms)
            elif is_current:
                added.append(pack_replica(segment.index, offset))
                segment.object_count += 1
                counters = self.counters[segment.tier]
                if move.kind is MoveKind.OFFLOAD:
                    counters.offloads += 1
                elif move.kind is MoveKind.PROMOTE:
                    counters.promotions += 1
                else:
                    counters.copies += 1
            else:
                segment.schedule_drop(InventoryEntry(key, offset, size_bytes, checksum))
        if not is_current:
            # Removed meanwhile: the remove left the ranges the move held to us.
            for segment, offset in move.held():
                if self._is_live(segment):
                    segment.schedule_drop(InventoryEntry(key, offset, size_bytes, checksum))
            return
        doomed: list[Place] = []
        if is_source_gone:
            doomed.append(move.source)
        # An offload that found its filesystem full leaves the object where it was (the
        # source is untouched: nodes never change one), back among that tier's eviction
        # candidates; the tier's room is capped now (_found_full), so the next offload there
        # makes room instead of failing. Before, the object was dropped: lost, though whole.
        is_kept = all(code == ErrorCode.NO_AVAILABLE_HANDLE for code in move.results.values())
        if move.kind is MoveKind.OFFLOAD and not is_kept and not meta.has_lease(now_ms):
            # Moved (or not: the room was needed all the same). A reader under a lease may
            # be copying from them: then they stay, as ordinary replicas, counted evicted
            # when a later eviction takes them. Counted here, not when the offload began: a
            # kept object counted, and a leased one twice.
            self.counters[move.source[0].tier].evictions += len(move.retiring)
            doomed.extend(place for place in move.retiring if place != move.source or not is_source_gone)
        doomed = [place for place in doomed if self._is_live(place[0])]
        doomed_packed = {pack_replica(segment.index, offset) for segment, offset in doomed}
        kept = [packed for packed in meta.replica_tuple() if packed not in doomed_packed] + added
        if not kept:
            self._evict_objects([key])  # Nowhere to keep it: evicted, like an object without tiers.
            return
        meta.set_replicas(kept)
        for segment, offset in doomed:
            segment.schedule_drop(InventoryEntry(key, offset, size_bytes, checksum))
            segment.object_count -= 1
        self.place(key, meta)

    def stranded_on(self, segment: Segment) -> tuple[list[tuple[str, int]], list[InventoryEntry]]:
        """`segment` is going: the ranges there of moves in flight, which their end no longer
        reaches (its node may come back with them). (key, offset) of the targets of moves whose
        object lives (or was lost), and the entries of every range of those whose object was
        removed or evicted (their end would have dropped them). O(moves in flight)."""
        targets: list[tuple[str, int]] = []
        removed: list[InventoryEntry] = []
        for move in self.moves:
            key, size_bytes, checksum = move.key, move.meta.size_bytes, move.meta.checksum
            places = [*move.targets, *move.held()] if move.is_cancelled else move.targets
            for place_segment, offset in places:
                if place_segment is not segment:
                    continue
                if move.is_cancelled:
                    removed.append(InventoryEntry(key, offset, size_bytes, checksum))
                else:
                    targets.append((key, offset))
        return targets, removed

    # --- invariants ------------------------------------------------------------------------

    def iter_held_ranges(self) -> Iterator[tuple[Segment, int, int, bool]]:
        """(segment, offset, size, is_object_replica) of every range a move holds on a live
        segment: its targets (never object replicas yet), and for a cancelled move its held
        source and retiring ranges (no longer object replicas)."""
        table = self._table
        for move in self.moves:
            size_bytes = move.meta.size_bytes
            for segment, offset in move.targets:
                if self._is_live(segment):
                    yield segment, offset, size_bytes, False
            if move.is_cancelled or table.get(move.key) is not move.meta:
                for segment, offset in move.held():
                    if self._is_live(segment):
                        yield segment, offset, size_bytes, False

    def check_invariants(self) -> None:
        self.moves.check_invariants()
        leaving: dict[int, int] = {}
        for move in self.moves:
            assert move.executor is not None, move
            for segment, _ in move.retiring:
                if self._is_live(segment):
                    leaving[segment.index] = leaving.get(segment.index, 0) + footprint_bytes(move.meta.size_bytes)
        for segment in self._registry:
            assert segment.leaving_bytes == leaving.get(segment.index, 0), (segment, segment.leaving_bytes)
        table = self._table
        for key, meta in table.items():
            tiers = self.resident_tiers(key, meta)
            assert (key in table.objects) == (TIER_DRAM in tiers), (key, tiers)
            for tier, view in table.views.items():
                assert (key in view.objects) == (tier in tiers), (key, tier, tiers)
