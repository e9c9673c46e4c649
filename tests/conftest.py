"""Shared fixtures: local clusters of real processes, stopped whatever the test did."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kvpool.cli.launcher import LocalCluster

# Masters started by tests check every structure after every request (STYLE.md).
os.environ.setdefault("KVPOOL_DEBUG_INVARIANTS", "1")


@pytest.fixture
def make_cluster() -> Iterator:
    """make_cluster(nodes, memory, master_args=..., node_args=..., token=...) -> LocalCluster."""
    clusters: list[LocalCluster] = []

    def make(node_count: int = 3, memory: str = "32MiB", **options) -> LocalCluster:
        cluster = LocalCluster(node_count, memory, **options)
        clusters.append(cluster)
        cluster.start()
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop()


@pytest.fixture(scope="session")
def etcd_endpoint(tmp_path_factory) -> Iterator[str]:
    """A real etcd on 127.0.0.1 (free ports, temporary data dir), shared by the session and
    ended by its pid; tests give each cluster its own cluster id. Skips where etcd is absent."""
    from kvpool.cli.launcher import LocalEtcd, etcd_binary

    if etcd_binary() is None:
        pytest.skip("etcd is not installed: run scripts/install-etcd.sh (Debian etcd-server)")
    with LocalEtcd(tmp_path_factory.mktemp("etcd")) as etcd:
        yield etcd.endpoint
