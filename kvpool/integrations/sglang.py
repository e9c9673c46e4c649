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
the prefetch that follows, default 5000; 0 = none). $KVPOOL_MASTER is read when "master" is
absent.

Pages are objects named as SGLang's own Mooncake backend names them
(sglang/srt/mem_cache/storage/mooncake_store/mooncake_store.py): the page hash, prefixed by
the backend tag and model name, suffixed by the TP rank (and PP rank when PP > 1) and `_k` /
`_v`; an MLA model stores one `_k` object per page, shared by every TP rank (SGLang lets only
the first rank write it). kvpool adds what else decides a page's bytes to the prefix: the
host pool's layout (SGLang's layouts order a page's bytes differently in objects of one
size), its dtype, and for MHA the TP size (a rank's share of the heads).

With `interface_v1: 1` SGLang calls batch_get_v1 / batch_set_v1, which move each page
straight between kvpool and the registered host pool (`register_mem_pool_host`) with the
multi-buffer batch API: no staging copy. Without it SGLang calls get/set/batch_get/batch_set
with page tensors. Every method returns what SGLang expects (a list for a list, never None),
and operating errors (node or master down, timeouts, misses) become failed pages, never
exceptions in SGLang's I/O threads. Not supported yet, and refused at start: split heads,
DCP, attention CP, the host pools of hybrid models besides the KV pool (SGLang moves
those with the v2 batch calls), and a host pool that cannot give its pages' ranges in its
layout. This module is not used without SGLang installed.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Sequence
from typing import Any

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvpool.errors import ErrorCode, InvalidParams, KVPoolError
from kvpool.integrations.engine_options import EngineOptions
from kvpool.integrations.host_memory import register_tensors

log = logging.getLogger(__name__)

# A stats window bigger than this is dropped from the front: get_stats() may never be called.
STATS_SAMPLES_MAX = 10_000
_PUT_OK = (ErrorCode.OK, ErrorCode.OBJECT_ALREADY_EXISTS)


class KVPoolHiCacheStorage(HiCacheStorage):
    """One SGLang rank's view of the pool. Thread-safe (SGLang's prefetch and backup threads).

    Holds the kvpool Store, the key namespace of this rank, the host pool once registered
    (whose buffers are registered with the Store for zero-copy I/O) and the stats window.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        if storage_config.should_split_heads or storage_config.dcp_size > 1 or storage_config.attn_cp_size > 1:
            raise InvalidParams("kvpool's SGLang backend does not support split heads, DCP or attention CP yet")
        options = EngineOptions.read(extra, "--hicache-storage-backend-extra-config")
        self.storage_config = storage_config
        self.is_mla = storage_config.is_mla_model
        self._replicate = options.replicate
        self._lookup_hold_ms = options.lookup_hold_ms
        self._store = options.open_store()
        parts = []
        if extra.get("extra_backend_tag") is not None:
            parts.append(str(extra["extra_backend_tag"]))
        if storage_config.model_name:
            parts.append("-".join(storage_config.model_name.split("/")))
        self._prefix = "_".join(parts)
        self._page_prefix = self._prefix  # and the page format, once the host pool is known
        if storage_config.pp_size > 1:
            self._mha_suffix = f"{storage_config.tp_rank}_{storage_config.pp_rank}"
            self._mla_suffix = f"{storage_config.pp_rank}"
        else:
            self._mha_suffix = f"{storage_config.tp_rank}"
            self._mla_suffix = ""
        self.mem_pool_host: Any = None
        self._registered: list[int] = []
        self._stats_lock = threading.Lock()
        self._prefetch_pages: list[int] = []
        self._backup_pages: list[int] = []
        self._prefetch_bandwidth: list[float] = []
        self._backup_bandwidth: list[float] = []
        self._gb_per_page = 0.0

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
        # The device pool's dtype: the host pool's is how it stores bytes (uint8 for every
        # fp8 format, which would read as one another's garbage).
        dtype = getattr(getattr(mem_pool_host, "device_pool", None), "dtype", None) or mem_pool_host.dtype
        page_format = [
            str(getattr(mem_pool_host, "layout", "")),
            str(dtype).removeprefix("torch."),
            "" if self.is_mla else f"tp{self.storage_config.tp_size}",  # MLA pages: one for every rank
        ]
        self._page_prefix = "_".join(part for part in [self._prefix, *page_format] if part)
        self._registered += register_tensors(self._store, _pool_tensors(mem_pool_host))
        if hasattr(mem_pool_host, "get_ksize_per_token"):
            bytes_per_page = mem_pool_host.get_ksize_per_token() * mem_pool_host.page_size
            self._gb_per_page = bytes_per_page / (1 << 30)

    def _check_page_ranges(self, mem_pool_host: Any) -> None:
        """Ask the pool for its first page's ranges, as every page I/O will: some layouts
        have none (SGLang's pools raise ValueError for them, e.g. an MLA pool in a layout
        other than page_first), and that is said at attach rather than as an exception in
        SGLang's I/O threads on every prefetch and backup.

        Raises:
            InvalidParams: the pool raised, or gave ranges that do not make this model's objects.
        """
        import torch

        probe = torch.arange(mem_pool_host.page_size, dtype=torch.int64)
        try:
            self._buffer_meta(["probe"], probe)
        except (ValueError, NotImplementedError, InvalidParams) as exc:
            layout = getattr(mem_pool_host, "layout", "?")
            raise InvalidParams(
                f"kvpool's SGLang backend cannot address the pages of {type(mem_pool_host).__name__} "
                f"(layout {layout}): {exc}"
            ) from None

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Take the KV pool that register_mem_pool_host gave; refuse a hybrid model's others.

        SGLang registers every host pool of its pool group here, the KV anchor included, at
        attach. The pages of the other pools (Mamba and SWA states, a DSA indexer, a draft
        model's KV) move with batch_exists_v2 / batch_get_v2 / batch_set_v2, which this
        backend lacks: HiCacheStorage's raise NotImplementedError in SGLang's storage threads
        on every prefetch and backup, and a backup stops there, before the KV pages.

        Raises:
            InvalidParams: a pool other than the one given to register_mem_pool_host.
        """
        if host_pool is not self.mem_pool_host:
            raise InvalidParams(
                f"kvpool's SGLang backend stores the KV pool only, not a hybrid model's {host_pool_name} pool yet"
            )
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def close(self) -> None:
        for address in self._registered:
            self._store.unregister_buffer(address)
        self._registered.clear()
        self._store.close()

    # --- keys ---------------------------------------------------------------------------------

    def _namespace(self, key: str) -> str:
        return f"{self._page_prefix}_{key}" if self._page_prefix else key

    def _object_keys(self, keys: Sequence[str]) -> list[str]:
        """The kvpool objects of each page, in page order: k (and v unless MLA)."""
        if self.is_mla:
            return [f"{self._namespace(k)}_{self._mla_suffix}_k" for k in keys]
        out = []
        for key in keys:
            base = f"{self._namespace(key)}_{self._mha_suffix}"
            out += [f"{base}_k", f"{base}_v"]
        return out

    @property
    def _objects_per_page(self) -> int:
        return 1 if self.is_mla else 2

    # --- v1: zero copy into the host pool -----------------------------------------------------

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading pages are in the pool (all their objects), in one round trip."""
        if not keys:
            return 0
        try:
            count = self._store.longest_prefix(self._object_keys(keys), self._lookup_hold_ms)
        except KVPoolError as exc:
            log.warning("kvpool batch_exists failed, reporting a miss: %s", exc)
            return 0
        return count // self._objects_per_page

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
        """Write pages straight from the host pool. A page already present is a success."""
        started = time.perf_counter()
        results = self._page_io(keys, host_indices, is_set=True)
        self._record(self._backup_pages, self._backup_bandwidth, keys, results, started)
        return results

    def _page_io(self, keys: list[str], host_indices: Any, is_set: bool) -> list[bool]:
        if not keys:
            return []
        if self.mem_pool_host is None:
            log.error("kvpool: page I/O before register_mem_pool_host")
            return [False] * len(keys)
        object_keys = self._object_keys(keys)
        try:
            addresses, sizes = self._buffer_meta(keys, host_indices)
            if is_set:
                codes = self._store.batch_put_from_multi_buffers(
                    object_keys, addresses, sizes, self._replicate
                )
                ok = [code in _PUT_OK for code in codes]
            else:
                read = self._store.batch_get_into_multi_buffers(object_keys, addresses, sizes)
                ok = [n == sum(s) for n, s in zip(read, sizes)]
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
        pointers, byte_sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if len(pointers) != len(byte_sizes) or len(pointers) % len(keys):
            raise InvalidParams(f"{len(pointers)} host ranges for {len(keys)} pages")
        per_page = len(pointers) // len(keys)
        addresses: list[list[int]] = []
        sizes: list[list[int]] = []
        for page in range(len(keys)):
            page_ptrs = pointers[page * per_page : (page + 1) * per_page]
            page_sizes = byte_sizes[page * per_page : (page + 1) * per_page]
            if self.is_mla:
                addresses.append(list(page_ptrs))
                sizes.append(list(page_sizes))
            else:
                if per_page % 2:
                    raise InvalidParams(f"MHA page with {per_page} ranges: K and V do not pair")
                addresses += [list(page_ptrs[0::2]), list(page_ptrs[1::2])]
                sizes += [list(page_sizes[0::2]), list(page_sizes[1::2])]
        return addresses, sizes

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
        """Write page tensors. True when every page is in the pool afterwards."""
        if not keys or values is None or len(values) != len(keys):
            return False
        return all(self._tensor_io(keys, list(values), is_set=True))

    def _tensor_io(self, keys: list[str], tensors: list[Any], is_set: bool) -> list[bool]:
        """Page tensors hold a whole page; with MHA the first half is K and the second V."""
        object_keys = self._object_keys(keys)
        addresses: list[list[int]] = []
        sizes: list[list[int]] = []
        registered: list[int] = []
        try:
            for tensor in tensors:
                if tensor is None or not tensor.is_contiguous() or tensor.device.type != "cpu":
                    raise InvalidParams("page tensors must be contiguous CPU tensors")
                start, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
                self._store.register_buffer(start, size)
                registered.append(start)
                if self.is_mla:
                    addresses.append([start])
                    sizes.append([size])
                else:
                    half = size // 2
                    addresses += [[start], [start + half]]
                    sizes += [[half], [size - half]]
            if is_set:
                codes = self._store.batch_put_from_multi_buffers(
                    object_keys, addresses, sizes, self._replicate
                )
                ok = [code in _PUT_OK for code in codes]
            else:
                read = self._store.batch_get_into_multi_buffers(object_keys, addresses, sizes)
                ok = [n == sum(s) for n, s in zip(read, sizes)]
        except KVPoolError as exc:
            log.warning("kvpool page tensor %s failed: %s", "set" if is_set else "get", exc)
            return [False] * len(keys)
        finally:
            for start in registered:
                self._store.unregister_buffer(start)
        per_page = self._objects_per_page
        return [all(ok[i * per_page : (i + 1) * per_page]) for i in range(len(keys))]

    # --- housekeeping -------------------------------------------------------------------------

    def clear(self) -> None:
        """Remove every object of this model's namespace (all ranks). Never raises."""
        pattern = f"^{re.escape(self._prefix)}_" if self._prefix else ".*"
        try:
            removed = self._store.remove_by_regex(pattern, force=True)
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
