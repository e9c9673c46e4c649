"""RemovedAtStart (master/removed_at_start.py): a master's first removes reach the segments
that mount after them. The pure class here; a master restarted under real processes in
tests/test_history.py, a leader elected in tests/test_history_ha.py."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvpool import limits
from kvpool.config import MasterConfig
from kvpool.errors import ErrorCode, InvalidParams
from kvpool.master import removed_at_start
from kvpool.master import server as master_server
from kvpool.master.removed_at_start import RemovedAtStart
from kvpool.master.server import MasterServer, local_clock_ms, wall_clock_ms
from kvpool.protocol.messages import ExistKeys, InventoryEntry, MountSegment, Remove, SegmentInfo


def entry(key: str, offset: int) -> InventoryEntry:
    return InventoryEntry(key, offset, 4096, 0)


def keys_of(entries: list[InventoryEntry]) -> list[str]:
    return [e.key for e in entries]


def mount(removed: RemovedAtStart, segment_id: str, keys: list[str], now_ms: int, is_last: bool = True) -> list[str]:
    """The keys refused of a mount part the master then takes."""
    inventory = [entry(key, i * 4096) for i, key in enumerate(keys)]
    adopted, refused = removed.mounting(segment_id, inventory, now_ms)
    assert sorted(keys_of(adopted) + keys_of(refused)) == sorted(keys)
    removed.mounted(segment_id, is_last, now_ms)
    return keys_of(refused)


def test_a_first_mount_refuses_what_the_window_removed_by_key_pattern_or_all() -> None:
    removed = RemovedAtStart(until_ms=1_000)
    removed.removed(["a", "b"], now_ms=10)
    removed.removed(pattern="^c", now_ms=20)
    removed.removed(pattern="x$", now_ms=21)
    assert mount(removed, "s1", ["a", "c1", "d", "b", "dx", "xd"], now_ms=30) == ["a", "c1", "b", "dx"]
    # A segment whose whole inventory mounted, and whose node then heartbeat (it read the
    # reply), holds only what was put through this master since.
    removed.settled(["s1"])
    assert mount(removed, "s1", ["a", "c1"], now_ms=40) == []
    removed.removed(is_all=True, now_ms=50)
    assert mount(removed, "s2", ["d", "e"], now_ms=60) == ["d", "e"]


def test_a_mount_the_master_refused_is_filtered_again_when_its_node_tries_again() -> None:
    removed = RemovedAtStart(until_ms=1_000)
    removed.removed(["a"], now_ms=10)
    adopted, refused = removed.mounting("s1", [entry("a", 0)], now_ms=20)
    assert keys_of(refused) == ["a"]  # ... and the service raised: no `mounted`
    assert mount(removed, "s1", ["a"], now_ms=30) == ["a"]


def test_a_mount_in_parts_begun_in_the_window_is_filtered_to_its_last_part() -> None:
    removed = RemovedAtStart(until_ms=1_000)
    removed.removed(["a", "z"], now_ms=10)
    assert mount(removed, "s1", ["a"], now_ms=900, is_last=False) == ["a"]
    # The window ended between the parts: the rest of that inventory is still from before.
    assert mount(removed, "s1", ["z"], now_ms=5_000) == ["z"]
    # A segment first seen after the window: nothing refused, and the window's removes forgotten.
    assert mount(removed, "s2", ["a"], now_ms=5_001) == []
    removed.expire(5_001)
    removed.removed(["b"], now_ms=5_002)
    assert mount(removed, "s3", ["a", "b", "z"], now_ms=5_003) == []


def test_a_mount_abandoned_in_parts_does_not_hold_the_window_forever() -> None:
    removed = RemovedAtStart(until_ms=1_000)
    removed.removed(["a"], now_ms=10)
    assert mount(removed, "s1", ["a"], now_ms=20, is_last=False) == ["a"]  # then its node died
    late = 20 + removed_at_start.MOUNT_PARTS_WAIT_MS + 1
    removed.expire(late)  # the master's tick: s1 let go
    assert mount(removed, "s2", ["a"], now_ms=late) == []
    assert mount(removed, "s1", ["a"], now_ms=late + 1) == []


def test_what_the_window_remembers_is_bounded_and_said_once(caplog) -> None:
    removed = RemovedAtStart(until_ms=1_000, keys_max=3)
    with caplog.at_level(logging.WARNING, logger="kvpool.master.removed_at_start"):
        removed.removed(["a", "b", "a"], now_ms=1)
        removed.removed(["b", "c", "d"], now_ms=2)  # room for one more: c
        for i in range(removed_at_start.PATTERNS_MAX + 1):
            removed.removed(pattern=f"^p{i}$", now_ms=3)
        removed.removed(pattern="^p0$", now_ms=4)  # remembered once
    last = f"p{removed_at_start.PATTERNS_MAX}"
    assert mount(removed, "s1", ["a", "c", "d", "p0", last], now_ms=5) == ["a", "c", "p0"]
    assert len([r for r in caplog.records if "not remembered" in r.getMessage()]) == 1


# --- in the master server (no sockets: requests dispatched as a connection would) -----------


class _Leading:
    """An elector that says this master leads: what `elected` needs of one."""

    def is_leader(self) -> bool:
        return True


class _Conn:
    def is_closed(self) -> bool:
        return False


@pytest.mark.parametrize("scan_late_ms", [0, 120_000], ids=["in_the_window", "past_the_window"])
def test_a_new_leaders_dfs_scan_refuses_a_file_removed_before_it(tmp_path, monkeypatch, scan_late_ms) -> None:
    """A new term mounts the DFS from a scan started by its tick, which on a large share ends
    after the takeover opened: a remove taken meanwhile found no such key, and the scan then
    adopted the file (the key was back). The scan may even begin past the term's window (the
    last term's still runs: one at a time): the DFS was not on the window's list then."""
    clock = [1_000_000]
    monkeypatch.setattr(master_server, "local_clock_ms", lambda: clock[0])

    async def main() -> None:
        server = MasterServer(MasterConfig(remount_grace_ms=0), seed=1, dfs_dir=str(tmp_path), dfs_bytes=limits.GIB)
        await server._open_dfs()
        dfs = server._dfs
        assert dfs is not None and server._dfs_info is not None
        dfs.publish("K", 0, dfs.write_temporary("K", 0, 123, [memoryview(b"x" * 4096)], is_durable=False),
                    is_durable=False)  # fmt: skip
        server.elector = _Leading()  # type: ignore[assignment]
        server.elected(7)
        server.predecessor_record([server._dfs_info.segment_id])
        clock[0] += scan_late_ms
        assert server._dispatch(_Conn(), Remove(["K"])).codes == [ErrorCode.OBJECT_NOT_FOUND]
        await server._ensure_dfs()  # the term's DFS mount, from its scan
        assert server.service.exist_keys(ExistKeys(["K"]), wall_clock_ms()).flags == [False]
        assert list(dfs.scan(limits.DFS_TEMP_FILE_AGE_MS_MAX)) == []  # and its file is gone

    asyncio.run(main())


def test_a_first_mount_the_service_refused_is_filtered_when_its_node_tries_again(monkeypatch) -> None:
    server = MasterServer(MasterConfig(), seed=1)
    server._removed_at_start = RemovedAtStart(local_clock_ms() + 60_000)
    server._dispatch(_Conn(), Remove(["K"]))
    mount_segment = server.service.mount_segment
    calls: list[int] = []

    def refusing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise InvalidParams("refused (a full registry, say)")
        return mount_segment(*args, **kwargs)

    monkeypatch.setattr(server.service, "mount_segment", refusing_once)
    info = SegmentInfo("s1", "node", "host", "host:1", "", b"t", 8 * limits.MIB)
    mount = MountSegment(info, [InventoryEntry("K", 0, 4096, 5)], True)
    with pytest.raises(InvalidParams):
        server._dispatch(_Conn(), mount)
    assert [e.key for e in server._dispatch(_Conn(), mount).rejected] == ["K"]


def test_patterns_that_do_not_compile_together_are_searched_one_by_one() -> None:
    """RE2 quotes to the end of a pattern after an unclosed \\Q: it took the ")" of the
    combined search, which then did not compile, and the remove was not remembered."""
    removed = RemovedAtStart(until_ms=1_000)
    removed.removed(pattern=r"\Qa.b", now_ms=1)
    removed.removed(pattern="(?i)^X", now_ms=2)
    assert mount(removed, "s1", ["a.b", "axb", "xy", "zx"], now_ms=3) == ["a.b", "xy"]


def test_a_scan_that_ends_past_the_window_is_filtered_and_a_slow_mount_is_not_abandoned() -> None:
    removed = RemovedAtStart(until_ms=1_000)
    removed.removed(["a"], now_ms=10)
    removed.scanning("dfs", now_ms=20)  # the DFS's scan begins in the window ...
    wait = removed_at_start.MOUNT_PARTS_WAIT_MS
    assert mount(removed, "s1", ["a"], now_ms=30, is_last=False) == ["a"]
    assert mount(removed, "s1", ["a"], now_ms=30 + wait, is_last=False) == ["a"]  # parts keep coming
    assert mount(removed, "s2", ["a"], now_ms=20 + 2 * wait) == []  # after the window, a new segment
    assert mount(removed, "s1", ["a"], now_ms=20 + 2 * wait) == ["a"]
    assert mount(removed, "dfs", ["a"], now_ms=10 * wait) == ["a"]  # ... and ends far past it


def test_a_remove_past_the_window_reaches_the_mounts_begun_in_it_that_still_come_in() -> None:
    """The DFS's scan of a large share, or a node's mount of many parts, begun in the window,
    went on past it: a remove taken then found none of their objects (not mounted yet) and was
    not remembered, and the parts that came after brought the removed keys back."""
    removed = RemovedAtStart(until_ms=1_000)
    removed.scanning("dfs", now_ms=20)
    assert mount(removed, "s1", ["x"], now_ms=30, is_last=False) == []
    removed.removed(["a", "b"], now_ms=5_000)  # past the window: both mounts still come in
    assert mount(removed, "s1", ["b", "x2"], now_ms=6_000) == ["b"]
    assert mount(removed, "dfs", ["a", "c"], now_ms=7_000) == ["a"]
    assert mount(removed, "s2", ["a"], now_ms=8_000) == []  # begun past the window: not filtered
    removed.expire(8_000)  # no mount left to filter: forgotten
    removed.removed(["c"], now_ms=9_000)
    assert mount(removed, "s3", ["c"], now_ms=9_000) == []


def test_what_a_mount_had_refused_is_refused_again_until_its_segments_heartbeat() -> None:
    """A node drops a refused entry once it reads the reply: one whose reply was lost (or came
    after its timeout) mounts the whole inventory again, and the removed object came back."""
    removed = RemovedAtStart(until_ms=1_000)
    removed.removed(["a"], now_ms=10)
    assert mount(removed, "s1", ["a", "b"], now_ms=20) == ["a"]  # the reply is lost
    assert mount(removed, "s1", ["a", "b"], now_ms=5_000) == ["a"]  # past the window, still
    removed.settled(["s1"])
    assert mount(removed, "s1", ["a", "b"], now_ms=5_001) == []  # a new "a", put since
