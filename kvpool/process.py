"""What belongs to one process and not to a child forked from it: which fork of the process
this is, and its thread pools (and how a call leaves work it gave them: `settle`); and the
process's resources: its open files limit, its standard output once writes to it fail.

A child forked from a process (multiprocessing's default start method on Linux, as serving
engines' worker pools use it) inherits a copy of the parent's objects but none of its other
threads: work submitted to a copied thread pool would wait forever, and a lock another parent
thread held at the fork would never be released. So in the child every pool here forgets its
executor and its lock (the next use starts new threads), and `forks()` counts one more: an
object that recorded the count when it was made (a client's connections) knows it was made
by an ancestor, whose sockets it must leave alone (client/sync.py, client/pool.py).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import resource
import sys
import threading
import time
import weakref
from collections.abc import Sequence

from kvpool import limits

log = logging.getLogger(__name__)

# How long a call that raised waits for the pool tasks it started (settle): the transfer
# timeout, the bound of every read.
SETTLE_TIMEOUT_S = limits.TRANSFER_TIMEOUT_MS_DEFAULT / 1000

_forks = 0


def forks() -> int:
    """How many forks separate this process from the one that imported kvpool first."""
    return _forks


class ThreadPool:
    """A ThreadPoolExecutor of `threads` threads named `name`-N, made when first asked for."""

    def __init__(self, threads: int, name: str) -> None:
        self.threads = threads
        self._name = name
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        _pools.add(self)

    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix=self._name)
            return self._executor

    def _forget_after_fork(self) -> None:
        self._lock = threading.Lock()
        self._executor = None  # its threads are the parent's; nothing here waits on them


def settle(futures: Sequence[concurrent.futures.Future], timeout_s: float = SETTLE_TIMEOUT_S) -> None:
    """Return once none of `futures` runs, or after `timeout_s`: a call that raises (its own
    part failed, or Ctrl-C came while it waited) must not leave pool threads copying into
    buffers and segment ranges its caller then frees (an unregistered buffer, a revoked put's
    ranges, a raw address unmapped: a crash, or the next put's bytes overwritten). Those not
    started are cancelled; the others finish their copy (milliseconds), interrupts or not. A
    read of a file on a hung mount may not: it is left running after the bound, and said."""
    for future in futures:
        future.cancel()
    deadline_s = time.monotonic() + timeout_s
    pending = [future for future in futures if not future.done()]
    while pending and (left_s := deadline_s - time.monotonic()) > 0:
        try:
            concurrent.futures.wait(pending, timeout=left_s)
        except KeyboardInterrupt:
            pass  # the caller re-raises the first one
        pending = [future for future in pending if not future.done()]
    if pending:
        log.warning("%d pool tasks of a call that raised still run after %.0f s (a hung filesystem?): "
                    "the memory they write must not be freed until they end", len(pending), timeout_s)  # fmt: skip


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit; returns the limit
    now. Every connection holds a descriptor, and a node's disk read one more per object file
    until its frame is sent: the usual soft limit of 1,024 is a few batch gets of small
    objects on a node, and about a thousand clients of a master (docs/operations.md)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:  # an unlimited hard limit above the kernel's nr_open
        log.warning("cannot raise the open files limit from %d to %d: %s", soft, hard, exc)
        return soft
    return hard


def discard_stdout() -> None:
    """Send the rest of this process's standard output to /dev/null, once a write to it failed
    (a full disk, a reader that left: `| head`): what stays buffered would fail again at the
    interpreter's flush at exit, with a second message. Never raises."""
    with contextlib.suppress(OSError, ValueError):  # ValueError: sys.stdout closed or replaced
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)


_pools: weakref.WeakSet[ThreadPool] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    global _forks
    _forks += 1
    for pool in list(_pools):
        pool._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)

__all__ = ["ThreadPool", "discard_stdout", "forks", "raise_open_files_limit", "settle"]
