"""Placement: the order in which a put's replicas try the active segments.

This module turns a placement strategy (messages.PLACEMENTS) into an ordered stream of
candidate segments; the service allocates on them in that order until it has `replica_num`
replicas on distinct segments. It is not where allocation happens, and it never offers a
draining segment, nor one whose node the master lost its connection to (the registry's
`active` view excludes them).

    "random"      uniform random; a few independent draws first, then every segment from a
                  random start, so a nearly full cluster still finds the one that fits.
    "free_ratio"  emptiest first (free_bytes / capacity), ties by mount order.
    "local"       segments on the client's host first (in random order), then random.
    "preferred"   the request's preferred segment ids in the given order, then random. A
                  preferred id naming a slower tier's segment (disk, DFS: ClusterStatus lists
                  them) is skipped like one without room: puts land in DRAM only, and moves
                  fill the slower tiers (docs/tiers.md).

A put places a run of keys at a time (up to puts.RUN_BYTES_MAX, one range per replica), or a
key at a time when no segment holds the run in one piece. Costs per placement: "random",
"local" and "preferred" O(replica_num) when the first tries fit, O(s) at worst for s active
segments; "free_ratio" O(s log s).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

from kvpool.master.membership import Segment, SegmentRegistry
from kvpool.protocol.messages import TIER_DRAM

# Independent random draws before the exhaustive scan: enough that a cluster with room almost
# never needs the scan, few enough that a full one is not probed at length.
_RANDOM_DRAWS_EXTRA = 4


def candidate_segments(
    registry: SegmentRegistry,
    placement: str,
    replica_num: int,
    rng: random.Random,
    client_hostname: str = "",
    preferred_segment_ids: Sequence[str] = (),
) -> Iterator[Segment]:
    """Active segments in the order the strategy tries them; may repeat one (callers skip)."""
    if placement == "free_ratio":
        yield from sorted(registry.active, key=_free_ratio_descending)
        return
    if placement == "local" and client_hostname:
        local = list(registry.active_by_hostname.get(client_hostname, ()))
        rng.shuffle(local)
        yield from local
    elif placement == "preferred":
        for segment_id in preferred_segment_ids:
            segment = registry.get(segment_id)
            if segment is not None and segment.takes_new_replicas and segment.tier == TIER_DRAM:
                yield segment
    yield from _random_order(registry.active, replica_num, rng)


def _free_ratio_descending(segment: Segment) -> float:
    allocator = segment.allocator
    if allocator.capacity_bytes == 0:
        return 0.0
    return -allocator.free_bytes / allocator.capacity_bytes


def _random_order(active: list[Segment], replica_num: int, rng: random.Random) -> Iterator[Segment]:
    # int(random() * n) rather than randrange(n): 5x cheaper, and its bias (n / 2**53) is nil.
    count = len(active)
    if count == 0:
        return
    for _ in range(min(count, replica_num + _RANDOM_DRAWS_EXTRA)):
        yield active[int(rng.random() * count)]
    start = int(rng.random() * count)
    for step in range(count):
        yield active[(start + step) % count]
