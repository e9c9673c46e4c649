"""Objects lost with a segment the master timed out stay removed when a remove named them.

A node stopped or cut off past the node TTL keeps its DRAM: the master drops its objects held
nowhere else as lost (mounts.py), and its node mounts them again when it comes back. A remove
meanwhile (by key, batch, pattern or remove_all) found no such key; the object came back with
the node, after the remove was answered. The master keeps the lost keys per segment, as the
replicas left behind (tombstones.py), and a remove that names them turns them into tombstones.

How: MasterService through test_master_service's checked proxy, the node played by the test.
"""

from __future__ import annotations

import logging

import pytest

from kvpool.errors import ErrorCode, SegmentNotFound
from kvpool.master.metadata import ObjectTable
from kvpool.master.tombstones import Tombstones
from kvpool.protocol.messages import (
    Heartbeat,
    InventoryEntry,
    MountSegment,
    Remove,
    RemoveAll,
    RemoveByRegex,
    UnmountSegment,
)
from tests.test_master_service import OBJECT_SIZE, OK, checksum_of, exists, get, info, make, mount, put

NOT_FOUND = ErrorCode.OBJECT_NOT_FOUND
KEYS = ["a", "b", "c", "d"]


def lost_with_s1(svc, keys: list[str] = KEYS) -> list[InventoryEntry]:
    """Put `keys` on s1 alone (s2 mounted too), then time s1 out (its node cut off, its DRAM
    intact): its objects are lost. Returns what its node still holds."""
    mount(svc, "s1")
    mount(svc, "s2")
    assert put(svc, keys, placement="preferred", preferred_segments=["s1"]) == [OK] * len(keys)
    held = [
        InventoryEntry(key, replicas[0].offset, OBJECT_SIZE, checksum_of(key))
        for key, replicas in zip(keys, get(svc, keys).replicas)
    ]
    assert {r.segment_id for replicas in get(svc, keys).replicas for r in replicas} == {"s1"}
    svc.heartbeat(Heartbeat(["s2"]), 999)
    svc.tick(1_000)
    assert exists(svc, keys) == [False] * len(keys) and svc.counters.lost == len(keys)
    return held


def comes_back(svc, held: list[InventoryEntry], now: int = 1_500) -> list[str]:
    """s1's node mounts again with what it held and heartbeats; returns the keys refused."""
    rejected = mount(svc, "s1", now=now, inventory=held)
    svc.heartbeat(Heartbeat(["s1", "s2"]), now + 1)
    return sorted(entry.key for entry in rejected)


@pytest.mark.parametrize("remove_by", ["key", "batch", "regex", "all"])
def test_a_lost_object_removed_while_its_node_was_away_does_not_come_back(remove_by: str) -> None:
    svc = make(node_ttl_ms=1_000)
    held = lost_with_s1(svc)
    if remove_by == "key":
        assert svc.remove(Remove(["a"]), 1_100).codes == [NOT_FOUND]
        removed = ["a"]
    elif remove_by == "batch":
        assert svc.remove(Remove(["a", "c", "x"]), 1_100).codes == [NOT_FOUND] * 3
        removed = ["a", "c"]
    elif remove_by == "regex":
        assert svc.remove_by_regex(RemoveByRegex("^[bc]$"), 1_100).count == 0  # none it knew of
        removed = ["b", "c"]
    else:
        assert svc.remove_all(RemoveAll(), 1_100).count == 0
        removed = KEYS
    assert comes_back(svc, held) == removed
    assert exists(svc, KEYS, 1_600) == [key not in removed for key in KEYS]
    assert len(svc.tombstones) == 0  # settled by the heartbeat


def test_a_lost_object_not_removed_comes_back_with_its_node() -> None:
    svc = make(node_ttl_ms=1_000)
    held = lost_with_s1(svc)
    svc.remove(Remove(["x"]), 1_100)
    assert comes_back(svc, held) == []
    assert exists(svc, KEYS, 1_600) == [True] * 4


def test_a_put_after_the_remove_is_a_new_object_and_the_old_one_is_refused() -> None:
    svc = make(node_ttl_ms=1_000)
    held = lost_with_s1(svc)
    assert svc.remove(Remove(["a"]), 1_100).codes == [NOT_FOUND]
    assert put(svc, ["a"], now=1_200) == [OK]  # on s2, the only segment mounted
    assert comes_back(svc, held) == ["a"]
    assert [[r.segment_id for r in replicas] for replicas in get(svc, ["a"], 1_600).replicas] == [["s2"]]


def test_a_put_again_without_a_remove_is_refused_nothing() -> None:
    """The node's copy of a key put again meanwhile follows the adopt rules: the same bytes are
    a second replica (a key names its bytes)."""
    svc = make(node_ttl_ms=1_000)
    held = lost_with_s1(svc)
    assert put(svc, ["a"], now=1_200) == [OK]
    assert comes_back(svc, held) == []
    replicas = get(svc, ["a"], 1_600).replicas[0]
    assert sorted(r.segment_id for r in replicas) == ["s1", "s2"]


def test_a_lost_object_put_again_and_then_removed_does_not_come_back() -> None:
    svc = make(node_ttl_ms=1_000)
    held = lost_with_s1(svc)
    assert put(svc, ["a"], now=1_200) == [OK]
    assert svc.remove(Remove(["a"]), 1_300).codes == [OK]
    assert comes_back(svc, held) == ["a"]
    assert exists(svc, ["a"], 1_600) == [False]


def test_lost_keys_are_forgotten_after_the_tombstone_ttl() -> None:
    svc = make(node_ttl_ms=1_000)
    held = lost_with_s1(svc)
    svc.tick(1_000 + 10 * 60_000)  # limits.TOMBSTONE_DRAM_TTL_MS: a DRAM segment's
    assert svc.remove(Remove(["a"]), 1_000 + 10 * 60_000).codes == [NOT_FOUND]
    assert len(svc.tombstones) == 0
    assert comes_back(svc, held, now=1_000 + 10 * 60_000 + 1) == []


def test_a_lost_key_put_again_after_a_remove_all_began_is_removed_and_counted() -> None:
    svc = make(node_ttl_ms=1_000)
    lost_with_s1(svc)
    removal = svc.removal(RemoveAll())
    assert put(svc, ["a", "new"], now=1_200) == [OK, OK]  # both put after it began
    assert removal.run(1_300) == 1  # "a" as a lost key; "new" was put first meanwhile
    assert exists(svc, ["a", "new"], 1_400) == [False, True]


def test_a_lost_key_put_again_before_a_remove_all_goes_once() -> None:
    """Its key is among the objects' and the lost keys', maybe in one step."""
    svc = make(node_ttl_ms=1_000)
    held = lost_with_s1(svc)
    assert put(svc, ["a"], now=1_200) == [OK]
    assert svc.remove_all(RemoveAll(), 1_300).count == 1
    assert exists(svc, ["a"], 1_400) == [False]
    assert comes_back(svc, held) == KEYS


def test_a_remove_all_copies_the_lost_keys_without_looking_each_up(monkeypatch) -> None:
    """removal() runs before the first step, the master serving no one: with a million lost
    keys, a lookup of each held it 0.45 s. The steps tell those put again from the others."""
    svc = make(node_ttl_ms=1_000)
    held = lost_with_s1(svc)
    looked_up: list[str] = []
    real_get = ObjectTable.get
    monkeypatch.setattr(ObjectTable, "get", lambda table, key: looked_up.append(key) or real_get(table, key))
    removal = svc.removal(RemoveAll())
    assert looked_up == []
    monkeypatch.undo()
    assert removal.run(1_100) == 0
    assert comes_back(svc, held) == KEYS


def big_loss(svc, lost: list[str]) -> tuple[list[InventoryEntry], list[InventoryEntry]]:
    """s3 goes holding a replica of "k" (which lives on s2) and the only one of "r" (removed,
    its drop unacknowledged: a tombstone), then s1 goes holding the only replicas of `lost`.
    Returns what the nodes of s3 and s1 still hold."""
    for segment_id in ("s1", "s2", "s3"):
        mount(svc, segment_id)
    assert put(svc, ["k"], replica_num=2, placement="preferred", preferred_segments=["s2", "s3"]) == [OK]
    assert put(svc, ["r"], placement="preferred", preferred_segments=["s3"]) == [OK]
    assert put(svc, lost, placement="preferred", preferred_segments=["s1"]) == [OK] * len(lost)

    def held_on(segment_id: str, keys: list[str]) -> list[InventoryEntry]:
        return [
            InventoryEntry(key, replica.offset, OBJECT_SIZE, checksum_of(key))
            for key, replicas in zip(keys, get(svc, keys).replicas)
            for replica in replicas
            if replica.segment_id == segment_id
        ]

    on_s3, on_s1 = held_on("s3", ["k", "r"]), held_on("s1", lost)
    assert svc.remove(Remove(["r"], force=True), 100).codes == [OK]  # its drop never acknowledged
    svc.heartbeat(Heartbeat(["s1", "s2"]), 500)
    svc.tick(1_000)  # s3 goes: k left behind there, r a tombstone
    svc.heartbeat(Heartbeat(["s2"]), 1_100)
    svc.tick(1_600)  # s1 goes, its objects lost
    assert exists(svc, ["k", "r", *lost], 1_600) == [True, False] + [False] * len(lost)
    return on_s3, on_s1


def test_a_node_losing_more_objects_than_replicas_may_be_left_behind_forgets_no_other_segments() -> None:
    """Lost keys have a budget of their own: a node timed out with a disk tier of a million
    objects pushed out the other segments' replicas left behind and tombstones (shared caps)."""
    svc = make(node_ttl_ms=1_000)
    svc.tombstones.entries_max = 2  # stands for TOMBSTONES_MAX
    on_s3, on_s1 = big_loss(svc, ["a", "b", "c"])
    assert svc.remove(Remove(["k"], force=True), 1_700).codes == [OK]  # answered done: must stay so
    assert svc.remove_all(RemoveAll(), 1_700).count == 0  # a, b and c are tombstones now
    rejected = mount(svc, "s3", now=1_800, inventory=on_s3)
    assert sorted(entry.key for entry in rejected) == ["k", "r"]
    assert comes_back(svc, on_s1, now=1_900) == ["a", "b", "c"]
    assert exists(svc, ["k", "r", "a"], 2_000) == [False] * 3


def test_lost_keys_over_their_budget_forget_the_oldest_lost_keys_only(caplog) -> None:
    tombstones = Tombstones(entries_max=2, lost_keys_max=3)
    tombstones.expire(0)
    tombstones.bury("s9", [InventoryEntry("r", 0, 1, 1)], 1_000)  # a drop's tombstone
    tombstones.leave_behind("s8", [("k", 0)], 1_000)  # k lives on elsewhere
    tombstones.leave_lost("old", [("a", 0), ("b", 128)], 1_000)
    tombstones.gone(["a"])  # a tombstone, on the lost budget
    with caplog.at_level(logging.WARNING, logger="kvpool.master.tombstones"):
        tombstones.leave_lost("new", [("c", 0), ("d", 128)], 1_000)  # 4 > 3: "old"'s b goes
        tombstones.leave_lost("newer", [("e", 0)], 1_000)  # then "new"'s c: "old"'s a is a remove answered
    assert caplog.text.count("more than 3 keys of objects lost") == 1
    tombstones.check_invariants()
    a, b = InventoryEntry("a", 0, 1, 1), InventoryEntry("b", 128, 1, 1)
    assert tombstones.unearth("old", [a, b]) == ([b], [a])
    tombstones.gone(["k", "c", "d", "e"])
    assert len(tombstones) == 5  # r, k, a, d, e
    entries = {key: InventoryEntry(key, 0 if key != "d" else 128, 1, 1) for key in "rkcde"}
    for segment_id, key in [("s9", "r"), ("s8", "k"), ("new", "d"), ("newer", "e")]:
        assert tombstones.unearth(segment_id, [entries[key]])[1] == [entries[key]]
    assert tombstones.unearth("new", [entries["c"]]) == ([entries["c"]], [])
    tombstones.check_invariants()


def test_lost_keys_over_their_budget_forget_those_no_remove_named_before_any_tombstone() -> None:
    """A remove_all buried every lost key of a segment: one more lost key over the budget
    forgot them all, and every object it had answered as removed came back with the node."""
    tombstones = Tombstones(lost_keys_max=4)
    tombstones.leave_lost("old", [(key, offset) for offset, key in enumerate(KEYS)], 1_000)
    tombstones.gone(KEYS)  # a remove_all: all four are tombstones
    tombstones.leave_lost("new", [("e", 0)], 1_000)  # 5 > 4: "new"'s e goes, no tombstone
    tombstones.check_invariants()
    held = [InventoryEntry(key, offset, 1, 1) for offset, key in enumerate(KEYS)]
    assert len(tombstones) == 4
    assert tombstones.unearth("old", held) == ([], held)
    tombstones.lost_keys_max = 3  # none left unnamed: the oldest tombstone goes, not all of them
    tombstones.leave_lost("newer", [("f", 0)], 1_000)
    tombstones.check_invariants()
    assert len(tombstones) == 3
    assert tombstones.unearth("old", held) == ([held[0]], held[1:])


def test_removed_lost_keys_stay_removed_when_other_lost_keys_go_over_the_budget() -> None:
    svc = make(node_ttl_ms=1_000)
    svc.tombstones.lost_keys_max = 5  # stands for LOST_KEYS_MAX
    held = lost_with_s1(svc)
    assert svc.remove_all(RemoveAll(), 1_100).count == 0  # a, b, c and d are tombstones
    mount(svc, "s3", now=1_100)
    assert put(svc, ["e", "f"], now=1_100, placement="preferred", preferred_segments=["s3"]) == [OK, OK]
    svc.heartbeat(Heartbeat(["s2"]), 1_500)
    svc.tick(2_100)  # s3 goes: e and f lost, 6 > 5
    assert comes_back(svc, held, now=2_200) == KEYS
    assert exists(svc, KEYS, 2_300) == [False] * 4


def test_a_dram_segment_its_node_unmounts_leaves_nothing_behind_to_crowd_out_lost_keys() -> None:
    """A DRAM segment that its node unmounted (stopped with SIGTERM) never mounts again: its
    file is gone, and the next start of the node mounts a new id. The keys lost with it were
    kept all the same, on the budget of lost keys (LOST_KEYS_MAX), and one node stopped with a
    million objects pushed out those of a node that does come back (a disk tier, a node cut
    off): removed meanwhile, they came back with it."""
    svc = make(node_ttl_ms=1_000)
    svc.tombstones.lost_keys_max = 5  # stands for LOST_KEYS_MAX
    held = lost_with_s1(svc)  # a, b, c and d: lost keys, not removed yet
    mount(svc, "s3", now=1_100)
    assert put(svc, ["e", "f", "g"], now=1_100, placement="preferred", preferred_segments=["s3"]) == [OK] * 3
    svc.unmount_segment(UnmountSegment("s3"), 1_200)  # 7 > 5, had they been kept
    assert svc.remove_all(RemoveAll(), 1_300).count == 0
    assert comes_back(svc, held) == KEYS
    assert exists(svc, KEYS, 1_600) == [False] * 4


def test_a_remove_between_the_parts_of_a_mount_reaches_a_lost_key_in_a_later_part() -> None:
    svc = make(node_ttl_ms=1_000)
    held = lost_with_s1(svc)
    svc.mount_segment(MountSegment(info("s1"), held[:2], is_last=False), 1_200)
    assert svc.remove(Remove(["c"]), 1_250).codes == [NOT_FOUND]
    rejected = svc.mount_segment(MountSegment(info("s1"), held[2:], is_last=True), 1_300).rejected
    assert [entry.key for entry in rejected] == ["c"]
    svc.heartbeat(Heartbeat(["s1", "s2"]), 1_400)
    assert exists(svc, KEYS, 1_500) == [True, True, False, True]


def test_a_later_part_of_a_mount_is_refused_once_its_segment_went_since_the_first() -> None:
    """The last part's is_whole forgot the lost keys the first part (to the incarnation that
    timed out) showed: the master no longer knew of objects its node held (a remove of one
    found nothing, and the node's next mount brought it back). The node mounts again from the
    first part (test_mount_in_parts.py)."""
    svc = make(node_ttl_ms=1_000)
    held = lost_with_s1(svc)
    svc.mount_segment(MountSegment(info("s1"), held[:2], is_last=False), 1_200)  # a, b
    svc.heartbeat(Heartbeat(["s2"]), 2_200)
    svc.tick(2_300)  # the node slow between parts: s1 times out, a and b lost again
    with pytest.raises(SegmentNotFound):
        svc.mount_segment(MountSegment(info("s1"), held[2:], is_first=False), 2_400)
    assert comes_back(svc, held, now=2_500) == []  # from its first part
    with pytest.raises(SegmentNotFound):  # nor a later part once the inventory is whole
        svc.mount_segment(MountSegment(info("s1"), held[2:], is_first=False), 2_600)
    assert svc.remove(Remove(["a"]), 2_700).codes == [OK]
    assert exists(svc, KEYS, 2_800) == [False, True, True, True]


def test_a_key_put_again_into_its_segment_mounted_whole_is_not_refused_when_the_node_mounts_again() -> None:
    """The node came back without "a", whole: a remove of "a" before its heartbeat buried "a"
    there, and a put of "a" landing at its old offset was refused at the node's next mount
    (its reply lost, it mounts again), though the master listed it."""
    svc = make(node_ttl_ms=1_000)
    held = lost_with_s1(svc)
    assert mount(svc, "s1", now=1_100, inventory=held[1:]) == []
    assert svc.remove(Remove(["a"]), 1_150).codes == [NOT_FOUND]
    assert put(svc, ["a"], now=1_200, placement="preferred", preferred_segments=["s1"]) == [OK]
    assert [(r.segment_id, r.offset) for r in get(svc, ["a"], 1_250).replicas[0]] == [("s1", held[0].offset)]
    assert mount(svc, "s1", now=1_300, inventory=held) == []
    svc.heartbeat(Heartbeat(["s1", "s2"]), 1_301)
    assert exists(svc, KEYS, 1_400) == [True] * 4
