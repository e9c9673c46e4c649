"""Configuration records for the master, nodes and clients, and how they are read.

The records are plain frozen dataclasses with defaults from limits.py; cores receive them
ready-made. Only the edges (cli/, integrations/) read the environment or files, through
`token_from()`, `parse_size()` and the `KVPOOL_*` variables the CLI declares.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from kvpool import limits
from kvpool.errors import InvalidParams


@dataclasses.dataclass(frozen=True)
class MasterConfig:
    lease_ttl_ms: int = limits.LEASE_TTL_MS_DEFAULT
    soft_pin_ttl_ms: int = limits.SOFT_PIN_TTL_MS_DEFAULT
    put_discard_timeout_ms: int = limits.PUT_DISCARD_TIMEOUT_MS_DEFAULT
    put_release_timeout_ms: int = limits.PUT_RELEASE_TIMEOUT_MS_DEFAULT
    evict_watermark_ratio_high: float = limits.EVICT_WATERMARK_RATIO_HIGH_DEFAULT
    evict_ratio: float = limits.EVICT_RATIO_DEFAULT
    node_ttl_ms: int = limits.NODE_TTL_MS_DEFAULT
    remount_grace_ms: int = limits.REMOUNT_GRACE_MS_DEFAULT

    def __post_init__(self) -> None:
        if not 0.0 < self.evict_ratio < self.evict_watermark_ratio_high <= 1.0:
            raise InvalidParams("need 0 < evict_ratio < evict_watermark_ratio_high <= 1")
        if self.put_discard_timeout_ms > self.put_release_timeout_ms:
            raise InvalidParams("put_discard_timeout_ms must not exceed put_release_timeout_ms")
        for name in ("lease_ttl_ms", "put_discard_timeout_ms", "node_ttl_ms"):
            if getattr(self, name) <= 0:
                raise InvalidParams(f"{name} must be positive")


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes in a size such as "1GiB", "512MB", "4096" (binary units throughout).

    Raises:
        InvalidParams: the text is not a size.
    """
    match = _SIZE_RE.match(text)
    if match is None:
        raise InvalidParams(f"not a size: {text!r} (try 1GiB, 512MiB or a byte count)")
    number, unit = match.groups()
    multiplier = _SIZE_UNITS[(unit or "").upper().rstrip("B").rstrip("I")]
    return int(float(number) * multiplier)


def token_from(token: str | None = None, token_file: str | None = None) -> str | None:
    """The cluster token: an explicit value, else a file, else $KVPOOL_TOKEN, else None."""
    if token:
        return token
    if token_file:
        text = Path(token_file).read_text().strip()
        if not text:
            raise InvalidParams(f"token file {token_file} is empty")
        return text
    return os.environ.get("KVPOOL_TOKEN") or None
