"""End-to-end wrong-KV checker for kvpool's vLLM connector, driven by vLLM's REAL v1 Scheduler.

Two vLLM "instances" (a real vllm.v1.core.sched.scheduler.Scheduler / AsyncScheduler each, which
creates its own scheduler-role KVPoolConnector through KVConnectorFactory, plus a worker-role
KVPoolConnector and a paged CPU cache each) share one kvpool LocalCluster. A fake model runner
plays each SchedulerOutput the way vLLM's GPU model runner + KVConnectorModelRunnerMixin do:

  bind_connector_metadata -> start_load_kv (before the forward only when
  scheduler_output.has_sync_kv_loads, else after it, exactly like the mixin) -> forward:
  write the KV of every scheduled token into its slot (reshape_and_cache), then "attention":
  read every position < num_computed_tokens + scheduled and CHECK it equals the deterministic
  KV of the request's token prefix -> wait_for_save -> get_block_ids_with_load_errors ->
  clear_connector_metadata -> ModelRunnerOutput -> scheduler.update_from_output.

vLLM's scheduler binds its block pool to the connector, so saves run on the worker's saver
thread, and a step that hands their blocks out again ends them first (bind_connector_metadata:
flush_jobs). Each step's saves run on during the next step's forward
pass (which writes the cache beside them) and end before that step's own saves start; the
step reports them to the scheduler then (build_connector_worker_meta), so that which saves a
step reports depends on the seed alone.

KV of token position p = f(tokens[0..p]) (a rolling 64-bit hash spread over head_dim floats,
distinct per layer and K/V). A forward that read wrong KV writes poisoned KV (-(x)-1) for its
tokens and samples POISON_TOKEN, so contamination propagates and becomes visible.

Checks:
  * READ: every position the forward attends to holds exactly f(prefix). A mismatch is excused
    only if it stems (directly or via poisoned KV) from a load failure the worker reported in a
    step whose output the scheduler had not processed when the reading step was scheduled
    (i.e. vLLM could not know yet and will discard that output). Anything else = WRONG KV.
  * SAVE: every block actually put into the pool (batch_put_from_multi_buffers intercepted on the
    worker's Store) must hold f(prefix) for the block hash's tokens = pool poisoning.
  * OUTPUT: every output token of a finished request = g(its prefix) (no poisoned token accepted).

Usage: python sim.py [--seed N] [--async] [--faults P] [--block-size 4] [--blocks 48] ...
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import json
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

import torch  # noqa: E402
import vllm_on_cpu  # noqa: E402, F401  (before vLLM)
from vllm import SamplingParams  # noqa: E402
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvpool.cli.launcher import LocalCluster  # noqa: E402
from kvpool.integrations.engine_options import SAVED_CODES  # noqa: E402

# A tiny Llama's config: vLLM reads the architecture and sizes from it; no weights are loaded
# (vLLM's model registry imports the model's module, which needs einops).
TINY_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "torch_dtype": "float32", "head_dim": 16, "bos_token_id": 1,
    "eos_token_id": 2, "tie_word_embeddings": False,
}  # fmt: skip
LAYERS = 2
HEADS = 2
HEAD_DIM = 4
VOCAB = 1000
POISON_TOKEN = 999
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
MASK64 = (1 << 64) - 1


# ------------------------------------------------------------------------------ oracle

def _mix(h: int, t: int) -> int:
    h = (h ^ (t + 0x9E3779B97F4A7C15)) & MASK64
    h = (h * 0xBF58476D1CE4E5B9) & MASK64
    h ^= h >> 31
    h = (h * 0x94D049BB133111EB) & MASK64
    return h ^ (h >> 29)


def prefix_hashes(tokens: list[int]) -> list[int]:
    out, h = [], 0x1234567
    for t in tokens:
        h = _mix(h, t)
        out.append(h)
    return out


def kv_values(h: int) -> torch.Tensor:
    """(LAYERS, 2, HEADS*HEAD_DIM) exact float32 values (16-bit ints) for prefix hash h."""
    vals = []
    for layer in range(LAYERS):
        for kv in range(2):
            row = []
            x = _mix(h, 1000 + layer * 2 + kv)
            for j in range(HEADS * HEAD_DIM):
                x = _mix(x, j)
                row.append(float(x & 0xFFFF))
            vals.append(row)
    return torch.tensor(vals, dtype=torch.float32).view(LAYERS, 2, HEADS * HEAD_DIM)


_kv_cache: dict[int, torch.Tensor] = {}


def kv_of(h: int) -> torch.Tensor:
    v = _kv_cache.get(h)
    if v is None:
        v = _kv_cache[h] = kv_values(h)
    return v


def next_token(h: int) -> int:
    return 3 + (_mix(h, 777) % 900)


# ------------------------------------------------------------------------------ setup

def make_vllm_config(args, master: str) -> VllmConfig:
    model = ModelConfig(model=args.model_dir, skip_tokenizer_init=True, dtype="float32",
                        max_model_len=args.max_model_len)
    sched = SchedulerConfig(max_num_batched_tokens=args.batched_tokens, max_num_seqs=args.max_seqs,
                            max_model_len=args.max_model_len, enable_chunked_prefill=True,
                            is_encoder_decoder=False, async_scheduling=args.async_sched,
                            max_num_inflight_kv_loads=args.inflight_loads)
    config = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=args.block_size, enable_prefix_caching=True),
        scheduler_config=sched,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVPoolConnector", kv_connector_module_path="kvpool.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config={"master": master, "load_async": args.load_async},
            kv_load_failure_policy=args.policy),
    )
    config.scheduler_config.disable_hybrid_kv_cache_manager = True
    config.scheduler_config.async_scheduling = args.async_sched
    config.cache_config.num_gpu_blocks = args.blocks
    return config


def make_kv_cache_config(args) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=args.block_size, num_kv_heads=HEADS, head_size=HEAD_DIM,
                             dtype=torch.float32)
    return KVCacheConfig(num_blocks=args.blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(layer_names=list(LAYER_NAMES), kv_cache_spec=spec)])


@dataclasses.dataclass
class Stats:
    steps: int = 0
    scheduled_tokens: int = 0
    loads_planned_blocks: int = 0
    loads_ok_blocks: int = 0
    load_failed_blocks: int = 0
    load_calls: int = 0
    saves_blocks: int = 0
    saves_ok: int = 0
    saves_skipped_steps: int = 0
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    external_hit_tokens: int = 0
    injected_removals: int = 0
    tainted_forwards: int = 0
    excused_reads: int = 0
    downstream_reads: int = 0
    start_load_after_forward_with_loads: int = 0
    async_loads_beside_a_full_batch: int = 0  # started while every running slot was taken
    finished: int = 0
    requests: int = 0
    convs_ended_at_capacity: int = 0
    finish_reasons: dict = dataclasses.field(default_factory=dict)


class Instance:
    def __init__(self, name: str, args, master: str, stats: Stats, report):
        self.name, self.args, self.stats, self.report = name, args, stats, report
        self.config = make_vllm_config(args, master)
        self.kv_cache_config = make_kv_cache_config(args)
        cls = AsyncScheduler if args.async_sched else Scheduler
        self.scheduler = cls(vllm_config=self.config, kv_cache_config=self.kv_cache_config,
                             structured_output_manager=StructuredOutputManager(self.config),
                             block_size=args.block_size, log_stats=True)
        self.worker = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER,
                                                          self.kv_cache_config)
        shape = (2, args.blocks, args.block_size, HEADS, HEAD_DIM)
        # Random initial content: stale garbage must never be read as computed KV.
        g = torch.Generator().manual_seed(args.seed * 7 + len(name))
        self.cache = {n: (torch.rand(shape, generator=g) * -1e6) for n in LAYER_NAMES}
        self.worker.register_kv_caches(self.cache)
        self.bs = args.block_size
        # Runner state (like the GPU runner's InputBatch): block tables from scheduler outputs.
        self.block_table: dict[str, list[int]] = {}
        self.pending: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)  # (step, tok)
        # slot -> origin step of wrong content (load failure / poison), or "W" for unexcused.
        self.origin: dict[tuple[int, int], object] = {}
        self.step_no = 0
        self.slots_taken_before_schedule = 0  # running requests as the step was scheduled
        self.processed_upto = 0  # steps whose update_from_output has run: all < this
        self.batch_queue: collections.deque = collections.deque()
        self.cur_meta = None
        self.saves_planned: dict[str, tuple[str, int]] = {}  # block hash -> (request, vLLM block)
        self.cur_step = 0
        self.ctx: dict = {}
        self.ctx_sched_processed: dict[int, int] = {}
        self.desynced: set[str] = set()
        self.reqs: dict[str, Request] = {}
        self._instrument_store()

    # -- instrumentation of the worker's Store (observation only) --------------------------
    def _instrument_store(self):
        store = self.worker._store
        orig_put, orig_get = store.batch_put_from_multi_buffers, store.batch_get_into_multi_buffers
        inst = self

        def put(keys, addresses, sizes, *a, **k):
            # A pool slower than a step (--put-delay-ms): the saves of a step then read their
            # blocks during the next steps' binds, loads and forward passes.
            time.sleep(inst.args.put_delay_ms / 1000)
            inst._check_save(keys, addresses)
            codes = orig_put(keys, addresses, sizes, *a, **k)
            inst.stats.saves_blocks += len(keys)
            inst.stats.saves_ok += sum(1 for c in codes if c in SAVED_CODES)
            return codes

        def get(keys, addresses, sizes, *a, **k):
            inst.stats.load_calls += 1
            read = orig_get(keys, addresses, sizes, *a, **k)
            for r, s in zip(read, sizes):
                if r == sum(s):
                    inst.stats.loads_ok_blocks += 1
            return read

        store.batch_put_from_multi_buffers = put
        store.batch_get_into_multi_buffers = get

    def _addr_to_block(self, addr: int) -> int:
        base, stride, _ = self.worker._layer_ranges[0]
        return (addr - base) // stride

    def _check_save(self, keys, addresses):
        by_hash = self.saves_planned  # a save may run during the step after its own
        for key, addrs in zip(keys, addresses):
            h = key.rsplit("@", 1)[1]
            req_id, b = by_hash[h]
            blk = self._addr_to_block(addrs[0])
            assert blk == b, (blk, b)
            req = self.reqs.get(req_id)
            tokens = self.ctx.get(req_id, {}).get("tokens") or (list(req.all_token_ids) if req else None)
            if req is None or tokens is None:
                self.report("SAVE-UNKNOWN", self, f"save of {req_id} block {b} key {h[:12]}: request unknown")
                continue
            hashes = [x.hex() if isinstance(x, bytes) else str(x) for x in req.block_hashes]
            if h not in hashes:
                self.report("SAVE-HASH", self, f"save {req_id}: hash {h[:12]} not among request's block hashes")
                continue
            i = hashes.index(h)
            ph = prefix_hashes(tokens[: (i + 1) * self.bs])
            bad = [p for p in range(i * self.bs, (i + 1) * self.bs) if not self._slot_ok(b, p % self.bs, ph[p])]
            if bad:
                kind = ("POOL-POISONED(vllm-async-desync)"
                        if all(self.origin.get((b, p % self.bs)) == "D" for p in bad) else "POOL-POISONED")
                self.report(kind, self,
                            f"step {self.cur_step}: {req_id} saves block #{i} (vLLM block {b}) holding wrong KV at "
                            f"positions {bad} (origins {[self.origin.get((b, p % self.bs)) for p in bad]})")

    def _slot_ok(self, b: int, s: int, h: int) -> bool:
        want = kv_of(h)
        for li, n in enumerate(LAYER_NAMES):
            got = self.cache[n][:, b, s].reshape(2, -1)
            if not torch.equal(got, want[li]):
                return False
        return True

    def _write_slot(self, b: int, s: int, h: int, poison: bool):
        want = kv_of(h)
        for li, n in enumerate(LAYER_NAMES):
            v = want[li].view(2, HEADS, HEAD_DIM)
            self.cache[n][:, b, s] = (-v - 1) if poison else v

    # -- workload ---------------------------------------------------------------------------
    def add(self, req: Request):
        self.reqs[req.request_id] = req
        self.scheduler.add_request(req)
        self.stats.requests += 1

    # -- the fake model runner -------------------------------------------------------------
    def execute(self, so, step: int, faults: float, rng: random.Random) -> ModelRunnerOutput:
        bs = self.bs
        meta = so.kv_connector_metadata
        self.cur_meta, self.cur_step = meta, step
        self.stats.steps += 1
        self.stats.scheduled_tokens += so.total_num_scheduled_tokens
        self.stats.loads_planned_blocks += sum(len(x.block_ids) for x in meta.loads)
        if so.preempted_req_ids:
            self.stats.preemptions += len(so.preempted_req_ids)
        # Runner block tables (GPU runner semantics).
        for rid in so.finished_req_ids:
            self.block_table.pop(rid, None)
        for rid in (so.preempted_req_ids or ()):
            self.block_table.pop(rid, None)
        computed: dict[str, int] = {}
        loaded_tokens = collections.Counter()
        for load in meta.loads:
            loaded_tokens[load.request_id] += len(load.block_ids) * self.bs
        self.stats.external_hit_tokens += sum(loaded_tokens.values())
        if self.slots_taken_before_schedule >= self.args.max_seqs:
            self.stats.async_loads_beside_a_full_batch += sum(load.is_async for load in meta.loads)
        for new in so.scheduled_new_reqs:
            self.block_table[new.req_id] = list(new.block_ids[0])
            computed[new.req_id] = new.num_computed_tokens
            self.stats.prefix_hit_tokens += new.num_computed_tokens - loaded_tokens[new.req_id]
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):  # resumed requests come as new ones
            nb = cached.new_block_ids[i]
            if nb is not None:
                self.block_table.setdefault(rid, []).extend(nb[0])
            computed[rid] = cached.num_computed_tokens[i]
        # Cross-check against the scheduler's own block table (sync scheduling only: exact).
        if not self.args.async_sched:
            for rid in so.num_scheduled_tokens:
                real = list(self.scheduler.kv_cache_manager.get_block_ids(rid)[0])
                if real[: len(self.block_table[rid])] != self.block_table[rid][: len(real)]:
                    table = self.block_table[rid]
                    self.report("BLOCKTABLE", self, f"step {step} {rid}: runner {table} vs sched {real}")

        # Fault injection: remove pool objects between lookup (schedule) and load (here).
        if faults and meta.loads:
            for load in meta.loads:
                if rng.random() < faults and load.block_hashes:
                    h = rng.choice(load.block_hashes)
                    key = self.worker._key(h, prefix=meta.key_prefix)
                    try:
                        self.worker._store.remove(key, force=True)
                        self.stats.injected_removals += 1
                    except Exception as exc:  # noqa: BLE001
                        logging.debug("remove failed %s", exc)

        if self.args.trace:
            print(f"  {self.name} step {step}: sched " + ", ".join(
                f"{r}(c={computed[r]},n={n},{_how_scheduled(so, r)},bt={self.block_table[r]})"
                for r, n in so.num_scheduled_tokens.items())
                + f" loads={[(x.request_id, x.block_ids) for x in meta.loads]}"
                + f" saves={[(x.request_id, x.block_ids) for x in meta.saves]}"
                + f" preempted={so.preempted_req_ids or ''} sync_loads={so.has_sync_kv_loads}")
        self.worker.bind_connector_metadata(meta)
        load_first = so.has_sync_kv_loads
        if meta.loads and not load_first:
            self.stats.start_load_after_forward_with_loads += 1
        if load_first:
            self._start_load(step)

        # ---- forward ----
        sampled: dict[str, int | None] = {}
        tok_views: dict[str, list[int]] = {}
        eff_n: dict[str, int] = {}
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            view = list(req.all_token_ids) + [t for (_, t) in self.pending.get(rid, [])]
            c = computed[rid]
            if c + n > len(view):
                if rid not in self.desynced:
                    self.report("VLLM-ASYNC-DESYNC", self, f"step {step} {rid}: scheduler schedules up to position "
                                f"{c + n} but only {len(view)} tokens exist (placeholder of a discarded output)")
                self.desynced.add(rid)
                n = max(0, len(view) - c)
            eff_n[rid] = n
            tok_views[rid] = view
            self.ctx[rid] = {"tokens": view}
        # Iterate: write clean KV, read-check, poison tainted writes, until stable.
        tainted: dict[str, object] = {}
        wrong_reads: dict[str, list] = {}
        for _ in range(4):
            for rid, n in eff_n.items():
                view, c = tok_views[rid], computed[rid]
                ph = prefix_hashes(view[: c + n])
                table = self.block_table[rid]
                for p in range(c, c + n):
                    b, s = table[p // bs], p % bs
                    self._write_slot(b, s, ph[p], poison=rid in tainted)
                    if rid in tainted:
                        self.origin[(b, s)] = tainted[rid]
                    else:
                        self.origin.pop((b, s), None)
            new_taint = False
            for rid, n in so.num_scheduled_tokens.items():
                view, c = tok_views[rid], computed[rid]
                ph = prefix_hashes(view[:c])
                table = self.block_table[rid]
                bad = [(p, table[p // bs]) for p in range(c) if not self._slot_ok(table[p // bs], p % bs, ph[p])]
                wrong_reads[rid] = bad
                if bad and rid not in tainted:
                    origins = [self.origin.get((b, p % bs)) for p, b in bad]
                    num = [o for o in origins if isinstance(o, int)]
                    tainted[rid] = (min(num) if num and len(num) == len(origins)
                                    else "D" if all(isinstance(o, int) or o == "D" for o in origins) else "W")
                    new_taint = True
            if not new_taint:
                break
        # Classify the wrong reads.
        for rid, bad in wrong_reads.items():
            if not bad:
                continue
            self.stats.tainted_forwards += 1
            unexcused, downstream = [], None
            for p, b in bad:
                o = self.origin.get((b, p % bs))
                if isinstance(o, int) and o >= self.ctx_sched_processed.get(step, 0):
                    continue  # a reported load failure vLLM cannot know of yet (this step / in flight)
                if o in ("W", "D"):
                    downstream = downstream or o  # downstream of an already-reported wrong read
                    continue
                unexcused.append((p, b, o))
            mark = None
            if unexcused:
                req = self.scheduler.requests.get(rid)
                desync = rid in self.desynced
                mark = "D" if desync else "W"
                self.report("WRONG-KV(vllm-async-desync)" if desync else "WRONG-KV", self,
                            f"step {step}: {rid} (computed={computed[rid]}, scheduled={so.num_scheduled_tokens[rid]}, "
                            f"prompt={req.num_prompt_tokens if req else '?'}, preemptions="
                            f"{req.num_preemptions if req else '?'}) attends to wrong KV at (pos, block, origin) "
                            f"{unexcused[:6]}{'...' if len(unexcused) > 6 else ''}; loads this step: "
                            f"{[(x.request_id, x.block_ids) for x in meta.loads]}; sync_loads={so.has_sync_kv_loads}")
                for p, b, o in unexcused:
                    self.origin[(b, p % bs)] = mark
            elif downstream:
                mark = downstream
                self.stats.downstream_reads += 1
            else:
                self.stats.excused_reads += 1
            if mark:
                tainted[rid] = mark
                c, n, table = computed[rid], eff_n[rid], self.block_table[rid]
                for p in range(c, c + n):
                    self.origin[(table[p // bs], p % bs)] = mark
        # Sampled tokens.
        for rid, n in eff_n.items():
            view, c = tok_views[rid], computed[rid]
            if c + n >= len(view):
                h = prefix_hashes(view[: c + n])[-1]
                sampled[rid] = POISON_TOKEN if rid in tainted else next_token(h)
            else:
                sampled[rid] = None

        if not load_first:
            self._start_load(step)
        if self.args.selftest and meta.loads and rng.random() < 0.3:
            # SELF-TEST ONLY: silently corrupt a block loaded this step (after the forward: the
            # next reader must flag it).
            b = meta.loads[0].block_ids[0]
            for n in LAYER_NAMES:
                self.cache[n][:, b, 0] += 1.0
        # The saves of the step before ran during this forward: they end now, and this step
        # reports them (exactly those: this step's saves start below).
        if self.worker._saver is not None:  # one thread: this runs after every save queued before
            self.worker._saver.submit(lambda: None).result()
        saved = self.worker.build_connector_worker_meta()
        for save in meta.saves:
            for h, b in zip(save.block_hashes, save.block_ids):
                self.saves_planned[h] = (save.request_id, b)
        self.worker.wait_for_save()
        # As the runner's connector mixin asks: the async loads that ended, then the blocks
        # that failed (an async load's failures come with its end; the sync ones were marked
        # by _start_load before the forward read them).
        results = self.worker.get_transfer_results(so.finished_req_ids)
        invalid = self.worker.get_block_ids_with_load_errors()
        sync_blocks = {b for load in meta.loads if not load.is_async for b in load.block_ids}
        for b in invalid - sync_blocks:
            for s in range(self.bs):
                self.origin[(b, s)] = step  # reported to vLLM this step
        self.worker.clear_connector_metadata()
        self.cur_meta = None
        if invalid:
            self.stats.load_failed_blocks += len(invalid)
        if self.args.trace:
            sampled_now = {r: t for r, t in sampled.items() if t is not None}
            print(f"  {self.name} step {step}: invalid={sorted(invalid)} tainted={tainted} sampled={sampled_now}")
        if self.worker._unsaved_steps or (invalid and meta.saves):
            self.stats.saves_skipped_steps += 1

        req_ids = list(so.num_scheduled_tokens)
        for rid in req_ids:
            if sampled[rid] is not None:
                self.pending[rid].append((step, sampled[rid]))
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=[[sampled[r]] if sampled[r] is not None else [] for r in req_ids],
            kv_connector_output=KVConnectorOutput(
                kv_connector_worker_meta=saved,
                finished_recving=results.finished_recving or None, failed_recving=results.failed_recving or None,
                invalid_block_ids=invalid,
            ),
        )

    def _start_load(self, step: int):
        before = set(self.worker._load_errors)
        self.worker.start_load_kv(None)
        # Async loads end within their step, so that a run depends on its seed alone (when
        # they end decides when vLLM admits the request: a run that lets them race is
        # another schedule each time).
        concurrent.futures.wait([future for _, future in self.worker._loading.values()])
        failed = set(self.worker._load_errors) - before
        for b in failed:
            for s in range(self.bs):
                self.origin[(b, s)] = step  # reported to vLLM this step
        # Loaded blocks that succeeded: their content is whatever the pool held.
        ok = {b for load in self.cur_meta.loads for b in load.block_ids} - failed
        for b in ok:
            for s in range(self.bs):
                self.origin.pop((b, s), None)

    # -- engine core step (EngineCore.step / step_with_batch_queue) ------------------------
    def engine_step(self, faults: float, rng: random.Random) -> list:
        finished = []
        if not self.args.async_sched:
            if not self.scheduler.has_requests():
                return finished
            self.slots_taken_before_schedule = len(self.scheduler.running)
            so = self.scheduler.schedule()
            self.step_no += 1
            self.ctx_sched_processed[self.step_no] = self.step_no  # only this step unprocessed
            out = self.execute(so, self.step_no, faults, rng)
            finished += self._update(so, out, self.step_no)
            return finished
        # step_with_batch_queue, batch_queue_size = 2
        scheduled = False
        if self.scheduler.has_requests():
            self.slots_taken_before_schedule = len(self.scheduler.running)
            so = self.scheduler.schedule()
            self.step_no += 1
            self.ctx_sched_processed[self.step_no] = self.processed_upto + 1
            out = self.execute(so, self.step_no, faults, rng)
            self.batch_queue.appendleft((so, out, self.step_no))
            executed = so.total_num_scheduled_tokens > 0
            if len(self.batch_queue) < 2 and (executed or self.scheduler.has_requests()):
                return finished
            scheduled = True
        if not self.batch_queue:
            return finished
        so, out, st = self.batch_queue.pop()
        finished += self._update(so, out, st)
        del scheduled
        return finished

    def _update(self, so, out, st) -> list:
        before = {r: len(q.all_token_ids) for r, q in self.scheduler.requests.items()}
        eco = self.scheduler.update_from_output(so, out)
        self.processed_upto = st
        for r, q in self.scheduler.requests.items():
            if r in before and POISON_TOKEN in list(q.all_token_ids)[max(before[r], q.num_prompt_tokens):]:
                if r not in self.desynced:
                    self.report("VLLM-ACCEPTED-TAINTED-OUTPUT", self, f"update({st}): {r} accepted a token sampled "
                                f"from a forward (step {st}) that read wrong KV")
                self.desynced.add(r)
        if self.args.trace:
            print(f"  {self.name} update({st}): " + ", ".join(
                f"{r}(c={q.num_computed_tokens},toks={len(q.all_token_ids)},ph={q.num_output_placeholders},{q.status.name})"
                for r, q in self.scheduler.requests.items()))
        for rid in list(self.pending):
            self.pending[rid] = [(s, t) for (s, t) in self.pending[rid] if s > st]
            if not self.pending[rid]:
                del self.pending[rid]
        done = []
        for outs in eco.values():
            for o in outs.outputs:
                if o.finish_reason is not None:
                    done.append(o.request_id)
                    reason = str(o.finish_reason)
                    self.stats.finish_reasons[reason] = self.stats.finish_reasons.get(reason, 0) + 1
        return done

    def flush(self):
        while self.batch_queue:
            so, out, st = self.batch_queue.pop()
            self._update(so, out, st)


# ------------------------------------------------------------------------------ driver

def _how_scheduled(so, req_id: str) -> str:
    return "new" if any(x.req_id == req_id for x in so.scheduled_new_reqs) else "run"  # new: or resumed


def arguments(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--async", dest="async_sched", action="store_true")
    ap.add_argument("--load-async", action="store_true", help="the connector's async loads (WAITING_FOR_REMOTE_KVS)")
    ap.add_argument("--inflight-loads", type=int, default=None,
                    help="--max-num-inflight-kv-loads: async loads may start while the running batch is full")
    ap.add_argument("--faults", type=float, default=0.0, help="probability per load to remove a block")
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=48)
    ap.add_argument("--batched-tokens", type=int, default=24)
    ap.add_argument("--max-seqs", type=int, default=6)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--convs", type=int, default=10)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-steps", type=int, default=4000)
    ap.add_argument("--time-limit", type=float, default=150)
    ap.add_argument("--pool", default="64MiB")
    ap.add_argument("--put-delay-ms", type=int, default=0, help="each save's put starts this late (a slow pool)")
    ap.add_argument("-v", action="store_true")
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--policy", default="recompute", choices=["recompute", "fail"],
                    help="KVTransferConfig.kv_load_failure_policy (vLLM's default is 'fail')")
    ap.add_argument("--selftest", action="store_true", help="corrupt loaded blocks silently: must be flagged")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    return run(arguments(argv)).code


@dataclasses.dataclass
class Outcome:
    """A run's verdict: its exit code (1: wrong KV in the engine or the pool, or a wrong
    output), the counts of what it exercised, and the problems found by kind."""

    code: int
    stats: Stats
    problems: collections.Counter


def run(args) -> Outcome:
    logging.basicConfig(level=logging.INFO if args.v else logging.ERROR)
    for name in ("vllm", "kvpool"):
        logging.getLogger(name).setLevel(logging.INFO if args.v else logging.ERROR)

    init_none_hash(sha256)
    hasher = get_request_block_hasher(args.block_size, sha256)
    rng = random.Random(args.seed)
    stats = Stats()
    problems: list[str] = []
    kinds = collections.Counter()

    def report(kind, inst, msg):
        kinds[kind] += 1
        line = f"[{kind}] {inst.name}: {msg}"
        if kinds[kind] <= 30:
            problems.append(line)
        if args.v or kinds[kind] <= 5:
            print(line, flush=True)

    t0 = time.time()
    with tempfile.TemporaryDirectory() as model_dir, LocalCluster(1, args.pool) as cluster:
        Path(model_dir, "config.json").write_text(json.dumps(TINY_MODEL_CONFIG))
        args.model_dir = model_dir
        insts = [Instance(n, args, cluster.master_endpoint, stats, report) for n in ("A", "B")]
        system = [rng.randrange(3, 900) for _ in range(6 * args.block_size + 3)]
        # conversation state: tokens so far; next instance; turns done; in-flight request id
        convs = []
        for c in range(args.convs):
            shared = system if c % 3 else system[: 3 * args.block_size]
            convs.append({"tokens": shared + [rng.randrange(3, 900) for _ in range(rng.randrange(2, 20))],
                          "turn": 0, "inflight": None, "start": rng.randrange(0, 30)})
        owner: dict[str, tuple[Instance, dict, int]] = {}
        capacity_tokens = (args.blocks - 1) * args.block_size  # vLLM keeps one block as its null block
        tick = 0
        outputs_checked = 0
        while tick < args.max_steps and time.time() - t0 < args.time_limit:
            tick += 1
            for ci, conv in enumerate(convs):
                if conv["inflight"] is None and conv["turn"] < args.turns and tick >= conv["start"]:
                    inst = insts[(ci + conv["turn"]) % 2]
                    rid = f"c{ci}t{conv['turn']}{inst.name}"
                    maxt = rng.randrange(1, 12)
                    if len(conv["tokens"]) + maxt > capacity_tokens:
                        # A request larger than the whole KV cache would wait forever at the
                        # head of the queue; vLLM refuses a max_model_len its cache cannot
                        # hold, so no real deployment sees one: the conversation ends.
                        conv["turn"] = args.turns
                        stats.convs_ended_at_capacity += 1
                        continue
                    req = Request(rid, list(conv["tokens"]), SamplingParams(max_tokens=maxt, ignore_eos=True),
                                  None, block_hasher=hasher)
                    inst.add(req)
                    conv["inflight"] = rid
                    owner[rid] = (inst, conv, len(conv["tokens"]))
            for inst in insts:
                for rid in inst.engine_step(args.faults, rng):
                    inst_, conv, plen = owner[rid]
                    req = inst_.reqs[rid]
                    toks = list(req.all_token_ids)
                    hs = prefix_hashes(toks)
                    for k in range(plen, len(toks)):
                        if toks[k] != next_token(hs[k - 1]):
                            kind = "WRONG-OUTPUT(after-accepted-tainted)" if rid in inst_.desynced else "WRONG-OUTPUT"
                            report(kind, inst_, f"{rid} output token #{k - plen} = {toks[k]}, "
                                   f"expected {next_token(hs[k - 1])} (preemptions={req.num_preemptions})")
                            break
                    outputs_checked += 1
                    stats.finished += 1
                    conv["tokens"] = toks + [rng.randrange(3, 900) for _ in range(rng.randrange(1, 16))]
                    conv["turn"] += 1
                    conv["inflight"] = None
                    conv["start"] = tick + rng.randrange(0, 5)
            busy = any(i.scheduler.has_requests() or i.batch_queue for i in insts)
            if all(c["turn"] >= args.turns for c in convs) and not busy:
                break
        for inst in insts:
            inst.flush()
        unfinished = sum(1 for c in convs if c["turn"] < args.turns)
        for inst in insts:
            inst.worker.shutdown()
            inst.scheduler.shutdown()
    elapsed = time.time() - t0
    print(f"\n== seed={args.seed} async={args.async_sched} load_async={args.load_async} "
          f"faults={args.faults} policy={args.policy} "
          f"block_size={args.block_size} "
          f"blocks={args.blocks} batched_tokens={args.batched_tokens} max_seqs={args.max_seqs} "
          f"ticks={tick} elapsed={elapsed:.1f}s unfinished_convs={unfinished}")
    print("stats:", dataclasses.asdict(stats))
    print("problems:", dict(kinds) or "none")
    failing = ("WRONG-KV", "POOL-POISONED", "WRONG-OUTPUT", "BLOCKTABLE", "RUNNER", "SAVE-HASH", "SAVE-UNKNOWN")
    return Outcome(1 if any(k in kinds for k in failing) else 0, stats, kinds)


if __name__ == "__main__":
    sys.exit(main())
