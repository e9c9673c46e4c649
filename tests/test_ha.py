"""High availability on etcd: the election's fence, discovery, takeover, and failover.

How: the pure parts (Leadership deadlines, Takeover, address parsing) with `now_ms` passed in;
the etcd client and the election against a real etcd started by the `etcd_endpoint` fixture
(127.0.0.1, free ports, its own data dir); masters in-process on one event loop for the
election's rules, and as real processes for what only a real process shows: a leader frozen
by SIGSTOP that wakes up after a successor took over must refuse the request that waited in
its socket, and clients and nodes given etcd:// follow a failover by themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
import time

import pytest
import uvloop
from conftest import python_child, wait_until

from kvpool import ErrorCode, ReplicateConfig
from kvpool.client.store import AsyncStore
from kvpool.config import MasterConfig, NodeConfig
from kvpool.discovery import (
    LeaderRecord,
    MasterResolver,
    decode_segments_record,
    encode_segments_record,
    leader_key,
    parse_master_address,
    segments_key,
)
from kvpool.errors import (
    ConnectFailed,
    CoordinationError,
    InvalidParams,
    KVPoolError,
    NotLeader,
    RpcFailed,
    RpcTimeout,
    error_from_code,
)
from kvpool.master.election import ElectionConfig, Elector, Leadership, Role
from kvpool.master.server import MasterServer
from kvpool.master.takeover import Takeover
from kvpool.node.server import Node
from kvpool.protocol.auth import Keyring
from kvpool.protocol.messages import ClusterStatus, PutStart
from kvpool.transports.connection import connect
from kvpool.transports.etcd import EtcdClient, parse_etcd_endpoints
from tests.test_cluster import kvpool_cli

TTL_MS = 3_000  # Short leases keep these tests quick; the chaos suite runs the 5 s default.


def run(coroutine):
    return uvloop.run(asyncio.wait_for(coroutine, 60))


def new_cluster_id() -> str:
    """A cluster id no other test of this session's etcd uses. Random, not a count: this module
    is imported twice in a worker (as test_ha, collected, and as tests.test_ha by the other HA
    test files), each copy with a count of its own, and two tests in one worker were given one
    id: the second met the first's records in etcd (its mark of another token: the master
    would not stand, and the test timed out waiting for a leader)."""
    return f"ha-{os.getpid()}-{secrets.token_hex(4)}"


# --- pure ---------------------------------------------------------------------------------------


def test_a_master_that_answers_not_leader_all_along_yields_not_leader(monkeypatch):
    """MasterLink's retries stop with enough of the bound left for a real attempt: a lookup
    squeezed into the last milliseconds used to time out and replace the master's answer
    (NotLeader) with an RpcTimeout (test_new_leader_waits_..., flaky under load)."""
    from kvpool.client.pool import MasterLink

    class Recovering:  # a master still waiting for its nodes: refuses every put
        def is_closed(self) -> bool:
            return False

        async def request(self, message, timeout_ms, late_reply=None):
            await asyncio.sleep(0.002)
            raise NotLeader("recovering: waiting for the nodes to re-mount")

    class EtcdLookup:  # answers in ~10 ms; given less, it times out like the real one
        is_dynamic = True

        async def resolve(self, timeout_ms: int) -> str:
            await asyncio.sleep(min(timeout_ms, 10) / 1000)
            if timeout_ms < 10:
                raise RpcTimeout(f"etcd did not answer within {timeout_ms} ms")
            return "127.0.0.1:1"

        def forget(self) -> None:
            pass

    async def main() -> list[str]:
        outcomes = []
        # Full backoffs (50, 100 ms...) and bounds a few ms apart: some calls have only a sliver
        # of their bound left after a backoff, which is the case that went wrong.
        for rpc_timeout_ms in range(40, 112, 3):
            link = MasterLink("etcd://127.0.0.1:1/x", Keyring(), 100, rpc_timeout_ms, prefer_local=False)
            link._resolver = EtcdLookup()  # type: ignore[assignment]
            link._conn, link._conn_endpoint = Recovering(), "127.0.0.1:1"  # type: ignore[assignment]
            try:
                await link.call(PutStart(["k"], [1], ReplicateConfig()), is_idempotent=False)
            except (NotLeader, RpcTimeout) as exc:
                outcomes.append(type(exc).__name__)
        return outcomes

    monkeypatch.setattr("kvpool.client.pool.random.randrange", lambda n: n - 1)
    assert set(run(main())) == {"NotLeader"}


def test_leadership_ends_margin_before_the_lease_can_lapse():
    leadership = Leadership(step_down_margin_ms=1_000)
    assert not leadership.is_leader(0)
    leadership.elect(lease_id=7, term=3, ttl_ms=5_000, sent_ms=100)
    assert leadership.role is Role.LEADER and leadership.term == 3
    assert leadership.is_leader(4_099)
    assert not leadership.is_leader(4_100)  # sent + ttl - margin
    assert leadership.remaining_ms(4_100) == 0
    leadership.renew(ttl_ms=5_000, sent_ms=3_000)
    assert leadership.is_leader(6_999) and not leadership.is_leader(7_000)
    leadership.renew(ttl_ms=5_000, sent_ms=1_000)  # a late answer never shortens the deadline
    assert leadership.is_leader(6_999)
    leadership.step_down()
    assert leadership.role is Role.STANDBY and not leadership.is_leader(0)
    with pytest.raises(AssertionError):
        leadership.renew(5_000, 8_000)


def _takeover(expected, elected_ms: int, grace_ms: int) -> Takeover:
    takeover = Takeover(elected_ms, grace_ms)
    takeover.expect(expected)
    return takeover


def test_takeover_opens_when_the_recorded_segments_remount_or_at_the_grace():
    takeover = _takeover(["a", "b"], elected_ms=1_000, grace_ms=3_000)
    assert not takeover.is_open(1_000) and takeover.waiting_count() == 2
    takeover.mounted("a")
    takeover.mounted("x")  # a node nobody waited for
    assert not takeover.is_open(3_999)
    takeover.mounted("b")
    assert takeover.is_open(1_001)
    late = _takeover(["a"], elected_ms=1_000, grace_ms=3_000)
    assert not late.is_open(3_999) and late.remaining_ms(3_000) == 1_000
    assert late.is_open(4_000) and late.is_open(0)  # open stays open
    assert _takeover([], 0, 3_000).is_open(0)  # a first leader waits for nobody
    unknown = _takeover(None, 0, 3_000)  # the record could not be read: the whole grace
    unknown.mounted("a")
    assert not unknown.is_open(2_999) and unknown.is_open(3_000)


def test_takeover_is_closed_until_the_record_is_read_and_counts_mounts_from_the_election():
    """A new leader takes no put nor remove while it reads its predecessor's record, and a
    segment that re-mounted meanwhile counts: it will not mount again."""
    takeover = Takeover(elected_ms=1_000, grace_ms=3_000)
    takeover.mounted("a")
    assert not takeover.is_open(1_500) and takeover.waiting_count() == -1  # even with nothing recorded
    takeover.expect(["a", "b"])
    assert not takeover.is_open(1_500) and takeover.waiting_count() == 1
    takeover.mounted("b")
    assert takeover.is_open(1_500)
    early = Takeover(elected_ms=1_000, grace_ms=3_000)
    early.mounted("a")
    early.expect(["a"])  # every recorded segment is back already
    assert early.is_open(1_000)
    pending = Takeover(elected_ms=1_000, grace_ms=3_000)
    assert pending.is_open(4_000)  # the grace bounds the read too
    with pytest.raises(AssertionError):
        early.expect([])


def test_master_addresses_parse():
    fixed = parse_master_address("10.0.0.1:50051")
    assert not fixed.is_etcd and fixed.endpoint == "10.0.0.1:50051"
    ha = parse_master_address("etcd://e1:2379,e2:2379/prod-a")
    assert ha.etcd_endpoints == ("e1:2379", "e2:2379") and ha.cluster_id == "prod-a"
    assert str(ha) == "etcd://e1:2379,e2:2379/prod-a" and ha.probe_host == "e1"
    assert parse_master_address("etcd://e1:2379").cluster_id == "default"
    for bad in ("nope", "host:", "etcd://", "etcd://e1/../x", "etcd://e1:99999/c", "h:0", "a:1,b:2", "a b:1", "http://a:1"):
        with pytest.raises(InvalidParams):
            parse_master_address(bad)
    assert parse_etcd_endpoints("http://a:1, b:2") == ("a:1", "b:2")


def test_records_round_trip_and_garbage_is_a_coordination_error():
    record = LeaderRecord("127.0.0.1:1", "127.0.0.1:2", "abc")
    assert LeaderRecord.decode(record.encode()) == record
    assert decode_segments_record(encode_segments_record(4, ["b", "a"])) == ["a", "b"]
    for garbage in (b"", b"[]", b"{\"x\": 1}", b"\xff"):
        with pytest.raises(CoordinationError):
            LeaderRecord.decode(garbage)
        with pytest.raises(CoordinationError):
            decode_segments_record(garbage)
    assert isinstance(error_from_code(int(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS)), NotLeader)


# --- the etcd client ------------------------------------------------------------------------


def test_etcd_client_reads_a_reply_that_comes_in_pieces():
    """A large reply (the segments record of a big cluster) crosses a real network in several
    pieces: the client reads it whole, and a reply past the size bound is an error."""
    import base64
    import json

    from kvpool import limits

    def body_of(value_size: int) -> bytes:
        value = base64.b64encode(b"x" * value_size).decode()
        kv = {"key": base64.b64encode(b"k").decode(), "value": value, "create_revision": "3", "mod_revision": "3"}
        return json.dumps({"header": {"revision": "7"}, "kvs": [kv]}).encode()

    async def run(value_size: int):
        body = body_of(value_size)

        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
            writer.write(b"Content-Length: %d\r\n\r\n" % len(body) + body[:1000])
            await writer.drain()
            await asyncio.sleep(0.05)  # the rest comes later, as a second segment would
            writer.write(body[1000:])
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        try:
            async with EtcdClient([f"127.0.0.1:{server.sockets[0].getsockname()[1]}"]) as etcd:
                return await etcd.get(b"k")
        finally:
            server.close()

    found, _ = asyncio.run(run(20_000))
    assert found is not None and found.value == b"x" * 20_000
    with pytest.raises(CoordinationError, match="larger than"):
        asyncio.run(run(limits.ETCD_RESPONSE_SIZE_BYTES_MAX))


def test_etcd_client_create_fence_lease_and_watch(etcd_endpoint):
    key = leader_key(new_cluster_id())

    async def main():
        # The first endpoint is down: requests go on to the next one.
        async with EtcdClient(["127.0.0.1:1", etcd_endpoint]) as etcd:
            assert (await etcd.get(key))[0] is None
            lease, ttl_ms = await etcd.grant_lease(TTL_MS)
            assert ttl_ms >= TTL_MS
            created, _, revision = await etcd.create(key, b"one", lease_id=lease)
            assert created
            created, holder, _ = await etcd.create(key, b"two", lease_id=lease)
            assert not created and holder.value == b"one" and holder.lease_id == lease
            assert await etcd.put_if_held(key, lease, key + b"/x", b"ok")
            assert not await etcd.put_if_held(key, lease + 1, key + b"/x", b"fenced")
            assert (await etcd.get(key + b"/x"))[0].value == b"ok"
            assert not await etcd.wait_for_change(key, revision, 200)  # nothing happens: timeout
            waiter = asyncio.ensure_future(etcd.wait_for_change(key, revision, 5_000))
            await asyncio.sleep(0.2)
            await etcd.revoke_lease(lease)
            assert await waiter
            assert (await etcd.get(key))[0] is None
            assert await etcd.keep_alive(lease) == 0  # a revoked lease is gone
            await etcd.revoke_lease(lease)  # and revoking it again is no error

    run(main())


# --- election, in-process ----------------------------------------------------------------------


def _candidate(etcd_endpoint: str, cluster_id: str, lease_ttl_ms: int = TTL_MS, **config) -> MasterServer:
    election = ElectionConfig((etcd_endpoint,), cluster_id, lease_ttl_ms=lease_ttl_ms)
    return MasterServer(MasterConfig(**config), port=0, seed=1, election=election,
                        debug_invariants=True)  # fmt: skip


async def _stood_down_by_an_etcd_outage(master: MasterServer, monkeypatch) -> Elector:
    """Once `master` leads, fail its every etcd call until it stands by; its elector."""
    await _wait_for(lambda: master.role == "leader")
    elector = master.elector

    async def etcd_down(*args, **kwargs):
        raise ConnectFailed("etcd is down (test)")

    for call in ("keep_alive", "grant_lease", "revoke_lease", "create"):
        monkeypatch.setattr(elector._etcd, call, etcd_down)
    await _wait_for(lambda: master.role == "standby", 10.0)
    return elector


async def _wait_for(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def test_one_leader_standby_refuses_and_takes_over_when_the_leader_stops(etcd_endpoint):
    cluster_id = leader = None

    async def main():
        nonlocal cluster_id, leader
        cluster_id = new_cluster_id()
        # A lease far longer than a hand-over: one that waited for it to lapse would show.
        first, second = (_candidate(etcd_endpoint, cluster_id, lease_ttl_ms=30_000) for _ in range(2))
        await first.start()
        await _wait_for(lambda: first.role == "leader")
        await second.start()
        await _wait_for(lambda: second.elector.leader is not None)
        assert second.role == "standby"

        def role_of(master) -> str:  # what /metrics says: a standby's empty figures read as its
            samples = {role: master.metrics.registry.get_sample_value("kvpool_master_role", {"role": role})
                       for role in ("single", "leader", "recovering", "standby")}  # fmt: skip
            (role,) = [role for role, value in samples.items() if value == 1]
            return role

        assert (role_of(first), role_of(second)) == ("leader", "standby")
        address = f"etcd://{etcd_endpoint}/{cluster_id}"
        node = Node(NodeConfig(master_endpoint=address, memory_bytes=8 << 20))
        await node.start()
        try:
            await node.wait_mounted(5_000)
            conn = await connect(second.endpoint, key=None)
            with pytest.raises(NotLeader, match="the leader is"):
                await conn.request(ClusterStatus())
            conn.close()
            store = await AsyncStore.open(address)
            try:
                await store.put("k", b"v" * 1000, ReplicateConfig())
                await first.stop()  # revokes its lease: no waiting for it to lapse
                started = time.monotonic()
                await _wait_for(lambda: second.role == "leader", 15.0)
                assert time.monotonic() - started < 15.0  # against the 30 s the lease had left
                assert role_of(second) == "leader"
                # The node re-mounts by itself; the store finds the new leader by itself.
                await _wait_for(lambda: second.service.object_count == 1, 5.0)
                assert await store.get("k") == b"v" * 1000
                await store.put("k2", b"w" * 1000, ReplicateConfig())
                assert await store.get("k2") == b"w" * 1000
            finally:
                await store.aclose()
        finally:
            await node.stop()
            await second.stop()
            await first.stop()

    run(main())


def test_a_leader_stopped_before_it_started_leading_refuses_once_its_lease_is_revoked(etcd_endpoint, monkeypatch):
    """A SIGTERM while the just-elected leader reads its predecessor's segment record: stop()
    revoked its lease (a standby may win at once) but left it answering as the leader until
    its deadline, requests still coming in while the server closed."""

    reading = asyncio.Event()

    async def slow_read(self):
        reading.set()
        await asyncio.sleep(30)

    monkeypatch.setattr(Elector, "_read_expected", slow_read)

    async def main() -> tuple[bool, bool]:
        master = _candidate(etcd_endpoint, new_cluster_id())
        await master.start()
        try:
            await asyncio.wait_for(reading.wait(), 10)
            was_leader = master.elector.is_leader()
            await master.elector.stop()
            return was_leader, master.elector.is_leader()
        finally:
            await master.stop()

    was_leader, is_leader = run(main())
    assert was_leader and not is_leader


def test_a_leader_past_its_deadline_refuses_before_its_elector_notices(etcd_endpoint):
    """The fence is the clock: a paused process's first act on waking is to check it."""

    async def main():
        master = _candidate(etcd_endpoint, new_cluster_id())
        await master.start()
        try:
            await _wait_for(lambda: master.role == "leader")
            conn = await connect(master.endpoint, key=None)
            await conn.request(ClusterStatus())
            elector = master.elector
            frozen_at = elector._clock_ms()
            # As if the process had been stopped for a whole lease: the elector's task has not
            # run yet, but the next request is already refused.
            elector._clock_ms = lambda: frozen_at + TTL_MS
            assert master.role == "standby"
            with pytest.raises(NotLeader):
                await conn.request(PutStart(["k"], [10], ReplicateConfig(), "h"))
            conn.close()
        finally:
            await master.stop()

    run(main())


def test_a_master_finding_its_own_previous_term_in_etcd_takes_the_lead_again(etcd_endpoint, monkeypatch):
    """etcd goes down: the leader steps down and cannot revoke its lease; etcd comes back with
    the leader key (a restarted etcd keeps leases, their TTL refreshed). The key names this very
    master: it revokes that lease and leads again, instead of standing by until the lease lapses
    while answering "not the leader ...; the leader is <itself>"."""

    async def main():
        cluster_id = new_cluster_id()
        master = _candidate(etcd_endpoint, cluster_id)
        await master.start()
        try:
            elector = await _stood_down_by_an_etcd_outage(master, monkeypatch)
            async with EtcdClient([etcd_endpoint]) as etcd:  # what the restarted etcd holds
                lease, _ = await etcd.grant_lease(60_000)
                await etcd.put(leader_key(cluster_id), elector.record.encode(), lease_id=lease)
                monkeypatch.undo()  # etcd is back
                await _wait_for(lambda: master.role == "leader", 10.0)
                kv, _ = await etcd.get(leader_key(cluster_id))
                assert kv is not None and kv.lease_id != lease
        finally:
            await master.stop()

    run(main())


def test_a_master_whose_own_stale_term_it_cannot_revoke_waits_for_the_lease_to_lapse(etcd_endpoint, monkeypatch):
    """As above, but etcd refuses to revoke that lease: the master campaigned again at once,
    granting a lease and failing the revoke in a loop as fast as etcd answered. It now waits
    for the key to change (the stale lease to lapse), then leads."""

    async def main():
        cluster_id = new_cluster_id()
        master = _candidate(etcd_endpoint, cluster_id)
        await master.start()
        try:
            etcd_client = master.elector._etcd
            grant_lease, revoke_lease = etcd_client.grant_lease, etcd_client.revoke_lease
            elector = await _stood_down_by_an_etcd_outage(master, monkeypatch)
            async with EtcdClient([etcd_endpoint]) as etcd:  # what the restarted etcd holds
                stale, _ = await etcd.grant_lease(3_000)
                await etcd.put(leader_key(cluster_id), elector.record.encode(), lease_id=stale)
                grants = []

                async def counted_grant(*args, **kwargs):
                    grants.append(time.monotonic())
                    return await grant_lease(*args, **kwargs)

                async def refused_revoke(lease_id):
                    if lease_id == stale:
                        raise ConnectFailed("etcd refuses this revoke (test)")
                    return await revoke_lease(lease_id)

                monkeypatch.undo()  # etcd is back, but for that revoke
                monkeypatch.setattr(etcd_client, "grant_lease", counted_grant)
                monkeypatch.setattr(etcd_client, "revoke_lease", refused_revoke)
                await asyncio.sleep(1.0)
                assert master.role != "leader"
                assert len(grants) <= 3, f"{len(grants)} leases granted in a second"
                await _wait_for(lambda: master.role == "leader", 10.0)  # the stale lease lapsed
        finally:
            await master.stop()

    run(main())


def test_new_leader_waits_for_the_recorded_nodes_before_taking_puts(etcd_endpoint):
    async def main():
        cluster_id = new_cluster_id()
        address = f"etcd://{etcd_endpoint}/{cluster_id}"
        async with EtcdClient([etcd_endpoint]) as etcd:
            # The previous leader recorded a node that is not coming back.
            await etcd.put(segments_key(cluster_id), encode_segments_record(1, ["gone-node-1234"]))
        master = _candidate(etcd_endpoint, cluster_id, remount_grace_ms=1_500)
        await master.start()
        try:
            await _wait_for(lambda: master.role in ("recovering", "leader"))
            assert master.role == "recovering"
            store = await AsyncStore.open(address, rpc_timeout_ms=300, connect_timeout_ms=300)
            try:
                # Reads are served at once; a put is refused (NotLeader: nothing was done).
                assert await store.get("absent") is None
                with pytest.raises(NotLeader, match="re-mount"):
                    await store.put("early", b"x")
                await _wait_for(lambda: master.role == "leader", 3.0)
            finally:
                await store.aclose()
            node = Node(NodeConfig(master_endpoint=address, memory_bytes=8 << 20))
            await node.start()
            await node.wait_mounted(5_000)
            store = await AsyncStore.open(address)
            try:
                await store.put("late", b"y" * 100)
                assert await store.get("late") == b"y" * 100
                # The leader records its live segments for its successor (fenced by its lease).
                async with EtcdClient([etcd_endpoint]) as etcd:
                    await _wait_for_async(
                        lambda: _recorded(etcd, cluster_id), lambda ids: ids == [node.segment_id]
                    )
            finally:
                await store.aclose()
                await node.stop()
        finally:
            await master.stop()

    run(main())


def test_the_segment_record_follows_mounts_and_unmounts_between_keepalives(etcd_endpoint):
    """A successor waits, up to the re-mount grace, for every segment the record names. The
    record was written at keepalives only: a node gone just before the leader died held a
    failover for the whole grace (8.1 s in the chaos suite, 10 s allowed). With keepalives
    10 s apart here, the record must follow within a second either way."""

    async def main():
        cluster_id = new_cluster_id()
        address = f"etcd://{etcd_endpoint}/{cluster_id}"
        election = ElectionConfig((etcd_endpoint,), cluster_id, lease_ttl_ms=30_000)
        master = MasterServer(MasterConfig(), port=0, seed=1, election=election, debug_invariants=True)
        await master.start()
        try:
            await _wait_for(lambda: master.role == "leader")
            async with EtcdClient([etcd_endpoint]) as etcd:
                node = Node(NodeConfig(master_endpoint=address, memory_bytes=8 << 20))
                await node.start()
                await node.wait_mounted(5_000)
                await _wait_for_async(lambda: _recorded(etcd, cluster_id), lambda ids: ids == [node.segment_id], 1.0)
                await node.stop()
                await _wait_for_async(lambda: _recorded(etcd, cluster_id), lambda ids: ids == [], 1.0)
        finally:
            await master.stop()

    run(main())


async def _recorded(etcd: EtcdClient, cluster_id: str) -> list[str]:
    kv, _ = await etcd.get(segments_key(cluster_id))
    return decode_segments_record(kv.value) if kv is not None else []


async def _wait_for_async(fetch, predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate(await fetch()):
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.1)


def test_resolver_without_a_leader_says_not_leader(etcd_endpoint):
    """Nothing led yet: an election under way, or (no master ever marked the cluster) a wrong
    cluster id, said as such (it said "election under way?" either way; helper-49)."""

    async def main():
        cluster_id = new_cluster_id()
        resolver = MasterResolver(f"etcd://{etcd_endpoint}/{cluster_id}")
        with pytest.raises(NotLeader, match="no master ever stood for cluster .* is the cluster id right"):
            await resolver.resolve(1_000)
        async with EtcdClient(parse_etcd_endpoints(etcd_endpoint)) as etcd:
            await etcd.put(f"/kvpool/{cluster_id}/mark".encode(), b"")  # what a master's candidacy leaves
        with pytest.raises(NotLeader, match="no master is the leader .*election under way"):
            await resolver.resolve(1_000)
        assert MasterResolver("127.0.0.1:5").is_dynamic is False

    run(main())


@contextlib.contextmanager
def _frozen_etcd_member(tmp_path):
    """The endpoint of an etcd frozen by SIGSTOP (TCP accepts, nothing answers) for the block."""
    from kvpool.cli.launcher import LocalEtcd

    with LocalEtcd(tmp_path) as frozen:
        assert frozen.process is not None
        os.kill(frozen.process.pid, signal.SIGSTOP)
        try:
            yield frozen.endpoint
        finally:
            os.kill(frozen.process.pid, signal.SIGCONT)


def test_resolver_with_a_frozen_etcd_member_keeps_its_bound_and_goes_to_the_live_one(etcd_endpoint, tmp_path):
    """An etcd member frozen by SIGSTOP (TCP accepts, nothing answers) listed first: a lookup
    used to give it the whole bound, and every endpoint after it as much again (two of them:
    twice the bound), and every later lookup began with it again."""
    cluster_id = new_cluster_id()

    async def main(frozen: str) -> list[float]:
        async with EtcdClient([etcd_endpoint]) as etcd:
            await etcd.put(leader_key(cluster_id), LeaderRecord("127.0.0.1:5", "", "x").encode())
        resolver = MasterResolver(f"etcd://{frozen},{frozen},{etcd_endpoint}/{cluster_id}")
        took_s = []
        for _ in range(2):
            started_s = time.monotonic()
            assert await resolver.resolve(600) == "127.0.0.1:5"
            took_s.append(time.monotonic() - started_s)
            resolver.forget()
        return took_s

    with _frozen_etcd_member(tmp_path) as frozen:
        first_s, second_s = run(main(frozen))
    assert first_s < 0.8, first_s  # within its bound (600 ms), a margin for a busy machine
    assert second_s < 0.2, second_s  # straight to the member that answered


def test_an_etcd_call_keeps_its_bound_past_frozen_members(etcd_endpoint, tmp_path):
    """A leader's keepalive is bounded by the time its leadership has left. Two frozen members
    listed first used to get the client's whole request timeout each (1 s), so the keepalive
    took 2 s whatever its bound; now each gets a share of the bound and the live one answers
    within it. A bound all frozen members use up is a timeout at the bound."""
    async def main(frozen: str) -> tuple[float, float]:
        async with EtcdClient([etcd_endpoint]) as etcd:
            lease_id, _ = await etcd.grant_lease(10_000)
        async with EtcdClient([frozen, frozen, etcd_endpoint]) as etcd:
            started_s = time.monotonic()
            assert await etcd.keep_alive(lease_id, timeout_ms=600) > 0
            kept_s = time.monotonic() - started_s
        async with EtcdClient([frozen, frozen]) as etcd:
            started_s = time.monotonic()
            with pytest.raises(RpcTimeout, match="within 300 ms"):
                await etcd.keep_alive(lease_id, timeout_ms=300)
            timed_out_s = time.monotonic() - started_s
        return kept_s, timed_out_s

    with _frozen_etcd_member(tmp_path) as frozen:
        kept_s, timed_out_s = run(main(frozen))
    assert kept_s < 0.8, kept_s  # within its bound (600 ms), a margin for a busy machine
    assert 0.25 < timed_out_s < 0.5, timed_out_s


def test_a_watch_past_a_frozen_member_sees_the_change_on_the_live_one(etcd_endpoint, tmp_path):
    """A standby watches its leader's key. A frozen member listed first got the whole wait
    (ETCD_WATCH_TIMEOUT_MS, 10 s): a failover took 8.6 s where it takes 4-5. Now a member that
    does not answer a watch within a request's timeout (1 s) is passed over, and the change,
    made 0.3 s in, is seen on the live member."""
    key = f"/kvpool-test/{new_cluster_id()}/watched".encode()

    async def main(frozen: str) -> tuple[bool, float]:
        async with EtcdClient([etcd_endpoint]) as etcd:
            revision = await etcd.put(key, b"1")

            async def change_soon() -> None:
                await asyncio.sleep(0.3)
                await etcd.put(key, b"2")

            changing = asyncio.ensure_future(change_soon())
            async with EtcdClient([frozen, etcd_endpoint]) as watcher:
                started_s = time.monotonic()
                changed = await watcher.wait_for_change(key, revision, 5_000)
                took_s = time.monotonic() - started_s
            await changing
        return changed, took_s

    with _frozen_etcd_member(tmp_path) as frozen:
        changed, took_s = run(main(frozen))
    assert changed and took_s < 2.5, (changed, took_s)  # the frozen member's 1 s, then the live one


def test_an_etcd_call_gives_a_slow_member_that_answers_most_of_its_bound():
    """The member that answered last, tried first, slow but alive (300 ms), with two frozen
    members after it: a keepalive bounded by 750 ms is answered. Shared out equally, that
    member got 250 ms and the keepalive failed, where a bound per member answered it; a leader
    whose etcd is slow would step down for nothing."""
    from aiohttp import web

    async def main() -> tuple[int, float]:
        async def keepalive(request: web.Request) -> web.Response:
            await asyncio.sleep(0.3)
            return web.json_response({"result": {"TTL": "10"}})

        app = web.Application()
        app.router.add_post("/v3/lease/keepalive", keepalive)
        runner = web.AppRunner(app)
        await runner.setup()
        listening = socket.create_server(("127.0.0.1", 0))
        await web.SockSite(runner, listening).start()
        slow = "127.0.0.1:%d" % listening.getsockname()[1]
        frozen = socket.socket()  # listens, never accepts: connections wait in its backlog
        frozen.bind(("127.0.0.1", 0))
        frozen.listen(8)
        try:
            endpoint = "127.0.0.1:%d" % frozen.getsockname()[1]
            async with EtcdClient([slow, endpoint, endpoint]) as etcd:
                started_s = time.monotonic()
                ttl_ms = await etcd.keep_alive(7, timeout_ms=750)
                return ttl_ms, time.monotonic() - started_s
        finally:
            frozen.close()
            await runner.cleanup()

    ttl_ms, took_s = run(main())
    assert ttl_ms == 10_000 and took_s < 0.7, took_s

# --- real processes ------------------------------------------------------------------------------


def test_frozen_leader_refuses_the_put_that_waited_in_its_socket(make_cluster, etcd_endpoint):
    """SIGSTOP the leader with a put on its way, let a standby take over, SIGCONT: the woken
    leader never grants it, clients follow the new leader, nothing is lost."""
    cluster = make_cluster(2, "16MiB", etcd_endpoint=etcd_endpoint, cluster_id=new_cluster_id(),
                           master_count=2, master_args=("--etcd-lease-ttl-ms", str(TTL_MS)))  # fmt: skip
    old = cluster.wait_leader()
    values = {f"frozen-{i}": os.urandom(50_000) for i in range(10)}

    async def main():
        async with await AsyncStore.open(cluster.master_address) as store:
            codes = await store.put_batch(list(values), list(values.values()), ReplicateConfig(replica_num=2))
            assert codes == [ErrorCode.OK] * len(values)
            conn = await connect(old.info["endpoint"], key=None)
            old.signal(signal.SIGSTOP)
            try:
                late_put = asyncio.ensure_future(
                    conn.request(PutStart(["late"], [100], ReplicateConfig(), "h"), timeout_ms=20_000)
                )
                await asyncio.sleep(0.2)
                new = await asyncio.to_thread(cluster.wait_leader, 15.0, ("leader", "recovering"))
                assert new is not old
            finally:
                old.signal(signal.SIGCONT)
            # Whichever it does first on waking, refuse the request or end the conversations
            # of its term, the put is never granted.
            with pytest.raises((NotLeader, RpcFailed)):
                await late_put
            conn.close()
            # The store follows the new leader; the objects come back as the nodes re-mount
            # (a node notices the frozen leader when a heartbeat times out), meanwhile a read
            # is a clean miss or the right bytes.
            deadline = time.monotonic() + 15
            while True:
                got = await store.get_batch(list(values))
                assert all(g in (None, v) for g, v in zip(got, values.values()))
                if got == list(values.values()):
                    break
                assert time.monotonic() < deadline, "objects did not come back"
                await asyncio.sleep(0.1)
            await store.put("after", b"z" * 10)
            assert await store.get("after") == b"z" * 10

    run(main())
    assert cluster.role_of(old) == "standby"


def test_stores_leave_a_leader_that_hangs_for_good(make_cluster, etcd_endpoint):
    """A leader frozen for good (SIGSTOP here; a host behind a network black hole) closes no
    connection: every later call of a Store or AsyncStore opened before timed out on it, for
    as long as it stayed frozen, while a standby led (helper-49). A call that times out now
    has the leader looked up again, and the next ones go to the new leader: one or two time
    out."""
    from kvpool import Store

    cluster = make_cluster(1, "16MiB", etcd_endpoint=etcd_endpoint, cluster_id=new_cluster_id(),
                           master_count=2, master_args=("--etcd-lease-ttl-ms", str(TTL_MS)))  # fmt: skip
    old = cluster.wait_leader()
    client = {"rpc_timeout_ms": 1_000, "connect_timeout_ms": 1_000}

    async def timeouts_until_put(put) -> int:
        """`put()` until one is acknowledged; how many timed out on the way (a call that hit
        the frozen leader). Other refusals (no segment until the node mounts on the new
        leader) are the cluster's state, not the store's."""
        deadline = time.monotonic() + 30
        timeouts = 0
        while True:
            try:
                await put()
                return timeouts
            except RpcTimeout:
                timeouts += 1
            except KVPoolError as exc:
                assert time.monotonic() < deadline, f"no put acknowledged in 30 s: {exc!r}"
                await asyncio.sleep(0.05)
            assert time.monotonic() < deadline, f"no put acknowledged in 30 s ({timeouts} timeouts)"

    async def main() -> None:
        async with await AsyncStore.open(cluster.master_address, **client) as async_store:
            with Store(cluster.master_address, **client) as store:
                store.put("before", b"b" * 100)
                await async_store.put("before-async", b"b" * 100)
                old.signal(signal.SIGSTOP)
                try:
                    await asyncio.to_thread(cluster.wait_leader, 20.0)
                    assert await timeouts_until_put(lambda: asyncio.to_thread(store.put, "s", b"s" * 100)) <= 2
                    assert await timeouts_until_put(lambda: async_store.put("a", b"a" * 100)) <= 2
                    assert store.get("s") == b"s" * 100 and await async_store.get("a") == b"a" * 100
                finally:
                    old.signal(signal.SIGCONT)

    run(main())


def test_a_candidate_with_another_token_refuses_to_stand(make_cluster, etcd_endpoint):
    """A master started with another cluster token stood by without a word; once it led,
    every client and node was refused (Unauthorized) and a failover became an outage
    (helper-49). It now exits at once, saying why; the cluster's masters go on."""
    cluster_id = new_cluster_id()
    cluster = make_cluster(1, "16MiB", etcd_endpoint=etcd_endpoint, cluster_id=cluster_id, token="the-token",
                           master_args=("--etcd-lease-ttl-ms", str(TTL_MS)))  # fmt: skip
    cluster.wait_leader()
    other = kvpool_cli(
        "master", "--port", "0", "--http-port", "0", "--etcd", etcd_endpoint, "--cluster-id", cluster_id,
        "--etcd-lease-ttl-ms", str(TTL_MS), env={"KVPOOL_TOKEN": "another-token", "KVPOOL_TOKEN_FILE": ""},
    )  # fmt: skip
    said = " ".join(other.stderr.decode().split())
    assert other.returncode == 1 and "Traceback" not in said, said
    assert f"error: cluster {cluster_id} on etcd has masters with another cluster token" in said, said
    from kvpool import Store

    with Store(cluster.master_address, token="the-token") as store:
        store.put("still", b"s" * 100)
        assert store.get("still") == b"s" * 100


def test_an_etcd_started_for_a_process_ends_with_it(tmp_path):
    """A test runner killed mid-run left its etcd running (kvpool's own servers end with their
    parent: PR_SET_PDEATHSIG); LocalEtcd's does too now."""
    from kvpool.cli.launcher import etcd_binary

    if etcd_binary() is None:
        pytest.skip("etcd is not installed: run scripts/install-etcd.sh (Debian etcd-server)")
    parent = python_child(
        "import sys, pathlib; from kvpool.cli.launcher import LocalEtcd; "
        f"etcd = LocalEtcd(pathlib.Path({str(tmp_path)!r})); etcd.start(); "
        "print(etcd.process.pid, flush=True); sys.stdin.read()"
    )
    try:
        etcd_pid = int(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait(10)
    deadline = time.monotonic() + 10
    try:
        while os.path.exists(f"/proc/{etcd_pid}") and "zombie" not in open(f"/proc/{etcd_pid}/status").read().lower():
            assert time.monotonic() < deadline, "etcd outlived the process that started it"
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(etcd_pid, signal.SIGKILL)  # a failure leaves nothing behind


def test_a_master_that_cannot_reach_etcd_says_so_on_health(make_cluster, etcd_endpoint):
    """A standby given a mistyped --etcd answered /health "ok" while it could reach no etcd
    (a warning a second in its log), a failure seen only at the failover that needed it. It
    answers 503 with the reason; a master that reaches etcd answers 200."""
    import json
    import urllib.error
    import urllib.request

    from kvpool.cli.launcher import free_port, spawn

    def health(process) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{process.info['http_port']}/health", timeout=5) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as refused:
            return refused.code, json.loads(refused.read())

    cluster = make_cluster(0, etcd_endpoint=etcd_endpoint, cluster_id=new_cluster_id())
    assert health(cluster.wait_leader()) == (200, {"status": "ok", "endpoint": cluster.master_endpoint,
                                                   "role": "leader"})  # fmt: skip
    nowhere = f"127.0.0.1:{free_port()}"
    args = ["master", "--port", "0", "--http-port", "0", "--etcd", nowhere, "--cluster-id", cluster.cluster_id]
    stray = spawn("stray-master", args, cluster.workdir, cluster.env)
    try:
        wait_until(lambda: health(stray)[0] == 503)
        code, said = health(stray)
        assert said["status"] == "etcd unreachable" and said["role"] == "standby"
        assert nowhere in said["etcd_error"], said
    finally:
        stray.stop()

