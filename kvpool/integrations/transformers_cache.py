"""KV cache of a Hugging Face `transformers` model, stored in kvpool one page at a time.

A serving instance that has prefilled a prompt saves the KV cache of every full page of
`page_size_tokens` tokens as one kvpool object; another instance, in another process on
another node, finds how many leading pages of its own prompt are in the pool (one
`longest_prefix` round trip), reads them straight into one staging tensor (`batch_get_into`)
and computes only the tokens after them. Page keys are chained hashes of the token ids, so
a page's key names the whole prefix up to its end: equal keys mean equal KV.

Object layout, one per page (float tensors in the model's dtype, C order):

    [layer 0: K (kv_heads, page_size_tokens, head_dim) | V (same)] [layer 1: K | V] ...

This module is not a serving engine: batch size 1, full-attention decoder models whose cache
is a `DynamicCache` of per-layer (1, kv_heads, tokens, head_dim) tensors (Llama, Qwen2,
Mistral and the like); sliding-window and MLA caches are not handled.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpool.client.sync import Store
from kvpool.errors import InvalidParams
from kvpool.limits import LOOKUP_HOLD_MS_DEFAULT
from kvpool.protocol.messages import ReplicateConfig

HASH_SIZE_BYTES = 16


@dataclasses.dataclass(frozen=True)
class PageLayout:
    """The shape of one page object, read off the model config."""

    model_id: str
    layer_count: int
    kv_head_count: int
    head_dim: int
    page_size_tokens: int
    dtype: Any  # torch.dtype

    @classmethod
    def from_config(cls, model_id: str, config: Any, page_size_tokens: int, dtype: Any) -> PageLayout:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        if page_size_tokens <= 0:
            raise InvalidParams(f"page_size_tokens must be positive, not {page_size_tokens}")
        return cls(model_id, config.num_hidden_layers, kv_heads, head_dim, page_size_tokens, dtype)

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (self.layer_count, 2, self.kv_head_count, self.page_size_tokens, self.head_dim)

    @property
    def page_size_bytes(self) -> int:
        import torch

        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return int(np.prod(self.page_shape)) * itemsize

    def page_keys(self, token_ids: Sequence[int]) -> list[str]:
        """One key per full page of `token_ids`; key i hashes every token of pages 0..i."""
        keys = []
        digest = hashlib.blake2b(
            f"{self.model_id}|{self.page_size_tokens}|{self.dtype}".encode(),
            digest_size=HASH_SIZE_BYTES,
        ).digest()
        full = len(token_ids) // self.page_size_tokens * self.page_size_tokens
        for start in range(0, full, self.page_size_tokens):
            page = np.asarray(token_ids[start : start + self.page_size_tokens], dtype=np.int64)
            digest = hashlib.blake2b(digest + page.tobytes(), digest_size=HASH_SIZE_BYTES).digest()
            keys.append(f"{self.model_id}/kv/{digest.hex()}")
        return keys


def save_pages(
    store: Store,
    layout: PageLayout,
    cache: Any,
    token_ids: Sequence[int],
    config: ReplicateConfig | None = None,
) -> list[int]:
    """Store every full page of `cache` (a DynamicCache over `token_ids`). Pages already in
    the pool are skipped by the store (a put of an existing key is a success).

    Returns:
        One ErrorCode per page, in page order.
    """
    import torch

    keys = layout.page_keys(token_ids)
    if not keys:
        return []
    n = layout.page_size_tokens
    staging = torch.empty((len(keys), *layout.page_shape), dtype=layout.dtype)
    for layer_index, layer in enumerate(cache.layers):
        for kv_index, tensor in enumerate((layer.keys, layer.values)):
            assert tensor.shape[0] == 1, "batch size 1 only"
            # (1, heads, tokens, dim) -> (pages, heads, n, dim) for the full pages.
            pages = tensor[0, :, : len(keys) * n].unflatten(1, (len(keys), n)).transpose(0, 1)
            staging[:, layer_index, kv_index] = pages
    address = staging.data_ptr()
    store.register_buffer(address, staging.nbytes)
    try:
        size = layout.page_size_bytes
        return store.batch_put_from(
            keys, [address + i * size for i in range(len(keys))], [size] * len(keys), config
        )
    finally:
        store.unregister_buffer(address)


def load_pages(store: Store, layout: PageLayout, token_ids: Sequence[int]) -> tuple[Any, int]:
    """The cache of the longest run of leading pages of `token_ids` found in the pool.

    One `longest_prefix` round trip finds the run and holds it from eviction; one
    `batch_get_into` reads it into a single staging tensor (its lease release ends the hold).
    A page that vanished between the two anyway (removed) ends the run there.

    Returns:
        (DynamicCache or None, number of tokens it covers).
    """
    import torch
    from transformers import DynamicCache

    keys = layout.page_keys(token_ids)
    count = store.longest_prefix(keys, LOOKUP_HOLD_MS_DEFAULT) if keys else 0
    if count == 0:
        return None, 0
    staging = torch.empty((count, *layout.page_shape), dtype=layout.dtype)
    address = staging.data_ptr()
    size = layout.page_size_bytes
    store.register_buffer(address, staging.nbytes)
    try:
        results = store.batch_get_into(
            keys[:count], [address + i * size for i in range(count)], [size] * count
        )
    finally:
        store.unregister_buffer(address)
    complete = 0
    for result in results:
        if result != size:  # a miss (negative code), or an object of another layout
            break
        complete += 1
    if complete == 0:
        return None, 0
    cache = DynamicCache()
    pages = staging[:complete]
    for layer_index in range(layout.layer_count):
        # (pages, heads, n, dim) -> (1, heads, pages * n, dim)
        k, v = (
            pages[:, layer_index, kv].transpose(0, 1).flatten(1, 2).unsqueeze(0).contiguous()
            for kv in (0, 1)
        )
        cache.update(k, v, layer_index)
    return cache, complete * layout.page_size_tokens
