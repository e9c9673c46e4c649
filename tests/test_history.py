"""What the store promises concurrent clients under faults, checked on recorded histories
(tests/history_check.py): a short seeded run of clients and faults, and the regressions the
checker found, each reproduced narrowly with real processes."""

from __future__ import annotations

import os
import signal

from kvpool import ReplicateConfig, Store
from tests.conftest import wait_until
from tests.history_check import CALL_BOUND_MS, FAULTS, HistoryRun, run_checked

CLIENT = dict(rpc_timeout_ms=5_000, connect_timeout_ms=1_000, transfer_timeout_ms=2_000)


def mounted(store: Store) -> set[str]:
    return {s.segment.segment_id for s in store.cluster_status().segments}


def test_remove_right_after_a_master_restart_reaches_nodes_still_re_mounting(make_cluster) -> None:
    """A restarted master knows no object until the nodes re-mount: a remove it took before then
    missed the replicas of the nodes still on their way, and once they re-mounted every get
    returned the removed bytes (found by the history checker: k008, k023 in its first run)."""
    cluster = make_cluster(2, "16MiB")
    late, early = cluster.nodes
    with Store(cluster.master_endpoint, shm_enabled=False, **CLIENT) as store:
        store.put("removed", b"old bytes" * 100, ReplicateConfig(replica_num=2))
        late.signal(signal.SIGSTOP)  # it re-mounts only once the remove is answered
        try:
            cluster.master.kill()
            cluster.start_master()
            wait_until(lambda: early.info["segment_id"] in mounted(store))
            assert store.batch_remove(["removed"]) == [0]
        finally:
            late.signal(signal.SIGCONT)
        wait_until(lambda: late.info["segment_id"] in mounted(store))
        assert store.get("removed") is None
        assert store.batch_exists(["removed"]) == [False]


def test_history_under_faults_keeps_the_promises(tmp_path) -> None:
    """A seeded run of three clients (shm and TCP; puts, batches, gets, get_into, exists,
    prefixes, removes, regex removes) on overlapping keys while a node is killed and restarted,
    a node stopped and continued, the master killed and restarted and a client killed: no read
    returns bytes no put of its key wrote, nor a value that was removed or replaced without
    its object leaving; acknowledged pinned objects stay; every call ends within its bound with
    a typed error at worst; and once quiet, exists, prefixes and gets agree and the master's
    use of each segment is what its node holds."""
    run = HistoryRun(tmp_path, seed=int(os.environ.get("KVPOOL_HISTORY_SEED", "7")), duration_s=14, fault_gap_s=0.8)
    violations, report, _ = run_checked(run)
    assert violations == [], report
    assert report["fault_kinds"] == sorted(FAULTS), report  # the run did inject every fault
    assert report["reads"] > 100 and report["misses"] > 0 and report["longest_ms"] < CALL_BOUND_MS, report


def test_a_remove_while_a_node_is_timed_out_reaches_its_replica_when_it_comes_back(make_cluster) -> None:
    """An object with two replicas; the master times out one's node (stopped, its DRAM intact),
    and the object, still whole on the other, is removed: the remove is answered as done, yet
    the node re-mounted with its replica and the removed bytes came back (the history checker:
    k033, read at 6.6 s after regex removes at 5.6 s counted it)."""
    cluster = make_cluster(2, "16MiB", master_args=("--node-ttl-ms", "1000"))
    away, staying = cluster.nodes
    with Store(cluster.master_endpoint, shm_enabled=False, **CLIENT) as store:
        store.put("removed", b"old bytes" * 100, ReplicateConfig(replica_num=2))
        away.signal(signal.SIGSTOP)
        try:
            wait_until(lambda: away.info["segment_id"] not in mounted(store))
            assert store.get("removed") == b"old bytes" * 100  # whole on the other node
            assert store.remove_by_regex("^removed$", force=True) == 1
        finally:
            away.signal(signal.SIGCONT)
        wait_until(lambda: away.info["segment_id"] in mounted(store))
        assert store.get("removed") is None
        assert store.batch_exists(["removed"]) == [False]
