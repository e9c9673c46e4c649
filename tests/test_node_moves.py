"""The node's Mover (node/moves.py) against a real segment and disk tier: a request whose copies
finish after its deadline records nothing and leaves no file, and a promotion of a key whose
old DRAM entry's drop has not come yet records the new place."""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from kvpool.errors import ErrorCode
from kvpool.node.disk import DiskTier
from kvpool.node.inventory import Inventory
from kvpool.node.metrics import NodeMetrics, TierMetrics
from kvpool.node.moves import Mover
from kvpool.node.segment import Segment
from kvpool.protocol.messages import InventoryEntry, MoveItem, MoveObjects

MIB = 1 << 20
SIZE = 64 * 1024


class Tiers:
    """A node's DRAM segment and disk tier, and a Mover over them whose clock (the master's,
    as the node estimates it) the test sets."""

    def __init__(self, root: Path) -> None:
        (root / "shm").mkdir()
        self.segment = Segment.create(str(root / "shm"), "n1", 4 * MIB, secrets.token_bytes(16))
        self.inventory = Inventory(self.segment.capacity_bytes)
        self.disk = DiskTier.open(root / "disk", 16 * MIB, "n1", is_durable=False)
        self.now_ms = 1_000
        self.mover = Mover(
            self.segment, "n1-dram", self.inventory, self.disk, None, TierMetrics(NodeMetrics().registry),
            is_durable=False, clock_ms=lambda: self.now_ms,
        )  # fmt: skip

    def in_dram(self, key: str, offset: int) -> InventoryEntry:
        data = os.urandom(SIZE)
        self.segment.data[offset : offset + SIZE] = data
        entry = InventoryEntry(key, offset, SIZE, xxhash.xxh3_64_intdigest(data))
        self.inventory.add([entry])
        return entry

    def on_disk(self, key: str, offset: int, data: bytes | None = None) -> InventoryEntry:
        data = os.urandom(SIZE) if data is None else data
        entry = InventoryEntry(key, offset, SIZE, xxhash.xxh3_64_intdigest(data))
        self.disk.publish(entry, self.disk.write_temporary(entry, [memoryview(data)]))
        self.disk.record([entry])
        return entry

    def offload(self, entry: InventoryEntry, to_offset: int) -> MoveItem:
        return MoveItem(entry.key, SIZE, entry.checksum, "n1-dram", entry.offset, self.disk.segment_id, to_offset)

    def promote(self, entry: InventoryEntry, to_offset: int) -> MoveItem:
        return MoveItem(entry.key, SIZE, entry.checksum, self.disk.segment_id, entry.offset, "n1-dram", to_offset)

    def close(self) -> None:
        self.mover.close()
        self.disk.close()
        self.segment.close()


@pytest.fixture
def tiers(tmp_path: Path) -> Iterator[Tiers]:
    made = Tiers(tmp_path)
    yield made
    made.close()


def test_copies_that_finish_after_the_deadline_are_not_recorded_and_leave_no_file(tiers: Tiers) -> None:
    """The master gives up on a MoveObjects a little after its deadline and drops the targets
    before reusing their ranges: a copy recorded later would be an entry in a range the master
    hands out again (a put there refused as a stale grant), or a file no one accounts for."""
    hot = tiers.in_dram("hot", 0)
    cold = tiers.on_disk("cold", 0)
    items = [tiers.offload(hot, 4 * MIB), tiers.promote(cold, MIB)]

    real_plan = tiers.mover._plan

    def slow_plan(item: MoveItem):
        plan = real_plan(item)
        copy = plan.copy

        def copy_past_the_deadline() -> None:
            copy()
            tiers.now_ms = 3_000  # the copy took longer than the master waits

        plan.copy = copy_past_the_deadline
        return plan

    tiers.mover._plan = slow_plan  # type: ignore[method-assign]
    reply = asyncio.run(tiers.mover.move(MoveObjects(items, deadline_ms=2_000)))
    assert reply.codes == [ErrorCode.TRANSFER_FAIL] * 2
    assert tiers.disk.entry_at("hot", 4 * MIB) is None and not tiers.disk.path_of(4 * MIB).exists()
    assert tiers.inventory.get("cold") is None  # the promotion's DRAM range is left free
    assert tiers.inventory.get("hot") == hot and tiers.disk.entry_at("cold", 0) == cold  # sources kept


def test_a_request_that_finishes_in_time_is_recorded(tiers: Tiers) -> None:
    hot = tiers.in_dram("hot", 0)
    reply = asyncio.run(tiers.mover.move(MoveObjects([tiers.offload(hot, 4 * MIB)], deadline_ms=2_000)))
    assert reply.codes == [ErrorCode.OK]
    assert tiers.disk.entry_at("hot", 4 * MIB) is not None and tiers.disk.path_of(4 * MIB).exists()


def test_a_promotion_of_a_key_whose_old_dram_entry_is_still_held_records_the_new_place(tiers: Tiers) -> None:
    """The master evicted the key from DRAM (its drop goes in the background, behind others)
    and promotes it back from disk to another range before the node got the drop: the new
    entry replaces the old one, and the late drop of the old one then matches nothing."""
    old = tiers.in_dram("k", 0)
    on_disk = tiers.on_disk("k", 0, bytes(tiers.segment.data[:SIZE]))  # offloaded before the eviction
    reply = asyncio.run(tiers.mover.move(MoveObjects([tiers.promote(on_disk, MIB)])))
    assert reply.codes == [ErrorCode.OK]
    held = tiers.inventory.get("k")
    assert held is not None and held.offset == MIB
    assert tiers.inventory.drop([old]) == []  # the old entry's drop, when it comes
    assert tiers.inventory.get("k") == held
