"""SIGHUP, as when the terminal or ssh session that started kvpool closes: a node leaves as on
SIGTERM, and `kvpool demo` stops everything it started; where SIGHUP is ignored (nohup), a
node keeps serving.

How: real processes. Nodes run against a master of make_cluster with their segment files in
the test's directory (--shm-dir); one is started under `nohup`. The demo runs through
test_replay_signals' Command, which records every process it starts and the segment files
they map, and the test sends SIGHUP to all of them at once, as the kernel does to a closing
terminal's foreground process group. Asserted: a node exits 0 with its segment file removed
(the default handler killed it and left the file, 16 MiB and more of /dev/shm), the nohup'd
one serves on until SIGTERM; the demo exits 129 (128 + SIGHUP) with no process, segment file
or directory left. Each test ends what it started by pid. Bounded: a few seconds each.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import wait_until

from tests.test_replay_signals import TRACE, Command, has_ready, needs_trace


def start_node(master: str, directory: Path, wrapper: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    directory.mkdir()
    ready = directory / "ready"
    command = [*wrapper, sys.executable, "-m", "kvpool.cli.main", "node", "--master", master, "--memory", "16MiB",
               "--shm-dir", str(directory / "shm"), "--ready-file", str(ready)]  # fmt: skip
    (directory / "shm").mkdir()
    with open(directory / "log", "wb") as log:
        node = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: ready.exists() or node.poll() is not None, 30)
        assert ready.exists(), (directory / "log").read_text()
    except AssertionError:
        node.kill()
        node.wait(10)
        raise
    return node


@pytest.mark.skipif(shutil.which("nohup") is None, reason="no nohup")
def test_sighup_stops_a_node_as_sigterm_does_unless_ignored(make_cluster, tmp_path: Path) -> None:
    cluster = make_cluster(0)
    nodes: list[subprocess.Popen[bytes]] = []
    try:
        nodes.append(start_node(cluster.master_endpoint, tmp_path / "plain"))
        nodes.append(start_node(cluster.master_endpoint, tmp_path / "nohup", wrapper=("nohup",)))
        plain, kept = nodes
        for node in nodes:
            node.send_signal(signal.SIGHUP)
        assert plain.wait(15) == 0, (tmp_path / "plain" / "log").read_text()
        assert list((tmp_path / "plain" / "shm").iterdir()) == []
        assert kept.poll() is None  # nohup: SIGHUP ignored, as the operator asked
        assert len(list((tmp_path / "nohup" / "shm").iterdir())) == 1
        kept.terminate()
        assert kept.wait(15) == 0
        assert list((tmp_path / "nohup" / "shm").iterdir()) == []
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait(10)


@needs_trace
@pytest.mark.timeout(60)
def test_sighup_to_the_demo_and_its_processes_leaves_nothing(tmp_path: Path) -> None:
    args = ["demo", "--nodes", "2", "--objects", "4", "--object-size", "64KiB", "--memory", "4MiB"]
    command = Command(args, tmp_path, {"KVPOOL_TRACE": str(TRACE)})
    try:
        # Both nodes (they start side by side: the second may be ready before the first).
        command.wait_for(lambda: has_ready("node1.ready")(tmp_path) and has_ready("node2.ready")(tmp_path))
        assert len(command.children) == 3 and len(command.segments) == 2  # a master and two nodes
        for pid in (command.popen.pid, *command.children):  # the terminal's process group
            os.kill(pid, signal.SIGHUP)
        assert command.popen.wait(20) == 128 + signal.SIGHUP, command.log_path.read_text()
        command.assert_nothing_left()
    finally:
        command.end_everything()
