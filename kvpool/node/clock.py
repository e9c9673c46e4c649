"""The master's clock as a node estimates it, for checking write grants.

A write grant carries its expiry in the master's wall-clock time (PUT_DISCARD_TIMEOUT_MS, 30 s,
after the put started), and the node refuses a write past it: by then the master may have
discarded the put. Checked against the node's own clock, a node whose clock ran more than 30 s
ahead of the master's refused every write as expired, and one running behind took writes the
master had given up on (its release timeout, 600 s, still kept their ranges from reuse).

So each MountReply and HeartbeatReply carries the master's time (`master_time_ms`), and the node
checks grants against its own clock plus the master's offset from it. A reply's time was read
after the request left, so `master_time_ms - sent_ms` is an upper bound of the offset (by the
request's trip and queueing); the least of the last few is the tightest. Erring high makes a
grant expire a few milliseconds early, never late. An offset beyond CLOCK_OFFSET_WARN_MS is
logged once (and once when it is back within): machines of a cluster should run NTP.
"""

from __future__ import annotations

import collections
import logging
import time

log = logging.getLogger(__name__)

# Replies the offset is the least of: a master slow to answer one (a busy loop) biases that
# sample only.
CLOCK_OFFSET_SAMPLES_MAX = 8
CLOCK_OFFSET_WARN_MS = 1_000


def wall_clock_ms() -> int:
    """This host's wall-clock time in ms."""
    return time.time_ns() // 1_000_000


def monotonic_ms() -> int:
    """This host's monotonic time in ms (for spans measured here alone)."""
    return time.monotonic_ns() // 1_000_000


class MasterClock:
    """The master's wall-clock time, estimated from its replies (the module)."""

    __slots__ = ("_samples", "offset_ms", "_is_far", "_label")

    def __init__(self, label: str) -> None:
        self._samples: collections.deque[int] = collections.deque(maxlen=CLOCK_OFFSET_SAMPLES_MAX)
        self.offset_ms = 0  # the master's clock minus ours; 0 until a master says its time
        self._is_far = False
        self._label = label

    def now_ms(self) -> int:
        """The master's time now, as far as this node can tell (never behind it by more than
        the clocks' drift since the last reply)."""
        return wall_clock_ms() + self.offset_ms

    def forget(self) -> None:
        """Another master (a restart, a new leader) may keep another time: start over at the
        next reply."""
        self._samples.clear()

    def observe(self, sent_ms: int, master_time_ms: int) -> None:
        """A reply to a request sent at `sent_ms` (our clock) said the master's time was
        `master_time_ms` (0: a master that does not say)."""
        if not master_time_ms:
            return
        self._samples.append(master_time_ms - sent_ms)
        self.offset_ms = min(self._samples)
        is_far = abs(self.offset_ms) > CLOCK_OFFSET_WARN_MS
        if is_far != self._is_far:
            self._is_far = is_far
            if is_far:
                log.warning("%s: this host's clock is %.1f s %s the master's: write grants are checked against "
                            "the master's time; run NTP on every machine of the cluster", self._label,
                            abs(self.offset_ms) / 1000, "behind" if self.offset_ms > 0 else "ahead of")  # fmt: skip
            else:
                log.info("%s: this host's clock is within %d ms of the master's again", self._label,
                         CLOCK_OFFSET_WARN_MS)  # fmt: skip
