"""Segment sizing (kvpool/node/segment.py): the file size follows the filesystem's page size.

How: hugetlbfs cannot be mounted in CI, so os.statvfs is replaced by one that reports a 2 MiB
block size (what hugetlbfs reports) for pytest's tmp_path; the segment must then round its file
down to whole huge pages, or refuse a size that rounds below the minimum. No sockets.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvpool import limits
from kvpool.errors import InvalidParams, SegmentNotFound
from kvpool.node.segment import Segment

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
