"""What the master counts, for /metrics: event counters and per-segment gauges.

Plain ints bumped on the hot paths (no Prometheus calls there); metrics.py reads them at
scrape time. This module is not the exporter and decides nothing.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class MasterCounters:
    """Monotonic event counts for /metrics. `gets` counts keys asked, `hits + misses == gets`;
    `evicted_bytes` is the footprint freed (every replica); `lost` counts objects that vanished
    with their last segment; `bad_replicas` counts replicas dropped because a check confirmed
    that their bytes no longer hash to the object's checksum (a reader's report: bit rot, a
    stale writer); `errors` counts raised requests and per-key failure codes (invalid key or
    parameters, no space after the put's last round, transfer failure); `put_room_rounds` counts
    the rounds puts waited for eviction to make room (a cache that runs full: each round is a
    wait of the put for drops or offloads to land); `leases_released` counts read leases given
    back by their readers before they expired (ReleaseLeases); `lookup_holds` counts objects a
    prefix lookup held for the load that follows it (LongestPrefix.hold_ms); `refused_returns`
    counts objects a node mounted again although they were removed or evicted while it was
    away (tombstones.py)."""

    puts: int = 0
    put_bytes: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    removes: int = 0
    lost: int = 0
    bad_replicas: int = 0
    errors: int = 0
    put_room_rounds: int = 0
    leases_released: int = 0
    lookup_holds: int = 0
    refused_returns: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class SegmentCounters:
    """One segment's gauges for /metrics."""

    segment_id: str
    node_id: str
    state: str
    capacity_bytes: int
    used_bytes: int
    free_bytes: int
    object_count: int
    quarantined_bytes: int
    drop_bytes: int
    free_extent_count: int = 0  # holes of free space: many, and small, is a fragmented segment
    largest_free_bytes: int = 0  # the largest object (or run of objects) that fits now


@dataclasses.dataclass(slots=True)
class TierCounters:
    """Monotonic counts per tier (appended with the tiers, docs/tiers.md): `hits` gets whose
    nearest replica was in the tier; `offloads` objects moved into it from a faster tier;
    `promotions` objects copied into it from a slower tier; `copies` write-through copies into
    it; `evictions` replicas that left it to make room (moved down or dropped); `failed_moves`
    offloads, promotions and copies into it that failed (the node could not write them, did
    not answer, or could not be reached)."""

    hits: int = 0
    offloads: int = 0
    promotions: int = 0
    copies: int = 0
    evictions: int = 0
    failed_moves: int = 0
