"""What the store promises under leader failovers, checked on recorded histories of an HA cluster
(tests/history_ha.py: a real etcd, master candidates, nodes and clients given etcd://): a short
seeded run under every HA fault, and the regressions it led to, each reproduced narrowly."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable

import pytest

from kvpool import ErrorCode, ReplicateConfig
from kvpool.client.store import AsyncStore
from kvpool.config import NodeConfig
from kvpool.errors import NotLeader
from kvpool.node.server import Node
from kvpool.protocol.messages import DropObjects, Remove
from kvpool.transports.connection import connect
from kvpool.transports.etcd import EtcdClient
from tests.history_check import run_checked
from tests.history_ha import HA_FAULTS, HAHistoryRun, call_bound_ms, check_ha
from tests.test_ha import _candidate, _recorded, _wait_for, _wait_for_async, new_cluster_id, run


def test_a_remove_whose_drops_the_term_could_not_send_is_refused(etcd_endpoint, monkeypatch):
    """A remove's drops wait behind a node slow to answer the ones before them, and the leader
    loses etcd meanwhile: once past its deadline its term sends no drop, yet the remove was
    answered as done, with the object still on its node; the next leader took it back as the
    node re-mounted, a removed key back. Now it is NotLeader ("nothing was done"): a client
    retries on the leader, whose remove reaches the node."""

    monkeypatch.setattr("kvpool.master.server.REMOVE_DROPS_WAIT_MS", 60_000)  # waits for the drops, not a bound

    async def main():
        cluster_id = new_cluster_id()
        address = f"etcd://{etcd_endpoint}/{cluster_id}"
        master = _candidate(etcd_endpoint, cluster_id)
        await master.start()
        node = Node(NodeConfig(master_endpoint=address, memory_bytes=8 << 20))
        store = conn = None
        try:
            await _wait_for(lambda: master.role == "leader")
            await node.start()
            await node.wait_mounted(5_000)
            store = await AsyncStore.open(address)
            for key in ("first", "second"):
                await store.put(key, b"x" * 1000, ReplicateConfig())
            async with EtcdClient([etcd_endpoint]) as etcd:  # the next term waits for the node
                await _wait_for_async(lambda: _recorded(etcd, cluster_id), lambda ids: ids == [node.segment_id])
            released, held = asyncio.Event(), asyncio.Event()
            dispatch = node._master_calls._dispatch

            def slow_drops(conn, message):  # the node answers drops once released
                if not isinstance(message, DropObjects) or released.is_set():
                    return dispatch(conn, message)
                held.set()

                async def later():
                    await released.wait()
                    result = dispatch(conn, message)
                    return await result if isinstance(result, Awaitable) else result

                return later()

            monkeypatch.setattr(node._master_calls, "_dispatch", slow_drops)
            first = asyncio.ensure_future(store.batch_remove(["first"]))
            await asyncio.wait_for(held.wait(), 5)
            conn = await connect(master.endpoint, key=None)
            second = asyncio.ensure_future(conn.request(Remove(["second"])))
            await _wait_for(lambda: master._unsent_drops)  # queued behind the first's drops

            # etcd stops answering: the elector waits on a keepalive, the deadline passes.
            etcd_back = asyncio.Event()
            elector = master.elector
            keep_alive = elector._etcd.keep_alive

            async def keepalive_unanswered(*args, **kwargs):
                await etcd_back.wait()
                return await keep_alive(*args, **kwargs)

            monkeypatch.setattr(elector._etcd, "keep_alive", keepalive_unanswered)
            frozen_at = elector._clock_ms()
            elector._clock_ms = lambda: frozen_at + elector.config.lease_ttl_ms
            assert master.role == "standby"
            released.set()
            assert await first == [0]  # its drops went out in its term: done
            with pytest.raises(NotLeader):
                await second
            assert "second" in node.inventory  # nothing was done
            conn.close()

            # The leader steps down and is elected again; the node re-mounts with what it holds.
            etcd_back.set()
            await _wait_for(lambda: master.role == "leader", 15)
            assert await store.batch_remove(["second"]) == [0]
            assert "second" not in node.inventory
            assert await store.get("second") is None
        finally:
            if store is not None:
                await store.aclose()
            if conn is not None:
                conn.close()
            await node.stop()
            await master.stop()

    run(main())


def test_a_remove_after_the_takeover_opened_on_its_grace_reaches_the_nodes_back_later(etcd_endpoint):
    """The leader stops; its node finds the successor late (a frozen leader's nodes notice when
    a heartbeat times out, 5 s, after the successor's grace, 3 s). The successor opens on its
    grace and takes a remove of an object it does not know yet: the node re-mounted with it and
    the removed key was back (the history checker: 22 keys in a 3-minute run of frozen leaders).
    Now a new leader refuses, from a segment mounting for the first time in its term, the
    objects its removes named (for as long as such a node may take), as a restarted single
    master does."""

    async def main():
        cluster_id = new_cluster_id()
        address = f"etcd://{etcd_endpoint}/{cluster_id}"
        first = _candidate(etcd_endpoint, cluster_id, remount_grace_ms=300)
        second = _candidate(etcd_endpoint, cluster_id, remount_grace_ms=300)
        await first.start()
        await _wait_for(lambda: first.role == "leader")
        await second.start()
        await _wait_for(lambda: second.elector.leader is not None)
        node = Node(NodeConfig(master_endpoint=address, memory_bytes=8 << 20))
        store = None
        try:
            await node.start()
            await node.wait_mounted(5_000)
            store = await AsyncStore.open(address)
            await store.put("removed", b"old" * 100, ReplicateConfig())
            await store.put("kept", b"kept" * 100, ReplicateConfig())
            async with EtcdClient([etcd_endpoint]) as etcd:  # the successor will wait for the node
                await _wait_for_async(lambda: _recorded(etcd, cluster_id), lambda ids: ids == [node.segment_id])
            found_again = asyncio.Event()
            resolve = node._resolver.resolve

            async def late_resolve(timeout_ms):
                await found_again.wait()
                return await resolve(timeout_ms)

            node._resolver.resolve = late_resolve
            await first.stop()
            await _wait_for(lambda: second.role == "leader", 5.0)  # opened on its grace
            assert not second.service.has_segment(node.segment_id)
            assert await store.batch_remove(["removed"]) == [ErrorCode.OBJECT_NOT_FOUND]  # not known yet
            found_again.set()
            await _wait_for(lambda: second.service.has_segment(node.segment_id), 10.0)
            assert await store.get("removed") is None
            assert await store.batch_exists(["removed", "kept"]) == [False, True]
            assert "removed" not in node.inventory
            assert await store.get("kept") == b"kept" * 100
        finally:
            if store is not None:
                await store.aclose()
            await node.stop()
            await second.stop()
            await first.stop()

    run(main())


def test_history_of_an_ha_cluster_under_failovers_keeps_the_promises(tmp_path) -> None:
    """A seeded run of three clients on etcd:// while the leader is killed (and a candidate
    started again), frozen past its lease and woken stale, stopped gracefully, etcd frozen for
    a moment, a node killed and restarted and a client killed: the checker's properties, and
    no acknowledged put missing without a cause, every call within its documented bound,
    every failover over within its bound, one leader per term."""
    seed = int(os.environ.get("KVPOOL_HISTORY_SEED", "5"))
    run_ = HAHistoryRun(tmp_path, seed=seed, duration_s=12, fault_gap_s=0.5)
    violations, report, _ = run_checked(run_, check_ha, "ha-report.json")
    assert violations == [], report
    assert report["ha_faults"] == sorted(HA_FAULTS), report  # the run did inject every fault
    assert report["terms"] >= 4, report  # the first leader and three failovers at least
    assert report["reads"] > 100 and report["longest_ms"] < call_bound_ms("put"), report
