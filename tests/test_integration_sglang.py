"""kvpool's SGLang HiCache backend, loaded and driven through the real SGLang package.

How: SGLang's own `StorageBackendFactory.create_backend("dynamic", ...)` loads
kvpool.integrations.sglang.KVPoolHiCacheStorage from the extra config SGLang passes on
`--hicache-storage-backend-extra-config`, against a LocalCluster on loopback. Two backends with
separate host pools play two SGLang instances: A backs pages up (batch_set_v1), B finds them
(batch_exists) and loads them into other host slots (batch_get_v1); bytes are compared page by
page, for MHA and MLA pools in page-first and layer-first layouts, then the v0 tensor path,
rank namespacing and a master that dies (no exception may reach SGLang's threads).

Host pools: SGLang's real MHATokenToKVPoolHost / MLATokenToKVPoolHost cannot be built here (they
import sglang.srt.configs, which needs torchvision; PyPI's torchvision does not load beside the
CPU torch 2.13.0 this project uses, and they want a device KV pool's pointer tables). So the
pools below expose exactly the members SGLang's host pools offer to storage backends and that
kvpool uses: kv_buffer, page_size, layout, dtype, layer_num, size, get_page_buffer_meta(indices),
get_ksize_per_token(), get_size_per_token(), get_data_page(), get_dummy_flat_data_page(),
set_from_flat_data_page(); their buffer shapes and page address arithmetic follow
sglang/srt/mem_cache/pool_host/mha.py and mla.py (sglang 0.5.23).

Skipped unless `sglang` imports (scripts/install-peers.sh sglang installs it without its CUDA
dependencies).
"""

from __future__ import annotations

import contextlib
import re
import signal
import threading
import time

import pytest
from conftest import removed_as_released, wait_until

torch = pytest.importorskip("torch", reason="needs torch==2.13.0")
factory_module = pytest.importorskip(
    "sglang.srt.mem_cache.storage.backend_factory",
    reason="SGLang is not installed (scripts/install-peers.sh sglang)",
)
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)

from kvpool import limits  # noqa: E402
from kvpool.errors import ErrorCode, InvalidParams  # noqa: E402

StorageBackendFactory = factory_module.StorageBackendFactory

PAGE_SIZE = 4
LAYERS = 3
HEADS = 2
HEAD_DIM = 8
MLA_DIM = 24
POOL_TOKENS = 64


class MHAHostPool:
    """SGLang's MHA host pool as storage backends see it (pool_host/mha.py)."""

    def __init__(self, layout: str, tokens: int = POOL_TOKENS) -> None:
        self.layout, self.page_size, self.dtype = layout, PAGE_SIZE, torch.bfloat16
        self.layer_num, self.size, self.head_num, self.head_dim = LAYERS, tokens, HEADS, HEAD_DIM
        if layout == "layer_first":
            dims = (2, LAYERS, tokens, HEADS, HEAD_DIM)
        else:
            dims = (2, tokens, LAYERS, HEADS, HEAD_DIM)
        self.kv_buffer = torch.zeros(dims, dtype=self.dtype)

    def get_size_per_token(self) -> int:
        return 2 * HEAD_DIM * HEADS * LAYERS * self.dtype.itemsize

    def get_ksize_per_token(self) -> int:
        return self.get_size_per_token() // 2

    def get_page_buffer_meta(self, indices):
        item = self.dtype.itemsize
        base = self.kv_buffer.data_ptr()
        v_offset = LAYERS * self.size * HEADS * HEAD_DIM * item
        pointers = []
        for start in indices.tolist()[::PAGE_SIZE]:
            if self.layout == "layer_first":
                for layer in range(LAYERS):
                    k = base + (layer * self.size + start) * HEADS * HEAD_DIM * item
                    pointers += [k, k + v_offset]
            else:
                k = base + start * LAYERS * HEADS * HEAD_DIM * item
                pointers += [k, k + v_offset]
        if self.layout == "layer_first":
            size = PAGE_SIZE * HEADS * HEAD_DIM * item
        else:
            size = LAYERS * PAGE_SIZE * HEADS * HEAD_DIM * item
        return pointers, [size] * len(pointers)

    def page(self, start: int):
        """The page's K and V, in a layout-independent order (for comparisons)."""
        if self.layout == "layer_first":
            return self.kv_buffer[:, :, start : start + PAGE_SIZE].clone()
        return self.kv_buffer[:, start : start + PAGE_SIZE].transpose(1, 2).clone()

    def _page_view(self, index: int):
        if self.layout == "layer_first":
            return self.kv_buffer[:, :, index : index + PAGE_SIZE]
        return self.kv_buffer[:, index : index + PAGE_SIZE]

    def get_data_page(self, index: int, flat: bool = True):
        return self._page_view(index).flatten()

    def get_dummy_flat_data_page(self):
        return torch.zeros(2 * LAYERS * PAGE_SIZE * HEADS * HEAD_DIM, dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data) -> None:
        view = self._page_view(index)
        view.copy_(data.reshape(view.shape))


class MLAHostPool:
    """SGLang's MLA host pool as storage backends see it (pool_host/mla.py)."""

    def __init__(self, layout: str) -> None:
        self.layout, self.page_size, self.dtype = layout, PAGE_SIZE, torch.float16
        self.layer_num, self.size, self.kv_cache_dim = LAYERS, POOL_TOKENS, MLA_DIM
        if layout == "layer_first":
            dims = (LAYERS, POOL_TOKENS, 1, MLA_DIM)
        else:
            dims = (POOL_TOKENS, LAYERS, 1, MLA_DIM)
        self.kv_buffer = torch.zeros(dims, dtype=self.dtype)

    def get_size_per_token(self) -> int:
        return MLA_DIM * LAYERS * self.dtype.itemsize

    def get_ksize_per_token(self) -> int:
        return self.get_size_per_token()

    def get_page_buffer_meta(self, indices):
        item = self.dtype.itemsize
        base = self.kv_buffer.data_ptr()
        pointers = []
        for start in indices.tolist()[::PAGE_SIZE]:
            if self.layout == "layer_first":
                pointers += [base + (layer * POOL_TOKENS + start) * MLA_DIM * item for layer in range(LAYERS)]
            else:
                pointers.append(base + start * LAYERS * MLA_DIM * item)
        size = PAGE_SIZE * MLA_DIM * item * (1 if self.layout == "layer_first" else LAYERS)
        return pointers, [size] * len(pointers)

    def page(self, start: int):
        if self.layout == "layer_first":
            return self.kv_buffer[:, start : start + PAGE_SIZE].clone()
        return self.kv_buffer[start : start + PAGE_SIZE].transpose(0, 1).clone()


def storage_config(master: str, *, mla: bool = False, tp_rank: int = 0, metrics: bool = True,
                   model: str = "org/tiny-model") -> HiCacheStorageConfig:  # fmt: skip
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=metrics, is_page_first_layout=True,
        model_name=model,
        extra_config={
            "backend_name": "kvpool", "module_path": "kvpool.integrations.sglang",
            "class_name": "KVPoolHiCacheStorage", "interface_v1": 1, "master": master,
        },
    )  # fmt: skip


def create(config: HiCacheStorageConfig, pool):
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)  # as SGLang's cache controller does after creating it
    return backend


@contextlib.contextmanager
def v0_backends(master: str, pool_type=None, mla: bool = False, count: int = 2):
    """`count` backends on SGLang's v0 interface (page tensors), each over a host pool of
    `pool_type` (MHAHostPool by default), the first pool filled with random KV; yields
    [(pool, backend), ...] and closes the backends."""
    pool_type = MHAHostPool if pool_type is None else pool_type
    config = storage_config(master, mla=mla)
    config.extra_config["interface_v1"] = 0
    pools = [pool_type("page_first") for _ in range(count)]
    pools[0].kv_buffer.copy_(torch.randn(pools[0].kv_buffer.shape).to(pools[0].dtype))
    made = []
    try:
        for pool in pools:
            made.append((pool, create(config, pool)))
        yield made
    finally:
        for _, backend in made:
            backend.close()


def host_indices(pages: list[int]):
    return torch.tensor([p * PAGE_SIZE + t for p in pages for t in range(PAGE_SIZE)], dtype=torch.int64)


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_instance_b_loads_pages_instance_a_backed_up(shared_cluster, mla, layout):
    cluster = shared_cluster(2)
    pool_class = MLAHostPool if mla else MHAHostPool
    pool_a, pool_b = pool_class(layout), pool_class(layout)
    torch.manual_seed(0)
    pool_a.kv_buffer.copy_(torch.randn(pool_a.kv_buffer.shape).to(pool_a.dtype))
    a = create(storage_config(cluster.master_endpoint, mla=mla), pool_a)
    b = create(storage_config(cluster.master_endpoint, mla=mla), pool_b)
    try:
        assert type(a).__name__ == "KVPoolHiCacheStorage"
        keys = [f"hash{i}" for i in range(5)]
        assert b.batch_exists(keys) == 0
        assert a.batch_set_v1(keys, host_indices([1, 2, 3, 4, 5])) == [True] * 5
        assert a.batch_set_v1(keys[:2], host_indices([1, 2])) == [True] * 2  # present: success
        assert b.batch_exists(keys + ["absent"]) == 5
        assert b.batch_exists(["absent", *keys]) == 0
        assert b.exists("hash0") and not b.exists("absent")
        assert b.batch_get_v1(keys + ["absent"], host_indices([10, 11, 12, 13, 14, 15])) == [True] * 5 + [False]
        for source, target in zip([1, 2, 3, 4, 5], [10, 11, 12, 13, 14]):
            assert torch.equal(pool_b.page(target * PAGE_SIZE), pool_a.page(source * PAGE_SIZE))
        listed = sorted(b._store.list_objects("org-tiny-model").keys)
        prefix = f"org-tiny-model@{layout}_float16_" if mla else f"org-tiny-model@{layout}_bfloat16_tp2_"
        expected = [f"{prefix}hash0__k"] if mla else [f"{prefix}hash0_0_k", f"{prefix}hash0_0_v"]
        assert listed[: len(expected)] == expected
        stats = a.get_stats()
        assert stats is None or stats.backup_pgs == [5, 2]
    finally:
        a.close()
        b.close()


def test_a_prompt_of_more_pages_than_one_master_request_takes_is_found_stored_and_loaded(shared_cluster):
    """SGLang's hybrid cache controller (every model's, from 0.5.23) looks a whole request up,
    and backs it up, at once: past 8,192 pages of an MHA model (16,384 objects, the most one
    master request takes) the lookup was refused whole, a miss for the longest prompts
    (review helper-148). The adapter goes in batches now."""
    cluster = shared_cluster(2)
    pages = limits.BATCH_KEYS_MAX // 2 + 100
    tokens = (pages + 1) * PAGE_SIZE
    pool_a, pool_b = MHAHostPool("page_first", tokens), MHAHostPool("page_first", tokens)
    torch.manual_seed(0)
    pool_a.kv_buffer.copy_(torch.randn(pool_a.kv_buffer.shape).to(pool_a.dtype))
    a = create(storage_config(cluster.master_endpoint), pool_a)
    b = create(storage_config(cluster.master_endpoint), pool_b)
    try:
        keys = [f"long{i}" for i in range(pages)]
        indices = host_indices(list(range(1, pages + 1)))
        assert a.batch_set_v1(keys, indices) == [True] * pages
        assert b.batch_exists(keys) == pages
        assert b.batch_exists([*keys[:-1], "absent"]) == pages - 1
        assert b.batch_get_v1(keys, indices) == [True] * pages
        assert torch.equal(pool_b.kv_buffer[:, PAGE_SIZE:], pool_a.kv_buffer[:, PAGE_SIZE:])  # page 0: unused
    finally:
        a.close()
        b.close()


def test_leading_run_rank_namespaces_and_mla_sharing(shared_cluster):
    cluster = shared_cluster(1)
    pool = MHAHostPool("page_first")
    pool.kv_buffer.fill_(1)
    rank0 = create(storage_config(cluster.master_endpoint), pool)
    rank1 = create(storage_config(cluster.master_endpoint, tp_rank=1), MHAHostPool("page_first"))
    other_model = create(storage_config(cluster.master_endpoint, model="org/other"), MHAHostPool("page_first"))
    mla0 = create(storage_config(cluster.master_endpoint, mla=True), MLAHostPool("page_first"))
    mla1 = create(storage_config(cluster.master_endpoint, mla=True, tp_rank=1), MLAHostPool("page_first"))
    backends = [rank0, rank1, other_model, mla0, mla1]
    try:
        keys = ["p0", "p1", "p2"]
        assert rank0.batch_set_v1(keys, host_indices([0, 1, 2])) == [True] * 3
        assert rank0.batch_exists(keys) == 3
        assert rank1.batch_exists(keys) == 0  # each TP rank holds its own heads
        assert other_model.batch_exists(keys) == 0  # models never share pages
        rank0._store.remove("org-tiny-model@page_first_bfloat16_tp2_p1_0_v", force=True)  # page 1 loses its V
        assert rank0.batch_exists(keys) == 1
        assert mla0.batch_set_v1(keys, host_indices([0, 1, 2])) == [True] * 3
        assert mla1.batch_exists(keys) == 3  # MLA pages are one copy for every rank
        other_model.clear()
        assert rank0.batch_exists(keys) == 1 and mla1.batch_exists(keys) == 3
        rank0.clear()  # this model's namespace, every rank
        assert mla1.batch_exists(keys) == 0
    finally:
        for backend in backends:
            backend.close()


def test_clear_leaves_the_pages_of_a_model_whose_name_extends_this_ones(shared_cluster):
    """Key parts are joined with '_', and clear() removed every key starting with the
    namespace and a '_': model "org/llama" removed "org/llama_3"'s pages too (and with a tag,
    tag "a" model "b" those of model "b_..."). The namespace now ends with an '@', which no
    tag or model name holds."""
    cluster = shared_cluster(1)
    llama = create(storage_config(cluster.master_endpoint, model="org/llama"), MHAHostPool("page_first"))
    llama_3 = create(storage_config(cluster.master_endpoint, model="org/llama_3"), MHAHostPool("page_first"))
    try:
        keys = ["q0", "q1"]
        for backend in (llama, llama_3):
            assert backend.batch_set_v1(keys, host_indices([0, 1])) == [True] * 2
        llama.clear()
        assert llama.batch_exists(keys) == 0
        assert llama_3.batch_exists(keys) == 2
    finally:
        llama.close()
        llama_3.close()


def test_a_master_that_stops_answering_costs_the_prefetch_thread_one_short_wait(make_cluster):
    """SGLang's prefetch thread runs every request's hit query (batch_exists), one after the
    other: a master alive but not answering (SIGSTOP) cost each the RPC timeout (5-6 s). Now
    one waits lookup_timeout_ms, the next ones miss without asking while the breaker is
    open, and a probe after the master answers again closes it."""
    cluster = make_cluster(1, "16MiB")
    config = storage_config(cluster.master_endpoint)
    config.extra_config.update(lookup_timeout_ms=200, lookup_backoff_ms_min=500, lookup_backoff_ms_max=1000)
    backend = create(config, MHAHostPool("page_first"))
    try:
        assert backend.batch_set_v1(["s0"], host_indices([0])) == [True]
        assert backend.batch_exists(["s0"]) == 1
        cluster.master.signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert backend.batch_exists(["s0"]) == 0
            assert time.monotonic() - started < 2  # the lookup's own bound, 0.2 s (was 5 s)
            started = time.monotonic()
            assert [backend.batch_exists(["s0"]) for _ in range(5)] == [0] * 5
            assert time.monotonic() - started < 0.5  # the breaker is open: none asks
        finally:
            cluster.master.signal(signal.SIGCONT)
        wait_until(lambda: backend.batch_exists(["s0"]) == 1, timeout_s=10)
    finally:
        backend.close()


def test_a_clear_while_the_master_does_not_answer_gives_up_after_a_short_wait(make_cluster):
    """SGLang calls clear() on its scheduler thread: a master alive but not answering
    (SIGSTOP) held it the removal's bound, 300 s. Now clear() waits on the removal while the
    master answers a probe of lookup_timeout_ms, and otherwise gives up (logged); close()
    does not wait for the removal given up on. Once the master answers, a clear removes the
    model's pages."""
    cluster = make_cluster(1, "16MiB")
    config = storage_config(cluster.master_endpoint)
    config.extra_config.update(lookup_timeout_ms=200)
    stuck, backend = create(config, MHAHostPool("page_first")), create(config, MHAHostPool("page_first"))
    took_s: list[float] = []

    def timed_clear() -> None:
        started = time.monotonic()
        stuck.clear()
        took_s.append(time.monotonic() - started)

    clearing = threading.Thread(target=timed_clear, daemon=True)
    try:
        assert backend.batch_set_v1(["c0", "c1"], host_indices([0, 1])) == [True, True]
        cluster.master.signal(signal.SIGSTOP)
        try:
            clearing.start()
            clearing.join(timeout=5)
            assert took_s, "clear() still waits on the master"
            assert took_s[0] < 2, took_s  # two bounds of 0.2 s and a connect (was 300 s)
            started = time.monotonic()
            stuck.close()
            assert time.monotonic() - started < 2
            wait_until(lambda: not any(t.name.startswith("kvpool-clear") for t in threading.enumerate()), 2)
        finally:
            cluster.master.signal(signal.SIGCONT)
        clearing.join(timeout=10)
        backend.clear()
        assert backend.batch_exists(["c0", "c1"]) == 0
    finally:
        stuck.close()
        backend.close()


def test_the_pages_batch_exists_found_are_held_until_they_are_fetched(shared_cluster):
    """SGLang prefetches what batch_exists found: meanwhile those pages cannot be evicted (a
    remove that spares leased objects stands for eviction here). The fetch's lease release
    ends the hold."""
    cluster = shared_cluster(1)
    pool = MHAHostPool("page_first")
    pool.kv_buffer.fill_(1)
    backend = create(storage_config(cluster.master_endpoint), pool)
    try:
        keys = ["h0", "h1"]
        assert backend.batch_set_v1(keys, host_indices([0, 1])) == [True] * 2
        assert backend.batch_exists(keys) == 2
        names = backend._object_keys(keys)
        assert backend._store.batch_remove(names) == [ErrorCode.OBJECT_HAS_LEASE] * len(names)
        assert backend.batch_get_v1(keys, host_indices([2, 3])) == [True] * 2
        removed_as_released(backend._store.batch_remove, names)
    finally:
        backend.close()


def test_pages_of_another_layout_dtype_or_tp_size_are_not_found(shared_cluster):
    """SGLang's host layouts order a page's bytes differently in objects of one size, and
    bf16 / fp16 pages have one size too, as have the fp8 formats (stored as uint8 by the host
    pool): by model and hash alone, an instance read another's pages as garbage. Each is part
    of the key (the device pool's dtype), and the TP size for MHA."""
    cluster = shared_cluster(1)
    pool = MHAHostPool("page_first")
    pool.kv_buffer.fill_(1)
    writer = create(storage_config(cluster.master_endpoint), pool)
    direct = create(storage_config(cluster.master_endpoint), MHAHostPool("page_first_direct"))
    fp16_pool = MHAHostPool("page_first")
    fp16_pool.dtype = torch.float16
    fp16 = create(storage_config(cluster.master_endpoint), fp16_pool)
    e4m3_pool, e5m2_pool = MHAHostPool("page_first"), MHAHostPool("page_first")
    for host_pool, fp8 in ((e4m3_pool, torch.float8_e4m3fn), (e5m2_pool, torch.float8_e5m2)):
        host_pool.dtype = torch.uint8  # what SGLang's host pool stores fp8 pages as
        host_pool.device_pool = type("DevicePool", (), {"dtype": fp8})()
    e4m3 = create(storage_config(cluster.master_endpoint), e4m3_pool)
    e5m2 = create(storage_config(cluster.master_endpoint), e5m2_pool)
    tp4_config = storage_config(cluster.master_endpoint)
    tp4_config.tp_size = 4
    tp4 = create(tp4_config, MHAHostPool("page_first"))
    same = create(storage_config(cluster.master_endpoint), MHAHostPool("page_first"))
    backends = [writer, direct, fp16, tp4, same, e4m3, e5m2]
    try:
        assert e4m3.batch_set_v1(["p0"], host_indices([0])) == [True]
        assert e5m2.batch_exists(["p0"]) == 0 and e4m3.batch_exists(["p0"]) == 1
        assert writer.batch_set_v1(["p0", "p1"], host_indices([0, 1])) == [True, True]
        assert same.batch_exists(["p0", "p1"]) == 2
        assert [direct.batch_exists(["p0", "p1"]), fp16.batch_exists(["p0"]), tp4.batch_exists(["p0"])] == [0, 0, 0]
    finally:
        for backend in backends:
            backend.close()


def test_pages_of_another_pipeline_split_are_not_found(shared_cluster):
    """The PP rank alone named a stage's pages: rank 1 of two stages split 16/16 and, by a
    custom split, 20/12 (or of two and four stages) holds other layers in pages that can be
    of one size. The PP size and the stage's first layer (the device pool's) are in the key."""
    cluster = shared_cluster(1)

    def stage(pp_size: int, start_layer: int):
        config = storage_config(cluster.master_endpoint)
        config.pp_size, config.pp_rank = pp_size, 1
        pool = MHAHostPool("page_first")
        pool.device_pool = type("DevicePool", (), {"dtype": pool.dtype, "start_layer": start_layer})()
        return create(config, pool)

    writer, same, custom, deeper = stage(2, 16), stage(2, 16), stage(2, 20), stage(4, 16)
    try:
        assert writer.batch_set_v1(["p0"], host_indices([0])) == [True]
        assert same.batch_exists(["p0"]) == 1
        assert [custom.batch_exists(["p0"]), deeper.batch_exists(["p0"])] == [0, 0]
        assert sorted(same._store.list_objects("org-tiny-model").keys) == [
            "org-tiny-model@page_first_bfloat16_tp2_pp2from16_p0_0_1_k",
            "org-tiny-model@page_first_bfloat16_tp2_pp2from16_p0_0_1_v",
        ]
    finally:
        for backend in (writer, same, custom, deeper):
            backend.close()


def kv_head_rank(master: str, tp_rank: int, total_kv_heads: object = None, *, v1: bool = True):
    """Rank `tp_rank` of TP 4 with one KV head (two ranks per head when total_kv_heads is 2),
    its pool's pages filled with that head's bytes: the same on the ranks holding it."""
    config = storage_config(master, tp_rank=tp_rank)
    config.tp_size = 4
    config.extra_config["interface_v1"] = int(v1)
    if total_kv_heads is not None:
        config.extra_config["total_kv_heads"] = total_kv_heads
    pool = MHAHostPool("page_first")
    pool.head_num = 1  # the rank's share of the heads (the buffers keep the helper's geometry)
    head = tp_rank // 2
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=torch.Generator().manual_seed(head)))
    return create(config, pool), pool


def test_ranks_holding_one_kv_head_store_one_copy_and_each_reads_it(shared_cluster):
    """8 KV heads at TP 16: each head on two ranks, which stored the same pages twice, each
    under its rank. SGLang does not tell a backend the head count (the host pool's head_num is
    1 for 16 KV heads too): with the operator's "total_kv_heads" the ranks of one head share
    one copy, named by the head, written by the first of them and read by all; the pool holds
    half the objects. Here 2 KV heads at TP 4."""
    cluster = shared_cluster(1)
    ranks = [kv_head_rank(cluster.master_endpoint, rank, total_kv_heads=2) for rank in range(4)]
    try:
        keys = ["g0", "g1"]
        (rank0, pool0), (rank1, pool1), (rank2, pool2), (rank3, pool3) = ranks
        assert rank1.batch_set_v1(keys, host_indices([0, 1])) == [True] * 2  # rank 0 writes them
        assert rank1.batch_exists(keys) == 0 and rank0._store.list_objects("org-tiny-model").keys == []
        for rank, _ in ranks:
            assert rank.batch_set_v1(keys, host_indices([0, 1])) == [True] * 2
        listed = sorted(rank0._store.list_objects("org-tiny-model").keys)
        assert len(listed) == 8  # 2 heads x 2 pages x K, V (per rank: 16)
        assert listed[:2] == [
            "org-tiny-model@page_first_bfloat16_tp4_g0_kvh0of2_k",
            "org-tiny-model@page_first_bfloat16_tp4_g0_kvh0of2_v",
        ]
        assert rank0._object_keys(keys) == rank1._object_keys(keys) != rank2._object_keys(keys)
        for rank, _ in ranks:  # the lookups (SGLang syncs the ranks' hits), then the loads
            assert rank.batch_exists(keys) == 2
        for rank, pool in ranks:
            assert rank.batch_get_v1(keys, host_indices([4, 5])) == [True] * 2
            for source, target in ((0, 4), (1, 5)):
                assert torch.equal(pool.page(target * PAGE_SIZE), pool.page(source * PAGE_SIZE))
        assert not torch.equal(pool0.page(4 * PAGE_SIZE), pool2.page(4 * PAGE_SIZE))  # another head
        assert torch.equal(pool1.page(4 * PAGE_SIZE), pool0.page(0)) and torch.equal(pool3.page(0), pool2.page(0))
    finally:
        for rank, _ in ranks:
            rank.close()


def test_a_kv_heads_pages_are_held_until_each_of_its_ranks_has_fetched_them(shared_cluster):
    """As an MLA model's shared pages: a hold that ended with the first rank's fetch let an
    eviction fail the other's. A remove that spares leased objects stands for eviction."""
    cluster = shared_cluster(1)
    (rank0, _), (rank1, _) = ranks = [kv_head_rank(cluster.master_endpoint, rank, 2) for rank in (0, 1)]
    try:
        assert rank0.batch_set_v1(["h0"], host_indices([0])) == [True]
        assert rank0.batch_exists(["h0"]) == 1 and rank1.batch_exists(["h0"]) == 1
        names = rank0._object_keys(["h0"])
        assert rank0.batch_get_v1(["h0"], host_indices([1])) == [True]
        # Its read lease goes back 10 ms after the read (client/leases.py): a later release only
        # holds the pages too, never fails the check.
        time.sleep(0.3)
        assert rank0._store.batch_remove(names) == [ErrorCode.OBJECT_HAS_LEASE] * 2
        assert rank1.batch_get_v1(["h0"], host_indices([1])) == [True]
        removed_as_released(rank1._store.batch_remove, names)
    finally:
        for rank, _ in ranks:
            rank.close()


def test_the_v0_interface_writes_a_kv_heads_pages_from_its_first_rank(shared_cluster):
    cluster = shared_cluster(1)
    (rank0, pool0), (rank1, pool1) = ranks = [kv_head_rank(cluster.master_endpoint, r, 2, v1=False) for r in (0, 1)]
    try:
        assert rank1.batch_set(["v0"], [pool1.get_data_page(0)]) is True  # rank 0 writes it
        assert rank1.batch_exists(["v0"]) == 0
        assert rank0.batch_set(["v0"], [pool0.get_data_page(0)]) is True
        (got,) = rank1.batch_get(["v0"], [pool1.get_dummy_flat_data_page()])
        assert got is not None and torch.equal(got, pool1.get_data_page(0))
    finally:
        for rank, _ in ranks:
            rank.close()


def test_without_total_kv_heads_every_rank_keeps_its_own_pages(shared_cluster):
    """One head per rank may be a head two ranks hold or a head of its own: never guessed.
    Nor at a head count of the TP size or above, where no two ranks hold one head."""
    cluster = shared_cluster(1)
    ranks = [kv_head_rank(cluster.master_endpoint, rank, heads) for heads in (None, 4) for rank in (0, 1)]
    try:
        for rank, _ in ranks:
            assert rank.batch_set_v1(["r0"], host_indices([0])) == [True]
        listed = sorted(ranks[0][0]._store.list_objects("org-tiny-model").keys)
        prefix = "org-tiny-model@page_first_bfloat16_tp4_r0"
        assert listed == [f"{prefix}_{rank}_{kv}" for rank in (0, 1) for kv in "kv"]  # each wrote its own
    finally:
        for rank, _ in ranks:
            rank.close()


def test_a_total_kv_heads_that_cannot_be_the_models_is_refused(shared_cluster):
    cluster = shared_cluster(1)
    for heads in (3, 0, "x", "²", 2.0):
        with pytest.raises(InvalidParams, match="total_kv_heads"):
            kv_head_rank(cluster.master_endpoint, 0, heads)
    config = storage_config(cluster.master_endpoint)  # TP 2, a pool of 2 heads per rank: 4 heads
    config.extra_config["total_kv_heads"] = 2
    with pytest.raises(InvalidParams, match="gives each rank 1 KV heads, but the host pool holds 2"):
        create(config, MHAHostPool("page_first"))
    config.extra_config["total_kv_heads"] = 4
    create(config, MHAHostPool("page_first")).close()
    mla = storage_config(cluster.master_endpoint, mla=True)  # its pages are shared by every rank already
    mla.extra_config["total_kv_heads"] = 1
    create(mla, MLAHostPool("page_first")).close()


def test_attention_context_parallelism_is_refused_at_start():
    # Refused before it dials: no master listens there (a backend that dialled would fail otherwise).
    config = storage_config("127.0.0.1:1")
    config.attn_cp_size = 2
    with pytest.raises(InvalidParams, match="attention CP"):
        StorageBackendFactory.create_backend("dynamic", config, MHAHostPool("page_first"))


class KOnlyHostPool(MHAHostPool):
    """Like SGLang's MHATokenToKOnlyPoolHost (pool_host/mha.py): no page ranges but in the
    page-first layouts."""

    def get_page_buffer_meta(self, indices):
        if self.layout not in ("page_first", "page_first_direct"):
            raise ValueError(f"Unsupported layout: {self.layout}")
        return super().get_page_buffer_meta(indices)


class UnpairedHostPool(MHAHostPool):
    """An MHA pool whose pages come in three ranges: K and V cannot be told apart."""

    def get_page_buffer_meta(self, indices):
        pointers, sizes = super().get_page_buffer_meta(indices)  # K, V per page (page_first)
        return pointers + pointers[: len(pointers) // 2], sizes + sizes[: len(sizes) // 2]


def test_host_pools_that_cannot_address_their_pages_are_refused_at_attach(shared_cluster):
    """Before, the attach passed and every prefetch and backup raised in SGLang's I/O threads."""
    cluster = shared_cluster(1)
    for pool, reason in (
        (KOnlyHostPool("layer_first"), "KOnlyHostPool (layout layer_first): Unsupported layout: layer_first"),
        (UnpairedHostPool("page_first"), "MHA page with 3 ranges: K and V do not pair"),
    ):
        with pytest.raises(InvalidParams, match=re.escape(reason)):
            create(storage_config(cluster.master_endpoint), pool)
    backend = create(storage_config(cluster.master_endpoint), KOnlyHostPool("page_first"))
    backend.close()


MAMBA_SLOTS = 8
TEMPORAL_ELEMS = 12
CONV_ELEMS = (6, 10)


class MambaHostPool:
    """SGLang's Mamba state host pool as storage backends see it (pool_host/mamba.py,
    page_first): one state slot per index, a temporal state and conv states per slot, each
    with every Mamba layer's state side by side; one range per component and slot."""

    def __init__(self, layers: int = LAYERS) -> None:
        self.layout, self.page_size, self.size = "page_first", 1, MAMBA_SLOTS
        self.temporal_dtype, self.conv_dtype = torch.float32, torch.bfloat16
        self.temporal_buffer = torch.zeros((MAMBA_SLOTS, layers, TEMPORAL_ELEMS), dtype=self.temporal_dtype)
        self.conv_buffer = [torch.zeros((MAMBA_SLOTS, layers, n), dtype=self.conv_dtype) for n in CONV_ELEMS]

    def get_hybrid_pool_buffer(self):
        return [self.temporal_buffer, *self.conv_buffer]

    def get_page_buffer_meta(self, indices):
        pointers, sizes = [], []
        for slot in indices.tolist():
            for buffer in (self.temporal_buffer, *self.conv_buffer):
                slot_bytes = buffer[0].numel() * buffer.element_size()
                pointers.append(buffer.data_ptr() + slot * slot_bytes)
                sizes.append(slot_bytes)
        return pointers, sizes

    def fill_randomly(self) -> None:
        for buffer in (self.temporal_buffer, *self.conv_buffer):
            buffer.copy_(torch.randn(buffer.shape).to(buffer.dtype))

    def state(self, slot: int) -> list:
        return [buffer[slot].clone() for buffer in (self.temporal_buffer, *self.conv_buffer)]


class IndexerHostPool:
    """A DSA indexer host pool (pool_host/dsa.py) as storage backends see it: one packed
    range per page of PAGE_SIZE tokens (keys with their scales), the same on every TP rank
    of an MLA model."""

    PAGE_BYTES = 96

    def __init__(self) -> None:
        self.layout, self.page_size, self.size, self.dtype = "page_first", PAGE_SIZE, POOL_TOKENS, torch.uint8
        self.index_k_with_scale_buffer = torch.zeros((POOL_TOKENS // PAGE_SIZE, self.PAGE_BYTES), dtype=torch.uint8)

    def get_hybrid_pool_buffer(self):
        return [self.index_k_with_scale_buffer]

    def get_page_buffer_meta(self, indices):
        starts = indices.tolist()[::PAGE_SIZE]
        base = self.index_k_with_scale_buffer.data_ptr()
        return [base + start // PAGE_SIZE * self.PAGE_BYTES for start in starts], [self.PAGE_BYTES] * len(starts)


def hybrid(config: HiCacheStorageConfig, kv_pool, **pools):
    """A backend attached as SGLang's HybridCacheController attaches one: the KV anchor,
    then every pool of the group through register_mem_host_pool_v2 (the anchor's too)."""
    backend = create(config, kv_pool)
    backend.register_mem_host_pool_v2(kv_pool, PoolName.KV)
    for name, pool in pools.items():
        backend.register_mem_host_pool_v2(pool, PoolName(name))
    backend.on_host_pools_registered()
    return backend


def window(pages: int) -> list[str]:
    """A TRAILING_PAGES pool's keys in a query: SGLang gives placeholders, their count the window."""
    return ["__placeholder__"] * pages


def states(slots: list[int], keys: list[str], policy=None):
    """A Mamba PoolTransfer: the states at `slots` of the pages `keys`."""
    transfer = PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor(slots, dtype=torch.int64), keys=keys)
    if policy is not None:
        transfer.hit_policy = policy
    return transfer


def test_a_mamba_hybrid_models_states_are_backed_up_found_and_loaded(shared_cluster):
    """Instance A backs up a hybrid model's KV pages (v1) and Mamba states at two page
    boundaries (v2); instance B finds the prefixes it can restore, KV and state together,
    and loads a state into another slot, byte for byte. Before 2026-12-03 the attach of such
    a model was refused."""
    cluster = shared_cluster(2)
    mamba_a, mamba_b = MambaHostPool(), MambaHostPool()
    mamba_a.fill_randomly()
    config = storage_config(cluster.master_endpoint)
    a = hybrid(config, MHAHostPool("page_first"), mamba=mamba_a)
    b = hybrid(config, MHAHostPool("page_first"), mamba=mamba_b)
    other_rank = hybrid(storage_config(cluster.master_endpoint, tp_rank=1), MHAHostPool("page_first"),
                        mamba=MambaHostPool())  # fmt: skip
    more_layers = hybrid(config, MHAHostPool("page_first"), mamba=MambaHostPool(layers=LAYERS + 1))
    try:
        keys = [f"h{i}" for i in range(5)]
        assert a.batch_set_v1(keys, host_indices([1, 2, 3, 4, 5])) == [True] * 5
        assert a.batch_set_v2([states([3, 5], [keys[2], keys[4]])]) == {PoolName.MAMBA: [True, True]}
        assert a.batch_set_v2([states([3], [keys[2]])]) == {PoolName.MAMBA: [True]}  # present: success
        listed = a._store.list_objects("mamba")  # one object per state: every component gathered
        state_bytes = sum(part.numel() * part.element_size() for part in mamba_a.state(0))
        name = "org-tiny-model@page_first_bfloat16_tp2_{}_0_mamba_page_first_float32_bfloat16_{}B"
        assert sorted(listed.keys) == [name.format(k, state_bytes) for k in ("h2", "h4")]
        assert listed.sizes == [state_bytes] * 2

        trailing = PoolHitPolicy.TRAILING_PAGES
        found = b.batch_exists_v2(keys, [states([], window(1), trailing)])
        assert (found.kv_hit_pages, found.restorable_prefix_pages) == (5, [3, 5])
        assert found.extra_pool_hit_pages == {PoolName.KV: 5, PoolName.MAMBA: 5}
        found = b.batch_exists_v2(keys[:4], [states([], window(1), trailing)])  # no state after page 4
        assert (found.kv_hit_pages, found.restorable_prefix_pages) == (3, [3])
        found = b.batch_exists_v2(keys, [states([], window(2), trailing)])  # two states needed at the end
        assert (found.kv_hit_pages, found.restorable_prefix_pages) == (0, [])
        found = b.batch_exists_v2(keys, [states([], keys, PoolHitPolicy.ALL_PAGES)])  # pages 1, 2 have none
        assert (found.kv_hit_pages, found.restorable_prefix_pages) == (0, [])
        assert b.batch_exists_v2(keys, []).kv_hit_pages == 5  # no other pool: the KV prefix
        # Each pool's own count whatever the order: a state at page 5 past an indexer-like
        # ALL_PAGES pool that stops at 3 pages is still the Mamba pool's 5.
        found = b.batch_exists_v2(keys, [states([], keys, PoolHitPolicy.ALL_PAGES), states([], window(1), trailing)])
        assert found.extra_pool_hit_pages == {PoolName.KV: 5, PoolName.MAMBA: 5}
        assert (found.kv_hit_pages, found.restorable_prefix_pages) == (0, [])
        # States of another format (more Mamba layers: a draft model's, say) are not found.
        assert more_layers.batch_exists_v2(keys, [states([], window(1), trailing)]).kv_hit_pages == 0

        assert b.batch_get_v2([states([6, 7], [keys[4], "absent"])]) == {PoolName.MAMBA: [True, False]}
        for mine, theirs in zip(mamba_b.state(6), mamba_a.state(5)):
            assert torch.equal(mine, theirs)
        assert not any(part.any() for part in mamba_b.state(7))  # a miss writes nothing

        # TP rank 1 holds other heads and other states: it finds neither of rank 0's.
        assert other_rank.batch_exists_v2(keys, [states([], window(1), trailing)]).kv_hit_pages == 0
        assert other_rank.batch_get_v2([states([1], [keys[4]])]) == {PoolName.MAMBA: [False]}
    finally:
        for backend in (a, b, other_rank, more_layers):
            backend.close()


def test_an_mla_models_indexer_is_shared_by_ranks_and_its_mamba_state_is_not(shared_cluster):
    """In an MLA model SGLang backs pages up from the first TP rank only, except the Mamba
    states, which each rank shards (HybridCacheController.should_backup): rank 1 finds rank
    0's KV and DSA indexer pages (ALL_PAGES), and a prefix that needs rank 1's own state
    only once rank 1 wrote it."""
    cluster = shared_cluster(1)
    indexer_0 = IndexerHostPool()
    written = indexer_0.index_k_with_scale_buffer
    written.copy_(torch.randint(0, 255, written.shape, dtype=torch.uint8))
    rank0 = hybrid(storage_config(cluster.master_endpoint, mla=True), MLAHostPool("page_first"),
                   indexer=indexer_0, mamba=MambaHostPool())  # fmt: skip
    indexer_1, mamba_1 = IndexerHostPool(), MambaHostPool()
    rank1 = hybrid(storage_config(cluster.master_endpoint, mla=True, tp_rank=1), MLAHostPool("page_first"),
                   indexer=indexer_1, mamba=mamba_1)  # fmt: skip
    try:
        keys = ["m0", "m1", "m2"]
        indexer = PoolTransfer(PoolName.INDEXER, host_indices=host_indices([0, 1, 2]), keys=keys)
        assert rank0.batch_set_v1(keys, host_indices([0, 1, 2])) == [True] * 3
        assert rank0.batch_set_v2([indexer, states([2], keys[2:])]) == {
            PoolName.INDEXER: [True] * 3, PoolName.MAMBA: [True],
        }  # fmt: skip
        query = [PoolTransfer(PoolName.INDEXER, keys=keys), states([], window(1), PoolHitPolicy.TRAILING_PAGES)]
        assert rank0.batch_exists_v2(keys, query).kv_hit_pages == 3
        assert rank1.batch_exists_v2(keys, query[:1]).kv_hit_pages == 3  # KV and indexer: shared
        assert rank1.batch_exists_v2(keys, query).kv_hit_pages == 0  # rank 1's state is not there
        mamba_1.fill_randomly()
        assert rank1.batch_set_v2([states([4], keys[2:])]) == {PoolName.MAMBA: [True]}
        assert rank1.batch_exists_v2(keys, query).kv_hit_pages == 3
        loaded = PoolTransfer(PoolName.INDEXER, host_indices=host_indices([5, 6, 7]), keys=keys)
        assert rank1.batch_get_v2([loaded]) == {PoolName.INDEXER: [True] * 3}
        assert torch.equal(indexer_1.index_k_with_scale_buffer[5:8], indexer_0.index_k_with_scale_buffer[0:3])
    finally:
        rank0.close()
        rank1.close()


def test_an_mla_models_shared_pages_are_held_until_every_rank_has_fetched_them(shared_cluster):
    """Each TP rank of an MLA model looks the pages up (SGLang syncs the ranks' hits before
    any fetch), then fetches them into its own host pool. The KV and indexer pages are one
    object for every rank: their hold lasted until the first rank's fetch, and an eviction
    before the second rank's failed it. Now it lasts until both have fetched; a rank's own
    Mamba state (one object per rank) is held for that rank's fetch only. A remove that
    spares leased objects stands for eviction here."""
    cluster = shared_cluster(1)
    ranks, mambas = [], []
    for rank in (0, 1):
        mambas.append(MambaHostPool())
        mambas[rank].fill_randomly()
        ranks.append(hybrid(storage_config(cluster.master_endpoint, mla=True, tp_rank=rank),
                            MLAHostPool("page_first"), indexer=IndexerHostPool(), mamba=mambas[rank]))  # fmt: skip
    try:
        keys = ["s0", "s1"]
        indexer = PoolTransfer(PoolName.INDEXER, host_indices=host_indices([0, 1]), keys=keys)
        assert ranks[0].batch_set_v1(keys, host_indices([0, 1])) == [True] * 2
        assert ranks[0].batch_set_v2([indexer]) == {PoolName.INDEXER: [True] * 2}
        for rank in ranks:
            assert rank.batch_set_v2([states([1], keys[1:])]) == {PoolName.MAMBA: [True]}
        query = [PoolTransfer(PoolName.INDEXER, keys=keys), states([], window(1), PoolHitPolicy.TRAILING_PAGES)]
        for rank in ranks:  # the lookups, then SGLang's sync of the ranks' hits
            assert rank.batch_exists_v2(keys, query).kv_hit_pages == 2
        shared = ranks[0]._object_keys(keys) + ranks[0]._sidecar_keys(PoolName.INDEXER, keys)
        own = [rank._sidecar_keys(PoolName.MAMBA, keys[1:])[0] for rank in ranks]
        assert len(set(shared)) == 4 and own[0] != own[1]

        def fetch(rank: int) -> None:
            loaded = PoolTransfer(PoolName.INDEXER, host_indices=host_indices([2, 3]), keys=keys)
            assert ranks[rank].batch_get_v1(keys, host_indices([2, 3])) == [True] * 2
            assert ranks[rank].batch_get_v2([loaded, states([2], keys[1:])]) == {
                PoolName.INDEXER: [True] * 2, PoolName.MAMBA: [True],
            }  # fmt: skip

        fetch(0)
        # A remove gives the store's own leases back first: rank 0's fetch is over.
        leased = ErrorCode.OBJECT_HAS_LEASE
        assert ranks[0]._store.batch_remove([*shared, *own]) == [leased] * 4 + [ErrorCode.OK, leased]
        fetch(1)
        assert ranks[1]._store.batch_remove([*shared, own[1]]) == [ErrorCode.OK] * 5
    finally:
        for rank in ranks:
            rank.close()


def test_other_pools_kvpool_cannot_store_are_refused_at_attach_and_bad_transfers_fail(make_cluster):
    """Refused when SGLang attaches: DeepSeek V4's compressed pools (the BLOCK_GROUPS policy)
    and, in an MLA model with TP > 1, a pool holding each rank's heads, which SGLang backs up
    from the first rank only (the other ranks would read rank 0's heads). In use, a transfer
    kvpool cannot serve is failed pages or a miss, never an exception in SGLang's threads."""
    cluster = make_cluster(1, "16MiB")
    backend = create(storage_config(cluster.master_endpoint), MHAHostPool("page_first"))
    mla = create(storage_config(cluster.master_endpoint, mla=True), MLAHostPool("page_first"))
    try:
        with pytest.raises(InvalidParams, match="deepseek_v4_c4 pool"):
            backend.register_mem_host_pool_v2(IndexerHostPool(), PoolName.DEEPSEEK_V4_C4)
        with pytest.raises(InvalidParams, match="the draft pool holds each TP rank's heads"):
            mla.register_mem_host_pool_v2(MHAHostPool("page_first"), PoolName.DRAFT)
        with pytest.raises(InvalidParams, match="cannot address the pages of KOnlyHostPool"):
            backend.register_mem_host_pool_v2(KOnlyHostPool("layer_first"), PoolName.SWA)
        backend.register_mem_host_pool_v2(MambaHostPool(), PoolName.MAMBA)
        assert backend.batch_set_v1(["k0"], host_indices([0])) == [True]
        groups = PoolTransfer(PoolName.MAMBA, keys=["k0"], hit_policy=PoolHitPolicy.BLOCK_GROUPS)
        assert backend.batch_exists_v2(["k0"], [groups]).kv_hit_pages == 0
        unregistered = PoolTransfer(PoolName.SWA, host_indices=host_indices([1]), keys=["k0"])
        wrong_count = states([1, 2], ["k0"])  # two slots for one page
        assert backend.batch_set_v2([unregistered, wrong_count]) == {PoolName.SWA: [False], PoolName.MAMBA: [False]}
        assert backend.batch_exists_v2(["k0"], [unregistered]).kv_hit_pages == 0
        cluster.master.kill()
        assert backend.batch_get_v2([states([1], ["k0"])]) == {PoolName.MAMBA: [False]}
        assert backend.batch_exists_v2(["k0"], [states([], ["k0"])]).kv_hit_pages == 0
    finally:
        backend.close()
        mla.close()


def test_v0_page_tensor_interface(shared_cluster):
    cluster = shared_cluster(1)
    with v0_backends(cluster.master_endpoint) as ((pool_a, a), (pool_b, b)):
        pages = [pool_a.get_data_page(i * PAGE_SIZE) for i in range(3)]
        assert a.batch_set(["t0", "t1", "t2"], pages) is True
        assert a.set("t3", pool_a.get_data_page(3 * PAGE_SIZE)) is True
        dummies = [pool_b.get_dummy_flat_data_page() for _ in range(5)]
        got = b.batch_get(["t0", "t1", "t2", "t3", "absent"], dummies)
        assert got[4] is None and all(t is not None for t in got[:4])
        for index, tensor in enumerate(got[:4]):
            pool_b.set_from_flat_data_page(index * PAGE_SIZE, tensor)
            assert torch.equal(pool_b.page(index * PAGE_SIZE), pool_a.page(index * PAGE_SIZE))
        assert b.get("absent", pool_b.get_dummy_flat_data_page()) is None
        assert b.batch_get([], []) == [] and b.batch_get(["t0"], None) == [None]
        assert a.batch_set([], []) is False


def test_v0_page_tensors_of_an_mla_pool_are_views_of_its_registered_buffer(shared_cluster):
    """SGLang's MLA host pool hands out a page as a view of its kv_buffer (pool_host/mla.py
    get_data_page, page_first layouts: a slice flattened without a copy), which the backend
    registered whole at attach: registering the page again overlapped it, and every backup
    failed."""

    class MLAPoolPages(MLAHostPool):
        def get_data_page(self, index: int, flat: bool = True):
            page = self.kv_buffer[index : index + self.page_size]
            return page.flatten() if flat else page

        def get_dummy_flat_data_page(self):
            return torch.zeros(LAYERS * PAGE_SIZE * MLA_DIM, dtype=self.dtype)

    cluster = shared_cluster(1)
    with v0_backends(cluster.master_endpoint, MLAPoolPages, mla=True) as ((pool_a, a), (pool_b, b)):
        pages = [pool_a.get_data_page(i * PAGE_SIZE) for i in range(2)]
        assert pages[0].data_ptr() == pool_a.kv_buffer.data_ptr()  # a view, not a copy
        assert a.batch_set(["m0", "m1"], pages) is True
        got = b.batch_get(["m0", "m1"], [pool_b.get_dummy_flat_data_page() for _ in range(2)])
        for page, tensor in zip(pages, got):
            assert tensor is not None and torch.equal(tensor, page)
        into_pool = [pool_b.get_data_page(i * PAGE_SIZE) for i in range(2)]  # a get into the pool itself
        assert all(t is not None for t in b.batch_get(["m0", "m1"], into_pool))
        assert torch.equal(pool_b.kv_buffer[: 2 * PAGE_SIZE], pool_a.kv_buffer[: 2 * PAGE_SIZE])


def test_a_page_another_instance_is_saving_counts_as_saved(make_cluster):
    """Several instances saving one prompt (a shared system prompt) at once: all but the first
    got REPLICA_IS_NOT_READY for its pages (another put of the key in flight), which counted
    as failed: SGLang logged the pages failed and gave the rest of its backup up."""
    cluster = make_cluster(1, "16MiB")
    pool = MHAHostPool("page_first")
    backend = create(storage_config(cluster.master_endpoint), pool)
    try:
        object_keys = backend._object_keys(["s0"])
        other = backend._store._async  # another instance's put of the same objects, under way
        in_flight = other._put_start(object_keys, [[memoryview(b"x" * 64)]] * len(object_keys), None)
        backend._store._loop.run(in_flight, 5_000)
        assert backend.batch_set_v1(["s0"], host_indices([0])) == [True]
    finally:
        backend.close()


def test_a_dead_master_fails_pages_without_raising(make_cluster):
    cluster = make_cluster(1, "16MiB")
    pool = MHAHostPool("page_first")
    backend = create(storage_config(cluster.master_endpoint), pool)
    try:
        assert backend.batch_set_v1(["x0"], host_indices([0])) == [True]
        cluster.master.kill()
        assert backend.batch_exists(["x0"]) == 0
        assert backend.batch_get_v1(["x0", "x1"], host_indices([1, 2])) == [False, False]
        assert backend.batch_set_v1(["x2"], host_indices([3])) == [False]
        assert backend.exists("x0") is False
        assert backend.batch_get(["x0"], [pool.get_dummy_flat_data_page()]) == [None]
        assert backend.batch_set(["x0"], [pool.get_data_page(0)]) is False
        backend.clear()  # logs, does not raise
        assert backend.batch_get_v1([], host_indices([])) == []
    finally:
        backend.close()
