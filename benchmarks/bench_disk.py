"""The disk tier's speed against the filesystem's own, side by side in one run.

On one filesystem (a temporary directory under --dir, default under the system's temp dir):
  - plain: a sequential write of a file of the dataset's size with O_DIRECT (then fsync), and
    sequential reads of it with O_DIRECT and, cold, buffered (4 MiB blocks, one thread);
  - tier writes: puts with `with_disk_copy` (write-through: the put returns once the node has
    written and fdatasync'ed the object's file) from a same-host client (shm) and a TCP client;
  - tier reads, cold: every object only on disk (the node was restarted, so DRAM is empty),
    read with the zero-copy batch API by a same-host client (it reads the files with preadv
    into its registered buffers) and by a TCP client (the node sends them with sendfile);
  - the two ways a node can send a file over asyncio (uvloop) that were measured to choose:
    os.sendfile from a worker thread, and os.preadv into a buffer then transport.write.

Cold reads: between rounds the benchmark evicts the objects' files (and the plain file) from
the page cache with posix_fadvise(POSIX_FADV_DONTNEED) on each file, as fio's invalidate=1
does; the system-wide drop_caches is not used. The plain O_DIRECT read bypasses the cache.
Prints JSON: medians of --repeats rounds, in GB/s, with the ratios the target is stated in
(tier reads >= 70% of the plain read).

    python benchmarks/bench_disk.py [--total 256MiB] [--object-size 4MiB] [--repeats 5] [--dir PATH]
                                    [--no-disk-fsync]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import mmap
import os
import select
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import uvloop

from kvpool import ErrorCode, ReplicateConfig, Store
from kvpool.cli.launcher import LocalCluster
from kvpool.config import parse_size
from kvpool.protocol import objectfile

MIB = 1 << 20
BLOCK_BYTES = 4 * MIB
BATCH_OBJECTS = 8


def gbps(size_bytes: int, seconds: float) -> float:
    return size_bytes / seconds / 1e9


def evict_from_page_cache(paths: list[Path]) -> None:
    """posix_fadvise(DONTNEED) on each file (fio's invalidate=1); clean pages leave the cache."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# --- the plain file ------------------------------------------------------------------------


def aligned_buffer(size: int) -> mmap.mmap:
    buffer = mmap.mmap(-1, size)  # page-aligned: what O_DIRECT needs
    buffer.write(os.urandom(min(size, MIB)) * (size // min(size, MIB)))
    return buffer


def plain_write_odirect(path: Path, total: int) -> float:
    buffer = aligned_buffer(BLOCK_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        started = time.perf_counter()
        for offset in range(0, total, BLOCK_BYTES):
            os.pwrite(fd, buffer, offset)
        os.fsync(fd)
        return gbps(total, time.perf_counter() - started)
    finally:
        os.close(fd)
        buffer.close()


def plain_read_odirect(path: Path, total: int) -> float:
    buffer = aligned_buffer(BLOCK_BYTES)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        started = time.perf_counter()
        for offset in range(0, total, BLOCK_BYTES):
            os.preadv(fd, [buffer], offset)
        return gbps(total, time.perf_counter() - started)
    finally:
        os.close(fd)
        buffer.close()


def plain_read_buffered_cold(path: Path, total: int) -> float:
    evict_from_page_cache([path])
    buffer = bytearray(BLOCK_BYTES)
    fd = os.open(path, os.O_RDONLY)
    try:
        started = time.perf_counter()
        for offset in range(0, total, BLOCK_BYTES):
            os.preadv(fd, [buffer], offset)
        return gbps(total, time.perf_counter() - started)
    finally:
        os.close(fd)


# --- the disk tier -------------------------------------------------------------------------


def tier_write(store: Store, keys: list[str], buffers: list[np.ndarray]) -> float:
    addresses = [store.register_buffer(b) for b in buffers]
    sizes = [b.nbytes for b in buffers]
    config = ReplicateConfig(with_disk_copy=True)
    started = time.perf_counter()
    for start in range(0, len(keys), BATCH_OBJECTS):
        batch = slice(start, start + BATCH_OBJECTS)
        codes = store.batch_put_from(keys[batch], addresses[batch], sizes[batch], config)
        assert codes == [ErrorCode.OK] * len(codes), codes
    elapsed = time.perf_counter() - started
    for address in addresses:
        store.unregister_buffer(address)
    return gbps(sum(sizes), elapsed)


def tier_read(store: Store, keys: list[str], buffers: list[np.ndarray]) -> float:
    addresses = [store.register_buffer(b) for b in buffers]
    sizes = [b.nbytes for b in buffers]
    started = time.perf_counter()
    for start in range(0, len(keys), BATCH_OBJECTS):
        batch = slice(start, start + BATCH_OBJECTS)
        got = store.batch_get_into(keys[batch], addresses[batch], sizes[batch])
        assert got == sizes[batch], got
    elapsed = time.perf_counter() - started
    for address in addresses:
        store.unregister_buffer(address)
    return gbps(sum(sizes), elapsed)


def disk_tier_files(disk_dir: Path) -> list[Path]:
    return [p for p in (disk_dir / objectfile.OBJECTS_DIR).iterdir() if p.name.endswith(objectfile.SUFFIX)]


# --- how a node sends a file over asyncio ----------------------------------------------------


def send_paths(path: Path, size: int, rounds: int) -> dict[str, float]:
    """Loopback GB/s of the two ways to send a file from a uvloop server (warm page cache)."""
    pool = concurrent.futures.ThreadPoolExecutor(2)

    def sendfile_thread(sock_fd: int) -> None:
        fd = os.open(path, os.O_RDONLY)
        poller = select.poll()
        poller.register(sock_fd, select.POLLOUT)
        offset = 0
        try:
            while offset < size:
                try:
                    offset += os.sendfile(sock_fd, fd, offset, size - offset)
                except BlockingIOError:
                    poller.poll(1000)
        finally:
            os.close(fd)

    def pread_buffer() -> bytearray:
        fd = os.open(path, os.O_RDONLY)
        try:
            buffer = bytearray(size)
            os.preadv(fd, [buffer], 0)
            return buffer
        finally:
            os.close(fd)

    class Sender(asyncio.Protocol):
        def __init__(self, mode: str) -> None:
            self.mode = mode

        def connection_made(self, transport) -> None:  # type: ignore[no-untyped-def]
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            asyncio.get_running_loop().create_task(self.send())

        async def send(self) -> None:
            loop = asyncio.get_running_loop()
            if self.mode == "sendfile_thread":
                sock_fd = os.dup(self.transport.get_extra_info("socket").fileno())
                try:
                    await loop.run_in_executor(pool, sendfile_thread, sock_fd)
                finally:
                    os.close(sock_fd)
            else:
                self.transport.write(memoryview(await loop.run_in_executor(pool, pread_buffer)))

    def receive(port: int) -> list[float]:
        conn = socket.create_connection(("127.0.0.1", port))
        target = memoryview(bytearray(size))
        results = []
        for _ in range(rounds):
            started = time.perf_counter()
            conn.sendall(b"go")
            received = 0
            while received < size:
                received += conn.recv_into(target[received:])
            results.append(gbps(size, time.perf_counter() - started))
        conn.close()
        return results

    async def measure(mode: str) -> float:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: Sender(mode), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        results = await loop.run_in_executor(None, receive, port)
        server.close()
        return statistics.median(results)

    out = {mode: uvloop.run(measure(mode)) for mode in ("sendfile_thread", "preadv_then_write")}
    pool.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total", default="256MiB", help="Bytes per round (the plain file's size).")
    parser.add_argument("--object-size", default="4MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--dir", default="", help="Directory on the filesystem to measure (default: the system temp dir)."
    )
    parser.add_argument("--no-disk-fsync", action="store_true", help="Run the node with --no-disk-fsync.")
    args = parser.parse_args()
    total, object_size = parse_size(args.total), parse_size(args.object_size)
    count = total // object_size
    total = count * object_size
    if args.dir and not Path(args.dir).is_dir():
        parser.error(f"--dir {args.dir}: no such directory (give one on the filesystem to measure)")
    base = Path(tempfile.mkdtemp(prefix="kvpool-bench-disk-", dir=args.dir or None))
    plain_path = base / "plain.bin"
    disk_dir = base / "disk"
    results: dict = {
        "total_bytes": total, "object_size_bytes": object_size, "repeats": args.repeats,
        "filesystem_dir": str(base), "disk_fsync": not args.no_disk_fsync,
        "cold_read_method": "plain: O_DIRECT, and buffered after posix_fadvise(DONTNEED); tier: "
        "posix_fadvise(DONTNEED) on every object file before each round (fio's invalidate=1)",
    }  # fmt: skip
    # Every round runs each measure once, in turn, so that a busy machine slows all of them
    # alike; the ratios are taken per round, then their median.
    rounds: dict[str, list[float]] = {}

    def record(name: str, value: float) -> None:
        rounds.setdefault(name, []).append(value)

    try:
        buffers = [np.random.randint(0, 255, object_size, dtype=np.uint8) for _ in range(count)]
        node_args = ("--disk-dir", str(disk_dir), "--disk-size", f"{(2 * args.repeats + 1) * total // MIB + 64}MiB")
        if args.no_disk_fsync:
            node_args += ("--no-disk-fsync",)
        with LocalCluster(0, f"{max(64, 2 * BATCH_OBJECTS * object_size // MIB)}MiB", workdir=base,
                          master_args=("--promote-reads", "0")) as cluster:  # fmt: skip
            node = cluster.start_node(node_args)
            for round_ in range(args.repeats):
                record("plain_write_odirect_gbps", plain_write_odirect(plain_path, total))
                for where, shm in (("local", True), ("remote", False)):
                    with Store(cluster.master_endpoint, token=cluster.client_token, shm_enabled=shm) as store:
                        keys = [f"{where}-{round_}-{i}" for i in range(count)]
                        record(f"tier_write_{where}_gbps", tier_write(store, keys, buffers))
                record(
                    "ratio_tier_write_local_vs_plain_write",
                    rounds["tier_write_local_gbps"][-1] / rounds["plain_write_odirect_gbps"][-1],
                )
            node.stop()  # DRAM gone: after the restart every object is only on disk
            cluster.nodes.remove(node)
            cluster.start_node(node_args)
            keys = [f"local-0-{i}" for i in range(count)]
            targets = [np.empty(object_size, dtype=np.uint8) for _ in range(count)]
            tier_files = disk_tier_files(disk_dir)
            stores = {
                where: Store(cluster.master_endpoint, token=cluster.client_token, shm_enabled=shm)
                for where, shm in (("local", True), ("remote", False))
            }
            try:
                for _ in range(args.repeats):
                    record("plain_read_odirect_gbps", plain_read_odirect(plain_path, total))
                    record("plain_read_buffered_cold_gbps", plain_read_buffered_cold(plain_path, total))
                    for where, store in stores.items():
                        evict_from_page_cache(tier_files)
                        record(f"tier_read_{where}_gbps", tier_read(store, keys, targets))
                        assert all(np.array_equal(t, b) for t, b in zip(targets, buffers)), f"{where}: bytes differ"
                        for target in targets:  # so that the next read's bytes are checked too
                            target.fill(0)
                    plain = rounds["plain_read_odirect_gbps"][-1]
                    for where in stores:
                        record(f"ratio_tier_read_{where}_vs_plain_read", rounds[f"tier_read_{where}_gbps"][-1] / plain)
            finally:
                for store in stores.values():
                    store.close()
            with Store(cluster.master_endpoint, token=cluster.client_token) as store:
                results["tiers"] = store.cluster_status().to_dict()["tiers"]
        for name, values in rounds.items():
            results[name] = statistics.median(values)
        results["rounds"] = {name: [round(v, 3) for v in values] for name, values in rounds.items()}
        results["send_path_gbps_warm"] = send_paths(plain_path, min(total, 256 * MIB), args.repeats)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    json.dump(results, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
