"""Busy polling: a server's event loop keeps polling its sockets for a short window after each
reply, instead of going to sleep in epoll_wait, so that the next request finds it awake.

Why: waking a process whose CPU went idle costs more than most requests' work. On this
project's VMs a master that idled 7 ms answered a one-key lookup in 424-476 µs against
203-218 µs back to back (docs/performance.md, "What this machine does to small requests"):
the halted vCPU has to be woken by the host. Bare metal pays the same in kind for deep CPU
sleep states. A client that runs request after request (a batch loop, a lookup before each
prefill, put_start then put_end around a copy) keeps finding a polling server awake.

How: while the window is open, a callback re-schedules itself on every loop iteration, so the
loop never blocks: each iteration polls the sockets with a zero timeout and handles what came.
Nothing else changes: requests are handled exactly as before, only sooner.

A server that knows when its client will not be back soon (it just granted a put of many MiB,
or located a large get: the client copies for milliseconds; or answered a node's heartbeat,
the next due in a second) gives a `not_back_soon(request, reply)` test: such a reply opens no
window, since polling would only take CPU from those copies, or burn it for nothing.

Cost: up to `window_us` of one CPU after each burst of requests, and nothing while requests
keep coming (the loop is busy then anyway). A node embedded in a client's process never polls:
its loop is the application's, and a spinning loop would hold the GIL.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where metrics are served: a client process never loads it (~0.25 s)
    from prometheus_client.core import CounterMetricFamily


class BusyPoll:
    """Keeps `loop` polling for `window_us` after the last reply that opened a window.
    `window_us` 0: never. `not_back_soon(request, reply)`: True for the replies that open none
    (see the module); None: every reply opens one."""

    __slots__ = (
        "_loop", "_window_ns", "_not_back_soon", "_until_ns", "_is_polling", "windows", "_opened_ns", "_polled_ns",
    )  # fmt: skip

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        window_us: int,
        not_back_soon: Callable[[object, object], bool] | None = None,
    ) -> None:
        if window_us < 0:
            raise ValueError(f"busy-poll window must be >= 0 µs, not {window_us}")
        self._loop = loop
        self._window_ns = window_us * 1000
        self._not_back_soon = not_back_soon
        self._until_ns = 0
        self._is_polling = False
        self.windows = 0  # windows opened; with polled_seconds(), what polling costs (metrics)
        self._opened_ns = 0
        self._polled_ns = 0

    def __repr__(self) -> str:
        return f"<BusyPoll {self._window_ns // 1000} µs {'polling' if self._is_polling else 'idle'}>"

    @property
    def is_polling(self) -> bool:
        return self._is_polling

    def replied(self, request: object, reply: object) -> None:
        """`reply` to `request` has been written (`request` None: unknown, as for a refused
        payload): poll for another window from now, unless its client will not be back soon."""
        if self._not_back_soon is None or request is None or not self._not_back_soon(request, reply):
            self.touch()

    def touch(self) -> None:
        """Keep polling for another window from now."""
        if not self._window_ns:
            return
        now_ns = time.monotonic_ns()
        self._until_ns = now_ns + self._window_ns
        if not self._is_polling:
            self._is_polling = True
            self.windows += 1
            self._opened_ns = now_ns
            self._loop.call_soon(self._poll)

    def polled_seconds(self) -> float:
        """Time the loop has spent in polling windows, the open one included (requests handled
        meanwhile count too: an upper bound on the CPU polling took)."""
        open_ns = time.monotonic_ns() - self._opened_ns if self._is_polling else 0
        return (self._polled_ns + open_ns) / 1e9

    def _poll(self) -> None:
        # A ready callback makes the loop poll its sockets with a zero timeout, then call us again.
        now_ns = time.monotonic_ns()
        if now_ns < self._until_ns:
            self._loop.call_soon(self._poll)
        else:
            self._is_polling = False
            self._polled_ns += now_ns - self._opened_ns


def metric_families(prefix: str, busy_poll: BusyPoll) -> Iterator[CounterMetricFamily]:
    """Prometheus counters of what polling costs a server (its metrics collector yields them)."""
    from prometheus_client.core import CounterMetricFamily

    yield CounterMetricFamily(
        prefix + "busy_poll_seconds",
        "Seconds of polling windows after replies (--busy-poll-us): at most the CPU polling took.",
        value=busy_poll.polled_seconds(),
    )  # fmt: skip
    yield CounterMetricFamily(
        prefix + "busy_poll_windows", "Polling windows opened after replies.", value=busy_poll.windows
    )


__all__ = ["BusyPoll", "metric_families"]
