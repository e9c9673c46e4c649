"""vLLM KV events for the blocks kvpool's vLLM connector saves and removes.

With KV events on (vLLM's --kv-events-config '{"enable_kv_cache_events": true, ...}'), vLLM's
scheduler publishes each step what its block pool cached (medium "GPU") and what its KV
connector's `take_events` returns. KVPoolConnector keeps one SaveEvents on its scheduler side
for that, and none while KV events are off. A save job's blocks are announced once every
worker has reported the job (the connector's `_unpin_saved`), those that every rank put
alone, as BlockStored events shaped as vLLM's block pool shapes its own (block hashes, the
parent's hash, token ids, LoRA, extra keys; vLLM's `BlockPool.cache_full_blocks`), with
medium "CPU": a block lands in a DRAM segment of the pool, as one of vLLM's CPU offloading
lands in its CPU tier. The blocks the connector removes from the pool after a failed load go
out as BlockRemoved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash, to_event_extra_keys

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.request import Request

MEDIUM = MEDIUM_CPU


@dataclasses.dataclass
class _PlannedSave:
    """A save job's blocks: `block_count` blocks of `request`'s prompt from `first_block`,
    and the positions among them that some worker did not put."""

    request: Request
    first_block: int
    block_count: int
    failed: set[int] = dataclasses.field(default_factory=set)


class SaveEvents:
    """The scheduler side's KV events: save jobs planned, then announced once done."""

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._planned: dict[int, _PlannedSave] = {}
        self._events: list[KVCacheEvent] = []

    def plan(self, job: int, request: Request, first_block: int, block_count: int) -> None:
        """Save job `job` puts `block_count` blocks of `request` from `first_block`."""
        self._planned[job] = _PlannedSave(request, first_block, block_count)

    def report(self, job: int, failed: Iterable[int], is_done: bool, pool: BlockPool, doomed: set[str]) -> None:
        """Workers reported `job`, with the positions of its blocks they did not put; once
        `is_done` (every worker reported it), its blocks that every rank put, and that the
        connector does not remove (their hex hashes in `doomed`), are announced, each run of
        consecutive ones as one BlockStored."""
        planned = self._planned.get(job)
        if planned is None:
            return
        planned.failed.update(failed)
        if not is_done:
            return
        del self._planned[job]
        request, first = planned.request, planned.first_block
        hashes = request.block_hashes
        run: list[int] = []
        for position in range(first, first + planned.block_count):
            if position - first in planned.failed or hashes[position].hex() in doomed:
                self._stored(pool, request, run)
                run = []
            else:
                run.append(position)
        self._stored(pool, request, run)

    def _stored(self, pool: BlockPool, request: Request, positions: Sequence[int]) -> None:
        """One BlockStored for `request`'s consecutive blocks at `positions`, as vLLM's block
        pool builds one for blocks it caches."""
        if not positions:
            return
        size, hashes, first = self._block_size, request.block_hashes, positions[0]
        extra_keys: list[tuple[Any, ...] | None] = []
        lookahead = [] if pool.num_hash_lookahead_tokens else None
        mm_index = 0
        for position in positions:
            keys, mm_index = pool.generate_event_extra_keys(request, position * size, (position + 1) * size, mm_index)
            extra_keys.append(keys)
            if lookahead is not None:
                lookahead.append(pool.get_lookahead_token_ids(request, (position + 1) * size))
        lora = request.lora_request
        self._events.append(
            BlockStored(
                block_hashes=[maybe_convert_block_hash(hashes[p]) for p in positions],
                parent_block_hash=maybe_convert_block_hash(hashes[first - 1]) if first > 0 else None,
                token_ids=list(request.all_token_ids[first * size : (positions[-1] + 1) * size]),
                block_size=size,
                lora_id=lora.adapter_id if lora else None,
                medium=MEDIUM,
                lora_name=lora.name if lora else None,
                extra_keys=to_event_extra_keys(extra_keys),
                group_idx=0,  # the connector supports one KV cache group
                session_id=request.session_id,
                lookahead_token_ids=lookahead,
            )
        )

    def removed(self, block_hashes: Iterable[str]) -> None:
        """The connector removes these blocks (hex hashes) from the pool."""
        unique = list(dict.fromkeys(block_hashes))
        if unique:
            hashes = [maybe_convert_block_hash(bytes.fromhex(h)) for h in unique]
            self._events.append(BlockRemoved(block_hashes=hashes, medium=MEDIUM, group_idx=0))

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call (vLLM asks each step)."""
        events, self._events = self._events, []
        return events
