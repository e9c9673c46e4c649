"""Tombstones (master/tombstones.py): what a segment's node was told to forget, and never
acknowledged, is refused when the segment mounts again.

How: the pure Tombstones on its own (matching, settling, expiry, the bound), then MasterService
through test_master_service's checked proxy, with the node played by the test: a segment leaves
with drops unacknowledged (timed out, unmounted, a disk tier restarted under a new node id) and
mounts again with the inventory its node still holds. The real processes are in
tests/test_cluster_removed.py.
"""

from __future__ import annotations

import logging

from kvpool import limits
from kvpool.errors import ErrorCode
from kvpool.master.tombstones import Tombstones
from kvpool.protocol.messages import (
    TIER_DISK,
    Heartbeat,
    InventoryEntry,
    MountSegment,
    MoveItem,
    Remove,
    RemoveAll,
)
from tests.test_master_service import OBJECT_SIZE, OK, checksum_of, exists, get, info, make, mount, put
from tests.test_master_tiers import Nodes, cluster, disk, dram, fill, promoting


def entry(key: str, offset: int) -> InventoryEntry:
    return InventoryEntry(key, offset, 100, 7)


def test_a_mount_refuses_the_entries_buried_at_their_offset_and_its_heartbeat_settles_the_rest() -> None:
    tombstones = Tombstones()
    tombstones.bury("s1", [entry("a", 0), entry("b", 128), entry("c", 256)], 1_000)
    tombstones.bury("s2", [entry("a", 0)], 1_000)
    assert len(tombstones) == 4
    tombstones.settle("s1")  # no mount since: nothing settles
    assert len(tombstones) == 4
    adopted, refused = tombstones.unearth("s1", [entry("a", 0), entry("b", 4096), entry("d", 512)])
    assert refused == [entry("a", 0)]
    assert adopted == [entry("b", 4096), entry("d", 512)]  # b was put again elsewhere: not this drop's
    # Its node drops a refused entry once it reads the reply: one that did not (the reply was
    # lost) mounts again, and is refused again, until the segment's heartbeat.
    assert tombstones.unearth("s1", [entry("a", 0)]) == ([], [entry("a", 0)])
    adopted, refused = tombstones.unearth("s1", [entry("c", 256)])  # a later part of the inventory
    assert refused == [entry("c", 256)]
    assert len(tombstones) == 4
    tombstones.settle("s1")
    assert len(tombstones) == 1  # a on s2
    assert tombstones.unearth("s1", [entry("a", 0), entry("b", 128)])[1] == []
    assert tombstones.unearth("s2", [entry("a", 0)])[1] == [entry("a", 0)]
    tombstones.settle("s2")
    assert len(tombstones) == 0
    tombstones.check_invariants()


def test_tombstones_expire_by_segment_and_are_bounded_oldest_first(caplog) -> None:
    tombstones = Tombstones()
    tombstones.bury("short", [entry("a", 0)], 100)
    tombstones.bury("long", [entry("a", 0)], 1_000)
    tombstones.expire(100)
    assert len(tombstones) == 1  # each segment on its own time

    tombstones = Tombstones(entries_max=5)
    tombstones.expire(0)
    tombstones.bury("old", [entry("a", 0), entry("b", 128)], 1_000)
    tombstones.expire(600)
    tombstones.bury("new", [entry("c", 0)], 1_000)
    tombstones.expire(999)
    assert len(tombstones) == 3
    tombstones.expire(1_000)
    assert len(tombstones) == 1  # "old" went; "new" was buried at 600
    tombstones.bury("old", [entry("a", 0), entry("b", 128), entry("d", 256)], 1_000)
    with caplog.at_level(logging.WARNING, logger="kvpool.master.tombstones"):
        tombstones.bury("newest", [entry("e", 0), entry("f", 128), entry("g", 256)], 1_000)
    assert len(tombstones) == 5 and "more than 5 tombstones" in caplog.text
    tombstones.check_invariants()
    # "new" (buried first of the three) went whole, then "old"'s oldest entry.
    assert tombstones.unearth("new", [entry("c", 0)])[1] == []
    assert tombstones.unearth("old", [entry("a", 0), entry("b", 128)])[1] == [entry("b", 128)]
    tombstones.check_invariants()


def test_replicas_left_behind_over_the_cap_forget_the_oldest_first(caplog) -> None:
    """Over the cap, the oldest replicas left behind go, not the whole oldest segment's: its
    newer ones still become tombstones when their objects go."""
    tombstones = Tombstones(entries_max=3)
    tombstones.expire(0)
    tombstones.leave_behind("old", [("a", 0), ("b", 128)], 1_000)
    with caplog.at_level(logging.WARNING, logger="kvpool.master.tombstones"):
        tombstones.leave_behind("new", [("c", 0), ("d", 128)], 1_000)  # 4 > 3: "old"'s a goes
    assert "more than 3 replicas left behind" in caplog.text
    tombstones.check_invariants()
    tombstones.gone(["a", "b", "c", "d"])
    assert len(tombstones) == 3
    assert tombstones.unearth("old", [entry("a", 0), entry("b", 128)])[1] == [entry("b", 128)]
    assert tombstones.unearth("new", [entry("c", 0), entry("d", 128)])[1] == [entry("c", 0), entry("d", 128)]
    tombstones.check_invariants()


def test_a_replica_left_behind_becomes_a_tombstone_once_its_object_goes() -> None:
    """A segment that went held replicas of objects that live on elsewhere: no drop was due,
    yet a remove of one of them must reach that replica when its node comes back (k033)."""
    tombstones = Tombstones()
    tombstones.expire(0)
    tombstones.leave_behind("s1", [("a", 0), ("b", 128), ("c", 256)], 1_000)
    assert len(tombstones) == 0  # not tombstones until their objects go
    tombstones.gone(["a", "x"])
    assert len(tombstones) == 1
    adopted, refused = tombstones.unearth("s1", [entry("a", 0), entry("b", 128)])
    assert refused == [entry("a", 0)] and adopted == [entry("b", 128)]  # b was not removed
    tombstones.settle("s1")  # the node heartbeats: what it left behind is settled too
    tombstones.gone(["c"])
    assert len(tombstones) == 0
    # Shown again by its segment's mount, a replica left behind is an ordinary one: a remove
    # before the segment's heartbeat reaches it by its drop, and buries nothing that would
    # refuse a later object at that offset.
    tombstones.leave_behind("s3", [("k", 0), ("m", 128)], 1_000)
    assert tombstones.unearth("s3", [entry("k", 0)]) == ([entry("k", 0)], [])
    tombstones.gone(["k", "m"])  # m: not shown (a later part of the inventory, or not held)
    assert len(tombstones) == 1 and tombstones.unearth("s3", [entry("m", 128)])[1] == [entry("m", 128)]
    tombstones.gone(["m2"])
    tombstones.check_invariants()
    tombstones.settle("s3")
    assert len(tombstones) == 0
    tombstones.leave_behind("s2", [("d", 0)], 100)
    tombstones.expire(100)  # as long as a tombstone would last
    tombstones.gone(["d"])
    assert len(tombstones) == 0
    tombstones.check_invariants()


def removed_while_away(svc, keys: list[str]) -> tuple[list[InventoryEntry], list[str]]:
    """Put `keys` on s1 and remove half of them, one drop sent and not acknowledged, the
    others not sent; returns what the node holds (all of them) and the removed keys."""
    assert put(svc, keys) == [OK] * len(keys)
    held = [
        InventoryEntry(key, replicas[0].offset, OBJECT_SIZE, checksum_of(key))
        for key, replicas in zip(keys, get(svc, keys, 1).replicas)
    ]
    removed = keys[::2]
    svc.remove(Remove(removed[:1], force=True), 2)
    assert [e.key for e in svc.take_drops()["s1"]] == removed[:1]  # sent, never acknowledged
    svc.remove(Remove(removed[1:], force=True), 3)
    return held, removed


def test_objects_removed_while_a_segment_was_away_are_refused_when_it_mounts_again(caplog) -> None:
    """(A DRAM segment its node unmounted never mounts again, and leaves nothing behind:
    test_master_lost_keys.py.)"""
    svc = make(node_ttl_ms=1_000)
    mount(svc, "s1")
    keys = [f"k{i}" for i in range(8)]
    held, removed = removed_while_away(svc, keys)
    svc.tick(1_000)  # silent: a node cut off from the master, its DRAM intact
    assert exists(svc, keys) == [False] * 8
    assert len(svc.tombstones) == len(removed)
    with caplog.at_level(logging.INFO, logger="kvpool.master.service"):
        rejected = mount(svc, "s1", now=1_100, inventory=held)
    assert sorted(e.key for e in rejected) == sorted(removed)
    assert "holding 4 objects removed or evicted while it was away" in caplog.text
    assert exists(svc, keys) == [key not in removed for key in keys]
    assert svc.counters.refused_returns == len(removed)
    assert len(svc.tombstones) == len(removed)  # until the node says it read the reply
    assert svc.heartbeat(Heartbeat(["s1"]), 1_200).unknown_segment_ids == []
    assert len(svc.tombstones) == 0
    # Their ranges are free again: the node dropped the refused entries.
    assert put(svc, [f"new{i}" for i in range(4)], now=1_300) == [OK] * 4


def test_a_disk_tier_restarted_under_a_new_node_id_comes_back_without_what_was_removed() -> None:
    svc = make()
    disk = info("disk-1", node="node-a")
    disk.tier = TIER_DISK
    inventory = [InventoryEntry(f"k{i}", i * 4096, 100, i + 1) for i in range(6)]
    assert svc.mount_segment(MountSegment(disk, inventory), 0).rejected == []
    assert svc.remove_all(RemoveAll(force=True), 1).count == 6
    assert len(svc.take_drops()["disk-1"]) == 6  # the node dies before it acknowledges
    restarted = info("disk-1", node="node-b")  # the same directory, the same id and token
    restarted.tier = TIER_DISK
    rejected = svc.mount_segment(MountSegment(restarted, inventory[:3]), 2).rejected  # in two parts
    assert rejected == inventory[:3]
    assert svc.mount_segment(MountSegment(restarted, inventory[3:]), 3).rejected == inventory[3:]
    assert exists(svc, [e.key for e in inventory]) == [False] * 6


def test_a_tombstone_the_mount_did_not_match_is_forgotten_at_the_next_heartbeat() -> None:
    svc = make(node_ttl_ms=1_000)
    mount(svc, "s1")
    held, removed = removed_while_away(svc, ["a", "b"])
    svc.tick(1_000)
    assert mount(svc, "s1", now=1_001, inventory=[]) == []  # the node had forgotten them itself
    assert len(svc.tombstones) == 1
    svc.heartbeat(Heartbeat(["s1"]), 1_002)
    assert len(svc.tombstones) == 0
    # A later mount with that entry (put there again since) is not refused.
    svc.tick(3_000)
    assert mount(svc, "s1", now=3_001, inventory=[e for e in held if e.key in removed]) == []


def test_a_dram_segments_tombstones_expire_sooner_than_a_disk_tiers() -> None:
    svc = make(node_ttl_ms=1_000)
    mount(svc, "s1")
    removed_while_away(svc, ["a", "b"])
    disk = info("disk-1")
    disk.tier = TIER_DISK
    svc.mount_segment(MountSegment(disk, [InventoryEntry("d", 0, 100, 1)]), 0)
    svc.remove(Remove(["d"], force=True), 4)
    svc.tick(1_000)  # both silent: both go, with their drops
    assert len(svc.tombstones) == 2
    svc.tick(1_000 + limits.TOMBSTONE_DRAM_TTL_MS)
    assert len(svc.tombstones) == 1  # a DRAM segment comes back only from a node cut off
    svc.tick(1_000 + limits.TOMBSTONE_TTL_MS)
    assert len(svc.tombstones) == 0


def one_drop_taken(svc) -> InventoryEntry:
    """On s1 (mounted at 0), "a" and "b" put and "a" removed: its drop, taken (sent to the
    node) and not acknowledged."""
    mount(svc, "s1")
    assert put(svc, ["a", "b"]) == [OK, OK]
    svc.remove(Remove(["a"], force=True), 1)
    (taken,) = svc.take_drops()["s1"]
    return taken


def test_acknowledged_drops_leave_no_tombstone() -> None:
    svc = make(node_ttl_ms=1_000)
    svc.drops_done("s1", [one_drop_taken(svc)], 1)
    svc.tick(1_000)
    assert len(svc.tombstones) == 0


def test_a_key_removed_twice_from_a_segment_that_went_with_both_drops_stays_removed() -> None:
    """Removed, put again on the same segment, removed again, its node acknowledging neither
    drop: the tombstone kept the older drop's offset, and the node's newer copy was adopted."""
    svc = make(node_ttl_ms=1_000)
    mount(svc, "s1")
    mount(svc, "s2")
    on_s1 = dict(placement="preferred", preferred_segments=["s1"])
    assert put(svc, ["k"], **on_s1) == [OK]
    assert svc.remove(Remove(["k"], force=True), 10).codes == [OK]
    svc.take_drops()  # sent; its node (cut off) never answers
    assert put(svc, ["k"], now=20, **on_s1) == [OK]
    newer = get(svc, ["k"], 20).replicas[0][0].offset
    assert svc.remove(Remove(["k"], force=True), 30).codes == [OK]  # this drop not sent yet
    svc.heartbeat(Heartbeat(["s2"]), 999)
    svc.tick(1_000)  # s1 goes with both drops
    held = InventoryEntry("k", newer, OBJECT_SIZE, checksum_of("k"))  # its node holds the last put
    assert mount(svc, "s1", now=1_100, inventory=[held]) == [held]
    assert exists(svc, ["k"], 1_200) == [False]


def test_drops_taken_for_an_earlier_incarnation_of_a_segment_are_not_due_to_the_next() -> None:
    # The server keeps drops a node did not answer and sends them again; once their segment
    # went (as tombstones) and came back under the same id, they are no longer due: sent, they
    # could make the node forget an object put there since.
    svc = make(node_ttl_ms=1_000)
    taken = one_drop_taken(svc)
    assert svc.drops_due("s1", [taken]) == [taken]
    svc.tick(1_000)
    assert svc.drops_due("s1", [taken]) == []  # gone
    mount(svc, "s1", now=1_001)
    assert svc.drops_due("s1", [taken]) == []  # another incarnation
    assert put(svc, ["b"], now=1_002) == [OK]
    svc.remove(Remove(["b"], force=True), 1_003)
    (fresh,) = svc.take_drops()["s1"]
    assert svc.drops_due("s1", [taken, fresh]) == [fresh]


def test_the_first_drop_still_waiting_is_found_from_where_the_last_look_stopped() -> None:
    # A remove is answered once its drops are acknowledged; the server asks after each
    # acknowledgement, from the first drop that still waited the time before.
    svc = make()
    mount(svc, "s1")
    assert put(svc, ["a", "b", "c"]) == [OK, OK, OK]
    svc.remove(Remove(["a", "b", "c"], force=True), 1)
    taken = svc.take_drops()["s1"]
    assert svc.first_dropping("s1", taken) == 0
    svc.drops_done("s1", taken[:2], 2)
    assert svc.first_dropping("s1", taken) == 2
    assert svc.first_dropping("s1", taken, 2) == 2
    svc.drops_done("s1", taken[2:], 3)
    assert svc.first_dropping("s1", taken, 2) == len(taken)
    assert svc.first_dropping("gone", taken) == len(taken)  # no such segment: nothing waits


# --- moves in flight when a segment goes (tiers.py) ------------------------------------------


def offloading(**config):
    """Node n1's DRAM "A" filled: offloads into its disk tier "A/disk" sent and not answered.
    Returns the service and the items (A/disk and A time out after 10 s without a heartbeat)."""
    svc = cluster(node_ttl_ms=10_000, **config)
    fill(svc)
    svc.tick(1)
    items = svc.take_moves()["A"]
    assert items and {item.dst_segment_id for item in items} == {"A/disk"}
    return svc, items


def moved(items: list[MoveItem]) -> list[InventoryEntry]:
    """What the node recorded of the moves it made: their targets."""
    return [InventoryEntry(item.key, item.dst_offset, item.size, item.checksum) for item in items]


def test_an_offload_target_left_on_a_disk_tier_that_went_is_refused_once_its_object_is_removed() -> None:
    svc, items = offloading()
    svc.heartbeat(Heartbeat(["A"]), 9_000)
    svc.tick(10_000)  # the disk tier went with the copies its node was writing
    first, *others = items
    assert svc.remove(Remove([first.key], force=True), 10_001).codes == [OK]
    rejected = svc.mount_segment(MountSegment(disk("A/disk", "n1"), moved(items)), 10_002).rejected
    assert [entry.key for entry in rejected] == [first.key]
    svc.finish_moves("A", items, [OK] * len(items), 10_003)  # late: their target went meanwhile
    assert exists(svc, [item.key for item in items], 10_004) == [item is not first for item in items]


def test_a_promotion_target_left_in_a_dram_segment_that_went_is_refused_once_its_object_is_removed() -> None:
    svc = cluster(promote_reads=2, lease_ttl_ms=1_000, node_ttl_ms=100_000)
    nodes = Nodes(svc)
    cold, moves = promoting(nodes)
    svc.heartbeat(Heartbeat(["A/disk"]), 99_000)
    svc.tick(100_000)  # node n1's DRAM segment timed out, the promotion written into it
    assert svc.remove(Remove([cold]), 100_001).codes == [OK]  # found on the disk tier
    for items in moves.values():  # the node wrote the copy; its answer comes late
        nodes.inventories["A"].add(moved(items))
    rejected = svc.mount_segment(MountSegment(dram("A", "n1"), nodes.inventories["A"].entries()), 100_002).rejected
    assert [entry.key for entry in rejected] == [cold]
    assert exists(svc, [cold], 100_003) == [False]


def test_ranges_a_move_of_a_removed_object_held_on_a_segment_that_went_are_refused() -> None:
    svc, items = offloading()
    first = items[0]
    source = get(svc, [first.key], 2).replicas[0][0]
    assert source.segment_id == "A"
    assert svc.remove(Remove([first.key], force=True), 3).codes == [OK]  # its move drops the source
    svc.tick(10_000)  # the node cut off: both its segments went before the move ended
    svc.finish_moves("A", items, None, 10_001)
    entry = InventoryEntry(first.key, source.offset, first.size, first.checksum)
    assert svc.mount_segment(MountSegment(dram("A", "n1"), [entry]), 10_002).rejected == [entry]
    rejected = svc.mount_segment(MountSegment(disk("A/disk", "n1"), moved(items)), 10_002).rejected
    assert [e.key for e in rejected] == [first.key]
    assert exists(svc, [first.key], 10_003) == [False]


def test_an_object_lost_during_its_offload_and_removed_comes_back_from_neither_tier() -> None:
    svc, items = offloading()
    first = items[0]
    source = get(svc, [first.key], 2).replicas[0][0]
    svc.tick(10_000)  # the node cut off: both its segments went, the object lost
    assert svc.remove(Remove([first.key]), 10_001).codes == [ErrorCode.OBJECT_NOT_FOUND]
    entry = InventoryEntry(first.key, source.offset, first.size, first.checksum)
    assert svc.mount_segment(MountSegment(dram("A", "n1"), [entry]), 10_002).rejected == [entry]
    rejected = svc.mount_segment(MountSegment(disk("A/disk", "n1"), moved(items)), 10_002).rejected
    assert [e.key for e in rejected] == [first.key]
    assert exists(svc, [item.key for item in items], 10_003) == [item is not first for item in items]
