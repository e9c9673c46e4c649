"""Registering an engine's host KV memory with a kvpool Store, for zero-copy transfers.

Engines keep their KV cache in a few large tensors, often as views of one another (SGLang's
K and V buffers are halves of one kv_buffer; vLLM may carve every layer out of one block of
memory). A Store's registered buffers must not overlap, so this module registers the union of
the tensors' storages as disjoint ranges. It is not an allocator and owns no memory: the
engine's tensors must outlive the registration.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from kvpool.client.sync import Store
from kvpool.errors import InvalidParams

log = logging.getLogger(__name__)


def covering_ranges(tensors: Iterable[Any]) -> list[tuple[int, int]]:
    """The union of the tensors' storages as sorted, disjoint (start address, size) ranges."""
    spans = sorted(
        (t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
        for t in tensors
        if t is not None and t.numel()
    )
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end - start) for start, end in merged]


def register_tensors(store: Store, tensors: Iterable[Any]) -> list[int]:
    """Register the memory of `tensors` with `store`; returns the registered addresses.

    Raises:
        InvalidParams: a tensor not in host memory (a GPU's); a range overlaps memory
            registered earlier, or too many buffers;
            the ranges registered by this call are unregistered again first.
    """
    tensors = list(tensors)
    for tensor in tensors:
        # A GPU's address is not this process's memory: a copy from or into it would crash it.
        if tensor is not None and tensor.device.type != "cpu":
            raise InvalidParams(f"a tensor on {tensor.device}: kvpool moves host memory only")
    addresses = []
    try:
        for start, size in covering_ranges(tensors):
            store.register_buffer(start, size)
            addresses.append(start)
    except BaseException:
        for address in addresses:
            store.unregister_buffer(address)
        raise
    return addresses


class RefusedRegistrations:
    """Registrations a Store would not drop yet, kept until it does: a get cancelled past the
    transfer timeout whose disk read still writes into the range (the Store refuses its
    unregister_buffer until that read ends). Each is kept with what owns its memory (holding
    it keeps the engine from freeing or reusing it under the late write) and what to call
    once the range is free; `retry` (at an adapter's next call) drops them again."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._kept: list[tuple[int, Any, Callable[[], None] | None]] = []
        self._lock = threading.Lock()

    def unregister(self, address: int, owner: Any = None, on_free: Callable[[], None] | None = None) -> bool:
        """Drop the registration at `address` now (True), or keep it with `owner` for `retry`,
        which calls `on_free` once it is dropped (False, logged)."""
        try:
            self._store.unregister_buffer(address)
        except InvalidParams as exc:
            log.warning("kvpool kept memory registered, a late read still writes into it: %s", exc)
            with self._lock:
                self._kept.append((address, owner, on_free))
            return False
        return True

    def retry(self) -> None:
        """Drop the kept registrations whose late writes have ended since."""
        with self._lock:
            kept, self._kept = self._kept, []
        for address, owner, on_free in kept:
            if self.unregister(address, owner, on_free) and on_free is not None:
                on_free()
