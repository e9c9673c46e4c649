"""The circuit breaker on an engine's lookups, for a master that is alive but does not answer.

An engine asks the pool which blocks it holds where the engine waits for the answer: vLLM's
scheduler loop (the connector's lookups and hit-source queries, for every waiting request each
step), LMCache's lookup (inside that same loop, with no timeout of LMCache's around it),
SGLang's prefetch thread (every request's hit query, one after the other). A master that stops
answering without closing its connections (a GC pause, a partition, SIGSTOP) cost each lookup
the whole RPC timeout, and nothing remembered it: a vLLM step with N waiting requests took
N x 6 s, and the running requests made no tokens. A master that is killed refuses at once.

So the lookups have a deadline of their own (`lookup_timeout_ms`, well under the RPC
timeout), and after one cannot reach the master (a TransportError: timed out, refused, broken)
the breaker opens: for `lookup_backoff_ms_min` every lookup answers a miss without asking;
then one lookup probes, and each probe that fails doubles the window, up to
`lookup_backoff_ms_max`; one that succeeds closes the breaker. It logs once when it opens and
once when it closes. An error the master answered with (a bad key, say) leaves it closed.
It adds no wait of its own: a lookup it lets through takes `lookup_timeout_ms` at most,
finding the master again included (the Store's `timeout_ms` bounds the whole call).

Not a retry policy, and not for loads and saves: those run off the engine's loop, under the
transfer timeout, and a failed one is a recompute or a future miss.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from kvpool.errors import KVPoolError, TransportError

T = TypeVar("T")

log = logging.getLogger(__name__)

# A lookup costs the master microseconds and a round trip a millisecond or less on a LAN; a
# master that has not answered in a second is stalled, and every waiting request of an
# engine's step would wait as long. Not much less: a master slowed for a moment (a busy host)
# would open the breaker, and a window of misses recomputes every prompt that could have hit.
LOOKUP_TIMEOUT_MS_DEFAULT = 1_000
LOOKUP_TIMEOUT_MS_MAX = 60_000
LOOKUP_BACKOFF_MS_MIN_DEFAULT = 1_000
LOOKUP_BACKOFF_MS_MAX_DEFAULT = 30_000
LOOKUP_BACKOFF_MS_MAX = 3_600_000


class LookupBreaker:
    """Whether an engine's lookups may ask the master now. Thread-safe.

    Closed (`_backoff_ms` 0): every lookup asks. Open: none asks before `_probe_at`; the first
    to ask after it probes, and the next probe is put a window later at once, so the others
    keep answering misses meanwhile and a probe that never reports back (an exception that
    is not an operating error) delays the next one only by a window.
    """

    def __init__(
        self, what: str, backoff_ms_min: int, backoff_ms_max: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        assert 0 < backoff_ms_min <= backoff_ms_max, (backoff_ms_min, backoff_ms_max)
        self._what = what  # for the log: whose lookups
        self._backoff_ms_min = backoff_ms_min
        self._backoff_ms_max = backoff_ms_max
        self._clock = clock  # seconds
        self._lock = threading.Lock()
        self._backoff_ms = 0
        self._probe_at = 0.0
        self._is_probing = False  # a probe was let through and has not failed yet

    def __repr__(self) -> str:
        state = f"open {self._backoff_ms} ms" if self._backoff_ms else "closed"
        return f"<LookupBreaker {self._what} {state}>"

    def is_open(self) -> bool:
        return self._backoff_ms > 0

    def ask(self, lookup: Callable[[], T], miss: T, on_error: Callable[[KVPoolError], None]) -> T:
        """`lookup()`'s answer; `miss` without calling it while the breaker keeps the master
        unasked, or when it fails: a failure to reach the master moves the breaker (and is
        logged here), any other error goes to `on_error` (the caller's log line)."""
        if not self.can_call():
            return miss
        try:
            answer = lookup()
        except KVPoolError as exc:
            if not self.record_failure(exc):
                on_error(exc)
            return miss
        self.record_success()
        return answer

    def can_call(self) -> bool:
        """Whether this lookup may ask the master (closed, or this one probes); if not,
        the caller answers a miss."""
        with self._lock:
            if not self._backoff_ms:
                return True
            now = self._clock()
            if now < self._probe_at:
                return False
            self._probe_at = now + self._backoff_ms / 1000
            self._is_probing = True
            return True

    def record_success(self) -> None:
        """The master answered a lookup: closed."""
        with self._lock:
            if not self._backoff_ms:
                return
            self._backoff_ms, self._is_probing = 0, False
        log.warning("kvpool: the master answers %s again", self._what)

    def record_failure(self, exc: KVPoolError) -> bool:
        """A lookup failed with `exc`. Returns whether it was the master out of reach (a
        TransportError): the breaker opens, or its window doubles after a failed probe, and
        the error is logged here (once, when it opens); any other error is the caller's to log."""
        if not isinstance(exc, TransportError):
            return False
        with self._lock:
            was_closed = not self._backoff_ms
            if was_closed:
                self._backoff_ms = self._backoff_ms_min
            elif self._is_probing:
                self._backoff_ms = min(2 * self._backoff_ms, self._backoff_ms_max)
            else:  # a lookup that began before the breaker opened: its window stands
                return True
            self._is_probing = False
            self._probe_at = self._clock() + self._backoff_ms / 1000
            backoff_ms = self._backoff_ms
        if was_closed:
            log.warning(
                "kvpool: %s cannot reach the master (%s); they answer a miss without asking, probing "
                "after %d ms, then at doubling intervals up to %d ms",
                self._what, exc, backoff_ms, self._backoff_ms_max,
            )  # fmt: skip
        else:
            log.debug("kvpool: a probe of %s failed, the next in %d ms: %s", self._what, backoff_ms, exc)
        return True
