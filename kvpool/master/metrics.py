"""The master's Prometheus metrics and HTTP surface (/metrics, /health, /status): read-only.

The service keeps plain integer counters (no prometheus calls on the hot path); a collector
reads them at scrape time, with per-segment gauges from the service's cluster status. Each
master has its own registry, so several masters (tests, HA) can share a process.

Metric names (prefix kvpool_master_): role{role} (1 for the master's role: single, leader,
recovering, standby; a standby's other figures are empty), objects, pending_puts, tombstones, requests_total{kind},
puts_total, put_bytes_total, gets_total, hits_total, misses_total, evictions_total,
evicted_bytes_total, removes_total, errors_total, put_room_rounds_total,
leases_released_total, refused_returns_total, per segment
segment_capacity_bytes{segment,node,endpoint}, segment_used_bytes{...}, segment_objects{...},
segment_quarantined_bytes{...} (of the used bytes, those that discarded or revoked puts hold
until their writers' grants are long past: master/membership.py),
segment_free_extents{...} and segment_largest_free_bytes{...} (fragmentation: a full cache
that churns leaves its free space in holes, docs/performance.md "A full cache that churns"),
segment_filesystem_free_bytes{...} and segment_writable{...} (what a slower tier's node last
reported of the filesystem under it: docs/tiers.md "Bounds and back-pressure"),
segment_reachable{...} (0 while its node's link is down, before the TTL drops it), and
segments{tier,state} (active, draining, unreachable, ...: an alert's `state="unreachable"`),
and per tier (docs/tiers.md) tier_capacity_bytes{tier}, tier_used_bytes{tier}, tier_objects{tier},
tier_hits_total{tier}, tier_offloads_total{tier}, tier_promotions_total{tier},
tier_copies_total{tier}, tier_evictions_total{tier}, tier_failed_moves_total{tier}; busy_poll_seconds_total and
busy_poll_windows_total (what polling after replies costs: transports/busy_poll.py); and with
the default eviction policy policy_objects{set} (probation, protected) and readmissions_total
(objects put again soon after their eviction: the signal that DRAM is short for the traffic).
"""

from __future__ import annotations

from collections import Counter as CountByName
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvpool.protocol.messages import ClusterStatus, ClusterStatusReply
from kvpool.transports import busy_poll
from kvpool.transports.busy_poll import BusyPoll
from kvpool.transports.http import serve_http

if TYPE_CHECKING:
    from kvpool.master.server import MasterServer
    from kvpool.master.service import MasterService

_PREFIX = "kvpool_master_"
# The service's counters (counters.py MasterCounters) and their /metrics help.
COUNTER_HELP = {
    "puts": "Objects stored.",
    "put_bytes": "Bytes of the objects stored.",
    "gets": "Keys looked up by gets.",
    "hits": "Keys a get's lookup found: its read may still miss (a dead node, a lapsed lease, bad bytes).",
    "misses": "Keys a get's lookup did not find (absent, or a put in flight).",
    "evictions": "Objects evicted.",
    "evicted_bytes": "Footprint freed by evictions, every replica.",
    "removes": "Objects removed.",
    "lost": "Objects lost with their last segment (a kept one's once its node did not bring it back).",
    "bad_replicas": "Replicas dropped because a check confirmed bad bytes.",
    "errors": "Failed requests and per-key failures.",
    "put_room_rounds": "Rounds puts waited for eviction to make room.",
    "leases_released": "Read leases given back by their readers before they expired.",
    "lookup_holds": "Objects a prefix lookup held from eviction for the load after it.",
    "refused_returns": "Objects a node mounted again that were removed or evicted while it was away: refused.",
}
COUNTER_NAMES = tuple(COUNTER_HELP)
# MasterServer.role's answers: no election, leading, leading before its nodes came back, not leading.
ROLES = ("single", "leader", "recovering", "standby")


class MasterMetrics(Collector):
    """Reads the service's counters when Prometheus scrapes."""

    def __init__(self, service: MasterService, role: Callable[[], str] = lambda: "single") -> None:
        self._service = service
        self._role = role  # the master's (MasterServer.role): a standby's figures are empty
        self.busy_poll: BusyPoll | None = None  # the listener's, once serving
        self.requests: CountByName[str] = CountByName()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def count_request(self, kind: str) -> None:
        self.requests[kind] += 1

    def collect(self) -> Iterator[Any]:
        # A standby knows nothing of the cluster: its zeros must not read as a leader that lost
        # every node (an alert on objects == 0 fired on it: walk-through helper-155).
        role, current = GaugeMetricFamily(_PREFIX + "role", "1 for this master's role.", labels=["role"]), self._role()
        for name in ROLES:
            role.add_metric([name], float(name == current))
        yield role
        status = self._service.cluster_status(ClusterStatus(), 0)
        yield GaugeMetricFamily(_PREFIX + "objects", "Complete objects.", value=status.object_count)
        yield GaugeMetricFamily(
            _PREFIX + "pending_puts", "Puts started and not yet ended.", value=status.pending_count
        )
        yield GaugeMetricFamily(
            _PREFIX + "tombstones",
            "Drops kept for segments that went before their node acknowledged them.",
            value=len(self._service.tombstones),
        )
        counters = self._service.counters
        for name in COUNTER_NAMES:
            yield CounterMetricFamily(_PREFIX + name, COUNTER_HELP[name], value=getattr(counters, name))
        requests = CounterMetricFamily(_PREFIX + "requests", "Requests by kind.", labels=["kind"])
        for kind, count in sorted(self.requests.items()):
            requests.add_metric([kind], count)
        yield requests
        labels = ["segment", "node", "endpoint"]
        capacity = GaugeMetricFamily(_PREFIX + "segment_capacity_bytes", "Segment size.", labels=labels)
        used = GaugeMetricFamily(_PREFIX + "segment_used_bytes", "Bytes allocated.", labels=labels)
        objects = GaugeMetricFamily(_PREFIX + "segment_objects", "Replicas held.", labels=labels)
        quarantined = GaugeMetricFamily(
            _PREFIX + "segment_quarantined_bytes",
            "Of the used bytes, those of puts given up while their writes may still land.", labels=labels,
        )  # fmt: skip
        extents = GaugeMetricFamily(_PREFIX + "segment_free_extents", "Holes of free space.", labels=labels)
        largest = GaugeMetricFamily(
            _PREFIX + "segment_largest_free_bytes", "The largest hole of free space.", labels=labels
        )
        filesystem_free = GaugeMetricFamily(
            _PREFIX + "segment_filesystem_free_bytes",
            "What a slower tier's filesystem had free at its last report.", labels=labels,
        )  # fmt: skip
        writable = GaugeMetricFamily(
            _PREFIX + "segment_writable", "0 while a slower tier's filesystem takes no writes.", labels=labels
        )
        reachable = GaugeMetricFamily(
            _PREFIX + "segment_reachable",
            "0 from when its node's connection closed until it speaks again or the node TTL drops it: its "
            "objects read as missing meanwhile.", labels=labels,
        )  # fmt: skip
        by_state = GaugeMetricFamily(_PREFIX + "segments", "Segments mounted, by tier and state.",
                                     labels=["tier", "state"])  # fmt: skip
        holes = {c.segment_id: c for c in self._service.segment_counters()}
        for segment in status.segments:
            values = [segment.segment.segment_id, segment.segment.node_id, segment.segment.endpoint]
            capacity.add_metric(values, segment.segment.capacity_bytes)
            used.add_metric(values, segment.used_bytes)
            objects.add_metric(values, segment.object_count)
            counters = holes[segment.segment.segment_id]  # the same registry, the same moment
            extents.add_metric(values, counters.free_extent_count)
            largest.add_metric(values, counters.largest_free_bytes)
            quarantined.add_metric(values, counters.quarantined_bytes)
            if segment.filesystem_free_bytes >= 0:
                filesystem_free.add_metric(values, segment.filesystem_free_bytes)
            writable.add_metric(values, int(segment.is_writable))
            if segment.state != "leaving":  # (a leaving one's link is neither here nor there)
                reachable.add_metric(values, int(segment.state != "unreachable"))
        states = CountByName((s.segment.tier, s.state) for s in status.segments)
        for (tier, state), count in sorted(states.items()):
            by_state.add_metric([tier, state], count)
        yield from (capacity, used, objects, quarantined, extents, largest, filesystem_free, writable, reachable,
                    by_state)  # fmt: skip
        yield from _tier_metrics(status)
        yield from _policy_metrics(self._service.policy_stats())
        if self.busy_poll is not None:
            yield from busy_poll.metric_families(_PREFIX, self.busy_poll)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _policy_metrics(stats: dict[str, int]) -> Iterator[Any]:
    """The eviction policy's sets and readmissions, where it has them (ProbationLru does)."""
    if "protected_objects" in stats:
        sets = GaugeMetricFamily(
            _PREFIX + "policy_objects",
            "Objects in DRAM by eviction-policy set: probation (not read since put), protected (read).",
            labels=["set"],
        )
        sets.add_metric(["probation"], stats["probation_objects"])
        sets.add_metric(["protected"], stats["protected_objects"])
        yield sets
    if "readmissions" in stats:
        yield CounterMetricFamily(
            _PREFIX + "readmissions",
            "Objects put again soon after their eviction: what more DRAM would have kept.",
            value=stats["readmissions"],
        )


def _tier_metrics(status: ClusterStatusReply) -> Iterator[Any]:
    """Per tier (dram, disk, dfs; docs/tiers.md): capacity, use and the tier counters."""
    gauges = {
        "capacity_bytes": GaugeMetricFamily(
            _PREFIX + "tier_capacity_bytes", "Bytes of the tier's mounted segments.", labels=["tier"]
        ),
        "used_bytes": GaugeMetricFamily(_PREFIX + "tier_used_bytes", "Bytes allocated in the tier.", labels=["tier"]),
        "object_count": GaugeMetricFamily(_PREFIX + "tier_objects", "Replicas in the tier.", labels=["tier"]),
    }
    counters = {
        name: CounterMetricFamily(_PREFIX + f"tier_{name}", f"Tier {name}: {help_text}", labels=["tier"])
        for name, help_text in (
            ("hits", "gets whose nearest replica was in the tier."),
            ("offloads", "objects moved into the tier from a faster one."),
            ("promotions", "objects copied into the tier from a slower one."),
            ("evictions", "replicas that left the tier to make room."),
            ("copies", "write-through copies into the tier (puts with with_disk_copy or with_dfs_copy)."),
            ("failed_moves", "offloads, promotions and write-through copies into the tier that failed: the "
                             "node could not write them, did not answer, or could not be reached (an offloaded "
                             "object is then dropped, or kept where it was if the filesystem was full; a "
                             "put's copy leaves its faster replicas)."),
        )
    }
    for tier in status.tiers:
        for name, family in gauges.items():
            family.add_metric([tier.tier], getattr(tier, name))
        for name, family in counters.items():
            family.add_metric([tier.tier], getattr(tier, name))
    yield from gauges.values()
    yield from counters.values()


async def start_http(host: str, port: int, server: MasterServer) -> tuple[web.AppRunner, int]:
    """Serve the HTTP surface; returns the runner (for cleanup) and the bound port."""

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=server.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(_request: web.Request) -> web.Response:
        # role: "single", "leader", "recovering" or "standby" (HA masters, election.py). An HA
        # master that cannot reach etcd answers 503: a standby with a mistyped --etcd looked
        # healthy until the failover that needed it.
        answer = {"status": "ok", "endpoint": server.endpoint, "role": server.role}
        etcd_error = server.elector.etcd_error if server.elector is not None else None
        if etcd_error is not None:
            answer.update(status="etcd unreachable", etcd_error=etcd_error)
            return web.json_response(answer, status=503)
        return web.json_response(answer)

    async def status(_request: web.Request) -> web.Response:
        reply = server.service.cluster_status(ClusterStatus(), 0)
        return web.json_response({**reply.to_dict(), "role": server.role})  # a standby's: empty

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_get("/status", status)
    return await serve_http(app, host, port, "--http-port")
