"""Edges of the engine adapters: what a serving engine relies on when a call outlasts the
engine's own bound, a read still writes after its call ended, or one page of a batch is bad.

Each test drives the real engine package's interface (LMCache's RemoteBackend, vLLM's
connector API, SGLang's storage backend API) against a LocalCluster of real processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import signal
import threading
import time

import pytest
import vllm_on_cpu  # noqa: F401  (before vLLM, which LMCache imports too)
from conftest import wait_until

from kvpool.errors import RpcTimeout

torch = pytest.importorskip("torch", reason="needs torch==2.13.0")


# --- LMCache ----------------------------------------------------------------------------------


@contextlib.contextmanager
def lmcache_backend(master: str, save_chunk_meta: bool = True, **options):
    """LMCache's own RemoteBackend on the kvpool plugin, its event loop running in a thread as
    in an LMCache worker; yields (backend, its connection (LMCache's instrumented wrapper), the
    Instance)."""
    pytest.importorskip("lmcache.v1.storage_backend.connector", reason="LMCache is not installed")
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend
    from test_integration_lmcache import Instance

    instance = Instance(master, save_chunk_meta, **options)
    instance.config.blocking_timeout_secs = 1
    thread = threading.Thread(target=instance.loop.run_forever, daemon=True)
    thread.start()
    backend = RemoteBackend(
        instance.config, instance.metadata, instance.loop, instance.cpu, "cpu", plugin_name="kvpool"
    )
    try:
        yield backend, backend.connection, instance
    finally:
        asyncio.run_coroutine_threadsafe(backend.connection.close(), instance.loop).result(30)
        instance.loop.call_soon_threadsafe(instance.loop.stop)
        thread.join(10)
        instance.loop.close()


@contextlib.contextmanager
def lmcache_warnings(logger_name: str, text: str):
    """The messages with `text` that LMCache's logger logs meanwhile (it does not propagate
    to pytest's capture)."""
    found: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: found.append(record.getMessage()) if text in record.getMessage() else None
    logger = logging.getLogger(logger_name)
    logger.addHandler(handler)
    try:
        yield found
    finally:
        logger.removeHandler(handler)


def ended_calls(obj, method: str) -> threading.Semaphore:
    """A semaphore released each time `obj.method` has returned (or raised)."""
    ended = threading.Semaphore(0)
    real = getattr(obj, method)

    def counted(*args, **kwargs):
        try:
            return real(*args, **kwargs)
        finally:
            ended.release()

    setattr(obj, method, counted)
    return ended


def chunks_in_use(instance) -> int:
    """How many chunks LMCache's CPU backend has lent out."""
    return instance.cpu.memory_allocator.pin_allocator.num_active_allocations


def put_chunks(instance, connection, keys) -> None:
    """Store a chunk per key; LMCache's wrapper gives them back to the CPU backend."""
    chunks = [instance.chunk(seed) for seed in range(len(keys))]
    asyncio.run_coroutine_threadsafe(connection.batched_put(keys, chunks), instance.loop).result(30)


@pytest.mark.parametrize("save_chunk_meta", [True, False], ids=["with-header", "zero-copy"])
def test_lmcache_gives_back_the_chunks_of_a_get_it_timed_out(make_cluster, save_chunk_meta):
    """LMCache cancels a get that outlasts blocking_timeout_secs and moves on with misses;
    kvpool's read went on in its worker thread, and the chunks it then returned were nobody's:
    never given back with ref_count_down, only freed by LMCache's safety net when Python
    dropped them, with a warning per chunk that a ref_count_down was missed. They go back
    as soon as the late read ends."""
    from test_integration_lmcache import key

    cluster = make_cluster(1, "16MiB")
    with (
        lmcache_backend(cluster.master_endpoint, save_chunk_meta, shm_enabled=False) as (backend, conn, instance),
        lmcache_warnings("lmcache.v1.memory_management", "ref_count_down()/unpin() was not called") as missed_releases,
    ):
        keys = [key(h) for h in (41, 42)]
        put_chunks(instance, conn, keys)
        assert chunks_in_use(instance) == 0
        reads_ended = ended_calls(conn._connector, "_get_objects")
        node = cluster.nodes[0]
        node.signal(signal.SIGSTOP)  # a node that stalls: the read outlasts LMCache's 1 s
        try:
            assert backend.batched_get_blocking(keys) == [None, None]
        finally:
            node.signal(signal.SIGCONT)
        assert reads_ended.acquire(timeout=10)  # the late read returned its chunks
        wait_until(lambda: chunks_in_use(instance) == 0, timeout_s=10)
        assert not missed_releases, missed_releases
        got = backend.batched_get_blocking(keys)  # and the pool still serves them
        assert all(obj is not None for obj in got)
        for obj in got:
            obj.ref_count_down()
        assert chunks_in_use(instance) == 0


def test_lmcache_keeps_a_chunk_a_late_disk_read_writes_into_until_it_ended(make_cluster):
    """A zero-copy get whose read of a disk file outlasted the transfer timeout returns with
    the chunk's buffer still in use (the Store refuses to unregister it until the read ended:
    store.py _copy_on_a_worker). The refusal raised out of the get's cleanup: every chunk of
    the batch was dropped without ref_count_down, the one still written into among them, whose
    memory LMCache's safety net then freed for reuse under the late write. Now the other
    chunks go back at once, that one is kept, and it goes back at a later call once the read
    ended."""
    from test_integration_lmcache import key

    cluster = make_cluster(1, "16MiB")
    with lmcache_backend(cluster.master_endpoint, save_chunk_meta=False) as (backend, conn, instance):
        keys = [key(h) for h in (51, 52, 53)]
        put_chunks(instance, conn, keys)
        store = conn._connector._store
        real_get_into = store.batch_get_into
        late_reads = []

        def get_into_timing_out(names, addresses, sizes):
            """The state a get leaves when its disk read of the first chunk outlasted the
            transfer timeout: that buffer held (as _copy_on_a_worker holds it), the call
            failed with a timeout."""
            real_get_into(names, addresses, sizes)
            view = memoryview((ctypes.c_char * sizes[0]).from_address(addresses[0])).cast("B")
            late_reads.append(store._async.buffers.hold([view]))
            raise RpcTimeout("call did not finish within 30000 ms")

        store.batch_get_into = get_into_timing_out
        assert backend.batched_get_blocking(keys) == [None, None, None]
        assert chunks_in_use(instance) == 1  # the one still written into, kept
        store.batch_get_into = real_get_into
        got = backend.batched_get_blocking(keys)  # the late read has not ended: still kept
        assert all(obj is not None for obj in got)
        for obj in got:
            obj.ref_count_down()
        assert chunks_in_use(instance) == 1
        late_reads.pop()()  # the disk read ends
        got = backend.batched_get_blocking(keys[:1])
        got[0].ref_count_down()
        assert chunks_in_use(instance) == 0
        assert len(store._async.buffers) == 0  # no registration left behind


# --- vLLM -------------------------------------------------------------------------------------


@pytest.fixture
def vllm_sides(make_cluster):
    """vllm_sides(load_async) -> (cluster, scheduler-side connector, worker-side connector
    with a random paged cache, a Store that reads the pool); vLLM's test helpers are
    test_integration_vllm's."""
    pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.factory", reason="vLLM is not installed")
    from test_integration_vllm import connector, paged_cache, vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvpool import Store

    sides = []

    def make(load_async: bool = False):
        cluster = make_cluster(1, "16MiB")
        config = vllm_config(cluster.master_endpoint, load_async)
        sched, worker = connector(config, KVConnectorRole.SCHEDULER), connector(config, KVConnectorRole.WORKER)
        sides.extend((worker, sched))
        worker.register_kv_caches(paged_cache(seed=3))
        reader = Store(cluster.master_endpoint)
        sides.append(reader)
        return cluster, sched, worker, reader

    yield make
    for side in sides:
        with contextlib.suppress(Exception):
            side.close() if isinstance(side, Store) else side.shutdown()


def test_vllm_removes_the_blocks_a_failed_load_doomed_beside_the_engine_loop(vllm_sides):
    """After a failed load (or a reset) the scheduler removes the blocks saved beside it, at
    that update and the next ones, in vLLM's engine loop: a master that did not answer cost
    each of those updates the RPC timeout (5 s). The removals now run on a thread of their
    own; meanwhile this engine's lookups stop before a doomed block, so that it never loads
    one before its removal succeeded, and a removal that failed goes again."""
    from test_integration_vllm import PROMPT, first_prefill, request, run_worker_step
    from vllm.v1.outputs import KVConnectorOutput

    cluster, sched, worker, reader = vllm_sides()
    meta = first_prefill(sched, "r-1", [0, 1, 2, 3])
    assert run_worker_step(worker, meta) == set()
    keys = [worker._key(h) for h in meta.saves[0].block_hashes]
    assert all(reader.batch_exists(keys))

    def update(invalid: set[int] | None = None) -> None:
        sched.update_connector_output(KVConnectorOutput(invalid_block_ids=invalid or set()))

    # A load fails in the step that saved r-1's blocks; their removal is held.
    removing, real_remove = threading.Event(), sched._store.batch_remove
    sched._store.batch_remove = lambda *args, **kwargs: removing.wait(5) and real_remove(*args, **kwargs)
    update({7})
    assert all(reader.batch_exists(keys))  # not removed yet...
    assert sched.get_num_new_matched_tokens(request("r-2", PROMPT), 0) == (0, False)  # ... nor loaded
    removing.set()
    wait_until(lambda: update() or not any(reader.batch_exists(keys)), timeout_s=10)

    # A master that does not answer: the updates do not wait for it.
    cluster.master.signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        update({7})
        update()
        update()
        assert time.monotonic() - started < 3  # was 5 s an update, two of them (10 s)
    finally:
        cluster.master.signal(signal.SIGCONT)

    # Once every removal succeeded, the blocks save and load again.
    wait_until(lambda: update() or (sched._removal is None and not sched._doomed_saves), timeout_s=20)
    assert run_worker_step(worker, first_prefill(sched, "r-3", [4, 5, 6, 7])) == set()
    assert sched.get_num_new_matched_tokens(request("r-4", PROMPT), 0) == (12, False)


def test_vllm_may_load_async_only_a_prompt_whose_first_block_the_pool_held(vllm_sides):
    """may_load_async (vLLM 0.34, with --max-num-inflight-kv-loads) said yes for any prompt
    longer than a block: one with nothing in the pool then sat at the head of vLLM's queue of
    async loads and held back every load behind it until a running slot freed. Now yes only
    where the prompt's first block (every hit starts there) was in the pool at this
    scheduler's last save or lookup of it."""
    from test_integration_vllm import PROMPT, first_prefill, request, run_worker_step

    _, sched, worker, reader = vllm_sides(load_async=True)
    assert not sched.may_load_async(request("r-0", PROMPT))  # the pool holds nothing
    meta = first_prefill(sched, "r-1", [0, 1, 2, 3])  # planned to be saved: known
    assert run_worker_step(worker, meta) == set()
    assert sched.may_load_async(request("r-2", PROMPT + [1, 2]))
    assert not sched.may_load_async(request("r-3", [7] + PROMPT))  # another first block
    reader.remove(worker._key(meta.saves[0].block_hashes[0]), force=True)
    assert sched.get_num_new_matched_tokens(request("r-4", PROMPT), 0) == (0, False)  # gone: forgotten
    assert not sched.may_load_async(request("r-5", PROMPT + [3]))


# --- SGLang -----------------------------------------------------------------------------------


def test_sglang_v0_one_bad_page_tensor_fails_alone(make_cluster):
    """SGLang's v0 interface (page tensors) answers per page for a get: a page tensor that
    cannot be used (not contiguous, here) failed the whole batch, every page a miss, and a
    set stored none of the batch's pages. Now that page fails alone."""
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="SGLang is not installed")
    from test_integration_sglang import PAGE_SIZE, v0_backends

    cluster = make_cluster(1, "16MiB")
    with v0_backends(cluster.master_endpoint) as ((pool_a, a), (pool_b, b)):
        pages = [pool_a.get_data_page(i * PAGE_SIZE) for i in range(3)]
        bad = pool_a.get_data_page(3 * PAGE_SIZE).reshape(2, -1).t()  # not contiguous
        assert a.batch_set(["p0", "p1", "bad", "p2"], [pages[0], pages[1], bad, pages[2]]) is False
        assert b.batch_exists(["p0", "p1", "p2"]) == 3  # the others were stored
        dummies = [pool_b.get_dummy_flat_data_page() for _ in range(3)]
        got = b.batch_get(["p0", "p1", "p2", "p2"], [dummies[0], dummies[1], bad, dummies[2]])
        assert got[2] is None and all(t is not None for t in (got[0], got[1], got[3]))
        for index, tensor in ((0, got[0]), (1, got[1]), (2, got[3])):
            pool_b.set_from_flat_data_page(index * PAGE_SIZE, tensor)
            assert torch.equal(pool_b.page(index * PAGE_SIZE), pool_a.page(index * PAGE_SIZE))


def test_sglang_v0_keeps_a_page_a_late_disk_read_writes_into_until_it_ended(make_cluster):
    """A v0 get whose read of a disk file outlasted the transfer timeout returns with its
    page tensor still in use (the Store refuses to unregister it until the read ended). The
    refusal raised out of the get's cleanup into SGLang, and the batch's other registrations
    stayed behind. Now the get answers misses, that tensor is held (SGLang cannot free it
    under the late write) and its registration goes at a later call once the read ended."""
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="SGLang is not installed")
    from test_integration_sglang import PAGE_SIZE, v0_backends

    cluster = make_cluster(1, "16MiB")
    with v0_backends(cluster.master_endpoint, count=1) as ((pool, backend),):
        keys = ["late0", "late1"]
        assert backend.batch_set(keys, [pool.get_data_page(i * PAGE_SIZE) for i in range(2)]) is True
        store = backend._store
        real_get_into = store.batch_get_into_multi_buffers
        late_reads = []

        def get_into_timing_out(names, addresses, sizes):
            """What a get leaves when its disk read of the first page outlasted the transfer
            timeout: that buffer held (as _copy_on_a_worker holds it), the call failed."""
            real_get_into(names, addresses, sizes)
            view = memoryview((ctypes.c_char * sizes[0][0]).from_address(addresses[0][0])).cast("B")
            late_reads.append(store._async.buffers.hold([view]))
            raise RpcTimeout("call did not finish within 30000 ms")

        store.batch_get_into_multi_buffers = get_into_timing_out
        registered = len(store._async.buffers)  # the host pool's own
        targets = [pool.get_dummy_flat_data_page() for _ in keys]
        assert backend.batch_get(keys, targets) == [None, None]  # no exception into SGLang
        assert len(store._async.buffers) == registered + 1  # the page still written into, only it
        assert backend._refused._kept[0][1] is targets[0]  # its tensor held
        store.batch_get_into_multi_buffers = real_get_into
        late_reads.pop()()  # the disk read ends
        again = [pool.get_dummy_flat_data_page() for _ in keys]
        got = backend.batch_get(keys, again)
        assert all(t is not None for t in got)
        assert torch.equal(got[1], pool.get_data_page(PAGE_SIZE))
        assert len(store._async.buffers) == registered  # no registration left behind
        assert backend._refused._kept == []
