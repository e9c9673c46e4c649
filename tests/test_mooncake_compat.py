"""kvpool's Mooncake-compatible API (kvpool.integrations.mooncake_compat) on a real local cluster.

How: a LocalCluster master (and nodes where a test needs them) as real processes on loopback,
driven through `MooncakeDistributedStore` exactly as Mooncake's own client is driven. The main
test runs the conformance sequence of scripts/mooncake_conformance.py and compares every return
value with the values the real Mooncake Store (mooncake-transfer-engine-non-cuda 0.3.13.post1,
TCP, P2PHANDSHAKE) returned for the same sequence, recorded below; test_mooncake_conformance.py
re-runs Mooncake live when it is installed. The other tests cover what a sequence cannot:
setup failures, a master that dies, placement translation and the dict form's parsing.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import removed_as_released

from kvpool import ErrorCode, Store
from kvpool.integrations.mooncake_compat import (
    BufferHandle,
    MooncakeDistributedStore,
    ReplicaStatus,
    ReplicateConfig,
    SoftPinAction,
    decode_tensor,
    encode_tensor,
)
from kvpool.protocol.messages import ReplicateConfig as KVPoolReplicateConfig

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "mooncake_conformance.py"
SEGMENT_SIZE_BYTES = 16 << 20

# What the real Mooncake Store returned for run_sequence(), normalized (scripts/mooncake_conformance.py
# --json). Regenerate with that script when the sequence changes.
MOONCAKE_VALUES = [
    ('health_check before setup', 1),
    ('setup positional', 0),
    ('health_check', 0),
    ('get_hostname is host:port', True),
    ('put', 0),
    ('put same again', 0),
    ('put other bytes, same key', 0),
    ('get', {'bytes': '68656c6c6f'}),
    ('get absent', {'bytes': ''}),
    ('put_batch', 0),
    ('get_batch', [{'bytes': '31'}, {'bytes': ''}, {'bytes_len': 102400, 'sha256': '27783e87963a4efb'}]),
    ('put_parts', 0),
    ('get put_parts', {'bytes': '616263646566'}),
    ('put empty value', -600),
    ('put bytearray', 0),
    ('put numpy', 0),
    ('get numpy', {'bytes': '00010203040506070809'}),
    ('is_exist', 1),
    ('is_exist absent', 0),
    ('batch_is_exist', [1, 0, 1]),
    ('get_size', 102400),
    ('get_size absent', -704),
    ('get_replica_desc', [[True, False, False, 3]]),
    ('get_replica_desc buffer', [102400, True]),
    ('get_disk_descriptor of a memory replica', 'Expected DiskDescriptor'),
    ('get_replica_desc absent', []),
    ('batch_get_replica_desc', [['k/a', 1], ['k/c', 1]]),
    ('batch_get_replica_desc of no keys', []),
    ('ReplicateConfig defaults', [1, False, '', [], False]),
    ('put with config', 0),
    ('put preferring own segment', 0),
    ('put hard pinned', 0),
    ('get_batch configured', [
        {'bytes_len': 100, 'sha256': 'bdcdc9e9204fe209'},
        {'bytes_len': 100, 'sha256': 'abd3b172acc3c31e'},
        {'bytes_len': 100, 'sha256': '17c0dab46c66cd1a'},
    ]),
    ('remove under lease', -706),
    ('remove force', 0),
    ('remove absent', -704),
    ('is_exist removed', 0),
    ('batch_remove', [0, -704]),
    ('put never read', 0),
    ('remove never read', 0),
    ('register_buffer source', 0),
    ('register_buffer target', 0),
    ('put_from', 0),
    ('get_into', 4096),
    ('get_into bytes', True),
    ('get_into absent', -704),
    ('batch_put_from', [0, 0]),
    ('batch_get_into', [1000, 2000, -704]),
    ('batch_get_into bytes', [True, True]),
    ('batch_put_from_multi_buffers', [0, 0]),
    ('batch_get_into_multi_buffers', [600, 64, -704]),
    ('batch_get_into_multi_buffers bytes', [True, True, True, True]),
    ('get of a multi-buffer object', True),
    ('register_buffer small', 0),
    ('get_into too small a buffer', -600),
    ('batch_get_into too small a buffer', [-600, 1000]),
    ('unregister_buffer small', 0),
    ('unregister_buffer source', 0),
    ('unregister_buffer target', 0),
    ('get_buffer', [4096, 4096, True]),
    ('get_buffer ptr', True),
    ('get_buffer numpy', 4096),
    ('get_buffer absent', None),
    ('batch_get_buffer', [1000, None]),
    ('put_tensor', 0),
    ('get_tensor', ['torch.float32', [3, 4], True]),
    ('get_tensor absent', None),
    ('batch_put_tensor', [0, 0]),
    ('batch_get_tensor', [['torch.bfloat16', True], None, ['torch.int64', True]]),
    ('get_batch of no keys', [{'bytes': ''}]),
    ('batch_is_exist of no keys', []),
    ('batch_remove of no keys', []),
    ('put_batch of no keys', 0),
    ('remove_by_regex under lease', 0),
    ('put_batch with a repeated key', 0),
    ('get repeated key', {'bytes': '6f6e65'}),
    ('remove_by_regex', 3),
    ('batch_is_exist after regex', [0, 0, 1]),
    ('remove_all', 13),
    ('is_exist after remove_all', [0, 0]),
    ('close', 0),
    ('health_check after close', 1),
    ('close again', 0),
    ('setup dict', 0),
    ('dict put', 0),
    ('dict get', {'bytes': '6469637420666f726d'}),
    ('dict close', 0),
    ('setup dict missing metadata_server', -600),
    ('setup dict bad size', -600),
]


def load_script():
    spec = importlib.util.spec_from_file_location("mooncake_conformance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def setup_store(master: str, segment_size: int = SEGMENT_SIZE_BYTES) -> MooncakeDistributedStore:
    store = MooncakeDistributedStore()
    code = store.setup("127.0.0.1", "P2PHANDSHAKE", segment_size, 16 << 20, "tcp", "", master)
    assert code == 0
    return store


def test_sequence_matches_recorded_mooncake_values(make_cluster):
    pytest.importorskip("torch", reason="put_tensor/get_tensor need torch (pip install torch==2.13.0)")
    script = load_script()
    cluster = make_cluster(0)
    values = script.run_sequence(MooncakeDistributedStore, ReplicateConfig, cluster.master_endpoint)
    assert script.compare(MOONCAKE_VALUES, values) == []


def test_pure_client_and_storage_nodes(make_cluster):
    """global_segment_size=0: a pure client, objects land on the cluster's nodes."""
    cluster = make_cluster(2, "8MiB")
    store = setup_store(cluster.master_endpoint, segment_size=0)
    try:
        assert store.get_hostname() == "127.0.0.1"  # no segment of its own: no port
        config = ReplicateConfig()
        config.replica_num = 2
        assert store.put("two", b"x" * 1000, config) == 0
        assert store.get("two") == b"x" * 1000
        assert store.health_check() == 0
    finally:
        assert store.close() == 0


def test_preferred_segment_is_the_embedded_segment(make_cluster):
    """Mooncake's idiom config.preferred_segment = store.get_hostname() places on our segment."""
    cluster = make_cluster(2, "8MiB")
    store = setup_store(cluster.master_endpoint)
    try:
        config = ReplicateConfig()
        config.preferred_segment = store.get_hostname()
        keys = [f"pref/{i}" for i in range(8)]
        for key in keys:
            assert store.put(key, b"p" * 4096, config) == 0
        reply = store._store.query(keys)
        segment_ids = {replicas[0].segment_id for replicas in reply.replicas}
        assert segment_ids == {store._segment_id}
    finally:
        store.close()


def test_lookups_lease_what_they_find_as_mooncakes_do(make_cluster):
    """Mooncake's is_exist, batch_is_exist, get_size and replica descriptors put each object
    found under a read lease (master_service.cpp ExistKey), and vLLM's Mooncake store
    connector looks prompts up with batch_is_exist, counting on the lease to keep what it
    found until its load. kvpool's took none: a remove right after returned 0 where
    Mooncake's returns OBJECT_HAS_LEASE, and the blocks found could be evicted before the
    load. Now they lease, and the leases lapse at the master's TTL; batch_probe_key (vLLM's
    lease-free probe) takes none."""
    cluster = make_cluster(0, master_args=("--lease-ttl-ms", "1000"))
    store = setup_store(cluster.master_endpoint)
    lookups = {
        "is_exist": lambda key: store.is_exist(key) == 1,
        "batch_is_exist": lambda key: store.batch_is_exist([key, "absent"]) == [1, 0],
        "get_size": lambda key: store.get_size(key) == 3,
        "get_replica_desc": lambda key: len(store.get_replica_desc(key)) == 1,
        "batch_get_replica_desc": lambda key: list(store.batch_get_replica_desc([key, "absent"])) == [key],
    }
    try:
        for name, lookup in lookups.items():
            assert store.put(name, b"abc") == 0
            assert lookup(name), name
            assert store.remove(name) == ErrorCode.OBJECT_HAS_LEASE, name
        assert store.put("probed", b"abc") == 0
        assert store.batch_probe_key(["probed", "absent"]) == [1, 0]
        assert store.remove("probed") == 0
        assert store.get_size("absent") == ErrorCode.OBJECT_NOT_FOUND
        removed_as_released(store.batch_remove, list(lookups))  # each lease lapses a second after its lookup
    finally:
        store.close()


def test_batch_puts_of_lists_of_different_lengths_are_invalid_params(make_cluster):
    """batch_put_from and batch_put_from_multi_buffers indexed past the shorter list and
    raised IndexError where Mooncake answers INVALID_PARAMS for every key."""
    cluster = make_cluster(0)
    store = setup_store(cluster.master_endpoint)
    buffer = np.zeros(64, dtype=np.uint8)
    address = buffer.ctypes.data
    invalid = int(ErrorCode.INVALID_PARAMS)
    try:
        assert store.register_buffer(address, buffer.nbytes) == 0
        assert store.batch_put_from(["x", "y"], [address], [10, 10]) == [invalid] * 2
        assert store.batch_put_from(["x", "y"], [address, address + 16], [10]) == [invalid] * 2
        assert store.batch_put_from_multi_buffers(["x", "y"], [[address]], [[10], [10]]) == [invalid] * 2
        assert store.batch_put_from_multi_buffers(["x"], [[address]], [[10], [10]]) == [invalid]
        assert store.batch_probe_key(["x", "y"]) == [0, 0]
        assert store.batch_put_from(["x", "y"], [address, address + 16], [10, 10]) == [0, 0]
    finally:
        store.close()


def test_replicate_config_translation():
    store = MooncakeDistributedStore()
    store._segment_name, store._segment_id = "127.0.0.1:4000", "node-abc"
    config = ReplicateConfig()
    assert store._kvpool_config(None) is None
    plain = store._kvpool_config(config)
    assert (plain.replica_num, plain.placement, plain.with_soft_pin) == (1, "random", False)
    config.replica_num, config.with_hard_pin = 3, True
    config.soft_pin_action = SoftPinAction.ENABLE
    config.preferred_segment = "127.0.0.1:4000"
    translated = store._kvpool_config(config)
    assert translated.replica_num == 3 and translated.with_hard_pin and translated.with_soft_pin
    assert (translated.placement, translated.preferred_segments) == ("preferred", ["node-abc"])
    local = ReplicateConfig()
    local.prefer_alloc_in_same_node = True
    assert store._kvpool_config(local).placement == "local"


def test_replica_descriptors_name_each_tier(make_cluster, tmp_path):
    """vLLM's Mooncake connector asks batch_get_replica_desc which tier each key loads from:
    a DRAM replica is a memory replica (its node's endpoint), a node's disk tier a local-disk
    one, the DFS a disk replica with the path of its file."""
    dfs, disk = tmp_path / "dfs", tmp_path / "disk"
    cluster = make_cluster(0, "8MiB", master_args=("--dfs-dir", str(dfs)))
    cluster.start_node(("--dfs-dir", str(dfs), "--disk-dir", str(disk), "--disk-size", "32MiB"))
    value = bytes(range(256)) * 64
    with Store(cluster.master_endpoint, dfs_dir=str(dfs)) as writer:
        config = KVPoolReplicateConfig(with_disk_copy=True, with_dfs_copy=True)
        assert writer.put_batch(["three"], [value], config) == [ErrorCode.OK]
        assert writer.put("dram only", b"d") is None
        (node,) = [s.segment for s in writer.cluster_status().segments if s.segment.tier == "dram"]
    store = setup_store(cluster.master_endpoint, segment_size=0)
    try:
        found = store.batch_get_replica_desc(["three", "absent", "dram only"])
        assert sorted(found) == ["dram only", "three"]
        kinds = sorted((d.is_memory_replica(), d.is_local_disk_replica(), d.is_disk_replica())
                       for d in found["three"])  # fmt: skip
        assert kinds == [(False, False, True), (False, True, False), (True, False, False)]
        assert {d.status for d in found["three"]} == {ReplicaStatus.COMPLETE}
        (memory,) = [d for d in found["three"] if d.is_memory_replica()]
        buffer = memory.get_memory_descriptor().buffer_descriptor
        assert (buffer.size, buffer.transport_endpoint) == (len(value), node.endpoint)
        (on_dfs,) = [d for d in found["three"] if d.is_disk_replica()]
        file = on_dfs.get_disk_descriptor()
        assert file.object_size == len(value) and Path(file.file_path).is_file()
        assert Path(file.file_path).is_relative_to(dfs)
        with pytest.raises(RuntimeError, match="Expected MemoryDescriptor"):
            on_dfs.get_memory_descriptor()
        (local_disk,) = [d for d in found["three"] if d.is_local_disk_replica()]
        with pytest.raises(RuntimeError, match="Expected DiskDescriptor"):
            local_disk.get_disk_descriptor()
        assert [d.is_memory_replica() for d in store.get_replica_desc("dram only")] == [True]
        cluster.master.kill()
        assert store.get_replica_desc("three") == [] and store.batch_get_replica_desc(["three"]) == {}
    finally:
        store.close()


def test_setup_failures_are_codes_not_exceptions(make_cluster):
    store = MooncakeDistributedStore()
    with pytest.raises(TypeError):
        store.setup("127.0.0.1", "P2PHANDSHAKE")  # positional form needs all seven, as pybind
    # Nothing listens on port 1: a bounded failure, INVALID_PARAMS as Mooncake's "Failed to
    # create client".
    started = time.monotonic()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", "127.0.0.1:1") == -600
    assert time.monotonic() - started < 30
    assert store.health_check() == 1
    assert store.get("k") == b"" and store.put("k", b"v") == -600 and store.is_exist("k") == -600
    assert store.get_into("k", 1, 1) == -600 and store.batch_get_buffer(["a"]) == [None]
    cluster = make_cluster(0)
    master = cluster.master_endpoint
    assert store.setup("127.0.0.1", "P2P", 0, 0, "tcp", "", master, object()) == -600  # engine
    assert store.setup("127.0.0.1", "P2P", 0, 0, "tcp", "", master, tenant_id="other") == -600
    assert store.setup({"local_hostname": "h", "metadata_server": "m", "master_server_addr": master,
                        "tenant_id": "other"}) == -600  # fmt: skip
    # The dict form converts values with str(), as Mooncake does: sizes may be strings.
    assert store.setup(config={"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                               "master_server_addr": master, "global_segment_size": "8MiB",
                               "protocol": "rdma"}) == 0  # fmt: skip
    try:
        assert store.get_hostname().startswith("127.0.0.1:")
        assert store.put("k", b"v") == 0 and store.get("k") == b"v"
    finally:
        store.close()


def test_master_death_degrades_to_codes(make_cluster):
    cluster = make_cluster(1, "8MiB")
    store = setup_store(cluster.master_endpoint, segment_size=0)
    try:
        assert store.put("k", b"v") == 0
        cluster.master.kill()
        assert store.health_check() == 2
        assert store.get("k") == b""
        assert store.put("k2", b"v") < 0
        assert store.is_exist("k") < 0
        assert store.get_size("k") < 0
        assert store.remove_all() < 0
        buffer = np.zeros(16, dtype=np.uint8)
        assert store.register_buffer(buffer.ctypes.data, buffer.nbytes) == 0
        assert store.get_into("k", buffer.ctypes.data, buffer.nbytes) < 0
    finally:
        store.close()


def test_register_buffer_errors(make_cluster):
    cluster = make_cluster(0)
    store = setup_store(cluster.master_endpoint)
    try:
        buffer = np.zeros(1024, dtype=np.uint8)
        assert store.register_buffer(buffer.ctypes.data, buffer.nbytes) == 0
        assert store.register_buffer(buffer.ctypes.data + 8, 8) == ErrorCode.INVALID_PARAMS
        assert store.unregister_buffer(buffer.ctypes.data + 1) == ErrorCode.INVALID_PARAMS
        assert store.put_from("k", 12345, 10) == ErrorCode.INVALID_PARAMS  # not registered
        assert store.unregister_buffer(buffer.ctypes.data) == 0
    finally:
        store.close()


def test_buffer_handle_and_tensor_codec():
    handle = BufferHandle(b"abc")
    assert handle.size() == len(handle) == 3 and handle.ptr() != 0
    assert np.array(handle, copy=False).tobytes() == b"abc"
    assert BufferHandle().ptr() == 0
    torch = pytest.importorskip("torch", reason="the tensor codec needs torch")
    for tensor in [torch.zeros(0, 3), torch.tensor(5.0), torch.randn(2, 3, 4)[:, 1],
                   torch.arange(6, dtype=torch.int16).reshape(2, 3).t()]:  # fmt: skip
        back = decode_tensor(encode_tensor(tensor))
        assert back.dtype == tensor.dtype and back.shape == tensor.shape
        assert torch.equal(back, tensor)
    assert decode_tensor(b"not a tensor") is None
    assert decode_tensor(b"") is None
