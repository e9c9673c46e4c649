"""What an operator's scripts rely on from the `kvpool` CLI, on real processes on 127.0.0.1: a
setting that means nothing without etcd is refused rather than ignored, the object commands'
exit statuses tell a miss from a failure and from a usage error, and a server's --ready-file is
there only while it serves. Every process a test starts is ended by its pid."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from conftest import wait_until

from kvpool import Store
from kvpool.cli.launcher import free_port, spawn
from tests.test_cluster_surface import kvpool_cli, kvpool_cli_each

MASTER_ANY_PORTS = ("master", "--port", "0", "--http-port", "0")


def test_a_cluster_id_without_etcd_is_refused_but_its_variable_is_left_alone(tmp_path):
    """`--cluster-id` names the cluster in etcd; a single master took it and went on as if
    unsaid. Typed, or in the settings file, it is refused as --etcd-lease-ttl-ms is;
    KVPOOL_CLUSTER_ID, exported on a host for its HA masters, does not stop a plain master."""
    typed = kvpool_cli(*MASTER_ANY_PORTS, "--cluster-id", "prod-a")
    said = " ".join(typed.stderr.decode().split())
    assert typed.returncode == 1 and said.startswith("error: --cluster-id needs --etcd"), said
    settings = tmp_path / "kvpool.toml"
    settings.write_text('[master]\ncluster-id = "prod-a"\n')
    filed = kvpool_cli(*MASTER_ANY_PORTS, "--config", str(settings))
    said = " ".join(filed.stderr.decode().split())
    assert filed.returncode == 1 and f"(--cluster-id: from [master] in {settings})" in said, said
    master = spawn("master", list(MASTER_ANY_PORTS), tmp_path, {"KVPOOL_CLUSTER_ID": "prod-a"})
    try:
        with Store(master.info["endpoint"], token="") as store:
            assert store.cluster_status().segments == []
    finally:
        master.stop()


def test_object_commands_exit_0_done_1_failed_2_usage_3_not_found(make_cluster):
    """`kvpool get` exited 2 on a miss, click's code for a usage error, and `kvpool rm` 1 for a
    key not there, the code of a master out of reach: a script could not tell a miss (compute
    the object again) from a mistake or an outage."""
    cluster = make_cluster(1, "16MiB")
    master = ("--master", cluster.master_endpoint)
    assert kvpool_cli("put", "here", *master, stdin=b"v").returncode == 0
    helps = (((), "2 usage error, 3 not found"), (("get",), "Exit status 3 when there is none"),
             (("rm",), "Exit status 3 when some were not removed"))  # fmt: skip
    got, missed, unreachable, unknown_option, no_key, nothing_named, rm_unreachable, *helped = kvpool_cli_each(
        ("get", "here", *master),
        ("get", "absent", *master),
        ("get", "here", "--master", "127.0.0.1:1"),
        ("get", "here", "--no-such-option", *master),
        ("get", *master),
        ("rm", *master),
        ("rm", "here", "--master", "127.0.0.1:1"),
        *((*command, "--help") for command, _ in helps),
    )  # none of them changes what the cluster holds: side by side
    assert got.returncode == 0
    assert missed.returncode == 3 and missed.stderr.strip().endswith(b"not found"), missed.stderr
    assert unreachable.returncode == 1 and b"cannot reach the master" in unreachable.stderr, unreachable.stderr
    assert unknown_option.returncode == 2
    assert no_key.returncode == 2
    assert nothing_named.returncode == 2
    assert rm_unreachable.returncode == 1
    for (_, said), shown in zip(helps, helped):
        shown = " ".join(shown.stdout.decode().split())  # where a script's author looks
        assert said in shown, shown
    not_removed = kvpool_cli("rm", "here", "absent", *master)
    assert not_removed.returncode == 3 and b"removed 1 of 2 object(s)" in not_removed.stderr, not_removed.stderr


def _endpoint_in(ready_file: Path) -> str | None:
    """The endpoint a --ready-file names, or None while there is none."""
    try:
        return json.loads(ready_file.read_text())["endpoint"]
    except (FileNotFoundError, ValueError):  # ValueError: the instant it is renamed into place
        return None


def test_a_ready_file_is_there_only_while_its_server_serves(tmp_path):
    """--ready-file stayed after a stop and across a restart: a script that waited for it after
    a restart went ahead at once, with the previous run's endpoint (with --port 0, a port nobody
    listens on). A master and a node now remove it at start, before they are ready (a node
    waiting for its master is not, nor a master that refuses its settings), and at a stop."""
    stale = json.dumps({"endpoint": "127.0.0.1:1", "http_port": 1, "segment_id": "gone"})
    master_ready, node_ready = tmp_path / "master.ready", tmp_path / "node.ready"
    master_ready.write_text(stale)
    refused = kvpool_cli(*MASTER_ANY_PORTS, "--node-ttl-ms", "10", "--ready-file", str(master_ready))
    assert refused.returncode == 1 and not master_ready.exists(), refused.stderr
    node_ready.write_text(stale)
    master_ready.write_text(stale)
    port = free_port()  # nobody listens here yet
    (tmp_path / "shm").mkdir()
    cli = [sys.executable, "-m", "kvpool.cli.main"]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    node = subprocess.Popen([*cli, "node", "--master", f"127.0.0.1:{port}", "--memory", "16MiB", "--shm-dir",
                             str(tmp_path / "shm"), "--ready-file", str(node_ready)], **quiet)  # fmt: skip
    master = None
    try:
        wait_until(lambda: not node_ready.exists() or node.poll() is not None, 30)
        assert node.poll() is None and not node_ready.exists()  # waiting for its master
        master = subprocess.Popen([*cli, "master", "--port", str(port), "--http-port", "0", "--ready-file",
                                   str(master_ready)], **quiet)  # fmt: skip
        wait_until(lambda: _endpoint_in(node_ready) and _endpoint_in(master_ready) == f"127.0.0.1:{port}", 30)
        for server, ready in ((node, node_ready), (master, master_ready)):
            server.send_signal(signal.SIGTERM)
            assert server.wait(30) == 0 and not ready.exists()
    finally:
        for server in (node, master):
            if server is not None and server.poll() is None:
                server.kill()
                server.wait(10)
