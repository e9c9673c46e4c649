"""A local cluster of real processes: one master (or HA candidates on etcd) and N nodes on loopback.

Used by `kvpool demo`, the cluster and chaos tests and the benchmarks. Every process is a real
`python -m kvpool.cli.main ...` child on 127.0.0.1 with ephemeral ports; it reports readiness
through a ready file (no port guessing, no sleeps), logs to a file in the work directory, and
is ended by its pid: SIGTERM, then SIGKILL after a bound, and gets SIGTERM from the kernel
if this process dies first. `sigterm_as_interrupt` lets a command stop its clusters on SIGTERM
(and SIGHUP) as on SIGINT. `LocalEtcd` is a one-member etcd on 127.0.0.1 with free ports and
a data directory of its own, for HA clusters. Not a deployment tool.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import kvpool
from kvpool.errors import ConnectFailed

_Started = TypeVar("_Started", bound="StartedInContext")

READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
READY_POLL_S = 0.005  # a look for the ready file is a stat: cheap against a start of ~0.5 s
# Where the kvpool package this process imported lives: its children import the same.
_PACKAGE_ROOT = str(Path(kvpool.__file__).resolve().parent.parent)


@dataclasses.dataclass
class Process:
    """A child process and what it reported when ready."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    info: dict

    @property
    def pid(self) -> int:
        return self.popen.pid

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.is_alive():
            os.kill(self.pid, sig)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, wait, then SIGKILL. Returns the exit code."""
        if self.is_alive():
            self.signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.popen.wait(timeout_s)
        return self.popen.returncode

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.popen.wait(STOP_TIMEOUT_S)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: no dlopen in a forked child
_spawner_lock = threading.Lock()
_spawner: ThreadPoolExecutor | None = None
_spawner_pid = 0  # a forked child has the executor but not its thread: it makes its own


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies, so that a test runner killed
    mid-test (its fixtures never run) leaves no cluster behind (Linux prctl PR_SET_PDEATHSIG)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _popen(command: list[str], **kwargs) -> subprocess.Popen[bytes]:
    """Popen with `_die_with_parent`, forked by a thread that lives as long as this process.

    The kernel sends the parent-death signal when the *thread* that forked the child ends, not
    the process: a child forked by a pool thread (LiveCluster starts clusters side by side)
    would get SIGTERM as soon as the pool shut down. Other threads than the main one hand the
    fork to one long-lived thread, which ends only at interpreter exit (concurrent.futures
    joins it then), after the processes were stopped or when they should be.
    """
    global _spawner, _spawner_pid
    if threading.current_thread() is threading.main_thread():
        return subprocess.Popen(command, preexec_fn=_die_with_parent, **kwargs)
    with _spawner_lock:
        if _spawner is None or _spawner_pid != os.getpid():
            _spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpool-spawner")
            _spawner_pid = os.getpid()
    return _spawner.submit(subprocess.Popen, command, preexec_fn=_die_with_parent, **kwargs).result()


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread as SIGINT raises KeyboardInterrupt
    (sigterm_as_interrupt)."""


@dataclasses.dataclass
class _Interrupts:
    """What sigterm_as_interrupt's handler knows. Only the main thread reads or writes it
    (Python runs signal handlers there)."""

    is_installed: bool = False
    terminating_signal: int = 0  # the SIGTERM or SIGHUP received, 0 if none: the exit status's
    is_forking: bool = False  # the main thread is in Popen: an interrupt waits (_on_signal)
    pending: type[KeyboardInterrupt] | None = None


_interrupts = _Interrupts()


def _on_signal(signum: int, frame: object) -> None:
    interrupt = KeyboardInterrupt if signum == signal.SIGINT else Terminated
    if interrupt is Terminated:
        _interrupts.terminating_signal = signum
    if _interrupts.is_forking:
        # Raised in Popen, it would land in an at-fork hook, which swallows it and keeps
        # logging's lock: the next fork hung (the demo's SIGTERM test, in 2 runs of 7).
        _interrupts.pending = interrupt
        return
    raise interrupt


@contextlib.contextmanager
def _forking() -> Iterator[None]:
    """Around Popen in the main thread: an interrupt that comes meanwhile waits for the caller's
    _raise_pending(), once it holds the process it must stop."""
    if not _interrupts.is_installed or threading.current_thread() is not threading.main_thread():
        yield
        return
    _interrupts.is_forking = True
    try:
        yield
    finally:
        _interrupts.is_forking = False


def _raise_pending() -> None:
    interrupt, _interrupts.pending = _interrupts.pending, None
    if interrupt is not None:
        raise interrupt


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP take the way out that SIGINT takes, then exit
    with 128 + the signal (143, 129).

    By default SIGTERM ends Python at once, and so does SIGHUP (the terminal or ssh session that
    started the command closed): no `with` block stops the processes it started or removes its
    directory. Here they raise Terminated (a KeyboardInterrupt) instead, so every LocalCluster
    on the way out stops its processes (they remove their segments) and its directory, and the
    command then exits as if killed by the signal. SIGHUP is left alone where it is ignored
    (`nohup kvpool demo`). Any interrupt waits while the main thread forks a server
    (_on_signal). Outside the main thread, where Python cannot catch signals, it changes nothing.

    Raises:
        SystemExit: 143 or 129, after a SIGTERM or a SIGHUP within the block.
    """
    global _interrupts
    if threading.current_thread() is not threading.main_thread() or _interrupts.is_installed:
        yield
        return
    _interrupts = _Interrupts(is_installed=True)
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _on_signal)}
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, _on_signal)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, _on_signal)
    try:
        yield
    except Terminated:
        raise SystemExit(128 + _interrupts.terminating_signal) from None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _interrupts.is_installed = False
    if _interrupts.terminating_signal:  # its exception was lost (raised where Python ignores them)
        raise SystemExit(128 + _interrupts.terminating_signal)


def spawn(
    name: str,
    args: list[str],
    workdir: Path,
    env: dict[str, str] | None = None,
    wrapper: tuple[str, ...] = (),
) -> Process:
    """Start `kvpool <args> --ready-file ...` and wait until it reports ready.

    `wrapper` prefixes the command with one that execs it (`ip netns exec NS`), so that the pid
    is still the kvpool process's.

    Raises:
        ConnectFailed: it exited or did not become ready within READY_TIMEOUT_S.
    """
    return spawn_side_by_side([(name, args)], workdir, env, wrapper)[0]


def spawn_side_by_side(
    commands: list[tuple[str, list[str]]],
    workdir: Path,
    env: dict[str, str] | None = None,
    wrapper: tuple[str, ...] = (),
) -> list[Process]:
    """`spawn` several (name, args) at once, then wait for each: their start-ups (half a second
    of imports each) overlap instead of adding up. One that fails stops them all.

    Raises:
        ConnectFailed: one exited or did not become ready within READY_TIMEOUT_S.
    """
    # The children run the kvpool this process runs: first on their path, and -P keeps the
    # current directory off it (`python -m` puts it first, so a checkout there, another version,
    # won the import: benchmarks comparing two trees by PYTHONPATH ran the same servers twice).
    child_env = {**os.environ, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, (_PACKAGE_ROOT, child_env.get("PYTHONPATH"))))
    started: list[tuple[Process, Path]] = []
    deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        for name, args in commands:
            ready = workdir / f"{name}.ready"
            ready.unlink(missing_ok=True)
            log_path = workdir / f"{name}.log"
            command = [*wrapper, sys.executable, "-P", "-m", "kvpool.cli.main", *args, "--ready-file", str(ready)]
            with _forking(), open(log_path, "ab") as log:
                popen = _popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env)
                started.append((Process(name, popen, log_path, {}), ready))
            _raise_pending()
        waiting = list(started)
        while waiting:
            for process, ready in list(waiting):
                if ready.exists():
                    process.info = json.loads(ready.read_text())
                    waiting.remove((process, ready))
                elif not process.is_alive() or time.monotonic() > deadline:  # whichever fails first
                    raise ConnectFailed(f"{process.name} did not start:\n{process.log_tail()}")
            if waiting:
                time.sleep(READY_POLL_S)
    except BaseException:
        # Failed or interrupted (SIGINT, SIGTERM) while they started: nobody else holds them.
        # Each is told first, so that a second interrupt during the waits leaves none running.
        for process, _ in started:
            process.signal(signal.SIGCONT)
            process.signal(signal.SIGTERM)
        for process, _ in started:
            process.stop()
        raise
    return [process for process, _ in started]


class StartedInContext:
    """`with X(...) as x:` starts x and stops it on leaving, and stops it too when starting
    fails halfway, so that no process outlives the block. Subclasses define start and stop."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self: _Started) -> _Started:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# What describes a deployment, and so never reaches a LocalCluster's processes.
DEPLOYMENT_VARIABLES = (
    "KVPOOL_CONFIG", "KVPOOL_DFS_DIR", "KVPOOL_ETCD", "KVPOOL_CLUSTER_ID", "KVPOOL_TOKEN", "KVPOOL_TOKEN_FILE",
)


class LocalCluster(StartedInContext):
    """A master and nodes as child processes. Use as a context manager: everything it started
    is stopped on exit, whatever happened."""

    def __init__(
        self,
        node_count: int = 3,
        memory: str = "64MiB",
        *,
        master_args: tuple[str, ...] = (),
        node_args: tuple[str, ...] = (),
        token: str | None = None,
        workdir: Path | None = None,
        etcd_endpoint: str | None = None,
        cluster_id: str = "local",
        master_count: int = 1,
    ) -> None:
        assert master_count >= 1, master_count
        assert etcd_endpoint or master_count == 1, "several masters need etcd to elect a leader"
        self.node_count = node_count
        self.etcd_endpoint = etcd_endpoint
        self.cluster_id = cluster_id
        self.master_count = master_count
        self.masters: list[Process] = []
        self._master_serial = 0
        self.memory = memory
        self.master_args = master_args
        self.node_args = node_args
        self._tempdir = None if workdir else tempfile.TemporaryDirectory(prefix="kvpool-")
        self.workdir = workdir or Path(self._tempdir.name)  # type: ignore[union-attr]
        # Tests run the master with its invariants checked after every request.
        self.env: dict[str, str] = {
            "KVPOOL_LOG_LEVEL": "info",
            "KVPOOL_DEBUG_INVARIANTS": os.environ.get("KVPOOL_DEBUG_INVARIANTS", "0"),
        }
        # A local cluster is whole in itself: what the environment says of a deployment (its
        # settings file, its shared filesystem, its etcd, its token) is not for it. `kvpool
        # demo` on a production host would otherwise take the nodes' settings, write into the
        # DFS tier, stand for election among the real masters, or require the deployment's
        # token of its own client. (Empty is unset to the CLI; `token` sets its own below.)
        self.env.update(dict.fromkeys(DEPLOYMENT_VARIABLES, ""))
        # What its clients pass as `token`: "" (none) rather than None, which reads the
        # deployment's from the environment (ClientConfig), which its servers do not have.
        self.client_token = token or ""
        if token:
            token_path = self.workdir / "token"
            token_path.write_text(token)
            token_path.chmod(0o600)
            self.env["KVPOOL_TOKEN_FILE"] = str(token_path)
        self.master: Process | None = None
        self.master_port = 0
        self.nodes: list[Process] = []
        self._node_serial = 0

    @property
    def master_endpoint(self) -> str:
        assert self.master is not None, "cluster not started"
        return self.master.info["endpoint"]

    @property
    def master_address(self) -> str:
        """What nodes and clients are given: etcd://... in an HA cluster, else HOST:PORT."""
        if self.etcd_endpoint:
            return f"etcd://{self.etcd_endpoint}/{self.cluster_id}"
        return self.master_endpoint

    @property
    def http_port(self) -> int:
        assert self.master is not None, "cluster not started"
        return self.master.info["http_port"]

    def start(self) -> None:
        self.start_master()
        if self.etcd_endpoint:
            self.wait_leader()
        for _ in range(self.master_count - 1):
            self.start_master()
        self.start_nodes([()] * self.node_count)

    def start_master(self, extra_args: tuple[str, ...] = ()) -> Process:
        """Start (or restart, on the same port) the master; with etcd, one more candidate."""
        if self.etcd_endpoint:
            self._master_serial += 1
            args = ["master", "--port", "0", "--http-port", "0", "--etcd", self.etcd_endpoint,
                    "--cluster-id", self.cluster_id, *self.master_args, *extra_args]  # fmt: skip
            process = spawn(f"master{self._master_serial}", args, self.workdir, self.env)
            self.masters.append(process)
            if self.master is None or not self.master.is_alive():
                self.master = process
            return process
        args = ["master", "--port", str(self.master_port), "--http-port", "0", *self.master_args, *extra_args]
        self.master = spawn("master", args, self.workdir, self.env)
        self.masters = [self.master]
        self.master_port = int(self.master_endpoint.rsplit(":", 1)[1])
        return self.master

    def role_of(self, master: Process) -> str:
        """The master's role from its /health ("leader", "recovering", "standby", "single"),
        or "down"."""
        if not master.is_alive():
            return "down"
        url = f"http://127.0.0.1:{master.info['http_port']}/health"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                return str(json.loads(response.read()).get("role", "single"))
        except (OSError, urllib.error.URLError, ValueError):
            return "down"

    def wait_leader(self, timeout_s: float = READY_TIMEOUT_S, roles: tuple[str, ...] = ("leader",)) -> Process:
        """The master that leads (in one of `roles`), once there is one; sets `self.master`.

        Raises:
            ConnectFailed: none within timeout_s.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for master in self.masters:
                if self.role_of(master) in roles:
                    self.master = master
                    return master
            time.sleep(0.05)
        raise ConnectFailed(f"no master became {'/'.join(roles)} within {timeout_s} s")

    def start_node(
        self, extra_args: tuple[str, ...] = (), memory: str | None = None, wrapper: tuple[str, ...] = ()
    ) -> Process:
        return self.start_nodes([extra_args], memory, wrapper)[0]

    def start_nodes(
        self, extra_args_each: list[tuple[str, ...]], memory: str | None = None, wrapper: tuple[str, ...] = ()
    ) -> list[Process]:
        """Start one node per entry of `extra_args_each`, side by side; they are in `nodes`, in
        that order, once all are ready."""
        commands = []
        for extra_args in extra_args_each:
            self._node_serial += 1
            args = [
                "node", "--master", self.master_address, "--memory", memory or self.memory,
                *self.node_args, *extra_args,
            ]  # fmt: skip
            commands.append((f"node{self._node_serial}", args))
        processes = spawn_side_by_side(commands, self.workdir, self.env, wrapper)
        self.nodes.extend(processes)
        return processes

    def stop(self) -> None:
        for process in reversed(self.nodes):
            process.stop()
        if self.nodes:  # a node killed with SIGKILL (a test's doing) left its segment file
            from kvpool.node.segment import remove_stale_segments

            remove_stale_segments()
        for process in {id(m): m for m in [*self.masters, self.master] if m is not None}.values():
            process.stop()
        if self._tempdir is not None:
            self._tempdir.cleanup()
            self._tempdir = None


# --- etcd -------------------------------------------------------------------------------------

ETCD_READY_TIMEOUT_S = 15.0
_ETCD_START_ATTEMPTS_MAX = 3


def etcd_binary() -> str | None:
    """The etcd server binary (Debian's etcd-server package: scripts/install-etcd.sh), or None."""
    return shutil.which("etcd") or ("/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None)


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago (the caller retries if it is taken)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class LocalEtcd(StartedInContext):
    """A one-member etcd on 127.0.0.1: free client and peer ports, its own data directory,
    ended by its pid. A context manager: stopped on exit, whatever happened."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.process: subprocess.Popen[bytes] | None = None
        self.client_port = 0
        self.log_path = workdir / "etcd.log"

    @property
    def endpoint(self) -> str:
        assert self.client_port, "etcd not started"
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> None:
        """Start etcd and wait until it answers.

        Raises:
            ConnectFailed: no etcd binary, or it did not come up (after a few port choices).
        """
        binary = etcd_binary()
        if binary is None:
            raise ConnectFailed("no etcd binary: run scripts/install-etcd.sh (Debian etcd-server)")
        for _ in range(_ETCD_START_ATTEMPTS_MAX):
            if self._start_once(binary):
                return
        raise ConnectFailed(f"etcd did not start:\n{self.log_tail()}")

    def _start_once(self, binary: str) -> bool:
        self.stop()
        client_port, peer_port = free_port(), free_port()
        data_dir = Path(tempfile.mkdtemp(prefix="etcd-data-", dir=self.workdir))
        client_url, peer_url = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
        command = [
            binary, "--name", "kvpool-local", "--data-dir", str(data_dir),
            "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"kvpool-local={peer_url}",
            "--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn",
        ]  # fmt: skip
        # etcd reads ETCD_* variables as flags: none of the caller's may leak in.
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
        with open(self.log_path, "ab") as log:  # ended with its parent, as the servers are (_popen)
            self.process = _popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        self.client_port = client_port
        deadline = time.monotonic() + ETCD_READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False  # A port was taken meanwhile, most likely: try others.
            try:
                with urllib.request.urlopen(f"{client_url}/health", timeout=1.0) as response:
                    if json.loads(response.read()).get("health") in ("true", True):
                        return True
            except (OSError, urllib.error.URLError, ValueError):
                pass
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(STOP_TIMEOUT_S)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
