"""Mooncake Store's Python API (`mooncake.store`) on top of kvpool: change one import.

    # from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    from kvpool.integrations.mooncake_compat import MooncakeDistributedStore, ReplicateConfig

`MooncakeDistributedStore` has the method names, argument names, defaults and return
conventions of Mooncake's pybind class (mooncake-integration/store/store_py.cpp): writes return
0 or a negative `ErrorCode`, reads return bytes (`b""` on a miss), `is_exist` returns 1/0 or a
negative code, zero-copy reads return the bytes read or a negative code. This is the one place
where kvpool's exceptions become Mooncake's integer codes, and where `OBJECT_ALREADY_EXISTS` on
a put counts as success (Mooncake client_service.cpp, BatchPut: "If error == object already
exist, consider as ok"), since keys are content hashes.

It is not a reimplementation of Mooncake's transfer engine: `metadata_server`, `protocol`,
`rdma_devices` and `local_buffer_size` are accepted and ignored (kvpool moves bytes by a
same-host memcpy or TCP, and needs no staging buffer). `master_server_addr` is the kvpool
master; `global_segment_size > 0` contributes a segment of that size from this process
(kvpool's embedded mode, `ClientConfig.embedded_memory_bytes`). Tensors written by
`put_tensor` use kvpool's own small header, not Mooncake's `TensorMetadata` layout, so tensor
objects are not byte-compatible between the two stores (plain objects are). Read leases run
for the master's whole TTL as Mooncake's do: kvpool's own Store gives them back once a get is
done (`ClientConfig.release_leases`). As in Mooncake, lookups (`is_exist`, `get_size`, the
replica descriptors) lease what they find too; `batch_probe_key` does not.
"""

from __future__ import annotations

import ctypes
import enum
import json
import logging
import re
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpool.client.store import key_list
from kvpool.client.sync import Store
from kvpool.config import parse_size
from kvpool.errors import ErrorCode, InvalidParams, KVPoolError
from kvpool.protocol import objectfile
from kvpool.protocol.messages import (
    TIER_DFS,
    TIER_DISK,
    TIER_DRAM,
    GetReplicaList,
    GetReplicaListReply,
    SegmentInfo,
)
from kvpool.protocol.messages import ReplicateConfig as KVPoolReplicateConfig

log = logging.getLogger(__name__)

# Mooncake's health_check codes (store_py.cpp "Returns 0 if healthy, 1 if not
# initialized/closed, 2 if master unreachable").
HEALTH_OK = 0
HEALTH_NOT_INITIALIZED = 1
HEALTH_MASTER_UNREACHABLE = 2

# Mooncake's defaults for the dict form of setup() (real_client.cpp setup_internal(ConfigDict)).
SEGMENT_SIZE_BYTES_DEFAULT = 16 * 1024 * 1024
MASTER_SERVER_ADDR_DEFAULT = "127.0.0.1:50051"
CLIENT_HTTP_PORT_DEFAULT = 9300

OK = int(ErrorCode.OK)
INVALID_PARAMS = int(ErrorCode.INVALID_PARAMS)


class SoftPinAction(enum.IntEnum):
    """Mooncake's soft-pin transition for a put (store_py.cpp `SoftPinAction`)."""

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ReplicateConfig:
    """Mooncake's `ReplicateConfig`: the same read-write attributes and defaults.

    kvpool honours `replica_num`, `with_hard_pin`, soft pinning (`soft_pin_action=ENABLE`, or
    the older `with_soft_pin=True`), `preferred_segment(s)` and `prefer_alloc_in_same_node`.
    The NVMe-oF, DFS, group and data-type fields are kept for compatibility and ignored.
    """

    def __init__(self) -> None:
        self.replica_num: int = 1
        self.nof_replica_num: int = 0
        self.dfs_replica_num: int = 0
        self.soft_pin_action: SoftPinAction = SoftPinAction.PRESERVE
        self.soft_pin_ttl_ms: int | None = None
        self.with_soft_pin: bool = False
        self.with_hard_pin: bool = False
        self.preferred_segments: list[str] = []
        self.preferred_nof_segments: list[str] = []
        self.preferred_segment: str = ""
        self.prefer_alloc_in_same_node: bool = False
        self.data_type: int = 0
        self.group_ids: list[str] | None = None

    def __str__(self) -> str:
        return (
            f"ReplicateConfig: {{ replica_num: {self.replica_num}, "
            f"soft_pin_action: {self.soft_pin_action.name}, "
            f"with_hard_pin: {int(self.with_hard_pin)}, "
            f"preferred_segments: {self.preferred_segments}, "
            f"preferred_segment: {self.preferred_segment!r}, "
            f"prefer_alloc_in_same_node: {int(self.prefer_alloc_in_same_node)} }}"
        )


class ReplicaStatus(enum.IntEnum):
    """Mooncake's replica states (store_py.cpp `ReplicaStatus`). kvpool describes only complete
    objects, so its descriptors are always COMPLETE."""

    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class Descriptor:
    """Mooncake's buffer `Descriptor`: where a DRAM replica lies. `transport_endpoint` is the
    node's transfer server "host:port"; `buffer_address` is the replica's offset in its
    segment (in Mooncake, an address in the process that holds the segment)."""

    def __init__(self, size: int = 0, buffer_address: int = 0, transport_endpoint: str = "") -> None:
        self.size = size
        self.buffer_address = buffer_address
        self.transport_endpoint = transport_endpoint

    def __repr__(self) -> str:
        return (f"<Descriptor size={self.size} buffer_address={self.buffer_address} "
                f"transport_endpoint={self.transport_endpoint}>")  # fmt: skip


class MemoryDescriptor:
    """Mooncake's `MemoryDescriptor`: one DRAM replica's buffer."""

    def __init__(self, buffer_descriptor: Descriptor) -> None:
        self.buffer_descriptor = buffer_descriptor


class DiskDescriptor:
    """Mooncake's `DiskDescriptor`: a replica in a file on the shared filesystem."""

    def __init__(self, file_path: str, object_size: int) -> None:
        self.file_path = file_path
        self.object_size = object_size


class ReplicaDescriptor:
    """Mooncake's `ReplicaDescriptor`, for one kvpool replica: a DRAM replica is a memory
    replica, one on a node's disk tier a local-disk replica, one on the DFS tier a disk
    replica (Mooncake's replica in a file on shared storage, with its path). The getter of
    another kind raises RuntimeError, as Mooncake's does."""

    def __init__(self, tier: str, detail: MemoryDescriptor | DiskDescriptor | None) -> None:
        self._tier = tier
        self._detail = detail
        self.status = ReplicaStatus.COMPLETE

    def __repr__(self) -> str:
        return f"<ReplicaDescriptor {self._tier} {self.status.name}>"

    def is_memory_replica(self) -> bool:
        return self._tier == TIER_DRAM

    def is_disk_replica(self) -> bool:
        return self._tier == TIER_DFS

    def is_local_disk_replica(self) -> bool:
        return self._tier == TIER_DISK

    def get_memory_descriptor(self) -> MemoryDescriptor:
        if not isinstance(self._detail, MemoryDescriptor):
            raise RuntimeError("Expected MemoryDescriptor")
        return self._detail

    def get_disk_descriptor(self) -> DiskDescriptor:
        if not isinstance(self._detail, DiskDescriptor):
            raise RuntimeError("Expected DiskDescriptor")
        return self._detail


class BufferHandle(bytearray):
    """What `get_buffer` returns: the object's bytes, with Mooncake's `ptr()` and `size()`.

    A bytearray, so it has the buffer protocol (`np.array(handle, copy=False)`, memoryview);
    the memory belongs to the handle and lives as long as it does.
    """

    def ptr(self) -> int:
        if not self:
            return 0
        return ctypes.addressof(ctypes.c_char.from_buffer(self))

    def size(self) -> int:
        return len(self)


class MooncakeDistributedStore:
    """A kvpool client that speaks Mooncake Store's Python API. Thread-safe once set up.

    Holds one `kvpool.Store` (None before `setup` and after `close`). Every method returns
    what Mooncake's returns; none raises for an operating error. Argument errors that pybind11
    would reject (a missing positional argument) raise TypeError, as there.
    """

    def __init__(self) -> None:
        self._store: Store | None = None
        self._local_hostname = ""
        self._segment_name = ""  # "host:port" of our embedded segment, Mooncake's segment name
        self._segment_id = ""  # kvpool's id of that segment

    def __repr__(self) -> str:
        return f"<MooncakeDistributedStore {self._store!r}>"

    # --- lifecycle ------------------------------------------------------------------------

    def setup(self, *args: Any, **kwargs: Any) -> int:
        """Connect, in either of Mooncake's two forms. Returns 0 or a negative ErrorCode.

        Positional form (every argument through `master_server_addr` required, as in
        store_py.cpp):
            setup(local_hostname, metadata_server, global_segment_size, local_buffer_size,
                  protocol, rdma_devices, master_server_addr, engine=None,
                  enable_ssd_offload=False, ssd_offload_path="", tenant_id="default",
                  enable_client_http_server=False, client_http_port=9300)
        Dict form: setup({"local_hostname": ..., "metadata_server": ..., ...}); the other
        keys default to 16 MiB segment and buffer, "tcp", "" and "127.0.0.1:50051". Values
        may be strings ("1GB"), as Mooncake converts every value with str().

        kvpool needs only `master_server_addr` and `global_segment_size` (0 = a pure client,
        > 0 = contribute that much memory from this process). A non-default `tenant_id` is
        refused (INVALID_PARAMS): kvpool has no tenants, and silently sharing one namespace
        would let tenants read each other's objects.
        """
        if len(args) + len(kwargs) == 1 and (
            (args and isinstance(args[0], dict)) or isinstance(kwargs.get("config"), dict)
        ):
            return self._setup_from_dict(args[0] if args else kwargs["config"])
        return self._setup_positional(*args, **kwargs)

    def _setup_positional(
        self,
        local_hostname: str,
        metadata_server: str,
        global_segment_size: int,
        local_buffer_size: int,
        protocol: str,
        rdma_devices: str,
        master_server_addr: str,
        engine: object = None,
        enable_ssd_offload: bool = False,
        ssd_offload_path: str = "",
        tenant_id: str = "default",
        enable_client_http_server: bool = False,
        client_http_port: int = CLIENT_HTTP_PORT_DEFAULT,
    ) -> int:
        if engine is not None:
            log.error("setup: kvpool has no Mooncake TransferEngine to reuse; pass engine=None")
            return INVALID_PARAMS
        return self._connect(
            local_hostname, int(global_segment_size), protocol, master_server_addr, tenant_id
        )

    def _setup_from_dict(self, config: dict) -> int:
        values = {str(k): str(v) for k, v in config.items()}
        local_hostname = values.get("local_hostname", "")
        if not local_hostname or not values.get("metadata_server", ""):
            log.error("setup: local_hostname and metadata_server are required")
            return INVALID_PARAMS
        try:
            segment_bytes = parse_size(
                values.get("global_segment_size", str(SEGMENT_SIZE_BYTES_DEFAULT))
            )
            parse_size(values.get("local_buffer_size", str(SEGMENT_SIZE_BYTES_DEFAULT)))
        except InvalidParams as exc:
            log.error("setup: %s", exc)
            return INVALID_PARAMS
        return self._connect(
            local_hostname,
            segment_bytes,
            values.get("protocol", "tcp"),
            values.get("master_server_addr", MASTER_SERVER_ADDR_DEFAULT),
            values.get("tenant_id", "default"),
        )

    def _connect(
        self, local_hostname: str, segment_bytes: int, protocol: str, master: str, tenant_id: str
    ) -> int:
        if not local_hostname or segment_bytes < 0:
            log.error("setup: local_hostname is empty or global_segment_size is negative")
            return INVALID_PARAMS
        if tenant_id != "default":
            log.error("setup: kvpool has no tenants; tenant_id %r refused", tenant_id)
            return INVALID_PARAMS
        if protocol != "tcp":
            log.info("setup: protocol %r requested; kvpool uses same-host memcpy or TCP", protocol)
        self.close()
        try:
            # Leases held for their whole TTL, as Mooncake's: a remove right after a get is
            # refused with OBJECT_HAS_LEASE there too (tests/test_mooncake_conformance.py).
            self._store = Store(master, embedded_memory_bytes=segment_bytes, release_leases=False)
        except KVPoolError as exc:
            # Mooncake answers INVALID_PARAMS when its client cannot be created, a master that
            # cannot be reached included (real_client.cpp setup_internal "Failed to create
            # client").
            log.error("setup: cannot reach kvpool master %s: %s", master, exc)
            return INVALID_PARAMS
        self._local_hostname = local_hostname
        segment = self._store.embedded_segment
        if segment is not None:
            port = segment.endpoint.rsplit(":", 1)[1]
            self._segment_name = f"{_host_part(local_hostname)}:{port}"
            self._segment_id = segment.segment_id
        return OK

    def close(self) -> int:
        """Disconnect (and withdraw the embedded segment). Returns 0; closing twice is fine."""
        store, self._store = self._store, None
        self._segment_name = self._segment_id = ""
        if store is None:
            return OK
        try:
            store.close()
        except KVPoolError as exc:
            log.warning("close: %s", exc)
            return int(exc.code)
        return OK

    def health_check(self) -> int:
        """0 healthy, 1 not set up or closed, 2 master unreachable (Mooncake's codes)."""
        if self._store is None:
            return HEALTH_NOT_INITIALIZED
        try:
            self._store.cluster_status()
        except KVPoolError:
            return HEALTH_MASTER_UNREACHABLE
        return HEALTH_OK

    def get_hostname(self) -> str:
        """This client's segment name, "host:port" as in Mooncake, when it contributes memory;
        else the local_hostname given to setup ("" before setup)."""
        return self._segment_name or self._local_hostname

    # --- bytes API ------------------------------------------------------------------------

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        return self._put_codes([key], [_bytes_view(value)], config)[0]

    def put_batch(
        self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None
    ) -> int:
        """0, or the first key's error code (Mooncake returns one int for the batch)."""
        if len(keys) != len(values):
            return INVALID_PARAMS
        codes = self._put_codes(keys, [_bytes_view(v) for v in values], config)
        return next((c for c in codes if c != OK), OK)

    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """Store the concatenation of `parts` as one object."""
        views = [_bytes_view(p) for p in parts]
        if any(v.ndim != 1 or v.itemsize != 1 for v in views):
            raise RuntimeError("parts must be 1-D bytes-like")  # as store_py.cpp
        return self._put_codes([key], [b"".join(views)], config)[0]

    def get(self, key: str) -> bytes:
        """The object's bytes, or b"" on a miss or any error."""
        return self.get_batch([key])[0]

    def get_batch(self, keys: list[str]) -> list[bytes]:
        """One bytes per key, b"" for each miss."""
        if self._store is None:
            return [b""] * len(keys)
        try:
            return [v if v is not None else b"" for v in self._store.get_batch(keys)]
        except KVPoolError as exc:
            log.info("get_batch failed: %s", exc)
            return [b""] * len(keys)

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The object in a `BufferHandle`, or None on a miss."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: list[str]) -> list[BufferHandle | None]:
        if self._store is None:
            return [None] * len(keys)
        try:
            values = self._store.get_batch(keys)
        except KVPoolError as exc:
            log.info("batch_get_buffer failed: %s", exc)
            return [None] * len(keys)
        return [BufferHandle(v) if v is not None else None for v in values]

    # --- metadata API ---------------------------------------------------------------------

    def is_exist(self, key: str) -> int:
        """1 present, 0 absent, a negative ErrorCode on error. An object found is under a
        read lease afterwards (_leased_lookup)."""
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        """Per key 1 present (then under a read lease: _leased_lookup), 0 absent or still
        being put, or a negative ErrorCode. vLLM's Mooncake store connector looks a prompt up
        with it and counts on the lease to keep what it found until its load."""
        if self._store is None:
            return [INVALID_PARAMS] * len(keys)
        try:
            reply = self._leased_lookup(keys)
        except KVPoolError as exc:
            return [int(exc.code)] * len(keys)
        return [1 if code == OK else 0 for code in reply.codes]

    def batch_probe_key(self, keys: list[str]) -> list[int]:
        """batch_is_exist without the read lease: an existence check that keeps nothing from
        eviction (Mooncake's BatchProbeKey, added after 0.3.13; vLLM's Mooncake store connector
        probes with it under VLLM_MOONCAKE_STORE_SELECTIVE_LEASE, then leases only the keys
        its hit loads with batch_is_exist)."""
        if self._store is None:
            return [INVALID_PARAMS] * len(keys)
        try:
            return [1 if flag else 0 for flag in self._store.batch_exists(keys)]
        except KVPoolError as exc:
            return [int(exc.code)] * len(keys)

    def get_size(self, key: str) -> int:
        """Size in bytes, or a negative ErrorCode (OBJECT_NOT_FOUND for a miss, and for an
        object still being put, as is_exist says it is absent). The object found is under a
        read lease afterwards (_leased_lookup)."""
        if self._store is None:
            return INVALID_PARAMS
        try:
            reply = self._leased_lookup([key])
        except KVPoolError as exc:
            return int(exc.code)
        code = reply.codes[0]
        if code == ErrorCode.REPLICA_IS_NOT_READY:
            return int(ErrorCode.OBJECT_NOT_FOUND)
        return reply.sizes[0] if code == OK else int(code)

    def _leased_lookup(self, keys: Sequence[str]) -> GetReplicaListReply:
        """Where each key's replicas lie, each object found put under a read lease of the
        master's TTL, as a get's lookup is. Mooncake's is_exist, get_size and replica
        descriptors take one (master_service.cpp ExistKey: "Grant a lease to the object as it
        may be further used by the client"; GetReplicaList likewise): a remove right after
        is refused with OBJECT_HAS_LEASE, and eviction skips the object until its load. The
        lease lapses at its TTL, as this Store's gets' do (release_leases=False). kvpool's
        Store has no public call for this (its exists and query take no lease, so that its
        checks never keep objects from eviction): it asks the master what a get asks.

        Raises:
            KVPoolError: the master's or the connection's.
        """
        assert self._store is not None, "_leased_lookup before setup"
        reply = self._store._ask(GetReplicaList(key_list(keys)))
        assert isinstance(reply, GetReplicaListReply), reply
        return reply

    def get_replica_desc(self, key: str) -> list[ReplicaDescriptor]:
        """Where the object's replicas lie; [] on a miss or an error, as in Mooncake."""
        return self.batch_get_replica_desc([key]).get(key, [])

    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[ReplicaDescriptor]]:
        """The replica descriptors of each key found, then under a read lease
        (_leased_lookup); a key not found (or every key, on an error) is left out, as in
        Mooncake. One master round trip: its answer says where the replicas' segments are."""
        if self._store is None or not keys:
            return {}
        try:
            reply = self._leased_lookup(keys)
        except KVPoolError as exc:
            log.info("batch_get_replica_desc failed: %s", exc)
            return {}
        found: dict[str, list[ReplicaDescriptor]] = {}
        for key, code, size, replicas in zip(keys, reply.codes, reply.sizes, reply.replicas):
            if code == OK:
                found[key] = [
                    _replica_descriptor(key, size, replica.offset, reply.segments[replica.segment_id])
                    for replica in replicas
                ]
        return found

    def remove(self, key: str, force: bool = False) -> int:
        """0, OBJECT_NOT_FOUND, or OBJECT_HAS_LEASE while a reader holds it (unless force)."""
        return self.batch_remove([key], force)[0]

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        if self._store is None:
            return [INVALID_PARAMS] * len(keys)
        try:
            return [int(c) for c in self._store.batch_remove(keys, force)]
        except KVPoolError as exc:
            return [int(exc.code)] * len(keys)

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """How many objects were removed, or a negative ErrorCode."""
        return self._count(lambda store: store.remove_by_regex(regex_pattern, force))

    def remove_all(self, force: bool = False) -> int:
        """How many objects were removed, or a negative ErrorCode."""
        return self._count(lambda store: store.remove_all(force))

    # --- zero-copy API --------------------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Register `size` bytes at address `buffer_ptr` for the zero-copy calls. 0 or a code."""
        if self._store is None:
            return INVALID_PARAMS
        try:
            self._store.register_buffer(int(buffer_ptr), int(size))
        except KVPoolError as exc:
            return int(exc.code)
        return OK

    def unregister_buffer(self, buffer_ptr: int) -> int:
        if self._store is None:
            return INVALID_PARAMS
        try:
            self._store.unregister_buffer(int(buffer_ptr))
        except KVPoolError as exc:
            return int(exc.code)
        return OK

    def put_from(
        self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None
    ) -> int:
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Bytes read into registered memory, or a negative ErrorCode."""
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_put_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        return self.batch_put_from_multi_buffers(
            keys, [[p] for p in buffer_ptrs], [[s] for s in sizes], config
        )

    def batch_get_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]:
        return self.batch_get_into_multi_buffers(
            keys, [[p] for p in buffer_ptrs], [[s] for s in sizes]
        )

    def batch_put_from_multi_buffers(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """Per key 0 or a negative ErrorCode; each object gathered from several buffers.
        Lists of different lengths are INVALID_PARAMS for every key, as in Mooncake."""
        if self._store is None or not len(keys) == len(all_buffer_ptrs) == len(all_sizes):
            return [INVALID_PARAMS] * len(keys)
        first = _first_indexes(keys)
        try:
            codes = self._store.batch_put_from_multi_buffers(
                [keys[i] for i in first], [all_buffer_ptrs[i] for i in first],
                [all_sizes[i] for i in first], self._kvpool_config(config),
            )  # fmt: skip
        except KVPoolError as exc:
            return [int(exc.code)] * len(keys)
        return _spread(keys, first, codes)

    def batch_get_into_multi_buffers(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        prefer_alloc_in_same_node: bool = False,
    ) -> list[int]:
        """Per key the bytes read (scattered over its buffers in order) or a negative code.
        `prefer_alloc_in_same_node` is accepted for compatibility; kvpool always reads the
        nearest replica."""
        if self._store is None:
            return [INVALID_PARAMS] * len(keys)
        try:
            codes = self._store.batch_get_into_multi_buffers(keys, all_buffer_ptrs, all_sizes)
        except KVPoolError as exc:
            return [_get_code(exc.code)] * len(keys)
        return [_get_code(c) for c in codes]

    # --- tensor API (torch imported on first use) -------------------------------------------

    def put_tensor(self, key: str, tensor: Any) -> int:
        return self.batch_put_tensor([key], [tensor])[0]

    def get_tensor(self, key: str) -> Any:
        """The tensor (on the CPU), or None on a miss."""
        return self.batch_get_tensor([key])[0]

    def batch_put_tensor(self, keys: list[str], tensors_list: list[Any]) -> list[int]:
        if len(keys) != len(tensors_list):
            return [INVALID_PARAMS] * len(keys)
        encoded = [encode_tensor(t) for t in tensors_list]
        return self._put_codes(keys, encoded, None)

    def batch_get_tensor(self, keys: list[str]) -> list[Any]:
        """One tensor per key, None for a miss or an object that is not a kvpool tensor."""
        results = []
        for value in self.get_batch(keys):
            results.append(decode_tensor(value) if value else None)
        return results

    # --- shared -----------------------------------------------------------------------------

    def _put_codes(
        self, keys: Sequence[str], values: Sequence[Any], config: ReplicateConfig | None
    ) -> list[int]:
        if self._store is None:
            return [INVALID_PARAMS] * len(keys)
        if any(memoryview(v).nbytes == 0 for v in values):
            # Mooncake refuses a batch with an empty value before writing any of it
            # (real_client.cpp put_batch_internal: "Failed to allocate buffer").
            return [INVALID_PARAMS] * len(keys)
        first = _first_indexes(keys)
        try:
            codes = self._store.put_batch(
                [keys[i] for i in first], [values[i] for i in first], self._kvpool_config(config)
            )
        except KVPoolError as exc:
            return [int(exc.code)] * len(keys)
        return _spread(keys, first, codes)

    def _count(self, call: Any) -> int:
        if self._store is None:
            return INVALID_PARAMS
        try:
            return int(call(self._store))
        except KVPoolError as exc:
            return int(exc.code)

    def _kvpool_config(self, config: ReplicateConfig | None) -> KVPoolReplicateConfig | None:
        """Mooncake's placement fields in kvpool's terms. A preferred segment is named as in
        Mooncake ("host:port" from get_hostname) or by its kvpool segment id."""
        if config is None:
            return None
        preferred = [s for s in [config.preferred_segment, *config.preferred_segments] if s]
        preferred = [self._segment_id if s == self._segment_name else s for s in preferred]
        placement = "random"
        if preferred:
            placement = "preferred"
        elif config.prefer_alloc_in_same_node:
            placement = "local"
        return KVPoolReplicateConfig(
            replica_num=config.replica_num,
            with_soft_pin=config.with_soft_pin or config.soft_pin_action == SoftPinAction.ENABLE,
            with_hard_pin=config.with_hard_pin,
            placement=placement,
            preferred_segments=preferred,
        )


def _put_code(code: int) -> int:
    # Keys are content hashes: an object that exists already is the object we meant to write.
    return OK if code == ErrorCode.OBJECT_ALREADY_EXISTS else int(code)


def _first_indexes(keys: Sequence[str]) -> list[int]:
    """The index of each key's first occurrence. Mooncake stores a key repeated within one
    batch once, from its first value, and reports success for every occurrence."""
    seen: dict[str, int] = {}
    for index, key in enumerate(keys):
        seen.setdefault(key, index)
    return sorted(seen.values())


def _spread(keys: Sequence[str], first: list[int], codes: Sequence[int]) -> list[int]:
    """Per key of the batch, the put code of its first occurrence."""
    by_key = {keys[i]: _put_code(code) for i, code in zip(first, codes)}
    return [by_key[key] for key in keys]


def _replica_descriptor(key: str, size: int, offset: int, segment: SegmentInfo) -> ReplicaDescriptor:
    if segment.tier == TIER_DRAM:
        return ReplicaDescriptor(TIER_DRAM, MemoryDescriptor(Descriptor(size, offset, segment.endpoint)))
    if segment.tier == TIER_DFS:
        # The master's path of the DFS directory: the same on every host (docs/tiers.md).
        path = Path(segment.shm_path) / objectfile.dfs_relative_path(key, offset)
        return ReplicaDescriptor(TIER_DFS, DiskDescriptor(str(path), size))
    return ReplicaDescriptor(segment.tier, None)


def _get_code(code: int) -> int:
    # Mooncake answers INVALID_PARAMS, not BUFFER_OVERFLOW, for a buffer smaller than the
    # object (real_client.cpp batch_get_into: "Buffer too small for key").
    return INVALID_PARAMS if code == ErrorCode.BUFFER_OVERFLOW else int(code)


def _bytes_view(value: Any) -> memoryview:
    view = memoryview(value)
    return view if view.contiguous else memoryview(view.tobytes())


def _host_part(hostname: str) -> str:
    match = re.fullmatch(r"(.*?)(?::\d+)?", hostname)
    assert match is not None, hostname
    return match.group(1)




# --- tensor objects ---------------------------------------------------------------------------
#
#   +-------+---------------+------------------------------+-------------------+
#   | magic | header_size   | header: JSON {dtype, shape}  | tensor bytes      |
#   | KVPT  | u32 LE        | header_size bytes            | numel * itemsize  |
#   +-------+---------------+------------------------------+-------------------+

TENSOR_MAGIC = b"KVPT"
_TENSOR_PREFIX = struct.Struct("<4sI")


def encode_tensor(tensor: Any) -> bytes:
    """A CPU copy of `tensor` as one object: the header above, then its raw bytes."""
    import torch

    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    header = json.dumps(
        {"dtype": str(flat.dtype).removeprefix("torch."), "shape": list(tensor.shape)}
    ).encode()
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return _TENSOR_PREFIX.pack(TENSOR_MAGIC, len(header)) + header + raw


def decode_tensor(data: bytes) -> Any:
    """The tensor `encode_tensor` wrote, or None if `data` is not one."""
    import torch

    if len(data) < _TENSOR_PREFIX.size:
        return None
    magic, header_size = _TENSOR_PREFIX.unpack_from(data)
    if magic != TENSOR_MAGIC or _TENSOR_PREFIX.size + header_size > len(data):
        return None
    header = json.loads(data[_TENSOR_PREFIX.size : _TENSOR_PREFIX.size + header_size])
    dtype = getattr(torch, header["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        return None
    raw = bytearray(data[_TENSOR_PREFIX.size + header_size :])
    if not raw:
        return torch.empty(header["shape"], dtype=dtype)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(header["shape"])
