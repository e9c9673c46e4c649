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
    with their last segment; `errors` counts raised requests and per-key failure codes
    (invalid key or parameters, no space, transfer failure)."""

    puts: int = 0
    put_bytes: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    removes: int = 0
    lost: int = 0
    errors: int = 0


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
