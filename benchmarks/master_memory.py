"""Master memory and hot-path cost per object: 1,000,000 complete objects through the put path.

Mounts a few segments, then puts OBJECTS objects (64-byte keys, one replica) in batches of 128
through put_start -> put_end -> finish_put_end, as the server would, and reads them back with
get_replica_list, then unmounts one segment (its eighth of the objects vanish: a node left):
in steps, as the master does with a large table (the longest step is the longest the master
keeps requests waiting), then another in one go for comparison. Memory is the RSS delta
(/proc/self/statm) over the inserts, divided by the object count; times are wall time per
key, and the unmounts' in ms.
Prints one JSON line.

    python benchmarks/master_memory.py [--objects N] [--batch-keys 128]

Target (issue): < 500 bytes of RSS per object at 1M objects.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import statistics
import time

from kvpool import limits
from kvpool.config import MasterConfig
from kvpool.master.service import MasterService
from kvpool.protocol import auth
from kvpool.protocol.messages import (
    GetReplicaList,
    MountSegment,
    PutEnd,
    PutStart,
    ReplicateConfig,
    SegmentInfo,
    UnmountSegment,
)

SEGMENT_COUNT = 8
OBJECT_SIZE_BYTES = 64 * limits.KIB


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def key_of(index: int) -> str:
    return hashlib.sha256(index.to_bytes(8, "little")).hexdigest()  # 64 ASCII characters.


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=1_000_000)
    parser.add_argument("--batch-keys", type=int, default=128)
    args = parser.parse_args()
    objects, batch = args.objects, args.batch_keys

    rng = random.Random(1)
    service = MasterService(MasterConfig(), rng, auth.cluster_key("bench-token"))
    per_segment_bytes = (objects // SEGMENT_COUNT + 1) * OBJECT_SIZE_BYTES * 2
    for index in range(SEGMENT_COUNT):
        info = SegmentInfo(
            f"seg-{index}", f"node-{index}", "host", "127.0.0.1:1", "", b"t", per_segment_bytes
        )
        service.mount_segment(MountSegment(info, []), 0)
    config = ReplicateConfig()
    gc.collect()
    rss_before = rss_bytes()

    now_ms = 1
    put_seconds = 0.0
    for start in range(0, objects, batch):
        keys = [key_of(i) for i in range(start, min(start + batch, objects))]
        sizes = [OBJECT_SIZE_BYTES] * len(keys)
        checksums = [rng.getrandbits(64) for _ in keys]
        began = time.perf_counter()
        service.put_start(PutStart(keys, sizes, config, "host"), now_ms)
        pending = service.put_end(PutEnd(keys, checksums), now_ms)
        results = {segment_id: [0] * len(entries) for segment_id, entries in pending.commits.items()}
        reply = service.finish_put_end(pending, results, now_ms)
        put_seconds += time.perf_counter() - began
        assert all(code == 0 for code in reply.codes), reply.codes[:4]
    gc.collect()
    rss_after = rss_bytes()

    get_seconds = 0.0
    get_keys = 0
    for start in range(0, min(objects, 200_000), batch):
        keys = [key_of(i) for i in range(start, min(start + batch, objects))]
        began = time.perf_counter()
        reply = service.get_replica_list(GetReplicaList(keys), now_ms)
        get_seconds += time.perf_counter() - began
        get_keys += len(keys)
        assert all(code == 0 for code in reply.codes)

    assert service.object_count == objects, service.object_count
    # A node leaves: its segment goes in steps (master/mounts.py), the master serving requests
    # between them; the longest step is the longest the master keeps anyone waiting.
    began = time.perf_counter()
    service.unmount_segment(UnmountSegment("seg-0"), now_ms)
    steps_ms = [(time.perf_counter() - began) * 1000]
    while True:
        began = time.perf_counter()
        more = service.sweep_step()
        steps_ms.append((time.perf_counter() - began) * 1000)
        if not more:
            break
    lost = objects - service.object_count
    # Another in one go, as every unmount was before 2026-12-01 (steps larger than the table).
    limits.UNMOUNT_SWEEP_KEYS_PER_STEP = objects + 1
    held_before = service.object_count
    began = time.perf_counter()
    service.unmount_segment(UnmountSegment("seg-1"), now_ms)
    at_once_ms = (time.perf_counter() - began) * 1000
    assert not service.is_sweeping and service.object_count < held_before
    print(
        json.dumps(
            {
                "objects": objects,
                "rss_bytes_per_object": round((rss_after - rss_before) / objects, 1),
                "put_us_per_key": round(put_seconds / objects * 1e6, 2),
                "get_us_per_key": round(get_seconds / get_keys * 1e6, 2),
                "unmount_objects": lost,
                "unmount_in_steps": len(steps_ms),
                "unmount_longest_step_ms": round(max(steps_ms), 1),
                "unmount_median_step_ms": round(statistics.median(steps_ms), 1),
                "unmount_steps_total_ms": round(sum(steps_ms)),
                "unmount_at_once_ms": round(at_once_ms),
                "batch_keys": batch,
                "segments": SEGMENT_COUNT,
            }
        )
    )


if __name__ == "__main__":
    main()
