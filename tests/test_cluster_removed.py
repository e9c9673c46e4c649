"""A removed object stays removed when the node that held it comes back: real processes on
loopback, a master with a short node TTL.

The master tells a node to forget a removed (or evicted) object by a drop. A dead node gets
none, and its disk tier re-adopts its files when it restarts on the same directory. Without
the master's record of the drops it could not deliver (tombstones, kvpool/master/tombstones.py),
the keys a user removed came back with that node. (A node the master timed out while it was
cut off, its DRAM intact, is the same case: tests/test_master_tombstones.py. Loopback cannot
cut a node off without also holding the drop for it, which the node then reads.)
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from kvpool import Store
from kvpool.errors import ErrorCode
from kvpool.protocol import objectfile
from tests.test_cluster import values_for, wait_until
from tests.test_cluster_disk import OBJECT_SIZE, disk_args, disk_keys, tiers_of

NODE_TTL_MS = 1500


def object_file_count(disk_dir) -> int:
    """Whole object files in a disk tier (names only: the node may remove one meanwhile)."""
    return sum(name.endswith(objectfile.SUFFIX) for name in os.listdir(disk_dir / objectfile.OBJECTS_DIR))


def put_until_settled_on_disk(store: Store, values: dict[str, bytes], node) -> list[str]:
    """Put `values` (more than DRAM holds) and wait for the offloads to settle; returns the
    keys whose only replica is on `node`'s disk tier."""
    for key, value in values.items():
        store.put(key, value)
    wait_until(lambda: sum(t["object_count"] for t in tiers_of(store).values()) == len(values)
               and tiers_of(store)["dram"]["used_bytes"] <= 0.9 * 8 * 1024 * 1024)  # fmt: skip
    return disk_keys(store, list(values), node.info["disk_segment_id"])


def segment_ids(store: Store) -> set[str]:
    return {status.segment.segment_id for status in store.cluster_status().segments}


@pytest.mark.parametrize("removed", ["before_ttl", "before_ttl_back_after_it", "after_ttl", "all_after_ttl"])
def test_disk_objects_removed_while_their_node_is_dead_stay_removed_after_its_restart(make_cluster, tmp_path, removed):
    # Before the node's TTL the master still lists its objects: a remove takes them, and its
    # drops wait as tombstones. After it, the master has dropped the node's segments and the
    # objects they alone held: a remove finds no such key (nor a remove_all any), and until
    # 2026-12-06 the restarted node's disk tier brought them back. The master now keeps the
    # keys lost with a segment, and a remove that names them, found or not, refuses them.
    cluster = make_cluster(0, "8MiB", master_args=("--node-ttl-ms", str(NODE_TTL_MS)))
    disk = tmp_path / "disk"
    node = cluster.start_node(disk_args(disk))
    values = values_for("removed", 64, OBJECT_SIZE)  # 16 MiB through 8 MiB of DRAM
    with Store(cluster.master_endpoint) as store:
        on_disk = put_until_settled_on_disk(store, values, node)
        assert len(on_disk) >= 32
        node.kill()

        def dropped() -> bool:
            return node.info["disk_segment_id"] not in segment_ids(store)

        if removed.endswith("after_ttl"):
            assert wait_until(dropped, 10)
        if removed == "all_after_ttl":
            gone, kept = on_disk, []
            assert store.remove_all() == 0  # none it knew of
        else:
            gone, kept = on_disk[::2], on_disk[1::2]
            code = 0 if removed.startswith("before_ttl") else ErrorCode.OBJECT_NOT_FOUND
            assert store.batch_remove(gone) == [code] * len(gone)  # the master forgets them at once
        assert not any(store.batch_exists(gone))
        if removed == "before_ttl_back_after_it":
            assert wait_until(dropped, 10)
    assert object_file_count(disk) >= len(on_disk)  # the dead node removed no file
    restarted = cluster.start_node(disk_args(disk))
    assert restarted.info["disk_segment_id"] == node.info["disk_segment_id"]
    with Store(cluster.master_endpoint, shm_enabled=False) as reader:
        assert wait_until(lambda: all(reader.batch_exists(kept)), 10)
        assert wait_until(lambda: "rejected" in restarted.log_tail(50), 10)
        assert not any(reader.batch_exists(gone))
        assert reader.get_batch(gone) == [None] * len(gone)
        assert reader.get_batch(kept) == [values[key] for key in kept]
        assert tiers_of(reader)["disk"]["object_count"] == len(kept)
    # The restarted node removes their files once its mount is answered (the kept ones may
    # be read before that).
    assert wait_until(lambda: object_file_count(disk) == len(kept), 10)


@pytest.mark.parametrize("then", ["writable_again", "restarted_read_only"])
def test_disk_objects_removed_while_the_filesystem_is_read_only_stay_removed(make_cluster, small_filesystem, then):
    # A read-only filesystem keeps the files of removed objects. Before: the node forgot them,
    # failed to unlink their files, and acknowledged the drop at the master's next try; after a
    # restart they were served again. Now the drop fails until the files are gone (sent again
    # at each flush), and a restart meanwhile meets the drops as tombstones.
    mount_path = small_filesystem("32m")
    disk = mount_path / "disk"
    cluster = make_cluster(0, "8MiB", master_args=("--node-ttl-ms", str(NODE_TTL_MS)))
    node = cluster.start_node(disk_args(disk, "24MiB"))
    values = values_for("read-only", 48, OBJECT_SIZE)  # 12 MiB through 8 MiB of DRAM
    with Store(cluster.master_endpoint) as store:
        on_disk = put_until_settled_on_disk(store, values, node)
        assert len(on_disk) >= 8
        subprocess.run(["mount", "-o", "remount,ro", str(mount_path)], check=True)
        removed, kept = on_disk[::2], on_disk[1::2]
        assert store.batch_remove(removed) == [0] * len(removed)
        assert wait_until(lambda: "could not be removed" in node.log_tail(50), 10)
        time.sleep(1)  # the master sends the drop again at each flush (every 100-500 ms) ...
        assert node.log_tail(200).count("could not be removed") == 1  # ... the node says so once
        assert store.get_batch(removed) == [None] * len(removed)
        assert object_file_count(disk) == len(on_disk)
        if then == "writable_again":
            subprocess.run(["mount", "-o", "remount,rw", str(mount_path)], check=True)
            assert wait_until(lambda: object_file_count(disk) == len(kept), 10)  # the drop went through
            # The node unlinks the files before it answers the drop: the master's line follows.
            assert wait_until(lambda: "go through again" in cluster.master.log_tail(50), 10)
        else:
            node.kill()
            node = cluster.start_node(disk_args(disk, "24MiB"))  # on the read-only filesystem
    with Store(cluster.master_endpoint, shm_enabled=False) as reader:
        assert wait_until(lambda: all(reader.batch_exists(kept)), 10)
        assert not any(reader.batch_exists(removed))
        assert reader.get_batch(kept) == [values[key] for key in kept]
    logged = cluster.master.log_tail(200)
    assert logged.count("drops on segment") <= 2  # once failing, once through: not at every flush


def test_a_remove_answered_survives_the_master_killed_right_after(make_cluster):
    """A remove was answered before its drops went out (at the master's next tick): a master
    killed in between left the objects on their nodes, and the next one took them back when
    the nodes mounted again. Removed keys came back, and a key put again since with other
    bytes could come back with the old ones, its acknowledged put lost (helper-49: 9-12 of
    40). A remove is now answered once the nodes have forgotten what it removed."""
    cluster = make_cluster(2, "16MiB")
    old = values_for("again", 40, 20_000)
    new = {key: os.urandom(20_000) for key in old}
    gone = values_for("gone", 20, 20_000)
    with Store(cluster.master_endpoint) as store:
        store.put_batch(list(old) + list(gone), list(old.values()) + list(gone.values()))
        store.batch_remove(list(old) + list(gone))
        store.put_batch(list(new), list(new.values()))  # elsewhere, or at the same offsets
        cluster.master.kill()
    cluster.start_master()
    with Store(cluster.master_endpoint) as store:
        wait_until(lambda: len(store.cluster_status().segments) == 2)
        assert store.get_batch(list(gone)) == [None] * len(gone)
        assert store.get_batch(list(new)) == list(new.values())
