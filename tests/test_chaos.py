"""Chaos: real processes, real signals, a real etcd, and every byte checked (`pytest -m chaos`).

How: a local etcd (the `etcd_endpoint` fixture), two HA master candidates, four nodes and three
load generator processes (kvpool/cli/loadgen.py: 1 put : 4 gets of 32-192 KiB objects with two
replicas, TCP and shm clients, each read compared with the key's one true value). Under that
load the test injects, one after the other: SIGKILL of a node; SIGSTOP of a node past its TTL,
then SIGCONT; SIGKILL of the leader with a standby; SIGKILL of the last master (no standby), then
a restart; a writer killed between put_start and put_end; a client killed while it holds read
leases. A probe client in this process measures how long each fault keeps reads and puts from
being served. Then every acknowledged key is read back. The second test cuts a node off from
the master but not from its clients with network namespaces (root only; skipped otherwise).

The figures go to the terminal as a table and to `chaos-report.json` in the test's tmp dir:
operations, faults, gets with wrong bytes (must be 0), acknowledged objects lost although a
replica holder survived (must be 0), the longest client call against its bound, the recovery
time after each fault (leader failover: reads again within 10 s), and the fault-free mixed
load's throughput and p50/p99.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table

from kvpool import ErrorCode, ReplicateConfig, Store
from kvpool.cli.launcher import LocalCluster
from kvpool.cli.loadgen import read_acked, summarize, value_of
from kvpool.errors import KVPoolError

pytestmark = pytest.mark.chaos

RPC_TIMEOUT_MS, CONNECT_TIMEOUT_MS, TRANSFER_TIMEOUT_MS = 3_000, 1_000, 3_000
CLIENT = dict(rpc_timeout_ms=RPC_TIMEOUT_MS, connect_timeout_ms=CONNECT_TIMEOUT_MS,
              transfer_timeout_ms=TRANSFER_TIMEOUT_MS)  # fmt: skip
CALL_BOUND_MS = TRANSFER_TIMEOUT_MS + 3 * RPC_TIMEOUT_MS  # sync.Store's bound on one call
NODE_TTL_MS, READ_LEASE_MS = 3_000, 4_000
PUT_DISCARD_MS, PUT_RELEASE_MS = 5_000, 7_000
MASTER_ARGS = (
    "--node-ttl-ms", str(NODE_TTL_MS), "--lease-ttl-ms", str(READ_LEASE_MS),
    "--put-discard-timeout-ms", str(PUT_DISCARD_MS), "--put-release-timeout-ms", str(PUT_RELEASE_MS),
)  # fmt: skip
SIZE_MIN, SIZE_MAX = 32 * 1024, 192 * 1024
FAILOVER_TARGET_S = 10.0
RECOVERY_TIMEOUT_S = 25.0
BASELINE_S = 3.0


class Report:
    """The rows of the chaos table, and the figures under it."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.faults: list[dict] = []
        self.figures: dict[str, object] = {}

    def fault(self, name: str, recovered_s: float | None, note: str = "") -> None:
        self.faults.append({"fault": name, "recovered_s": recovered_s, "note": note})

    def show(self, path: Path) -> str:
        table = Table(title=self.title, title_justify="left")
        table.add_column("fault injected")
        table.add_column("took", justify="right")
        table.add_column("until")
        for row in self.faults:
            recovered = "never" if row["recovered_s"] is None else f"{row['recovered_s']:.2f} s"
            table.add_row(row["fault"], recovered, row["note"])
        figures = Table(show_header=False, box=None)
        for name, value in self.figures.items():
            figures.add_row(name, str(value))
        console = Console(width=140, record=True, file=io.StringIO())
        console.print(table)
        console.print(figures)
        path.write_text(json.dumps({"faults": self.faults, "figures": self.figures}, indent=2))
        return console.export_text()


def measure(
    check: Callable[[], bool], timeout_s: float = RECOVERY_TIMEOUT_S, since: float | None = None
) -> float | None:
    """Seconds from `since` (default: now) until `check()` first holds; None if it never did."""
    since = time.monotonic() if since is None else since
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return time.monotonic() - since
        except KVPoolError:
            pass  # Failing cleanly is what a fault looks like from here: keep probing.
        time.sleep(0.1)
    return None


def measure_each(checks: dict[str, Callable[[], bool]], since: float) -> dict[str, float | None]:
    """`measure` for several checks polled side by side: seconds from `since` for each."""
    took: dict[str, float | None] = dict.fromkeys(checks)
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while time.monotonic() < deadline and None in took.values():
        for name, check in checks.items():
            if took[name] is None:
                try:
                    if check():
                        took[name] = time.monotonic() - since
                except KVPoolError:
                    pass
        time.sleep(0.1)
    return took


class Probe:
    """A client in the test process: reads a sample of acknowledged keys, writes fresh ones."""

    def __init__(self, address: str, out_dir: Path, **options) -> None:
        self.store = Store(address, shm_enabled=False, **{**CLIENT, **options})
        self.out_dir = out_dir
        self.serial = 0
        self.wrong = 0

    def sample(self, avoid_segments: set[str], count: int = 12) -> list[str]:
        """Acknowledged keys with a replica outside `avoid_segments`."""
        acked = read_acked(self.out_dir)
        keys = [k for k, segs in acked.items() if segs and set(segs) - avoid_segments]
        return keys[-count:]

    def can_read(self, keys: list[str]) -> bool:
        got = self.store.get_batch(keys)
        for key, data in zip(keys, got):
            if data is not None and data != value_of(key, SIZE_MIN, SIZE_MAX):
                self.wrong += 1
        return all(data is not None for data in got)

    def can_put(self) -> bool:
        self.serial += 1
        key = f"probe/{os.getpid()}/{self.serial}"
        value = os.urandom(4096)
        if self.store.put_batch([key], [value], ReplicateConfig(replica_num=2))[0] != ErrorCode.OK:
            return False
        return self.store.get(key) == value

    def serves(self, keys: list[str]) -> bool:
        return self.can_read(keys) and self.can_put()

    def close(self) -> None:
        try:
            self.store.close()
        except KVPoolError:
            pass


def start_workers(address: str, out_dir: Path, count: int, *, run_id: str, rate: float,
                  token_file: str | None = None) -> list[subprocess.Popen]:  # fmt: skip
    workers = []
    for i in range(count):
        command = [
            sys.executable, "-m", "kvpool.cli.loadgen", "--master", address, "--out-dir", str(out_dir),
            "--worker-id", str(i), "--run-id", run_id, "--duration-s", "600", "--rate", str(rate),
            "--put-ratio", "0.2", "--size-min", str(SIZE_MIN), "--size-max", str(SIZE_MAX),
            "--replicas", "2", "--puts-max", "300", "--shm", "1" if i == count - 1 else "0",
            "--rpc-timeout-ms", str(RPC_TIMEOUT_MS), "--connect-timeout-ms", str(CONNECT_TIMEOUT_MS),
            "--transfer-timeout-ms", str(TRANSFER_TIMEOUT_MS),
        ]  # fmt: skip
        if token_file:
            command += ["--token-file", token_file]
        worker = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        workers.append(worker)
    for worker in workers:
        assert worker.stdout is not None and worker.stdout.readline().strip() == b"ready"
    return workers


def stop_workers(workers: list[subprocess.Popen], out_dir: Path) -> list[dict]:
    for worker in workers:
        worker.send_signal(signal.SIGTERM)
    for worker in workers:
        try:
            worker.wait(CALL_BOUND_MS / 1000 + 10)  # a call in flight finishes within its bound
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait(10)
    return [json.loads(p.read_text()) for p in sorted(out_dir.glob("stats-*.json"))]


def spawn_scripts(*commands: tuple[str, ...]) -> list[subprocess.Popen]:
    """Client processes (started side by side) that each print "done" once they did what they
    came for, then wait to be killed."""
    processes = [
        subprocess.Popen([sys.executable, "-c", *command], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        for command in commands
    ]
    for process in processes:
        assert process.stdout is not None and process.stdout.readline().strip() == b"done"
    return processes


ZOMBIE_WRITER = """
import asyncio, sys, uvloop
from kvpool.client.store import AsyncStore

async def main():
    store = await AsyncStore.open(sys.argv[1])
    reply = await store._put_start([sys.argv[2]], [[memoryview(bytes(1 << 20))]], None)
    assert reply.codes == [0], reply.codes
    print("done", flush=True)
    await asyncio.sleep(3600)

uvloop.run(main())
"""

LEASE_HOLDER = """
import asyncio, sys, uvloop
from kvpool.client.store import AsyncStore

async def main():
    store = await AsyncStore.open(sys.argv[1])
    keys = sys.argv[2:]
    job = await store._locate(keys, [None] * len(keys))  # get_replica_list: read leases taken
    assert list(job.codes) == [0] * len(keys), job.codes
    print("done", flush=True)
    await asyncio.sleep(3600)

uvloop.run(main())
"""


def check_acknowledged(probe: Probe, out_dir: Path, dead_segments: set[str]) -> dict:
    """Read back every acknowledged key: wrong bytes, and losses a surviving holder excuses not."""
    acked = read_acked(out_dir)
    keys = list(acked)
    wrong: list[str] = []
    missing: list[str] = []
    for start in range(0, len(keys), 64):
        chunk = keys[start : start + 64]
        for key, data in zip(chunk, probe.store.get_batch(chunk)):
            if data is None:
                missing.append(key)
            elif data != value_of(key, SIZE_MIN, SIZE_MAX):
                wrong.append(key)
    lost = [k for k in missing if acked[k] and set(acked[k]) - dead_segments]
    excused = [k for k in missing if acked[k] and not set(acked[k]) - dead_segments]
    unknown = [k for k in missing if not acked[k]]
    return {"acked": len(keys), "wrong": wrong, "lost": lost, "excused": excused, "unknown": unknown}


def segment_ids(store: Store) -> set[str]:
    return {s.segment.segment_id for s in store.cluster_status().segments}


def test_chaos_ha_cluster_under_faults(make_cluster, etcd_endpoint, tmp_path, capsys):
    cluster: LocalCluster = make_cluster(
        4, "160MiB", etcd_endpoint=etcd_endpoint, cluster_id=f"chaos-{os.getpid()}",
        master_count=2, master_args=MASTER_ARGS,
    )  # fmt: skip
    out_dir = tmp_path / "load"
    report = Report("kvpool chaos: HA masters on etcd, 4 nodes, 3 client processes")
    workers = start_workers(cluster.master_address, out_dir, 3, run_id="chaos", rate=40)
    probe = Probe(cluster.master_address, out_dir)
    stats: list[dict] = []
    dead: set[str] = set()
    faults = 0
    try:
        baseline_from = time.time() * 1000
        time.sleep(BASELINE_S)
        baseline_window = (baseline_from, time.time() * 1000)

        # 1. A node dies in the middle of puts and gets (replicas elsewhere survive).
        victim = cluster.nodes[0]
        dead.add(victim.info["segment_id"])
        victim.kill()
        faults += 1
        sample = probe.sample(dead)
        report.fault("node SIGKILL mid put/get", measure(lambda: probe.serves(sample)),
                     "surviving replicas read, new puts land")  # fmt: skip

        # 2. A node hangs past its TTL (a hung peer, not a dead one), then comes back.
        hung = cluster.nodes[1]
        hung_segment = hung.info["segment_id"]
        hung.signal(signal.SIGSTOP)
        faults += 1
        stopped_at = time.monotonic()
        sample = probe.sample(dead | {hung_segment})
        while_hung = measure(lambda: probe.serves(sample), timeout_s=NODE_TTL_MS / 1000 + 8)
        dropped = measure(lambda: hung_segment not in segment_ids(probe.store), since=stopped_at)
        hung.signal(signal.SIGCONT)
        report.fault("node SIGSTOP (hung, not dead)", while_hung, "reads and puts served by the other nodes")
        report.fault("  ... master drops it", dropped, f"node TTL {NODE_TTL_MS} ms")
        report.fault("  ... then SIGCONT", measure(lambda: hung_segment in segment_ids(probe.store)),
                     "re-mounted with its inventory")  # fmt: skip

        # 3. The leader dies under load; the standby takes over.
        leader = cluster.wait_leader()
        sample = probe.sample(dead)
        leader.kill()
        faults += 1
        failover_s = measure(lambda: probe.serves(sample))
        report.fault("leader SIGKILL, standby running", failover_s,
                     f"reads and puts served by the new leader (target {FAILOVER_TARGET_S:.0f} s)")  # fmt: skip

        # 4. The last master dies (no standby); an operator or supervisor restarts one.
        last = cluster.wait_leader(roles=("leader", "recovering"))
        sample = probe.sample(dead)
        last.kill()
        faults += 1
        killed_at = time.monotonic()
        time.sleep(1.0)  # a supervisor's restart delay
        cluster.start_master()
        report.fault("leader SIGKILL, no standby (restart 1 s later)",
                     measure(lambda: probe.serves(sample), since=killed_at),
                     "reads and puts served again, counted from the kill "
                     "(the dead leader's lease lapses first)")  # fmt: skip

        # 5 and 6, side by side: a writer killed between put_start and put_end, and a client
        # killed while it holds read leases.
        leased = {f"chaos/leased/{i}": os.urandom(8192) for i in range(4)}
        assert probe.store.put_batch(list(leased), list(leased.values())) == [ErrorCode.OK] * 4
        writer, reader = spawn_scripts((ZOMBIE_WRITER, cluster.master_address, "chaos/zombie"),
                                       (LEASE_HOLDER, cluster.master_address, *leased))  # fmt: skip
        writer.kill()
        reader.kill()
        killed_at = time.monotonic()
        faults += 2
        writer.wait(10)
        reader.wait(10)
        assert probe.store.put_batch(["chaos/zombie"], [b"x"]) == [ErrorCode.REPLICA_IS_NOT_READY]
        assert probe.store.batch_remove(list(leased)) == [ErrorCode.OBJECT_HAS_LEASE] * 4
        removed: set[str] = set()

        def leases_lapsed() -> bool:
            rest = [k for k in leased if k not in removed]
            codes = probe.store.batch_remove(rest)
            removed.update(k for k, code in zip(rest, codes) if code == ErrorCode.OK)
            return len(removed) == len(leased)

        took = measure_each({
            "zombie": lambda: probe.store.put_batch(["chaos/zombie"], [b"fresh"])[0] == ErrorCode.OK,
            "leases": leases_lapsed,
        }, since=killed_at)  # fmt: skip
        report.fault("writer SIGKILL between put_start and put_end", took["zombie"],
                     f"key free again (discard timeout {PUT_DISCARD_MS} ms)")  # fmt: skip
        report.fault("client SIGKILL holding read leases", took["leases"],
                     f"objects removable again (lease {READ_LEASE_MS} ms)")  # fmt: skip
        assert probe.store.get("chaos/zombie") == b"fresh"
    finally:
        stats = stop_workers(workers, out_dir)

    # Every acknowledged object is readable, unless all of its holders were SIGKILLed.
    outcome = check_acknowledged(probe, out_dir, dead)
    probe.close()
    load = summarize(stats)
    baseline = summarize(stats, baseline_window)
    longest_ms = max(s["max_latency_ms"] for s in stats)
    wrong_gets = load["outcomes"].get("get_wrong", 0) + probe.wrong + len(outcome["wrong"])
    report.figures = {
        "operations tried (3 client processes)": f"{load['ops']} ({load['outcomes']})",
        "faults injected": faults,
        "gets that returned wrong bytes": wrong_gets,
        "acknowledged objects lost although a replica holder survived": len(outcome["lost"]),
        "acknowledged objects (lost with all holders SIGKILLed / holders unknown)":
            f"{outcome['acked']} ({len(outcome['excused'])} / {len(outcome['unknown'])})",
        "longest client call": f"{longest_ms:.0f} ms (bound {CALL_BOUND_MS} ms)",
        "client errors (clean, during faults)": {k: v for s in stats for k, v in s["errors"].items()},
        f"mixed load, fault-free {BASELINE_S:.0f} s "
        f"(1:4, {SIZE_MIN >> 10}-{SIZE_MAX >> 10} KiB, paced 40 ops/s/client)":
            f"{baseline['ops_per_s']} ops/s, {baseline['mib_per_s']} MiB/s, put p50/p99 "
            f"{baseline['put_p50_ms']}/{baseline['put_p99_ms']} ms, get p50/p99 "
            f"{baseline['get_p50_ms']}/{baseline['get_p99_ms']} ms",
    }  # fmt: skip
    text = report.show(tmp_path / "chaos-report.json")
    with capsys.disabled():
        print("\n" + text)
    assert wrong_gets == 0, outcome["wrong"]
    assert not outcome["lost"], outcome["lost"][:10]
    assert longest_ms <= CALL_BOUND_MS + 500, longest_ms
    for row in report.faults:
        assert row["recovered_s"] is not None, row
    assert failover_s is not None and failover_s <= FAILOVER_TARGET_S, failover_s


# --- a node cut off from the master, not from its clients (network namespaces) -------------------

NETNS_REASON = ""
if os.geteuid() != 0:
    NETNS_REASON = "network namespaces need root"
elif shutil.which("ip") is None:
    NETNS_REASON = "no `ip` command (iproute2)"


class Namespace:
    """A network namespace holding one node, joined to this host by two veth pairs: one the
    node uses to reach the master, one its clients use to reach it. Cutting the first leaves
    the second. Addresses are link-local to these veths (10.199.77.0/30 and 10.199.78.0/30),
    which exist only while the test runs; nothing else is ever addressed."""

    MASTER_HOST, MASTER_NODE_SIDE = "10.199.77.1", "10.199.77.2"
    CLIENT_HOST, NODE_ADDRESS = "10.199.78.1", "10.199.78.2"

    def __init__(self) -> None:
        tag = os.getpid() % 100_000
        self.name = f"kvpool-chaos-{tag}"
        self.master_link, self.client_link = f"kvm{tag}", f"kvc{tag}"

    def ip(self, *args: str, inside: bool = False) -> None:
        prefix = ["ip", "netns", "exec", self.name] if inside else []
        subprocess.run([*prefix, "ip", *args], check=True, capture_output=True, timeout=10)

    def create(self) -> None:
        for subnet in ("10.199.77.0/30", "10.199.78.0/30"):
            routes = subprocess.run(["ip", "-4", "route", "show", subnet], capture_output=True, text=True)
            if routes.stdout.strip():
                raise OSError(f"{subnet} is already routed here: {routes.stdout.strip()}")
        self.ip("netns", "add", self.name)
        self.ip("link", "set", "lo", "up", inside=True)
        for link, host, peer in ((self.master_link, self.MASTER_HOST, self.MASTER_NODE_SIDE),
                                 (self.client_link, self.CLIENT_HOST, self.NODE_ADDRESS)):  # fmt: skip
            self.ip("link", "add", f"{link}h", "type", "veth", "peer", "name", f"{link}n")
            self.ip("link", "set", f"{link}n", "netns", self.name)
            self.ip("addr", "add", f"{host}/30", "dev", f"{link}h")
            self.ip("link", "set", f"{link}h", "up")
            self.ip("addr", "add", f"{peer}/30", "dev", f"{link}n", inside=True)
            self.ip("link", "set", f"{link}n", "up", inside=True)

    def cut_from_master(self) -> None:
        self.ip("link", "set", f"{self.master_link}n", "down", inside=True)

    def heal(self) -> None:
        self.ip("link", "set", f"{self.master_link}n", "up", inside=True)

    def delete(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=10)
        for link in (self.master_link, self.client_link):  # gone with the namespace, normally
            subprocess.run(["ip", "link", "del", f"{link}h"], capture_output=True, timeout=10)

    @property
    def wrapper(self) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.name)


@pytest.mark.skipif(bool(NETNS_REASON), reason=NETNS_REASON or "-")
def test_chaos_node_cut_off_from_master_but_not_from_clients(make_cluster, tmp_path, capsys):
    namespace = Namespace()
    try:
        namespace.create()
    except (OSError, subprocess.CalledProcessError) as exc:
        namespace.delete()
        detail = exc.stderr.decode(errors="replace").strip() if isinstance(exc, subprocess.CalledProcessError) else exc
        pytest.skip(f"network namespaces unavailable here: {detail}")
    token = "chaos-netns-token"  # a server bound off loopback needs the cluster token
    try:
        cluster: LocalCluster = make_cluster(
            2, "32MiB", token=token,
            master_args=("--host", Namespace.MASTER_HOST, "--node-ttl-ms", str(NODE_TTL_MS)),
        )  # fmt: skip
        cut = cluster.start_node(
            ("--host", Namespace.NODE_ADDRESS, "--no-shm"), memory="32MiB", wrapper=namespace.wrapper
        )
        cut_segment = cut.info["segment_id"]
        report = Report("kvpool chaos: a node cut off from the master, not from its clients")
        with Store(cluster.master_address, token=token, shm_enabled=False, **CLIENT) as store:
            values = {f"netns/{i}": os.urandom(64 * 1024) for i in range(24)}
            config = ReplicateConfig(placement="preferred", preferred_segments=[cut_segment])
            assert store.put_batch(list(values), list(values.values()), config) == [ErrorCode.OK] * 24
            held = [k for k, r in zip(values, store.query(list(values)).replicas) if r[0].segment_id == cut_segment]
            assert held, "no object landed on the namespaced node"

            def read_all() -> list[bytes | None]:
                got = store.get_batch(list(values))
                assert all(g in (None, v) for g, v in zip(got, values.values())), "wrong bytes"
                return got

            namespace.cut_from_master()
            cut_at = time.monotonic()
            # Its clients still reach it: until the master drops it, its objects are read.
            assert read_all() == list(values.values())
            dropped_s = measure(lambda: cut_segment not in segment_ids(store), since=cut_at)
            during = read_all()
            assert all(during[list(values).index(k)] is None for k in held)  # clean misses
            namespace.heal()
            healed_at = time.monotonic()
            back_s = measure(lambda: read_all() == list(values.values()), since=healed_at)
        report.fault("node cut off from the master (link down in its namespace)", dropped_s,
                     f"master drops it (TTL {NODE_TTL_MS} ms); until then its clients read it, "
                     "after: clean misses")  # fmt: skip
        report.fault("  ... then healed", back_s, f"re-mounted: all {len(held)} objects it holds read again")
        report.figures = {"objects held by the cut node": len(held), "lost": 0 if back_s is not None else len(held)}
        text = report.show(tmp_path / "chaos-netns-report.json")
        with capsys.disabled():
            print("\n" + text)
        assert dropped_s is not None and back_s is not None
    finally:
        namespace.delete()
