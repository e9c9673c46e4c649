"""HostDirectories (kvpool/client/directories.py): which disk and DFS directories a client
opens here, looked at on threads of their own. Cluster tests (test_cluster_disk.py,
test_cluster_dfs.py) cover hung and slow mounts through real gets; here, the looks a get
starts, with real directories."""

from __future__ import annotations

from kvpool.client import directories
from kvpool.client.directories import HostDirectories
from kvpool.protocol.messages import TIER_DFS, SegmentInfo


def _dfs_info() -> SegmentInfo:
    info = SegmentInfo("dfs-1", "", "", "", "", b"dfs-token", 1 << 30)
    info.tier = TIER_DFS
    return info


def test_a_dfs_not_mounted_is_looked_for_again_a_minute_on_not_at_every_get(tmp_path, monkeypatch):
    """A client whose dfs_dir holds no DFS yet (the share not mounted) skips DFS replicas and
    looks again after DFS_LOOK_AGAIN_S. The waits of gets started a look (a thread, a read of
    the share) at every get meanwhile."""
    looks = []
    real = directories.DfsDirectory

    class CountedDfs(real):
        def has_token(self, token: bytes) -> bool:
            looks.append(token)
            return super().has_token(token)

    monkeypatch.setattr(directories, "DfsDirectory", CountedDfs)
    host = HostDirectories("host-a", True, str(tmp_path))
    info = _dfs_info()
    for _ in range(5):  # as each get does: wait for the looks its replicas need, then choose
        host.wait(host.looks_for([info]))
        assert host.find(info) is None
    assert len(looks) == 1
    monkeypatch.setattr(host, "_dfs_look_again_at", 0.0)  # a minute on
    host.wait(host.looks_for([info]))
    assert host.find(info) is None and len(looks) == 2
