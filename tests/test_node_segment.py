"""Segment files (kvpool/node/segment.py): sizing, and the files a killed node leaves behind.

How: hugetlbfs cannot be mounted in CI, so os.statvfs is replaced by one that reports a 2 MiB
block size (what hugetlbfs reports) for pytest's tmp_path; the segment must then round its file
down to whole huge pages, or refuse a size that rounds below the minimum. A killed node is a
child process that creates a segment and is sent SIGKILL; its header's pid is then rewritten to
what another PID namespace would have left there. No sockets.
"""

from __future__ import annotations

import fcntl
import os
import struct
import subprocess
from pathlib import Path

import pytest
from conftest import dead_segment_owner

from kvpool import limits
from kvpool.errors import InvalidParams, SegmentNotFound
from kvpool.node.segment import MEMORY_FILESYSTEM_MAGICS, Segment, filesystem_magic, remove_stale_segments

HUGE_PAGE_SIZE_BYTES = 2 * limits.MIB


def fake_statvfs(block_size: int):
    real = os.statvfs

    class Result:
        def __init__(self, path: str) -> None:
            self.f_bsize = block_size
            self._real = real(path)

        def __getattr__(self, name: str) -> int:  # the free room and the rest: the real ones
            return getattr(self._real, name)

    return Result


def test_tmpfs_sizes_round_to_base_pages(tmp_path: Path) -> None:
    segment = Segment.create(str(tmp_path), "a", 3 * limits.MIB + 100, os.urandom(16))
    try:
        assert segment.capacity_bytes == 3 * limits.MIB
        assert segment.path.stat().st_size == limits.SEGMENT_HEADER_SIZE_BYTES + 3 * limits.MIB
    finally:
        segment.close()
    assert not segment.path.exists()


def test_hugetlbfs_sizes_round_to_huge_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "statvfs", fake_statvfs(HUGE_PAGE_SIZE_BYTES))
    segment = Segment.create(str(tmp_path), "huge", 5 * limits.MIB, os.urandom(16))
    try:
        file_size = segment.path.stat().st_size
        assert file_size % HUGE_PAGE_SIZE_BYTES == 0
        assert file_size == 4 * limits.MIB  # 5 MiB + header rounds down to two huge pages
        assert segment.capacity_bytes == file_size - limits.SEGMENT_HEADER_SIZE_BYTES
        assert len(segment.data) == segment.capacity_bytes
    finally:
        segment.close()


def test_hugetlbfs_size_that_rounds_below_the_minimum_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "statvfs", fake_statvfs(HUGE_PAGE_SIZE_BYTES))
    with pytest.raises(InvalidParams):
        Segment.create(str(tmp_path), "tiny", limits.SEGMENT_SIZE_BYTES_MIN, os.urandom(16))
    assert list(tmp_path.iterdir()) == []


def test_missing_directory_and_wrong_token(tmp_path: Path) -> None:
    with pytest.raises(InvalidParams):
        Segment.create(str(tmp_path / "absent"), "x", limits.MIB, os.urandom(16))
    segment = Segment.create(str(tmp_path), "x", limits.MIB, os.urandom(16))
    try:
        with pytest.raises(SegmentNotFound):
            Segment.open_mapped(str(segment.path), os.urandom(16))
    finally:
        segment.close()


def test_a_segment_larger_than_the_room_left_in_its_filesystem_is_refused_before_any_write() -> None:
    """Pre-faulting a tmpfs file beyond the filesystem's free room dies of SIGBUS part way:
    such a segment is refused at once, with the room there is, and leaves no file."""
    shm = "/dev/shm"
    room = os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize
    name = f"too-large-{os.getpid()}"
    with pytest.raises(InvalidParams, match="does not fit"):
        Segment.create(shm, name, room + limits.GIB, os.urandom(16))
    assert not any(name in entry for entry in os.listdir(shm))


def test_a_segment_directory_that_is_a_file_is_named_as_not_a_directory(tmp_path) -> None:
    """`--shm-dir` naming a file: statvfs takes it, and the create said only ENOTDIR on a
    path the operator never typed."""
    plain = tmp_path / "plain"
    plain.write_bytes(b"")
    with pytest.raises(InvalidParams, match=f"cannot make segments in {plain}: not a directory"):
        Segment.create(str(plain), "file-dir", limits.SEGMENT_SIZE_BYTES_MIN, os.urandom(16))


_TAKEN_MEANWHILE = """
import os, sys
from kvpool.errors import InvalidParams
from kvpool.node import segment
directory = sys.argv[1]
os.system(f"mount -t tmpfs -o size=8m kvpool-test {directory}")
room_before = os.statvfs(directory)  # what the node saw: 8 MiB free
with open(os.path.join(directory, "another-process"), "wb") as other:
    other.write(b"x" * (6 << 20))  # meanwhile another process takes 6 MiB
segment.os.statvfs = lambda path: room_before
try:
    segment.Segment.create(directory, "late", 4 << 20, os.urandom(16))
except InvalidParams as exc:
    print("refused:", exc)
print("left:", sorted(os.listdir(directory)))
"""


def test_a_segment_whose_room_was_taken_after_the_check_is_refused_not_killed_by_sigbus(tmp_path: Path) -> None:
    """Another process may fill the filesystem between the room check and the pre-faulting
    (two nodes starting at once on one host): the node gets a clear error and leaves no file,
    instead of dying of SIGBUS on the first page the filesystem cannot give. A real 8 MiB
    tmpfs, mounted in a private mount namespace (unshare), so nothing of the host's changes."""
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) on this machine")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here: {probe.stderr.decode().strip()}")
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    done = subprocess.run(
        ["unshare", "-rm", sys.executable, "-c", _TAKEN_MEANWHILE, str(mount_point)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, f"the node died (returncode {done.returncode}): {done.stderr[-2000:]}"
    assert "refused: a segment of" in done.stdout and "does not fit" in done.stdout, done.stdout
    assert "left: ['another-process']" in done.stdout, done.stdout


def test_a_node_killed_while_its_header_pid_is_alive_here_restarts(tmp_path: Path) -> None:
    """A node that ran as PID 1 of its container, with /dev/shm shared, and was SIGKILLed (OOM)
    left pid 1 in its file's header, and pid 1 is alive in the next container: the file was
    never found stale, and the node restarted with the same id could not create its segment
    (EEXIST). Whether the owner lives is its flock's to say, which died with it."""
    path = dead_segment_owner(tmp_path, "pid1", 4 * limits.MIB)
    with open(path, "r+b") as file:  # the pid as the dead node saw it: alive here (this test's)
        file.seek(40)
        file.write(struct.pack("<Q", os.getpid()))
    assert remove_stale_segments(str(tmp_path)) == [path]
    restarted = Segment.create(str(tmp_path), "pid1", 4 * limits.MIB, os.urandom(16))
    try:
        assert restarted.path == path
        assert remove_stale_segments(str(tmp_path)) == []  # its own lock: alive, kept
        assert path.exists()
    finally:
        restarted.close()


def test_a_sweep_never_removes_the_file_of_a_node_that_restarted_under_it(tmp_path, monkeypatch):
    """A sweep opened a dead node's file; before it took the lock, that node restarted (its own
    start removed the old file and made a new one, locked, at the same path). The sweep's lock
    on the old, unlinked file succeeded, and it unlinked the path: the live node's new file.
    Every running node sweeps every 30 s, so a restart loop of one node id meets it."""
    path = dead_segment_owner(tmp_path, "x", 4 * limits.MIB)
    restarted: list[Segment] = []
    flock, turns = fcntl.flock, []

    def restart_then_lock(fd: int, operation: int) -> None:
        turns.append(fd)
        if len(turns) == 1:  # the sweep holds the old file open: "x" restarts now
            path.unlink()
            restarted.append(Segment.create(str(tmp_path), "x", 4 * limits.MIB, os.urandom(16)))
        flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", restart_then_lock)
    try:
        assert remove_stale_segments(str(tmp_path)) == []
        monkeypatch.undo()
        assert restarted and restarted[0].path == path and path.exists()
    finally:
        monkeypatch.undo()
        for segment in restarted:
            segment.close()


def test_the_filesystem_under_a_segment_directory_is_told_as_stat_tells_it(tmp_path):
    """A node warns when its --shm-dir is not in memory (the kernel writes the segment back to
    a disk): the kernel's statfs type of the directory itself, as `stat -f` reads it."""
    for directory in ("/dev/shm", str(tmp_path)):
        shown = subprocess.run(["stat", "-f", "-c", "%t", directory], capture_output=True, text=True, check=True)
        assert filesystem_magic(directory) == int(shown.stdout, 16), directory
    assert filesystem_magic("/dev/shm") in MEMORY_FILESYSTEM_MAGICS
    assert filesystem_magic(str(tmp_path / "absent")) is None
