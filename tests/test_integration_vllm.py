"""kvpool's vLLM KV connector, built and driven through the real vLLM package's classes on CPU.

How: vLLM's own KVConnectorFactory loads kvpool.integrations.vllm.KVPoolConnector from a real
VllmConfig/KVTransferConfig (kv_connector_module_path), once per role, against a LocalCluster.
Requests are real vllm.v1.request.Request objects whose block hashes come from vLLM's own block
hasher; allocations are real KVCacheBlocks; each step's plan goes through real SchedulerOutput /
NewRequestData objects, as vLLM's scheduler would send them. Instance A prefills and saves;
instance B (another scheduler and worker, another paged cache) looks the prompt up, loads the
blocks into different block ids, and its blocks must equal A's, byte for byte, in every layer.
Then the failure paths: a block evicted between lookup and load is reported for recompute, and
a dead master makes lookups miss and loads fail without raising. Most tests load synchronously
(`load_async` false); the async tests drive the default path: a load on the worker's thread,
its end reported by get_finished.

vLLM itself cannot be installed with its dependencies here: vllm 0.34.0 pins torch==2.14.0,
a CUDA build of several GB. scripts/install-peers.sh vllm installs it with --no-deps plus the
few pure-Python packages its connector, config and scheduler modules import; vllm_on_cpu makes
vLLM take its CPU platform. Skipped unless vllm imports.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import signal
import threading
import time
import weakref

import msgspec
import pytest
import vllm_on_cpu  # noqa: E402, F401  (before vLLM)
from conftest import wait_until

torch = pytest.importorskip("torch", reason="needs torch==2.13.0")
pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.factory",
    reason="vLLM is not installed (scripts/install-peers.sh vllm)",
)
from vllm import SamplingParams  # noqa: E402
from vllm.config import CacheConfig, KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvpool import Store, limits  # noqa: E402
from kvpool.errors import ErrorCode, InvalidParams  # noqa: E402
from kvpool.integrations.vllm import (  # noqa: E402
    KVPoolConnector,
    KVPoolConnectorMetadata,
    KVPoolWorkerMetadata,
    _hex,
    _hit_source,
)
from kvpool.protocol.messages import Replica, SegmentInfo  # noqa: E402

BLOCK_SIZE = 4
NUM_BLOCKS = 16
LAYERS = 3
KV_HEADS = 2
HEAD_SIZE = 8


def vllm_config(master: str, load_async: bool | None = False, **extra) -> VllmConfig:
    """A config for the connector; loads are synchronous unless `load_async` (None: the
    connector's default, async)."""
    if load_async is not None:
        extra["load_async"] = load_async
    config = VllmConfig(
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVPoolConnector",
            kv_connector_module_path="kvpool.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"master": master, "model_name": "org/tiny", **extra},
        ),
    )
    config.scheduler_config.disable_hybrid_kv_cache_manager = True
    return config


def connector(config: VllmConfig, role: KVConnectorRole):
    kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[])
    return KVConnectorFactory.create_connector(config, role, kv_cache_config)


FLASH_ATTENTION_SHAPE = (2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
CPU_ATTENTION_SHAPE = (NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)  # vLLM's CPU backend


def paged_cache(seed: int | None, shape: tuple[int, ...] = FLASH_ATTENTION_SHAPE) -> dict[str, torch.Tensor]:
    """Layers of `shape`, FlashAttention-style by default: (2, num_blocks, block_size,
    kv_heads, head_size); random from `seed`, or zeros."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return {
        f"model.layers.{i}.self_attn.attn": (
            torch.randn(shape, generator=generator, dtype=torch.float32).to(torch.bfloat16)
            if generator is not None else torch.zeros(shape, dtype=torch.bfloat16)
        )
        for i in range(LAYERS)
    }  # fmt: skip


init_none_hash(sha256)
HASHER = get_request_block_hasher(BLOCK_SIZE, sha256)


def request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=4), None, block_hasher=HASHER)


def blocks(ids: list[int]) -> KVCacheBlocks:
    return KVCacheBlocks((tuple(KVCacheBlock(i) for i in ids),))


def step(new: list[NewRequestData], scheduled: dict[str, int]) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=new, scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
        finished_req_ids=set(), free_encoder_mm_hashes=[],
    )  # fmt: skip


def new_request_data(req: Request, block_ids: list[int], num_computed_tokens: int) -> NewRequestData:
    return NewRequestData(
        req_id=req.request_id, prompt_token_ids=req.prompt_token_ids, mm_features=[],
        sampling_params=req.sampling_params, pooling_params=None, block_ids=(block_ids,),
        num_computed_tokens=num_computed_tokens, lora_request=None,
        prefill_token_ids=list(req.prompt_token_ids),
    )  # fmt: skip


def run_worker_step(worker, meta) -> set[int]:
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    return worker.get_block_ids_with_load_errors()


def run_async_load_step(worker, meta, request_id: str) -> set[int]:
    """A step that starts an async load, then the steps vLLM runs until the worker reports it
    done (get_finished, as vLLM's runner asks after each step); the blocks that failed, which
    must come in the same step as the report."""
    assert [load.is_async for load in meta.loads] == [True] and not meta.saves
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    errors = set()
    while True:
        _, finished = worker.get_finished(set())
        errors |= worker.get_block_ids_with_load_errors()
        if finished:
            assert finished == {request_id}
            break
        assert not errors, "failed blocks reported before their load"
        time.sleep(0.005)
    assert worker.get_finished(set()) == (None, None)  # reported once
    return errors


PROMPT = list(range(100, 114))  # 14 tokens: 3 full blocks and 2 tokens


def first_prefill(sched, req_id: str, block_ids: list[int]):
    """The scheduler's plan for a prefill of the whole PROMPT that the pool does not hold."""
    req = request(req_id, PROMPT)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, blocks(block_ids), 0)
    return sched.build_connector_meta(step([new_request_data(req, block_ids, 0)], {req_id: len(PROMPT)}))


def second_turn(sched):
    """The plan of a request for PROMPT and 4 more tokens after first_prefill stored PROMPT:
    its 3 blocks load into blocks 6, 7 and 8, and it saves its fourth, block 9."""
    again = request("r-2", PROMPT + [1, 2, 3, 4])
    assert sched.get_num_new_matched_tokens(again, 0) == (12, False)
    sched.update_state_after_alloc(again, blocks([6, 7, 8, 9, 10]), 12)
    return sched.build_connector_meta(step([new_request_data(again, [6, 7, 8, 9, 10], 12)], {"r-2": 6}))


@contextlib.contextmanager
def two_instances(config: VllmConfig, seed_a: int):
    """Instances A (its paged cache random) and B (zeros), each a scheduler-side and a
    worker-side connector: (sched_a, worker_a, cache_a, sched_b, worker_b, cache_b)."""
    sched_a, worker_a = connector(config, KVConnectorRole.SCHEDULER), connector(config, KVConnectorRole.WORKER)
    sched_b, worker_b = connector(config, KVConnectorRole.SCHEDULER), connector(config, KVConnectorRole.WORKER)
    cache_a, cache_b = paged_cache(seed=seed_a), paged_cache(seed=None)
    worker_a.register_kv_caches(cache_a)
    worker_b.register_kv_caches(cache_b)
    try:
        yield sched_a, worker_a, cache_a, sched_b, worker_b, cache_b
    finally:
        for side in (worker_a, worker_b, sched_a, sched_b):
            side.shutdown()


def test_instance_b_loads_blocks_instance_a_saved(make_cluster):
    cluster = make_cluster(2, "16MiB")
    config = vllm_config(cluster.master_endpoint)
    with two_instances(config, 1) as (sched_a, worker_a, cache_a, sched_b, worker_b, cache_b):
        assert type(sched_a).__name__ == "KVPoolConnector"
        assert sched_a.requires_kv_delivery is False  # a cache: preempted output need not be dropped
        # Instance A: a miss, then prefill of the whole prompt into blocks 5..8; saves 3 blocks.
        req_a = request("a-1", PROMPT)
        assert len(req_a.block_hashes) == 3
        assert sched_a.get_num_new_matched_tokens(req_a, 0) == (0, False)
        sched_a.update_state_after_alloc(req_a, blocks([5, 6, 7, 8]), 0)
        meta = sched_a.build_connector_meta(step([new_request_data(req_a, [5, 6, 7, 8], 0)], {"a-1": 14}))
        assert meta.loads == [] and [s.block_ids for s in meta.saves] == [[5, 6, 7]]
        assert run_worker_step(worker_a, meta) == set()
        keys = sorted(worker_a._store.list_objects("org/tiny").keys)
        assert len(keys) == 3
        assert keys[0].startswith("org/tiny@kv:auto@tp_size:1@pp_size:1@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@")

        # Instance B: the same prompt and a new turn; 3 blocks come from the pool.
        req_b = request("b-1", PROMPT + [7, 8, 9, 10, 11, 12])
        assert sched_b.get_num_new_matched_tokens(req_b, 0) == (12, False)
        sched_b.update_state_after_alloc(req_b, blocks([1, 2, 3, 9, 10]), 12)
        # vLLM's prefix-cache metrics by source: the nodes' DRAM, on this host.
        assert sched_b.get_external_cache_hit_sources(req_b, 12) == {CacheHitSource.HOST: 12}
        meta = sched_b.build_connector_meta(step([new_request_data(req_b, [1, 2, 3, 9, 10], 12)], {"b-1": 8}))
        assert [(load.block_ids, len(load.block_hashes)) for load in meta.loads] == [([1, 2, 3], 3)]
        assert [s.block_ids for s in meta.saves] == [[9, 10]]  # B's own new full blocks
        assert run_worker_step(worker_b, meta) == set()
        for name in cache_a:
            for kv in (0, 1):
                assert torch.equal(cache_b[name][kv, 1:4], cache_a[name][kv, 5:8]), (name, kv)
        assert not cache_b[name][:, 0].any() and not cache_b[name][:, 4:9].any()

        # A prompt that is all cached still leaves its last block to compute.
        req_c = request("c-1", PROMPT[:12])
        assert sched_b.get_num_new_matched_tokens(req_c, 0) == (8, False)
        # Locally computed tokens are not loaded again.
        assert sched_b.get_num_new_matched_tokens(request("d-1", PROMPT), 8) == (4, False)
        # vLLM's prefix cache holds the first 2 blocks (ids 11, 12): the pool's third block
        # loads into the block after them, and vLLM's own blocks are left alone. vLLM sets
        # request.num_computed_tokens only after update_state_after_alloc (scheduler.py).
        req_e = request("e-1", PROMPT + [20, 21, 22, 23, 24, 25])
        assert sched_b.get_num_new_matched_tokens(req_e, 8) == (4, False)
        assert req_e.num_computed_tokens == 0
        sched_b.update_state_after_alloc(req_e, blocks([11, 12, 13, 14, 15]), 4)
        meta = sched_b.build_connector_meta(step([new_request_data(req_e, [11, 12, 13, 14, 15], 12)], {"e-1": 8}))
        assert [(load.block_ids, len(load.block_hashes)) for load in meta.loads] == [([13], 1)]
        assert run_worker_step(worker_b, meta) == set()
        for name in cache_a:
            for kv in (0, 1):
                assert torch.equal(cache_b[name][kv, 13], cache_a[name][kv, 7]), (name, kv)
            assert not cache_b[name][:, 11:13].any()


def test_layers_that_share_one_kv_cache_save_and_load_it_once(shared_cluster):
    """Cross-layer KV sharing (Gemma 3n, Gemma 4): vLLM registers a shared layer as the very
    tensor of the layer it shares (gpu_model_runner.py, kv_caches[layer] =
    kv_caches[target]). Its ranges twice in one block's read overlapped, which a get refuses:
    every load failed."""
    cluster = shared_cluster(1)
    cache_a, cache_b = paged_cache(seed=1), paged_cache(seed=None)
    for cache in (cache_a, cache_b):
        cache["model.layers.9.self_attn.attn"] = cache["model.layers.0.self_attn.attn"]
    a_saves_and_b_loads(cluster.master_endpoint, cache_a, cache_b)
    for name in cache_a:
        assert torch.equal(cache_b[name][:, 6:9], cache_a[name][:, 5:8]), name


def a_saves_and_b_loads(master: str, cache_a: dict, cache_b: dict) -> None:
    """Instance A (its paged cache `cache_a`) saves PROMPT from its blocks 5..7 (first_prefill);
    instance B loads them into its blocks 6..8 of `cache_b` (second_turn); every step clean."""
    config = vllm_config(master)
    sched_a, worker_a = connector(config, KVConnectorRole.SCHEDULER), connector(config, KVConnectorRole.WORKER)
    sched_b, worker_b = connector(config, KVConnectorRole.SCHEDULER), connector(config, KVConnectorRole.WORKER)
    worker_a.register_kv_caches(cache_a)
    worker_b.register_kv_caches(cache_b)
    try:
        assert run_worker_step(worker_a, first_prefill(sched_a, "a-1", [5, 6, 7, 8])) == set()
        assert run_worker_step(worker_b, second_turn(sched_b)) == set()
    finally:
        for side in (worker_a, worker_b, sched_a, sched_b):
            side.shutdown()


def test_the_cpu_backends_block_first_layout_saves_and_loads_whole_blocks(shared_cluster):
    """vLLM's CPU attention (the backend this connector serves) lays a layer out block
    first, K and V in one row: (num_blocks, kv_heads, block_size, 2 * head_size)."""
    cluster = shared_cluster(1)
    cache_a, cache_b = paged_cache(1, CPU_ATTENTION_SHAPE), paged_cache(None, CPU_ATTENTION_SHAPE)
    a_saves_and_b_loads(cluster.master_endpoint, cache_a, cache_b)
    for name in cache_a:
        assert torch.equal(cache_b[name][6:9], cache_a[name][5:8]), name
        assert not cache_b[name][:6].any() and not cache_b[name][9:].any(), name


def test_a_lookup_of_more_keys_than_a_master_batch_finds_every_block_a_worker_can_load(make_cluster):
    """A master takes BATCH_KEYS_MAX keys in one batch: a prompt of more blocks x TP x PP
    ranks (past 65k tokens at block 16 and TP 4) was one lookup it refused, a whole miss. It
    goes in batches now; and a hit stops at BATCH_KEYS_MAX blocks, which a worker loads in
    one batch (a longer one would be a failed load)."""
    cluster = make_cluster(1, "64MiB")

    def stored_prompt(store: Store, sched, block_count: int, tp_size: int):
        prompt = request(f"long-{tp_size}", list(range(block_count * BLOCK_SIZE + 1)))
        keys = [sched._key(_hex(h), tp, 0) for h in prompt.block_hashes for tp in range(tp_size)]
        assert len(keys) == block_count * tp_size
        for start in range(0, len(keys), 4096):
            batch = keys[start : start + 4096]
            assert store.put_batch(batch, [b"kv"] * len(batch)) == [0] * len(batch)
        return prompt, keys

    # Lookups of 16k keys over two batches: on a loaded machine (tests beside it) longer than
    # the scheduler's default bound, whose miss other tests are about; this one is about batches.
    options = {"lookup_hold_ms": 0, "lookup_timeout_ms": 10_000}
    config = vllm_config(cluster.master_endpoint, **options)
    config.parallel_config.tensor_parallel_size = 4
    tp4 = connector(config, KVConnectorRole.SCHEDULER)
    tp1 = connector(vllm_config(cluster.master_endpoint, **options), KVConnectorRole.SCHEDULER)
    try:
        with Store(cluster.master_endpoint) as store:
            blocks = limits.BATCH_KEYS_MAX // 4 + 5  # x 4 ranks: past one batch
            prompt, keys = stored_prompt(store, tp4, blocks, 4)
            assert tp4.get_num_new_matched_tokens(prompt, 0) == (blocks * BLOCK_SIZE, False)
            store.remove(keys[limits.BATCH_KEYS_MAX + 1])  # rank 1 of block 4096: the second batch
            assert tp4.get_num_new_matched_tokens(prompt, 0) == (4096 * BLOCK_SIZE, False)
            longest, _ = stored_prompt(store, tp1, limits.BATCH_KEYS_MAX + 3, 1)
            assert tp1.get_num_new_matched_tokens(longest, 0) == (limits.BATCH_KEYS_MAX * BLOCK_SIZE, False)
    finally:
        tp4.shutdown()
        tp1.shutdown()


def test_a_kv_cache_outside_host_memory_is_refused_at_registration(shared_cluster):
    """A GPU's cache address is not this process's memory: the first save or load would
    memcpy from it and crash the worker. vLLM hands the worker its caches at start
    (register_kv_caches), so that is where it must fail, naming the layer."""
    cluster = shared_cluster(1)
    worker = connector(vllm_config(cluster.master_endpoint), KVConnectorRole.WORKER)
    try:
        on_device = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in paged_cache(None).items()}
        named = r"layer model\.layers\.0\.self_attn\.attn: the KV cache is on meta"
        with pytest.raises(InvalidParams, match=named) as refused:
            worker.register_kv_caches(on_device)
        assert "LMCacheConnectorV1" in str(refused.value)  # what to run instead
        assert worker._registered == []
    finally:
        worker.shutdown()


def test_a_load_that_fails_on_one_tp_rank_only_leaves_no_rank_the_blocks_computed_over_it(shared_cluster):
    """TP rank 0's object of a planned block is lost between the lookup and the load; rank
    1's loads. Rank 0 skips its saves of that step, but rank 1 saved the block it computed
    over hidden states rank 0's garbage entered (all-reduced), under its right key: a later
    recompute would find the key taken, and rank 1 would load that KV as a hit. The
    scheduler, which hears rank 0's failure, removes every rank's saves of that step."""
    import types

    cluster = shared_cluster(1)
    config = vllm_config(cluster.master_endpoint)
    config.parallel_config.tensor_parallel_size = 2
    sched_a, sched_b = connector(config, KVConnectorRole.SCHEDULER), connector(config, KVConnectorRole.SCHEDULER)
    workers = {}
    for name, seed in (("a", 1), ("b", None)):
        for rank in (0, 1):
            worker = workers[name, rank] = connector(config, KVConnectorRole.WORKER)
            worker.tp_rank = rank  # what _parallel_ranks() gives TP rank `rank`
            worker.register_kv_caches(paged_cache(None if seed is None else seed + rank))
    try:
        meta = first_prefill(sched_a, "a-1", [5, 6, 7, 8])
        assert all(run_worker_step(workers["a", rank], meta) == set() for rank in (0, 1))
        meta = second_turn(sched_b)  # loads 3 blocks into 6, 7 and 8, saves block 9 in that step
        store = workers["b", 0]._store
        store.remove(workers["b", 0]._key(meta.loads[0].block_hashes[2], prefix=meta.key_prefix), force=True)
        failed = set()
        for rank in (0, 1):
            failed |= run_worker_step(workers["b", rank], meta)
        assert failed == {8}  # rank 0's alone
        saved = [workers["b", rank]._key(meta.saves[0].block_hashes[0], prefix=meta.key_prefix) for rank in (0, 1)]
        assert store.batch_exists(saved) == [False, True]  # rank 1 saved it
        sched_b.update_connector_output(types.SimpleNamespace(invalid_block_ids=failed))  # vLLM: every rank's
        wait_until(lambda: store.batch_exists(saved) == [False, False], timeout_s=10)  # on the remover thread
    finally:
        for side in [*workers.values(), sched_a, sched_b]:
            side.shutdown()


class _Model:
    """What the connector reads of vLLM's ModelConfig (a real one needs the model's HF config)."""

    model, dtype = "org/tiny", "torch.bfloat16"

    def __init__(self, use_mla: bool, kv_heads: int) -> None:
        self.use_mla, self._kv_heads = use_mla, kv_heads

    def get_total_num_kv_heads(self) -> int:
        return self._kv_heads


@pytest.mark.parametrize(
    ("use_mla", "kv_heads", "key_ranks", "blocks_saved"),
    [(True, 1, [0, 0, 0, 0], [1, 1, 1, 0]), (False, 2, [0, 0, 1, 1], [2, 1, 2, 1]),
     (False, 4, [0, 1, 2, 3], [3, 3, 3, 3])],
    ids=["mla", "two-kv-heads", "four-kv-heads"],
)  # fmt: skip
def test_tp_ranks_that_hold_the_same_kv_store_it_once(shared_cluster, use_mla, kv_heads, key_ranks, blocks_saved):
    """At TP 4 an MLA model's ranks all hold the same latent KV, and with 2 KV heads vLLM
    gives ranks 0-1 one head and 2-3 the other. Every rank stored its bytes under a key of its
    own: four copies of each MLA block in the pool. Ranks that hold the same bytes now share
    keys, save the blocks of a step in turns, and all load every block. An MLA block is the
    same at any TP size: a deployment at TP 2 finds it too; a GQA one must not."""
    cluster = shared_cluster(1)
    config = vllm_config(cluster.master_endpoint)
    config.parallel_config.tensor_parallel_size = 4
    config.model_config = _Model(use_mla, kv_heads)
    shape = (NUM_BLOCKS, BLOCK_SIZE, 3 * HEAD_SIZE) if use_mla else FLASH_ATTENTION_SHAPE
    sched_a, sched_b = connector(config, KVConnectorRole.SCHEDULER), connector(config, KVConnectorRole.SCHEDULER)
    workers, caches = {}, {}
    for name in ("a", "b"):
        for rank in range(4):
            worker = workers[name, rank] = connector(config, KVConnectorRole.WORKER)
            worker.tp_rank = rank  # what _parallel_ranks() gives TP rank `rank`
            caches[name, rank] = paged_cache(key_ranks[rank] if name == "a" else None, shape)
            worker.register_kv_caches(caches[name, rank])
    try:
        meta = first_prefill(sched_a, "a-1", [5, 6, 7, 8])
        store = workers["a", 0]._store
        saved = []
        for rank in range(4):
            before = set(store.list_objects().keys)
            assert run_worker_step(workers["a", rank], meta) == set()
            saved.append(len(set(store.list_objects().keys) - before))
        assert saved == blocks_saved  # the ranks of one KV take turns over the 3 blocks
        assert len(store.list_objects().keys) == 3 * len(set(key_ranks))  # once per distinct KV

        def blocks_of(layer: torch.Tensor, ids: list[int]) -> torch.Tensor:
            return layer[ids] if use_mla else layer[:, ids]

        meta = second_turn(sched_b)  # loads the 3 blocks into 6, 7 and 8
        for rank in range(4):
            assert run_worker_step(workers["b", rank], meta) == set()
            for name, layer in caches["b", rank].items():
                assert torch.equal(blocks_of(layer, [6, 7, 8]), blocks_of(caches["a", rank][name], [5, 6, 7]))
        config.parallel_config.tensor_parallel_size = 2
        sched_c = connector(config, KVConnectorRole.SCHEDULER)
        try:
            assert sched_c.get_num_new_matched_tokens(request("c-1", PROMPT), 0) == ((12 if use_mla else 0), False)
        finally:
            sched_c.shutdown()
    finally:
        for side in [*workers.values(), sched_a, sched_b]:
            side.shutdown()


def test_saves_run_after_the_step_and_a_step_handing_their_blocks_out_again_waits_for_them(shared_cluster):
    """With vLLM's block pool bound (its scheduler binds it), wait_for_save returns at once and
    a worker puts the step's blocks on its saver thread, during the next forward passes. A
    step that hands one of those blocks to a request again (a finished or preempted request
    frees its blocks at once) names the save in its plan, and each worker ends it before that
    step writes anything: written again under a put, a block would be stored under its old
    key. Until 2026-12-07 the scheduler held a reference on each block instead, and vLLM's
    reset_prefix_cache(reset_running_requests=True) failed meanwhile (review helper-148)."""
    from vllm.v1.core.block_pool import BlockPool

    cluster = shared_cluster(1)
    config = vllm_config(cluster.master_endpoint)
    config.parallel_config.tensor_parallel_size = 2
    sched = connector(config, KVConnectorRole.SCHEDULER)
    pool = BlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=BLOCK_SIZE)
    sched.bind_gpu_block_pool(pool)
    workers = [connector(config, KVConnectorRole.WORKER) for _ in range(2)]
    gate = threading.Event()
    for rank, worker in enumerate(workers):
        worker.tp_rank = rank  # what _parallel_ranks() gives TP rank `rank`
        worker.register_kv_caches(paged_cache(seed=20 + rank))
    held_put = workers[0]._store.batch_put_from_multi_buffers
    workers[0]._store.batch_put_from_multi_buffers = lambda *args: gate.wait(10) and held_put(*args)
    try:
        meta = first_prefill(sched, "a-1", [5, 6, 7, 8])
        assert [save.job for save in meta.saves] == [0] and meta.flush_jobs == []
        assert [pool.blocks[b].ref_cnt for b in (5, 6, 7)] == [0, 0, 0]  # no reference of its own
        assert sched.has_pending_push_work()
        for worker in workers:
            assert run_worker_step(worker, meta) == set()  # returns with rank 0's put held
        reported = wait_until(workers[1].build_connector_worker_meta, 10)
        assert reported.saved == {0: 1}
        sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=reported))
        assert sched.has_pending_push_work() and workers[0].build_connector_worker_meta() is None
        # A prefix-cache hit on the save's blocks is read, not written: no flush (it held a
        # shared prompt's next request behind the put: review helper-153).
        hit = request("hit", PROMPT + [1, 2, 3, 4])
        assert sched.build_connector_meta(step([new_request_data(hit, [5, 6, 7, 9], 12)], {"hit": 6})).flush_jobs == []
        handing_out = first_prefill(sched, "b-1", [6, 9, 10, 11])  # block 6 again, under job 0's put
        assert handing_out.flush_jobs == [0]
        workers[1].bind_connector_metadata(handing_out)  # its part of job 0 is over: at once
        binding = threading.Thread(target=workers[0].bind_connector_metadata, args=(handing_out,))
        binding.start()
        binding.join(0.3)
        assert binding.is_alive()  # rank 0 waits for its put before the step writes block 6
        gate.set()
        binding.join(10)
        assert not binding.is_alive()
        reported = workers[0].build_connector_worker_meta()
        assert reported is not None and reported.aggregate(KVPoolWorkerMetadata({0: 1})).saved == {0: 2}
        sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=reported))
        assert 0 not in sched._saving
        for worker in workers:
            worker.clear_connector_metadata()
        assert sched.get_num_new_matched_tokens(request("a-2", PROMPT), 0) == (12, False)  # both ranks put
    finally:
        gate.set()
        for side in [*workers, sched]:
            side.shutdown()


def test_saves_a_pool_does_not_take_are_given_up_rather_than_hold_vllm_back(make_cluster):
    """A pool that stops answering (master SIGSTOP: each put waits out its 5 s RPC bound, one
    after another on the saver thread) kept every planned save's blocks pinned until vLLM's
    KV cache was full, and the engine produced no token (a review, 2 s into the stall). Past
    _SAVE_JOBS_WAITING_MAX jobs waiting, a worker gives a step's saves up at once (reported
    done, not put); a step that hands out the blocks of saves still waiting gives them up
    rather than wait; and while the lookup breaker is open (the master did not answer a
    lookup) the scheduler plans no save at all."""
    from vllm.v1.core.block_pool import BlockPool

    from kvpool.errors import RpcTimeout
    from kvpool.integrations.vllm import _SAVE_JOBS_WAITING_MAX

    cluster = make_cluster(1, "16MiB")
    config = vllm_config(cluster.master_endpoint)
    sched, worker = connector(config, KVConnectorRole.SCHEDULER), connector(config, KVConnectorRole.WORKER)
    requests = _SAVE_JOBS_WAITING_MAX + 4
    num_blocks = 4 * (requests + 1)  # blocks of their own each: no step hands out another's
    pool = BlockPool(num_blocks, enable_caching=True, hash_block_size=BLOCK_SIZE)
    sched.bind_gpu_block_pool(pool)
    worker.register_kv_caches(paged_cache(seed=4, shape=(2, num_blocks, *FLASH_ATTENTION_SHAPE[2:])))
    entered, gate = threading.Event(), threading.Event()
    held_put = worker._store.batch_put_from_multi_buffers

    def stalled_put(*args):  # as a put to a master that does not answer
        entered.set()
        gate.wait(10)
        return held_put(*args)

    worker._store.batch_put_from_multi_buffers = stalled_put
    try:
        assert run_worker_step(worker, first_prefill(sched, "r-0", [0, 1, 2, 3])) == set()
        assert entered.wait(10)  # job 0 on the saver thread, stalled
        for index in range(1, requests):
            blocks = list(range(4 * index, 4 * index + 4))
            assert run_worker_step(worker, first_prefill(sched, f"r-{index}", blocks)) == set()
        reported = worker.build_connector_worker_meta()
        given_up = list(range(_SAVE_JOBS_WAITING_MAX + 1, _SAVE_JOBS_WAITING_MAX + 4))
        assert sorted(reported.saved) == given_up and sorted(reported.failed) == given_up, reported
        sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=reported))
        assert len(sched._saving) == _SAVE_JOBS_WAITING_MAX + 1  # the stalled one and those waiting
        waiting = list(range(1, _SAVE_JOBS_WAITING_MAX + 1))
        binding = threading.Thread(target=worker.bind_connector_metadata,
                                   args=(KVPoolConnectorMetadata(flush_jobs=waiting),))  # their blocks handed out
        binding.start()
        binding.join(5)
        assert not binding.is_alive() and not gate.is_set()  # given up: not behind the put still stalled
        reported = worker.build_connector_worker_meta()
        assert sorted(reported.saved) == waiting and sorted(reported.failed) == waiting, reported
        worker.clear_connector_metadata()
        sched._breaker.record_failure(RpcTimeout("a lookup the master did not answer"))
        last = list(range(4 * requests, 4 * requests + 4))
        assert first_prefill(sched, "r-breaker-open", last).saves == []
    finally:
        gate.set()
        worker.shutdown()
        sched.shutdown()


def test_a_reset_of_the_connectors_cache_removes_the_models_blocks_and_the_saves_in_flight(make_cluster):
    """vLLM resets the connector's cache with reset_prefix_cache(reset_connector=True), and
    by default on sleep and on a pause that clears caches, as around a weight update: blocks
    computed with the old weights must not load again. The base class answers None, which
    vLLM takes for success, and the pool kept serving them. Now every block of the model
    goes, in every KV format, and only that model's; a save still in flight at the reset
    (its put held on a worker's saver thread) is removed again once it has run. With the
    master gone the reset fails (vLLM then fails it)."""
    from vllm.v1.core.block_pool import BlockPool

    cluster = make_cluster(1, "16MiB")
    config = vllm_config(cluster.master_endpoint)
    other = vllm_config(cluster.master_endpoint)
    other.kv_transfer_config.kv_connector_extra_config["model_name"] = "org/other"
    sched, worker = connector(config, KVConnectorRole.SCHEDULER), connector(config, KVConnectorRole.WORKER)
    other_sched, other_worker = connector(other, KVConnectorRole.SCHEDULER), connector(other, KVConnectorRole.WORKER)
    pool = BlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=BLOCK_SIZE)
    sched.bind_gpu_block_pool(pool)
    gate = threading.Event()
    try:
        for w in (worker, other_worker):
            w.register_kv_caches(paged_cache(seed=5))
        assert run_worker_step(other_worker, first_prefill(other_sched, "o-1", [0, 1, 2, 3])) == set()
        meta = first_prefill(sched, "r-1", [0, 1, 2, 3])
        assert run_worker_step(worker, meta) == set()
        wait_until(lambda: sched.get_num_new_matched_tokens(request("r-2", PROMPT), 0) == (12, False), timeout_s=10)
        sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=worker.build_connector_worker_meta()))
        another_format = Store(cluster.master_endpoint)
        stale_tp2 = f"org/tiny@kv:bfloat16@tp_size:2@pp_size:1@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{'ab' * 16}"
        another_format.put(stale_tp2, b"kv of the old weights")

        held_put = worker._store.batch_put_from_multi_buffers
        worker._store.batch_put_from_multi_buffers = lambda *args: gate.wait(10) and held_put(*args)
        longer = request("r-3", list(range(200, 217)))  # 4 full blocks the pool does not hold
        sched.get_num_new_matched_tokens(longer, 0)
        sched.update_state_after_alloc(longer, blocks([5, 6, 7, 8, 9]), 0)
        in_flight = sched.build_connector_meta(step([new_request_data(longer, [5, 6, 7, 8, 9], 0)], {"r-3": 17}))
        assert run_worker_step(worker, in_flight) == set()  # its put is held on the saver thread

        assert sched.reset_cache() is True
        assert sched.get_num_new_matched_tokens(request("r-4", PROMPT), 0) == (0, False)
        assert not another_format.exists(stale_tp2)
        assert other_sched.get_num_new_matched_tokens(request("o-2", PROMPT), 0) == (12, False)  # not this model
        gate.set()
        reported = wait_until(worker.build_connector_worker_meta, 10)
        saved = [worker._key(h) for h in in_flight.saves[0].block_hashes]
        assert all(another_format.batch_exists(saved))  # landed after the reset...
        sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=reported))
        wait_until(lambda: not any(another_format.batch_exists(saved)), timeout_s=10)  # ... and removed then
        another_format.close()

        cluster.master.kill()
        assert sched.reset_cache() is False
    finally:
        gate.set()
        for side in (worker, sched, other_worker, other_sched):
            side.shutdown()


def test_a_reset_leaves_the_blocks_of_a_namespace_that_extends_this_ones(shared_cluster):
    """The reset removed every key starting with the namespace, "team@": the blocks of
    another deployment whose cache_prefix is "team" ("team@org/tiny@kv:...") went with those
    of model "team". It now matches up to the KV format's first field."""
    cluster = shared_cluster(1)
    prefixed = vllm_config(cluster.master_endpoint, cache_prefix="team")
    named_like_it = vllm_config(cluster.master_endpoint)
    named_like_it.kv_transfer_config.kv_connector_extra_config["model_name"] = "team"
    sides = []
    try:
        for config, req_id in ((prefixed, "p"), (named_like_it, "n")):
            sched, worker = connector(config, KVConnectorRole.SCHEDULER), connector(config, KVConnectorRole.WORKER)
            sides += [sched, worker]
            worker.register_kv_caches(paged_cache(seed=4))
            assert run_worker_step(worker, first_prefill(sched, f"{req_id}-1", [0, 1, 2, 3])) == set()
            wait_until(lambda s=sched: s.get_num_new_matched_tokens(request("again", PROMPT), 0) == (12, False), 10)
        prefixed_sched, _, named_sched, _ = sides
        assert named_sched.reset_cache() is True
        assert named_sched.get_num_new_matched_tokens(request("n-2", PROMPT), 0) == (0, False)
        assert prefixed_sched.get_num_new_matched_tokens(request("p-2", PROMPT), 0) == (12, False)
    finally:
        for side in sides:
            side.shutdown()


def test_an_at_in_a_cache_prefix_or_model_name_reaches_no_other_namespace(shared_cluster):
    """The namespace's parts end with an '@', which the cache_prefix and model name were not
    kept from holding: cache_prefix "team" with model "org/tiny" and model "team@org/tiny"
    without one both named their blocks "team@org/tiny@kv:...", and each loaded the other's
    blocks as its own. An '@' in either becomes a '-' (as in SGLang's adapter); the keys of
    names without one are as before, so the blocks a pool holds stay found."""
    cluster = shared_cluster(1)
    prefixed = vllm_config(cluster.master_endpoint, cache_prefix="team")
    at_in_name = vllm_config(cluster.master_endpoint)
    at_in_name.kv_transfer_config.kv_connector_extra_config["model_name"] = "team@org/tiny"
    sched, worker = connector(prefixed, KVConnectorRole.SCHEDULER), connector(prefixed, KVConnectorRole.WORKER)
    other = connector(at_in_name, KVConnectorRole.SCHEDULER)
    try:
        worker.register_kv_caches(paged_cache(seed=6))
        meta = first_prefill(sched, "p-1", [0, 1, 2, 3])
        assert run_worker_step(worker, meta) == set()
        wait_until(lambda: sched.get_num_new_matched_tokens(request("p-2", PROMPT), 0) == (12, False), 10)
        assert other.get_num_new_matched_tokens(request("o-1", PROMPT), 0) == (0, False)
        first = meta.saves[0].block_hashes[0]
        layout = "kv:auto@tp_size:1@pp_size:1@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0"
        assert worker._key(first) == f"team@org/tiny@{layout}@{first}"  # as before
        assert other._key("ab").startswith("team-org/tiny@kv:")
    finally:
        for side in (worker, sched, other):
            side.shutdown()


def test_hit_sources_name_the_nearest_replica_of_each_block():
    def segment(segment_id: str, tier: str, hostname: str) -> SegmentInfo:
        return SegmentInfo(segment_id, "n", hostname, "h:1", "", b"", 1 << 20, tier)

    segments = {s.segment_id: s for s in (
        segment("here", "dram", "me"), segment("there", "dram", "other"),
        segment("nvme", "disk", "other"), segment("dfs", "dfs", ""),
    )}  # fmt: skip

    def source(*segment_ids: str) -> str:
        return _hit_source([Replica(i, 0) for i in segment_ids], segments, "me")

    assert source("nvme", "there", "here") == "host"
    assert source("nvme", "there") == "p2p"
    assert source("dfs", "nvme") == "disk"
    assert source() == source("unmounted") == "external_unspecified"
    assert {source("here"), source("there"), source("nvme")} <= {s.value for s in CacheHitSource}


def test_async_loads_run_beside_the_forward_passes_and_end_once(shared_cluster):
    """The default: vLLM parks a request with a hit in WAITING_FOR_REMOTE_KVS, its blocks load
    on the worker's loader thread while forward passes go on, and the worker reports the
    request done once; it is scheduled to compute after that, and saves its own blocks.
    vLLM (0.34, with --max-num-inflight-kv-loads) queues a request that may load so before it
    asks: any prompt longer than a block, but not one looked up again after an async load
    (it loads nothing more) unless it was preempted since."""
    cluster = shared_cluster(2)
    config = vllm_config(cluster.master_endpoint, load_async=None)
    with two_instances(config, 4) as (sched_a, worker_a, cache_a, sched_b, worker_b, cache_b):
        assert run_worker_step(worker_a, first_prefill(sched_a, "a-1", [5, 6, 7, 8])) == set()
        req_b = request("b-1", PROMPT + [7, 8, 9, 10, 11, 12])
        assert not sched_b.may_load_async(req_b)  # B never saw PROMPT in the pool: no early load
        assert sched_b.get_num_new_matched_tokens(req_b, 0) == (12, True)
        # Found once, a prompt that starts alike may load early (may_load_async).
        assert sched_b.may_load_async(request("b-3", PROMPT + [1]))
        assert not sched_b.may_load_async(request("b-2", PROMPT[:BLOCK_SIZE]))
        sched_b.update_state_after_alloc(req_b, blocks([1, 2, 3, 9, 10]), 12)
        assert not sched_b.may_load_async(req_b)
        meta = sched_b.build_connector_meta(step([], {}))  # b-1 is not scheduled: it waits
        assert [(load.block_ids, load.is_async) for load in meta.loads] == [([1, 2, 3], True)]
        assert run_async_load_step(worker_b, meta, "b-1") == set()
        for name in cache_a:
            for kv in (0, 1):
                assert torch.equal(cache_b[name][kv, 1:4], cache_a[name][kv, 5:8]), (name, kv)
        # Loaded: vLLM schedules it from token 12; it saves its own new full blocks.
        meta = sched_b.build_connector_meta(step([new_request_data(req_b, [1, 2, 3, 9, 10], 12)], {"b-1": 8}))
        assert meta.loads == [] and [s.block_ids for s in meta.saves] == [[9, 10]]
        assert run_worker_step(worker_b, meta) == set()
        # Preempted, b-1 gives its blocks back: it loads async again, what it saved too.
        preempted = step([], {})
        preempted.preempted_req_ids = {"b-1"}
        sched_b.build_connector_meta(preempted)
        assert sched_b.may_load_async(req_b)
        assert sched_b.get_num_new_matched_tokens(req_b, 0) == (16, True)


def test_the_worker_holds_the_kv_caches_it_registered_until_it_shuts_down(shared_cluster):
    """Loads write into the registered caches, on the loader thread too: a caller that drops
    its own reference must not leave the connector writing into freed memory (tests that
    did corrupted the test process's heap: a segfault, now and then, later in the run)."""
    cluster = shared_cluster(1)
    worker = connector(vllm_config(cluster.master_endpoint), KVConnectorRole.WORKER)
    cache = paged_cache(seed=8)
    layers = [weakref.ref(tensor) for tensor in cache.values()]
    worker.register_kv_caches(cache)
    del cache
    gc.collect()
    assert all(layer() is not None for layer in layers)
    worker.shutdown()
    gc.collect()
    assert all(layer() is None for layer in layers)


def test_a_failed_async_load_reports_its_blocks_with_its_end(make_cluster):
    """vLLM requires a request's failed blocks no later than the step that reports its load
    done: a block gone from the pool, then a dead master (every block fails)."""
    cluster = make_cluster(1, "16MiB")
    config = vllm_config(cluster.master_endpoint, load_async=True)
    sched, worker = connector(config, KVConnectorRole.SCHEDULER), connector(config, KVConnectorRole.WORKER)
    worker.register_kv_caches(paged_cache(seed=5))
    try:
        run_worker_step(worker, first_prefill(sched, "r-1", [0, 1, 2, 3]))
        again = request("r-2", PROMPT + [1, 2, 3, 4])
        assert sched.get_num_new_matched_tokens(again, 0) == (12, True)
        sched.update_state_after_alloc(again, blocks([6, 7, 8, 9, 10]), 12)
        meta = sched.build_connector_meta(step([], {}))
        worker._store.remove(worker._key(meta.loads[0].block_hashes[1]), force=True)
        assert run_async_load_step(worker, meta, "r-2") == {7}
        # vLLM looks r-2 up again (it recomputes from block 7): it loads nothing more (a
        # synchronous load failing under vLLM's async scheduling went wrong: integrations.md).
        assert sched.get_num_new_matched_tokens(again, 0) == (0, False)
        cluster.master.kill()
        assert run_async_load_step(worker, meta, "r-2") == {6, 7, 8}
    finally:
        worker.shutdown()
        sched.shutdown()


@pytest.mark.parametrize("hold_ms", [None, 0])
def test_the_blocks_a_lookup_planned_to_load_are_held_until_the_load(shared_cluster, hold_ms):
    """Between the scheduler's lookup and its workers' load, what it planned to load cannot be
    evicted (a remove that spares leased objects stands for eviction here): the lookup held
    it. The load gives its leases back, and the hold ends with them. lookup_hold_ms 0: none."""
    cluster = shared_cluster(1)
    extra = {} if hold_ms is None else {"lookup_hold_ms": hold_ms}
    config = vllm_config(cluster.master_endpoint, **extra)
    sched, worker = connector(config, KVConnectorRole.SCHEDULER), connector(config, KVConnectorRole.WORKER)
    worker.register_kv_caches(paged_cache(seed=3))
    try:
        run_worker_step(worker, first_prefill(sched, "r-1", [0, 1, 2, 3]))
        meta = second_turn(sched)
        planned = [worker._key(h) for h in meta.loads[0].block_hashes]
        if hold_ms == 0:
            assert worker._store.batch_remove(planned) == [ErrorCode.OK] * len(planned)
            return
        assert worker._store.batch_remove(planned) == [ErrorCode.OBJECT_HAS_LEASE] * len(planned)
        assert run_worker_step(worker, meta) == set()
        gone = (ErrorCode.OK, ErrorCode.OBJECT_NOT_FOUND)  # (a retry after a partial remove)
        wait_until(lambda: all(code in gone for code in worker._store.batch_remove(planned)), timeout_s=5)
        assert not any(worker._store.batch_exists(planned))
    finally:
        worker.shutdown()
        sched.shutdown()


def test_a_reset_while_the_master_does_not_answer_fails_after_a_short_wait(make_cluster):
    """vLLM resets the connector's cache in its engine loop: a master alive but not answering
    (SIGSTOP here: a GC pause, a partition) held that loop the removal's bound, 300 s. Now the
    reset waits on the removal while the master answers a probe of lookup_timeout_ms, and
    otherwise answers False (vLLM fails the reset); the connector's shutdown does not wait for
    the removal given up on. Tried again once the master answers, the reset succeeds, and the
    blocks saved before it are not found."""
    cluster = make_cluster(1, "16MiB")
    config = vllm_config(cluster.master_endpoint, lookup_timeout_ms=200)
    stuck, worker = connector(config, KVConnectorRole.SCHEDULER), connector(config, KVConnectorRole.WORKER)
    sched = connector(config, KVConnectorRole.SCHEDULER)
    worker.register_kv_caches(paged_cache(seed=3))
    answers: list[tuple[bool, float]] = []

    def timed_reset() -> None:
        started = time.monotonic()
        answers.append((stuck.reset_cache(), time.monotonic() - started))

    reset = threading.Thread(target=timed_reset, daemon=True)
    try:
        assert run_worker_step(worker, first_prefill(sched, "r-1", [0, 1, 2, 3])) == set()
        wait_until(lambda: sched.get_num_new_matched_tokens(request("r-2", PROMPT), 0) == (12, False), timeout_s=10)
        cluster.master.signal(signal.SIGSTOP)
        try:
            reset.start()
            reset.join(timeout=5)
            assert answers and answers[0][0] is False, "the reset still waits on the master"
            assert answers[0][1] < 2, answers  # two bounds of 0.2 s and a connect (was 300 s)
            started = time.monotonic()
            stuck.shutdown()
            assert time.monotonic() - started < 2
            # nor does the process's exit, which joins the reset's thread
            wait_until(lambda: not any(t.name.startswith("kvpool-reset") for t in threading.enumerate()), 2)
        finally:
            cluster.master.signal(signal.SIGCONT)
        reset.join(timeout=10)
        assert sched.reset_cache() is True
        assert sched.get_num_new_matched_tokens(request("r-3", PROMPT), 0) == (0, False)
    finally:
        for side in (worker, sched, stuck):
            side.shutdown()


def test_a_reset_does_not_wait_behind_a_removal_an_earlier_reset_gave_up_on(make_cluster):
    """A reset that gave up leaves its removal running until its own bound (300 s): stuck on a
    connection that never answers (an old leader's, half-open) while probes on another are
    answered, the next reset's removal queued behind it on the one reset thread, and that
    reset held vLLM's engine loop as long. Each reset's removal has a thread of its own now."""
    cluster = make_cluster(1, "16MiB")
    sched = connector(vllm_config(cluster.master_endpoint, lookup_timeout_ms=200), KVConnectorRole.SCHEDULER)
    store = sched._store
    real_remove = store.remove_by_regex
    first_stuck = threading.Event()
    removals = []

    def remove_first_stuck(*args, **kwargs):
        removals.append(args)
        if len(removals) == 1:
            first_stuck.wait(60)  # a connection that never answers, until the test ends it
        return real_remove(*args, **kwargs)

    store.remove_by_regex = remove_first_stuck
    answers: list[bool] = []
    try:
        cluster.master.signal(signal.SIGSTOP)
        try:
            assert sched.reset_cache() is False  # its probe went unanswered
        finally:
            cluster.master.signal(signal.SIGCONT)
        second = threading.Thread(target=lambda: answers.append(sched.reset_cache()), daemon=True)
        second.start()
        second.join(timeout=10)
        assert answers == [True], "the second reset waits behind the first's removal"
    finally:
        first_stuck.set()
        sched.shutdown()


def calls_of(store: Store, *names: str) -> list[str]:
    """The names of the calls of `store`'s methods `names` from now on, in order."""
    calls: list[str] = []

    def recorded(name: str, method):
        def call(*args, **kwargs):
            calls.append(name)
            return method(*args, **kwargs)

        return call

    for name in names:
        setattr(store, name, recorded(name, getattr(store, name)))
    return calls


def test_a_master_that_stops_answering_costs_the_scheduler_one_short_wait_not_one_per_lookup(make_cluster):
    """A master alive but not answering (SIGSTOP here: a GC pause, a partition) cost every
    scheduler lookup the RPC timeout (5-6 s), for each waiting request at every step of
    vLLM's engine loop. Now a lookup waits lookup_timeout_ms, and the breaker then answers
    lookups and hit-source queries without asking the master (none reaches the Store) until
    its window ends; a probe then, still unanswered, waits that short time once more. Once
    the master answers, a probe closes the breaker and blocks are found again."""
    cluster = make_cluster(1, "16MiB")
    config = vllm_config(cluster.master_endpoint, lookup_timeout_ms=200, lookup_backoff_ms_min=500,
                         lookup_backoff_ms_max=1000)  # fmt: skip
    sched, worker = connector(config, KVConnectorRole.SCHEDULER), connector(config, KVConnectorRole.WORKER)
    worker.register_kv_caches(paged_cache(seed=3))
    asked = calls_of(sched._store, "longest_prefix", "query")

    def timed_lookup(req_id: str) -> tuple[tuple[int, bool], float]:
        started = time.monotonic()
        found = sched.get_num_new_matched_tokens(request(req_id, PROMPT), 0)
        return found, time.monotonic() - started

    try:
        run_worker_step(worker, first_prefill(sched, "r-1", [0, 1, 2, 3]))
        wait_until(lambda: timed_lookup("r-2")[0] == (12, False), timeout_s=10)
        cluster.master.signal(signal.SIGSTOP)
        try:
            found, took_s = timed_lookup("w-0")
            assert found == (0, False) and took_s < 2, took_s  # the lookup's own bound, 0.2 s (was 5 s)
            asked.clear()
            for index in range(1, 6):  # the breaker is open: misses, and no call at all
                assert timed_lookup(f"w-{index}")[0] == (0, False)
            assert sched.get_external_cache_hit_sources(request("w-1", PROMPT), 12) == {
                CacheHitSource.EXTERNAL_UNSPECIFIED: 12
            }
            assert asked == []
            time.sleep(0.6)  # past the window: one probe, unanswered, and the window doubles
            found, took_s = timed_lookup("w-6")
            assert found == (0, False) and took_s < 2 and asked == ["longest_prefix"], (took_s, asked)
            assert timed_lookup("w-7")[0] == (0, False) and asked == ["longest_prefix"]
        finally:
            cluster.master.signal(signal.SIGCONT)
        # The master answers again: the next probe (within the 1 s window) closes the breaker.
        wait_until(lambda: timed_lookup("r-3")[0] == (12, False), timeout_s=10)
        req = request("r-4", PROMPT + [1, 2, 3, 4])
        assert sched.get_num_new_matched_tokens(req, 0) == (12, False)
        assert sched.get_external_cache_hit_sources(req, 12) == {CacheHitSource.HOST: 12}
    finally:
        worker.shutdown()
        sched.shutdown()


def test_an_mla_block_is_held_until_every_tp_rank_has_loaded_it(shared_cluster):
    """The TP ranks of an MLA model share each block's object and each loads it. The lookup's
    hold waited for one read: the first rank's release ended it, and an eviction before a
    later rank's read failed that rank's load. Now it lasts until every rank has read it."""
    cluster = shared_cluster(1)
    config = vllm_config(cluster.master_endpoint)
    config.parallel_config.tensor_parallel_size = 2
    config.model_config = _Model(use_mla=True, kv_heads=1)
    shape = (NUM_BLOCKS, BLOCK_SIZE, 3 * HEAD_SIZE)
    sched = connector(config, KVConnectorRole.SCHEDULER)
    workers = [connector(config, KVConnectorRole.WORKER) for _ in range(2)]
    for rank, worker in enumerate(workers):
        worker.tp_rank = rank  # what _parallel_ranks() gives TP rank `rank`
        worker.register_kv_caches(paged_cache(7, shape))
    try:
        meta = first_prefill(sched, "r-1", [0, 1, 2, 3])
        for worker in workers:
            assert run_worker_step(worker, meta) == set()
        meta = second_turn(sched)
        planned = [workers[0]._key(h) for h in meta.loads[0].block_hashes]
        held = [ErrorCode.OBJECT_HAS_LEASE] * len(planned)
        assert run_worker_step(workers[0], meta) == set()
        # A remove gives the store's own leases back first: rank 0's read is over.
        assert workers[0]._store.batch_remove(planned) == held  # rank 1 has yet to read
        assert run_worker_step(workers[1], meta) == set()
        assert workers[1]._store.batch_remove(planned) == [ErrorCode.OK] * len(planned)
    finally:
        for side in [*workers, sched]:
            side.shutdown()


def test_the_pools_lookups_loads_and_saves_reach_vllms_log_and_prometheus(make_cluster):
    """vLLM asks each side of the connector for its stats after every step, sums the
    workers', logs a summary every interval and exports them to Prometheus, as for its own
    Mooncake store connector (same metric names, kvpool for mooncake_store). What each
    operation moved is counted: keys, bytes, failed keys, and errors when the pool is gone."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    cluster = make_cluster(1, "16MiB")
    config = vllm_config(cluster.master_endpoint)
    sched, worker = connector(config, KVConnectorRole.SCHEDULER), connector(config, KVConnectorRole.WORKER)
    worker.register_kv_caches(paged_cache(seed=4))
    block_bytes = sum(size for _, _, size in worker._layer_ranges)
    try:
        assert worker.get_kv_connector_stats() is None  # nothing yet
        run_worker_step(worker, first_prefill(sched, "r-1", [0, 1, 2, 3]))  # saves its 3 blocks
        meta = second_turn(sched)  # finds them; loads them into 6-8, saves block 9
        assert run_worker_step(worker, meta) == set()
        again = request("r-3", PROMPT + [9, 9, 9, 9])
        assert sched.get_num_new_matched_tokens(again, 0) == (12, False)
        sched.update_state_after_alloc(again, blocks([10, 11, 12, 13, 14]), 12)
        meta = sched.build_connector_meta(step([new_request_data(again, [10, 11, 12, 13, 14], 12)], {"r-3": 6}))
        worker._store.remove(worker._key(meta.loads[0].block_hashes[1]), force=True)
        assert run_worker_step(worker, meta) == {11}  # one block of three lost: no save in that step
        cluster.master.kill()
        assert sched.get_num_new_matched_tokens(request("r-4", PROMPT), 0) == (0, False)

        stats = worker.get_kv_connector_stats()
        assert worker.get_kv_connector_stats() is None  # taken: a new interval
        records = stats.data
        assert [(r[1], r[2], r[3], r[4]) for r in records["save"]] == [
            (3, 3 * block_bytes, 0, 0), (1, block_bytes, 0, 0),
        ]  # fmt: skip
        assert [(r[1], r[2], r[3], r[4]) for r in records["load"]] == [
            (3, 3 * block_bytes, 0, 0), (3, 2 * block_bytes, 1, 0),
        ]  # fmt: skip
        lookups = sched.get_kv_connector_stats().data["lookup"]
        assert [(r[1], r[3], r[4]) for r in lookups] == [(3, 0, 0), (4, 0, 0), (4, 0, 0), (3, 3, 1)]
        assert all(0 < r[0] < 10 for op in (records["save"], records["load"], lookups) for r in op)

        # As vLLM carries them: the workers' and the scheduler's summed, to the logger's process.
        shipped = KVPoolConnector.build_kv_connector_stats(msgspec.msgpack.decode(msgspec.msgpack.encode(
            stats.aggregate(KVPoolConnector.build_kv_connector_stats({"lookup": lookups})).to_dict()
        )))  # fmt: skip
        summary = shipped.reduce()
        assert (summary["load_keys"], summary["load_failed_keys"], summary["load_bytes"]) == (6, 1, 5 * block_bytes)
        assert (summary["lookup_count"], summary["lookup_errors"], summary["save_errors"]) == (4, 1, 0)
        logged: list[str] = []
        vllm_logging = KVConnectorLogging(config.kv_transfer_config)
        vllm_logging.observe(shipped.to_dict())
        vllm_logging.log(lambda fmt, *args: logged.append(fmt % args))
        assert len(logged) == 1 and "load_failed_keys=1" in logged[0] and "save_keys=4" in logged[0]

        registry = CollectorRegistry()
        types = {kind: functools.partial(kind, registry=registry) for kind in (Gauge, Counter, Histogram)}
        prom = KVPoolConnector.build_prom_metrics(config, types, ["model_name", "engine"], {0: ["tiny", "0"]})
        prom.observe(shipped.to_dict(), 0)

        def sample(name: str, operation: str, status: str = "ok") -> float | None:
            labels = {"model_name": "tiny", "engine": "0", "operation": operation, "status": status}
            return registry.get_sample_value(f"vllm:kvpool_operation_{name}", labels)

        assert sample("keys_total", "load") == 6 and sample("failed_keys_total", "load") == 1
        assert sample("bytes_total", "save") == 4 * block_bytes and sample("total", "save") == 2
        assert sample("total", "lookup", "error") == 1 and sample("failed_keys_total", "lookup", "error") == 3
        assert sample("time_seconds_count", "lookup") == 3
    finally:
        worker.shutdown()
        sched.shutdown()


def test_connector_stats_reduce_to_a_summary_and_stay_bounded():
    """The logged summary: per operation its count, mean and 90th-percentile time (nearest
    rank), keys, failed keys, errors, and for loads and saves bytes and GB/s over their time.
    Stats nothing takes stop growing at a bound."""
    stats = KVPoolConnector.build_kv_connector_stats()
    for ms in range(1, 11):
        stats.record("load", ms / 1000, 2, 1_000_000, 1 if ms == 10 else 0, raised=False)
    stats.record("lookup", 0.002, 5, 0, 5, raised=True)
    summary = stats.reduce()
    assert (summary["load_count"], summary["load_avg_ms"], summary["load_p90_ms"]) == (10, 5.5, 9.0)
    assert (summary["load_keys"], summary["load_failed_keys"], summary["load_errors"]) == (20, 1, 0)
    assert (summary["load_bytes"], summary["load_gb_per_s"]) == (10_000_000, 0.182)  # 10 MB in 55 ms
    assert (summary["lookup_errors"], summary["lookup_failed_keys"]) == (1, 5) and "lookup_bytes" not in summary
    for _ in range(limits.ENGINE_STATS_RECORDS_MAX + 5):
        stats.record("save", 0.001, 1, 0, 0, raised=False)
    assert len(stats.data["save"]) == limits.ENGINE_STATS_RECORDS_MAX


def test_failed_loads_are_reported_for_recompute(make_cluster):
    cluster = make_cluster(1, "16MiB")
    config = vllm_config(cluster.master_endpoint)
    sched, worker = connector(config, KVConnectorRole.SCHEDULER), connector(config, KVConnectorRole.WORKER)
    worker.register_kv_caches(paged_cache(seed=2))
    try:
        run_worker_step(worker, first_prefill(sched, "r-1", [0, 1, 2, 3]))

        meta = second_turn(sched)
        middle = worker._key(meta.loads[0].block_hashes[1])
        worker._store.remove(middle, force=True)  # evicted between lookup and load
        computed_over_it = [worker._key(h) for save in meta.saves for h in save.block_hashes]
        assert computed_over_it  # the step's fourth block, computed after the three loaded
        assert run_worker_step(worker, meta) == {7}
        # vLLM recomputes from block 7; the pool must not keep what was computed over it.
        assert worker._store.batch_exists(computed_over_it) == [False] * len(computed_over_it)
        assert worker.get_block_ids_with_load_errors() == set()  # reported once

        cluster.master.kill()
        later = request("r-3", PROMPT)
        assert sched.get_num_new_matched_tokens(later, 0) == (0, False)
        assert run_worker_step(worker, meta) == {6, 7, 8}
    finally:
        worker.shutdown()
        sched.shutdown()


def test_blocks_of_another_kv_dtype_are_not_found(shared_cluster):
    """bf16 and fp16 blocks have one size: by key alone, an fp16 instance loaded a bf16
    instance's blocks as garbage, with no error. The KV dtype (and the TP and PP sizes) are
    part of the key."""
    cluster = shared_cluster(1)
    config_a = vllm_config(cluster.master_endpoint)
    config_b = vllm_config(cluster.master_endpoint)
    config_b.cache_config.cache_dtype = "fp8_e5m2"
    sched_a, worker_a = connector(config_a, KVConnectorRole.SCHEDULER), connector(config_a, KVConnectorRole.WORKER)
    sched_b = connector(config_b, KVConnectorRole.SCHEDULER)
    worker_a.register_kv_caches(paged_cache(seed=3))
    try:
        run_worker_step(worker_a, first_prefill(sched_a, "a-1", [0, 1, 2, 3]))
        assert sched_a.get_num_new_matched_tokens(request("a-2", PROMPT), 0) == (12, False)
        assert sched_b.get_num_new_matched_tokens(request("b-1", PROMPT), 0) == (0, False)
    finally:
        worker_a.shutdown()
        for sched in (sched_a, sched_b):
            sched.shutdown()


def test_with_async_scheduling_the_step_after_a_failed_load_saves_nothing_either(shared_cluster):
    """vLLM schedules the next step before it learns of a failed load: that step's forward
    pass may compute over the failed block too (its request's next chunk, another request
    its prefix cache let share it), so its saves are skipped as well; the step after saves."""
    cluster = shared_cluster(1)
    config = vllm_config(cluster.master_endpoint)
    config.scheduler_config.async_scheduling = True
    assert config.max_concurrent_batches == 2
    sched, worker = connector(config, KVConnectorRole.SCHEDULER), connector(config, KVConnectorRole.WORKER)
    worker.register_kv_caches(paged_cache(seed=6))
    try:
        run_worker_step(worker, first_prefill(sched, "r-1", [0, 1, 2, 3]))
        meta = second_turn(sched)
        worker._store.remove(worker._key(meta.loads[0].block_hashes[0]), force=True)
        assert run_worker_step(worker, meta) == {6}

        def saved_by_a_new_prefill(req_id: str, tokens: list[int]) -> bool:
            req = request(req_id, tokens)
            sched.get_num_new_matched_tokens(req, 0)
            sched.update_state_after_alloc(req, blocks([11, 12]), 0)
            plan = sched.build_connector_meta(step([new_request_data(req, [11, 12], 0)], {req_id: len(tokens)}))
            run_worker_step(worker, plan)
            keys = [worker._key(h) for save in plan.saves for h in save.block_hashes]
            return all(worker._store.batch_exists(keys))

        assert not saved_by_a_new_prefill("r-3", list(range(300, 305)))  # in flight with the failure
        assert saved_by_a_new_prefill("r-4", list(range(400, 405)))
    finally:
        worker.shutdown()
        sched.shutdown()


def test_keys_are_the_schedulers_whatever_the_workers_config_became(shared_cluster):
    """Loading some attention layers rewrites cache_dtype in the worker's config (sparse MLA
    with fp8: fp8_ds_mla), after the scheduler built its keys from the same setting: the
    workers saved under keys the scheduler's lookups never found."""
    cluster = shared_cluster(1)
    config = vllm_config(cluster.master_endpoint)
    config.cache_config.cache_dtype = "fp8"
    worker_config = vllm_config(cluster.master_endpoint)
    worker_config.cache_config.cache_dtype = "fp8_ds_mla"
    sched, worker = connector(config, KVConnectorRole.SCHEDULER), connector(worker_config, KVConnectorRole.WORKER)
    worker.register_kv_caches(paged_cache(seed=7))
    try:
        run_worker_step(worker, first_prefill(sched, "a-1", [0, 1, 2, 3]))
        assert sched.get_num_new_matched_tokens(request("a-2", PROMPT), 0) == (12, False)
    finally:
        worker.shutdown()
        sched.shutdown()


def test_a_block_is_found_only_when_every_pipeline_stage_holds_it(shared_cluster):
    """With pipeline parallelism each stage saves its layers of a block under its own key. The
    scheduler (whose own PP rank is 0) counted a block found when stage 0 held it: a stage
    that missed it failed its load, and vLLM recomputed what the lookup promised."""
    cluster = shared_cluster(1)
    config = vllm_config(cluster.master_endpoint)
    config.parallel_config.pipeline_parallel_size = 2
    sched = connector(config, KVConnectorRole.SCHEDULER)
    stages = [connector(config, KVConnectorRole.WORKER) for _ in range(2)]
    stages[1].pp_rank = 1  # vLLM's PP group is not set up in this process
    for stage in stages:
        stage.register_kv_caches(paged_cache(seed=5))
    try:
        meta = first_prefill(sched, "a-1", [0, 1, 2, 3])
        run_worker_step(stages[0], meta)
        assert sched.get_num_new_matched_tokens(request("a-2", PROMPT), 0) == (0, False)
        run_worker_step(stages[1], meta)
        assert sched.get_num_new_matched_tokens(request("a-3", PROMPT), 0) == (12, False)
    finally:
        for role in (*stages, sched):
            role.shutdown()


def test_deployments_whose_pipeline_stages_split_the_layers_otherwise_share_no_block(make_cluster, monkeypatch):
    """A stage's key named its PP rank only: stage 1 of a 32-layer model split 16/16 and the
    same stage split 20/12 ($VLLM_PP_LAYER_PARTITION) read each other's blocks, layers 16-31
    as layers 20-31. The stages' layer counts are part of the key."""

    class Model:  # what the connector reads of vLLM's ModelConfig (a real one needs the HF config)
        model, dtype = "org/deep", "torch.bfloat16"

        def get_total_num_hidden_layers(self) -> int:
            return 32

    cluster = make_cluster(1, "16MiB")

    def pipeline_of_two(partition: str | None):
        if partition is None:
            monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
        else:
            monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", partition)
        config = vllm_config(cluster.master_endpoint)
        config.parallel_config.pipeline_parallel_size = 2
        config.model_config = Model()
        sched = connector(config, KVConnectorRole.SCHEDULER)
        stages = [connector(config, KVConnectorRole.WORKER) for _ in range(2)]
        stages[1].pp_rank = 1  # vLLM's PP group is not set up in this process
        for stage in stages:
            stage.register_kv_caches(paged_cache(seed=8))
        return sched, stages

    even_sched, even_stages = pipeline_of_two(None)
    uneven_sched, uneven_stages = pipeline_of_two("20,12")
    try:
        assert "@pp_size:2@pp_layers:16.16@" in even_stages[1]._key("h")
        assert "@pp_size:2@pp_layers:20.12@" in uneven_stages[1]._key("h")
        meta = first_prefill(even_sched, "a-1", [0, 1, 2, 3])
        for stage in even_stages:
            run_worker_step(stage, meta)
        assert even_sched.get_num_new_matched_tokens(request("a-2", PROMPT), 0) == (12, False)
        assert uneven_sched.get_num_new_matched_tokens(request("b-1", PROMPT), 0) == (0, False)
    finally:
        for role in (*even_stages, even_sched, *uneven_stages, uneven_sched):
            role.shutdown()


def test_failed_blocks_and_the_blocks_after_them_leave_vllms_prefix_cache(shared_cluster):
    """Under kv_load_failure_policy "recompute" vLLM keeps a failed block cached for its request
    to recompute in place; a request preempted first freed it with its hash, and the next
    request with that prefix read its garbage as a prefix-cache hit (and the connector saved
    what it computed over it into the pool). Seen driving vLLM's real scheduler with load
    failures injected. The scheduler-side connector evicts, from vLLM's prefix cache, each
    failed block and every block after it in the requests that hold it."""

    class PrefixCache:  # what the connector uses of vLLM's KVCacheManager
        block_pool = None

        def __init__(self, tables):
            self.tables, self.evicted = tables, set()

        def get_block_ids(self, req_id):
            return (self.tables.get(req_id, []),)

        def evict_blocks(self, block_ids):
            self.evicted |= set(block_ids)

    cluster = shared_cluster(1)
    sched = connector(vllm_config(cluster.master_endpoint), KVConnectorRole.SCHEDULER)
    try:
        for req_id in ("loader", "sharer", "bystander"):
            sched.get_num_new_matched_tokens(request(req_id, PROMPT), 0)
        cache = PrefixCache({"loader": [4, 5, 6, 7], "sharer": [4, 5, 9], "bystander": [1, 2]})
        sched.bind_kv_cache_manager(cache)  # as vLLM's scheduler does once it has made its manager
        sched.update_connector_output(KVConnectorOutput(invalid_block_ids={5}))
        assert cache.evicted == {5, 6, 7, 9}
        sched.update_connector_output(KVConnectorOutput())
        assert cache.evicted == {5, 6, 7, 9}
    finally:
        sched.shutdown()


@pytest.mark.parametrize(
    "change, refusal",
    [
        (lambda config, kv: setattr(config.parallel_config, "decode_context_parallel_size", 2), "decode_context"),
        (lambda config, kv: setattr(config.parallel_config, "prefill_context_parallel_size", 2), "prefill_context"),
        (lambda config, kv: setattr(kv, "hash_block_size", BLOCK_SIZE // 2), "hash_block_size 2 != block_size 4"),
        (lambda config, kv: kv.kv_cache_groups.extend([object(), object()]), "one KV cache group, not 2"),
    ],
    ids=["dcp", "pcp", "finer-hashes", "two-groups"],
)
def test_configurations_that_would_load_wrong_kv_are_refused_at_start(change, refusal):
    """Each names blocks or lays them out otherwise than the connector's key for block i;
    the connector must fail vLLM's start, not serve another prompt's KV."""
    config = vllm_config("127.0.0.1:1")  # refused before any connection
    kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[])
    change(config, kv_cache_config)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(InvalidParams, match=refusal):
            KVConnectorFactory.create_connector(config, role, kv_cache_config)


@pytest.mark.parametrize(
    "extra, refusal",
    [({"replica_num": 0}, "replica_num in kv_connector_extra_config"), ({"lookup_hold_ms": "5s"}, "lookup_hold_ms")],
)
def test_a_bad_extra_config_value_is_refused_at_start(extra, refusal):
    """Not at the first save (or by the master, as a failed put logged on every step)."""
    config = vllm_config("127.0.0.1:1", **extra)  # refused before any connection
    kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[])
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(InvalidParams, match=refusal):
            KVConnectorFactory.create_connector(config, role, kv_cache_config)
