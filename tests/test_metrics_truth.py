"""What kvpool reports is what happened: a master and nodes as real processes, a workload whose
effects are known exactly, and after each step the master's and the nodes' /metrics (and the
cluster status `kvpool stat` prints) compared with the truth: objects and bytes per tier,
capacity, puts, gets, hits, misses, promotions, removes, a node lost, a master restarted."""

from __future__ import annotations

import contextlib
import urllib.request
from pathlib import Path

from conftest import wait_until
from prometheus_client.parser import text_string_to_metric_families

from kvpool import ErrorCode, ReplicateConfig, Store

KIB = 1024
MIB = 1024 * KIB


def scrape(endpoint: str) -> dict[str, float]:
    """Samples of a /metrics page by name and labels ("name{k=v,...}"), without `*_created`
    and without the labels that name a segment's node or endpoint."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k not in ("node", "endpoint"))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def master_metrics(cluster) -> dict[str, float]:
    return scrape(f"127.0.0.1:{cluster.http_port}")


def tier(samples: dict[str, float], name: str, tier_name: str) -> float:
    return samples[f"kvpool_master_tier_{name}{{tier={tier_name}}}"]


def disk_args(path: Path) -> tuple[str, ...]:
    return ("--disk-dir", str(path), "--disk-size", "8MiB", "--metrics-port", "0")


def test_a_request_that_reads_dram_and_disk_counts_both_on_the_node(make_cluster, tmp_path):
    """One ReadSlices with an item of the DRAM segment and one of the disk tier: the node counted
    the disk item in disk_read_bytes_total and the DRAM item nowhere (read_bytes_total stayed
    0 whatever DRAM it served in such requests)."""
    cluster = make_cluster(0, "8MiB")
    node = cluster.start_node(disk_args(tmp_path / "disk"))
    on_disk, in_dram = b"d" * (256 * KIB), b"m" * (64 * KIB)
    with Store(cluster.master_endpoint) as store:
        assert store.put_batch(["d"], [on_disk], ReplicateConfig(with_disk_copy=True)) == [ErrorCode.OK]
    node.stop()  # its DRAM goes, its disk tier stays: "d" is on disk only
    node = cluster.start_node(disk_args(tmp_path / "disk"))
    with Store(cluster.master_endpoint, shm_enabled=False) as store:  # through the node
        store.put("m", in_dram)
        assert [len(rs) for rs in store.query(["d", "m"]).replicas] == [1, 1]
        assert store.get_batch(["d", "m"]) == [on_disk, in_dram]
    samples = scrape(node.info["metrics_endpoint"])
    assert samples["kvpool_node_disk_read_bytes_total"] == len(on_disk)
    assert samples["kvpool_node_disk_read_requests_total"] == 1
    assert samples["kvpool_node_read_bytes_total"] == len(in_dram)
    assert samples["kvpool_node_read_requests_total"] == 1


def test_a_node_without_a_disk_tier_exports_no_disk_gauges(make_cluster, tmp_path):
    """A node without --disk-dir exported kvpool_node_disk_capacity_bytes and
    kvpool_node_disk_filesystem_free_bytes as 0: a full disk to the alert docs/tiers.md
    suggests on the free space. A node with a disk tier exports its true figures."""
    cluster = make_cluster(0, "8MiB")
    with_disk = cluster.start_node(disk_args(tmp_path / "disk"))
    without = cluster.start_node(("--metrics-port", "0"))
    with Store(cluster.master_endpoint) as store:
        to_disk_node = [with_disk.info["segment_id"]]
        store.put("k", b"k" * (64 * KIB), ReplicateConfig(placement="preferred", preferred_segments=to_disk_node,
                                                          with_disk_copy=True))  # fmt: skip
    gauges = ("capacity_bytes", "used_bytes", "objects", "filesystem_free_bytes")
    plain = scrape(without.info["metrics_endpoint"])
    assert [name for name in plain if name.startswith("kvpool_node_disk_") and name[17:] in gauges] == []
    disk = scrape(with_disk.info["metrics_endpoint"])
    assert disk["kvpool_node_disk_capacity_bytes"] == 8 * MIB
    assert disk["kvpool_node_disk_objects"] == 1
    assert disk["kvpool_node_disk_used_bytes"] == 64 * KIB
    free = "kvpool_node_disk_filesystem_free_bytes"  # NaN until the node's first look
    wait_until(lambda: scrape(with_disk.info["metrics_endpoint"])[free] > 0)


def test_master_and_node_metrics_follow_a_known_workload(make_cluster, tmp_path):
    """Puts, hits and misses, DRAM lost with a node restart (disk kept), promotions, a remove,
    a node killed (its capacity and objects leave the totals after the TTL), a master
    restarted (the gauges come back the same from the nodes' inventories)."""
    # Three heartbeats (a node's come every second): with one, a heartbeat a little late under
    # load (tests beside it) dropped a live node, and its objects counted as lost.
    cluster = make_cluster(0, "8MiB", master_args=("--node-ttl-ms", "3000", "--promote-reads", "2"))
    n1 = cluster.start_node(disk_args(tmp_path / "disk"))
    n2 = cluster.start_node(("--metrics-port", "0"))
    small, large = 64 * KIB, 128 * KIB
    a_keys, b_keys = ["a0", "a1", "a2"], ["b0", "b1"]
    with Store(cluster.master_endpoint, shm_enabled=False) as store:
        n2_segment = n2.info["segment_id"]
        to_n1 = ReplicateConfig(placement="preferred", preferred_segments=[n1.info["segment_id"]], with_disk_copy=True)
        to_n2 = ReplicateConfig(placement="preferred", preferred_segments=[n2_segment])
        assert store.put_batch(a_keys, [b"a" * small] * 3, to_n1) == [ErrorCode.OK] * 3
        assert store.put_batch(b_keys, [b"b" * large] * 2, to_n2) == [ErrorCode.OK] * 2
        m = master_metrics(cluster)
        assert (m["kvpool_master_objects"], m["kvpool_master_puts_total"]) == (5, 5)
        assert m["kvpool_master_put_bytes_total"] == 3 * small + 2 * large
        assert (tier(m, "objects", "dram"), tier(m, "used_bytes", "dram")) == (5, 3 * small + 2 * large)
        assert (tier(m, "objects", "disk"), tier(m, "used_bytes", "disk")) == (3, 3 * small)
        assert (tier(m, "capacity_bytes", "dram"), tier(m, "capacity_bytes", "disk")) == (16 * MIB, 8 * MIB)
        wait_until(lambda: scrape(n1.info["metrics_endpoint"])["kvpool_node_objects"] == 3)  # commits land late
        node1 = scrape(n1.info["metrics_endpoint"])
        assert (node1["kvpool_node_segment_used_bytes"], node1["kvpool_node_disk_objects"]) == (3 * small, 3)
        wait_until(lambda: scrape(n2.info["metrics_endpoint"])["kvpool_node_objects"] == 2)
        assert scrape(n2.info["metrics_endpoint"])["kvpool_node_segment_used_bytes"] == 2 * large

        assert store.get_batch([*a_keys, *b_keys, "absent", "absent2"])[:5] == [b"a" * small] * 3 + [b"b" * large] * 2
        m = master_metrics(cluster)
        assert [m[f"kvpool_master_{name}_total"] for name in ("gets", "hits", "misses")] == [7, 5, 2]
        assert (tier(m, "hits_total", "dram"), tier(m, "hits_total", "disk")) == (5, 0)

    n1.stop()  # its DRAM replicas go; its disk tier comes back with the node
    n1 = cluster.start_node(disk_args(tmp_path / "disk"))
    with Store(cluster.master_endpoint, shm_enabled=False) as store:
        m = master_metrics(cluster)
        # Its disk tier left with it (lost: nothing could read them meanwhile) and came back.
        assert (m["kvpool_master_objects"], m["kvpool_master_lost_total"]) == (5, 3)
        assert (tier(m, "objects", "dram"), tier(m, "objects", "disk")) == (2, 3)
        assert tier(m, "capacity_bytes", "dram") == 16 * MIB  # the restarted node's new segment, once
        for _ in range(2):  # --promote-reads 2: each disk object comes back into DRAM
            assert store.get_batch(a_keys) == [b"a" * small] * 3
        wait_until(lambda: tier(master_metrics(cluster), "promotions_total", "dram") == 3)
        m = master_metrics(cluster)
        assert (tier(m, "hits_total", "disk"), tier(m, "objects", "dram"), tier(m, "objects", "disk")) == (6, 5, 3)
        assert tier(m, "used_bytes", "dram") == 3 * small + 2 * large
        wait_until(lambda: scrape(n1.info["metrics_endpoint"])["kvpool_node_objects"] == 3)

        store.remove("b0")
        m = master_metrics(cluster)
        assert (m["kvpool_master_removes_total"], m["kvpool_master_objects"], tier(m, "objects", "dram")) == (1, 4, 4)
        wait_until(lambda: scrape(n2.info["metrics_endpoint"])["kvpool_node_objects"] == 1)

    n2.kill()  # b1 goes with it after the TTL, and so does its segment's capacity
    wait_until(lambda: master_metrics(cluster)["kvpool_master_lost_total"] == 3 + 1)
    before = master_metrics(cluster)
    assert before["kvpool_master_objects"] == 3
    assert (tier(before, "capacity_bytes", "dram"), tier(before, "objects", "dram")) == (8 * MIB, 3)
    assert tier(before, "used_bytes", "dram") == 3 * small
    assert not [name for name in before if "segment=" in name and n2_segment in name]

    cluster.master.stop()
    cluster.start_master()
    rebuilt = ("tier_capacity_bytes", "tier_used_bytes", "tier_objects", "segment_used_bytes", "segment_objects")
    gauges = [name for name in before if name.startswith(tuple(f"kvpool_master_{g}" for g in (*rebuilt, "objects")))]
    expected = {name: before[name] for name in gauges}

    def rebuilt() -> dict[str, float | None]:
        after = master_metrics(cluster)
        return {name: after.get(name) for name in gauges}

    with contextlib.suppress(AssertionError):  # the node mounts again within a heartbeat or two
        wait_until(lambda: rebuilt() == expected, 10)
    assert rebuilt() == expected


def test_a_put_larger_than_every_segment_counts_as_an_error(make_cluster):
    """A put that no segment could ever hold fails at once with NO_AVAILABLE_HANDLE, and counts
    in kvpool_master_errors_total as a put that found no room after waiting does (it answered
    without settling the reply, and counted nothing)."""
    cluster = make_cluster(1, "4MiB")
    with Store(cluster.master_endpoint) as store:
        assert store.put_batch(["big", "small"], [b"b" * (8 * MIB), b"s" * KIB]) == [
            ErrorCode.NO_AVAILABLE_HANDLE, ErrorCode.OK,
        ]  # fmt: skip
        assert store.get("small") == b"s" * KIB
    assert master_metrics(cluster)["kvpool_master_errors_total"] == 1


def test_write_through_copies_are_counted_per_tier(make_cluster, tmp_path):
    """A put with with_disk_copy and one with with_dfs_copy each add a replica to a slower tier
    without an offload: the master counted them (TierCounters.copies) and showed them nowhere,
    so a disk tier's objects grew with nothing in /metrics to explain it."""
    cluster = make_cluster(0, "8MiB", master_args=("--dfs-dir", str(tmp_path / "dfs")))
    cluster.start_node((*disk_args(tmp_path / "disk"), "--dfs-dir", str(tmp_path / "dfs")))
    with Store(cluster.master_endpoint, dfs_dir=str(tmp_path / "dfs")) as store:
        assert store.put_batch(["d1", "d2"], [b"1" * KIB, b"2" * KIB], ReplicateConfig(with_disk_copy=True)) == [0, 0]
        store.put("f", b"f" * KIB, ReplicateConfig(with_dfs_copy=True))
    samples = master_metrics(cluster)
    assert tier(samples, "copies_total", "disk") == 2
    assert tier(samples, "copies_total", "dfs") == 1
    assert tier(samples, "copies_total", "dram") == 0
    assert tier(samples, "offloads_total", "disk") == tier(samples, "offloads_total", "dfs") == 0
    assert tier(samples, "objects", "disk") == 2 and tier(samples, "objects", "dfs") == 1
