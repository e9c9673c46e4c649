"""Live conformance with the real Mooncake Store: scripts/mooncake_conformance.py, as a test.

How: the script runs one sequence of calls against Mooncake's own `mooncake_master` and TCP
client, and against kvpool's compat client on a LocalCluster, each side in its own process
inside a private network namespace (Mooncake listens on every interface; the namespace holds
only loopback), and fails on any return value that differs. Skipped, saying why, when the
`mooncake` package (PyPI mooncake-transfer-engine-non-cuda; scripts/install-peers.sh mooncake)
is not installed or the namespace cannot be made (needs root, unshare, ip).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "mooncake_conformance.py"
EXIT_SKIP = 77


def test_same_return_values_as_real_mooncake(tmp_path):
    pytest.importorskip(
        "mooncake.store",
        reason="Mooncake Store is not installed (scripts/install-peers.sh mooncake installs "
        "mooncake-transfer-engine-non-cuda and libibverbs1)",
    )
    pytest.importorskip("torch", reason="the sequence covers put_tensor: needs torch==2.13.0")
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        pytest.skip("running Mooncake in a private network namespace needs root, unshare and ip")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--log-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    if result.returncode == EXIT_SKIP:
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert "return values agree" in result.stdout
