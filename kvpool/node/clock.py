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

The node measures against its monotonic clock (`local_ms`), which no one steps: measured against
its wall clock, a step back of that clock by D left the old, smaller offsets the least of the
samples for up to CLOCK_OFFSET_SAMPLES_MAX replies (8 s of heartbeats), and the master's time
read D behind: grants taken up to D after they expired, and move copies recorded up to D past
their deadline, the master perhaps done with them (a step forward erred the safe way, for one
reply). A step of the master's clock forward does the same, and a reply shows it: its time was
read before the reply arrived, so `master_time_ms - received_ms` is a lower bound of the
offset, and a lower bound above the least of the samples proves them stale: they are dropped.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable

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
    """The master's wall-clock time, estimated from its replies (the module), against
    `local_ms` (the node's monotonic clock; the wall clock by default)."""

    __slots__ = ("_samples", "offset_ms", "_is_measured", "_is_far", "_label", "local_ms")

    def __init__(self, label: str, local_ms: Callable[[], int] = wall_clock_ms) -> None:
        self._samples: collections.deque[int] = collections.deque(maxlen=CLOCK_OFFSET_SAMPLES_MAX)
        self.offset_ms = 0  # the master's clock minus local_ms, once a master said its time
        self._is_measured = False  # until then, the master's time is taken to be this host's
        self._is_far = False
        self._label = label
        self.local_ms = local_ms  # what callers stamp their requests with

    def now_ms(self) -> int:
        """The master's time now, as far as this node can tell (never behind it by more than
        the clocks' drift since the last reply)."""
        if not self._is_measured:
            return wall_clock_ms()
        return self.local_ms() + self.offset_ms

    @property
    def wall_offset_ms(self) -> int:
        """The master's wall clock minus this host's."""
        return self.now_ms() - wall_clock_ms()

    def forget(self) -> None:
        """Another master (a restart, a new leader) may keep another time: start over at the
        next reply."""
        self._samples.clear()

    def observe(self, sent_ms: int, master_time_ms: int, received_ms: int | None = None) -> None:
        """A reply to a request sent at `sent_ms` and received at `received_ms` (local_ms)
        said the master's time was `master_time_ms` (0: a master that does not say)."""
        if not master_time_ms:
            return
        if received_ms is not None and self._samples and master_time_ms - received_ms > self.offset_ms:
            self._samples.clear()  # a clock stepped: the earlier samples are too low (the module)
        self._samples.append(master_time_ms - sent_ms)
        self.offset_ms = min(self._samples)
        self._is_measured = True
        wall_offset_ms = self.wall_offset_ms
        is_far = abs(wall_offset_ms) > CLOCK_OFFSET_WARN_MS
        if is_far != self._is_far:
            self._is_far = is_far
            if is_far:
                log.warning("%s: this host's clock is %.1f s %s the master's: write grants are checked against "
                            "the master's time; run NTP on every machine of the cluster", self._label,
                            abs(wall_offset_ms) / 1000, "behind" if wall_offset_ms > 0 else "ahead of")  # fmt: skip
            else:
                log.info("%s: this host's clock is within %d ms of the master's again", self._label,
                         CLOCK_OFFSET_WARN_MS)  # fmt: skip
