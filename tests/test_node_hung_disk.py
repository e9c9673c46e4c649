"""A node whose disk tier stops answering (a statvfs that hangs on a failing device or a hung
network mount): its /metrics still answers, and SIGTERM still ends it.

How: a real `kvpool node` process with a disk tier, against a master of make_cluster, whose
os.statvfs is replaced before kvpool is imported: once the test creates a flag file, every
statvfs records that it began (a marker file) and sleeps HANG_S. Asserted: a scrape while the
heartbeat's look hangs answers at once, with the free bytes of the last look (it called
statvfs on the event loop and froze the node, and the master dropped it); SIGTERM while the
look hangs ends the node within seconds, exit status 0 and its segment file removed (the
look's executor thread was joined at exit, until statvfs returned). Each test ends its node
by pid. Bounded: a few seconds each.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

from conftest import wait_until
from prometheus_client.parser import text_string_to_metric_families

HANG_S = 30  # longer than any test waits: a fix that only shortens the hang still fails
FREE_METRIC = "kvpool_node_disk_filesystem_free_bytes"
_HUNG_DISK_NODE = textwrap.dedent(
    f"""
    import os, sys, time
    flag, began = sys.argv[1], sys.argv[2]
    real_statvfs = os.statvfs

    def statvfs(path):
        if os.path.exists(flag):  # the test's word: the disk stops answering
            open(began, "a").close()
            time.sleep({HANG_S})
        return real_statvfs(path)

    os.statvfs = statvfs
    from kvpool.cli.main import app
    sys.argv = ["kvpool", *sys.argv[3:]]
    app()
    """
)


class HungDiskNode:
    """`kvpool node` with a disk tier in `tmp_path`, its statvfs hanging once `hang()` is called."""

    def __init__(self, master: str, tmp_path: Path, *args: str) -> None:
        self.flag = tmp_path / "hang"
        self.began = tmp_path / "statvfs-began"
        self.shm_dir = tmp_path / "shm"
        self.shm_dir.mkdir()
        self.ready = tmp_path / "node.ready"
        self.log_path = tmp_path / "node.log"
        command = [
            sys.executable, "-c", _HUNG_DISK_NODE, str(self.flag), str(self.began), "node", "--master", master,
            "--memory", "16MiB", "--shm-dir", str(self.shm_dir), "--disk-dir", str(tmp_path / "disk"),
            "--disk-size", "32MiB", "--ready-file", str(self.ready), *args,
        ]  # fmt: skip
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            wait_until(lambda: self.ready.exists() or self.popen.poll() is not None, 30)
            assert self.ready.exists(), self.log_path.read_text()
        except AssertionError:
            self.end()
            raise

    def hang(self) -> None:
        self.flag.touch()

    def end(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)


def free_bytes(metrics_endpoint: str, timeout_s: float) -> float:
    text = urllib.request.urlopen(f"http://{metrics_endpoint}/metrics", timeout=timeout_s).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == FREE_METRIC:
                return sample.value
    raise AssertionError(f"no {FREE_METRIC} in /metrics")


def test_a_scrape_answers_while_the_disk_hangs(make_cluster, tmp_path: Path) -> None:
    cluster = make_cluster(0)
    node = HungDiskNode(cluster.master_endpoint, tmp_path, "--metrics-port", "0", "--metrics-host", "127.0.0.1")
    try:
        endpoint = json.loads(node.ready.read_text())["metrics_endpoint"]
        wait_until(lambda: free_bytes(endpoint, 5) > 0, 10)  # a heartbeat's look is done (NaN before)
        node.hang()
        wait_until(node.began.exists, 10)  # the next look hangs now
        for _ in range(3):  # each answered at once, with what the last look found
            assert free_bytes(endpoint, timeout_s=3) > 0
        urllib.request.urlopen(f"http://{endpoint}/health", timeout=3).read()
    finally:
        node.end()


def test_a_node_whose_disk_hangs_exits_on_sigterm(make_cluster, tmp_path: Path) -> None:
    cluster = make_cluster(0)
    node = HungDiskNode(cluster.master_endpoint, tmp_path)
    try:
        assert len(list(node.shm_dir.iterdir())) == 1  # its segment file
        node.hang()
        wait_until(node.began.exists, 10)  # the heartbeat's look hangs now
        node.popen.terminate()
        assert node.popen.wait(5) == 0, node.log_path.read_text()
        assert list(node.shm_dir.iterdir()) == []
    finally:
        node.end()
