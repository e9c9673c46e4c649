"""docs/integrations.md followed as an operator follows it: the vLLM `--kv-transfer-config`, the
SGLang `--hicache-storage-backend-extra-config` and the LMCache YAML the page shows, read from
the page itself, build each engine's adapter through the engine's own loader against a real
cluster, with no key left unread; a key the adapter does not read (a typo) is named in a
warning instead of passing in silence; and vLLM's scheduler side contributes no memory of its
own (`embedded_memory` is each worker's).

Skipped per engine where it is not installed (scripts/install-peers.sh). About 20 s, most of it
importing vLLM.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shlex
from pathlib import Path

import pytest
import vllm_on_cpu  # noqa: F401  (before vLLM, which LMCache imports too)

from kvpool import Store

torch = pytest.importorskip("torch", reason="needs torch==2.13.0")

PAGE = (Path(__file__).resolve().parent.parent / "docs" / "integrations.md").read_text()
DOCUMENTED_MASTER = "10.0.0.1:50051"


def documented_option(command: str, option: str) -> str:
    """The value of `option` in the page's fenced `command` line (continuation lines joined)."""
    for block in re.findall(r"^```\w*\n(.*?)^```", PAGE, re.S | re.M):
        words = shlex.split(block.replace("\\\n", " "))
        if words[: len(command.split())] == command.split() and option in words:
            return words[words.index(option) + 1]
    raise AssertionError(f"no `{command} ... {option}` in docs/integrations.md")


def unread_key_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "which kvpool does not read" in r.getMessage()]


# --- vLLM -------------------------------------------------------------------------------------


def vllm_connector(master: str, role_name: str, **extra):
    """vLLM's factory's connector for `role_name`, from the page's --kv-transfer-config with
    the cluster's master and `extra` in kv_connector_extra_config."""
    pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.factory", reason="vLLM is not installed")
    from test_integration_vllm import connector
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    documented = json.loads(documented_option("vllm serve", "--kv-transfer-config"))
    assert documented["kv_connector_extra_config"] == {"master": DOCUMENTED_MASTER}
    # No model is loaded here: model_name stands for `vllm serve MODEL`.
    documented["kv_connector_extra_config"] = {"master": master, "model_name": "org/tiny", **extra}
    config = VllmConfig(cache_config=CacheConfig(block_size=4), kv_transfer_config=KVTransferConfig(**documented))
    config.scheduler_config.disable_hybrid_kv_cache_manager = True
    return connector(config, getattr(KVConnectorRole, role_name))


def test_vllm_takes_the_documented_config_and_names_a_key_it_does_not_read(make_cluster, caplog):
    cluster = make_cluster(1, "16MiB")
    documented_keys = {"cache_prefix": "team", "load_async": "false", "lookup_hold_ms": 0, "shm_enabled": True}
    with caplog.at_level(logging.WARNING):
        vllm_connector(cluster.master_endpoint, "SCHEDULER", **documented_keys).shutdown()
        assert unread_key_warnings(caplog) == []
        vllm_connector(cluster.master_endpoint, "SCHEDULER", replicas=2, lookup_timeout=100).shutdown()
    [warning] = unread_key_warnings(caplog)
    assert "kv_connector_extra_config has 'lookup_timeout', 'replicas'" in warning
    assert "lookup_timeout_ms" in warning and "replica_num" in warning  # what was meant


def test_vllms_embedded_memory_is_each_workers_not_the_schedulers(make_cluster):
    """vLLM builds a scheduler side as well as a connector per worker; each contributed
    `embedded_memory`, so the engine gave one segment more than it has workers (at TP 1, two
    in one process)."""
    cluster = make_cluster(1, "16MiB")
    sides = [vllm_connector(cluster.master_endpoint, role, embedded_memory="4MiB") for role in ("SCHEDULER", "WORKER")]
    try:
        with Store(cluster.master_endpoint) as store:
            assert len(store.cluster_status().segments) == 2  # the node's and the worker's
    finally:
        for side in sides:
            side.shutdown()


# --- SGLang -----------------------------------------------------------------------------------


def test_sglang_takes_the_documented_extra_config_and_names_a_key_it_does_not_read(make_cluster, caplog):
    pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory", reason="SGLang is not installed")
    from test_integration_sglang import MHAHostPool, create, storage_config

    cluster = make_cluster(1, "16MiB")
    # SGLang reads the option with json.loads (and pops its prefetch_* keys, but for a
    # decode-side offload, which hands them on).
    documented = json.loads(
        documented_option("python -m sglang.launch_server", "--hicache-storage-backend-extra-config")
    )
    assert documented["master"] == DOCUMENTED_MASTER
    config = storage_config(cluster.master_endpoint)
    with caplog.at_level(logging.WARNING):
        for extra in ({"prefetch_threshold": 256, "extra_backend_tag": "team"}, {"lookup_hold": 0}):
            config.extra_config = {**documented, "master": cluster.master_endpoint, **extra}
            create(config, MHAHostPool("page_first")).close()
    [warning] = unread_key_warnings(caplog)
    assert "--hicache-storage-backend-extra-config has 'lookup_hold'," in warning


# --- LMCache ----------------------------------------------------------------------------------


def test_lmcache_takes_the_documented_yaml_and_names_a_kvpool_key_it_does_not_read(make_cluster, caplog, tmp_path):
    pytest.importorskip("lmcache.v1.storage_backend.connector", reason="LMCache is not installed")
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.connector import CreateConnector
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from test_integration_lmcache import CHUNK, KV_SHAPE

    cluster = make_cluster(1, "16MiB")
    [yaml] = re.findall(r"^```yaml\n(.*?)^```", PAGE, re.S | re.M)
    assert DOCUMENTED_MASTER in yaml
    config_file = tmp_path / "lmcache.yaml"
    config_file.write_text(yaml.replace(DOCUMENTED_MASTER, cluster.master_endpoint))
    metadata = LMCacheMetadata(
        model_name="org/tiny", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.bfloat16, kv_shape=KV_SHAPE, chunk_size=CHUNK,
    )  # fmt: skip
    for extra in ({"save_chunk_meta": False, "kvpool.lookup_hold_ms": 0}, {"kvpool.lookup_timeout": 100}):
        config = LMCacheEngineConfig.from_file(str(config_file))
        config.max_local_cpu_size = 0.05  # the page's 5 GB, not on this machine
        config.extra_config.update(extra)
        cpu = LocalCPUBackend(config, metadata, dst_device="cpu")
        loop = asyncio.new_event_loop()
        with caplog.at_level(logging.WARNING):
            connection = CreateConnector("plugin://kvpool", loop, cpu, config, metadata, "kvpool")
        assert "KVPoolRemoteConnector" in repr(connection)
        loop.run_until_complete(connection.close())
        loop.close()
    [warning] = unread_key_warnings(caplog)
    assert "LMCache's extra_config has 'kvpool.lookup_timeout'," in warning
