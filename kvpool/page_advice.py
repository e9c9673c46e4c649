"""Advice to the kernel (madvise) on the fresh memory a plain get lands in.

A plain get returns new bytes objects, and glibc maps a large one anew each time, so a copy
into it would fault its pages in one trap at a time. Two kinds of advice make that cheaper:

- `advise_huge_pages`: transparent huge pages on a block of several MiB, before anything
  touches it (one fault per 2 MiB).
- `populate`: map a block's pages in one call (MADV_POPULATE_WRITE) right before a copy fills
  it, in the thread that copies. On this VM a trap per 4 KiB page costs more than the kernel's
  own loop: 32 plain gets of 1 MiB objects from a same-host segment ran 1.26x faster
  (`python benchmarks/bench_paths.py landing`, docs/performance.md).

Only advice: a kernel without it (MADV_POPULATE_WRITE needs Linux 5.14; THP may be off)
changes the speed, never a result.
"""

from __future__ import annotations

import ctypes

from kvpool import limits

_madvise = ctypes.CDLL(None, use_errno=True).madvise
_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_MADV_HUGEPAGE = 14  # Linux (mmap.MADV_HUGEPAGE)
_MADV_POPULATE_WRITE = 23  # Linux 5.14 (mmap.MADV_POPULATE_WRITE, Python 3.12)
_PAGE_BYTES = 4 * limits.KIB
_HUGE_PAGE_BYTES = 2 * limits.MIB

# Blocks of at least this size ask for transparent huge pages: faulting 32 MiB in 4 KiB pages
# cost more than the copy itself (22 ms against 6 ms, bench_paths.py landing).
HUGE_PAGES_BYTES_MIN = 4 * limits.MIB
# Blocks of at least this size are populated before a copy fills them: smaller ones are a few
# traps, not worth a system call.
POPULATE_BYTES_MIN = 256 * limits.KIB


def advise_huge_pages(address: int, size: int) -> None:
    """Ask for transparent huge pages on the whole 2 MiB pages inside [address, +size), when
    `size` is at least HUGE_PAGES_BYTES_MIN, before anything touched them."""
    if size >= HUGE_PAGES_BYTES_MIN:
        _advise(address, size, _HUGE_PAGE_BYTES, _MADV_HUGEPAGE)


def populate(view: memoryview) -> None:
    """Map the whole pages of the writable `view` now, when it holds at least
    POPULATE_BYTES_MIN bytes: what a copy into fresh memory would do one fault at a time."""
    if view.nbytes >= POPULATE_BYTES_MIN:
        _advise(ctypes.addressof(ctypes.c_char.from_buffer(view)), view.nbytes, _PAGE_BYTES, _MADV_POPULATE_WRITE)


def _advise(address: int, size: int, unit: int, advice: int) -> None:
    start = -(-address // unit) * unit
    end = (address + size) // unit * unit
    if end > start:
        _madvise(start, end - start, advice)
