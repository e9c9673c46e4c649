"""Inventory (kvpool/node/inventory.py): the node's record of complete objects in its segment.

How: plain unit tests of add/drop/overlap on a small segment, then a hypothesis stateful test
that runs random adds (single entries, and runs of keys at ascending offsets as commits bring
them, with spans of at most 3 entries) and drops against a naive model (a dict of key -> entry,
where an add first removes every entry with the same key or an overlapping range) and, after
every step, calls check_invariants() and compares entries, length and used_bytes with the
model. No I/O.
"""

from __future__ import annotations

import gc

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpool.node import inventory
from kvpool.node.inventory import Inventory
from kvpool.protocol.messages import InventoryEntry

CAPACITY = 4096


def e(key: str, offset: int, size: int, checksum: int = 0) -> InventoryEntry:
    return InventoryEntry(key, offset, size, checksum)


def test_add_get_entries_sorted_by_offset() -> None:
    inv = Inventory(CAPACITY)
    assert inv.add([e("b", 100, 50), e("a", 0, 10), e("c", 4000, 96)]) == []
    inv.check_invariants()
    assert [x.key for x in inv.entries()] == ["a", "b", "c"]
    assert len(inv) == 3 and "a" in inv and "z" not in inv
    assert inv.used_bytes == 156
    assert inv.get("b") == e("b", 100, 50)
    assert inv.get("z") is None


def test_a_run_of_new_keys_is_added_whole_and_a_run_over_held_bytes_displaces_them() -> None:
    """The common commit (new keys at ascending, disjoint offsets over a free span) is added in
    one step; the same checks hold as entry by entry: overlaps and repeated keys displace."""
    inv = Inventory(1 << 20)
    run = [e(f"r{i}", 1000 + 100 * i, 100) for i in range(5)]
    assert inv.add(run) == []
    assert inv.entries() == run and inv.used_bytes == 500
    inv.check_invariants()
    assert inv.add([e("x", 0, 10), e("y", 1050, 10)]) == [run[0]]  # y lands inside r0
    assert inv.add([e("r1", 5000, 100), e("z", 6000, 10)]) == [run[1]]  # r1 moved: old one out
    assert inv.add([e("p", 7000, 10), e("q", 7005, 10)]) == [e("p", 7000, 10)]  # within the run
    assert sorted(x.key for x in inv.entries()) == ["q", "r1", "r2", "r3", "r4", "x", "y", "z"]
    inv.check_invariants()


def test_a_run_put_again_before_the_drop_of_its_old_entries_is_added_whole() -> None:
    """A client removes keys and puts them again; the master sends the old entries' drops in the
    background, so the new commit can come first. The old entries go, and the new run is one
    span, as a fresh run is: entry by entry, every key cut the spans around it, and a node
    re-putting thousands of keys per second fell seconds behind its commits."""
    inv = Inventory(1 << 20)
    old = [e(f"k{i}", 100 * i, 100) for i in range(40)]
    inv.add(old)
    new = [e(f"k{i}", 10_000 + 100 * i, 100) for i in range(40)]
    assert inv.add(new) == old
    assert inv.entries() == new and inv.used_bytes == 4_000
    assert inv.span_count == 1
    assert inv.drop(old) == []  # the late drops match nothing
    inv.check_invariants()


def test_a_commit_of_several_runs_adds_each_fresh_one_whole() -> None:
    """A run the master split over a fragmented segment's holes arrives as several contiguous
    runs in one commit (master/puts.py): each is checked as a whole, in order."""
    inv = Inventory(1 << 20)
    inv.add([e("old", 5000, 100)])
    first = [e(f"a{i}", 1000 + 64 * i, 60) for i in range(4)]  # padding gaps under 64 bytes
    second = [e(f"b{i}", 200 + 100 * i, 100) for i in range(3)]
    third = [e("c0", 4950, 100), e("c1", 5050, 100)]  # lands over "old": displaces it
    assert inv.add(first + second + third) == [e("old", 5000, 100)]
    assert inv.entries() == second + first + third
    inv.check_invariants()


def test_a_commit_scattered_over_the_segment_is_checked_run_by_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys placed in holes all over a fragmented segment arrive in ascending order with other
    objects between them: checking the whole range from the first to the last, as one run,
    walked every object of the segment (over 200 us per key at 16,384 objects). Each run's own
    range is checked instead."""
    inv = Inventory(1 << 20)
    held = [e(f"h{i}", 200 * i, 100) for i in range(1000)]  # a gap after each
    assert inv.add(held) == []
    checked: list[int] = []
    overlapping = inv.overlapping
    monkeypatch.setattr(inv, "overlapping", lambda offset, size: checked.append(size) or overlapping(offset, size))
    scattered = [e(f"s{i}", 200 * i + 100, 100) for i in range(0, 1000, 7)]  # one per gap
    assert inv.add(scattered) == []
    assert max(checked) == 100 and len(inv) == 1000 + len(scattered)
    inv.check_invariants()


def test_the_garbage_collector_never_walks_the_entries_by_key() -> None:
    """A node holds an entry per object; a full collection visited every one through the
    index by key (tens of ms at a million, the node serving nothing meanwhile). Entries are
    untracked, so that dict is too, however it grows."""
    inv = Inventory(1 << 30)
    inv.add([InventoryEntry(f"k{i}", i * 4096, 4096, i) for i in range(1000)])
    gc.collect()
    inv.add([InventoryEntry("late", 1000 * 4096, 4096, 1)])
    assert not gc.is_tracked(inv._by_key) and not gc.is_tracked(inv.get("late"))


def test_overlapping_finds_neighbours_only() -> None:
    inv = Inventory(CAPACITY)
    inv.add([e("a", 0, 10), e("b", 10, 10), e("c", 30, 10)])
    assert inv.overlapping(0, 10) == [e("a", 0, 10)]
    assert inv.overlapping(9, 2) == [e("a", 0, 10), e("b", 10, 10)]
    assert inv.overlapping(20, 10) == []  # The gap [20, 30) touches neither side.
    assert inv.overlapping(25, 6) == [e("c", 30, 10)]
    assert inv.overlapping(39, 100) == [e("c", 30, 10)]
    assert inv.overlapping(40, 100) == []
    assert inv.overlapping(5, 0) == []
    assert inv.is_range_free(20, 10)
    assert not inv.is_range_free(0, 1)


def test_add_overlapping_displaces_old_entries() -> None:
    inv = Inventory(CAPACITY)
    inv.add([e("a", 0, 10), e("b", 10, 10), e("c", 30, 10)])
    displaced = inv.add([e("d", 5, 10)])
    inv.check_invariants()
    assert displaced == [e("a", 0, 10), e("b", 10, 10)]
    assert [x.key for x in inv.entries()] == ["d", "c"]
    assert inv.used_bytes == 20


def test_add_same_key_moves_it_and_identical_readd_is_a_no_op() -> None:
    inv = Inventory(CAPACITY)
    inv.add([e("a", 0, 10, 7)])
    assert inv.add([e("a", 0, 10, 7)]) == []
    assert inv.add([e("a", 100, 20, 8)]) == [e("a", 0, 10, 7)]
    inv.check_invariants()
    assert inv.entries() == [e("a", 100, 20, 8)]
    assert inv.used_bytes == 20


def test_drop_matches_key_and_offset_and_ignores_unknown() -> None:
    inv = Inventory(CAPACITY)
    inv.add([e("a", 0, 10), e("b", 10, 10)])
    assert inv.drop([e("a", 64, 10), e("zz", 0, 1)]) == []  # wrong offset, unknown key
    assert inv.drop([e("a", 0, 999)]) == [e("a", 0, 10)]  # size and checksum are not matched
    inv.check_invariants()
    assert inv.entries() == [e("b", 10, 10)]
    assert inv.used_bytes == 10
    inv.clear()
    inv.check_invariants()
    assert len(inv) == 0 and inv.used_bytes == 0


@pytest.mark.parametrize("bad", [e("x", 0, 0), e("x", -1, 4), e("x", CAPACITY - 1, 2)])
def test_add_outside_the_segment_is_a_caller_bug(bad: InventoryEntry) -> None:
    inv = Inventory(CAPACITY)
    with pytest.raises(AssertionError):
        inv.add([bad])


def test_check_invariants_catches_corruption() -> None:
    inv = Inventory(CAPACITY)
    inv.add([e("a", 0, 10)])
    inv.used_bytes += 1
    with pytest.raises(AssertionError):
        inv.check_invariants()


# --- stateful test against a naive model ------------------------------------------------------

SMALL_CAPACITY = 256
keys = st.sampled_from([f"k{i}" for i in range(12)])
offsets = st.integers(0, SMALL_CAPACITY - 1)


def _model_add(model: dict[str, InventoryEntry], entry: InventoryEntry) -> None:
    for key, old in list(model.items()):
        overlaps = old.offset < entry.offset + entry.size and entry.offset < old.offset + old.size
        if key == entry.key or overlaps:
            del model[key]
    model[entry.key] = entry


class InventoryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.inv = Inventory(SMALL_CAPACITY)
        self.model: dict[str, InventoryEntry] = {}
        self.span_entries_max = inventory.SPAN_ENTRIES_MAX
        inventory.SPAN_ENTRIES_MAX = 3  # runs longer than a span, and cuts, in small examples

    def teardown(self) -> None:
        inventory.SPAN_ENTRIES_MAX = self.span_entries_max

    @rule(batch=st.lists(st.tuples(keys, offsets, st.integers(1, 64), st.integers(0, 3)),
                         max_size=4))  # fmt: skip
    def add(self, batch: list[tuple[str, int, int, int]]) -> None:
        entries = [e(k, o, min(s, SMALL_CAPACITY - o), c) for k, o, s, c in batch]
        before = dict(self.model)
        displaced = self.inv.add(entries)
        for entry in entries:
            _model_add(self.model, entry)
        # Whatever was displaced was held before (or added earlier in this very batch).
        for old in displaced:
            assert old in before.values() or old in entries, old

    @rule(start=offsets, gap=st.integers(0, 8),
          run=st.lists(st.tuples(keys, st.integers(1, 24)), min_size=1, max_size=8,
                       unique_by=lambda item: item[0]))  # fmt: skip
    def add_run(self, start: int, gap: int, run: list[tuple[str, int]]) -> None:
        """Keys at ascending offsets, as a commit of a run brings them (gaps: refused keys)."""
        entries = []
        offset = start
        for key, size in run:
            if offset + size > SMALL_CAPACITY:
                break
            entries.append(e(key, offset, size))
            offset += size + gap
        self.inv.add(entries)
        for entry in entries:
            _model_add(self.model, entry)

    @rule(chosen=st.lists(keys, max_size=8, unique=True))
    def drop_several(self, chosen: list[str]) -> None:
        held = sorted((self.model[k] for k in chosen if k in self.model), key=lambda x: x.offset)
        assert self.inv.drop(held) == held
        for entry in held:
            del self.model[entry.key]

    @rule(key=keys)
    def drop_held(self, key: str) -> None:
        held = self.model.get(key)
        if held is None:
            return
        assert self.inv.drop([e(key, held.offset, 1)]) == [held]
        del self.model[key]

    @rule(key=keys, offset=offsets)
    def drop_maybe_unknown(self, key: str, offset: int) -> None:
        held = self.model.get(key)
        dropped = self.inv.drop([e(key, offset, 1)])
        if held is not None and held.offset == offset:
            assert dropped == [held]
            del self.model[key]
        else:
            assert dropped == []

    @rule(offset=offsets, size=st.integers(1, 64))
    def overlap_query(self, offset: int, size: int) -> None:
        expected = sorted(
            (x for x in self.model.values()
             if x.offset < offset + size and offset < x.offset + x.size),
            key=lambda x: x.offset,
        )  # fmt: skip
        assert self.inv.overlapping(offset, size) == expected

    @invariant()
    def matches_model(self) -> None:
        self.inv.check_invariants()
        assert self.inv.entries() == sorted(self.model.values(), key=lambda x: x.offset)
        assert len(self.inv) == len(self.model)
        assert self.inv.used_bytes == sum(x.size for x in self.model.values())


InventoryMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40,
                                              deadline=None)  # fmt: skip
test_inventory_against_model = InventoryMachine.TestCase
