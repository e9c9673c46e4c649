"""OffsetAllocator: best fit, coalescing, allocate_at / allocate_many_at, and utilisation.

How: plain unit tests for the edges (alignment, full, exact fit, rounding of the capacity,
double free caught); a hypothesis RuleBasedStateMachine that runs allocate / free /
allocate_at / allocate_many_at against a naive model (a set of allocated aligned units) and
checks after every step that `check_invariants()` holds and the free bytes, the largest free
extent and every extent agree with the model; and a seeded churn of KV-cache-shaped sizes
(16 KiB .. 4 MiB, power-of-two-ish) that must keep utilisation above 95%.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool import limits
from kvpool.master.allocator import OffsetAllocator, footprint_bytes

KIB = limits.KIB
MIB = limits.MIB


def test_allocate_rounds_to_alignment_and_counts_footprint() -> None:
    allocator = OffsetAllocator(64 * 10)
    offset = allocator.allocate(1)
    assert offset is not None and offset % 64 == 0
    assert allocator.used_bytes == 64
    assert allocator.free_bytes == 64 * 9
    allocator.free(offset, 1)
    assert allocator.used_bytes == 0
    allocator.check_invariants()


def test_full_returns_none_and_free_makes_room() -> None:
    allocator = OffsetAllocator(256)
    offsets = [allocator.allocate(64) for _ in range(4)]
    assert None not in offsets
    assert sorted(offsets) == [0, 64, 128, 192]
    assert allocator.allocate(1) is None
    assert allocator.largest_free_bytes == 0
    allocator.free(offsets[1], 64)
    assert allocator.allocate(64) == offsets[1]
    allocator.check_invariants()


def test_best_fit_prefers_the_smallest_hole() -> None:
    allocator = OffsetAllocator(64 * 100)
    a = allocator.allocate(64 * 10)
    b = allocator.allocate(64 * 1)
    c = allocator.allocate(64 * 3)
    d = allocator.allocate(64 * 1)
    assert None not in (a, b, c, d)
    allocator.free(a, 64 * 10)  # a hole of 10 units
    allocator.free(c, 64 * 3)  # a hole of 3 units
    offset = allocator.allocate(64 * 3)
    assert offset == c  # the exact fit, not the 10-unit hole nor the big tail
    allocator.check_invariants()


def test_ranges_allocated_in_turn_lie_in_ascending_order() -> None:
    # Objects put in turn sit in address order, so eviction (oldest first) frees ranges
    # that coalesce: four allocations, the first two freed, leave one extent of two units.
    allocator = OffsetAllocator(64 * 8)
    offsets = [allocator.allocate(64) for _ in range(4)]
    assert offsets == [0, 64, 128, 192]
    allocator.free_many([(0, 64), (64, 64)])
    assert list(allocator.iter_free_extents()) == [(0, 128), (256, 256)]


def test_free_coalesces_both_neighbours() -> None:
    allocator = OffsetAllocator(64 * 3)
    a, b, c = (allocator.allocate(64) for _ in range(3))
    allocator.free(a, 64)
    allocator.free(c, 64)
    assert allocator.free_extent_count == 2
    allocator.free(b, 64)
    assert allocator.free_extent_count == 1
    assert allocator.largest_free_bytes == 64 * 3
    allocator.check_invariants()


def test_hole_bytes_if_freed_counts_the_free_extents_a_range_touches() -> None:
    allocator = OffsetAllocator(64 * 8)
    a, b, c, d = (allocator.allocate(size) for size in (64, 100, 64, 64))  # 64, 128, 64, 64
    allocator.free(a, 64)  # free: [0, 64) and [320, 512)
    assert allocator.hole_bytes_if_freed(b, 100) == 64 + 128  # the extent before
    assert allocator.hole_bytes_if_freed(c, 64) == 64  # touches none
    assert allocator.hole_bytes_if_freed(d, 64) == 64 + 192  # the extent after
    assert allocator.free_bytes == 256 and allocator.largest_free_bytes == 192  # nothing freed


def test_free_many_returns_adjacent_ranges_as_one_extent() -> None:
    allocator = OffsetAllocator(64 * 8)
    offsets = [allocator.allocate(size) for size in (64, 100, 64, 64)]  # footprints 64, 128, 64, 64
    assert None not in offsets
    by_offset = dict(zip(offsets, (64, 100, 64, 64)))
    kept = offsets[2]
    allocator.free_many([(offset, size) for offset, size in by_offset.items() if offset != kept])
    allocator.check_invariants()
    assert allocator.used_bytes == 64
    # Everything but the kept range is free, in the two extents around it.
    assert list(allocator.iter_free_extents()) == [(0, kept), (kept + 64, 64 * 8 - kept - 64)]
    with pytest.raises(AssertionError):  # a double free is caught as one free
        allocator.free_many([(offsets[0], 64)])


def test_capacity_is_rounded_down_to_alignment() -> None:
    allocator = OffsetAllocator(64 * 4 + 10)
    assert allocator.capacity_bytes == 64 * 4
    assert allocator.allocate(64 * 4) is not None
    assert allocator.allocate(1) is None
    allocator.check_invariants()


def test_the_largest_tier_is_allocated_to_its_last_byte() -> None:
    """A 128 TiB tier (a big disk tier or DFS): offsets near the top pack and round-trip."""
    from kvpool.master.metadata import pack_replica, replica_offset, replica_segment_index

    allocator = OffsetAllocator(limits.SEGMENT_SIZE_BYTES_MAX)
    first = allocator.allocate(limits.SEGMENT_SIZE_BYTES_MAX - 4 * MIB)
    last = allocator.allocate(4 * MIB)
    assert (first, last) == (4 * MIB, 0) or (first, last) == (0, limits.SEGMENT_SIZE_BYTES_MAX - 4 * MIB)
    assert allocator.free_bytes == 0 and allocator.allocate(64) is None
    top = max(first, last)
    packed = pack_replica(65_535, top)
    assert (replica_segment_index(packed), replica_offset(packed)) == (65_535, top)
    allocator.free(top, limits.SEGMENT_SIZE_BYTES_MAX - top)
    assert allocator.largest_free_bytes == limits.SEGMENT_SIZE_BYTES_MAX - top
    allocator.check_invariants()


def test_allocate_at_takes_exact_ranges_and_refuses_overlap() -> None:
    allocator = OffsetAllocator(64 * 10)
    assert allocator.allocate_at(128, 100)  # footprint 128: [128, 256)
    assert not allocator.allocate_at(192, 64)  # inside it
    assert not allocator.allocate_at(64, 65)  # footprint 128 reaches into it
    assert allocator.allocate_at(64, 64)
    assert not allocator.allocate_at(32, 64)  # unaligned
    assert not allocator.allocate_at(64 * 9, 65)  # past the capacity
    assert not allocator.allocate_at(-64, 64)
    assert not allocator.allocate_at(0, 0)
    assert allocator.used_bytes == 64 * 3
    allocator.check_invariants()
    allocator.free(128, 100)
    allocator.free(64, 64)
    assert allocator.used_bytes == 0
    allocator.check_invariants()


def test_allocate_many_at_lower_offset_wins_an_overlap() -> None:
    allocator = OffsetAllocator(64 * 10)
    first = allocator.allocate(64)  # the first unit (allocations take the start of an extent)
    assert first == 0
    results = allocator.allocate_many_at([(128, 128), (64, 128), (64 * 9, 64), (0, 64), (64 * 4, 64)])
    assert results == [False, True, True, False, True]
    assert allocator.used_bytes == 64 * 5
    allocator.check_invariants()


def test_double_free_is_caught() -> None:
    allocator = OffsetAllocator(64 * 4)
    offset = allocator.allocate(64)
    assert offset is not None
    allocator.free(offset, 64)
    with pytest.raises(AssertionError):
        allocator.free(offset, 64)


def test_footprint_bytes() -> None:
    assert footprint_bytes(1) == 64
    assert footprint_bytes(64) == 64
    assert footprint_bytes(65) == 128
    assert footprint_bytes(4096, 4096) == 4096


def _kv_size(rng: random.Random) -> int:
    """KV-cache-shaped: a power of two from 16 KiB to 4 MiB, sometimes x1.5 or x0.75."""
    size = 16 * KIB << rng.randrange(0, 9)
    return int(size * rng.choice((1, 1, 1, 1.5, 0.75)))


def _model_size(rng: random.Random) -> int:
    """A few models sharing the pool, each with its own fixed object size."""
    return rng.choice((256 * KIB, 1 * MIB, 2 * MIB + 512 * KIB, 4 * MIB))


def _churn_utilisation(seed: int, size_of, refusals_in_a_row: int) -> float:
    """Fill, then churn (free a random 10%, refill), 30 rounds; returns the lowest used
    fraction at the moment the allocator was "full": `refusals_in_a_row` requests in a row
    found no room (so the free space left is in holes smaller than what the workload asks)."""
    rng = random.Random(seed)
    allocator = OffsetAllocator(1024 * MIB)
    live: list[tuple[int, int]] = []
    worst = 1.0
    for round_index in range(30):
        refusals = 0
        while refusals < refusals_in_a_row:
            size = size_of(rng)
            offset = allocator.allocate(size)
            if offset is None:
                refusals += 1
                continue
            refusals = 0
            live.append((offset, size))
        if round_index >= 5:  # after a few rounds of churn, fragmentation has set in
            worst = min(worst, allocator.used_bytes / allocator.capacity_bytes)
        rng.shuffle(live)
        cut = len(live) // 10
        for offset, size in live[:cut]:
            allocator.free(offset, size)
        live = live[cut:]
    allocator.check_invariants()
    return worst


@pytest.mark.parametrize("seed", [1, 2])
def test_utilisation_above_95_percent_on_kv_sizes(seed: int) -> None:
    # Measured: 99.7-99.8% (mixed sizes), 98.5-98.8% (four model sizes). At the very first
    # refusal of a 16 KiB..6 MiB mix it is 81-93%: a 6 MiB request cannot use 1 MiB holes.
    assert _churn_utilisation(seed, _kv_size, refusals_in_a_row=8) > 0.95
    assert _churn_utilisation(seed, _model_size, refusals_in_a_row=8) > 0.95


def test_utilisation_of_one_object_size_is_total() -> None:
    assert _churn_utilisation(3, lambda rng: 2 * MIB, refusals_in_a_row=1) == 1.0


class AllocatorMachine(RuleBasedStateMachine):
    """The allocator against a model: the set of allocated units (64-byte cells)."""

    UNIT = 64

    @initialize(units=st.integers(1, 64), tail=st.integers(0, 63))
    def setup(self, units: int, tail: int) -> None:
        self.capacity_units = units
        self.allocator = OffsetAllocator(units * self.UNIT + tail)
        self.used: set[int] = set()  # allocated units
        self.live: dict[int, int] = {}  # offset -> size_bytes as passed

    def _units(self, offset: int, size_bytes: int) -> range:
        start = offset // self.UNIT
        return range(start, start + footprint_bytes(size_bytes) // self.UNIT)

    def _fits_model(self, offset: int, size_bytes: int) -> bool:
        units = self._units(offset, size_bytes)
        return (
            offset >= 0
            and offset % self.UNIT == 0
            and units.stop <= self.capacity_units
            and not any(unit in self.used for unit in units)
        )

    def _model_free_runs(self) -> list[tuple[int, int]]:
        runs, start = [], None
        for unit in range(self.capacity_units + 1):
            is_free = unit < self.capacity_units and unit not in self.used
            if is_free and start is None:
                start = unit
            elif not is_free and start is not None:
                runs.append((start * self.UNIT, (unit - start) * self.UNIT))
                start = None
        return runs

    @rule(size=st.integers(1, 64 * 20))
    def allocate(self, size: int) -> None:
        needed = footprint_bytes(size)
        runs = self._model_free_runs()
        fits = [run for run in runs if run[1] >= needed]
        offset = self.allocator.allocate(size)
        if not fits:
            assert offset is None
            return
        assert offset is not None
        best = min(run[1] for run in fits)
        run = next(r for r in runs if r[0] <= offset < r[0] + r[1])
        assert run[1] == best, "not the best fit"
        assert self._fits_model(offset, size)
        self.used.update(self._units(offset, size))
        self.live[offset] = size

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data) -> None:
        offset = data.draw(st.sampled_from(sorted(self.live)))
        size = self.live.pop(offset)
        predicted = self.allocator.hole_bytes_if_freed(offset, size)
        self.allocator.free(offset, size)
        self.used.difference_update(self._units(offset, size))
        # The hole a free makes is the model's free run around the freed range.
        assert predicted == next(n for start, n in self._model_free_runs() if start <= offset < start + n)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free_many(self, data) -> None:
        offsets = data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=1, unique=True))
        ranges = [(offset, self.live.pop(offset)) for offset in offsets]
        self.allocator.free_many(ranges)
        for offset, size in ranges:
            self.used.difference_update(self._units(offset, size))

    @rule(unit=st.integers(-1, 65), size=st.integers(0, 64 * 8), skew=st.sampled_from([0, 0, 0, 1]))
    def allocate_at(self, unit: int, size: int, skew: int) -> None:
        offset = unit * self.UNIT + skew
        expected = size > 0 and self._fits_model(offset, size)
        assert self.allocator.allocate_at(offset, size) == expected
        if expected:
            self.used.update(self._units(offset, size))
            self.live[offset] = size

    @rule(ranges=st.lists(st.tuples(st.integers(0, 65), st.integers(1, 64 * 6)), max_size=6))
    def allocate_many_at(self, ranges: list[tuple[int, int]]) -> None:
        pairs = [(unit * self.UNIT, size) for unit, size in ranges]
        results = self.allocator.allocate_many_at(pairs)
        order = sorted(range(len(pairs)), key=lambda i: (pairs[i], i))
        for index in order:
            offset, size = pairs[index]
            expected = self._fits_model(offset, size)
            assert results[index] == expected, (pairs, results, index)
            if expected:
                self.used.update(self._units(offset, size))
                self.live[offset] = size

    @invariant()
    def agrees_with_model(self) -> None:
        self.allocator.check_invariants()
        assert self.allocator.used_bytes == len(self.used) * self.UNIT
        assert self.allocator.free_bytes == (self.capacity_units - len(self.used)) * self.UNIT
        runs = self._model_free_runs()
        assert list(self.allocator.iter_free_extents()) == runs
        assert self.allocator.largest_free_bytes == max((r[1] for r in runs), default=0)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
