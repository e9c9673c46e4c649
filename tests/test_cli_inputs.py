"""What the object commands read from their caller: the value of `kvpool put` and KVPOOL_SHM.

How: typer's CliRunner runs the real command in-process, with no cluster (each case ends before
one is needed, or the Store the command would open is recorded instead), and the largest object
lowered to 4 KiB so that "larger than an object" costs no GiB. Asserted: a put whose file or
standard input holds more than an object can is refused with one line naming the limit, having
read at most one byte past it (an endless input, `kvpool put k < /dev/zero`, was read until the
memory ran out); KVPOOL_SHM turns shared memory off with the spellings engines' shm_enabled
takes (off, False), not only 0, false and no. Bounded: well under a second.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import kvpool.client.sync as sync
from kvpool import limits
from kvpool.cli.main import app, put

OBJECT_SIZE_BYTES_MAX = 4096


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
