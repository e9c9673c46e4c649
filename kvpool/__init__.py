"""kvpool: a pooled KV-cache store for LLM serving.

The host DRAM of many servers, pooled into one store that every serving process can read:
KV cache written on one server is fetched by another, peer to peer, instead of recomputed.

    from kvpool import Store
    with Store("127.0.0.1:50051") as store:
        store.put("prefix-hash", kv_bytes)
        kv = store.get("prefix-hash")        # None on a miss

See DESIGN.md in the project's shared docs for the architecture.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpool.client.store import AsyncStore
    from kvpool.client.sync import Store
    from kvpool.errors import ErrorCode, KVPoolError
    from kvpool.protocol.messages import ReplicateConfig

__all__ = ["AsyncStore", "ErrorCode", "KVPoolError", "ReplicateConfig", "Store"]
__version__ = "0.1.0"

# Loaded on first use: the `kvpool` command imports this package before anything else, and
# only then can it make a Ctrl-C during its imports quiet (main in kvpool/cli/__init__.py).
_HOMES = {
    "AsyncStore": "kvpool.client.store",
    "Store": "kvpool.client.sync",
    "ErrorCode": "kvpool.errors",
    "KVPoolError": "kvpool.errors",
    "ReplicateConfig": "kvpool.protocol.messages",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kvpool' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
