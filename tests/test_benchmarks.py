"""The benchmarks the README and docs quote, run as their commands (quick volumes): a benchmark
that hangs or stops printing its JSON went unnoticed for a day once (bench_peers, since
105bc58). Numbers are not judged here: speed is the benchmarks' business, not the tests'."""

import ctypes
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from bench_core import MIB, ZeroCopyRun, small_objects, socket_pair_gbps  # noqa: E402
from bench_peers import SIZES  # noqa: E402


def run_benchmark(tmp_path: Path, script: str, *args: str, returncode: int = 0) -> dict:
    """The JSON `script` prints, its temporary files under tmp_path."""
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True, text=True, timeout=240, env={**os.environ, "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == returncode, done.stderr[-3000:]
    return json.loads(done.stdout)


class ForgetfulStore:
    """The part of Store that bench_core's runs use, in memory; with `is_forgetful` set its
    gets report success but copy nothing and find only the first key of a batch."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.is_forgetful = False

    def register_buffer(self, array: np.ndarray) -> int:
        return array.ctypes.data

    def remove_by_regex(self, pattern: str, force: bool = False) -> None:
        self.objects.clear()

    def cluster_status(self) -> SimpleNamespace:  # what the removes left: nothing, at once
        return SimpleNamespace(segments=[SimpleNamespace(used_bytes=0)])

    def batch_put_from(self, keys, addresses, sizes) -> list[int]:
        self.objects.update((k, ctypes.string_at(a, s)) for k, a, s in zip(keys, addresses, sizes))
        return [0] * len(keys)

    def batch_get_into(self, keys, addresses, sizes) -> list[int]:
        for key, address, size in zip(keys, addresses, sizes):
            if not self.is_forgetful:
                ctypes.memmove(address, self.objects[key], size)
        return list(sizes)

    def put_batch(self, keys, values) -> list[int]:
        self.objects.update(zip(keys, values))
        return [0] * len(keys)

    def get_batch(self, keys) -> list:
        found = [self.objects[keys[0]]] + [None] * (len(keys) - 1)
        return found if self.is_forgetful else [self.objects[k] for k in keys]


def test_bench_core_checks_the_bytes_of_every_measured_get():
    store = ForgetfulStore()
    run = ZeroCopyRun(store, "t", 4096, 8)
    run.put_gbps(4)  # the warm-up fills the target
    run.get_gbps(4)
    store.is_forgetful = True
    run.put_gbps(4)
    with pytest.raises(AssertionError):
        run.get_gbps(4)
    with pytest.raises(AssertionError):
        small_objects(store, 1, 1)


def test_the_numpy_limit_copies_as_many_distinct_bytes_as_the_run(monkeypatch):
    from bench_core import numpy_copy_gbps

    copied = []
    real_copyto = np.copyto
    monkeypatch.setattr(np, "copyto", lambda to, of: (copied.append(of.ctypes.data), real_copyto(to, of)))
    numpy_copy_gbps(4096, 128 * 4096)
    assert len(set(copied)) == 128  # no source object copied twice


@pytest.mark.timeout(120)
def test_bench_disk_takes_every_ratio_per_round_then_the_median(tmp_path):
    result = run_benchmark(tmp_path, "bench_disk.py", "--total", "8MiB", "--repeats", "3", "--dir", str(tmp_path))
    rounds = result["rounds"]
    pairs = {
        "ratio_tier_write_local_vs_plain_write": ("tier_write_local_gbps", "plain_write_odirect_gbps"),
        "ratio_tier_read_local_vs_plain_read": ("tier_read_local_gbps", "plain_read_odirect_gbps"),
        "ratio_tier_read_remote_vs_plain_read": ("tier_read_remote_gbps", "plain_read_odirect_gbps"),
    }
    for ratio, (numerator, denominator) in pairs.items():
        per_round = [a / b for a, b in zip(rounds[numerator], rounds[denominator])]
        assert rounds[ratio] == pytest.approx(per_round, rel=0.01)  # rounds are rounded to 3 digits
        assert result[ratio] == pytest.approx(statistics.median(rounds[ratio]), abs=1e-3)


@pytest.mark.timeout(120)
def test_mixed_load_fails_when_a_load_generator_fails(tmp_path):
    # --size-min above --size-max: every load generator stops at its argument check.
    result = run_benchmark(
        tmp_path, "mixed_load.py", "--clients", "2", "--nodes", "1", "--memory", "16MiB",
        "--duration-s", "1", "--size-min", "70000", "--size-max", "65536", returncode=1,
    )  # fmt: skip
    assert sorted(result["failed_workers"]) == ["0", "1"]


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


@pytest.mark.timeout(120)
def test_put_then_get_counts_every_pair_each_writer_read_back(tmp_path):
    result = run_benchmark(
        tmp_path, "put_then_get.py", "--threads", "2", "--memory", "16MiB", "--mib-per-thread", "4",
    )  # fmt: skip
    assert result["threads"] == 2 and result["policy"] == "probation"
    assert result["pairs"] >= 2 * 4 * 1024 // 64  # 4 MiB a writer, objects of 64 KiB at most
    assert 0 <= result["misses"] <= result["pairs"]
