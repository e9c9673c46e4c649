"""`kvpool bench` against real clusters: what it measures, and that it leaves the cache as it
found it (its keys removed however it ends, a run that would evict refused, bad flags refused
before it connects)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from conftest import wait_until

from kvpool import ReplicateConfig, Store

BENCH_PREFIX = "kvpool-bench/"


def kvpool_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpool.cli.main", *args], capture_output=True, timeout=120)


def kvpool_cli_each(*commands: tuple[str, ...]) -> list[subprocess.CompletedProcess]:
    """kvpool_cli of each command, in their order, two at a time: for commands that do not
    depend on one another. Each is half a second of one core's Python start-up, and the test
    runner waits meanwhile: a CI machine's second core did nothing."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda args: kvpool_cli(*args), commands))


def bench_keys(store: Store) -> list[str]:
    return [key for key in store.list_objects("^kvpool-bench/", 100_000).keys]


def test_bench_measures_the_cluster_and_leaves_its_objects_as_they_were(make_cluster):
    cluster = make_cluster(2, "64MiB")
    master = ("--master", cluster.master_endpoint)
    cached = {f"cache/{i}": os.urandom(100_000) for i in range(4)}
    with Store(cluster.master_endpoint) as store:
        assert store.put_batch(list(cached), list(cached.values())) == [0] * 4
        runs = {
            "shm": ("--total", "8MiB", "--size", "1MiB", "--rounds", "2"),
            "tcp": ("--total", "1MiB", "--size", "64KiB", "--batch", "5", "--no-shm"),
            "two replicas": ("--total", "4MiB", "--size", "512KiB", "--replicas", "2", "--rounds", "1"),
        }
        for name, flags in runs.items():
            run = kvpool_cli("bench", *flags, "--json", *master)
            assert run.returncode == 0, (name, run.stderr.decode()[-2000:])
            figures = json.loads(run.stdout)
            size, count = figures["object_size_bytes"], figures["objects"]
            assert count * size == {"shm": 8, "tcp": 1, "two replicas": 4}[name] << 20
            assert figures["shm_enabled"] == (name != "tcp")
            rounds = {"shm": 2, "tcp": 3, "two replicas": 1}[name]  # --rounds, or its default (3)
            assert figures["rounds"] == len(figures["seconds_per_round"]) == rounds
            for phase in ("put", "get"):
                assert 0 < figures[phase]["gbps_min"] <= figures[phase]["gbps"] <= figures[phase]["gbps_max"]
                assert figures[phase]["objects_per_s"] > 0
            assert 0 < figures["single_get_us"]["p50"] <= figures["single_get_us"]["p99"]
            held = figures["replicas_by_segment"]
            assert sum(held.values()) == count * figures["replica_num"], held
            if name == "two replicas":  # on distinct segments: both nodes hold every object
                assert sorted(held.values()) == [count, count], held
            assert bench_keys(store) == [], name
        assert store.get_batch(list(cached)) == list(cached.values())
        table = kvpool_cli("bench", "--total", "2MiB", "--rounds", "1", *master)
        out = table.stdout.decode()
        assert table.returncode == 0 and "put" in out and "get" in out and "one-object get: p50" in out, out
        assert b"Traceback" not in table.stderr


def test_bench_refuses_a_run_that_would_evict_cached_objects(make_cluster):
    cluster = make_cluster(1, "32MiB")
    with Store(cluster.master_endpoint) as store:
        store.put("cache/kept", b"k" * 1000)
        refused = kvpool_cli("bench", "--total", "32MiB", "--master", cluster.master_endpoint)
        message = b" ".join(refused.stderr.split())
        assert refused.returncode == 1 and b"would evict cached objects" in message, message
        assert bench_keys(store) == [] and store.get("cache/kept") == b"k" * 1000
        # Two replicas need two segments.
        twice = kvpool_cli("bench", "--total", "1MiB", "--replicas", "2", "--master", cluster.master_endpoint)
        assert twice.returncode == 1 and b"--replicas 2: the cluster has 1 DRAM segment" in twice.stderr
        # Small objects take their allocation's footprint (64 bytes at least), not their size:
        # 160 KiB of 1-byte objects is 10 MiB of a segment that has 8.8 MiB below the watermark.
        store.put_batch([f"cache/{i}" for i in range(20)], [b"c" * (1 << 20)] * 20)
        tiny = kvpool_cli("bench", "--size", "1", "--total", "160KiB", "--master", cluster.master_endpoint)
        assert tiny.returncode == 1 and b"would evict cached objects" in b" ".join(tiny.stderr.split())
        assert store.cluster_status().evicted_count == 0 and bench_keys(store) == []


def test_a_refused_bench_says_that_one_segment_bounds_a_batch_and_what_fits(make_cluster):
    """Two empty 32 MiB nodes have 28.8 MiB each below the watermark, 57.6 MiB in all: --total
    32MiB in the default batches of 32 objects of 1 MiB was refused "(57.6 MiB free there in
    all)", as if 32 did not fit 57.6. A batch goes whole to one segment: the refusal says so,
    with the roomiest segment's room and the largest --batch that fits; where each batch fits
    but not all of them, how much of --total they take. The largest --batch said then runs."""
    cluster = make_cluster(2, "32MiB")
    master = ("--master", cluster.master_endpoint)
    whole_batch, all_batches = kvpool_cli_each(("bench", "--total", "32MiB", *master),
                                               ("bench", "--total", "56MiB", "--batch", "8", *master))  # fmt: skip
    room = b"each batch goes whole to one segment, and the roomiest has 28.8 MiB there (57.6 MiB in all, on 2 DRAM"
    said = b" ".join(whole_batch.stderr.split())
    assert whole_batch.returncode == 1 and room in said and b"would evict cached objects" in said, said
    assert b"a batch of 32 objects of --size 1 MiB (32 MiB)" in said and b"give --batch 28 or less" in said, said
    said = b" ".join(all_batches.stderr.split())
    assert all_batches.returncode == 1 and room in said, said
    assert b"batches of 8 fit 48 MiB of --total" in said and b"give a smaller --total" in said, said
    fits = kvpool_cli("bench", "--total", "32MiB", "--batch", "28", "--rounds", "1", *master)
    assert fits.returncode == 0, fits.stderr.decode()[-2000:]


def test_bench_keeps_each_segment_below_the_watermark(make_cluster):
    """The master evicts segment by segment: room on one segment cannot stand in for another's.
    Node A is 84% full of cached objects, node B empty; 24 MiB of bench objects fit the two
    nodes' room in all, and used to be placed at random, A's share evicting cached objects."""
    cluster = make_cluster(2, "32MiB")
    with Store(cluster.master_endpoint) as store:
        full = store.cluster_status().segments[0].segment.segment_id
        cached = [f"cache/{i}" for i in range(27)]
        config = ReplicateConfig(placement="preferred", preferred_segments=[full])
        assert store.put_batch(cached, [b"c" * 1_000_000] * 27, config) == [0] * 27
        run = kvpool_cli("bench", "--total", "24MiB", "--size", "256KiB", "--rounds", "4", "--json",
                         "--master", cluster.master_endpoint)  # fmt: skip
        assert run.returncode == 0, run.stderr.decode()[-2000:]
        assert full not in json.loads(run.stdout)["replicas_by_segment"]
        status = store.cluster_status()
        assert status.evicted_count == 0 and status.object_count == 27
        assert all(value is not None for value in store.get_batch(cached))


def test_bench_flags_that_cannot_work_are_usage_errors_before_it_connects():
    nowhere = ("--master", "127.0.0.1:1")  # never dialled: the flags are checked first
    refusals = (
        (("--size", "0"), b"--size 0 bytes"),
        (("--size", "2GiB"), b"1 byte to 1 GiB"),
        (("--size", "1MiB", "--total", "1KiB"), b"less than one object"),
        (("--batch", "0"), b"--batch 0"),
        (("--rounds", "0"), b"--rounds 0"),
        (("--replicas", "9"), b"--replicas 9"),
        (("--size", "lots"), b"not a size"),
        (("--total", "1TiB"), b"of memory"),
    )
    *runs, unreachable = kvpool_cli_each(*(("bench", *flags, *nowhere) for flags, _ in refusals),
                                         ("bench", "--total", "1MiB", *nowhere))  # fmt: skip
    for (flags, said), run in zip(refusals, runs):
        assert run.returncode == 2 and said in b" ".join(run.stderr.split()), (flags, run.stderr)
        assert b"Traceback" not in run.stderr
    assert unreachable.returncode == 1 and b"cannot reach the master" in unreachable.stderr


def test_an_interrupted_bench_removes_what_it_wrote(make_cluster):
    """SIGINT (Ctrl-C) or SIGTERM in the middle of a run (over TCP, where most of its time is
    inside puts and gets): the keys it wrote are removed before it exits, and no put of it is
    left in flight, so nothing of it stays in the cache."""
    cluster = make_cluster(1, "64MiB")
    with Store(cluster.master_endpoint) as store:
        for sig in (signal.SIGINT, signal.SIGTERM):
            bench = subprocess.Popen(
                [sys.executable, "-m", "kvpool.cli.main", "bench", "--total", "16MiB", "--size", "256KiB",
                 "--batch", "8", "--rounds", "100000", "--no-shm", "--master", cluster.master_endpoint],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            )  # fmt: skip
            try:
                wait_until(lambda: bench_keys(store), timeout_s=30)
                bench.send_signal(sig)
                _, err = bench.communicate(timeout=30)
            finally:
                if bench.poll() is None:
                    bench.kill()
                    bench.wait()
            assert bench.returncode == 128 + sig, (sig, bench.returncode, err[-2000:])
            assert b"Traceback" not in err, err[-2000:]
            assert f"bench: interrupted by {sig.name}: no figures".encode() in err, err[-2000:]  # it said nothing
            assert bench_keys(store) == [], sig
            # Nor a put in flight: the run stops between two calls, never inside one (a put
            # cut in its middle stayed pending, then its ranges quarantined for minutes).
            status = store.cluster_status()
            assert status.pending_count == 0, sig
            wait_until(lambda: store.cluster_status().segments[0].used_bytes == 0)  # drops acknowledged


def test_a_bench_whose_master_stops_answering_says_the_error_and_what_it_left(make_cluster):
    """The master frozen mid-run (the bench waits 1 s for each answer: --timeout): the run's own
    error is said first, then that its objects may be left, with the command that removes them;
    that command works once it is back."""
    cluster = make_cluster(1, "64MiB")
    with Store(cluster.master_endpoint) as store:
        bench = subprocess.Popen(
            [sys.executable, "-m", "kvpool.cli.main", "bench", "--total", "8MiB", "--size", "64KiB",
             "--rounds", "100000", "--timeout", "1", "--master", cluster.master_endpoint],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            wait_until(lambda: bench_keys(store), timeout_s=30)
            os.kill(cluster.master.pid, signal.SIGSTOP)
            try:
                _, err = bench.communicate(timeout=60)
            finally:
                os.kill(cluster.master.pid, signal.SIGCONT)
        finally:
            if bench.poll() is None:
                bench.kill()
                bench.wait()
        said = b" ".join(err.split())
        assert bench.returncode == 1 and b"Traceback" not in err, err[-2000:]
        left = said.index(b"its objects may be left in the cluster")
        assert said.index(b"error: bench:") > left  # the run's own error, the last line
        command = said[said.index(b"kvpool rm --regex") :].split(b"' --force")[0] + b"' --force"
        regex = command.split(b"'")[1].decode()
        removed = kvpool_cli("rm", "--regex", regex, "--force", "--master", cluster.master_endpoint)
        assert removed.returncode == 0 and bench_keys(store) == []


def test_bench_plans_below_the_masters_own_watermark(make_cluster):
    """A master that evicts above half of each segment: 24 MiB fit a 32 MiB node below the
    default watermark (0.90), not below this one, and the bench used to assume the default."""
    cluster = make_cluster(1, "32MiB", master_args=("--evict-watermark-high", "0.5", "--evict-ratio", "0.05"))
    with Store(cluster.master_endpoint) as store:
        store.put("cache/kept", b"k" * 1000)
        assert store.cluster_status().evict_watermark_high == 0.5
        refused = kvpool_cli("bench", "--total", "24MiB", "--master", cluster.master_endpoint)
        assert refused.returncode == 1 and b"would evict cached objects" in b" ".join(refused.stderr.split())
        fits = kvpool_cli("bench", "--total", "12MiB", "--rounds", "1", "--master", cluster.master_endpoint)
        assert fits.returncode == 0, fits.stderr.decode()[-2000:]
        status = store.cluster_status()
        assert status.evicted_count == 0 and store.get("cache/kept") == b"k" * 1000
