"""Soft pins lapse on time, whichever tier the object moved to, and no eviction scan (real or
simulated) spends its bound on soft-pinned objects.

How: the object table and the policies directly (pure: time passed in, no sockets).
"""

from __future__ import annotations

import pytest

from kvpool.master.eviction import Verdict, make_policy
from kvpool.master.metadata import ObjectMeta, ObjectTable, pack_replica
from kvpool.protocol.messages import TIER_DISK, TIER_DRAM
from kvpool.sim.belady import BeladyPolicy

TTL_MS = 10_000


def _pinned(put_ms: int) -> ObjectMeta:
    return ObjectMeta(size_bytes=1, checksum=0, replicas=pack_replica(0, 0), soft_pin_expiry_ms=put_ms + TTL_MS)


def _is_pinned(table: ObjectTable, key: str) -> bool:
    meta = table.get(key)
    assert meta is not None
    return meta.soft_pin_expiry_ms != 0


@pytest.mark.parametrize("direction", ["offloaded", "promoted"])
def test_a_soft_pin_lapses_on_time_after_its_object_moved_to_another_tier(direction: str) -> None:
    """Object "old" (put at 0) moves to the tier where "new" (put at 5 s) is. It used to join
    that tier's pins at the newest end, and the expiry scan, which stops at the first live pin,
    kept it pinned until "new" lapsed: a TTL late at worst."""
    table = ObjectTable(make_policy("lru"), {TIER_DISK: make_policy("lru")})
    here, there = ((TIER_DRAM,), (TIER_DISK,)) if direction == "offloaded" else ((TIER_DISK,), (TIER_DRAM,))
    table.insert("old", _pinned(0), here)
    table.insert("new", _pinned(5_000), there)
    table.place("old", table.get("old"), there)  # type: ignore[arg-type]
    table.check_invariants()

    assert table.expire_soft_pins(TTL_MS) == 1
    assert not _is_pinned(table, "old") and _is_pinned(table, "new")
    table.check_invariants()
    assert table.expire_soft_pins(5_000 + TTL_MS) == 1
    assert not _is_pinned(table, "new")


def _judge_taking_all(key: str, meta: ObjectMeta) -> Verdict:
    return Verdict.TAKE


@pytest.mark.parametrize("policy", ["lru", "probation", "belady"])
def test_soft_pinned_objects_ahead_take_none_of_the_scan_bound(policy: str) -> None:
    """Soft-pinned objects first in the policy's order (for Belady: the furthest next uses),
    then unpinned ones: a scan of bound 4 takes 4 unpinned objects. The simulation's Belady
    counted the soft-pinned ones it skipped, and took none."""
    chosen = BeladyPolicy() if policy == "belady" else make_policy(policy)
    table = ObjectTable(chosen)
    keys = [f"pinned{i}" for i in range(8)] + [f"free{i}" for i in range(8)]
    if isinstance(chosen, BeladyPolicy):  # the furthest next use first: the pinned ones
        chosen.announce({key: (100 - i, 0, i) for i, key in enumerate(keys)})
    for key in keys:
        meta = _pinned(0) if key.startswith("pinned") else ObjectMeta(1, 0, pack_replica(0, 0))
        table.insert(key, meta)
    table.check_invariants()

    victims = chosen.select_victims(_judge_taking_all, 4)

    assert len(victims) == 4 and all(key.startswith("free") for key in victims)
    table.remove_many(victims)
    table.check_invariants()


def test_belady_takes_soft_pinned_objects_last_furthest_next_use_first_and_a_lapsed_pin_competes() -> None:
    policy = BeladyPolicy()
    table = ObjectTable(policy)
    policy.announce({"soon": (1, 0, 0), "late": (9, 0, 1), "free": (5, 0, 2), "lapsing": (7, 0, 3)})
    table.insert("lapsing", _pinned(-5_000))
    table.insert("soon", _pinned(0))
    table.insert("late", _pinned(0))
    table.insert("free", ObjectMeta(1, 0, pack_replica(0, 0)))
    assert policy.select_victims(_judge_taking_all, 1) == ["free"]
    table.remove_many(["free"])
    assert table.expire_soft_pins(5_000) == 1  # "lapsing" competes as unpinned from now on
    table.check_invariants()

    victims = policy.select_victims(_judge_taking_all, 10)
    assert victims == ["lapsing", "late", "soon"]
    table.remove_many(victims)
    table.check_invariants()
