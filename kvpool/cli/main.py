"""The `kvpool` command: servers (master, node), object commands and the demo.

This is where configuration is read (flags, `KVPOOL_*` environment variables, token files) and
turned into the config records that the cores take; nothing below cli/ reads the environment.
Object commands talk to a running cluster through the sync `Store`.
"""

from __future__ import annotations

if __name__ == "__main__":  # `python -m kvpool.cli.main`, as LocalCluster starts servers: first of all
    from kvpool.cli import ignore_sigusr1_until_served

    ignore_sigusr1_until_served()

import asyncio
import contextlib
import errno
import gc
import ipaddress
import json
import logging
import os
import re
import signal
import socket
import sys
import unicodedata
from collections.abc import Callable, Iterator
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvpool import limits
from kvpool.cli.config_file import flags_from_file, forget_settings, load_settings
from kvpool.config import parse_flag, parse_size, tokens_from
from kvpool.errors import ErrorCode, InvalidParams, KVPoolError, NoAvailableHandle, RpcTimeout, Unauthorized
from kvpool.process import discard_stdout

if TYPE_CHECKING:
    from kvpool.client.sync import Store
    from kvpool.node.server import Node
    from kvpool.protocol.messages import SegmentStatus

# What the object commands (put, get, rm, ls, stat, bench) exit with: a script tells a miss, which
# it answers by computing the object again, from a failure, which it reports.
EXIT_FAILED = 1  # the cluster unreachable, too slow or refusing; a file unreadable or unwritable
EXIT_USAGE = 2  # click's own code for a command line it cannot read
EXIT_NOT_FOUND = 3  # get: no object to read; rm: keys not removed (absent, or under a read lease)
EXIT_STATUSES_HELP = (
    "Exit status of the object commands: 0 done, 1 failed (the cluster unreachable or refusing, a "
    "file unreadable), 2 usage error, 3 not found (get: a miss; rm: keys not removed)."
)

# What every size option says of its units (config.parse_size): "1GB" is not 10^9 bytes.
SIZE_UNITS = "binary units: 1GB is 1 GiB"

# Help is click's plain layout (rich_markup_mode=None): rich's option tables, fitted to 80
# columns, cut option and environment variable names ("--evict-watermar…"); click wraps the
# descriptions and never cuts a name.
app = typer.Typer(
    name="kvpool",
    help="kvpool: a pooled KV-cache store. Host DRAM of many servers as one cache for LLM serving.",
    epilog=EXIT_STATUSES_HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if value:
        import kvpool

        # The wire version decides who talks to whom: peers of another one refuse each other.
        print(f"kvpool {kvpool.__version__} (wire version {limits.FRAME_VERSION})")
        raise typer.Exit()


@app.callback()
def _kvpool(
    version: Annotated[
        bool, typer.Option("--version", is_eager=True, callback=_print_version, help="Print the version and exit.")
    ] = False,
) -> None:
    """kvpool: a pooled KV-cache store. Host DRAM of many servers as one cache for LLM serving."""
    forget_settings()


# emoji=False: rich read ":name:" in a message as an emoji code, and printed the key "a:ok:b"
# or the address in "127.0.0.1:abc: not a master address" with an emoji in its place.
console = Console(emoji=False)
# soft_wrap: a message is one line however long (a terminal folds it; a log file keeps it whole).
err_console = Console(stderr=True, soft_wrap=True, emoji=False)
log = logging.getLogger(__name__)

MasterOption = Annotated[
    str,
    typer.Option(
        "--master", "-m", envvar="KVPOOL_MASTER",
        help="Master address HOST:PORT, or etcd://HOST:PORT,HOST:PORT/CLUSTER_ID (one etcd "
        "endpoint or more; the cluster id defaults to 'default') to follow the leader that HA "
        "masters elect there.",
    ),
]
BusyPollOption = Annotated[
    int,
    typer.Option(
        help="Keep polling this long (µs) after each reply before sleeping, so that a client's next "
        "request finds the process awake (0: sleep at once; docs/performance.md).",
    ),
]


class LogLevel(str, Enum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


class EvictionPolicyName(str, Enum):
    """kvpool master --eviction-policy: master/eviction.py POLICIES (a test checks they agree)."""

    probation = "probation"
    lru = "lru"


def _path(text: str) -> Path:
    """A path option's value. An empty one is refused: click reads "" as ".", and
    `--disk-dir ""` made a disk tier in the working directory."""
    if not text:
        raise typer.BadParameter("an empty path")
    return Path(text)


# A choice, so that a misspelt level is a usage error naming the choices, not a traceback.
LogLevelOption = Annotated[
    LogLevel, typer.Option(envvar="KVPOOL_LOG_LEVEL", case_sensitive=False, help="The least severe level logged.")
]
TokenFileOption = Annotated[
    Optional[Path],
    typer.Option(
        "--token-file", envvar="KVPOOL_TOKEN_FILE", parser=_path,
        help="File holding the cluster token (or set KVPOOL_TOKEN). Without a token, servers "
        "bind loopback only. One token per line: the first is used, every one accepted by a master or node "
        "(kill -USR1 makes it read the file again: a token rotated without a restart).",
    ),
]  # fmt: skip
TimeoutOption = Annotated[
    float,
    typer.Option(
        "--timeout", envvar="KVPOOL_TIMEOUT", min=0.1, max=3600.0,
        help="Seconds to wait for each answer of the master before the command fails (reaching "
        "it, etcd:// included, may take up to 2 s more). Moves of bytes to and from nodes have their own 30 s bound.",
    ),
]  # fmt: skip
TIMEOUT_DEFAULT = limits.RPC_TIMEOUT_MS_DEFAULT / 1000
ConfigOption = Annotated[
    Optional[Path],
    typer.Option(
        "--config", envvar="KVPOOL_CONFIG", is_eager=True, callback=load_settings, parser=_path,
        help="TOML file of settings, a table per command ([master], [node]) keyed by option name "
        "(memory = \"64GiB\"). The command line wins, then KVPOOL_* variables, then the file.",
    ),
]  # fmt: skip
MASTER_DEFAULT = f"127.0.0.1:{limits.MASTER_PORT_DEFAULT}"
PORT_MAX = 65535
# Tables printed to a pipe or a file: wider than any row, so that no value (a segment id, an
# endpoint) is cut with "…" to fit 80 columns, as it would be by default (cli/replay.py does
# the same).
CONSOLE_WIDTH_NOT_TERMINAL = 1_000
# A node waiting for its master says so when it starts waiting; its master link's failures
# say why it still waits, at most every 30 s (a second line of its own each time was noise).
MASTER_WAIT_INTERVAL_MS = 30_000
# A master whose node TTL is under this many heartbeats says so at start: one heartbeat a little
# late drops a live node (its objects counted lost) until it mounts again: a flapping node.
NODE_TTL_HEARTBEATS_MIN = 3


def _setup_logging(level: LogLevel) -> None:
    logging.basicConfig(
        level=level.value.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


def _freeze_start_up_objects() -> None:
    """Take what a server process holds once started (its modules, its set-up) out of the
    cyclic garbage collector's sight. A full collection traversed all of it: 25-60 ms on this
    project's VM, once every few thousand puts, and every request waited (docs/performance.md,
    "Pauses"). What the server allocates later is still collected."""
    gc.freeze()


def _token(token_file: Optional[Path]) -> str | None:
    tokens = _tokens(token_file)
    return tokens[0] if tokens else None


def _tokens(token_file: Optional[Path]) -> list[str]:
    """Every token --token-file holds (or the environment), the one to connect with first."""
    # --token-file takes $KVPOOL_TOKEN_FILE: the path it holds goes as unnamed, so that an
    # error about the file says where its name came from.
    named = os.environ.get("KVPOOL_TOKEN_FILE")
    from_environment = bool(named) and token_file == Path(named)
    try:
        return tokens_from(None, str(token_file) if token_file and not from_environment else None)
    except InvalidParams as exc:
        if token_file is None or from_environment:
            raise
        raise InvalidParams(f"--token-file: {exc}") from None  # (said with the settings file that set it)


def _replace_tokens_on_sigusr1(token_file: Optional[Path], replace: Callable[[list[str]], None], name: str) -> None:
    """From now on, SIGUSR1 reads the tokens again and hands them to `replace` (a server's
    replace_tokens): a token rotated in or out without a restart (docs/operations.md
    "Rotating the token"). A file that cannot be read, or a change replace refuses, is logged
    and the tokens stay as they were. Taken before the server starts: SIGUSR1's default
    action ends the process."""

    def reload() -> None:
        if token_file is None:  # nothing to read again: KVPOOL_TOKEN is the start's, or no token at all
            log.warning("%s: SIGUSR1 reads the token file again, and there is none (--token-file, "
                        "KVPOOL_TOKEN_FILE); KVPOOL_TOKEN is read at start only", name)  # fmt: skip
            return
        try:
            replace(_tokens(token_file))
        except KVPoolError as exc:
            log.error("%s: cluster tokens not replaced (SIGUSR1): %s; the ones before stay", name, exc)

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, reload)


def _fail(message: str, code: int = EXIT_FAILED) -> typer.Exit:
    err_console.print(f"[red]error:[/red] {escape(message + flags_from_file(message))}")
    return typer.Exit(code)


# The options behind the config fields their errors name (config.py speaks in fields): an
# operator is told about the flag typed, not a Python name.
_MASTER_FLAGS = {
    "dfs_dir": "--dfs-dir",
    "lease_ttl_ms": "--lease-ttl-ms",
    "node_ttl_ms": "--node-ttl-ms",
    "put_discard_timeout_ms": "--put-discard-timeout-ms",
    "put_release_timeout_ms": "--put-release-timeout-ms",
    "evict_watermark_ratio_high": "--evict-watermark-high",
    "evict_ratio": "--evict-ratio",
    "promote_reads": "--promote-reads",
    "remount_grace_ms": "--remount-grace-ms",
    "busy_poll_us": "--busy-poll-us",
}
_NODE_FLAGS = {
    "node_id": "--node-id",
    "shm_dir": "--shm-dir",
    "keep_ms": "--keep-ms",
    "memory_bytes": "--memory",
    "disk_bytes": "--disk-size",
    "listen_port": "--port",
    "metrics_port": "--metrics-port",
    "busy_poll_us": "--busy-poll-us",
}


def _check_pattern(name: str, pattern: str) -> None:
    """A key pattern RE2 cannot read is a usage error (exit status 2), said before the master is
    asked (it was exit status 1, as a failure of the cluster's)."""
    from kvpool.patterns import compile_pattern

    try:
        compile_pattern(pattern)
    except InvalidParams as exc:
        raise _fail(f"{name}: {exc}", EXIT_USAGE) from None


def _fail_in_flags(exc: KVPoolError, flags: dict[str, str]) -> typer.Exit:
    """_fail for a config error, each field it names spelt as its command-line flag."""
    pattern = r"\b(" + "|".join(flags) + r")\b"
    return _fail(re.sub(pattern, lambda match: flags[match.group(1)], str(exc)))


def _source_name(ctx: typer.Context, name: str) -> str:
    """Where option `name` took its value: COMMANDLINE, ENVIRONMENT, DEFAULT_MAP (a settings
    file) or DEFAULT, click's ParameterSource by name (typer may vendor click)."""
    source = ctx.get_parameter_source(name)
    return source.name if source is not None else "DEFAULT"


def _require_directory(size_flag: str, size: str | None, directory_flag: str, directory: Path | None) -> None:
    """A tier's size given without its directory would be ignored: refuse it instead."""
    if size and not directory:
        raise _fail(f"{size_flag} needs {directory_flag}: without its directory there is no tier to size")


def _check_listen_host(flag: str, host: str) -> None:
    """Refuse an address no server can listen on before anything starts, and before the
    cluster token rule, which answered `--host 256.1.1.1` with "without a cluster token": an
    IP address, or a host name that resolves. "" (every interface, as asyncio takes it) is
    left to the token rule."""
    if not host:
        return
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    # Labels that are all numbers are an IPv4 address or nothing (no top-level domain is a
    # number); said without a DNS query, which the resolver would make for 256.1.1.1.
    if all(label.isdigit() for label in host.split(".")):
        raise _fail(f"{flag} {host}: not a valid address (an IPv4 address is 4 numbers in 0..255, "
                    "such as 10.0.0.5)")  # fmt: skip
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise _fail(f"{flag} {host}: not a valid address: {getattr(exc, 'strerror', None) or exc}") from None


def _shown(key: str) -> str:
    """`key` as the commands print it: as it is, or as a Python string literal when it holds a
    control or format character (a newline in a key could fake more lines of `kvpool ls`)."""
    if any(unicodedata.category(char).startswith("C") for char in key):
        return repr(key)
    return key


# Of a key too long to print, this many characters are shown.
KEY_SHOWN_CHARS_MAX = 40


def _check_key(command: str, key: str) -> None:
    """Refuse a key the master refuses (metadata.is_valid_key: 1 to KEY_SIZE_BYTES_MAX bytes of
    UTF-8), before connecting: a put was answered a bare INVALID_KEY, a get or rm "not found"."""
    if not key:
        raise _fail(f"{command}: empty key (a key holds 1 to {limits.KEY_SIZE_BYTES_MAX} bytes of UTF-8)")
    size_bytes = len(key.encode(errors="surrogatepass"))
    if size_bytes > limits.KEY_SIZE_BYTES_MAX:
        shown = _shown(key)[:KEY_SHOWN_CHARS_MAX]
        raise _fail(f"{command} {shown}...: key too long: {size_bytes} bytes of UTF-8, at most "
                    f"{limits.KEY_SIZE_BYTES_MAX}")  # fmt: skip


def _failed(command: str, exc: KVPoolError, key: str | None = None) -> typer.Exit:
    """The one line for an object command's cluster error: "COMMAND [KEY]: what failed". The
    Store's errors about one key name it already ("put 'k' failed: ..."): then it is said once.
    """
    message = str(exc)
    if key is None:
        return _fail(f"{command}: {message}")
    if f"{key!r:.100}" in message:
        return _fail(message)
    return _fail(f"{command} {_shown(key)}: {message}")


def _size_of(flag: str, text: str, code: int = 1) -> int:
    """parse_size, its refusal naming the flag (and the settings file, where it came from)."""
    try:
        return parse_size(text)
    except KVPoolError as exc:
        raise _fail(f"{flag}: {exc}", code) from None


def _tier_size_of(flag: str, text: str | None) -> int:
    """A tier's size flag in bytes, 0 when not given (its config's "the size stored, or the
    filesystem's"). Given as 0 it is refused: it was taken as not given, and a new --disk-dir
    was answered "give its size (--disk-size)"."""
    if not text:
        return 0
    size_bytes = _size_of(flag, text)
    if size_bytes == 0:
        raise _fail(f"{flag} {text}: must be positive")
    return size_bytes


def _shm_from_environment() -> bool:
    """KVPOOL_SHM=0 (or off, false, no, in any case: as engines' shm_enabled) makes object
    commands use TCP even on the nodes' host; set empty, it is unset."""
    try:
        return parse_flag(os.environ.get("KVPOOL_SHM") or "1", "KVPOOL_SHM")
    except KVPoolError as exc:
        raise _fail(str(exc), code=EXIT_USAGE) from None


def _check_master(master: str, code: int) -> None:
    """Refuse a --master that is no address, naming the flag, before anything connects (it was
    said as "cannot reach the master at foo", as if the network were at fault)."""
    from kvpool.discovery import parse_master_address

    try:
        parse_master_address(master)
    except KVPoolError as exc:
        raise _fail(f"--master: {exc}", code) from None


def _store(
    master: str,
    token_file: Optional[Path],
    dfs_dir: Optional[Path] = None,
    shm_enabled: bool | None = None,
    timeout_s: float = TIMEOUT_DEFAULT,
) -> Store:
    from kvpool.client.sync import Store

    _check_master(master, EXIT_USAGE)
    if shm_enabled is None:
        shm_enabled = _shm_from_environment()
    rpc_timeout_ms = round(timeout_s * 1000)
    try:
        token = _token(token_file)
    except KVPoolError as exc:
        raise _fail(str(exc)) from None
    try:
        return Store(
            master, token=token, shm_enabled=shm_enabled,
            connect_timeout_ms=min(limits.CONNECT_TIMEOUT_MS_DEFAULT, rpc_timeout_ms),
            rpc_timeout_ms=rpc_timeout_ms, dfs_dir=str(dfs_dir or ""),
        )  # fmt: skip
    except Unauthorized as exc:  # reached, and refused: the token, not the network
        raise _fail(f"Unauthorized: {exc}") from None
    except InvalidParams as exc:  # reached, and not a master (a node's port)
        raise _fail(f"--master: {exc}") from None
    except KVPoolError as exc:
        at = "" if master in str(exc) else f" at {master}"  # most errors name it already
        raise _fail(f"cannot reach the master{at}: {exc}") from None


@contextlib.contextmanager
def _connected(
    command: str,
    master: str,
    token_file: Optional[Path],
    *,
    key: str | None = None,
    dfs_dir: Optional[Path] = None,
    shm_enabled: bool | None = None,
    timeout_s: float = TIMEOUT_DEFAULT,
) -> Iterator[Store]:
    """A Store for an object command, closed on leaving. Any cluster error in the block (a
    master that stops answering: RpcTimeout) ends the command with one line and exit status 1,
    never a traceback: "COMMAND [KEY]: the error"."""
    store = _store(master, token_file, dfs_dir, shm_enabled, timeout_s)
    try:
        with store:
            yield store
    except KVPoolError as exc:
        raise _failed(command, exc, key) from None


@contextlib.contextmanager
def _writing_stdout() -> Iterator[None]:
    """Output of the block, flushed at its end. A write that fails ends the command with exit
    status 1 and one line (a full disk: `kvpool get k > /dev/full`), or none when the reader
    left (`kvpool ls | head -1`), never a traceback."""
    try:
        yield
        sys.stdout.flush()
    except OSError as exc:
        discard_stdout()
        if exc.errno == errno.EPIPE:
            raise typer.Exit(EXIT_FAILED) from None
        raise _fail(f"cannot write to standard output: {exc.strerror or exc}") from None


def _table_console() -> Console:
    """Where tables go: the terminal, fitted to its width, or a pipe or file, whole."""
    if console.is_terminal:
        return console
    return Console(width=CONSOLE_WIDTH_NOT_TERMINAL, emoji=False)


# --- servers ----------------------------------------------------------------------------------


@app.command()
def master(
    ctx: typer.Context,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(help="RPC port (0 = any free port).", min=0, max=PORT_MAX)
    ] = limits.MASTER_PORT_DEFAULT,
    http_port: Annotated[
        int, typer.Option(help="Port of /metrics, /health, /status (0 = any free port).", min=0, max=PORT_MAX)
    ] = limits.MASTER_HTTP_PORT_DEFAULT,
    http_host: Annotated[
        Optional[str],
        typer.Option(help="Address /metrics, /health, /status listen on (default: --host). They only read, "
                     "and take no token: where only your monitoring reaches."),
    ] = None,
    lease_ttl_ms: Annotated[int, typer.Option(help="Read lease of a get.")] = limits.LEASE_TTL_MS_DEFAULT,
    node_ttl_ms: Annotated[
        int, typer.Option(help="A node silent this long is dropped with its replicas (nodes heartbeat every "
                          "second: give three or more).")
    ] = limits.NODE_TTL_MS_DEFAULT,
    put_discard_timeout_ms: Annotated[
        int, typer.Option(help="A put not ended within this is discarded.")
    ] = limits.PUT_DISCARD_TIMEOUT_MS_DEFAULT,
    put_release_timeout_ms: Annotated[
        int, typer.Option(help="A discarded put's space is reused only after this.")
    ] = limits.PUT_RELEASE_TIMEOUT_MS_DEFAULT,
    evict_watermark_high: Annotated[
        float, typer.Option(help="Eviction starts above this used ratio.")
    ] = limits.EVICT_WATERMARK_RATIO_HIGH_DEFAULT,
    evict_ratio: Annotated[
        float, typer.Option(help="Fraction of a segment freed per eviction.")
    ] = limits.EVICT_RATIO_DEFAULT,
    token_file: TokenFileOption = None,
    ready_file: Annotated[
        Optional[Path], typer.Option(parser=_path, help="Write {\"endpoint\", \"http_port\"} here once serving.")
    ] = None,
    debug_invariants: Annotated[
        bool,
        typer.Option(envvar="KVPOOL_DEBUG_INVARIANTS", help="Check every structure after every request (slow)."),
    ] = False,
    etcd: Annotated[
        Optional[str],
        typer.Option(
            envvar="KVPOOL_ETCD",
            help="etcd HOST:PORT[,HOST:PORT...]: run as one of several HA master candidates "
            "that elect a leader there (see docs/ha.md).",
        ),
    ] = None,
    cluster_id: Annotated[
        str,
        typer.Option(envvar="KVPOOL_CLUSTER_ID",
                     help="Name of the cluster in etcd (with --etcd; KVPOOL_CLUSTER_ID is ignored without it)."),
    ] = limits.CLUSTER_ID_DEFAULT,
    etcd_lease_ttl_ms: Annotated[
        int,
        typer.Option(help="The leader's etcd lease (whole seconds): how long a failover waits for a dead leader "
                     "(with --etcd; refused without it)."),
    ] = limits.ETCD_LEASE_TTL_MS_DEFAULT,
    remount_grace_ms: Annotated[
        int,
        typer.Option(help="A new leader takes puts once its predecessor's nodes re-mount, or after this (with "
                     "--etcd; refused without it)."),
    ] = limits.REMOUNT_GRACE_MS_DEFAULT,
    advertise_host: Annotated[
        Optional[str],
        typer.Option(help="Address the leader record tells clients and nodes to dial (default: --host; with --etcd; "
                     "refused without it)."),
    ] = None,
    dfs_dir: Annotated[
        Optional[Path], typer.Option(envvar="KVPOOL_DFS_DIR", parser=_path,
                                     help="The shared filesystem tier's directory (indexed from its files at start).")
    ] = None,
    dfs_size: Annotated[
        Optional[str],
        typer.Option(help=f"DFS tier capacity (default: the filesystem's size, at most 128 TiB; {SIZE_UNITS})."),
    ] = None,
    promote_reads: Annotated[
        int, typer.Option(help="Copy an object back into DRAM after this many reads from disk or DFS (0: never).")
    ] = limits.PROMOTE_READS_DEFAULT,
    eviction_policy: Annotated[
        EvictionPolicyName, typer.Option(help="DRAM eviction order: probation (never-read objects first) or lru.")
    ] = EvictionPolicyName(limits.EVICTION_POLICY_DEFAULT),
    busy_poll_us: BusyPollOption = limits.BUSY_POLL_US_DEFAULT,
    log_level: LogLevelOption = LogLevel.info,
    settings: ConfigOption = None,
) -> None:
    """Run the metadata master (no object bytes pass through it)."""
    import uvloop

    from kvpool.config import MasterConfig
    from kvpool.master.server import MasterServer

    _setup_logging(log_level)
    _remove_ready(ready_file)
    _require_directory("--dfs-size", dfs_size, "--dfs-dir", dfs_dir)
    _check_listen_host("--host", host)
    if http_host is not None:
        _check_listen_host("--http-host", http_host)
    # ElectionConfig's rule (whole seconds, as etcd grants a lease, and over twice the
    # step-down margin), checked with or without --etcd: ElectionConfig checks it only with it.
    from kvpool.master.election import is_lease_ttl_ms, lease_ttl_ms_min

    if not is_lease_ttl_ms(etcd_lease_ttl_ms):
        raise _fail(f"--etcd-lease-ttl-ms {etcd_lease_ttl_ms}: give whole seconds, {lease_ttl_ms_min()} or more")
    try:
        config = MasterConfig(
            lease_ttl_ms=lease_ttl_ms,
            node_ttl_ms=node_ttl_ms,
            put_discard_timeout_ms=put_discard_timeout_ms,
            put_release_timeout_ms=put_release_timeout_ms,
            evict_watermark_ratio_high=evict_watermark_high,
            evict_ratio=evict_ratio,
            remount_grace_ms=remount_grace_ms,
            promote_reads=promote_reads,
            eviction_policy=eviction_policy.value,
        )
        election = None
        # Settings of an election, which only --etcd holds: without it they were ignored.
        for flag, value, default in (
            ("--etcd-lease-ttl-ms", etcd_lease_ttl_ms, limits.ETCD_LEASE_TTL_MS_DEFAULT),
            ("--remount-grace-ms", remount_grace_ms, limits.REMOUNT_GRACE_MS_DEFAULT),
        ):
            if value != default and not etcd:
                raise _fail(f"{flag} needs --etcd: without an election there is no leader to wait for")
        # The cluster's name in etcd names nothing without it. KVPOOL_CLUSTER_ID, exported on a
        # host for its HA masters, is left to them; a flag or a settings file's line is refused.
        if not etcd and _source_name(ctx, "cluster_id") in ("COMMANDLINE", "DEFAULT_MAP"):
            raise _fail("--cluster-id needs --etcd: it names the cluster in etcd, and without --etcd there is none")
        if advertise_host is not None and not etcd:  # ignored, before
            raise _fail("--advertise-host needs --etcd: it is the address the leader record in etcd names")
        if etcd:
            from kvpool.master.election import ElectionConfig
            from kvpool.transports.etcd import parse_etcd_endpoints

            election = ElectionConfig(parse_etcd_endpoints(etcd), cluster_id, etcd_lease_ttl_ms)
        tokens = _tokens(token_file)
        server = MasterServer(
            config, host=host, port=port, http_port=http_port, http_host=http_host,
            token=tokens[0] if tokens else None, accepted_tokens=tokens[1:],
            debug_invariants=debug_invariants, election=election, advertise_host=advertise_host,
            dfs_dir=str(dfs_dir) if dfs_dir else None, dfs_bytes=_tier_size_of("--dfs-size", dfs_size),
            busy_poll_us=busy_poll_us,
        )  # fmt: skip
    except KVPoolError as exc:
        raise _fail_in_flags(exc, _MASTER_FLAGS) from None
    if node_ttl_ms < NODE_TTL_HEARTBEATS_MIN * limits.HEARTBEAT_INTERVAL_MS_DEFAULT:
        log.warning(
            "--node-ttl-ms %d is under %d heartbeats (%d ms): a node whose heartbeat comes a little late (a busy "
            "host, a pause) is dropped, with its objects, and mounts again", node_ttl_ms, NODE_TTL_HEARTBEATS_MIN,
            NODE_TTL_HEARTBEATS_MIN * limits.HEARTBEAT_INTERVAL_MS_DEFAULT,
        )  # fmt: skip

    async def main() -> None:
        stop = _stop_on_signal()
        _replace_tokens_on_sigusr1(token_file, server.replace_tokens, "master")
        await server.start()
        try:
            _freeze_start_up_objects()
            if ready_file:
                _write_ready(ready_file, {"endpoint": server.endpoint, "http_port": server.http_port})
            # Until a signal, or (a candidate on etcd) until it refuses to stand: another token.
            refusal = server.elector.refusal if server.elector is not None else None
            stopping = asyncio.ensure_future(stop.wait())
            await asyncio.wait({stopping, *([refusal] if refusal else [])}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if refusal is not None and refusal.done():
                raise refusal.result()
        finally:
            await server.stop()
            _remove_ready(ready_file, is_stopping=True)
            log.info("master %s stopped", server.endpoint)  # as a node says it: a stop, not a kill

    try:
        with _signal_handlers_kept():
            uvloop.run(main())
    except KVPoolError as exc:
        raise _fail_in_flags(exc, _MASTER_FLAGS) from None


@app.command(short_help="Run a storage node: a DRAM segment (and a disk tier) for the pool.")
def node(
    master: MasterOption = MASTER_DEFAULT,
    memory: Annotated[str, typer.Option(help=f"DRAM segment size, e.g. 64GiB ({SIZE_UNITS}).")] = "1GiB",
    host: Annotated[str, typer.Option(help="Address the transfer server listens on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Transfer port (0 = any free port).", min=0, max=PORT_MAX)] = 0,
    advertise_host: Annotated[
        Optional[str], typer.Option(help="Address clients dial (default: --host; for 0.0.0.0 or ::, this host's "
                                    "first address that is not loopback, else its name).")
    ] = None,
    shm_dir: Annotated[
        Path, typer.Option(parser=_path, help="Directory of the segment file: /dev/shm or a hugetlbfs mount.")
    ] = Path("/dev/shm"),
    shm: Annotated[
        bool, typer.Option(help="Let same-host clients map the segment; reach a same-host master by Unix socket.")
    ] = True,
    metrics_port: Annotated[
        Optional[int],
        typer.Option(help="Port of /metrics, /health and /ready (0 = any free port; default: none served).",
                     min=0, max=PORT_MAX),  # fmt: skip
    ] = None,
    metrics_host: Annotated[
        Optional[str],
        typer.Option(help="Address /metrics, /health and /ready listen on (default: --host). They only read, and "
                     "take no token: where only your monitoring reaches (needs --metrics-port)."),
    ] = None,
    disk_dir: Annotated[
        Optional[Path],
        typer.Option(parser=_path, help="Directory of the node's disk tier (NVMe): objects evicted from DRAM "
                     "move there, and survive a restart with the same directory."),
    ] = None,
    disk_size: Annotated[
        Optional[str],
        typer.Option(help=f"Disk tier capacity, e.g. 100GiB (needed for a new --disk-dir; {SIZE_UNITS})."),
    ] = None,
    disk_fsync: Annotated[
        bool, typer.Option(help="fsync every disk tier file before the master hears of it.")
    ] = True,
    dfs_dir: Annotated[
        Optional[Path], typer.Option(envvar="KVPOOL_DFS_DIR", parser=_path,
                                     help="This host's mount of the shared filesystem tier's directory.")
    ] = None,
    token_file: TokenFileOption = None,
    busy_poll_us: BusyPollOption = limits.BUSY_POLL_US_DEFAULT,
    ready_file: Annotated[
        Optional[Path], typer.Option(parser=_path, help="Write the node's endpoints as JSON here once mounted.")
    ] = None,
    drain_ms: Annotated[
        int,
        typer.Option(help="On SIGTERM, SIGINT or SIGHUP, drain first: no new objects here, reads served for this "
                     "long, then leave (0: leave at once).", min=0, max=limits.DRAIN_TIMEOUT_MS_MAX),
    ] = 0,
    node_id: Annotated[
        Optional[str],
        typer.Option(help="The node's name: its segment file's, and what a restart after --keep-ms finds its "
                     "segment by (letters, digits, '_', '.', '-'; default: a random one each start)."),
    ] = None,
    keep_ms: Annotated[
        int,
        typer.Option(help="On a stop, keep the DRAM segment and its objects this long for the node started again "
                     "with the same --node-id (an upgrade, a restart): it serves them again without any client "
                     "writing them anew (0: drop them).", min=0, max=limits.KEEP_MS_MAX),
    ] = 0,
    log_level: LogLevelOption = LogLevel.info,
    settings: ConfigOption = None,
) -> None:
    """Run a storage node: contributes a DRAM segment (and a disk tier) to the pool and serves its bytes."""
    import uvloop

    from kvpool.config import NodeConfig
    from kvpool.node.server import Node

    _setup_logging(log_level)
    _remove_ready(ready_file)
    _require_directory("--disk-size", disk_size, "--disk-dir", disk_dir)
    if keep_ms and node_id is None:
        raise _fail("--keep-ms needs --node-id: the node started again finds its kept segment by it")
    _check_dfs_mount(dfs_dir)
    _check_master(master, EXIT_FAILED)
    _check_listen_host("--host", host)
    if metrics_host is not None:
        if metrics_port is None:  # ignored, before
            raise _fail("--metrics-host needs --metrics-port: without it the node serves no /metrics")
        _check_listen_host("--metrics-host", metrics_host)
    try:
        tokens = _tokens(token_file)
        config = NodeConfig(
            master_endpoint=master,
            memory_bytes=_size_of("--memory", memory),
            listen_host=host,
            listen_port=port,
            advertise_host=advertise_host,
            shm_dir=str(shm_dir),
            shm_enabled=shm,
            token=tokens[0] if tokens else None,
            accepted_tokens=tuple(tokens[1:]),
            metrics_port=metrics_port,
            metrics_host=metrics_host,
            disk_dir=str(disk_dir) if disk_dir else "",
            disk_bytes=_tier_size_of("--disk-size", disk_size),
            disk_fsync=disk_fsync,
            dfs_dir=str(dfs_dir) if dfs_dir else "",
            busy_poll_us=busy_poll_us,
            keep_ms=keep_ms,
            **({"node_id": node_id} if node_id is not None else {}),
        )
    except KVPoolError as exc:
        raise _fail_in_flags(exc, _NODE_FLAGS) from None

    async def main() -> None:
        stop = _stop_on_signal()
        storage_node = Node(config)
        _replace_tokens_on_sigusr1(token_file, storage_node.replace_tokens, "node")
        await storage_node.start()
        _freeze_start_up_objects()
        try:
            # Until a master takes the segment, or a signal: then the node leaves as it would
            # once serving (segment file removed).
            if not await _wait_for_master(storage_node, stop):
                return
            if ready_file:
                _write_ready(
                    ready_file,
                    {
                        "endpoint": storage_node.endpoint,
                        "segment_id": storage_node.segment_info.segment_id,
                        "metrics_endpoint": storage_node.metrics_endpoint,
                        "disk_segment_id": storage_node.disk_info.segment_id if storage_node.disk_info else "",
                    },
                )
            # Refused by a master once mounted, it retries on, keeping its objects (node/server.py).
            await stop.wait()
            if drain_ms:  # decommissioning: readers of what it holds move on meanwhile
                await _drain(storage_node, drain_ms, stop)
        finally:
            await storage_node.stop()
            _remove_ready(ready_file, is_stopping=True)

    try:
        with _signal_handlers_kept():
            uvloop.run(main())
    except KVPoolError as exc:
        raise _fail_in_flags(exc, _NODE_FLAGS) from None


async def _wait_for_master(storage_node: Node, stop: asyncio.Event) -> bool:
    """Wait until a master takes the node's segment, however long: nodes and their master start
    in any order (systemd, Kubernetes), and the node's master link retries with backoff (its
    failures logged at most every 30 s). Says when it starts waiting.

    Returns:
        True once mounted; False when `stop` was set first (a signal).

    Raises:
        Unauthorized: the master refused the cluster token (a permanent error).
        InvalidParams: the address given as the master's is a kvpool node's (as permanent).
    """
    config = storage_node.config
    if storage_node.is_mounted:
        return True
    if storage_node.refusal is not None:  # the first attempt was refused for good: no wait follows
        raise storage_node.refusal
    log.info("node %s: waiting for a master at %s to take its segment", storage_node.node_id, config.master_endpoint)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        while True:  # a mount, a signal or a refusal ends it
            mounted = asyncio.ensure_future(storage_node.wait_mounted(MASTER_WAIT_INTERVAL_MS))
            await asyncio.wait((mounted, stopped), return_when=asyncio.FIRST_COMPLETED)
            if stopped.done():
                mounted.cancel()
                return False
            try:
                mounted.result()
            except RpcTimeout:  # still waiting: the link's own line (every 30 s) says why
                continue
            return True
    finally:
        stopped.cancel()


async def _drain(storage_node: Node, drain_ms: int, stop: asyncio.Event) -> None:
    """Drain for `drain_ms`, or until a second signal (an operator's second Ctrl-C, a
    supervisor's grace period ending in another SIGTERM): then leave at once."""
    log.info("node %s: draining for %d ms before it leaves (a second signal ends it now)", storage_node.node_id,
             drain_ms)  # fmt: skip
    stop.clear()
    draining = asyncio.ensure_future(storage_node.drain(drain_ms))
    again = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((draining, again), return_when=asyncio.FIRST_COMPLETED)
        if not draining.done():
            log.info("node %s: second signal: leaving now", storage_node.node_id)
    finally:
        draining.cancel()
        again.cancel()


def _stop_on_signal() -> asyncio.Event:
    """An event that SIGTERM, SIGINT or SIGHUP sets, from now on. Taken before a server starts,
    so that a signal while it starts (a node may wait seconds for its master) ends it through
    its graceful stop rather than the default handler's instant death. SIGHUP (the terminal or
    ssh session that started it closed) killed a node that way, and left its segment file in
    /dev/shm; it is left alone where it is ignored (`nohup kvpool node`)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = [signal.SIGTERM, signal.SIGINT]
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signals.append(signal.SIGHUP)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    return stop


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """Around a server's event loop: the signal handlers from before are back once it closed.
    uvloop (0.23) leaves its own (_stop_on_signal's) on SIGINT, SIGTERM and SIGHUP, and a
    process that had run a server in its main thread (a test, a program embedding one) took no
    Ctrl-C from then on. Restored after the loop closed, not when the server stopped, so that
    a second signal during the loop's teardown still finds the server's handler."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: one set outside Python, which nothing here changed
                signal.signal(sig, handler)


def _remove_ready(path: Optional[Path], is_stopping: bool = False) -> None:
    """Remove --ready-file, if there: at start, before the server is ready, so that a script
    that waits for it after a restart does not go ahead at once with the previous run's
    endpoint (with --port 0, a port nobody listens on); and at a stop, so that it is there
    only while the server serves. One that cannot be removed ends the start with one line
    (typer.Exit); at a stop it is let be."""
    if path is None:
        return
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        if not is_stopping:
            raise _fail(f"cannot remove --ready-file {path}: {exc.strerror or exc}") from None


def _check_dfs_mount(dfs_dir: Optional[Path]) -> None:
    """Refuse a node's --dfs-dir that is there but no directory (a file), or cannot be looked
    at, with one line: it started, and failed every DFS move the master sent with "not a tier
    of this node", never naming the path. One not there yet is taken, as a share mounted
    later is picked up (docs/tiers.md), with a warning naming it: a typo looks the same."""
    if dfs_dir is None:
        return
    try:
        dfs_dir.stat()
    except FileNotFoundError:
        log.warning("--dfs-dir %s does not exist: this node fails the master's DFS moves until it does (the shared "
                    "filesystem mounted there)", dfs_dir)  # fmt: skip
        return
    except OSError as exc:
        raise _fail(f"--dfs-dir {dfs_dir}: {exc.strerror or exc}") from None
    if not dfs_dir.is_dir():
        raise _fail(f"--dfs-dir {dfs_dir}: not a directory")


def _write_ready(path: Path, payload: dict) -> None:
    """Write --ready-file, or end the server with one line (typer.Exit) when it cannot be written."""
    temporary = path.with_suffix(".tmp")
    try:
        temporary.write_text(json.dumps(payload))
        temporary.rename(path)  # atomic: a reader never sees half a file
    except OSError as exc:
        raise _fail(f"cannot write --ready-file {path}: {exc.strerror or exc}") from None


# --- object commands --------------------------------------------------------------------------


@app.command(epilog=EXIT_STATUSES_HELP)
def put(
    key: Annotated[str, typer.Argument(help="Object key.")],
    source: Annotated[
        Optional[Path], typer.Argument(parser=_path, help="File to store ('-' or absent: standard input).")
    ] = None,
    replicas: Annotated[int, typer.Option(help="Replicas on distinct segments.")] = 1,
    master: MasterOption = MASTER_DEFAULT,
    token_file: TokenFileOption = None,
    timeout: TimeoutOption = TIMEOUT_DEFAULT,
) -> None:
    """Store a file (or stdin) as one object. A key that exists is left as it is."""
    from kvpool.protocol.messages import ReplicateConfig

    _check_key("put", key)
    _check_master(master, EXIT_USAGE)  # before standard input is read
    # The master's rule (master/service.py), said before anything is read or sent.
    if not 1 <= replicas <= limits.REPLICA_NUM_MAX:
        raise _fail(f"--replicas {replicas} not in 1..{limits.REPLICA_NUM_MAX}", EXIT_USAGE)
    shown = _shown(key)
    try:
        # One byte more than an object holds tells a value too large, without reading all of
        # it: `kvpool put k < /dev/zero` filled this process's memory, and a file over the
        # limit was sent whole to be refused with a bare INVALID_PARAMS.
        data = _read_at_most(source, limits.OBJECT_SIZE_BYTES_MAX + 1)
    except OSError as exc:
        raise _fail(f"put {shown}: cannot read {source or 'standard input'}: {exc.strerror or exc}") from None
    if not data:
        raise _fail(f"put {shown}: nothing to store (an object holds at least one byte)")
    if len(data) > limits.OBJECT_SIZE_BYTES_MAX:
        raise _fail(f"put {shown}: {source or 'standard input'} holds more than an object can "
                    f"({_human(limits.OBJECT_SIZE_BYTES_MAX)} at most)")  # fmt: skip
    with _connected("put", master, token_file, key=key, timeout_s=timeout) as store:
        # Objects are immutable: a put of an existing key succeeds without writing (the
        # Store's rule, for content-hashed keys), so the operator is told it was not stored.
        existing = store.query([key])
        if existing.codes[0] == ErrorCode.OK:
            err_console.print(
                f"{escape(shown)} exists already: left as it is ({existing.sizes[0]} bytes; objects "
                f"are immutable, so the {len(data)} bytes given were not stored)"
            )
            return
        try:
            store.put(key, data, ReplicateConfig(replica_num=replicas))
        except NoAvailableHandle as exc:
            raise _fail(f"{exc} ({_why_no_room(store, len(data))}; `kvpool stat` shows the segments)") from None
        placed = replicas
        if replicas > 1:
            # The master places replicas on distinct segments, as many as it can: fewer than
            # asked is still a success, and said below.
            try:
                placed = len(store.query([key]).replicas[0])
            except KVPoolError as exc:
                raise _fail(f"stored {shown} ({len(data)} bytes), but cannot count its replicas: {exc}") from None
    err_console.print(f"stored {escape(shown)} ({len(data)} bytes)")
    if placed < replicas:
        err_console.print(f"{escape(shown)}: {placed} of the {replicas} replicas asked placed (replicas need "
                          "distinct segments with room)")  # fmt: skip


def _read_at_most(source: Optional[Path], size_bytes: int) -> bytes:
    """The first `size_bytes` of a file, or of standard input for None or '-' (until its end
    or `size_bytes`, whichever comes first).

    Raises:
        OSError: it cannot be read.
    """
    if source is None or str(source) == "-":
        return sys.stdin.buffer.read(size_bytes)
    with source.open("rb") as file:
        return file.read(size_bytes)


@app.command()
def get(
    key: Annotated[str, typer.Argument(help="Object key.")],
    output: Annotated[
        Optional[Path], typer.Option("--output", "-o", parser=_path, help="File to write (default: stdout).")
    ] = None,
    dfs_dir: Annotated[
        Optional[Path],
        typer.Option(
            "--dfs-dir", envvar="KVPOOL_DFS_DIR", parser=_path,
            help="This host's mount of the shared-filesystem (DFS) tier: objects kept only there "
            "are read from it (no node serves DFS bytes).",
        ),
    ] = None,
    master: MasterOption = MASTER_DEFAULT,
    token_file: TokenFileOption = None,
    timeout: TimeoutOption = TIMEOUT_DEFAULT,
) -> None:
    """Fetch an object. Exit status 3 when there is none to read (a miss: not found, or no
    replica readable), 1 when the command failed (the master unreachable), 2 on a usage error."""
    from kvpool.protocol.messages import TIER_DFS
    from kvpool.transports.dfs import DfsDirectory

    _check_key("get", key)
    shown = _shown(key)
    with _connected("get", master, token_file, key=key, dfs_dir=dfs_dir, timeout_s=timeout) as store:
        data = store.get(key)
        if data is None:  # a miss: say which kind
            (replicas,) = store.query([key]).replicas
            segments = {s.segment.segment_id: s.segment for s in store.cluster_status().segments}
            dfs_only = [segments[r.segment_id] for r in replicas if r.segment_id in segments]
            if replicas and len(dfs_only) == len(replicas) and all(s.tier == TIER_DFS for s in dfs_only):
                if not dfs_dir:
                    raise _fail(f"{shown}: kept only on the DFS tier, which no node serves: give --dfs-dir",
                                code=EXIT_NOT_FOUND)  # fmt: skip
                if not DfsDirectory(str(dfs_dir)).has_token(dfs_only[0].shm_token):
                    # It blamed the nodes (walk-through helper-155): the directory is the wrong one.
                    raise _fail(f"{shown}: kept only on the DFS tier, which --dfs-dir {dfs_dir} does not hold (no "
                                f"kvpool-tier.json of this cluster's DFS there: give the directory the master's "
                                f"--dfs-dir names, as this host mounts it)", code=EXIT_NOT_FOUND)  # fmt: skip
            if replicas:
                raise _fail(f"{shown}: stored, but no replica could be read (its nodes: down, not answering, "
                            f"or bad bytes; `kvpool stat {shown}` shows where it lives)",
                            code=EXIT_NOT_FOUND)  # fmt: skip
    if data is None:
        raise _fail(f"{shown}: not found", code=EXIT_NOT_FOUND)
    if output is None:
        with _writing_stdout():
            sys.stdout.buffer.write(data)
    else:
        try:
            output.write_bytes(data)
        except OSError as exc:
            raise _fail(f"get {shown}: cannot write {output}: {exc.strerror or exc}") from None


def _why_no_room(store: Store, size: int) -> str:
    """Why no segment took `size` bytes, as far as the cluster's status tells: no segment
    takes puts (none mounted, or none active: unreachable, draining), or the active ones are
    full of objects in use, or smaller than the object."""
    try:
        segments = store.cluster_status().segments
    except KVPoolError:
        segments = None
    if segments is not None and not any(s.state == "active" for s in segments):
        states = ", ".join(sorted({s.state for s in segments})) or "none mounted"
        return f"no segment takes puts now (segments: {states})"
    if segments is not None and any(
        s.state == "active" and s.segment.capacity_bytes - s.used_bytes >= size for s in segments
    ):  # the nodes of a master that had just started were mounting meanwhile (walk-through helper-147)
        return "a segment has room for it now: try again (a master that just started takes its nodes back " \
               "over a second)"
    return (f"no segment had room for {size} bytes: the cache is full of objects in use, or the object is "
            "larger than every segment")


_LEFT_SHOWN_MAX = 1000  # how many of the objects a removal left `kvpool rm` counts


@app.command()
def rm(
    keys: Annotated[Optional[list[str]], typer.Argument(help="Keys to remove.")] = None,
    regex: Annotated[Optional[str], typer.Option(help="Remove every key matching this regex (RE2 syntax).")] = None,
    all_objects: Annotated[bool, typer.Option("--all", help="Remove every object.")] = False,
    force: Annotated[bool, typer.Option(help="Also remove objects under a read lease.")] = False,
    master: MasterOption = MASTER_DEFAULT,
    token_file: TokenFileOption = None,
    timeout: TimeoutOption = TIMEOUT_DEFAULT,
) -> None:
    """Remove objects by key, by regex, or all of them. Name one of the three. Exit status 3
    when some were not removed (not found, or under a read lease: --force removes those), 1
    when the command failed (the master unreachable), 2 on a usage error."""
    chosen = sum((bool(keys), regex is not None, all_objects))
    if chosen != 1:
        # Two of them once meant the first in an order nobody wrote down (`rm KEY --regex R`
        # removed what R matched and left KEY): a usage error now.
        raise _fail("name keys, --regex PATTERN or --all" + (", only one of them" if chosen else ""), EXIT_USAGE)
    if regex == "":  # an unset shell variable in `--regex "$PREFIX"`: every key would match
        raise _fail("--regex '': an empty pattern matches every key (--all says so)", EXIT_USAGE)
    if regex is not None:
        _check_pattern("--regex", regex)
    for key in keys or []:
        _check_key("rm", key)
    with _connected("rm", master, token_file, timeout_s=timeout) as store:
        if all_objects or regex is not None:
            bound = limits.BULK_REMOVE_TIMEOUT_MS  # millions of objects take the master seconds
            # A spinner on a terminal, as the call may take minutes and says nothing meanwhile.
            with err_console.status("removing ...") if err_console.is_terminal else contextlib.nullcontext():
                if all_objects:
                    count = store.remove_all(force, timeout_ms=bound)
                else:
                    count = store.remove_by_regex(regex or "", force, timeout_ms=bound)
            left = None if force else store.list_objects(regex or "", limit=_LEFT_SHOWN_MAX)
            if left is not None and left.keys:  # under read leases (or put since): said, as `rm KEY` says it
                err_console.print(f"removed {count} object(s); {len(left.keys)}{'+' if left.truncated else ''} "
                                  "matching still stored, under read leases or put since (--force removes "
                                  "leased ones)")  # fmt: skip
                raise typer.Exit(EXIT_NOT_FOUND)
        else:
            codes = store.batch_remove(keys or [], force)
            for key, code in zip(keys or [], codes):
                if code == ErrorCode.OBJECT_NOT_FOUND:  # remembered for a while all the same (master/tombstones.py)
                    err_console.print(f"{escape(_shown(key))}: not found (a copy on a node that is away goes when "
                                      "it comes back, within docs/tiers.md's limits)")  # fmt: skip
                elif code != ErrorCode.OK:
                    err_console.print(f"{escape(_shown(key))}: not removed ({ErrorCode(code).name})")
            count = sum(1 for c in codes if c == ErrorCode.OK)
            if count < len(codes):
                err_console.print(f"removed {count} of {len(codes)} object(s)")
                raise typer.Exit(EXIT_NOT_FOUND)
    err_console.print(f"removed {count} object(s)")


@app.command(epilog=EXIT_STATUSES_HELP)
def ls(
    pattern: Annotated[str, typer.Argument(help="Regex the keys must contain (RE2 syntax).")] = "",
    limit: Annotated[int, typer.Option(help="At most this many keys.", min=1, max=limits.LIST_OBJECTS_MAX)] = 1000,
    master: MasterOption = MASTER_DEFAULT,
    token_file: TokenFileOption = None,
    timeout: TimeoutOption = TIMEOUT_DEFAULT,
) -> None:
    """List objects (key and size). A key with control characters is printed as a literal."""
    _check_pattern("PATTERN", pattern)
    with _connected("ls", master, token_file, timeout_s=timeout) as store:
        reply = store.list_objects(pattern, limit)
        if not reply.keys and not store.cluster_status().segments:
            err_console.print(_NO_SEGMENT_YET)  # a script must not take it for an empty cache
    with _writing_stdout():
        # Plain writes: a rich console folds a long key onto a second line.
        for key, size in zip(reply.keys, reply.sizes):
            sys.stdout.write(f"{size:>12}  {_shown(key)}\n")
    if reply.truncated:
        err_console.print(f"(first {limit} shown)")


# A master that just started knows what its nodes hold only once they mounted again (within a
# few seconds): until then it lists nothing (walk-through helper-155).
_NO_SEGMENT_YET = ("(no segment is mounted: no node runs, or the master just started and its nodes are "
                   "mounting again, within seconds)")


@app.command(epilog=EXIT_STATUSES_HELP, short_help="Show the segments and their usage, or where objects live.")
def stat(
    keys: Annotated[Optional[list[str]], typer.Argument(help="Objects to describe (none: the cluster).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    master: MasterOption = MASTER_DEFAULT,
    token_file: TokenFileOption = None,
    timeout: TimeoutOption = TIMEOUT_DEFAULT,
) -> None:
    """Show the cluster's segments and usage, or where given objects live."""
    for key in keys or ():  # refused as get, put and rm refuse them (was a row, and exit status 0)
        _check_key("stat", key)
    with _connected("stat", master, token_file, timeout_s=timeout) as store:
        if keys:
            reply = store.query(keys)
        else:
            status = store.cluster_status()
            if not status.segments:
                err_console.print(_NO_SEGMENT_YET)
    out = _table_console()
    with _writing_stdout():
        if keys:
            rows = [
                {"key": k, "code": ErrorCode(c).name, "size": s, "replicas": [[r.segment_id, r.offset] for r in rs]}
                for k, c, s, rs in zip(keys, reply.codes, reply.sizes, reply.replicas)
            ]
            if as_json:
                print(json.dumps(rows))
                return
            table = Table("key", "status", "size", "replicas (segment@offset)")
            for row in rows:
                replicas = ", ".join(f"{s}@{o}" for s, o in row["replicas"])
                table.add_row(escape(_shown(row["key"])), row["code"], str(row["size"]), escape(replicas))
            out.print(table)
            return
        if as_json:
            print(json.dumps(status.to_dict()))
            return
        table = Table("segment", "tier", "node endpoint", "state", "used", "capacity", "objects", "filesystem free")
        for segment in status.segments:
            table.add_row(
                escape(segment.segment.segment_id),
                segment.segment.tier,
                escape(segment.segment.endpoint),
                segment.state,
                _human(segment.used_bytes),
                _human(segment.segment.capacity_bytes),
                str(segment.object_count),
                _filesystem_free(segment),
            )
        out.print(table)
        if status.tiers:
            tiers = Table("tier", "capacity", "used", "replicas", "hits", "offloads", "promotions", "copies",
                          "evictions", "failed moves")
            for tier in status.tiers:
                tiers.add_row(
                    tier.tier, _human(tier.capacity_bytes), _human(tier.used_bytes), str(tier.object_count),
                    str(tier.hits), str(tier.offloads), str(tier.promotions), str(tier.copies),
                    str(tier.evictions), str(tier.failed_moves),
                )  # fmt: skip
            out.print(tiers)
        out.print(f"objects: {status.object_count}  pending puts: {status.pending_count}")


def _filesystem_free(segment: SegmentStatus) -> str:
    """A slower tier's filesystem as its node last reported it."""
    if not segment.is_writable:
        return "read-only"
    return "-" if segment.filesystem_free_bytes < 0 else _human(segment.filesystem_free_bytes)


def _human(size_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size_bytes < 1024 or unit == "TiB":
            return f"{size_bytes:.0f} {unit}" if unit == "B" else f"{size_bytes:.1f} {unit}"
        size_bytes /= 1024
    raise AssertionError("unreachable")


@app.command(short_help="Start a local cluster, move objects across it, report, stop it.")
def demo(
    nodes: Annotated[int, typer.Option(help="Storage nodes to start.", min=1)] = 3,
    memory: Annotated[str, typer.Option(help=f"DRAM segment per node ({SIZE_UNITS}).")] = "128MiB",
    objects: Annotated[int, typer.Option(help="Objects to write and read back.", min=1)] = 64,
    object_size: Annotated[str, typer.Option(help=f"Size of each object ({SIZE_UNITS}).")] = "1MiB",
) -> None:
    """Start a master and nodes on loopback, move objects across them, report, stop everything."""
    from kvpool.cli.demo import run_demo

    try:
        run_demo(nodes, _size_of("--memory", memory), objects, _size_of("--object-size", object_size), console)
    except KVPoolError as exc:
        raise _fail(str(exc)) from None


@app.command(epilog=EXIT_STATUSES_HELP, short_help="Measure put and get throughput and latency of a running cluster.")
def bench(
    size: Annotated[str, typer.Option(help=f"Size of each object, e.g. 4KiB, 1MiB ({SIZE_UNITS}).")] = "1MiB",
    total: Annotated[
        str, typer.Option(help=f"Bytes a round puts and reads back (whole objects; {SIZE_UNITS}).")
    ] = "64MiB",
    batch: Annotated[
        int, typer.Option(help="Objects per put or get call (a batch goes whole to one segment per replica).")
    ] = 32,
    rounds: Annotated[int, typer.Option(help="Rounds of put then get; the figures are their medians.")] = 3,
    replicas: Annotated[int, typer.Option(help="Replicas of each object, on distinct segments.")] = 1,
    shm: Annotated[
        Optional[bool],
        typer.Option(help="Copy through shared memory where a node is on this host (--no-shm: TCP only; "
                     "default: KVPOOL_SHM, else on).", show_default=False),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    master: MasterOption = MASTER_DEFAULT,
    token_file: TokenFileOption = None,
    timeout: TimeoutOption = TIMEOUT_DEFAULT,
) -> None:
    """Measure put and get throughput and one-object get latency of a running cluster from
    this host (its own keys, removed at the end; refused if it would evict cached objects)."""
    from kvpool.cli.bench import Interrupted, interrupts_between_calls, plan_bench, print_figures, run_bench

    try:
        plan = plan_bench(_size_of("--size", size, EXIT_USAGE), _size_of("--total", total, EXIT_USAGE), batch, rounds,
                          replicas)  # fmt: skip
    except KVPoolError as exc:
        raise _fail(str(exc), EXIT_USAGE) from None
    if shm is None:
        shm = _shm_from_environment()
    connected = _connected("bench", master, token_file, shm_enabled=shm, timeout_s=timeout)
    with interrupts_between_calls() as check, connected as store:
        try:
            figures = run_bench(store, plan, err_console, check)
        except Interrupted as exc:
            # Its objects are removed on the way out (run_bench; one it could not remove is said).
            err_console.print(f"bench: interrupted by {signal.Signals(exc.signum).name}: no figures", markup=False)
            raise typer.Exit(128 + exc.signum) from None
    figures["master"] = master
    figures["shm_enabled"] = shm
    with _writing_stdout():
        if as_json:
            print(json.dumps(figures))
        else:
            print_figures(figures, _table_console())


# `kvpool replay` (trace replay, issue 6) lives in cli/replay.py; it imports kvpool.sim lazily.
from kvpool.cli.replay import replay as _replay  # noqa: E402

app.command(name="replay", short_help="Replay a trace: hit rates of local caches vs one pool.")(_replay)


if __name__ == "__main__":
    app()
