"""Reference caches in plain Python: the yardsticks a master-driven replay is checked against.

`reference_lru` is the model behind the figures of ../shared/data/README.md, word for word:
one LRU cache of `capacity_blocks` blocks, requests in timestamp order, a request hits the
longest leading run of its blocks that is cached, and after that lookup every block of the
request is inserted in order (an insert of a cached block moves it to the most recent end;
an insert into a full cache evicts the least recent block). With capacities of 1M, 3M and
10M tokens (floor(tokens / 512) blocks) and unbounded it gives 0.139, 0.309, 0.566 and 0.640.

`reference_belady` is the offline optimum under the master's own rules, so that
`BeladyPolicy` inside the real master can be checked against it exactly: a run of absent
blocks is put in one batch (room is made for the whole run first, among objects not in the
run), a block read in the same millisecond holds a lease and cannot be evicted, and among
evictable blocks the one used furthest in the future goes first (ties: deepest, then highest
block id). These are models, not the store: they hold no bytes and no master.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import OrderedDict
from collections.abc import Sequence

from kvpool.errors import InvalidParams
from kvpool.sim.trace import TraceRequest, next_uses


@dataclasses.dataclass(frozen=True)
class ReferenceResult:
    block_hits: int
    blocks: int

    @property
    def hit_rate(self) -> float:
        return self.block_hits / self.blocks if self.blocks else 0.0


def reference_lru(requests: Sequence[TraceRequest], capacity_blocks: int | None) -> ReferenceResult:
    """The README's model: one LRU cache; `capacity_blocks` None means unbounded."""
    if capacity_blocks is not None and capacity_blocks <= 0:
        raise InvalidParams(f"capacity_blocks {capacity_blocks} <= 0")
    cache: OrderedDict[int, None] = OrderedDict()
    hits = blocks = 0
    for request in requests:
        ids = request.hash_ids
        for block in ids:
            if block not in cache:
                break
            hits += 1
        blocks += len(ids)
        for block in ids:
            if block in cache:
                cache.move_to_end(block)
            else:
                cache[block] = None
                if capacity_blocks is not None and len(cache) > capacity_blocks:
                    cache.popitem(last=False)
    return ReferenceResult(hits, blocks)


def reference_belady(
    requests: Sequence[TraceRequest], capacity_blocks: int, lease_ttl_ms: int = 1
) -> ReferenceResult:
    """Furthest-next-use eviction with the master's batch and lease rules (module docstring).

    Raises:
        InvalidParams: a run of blocks cannot fit (every cached block is leased).
    """
    if capacity_blocks <= 0:
        raise InvalidParams(f"capacity_blocks {capacity_blocks} <= 0")
    future = next_uses(requests)
    priority: dict[int, tuple[int, int]] = {}  # block -> (next use, depth)
    lease_expiry_ms: dict[int, int] = {}
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, -block)
    hits = blocks = 0
    for index, request in enumerate(requests):
        now_ms = request.timestamp
        ids = request.hash_ids
        for block in ids:
            if block not in priority:
                break
            hits += 1
        blocks += len(ids)
        position = 0
        while position < len(ids):
            is_cached = ids[position] in priority
            end = position
            while end < len(ids) and (ids[end] in priority) == is_cached:
                end += 1
            if not is_cached:
                room = capacity_blocks - len(priority)
                need = (end - position) - room
                held = []
                while need > 0:
                    if not heap:
                        raise InvalidParams(f"request {index}: no evictable block for a run")
                    entry = heapq.heappop(heap)
                    block = -entry[2]
                    if priority.get(block) != (-entry[0], -entry[1]):
                        continue  # stale
                    if lease_expiry_ms.get(block, 0) > now_ms:
                        held.append(entry)
                        continue
                    del priority[block]
                    need -= 1
                for entry in held:
                    heapq.heappush(heap, entry)
            for depth in range(position, end):
                block = ids[depth]
                if is_cached:
                    lease_expiry_ms[block] = now_ms + lease_ttl_ms
                value = (future[index][depth], depth)
                priority[block] = value
                heapq.heappush(heap, (-value[0], -depth, -block))
            position = end
        if len(heap) > 3 * len(priority) + 1_024:
            heap = [(-n, -d, -b) for b, (n, d) in priority.items()]
            heapq.heapify(heap)
    return ReferenceResult(hits, blocks)
