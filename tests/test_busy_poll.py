"""Busy polling (kvpool/transports/busy_poll.py): a server's loop keeps polling for a window
after each reply, then sleeps again.

How: BusyPoll on a real uvloop loop (the window opens, is extended by a touch, closes, and a
zero window never opens); a real master process with the default window, whose CPU time over
an idle second after a burst of requests shows that the polling stopped; servers with polling
answering requests as before; and bad windows refused where an operator sets them.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import uvloop
from typer.testing import CliRunner

from kvpool import Store, limits
from kvpool.cli.launcher import LocalCluster
from kvpool.cli.main import app
from kvpool.config import MasterConfig, NodeConfig
from kvpool.errors import InvalidParams
from kvpool.master.server import MasterServer, _not_back_soon
from kvpool.protocol.messages import (
    ExistKeys,
    ExistsReply,
    GetReplicaList,
    Heartbeat,
    HeartbeatReply,
    MountSegment,
    PutEnd,
    PutStart,
    ReplicateConfig,
    SegmentInfo,
)
from kvpool.transports.busy_poll import BusyPoll


def test_the_window_opens_at_a_touch_is_extended_by_the_next_and_closes():
    async def main() -> None:
        loop = asyncio.get_running_loop()
        poll = BusyPoll(loop, 30_000)  # 30 ms: wide enough for this VM's scheduling
        assert not poll.is_polling
        poll.touch()
        assert poll.is_polling
        await asyncio.sleep(0.02)
        poll.touch()  # 20 ms in: the window now ends 30 ms from here
        await asyncio.sleep(0.02)
        assert poll.is_polling, "a touch inside the window must extend it"
        await asyncio.sleep(0.05)
        assert not poll.is_polling

    uvloop.run(main())


def test_it_counts_the_windows_it_opens_and_the_time_it_polls():
    async def main() -> None:
        poll = BusyPoll(asyncio.get_running_loop(), 10_000)
        assert (poll.windows, poll.polled_seconds()) == (0, 0)
        poll.touch()
        poll.touch()  # inside the open window: the same one, extended
        await asyncio.sleep(0.05)
        assert poll.windows == 1 and not poll.is_polling
        polled = poll.polled_seconds()
        assert 0.009 <= polled < 0.05
        await asyncio.sleep(0.02)
        assert poll.polled_seconds() == polled, "a closed window adds no time"
        poll.touch()
        await asyncio.sleep(0.05)
        assert poll.windows == 2 and poll.polled_seconds() >= polled + 0.009

    uvloop.run(main())


def test_a_reply_whose_client_is_not_back_soon_opens_no_window_and_leaves_the_next_be():
    async def main() -> None:
        poll = BusyPoll(asyncio.get_running_loop(), 30_000, lambda request, reply: request == "copies for ms")
        poll.replied("copies for ms", "reply")
        assert not poll.is_polling
        poll.replied("lookup", "reply")
        assert poll.is_polling
        await asyncio.sleep(0.05)
        poll.replied(None, "error reply to a refused payload")  # the request unknown: it polls
        assert poll.is_polling

    uvloop.run(main())


def test_the_master_does_not_poll_for_a_client_that_will_be_copying_many_mib():
    """After granting a put, or locating a get, of 4 MiB or more the client copies for longer
    than the window: the reply opens none. Smaller ones do."""

    async def main() -> None:
        master = MasterServer(MasterConfig(), port=0, busy_poll_us=5_000)
        await master.start()
        try:
            info = SegmentInfo("seg", "node", "host", "127.0.0.1:1", "/dev/shm/x", b"t", 64 << 20)
            master.service.mount_segment(MountSegment(info, []), 0)
            poll = master._server.busy_poll
            for keys, size, polls in ((["small"], 64 << 10, True), (["a", "b"], 2 << 20, False)):
                reply = master.handle(None, PutStart(keys, [size] * len(keys), ReplicateConfig()))
                assert reply.codes == [0] * len(keys)
                poll.replied(PutStart(keys, [size] * len(keys), ReplicateConfig()), reply)  # as written
                assert poll.is_polling is polls, (keys, size)
                await asyncio.sleep(0.02)  # the window closes
                pending = master.service.put_end(PutEnd(keys, [7] * len(keys)), 0)  # no node: commit here
                master.service.finish_put_end(pending, {s: [0] * len(e) for s, e in pending.commits.items()}, 0)
                reply = master.handle(None, GetReplicaList(keys))
                assert reply.sizes == [size] * len(keys)
                poll.replied(GetReplicaList(keys), reply)
                assert poll.is_polling is polls, (keys, size)
                await asyncio.sleep(0.02)
        finally:
            await master.stop()

    uvloop.run(main())


def test_the_master_does_not_poll_after_a_heartbeat():
    """A node's next heartbeat is a second away: polling after each would keep the master of a
    large cluster busy for nothing."""
    assert _not_back_soon(Heartbeat(["seg"]), HeartbeatReply([]))
    assert not _not_back_soon(ExistKeys(["k"]), ExistsReply([False]))


def test_a_zero_window_never_polls_and_a_negative_one_is_refused():
    async def main() -> None:
        loop = asyncio.get_running_loop()
        poll = BusyPoll(loop, 0)
        poll.touch()
        assert not poll.is_polling
        with pytest.raises(ValueError, match="busy-poll window"):
            BusyPoll(loop, -1)

    uvloop.run(main())


def test_while_polling_the_loop_keeps_running_other_work():
    """Polling is callbacks on the loop, never a blocking spin: timers and I/O go on. (A window
    of 1 s, so that a machine that preempts the test for tens of ms cannot fail it: a spin would
    hold the timer for the whole second.)"""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        poll = BusyPoll(loop, 1_000_000)
        poll.touch()
        started = time.monotonic()
        await asyncio.sleep(0.005)
        assert time.monotonic() - started < 0.5
        assert poll.is_polling

    uvloop.run(main())


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks of 1/100 s


def test_a_polling_master_answers_and_goes_back_to_sleep_when_requests_stop():
    with LocalCluster(1, "64MiB") as cluster, Store(cluster.master_endpoint) as store:
        for i in range(200):  # a burst: every reply opens the default window again
            store.put(f"busy-{i}", b"x" * 64)
            assert store.get(f"busy-{i}") == b"x" * 64
        time.sleep(0.2)
        before = _cpu_seconds(cluster.master.pid)
        time.sleep(1.0)
        idle_cpu = _cpu_seconds(cluster.master.pid) - before
        # A loop still polling would burn the whole second; an idle master ticks every 200 ms.
        assert idle_cpu < 0.15, f"the master used {idle_cpu:.2f} s of CPU in an idle second"


def test_servers_take_the_window_from_their_configuration():
    async def main() -> None:
        master = MasterServer(MasterConfig(), port=0, busy_poll_us=5_000)
        await master.start()
        try:
            assert master._server is not None and master._server.busy_poll is not None
            assert repr(master._server.busy_poll) == "<BusyPoll 5000 µs idle>"
        finally:
            await master.stop()
        silent = MasterServer(MasterConfig(), port=0, busy_poll_us=0)
        await silent.start()
        try:
            assert silent._server is not None and silent._server.busy_poll is None
        finally:
            await silent.stop()

    uvloop.run(main())


def test_an_embedded_node_never_polls_the_applications_loop():
    with LocalCluster(0) as cluster, Store(cluster.master_endpoint, embedded_memory_bytes=64 << 20) as store:
        node = store._async._embedded_node
        assert node is not None and node.config.busy_poll_us == 0
        store.put("embedded", b"y" * 100)
        assert store.get("embedded") == b"y" * 100


@pytest.mark.parametrize("window_us", [-1, limits.BUSY_POLL_US_MAX + 1])
def test_a_bad_window_is_refused_with_a_clear_error(window_us):
    with pytest.raises(InvalidParams, match="busy_poll_us"):
        NodeConfig(master_endpoint="127.0.0.1:1", memory_bytes=64 << 20, busy_poll_us=window_us)
    with pytest.raises(InvalidParams, match="busy_poll_us"):
        MasterServer(MasterConfig(), port=0, busy_poll_us=window_us)
    for command in ("master", "node"):
        result = CliRunner().invoke(app, [command, "--busy-poll-us", str(window_us), "--port", "0"])
        assert result.exit_code != 0
        assert "--busy-poll-us" in result.output  # the flag typed, not the config field
