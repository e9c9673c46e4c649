"""The benchmarks' own measuring tools: a limit that hangs or miscounts makes every ratio wrong."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_core import MIB, socket_pair_gbps  # noqa: E402


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
