"""`kvpool replay`: the command line, its table and the files it writes.

How: typer's CliRunner runs the real command in-process on a 300-request prefix of the shipped
trace (simulation mode, two capacities, two instances, both sharing modes), then the test reads
replay.json, replay.md and replay.png back. Capacity parsing is tested on its own, and bad
input must end with exit code 1 and a message, not a traceback. Bounded: a few seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvpool.cli.main import app
from kvpool.cli.replay import parse_capacity_tokens
from kvpool.errors import InvalidParams

TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "synthetic_trace.jsonl"


def test_capacities_are_tokens_bytes_or_unbounded() -> None:
    assert parse_capacity_tokens("1M", 1) == 1_000_000
    assert parse_capacity_tokens("2.5K tokens", 1) == 2_500
    assert parse_capacity_tokens("4096", 1) == 4_096
    assert parse_capacity_tokens("unbounded", 1) is None
    assert parse_capacity_tokens("64GiB", 320 * 1024) == 64 * 2**30 // (320 * 1024)
    for bad in ("lots", "1X", "-1M"):
        with pytest.raises(InvalidParams):
            parse_capacity_tokens(bad, 1)


@pytest.mark.skipif(not TRACE.is_file(), reason=f"no trace at {TRACE}")
def test_replay_writes_a_table_json_and_a_plot(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = [
        "replay", str(TRACE), "--limit", "300", "--instances", "2", "--capacity", "100K,1M",
        "--policy", "lru,probation", "--out", str(out), "--check-every", "500",
    ]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "hit rates (sim)" in result.output and "2 x pooled, round-robin, probation" in result.output
    record = json.loads((out / "replay.json").read_text())
    assert record["requests"] == 300 and record["mode"] == "sim"
    results = record["results"]
    assert len(results) == 2 * 2 * 2  # sharing x policy x capacity
    assert {(r["sharing"], r["policy"], r["capacity_blocks"]) for r in results} == {
        (s, p, c) for s in ("local", "pooled") for p in ("lru", "probation") for c in (195, 1953)
    }
    for r in results:
        assert 0 <= r["block_hit_rate"] <= 1 and r["requests"] == 300
        assert r["pool_capacity_tokens"] == 2 * r["capacity_tokens"]
    assert (out / "replay.md").read_text().count("\n| 2 x ") == 8
    assert (out / "replay.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not TRACE.is_file(), reason=f"no trace at {TRACE}")
@pytest.mark.parametrize(
    "extra",
    [
        ["--capacity", "lots"],
        ["--capacity", "100"],  # less than one block
        ["--policy", "fifo"],
        ["--mode", "live", "--policy", "belady"],
        ["--mode", "warp"],
        ["--disk-capacity", "unbounded"],  # a disk has a size
        ["--disk-capacity", "100"],  # less than one block
    ],
)
def test_bad_arguments_exit_with_a_message(tmp_path: Path, extra: list[str]) -> None:
    result = CliRunner().invoke(app, ["replay", str(TRACE), "--limit", "5", "--out", str(tmp_path), *extra])
    assert result.exit_code == 1, result.output
    assert "error" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.skipif(not TRACE.is_file(), reason=f"no trace at {TRACE}")
def test_a_disk_tier_per_instance_is_a_configuration_of_its_own(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["replay", str(TRACE), "--limit", "200", "--capacity", "200K", "--disk-capacity", "0,1M",
            "--policy", "lru", "--out", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "hit on disk" in result.output
    assert "| 1 instance, lru, + disk 1M | sim | 200K | 1M |" in (out / "replay.md").read_text()
    without, with_disk = json.loads((out / "replay.json").read_text())["results"]
    assert (without["disk_capacity_blocks"], with_disk["disk_capacity_blocks"]) == (0, 1953)
    assert without["offloads"] == without["block_hits_disk"] == 0
    assert with_disk["block_hit_rate"] >= without["block_hit_rate"]
