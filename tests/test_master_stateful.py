"""The object lifecycle of MasterService against a naive model, under random interleavings.

How: a hypothesis RuleBasedStateMachine drives mount / heartbeat / a lost node link / drain / unmount,
put_start / put_end (+ finish, immediately or held across other steps) / put_revoke, get,
exists, remove, remove_by_regex, advance_clock, tick, drop acknowledgements and a master
restart (a new service rebuilt from the nodes' inventories). The model is plain dicts: the
acknowledged objects with their replicas, puts in flight, leases, and for every segment the
byte ranges that must not be handed out (replicas, puts in flight, quarantined ranges, drops
not yet acknowledged). After every step the invariant calls `check_invariants()` and compares:
exactly the model's objects are visible, with their size, checksum and replicas, but for those
whose every replica is on a node whose link is lost (read as missing, put anew); per-segment
used bytes equal the model's busy ranges; every new grant lies on free model space (so a range
is never reused before its drop is acknowledged). Evictions are the one thing the model does
not predict: it reads them from the drop outbox after each step and checks that no evicted
object was leased or hard-pinned, and that an eviction took every replica. The machine runs
twice: with the default eviction policy (ProbationLru) and with LRU.
"""

from __future__ import annotations

import dataclasses
import random
import re

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool import limits
from kvpool.config import MasterConfig
from kvpool.errors import ErrorCode, SegmentNotFound
from kvpool.master.allocator import footprint_bytes
from kvpool.master.eviction import POLICY_DEFAULT, make_policy
from kvpool.master.service import MasterService, PendingCommit
from kvpool.protocol.messages import (
    DrainSegment,
    ExistKeys,
    GetReplicaList,
    Heartbeat,
    InventoryEntry,
    LongestPrefix,
    MountSegment,
    PutEnd,
    PutRevoke,
    PutStart,
    QueryObjects,
    ReleaseLeases,
    Remove,
    RemoveByRegex,
    ReplicateConfig,
    SegmentInfo,
    UnmountSegment,
)

KIB, MIB = limits.KIB, limits.MIB
OK = int(ErrorCode.OK)
KEYS = [f"k{i}" for i in range(10)]
SEGMENTS = ["s0", "s1", "s2"]
SIZES = [1, 100 * KIB, 256 * KIB, 320 * KIB]
PATTERNS = ["^k[0-3]$", "5", "k", "^x"]
CONFIG = MasterConfig(
    lease_ttl_ms=1_000,
    soft_pin_ttl_ms=3_000,
    put_discard_timeout_ms=2_000,
    put_release_timeout_ms=5_000,
    evict_watermark_ratio_high=0.8,
    evict_ratio=0.2,
    node_ttl_ms=8_000,
)


def checksum_of(key: str, size: int) -> int:
    return (hash(key) * 31 + size) & (2**64 - 1)


@dataclasses.dataclass
class Obj:
    size: int
    checksum: int
    replicas: dict[str, int]  # segment id -> offset
    is_hard_pinned: bool


@dataclasses.dataclass
class Put:
    size: int
    start_ms: int
    grants: dict[str, int]  # segment id -> offset
    is_hard_pinned: bool
    is_committing: bool = False


@dataclasses.dataclass
class Seg:
    capacity: int
    last_seen_ms: int
    drain_deadline_ms: int | None = None
    is_reachable: bool = True  # the master holds a connection to its node
    busy: dict[int, tuple[int, str, str]] = dataclasses.field(default_factory=dict)
    # offset -> (footprint, kind, key); kind: obj | put | quar | drop


class MasterMachine(RuleBasedStateMachine):
    POLICY = POLICY_DEFAULT  # eviction policy (LruMasterMachine below runs LRU)

    @initialize(seed=st.integers(0, 2**16))
    def setup(self, seed: int) -> None:
        self.seed = seed
        self.service = MasterService(CONFIG, random.Random(seed), None, policy=make_policy(self.POLICY))
        self.now = 1_000
        self.segments: dict[str, Seg] = {}
        self.objects: dict[str, Obj] = {}
        self.pending: dict[str, Put] = {}
        self.leases: dict[str, int] = {}
        self.readers: dict[str, int] = {}  # leases granted since the last lapse, not given back
        self.awaited: dict[str, int] = {}  # reads a lookup's hold awaits (since the last lapse)
        self.granted: list[tuple[int, str]] = []  # leases a reader may give back: (time, key)
        self.quarantine: list[tuple[int, str, int]] = []  # release_ms, segment, offset
        self.taken: list[tuple[str, InventoryEntry]] = []  # drops sent, not yet acknowledged
        self.held: PendingCommit | None = None
        for segment_id, capacity in (("s0", MIB), ("s1", 2 * MIB)):
            self._mount(segment_id, capacity)

    def _mount(self, segment_id: str, capacity: int) -> None:
        token = b"t-" + segment_id.encode()  # each its own: the master refuses a second holder
        info = SegmentInfo(segment_id, f"node-{segment_id}", "host", "host:1", "", token, capacity)
        reply = self.service.mount_segment(MountSegment(info, []), self.now)
        assert reply.rejected == []
        self.segments[segment_id] = Seg(capacity, self.now)

    # --- model helpers ---------------------------------------------------------------

    def _occupy(self, segment_id: str, offset: int, size: int, kind: str, key: str) -> None:
        seg = self.segments[segment_id]
        footprint = footprint_bytes(size)
        for other, (other_size, other_kind, other_key) in seg.busy.items():
            assert offset + footprint <= other or other + other_size <= offset, (
                f"{kind} {key} at {segment_id}:{offset}+{footprint} overlaps "
                f"{other_kind} {other_key} at {other}+{other_size}"
            )
        seg.busy[offset] = (footprint, kind, key)

    def _release(self, segment_id: str, offset: int) -> None:
        seg = self.segments.get(segment_id)
        if seg is not None:
            del seg.busy[offset]

    def _mark(self, segment_id: str, offset: int, kind: str) -> None:
        seg = self.segments[segment_id]
        footprint, _, key = seg.busy[offset]
        seg.busy[offset] = (footprint, kind, key)

    def _drop_object(self, key: str) -> None:
        obj = self.objects.pop(key)
        self.leases.pop(key, None)
        for segment_id, offset in obj.replicas.items():
            self._mark(segment_id, offset, "drop")

    def _unmount_model(self, segment_id: str) -> None:
        del self.segments[segment_id]
        for key in list(self.objects):
            obj = self.objects[key]
            obj.replicas.pop(segment_id, None)
            if not obj.replicas:
                del self.objects[key]
                self.leases.pop(key, None)
        for put in self.pending.values():
            put.grants.pop(segment_id, None)
        self.quarantine = [q for q in self.quarantine if q[1] != segment_id]
        self.taken = [t for t in self.taken if t[0] != segment_id]

    def _is_readable(self, key: str) -> bool:
        """A complete object with a replica on a segment whose node's connection the master
        holds: any other reads as missing (exists, prefix, query, get) and a put writes it anew."""
        obj = self.objects.get(key)
        return obj is not None and any(self.segments[s].is_reachable for s in obj.replicas)

    def _is_leased(self, key: str) -> bool:
        return self.leases.get(key, 0) > self.now

    def _sync_drops(self, may_evict: bool) -> None:
        """Read the drop outbox: expected drops (removes) and evictions (checked)."""
        evicted: dict[str, dict[str, int]] = {}
        for segment_id, entries in self.service.take_drops().items():
            seg = self.segments[segment_id]
            for entry in entries:
                footprint, kind, key = seg.busy[entry.offset]
                assert key == entry.key, (entry, key)
                if kind == "obj":
                    evicted.setdefault(entry.key, {})[segment_id] = entry.offset
                else:
                    assert kind == "drop", (entry, kind)
                self.taken.append((segment_id, entry))
        for key, replicas in evicted.items():
            assert may_evict, f"{key} evicted by a step that never evicts"
            obj = self.objects[key]
            assert replicas == obj.replicas, f"eviction of {key} left replicas: {replicas} vs {obj.replicas}"
            assert not self._is_leased(key), f"evicted {key} under a lease"
            assert not obj.is_hard_pinned, f"evicted hard-pinned {key}"
            self._drop_object(key)
            event("evicted")

    # --- membership ------------------------------------------------------------------

    @precondition(lambda self: len(self.segments) < len(SEGMENTS))
    @rule(data=st.data(), capacity=st.sampled_from([MIB, 2 * MIB]))
    def mount(self, data, capacity: int) -> None:
        segment_id = data.draw(st.sampled_from([s for s in SEGMENTS if s not in self.segments]))
        self._mount(segment_id, capacity)

    @precondition(lambda self: self.segments)
    @rule(data=st.data())
    def heartbeat(self, data) -> None:
        ids = data.draw(st.lists(st.sampled_from(SEGMENTS), unique=True, min_size=1))
        unknown = self.service.heartbeat(Heartbeat(ids), self.now).unknown_segment_ids
        assert unknown == [s for s in ids if s not in self.segments]
        for segment_id in ids:
            if segment_id in self.segments:
                self.segments[segment_id].last_seen_ms = self.now
                self.segments[segment_id].is_reachable = True

    @precondition(lambda self: self.segments)
    @rule(data=st.data())
    def lose_node_link(self, data) -> None:
        """The node's connection closed (it died, or the network blinked): nothing new goes
        there until it speaks again; its replicas stay until the TTL."""
        ids = data.draw(st.lists(st.sampled_from(sorted(self.segments)), unique=True, min_size=1))
        self.service.node_link_lost(ids)
        for segment_id in ids:
            self.segments[segment_id].is_reachable = False

    @rule(segment_id=st.sampled_from(SEGMENTS))
    def unmount(self, segment_id: str) -> None:
        if segment_id not in self.segments:
            try:
                self.service.unmount_segment(UnmountSegment(segment_id), self.now)
            except SegmentNotFound:
                return
            raise AssertionError("unmount of an unknown segment succeeded")
        self.service.unmount_segment(UnmountSegment(segment_id), self.now)
        self._finish_leaving()
        self._unmount_model(segment_id)

    @precondition(lambda self: self.segments)
    @rule(data=st.data(), timeout_ms=st.integers(0, 10_000))
    def drain(self, data, timeout_ms: int) -> None:
        segment_id = data.draw(st.sampled_from(sorted(self.segments)))
        self.service.drain_segment(DrainSegment(segment_id, timeout_ms), self.now)
        self.segments[segment_id].drain_deadline_ms = self.now + timeout_ms

    # --- puts ----------------------------------------------------------------------------

    @rule(
        keys=st.lists(st.sampled_from(KEYS), unique=True, min_size=1, max_size=4),
        size=st.sampled_from(SIZES),
        replica_num=st.integers(1, 3),
        pin=st.sampled_from(["none", "none", "soft", "hard"]),
        placement=st.sampled_from(["random", "free_ratio", "local", "preferred"]),
    )
    def put_start(self, keys: list[str], size: int, replica_num: int, pin: str, placement: str) -> None:
        self._start(keys, size, replica_num, pin, placement)

    @rule(
        keys=st.lists(st.sampled_from(KEYS), unique=True, min_size=1, max_size=4),
        size=st.sampled_from(SIZES),
        replica_num=st.integers(1, 3),
        pin=st.sampled_from(["none", "none", "none", "soft", "hard"]),
        data=st.data(),
    )
    def put(self, keys: list[str], size: int, replica_num: int, pin: str, data) -> None:
        """The whole put in one step, as most puts go."""
        self._start(keys, size, replica_num, pin, "random")
        started = [key for key in keys if key in self.pending and not self.pending[key].is_committing]
        if started:
            self._finish(self._end(started), data)

    def _start(self, keys: list[str], size: int, replica_num: int, pin: str, placement: str) -> None:
        config = ReplicateConfig(
            replica_num=replica_num,
            with_soft_pin=pin == "soft",
            with_hard_pin=pin == "hard",
            placement=placement,
            preferred_segments=list(reversed(SEGMENTS)),
        )
        reply = self.service.put_start(PutStart(keys, [size] * len(keys), config, "host"), self.now)
        for index, (key, code) in enumerate(zip(keys, reply.codes)):
            granted = [(grant.segment_id, grant.offset + start) for grant, start in reply.replicas_of(index)]
            if self._is_readable(key):
                assert code == ErrorCode.OBJECT_ALREADY_EXISTS, (key, code)
            elif key in self.pending:
                assert code == ErrorCode.REPLICA_IS_NOT_READY, (key, code)
            elif code == ErrorCode.NO_AVAILABLE_HANDLE:
                assert granted == []
                event("no room")
            else:
                assert code == OK, (key, code)
                assert 1 <= len(granted) <= replica_num
                is_hard_pinned = pin == "hard"
                if key in self.objects:  # no replica readable (their node's link lost): written anew
                    is_hard_pinned = is_hard_pinned or self.objects[key].is_hard_pinned  # its pin kept
                    self._drop_object(key)
                    event("put anew: its replicas unreadable")
                put = Put(size, self.now, {}, is_hard_pinned)
                for segment_id, offset in granted:
                    seg = self.segments[segment_id]
                    assert seg.drain_deadline_ms is None, "allocated on a draining segment"
                    assert seg.is_reachable, "allocated on a segment whose node is unreachable"
                    assert segment_id not in put.grants, "two replicas on one segment"
                    self._occupy(segment_id, offset, size, "put", key)
                    put.grants[segment_id] = offset
                for grant, start in reply.replicas_of(index):
                    assert 0 <= start and start + size <= grant.size, "a range outside its grant"
                self.pending[key] = put
        self._sync_drops(may_evict=True)

    def _end(self, keys: list[str]) -> PendingCommit:
        pending = self.service.put_end(PutEnd(keys, [checksum_of(k, self._size(k)) for k in keys]), self.now)
        for key, code in zip(keys, pending.codes):
            put = self.pending.get(key)
            if put is None:
                expected = (
                    ErrorCode.OBJECT_ALREADY_EXISTS if key in self.objects else ErrorCode.OBJECT_NOT_FOUND
                )
            elif put.is_committing:
                expected = ErrorCode.REPLICA_IS_NOT_READY
            elif not put.grants:
                expected = ErrorCode.TRANSFER_FAIL
                del self.pending[key]
            else:
                expected = OK
                put.is_committing = True
            assert code == expected, (key, code, expected)
        return pending

    def _size(self, key: str) -> int:
        put = self.pending.get(key)
        return put.size if put is not None else 1

    def _finish(self, pending: PendingCommit, data) -> None:
        results = {}
        for segment_id, entries in pending.commits.items():
            answer = data.draw(st.sampled_from(["ok", "ok", "fail", "mixed", "silent"]))
            if answer == "silent":
                continue
            codes = [OK if answer == "ok" else int(ErrorCode.TRANSFER_FAIL)] * len(entries)
            if answer == "mixed":
                codes = [data.draw(st.sampled_from([OK, int(ErrorCode.TRANSFER_FAIL)])) for _ in entries]
            results[segment_id] = codes
        good: dict[str, set[str]] = {}
        for segment_id, entries in pending.commits.items():
            is_answered = segment_id in results
            for entry, code in zip(entries, results.get(segment_id, [-1] * len(entries))):
                put = self.pending[entry.key]
                if put.grants.get(segment_id) != entry.offset:
                    continue  # its segment went away during the commit
                if code == OK:
                    good.setdefault(entry.key, set()).add(segment_id)
                else:
                    del put.grants[segment_id]
                    if is_answered:  # refused: free at once
                        self._release(segment_id, entry.offset)
                    else:  # no answer: the node may hold it; dropped before reuse
                        self._mark(segment_id, entry.offset, "drop")
        codes = self.service.finish_put_end(pending, results, self.now).codes
        for index in pending.awaiting:
            key = pending.keys[index]
            put = self.pending.pop(key)
            assert set(put.grants) == good.get(key, set()), (key, put.grants, good)
            if put.grants:
                assert codes[index] == OK, (key, codes[index])
                event("put acknowledged")
                checksum = checksum_of(key, put.size)
                self.objects[key] = Obj(put.size, checksum, dict(put.grants), put.is_hard_pinned)
                for segment_id, offset in put.grants.items():
                    self._mark(segment_id, offset, "obj")
            else:
                assert codes[index] == ErrorCode.TRANSFER_FAIL, (key, codes[index])

    @rule(keys=st.lists(st.sampled_from(KEYS), unique=True, min_size=1, max_size=4), data=st.data())
    def put_end(self, keys: list[str], data) -> None:
        self._finish(self._end(keys), data)

    @precondition(lambda self: self.held is None and any(not p.is_committing for p in self.pending.values()))
    @rule(data=st.data())
    def put_end_and_hold(self, data) -> None:
        writing = sorted(k for k, p in self.pending.items() if not p.is_committing)
        key = data.draw(st.sampled_from(writing))
        self.held = self._end([key])

    @precondition(lambda self: self.held is not None)
    @rule(data=st.data())
    def finish_held(self, data) -> None:
        held, self.held = self.held, None
        self._finish(held, data)

    @rule(keys=st.lists(st.sampled_from(KEYS), unique=True, min_size=1, max_size=3), writes_in_flight=st.booleans())
    def put_revoke(self, keys: list[str], writes_in_flight: bool) -> None:
        """A writer that gave up; one whose writes may still land (cancelled mid-write) frees
        the keys at once and the ranges only after the release timeout."""
        codes = self.service.put_revoke(PutRevoke(keys, writes_in_flight), self.now).codes
        for key, code in zip(keys, codes):
            put = self.pending.get(key)
            if put is None:
                expected = (
                    ErrorCode.OBJECT_ALREADY_EXISTS if key in self.objects else ErrorCode.OBJECT_NOT_FOUND
                )
            elif put.is_committing:
                expected = ErrorCode.REPLICA_IS_NOT_READY
            elif writes_in_flight:
                expected = OK
                self._discard(key)
            else:
                expected = OK
                del self.pending[key]
                for segment_id, offset in put.grants.items():
                    self._release(segment_id, offset)
            assert code == expected, (key, code, expected)

    # --- reads and removes -------------------------------------------------------------

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4))
    def get(self, keys: list[str]) -> None:
        reply = self.service.get_replica_list(GetReplicaList(keys), self.now)
        for key, code, size, checksum, replicas in zip(
            keys, reply.codes, reply.sizes, reply.checksums, reply.replicas
        ):
            obj = self.objects.get(key)
            if not self._is_readable(key):  # no lease, no access
                expected = (
                    ErrorCode.REPLICA_IS_NOT_READY if key in self.pending else ErrorCode.OBJECT_NOT_FOUND
                )
                assert code == expected, (key, code)
                if obj is not None:
                    event("get of an object on lost nodes only: a miss")
                continue
            assert code == OK and (size, checksum) == (obj.size, obj.checksum), (key, size, checksum, obj)
            assert {r.segment_id: r.offset for r in replicas} == obj.replicas
            event("hit")
            if not self._is_leased(key):
                self.readers[key] = self.awaited[key] = 0
            self.readers[key] = self.readers.get(key, 0) + 1
            if self.awaited.get(key, 0) > 0:
                self.awaited[key] -= 1
            self.leases[key] = max(self.leases.get(key, 0), self.now + CONFIG.lease_ttl_ms)
            self.granted.append((self.now, key))

    @precondition(lambda self: self.granted)
    @rule(data=st.data())
    def release_lease(self, data: st.DataObject) -> None:
        """A reader is done: it gives back one lease it was granted (maybe after it lapsed)."""
        granted_ms, key = self.granted.pop(data.draw(st.integers(0, len(self.granted) - 1)))
        self.service.release_leases(ReleaseLeases([granted_ms], [1], [key]), self.now)
        is_current = granted_ms + CONFIG.lease_ttl_ms > self.now and key in self.objects
        if is_current and self._is_leased(key) and self.readers.get(key, 0) > 0:
            self.readers[key] -= 1
            if not self.readers[key] and not self.awaited.get(key, 0):
                del self.leases[key]
                event("lease ended by its last reader")
            elif not self.readers[key] and self._is_readable(key):
                event("lease kept for a read a hold awaits")
                # Still leased: a remove that spares leased objects is refused (and changes nothing).
                assert self.service.remove(Remove([key]), self.now).codes == [ErrorCode.OBJECT_HAS_LEASE]

    @precondition(lambda self: self.objects)
    @rule()
    def read_everything(self) -> None:
        """Every object under a lease at once: eviction must then find nothing to take."""
        self.get(sorted(self.objects))

    @rule(data=st.data(), hold_ms=st.sampled_from([0, 300, 5_000]), hold_reads=st.integers(1, 3))
    def exists_and_prefix(self, data: st.DataObject, hold_ms: int, hold_reads: int) -> None:
        """With a hold, the prefix found is leased (to at most the TTL) with no reader counted,
        awaiting `hold_reads` reads (the most of the holds since the lease last lapsed). Keys
        of objects lead, so that most lookups find some (an engine's usually do)."""
        found = data.draw(st.lists(st.sampled_from(sorted(self.objects)), max_size=3)) if self.objects else []
        keys = found + data.draw(st.lists(st.sampled_from(KEYS), max_size=3))
        flags = self.service.exist_keys(ExistKeys(keys), self.now).flags
        assert flags == [self._is_readable(key) for key in keys]
        prefix = self.service.longest_prefix(LongestPrefix(keys, hold_ms, hold_reads), self.now).count
        expected = next((i for i, key in enumerate(keys) if not self._is_readable(key)), len(keys))
        assert prefix == expected
        if expected < len(keys) and keys[expected] in self.objects:
            event("prefix ended by an object on lost nodes only")
        for key in keys[:prefix] if hold_ms else ():
            if not self._is_leased(key):
                self.readers[key] = self.awaited[key] = 0
            self.awaited[key] = max(self.awaited.get(key, 0), hold_reads)
            self.leases[key] = max(self.leases.get(key, 0), self.now + min(hold_ms, CONFIG.lease_ttl_ms))
            event("held by a lookup")

    @rule(keys=st.lists(st.sampled_from(KEYS), unique=True, min_size=1, max_size=3), force=st.booleans())
    def remove(self, keys: list[str], force: bool) -> None:
        codes = self.service.remove(Remove(keys, force), self.now).codes
        for key, code in zip(keys, codes):
            put = self.pending.get(key)
            if key in self.objects:
                if self._is_leased(key) and not force and self._is_readable(key):
                    expected = ErrorCode.OBJECT_HAS_LEASE
                else:
                    if not force and self._is_leased(key):
                        event("a leased object on lost nodes only removed")
                    expected = OK
                    self._drop_object(key)
            elif put is None:
                expected = ErrorCode.OBJECT_NOT_FOUND
            elif put.is_committing or not force:
                expected = ErrorCode.REPLICA_IS_NOT_READY
            else:
                expected = OK
                self._discard(key)
            assert code == expected, (key, code, expected)
        self._sync_drops(may_evict=False)

    @rule(pattern=st.sampled_from(PATTERNS), force=st.booleans())
    def remove_by_regex(self, pattern: str, force: bool) -> None:
        count = self.service.remove_by_regex(RemoveByRegex(pattern, force), self.now).count
        doomed = [
            k for k in self.objects
            if re.search(pattern, k) and (force or not self._is_leased(k) or not self._is_readable(k))
        ]
        assert count == len(doomed)
        for key in doomed:
            self._drop_object(key)
        self._sync_drops(may_evict=False)

    # --- time and drops ------------------------------------------------------------------

    def _discard(self, key: str) -> None:
        put = self.pending.pop(key)
        for segment_id, offset in put.grants.items():
            self._mark(segment_id, offset, "quar")
            self.quarantine.append((put.start_ms + CONFIG.put_release_timeout_ms, segment_id, offset))

    @rule(delta_ms=st.sampled_from([1, 100, 999, 1_000, 2_500, 6_000, 9_000]), keep_alive=st.booleans())
    def advance_clock(self, delta_ms: int, keep_alive: bool) -> None:
        """Time passes; with keep_alive every node heartbeats on time."""
        self.now += delta_ms
        if keep_alive and self.segments:
            self.service.heartbeat(Heartbeat(sorted(self.segments)), self.now)
            for seg in self.segments.values():
                seg.last_seen_ms = self.now
                seg.is_reachable = True

    def _finish_leaving(self) -> None:
        """Segments the service unmounts in steps are gone once their steps ran (SweepingMasterMachine)."""

    @rule()
    def tick(self) -> None:
        self.service.tick(self.now)
        self._finish_leaving()
        for segment_id, seg in list(self.segments.items()):
            if seg.last_seen_ms + CONFIG.node_ttl_ms <= self.now:
                self._unmount_model(segment_id)
                event("node expired")
            elif seg.drain_deadline_ms is not None and seg.drain_deadline_ms <= self.now:
                self._unmount_model(segment_id)
        for key, put in list(self.pending.items()):
            if not put.is_committing and put.start_ms + CONFIG.put_discard_timeout_ms <= self.now:
                self._discard(key)
                event("zombie discarded")
        due = [q for q in self.quarantine if q[0] <= self.now]
        self.quarantine = [q for q in self.quarantine if q[0] > self.now]
        for _, segment_id, offset in due:
            self._release(segment_id, offset)
            event("quarantine released")
        self._sync_drops(may_evict=True)

    @precondition(lambda self: self.taken)
    @rule(data=st.data())
    def ack_drops(self, data) -> None:
        count = data.draw(st.integers(1, len(self.taken)))
        acked, self.taken = self.taken[:count], self.taken[count:]
        by_segment: dict[str, list[InventoryEntry]] = {}
        for segment_id, entry in acked:
            by_segment.setdefault(segment_id, []).append(entry)
            self._release(segment_id, entry.offset)
        for segment_id, entries in by_segment.items():
            self.service.drops_done(segment_id, entries, self.now)
            self.service.drops_done(segment_id, entries, self.now)  # a repeated ack is harmless

    @precondition(lambda self: self.held is None)
    @rule()
    def restart_master(self) -> None:
        """A new master with no memory: nodes flush their drops, then re-mount with their
        inventories. Puts in flight, leases, pins and drains are forgotten."""
        for segment_id, entries in self.service.take_drops().items():
            self.taken.extend((segment_id, entry) for entry in entries)
        for segment_id, entry in self.taken:
            self._release(segment_id, entry.offset)
        self.taken = []
        inventories: dict[str, list[InventoryEntry]] = {s: [] for s in self.segments}
        for key, obj in self.objects.items():
            obj.is_hard_pinned = False
            for segment_id, offset in obj.replicas.items():
                inventories[segment_id].append(InventoryEntry(key, offset, obj.size, obj.checksum))
        self.service = MasterService(CONFIG, random.Random(self.seed + self.now), None, policy=make_policy(self.POLICY))
        for segment_id, seg in self.segments.items():
            seg.last_seen_ms = self.now
            seg.drain_deadline_ms = None
            seg.is_reachable = True  # it re-mounted
            seg.busy = {o: b for o, b in seg.busy.items() if b[1] == "obj"}
            token = b"t-" + segment_id.encode()
            info = SegmentInfo(segment_id, f"node-{segment_id}", "host", "host:1", "", token, seg.capacity)
            reply = self.service.mount_segment(MountSegment(info, inventories[segment_id]), self.now)
            assert reply.rejected == []
        event(f"restart with {len(self.objects)} objects")
        self.pending = {}
        self.leases = {}
        self.readers = {}
        self.awaited = {}
        self.granted = []  # an earlier master's: the new one ignores them (test_master_service)
        self.quarantine = []

    # --- invariants --------------------------------------------------------------------

    @invariant()
    def agrees_with_model(self) -> None:
        service = self.service
        service.check_invariants()
        assert service.exist_keys(ExistKeys(KEYS), self.now).flags == [self._is_readable(k) for k in KEYS]
        query = service.query_objects(QueryObjects(KEYS), self.now)
        for key, code, size, replicas in zip(KEYS, query.codes, query.sizes, query.replicas):
            obj = self.objects.get(key)
            if obj is None:
                continue
            if not self._is_readable(key):
                assert (code, replicas) == (ErrorCode.OBJECT_NOT_FOUND, []), (key, code, replicas)
                continue
            assert code == OK and size == obj.size, (key, code, size)
            assert {r.segment_id: r.offset for r in replicas} == obj.replicas, (key, replicas, obj)
        counters = {c.segment_id: c for c in service.segment_counters()}
        assert set(counters) == set(self.segments)
        for segment_id, seg in self.segments.items():
            busy = sum(size for size, _, _ in seg.busy.values())
            assert counters[segment_id].used_bytes == busy, (segment_id, counters[segment_id], seg.busy)
            state = "draining" if seg.drain_deadline_ms is not None else "active"
            if not seg.is_reachable:
                state = "unreachable"
            assert counters[segment_id].state == state
        assert service.pending_count == len(self.pending)


TestMasterMachine = MasterMachine.TestCase
TestMasterMachine.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)


class LruMasterMachine(MasterMachine):
    """The same rules and model with the LRU policy, which is no longer the default."""

    POLICY = "lru"


TestLruMasterMachine = LruMasterMachine.TestCase
TestLruMasterMachine.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)


class SweepingMasterMachine(MasterMachine):
    """The same rules and model with every unmount in steps of one key (master/mounts.py),
    the service checked after each step; the model sees the segment go once its steps ran."""

    @initialize(seed=st.integers(0, 2**16))
    def setup(self, seed: int) -> None:
        self.steps_before = limits.UNMOUNT_SWEEP_KEYS_PER_STEP
        limits.UNMOUNT_SWEEP_KEYS_PER_STEP = 1
        super().setup(seed)

    def teardown(self) -> None:
        limits.UNMOUNT_SWEEP_KEYS_PER_STEP = getattr(self, "steps_before", limits.UNMOUNT_SWEEP_KEYS_PER_STEP)

    def _finish_leaving(self) -> None:
        steps = 0
        while self.service.sweep_step():
            self.service.check_invariants()
            steps += 1
        if steps:
            event("unmounted in steps")


TestSweepingMasterMachine = SweepingMasterMachine.TestCase
TestSweepingMasterMachine.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
