"""LeaseReleases (kvpool/client/leases.py): the leases of finished gets, batched for the master.

How: replies built by hand, no I/O: what a finished get records, when the caller must schedule
a flush, and how the flush cuts what it took into ReleaseLeases messages.
"""

from __future__ import annotations

import threading

from kvpool import limits
from kvpool.client.leases import LeaseReleases
from kvpool.errors import ErrorCode
from kvpool.protocol.messages import GetReplicaListReply

OK, MISS = int(ErrorCode.OK), int(ErrorCode.OBJECT_NOT_FOUND)


def reply(codes: list[int], granted_ms: int) -> GetReplicaListReply:
    count = len(codes)
    return GetReplicaListReply(codes, [1] * count, [0] * count, [[] for _ in codes], 10_000, {}, granted_ms)


def test_only_the_leased_keys_of_a_get_are_given_back_grouped_by_grant_time() -> None:
    releases = LeaseReleases()
    assert releases.add(reply([OK, MISS, OK], 100), ["a", "b", "c"])  # the first: schedule a flush
    assert not releases.add(reply([OK], 100), ["d"])  # one is scheduled already
    assert not releases.add(reply([OK, OK], 200), ["a", "a"])  # a key read twice: two leases
    [message] = releases.take()
    assert (message.granted_ms, message.counts, message.keys) == ([100, 200], [3, 2], ["a", "c", "d", "a", "a"])
    assert releases.take() == []
    assert releases.add(reply([OK], 300), ["e"])  # after a flush, the next addition schedules one


def test_nothing_is_recorded_for_a_get_without_leases_or_from_a_master_that_takes_none_back() -> None:
    releases = LeaseReleases()
    assert not releases.add(reply([MISS, MISS], 100), ["a", "b"])
    assert not releases.add(reply([OK], 0), ["a"])  # lease_granted_ms 0: an older master
    assert releases.take() == []


def test_a_flush_is_cut_into_messages_of_at_most_a_batch_of_keys() -> None:
    releases = LeaseReleases()
    count = limits.BATCH_KEYS_MAX + 10
    releases.add(reply([OK] * count, 100), [f"k{i}" for i in range(count)])
    releases.add(reply([OK] * 5, 200), [f"j{i}" for i in range(5)])
    messages = releases.take()
    assert [len(m.keys) for m in messages] == [limits.BATCH_KEYS_MAX, 15]
    assert [(m.granted_ms, m.counts) for m in messages] == [([100], [limits.BATCH_KEYS_MAX]), ([100, 200], [10, 5])]
    assert [key for m in messages for key in m.keys] == [f"k{i}" for i in range(count)] + [f"j{i}" for i in range(5)]


def test_gets_finishing_on_many_threads_lose_no_lease_and_schedule_one_flush_per_take() -> None:
    releases = LeaseReleases()
    firsts: list[bool] = []

    def finish_gets(thread: int) -> None:
        for i in range(200):
            firsts.append(releases.add(reply([OK], 100), [f"t{thread}-{i}"]))

    threads = [threading.Thread(target=finish_gets, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert firsts.count(True) == 1
    [message] = releases.take()
    assert sorted(message.keys) == sorted(f"t{t}-{i}" for t in range(4) for i in range(200))
