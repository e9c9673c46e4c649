"""Sustained mixed load: several client processes, 1 put : 4 gets, KV-cache-sized objects.

Starts a local cluster (a master, or with --etcd two HA master candidates on a local etcd, and
--nodes nodes), runs --clients load generator processes (kvpool/cli/loadgen.py: every byte read
is checked against the key's value) for --duration-s, then prints JSON: throughput (ops/s,
MiB/s), p50/p99 latency of puts and gets, the longest call against the client's bound, the
counts of misses, errors and wrong bytes (which must be 0), the load generators that failed
(exit status 1 if any did, or if any get read wrong bytes), and the master's counters of a
full cache (evictions, rounds puts waited for room). A regression in failure handling
that costs speed shows here first.

    python benchmarks/mixed_load.py [--clients 3] [--nodes 3] [--duration-s 20] [--etcd]
        [--size-min 65536] [--size-max 524288] [--shm 0|1] [--disk-size 64MiB] [--output FILE]

With --disk-size each node also has a disk tier of that size (its own directory): what DRAM
evicts moves there, and gets read it back.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

from kvpool.cli.launcher import LocalCluster, LocalEtcd
from kvpool.cli.loadgen import summarize


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--memory", default="256MiB", help="DRAM segment per node")
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--put-ratio", type=float, default=0.2)
    parser.add_argument("--size-min", type=int, default=64 * 1024)
    parser.add_argument("--size-max", type=int, default=512 * 1024)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--shm", type=int, default=0, help="1: same-host clients map segments")
    parser.add_argument("--etcd", action="store_true", help="two HA masters on a local etcd")
    parser.add_argument("--disk-size", default=None, help="a disk tier of this size on every node (e.g. 64MiB)")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="kvpool-bench-") as tmp:
        workdir = Path(tmp)
        env = {**os.environ, "KVPOOL_DEBUG_INVARIANTS": "0"}
        os.environ["KVPOOL_DEBUG_INVARIANTS"] = "0"  # measure the product, not its self-checks
        etcd = LocalEtcd(workdir) if args.etcd else None
        try:
            if etcd is not None:
                etcd.start()
            cluster = LocalCluster(
                0 if args.disk_size else args.nodes, args.memory, workdir=workdir / "cluster",
                etcd_endpoint=etcd.endpoint if etcd else None, master_count=2 if etcd else 1,
            )  # fmt: skip
            (workdir / "cluster").mkdir()
            with cluster:
                cluster.start_nodes([  # a disk directory each
                    ("--disk-dir", str(workdir / f"disk{index}"), "--disk-size", args.disk_size)
                    for index in range(args.nodes if args.disk_size else 0)
                ])  # fmt: skip
                out_dir = workdir / "load"
                workers = [
                    subprocess.Popen(
                        [sys.executable, "-m", "kvpool.cli.loadgen", "--master", cluster.master_address,
                         "--out-dir", str(out_dir), "--worker-id", str(i), "--run-id", "bench",
                         "--duration-s", str(args.duration_s), "--put-ratio", str(args.put_ratio),
                         "--size-min", str(args.size_min), "--size-max", str(args.size_max),
                         "--replicas", str(args.replicas), "--shm", str(args.shm)],
                        env=env, stdout=subprocess.DEVNULL,
                    )  # fmt: skip
                    for i in range(args.clients)
                ]
                try:
                    for worker in workers:
                        worker.wait(args.duration_s + 60)
                finally:
                    for worker in workers:
                        if worker.poll() is None:
                            worker.kill()
                            worker.wait(10)
                stats = [json.loads(p.read_text()) for p in sorted(out_dir.glob("stats-*.json"))]
                master = master_counters(cluster.http_port)
        finally:
            if etcd is not None:
                etcd.stop()
    # A load generator that died wrote no counters (or not all of them): its misses,
    # errors and wrong bytes would be missing from the sums below.
    failed_workers = {i: worker.returncode for i, worker in enumerate(workers) if worker.returncode != 0}
    summary = summarize(stats)
    result = {
        "benchmark": "mixed_load",
        "clients": args.clients,
        "nodes": args.nodes,
        "ha": bool(args.etcd),
        "duration_s": args.duration_s,
        "put_ratio": args.put_ratio,
        "object_size_bytes": [args.size_min, args.size_max],
        "replicas": args.replicas,
        "transport": "shm" if args.shm else "tcp",
        "disk_size": args.disk_size,
        "client_bound_ms": stats[0]["bound_ms"] if stats else 0,
        "wrong_bytes_gets": summary["outcomes"].get("get_wrong", 0),
        "failed_workers": failed_workers,  # worker id: exit status; must be empty
        "errors": dict(sum((Counter(s["errors"]) for s in stats), Counter())),  # every worker's
        **{k: v for k, v in summary.items() if k != "outcomes"},
        "outcomes": summary["outcomes"],
        "master": master,  # the (last) leader's counters: evictions, put rounds waiting for room
        "finished_epoch_s": round(time.time()),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    return 1 if result["wrong_bytes_gets"] or failed_workers or len(stats) != args.clients else 0


def master_counters(http_port: int) -> dict[str, float]:
    """The master's counters of a full cache, from its /metrics."""
    names = ("evictions_total", "put_room_rounds_total", "errors_total", "puts_total")
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5) as response:
        lines = response.read().decode().splitlines()
    samples = dict(line.rsplit(" ", 1) for line in lines if line.startswith("kvpool_master_"))
    return {name: float(samples[f"kvpool_master_{name}"]) for name in names}


if __name__ == "__main__":
    sys.exit(main())
