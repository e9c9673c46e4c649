"""Core store speed against the machine's own limits, side by side in one run.

Between two processes (this client and a node process; the master is a third):
  - TCP path (shm off) and same-host shm path, 1 MiB and 4 MiB objects, zero-copy batch API,
    against a plain Python socket pair (sendall/recv_into of 1 MiB buffers: one buffer each
    side, as the issue states it, and buffers spanning as many distinct bytes as the run moves)
    and a numpy copy of the same bytes, measured in the same run;
  - 4 KiB objects in batches of 128 through one client (objects/s, put and get), into an
    empty cache and into a full one (every put evicts as much as it writes: a cache's steady
    state);
  - a single 4 KiB get (median latency).
Prints JSON: medians of --repeats rounds; every round measures the machine's limit next to the
put and the get, and the ratios the targets are stated in are medians of per-round ratios.

    python benchmarks/bench_core.py [--repeats 5] [--quick] [--busy-poll-us 200] [--token T]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import uvloop

from kvpool import AsyncStore, ErrorCode, Store, limits
from kvpool.cli.launcher import LocalCluster

MIB = 1 << 20
BATCH_BYTES = 32 * MIB  # one zero-copy batch call moves this much (32 x 1 MiB, 8 x 4 MiB)


def median_of(repeats: int, measure) -> float:
    return statistics.median(measure() for _ in range(repeats))


def remove_and_settle(store: Store, pattern: str, timeout_s: float = 10.0) -> None:
    """Remove the run's keys (the store holds no others) and wait until the node has dropped
    them and the master freed their ranges, so that the next round's puts are timed alone: the
    drops of 6,144 pages still on their way cost the 4 KiB puts timed after them 7% by the
    median (12 alternating rounds, ad hoc; `bench_paths.py puts-after-remove` measures puts
    in that moment)."""
    store.remove_by_regex(pattern, force=True)
    deadline = time.monotonic() + timeout_s
    while any(segment.used_bytes for segment in store.cluster_status().segments):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the node did not drop the keys of {pattern!r} in {timeout_s} s")
        time.sleep(0.005)


def numpy_copy_gbps(object_size: int, total_bytes: int) -> float:
    """numpy copies of `object_size` bytes from and into as many distinct bytes as the run moves
    (as the store's puts and gets do). Sources recycled over 64 objects once made the limit of
    1 MiB objects 10-18% faster than a copy of 256 MiB of distinct bytes on this VM."""
    count = total_bytes // object_size
    source = np.random.randint(0, 255, object_size * count, dtype=np.uint8)
    target = np.empty_like(source)
    target.fill(0)  # faulted in before timing, like a segment (pre-faulted) or a registered buffer
    started = time.perf_counter()
    for i in range(count):
        at = slice(i * object_size, (i + 1) * object_size)
        np.copyto(target[at], source[at])
    return object_size * count / (time.perf_counter() - started) / 1e9


def socket_pair_gbps(total_bytes: int, chunk: int = MIB, footprint: int | None = None) -> float:
    """A plain Python socket pair over TCP loopback between two processes: sendall and
    recv_into of `chunk` bytes at a time, from and into buffers of `footprint` bytes taken in
    turn. The issue's limit is one buffer of 1 MiB each side (the default), which stays in the
    L2 cache; a footprint of the run's size moves distinct memory, as the store does. The
    footprint defaults to one chunk; each side counts the bytes it moved, so that any sizes
    end (a chunk larger than the footprint once had the sender count bytes it never sent, and
    both sides wait for ever)."""
    footprint = chunk if footprint is None else footprint
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    pid = os.fork()
    if pid == 0:
        landing = np.ones(footprint, dtype=np.uint8)  # faulted in before the sender starts its clock
        buffer = memoryview(landing).cast("B")
        conn, _ = listener.accept()
        conn.sendall(b"r")  # ready: the sender starts its clock now
        received = 0
        while received < total_bytes:
            at = received % footprint
            received += conn.recv_into(buffer[at : at + min(chunk, footprint - at, total_bytes - received)])
        conn.sendall(b"k")
        os._exit(0)
    data = memoryview(np.ones(footprint, dtype=np.uint8)).cast("B")  # faulted in; any bytes will do
    conn = socket.create_connection(("127.0.0.1", port))
    conn.recv(1)
    started = time.perf_counter()
    sent = 0
    while sent < total_bytes:
        at = sent % footprint
        piece = data[at : at + min(chunk, footprint - at, total_bytes - sent)]
        conn.sendall(piece)
        sent += len(piece)
    conn.recv(1)
    elapsed = time.perf_counter() - started
    conn.close()
    listener.close()
    os.waitpid(pid, 0)
    return total_bytes / elapsed / 1e9


def connected_pair(family: int) -> tuple[socket.socket, socket.socket]:
    """Two connected sockets: over TCP loopback (Nagle off, as kvpool's) or a Unix socket pair."""
    if family == socket.AF_UNIX:
        return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    listener = socket.create_server(("127.0.0.1", 0))
    ours = socket.create_connection(listener.getsockname())
    theirs, _ = listener.accept()
    listener.close()
    for end in (ours, theirs):
        end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return ours, theirs


def round_trip_us(family: int = socket.AF_INET) -> float:
    """Median round trip of 64 bytes between two processes, over TCP loopback or a Unix socket
    (what same-host control traffic uses): how quickly this machine wakes a process right now
    (shared VMs vary several-fold from hour to hour)."""
    conn, peer = connected_pair(family)
    pid = os.fork()
    if pid == 0:
        conn.close()
        while data := peer.recv(64):
            peer.sendall(data)
        os._exit(0)
    peer.close()
    samples = []
    for _ in range(2000):
        started = time.perf_counter_ns()
        conn.sendall(b"x" * 64)
        conn.recv(64)
        samples.append((time.perf_counter_ns() - started) / 1000)
    conn.close()
    os.waitpid(pid, 0)
    return statistics.median(samples)


class ZeroCopyRun:
    """Registered source and target buffers for `count` objects of `size` bytes."""

    def __init__(self, store: Store, prefix: str, size: int, count: int) -> None:
        self.store = store
        self.size = size
        self.keys = [f"{prefix}-{size}-{i}" for i in range(count)]
        self.source = np.random.randint(0, 255, size * count, dtype=np.uint8)
        self.target = np.zeros(size * count, dtype=np.uint8)
        base_source = store.register_buffer(self.source)
        base_target = store.register_buffer(self.target)
        self.source_addresses = [base_source + i * size for i in range(count)]
        self.target_addresses = [base_target + i * size for i in range(count)]

    def put_gbps(self, batch: int) -> float:
        remove_and_settle(self.store, f"^{self.keys[0].rsplit('-', 1)[0]}-")
        started = time.perf_counter()
        for start in range(0, len(self.keys), batch):
            end = start + batch
            codes = self.store.batch_put_from(
                self.keys[start:end], self.source_addresses[start:end], [self.size] * len(self.keys[start:end])
            )
            assert all(c == ErrorCode.OK for c in codes), codes
        return self.size * len(self.keys) / (time.perf_counter() - started) / 1e9

    def get_gbps(self, batch: int) -> float:
        started = time.perf_counter()
        for start in range(0, len(self.keys), batch):
            end = start + batch
            sizes = self.store.batch_get_into(
                self.keys[start:end], self.target_addresses[start:end], [self.size] * len(self.keys[start:end])
            )
            assert all(s == self.size for s in sizes), sizes
        elapsed = time.perf_counter() - started
        assert np.array_equal(self.source, self.target), "zero-copy get returned other bytes"
        # Cleared after the check, untimed, so that the next get's bytes are checked too (the
        # target of a get into bytes already there once passed whatever the get wrote).
        self.target.fill(0)
        return self.size * len(self.keys) / elapsed / 1e9


def small_objects(store: Store, repeats: int, threads: int, batch_count: int = 48) -> dict:
    """4 KiB objects in batches of 128 through one Store, from `threads` caller threads."""
    batches = [[f"small-{b}-{i}" for i in range(128)] for b in range(batch_count)]
    value = os.urandom(4096)
    values = [value] * 128

    def put_rate() -> float:
        remove_and_settle(store, "^small-")
        started = time.perf_counter()
        for codes in pool.map(lambda keys: store.put_batch(keys, values), batches):
            assert codes == [0] * 128, codes
        return 128 * len(batches) / (time.perf_counter() - started)

    def get_rate() -> float:
        started = time.perf_counter()
        for got in pool.map(store.get_batch, batches):
            assert got == values, "a get missed or returned other bytes"  # about 1% of a batch
        return 128 * len(batches) / (time.perf_counter() - started)

    # The threads start before the timing, once (the pool's start-up is no put's or get's).
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(time.sleep, [0.01] * threads))
        return {
            "threads": threads,
            "put_objects_per_s": round(median_of(repeats, put_rate)),
            "get_objects_per_s": round(median_of(repeats, get_rate)),
        }


FULL_CACHE_MEMORY = 64 * MIB


def small_puts_into_a_full_cache(
    repeats: int, polling: tuple[str, str], memory: int = FULL_CACHE_MEMORY, token: str | None = None
) -> dict:
    """4 KiB puts in batches of 128 from one thread into a node of `memory` that was filled
    twice over first: each put finds no room until eviction makes it. Every put must be
    stored."""
    batches_per_round = 48 * memory // FULL_CACHE_MEMORY
    value = os.urandom(4096)
    with LocalCluster(1, f"{memory // MIB}MiB", master_args=polling, node_args=polling, token=token) as cluster:
        with Store(cluster.master_endpoint, token=cluster.client_token) as store:
            next_batch = 0

            def put_rounds(batch_count: int) -> float:
                nonlocal next_batch
                started = time.perf_counter()
                for b in range(next_batch, next_batch + batch_count):
                    codes = store.put_batch([f"full-{b}-{i}" for i in range(128)], [value] * 128)
                    assert codes == [ErrorCode.OK] * 128, sorted(set(codes))
                next_batch += batch_count
                return 128 * batch_count / (time.perf_counter() - started)

            put_rounds(2 * memory // (128 * len(value)))  # fill, then evict as much again
            rate = median_of(repeats, lambda: put_rounds(batches_per_round))
            evictions = store.cluster_status().evicted_count
    return {"segment_bytes": memory, "put_objects_per_s": round(rate), "evictions": evictions}


def single_get_latency(store: Store, gets: int = 3000) -> dict:
    """One 4 KiB get at a time: the sync Store, and AsyncStore on its own loop."""
    keys = [f"latency-{i}" for i in range(256)]
    store.put_batch(keys, [os.urandom(4096)] * len(keys))
    sync_us = []
    for i in range(gets):
        started = time.perf_counter_ns()
        assert store.get(keys[i % len(keys)]) is not None
        sync_us.append((time.perf_counter_ns() - started) / 1000)

    async def async_latencies() -> list[float]:
        async with await AsyncStore.open(store._async.config.master, token=store._async.config.token) as async_store:
            out = []
            for i in range(gets):
                started = time.perf_counter_ns()
                assert await async_store.get(keys[i % len(keys)]) is not None
                out.append((time.perf_counter_ns() - started) / 1000)
            return out

    async_us = uvloop.run(async_latencies())
    return {
        "sync_store_us_p50": round(statistics.median(sync_us), 1),
        "sync_store_us_p99": round(sorted(sync_us)[int(len(sync_us) * 0.99)], 1),
        "async_store_us_p50": round(statistics.median(async_us), 1),
        "async_store_us_p99": round(sorted(async_us)[int(len(async_us) * 0.99)], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="smaller volumes, for a smoke run")
    parser.add_argument(
        "--busy-poll-us", type=int, default=limits.BUSY_POLL_US_DEFAULT,
        help="the master's and node's polling window after replies (0: off; docs/performance.md)",
    )  # fmt: skip
    parser.add_argument(
        "--token", default="",
        help="run the cluster with this cluster token, as a deployment does (every frame after a handshake "
        "carries its MAC); default none (loopback only)",
    )  # fmt: skip
    args = parser.parse_args()
    total = (64 if args.quick else 256) * MIB
    result: dict = {"machine": {"cpus": os.cpu_count()}, "total_bytes_per_run": total}
    result["busy_poll_us"] = args.busy_poll_us
    result["token"] = bool(args.token)
    baseline_socket = median_of(args.repeats, lambda: socket_pair_gbps(total))
    result["socket_pair_gbps"] = round(baseline_socket, 3)
    result["loopback_rtt_us_p50"] = round(round_trip_us(socket.AF_INET), 1)
    result["unix_socket_rtt_us_p50"] = round(round_trip_us(socket.AF_UNIX), 1)
    polling = ("--busy-poll-us", str(args.busy_poll_us))
    token = args.token or None
    with LocalCluster(1, f"{2 * total // MIB + 64}MiB", master_args=polling, node_args=polling, token=token) as cluster:
        for path, shm_enabled in (("tcp", False), ("shm", True)):
            with Store(cluster.master_endpoint, token=cluster.client_token, shm_enabled=shm_enabled) as store:
                for size in (MIB, 4 * MIB):
                    run = ZeroCopyRun(store, path, size, total // size)
                    batch = BATCH_BYTES // size
                    run.put_gbps(batch)  # warm-up: connections, mappings, page tables
                    run.get_gbps(batch)
                    if path == "tcp":  # the limit, and one that moves as many distinct bytes
                        machine_limits = {
                            "socket_pair": lambda: socket_pair_gbps(total),
                            "socket_pair_same_bytes": lambda: socket_pair_gbps(total, footprint=total),
                        }
                    else:
                        machine_limits = {"numpy_copy": lambda size=size: numpy_copy_gbps(size, total)}
                    # Each round measures the limits, the put and the get back to back, so that a
                    # busy moment of this shared VM slows them all: ratios are taken per round,
                    # then the median (as bench_disk.py does).
                    rounds = [
                        ([limit() for limit in machine_limits.values()], run.put_gbps(batch), run.get_gbps(batch))
                        for _ in range(args.repeats)
                    ]
                    row: dict = {"batch_objects": batch}
                    row["put_gbps"] = round(statistics.median(r[1] for r in rounds), 3)
                    row["get_gbps"] = round(statistics.median(r[2] for r in rounds), 3)
                    for i, name in enumerate(machine_limits):
                        row[f"{name}_gbps"] = round(statistics.median(r[0][i] for r in rounds), 3)
                        row[f"put_vs_{name}"] = round(statistics.median(r[1] / r[0][i] for r in rounds), 2)
                        row[f"get_vs_{name}"] = round(statistics.median(r[2] / r[0][i] for r in rounds), 2)
                    result[f"{path}_{size // MIB}MiB"] = row
                    store.remove_all(force=True)
        with Store(cluster.master_endpoint, token=cluster.client_token) as store:
            for threads in (1, 4):
                result[f"small_4KiB_batch128_shm_{threads}_threads"] = small_objects(
                    store, args.repeats, threads, 16 if args.quick else 48
                )
            store.remove_all(force=True)
            result["single_get_4KiB"] = single_get_latency(store, 500 if args.quick else 3000)
    # --quick: a quarter of the node (and fewer batches and gets above), so that a smoke run
    # under the tests' invariant checks (O(objects) after every request) takes seconds.
    full_cache_memory = FULL_CACHE_MEMORY // 4 if args.quick else FULL_CACHE_MEMORY
    result["small_4KiB_batch128_shm_1_thread_full_cache"] = small_puts_into_a_full_cache(
        args.repeats, polling, full_cache_memory, token
    )
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
