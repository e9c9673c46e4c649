"""What operators touch on a running cluster of real processes: hostile bytes on the master's and
a node's ports (the servers keep serving and no stored object changes), the object commands of
the `kvpool` CLI, the Prometheus /metrics of master and node, and the addresses and ports the
servers listen on and report."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpool import Store, limits
from kvpool.cli.replay import find_trace
from kvpool.errors import ConnectFailed, InvalidParams, SegmentNotFound, Unauthorized
from kvpool.protocol.frames import encode_frame
from kvpool.protocol.messages import (
    AuthResponse,
    GetReplicaList,
    ReadItem,
    ReadSlices,
    WriteGrant,
    WriteItem,
    WriteSlices,
)


def kvpool_cli(*args: str, stdin: bytes = b"", env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", *args], input=stdin, capture_output=True, timeout=60,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def kvpool_cli_each(*commands: tuple[str, ...]) -> list[subprocess.CompletedProcess]:
    """kvpool_cli of each command, in their order, two at a time: for commands that do not
    depend on one another. Each is half a second of one core's Python start-up, and the test
    runner waits meanwhile: a CI machine's second core did nothing."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda args: kvpool_cli(*args), commands))


def hostile_payloads() -> dict[str, bytes]:
    header = struct.Struct(limits.FRAME_HEADER_FMT)
    return {
        "random bytes": os.urandom(64 * 1024),
        "truncated frame": encode_frame(GetReplicaList(["k"] * 100), 1)[:-7],
        "huge control size": header.pack(limits.FRAME_MAGIC, 1, 0, 1, 2**32 - 1, 0),
        "huge payload size": header.pack(limits.FRAME_MAGIC, 1, 0, 1, 4, 2**64 - 1),
        "garbage control": header.pack(limits.FRAME_MAGIC, 1, 0, 1, 8, 0) + b"\xc1" * 8,
        "handshake with a payload": encode_frame(AuthResponse(os.urandom(32), b""), 0, payload_size=10) + b"x" * 10,
    }


def send_and_wait_for_close(endpoint: str, data: bytes) -> bool:
    """Send bytes without a handshake; True if the server closed the connection."""
    host, port = endpoint.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.recv(4096)  # the server's challenge
        try:
            sock.sendall(data)
        except OSError:
            return True
        sock.settimeout(5)
        try:
            while sock.recv(65536):
                pass
        except (ConnectionResetError, BrokenPipeError):
            pass
        return True


def test_hostile_bytes_leave_master_and_node_serving_and_objects_intact(make_cluster):
    cluster = make_cluster(2, "16MiB")
    values = {f"precious-{i}": os.urandom(50_000) for i in range(20)}
    with Store(cluster.master_endpoint, shm_enabled=False) as store:
        store.put_batch(list(values), list(values.values()))
        for endpoint in [cluster.master_endpoint, *(n.info["endpoint"] for n in cluster.nodes)]:
            for name, data in hostile_payloads().items():
                assert send_and_wait_for_close(endpoint, data), (endpoint, name)
                assert store.get_batch(list(values)) == list(values.values()), (endpoint, name)
        # Authenticated but out of bounds: refused with a typed error, nothing written.
        node = cluster.nodes[0]
        segment_id = node.info["segment_id"]
        conn = store._run(store._async._peers.lanes(node.info["endpoint"], 1))[0]
        for offset, size in [(-1, 10), (16 << 20, 1), (0, 1 << 40)]:
            try:
                store._run(conn.request(ReadSlices([ReadItem(segment_id, offset, size)])))
                raise AssertionError("out-of-range read accepted")
            except InvalidParams:
                pass
        forged = WriteGrant(segment_id, 0, 16, expiry_ms=1)  # long expired
        try:
            store._run(conn.request(WriteSlices([WriteItem(forged, 0, 16)]), [b"X" * 16]))
            raise AssertionError("expired grant accepted")
        except (Unauthorized, InvalidParams):
            pass
        try:
            store._run(conn.request(ReadSlices([ReadItem("no-such-segment", 0, 1)])))
            raise AssertionError("unknown segment accepted")
        except SegmentNotFound:
            pass
        assert store.get_batch(list(values)) == list(values.values())
        assert all(n.is_alive() for n in cluster.nodes) and cluster.master.is_alive()


def test_a_master_out_of_open_files_says_so_and_serves_again_once_they_close(make_cluster):
    """A client that leaks connections ran a master out of open files. The master now holds at
    most a share of them (connection.authenticated_connections_max: 40 of 160): the leak's
    next connections are refused before their handshake ends, saying why in the master's log;
    its clients already connected are served throughout, and new ones once the leaked
    connections close (or have been silent long enough to be closed:
    tests/test_connection_bounds.py)."""
    import asyncio
    import resource

    from kvpool.errors import ConnectFailed
    from kvpool.protocol.auth import cluster_key
    from kvpool.transports.connection import connect

    cluster = make_cluster(1, "16MiB", token="secret")
    resource.prlimit(cluster.master.pid, resource.RLIMIT_NOFILE, (160, 160))
    with Store(cluster.master_endpoint, token="secret") as store:
        store.put("kept", b"x" * 1000)

        async def leak() -> tuple[int, bool]:
            held = []
            served = True
            try:
                for attempt in range(200):  # more than the master can hold
                    if attempt % 8 == 0:  # served throughout (and so never the silent one closed)
                        served &= store.get("kept") == b"x" * 1000
                    try:
                        held.append(await connect(cluster.master_endpoint, key=cluster_key("secret"), timeout_ms=2_000))
                    except ConnectFailed:
                        break
                return len(held), served and store.get("kept") == b"x" * 1000
            finally:
                for conn in held:
                    conn.close()

        held, served = asyncio.run(leak())
        assert 30 < held < 40 and served, (held, served)  # the node's and the store's among the 40
        log_text = cluster.master.log_tail(200)
        assert "this server holds 40 connections" in log_text, log_text
        deadline_s = time.monotonic() + 10
        while True:  # the master lets go of the closed connections
            try:
                with Store(cluster.master_endpoint, token="secret") as fresh:
                    assert fresh.get("kept") == b"x" * 1000
                break
            except ConnectFailed:
                assert time.monotonic() < deadline_s, "no new connection after the leaked ones closed"
                time.sleep(0.1)


def test_object_commands_of_the_cli(make_cluster, tmp_path):
    cluster = make_cluster(2, "16MiB")
    master = ["--master", cluster.master_endpoint]
    assert kvpool_cli("put", "cli/a", *master, stdin=b"alpha").returncode == 0
    source = tmp_path / "b.bin"
    source.write_bytes(os.urandom(200_000))
    assert kvpool_cli("put", "cli/b", str(source), "--replicas", "2", *master).returncode == 0
    got = kvpool_cli("get", "cli/a", *master)
    assert got.returncode == 0 and got.stdout == b"alpha"
    listing = kvpool_cli("ls", "^cli/", *master).stdout.decode()
    assert "cli/a" in listing and "cli/b" in listing and "200000" in listing
    stat = kvpool_cli("stat", "cli/b", "--json", *master)
    import json

    row = json.loads(stat.stdout)[0]
    assert row["size"] == 200_000 and len(row["replicas"]) == 2 and row["code"] == "OK"
    cluster_stat = json.loads(kvpool_cli("stat", "--json", *master).stdout)
    assert cluster_stat["object_count"] == 2 and len(cluster_stat["segments"]) == 2
    with Store(cluster.master_endpoint) as reader:  # a reader still copying holds a read lease
        assert reader._ask(GetReplicaList(["cli/a"])).codes == [0]
        leased = kvpool_cli("rm", "cli/a", *master)
        assert leased.returncode == 3 and b"OBJECT_HAS_LEASE" in leased.stderr
    assert kvpool_cli("rm", "cli/a", "--force", *master).returncode == 0
    assert kvpool_cli("get", "cli/b", "-o", str(tmp_path / "b.out"), *master).returncode == 0
    for unreadable in kvpool_cli_each(  # a clean error, not a traceback
        ("put", "cli/c", str(tmp_path / "absent"), *master),
        ("get", "cli/b", "-o", str(tmp_path / "absent" / "b.out"), *master),
    ):
        message = b" ".join(unreadable.stderr.split())  # rich wraps long lines
        assert unreadable.returncode == 1 and b"No such file or directory" in message, message
        assert b"Traceback" not in unreadable.stderr
    assert kvpool_cli("rm", "cli/b", *master).returncode == 0  # those gets gave their leases back
    assert kvpool_cli("get", "cli/a", *master).returncode == 3
    assert kvpool_cli("rm", "--all", "--force", *master).returncode == 0
    assert kvpool_cli("ls", *master).stdout == b""
    assert kvpool_cli("rm", *master).returncode == 2  # nothing named: usage error
    helps = ("master", "node", "put", "get", "rm", "ls", "stat", "demo", "bench")
    unreachable, bad_master, out_of_range, no_nodes, *helped = kvpool_cli_each(
        ("get", "x", "--master", "127.0.0.1:1"),
        ("node", "--master", "nohost", "--memory", "16MiB"),
        ("master", "--port", "99999"),
        ("demo", "--nodes", "0"),
        *((command, "--help") for command in helps),
    )  # fmt: skip
    assert unreachable.returncode == 1 and b"cannot reach the master" in unreachable.stderr
    # Said as an operator reads it: was "ConnectionRefusedError: [Errno 111] Connection refused".
    assert b"127.0.0.1:1: Connection refused (ECONNREFUSED)" in b" ".join(unreachable.stderr.split())
    # The API says the address too: it said "Connection refused (ECONNREFUSED)" alone (helper-157).
    with pytest.raises(ConnectFailed, match=r"^connect to 127\.0\.0\.1:1: Connection refused"):
        Store("127.0.0.1:1", token="")
    assert [out.returncode for out in helped] == [0] * len(helps), helped
    # What an operator types or stores is printed as it is, never read as rich markup.
    marked = "cli/[red]x[/]"
    assert kvpool_cli("put", marked, *master, stdin=b"m").returncode == 0
    shown = kvpool_cli("stat", marked, *master)
    assert shown.returncode == 0 and marked.encode() in shown.stdout, shown.stdout
    assert kvpool_cli("rm", marked, "[/]", *master).stderr.count(b"[/]") == 1  # "[/]: not removed"
    assert bad_master.returncode == 1 and b"[/CLUSTER_ID]" in bad_master.stderr, bad_master.stderr
    # A port beyond 65535 is a usage error, not another port (99999 listened on 34463).
    assert out_of_range.returncode == 2 and b"65535" in out_of_range.stderr
    assert no_nodes.returncode == 2  # refused before a master starts


def test_unreadable_token_files_and_busy_http_ports_are_one_line_errors(tmp_path):
    """What an operator mistypes: a token file that is missing, a directory or not text (and
    one every user can read: a warning), and a metrics port another process holds (9100, the
    master's default, is node_exporter's)."""
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe\x01")
    reasons = ((tmp_path / "missing", "No such file"), (tmp_path, "Is a directory"), (binary, "not UTF-8"))
    commands = (("ls", "--master", "127.0.0.1:1"), ("master", "--port", "0", "--http-port", "0"))
    unreadable = [(path, reason, args) for path, reason in reasons for args in commands]
    outs = kvpool_cli_each(*((*args, "--token-file", str(path)) for path, _, args in unreadable))
    for (path, reason, _), out in zip(unreadable, outs):
        assert out.returncode == 1, out
        assert f"cannot read token file {path}: {reason}" in " ".join(out.stderr.decode().split())
        assert b"Traceback" not in out.stderr
    # The file named by the environment, not on the command line: the error says where from.
    named = kvpool_cli("ls", "--master", "127.0.0.1:1", env={"KVPOOL_TOKEN_FILE": str(tmp_path / "missing")})
    message = " ".join(named.stderr.decode().split())
    assert named.returncode == 1 and f"{tmp_path / 'missing'} (named by $KVPOOL_TOKEN_FILE)" in message, message
    shared = tmp_path / "token"
    shared.write_text("secret")
    for mode, warned in ((0o644, True), (0o640, False)):
        shared.chmod(mode)
        out = kvpool_cli("ls", "--master", "127.0.0.1:1", "--token-file", str(shared))
        message = " ".join(out.stderr.decode().split())
        assert (f"token file {shared} can be read by every user of this host (mode {mode:03o})" in message) is warned
        assert out.returncode == 1 and b"Traceback" not in out.stderr, out  # no master there: it went on
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = str(held.getsockname()[1])
        metrics_ports = ((("master", "--port", "0", "--http-port", port), "--http-port"),
                         (("node", "--master", "127.0.0.1:1", "--memory", "16MiB", "--metrics-port", port),
                          "--metrics-port"))  # fmt: skip
        rpc_ports = (("master", "--port", port, "--http-port", "0"),  # the RPC port: was "OSError: [Errno 98] ..."
                     ("node", "--master", "127.0.0.1:1", "--memory", "16MiB", "--port", port))  # fmt: skip
        *metrics_outs, master_out, node_out = kvpool_cli_each(*(args for args, _ in metrics_ports), *rpc_ports)
        for (_, option), out in zip(metrics_ports, metrics_outs):
            message = " ".join(out.stderr.decode().split())
            assert out.returncode == 1 and b"Traceback" not in out.stderr, out
            assert f"cannot listen on 127.0.0.1:{port} for /metrics ({option})" in message
        for out in (master_out, node_out):
            last = out.stderr.decode().strip().splitlines()[-1]
            assert out.returncode == 1 and b"Traceback" not in out.stderr, out
            expected = f"cannot listen on 127.0.0.1:{port} (--host, --port): Address already in use"
            assert last.startswith("error: ") and expected in last
    # A host name the resolver refuses: its reason, not "Unknown error -2" (the resolver's errno
    # read as the system's).
    for out in kvpool_cli_each(("master", "--port", "0", "--http-port", "0", "--host", "::1%lo"),
                               ("node", "--master", "127.0.0.1:1", "--memory", "16MiB", "--host", "::1%lo")):
        last = out.stderr.decode().strip().splitlines()[-1]
        assert out.returncode == 1 and b"Traceback" not in out.stderr, out
        assert "cannot listen on ::1%lo:0 (--host, --port): " in last and "Unknown error" not in last, last


def test_settings_that_cannot_work_are_refused_before_anything_starts(tmp_path):
    """Each went unnoticed until it mattered: a misspelt log level (a traceback), a tier size
    without its directory (ignored), a disk tier larger than its filesystem (offloads failing
    once it filled), a demo whose objects no node could hold (every put failing); and a bad
    value was reported under its config field's name, not the flag the operator typed."""
    node = ("node", "--master", "127.0.0.1:1", "--memory", "16MiB")
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    # Larger than the whole filesystem: it cannot fit however much others free meanwhile (the
    # free space plus 1 GiB fitted once, when a test beside this one deleted its files).
    too_large = os.statvfs(tmp_path).f_blocks * os.statvfs(tmp_path).f_frsize + limits.GIB
    cases = (
        ((*node, "--log-level", "loud"), 2, "'loud' is not one of 'debug', 'info', 'warning', 'error'"),
        (("master", "--port", "0", "--log-level", "verbose"), 2, "'verbose' is not one of"),
        ((*node, "--disk-size", "1GiB"), 1, "--disk-size needs --disk-dir"),
        (("master", "--port", "0", "--dfs-size", "1GiB"), 1, "--dfs-size needs --dfs-dir"),
        # Election settings without an election (ignored, before).
        (("master", "--port", "0", "--remount-grace-ms", "100"), 1, "--remount-grace-ms needs --etcd"),
        (("master", "--port", "0", "--etcd-lease-ttl-ms", "10000"), 1, "--etcd-lease-ttl-ms needs --etcd"),
        (("master", "--port", "0", "--advertise-host", "127.0.0.1"), 1, "--advertise-host needs --etcd"),
        ((*node, "--metrics-host", "127.0.0.1"), 1, "--metrics-host needs --metrics-port"),
        ((*node, "--disk-dir", str(tmp_path / "disk"), "--disk-size", str(too_large)), 1,
         f"a disk tier of {too_large} bytes (--disk-size) does not fit in {tmp_path / 'disk'}"),
        (("demo", "--object-size", "0"), 1, "--object-size 0 bytes: give 1 byte to --memory (128 MiB)"),
        (("demo", "--memory", "16MiB", "--object-size", "17MiB"), 1, "--object-size 17 MiB: give 1 byte to --memory"),
        # The config's checks name the flag typed, not the field behind it (was lease_ttl_ms).
        (("master", "--port", "0", "--lease-ttl-ms", "0"), 1, "error: --lease-ttl-ms must be positive"),
        (("master", "--port", "0", "--evict-ratio", "0.95"), 1, "need 0 < --evict-ratio < --evict-watermark-high"),
        (("node", "--master", "127.0.0.1:1", "--memory", "1000"), 1, "error: --memory 1000 out of"),
        # Was "FileNotFoundError: [Errno 2] ..." and "NotADirectoryError: [Errno 20] ...".
        ((*node, "--shm-dir", str(tmp_path / "missing")), 1,
         f"error: cannot make segments in {tmp_path / 'missing'}: No such file or directory"),
        ((*node, "--disk-dir", str(a_file), "--disk-size", "32MiB"), 1,
         f"error: cannot make directory {a_file / 'objects'}: Not a directory"),
    )  # fmt: skip
    for (_, code, reason), out in zip(cases, kvpool_cli_each(*(args for args, _, _ in cases))):
        assert out.returncode == code and b"Traceback" not in out.stderr, out
        assert reason in " ".join(out.stderr.decode().split()), out.stderr
    assert not (tmp_path / "disk").exists()  # no tier was made, nor its directory (it was, empty)
    out = kvpool_cli("master", "--help")
    assert "--log-level <debug|info|warning|error>" in out.stdout.decode()


def test_a_ready_file_that_cannot_be_written_is_one_line_and_leaves_no_segment(make_cluster, tmp_path, memory_dir):
    """--ready-file where no file can be made (a missing directory): the server, already started,
    ended with a traceback; now with one line, and the node removes its segment file (in a
    directory of its own: other tests' nodes come and go in /dev/shm meanwhile)."""
    cluster = make_cluster(0)
    ready = tmp_path / "missing" / "ready"
    shm_dir = memory_dir
    node = ("node", "--master", cluster.master_endpoint, "--memory", "16MiB", "--shm-dir", str(shm_dir))
    for args in (("master", "--port", "0", "--http-port", "0"), node):
        out = kvpool_cli(*args, "--log-level", "warning", "--ready-file", str(ready))
        assert out.returncode == 1 and b"Traceback" not in out.stderr, out.stderr
        assert out.stderr.decode() == f"error: cannot write --ready-file {ready}: No such file or directory\n"
    assert list(shm_dir.iterdir()) == []


def test_nodes_started_side_by_side_stop_together_when_one_cannot_start(make_cluster):
    """start_nodes starts its nodes at once and waits for each: when one exits (here a memory
    size that cannot be parsed), the error names it and the others it started are stopped,
    not left running unlisted; the nodes started before are untouched."""
    from kvpool.errors import ConnectFailed

    cluster = make_cluster(1, "16MiB")
    with pytest.raises(ConnectFailed, match="node3 did not start"):
        cluster.start_nodes([(), ("--memory", "lots")])
    assert [node.name for node in cluster.nodes] == ["node1"] and cluster.nodes[0].is_alive()
    ready_file = str(cluster.workdir / "node2.ready")
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):  # gone meanwhile
            assert ready_file not in (proc / "cmdline").read_bytes().decode(errors="replace"), "node2 still runs"
    with Store(cluster.master_endpoint) as store:  # node2 mounted (if it was quick), then left
        assert len(store.cluster_status().segments) == 1


def test_a_node_that_cannot_start_is_named_at_once_while_one_before_it_still_waits(make_cluster):
    """Side by side, each child is watched while any is waited for: a node that exits is
    reported at once, by name, not after the ready timeout of one still waiting for its
    master (which a node does for as long as it takes)."""
    from kvpool.cli.launcher import READY_TIMEOUT_S, free_port
    from kvpool.errors import ConnectFailed

    cluster = make_cluster(0)
    started = time.monotonic()
    with pytest.raises(ConnectFailed, match="node2 did not start"):
        cluster.start_nodes([("--master", f"127.0.0.1:{free_port()}"), ("--memory", "lots")])
    assert time.monotonic() - started < READY_TIMEOUT_S / 3 and cluster.nodes == []


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def test_prometheus_metrics_of_master_and_node(make_cluster):
    cluster = make_cluster(1, "16MiB", node_args=("--metrics-port", "0"))
    with Store(cluster.master_endpoint, shm_enabled=False) as store:
        store.put_batch([f"m{i}" for i in range(10)], [b"z" * 4096] * 10)
        store.get_batch([f"m{i}" for i in range(10)] + ["absent"])
    # Each says where its /metrics is, at start.
    assert f"/metrics on http://127.0.0.1:{cluster.http_port}" in cluster.master.log_path.read_text()
    node_metrics = cluster.nodes[0].info["metrics_endpoint"]
    assert node_metrics and f"/metrics on http://{node_metrics}" in cluster.nodes[0].log_path.read_text()
    master = scrape(cluster.http_port)
    assert master["kvpool_master_objects"] == 10
    assert master["kvpool_master_puts_total"] == 10
    assert master["kvpool_master_hits_total"] == 10
    assert master["kvpool_master_misses_total"] == 1
    used = [v for k, v in master.items() if k.startswith("kvpool_master_segment_used_bytes")]
    assert used == [10 * 4096]
    # Ten pages put into an empty 16 MiB segment: one hole, the rest of it.
    assert [v for k, v in master.items() if k.startswith("kvpool_master_segment_free_extents")] == [1]
    largest = [v for k, v in master.items() if k.startswith("kvpool_master_segment_largest_free_bytes")]
    capacity = [v for k, v in master.items() if k.startswith("kvpool_master_segment_capacity_bytes")]
    assert largest == [capacity[0] - 10 * 4096]
    assert [v for k, v in master.items() if k.startswith("kvpool_master_segment_quarantined_bytes")] == [0]
    # The eviction policy's sets (all ten were read: protected) and its readmissions (none:
    # nothing was evicted).
    assert master["kvpool_master_policy_objects{set=protected}"] == 10
    assert master["kvpool_master_policy_objects{set=probation}"] == 0
    assert master["kvpool_master_readmissions_total"] == 0
    node_port = int(cluster.nodes[0].info["metrics_endpoint"].rsplit(":", 1)[1])
    node = scrape(node_port)
    assert node["kvpool_node_objects"] == 10
    assert node["kvpool_node_segment_used_bytes"] == 10 * 4096
    assert node["kvpool_node_read_bytes_total"] >= 10 * 4096
    assert node["kvpool_node_commits_total{result=ok}"] == 10
    assert node["kvpool_node_commits_hashed_in_place_total"] == 0  # over TCP: the node hashed them
    with Store(cluster.master_endpoint) as store:  # same host: copied and hashed in the segment
        store.put_batch([f"s{i}" for i in range(5)], [b"s" * 4096] * 5)
    deadline = time.monotonic() + 5  # the put is answered before the node records the commit
    while scrape(node_port)["kvpool_node_commits_total{result=ok}"] < 15 and time.monotonic() < deadline:
        time.sleep(0.05)
    node = scrape(node_port)
    assert node["kvpool_node_commits_total{result=ok}"] == 15
    assert node["kvpool_node_commits_hashed_in_place_total"] == 5
    # Polling after replies (transports/busy_poll.py): its windows and time are counted.
    master = scrape(cluster.http_port)
    assert master["kvpool_master_busy_poll_windows_total"] >= 1
    assert 0 < master["kvpool_master_busy_poll_seconds_total"] < 10
    assert node["kvpool_node_busy_poll_windows_total"] >= 1  # the node answered reads and writes
    assert 0 < node["kvpool_node_busy_poll_seconds_total"] < 10
    # A put given up while its writes may still land holds its range until the release
    # timeout: used, and said so.
    from kvpool.protocol.messages import PutRevoke, PutStart, ReplicateConfig
    from kvpool.transports.blocking import BlockingConnection

    conn = BlockingConnection.open(cluster.master_endpoint, key=None, timeout_ms=5_000, prefer_local=False)
    try:
        conn.request(PutStart(["q"], [8192], ReplicateConfig(), put_id=7), timeout_ms=5_000)
        conn.request(PutRevoke(["q"], writes_in_flight=True, put_id=7), timeout_ms=5_000)
    finally:
        conn.close()
    master = scrape(cluster.http_port)
    assert [v for k, v in master.items() if k.startswith("kvpool_master_segment_quarantined_bytes")] == [8192]
    assert [v for k, v in master.items() if k.startswith("kvpool_master_segment_used_bytes")] == [15 * 4096 + 8192]
    health = urllib.request.urlopen(f"http://127.0.0.1:{cluster.http_port}/health", timeout=5).read()
    assert b"ok" in health


def test_cluster_processes_run_this_kvpool_whatever_the_current_directory(make_cluster, tmp_path, monkeypatch):
    """The master and nodes import the kvpool this process imported, not one that lies in the
    current directory (`python -m` put it first: a benchmark comparing two trees, run from one
    checkout with PYTHONPATH naming the other, ran that checkout's servers in both arms)."""
    decoy = tmp_path / "kvpool" / "cli"
    decoy.mkdir(parents=True)
    (tmp_path / "kvpool" / "__init__.py").write_text("")
    (decoy / "__init__.py").write_text("")
    (decoy / "main.py").write_text("import sys\nsys.exit('the kvpool of the current directory ran')\n")
    monkeypatch.chdir(tmp_path)
    cluster = make_cluster(1, "8MiB")
    with Store(cluster.master_endpoint) as store:
        store.put("k", b"v")
        assert store.get("k") == b"v"


def test_the_demo_runs_end_to_end_and_leaves_no_process_behind():
    """The README's first command: a whole local cluster, every byte checked on both paths,
    the live replay (where the trace is: next to the repository, or $KVPOOL_TRACE; else it
    says it skipped it), and every process it started ended."""
    demo = kvpool_cli("demo", "--nodes", "2", "--memory", "32MiB", "--objects", "16", "--object-size", "64KiB")
    out = demo.stdout.decode()
    assert demo.returncode == 0, demo.stderr.decode()[-2000:]
    assert "all 16 objects read back intact on both paths" in out
    replayed = "pooling the same memory" if find_trace() else "trace replay skipped"
    assert "stopped master and nodes" in out and replayed in out
    pids = [int(word) for line in out.splitlines() if "node pid" in line for word in line.split() if word.isdigit()]
    assert len(pids) == 2
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def test_a_node_signalled_while_it_waits_for_its_master_leaves_gracefully(tmp_path: Path) -> None:
    """SIGTERM while `kvpool node` starts (here: waiting for a master that is not there) ends
    it through its graceful stop, as once it serves: exit status 0 and its segment file gone.
    (The signal handler used to be installed after the start: the default one killed it and
    left the file.)"""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nobody listens here
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    node = subprocess.Popen(
        [sys.executable, "-m", "kvpool.cli.main", "node", "--master", f"127.0.0.1:{port}",
         "--memory", "16MiB", "--shm-dir", str(shm_dir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not list(shm_dir.iterdir()) and time.monotonic() < deadline and node.poll() is None:
            time.sleep(0.02)
        assert list(shm_dir.iterdir()), "the node never made its segment file"
        node.send_signal(signal.SIGTERM)
        assert node.wait(30) == 0, node.stderr.read().decode() if node.stderr else ""
        assert list(shm_dir.iterdir()) == []
    finally:
        if node.poll() is None:
            node.kill()
            node.wait(10)


def test_a_master_stopped_by_a_signal_says_so_as_a_node_does(tmp_path: Path) -> None:
    """SIGTERM, SIGINT and SIGHUP stop a master gracefully, and a node logs "node N stopped";
    the master logged nothing, so its log did not tell a stop from a kill (SIGKILL, OOM)."""
    masters = []
    try:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            master, info = _start_server(tmp_path, sig.name, ("master", "--port", "0", "--http-port", "0"))
            masters.append(master)
            master.send_signal(sig)
            assert master.wait(15) == 0, (tmp_path / f"{sig.name}.log").read_text()
            last = (tmp_path / f"{sig.name}.log").read_text().splitlines()[-1]
            assert " INFO " in last and last.endswith(f": master {info['endpoint']} stopped"), last
    finally:
        _stop(masters)


def _rss_kib(pid: int, field: str = "VmRSS") -> int:
    """A process's resident memory now, or at its peak (field "VmHWM")."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith(f"{field}:")))


def test_a_client_that_never_reads_its_replies_is_not_answered_into_memory(make_cluster):
    """A peer that sends requests and never reads the replies: the master stops reading from
    it once its replies back up, instead of answering into memory without bound (300 MB in
    44 s in a probe); other clients are served meanwhile."""
    from kvpool.protocol.messages import ClusterStatus
    from kvpool.transports.blocking import BlockingConnection

    cluster = make_cluster(1, "16MiB")
    conn = BlockingConnection.open(cluster.master_endpoint, key=None, timeout_ms=5_000, prefer_local=False)
    sock = conn._socket
    requests = encode_frame(ClusterStatus(), 1) * 2_000
    before_kib = _rss_kib(cluster.master.pid)
    sock.settimeout(0.5)
    started = time.monotonic()
    try:
        while time.monotonic() - started < 3:  # the buffers fill within the first second
            try:
                sock.send(requests)
            except TimeoutError:
                pass  # the master stopped reading: what it should do
        grown_kib = _rss_kib(cluster.master.pid) - before_kib
        with Store(cluster.master_endpoint) as store:
            asked = time.monotonic()
            assert len(store.cluster_status().segments) == 1
            assert time.monotonic() - asked < 2
    finally:
        conn.close()
    assert grown_kib < 8 * 1024, grown_kib  # answered into memory: ~7 MB/s


def test_idle_connections_cost_the_master_little_memory(make_cluster):
    """Every client keeps connections to the master. Each held a 256 KiB receive buffer from
    its first byte on: 3,000 idle connections took a master to 848 MB in a probe. An idle
    connection now holds 16 KiB; the master stays within a few tens of MB for 400, and still
    answers each of them."""
    from kvpool.protocol.messages import ClusterStatus
    from kvpool.transports.blocking import BlockingConnection

    cluster = make_cluster(1, "16MiB")
    before_kib = _rss_kib(cluster.master.pid)
    connections = []
    try:
        for _ in range(400):
            connections.append(
                BlockingConnection.open(cluster.master_endpoint, key=None, timeout_ms=5_000, prefer_local=False)
            )
        grown_kib = _rss_kib(cluster.master.pid) - before_kib
        for conn in connections[::50]:
            assert len(conn.request(ClusterStatus(), timeout_ms=5_000).segments) == 1
    finally:
        for conn in connections:
            conn.close()
    assert grown_kib < 40 * 1024, grown_kib  # 400 x 256 KiB was 100 MiB


def test_the_http_ports_listen_where_they_are_told(make_cluster):
    """The master's /metrics, /health and /status and a node's /metrics take no token: an
    operator binds them apart from the RPC ports (--http-host, --metrics-host), e.g. where only
    the monitoring reaches."""
    node_args = ("--metrics-port", "0", "--metrics-host", "127.0.0.3")
    cluster = make_cluster(1, "16MiB", master_args=("--http-host", "127.0.0.2"), node_args=node_args)
    health = urllib.request.urlopen(f"http://127.0.0.2:{cluster.http_port}/health", timeout=5).read()
    assert b'"status": "ok"' in health or b'"status":"ok"' in health
    metrics_port = int(cluster.nodes[0].info["metrics_endpoint"].rsplit(":", 1)[1])
    assert urllib.request.urlopen(f"http://127.0.0.3:{metrics_port}/metrics", timeout=5).status == 200
    for address, port in (("127.0.0.1", cluster.http_port), ("127.0.0.1", metrics_port)):
        with socket.socket() as probe:
            assert probe.connect_ex((address, port)) != 0  # not served there


def test_http_connections_that_send_no_request_cannot_take_the_masters_descriptors(make_cluster):
    """Connections to the master's HTTP port (no token) that each sent half a request's head and
    stalled held every descriptor of the master: then no client could connect. A port now holds
    HTTP_CONNECTIONS_MAX connections and closes those past them as they come, closes those with
    no complete request within HTTP_REQUEST_HEAD_TIMEOUT_MS and idle ones after
    HTTP_KEEPALIVE_TIMEOUT_MS: a client with the token is served throughout, and /health answers
    once they are gone."""
    import resource

    cluster = make_cluster(1, "16MiB", token="secret")
    resource.prlimit(cluster.master.pid, resource.RLIMIT_NOFILE, (200, 200))
    health_url = f"http://127.0.0.1:{cluster.http_port}/health"
    t0 = time.monotonic()
    idle = socket.create_connection(("127.0.0.1", cluster.http_port), timeout=5)  # keep-alive, then silent
    idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert idle.recv(65536).startswith(b"HTTP/1.1 200")
    flood: list[socket.socket] = [idle]
    try:
        for _ in range(250):  # more than the master's descriptors
            sock = socket.create_connection(("127.0.0.1", cluster.http_port), timeout=5)
            flood.append(sock)
            with contextlib.suppress(OSError):  # refused already
                sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        with contextlib.suppress(ConnectionResetError):
            assert flood[-1].recv(65536) == b""  # closed: the port holds as many as it may
        with Store(cluster.master_endpoint, token="secret") as store:
            store.put("served", b"x" * 1000)
            assert store.get("served") == b"x" * 1000
        with pytest.raises(OSError):  # closed (urllib: connection reset, or remote end closed)
            urllib.request.urlopen(health_url, timeout=5)
        while True:  # the stalled ones are closed, and the port serves again
            try:
                assert b'"status"' in urllib.request.urlopen(health_url, timeout=5).read()
                break
            except OSError:
                assert time.monotonic() - t0 < limits.HTTP_REQUEST_HEAD_TIMEOUT_MS / 1000 + 5, "never answered"
                time.sleep(0.2)
        for sock in flood[: limits.HTTP_CONNECTIONS_MAX]:  # the idle one too
            sock.settimeout(5)
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(65536) == b""
    finally:
        for sock in flood:
            sock.close()
    log_text = cluster.master.log_tail(100)
    assert f"it holds {limits.HTTP_CONNECTIONS_MAX} connections, the most it may" in log_text, log_text
    assert f"no complete request within {limits.HTTP_REQUEST_HEAD_TIMEOUT_MS} ms" in log_text, log_text


def test_a_flood_of_connections_that_never_authenticate_holds_bounded_memory(make_cluster):
    """Connections that send part of a first frame and stall: the master held each one's
    buffers until its handshake timed out (2 s), 220-500 MB under a flood (helper-53). It now
    holds HANDSHAKES_PENDING_MAX handshakes at once and closes the oldest past that, so a
    client's handshake, one round trip, still goes through during the flood."""
    cluster = make_cluster(1, "16MiB")
    host, port = cluster.master_endpoint.rsplit(":", 1)
    control_size = 60 * 1024  # under the 64 KiB a peer may send before it authenticates
    header = struct.Struct(limits.FRAME_HEADER_FMT)
    first_frame_part = header.pack(limits.FRAME_MAGIC, limits.FRAME_VERSION, 0, 1, control_size, 0)
    first_frame_part += b"\x00" * (control_size - 4 * 1024)
    before_kib = _rss_kib(cluster.master.pid, "VmHWM")
    flood: list[socket.socket] = []
    t0 = time.monotonic()
    try:
        for _ in range(1_500):
            sock = socket.create_connection((host, int(port)), timeout=5)
            flood.append(sock)
            try:
                sock.sendall(first_frame_part)
            except OSError:
                pass  # closed as the oldest already
        flood[-1].settimeout(5)
        assert flood[-1].recv(65536)  # the master's challenge: it has taken every connection
        oldest_closed = 0
        for sock in flood[:1_000]:  # closed already, long before their handshake timers
            sock.settimeout(0.2)
            try:
                while sock.recv(65536):
                    pass  # the server's challenge, then the end
            except TimeoutError:
                break
            except OSError:
                pass  # reset
            oldest_closed += 1
        time.sleep(max(0.0, t0 + 1.5 - time.monotonic()))  # the master has read them all
        grown_kib = _rss_kib(cluster.master.pid, "VmHWM") - before_kib
        with Store(cluster.master_endpoint) as store:
            assert len(store.cluster_status().segments) == 1
    finally:
        for sock in flood:
            sock.close()
    assert oldest_closed == 1_000
    assert grown_kib < 48 * 1024, grown_kib  # at its peak: 1,500 held were 100 MB


def test_an_elected_master_keeps_its_busy_poll_metrics(make_cluster, etcd_endpoint):
    """docs/operations.md lists kvpool_master_busy_poll_*: an HA master lost them once elected
    (its new term made new metrics without the listener's busy poll)."""
    cluster = make_cluster(0, etcd_endpoint=etcd_endpoint, cluster_id="busy-poll-metrics")
    leader = cluster.wait_leader()
    samples = scrape(leader.info["http_port"])
    assert "kvpool_master_busy_poll_windows_total" in samples
    assert "kvpool_master_busy_poll_seconds_total" in samples


def _start_server(tmp_path: Path, name: str, args: tuple[str, ...], wrapper: tuple[str, ...] = ()) -> tuple:
    """`kvpool <args>` with a ready file and a log in tmp_path: (its Popen, what it reported)."""
    ready = tmp_path / f"{name}.ready"
    log_path = tmp_path / f"{name}.log"
    command = [*wrapper, sys.executable, "-m", "kvpool.cli.main", *args, "--ready-file", str(ready)]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not ready.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if not ready.exists():
        _stop([process])
        raise AssertionError(f"{name} did not start:\n{log_path.read_text()}")
    return process, json.loads(ready.read_text())


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def _can_listen_on(address: str) -> bool:
    try:
        with socket.create_server((address, 0), family=socket.AF_INET6 if ":" in address else socket.AF_INET):
            return True
    except OSError:
        return False


def _can_mount_in_a_namespace() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "mount", "--bind", "/", "/mnt"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_listen_on("::1"), reason="no IPv6 loopback")
@pytest.mark.skipif(not _can_mount_in_a_namespace(), reason="needs unshare -m and mount (root)")
def test_a_host_of_two_addresses_listens_on_one_port_for_both(tmp_path: Path) -> None:
    """`--host localhost` where localhost is 127.0.0.1 and ::1 (Debian's and Fedora's
    /etc/hosts), with port 0 (a node's default): each address got a port of its own, and the
    server reported one of them. How: each server runs in a mount namespace of its own, where
    such a hosts file is bind-mounted over /etc/hosts (the real one is never touched); needs
    root, else skipped. Asserted: the RPC and HTTP ports that master and node report answer on
    both addresses."""
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n::1 localhost\n")
    wrapper = ("unshare", "-m", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts))
    processes = []
    try:
        master, master_info = _start_server(
            tmp_path, "master", ("master", "--host", "localhost", "--port", "0", "--http-port", "0"), wrapper
        )
        processes.append(master)
        master_port = int(master_info["endpoint"].rsplit(":", 1)[1])
        node_args = ("node", "--master", f"127.0.0.1:{master_port}", "--host", "localhost", "--memory", "16MiB",
                     "--metrics-port", "0")  # fmt: skip
        node, node_info = _start_server(tmp_path, "node", node_args, wrapper)
        processes.append(node)
        ports = {
            "master RPC": master_port,
            "master HTTP": master_info["http_port"],
            "node RPC": int(node_info["endpoint"].rsplit(":", 1)[1]),
            "node metrics": int(node_info["metrics_endpoint"].rsplit(":", 1)[1]),
        }
        for what, port in ports.items():
            for family, address in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
                with socket.socket(family) as probe:
                    assert probe.connect_ex((address, port)) == 0, f"{what} port {port} not served on {address}"
    finally:
        _stop(processes)


@pytest.mark.skipif(not _can_listen_on("::1"), reason="no IPv6 loopback")
def test_a_master_on_ipv6_reports_its_endpoint_in_brackets(tmp_path: Path) -> None:
    """`kvpool master --host ::1` wrote "::1:PORT" to its ready file, /health and log, where a
    node writes "[::1]:PORT"; clients take the bracketed form."""
    master, info = _start_server(tmp_path, "master", ("master", "--host", "::1", "--port", "0", "--http-port", "0"))
    try:
        endpoint = info["endpoint"]
        assert endpoint.startswith("[::1]:"), endpoint
        health = json.loads(urllib.request.urlopen(f"http://[::1]:{info['http_port']}/health", timeout=5).read())
        assert health["endpoint"] == endpoint
        assert f"master listening on {endpoint} " in (tmp_path / "master.log").read_text()
        assert f"/metrics on http://[::1]:{info['http_port']})" in (tmp_path / "master.log").read_text()
        out = kvpool_cli("stat", "--master", endpoint)
        assert out.returncode == 0, out.stderr
    finally:
        _stop([master])
