"""`kvpool master --config FILE` and `kvpool node --config FILE`: settings from a TOML file,
below the command line and the environment; a file that cannot be right is a usage error
before anything starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import wait_until

from kvpool import Store
from kvpool.cli.launcher import spawn
from kvpool.protocol.messages import GetReplicaList

MIB = 1 << 20


def test_master_and_nodes_take_their_settings_from_a_file(tmp_path):
    settings = tmp_path / "kvpool.toml"
    settings.write_text(
        """
[master]
port = 0             # the default is 50051
http-port = 0        # the default is 9100
lease-ttl-ms = 4321

[node]
master = "127.0.0.1:1"   # node A: its environment names the real master
memory = "16MiB"         # node A: its command line asks for 24MiB
"""
    )
    processes = []
    try:
        master = spawn("master", ["master", "--config", str(settings)], tmp_path)
        processes.append(master)
        endpoint = master.info["endpoint"]
        assert not endpoint.endswith(":50051") and master.info["http_port"] != 9100
        processes.append(
            spawn("node-a", ["node", "--config", str(settings), "--memory", "24MiB"], tmp_path,
                  env={"KVPOOL_MASTER": endpoint})  # fmt: skip
        )
        second = tmp_path / "node-b.toml"
        second.write_text(f'[node]\nmaster = "{endpoint}"\nmemory = "16MiB"\nshm = false\n')
        processes.append(spawn("node-b", ["node"], tmp_path, env={"KVPOOL_CONFIG": str(second)}))
        with Store(endpoint) as store:
            capacities = sorted(s.segment.capacity_bytes for s in store.cluster_status().segments)
            assert capacities == [16 * MIB, 24 * MIB], capacities
            no_shm = [s.segment for s in store.cluster_status().segments if s.segment.capacity_bytes == 16 * MIB]
            assert no_shm[0].shm_path == "", no_shm  # node B's `shm = false`
            store.put("configured", b"x" * 1000)
            assert store.get("configured") == b"x" * 1000
            assert store._ask(GetReplicaList(["configured"])).lease_ttl_ms == 4321
    finally:
        for process in reversed(processes):
            process.stop()


def test_a_settings_file_that_cannot_be_right_is_a_usage_error_naming_it(tmp_path):
    both = ("master", "node")
    cases = {  # the file, what the error says, the commands it stops (the others ignore the table)
        "unknown setting": ('[node]\nmemroy = "1GiB"\n', "[node] has no setting 'memroy'", ("node",)),
        "another command's setting": ('[master]\nmemory = "1GiB"\n', "[master] has no setting 'memory'", ("master",)),
        "outside a table": ('memory = "1GiB"\n', "'memory' is outside a table", both),
        "a table nobody reads": ('[nodes]\nmemory = "1GiB"\n', "no command reads [nodes]", both),
        "not TOML": ("[node\n", "is not TOML", both),
        "a value of the wrong type": ('[node]\nport = "eighty"\n', "[node] port = 'eighty'", ("node",)),
        "a value out of range": ("[master]\nport = 70000\n", "[master] port = 70000", ("master",)),
        "a list": ('[node]\nmemory = ["1GiB"]\n', "give a single value", ("node",)),
        "a yes/no for a number": ("[master]\nport = true\n", "not a yes/no setting", ("master",)),
        "an empty path": ('[node]\ndisk-dir = ""\n', "empty (remove the line", ("node",)),
        "a setting twice": ('[node]\ndisk-dir = "/a"\ndisk_dir = "/b"\n', "sets 'disk_dir' twice", ("node",)),
        "an array of tables": ("[[master]]\nport = 1\n", "[[master]] is an array of tables", both),
        # The node ran on its defaults without a word (walk-through helper-155).
        "no table for the command": ("[master]\nport = 50299\n", "has no [node] table", ("node",)),
        # It said "eviction policy 'fifo' not one of [...]", exit status 1, naming neither (helper-147).
        "a choice not offered": ('[master]\neviction-policy = "fifo"\n',
                                 "[master] eviction-policy = 'fifo': Value error, 'fifo' is not one of 'probation', "
                                 "'lru'", ("master",)),
    }
    checks = []  # a file of its own per case: the commands run two at a time (independent)
    for index, (name, (text, said, commands)) in enumerate(cases.items()):
        path = tmp_path / f"bad{index}.toml"
        path.write_text(text)
        checks += [(name, said, command, path) for command in commands]

    def run_with(check: tuple) -> subprocess.CompletedProcess:
        _, _, command, path = check
        return subprocess.run([sys.executable, "-m", "kvpool.cli.main", command, "--config", str(path)],
                              capture_output=True, timeout=60)  # fmt: skip

    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(run_with, checks))
    for (name, said, command, path), run in zip(checks, runs):
        err = " ".join(run.stderr.decode().split())
        assert run.returncode == 2 and said in err and str(path) in err, (name, command, err)
        assert "Traceback" not in err, (name, command, err)
    path = tmp_path / "bad.toml"
    path.write_bytes(b"\xff\xfe[master]\n")  # not UTF-8: was a UnicodeDecodeError traceback
    run = subprocess.run([sys.executable, "-m", "kvpool.cli.main", "master", "--config", str(path)],
                         capture_output=True, timeout=60)  # fmt: skip
    assert run.returncode == 2 and b"is not TOML: not UTF-8 text" in run.stderr, run.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "node", "--config", str(tmp_path / "absent.toml")],
        capture_output=True, timeout=60,
    )  # fmt: skip
    assert missing.returncode == 2 and b"No such file or directory" in missing.stderr


def test_a_refusal_of_a_setting_from_the_file_says_the_file_set_it(tmp_path):
    """The command's own checks name flags: when the file gave them, the error says so, for
    the flags the command line did not give (an operator who typed no `--disk-size` would
    otherwise look for it on the command line)."""
    path = tmp_path / "node.toml"
    path.write_text('[node]\ndisk-size = "1GiB"\nmemory = "0"\n')

    def refusal(*args: str) -> str:
        run = subprocess.run(
            [sys.executable, "-m", "kvpool.cli.main", "node", "--config", str(path), *args],
            capture_output=True, timeout=60,
        )  # fmt: skip
        assert run.returncode == 1, run
        return " ".join(run.stderr.decode().split())

    said = refusal("--memory", "64MiB")
    assert "--disk-size needs --disk-dir" in said and f"(--disk-size: from [node] in {path})" in said, said
    said = refusal("--memory", "0", "--disk-dir", str(tmp_path))  # the command line's: no note
    assert "--memory 0 out of" in said and "from [node]" not in said, said
    said = refusal("--disk-dir", str(tmp_path))
    assert "--memory 0 out of" in said and f"(--memory: from [node] in {path})" in said, said
    # A value that is no size names its flag too (it said "not a size: 'abc'", naming neither).
    path.write_text('[node]\nmemory = "abc"\n')
    said = refusal()
    assert f"--memory: not a size: 'abc' (try 1GiB, 512MiB or a byte count) (--memory: from [node] in {path})" in said
    said = refusal("--disk-size", "1Q", "--disk-dir", str(tmp_path), "--memory", "64MiB")
    assert "--disk-size: not a size: '1Q'" in said and "from [node]" not in said, said
    # Refusals at start name the flag too (they named a path alone: walk-through helper-147).
    path.write_text(f'[node]\ntoken-file = "{tmp_path / "absent-token"}"\n')
    said = refusal()
    assert "--token-file: cannot read token file" in said and f"(--token-file: from [node] in {path})" in said, said
    master_path = tmp_path / "master.toml"
    master_path.write_text(f'[master]\ndfs-dir = "{tmp_path / "absent" / "kvpool"}"\n')
    run = subprocess.run([sys.executable, "-m", "kvpool.cli.main", "master", "--port", "0", "--http-port", "0",
                          "--config", str(master_path)], capture_output=True, timeout=60)  # fmt: skip
    said = " ".join(run.stderr.decode().split())
    assert run.returncode == 1 and "--dfs-dir: " in said and f"(--dfs-dir: from [master] in {master_path})" in said
    path.write_text('[node]\ndisk-size = "1GiB"\nmemory = "0"\n')
    # Commands run one after the other in one process (a CLI runner): the file was the first's.
    from typer.testing import CliRunner

    from kvpool.cli.main import app

    runner = CliRunner()
    assert "from [node]" in runner.invoke(app, ["node", "--config", str(path), "--memory", "64MiB"]).output
    later = runner.invoke(app, ["node", "--memory", "64MiB", "--disk-size", "1GiB"]).output
    assert "--disk-size needs --disk-dir" in later and "from [node]" not in later, later


def test_a_node_ttl_under_the_heartbeat_from_the_file_is_refused_as_on_the_command_line(tmp_path):
    """`node-ttl-ms = 10` (seconds meant): the master started, and dropped every node between two
    of its heartbeats, forever. Refused at start as `--node-ttl-ms 10` is, saying the file set it."""
    path = tmp_path / "master.toml"
    path.write_text("[master]\nport = 0\nhttp-port = 0\nnode-ttl-ms = 10\n")
    run = subprocess.run([sys.executable, "-m", "kvpool.cli.main", "master", "--config", str(path)],
                         capture_output=True, timeout=60)  # fmt: skip
    said = " ".join(run.stderr.decode().split())
    assert run.returncode == 1 and said.startswith("error: --node-ttl-ms 10: at least 1000 ms"), said
    assert said.endswith(f"(--node-ttl-ms: from [master] in {path})"), said


@pytest.mark.parametrize(("node_ttl_ms", "is_warned"), [(2_999, True), (3_000, False)])
def test_a_node_ttl_of_under_three_heartbeats_is_taken_with_a_warning(tmp_path, node_ttl_ms, is_warned):
    """A TTL of one or two heartbeats drops a node whose heartbeat comes a little late, and its
    objects with it (a test's master with a TTL of one heartbeat did so under load): the master
    starts, and says so."""
    ready = tmp_path / "master.ready"
    master = subprocess.Popen(
        [sys.executable, "-m", "kvpool.cli.main", "master", "--port", "0", "--http-port", "0",
         "--node-ttl-ms", str(node_ttl_ms), "--ready-file", str(ready)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert wait_until(lambda: ready.exists() or master.poll() is not None, 30) and ready.exists()
        master.send_signal(signal.SIGTERM)
        assert master.wait(30) == 0
        said = " ".join(master.stderr.read().decode().split())  # type: ignore[union-attr]
        warning = f"--node-ttl-ms {node_ttl_ms} is under 3 heartbeats (3000 ms): a node whose heartbeat comes"
        assert (warning in said) == is_warned and "Traceback" not in said, said
    finally:
        if master.poll() is None:
            master.kill()
            master.wait(10)


def test_a_local_cluster_takes_nothing_from_a_deployment_in_the_environment(tmp_path, monkeypatch):
    """`kvpool demo` on a production host: the deployment's settings file, DFS mount, etcd and
    token in the environment are not its cluster's (its nodes used to read the file's [node]
    table, its master to index the DFS and stand for election in etcd, and its servers to
    require the deployment's token of the demo's own client)."""
    from kvpool.cli.launcher import LocalCluster

    settings = tmp_path / "kvpool.toml"
    settings.write_text('[master]\nlease-ttl-ms = 4321\n\n[node]\nshm = false\n')
    dfs = tmp_path / "dfs"
    dfs.mkdir()
    monkeypatch.setenv("KVPOOL_CONFIG", str(settings))
    monkeypatch.setenv("KVPOOL_DFS_DIR", str(dfs))
    monkeypatch.setenv("KVPOOL_ETCD", "127.0.0.1:1")  # a master that followed it would not start
    monkeypatch.setenv("KVPOOL_TOKEN", "the-deployment's")  # its servers would refuse this client
    with LocalCluster(1, "16MiB") as cluster, Store(cluster.master_endpoint, token=cluster.client_token) as store:
        status = store.cluster_status()
        assert [s.segment.capacity_bytes for s in status.segments] == [16 * MIB]  # no DFS segment either
        assert status.segments[0].segment.shm_path != ""  # not the file's `shm = false`
        store.put("local", b"y" * 100)
        assert store._ask(GetReplicaList(["local"])).lease_ttl_ms == 10_000
    assert list(dfs.iterdir()) == []


def test_a_token_in_the_environment_wins_over_a_token_file_in_the_settings_file(tmp_path):
    """The precedence holds for the token too, which the commands read from KVPOOL_TOKEN
    themselves (it is no option's variable): a settings file's `token-file` used to win."""
    from kvpool.errors import Unauthorized

    token_file = tmp_path / "token"
    token_file.write_text("from-the-file")
    token_file.chmod(0o600)
    settings = tmp_path / "kvpool.toml"
    settings.write_text(f'[master]\nport = 0\nhttp-port = 0\ntoken-file = "{token_file}"\n')
    master = spawn("master", ["master", "--config", str(settings)], tmp_path, env={"KVPOOL_TOKEN": "from-the-env"})
    try:
        with Store(master.info["endpoint"], token="from-the-env") as store:
            assert store.cluster_status().segments == []
        with pytest.raises(Unauthorized):
            Store(master.info["endpoint"], token="from-the-file", connect_timeout_ms=2_000)
    finally:
        master.stop()


def test_kvpool_token_is_stripped_as_a_token_file_is(tmp_path):
    """A secret made from a file and set as a variable (a Kubernetes secretKeyRef) keeps the
    file's newline: KVPOOL_TOKEN was taken verbatim, a token file stripped, and the same secret
    gave two cluster keys (Unauthorized). Only whitespace is refused, as an empty file is."""
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    token_file.chmod(0o600)
    master = spawn("master", ["master", "--port", "0", "--http-port", "0", "--token-file", str(token_file)], tmp_path)
    try:
        cases = (("s3cret-token\n", 0, b""), (" \n", 1, b"error: KVPOOL_TOKEN holds only whitespace"))
        for value, code, stderr in cases:
            out = subprocess.run(
                [sys.executable, "-m", "kvpool.cli.main", "ls", "--master", master.info["endpoint"]],
                capture_output=True, timeout=60, env={**os.environ, "KVPOOL_TOKEN": value},
            )  # fmt: skip
            assert (out.returncode, out.stderr[: len(stderr)]) == (code, stderr), out.stderr
    finally:
        master.stop()


def test_the_eviction_policies_offered_are_the_masters():
    from kvpool.cli.main import EvictionPolicyName
    from kvpool.master.eviction import POLICIES

    assert {name.value for name in EvictionPolicyName} == set(POLICIES)
