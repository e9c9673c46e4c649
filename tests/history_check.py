"""A small Jepsen-style checker: clients record every operation, a nemesis injects faults, and
the recorded history is checked for what a user of the store relies on.

Three parts, each usable alone:

- `run_client` (`python tests/history_check.py client ...`): one Store in its own process
  doing a seeded random mix of put / put_batch / get / get_batch / get_into / exists /
  batch_exists / longest_prefix / remove / remove_by_regex on a key set that overlaps the other
  clients'. Every value is a pure function of (key, writer, sequence), so any read is
  attributed to the one put that wrote it (`value_of`, `attribution`). Each operation is logged
  to `ops-<writer>.jsonl` twice: before the call (its invocation time) and after it (its return
  time and result), with time.monotonic_ns, which all processes of one machine share. A client
  killed mid-call leaves the first line only: that operation's end is unknown. Where the master
  holds each key is recorded too (`where`): after an acknowledged put (`at`, on its result
  line) and before a remove (`before`, on its invocation line), so that the checker excuses a
  loss only when a fault hit a segment that held the key.
- `HistoryRun`: a LocalCluster, clients, a nemesis thread (SIGKILL and restart a node, SIGSTOP
  and SIGCONT a node, SIGKILL and restart the master, SIGKILL a client and start another), a
  sampler of the master's eviction and loss counters, then a quiet phase and the final state.
- `check`: the properties, over the recorded files; returns the violations found.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import functools
import json
import math
import os
import random
import re
import signal
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import numpy as np
import xxhash

MAGIC = b"KVHIST01"
HEADER = struct.Struct("<8sQIIQ")  # magic, key hash, writer, size, sequence
SIZE_MIN, SIZE_MAX = 1024, 512 * 1024
PINNED_SIZE_MAX = 4096
FAULTS = ("kill_node", "stop_node", "kill_master", "kill_client")
# With tiers (HistoryRun(tiers=True)) also: every node killed at once (the DFS alone serves),
# then each restarted on its disk directory.
TIER_FAULTS = (*FAULTS, "kill_all_nodes")
NEVER = math.inf  # the return time of an operation whose client was killed during it

# The cluster's timeouts: short, so that faults resolve within a run of seconds.
RPC_TIMEOUT_MS, CONNECT_TIMEOUT_MS, TRANSFER_TIMEOUT_MS = 4_000, 1_000, 2_000
CALL_BOUND_MS = TRANSFER_TIMEOUT_MS + 3 * RPC_TIMEOUT_MS  # sync Store's bound on one call
NODE_TTL_MS, LEASE_TTL_MS, PUT_DISCARD_MS, PUT_RELEASE_MS = 2_000, 3_000, 3_000, 4_000
REMOVE_DROPS_WAIT_MS = 1_000  # a remove answers once its drops are acknowledged, or after this (master/server.py)
# As a deployment runs: with a cluster token, so every frame after a handshake is sealed.
TOKEN = "history-token"
MASTER_ARGS = (
    "--node-ttl-ms", str(NODE_TTL_MS), "--lease-ttl-ms", str(LEASE_TTL_MS),
    "--put-discard-timeout-ms", str(PUT_DISCARD_MS), "--put-release-timeout-ms", str(PUT_RELEASE_MS),
)  # fmt: skip


# --- values ---------------------------------------------------------------------------------


def key_hash(key: str) -> int:
    return xxhash.xxh64_intdigest(key.encode())


def value_of(key: str, writer: int, sequence: int, size: int) -> bytes:
    """The bytes that writer `writer`'s operation `sequence` puts under `key`."""
    header = HEADER.pack(MAGIC, key_hash(key), writer, size, sequence)
    body = np.random.default_rng([key_hash(key), writer, sequence]).bytes(size - HEADER.size)
    return header + body


def attribution(key: str, data: bytes | memoryview) -> list | str:
    """[writer, sequence] of the put that wrote `data` under `key`, or why no put did."""
    if len(data) < HEADER.size:
        return f"bad: {len(data)} bytes"
    magic, hashed, writer, size, sequence = HEADER.unpack_from(data)
    if magic != MAGIC:
        return "bad: no header"
    if hashed != key_hash(key):
        return f"bad: another key's bytes (writer {writer} sequence {sequence})"
    if size != len(data):
        return f"bad: {len(data)} bytes of a {size}-byte value (writer {writer} sequence {sequence})"
    if value_of(key, writer, sequence, size) != bytes(data):
        return f"bad: torn or mixed bytes (writer {writer} sequence {sequence})"
    return [writer, sequence]


# --- the client -----------------------------------------------------------------------------


def client_keys(client: int, key_space: int = 100) -> tuple[list[str], list[str]]:
    """A client's plain keys, half of the `key_space` (overlapping the next client's), and the
    pinned keys all share."""
    start = key_space // 5 * client
    plain = [f"k{(start + i) % key_space:03d}" for i in range(key_space // 2)]
    return plain, [f"p{i:02d}" for i in range(6)]


def run_client(master: str, out_dir: Path, writer: int, client: int, seed: int, duration_s: float, shm: bool,
               dfs_dir: str = "", key_space: int = 100) -> None:  # fmt: skip
    """With `dfs_dir` (a cluster with tiers), the client reads DFS files itself and some of its
    puts ask for write-through copies to the disk tier and to the DFS. `key_space`: how many
    plain keys the clients share (more: more bytes than DRAM holds)."""
    from kvpool import ReplicateConfig, Store
    from kvpool.errors import ErrorCode

    rng = random.Random(seed)
    plain, pinned = client_keys(client, key_space)
    every_key = all_keys(key_space)
    log = os.open(out_dir / f"ops-{writer}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    store = Store(master, shm_enabled=shm, rpc_timeout_ms=RPC_TIMEOUT_MS, connect_timeout_ms=CONNECT_TIMEOUT_MS,
                  transfer_timeout_ms=TRANSFER_TIMEOUT_MS, dfs_dir=dfs_dir)  # fmt: skip
    buffer = np.zeros(SIZE_MAX, dtype=np.uint8)
    address = store.register_buffer(buffer)

    def size_for(key: str) -> int:
        top = PINNED_SIZE_MAX if key in pinned else SIZE_MAX
        return int(math.exp(rng.uniform(math.log(SIZE_MIN), math.log(top))))

    def some(count: int) -> list[str]:
        return rng.sample(plain, count)

    def put(sequence: int, keys: list[str], sizes: list[int], replicas: int, copies: tuple = ()) -> list[int]:
        values = [value_of(k, writer, sequence, s) for k, s in zip(keys, sizes)]
        config = ReplicateConfig(replica_num=replicas, with_hard_pin=keys[0] in pinned,
                                 with_disk_copy="disk" in copies, with_dfs_copy="dfs" in copies)  # fmt: skip
        return store.put_batch(keys, values, config)

    def get(keys: list[str]) -> list:
        return [None if d is None else attribution(k, d) for k, d in zip(keys, store.get_batch(keys))]

    def where(keys: list[str]) -> dict[str, list[str]] | None:
        """The segments the master lists for each key now; None if it cannot tell (then the
        checker takes any fault as one that may have hit them)."""
        try:
            return {k: [r.segment_id for r in places] for k, places in zip(keys, store.query(keys).replicas)}
        except Exception:  # the master is away: the operation itself is what is checked
            return None

    def get_into(key: str) -> list:
        got = store.get_into(key, address, SIZE_MAX)
        if got == ErrorCode.OBJECT_NOT_FOUND:
            return [None]
        if got < 0:
            return [f"code {got}"]
        return [attribution(key, memoryview(buffer)[:got])]

    deadline = time.monotonic() + duration_s
    sequence = 0
    while time.monotonic() < deadline and not stopping.is_set():
        sequence += 1
        roll = rng.random()
        op: dict = {"w": writer, "n": sequence}
        if roll < 0.25:
            keys = [rng.choice(pinned)] if rng.random() < 0.2 else some(1)
            op.update(f="put", keys=keys, sizes=[size_for(keys[0])], replicas=rng.choice((1, 2)))
        elif roll < 0.35:
            keys = some(rng.randint(2, 6))
            op.update(f="put", keys=keys, sizes=[size_for(k) for k in keys], replicas=rng.choice((1, 2)))
        elif roll < 0.55:
            op.update(f="get", keys=[rng.choice(pinned)] if rng.random() < 0.3 else some(1))
        elif roll < 0.65:
            op.update(f="get", keys=some(rng.randint(2, 6)) + ([rng.choice(pinned)] if rng.random() < 0.5 else []))
        elif roll < 0.72:
            op.update(f="get_into", keys=[rng.choice(pinned + some(3))])
        elif roll < 0.80:
            op.update(f="exists", keys=some(rng.randint(1, 6)))
        elif roll < 0.88:
            op.update(f="longest_prefix", keys=sorted(some(rng.randint(2, 8))))
        elif roll < 0.97:
            op.update(f="remove", keys=[rng.choice(pinned)] if rng.random() < 0.1 else some(1))
        else:
            digit = rng.randrange(10)  # even: forced; odd: a key under a read lease stays
            op.update(f="remove_by_regex", pattern=f"^k0{digit}[0-4]$", force=digit % 2 == 0)
        if dfs_dir and op["f"] == "put":  # drawn only with tiers: a run without keeps its sequence
            op.update(copies=[tier for tier in ("disk", "dfs") if rng.random() < 0.2])
        if op["f"] in ("remove", "remove_by_regex"):
            candidates = op["keys"] if op["f"] == "remove" else [k for k in every_key if re.search(op["pattern"], k)]
            op.update(before_t=time.monotonic_ns())  # a put landing after this look is not in it
            op.update(before=where(candidates))
        record = dict(op, i=time.monotonic_ns())
        os.write(log, (json.dumps(record) + "\n").encode())
        try:
            f = op["f"]
            if f == "put":
                result: object = put(sequence, op["keys"], op["sizes"], op["replicas"], op.get("copies", ()))
            elif f == "get":
                result = get(op["keys"])
            elif f == "get_into":
                result = get_into(op["keys"][0])
            elif f == "exists":
                result = store.batch_exists(op["keys"])
            elif f == "longest_prefix":
                result = store.longest_prefix(op["keys"])
            elif f == "remove":
                result = store.batch_remove(op["keys"])
            else:
                result = store.remove_by_regex(op["pattern"], force=op["force"])
            outcome = {"res": result}
            stored = [k for k, code in zip(op["keys"], result) if code == 0] if f == "put" else []  # type: ignore
            if stored:
                outcome.update(at=where(stored))
        except Exception as exc:  # recorded: the checker tells typed errors from others
            from kvpool.errors import KVPoolError

            outcome = {"err": type(exc).__name__, "typed": isinstance(exc, KVPoolError), "msg": str(exc)[:200]}
        os.write(log, (json.dumps(dict(outcome, w=writer, n=sequence, r=time.monotonic_ns())) + "\n").encode())
        time.sleep(rng.uniform(0.002, 0.02))  # keeps the CPU modest: two vCPUs are shared
    store.close()


# --- the run --------------------------------------------------------------------------------


@dataclasses.dataclass
class Client:
    popen: subprocess.Popen
    writer: int
    client: int


class HistoryRun:
    """A cluster, clients and a nemesis, recording into `out_dir`. Every process it starts is
    ended by its pid (the cluster's by LocalCluster.stop)."""

    def __init__(self, out_dir: Path, seed: int, duration_s: float, clients: int = 3, nodes: int = 3,
                 memory: str = "4MiB", fault_gap_s: float = 3.0, disk: bool = True, *, tiers: bool = False,
                 disk_size: str = "24MiB", promote_reads: int = 1, key_space: int = 100) -> None:  # fmt: skip
        """`tiers`: every node has a disk tier of `disk_size` (DRAM of `memory` over it), and a
        DFS directory is shared by the master, the nodes and the clients; the master promotes
        objects read `promote_reads` times; the nemesis also kills every node at once
        (TIER_FAULTS). The final state then also holds each tier's files. `key_space`: the
        clients' plain keys (client_keys)."""
        from kvpool.cli.launcher import LocalCluster

        self.out_dir = out_dir
        self.rng = random.Random(seed)
        self.seed = seed
        self.duration_s = duration_s
        self.client_count = clients
        self.fault_gap_s = fault_gap_s
        self.tiers = tiers
        self.key_space = key_space
        self.disk_size = disk_size
        self.dfs_dir = out_dir / "dfs" if tiers else None
        self.faults = TIER_FAULTS if tiers else FAULTS
        master_args = MASTER_ARGS
        if self.dfs_dir is not None:
            master_args += ("--dfs-dir", str(self.dfs_dir), "--promote-reads", str(promote_reads))
        (out_dir / "cluster").mkdir(parents=True, exist_ok=True)  # before the cluster writes its token there
        self.cluster = LocalCluster(0, memory, master_args=master_args, workdir=out_dir / "cluster", token=TOKEN)
        self.node_count = nodes
        self.disk = disk
        self.node_extra: dict[int, tuple[str, ...]] = {}  # node slot -> its own flags (a disk tier)
        self.slots: list = []  # node slot -> its Process now
        self.clients: list[Client] = []
        self._writers = 0
        self._reads = 0  # writer 0's operations: the nemesis's reads of a tier (read_tier)
        self.node_kills: list[float] = []  # when (time.time) the nemesis killed nodes
        self._events = open(out_dir / "events.jsonl", "a")  # noqa: SIM115 - closed in stop
        self._stop = threading.Event()
        self.every_fault_ran = threading.Event()  # the nemesis began its second round

    def event(self, **fields) -> None:
        self._events.write(json.dumps(dict(fields, t=time.monotonic_ns())) + "\n")
        self._events.flush()

    def start(self) -> None:
        self.cluster.start()
        for slot in range(self.node_count):
            extra: tuple[str, ...] = ("--metrics-port", "0")
            if self.tiers:
                extra += ("--disk-dir", str(self.out_dir / f"disk{slot}"), "--disk-size", self.disk_size,
                          "--dfs-dir", str(self.dfs_dir))  # fmt: skip
            elif self.disk and slot == 0:
                disk_dir = self.out_dir / "disk0"
                extra += ("--disk-dir", str(disk_dir), "--disk-size", "32MiB")
            self.node_extra[slot] = extra
            self.slots.append(None)
            self.start_node(slot)
        for client in range(self.client_count):
            self.start_client(client)

    def start_node(self, slot: int) -> None:
        """Start the node of `slot` (again); the checker learns which segments are that slot's."""
        self.slots[slot] = self.cluster.start_node(self.node_extra[slot])
        self.event(what="node_start", slot=slot, segments=segments_of([self.slots[slot]]))

    def start_client(self, client: int) -> None:
        self._writers += 1
        writer = self._writers
        command = [sys.executable, __file__, "client", "--master", self.cluster.master_endpoint,
                   "--out-dir", str(self.out_dir), "--writer", str(writer), "--client", str(client),
                   "--seed", str(self.seed * 1000 + writer), "--duration-s", str(self.duration_s + 60),
                   "--shm" if client % 2 == 0 else "--no-shm"]  # fmt: skip
        if self.dfs_dir is not None:
            command += ["--dfs-dir", str(self.dfs_dir)]
        command += ["--key-space", str(self.key_space)]
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent), KVPOOL_TOKEN=TOKEN)
        with open(self.out_dir / f"client-{writer}.log", "ab") as log:
            popen = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.clients.append(Client(popen, writer, client))
        self.event(what="client_start", writer=writer)

    def nemesis(self) -> None:
        """One fault every `fault_gap_s`, in a seeded order; each is over before the next."""
        faults = list(self.faults)
        index = 0
        while not self._stop.wait(self.fault_gap_s):
            if index >= len(faults):
                self.every_fault_ran.set()
            fault = faults[index % len(faults)] if index < len(faults) else self.rng.choice(faults)
            index += 1
            slot = self.rng.randrange(self.node_count)
            node = self.slots[slot]
            if fault == "kill_node":
                self.kill_node_in(slot)
            elif fault == "kill_all_nodes":
                self.kill_all_nodes()
            elif fault == "stop_node":
                self.event(what="stop_node", slot=slot, segments=segments_of([node]))
                node.signal(signal.SIGSTOP)
                self._stop.wait(self.rng.uniform(1.0, 3.0))
                node.signal(signal.SIGCONT)
                self.event(what="cont_node", slot=slot)
            elif fault == "kill_master":
                self.event(what="kill_master")
                self.cluster.master.kill()
                self._stop.wait(self.rng.uniform(0.2, 2.0))
                self.cluster.start_master()
                wait_remounted(self.cluster, self.slots, NODE_TTL_MS / 1000 + 5)
                self.event(what="master_back")
            else:
                victim = self.rng.choice([c for c in self.clients if c.popen.poll() is None])
                self.event(what="kill_client", writer=victim.writer)
                victim.popen.kill()
                victim.popen.wait(10)
                self.start_client(victim.client)

    def kill_node_in(self, slot: int) -> None:
        """SIGKILL the node of `slot` (mid-move, with tiers, when it has one), then start it
        again; with tiers, read what its disk tier re-adopted."""
        node = self.slots[slot]
        moving = self.tiers and self.wait_moving(node)
        self.event(what="kill_node", slot=slot, segments=segments_of([node]), moving=moving)
        node.kill()
        self.node_kills.append(time.time())
        self._stop.wait(self.rng.uniform(0.5, 2.0))
        self.start_node(slot)
        self.event(what="node_back", slot=slot)
        if self.tiers:
            self.read_tier(self.slots[slot].info["disk_segment_id"])

    def kill_all_nodes(self) -> None:
        """With tiers: every node at once, the DFS alone serving until they are back."""
        self.event(what="kill_all_nodes", segments=segments_of(self.slots))
        for process in self.slots:
            process.kill()
        self.node_kills.append(time.time())
        self._stop.wait((NODE_TTL_MS + 1_500) / 1000)  # the master has dropped them all
        self.read_tier("dfs")
        for slot in range(self.node_count):
            self.start_node(slot)
        self.event(what="nodes_back")

    def wait_moving(self, node) -> bool:
        """Whether `node` had moves queued (an offload, a promotion, a copy) within 2 s: the
        nemesis kills it then, mid-move, when it can."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and not self._stop.is_set():
            if _metric(node.info["metrics_endpoint"], "kvpool_node_move_queue_bytes") > 0:
                return True
            time.sleep(0.01)
        return False

    def read_tier(self, tier: str) -> None:
        """Gets (recorded as writer 0's, checked as any client's) of the keys the master lists
        on a slower tier: `tier` is a disk segment id (a node re-adopted it) or "dfs"."""
        from kvpool import Store

        keys = all_keys(self.key_space)
        path = self.out_dir / "ops-0.jsonl"
        try:
            with Store(self.cluster.master_endpoint, shm_enabled=False, rpc_timeout_ms=RPC_TIMEOUT_MS,
                       dfs_dir=str(self.dfs_dir), token=TOKEN) as store:  # fmt: skip
                if tier != "dfs":
                    wait_mounted(store, tier, NODE_TTL_MS / 1000 + 5)
                dfs = {s.segment.segment_id for s in store.cluster_status().segments if s.segment.tier == "dfs"}
                held = [k for k, places in zip(keys, store.query(keys).replicas)
                        if any(r.segment_id in ({tier} if tier != "dfs" else dfs) for r in places)]  # fmt: skip
                if not held:
                    return
                self._reads += 1
                op = {"w": 0, "n": self._reads, "f": "get", "keys": held, "tier": tier}
                with open(path, "a") as log:
                    log.write(json.dumps(dict(op, i=time.monotonic_ns())) + "\n")
                    got = [None if d is None else attribution(k, d) for k, d in zip(held, store.get_batch(held))]
                    log.write(json.dumps({"res": got, "w": 0, "n": self._reads, "r": time.monotonic_ns()}) + "\n")
                self.event(what="read_tier", tier=tier, keys=len(held), hits=sum(g is not None for g in got))
        except Exception as exc:  # the run goes on; the event says why this look was not taken
            self.event(what="read_tier_failed", tier=tier, error=f"{type(exc).__name__}: {exc}"[:200])

    def sample_counters(self) -> None:
        """The master's eviction and loss counters every 0.2 s: the checker's evidence that an
        object may have left without a remove."""
        while not self._stop.wait(0.2):
            try:
                url = f"http://127.0.0.1:{self.cluster.http_port}/metrics"
                with urllib.request.urlopen(url, timeout=1.0) as response:
                    text = response.read().decode()
            except (OSError, ValueError):
                continue
            values = {}
            for name in ("evictions_total", "lost_total", "bad_replicas_total"):
                found = re.search(rf"^kvpool_master_{name} (\S+)$", text, re.M)
                values[name] = float(found.group(1)) if found else 0.0
            self.event(what="counters", **values)

    def run(self) -> dict:
        """Start, run the clients under faults for `duration_s`, stop the faults and clients,
        and record the final state (exists, prefix and gets in a quiet cluster; segment use as
        the master and the nodes see it). Returns the final state."""
        threads = [threading.Thread(target=self.nemesis), threading.Thread(target=self.sample_counters)]
        self.start()
        for thread in threads:
            thread.start()
        try:
            self._stop.wait(self.duration_s)
            # On a slow machine each fault takes longer (restarts, re-mounts): the run goes on
            # until every kind of fault ran once, within a bound.
            self.every_fault_ran.wait(2 * self.duration_s)
        finally:
            self._stop.set()
            for thread in threads:
                thread.join()
            for client in self.clients:
                client.popen.send_signal(signal.SIGTERM)
            for client in self.clients:
                try:
                    client.popen.wait(CALL_BOUND_MS / 1000 + 5)
                except subprocess.TimeoutExpired:
                    client.popen.kill()
                    client.popen.wait(10)
        self.event(what="quiet")
        if not self.tiers:
            return final_state(self.cluster, self.slots)
        return final_state(self.cluster, self.slots, self.tier_dirs(), self.key_space, tuple(self.node_kills))

    def tier_dirs(self) -> dict[str, str]:
        """Segment id -> directory of each slower tier: the nodes' disk tiers and the DFS."""
        dirs = {p.info["disk_segment_id"]: str(self.out_dir / f"disk{slot}") for slot, p in enumerate(self.slots)}
        identity = json.loads((self.dfs_dir / "kvpool-tier.json").read_text())
        return dict(dirs, **{identity["segment_id"]: str(self.dfs_dir)})

    def stop(self) -> None:
        for client in self.clients:
            if client.popen.poll() is None:
                client.popen.kill()
                client.popen.wait(10)
        self.cluster.stop()
        self._events.close()


def _metric(endpoint: str, name: str) -> float:
    """One unlabelled value of a server's /metrics, 0 if absent or unreachable."""
    try:
        with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=1.0) as response:
            text = response.read().decode()
    except (OSError, ValueError):
        return 0.0
    found = re.search(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def segments_of(processes: list) -> list[str]:
    """The segments of these nodes: DRAM, and disk tier if any (the checker's evidence)."""
    return [p.info[name] for p in processes for name in ("segment_id", "disk_segment_id") if p.info.get(name)]


def mounted_on(http_port: int) -> set[str]:
    """The segment ids a master lists (its /status); empty if it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status", timeout=1.0) as reply:
            return {s["segment_id"] for s in json.loads(reply.read())["segments"]}
    except (OSError, ValueError):
        return set()


def wait_remounted(cluster, slots: list, timeout_s: float) -> None:
    """Until the master lists every node's segments again (a restart's consequences are over)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not set(segments_of(slots)) <= mounted_on(cluster.http_port):
        time.sleep(0.05)


def all_keys(key_space: int = 100) -> list[str]:
    return sorted({k for c in range(5) for k in client_keys(c, key_space)[0]} | set(client_keys(0)[1]))


def wait_mounted(store, segment_id: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while segment_id not in {s.segment.segment_id for s in store.cluster_status().segments}:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{segment_id} not mounted within {timeout_s} s")
        time.sleep(0.05)


def final_state(cluster, slots: list, tier_dirs: dict[str, str] | None = None, key_space: int = 100,
                node_kills: tuple[float, ...] = ()) -> dict:  # fmt: skip
    """Once every fault is over: each key's presence by exists, prefix and get, and each DRAM
    segment's use as the master counts it, as its node holds it, and as the replicas the master
    lists there add up; looked at again until the use agrees (the put release timeout frees
    what killed writers held) or for that timeout and the node TTL and some.

    With `tier_dirs` (segment id -> directory of each slower tier), also each tier's files
    against its replicas; the use is looked at without reading until it agrees, and the keys
    read once after: a read of a disk object earns a promotion (and a DRAM eviction), so use
    read along with gets never settles. `node_kills`: when (time.time) nodes were killed."""
    deadline = time.monotonic() + (PUT_RELEASE_MS + NODE_TTL_MS) / 1000 + 10
    while True:
        state = _state_now(cluster, slots, tier_dirs, key_space, reads=tier_dirs is None)
        if tier_dirs is not None:
            state["node_kills"] = list(node_kills)
            if not check_final(state):
                read = _state_now(cluster, slots, tier_dirs, key_space, reads=True)
                state.update({name: read[name] for name in ("exists", "got", "prefixes")})
        if not check_final(state) or time.monotonic() > deadline:
            return state
        time.sleep(0.2)


def _state_now(cluster, slots: list, tier_dirs: dict[str, str] | None, key_space: int, reads: bool) -> dict:
    from kvpool import Store

    keys = all_keys(key_space)
    dfs_dir = next((d for d in (tier_dirs or {}).values() if tier_of(d) == "dfs"), "")
    exists, got, prefixes = [], [], []
    with Store(cluster.master_endpoint, shm_enabled=False, rpc_timeout_ms=RPC_TIMEOUT_MS, dfs_dir=dfs_dir,
               token=TOKEN) as store:  # fmt: skip
        if reads:
            exists = store.batch_exists(keys)
            got = [None if d is None else attribution(k, d) for k, d in zip(keys, store.get_batch(keys))]
            prefixes = [[keys[:n], store.longest_prefix(keys[:n])] for n in range(1, len(keys), 7)]
        status = store.cluster_status()
        replicas = store.query(keys)
    held: dict[str, list[int]] = defaultdict(list)  # segment id -> sizes of the replicas there
    for size, places in zip(replicas.sizes, replicas.replicas):
        for replica in places:
            held[replica.segment_id].append(size)
    master_used = {s.segment.segment_id: s.used_bytes for s in status.segments if s.segment.tier == "dram"}
    node_used = {}
    for process in slots:
        with urllib.request.urlopen(f"http://{process.info['metrics_endpoint']}/metrics", timeout=2) as response:
            text = response.read().decode()
        found = re.search(r"^kvpool_node_segment_used_bytes(?:\{[^}]*\})? (\S+)$", text, re.M)
        node_used[process.info["segment_id"]] = int(float(found.group(1))) if found else -1
    state = {"keys": keys, "exists": exists, "got": got, "prefixes": prefixes, "master_used": master_used,
             "node_used": node_used, "held": {s: held[s] for s in node_used}}  # fmt: skip
    if tier_dirs is not None:
        state["tiers"] = tier_state(keys, replicas, tier_dirs)
        state["tier_counts"] = status.to_dict()["tiers"]  # for the record: what moved where
        state["segment_objects"] = {s.segment.segment_id: s.object_count for s in status.segments}
    return state


def tier_of(directory: str) -> str:
    """The tier ("disk" or "dfs") the directory's identity file names."""
    from kvpool.protocol import objectfile

    return json.loads((Path(directory) / objectfile.IDENTITY_FILE).read_text())["tier"]


def tier_state(keys: list[str], replicas, tier_dirs: dict[str, str]) -> dict:
    """Per slower tier: the object files the master's replicas name there, and the files there
    (temporary ones included), as paths relative to its directory."""
    from kvpool.protocol import objectfile

    listed: dict[str, list[str]] = {segment: [] for segment in tier_dirs}
    is_dfs = {segment: tier_of(directory) == "dfs" for segment, directory in tier_dirs.items()}
    for key, places in zip(keys, replicas.replicas):
        for replica in places:
            if replica.segment_id not in tier_dirs:
                continue
            if is_dfs[replica.segment_id]:
                name = objectfile.dfs_relative_path(key, replica.offset)
            else:
                name = f"{objectfile.OBJECTS_DIR}/{objectfile.disk_name(replica.offset)}"
            listed[replica.segment_id].append(name)
    found, modified = {}, {}
    for segment, directory in tier_dirs.items():
        objects = Path(directory) / objectfile.OBJECTS_DIR
        paths = [p for p in objects.rglob("*") if p.is_file()]
        temporaries = {str(p.relative_to(directory)): _modified_s(p) for p in paths if p.name.endswith(".tmp")}
        gone = {name for name, at in temporaries.items() if at is None}  # the next look sees where it went
        found[segment] = sorted(name for name in (str(p.relative_to(directory)) for p in paths) if name not in gone)
        modified[segment] = {name: at for name, at in temporaries.items() if at is not None}
    return {s: {"listed": sorted(listed[s]), "files": found[s], "temporary": modified[s], "dfs": is_dfs[s]}
            for s in tier_dirs}  # fmt: skip


def _modified_s(path: Path) -> float | None:
    """When the file was last written; None if it is gone since it was listed (a move that
    renamed its temporary file in between)."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return None


# --- the checker ----------------------------------------------------------------------------


@dataclasses.dataclass
class Op:
    writer: int
    sequence: int
    f: str
    start: int
    end: float  # NEVER: the client died during it
    args: dict
    result: object = None
    error: dict | None = None
    at: dict | None = None  # a put's: the segments the master listed for each stored key after it


def load(out_dir: Path) -> tuple[list[Op], list[dict]]:
    ops: dict[tuple[int, int], Op] = {}
    for path in sorted(out_dir.glob("ops-*.jsonl")):
        for line in path.read_text().splitlines():
            if not line.endswith("}"):
                continue  # the half line of a client killed while writing it
            record = json.loads(line)
            key = (record["w"], record["n"])
            if "i" in record:
                ops[key] = Op(record["w"], record["n"], record["f"], record["i"], NEVER, record)
            elif key in ops:
                op = ops[key]
                op.end = record["r"]
                op.result = record.get("res")
                op.at = record.get("at")
                if "err" in record:
                    op.error = record
    events = [json.loads(line) for line in (out_dir / "events.jsonl").read_text().splitlines()]
    return sorted(ops.values(), key=lambda o: o.start), events


class Evidence:
    """What may take an object away without a remove, each tied to where the object was:

    - a node fault (killed, stopped, every node killed) hits the segments of its node slot
      (DRAM, disk tier; a restarted node's new ones too: moves stay on a node), from its start
      until SETTLE_NS after it ended: the master lists a dead node's replicas until its TTL,
      and a node timed out while stopped re-mounts once it runs again;
    - a master restart (or failover) hides every object from its start until the nodes have
      re-mounted (`master_back`, and SETTLE_AFTER_BACK_NS: a re-mount is answered before its
      last part is in the table): a read then may miss, but nothing leaves; and it forgets the
      drops a node had not acknowledged, so objects removed before it may come back;
    - evictions and losses the master counted (sampled)."""

    SETTLE_NS = (NODE_TTL_MS + 1_000) * 1_000_000
    SETTLE_AFTER_BACK_NS = 1_000_000_000

    def __init__(self, events: list[dict]) -> None:
        self.samples = _counted([(e["t"], e["evictions_total"] + e["lost_total"] + e["bad_replicas_total"])
                                 for e in events if e["what"] == "counters"])  # fmt: skip
        self.slot_of: dict[str, int] = {}  # segment id -> node slot
        for event in events:
            if event["what"] == "node_start":
                self.slot_of.update(dict.fromkeys(event["segments"], event["slot"]))
        slots = set(self.slot_of.values())
        # (start, end, slots hit: None for every one)
        self.node_faults: list[tuple[float, float, set[int] | None]] = []
        self.master_windows: list[tuple[float, float]] = []
        ends = {"kill_node": "node_back", "stop_node": "cont_node", "kill_master": "master_back",
                "kill_all_nodes": "nodes_back"}  # fmt: skip
        for index, event in enumerate(events):
            if event["what"] in ends:
                end = next((e["t"] for e in events[index:] if e["what"] == ends[event["what"]]), NEVER)
                if event["what"] == "kill_master":
                    self.master_windows.append((event["t"], end + self.SETTLE_AFTER_BACK_NS))
                else:
                    hit = {event["slot"]} if "slot" in event else (slots or None)
                    self.node_faults.append((event["t"], end + self.SETTLE_NS, hit))
        self.master_restarts = [e["t"] for e in events if e["what"] == "kill_master"]
        self.losses = _counted([(e["t"], e["lost_total"]) for e in events if e["what"] == "counters"])
        self.evictions = [(e["t"], e["evictions_total"]) for e in events if e["what"] == "counters"]

    def slots(self, segments: set[str] | None) -> set[int] | None:
        """The node slots of these segments (a DFS has none); None: not known, every slot."""
        if segments is None:
            return None
        return {self.slot_of[s] for s in segments if s in self.slot_of}

    def node_fault_on(self, segments: set[str] | None, start: float, end: float) -> bool:
        """Whether a node fault hit one of `segments` (None: not known, any) between them."""
        slots = self.slots(segments)
        return any(s <= end and start <= e and (slots is None or hit is None or hit & slots)
                   for s, e, hit in self.node_faults)  # fmt: skip

    def master_away(self, start: float, end: float) -> bool:
        """Whether a master restart or failover was under way between `start` and `end`."""
        return any(s <= end and start <= e for s, e in self.master_windows)

    def restart_between(self, start: float, end: float) -> bool:
        return any(start <= t <= end for t in self.master_restarts)

    def lost_between(self, start: float, end: float) -> bool:
        """Whether the master counted objects lost with a node (or cannot tell) meanwhile."""
        return _moved(self.losses, start, end)

    def eviction_between(self, start: float, end: float) -> bool:
        """Whether the counters moved (or cannot tell) between the last sample before `start`
        and the first after `end`."""
        return _moved(self.samples, start, end)

    def departure_between(self, segments: set[str] | None, start: float, end: float, pinned: bool) -> bool:
        """Whether an object on `segments` may have left between `start` and `end` without a
        remove: a node fault there, or (unpinned) an eviction or loss anywhere."""
        return self.node_fault_on(segments, start, end) or (not pinned and self.eviction_between(start, end))


def _counted(samples: list[tuple[int, float]]) -> list[tuple[int, float, int]]:
    """Samples of a counter by time, each with how many times the counter changed up to it: a
    master restart resets its counters, and one back at the value it had before (evictions
    15, a restart, 15 again) has moved all the same (a run's checker took it for still)."""
    changes = 0
    counted = []
    for index, (t, value) in enumerate(samples):
        changes += index > 0 and value != samples[index - 1][1]
        counted.append((t, value, changes))
    return counted


def _moved(samples: list[tuple[int, float, int]], start: float, end: float) -> bool:
    """Whether a sampled counter (`_counted` samples by time) changed, or a master restart reset
    it, from the last sample at or before `start` to the first at or after `end`; True if not
    sampled."""
    before = bisect.bisect_right(samples, (start, math.inf)) - 1
    after = bisect.bisect_left(samples, (end, -math.inf))
    if before < 0 or after >= len(samples):
        return True
    return samples[after][2] != samples[before][2]


class History:
    """The operations of a run, indexed for the checks: puts by value, removals by key, and
    where the master listed each key (the puts' `at`, the removes' `before`)."""

    def __init__(self, ops: list[Op], evidence: Evidence) -> None:
        self.evidence = evidence
        self.puts: dict[tuple[str, int, int], Op] = {}
        self.acked: dict[str, list[Op]] = defaultdict(list)
        self.reads_of: dict[str, list[Op]] = defaultdict(list)  # gets, exists, prefixes: a lease, a hold
        removes: dict[str, list[Op]] = defaultdict(list)
        self._regexes: list[Op] = []
        for op in ops:
            if op.f == "put":
                for index, key in enumerate(op.args["keys"]):
                    self.puts[(key, op.writer, op.sequence)] = op
                    if op.error is None and op.end != NEVER and op.result[index] == 0:
                        self.acked[key].append(op)
            elif op.f == "remove":
                removes[op.args["keys"][0]].append(op)
            elif op.f == "remove_by_regex":
                self._regexes.append(op)
            else:
                for key in op.args["keys"]:
                    self.reads_of[key].append(op)
        self._removes = removes
        # Moves between tiers (offloads of evicted objects, promotions, write-through copies):
        # any eviction counted, or a put asking for copies.
        self.moves_objects = any(count for _, count in evidence.evictions) or any(
            op.args.get("copies") for op in ops if op.f == "put"
        )

    @functools.cache
    def removals(self, key: str) -> list[Op]:
        return self._removes[key] + [r for r in self._regexes if re.search(r.args["pattern"], key)]

    def may_remove(self, removal: Op, key: str, put: Op) -> bool:
        """Whether `removal` may have removed the object `put` wrote under `key` (an error: it
        may have; so may one that found no such key while a restarted master waited for
        nodes: it refuses the key from them when they mount, tombstones.RemovedAtStart)."""
        if removal.error is not None or removal.end == NEVER:
            return True
        if self.evidence.master_away(removal.start, removal.end):
            return True
        if removal.f == "remove":
            return removal.result[0] == 0
        before = removal.args.get("before")
        if before is None or before.get(key):
            return True
        # Not listed when the runner looked, just before the call: `put` may yet have landed
        # after that look and before the pattern reached it (ended later, or still going).
        looked = removal.args.get("before_t", removal.start - CALL_BOUND_MS * 1_000_000)
        return put.start < removal.end and put.end > looked

    def took(self, removal: Op, key: str) -> bool:
        """Whether `removal` surely removed the object `key` had when it began: done, and for a
        regex, the master listed the key then (a forced one takes it; an unforced one spares
        an object under a read lease or a lookup's hold, which any reader's get, exists or
        prefix in the lease TTL before may hold)."""
        if removal.error is not None or removal.end == NEVER:
            return False
        if removal.f == "remove":
            return removal.result[0] == 0
        before = removal.args.get("before")
        if not before or not before.get(key):
            return False
        if removal.args.get("force", True):
            return True
        since = removal.start - (LEASE_TTL_MS + 1_000) * 1_000_000
        return not any(since <= r.start and r.start <= removal.end for r in self.reads_of[key])

    def ended(self, removal: Op, key: str, put: Op) -> bool:
        """Whether `removal` surely ended the value `put` wrote under `key` (put before it):
        it took the key's object, or it was a remove of the key that found none, `put` having
        been acknowledged (a put that failed may yet be committed after the remove)."""
        from kvpool.errors import ErrorCode

        if self.took(removal, key):
            return True
        return (
            removal.f == "remove" and removal.error is None and removal.end != NEVER
            and removal.result[0] == ErrorCode.OBJECT_NOT_FOUND and put in self.acked[key]
        )  # fmt: skip

    def may_be_unacknowledged(self, removal: Op, key: str, put: Op) -> bool:
        """Whether the drops of `removal`, which ended the object `put` wrote under `key`, may
        not have reached its nodes when it was answered. A remove answered as done while the
        nodes were linked had its drops acknowledged first (docs/ha.md), unless: a node fault
        or a master change came about it; it waited its second for a node slow to answer
        (REMOVE_DROPS_WAIT_MS); it found no object (an earlier removal's drops); or the run
        moved objects between tiers (a remove does not wait for a move: operations.md)."""
        if self.moves_objects or not self.took(removal, key):
            return True
        if (removal.end - removal.start) / 1e6 >= REMOVE_DROPS_WAIT_MS - 100:
            return True
        start, end, evidence = removal.start, removal.end, self.evidence
        return evidence.node_fault_on(self.where(key, put, start), start, end) or evidence.master_away(start, end)

    def where(self, key: str, put: Op, end: float) -> set[str] | None:
        """The segments the master listed for `key`'s object after `put` (its own sample and
        those of the acknowledged puts of the key that found it there until `end`: a put of an
        existing key leaves it as it is); None if `put` has no sample, or none listed one: the
        object had gone before the sample was taken (a put of a key that existed, answered
        OK, whose node died before the answer: seen in test_history_ha.py), so where it was
        is not known."""
        at = put.at or {}
        if key not in at:
            return None
        segments = set(at[key])
        for other in self.acked[key]:
            if put.end < other.end <= end and other.at and key in other.at:
                segments |= set(other.at[key])
        return segments or None


def run_checked(run: HistoryRun, checker=None, report_file: str = "report.json") -> tuple[list[str], dict, dict]:
    """Run `run` to its end, stop it, and check its history with `checker` (`check` when None):
    (the violations, the run's report, its final state)."""
    try:
        final = run.run()
    finally:
        run.stop()
    violations = (checker or check)(run.out_dir, final)
    return violations, json.loads((run.out_dir / report_file).read_text())["report"], final


def check(out_dir: Path, final: dict | None = None) -> list[str]:
    """The violations in the history recorded in `out_dir` (empty: none)."""
    ops, events = load(out_dir)
    evidence = Evidence(events)
    history = History(ops, evidence)
    puts = history.puts
    violations: list[str] = []
    reads: dict[str, list[tuple[Op, tuple[int, int]]]] = defaultdict(list)
    misses: dict[str, list[Op]] = defaultdict(list)
    excused: dict[str, int] = defaultdict(int)  # the allowances taken, by kind: the report's

    # Every result is typed and within its bound.
    longest = max((o for o in ops if o.end != NEVER), key=lambda o: o.end - o.start, default=None)
    for op in ops:
        if op.error is not None and not op.error["typed"]:
            violations.append(f"untyped error {op.error['err']}: {op.error['msg']} ({op.f} {op.args})")
        if op.end != NEVER and (op.end - op.start) / 1e6 > CALL_BOUND_MS + 1000:
            violations.append(f"{op.f} took {(op.end - op.start) / 1e6:.0f} ms > {CALL_BOUND_MS} ms bound")
    # Reads: every value is one a put of that key wrote, invoked before the read ended.
    for op in ops:
        if op.f not in ("get", "get_into") or op.error is not None or op.end == NEVER:
            continue
        for key, got in zip(op.args["keys"], op.result):
            if got is None:
                misses[key].append(op)
            elif isinstance(got, str):
                if got.startswith("bad"):
                    violations.append(f"{op.f} {key} returned {got}")
            else:
                writer, sequence = got
                put = puts.get((key, writer, sequence))
                if put is None or put.start > op.end:
                    violations.append(f"{op.f} {key} returned the bytes of a put that never began: {got}")
                    continue
                reads[key].append((op, (writer, sequence)))
    for key, key_reads in reads.items():
        pinned = key.startswith("p")
        # A value changes only after its object left: removed, evicted, lost. For each read and
        # each other value, the first read of that value after it is the one to look at.
        by_value: dict[tuple[int, int], list[Op]] = defaultdict(list)
        for read, version in key_reads:
            by_value[version].append(read)
        starts = {v: [r.start for r in value_reads] for v, value_reads in by_value.items()}
        for first, version in key_reads:
            for other, other_reads in by_value.items():
                index = bisect.bisect_right(starts[other], first.end)
                if other == version or index == len(other_reads):
                    continue
                second = other_reads[index]
                put = puts[(key, *other)]
                if put.end < first.start:
                    # Its object had left and came back: one lost with a node the master timed
                    # out comes back with it (documented); so does one hidden by a master
                    # restart, whose key was put anew meanwhile (`version`), once that left.
                    was = history.where(key, put, second.end)
                    if evidence.node_fault_on(was, put.start, second.end) and evidence.lost_between(
                        put.start, second.end
                    ):
                        excused["value back with its node"] += 1
                    elif evidence.master_away(puts[(key, *version)].start, puts[(key, *version)].end):
                        excused["value back after a master restart hid it"] += 1
                    else:
                        violations.append(f"{key}: read {version} then {other}, whose put had ended before")
                gone = puts[(key, *version)]
                if any(r.start < second.end and r.end > first.start and history.may_remove(r, key, gone)
                       for r in history.removals(key)):  # fmt: skip
                    continue
                was = history.where(key, puts[(key, *version)], second.end)
                if evidence.departure_between(was, first.start, second.end, pinned):
                    excused["value replaced after a fault or eviction"] += 1
                elif evidence.master_away(put.start, put.end):
                    # A restarted master knows no object of a node not back yet: a put of the
                    # key meanwhile stores anew, and the node's copy is refused when it is.
                    excused["value replaced while the master was away"] += 1
                else:
                    violations.append(f"{key}: read {version} then {other} with nothing removing {version}")
        # A removed value does not come back.
        # Nor does one a remove of its key found no more (lost with a node the master timed
        # out: the master keeps what such a node held, tombstones.py).
        for read, version in key_reads:
            put = puts[(key, *version)]
            for removal in history.removals(key):
                if not (put.end < removal.start and removal.end < read.start and history.ended(removal, key, put)):
                    continue
                # Documented limit (docs/operations.md): a master restart forgets the drops a
                # node had not acknowledged and what a node away held.
                is_restarted = evidence.restart_between(removal.start, read.end)
                if is_restarted and history.may_be_unacknowledged(removal, key, put):
                    excused["removed value back after a master restart"] += 1
                else:
                    violations.append(f"{key}: {read.f} returned {version} after a remove that ended it "
                                      f"({removal.f} {removal.writer}/{removal.sequence})")  # fmt: skip
    # An acknowledged pinned put stays readable unless it left (removed, a fault on a node that
    # held it), or while a master restart hides it.
    for key, key_acks in history.acked.items():
        if not key.startswith("p"):
            continue
        for put in key_acks:
            for miss in misses[key]:
                if miss.start <= put.end:
                    continue
                if any(r.start < miss.end and r.end > put.start and history.may_remove(r, key, put)
                       for r in history.removals(key)):  # fmt: skip
                    continue
                if evidence.master_away(miss.start, miss.end):
                    excused["pinned miss while the master was away"] += 1
                # A put of a key held only by a node whose connection is lost writes it anew
                # (PutFlow.start); one held by a stopped node (its connection open until the TTL)
                # is answered OK without writing, within that node's fault. The master may list
                # no replica after the put (its TTL dropped the stopped node's meanwhile, or a
                # fault right after the put): an empty sample is any node's fault.
                elif evidence.departure_between(history.where(key, put, miss.end), put.start, miss.end, True):
                    excused["pinned miss after a fault on its node"] += 1
                else:
                    violations.append(f"{key}: a miss after acknowledged put {put.writer}/{put.sequence}")
                    break
    if final is not None:
        violations += check_final(final)
    violations = list(dict.fromkeys(violations))
    report = {"ops": len(ops), "unfinished": sum(o.end == NEVER for o in ops),
              "errors": sum(o.error is not None for o in ops),
              "faults": sum(e["what"] in TIER_FAULTS for e in events),
              "longest_ms": None if longest is None else (longest.end - longest.start) / 1e6,
              "longest_op": None if longest is None else longest.f,
              "reads": sum(len(r) for r in reads.values()), "misses": sum(len(m) for m in misses.values()),
              "evictions": sum(max(0, b[1] - a[1]) for a, b in zip(evidence.evictions, evidence.evictions[1:])),
              "fault_kinds": sorted({e["what"] for e in events if e["what"] in TIER_FAULTS}),
              "excused": dict(excused), "violations": len(violations)}  # fmt: skip
    (out_dir / "report.json").write_text(json.dumps({"report": report, "violations": violations}, indent=1))
    return violations


def check_final(final: dict) -> list[str]:
    """In a quiet cluster: exists, longest_prefix and get agree; the master's use of each DRAM
    segment is what its node holds."""
    violations = []
    present = {k: g is not None for k, g in zip(final["keys"], final["got"])}
    for key, exists, got in zip(final["keys"], final["exists"], final["got"]):
        if isinstance(got, str):
            violations.append(f"final get {key}: {got}")
        if exists != (got is not None):
            violations.append(f"final: exists({key}) is {exists} but get returned {got}")
    for keys, count in final["prefixes"]:
        expected = next((i for i, k in enumerate(keys) if not present[k]), len(keys))
        if count != expected:
            violations.append(f"final: longest_prefix of {len(keys)} keys is {count}, gets say {expected}")
    from kvpool.master.allocator import footprint_bytes

    for segment, used in final["node_used"].items():
        sizes = final["held"].get(segment, [])
        footprint = sum(footprint_bytes(size) for size in sizes)
        if final["master_used"].get(segment) != footprint or used != sum(sizes):
            counted = final["master_used"].get(segment)
            violations.append(f"final: segment {segment}: the master counts {counted} bytes used for replicas "
                              f"of {footprint}, its node holds {used} for {sum(sizes)}")  # fmt: skip
    for segment, tier in final.get("tiers", {}).items():
        from kvpool.protocol import objectfile

        temporary = [f for f in tier["files"] if objectfile.is_temp_name(Path(f).name)]
        # A node killed while it wrote a DFS file leaves its temporary file to the master, which
        # removes those over an hour old (docs/tiers.md): no other host can tell it is dead.
        left = [f for f in temporary if not (tier["dfs"] and _killed_writing(tier["temporary"][f], final))]
        if left:
            violations.append(f"final: tier {segment}: temporary files left: {left[:5]}")
        whole = {f for f in tier["files"] if f not in temporary}
        if whole != set(tier["listed"]):
            violations.append(f"final: tier {segment}: files no replica names {sorted(whole - set(tier['listed']))[:5]}"
                              f", replicas without a file {sorted(set(tier['listed']) - whole)[:5]}")  # fmt: skip
    return violations


def _killed_writing(modified_s: float, final: dict) -> bool:
    """Whether a file last written at `modified_s` may be a killed node's (written up to the
    kill: a copy runs for at most the master's move timeout, far less here)."""
    return any(kill - 60 <= modified_s <= kill + 1 for kill in final.get("node_kills", ()))


def main() -> None:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    client = commands.add_parser("client")
    client.add_argument("--master", required=True)
    client.add_argument("--out-dir", type=Path, required=True)
    client.add_argument("--writer", type=int, required=True)
    client.add_argument("--client", type=int, required=True)
    client.add_argument("--seed", type=int, required=True)
    client.add_argument("--duration-s", type=float, required=True)
    client.add_argument("--shm", action=argparse.BooleanOptionalAction, default=True)
    client.add_argument("--dfs-dir", default="")
    client.add_argument("--key-space", type=int, default=100)
    run = commands.add_parser("run")
    run.add_argument("--out-dir", type=Path, required=True)
    run.add_argument("--seed", type=int, default=1)
    run.add_argument("--duration-s", type=float, default=60)
    run.add_argument("--fault-gap-s", type=float, default=3.0)
    run.add_argument("--tiers", action="store_true", help="disk tiers on every node, a shared DFS, promotions")
    run.add_argument("--memory", default="4MiB")
    run.add_argument("--disk-size", default="24MiB")
    run.add_argument("--key-space", type=int, default=100)
    run.add_argument("--nodes", type=int, default=3)
    args = parser.parse_args()
    if args.command == "client":
        run_client(args.master, args.out_dir, args.writer, args.client, args.seed, args.duration_s, args.shm,
                   args.dfs_dir, args.key_space)  # fmt: skip
        return
    args.out_dir.mkdir(parents=True, exist_ok=True)
    history = HistoryRun(args.out_dir, args.seed, args.duration_s, nodes=args.nodes, fault_gap_s=args.fault_gap_s,
                         memory=args.memory, tiers=args.tiers, disk_size=args.disk_size,
                         key_space=args.key_space)  # fmt: skip
    violations, report, final = run_checked(history)
    (args.out_dir / "final.json").write_text(json.dumps(final))
    print(json.dumps(report))
    for violation in violations[:50]:
        print(violation)


if __name__ == "__main__":
    main()
