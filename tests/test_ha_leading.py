"""A new leader from the moment it wins: closed to puts and removes until its takeover, and
keeping its lease alive however long the election took.

How: a real etcd (the `etcd_endpoint` fixture, 127.0.0.1), masters, nodes and a client
in-process on one event loop over loopback sockets; etcd is made slow for one call by wrapping
the elector's etcd client (as a frozen member listed first would be: its request timeout,
1 s, before the next member answers).
"""

from __future__ import annotations

import asyncio

from kvpool import ReplicateConfig
from kvpool.client.store import AsyncStore
from kvpool.config import MasterConfig, NodeConfig
from kvpool.discovery import segments_key
from kvpool.master.election import ElectionConfig
from kvpool.master.server import MasterServer
from kvpool.node.server import Node
from kvpool.transports.etcd import EtcdClient
from tests.test_ha import _recorded, _wait_for, _wait_for_async, new_cluster_id, run


def _candidate(etcd_endpoint: str, cluster_id: str, lease_ttl_ms: int) -> MasterServer:
    election = ElectionConfig((etcd_endpoint,), cluster_id, lease_ttl_ms=lease_ttl_ms)
    return MasterServer(MasterConfig(), port=0, seed=1, election=election, debug_invariants=True)


def test_a_new_leader_takes_no_remove_while_it_reads_its_predecessors_record(etcd_endpoint, monkeypatch):
    """K has replicas on N1 and N2; the leader stops and B wins. While B reads the segment
    record (slow etcd), N1 re-mounts and a client removes K; N2 re-mounts after. B used to
    answer that remove as an open leader, on a service it then replaced, so K came back with
    N2. Now B is "recovering" from the moment it wins, the remove waits for N2, and N1's
    re-mount during the read counts."""

    async def main():
        cluster_id = new_cluster_id()
        address = f"etcd://{etcd_endpoint}/{cluster_id}"
        # A lease long enough for the slow read to fit in its bound (an interval: 2 s).
        first, second = _candidate(etcd_endpoint, cluster_id, 6_000), _candidate(etcd_endpoint, cluster_id, 6_000)
        await first.start()
        await _wait_for(lambda: first.role == "leader")
        await second.start()
        await _wait_for(lambda: second.elector.leader is not None)
        n1 = Node(NodeConfig(master_endpoint=address, memory_bytes=8 << 20))
        n2 = Node(NodeConfig(master_endpoint=address, memory_bytes=8 << 20))
        store = None
        try:
            for node in (n1, n2):
                await node.start()
                await node.wait_mounted(5_000)
            store = await AsyncStore.open(address)
            config = ReplicateConfig()
            config.replica_num = 2
            await store.put("k", b"old" * 100, config)
            async with EtcdClient([etcd_endpoint]) as etcd:
                both = sorted([n1.segment_id, n2.segment_id])
                await _wait_for_async(lambda: _recorded(etcd, cluster_id), lambda ids: sorted(ids) == both)

            etcd_get = second.elector._etcd.get

            async def slow_record_read(key, **kwargs):
                if key == segments_key(cluster_id):
                    await asyncio.sleep(0.8)
                return await etcd_get(key, **kwargs)

            resolve = n2._resolver.resolve

            async def late_resolve(timeout_ms):
                await asyncio.sleep(2.0)
                return await resolve(timeout_ms)

            monkeypatch.setattr(second.elector._etcd, "get", slow_record_read)
            monkeypatch.setattr(n2._resolver, "resolve", late_resolve)
            await first.stop()
            await _wait_for(lambda: second.elector.is_leader(), 5.0)
            assert second.role == "recovering"
            await _wait_for(lambda: second.service.has_segment(n1.segment_id), 5.0)
            assert second.role == "recovering" and not second.service.has_segment(n2.segment_id)
            await store.remove("k")  # answered once N2 is back: B then knows both replicas
            assert second.service.has_segment(n2.segment_id)
            assert second.service.has_segment(n1.segment_id)  # N1's re-mount in the read counted
            assert await store.get("k") is None
        finally:
            if store is not None:
                await store.aclose()
            await n1.stop()
            await n2.stop()
            await second.stop()
            await first.stop()

    run(main())


def test_a_leader_elected_slowly_keeps_its_lease(etcd_endpoint, monkeypatch):
    """The step-down deadline runs from the grant's send (TTL - margin: 2 s at the minimum TTL,
    3 s); the first keepalive was due a TTL/3 after the leader began to lead. A grant that took
    a frozen member's request timeout (1.05 s) left it stepping down at 2 s without having sent
    any, then winning again: a failover for nothing."""
    grants = []

    async def main():
        master = _candidate(etcd_endpoint, new_cluster_id(), 3_000)
        grant_lease = EtcdClient.grant_lease

        async def slow_first_grant(self, ttl_ms):
            grants.append(ttl_ms)
            if len(grants) == 1:
                await asyncio.sleep(1.05)
            return await grant_lease(self, ttl_ms)

        monkeypatch.setattr(EtcdClient, "grant_lease", slow_first_grant)
        deposed = []
        monkeypatch.setattr(master, "deposed", lambda reason: deposed.append(reason))
        await master.start()
        try:
            await _wait_for(lambda: master.elector.is_leader(), 5.0)
            term = master.elector.leadership.term
            await asyncio.sleep(2.0)  # past the first deadline (grant sent + 2 s)
            assert deposed == [] and master.elector.is_leader()
            assert master.elector.leadership.term == term
        finally:
            monkeypatch.undo()
            await master.stop()

    run(main())
