"""Object checksums: xxh3-64 of an object's bytes, alone or for a whole batch at once, and the
copies that compute them on the way.

Every object carries the xxh3-64 of its bytes: the client computes it at put, the node checks
it before it records a write, and the client checks it again after every read (STYLE.md "pair
the checks"). This module is the arithmetic, and the same-host copies that feed it:

- A copy hashes each chunk of what it wrote right after writing it, while the chunk is still
  in the core's cache (COPY_CHUNK_BYTES), instead of reading the whole object back afterwards.
- A large batch runs on a small pool of threads, the caller taking one share: numpy's copy
  and xxhash both release the GIL on large inputs, and the caller is waiting anyway.
- Copies go through numpy's SIMD loop, not glibc's memcpy (see _copy).

`python benchmarks/bench_paths.py copies`, 32 x 1 MiB into a numpy array, eight runs on this
shared VM: chunk by chunk on two threads beat copy-then-hash (the previous way) in every run,
by 1.04-1.41x (median 1.2x; 5.6-8.1 against 4.0-6.8 GB/s; a numpy copy alone, no hash,
7.1-9.1). A put of the same bytes in 64 parts of 16 KiB per object (one per layer) takes the
memcpy path: 0.91-1.0x of the previous way in four runs (the per-part bookkeeping).
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Collection, Sequence
from typing import TypeVar

import numpy as np
import xxhash

from kvpool import page_advice
from kvpool.process import ThreadPool, settle

# Batches smaller than this are handled in the calling thread: a hand-off costs more.
PARALLEL_BYTES_MIN = 1 << 20
# Copied, then hashed while still in cache (this machine's L2 is 1 MiB per core: the source
# and destination chunks together stay well inside it).
COPY_CHUNK_BYTES = 256 << 10
# Objects up to this size are copied with one memcpy and hashed once.
SMALL_COPY_BYTES_MAX = 16 << 10
# Pieces from this size up take _copy, smaller ones (a layer of a KV page, say) memcpy: numpy's
# call costs a few us. Into a caller's buffer (a get) from 64 KiB: such a buffer is often 16
# bytes past a page (numpy), the case `rep movsb` is slow for. Into a segment (a put), whose
# ranges are aligned, that case needs a source 1-31 bytes short of a page boundary (rare), so
# only whole chunks take _copy there (a put in 64 KiB parts: 0.55-0.63x through it, `copies`).
SIMD_COPY_BYTES_MIN = 64 << 10
SIMD_COPY_INTO_SEGMENT_BYTES_MIN = COPY_CHUNK_BYTES
# A copy through numpy's SIMD loop rather than glibc's memcpy, which copies 2 KiB-512 KiB
# with `rep movsb`: this machine's CPUs (AMD EPYC) run that 3x slower when the destination
# is 1-31 bytes past the source modulo 4 KiB, as it is from a segment into a numpy array
# (data at +16). Both release the GIL; elsewhere they run at the same speed.
_copy = np.positive
_THREAD_COUNT = min(4, os.cpu_count() or 1)
_pool = ThreadPool(_THREAD_COUNT, "kvpool-hash")

Parts = Sequence[memoryview | bytes]
T = TypeVar("T")
R = TypeVar("R")


def checksum_of(parts: Parts) -> int:
    """xxh3-64 of the concatenation of `parts`."""
    if len(parts) == 1:
        return xxhash.xxh3_64_intdigest(parts[0])
    hasher = xxhash.xxh3_64()
    for part in parts:
        hasher.update(part)
    return hasher.intdigest()


def checksums_of(objects: Sequence[Parts]) -> list[int]:
    """The checksum of each object (each a list of parts), on several threads when large."""
    if all(len(parts) == 1 for parts in objects):  # the common case, kept tight (4 KiB pages)
        sizes = [len(parts[0]) for parts in objects]
        if sum(sizes) < PARALLEL_BYTES_MIN:
            digest = xxhash.xxh3_64_intdigest
            return [digest(parts[0]) for parts in objects]
        return _in_shares(checksum_of, objects, sizes)
    return _in_shares(checksum_of, objects, [sum(len(p) for p in parts) for parts in objects])


def copy_bytes(source: memoryview, destination: memoryview) -> None:
    """Copy `source` into `destination` (as long) through _copy: fast at any offsets."""
    _copy(np.frombuffer(source, np.uint8), out=np.frombuffer(destination, np.uint8))


def copy_checksummed(
    sources: Parts,
    destinations: Sequence[memoryview],
    simd_bytes_min: int = SIMD_COPY_BYTES_MIN,
    is_fresh: bool = False,
) -> int:
    """Copy the concatenation of `sources` into `destinations` (as many bytes or more) and
    return the xxh3-64 of the bytes copied, hashed from where they landed: what a reader
    checks is what it got, and a writer's checksum is of what it wrote. Pieces of at least
    `simd_bytes_min` bytes are copied with _copy, smaller ones with memcpy. Fresh
    destinations (a plain get's new bytes) are populated first (page_advice.py)."""
    if is_fresh:
        for destination in destinations:
            page_advice.populate(destination)
    if len(destinations) == 1:
        return _copy_into(sources, destinations[0], simd_bytes_min)
    return _copy_scattered(sources, destinations, simd_bytes_min)


def _copy_into(sources: Parts, destination: memoryview, simd_bytes_min: int) -> int:
    """copy_checksummed into one buffer (a segment range, a bytes object, one registered
    buffer): the common case, kept tight because a KV page may come in one part per layer.
    (A small object in one piece never gets here: copies_checksummed copies it inline.)"""
    hasher = xxhash.xxh3_64()
    at = hashed_to = 0  # bytes of `destination` written, and hashed
    for part in sources:
        size = len(part)
        if size < simd_bytes_min:  # one piece (a layer of a KV page, say): kept tight
            destination[at : at + size] = part
            at += size
        else:
            source = memoryview(part)
            for start in range(0, size, COPY_CHUNK_BYTES):
                piece = np.frombuffer(source[start : start + COPY_CHUNK_BYTES], np.uint8)
                _copy(piece, out=np.frombuffer(destination, np.uint8, len(piece), at))
                at += len(piece)
                hasher.update(destination[hashed_to:at])  # what landed, while it is in cache
                hashed_to = at
        if at - hashed_to >= COPY_CHUNK_BYTES:
            hasher.update(destination[hashed_to:at])
            hashed_to = at
    hasher.update(destination[hashed_to:at])
    return hasher.intdigest()


def _copy_scattered(sources: Parts, destinations: Sequence[memoryview], simd_bytes_min: int) -> int:
    """copy_checksummed into several buffers (one per layer, say), piece by piece."""
    hasher = xxhash.xxh3_64()
    targets = iter(destinations)
    target = memoryview(bytearray())
    at = 0  # bytes of `target` already written
    for part in sources:
        source = memoryview(part)
        position = 0
        while position < len(source):
            if at == len(target):
                target, at = next(targets), 0
            size = min(COPY_CHUNK_BYTES, len(source) - position, len(target) - at)
            landed = target[at : at + size]
            if size < simd_bytes_min:
                landed[:] = source[position : position + size]
            else:
                _copy(np.frombuffer(source, np.uint8, size, position), out=np.frombuffer(landed, np.uint8))
            hasher.update(landed)
            position += size
            at += size
    return hasher.intdigest()


def copies_checksummed(
    sources: Sequence[Parts],
    destinations: Sequence[Sequence[memoryview]],
    simd_bytes_min: int = SIMD_COPY_BYTES_MIN,
    fresh: Collection[int] = (),
) -> list[int]:
    """copy_checksummed of each object (`sources[i]` into `destinations[i]`; those whose index
    is in `fresh` into fresh memory), on several threads when large and in large pieces
    (small pieces are Python work under the GIL: threads would only take turns). Each
    thread populates the fresh destinations it copies into: in parallel, as their faults
    would have been. A small object in one piece into one buffer (a batch of
    KV pages) is copied and hashed in one tight loop: 4x faster than the general path for
    128 x 4 KiB. Two lists rather than a pair per object: a batch keeps fewer objects alive
    for the garbage collector (protocol/messages.py, on gc=False)."""
    checksums = [0] * len(sources)
    others: list[int] = []
    for index, parts in enumerate(sources):
        targets = destinations[index]
        if len(parts) == 1 and len(targets) == 1 and len(parts[0]) <= SMALL_COPY_BYTES_MAX:
            source, destination = parts[0], targets[0]
            if len(destination) != len(source):
                destination = destination[: len(source)]
            checksums[index] = copy_small_checksummed(source, destination)
        else:
            others.append(index)
    if others:
        rest = _copies_checksummed(
            [sources[i] for i in others],
            [destinations[i] for i in others],
            simd_bytes_min,
            [i in fresh for i in others] if fresh else None,
        )
        for index, checksum in zip(others, rest):
            checksums[index] = checksum
    return checksums


def copy_small_checksummed(source: memoryview | bytes, destination: memoryview) -> int:
    """Copy an object in one piece of up to SMALL_COPY_BYTES_MAX into `destination` (as long)
    with one memcpy, and return the xxh3-64 of the bytes where they landed."""
    destination[:] = source
    return xxhash.xxh3_64_intdigest(destination)


def _copies_checksummed(
    sources: Sequence[Parts],
    destinations: Sequence[Sequence[memoryview]],
    simd_bytes_min: int,
    is_fresh: Sequence[bool] | None,
) -> list[int]:
    sizes = [sum(len(p) for p in parts) for parts in sources]
    pieces = sum(max(len(parts), len(targets)) for parts, targets in zip(sources, destinations))

    def copy(i: int) -> int:
        return copy_checksummed(sources[i], destinations[i], simd_bytes_min, is_fresh is not None and is_fresh[i])

    if sum(sizes) < simd_bytes_min * pieces:  # the average piece is small
        return [copy(i) for i in range(len(sources))]
    return _in_shares(copy, range(len(sources)), sizes)


def _in_shares(function: Callable[[T], R], items: Sequence[T], sizes: Sequence[int]) -> list[R]:
    """[function(item) for item in items], split into contiguous shares of about equal bytes
    when the batch is large: the caller runs the first share, pool threads the others."""
    total_bytes = sum(sizes)
    if total_bytes < PARALLEL_BYTES_MIN or len(items) < 2 or _THREAD_COUNT < 2:
        return [function(item) for item in items]
    shares: list[list[T]] = [[]]
    share_bytes = 0
    target_bytes = total_bytes / _THREAD_COUNT
    for item, size in zip(items, sizes):
        if share_bytes >= target_bytes and len(shares) < _THREAD_COUNT:
            shares.append([])
            share_bytes = 0
        shares[-1].append(item)
        share_bytes += size
    others: list[concurrent.futures.Future[list[R]]] = []
    try:
        pool = _pool.executor()
        others.extend(pool.submit(lambda share=share: [function(item) for item in share]) for share in shares[1:])
        results = [function(item) for item in shares[0]]
        for future in others:
            results.extend(future.result())
    except BaseException:  # its caller may free the buffers and ranges the others copy into
        settle(others)
        raise
    return results

