"""page_advice: populating fresh memory maps its pages before a copy touches them, and the
copies of a same-host batch do it for the destinations marked fresh only."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest
import xxhash

from kvpool import checksums, limits, page_advice


def _resident_kib(region: mmap.mmap) -> int:
    """Rss of the mapping that starts where `region` does, from /proc/self/smaps."""
    start = f"{np.frombuffer(region, np.uint8).ctypes.data:x}-"
    with open("/proc/self/smaps") as smaps:
        lines = iter(smaps.read().splitlines())
    for line in lines:
        if line.startswith(start):
            return next(int(d.split()[1]) for d in lines if d.startswith("Rss:"))
    raise AssertionError("mapping not found in /proc/self/smaps")


@pytest.fixture
def fresh_region():
    region = mmap.mmap(-1, 4 * limits.MIB)  # anonymous, private: no page mapped yet
    yield region
    region.close()


def test_populate_maps_every_page_of_a_fresh_block_without_writing_it(fresh_region) -> None:
    assert _resident_kib(fresh_region) == 0
    page_advice.populate(memoryview(fresh_region)[: 2 * limits.MIB])
    assert _resident_kib(fresh_region) >= 2 * 1024  # the kernel may map more, never less
    assert not any(fresh_region[: 2 * limits.MIB])  # mapped as zeros: nothing was written


def test_populate_leaves_blocks_under_the_threshold_alone(fresh_region) -> None:
    page_advice.populate(memoryview(fresh_region)[: page_advice.POPULATE_BYTES_MIN - 1])
    assert _resident_kib(fresh_region) == 0


def test_copies_populate_the_fresh_destinations_only(monkeypatch) -> None:
    """The threads copying a batch populate the destinations whose index is in `fresh`, and
    the bytes land and hash the same either way."""
    populated: list[int] = []
    monkeypatch.setattr(page_advice, "populate", lambda view: populated.append(view.nbytes))
    size = limits.MIB
    sources = [[memoryview(os.urandom(size))] for _ in range(4)]
    targets = [bytearray(size + index) for index in range(4)]  # told apart by their sizes
    landed = checksums.copies_checksummed(sources, [[memoryview(t)] for t in targets], fresh={1, 3})
    assert sorted(populated) == [size + 1, size + 3]
    for source, target, checksum in zip(sources, targets, landed):
        assert target[:size] == source[0]
        assert checksum == xxhash.xxh3_64_intdigest(source[0])
