"""`kvpool demo`: what it reports about the cluster it started, and the sizes it is given.

How: the demo's own code (cli/demo.py `run_demo`) runs in-process against a real master and
one node on 127.0.0.1, without its closing trace replay; its LocalCluster is wrapped to record
the memory each node was given, and its timer to report a fixed 1 ms per path, so that the
throughput it prints follows from the replicas it counts alone. Asserted: with one node the
put row says (and computes for) the one replica held, not two; a segment size that is not a
whole number of MiB reaches the node as given; one below a segment's minimum is refused,
worded as the user gave it, before any process starts. Bounded: a few seconds.
"""

from __future__ import annotations

import pytest
from rich.console import Console
from typer.testing import CliRunner

import kvpool.cli.replay as replay_cli
from kvpool.cli import demo
from kvpool.cli.launcher import LocalCluster
from kvpool.cli.main import app
from kvpool.config import parse_size
from kvpool.errors import InvalidParams

KIB = 1024


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
