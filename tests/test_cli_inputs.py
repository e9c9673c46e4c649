"""What the commands read from their caller: the value of `kvpool put`, KVPOOL_SHM, and options
and keys out of range (object commands and servers).

How: typer's CliRunner runs the real command in-process, with no cluster (each case ends before
one is needed, or the Store the command would open is recorded instead), and the largest object
lowered to 4 KiB so that "larger than an object" costs no GiB. Asserted: a put whose file or
standard input holds more than an object can is refused with one line naming the limit, having
read at most one byte past it (an endless input, `kvpool put k < /dev/zero`, was read until the
memory ran out); KVPOOL_SHM turns shared memory off with the spellings engines' shm_enabled
takes (off, False), not only 0, false and no; an option out of its range (--replicas, a server's
durations, over a week too, a node TTL under the heartbeat, a tier size of 0, a byte count that is not
a whole number, an address that is not one, a --master that is none: exit status 2 for an
object command), a node's --dfs-dir that
is a file, or a key over
limits.KEY_SIZE_BYTES_MAX is refused with one line naming it and its range, before a Store
opens or a server starts (both replaced by stubs that raise); so is a duration of the config
records that no flag sets, over a week; an empty path option is a usage error, and nothing is
made in the working directory. Bounded: well under a second.
"""

from __future__ import annotations

import io
import logging
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import kvpool.client.sync as sync
from kvpool import limits
from kvpool.cli.main import app, put
from kvpool.config import ClientConfig, MasterConfig, NodeConfig
from kvpool.errors import InvalidParams

OBJECT_SIZE_BYTES_MAX = 4096
WEEK_MS = str(7 * 24 * 3_600_000)  # the longest duration a server takes


class EndlessZeros(io.RawIOBase):
    """Standard input that never ends (up to a bound that keeps a broken test finite)."""

    def __init__(self, size_bytes_max: int) -> None:
        self.read_bytes = 0
        self._size_bytes_max = size_bytes_max

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        count = min(len(buffer), self._size_bytes_max - self.read_bytes)
        buffer[:count] = bytes(count)
        self.read_bytes += count
        return count


@pytest.fixture
def small_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "OBJECT_SIZE_BYTES_MAX", OBJECT_SIZE_BYTES_MAX)


def test_a_put_of_an_endless_input_reads_one_byte_past_an_object(
    small_objects, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The command itself, called as typer would: CliRunner takes standard input as bytes only.
    endless = EndlessZeros(64 * limits.MIB)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(endless)))
    with pytest.raises(typer.Exit) as exited:
        put("k", None, replicas=1, master="127.0.0.1:1", token_file=None)
    assert exited.value.exit_code == 1
    assert capsys.readouterr().err == "error: put k: standard input holds more than an object can (4.0 KiB at most)\n"
    assert endless.read_bytes <= OBJECT_SIZE_BYTES_MAX + 1 + io.DEFAULT_BUFFER_SIZE, endless.read_bytes


def test_a_put_of_a_file_larger_than_an_object_says_so(small_objects, tmp_path: Path) -> None:
    large = tmp_path / "large"
    large.write_bytes(bytes(OBJECT_SIZE_BYTES_MAX + 1))
    result = CliRunner().invoke(app, ["put", "k", str(large)])
    assert result.exit_code == 1, result.output
    assert result.output == f"error: put k: {large} holds more than an object can (4.0 KiB at most)\n"


@pytest.mark.parametrize(
    ("value", "is_shm_enabled"),
    [("0", False), ("off", False), ("False", False), ("NO", False), ("1", True), ("on", True), ("", True)],
)
def test_kvpool_shm_takes_the_spellings_of_a_flag(monkeypatch: pytest.MonkeyPatch, value, is_shm_enabled) -> None:
    opened: list[bool] = []

    class Refused(Exception):
        pass

    def record(self, master: str, **options) -> None:
        opened.append(options["shm_enabled"])
        raise Refused  # no cluster: the command ends here

    monkeypatch.setattr(sync.Store, "__init__", record)
    monkeypatch.setenv("KVPOOL_SHM", value)
    result = CliRunner().invoke(app, ["ls"])
    assert isinstance(result.exception, Refused), result.output
    assert opened == [is_shm_enabled]


@pytest.mark.parametrize("value", ["maybe", "flase", "2"])
def test_kvpool_shm_that_is_no_flag_is_a_usage_error(monkeypatch: pytest.MonkeyPatch, value) -> None:
    """It was read as on: a typo of "false" left shared memory on."""
    monkeypatch.setenv("KVPOOL_SHM", value)
    result = CliRunner().invoke(app, ["ls"])
    assert result.exit_code == 2, result.output
    assert result.output == f"error: KVPOOL_SHM must be on or off (1/0, true/false, yes/no), not {value!r}\n"


class Opened(Exception):
    """Raised where a command would open a Store or start a server: the test ends there."""


@pytest.fixture
def nothing_opens(monkeypatch: pytest.MonkeyPatch) -> None:
    """No Store connects, no master or node starts: each raises Opened instead (before a fix,
    a command ran on to there; without this it would wait for a master, or serve forever)."""

    def opened(*args, **kwargs) -> None:
        raise Opened

    import kvpool.master.server
    import kvpool.node.server

    monkeypatch.setattr(sync.Store, "__init__", opened)
    monkeypatch.setattr(kvpool.master.server, "MasterServer", opened)
    monkeypatch.setattr(kvpool.node.server, "Node", opened)


@pytest.mark.parametrize(
    ("args", "line"),
    [
        # Keys over limits.KEY_SIZE_BYTES_MAX: a bare INVALID_KEY (put), "not found" (get, rm).
        (["put", "a" * 4097, "-"], f"put {'a' * 40}...: key too long: 4097 bytes of UTF-8, at most 4096"),
        (["get", "a" * 4097], f"get {'a' * 40}...: key too long: 4097 bytes of UTF-8, at most 4096"),
        (["rm", "k", "é" * 2049], f"rm {'é' * 40}...: key too long: 4098 bytes of UTF-8, at most 4096"),
        (["put", "", "-"], "put: empty key (a key holds 1 to 4096 bytes of UTF-8)"),
        # `kvpool stat` answered such keys with a row, and exit status 0.
        (["stat", ""], "stat: empty key (a key holds 1 to 4096 bytes of UTF-8)"),
        (["stat", "k", "a" * 4097], f"stat {'a' * 40}...: key too long: 4097 bytes of UTF-8, at most 4096"),
        # Over a week: it started, then every get's reply failed to encode (its lease TTL).
        (["master", "--lease-ttl-ms", str(10**20)], f"--lease-ttl-ms {10**20}: at most 604800000 ms (a week)"),
        (["master", "--node-ttl-ms", "604800001"], "--node-ttl-ms 604800001: at most 604800000 ms (a week)"),
        (["master", "--put-release-timeout-ms", "604800001"],
         "--put-release-timeout-ms 604800001: at most 604800000 ms (a week)"),
        # Under the nodes' heartbeat (seconds meant): every node was dropped between two of
        # them and mounted again at the next, forever, and every put failed.
        (["master", "--node-ttl-ms", "10"], "--node-ttl-ms 10: at least 1000 ms, the nodes' heartbeat interval (a "
         "shorter TTL drops every node between two heartbeats; the default is 10000)"),
        # It named a field no flag sets: "need --promote-reads >= 0 and promotion_window_ms > 0".
        (["master", "--promote-reads", "-1"], "--promote-reads -1: give 0 (never) or more"),
        # A size of 0 was taken as none given: "... holds no disk tier yet: give its size
        # (--disk-size)"; the DFS tier took the filesystem's size.
        (["node", "--disk-dir", "/kvpool-test-never-made", "--disk-size", "0"], "--disk-size 0: must be positive"),
        (["master", "--dfs-dir", "/kvpool-test-never-made", "--dfs-size", "0KiB"], "--dfs-size 0KiB: must be positive"),
        # Taken, and the master started (a negative grace: puts at once; the etcd lease unused).
        (["master", "--remount-grace-ms", "-5"], "--remount-grace-ms -5: give 0 or more"),
        (["master", "--etcd-lease-ttl-ms", "-5000"], "--etcd-lease-ttl-ms -5000: give whole seconds, 3000 or more"),
        # Whole seconds, but no longer than twice the leader's step-down margin (1 s): it said
        # "step-down margin 1000 ms must be under half the lease TTL", a setting with no flag.
        (["master", "--etcd-lease-ttl-ms", "2000"], "--etcd-lease-ttl-ms 2000: give whole seconds, 3000 or more"),
        # The address is said to be invalid before the token rule for non-loopback hosts
        # ("refusing to listen on 256.1.1.1 without a cluster token").
        (["master", "--host", "256.1.1.1"], "--host 256.1.1.1: not a valid address (an IPv4 address is 4 numbers "
         "in 0..255, such as 10.0.0.5)"),
        (["master", "--http-host", "1.2.3"], "--http-host 1.2.3: not a valid address (an IPv4 address is 4 numbers "
         "in 0..255, such as 10.0.0.5)"),
        (["node", "--host", "256.1.1.1"], "--host 256.1.1.1: not a valid address (an IPv4 address is 4 numbers in "
         "0..255, such as 10.0.0.5)"),
        # Sizes: "5iB" was read as 5 bytes; a size out of range is said in units too.
        (["node", "--memory", "5iB"], "--memory: not a size: '5iB' (try 1GiB, 512MiB or a byte count)"),
        (["node", "--memory", "1.5KiB"], "--memory 1536 out of [1048576, 140737488355328] bytes (1 MiB to 128 TiB)"),
        (["node", "--memory", "-1GB"], "--memory: not a size: '-1GB' (try 1GiB, 512MiB or a byte count)"),
        # A fraction of a byte count was cut off without a word: "1.3" was 1 byte.
        (["node", "--memory", "1.3"], "--memory: 1.3 is not a whole number of bytes (between 1 and 2)"),
    ],
)  # fmt: skip
def test_a_bad_option_or_key_is_named_before_anything_opens(nothing_opens, args: list[str], line: str) -> None:
    result = CliRunner().invoke(app, args, input=b"v")
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert (result.exit_code, result.output) == (1, f"error: {line}\n")


MASTER_ADDRESS_FORMS = "(HOST:PORT, or etcd://HOST:PORT[,...][/CLUSTER_ID])"


@pytest.mark.parametrize(
    ("args", "line"),
    [
        # The master's answer, once connected: "put k: replica_num 0 not in 1..8" (exit status 1).
        (["put", "k", "-", "--replicas", "0"], "--replicas 0 not in 1..8"),
        (["put", "k", "-", "--replicas", "9"], "--replicas 9 not in 1..8"),
        # "cannot reach the master at 10.0.0.5: not a master address", exit status 1: as if the
        # network had failed. ":abc:" was printed as an emoji (rich's emoji codes).
        (["ls", "--master", "127.0.0.1:abc"],
         f"--master: not a master address: '127.0.0.1:abc' {MASTER_ADDRESS_FORMS}"),
        (["get", "k", "-m", "10.0.0.5"], f"--master: not a master address: '10.0.0.5' {MASTER_ADDRESS_FORMS}"),
        (["put", "k", "-", "-m", "master-host:99999"],
         f"--master: not a master address: 'master-host:99999' {MASTER_ADDRESS_FORMS}"),
        (["stat", "-m", "etcd://"], "--master: no etcd endpoint in ''"),
        (["bench", "--size", "4096.5B"], "--size: 4096.5B is not a whole number of bytes (between 4096 and 4097)"),
        # The master's refusal, exit status 1, as if the cluster had failed (walk-through helper-147).
        (["ls", "(a"], "PATTERN: bad pattern '(a' (RE2 syntax): missing ): (a"),
        (["rm", "--regex", "a)"], "--regex: bad pattern 'a)' (RE2 syntax): unexpected ): a)"),
    ],
)  # fmt: skip
def test_an_object_command_out_of_range_is_a_usage_error_naming_the_option(
    nothing_opens, args: list[str], line: str
) -> None:
    # docs/operations.md, "Exit statuses": 2 for a value out of an option's range.
    result = CliRunner().invoke(app, args, input=b"v")
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert (result.exit_code, result.output) == (2, f"error: {line}\n")


def test_a_node_names_a_master_address_that_is_none(nothing_opens) -> None:
    result = CliRunner().invoke(app, ["node", "--master", "master-host", "--memory", "4MiB"])
    assert (result.exit_code, result.output) == (1, f"error: --master: not a master address: 'master-host' "
                                                    f"{MASTER_ADDRESS_FORMS}\n")  # fmt: skip


@pytest.mark.parametrize(
    ("record", "field"),
    [
        (MasterConfig, "soft_pin_ttl_ms"),
        (MasterConfig, "promotion_window_ms"),
        (NodeConfig, "heartbeat_interval_ms"),
        (NodeConfig, "rpc_timeout_ms"),
        (ClientConfig, "transfer_timeout_ms"),
    ],
)
def test_a_duration_over_a_week_is_refused_by_its_config(record, field: str) -> None:
    required = {"master_endpoint": "127.0.0.1:1", "memory_bytes": 16 << 20} if record is NodeConfig else {}
    record(**required, **{field: limits.SETTING_DURATION_MS_MAX})  # a week: taken
    with pytest.raises(InvalidParams, match=f"^{field} 604800001: at most 604800000 ms"):
        record(**required, **{field: limits.SETTING_DURATION_MS_MAX + 1})


@pytest.mark.parametrize(
    "args",
    [
        ["put", "a" * 4096, "-"],  # the longest key
        ["get", "é" * 2048],
        ["master", "--remount-grace-ms", "0", "--etcd-lease-ttl-ms", "3000", "--etcd", "127.0.0.1:2379"],
        ["master", "--lease-ttl-ms", WEEK_MS, "--node-ttl-ms", WEEK_MS, "--put-release-timeout-ms", WEEK_MS],
        ["master", "--node-ttl-ms", "1000", "--promote-reads", "0"],  # one heartbeat; never promote
        ["stat", "k", "a" * 4096],
        ["master", "--host", "10.0.0.5", "--http-host", "::1"],  # an address not held here is the bind's to refuse
        ["node", "--host", "localhost"],
    ],
)
def test_values_in_range_are_let_through(nothing_opens, args: list[str]) -> None:
    result = CliRunner().invoke(app, args, input=b"v")
    assert isinstance(result.exception, Opened), result.output


def test_a_valid_non_loopback_host_still_needs_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPOOL_TOKEN", raising=False)
    monkeypatch.delenv("KVPOOL_TOKEN_FILE", raising=False)
    result = CliRunner().invoke(app, ["master", "--host", "10.0.0.5", "--port", "0", "--http-port", "0"])
    assert result.exit_code == 1, result.output
    assert result.output == (
        "error: refusing to listen on 10.0.0.5 without a cluster token: set KVPOOL_TOKEN or --token-file, or bind "
        "127.0.0.1\n"
    )


@pytest.mark.parametrize(
    ("args", "serving"),
    [
        (["master", "--port", "0", "--http-port", "0", "--http-host", "0.0.0.0"], " for /metrics, /health and /status"),
        (["master", "--port", "0", "--http-port", "0", "--http-host", "::"], " for /metrics, /health and /status"),
        (["node", "--memory", "4MiB", "--metrics-port", "0", "--metrics-host", "0.0.0.0"], " for /metrics"),
    ],
)
def test_without_a_token_the_http_ports_stay_on_loopback_too(
    monkeypatch: pytest.MonkeyPatch, args: list[str], serving: str
) -> None:
    # They served every interface: /status names every node's endpoint and host (helper-52).
    monkeypatch.delenv("KVPOOL_TOKEN", raising=False)
    monkeypatch.delenv("KVPOOL_TOKEN_FILE", raising=False)
    result = CliRunner().invoke(app, [*args, "--master", "127.0.0.1:1"] if args[0] == "node" else args)
    assert result.exit_code == 1, result.output
    host = args[-1]
    assert result.output == (
        f"error: refusing to listen on {host}{serving} without a cluster token: set KVPOOL_TOKEN or --token-file, "
        "or bind 127.0.0.1\n"
    )


@pytest.mark.parametrize("limit", ["0", str(limits.LIST_OBJECTS_MAX + 1)])
def test_ls_limit_out_of_range_is_a_usage_error_naming_it(limit: str) -> None:
    # It went to the master, whose answer named its own field ("list limit 0 not in 1..N").
    result = CliRunner().invoke(app, ["ls", "--limit", limit, "--master", "127.0.0.1:1"])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--limit'" in result.output, result.output


def test_version_names_the_release_and_the_wire_version() -> None:
    """Peers of another wire version refuse each other: an operator checks it across machines."""
    import kvpool

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"kvpool {kvpool.__version__} (wire version {limits.FRAME_VERSION})"


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["node", "--disk-dir", "", "--disk-size", "64MiB"], "--disk-dir"),
        (["node", "--dfs-dir", ""], "--dfs-dir"),
        (["node", "--shm-dir", ""], "--shm-dir"),
        (["node", "--ready-file", ""], "--ready-file"),
        (["master", "--dfs-dir", ""], "--dfs-dir"),
        (["master", "--token-file", ""], "--token-file"),
        (["master", "--config", ""], "--config"),
        (["get", "k", "--output", ""], "--output"),
    ],
)
def test_an_empty_path_is_a_usage_error_not_the_working_directory(
    nothing_opens, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], option: str
) -> None:
    # Click reads "" as "."; `--disk-dir ""` made a disk tier in the working directory.
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}'" in result.output and "an empty path" in result.output, result.output
    assert list(tmp_path.iterdir()) == []


def test_a_node_dfs_dir_that_is_a_file_is_refused_and_one_not_there_yet_is_named(
    nothing_opens, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A regular file started a node that failed every DFS move the master sent ("not a tier
    of this node", never naming the path); the master's `--dfs-dir FILE` was refused. A path
    not there yet is taken (a share mounted later is picked up), with a warning naming it."""
    a_file = tmp_path / "dfs"
    a_file.write_text("")
    result = CliRunner().invoke(app, ["node", "--memory", "16MiB", "--dfs-dir", str(a_file)])
    assert (result.exit_code, result.output) == (1, f"error: --dfs-dir {a_file}: not a directory\n")
    not_mounted = tmp_path / "mnt" / "kvpool"
    with caplog.at_level(logging.WARNING, logger="kvpool.cli.main"):
        result = CliRunner().invoke(app, ["node", "--memory", "16MiB", "--dfs-dir", str(not_mounted)])
    assert isinstance(result.exception, Opened), result.output
    assert f"--dfs-dir {not_mounted} does not exist" in caplog.text, caplog.text
