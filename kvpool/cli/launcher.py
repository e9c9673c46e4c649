"""A local cluster of real processes: one master and N nodes on loopback.

Used by `kvpool demo`, the cluster and chaos tests and the benchmarks. Every process is a real
`python -m kvpool.cli.main ...` child on 127.0.0.1 with ephemeral ports; it reports readiness
through a ready file (no port guessing, no sleeps), logs to a file in the work directory, and
is ended by its pid: SIGTERM, then SIGKILL after a bound. Not a deployment tool.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvpool.errors import ConnectFailed

READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


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


def spawn(name: str, args: list[str], workdir: Path, env: dict[str, str] | None = None) -> Process:
    """Start `kvpool <args> --ready-file ...` and wait until it reports ready.

    Raises:
        ConnectFailed: it exited or did not become ready within READY_TIMEOUT_S.
    """
    ready = workdir / f"{name}.ready"
    ready.unlink(missing_ok=True)
    log_path = workdir / f"{name}.log"
    command = [sys.executable, "-m", "kvpool.cli.main", *args, "--ready-file", str(ready)]
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )  # fmt: skip
    process = Process(name, popen, log_path, {})
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ready.exists():
        if not process.is_alive() or time.monotonic() > deadline:
            process.stop()
            raise ConnectFailed(f"{name} did not start:\n{process.log_tail()}")
        time.sleep(0.02)
    process.info = json.loads(ready.read_text())
    return process


class LocalCluster:
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
    ) -> None:
        self.node_count = node_count
        self.memory = memory
        self.master_args = master_args
        self.node_args = node_args
        self._tempdir = None if workdir else tempfile.TemporaryDirectory(prefix="kvpool-")
        self.workdir = workdir or Path(self._tempdir.name)  # type: ignore[union-attr]
        # Tests run the master with its invariants checked after every request.
        self.env: dict[str, str] = {"KVPOOL_LOG_LEVEL": "info", "KVPOOL_DEBUG_INVARIANTS": os.environ.get("KVPOOL_DEBUG_INVARIANTS", "0")}
        if token:
            token_path = self.workdir / "token"
            token_path.write_text(token)
            token_path.chmod(0o600)
            self.env["KVPOOL_TOKEN_FILE"] = str(token_path)
        self.master: Process | None = None
        self.master_port = 0
        self.nodes: list[Process] = []
        self._node_serial = 0

    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def master_endpoint(self) -> str:
        assert self.master is not None, "cluster not started"
        return self.master.info["endpoint"]

    @property
    def http_port(self) -> int:
        assert self.master is not None, "cluster not started"
        return self.master.info["http_port"]

    def start(self) -> None:
        self.start_master()
        for _ in range(self.node_count):
            self.start_node()

    def start_master(self, extra_args: tuple[str, ...] = ()) -> Process:
        """Start (or restart, on the same port) the master."""
        args = ["master", "--port", str(self.master_port), "--http-port", "0", *self.master_args, *extra_args]
        self.master = spawn("master", args, self.workdir, self.env)
        self.master_port = int(self.master_endpoint.rsplit(":", 1)[1])
        return self.master

    def start_node(self, extra_args: tuple[str, ...] = (), memory: str | None = None) -> Process:
        self._node_serial += 1
        args = [
            "node", "--master", self.master_endpoint, "--memory", memory or self.memory,
            *self.node_args, *extra_args,
        ]  # fmt: skip
        process = spawn(f"node{self._node_serial}", args, self.workdir, self.env)
        self.nodes.append(process)
        return process

    def stop(self) -> None:
        for process in reversed(self.nodes):
            process.stop()
        if self.master is not None:
            self.master.stop()
        if self._tempdir is not None:
            self._tempdir.cleanup()
            self._tempdir = None
