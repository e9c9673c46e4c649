"""kvpool against the real Mooncake Store and Redis, side by side in one run on this machine.

For 4 KiB, 64 KiB, 1 MiB, 4 MiB and 32 MiB objects, put and get throughput (GB/s and objects/s)
in three modes. The first two are between two processes: a client process (started by this
script) and a storage process; the third has client and storage in one process.

  - tcp:       over TCP loopback only. kvpool: Store(master, shm_enabled=False) against a node
               process of a LocalCluster. Mooncake: a client (global_segment_size 0) against a
               storage process (a MooncakeDistributedStore holding a 1 GiB segment), TCP
               protocol, P2PHANDSHAKE, its mooncake_master on 127.0.0.1. Redis: redis-py over TCP.
  - same-host: the fastest same-host path each offers. kvpool: its shm path (Store default).
               Mooncake's non-CUDA TCP build has no shared-memory path: same TCP setup as above,
               measured again and labelled "tcp". Redis: redis-py over a unix socket.
  - in_process: client and storage in one process, no storage process. kvpool: a master only
               (LocalCluster with 0 nodes) and Store(master, embedded_memory_bytes=256 MiB), so
               the client's embedded node holds the only segment: puts land in it and gets
               copy out of the mapped segment. Mooncake: one MooncakeDistributedStore with its
               own 256 MiB global segment (the only one: its own mooncake_master), local buffer
               128 MiB. Redis has no in-process mode: skipped, with that reason. These rows are
               informative: the targets are stated for the tcp and same_host modes only.

APIs: the zero-copy batch API (register_buffer + batch_put_from / batch_get_into: kvpool and
Mooncake) and the plain bytes API (put_batch / get_batch; Redis: a pipeline of SETs / MGET).
Machine limits measured in the same run: numpy memcpy and a plain Python socket pair (functions
from bench_core.py). The run goes round the stores --rounds times (one client process per store
and mode and round, one warm-up then --repeats measured runs of each row): GB/s are medians over
the rounds, and a kvpool/peer ratio is the median of the per-round ratios, so that a slow spell
of this shared machine, which comes and goes within a minute, weighs on every store alike.
Prints JSON, and with --write rewrites docs/benchmarks.md (table with kvpool/Mooncake and
kvpool/Redis on every row) and docs/benchmarks.png (matplotlib, if installed).

Mooncake's client listens on every interface, so (as scripts/mooncake_conformance.py does) the
whole run re-executes itself in a new network namespace holding only loopback (`unshare --net`,
needs root); without it Mooncake is skipped. Peers are optional: install Mooncake with
scripts/install-peers.sh mooncake, Redis with scripts/install-peers.sh redis (Debian's
redis-server and the redis Python client; not kvpool dependencies). Skipped peers are listed
with the reason.

    python benchmarks/bench_peers.py [--rounds 5] [--repeats 1] [--quick] [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import numpy_copy_gbps, socket_pair_gbps

KIB, MIB = 1 << 10, 1 << 20
SIZES = (4 * KIB, 64 * KIB, MIB, 4 * MIB, 32 * MIB)
BATCH_BYTES = 32 * MIB
MAX_BATCH = 128
ROOT = Path(__file__).resolve().parent.parent
CLIENT_TIMEOUT_S = 600


def size_label(size: int) -> str:
    return f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"


def volume_for(size: int, total: int) -> int:
    """Bytes moved per measured run: `total`, a quarter of it for 4 KiB objects."""
    return max(size, total // 4 if size < 64 * KIB else total)


def batch_for(size: int) -> int:
    return max(1, min(MAX_BATCH, BATCH_BYTES // size))


def memcpy_gbps(size: int, total: int) -> float:
    """numpy copies of `size`-byte objects over at most 64 MiB of sources and targets, reused
    (faulted in before timing): the same-host rows' limit. It runs out of the caches more
    than the stores' copies of distinct memory do (10-18% faster for 1 MiB objects on this VM,
    performance.md): bench_core.numpy_copy_gbps, which copies as many distinct bytes as the
    run, is reported alongside as numpy_copy_distinct_bytes_gbps."""
    count = max(1, total // size)
    slots = max(1, min(count, (64 * MIB) // size))
    source = np.random.randint(0, 255, size * slots, dtype=np.uint8)
    target = np.ones_like(source)
    np.copyto(target, source)
    started = time.perf_counter()
    for i in range(count):
        j = (i % slots) * size
        np.copyto(target[j : j + size], source[j : j + size])
    return count * size / (time.perf_counter() - started) / 1e9


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_port(port: int, process: subprocess.Popen, what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start") from None
            time.sleep(0.05)


def end(process: subprocess.Popen | None) -> None:
    """End one process that this script started, by its pid."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


# --- client adapters (run in the client process) -----------------------------------------------


IN_PROCESS_SEGMENT = 256 * MIB  # the client's own segment in the in_process mode (both stores)
IN_PROCESS_MOONCAKE_BUFFER = 128 * MIB  # Mooncake's local buffer there (plain API staging)


class KvpoolClient:
    def __init__(self, master: str, shm: bool, embedded_bytes: int = 0) -> None:
        from kvpool import Store

        self.store = Store(master, token="", shm_enabled=shm, embedded_memory_bytes=embedded_bytes)
        if embedded_bytes:
            assert self.store.embedded_segment is not None, "no embedded segment"

    def register(self, array: np.ndarray) -> int:
        return self.store.register_buffer(array)

    def unregister(self, address: int) -> None:
        self.store.unregister_buffer(address)

    def put_from(self, keys, addresses, sizes) -> None:
        codes = self.store.batch_put_from(keys, addresses, sizes)
        assert all(c == 0 for c in codes), codes

    def get_into(self, keys, addresses, sizes) -> None:
        got = self.store.batch_get_into(keys, addresses, sizes)
        assert got == sizes, got

    def put_batch(self, keys, values) -> None:
        codes = self.store.put_batch(keys, values)
        assert all(c == 0 for c in codes), codes

    def get_batch(self, keys) -> list:
        return self.store.get_batch(keys)

    def clear(self) -> None:
        self.store.remove_all(force=True)

    def close(self) -> None:
        self.store.close()


class MooncakeClient:
    def __init__(self, master: str, segment_bytes: int = 0, buffer_bytes: int = 512 * MIB) -> None:
        """segment_bytes 0: a pure client (tcp mode); > 0: it holds its own global segment."""
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        code = self.store.setup("127.0.0.1", "P2PHANDSHAKE", segment_bytes, buffer_bytes, "tcp", "", master)
        assert code == 0, f"mooncake client setup returned {code}"

    def register(self, array: np.ndarray) -> int:
        code = self.store.register_buffer(array.ctypes.data, array.nbytes)
        assert code == 0, f"mooncake register_buffer returned {code}"
        return array.ctypes.data

    def unregister(self, address: int) -> None:
        self.store.unregister_buffer(address)

    def put_from(self, keys, addresses, sizes) -> None:
        codes = self.store.batch_put_from(keys, addresses, sizes)
        assert all(c == 0 for c in codes), codes

    def get_into(self, keys, addresses, sizes) -> None:
        got = self.store.batch_get_into(keys, addresses, sizes)
        assert list(got) == sizes, got

    def put_batch(self, keys, values) -> None:
        code = self.store.put_batch(keys, values)
        assert code == 0, code

    def get_batch(self, keys) -> list:
        return self.store.get_batch(keys)

    def clear(self) -> None:
        self.store.remove_all(force=True)

    def close(self) -> None:
        self.store.close()


class RedisClient:
    def __init__(self, address: str) -> None:
        import redis

        if address.startswith("/"):
            self.client = redis.Redis(unix_socket_path=address)
        else:
            host, port = address.rsplit(":", 1)
            self.client = redis.Redis(host=host, port=int(port))
        self.client.ping()

    def put_batch(self, keys, values) -> None:
        pipe = self.client.pipeline(transaction=False)
        for key, value in zip(keys, values):
            pipe.set(key, value)
        assert all(pipe.execute())

    def get_batch(self, keys) -> list:
        return self.client.mget(keys)

    def clear(self) -> None:
        self.client.flushall()

    def close(self) -> None:
        self.client.close()


def measure_size(client, target: str, size: int, repeats: int, total: int) -> dict:
    """Both APIs (where the target has them) for objects of one size."""
    count = volume_for(size, total) // size
    batch = batch_for(size)
    keys = [f"b-{size}-{i}" for i in range(count)]
    spans = [(s, min(s + batch, count)) for s in range(0, count, batch)]
    source = np.random.randint(0, 255, size * count, dtype=np.uint8)
    row: dict = {"objects": count, "batch": batch}

    def timed(fn) -> float:
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started

    def record(api: str, put, get, check) -> None:
        put_s, get_s = [], []
        for i in range(repeats + 1):  # the first of each is a warm-up
            client.clear()
            elapsed = timed(put)
            if i:
                put_s.append(elapsed)
        for i in range(repeats + 1):
            elapsed = timed(get)
            check()  # every get's bytes, untimed
            if i:
                get_s.append(elapsed)
        client.clear()
        moved = size * count
        for op, seconds in (("put", put_s), ("get", get_s)):
            median = statistics.median(seconds)
            row[f"{api}_{op}_gbps"] = round(moved / median / 1e9, 4)
            row[f"{api}_{op}_objects_per_s"] = round(count / median)

    if target != "redis":
        target_buf = np.zeros_like(source)
        src_base, dst_base = client.register(source), client.register(target_buf)
        src = [src_base + i * size for i in range(count)]
        dst = [dst_base + i * size for i in range(count)]

        def zc_put() -> None:
            for a, b in spans:
                client.put_from(keys[a:b], src[a:b], [size] * (b - a))

        def zc_get() -> None:
            for a, b in spans:
                client.get_into(keys[a:b], dst[a:b], [size] * (b - a))

        def zc_check() -> None:
            assert np.array_equal(source, target_buf), "zero-copy get returned other bytes"
            target_buf.fill(0)  # so that the next get's bytes are checked too, not the warm-up's

        record("zero_copy", zc_put, zc_get, zc_check)
        client.unregister(src_base)
        client.unregister(dst_base)

    values = [source[i * size : (i + 1) * size].tobytes() for i in range(count)]
    last: list = []

    def plain_put() -> None:
        for a, b in spans:
            client.put_batch(keys[a:b], values[a:b])

    def plain_get() -> None:
        last.clear()
        for a, b in spans:
            last.extend(client.get_batch(keys[a:b]))

    def plain_check() -> None:
        assert len(last) == count and all(bytes(g) == v for g, v in zip(last, values)), (
            "plain get returned other bytes"
        )

    record("plain", plain_put, plain_get, plain_check)
    return row


def measure_client(
    target: str, address: str, shm: bool, repeats: int, total: int, in_process: bool = False
) -> dict:
    """In the client process: every size, both APIs where the target has them. in_process: the
    client holds the store's only segment itself (kvpool embedded mode, Mooncake global segment)."""
    if target == "kvpool":
        client = KvpoolClient(address, shm, IN_PROCESS_SEGMENT if in_process else 0)
    elif target == "mooncake":
        if in_process:
            client = MooncakeClient(address, IN_PROCESS_SEGMENT, IN_PROCESS_MOONCAKE_BUFFER)
        else:
            client = MooncakeClient(address)
    else:
        client = RedisClient(address)
    out: dict = {}
    try:
        for size in SIZES:
            out[str(size)] = measure_size(client, target, size, repeats, total)
    finally:
        client.close()
    return out


# --- servers (started and ended by the orchestrator, by pid) ----------------------------------


def mooncake_master_binary() -> str | None:
    found = shutil.which("mooncake_master")
    if found:
        return found
    import mooncake

    candidate = Path(mooncake.__file__).parent / "mooncake_master"
    return str(candidate) if candidate.exists() else None


def mooncake_storage_main(master: str) -> None:
    """The Mooncake storage process: contributes a 1 GiB segment until stdin closes."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    code = store.setup("127.0.0.1", "P2PHANDSHAKE", 1024 * MIB, 16 * MIB, "tcp", "", master)
    print("ready" if code == 0 else f"setup failed {code}", flush=True)
    sys.stdin.read()
    store.close()


class Servers:
    """Whichever storage services can run here; `skipped` says which cannot, and why."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.processes: list[subprocess.Popen] = []
        self.cluster = None
        self.master_only = None
        self.addresses: dict[str, str] = {}
        self.skipped: dict[str, str] = {}
        self.socket_dir: Path | None = None

    def _spawn(self, args: list[str], log: str, **kwargs) -> subprocess.Popen:
        process = subprocess.Popen(
            args, stdout=open(self.log_dir / log, "wb"), stderr=subprocess.STDOUT, **kwargs  # noqa: SIM115
        )
        self.processes.append(process)
        return process

    def start_kvpool(self) -> None:
        from kvpool.cli.launcher import LocalCluster

        self.cluster = LocalCluster(1, "1GiB", workdir=self.log_dir / "kvpool")
        (self.log_dir / "kvpool").mkdir(exist_ok=True)
        self.cluster.__enter__()
        self.addresses["kvpool"] = self.cluster.master_endpoint

    def start_kvpool_master_only(self) -> None:
        """A second kvpool master with no node: in the in_process mode the client's embedded
        segment is the only one."""
        from kvpool.cli.launcher import LocalCluster

        (self.log_dir / "kvpool-in-process").mkdir(exist_ok=True)
        self.master_only = LocalCluster(0, workdir=self.log_dir / "kvpool-in-process")
        self.master_only.__enter__()
        self.addresses["kvpool-in-process"] = self.master_only.master_endpoint

    def _mooncake_master(self, log: str) -> str:
        port = free_port()
        master = self._spawn(
            [mooncake_master_binary(), "--rpc_address=127.0.0.1", f"--rpc_port={port}",
             "--metrics_host=127.0.0.1", f"--metrics_port={free_port()}",
             "--enable_http_metadata_server=false", "--logtostderr"],
            log, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        wait_port(port, master, "mooncake_master")
        return f"127.0.0.1:{port}"

    def start_mooncake(self, netns: bool) -> None:
        try:
            import mooncake.store  # noqa: F401
        except ImportError as exc:
            self.skipped["mooncake"] = f"mooncake.store does not import ({exc}); scripts/install-peers.sh mooncake"
            return
        if not netns:
            self.skipped["mooncake"] = (
                "Mooncake listens on every interface; it is only run in a private network namespace "
                "(needs root, unshare and ip)"
            )
            return
        binary = mooncake_master_binary()
        if binary is None:
            self.skipped["mooncake"] = "mooncake_master not found"
            return
        # A master of its own for the in_process mode, so the client's segment is the only one.
        self.addresses["mooncake-in-process"] = self._mooncake_master("mooncake_master_in_process.log")
        address = self._mooncake_master("mooncake_master.log")
        storage = subprocess.Popen(
            [sys.executable, __file__, "--mooncake-storage", address],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=open(self.log_dir / "mooncake_storage.log", "wb"),  # noqa: SIM115
        )  # fmt: skip
        self.processes.append(storage)
        line = storage.stdout.readline().decode().strip()
        if line != "ready":
            self.skipped["mooncake"] = f"Mooncake storage process did not start: {line!r}"
            return
        self.addresses["mooncake"] = address

    def start_redis(self) -> None:
        binary = shutil.which("redis-server")
        try:
            import redis  # noqa: F401
        except ImportError:
            self.skipped["redis"] = "the redis Python client is not installed (scripts/install-peers.sh redis)"
            return
        if binary is None:
            self.skipped["redis"] = "redis-server not found (scripts/install-peers.sh redis, as root)"
            return
        port = free_port()
        # A Unix socket's path holds at most 107 bytes: one under a deep TMPDIR (pytest's
        # under xdist) made redis-server exit at start. Its own short directory, removed at stop.
        self.socket_dir = Path(tempfile.mkdtemp(prefix="kvpool-redis-", dir="/tmp"))
        unix = str(self.socket_dir / "redis.sock")
        process = self._spawn(
            [binary, "--bind", "127.0.0.1", "--port", str(port), "--unixsocket", unix,
             "--unixsocketperm", "700", "--save", "", "--appendonly", "no",
             "--protected-mode", "yes", "--dir", str(self.log_dir)],
            "redis.log", stdin=subprocess.DEVNULL,
        )  # fmt: skip
        wait_port(port, process, "redis-server")
        self.addresses["redis"] = f"127.0.0.1:{port}"
        self.addresses["redis-unix"] = unix

    def stop(self) -> None:
        for cluster in (self.master_only, self.cluster):
            if cluster is not None:
                cluster.__exit__(None, None, None)
        for process in reversed(self.processes):
            if process.stdin:
                process.stdin.close()
            end(process)
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)


def run_client(
    target: str, address: str, shm: bool, repeats: int, total: int, log_dir: Path, path: str = "tcp"
) -> dict:
    """One client process: its own interpreter, ended when it returns."""
    command = [sys.executable, __file__, "--client", target, "--address", address,
               "--repeats", str(repeats), "--total", str(total)] + (["--shm"] if shm else [])  # fmt: skip
    if path == "in_process":
        command.append("--in-process")
    result = subprocess.run(
        command, capture_output=True, timeout=CLIENT_TIMEOUT_S, stdin=subprocess.DEVNULL, check=False
    )
    (log_dir / f"client-{target}-{path}.stderr").write_bytes(result.stderr)
    if result.returncode != 0:
        raise RuntimeError(f"{target} client failed: {result.stderr.decode(errors='replace')[-2000:]}")
    return json.loads(result.stdout.decode().strip().splitlines()[-1])


# --- report -------------------------------------------------------------------------------------


def ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}x"


def gbps(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


PATHS = ("tcp", "same_host", "in_process")
TARGET_PATHS = ("tcp", "same_host")  # the targets are stated for these; in_process is informative


def table_rows(result: dict) -> list[dict]:
    rows = []
    for path in PATHS:
        for api in ("zero_copy", "plain"):
            for size in SIZES:
                for op in ("put", "get"):
                    def get(target: str, field: str = "gbps", path=path, size=size, api=api, op=op):
                        data = result["runs"].get(path, {}).get(target, {}).get(str(size), {})
                        return data.get(f"{api}_{op}_{field}")

                    def per_round_ratio(peer: str, path=path, size=size, api=api, op=op) -> float | None:
                        """Median over the rounds of kvpool / peer, each round's pair taken together."""
                        field = f"{api}_{op}_gbps"
                        pairs = [
                            (runs.get("kvpool", {}).get(str(size), {}).get(field),
                             runs.get(peer, {}).get(str(size), {}).get(field))
                            for runs in (r.get(path, {}) for r in result["rounds"])
                        ]  # fmt: skip
                        ratios = [a / b for a, b in pairs if a and b]
                        return statistics.median(ratios) if ratios else None

                    limits = result["machine_limits"][str(size)]
                    rows.append({
                        "path": path, "api": api, "size": size, "op": op,
                        "kvpool": get("kvpool"), "kvpool_objects_per_s": get("kvpool", "objects_per_s"),
                        "mooncake": get("mooncake"), "redis": get("redis"),
                        "vs_mooncake": per_round_ratio("mooncake"), "vs_redis": per_round_ratio("redis"),
                        "limit": limits["socket_pair_gbps" if path == "tcp" else "numpy_copy_gbps"],
                    })  # fmt: skip
    return rows


def markdown(result: dict, command: str) -> str:
    paths = {
        "tcp": "TCP only (kvpool shm off)",
        "same_host": "same host (kvpool shm; Mooncake TCP — no shm path in its non-CUDA build; Redis unix socket)",
        "in_process": "in one process (kvpool embedded segment; Mooncake client's own global segment; Redis: none)",
    }
    lines = [
        "# Benchmarks against peers",
        "",
        (
            "kvpool, the real Mooncake Store (PyPI `mooncake-transfer-engine-non-cuda`, TCP protocol, "
            "P2PHANDSHAKE, its master on 127.0.0.1) and Redis (Debian `redis-server`, persistence off, "
            "redis-py client) measured on the same machine in the same run by"
        ),
        "",
        f"    {command}",
        "",
        (
        "Three modes. TCP and same host: between two processes, a client process and a storage "
        "process (kvpool: a LocalCluster node; Mooncake: a process holding a 1 GiB segment, the "
        "client contributing none; Redis: redis-server). In one process: client and storage in "
        "the same process, no storage process (kvpool: a master only and "
        f"`Store(master, embedded_memory_bytes={IN_PROCESS_SEGMENT // MIB} MiB)`, whose embedded "
        "node holds the only segment, so puts land in it and gets copy out of the mapped segment; "
        f"Mooncake: one `MooncakeDistributedStore` with its own {IN_PROCESS_SEGMENT // MIB} MiB "
        "global segment, the only one at its master; Redis has no in-process mode: –). "
        f"GB/s = 10^9 bytes/s, the median over {result['round_count']} rounds, each of which measures "
        f"every store in turn ({result['repeats']} measured run(s) per row after a warm-up); a "
        "kvpool/peer ratio is the median of the per-round ratios; objects/s is kvpool's. "
        "Zero-copy = register_buffer + batch_put_from/batch_get_into (Redis has none: –); "
        "plain = put_batch/get_batch (Redis: pipelined SET / MGET). Limit: a plain Python socket "
        "pair over TCP loopback (TCP rows) or a numpy memcpy (same-host and in-process rows) of "
        "the same object size, measured in the same run."
        ),
        "",
        (
        "The targets below are stated for the TCP and same-host modes only; the in-process rows "
        "are informative (no target), and so is the kvpool/Mooncake ratio on them."
        ),
        "",
        (
            f"Machine: {result['machine']['cpus']} CPUs, Python {result['machine']['python']}. "
            f"Skipped: {', '.join(f'{k} ({v})' for k, v in result['skipped'].items()) or 'nothing'}."
        ),
        "",
        (
        "Redis needs `scripts/install-peers.sh redis` (Debian redis-server and redis-py, not kvpool "
        "dependencies); Mooncake needs `scripts/install-peers.sh mooncake` and root (it runs in a "
        "private network namespace holding only loopback, because its client listens on every "
        "interface)."
        ),
        "",
    ]
    current = None
    for row in table_rows(result):
        if (row["path"], row["api"]) != current:
            current = (row["path"], row["api"])
            lines += [
                "",
                f"## {paths[row['path']]}, {row['api'].replace('_', '-')} API",
                "",
                (
                    "| size | op | kvpool GB/s | kvpool objects/s | Mooncake GB/s | Redis GB/s "
                    "| kvpool/Mooncake | kvpool/Redis | limit GB/s |"
                ),
                "|---|---|---:|---:|---:|---:|---:|---:|---:|",
            ]
        lines.append(
            f"| {size_label(row['size'])} | {row['op']} | {gbps(row['kvpool'])} | "
            f"{row['kvpool_objects_per_s'] or '–'} | {gbps(row['mooncake'])} | {gbps(row['redis'])} | "
            f"{ratio(row['vs_mooncake'])} | {ratio(row['vs_redis'])} | "
            f"{gbps(row['limit'])} |"
        )
    lines += ["", "## Targets", ""] + [f"- {line}" for line in result["targets"]]
    lines += [
        "",
        "What these numbers mean, how much they move between runs on this machine, and why the "
        "targets are met or not: [performance.md, against peers](performance.md#against-peers).",
    ]
    if result.get("chart"):
        lines += ["", "![throughput chart](benchmarks.png)"]
    return "\n".join(lines) + "\n"


def targets(result: dict) -> list[str]:
    """The targets, over the tcp and same_host rows (by the per-round ratios); one informative
    line for in_process."""
    all_rows = table_rows(result)
    rows = [r for r in all_rows if r["path"] in TARGET_PATHS]
    out = []
    for path, need in (("tcp", 2.5), ("same_host", 5.0)):
        mid = [r for r in rows if r["path"] == path and r["size"] in (MIB, 4 * MIB) and r["vs_mooncake"]]
        if not mid:
            out.append(f"{path} 1-4 MiB >= {need}x Mooncake: not measured (Mooncake skipped)")
            continue
        worst = min(mid, key=lambda r: r["vs_mooncake"])
        out.append(
            f"{'MET' if worst['vs_mooncake'] >= need else 'NOT MET'}: {path} 1-4 MiB >= {need}x "
            f"Mooncake (every API/op); lowest {worst['vs_mooncake']:.2f}x ({worst['api']} "
            f"{worst['op']} {size_label(worst['size'])})"
        )
    slower = [
        f"{r['path']} {r['api']} {r['op']} {size_label(r['size'])} vs {peer} ({r[f'vs_{peer}']:.2f}x)"
        for r in rows for peer in ("mooncake", "redis") if r[f"vs_{peer}"] and r[f"vs_{peer}"] < 1
    ]  # fmt: skip
    names = {"mooncake": "Mooncake", "redis": "Redis"}
    measured = [name for peer, name in names.items() if any(r[f"vs_{peer}"] for r in rows)]
    unmeasured = [name for name in names.values() if name not in measured]
    if slower:
        out.append(f"NOT MET: kvpool slower on {len(slower)} tcp/same_host rows: " + "; ".join(slower))
    elif not measured:
        out.append("no tcp/same_host row slower than a peer: not measured (every peer skipped)")
    else:
        out.append(
            f"MET: no tcp/same_host row where kvpool is slower than {' or '.join(measured)}"
            + (f" ({' and '.join(unmeasured)} not measured: skipped)" if unmeasured else "")
        )
    inproc = [r for r in all_rows if r["path"] == "in_process" and r["vs_mooncake"]]
    if inproc:
        low = min(inproc, key=lambda r: r["vs_mooncake"])
        high = max(inproc, key=lambda r: r["vs_mooncake"])
        behind = sum(r["vs_mooncake"] < 1 for r in inproc)
        out.append(
            f"informative, no target: in_process kvpool/Mooncake from {low['vs_mooncake']:.2f}x "
            f"({low['api']} {low['op']} {size_label(low['size'])}) to {high['vs_mooncake']:.2f}x "
            f"({high['api']} {high['op']} {size_label(high['size'])}); kvpool slower on {behind} of "
            f"{len(inproc)} rows"
        )
    else:
        out.append("informative, no target: in_process kvpool vs Mooncake not measured")
    return out


def chart(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = table_rows(result)
    fig, axes = plt.subplots(len(PATHS), 2, figsize=(12, 4 * len(PATHS)), sharex=True)
    for (i, p), (j, op) in [((i, p), (j, op)) for i, p in enumerate(PATHS)
                            for j, op in enumerate(("put", "get"))]:  # fmt: skip
        ax = axes[i][j]
        for api, style in (("zero_copy", "-"), ("plain", "--")):
            sel = [r for r in rows if r["path"] == p and r["api"] == api and r["op"] == op]
            for target, color in (("kvpool", "C0"), ("mooncake", "C1"), ("redis", "C3")):
                ys = [r[target] for r in sel]
                if any(ys):
                    ax.plot([r["size"] for r in sel], ys, style, color=color, marker="o",
                            label=f"{target} {api}")  # fmt: skip
        ax.plot(SIZES, [sel[k]["limit"] for k in range(len(SIZES))], ":", color="grey",
                label="socket pair" if p == "tcp" else "numpy memcpy")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{p} {op}")
        ax.set_ylabel("GB/s")
        ax.set_xticks(SIZES, [size_label(s) for s in SIZES])
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


# --- driver ------------------------------------------------------------------------------------


def in_private_netns() -> bool:
    try:
        return [name for _, name in socket.if_nameindex()] == ["lo"]
    except OSError:
        return False


LIMIT_SAMPLES = 3  # runs of each machine limit (the median is kept)


def medians_over_rounds(rounds: list[dict]) -> dict:
    """runs[path][target][size][field]: the median over the rounds that measured it."""
    merged: dict = {path: {} for path in PATHS}
    for path in PATHS:
        for target in {t for runs in rounds for t in runs.get(path, {})}:
            per_size: dict = {}
            for size in SIZES:
                rows = [runs[path][target][str(size)] for runs in rounds if target in runs.get(path, {})]
                fields = {field for row in rows for field in row}
                medians = {f: statistics.median(row[f] for row in rows if f in row) for f in sorted(fields)}
                per_size[str(size)] = {
                    f: round(value, 4) if f.endswith("gbps") else round(value) for f, value in medians.items()
                }
            merged[path][target] = per_size
    return merged


def orchestrate(args: argparse.Namespace) -> int:
    total = (16 if args.quick else 64) * MIB
    log_dir = Path(tempfile.mkdtemp(prefix="kvpool-bench-peers-"))
    result: dict = {
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "round_count": args.rounds, "repeats": args.repeats, "bytes_per_row": total,
        "log_dir": str(log_dir), "skipped": {}, "machine_limits": {}, "rounds": [],
    }  # fmt: skip
    started = time.monotonic()
    for size in SIZES:
        volume = volume_for(size, total)
        result["machine_limits"][str(size)] = {
            "numpy_copy_gbps": round(statistics.median(memcpy_gbps(size, volume) for _ in range(LIMIT_SAMPLES)), 3),
            "numpy_copy_distinct_bytes_gbps": round(numpy_copy_gbps(size, volume), 3),
            "socket_pair_gbps": round(statistics.median(
                socket_pair_gbps(volume, chunk=min(size, 4 * MIB)) for _ in range(LIMIT_SAMPLES)), 3),
        }  # fmt: skip
    servers = Servers(log_dir)
    try:
        servers.start_kvpool()
        servers.start_kvpool_master_only()
        servers.start_mooncake(in_private_netns())
        servers.start_redis()
        result["skipped"] = dict(servers.skipped)
        result["skipped"]["redis in_process"] = (
            "Redis has no in-process mode: redis-server is always a separate process, with no "
            "embeddable library"
        )
        plan = [("tcp", "kvpool", servers.addresses["kvpool"], False),
                ("same_host", "kvpool", servers.addresses["kvpool"], True),
                ("in_process", "kvpool", servers.addresses["kvpool-in-process"], True)]  # fmt: skip
        if "mooncake" in servers.addresses:
            plan += [("tcp", "mooncake", servers.addresses["mooncake"], False),
                     ("in_process", "mooncake", servers.addresses["mooncake-in-process"], False)]  # fmt: skip
        if "redis" in servers.addresses:
            plan += [("tcp", "redis", servers.addresses["redis"], False),
                     ("same_host", "redis", servers.addresses["redis-unix"], False)]  # fmt: skip
        for round_index in range(args.rounds):
            runs: dict = {path: {} for path in PATHS}
            for path, target, address, shm in plan:
                print(f"[{time.monotonic() - started:5.0f}s] round {round_index + 1}/{args.rounds} "
                      f"{target} {path}", file=sys.stderr, flush=True)  # fmt: skip
                try:
                    runs[path][target] = run_client(target, address, shm, args.repeats, total, log_dir, path)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    result["skipped"][f"{target} {path} round {round_index + 1}"] = (
                        f"client failed: {str(exc)[-500:]}"
                    )
            if "mooncake" in runs["tcp"]:
                # No shm path in Mooncake's non-CUDA TCP build: its same-host figure is its TCP one.
                runs["same_host"]["mooncake"] = runs["tcp"]["mooncake"]
                result["mooncake_same_host_note"] = (
                    "Mooncake same-host rows are its TCP run (no shm path in this build)"
                )
            result["rounds"].append(runs)
    finally:
        servers.stop()
    result["runs"] = medians_over_rounds(result["rounds"])
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    result["targets"] = targets(result)
    if args.write:
        result["chart"] = chart(result, ROOT / "docs" / "benchmarks.png")
        (ROOT / "docs" / "benchmarks.md").write_text(markdown(result, args.command_line))
    json.dump(result, sys.stdout, indent=1)
    print()
    for name, reason in result["skipped"].items():
        print(f"SKIPPED {name}: {reason}", file=sys.stderr)
    for line in result["targets"]:
        print(line, file=sys.stderr)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="times round every store (medians over them)")
    parser.add_argument("--repeats", type=int, default=1, help="measured runs per row in each round")
    parser.add_argument("--quick", action="store_true", help="16 MiB per row instead of 64 MiB")
    parser.add_argument("--write", action="store_true", help="rewrite docs/benchmarks.md and .png")
    parser.add_argument("--no-netns", action="store_true", help="do not re-execute in a private netns")
    parser.add_argument("--client", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--shm", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--total", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mooncake-storage", help=argparse.SUPPRESS)
    parser.add_argument("--command-line", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mooncake_storage:
        mooncake_storage_main(args.mooncake_storage)
        return 0
    if args.client:
        measured = measure_client(args.client, args.address, args.shm, args.repeats, args.total, args.in_process)
        print(json.dumps(measured))
        return 0
    if not args.command_line:
        args.command_line = "python benchmarks/bench_peers.py " + " ".join(sys.argv[1:])
    unshare, ip = shutil.which("unshare"), shutil.which("ip")
    if not args.no_netns and not in_private_netns() and os.geteuid() == 0 and unshare and ip:
        inner = " ".join(
            ["ip link set lo up &&", "exec", sys.executable, __file__]
            + [f"'{a}'" for a in sys.argv[1:]] + [f"--command-line='{args.command_line}'"]
        )
        return subprocess.run([unshare, "--net", "sh", "-c", inner], stdin=subprocess.DEVNULL, check=False).returncode
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
