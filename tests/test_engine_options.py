"""The settings the engine adapters read from vLLM's, SGLang's and LMCache's extra config, and
the lookup breaker they build from them (on a fake clock; the adapters' own tests freeze a real
master)."""

import logging

import pytest

from kvpool import limits
from kvpool.config import parse_size
from kvpool.errors import InvalidKey, InvalidParams, RpcTimeout
from kvpool.integrations import breaker
from kvpool.integrations.engine_options import EngineOptions


def test_values_as_json_and_yaml_give_them_are_read(tmp_path, monkeypatch):
    monkeypatch.delenv("KVPOOL_TOKEN", raising=False)
    monkeypatch.delenv("KVPOOL_TOKEN_FILE", raising=False)
    token_file = tmp_path / "token"
    token_file.write_text("secret\n")
    extra = {
        "master": "10.0.0.1:50051",
        "token_file": str(token_file),
        "embedded_memory": "64MiB",
        "shm_enabled": "false",
        "replica_num": "2",
        "lookup_hold_ms": 0,
        "lookup_timeout_ms": "150",
        "lookup_backoff_ms_min": 200,
        "lookup_backoff_ms_max": "800",
    }
    options = EngineOptions.read(extra, "kv_connector_extra_config")
    assert options == EngineOptions(
        master="10.0.0.1:50051",
        token="secret",
        embedded_memory_bytes=64 << 20,
        shm_enabled=False,
        replicate=options.replicate,
        lookup_hold_ms=0,
        lookup_timeout_ms=150,
        lookup_backoff_ms_min=200,
        lookup_backoff_ms_max=800,
    )
    assert options.replicate.replica_num == 2
    # A token file mid-rotation: the connector connects with the first line, and keeps the
    # others for when a server refuses it (docs/operations.md "Rotating the token").
    token_file.write_text("the-new-one-0123456789\nsecret\n")
    rotating = EngineOptions.read(extra, "kv_connector_extra_config")
    assert (rotating.token, rotating.other_tokens) == ("the-new-one-0123456789", ("secret",))


def test_defaults_and_the_master_from_the_environment(monkeypatch):
    monkeypatch.setenv("KVPOOL_MASTER", "10.0.0.2:50051")
    monkeypatch.delenv("KVPOOL_TOKEN", raising=False)
    monkeypatch.delenv("KVPOOL_TOKEN_FILE", raising=False)
    options = EngineOptions.read(None, "extra")
    assert (options.master, options.token, options.embedded_memory_bytes, options.shm_enabled) == (
        "10.0.0.2:50051", None, 0, True,
    )  # fmt: skip
    assert (options.replicate.replica_num, options.lookup_hold_ms) == (1, limits.LOOKUP_HOLD_MS_DEFAULT)
    assert (options.lookup_timeout_ms, options.lookup_backoff_ms_min, options.lookup_backoff_ms_max) == (
        breaker.LOOKUP_TIMEOUT_MS_DEFAULT, breaker.LOOKUP_BACKOFF_MS_MIN_DEFAULT, breaker.LOOKUP_BACKOFF_MS_MAX_DEFAULT,
    )  # fmt: skip
    # A minimum above the default maximum takes the maximum with it.
    longer = EngineOptions.read({"lookup_backoff_ms_min": 60_000}, "extra")
    assert (longer.lookup_backoff_ms_min, longer.lookup_backoff_ms_max) == (60_000, 60_000)


def test_a_prefix_names_every_key(monkeypatch):
    monkeypatch.delenv("KVPOOL_MASTER", raising=False)
    extra = {"kvpool.master": "10.0.0.3:50051", "kvpool.replica_num": 3, "replica_num": 5}
    assert EngineOptions.read(extra, "extra_config", prefix="kvpool.").replicate.replica_num == 3
    with pytest.raises(InvalidParams, match=r"set 'kvpool.master' in extra_config \(or \$KVPOOL_MASTER\)"):
        EngineOptions.read({"master": "10.0.0.3:50051"}, "extra_config", prefix="kvpool.")


@pytest.mark.parametrize(
    "key, value",
    [
        ("replica_num", 0),
        ("replica_num", limits.REPLICA_NUM_MAX + 1),
        ("replica_num", "two"),
        ("replica_num", True),  # JSON true is no count
        ("replica_num", 1.5),
        ("replica_num", "--2"),
        ("replica_num", "²"),
        ("lookup_hold_ms", -1),
        ("lookup_hold_ms", "5s"),
        ("lookup_hold_ms", limits.LOOKUP_HOLD_MS_MAX + 1),
        ("lookup_timeout_ms", 0),
        ("lookup_timeout_ms", "300ms"),
        ("lookup_timeout_ms", breaker.LOOKUP_TIMEOUT_MS_MAX + 1),
        ("lookup_backoff_ms_min", 0),
        ("lookup_backoff_ms_max", breaker.LOOKUP_BACKOFF_MS_MIN_DEFAULT - 1),  # under the minimum
        ("lookup_backoff_ms_max", breaker.LOOKUP_BACKOFF_MS_MAX + 1),
    ],
)
def test_a_bad_value_is_refused_with_its_key(key, value):
    with pytest.raises(InvalidParams, match=f"^{key} in kv_connector_extra_config must be a whole number in"):
        EngineOptions.read({"master": "127.0.0.1:1", key: value}, "kv_connector_extra_config")


def test_a_flag_that_is_no_flag_is_refused_with_its_key():
    options = EngineOptions.read({"kvpool.master": "127.0.0.1:1", "kvpool.shm_enabled": "Off"}, "extra", "kvpool.")
    assert options.shm_enabled is False
    with pytest.raises(InvalidParams, match=r"^kvpool.shm_enabled in extra must be on or off .*not 'flase'"):
        EngineOptions.read({"kvpool.master": "127.0.0.1:1", "kvpool.shm_enabled": "flase"}, "extra", "kvpool.")


def test_a_bad_size_or_token_file_is_refused(tmp_path):
    with pytest.raises(InvalidParams, match=r"^kvpool.embedded_memory in LMCache's extra_config: not a size: 'lots'"):
        extra = {"kvpool.master": "127.0.0.1:1", "kvpool.embedded_memory": "lots"}
        EngineOptions.read(extra, "LMCache's extra_config", "kvpool.")
    with pytest.raises(InvalidParams, match="cannot read token file"):
        EngineOptions.read({"master": "127.0.0.1:1", "token_file": str(tmp_path / "absent")}, "extra")


def test_a_key_no_one_reads_is_named_once_and_the_keys_of_the_adapter_and_engine_are_not(caplog):
    """A misspelt key took its default without a word; every worker of an engine reads the same
    config, so the warning is said once per process."""
    extra = {"kvpool.master": "127.0.0.1:1", "kvpool.replicas": 2, "kvpool.tag": "a", "engine_key": 1, "other": 0}
    with caplog.at_level(logging.WARNING, logger="kvpool.integrations.engine_options"):
        for _ in range(2):
            EngineOptions.read(extra, "the extra", "kvpool.", adapter_keys=("tag",), engine_keys=("kvpool.engine_key",))
    warned = [r.getMessage() for r in caplog.records if "does not read" in r.getMessage()]
    assert len(warned) == 1 and "'kvpool.replicas'" in warned[0] and "kvpool.replica_num" in warned[0], warned
    assert "tag" not in warned[0].split("does not read")[0] and "other" not in warned[0], warned


def test_sizes_are_read_exactly_at_any_length():
    """Through a float, a size of 400 digits raised OverflowError (a traceback from `kvpool node
    --memory`, not the range error that names the flag)."""
    assert parse_size("1.5KiB") == 1536
    assert parse_size("0.1GiB") == limits.GIB // 10
    assert parse_size("9" * 400) == int("9" * 400)


def test_an_adapter_takes_the_token_file_the_deployment_exported(tmp_path, monkeypatch):
    """The README's deployment exports KVPOOL_TOKEN_FILE on every machine "before any kvpool
    command or serving process": the engine adapters read it as the commands do (they used to
    read only KVPOOL_TOKEN, and vLLM and SGLang failed with Unauthorized, LMCache ran without
    its remote backend)."""
    from kvpool.cli.launcher import LocalCluster

    exported, other = tmp_path / "exported", tmp_path / "other"
    exported.write_text("the-cluster's\n")
    other.write_text("another\n")
    monkeypatch.setenv("KVPOOL_TOKEN_FILE", str(exported))
    monkeypatch.setenv("KVPOOL_TOKEN", "loses to the file, as on the command line")
    with LocalCluster(1, "16MiB", token="the-cluster's") as cluster:
        options = EngineOptions.read({"master": cluster.master_endpoint}, "kv_connector_extra_config")
        assert options.token == "the-cluster's"
        with options.open_store() as store:
            store.put("exported", b"z" * 100)
            assert store.get("exported") == b"z" * 100
    given = EngineOptions.read({"master": "127.0.0.1:1", "token_file": str(other)}, "extra")
    assert given.token == "another"  # the adapter's own setting wins
    monkeypatch.delenv("KVPOOL_TOKEN_FILE")
    assert EngineOptions.read({"master": "127.0.0.1:1"}, "extra").token == "loses to the file, as on the command line"


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_the_lookup_breaker_opens_probes_at_doubling_intervals_and_closes():
    clock = FakeClock()
    lookups = breaker.LookupBreaker("test lookups", 1_000, 3_000, clock)
    assert lookups.can_call() and not lookups.is_open()
    assert lookups.record_failure(InvalidKey("the master answered")) is False  # the caller's to log
    assert lookups.can_call() and not lookups.is_open()
    assert lookups.record_failure(RpcTimeout("no answer")) is True
    assert lookups.is_open() and not lookups.can_call()
    lookups.record_failure(RpcTimeout("a lookup begun before it opened"))  # no probe: the window stands
    for window_s in (1, 2, 3, 3):  # each probe that fails doubles it, up to the maximum
        clock.now_s += window_s - 0.001
        assert not lookups.can_call()
        clock.now_s += 0.001
        assert lookups.can_call()  # this one probes...
        assert not lookups.can_call()  # ...the others miss meanwhile
        lookups.record_failure(RpcTimeout("still no answer"))
    clock.now_s += 3
    assert lookups.can_call()
    lookups.record_success()
    assert not lookups.is_open() and lookups.can_call() and lookups.can_call()
    lookups.record_failure(RpcTimeout("again"))
    clock.now_s += 1
    assert lookups.can_call()  # back to the minimum


def test_a_probe_that_never_reports_delays_the_next_one_by_a_window():
    clock = FakeClock()
    lookups = breaker.LookupBreaker("test lookups", 1_000, 30_000, clock)
    lookups.record_failure(RpcTimeout("no answer"))
    clock.now_s += 1
    assert lookups.can_call()  # a probe, which then raises something else: no report
    clock.now_s += 0.999
    assert not lookups.can_call()
    clock.now_s += 0.001
    assert lookups.can_call()
