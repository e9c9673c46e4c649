"""kvpool as an LMCache remote storage plugin (LMCache's `remote_storage_plugins`).

LMCache loads it by name, no patch to LMCache; in the LMCache config file (or LMCACHE_* env):

    chunk_size: 256
    local_cpu: true
    max_local_cpu_size: 5
    remote_storage_plugins: ["kvpool"]
    extra_config:
      remote_storage_plugin.kvpool.module_path: kvpool.integrations.lmcache
      remote_storage_plugin.kvpool.class_name: KVPoolConnectorAdapter
      kvpool.master: 10.0.0.1:50051
      # optional: kvpool.token_file, kvpool.embedded_memory (a size), kvpool.shm_enabled,
      # kvpool.replica_num, kvpool.lookup_hold_ms (how long a lookup's hits are held from
      # eviction for their retrieval, default 5000; 0 = none), kvpool.lookup_timeout_ms,
      # kvpool.lookup_backoff_ms_min, kvpool.lookup_backoff_ms_max (the lookups' own bound
      # on the master's answer and the breaker's window after one could not reach it,
      # default 1000, 1000 and 30000: breaker.py)

The adapter takes LMCache's plugin URLs only (`plugin://kvpool[.instance]`): LMCache 0.5.6
loads a plugin's adapter only for the names in `remote_storage_plugins`, so a `remote_url`
alone finds no adapter, and beside the plugin it builds a second remote backend (every chunk
written and looked up twice).

Each LMCache chunk is one kvpool object named by `CacheEngineKey.to_string()` (which carries
the model, world size, worker and chunk hash). With LMCache's default `save_chunk_meta`, the
object is LMCache's RemoteMetadata header followed by the chunk's bytes, as LMCache's own
Mooncake connector stores it, so partial chunks read back with their shapes; without it, only
the bytes, read straight into a buffer from LMCache's local CPU backend. Writes gather the
header and the chunk with the multi-buffer API (no concatenation copy).

The Store is synchronous and bounded; every call runs in a worker thread so LMCache's event
loop never blocks: puts on threads of their own (PUT_THREADS), the rest on the loop's default
executor, where puts queued behind a master or node that stopped answering had lookups and
reads wait 30 s. Operating errors become misses (None, False, 0) and
logged failed puts, never exceptions into LMCache. Lookups (`batched_contains`, `exists`) wait
lookup_timeout_ms at most: LMCache asks them inside vLLM's scheduler step, with no timeout of
its own around the synchronous ones, and after one could not reach the master the next ones
answer a miss without asking until a probe gets an answer (breaker.py). This module is not
used without LMCache.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import struct
import uuid
from collections.abc import Sequence
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend.connector import (
    ConnectorAdapter,
    ConnectorContext,
    extract_plugin_type,
)
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvpool.errors import KVPoolError
from kvpool.integrations.engine_options import SAVED_CODES, EngineOptions
from kvpool.integrations.host_memory import RefusedRegistrations

log = logging.getLogger(__name__)

# Threads of a connector's puts (its writes of chunks): apart from LMCache's lookups and reads.
PUT_THREADS = 2
PLUGIN_TYPE = "kvpool"
URL_SCHEME = "plugin://"


class KVPoolConnectorAdapter(ConnectorAdapter):
    """What `remote_storage_plugin.<name>.class_name` names: builds the connector for the
    plugin's URLs, `plugin://kvpool[.instance]`."""

    def __init__(self) -> None:
        super().__init__(URL_SCHEME)

    def can_parse(self, url: str) -> bool:
        return url.startswith(URL_SCHEME) and extract_plugin_type(url[len(URL_SCHEME) :]) == PLUGIN_TYPE

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        return KVPoolRemoteConnector(context.loop, context.local_cpu_backend, context.config, context.metadata)


class KVPoolRemoteConnector(RemoteConnector):
    """LMCache's RemoteConnector on a kvpool Store. Holds the Store and the local CPU backend
    that get() allocates chunks from."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        local_cpu_backend: Any,
        config: Any,
        metadata: Any,
    ) -> None:
        super().__init__(config, metadata)
        options = EngineOptions.read(config.extra_config, "LMCache's extra_config", prefix="kvpool.")
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self._store = options.open_store()
        self._replicate = options.replicate
        self._lookup_hold_ms = options.lookup_hold_ms
        self._lookup_timeout_ms = options.lookup_timeout_ms
        self._readers_of_each = _readers_of_each(config, metadata)
        # The health probe's object (_names): each connector's own, but where every worker reads
        # worker 0's chunks (an MLA model at TP > 1), which only worker 0 writes: theirs.
        is_shared = self._readers_of_each > 1
        self._probe_name = _HEALTH_PROBE_NAME if is_shared else f"{_HEALTH_PROBE_NAME}@probe:{uuid.uuid4().hex}"
        self._has_probed = False
        self._breaker = options.lookup_breaker("LMCache's lookups")
        self._putter = concurrent.futures.ThreadPoolExecutor(PUT_THREADS, thread_name_prefix="kvpool-lmcache-put")
        # Chunks whose registration the Store refused to drop (a cancelled get's disk read
        # still writes into them): given back to LMCache once it lets them go.
        self._refused = RefusedRegistrations(self._store)

    def __repr__(self) -> str:
        return f"<KVPoolRemoteConnector {self._store!r}>"

    # --- existence --------------------------------------------------------------------------

    def exists_sync(self, key: Any) -> bool:
        """A lookup of one chunk (a prefix of one key: bound and skipped as the others are)."""
        return self._lookup([key], 0) == 1

    async def exists(self, key: Any) -> bool:
        return await asyncio.to_thread(self.exists_sync, key)

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[Any]) -> int:
        """How many leading chunks are stored, in one round trip; they are held from eviction
        for the retrieval that follows (kvpool.lookup_hold_ms)."""
        return self._lookup(keys, self._lookup_hold_ms)

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: list[Any], pin: bool = False) -> int:
        """As batched_contains; LMCache's `pin` (keep the hits until they are retrieved) is
        the lookup hold."""
        return await asyncio.to_thread(self._lookup, keys, self._lookup_hold_ms if pin else 0)

    def _lookup(self, keys: list[Any], hold_ms: int) -> int:
        """How many leading chunks are stored; 0 when the master cannot be asked (breaker.py)."""
        if not keys:
            return 0
        names = self._names(keys)
        return self._breaker.ask(
            lambda: self._store.longest_prefix(names, hold_ms, self._readers_of_each, self._lookup_timeout_ms), 0,
            lambda exc: log.info("kvpool lookup failed, reporting a miss: %s", exc),
        )  # fmt: skip

    # --- reads ------------------------------------------------------------------------------

    async def get(self, key: Any) -> Any:
        return (await self.batched_get([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[Any]) -> list[Any]:
        """One MemoryObj per key (allocated from the local CPU backend), None for a miss.

        LMCache cancels a get that outlasts its blocking_timeout_secs, which does not stop
        the worker thread: the chunks that thread returns are nobody's, so they go back to
        the CPU backend as they arrive."""
        reading = asyncio.ensure_future(asyncio.to_thread(self._get_objects, keys))
        try:
            return await asyncio.shield(reading)
        except asyncio.CancelledError:
            reading.add_done_callback(_release_late_chunks)
            raise

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[Any]) -> list[Any]:
        """The leading run of chunks that could be read; later ones are released."""
        objects = await self.batched_get(keys)
        run = []
        for index, obj in enumerate(objects):
            if obj is None:
                for later in objects[index + 1 :]:
                    if later is not None:
                        later.ref_count_down()
                break
            run.append(obj)
        return run

    def _get_objects(self, keys: Sequence[Any]) -> list[Any]:
        self._refused.retry()
        if not keys:
            return []
        names = self._names(keys)
        if self.save_chunk_meta:
            try:
                values = self._store.get_batch(names)
            except KVPoolError as exc:
                log.info("kvpool get failed, reporting misses: %s", exc)
                return [None] * len(keys)
            objects: list[Any] = []
            try:
                for value in values:
                    objects.append(self._from_stored(value) if value is not None else None)
            except BaseException:  # the chunks read so far go back to LMCache's CPU backend
                for obj in objects:
                    if obj is not None:
                        obj.ref_count_down()
                raise
            return objects
        return self._get_into_full_chunks(names)

    def _from_stored(self, data: bytes) -> Any:
        """A MemoryObj from a stored header and chunk, or None (unreadable or no memory)."""
        header_size = self.remote_metadata_bytes
        if len(data) < header_size:
            return None
        try:
            meta = RemoteMetadata.deserialize(memoryview(data)[:header_size])
        except (ValueError, KeyError, struct.error) as exc:  # another writer's bytes (no header)
            log.warning("kvpool object of %d bytes has no LMCache chunk header, a miss: %s", len(data), exc)
            return None
        if meta.length != len(data) - header_size:
            log.warning("kvpool chunk of %d bytes, header says %d", len(data) - header_size, meta.length)
            return None
        if any(dtype is None for dtype in meta.dtypes) or any(d <= 0 for shape in meta.shapes for d in shape):
            log.warning("kvpool chunk header names no dtype or an empty shape: %s %s", meta.dtypes, meta.shapes)
            return None
        try:
            obj = self.local_cpu_backend.allocate(meta.shapes, meta.dtypes, meta.fmt)
        except (ValueError, RuntimeError, OverflowError) as exc:  # shapes no allocation can hold
            log.warning("kvpool chunk header's shapes %s cannot be allocated, a miss: %s", meta.shapes, exc)
            return None
        if obj is None or obj.raw_tensor is None:
            return None
        view = obj.raw_tensor.view(-1).view(torch.uint8)[: meta.length]
        if view.numel() != meta.length:  # shapes that hold fewer bytes than the header's length
            log.warning("kvpool chunk header says %d bytes, its shapes hold %d", meta.length, view.numel())
            obj.ref_count_down()
            return None
        view.numpy()[:] = memoryview(data)[header_size:]
        return obj

    def _get_into_full_chunks(self, names: list[str]) -> list[Any]:
        """Zero-copy reads of headerless chunks into freshly allocated full-chunk objects."""
        objects = [self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
                   for _ in names]  # fmt: skip
        usable = [i for i, obj in enumerate(objects) if obj is not None and obj.raw_tensor is not None]
        results: list[Any] = [None] * len(names)
        registered: list[int] = []
        try:
            for i in usable:
                self._store.register_buffer(objects[i].data_ptr, objects[i].get_size())
                registered.append(objects[i].data_ptr)
            read = self._store.batch_get_into(
                [names[i] for i in usable],
                [objects[i].data_ptr for i in usable],
                [objects[i].get_size() for i in usable],
            )
            for i, count in zip(usable, read):
                if count > 0:
                    try:
                        results[i] = self.reshape_partial_chunk(objects[i], count)
                    except ValueError as exc:  # not whole tokens: another model's object, say
                        log.warning("kvpool object %s is no chunk of this model, a miss: %s", names[i], exc)
        except KVPoolError as exc:
            log.info("kvpool get failed, reporting misses: %s", exc)
        finally:
            by_address = {objects[i].data_ptr: objects[i] for i in usable}
            stuck = {
                address
                for address in registered
                if not self._refused.unregister(address, by_address[address], by_address[address].ref_count_down)
            }
        for index, obj in enumerate(objects):
            if obj is None:
                continue
            if obj.data_ptr in stuck:  # a late write may still land in it: kept until it cannot
                results[index] = None
            elif results[index] is None:
                obj.ref_count_down()
        return results

    # --- writes -----------------------------------------------------------------------------

    async def put(self, key: Any, memory_obj: Any) -> None:
        await self.batched_put([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[Any], memory_objs: list[Any]) -> None:
        await asyncio.get_running_loop().run_in_executor(self._putter, self._put_objects, keys, memory_objs)

    def _names(self, keys: Sequence[Any]) -> list[str]:
        """The objects of LMCache's keys: `to_string()`, but for the health probe's (below)."""
        names = [key.to_string() for key in keys]
        return [self._probe_name if name == _HEALTH_PROBE_NAME else name for name in names]

    def _forget_health_probe(self) -> None:
        """LMCache's health check writes fresh bytes under one fixed key and wants them back
        (remote_backend_check.py): a put of a key stored already writes nothing (keys name
        their bytes), so once any worker had probed, every later probe read the first one's
        bytes and LMCache stayed off the pool until a restart. Each connector's probe is an
        object of its own (every worker probes at once after an outage: one's removal or put
        landed between another's put and get), removed before it is written again; but an MLA
        model's at TP > 1, where the other workers read worker 0's probe (its put alone is
        made), shared by the instance's workers (and with other instances: they may race)."""
        try:
            self._store.batch_remove([self._probe_name], force=True)
        except KVPoolError as exc:
            log.info("kvpool: LMCache's health probe was not removed before its put: %s", exc)

    def _put_objects(self, keys: Sequence[Any], memory_objs: Sequence[Any]) -> list[int]:
        """Store each chunk (header + bytes, or bytes), gathered without a copy. Returns the
        per-chunk codes; failures are logged (LMCache treats a lost put as a future miss)."""
        self._refused.retry()
        if not keys:
            return []
        headers = bytearray()
        addresses: list[list[int]] = []
        sizes: list[list[int]] = []
        registered: list[int] = []
        try:
            if self.save_chunk_meta:
                for obj in memory_objs:
                    headers += RemoteMetadata(obj.get_size(), obj.get_shapes(), obj.get_dtypes(),
                                              obj.get_memory_format()).serialize()  # fmt: skip
                registered.append(self._store.register_buffer(headers))
            for index, obj in enumerate(memory_objs):
                registered.append(self._store.register_buffer(obj.data_ptr, obj.get_size()))
                if self.save_chunk_meta:
                    header = registered[0] + index * self.remote_metadata_bytes
                    addresses.append([header, obj.data_ptr])
                    sizes.append([self.remote_metadata_bytes, obj.get_size()])
                else:
                    addresses.append([obj.data_ptr])
                    sizes.append([obj.get_size()])
            names = self._names(keys)
            if self._probe_name in names:
                self._forget_health_probe()
                self._has_probed = True
            codes = self._store.batch_put_from_multi_buffers(names, addresses, sizes, self._replicate)
        except KVPoolError as exc:
            log.warning("kvpool put of %d chunks failed: %s", len(keys), exc)
            return [int(exc.code)] * len(keys)
        finally:
            for address in registered:
                self._refused.unregister(address)  # retried if refused; the chunk is LMCache's
        failed = sum(code not in SAVED_CODES for code in codes)
        if failed:
            log.warning("kvpool put: %d of %d chunks failed", failed, len(codes))
        return codes

    # --- the rest ---------------------------------------------------------------------------

    def remove_sync(self, key: Any) -> bool:
        try:
            self._store.remove(self._names([key])[0], force=True)
        except KVPoolError:
            return False
        return True

    async def list(self) -> list[str]:
        """Stored keys (at most the Store's listing bound), [] when the pool is unreachable."""
        try:
            reply = await asyncio.to_thread(self._store.list_objects, "", 100_000)
        except KVPoolError as exc:
            log.info("kvpool list failed: %s", exc)
            return []
        return list(reply.keys)

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        try:
            await asyncio.to_thread(self._store.cluster_status)
        except KVPoolError as exc:
            return int(exc.code)
        return 0

    async def close(self) -> None:
        self._putter.shutdown(wait=False, cancel_futures=True)  # a put waiting on the pool ends with the store
        if self._has_probed and self._probe_name != _HEALTH_PROBE_NAME:  # its own probe: of use to no one now
            await asyncio.to_thread(self._forget_health_probe)
        await asyncio.to_thread(self._store.close)


def _release_late_chunks(reading: asyncio.Future) -> None:
    """The chunks of a get that LMCache cancelled, back to its CPU backend."""
    if reading.cancelled() or reading.exception() is not None:
        return
    for obj in reading.result():
        if obj is not None:
            obj.ref_count_down()


def _readers_of_each(config: Any, metadata: Any) -> int:
    """The workers that read each chunk a lookup finds, which its hold waits for: all of them
    for an MLA model at TP > 1, where every worker reads worker 0's chunks and only worker 0
    looks them up (LMCache's `remote_enable_mla_worker_id_as0`, on by default with MLA);
    before 2026-12-07 the hold ended with the first worker's read, and a chunk evicted before a
    later worker read it failed that worker's load (review helper-148)."""
    use_mla = bool(getattr(metadata, "use_mla", False))
    world_size = int(getattr(metadata, "world_size", 1) or 1)
    if use_mla and world_size > 1 and config.get_extra_config_value("remote_enable_mla_worker_id_as0", use_mla):
        return world_size
    return 1


# The object LMCache's health check writes and reads back (lmcache/v1/health_monitor/checks/
# remote_backend_check.py: model "test", chunk 0): each connector's own (_names).
_HEALTH_PROBE_NAME = CacheEngineKey(
    model_name="test", world_size=1, worker_id=0, chunk_hash=0, dtype=torch.bfloat16
).to_string()
