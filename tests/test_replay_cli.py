"""`kvpool replay`: the command line, its table and the files it writes.

How: typer's CliRunner runs the real command in-process on a 300-request prefix of the shipped
trace (simulation mode, two capacities, two instances, both sharing modes), then the test reads
replay.json, replay.md and replay.png back. Capacity parsing is tested on its own, and bad
input (a misspelt name, a watermark no master takes, an option out of its range) must end with
exit code 1 and a message, not a traceback; an option out of range with one line naming it and
its range, before anything runs or is written. Bounded: a few seconds.
"""

from __future__ import annotations

import io
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
    # Shown only when a put found no room: here a request of 264 blocks in the local caches
    # of 195 leaves 69 not stored.
    assert ("not stored" in result.output) == any(r["blocks_not_stored"] for r in results)
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
        # Misspelt with one instance, where nothing is shared or routed: once accepted unread.
        ["--routing", "cache-awre"],
        ["--sharing", "locl"],
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
    assert "not stored" not in result.output  # every put found room
    without, with_disk = json.loads((out / "replay.json").read_text())["results"]
    assert (without["disk_capacity_blocks"], with_disk["disk_capacity_blocks"]) == (0, 1953)
    assert without["offloads"] == without["block_hits_disk"] == 0
    assert with_disk["block_hit_rate"] >= without["block_hit_rate"]


@pytest.mark.skipif(not TRACE.is_file(), reason=f"no trace at {TRACE}")
@pytest.mark.parametrize(
    "extra",
    [
        # Belady named with local caches and cache-aware routing; the pooled rows could run.
        ["--instances", "2", "--routing", "cache-aware", "--policy", "lru,belady"],
        ["--mode", "live", "--policy", "lru,belady"],  # a master process runs no belady
        ["--mode", "live", "--capacity", "100K,40M"],  # 78,125 blocks: over the live replay's 256 MiB
    ],
)
def test_a_configuration_that_cannot_run_fails_before_any_runs(tmp_path: Path, extra: list[str]) -> None:
    args = ["replay", str(TRACE), "--limit", "5", "--capacity", "100K", "--out", str(tmp_path / "out"), *extra]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    assert result.output.startswith("error: "), result.output
    assert "configurations" not in result.output  # the run's header: nothing was replayed
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not TRACE.is_file(), reason=f"no trace at {TRACE}")
@pytest.mark.parametrize("mode", ["sim", "live"])
@pytest.mark.parametrize("watermark", ["0.03", "1.5", "nan"])
def test_a_watermark_no_master_takes_is_named_before_any_runs(tmp_path: Path, mode: str, watermark: str) -> None:
    # It was found by the first configuration's master (the run's header printed, --out made),
    # and worded in the master's fields (sim) or as a master that did not start (live).
    out = tmp_path / "out"
    args = ["replay", str(TRACE), "--limit", "5", "--capacity", "100K", "--policy", "lru", "--mode", mode,
            "--watermark-high", watermark, "--out", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    assert result.output.startswith(f"error: --watermark-high {float(watermark)}: "), result.output
    assert result.output.count("\n") == 1, result.output
    assert not out.exists()


@pytest.mark.skipif(not TRACE.is_file(), reason=f"no trace at {TRACE}")
def test_the_default_policies_leave_out_belady_where_it_cannot_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["replay", str(TRACE), "--limit", "100", "--instances", "2", "--routing", "cache-aware",
            "--capacity", "50K", "--out", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "left out" in result.output and "belady" in result.output
    runs = {(r["sharing"], r["policy"]) for r in json.loads((out / "replay.json").read_text())["results"]}
    assert runs == {("local", "lru"), ("local", "probation"), ("pooled", "lru"), ("pooled", "probation"),
                    ("pooled", "belady")}  # fmt: skip


@pytest.mark.skipif(not TRACE.is_file(), reason=f"no trace at {TRACE}")
def test_an_out_that_cannot_take_the_files_fails_before_the_replay(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("mine\n")
    for out in (a_file, a_file / "below"):
        result = CliRunner().invoke(app, ["replay", str(TRACE), "--limit", "50", "--policy", "lru", "--out", str(out)])
        assert result.exit_code == 1, result.output
        assert result.output.startswith("error: ") and result.output.count("\n") == 1, result.output
        assert "not a directory" in result.output and "hit rates" not in result.output
    assert a_file.read_text() == "mine\n"


@pytest.mark.skipif(not TRACE.is_file(), reason=f"no trace at {TRACE}")
@pytest.mark.parametrize("option", ["--capacity", "--disk-capacity"])
def test_an_empty_capacity_list_is_an_error_and_writes_nothing(tmp_path: Path, option: str) -> None:
    (tmp_path / "replay.json").write_text("{}\n")  # an earlier run's
    result = CliRunner().invoke(app, ["replay", str(TRACE), "--limit", "5", "--out", str(tmp_path), option, ","])
    assert result.exit_code == 1, result.output
    assert result.output.startswith("error: no ") and "capacity" in result.output
    assert (tmp_path / "replay.json").read_text() == "{}\n"


def test_blocks_not_stored_are_counted_apart_and_shown(tmp_path: Path) -> None:
    # Room for two blocks; the second request's put of block 2 finds only block 0, which that
    # request's read still leases: NO_AVAILABLE_HANDLE. Block 2 is stored by request 4.
    trace = tmp_path / "lease.jsonl"
    lines = [(0, [0]), (10, [0, 1, 2]), (20, [0]), (30, [1, 2])]
    trace.write_text("".join(
        json.dumps({"timestamp": t, "input_length": 512 * len(ids), "output_length": 1, "hash_ids": ids}) + "\n"
        for t, ids in lines
    ))  # fmt: skip
    out = tmp_path / "out"
    args = ["replay", str(trace), "--capacity", "1024", "--policy", "lru", "--bytes-per-token", "1KiB",
            "--out", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (record,) = json.loads((out / "replay.json").read_text())["results"]
    assert record["blocks_not_stored"] == 1
    assert record["stored_bytes"] == 3 * 512 * 1024  # blocks 0, 1 and 2 once each
    assert "not stored" in result.output
    markdown = (out / "replay.md").read_text()
    header, _, row = markdown.splitlines()[4:7]
    cells = dict(zip(header.split(" | "), row.split(" | ")))
    assert cells["not stored"] == "1" and cells["stored (remote)"] == "1.6 MB (0 B)"


@pytest.mark.skipif(not TRACE.is_file(), reason=f"no trace at {TRACE}")
@pytest.mark.parametrize(
    ("extra", "line"),
    [
        # Found by the simulated master's mount once the run's header was printed, in its terms:
        # "segment capacity 7999999999992000413696 not in 1048576..140737488355328".
        (["--capacity", "999999999999G"], "--capacity 999999999999G: 999999999999000000000 tokens, more than an "
         "instance holds (at most 17592186044416 tokens per instance)"),
        (["--capacity", "17592186044417"], "--capacity 17592186044417: 17592186044417 tokens, more than an instance "
         "holds (at most 17592186044416 tokens per instance)"),
        (["--disk-capacity", "999999999999G"], "--disk-capacity 999999999999G: 999999999999000000000 tokens, more "
         "than an instance holds (at most 17592186044416 tokens per instance)"),
        # -1 was taken, and checked the invariants after every call (calls % -1 == 0).
        (["--check-every", "-1"], "--check-every -1: give 0 (only at the end) or more"),
        # A negative speedup silently meant "as fast as possible" (0 says so).
        (["--mode", "live", "--speedup", "-1"], "--speedup -1.0: give 0 (as fast as possible) or more trace ms per "
         "wall ms"),
        (["--speedup", "nan"], "--speedup nan: give 0 (as fast as possible) or more trace ms per wall ms"),
        # Was said in ReplayConfig's field: "instance_count 0 <= 0".
        (["--instances", "0"], "--instances 0: give 1 or more"),
    ],
)  # fmt: skip
def test_an_option_out_of_range_is_named_before_anything_runs(tmp_path: Path, extra: list[str], line: str) -> None:
    out = tmp_path / "out"
    args = ["replay", str(TRACE), "--limit", "50", "--policy", "lru", "--out", str(out), *extra]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    assert result.output == f"error: {line}\n"  # one line: no header, no traceback
    assert not out.exists()


def test_a_capacity_is_parsed_exactly() -> None:
    # Through a float, 999999999999G was 999,999,999,999,000,051,712 tokens.
    assert parse_capacity_tokens("999999999999G", 1) == 999_999_999_999 * 10**9
    assert parse_capacity_tokens("9" * 400, 1) == 10**400 - 1  # an OverflowError through a float


@pytest.mark.skipif(not TRACE.is_file(), reason=f"no trace at {TRACE}")
def test_a_replay_whose_stdout_fails_still_writes_its_results(tmp_path: Path) -> None:
    """`kvpool replay ... | head` (the reader leaves) or a full disk under stdout: the first
    failed print (the progress, the table) ended the run with exit 1, and a whole sweep's
    results were never written. They are written now; the exit status is 1, with one line
    for a full disk and none for a reader that left."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "kvpool.cli.main", "replay", str(TRACE), "--limit", "300", "--capacity", "500K"]
    with open("/dev/full", "w") as full:  # noqa: PTH123
        done = subprocess.run([*command, "--out", str(tmp_path / "full")], stdout=full, stderr=subprocess.PIPE,
                              timeout=120, check=False)  # fmt: skip
    said = done.stderr.decode().strip().splitlines()
    assert done.returncode == 1 and said == ["error: cannot write to standard output: No space left on device"], said
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    reader = subprocess.Popen([*command, "--out", str(tmp_path / "pipe")], **pipes)
    assert reader.stdout.readline().startswith(b"kvpool replay (sim)")
    reader.stdout.close()  # the reader leaves after the first line
    assert reader.wait(120) == 1 and reader.stderr.read() == b""
    reader.stderr.close()
    for out in ("full", "pipe"):
        assert json.loads((tmp_path / out / "replay.json").read_text())["results"], out
        assert (tmp_path / out / "replay.md").is_file() and (tmp_path / out / "replay.png").is_file()


def test_a_trace_named_by_the_environment_must_be_there(monkeypatch, tmp_path: Path) -> None:
    """KVPOOL_TRACE naming no file fell back to the shipped trace without a word (the demo's
    replay then named another trace than the one asked for)."""
    from kvpool.cli.replay import TRACE_ENV, find_trace

    monkeypatch.setenv(TRACE_ENV, str(tmp_path / "typo.jsonl"))
    with pytest.raises(InvalidParams, match="no such file"):
        find_trace()
    # The demo says so before it starts a process (it ran whole, then failed on it).
    from rich.console import Console

    from kvpool.cli.demo import run_demo

    with pytest.raises(InvalidParams, match="no such file"):
        run_demo(3, 32 << 20, 16, 1024, Console(file=io.StringIO()))
    (tmp_path / "typo.jsonl").write_text("")
    assert find_trace() == tmp_path / "typo.jsonl"
