"""kvpool as a vLLM V1 KV connector, loaded out of tree with no patch to vLLM:

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "kvpool.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"master": "10.0.0.1:50051"}}'

("recompute": a block lost between the lookup and the load is recomputed; vLLM's default,
"fail", ends the request with an error. With "load_async": false, recompute only together
with --no-async-scheduling: a synchronous load that fails under async scheduling has vLLM
hand out tokens computed over the lost block. docs/integrations.md.)

Other extra-config keys: "embedded_memory" (a size each worker process contributes to the
pool, default 0; the scheduler side contributes none), "token" / "token_file", "replica_num"
(default 1), "shm_enabled" (default true), "cache_prefix" (a namespace for separate
deployments), "lookup_hold_ms" (how long a lookup's hits are held from eviction for their
load, default 5000; 0 = none), "load_async"
(default true, as vLLM's Mooncake store connector), "lookup_timeout_ms" (how long a scheduler
lookup, or a reset's probe, waits for the master, default 1000), "lookup_backoff_ms_min" / "lookup_backoff_ms_max"
(after a lookup could not reach the master, lookups miss without asking for that long,
doubling from the min to the max between probes; default 1000 / 30000: breaker.py).
$KVPOOL_MASTER is read when "master" is absent.

Each full block of a prompt is one object holding that block of every layer (K then V per
layer for FlashAttention-style caches; the block as it lies for block-first and MLA caches),
named like vLLM's own Mooncake store connector (vllm/distributed/kv_transfer/kv_connector/v1/
mooncake/store/data.py PoolKey) with the block's format after the model (_kv_format):
`model@kv:DTYPE@tp_size:N@pp_size:M@tp_rank:T@pcp0@dcp0@pp_rank:P@group:0@<block hash>`
(`cache_prefix@` before it when set, an '@' in either name becoming a '-'; `tp_size:any`
for an MLA model, whose blocks are the same bytes at every TP size; with PP,
`@pp_layers:16.16` after the PP size: how many layers each stage holds). TP ranks
that hold the same bytes share their keys, as in that connector: every rank of an MLA model
(one latent per token), and the ranks over which vLLM replicates a KV head when TP exceeds
the KV heads. A key's `tp_rank` is the rank divided by that replication (`_tp_replicas`);
each of those ranks saves every Nth block of a step (by its position in the prompt) and all
of them load every block.

- Scheduler side: `get_num_new_matched_tokens` asks the pool how many leading blocks of the
  prompt every TP and PP rank holds, in one `longest_prefix` round trip per BATCH_KEYS_MAX
  keys (at most BATCH_KEYS_MAX blocks: a worker loads them in one batch), and always leaves
  at least one token to compute. A lookup waits lookup_timeout_ms at most, and after one
  could not reach the master the next ones answer a miss without asking, until a probe gets
  an answer (breaker.py): a master that stops answering costs vLLM's loop one short wait
  per back-off window, not the RPC timeout per waiting request per step. The plan (and the
  scheduler's key prefix) goes to the workers in the metadata. Loads are asynchronous
  (load_async): vLLM parks the request in WAITING_FOR_REMOTE_KVS and goes on with the
  others; a request vLLM looks up again after its async load failed loads nothing more (a
  preempted one loads async again).
  `get_external_cache_hit_sources` splits the loaded tokens, for vLLM's metrics, by where
  each block lies: this host's DRAM ("host"), another's ("p2p"), a disk tier or the DFS.
- Worker side: `start_load_kv` reads the planned blocks straight into the paged KV cache
  (`batch_get_into_multi_buffers`, one range per layer and K/V): a synchronous load at once,
  before the forward pass; an async one on the worker's loader thread, whose end
  `get_finished` reports once, with the blocks that failed. `wait_for_save` hands the
  prompt blocks computed in this step to the worker's saver thread
  (`batch_put_from_multi_buffers`), which puts them during the next forward passes; a step
  that hands one of their blocks to a request again names the save in its plan, and each
  worker ends it before that step writes anything (`bind_connector_metadata`: a save not
  begun is given up, the one running waited for), so that no block is written again under a
  put (vLLM's offloading connector's way; until 2026-12-07 the scheduler held a reference on
  each block, and vLLM's reset_prefix_cache(reset_running_requests=True) failed meanwhile).
  Each worker reports its finished saves with the next step's output
  (`build_connector_worker_meta`). Without a bound pool (`bind_gpu_block_pool`: a scheduler
  that is not vLLM's) a step's saves are put in the step. A block that fails to
  load is reported by `get_block_ids_with_load_errors` (vLLM then recomputes or fails the
  request, per its kv_load_failure_policy); after a synchronous load, the saves of its step
  and of the steps in flight with it are skipped (computed over it); the scheduler side
  evicts it and the blocks after it from vLLM's prefix cache (update_connector_output); a
  failed save is a future miss. Operating errors never raise into vLLM. vLLM's reset of the
  connector's cache (around a weight update, on sleep) removes the model's blocks from the
  pool (reset_cache). Each lookup, load and save goes to vLLM's connector stats, log and
  Prometheus metrics (vllm_stats.py). With vLLM's KV events on, the blocks saved (once every
  worker has put them) and those removed after a failed load go to vLLM's KV event
  publisher (take_events, vllm_events.py).

Not supported, and refused at start because each would load the wrong KV: more than one
KV cache group (vLLM turns the hybrid KV cache manager off for a connector without
SupportsHMA), prefix/decode context parallelism, block hashes finer than the block
(hash_block_size). Not supported either: KV caches on a device the Store cannot address (the
paged cache must be host memory, e.g. vLLM's CPU backend; on GPUs vLLM reaches kvpool through
LMCache's connector and kvpool's LMCache plugin), layer-wise pipelining.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import re
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvpool import limits
from kvpool.config import parse_flag
from kvpool.errors import ErrorCode, InvalidParams, KVPoolError
from kvpool.integrations.engine_options import SAVED_CODES, STORED_CODES, EngineOptions, without_ats
from kvpool.integrations.host_memory import register_tensors
from kvpool.integrations.namespace_removal import NamespaceRemovals
from kvpool.integrations.vllm_events import SaveEvents
from kvpool.integrations.vllm_stats import KVPoolConnectorStats, KVPoolPromMetrics, StatsRecorder
from kvpool.protocol.messages import TIER_DRAM, QueryReply, Replica, SegmentInfo
from kvpool.repeated_log import RepeatedLog

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
_backed_up_log = RepeatedLog(log, logging.WARNING)

# Save jobs a worker's saver thread may have waiting: past it a step's saves are given up at
# once (reported done, not put), so that a pool that stops answering (each put waiting out its
# RPC bound, one after another) does not keep pinning vLLM's blocks until its KV cache is full
# and the engine stops producing tokens (a review: 0 tokens/s 2 s into a master SIGSTOP).
_SAVE_JOBS_WAITING_MAX = 8
# First blocks of prompts the scheduler last knew in the pool (may_load_async), at most: ~10 MB.
_FIRST_BLOCKS_KNOWN_MAX = 65_536


@dataclasses.dataclass
class BlockTransfer:
    """Blocks of one request to move: block hashes (hex) and the vLLM block ids they occupy."""

    request_id: str
    block_hashes: list[str]
    block_ids: list[int]
    is_async: bool = False  # a load vLLM waits for in WAITING_FOR_REMOTE_KVS, not before a forward
    first_block: int = 0  # the first block's position in the prompt (which rank saves which)
    job: int = -1  # a save put after the step, on the workers' saver threads: reported done by every worker


@dataclasses.dataclass
class KVPoolConnectorMetadata(KVConnectorMetadata):
    """One step's plan, from the scheduler to every worker: what to load before the forward
    pass and what to save after it, and the scheduler's key prefix (a worker's config may
    differ from it after the model loads: vLLM rewrites cache_dtype for some attention
    layers, and the keys would no longer match the scheduler's lookups)."""

    key_prefix: str = ""
    loads: list[BlockTransfer] = dataclasses.field(default_factory=list)
    saves: list[BlockTransfer] = dataclasses.field(default_factory=list)
    # Save jobs whose blocks vLLM hands out again in this step: a worker ends them before
    # anything writes those blocks (bind_connector_metadata).
    flush_jobs: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class KVPoolWorkerMetadata(KVConnectorWorkerMetadata):
    """From the workers to the scheduler, each step: the save jobs each has finished (job ->
    how many workers; vLLM sums them over the workers with `aggregate`), and of those the
    positions of the blocks some worker did not put (job -> positions in the save; for the
    scheduler's KV events)."""

    saved: dict[int, int] = dataclasses.field(default_factory=dict)
    failed: dict[int, list[int]] = dataclasses.field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVPoolWorkerMetadata), type(other)
        saved, failed = dict(self.saved), dict(self.failed)
        for job, count in other.saved.items():
            saved[job] = saved.get(job, 0) + count
        for job, positions in other.failed.items():
            failed[job] = sorted({*failed.get(job, ()), *positions})
        return KVPoolWorkerMetadata(saved, failed)


@dataclasses.dataclass
class _RequestState:
    """The scheduler's view of a running request: its prompt's block hashes, the blocks vLLM
    gave it, and how many leading blocks are in the pool already (found or saved)."""

    block_hashes: list[str]
    prompt_token_count: int
    block_ids: list[int] = dataclasses.field(default_factory=list)
    stored_block_count: int = 0
    # Leading blocks vLLM's own prefix cache holds (the lookup's num_computed_tokens): the
    # pool's blocks load after them. request.num_computed_tokens cannot say it: vLLM sets it
    # only after update_state_after_alloc (0 until then, and again after a preemption).
    local_block_count: int = 0
    load_async: bool = False  # what the lookup told vLLM
    request: Request | None = None  # with KV events on: what they describe of its blocks


class KVPoolConnector(KVConnectorBase_V1):
    """vLLM's KV connector for kvpool; vLLM builds one per role (scheduler, each worker)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        options = EngineOptions.read(
            extra, "kv_connector_extra_config", adapter_keys=("cache_prefix", "load_async", "model_name"),
            engine_keys=("custom_mem_pool",),  # vLLM's own (KVTransferConfig.uses_custom_mem_pool)
        )  # fmt: skip
        self._load_async = parse_flag(extra.get("load_async", True), "load_async in kv_connector_extra_config")
        _refuse_unsupported(vllm_config, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            # embedded_memory is what each worker contributes: vLLM builds a scheduler side
            # too (in the engine core's process, a worker's own at TP 1), which only looks up.
            options = dataclasses.replace(options, embedded_memory_bytes=0)
        self._store = options.open_store()
        self._replicate = options.replicate
        self._lookup_hold_ms = options.lookup_hold_ms
        # The scheduler's lookups run in vLLM's engine loop: a bound of their own, and a breaker
        # that answers misses while the master does not answer (breaker.py).
        self._lookup_timeout_ms = options.lookup_timeout_ms
        self._breaker = options.lookup_breaker("vLLM's scheduler lookups")
        self.block_size = vllm_config.cache_config.block_size
        model = vllm_config.model_config.model if vllm_config.model_config else extra.get("model_name", "")
        # Each part ends with an '@', which neither holds (one in either becomes a '-', as in
        # SGLang's adapter): cache_prefix "team" with model "m" and model "team@m" without one
        # shared their keys, and read each other's blocks.
        prefix = f"{without_ats(str(extra['cache_prefix']))}@" if extra.get("cache_prefix") else ""
        self._namespace = f"{prefix}{without_ats(str(model))}@"  # every block of this model, in any KV format
        self._model_prefix = f"{self._namespace}{_kv_format(vllm_config)}"
        assert self._model_prefix.startswith(f"{self._namespace}kv:"), self._model_prefix  # reset_cache's pattern
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.pp_size = vllm_config.parallel_config.pipeline_parallel_size
        self.tp_rank, self.pp_rank = _parallel_ranks()
        self._tp_replicas = _tp_replicas(vllm_config)
        # This side's pool operations since vLLM last asked (get_kv_connector_stats).
        self._stats = StatsRecorder()
        # Scheduler state.
        self._requests: dict[str, _RequestState] = {}
        self._pending_loads: list[BlockTransfer] = []
        # Requests that had an async load (and were not preempted since): a later lookup of
        # theirs loads nothing (see get_num_new_matched_tokens).
        self._loaded_async: set[str] = set()
        # The first blocks of prompts that the pool held at this scheduler's last lookup or
        # save of them, least recently seen first (may_load_async).
        self._first_blocks_in_pool: collections.OrderedDict[str, None] = collections.OrderedDict()
        # Where segments are (by id), for get_external_cache_hit_sources: fetched again when
        # a replica lies in one not known yet.
        self._segments: dict[str, SegmentInfo] = {}
        # Worker state: per layer (base address, bytes between blocks, bytes per range), one
        # entry per K/V range of a block.
        self._layer_ranges: list[tuple[int, int, int]] = []
        self._registered: list[int] = []
        # The registered tensors, held: loads write into them (on the loader thread too), so
        # they live as long as the registration, whoever else drops them.
        self._kv_caches: dict[str, Any] = {}
        self._load_errors: set[int] = set()
        # Async loads: one thread reads them while vLLM runs its forward passes; per request,
        # its blocks and the future of those that failed (its completion is reported once).
        self._loader: concurrent.futures.ThreadPoolExecutor | None = None
        self._loading: dict[str, tuple[list[int], concurrent.futures.Future[set[int]]]] = {}
        # Steps whose saves are skipped after a failed load (wait_for_save): that step and
        # those vLLM scheduled before it learnt of the failure (async scheduling, PP).
        self._unsaved_steps = 0
        self._steps_in_flight = max(1, int(getattr(vllm_config, "max_concurrent_batches", 1)))
        # Scheduler: the block hashes each recent step planned to save (the steps a load
        # failure may have run beside), and what a load failure doomed, removed again at the
        # next updates until those steps' saves are surely over (update_connector_output).
        self._recent_saves: collections.deque[tuple[list[str], list[int]]] = collections.deque(
            maxlen=self._steps_in_flight + 1
        )
        self._doomed_saves: list[tuple[int, list[str], list[int]]] = []
        # Their removals run on a thread of their own (a master that does not answer must not
        # stall vLLM's engine loop): the one in flight, and the doomed saves whose last
        # removal it is (doomed again if it fails).
        self._remover: concurrent.futures.ThreadPoolExecutor | None = None
        self._removal: concurrent.futures.Future[bool] | None = None
        self._last_removed: list[tuple[int, list[str], list[int]]] = []
        # Each reset's removal of the namespace, waited for while the master answers (reset_cache).
        self._resets = NamespaceRemovals(self._store, self._lookup_timeout_ms, "kvpool-reset")
        # Scheduler: vLLM's block pool, the blocks each save job still reads until every worker
        # reported it (_number_saves), with the workers yet to report it and the job's block
        # hashes, and the jobs that read each block (a step that hands one out again flushes them).
        self._block_pool: BlockPool | None = None
        self._saving: dict[int, tuple[list[int], int, list[str]]] = {}
        self._saving_blocks: dict[int, set[int]] = {}
        self._next_job = 0
        self._workers = self.tp_size * self.pp_size  # each reports every job (context parallelism is refused)
        # vLLM's KV events for the blocks saved and removed, kept only while they are on (as
        # vLLM's scheduler and block pool decide it): vllm_events.py.
        events_config = getattr(vllm_config, "kv_events_config", None)
        self._save_events = (
            SaveEvents(self.block_size) if events_config is not None and events_config.enable_kv_cache_events else None
        )
        # Worker: saves put on a thread of their own after the forward pass, and the jobs done
        # since the last step's report (build_connector_worker_meta), each with the positions
        # of its blocks this worker did not put.
        self._saver: concurrent.futures.ThreadPoolExecutor | None = None
        self._saves_waiting = 0  # jobs submitted to the saver and not begun (_SAVE_JOBS_WAITING_MAX)
        self._saves_waiting_lock = threading.Lock()
        self._saved: collections.deque[tuple[int, Sequence[int]]] = collections.deque()
        # Jobs on the saver thread, not reported yet: their future and this worker's positions.
        self._save_futures: dict[int, tuple[concurrent.futures.Future, list[int]]] = {}

    # --- keys ---------------------------------------------------------------------------------

    def _key(
        self, block_hash: str, key_tp: int | None = None, pp_rank: int | None = None, prefix: str = ""
    ) -> str:
        """A block's key for this worker's ranks, or for `key_tp` (a TP rank over the
        replication: one of _key_ranks) and `pp_rank`."""
        tp = self.tp_rank // self._tp_replicas if key_tp is None else key_tp
        pp = self.pp_rank if pp_rank is None else pp_rank
        return f"{prefix or self._model_prefix}@tp_rank:{tp}@pcp0@dcp0@pp_rank:{pp}@group:0@{block_hash}"

    def _key_ranks(self) -> list[tuple[int, int]]:
        """The (key TP rank, PP rank) of every distinct object of a block."""
        key_tp_size = self.tp_size // self._tp_replicas
        return [(tp, pp) for pp in range(self.pp_size) for tp in range(key_tp_size)]

    # --- scheduler side -----------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond `num_computed_tokens` whose KV the pool holds for every TP rank."""
        prompt_blocks = len(request.prompt_token_ids or ()) // self.block_size
        hashes = [_hex(h) for h in request.block_hashes[:prompt_blocks]]
        self._requests[request.request_id] = _RequestState(
            hashes, len(request.prompt_token_ids or ()), local_block_count=num_computed_tokens // self.block_size,
            request=request if self._save_events is not None else None,
        )  # fmt: skip
        # A worker loads a request's blocks in one batch, which a master takes up to
        # BATCH_KEYS_MAX keys: a longer hit would be a failed load (past 262k tokens at block 16).
        loadable = self._before_doomed(hashes[: limits.BATCH_KEYS_MAX])
        if not loadable:
            return 0, False
        ranks = self._key_ranks()
        keys = [self._key(h, tp, pp) for h in loadable for tp, pp in ranks]
        # A request looked up again after an async load (which failed, or vLLM would not ask)
        # loads nothing more: it computes the rest. Loaded async again, it would wait at the
        # head of vLLM's queue of requests holding blocks for room beside every load in
        # flight, while the requests behind it, loaded already and holding that room, never
        # moved (tests/vllm_scheduler_sim.py, seed 0, faults 0.3). Loaded synchronously (as
        # until 2026-12-05), a failure of that load under vLLM's async scheduling handed out
        # tokens computed over the failed block (vLLM's own bug; integrations.md). A
        # preempted request gave its blocks back, and loads async again (build_connector_meta).
        again = request.request_id in self._loaded_async  # (empty without async loads)
        # None: the lookup failed, or the master did not answer lately (not asked): a miss.
        held = self._breaker.ask(
            lambda: self._held_prefix(keys, hold=not again), None,
            lambda exc: log.warning("kvpool lookup failed, computing %s locally: %s", request.request_id, exc),
        )  # fmt: skip
        if held is None:
            return 0, False
        self._know_first_block(loadable[0], held >= len(ranks))
        hit_blocks = held // len(ranks)
        # vLLM must compute at least the last token to sample from it.
        if hit_blocks * self.block_size >= request.num_tokens:
            hit_blocks -= 1
        state = self._requests[request.request_id]
        state.stored_block_count = hit_blocks
        if again:
            return 0, False
        tokens = max(0, hit_blocks * self.block_size - num_computed_tokens)
        state.load_async = tokens > 0 and self._load_async
        return tokens, state.load_async

    def may_load_async(self, request: Request) -> bool:
        """Whether the lookup may answer with an async load, asked (from vLLM 0.34) as a
        request enters the waiting queues, so without a round trip. With
        --max-num-inflight-kv-loads such a request's load may start while the running batch
        is full, and its KV is there when a slot frees; one told yes that then has nothing to
        load holds back the loads queued behind it until a slot frees. So yes only where a
        load is likely: the prompt's first block (every hit starts there) was in the pool at
        this scheduler's last lookup or save of it; a shared prefix (a system prompt) is known
        after its first lookup. Any other request waits for a slot, as every one did before
        vLLM 0.34, and loads then. A request looked up again after an async load loads
        nothing (get_num_new_matched_tokens)."""
        hashes = request.block_hashes
        return (
            self._load_async
            and request.request_id not in self._loaded_async
            and len(request.prompt_token_ids or ()) > self.block_size
            and bool(hashes)
            and _hex(hashes[0]) in self._first_blocks_in_pool
        )

    def _know_first_block(self, block_hash: str, is_in_pool: bool) -> None:
        """Remember whether the pool holds a prompt's first block (may_load_async)."""
        known = self._first_blocks_in_pool
        if not is_in_pool:
            known.pop(block_hash, None)
            return
        known[block_hash] = None
        known.move_to_end(block_hash)
        if len(known) > _FIRST_BLOCKS_KNOWN_MAX:
            known.popitem(last=False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens == 0:
            return
        block_ids = list(blocks.get_block_ids()[0])
        first = state.local_block_count
        last = first + num_external_tokens // self.block_size
        assert last <= len(block_ids), (first, last, len(block_ids))
        self._pending_loads.append(
            BlockTransfer(request.request_id, state.block_hashes[first:last], block_ids[first:last], state.load_async)
        )
        if state.load_async:
            self._loaded_async.add(request.request_id)

    def _held_prefix(self, keys: list[str], hold: bool = True) -> int:
        """How many leading keys the pool holds (and holds for the load, with `hold`), in one round trip
        per BATCH_KEYS_MAX keys, which a master takes in one batch: a long prompt at TP 4 and
        block 16 has more past 65k tokens, and its whole lookup used to be refused (a miss).
        Each round trip waits lookup_timeout_ms at most."""
        found = 0
        for start in range(0, len(keys), limits.BATCH_KEYS_MAX):
            batch = keys[start : start + limits.BATCH_KEYS_MAX]
            with self._stats.timed("lookup", len(batch)):
                # Each key is loaded by the TP ranks that share it (every rank of an MLA model).
                count = self._store.longest_prefix(
                    batch, self._lookup_hold_ms if hold else 0, self._tp_replicas, timeout_ms=self._lookup_timeout_ms
                )
            found += count
            if count < len(batch):
                break
        return found

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        """vLLM's prefix-cache metrics by source: the tokens this request loads from the pool,
        split by where their blocks lie now (_hit_source). One query of the master, for the
        first TP and PP rank's keys, bound and skipped as the lookups are (the breaker); all
        EXTERNAL_UNSPECIFIED when it fails or is skipped."""
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        state = self._requests.get(request.request_id)
        if num_external_tokens <= 0:
            return {}
        if state is None:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        first = state.local_block_count
        hashes = state.block_hashes[first : first + -(-num_external_tokens // self.block_size)]

        def query() -> QueryReply:
            reply = self._store.query([self._key(h, 0, 0) for h in hashes], timeout_ms=self._lookup_timeout_ms)
            if any(r.segment_id not in self._segments for replicas in reply.replicas for r in replicas):
                self._segments = self._store.cluster_status(timeout_ms=self._lookup_timeout_ms).segment_infos()
            return reply

        reply = self._breaker.ask(
            query, None, lambda exc: log.debug("kvpool: no hit sources for %s: %s", request.request_id, exc)
        )
        if reply is None:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        sources: dict[Any, int] = {}
        left, hostname = num_external_tokens, self._store.hostname
        for replicas in reply.replicas:
            source = CacheHitSource(_hit_source(replicas, self._segments, hostname))
            tokens = min(self.block_size, left)
            sources[source] = sources.get(source, 0) + tokens
            left -= tokens
        return sources

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVPoolConnectorMetadata:
        """This step's loads (planned at allocation) and saves: every full prompt block that
        becomes computed in this step and is not in the pool yet."""
        meta = KVPoolConnectorMetadata(key_prefix=self._model_prefix, loads=self._pending_loads)
        self._pending_loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
                self._plan_save(meta, new.req_id, state, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
        for index, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[index]
            if req_id in resumed:
                state.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                state.block_ids += list(new_ids[0])
            computed = cached.num_computed_tokens[index] + scheduled.get(req_id, 0)
            self._plan_save(meta, req_id, state, computed)
        for req_id in scheduler_output.preempted_req_ids or ():
            self._loaded_async.discard(req_id)  # its blocks are gone: a load of it starts afresh
        for req_id in scheduler_output.finished_req_ids:
            self._requests.pop(req_id, None)
            self._loaded_async.discard(req_id)
        meta.flush_jobs = self._jobs_reading(scheduler_output, meta.loads)
        self._number_saves(meta)
        self._recent_saves.append(([h for save in meta.saves for h in save.block_hashes], [s.job for s in meta.saves]))
        return meta

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        """vLLM's block pool (the real scheduler binds it): with it, saves run after the
        forward pass on the workers' saver threads, and a step that hands their blocks out
        again flushes them first (_jobs_reading)."""
        self._block_pool = gpu_block_pool

    def _jobs_reading(self, scheduler_output: SchedulerOutput, loads: list[BlockTransfer]) -> list[int]:
        """The save jobs in flight that read a block this step writes: one handed to a request
        for the tokens it computes (new or resumed past its prefix-cache hits, or growing), or
        one a load of this step writes (an async load's request is scheduled only once it has
        landed: its blocks are in no request of the step's). Its worker ends the job before
        the step writes the block (bind_connector_metadata). Before, the scheduler held a
        reference on each block of a save until every worker had put it, and vLLM's
        reset_prefix_cache(reset_running_requests=True) failed while one did (review
        helper-148): the way of vLLM's own offloading connector. A prefix-cache hit is read,
        not written: flushing for it held a step behind the put of a shared prompt's save
        (review helper-153, as was a save whose blocks an async load took)."""
        if not self._saving_blocks:
            return []
        written: set[int] = {block for load in loads for block in load.block_ids}
        for new in scheduler_output.scheduled_new_reqs:
            hits = new.num_computed_tokens // self.block_size  # (this step's loads are above)
            for group in new.block_ids:
                written.update(group[hits:])
        for ids in scheduler_output.scheduled_cached_reqs.new_block_ids:
            for group in ids or ():
                written.update(group)
        reading = self._saving_blocks
        return sorted({job for block in written & reading.keys() for job in reading[block]})

    def _number_saves(self, meta: KVPoolConnectorMetadata) -> None:
        """Give each save a job, put after the step on the workers' saver threads: the blocks
        it reads are written again only once it is over (_jobs_reading). Its end is known
        when every worker has reported it (update_connector_output)."""
        if self._block_pool is None:
            return  # a scheduler vLLM did not bind: workers save in the step
        for save in meta.saves:
            save.job, self._next_job = self._next_job, self._next_job + 1
            block_ids = list(dict.fromkeys(save.block_ids))
            self._saving[save.job] = (block_ids, self._workers, save.block_hashes)
            for block_id in block_ids:
                self._saving_blocks.setdefault(block_id, set()).add(save.job)
            state = self._requests.get(save.request_id)
            if self._save_events is not None and state is not None and state.request is not None:
                self._save_events.plan(save.job, state.request, save.first_block, len(save.block_hashes))

    def _end_saves(self, worker_meta: Any) -> None:
        """Forget the save jobs every worker has now reported (in job order: with KV events
        on, a job's blocks are announced then, after those of the jobs before it, which hold
        their parents)."""
        if not isinstance(worker_meta, KVPoolWorkerMetadata) or self._block_pool is None:
            return
        pool = self._block_pool
        doomed = self._doomed_hashes() if self._save_events is not None else set()
        for job, count in sorted(worker_meta.saved.items()):
            saving = self._saving.pop(job, None)
            if saving is None:  # a bug (a job reported by more workers than there are): say so
                log.warning("kvpool: save job %d reported done again", job)
                continue
            block_ids, left, hashes = saving
            if self._save_events is not None:
                self._save_events.report(job, worker_meta.failed.get(job, ()), left <= count, pool, doomed)
            if left > count:
                self._saving[job] = (block_ids, left - count, hashes)
                continue
            for block_id in block_ids:
                jobs = self._saving_blocks.get(block_id)
                if jobs is not None:
                    jobs.discard(job)
                    if not jobs:
                        del self._saving_blocks[block_id]

    def take_events(self) -> list[KVCacheEvent]:
        """The KV events since vLLM last asked (each step, publishing them with its own):
        BlockStored for the blocks of the save jobs every worker has reported, less those a
        worker did not put and those this connector removes; BlockRemoved for the blocks of
        the saves it removes after a failed load (_remove_doomed_saves). None while KV
        events are off (vllm_events.py)."""
        return self._save_events.take() if self._save_events is not None else []

    def reset_cache(self) -> bool:
        """vLLM's reset of the connector's cache (reset_prefix_cache with reset_connector, and
        by default sleep and a pause that clears the caches, as around a weight update): every
        object of this model's namespace leaves the pool, whichever deployment of it wrote it
        and in whatever KV format, since blocks computed with the weights before must not load
        again. A save planned before may still land after the removal: the blocks of the saves
        of the steps in flight and of those no worker has finished go again at the next
        updates, until those saves are over (_remove_doomed_saves, as after a failed load).
        Returns False when the pool could not be reached, or its master stopped answering
        (namespace_removal.py): vLLM then fails the reset."""
        saving_hashes = [h for _, _, job_hashes in self._saving.values() for h in job_hashes]
        self._first_blocks_in_pool.clear()
        self._doom_saves(self._recent_save_hashes() + saving_hashes, list(self._saving))
        # Up to the KV format's first field: a namespace alone is a prefix of another's
        # where a model's name extends this one's past an '@' (a cache_prefix named like
        # this model, or a model "m@x" beside "m").
        pattern = f"^{re.escape(self._namespace)}kv:"
        try:
            removed = self._resets.remove(pattern)
        except KVPoolError as exc:
            log.warning("kvpool: the reset of the connector's cache failed: %s", exc)
            return False
        log.info("kvpool: the connector's cache was reset: %d objects of %s removed", removed, self._namespace)
        return True

    def has_pending_push_work(self) -> bool:
        """Saves are still put: vLLM keeps stepping until the workers report them."""
        return bool(self._saving)

    def _plan_save(
        self, meta: KVPoolConnectorMetadata, req_id: str, state: _RequestState, computed_tokens: int
    ) -> None:
        full = min(computed_tokens, state.prompt_token_count) // self.block_size
        full = min(full, len(state.block_hashes), len(state.block_ids))
        if full > state.stored_block_count:
            first = state.stored_block_count
            state.stored_block_count = full
            if self._breaker.is_open():  # the master does not answer: no save
                return
            hashes, block_ids = state.block_hashes[first:full], state.block_ids[first:full]
            meta.saves.append(BlockTransfer(req_id, hashes, block_ids, first_block=first))
            if first == 0:
                self._know_first_block(hashes[0], True)

    def update_connector_output(self, connector_output: Any) -> None:
        """Blocks the workers failed to load leave vLLM's prefix cache, with every block after
        them in the requests that hold them (computed over them), and those requests save
        nothing more.

        vLLM does so itself only under kv_load_failure_policy "fail": under "recompute" it
        keeps them cached for the failed request to recompute in place, but a request
        preempted before it recomputes frees them with their hashes, and the next request
        with that prefix read the failed block's garbage as a prefix-cache hit (and this
        connector then saved the blocks it computed over them into the pool: seen driving
        vLLM's real scheduler, 4 of 6 seeds with load failures injected)."""
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        if invalid:  # before the saves reported now are announced (KV events): they go too
            self._doom_recent_saves()
        self._end_saves(getattr(connector_output, "kv_connector_worker_meta", None))
        self._remove_doomed_saves()
        manager = getattr(self, "_kv_cache_manager", None)
        if not invalid or manager is None:
            return
        doomed = set(invalid)
        for req_id, state in self._requests.items():
            block_ids = manager.get_block_ids(req_id)[0]
            for index, block_id in enumerate(block_ids):
                if block_id in invalid:
                    doomed.update(block_ids[index:])
                    # Nothing more of it is saved: with async scheduling a request that took
                    # the failed block from vLLM's prefix cache in the step in flight has
                    # computed over it, and vLLM keeps those tokens computed.
                    state.stored_block_count = len(state.block_hashes)
                    break
        manager.evict_blocks(doomed)

    def _doom_recent_saves(self) -> None:
        """A load failed: the saves planned in the steps it may have run beside are doomed
        (_remove_doomed_saves), and with KV events on announced removed."""
        jobs = [job for _, step_jobs in self._recent_saves for job in step_jobs if job >= 0]
        recent = self._recent_save_hashes()
        self._doom_saves(recent, jobs)
        if self._save_events is not None:
            self._save_events.removed(recent)

    def _remove_doomed_saves(self) -> None:
        """After a load failure, every rank's objects of the saves planned in the steps it may
        have run beside go, now and at the next updates until those steps are over.

        A worker whose load failed skips its own saves of those steps (wait_for_save), but
        with TP or PP above 1 another rank's load may have succeeded: it saved blocks computed
        over hidden states the failed block's garbage entered (all-reduced across TP, passed
        on across PP), under their right keys, and a later recompute of them found the keys
        taken. Only the scheduler hears every rank's failures. A save of a step still in
        flight may land after a removal: hence again, at each of the next updates (each
        comes after one more step's saves), and for as long as a worker has not reported one
        of those saves done (saves put on the workers' threads: _number_saves). A reset of the
        connector's cache dooms the saves planned before it alike (reset_cache).

        The removals run on the remover thread: a master that does not answer cost vLLM's
        engine loop the RPC timeout at each of those updates. An update while one is in
        flight starts none; a failed last removal goes again; and the scheduler's lookups
        stop before any doomed block until its last removal has succeeded (_before_doomed),
        so that this engine loads none meanwhile. Readers elsewhere need the master's replica
        list, as the removal does: a master that answers neither serves them none."""
        if self._removal is not None:
            if not self._removal.done():
                return  # it still waits on the master: the next update asks again
            if not self._removal.result():  # their last removal goes again
                self._doomed_saves += [(1, hashes, jobs) for _, hashes, jobs in self._last_removed]
            self._removal, self._last_removed = None, []
        if not self._doomed_saves:
            return
        ranks = self._key_ranks()
        keys = [self._key(h, tp, pp) for _, hashes, _ in self._doomed_saves for h in hashes for tp, pp in ranks]
        # A save's blocks are removed for the last time once its steps are over and no worker
        # still puts them: if that removal succeeds, none of them is left.
        self._last_removed = [
            (left, hashes, jobs)
            for left, hashes, jobs in self._doomed_saves
            if left <= 1 and not any(job in self._saving for job in jobs)
        ]
        self._doomed_saves = [
            (left - 1, hashes, jobs)
            for left, hashes, jobs in self._doomed_saves
            if left > 1 or any(job in self._saving for job in jobs)
        ]
        if self._remover is None:
            self._remover = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvpool-remove")
        self._removal = self._remover.submit(self._remove_keys, keys)

    def _remove_keys(self, keys: list[str]) -> bool:
        """Remove every one of `keys` (on the remover thread); False (logged) if that failed."""
        try:
            for start in range(0, len(keys), limits.BATCH_KEYS_MAX):
                self._store.batch_remove(keys[start : start + limits.BATCH_KEYS_MAX], force=True)
        except KVPoolError as exc:
            log.warning("kvpool: removing %d blocks saved beside a failed load or before a reset failed "
                        "(tried again at the next update): %s", len(keys), exc)  # fmt: skip
            return False
        return True

    def _before_doomed(self, hashes: list[str]) -> list[str]:
        """The leading `hashes` that no doomed save holds: until their last removal has
        succeeded, this scheduler plans no load of blocks computed over a failed load's
        garbage or with the weights before a reset (a removal runs beside the engine loop,
        and such a save may land after one)."""
        doomed = self._doomed_hashes()
        if not doomed:
            return hashes
        for index, block_hash in enumerate(hashes):
            if block_hash in doomed:
                return hashes[:index]
        return hashes

    def _doomed_hashes(self) -> set[str]:
        """The blocks (hashes) of the doomed saves whose last removal has not succeeded yet."""
        return {h for entries in (self._doomed_saves, self._last_removed) for _, hs, _ in entries for h in hs}

    def _recent_save_hashes(self) -> list[str]:
        """The block hashes of the saves planned in the steps that may still be in flight."""
        return [h for step_hashes, _ in self._recent_saves for h in step_hashes]

    def _doom_saves(self, hashes: list[str], jobs: list[int]) -> None:
        """Remove these blocks (their hashes, every rank's keys) at each of the next updates,
        until the steps in flight now are over and no worker still runs one of `jobs`."""
        if hashes:
            self._doomed_saves.append((self._steps_in_flight + 1, hashes, jobs))
            for block_hash in hashes:
                self._first_blocks_in_pool.pop(block_hash, None)

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache, not a hand-off: a save lost to a preemption is a future miss, so vLLM
        need not drop a preempted request's output in flight (it does for kv_both producers by
        default, recomputing it)."""
        return False

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._requests.pop(request.request_id, None)
        self._loaded_async.discard(request.request_id)
        return False, None  # vLLM may free the blocks now: a save in flight holds its own reference

    # --- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Learn each layer's paged cache layout and register its memory with the Store.

        A layer is (2, num_blocks, ...) for FlashAttention-style caches, whose blocks are
        one K range and one V range, or (num_blocks, ...) for block-first and MLA caches. A
        layer that shares another's cache (cross-layer KV sharing: vLLM hands both names the
        same tensor) is stored once: its ranges twice in a block's read would overlap, which
        a get refuses.

        Raises:
            InvalidParams: a layer's cache is not in host memory (vLLM's CPU backend), or a
                block of some layer is not one contiguous range.
        """
        ranges = []
        seen: set[tuple[int, tuple[int, ...]]] = set()
        for name, tensor in kv_caches.items():
            if tensor.device.type != "cpu":  # a GPU's address: the first save would crash the worker
                raise InvalidParams(
                    f"layer {name}: the KV cache is on {tensor.device}; kvpool's vLLM connector reads "
                    "and writes host memory only (vLLM's CPU backend). On GPUs, serve with vLLM's "
                    "LMCacheConnectorV1 and kvpool as LMCache's remote storage plugin (kvpool's "
                    "docs/integrations.md)"
                )
            identity = (tensor.data_ptr(), tuple(tensor.shape))
            if identity in seen:
                continue
            seen.add(identity)
            if tensor.dim() >= 3 and tensor.shape[0] == 2:
                parts = [tensor[0], tensor[1]]
            else:
                parts = [tensor]
            for part in parts:
                block = part[0]
                block_bytes = block.numel() * block.element_size()
                if not block.is_contiguous() or part.stride(0) * part.element_size() < block_bytes:
                    raise InvalidParams(f"layer {name}: a KV block is not one contiguous range")
                ranges.append((part.data_ptr(), part.stride(0) * part.element_size(), block_bytes))
        self._layer_ranges = ranges
        self._registered = register_tensors(self._store, kv_caches.values())
        self._kv_caches = dict(kv_caches)

    def _block_buffers(self, block_ids: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
        addresses = [[base + b * stride for base, stride, _ in self._layer_ranges] for b in block_ids]
        sizes = [[size for _, _, size in self._layer_ranges] for _ in block_ids]
        return addresses, sizes

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Read this step's planned blocks into the paged cache: sync loads now (before the
        forward pass), async ones on the loader thread (reported by get_finished)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPoolConnectorMetadata), type(meta)
        failed_before = len(self._load_errors)
        for load in meta.loads:
            if load.is_async:
                if self._loader is None:
                    self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvpool-load")
                future = self._loader.submit(self._load, load, meta.key_prefix)
                self._loading[load.request_id] = (load.block_ids, future)
            else:
                self._load_errors |= self._load(load, meta.key_prefix)
        if len(self._load_errors) > failed_before:
            self._unsaved_steps = self._steps_in_flight

    def _load(self, load: BlockTransfer, key_prefix: str) -> set[int]:
        """Read one request's planned blocks; returns the ids of those that failed."""
        keys = [self._key(h, prefix=key_prefix) for h in load.block_hashes]
        addresses, sizes = self._block_buffers(load.block_ids)
        try:
            with self._stats.timed("load", len(keys)) as outcome:
                read = self._store.batch_get_into_multi_buffers(keys, addresses, sizes)
                whole = [count == sum(parts) for count, parts in zip(read, sizes)]
                outcome.size_bytes = sum(count for count, ok in zip(read, whole) if ok)
                outcome.failed_keys = whole.count(False)
        except KVPoolError as exc:
            log.warning("kvpool load of %s failed, vLLM recomputes: %s", load.request_id, exc)
            return set(load.block_ids)
        return {block for block, ok in zip(load.block_ids, whole) if not ok}

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose async load ended, each reported once; the blocks that failed to
        load go to this same step's get_block_ids_with_load_errors, as vLLM requires. (No
        save is skipped for them: vLLM caches none of a request's blocks before its load
        ends, and recomputes from the first failed one, so nothing was computed over it.)"""
        done = {req_id for req_id, (_, future) in self._loading.items() if future.done()}
        for req_id in done:
            block_ids, future = self._loading.pop(req_id)
            try:
                self._load_errors |= future.result()
            except Exception:  # a bug, not an operating error: the whole load failed
                log.exception("kvpool async load of %s failed", req_id)
                self._load_errors |= set(block_ids)
        return None, done or None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks of every layer are saved in wait_for_save

    def wait_for_save(self) -> None:
        """Write the prompt blocks this step computed: on the saver thread, while the next
        steps run, when the scheduler gave the save a job (_number_saves: it then flushes the
        job before a step writes its blocks again, bind_connector_metadata), else now. A
        failure is logged: a future miss. Each job is reported done once, put or not
        (build_connector_worker_meta).

        Not after a load failed, in its step and in the steps vLLM scheduled before it learnt
        of the failure (one more with async scheduling; PP - 1 more with PP): their forward
        passes computed blocks over whatever the failed block held, in the request that
        loaded it (its next chunk too) and in any other that vLLM's prefix cache let share
        it. vLLM recomputes those requests from the failed block; the pool must not keep
        the blocks computed over it under their right keys."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPoolConnectorMetadata), type(meta)
        if self._unsaved_steps:
            self._unsaved_steps -= 1
            if meta.saves:
                log.warning(
                    "kvpool: a load failed in this step or one in flight with it; not saving %d blocks",
                    sum(len(save.block_ids) for save in meta.saves),
                )
            self._saved.extend((save.job, range(len(save.block_ids))) for save in meta.saves if save.job >= 0)
            return
        replicas, share = self._tp_replicas, self.tp_rank % self._tp_replicas
        for save in meta.saves:
            mine = [i for i in range(len(save.block_ids)) if (save.first_block + i) % replicas == share]
            if save.job < 0:
                self._save(save, mine, meta.key_prefix)
            elif not mine:
                self._saved.append((save.job, ()))
            else:
                with self._saves_waiting_lock:
                    is_backed_up = self._saves_waiting >= _SAVE_JOBS_WAITING_MAX
                    self._saves_waiting += not is_backed_up
                if is_backed_up:  # the pool is slow or not answering: no step waits for these
                    _backed_up_log.log("kvpool: %d save jobs wait already (the pool is slow or not answering): "
                                       "not saving %d blocks", _SAVE_JOBS_WAITING_MAX, len(mine))  # fmt: skip
                    self._saved.append((save.job, mine))
                    continue
                if self._saver is None:
                    self._saver = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvpool-save")
                future = self._saver.submit(self._save_job, save, mine, meta.key_prefix)
                self._save_futures[save.job] = (future, mine)
                # Forgotten once done (at once if it is already: after the entry, whatever the order).
                future.add_done_callback(lambda _, job=save.job: self._save_futures.pop(job, None))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The step's plan, bound before its forward pass (which vLLM may run before
        start_load_kv): the save jobs reading blocks this step hands out again end first."""
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, KVPoolConnectorMetadata) and connector_metadata.flush_jobs:
            self._flush(connector_metadata.flush_jobs)

    def _flush(self, jobs: Sequence[int]) -> None:
        """End these save jobs before their blocks are written again: one not begun is given up
        (reported done, its blocks not put: a future miss), the one running is waited for
        (its put is bounded by the Store's timeouts)."""
        running = []
        for job in jobs:
            found = self._save_futures.get(job)
            if found is None:  # reported, given up, or never this worker's
                continue
            future, mine = found
            if future.cancel():
                self._save_futures.pop(job, None)
                with self._saves_waiting_lock:
                    self._saves_waiting -= 1
                self._saved.append((job, mine))
            else:
                running.append(future)
        if running:
            concurrent.futures.wait(running)

    def _save_job(self, save: BlockTransfer, mine: list[int], key_prefix: str) -> None:
        with self._saves_waiting_lock:
            self._saves_waiting -= 1
        failed: Sequence[int] = mine
        try:
            failed = self._save(save, mine, key_prefix)
        except Exception:  # a bug, not an operating error: the job still ends
            log.exception("kvpool save of %s failed", save.request_id)
        finally:
            self._saved.append((save.job, failed))

    def _save(self, save: BlockTransfer, mine: list[int], key_prefix: str) -> list[int]:
        """Put this rank's blocks of `save` (those at `mine`); a failure is logged. Returns the
        positions of those not put."""
        if not mine:
            return []
        keys = [self._key(save.block_hashes[i], prefix=key_prefix) for i in mine]
        addresses, sizes = self._block_buffers([save.block_ids[i] for i in mine])
        try:
            with self._stats.timed("save", len(keys)) as outcome:
                codes = self._store.batch_put_from_multi_buffers(keys, addresses, sizes, self._replicate)
                # (a block already in the pool moved no bytes, and did not fail)
                outcome.size_bytes = sum(sum(parts) for code, parts in zip(codes, sizes) if code == ErrorCode.OK)
                outcome.failed_keys = failed = sum(code not in SAVED_CODES for code in codes)
        except KVPoolError as exc:
            log.warning("kvpool save of %s failed: %s", save.request_id, exc)
            return mine
        if failed:
            log.info("kvpool save of %s: %d of %d blocks failed", save.request_id, failed, len(codes))
        # Not put by this rank: failed, or another writer's put still in flight (not failed, but
        # the pool may not hold the block yet: KV events announce it only once it does).
        return [i for i, code in zip(mine, codes) if code not in STORED_CODES]

    def build_connector_worker_meta(self) -> KVPoolWorkerMetadata | None:
        """The save jobs this worker finished since the last step (each once), and the
        blocks of theirs it did not put."""
        saved: dict[int, int] = {}
        failed: dict[int, list[int]] = {}
        while self._saved:
            job, not_put = self._saved.popleft()
            saved[job] = 1
            if not_put:
                failed[job] = list(not_put)
        return KVPoolWorkerMetadata(saved, failed) if saved else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._loader is not None:  # loads in flight write into the registered cache
            self._loader.shutdown(wait=True)
        if self._saver is not None:  # and saves in flight read it
            self._saver.shutdown(wait=True)
        if self._remover is not None:
            self._remover.shutdown(wait=True)
        self._resets.close()
        for address in self._registered:
            self._store.unregister_buffer(address)
        self._registered = []
        self._kv_caches = {}
        self._store.close()

    # --- telemetry (either side) -------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVPoolConnectorStats | None:
        """This side's pool operations since vLLM last asked (it asks after every step, sums
        the workers' and logs and exports them: vllm_stats.py)."""
        return self._stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVPoolConnectorStats:
        return KVPoolConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVPoolPromMetrics:
        return KVPoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _refuse_unsupported(vllm_config: VllmConfig, kv_cache_config: Any) -> None:
    """Refuse at start what would load the wrong KV: this connector keys block i of the first
    KV cache group by request.block_hashes[i] and reads into every registered layer.

    Raises:
        InvalidParams: context parallelism, more than one KV cache group, or block hashes of
            another granularity than the block (vLLM's hash_block_size).
    """
    parallel = vllm_config.parallel_config
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(parallel, name, 1) > 1:
            raise InvalidParams(f"kvpool's vLLM connector does not support {name} > 1")
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    if len(groups) > 1:
        raise InvalidParams(
            f"kvpool's vLLM connector supports one KV cache group, not {len(groups)}: "
            "run with --disable-hybrid-kv-cache-manager"
        )
    block_size = vllm_config.cache_config.block_size
    hash_block_size = getattr(kv_cache_config, "hash_block_size", None)
    if hash_block_size not in (None, block_size):
        raise InvalidParams(
            f"kvpool's vLLM connector needs block hashes per block: hash_block_size "
            f"{hash_block_size} != block_size {block_size} (unset --prefix-match-unit)"
        )


def _tp_replicas(vllm_config: VllmConfig) -> int:
    """How many TP ranks hold each rank's KV bytes: all of them in an MLA model (one latent
    per token, no heads to split), tp_size / KV heads when TP exceeds the KV heads (vLLM
    gives rank r head r // that, linear.py's num_kv_head_replicas), else 1. Without this
    every rank of an MLA model stored the same bytes under its own key: TP times the pool."""
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    if tp_size == 1 or vllm_config.model_config is None:
        return 1
    if _is_mla(vllm_config):
        return tp_size
    kv_heads = vllm_config.model_config.get_total_num_kv_heads()
    return tp_size // kv_heads if tp_size > kv_heads and tp_size % kv_heads == 0 else 1


def _is_mla(vllm_config: VllmConfig) -> bool:
    return bool(getattr(vllm_config.model_config, "use_mla", False))


def _kv_format(vllm_config: VllmConfig) -> str:
    """What decides a block's bytes besides its tokens, for the key: the KV dtype (same-sized
    dtypes, bf16 and fp16, or two fp8 formats, read as one another's garbage), the TP and PP
    sizes (a rank's share of the heads: 4 KV heads over TP 4 or TP 8 give rank 1 another head
    in objects of one size; "any" TP size for MLA, whose latent every rank holds whole) and
    with PP the stages' layer counts. The scheduler's is the one
    keys use: each step's metadata carries it to the workers, whose config vLLM may have
    changed since."""
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype == "auto" and vllm_config.model_config is not None:
        cache_dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
    parallel = vllm_config.parallel_config
    tp_size = "any" if _is_mla(vllm_config) else parallel.tensor_parallel_size
    kv_format = f"kv:{cache_dtype}@tp_size:{tp_size}@pp_size:{parallel.pipeline_parallel_size}"
    if parallel.pipeline_parallel_size > 1 and vllm_config.model_config is not None:
        kv_format += f"@pp_layers:{_stage_layer_counts(vllm_config)}"
    return kv_format


def _stage_layer_counts(vllm_config: VllmConfig) -> str:
    """How many layers each pipeline stage holds, as "16.16" (vLLM's split: even, or
    $VLLM_PP_LAYER_PARTITION). A stage's key names its rank only, so two deployments of a
    model split otherwise (16/16 and 20/12) read each other's layers where one stage's layer
    count agrees."""
    from vllm.distributed.utils import get_pp_indices

    layers = vllm_config.model_config.get_total_num_hidden_layers()
    stages = vllm_config.parallel_config.pipeline_parallel_size
    return ".".join(str(end - start) for start, end in (get_pp_indices(layers, s, stages) for s in range(stages)))


def _hit_source(replicas: Sequence[Replica], segments: dict[str, SegmentInfo], hostname: str) -> str:
    """The value of vLLM's CacheHitSource for a block whose replicas lie there, the nearest
    counting: "host" (DRAM on this host), "p2p" (another host's DRAM), "disk" (a node's disk
    tier or the DFS); "external_unspecified" when it is gone or its segments are unknown."""
    known = [segments[r.segment_id] for r in replicas if r.segment_id in segments]
    if any(s.tier == TIER_DRAM and s.hostname == hostname for s in known):
        return "host"
    if any(s.tier == TIER_DRAM for s in known):
        return "p2p"
    return "disk" if known else "external_unspecified"


def _hex(block_hash: Any) -> str:
    return block_hash.hex() if isinstance(block_hash, (bytes, bytearray)) else str(block_hash)


def _parallel_ranks() -> tuple[int, int]:
    """This worker's (TP rank, PP rank); (0, 0) where vLLM's model parallel groups are not set
    up (the scheduler process, or a single-process engine)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 0
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pp_group().rank_in_group
