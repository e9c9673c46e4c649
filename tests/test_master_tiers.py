"""The master's side of the tiers: offload on evict, promotion, write-through, DFS, restarts.

How: a pure MasterService behind the `Checked` proxy of test_master_service.py (every call is
followed by check_invariants(), which also proves the table's split by residence, the moves'
held ranges and every segment's leaving bytes). The test plays the nodes: it takes the move
outbox, answers each item with a code, and acknowledges drops explicitly. No sockets, no
sleeps, time passed in.
"""

from __future__ import annotations

import logging

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool import ReplicateConfig, limits
from kvpool.errors import ErrorCode, SegmentAlreadyExists
from kvpool.master import tiers as tiers_module
from kvpool.master.allocator import footprint_bytes
from kvpool.node.inventory import Inventory
from kvpool.protocol import objectfile
from kvpool.protocol.messages import (
    TIER_DFS,
    TIER_DISK,
    TIER_DRAM,
    ClusterStatus,
    ExistKeys,
    FilesystemReport,
    GetReplicaList,
    Heartbeat,
    InventoryEntry,
    MountSegment,
    MoveItem,
    PutEnd,
    PutRevoke,
    PutStart,
    QueryObjects,
    Remove,
    SegmentInfo,
    UnmountSegment,
)
from tests.test_master_service import OBJECT_SIZE, checksum_of, commit, make, put

MIB = limits.MIB
OK = ErrorCode.OK
FAIL = ErrorCode.TRANSFER_FAIL


def dram(segment_id: str, node: str, capacity: int = MIB) -> SegmentInfo:
    return SegmentInfo(segment_id, node, "host-a", "host-a:1", "/dev/shm/x", b"t-" + segment_id.encode(), capacity)


def disk(segment_id: str, node: str, capacity: int = 8 * MIB, token: bytes = b"disk-token") -> SegmentInfo:
    return SegmentInfo(segment_id, node, "host-a", "host-a:1", "/nvme/x", token, capacity, TIER_DISK)


def dfs(capacity: int = 64 * MIB) -> SegmentInfo:
    return SegmentInfo("dfs-1", "dfs", "", "", "/dfs", b"dfs-token", capacity, TIER_DFS)


def cluster(disk_capacity: int = 8 * MIB, with_dfs: bool = False, **config):
    """One node "n1" with a DRAM segment "A" (1 MiB) and a disk tier "A/disk" (nodes never
    time out here: the test plays them)."""
    config.setdefault("node_ttl_ms", limits.SETTING_DURATION_MS_MAX)
    svc = make(**config)
    svc.mount_segment(MountSegment(dram("A", "n1"), []), 0)
    if disk_capacity:
        svc.mount_segment(MountSegment(disk("A/disk", "n1", disk_capacity), []), 0)
    if with_dfs:
        svc.mount_segment(MountSegment(dfs(), []), 0)
    return svc


def keys(prefix: str, count: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(count)]


def ack_drops(svc, now: int = 0) -> dict[str, list[InventoryEntry]]:
    drops = svc.take_drops()
    for segment_id, entries in drops.items():
        svc.drops_done(segment_id, entries, now)
    return drops


def run_moves(svc, now: int = 0, answer=lambda item: OK) -> list[tuple[str, MoveItem]]:
    """Take the outbox and answer every item; returns (executor segment id, item) pairs."""
    done = []
    for segment_id, items in svc.take_moves().items():
        svc.finish_moves(segment_id, items, [int(answer(item)) for item in items], now)
        done.extend((segment_id, item) for item in items)
    return done


def where(svc, key: str) -> list[str]:
    reply = svc.query_objects(QueryObjects([key]), 0)
    return sorted(r.segment_id for r in reply.replicas[0])


def tiers(svc) -> dict[str, dict]:
    status = svc.cluster_status(ClusterStatus(), 0).to_dict()
    return {t["tier"]: t for t in status["tiers"]}


def fill(svc, count: int = 16, prefix: str = "k", now: int = 0) -> list[str]:
    """One put per key: the first is the oldest (one batch's keys enter last key first)."""
    names = keys(prefix, count)
    for name in names:
        assert put(svc, [name], now=now) == [OK]
    return names


def test_dram_eviction_offloads_to_the_nodes_disk_and_the_object_stays_readable_throughout():
    svc = cluster()
    names = fill(svc)  # 16 x 64 KiB: the DRAM segment is full (above the 0.90 watermark)
    svc.tick(1)
    moves = svc.take_moves()
    assert list(moves) == ["A"]  # the node that holds the bytes runs the copies
    items = moves["A"]
    # Above the watermark by 0.10: free 0.10 + 0.05 of 1 MiB, three 64 KiB objects.
    assert len(items) == 3
    assert {(i.src_segment_id, i.dst_segment_id) for i in items} == {("A", "A/disk")}
    moving = items[0].key
    assert where(svc, moving) == ["A"]
    assert svc.get_replica_list(GetReplicaList([moving]), 2).codes == [OK]  # still readable
    assert svc.take_drops() == {}  # nothing dropped while the bytes are being copied
    svc.finish_moves("A", items, [OK, OK, OK], 3)
    # The object now lives on disk; its DRAM range is freed once the node forgot it. The
    # get above leased `moving` for 10 s: its DRAM replica stays until an eviction without lease.
    assert where(svc, items[1].key) == ["A/disk"]
    assert where(svc, moving) == ["A", "A/disk"]
    drops = ack_drops(svc)
    assert [e.key for e in drops["A"]] == [items[1].key, items[2].key]
    status = tiers(svc)
    assert status[TIER_DISK]["object_count"] == 3
    assert status[TIER_DISK]["offloads"] == 3
    assert status[TIER_DRAM]["evictions"] == 2  # the leased one's DRAM replica stays, not evicted
    assert svc.exist_keys(ExistKeys(names), 4).flags == [True] * 16
    reply = svc.get_replica_list(GetReplicaList([items[1].key]), 5)
    assert reply.codes == [OK] and [r.segment_id for r in reply.replicas[0]] == ["A/disk"]
    assert reply.segments["A/disk"].tier == TIER_DISK


def test_put_without_room_offloads_then_fits():
    svc = cluster()
    fill(svc)
    start = svc.put_start(PutStart(["new"], [OBJECT_SIZE], ReplicateConfig()), 1)
    assert start.codes == [ErrorCode.NO_AVAILABLE_HANDLE]
    assert svc.has_unsent_moves()  # the server sends them, waits, flushes the drops, retries
    run_moves(svc, 2)
    ack_drops(svc, 2)
    assert put(svc, ["new"], now=3) == [OK]


def put_in_rounds(svc, names: list[str], now: int) -> list[str]:
    """A put as the server runs it when keys find no room: moves and drops land, then the keys
    without room try again, up to PUT_ROOM_ROUNDS_MAX times; then put_end and the commits of
    the keys that found room. Returns the keys left without."""
    start = svc.put_start(PutStart(names, [OBJECT_SIZE] * len(names), ReplicateConfig()), now)
    retry = [name for name, code in zip(names, start.codes) if code == ErrorCode.NO_AVAILABLE_HANDLE]
    for _ in range(limits.PUT_ROOM_ROUNDS_MAX):
        if not retry:
            break
        run_moves(svc, now)
        ack_drops(svc, now)
        again = svc.put_start(PutStart(retry, [OBJECT_SIZE] * len(retry), ReplicateConfig()), now)
        retry = [name for name, code in zip(retry, again.codes) if code == ErrorCode.NO_AVAILABLE_HANDLE]
    granted = [name for name in names if name not in retry]
    pending = svc.put_end(PutEnd(granted, [checksum_of(k) for k in granted]), now)
    assert commit(svc, pending, now) == [OK] * len(granted)
    return retry


def test_an_offload_into_a_full_disk_tier_evicts_an_object_that_makes_it_a_hole():
    # The disk tier fills with small and large objects side by side (offloaded in turn); its
    # large ones are read, so its small ones go first: evicting them by bytes frees holes no
    # large object fits, so the first victim is a large one.
    svc = cluster(disk_capacity=MIB, evict_watermark_ratio_high=1.0, lease_ttl_ms=1)
    sizes = {f"{kind}{i}": size for i in range(16) for kind, size in (("s", 32 << 10), ("b", 96 << 10))}
    now = 0
    for key, size in sizes.items():  # 32 objects: the second 16 offload the first 16, in turn
        now += 10
        put_through(svc, key, now, size)
    on_disk = [key for key in sizes if where(svc, key) == ["A/disk"]]
    assert on_disk == [f"{kind}{i}" for i in range(8) for kind in "sb"]  # the disk is full
    for i in range(8):  # read in turn: b0 the least recently
        svc.get_replica_list(GetReplicaList([f"b{i}"]), now)
    now += 10  # the reads' leases are over
    # A put of 96 KiB evicts b8, the DRAM object that makes it room: its offload into the full
    # disk evicts b0 there, and goes once that drop landed.
    message = PutStart(["new"], [96 << 10], ReplicateConfig())
    reply = svc.put_start(message, now)
    assert [e.key for e in ack_drops(svc, now)["A/disk"]] == ["b0"]
    for _ in range(3):  # rounds as the server runs them
        run_moves(svc, now)
        ack_drops(svc, now)
        if not svc.put_start_again(message, reply, [0], now):
            break
    assert reply.codes == [OK]
    assert where(svc, "b8") == ["A/disk"] and not svc.exist_keys(ExistKeys(["b0"]), now).flags[0]


def both_tiers_full():
    """Eviction only for room; DRAM (16 objects) and the disk tier (16) full."""
    svc = cluster(disk_capacity=MIB, evict_watermark_ratio_high=1.0)
    fill(svc, 16, "dram")
    for batch in range(2):
        assert put_in_rounds(svc, keys(f"more{batch}-", 8), now=1) == []
    status = tiers(svc)
    assert status[TIER_DISK]["used_bytes"] == status[TIER_DISK]["capacity_bytes"] == MIB
    return svc


def test_a_batch_finds_room_when_dram_and_disk_are_both_full():
    # Room comes in two rounds, the disk tier dropping what makes room for DRAM's offloads,
    # then DRAM dropping what it offloaded. Each of a batch's victims needs disk room of its
    # own (a batch used to wait on the first victim's, one object per round), and the second
    # round must not find DRAM's eviction backed off (it used to be, for 250 ms, failing every
    # put meanwhile).
    svc = both_tiers_full()
    for now in (2, 3):
        assert put_in_rounds(svc, keys(f"batch{now}-", 8), now) == [], f"t={now}"
    status = tiers(svc)
    assert status[TIER_DISK]["used_bytes"] == status[TIER_DISK]["capacity_bytes"]  # full, and turning over
    assert status[TIER_DISK]["evictions"] >= 16


def test_a_second_put_before_the_drops_land_evicts_nothing_more_from_the_disk():
    # A put of 8 keys makes DRAM pick 8 victims, whose offloads need 8 objects' room on the
    # disk: the disk drops 8. Another put arriving before those drops land (another client)
    # picks the same victims, and the room coming covers them: no disk object more.
    svc = both_tiers_full()
    for name in ("first", "second"):
        start = svc.put_start(PutStart(keys(name, 8), [OBJECT_SIZE] * 8, ReplicateConfig()), 2)
        assert start.codes == [ErrorCode.NO_AVAILABLE_HANDLE] * 8
    drops = ack_drops(svc, 2)
    assert len(drops["A/disk"]) == 8
    assert "A" not in drops  # DRAM's room comes from the offloads, once they land


def write_through(svc, names: list[str], now: int = 0, **replicate) -> dict[str, list[MoveItem]]:
    """A put with copies, as the server runs it: put_end, then start_copies (the reply waits)."""
    start = svc.put_start(PutStart(names, [OBJECT_SIZE] * len(names), ReplicateConfig(**replicate)), now)
    assert start.codes == [OK] * len(names)
    pending = svc.put_end(PutEnd(names, [checksum_of(k) for k in names]), now)
    results = {segment_id: [0] * len(entries) for segment_id, entries in pending.commits.items()}
    reply = svc.finish_put_end(pending, results, now)
    assert reply.codes == [OK] * len(names)
    return svc.start_copies(pending, reply, now)


def test_write_through_copies_to_the_nodes_disk_and_to_the_dfs():
    svc = cluster(with_dfs=True)
    copies = write_through(svc, ["w"], with_disk_copy=True, with_dfs_copy=True)
    assert sorted((i.src_segment_id, i.dst_segment_id) for i in copies["A"]) == [("A", "A/disk"), ("A", "dfs-1")]
    assert not svc.has_unsent_moves()  # the put's own flow sends them
    svc.finish_moves("A", copies["A"], [OK, OK], 1)
    assert where(svc, "w") == ["A", "A/disk", "dfs-1"]
    assert tiers(svc)[TIER_DISK]["object_count"] == 1
    assert write_through(svc, ["plain"]) == {}


def test_write_through_then_dram_eviction_drops_only_the_dram_replica():
    svc = cluster()
    names = keys("w", 16)
    copies = write_through(svc, names, with_disk_copy=True)
    svc.finish_moves("A", copies["A"], [OK] * 16, 0)
    svc.tick(20_000)  # past every lease
    assert svc.take_moves() == {}  # a disk copy exists: DRAM replicas just go
    drops = ack_drops(svc, 20_000)
    assert len(drops["A"]) == 3
    for entry in drops["A"]:
        assert where(svc, entry.key) == ["A/disk"]


def test_an_offload_finishing_under_a_lease_keeps_both_replicas():
    svc = cluster()
    fill(svc)
    svc.tick(1)
    items = svc.take_moves()["A"]
    leased = [item.key for item in items]
    assert svc.get_replica_list(GetReplicaList(leased), 2).codes == [OK] * 3
    svc.finish_moves("A", items, [OK] * 3, 3)
    assert ack_drops(svc, 3) == {}
    for key in leased:
        assert where(svc, key) == ["A", "A/disk"]
    assert tiers(svc)[TIER_DRAM]["object_count"] == 16  # kept, as ordinary replicas
    assert tiers(svc)[TIER_DISK]["object_count"] == 3


def test_remove_during_an_offload_drops_its_source_and_target_when_the_move_ends():
    svc = cluster()
    fill(svc)
    svc.tick(1)
    items = svc.take_moves()["A"]
    victim = items[0].key
    assert svc.remove(Remove([victim]), 2).codes == [OK]
    assert svc.exist_keys(ExistKeys([victim]), 2).flags == [False]
    assert svc.take_drops() == {}  # the node may be reading the source right now
    svc.finish_moves("A", items, [OK] * 3, 3)
    drops = ack_drops(svc, 3)
    assert [e.key for e in drops["A/disk"]] == [victim]  # the copy it made, and
    assert victim in [e.key for e in drops["A"]]  # the source, both forgotten


def test_a_failed_offload_evicts_and_frees_its_target():
    svc = cluster()
    fill(svc)
    svc.tick(1)
    items = svc.take_moves()["A"]
    svc.finish_moves("A", items, [FAIL] * 3, 3)
    assert svc.exist_keys(ExistKeys([i.key for i in items]), 3).flags == [False] * 3
    assert tiers(svc)[TIER_DISK]["used_bytes"] == 0
    assert tiers(svc)[TIER_DISK]["failed_moves"] == 3
    assert len(ack_drops(svc)["A"]) == 3


class SmallFilesystem:
    """The filesystem under the disk tiers ("A/disk", and "B/disk" where a test has it on the
    same disk) as their nodes see it: room for `files_max` object files (other files took the
    rest), so a write beyond them fails as a full disk does."""

    def __init__(self, files_max: int, object_size: int = OBJECT_SIZE) -> None:
        self.files_max = files_max
        self.object_size = object_size
        self.files: set[str] = set()
        self.full_answers = 0

    def answer(self, item: MoveItem) -> ErrorCode:
        if not item.dst_segment_id.endswith("/disk"):
            return OK
        if len(self.files) >= self.files_max:
            self.full_answers += 1
            return ErrorCode.NO_AVAILABLE_HANDLE  # the node's FilesystemFull
        self.files.add(item.key)
        return OK

    def free_bytes(self) -> int:
        """What statvfs would say is left: room for this many more object files (each its
        object's bytes and a header of one page)."""
        file_bytes = footprint_bytes(self.object_size) + objectfile.header_size_for("k0")
        return (self.files_max - len(self.files)) * file_bytes

    def put(self, svc, key: str | list[str], now: int) -> None:
        """One put (of a key, or a batch) as the server runs it: moves and drops land between
        its rounds."""
        todo = [key] if isinstance(key, str) else key
        for _ in range(limits.PUT_ROOM_ROUNDS_MAX):
            codes = put(svc, todo, size=self.object_size, now=now)
            todo = [name for name, code in zip(todo, codes) if code != OK]
            if not todo:
                return
            run_moves(svc, now, self.answer)
            drops = ack_drops(svc, now)
            self.files -= {entry.key for disk in ("A/disk", "B/disk") for entry in drops.get(disk, [])}
        raise AssertionError(f"{todo} found no room")


@pytest.mark.parametrize("batch", [1, 4])
def test_a_disk_tier_whose_filesystem_fills_up_keeps_its_newest_objects(caplog, batch):
    # 4 MiB of disk tier by its capacity, but other files left its filesystem room for 8
    # objects of 64 KiB. Before: every offload after the 8th failed, so the disk kept the 8
    # oldest objects for good and every object evicted from DRAM since was lost.
    svc = cluster(disk_capacity=4 * MIB)
    filesystem = SmallFilesystem(files_max=8)
    now = 0
    names = keys("k", 64)
    with caplog.at_level(logging.WARNING, logger="kvpool.master.service"):
        for start in range(0, len(names), batch):
            now += 100
            filesystem.put(svc, names[start : start + batch], now)
    # The offloads in flight when it filled (a batch put evicts several at once) found it
    # full: those objects stayed in DRAM (before 2026-12-06 they were lost), entered there
    # again (as read ones: they go after the unread); its room was capped at what it held.
    assert filesystem.full_answers == batch
    assert tiers(svc)[TIER_DISK]["failed_moves"] == batch
    assert len(filesystem.files) == 8
    on_disk = sorted(filesystem.files, key=names.index)
    in_dram = [name for name in names if where(svc, name) == ["A"]]
    kept = [name for name in in_dram if names.index(name) < names.index(on_disk[0])]
    assert kept == names[8 : 8 + batch]  # the first offloads past the filesystem's 8 files
    # Else least recently used first, in DRAM as on the disk: what is left is the newest objects.
    rest = [name for name in in_dram if name not in kept]
    assert on_disk + rest == names[-len(on_disk + rest) :]
    assert all(where(svc, name) == ["A/disk"] for name in on_disk)
    (full,) = [r.getMessage() for r in caplog.records if "its filesystem is full" in r.getMessage()]
    assert f"full with {8 * footprint_bytes(OBJECT_SIZE)} of" in full  # once all those failed

    # A minute later the tier is tried at its capacity again: the other files are gone.
    filesystem.files_max = 64
    for name in keys("later", 16):
        now += 100
        filesystem.put(svc, name, now + tiers_module.FULL_TIER_RETRY_MS)
    assert filesystem.full_answers == batch  # none more
    assert len(filesystem.files) > 8


def test_the_free_space_a_node_reports_caps_its_disk_tier_before_a_move_fails(caplog):
    # The filesystem of the test above, but the node's heartbeats (one a second) say what it
    # has free: the master caps the tier's room before any move finds the disk full. Without
    # the report, the first move to find it full failed, and lost its object.
    svc = cluster(disk_capacity=4 * MIB)
    filesystem = SmallFilesystem(files_max=8)

    def heartbeat(now: int) -> None:
        svc.heartbeat(Heartbeat(["A", "A/disk"], {"A/disk": FilesystemReport(filesystem.free_bytes())}), now)

    now = 0
    names = keys("k", 64)
    with caplog.at_level(logging.INFO, logger="kvpool.master.service"):
        for name in names:
            now += 100
            if now % 1000 == 0:
                heartbeat(now)
            filesystem.put(svc, name, now)
        assert filesystem.full_answers == 0
        assert len(filesystem.files) == 8
        on_disk = sorted(filesystem.files, key=names.index)
        in_dram = [name for name in names if where(svc, name) == ["A"]]
        assert on_disk + in_dram == names[-len(on_disk + in_dram) :]  # the newest objects
        capped = [r for r in caplog.records if "room for" in r.getMessage()]
        assert [r.levelno for r in capped] == [logging.WARNING]  # once, not once a heartbeat

        # The other files go: the next report lifts the cap (no minute to wait).
        filesystem.files_max = 64
        heartbeat(now)
        for name in keys("later", 16):
            now += 100
            filesystem.put(svc, name, now)
        assert len(filesystem.files) > 8 and filesystem.full_answers == 0
        lifted = [r for r in caplog.records if "use it all again" in r.getMessage()]
        assert [r.levelno for r in lifted] == [logging.INFO]


@pytest.mark.parametrize("is_look_known", [True, False])
def test_moves_that_land_during_a_look_at_free_space_are_not_counted_twice(is_look_known):
    # The master looks at the DFS's free space on a thread, then reports it as its heartbeat:
    # moves that land meanwhile were in its count of the tier's files and, by the look, still
    # free. Counted twice, that room went to two objects, and a move found the share full
    # (seen under load as "No space left" in test_cluster_disk.py). Known to the master (the
    # DFS's look), they are counted as still to come; a node's look is not (docs/tiers.md).
    svc = cluster(disk_capacity=4 * MIB)
    filesystem = SmallFilesystem(files_max=8)
    now = 0
    for name in keys("k", 64):
        now += 100
        if is_look_known:
            svc.filesystem_look_begins("A/disk")
        look = filesystem.free_bytes()
        filesystem.put(svc, name, now)  # its offloads land during the look
        svc.heartbeat(Heartbeat(["A", "A/disk"], {"A/disk": FilesystemReport(look)}), now)
    assert (filesystem.full_answers == 0) == is_look_known
    # Files deleted during the look count as there (its free space was looked at before), as
    # long as that look rules: a little room stays unused, never more than the filesystem has.
    assert len(filesystem.files) >= 6


def test_disk_tiers_of_two_nodes_on_one_filesystem_share_its_free_space():
    # Two nodes on one host, their disk tiers on one disk. Each node reports the same free
    # space: counted per tier, each would take all of it, and together they would overfill it.
    svc = cluster(disk_capacity=4 * MIB)
    svc.mount_segment(MountSegment(dram("B", "n2"), []), 0)
    svc.mount_segment(MountSegment(disk("B/disk", "n2", 4 * MIB, token=b"disk-token-b"), []), 0)
    filesystem = SmallFilesystem(files_max=8)
    for index, name in enumerate(keys("k", 96)):
        now = index * 100
        if now % 1000 == 0:
            for node in ("A", "B"):
                report = {f"{node}/disk": FilesystemReport(filesystem.free_bytes(), device=7)}
                svc.heartbeat(Heartbeat([node, f"{node}/disk"], report), now)
        filesystem.put(svc, name, now)
    assert filesystem.full_answers == 0
    assert len(filesystem.files) >= 7
    assert tiers(svc)[TIER_DISK]["object_count"] == len(filesystem.files)  # both tiers, as the master counts


def test_a_tier_of_small_pages_counts_their_headers_and_stays_full():
    # 4 KiB pages take 8 KiB files (a 4 KiB header each). Counting only their bytes, the master
    # would fill the filesystem with twice what it has room for, and moves would fail.
    svc = cluster(disk_capacity=4 * MIB)
    filesystem = SmallFilesystem(files_max=64, object_size=4096)
    held = []
    for index, name in enumerate(keys("p", 600)):
        if index % 100 == 0:
            report = {"A/disk": FilesystemReport(filesystem.free_bytes())}
            svc.heartbeat(Heartbeat(["A", "A/disk"], report), index * 10)
        filesystem.put(svc, name, index * 10)
        held.append(len(filesystem.files))
    assert filesystem.full_answers == 0
    assert min(held[400:]) >= 63  # full, not emptied by evictions that overshoot


@pytest.mark.parametrize("with_dfs", [True, False])
def test_a_disk_tier_that_takes_no_writes_is_skipped_and_still_read(caplog, with_dfs):
    # Its filesystem went read-only (ext4 remounts itself so on I/O errors) or its directory is
    # gone. Before: every offload there failed, one TRANSFER_FAIL per object, each object lost.
    svc = cluster(with_dfs=with_dfs)
    fill(svc)
    svc.tick(1)
    on_disk = [item.key for _, item in run_moves(svc, 1)]
    ack_drops(svc, 1)
    assert [where(svc, key) for key in on_disk] == [["A/disk"]] * 3
    unwritable = Heartbeat(["A", "A/disk"], {"A/disk": FilesystemReport(is_writable=False)})
    with caplog.at_level(logging.INFO, logger="kvpool.master.service"):
        svc.heartbeat(unwritable, 2)
        svc.heartbeat(unwritable, 3)
        fill(svc, 3, prefix="x", now=4)
        svc.tick(5)
        moves = svc.take_moves()
        if with_dfs:  # to the next tier down
            assert {item.dst_segment_id for item in moves["A"]} == {"dfs-1"}
        else:  # dropped, as without a tier
            assert moves == {} and ack_drops(svc, 5)["A"]
        assert svc.get_replica_list(GetReplicaList(on_disk), 5).codes == [OK] * 3  # read as before
        svc.heartbeat(Heartbeat(["A", "A/disk"], {"A/disk": FilesystemReport(64 * MIB)}), 6)
    logged = [(r.levelno, "takes writes again" in r.getMessage()) for r in caplog.records]
    assert logged == [(logging.WARNING, False), (logging.INFO, True)]  # once each way
    svc.finish_moves("A", moves.get("A", []), [OK] * len(moves.get("A", [])), 7)
    ack_drops(svc, 7)
    fill(svc, 3, prefix="y", now=8)
    svc.tick(9)
    assert {item.dst_segment_id for item in svc.take_moves()["A"]} == {"A/disk"}


def test_free_space_reports_of_dram_or_unknown_segments_change_nothing():
    svc = cluster()
    names = fill(svc)
    no_room = FilesystemReport(0)
    svc.heartbeat(Heartbeat(["A", "A/disk"], {"A": no_room, "ghost": no_room}), 1)  # DRAM's is not a filesystem's
    svc.tick(2)
    assert len(svc.take_moves()["A"]) == 3  # offloads to the disk tier as before
    assert all(where(svc, name) for name in names)


def test_a_source_the_node_does_not_hold_is_forgotten():
    svc = cluster()
    fill(svc)
    svc.tick(1)
    items = svc.take_moves()["A"]
    svc.finish_moves("A", items, [ErrorCode.OBJECT_NOT_FOUND, OK, OK], 3)
    assert svc.exist_keys(ExistKeys([items[0].key]), 3).flags == [False]
    assert where(svc, items[1].key) == ["A/disk"]


def test_moves_in_flight_are_bounded_per_node(monkeypatch):
    monkeypatch.setattr(limits, "MOVE_INFLIGHT_BYTES_PER_NODE_MAX", 2 * OBJECT_SIZE)
    svc = cluster(evict_ratio=0.5)
    fill(svc)
    svc.tick(1)  # wants 8 objects out, may start 2
    first = svc.take_moves()["A"]
    assert len(first) == 2
    svc.tick(2_000)
    assert svc.take_moves() == {}  # the budget is spent: DRAM stays full (back-pressure)
    svc.finish_moves("A", first, [OK, OK], 2_001)
    ack_drops(svc, 2_001)
    assert put(svc, ["x0", "x1"], now=4_000) == [OK, OK]  # full again
    svc.tick(4_000)
    assert len(svc.take_moves()["A"]) == 2


def put_through(svc, key: str, now: int, size: int = OBJECT_SIZE) -> None:
    """One put as the server runs it when DRAM is full: moves, drops, one retry."""
    if put(svc, [key], size=size, now=now) != [OK]:
        run_moves(svc, now)
        ack_drops(svc, now)
        assert put(svc, [key], size=size, now=now) == [OK], key


def test_a_full_disk_tier_evicts_its_least_recently_used_objects_to_the_dfs():
    svc = cluster(disk_capacity=MIB, with_dfs=True)
    now = 0
    for round_ in range(3):  # 48 objects through 1 MiB of DRAM and 1 MiB of disk
        for index in range(16):
            now += 100
            put_through(svc, f"r{round_}-{index}", now)
            svc.tick(now)
            run_moves(svc, now)
            ack_drops(svc, now)
    status = tiers(svc)
    assert status[TIER_DFS]["offloads"] > 0
    assert status[TIER_DISK]["evictions"] > 0
    assert svc.raw.object_count == 48  # nothing lost: DRAM -> disk -> DFS
    # The oldest objects went furthest down.
    assert where(svc, "r0-0") == ["dfs-1"]
    reply = svc.get_replica_list(GetReplicaList(["r0-0"]), now)
    assert reply.segments["dfs-1"].tier == TIER_DFS


def test_without_a_lower_tier_eviction_drops_as_before():
    svc = cluster(disk_capacity=0)
    fill(svc)
    svc.tick(1)
    assert svc.take_moves() == {}
    assert len(ack_drops(svc)["A"]) == 3
    assert svc.raw.object_count == 13


@pytest.mark.parametrize("has_disk", [True, False])
def test_a_dram_victim_whose_other_replica_is_on_a_lost_node_is_offloaded(has_disk):
    """A DRAM replica is dropped without a copy when the object has one in another tier, but
    one on a node whose connection is lost cannot be read: dropped for it, the object read as
    missing. It is offloaded to its live node's disk tier instead; with nowhere to go, its
    DRAM replica goes and the lost one is kept (its node may speak again)."""
    svc = make(node_ttl_ms=limits.SETTING_DURATION_MS_MAX, evict_watermark_ratio_high=0.9, evict_ratio=0.1)
    k = InventoryEntry("k", 0, OBJECT_SIZE, checksum_of("k"))
    svc.mount_segment(MountSegment(dram("A", "n1"), []), 0)
    svc.mount_segment(MountSegment(disk("A/disk", "n1", token=b"d1"), [k]), 0)
    svc.mount_segment(MountSegment(dram("B", "n2"), [k]), 0)  # "k": B (DRAM) and A/disk
    if has_disk:
        svc.mount_segment(MountSegment(disk("B/disk", "n2", token=b"d2"), []), 0)
    svc.node_link_lost(["A", "A/disk"])
    for index in range(15):  # B past its watermark: "k" is its oldest object
        assert put(svc, [f"f{index}"], now=1, placement="preferred", preferred_segments=["B"]) == [OK]
    svc.tick(10)
    run_moves(svc, 10)
    ack_drops(svc, 10)
    if has_disk:
        assert where(svc, "k") == ["A/disk", "B/disk"]
        assert svc.exist_keys(ExistKeys(["k"]), 10).flags == [True]
    else:
        assert where(svc, "k") == []  # listed on A/disk alone: read as missing
        svc.heartbeat(Heartbeat(["A", "A/disk"]), 11)
        assert where(svc, "k") == ["A/disk"]


def test_a_get_served_from_the_dfs_while_its_dram_replica_is_on_a_lost_node_counts_a_dfs_hit():
    """A hit counts for the fastest tier a reader can read: not DRAM while the object's DRAM
    replica is on a node whose connection is lost (its readers go on to the DFS copy), DRAM
    again once the node speaks."""
    svc = make(node_ttl_ms=limits.SETTING_DURATION_MS_MAX)
    k = InventoryEntry("k", 0, OBJECT_SIZE, checksum_of("k"))
    svc.mount_segment(MountSegment(dram("A", "n1"), [k]), 0)
    svc.mount_segment(MountSegment(dram("B", "n2"), []), 0)
    svc.mount_segment(MountSegment(dfs(), [k]), 0)
    svc.node_link_lost(["A"])
    for now in (1, 2, 3):
        assert svc.get_replica_list(GetReplicaList(["k"]), now).codes == [OK]
    assert {tier: status["hits"] for tier, status in tiers(svc).items()} == {TIER_DRAM: 0, TIER_DISK: 0, TIER_DFS: 3}
    svc.heartbeat(Heartbeat(["A"]), 4)
    svc.get_replica_list(GetReplicaList(["k"]), 4)
    assert tiers(svc)[TIER_DRAM]["hits"] == 1


def offloaded(promote_reads: int):
    """A service whose node A's DRAM filled and offloaded; returns it and a key only on A/disk."""
    svc = cluster(promote_reads=promote_reads)
    fill(svc)
    svc.tick(1)
    run_moves(svc, 1)
    ack_drops(svc, 1)
    return svc, next(k for k in keys("k", 16) if where(svc, k) == ["A/disk"])


def test_an_object_read_often_from_disk_is_promoted_back_into_dram():
    svc, cold = offloaded(promote_reads=3)
    for now in (2, 3):
        svc.get_replica_list(GetReplicaList([cold]), now)
    svc.tick(4)
    assert svc.take_moves() == {}  # two reads: not yet
    svc.get_replica_list(GetReplicaList([cold]), 5)
    svc.tick(6)
    moves = svc.take_moves()
    assert [(i.key, i.src_segment_id, i.dst_segment_id) for i in moves["A/disk"]] == [(cold, "A/disk", "A")]
    svc.finish_moves("A/disk", moves["A/disk"], [OK], 7)
    assert where(svc, cold) == ["A", "A/disk"]  # promoted: DRAM first, the disk copy kept
    assert tiers(svc)[TIER_DRAM]["promotions"] == 1
    assert tiers(svc)[TIER_DISK]["hits"] == 3


@pytest.mark.parametrize("answer", ["refused", "none"])
def test_a_failed_promotion_frees_its_target_at_once_only_when_the_node_said_so(answer):
    """A node that answered a failure recorded nothing: the range is free at once. One that
    did not answer (a timeout, a lost link) may have recorded the copy, late: its target is
    dropped from the node before the range is granted again."""
    svc, cold = offloaded(promote_reads=3)
    for now in (2, 3, 5):
        svc.get_replica_list(GetReplicaList([cold]), now)
    svc.tick(6)
    (item,) = svc.take_moves()["A/disk"]
    svc.finish_moves("A/disk", [item], [int(ErrorCode.TRANSFER_FAIL)] if answer == "refused" else None, 7)
    assert where(svc, cold) == ["A/disk"]
    drops = svc.take_drops()
    if answer == "refused":
        assert drops == {}
    else:
        assert [(e.key, e.offset) for e in drops["A"]] == [(cold, item.dst_offset)]
        held = used_bytes(svc, "A")
        svc.drops_done("A", drops["A"], 9)  # the node forgot it: only now is the range free
        assert used_bytes(svc, "A") == held - footprint_bytes(item.size)


def used_bytes(svc, segment_id: str) -> int:
    return next(c.used_bytes for c in svc.segment_counters() if c.segment_id == segment_id)


def test_no_promotion_goes_to_a_node_the_master_lost_until_it_speaks_again():
    svc, cold = offloaded(promote_reads=3)
    used = {c.segment_id: c.used_bytes for c in svc.segment_counters()}
    svc.node_link_lost(["A", "A/disk"])
    for now in (2, 3, 5):
        svc.get_replica_list(GetReplicaList([cold]), now)
    svc.tick(6)
    assert svc.take_moves() == {}  # a move there would wait on a node that may be dead
    assert {c.segment_id: c.used_bytes for c in svc.segment_counters()} == used
    svc.heartbeat(Heartbeat(["A", "A/disk"]), 7)
    for now in (7, 8, 8):  # read often enough again: promoted now
        svc.get_replica_list(GetReplicaList([cold]), now)
    svc.tick(9)
    assert [(i.key, i.dst_segment_id) for i in svc.take_moves()["A/disk"]] == [(cold, "A")]


def test_a_restarted_nodes_disk_tier_replaces_its_old_incarnation():
    svc = make()
    svc.mount_segment(MountSegment(dram("A", "n1"), []), 0)
    inventory = [InventoryEntry(f"d{i}", i * OBJECT_SIZE, OBJECT_SIZE, checksum_of(f"d{i}")) for i in range(4)]
    assert svc.mount_segment(MountSegment(disk("X/disk", "n1"), inventory), 0).rejected == []
    # The node is killed and restarted: a new node id, a new DRAM segment, the same disk tier
    # (its token proves the directory), now holding one object fewer.
    svc.mount_segment(MountSegment(dram("B", "n2"), []), 1)
    reply = svc.mount_segment(MountSegment(disk("X/disk", "n2"), inventory[1:]), 1)
    assert reply.rejected == []
    assert svc.exist_keys(ExistKeys([e.key for e in inventory]), 1).flags == [False, True, True, True]
    status = svc.cluster_status(ClusterStatus(), 1)
    disks = [s for s in status.segments if s.segment.tier == TIER_DISK]
    assert [(s.segment.node_id, s.object_count) for s in disks] == [("n2", 3)]
    # Another token under the same id is someone else's directory: refused.
    with pytest.raises(SegmentAlreadyExists):
        svc.mount_segment(MountSegment(disk("X/disk", "n3", token=b"other"), []), 2)


def test_dfs_objects_are_indexed_from_an_inventory_and_outlive_every_node():
    svc = make()
    svc.mount_segment(MountSegment(dram("A", "n1"), []), 0)
    inventory = [InventoryEntry("f0", 4096, OBJECT_SIZE, 7)]
    assert svc.mount_segment(MountSegment(dfs(), inventory), 0).rejected == []
    svc.unmount_segment(UnmountSegment("A"), 1)
    svc.heartbeat(Heartbeat(["dfs-1"]), 1)
    reply = svc.get_replica_list(GetReplicaList(["f0"]), 2)
    assert reply.codes == [OK] and reply.replicas[0][0].segment_id == "dfs-1"
    assert tiers(svc)[TIER_DFS]["hits"] == 1


def test_puts_never_land_on_a_slower_tier():
    svc = cluster(with_dfs=True)
    names = keys("p", 40)
    codes = put(svc, names)  # more than DRAM holds: the rest finds no room now
    assert codes[:16] == [OK] * 16 and set(codes[16:]) == {ErrorCode.NO_AVAILABLE_HANDLE}
    placed = {seg for key in names[:16] for seg in where(svc, key)}
    assert placed == {"A"}


def unmount(svc, segment_id: str, now: int) -> None:
    """Unmount, and run the steps of a segment that leaves in steps (mounts.py)."""
    svc.unmount_segment(UnmountSegment(segment_id), now)
    while svc.sweep_step():
        pass


@pytest.mark.parametrize("in_steps", [False, True], ids=["at-once", "in-steps"])
def test_unmounting_the_source_during_a_move_loses_the_objects_and_drops_their_copies(monkeypatch, in_steps):
    """In steps (of one key, each checked), the objects a move holds ranges of wait for the
    last step."""
    if in_steps:
        monkeypatch.setattr(limits, "UNMOUNT_SWEEP_KEYS_PER_STEP", 1)
    svc = cluster()
    fill(svc)
    svc.tick(1)
    items = svc.take_moves()["A"]
    unmount(svc, "A", 2)  # the node died with its DRAM
    assert svc.raw.object_count == 0
    svc.finish_moves("A", items, [OK] * 3, 3)  # late answers (or failures) change nothing
    drops = ack_drops(svc, 3)
    assert sorted(e.key for e in drops["A/disk"]) == sorted(i.key for i in items)
    assert tiers(svc)[TIER_DISK]["used_bytes"] == 0


@pytest.mark.parametrize("in_steps", [False, True], ids=["at-once", "in-steps"])
def test_unmounting_a_dram_segment_keeps_the_disk_copies_and_losing_the_disk_keeps_dram(monkeypatch, in_steps):
    if in_steps:
        monkeypatch.setattr(limits, "UNMOUNT_SWEEP_KEYS_PER_STEP", 1)
    svc = cluster()
    copied = keys("w", 4)
    copies = write_through(svc, copied, with_disk_copy=True)
    svc.finish_moves("A", copies["A"], [OK] * 4, 0)
    plain = fill(svc, 4, prefix="p")
    unmount(svc, "A/disk", 1)  # the disk died: DRAM replicas remain
    assert [where(svc, k) for k in copied + plain] == [["A"]] * 8
    assert tiers(svc)[TIER_DISK]["object_count"] == 0
    svc.mount_segment(MountSegment(disk("A/disk2", "n1"), []), 1)
    copies = write_through(svc, keys("x", 2), now=1, with_disk_copy=True)
    svc.finish_moves("A", copies["A"], [OK] * 2, 1)
    unmount(svc, "A", 2)  # the DRAM went: only disk copies survive
    assert svc.raw.object_count == 2
    assert [where(svc, k) for k in keys("x", 2)] == [["A/disk2"]] * 2
    assert tiers(svc)[TIER_DISK]["object_count"] == 2
    unmount(svc, "A/disk2", 3)  # and then the disk: nothing is left
    assert svc.raw.object_count == 0 and svc.counters.lost == 10
    assert tiers(svc)[TIER_DISK]["object_count"] == 0


# --- a key whose move is running: no new object under it until the move ends -----------------


class Nodes:
    """What node n1 holds, recorded the way the node records it (node/inventory.py: one entry
    per key in a segment; a commit or a finished move adds an entry and displaces the key's
    other one there, a drop forgets an entry by key and offset). A test puts, moves and drops
    through it, and checks the master against it, or restarts the master from it."""

    CAPACITIES = {"A": MIB, "A/disk": 8 * MIB}

    def __init__(self, svc) -> None:
        self.svc = svc
        self.inventories = {segment_id: Inventory(size) for segment_id, size in self.CAPACITIES.items()}

    def put(self, names: list[str], now: int) -> list[int]:
        """A whole put (no write-through); returns the final code per key."""
        svc = self.svc
        start = svc.put_start(PutStart(names, [OBJECT_SIZE] * len(names), ReplicateConfig()), now)
        started = [k for k, code in zip(names, start.codes) if code == OK]
        pending = svc.put_end(PutEnd(started, [checksum_of(k) for k in started]), now)
        for segment_id, entries in pending.commits.items():
            self.inventories[segment_id].add(entries)
        results = {segment_id: [0] * len(entries) for segment_id, entries in pending.commits.items()}
        reply = svc.finish_put_end(pending, results, now)
        final = dict(zip(started, reply.codes))
        return [final.get(k, code) for k, code in zip(names, start.codes)]

    def move(self, moves: dict[str, list[MoveItem]], now: int) -> None:
        """The node makes these moves (every one succeeds) and answers them."""
        for segment_id, items in moves.items():
            for item in items:
                entry = InventoryEntry(item.key, item.dst_offset, item.size, item.checksum)
                self.inventories[item.dst_segment_id].add([entry])
            self.svc.finish_moves(segment_id, items, [OK] * len(items), now)

    def drop(self, now: int) -> None:
        for segment_id, entries in self.svc.take_drops().items():
            self.inventories[segment_id].drop(entries)
            self.svc.drops_done(segment_id, entries, now)

    def check(self, names: list[str]) -> None:
        """Every replica the master lists is an entry of that key in its segment's inventory."""
        reply = self.svc.query_objects(QueryObjects(names), 0)
        for key, replicas in zip(names, reply.replicas):
            for replica in replicas:
                held = self.inventories[replica.segment_id].get(key)
                assert held is not None and held.offset == replica.offset, (key, replica, held)

    def restarted_master(self, now: int):
        """A new master, the node mounting its segments again with their inventories."""
        svc = make(node_ttl_ms=limits.SETTING_DURATION_MS_MAX)  # no node expires here
        svc.mount_segment(MountSegment(dram("A", "n1"), self.inventories["A"].entries()), now)
        svc.mount_segment(MountSegment(disk("A/disk", "n1"), self.inventories["A/disk"].entries()), now)
        return svc


def promoting(nodes: Nodes) -> tuple[str, dict[str, list[MoveItem]]]:
    """Fill A, offload, read a key that went to disk until its promotion into A is sent; returns
    the key and the move sent (its node is making it)."""
    svc = nodes.svc
    for name in keys("k", 16):
        assert nodes.put([name], 0) == [OK]
    svc.tick(1)
    nodes.move(svc.take_moves(), 1)
    nodes.drop(1)
    cold = next(k for k in keys("k", 16) if where(svc, k) == ["A/disk"])
    for now in (2, 3):
        svc.get_replica_list(GetReplicaList([cold]), now)
    svc.tick(5_000)  # the reads' leases are over
    moves = svc.take_moves()
    assert [(i.key, i.dst_segment_id) for i in moves["A/disk"]] == [(cold, "A")]
    return cold, moves


def test_a_key_removed_while_its_promotion_runs_takes_a_put_only_once_the_node_answered():
    """The node records a promotion under its key in A, which would displace the entry of a new
    object put there meanwhile: the master listed that object, its node did not, and a master
    restart lost it. The key answers puts as while another writer puts it, until the move ends;
    then it is put as any key, and survives a restart."""
    svc = cluster(promote_reads=2, lease_ttl_ms=1_000)
    nodes = Nodes(svc)
    cold, moves = promoting(nodes)
    assert svc.remove(Remove([cold]), 5_000).codes == [OK]
    nodes.drop(5_000)
    assert nodes.put([cold], 5_000) == [ErrorCode.REPLICA_IS_NOT_READY]
    assert svc.exist_keys(ExistKeys([cold]), 5_000).flags == [False]
    nodes.move(moves, 5_001)  # the copy lands in A under the key; the master drops it
    nodes.drop(5_001)
    assert nodes.put([cold], 5_002) == [OK]
    nodes.drop(5_002)
    nodes.check(keys("k", 16))
    restarted = nodes.restarted_master(5_003)
    assert restarted.exist_keys(ExistKeys([cold]), 5_003).flags == [True]


@pytest.mark.parametrize("removed", [False, True], ids=["still-there", "removed"])
def test_a_remount_adopts_no_entry_of_a_key_whose_move_writes_into_that_segment(removed):
    """A node mounting A again (its link came back) listing the key being promoted into A: the
    node's record of the promotion would displace that entry (the master would list the key
    where no node holds it, or twice in A). Removed or not, the entry is refused (the node
    drops it), as an entry of a key being put is."""
    svc = cluster(promote_reads=2, lease_ttl_ms=1_000)
    nodes = Nodes(svc)
    cold, moves = promoting(nodes)
    elsewhere = svc.put_start(PutStart(["hole"], [OBJECT_SIZE], ReplicateConfig()), 5_000)  # a free range of A
    svc.put_revoke(PutRevoke(["hole"]), 5_000)
    entry = InventoryEntry(cold, elsewhere.grants[0].offset, OBJECT_SIZE, checksum_of(cold))
    if removed:
        assert svc.remove(Remove([cold]), 5_000).codes == [OK]
    reply = svc.mount_segment(MountSegment(dram("A", "n1"), [*nodes.inventories["A"].entries(), entry]), 5_000)
    assert reply.rejected == [entry]
    nodes.move(moves, 5_001)
    nodes.drop(5_001)
    nodes.check(keys("k", 16))
    assert svc.exist_keys(ExistKeys([cold]), 5_001).flags == [not removed]


@pytest.mark.parametrize("gone", ["removed", "lost"])
def test_a_move_whose_object_went_before_it_was_sent_is_never_sent(gone):
    """Offloads started by the tick, then their objects removed (their keys take a put at
    once) or lost with their DRAM segment: no node is asked to copy them, and their targets'
    room is free without any drop."""
    svc = cluster()
    names = fill(svc)
    svc.tick(1)
    assert svc.has_unsent_moves()
    if gone == "removed":
        assert svc.remove(Remove(names), 2).codes == [OK] * 16
    else:
        unmount(svc, "A", 2)
    assert svc.take_moves() == {} and svc.moves_in_flight() == 0
    assert tiers(svc)[TIER_DISK]["used_bytes"] == 0
    assert "A/disk" not in ack_drops(svc, 2)
    if gone == "removed":
        assert put(svc, names, now=3) == [OK] * 16


@pytest.mark.parametrize("fragmented", [False, True], ids=["one-key", "in-pieces"])
def test_a_put_preferring_a_slower_tiers_segment_lands_in_dram(fragmented):
    """ClusterStatus lists the disk and DFS segments too, and a client may name one as its
    preferred segment: it is passed over like a preferred segment without room (the put
    goes to DRAM), for a run that fits a hole and for one placed in pieces across the holes
    of a fragmented segment. Before, the put was granted on the disk tier, where the node
    refuses writes (and the master filed the object as DRAM-resident)."""
    svc = cluster(with_dfs=True)
    names = ["p"]
    if fragmented:
        every_other = fill(svc)[1::2]
        assert svc.remove(Remove(every_other), 1).codes == [OK] * 8
        ack_drops(svc, 1)
        names = keys("p", 4)  # a run of 256 KiB; the largest hole holds 64 KiB
    preferred = ReplicateConfig(placement="preferred", preferred_segments=["A/disk", "dfs-1"])
    start = svc.put_start(PutStart(names, [OBJECT_SIZE] * len(names), preferred), 2)
    assert start.codes == [OK] * len(names)
    assert {grant.segment_id for grant in start.grants} == {"A"}
    assert len(start.grants) == (len(names) if fragmented else 1)


# --- random interleavings against the nodes' truth ---------------------------------------------

TIER_KEYS = [f"t{i}" for i in range(40)]
MOVE_CODES = st.sampled_from([OK, OK, OK, FAIL, ErrorCode.OBJECT_NOT_FOUND, ErrorCode.NO_AVAILABLE_HANDLE])


class TierMachine(RuleBasedStateMachine):
    """Puts (some with write-through), gets, removes, ticks, moves sent and answered later,
    drop acknowledgements, re-mounts of the DRAM segment and reports of free or read-only
    filesystems in any order, on a node with 1 MiB of DRAM, a 2 MiB disk tier and a 4 MiB DFS.
    The model is what the nodes hold (segment -> offset -> (key, size)), changed only the way
    nodes change it: a commit or a successful move adds an entry (in the node's DRAM and disk
    tier, displacing the key's other entry there: node/inventory.py holds one per key), a drop
    removes it. Invariants: every replica the master lists is held by its node under that key
    (the master never points a reader at bytes that are not the object), no node is ever told
    to write over an entry it still holds (no range is reused before it was forgotten), a move
    only reads a source the node holds, and a removed key never comes back."""

    def __init__(self) -> None:
        super().__init__()
        self.svc = cluster(disk_capacity=2 * MIB, with_dfs=False, lease_ttl_ms=1_000, promote_reads=2)
        self.svc.mount_segment(MountSegment(dfs(4 * MIB), []), 0)
        self.now = 0
        self.held: dict[str, dict[int, tuple[str, int]]] = {"A": {}, "A/disk": {}, "dfs-1": {}}
        self.removed: set[str] = set()
        self.sent: list[tuple[str, list[MoveItem]]] = []  # moves the node is making
        self.refused: set[tuple[str, int, str]] = set()  # (segment id, offset, key) a mount refused

    def _hold(self, segment_id: str, offset: int, key: str, size: int) -> None:
        entries = self.held[segment_id]
        if segment_id != "dfs-1":  # the DFS has no node inventory: the master indexes its files
            for other in [other for other, (other_key, _) in entries.items() if other_key == key]:
                del entries[other]
        for other, (other_key, other_size) in entries.items():
            assert offset + size <= other or other + other_size <= offset, (
                f"{segment_id}: {key} at {offset} overlaps {other_key} at {other}, still held"
            )
        entries[offset] = (key, size)

    @rule(
        index=st.integers(0, len(TIER_KEYS) - 1),
        copy=st.sampled_from([(), ("disk",), ("disk", "dfs")]),
        size=st.sampled_from([OBJECT_SIZE, OBJECT_SIZE // 2, OBJECT_SIZE * 3 // 2, OBJECT_SIZE * 3]),
    )
    def do_put(self, index: int, copy: tuple[str, ...], size: int) -> None:
        # Mixed sizes, so that every tier's eviction has holes to make, not just bytes.
        key = TIER_KEYS[index]
        replicate = ReplicateConfig(with_disk_copy="disk" in copy, with_dfs_copy="dfs" in copy)
        start = self.svc.put_start(PutStart([key], [size], replicate), self.now)
        if start.codes != [OK]:
            return
        self.removed.discard(key)
        pending = self.svc.put_end(PutEnd([key], [checksum_of(key)]), self.now)
        for segment_id, entries in pending.commits.items():
            for entry in entries:
                self._hold(segment_id, entry.offset, entry.key, entry.size)
        results = {segment_id: [0] * len(entries) for segment_id, entries in pending.commits.items()}
        reply = self.svc.finish_put_end(pending, results, self.now)
        copies = self.svc.start_copies(pending, reply, self.now)
        for segment_id, items in copies.items():
            self._answer(segment_id, items, [OK] * len(items))

    @rule(index=st.integers(0, len(TIER_KEYS) - 1))
    def do_get(self, index: int) -> None:
        self.svc.get_replica_list(GetReplicaList([TIER_KEYS[index]]), self.now)

    @rule(copy=st.sampled_from([(), ("disk",)]))
    def do_fill(self, copy: tuple[str, ...]) -> None:
        # Six new objects: DRAM fills in a few steps, so that its eviction moves objects down
        # (single puts, drawn from 40 keys, rarely filled it).
        flags = self.svc.exist_keys(ExistKeys(TIER_KEYS), self.now).flags
        for index in [index for index, flag in enumerate(flags) if not flag][:6]:
            self.do_put(index, copy, OBJECT_SIZE)

    @rule(data=st.data())
    def do_read_a_cold_key(self, data) -> None:
        # Read twice an object outside DRAM, and tick: it is promoted (promote_reads=2) if
        # DRAM has room below its watermark, else DRAM evicts for it.
        reply = self.svc.query_objects(QueryObjects(TIER_KEYS), self.now)
        cold = [key for key, replicas in zip(TIER_KEYS, reply.replicas) if replicas and "A" not in
                {replica.segment_id for replica in replicas}]  # fmt: skip
        if cold:
            key = data.draw(st.sampled_from(cold))
            for _ in range(2):
                self.svc.get_replica_list(GetReplicaList([key]), self.now)
            self.svc.tick(self.now)

    @rule(index=st.integers(0, len(TIER_KEYS) - 1))
    def do_remove(self, index: int) -> None:
        key = TIER_KEYS[index]
        if self.svc.remove(Remove([key], force=True), self.now).codes == [OK]:
            self.removed.add(key)

    @rule(step_ms=st.integers(1, 1_500))
    def do_tick(self, step_ms: int) -> None:
        self.now += step_ms
        self.svc.tick(self.now)

    @rule(
        disk_free=st.one_of(st.none(), st.integers(0, 3 * MIB)), dfs_free=st.one_of(st.none(), st.integers(0, 5 * MIB))
    )
    def do_heartbeat(self, disk_free: int | None, dfs_free: int | None) -> None:
        # The filesystems' free space moves as other programs use them: it caps the room.
        # None: the filesystem takes no writes (read-only).
        reports = {
            segment_id: FilesystemReport(is_writable=False) if free is None else FilesystemReport(free)
            for segment_id, free in {"A/disk": disk_free, "dfs-1": dfs_free}.items()
        }
        self.svc.heartbeat(Heartbeat(["A", "A/disk", "dfs-1"], reports), self.now)

    @rule()
    def do_send_moves(self) -> None:
        self.sent.extend(self.svc.take_moves().items())

    @rule(codes=st.lists(MOVE_CODES, min_size=1, max_size=8))
    def do_moves(self, codes: list[int]) -> None:
        self.do_send_moves()
        sent, self.sent = self.sent, []
        for segment_id, items in sent:
            answers = [codes[i % len(codes)] for i in range(len(items))]
            self._answer(segment_id, items, answers)

    @precondition(lambda self: self.sent)
    @rule(data=st.data(), copy=st.sampled_from([(), ("disk",)]))
    def do_put_a_moving_key_again(self, data, copy: tuple[str, ...]) -> None:
        # A key the node is moving, removed and put again (its new object must not be
        # displaced by the node's record of the old one's move).
        key = data.draw(st.sampled_from(sorted({item.key for _, items in self.sent for item in items})))
        self.do_remove(TIER_KEYS.index(key))
        self.do_put(TIER_KEYS.index(key), copy, OBJECT_SIZE)

    @rule()
    def do_remount(self) -> None:
        # The node's link came back: it mounts its DRAM segment again with what it holds,
        # and forgets what the master refuses.
        held = self.held["A"].items()
        inventory = [InventoryEntry(key, offset, size, checksum_of(key)) for offset, (key, size) in held]
        reply = self.svc.mount_segment(MountSegment(dram("A", "n1"), inventory), self.now)
        for entry in reply.rejected:
            del self.held["A"][entry.offset]
            self.refused.add(("A", entry.offset, entry.key))

    def _answer(self, segment_id: str, items: list[MoveItem], answers: list[int]) -> None:
        answers = list(answers)
        for index, (item, code) in enumerate(zip(items, answers)):
            if self.held[item.src_segment_id].get(item.src_offset) != (item.key, item.size):
                # Only a source the node forgot as a re-mount told it (node/moves.py: gone).
                assert (item.src_segment_id, item.src_offset, item.key) in self.refused, item
                answers[index] = code = ErrorCode.OBJECT_NOT_FOUND
            if code == OK:
                self._hold(item.dst_segment_id, item.dst_offset, item.key, item.size)
        self.svc.finish_moves(segment_id, items, [int(c) for c in answers], self.now)

    @rule()
    def do_drops(self) -> None:
        for segment_id, entries in self.svc.take_drops().items():
            for entry in entries:
                if self.held[segment_id].get(entry.offset) == (entry.key, entry.size):
                    del self.held[segment_id][entry.offset]
            self.svc.drops_done(segment_id, entries, self.now)

    @invariant()
    def replicas_point_at_what_nodes_hold(self) -> None:
        reply = self.svc.query_objects(QueryObjects(TIER_KEYS), self.now)
        for key, code, replicas in zip(TIER_KEYS, reply.codes, reply.replicas):
            if code != OK:
                continue
            assert key not in self.removed, f"{key} came back after its remove"
            for replica in replicas:
                assert self.held[replica.segment_id].get(replica.offset, (None,))[0] == key, (key, replica)


TestTierMachine = TierMachine.TestCase
TestTierMachine.settings = settings(max_examples=100, stateful_step_count=80, deadline=None)


def test_a_node_without_the_dfs_mounted_is_asked_for_no_more_dfs_moves():
    svc = cluster(disk_capacity=0, with_dfs=True)
    fill(svc)
    svc.tick(1)
    items = svc.take_moves()["A"]
    assert {i.dst_segment_id for i in items} == {"dfs-1"}
    svc.finish_moves("A", items, [ErrorCode.SEGMENT_NOT_FOUND] * 3, 2)
    ack_drops(svc, 2)
    assert put(svc, ["a", "b", "c"], now=3) == [OK] * 3
    svc.tick(4)
    assert svc.take_moves() == {}  # evicted by dropping, as without a DFS
    assert ack_drops(svc, 4)["A"]
    assert tiers(svc)[TIER_DFS]["failed_moves"] == 3  # counted: /metrics, kvpool stat
    # ... for a while only: the share may be mounted since (it was never tried again).
    later = 5 + tiers_module.FULL_TIER_RETRY_MS
    assert put(svc, ["d", "e", "f"], now=later) == [OK] * 3
    svc.tick(later)
    assert {i.dst_segment_id for i in svc.take_moves()["A"]} == {"dfs-1"}


def test_a_confirmed_bad_replica_goes_alone_and_the_object_lives_on_in_its_other_tier():
    """drop_bad_replicas across tiers: a bad DRAM replica leaves the object on its disk copy
    (out of the DRAM table, counted by the disk tier); a bad disk replica leaves it in DRAM;
    the last replica takes the object with it. Drops go to the replicas' own segments."""
    svc = cluster()
    copies = write_through(svc, ["d", "k", "last"], with_disk_copy=True)
    svc.finish_moves("A", copies["A"], [OK] * 3, 0)
    ack_drops(svc)
    replicas = {key: {r.segment_id: r.offset for r in svc.query_objects(QueryObjects([key]), 0).replicas[0]}
                for key in ("d", "k", "last")}  # fmt: skip

    def entry(key: str, segment_id: str) -> list[InventoryEntry]:
        return [InventoryEntry(key, replicas[key][segment_id], OBJECT_SIZE, checksum_of(key))]

    assert svc.drop_bad_replicas("A", entry("d", "A"), 1) == (1, 0)  # DRAM rotted: disk copy stays
    assert where(svc, "d") == ["A/disk"]
    assert svc.get_replica_list(GetReplicaList(["d"]), 1).codes == [OK]
    assert svc.drop_bad_replicas("A/disk", entry("k", "A/disk"), 1) == (1, 0)  # disk rotted
    assert where(svc, "k") == ["A"]
    assert svc.drop_bad_replicas("A/disk", entry("last", "A/disk"), 1) == (1, 0)
    assert svc.drop_bad_replicas("A", entry("last", "A"), 1) == (1, 1)  # no replica left
    assert svc.exist_keys(ExistKeys(["d", "k", "last"]), 2).flags == [True, True, False]
    assert tiers(svc)[TIER_DISK]["object_count"] == 1
    drops = {s: sorted(e.key for e in entries) for s, entries in svc.take_drops().items()}
    assert drops == {"A": ["d", "last"], "A/disk": ["k", "last"]}


def test_a_report_between_a_drop_and_its_acknowledgement_counts_the_dropped_file_once():
    # The node deletes a dropped file and its heartbeat (another connection) says what the
    # filesystem has free before the master hears the drop acknowledged. Counted both as a
    # file the tier holds and as free space, that file's room went to two objects until the
    # next report a second later: a move found the disk full (a cluster test saw it under load).
    svc = cluster(disk_capacity=4 * MIB)
    filesystem = SmallFilesystem(files_max=8)

    def heartbeat(now: int) -> None:
        svc.heartbeat(Heartbeat(["A", "A/disk"], {"A/disk": FilesystemReport(filesystem.free_bytes())}), now)

    heartbeat(0)
    is_reported = False
    for now, name in enumerate(keys("k", 40), start=1):
        todo = [name]
        for _ in range(limits.PUT_ROOM_ROUNDS_MAX):
            todo = [key for key, code in zip(todo, put(svc, todo, now=now)) if code != OK]
            if not todo:
                break
            run_moves(svc, now, filesystem.answer)
            drops = svc.take_drops()
            filesystem.files -= {entry.key for entry in drops.get("A/disk", [])}  # deleted ...
            if drops.get("A/disk") and not is_reported:
                heartbeat(now)  # ... and reported free before the acknowledgement came
                is_reported = True
            for segment_id, entries in drops.items():
                svc.drops_done(segment_id, entries, now)
        assert not todo, name
    assert filesystem.full_answers == 0
    assert tiers(svc)[TIER_DISK]["failed_moves"] == 0
