"""Nodes that stopped answering in time: a get reads their replicas last, and briefly, for a while.

A frozen node (stopped, swapping, a hung link) takes a request's bytes into its kernel buffers
and answers nothing, so each get that reads from it first waits out its round (a share of the
read lease, GetJob.round_timeout_ms) before it tries the next replica. Once one transfer with a
node timed out, gets read other replicas of its objects first, and give a read of it at most
SLOW_NODE_BUDGET_MS (and as long as its bytes take at SLOW_NODE_MS_PER_MIB), until
SLOW_NODE_MS have passed or it answers in time: by then the master has dropped a node that
stopped heartbeating (its TTL), or it answers again. Without that bound, every get of an
object only there waited out a round: 10 s by default, for as long as the node stayed frozen,
or cut off from this client while the master still heard it. A read begun while it was
marked that times out does not mark it again: a node that is only busy, whose reads overran
the shorter budget, is given whole rounds again SLOW_NODE_MS after it was marked (a frozen
one is marked again by its next read).
Shared by a Store's loop and its caller threads (dict operations are atomic).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvpool import limits

SLOW_NODE_MS = limits.NODE_TTL_MS_DEFAULT
# A transfer that timed out with less time than this says little about its node (a round's
# share of a lease nearly spent): it marks nothing.
SLOW_NODE_BUDGET_MIN_MS = 250
# What a transfer with a node marked slow is given, at most: a second of a KV cache's read is
# already worth less than its prefill; and 2 ms more for each MiB it reads (512 MiB/s), so
# that a long prefix's load from a node that is only busy is not cut short.
SLOW_NODE_BUDGET_MS = 1_000
SLOW_NODE_MS_PER_MIB = 2
assert SLOW_NODE_BUDGET_MS >= SLOW_NODE_BUDGET_MIN_MS
# A caller thread's connection to a node marked slow has this long to open (a frozen node's
# handshake never ends); the read then goes through the Store's loop, within its own budget.
SLOW_NODE_OPEN_MS = 250
# How many endpoints' marks are remembered, ended ones included (those go first).
SLOW_NODES_REMEMBERED_MAX = 1_024


class SlowNodes:
    def __init__(self) -> None:
        # endpoint -> monotonic time its mark ends; kept after it ended (timed_out), up to
        # SLOW_NODES_REMEMBERED_MAX endpoints.
        self._until: dict[str, float] = {}

    def timed_out(self, endpoint: str, budget_ms: int, started_s: float | None = None) -> None:
        """A transfer with `endpoint`, begun at `started_s` (time.monotonic; None: `budget_ms`
        ago, its whole budget run), did not finish within `budget_ms`: the node is marked,
        unless the transfer began while it was (its shorter budget, overrun, says nothing new:
        the mark must end SLOW_NODE_MS after it began, even if one such read ends after it)."""
        now = time.monotonic()
        started_s = now - budget_ms / 1000 if started_s is None else started_s
        if budget_ms < SLOW_NODE_BUDGET_MIN_MS or started_s < self._until.get(endpoint, 0.0):
            return
        if len(self._until) >= SLOW_NODES_REMEMBERED_MAX:  # a new dict: other threads may read the old
            self._until = {other: until for other, until in self._until.items() if until > now}
        self._until[endpoint] = now + SLOW_NODE_MS / 1000

    def answered(self, endpoint: str) -> None:
        """A transfer with `endpoint` ended in time: it is not slow (any more). The mark ends
        now, and is kept: a read begun before it did still says nothing new (timed_out)."""
        if (until := self._until.get(endpoint)) is not None and until > (now := time.monotonic()):
            self._until[endpoint] = now

    def budget_ms(self, endpoint: str, budget_ms: int, size_bytes: Callable[[], int]) -> int:
        """What a read of `size_bytes()` bytes (asked only while it is slow) from `endpoint`
        may take of `budget_ms`: while it is slow, SLOW_NODE_BUDGET_MS and
        SLOW_NODE_MS_PER_MIB at most."""
        if not self._until or not self.is_slow(endpoint):
            return budget_ms
        return min(budget_ms, SLOW_NODE_BUDGET_MS + SLOW_NODE_MS_PER_MIB * size_bytes() // (1 << 20))

    def is_slow(self, endpoint: str) -> bool:
        return time.monotonic() < self._until.get(endpoint, 0.0)
