"""What the `kvpool` CLI tells an operator when things go wrong, on real processes on 127.0.0.1:
a master that stops answering (SIGSTOP after the CLI connected), a stdout that is full or
closed (and the writes after the first that failed), a put over an existing key or with more
replicas than segments, a `rm` given two selections, keys holding control characters, output
to a pipe, help at 80 columns, a node
started before its master or with the wrong token, and a --master port that is another
service's; a node refused once mounted (its master restarted with another token), and a node
with a token whose master has none. Each case runs the command as a child
process and checks its exit status and its lines: one `error: ...` line, never a traceback.
Every process a test starts is ended by its pid."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import wait_until

from kvpool import Store
from tests.test_cluster_surface import kvpool_cli, kvpool_cli_each

# The CLI, with every Store it opens freezing the master (SIGSTOP) once connected: a master
# that hangs between the handshake and the request. The tests give it `--timeout 1` (5 s by
# default) to keep them short.
_FREEZING_CLI = """
import os, signal, sys
import kvpool.client.sync as sync
opened = sync.Store.__init__
def open_then_freeze(self, *args, **kwargs):
    opened(self, *args, **kwargs)
    os.kill(int(os.environ["FROZEN_MASTER_PID"]), signal.SIGSTOP)
sync.Store.__init__ = open_then_freeze
from kvpool.cli.main import app
app(sys.argv[1:], prog_name="kvpool")
"""


def assert_one_error_line(out: subprocess.CompletedProcess, *fragments: str) -> str:
    stderr = out.stderr.decode()
    assert out.returncode == 1, (out.returncode, stderr)
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, stderr)
    return lines[0]


def test_get_and_stat_say_one_line_when_the_master_stops_answering(make_cluster):
    cluster = make_cluster(1, "16MiB")
    master = ["--master", cluster.master_endpoint]
    assert kvpool_cli("put", "frozen", *master, stdin=b"v").returncode == 0
    env = {**os.environ, "FROZEN_MASTER_PID": str(cluster.master.pid)}
    commands = ((("get", "frozen"), "get frozen: "), (("stat",), "stat: "), (("stat", "frozen"), "stat: "))
    for args, first_words in commands:
        try:
            out = subprocess.run(
                [sys.executable, "-c", _FREEZING_CLI, *args, *master, "--timeout", "1"],
                capture_output=True, timeout=30, env=env,
            )  # fmt: skip
        finally:
            os.kill(cluster.master.pid, signal.SIGCONT)
        line = assert_one_error_line(out, "timed out after 1000 ms")
        assert line.startswith(f"error: {first_words}"), line


def test_a_full_or_closed_stdout_is_one_line_or_silence(make_cluster):
    cluster = make_cluster(1, "16MiB")
    master = ["--master", cluster.master_endpoint]
    assert kvpool_cli("put", "k", *master, stdin=b"value").returncode == 0
    for args in (("get", "k"), ("ls",), ("stat", "k")):
        with open("/dev/full", "wb") as full:
            out = subprocess.run(
                [sys.executable, "-m", "kvpool.cli.main", *args, *master], stdout=full, stderr=subprocess.PIPE,
                timeout=60,
            )  # fmt: skip
        assert_one_error_line(out, "cannot write to standard output: No space left on device")
    # A reader that left (`kvpool ls | head -1`): no message at all.
    reader_gone = subprocess.Popen(
        [sys.executable, "-m", "kvpool.cli.main", "ls", *master], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        reader_gone.stdout.close()  # type: ignore[union-attr]
        assert reader_gone.wait(60) == 1
        assert reader_gone.stderr.read() == b""  # type: ignore[union-attr]
    finally:
        if reader_gone.poll() is None:
            reader_gone.kill()
            reader_gone.wait(10)
        reader_gone.stderr.close()  # type: ignore[union-attr]


# A process whose write to standard output failed: what it writes afterwards, and the flush
# at its exit, must fail no more.
_WRITES_ON_AFTER_A_FAILED_WRITE = """
import sys
from kvpool.process import discard_stdout
try:
    sys.stdout.write("x" * 100_000)  # over the buffer: written at once, and refused
except OSError:
    discard_stdout()
sys.stdout.write("left buffered for the flush at exit")
sys.stdout.close()
discard_stdout()  # a closed stdout: nothing to do, no error
"""


def test_stdout_discarded_after_a_failed_write_takes_the_rest_quietly():
    """process.discard_stdout, which `kvpool get`, `ls`, `stat` (above) and `kvpool replay`
    call once a write to standard output failed: later writes and the interpreter's flush at
    exit go to /dev/null, and a stdout already closed is no error."""
    with open("/dev/full", "wb") as full:
        out = subprocess.run([sys.executable, "-c", _WRITES_ON_AFTER_A_FAILED_WRITE], stdout=full,
                             stderr=subprocess.PIPE, timeout=60)  # fmt: skip
    assert (out.returncode, out.stderr.decode()) == (0, "")


def test_put_rm_and_ls_say_what_they_did(make_cluster):
    cluster = make_cluster(1, "16MiB")
    master = ["--master", cluster.master_endpoint]
    assert kvpool_cli("put", "dup", *master, stdin=b"first").returncode == 0
    again = kvpool_cli("put", "dup", *master, stdin=b"second")
    assert again.returncode == 0 and not again.stderr.startswith(b"stored"), again.stderr
    assert b"dup exists already: left as it is (5 bytes" in again.stderr, again.stderr
    assert kvpool_cli("get", "dup", *master).stdout == b"first"
    # One node: one replica of the three asked, said after the put.
    three = kvpool_cli("put", "three", "--replicas", "3", *master, stdin=b"3")
    assert three.returncode == 0 and b"three: 1 of the 3 replicas asked placed" in three.stderr, three.stderr
    # The Store's error names the key; the CLI does not name it again.
    empty = kvpool_cli("put", "empty-object", *master, stdin=b"")
    assert_one_error_line(empty, "nothing to store")
    assert empty.stderr.count(b"empty-object") == 1, empty.stderr
    # Larger than every segment: said so, not a bare NO_AVAILABLE_HANDLE.
    assert_one_error_line(kvpool_cli("put", "huge", *master, stdin=os.urandom(17 << 20)), "larger than every segment")
    # A key and a regex: refused, nothing removed (the key used to be ignored).
    both = kvpool_cli("rm", "dup", "--regex", "^three$", *master)
    assert both.returncode == 2 and b"only one of them" in both.stderr, both.stderr
    # A key not found: said so, not "not removed" (a copy on a node away goes when it is back).
    absent = kvpool_cli("rm", "never-put", *master)
    assert absent.returncode == 3 and absent.stderr.startswith(b"never-put: not found ("), absent.stderr
    # A key that would print as two lines of `ls` (a fake object) is printed as a literal.
    forged = "fake\n      999999  spoofed"
    assert kvpool_cli("put", forged, *master, stdin=b"f").returncode == 0
    listing = kvpool_cli("ls", *master).stdout.decode().splitlines()
    assert sorted(listing) == sorted([f"{5:>12}  dup", f"{1:>12}  {forged!r}", f"{1:>12}  three"]), listing


def test_piped_stat_and_narrow_help_print_whole_values(make_cluster):
    cluster = make_cluster(2, "16MiB")
    stat = kvpool_cli("stat", "--master", cluster.master_endpoint)  # stdout is a pipe
    shown = stat.stdout.decode()
    assert stat.returncode == 0 and "…" not in shown, shown
    for node in cluster.nodes:
        assert node.info["segment_id"] in shown and node.info["endpoint"] in shown, shown
    env = {**os.environ, "COLUMNS": "80"}
    for command, names in (
        ("master", ("--evict-watermark-high", "--put-release-timeout-ms", "--no-debug-invariants",
                    "KVPOOL_DEBUG_INVARIANTS", "KVPOOL_TOKEN_FILE", "KVPOOL_CLUSTER_ID")),
        ("node", ("--advertise-host", "--metrics-port", "KVPOOL_TOKEN_FILE", "KVPOOL_DFS_DIR")),
    ):  # fmt: skip
        help_text = subprocess.run(
            [sys.executable, "-m", "kvpool.cli.main", command, "--help"], capture_output=True, timeout=60, env=env
        ).stdout.decode()
        assert "…" not in help_text, help_text
        for name in names:
            assert name in help_text, (name, help_text)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _start_node(master: str, shm_dir: Path, *args: str) -> subprocess.Popen:
    shm_dir.mkdir()
    return subprocess.Popen(
        [sys.executable, "-m", "kvpool.cli.main", "node", "--master", master, "--memory", "16MiB",
         "--shm-dir", str(shm_dir), *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip


def _end(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait(10)


def test_a_node_started_before_its_master_waits_for_it_quietly(tmp_path):
    """A node whose master comes up 11 s later (it used to give up after 10 s) is mounted by
    it, having said once that it waits and logged its first failed attempt, not one line per
    attempt (every 2 s). SIGTERM then ends it gracefully."""
    port = _free_port()  # nobody listens here yet
    shm_dir, ready = tmp_path / "shm", tmp_path / "node.ready"
    node = _start_node(f"127.0.0.1:{port}", shm_dir, "--ready-file", str(ready))
    master = None
    try:
        deadline = time.monotonic() + 30
        while not list(shm_dir.iterdir()) and time.monotonic() < deadline and node.poll() is None:
            time.sleep(0.02)
        assert list(shm_dir.iterdir()), "the node never made its segment file"
        time.sleep(11)
        assert node.poll() is None, node.stderr.read().decode()  # type: ignore[union-attr]
        master = subprocess.Popen(
            [sys.executable, "-m", "kvpool.cli.main", "master", "--port", str(port), "--http-port", "0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 15
        while not ready.exists() and time.monotonic() < deadline and node.poll() is None:
            time.sleep(0.05)
        assert ready.exists(), "no mount once the master came"
        node.send_signal(signal.SIGTERM)
        assert node.wait(30) == 0
        assert list(shm_dir.iterdir()) == []
        log = node.stderr.read().decode()  # type: ignore[union-attr]
        assert log.count("master link to") == 1 and "ERROR" not in log, log
        assert log.count("waiting for a master") == 1, log
    finally:
        _end(node)
        if master is not None:
            _end(master)


def test_a_node_with_the_wrong_token_exits_at_once(make_cluster, tmp_path):
    cluster = make_cluster(0, token="the-right-cluster-token-0123456789abcdef")
    wrong = tmp_path / "wrong-token"
    wrong.write_text("a-wrong-cluster-token-0123456789abcdef")
    wrong.chmod(0o600)
    shm_dir = tmp_path / "shm"
    started = time.monotonic()
    node = _start_node(cluster.master_endpoint, shm_dir, "--token-file", str(wrong))
    try:
        assert node.wait(30) == 1
        assert time.monotonic() - started < 8, "the node retried a wrong token"  # it gave up after 10 s
        stderr = node.stderr.read().decode()  # type: ignore[union-attr]
        last = stderr.splitlines()[-1]
        assert last.startswith("error: ") and "wrong cluster token" in last, stderr
        assert "Traceback" not in stderr and stderr.count("wrong cluster token") <= 2, stderr
        assert "retrying" not in stderr, stderr  # it does not: it exits
        assert "waiting for a master" not in stderr, stderr  # it said so after the fatal line, before
        assert list(shm_dir.iterdir()) == []
    finally:
        _end(node)
    # An object command: reached and refused, not "cannot reach the master" (it was reached).
    refused = kvpool_cli("ls", "--master", cluster.master_endpoint, "--token-file", str(wrong))
    assert_one_error_line(refused, "error: Unauthorized: ", "wrong cluster token")
    assert b"cannot reach" not in refused.stderr


def _http_answer(url: str) -> tuple[int, dict]:
    """(status, JSON body) of a GET, errors included."""
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_a_node_no_master_holds_is_not_ready_until_one_mounts_it_again(make_cluster, tmp_path):
    """/ready is for readiness probes and alerts: a node whose master went away gets no new
    puts, so it answers 503 with status "unmounted" (200 "ok" before 2026-12-07), while /health
    stays 200 (a liveness probe must not restart it: its objects would go). Once the master
    is back and holds the node's segment again, /ready is 200, and the objects read back."""
    cluster = make_cluster(0)
    shm_dir, ready = tmp_path / "shm", tmp_path / "node.ready"
    node = _start_node(cluster.master_endpoint, shm_dir, "--ready-file", str(ready), "--metrics-port", "0")
    try:
        wait_until(lambda: ready.exists() or node.poll() is not None, 30)
        assert ready.exists(), node.stderr.read().decode()  # type: ignore[union-attr]
        http = f"http://{json.loads(ready.read_text())['metrics_endpoint']}"
        status, body = _http_answer(http + "/ready")
        assert status == 200 and body["status"] == "ok" and body["mounted"] is True, body
        values = {f"kept/{i}": os.urandom(5000) for i in range(10)}
        with Store(cluster.master_endpoint) as store:
            store.put_batch(list(values), list(values.values()))
        cluster.master.stop()  # type: ignore[union-attr]
        assert wait_until(lambda: _http_answer(http + "/ready")[0] == 503, 10)
        status, body = _http_answer(http + "/ready")
        assert body["status"] == "unmounted" and body["mounted"] is False and body["objects"] == 10, body
        assert _http_answer(http + "/health") == (200, body)
        cluster.start_master()  # on the same port
        assert wait_until(lambda: _http_answer(http + "/ready")[0] == 200, 15)
        with Store(cluster.master_endpoint) as store:
            assert store.get_batch(list(values)) == list(values.values())
    finally:
        _end(node)


def test_a_node_refused_once_mounted_keeps_its_objects_says_so_and_mounts_again(make_cluster, tmp_path):
    """Its master restarted with another token (rotated on the master only). The node, mounted
    before, retried forever saying "ok" on /health (before 2026-12-07), then exited 1 at once,
    which lost every object it held: and a refusal comes before the master proved the token,
    so a relay could make every node exit with one changed frame (docs/operations.md
    "Security"). It now logs the refusal at once, says "refused" on /health (200: a liveness
    probe must not restart it) and on /ready (503), keeps its segment, and mounts again with
    its objects once its master holds its token again."""
    first_token = "the-first-cluster-token-0123456789abcdef"
    cluster = make_cluster(0, token=first_token)
    token_file = tmp_path / "first-token"
    token_file.write_text(first_token)
    token_file.chmod(0o600)
    shm_dir, ready, log_path = tmp_path / "shm", tmp_path / "node.ready", tmp_path / "node.log"
    shm_dir.mkdir()
    with open(log_path, "wb") as log:
        node = subprocess.Popen(
            [sys.executable, "-m", "kvpool.cli.main", "node", "--master", cluster.master_endpoint, "--memory",
             "16MiB", "--shm-dir", str(shm_dir), "--token-file", str(token_file), "--ready-file", str(ready),
             "--metrics-port", "0"],
            stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip
    try:
        wait_until(lambda: ready.exists() or node.poll() is not None, 30)
        assert ready.exists(), log_path.read_text()
        http = f"http://{json.loads(ready.read_text())['metrics_endpoint']}"
        values = {f"kept/{i}": os.urandom(5000) for i in range(10)}
        with Store(cluster.master_endpoint, token=first_token) as store:
            store.put_batch(list(values), list(values.values()))
        cluster.master.stop()  # type: ignore[union-attr]
        (cluster.workdir / "token").write_text("the-second-cluster-token-0123456789abcdef")  # the master's own
        cluster.start_master()  # on the same port
        assert wait_until(lambda: "wrong cluster token" in log_path.read_text(), 10), log_path.read_text()

        def answer(path: str) -> tuple[int, dict]:
            return _http_answer(http + path)

        for path, code in (("/health", 200), ("/ready", 503)):
            got, body = answer(path)
            assert got == code and body["status"] == "refused" and "wrong cluster token" in body["refusal"], body
        time.sleep(3)  # retrying meanwhile: still there, said once
        assert node.poll() is None and ready.exists() and list(shm_dir.iterdir())
        refusals = [line for line in log_path.read_text().splitlines() if "wrong cluster token" in line]
        assert len(refusals) == 1 and "ERROR" in refusals[0] and "keeps its objects" in refusals[0], refusals
        cluster.master.stop()  # type: ignore[union-attr]
        (cluster.workdir / "token").write_text(first_token)
        cluster.start_master()
        with Store(cluster.master_endpoint, token=first_token) as store:
            assert wait_until(lambda: store.get_batch(list(values)) == list(values.values()), 15)
        assert answer("/ready") == (200, answer("/health")[1])
        assert "Traceback" not in log_path.read_text()
    finally:
        _end(node)


def test_a_node_with_a_token_and_a_master_without_one_says_which_has_none(make_cluster, tmp_path):
    """The node refuses to trust a master without a token; the line said the master refused the
    node, and "a node needs its master's cluster token", as if the node had none."""
    cluster = make_cluster(0)
    token = tmp_path / "token"
    token.write_text("a-cluster-token-0123456789abcdef")
    token.chmod(0o600)
    node = _start_node(cluster.master_endpoint, tmp_path / "shm", "--token-file", str(token))
    try:
        assert node.wait(30) == 1
        last = node.stderr.read().decode().splitlines()[-1]  # type: ignore[union-attr]
        assert last.startswith("error: ") and "has no cluster token; refusing to trust it" in last, last
        assert "the master and its nodes need the same cluster token" in last, last
        assert "refused node" not in last and "a node needs" not in last, last
    finally:
        _end(node)


def test_get_of_an_object_whose_nodes_stopped_answering_says_so_not_not_found(make_cluster, monkeypatch):
    """The only replica is on a node that stopped answering (SIGSTOP: its connection to the
    master stays open, so the master lists the object until the node TTL): `kvpool get` said
    "not found" while `kvpool stat KEY` said OK. A node killed (its connection closed) leaves
    its objects missing for every lookup at once, and both say not found. (Over TCP: on the
    node's own host its segment file outlives a SIGKILL, and a get still reads it there, checked.)"""
    monkeypatch.setenv("KVPOOL_SHM", "0")
    cluster = make_cluster(1, "16MiB", master_args=("--node-ttl-ms", "60000"))
    master = ["--master", cluster.master_endpoint]
    assert kvpool_cli("put", "orphan", *master, stdin=b"v").returncode == 0
    node = cluster.nodes[0]
    node.signal(signal.SIGSTOP)
    got = kvpool_cli("get", "orphan", *master, "--timeout", "1")
    assert got.returncode == 3 and b"stored, but no replica could be read" in got.stderr, got.stderr
    assert b"`kvpool stat orphan` shows where" in got.stderr, got.stderr  # was a literal {shown}
    node.kill()
    assert wait_until(lambda: kvpool_cli("get", "orphan", *master).stderr.strip().endswith(b"not found"), 10)
    assert b"OBJECT_NOT_FOUND" in kvpool_cli("stat", "orphan", *master).stdout
    assert kvpool_cli("get", "never-put", *master).stderr.strip().endswith(b"not found")


def test_rm_by_pattern_says_what_it_left_and_refuses_an_empty_pattern(make_cluster):
    """`rm --all` and `rm --regex` skip objects under a read lease, as `rm KEY` does, but said
    "removed N object(s)" and exited 0 while the leased ones stayed; `--regex ''` (an unset
    variable in `--regex "$PREFIX"`) removed everything; a pattern that is not UTF-8 was a
    traceback from the frame encoder."""
    from kvpool import Store

    cluster = make_cluster(1, "16MiB")
    master = ["--master", cluster.master_endpoint]
    with Store(cluster.master_endpoint) as store:
        store.put_batch(["held", "free-1", "free-2"], [b"h", b"1", b"2"])
        empty = kvpool_cli("rm", "--regex", "", *master)
        assert empty.returncode == 2 and b"an empty pattern matches every key" in empty.stderr, empty.stderr
        assert store.longest_prefix(["held"], hold_ms=60_000) == 1  # a read lease, as an engine's lookup
        by_regex = kvpool_cli("rm", "--regex", "^(held|free-1)$", *master)
        assert by_regex.returncode == 3, by_regex.stderr
        assert b"removed 1 object(s); 1 matching still stored, under read leases" in by_regex.stderr, by_regex.stderr
        every = kvpool_cli("rm", "--all", *master)
        assert every.returncode == 3 and b"removed 1 object(s); 1 matching still stored" in every.stderr, every.stderr
        assert store.list_objects().keys == ["held"]
        forced = kvpool_cli("rm", "--all", "--force", *master)
        assert forced.returncode == 0 and b"removed 1 object(s)" in forced.stderr, forced.stderr
        assert store.list_objects().keys == []
    for command in (["ls", b"\xff"], ["rm", "--regex", b"\xff"]):  # a byte that is not UTF-8
        out = subprocess.run([sys.executable, "-m", "kvpool.cli.main", *command, *master], capture_output=True,
                             timeout=60)  # fmt: skip
        # A usage error, as a pattern RE2 cannot read (exit status 1 before 2026-12-07, the master's refusal).
        assert out.returncode == 2 and out.stderr.decode().count("\n") == 1, out.stderr
        assert b"pattern must be valid UTF-8 text" in out.stderr, out.stderr


def test_a_put_refused_for_want_of_a_segment_says_so(make_cluster):
    """A master with no node answered a put with "the cache is full of objects in use, or the
    object is larger than every segment": neither was true."""
    cluster = make_cluster(0)
    refused = kvpool_cli("put", "k", "--master", cluster.master_endpoint, stdin=b"v")
    assert_one_error_line(refused, "no segment takes puts now (segments: none mounted)")
    # ls and stat answer, exit 0, and say why nothing is listed: a master that just started lists
    # nothing until its nodes mount again, and a script took that for an empty cache (helper-155).
    for args in (("ls",), ("stat",)):
        shown = kvpool_cli(*args, "--master", cluster.master_endpoint)
        assert shown.returncode == 0 and b"no segment is mounted" in shown.stderr, shown.stderr


def test_a_put_refused_while_a_master_took_its_nodes_back_says_to_try_again():
    """Right after a master restarted, a put was refused (no node mounted yet), and by the time
    the command looked why, the nodes were back: it said "the cache is full of objects in use",
    neither true (walk-through helper-147). The cluster's status is a stand-in here: the race
    is a matter of milliseconds."""
    from kvpool.cli.main import _why_no_room
    from kvpool.protocol.messages import ClusterStatusReply, SegmentInfo, SegmentStatus

    def status_of(used_bytes: int):
        info = SegmentInfo("s1", "n1", "h", "h:1", "", b"", 1 << 20)
        return type("Store", (), {"cluster_status": lambda self: ClusterStatusReply(
            [SegmentStatus(info, "active", used_bytes, 1)], 1, 0, 0)})()  # fmt: skip

    assert _why_no_room(status_of(0), 4096).startswith("a segment has room for it now: try again")
    assert _why_no_room(status_of((1 << 20) - 100), 4096).startswith("no segment had room for 4096 bytes")


def test_a_port_that_is_not_a_kvpool_server_is_named_as_such():
    """An operator who gives the master's HTTP port, etcd's, or another service's as --master:
    a peer that sends something else says what it sent; one that waits for a request (HTTP,
    etcd) is a handshake timeout that says so. Before: "bad frame magic 0x5353", and a bare
    timeout."""
    foreign, silent = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def greet() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = foreign.accept()
                accepted.append(conn)
                conn.sendall(b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n")

    thread = threading.Thread(target=greet, daemon=True)
    thread.start()
    try:
        out = kvpool_cli("ls", "--master", f"127.0.0.1:{foreign.getsockname()[1]}")
        assert_one_error_line(out, "not a kvpool peer (a wrong port?): it sent b'SSH-2.0-OpenSSH_9.2p'")
        # The silent listener's backlog takes the connection; nothing ever answers it.
        out = kvpool_cli("ls", "--master", f"127.0.0.1:{silent.getsockname()[1]}", "--timeout", "1")
        assert_one_error_line(out, "timed out after", "not a kvpool port: an HTTP or etcd port waits for a request")
    finally:
        foreign.shutdown(socket.SHUT_RDWR)  # wakes the accept: a close alone left it for join's 10 s
        foreign.close()
        silent.close()
        for conn in accepted:
            conn.close()
        thread.join(10)


def test_a_nodes_address_given_as_the_master_is_named_as_such(make_cluster, tmp_path):
    """A node's port as --master (one of the addresses `kvpool node` printed): the node takes
    the handshake and refuses the Store's first request, which said "cannot reach the master
    at ...: unexpected ClusterStatus request". Now every object command, and a Store, says it
    is a node's. So does a second node given it: it retried for ever, saying "InvalidParams:
    unexpected MountSegment request"; it exits 1 at once, its segment file removed."""
    from kvpool.errors import InvalidParams

    cluster = make_cluster(1, "4MiB")
    node = cluster.nodes[0].info["endpoint"]
    said = f"--master: {node} is a kvpool node, not a master: give the master's address"
    for run in kvpool_cli_each(("ls", "--master", node), ("get", "k", "--master", node), ("bench", "--master", node)):
        assert_one_error_line(run, said)
    with pytest.raises(InvalidParams, match="is a kvpool node, not a master"):
        Store(node)
    second = _start_node(node, tmp_path / "shm")
    try:
        assert second.wait(15) == 1
        stderr = second.stderr.read().decode()  # type: ignore[union-attr]
        last = stderr.splitlines()[-1]
        assert last.startswith("error: node ") and last.endswith(
            f"cannot mount on {node}: it is a kvpool node, not a master: give the master's address"
        ), stderr
        assert "Traceback" not in stderr and "retrying" not in stderr and "waiting for a master" not in stderr, stderr
        assert list((tmp_path / "shm").iterdir()) == []
    finally:
        _end(second)


def test_a_node_that_etcd_sends_to_another_node_retries_rather_than_exits(make_cluster, tmp_path, etcd_endpoint):
    """etcd's leader record names a node's address (the master gone, a node on its address since,
    within the record's lease): the node given `etcd://` exited 1 telling the operator to give
    the master's address, which they never typed. It says what etcd named and retries: the next
    leader's record would take it."""
    from kvpool.discovery import LeaderRecord, leader_key, mark_key
    from kvpool.transports.etcd import EtcdClient

    cluster = make_cluster(1, "4MiB")
    node = cluster.nodes[0].info["endpoint"]
    cluster_id = f"stale-{time.monotonic_ns()}"

    async def record() -> None:
        async with EtcdClient([etcd_endpoint]) as etcd:
            await etcd.put(mark_key(cluster_id), b"")
            await etcd.put(leader_key(cluster_id), LeaderRecord(node, "", "gone").encode())

    asyncio.run(record())
    second = _start_node(f"etcd://{etcd_endpoint}/{cluster_id}", tmp_path / "shm")
    try:
        time.sleep(4)
        assert second.poll() is None, second.stderr.read().decode()  # type: ignore[union-attr]
        second.send_signal(signal.SIGTERM)
        assert second.wait(15) == 0
        stderr = second.stderr.read().decode()  # type: ignore[union-attr]
        assert f"cannot mount on {node}, which etcd's leader record names: it is a kvpool node" in stderr, stderr
    finally:
        _end(second)


# The command's entry point, with a Ctrl-C arriving while it loads the CLI's modules.
_INTERRUPTED_WHILE_LOADING = """
import sys
class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == "kvpool.cli.main":
            raise KeyboardInterrupt
sys.meta_path.insert(0, CtrlC())
from kvpool.cli import main
main()
"""


def test_a_ctrl_c_while_the_command_loads_exits_quietly():
    """The `kvpool` command spends about half a second loading its modules (typer, rich, the
    client, numpy); a Ctrl-C in that time printed a traceback. Its entry point loads nothing
    of them itself (the package's names load on first use), so it can catch that: exit 130,
    no traceback."""
    interrupted = subprocess.run(
        [sys.executable, "-c", _INTERRUPTED_WHILE_LOADING, "master"], capture_output=True, timeout=60
    )
    assert interrupted.returncode == 130, interrupted.stderr
    assert b"Traceback" not in interrupted.stderr, interrupted.stderr
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, kvpool.cli; print(sorted(m for m in sys.modules if m.startswith("
         "('kvpool.', 'typer', 'rich', 'numpy', 'msgspec'))))"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert loaded.stdout.split() == ["['kvpool.cli']"]
