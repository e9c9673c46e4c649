"""The benchmarks the README and docs quote, run as their commands (quick volumes): a benchmark
that hangs or stops printing its JSON went unnoticed for a day once (bench_peers, since
105bc58). Numbers are not judged here: speed is the benchmarks' business, not the tests'."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from bench_core import MIB, socket_pair_gbps  # noqa: E402
from bench_peers import SIZES  # noqa: E402


def run_benchmark(tmp_path: Path, script: str, *args: str) -> dict:
    """The JSON `script` prints, its temporary files under tmp_path."""
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True, text=True, timeout=240, env={**os.environ, "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "total_bytes, chunk, footprint",
    [
        (8 * MIB, 4 * MIB, None),  # bench_peers' limit for objects of 4 MiB and more
        (8 * MIB, 4 * MIB, MIB),  # a chunk larger than the buffers
        (3 * MIB + 5, MIB, 2 * MIB),  # sizes that are no multiple of one another
        (4 * MIB, MIB, 4 * MIB),  # bench_core's pair over distinct memory
    ],
)
def test_the_socket_pair_moves_every_byte_and_ends(total_bytes, chunk, footprint):
    assert socket_pair_gbps(total_bytes, chunk, footprint) > 0


@pytest.mark.timeout(300)
def test_bench_core_measures_every_row_next_to_its_limit(tmp_path):
    result = run_benchmark(tmp_path, "bench_core.py", "--quick", "--repeats", "1")
    tcp_fields = ("put_gbps", "get_gbps", "socket_pair_gbps", "socket_pair_same_bytes_gbps")
    for row in ("tcp_1MiB", "tcp_4MiB"):
        assert min(result[row][f] for f in tcp_fields) > 0
    for row in ("shm_1MiB", "shm_4MiB"):
        assert min(result[row][f] for f in ("put_gbps", "get_gbps", "numpy_copy_gbps")) > 0
    for threads in (1, 4):
        row = result[f"small_4KiB_batch128_shm_{threads}_threads"]
        assert row["put_objects_per_s"] > 0 and row["get_objects_per_s"] > 0
    assert result["small_4KiB_batch128_shm_1_thread_full_cache"]["evictions"] > 0  # the cache was full
    assert 0 < result["single_get_4KiB"]["sync_store_us_p50"] <= result["single_get_4KiB"]["sync_store_us_p99"]


@pytest.mark.timeout(300)
def test_bench_peers_measures_kvpool_everywhere_and_says_why_a_peer_is_skipped(tmp_path):
    result = run_benchmark(tmp_path, "bench_peers.py", "--quick", "--rounds", "1")
    for size in SIZES:
        assert min(result["machine_limits"][str(size)].values()) > 0
    for mode in ("tcp", "same_host", "in_process"):
        for size in SIZES:
            row = result["runs"][mode]["kvpool"][str(size)]
            assert min(row[f"{api}_{op}_gbps"] for api in ("zero_copy", "plain") for op in ("put", "get")) > 0
        for peer in ("mooncake", "redis"):
            skipped = result["skipped"].get(peer) or result["skipped"].get(f"{peer} {mode}")
            assert (peer in result["runs"][mode]) != bool(skipped)  # measured, or skipped with the reason
    assert result["targets"]  # each target said met or not
