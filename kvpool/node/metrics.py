"""A node's Prometheus metrics and its small HTTP surface (/metrics, /health).

`NodeMetrics` owns one `CollectorRegistry` per node, so that several nodes (embedded mode, tests)
can live in one process without colliding in prometheus_client's global registry. The transfer
handlers count into it on the data path (a counter increment, no I/O). `MetricsServer` is the
HTTP shell that exposes it (node/metrics_http.py), imported and started only when a metrics port
is configured. This module is not where anything is measured for benchmarks (benchmarks/ does
that).

Metric names (all prefixed kvpool_node_):

    segment_capacity_bytes   gauge    bytes of the segment's data area
    segment_used_bytes       gauge    bytes held by complete objects (the inventory)
    objects                  gauge    complete objects in the inventory
    master_connected         gauge    1 while mounted on a master, else 0
    master_clock_offset_seconds  gauge  the master's wall clock minus this host's (node/clock.py)
    info{node_id,segment_id,endpoint}  gauge, always 1
    write_bytes_total        counter  payload bytes accepted into the segment (over TCP: a
                                      same-host client copies through the mapping, uncounted)
    read_bytes_total         counter  payload bytes served from the segment (likewise), also
                                      in requests that read the disk tier too
    write_requests_total     counter  WriteSlices requests answered OK
    read_requests_total      counter  ReadSlices requests answered OK that read the segment
    errors_total{code}       counter  requests answered with an error, by ErrorCode name
    commits_total{result}    counter  entries committed by the master, result ok|checksum|bounds|moving
    commits_hashed_in_place_total  counter  of the ok ones, those taken on the writer's hash
                                   (a same-host copy, PutEnd.hashed_in_place), not hashed again
    mounts_total             counter  successful MountSegment calls (first mount and re-mounts)
    busy_poll_seconds_total  counter  time the transfer server's loop spent polling after replies
    busy_poll_windows_total  counter  polling windows opened (transports/busy_poll.py)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.registry import Collector

from kvpool.errors import ErrorCode, KVPoolError
from kvpool.transports import busy_poll
from kvpool.transports.busy_poll import BusyPoll

_PREFIX = "kvpool_node_"


class NodeMetrics:
    """Counters and gauges of one node, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.segment_capacity_bytes = Gauge(
            _PREFIX + "segment_capacity_bytes", "Bytes of the segment's data area.", registry=r
        )
        self.segment_used_bytes = Gauge(
            _PREFIX + "segment_used_bytes", "Bytes held by complete objects.", registry=r
        )
        self.objects = Gauge(_PREFIX + "objects", "Complete objects in the inventory.", registry=r)
        self.master_connected = Gauge(
            _PREFIX + "master_connected", "1 while mounted on a master, else 0.", registry=r
        )
        self.master_clock_offset = Gauge(
            _PREFIX + "master_clock_offset_seconds",
            "The master's wall clock minus this host's (write grants are checked against the master's).",
            registry=r,
        )
        self.info = Gauge(
            _PREFIX + "info", "Identity of this node (always 1).",
            ["node_id", "segment_id", "endpoint"], registry=r,
        )  # fmt: skip
        self.write_bytes = Counter(
            _PREFIX + "write_bytes", "Payload bytes accepted into the segment.", registry=r
        )
        self.read_bytes = Counter(
            _PREFIX + "read_bytes", "Payload bytes served from the segment.", registry=r
        )
        self.write_requests = Counter(
            _PREFIX + "write_requests", "WriteSlices requests answered OK.", registry=r
        )
        self.read_requests = Counter(
            _PREFIX + "read_requests", "ReadSlices requests answered OK.", registry=r
        )
        self.errors = Counter(
            _PREFIX + "errors", "Requests answered with an error.", ["code"], registry=r
        )
        self.commits = Counter(
            _PREFIX + "commits", "Entries committed by the master, by result.", ["result"],
            registry=r,
        )  # fmt: skip
        self.commits_hashed_in_place = Counter(
            _PREFIX + "commits_hashed_in_place",
            "Commits recorded on the writer's own hash of the bytes in the segment (same host).",
            registry=r,
        )
        self.mounts = Counter(
            _PREFIX + "mounts", "Successful MountSegment calls (mounts and re-mounts).", registry=r
        )

    def track_inventory(self, used_bytes: Callable[[], float], objects: Callable[[], float]) -> None:
        """Read the inventory's size at scrape time rather than on every change."""
        self.segment_used_bytes.set_function(used_bytes)
        self.objects.set_function(objects)

    def track_busy_poll(self, poll: BusyPoll) -> None:
        """Count what polling after replies costs (transports/busy_poll.py), read at scrape time."""
        self.registry.register(_BusyPollCollector(poll))

    def count_error(self, exc: KVPoolError) -> None:
        self.errors.labels(code=ErrorCode(exc.code).name).inc()

    def render(self) -> bytes:
        """The text exposition of every metric (what /metrics serves)."""
        return generate_latest(self.registry)


class _BusyPollCollector(Collector):
    def __init__(self, poll: BusyPoll) -> None:
        self._poll = poll

    def collect(self) -> Iterator[Any]:
        return busy_poll.metric_families(_PREFIX, self._poll)


class TierMetrics:
    """The node's disk and DFS tier metrics, in the node's registry (appended with the tiers).

    Names (prefixed kvpool_node_): disk_capacity_bytes, disk_used_bytes, disk_objects and
    disk_filesystem_free_bytes (gauges read at scrape time, exported by a node with a disk tier
    only; the last is what the filesystem under the tier had left at the heartbeat's last
    look, which other files may take before the tier's capacity is used: docs/tiers.md; NaN
    before the first look; a scrape never looks itself, as a disk that hangs would freeze the
    node), disk_read_bytes_total and disk_read_requests_total (bytes and items read from the
    disk tier through this node: a same-host client reads the files itself, uncounted),
    moves_total{src,dst,result} and move_bytes_total{src,dst} (copies between tiers the master
    asked for: offloads, promotions, write-through), and move_queue_bytes (bytes of moves
    admitted and not finished).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        r = registry
        self.disk_read_bytes = Counter(
            _PREFIX + "disk_read_bytes", "Bytes clients read from the disk tier.", registry=r
        )
        self.disk_read_requests = Counter(
            _PREFIX + "disk_read_requests", "Read items served from the disk tier.", registry=r
        )
        self.moves = Counter(
            _PREFIX + "moves", "Copies between tiers, by source, destination and result.",
            ["src", "dst", "result"], registry=r,
        )  # fmt: skip
        self.move_bytes = Counter(
            _PREFIX + "move_bytes", "Bytes copied between tiers.", ["src", "dst"], registry=r
        )
        self.move_queue_bytes = Gauge(
            _PREFIX + "move_queue_bytes", "Bytes of moves admitted and not finished.", registry=r
        )

    def track_disk(
        self,
        capacity_bytes: int,
        used_bytes: Callable[[], float],
        objects: Callable[[], float],
        filesystem_free_bytes: Callable[[], float],
    ) -> None:
        """Export the disk tier's gauges: only a node that has one does (a 0 from a node without
        would read as a full disk, and fire the alert on its free space)."""
        r = self._registry
        Gauge(_PREFIX + "disk_capacity_bytes", "Bytes of the disk tier.", registry=r).set(capacity_bytes)
        Gauge(_PREFIX + "disk_used_bytes", "Bytes of objects on the disk tier.", registry=r).set_function(used_bytes)
        Gauge(_PREFIX + "disk_objects", "Objects on the disk tier.", registry=r).set_function(objects)
        Gauge(
            _PREFIX + "disk_filesystem_free_bytes",
            "Bytes left on the disk tier's filesystem, as of the node's last look (each heartbeat).",
            registry=r,
        ).set_function(filesystem_free_bytes)
