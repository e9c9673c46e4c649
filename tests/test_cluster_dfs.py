"""The shared-filesystem (DFS) tier as operators run it: a master and nodes as real processes,
all given the same `--dfs-dir` (a directory under pytest's tmp_path standing in for NFS or
Lustre), and clients that read DFS objects straight from that path.

How: objects are put with a DFS copy (write-through) and more are pushed out of DRAM into the
DFS by eviction; then every node is killed with SIGKILL and a fresh client, with no node left,
reads the DFS objects; then the master is killed and restarted and rebuilds its DFS index from
the directory alone. Every check is on the bytes a user gets back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

import pytest

from kvpool import AsyncStore, ErrorCode, ReplicateConfig, Store, limits
from kvpool.protocol import objectfile
from tests.test_cluster import kvpool_cli, values_for, wait_until

OBJECT_SIZE = 256 * 1024


def dfs_keys(store: Store, keys: list[str]) -> list[str]:
    status = store.cluster_status()
    dfs_ids = {s.segment.segment_id for s in status.segments if s.segment.tier == "dfs"}
    reply = store.query(keys)
    return [k for k, rs in zip(keys, reply.replicas) if any(r.segment_id in dfs_ids for r in rs)]


def test_dfs_objects_outlive_every_node_and_a_master_restart(make_cluster, tmp_path):
    dfs = str(tmp_path / "dfs")
    cluster = make_cluster(0, "8MiB", master_args=("--dfs-dir", dfs, "--node-ttl-ms", "1500"))
    cluster.start_nodes([("--dfs-dir", dfs)] * 2)
    persisted = values_for("persisted", 12, OBJECT_SIZE)
    flood = values_for("flood", 64, OBJECT_SIZE)  # 19 MiB in all through 16 MiB of DRAM
    with Store(cluster.master_endpoint, dfs_dir=dfs) as writer:
        codes = writer.put_batch(list(persisted), list(persisted.values()), ReplicateConfig(with_dfs_copy=True))
        assert codes == [ErrorCode.OK] * len(persisted)
        assert dfs_keys(writer, list(persisted)) == list(persisted)  # the put returned with them
        for key, value in flood.items():
            writer.put(key, value)
        wait_until(lambda: dfs_keys(writer, list(flood)))  # evicted from DRAM into the DFS
        offloaded = dfs_keys(writer, list(flood))
    for node in cluster.nodes:
        node.kill()
    with Store(cluster.master_endpoint, dfs_dir=dfs, shm_enabled=False) as reader:
        wait_until(lambda: not [s for s in reader.cluster_status().segments if s.segment.tier == "dram"])
        assert reader.get_batch(list(persisted)) == list(persisted.values())
        assert reader.get_batch(offloaded) == [flood[k] for k in offloaded]
        for key, data in zip(flood, reader.get_batch(list(flood))):
            assert data in (flood[key], None)
        tiers = {t["tier"]: t for t in reader.cluster_status().to_dict()["tiers"]}
        assert tiers["dfs"]["hits"] >= len(persisted) + len(offloaded)
    # The CLI too, given the DFS mount (--dfs-dir, or KVPOOL_DFS_DIR); without it, a miss that
    # says why. A client without it gets a clean miss.
    first = next(iter(persisted))
    for how in ({"KVPOOL_DFS_DIR": dfs}, {}):
        got = kvpool_cli("get", first, "-o", str(tmp_path / "out"), "--master", cluster.master_endpoint,
                         *([] if how else ["--dfs-dir", dfs]), env=how)  # fmt: skip
        assert got.returncode == 0, got.stderr.decode()
        assert (tmp_path / "out").read_bytes() == persisted[first]
    missed = kvpool_cli("get", first, "--master", cluster.master_endpoint)
    assert missed.returncode == 3
    assert "kept only on the DFS tier, which no node serves: give --dfs-dir" in " ".join(missed.stderr.decode().split())
    elsewhere = kvpool_cli("get", first, "--master", cluster.master_endpoint, "--dfs-dir", str(tmp_path))  # its parent
    assert elsewhere.returncode == 3
    assert f"which --dfs-dir {tmp_path} does not hold" in " ".join(elsewhere.stderr.decode().split())
    with Store(cluster.master_endpoint, shm_enabled=False) as outsider:
        assert outsider.get(first) is None
    cluster.master.kill()
    cluster.start_master()
    with Store(cluster.master_endpoint, dfs_dir=dfs, shm_enabled=False) as reader:
        every = list(persisted) + offloaded
        assert all(reader.batch_exists(every))  # indexed again from the directory alone
        assert reader.get_batch(every) == [persisted.get(k) or flood[k] for k in every]
        # Counted now, not from `every`: offloads in flight when `offloaded` was read may have
        # landed more files before the nodes died (a full run under load saw it).
        files_before = len(list((tmp_path / "dfs" / "objects").rglob("*.kvo")))
        reader.remove(every[0], force=True)  # read a moment ago: under a lease
        assert reader.get(every[0]) is None
        # The master removes the file itself (no node holds DFS objects).
        wait_until(lambda: len(list((tmp_path / "dfs" / "objects").rglob("*.kvo"))) == files_before - 1)


def test_a_stray_directory_named_like_an_object_file_does_not_stop_the_tiers_from_starting(make_cluster, tmp_path):
    """A directory where an object file would be (an operator's mkdir, a copy gone wrong) is
    left alone with a warning: the master rebuilds its DFS index and the node adopts its disk
    tier around it (before, either refused to start: 'IsADirectoryError', naming no path)."""
    dfs, disk = tmp_path / "dfs", tmp_path / "disk"
    cluster = make_cluster(0, "8MiB", master_args=("--dfs-dir", str(dfs)))
    node_args = ("--dfs-dir", str(dfs), "--disk-dir", str(disk), "--disk-size", "32MiB")
    node = cluster.start_node(node_args)
    values = values_for("kept", 2, OBJECT_SIZE)
    with Store(cluster.master_endpoint, dfs_dir=str(dfs)) as store:
        config = ReplicateConfig(with_dfs_copy=True, with_disk_copy=True)
        assert store.put_batch(list(values), list(values.values()), config) == [ErrorCode.OK] * 2
    stray_dfs = dfs / objectfile.dfs_relative_path("a-key-never-put", 0)
    stray_dfs.mkdir(parents=True)
    (disk / objectfile.OBJECTS_DIR / objectfile.disk_name(64 * 1024 * 1024)).mkdir()
    node.stop()
    cluster.master.kill()
    cluster.start_master()
    cluster.start_node(node_args)
    with Store(cluster.master_endpoint, dfs_dir=str(dfs)) as store:
        assert wait_until(lambda: all(store.batch_exists(list(values))), 10)
        assert store.get_batch(list(values)) == list(values.values())
        tiers = {t["tier"]: t["object_count"] for t in store.cluster_status().to_dict()["tiers"]}
        assert tiers["dfs"] == 2 and tiers["disk"] == 2
    assert stray_dfs.is_dir()  # left alone


def test_a_dfs_file_that_rots_is_checked_by_the_master_and_dropped(make_cluster, tmp_path):
    """An object whose only replica left is its DFS file (its node died), and the file's bytes
    change: a get is a miss, never the wrong bytes; the reader's report has the master (no
    node owns DFS files) re-read and hash the file, and drop it; the sound object stays."""
    dfs = tmp_path / "dfs"
    cluster = make_cluster(0, "8MiB", master_args=("--dfs-dir", str(dfs), "--node-ttl-ms", "1500"))
    node = cluster.start_node(("--dfs-dir", str(dfs)))
    rotten, sound = os.urandom(OBJECT_SIZE), os.urandom(OBJECT_SIZE)
    with Store(cluster.master_endpoint, dfs_dir=str(dfs), shm_enabled=False) as store:
        config = ReplicateConfig(with_dfs_copy=True)
        assert store.put_batch(["rotten", "sound"], [rotten, sound], config) == [ErrorCode.OK] * 2
        node.kill()
        wait_until(lambda: not [s for s in store.cluster_status().segments if s.segment.tier == "dram"])
        (replica,) = store.query(["rotten"]).replicas[0]  # the DFS file alone
        path = dfs / objectfile.dfs_relative_path("rotten", replica.offset)
        with open(path, "r+b") as file:
            file.seek(-100, os.SEEK_END)  # inside the object's bytes, past the header
            byte = file.read(1)
            file.seek(-1, os.SEEK_CUR)
            file.write(bytes([byte[0] ^ 0x10]))
        assert store.get("rotten") is None
        wait_until(lambda: not store.exists("rotten"))
        wait_until(lambda: not path.exists())  # the master removed the file itself
        assert store.get("sound") == sound


@pytest.mark.parametrize("api", ["Store", "AsyncStore"])
def test_a_same_host_get_whose_nearer_copy_rotted_reads_the_dfs_copy(make_cluster, tmp_path, monkeypatch, api):
    """An object with a DRAM replica and a DFS copy, its DRAM bytes rotted, read from the
    node's host: the key went on from the mapped copy to the DFS file, which the reads over
    TCP took for a node's (a sync get raised InvalidParams "not a host:port endpoint", for
    every key of the batch, an async get missed). It reads the DFS copy here now; a reader
    without the DFS mounted gets a clean miss."""
    dfs = tmp_path / "dfs"
    cluster = make_cluster(0, "8MiB", master_args=("--dfs-dir", str(dfs)))
    cluster.start_node(("--dfs-dir", str(dfs)))
    value, other = os.urandom(OBJECT_SIZE), os.urandom(OBJECT_SIZE)
    with Store(cluster.master_endpoint, dfs_dir=str(dfs)) as store:
        assert store.put_batch(["k", "other"], [value, other], ReplicateConfig(with_dfs_copy=True)) == [0, 0]
        assert wait_until(lambda: dfs_keys(store, ["k"]) == ["k"])
        segments = store.cluster_status().segment_infos()
        (dram,) = [r for r in store.query(["k"]).replicas[0] if segments[r.segment_id].tier == "dram"]
        with open(segments[dram.segment_id].shm_path, "r+b") as segment:
            segment.seek(limits.SEGMENT_HEADER_SIZE_BYTES + dram.offset + 100)
            segment.write(b"\x01\x02\x03")
    if api == "Store":
        with Store(cluster.master_endpoint, dfs_dir=str(dfs)) as reader:
            got = reader.get_batch(["k", "other"])
    else:
        from kvpool.transports import files

        read_object_bytes, read_on_the_loop = files.read_object_bytes, []

        def spied(*args, **kwargs):  # a file read on the event loop would stall it on a hung mount
            with contextlib.suppress(RuntimeError):
                read_on_the_loop.append(asyncio.get_running_loop())
            return read_object_bytes(*args, **kwargs)

        async def read() -> list:
            async with await AsyncStore.open(cluster.master_endpoint, dfs_dir=str(dfs)) as reader:
                return await reader.get_batch(["k", "other"])

        monkeypatch.setattr(files, "read_object_bytes", spied)
        got = asyncio.run(read())
        assert read_on_the_loop == []
    assert got == [value, other]
    with Store(cluster.master_endpoint) as without_the_dfs:  # the DRAM copy dropped as bad by now, or not
        assert without_the_dfs.get("k") in (None, value)


def test_a_running_node_takes_the_new_identity_of_a_dfs_emptied_under_it(make_cluster, tmp_path):
    """An operator empties the shared DFS directory and restarts the master, which gives it a
    new identity: the nodes kept the old one, and refused every DFS move against the new
    (a put's DFS copy, an offload) until they were restarted."""
    import shutil

    dfs = tmp_path / "dfs"
    cluster = make_cluster(0, "8MiB", master_args=("--dfs-dir", str(dfs)))
    cluster.start_node(("--dfs-dir", str(dfs)))
    config = ReplicateConfig(with_dfs_copy=True)
    with Store(cluster.master_endpoint, dfs_dir=str(dfs)) as store:
        store.put("before", b"b" * OBJECT_SIZE, config)
        assert dfs_keys(store, ["before"]) == ["before"]
    cluster.master.kill()
    shutil.rmtree(dfs)
    dfs.mkdir()
    cluster.start_master()
    with Store(cluster.master_endpoint, dfs_dir=str(dfs)) as store:
        assert wait_until(lambda: any(s.segment.tier == "dram" for s in store.cluster_status().segments), 10)
        store.put("after", b"a" * OBJECT_SIZE, config)
        assert dfs_keys(store, ["after"]) == ["after"]
        assert store.get("after") == b"a" * OBJECT_SIZE


def test_a_store_reads_a_dfs_mounted_after_it_first_looked(make_cluster, tmp_path, monkeypatch):
    """A serving process started before the share was mounted at its dfs_dir skipped the DFS
    for the life of its store; it looks again (after DFS_LOOK_AGAIN_S, a minute)."""
    from kvpool.client import directories

    monkeypatch.setattr(directories, "DFS_LOOK_AGAIN_S", 0.0)
    dfs, mount_point = tmp_path / "dfs", tmp_path / "mnt"
    cluster = make_cluster(0, "8MiB", master_args=("--dfs-dir", str(dfs), "--node-ttl-ms", "2000"))
    node = cluster.start_node(("--dfs-dir", str(dfs)))
    value = os.urandom(OBJECT_SIZE)
    with Store(cluster.master_endpoint, dfs_dir=str(dfs)) as store:
        store.put("k", value, ReplicateConfig(with_dfs_copy=True))
    node.kill()
    with Store(cluster.master_endpoint, dfs_dir=str(mount_point)) as reader:
        assert wait_until(lambda: reader.query(["k"]).replicas[0] and dfs_keys(reader, ["k"]) == ["k"]
                          and len(reader.query(["k"]).replicas[0]) == 1, 15)  # fmt: skip
        assert reader.get("k") is None  # nothing mounted at its dfs_dir yet
        mount_point.symlink_to(dfs)
        assert reader.get("k") == value


def test_a_dfs_directory_is_one_clusters(make_cluster, tmp_path):
    """A second cluster (another token) given the same --dfs-dir started without a word, read
    the first's objects, and its remove_all deleted their files under it: each master indexes
    every file there and allocates the tier's offsets alone (helper-48). Its master now
    refuses the directory; the first cluster, restarted, takes it again."""
    dfs = str(tmp_path / "dfs")
    cluster = make_cluster(0, "8MiB", master_args=("--dfs-dir", dfs), token="cluster-a-token")
    cluster.start_node(("--dfs-dir", dfs))
    with Store(cluster.master_endpoint, token="cluster-a-token", dfs_dir=dfs) as store:
        store.put("a/0", b"a" * OBJECT_SIZE, ReplicateConfig(with_dfs_copy=True))
        assert dfs_keys(store, ["a/0"]) == ["a/0"]
    other = kvpool_cli("master", "--port", "0", "--http-port", "0", "--dfs-dir", dfs, env={"KVPOOL_TOKEN": "cluster-b"})
    said = " ".join(other.stderr.decode().split())
    assert other.returncode == 1 and "Traceback" not in said, said
    assert f"{dfs} is the DFS tier of another cluster (another cluster token)" in said, said
    cluster.master.kill()
    cluster.start_master()
    with Store(cluster.master_endpoint, token="cluster-a-token", dfs_dir=dfs) as store:
        assert store.get("a/0") == b"a" * OBJECT_SIZE
