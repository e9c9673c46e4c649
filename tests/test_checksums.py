"""Checksums and the same-host copies that compute them on the way (kvpool/checksums.py): the
checksum is xxh3-64 of the object whatever the split of its source and destination buffers,
the bytes land whole and only where they should, and a batch gives the same answers on
several threads as on one. Chunk sizes are shrunk so that every boundary appears."""

from __future__ import annotations

import itertools
import os
import threading
import time

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool import checksums
from kvpool.checksums import checksums_of, copies_checksummed, copy_checksummed
from kvpool.process import ThreadPool


def _split(data: bytes, cuts: list[int]) -> list[memoryview]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    edges = [0, *points, len(data)]
    return [memoryview(data)[a:b] for a, b in itertools.pairwise(edges)]


@settings(max_examples=200, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=3000),
    source_cuts=st.lists(st.integers(0, 3000), max_size=4),
    target_cuts=st.lists(st.integers(0, 3000), max_size=4),
    spare=st.integers(0, 40),
    chunk=st.sampled_from([1, 7, 64, 1000]),
    small=st.sampled_from([0, 100, 5000]),
    simd=st.sampled_from([1, 64, 100_000]),
)
def test_copy_lands_the_object_and_returns_its_checksum(data, source_cuts, target_cuts, spare, chunk, small, simd):
    names = ("COPY_CHUNK_BYTES", "SMALL_COPY_BYTES_MAX")
    saved = [getattr(checksums, name) for name in names]
    for name, value in zip(names, (chunk, small)):
        setattr(checksums, name, value)
    try:
        landing = bytearray(b"\xee" * (len(data) + spare))
        targets = _split(bytes(len(landing)), target_cuts)  # only the sizes matter
        views, at = [], 0
        for part in targets:
            views.append(memoryview(landing)[at : at + len(part)])
            at += len(part)
        assert copy_checksummed(_split(data, source_cuts), views, simd) == xxhash.xxh3_64_intdigest(data)
        assert bytes(landing[: len(data)]) == data
        assert landing[len(data) :] == b"\xee" * spare  # nothing written past the object
    finally:
        for name, value in zip(names, saved):
            setattr(checksums, name, value)


def test_copy_into_a_destination_at_any_offset_from_its_source() -> None:
    # Offsets 1-31 bytes apart modulo 4 KiB are the ones glibc's memcpy is slow for here.
    source = np.frombuffer(os.urandom(3 << 20), dtype=np.uint8)
    for shift in (0, 8, 16, 31, 32, 4095):
        landing = np.zeros((3 << 20) + 4096, dtype=np.uint8)
        target = memoryview(landing)[shift : shift + len(source)]
        assert copy_checksummed([memoryview(source)], [target]) == xxhash.xxh3_64_intdigest(source)
        assert np.array_equal(landing[shift : shift + len(source)], source)


@pytest.mark.parametrize("object_bytes", [4096, 300 << 10])
def test_a_large_batch_on_several_threads_gives_what_one_thread_gives(monkeypatch, object_bytes) -> None:
    objects = [os.urandom(object_bytes) for _ in range(16)]
    expected = [xxhash.xxh3_64_intdigest(o) for o in objects]
    for parallel_min in (1 << 40, 1):  # one thread; then every batch split
        monkeypatch.setattr(checksums, "PARALLEL_BYTES_MIN", parallel_min)
        landings = [bytearray(object_bytes) for _ in objects]
        sources = [[memoryview(o)] for o in objects]
        assert copies_checksummed(sources, [[memoryview(t)] for t in landings]) == expected
        assert landings == [bytearray(o) for o in objects]
        assert checksums_of([[memoryview(o)] for o in objects]) == expected


def test_a_mixed_batch_lands_every_object_in_order() -> None:
    """copies_checksummed's tight loop for small one-piece objects and the general path for the
    rest, in one batch: each answer is its own object's checksum, each object lands whole, and
    a destination longer than its object keeps its tail."""
    sizes_and_splits = [(4096, 1, 1), (0, 1, 1), (16 << 10, 1, 1), (5000, 3, 1), (300 << 10, 1, 1),
                        (7000, 1, 2), (100, 1, 1), ((16 << 10) + 1, 1, 1)]  # fmt: skip
    objects = [os.urandom(size) for size, _, _ in sizes_and_splits]
    landings = [bytearray(b"\xee" * (size + 9)) for size, _, _ in sizes_and_splits]
    copies = []
    for data, landing, (size, source_parts, target_parts) in zip(objects, landings, sizes_and_splits):
        sources = _split(data, [size * i // source_parts for i in range(1, source_parts)])
        cut = (size + 9) // 2 if target_parts == 2 else len(landing)
        targets = [memoryview(landing)[:cut], memoryview(landing)[cut:]][:target_parts]
        copies.append((sources, targets))
    expected = [xxhash.xxh3_64_intdigest(o) for o in objects]
    assert copies_checksummed([s for s, _ in copies], [t for _, t in copies]) == expected
    assert checksums_of([sources for sources, _ in copies]) == expected  # some in several parts
    assert checksums_of([[memoryview(o)] for o in objects]) == expected  # each in one part
    for data, landing in zip(objects, landings):
        assert bytes(landing[: len(data)]) == data and landing[len(data) :] == b"\xee" * 9


@pytest.mark.parametrize("failure", [KeyboardInterrupt, ValueError])
def test_a_split_copy_that_raises_returns_only_once_no_share_is_still_copying(monkeypatch, failure):
    """Ctrl-C in the caller's share (or its share failing) left the pool threads copying
    their shares after the call raised: into a buffer the caller then unregistered (a crash
    when it was unmapped), or into a put's ranges the master then freed (the next put's bytes
    overwritten: acknowledged puts lost)."""
    monkeypatch.setattr(checksums, "_THREAD_COUNT", 4)
    still_copying = threading.Event()
    done: list[int] = []

    def copy(item: int) -> int:
        if item == 0:  # the caller's share, while the others copy
            time.sleep(0.05)
            raise failure()
        still_copying.set()
        time.sleep(0.2)
        done.append(item)
        return item

    with pytest.raises(failure):
        checksums._in_shares(copy, range(8), [1 << 20] * 8)
    assert still_copying.is_set()
    finished_by_then = sorted(done)
    time.sleep(0.5)  # what a share left running would finish meanwhile
    assert sorted(done) == finished_by_then and finished_by_then, (finished_by_then, done)


def test_a_call_that_raised_waits_for_a_hung_task_only_so_long(caplog):
    """A read of a file on a hung mount may never end: Ctrl-C must still end the call, after
    the bound, saying that the task runs on."""
    from kvpool.process import settle

    pool = ThreadPool(1, "test-hung")
    release = threading.Event()
    hung = pool.executor().submit(release.wait, 10)
    started = time.monotonic()
    settle([hung], timeout_s=0.3)
    assert 0.25 < time.monotonic() - started < 2 and not hung.done()
    assert "still run after" in caplog.text
    release.set()
