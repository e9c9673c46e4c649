"""The client API end to end, in one process: a real MasterServer and real Nodes on one event
loop over loopback sockets, driven through AsyncStore (and Store on its own loop thread). Covers
every call of the bytes, zero-copy, multi-buffer and metadata APIs, both data paths (same-host
shm and TCP) and embedded mode. Faster than the multi-process tests, same code paths."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time

import numpy as np
import pytest
import uvloop

from kvpool import AsyncStore, ErrorCode, ReplicateConfig, Store, limits
from kvpool.config import MasterConfig, NodeConfig
from kvpool.errors import InvalidKey, InvalidParams, ObjectHasLease, ObjectNotFound, RpcFailed
from kvpool.master.server import MasterServer
from kvpool.node.server import Node
from kvpool.protocol.messages import (
    GetReplicaList,
    Message,
    PutEnd,
    PutRevoke,
    PutStart,
    ReleaseLeases,
    ReportBadReplicas,
)


@contextlib.asynccontextmanager
async def cluster(node_count: int = 2, memory_bytes: int = 16 << 20, **master_options):
    master = MasterServer(MasterConfig(**master_options), port=0, seed=1, debug_invariants=True)
    await master.start()
    nodes = [Node(NodeConfig(master_endpoint=master.endpoint, memory_bytes=memory_bytes)) for _ in range(node_count)]
    try:
        for node in nodes:
            await node.start()
        yield master, nodes
    finally:
        for node in nodes:
            await node.stop()
        await master.stop()


def run(coroutine):
    return uvloop.run(asyncio.wait_for(coroutine, 60))


async def gone(store: AsyncStore, key: str, timeout_s: float = 2.0) -> bool:
    """Whether `key` stops existing within the bound (the master acts after its answer)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while await store.exists(key):
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


@pytest.mark.parametrize("shm_enabled", [True, False], ids=["shm", "tcp"])
def test_bytes_api_round_trip(shm_enabled):
    async def main():
        async with cluster() as (master, _):
            async with await AsyncStore.open(master.endpoint, shm_enabled=shm_enabled) as store:
                values = {f"k{i}": os.urandom(size) for i, size in enumerate([1, 4096, 100_000, 3 << 20])}
                assert await store.put_batch(list(values), list(values.values())) == [0] * 4
                assert await store.get_batch(list(values)) == list(values.values())
                await store.put("k0", b"different")  # immutable: a second put keeps the first
                assert await store.get("k0") == values["k0"]
                assert await store.get("absent") is None
                assert await store.get_size("k3") == 3 << 20
                with pytest.raises(ObjectNotFound):
                    await store.get_size("absent")
                # A put under way is no object yet, as exists() says: ObjectNotFound, not ReplicaNotReady.
                await store._put_start(["writing"], [[memoryview(b"w" * 100)]], None)
                assert await store.exists("writing") is False
                with pytest.raises(ObjectNotFound):
                    await store.get_size("writing")

    run(main())


@pytest.mark.parametrize("shm_enabled", [True, False], ids=["shm", "tcp"])
def test_zero_copy_and_multi_buffer_api(shm_enabled):
    async def main():
        async with cluster() as (master, _):
            async with await AsyncStore.open(master.endpoint, shm_enabled=shm_enabled) as store:
                layers = [np.random.randint(0, 255, 64 * 1024, dtype=np.uint8) for _ in range(4)]
                source = [store.register_buffer(layer) for layer in layers]
                codes = await store.batch_put_from_multi_buffers(
                    ["obj"], [source], [[len(layer) for layer in layers]]
                )
                assert codes == [0]
                whole = np.zeros(4 * 64 * 1024, dtype=np.uint8)
                address = store.register_buffer(whole)
                assert await store.get_into("obj", address, whole.nbytes) == whole.nbytes
                assert np.array_equal(whole, np.concatenate(layers))
                scattered = [np.zeros(64 * 1024, dtype=np.uint8) for _ in range(4)]
                targets = [store.register_buffer(t) for t in scattered]
                sizes = [[t.nbytes for t in scattered]]
                assert await store.batch_get_into_multi_buffers(["obj"], [targets], sizes) == [whole.nbytes]
                for got, want in zip(scattered, layers):
                    assert np.array_equal(got, want)
                # Batch forms with one buffer per key; a too-small buffer is BUFFER_OVERFLOW.
                assert await store.batch_put_from(["a", "b"], [source[0], source[1]], [100, 200]) == [0, 0]
                small = store.register_buffer(bytearray(50))
                codes = await store.batch_get_into(["a", "b", "zz"], [small, address, address + 200], [50, 200, 200])
                assert codes == [ErrorCode.BUFFER_OVERFLOW, 200, ErrorCode.OBJECT_NOT_FOUND]
                with pytest.raises(InvalidParams):
                    await store.get_into("a", 12345, 10)  # not registered memory

    run(main())


def test_payloads_over_tcp_are_padded_so_that_no_copy_runs_at_a_slow_offset(monkeypatch):
    """Zero-copy and plain transfers over TCP from and into buffers at several offsets of a
    page: every frame with a payload names where it is read from and where it lands, its
    control message is padded so that neither copy's destination is 1-63 bytes past its
    source modulo a page (frames.payload_padding), and the bytes arrive intact."""
    from kvpool.protocol import frames
    from kvpool.transports import connection

    sent = []

    def recording(message, request_id, **options):
        wire = frames.encode_frame(message, request_id, **options)
        if options.get("payload_size", 0) >= frames.PADDED_PAYLOAD_BYTES_MIN:
            sent.append((len(wire), options.get("payload_source"), options.get("payload_landing")))
        return wire

    monkeypatch.setattr(connection, "encode_frame", recording)

    async def main():
        async with cluster(node_count=1) as (master, nodes):
            # write_landing's premise: a node's segment data starts a page.
            data_start = frames.buffer_address(nodes[0].segment.data)
            assert data_start % frames.PAGE_BYTES == limits.SEGMENT_HEADER_SIZE_BYTES % frames.PAGE_BYTES
            async with await AsyncStore.open(master.endpoint, shm_enabled=False) as store:
                size, shifts = 64 * 1024, [0, 16, 40, 4080]
                arena = np.random.randint(0, 255, len(shifts) * (size + 2 * frames.PAGE_BYTES), dtype=np.uint8)
                landing = np.zeros_like(arena)
                base, landing_base = store.register_buffer(arena), store.register_buffer(landing)
                page = -base % frames.PAGE_BYTES
                sources = [base + page + i * (size + 2 * frames.PAGE_BYTES) + shift for i, shift in enumerate(shifts)]
                keys = [f"k{shift}" for shift in shifts]
                assert await store.batch_put_from(keys, sources, [size] * len(keys)) == [0] * len(keys)
                page = -landing_base % frames.PAGE_BYTES
                targets = [landing_base + page + i * (size + 2 * frames.PAGE_BYTES) + s for i, s in enumerate(shifts)]
                for key, source, target in zip(keys, sources, targets):
                    assert await store.get_into(key, target, size) == size
                    assert np.array_equal(landing[target - landing_base :][:size], arena[source - base :][:size])
                plain = await store.get_batch(keys)
                assert [bytes(p) for p in plain] == [arena[s - base :][:size].tobytes() for s in sources]

    run(main())
    # One frame puts the four objects, the node answers four zero-copy gets, then one plain
    # get of all four: a frame pads for its first object (the others follow in its payload).
    assert len(sent) == 6, sent
    for header_bytes, source, landing_at in sent:
        assert source is not None and landing_at is not None, (header_bytes, source, landing_at)
        assert not frames.is_slow_copy(source, header_bytes), (header_bytes, source)
        assert not frames.is_slow_copy(header_bytes, landing_at), (header_bytes, landing_at)


def test_a_node_leaving_a_large_table_goes_in_steps_while_the_master_serves(monkeypatch):
    """A master whose table holds more keys than one unmount step looks at (8 here): a node
    that stops takes its segment away in steps, run between requests (master/server.py);
    meanwhile and after, the other node's objects are served, and the leaving one's go."""

    monkeypatch.setattr(limits, "UNMOUNT_SWEEP_KEYS_PER_STEP", 8)

    async def main():
        async with cluster() as (master, nodes):
            async with await AsyncStore.open(master.endpoint, shm_enabled=False) as store:
                by_node = {}
                for node in nodes:
                    keys = [f"{node.segment_id}/{i}" for i in range(40)]
                    on_node = ReplicateConfig(placement="preferred", preferred_segments=[node.segment_id])
                    assert await store.put_batch(keys, [os.urandom(1000) for _ in keys], on_node) == [0] * 40
                    by_node[node.segment_id] = keys
                leaving, staying = nodes
                await leaving.stop()  # UnmountSegment: the segment starts leaving
                for _ in range(300):  # the master's next tick starts the steps; the last unmounts
                    assert await store.batch_exists(by_node[staying.segment_id]) == [True] * 40
                    if not master.service.has_segment(leaving.segment_id):
                        break
                    await asyncio.sleep(0.01)
                assert not master.service.has_segment(leaving.segment_id)
                assert not any(await store.batch_exists(by_node[leaving.segment_id]))
                assert master.service.counters.lost == 40
                gotten = await store.get_batch(by_node[staying.segment_id])
                assert all(value is not None and len(value) == 1000 for value in gotten)

    run(main())


def test_metadata_api():
    async def main():
        async with cluster() as (master, _):
            async with await AsyncStore.open(master.endpoint) as store:
                keys = [f"chain/{i}" for i in range(8)]
                await store.put_batch(keys[:5], [b"x" * 10] * 5)
                assert await store.batch_exists(keys) == [True] * 5 + [False] * 3
                assert await store.longest_prefix(keys) == 5
                assert await store.longest_prefix(["chain/9", *keys]) == 0
                assert await store.exists("chain/0")
                # A lookup's hold (an engine's, until its load): a finished get's lease is given
                # back before the store's own remove (test_a_remove_right_after_the_stores_own_get_...).
                assert await store.longest_prefix(["chain/0"], hold_ms=60_000) == 1
                with pytest.raises(ObjectHasLease):
                    await store.remove("chain/0")
                await store.remove("chain/0", force=True)
                assert not await store.exists("chain/0")
                assert await store.remove_by_regex(r"^chain/[12]$") == 2
                listed = await store.list_objects("chain")
                assert sorted(listed.keys) == ["chain/3", "chain/4"]
                assert await store.remove_all() == 2
                assert await store.longest_prefix(keys) == 0

    run(main())


def test_replicas_on_distinct_segments_and_placement():
    async def main():
        async with cluster(node_count=3) as (master, nodes):
            async with await AsyncStore.open(master.endpoint) as store:
                await store.put_batch(
                    [f"r{i}" for i in range(10)], [b"y" * 1000] * 10, ReplicateConfig(replica_num=3)
                )
                reply = await store.query([f"r{i}" for i in range(10)])
                assert all(len({r.segment_id for r in rs}) == 3 for rs in reply.replicas)
                target = nodes[1].segment_info.segment_id
                config = ReplicateConfig(placement="preferred", preferred_segments=[target])
                await store.put("pinned-here", b"z" * 100, config)
                reply = await store.query(["pinned-here"])
                assert reply.replicas[0][0].segment_id == target

    run(main())


@pytest.mark.parametrize("token", [None, ""], ids=["default", "none-said"])
def test_embedded_mode_contributes_a_segment(token):
    """token="" (no token, whatever the environment says) once failed the embedded node's
    start: its config refuses "" (the benchmarks' in-process rows found it)."""

    async def main():
        master = MasterServer(MasterConfig(), port=0)
        await master.start()
        try:
            store = await AsyncStore.open(master.endpoint, token=token, embedded_memory_bytes=8 << 20)
            try:
                await store.put("local", b"q" * 5000)
                assert await store.get("local") == b"q" * 5000
                status = await store.cluster_status()
                assert len(status.segments) == 1
            finally:
                await store.aclose()
        finally:
            await master.stop()

    run(main())


@contextlib.contextmanager
def cluster_on_a_thread(**options):
    """cluster(**options) served by a loop of its own on another thread, for a sync Store:
    yields the master's endpoint."""
    loop = uvloop.new_event_loop()
    ready = loop.create_future()
    stop = loop.create_future()

    async def serve():
        async with cluster(**options) as (master, _):
            ready.set_result(master.endpoint)
            await stop

    thread = threading.Thread(target=lambda: loop.run_until_complete(serve()))
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not ready.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        yield ready.result()
    finally:
        loop.call_soon_threadsafe(lambda: stop.done() or stop.set_result(None))
        thread.join(30)


def test_sync_store_from_threads():
    with cluster_on_a_thread() as endpoint, Store(endpoint) as store:

        def worker(n: int) -> bool:
            keys = [f"t{n}-{i}" for i in range(20)]
            values = [os.urandom(10_000) for _ in keys]
            store.put_batch(keys, values)
            return store.get_batch(keys) == values

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert all(pool.map(worker, range(8)))


def test_a_key_that_is_not_a_str_is_an_invalid_key_and_the_connection_serves_on():
    """A bytes key (a hash digest, say) is refused by the client, before the master would take
    the request for a malformed frame and drop the connection."""
    bad_keys = [b"digest", 7, None, ["unhashable"]]

    with cluster_on_a_thread() as endpoint, Store(endpoint) as store:
        store.put("good", b"v" * 100)
        connection = store._direct.connections()[0]
        buffer = np.zeros(100, dtype=np.uint8)
        address = store.register_buffer(buffer)
        for bad in bad_keys:
            for call in (
                lambda: store.put(bad, b"v"), lambda: store.get(bad), lambda: store.get_batch(["good", bad]),
                lambda: store.batch_get_into([bad], [address], [100]), lambda: store.exists(bad),
                lambda: store.longest_prefix(["good", bad]), lambda: store.get_size(bad), lambda: store.remove(bad),
            ):  # fmt: skip
                with pytest.raises(InvalidKey, match=type(bad).__name__):
                    call()
        assert store.get("good") == b"v" * 100
        assert store._direct.connections() == [connection] and connection.is_usable()
        with pytest.raises(InvalidKey) as refused:  # a huge key is named, not printed whole
            store.put("k" * 100_000, b"v")
        assert len(str(refused.value)) < 300
        for call in (lambda: store.put("a\udc80", b"v"), lambda: store.get_batch(["good", "a\udc80"])):
            with pytest.raises(InvalidKey, match="UTF-8"):  # a lone surrogate: bytes decoded with surrogateescape
                call()
        # The admin calls' arguments too: the master would drop the connection on any of them.
        for call in (
            lambda: store.remove_by_regex(5), lambda: store.remove_by_regex("g.*", force="yes"),
            lambda: store.remove_all(force=None), lambda: store.list_objects("", 2**70),
            lambda: store.list_objects(None), lambda: store.batch_remove(["good"], force=1),
            lambda: store.longest_prefix(["good"], hold_ms="5"), lambda: store.longest_prefix(["good"], -1),
            lambda: store.longest_prefix(["good"], 5, hold_reads=2.0), lambda: store.longest_prefix(["good"], 5, 0),
        ):  # fmt: skip
            with pytest.raises(InvalidParams):
                call()
        assert store.get("good") == b"v" * 100 and store.list_objects("go").keys == ["good"]
        assert store._direct.connections() == [connection] and connection.is_usable()

    actions = (lambda s, k: s.put(k, b"v"), lambda s, k: s.get(k), lambda s, k: s.exists(k), lambda s, k: s.remove(k))
    refused_on_an_async_store(
        [(lambda s, act=act, bad=bad: act(s, bad), InvalidKey, None) for bad in bad_keys for act in actions]
    )


def test_keys_of_a_str_subclass_are_the_keys_their_text_names():
    """Keys taken from a numpy array of strings are numpy.str_, a str subclass: they passed
    the client's key check and then failed in the frame encoder with a bare TypeError, from
    every call. They are their text now, through the sync and the async paths alike."""

    class Key(str):
        pass

    keys = list(np.array(["np-a", "np-b"])) + [Key("sub-c")]
    values = [os.urandom(1000) for _ in keys]
    with cluster_on_a_thread() as endpoint:
        with Store(endpoint) as store:
            assert store.put_batch(keys, values) == [0, 0, 0]
            assert store.get_batch(["np-a", "np-b", "sub-c"]) == values
            assert store.get(keys[0]) == values[0] and store.get_size(keys[2]) == 1000
            assert store.batch_exists(keys) == [True] * 3 and store.longest_prefix(keys) == 3
            assert sorted(store.list_objects("").keys) == ["np-a", "np-b", "sub-c"]

        async def main():
            async with await AsyncStore.open(endpoint) as store:
                assert await store.get_batch(keys) == values
                await store.remove(keys[1])
                assert await store.batch_exists(["np-a", "np-b", "sub-c"]) == [True, False, True]

        asyncio.run(main())


def refused_on_an_async_store(refusals) -> None:
    """Each (call, exception, match) of `refusals`, given an AsyncStore, raises that exception;
    the store's master connection then serves on."""

    async def main():
        async with cluster() as (master, _):
            async with await AsyncStore.open(master.endpoint) as store:
                await store.put("good", b"v" * 100)
                connection = store._master._conn
                for call, error, match in refusals:
                    with pytest.raises(error, match=match):
                        await call(store)
                assert await store.get("good") == b"v" * 100
                assert store._master._conn is connection and not connection.is_closed()

    run(main())


def test_a_buffer_in_use_by_a_call_in_flight_cannot_be_unregistered():
    """An engine that frees a buffer while a get is landing in it would crash (a raw
    registration freed mid-transfer did: SIGSEGV): unregister refuses until the call returned."""

    async def main():
        async with cluster() as (master, _):
            async with await AsyncStore.open(master.endpoint, shm_enabled=False) as store:
                data = os.urandom(1 << 20)
                await store.put("k", data)
                buffer = np.zeros(len(data), dtype=np.uint8)
                raw = np.zeros(len(data), dtype=np.uint8)
                address, raw_address = store.register_buffer(buffer), store.register_buffer(raw.ctypes.data, raw.nbytes)
                for target in (address, raw_address):
                    task = asyncio.ensure_future(store.get_into("k", target, len(data)))
                    await asyncio.sleep(0)  # the get holds its buffer from its first step
                    with pytest.raises(InvalidParams, match="in use by 1 call"):
                        store.unregister_buffer(target)
                    assert await task == len(data)
                    store.unregister_buffer(target)  # returned: free to go
                assert buffer.tobytes() == raw.tobytes() == data

    run(main())


class _RunToTheEnd:
    """An AsyncStore whose coroutine calls each run to their end on `loop`: one test body for
    both APIs."""

    def __init__(self, store: AsyncStore, loop: asyncio.AbstractEventLoop) -> None:
        self._store, self._loop = store, loop

    def __getattr__(self, name: str):
        call = getattr(self._store, name)
        if not asyncio.iscoroutinefunction(call):
            return call
        return lambda *args: self._loop.run_until_complete(call(*args))


@contextlib.contextmanager
def either_store(api: str, endpoint: str, **options):
    """A Store, or an AsyncStore on a loop of its own behind _RunToTheEnd."""
    if api == "Store":
        with Store(endpoint, **options) as store:
            yield store
        return
    loop = uvloop.new_event_loop()
    store = loop.run_until_complete(AsyncStore.open(endpoint, **options))
    try:
        yield _RunToTheEnd(store, loop)
    finally:
        loop.run_until_complete(store.aclose())
        loop.close()


@pytest.mark.parametrize("api", ["Store", "AsyncStore"])
def test_a_get_into_ranges_that_overlap_is_refused_and_a_put_from_them_is_not(api):
    """Two ranges of one get that share bytes (two keys' pages, or two layer buffers of one
    key): a same-host get copied into both in turn and reported success with the other key's
    bytes in the first. The get is refused whole, before anything is written; a put only reads
    its ranges and takes them overlapping."""
    a, b, c = (bytes([value]) * 4096 for value in (0xAA, 0xBB, 0xCC))
    with cluster_on_a_thread() as endpoint, either_store(api, endpoint) as store:
        assert store.put_batch(["a", "b", "c"], [a, b, c]) == [ErrorCode.OK] * 3
        buffer = bytearray(3 * 4096)
        base = store.register_buffer(buffer)
        for keys, addresses, sizes in (
            (["a", "b"], [[base], [base + 2048]], [[4096], [4096]]),  # two keys' pages
            (["a", "b"], [[base + 4096], [base + 2048]], [[4096], [4096]]),  # the same, out of order
            (["c"], [[base, base + 1024]], [[2048, 2048]]),  # one key's layer buffers
            (["a", "c"], [[base], [base + 8192, base + 100]], [[4096], [2048, 2048]]),  # a layer in a page
        ):
            with pytest.raises(InvalidParams, match="overlap"):
                store.batch_get_into_multi_buffers(keys, addresses, sizes)
            if all(len(key_addresses) == 1 for key_addresses in addresses):
                with pytest.raises(InvalidParams, match="overlap"):
                    store.batch_get_into(keys, [a for (a,) in addresses], [n for (n,) in sizes])
        assert bytes(buffer) == bytes(len(buffer))  # nothing written
        buffer[:8192] = a + b
        assert store.batch_put_from(["ab", "ba"], [base, base + 2048], [4096, 4096]) == [ErrorCode.OK] * 2
        buffer[:] = bytes(len(buffer))
        assert store.batch_get_into(["ab", "ba"], [base + 4096, base], [4096, 4096]) == [4096, 4096]
        assert bytes(buffer[:8192]) == a[:2048] + b[:2048] + a  # "ba" then "ab", side by side
        store.unregister_buffer(base)  # the refused calls held nothing


def test_a_replicate_config_field_of_the_wrong_type_is_invalid_params_and_the_connection_serves_on():
    """ReplicateConfig(with_disk_copy="no") and the like: refused by the client, naming the
    field, before the master would take the put for a malformed frame and drop the connection."""
    bad_configs = [
        ("with_disk_copy", ReplicateConfig(with_disk_copy="no")),
        ("with_dfs_copy", ReplicateConfig(with_dfs_copy=None)),
        ("replica_num", ReplicateConfig(replica_num="2")),
        ("replica_num", ReplicateConfig(replica_num=2**70)),  # beyond what msgpack carries
        ("preferred_segments", ReplicateConfig(preferred_segments=["a", 1])),
    ]
    with cluster_on_a_thread() as endpoint, Store(endpoint) as store:
        store.put("good", b"v" * 100)
        connection = store._direct.connections()[0]
        for field, config in bad_configs:
            for call in (lambda: store.put("k", b"v", config), lambda: store.put_batch(["k"], [b"v"], config)):
                with pytest.raises(InvalidParams, match=f"ReplicateConfig.{field}"):
                    call()
        assert store.get("good") == b"v" * 100 and not store.exists("k")
        assert store._direct.connections() == [connection] and connection.is_usable()

    refused_on_an_async_store(
        [(lambda s, c=config: s.put("k", b"v", c), InvalidParams, f"ReplicateConfig.{field}")
         for field, config in bad_configs]  # fmt: skip
    )


def test_a_value_that_is_not_contiguous_bytes_is_invalid_params():
    """put(k, "text"), put(k, None), a strided numpy view: memoryview's TypeError came out
    of the put, where the API promises InvalidParams."""
    strided = np.arange(64, dtype=np.uint8)[::2]
    bad_values = [("str", "text"), ("NoneType", None), ("int", 5), ("ndarray", strided)]
    with cluster_on_a_thread() as endpoint, Store(endpoint) as store:
        for name, value in bad_values:
            with pytest.raises(InvalidParams, match=f"value 0: {name} is not contiguous bytes"):
                store.put("k", value)
            with pytest.raises(InvalidParams, match=f"value 1: {name} is not contiguous bytes"):
                store.put_batch(["a", "b"], [b"fine", value])
        assert not store.exists("k") and not store.exists("a")
    refused_on_an_async_store(
        [(lambda s, v=value: s.put("k", v), InvalidParams, f"{name} is not contiguous") for name, value in bad_values]
    )


@pytest.mark.parametrize("shm_enabled", [True, False], ids=["shm", "tcp"])
@pytest.mark.parametrize("api", ["Store", "AsyncStore"])
def test_numpy_integer_addresses_and_sizes_work_end_to_end(api, shm_enabled):
    """An engine's page table in numpy arrays: uint64 pointers and int64 sizes summed to a
    float64 (TypeError from a slice), an int32 size plus an address overflowed, and a uint64
    address to register_buffer was taken for a buffer object. Every zero-copy form takes them."""
    pages = np.random.default_rng(3).integers(0, 256, 8 * 4096, dtype=np.uint8)
    landed = np.zeros_like(pages)
    with cluster_on_a_thread() as endpoint, either_store(api, endpoint, shm_enabled=shm_enabled) as store:
        source = store.register_buffer(np.uint64(pages.ctypes.data), np.int64(pages.nbytes))
        target = store.register_buffer(landed)
        pointers = np.uint64(source) + np.arange(8, dtype=np.uint64) * np.uint64(4096)
        sizes = np.full(8, 4096, dtype=np.int64)
        keys = [f"p{i}" for i in range(4)]
        assert store.batch_put_from(keys, pointers[:4], sizes[:4]) == [ErrorCode.OK] * 4
        assert store.put_from("p4", pointers[4], np.int32(4096)) == ErrorCode.OK
        layers = [[pointers[5], pointers[6]], [pointers[7]]]  # numpy per key too
        assert store.batch_put_from_multi_buffers(["m0", "m1"], layers, [sizes[:2], sizes[:1]]) == [ErrorCode.OK] * 2
        into = np.uint64(target) + np.arange(8, dtype=np.uint64) * np.uint64(4096)
        assert store.batch_get_into(keys, [int(a) for a in into[:4]], sizes[:4].astype(np.int32)) == [4096] * 4
        assert store.get_into("p4", into[4], np.int32(4096)) == 4096
        read = store.batch_get_into_multi_buffers(["m0", "m1"], [into[5:7], into[7:]], [sizes[:2], sizes[:1]])
        assert read == [8192, 4096]
        assert landed.tobytes() == pages.tobytes()
        store.unregister_buffer(np.uint64(source))
        store.unregister_buffer(target)


@pytest.mark.parametrize("api", ["Store", "AsyncStore"])
def test_arguments_of_the_wrong_type_or_range_are_invalid_params_naming_them_and_change_nothing(api):
    """A float, str or None address or size, flat lists to a multi-buffer call, a strided view,
    a str or an empty buffer to register, a str to unregister, a config that is not a
    ReplicateConfig, a bulk removal's bound past what a wait takes (2**53 ms: OverflowError
    from the sync Store's wait): untyped errors came out before, or a registry corrupted."""
    with cluster_on_a_thread() as endpoint, either_store(api, endpoint) as store:
        store.put("good", b"v" * 100)
        buffer = bytearray(8192)
        base = store.register_buffer(buffer)
        refusals = [
            (lambda: store.put_from("k", float(base), 100), "addresses must be an integer, not float"),
            (lambda: store.put_from("k", str(base), 100), "addresses must be an integer, not str"),
            (lambda: store.put_from("k", base, 100.0), "sizes must be an integer, not float"),
            (lambda: store.get_into("good", None, 100), "addresses must be an integer, not NoneType"),
            (lambda: store.batch_get_into(["good"], [base], ["100"]), "sizes must be an integer, not str"),
            (lambda: store.batch_get_into_multi_buffers(["good"], [base], [100]), "addresses must be a sequence"),
            (lambda: store.batch_put_from_multi_buffers(["k"], [[base]], [100]), "sizes must be a sequence"),
            (lambda: store.register_buffer(np.zeros((10, 10), np.uint8)[:, ::2]), "C-contiguous buffer, not ndarray"),
            (lambda: store.register_buffer("abc"), "C-contiguous buffer, not str"),
            (lambda: store.register_buffer(bytearray(100), 10.0), "size_bytes must be an integer, not float"),
            (lambda: store.register_buffer(bytearray()), "empty buffer"),
            (lambda: store.unregister_buffer("x"), "address must be an integer, not str"),
            (lambda: store.put("k", b"v", "abc"), "config must be a ReplicateConfig or None, not str"),
            (lambda: store.put_batch(["k"], [b"v"], {"replica_num": 1}), "config must be a ReplicateConfig"),
            (lambda: store.batch_put_from(["k"], [base], [100], "abc"), "config must be a ReplicateConfig"),
            (lambda: store.remove_all(False, 2**62), "timeout_ms 4611686018427387904 not in 1.."),
            (lambda: store.remove_by_regex("good", False, 2**53), "timeout_ms 9007199254740992 not in 1.."),
            (lambda: store.remove_all(True, limits.CALL_TIMEOUT_MS_MAX + 1), "timeout_ms"),
        ]
        for call, match in refusals:
            with pytest.raises(InvalidParams, match=match):
                call()
        assert bytes(buffer) == bytes(len(buffer))
        store.unregister_buffer(base)  # registered once, and no refused call holds it
        with pytest.raises(InvalidParams, match="no buffer registered"):
            store.unregister_buffer(base)
        assert store.remove_all(False, limits.CALL_TIMEOUT_MS_MAX) == 1  # "good" alone: "k" never stored


def test_a_segment_retired_by_another_thread_between_two_lookups_fails_no_get():
    """A sync Store's caller threads look mapped segments up while another thread may retire
    one (a node on this host restarted: _retire_unlinked): a lookup that tested for the entry
    and then read it raised KeyError out of the get. Simulated by an entry that goes the
    moment it is tested for; a get then maps the segment anew."""

    retired = []

    class _GoesOnceTested(dict):
        def __contains__(self, key: object) -> bool:
            present = super().__contains__(key)
            retired.append(self.pop(key, None))
            type(self).__contains__ = dict.__contains__  # once
            return present

    async def main():
        async with cluster(1) as (master, _):
            async with await AsyncStore.open(master.endpoint) as store:
                await store.put("k", b"v" * 4096)
                assert await store.get("k") == b"v" * 4096
                assert [s for s in store._mapped.values() if s is not None]  # same host: mapped
                store._mapped = _GoesOnceTested(store._mapped)
                try:
                    assert await store.get("k") == b"v" * 4096
                finally:
                    for segment in retired:
                        segment is None or segment.close()

    run(main())


def test_a_remove_right_after_the_stores_own_get_is_not_refused_for_its_lease():
    """A finished get's lease went back 10 ms later, batched with the gets after it: a remove
    (by key, pattern or all) right after it was refused with OBJECT_HAS_LEASE for a read that
    was over. Another store's lease still holds (the point of leases)."""
    with cluster_on_a_thread() as endpoint, Store(endpoint) as store, Store(endpoint) as other:
        store.put_batch(["a", "b", "c", "held"], [b"1", b"2", b"3", b"4"])
        assert store.get("a") == b"1"
        store.remove("a")
        assert store.get("b") == b"2"
        assert store.remove_by_regex("^b$") == 1
        assert other.longest_prefix(["held"], hold_ms=60_000) == 1  # another reader's lease
        assert store.get("c") == b"3"
        assert store.remove_all() == 1  # "c"; "held" stays under the other store's lease
        assert store.list_objects().keys == ["held"]


def test_a_remove_waits_for_the_lease_releases_the_store_already_sent(monkeypatch):
    """The store's flush gives a finished get's leases back RELEASE_DELAY_MS after it; a
    remove that came as it flushed took nothing to give back, and its frame went out before
    the flush's release (the master refused the key with OBJECT_HAS_LEASE for a read that was
    over: a test under load saw it). Here the flush's release is held 200 ms on its way:
    the remove waits for it."""
    with cluster_on_a_thread() as endpoint, Store(endpoint) as store:
        link = store._async._master
        real_call = link.call

        async def slow_releases(message, **kwargs):
            if isinstance(message, ReleaseLeases):
                await asyncio.sleep(0.2)
            return await real_call(message, **kwargs)

        monkeypatch.setattr(link, "call", slow_releases)
        store.put_batch(["a", "b"], [b"1", b"2"])
        assert store.get_batch(["a", "b"]) == [b"1", b"2"]
        time.sleep(0.05)  # the flush took the leases; its release is on its way
        assert store.batch_remove(["a", "b"]) == [ErrorCode.OK, ErrorCode.OK]


def test_a_lease_that_lapses_during_the_read_is_a_clean_miss(monkeypatch):
    from kvpool.client.transfer import GetJob

    finish = GetJob.finish

    async def main():
        async with cluster(lease_ttl_ms=2_000) as (master, _):
            async with await AsyncStore.open(master.endpoint, shm_enabled=False) as store:
                await store.put("short-lease", b"v" * 200_000)
                address = store.register_buffer(bytearray(200_000))
                assert await store.get("short-lease") == b"v" * 200_000
                # The read now "takes" 3 s: longer than the lease, so the bytes are not trusted.
                monkeypatch.setattr(GetJob, "finish", lambda job, now_ms: finish(job, now_ms + 3_000))
                assert await store.get("short-lease") is None
                assert await store.get_into("short-lease", address, 200_000) == ErrorCode.LEASE_EXPIRED

    run(main())


def test_an_unreachable_master_is_a_typed_error_within_the_bound():
    from kvpool.errors import TransportError

    async def main():
        async with cluster() as (master, _):
            store = await AsyncStore.open(master.endpoint, rpc_timeout_ms=500, connect_timeout_ms=500)
            await store.put("before", b"x")
        # The master and nodes are gone now.
        started = time.monotonic()
        for call in (store.get("before"), store.put("after", b"y"), store.exists("before")):
            with pytest.raises(TransportError):
                await call
        assert time.monotonic() - started < 5
        await store.aclose()

    run(main())


def test_a_key_repeated_in_one_batch_is_put_once():
    async def main():
        async with cluster() as (master, _):
            async with await AsyncStore.open(master.endpoint) as store:
                codes = await store.put_batch(["d", "e", "d"], [b"same", b"other", b"same"])
                assert codes == [ErrorCode.OK] * 3
                assert await store.get_batch(["d", "e"]) == [b"same", b"other"]

    run(main())


def test_the_sync_hand_off_returns_raises_and_cancels_on_its_bound() -> None:
    """Store's calls go through the loop thread: results and errors come back as they are,
    and a call past its bound raises RpcTimeout once its cancellation has ended on the loop
    (a get cancelled mid-reply stops landing bytes in the caller's buffers as it ends)."""
    from kvpool.client.sync import _LoopThread
    from kvpool.errors import RpcTimeout

    loop_thread = _LoopThread.get()

    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    async def fail() -> None:
        raise ObjectNotFound("gone")

    ended = threading.Event()

    async def stall() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await asyncio.sleep(0.1)  # a clean-up that takes a few loop turns
            ended.set()
            raise

    assert loop_thread.run(answer(), 1_000) == 42
    with pytest.raises(ObjectNotFound):
        loop_thread.run(fail(), 1_000)
    started = time.monotonic()
    with pytest.raises(RpcTimeout):
        loop_thread.run(stall(), 200)
    assert time.monotonic() - started < 5
    assert ended.is_set(), "RpcTimeout came before the call's cancellation had ended"


@pytest.mark.parametrize("replica_num", [1, 2])
@pytest.mark.parametrize("shm_enabled", [True, False], ids=["shm", "tcp"])
def test_a_writer_whose_bytes_miss_their_checksum_never_serves_them(shm_enabled, replica_num):
    """The master answers put_end before the nodes verify the bytes. A writer that sends a
    checksum its bytes do not have gets its answer, but no reader ever gets those bytes: a
    read before the node's verdict fails the checksum (a miss), and the verdict drops the
    object and frees its space. A same-host writer's single replica is not hashed at commit
    (PutEnd.hashed_in_place): there the reader's report is what has the node check it."""

    async def main():
        async with cluster() as (master, _):
            async with await AsyncStore.open(master.endpoint, shm_enabled=shm_enabled) as store:
                value = os.urandom(300_000)
                config = ReplicateConfig(replica_num=replica_num)
                job = await store._put_start(["liar"], [[memoryview(value)]], config)
                job.copy_local()
                job.checksums[0] ^= 1  # the lie
                await store._put_finish(job)
                assert await store.get("liar") is None
                assert await gone(store, "liar")
                for _ in range(200):  # the drops are acknowledged at the master's next tick
                    status = await store.cluster_status()
                    if all(s.used_bytes == 0 for s in status.segments):
                        break
                    await asyncio.sleep(0.05)
                assert [s.used_bytes for s in status.segments] == [0, 0]
                # An honest writer of the same key is served.
                await store.put("liar", value)
                assert await store.get("liar") == value

    run(main())


@pytest.mark.parametrize("size", [4096, 20_000], ids=["page", "larger"])
@pytest.mark.parametrize("shm_enabled", [True, False], ids=["shm", "tcp"])
def test_a_rotten_replica_goes_alone_and_its_object_is_served_from_the_other(shm_enabled, size):
    """Two replicas, the one read first rots after the commit: the get still returns the
    object's bytes (from the other replica), the reader's report has the node confirm the bad
    one, and only that replica is dropped (from the master and its node's inventory); the
    object stays, served from the sound replica. A page (a plain get over TCP lands pages
    together, one buffer per frame) and a larger object."""

    async def main():
        async with cluster(node_count=2) as (master, nodes):
            async with await AsyncStore.open(master.endpoint, shm_enabled=shm_enabled) as store:
                value = os.urandom(size)
                await store.put("twice", value, ReplicateConfig(replica_num=2))
                first, second = (await store.query(["twice"])).replicas[0]
                node = {n.segment_id: n for n in nodes}[first.segment_id]
                node.segment.data[first.offset + 5] ^= 0x01
                assert await store.get("twice") == value  # from the second replica
                deadline = asyncio.get_running_loop().time() + 3
                while len((await store.query(["twice"])).replicas[0]) == 2:
                    assert asyncio.get_running_loop().time() < deadline, "the bad replica stayed"
                    await asyncio.sleep(0.02)
                assert (await store.query(["twice"])).replicas[0] == [second]
                while node.inventory.get("twice") is not None:  # dropped at the master's next tick
                    assert asyncio.get_running_loop().time() < deadline + 2, "the node kept the bad replica"
                    await asyncio.sleep(0.05)
                assert await store.get("twice") == value

    run(main())


@pytest.mark.parametrize("shm_enabled", [True, False], ids=["shm", "tcp"])
def test_bytes_that_rot_after_their_commit_are_found_confirmed_and_dropped(shm_enabled):
    """A replica whose bytes change after the commit (a bit flip, a stale writer) reads as a
    miss; the reader reports it, the node hashes it and agrees, the master drops the object,
    and the key can be put again. A report alone changes nothing: an intact replica stays."""

    async def main():
        async with cluster(node_count=1) as (master, nodes):
            async with await AsyncStore.open(master.endpoint, shm_enabled=shm_enabled) as store:
                value, other = os.urandom(5000), os.urandom(5000)
                await store.put_batch(["rotten", "sound"], [value, other])
                entry = nodes[0].inventory.get("rotten")
                nodes[0].segment.data[entry.offset + 17] ^= 0x40  # one bit, after the commit
                assert await store.get("rotten") is None
                assert await gone(store, "rotten")
                # A false report (the bytes are fine) is checked and changes nothing.
                sound = nodes[0].inventory.get("sound")
                await store._master.call(
                    ReportBadReplicas(["sound"], [nodes[0].segment_id], [sound.offset]), is_idempotent=True
                )
                await asyncio.sleep(0.3)
                assert await store.get("sound") == other
                await store.put("rotten", value)
                assert await store.get("rotten") == value

    run(main())


async def _used_bytes(store: AsyncStore) -> int:
    return sum(s.used_bytes for s in (await store.cluster_status()).segments)


async def _put_again(store: AsyncStore, keys: list[str], values: list[bytes]) -> list[int]:
    """The put of keys a cancelled put held, once the revoke sent in the background landed
    (bounded: before, the keys refused puts until the master discarded them, 30 s later)."""
    deadline = asyncio.get_running_loop().time() + 2
    while (codes := await store.put_batch(keys, values)) != [ErrorCode.OK] * len(keys):
        assert set(codes) == {ErrorCode.REPLICA_IS_NOT_READY}, codes
        assert asyncio.get_running_loop().time() < deadline, "the cancelled put still holds its keys"
        await asyncio.sleep(0.01)
    return codes


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
def test_a_put_cancelled_before_its_put_start_answer_gives_back_its_keys_and_space(shm):
    """An engine cancels a put (a request aborted, a sync call timed out) while the master
    allocates: the answer that comes after the cancel is revoked at once (nothing was written
    into it), so the keys can be put again and the space is free, instead of the keys refusing
    puts until the discard timeout and the space lost until the release timeout."""
    from kvpool.master.allocator import footprint_bytes

    async def main():
        async with cluster(1, 64 << 20) as (master, _):
            async with await AsyncStore.open(master.endpoint, shm_enabled=shm) as store:
                keys, values = [f"k{i}" for i in range(8)], [os.urandom(1 << 20) for _ in range(8)]
                task = asyncio.ensure_future(store.put_batch(keys, values))
                await asyncio.sleep(0)  # the put_start is on its way
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                await _put_again(store, keys, values)
                assert await store.get_batch(keys) == values
                assert await _used_bytes(store) == 8 * footprint_bytes(1 << 20)  # no range held back

    run(main())


def test_a_put_cancelled_mid_write_frees_its_keys_at_once_and_its_ranges_after_the_release_timeout():
    """A put over TCP cancelled while its frames are on their way to the node: a frame may land
    yet, so its keys are revoked with their writes in flight: free to put again at once, their
    ranges quarantined (not handed to another object a late frame would overwrite)."""
    from kvpool.master.allocator import footprint_bytes

    async def main():
        async with cluster(1, 64 << 20, put_discard_timeout_ms=1_000, put_release_timeout_ms=1_500) as (master, _):
            async with await AsyncStore.open(master.endpoint, shm_enabled=False) as store:
                keys, values = [f"k{i}" for i in range(8)], [os.urandom(1 << 20) for _ in range(8)]
                writing = asyncio.Event()
                run_batches = store._run_batches

                async def writes_started(batches, timeout_ms=None):
                    writing.set()
                    return await run_batches(batches, timeout_ms)

                store._run_batches = writes_started
                task = asyncio.ensure_future(store.put_batch(keys, values))
                await writing.wait()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                del store._run_batches
                await _put_again(store, keys, values)
                assert await store.get_batch(keys) == values
                assert await _used_bytes(store) == 16 * footprint_bytes(1 << 20)  # 8 quarantined
                await asyncio.sleep(1.5)  # the release timeout: the master's tick frees them
                deadline = asyncio.get_running_loop().time() + 2
                while await _used_bytes(store) != 8 * footprint_bytes(1 << 20):
                    assert asyncio.get_running_loop().time() < deadline
                    await asyncio.sleep(0.05)
                assert await store.get_batch(keys) == values

    run(main())


def deleted_segment_maps() -> list[str]:
    """This process's mappings of segment files whose node unlinked them."""
    with open("/proc/self/maps") as maps:
        return [line for line in maps if "kvpool-" in line and line.rstrip().endswith("(deleted)")]


def test_segments_of_nodes_that_restarted_are_unmapped(monkeypatch: pytest.MonkeyPatch):
    """A long-lived same-host client kept every segment it ever mapped: after each restart of a
    node on its host, the old segment's whole memory (the file unlinked, still mapped) and a
    descriptor (helper-53: 6 mappings, 201 MiB of /dev/shm after 5 restarts of a 32 MiB node).
    Now a segment whose file is gone is forgotten when the next is mapped, and unmapped a
    while later (MAPPED_SEGMENT_RETIRE_MS, cut to 0.2 s here)."""
    import kvpool.client.store as store_module

    monkeypatch.setattr(store_module, "MAPPED_SEGMENT_RETIRE_MS", 200)

    async def main():
        async with cluster(0) as (master, _):
            async with await AsyncStore.open(master.endpoint) as store:
                for restart in range(3):
                    node = Node(NodeConfig(master_endpoint=master.endpoint, memory_bytes=8 << 20))
                    await node.start()
                    await store.put(f"k{restart}", b"v" * 4096)
                    assert await store.get(f"k{restart}") == b"v" * 4096
                    await node.stop()  # unlinks its file; this store still maps it
                node = Node(NodeConfig(master_endpoint=master.endpoint, memory_bytes=8 << 20))
                await node.start()
                try:
                    await store.put("last", b"w" * 4096)
                    assert await store.get("last") == b"w" * 4096
                    assert len([s for s in store._mapped.values() if s is not None]) == 1
                    await asyncio.sleep(0.5)
                    assert deleted_segment_maps() == []
                    assert await store.get("last") == b"w" * 4096  # the live one stays mapped
                finally:
                    await node.stop()

    run(main())


def test_the_segment_of_a_node_stopped_for_good_is_unmapped(monkeypatch: pytest.MonkeyPatch):
    """A node stopped and not restarted (scaled down, moved to another host): its segment was
    unmapped only when the client mapped another one, so a long-lived same-host client held
    all its memory in /dev/shm (review helper-69: 256 MiB). A mapped segment's file is looked
    at every MAPPED_SEGMENT_SWEEP_MS (cut to 0.1 s here, the unmapping after to 0.2 s)."""
    import kvpool.client.store as store_module

    monkeypatch.setattr(store_module, "MAPPED_SEGMENT_SWEEP_MS", 100)
    monkeypatch.setattr(store_module, "MAPPED_SEGMENT_RETIRE_MS", 200)

    async def main():
        async with cluster(0) as (master, _):
            async with await AsyncStore.open(master.endpoint) as store:
                node = Node(NodeConfig(master_endpoint=master.endpoint, memory_bytes=8 << 20))
                await node.start()
                await store.put("k", b"v" * 4096)
                assert await store.get("k") == b"v" * 4096
                await node.stop()  # unlinks its file; this store still maps it
                assert deleted_segment_maps() != []
                deadline = asyncio.get_running_loop().time() + 10
                while deleted_segment_maps():
                    assert asyncio.get_running_loop().time() < deadline, deleted_segment_maps()
                    await asyncio.sleep(0.05)
                assert [s for s in store._mapped.values() if s is not None] == []

    run(main())


def test_a_batch_over_the_limit_is_refused_here_and_the_store_goes_on():
    """A batch of more than BATCH_KEYS_MAX keys is InvalidParams, said by the client: the
    master's decoder refuses such a request and closes its connection (protocol/messages.py
    Batch), which callers would see as RpcFailed."""

    async def main():
        async with cluster(1, 16 << 20) as (master, _):
            async with await AsyncStore.open(master.endpoint) as store:
                too_many = [f"k{i}" for i in range(limits.BATCH_KEYS_MAX + 1)]
                for call in (store.batch_exists, store.get_batch, store.longest_prefix, store.batch_remove):
                    with pytest.raises(InvalidParams, match=f"{len(too_many)} keys in one batch"):
                        await call(too_many)
                with pytest.raises(InvalidParams, match="keys in one batch"):
                    await store.put_batch(too_many, [b"v"] * len(too_many))
                await store.put("k", b"v")
                assert await store.get("k") == b"v"

    run(main())


def test_a_put_whose_end_comes_after_the_master_gave_it_up_says_so():
    """A writer stalled between its writes and its put_end for longer than the grants: the
    master has discarded the put, and the put raises an error that says why (it said
    "OBJECT_NOT_FOUND" alone: a riddle for a put). The key is free to put again."""

    async def main():
        async with cluster(1, 64 << 20, put_discard_timeout_ms=1_000, put_release_timeout_ms=1_500) as (master, _):
            async with await AsyncStore.open(master.endpoint) as store:
                call = store._master.call

                async def late_put_end(message, *args, **kwargs):
                    if isinstance(message, PutEnd):
                        await asyncio.sleep(2.0)  # past the discard timeout, and a tick of the master
                    return await call(message, *args, **kwargs)

                store._master.call = late_put_end
                with pytest.raises(ObjectNotFound, match="the master had given the put up before it ended"):
                    await store.put("late", b"v" * 4096)
                store._master.call = call
                await store.put("late", b"w" * 4096)
                assert await store.get("late") == b"w" * 4096

    run(main())


async def _removed_once_the_lease_is_back(store: AsyncStore, key: str) -> None:
    """A plain remove refuses an object under a read lease (10 s): it goes through within a
    bound only if the cancelled get gave its lease back."""
    deadline = asyncio.get_running_loop().time() + 2
    while True:
        try:
            await store.remove(key)
            return
        except ObjectHasLease:
            assert asyncio.get_running_loop().time() < deadline, "the cancelled get kept its read lease"
            await asyncio.sleep(0.02)


@pytest.mark.parametrize("step", ["lookup", "read"])
def test_a_get_cancelled_at_any_step_gives_its_read_leases_back(step):
    """A cancelled get (the lookup answered after the cancel, or the read from the node cut
    short) gives its read leases back at once: until then eviction and a plain remove skip
    those objects, for up to the lease TTL."""

    async def main():
        async with cluster(1) as (master, _):
            async with await AsyncStore.open(master.endpoint, shm_enabled=False) as store:
                await store.put("k", os.urandom(4 << 20))
                reading = asyncio.Event()
                if step == "read":
                    read_remote = store._read_remote

                    async def read_started(job):
                        reading.set()
                        return await read_remote(job)

                    store._read_remote = read_started
                task = asyncio.ensure_future(store.get("k"))
                await (reading.wait() if step == "read" else asyncio.sleep(0))
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                await _removed_once_the_lease_is_back(store, "k")
                assert await store.get("k") is None

    run(main())


def test_a_get_in_pieces_cancelled_mid_copy_gives_back_the_leases_of_pieces_it_did_not_reach():
    """The lookups of later pieces were answered already when the get was cancelled during the
    first piece's copies: their leases were dropped with them (cancelling a finished lookup
    does nothing), and a plain remove of their keys refused for the lease TTL."""

    async def main():
        async with cluster(1) as (master, _):
            async with await AsyncStore.open(master.endpoint, shm_enabled=False) as store:
                keys = [f"k{i}" for i in range(8)]
                await store.put_batch(keys, [os.urandom(4096) for _ in keys])
                copy_local, copies = store._copy_local, []

                def first_piece_slow(job):
                    copies.append(job)
                    return asyncio.ensure_future(asyncio.sleep(5)) if len(copies) == 1 else copy_local(job)

                store._copy_local = first_piece_slow
                task = asyncio.ensure_future(store._located_in_pieces(keys, [None] * 8, None, [(0, 4), (4, 8)]))
                while len(copies) < 1:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.2)  # the second piece's lookup is answered meanwhile
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                for key in ("k0", "k7"):  # a piece reached, and one not
                    await _removed_once_the_lease_is_back(store, key)

    run(main())


def put_again_within(store: Store, keys: list[str], pages: list[bytes], seconds: float) -> None:
    """Put `keys` again until every one is stored, within `seconds`: keys an aborted put left
    pending answer REPLICA_IS_NOT_READY until given back."""
    deadline = time.monotonic() + seconds
    while (codes := store.put_batch(keys, pages)) != [ErrorCode.OK] * len(keys):
        assert set(codes) <= {ErrorCode.OK, ErrorCode.REPLICA_IS_NOT_READY}, set(codes)
        assert time.monotonic() < deadline, codes.count(ErrorCode.REPLICA_IS_NOT_READY)
        time.sleep(0.05)
    assert store.get_batch(keys) == pages


@pytest.mark.parametrize("api", ["Store", "AsyncStore", "Store in pieces"])
def test_a_put_start_answered_after_the_rpc_timeout_gives_its_keys_back(monkeypatch, api):
    """The master answers a put_start after the client's RPC timeout: the grants it carries
    are revoked when it comes (the sync Store sends it on the caller thread's own connection,
    which it closed at the timeout). Before, the key refused puts until the discard timeout."""
    import inspect

    from kvpool.errors import RpcTimeout

    answered = MasterServer._put_start
    calls = []
    late_one_answered = threading.Event()

    def first_one_late(self, message):
        calls.append(message)
        if len(calls) > 1:
            return answered(self, message)

        async def later():
            await asyncio.sleep(1.0)
            reply = answered(self, message)
            late_one_answered.set()  # its grants are the master's now: the key is taken
            return await reply if inspect.isawaitable(reply) else reply

        return later()

    monkeypatch.setattr(MasterServer, "_put_start", first_one_late)
    value = os.urandom(1 << 20)

    def put_again(put) -> None:
        deadline = time.monotonic() + 3
        while (codes := put()) != [ErrorCode.OK]:
            assert codes == [ErrorCode.REPLICA_IS_NOT_READY] and time.monotonic() < deadline, codes
            time.sleep(0.05)

    with cluster_on_a_thread(put_discard_timeout_ms=20_000, put_release_timeout_ms=60_000) as endpoint:
        if api == "Store in pieces":  # a batch of pages from a same-host client: put_starts pipelined
            keys, pages = [f"page-{i}" for i in range(512)], [os.urandom(4096) for _ in range(512)]
            with Store(endpoint, rpc_timeout_ms=400) as store:
                with pytest.raises(RpcTimeout):
                    store.put_batch(keys, pages)
                assert late_one_answered.wait(5)
                put_again_within(store, keys, pages, 3)
        elif api == "Store":
            with Store(endpoint, rpc_timeout_ms=400, shm_enabled=False) as store:
                with pytest.raises(RpcTimeout):
                    store.put_batch(["k"], [value])
                assert late_one_answered.wait(5)
                put_again(lambda: store.put_batch(["k"], [value]))
                assert store.get("k") == value
        else:

            async def main():
                async with await AsyncStore.open(endpoint, rpc_timeout_ms=400, shm_enabled=False) as store:
                    with pytest.raises(RpcTimeout):
                        await store.put_batch(["k"], [value])
                    assert await asyncio.to_thread(late_one_answered.wait, 5)
                    deadline = time.monotonic() + 3
                    while (codes := await store.put_batch(["k"], [value])) != [ErrorCode.OK]:
                        assert codes == [ErrorCode.REPLICA_IS_NOT_READY] and time.monotonic() < deadline, codes
                        await asyncio.sleep(0.05)
                    assert await store.get("k") == value

            run(main())


def one_request_answered_late(monkeypatch, kind: type[Message], key: str, delay_s: float = 1.0) -> threading.Event:
    """The master carries out the first request of `kind` that names `key` only `delay_s`
    later (what it grants, it grants then: a master stalled by a pause), and answers it then;
    the event is set once it has carried it out. Patch before the cluster starts."""
    import inspect

    handle = MasterServer.handle
    carried_out = threading.Event()
    delayed: list[Message] = []

    def handle_late(self, conn, message):
        if delayed or not isinstance(message, kind) or key not in message.keys:  # type: ignore[attr-defined]
            return handle(self, conn, message)
        delayed.append(message)

        async def later():
            await asyncio.sleep(delay_s)
            reply = handle(self, conn, message)
            carried_out.set()
            return await reply if inspect.isawaitable(reply) else reply

        return later()

    monkeypatch.setattr(MasterServer, "handle", handle_late)
    return carried_out


def removed_once_the_lease_is_back(store: Store, key: str, timeout_s: float = 3.0) -> None:
    """A plain remove refuses an object under a read lease (10 s): it goes through within the
    bound only if the get that took the lease gave it back."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            store.remove(key)
            return
        except ObjectHasLease:
            assert time.monotonic() < deadline, f"{key} kept its read lease"
            time.sleep(0.02)


@pytest.mark.parametrize("through_the_loop", [False, True], ids=["own-connection", "loop"])
@pytest.mark.parametrize("key_count", [1, 512], ids=["one-lookup", "in-pieces"])
def test_a_sync_get_whose_lookup_times_out_gives_its_read_leases_back(monkeypatch, through_the_loop, key_count):
    """A sync Store's lookup that the master answers after the RPC timeout: the get raises
    RpcTimeout, and the read leases the late answer grants go back when it comes, with those
    of the pieces of a large get answered before and after it. They were kept for the lease
    TTL (10 s), and eviction and a plain remove skipped those objects until then."""
    from kvpool.client import sync
    from kvpool.errors import RpcTimeout

    if through_the_loop:
        monkeypatch.setattr(sync, "DIRECT_LINKS_MAX", 0)  # no thread has a connection of its own
    keys = [f"page-{i}" for i in range(key_count)]
    late_key = keys[len(keys) // 2]  # in pieces (8 of 64 keys): the fifth piece's first key
    carried_out = one_request_answered_late(monkeypatch, GetReplicaList, late_key)
    with cluster_on_a_thread() as endpoint:
        with Store(endpoint) as writer:  # the short timeout is the lookup's: a busy machine puts slower
            assert writer.put_batch(keys, [os.urandom(4096) for _ in keys]) == [ErrorCode.OK] * key_count
        with Store(endpoint, rpc_timeout_ms=400) as store:
            with pytest.raises(RpcTimeout):
                store.get_batch(keys)
            assert carried_out.wait(5)
            for key in dict.fromkeys([keys[0], late_key, keys[-1]]):  # pieces answered before, late, after
                removed_once_the_lease_is_back(store, key)


def test_a_sync_put_in_pieces_whose_later_piece_times_out_gives_back_the_pieces_answered(monkeypatch):
    """A same-host put of many pages goes in pieces whose put_starts leave together. One
    answered after the RPC timeout fails the put (RpcTimeout) when the pieces before it are
    granted and copied already: their keys refused puts (REPLICA_IS_NOT_READY) until the
    master discarded them, and their ranges were quarantined until the release timeout. They
    are revoked at once: the put again succeeds, with no space held back."""
    from kvpool.errors import RpcTimeout
    from kvpool.master.allocator import footprint_bytes

    keys, pages = [f"page-{i}" for i in range(512)], [os.urandom(4096) for _ in range(512)]
    carried_out = one_request_answered_late(monkeypatch, PutStart, keys[256])  # the fifth of 8 pieces
    with cluster_on_a_thread(put_discard_timeout_ms=20_000, put_release_timeout_ms=60_000) as endpoint:
        with Store(endpoint, rpc_timeout_ms=400) as store:
            with pytest.raises(RpcTimeout):
                store.put_batch(keys, pages)
            assert carried_out.wait(5)
            put_again_within(store, keys, pages, 3)
            used_bytes = sum(segment.used_bytes for segment in store.cluster_status().segments)
            assert used_bytes == len(keys) * footprint_bytes(4096)  # nothing quarantined


def test_a_sync_get_interrupted_in_its_reads_gives_its_read_leases_back():
    """Ctrl-C (or a timeout) while a sync Store's get reads from a node in the caller's
    thread: the get's read leases went back only at their TTL, and eviction and a plain remove
    skipped those objects until then."""
    with cluster_on_a_thread() as endpoint, Store(endpoint, shm_enabled=False) as store:
        store.put("k", os.urandom(64 * 1024))

        def interrupted(job):
            raise KeyboardInterrupt

        store._nodes.read = interrupted
        with pytest.raises(KeyboardInterrupt):
            store.get("k")
        deadline = time.monotonic() + 2
        while True:
            try:
                store.remove("k")
                break
            except ObjectHasLease:
                assert time.monotonic() < deadline, "the interrupted get kept its read lease"
                time.sleep(0.02)


def put_once_given_back(store: Store, keys: list[str], values: list[bytes], waiting_codes: set[int]):
    """Put `keys` again until they are stored, within 3 s, each try answered only with
    `waiting_codes` (the keys of an interrupted put are given back at once, not after the
    30 s discard); then read them back. Returns the cluster status: no put left pending."""
    deadline = time.monotonic() + 3
    while (codes := store.put_batch(keys, values)) != [0] * len(keys):
        assert set(codes) <= waiting_codes, codes
        assert time.monotonic() < deadline, f"the interrupted put stayed pending: {codes}"
        time.sleep(0.02)
    assert store.get_batch(keys) == values
    status = store.cluster_status()
    assert status.pending_count == 0
    return status


def test_a_sync_put_interrupted_while_it_waits_or_writes_gives_its_keys_back(monkeypatch):
    """Ctrl-C while a sync Store's put waited for its put_start answer, or wrote to a node,
    in the caller's thread: the put was left pending at the master, the keys refused puts
    (REPLICA_IS_NOT_READY) until the discard timeout (30 s), and the ranges of the first
    stayed quarantined for the release timeout after. Now an answer that comes after the
    interrupt has its grants given back, and a put interrupted in its writes is revoked."""
    from kvpool.transports.blocking import BlockingConnection

    with cluster_on_a_thread() as endpoint, Store(endpoint, shm_enabled=False) as store:
        value = os.urandom(100_000)
        store.put("warm-up", value)  # the caller thread's own connection to the master
        receive = BlockingConnection._receive

        def interrupted_once(self, deadline):
            monkeypatch.setattr(BlockingConnection, "_receive", receive)
            raise KeyboardInterrupt

        monkeypatch.setattr(BlockingConnection, "_receive", interrupted_once)
        with pytest.raises(KeyboardInterrupt):
            store.put("waited", value)
        write = store._nodes.write

        def interrupted(batches):
            raise KeyboardInterrupt

        store._nodes.write = interrupted
        with pytest.raises(KeyboardInterrupt):
            store.put("wrote", value)
        store._nodes.write = write
        put_once_given_back(store, ["waited", "wrote"], [value, value], {0, ErrorCode.REPLICA_IS_NOT_READY})


def test_a_sync_put_interrupted_while_it_maps_the_segment_gives_its_keys_back(make_cluster, monkeypatch):
    """Ctrl-C after a sync put's put_start was answered but before its job was made (a
    Store's first put to a node's host maps that node's segment then): its grants were never
    given back, the keys refused puts for 30 s and their ranges were quarantined for 10
    minutes after. With 128 MiB of a 256 MiB node held so, the next puts evicted each other."""
    from kvpool.node.segment import Segment

    cluster = make_cluster(1, "64MiB")
    open_mapped = Segment.open_mapped

    def interrupted_once(*args):
        monkeypatch.setattr(Segment, "open_mapped", open_mapped)
        raise KeyboardInterrupt

    monkeypatch.setattr(Segment, "open_mapped", staticmethod(interrupted_once))
    value = os.urandom(8 << 20)
    with Store(cluster.master_endpoint) as store:
        with pytest.raises(KeyboardInterrupt):
            store.put_batch(["first", "second"], [value, value])
        status = put_once_given_back(store, ["first", "second"], [value, value], {ErrorCode.REPLICA_IS_NOT_READY})
        assert sum(s.used_bytes for s in status.segments) < 17 << 20  # nothing held besides the two


def test_a_sync_put_beside_another_interrupted_in_its_copy_gives_its_keys_back(make_cluster, monkeypatch):
    """Ctrl-C while a sync put of over 1 MiB, made while another put of the Store was in
    flight (its put_start through the loop), copied into a mapped segment in the caller's
    thread: its grants were never given back (the lone put's way did), the keys refused
    puts for 30 s and their ranges were quarantined for 10 minutes after."""
    from kvpool.client.transfer import PutJob

    cluster = make_cluster(1, "64MiB")
    copy_local = PutJob.copy_local

    def interrupted_once(job):
        monkeypatch.setattr(PutJob, "copy_local", copy_local)
        raise KeyboardInterrupt

    value = os.urandom(4 << 20)
    with Store(cluster.master_endpoint) as store:
        store.put("warm-up", b"w")  # the node's segment mapped here
        monkeypatch.setattr(PutJob, "copy_local", interrupted_once)
        store._puts_in_flight += 1  # another thread's put under way: this one goes through the loop
        try:
            with pytest.raises(KeyboardInterrupt):
                store.put_batch(["first", "second"], [value, value])
        finally:
            store._puts_in_flight -= 1
        status = put_once_given_back(store, ["first", "second"], [value, value], {ErrorCode.REPLICA_IS_NOT_READY})
        assert sum(s.used_bytes for s in status.segments) < 9 << 20  # nothing held besides the two


@pytest.mark.parametrize("shm_enabled", [False, True])
def test_a_node_checks_write_grants_against_the_masters_clock_not_its_own(monkeypatch, caplog, shm_enabled):
    """A write grant expires 30 s after its put started, in the master's time. A node whose
    clock ran ahead of the master's by more (here the master's runs two minutes behind) refused
    every write as expired, and every put failed. The node now checks grants against the
    master's time, which mount and heartbeat replies carry, and says once that its clock is off."""
    from kvpool.master import server as server_module

    real_clock_ms = server_module.wall_clock_ms
    monkeypatch.setattr(server_module, "wall_clock_ms", lambda: real_clock_ms() - 120_000)
    value = os.urandom(100_000)

    async def main():
        async with cluster(node_count=1) as (master, nodes):
            async with await AsyncStore.open(master.endpoint, shm_enabled=shm_enabled) as store:
                await store.put("k", value)
                assert await store.get("k") == value
            assert -121 < nodes[0].metrics.master_clock_offset._value.get() < -119

    with caplog.at_level(logging.WARNING, logger="kvpool.node.clock"):
        run(main())
    assert caplog.text.count("s ahead of the master's") == 1
    assert "120.0 s ahead of the master's" in caplog.text


def test_a_node_whose_master_link_fails_with_an_untyped_error_mounts_again(monkeypatch, caplog):
    """Only kvpool's typed errors used to be retried: anything else (a bug, an OS error no layer
    below turned into one) ended the link's task, and the node stayed up but unmounted for good,
    its memory lost to the cluster. Now the failure is logged with its traceback and retried."""
    real_mount = Node._mount
    failures = []

    async def mount_failing_once(self, conn):
        if not failures:
            failures.append(1)
            raise OSError(24, "Too many open files")
        await real_mount(self, conn)

    monkeypatch.setattr(Node, "_mount", mount_failing_once)

    async def main():
        async with cluster(node_count=1) as (master, nodes):
            await nodes[0].wait_mounted(5_000)
            async with await AsyncStore.open(master.endpoint) as store:
                await store.put("k", b"v" * 1000)
                assert await store.get("k") == b"v" * 1000

    with caplog.at_level(logging.ERROR, logger="kvpool.node.server"):
        run(main())
    assert failures == [1]
    assert "master link failed unexpectedly" in caplog.text and "Too many open files" in caplog.text


@pytest.mark.parametrize("shm_enabled", [True, False], ids=["shm", "tcp"])
def test_a_put_whose_put_end_failed_can_be_put_again_at_once(shm_enabled):
    """A put_end that never reached the master (its connection broke) failed the put, and
    left its keys pending there until the discard timeout (30 s): a put of them again was
    refused (REPLICA_IS_NOT_READY) all that while. The client now revokes them in the
    background, and the put again succeeds at once, through AsyncStore and through Store."""

    def break_the_first_put_end(call):
        broken = []

        async def failing_once(message: Message, **kwargs):
            if isinstance(message, PutEnd) and not broken:
                broken.append(message)
                raise RpcFailed("connection to the master broke (test)")
            return await call(message, **kwargs)

        return failing_once, broken

    async def main():
        async with cluster() as (master, _):
            async with await AsyncStore.open(master.endpoint, shm_enabled=shm_enabled) as store:
                value = os.urandom(200_000)
                store._master.call, broken = break_the_first_put_end(store._master.call)
                with pytest.raises(RpcFailed):
                    await store.put_batch(["k", "j"], [value, value])
                assert broken
                started = asyncio.get_running_loop().time()
                while (codes := await store.put_batch(["k", "j"], [value, value])) != [0, 0]:
                    assert set(codes) == {ErrorCode.REPLICA_IS_NOT_READY}, codes
                    assert asyncio.get_running_loop().time() - started < 2, "the keys stayed pending"
                    await asyncio.sleep(0.02)
                assert await store.get_batch(["k", "j"]) == [value, value]

    run(main())

    with cluster_on_a_thread() as endpoint, Store(endpoint, shm_enabled=shm_enabled) as store:
        value = os.urandom(200_000)
        ask = store._ask
        broken = []

        def failing_once(message: Message, **kwargs):
            if isinstance(message, PutEnd) and not broken:
                broken.append(message)
                raise RpcFailed("connection to the master broke (test)")
            return ask(message, **kwargs)

        store._ask = failing_once
        with pytest.raises(RpcFailed):
            store.put("k", value)
        assert broken
        deadline = time.monotonic() + 2
        while (code := store.put_batch(["k"], [value])[0]) != 0:
            assert code == ErrorCode.REPLICA_IS_NOT_READY and time.monotonic() < deadline, code
            time.sleep(0.02)
        assert store.get("k") == value


def test_a_key_whose_write_to_one_replica_failed_stays_quarantined_when_its_put_end_fails():
    """Revoking after a failed put_end: a key written to one node but not the other (that
    write timed out, and its frame may land yet) is revoked with its writes in flight, so its
    ranges stay quarantined; freed at once, another put could be placed there and overwritten."""

    async def main():
        async with cluster(node_count=2) as (master, _):
            async with await AsyncStore.open(master.endpoint, shm_enabled=False) as store:
                call, revokes = store._master.call, []

                async def spied(message: Message, **kwargs):
                    if isinstance(message, PutEnd):
                        raise RpcFailed("connection to the master broke (test)")
                    if isinstance(message, PutRevoke):
                        revokes.append(message)
                    return await call(message, **kwargs)

                run_batches = store._run_batches

                async def second_replica_fails(batches, timeout_ms=None):
                    results = await run_batches(batches, timeout_ms)
                    return [results[0]] + [{i for owners in b.owners for i in owners} for b in batches[1:]]

                store._master.call, store._run_batches = spied, second_replica_fails
                with pytest.raises(RpcFailed):
                    await store.put_batch(["k"], [os.urandom(200_000)], ReplicateConfig(replica_num=2))
                for _ in range(100):
                    if revokes:
                        break
                    await asyncio.sleep(0.01)
                assert revokes and all(revoke.writes_in_flight for revoke in revokes), revokes

    run(main())
