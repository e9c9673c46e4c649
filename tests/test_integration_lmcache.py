"""kvpool's LMCache remote storage plugin, loaded and driven through the real LMCache package.

How: LMCache's own CreateConnector("plugin://kvpool", ...) finds kvpool's adapter from the
`remote_storage_plugins` + `remote_storage_plugin.kvpool.*` extra config, exactly as LMCache's
RemoteBackend does, against a LocalCluster; chunks are real MemoryObjs allocated by a real
LocalCPUBackend. Instance A stores chunks; instance B (its own CPU backend and Store) finds
them (batched contains, exists), reads them back (full and partial chunks, with and without
LMCache's remote metadata header) and lists them; then a dead master turns every call into a
miss without an exception.

LMCache cannot be installed with its dependencies here (it needs cupy-cuda13x, cuda-python,
nvtx and cufile-python, and numpy<=2.2.6); scripts/install-peers.sh lmcache installs it with
--no-deps plus the pure-Python packages its storage modules import. Skipped unless it imports.
"""

from __future__ import annotations

import asyncio
import signal
import struct
import threading
import time

import pytest
from conftest import removed_as_released, wait_until

torch = pytest.importorskip("torch", reason="needs torch==2.13.0")
pytest.importorskip(
    "lmcache.v1.storage_backend.connector",
    reason="LMCache is not installed (scripts/install-peers.sh lmcache)",
)
from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1 import protocol  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.connector import CreateConnector  # noqa: E402
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: E402

from kvpool import ErrorCode, Store  # noqa: E402

CHUNK = 16
KV_SHAPE = (3, 2, CHUNK, 2, 8)  # layers, k/v, tokens, heads, head size


class Instance:
    """One LMCache worker: its config, CPU backend and connector, on its own event loop."""

    def __init__(self, master: str, save_chunk_meta: bool = True, worker: tuple[int, int] = (0, 1), mla: bool = False,
                 **options) -> None:  # fmt: skip
        self.config = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.05,
            remote_storage_plugins=["kvpool"],
            extra_config={
                "remote_storage_plugin.kvpool.module_path": "kvpool.integrations.lmcache",
                "remote_storage_plugin.kvpool.class_name": "KVPoolConnectorAdapter",
                "kvpool.master": master, "save_chunk_meta": save_chunk_meta,
                **{f"kvpool.{name}": value for name, value in options.items()},
            },
        )  # fmt: skip
        self.metadata = LMCacheMetadata(
            model_name="org/tiny", world_size=worker[1], local_world_size=worker[1], worker_id=worker[0],
            local_worker_id=worker[0], kv_dtype=torch.bfloat16, kv_shape=KV_SHAPE, chunk_size=CHUNK, use_mla=mla,
        )  # fmt: skip
        self.cpu = LocalCPUBackend(self.config, self.metadata, dst_device="cpu")
        self.loop = asyncio.new_event_loop()
        self.conn = CreateConnector("plugin://kvpool", self.loop, self.cpu, self.config, self.metadata, "kvpool")

    def run(self, coroutine):
        return self.loop.run_until_complete(asyncio.wait_for(coroutine, 60))

    def chunk(self, seed: int, tokens: int = CHUNK):
        shape = torch.Size([2, KV_SHAPE[0], tokens, KV_SHAPE[3] * KV_SHAPE[4]])
        obj = self.cpu.allocate([shape], [torch.bfloat16], MemoryFormat.KV_2LTD)
        generator = torch.Generator().manual_seed(seed)
        obj.raw_tensor.view(torch.bfloat16).copy_(
            torch.randn(obj.raw_tensor.numel() // 2, generator=generator).to(torch.bfloat16)
        )
        return obj

    def close(self) -> None:
        self.run(self.conn.close())
        self.loop.close()


def key(chunk_hash: int) -> CacheEngineKey:
    return CacheEngineKey("org/tiny", 1, 0, chunk_hash, torch.bfloat16)


@pytest.mark.parametrize("save_chunk_meta", [True, False], ids=["with-header", "zero-copy"])
def test_instance_b_reads_chunks_instance_a_stored(shared_cluster, save_chunk_meta):
    cluster = shared_cluster(2)
    a = Instance(cluster.master_endpoint, save_chunk_meta)
    b = Instance(cluster.master_endpoint, save_chunk_meta)
    try:
        assert "KVPoolRemoteConnector" in repr(a.conn)
        chunks = [a.chunk(seed) for seed in range(3)]
        originals = [c.raw_tensor.clone() for c in chunks]  # put releases the chunks (LMCache)
        keys = [key(h) for h in (11, 12, 13)]
        assert b.conn.batched_contains(keys) == 0
        a.run(a.conn.batched_put(keys, chunks))
        a.run(a.conn.put(key(14), a.chunk(4)))
        assert b.conn.batched_contains([*keys, key(99), key(14)]) == 3
        assert b.run(b.conn.batched_async_contains("lookup-1", keys)) == 3
        assert b.run(b.conn.exists(keys[0])) and not b.conn.exists_sync(key(99))
        got = b.run(b.conn.batched_get([*keys, key(99)]))
        assert got[3] is None
        for original, theirs in zip(originals, got[:3]):
            assert torch.equal(theirs.raw_tensor, original)
            assert list(theirs.get_shapes()[0]) == [2, KV_SHAPE[0], CHUNK, KV_SHAPE[3] * KV_SHAPE[4]]
            theirs.ref_count_down()
        assert b.run(b.conn.get(key(99))) is None
        run = b.run(b.conn.batched_get_non_blocking("lookup-2", [keys[0], key(99), keys[1]]))
        assert len(run) == 1 and torch.equal(run[0].raw_tensor, originals[0])
        run[0].ref_count_down()
        # A partial chunk (the prompt's tail) keeps its token count.
        tail = a.chunk(seed=7, tokens=5)
        tail_bytes = tail.raw_tensor.clone().view(-1)
        a.run(a.conn.put(key(15), tail))
        back = b.run(b.conn.get(key(15)))
        assert back.meta.shape[2] == 5
        assert torch.equal(back.raw_tensor.reshape(-1)[: tail_bytes.numel()], tail_bytes)
        back.ref_count_down()
        assert sorted(b.run(b.conn.list())) == sorted(k.to_string() for k in [*keys, key(14), key(15)])
        assert b.run(b.conn.ping()) == 0
        assert b.conn.remove_sync(key(14)) and not b.conn.exists_sync(key(14))
    finally:
        a.close()
        b.close()


def test_a_pinned_lookup_holds_its_chunks_until_they_are_retrieved(shared_cluster):
    """LMCache's lookup pins what it found so that it is still there for the retrieval: the
    hits are held from eviction (a remove that spares leased objects stands for it here) until
    the retrieval's lease goes back. An unpinned async lookup holds nothing."""
    cluster = shared_cluster(1)
    a = Instance(cluster.master_endpoint)
    try:
        unpinned, pinned, synced = [key(h) for h in (21, 22)], [key(h) for h in (23, 24)], [key(25)]
        every = [*unpinned, *pinned, *synced]
        a.run(a.conn.batched_put(every, [a.chunk(seed) for seed in range(len(every))]))
        assert a.run(a.conn.batched_async_contains("l-1", unpinned)) == 2
        assert a.run(a.conn.batched_async_contains("l-2", pinned, pin=True)) == 2
        assert a.conn.batched_contains(synced) == 1
        names = [k.to_string() for k in every]
        with Store(cluster.master_endpoint) as store:
            refused = [ErrorCode.OK] * 2 + [ErrorCode.OBJECT_HAS_LEASE] * 3
            assert store.batch_remove(names) == refused
            for obj in a.run(a.conn.batched_get(pinned)):  # the retrieval
                obj.ref_count_down()
            removed_as_released(store.batch_remove, names[2:4])
            assert store.batch_remove(names[4:]) == [ErrorCode.OBJECT_HAS_LEASE]  # never retrieved
    finally:
        a.close()


def test_an_mla_models_lookup_holds_its_chunks_until_every_worker_retrieved_them(shared_cluster):
    """With MLA at TP 2, LMCache looks chunks up on worker 0 alone and both workers read worker
    0's chunks: the hold lasts until the second's retrieval (it ended with the first's, and the
    chunk could be evicted before the other worker read it: review helper-148)."""
    cluster = shared_cluster(1)
    first, second = (Instance(cluster.master_endpoint, worker=(rank, 2), mla=True) for rank in (0, 1))
    try:
        keys = [key(31)]
        first.run(first.conn.batched_put(keys, [first.chunk(31)]))
        assert first.run(first.conn.batched_async_contains("l-1", keys, pin=True)) == 1
        names = [k.to_string() for k in keys]
        with Store(cluster.master_endpoint) as store:
            for worker in (first, second):  # worker 1 reads worker 0's key (as RemoteBackend makes it)
                for obj in worker.run(worker.conn.batched_get(keys)):
                    obj.ref_count_down()
                if worker is first:
                    # Its read lease goes back 10 ms after the read (client/leases.py); a release
                    # later than this wait would only hold the chunk too, never fail the check.
                    time.sleep(0.3)
                    assert store.batch_remove(names) == [ErrorCode.OBJECT_HAS_LEASE]  # still held
            removed_as_released(store.batch_remove, names)
    finally:
        first.close()
        second.close()


def test_lmcaches_health_probe_reads_back_what_it_wrote_last(shared_cluster):
    """LMCache's health check, after a run of failed gets, writes fresh bytes under one fixed
    key (model "test", chunk 0) and wants them back before it uses the pool again. A put of a
    key already stored writes nothing (keys name their bytes), so once any worker had probed,
    every later probe read the first one's bytes, and LMCache stayed off the pool until a
    restart (review helper-148), and a worker's probe between another's put and get failed
    that one's (helper-151). Each connector's probe is an object of its own, written anew."""
    cluster = shared_cluster(1)
    a, b = Instance(cluster.master_endpoint), Instance(cluster.master_endpoint)
    probe = CacheEngineKey(model_name="test", world_size=1, worker_id=0, chunk_hash=0, dtype=torch.bfloat16)
    try:
        for seeds in ((1, 2), (3, 4)):  # both probe at once, as every worker does after an outage
            expected = {}
            for instance, seed in zip((a, b), seeds):
                written = instance.chunk(seed)
                expected[instance] = written.raw_tensor.clone()  # (the put gives the chunk back to LMCache)
                instance.run(instance.conn.batched_put([probe], [written]))
            for instance in (a, b):
                (read,) = instance.run(instance.conn.batched_get([probe]))
                assert torch.equal(read.raw_tensor, expected[instance])
                read.ref_count_down()
        # An MLA model at TP 2: worker 0 alone puts the probe, and worker 1 reads worker 0's
        # (LMCache's RemoteBackend): their probe is the instance's (helper-152 found each
        # worker reading a probe of its own, never written).
        first_worker, second_worker = (Instance(cluster.master_endpoint, worker=(r, 2), mla=True) for r in (0, 1))
        try:
            written = first_worker.chunk(5)
            expected = written.raw_tensor.clone()
            first_worker.run(first_worker.conn.batched_put([probe], [written]))
            (read,) = second_worker.run(second_worker.conn.batched_get([probe]))
            assert read is not None and torch.equal(read.raw_tensor, expected)
            read.ref_count_down()
        finally:
            first_worker.close()
            second_worker.close()
        ordinary, first, second = key(41), a.chunk(41), a.chunk(42)
        expected = first.raw_tensor.clone()
        a.run(a.conn.batched_put([ordinary], [first]))
        a.run(a.conn.batched_put([ordinary], [second]))  # any other key: the first bytes stay
        (read,) = a.run(a.conn.batched_get([ordinary]))
        assert torch.equal(read.raw_tensor, expected)
        read.ref_count_down()
    finally:
        a.close()
        b.close()


def test_an_object_that_is_no_chunk_of_this_model_is_a_miss(shared_cluster):
    """Headerless chunks are reshaped from their byte count: an object under a chunk's name
    that is not whole tokens (another model's layout, say) is a miss, not a ValueError
    raised into LMCache."""
    cluster = shared_cluster(1)
    b = Instance(cluster.master_endpoint, save_chunk_meta=False)
    try:
        b.run(b.conn.put(key(22), b.chunk(seed=2)))
        with Store(cluster.master_endpoint) as store:
            store.put(key(21).to_string(), b"odd")
        got = b.run(b.conn.batched_get([key(21), key(22)]))
        assert got[0] is None and got[1] is not None
        got[1].ref_count_down()
    finally:
        b.close()


def _header(dtype_code: int, dims: list[int], length: int) -> bytes:
    """LMCache's chunk header (lmcache/v1/protocol.py REMOTE_METADATA_FMT, set once a connector
    is made), every group alike."""
    fields = [length, MemoryFormat.KV_2LTD.value]
    fields += [dtype_code, *dims] * ((len(protocol.REMOTE_METADATA_FMT) - 2) // 5)
    return struct.pack(protocol.REMOTE_METADATA_FMT, *fields)


@pytest.mark.parametrize(
    "header",
    [
        None,  # no header: bytes whose memory format is unknown
        (0, [4, 4, 4, 4]),  # no dtype
        (3, [-2, 8, 8, 8]),  # a negative dimension
        (3, [1 << 30, 1 << 30, 8, 8]),  # no allocation holds it
    ],
    ids=["no-header", "no-dtype", "negative-dim", "huge-shape"],
)
def test_an_object_without_a_usable_chunk_header_is_a_miss_and_the_batch_is_read(shared_cluster, header):
    """With save_chunk_meta (LMCache's default) every object starts with LMCache's header. One
    under a chunk's name without a usable one (written by an instance with save_chunk_meta
    off, say) raised from the header's decoding or the allocation it asked for: the whole
    batch failed, and the chunks allocated for the keys before it were never given back to
    LMCache's CPU backend."""
    cluster = shared_cluster(1)
    b = Instance(cluster.master_endpoint)
    try:
        b.run(b.conn.batched_put([key(30), key(32)], [b.chunk(seed=30), b.chunk(seed=32)]))
        with Store(cluster.master_endpoint) as store:
            stored = bytes(range(256)) * 64 if header is None else _header(*header, 512) + bytes(512)
            store.put(key(31).to_string(), stored)
        got = b.run(b.conn.batched_get([key(30), key(31), key(32)]))
        assert got[0] is not None and got[1] is None and got[2] is not None
        for obj in (got[0], got[2]):
            obj.ref_count_down()
    finally:
        b.close()


def test_a_dead_master_turns_calls_into_misses(make_cluster):
    cluster = make_cluster(1, "16MiB")
    a = Instance(cluster.master_endpoint)
    try:
        a.run(a.conn.put(key(1), a.chunk(1)))
        cluster.master.kill()
        assert a.conn.batched_contains([key(1)]) == 0
        assert a.run(a.conn.exists(key(1))) is False
        assert a.run(a.conn.batched_get([key(1)])) == [None]
        a.run(a.conn.batched_put([key(2)], [a.chunk(2)]))  # logged, not raised
        assert a.run(a.conn.list()) == []
        assert a.run(a.conn.ping()) < 0
    finally:
        a.close()


def test_a_master_that_stops_answering_costs_lookups_one_short_wait(make_cluster):
    """LMCache runs batched_contains inside vLLM's scheduler step with no timeout around it:
    a master alive but not answering (SIGSTOP) cost each lookup the RPC timeout (5-6 s). Now
    one waits lookup_timeout_ms, the next ones (exists too) miss without asking while the
    breaker is open, and a probe after the master answers again closes it."""
    cluster = make_cluster(1, "16MiB")
    a = Instance(cluster.master_endpoint, lookup_timeout_ms=200, lookup_backoff_ms_min=500, lookup_backoff_ms_max=1000)
    try:
        a.run(a.conn.put(key(1), a.chunk(1)))
        assert a.conn.batched_contains([key(1)]) == 1
        cluster.master.signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert a.conn.batched_contains([key(1)]) == 0
            assert time.monotonic() - started < 2  # the lookup's own bound, 0.2 s (was 5 s)
            started = time.monotonic()
            assert [a.conn.batched_contains([key(1)]) for _ in range(5)] == [0] * 5
            assert a.conn.exists_sync(key(1)) is False
            assert a.run(a.conn.batched_async_contains("lookup-1", [key(1)], pin=True)) == 0
            assert time.monotonic() - started < 0.5  # the breaker is open: none asks
        finally:
            cluster.master.signal(signal.SIGCONT)
        wait_until(lambda: a.conn.batched_contains([key(1)]) == 1, timeout_s=10)
        assert a.conn.exists_sync(key(1)) is True
    finally:
        a.close()


def test_a_bad_kvpool_value_is_logged_and_lmcache_starts_without_the_pool():
    """LMCache's RemoteBackend catches a connector's construction error (docs/integrations.md):
    the value is named in its log, and the engine starts without the remote connection."""
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

    instance_config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.05, remote_storage_plugins=["kvpool"],
        extra_config={
            "remote_storage_plugin.kvpool.module_path": "kvpool.integrations.lmcache",
            "remote_storage_plugin.kvpool.class_name": "KVPoolConnectorAdapter",
            "kvpool.master": "127.0.0.1:1", "kvpool.replica_num": 0,
        },
    )  # fmt: skip
    metadata = LMCacheMetadata(
        model_name="org/tiny", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.bfloat16, kv_shape=KV_SHAPE, chunk_size=CHUNK,
    )  # fmt: skip
    cpu = LocalCPUBackend(instance_config, metadata, dst_device="cpu")
    loop = asyncio.new_event_loop()
    try:
        backend = RemoteBackend(instance_config, metadata, loop, cpu, "cpu", plugin_name="kvpool")
        assert backend.connection is None
        assert backend.batched_contains([key(1)]) == 0
    finally:
        loop.close()


def test_lookups_and_reads_do_not_wait_behind_puts_the_pool_is_slow_to_take(shared_cluster):
    """Puts waiting on a master or node that stopped answering filled the loop's default
    executor (6 threads here), and LMCache's lookups and reads queued behind them: 30 s for
    a lookup of a 1 s bound, 5.5 s for a read from a healthy node. Puts have threads of their
    own now."""
    cluster = shared_cluster(1)
    instance = Instance(cluster.master_endpoint, True)
    gate = threading.Event()
    store = instance.conn._connector._store  # LMCache wraps the plugin (InstrumentedRemoteConnector)
    put = store.batch_put_from_multi_buffers
    store.batch_put_from_multi_buffers = lambda *args: gate.wait(30) and put(*args)
    try:
        stored = [key(h) for h in (21, 22)]

        async def main() -> None:
            puts = [asyncio.ensure_future(instance.conn.put(key(100 + i), instance.chunk(i))) for i in range(12)]
            await asyncio.sleep(0.2)  # every put begun, held
            assert await asyncio.wait_for(instance.conn.batched_async_contains("l-1", stored), 5) == 0
            assert await asyncio.wait_for(instance.conn.batched_get(stored), 5) == [None, None]
            gate.set()
            await asyncio.wait_for(asyncio.gather(*puts), 30)

        instance.run(main())
        assert instance.conn.batched_contains([key(100 + i) for i in range(12)]) == 12
    finally:
        gate.set()
        instance.close()
