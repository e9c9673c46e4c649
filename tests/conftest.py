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
