"""Writers that read back at once what they just put, into a full cache: how many miss.

A prefill instance puts KV blocks and a decode instance reads them moments later; in a full
cache, an eviction between the two loses them (docs/operations.md, "A put is not a
reservation"). Starts a master and one node (real processes, 127.0.0.1), then each of
THREADS threads of one Store puts batches of BATCH objects of 1-64 KiB (random bytes, a fixed
seed per thread) and gets each object right after its batch's put, until it has put
MIB_PER_THREAD MiB (a few times the node's memory). A get that does not return the bytes put
is a miss. Prints one JSON line.

    python benchmarks/put_then_get.py [--threads 1] [--batch 8] [--memory 64MiB]
                                      [--mib-per-thread 200] [--policy probation]
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time

from kvpool import ErrorCode, Store
from kvpool.cli.launcher import LocalCluster
from kvpool.master.eviction import POLICIES

OBJECT_BYTES_MIN = 1024
OBJECT_BYTES_MAX = 64 * 1024


def writer(store: Store, seed: int, batch: int, total_bytes: int, counts: list[int]) -> None:
    """Put and read back until `total_bytes` are put; counts: [pairs, misses]."""
    rng = random.Random(seed)
    written = 0
    index = 0
    while written < total_bytes:
        keys = [f"w{seed}-{index + i}" for i in range(batch)]
        values = [rng.randbytes(rng.randint(OBJECT_BYTES_MIN, OBJECT_BYTES_MAX)) for _ in keys]
        index += batch
        codes = store.put_batch(keys, values)
        for key, value, code in zip(keys, values, codes):
            if code != ErrorCode.OK:
                continue
            counts[0] += 1
            counts[1] += store.get(key) != value
            written += len(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--memory", default="64MiB", help="the node's DRAM segment")
    parser.add_argument("--mib-per-thread", type=int, default=200)
    parser.add_argument("--policy", default="probation", choices=sorted(POLICIES))
    args = parser.parse_args()
    counts = [[0, 0] for _ in range(args.threads)]
    with LocalCluster(1, args.memory, master_args=("--eviction-policy", args.policy)) as cluster:
        with Store(cluster.master_endpoint, token=cluster.client_token) as store:
            threads = [
                threading.Thread(target=writer, args=(store, seed, args.batch, args.mib_per_thread << 20, counts[seed]))
                for seed in range(args.threads)
            ]
            started = time.monotonic()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            elapsed_s = time.monotonic() - started
    print(json.dumps({
        "threads": args.threads, "batch": args.batch, "memory": args.memory, "policy": args.policy,
        "pairs": sum(c[0] for c in counts), "misses": sum(c[1] for c in counts),
        "seconds": round(elapsed_s, 1),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
