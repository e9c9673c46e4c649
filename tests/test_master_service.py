"""MasterService, request by request: puts, reads, leases, pins, eviction, drops, membership.

How: each test builds a pure MasterService (seeded rng, a cluster key, time passed in as
`now_ms`) behind a `Checked` proxy that calls `check_invariants()` after every call, so every
step of every test also proves that the segments are tiled exactly by object replicas,
pending puts, quarantined ranges, drops and free extents. Nodes are simulated by the test:
commits succeed unless a test says otherwise, and drops are acknowledged explicitly, so the
order "drop before reuse" is visible. No sockets, no sleeps.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

import pytest

from kvpool import limits
from kvpool.config import MasterConfig
from kvpool.errors import ErrorCode, InvalidParams, SegmentAlreadyExists, SegmentNotFound
from kvpool.master import eviction
from kvpool.master.allocator import footprint_bytes
from kvpool.master.eviction import EVICT_SHORTFALL_BACKOFF_MS, EvictionPolicy, Verdict, make_policy
from kvpool.master.service import MasterService, PendingCommit
from kvpool.protocol import auth
from kvpool.protocol.frames import FrameDecoder, encode_frame
from kvpool.protocol.messages import (
    PIN_HARD,
    PIN_SOFT,
    ClusterStatus,
    DrainSegment,
    ExistKeys,
    GetReplicaList,
    Heartbeat,
    InventoryEntry,
    ListObjects,
    LongestPrefix,
    MountSegment,
    PutEnd,
    PutRevoke,
    PutStart,
    PutStartReply,
    QueryObjects,
    ReleaseLeases,
    Remove,
    RemoveAll,
    RemoveByRegex,
    ReplicateConfig,
    ReportBadReplicas,
    SegmentInfo,
    UnmountSegment,
)

KIB, MIB = limits.KIB, limits.MIB
OK = ErrorCode.OK
OBJECT_SIZE = 64 * KIB  # 16 objects fill a 1 MiB segment
CLUSTER_KEY = auth.cluster_key("test-token")


class Checked:
    """Proxy that runs check_invariants() after every method call of the service."""

    def __init__(self, service: MasterService):
        self.raw = service

    def __getattr__(self, name: str):
        attribute = getattr(self.raw, name)
        if not callable(attribute):
            return attribute

        def call(*args, **kwargs):
            try:
                return attribute(*args, **kwargs)
            finally:
                self.raw.check_invariants()

        return call


def make(seed: int = 0, policy: str | None = None, **config) -> Checked:
    """A checked service; `policy` names an eviction policy (None: the master's default)."""
    chosen = None if policy is None else make_policy(policy)
    return Checked(MasterService(MasterConfig(**config), random.Random(seed), CLUSTER_KEY, policy=chosen))


def info(
    segment_id: str, capacity: int = MIB, node: str = "", hostname: str = "host-a", token: bytes = b""
) -> SegmentInfo:
    """A segment's info; its file token is its own unless given (the master refuses a second
    segment naming another's file)."""
    return SegmentInfo(
        segment_id, node or f"node-{segment_id}", hostname, f"{hostname}:1", "/dev/shm/x",
        token or b"t-" + segment_id.encode(), capacity,
    )  # fmt: skip


def mount(svc, segment_id: str, now: int = 0, inventory=(), **kwargs) -> list[InventoryEntry]:
    return svc.mount_segment(MountSegment(info(segment_id, **kwargs), list(inventory)), now).rejected


def config(**kwargs) -> ReplicateConfig:
    return ReplicateConfig(**kwargs)


def checksum_of(key: str) -> int:
    return hash(key) & (2**64 - 1)


NodeAnswer = Callable[[str, list[InventoryEntry]], list[int]]


def all_ok(segment_id: str, entries: list[InventoryEntry]) -> list[int]:
    return [0] * len(entries)


def commit(svc, pending: PendingCommit, now: int, node: NodeAnswer = all_ok) -> list[int]:
    results = {segment_id: node(segment_id, entries) for segment_id, entries in pending.commits.items()}
    return svc.finish_put_end(pending, results, now).codes


def put(
    svc, keys, size: int = OBJECT_SIZE, now: int = 0, node: NodeAnswer = all_ok, **replicate
) -> list[int]:
    """The whole put as the server runs it; returns the final code per key."""
    keys = list(keys)
    start = svc.put_start(PutStart(keys, [size] * len(keys), config(**replicate)), now)
    started = [key for key, code in zip(keys, start.codes) if code == OK]
    pending = svc.put_end(PutEnd(started, [checksum_of(k) for k in started]), now)
    final = dict(zip(started, commit(svc, pending, now, node)))
    return [final.get(key, code) for key, code in zip(keys, start.codes)]


def where(reply: PutStartReply, index: int) -> list[tuple[str, int]]:
    """(segment id, offset of the object) of each replica granted to key `index`."""
    return [(grant.segment_id, grant.offset + start) for grant, start in reply.replicas_of(index)]


def get(svc, keys, now: int = 0):
    return svc.get_replica_list(GetReplicaList(list(keys)), now)


def exists(svc, keys, now: int = 0) -> list[bool]:
    return svc.exist_keys(ExistKeys(list(keys)), now).flags


def used(svc, segment_id: str) -> int:
    return next(c.used_bytes for c in svc.segment_counters() if c.segment_id == segment_id)


def ack_drops(svc, now: int = 0) -> dict[str, list[InventoryEntry]]:
    drops = svc.take_drops()
    for segment_id, entries in drops.items():
        svc.drops_done(segment_id, entries, now)
    return drops


# --- puts -------------------------------------------------------------------------------


def test_put_then_get_returns_size_checksum_and_signed_grants() -> None:
    svc = make()
    mount(svc, "s1")
    reply = svc.put_start(PutStart(["k"], [1000], config()), 5)
    assert reply.codes == [OK]
    ((grant, start),) = reply.replicas_of(0)
    assert grant.segment_id == "s1" and grant.size == 1000 and start == 0
    assert grant.expiry_ms == 5 + MasterConfig().put_discard_timeout_ms
    assert auth.is_valid_grant(CLUSTER_KEY, grant, 5)
    assert reply.segments["s1"].segment_id == "s1"
    pending = svc.put_end(PutEnd(["k"], [1234]), 6)
    assert pending.commits == {"s1": [InventoryEntry("k", grant.offset, 1000, 1234)]}
    assert exists(svc, ["k"]) == [False]  # not visible until the node committed it
    assert commit(svc, pending, 7) == [OK]
    got = get(svc, ["k"], 8)
    assert got.codes == [OK] and got.sizes == [1000] and got.checksums == [1234]
    assert [(r.segment_id, r.offset) for r in got.replicas[0]] == [("s1", grant.offset)]
    assert set(got.segments) == {"s1"}
    assert svc.counters.puts == 1 and svc.counters.put_bytes == 1000


def test_put_start_rejects_bad_keys_and_sizes_per_key() -> None:
    svc = make()
    mount(svc, "s1")
    keys = ["", "x" * (limits.KEY_SIZE_BYTES_MAX + 1), "\ud800", "ok1", "ok2", "ok3", "ok4", "é" * 2049]
    sizes = [10, 10, 10, 0, -1, limits.OBJECT_SIZE_BYTES_MAX + 1, 10, 10]
    codes = svc.put_start(PutStart(keys, sizes, config()), 0).codes
    assert codes == [ErrorCode.INVALID_KEY] * 3 + [ErrorCode.INVALID_PARAMS] * 3 + [OK, ErrorCode.INVALID_KEY]
    assert svc.counters.errors == 7


@pytest.mark.parametrize(
    "msg",
    [
        PutStart(["a", "b"], [1], ReplicateConfig()),
        PutStart(["a"] * (limits.BATCH_KEYS_MAX + 1), [1] * (limits.BATCH_KEYS_MAX + 1), ReplicateConfig()),
        PutStart(["a"], [1], ReplicateConfig(replica_num=0)),
        PutStart(["a"], [1], ReplicateConfig(replica_num=limits.REPLICA_NUM_MAX + 1)),
        PutStart(["a"], [1], ReplicateConfig(placement="nearest")),
    ],
)
def test_put_start_raises_on_bad_requests_and_allocates_nothing(msg: PutStart) -> None:
    svc = make()
    mount(svc, "s1")
    with pytest.raises(InvalidParams):
        svc.put_start(msg, 0)
    assert used(svc, "s1") == 0 and svc.pending_count == 0


def test_batch_limits_raise_everywhere() -> None:
    svc = make()
    too_many = ["k"] * (limits.BATCH_KEYS_MAX + 1)
    for call in (
        lambda: svc.put_end(PutEnd(too_many, [0] * len(too_many)), 0),
        lambda: svc.put_revoke(PutRevoke(too_many), 0),
        lambda: svc.get_replica_list(GetReplicaList(too_many), 0),
        lambda: svc.exist_keys(ExistKeys(too_many), 0),
        lambda: svc.longest_prefix(LongestPrefix(too_many), 0),
        lambda: svc.remove(Remove(too_many), 0),
        lambda: svc.query_objects(QueryObjects(too_many), 0),
        lambda: svc.heartbeat(Heartbeat(too_many), 0),
    ):
        with pytest.raises(InvalidParams):
            call()


def test_existing_and_pending_keys() -> None:
    svc = make()
    mount(svc, "s1")
    assert put(svc, ["done"]) == [OK]
    svc.put_start(PutStart(["busy"], [10], config()), 0)
    codes = svc.put_start(PutStart(["done", "busy", "busy2", "busy2"], [10] * 4, config()), 0).codes
    assert codes == [
        ErrorCode.OBJECT_ALREADY_EXISTS,
        ErrorCode.REPLICA_IS_NOT_READY,
        OK,
        ErrorCode.REPLICA_IS_NOT_READY,
    ]
    got = get(svc, ["busy", "nope"])
    assert got.codes == [ErrorCode.REPLICA_IS_NOT_READY, ErrorCode.OBJECT_NOT_FOUND]
    assert got.replicas == [[], []]
    assert exists(svc, ["done", "busy", "nope"]) == [True, False, False]
    assert svc.counters.misses == 2 and svc.counters.hits == 0


def test_no_segment_means_no_available_handle() -> None:
    svc = make()
    assert svc.put_start(PutStart(["k"], [10], config()), 0).codes == [ErrorCode.NO_AVAILABLE_HANDLE]
    mount(svc, "s1")
    too_big = svc.put_start(PutStart(["k"], [2 * MIB], config()), 0)
    assert too_big.codes == [ErrorCode.NO_AVAILABLE_HANDLE]


def test_replicas_on_distinct_segments_best_effort() -> None:
    svc = make()
    for segment_id in ("s1", "s2", "s3"):
        mount(svc, segment_id)
    reply = svc.put_start(PutStart(["a", "b"], [10, 10], config(replica_num=3)), 0)
    for index in range(2):
        assert sorted(segment_id for segment_id, _ in where(reply, index)) == ["s1", "s2", "s3"]
    reply = svc.put_start(PutStart(["c"], [10], config(replica_num=5)), 0)
    assert reply.codes == [OK] and len(where(reply, 0)) == 3
    assert set(reply.segments) == {"s1", "s2", "s3"}


def test_put_end_codes() -> None:
    svc = make()
    mount(svc, "s1")
    assert put(svc, ["done"]) == [OK]
    svc.put_start(PutStart(["a", "b"], [10, 10], config()), 0)
    # A checksum list that does not match the keys: every key is refused, the puts stay.
    bad = svc.put_end(PutEnd(["a", "b"], [1]), 0)
    assert bad.codes == [ErrorCode.INVALID_PARAMS] * 2 and bad.commits == {}
    assert svc.finish_put_end(bad, {}, 0).codes == [ErrorCode.INVALID_PARAMS] * 2
    pending = svc.put_end(PutEnd(["a", "b", "nope", "done", "a"], [1, -1, 0, 0, 1]), 0)
    assert pending.codes[1:] == [
        ErrorCode.INVALID_PARAMS,
        ErrorCode.OBJECT_NOT_FOUND,
        ErrorCode.OBJECT_ALREADY_EXISTS,
        ErrorCode.REPLICA_IS_NOT_READY,  # its first put_end in this very batch is committing
    ]
    assert [e.key for e in pending.commits["s1"]] == ["a"]
    assert commit(svc, pending, 0)[0] == OK
    assert exists(svc, ["a", "b"]) == [True, False]


def test_commit_failures_free_ranges_and_the_key() -> None:
    svc = make()
    for segment_id in ("s1", "s2"):
        mount(svc, segment_id)

    def only_s1(segment_id: str, entries) -> list[int]:
        return [0 if segment_id == "s1" else ErrorCode.TRANSFER_FAIL] * len(entries)

    assert put(svc, ["half"], replica_num=2, node=only_s1) == [OK]
    got = get(svc, ["half"])
    assert [r.segment_id for r in got.replicas[0]] == ["s1"]
    assert used(svc, "s2") == 0  # the failed replica's range is free: it never reached an inventory

    def none(segment_id: str, entries) -> list[int]:
        return [ErrorCode.TRANSFER_FAIL] * len(entries)

    assert put(svc, ["lost"], replica_num=2, node=none) == [ErrorCode.TRANSFER_FAIL]
    assert used(svc, "s1") == footprint_bytes(OBJECT_SIZE) and used(svc, "s2") == 0
    assert put(svc, ["lost"]) == [OK]  # the key is free again

    # A node that never answered, or answered the wrong number of codes, failed; it may have
    # recorded them all the same (an answer lost or late), so their ranges are dropped from it
    # before they are granted again.
    for results in ({"s2": [0]}, {}):
        used_before = used(svc, "s2")
        svc.put_start(PutStart(["x", "y"], [10, 10], config(placement="preferred", preferred_segments=["s2"])), 0)
        pending = svc.put_end(PutEnd(["x", "y"], [1, 2]), 0)
        assert svc.finish_put_end(pending, results, 0).codes == [ErrorCode.TRANSFER_FAIL] * 2
        assert exists(svc, ["x", "y"]) == [False, False]
        assert used(svc, "s2") > used_before  # not free yet
        assert sorted(e.key for e in ack_drops(svc)["s2"]) == ["x", "y"]
        assert used(svc, "s2") == used_before


def test_finish_put_end_twice_is_a_programmer_error() -> None:
    svc = make()
    mount(svc, "s1")
    svc.put_start(PutStart(["k"], [10], config()), 0)
    pending = svc.put_end(PutEnd(["k"], [1]), 0)
    commit(svc, pending, 0)
    with pytest.raises(AssertionError):
        svc.raw.finish_put_end(pending, {}, 0)


def test_revoke_frees_at_once() -> None:
    svc = make()
    mount(svc, "s1")
    assert put(svc, ["done"]) == [OK]
    svc.put_start(PutStart(["w", "c"], [OBJECT_SIZE, OBJECT_SIZE], config()), 0)
    pending = svc.put_end(PutEnd(["c"], [1]), 0)
    codes = svc.put_revoke(PutRevoke(["w", "c", "done", "nope"]), 0).codes
    assert codes == [
        OK,
        ErrorCode.REPLICA_IS_NOT_READY,
        ErrorCode.OBJECT_ALREADY_EXISTS,
        ErrorCode.OBJECT_NOT_FOUND,
    ]
    assert used(svc, "s1") == 2 * footprint_bytes(OBJECT_SIZE)
    assert commit(svc, pending, 0) == [OK]
    assert svc.put_end(PutEnd(["w"], [1]), 0).codes == [ErrorCode.OBJECT_NOT_FOUND]


@pytest.mark.parametrize(
    ("release_timeout_ms", "released_at_ms"),
    [(600_000, 100 + 1_000 + limits.REVOKED_WRITES_FENCE_MARGIN_MS), (5_000, 5_100)],
    ids=["fenced-by-the-grants", "release-timeout-first"],
)
def test_a_revoke_with_writes_in_flight_frees_the_key_at_once_and_the_range_once_nodes_take_no_more(
    release_timeout_ms, released_at_ms
) -> None:
    """A writer cancelled mid-write: its keys can be put again at once, but a write of its
    to a node may still land, so its ranges are not handed out until the nodes take no more of
    them: its grants' expiry (put_start + discard timeout) and a margin, or the release timeout
    if that comes first (it was always the release timeout, 10 minutes by default)."""
    svc = make(put_discard_timeout_ms=1_000, put_release_timeout_ms=release_timeout_ms, node_ttl_ms=10_000_000)
    mount(svc, "s1")
    svc.put_start(PutStart(["w"], [OBJECT_SIZE], config()), 100)
    assert svc.put_revoke(PutRevoke(["w", "nope"], writes_in_flight=True), 200).codes == [
        OK, ErrorCode.OBJECT_NOT_FOUND
    ]  # fmt: skip
    assert svc.pending_count == 0
    assert svc.put_end(PutEnd(["w"], [1]), 201).codes == [ErrorCode.OBJECT_NOT_FOUND]
    assert put(svc, ["w"], now=300) == [OK]  # a new range: the old one is quarantined
    assert used(svc, "s1") == 2 * footprint_bytes(OBJECT_SIZE)
    svc.tick(released_at_ms - 1)
    assert used(svc, "s1") == 2 * footprint_bytes(OBJECT_SIZE)
    svc.tick(released_at_ms)
    assert used(svc, "s1") == footprint_bytes(OBJECT_SIZE)


def test_replicas_a_writer_names_unwritten_are_never_published_and_their_ranges_are_fenced() -> None:
    """A put of two replicas whose write to one node broke off (the node froze mid-frame) is
    put_end'ed for the other: the writer names the broken one (PutEnd.unwritten), so no reader
    is ever sent to it, and its range waits as a revoked write's (the write may land yet)
    before another put may have it. A key whose every replica is named fails and is free
    again; an index out of range is refused, and nothing of that put_end is committed."""
    svc = make(put_discard_timeout_ms=1_000, node_ttl_ms=10_000_000)
    for segment_id in ("s1", "s2"):
        mount(svc, segment_id)
    keys = ["half", "none", "whole"]
    start = svc.put_start(PutStart(keys, [OBJECT_SIZE] * 3, config(replica_num=2)), 100)
    assert start.codes == [OK] * 3
    refused = svc.put_end(PutEnd(keys, [checksum_of(k) for k in keys], put_id=0, unwritten=[(3, "s1")]), 150)
    assert refused.codes == [ErrorCode.INVALID_PARAMS] * 3 and refused.commits == {}
    unwritten = [(0, "s1"), (1, "s1"), (1, "s2")]
    pending = svc.put_end(PutEnd(keys, [checksum_of(k) for k in keys], put_id=0, unwritten=unwritten), 200)
    assert {s: [e.key for e in entries] for s, entries in pending.commits.items()} == {
        "s1": ["whole"], "s2": ["half", "whole"]
    }  # fmt: skip
    assert commit(svc, pending, 200) == [OK, ErrorCode.TRANSFER_FAIL, OK]
    assert [sorted(r.segment_id for r in replicas) for replicas in get(svc, ["half", "whole"]).replicas] == [
        ["s2"], ["s1", "s2"]
    ]  # fmt: skip
    assert exists(svc, ["none"]) == [False] and svc.pending_count == 0
    assert put(svc, ["none"], now=300, replica_num=2) == [OK]  # the key is free again
    # s1 holds "whole" and "none" (put again), and the ranges of "half" and of the first "none", fenced.
    assert used(svc, "s1") == used(svc, "s2") == 4 * footprint_bytes(OBJECT_SIZE)
    released_at_ms = 100 + 1_000 + limits.REVOKED_WRITES_FENCE_MARGIN_MS
    svc.tick(released_at_ms - 1)
    assert used(svc, "s1") == 4 * footprint_bytes(OBJECT_SIZE)
    svc.tick(released_at_ms)
    assert used(svc, "s1") == 2 * footprint_bytes(OBJECT_SIZE) and used(svc, "s2") == 3 * footprint_bytes(OBJECT_SIZE)


# --- zombies ----------------------------------------------------------------------------


def test_zombie_put_is_discarded_then_its_space_released() -> None:
    svc = make(put_discard_timeout_ms=1_000, put_release_timeout_ms=5_000)
    mount(svc, "s1")
    svc.put_start(PutStart(["z"], [OBJECT_SIZE], config()), 100)
    svc.tick(1_099)
    assert svc.put_start(PutStart(["z"], [10], config()), 1_099).codes == [ErrorCode.REPLICA_IS_NOT_READY]
    svc.heartbeat(Heartbeat(["s1"]), 1_100)
    svc.tick(1_100)  # discarded: the key is free, the range quarantined
    assert svc.pending_count == 0
    assert used(svc, "s1") == footprint_bytes(OBJECT_SIZE)
    assert svc.put_end(PutEnd(["z"], [1]), 1_101).codes == [ErrorCode.OBJECT_NOT_FOUND]
    svc.tick(5_099)
    assert used(svc, "s1") == footprint_bytes(OBJECT_SIZE)
    svc.heartbeat(Heartbeat(["s1"]), 5_100)
    svc.tick(5_100)  # put_start + release timeout: the writer's grant is long expired
    assert used(svc, "s1") == 0


def test_a_late_end_or_revoke_of_a_discarded_put_leaves_the_next_writers_put_alone() -> None:
    """Writer A stalls past the discard timeout; writer B puts the same key. A's late PutEnd
    (by key alone) committed B's ranges with A's checksum, and its late PutRevoke took B's put
    away: B's own put_end then failed. Ends and revokes act only on their put_start's put."""
    svc = make(put_discard_timeout_ms=1_000, put_release_timeout_ms=5_000, node_ttl_ms=100_000)
    mount(svc, "s1")
    svc.put_start(PutStart(["k"], [OBJECT_SIZE], config(), put_id=11), 100)
    svc.tick(1_100)  # A's put is discarded
    assert svc.put_start(PutStart(["k"], [OBJECT_SIZE], config(), put_id=22), 1_200).codes == [OK]
    assert svc.put_end(PutEnd(["k"], [1], put_id=11), 1_300).codes == [ErrorCode.OBJECT_NOT_FOUND]
    assert svc.put_revoke(PutRevoke(["k"], put_id=11), 1_300).codes == [ErrorCode.OBJECT_NOT_FOUND]
    assert svc.pending_count == 1  # B's put, untouched
    pending = svc.put_end(PutEnd(["k"], [2], put_id=22), 1_400)
    assert pending.commits["s1"][0].checksum == 2 and commit(svc, pending, 1_400) == [OK]
    assert svc.put_revoke(PutRevoke(["k"], put_id=22), 1_500).codes == [ErrorCode.OBJECT_ALREADY_EXISTS]


def test_committing_put_is_never_discarded() -> None:
    svc = make(put_discard_timeout_ms=1_000, node_ttl_ms=100_000)
    mount(svc, "s1")
    svc.put_start(PutStart(["k"], [10], config()), 0)
    pending = svc.put_end(PutEnd(["k"], [7]), 10)
    svc.tick(50_000)
    assert commit(svc, pending, 50_001) == [OK]
    assert get(svc, ["k"], 50_002).checksums == [7]


def test_force_remove_of_a_writing_put_quarantines_its_range() -> None:
    svc = make(put_release_timeout_ms=60_000, node_ttl_ms=100_000)
    mount(svc, "s1")
    svc.put_start(PutStart(["w"], [OBJECT_SIZE], config()), 0)
    assert svc.remove(Remove(["w"]), 0).codes == [ErrorCode.REPLICA_IS_NOT_READY]
    assert svc.remove(Remove(["w"], force=True), 0).codes == [OK]
    assert used(svc, "s1") == footprint_bytes(OBJECT_SIZE)  # the writer may still be writing
    assert put(svc, ["w"], now=1) == [OK]  # but the key is free
    svc.tick(60_000)
    assert used(svc, "s1") == footprint_bytes(OBJECT_SIZE)


# --- leases, existence, removal ----------------------------------------------------------


def test_lease_blocks_remove_until_it_expires() -> None:
    svc = make(lease_ttl_ms=1_000)
    mount(svc, "s1")
    put(svc, ["k"])
    assert get(svc, ["k"], 100).lease_ttl_ms == 1_000
    get(svc, ["k"], 50)  # an older read never shortens the lease
    assert svc.remove(Remove(["k"]), 1_099).codes == [ErrorCode.OBJECT_HAS_LEASE]
    assert svc.remove(Remove(["k"]), 1_100).codes == [OK]
    assert svc.remove(Remove(["k"]), 1_100).codes == [ErrorCode.OBJECT_NOT_FOUND]
    put(svc, ["f"])
    get(svc, ["f"], 0)
    assert svc.remove(Remove(["f"], force=True), 1).codes == [OK]
    assert svc.counters.removes == 2


def release(svc, granted_ms: int, keys, now: int) -> None:
    keys = list(keys)
    svc.release_leases(ReleaseLeases([granted_ms], [len(keys)], keys), now)


def test_a_lease_ends_when_its_last_reader_gives_it_back() -> None:
    """Two readers of one object: the first one done leaves it leased for the other; the last
    one done ends the lease, long before its TTL, and the object can go at once."""
    svc = make(lease_ttl_ms=10_000)
    mount(svc, "s1")
    put(svc, ["k", "other"])
    first, second = get(svc, ["k"], 100), get(svc, ["k", "other"], 200)
    assert (first.lease_granted_ms, second.lease_granted_ms) == (100, 200)
    release(svc, 100, ["k"], 300)
    assert svc.remove(Remove(["k"]), 301).codes == [ErrorCode.OBJECT_HAS_LEASE]
    release(svc, 200, ["k"], 400)
    assert svc.counters.leases_released == 1
    assert svc.remove(Remove(["k", "other"]), 401).codes == [OK, ErrorCode.OBJECT_HAS_LEASE]
    release(svc, 200, ["k"], 402)  # given back twice, or for an object gone: nothing happens
    assert svc.counters.leases_released == 1


def test_segments_mounted_one_after_another_rebuild_the_placement_views_once(monkeypatch) -> None:
    """The registry's placement views (active segments, by tier, host and node) are rebuilt at
    the first look after a change, not at each: rebuilt per mount, s segments mounting cost
    O(s^2) (a replay of 3,000 instances spent 85 s there; a master whose nodes re-mount pays
    the same). A put after the mounts sees them all."""
    from kvpool.master import membership

    rebuild = membership.SegmentRegistry._rebuild_views
    rebuilds: list[int] = []

    def counted(registry) -> None:
        rebuilds.append(len(registry))
        rebuild(registry)

    monkeypatch.setattr(membership.SegmentRegistry, "_rebuild_views", counted)
    svc = MasterService(MasterConfig(), random.Random(0), CLUSTER_KEY)  # not Checked: its checks look
    for index in range(500):
        svc.mount_segment(MountSegment(info(f"s{index}"), []), 0)
    assert len(rebuilds) <= 1, rebuilds
    reply = svc.put_start(PutStart([f"k{i}" for i in range(64)], [4096] * 64, config()), 1)
    assert reply.codes == [OK] * 64
    assert len(rebuilds) <= 2 and rebuilds[-1] == 500, rebuilds


def test_a_release_whose_counts_do_not_add_up_is_refused_and_releases_nothing() -> None:
    """ReleaseLeases carries its keys in one list and a count per grant time (wire version 8,
    bounded where a list of lists was not): counts that do not cover the keys exactly, or do
    not match the grant times, are InvalidParams, counted, and change no lease."""
    svc = make(lease_ttl_ms=10_000)
    mount(svc, "s1")
    put(svc, ["a", "b"])
    get(svc, ["a"], 100)
    get(svc, ["b"], 200)
    for granted_ms, counts in (([100, 200], [1, 2]), ([100, 200], [1]), ([100, 200], [3, -1]), ([100], [1, 1])):
        with pytest.raises(InvalidParams):
            svc.release_leases(ReleaseLeases(granted_ms, counts, ["a", "b"]), 300)
    assert svc.counters.errors == 4 and svc.counters.leases_released == 0
    assert svc.remove(Remove(["a", "b"]), 301).codes == [ErrorCode.OBJECT_HAS_LEASE] * 2
    svc.release_leases(ReleaseLeases([100, 200], [1, 1], ["a", "b"]), 302)
    assert svc.remove(Remove(["a", "b"]), 303).codes == [OK, OK]


def test_a_lease_given_back_after_it_lapsed_does_not_end_a_later_readers_lease() -> None:
    """A reader slower than the TTL gives its lease back after the object's lease lapsed and a
    new reader took one: the new reader's lease stands."""
    svc = make(lease_ttl_ms=1_000)
    mount(svc, "s1")
    put(svc, ["k"])
    get(svc, ["k"], 0)  # the slow reader
    get(svc, ["k"], 1_500)  # after the first lease lapsed: a new one
    release(svc, 0, ["k"], 1_600)
    assert svc.remove(Remove(["k"]), 1_601).codes == [ErrorCode.OBJECT_HAS_LEASE]
    release(svc, 1_500, ["k"], 1_700)
    assert svc.remove(Remove(["k"]), 1_701).codes == [OK]


def test_a_lease_granted_by_an_earlier_master_is_not_this_ones_to_end() -> None:
    """A client gives back a lease an earlier master granted (it restarted, or a standby took
    over): the new master's readers of the object keep theirs."""
    old, new = make(lease_ttl_ms=10_000), make(lease_ttl_ms=10_000)
    for svc in (old, new):
        mount(svc, "s1")
        put(svc, ["k"])
    granted = get(old, ["k"], 100).lease_granted_ms
    get(new, ["k"], 200)
    release(new, granted, ["k"], 300)
    assert new.remove(Remove(["k"]), 301).codes == [ErrorCode.OBJECT_HAS_LEASE]


def test_a_full_cache_evicts_what_its_readers_gave_back() -> None:
    """Everything read within the TTL used to be out of eviction's reach for the whole TTL: a
    cache that reads its capacity's worth that fast refused puts. Given back, it is not."""
    svc = make(lease_ttl_ms=10_000)
    mount(svc, "s1")
    keys = [f"k{i}" for i in range(16)]  # 16 x 64 KiB: the whole 1 MiB segment
    assert put(svc, keys) == [OK] * 16
    reply = get(svc, keys, 10)
    assert put(svc, ["new"], now=20) == [ErrorCode.NO_AVAILABLE_HANDLE]  # all leased
    release(svc, reply.lease_granted_ms, keys, 30)
    start = svc.put_start(PutStart(["new"], [OBJECT_SIZE], config()), 40)
    assert start.codes == [ErrorCode.NO_AVAILABLE_HANDLE]  # room is coming: a drop is on its way
    assert svc.take_drops()


def test_exists_longest_prefix_and_query_grant_no_lease() -> None:
    svc = make()
    mount(svc, "s1")
    put(svc, ["a", "b", "d"])
    assert exists(svc, ["a", "c"]) == [True, False]
    assert svc.longest_prefix(LongestPrefix(["a", "b", "c", "d"]), 0).count == 2
    assert svc.longest_prefix(LongestPrefix([]), 0).count == 0
    query = svc.query_objects(QueryObjects(["a", "c"]), 0)
    assert query.codes == [OK, ErrorCode.OBJECT_NOT_FOUND] and query.sizes == [OBJECT_SIZE, 0]
    assert query.replicas[0][0].segment_id == "s1"
    assert svc.remove(Remove(["a", "b", "d"]), 0).codes == [OK, OK, OK]  # no lease anywhere
    assert svc.counters.gets == 0


def test_a_lookup_hold_keeps_its_hits_until_their_load_reads_them() -> None:
    """An engine looks up (scheduler) and loads moments later (workers): what the lookup found
    with a hold is spared by eviction and removal until the load gives its lease back, or the
    hold runs out; without a hold the oldest object goes first."""
    svc = make(lease_ttl_ms=10_000, evict_watermark_ratio_high=1.0, evict_ratio=0.05)
    mount(svc, "s1")
    fill(svc, "s1", 16)  # 16 x 64 KiB: the whole 1 MiB segment, k0 the oldest
    held = LongestPrefix(["k0", "k1", "k2", "absent", "k3"], hold_ms=5_000)
    assert svc.longest_prefix(held, 10).count == 3 and svc.counters.lookup_holds == 3
    assert svc.counters.gets == 0  # not a read: eviction order untouched
    assert put(svc, ["new"], now=20) == [ErrorCode.NO_AVAILABLE_HANDLE]  # room is coming
    assert [e.key for e in svc.take_drops()["s1"]] == ["k3"]  # the oldest not held
    assert svc.remove(Remove(["k0"]), 30).codes == [ErrorCode.OBJECT_HAS_LEASE]
    reply = get(svc, ["k1"], 40)  # the load
    release(svc, reply.lease_granted_ms, ["k1"], 50)
    assert svc.remove(Remove(["k1"]), 51).codes == [OK]  # read: the hold ended with its lease
    assert svc.remove(Remove(["k2"]), 5_009).codes == [ErrorCode.OBJECT_HAS_LEASE]
    assert svc.remove(Remove(["k2", "k0"]), 5_010).codes == [OK, OK]  # never loaded: ran out


def test_a_lookup_hold_is_cut_to_the_lease_ttl_and_not_negative() -> None:
    svc = make(lease_ttl_ms=1_000)
    mount(svc, "s1")
    put(svc, ["a", "b"])
    get(svc, ["b"], 0)  # a reader that never gives its lease back
    assert svc.longest_prefix(LongestPrefix(["a"], hold_ms=60_000), 0).count == 1
    assert svc.remove(Remove(["a"]), 999).codes == [ErrorCode.OBJECT_HAS_LEASE]
    assert svc.remove(Remove(["a"]), 1_000).codes == [OK]
    # A hold on an object whose lease lapsed starts a new count of readers: the lapsed reader
    # no longer holds it, so the load's release ends the hold.
    svc.longest_prefix(LongestPrefix(["b"], hold_ms=1_000), 2_000)
    reply = get(svc, ["b"], 2_100)
    release(svc, reply.lease_granted_ms, ["b"], 2_200)
    assert svc.remove(Remove(["b"]), 2_201).codes == [OK]
    with pytest.raises(InvalidParams, match="hold_ms"):
        svc.longest_prefix(LongestPrefix(["b"], hold_ms=-1), 0)


def test_bad_lookup_holds_are_counted_as_errors() -> None:
    """Like every refused request, a lookup with a bad hold counts in errors_total (/metrics)."""
    svc = make()
    for msg in (LongestPrefix(["a"], hold_ms=-1), LongestPrefix(["a"], hold_ms=1_000, hold_reads=0)):
        with pytest.raises(InvalidParams):
            svc.longest_prefix(msg, 0)
    assert svc.counters.errors == 2


def test_a_lookup_hold_for_several_reads_lasts_until_the_last_of_them() -> None:
    """The TP ranks of an MLA model share one object per block and each loads it: a hold for
    two reads outlives the first reader's release and ends with the second's. Looked up again
    (a scheduler does, every step a request waits), a hold does not add reads up; a hold
    that ran out awaits none; and a lookup that holds nothing asks for no reads."""
    svc = make(lease_ttl_ms=10_000)
    mount(svc, "s1")
    put(svc, ["a", "b"])
    for now in (0, 5):
        assert svc.longest_prefix(LongestPrefix(["a"], hold_ms=5_000, hold_reads=2), now).count == 1
    first, second = get(svc, ["a"], 10), get(svc, ["a"], 20)
    release(svc, first.lease_granted_ms, ["a"], 30)
    assert svc.remove(Remove(["a"]), 31).codes == [ErrorCode.OBJECT_HAS_LEASE]
    release(svc, second.lease_granted_ms, ["a"], 40)
    assert svc.remove(Remove(["a"]), 41).codes == [OK]
    # Only one of the two reads came: the first reader's release leaves the hold, until the
    # lease of that read runs out (the hold's own time, cut to the TTL, is past by then).
    svc.longest_prefix(LongestPrefix(["b"], hold_ms=1_000, hold_reads=2), 100)
    reply = get(svc, ["b"], 200)
    release(svc, reply.lease_granted_ms, ["b"], 300)
    assert svc.remove(Remove(["b"]), 10_199).codes == [ErrorCode.OBJECT_HAS_LEASE]
    assert svc.remove(Remove(["b"]), 10_200).codes == [OK]
    put(svc, ["c"])
    svc.longest_prefix(LongestPrefix(["c"], hold_ms=1_000, hold_reads=3), 0)
    reply = get(svc, ["c"], 1_500)  # after the hold ran out: a lease of its own, nothing awaited
    release(svc, reply.lease_granted_ms, ["c"], 1_600)
    assert svc.remove(Remove(["c"]), 1_601).codes == [OK]
    put(svc, ["d"])
    svc.longest_prefix(LongestPrefix(["d"], hold_ms=0, hold_reads=2), 0)
    reply = get(svc, ["d"], 10)
    release(svc, reply.lease_granted_ms, ["d"], 20)
    assert svc.remove(Remove(["d"]), 21).codes == [OK]
    for reads in (0, -1, limits.LOOKUP_HOLD_READS_MAX + 1):
        with pytest.raises(InvalidParams, match="hold_reads"):
            svc.longest_prefix(LongestPrefix(["a"], hold_ms=1_000, hold_reads=reads), 0)


def test_removed_ranges_are_reused_only_after_drops_done() -> None:
    svc = make()
    mount(svc, "s1")  # 16 objects of 64 KiB fill it
    keys = [f"k{i}" for i in range(16)]
    assert put(svc, keys) == [OK] * 16
    for key in keys:
        get(svc, [key])  # leases: nothing is evictable
    svc.remove(Remove(["k3"], force=True), 0)
    offset = svc.query_objects(QueryObjects(["k3"]), 0)
    assert offset.codes == [ErrorCode.OBJECT_NOT_FOUND]
    assert svc.has_pending_drops()
    # The node has not forgotten k3 yet: its range cannot be handed out.
    assert svc.put_start(PutStart(["new"], [OBJECT_SIZE], config()), 0).codes == [
        ErrorCode.NO_AVAILABLE_HANDLE
    ]
    drops = svc.take_drops()
    assert [(e.key, e.size) for e in drops["s1"]] == [("k3", OBJECT_SIZE)]
    assert not svc.has_pending_drops()
    assert svc.put_start(PutStart(["new"], [OBJECT_SIZE], config()), 0).codes == [
        ErrorCode.NO_AVAILABLE_HANDLE
    ]
    svc.drops_done("s1", drops["s1"], 0)
    svc.drops_done("s1", drops["s1"], 0)  # a repeated ack frees nothing twice
    svc.drops_done("gone", drops["s1"], 0)  # an unknown segment is ignored
    reply = svc.put_start(PutStart(["new"], [OBJECT_SIZE], config()), 0)
    assert reply.codes == [OK] and where(reply, 0)[0][1] == drops["s1"][0].offset


def test_a_pattern_that_backtracks_is_matched_in_linear_time() -> None:
    """`^(a+)+$` against a key of 28 a's and a '!' held a backtracking master for 26 s (each more
    character doubles it; keys may be 4 KiB): its nodes' heartbeats went unanswered and it
    dropped them. Patterns are RE2's: linear in the key; backreferences are refused."""
    svc = make()
    mount(svc, "s1")
    key = "a" * 4000 + "!"
    assert put(svc, [key, "aaaa"]) == [OK, OK]
    started = time.monotonic()
    assert svc.list_objects(ListObjects("^(a+)+$"), 0).keys == ["aaaa"]
    assert svc.remove_by_regex(RemoveByRegex("^(a+)+$", force=True), 0).count == 1
    assert time.monotonic() - started < 1
    with pytest.raises(InvalidParams, match="RE2 syntax"):
        svc.list_objects(ListObjects(r"(a)\1"), 0)


def test_remove_by_regex_and_remove_all() -> None:
    svc = make(lease_ttl_ms=1_000)
    mount(svc, "s1")
    put(svc, ["user/1", "user/2", "sys/1", "user/3"])
    get(svc, ["user/3"], 0)
    assert svc.remove_by_regex(RemoveByRegex("^user/"), 0).count == 2  # user/3 is leased
    assert svc.remove_by_regex(RemoveByRegex("3"), 0).count == 0
    assert svc.remove_by_regex(RemoveByRegex("3", force=True), 0).count == 1
    assert exists(svc, ["sys/1"]) == [True]
    with pytest.raises(InvalidParams):
        svc.remove_by_regex(RemoveByRegex("(unclosed"), 0)
    with pytest.raises(InvalidParams):
        svc.remove_by_regex(RemoveByRegex("a" * (limits.REGEX_SIZE_BYTES_MAX + 1)), 0)
    put(svc, ["x", "y"])
    get(svc, ["x"], 0)
    assert svc.remove_all(RemoveAll(), 0).count == 2  # sys/1 and y
    assert svc.remove_all(RemoveAll(force=True), 0).count == 1
    assert svc.object_count == 0
    ack_drops(svc)
    assert used(svc, "s1") == 0


def test_a_removal_in_steps_takes_what_is_there_at_each_step() -> None:
    """A server runs remove_all and remove_by_regex a step at a time, answering other requests
    between them: a key put after the removal began stays, one read meanwhile is leased and
    stays (unless forced), one put again meanwhile goes like the rest."""
    svc = make(lease_ttl_ms=1_000)
    mount(svc, "s1")
    for i in range(6):  # one put each: the removal's keys in that order
        put(svc, [f"k{i}"])
    removal = svc.removal(RemoveAll())
    assert removal.step(0, 2) is False and removal.count == 2  # k0 and k1
    assert exists(svc, ["k0", "k1", "k2"]) == [False, False, True]
    put(svc, ["late"])  # after the removal began: not one of its keys
    get(svc, ["k3"], 0)  # leased
    svc.remove(Remove(["k4"]), 0)
    put(svc, ["k4"])  # removed and put again meanwhile
    assert removal.step(0, 10) is True and removal.count == 5  # and k2, k4, k5
    assert exists(svc, ["late", "k3", "k4", "k5"]) == [True, True, False, False]
    with pytest.raises(InvalidParams):
        svc.removal(RemoveByRegex("(unclosed"))  # refused at once, not at its first step
    forced = svc.removal(RemoveByRegex("^k", force=True))
    assert forced.step(0) is True and forced.count == 1  # k3, leased
    assert exists(svc, ["late", "k3"]) == [True, False]
    svc.check_invariants()


def test_list_objects() -> None:
    svc = make()
    mount(svc, "s1")
    put(svc, ["a1", "a2", "b1"])
    listed = svc.list_objects(ListObjects("", 10), 0)
    assert sorted(listed.keys) == ["a1", "a2", "b1"] and not listed.truncated
    assert listed.sizes == [OBJECT_SIZE] * 3
    listed = svc.list_objects(ListObjects("^a", 1), 0)
    assert len(listed.keys) == 1 and listed.keys[0].startswith("a") and listed.truncated
    for limit in (0, limits.LIST_OBJECTS_MAX + 1):
        with pytest.raises(InvalidParams):
            svc.list_objects(ListObjects("", limit), 0)
    with pytest.raises(InvalidParams):
        svc.list_objects(ListObjects("[", 10), 0)


def test_a_rebuild_adopts_no_more_copies_of_an_object_than_a_reply_lists() -> None:
    """A restarted master adopts every copy its nodes report, one per segment: past
    REPLICAS_PER_OBJECT_MAX (what a reply lists per key) a get of the key would break the
    client's connection with a protocol error. The copies past it are refused (their nodes
    drop them)."""
    svc = make()
    entry = InventoryEntry("k", 0, OBJECT_SIZE, checksum_of("k"))
    for i in range(limits.REPLICAS_PER_OBJECT_MAX):
        assert mount(svc, f"s{i}", inventory=[entry]) == []
    assert mount(svc, "one-too-many", inventory=[entry]) == [entry]
    reply = svc.get_replica_list(GetReplicaList(["k"]), 0)
    assert len(reply.replicas[0]) == limits.REPLICAS_PER_OBJECT_MAX
    decoder = FrameDecoder()  # and it is a reply a client takes
    decoder.receive_data(encode_frame(reply, 1, is_reply=True))
    assert len(decoder.next_event().message.replicas[0]) == limits.REPLICAS_PER_OBJECT_MAX
    svc.check_invariants()


def test_a_listing_of_long_keys_ends_within_one_reply_frame(monkeypatch) -> None:
    """100,000 keys of 4 KiB (the list limit, the key limit) made a 400 MB reply, over the
    control message limit: the listing stops, truncated, at LIST_OBJECTS_KEY_BYTES_MAX of keys."""
    monkeypatch.setattr(limits, "LIST_OBJECTS_KEY_BYTES_MAX", 10_000)
    svc = make()
    mount(svc, "s1")
    keys = [f"{i}" + "\u00e9" * 1000 for i in range(12)]  # 2,001 bytes each in UTF-8
    put(svc, keys)
    listed = svc.list_objects(ListObjects("", 100), 0)
    assert len(listed.keys) == 4 and listed.truncated


# --- placement ---------------------------------------------------------------------------


def test_placement_free_ratio_takes_the_emptiest() -> None:
    svc = make()
    mount(svc, "s1")
    mount(svc, "s2", capacity=2 * MIB)
    put(svc, [f"k{i}" for i in range(4)], placement="preferred", preferred_segments=["s2"])
    # s1: empty (ratio 1.0); s2: 4 * 64 KiB used of 2 MiB (0.875)
    reply = svc.put_start(PutStart(["f"], [10], config(placement="free_ratio")), 0)
    assert where(reply, 0)[0][0] == "s1"


def test_placement_local_then_random() -> None:
    svc = make()
    mount(svc, "a1", hostname="alpha")
    mount(svc, "b1", hostname="beta")
    mount(svc, "b2", hostname="beta")
    for i in range(20):
        reply = svc.put_start(PutStart([f"k{i}"], [10], config(placement="local")), 0)
        assert where(reply, 0)[0][0] in ("a1", "b1", "b2")
    msg = PutStart([f"l{i}" for i in range(20)], [10] * 20, config(placement="local", replica_num=2), "beta")
    reply = svc.put_start(msg, 0)
    for index in range(20):
        assert sorted(segment_id for segment_id, _ in where(reply, index)) == ["b1", "b2"]
    msg = PutStart(["m"], [10], config(placement="local", replica_num=2), "alpha")
    (first, _), (second, _) = where(svc.put_start(msg, 0), 0)
    assert first == "a1" and second in ("b1", "b2")


def test_placement_preferred_in_order_then_random() -> None:
    svc = make()
    for segment_id in ("s1", "s2", "s3"):
        mount(svc, segment_id)
    cfg = config(placement="preferred", preferred_segments=["s3", "missing", "s1"], replica_num=3)
    reply = svc.put_start(PutStart(["k"], [10], cfg), 0)
    assert [segment_id for segment_id, _ in where(reply, 0)] == ["s3", "s1", "s2"]


def test_placement_random_spreads_over_segments() -> None:
    svc = make(seed=7)
    for segment_id in ("s1", "s2", "s3", "s4"):
        mount(svc, segment_id, capacity=64 * MIB)
    counts: dict[str, int] = {}
    for i in range(400):
        (segment_id, _), = where(svc.put_start(PutStart([f"k{i}"], [10], config()), 0), 0)
        counts[segment_id] = counts.get(segment_id, 0) + 1
    assert set(counts) == {"s1", "s2", "s3", "s4"} and min(counts.values()) > 60


def test_a_segment_whose_node_link_is_lost_takes_no_puts_until_its_node_speaks_again() -> None:
    """A node killed with SIGKILL closes its connection at once; the node TTL (10 s) decides
    that it is gone. Meanwhile puts go to the other segments (not half of them to a dead node)
    and a key held only there reads as missing; a heartbeat, or a re-mount, brings it back."""
    svc = make(seed=7)
    mount(svc, "s1", capacity=64 * MIB)
    mount(svc, "s2", capacity=64 * MIB)
    assert put(svc, ["old"], placement="preferred", preferred_segments=["s1"]) == [OK]
    assert svc.node_link_lost(["s1", "unknown"]) == ["s1"]
    assert svc.node_link_lost(["s1"]) == []
    placed = {where(svc.put_start(PutStart([f"k{i}"], [10], config()), 0), 0)[0][0] for i in range(100)}
    assert placed == {"s2"}
    preferred = svc.put_start(PutStart(["p"], [10], config(placement="preferred", preferred_segments=["s1"])), 0)
    assert where(preferred, 0)[0][0] == "s2"
    assert {s.segment.segment_id: s.state for s in svc.cluster_status(ClusterStatus(), 0).segments} == {
        "s1": "unreachable",
        "s2": "active",
    }
    assert get(svc, ["old"]).codes == [ErrorCode.OBJECT_NOT_FOUND]
    svc.heartbeat(Heartbeat(["s1"]), 1)
    assert [r.segment_id for r in get(svc, ["old"], 1).replicas[0]] == ["s1"]
    placed = {where(svc.put_start(PutStart([f"j{i}"], [10], config()), 0), 0)[0][0] for i in range(100)}
    assert placed == {"s1", "s2"}
    svc.node_link_lost(["s1"])
    mount(svc, "s1", capacity=64 * MIB)  # a re-mount (the master restarted) speaks too
    assert {s.state for s in svc.cluster_status(ClusterStatus(), 0).segments} == {"active"}


def test_a_put_of_a_key_whose_every_replica_is_on_a_lost_node_writes_it_anew() -> None:
    """A key is OBJECT_ALREADY_EXISTS while a replica of it can be read. Once its every replica
    is on a node whose connection is lost (listed until the node TTL), a put answered that way
    left every get missing though the writer was told it stored the key: the put writes it
    anew on a live segment (single and batch), and the old object's replicas go to their
    node's drops, its ranges held until the node, back, forgets them; the re-mount of its
    inventory listing them meanwhile is refused, so the key never has replicas on both."""
    svc = make(seed=7)
    mount(svc, "s1", capacity=64 * MIB)
    mount(svc, "s2", capacity=64 * MIB)
    on_s1 = dict(placement="preferred", preferred_segments=["s1"])
    assert put(svc, ["k", "a", "b"], **on_s1) == [OK] * 3
    assert put(svc, ["both"], replica_num=2) == [OK]
    held = {entry.key: entry for entry in inventories(svc)["s1"]}
    svc.node_link_lost(["s1"])

    assert put(svc, ["both"]) == [ErrorCode.OBJECT_ALREADY_EXISTS]  # its s2 replica is readable
    assert put(svc, ["k"], **on_s1) == [OK]  # on s2: s1 takes no puts
    assert [r.segment_id for r in get(svc, ["k"]).replicas[0]] == ["s2"]
    batch = svc.put_start(PutStart(["a", "new", "a", "both"], [OBJECT_SIZE] * 4, config()), 0)
    assert batch.codes == [OK, OK, ErrorCode.REPLICA_IS_NOT_READY, ErrorCode.OBJECT_ALREADY_EXISTS]
    assert get(svc, ["a"]).codes == [ErrorCode.REPLICA_IS_NOT_READY]  # the new put is in flight
    assert [where(batch, 0)[0][0], where(batch, 1)[0][0]] == ["s2", "s2"]
    assert exists(svc, ["b"]) == [False]  # not put again: kept on s1 until the TTL, read as missing
    assert {s.segment_id: s.object_count for s in svc.segment_counters()} == {"s1": 2, "s2": 2}  # "a": pending

    # The node speaks again and re-mounts with what it held: the replaced entries are refused
    # (their ranges wait for its drops; "a"'s new put is in flight), the others adopted.
    rejected = mount(svc, "s1", capacity=64 * MIB, inventory=held.values())
    assert sorted(entry.key for entry in rejected) == ["a", "k"]
    assert sorted(entry.key for entry in ack_drops(svc)["s1"]) == ["a", "k"]
    pending = svc.put_end(PutEnd(["a", "new"], [checksum_of("a"), checksum_of("new")]), 1)
    assert commit(svc, pending, 1) == [OK, OK]
    for key in ("k", "a"):
        assert [r.segment_id for r in get(svc, [key], 2).replicas[0]] == ["s2"]
    assert sorted(r.segment_id for r in get(svc, ["both"], 2).replicas[0]) == ["s1", "s2"]
    assert [r.segment_id for r in get(svc, ["b"], 2).replicas[0]] == ["s1"]
    assert used(svc, "s1") == 2 * footprint_bytes(OBJECT_SIZE)  # "b" and "both": nothing leaked


def test_a_key_on_a_lost_node_that_finds_no_room_elsewhere_keeps_its_object() -> None:
    """A put of a key on a lost node that finds no live segment with room is refused as any
    put short of room is, and the object stays listed (read as missing meanwhile): its node
    may yet speak again."""
    svc = make()
    mount(svc, "s1")
    assert put(svc, ["k"]) == [OK]
    svc.node_link_lost(["s1"])
    assert put(svc, ["k"]) == [ErrorCode.NO_AVAILABLE_HANDLE]
    assert svc.object_count == 1 and svc.take_drops() == {}
    svc.heartbeat(Heartbeat(["s1"]), 1)
    assert exists(svc, ["k"], 1) == [True]
    assert put(svc, ["k"]) == [ErrorCode.OBJECT_ALREADY_EXISTS]


def test_an_object_on_a_lost_node_only_is_neither_listed_nor_kept_by_its_lease() -> None:
    """Lookups answer missing for an object whose every replica is on a lost node: `ls` did
    list it, and a remove without force answered OBJECT_HAS_LEASE for a lease taken before the
    node was lost, though a put of the key drops it. A segment draining when its node's link
    is lost reads "unreachable" as an active one does (it read "draining")."""
    svc = make(seed=7)
    mount(svc, "s1", capacity=64 * MIB)
    mount(svc, "s2", capacity=64 * MIB)
    on_s1 = dict(placement="preferred", preferred_segments=["s1"])
    assert put(svc, ["lost", "lost2", "lost3"], **on_s1) == [OK] * 3
    assert put(svc, ["kept"], placement="preferred", preferred_segments=["s2"]) == [OK]
    assert get(svc, ["lost", "lost2", "lost3", "kept"]).codes == [OK] * 4  # all four leased
    svc.drain_segment(DrainSegment("s1", 60_000), 1)
    svc.node_link_lost(["s1"])

    assert svc.list_objects(ListObjects("", 10), 1).keys == ["kept"]
    assert {s.segment.segment_id: s.state for s in svc.cluster_status(ClusterStatus(), 1).segments} == {
        "s1": "unreachable", "s2": "active",
    }  # fmt: skip
    assert svc.remove(Remove(["lost", "kept"]), 1).codes == [OK, ErrorCode.OBJECT_HAS_LEASE]
    assert svc.remove_by_regex(RemoveByRegex("lost|kept"), 1).count == 2  # lost2, lost3
    assert svc.object_count == 1
    assert sorted(entry.key for entry in svc.take_drops()["s1"]) == ["lost", "lost2", "lost3"]


def test_a_key_written_anew_keeps_the_pins_of_its_old_object() -> None:
    """An engine's put of a key whose every replica is on a lost node names no pin: the new
    object takes the old one's (a hard pin, a soft pin not lapsed; the stronger of both
    stands). Else the node's pinned copy, refused on its re-mount, left the key to be
    evicted like any other."""
    svc = make(seed=7, node_ttl_ms=600_000, soft_pin_ttl_ms=10_000, evict_watermark_ratio_high=0.9, evict_ratio=0.2)
    mount(svc, "s1")
    mount(svc, "s2")  # 16 objects fill it
    on_s1 = dict(placement="preferred", preferred_segments=["s1"])
    assert put(svc, ["lapsed"], with_soft_pin=True, **on_s1) == [OK]  # its pin lapses at 10 s
    assert put(svc, ["hard"], now=5_000, with_hard_pin=True, **on_s1) == [OK]
    assert put(svc, ["soft", "soft+hard"], now=5_000, with_soft_pin=True, **on_s1) == [OK, OK]
    assert put(svc, ["plain"], now=5_000, **on_s1) == [OK]
    svc.node_link_lost(["s1"])

    keys = ["plain", "lapsed", "hard", "soft"]
    start = svc.put_start(PutStart(keys, [OBJECT_SIZE] * 4, config()), 12_000)
    assert start.codes == [OK] * 4
    again = svc.put_start(PutStart(["soft+hard"], [OBJECT_SIZE], config(with_hard_pin=True)), 12_000)
    assert again.codes == [OK]
    pending = svc.put_end(PutEnd([*keys, "soft+hard"], [checksum_of(k) for k in [*keys, "soft+hard"]]), 12_000)
    assert {e.key: e.pins for e in pending.commits["s2"]} == {
        "plain": 0, "lapsed": 0, "hard": PIN_HARD, "soft": PIN_SOFT, "soft+hard": PIN_HARD,
    }  # fmt: skip
    assert commit(svc, pending, 12_000) == [OK] * 5

    fill(svc, "s2", 11, prefix="f", now=12_001)  # s2 full: eviction takes the unpinned first
    svc.tick(13_000)
    ack_drops(svc, 13_000)
    assert svc.counters.evictions >= 3
    assert exists(svc, ["plain", "lapsed", "hard", "soft", "soft+hard"], 13_000) == [False, False, True, True, True]


def test_lookups_answer_a_key_whose_every_replica_is_on_a_lost_node_missing() -> None:
    """An engine looks before it saves (SGLang's batch_exists, vLLM's and LMCache's
    longest_prefix): a key whose every replica is on a node whose connection is lost was
    answered present, so the put that writes it anew (PutFlow.start) never came, and every
    get missed until the node TTL. exists, longest_prefix, query and get_replica_list answer
    it missing: no lease, no lookup hold (a remove without force takes it). A key with a
    replica elsewhere stays present, all its replicas listed; its node back, the key is too."""
    svc = make(seed=7)
    mount(svc, "s1", capacity=64 * MIB)
    mount(svc, "s2", capacity=64 * MIB)
    assert put(svc, ["lost", "removed"], placement="preferred", preferred_segments=["s1"]) == [OK, OK]
    assert put(svc, ["live"], placement="preferred", preferred_segments=["s2"]) == [OK]
    assert put(svc, ["both"], replica_num=2) == [OK]
    svc.node_link_lost(["s1"])
    keys = ["live", "both", "lost", "removed"]
    missing = ErrorCode.OBJECT_NOT_FOUND

    assert exists(svc, keys, 1) == [True, True, False, False]
    assert svc.longest_prefix(LongestPrefix(["both", "lost", "live"], 5_000, 1), 1).count == 1
    assert svc.longest_prefix(LongestPrefix(["removed", "live"], 5_000, 1), 1).count == 0
    assert svc.counters.lookup_holds == 1  # "both"
    query = svc.query_objects(QueryObjects(keys), 1)
    assert query.codes == [OK, OK, missing, missing] and query.replicas[2:] == [[], []]
    assert sorted(r.segment_id for r in query.replicas[1]) == ["s1", "s2"]
    reply = get(svc, keys, 1)
    assert reply.codes == [OK, OK, missing, missing] and reply.replicas[2:] == [[], []]
    assert (svc.counters.hits, svc.counters.misses) == (2, 2)
    assert svc.remove(Remove(["removed", "both"]), 1).codes == [OK, ErrorCode.OBJECT_HAS_LEASE]

    svc.heartbeat(Heartbeat(["s1"]), 2)
    assert exists(svc, keys, 2) == [True, True, True, False]
    assert [r.segment_id for r in get(svc, ["lost"], 2).replicas[0]] == ["s1"]


def test_a_put_of_a_key_only_a_leaving_segment_holds_writes_it_anew(monkeypatch) -> None:
    """A segment leaving in steps still lists its replicas until its step takes them: a put of
    a key held only there writes it anew (lookups answer it missing meanwhile), and the sweep
    leaves the new object alone."""
    monkeypatch.setattr(limits, "UNMOUNT_SWEEP_KEYS_PER_STEP", 1)
    svc = make()
    mount(svc, "s1")
    mount(svc, "s2")
    fill(svc, "s1", 2, prefix="a")
    svc.unmount_segment(UnmountSegment("s1"), 1)
    assert svc.is_sweeping and svc.object_count == 2 and exists(svc, ["a0", "a1"], 1) == [False, False]
    assert put(svc, ["a0"], now=1) == [OK]
    while svc.sweep_step():
        pass
    assert [r.segment_id for r in get(svc, ["a0"], 2).replicas[0]] == ["s2"]
    assert exists(svc, ["a1"], 2) == [False] and svc.counters.lost == 1


def test_a_put_short_of_room_does_not_count_on_drops_sent_to_a_lost_node() -> None:
    svc = make(evict_watermark_ratio_high=1.0, evict_ratio=0.05)
    mount(svc, "s1")  # 16 objects of 64 KiB fill each
    mount(svc, "s2")
    fill(svc, "s1", 16, prefix="a")
    fill(svc, "s2", 16, prefix="b")
    svc.remove(Remove([f"a{i}" for i in range(16)], force=True), 0)
    assert list(svc.take_drops()) == ["s1"]  # sent to s1's node, which then dies: never acknowledged
    svc.node_link_lost(["s1"])
    assert svc.put_start(PutStart(["n"], [OBJECT_SIZE], config()), 0).codes == [ErrorCode.NO_AVAILABLE_HANDLE]
    assert [e.key for e in ack_drops(svc)["s2"]] == ["b0"]  # s2 evicts for it
    reply = svc.put_start(PutStart(["n"], [OBJECT_SIZE], config()), 0)
    assert reply.codes == [OK] and where(reply, 0)[0][0] == "s2"


def test_a_batch_is_placed_in_runs_that_share_one_range_and_grant() -> None:
    """Keys of one put_start are allocated in runs of up to RUN_BYTES_MAX: per replica one
    contiguous range, carved in key order, with one grant; runs of a large batch spread."""
    svc = make(seed=3)
    for segment_id in ("s1", "s2", "s3", "s4"):
        mount(svc, segment_id, capacity=64 * MIB)
    keys = [f"k{i}" for i in range(128)]
    reply = svc.put_start(PutStart(keys, [4000] * 128, config(replica_num=2)), 0)
    assert reply.codes == [OK] * 128 and len(reply.grants) == 2
    first = where(reply, 0)
    for index in range(128):  # 4000 bytes take 4032 (aligned to 64)
        assert where(reply, index) == [(s, offset + 4032 * index) for s, offset in first]
    assert all(g.size == 4032 * 128 and auth.is_valid_grant(CLUSTER_KEY, g, 0) for g in reply.grants)
    pending = svc.put_end(PutEnd(keys, [checksum_of(k) for k in keys]), 0)
    assert commit(svc, pending, 0) == [OK] * 128
    # 64 objects of 1 MiB: 16 runs of 4 MiB (the last footprint would pass the bound)
    big = [f"big{i}" for i in range(64)]
    reply = svc.put_start(PutStart(big, [MIB] * 64, config()), 0)
    assert reply.codes == [OK] * 64 and len(reply.grants) == 16
    assert len({segment_id for i in range(64) for segment_id, _ in where(reply, i)}) > 1


def test_a_run_without_a_hole_its_size_goes_in_the_fewest_pieces_largest_hole_first() -> None:
    """A full cache's holes are wherever eviction freed the oldest objects: a run that fits in
    none is cut in pieces, each as many of its keys as the largest hole left holds, each one
    contiguous range and one grant. (Halves would have cut 4 keys over a hole of 3 and a hole
    of 1 in three pieces: 2 in the hole of 3, then 1 + 1.)"""
    svc = make()
    mount(svc, "s1")
    keys = fill(svc, "s1", 16)
    holes = keys[2:5] + keys[8:9]  # a hole of three objects and a hole of one
    assert svc.remove(Remove(holes), 0).codes == [OK] * 4
    ack_drops(svc)
    new = [f"n{i}" for i in range(4)]
    reply = svc.put_start(PutStart(new, [OBJECT_SIZE] * 4, config()), 0)
    assert reply.codes == [OK] * 4 and len(reply.grants) == 2
    assert [where(reply, i)[0][1] // OBJECT_SIZE for i in range(4)] == [2, 3, 4, 8]
    assert used(svc, "s1") == 16 * OBJECT_SIZE
    svc.check_invariants()
    # A run larger than every hole left, in a full segment: no room for any key.
    assert svc.put_start(PutStart(["m0", "m1"], [OBJECT_SIZE] * 2, config()), 0).codes == [
        ErrorCode.NO_AVAILABLE_HANDLE
    ] * 2


def test_random_placement_finds_the_one_segment_with_room() -> None:
    svc = make()
    for segment_id in ("s1", "s2", "s3", "s4", "s5"):
        mount(svc, segment_id)
        if segment_id != "s5":
            put(
                svc,
                [f"{segment_id}-{i}" for i in range(16)],
                placement="preferred",
                preferred_segments=[segment_id],
            )
    for i in range(16):
        reply = svc.put_start(PutStart([f"x{i}"], [OBJECT_SIZE], config()), 0)
        assert where(reply, 0)[0][0] == "s5"


# --- eviction -------------------------------------------------------------------------

# These scenarios order victims the same way under LRU and under the default ProbationLru
# (objects read in them are read last, so probation order equals LRU order); each runs under
# both, so LRU stays tested now that it is not the default. Where the two differ, see
# tests/test_master_eviction.py.
EVICTION_POLICIES = ["lru", "probation"]


def fill(svc, segment_id: str, count: int, prefix: str = "k", now: int = 0, **replicate) -> list[str]:
    """`count` objects on `segment_id`, one put each, so that the first is the oldest under
    every policy (ProbationLru enters one batch's keys last key first)."""
    keys = [f"{prefix}{i}" for i in range(count)]
    for key in keys:
        assert put(svc, [key], now=now, placement="preferred", preferred_segments=[segment_id], **replicate) == [OK]
    return keys


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_watermark_eviction_is_lru_and_spares_leases(policy: str) -> None:
    svc = make(policy=policy, lease_ttl_ms=1_000, evict_watermark_ratio_high=0.9, evict_ratio=0.2)
    mount(svc, "s1")
    keys = fill(svc, "s1", 15)  # 15/16 = 0.94 > 0.9
    get(svc, ["k0"], 10)  # k0 becomes the most recent, and leased
    svc.tick(11)
    # max(0.2, 0.9375 - 0.9 + 0.2) * 1 MiB = 0.2375 MiB: four 64 KiB objects.
    drops = svc.take_drops()
    assert [e.key for e in drops["s1"]] == ["k1", "k2", "k3", "k4"]
    assert svc.counters.evictions == 4 and svc.counters.evicted_bytes == 4 * OBJECT_SIZE
    assert exists(svc, keys[:6]) == [True, False, False, False, False, True]
    assert used(svc, "s1") == 15 * OBJECT_SIZE  # drops are not acknowledged yet
    svc.tick(12)  # the scheduled drops count: no second round of eviction
    assert svc.counters.evictions == 4
    for segment_id, entries in drops.items():
        svc.drops_done(segment_id, entries, 13)
    assert used(svc, "s1") == 11 * OBJECT_SIZE
    assert svc.cluster_status(ClusterStatus(), 13).evicted_count == 4


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_eviction_never_takes_leased_or_hard_pinned_and_soft_pinned_last(policy: str) -> None:
    svc = make(policy=policy, lease_ttl_ms=1_000, evict_watermark_ratio_high=0.5, evict_ratio=0.4)
    mount(svc, "s1")
    fill(svc, "s1", 4, prefix="soft", with_soft_pin=True)
    fill(svc, "s1", 4, prefix="hard", with_hard_pin=True)
    fill(svc, "s1", 4, prefix="plain")
    fill(svc, "s1", 4, prefix="read")
    get(svc, [f"read{i}" for i in range(4)], 0)
    svc.tick(1)
    # Goal max(0.4, 1.0 - 0.5 + 0.4) = 0.9 MiB: every evictable object, soft-pinned last.
    evicted = [e.key for e in svc.take_drops()["s1"]]
    assert evicted == [f"plain{i}" for i in range(4)] + [f"soft{i}" for i in range(4)]


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_soft_pin_expires_without_access(policy: str) -> None:
    svc = make(policy=policy, soft_pin_ttl_ms=1_000, evict_watermark_ratio_high=0.9, evict_ratio=0.05)
    mount(svc, "s1")
    fill(svc, "s1", 1, prefix="soft", with_soft_pin=True)
    fill(svc, "s1", 14, prefix="plain")
    svc.tick(999)
    # 15/16 used: max(0.05, 0.9375 - 0.9 + 0.05) of 1 MiB to free is two objects.
    drops = svc.take_drops()
    assert [e.key for e in drops["s1"]] == ["plain0", "plain1"]
    svc.tick(1_000)  # the pin lapsed: soft0 is the least recently used object now
    svc.drops_done("s1", drops["s1"], 1_000)
    fill(svc, "s1", 2, prefix="more")
    svc.tick(1_001)
    assert [e.key for e in svc.take_drops()["s1"]] == ["soft0", "plain2"]


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_get_refreshes_the_soft_pin_and_lru_position(policy: str) -> None:
    svc = make(policy=policy, soft_pin_ttl_ms=1_000, lease_ttl_ms=10, evict_watermark_ratio_high=0.9, evict_ratio=0.05)
    mount(svc, "s1")
    fill(svc, "s1", 1, prefix="soft", with_soft_pin=True)
    fill(svc, "s1", 14, prefix="plain")
    get(svc, ["soft0", "plain0"], 900)
    svc.tick(1_500)  # the pin was refreshed at 900: still pinned; plain0 was read: plain1 goes
    assert [e.key for e in svc.take_drops()["s1"]] == ["plain1", "plain2"]


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_allocation_failure_evicts_then_the_retry_fits(policy: str) -> None:
    svc = make(policy=policy, evict_watermark_ratio_high=1.0, evict_ratio=0.05)
    mount(svc, "s1")
    fill(svc, "s1", 16)
    get(svc, ["k0"], 0)
    reply = svc.put_start(PutStart(["n1", "n2"], [OBJECT_SIZE] * 2, config()), 0)
    assert reply.codes == [ErrorCode.NO_AVAILABLE_HANDLE] * 2
    assert svc.has_pending_drops()
    assert [e.key for e in ack_drops(svc)["s1"]] == ["k1", "k2"]  # k0 is leased
    assert svc.put_start(PutStart(["n1", "n2"], [OBJECT_SIZE] * 2, config()), 0).codes == [OK, OK]


def test_a_put_larger_than_every_segment_is_refused_without_evicting_anything() -> None:
    svc = make(evict_watermark_ratio_high=1.0)
    mount(svc, "s1")
    mount(svc, "s2", capacity=2 * MIB)
    kept = fill(svc, "s1", 16)
    reply = svc.put_start(PutStart(["huge", "fits"], [2 * MIB + 1, OBJECT_SIZE], config()), 0)
    assert reply.codes == [ErrorCode.NO_AVAILABLE_HANDLE, OK]
    assert not svc.has_pending_drops() and all(exists(svc, kept))
    assert not svc.fits_a_segment(2 * MIB + 1) and svc.fits_a_segment(2 * MIB)
    svc.put_start_settled(reply)
    assert svc.counters.errors == 1  # counted once, when the put is over


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_a_second_put_short_of_room_evicts_for_itself_not_on_the_firsts_drops(policy: str) -> None:
    svc = make(policy=policy, evict_watermark_ratio_high=1.0, evict_ratio=0.05)
    mount(svc, "s1")
    fill(svc, "s1", 16)
    assert svc.put_start(PutStart(["a"], [OBJECT_SIZE], config()), 0).codes == [ErrorCode.NO_AVAILABLE_HANDLE]
    # The drop of k0 is in flight: it is the first put's room, so the second evicts k1.
    assert svc.put_start(PutStart(["b"], [OBJECT_SIZE], config()), 0).codes == [ErrorCode.NO_AVAILABLE_HANDLE]
    assert [e.key for e in ack_drops(svc)["s1"]] == ["k0", "k1"]
    assert svc.put_start(PutStart(["a", "b"], [OBJECT_SIZE] * 2, config()), 0).codes == [OK, OK]
    # Room that landed is no one's any more: the next put short of room evicts just for itself.
    assert svc.put_start(PutStart(["c"], [OBJECT_SIZE], config()), 0).codes == [ErrorCode.NO_AVAILABLE_HANDLE]
    assert [e.key for e in ack_drops(svc)["s1"]] == ["k2"]


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_a_put_that_finds_free_bytes_but_no_hole_evicts_an_object_that_makes_one(policy: str) -> None:
    # A full segment of small and large objects side by side, the small ones oldest: evicting
    # the oldest by bytes would free holes too small for a large key, round after round.
    svc = make(policy=policy, lease_ttl_ms=1, evict_watermark_ratio_high=1.0, evict_ratio=0.05)
    mount(svc, "s1")
    for i in range(8):  # 8 x (32 + 96) KiB fill the 1 MiB segment, in address order
        assert put(svc, [f"small{i}"], size=32 * KIB) == [OK]
        assert put(svc, [f"large{i}"], size=96 * KIB) == [OK]
    for i in range(8):  # read (in turn: large0 the least recently), so the small ones go first
        get(svc, [f"large{i}"], 0)
    message = PutStart(["new"], [96 * KIB], config())
    reply = svc.put_start(message, 10)
    assert reply.codes == [ErrorCode.NO_AVAILABLE_HANDLE]
    # One victim, the oldest object whose range is hole enough (here, any large one's is).
    assert [e.key for e in ack_drops(svc)["s1"]] == ["large0"]
    assert svc.put_start_again(message, reply, [0], 10) == []
    assert reply.codes == [OK]


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_the_hole_a_put_needs_is_never_made_of_a_soft_pinned_object(policy: str) -> None:
    svc = make(policy=policy, evict_watermark_ratio_high=1.0, evict_ratio=0.05)
    mount(svc, "s1")
    for i in range(8):
        assert put(svc, [f"small{i}"], size=32 * KIB) == [OK]
        assert put(svc, [f"large{i}"], size=96 * KIB, with_soft_pin=True) == [OK]
    assert svc.put_start(PutStart(["new"], [96 * KIB], config()), 10).codes == [ErrorCode.NO_AVAILABLE_HANDLE]
    assert [e.key for e in ack_drops(svc)["s1"]] == ["small0", "small1", "small2"]  # by bytes, unpinned first


def _short_scan_then_leases_lapse(svc) -> None:
    """A full segment, all but k0 leased until 100: a put of two keys evicts k0 and comes up
    short; its retry finds no more; the leases lapse at 100."""
    mount(svc, "s1")
    keys = fill(svc, "s1", 16)
    for key in keys[1:]:  # in turn: k1 the least recently read
        get(svc, [key], 0)
    message = PutStart(["a", "b"], [OBJECT_SIZE] * 2, config())
    reply = svc.put_start(message, 1)
    assert [e.key for e in ack_drops(svc)["s1"]] == ["k0"]
    assert svc.put_start_again(message, reply, [0, 1], 1) == [1]  # room for a, none for b


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_a_short_scan_of_a_small_table_does_not_refuse_the_puts_after_it(policy: str) -> None:
    # A scan of a few candidates costs less than refusing every put short of room for the
    # backoff's length: a put after the leases lapsed evicts at once.
    svc = make(policy=policy, lease_ttl_ms=100, evict_watermark_ratio_high=1.0, evict_ratio=0.05)
    _short_scan_then_leases_lapse(svc)
    assert svc.put_start(PutStart(["c"], [OBJECT_SIZE], config()), 150).codes == [ErrorCode.NO_AVAILABLE_HANDLE]
    assert [e.key for e in ack_drops(svc)["s1"]] == ["k1"]


def test_a_short_scan_of_a_large_table_backs_off(monkeypatch) -> None:
    monkeypatch.setattr(eviction, "EVICT_SCAN_BACKOFF_CANDIDATES_MIN", 8)  # 16 objects: a long scan
    svc = make(lease_ttl_ms=100, evict_watermark_ratio_high=1.0, evict_ratio=0.05)
    _short_scan_then_leases_lapse(svc)
    svc.put_start(PutStart(["c"], [OBJECT_SIZE], config()), 150)
    assert not svc.has_pending_drops()  # backed off until 1 + EVICT_SHORTFALL_BACKOFF_MS
    svc.put_start(PutStart(["c"], [OBJECT_SIZE], config()), 1 + EVICT_SHORTFALL_BACKOFF_MS)
    assert [e.key for e in ack_drops(svc)["s1"]] == ["k1"]


def test_only_keys_that_no_round_stores_count_as_errors() -> None:
    svc = make(lease_ttl_ms=1_000, evict_watermark_ratio_high=1.0, evict_ratio=0.05)
    mount(svc, "s1")
    keys = fill(svc, "s1", 16)
    get(svc, keys[2:], 0)  # all but two leased: room for two objects, not three
    message = PutStart(["a", "b", "c"], [OBJECT_SIZE] * 3, config())
    reply = svc.put_start(message, 0)
    assert reply.codes == [ErrorCode.NO_AVAILABLE_HANDLE] * 3
    assert svc.counters.errors == 0  # not yet: a later round may store them
    ack_drops(svc)
    assert svc.put_start_again(message, reply, [0, 1, 2], 0) == [2]  # a round stored a and b
    assert svc.counters.errors == 0
    assert svc.counters.put_room_rounds == 1  # what /metrics shows of the wait
    svc.put_start_settled(reply)
    assert reply.codes[:2] == [OK, OK] and svc.counters.errors == 1


def test_a_tick_evicts_a_bounded_number_and_the_next_tick_goes_on(monkeypatch) -> None:
    # The master serves nothing while it evicts: a large backlog goes over several ticks.
    monkeypatch.setattr(eviction, "EVICT_VICTIMS_TICK_MAX", 3)
    svc = make(evict_watermark_ratio_high=0.5, evict_ratio=0.05)
    mount(svc, "s1")
    fill(svc, "s1", 16)  # the goal, 0.55 of 1 MiB, is nine objects
    svc.tick(1)
    assert [e.key for e in ack_drops(svc)["s1"]] == ["k0", "k1", "k2"]
    svc.tick(2)  # not backed off: stopping at the bound is not falling short
    assert [e.key for e in ack_drops(svc)["s1"]] == ["k3", "k4", "k5"]


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_eviction_that_finds_nothing_backs_off(policy: str) -> None:
    svc = make(policy=policy, lease_ttl_ms=100, evict_watermark_ratio_high=0.9, evict_ratio=0.05)
    mount(svc, "s1")
    keys = fill(svc, "s1", 16)
    for key in keys:  # everything leased until 100 (read in turn: k0 the least recently)
        get(svc, [key], 0)
    svc.tick(1)
    assert not svc.has_pending_drops()
    svc.tick(150)  # leases are over, but the scan that came up short backs off for a while
    assert not svc.has_pending_drops()
    svc.tick(1 + EVICT_SHORTFALL_BACKOFF_MS)
    assert [e.key for e in svc.take_drops()["s1"]] == ["k0", "k1", "k2"]


class NewestFirst(EvictionPolicy):
    """A toy policy (most recently inserted first) to show the policy is swappable."""

    def attach(self, table) -> None:
        self.table = table

    def on_insert(self, key, meta) -> None:
        pass

    def on_access(self, key, meta) -> None:
        pass

    def on_remove(self, key, meta) -> None:
        pass

    def select_victims(self, judge, scan_max: int) -> list[str]:
        victims = []
        for key in reversed(list(self.table.objects)[-scan_max:]):
            meta = self.table.objects[key]
            if meta.is_hard_pinned:
                continue
            verdict = judge(key, meta)
            if verdict is Verdict.STOP:
                break
            if verdict is Verdict.TAKE:
                victims.append(key)
        return victims


def test_the_eviction_policy_is_pluggable() -> None:
    config = MasterConfig(evict_watermark_ratio_high=0.9, evict_ratio=0.05)
    svc = Checked(MasterService(config, random.Random(0), None, policy=NewestFirst()))
    mount(svc, "s1")
    fill(svc, "s1", 16)
    svc.tick(1)
    assert [e.key for e in svc.take_drops()["s1"]] == ["k15", "k14", "k13"]


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_eviction_never_touches_a_put_in_flight(policy: str) -> None:
    svc = make(policy=policy, evict_watermark_ratio_high=0.5, evict_ratio=0.4)
    mount(svc, "s1")
    svc.put_start(PutStart([f"w{i}" for i in range(8)], [OBJECT_SIZE] * 8, config()), 0)
    fill(svc, "s1", 8)
    svc.tick(1)
    assert sorted(e.key for e in svc.take_drops()["s1"]) == sorted(f"k{i}" for i in range(8))
    assert svc.pending_count == 8


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_watermark_eviction_targets_the_full_segment_only(policy: str) -> None:
    svc = make(policy=policy, evict_watermark_ratio_high=0.9, evict_ratio=0.1)
    mount(svc, "s1")
    mount(svc, "s2", capacity=4 * MIB)
    fill(svc, "s2", 4, prefix="other")  # older, but on a segment with room
    fill(svc, "s1", 16, prefix="full")
    svc.tick(1)
    evicted = svc.take_drops()
    assert set(evicted) == {"s1"}
    # max(0.1, 1.0 - 0.9 + 0.1) of 1 MiB: four objects, all from s1 though "other*" are older.
    assert [e.key for e in evicted["s1"]] == ["full0", "full1", "full2", "full3"]


# --- membership ---------------------------------------------------------------------------


def test_heartbeat_keeps_segments_and_silence_unmounts_them(caplog) -> None:
    svc = make(node_ttl_ms=1_000)
    mount(svc, "s1", now=0)
    mount(svc, "s2", now=0)
    put(svc, ["both"], replica_num=2)
    put(svc, ["only2"], placement="preferred", preferred_segments=["s2"])
    assert svc.heartbeat(Heartbeat(["s1", "ghost"]), 900).unknown_segment_ids == ["ghost"]
    svc.tick(999)
    assert len(svc.cluster_status(ClusterStatus(), 999).segments) == 2
    with caplog.at_level(logging.INFO, logger="kvpool.master.service"):
        svc.tick(1_000)  # s2 silent for node_ttl_ms: an operator reads why in the log
    assert "segment s2" in caplog.text and "silent for 1000 ms" in caplog.text
    status = svc.cluster_status(ClusterStatus(), 1_000)
    assert [s.segment.segment_id for s in status.segments] == ["s1"]
    assert exists(svc, ["both", "only2"]) == [True, False]
    assert [r.segment_id for r in get(svc, ["both"], 1_000).replicas[0]] == ["s1"]
    assert svc.counters.lost == 1
    assert svc.heartbeat(Heartbeat(["s2"]), 1_001).unknown_segment_ids == ["s2"]


def test_unmount(caplog) -> None:
    svc = make()
    mount(svc, "s1")
    mount(svc, "s2")
    put(svc, ["k"], replica_num=2)
    with pytest.raises(SegmentNotFound):
        svc.unmount_segment(UnmountSegment("nope"), 0)
    with caplog.at_level(logging.INFO, logger="kvpool.master.service"):
        svc.unmount_segment(UnmountSegment("s1"), 0)
    assert "segment s1 unmounted by its node" in caplog.text
    assert [r.segment_id for r in get(svc, ["k"]).replicas[0]] == ["s2"]
    svc.unmount_segment(UnmountSegment("s2"), 0)
    assert exists(svc, ["k"]) == [False]
    assert svc.object_count == 0


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_unmount_of_a_segment_holding_many_objects(policy: str) -> None:
    """The bulk path (ObjectTable.on_segment / remove_many): soft-pinned, read (a protected
    object under probation-lru) and two-replica objects; the policy stays consistent
    (Checked) and still evicts afterwards."""
    svc = make(policy=policy, evict_watermark_ratio_high=0.9, evict_ratio=0.2)
    mount(svc, "s1", capacity=4 * MIB)
    mount(svc, "s2", capacity=MIB)
    only_s1 = fill(svc, "s1", 20, prefix="a") + fill(svc, "s1", 1, prefix="soft", with_soft_pin=True)
    assert put(svc, ["both"], replica_num=2) == [OK]
    get(svc, ["a3", "a4", "both"], 1)  # a second access: protected under probation-lru
    fill(svc, "s2", 12, prefix="b")
    svc.unmount_segment(UnmountSegment("s1"), 2)
    assert not any(exists(svc, only_s1))
    assert svc.counters.lost == 21
    assert [r.segment_id for r in get(svc, ["both"], 3).replicas[0]] == ["s2"]
    assert svc.object_count == 13
    fill(svc, "s2", 2, prefix="c", now=4)  # s2 past its watermark: eviction still finds victims
    svc.tick(5)
    assert [e.key for e in svc.take_drops()["s2"]][:2] == ["b0", "b1"]


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_a_segment_among_many_objects_leaves_in_steps(monkeypatch, policy: str) -> None:
    """With more keys in the table than one step looks at (4 here), an unmount takes the
    segment's replicas a slice of keys at a time (mounts.py): at once it takes no allocation,
    no pending put keeps a range there, its node is told to re-mount, and a drain or a second
    unmount of it changes nothing; the objects only there read as missing at once (the others
    list it until its step took their key); every step leaves the master consistent (Checked:
    tiling, counts, policy); the last one unmounts it, and the objects that lived only there
    are lost, the others keep their replica elsewhere."""
    monkeypatch.setattr(limits, "UNMOUNT_SWEEP_KEYS_PER_STEP", 4)
    svc = make(policy=policy, node_ttl_ms=100_000)
    mount(svc, "s1", capacity=4 * MIB)
    mount(svc, "s2", capacity=MIB)
    only_s1 = fill(svc, "s1", 20, prefix="a")
    assert put(svc, ["both"], replica_num=2) == [OK]
    only_s2 = fill(svc, "s2", 5, prefix="b")
    get(svc, ["a3", "both"], 1)  # read: protected under probation-lru
    in_flight = svc.put_start(PutStart(["p"], [10], config(placement="preferred", preferred_segments=["s1"])), 1)
    assert where(in_flight, 0)[0][0] == "s1"

    svc.unmount_segment(UnmountSegment("s1"), 2)
    assert svc.is_sweeping and svc.has_segment("s1")
    states = {s.segment.segment_id: s.state for s in svc.cluster_status(ClusterStatus(), 2).segments}
    assert states == {"s1": "leaving", "s2": "active"}
    assert svc.heartbeat(Heartbeat(["s1", "s2"]), 2).unknown_segment_ids == ["s1"]
    with pytest.raises(SegmentNotFound):
        svc.drain_segment(DrainSegment("s1", 1_000), 2)
    svc.unmount_segment(UnmountSegment("s1"), 2)  # again: nothing changes
    svc.tick(3)  # housekeeping leaves a leaving segment to its steps
    reply = svc.put_start(PutStart(["new"], [10], config(placement="preferred", preferred_segments=["s1"])), 3)
    assert [segment_id for segment_id, _ in where(reply, 0)] == ["s2"]
    assert svc.put_end(PutEnd(["p"], [1]), 3).codes == [ErrorCode.TRANSFER_FAIL]  # its only range was there
    assert not any(exists(svc, only_s1, 3))  # not swept yet, but leaving: as during a dead node's TTL
    assert sorted(r.segment_id for r in svc.query_objects(QueryObjects(["both"]), 3).replicas[0]) == ["s1", "s2"]

    steps, present = 0, []
    while svc.sweep_step():
        steps += 1
        assert steps < 100
        present.append(svc.object_count)
    assert steps >= (20 + 1 + 5) // 4
    assert present[0] == 26 and min(present[:-1]) < 26  # the snapshot, then slice by slice
    assert not svc.is_sweeping and not svc.has_segment("s1")
    assert not any(exists(svc, only_s1, 4)) and all(exists(svc, only_s2, 4))
    assert [r.segment_id for r in get(svc, ["both"], 4).replicas[0]] == ["s2"]
    assert svc.counters.lost == 20
    assert svc.heartbeat(Heartbeat(["s1"]), 5).unknown_segment_ids == ["s1"]


def test_a_leaving_segment_whose_node_mounts_again_is_unmounted_at_once(monkeypatch) -> None:
    """A node that comes back (it was only silent) re-mounts while its segment leaves: the
    sweep ends there, and the inventory it sends is the truth."""
    monkeypatch.setattr(limits, "UNMOUNT_SWEEP_KEYS_PER_STEP", 4)
    svc = make(node_ttl_ms=1_000)
    mount(svc, "s1", capacity=4 * MIB, now=0)
    mount(svc, "s2", capacity=MIB, now=0)
    keys = fill(svc, "s1", 12, prefix="a")
    held = {e.key: e for e in inventories(svc)["s1"]}
    svc.heartbeat(Heartbeat(["s2"]), 900)
    svc.tick(1_000)  # s1 silent for the TTL: it starts leaving
    assert svc.is_sweeping
    assert svc.sweep_step() and svc.sweep_step()  # the snapshot, then a first slice
    assert mount(svc, "s1", capacity=4 * MIB, now=1_001, inventory=[held[k] for k in keys[:6]]) == []
    assert not svc.sweep_step() and not svc.is_sweeping
    assert exists(svc, keys, 1_002) == [True] * 6 + [False] * 6
    assert svc.heartbeat(Heartbeat(["s1", "s2"]), 1_002).unknown_segment_ids == []


def test_a_bad_replica_report_names_only_current_replicas_and_changes_nothing() -> None:
    """suspect_replicas: what to ask the nodes to hash (the master's size and checksum), for
    replicas that still are at the reported offset; a client's word alone drops nothing. A
    confirmed bad replica goes alone: its object is served from the other replica, and its
    range is dropped on its node; an object whose last replica is bad goes whole."""
    svc = make()
    mount(svc, "s1")
    mount(svc, "s2")
    assert put(svc, ["a", "b"], replica_num=2) == [OK, OK]
    a_on_s1 = next(r.offset for r in get(svc, ["a"]).replicas[0] if r.segment_id == "s1")
    report = ReportBadReplicas(["a", "a", "b", "ghost", "a"], ["s1", "s1", "s1", "s1", "nope"],
                               [a_on_s1, a_on_s1, a_on_s1 + 1, 0, a_on_s1])  # fmt: skip
    suspects = svc.suspect_replicas(report, 1)
    assert suspects == {"s1": [InventoryEntry("a", a_on_s1, OBJECT_SIZE, checksum_of("a"))]}
    assert exists(svc, ["a", "b"]) == [True, True]
    with pytest.raises(InvalidParams):
        svc.suspect_replicas(ReportBadReplicas(["a"], ["s1", "s2"], [0]), 1)
    svc.take_drops()
    assert svc.drop_bad_replicas("s1", suspects["s1"], 2) == (1, 0)  # the node agreed
    assert exists(svc, ["a", "b"]) == [True, True]
    assert [r.segment_id for r in get(svc, ["a"], 3).replicas[0]] == ["s2"]
    assert svc.take_drops() == {"s1": [InventoryEntry("a", a_on_s1, OBJECT_SIZE, checksum_of("a"))]}
    assert svc.drop_bad_replicas("s1", suspects["s1"], 4) == (0, 0)  # already gone from s1
    a_on_s2 = get(svc, ["a"], 5).replicas[0][0].offset
    last = [InventoryEntry("a", a_on_s2, OBJECT_SIZE, checksum_of("a"))]
    assert svc.drop_bad_replicas("s2", last, 6) == (1, 1)  # its last replica: the object goes
    assert exists(svc, ["a", "b"]) == [False, True]


def test_a_bad_replica_confirmed_after_its_key_was_put_again_there_spares_the_new_object() -> None:
    """The check of a reported replica runs on its node while the master serves on: the key
    removed and put again (other bytes) at that very offset meanwhile, the check's verdict on
    the old bytes dropped the new replica (review helper-149). A verdict names the checksum it
    checked, and spares another."""
    svc = make()
    mount(svc, "s1")
    assert put(svc, ["k"]) == [OK]
    offset = get(svc, ["k"]).replicas[0][0].offset
    suspects = svc.suspect_replicas(ReportBadReplicas(["k"], ["s1"], [offset]), 1)
    assert svc.remove(Remove(["k"], force=True), 2).codes == [OK]  # (the get above holds a lease)
    ack_drops(svc, 2)
    start = svc.put_start(PutStart(["k"], [OBJECT_SIZE], config()), 3)
    assert where(start, 0) == [("s1", offset)]  # the range the old replica held
    assert commit(svc, svc.put_end(PutEnd(["k"], [checksum_of("k") ^ 1]), 3), 3) == [OK]
    assert svc.drop_bad_replicas("s1", suspects["s1"], 4) == (0, 0)
    assert exists(svc, ["k"]) == [True]


def test_segment_lost_mid_put() -> None:
    svc = make()
    mount(svc, "s1")
    mount(svc, "s2")
    svc.put_start(PutStart(["a", "b"], [10, 10], config(replica_num=2)), 0)
    svc.put_start(PutStart(["c"], [10], config(placement="preferred", preferred_segments=["s1"])), 0)
    pending = svc.put_end(PutEnd(["a"], [1]), 0)
    svc.unmount_segment(UnmountSegment("s1"), 0)  # while a's commit is in flight
    assert commit(svc, pending, 0) == [OK]
    assert [r.segment_id for r in get(svc, ["a"]).replicas[0]] == ["s2"]
    pending = svc.put_end(PutEnd(["b", "c"], [1, 1]), 0)
    assert pending.codes == [OK, ErrorCode.TRANSFER_FAIL]  # c's only segment is gone
    assert commit(svc, pending, 0) == [OK, ErrorCode.TRANSFER_FAIL]


def test_drain_stops_allocation_then_unmounts() -> None:
    svc = make(node_ttl_ms=100_000)
    mount(svc, "s1")
    mount(svc, "s2")
    put(svc, ["on1"], placement="preferred", preferred_segments=["s1"])
    svc.drain_segment(DrainSegment("s1", 5_000), 1_000)
    with pytest.raises(SegmentNotFound):
        svc.drain_segment(DrainSegment("nope", 5), 0)
    with pytest.raises(InvalidParams):
        svc.drain_segment(DrainSegment("s2", -1), 0)
    for i in range(10):
        cfg = config(placement="preferred", preferred_segments=["s1"], replica_num=2)
        reply = svc.put_start(PutStart([f"n{i}"], [10], cfg), 1_000)
        assert [segment_id for segment_id, _ in where(reply, 0)] == ["s2"]
    assert get(svc, ["on1"], 2_000).codes == [OK]  # still readable
    states = {s.segment.segment_id: s.state for s in svc.cluster_status(ClusterStatus(), 0).segments}
    assert states == {"s1": "draining", "s2": "active"}
    svc.tick(5_999)
    assert exists(svc, ["on1"]) == [True]
    svc.tick(6_000)
    assert exists(svc, ["on1"]) == [False]
    assert not svc.has_segment("s1")


@pytest.mark.parametrize("is_kept", [False, True], ids=["stopping", "kept-for-a-restart"])
def test_a_drain_that_ends_before_its_kept_segments_unmount_still_refuses_what_was_removed_meanwhile(is_kept):
    """A node stopped with --drain-ms and --keep-ms: the master's end of the drain came before
    the node's own unmount, and unmounted the segment for good (its file goes with the node):
    nothing was kept of it, and a key removed meanwhile came back when the node did (review
    helper-150). A drain that says its segment is kept leaves it behind, as a kept unmount does."""
    svc = make(node_ttl_ms=100_000)
    mount(svc, "s1")
    put(svc, ["gone", "stays"])
    entries = inventories(svc)["s1"]
    svc.drain_segment(DrainSegment("s1", 1_000, is_kept), 0)
    svc.tick(1_000)
    assert not svc.has_segment("s1")
    assert svc.remove(Remove(["gone"]), 2_000).codes == [ErrorCode.OBJECT_NOT_FOUND]  # lost with its segment
    rejected = mount(svc, "s1", 3_000, inventory=entries)  # the node back, with its kept segment
    assert [entry.key for entry in rejected] == (["gone"] if is_kept else [])


@pytest.mark.parametrize("comes_back", ["with-its-file", "never", "with-another-file"])
def test_objects_of_a_kept_segment_count_lost_only_if_its_node_does_not_bring_them_back(comes_back):
    """kvpool_master_lost_total rose at every restart of a node with --keep-ms, whose objects
    come back with it (walk-through helper-155); taken on the node's word alone, it then missed
    those of a node killed before it kept them, or never started again (review helper-156)."""
    svc = make(node_ttl_ms=3 * limits.TOMBSTONE_DRAM_TTL_MS)  # no heartbeats here: none goes silent past it
    mount(svc, "s1")
    put(svc, ["a", "b"])
    entries = inventories(svc)["s1"]
    svc.unmount_segment(UnmountSegment("s1", True), 1_000)
    svc.tick(1_000)
    assert svc.counters.lost == 0  # away, not lost
    if comes_back == "with-its-file":
        mount(svc, "s1", 2_000, inventory=entries)
        svc.tick(1_000 + limits.TOMBSTONE_DRAM_TTL_MS + 1)
        assert svc.counters.lost == 0 and exists(svc, ["a", "b"]) == [True, True]
    elif comes_back == "never":
        svc.tick(1_000 + limits.TOMBSTONE_DRAM_TTL_MS - 1)
        assert svc.counters.lost == 0
        svc.tick(1_000 + limits.TOMBSTONE_DRAM_TTL_MS)
        assert svc.counters.lost == 2
    else:  # the same id, another file: what was kept is not there
        mount(svc, "s1", 2_000, token=b"t-another-file")
        assert svc.counters.lost == 2
    svc.tick(2 * limits.TOMBSTONE_DRAM_TTL_MS)
    assert svc.counters.lost == (0 if comes_back == "with-its-file" else 2)  # once


def quarantined(svc, segment_id: str) -> int:
    return next(c.quarantined_bytes for c in svc.segment_counters() if c.segment_id == segment_id)


@pytest.mark.parametrize("is_kept", [True, False], ids=["kept-for-a-restart", "gone-for-good"])
def test_a_segment_mounted_again_with_its_file_keeps_the_ranges_writers_may_still_write(is_kept):
    """A same-host writer copies into the segment file itself, and a TCP write's grant stays
    good under the same segment id: a segment that mounts again with the same file (kept for
    its node's restart, or its node cut off) must not hand out, before their release times,
    the ranges of the puts in flight when it went, nor its quarantined ones: an object put
    after a node's restart was destroyed by a copy granted before it (review helper-150). A
    segment gone for good comes back as a new file: nothing to fence."""
    svc = make(put_discard_timeout_ms=1_000, put_release_timeout_ms=5_000, node_ttl_ms=100_000)
    mount(svc, "s1")
    assert svc.put_start(PutStart(["zombie"], [OBJECT_SIZE], config()), 0).codes == [OK]
    svc.tick(1_500)  # its writer silent past the discard timeout: quarantined until 5_000
    assert svc.put_start(PutStart(["writing"], [OBJECT_SIZE], config()), 1_500).codes == [OK]  # until 6_500
    assert quarantined(svc, "s1") == footprint_bytes(OBJECT_SIZE)
    svc.unmount_segment(UnmountSegment("s1", is_kept), 2_000)
    mount(svc, "s1", 2_500, **({} if is_kept else {"token": b"t-new-file"}))
    if not is_kept:
        assert quarantined(svc, "s1") == used(svc, "s1") == 0
        return
    assert quarantined(svc, "s1") == used(svc, "s1") == 2 * footprint_bytes(OBJECT_SIZE)
    svc.tick(5_000)
    assert quarantined(svc, "s1") == footprint_bytes(OBJECT_SIZE)
    svc.tick(6_500)
    assert quarantined(svc, "s1") == used(svc, "s1") == 0


# --- mount and rebuild --------------------------------------------------------------------


def inventories(svc) -> dict[str, list[InventoryEntry]]:
    """What the nodes hold: every complete object's replicas, by segment (as nodes would know)."""
    listed = svc.list_objects(ListObjects("", limits.LIST_OBJECTS_MAX), 0).keys
    query = svc.query_objects(QueryObjects(listed), 0)
    checks = get(svc, listed, 0).checksums
    held: dict[str, list[InventoryEntry]] = {}
    for key, size, checksum, replicas in zip(listed, query.sizes, checks, query.replicas):
        for replica in replicas:
            held.setdefault(replica.segment_id, []).append(
                InventoryEntry(key, replica.offset, size, checksum)
            )
    return held


def test_restarted_master_rebuilds_from_inventories() -> None:
    old = make(seed=1)
    for segment_id in ("s1", "s2", "s3"):
        mount(old, segment_id)
    assert put(old, ["big"], size=300 * KIB) == [OK]
    assert put(old, [f"k{i}" for i in range(20)], replica_num=2) == [OK] * 20
    held = inventories(old)
    keys = sorted(held_keys(held))
    before = get(old, keys, 0)

    new = make(seed=2)
    for segment_id, entries in held.items():
        assert mount(new, segment_id, inventory=entries) == []
    got = get(new, keys, 0)
    assert got.codes == [OK] * len(keys)
    assert (got.sizes, got.checksums) == (before.sizes, before.checksums)
    for key, replicas in zip(keys, got.replicas):
        old_replicas = get(old, [key], 0).replicas[0]
        assert sorted((r.segment_id, r.offset) for r in replicas) == sorted(
            (r.segment_id, r.offset) for r in old_replicas
        )
    for counters in new.segment_counters():
        assert counters.used_bytes == used(old, counters.segment_id)
    # A re-mount of the same segment is a refresh: nothing changes, nothing is rejected.
    assert mount(new, "s1", inventory=held["s1"]) == []
    assert new.object_count == old.object_count


def held_keys(held: dict[str, list[InventoryEntry]]) -> set[str]:
    return {entry.key for entries in held.values() for entry in entries}


def test_a_segment_naming_another_segments_file_is_refused() -> None:
    """A token holder mounted a segment of its own id with node1's file path and token (both in
    ClusterStatus): same-host clients mapped node1's file for it and copied puts over node1's
    objects, placed by an allocator of its own (helper-52). Its token is node1's: refused, and
    node1 keeps its segment and objects; a segment with a token of its own mounts."""
    svc = make()
    mount(svc, "node1", inventory=[InventoryEntry("k", 0, 100, checksum_of("k"))])
    with pytest.raises(SegmentAlreadyExists, match="names the file of segment 'node1'"):
        mount(svc, "fake", token=b"t-node1")
    assert [s.segment.segment_id for s in svc.cluster_status(ClusterStatus(), 0).segments] == ["node1"]
    assert svc.get_replica_list(GetReplicaList(["k"]), 0).codes == [ErrorCode.OK]
    mount(svc, "fake")
    # A node's own segment mounted again (a refresh, a restarted master) is no alias.
    assert mount(svc, "node1", inventory=[InventoryEntry("k", 0, 100, checksum_of("k"))]) == []


def test_mount_rejects_conflicting_inventory_entries() -> None:
    svc = make()
    mount(svc, "s1", inventory=[InventoryEntry("a", 0, 100, 1)])
    svc.put_start(PutStart(["pending"], [10], config(placement="preferred", preferred_segments=["s1"])), 0)
    inventory = [
        InventoryEntry("b", 64, 100, 2),  # ok: [64, 192)
        InventoryEntry("c", 128, 10, 3),  # overlaps b
        InventoryEntry("a", 4096, 100, 9),  # a with another checksum
        InventoryEntry("d", MIB - 64, 100, 4),  # runs past the end
        InventoryEntry("e", 33, 10, 5),  # unaligned
        InventoryEntry("", 8192, 10, 5),  # bad key
        InventoryEntry("f", 8192, 0, 5),  # bad size
        InventoryEntry("g", 12288, 10, -5),  # bad checksum
        InventoryEntry("pending", 16384, 10, 5),  # a put of it is in flight
        InventoryEntry("b", 20480, 100, 2),  # b twice at two offsets
        InventoryEntry("h", 24576, 10, 6),
        InventoryEntry("h", 24576, 10, 6),  # the same line twice: accepted with the first
    ]
    rejected = mount(svc, "s2", inventory=inventory)
    assert sorted(e.key for e in rejected) == sorted(["c", "a", "d", "e", "", "f", "g", "pending", "b"])
    assert [e.offset for e in rejected if e.key == "b"] == [20480]
    assert exists(svc, ["b", "c", "h"]) == [True, False, True]
    # s1 holds a at offset 0; a second entry for a on s1 at another offset is a conflict.
    assert mount(svc, "s1", inventory=[InventoryEntry("a", 640, 100, 1)]) == [
        InventoryEntry("a", 640, 100, 1)
    ]
    # a on a third segment with the same size and checksum is another replica.
    assert mount(svc, "s3", inventory=[InventoryEntry("a", 0, 100, 1)]) == []
    assert sorted(r.segment_id for r in get(svc, ["a"]).replicas[0]) == ["s1", "s3"]


def test_nothing_is_placed_on_a_segment_until_its_whole_inventory_came() -> None:
    """A node re-mounting after a master restart sends a large inventory in several parts, in
    order of offset. A put placed between two parts would be granted a range the node still
    holds (the lowest free one: where the next part starts): the node refuses the write, and
    the object there is rejected when its entry comes. So the segment takes no new replica
    until the last part."""
    svc = make()
    held = [InventoryEntry(f"k{i}", i * OBJECT_SIZE, OBJECT_SIZE, checksum_of(f"k{i}")) for i in range(8)]
    first = svc.mount_segment(MountSegment(info("s1"), held[:4], is_last=False), 0)
    assert first.rejected == []
    reply = svc.put_start(PutStart(["new"], [OBJECT_SIZE], config()), 1)
    assert reply.codes == [ErrorCode.NO_AVAILABLE_HANDLE]  # nowhere else to go: it waits
    assert svc.mount_segment(MountSegment(info("s1"), held[4:]), 2).rejected == []
    assert exists(svc, [e.key for e in held]) == [True] * len(held)
    reply = svc.put_start(PutStart(["new"], [OBJECT_SIZE], config()), 3)
    assert reply.codes == [OK] and reply.grants[0].offset == len(held) * OBJECT_SIZE
    # A segment already mounted whose node sends its inventory again (a new connection) takes
    # none until that is whole, either.
    svc.mount_segment(MountSegment(info("s1"), held[:2], is_last=False), 4)
    assert svc.put_start(PutStart(["other"], [OBJECT_SIZE], config()), 5).codes == [ErrorCode.NO_AVAILABLE_HANDLE]


def test_mount_identity_rules() -> None:
    svc = make()
    mount(svc, "s1", node="n1", inventory=[InventoryEntry("a", 0, 100, 1)])
    with pytest.raises(SegmentAlreadyExists):
        mount(svc, "s1", node="n2")
    with pytest.raises(SegmentAlreadyExists):
        mount(svc, "s1", node="n1", capacity=2 * MIB)
    with pytest.raises(InvalidParams):
        mount(svc, "tiny", capacity=limits.SEGMENT_SIZE_BYTES_MIN - 1)
    with pytest.raises(InvalidParams):
        mount(svc, "")
    # Same node, same capacity, a new segment token: a new segment file, the old replicas are gone.
    mount(svc, "s1", node="n1", token=b"new")
    assert exists(svc, ["a"]) == [False]
    assert svc.counters.errors == 4


def test_segment_index_reuse_keeps_replicas_straight() -> None:
    svc = make()
    mount(svc, "s1")
    mount(svc, "s2")
    put(svc, ["on2"], placement="preferred", preferred_segments=["s2"])
    svc.unmount_segment(UnmountSegment("s1"), 0)
    mount(svc, "s3")  # takes s1's freed index
    put(svc, ["on3"], placement="preferred", preferred_segments=["s3"])
    assert get(svc, ["on2"]).replicas[0][0].segment_id == "s2"
    assert get(svc, ["on3"]).replicas[0][0].segment_id == "s3"


def test_cluster_status_and_counters() -> None:
    svc = make()
    mount(svc, "s1")
    put(svc, ["a", "b"])
    svc.put_start(PutStart(["p"], [10], config()), 0)
    get(svc, ["a", "x"])
    status = svc.cluster_status(ClusterStatus(), 0)
    assert status.object_count == 2 and status.pending_count == 1 and status.evicted_count == 0
    (segment,) = status.segments
    assert segment.state == "active" and segment.object_count == 2
    assert segment.used_bytes == 2 * OBJECT_SIZE + 64
    counters = svc.counters
    assert (counters.puts, counters.gets, counters.hits, counters.misses) == (2, 2, 1, 1)
    (gauges,) = svc.segment_counters()
    assert gauges.capacity_bytes == MIB and gauges.object_count == 2


def test_a_commit_refused_after_the_put_was_answered_drops_that_replica_and_keeps_the_others() -> None:
    """The server answers a put once its commits are on their way; a node that then refuses
    a replica (bytes not matching the checksum: its write broke off) gets that replica
    dropped, and the object is read from its others, which their own nodes check. Until
    2026-12-07 the whole object went: a put of two replicas whose write to one node broke off
    (the node frozen mid-frame) lost its good copy when that node woke. An object whose every
    replica is refused goes; its space comes back once the nodes acknowledge."""
    svc = make()
    for segment_id in ("s1", "s2"):
        mount(svc, segment_id)
    assert put(svc, ["bad", "good"], replica_num=2) == [OK, OK]
    offsets = {r.segment_id: r.offset for r in get(svc, ["bad"]).replicas[0]}
    refused = {s: [InventoryEntry("bad", offsets[s], OBJECT_SIZE, checksum_of("bad"))] for s in offsets}
    assert svc.refuse_commits("s1", refused["s1"], 1) == (1, 0)
    assert exists(svc, ["bad", "good"]) == [True, True]
    assert [r.segment_id for r in get(svc, ["bad"]).replicas[0]] == ["s2"]
    assert {s: [e.key for e in entries] for s, entries in ack_drops(svc).items()} == {"s1": ["bad"]}
    assert used(svc, "s1") == footprint_bytes(OBJECT_SIZE) and used(svc, "s2") == 2 * footprint_bytes(OBJECT_SIZE)
    # A refusal that comes too late (the replica is gone, or on an unknown segment) is ignored.
    assert svc.refuse_commits("s1", refused["s1"], 2) == (0, 0)
    assert svc.refuse_commits("gone", refused["s1"], 2) == (0, 0)
    # The last replica refused too: the object goes.
    assert svc.refuse_commits("s2", refused["s2"], 3) == (1, 1)
    assert exists(svc, ["bad", "good"]) == [False, True]
    assert {s: [e.key for e in entries] for s, entries in ack_drops(svc).items()} == {"s2": ["bad"]}
    assert used(svc, "s1") == used(svc, "s2") == footprint_bytes(OBJECT_SIZE)  # "good" only
    assert svc.counters.errors == 2


def test_grants_and_mount_replies_carry_the_master_term() -> None:
    svc = MasterService(MasterConfig(), random.Random(0), CLUSTER_KEY, term=5)
    reply = svc.mount_segment(MountSegment(info("s1"), []), 0)
    assert reply.term == 5
    start = svc.put_start(PutStart(["a", "b"], [10, 10], config()), 0)
    assert [g.term for g in start.grants] == [5]
    assert auth.is_valid_grant(CLUSTER_KEY, start.grants[0], 0)


def test_a_rebuilt_master_keeps_the_pins_the_nodes_recorded() -> None:
    """Commits carry the object's pins into the node's inventory, so a master rebuilt from the
    nodes evicts as the old one would: never a hard-pinned object, soft-pinned ones last."""
    from kvpool.protocol.messages import PIN_HARD, PIN_SOFT

    old = make()
    mount(old, "s1")
    held: list[InventoryEntry] = []
    for prefix, pins in (("soft", {"with_soft_pin": True}), ("hard", {"with_hard_pin": True}), ("plain", {})):
        keys = [f"{prefix}{i}" for i in range(4)]
        old.put_start(PutStart(keys, [OBJECT_SIZE] * 4, config(**pins)), 0)
        pending = old.put_end(PutEnd(keys, [checksum_of(k) for k in keys]), 0)
        held += pending.commits["s1"]
        assert commit(old, pending, 0) == [OK] * 4
    assert [e.pins for e in held] == [PIN_SOFT] * 4 + [PIN_HARD] * 4 + [0] * 4
    new = make(evict_watermark_ratio_high=0.5, evict_ratio=0.4)
    assert mount(new, "s1", now=10, inventory=held) == []
    new.tick(11)
    # Goal max(0.4, 0.75 - 0.5 + 0.4) = 0.65 MiB of 12 objects of 64 KiB: all but the hard ones.
    evicted = [e.key for e in new.take_drops()["s1"]]
    assert evicted == [f"plain{i}" for i in range(4)] + [f"soft{i}" for i in range(4)]


def test_every_master_counter_is_on_metrics_with_a_help_that_says_what_it_counts() -> None:
    import dataclasses

    from kvpool.master.counters import MasterCounters
    from kvpool.master.metrics import MasterMetrics

    text = MasterMetrics(make()).render().decode()
    for field in dataclasses.fields(MasterCounters):
        assert f"# HELP kvpool_master_{field.name}_total " in text, field.name
    # A lookup's hit is not the reader's: an operator must not read it as the hit rate served.
    assert "its read may still miss" in text


def test_a_segment_named_at_length_is_refused_in_few_words() -> None:
    """A mount whose endpoint (or node id, hostname, path) is megabytes long was accepted and
    logged whole at each mount (fuzzing: 50 MB of master log from ten requests)."""
    svc = make()
    for field in ("node_id", "hostname", "endpoint", "shm_path"):
        info = SegmentInfo("s1", "node-s1", "host", "host:1", "/dev/shm/x", b"t", 64 * MIB)
        setattr(info, field, "x" * 5_000_000)
        with pytest.raises(InvalidParams, match=field) as refused:
            svc.mount_segment(MountSegment(info, []), 0)
        assert len(str(refused.value)) < 200
    assert svc.cluster_status(ClusterStatus(), 0).segments == []
