"""`HostDirectories`: which disk-tier and DFS directories a client can open on this host, found
out without a hung mount ever holding a get for good.

A get reads a same-host disk tier's object files (or the DFS's, at the client's dfs_dir) straight
from the filesystem once it knows the directory is the segment the master names: its identity
file holds the segment's token (transports/files.py, transports/dfs.py). That first look reads a
file, and on a hung mount (NFS, a DFS) the read never ends. So each look runs on a daemon thread
of its own (the interpreter does not wait for it at exit; one per directory at a time, at most
LOOKS_IN_FLIGHT_MAX in all), and a get waits for the looks its replicas need until LOOK_WAIT_MS
after each began (`wait`, `wait_async`: every get that meets a look under way waits for the same
deadline, not a new one). Past it, the get goes on without the directory (a disk tier is read
through its node, a DFS replica is skipped) and a later get takes the look's answer (`find`).

Before 2026-12-07 the look ran in the get's thread and held it for good (an AsyncStore's event
loop with it); for some hours that day, on a shared pool of two threads, which two hung looks
took from every other look of the process, and whose threads the interpreter waited for at exit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from kvpool.protocol.messages import TIER_DFS, TIER_DISK, SegmentInfo
from kvpool.repeated_log import RepeatedLog
from kvpool.transports import files
from kvpool.transports.dfs import DfsDirectory

log = logging.getLogger(__name__)

# Long enough for a mount that comes up at its first access (autofs, a cold NFS cache: a
# `kvpool get` is always a first access), short beside the reads' own bound (a transfer timeout).
LOOK_WAIT_MS = 2_000
# Looks under way at once, at most: each may be a thread stuck on a hung mount for good.
LOOKS_IN_FLIGHT_MAX = 16
# A DFS not found at a store's dfs_dir (the share not mounted yet) is looked for again after
# this long: it was skipped for the life of the store.
DFS_LOOK_AGAIN_S = 60.0
# Directories remembered (and forgotten all at once past it: each is looked at again when met).
DIRECTORIES_REMEMBERED_MAX = 65_536

_slow_look = RepeatedLog(log, logging.WARNING)


class _Look:
    """One look at a directory under way: its answer (the directory, or None: not here) and
    the time (monotonic) until which gets wait for it."""

    __slots__ = ("answer", "wait_until")

    def __init__(self) -> None:
        self.answer: concurrent.futures.Future[Path | None] = concurrent.futures.Future()
        self.answer.set_running_or_notify_cancel()  # a waiter that gives up cannot cancel it
        self.wait_until = time.monotonic() + LOOK_WAIT_MS / 1000


class HostDirectories:
    """Per disk or DFS segment met, the directory of its object files if this host can open
    them. Any thread."""

    def __init__(self, hostname: str, shm_enabled: bool, dfs_dir: str) -> None:
        self._hostname = hostname
        self._shm_enabled = shm_enabled
        self._dfs_dir = dfs_dir
        self._found: dict[str, Path | None] = {}
        self._looks: dict[str, _Look] = {}  # under way, or answered and not taken yet
        self._lock = threading.Lock()
        self._dfs_look_again_at = 0.0

    def find(self, info: SegmentInfo) -> Path | None:
        """The directory of the segment's object files if this host can open them; None when
        it cannot, or is not known to yet (a look under way). Never waits."""
        segment_id = info.segment_id
        found = self._found  # (another thread may replace it meanwhile)
        if self._is_known(info, found):
            return found[segment_id]
        if not self._may_be_here(info):
            self._remember(segment_id, None)
            return None
        look = self._look_at(info)
        if look is None or not look.answer.done():
            return None
        with self._lock:
            if self._looks.get(segment_id) is look:
                del self._looks[segment_id]
        directory = look.answer.result()
        self._remember(segment_id, directory)
        return directory

    def looks_for(self, segments: Iterable[SegmentInfo]) -> list[_Look]:
        """The looks under way at these segments' directories (begun here when none is), for a
        get to wait for before it chooses its replicas."""
        looks = []
        found = self._found
        for info in segments:
            if info.tier not in (TIER_DISK, TIER_DFS) or self._is_known(info, found):
                continue
            if self._may_be_here(info) and (look := self._look_at(info)) is not None and not look.answer.done():
                looks.append(look)
        return looks

    def _is_known(self, info: SegmentInfo, found: dict[str, Path | None]) -> bool:
        """Whether the segment's directory is known (here or not), with no look due: a DFS not
        found is looked for again DFS_LOOK_AGAIN_S on."""
        if info.segment_id not in found:
            return False
        return info.tier != TIER_DFS or found[info.segment_id] is not None or time.monotonic() < self._dfs_look_again_at

    def wait(self, looks: list[_Look]) -> None:
        """Until these looks are answered or their time to be waited for is up."""
        if looks:
            left_s = max(look.wait_until for look in looks) - time.monotonic()
            concurrent.futures.wait([look.answer for look in looks], timeout=max(0.0, left_s))
        self._say_unanswered(looks)

    async def wait_async(self, looks: list[_Look]) -> None:
        """`wait`, for an event loop, which it does not block."""
        if looks:
            left_s = max(look.wait_until for look in looks) - time.monotonic()
            answers = [asyncio.wrap_future(look.answer) for look in looks]
            try:
                await asyncio.wait(answers, timeout=max(0.0, left_s))
            finally:
                for answer in answers:  # so that a late answer does not call into a closed loop
                    answer.cancel()
        self._say_unanswered(looks)

    def _say_unanswered(self, looks: list[_Look]) -> None:
        if unanswered := sum(not look.answer.done() for look in looks):
            _slow_look.log(
                "%d disk or DFS directories did not answer within %d ms (a hung mount?): disk tiers "
                "are read through their nodes and DFS replicas skipped meanwhile", unanswered, LOOK_WAIT_MS,
            )  # fmt: skip

    def _may_be_here(self, info: SegmentInfo) -> bool:
        if info.tier == TIER_DISK:
            return self._shm_enabled and bool(info.shm_path) and info.hostname == self._hostname
        return info.tier == TIER_DFS and bool(self._dfs_dir)

    def _look_at(self, info: SegmentInfo) -> _Look | None:
        """The look at the segment's directory, begun if none is under way; None when
        LOOKS_IN_FLIGHT_MAX are (the segment is taken for not here, for now)."""
        with self._lock:
            look = self._looks.get(info.segment_id)
            if look is not None:
                return look
            if sum(not look.answer.done() for look in self._looks.values()) >= LOOKS_IN_FLIGHT_MAX:
                return None
            if len(self._looks) >= DIRECTORIES_REMEMBERED_MAX:
                self._looks = {segment_id: look for segment_id, look in self._looks.items() if not look.answer.done()}
            look = self._looks[info.segment_id] = _Look()
        threading.Thread(target=self._look, args=(info, look), name="kvpool-directory-look", daemon=True).start()
        return look

    def _look(self, info: SegmentInfo, look: _Look) -> None:
        try:
            look.answer.set_result(self._directory_of(info))
        except BaseException as exc:  # a get takes it (find)
            look.answer.set_exception(exc)

    def _directory_of(self, info: SegmentInfo) -> Path | None:
        """The look itself (on its thread): the directory if its identity is the segment's."""
        if info.tier == TIER_DISK:
            identity = files.load_identity(Path(info.shm_path))
            return Path(info.shm_path) if identity is not None and identity.token == info.shm_token else None
        if DfsDirectory(self._dfs_dir).has_token(info.shm_token):
            return Path(self._dfs_dir)
        self._dfs_look_again_at = time.monotonic() + DFS_LOOK_AGAIN_S  # not mounted yet, perhaps
        log.info("DFS %s is not at %s: DFS replicas are skipped", info.segment_id, self._dfs_dir)
        return None

    def _remember(self, segment_id: str, directory: Path | None) -> None:
        if len(self._found) >= DIRECTORIES_REMEMBERED_MAX:
            self._found = {}  # a new dict: other threads may be reading the old
        self._found[segment_id] = directory


__all__ = ["HostDirectories", "LOOK_WAIT_MS"]
