"""The small measurements behind docs/performance.md and docs/tiers.md: where a request's time goes.

Each part prints one JSON object (medians); run one with its name, or all by default:

    python benchmarks/bench_paths.py [PART ...]   (round-trips master mixed-sizes fragmentation
                                                 full-cache-soak node-commit puts-after-remove
                                                 client put-phases tcp-transfers page-gets
                                                 pieces caller-thread landing copies
                                                 payload-alignment files bytecodes)

  round-trips  a 200-byte send and a round trip between two processes over TCP loopback and a
               Unix socket (blocking sockets), and over a Unix socket to a receiver that waits
               in epoll_wait as asyncio servers do; a uvloop ping-pong; one kvpool RPC
               (GetReplicaList of one key) to a master process over TCP and over its Unix socket,
               from an event loop and from a thread blocked in recv (a sync Store's caller);
               and that RPC back to back against after 7 ms away (busy, asleep, and busy with
               the master woken 300 us before), as the put_end after a large copy is. Those
               masters do not poll after replies (--busy-poll-us 0): polling hides the wake-up.
  master       µs per key of put_start, put_end, finish_put_end and get_replica_list on the pure
               MasterService, in batches of 128 4 KiB objects; and a put of 32 x 1 MiB with warm
               caches and right after a 64 MiB copy (cold, as in put-phases).
  mixed-sizes  puts of mixed sizes (64-512 KiB) into two full 24 MiB segments through the pure
               MasterService, rounds as the server runs them: how many puts needed rounds
               waiting for room, how many failed, objects evicted per put, how full it stayed.
  fragmentation
               4,000 batches of 128 4 KiB puts into a full 64 MiB segment through the pure
               MasterService, no reads: the pieces (grants) a batch is cut into as the cache
               churns, the segment's free extents, unread objects left protected, put_start's
               time per batch, early and late.
  full-cache-soak
               one thread putting 4 KiB pages in batches of 128 into a 64 MiB node filled twice
               over, 100 rounds of 48 batches (about three minutes): puts/s early and late,
               and late, each process's CPU per batch and the pieces (grants) per batch.
  node-commit  µs per key for a node to verify and record a commit of 128 4 KiB objects, to record
               one a same-host writer hashed in place, and to drop 128 (400 batches in all); and
               to record the same keys put again elsewhere before their old entries' drops came
               (a client's remove, then put, of the same keys), with the spans that leaves;
               and to record 128 keys scattered one by one over a full 64 MiB segment (a
               fragmented cache's puts), and to drop them (200 batches); and a full garbage
               collection with a node inventory of a million 4 KiB objects (ms beyond one without).
  puts-after-remove
               rounds of 128 x 128 4 KiB puts through one Store, each after a remove_by_regex of
               the round before's 16,384 keys, put again: the slowest put_batch of a round and
               the round's puts/s (medians), with the drops of the remove still on their way.
  client       a client's own work for a 128-key get from a same-host node (GetJob, copies);
               copying and hashing 128 pages of 4 KiB, and hashing them alone;
               the sync Store's hand-off to its loop thread; 4 KiB puts in batches of 128
               through AsyncStore and Store (and Store with shm off: over TCP), and how often
               the client's garbage collector ran in 100 of those batches (same host);
               zero-copy same-host gets of 4 KiB pages in batches of 128 (and the collector's
               runs); gets over TCP in batches of 128: plain 4 KiB, zero-copy 4 KiB and 64 KiB
               (back to back).
  put-phases   where a same-host zero-copy put of 32 x 1 MiB spends its time, batches back to
               back (as bench_core.py runs them): put_start, the copy and hash, put_end, each
               timed through Store and through AsyncStore; a numpy copy of 32 MiB for scale.
               Against a node process, and in one process (the client's embedded segment).
  tcp-transfers
               zero-copy puts and gets of 32 x 1 MiB over TCP (shm off), batches back to back:
               GB/s, and the CPU time of the client, the master and the node per batch (/proc),
               medians of 6 rounds of 8 batches; a plain socket pair's GB/s in the same rounds.
  page-gets    a working set of 48 batches of 128 pages of 4 KiB read round and round through
               one Store on the same host (a node with room): objects/s and the CPU time of the
               client, the master and the node per batch (/proc), medians of 8 rounds.
  pieces       gets and puts through one Store from one thread, each batch in pieces whose
               requests leave at once (client/store.py batch_pieces) against one request per
               batch, alternating round by round: 4 KiB pages in batches of 128 (gets) and 512
               on the same host; and what batches of 128 that go whole would do in two pieces:
               gets over TCP (shm off) and of 64 KiB objects, puts of 4 KiB pages; and
               AsyncStore's gets of 4 KiB pages in batches of 128 and 512.
  caller-thread
               a sync Store's transfers over TCP from the calling thread's own connections to
               nodes (client/node_links.py) against through its loop thread, toggled round by
               round in one cluster: 4 KiB gets and puts in batches of 128, with one node and
               with two (each batch's gets half on each).
  landing      where a plain get of 4 MiB lands: a bytes object filled in place against a
               zeroed bytearray copied into bytes; same-host plain gets of 4 MiB with glibc's
               defaults and with GLIBC_TUNABLES keeping freed memory (docs/performance.md);
               filling a fresh 32 MiB bytes object in 4 KiB pages and in huge pages; same-host
               plain gets of 1 and 4 MiB objects whose results are kept, with the copying threads
               populating each fresh object first (page_advice.py) and without, alternating.
  copies       a same-host get's copy of 32 x 1 MiB into a numpy array: glibc's memcpy in
               256 KiB chunks with the destination 16 and 64 bytes past the source (mod 4 KiB),
               numpy's SIMD copy, copy then hash, and copy and hash chunk by chunk (checksums.py)
               on one and two threads; a numpy copy of whole objects as the limit; and a put of
               the same bytes as 64 parts of 16 KiB per object (one per layer), before and now,
               and as 16 parts of 64 KiB, by memcpy and by numpy's copy.
  payload-alignment
               glibc's memcpy of 64 KiB with the destination 0-64 bytes past the source (mod
               4 KiB); and frames of 128 x 64 KiB over TCP loopback to a receiver process, as a
               zero-copy put sends them (from a numpy array into a page-aligned segment) and as
               a node replies to a get (from a segment into a numpy array), with the control
               message as encoded before 2026-12-01 and padded (frames.payload_padding).
  files        reading 64 files of 4 MiB, cold, through the page cache (1 and 4 threads,
               POSIX_FADV_WILLNEED), with O_DIRECT (1 and 4 threads) and as the disk tier's
               same-host reads do (files.read_object_into into a numpy array, 4 threads, after
               WILLNEED), next to one file of the same 256 MiB read buffered and with O_DIRECT,
               every way once per round; and
               64 object files of 4 MiB from the page cache into a numpy array 16 bytes past a
               page: preadv straight in, into a page-aligned array, and files.read_object_into.
  bytecodes    Python bytecodes per key (counted, not timed: the same on every run) of the
               master's put and get phases and the client's planning of a 128-key get over TCP,
               and its checking of the pages once they landed.

Numbers on a shared VM move between runs: compare within one run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import json
import mmap
import os
import random
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import uvloop
import xxhash
from bench_core import connected_pair

from kvpool import AsyncStore, ErrorCode, Store, limits
from kvpool.checksums import SIMD_COPY_INTO_SEGMENT_BYTES_MIN, checksum_of, checksums_of, copies_checksummed
from kvpool.cli.launcher import LocalCluster
from kvpool.config import MasterConfig
from kvpool.master.service import MasterService
from kvpool.protocol import auth
from kvpool.protocol.messages import (
    CommitObjects,
    DropObjects,
    GetReplicaList,
    Heartbeat,
    InventoryEntry,
    MountSegment,
    PutEnd,
    PutStart,
    RemoveAll,
    ReplicateConfig,
    SegmentInfo,
)
from kvpool.transports.connection import connect

KIB, MIB = 1 << 10, 1 << 20
PAGE = 4 * KIB
BATCH = 128


def process_cpu_ms(pid: int) -> float:
    """CPU time of every thread of a process so far, in ms (the scheduler's statistics)."""
    total_ns = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            total_ns += int((task / "schedstat").read_text().split()[0])
    return total_ns / 1e6


def cluster_processes(cluster: LocalCluster) -> dict[str, int]:
    """The pids of this process (the client), the cluster's master and its first node."""
    return {"client": os.getpid(), "master": cluster.master.pid, "node": cluster.nodes[0].pid}


def timed_with_cpu(processes: dict[str, int], action) -> tuple[float, dict[str, float]]:
    """Run `action`: its wall time in seconds, and the CPU ms each process spent meanwhile."""
    cpu_before = {name: process_cpu_ms(pid) for name, pid in processes.items()}
    started = time.perf_counter()
    action()
    elapsed = time.perf_counter() - started
    return elapsed, {name: process_cpu_ms(pid) - cpu_before[name] for name, pid in processes.items()}


def median_us(samples_ns: list[int]) -> float:
    return round(statistics.median(samples_ns) / 1000, 1)


def timed(action, count: int) -> list[int]:
    samples = []
    for _ in range(count):
        started = time.perf_counter_ns()
        action()
        samples.append(time.perf_counter_ns() - started)
    return samples


def answering(action, expected):
    """`action`, failing the benchmark when it does not return `expected` (a get whose key
    missed or whose bytes failed their checksum returns a negative code or None)."""

    def checked() -> None:
        assert action() == expected, "a get missed or read wrong"

    return checked


# --- round trips -------------------------------------------------------------------------


def blocking_round_trip(family: int, receiver_waits_in_epoll: bool = False) -> dict:
    """The sender's cost of a 200-byte send to a process blocked in recv (or waiting in
    epoll_wait, as every asyncio server does), and the round trip."""
    ours, theirs = connected_pair(family)
    pid = os.fork()
    if pid == 0:
        ours.close()
        poller = select.epoll()
        poller.register(theirs.fileno(), select.EPOLLIN)
        while not receiver_waits_in_epoll or poller.poll():
            if not theirs.recv(65536):
                break
            theirs.send(b"x")
        os._exit(0)
    theirs.close()
    sends, trips = [], []
    for _ in range(3000):
        started = time.perf_counter_ns()
        ours.send(b"a" * 200)
        sent = time.perf_counter_ns()
        ours.recv(16)
        trips.append(time.perf_counter_ns() - started)
        sends.append(sent - started)
    ours.close()
    os.waitpid(pid, 0)
    return {"send_us": median_us(sends), "round_trip_us": median_us(trips)}


def uvloop_ping_pong_us() -> float:
    """Two uvloop processes echoing 100 bytes over a Unix socket: the floor of an asyncio RPC."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        ours.close()

        async def echo() -> None:
            done = asyncio.get_running_loop().create_future()

            class Echo(asyncio.Protocol):
                def connection_made(self, transport):
                    self.transport = transport

                def data_received(self, data):
                    self.transport.write(data)

                def connection_lost(self, exc):
                    done.set_result(None)

            await asyncio.get_running_loop().connect_accepted_socket(Echo, theirs)
            await done

        uvloop.run(echo())
        os._exit(0)
    theirs.close()

    async def ping() -> list[int]:
        loop = asyncio.get_running_loop()
        waiter: list[asyncio.Future] = []

        class Ping(asyncio.Protocol):
            def data_received(self, data):
                waiter[0].set_result(None)

        transport, _ = await loop.connect_accepted_socket(Ping, ours)
        samples = []
        for _ in range(3000):
            waiter[:] = [loop.create_future()]
            started = time.perf_counter_ns()
            transport.write(b"x" * 100)
            await waiter[0]
            samples.append(time.perf_counter_ns() - started)
        transport.close()
        return samples

    samples = uvloop.run(ping())
    os.waitpid(pid, 0)
    return median_us(samples)


# The RPC figures measure what waking a process costs, which a polling master hides
# (transports/busy_poll.py): its masters do not poll.
NOT_POLLING = ("--busy-poll-us", "0")


def kvpool_rpc_us() -> dict:
    """One GetReplicaList of one key to a master process (not polling), over TCP and over its
    Unix socket from an event loop (Connection), and from a thread blocked in recv
    (BlockingConnection: how a sync Store's caller thread asks)."""
    from kvpool.transports.blocking import BlockingConnection

    with LocalCluster(0, master_args=NOT_POLLING) as cluster:

        async def measure() -> dict:
            out = {}
            for name, prefer_local in (("tcp", False), ("unix", True)):
                conn = await connect(cluster.master_endpoint, key=None, prefer_local=prefer_local)
                samples = []
                for _ in range(2000):
                    started = time.perf_counter_ns()
                    await conn.request(GetReplicaList(["k"]))
                    samples.append(time.perf_counter_ns() - started)
                conn.close()
                out[f"{name}_us"] = median_us(samples)
            return out

        out = uvloop.run(measure())
        blocking = BlockingConnection.open(cluster.master_endpoint, key=None, timeout_ms=5_000, prefer_local=True)
        samples = []
        for _ in range(2000):
            started = time.perf_counter_ns()
            blocking.request(GetReplicaList(["k"]), 5_000)
            samples.append(time.perf_counter_ns() - started)
        blocking.close()
        out["blocking_thread_unix_us"] = median_us(samples)
        return out


def rpc_after_idle_us() -> dict:
    """The same lookup from a blocked thread (a sync Store's), back to back and after the
    caller has been away for AWAY_MS, as a client copying a large batch is between put_start
    and put_end: busy (spinning), asleep, and busy with a wake-up sent to the master
    WAKE_AHEAD_US before the lookup (another request, on a second connection, whose answer is
    read afterwards). The modes take turns, sample by sample, so that the machine's moods
    fall on all of them alike."""
    from kvpool.protocol.frames import encode_frame
    from kvpool.transports.blocking import BlockingConnection

    away_s, ahead_s = AWAY_MS / 1000, WAKE_AHEAD_US / 1e6

    def spin(seconds: float) -> None:
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            pass

    with LocalCluster(0, master_args=NOT_POLLING) as cluster:
        links = [
            BlockingConnection.open(cluster.master_endpoint, key=None, timeout_ms=5_000, prefer_local=True)
            for _ in range(2)
        ]
        ask, wake = links
        modes = ("back_to_back", "after_busy", "after_sleep", "after_busy_woken")
        samples: dict[str, list[int]] = {mode: [] for mode in modes}
        for turn in range(len(modes) * 400):
            mode = modes[turn % len(modes)]
            if mode == "after_busy":
                spin(away_s)
            elif mode == "after_sleep":
                time.sleep(away_s)
            elif mode == "after_busy_woken":
                spin(away_s - ahead_s)
                wake._send(encode_frame(GetReplicaList(["k"]), 1), time.monotonic() + 5)
                spin(ahead_s)
            started = time.perf_counter_ns()
            ask.request(GetReplicaList(["k"]), 5_000)
            samples[mode].append(time.perf_counter_ns() - started)
            if mode == "after_busy_woken":
                wake._receive(time.monotonic() + 5)  # the wake-up's answer, long arrived
        for link in links:
            link.close()
    return {f"{mode}_us": median_us(ns) for mode, ns in samples.items()}


AWAY_MS = 7  # about what a client spends copying 32 MiB between put_start and put_end
WAKE_AHEAD_US = 300


def round_trips() -> dict:
    return {
        "tcp_blocking": blocking_round_trip(socket.AF_INET),
        "unix_blocking": blocking_round_trip(socket.AF_UNIX),
        "unix_receiver_in_epoll": blocking_round_trip(socket.AF_UNIX, receiver_waits_in_epoll=True),
        "uvloop_ping_pong_unix_us": uvloop_ping_pong_us(),
        "kvpool_rpc_get_replica_list_1_key": kvpool_rpc_us(),
        "kvpool_rpc_after_idle": rpc_after_idle_us(),
    }


# --- the master's and the node's work per key --------------------------------------------


def master() -> dict:
    service = MasterService(MasterConfig(), random.Random(0), auth.cluster_key("bench"), term=1)
    info = SegmentInfo("bench-segment", "bench-node", "host", "host:1", "/dev/shm/x", b"t", 1 << 30)
    service.mount_segment(MountSegment(info, []), 0)
    phases: dict[str, list[int]] = {"put_start": [], "put_end": [], "finish_put_end": [], "get_replica_list": []}
    for batch in range(200):
        keys = [f"key-{batch}-{i:058d}" for i in range(BATCH)]
        a = time.perf_counter_ns()
        service.put_start(PutStart(keys, [4 * KIB] * BATCH, ReplicateConfig()), 1)
        b = time.perf_counter_ns()
        pending = service.put_end(PutEnd(keys, [7] * BATCH), 1)
        c = time.perf_counter_ns()
        service.finish_put_end(pending, {s: [0] * len(e) for s, e in pending.commits.items()}, 1)
        d = time.perf_counter_ns()
        service.get_replica_list(GetReplicaList(keys), 2)
        e = time.perf_counter_ns()
        for name, elapsed in zip(phases, (b - a, c - b, d - c, e - d)):
            phases[name].append(elapsed // BATCH)
    result = {f"{name}_us_per_key": median_us(samples) for name, samples in phases.items()}
    result["put_32x1MiB_us"] = put_with_cold_caches(service)
    return result


def put_with_cold_caches(service: MasterService) -> dict:
    """put_start and put_end + finish_put_end of 32 keys of 1 MiB (bench_core's same-host batch),
    warm, and right after a 64 MiB copy has flushed the caches, as a client's copies do to a
    master on the same two vCPUs (put-phases)."""
    source = np.ones(64 * MIB, dtype=np.uint8)
    target = np.empty_like(source)
    result = {}
    for label, flush in (("warm", lambda: None), ("after_a_64MiB_copy", lambda: np.copyto(target, source))):
        starts, ends = [], []
        for batch in range(100):
            keys = [f"{label}-{batch}-{i:050d}" for i in range(32)]
            flush()
            a = time.perf_counter_ns()
            service.put_start(PutStart(keys, [MIB] * 32, ReplicateConfig()), 1)
            b = time.perf_counter_ns()
            flush()
            c = time.perf_counter_ns()
            pending = service.put_end(PutEnd(keys, [7] * 32), 1)
            service.finish_put_end(pending, {s: [0] * len(e) for s, e in pending.commits.items()}, 1)
            starts.append(b - a)
            ends.append(time.perf_counter_ns() - c)
            if batch % 8 == 7:  # keep within the segment: remove, and let the node acknowledge
                service.remove_all(RemoveAll(True), 1)
                acknowledge_drops(service, 1)
        result[label] = {"put_start_us": median_us(starts), "put_end_us": median_us(ends)}
    return result


def put_start_in_rounds(service: MasterService, message: PutStart, now_ms: int) -> tuple:
    """put_start as the server runs it: keys short of room are tried again in rounds, each
    after the nodes acknowledged the drops the eviction scheduled, up to
    limits.PUT_ROOM_ROUNDS_MAX. Returns the settled reply and the rounds taken."""
    reply = service.put_start(message, now_ms)
    retry = [i for i, code in enumerate(reply.codes) if code == ErrorCode.NO_AVAILABLE_HANDLE]
    rounds = 0
    while retry and rounds < limits.PUT_ROOM_ROUNDS_MAX:
        acknowledge_drops(service, now_ms)
        rounds += 1
        retry = service.put_start_again(message, reply, retry, now_ms)
    return service.put_start_settled(reply), rounds


def acknowledge_drops(service: MasterService, now_ms: int) -> None:
    for segment_id, entries in service.take_drops().items():
        service.drops_done(segment_id, entries, now_ms)


def mixed_sizes() -> dict:
    """Puts of KV-cache objects of mixed sizes (64-512 KiB, seeded) into two full 24 MiB
    segments, through the pure MasterService as the server drives it: a put that finds no room
    is tried again in rounds, each after the nodes acknowledged the drops its eviction
    scheduled, up to limits.PUT_ROOM_ROUNDS_MAX; a watermark tick every 40 puts. No reads, so
    no leases: what is measured is the allocator and eviction. Reports how many rounds the
    puts took, how many failed, the objects evicted per put and how full the segments stayed."""
    result = {}
    for replica_num in (1, 2):
        service = MasterService(MasterConfig(), random.Random(0), auth.cluster_key("bench"), term=1)
        segment_ids = ["a", "b"]
        for segment_id in segment_ids:
            info = SegmentInfo(segment_id, f"node-{segment_id}", "host", f"host:{segment_id}", "/x", b"t", 24 * MIB)
            service.mount_segment(MountSegment(info, []), 0)
        rng = random.Random(1)
        rounds_per_put, used_ratios, failed = [], [], 0
        puts = 8_000
        for index in range(puts):
            now_ms = index * 5
            message = PutStart([f"key-{index}"], [rng.randint(64 * KIB, 512 * KIB)], ReplicateConfig(replica_num))
            reply, rounds = put_start_in_rounds(service, message, now_ms)
            rounds_per_put.append(rounds)
            if reply.codes[0] != ErrorCode.OK:
                failed += 1
                continue
            pending = service.put_end(PutEnd(message.keys, [7]), now_ms)
            service.finish_put_end(pending, {s: [0] * len(e) for s, e in pending.commits.items()}, now_ms)
            if index % 40 == 39:
                service.heartbeat(Heartbeat(segment_ids), now_ms)
                service.tick(now_ms)
                acknowledge_drops(service, now_ms)
            if index >= puts // 4:  # past the first fill
                counters = service.segment_counters()
                used_ratios.append(sum(c.used_bytes for c in counters) / sum(c.capacity_bytes for c in counters))
        measured = rounds_per_put[puts // 4 :]
        result[f"replicas_{replica_num}"] = {
            "puts": len(measured),
            "rounds": sum(measured),
            "puts_needing_a_round": sum(1 for r in measured if r >= 1),
            "puts_needing_4_rounds_or_more": sum(1 for r in measured if r >= 4),
            "rounds_max": max(measured),
            "failed": failed,
            "evicted_per_put": round(service.counters.evictions / puts, 2),
            "used_ratio_mean": round(statistics.mean(used_ratios), 3),
        }
    return result


def fragmentation() -> dict:
    """4,000 batches of 128 puts of 4 KiB into one full 64 MiB segment through the pure master,
    as the server drives it (rounds for room, a watermark tick every 28 batches, drops
    acknowledged at once), no reads: how many pieces (grants) a batch's run is cut into as
    the cache churns, how many free extents the segment has, how many objects sit protected
    though nobody read them (ghost-filter false positives), and put_start's time per batch."""
    service = MasterService(MasterConfig(), random.Random(0), auth.cluster_key("bench"), term=1)
    info = SegmentInfo("a", "node-a", "host", "host:a", "/x", b"t", 64 * MIB)
    service.mount_segment(MountSegment(info, []), 0)
    allocator = service._registry.active[0].allocator
    batches, window = 4_000, 500
    grants, extents, start_ns = [], [], []
    for batch in range(batches):
        now_ms = batch * 7
        message = PutStart([f"k-{batch}-{i:04d}" for i in range(BATCH)], [PAGE] * BATCH, ReplicateConfig(1))
        started = time.perf_counter_ns()
        reply, _ = put_start_in_rounds(service, message, now_ms)
        start_ns.append(time.perf_counter_ns() - started)
        assert reply.codes == [ErrorCode.OK] * BATCH, sorted(set(reply.codes))
        grants.append(len(reply.grants))
        pending = service.put_end(PutEnd(message.keys, [7] * BATCH), now_ms)
        service.finish_put_end(pending, {s: [0] * len(e) for s, e in pending.commits.items()}, now_ms)
        if batch % 28 == 27:  # the server ticks every 200 ms
            service.heartbeat(Heartbeat(["a"]), now_ms)
            service.tick(now_ms)
            acknowledge_drops(service, now_ms)
        extents.append(allocator.free_extent_count)

    def summary(first: int) -> dict:
        chosen = sorted(grants[first : first + window])
        return {
            "grants_per_batch_median": statistics.median(chosen),
            "grants_per_batch_p90": chosen[int(0.9 * window)],
            "free_extents_median": statistics.median(extents[first : first + window]),
            "put_start_us_per_batch": median_us(start_ns[first : first + window]),
        }

    return {
        f"batches_{window}_to_{2 * window}": summary(window),
        f"last_{window}_batches": summary(batches - window),
        "protected_objects_at_end": service._table.policy.protected_count,
        "objects_at_end": service.object_count,
    }


def full_cache_soak() -> dict:
    """One thread putting batches of 128 pages of 4 KiB into a 64 MiB node, after filling it
    twice over: 100 rounds of 48 batches, every put evicting. Puts/s over the first and the
    last 20 rounds, and over the last 20 the CPU time per batch of each process and the pieces
    (grants) per batch."""
    from kvpool.client import store as store_module

    grants: list[int] = []
    put_job = store_module.AsyncStore._put_job

    def counting_put_job(self, message, parts, reply, *rest):  # type: ignore[no-untyped-def]
        grants.append(len(reply.grants))
        return put_job(self, message, parts, reply, *rest)

    rounds, batches_per_round, window = 100, 48, 20
    value = os.urandom(PAGE)
    rates: list[float] = []
    store_module.AsyncStore._put_job = counting_put_job  # type: ignore[method-assign]
    try:
        cluster = LocalCluster(1, "64MiB")
        with cluster, Store(cluster.master_endpoint, token=cluster.client_token) as store:
            processes = cluster_processes(cluster)
            batch = 0

            def put_batches(count: int) -> None:
                nonlocal batch
                for _ in range(count):
                    keys = [f"soak-{batch}-{i}" for i in range(BATCH)]
                    assert store.put_batch(keys, [value] * BATCH) == [ErrorCode.OK] * BATCH
                    batch += 1

            put_batches(2 * 64 * MIB // (BATCH * PAGE))
            for round_index in range(rounds):
                if round_index == rounds - window:
                    cpu_before = {name: process_cpu_ms(pid) for name, pid in processes.items()}
                    grants.clear()
                started = time.perf_counter()
                put_batches(batches_per_round)
                rates.append(BATCH * batches_per_round / (time.perf_counter() - started))
            cpu_after = {name: process_cpu_ms(pid) for name, pid in processes.items()}
    finally:
        store_module.AsyncStore._put_job = put_job  # type: ignore[method-assign]
    batches = window * batches_per_round
    return {
        f"puts_per_s_first_{window}_rounds": round(statistics.median(rates[:window])),
        f"puts_per_s_last_{window}_rounds": round(statistics.median(rates[-window:])),
        "last_rounds_cpu_ms_per_batch": {
            name: round((cpu_after[name] - cpu_before[name]) / batches, 2) for name in processes
        },
        "last_rounds_grants_per_batch_median": statistics.median(grants),
    }


def node_commit() -> dict:
    from kvpool.node.inventory import Inventory
    from kvpool.node.metrics import NodeMetrics
    from kvpool.node.segment import Segment
    from kvpool.node.transfer import MasterCallHandler

    segment = Segment.create("/dev/shm", f"bench-{os.getpid()}", 256 * MIB, b"t" * 16)
    try:
        handler = MasterCallHandler(segment, "s", Inventory(segment.capacity_bytes), NodeMetrics())
        data = os.urandom(4 * KIB)
        checksum = xxhash.xxh3_64_intdigest(data)
        batches = []
        for batch in range(400):
            entries = []
            for i in range(BATCH):
                offset = (batch * BATCH + i) * 4 * KIB
                segment.data[offset : offset + len(data)] = data
                entries.append(InventoryEntry(f"k-{batch}-{i:058d}", offset, len(data), checksum))
            batches.append(entries)
        result = {}
        for name, is_hashed_in_place, chosen in (("", False, batches[0::2]), ("_hashed_in_place", True, batches[1::2])):
            samples = []
            for entries in chosen:
                started = time.perf_counter_ns()
                handler.handle(None, CommitObjects("s", entries, is_hashed_in_place))  # type: ignore[arg-type]
                samples.append((time.perf_counter_ns() - started) // BATCH)
            result[f"commit{name}_us_per_key"] = median_us(samples)
        # A quarter of the keys put again in the free space past the others, before the drops
        # of their old entries (master/server.py sends drops in the background).
        free_start = len(batches) * BATCH * 4 * KIB
        samples = []
        for entries in batches[: len(batches) // 4]:
            moved = [InventoryEntry(x.key, free_start + x.offset, x.size, x.checksum) for x in entries]
            started = time.perf_counter_ns()
            handler.handle(None, CommitObjects("s", moved, True))  # type: ignore[arg-type]
            samples.append((time.perf_counter_ns() - started) // BATCH)
        result["commit_of_keys_put_again_us_per_key"] = median_us(samples)
        result["spans_after_keys_put_again"] = handler.inventory.span_count
        samples = []
        for entries in batches:  # in put order, as LRU eviction drops them
            started = time.perf_counter_ns()
            handler.handle(None, DropObjects("s", entries))  # type: ignore[arg-type]
            samples.append((time.perf_counter_ns() - started) // BATCH)
        result["drop_us_per_key"] = median_us(samples)
        result.update(scattered_commit(handler))
        result["full_collection_ms_1M_entries"] = full_collection_ms()
        return result
    finally:
        segment.close()


def full_collection_ms(count: int = 1 << 20) -> float:
    """A full garbage collection in a process whose node inventory holds `count` objects of
    4 KiB (a 4 GiB segment of KV pages), recorded in runs as commits record them; the
    collector's cost beyond the same collection without them, median of 5. The entries are
    not tracked (msgspec leaves a struct of str and int fields untracked), but the lists of
    the offset index (node/inventory.py spans) are, and a collection visits every entry in
    them."""
    from kvpool.node.inventory import Inventory

    def collection_ms() -> float:
        samples = []
        for _ in range(5):
            started = time.perf_counter()
            gc.collect()
            samples.append((time.perf_counter() - started) * 1000)
        return statistics.median(samples)

    gc.collect()
    empty_ms = collection_ms()
    inventory = Inventory(count * 4 * KIB)
    for start in range(0, count, BATCH):
        inventory.add([InventoryEntry(f"k-{i:062d}", i * 4 * KIB, 4 * KIB, i) for i in range(start, start + BATCH)])
    full_ms = collection_ms()
    del inventory
    return round(full_ms - empty_ms, 1)


def scattered_commit(handler) -> dict:
    """A full 64 MiB inventory of 4 KiB objects; then, 200 times, 128 of them dropped from all
    over it and 128 new keys committed in their places: what a full, fragmented cache asks."""
    handler.inventory.clear()
    slots = 64 * MIB // PAGE
    held = [InventoryEntry(f"held-{i:058d}", i * PAGE, PAGE, 0) for i in range(slots)]
    handler.inventory.add(held)
    rng = random.Random(3)
    commits, drops = [], []
    for round_index in range(200):
        places = sorted(rng.sample(range(slots), BATCH))
        started = time.perf_counter_ns()
        handler.handle(None, DropObjects("s", [held[p] for p in places]))  # type: ignore[arg-type]
        dropped = time.perf_counter_ns()
        new = [InventoryEntry(f"new-{round_index}-{j:054d}", p * PAGE, PAGE, 0) for j, p in enumerate(places)]
        committed = time.perf_counter_ns()
        handler.handle(None, CommitObjects("s", new, True))  # type: ignore[arg-type]
        commits.append((time.perf_counter_ns() - committed) // BATCH)
        drops.append((dropped - started) // BATCH)
        for entry, place in zip(new, places):
            held[place] = entry
    return {
        "commit_scattered_us_per_key": median_us(commits),
        "drop_scattered_us_per_key": median_us(drops),
        "spans_after_scattered": handler.inventory.span_count,
    }


def puts_after_remove() -> dict:
    """Rounds of 128 batches of 128 4 KiB puts through one Store, each round after a
    remove_by_regex of the last round's 16,384 keys, which it puts again: the master sends the
    node their drops while the round's puts commit. The slowest put of each round, and the
    round's rate (medians over rounds after the first)."""
    value = os.urandom(4 * KIB)
    slowest_ms: list[float] = []
    rates: list[float] = []
    with LocalCluster(1, "256MiB") as cluster, Store(cluster.master_endpoint, token=cluster.client_token) as store:
        for round_index in range(9):
            store.remove_by_regex("^again-", force=True)
            times_ns = []
            for b in range(128):
                keys = [f"again-{b}-{i}" for i in range(BATCH)]
                started = time.perf_counter_ns()
                assert store.put_batch(keys, [value] * BATCH) == [0] * BATCH
                times_ns.append(time.perf_counter_ns() - started)
            if round_index:
                slowest_ms.append(max(times_ns) / 1e6)
                rates.append(128 * BATCH / (sum(times_ns) / 1e9))
    return {
        "slowest_put_batch_ms": round(statistics.median(slowest_ms), 1),
        "puts_per_s": round(statistics.median(rates)),
    }


# --- the client ----------------------------------------------------------------------------


def client() -> dict:
    from kvpool.client.sync import _LoopThread
    from kvpool.client.transfer import GetJob

    value = os.urandom(4 * KIB)
    result: dict = {}
    with LocalCluster(1, "512MiB") as cluster:

        async def get_job_work() -> dict:
            async with await AsyncStore.open(cluster.master_endpoint, token=cluster.client_token) as store:
                keys = [f"job-{i}" for i in range(BATCH)]
                await store.put_batch(keys, [value] * BATCH)
                reply = await store._master.call(GetReplicaList(keys), is_idempotent=True)

                def new_job() -> GetJob:
                    return GetJob(reply, [None] * BATCH, 0, store._local_segment, keys, store.directories.find)

                jobs = [new_job() for _ in range(300)]
                return {
                    "get_job_init_us": median_us(timed(new_job, 300)),
                    "get_copy_local_us": median_us(timed(lambda: jobs.pop().copy_local(), 300)),
                }

        result["get_128_keys_same_host"] = uvloop.run(get_job_work())
        # The per-key work of a batch of 4 KiB pages: copy into a segment and hash (a same-host
        # put), and hash alone (a TCP put, a node's commit).
        segment = memoryview(bytearray(BATCH * 4 * KIB))
        pages = [memoryview(os.urandom(4 * KIB)) for _ in range(BATCH)]
        sources = [[page] for page in pages]
        destinations = [[segment[i * 4 * KIB : (i + 1) * 4 * KIB]] for i in range(BATCH)]
        result["copies_checksummed_128x4KiB_us"] = median_us(
            timed(lambda: copies_checksummed(sources, destinations, SIMD_COPY_INTO_SEGMENT_BYTES_MIN), 2000)
        )
        result["checksums_of_128x4KiB_us"] = median_us(timed(lambda: checksums_of([[p] for p in pages]), 2000))

        async def nothing() -> None:
            return None

        loop_thread = _LoopThread.get()
        result["sync_hand_off_us"] = median_us(timed(lambda: loop_thread.run(nothing(), 1_000), 3000))

        async def async_puts() -> float:
            async with await AsyncStore.open(cluster.master_endpoint, token=cluster.client_token) as store:
                samples = []
                for batch in range(150):
                    keys = [f"a-{batch}-{i}" for i in range(BATCH)]
                    started = time.perf_counter_ns()
                    await store.put_batch(keys, [value] * BATCH)
                    samples.append(time.perf_counter_ns() - started)
                return BATCH / (statistics.median(samples) / 1e9)

        collector_runs: list[int] = []

        def count_runs(phase: str, info: dict) -> None:
            if phase == "start":
                collector_runs.append(info["generation"])

        def sync_puts(shm_enabled: bool) -> float:
            with Store(cluster.master_endpoint, token=cluster.client_token, shm_enabled=shm_enabled) as store:
                samples = []
                for batch in range(150):
                    if batch == 50 and shm_enabled:  # the client's garbage collector, 100 batches
                        collector_runs.clear()
                        gc.callbacks.append(count_runs)
                    keys = [f"s-{shm_enabled}-{batch}-{i}" for i in range(BATCH)]
                    samples.append(timed(lambda keys=keys: store.put_batch(keys, [value] * BATCH), 1)[0])
                if shm_enabled:
                    gc.callbacks.remove(count_runs)
                return BATCH / (statistics.median(samples) / 1e9)

        result["puts_4KiB_batch128_per_s"] = {
            "async_store": round(uvloop.run(async_puts())),
            "store": round(sync_puts(True)),
            "store_tcp_only": round(sync_puts(False)),
        }
        result["collector_runs_in_100_same_host_put_batches"] = len(collector_runs)
        result["zero_copy_same_host_gets"] = zero_copy_page_gets(
            cluster.master_endpoint, count_runs, collector_runs
        )
        result["gets_over_tcp"] = tcp_gets(cluster.master_endpoint)
    return result


def zero_copy_page_gets(master: str, count_runs, collector_runs: list[int]) -> dict:
    """Batches of 128 zero-copy gets of 4 KiB pages from a same-host node into one registered
    array (an engine's KV pages): objects/s, and how often the client's garbage collector ran
    in 100 of those batches (`count_runs` appends to `collector_runs`)."""
    with Store(master, token="") as store:  # a local cluster's: no token
        source = np.random.randint(0, 255, BATCH * 4 * KIB, dtype=np.uint8)
        target = np.zeros_like(source)
        keys = [f"zc-page-{i}" for i in range(BATCH)]
        source_at, target_at = store.register_buffer(source), store.register_buffer(target)
        store.batch_put_from(keys, [source_at + i * 4 * KIB for i in range(BATCH)], [4 * KIB] * BATCH)
        addresses = [target_at + i * 4 * KIB for i in range(BATCH)]
        get = answering(lambda: store.batch_get_into(keys, addresses, [4 * KIB] * BATCH), [4 * KIB] * BATCH)
        timed(get, 20)  # warm-up
        collector_runs.clear()
        gc.callbacks.append(count_runs)
        samples = timed(get, 100)
        gc.callbacks.remove(count_runs)
        assert np.array_equal(source, target), "zero-copy get returned other bytes"
        per_s = round(BATCH / (statistics.median(samples) / 1e9))
        return {"objects_per_s": per_s, "collector_runs_in_100_batches": len(collector_runs)}


def tcp_gets(master: str) -> dict:
    """Batches of 128 gets through a Store with shm off: plain gets of 4 KiB pages (objects/s),
    and zero-copy gets of 4 KiB and 64 KiB objects laid out back to back in one registered
    array (GB/s), as an engine's KV pages are."""
    out: dict = {}
    with Store(master, token="", shm_enabled=False) as store:
        keys = [f"tcp-get-{i}" for i in range(BATCH)]
        values = [os.urandom(4 * KIB) for _ in keys]
        store.put_batch(keys, values)
        samples = timed(answering(lambda: store.get_batch(keys), values), 200)
        out["plain_4KiB_per_s"] = round(BATCH / (statistics.median(samples) / 1e9))
        for size in (4 * KIB, 64 * KIB):
            source = np.random.randint(0, 255, size * BATCH, dtype=np.uint8)
            target = np.zeros_like(source)
            keys = [f"tcp-zc-{size}-{i}" for i in range(BATCH)]
            base_in, base_out = store.register_buffer(source), store.register_buffer(target)
            store.batch_put_from(keys, [base_in + i * size for i in range(BATCH)], [size] * BATCH)
            addresses = [base_out + i * size for i in range(BATCH)]
            sizes = [size] * BATCH
            samples = timed(answering(lambda: store.batch_get_into(keys, addresses, sizes), sizes), 100)
            assert np.array_equal(source, target), "zero-copy get returned other bytes"
            out[f"zero_copy_{size // KIB}KiB_gbps"] = round(size * BATCH / (statistics.median(samples) / 1e9) / 1e9, 3)
            store.unregister_buffer(base_in)
            store.unregister_buffer(base_out)
    return out


# --- phases of a same-host put -----------------------------------------------------------


def put_phases() -> dict:
    size, keys_per_batch, batches, rounds = MIB, 32, 8, 6
    source = np.random.randint(0, 255, size * keys_per_batch * batches, dtype=np.uint8)
    target = np.empty(size * keys_per_batch, dtype=np.uint8)
    numpy_ns = timed(lambda: np.copyto(target, source[: len(target)]), 20)

    def spans(store: AsyncStore, base: int, round_index: int) -> list:
        out = []
        for b in range(batches):
            keys = [f"phase-{round_index}-{b}-{i}" for i in range(keys_per_batch)]
            addresses = [base + (b * keys_per_batch + i) * size for i in range(keys_per_batch)]
            out.append((keys, [[store.buffers.view(address, size)] for address in addresses]))
        return out

    def summary(samples: dict[str, list[int]]) -> dict:
        return {f"{phase}_us": median_us(ns) for phase, ns in samples.items()}

    def through_store(master: str, **options) -> dict:
        samples: dict[str, list[int]] = {"put_start": [], "copy": [], "put_end": []}
        with Store(master, token="", **options) as store:
            base = store.register_buffer(source)
            for round_index in range(rounds):
                for keys, views in spans(store._async, base, round_index):
                    began = time.perf_counter_ns()
                    job = store._run(store._async._put_start(keys, views, None))
                    copied = time.perf_counter_ns()
                    job.copy_local()
                    ended = time.perf_counter_ns()
                    assert store._run(store._async._put_finish(job)) == [0] * keys_per_batch
                    if round_index:  # the first round maps the segment and warms up
                        samples["put_start"].append(copied - began)
                        samples["copy"].append(ended - copied)
                        samples["put_end"].append(time.perf_counter_ns() - ended)
                store.remove_all(force=True)
        return summary(samples)

    async def through_async_store(master: str, **options) -> dict:
        samples: dict[str, list[int]] = {"put_start": [], "copy": [], "put_end": []}
        async with await AsyncStore.open(master, token="", **options) as store:
            base = store.register_buffer(source)
            for round_index in range(rounds):
                for keys, views in spans(store, base, round_index):
                    began = time.perf_counter_ns()
                    job = await store._put_start(keys, views, None)
                    copied = time.perf_counter_ns()
                    job.copy_local()
                    ended = time.perf_counter_ns()
                    assert await store._put_finish(job) == [0] * keys_per_batch
                    if round_index:
                        samples["put_start"].append(copied - began)
                        samples["copy"].append(ended - copied)
                        samples["put_end"].append(time.perf_counter_ns() - ended)
                await store.remove_all(force=True)
        return summary(samples)

    result: dict = {"numpy_copy_32MiB_us": median_us(numpy_ns)}
    with LocalCluster(1, "512MiB") as cluster:
        result["node_process"] = {
            "store": through_store(cluster.master_endpoint),
            "async_store": uvloop.run(through_async_store(cluster.master_endpoint)),
        }
    with LocalCluster(0, "64MiB") as cluster:
        embedded = {"embedded_memory_bytes": 512 * MIB}
        result["one_process"] = {
            "store": through_store(cluster.master_endpoint, **embedded),
            "async_store": uvloop.run(through_async_store(cluster.master_endpoint, **embedded)),
        }
    return result


# --- landing of plain gets ---------------------------------------------------------------


def tcp_transfers() -> dict:
    from bench_core import socket_pair_gbps

    size, keys_per_batch, batches, rounds = MIB, 32, 8, 6
    total = size * keys_per_batch * batches
    source = np.random.randint(0, 255, total, dtype=np.uint8)
    target = np.zeros_like(source)

    samples: dict[str, list[float]] = {}
    cluster = LocalCluster(1, f"{total // MIB + 64}MiB")
    with cluster, Store(cluster.master_endpoint, token=cluster.client_token, shm_enabled=False) as store:
        processes = cluster_processes(cluster)
        sources, targets = store.register_buffer(source), store.register_buffer(target)
        batch_keys = [[f"tcp-{b}-{i}" for i in range(keys_per_batch)] for b in range(batches)]
        offsets = [[(b * keys_per_batch + i) * size for i in range(keys_per_batch)] for b in range(batches)]
        sizes = [size] * keys_per_batch

        def put_all() -> None:
            for keys, at in zip(batch_keys, offsets):
                assert store.batch_put_from(keys, [sources + o for o in at], sizes) == [0] * keys_per_batch

        def get_all() -> None:
            for keys, at in zip(batch_keys, offsets):
                assert store.batch_get_into(keys, [targets + o for o in at], sizes) == sizes

        def measure(name: str, action) -> None:
            elapsed, used_ms = timed_with_cpu(processes, action)
            samples.setdefault(f"{name}_gbps", []).append(total / elapsed / 1e9)
            for p, ms in used_ms.items():
                samples.setdefault(f"{name}_cpu_ms_per_batch_{p}", []).append(ms / batches)

        for _ in range(rounds + 1):  # the first round opens connections and faults pages in
            samples.setdefault("socket_pair_gbps", []).append(socket_pair_gbps(total))
            measure("put", put_all)
            measure("get", get_all)
            assert np.array_equal(source, target), "zero-copy get returned other bytes"
            target.fill(0)  # so that the next round's gets are checked too, not the first's
            store.remove_all(force=True)
    return {name: round(statistics.median(values[1:]), 2) for name, values in samples.items()}


def page_gets() -> dict:
    """A working set of 48 batches of 128 pages of 4 KiB (bench_core's), read round and round
    through one Store on the same host, in a node with room to spare: objects/s and each
    process's CPU per batch (/proc schedstat). Every read after the first round reads a
    protected object; every one read again once protected holds its share of the table."""
    batches, rounds = 48, 8
    value = os.urandom(4096)
    samples: dict[str, list[float]] = {}
    with LocalCluster(1, "512MiB") as cluster, Store(cluster.master_endpoint, token=cluster.client_token) as store:
        processes = cluster_processes(cluster)
        batch_keys = [[f"page-{b}-{i}" for i in range(128)] for b in range(batches)]
        for keys in batch_keys:
            assert store.put_batch(keys, [value] * 128) == [ErrorCode.OK] * 128

        def get_all() -> None:
            for keys in batch_keys:
                assert store.get_batch(keys) == [value] * len(keys), "a get missed or read wrong"

        for _ in range(rounds + 1):  # the first round promotes every page
            elapsed, used_ms = timed_with_cpu(processes, get_all)
            samples.setdefault("get_objects_per_s", []).append(128 * batches / elapsed)
            for p, ms in used_ms.items():
                samples.setdefault(f"get_cpu_ms_per_batch_{p}", []).append(ms / batches)
    return {name: round(statistics.median(values[1:]), 3) for name, values in samples.items()}


def pieces() -> dict:
    """Gets and puts through one sync Store from one thread, each batch in pieces whose
    requests leave at once (client/store.py batch_pieces: the master looks up or allocates the
    next piece while the caller copies the last) against one request per batch, alternating
    round by round (the order too): objects/s (medians of 8 rounds) and the median of the
    per-round ratios. 4 KiB pages on the same host: gets in batches of 128 (two pieces of 64,
    and four of 32) and 512 (eight of 64), puts in batches of 512; and what batches of 128 that
    go whole would do in two pieces: gets of 4 KiB pages over TCP (shm off) and of 64 KiB
    objects, puts of 4 KiB pages. Puts write fresh keys, removed after each round. Then
    AsyncStore's gets of 4 KiB pages in batches of 128 and 512."""
    from kvpool.client import store as store_module
    from kvpool.client import sync

    rounds = 8
    in_pieces = store_module.batch_pieces
    ways = {  # the settings of client/sync.py each way runs with
        "pieces": {},
        "pieces_of_32": {"PIECE_KEYS_MIN": 32},
        "one_request": {"PIECES_MAX": 1},
        "forced_pieces": {
            "PIECE_OBJECT_BYTES_MAX": 1 << 30,
            "PIECES_MAX": 4,
            "batch_pieces": lambda count, size, _, __: in_pieces(count, size, True, 2),
        },
    }
    cases = {  # name: get or put, object size, batch, shm, the ways compared (the last the baseline)
        "get_4KiB_x128": ("get", 4 * KIB, 128, True, ("pieces", "pieces_of_32", "one_request")),
        "get_4KiB_x512": ("get", 4 * KIB, 512, True, ("pieces", "one_request")),
        "get_4KiB_x128_tcp": ("get", 4 * KIB, 128, False, ("forced_pieces", "one_request")),
        "get_64KiB_x128": ("get", 64 * KIB, 128, True, ("forced_pieces", "one_request")),
        "put_4KiB_x128": ("put", 4 * KIB, 128, True, ("forced_pieces", "one_request")),
        "put_4KiB_x512": ("put", 4 * KIB, 512, True, ("pieces", "one_request")),
    }
    result: dict[str, float] = {}
    with LocalCluster(1, "1GiB") as cluster:
        for case, (op, size, batch, shm, compared) in cases.items():
            value = os.urandom(size)
            batch_count = max(4, 6144 // batch)
            with Store(cluster.master_endpoint, token=cluster.client_token, shm_enabled=shm) as store:
                if op == "get":
                    batch_keys = [[f"{case}-{b}-{i}" for i in range(batch)] for b in range(batch_count)]
                    for keys in batch_keys:
                        assert store.put_batch(keys, [value] * batch) == [ErrorCode.OK] * batch
                rates: dict[str, list[float]] = {way: [] for way in compared}
                for round_index in range(rounds + 1):  # the first round warms up
                    for way in compared if round_index % 2 else compared[::-1]:
                        if op == "put":
                            batch_keys = [[f"{case}-{way}-{round_index}-{b}-{i}" for i in range(batch)]
                                          for b in range(batch_count)]  # fmt: skip
                        # The settings live in store.py; sync.py holds its own name for batch_pieces.
                        saved = [(module, name, getattr(module, name)) for name in ways[way]
                                 for module in (store_module, sync) if hasattr(module, name)]  # fmt: skip
                        for module, name, _ in saved:
                            setattr(module, name, ways[way][name])
                        try:
                            started = time.perf_counter()
                            for keys in batch_keys:
                                if op == "get":
                                    assert store.get_batch(keys) == [value] * len(keys), "a get missed or read wrong"
                                else:
                                    assert store.put_batch(keys, [value] * batch) == [ErrorCode.OK] * batch
                            rates[way].append(batch * batch_count / (time.perf_counter() - started))
                        finally:
                            for module, name, setting in saved:
                                setattr(module, name, setting)
                        if op == "put":
                            store.remove_all(force=True)
                store.remove_all(force=True)
            *others, baseline = compared
            for way in compared:
                result[f"{case}_{way}_objects_per_s"] = round(statistics.median(rates[way][1:]))
            for way in others:
                ratios = [a / b for a, b in zip(rates[way][1:], rates[baseline][1:])]
                result[f"{case}_{way}_over_{baseline}"] = round(statistics.median(ratios), 3)
        for batch in (128, 512):
            rates = asyncio.run(async_get_rates(cluster.master_endpoint, batch, rounds, store_module))
            ratios = [a / b for a, b in zip(rates["pieces"][1:], rates["one_request"][1:])]
            case = f"async_get_4KiB_x{batch}"
            for way, values in rates.items():
                result[f"{case}_{way}_objects_per_s"] = round(statistics.median(values[1:]))
            result[f"{case}_pieces_over_one_request"] = round(statistics.median(ratios), 3)
    return result


def caller_thread() -> dict:
    """A sync Store's transfers over TCP (shm off) from the calling thread's own connections
    (client/node_links.py) against through the loop thread, toggled round by round in one
    cluster (the order too): 4 KiB pages in batches of 128, gets and puts (fresh keys, removed
    after each round), with one node and with two (each batch's gets half on each node, its
    puts a replica on each); objects/s (medians of 10 rounds) and the median and range of the
    per-round ratios."""
    rounds, batch, batch_count = 10, 128, 24
    value = os.urandom(4 * KIB)
    result: dict[str, object] = {}
    for node_count in (1, 2):
        with LocalCluster(node_count, "512MiB") as cluster:
            with Store(cluster.master_endpoint, token=cluster.client_token, shm_enabled=False) as store:
                own_read, own_write = store._nodes.read, store._nodes.write
                segments = [node.info["segment_id"] for node in cluster.nodes]
                get_keys = []
                for b in range(batch_count):
                    keys = [f"get-{b}-{i}" for i in range(batch)]
                    for n, segment in enumerate(segments):  # a share of each batch on each node
                        share = keys[n::node_count]
                        config = ReplicateConfig(placement="preferred", preferred_segments=[segment])
                        assert store.put_batch(share, [value] * len(share), config) == [ErrorCode.OK] * len(share)
                    get_keys.append(keys)
                for op in ("get", "put"):
                    rates: dict[str, list[float]] = {"caller_thread": [], "loop": []}
                    for round_index in range(rounds + 1):  # the first round warms up
                        for way in ("caller_thread", "loop") if round_index % 2 else ("loop", "caller_thread"):
                            is_own = way == "caller_thread"
                            store._nodes.read = own_read if is_own else lambda job: False
                            store._nodes.write = own_write if is_own else lambda batches: None
                            started = time.perf_counter()
                            for b, keys in enumerate(get_keys):
                                if op == "get":
                                    assert store.get_batch(keys) == [value] * len(keys), "a get missed or read wrong"
                                else:
                                    fresh = [f"put-{round_index}-{way}-{b}-{i}" for i in range(batch)]
                                    replicas = ReplicateConfig(replica_num=node_count)
                                    assert store.put_batch(fresh, [value] * batch, replicas) == [ErrorCode.OK] * batch
                            rates[way].append(batch * batch_count / (time.perf_counter() - started))
                            if op == "put":
                                store.remove_by_regex("^put-", force=True)
                    ratios = [a / b for a, b in zip(rates["caller_thread"][1:], rates["loop"][1:])]
                    case = f"{op}_4KiB_x{batch}_{node_count}_node{'s' if node_count > 1 else ''}"
                    result[f"{case}_caller_thread_objects_per_s"] = round(statistics.median(rates["caller_thread"][1:]))
                    result[f"{case}_loop_objects_per_s"] = round(statistics.median(rates["loop"][1:]))
                    result[f"{case}_ratio_median"] = round(statistics.median(ratios), 3)
                    result[f"{case}_ratio_range"] = [round(min(ratios), 2), round(max(ratios), 2)]
                store._nodes.read, store._nodes.write = own_read, own_write
    return result


async def async_get_rates(master: str, batch: int, rounds: int, store_module) -> dict[str, list[float]]:
    """`pieces` for AsyncStore: 4 KiB gets in batches of `batch`, in pieces and in one request
    alternating round by round (the first round warms up)."""
    value = os.urandom(4 * KIB)
    rates: dict[str, list[float]] = {"pieces": [], "one_request": []}
    async with await AsyncStore.open(master, token="") as store:
        batch_keys = [[f"async-{batch}-{b}-{i}" for i in range(batch)] for b in range(max(4, 6144 // batch))]
        for keys in batch_keys:
            assert await store.put_batch(keys, [value] * batch) == [ErrorCode.OK] * batch
        for round_index in range(rounds + 1):
            for way in ("pieces", "one_request") if round_index % 2 else ("one_request", "pieces"):
                saved = store_module.PIECES_MAX
                store_module.PIECES_MAX = 1 if way == "one_request" else saved
                try:
                    started = time.perf_counter()
                    for keys in batch_keys:
                        assert (await store.get_batch(keys)) == [value] * len(keys), "a get missed or read wrong"
                    rates[way].append(batch * len(batch_keys) / (time.perf_counter() - started))
                finally:
                    store_module.PIECES_MAX = saved
        await store.remove_all(force=True)
    return rates


def landing() -> dict:
    from kvpool.client.transfer import _new_bytes

    source = memoryview(os.urandom(4 * MIB))

    def in_place() -> bytes:
        data, view = _new_bytes(len(source))
        view[:] = source
        return data

    def via_bytearray() -> bytes:
        buffer = bytearray(len(source))
        buffer[:] = source
        return bytes(buffer)

    def sixteen(fill) -> None:
        for _ in range(16):  # one result alive at a time, as a caller that drops each one
            fill()

    out = {}
    for name, fill in (("bytes_in_place", in_place), ("bytearray_then_bytes", via_bytearray)):
        samples = timed(lambda fill=fill: sixteen(fill), 10)
        out[f"{name}_gbps"] = round(16 * len(source) / statistics.median(samples), 2)
    for name, tunables in (("default", None), ("tunables", KEEP_FREED_MEMORY)):
        env = {**os.environ, **({"GLIBC_TUNABLES": tunables} if tunables else {})}
        child = subprocess.run(
            [sys.executable, __file__, "_same-host-plain-gets"], env=env, capture_output=True, text=True, check=True
        )
        out[f"same_host_plain_get_4MiB_{name}_gbps"] = json.loads(child.stdout)
    out["tunables"] = KEEP_FREED_MEMORY
    out["fill_fresh_32MiB_ms"] = fill_fresh_bytes_ms(32 * MIB)
    out["same_host_plain_gets_populated"] = plain_gets_populated()
    return out


def plain_gets_populated(rounds: int = 5) -> dict:
    """Same-host plain gets of 64 MiB in batches of 32 MiB, each run's results kept until it
    ends (as bench_peers.py keeps them: every bytes object is fresh memory), with the copying
    threads populating each object first (page_advice.populate) and without, alternating:
    GB/s, medians over the rounds, and the median of the per-round ratios."""
    from kvpool import page_advice

    out: dict = {}
    with LocalCluster(1, "200MiB") as cluster, Store(cluster.master_endpoint, token=cluster.client_token) as store:
        for size in (MIB, 4 * MIB):
            keys = [f"pop-{size}-{i}" for i in range(64 * MIB // size)]
            batch = 32 * MIB // size
            store.put_batch(keys, [os.urandom(size)] * len(keys))
            rates: dict[str, list[float]] = {"faulted": [], "populated": []}
            saved = page_advice.POPULATE_BYTES_MIN
            try:
                for _ in range(rounds + 1):  # the first round warms up
                    for name, populate_min in (("faulted", 1 << 62), ("populated", saved)):
                        page_advice.POPULATE_BYTES_MIN = populate_min
                        kept = []
                        started = time.perf_counter()
                        for start in range(0, len(keys), batch):
                            kept.extend(store.get_batch(keys[start : start + batch]))
                        rates[name].append(len(keys) * size / (time.perf_counter() - started) / 1e9)
                        assert all(len(value) == size for value in kept)
                        del kept
            finally:
                page_advice.POPULATE_BYTES_MIN = saved
            row = {f"{name}_gbps": round(statistics.median(r[1:]), 2) for name, r in rates.items()}
            ratios = [p / f for f, p in zip(rates["faulted"][1:], rates["populated"][1:])]
            row["populated_vs_faulted"] = round(statistics.median(ratios), 2)
            out[f"{size // MIB}MiB"] = row
    return out


def fill_fresh_bytes_ms(size: int) -> dict:
    """Filling a new bytes object of `size` bytes, as a plain get's landing (glibc maps a block
    this large anew each time): in 4 KiB pages, and with transparent huge pages advised."""
    from kvpool.client import transfer

    source = np.random.randint(0, 255, size, dtype=np.uint8)
    out = {}
    for name, huge_min in (("4KiB_pages", 1 << 62), ("huge_pages", transfer.HUGE_PAGES_BYTES_MIN)):
        saved, transfer.HUGE_PAGES_BYTES_MIN = transfer.HUGE_PAGES_BYTES_MIN, huge_min
        try:

            def fill() -> None:
                _, view = transfer._new_bytes(size)
                np.frombuffer(view, dtype=np.uint8)[:] = source

            out[name] = round(statistics.median(timed(fill, 15)) / 1e6, 2)
        finally:
            transfer.HUGE_PAGES_BYTES_MIN = saved
    return out


KEEP_FREED_MEMORY = "glibc.malloc.mmap_threshold=67108864:glibc.malloc.trim_threshold=268435456"


def same_host_plain_gets() -> float:
    with LocalCluster(1, "200MiB") as cluster, Store(cluster.master_endpoint, token=cluster.client_token) as store:
        keys = [f"p{i}" for i in range(16)]
        value = os.urandom(4 * MIB)
        store.put_batch(keys, [value] * 16)
        store.get_batch(keys[:8])
        samples = []
        for _ in range(10):
            started = time.perf_counter_ns()
            got = [store.get_batch(keys[s : s + 8]) for s in (0, 8)]
            samples.append(time.perf_counter_ns() - started)
            assert got == [[value] * 8] * 2, "a get missed or read wrong"  # checked untimed: 64 MiB
        return round(16 * 4 * MIB / statistics.median(samples), 2)


# --- same-host copies ----------------------------------------------------------------------


def copies() -> dict:
    """32 objects of 1 MiB out of page-aligned memory (a segment) into a numpy array whose
    data starts 16 bytes past a page, as a same-host get into a registered buffer does."""
    from kvpool import checksums

    count, size, chunk = 32, MIB, checksums.COPY_CHUNK_BYTES
    segment = np.frombuffer(mmap.mmap(-1, count * size), dtype=np.uint8)
    segment[:] = np.random.default_rng(0).integers(0, 255, count * size, dtype=np.uint8)
    landing = np.zeros(count * size + 2 * PAGE, dtype=np.uint8)
    page_start = -landing.__array_interface__["data"][0] % PAGE

    def target_at(shift: int) -> np.ndarray:
        return landing[page_start + shift : page_start + shift + count * size]

    def chunked(target: np.ndarray, copy) -> None:
        for at in range(0, count * size, chunk):
            copy(segment[at : at + chunk], target[at : at + chunk])

    target = target_at(16)
    views = [memoryview(target)[i * size : (i + 1) * size] for i in range(count)]
    sources = [memoryview(segment)[i * size : (i + 1) * size] for i in range(count)]
    pairs = list(zip(sources, views))

    def numpy_copy() -> None:  # the limit: whole objects, no hash
        for i in range(count):
            np.copyto(target[i * size : (i + 1) * size], segment[i * size : (i + 1) * size])

    def copy_then_hash() -> None:  # the previous same-host get: copy every object, then hash
        for source, view in zip(sources, views):
            view[:] = source
        checksums.checksums_of([[view] for view in views])

    # A put of KV pages laid out one part per layer: 64 parts of 16 KiB per object, into the
    # segment, the previous way (memcpy each part, then hash the object) and now.
    layers = [[memoryview(target)[i * size + j * 16 * KIB :][: 16 * KIB] for j in range(64)] for i in range(count)]
    into_segment = [memoryview(segment)[i * size : (i + 1) * size] for i in range(count)]
    # ... and 16 parts of 64 KiB: memcpy (what puts do) against numpy's copy (what gets do)
    sixteenths = [[memoryview(target)[i * size + j * 64 * KIB :][: 64 * KIB] for j in range(16)] for i in range(count)]

    def put_parts(parts_of: list, simd_bytes_min: int) -> None:
        checksums.copies_checksummed(parts_of, [[d] for d in into_segment], simd_bytes_min)

    def layers_copy_then_hash() -> None:
        for parts, destination in zip(layers, into_segment):
            at = 0
            for part in parts:
                destination[at : at + len(part)] = part
                at += len(part)
            xxhash.xxh3_64_intdigest(destination)

    sources, destinations = [[s] for s, _ in pairs], [[v] for _, v in pairs]
    cases = {
        "numpy_copy_1MiB": numpy_copy,
        "memcpy_256KiB_dst_16_past_src": lambda: chunked(target, lambda a, b: np.copyto(b, a)),
        "memcpy_256KiB_dst_64_past_src": lambda: chunked(target_at(64), lambda a, b: np.copyto(b, a)),
        "simd_256KiB_dst_16_past_src": lambda: chunked(target, lambda a, b: np.positive(a, out=b)),
        "copy_then_hash": copy_then_hash,
        "copy_and_hash_in_chunks_1_thread": lambda: [checksums.copy_checksummed([s], [v]) for s, v in pairs],
        "copy_and_hash_in_chunks_2_threads": lambda: checksums.copies_checksummed(sources, destinations),
        "put_64_layers_of_16KiB_copy_then_hash": layers_copy_then_hash,
        "put_64_layers_of_16KiB_now": lambda: put_parts(layers, checksums.SIMD_COPY_INTO_SEGMENT_BYTES_MIN),
        "put_16_parts_of_64KiB_memcpy": lambda: put_parts(sixteenths, checksums.SIMD_COPY_INTO_SEGMENT_BYTES_MIN),
        "put_16_parts_of_64KiB_simd": lambda: put_parts(sixteenths, 64 * KIB),
    }
    out = {}
    for name, action in cases.items():
        samples = timed(action, 15)
        out[f"{name}_gbps"] = round(count * size / statistics.median(samples), 2)
    return out


# --- payload alignment --------------------------------------------------------------------


def payload_alignment() -> dict:
    import ctypes

    from kvpool.protocol.frames import buffer_address, encode_frame, payload_padding
    from kvpool.protocol.messages import ReadReply

    size = 64 * KIB
    source = np.random.default_rng(0).integers(0, 255, size + 2 * PAGE, dtype=np.uint8)
    target = np.zeros_like(source)
    source_page = -source.ctypes.data % PAGE
    target_page = -target.ctypes.data % PAGE
    out = {}
    for shift in (0, 16, 32, 48, 64):
        src, dst = source.ctypes.data + source_page, target.ctypes.data + target_page + shift
        samples = timed(lambda: ctypes.memmove(dst, src, size), 2000)
        out[f"memcpy_64KiB_dst_{shift}_past_src_gbps"] = round(size / statistics.median(samples), 2)

    frame_bytes = 4 * MIB  # kvpool's frames (client/transfer.py FRAME_BYTES_TARGET)
    # A zero-copy put: from the caller's numpy array (data 16 bytes past a page) into a
    # page-aligned segment. The control message of 128 write items is some 11 KiB; its length
    # modulo 4 KiB varies with the keys' grants (21 in bench_peers' 64 KiB rows, 5 bytes past
    # the source: the slow case). The kernel copies payload bytes, so a header of zeros of the
    # same length stands for it.
    array = np.random.default_rng(1).integers(0, 255, frame_bytes + 2 * PAGE, dtype=np.uint8)
    put_source = memoryview(array)[-array.ctypes.data % PAGE + 16 :][:frame_bytes]
    # A node's reply to a get: from page-aligned segment memory into such an array.
    segment = np.frombuffer(mmap.mmap(-1, frame_bytes + PAGE), dtype=np.uint8)
    segment[:] = 1
    get_source = memoryview(segment)[PAGE:]
    reply_bytes = len(encode_frame(ReadReply(frame_bytes), 1, is_reply=True, payload_size=frame_bytes))
    cases = {  # name: (header bytes, payload, where it lands modulo a page)
        "put_header_21": (2 * PAGE + 21, put_source, 0),
        "put_header_80": (2 * PAGE + 80, put_source, 0),
        "get_reply": (reply_bytes, get_source, 16),
    }
    for name, (header_bytes, payload, landing) in cases.items():
        padding = payload_padding(header_bytes, buffer_address(payload), landing)
        headers = {"as_encoded": bytes(header_bytes), "padded": bytes(header_bytes + padding)}
        rates: dict[str, list[float]] = {label: [] for label in headers}
        for _ in range(7):
            for label, header in headers.items():
                rates[label].append(frames_over_tcp(header, payload, landing, 32))
        for label, values in rates.items():
            out[f"tcp_{name}_{label}_gbps"] = round(statistics.median(values), 2)
        out[f"tcp_{name}_padding_bytes"] = padding
    return out


def frames_over_tcp(header: bytes, payload: memoryview, landing_page_offset: int, count: int) -> float:
    """GB/s of `count` frames (header, payload) to a receiver process that lands each payload
    at `landing_page_offset` of a page and answers one byte per frame."""
    ours, theirs = connected_pair(socket.AF_INET)
    pid = os.fork()
    if pid == 0:
        ours.close()
        sink = np.zeros(len(payload) + 2 * PAGE, dtype=np.uint8)
        landing = memoryview(sink)[-sink.ctypes.data % PAGE + landing_page_offset :][: len(payload)]
        head = memoryview(bytearray(len(header)))
        for _ in range(count):
            for view in (head, landing):
                got = 0
                while got < len(view):
                    got += theirs.recv_into(view[got:])
            theirs.send(b"k")
        os._exit(0)
    theirs.close()
    started = time.perf_counter()
    for _ in range(count):
        sent = ours.sendmsg([header, payload])  # a blocking socket sends it whole
        assert sent == len(header) + len(payload), sent
        ours.recv(1)
    elapsed = time.perf_counter() - started
    ours.close()
    os.waitpid(pid, 0)
    return count * len(payload) / elapsed / 1e9


# --- reading object files ----------------------------------------------------------------


def files_read() -> dict:
    """64 files of 4 MiB read cold, each way once per round in turn (medians of 5 rounds),
    next to one file of the same 256 MiB read the same ways: whether one file per object
    costs anything against one long file (ratios per round, then the median)."""
    count, size = 64, 4 * MIB
    with tempfile.TemporaryDirectory(dir=".") as directory:
        from kvpool.transports import files as object_files

        names = [f"f{i}" for i in range(count)]
        paths = [Path(directory) / name for name in names]
        one_file = Path(directory) / "one"
        data = os.urandom(size)
        for name in names:  # object files (a page of header, then the bytes), synced
            object_files.write_object(Path(directory), name, name, 0, [memoryview(data)], is_durable=True)
        _write_synced(one_file, [data] * count)
        buffers = [bytearray(size) for _ in range(count)]
        aligned = [mmap.mmap(-1, size) for _ in range(count)]
        array = np.zeros(count * size + 2 * PAGE, dtype=np.uint8)  # a numpy target, 16 bytes past a page
        array_views = [memoryview(array)[16 + i * size : 16 + (i + 1) * size] for i in range(count)]

        def evict(files: list[Path]) -> None:
            for path in files:
                fd = os.open(path, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)

        def read(i: int, flags: int, target) -> None:
            fd = os.open(paths[i], os.O_RDONLY | flags)
            try:
                os.preadv(fd, [target[i]], 4 * KIB)
            finally:
                os.close(fd)

        def read_object(i: int) -> None:
            object_files.read_object_into(paths[i], names[i], size, [array_views[i]])

        def files(threads: int, willneed: bool, read_one: Callable[[int], None]) -> Callable[[], None]:
            def run() -> None:
                evict(paths)
                if willneed:
                    for path in paths:
                        object_files.prefetch(path)
                with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                    list(pool.map(read_one, range(count)))

            return run

        def one(flags: int, target) -> Callable[[], None]:
            def run() -> None:
                evict([one_file])
                fd = os.open(one_file, os.O_RDONLY | flags)
                try:
                    for i in range(count):
                        os.preadv(fd, [target[i]], i * size)
                finally:
                    os.close(fd)

            return run

        cases = {
            "buffered_1_thread": files(1, False, lambda i: read(i, 0, buffers)),
            "buffered_4_threads_willneed": files(4, True, lambda i: read(i, 0, buffers)),
            "o_direct_1_thread": files(1, False, lambda i: read(i, os.O_DIRECT, aligned)),
            "o_direct_4_threads": files(4, False, lambda i: read(i, os.O_DIRECT, aligned)),
            # as the disk tier's same-host reads go, into a numpy array
            "objects_4_threads_willneed": files(4, True, read_object),
            "one_file_buffered": one(0, buffers),
            "one_file_o_direct": one(os.O_DIRECT, aligned),
        }
        rates: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(5):
            for name, run in cases.items():
                started = time.perf_counter()
                run()
                rates[name].append(count * size / (time.perf_counter() - started) / 1e9)
        out: dict = {f"{name}_gbps": round(statistics.median(values), 2) for name, values in rates.items()}
        out["gbps_rounds"] = {name: [round(rate, 2) for rate in values] for name, values in rates.items()}
        for ours, theirs in (
            ("o_direct_1_thread", "one_file_o_direct"),
            ("buffered_1_thread", "one_file_buffered"),
            ("o_direct_4_threads", "one_file_o_direct"),
            ("objects_4_threads_willneed", "one_file_o_direct"),
        ):
            ratios = [a / b for a, b in zip(rates[ours], rates[theirs])]
            out[f"{ours}_vs_{theirs}"] = round(statistics.median(ratios), 2)
        out.update(warm_object_reads(Path(directory)))
        return out


def _write_synced(path: Path, parts: list[bytes]) -> None:
    """Write and fsync, so that POSIX_FADV_DONTNEED can drop every page (dirty ones stay)."""
    with path.open("wb") as file:
        for part in parts:
            file.write(part)
        file.flush()
        os.fsync(file.fileno())


def warm_object_reads(directory: Path) -> dict:
    """64 object files of 4 MiB, in the page cache, read on four threads into one numpy
    array as a same-host zero-copy get does: preadv straight into the array (its data 16
    bytes past a page, the kernel's slow offset from the file's pages) and into a page-aligned
    one, and through files.read_object_into (a bounce buffer for the first)."""
    from kvpool.protocol import objectfile
    from kvpool.transports import files

    count, size = 64, 4 * MIB
    data = np.random.default_rng(2).integers(0, 255, size, dtype=np.uint8)
    names = [f"object-{i}" for i in range(count)]
    for name in names:
        files.write_object(directory, name, name, xxhash.xxh3_64_intdigest(data), [memoryview(data)], is_durable=False)
    array = np.zeros(count * size + 2 * PAGE, dtype=np.uint8)
    page_start = -array.ctypes.data % PAGE

    def targets(shift: int) -> list[memoryview]:
        view = memoryview(array)[page_start + shift :]
        return [view[i * size : (i + 1) * size] for i in range(count)]

    def preadv_into(views: list[memoryview]):
        def read(i: int) -> None:
            fd = os.open(directory / names[i], os.O_RDONLY)
            try:
                done = 0
                while done < size:
                    done += os.preadv(fd, [views[i][done:]], objectfile.header_size_for(names[i]) + done)
            finally:
                os.close(fd)

        return read

    def read_object_into(views: list[memoryview]):
        return lambda i: files.read_object_into(directory / names[i], names[i], size, [views[i]])

    cases = {
        "warm_preadv_into_numpy_16_past_page": preadv_into(targets(16)),
        "warm_preadv_into_page_aligned": preadv_into(targets(0)),
        "warm_read_object_into_numpy_16_past_page": read_object_into(targets(16)),
    }
    rates: dict[str, list[float]] = {name: [] for name in cases}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            for name, read in cases.items():
                started = time.perf_counter()
                list(pool.map(read, range(count)))
                rates[name].append(count * size / (time.perf_counter() - started) / 1e9)
    return {f"{name}_gbps": round(statistics.median(values), 2) for name, values in rates.items()}


# --- work counted in bytecodes: what timings on this VM cannot show ----------------------------


def bytecodes_per_key(action) -> float:
    """Python bytecodes executed by `action()` (every function it calls, C code not counted),
    per key of a BATCH-key batch. Deterministic: a change of a few percent in the master's or
    the client's per-key work shows here while timings on this VM move by 2x."""
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        frame.f_trace_opcodes = True
        if event == "opcode":
            count += 1
        return trace

    sys.settrace(trace)
    try:
        action()
    finally:
        sys.settrace(None)
    return round(count / BATCH, 1)


def bytecodes() -> dict:
    """Per key of a 128-key batch of 4 KiB objects: the master's put_start, put_end,
    finish_put_end and get_replica_list (a first and a second read); the client's GetJob
    planning a plain get over TCP (pages landing in one buffer per frame), checking the pages
    once they landed and making the bytes returned, and planning a zero-copy get into a
    registered array."""
    from kvpool.client.buffers import BufferRegistry
    from kvpool.client.transfer import GetJob
    from kvpool.protocol.messages import GetReplicaListReply, Replica

    service = MasterService(MasterConfig(), random.Random(0), auth.cluster_key("bench"), term=1)
    info = SegmentInfo("bench-segment", "bench-node", "host", "host:1", "/dev/shm/x", b"t", 1 << 30)
    service.mount_segment(MountSegment(info, []), 0)
    keys = [f"key-{i:060d}" for i in range(BATCH)]
    start = PutStart(keys, [4 * KIB] * BATCH, ReplicateConfig())
    out = {"put_start": bytecodes_per_key(lambda: service.put_start(start, 1))}
    pending = []
    out["put_end"] = bytecodes_per_key(lambda: pending.append(service.put_end(PutEnd(keys, [7] * BATCH), 1)))
    answers = {s: [0] * len(e) for s, e in pending[0].commits.items()}
    out["finish_put_end"] = bytecodes_per_key(lambda: service.finish_put_end(pending[0], answers, 1))
    lookup = GetReplicaList(keys)
    out["get_replica_list_first_read"] = bytecodes_per_key(lambda: service.get_replica_list(lookup, 2))
    out["get_replica_list_again"] = bytecodes_per_key(lambda: service.get_replica_list(lookup, 3))
    remote = SegmentInfo("remote", "node", "elsewhere", "elsewhere:1", "", b"t", 1 << 30)
    replicas = [[Replica("remote", i * 4 * KIB)] for i in range(BATCH)]
    pages = [bytes([i]) * 4 * KIB for i in range(BATCH)]
    checksums = [checksum_of([page]) for page in pages]
    reply = GetReplicaListReply([0] * BATCH, [4 * KIB] * BATCH, checksums, replicas, 10_000, {"remote": remote})
    planned = []

    def plan(targets, starts=None, span=None) -> None:
        job = GetJob(reply, targets, 0, lambda _: None, keys, None, starts, span)
        job.copy_local()
        planned[:] = [job, job.remote_batches()]

    def land() -> None:
        """The node's payload has come: check every page and make the bytes returned."""
        job, batches = planned
        asked = set()
        for batch in batches:
            for (_, (arena,)), owners in zip(batch.frames, batch.owners):
                arena[:] = b"".join(pages[index] for index in owners)
                asked.update(owners)
        job.remote_done(asked, set())
        job.finish(1)
        assert job.results == pages

    out["client_plain_get_over_tcp"] = bytecodes_per_key(lambda: plan([None] * BATCH))
    out["client_plain_get_over_tcp_landed"] = bytecodes_per_key(land)
    registry = BufferRegistry()
    array = np.zeros(BATCH * 4 * KIB, dtype=np.uint8)
    base = registry.register(array)
    addresses = [base + i * 4 * KIB for i in range(BATCH)]
    targets = [[registry.view(a, 4 * KIB)] for a in addresses]
    out["client_zero_copy_get_over_tcp"] = bytecodes_per_key(lambda: plan(targets, addresses, registry.view))
    return out


PARTS = {
    "round-trips": round_trips,
    "master": master,
    "mixed-sizes": mixed_sizes,
    "fragmentation": fragmentation,
    "full-cache-soak": full_cache_soak,
    "node-commit": node_commit,
    "puts-after-remove": puts_after_remove,
    "client": client,
    "put-phases": put_phases,
    "tcp-transfers": tcp_transfers,
    "page-gets": page_gets,
    "pieces": pieces,
    "caller-thread": caller_thread,
    "landing": landing,
    "copies": copies,
    "payload-alignment": payload_alignment,
    "files": files_read,
    "bytecodes": bytecodes,
}


def main() -> None:
    names = sys.argv[1:] or list(PARTS)
    if names == ["_same-host-plain-gets"]:  # the child of `landing`
        print(json.dumps(same_host_plain_gets()))
        return
    unknown = [name for name in names if name not in PARTS]
    if unknown or "-h" in names or "--help" in names:
        print(__doc__)
        sys.exit(2 if unknown else 0)
    result = {"machine": {"cpus": os.cpu_count()}}
    for name in names:
        result[name] = PARTS[name]()
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
