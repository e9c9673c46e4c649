"""What kvpool's vLLM connector moved, in vLLM's own telemetry.

vLLM collects a connector's stats after every step, from the scheduler side and from each
worker (`get_kv_connector_stats`), sums them over the workers (`aggregate`), logs a summary
every stats interval ("KV Transfer metrics: ...", `reduce`) and feeds its Prometheus endpoint
(`build_prom_metrics`). The connector records each of its pool operations there, as vLLM's
own Mooncake store connector does, under its metric names with `kvpool` for
`mooncake_store` and the same labels (a dashboard moves over by renaming the metrics; the
`operation` label names kvpool's three operations, where Mooncake's names its RPCs):

    lookup  the scheduler's longest_prefix of a request's blocks (keys asked)
    load    a worker's read of a request's planned blocks (keys, bytes landed, keys failed)
    save    a worker's put of the blocks it saves of a request (keys, bytes, keys failed)

An operation that raised counts with status "error" (all its keys failed); one whose keys
partly failed is "ok" with its failed keys counted. A put of a block already in the pool is
not a failure. This module is not used without vLLM installed.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvpool import limits

# A record: seconds, keys, bytes, failed keys, 1 if the operation raised (a list: stats cross
# from the workers to vLLM's front end serialized, so plain numbers only).
SECONDS, KEYS, BYTES, FAILED_KEYS, RAISED = range(5)
# vLLM's Mooncake store connector's buckets: an RPC of a millisecond to a load of seconds.
SECONDS_BUCKETS = (1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)


@dataclasses.dataclass
class KVPoolConnectorStats(KVConnectorStats):
    """The operations of one stats interval: per operation name, one record each."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, list[list[float]]] = {}

    def is_empty(self) -> bool:
        return not self.data

    def record(
        self, operation: str, seconds: float, keys: int, size_bytes: int, failed_keys: int, raised: bool
    ) -> None:
        records = self.data.setdefault(operation, [])
        if len(records) < limits.ENGINE_STATS_RECORDS_MAX:  # (a bound should nothing take them)
            records.append([seconds, keys, size_bytes, failed_keys, int(raised)])

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for operation, records in other.data.items():
            self.data.setdefault(operation, []).extend(records)
        return self

    def reduce(self) -> dict[str, int | float]:
        """Per operation: how many, their mean and 90th-percentile time, the keys, bytes and
        failed keys in all, how many raised, and the bytes per second of their time."""
        reduced: dict[str, int | float] = {}
        for operation, records in sorted(self.data.items()):
            seconds = sorted(record[SECONDS] for record in records)
            size_bytes = sum(int(record[BYTES]) for record in records)
            reduced[f"{operation}_count"] = len(records)
            reduced[f"{operation}_avg_ms"] = round(statistics.fmean(seconds) * 1e3, 3)
            reduced[f"{operation}_p90_ms"] = round(seconds[max(0, -(-len(seconds) * 9 // 10) - 1)] * 1e3, 3)
            reduced[f"{operation}_keys"] = sum(int(record[KEYS]) for record in records)
            reduced[f"{operation}_failed_keys"] = sum(int(record[FAILED_KEYS]) for record in records)
            reduced[f"{operation}_errors"] = sum(int(record[RAISED]) for record in records)
            if size_bytes:
                reduced[f"{operation}_bytes"] = size_bytes
                reduced[f"{operation}_gb_per_s"] = round(size_bytes / max(sum(seconds), 1e-9) / 1e9, 3)
        return reduced


@dataclasses.dataclass
class Outcome:
    """What a timed operation moved, set by its caller (StatsRecorder.timed)."""

    size_bytes: int = 0
    failed_keys: int = 0


class StatsRecorder:
    """A connector's stats of the interval so far, recorded from vLLM's thread and the
    connector's loader and saver threads, and taken whole once a step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = KVPoolConnectorStats()

    @contextmanager
    def timed(self, operation: str, keys: int) -> Iterator[Outcome]:
        """Time the operation in the block, whose caller fills in the Outcome it is given. An
        exception out of the block records the operation as raised, every key failed, and
        goes on."""
        outcome = Outcome()
        started = time.perf_counter()
        try:
            yield outcome
        except BaseException:
            self._record(operation, started, keys, 0, keys, raised=True)
            raise
        self._record(operation, started, keys, outcome.size_bytes, outcome.failed_keys, raised=False)

    def _record(self, operation: str, started: float, keys: int, size_bytes: int, failed: int, raised: bool) -> None:
        seconds = time.perf_counter() - started
        with self._lock:
            self._stats.record(operation, seconds, keys, size_bytes, failed, raised)

    def take(self) -> KVPoolConnectorStats | None:
        """The interval's stats (None when nothing happened); a new interval starts."""
        with self._lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, KVPoolConnectorStats()
            return stats


class KVPoolPromMetrics(KVConnectorPromMetrics):
    """The connector's operations as Prometheus metrics, per engine, operation and status."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        names = [*labelnames, "operation", "status"]
        self._seconds = self._histogram_cls(
            name="vllm:kvpool_operation_time_seconds",
            documentation="Time of kvpool operations (lookup, load, save) of the KV connector.",
            buckets=list(SECONDS_BUCKETS),
            labelnames=names,
        )
        counters = {
            "calls": ("vllm:kvpool_operation_total", "kvpool operations of the KV connector."),
            "keys": ("vllm:kvpool_operation_keys_total", "Keys (blocks) kvpool operations touched."),
            "bytes": ("vllm:kvpool_operation_bytes_total", "Bytes kvpool loads and saves moved."),
            "failed_keys": ("vllm:kvpool_operation_failed_keys_total", "Keys kvpool operations failed."),
        }
        self._counters = {
            field: self._counter_cls(name=name, documentation=doc, labelnames=names)
            for field, (name, doc) in counters.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for operation, records in (transfer_stats_data or {}).items():
            for record in records:
                labels = [*self.per_engine_labelvalues[engine_idx], operation, "error" if record[RAISED] else "ok"]
                self._seconds.labels(*labels).observe(record[SECONDS])
                self._counters["calls"].labels(*labels).inc()
                self._counters["keys"].labels(*labels).inc(record[KEYS])
                self._counters["bytes"].labels(*labels).inc(record[BYTES])
                self._counters["failed_keys"].labels(*labels).inc(record[FAILED_KEYS])
