"""A log line that events can repeat thousands of times a second (a flood of unauthenticated
connections, a client putting into a full cache): said at most once an interval, with how many
like it were not shown. Unthrottled, such lines wrote megabytes of log a second (helper-52,
helper-53: 8,330 lines/s from one client's puts into a cache of pinned objects)."""

from __future__ import annotations

import logging
import threading
import time

INTERVAL_S_DEFAULT = 10.0


class RepeatedLog:
    """`log(...)` as logger.log at `level`, but once per `interval_s` at most. Any thread."""

    def __init__(self, logger: logging.Logger, level: int, interval_s: float = INTERVAL_S_DEFAULT) -> None:
        self._logger = logger
        self._level = level
        self._interval_s = interval_s
        self._quiet_until_s = 0.0
        self._unshown = 0
        self._lock = threading.Lock()

    def log(self, message: str, *args: object) -> None:
        now_s = time.monotonic()
        with self._lock:
            if now_s < self._quiet_until_s:
                self._unshown += 1
                return
            unshown, self._unshown = self._unshown, 0
            self._quiet_until_s = now_s + self._interval_s
        if unshown:
            message += f" ({unshown} more like it in the last {self._interval_s:g} s not shown)"
        self._logger.log(self._level, message, *args)
