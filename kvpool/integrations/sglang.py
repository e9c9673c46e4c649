"""kvpool as an SGLang HiCache storage backend (the L3 tier under SGLang's host KV pool).

SGLang loads it with its own dynamic-backend mechanism, no patch to SGLang:

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvpool",
        "module_path": "kvpool.integrations.sglang", "class_name": "KVPoolHiCacheStorage",
        "interface_v1": 1, "master": "10.0.0.1:50051"}'

Other extra-config keys: "embedded_memory" (a size: this process contributes that much DRAM
to the pool, default 0), "token" / "token_file" (the cluster token), "replica_num" (default
1), "shm_enabled" (default true), "extra_backend_tag" (a namespace prefix, as in SGLang's
Mooncake backend), "lookup_hold_ms" (how long `batch_exists` holds its hits from eviction for
the prefetch that follows, default 5000; 0 = none), "lookup_timeout_ms" (how long a lookup
waits for the master, default 1000), "lookup_backoff_ms_min" / "lookup_backoff_ms_max" (after a
lookup could not reach the master, lookups miss without asking for that long, doubling from
the min to the max between probes; default 1000 / 30000: breaker.py; SGLang runs every
request's hit query on its one prefetch thread, one after the other), "total_kv_heads" (the
model's KV head count, which SGLang does not give a backend: set, with more TP ranks than KV
heads, the ranks holding one head share one copy of its pages; the operator vouches for it).
$KVPOOL_MASTER is read when "master" is absent.

Pages are objects named much as SGLang's own Mooncake backend names them
(sglang/srt/mem_cache/storage/mooncake_store/mooncake_store.py): the page hash, prefixed by
the backend tag and model name, suffixed by the TP rank (and PP rank when PP > 1) and `_k` /
`_v`; an MLA model stores one `_k` object per page, shared by every TP rank (SGLang lets only
the first rank write it). The tag and model name end with an '@' (one in either becomes a
'-'), so that no model's namespace is a prefix of another's, as "m_" is of "m_2_" (clear).
kvpool adds what else decides a page's bytes to the prefix: the host pool's layout (SGLang's
layouts order a page's bytes differently in objects of one size), its dtype, and for MHA the
TP size (a rank's share of the heads):
`tag_model@layout_dtype_tpN[_ppNfromL]_<hash>_<tp rank>[_<pp rank>]_k`. With "total_kv_heads"
below the TP size, the ranks holding one KV head name its pages by the head instead of the
rank (`..._<hash>_kvh<head>of<total_kv_heads>[_<pp rank>]_k`); the first of them writes them,
the others report their writes done (as SGLang's non-writing MLA ranks do), and all read them.

With `interface_v1: 1` SGLang calls batch_get_v1 / batch_set_v1, which move each page
straight between kvpool and the registered host pool (`register_mem_pool_host`) with the
multi-buffer batch API: no staging copy. Without it SGLang calls get/set/batch_get/batch_set
with page tensors. A hybrid model's other host pools (Mamba and SWA states, a DSA indexer, a
draft model's KV) move with the v2 calls (batch_exists_v2 / batch_get_v2 / batch_set_v2):
one object per page and pool, `<page prefix>_<hash>_<rank>_<pool>_<layout>_<dtypes>_<page bytes>B`, where
the rank is dropped for the pools an MLA model's ranks share. Every method returns what
SGLang expects (a list for a list, never None), and operating errors (node or master down,
timeouts, misses) become failed pages, never exceptions in SGLang's I/O threads. Not
supported yet, and refused at start: split heads, DCP, attention CP, DeepSeek V4's
compressed pools (the BLOCK_GROUPS hit policy), in an MLA model with TP > 1 a pool sharded
by heads (SGLang backs it up from the first rank only), and a host pool that cannot give
its pages' ranges in its layout. This module is not used without SGLang installed.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvpool import limits
from kvpool.errors import ErrorCode, InvalidParams, KVPoolError
from kvpool.integrations.engine_options import SAVED_CODES, EngineOptions, without_ats
from kvpool.integrations.host_memory import RefusedRegistrations, covering_ranges, register_tensors
from kvpool.integrations.namespace_removal import NamespaceRemovals

log = logging.getLogger(__name__)

# A stats window bigger than this is dropped from the front: get_stats() may never be called.
STATS_SAMPLES_MAX = 10_000
# What SGLang 0.5.23 itself reads from the extra config it hands the backend (the dynamic
# backend's, cache_controller.py, hybrid_cache_controller.py): not kvpool's, and no typo.
_SGLANG_KEYS = (
    "backend_name", "module_path", "class_name", "interface_v1", "file_storage_path", "tp_lcm_size",
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys",
)  # fmt: skip
# In an MLA model every TP rank shares the KV pages and SGLang backs a page up from the first
# rank only, except for these pools, whose states are sharded by rank (SGLang's
# HybridCacheController.should_backup): their objects are named per rank and TP size.
_RANK_SHARDED_IN_MLA = frozenset({PoolName.MAMBA.value})
# DeepSeek V4's compressed pools need the BLOCK_GROUPS hit policy and a logical KV anchor.
_UNSUPPORTED_POOLS_PREFIX = "deepseek_v4"


class KVPoolHiCacheStorage(HiCacheStorage):
    """One SGLang rank's view of the pool. Thread-safe (SGLang's prefetch and backup threads).

    Holds the kvpool Store, the key namespace of this rank, the host pool once registered
    (whose buffers are registered with the Store for zero-copy I/O) and the stats window.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        if storage_config.should_split_heads or storage_config.dcp_size > 1 or storage_config.attn_cp_size > 1:
            raise InvalidParams("kvpool's SGLang backend does not support split heads, DCP or attention CP yet")
        options = EngineOptions.read(
            extra, "--hicache-storage-backend-extra-config", adapter_keys=("extra_backend_tag", "total_kv_heads"),
            engine_keys=_SGLANG_KEYS,
        )  # fmt: skip
        self.storage_config = storage_config
        self.is_mla = storage_config.is_mla_model
        self._replicate = options.replicate
        self._lookup_hold_ms = options.lookup_hold_ms
        # SGLang's prefetch thread runs every request's hit query, one after the other.
        self._lookup_timeout_ms = options.lookup_timeout_ms
        self._breaker = options.lookup_breaker("SGLang's lookups")
        self._store = options.open_store()
        # Page tensors whose registration the Store refused to drop (a cancelled get's disk
        # read still writes into them): held, so SGLang cannot free them under it, until it may.
        self._refused = RefusedRegistrations(self._store)
        parts = []
        if extra.get("extra_backend_tag") is not None:
            parts.append(without_ats(str(extra["extra_backend_tag"])))
        if storage_config.model_name:
            parts.append(without_ats("-".join(storage_config.model_name.split("/"))))
        # The namespace ends with an '@', which no tag or model name holds: with '_', which
        # they do, the namespace of model "m" was a prefix of model "m_2"'s, and clear()
        # removed both.
        self._prefix = "_".join(parts) + "@"
        self._page_prefix = self._prefix  # and the page format, once the host pool is known
        if storage_config.pp_size > 1:
            self._mha_suffix = f"{storage_config.tp_rank}_{storage_config.pp_rank}"
            self._mla_suffix = f"{storage_config.pp_rank}"
        else:
            self._mha_suffix = f"{storage_config.tp_rank}"
            self._mla_suffix = ""
        # With more TP ranks than KV heads, SGLang gives `replicas` consecutive ranks the same
        # head (QKVParallelLinear: head = rank // replicas). Only the operator can say so (see
        # _total_kv_heads): without it every rank keeps its own copy, under its rank.
        self._total_kv_heads = None if self.is_mla else _total_kv_heads(extra, storage_config.tp_size)
        self._kv_head_replicas = max(1, storage_config.tp_size // (self._total_kv_heads or storage_config.tp_size))
        self._kv_suffix = self._mha_suffix  # names this rank's KV pages (MHA)
        if self._kv_head_replicas > 1:
            head = storage_config.tp_rank // self._kv_head_replicas
            stage = f"_{storage_config.pp_rank}" if storage_config.pp_size > 1 else ""
            self._kv_suffix = f"kvh{head}of{self._total_kv_heads}{stage}"
        # The first rank of a head's replicas writes its pages; the others' writes are done.
        self._writes_kv = storage_config.tp_rank % self._kv_head_replicas == 0
        self.mem_pool_host: Any = None
        self._sidecars: dict[str, tuple[Any, str]] = {}  # pool name -> (host pool, object suffix)
        self._registered: list[int] = []
        self._pool_ranges: list[tuple[int, int]] = []  # (start, size) of the host pools registered
        self._stats_lock = threading.Lock()
        self._prefetch_pages: list[int] = []
        self._backup_pages: list[int] = []
        self._prefetch_bandwidth: list[float] = []
        self._backup_bandwidth: list[float] = []
        self._gb_per_page = 0.0
        # Each clear's removal of the namespace, waited for while the master answers (clear).
        self._clears = NamespaceRemovals(self._store, self._lookup_timeout_ms, "kvpool-clear")

    def __repr__(self) -> str:
        return f"<KVPoolHiCacheStorage prefix={self._prefix!r} mla={self.is_mla} {self._store!r}>"

    # --- host pool ----------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Remember the host KV pool and register its memory for zero-copy page I/O.

        Raises:
            KVPoolError: the memory cannot be registered, or the pool cannot say where a page
                lies (SGLang calls this at startup, and fails it on an error).
        """
        super().register_mem_pool_host(mem_pool_host)
        self._check_page_ranges(mem_pool_host)
        self._check_head_count(mem_pool_host)
        # The device pool's dtype: the host pool's is how it stores bytes (uint8 for every
        # fp8 format, which would read as one another's garbage).
        device_pool = getattr(mem_pool_host, "device_pool", None)
        dtype = getattr(device_pool, "dtype", None) or mem_pool_host.dtype
        page_format = [
            str(getattr(mem_pool_host, "layout", "")),
            str(dtype).removeprefix("torch."),
            "" if self.is_mla else f"tp{self.storage_config.tp_size}",  # MLA pages: one for every rank
            _pipeline_stage(self.storage_config.pp_size, getattr(device_pool, "start_layer", None)),
        ]
        self._page_prefix = self._prefix + "_".join(part for part in page_format if part)
        self._register_pool(mem_pool_host)
        if hasattr(mem_pool_host, "get_ksize_per_token"):
            bytes_per_page = mem_pool_host.get_ksize_per_token() * mem_pool_host.page_size
            self._gb_per_page = bytes_per_page / (1 << 30)

    def _check_head_count(self, mem_pool_host: Any) -> None:
        """A "total_kv_heads" that cannot be the model's: this rank's share of it is not the
        host pool's head count. (One head per rank fits any count up to the TP size: that the
        ranks share heads is the operator's word.)

        Raises:
            InvalidParams: the pool holds another number of heads.
        """
        head_num = getattr(mem_pool_host, "head_num", None)
        if self._total_kv_heads is None or head_num is None:
            return
        expected = max(1, self._total_kv_heads // self.storage_config.tp_size)
        if head_num != expected:
            raise InvalidParams(
                f"total_kv_heads {self._total_kv_heads} at TP {self.storage_config.tp_size} gives each rank "
                f"{expected} KV heads, but the host pool holds {head_num}: it is not this model's KV head count"
            )

    def _register_pool(self, pool: Any) -> None:
        tensors = list(_pool_tensors(pool))
        self._registered += register_tensors(self._store, tensors)
        self._pool_ranges += covering_ranges(tensors)

    def _in_a_pool(self, start: int, size: int) -> bool:
        return any(first <= start and start + size <= first + length for first, length in self._pool_ranges)

    def _check_page_ranges(self, mem_pool_host: Any) -> int:
        """Ask the pool for its first page's ranges, as every page I/O will: some layouts
        have none (SGLang's pools raise ValueError for them, e.g. an MLA pool in a layout
        other than page_first), and that is said at attach rather than as an exception in
        SGLang's I/O threads on every prefetch and backup.

        Returns:
            The bytes of a page.

        Raises:
            InvalidParams: the pool raised, or gave ranges that do not make this model's objects.
        """
        import torch

        probe = torch.arange(mem_pool_host.page_size or 1, dtype=torch.int64)
        try:
            if mem_pool_host is self.mem_pool_host:
                return sum(sum(sizes) for sizes in self._buffer_meta(["probe"], probe)[1])
            ((_, sizes),) = _page_ranges(mem_pool_host, probe, 1)
            return sum(sizes)
        except (ValueError, NotImplementedError, InvalidParams) as exc:
            layout = getattr(mem_pool_host, "layout", "?")
            raise InvalidParams(
                f"kvpool's SGLang backend cannot address the pages of {type(mem_pool_host).__name__} "
                f"(layout {layout}): {exc}"
            ) from None

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Take a pool of SGLang's host pool group: the KV anchor (given already to
        register_mem_pool_host), or a hybrid model's other pool (Mamba or SWA states, a DSA
        indexer, a draft model's KV), whose pages move with the v2 batch calls: one object per
        page and pool, gathered from all the page's ranges (get_page_buffer_meta).

        Raises:
            InvalidParams: a pool this backend cannot store (SGLang fails the attach): one
                that cannot give its pages' ranges, DeepSeek V4's compressed pools, a KV pool
                other than the anchor, or in an MLA model with TP > 1 a pool sharded by heads
                that SGLang backs up from the first rank only.
        """
        name = str(host_pool_name)
        if host_pool is self.mem_pool_host:
            super().register_mem_host_pool_v2(host_pool, host_pool_name)
            return
        if name == PoolName.KV.value or name.startswith(_UNSUPPORTED_POOLS_PREFIX):
            raise InvalidParams(f"kvpool's SGLang backend does not store a hybrid model's {name} pool yet")
        rank_sharded = not self.is_mla or name in _RANK_SHARDED_IN_MLA
        if not rank_sharded and self.storage_config.tp_size > 1 and hasattr(host_pool, "head_num"):
            raise InvalidParams(
                f"the {name} pool holds each TP rank's heads, but SGLang backs it up from the first "
                "rank only in an MLA model: kvpool cannot store it for the others"
            )
        page_bytes = self._check_page_ranges(host_pool)
        # What decides a page's bytes besides the model: the dtypes (a Mamba pool's temporal
        # and conv states have their own) and the page's size (layers differ with and
        # without draft layers, say), so that no page of another format is found.
        dtypes = [getattr(host_pool, attribute, None) for attribute in ("dtype", "temporal_dtype", "conv_dtype")]
        dtypes = [str(dtype).removeprefix("torch.") for dtype in dtypes if dtype is not None]
        if not rank_sharded:
            rank = self._mla_suffix
        else:  # the TP size is in an MHA model's page prefix already
            rank = self._mha_suffix if not self.is_mla else f"tp{self.storage_config.tp_size}_{self._mha_suffix}"
        layout = str(getattr(host_pool, "layout", ""))
        suffix = "_".join(part for part in (rank, name, layout, *dtypes, f"{page_bytes}B") if part)
        self._register_pool(host_pool)
        self._sidecars[name] = (host_pool, suffix)
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def close(self) -> None:
        self._clears.close()
        for address in self._registered:
            self._store.unregister_buffer(address)
        self._registered.clear()
        self._store.close()

    # --- keys ---------------------------------------------------------------------------------

    def _namespace(self, key: str) -> str:
        return f"{self._page_prefix}_{key}"

    def _object_keys(self, keys: Sequence[str]) -> list[str]:
        """The kvpool objects of each page, in page order: k (and v unless MLA)."""
        if self.is_mla:
            return [f"{self._namespace(k)}_{self._mla_suffix}_k" for k in keys]
        out = []
        for key in keys:
            base = f"{self._namespace(key)}_{self._kv_suffix}"
            out += [f"{base}_k", f"{base}_v"]
        return out

    @property
    def _objects_per_page(self) -> int:
        return 1 if self.is_mla else 2

    # --- v1: zero copy into the host pool -----------------------------------------------------

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading pages are in the pool (all their objects), in one round trip of
        lookup_timeout_ms at most; 0 while the master does not answer (breaker.py)."""
        if not keys:
            return 0
        object_keys = self._object_keys(keys)
        count = self._breaker.ask(
            lambda: self._held_prefix(object_keys),
            0, lambda exc: log.warning("kvpool batch_exists failed, reporting a miss: %s", exc),
        )  # fmt: skip
        return count // self._objects_per_page

    def _held_prefix(self, object_keys: list[str]) -> int:
        """How many leading objects the pool holds (held for the load), one round trip of
        lookup_timeout_ms at most per BATCH_KEYS_MAX of them: SGLang's hybrid cache controller
        (every model's, from 0.5.23) looks a whole request up at once, and a prompt of more
        than 8,192 pages (MHA: two objects a page) was refused whole, a miss (helper-148)."""
        found = 0
        for start in range(0, len(object_keys), limits.BATCH_KEYS_MAX):
            batch = object_keys[start : start + limits.BATCH_KEYS_MAX]
            count = self._store.longest_prefix(
                batch, self._lookup_hold_ms, self._readers_of_each(), self._lookup_timeout_ms
            )
            found += count
            if count < len(batch):
                break
        return found

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: Any,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read pages straight into the host pool at `host_indices`. One bool per page."""
        started = time.perf_counter()
        results = self._page_io(keys, host_indices, is_set=False)
        self._record(self._prefetch_pages, self._prefetch_bandwidth, keys, results, started)
        return results

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: Any,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Write pages straight from the host pool. A page already present is a success, and
        so is every page another rank holding this rank's KV heads writes."""
        if not self._writes_kv:
            return [True] * len(keys)
        started = time.perf_counter()
        results = self._page_io(keys, host_indices, is_set=True)
        self._record(self._backup_pages, self._backup_bandwidth, keys, results, started)
        return results

    def _page_io(self, keys: list[str], host_indices: Any, is_set: bool) -> list[bool]:
        if not keys:
            return []
        if is_set and not self._writes_kv:  # another rank of this rank's KV heads writes them
            return [True] * len(keys)
        if self.mem_pool_host is None:
            log.error("kvpool: page I/O before register_mem_pool_host")
            return [False] * len(keys)
        object_keys = self._object_keys(keys)
        try:
            addresses, sizes = self._buffer_meta(keys, host_indices)
            ok = self._objects_io(object_keys, addresses, sizes, is_set)
        except KVPoolError as exc:
            log.warning("kvpool %s of %d pages failed: %s", "set" if is_set else "get", len(keys), exc)
            return [False] * len(keys)
        per_page = self._objects_per_page
        return [all(ok[i * per_page : (i + 1) * per_page]) for i in range(len(keys))]

    def _buffer_meta(self, keys: list[str], host_indices: Any) -> tuple[list[list[int]], list[list[int]]]:
        """Per object, the host pool ranges it is gathered from / scattered into.

        get_page_buffer_meta gives a page's ranges in order: MHA alternates K and V ranges
        (one pair per page in page-first layouts, one per layer in layer-first); for MLA
        every range of the page belongs to its one object.

        Raises:
            InvalidParams: the pool gave a range count that does not fit the pages.
        """
        pages = _page_ranges(self.mem_pool_host, host_indices, len(keys))
        if self.is_mla:
            return [ptrs for ptrs, _ in pages], [sizes for _, sizes in pages]
        addresses: list[list[int]] = []
        sizes: list[list[int]] = []
        for page_ptrs, page_sizes in pages:
            if len(page_ptrs) % 2:
                raise InvalidParams(f"MHA page with {len(page_ptrs)} ranges: K and V do not pair")
            addresses += [page_ptrs[0::2], page_ptrs[1::2]]
            sizes += [page_sizes[0::2], page_sizes[1::2]]
        return addresses, sizes

    # --- v2: a hybrid model's other pools -----------------------------------------------------

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The KV prefix found (batch_exists), cut to where every other pool can restore it.

        An ALL_PAGES pool needs its object at every page of the prefix; a TRAILING_PAGES one
        (Mamba and SWA states) only at the last len(transfer.keys) pages of it, so a prefix
        of 5 pages may be restorable where 4 is not: every restorable length is returned, for
        SGLang to intersect across ranks. What is found is held from eviction as
        batch_exists holds the KV pages. A pool with another policy is a miss (logged).
        """
        kv_pages = self.batch_exists(keys, extra_info)
        restorable = list(range(1, kv_pages + 1))
        hits: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        transfers = [t for t in pool_transfers or () if str(t.name) != PoolName.KV.value]
        if not restorable or not transfers:
            return PoolTransferResult(kv_pages, hits, restorable)
        try:
            object_keys = [self._sidecar_keys(t.name, keys[:kv_pages]) for t in transfers]
            # Bounded as the KV lookup before it (it cost the prefetch thread the RPC timeout, 5 s).
            codes = _batched(lambda batch: self._store.query(batch, timeout_ms=self._lookup_timeout_ms).codes,
                             [k for ks in object_keys for k in ks])  # fmt: skip
            found = iter([code == ErrorCode.OK for code in codes])
        except KVPoolError as exc:
            if not self._breaker.record_failure(exc):
                log.warning("kvpool batch_exists_v2 failed, reporting a miss: %s", exc)
            return PoolTransferResult(0, {}, [])
        windows: list[tuple[list[str], int, int]] = []  # per pool: its objects, pages it needs at the end, readers
        for transfer, pool_keys in zip(transfers, object_keys):
            present = [next(found) for _ in pool_keys]
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = present.index(False) if False in present else kv_pages
                pool_restorable = set(range(1, boundary + 1))
                window = kv_pages
            elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                window = max(1, len(transfer.keys or ()))
                pool_restorable = {n for n in range(1, kv_pages + 1) if all(present[max(0, n - window) : n])}
                boundary = max(pool_restorable, default=0)
            else:
                log.error("kvpool: the %s pool's hit policy %s is not supported: a miss", transfer.name,
                          transfer.hit_policy)  # fmt: skip
                return PoolTransferResult(0, {}, [])
            if boundary:
                hits[transfer.name] = boundary
            restorable = [n for n in restorable if n in pool_restorable]
            windows.append((pool_keys, window, self._readers_of_each(str(transfer.name))))
        if restorable and self._lookup_hold_ms:
            end = restorable[-1]
            held: dict[int, list[str]] = {}  # by the ranks that read each object
            for pool_keys, window, readers in windows:
                held.setdefault(readers, []).extend(pool_keys[max(0, end - window) : end])
            try:
                hold_ms, timeout_ms = self._lookup_hold_ms, self._lookup_timeout_ms
                for readers, held_keys in held.items():
                    counts = _batched(lambda batch: [self._store.longest_prefix(batch, hold_ms, readers, timeout_ms)],
                                      held_keys)  # fmt: skip
                    if sum(counts) < len(held_keys):
                        restorable.pop()  # evicted since it was found: the longest is not restorable now
                        break
            except KVPoolError as exc:
                if not self._breaker.record_failure(exc):
                    log.warning("kvpool could not hold the pages found (they may be evicted): %s", exc)
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Read each transfer's pages into its pool at its host_indices. Per pool, one bool per key."""
        return self._transfers_io(transfers, is_set=False)

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Write each transfer's pages from its pool. A page already present is a success."""
        return self._transfers_io(transfers, is_set=True)

    def _transfers_io(self, transfers: list[PoolTransfer], is_set: bool) -> dict[str, list[bool]]:
        """All the transfers' objects in one batch (one round trip to the master)."""
        results: dict[str, list[bool]] = {}
        object_keys: list[str] = []
        addresses: list[list[int]] = []
        sizes: list[list[int]] = []
        spans: list[tuple[Any, int, int]] = []  # transfer name, first object, page count
        for transfer in transfers:
            keys = list(transfer.keys or ())
            if str(transfer.name) == PoolName.KV.value:
                results[transfer.name] = self._page_io(keys, transfer.host_indices, is_set)
                continue
            try:
                pool_keys = self._sidecar_keys(transfer.name, keys)
                pool, _ = self._sidecars[str(transfer.name)]
                pages = _page_ranges(pool, transfer.host_indices, len(keys)) if keys else []
            except (InvalidParams, ValueError, NotImplementedError) as exc:
                log.error("kvpool: the %s pool's pages cannot be moved: %s", transfer.name, exc)
                results[transfer.name] = [False] * len(keys)
                continue
            spans.append((transfer.name, len(object_keys), len(keys)))
            object_keys += pool_keys
            addresses += [ptrs for ptrs, _ in pages]
            sizes += [page_sizes for _, page_sizes in pages]
        if not spans:
            return results
        try:
            ok = self._objects_io(object_keys, addresses, sizes, is_set)
        except KVPoolError as exc:
            log.warning("kvpool %s of %d pages of other pools failed: %s", "set" if is_set else "get",
                        len(object_keys), exc)  # fmt: skip
            ok = [False] * len(object_keys)
        for name, first, count in spans:
            results[name] = ok[first : first + count]
        return results

    def _objects_io(
        self, object_keys: list[str], addresses: list[list[int]], sizes: list[list[int]], is_set: bool
    ) -> list[bool]:
        """Write or read objects from / into the host pool ranges given; whether each was.
        One batch per BATCH_KEYS_MAX objects (a master takes no more in one request)."""
        if is_set:
            codes = _batched(lambda *b: self._store.batch_put_from_multi_buffers(*b, self._replicate),
                             object_keys, addresses, sizes)  # fmt: skip
            return [code in SAVED_CODES for code in codes]
        read = _batched(self._store.batch_get_into_multi_buffers, object_keys, addresses, sizes)
        return [n == sum(s) for n, s in zip(read, sizes)]

    def _readers_of_each(self, pool_name: str = PoolName.KV.value) -> int:
        """The ranks that load each object of that pool, which a lookup holds it for: all the
        TP ranks of an MLA model share its KV pages (and all but the rank-sharded pools');
        each rank looks them up, and SGLang syncs the ranks' hits before any loads. The ranks
        holding one KV head share its KV pages likewise ("total_kv_heads")."""
        shared = self.is_mla and pool_name not in _RANK_SHARDED_IN_MLA
        if shared:
            return self.storage_config.tp_size
        return self._kv_head_replicas if pool_name == PoolName.KV.value else 1

    def _sidecar_keys(self, pool_name: Any, keys: Sequence[str]) -> list[str]:
        """The objects of a registered non-KV pool's pages. Raises InvalidParams otherwise."""
        sidecar = self._sidecars.get(str(pool_name))
        if sidecar is None:
            raise InvalidParams(f"the {pool_name} pool was not registered (register_mem_host_pool_v2)")
        return [f"{self._namespace(key)}_{sidecar[1]}" for key in keys]

    # --- v0: page tensors ---------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """Read one page into `target_location` (a tensor) and return it; None on a miss."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[Any]:
        """Read pages into the given flat page tensors. Per page the tensor, or None on a miss
        (SGLang stops at the first None)."""
        if not keys:
            return []
        if target_locations is None or len(target_locations) != len(keys):
            log.error("kvpool batch_get needs one target tensor per key")
            return [None] * len(keys)
        ok = self._tensor_io(keys, list(target_locations), is_set=False)
        return [t if good else None for t, good in zip(target_locations, ok)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Write page tensors. True when every page is in the pool afterwards (the usable
        pages are written when another's tensor is not)."""
        if not keys or values is None or len(values) != len(keys):
            return False
        if not self._writes_kv:  # another rank of this rank's KV heads writes them
            return True
        return all(self._tensor_io(keys, list(values), is_set=True))

    def _tensor_io(self, keys: list[str], tensors: list[Any], is_set: bool) -> list[bool]:
        """Page tensors hold a whole page; with MHA the first half is K and the second V.
        Per page whether it moved: a page whose tensor is unusable (not a contiguous CPU
        tensor, or memory that cannot be registered) fails alone, the others move."""
        self._refused.retry()
        object_keys = self._object_keys(keys)
        per_page = self._objects_per_page
        pages: list[int] = []  # the pages that move, by index
        addresses: list[list[int]] = []
        sizes: list[list[int]] = []
        registered: dict[int, int] = {}  # address -> the page whose tensor it is
        ok: list[bool] = []
        try:
            for index, tensor in enumerate(tensors):
                if tensor is None or not tensor.is_contiguous() or tensor.device.type != "cpu":
                    log.warning("kvpool page %s: not a contiguous CPU tensor, it fails alone", keys[index])
                    continue
                start, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
                if not self._in_a_pool(start, size):  # a page copied out (MHA); an MLA page is a view of the pool
                    try:
                        registered[self._store.register_buffer(start, size)] = index
                    except InvalidParams as exc:  # e.g. overlapping another page of the batch
                        log.warning("kvpool page %s fails alone: %s", keys[index], exc)
                        continue
                pages.append(index)
                if self.is_mla:
                    addresses.append([start])
                    sizes.append([size])
                else:
                    half = size // 2
                    addresses += [[start], [start + half]]
                    sizes += [[half], [size - half]]
            moving = [object_keys[page * per_page + part] for page in pages for part in range(per_page)]
            if moving:
                ok = self._objects_io(moving, addresses, sizes, is_set)
        except KVPoolError as exc:
            log.warning("kvpool page tensor %s failed: %s", "set" if is_set else "get", exc)
            return [False] * len(keys)
        finally:  # a page still written into by a late read did not move
            stuck = {page for start, page in registered.items() if not self._refused.unregister(start, tensors[page])}
        moved = [False] * len(keys)
        for n, page in enumerate(pages):
            moved[page] = page not in stuck and all(ok[n * per_page : (n + 1) * per_page])
        return moved

    # --- housekeeping -------------------------------------------------------------------------

    def clear(self) -> None:
        """Remove every object of this model's namespace (all ranks, every page format).
        Never raises.

        SGLang calls it on its scheduler thread (/clear_hicache_storage_backend), which serves
        nothing meanwhile: the removal (seconds for millions of objects) is waited for while
        the master answers a probe of lookup_timeout_ms between waits of that length, and
        given up on (logged) when one goes unanswered (namespace_removal.py); a master alive
        but not answering held SGLang's scheduler the removal's bound, 300 s."""
        try:
            removed = self._clears.remove(f"^{re.escape(self._prefix)}")
        except KVPoolError as exc:
            log.warning("kvpool clear failed: %s", exc)
            return
        log.info("kvpool clear removed %d objects", removed)

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics for the window since the last call (None if SGLang's
        metrics module is unavailable), as its Mooncake backend reports them."""
        storage_metrics = _storage_metrics_class()
        if storage_metrics is None:
            return None
        metrics = storage_metrics()
        with self._stats_lock:
            metrics.prefetch_pgs.extend(self._prefetch_pages)
            metrics.backup_pgs.extend(self._backup_pages)
            metrics.prefetch_bandwidth.extend(self._prefetch_bandwidth)
            metrics.backup_bandwidth.extend(self._backup_bandwidth)
            for window in (self._prefetch_pages, self._backup_pages,
                           self._prefetch_bandwidth, self._backup_bandwidth):  # fmt: skip
                window.clear()
        return metrics

    def _record(
        self, pages: list[int], bandwidth: list[float], keys: list[str], results: list[bool], started: float
    ) -> None:
        if not self.storage_config.enable_storage_metrics or not keys:
            return
        elapsed_s = max(time.perf_counter() - started, 1e-9)
        with self._stats_lock:
            pages.append(sum(results))
            bandwidth.append(sum(results) / elapsed_s * self._gb_per_page)
            del pages[:-STATS_SAMPLES_MAX], bandwidth[:-STATS_SAMPLES_MAX]


_STORAGE_METRICS: list[Any] = []


def _storage_metrics_class() -> Any:
    """SGLang's StorageMetrics, looked up once (its module imports much of SGLang)."""
    if not _STORAGE_METRICS:
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError as exc:
            log.info("SGLang's StorageMetrics unavailable, get_stats returns None: %s", exc)
            StorageMetrics = None  # noqa: N806
        _STORAGE_METRICS.append(StorageMetrics)
    return _STORAGE_METRICS[0]


def _total_kv_heads(extra: dict, tp_size: int) -> int | None:
    """The model's KV head count, as the operator gives it ("total_kv_heads"), or None.

    SGLang gives a storage backend no way to know it: the host pool's head_num is this rank's
    share, 1 both for 8 KV heads at TP 16 (each held by two ranks) and for 16, and
    HiCacheStorageConfig has no head count. SGLang's own unified key scheme
    (hicache_key_scheme.py) refuses to guess at one head per rank too; in 0.5.23 it is wired
    to no backend and its --hicache-storage-head-group is no server argument. So it is never
    guessed.

    Raises:
        InvalidParams: not a whole number that divides the TP size or that it divides, as
            SGLang's tensor parallelism requires.
    """
    given = extra.get("total_kv_heads")
    if given is None:
        return None
    text = str(given).strip()
    heads = given if type(given) is int else int(text) if text.isascii() and text.isdigit() else None
    if heads is None or heads < 1 or (heads % tp_size and tp_size % heads):
        raise InvalidParams(
            f"total_kv_heads in --hicache-storage-backend-extra-config must be the model's KV head count, "
            f"which divides TP size {tp_size} or is a multiple of it, not {given!r}"
        )
    return heads


def _pipeline_stage(pp_size: int, start_layer: int | None) -> str:
    """What a PP rank's pages hold besides its rank: the PP size and the stage's first layer.
    Rank 1 of two stages split 16/16 or (by a custom split) 20/12 holds other layers, in
    pages of one size when the counts agree. "" without PP."""
    if pp_size <= 1:
        return ""
    return f"pp{pp_size}" + (f"from{start_layer}" if start_layer is not None else "")


def _page_ranges(pool: Any, host_indices: Any, page_count: int) -> list[tuple[list[int], list[int]]]:
    """Per page, the host ranges get_page_buffer_meta gives for it, in its order.

    Raises:
        InvalidParams: no indices for the pages, or a range count that does not split into them.
        ValueError, NotImplementedError: the pool's, for a layout it cannot address.
    """
    page_size = pool.page_size or 1
    if host_indices is None or host_indices.numel() != page_count * page_size:
        found = 0 if host_indices is None else host_indices.numel()
        raise InvalidParams(f"{found} host indices for {page_count} pages of {page_size}")
    pointers, byte_sizes = pool.get_page_buffer_meta(host_indices)
    if not pointers or len(pointers) != len(byte_sizes) or len(pointers) % page_count:
        raise InvalidParams(f"{len(pointers)} host ranges for {page_count} pages")
    per_page = len(pointers) // page_count
    return [
        (list(pointers[i : i + per_page]), list(byte_sizes[i : i + per_page]))
        for i in range(0, len(pointers), per_page)
    ]


def _pool_tensors(pool: Any) -> list[Any]:
    """Every host tensor the pool's page ranges can point into."""
    tensors = []
    getter = getattr(pool, "get_hybrid_pool_buffer", None)
    if callable(getter):
        tensors += [t for t in getter() if t is not None]
    for name in ("kv_buffer", "k_buffer", "v_buffer", "index_k_buffer", "index_k_scale_buffer"):
        tensor = getattr(pool, name, None)
        if tensor is not None and hasattr(tensor, "data_ptr"):
            tensors.append(tensor)
    return tensors


_R = TypeVar("_R")


def _batched(call: Callable[..., Sequence[_R]], *columns: list) -> list[_R]:
    """`call` over the rows of `columns` (parallel lists, one row per object) in batches of at
    most BATCH_KEYS_MAX rows, the results joined: a master takes no more keys in one request,
    and a larger batch was refused whole."""
    results: list[_R] = []
    for start in range(0, len(columns[0]), limits.BATCH_KEYS_MAX):
        results += call(*(column[start : start + limits.BATCH_KEYS_MAX] for column in columns))
    return results
