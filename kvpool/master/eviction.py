"""Eviction policies: the order in which the master offers complete objects for eviction.

A policy decides *order* only. It is not where eviction is decided: the master service's
judge says whether a candidate may go (a read lease, a segment that needs no room) and when
enough is freed, and the service removes the victims. Whatever the policy, these rules hold
(DESIGN.md section 5): never an object under a read lease, hard-pinned or mid-write (pending
puts are not in the table at all); soft-pinned objects only after every unpinned candidate.

Two policies, picked by name with `make_policy` (`POLICIES`):

- `ProbationLruPolicy` ("probation", the default): objects that were never read since their
  put are on probation and go first, least recently put first; objects that were read are
  protected, least recently read first, and hold at most 90% of the bytes when victims are
  chosen. An object evicted and put again soon after (a ghost filter remembers recent
  evictions) skips probation. The 10% of objects put or read most recently go after the rest,
  least recently touched first: a reader is often a moment behind its writer. A batch's keys
  are entered last key first, so that a prompt's blocks go from its tail. This is
  segmented LRU (Karedla et al., 1994) with 2Q's ghost admission (Johnson and Shasha, VLDB
  1994) and, for that window, W-TinyLFU's (Einziger et al., 2017) without its admission
  filter. On the FAST'25 trace it beats LRU at every capacity measured (docs/replay.md):
  KV-cache blocks put once and never read again (the tail of every prompt) no longer push out
  the documents and conversation prefixes that are read again and again.
- `LruPolicy` ("lru"): least recently accessed first, in a dict of its own (insertion-ordered;
  an access moves the key to the end).

Another policy (an offline optimum for simulation, kvpool/sim/belady.py) subclasses
`EvictionPolicy` and keeps its own structures.

Eviction for a put that found no room (`select_for_room`) frees a hole, not just bytes: its
first victim is the first candidate whose range, with the free extents around it, fits the key;
the rest of the shortfall goes in policy order. Eviction above the watermark frees bytes.

Scans are bounded (`select_victims(scan_max)`), so that an allocation failure never costs
O(all objects). Candidates that cannot go now are moved behind the others when the scan ends,
so the next bounded scan starts on fresh ones: hard-pinned objects (never candidates) and
leased ones (read within the lease TTL, so the move hardly changes the LRU order).
Soft-pinned objects are in no policy's own order while pinned, only in the table's
`soft_pinned` (last-access order), which the last pass scans. Left in place and skipped, they
used up the bound: with 16,384 of them ahead (a put's bound), a put found no victim, not even
in a cache of soft-pinned objects alone (Mooncake's `with_soft_pin` on every put); skipped
without counting, every put would pay a scan of them all. A lapsed pin (`on_unpin`) joins
the unpinned at the oldest end: unread for the whole soft-pin TTL (30 min by default), it is
older than most of a busy cache.
"""

from __future__ import annotations

import abc
import enum
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from kvpool import limits
from kvpool.errors import InvalidParams
from kvpool.master.allocator import footprint_bytes
from kvpool.master.metadata import replica_offset, replica_segment_index

if TYPE_CHECKING:
    from kvpool.master.membership import Segment
    from kvpool.master.metadata import ObjectMeta, ObjectTable

# At most this many candidates are examined by an eviction that a put_start triggers (hot
# path: ~0.2 us each, so a few ms at worst), and by a watermark eviction in tick(). These
# belong in limits.py; they live here until that file is open to this module's owner.
EVICT_SCAN_CANDIDATES_PUT_MAX = 16_384
EVICT_SCAN_CANDIDATES_TICK_MAX = 262_144
# At most this many candidates are examined for the one victim that makes a hole large enough
# for a put that found free bytes but no free extent (select_for_room).
EVICT_SCAN_HOLE_CANDIDATES_MAX = 256
# At most this many protected objects are demoted for their share of the bytes per choice of
# victims (ProbationLruPolicy, ~2 us each): a cache that filled while everything in it was
# read is over that share by a tenth of its objects at its first eviction (100,000 at a
# million objects: 190 ms in one go, ad hoc); the evictions after it demote the rest.
DEMOTIONS_PER_SELECTION_MAX = 4_096
# At most this many victims per watermark eviction: the master serves no request while it
# evicts (6-10 us per object), so a large segment of small objects is brought under its
# watermark over several ticks (about 0.1 s each) instead of in one stall of seconds. A tick
# that stopped here does not back off.
EVICT_VICTIMS_TICK_MAX = 16_384
# After an eviction that could not free what it needed (everything leased or pinned), the next
# one of the same kind waits this long: leases last seconds, and a scan that finds nothing
# would otherwise run on every put and every tick.
EVICT_SHORTFALL_BACKOFF_MS = 250
# ... but a put's eviction backs off only once it looked at this many candidates: scanning a
# small table again costs less than refusing, for the backoff's length, every put short of
# room, though objects put or leases lapsed meanwhile could make it (a cache of a few large
# objects, most of them leased, refused one put in eight that way).
EVICT_SCAN_BACKOFF_CANDIDATES_MIN = 1_024
# ProbationLruPolicy: the objects put or read most recently, this share of the table's, are
# evicted after all the others: a reader is often a moment behind its writer. Measured
# (2026-12-05): writers reading back each batch right after its put into a full 64 MiB node
# (benchmarks/put_then_get.py) missed none at 5% or 10% with batches of 8, 108 and 6 of 6,400
# with four writers' batches of 32; on the FAST'25 trace (docs/replay.md), 10% moved one
# instance's hit rates by -0.0006 to +0.0033 and four local instances' by -0.0007 to +0.0026,
# 5% by -0.0046 to +0.0018, 20% lost 0.0025 at 500K.
RECENT_OBJECTS_RATIO = 0.10
# ProbationLruPolicy: protected (read) objects hold at most this share of the bytes, so that
# new objects always have room to prove themselves. Measured on the FAST'25 trace (1M, 3M and
# 10M tokens, docs/replay.md): 0.9 and 0.95 are best and alike; 1.0 (probation emptied first,
# always) is as good there but lets a stale protected set lock every new object out.
PROTECTED_BYTES_RATIO_MAX = 0.9
# ProbationLruPolicy: a protected object not read for this many times the table's object
# count in puts is demoted to probation. The ghost filter takes some new keys for ghosts
# (Bloom false positives, GHOST_PROBES) and admits them to protected; unread, and with no
# reads to push them out, they piled up there (a third of a full cache after 6,000 batches of
# puts, with 3 probes), held their ranges while the objects around them were evicted, and cut
# every run put later in pieces: `bench_paths.py fragmentation`.
PROTECTED_IDLE_TURNOVERS_MAX = 8
# The ghost filter remembers the last GHOST_OBJECTS_RATIO x (objects in the table) evictions
# (up to twice that). Measured: x1 gains half of what x4 does; x8 gains no more.
GHOST_OBJECTS_RATIO = 4
GHOST_ENTRIES_MIN = 1_024
# 16 bits and 6 probes per entry: a key never evicted is taken for a ghost ~0.1% of the time
# per filter. With 3 probes it was ~0.5%, and those false ghosts, admitted to protected unread,
# were the islands that cut a churning full cache's runs in pieces: 3 -> 6 probes took the
# pieces per batch late in `bench_paths.py fragmentation` from 12.5 to 3 and the unread
# protected objects from 806 to 126, the replay's hit rates unchanged (docs/replay.md), for
# ~0.4 us more per put into a cache that has evicted (the probes of a key never evicted stop
# at its first clear bit).
GHOST_BITS_PER_ENTRY = 16
GHOST_PROBES = 6


class Verdict(enum.Enum):
    """The judge's answer about one candidate."""

    TAKE = "take"  # evict it.
    SKIP = "skip"  # not useful now (no replica where room is needed): leave it in place.
    DEFER = "defer"  # cannot go now (read lease): the policy may move it out of the way.
    STOP = "stop"  # enough was taken: end the scan (this candidate is not taken).


Judge = Callable[[str, "ObjectMeta"], Verdict]


class EvictionPolicy(abc.ABC):
    """The order of eviction candidates among the complete objects of an `ObjectTable`.

    The table calls `attach` once, then the hooks on every change; `select_victims` never
    changes the table's key set (the caller removes the victims afterwards).
    """

    # Whether a batch's reads and puts reach the hooks last key first. An engine reads and
    # puts a prompt's blocks in prompt order, and a block is worth only as much as the
    # blocks before it (a lookup hits the longest leading run): entered last to first, the
    # first block is the most recent, so eviction takes a prompt's blocks from its tail and
    # what stays is still a prefix that hits. Off for LRU, the textbook order that the trace's
    # reference figures are computed with (tests/test_sim_anchor.py).
    enters_batches_last_key_first: bool = False

    @abc.abstractmethod
    def attach(self, table: ObjectTable) -> None:
        """Bind to the (empty) table whose objects this policy orders."""

    @abc.abstractmethod
    def on_insert(self, key: str, meta: ObjectMeta) -> None:
        """A complete object entered the table (put finished, or adopted from an inventory)."""

    @abc.abstractmethod
    def on_access(self, key: str, meta: ObjectMeta) -> None:
        """The object was read (get_replica_list); existence checks do not count."""

    @abc.abstractmethod
    def on_remove(self, key: str, meta: ObjectMeta) -> None:
        """The object left the table (removed, evicted, or lost with its segments)."""

    def on_remove_many(self, removed: list[tuple[str, ObjectMeta]]) -> None:
        """on_remove for each (key, meta): many objects left at once (a segment left)."""
        for key, meta in removed:
            self.on_remove(key, meta)

    def on_unpin(self, key: str, meta: ObjectMeta) -> None:
        """The object's soft pin expired; it competes with unpinned objects from now on.

        A policy that keeps an order of its own keeps soft-pinned objects out of it (the hooks
        see `meta.soft_pin_expiry_ms`), and enters them here."""

    @abc.abstractmethod
    def select_victims(self, judge: Judge, scan_max: int) -> list[str]:
        """Offer candidates to `judge` in eviction order; return the keys it took, in order.

        Order: every unpinned object first, then the soft-pinned ones; never a hard-pinned
        one. The scan ends when the judge says STOP, after `scan_max` candidates, or when
        candidates run out; soft-pinned objects must not take up the bound before the last
        pass. The judge must not change the table.
        """

    def stats(self) -> dict[str, int]:
        """What the policy can tell an operator (master/metrics.py), by name; none by default."""
        return {}

    def check_invariants(self) -> None:
        """O(n) self-check against the attached table."""


class LruPolicy(EvictionPolicy):
    """Least recently accessed first ("lru").

    Holds `_unpinned`, the keys of the table's objects that are not soft-pinned, in access
    order (oldest first): every access re-inserts its key at the end; and ahead of them
    `_lapsed`, the keys whose soft pin lapsed since their last access, in the order they
    lapsed (a dict cannot put a key at its front). The soft-pinned ones are the table's
    `soft_pinned`, in access order too. Costs: on_insert, on_access, on_remove O(1);
    select_victims O(candidates examined) <= O(scan_max). Memory: one dict entry per
    unpinned object (~31 bytes at a million, measured; an OrderedDict's were 80).
    """

    def __init__(self) -> None:
        self._table: ObjectTable | None = None
        self._unpinned: dict[str, None] = {}
        self._lapsed: dict[str, None] = {}

    def attach(self, table: ObjectTable) -> None:
        assert self._table is None, "policy attached twice"
        assert not table.objects, "attach to an empty table"
        self._table = table

    def on_insert(self, key: str, meta: ObjectMeta) -> None:
        if not meta.soft_pin_expiry_ms:
            self._unpinned[key] = None

    def on_access(self, key: str, meta: ObjectMeta) -> None:
        if not meta.soft_pin_expiry_ms:
            self._forget(key)
            self._unpinned[key] = None

    def on_remove(self, key: str, meta: ObjectMeta) -> None:
        if not meta.soft_pin_expiry_ms:
            self._forget(key)

    def on_remove_many(self, removed: list[tuple[str, ObjectMeta]]) -> None:
        for key, meta in removed:
            if not meta.soft_pin_expiry_ms:
                self._forget(key)

    def _forget(self, key: str) -> None:
        """Take an unpinned key out of its order (a lapsed pin's, or the access order)."""
        try:
            del self._unpinned[key]
        except KeyError:
            del self._lapsed[key]

    def on_unpin(self, key: str, meta: ObjectMeta) -> None:
        self._lapsed[key] = None

    def select_victims(self, judge: Judge, scan_max: int) -> list[str]:
        assert scan_max > 0, scan_max
        table = self._table
        assert table is not None, "policy not attached"
        unpinned = self._unpinned
        victims: list[str] = []
        scanned = 0
        stopped = False
        # Passes 1 and 2: unpinned objects, lapsed pins first, least recently accessed first.
        for keys in (self._lapsed, unpinned) if self._lapsed else (unpinned,):
            deferred, scanned_here, stopped = _take_unpinned(keys, table.objects, judge, scan_max - scanned, victims)
            scanned += scanned_here
            # Move what could not go behind everything else, so the next scan starts on fresh
            # candidates instead of re-reading the same pinned or leased ones.
            for key in deferred:
                del keys[key]
                unpinned[key] = None
            if stopped:
                break
        # Pass 3: soft-pinned objects, least recently accessed first.
        if not stopped:
            _take_soft_pinned(table, judge, scan_max - scanned, victims)
        return victims

    def check_invariants(self) -> None:
        table = self._table
        assert table is not None, "policy not attached"
        unpinned, lapsed, objects = self._unpinned, self._lapsed, table.objects
        assert len(unpinned) + len(lapsed) + len(table.soft_pinned) == len(objects), (
            len(unpinned),
            len(lapsed),
            len(table.soft_pinned),
            len(objects),
        )
        for key in [*lapsed, *unpinned]:
            meta = objects.get(key)
            assert meta is not None, f"{key!r} ordered, not an object"
            assert not meta.soft_pin_expiry_ms, f"{key!r} soft-pinned and ordered as unpinned"
            assert not (key in lapsed and key in unpinned), f"{key!r} ordered twice"


class GhostFilter:
    """The keys evicted lately, without the keys: two Bloom filters in rotation.

    `add` sets GHOST_PROBES bits of the current filter per key; once the current filter holds
    `entries_max` keys it becomes the previous one, and a fresh current filter is sized for the
    `entries_max` of that moment. So a key added within the last `entries_max` adds is always
    found (a Bloom filter has no false negatives), one added more than 2 x entries_max adds ago
    never is, and a key never added is found by mistake with probability ~0.1%. No false
    negatives matters here: the blocks of one prompt are evicted together and come back
    together, and a prefix is only as useful as its first missing block, so a filter that
    forgot one key in twelve (a direct-mapped table, measured) lost most of the gain.
    Memory: 2 bytes per entry per filter, 4 x entries_max bytes in all. Costs: one xxh3 hash
    and GHOST_PROBES (add) or up to twice that (contains: both filters) byte probes.
    """

    __slots__ = ("_count", "_current", "_current_entries_max", "_entries_max", "_is_empty", "_previous")

    def __init__(self, entries_max: int = GHOST_ENTRIES_MIN) -> None:
        self._entries_max = max(entries_max, GHOST_ENTRIES_MIN)
        self._current_entries_max = self._entries_max
        self._current = bytearray(self._entries_max * GHOST_BITS_PER_ENTRY // 8)
        self._previous = bytearray(8)
        self._count = 0
        self._is_empty = True  # nothing added yet (a cluster that never evicted): no hashing

    @property
    def entries_max(self) -> int:
        return self._entries_max

    def resize(self, entries_max: int) -> None:
        """Size the next filter for `entries_max` keys (the current one keeps its size: more
        keys than it was sized for would raise its false positives)."""
        self._entries_max = max(entries_max, GHOST_ENTRIES_MIN)

    def add(self, key: str) -> None:
        self.add_many([key])

    def add_many(self, keys: list[str]) -> None:
        """add() each key, in order; the bits of each run within one filter set at once."""
        done = 0
        while done < len(keys):
            run = keys[done : done + self._current_entries_max - self._count]
            self._set_bits(run)
            self._is_empty = False
            self._count += len(run)
            done += len(run)
            if self._count >= self._current_entries_max:
                self._previous = self._current
                self._current_entries_max = self._entries_max
                self._current = bytearray(self._entries_max * GHOST_BITS_PER_ENTRY // 8)
                self._count = 0

    def _set_bits(self, keys: list[str]) -> None:
        # The probes contains() makes (h1 + i * h2, i < GHOST_PROBES), for every key at once:
        # uint64 holds them exactly (h1, h2 < 2**32).
        digest = xxhash.xxh3_64_intdigest
        hashes = np.fromiter((digest(key.encode()) for key in keys), dtype=np.uint64, count=len(keys))
        h1, h2 = hashes & np.uint64(0xFFFFFFFF), hashes >> np.uint64(32) | np.uint64(1)
        bits = np.frombuffer(self._current, dtype=np.uint8)
        bit_count = np.uint64(len(bits) * 8)
        positions = np.concatenate([(h1 + np.uint64(i) * h2) % bit_count for i in range(GHOST_PROBES)])
        np.bitwise_or.at(bits, positions >> np.uint64(3), np.left_shift(1, positions & np.uint64(7)).astype(np.uint8))

    def contains(self, key: str) -> bool:
        if self._is_empty:
            return False
        h = xxhash.xxh3_64_intdigest(key.encode())
        h1, h2 = h & 0xFFFFFFFF, h >> 32 | 1
        for bits in (self._current, self._previous):
            bit_count = len(bits) << 3
            for i in range(GHOST_PROBES):
                position = (h1 + i * h2) % bit_count
                if not bits[position >> 3] >> (position & 7) & 1:
                    break
            else:
                return True
        return False

    def size_bytes(self) -> int:
        return len(self._current) + len(self._previous)


# ProbationLruPolicy: a recent key's value in place of the epoch of its last read, when it was
# not read since its put.
_UNREAD = -1


class ProbationLruPolicy(EvictionPolicy):
    """Unread objects first (least recently put first), then read ones (least recently read),
    then the most recently put or read (least recently touched first); a batch's keys are
    touched last key first (`enters_batches_last_key_first`).

    Holds three ordered key sets over the table's objects, oldest first, and every object not
    soft-pinned (those are the table's `soft_pinned`) is in exactly one of them: `_recent`
    (the RECENT_OBJECTS_RATIO of the objects put or read most recently), `_probation` (put,
    and not read since; or demoted; or its soft pin lapsed) and `_protected` (read at least
    once, or put again soon after an eviction). A put or a read moves an object to
    the newest end of `_recent`; when victims are chosen, the oldest recent ones past that
    share move on to the newest end of `_protected` if they were read (or put again soon after
    an eviction), else of `_probation`. A window counted in objects, not in time, keeps the
    order a function of the requests alone: `kvpool replay --mode live` hits what the
    simulation does, to the block. When victims are chosen and protected objects hold more
    than PROTECTED_BYTES_RATIO_MAX of the bytes in the table, the oldest protected ones are
    demoted to the newest end of probation first; and one not read for
    PROTECTED_IDLE_TURNOVERS_MAX turnovers of the table (as many puts as it holds objects: an
    epoch; each protected key holds the epoch of its last read) is demoted as puts come.

    Demotion for the cap waits for an eviction because the split between the sets decides
    the order of victims and nothing else: a cache that is not full would otherwise pay a
    demotion for each first read once protected holds its share (a working set read round
    and round: every read a promotion and a demotion, 3 us more per 4 KiB get on the master
    than LRU's, docs/performance.md). In a full cache, evictions come with the puts, so
    probation's order is nearly what demotion at each read gave (the replays' hit rates moved
    by 0.0004 at most, docs/replay.md).

    Victims are offered from probation, then from protected, then from recent, then the
    soft-pinned objects. The recent ones go last because a reader is often a moment behind its
    writer (a decode instance reads a prefill's blocks milliseconds after their put; an
    engine's workers load what its scheduler looked up): the tick's eviction above the
    watermark frees up to 15% of a segment that puts keep full, more than probation's tenth,
    and a put short of room picks among 256 candidates the one that makes it a hole; both
    took the newest objects before their first read (benchmarks/put_then_get.py: one writer
    missed 23 of 6,304 of its pairs, four writers 115 of 6,368). Among them, least recently
    touched first: sparing only the unread made what was read a moment ago the next to go,
    and putting the unread after the read made another writer's batch, about to be read, go
    before what was read a moment earlier. Each victim's key is remembered by a `GhostFilter` sized
    to GHOST_OBJECTS_RATIO x the table: a key put again while remembered counts as read (it
    was wanted once more after it went, which is what a read would have shown had it stayed).

    Why this order for a KV cache: most blocks a request puts are never read again (58% of the
    blocks of the FAST'25 trace are used exactly once: each prompt's own tail), while a
    document or a conversation prefix that was read once is read again and again, minutes
    apart. LRU lets a burst of one-use blocks push those out; here the one-use blocks only cycle
    through probation. Prefix structure falls out of the same rule: a block is read only when
    its whole prefix hits, so a prefix's blocks are promoted and demoted together.

    Costs: on_insert, on_access, on_remove O(1) (OrderedDict moves, one hash for the ghost);
    select_victims O(demotions + candidates examined) <= O(2 scan_max). Memory: ~80 bytes per
    object for the ordered sets (the key strings are the table's) and ~16 bytes for the ghost
    filter.

    Args:
        protected_bytes_ratio_max: the share of bytes read objects may hold, in (0, 1].
        ghost_objects_ratio: evictions remembered, per object in the table (0: no ghost).
        recent_objects_ratio: the share of the objects that is recent, in [0, 1).
    """

    enters_batches_last_key_first = True

    def __init__(
        self,
        protected_bytes_ratio_max: float = PROTECTED_BYTES_RATIO_MAX,
        ghost_objects_ratio: int = GHOST_OBJECTS_RATIO,
        recent_objects_ratio: float = RECENT_OBJECTS_RATIO,
    ) -> None:
        if not 0.0 <= recent_objects_ratio < 1.0:
            raise InvalidParams(f"recent_objects_ratio {recent_objects_ratio} not in [0, 1)")
        if not 0.0 < protected_bytes_ratio_max <= 1.0:
            raise InvalidParams(f"protected_bytes_ratio_max {protected_bytes_ratio_max} not in (0, 1]")
        if ghost_objects_ratio < 0:
            raise InvalidParams(f"ghost_objects_ratio {ghost_objects_ratio} < 0")
        self._table: ObjectTable | None = None
        self._probation: OrderedDict[str, None] = OrderedDict()
        self._protected: OrderedDict[str, int] = OrderedDict()  # key -> epoch of its last read
        self._recent: OrderedDict[str, int] = OrderedDict()  # key -> epoch of its last read, or _UNREAD
        self._recent_read = 0  # recent keys that were read
        self._recent_objects_ratio = recent_objects_ratio
        self._epoch = 0
        self._puts_left_in_epoch = 1
        self._idle_checked_epoch = -1  # the oldest protected object was fresh in this epoch
        self._probation_bytes = 0
        self._protected_bytes = 0
        self._recent_bytes = 0
        self._protected_bytes_ratio_max = protected_bytes_ratio_max
        self._ghost_objects_ratio = ghost_objects_ratio
        self._ghost = GhostFilter() if ghost_objects_ratio else None
        self._readmissions = 0  # keys put again while the ghost filter remembered their eviction

    def __repr__(self) -> str:
        return (
            f"<ProbationLruPolicy probation={len(self._probation)} ({self._probation_bytes} B) "
            f"protected={len(self._protected)} ({self._protected_bytes} B) "
            f"recent={len(self._recent)} ({self._recent_bytes} B)>"
        )

    @property
    def probation_count(self) -> int:
        """Objects not read since their put (or demoted), recent ones included; soft-pinned
        ones are in neither count."""
        return len(self._probation) + len(self._recent) - self._recent_read

    @property
    def protected_count(self) -> int:
        """Objects read (or put again soon after an eviction), recent ones included."""
        return len(self._protected) + self._recent_read

    def is_protected(self, key: str) -> bool:
        read_epoch = self._recent.get(key)
        return key in self._protected if read_epoch is None else read_epoch != _UNREAD

    def stats(self) -> dict[str, int]:
        """The objects read and not read (recent ones counted by whether they were), and the
        readmissions: objects put again while the ghost filter remembered their eviction
        (~0.1% of other puts count too, its false positives). A readmission is a KV block
        evicted and then needed again: what more capacity would have kept, the operator's
        signal that the cache is too small for its traffic."""
        return {
            "probation_objects": self.probation_count,
            "protected_objects": self.protected_count,
            "readmissions": self._readmissions,
        }

    def attach(self, table: ObjectTable) -> None:
        assert self._table is None, "policy attached twice"
        assert not table.objects, "attach to an empty table"
        self._table = table

    def on_insert(self, key: str, meta: ObjectMeta) -> None:
        self._puts_left_in_epoch -= 1
        if self._puts_left_in_epoch <= 0:
            self._epoch += 1
            self._puts_left_in_epoch = max(len(self._table.objects), 1)  # type: ignore[union-attr]
        ghost = self._ghost
        readmitted = ghost is not None and ghost.contains(key)
        self._readmissions += readmitted
        if not meta.soft_pin_expiry_ms:
            self._enter(key, meta.size_bytes, read=readmitted)
        if self._idle_checked_epoch != self._epoch and self._protected:
            self._demote_idle()

    def on_access(self, key: str, meta: ObjectMeta) -> None:
        if meta.soft_pin_expiry_ms:
            return
        recent = self._recent
        read_epoch = recent.get(key)
        if read_epoch is None:
            self._leave(key, meta.size_bytes)
            self._enter(key, meta.size_bytes, read=True)
        else:
            recent.move_to_end(key)
            recent[key] = self._epoch
            self._recent_read += read_epoch == _UNREAD

    def on_remove(self, key: str, meta: ObjectMeta) -> None:
        if meta.soft_pin_expiry_ms:
            return
        read_epoch = self._recent.pop(key, None)
        if read_epoch is None:
            self._leave(key, meta.size_bytes)
        else:
            self._recent_bytes -= meta.size_bytes
            self._recent_read -= read_epoch != _UNREAD

    def on_unpin(self, key: str, meta: ObjectMeta) -> None:
        # Unread for the soft-pin TTL: first to go (the module docstring).
        self._settle(key, meta.size_bytes, _UNREAD)
        self._probation.move_to_end(key, last=False)

    def _enter(self, key: str, size_bytes: int, read: bool) -> None:
        """Put `key` at the newest end of recent; with no recent share, of protected if it was
        read, else of probation."""
        read_epoch = self._epoch if read else _UNREAD
        if self._recent_objects_ratio:
            self._recent[key] = read_epoch
            self._recent_bytes += size_bytes
            self._recent_read += read
        else:
            self._settle(key, size_bytes, read_epoch)

    def _trim_recent(self, count_max: int) -> None:
        """Move the oldest recent objects past recent's share on, to protected (if read) or
        probation, `count_max` at most. Done when victims are chosen, not at each put or read:
        a cache with room pays nothing for it (a put's master work was 1.0 -> 1.8 us per key
        when each put moved one on, `bench_paths.py master`), and as with demotions, the
        bound keeps the first eviction of a cache that filled short."""
        table = self._table
        assert table is not None, "policy not attached"
        recent, objects = self._recent, table.objects
        recent_max = int(self._recent_objects_ratio * (len(objects) - len(table.soft_pinned)))
        for _ in range(min(len(recent) - recent_max, count_max)):
            oldest, read_epoch = recent.popitem(last=False)
            size_bytes = objects[oldest].size_bytes
            self._recent_bytes -= size_bytes
            self._recent_read -= read_epoch != _UNREAD
            self._settle(oldest, size_bytes, read_epoch)

    def _settle(self, key: str, size_bytes: int, read_epoch: int) -> None:
        """Put a key that is in no set at the newest end of protected if it was read (in
        `read_epoch`), else of probation."""
        if read_epoch == _UNREAD:
            self._probation[key] = None
            self._probation_bytes += size_bytes
        else:
            self._protected[key] = read_epoch
            self._protected_bytes += size_bytes

    def _leave(self, key: str, size_bytes: int) -> None:
        """Take a key that is not recent out of protected or probation."""
        if key in self._protected:
            del self._protected[key]
            self._protected_bytes -= size_bytes
        else:
            del self._probation[key]
            self._probation_bytes -= size_bytes

    def _demote_overflow(self, count_max: int) -> None:
        """Demote the oldest protected objects while they hold too large a share of the bytes,
        `count_max` at most. Each promotion since the last call overflows by at most one
        object, so this is O(1) per promotion; the bound keeps the first eviction of a cache
        that filled while everything was read (protected holding all of it) short: the next
        evictions demote the rest (DEMOTIONS_PER_SELECTION_MAX)."""
        protected = self._protected
        total_bytes = self._protected_bytes + self._probation_bytes + self._recent_bytes
        limit_bytes = self._protected_bytes_ratio_max * total_bytes
        while self._protected_bytes > limit_bytes and len(protected) > 1 and count_max > 0:
            self._demote_oldest()
            count_max -= 1

    def _demote_idle(self) -> None:
        """Demote the oldest protected objects if no read touched them for the last
        PROTECTED_IDLE_TURNOVERS_MAX epochs, two at most per put: protected objects go stale
        at most one per put, in a burst at an epoch's start, so this keeps pace within an
        epoch at bounded cost per call. Protected keys are in order of their last read, so
        once the oldest is fresh, all are until the next epoch: no look until then."""
        protected = self._protected
        stale = self._epoch - PROTECTED_IDLE_TURNOVERS_MAX
        for _ in range(2):
            if next(iter(protected.values())) > stale:
                self._idle_checked_epoch = self._epoch
                return
            self._demote_oldest()
            if not protected:
                return

    def _demote_oldest(self) -> None:
        """Move the least recently read protected object to the newest end of probation."""
        key, _ = self._protected.popitem(last=False)
        size_bytes = self._table.objects[key].size_bytes  # type: ignore[union-attr]
        self._protected_bytes -= size_bytes
        self._settle(key, size_bytes, _UNREAD)

    def select_victims(self, judge: Judge, scan_max: int) -> list[str]:
        """Victims in the order of the class docstring."""
        assert scan_max > 0, scan_max
        table = self._table
        assert table is not None, "policy not attached"
        objects = table.objects
        self._trim_recent(min(scan_max, DEMOTIONS_PER_SELECTION_MAX))
        self._demote_overflow(min(scan_max, DEMOTIONS_PER_SELECTION_MAX))
        victims: list[str] = []
        scanned = 0
        stopped = False
        # Passes 1 to 3: unpinned objects, each set oldest first.
        for keys in (self._probation, self._protected, self._recent):
            deferred, scanned_here, stopped = _take_unpinned(keys, objects, judge, scan_max - scanned, victims)
            scanned += scanned_here
            # Move what could not go behind the rest of its set, so the next scan starts on
            # fresh candidates instead of re-reading the same pinned or leased ones.
            for key in deferred:
                keys.move_to_end(key)
            if stopped:
                break
        # Pass 4: soft-pinned objects, least recently accessed first.
        if not stopped:
            _take_soft_pinned(table, judge, scan_max - scanned, victims)
        ghost = self._ghost
        if ghost is not None and victims:
            ghost.resize(self._ghost_objects_ratio * len(objects))
            ghost.add_many(victims)
        return victims

    def check_invariants(self) -> None:
        table = self._table
        assert table is not None, "policy not attached"
        probation, protected, recent, objects = self._probation, self._protected, self._recent, table.objects
        assert len(probation) + len(protected) + len(recent) + len(table.soft_pinned) == len(objects), (
            len(probation),
            len(protected),
            len(recent),
            len(table.soft_pinned),
            len(objects),
        )
        sizes = {}
        for name, keys in (("probation", probation), ("protected", protected), ("recent", recent)):
            total = 0
            for key in keys:
                assert key in objects, f"{name} holds {key!r}, not an object"
                assert not objects[key].soft_pin_expiry_ms, f"{name} holds {key!r}, soft-pinned"
                total += objects[key].size_bytes
            sizes[name] = total
        assert sizes == {
            "probation": self._probation_bytes,
            "protected": self._protected_bytes,
            "recent": self._recent_bytes,
        }, sizes
        for key, epoch in protected.items():
            assert epoch <= self._epoch, (key, epoch, self._epoch)
        read = 0
        for key, read_epoch in recent.items():
            assert key not in probation and key not in protected, f"{key!r} in two sets"
            assert read_epoch <= self._epoch, (key, read_epoch)
            read += read_epoch != _UNREAD
        assert read == self._recent_read, (read, self._recent_read)


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "probation": ProbationLruPolicy,
    "lru": LruPolicy,
}
POLICY_DEFAULT = limits.EVICTION_POLICY_DEFAULT


def make_policy(name: str = POLICY_DEFAULT) -> EvictionPolicy:
    """A fresh policy by name (`POLICIES`); the master's default when no name is given.

    Raises:
        InvalidParams: an unknown name.
    """
    factory = POLICIES.get(name)
    if factory is None:
        raise InvalidParams(f"eviction policy {name!r} not one of {sorted(POLICIES)}")
    return factory()


# --- what to evict: the judges of the two triggers ---------------------------------------


def _take_unpinned(
    keys: Iterable[str], objects: dict[str, ObjectMeta], judge: Judge, scan_max: int, victims: list[str]
) -> tuple[list[str], int, bool]:
    """A pass of every policy over unpinned objects, in the order of `keys` (which holds no
    soft-pinned one): each judged one is appended to `victims` if taken. Returns the keys to
    move behind the rest (hard-pinned ones, never candidates, and deferred ones), how many
    keys were scanned, and whether the scan must end (`scan_max` reached, or the judge said
    STOP)."""
    deferred: list[str] = []
    scanned = 0
    for key in keys:
        if scanned >= scan_max:
            return deferred, scanned, True
        scanned += 1
        meta = objects[key]
        if meta.is_hard_pinned:
            deferred.append(key)
            continue
        verdict = judge(key, meta)
        if verdict is Verdict.TAKE:
            victims.append(key)
        elif verdict is Verdict.DEFER:
            deferred.append(key)
        elif verdict is Verdict.STOP:
            return deferred, scanned, True
    return deferred, scanned, False


def _take_soft_pinned(table: ObjectTable, judge: Judge, scan_max: int, victims: list[str]) -> None:
    """The last pass of every policy: soft-pinned objects, least recently accessed first."""
    objects = table.objects
    for scanned, key in enumerate(table.soft_pinned):
        if scanned >= scan_max:
            break
        verdict = judge(key, objects[key])
        if verdict is Verdict.TAKE:
            victims.append(key)
        elif verdict is Verdict.STOP:
            break


def drop_bytes_in_flight(segments: list[Segment]) -> int:
    """Bytes these segments will have free once the drops and offloads under way land."""
    return sum(segment.drop_bytes for segment in segments)


def select_for_room(
    policy: EvictionPolicy,
    active: list[Segment],
    shortfall_bytes: int,
    now_ms: int,
    claimed_bytes: int = 0,
    hole_bytes: int = 0,
) -> tuple[list[str], bool]:
    """Victims after an allocation failure: objects with replicas on active segments, until
    `shortfall_bytes` more are scheduled for freeing than the drops already in flight, less
    `claimed_bytes` of them that other puts waiting for room count on.

    Bytes are not room: a key needs one free extent of its footprint, and the oldest objects
    lie wherever they lie. So when `hole_bytes` (the largest footprint that found no room) is
    given, the first victim is the oldest object whose range, with the free extents it
    touches, makes a hole that large (`_oldest_hole_maker`); the rest go in policy order.

    Returns the victims and whether puts should not scan again for a while: the victims fall
    short of the need after a scan of EVICT_SCAN_BACKOFF_CANDIDATES_MIN candidates or more.
    Nothing when the unclaimed drops in flight cover the shortfall: once the server flushes
    them and the nodes acknowledge, the room is there. Bounded by
    EVICT_SCAN_CANDIDATES_PUT_MAX, and EVICT_SCAN_HOLE_CANDIDATES_MAX more for the hole.
    """
    remaining = shortfall_bytes - max(0, drop_bytes_in_flight(active) - claimed_bytes)
    if remaining <= 0:
        return [], False
    by_index = {segment.index: segment for segment in active}

    def freed_bytes(meta: ObjectMeta) -> int:
        useful = sum(1 for r in meta.replica_tuple() if replica_segment_index(r) in by_index)
        return useful * footprint_bytes(meta.size_bytes)

    victims: list[str] = []
    found = _oldest_hole_maker(policy, by_index, hole_bytes, now_ms) if hole_bytes else None
    if found is not None:
        victims.append(found[0])
        remaining -= freed_bytes(found[1])

    examined = 0

    def judge(key: str, meta: ObjectMeta) -> Verdict:
        nonlocal remaining, examined
        examined += 1
        if remaining <= 0:
            return Verdict.STOP
        if meta.lease_expiry_ms > now_ms:
            return Verdict.DEFER
        if found is not None and key == found[0]:
            return Verdict.SKIP  # taken already
        freed = freed_bytes(meta)
        if not freed:
            return Verdict.SKIP  # Only on draining segments: evicting it frees nothing usable.
        remaining -= freed
        return Verdict.TAKE

    if remaining > 0:
        victims += policy.select_victims(judge, EVICT_SCAN_CANDIDATES_PUT_MAX)
    return victims, remaining > 0 and examined >= EVICT_SCAN_BACKOFF_CANDIDATES_MIN


def _oldest_hole_maker(
    policy: EvictionPolicy, by_index: dict[int, Segment], hole_bytes: int, now_ms: int
) -> tuple[str, ObjectMeta] | None:
    """The first candidate in policy order that may go and whose range on some active segment,
    freed, makes a free extent of at least `hole_bytes`; None when the first
    EVICT_SCAN_HOLE_CANDIDATES_MAX candidates hold none. In a cache of one object size this
    is the first candidate that may go: the order is the policy's."""
    found: tuple[str, ObjectMeta] | None = None

    def judge(key: str, meta: ObjectMeta) -> Verdict:
        nonlocal found
        if found is not None or meta.soft_pin_expiry_ms:
            return Verdict.STOP  # soft-pinned objects come last (the policy's last pass): only by bytes
        if meta.lease_expiry_ms > now_ms:
            return Verdict.SKIP  # the bytes pass defers it
        for replica in meta.replica_tuple():
            segment = by_index.get(replica_segment_index(replica))
            if segment is not None and (
                segment.allocator.hole_bytes_if_freed(replica_offset(replica), meta.size_bytes) >= hole_bytes
            ):
                found = (key, meta)
                return Verdict.TAKE
        return Verdict.SKIP

    policy.select_victims(judge, EVICT_SCAN_HOLE_CANDIDATES_MAX)
    return found


def select_above_watermark(
    policy: EvictionPolicy, active: list[Segment], ratio_high: float, ratio: float, now_ms: int
) -> tuple[list[str], bool]:
    """Victims for the active segments above the high watermark, and whether they fall short.

    A segment at used ratio u > ratio_high needs max(ratio, u - ratio_high + ratio) of its
    capacity scheduled for freeing (Mooncake's BatchEvict target, master_service.cpp), counting
    its drops in flight, so that a slow acknowledgement never evicts twice for the same need.
    Candidates are the objects with a replica on such a segment; one eviction frees every
    replica. Bounded by EVICT_SCAN_CANDIDATES_TICK_MAX candidates and EVICT_VICTIMS_TICK_MAX
    victims; stopping at the latter is not falling short (the next tick goes on).
    """
    goals: dict[int, int] = {}
    for segment in active:
        allocator = segment.allocator
        used_ratio = allocator.used_bytes / allocator.capacity_bytes
        if used_ratio <= ratio_high:
            continue
        goal = int(max(ratio, used_ratio - ratio_high + ratio) * allocator.capacity_bytes)
        goal -= segment.drop_bytes
        if goal > 0:
            goals[segment.index] = goal
    if not goals:
        return [], False

    taken = 0

    def judge(key: str, meta: ObjectMeta) -> Verdict:
        nonlocal taken
        if not goals or taken >= EVICT_VICTIMS_TICK_MAX:
            return Verdict.STOP
        if meta.lease_expiry_ms > now_ms:
            return Verdict.DEFER
        replicas = meta.replicas
        if type(replicas) is int:  # one replica, the common case: one goal to look up
            index = replica_segment_index(replicas)
            goal = goals.get(index)
            if goal is None:
                return Verdict.SKIP
            goal -= footprint_bytes(meta.size_bytes)
            if goal > 0:
                goals[index] = goal
            else:
                del goals[index]
            taken += 1
            return Verdict.TAKE
        if not any(replica_segment_index(r) in goals for r in replicas):
            return Verdict.SKIP
        footprint = footprint_bytes(meta.size_bytes)
        for packed in replicas:
            index = replica_segment_index(packed)
            if index in goals:
                goals[index] -= footprint
                if goals[index] <= 0:
                    del goals[index]
        taken += 1
        return Verdict.TAKE

    victims = policy.select_victims(judge, EVICT_SCAN_CANDIDATES_TICK_MAX)
    return victims, bool(goals) and taken < EVICT_VICTIMS_TICK_MAX
