"""`kvpool demo`: a whole local cluster on defaults, exercised and torn down in one command.

Starts a master and N nodes as separate processes on loopback, writes objects through one
client, reads them back through a second client (same-host shared memory) and a third (TCP
only), checks every byte, prints where the objects landed and the throughput of each path,
and stops every process it started, on SIGINT, SIGTERM or SIGHUP too. It ends with a short live trace
replay, local caches against one pool (cli/replay.py `run_demo_replay`, ~10 s).
"""

from __future__ import annotations

import ctypes
import os
import time
from collections import Counter

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvpool import limits
from kvpool.cli.launcher import LocalCluster, sigterm_as_interrupt
from kvpool.client.sync import Store
from kvpool.config import exact_size
from kvpool.errors import ErrorCode, InvalidParams, TransferFailed
from kvpool.protocol.messages import ReplicateConfig

WARM_UP_KEY = "demo/warm-up"
BATCH_KEYS = 16
# Replicas of each object the demo writes (fewer with fewer nodes: replicas need distinct segments).
PUT_REPLICA_NUM = 2


def run_demo(node_count: int, memory_bytes: int, object_count: int, object_size_bytes: int, console: Console) -> None:
    """The demo (module docstring); SIGTERM or SIGHUP stops it as SIGINT does, then exits 143 or 129.

    Raises:
        InvalidParams: a segment below the minimum a node takes, or objects that could not be
            stored (empty, larger than a segment or than an object can be) or kept until read
            back (more than the nodes hold below the eviction watermark), or $KVPOOL_TRACE
            naming no file: said before any process starts.
    """
    if memory_bytes < limits.SEGMENT_SIZE_BYTES_MIN:
        raise InvalidParams(
            f"--memory {exact_size(memory_bytes)}: a node's segment is at least "
            f"{exact_size(limits.SEGMENT_SIZE_BYTES_MIN)}"
        )
    if not 0 < object_size_bytes <= memory_bytes:
        raise InvalidParams(
            f"--object-size {exact_size(object_size_bytes)}: give 1 byte to --memory "
            f"({exact_size(memory_bytes)}), as an object is stored whole in one segment"
        )
    if object_size_bytes > limits.OBJECT_SIZE_BYTES_MAX:
        raise InvalidParams(
            f"--object-size {exact_size(object_size_bytes)}: an object is at most "
            f"{exact_size(limits.OBJECT_SIZE_BYTES_MAX)}"
        )
    # Above the watermark the master evicts: objects written would be gone when read back.
    replica_count = min(PUT_REPLICA_NUM, node_count)
    room_bytes = node_count * memory_bytes * limits.EVICT_WATERMARK_RATIO_HIGH_DEFAULT
    if object_count * object_size_bytes * replica_count > room_bytes:
        raise InvalidParams(
            f"--objects {object_count} x --object-size {exact_size(object_size_bytes)} x {replica_count} "
            f"replica(s) is more than --nodes {node_count} x --memory {exact_size(memory_bytes)} hold below "
            f"the eviction watermark ({limits.EVICT_WATERMARK_RATIO_HIGH_DEFAULT:.0%}): they would be evicted "
            "before they are read back"
        )
    from kvpool.cli.replay import find_trace

    find_trace()  # $KVPOOL_TRACE naming no file: said before the demo runs, not after it
    with sigterm_as_interrupt():
        _run_demo(node_count, memory_bytes, object_count, object_size_bytes, console)


def _run_demo(node_count: int, memory_bytes: int, object_count: int, object_size_bytes: int, console: Console) -> None:
    _keep_freed_memory()
    console.print(f"[bold]kvpool demo[/bold]: 1 master + {node_count} nodes x {exact_size(memory_bytes)} on 127.0.0.1")
    with LocalCluster(node_count, str(memory_bytes)) as cluster:
        console.print(f"master {cluster.master_endpoint}, metrics http://127.0.0.1:{cluster.http_port}/metrics")
        for process in cluster.nodes:
            console.print(f"  node pid {process.pid} serving {process.info['endpoint']}")
        values = {f"demo/object-{i:05d}": os.urandom(object_size_bytes) for i in range(object_count)}
        keys = list(values)
        with Store(cluster.master_endpoint, token=cluster.client_token) as writer:
            # Untimed: the first put maps the segments it lands on (each pre-faulted at once),
            # at most REPLICA_NUM_MAX segments a put.
            segment_ids = [process.info["segment_id"] for process in cluster.nodes]
            for start in range(0, len(segment_ids), limits.REPLICA_NUM_MAX):
                chosen = segment_ids[start : start + limits.REPLICA_NUM_MAX]
                warm_up = ReplicateConfig(replica_num=len(chosen), placement="preferred", preferred_segments=chosen)
                _check_codes(writer.put_batch([WARM_UP_KEY], [b"w"], warm_up))
                writer.remove(WARM_UP_KEY)
            put_seconds = _timed_batches(
                console, "put (shm)", keys,
                lambda batch: _check_codes(
                    writer.put_batch(batch, [values[k] for k in batch], ReplicateConfig(replica_num=PUT_REPLICA_NUM))
                ),
            )  # fmt: skip
            placement = writer.query(keys)
            status = writer.cluster_status()
        with Store(cluster.master_endpoint, token=cluster.client_token) as reader:
            reader.get_batch(keys[:BATCH_KEYS])  # untimed: maps the segments, as the writer did
            shm_seconds = _timed_batches(
                console, "get (shm)", keys, lambda b: _check_values(reader.get_batch(b), b, values)
            )
        with Store(cluster.master_endpoint, token=cluster.client_token, shm_enabled=False) as tcp_reader:
            tcp_reader.get_batch(keys[:BATCH_KEYS])  # untimed: opens the connections
            tcp_seconds = _timed_batches(
                console, "get (tcp)", keys, lambda b: _check_values(tcp_reader.get_batch(b), b, values)
            )

        replicas = Counter(r.segment_id for rs in placement.replicas for r in rs)
        endpoints = {s.segment.segment_id: s.segment.endpoint for s in status.segments}
        table = Table("segment", "node", "replicas held")
        for segment_id, count in sorted(replicas.items()):
            table.add_row(segment_id, endpoints.get(segment_id, "?"), str(count))
        console.print(table)
        total = object_count * object_size_bytes
        # The replicas the master placed, not the PUT_REPLICA_NUM asked for: fewer nodes hold fewer.
        held = sum(replicas.values()) / object_count
        results = Table("path", "objects/s", "GB/s")
        for name, seconds, copies in (
            (f"put, {held:g} replica{'' if held == 1 else 's'} (shm)", put_seconds, held),
            ("get (same-host shm)", shm_seconds, 1),
            ("get (TCP only)", tcp_seconds, 1),
        ):
            results.add_row(name, f"{object_count / seconds:,.0f}", f"{total * copies / seconds / 1e9:.2f}")
        console.print(results)
        console.print(f"[green]all {object_count} objects read back intact on both paths[/green]")
    console.print("stopped master and nodes")
    # Issue 6: end with a short live trace replay, pooled vs local caches (cli/replay.py).
    from kvpool.cli.replay import run_demo_replay

    run_demo_replay(console)


# glibc's mallopt parameters (malloc.h): M_TRIM_THRESHOLD and M_MMAP_THRESHOLD.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _keep_freed_memory() -> None:
    """Let this process reuse the memory of freed objects instead of faulting in fresh pages
    for every bytes object a plain get returns (docs/performance.md; measured by
    `benchmarks/bench_paths.py landing`). What an operator sets with GLIBC_TUNABLES for a
    serving process; the demo sets it for itself. Nothing happens outside glibc."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, 64 << 20)
        libc.mallopt(_M_TRIM_THRESHOLD, 256 << 20)
    except (OSError, AttributeError):
        pass


def _timed_batches(console: Console, label: str, keys: list[str], action) -> float:
    started = time.perf_counter()
    # Shown on a terminal only: piped, a transient bar left an empty line behind (as bench's).
    with Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task(label, total=len(keys))
        for start in range(0, len(keys), BATCH_KEYS):
            batch = keys[start : start + BATCH_KEYS]
            action(batch)
            progress.advance(task, len(batch))
    return time.perf_counter() - started


def _check_codes(codes: list[int]) -> None:
    failed = [ErrorCode(c).name for c in codes if c != ErrorCode.OK]
    if failed:
        raise TransferFailed(f"{len(failed)} puts failed: {failed[:3]}")


def _check_values(got: list[bytes | None], keys: list[str], values: dict[str, bytes]) -> None:
    for key, value in zip(keys, got):
        if value != values[key]:
            raise TransferFailed(f"{key} read back wrong ({'miss' if value is None else 'bytes differ'})")
