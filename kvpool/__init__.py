"""kvpool: a pooled KV-cache store for LLM serving.

The host DRAM of many servers, pooled into one store that every serving process can read:
KV cache written on one server is fetched by another, peer to peer, instead of recomputed.

    from kvpool import Store
    with Store("127.0.0.1:50051") as store:
        store.put("prefix-hash", kv_bytes)
        kv = store.get("prefix-hash")        # None on a miss

See DESIGN.md in the project's shared docs for the architecture.
"""

from kvpool.client.store import AsyncStore
from kvpool.client.sync import Store
from kvpool.errors import ErrorCode, KVPoolError
from kvpool.protocol.messages import ReplicateConfig

__all__ = ["AsyncStore", "ErrorCode", "KVPoolError", "ReplicateConfig", "Store"]
__version__ = "0.1.0"
