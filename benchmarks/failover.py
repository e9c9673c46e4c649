"""Leader failover time: SIGKILL the leading master, time until reads and puts are served again.

Starts a local etcd, two HA master candidates and --nodes nodes, writes objects with two
replicas, then --rounds times: SIGKILL the leader, poll (every 50 ms) a client that reads every
object back and puts a new one, and start a fresh candidate so that a standby is always there.
Prints JSON: per round the seconds from the kill to the first complete correct read and to the
first put, and their medians. No load runs beside it (tests/test_chaos.py measures under load).

    python benchmarks/failover.py [--rounds 3] [--nodes 3] [--lease-ttl-ms 5000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvpool import ReplicateConfig, Store
from kvpool.cli.launcher import LocalCluster, LocalEtcd
from kvpool.errors import KVPoolError

POLL_S = 0.05
ROUND_TIMEOUT_S = 60.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--objects", type=int, default=32)
    parser.add_argument("--lease-ttl-ms", type=int, default=5_000)
    args = parser.parse_args()
    os.environ["KVPOOL_DEBUG_INVARIANTS"] = "0"
    rounds = []
    with tempfile.TemporaryDirectory(prefix="kvpool-failover-") as tmp:
        workdir = Path(tmp)
        (workdir / "cluster").mkdir()
        with LocalEtcd(workdir) as etcd, LocalCluster(
            args.nodes, "32MiB", workdir=workdir / "cluster", etcd_endpoint=etcd.endpoint,
            master_count=2, master_args=("--etcd-lease-ttl-ms", str(args.lease_ttl_ms)),
        ) as cluster:  # fmt: skip
            with Store(cluster.master_address, token=cluster.client_token, shm_enabled=False, rpc_timeout_ms=3_000,
                       connect_timeout_ms=1_000, transfer_timeout_ms=3_000) as store:  # fmt: skip
                values = {f"failover/{i}": os.urandom(64 * 1024) for i in range(args.objects)}
                store.put_batch(list(values), list(values.values()), ReplicateConfig(replica_num=2))
                for round_index in range(args.rounds):
                    leader = cluster.wait_leader()
                    killed_at = time.monotonic()
                    leader.kill()
                    read_s = put_s = None
                    attempt = 0
                    while put_s is None and time.monotonic() - killed_at < ROUND_TIMEOUT_S:
                        attempt += 1
                        try:
                            if read_s is None:
                                got = store.get_batch(list(values))
                                assert all(g in (None, v) for g, v in zip(got, values.values())), "wrong bytes"
                                if got == list(values.values()):
                                    read_s = time.monotonic() - killed_at
                            if read_s is not None:
                                key = f"failover/put/{round_index}/{attempt}"
                                if store.put_batch([key], [b"x" * 4096])[0] == 0:
                                    put_s = time.monotonic() - killed_at
                        except KVPoolError:
                            pass  # a clean error while there is no leader: keep polling
                        time.sleep(POLL_S)
                    rounds.append({"read_s": read_s, "put_s": put_s})
                    cluster.start_master()  # a standby again for the next round
                    cluster.wait_leader(roles=("leader",))
    reads = [r["read_s"] for r in rounds if r["read_s"] is not None]
    puts = [r["put_s"] for r in rounds if r["put_s"] is not None]
    result = {
        "benchmark": "failover",
        "lease_ttl_ms": args.lease_ttl_ms,
        "nodes": args.nodes,
        "rounds": [{k: round(v, 2) if v is not None else None for k, v in r.items()} for r in rounds],
        "read_s_median": round(statistics.median(reads), 2) if reads else None,
        "put_s_median": round(statistics.median(puts), 2) if puts else None,
    }
    print(json.dumps(result, indent=2))
    return 0 if len(puts) == len(rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
