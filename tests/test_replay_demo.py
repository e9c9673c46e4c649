"""`kvpool demo`: what it reports about the cluster it started, and the sizes it is given.

How: the demo's own code (cli/demo.py `run_demo`) runs in-process against a real master and
one node on 127.0.0.1, without its closing trace replay; its LocalCluster is wrapped to record
the memory each node was given, and its timer to report a fixed 1 ms per path, so that the
throughput it prints follows from the replicas it counts alone. Asserted: with one node the
put row says (and computes for) the one replica held, not two; a segment size that is not a
whole number of MiB reaches the node as given; one below a segment's minimum is refused,
worded as the user gave it, before any process starts; so are objects larger than an object
can be, and more objects than the nodes hold below the eviction watermark (they were evicted,
then reported as "read back wrong"); more nodes than a put has replicas (9) all serve. Bounded:
a few seconds each.
"""

from __future__ import annotations

import pytest
from rich.console import Console
from typer.testing import CliRunner

import kvpool.cli.replay as replay_cli
from kvpool import limits
from kvpool.cli import demo
from kvpool.cli.launcher import LocalCluster
from kvpool.cli.main import app
from kvpool.config import parse_size
from kvpool.errors import InvalidParams

KIB = 1024
MIB = 1024 * KIB


@pytest.fixture
def node_memory(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The segment size of each LocalCluster the demo starts, in bytes."""
    sizes: list[int] = []

    class Recording(LocalCluster):
        def __init__(self, node_count: int, memory: str, **kwargs) -> None:
            sizes.append(parse_size(memory))
            super().__init__(node_count, memory, **kwargs)

    monkeypatch.setattr(demo, "LocalCluster", Recording)
    monkeypatch.setattr(replay_cli, "run_demo_replay", lambda console: None)
    return sizes


@pytest.mark.timeout(60)
def test_one_node_holds_one_replica_and_the_demo_says_so(node_memory, monkeypatch) -> None:
    timed = demo._timed_batches

    def one_ms(*args) -> float:
        timed(*args)
        return 0.001

    monkeypatch.setattr(demo, "_timed_batches", one_ms)
    console = Console(record=True, width=200)
    demo.run_demo(1, 1500 * KIB, 16, 64 * KIB, console)
    text = console.export_text()
    assert node_memory == [1500 * KIB]  # not cut to 1 MiB
    assert "x 1500 KiB on 127.0.0.1" in text
    (put_row,) = [line for line in text.splitlines() if "put," in line]
    # 16 objects of 64 KiB in 1 ms, one copy each: 16,000 objects/s and 1.05 GB/s (not 2.10).
    assert "put, 1 replica (shm)" in put_row and "16,000" in put_row and "1.05" in put_row, put_row


def test_a_segment_below_the_minimum_is_refused_as_given(node_memory) -> None:
    with pytest.raises(InvalidParams, match="512 KiB"):
        demo.run_demo(1, 512 * KIB, 16, 64 * KIB, Console(record=True))
    assert node_memory == []  # nothing started
    result = CliRunner().invoke(app, ["demo", "--nodes", "1", "--memory", "512KiB"])
    assert result.exit_code == 1
    assert result.output.startswith("error: --memory 512 KiB"), result.output
    assert result.output.count("\n") == 1, result.output


@pytest.mark.parametrize(
    ("node_count", "memory", "object_count", "object_size", "said"),
    [
        (1, 32 * MIB, 100, MIB, "evicted before they are read back"),  # 100 MiB in 32 MiB
        (3, 64 * MIB, 100, MIB, "evicted before they are read back"),  # 200 MiB with replicas in 192
        (1, 2 * limits.GIB, 1, 1536 * MIB, "an object is at most 1 GiB"),
    ],
)
def test_objects_the_nodes_cannot_keep_are_refused_before_anything_starts(
    node_memory, node_count, memory, object_count, object_size, said
) -> None:
    with pytest.raises(InvalidParams, match=said):
        demo.run_demo(node_count, memory, object_count, object_size, Console(record=True))
    assert node_memory == []  # nothing started


@pytest.mark.timeout(60)
def test_more_nodes_than_a_put_has_replicas_all_serve(node_memory) -> None:
    console = Console(record=True, width=200)
    demo.run_demo(limits.REPLICA_NUM_MAX + 1, MIB, 8, 64 * KIB, console)
    assert "all 8 objects read back intact on both paths" in console.export_text()
