"""The history checker (tests/history_check.py) on a cluster of HA masters on etcd.

A real etcd on 127.0.0.1, two or three master candidates, nodes and clients given the
`etcd://` address as operators deploy them (docs/ha.md). The nemesis kills the leader
(SIGKILL, then a new candidate), freezes it past its etcd lease (SIGSTOP, then SIGCONT: a
stale leader that wakes up), stops it gracefully (SIGTERM, then a new candidate), kills a
node or a client, or freezes etcd briefly. Each leader fault is recorded as the checker's
`kill_master` ... `master_back` pair, `master_back` once a leader is open and every live
node has re-mounted on it (its disk tier too), so the checker's evidence treats a failover as
it treats a master restart. With `--tiers` (HistoryRun's tiers: 4 MiB of DRAM over disk tiers,
a shared DFS the masters index, promotions) the nemesis also kills every node at once, and
objects move between tiers across failovers.

`check_ha` adds, on top of the checker's properties: no acknowledged put read as missing
while its object could not have left (no remove, no node fault, no eviction in the run, and
the cluster whole again after a failover); every call within what docs/ha.md bounds it by;
every failover over within its bound; one leader per term in the masters' logs.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the tests package as pytest does
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvpool.cli.launcher import LocalCluster, LocalEtcd
from kvpool.errors import ConnectFailed
from tests.history_check import (
    CONNECT_TIMEOUT_MS,
    NEVER,
    RPC_TIMEOUT_MS,
    TOKEN,
    TRANSFER_TIMEOUT_MS,
    Evidence,
    History,
    HistoryRun,
    check,
    load,
    run_checked,
    segments_of,
)

# The events that record a fault (a leader fault is a kill_master with its `how`).
FAULT_EVENTS = ("kill_master", "kill_node", "kill_client", "kill_all_nodes")
# Each kind once first, in this order (the quickest first: a short run injects them all).
HA_FAULTS = ("kill_client", "kill_node", "stop_etcd", "term_leader", "kill_leader", "stop_leader")
ETCD_LEASE_TTL_MS, REMOUNT_GRACE_MS = 3_000, 3_000
# Added to the run's master flags (HistoryRun's, with tiers its DFS's too).
HA_ARGS = ("--etcd-lease-ttl-ms", str(ETCD_LEASE_TTL_MS), "--remount-grace-ms", str(REMOUNT_GRACE_MS))
# docs/ha.md: a master request ends within connect + RPC timeout, and a thread opening its
# connection to a master that stopped answering adds at most 1 s.
MASTER_CALL_BOUND_MS = CONNECT_TIMEOUT_MS + RPC_TIMEOUT_MS + 1_000
# A frozen leader costs up to its lease plus a node's heartbeat timeout (RPC timeout, 5 s by
# default) before the nodes re-mount, then the takeover's grace at most; and some slack.
FAILOVER_BOUND_MS = ETCD_LEASE_TTL_MS + 5_000 + REMOUNT_GRACE_MS + 3_000
# Memory enough that nothing is evicted (~100 keys of 1-512 KiB, 2 replicas at most).
MEMORY = "48MiB"


class EtcdCluster(LocalCluster):
    """A LocalCluster of master candidates whose clients are given the etcd address."""

    @property
    def master_endpoint(self) -> str:
        return self.master_address


class HAHistoryRun(HistoryRun):
    """HistoryRun with its own etcd and `masters` candidates, and the HA nemesis."""

    def __init__(self, out_dir: Path, seed: int, duration_s: float, masters: int = 2, clients: int = 3,
                 nodes: int = 3, memory: str = MEMORY, fault_gap_s: float = 3.0,
                 faults: tuple[str, ...] = HA_FAULTS, **tier_options) -> None:  # fmt: skip
        """`tier_options`: HistoryRun's (tiers=True, disk_size, key_space); with tiers the
        nemesis also kills every node at once."""
        super().__init__(out_dir, seed, duration_s, clients, nodes, memory, fault_gap_s, disk=True, **tier_options)
        self.masters = masters
        self.faults = (*faults, "kill_all_nodes") if self.tiers else faults
        self.etcd = LocalEtcd(out_dir)

    def start(self) -> None:
        self.etcd.start()
        self.cluster = EtcdCluster(0, self.cluster.memory, master_args=(*self.cluster.master_args, *HA_ARGS),
                                   workdir=self.out_dir / "cluster",
                                   etcd_endpoint=self.etcd.endpoint, cluster_id=f"history-{self.seed}",
                                   master_count=self.masters, token=TOKEN)  # fmt: skip
        super().start()
        self._back(time.monotonic())

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            self.etcd.stop()

    # --- the nemesis ------------------------------------------------------------------------

    def nemesis(self) -> None:
        """One fault every `fault_gap_s`, each kind once first, then in a seeded order."""
        index = 0
        while not self._stop.wait(self.fault_gap_s):
            if index >= len(self.faults):
                self.every_fault_ran.set()
            fault = self.faults[index] if index < len(self.faults) else self.rng.choice(self.faults)
            index += 1
            getattr(self, fault)()

    def kill_leader(self) -> None:
        leader = self.cluster.master
        started = time.monotonic()
        self.event(what="kill_master", how="kill_leader", pid=leader.pid)
        leader.kill()
        self._stop.wait(self.rng.uniform(0.2, 2.0))
        self.cluster.start_master()  # a candidate again, as a supervisor would restart it
        self._back(started)

    def stop_leader(self) -> None:
        """Frozen past its etcd lease: a successor wins meanwhile, and it wakes up stale."""
        leader = self.cluster.master
        started = time.monotonic()
        self.event(what="kill_master", how="stop_leader", pid=leader.pid)
        leader.signal(signal.SIGSTOP)
        time.sleep(ETCD_LEASE_TTL_MS / 1000 + self.rng.uniform(0.3, 2.0))  # even if the run ends
        wakes_late = self.rng.random() < 0.5  # once its successor is whole, else meanwhile
        if wakes_late:
            self._back(started)
        leader.signal(signal.SIGCONT)
        self.event(what="cont_leader", pid=leader.pid)
        if not wakes_late:
            self._back(started)

    def term_leader(self) -> None:
        leader = self.cluster.master
        started = time.monotonic()
        self.event(what="kill_master", how="term_leader", pid=leader.pid)
        leader.stop()
        self.cluster.start_master()
        self._back(started)

    def stop_etcd(self) -> None:
        """etcd frozen for less than a leader's margin: no failover is needed, one may happen."""
        assert self.etcd.process is not None
        started = time.monotonic()
        self.event(what="kill_master", how="stop_etcd")
        self.etcd.process.send_signal(signal.SIGSTOP)
        self._stop.wait(self.rng.uniform(0.3, 1.5))
        self.etcd.process.send_signal(signal.SIGCONT)
        self._back(started)

    def kill_node(self) -> None:
        self.kill_node_in(self.rng.randrange(self.node_count))

    def kill_client(self) -> None:
        victim = self.rng.choice([c for c in self.clients if c.popen.poll() is None])
        self.event(what="kill_client", writer=victim.writer)
        victim.popen.kill()
        victim.popen.wait(10)
        self.start_client(victim.client)

    def _back(self, started: float) -> None:
        """Wait until a leader is open and every live node is mounted on it; record how long
        that took from `started` (`master_back`), or that it did not within the bound."""
        deadline = started + FAILOVER_BOUND_MS / 1000 * 2
        while time.monotonic() < deadline:
            try:
                leader = self.cluster.wait_leader(timeout_s=max(0.1, deadline - time.monotonic()))
            except ConnectFailed:  # no leader within the bound
                break
            if self._mounted(leader) >= self._awaited():
                self.event(what="master_back", pid=leader.pid, took_ms=(time.monotonic() - started) * 1000)
                return
            time.sleep(0.05)
        self.event(what="master_back", pid=None, took_ms=None)  # check_ha reports it

    def _awaited(self) -> set[str]:
        """Every live node's segments (its disk tier too), and with tiers the DFS, which a new
        leader mounts from a scan that may end after it opened."""
        return set(segments_of(self.slots)) | (set(self.tier_dirs()) if self.tiers else set())

    def _mounted(self, leader) -> set[str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{leader.info['http_port']}/status", timeout=1.0) as reply:
                return {s["segment_id"] for s in json.loads(reply.read())["segments"]}
        except (OSError, ValueError):
            return set()


# --- the HA properties ----------------------------------------------------------------------

_ELECTED = re.compile(r"election: elected leader of cluster \S+ \(term (\d+),")


def terms_led(cluster_dir: Path) -> dict[int, list[str]]:
    """Each term (the leader key's create revision) and the masters whose logs say they won it."""
    terms: dict[int, list[str]] = defaultdict(list)
    for log in sorted(cluster_dir.glob("master*.log")):
        for found in _ELECTED.finditer(log.read_text(errors="replace")):
            terms[int(found.group(1))].append(log.stem)
    return dict(terms)


def call_bound_ms(f: str) -> int:
    """What docs/ha.md bounds a call by: each master request its own bound, plus a transfer."""
    if f == "put":
        return 2 * MASTER_CALL_BOUND_MS + TRANSFER_TIMEOUT_MS  # put_start, bytes, put_end
    if f in ("get", "get_into"):
        return MASTER_CALL_BOUND_MS + TRANSFER_TIMEOUT_MS
    return MASTER_CALL_BOUND_MS


def check_ha(out_dir: Path, final: dict | None = None) -> list[str]:
    """The checker's violations, and the HA properties' (see the module docstring)."""
    violations = check(out_dir, final)
    ops, events = load(out_dir)
    evidence = Evidence(events)
    # Failovers: each over, within its bound.
    failovers = [e for e in events if e["what"] == "master_back"]
    for back in failovers:
        if back["took_ms"] is None or back["took_ms"] > FAILOVER_BOUND_MS:
            violations.append(f"a failover took {back['took_ms']} ms (bound {FAILOVER_BOUND_MS} ms)")
    # One leader per term.
    terms = terms_led(out_dir / "cluster")
    for term, masters in terms.items():
        if len(masters) > 1:
            violations.append(f"term {term} was won by {masters}")
    # Every call within its documented bound.
    for op in ops:
        took_ms = (op.end - op.start) / 1e6
        if op.end != NEVER and took_ms > call_bound_ms(op.f) + 500:
            violations.append(f"{op.f} took {took_ms:.0f} ms > {call_bound_ms(op.f)} ms ({op.error or 'ok'})")
    # No acknowledged put reads as missing unless its object could have left: removed, a fault
    # on a node that held it, an eviction (unpinned) in the run; or while a failover hid it.
    evicted = any(value for _, value in evidence.evictions)
    history = History(ops, evidence)
    for op in ops:
        if op.f not in ("get", "get_into") or op.error is not None or op.end == NEVER:
            continue
        for key, got in zip(op.args["keys"], op.result):
            if got is not None or (evicted and not key.startswith("p")):
                continue
            before = [p for p in history.acked[key] if p.end < op.start]
            if not before:
                continue
            put = max(before, key=lambda p: p.end)  # the latest: the narrowest span to excuse
            if any(r.start < op.end and r.end > put.start and history.may_remove(r, key, put)
                   for r in history.removals(key)):  # fmt: skip
                continue
            if evidence.node_fault_on(history.where(key, put, op.end), put.start, op.end):
                continue
            if evidence.master_away(op.start, op.end):
                continue
            violations.append(f"{key}: {op.f} missed it after acknowledged put {put.writer}/{put.sequence}, "
                              f"with no remove, node fault or failover since")  # fmt: skip
    violations = list(dict.fromkeys(violations))
    report = json.loads((out_dir / "report.json").read_text())["report"]
    report.update(
        ha_faults=sorted({e.get("how", e["what"]) for e in events if e["what"] in FAULT_EVENTS}),
        fault_count=sum(e["what"] in FAULT_EVENTS for e in events),
        failover_ms=[None if b["took_ms"] is None else round(b["took_ms"]) for b in failovers],
        terms=len(terms), evicted=evicted, violations=len(violations),
        longest_by_kind={f: round(max((o.end - o.start) / 1e6 for o in ops if o.f == f and o.end != NEVER))
                         for f in sorted({o.f for o in ops if o.end != NEVER})},
    )  # fmt: skip
    (out_dir / "ha-report.json").write_text(json.dumps({"report": report, "violations": violations}, indent=1))
    return violations


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--duration-s", type=float, default=60)
    parser.add_argument("--fault-gap-s", type=float, default=3.0)
    parser.add_argument("--masters", type=int, default=2)
    parser.add_argument("--tiers", action="store_true", help="4 MiB of DRAM over disk tiers, a shared DFS")
    parser.add_argument("--disk-size", default="16MiB")
    parser.add_argument("--key-space", type=int, default=100)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    tier_options = dict(tiers=True, disk_size=args.disk_size, key_space=args.key_space) if args.tiers else {}
    history = HAHistoryRun(args.out_dir, args.seed, args.duration_s, masters=args.masters,
                           memory="4MiB" if args.tiers else MEMORY, fault_gap_s=args.fault_gap_s,
                           **tier_options)  # fmt: skip
    violations, report, final = run_checked(history, check_ha, "ha-report.json")
    (args.out_dir / "final.json").write_text(json.dumps(final))
    print(json.dumps(report))
    for violation in violations[:50]:
        print(violation)


if __name__ == "__main__":
    random.seed()
    main()
