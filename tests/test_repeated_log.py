"""RepeatedLog (kvpool/repeated_log.py): a line that events repeat thousands of times a second
is said once an interval, with the count of those not shown. A unit test of the piece; the
lines it guards are the master's refused puts and the servers' refused peers."""

from __future__ import annotations

import logging
import time

import pytest

from kvpool.repeated_log import RepeatedLog


def test_a_line_repeated_is_said_once_an_interval_with_the_count_not_shown(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("kvpool.test.repeated")
    repeated = RepeatedLog(logger, logging.WARNING, interval_s=0.2)
    with caplog.at_level(logging.WARNING, logger=logger.name):
        for index in range(1_000):
            repeated.log("rejecting %s: wrong cluster token", f"peer-{index}")
        time.sleep(0.25)
        repeated.log("rejecting %s: wrong cluster token", "peer-last")
    assert [record.getMessage() for record in caplog.records] == [
        "rejecting peer-0: wrong cluster token",
        "rejecting peer-last: wrong cluster token (999 more like it in the last 0.2 s not shown)",
    ]
