"""The kvpool settings every engine adapter reads from its engine's extra config.

vLLM (`kv_connector_extra_config`), SGLang (`--hicache-storage-backend-extra-config`) and
LMCache (`extra_config`, kvpool's keys under "kvpool.") each hand their plugin a dict parsed
from JSON or YAML, so a number may come as text and a flag as "false". The common keys are
read here once, and a bad value fails the engine's start with the key's name, where it would
otherwise fail (or be refused by the master) at the first put or lookup of a serving engine.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Collection, Mapping
from typing import Any

from kvpool import limits
from kvpool.client.sync import Store
from kvpool.config import parse_flag, parse_size, tokens_from
from kvpool.errors import ErrorCode, InvalidParams
from kvpool.integrations import breaker
from kvpool.protocol.messages import ReplicateConfig

_WHOLE_NUMBER = re.compile(r"-?[0-9]+")  # as text; str.isdigit() takes '²', which int() refuses

log = logging.getLogger(__name__)

# The keys read here, as every adapter's configuration names them (after its prefix).
COMMON_KEYS = (
    "master", "token", "token_file", "embedded_memory", "shm_enabled", "replica_num", "lookup_hold_ms",
    "lookup_timeout_ms", "lookup_backoff_ms_min", "lookup_backoff_ms_max",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Where the pool is and how an adapter uses it, from the engine's extra config."""

    master: str
    token: str | None
    embedded_memory_bytes: int
    shm_enabled: bool
    replicate: ReplicateConfig
    lookup_hold_ms: int
    # A lookup's own bound on the master's answer, and the breaker's window after one could
    # not reach it (breaker.py).
    lookup_timeout_ms: int = breaker.LOOKUP_TIMEOUT_MS_DEFAULT
    lookup_backoff_ms_min: int = breaker.LOOKUP_BACKOFF_MS_MIN_DEFAULT
    lookup_backoff_ms_max: int = breaker.LOOKUP_BACKOFF_MS_MAX_DEFAULT
    # The token file's other lines, tried once a server refuses `token` (auth.Keyring: a
    # token being rotated, so that a serving engine rides through the rotation's last step).
    other_tokens: tuple[str, ...] = ()

    @classmethod
    def read(
        cls,
        extra: Mapping[str, Any] | None,
        where: str,
        prefix: str = "",
        adapter_keys: Collection[str] = (),
        engine_keys: Collection[str] = (),
    ) -> EngineOptions:
        """kvpool's keys (each named `prefix` + key) from `extra`, the dict an engine calls
        `where` in its own configuration. The master is its "master" key, else $KVPOOL_MASTER.
        A key under `prefix` that is none of these, of `adapter_keys` (the adapter's own) or of
        `engine_keys` (what the engine itself reads from the dict) is logged as a warning: the
        engine hands a misspelt key on unread, and the default stood in without a word.

        Raises:
            InvalidParams: no master anywhere, or a value that is not what its key takes.
        """
        extra = extra or {}
        _warn_of_unread_keys(extra, where, prefix, (*COMMON_KEYS, *adapter_keys), engine_keys)

        def value(key: str, default: object) -> object:
            return extra.get(prefix + key, default)

        def whole(key: str, default: int, low: int, high: int) -> int:
            given = value(key, default)
            text = str(given).strip()
            number = given if type(given) is int else int(text) if _WHOLE_NUMBER.fullmatch(text) else None
            if number is None or not low <= number <= high:
                raise InvalidParams(f"{prefix}{key} in {where} must be a whole number in {low}..{high}, not {given!r}")
            return number

        def size(key: str) -> int:
            try:
                return parse_size(str(value(key, 0)))
            except InvalidParams as exc:
                raise InvalidParams(f"{prefix}{key} in {where}: {exc}") from None

        master = value("master", None) or os.environ.get("KVPOOL_MASTER")
        if not master:
            raise InvalidParams(f"set '{prefix}master' in {where} (or $KVPOOL_MASTER)")
        timeout_ms = whole("lookup_timeout_ms", breaker.LOOKUP_TIMEOUT_MS_DEFAULT, 1, breaker.LOOKUP_TIMEOUT_MS_MAX)
        longest_ms = breaker.LOOKUP_BACKOFF_MS_MAX
        backoff_ms_min = whole("lookup_backoff_ms_min", breaker.LOOKUP_BACKOFF_MS_MIN_DEFAULT, 1, longest_ms)
        # (a minimum above the default maximum raises the maximum's default with it)
        default_ms_max = max(backoff_ms_min, breaker.LOOKUP_BACKOFF_MS_MAX_DEFAULT)
        backoff_ms_max = whole("lookup_backoff_ms_max", default_ms_max, backoff_ms_min, longest_ms)
        tokens = tokens_from(value("token", None), value("token_file", None))
        return cls(
            master=str(master),
            token=tokens[0] if tokens else None,
            other_tokens=tuple(tokens[1:]),
            embedded_memory_bytes=size("embedded_memory"),
            shm_enabled=parse_flag(value("shm_enabled", True), f"{prefix}shm_enabled in {where}"),
            replicate=ReplicateConfig(replica_num=whole("replica_num", 1, 1, limits.REPLICA_NUM_MAX)),
            lookup_hold_ms=whole("lookup_hold_ms", limits.LOOKUP_HOLD_MS_DEFAULT, 0, limits.LOOKUP_HOLD_MS_MAX),
            lookup_timeout_ms=timeout_ms,
            lookup_backoff_ms_min=backoff_ms_min,
            lookup_backoff_ms_max=backoff_ms_max,
        )

    def lookup_breaker(self, what: str) -> breaker.LookupBreaker:
        """A breaker for these lookups (`what`: whose, for its log lines)."""
        return breaker.LookupBreaker(what, self.lookup_backoff_ms_min, self.lookup_backoff_ms_max)

    def open_store(self) -> Store:
        """A Store on the pool these options name."""
        return Store(
            self.master,
            token=self.token,
            other_tokens=self.other_tokens,
            embedded_memory_bytes=self.embedded_memory_bytes,
            shm_enabled=self.shm_enabled,
        )


_unread_keys_warned: set[tuple[str, ...]] = set()  # an engine's every worker reads the same config


def _warn_of_unread_keys(
    extra: Mapping[str, Any], where: str, prefix: str, kvpool_keys: Collection[str], engine_keys: Collection[str]
) -> None:
    names = [str(key) for key in extra if str(key).startswith(prefix)]
    unread = sorted(name for name in names if name[len(prefix) :] not in kvpool_keys and name not in engine_keys)
    if unread and (where, *unread) not in _unread_keys_warned:
        _unread_keys_warned.add((where, *unread))
        log.warning(
            "kvpool: %s has %s, which kvpool does not read (misspelt?); it reads %s",
            where, ", ".join(map(repr, unread)), ", ".join(prefix + key for key in kvpool_keys),
        )  # fmt: skip


def without_ats(name: str) -> str:
    """A part of a key namespace (a model name, a cache prefix, a tag) with no '@', which ends
    each part: "team" + "m" and "team@m" would share their keys."""
    return name.replace("@", "-")


# What a save's put answers for a block the pool holds now: done, or there already.
STORED_CODES = (ErrorCode.OK, ErrorCode.OBJECT_ALREADY_EXISTS)
# ... or will hold, not a failure: another put of it in flight (another instance saving the
# same prompt, REPLICA_IS_NOT_READY: counted failed, three of four instances saving a shared
# system prompt reported every block failed, and SGLang gave up the rest of its backup).
SAVED_CODES = (*STORED_CODES, ErrorCode.REPLICA_IS_NOT_READY)
