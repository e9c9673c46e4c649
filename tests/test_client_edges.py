"""Edges of the client library against real clusters (master and nodes as child processes): a
same-host put stalled past its grants, the cache of mapped segments, a failed copy of an
AsyncStore's put, a str where a list of keys belongs, and a get whose replicas stopped
answering under a long read lease."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import uvloop

from kvpool import AsyncStore, ErrorCode, Store
from kvpool.client.transfer import PutJob
from kvpool.errors import KVPoolError, TransferFailed
from tests.conftest import wait_until

# A master that gives a put up (and its grants lapse) 500 ms after it started, and grants its
# ranges again 600 ms after.
SHORT_GRANTS = ("--put-discard-timeout-ms", "500", "--put-release-timeout-ms", "600")


def put_when_room(store: Store, key: str, value: bytes) -> None:
    """Put `key`, again while the master finds no room for it (a range still quarantined)."""

    def put() -> bool:
        code = store.put_batch([key], [value])[0]
        assert code in (ErrorCode.OK, ErrorCode.NO_AVAILABLE_HANDLE), code
        return code == ErrorCode.OK

    wait_until(put, timeout_s=10)


@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_same_host_put_stalled_past_its_grants_does_not_overwrite_the_put_granted_its_range_since(
    make_cluster, monkeypatch, api
):
    """A writer stopped between its put_start and its copy into the node's mapped segment
    (SIGSTOP, swapped out) for longer than its grants: the master gave its put up and granted
    the range to another put meanwhile. The late copy went in all the same (no node checks a
    same-host copy's grant), and the other put's object failed its checksum from then on: lost.
    Now the late put fails (TransferFailed) without copying, and the other object reads whole."""
    cluster = make_cluster(1, "1MiB", master_args=SHORT_GRANTS)
    size = 600 << 10  # one such object fills the segment: the second one fits only in its range
    stalled, granted_since = os.urandom(size), os.urandom(size)
    copy_local = PutJob.copy_local

    with Store(cluster.master_endpoint) as other:

        def stalled_copy(job: PutJob) -> None:
            monkeypatch.setattr(PutJob, "copy_local", copy_local)  # the other put's copy runs as ever
            put_when_room(other, "granted-since", granted_since)  # the grants lapsed, the range regranted
            copy_local(job)

        monkeypatch.setattr(PutJob, "copy_local", stalled_copy)
        with pytest.raises(KVPoolError) as failed:
            if api == "sync":
                with Store(cluster.master_endpoint) as store:
                    store.put("stalled", stalled)
            else:

                async def put_stalled() -> None:
                    async with await AsyncStore.open(cluster.master_endpoint) as store:
                        await store.put("stalled", stalled)

                uvloop.run(asyncio.wait_for(put_stalled(), 30))
        assert other.get("granted-since") == granted_since
        assert isinstance(failed.value, TransferFailed) and "stalled past its grants" in str(failed.value)
        assert not other.exists("stalled")


def test_a_sync_put_in_pieces_stalled_past_its_grants_fails_every_key_and_overwrites_nothing(make_cluster, monkeypatch):
    """The same in a sync Store's put of many pages, which goes in pieces (their put_starts at
    once, each piece copied as its answer comes): the late pieces fail and are revoked."""
    cluster = make_cluster(1, "1MiB", master_args=SHORT_GRANTS)
    keys = [f"page-{n}" for n in range(256)]
    pages = [os.urandom(2 << 10) for _ in keys]  # half the segment: the other object needs their ranges
    granted_since = os.urandom(600 << 10)
    copy_local = PutJob.copy_local
    copies = []

    with Store(cluster.master_endpoint) as other, Store(cluster.master_endpoint) as store:

        def stalled_copy(job: PutJob) -> None:
            copies.append(len(job.keys))
            if len(copies) == 1:  # the first piece's: the other put's copy comes here too, second
                put_when_room(other, "granted-since", granted_since)
            copy_local(job)

        monkeypatch.setattr(PutJob, "copy_local", stalled_copy)
        codes = store.put_batch(keys, pages)
        monkeypatch.setattr(PutJob, "copy_local", copy_local)
        assert other.get("granted-since") == granted_since
        assert len(copies) > 2  # the other put's and the pieces'
        assert codes == [ErrorCode.TRANSFER_FAIL] * len(keys)
        assert other.cluster_status().pending_count == 0
        assert not any(other.batch_exists(keys))


def test_a_client_that_met_many_segments_of_other_hosts_still_maps_its_own_hosts_once(make_cluster, monkeypatch):
    """The store remembers per segment whether it maps it here; past SEGMENTS_REMEMBERED_MAX
    segments (65,536: other hosts' nodes coming and going in a large cluster, over months) it
    remembered nothing more, and every get and put then mapped its own host's segment anew
    (its whole file, page tables filled). Now the segments of other hosts are forgotten to
    make room: the bound holds, and this host's segment is mapped once."""
    from kvpool.client import store as store_module
    from kvpool.node.segment import Segment
    from kvpool.protocol.messages import SegmentInfo

    monkeypatch.setattr(store_module, "SEGMENTS_REMEMBERED_MAX", 8)
    cluster = make_cluster(1, "4MiB")
    with Store(cluster.master_endpoint) as store:
        for n in range(20):  # what gets of a large cluster's objects meet
            info = SegmentInfo(f"elsewhere-{n}", f"node-{n}", f"host-{n}", f"10.0.0.{n}:1", "/dev/shm/x", b"t", 1 << 20)
            assert store._async._local_segment(info) is None
        maps = []
        open_mapped = Segment.open_mapped

        def counted(path: str, token: bytes) -> Segment:
            maps.append(path)
            return open_mapped(path, token)

        monkeypatch.setattr(Segment, "open_mapped", counted)
        values = [os.urandom(64 << 10) for _ in range(5)]
        for n, value in enumerate(values):
            store.put(f"k{n}", value)
            assert store.get(f"k{n}") == value
        assert len(maps) == 1
        assert len(store._async._mapped) <= 8


def test_an_async_put_whose_same_host_copy_raises_gives_its_keys_and_space_back_at_once(make_cluster, monkeypatch):
    """An AsyncStore's put whose copy into a mapped segment raised (a close meanwhile, a
    buffer that went away) left its keys pending at the master: a put of them again was
    refused (REPLICA_IS_NOT_READY) until the discard timeout (30 s), and their ranges held.
    Now they are revoked at once, as the sync Store's are."""
    cluster = make_cluster(1, "4MiB")
    copy_local = PutJob.copy_local
    value = os.urandom(1 << 20)

    def raises_once(job: PutJob) -> None:
        monkeypatch.setattr(PutJob, "copy_local", copy_local)
        raise RuntimeError("the copy failed")

    async def main() -> None:
        async with await AsyncStore.open(cluster.master_endpoint) as store:
            monkeypatch.setattr(PutJob, "copy_local", raises_once)
            with pytest.raises(RuntimeError, match="the copy failed"):
                await store.put("k", value)
            deadline = asyncio.get_running_loop().time() + 3
            while (code := (await store.put_batch(["k"], [value]))[0]) != ErrorCode.OK:
                assert code == ErrorCode.REPLICA_IS_NOT_READY, code
                assert asyncio.get_running_loop().time() < deadline, "the failed put stayed pending"
                await asyncio.sleep(0.02)
            assert await store.get("k") == value
            status = await store.cluster_status()
            assert status.pending_count == 0
            assert sum(s.used_bytes for s in status.segments) < 2 << 20  # the object's range alone

    uvloop.run(asyncio.wait_for(main(), 30))


def batch_calls(store, keys) -> dict[str, object]:
    """Every batch form of `store` (Store or AsyncStore) given `keys` as its keys: name -> a
    call of no arguments (a coroutine's for an AsyncStore)."""
    address = store.register_buffer(bytearray(3 << 10))
    addresses, sizes = [address, address + 1024, address + 2048], [1024] * 3
    per_key = [[a] for a in addresses], [[s] for s in sizes]
    return {
        "put_batch": lambda: store.put_batch(keys, [b"1", b"2", b"3"]),
        "get_batch": lambda: store.get_batch(keys),
        "batch_put_from": lambda: store.batch_put_from(keys, addresses, sizes),
        "batch_get_into": lambda: store.batch_get_into(keys, addresses, sizes),
        "batch_put_from_multi_buffers": lambda: store.batch_put_from_multi_buffers(keys, *per_key),
        "batch_get_into_multi_buffers": lambda: store.batch_get_into_multi_buffers(keys, *per_key),
        "batch_exists": lambda: store.batch_exists(keys),
        "longest_prefix": lambda: store.longest_prefix(keys),
        "query": lambda: store.query(keys),
        "batch_remove": lambda: store.batch_remove(keys),
    }


@pytest.mark.parametrize("keys", ["abc", b"abc", bytearray(b"abc")], ids=["str", "bytes", "bytearray"])
@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_str_or_bytes_given_as_the_keys_of_a_batch_form_is_invalid_params_naming_them(make_cluster, api, keys):
    """get_batch("abc") read the keys "a", "b" and "c" (put_batch stored them): a str is a
    sequence of str. Every batch form now refuses a str or bytes where its list of keys
    belongs, naming the argument, and does nothing."""
    from kvpool.errors import InvalidParams

    cluster = make_cluster(1, "4MiB")
    if api == "sync":
        with Store(cluster.master_endpoint) as store:
            store.put_batch(["a", "b", "c"], [b"a", b"b", b"c"])
            for name, call in batch_calls(store, keys).items():
                with pytest.raises(InvalidParams, match="keys must be a list of keys") as refused:
                    call()
                assert type(keys).__name__ in str(refused.value), name
            assert store.get_batch(["a", "b", "c"]) == [b"a", b"b", b"c"]
        return

    async def main() -> None:
        async with await AsyncStore.open(cluster.master_endpoint) as store:
            await store.put_batch(["a", "b", "c"], [b"a", b"b", b"c"])
            for name, call in batch_calls(store, keys).items():
                with pytest.raises(InvalidParams, match="keys must be a list of keys") as refused:
                    await call()
                assert type(keys).__name__ in str(refused.value), name
            assert await store.get_batch(["a", "b", "c"]) == [b"a", b"b", b"c"]

    uvloop.run(asyncio.wait_for(main(), 30))


@pytest.mark.parametrize("path", ["loop", "caller thread"])
def test_a_get_whose_replicas_stopped_answering_is_a_miss_within_the_transfer_timeout(make_cluster, path):
    """A read lease longer than the sync Store's bound on a call (the transfer timeout and three
    RPC timeouts: 45 s by default, against `--lease-ttl-ms 60000`): a get whose replicas'
    nodes stopped answering spent up to a transfer timeout on each replica in turn, within the
    lease, and through the loop ran past that bound: RpcTimeout, not a miss. Its reads now end
    within one transfer timeout, all replicas together: a miss. (Here the lease is the default
    10 s against a 1 s transfer timeout and a bound of 2.5 s.)"""
    from kvpool import ReplicateConfig

    cluster = make_cluster(3, "4MiB")
    value = os.urandom(64 << 10)
    options = {"shm_enabled": False, "transfer_timeout_ms": 1_000, "rpc_timeout_ms": 500}
    with Store(cluster.master_endpoint, **options) as store:
        store.put("k", value, ReplicateConfig(replica_num=3))
        assert store.get("k") == value
        if path == "loop":  # a caller thread beyond the Store's NODE_LINK_THREADS_MAX reads through the loop
            store._nodes.read = lambda job: False
        for node in cluster.nodes:
            node.signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert store.get("k") is None
            assert time.monotonic() - started < store._timeout_ms / 1000  # the Store's bound on a call
        finally:
            for node in cluster.nodes:
                node.signal(signal.SIGCONT)
        assert store.get("k") == value


@pytest.mark.parametrize("path", ["loop", "caller thread"])
def test_a_node_that_stopped_answering_costs_later_gets_a_second_not_a_round(make_cluster, path):
    """A node frozen (SIGSTOP, a hung host, or cut off from this client while the master still
    hears it) is listed until its TTL, for ever if only the client lost it. Once one read of it
    timed out, every get of an object only there still waited out a whole round (its share of
    the read lease: 10 s by default, 3 s here), and a batch that also read a live node's keys
    waited with it. Reads of a node marked slow now have SLOW_NODE_BUDGET_MS (1 s, for small
    reads); the live node's keys come back; a node that answers again is read as before."""
    from kvpool import ReplicateConfig
    from kvpool.client.slow_nodes import SLOW_NODE_BUDGET_MS, SLOW_NODE_OPEN_MS

    cluster = make_cluster(2, "4MiB", master_args=("--node-ttl-ms", "60000"))
    frozen, live = cluster.nodes
    values = {"on-frozen": os.urandom(64 << 10), "on-live": os.urandom(64 << 10)}
    options = {"shm_enabled": False, "transfer_timeout_ms": 3_000, "rpc_timeout_ms": 1_000}
    with Store(cluster.master_endpoint, **options) as store:
        for key, node in zip(values, (frozen, live)):
            on_node = ReplicateConfig(placement="preferred", preferred_segments=[node.info["segment_id"]])
            store.put(key, values[key], on_node)
        assert store.get_batch(list(values)) == list(values.values())
        if path == "loop":  # a caller thread beyond the Store's NODE_LINK_THREADS_MAX reads through the loop
            store._nodes.read = lambda job: False
        frozen.signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert store.get("on-frozen") is None  # the first read waits out its round
            assert time.monotonic() - started >= 1.5  # (the loop: a new connection's handshake, 2 s)
            for _ in range(2):
                started = time.monotonic()
                assert store.get_batch(list(values)) == [None, values["on-live"]]
                assert time.monotonic() - started < (SLOW_NODE_BUDGET_MS + SLOW_NODE_OPEN_MS) / 1000 + 0.5
        finally:
            frozen.signal(signal.SIGCONT)
        assert wait_until(lambda: store.get("on-frozen") == values["on-frozen"], 5)
        assert not store._opened.slow_nodes.is_slow(frozen.info["endpoint"])
