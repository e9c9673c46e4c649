"""The master's wall clock steps (an NTP step, a VM restored from a snapshot): a node's
liveness is counted on the master's monotonic clock, not on its wall clock.

How: an in-process master whose wall clock the test steps (server.wall_clock_ms patched, as
tests/test_ha_edges.py does) and an in-process node over loopback sockets. A tick is waited
for with an asyncio.Event set by a wrapper of MasterService.tick; a node is made silent, its
link open, by holding its heartbeat in the look at its filesystems (HeldHeartbeats), so that
no heartbeat lands between the step and the tick the test looks at.

Also here (the master's counters, a pure MasterService as in tests/test_master_tiers.py): a
tier's evictions count only the replicas that left it.
"""

from __future__ import annotations

import asyncio
import logging
import time

import uvloop

from kvpool import AsyncStore
from kvpool.config import MasterConfig, NodeConfig
from kvpool.errors import ErrorCode
from kvpool.master import server as server_module
from kvpool.master.server import MasterServer
from kvpool.master.service import MasterService
from kvpool.node.server import Node
from kvpool.protocol.messages import TIER_DISK, TIER_DRAM
from tests.test_master_tiers import ack_drops, cluster, fill, run_moves, tiers, where

MIB = 1 << 20
HOUR_MS = 3_600_000
NODE_TTL_MS = 1_000


class SteppedWallClock:
    """The master's wall clock, stepped by `step_ms`."""

    def __init__(self) -> None:
        self.step_ms = 0

    def __call__(self) -> int:
        return time.time_ns() // 1_000_000 + self.step_ms


class HeldHeartbeats:
    """Patched over a node's look at its filesystems: holds its heartbeats there until
    released. `holding` is set once the node is held, its last heartbeat answered."""

    def __init__(self) -> None:
        self.holding, self.released = asyncio.Event(), asyncio.Event()

    async def __call__(self) -> dict:
        self.holding.set()
        await self.released.wait()
        return {}


def run(coroutine):
    return uvloop.run(asyncio.wait_for(coroutine, 30))


async def until(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def segment_state(master: MasterServer, segment_id: str) -> str | None:
    states = [seg.state for seg in master.service.segment_counters() if seg.segment_id == segment_id]
    return states[0] if states else None


async def master_and_node(monkeypatch, clock: SteppedWallClock, node_ttl_ms: int) -> tuple[MasterServer, Node]:
    monkeypatch.setattr(server_module, "wall_clock_ms", clock)
    master = MasterServer(MasterConfig(node_ttl_ms=node_ttl_ms), port=0, seed=1, debug_invariants=True)
    await master.start()
    node = Node(NodeConfig(master_endpoint=master.endpoint, memory_bytes=8 * MIB, heartbeat_interval_ms=100))
    await node.start()
    await node.wait_mounted(5_000)
    return master, node


def test_a_wall_clock_stepped_forward_past_the_node_ttl_drops_no_node(monkeypatch, caplog):
    """Stepped an hour forward, the master found every node silent for an hour at its next
    tick and dropped them with all their replicas: reads missed until the nodes re-mounted."""
    clock, held = SteppedWallClock(), HeldHeartbeats()
    states: list[str | None] = []  # the node's segment's state after each tick
    ticked = asyncio.Event()
    real_tick = MasterService.tick

    async def main():
        master, node = await master_and_node(monkeypatch, clock, node_ttl_ms=10_000)
        (segment_id,) = node._segment_ids()

        def tick(service, *args, **kwargs):
            real_tick(service, *args, **kwargs)
            states.append(segment_state(master, segment_id))
            ticked.set()

        monkeypatch.setattr(MasterService, "tick", tick)
        try:
            async with await AsyncStore.open(master.endpoint, shm_enabled=False) as store:
                await store.put("k", b"v" * 4096)
                monkeypatch.setattr(node, "_filesystems", held)
                await held.holding.wait()
                clock.step_ms = HOUR_MS
                ticked.clear()
                await ticked.wait()
                assert states[-1] == "active"
                assert await store.get("k") == b"v" * 4096
        finally:
            held.released.set()
            await node.stop()
            await master.stop()

    with caplog.at_level(logging.WARNING, logger="kvpool.master.service"):
        run(main())
    assert "silent for" not in caplog.text


def test_a_node_silent_before_the_wall_clock_stepped_back_is_dropped_after_its_ttl(monkeypatch):
    """Stepped an hour back, a node that had gone silent counted as heard for an hour more."""
    clock, held = SteppedWallClock(), HeldHeartbeats()

    async def main():
        master, node = await master_and_node(monkeypatch, clock, node_ttl_ms=NODE_TTL_MS)
        (segment_id,) = node._segment_ids()
        try:
            monkeypatch.setattr(node, "_filesystems", held)
            await held.holding.wait()
            clock.step_ms = -HOUR_MS
            await until(lambda: segment_state(master, segment_id) in (None, "leaving", "unmounted"), 5.0)
        finally:
            held.released.set()
            await node.stop()
            await master.stop()

    run(main())


def test_an_offload_that_found_the_filesystem_full_counts_no_eviction():
    """An offload whose filesystem was full keeps its object in DRAM, but the DRAM tier had
    counted its eviction when the offload began: kvpool_master_tier_evictions_total{tier="dram"}
    over-counted by every such offload (a counter cannot be taken back)."""
    svc = cluster()
    fill(svc)
    svc.tick(1)
    moved = run_moves(svc, 2, answer=lambda item: ErrorCode.NO_AVAILABLE_HANDLE)
    assert len(moved) == 3
    for _, item in moved:
        assert where(svc, item.key) == ["A"]
    status = tiers(svc)
    assert status[TIER_DISK]["failed_moves"] == 3
    assert status[TIER_DRAM]["evictions"] == 0
    assert ack_drops(svc, 2) == {}
