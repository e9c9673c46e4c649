"""Read leases given back: a finished get tells the master that its reader is done, so that what
it read can be evicted at once rather than when the lease runs out (10 s by default).

A lease keeps an object out of eviction's reach while a reader may be copying its bytes. Held
for its whole TTL, it kept everything read in the last 10 s out of reach: a cache that reads
its capacity's worth within that time refused puts (NO_AVAILABLE_HANDLE), though no one was
reading (docs/performance.md, "Read leases"). The master counts an object's readers and ends
its lease when the last gives it back (master/metadata.py); the TTL still bounds a reader that
dies before it does.

Releases are batched: a finished get adds its leased keys here, from any thread, and the first
addition after a flush has the store's loop flush RELEASE_DELAY_MS later: one ReleaseLeases for
every get in between. A release that is lost costs only the lease's TTL.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvpool import limits
from kvpool.errors import ErrorCode
from kvpool.protocol.messages import GetReplicaListReply, ReleaseLeases

# How long a finished get's leases wait to be given back with those of the gets after it.
RELEASE_DELAY_MS = 10


class LeaseReleases:
    """The leases of finished gets not yet given back, by the master's grant time. Thread-safe."""

    __slots__ = ("_lock", "_pending")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[int, list[str]] = {}  # grant time -> keys (a key once per lease)

    def add(self, reply: GetReplicaListReply, keys: Sequence[str]) -> bool:
        """Record the leases `reply` granted on `keys` (the get's, in order). True when this is
        the first addition since the last `take`: the caller schedules the next one."""
        granted_ms = reply.lease_granted_ms
        if not granted_ms:
            return False  # a master that does not take leases back
        leased = [key for key, code in zip(keys, reply.codes) if code == ErrorCode.OK]
        if not leased:
            return False
        with self._lock:
            is_first = not self._pending  # (what is recorded is never empty)
            held = self._pending.get(granted_ms)
            if held is None:
                self._pending[granted_ms] = leased
            else:
                held += leased
        return is_first

    def take(self) -> list[ReleaseLeases]:
        """Everything recorded, as messages of at most BATCH_KEYS_MAX keys; then nothing."""
        with self._lock:
            pending, self._pending = self._pending, {}
        messages: list[ReleaseLeases] = []
        message, room = ReleaseLeases([], [], []), 0
        for granted_ms, keys in pending.items():
            position = 0
            while position < len(keys):
                if not room:
                    message, room = ReleaseLeases([], [], []), limits.BATCH_KEYS_MAX
                    messages.append(message)
                piece = keys[position : position + room]
                message.granted_ms.append(granted_ms)
                message.counts.append(len(piece))
                message.keys += piece
                position += len(piece)
                room -= len(piece)
        return messages


__all__ = ["LeaseReleases", "RELEASE_DELAY_MS"]
