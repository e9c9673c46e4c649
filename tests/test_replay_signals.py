"""`kvpool replay --mode live` and `kvpool demo` stopped by a signal leave nothing behind.

How: each test runs the real command as a child process (its temporary directories under the
test's own, through TMPDIR), waits until its master and nodes are up (their ready files),
records every process it started (the children of each of its threads, as the live replay
starts servers from pool threads) and the /dev/shm segment files they map, then sends SIGTERM
(a supervisor's stop) or SIGKILL. Asserted: after SIGTERM the command exits 143 (128 +
SIGTERM) having stopped every child, removed every segment file and its temporary
directories; a SIGTERM that comes while the command forks a server (sent from an at-fork
hook) is not lost (it was swallowed there, and once left logging's lock held: the next fork
hung); after SIGKILL of a process that started a cluster from a pool thread, the children
still end (they were started to die with it) and remove their segments. Whatever happens, a
test ends what it started by pid. Bounded: a few seconds each.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "synthetic_trace.jsonl"
needs_trace = pytest.mark.skipif(not TRACE.is_file(), reason=f"no trace at {TRACE}")
WAIT_S = 30.0
STOP_WAIT_S = 20.0  # a clean stop takes a second or two
KILL_WAIT_S = 5.0
EXIT_SIGTERM = 128 + signal.SIGTERM


def children_of(pid: int) -> set[int]:
    """The children of every thread of `pid` (a child belongs to the thread that forked it)."""
    found: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            found.update(int(child) for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split())
        except OSError:
            continue
    return found


def segments_of(pids: set[int]) -> set[str]:
    """The /dev/shm segment files that `pids` map or hold open."""
    found: set[str] = set()
    for pid in pids:
        try:
            found.update(line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
                         if "/dev/shm/kvpool-" in line)  # fmt: skip
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/kvpool-"):
                    found.add(target)
        except OSError:
            continue
    return found


def is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Command:
    """A kvpool command run as a child, with every process it starts recorded by pid."""

    def __init__(self, args: list[str], tmp_path: Path, env: dict[str, str] | None = None) -> None:
        self.tmp_path = tmp_path
        self.log_path = tmp_path / "command.log"
        child_env = {**os.environ, "TMPDIR": str(tmp_path), **(env or {})}
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "kvpool.cli.main", *args], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=child_env,
            )  # fmt: skip
        self.children: set[int] = set()
        self.segments: set[str] = set()

    def wait_for(self, condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + WAIT_S
        while not condition():
            self.children |= children_of(self.popen.pid)
            assert self.popen.poll() is None, self.log_path.read_text()
            assert time.monotonic() < deadline, f"not ready in time:\n{self.log_path.read_text()}"
            time.sleep(0.02)
        self.children |= children_of(self.popen.pid)
        self.segments |= segments_of(self.children)

    def work_dirs(self) -> list[Path]:
        return sorted(self.tmp_path.glob("kvpool-*"))

    def stop(self, sig: int) -> int:
        self.popen.send_signal(sig)
        return self.popen.wait(STOP_WAIT_S)

    def end_everything(self) -> None:
        """Whatever the test found: no process of it outlives it (SIGKILL if SIGTERM is not enough)."""
        pids = [self.popen.pid, *self.children]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                if is_alive(pid):
                    os.kill(pid, sig)
            try:
                self.popen.wait(KILL_WAIT_S)
                break
            except subprocess.TimeoutExpired:
                continue

    def assert_nothing_left(self) -> None:
        time.sleep(0.2)  # a reparented zombie is reaped by init
        assert self.children, "no process recorded: the test tested nothing"
        assert [pid for pid in self.children if is_alive(pid)] == []
        assert [path for path in self.segments if os.path.exists(path)] == []
        assert self.work_dirs() == []


def has_ready(pattern: str, dir_count: int = 1) -> Callable[[Path], bool]:
    def condition(tmp_path: Path) -> bool:
        dirs = list(tmp_path.glob("kvpool-*"))
        return len(dirs) >= dir_count and any(any(d.glob(pattern)) for d in dirs)

    return condition


@needs_trace
@pytest.mark.timeout(60)
def test_sigterm_stops_a_live_replay_and_everything_it_started(tmp_path: Path) -> None:
    # Paced (25 s of trace at --speedup 1), so that SIGTERM finds it replaying.
    args = ["replay", str(TRACE), "--skip", "3843", "--limit", "100", "--capacity", "100K", "--policy", "lru",
            "--mode", "live", "--speedup", "1", "--out", str(tmp_path / "out")]  # fmt: skip
    command = Command(args, tmp_path)
    try:
        command.wait_for(lambda: has_ready("node1.ready")(tmp_path))
        time.sleep(0.3)
        assert len(command.children) == 2 and command.segments  # a master and a node
        assert command.stop(signal.SIGTERM) == EXIT_SIGTERM, command.log_path.read_text()
        command.assert_nothing_left()
        assert not (tmp_path / "out" / "replay.json").exists()
    finally:
        command.end_everything()


@needs_trace
@pytest.mark.timeout(60)
@pytest.mark.parametrize("phase", ["objects", "replay"])
def test_sigterm_stops_the_demo_in_either_phase(tmp_path: Path, phase: str) -> None:
    # "objects": one cluster, SIGTERM once its master is up (its node starting, from the main
    # thread). "replay": the closing replay's three clusters (>= 2 directories at once),
    # SIGTERM once a node of theirs is up, while the others start from pool threads.
    args = ["demo", "--nodes", "1", "--objects", "4", "--object-size", "64KiB", "--memory", "4MiB"]
    command = Command(args, tmp_path, {"KVPOOL_TRACE": str(TRACE)})
    condition = has_ready("master.ready") if phase == "objects" else has_ready("node*.ready", dir_count=2)
    try:
        command.wait_for(lambda: condition(tmp_path))
        assert command.stop(signal.SIGTERM) == EXIT_SIGTERM, command.log_path.read_text()
        command.assert_nothing_left()
    finally:
        command.end_everything()


_SIGTERM_IN_A_FORK = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from kvpool.cli.launcher import LocalCluster, sigterm_as_interrupt

    sent = []
    def sigterm_once():  # in the parent, right after its first fork: inside Popen
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)

    os.register_at_fork(after_in_parent=sigterm_once)
    with sigterm_as_interrupt():
        with LocalCluster(1, "2MiB", workdir=Path(sys.argv[1])) as cluster:
            print("started", flush=True)
    """
)


@pytest.mark.timeout(60)
def test_a_sigterm_during_a_fork_stops_the_command_at_once(tmp_path: Path) -> None:
    workdir = tmp_path / "cluster"
    workdir.mkdir()
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", _SIGTERM_IN_A_FORK, str(workdir)], capture_output=True, text=True, timeout=WAIT_S
    )
    assert result.returncode == EXIT_SIGTERM, result.stdout + result.stderr
    assert "started" not in result.stdout and "Exception ignored" not in result.stderr, result.stderr
    assert time.monotonic() - started < 10  # the master stopped as it started, no node started
    assert not list(workdir.glob("node*.log"))


_STARTS_FROM_A_POOL_THREAD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from kvpool.cli.launcher import LocalCluster
    from kvpool.sim.live import start_all

    cluster = LocalCluster(1, "2MiB", workdir=Path(sys.argv[1]))
    start_all([cluster.start])
    print("started", flush=True)
    time.sleep(60)
    """
)


@pytest.mark.timeout(60)
def test_servers_started_from_a_pool_thread_end_with_a_killed_parent(tmp_path: Path) -> None:
    # SIGKILL runs no handler: only the kernel's parent-death signal ends the children, and
    # it fires when the thread that forked them ends (the pool's, long before the process).
    workdir = tmp_path / "cluster"
    workdir.mkdir()
    log_path = tmp_path / "parent.log"
    with open(log_path, "wb") as log:
        parent = subprocess.Popen(
            [sys.executable, "-c", _STARTS_FROM_A_POOL_THREAD, str(workdir)], stdout=log, stderr=subprocess.STDOUT
        )
    children: set[int] = set()
    try:
        deadline = time.monotonic() + WAIT_S
        while b"started" not in log_path.read_bytes():
            assert parent.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.02)
        time.sleep(0.2)  # the pool's thread has ended: its children were handed to another thread
        children = children_of(parent.pid)
        segments = segments_of(children)
        assert len(children) == 2 and segments
        parent.kill()
        parent.wait(WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while any(is_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [pid for pid in children if is_alive(pid)] == []
        assert [path for path in segments if os.path.exists(path)] == []
    finally:
        for pid in [parent.pid, *children]:
            if is_alive(pid):
                os.kill(pid, signal.SIGTERM)
        parent.wait(WAIT_S)
