"""Configuration records for the master, nodes and clients, and how they are read.

The records are plain frozen dataclasses with defaults from limits.py; cores receive them
ready-made. Only the edges (cli/, integrations/) read the environment or files, through
`token_from()`, `parse_size()` and the `KVPOOL_*` variables the CLI declares.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import stat
from fractions import Fraction
from pathlib import Path

from kvpool import limits
from kvpool.errors import InvalidParams

log = logging.getLogger(__name__)


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
    # Tiers (docs/tiers.md): an object read this many times from disk or DFS within the
    # window is copied back into DRAM (0: never).
    promote_reads: int = limits.PROMOTE_READS_DEFAULT
    promotion_window_ms: int = limits.PROMOTION_WINDOW_MS_DEFAULT
    # DRAM eviction order, by name (master/eviction.py POLICIES): "probation" or "lru".
    eviction_policy: str = limits.EVICTION_POLICY_DEFAULT

    def __post_init__(self) -> None:
        # Imported here, not at the top: every client imports config, and none needs the master.
        from kvpool.master.eviction import POLICIES

        if self.eviction_policy not in POLICIES:
            raise InvalidParams(f"eviction policy {self.eviction_policy!r} not one of {sorted(POLICIES)}")
        if not 0.0 < self.evict_ratio < self.evict_watermark_ratio_high <= 1.0:
            raise InvalidParams("need 0 < evict_ratio < evict_watermark_ratio_high <= 1")
        if self.put_discard_timeout_ms > self.put_release_timeout_ms:
            raise InvalidParams("put_discard_timeout_ms must not exceed put_release_timeout_ms")
        for name in ("lease_ttl_ms", "put_discard_timeout_ms", "node_ttl_ms", "promotion_window_ms"):
            if getattr(self, name) <= 0:
                raise InvalidParams(f"{name} must be positive")
        # `kvpool node` heartbeats every HEARTBEAT_INTERVAL_MS_DEFAULT: with a shorter TTL (10,
        # seconds meant) every node was dropped between two heartbeats and mounted again at the
        # next, forever, and every put failed. The floor is one heartbeat, which tests whose
        # in-process nodes heartbeat faster use; three outlast a late one (limits.py asserts it).
        if self.node_ttl_ms < limits.HEARTBEAT_INTERVAL_MS_DEFAULT:
            raise InvalidParams(f"node_ttl_ms {self.node_ttl_ms}: at least {limits.HEARTBEAT_INTERVAL_MS_DEFAULT} "
                                f"ms, the nodes' heartbeat interval (a shorter TTL drops every node between two "
                                f"heartbeats; the default is {limits.NODE_TTL_MS_DEFAULT})")  # fmt: skip
        if self.promote_reads < 0:
            raise InvalidParams(f"promote_reads {self.promote_reads}: give 0 (never) or more")
        if self.remount_grace_ms < 0:  # 0: a new leader takes puts at once
            raise InvalidParams(f"remount_grace_ms {self.remount_grace_ms}: give 0 or more")
        durations = ("lease_ttl_ms", "soft_pin_ttl_ms", "put_discard_timeout_ms", "put_release_timeout_ms",
                     "node_ttl_ms", "remount_grace_ms", "promotion_window_ms")  # fmt: skip
        _refuse_over_a_week(self, durations)


def _refuse_over_a_week(record: object, names: tuple[str, ...]) -> None:
    """Raises InvalidParams: a duration field of `record` over limits.SETTING_DURATION_MS_MAX."""
    for name in names:
        value = getattr(record, name)
        if value > limits.SETTING_DURATION_MS_MAX:
            raise InvalidParams(f"{name} {value}: at most {limits.SETTING_DURATION_MS_MAX} ms (a week)")


# A unit is K, M, G or T, with or without "iB" or "B", or "B" alone ("5iB" was read as 5 bytes).
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes in a size such as "1GiB", "512MB", "4096" (binary units throughout: "1GB" is 1 GiB).
    A fraction of a unit is taken, rounded down to a byte ("0.1GiB" is 107374182 bytes); a
    byte count must be whole ("1.3" is refused, not read as 1).

    Raises:
        InvalidParams: the text is not a size, or not a whole number of bytes.
    """
    match = _SIZE_RE.match(text)
    if match is None:
        raise InvalidParams(f"not a size: {text!r} (try 1GiB, 512MiB or a byte count)")
    number, unit = match.groups()
    multiplier = _SIZE_UNITS[(unit or "").upper().rstrip("B").rstrip("I")]
    # Exact, and any length: through a float, 400 digits raised OverflowError (a traceback).
    size_bytes = Fraction(number) * multiplier
    if multiplier == 1 and size_bytes.denominator != 1:  # "1.3" was read as 1 byte, without a word
        whole = int(size_bytes)
        raise InvalidParams(f"{text.strip()} is not a whole number of bytes (between {whole} and {whole + 1})")
    return int(size_bytes)


def exact_size(size_bytes: int) -> str:
    """A size in the largest binary unit that holds it whole: 512 KiB, 1500 KiB, 3 MiB."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size_bytes and size_bytes % (1 << shift) == 0:
            return f"{size_bytes >> shift} {unit}"
    return f"{size_bytes} bytes"


_FLAG_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def parse_flag(value: object, what: str) -> bool:
    """A yes/no setting as engines' JSON or YAML configs give it: a bool, or 1/0, true/false,
    yes/no or on/off in any case. `what` names the setting in the error.

    Raises:
        InvalidParams: anything else ("flase" was once read as yes).
    """
    flag = _FLAG_WORDS.get(str(value).strip().lower())
    if flag is None:
        raise InvalidParams(f"{what} must be on or off (1/0, true/false, yes/no), not {value!r}")
    return flag


def check_busy_poll_us(busy_poll_us: int) -> None:
    """Raises InvalidParams: a busy-poll window out of [0, BUSY_POLL_US_MAX]."""
    if not 0 <= busy_poll_us <= limits.BUSY_POLL_US_MAX:
        raise InvalidParams(f"busy_poll_us {busy_poll_us} out of [0, {limits.BUSY_POLL_US_MAX}]")


def token_from(token: str | None = None, token_file: str | None = None) -> str | None:
    """The cluster token: an explicit value, else a file, else the file $KVPOOL_TOKEN_FILE
    names, else $KVPOOL_TOKEN, else None: the command line's order (its --token-file reads
    $KVPOOL_TOKEN_FILE), so that an engine adapter finds the token a deployment exported for
    every kvpool command and serving process (README, "Deploying on several machines"). A
    file's first line: the others are tokens a server accepts as well (tokens_from)."""
    tokens = tokens_from(token, token_file)
    return tokens[0] if tokens else None


def tokens_from(token: str | None = None, token_file: str | None = None) -> list[str]:
    """The cluster tokens, from the source token_from reads ([] for none): a token file holds
    one per line, blank lines and lines that start with "#" skipped. The first is the one a
    process connects and signs with; a master or node accepts every one from its peers, so
    that a token can be rotated in and out without a restart (docs/operations.md "Rotating
    the token")."""
    if token:
        return [token]
    # A file named by the environment is said to be: the command named none.
    source = "" if token_file else " (named by $KVPOOL_TOKEN_FILE)"
    token_file = token_file or os.environ.get("KVPOOL_TOKEN_FILE") or None
    if token_file:
        try:
            text = Path(token_file).read_text().strip()
        except (OSError, ValueError) as exc:  # ValueError: not UTF-8 (the token is text), a NUL in the path
            reason = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else getattr(exc, "strerror", str(exc))
            raise InvalidParams(f"cannot read token file {token_file}{source}: {reason}") from None
        tokens = list(dict.fromkeys(line for line in map(str.strip, text.splitlines()) if line and line[0] != "#"))
        if not tokens:
            raise InvalidParams(f"token file {token_file}{source} is empty (or only comments)")
        _warn_if_every_user_reads(token_file)
        _warn_if_short(token_file, tokens)
        return tokens
    value = os.environ.get("KVPOOL_TOKEN")
    if not value:
        return []
    # Stripped as a file's text is: a secret made from a file and set as a variable (a
    # Kubernetes secretKeyRef) keeps the file's newline, and gave another cluster key.
    text = value.strip()
    if not text:
        raise InvalidParams("KVPOOL_TOKEN holds only whitespace: set a token, or unset it for none")
    return [text]


_token_files_warned: set[str] = set()
_short_tokens_warned: set[str] = set()
# A token shorter than this is said to be guessable (whoever guesses it joins the cluster).
TOKEN_CHARS_MIN = 16


def _warn_if_short(token_file: str, tokens: list[str]) -> None:
    """Says once per file that it holds a token short enough to guess. Not refused: a test
    cluster's token may be anything."""
    short = min(len(token) for token in tokens)
    if short < TOKEN_CHARS_MIN and token_file not in _short_tokens_warned:
        _short_tokens_warned.add(token_file)
        log.warning("token file %s holds a token of %d characters: whoever guesses it joins the cluster; use 32 "
                    "random bytes (openssl rand -hex 32)", token_file, short)  # fmt: skip


def _warn_if_every_user_reads(token_file: str) -> None:
    """Says once per file that every user of this host can read the token, and so read and
    write the cluster's cache. Not refused: a Kubernetes secret is mounted 0644 unless its
    defaultMode says otherwise, and the operator may mean it."""
    try:
        mode = os.stat(token_file).st_mode
    except OSError:
        return  # read a moment ago: gone meanwhile, and the token is what was read
    if mode & stat.S_IROTH and token_file not in _token_files_warned:
        _token_files_warned.add(token_file)
        log.warning(
            "token file %s can be read by every user of this host (mode %03o): each of them can "
            "read and write the cluster's cache; make it readable only by kvpool's users (chmod o-r)",
            token_file,
            stat.S_IMODE(mode),
        )


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    """What a Store needs: where the master is, how to authenticate, how to move bytes.

    `shm_enabled` turns on the same-host paths: copies through mapped segments, and the Unix
    sockets of same-host servers (transports/connection.py) instead of TCP. Off, a client
    behaves as if every server were on another host.
    """

    master: str = f"127.0.0.1:{limits.MASTER_PORT_DEFAULT}"
    # None: the file $KVPOOL_TOKEN_FILE names, else $KVPOOL_TOKEN, as every kvpool command
    # and engine adapter reads them (token_from); "" for none whatever the environment says.
    token: str | None = None
    shm_enabled: bool = True
    hostname: str = ""  # "" = socket.gethostname(); used for local-first placement
    connections_per_peer: int = limits.CONNECTIONS_PER_PEER_DEFAULT
    rpc_timeout_ms: int = limits.RPC_TIMEOUT_MS_DEFAULT
    connect_timeout_ms: int = limits.CONNECT_TIMEOUT_MS_DEFAULT
    transfer_timeout_ms: int = limits.TRANSFER_TIMEOUT_MS_DEFAULT
    # Embedded mode: contribute a segment of this size from the client process (0 = none).
    embedded_memory_bytes: int = 0
    # This host's mount of the shared filesystem's kvpool directory: DFS replicas are read
    # straight from it ("" = none: DFS replicas are skipped). Appended with the tiers.
    dfs_dir: str = ""
    # Give a get's read leases back once it is done (client/leases.py); off, they run for the
    # master's whole lease TTL, as Mooncake's do (the Mooncake-compatible API keeps that).
    release_leases: bool = True
    # Tokens to connect with once a server refuses `token` as a wrong one (auth.Keyring): with
    # `token` None, the rest of the token file's lines (a token being rotated).
    other_tokens: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.token is None:
            tokens = tokens_from()
            object.__setattr__(self, "token", tokens[0] if tokens else None)  # frozen: set once, here
            object.__setattr__(self, "other_tokens", (*self.other_tokens, *tokens[1:]))
        if self.other_tokens and not self.token:  # dropped unsaid, the refusal named no token at all
            raise InvalidParams("other_tokens without a token: give the token to connect with first")
        if "" in self.other_tokens:
            raise InvalidParams("other_tokens holds an empty token")
        if not 1 <= self.connections_per_peer <= limits.CONNECTIONS_PER_PEER_MAX:
            raise InvalidParams(
                f"connections_per_peer must be in [1, {limits.CONNECTIONS_PER_PEER_MAX}]"
            )
        for name in ("rpc_timeout_ms", "connect_timeout_ms", "transfer_timeout_ms"):
            if getattr(self, name) <= 0:
                raise InvalidParams(f"{name} must be positive")
        _refuse_over_a_week(self, ("rpc_timeout_ms", "connect_timeout_ms", "transfer_timeout_ms"))


def _check_segment_size(name: str, size_bytes: int) -> None:
    """Raises InvalidParams: a segment size out of limits, its range also said in units."""
    low, high = limits.SEGMENT_SIZE_BYTES_MIN, limits.SEGMENT_SIZE_BYTES_MAX
    if not low <= size_bytes <= high:
        raise InvalidParams(f"{name} {size_bytes} out of [{low}, {high}] bytes ({exact_size(low)} to "
                            f"{high >> 40} TiB)")  # fmt: skip


# The node section: its two imports stay local to it, so that it was appended without edits above.
def _node_id_default() -> str:
    import uuid

    return uuid.uuid4().hex[:12]


def _hostname_default() -> str:
    import socket

    return socket.gethostname()


@dataclasses.dataclass(frozen=True)
class NodeConfig:
    """A storage node (kvpool/node/server.py): its segment, its listener and its master.

    `advertise_host` is what clients dial: None means the listen host, or this host's address
    when listening on a wildcard (0.0.0.0 or ::). `shm_enabled=False` hides the segment file
    from same-host clients (they then use TCP) and keeps the node's own link to a same-host
    master on TCP. `metrics_port` None serves no HTTP; 0 picks a
    free port. `metrics_host` None means the listen host.
    """

    master_endpoint: str
    memory_bytes: int
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    advertise_host: str | None = None
    shm_dir: str = "/dev/shm"
    shm_enabled: bool = True
    token: str | None = None
    # Tokens accepted from peers besides `token`, which the node connects with (a token
    # rotating in or out: auth.Keyring); empty without `token`.
    accepted_tokens: tuple[str, ...] = ()
    heartbeat_interval_ms: int = limits.HEARTBEAT_INTERVAL_MS_DEFAULT
    rpc_timeout_ms: int = limits.RPC_TIMEOUT_MS_DEFAULT
    connect_timeout_ms: int = limits.CONNECT_TIMEOUT_MS_DEFAULT
    node_id: str = dataclasses.field(default_factory=_node_id_default)
    hostname: str = dataclasses.field(default_factory=_hostname_default)
    metrics_port: int | None = None
    metrics_host: str | None = None
    busy_poll_us: int = limits.BUSY_POLL_US_DEFAULT
    # Tiers (docs/tiers.md). disk_dir "": no disk tier. disk_bytes: its capacity when the
    # directory is new (0: use the stored one; a new directory needs a size). disk_fsync:
    # fdatasync each file and fsync the directory before the master hears of it (off: a
    # power loss may lose recent files, never serve a wrong one). dfs_dir: this host's mount
    # of the shared filesystem's kvpool directory ("": none).
    disk_dir: str = ""
    disk_bytes: int = 0
    disk_fsync: bool = True
    dfs_dir: str = ""
    # On a stop, leave the DRAM segment and its objects this long for the node started again
    # with the same node_id (node/segment.py, Segment.keep); 0: unlink it.
    keep_ms: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.keep_ms <= limits.KEEP_MS_MAX:
            raise InvalidParams(f"keep_ms {self.keep_ms} out of [0, {limits.KEEP_MS_MAX}]")
        if self.disk_bytes:
            _check_segment_size("disk_bytes", self.disk_bytes)
        _check_segment_size("memory_bytes", self.memory_bytes)
        for name in ("heartbeat_interval_ms", "rpc_timeout_ms", "connect_timeout_ms"):
            if getattr(self, name) <= 0:
                raise InvalidParams(f"{name} must be positive")
        _refuse_over_a_week(self, ("heartbeat_interval_ms", "rpc_timeout_ms", "connect_timeout_ms"))
        check_busy_poll_us(self.busy_poll_us)
        for name in ("listen_port", "metrics_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port < 65536:
                raise InvalidParams(f"{name} {port} out of range")
        if not self.node_id or not re.fullmatch(r"[A-Za-z0-9_.-]+", self.node_id):
            raise InvalidParams(f"node_id {self.node_id!r}: use letters, digits, '_', '.', '-'")
        if self.token == "" or "" in self.accepted_tokens:
            raise InvalidParams("an empty token means no token: pass None")
        if self.accepted_tokens and not self.token:
            raise InvalidParams("accepted_tokens without a token: a node with none accepts every peer")
