"""Shared fixtures: local clusters of real processes, stopped whatever the test did; and a raw
socket server that plays a kvpool peer (authenticates, then does what the test says)."""

from __future__ import annotations

import compileall
import contextlib
import gc
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvpool
from kvpool import ErrorCode, Store, limits
from kvpool.cli.launcher import DEPLOYMENT_VARIABLES, LocalCluster
from kvpool.protocol.frames import FLAG_SEALED, NEED_DATA, Frame, FrameDecoder, FrameSeal, encode_frame, payload_tag
from kvpool.protocol.messages import AuthChallenge, AuthOk

# Masters started by tests check every structure after every request (STYLE.md).
os.environ.setdefault("KVPOOL_DEBUG_INVARIANTS", "1")


def pytest_configure(config) -> None:
    """Byte-compile kvpool once for the session. The tests start real processes by the
    thousand (masters, nodes, CLI commands, clients), and where PYTHONDONTWRITEBYTECODE is set
    (these machines set it) over an editable install, which pip does not compile, each of them
    compiled kvpool's sources anew: 0.1-0.2 s of every start. compileall writes regardless."""
    compileall.compile_dir(Path(kvpool.__file__).parent, quiet=1)


@pytest.fixture(autouse=True)
def _no_deployment_in_the_environment(monkeypatch) -> None:
    """Tests run on a host that may export a deployment's settings (README: KVPOOL_TOKEN_FILE
    on every machine); their clusters are local and tokenless unless a test says otherwise,
    and a Store given no token reads the environment's."""
    for name in (*DEPLOYMENT_VARIABLES, "KVPOOL_MASTER", "KVPOOL_SHM"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def _signal_handlers_left_as_found() -> Iterator[None]:
    """A test that runs a server's command in this process (CliRunner) must leave the signal
    handlers as it found them: uvloop's stayed on SIGINT, and a later test's Ctrl-C (a sync
    get interrupted while its file read hangs) was swallowed."""
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    before = [signal.getsignal(sig) for sig in signals]
    yield
    assert [signal.getsignal(sig) for sig in signals] == before, "a signal handler was changed and left"


@pytest.fixture
def make_cluster() -> Iterator:
    """make_cluster(nodes, memory, master_args=..., node_args=..., token=...) -> LocalCluster."""
    clusters: list[LocalCluster] = []

    def make(node_count: int = 3, memory: str = "32MiB", **options) -> LocalCluster:
        cluster = LocalCluster(node_count, memory, **options)
        clusters.append(cluster)
        cluster.start()
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop()


@pytest.fixture(scope="module")
def _clusters_by_node_count():
    """The module's shared clusters, started on first use and stopped at its end."""
    with contextlib.ExitStack() as stack:
        yield stack, {}


@pytest.fixture
def shared_cluster(_clusters_by_node_count):
    """shared_cluster(node_count) -> the module's LocalCluster of that many 16 MiB nodes, empty
    as a new one: after each test every object is removed (leased or not) and none may be
    left. For tests that neither stop its processes nor count on a master that served no
    other test: a cluster of their own was a second of start-up each."""
    stack, clusters = _clusters_by_node_count
    used: list[LocalCluster] = []

    def get(node_count: int) -> LocalCluster:
        if node_count not in clusters:
            clusters[node_count] = stack.enter_context(LocalCluster(node_count, "16MiB"))
        used.append(clusters[node_count])
        return clusters[node_count]

    yield get
    for node_count, cluster in list(clusters.items()):
        if not any(cluster is mine for mine in used):
            continue
        try:
            with Store(cluster.master_endpoint, token="") as store:
                store.remove_all(force=True)
                left = store.list_objects("", 1).keys
            assert left == [], f"an object outlived its test on a shared cluster: {left}"
        except BaseException:
            del clusters[node_count]  # the next test gets a new one, not what this one left
            cluster.stop()
            raise


@pytest.fixture
def small_filesystem(tmp_path) -> Iterator:
    """small_filesystem(size) -> the path of a tmpfs of `size` (e.g. "16m") under tmp_path: a
    filesystem that really fills up (ENOSPC). Mounting needs root (CAP_SYS_ADMIN): skipped
    without it. Unmounted lazily at the end, so a process still holding a file there does not
    keep it mounted."""
    mounts: list[Path] = []

    def mount(size: str) -> Path:
        path = tmp_path / f"tmpfs{len(mounts)}"
        path.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs (needs root): {done.stderr.strip()}")
        mounts.append(path)
        return path

    yield mount
    for path in mounts:
        subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.fixture(scope="session")
def etcd_endpoint(tmp_path_factory) -> Iterator[str]:
    """A real etcd on 127.0.0.1 (free ports, temporary data dir), shared by the session and
    ended by its pid; tests give each cluster its own cluster id. Skips where etcd is absent."""
    from kvpool.cli.launcher import LocalEtcd, etcd_binary

    if etcd_binary() is None:
        pytest.skip("etcd is not installed: run scripts/install-etcd.sh (Debian etcd-server)")
    with LocalEtcd(tmp_path_factory.mktemp("etcd")) as etcd:
        yield etcd.endpoint


@contextlib.contextmanager
def raw_server(after_handshake) -> Iterator[str]:
    """A TCP server that authenticates one client (no token), then hands the socket and what
    it read to `after_handshake`."""
    listener = socket.create_server(("127.0.0.1", 0))
    endpoint = f"127.0.0.1:{listener.getsockname()[1]}"

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(encode_frame(AuthChallenge(os.urandom(16), False, ""), 0))
            conn.recv(4096)  # the AuthResponse
            conn.sendall(encode_frame(AuthOk(b""), 0))
            after_handshake(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield endpoint
    finally:
        listener.close()
        thread.join(10)


def requests_read(conn: socket.socket, count: int) -> list[Frame]:
    """A raw server's read of the next `count` request frames."""
    decoder, requests = FrameDecoder(), []
    while len(requests) < count:
        decoder.receive_data(conn.recv(4096))
        while (frame := decoder.next_event()) is not NEED_DATA:
            requests.append(frame)
    return requests


def python_child(code: str) -> subprocess.Popen[str]:
    """A Python process running `code`, its stdin and stdout piped (text): it reports on
    stdout, and `sys.stdin.read()` in it holds it alive until the test ends it by its pid."""
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def segment_owner(shm_dir, name: str, size_bytes: int = 1 << 20) -> tuple[subprocess.Popen[str], Path]:
    """A process holding a segment file `name` in `shm_dir`, as a node or an embedded client
    does, and the file's path; it lives until the test kills it by its pid."""
    child = python_child(
        "import os, sys; from kvpool.node.segment import Segment; "
        f"s = Segment.create({str(shm_dir)!r}, {name!r}, {size_bytes}, os.urandom(16)); "
        "print(s.path, flush=True); sys.stdin.read()"
    )
    try:
        return child, Path(child.stdout.readline().strip())  # type: ignore[union-attr]
    except BaseException:
        child.kill()
        child.wait(10)
        raise


def dead_segment_owner(shm_dir, name: str, size_bytes: int = 1 << 20) -> Path:
    """The path of a segment file `name` in `shm_dir` whose owner was killed with SIGKILL."""
    child, path = segment_owner(shm_dir, name, size_bytes)
    child.kill()
    child.wait(10)
    return path


@pytest.fixture
def memory_dir() -> Iterator[Path]:
    """A directory of its own on /dev/shm (tmpfs), removed after: a node's --shm-dir where the
    test reads every line a node says (one on the test's disk is warned of)."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="kvpool-test-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def steady_heap() -> Iterator[None]:
    """For a test that times calls against their bound: the objects this worker already holds
    are frozen out of the garbage collector meanwhile. A worker that ran the vLLM, SGLang or
    torch tests holds their modules (~400,000 objects), and one full collection of them takes
    ~230 ms on this machine, longer loaded: the likeliest cause of a 300 ms lookup measured at
    581 ms once in a full run (not reproduced otherwise, even with the CPUs three times
    oversubscribed), a pause of the test's own process, not of the call it timed."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def wait_until(predicate, timeout_s: float = 15.0, interval_s: float = 0.05):
    """predicate()'s first true value, polled until `timeout_s` (then AssertionError)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"condition not met within {timeout_s} s")


def removed_as_released(batch_remove, keys: list[str], timeout_s: float = 5.0) -> None:
    """Remove `keys` with `batch_remove` (a store's, sparing leased objects) as their leases
    end, within `timeout_s`: each try removes those whose lease ended, the rest are tried
    again. One try of them all, retried until every code was OK, never ended where leases
    end apart: a key removed by an earlier try reads not found in the next."""
    leased = list(keys)

    def removed() -> bool:
        codes = batch_remove(leased)
        assert set(codes) <= {ErrorCode.OK, ErrorCode.OBJECT_HAS_LEASE}, codes
        leased[:] = [key for key, code in zip(leased, codes) if code != ErrorCode.OK]
        return not leased

    wait_until(removed, timeout_s)


def pytest_assertrepr_compare(config, op: str, left: object, right: object) -> list[str] | None:
    """Comparisons of objects' bytes say which keys or positions differ and how, instead of
    pytest's byte-by-byte diff (tests/bytes_diff.py)."""
    from tests.bytes_diff import explain

    return explain(left, right) if op == "==" else None


_failed_tests: list[str] = []


def pytest_runtest_logreport(report) -> None:
    if report.failed:
        _failed_tests.append(f"{report.nodeid} ({report.when})")


def pytest_unconfigure(config) -> None:
    """The failed tests once more, after pytest's last line: CI keeps the run's last 12,000
    characters, and a failure's message (a log tail, a diff) can fill them."""
    if _failed_tests:
        print("\nfailed:", *_failed_tests, sep="\n  ")


def sealed_by_hand(seal: FrameSeal | None, frame: bytes) -> bytes:
    """A frame built by hand (a header and control message, then any payload) as the next
    frame of a connection sealed with `seal` (protocol/frames.py FrameSeal): its tag after its
    control message, and its payload's after the payload (as much of it as `frame` holds).
    Unchanged without a seal. For raw peers that must get past the tag checks to test what
    comes after them."""
    if seal is None:
        return frame
    header = struct.Struct(limits.FRAME_HEADER_FMT)
    magic, version, flags, request_id, control_size, payload_size = header.unpack_from(frame)
    end = header.size + control_size
    head = header.pack(magic, version, flags | FLAG_SEALED, request_id, control_size + limits.FRAME_TAG_SIZE_BYTES,
                       payload_size) + frame[header.size : end]  # fmt: skip
    sealed = head + seal.tag(head)
    if not payload_size:
        return sealed + frame[end:]
    payload = frame[end:]
    return sealed + payload + payload_tag(seal.payload_mac(), [payload])
