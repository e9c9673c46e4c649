"""What the store promises concurrent clients while the disk and DFS tiers are busy, checked on a
recorded history (tests/history_check.py, HistoryRun(tiers=True)): small DRAM over disk tiers,
so that offloads, disk evictions and promotions run all the time; a DFS shared by the master,
the nodes and the clients; write-through puts to disk and DFS; and faults that hit the tiers
(a node killed mid-move and restarted on its disk directory, the master killed and its DFS
index rebuilt, a node stopped, every node killed while the DFS alone serves)."""

from __future__ import annotations

import json
import os

from tests.history_check import CALL_BOUND_MS, TIER_FAULTS, HistoryRun, run_checked


def test_history_with_busy_tiers_keeps_the_promises(tmp_path) -> None:
    """A seeded run of three clients on 4 MiB of DRAM per node over 16 MiB disk tiers: every
    read returns bytes a put of its key wrote, no removed value comes back from disk or DFS,
    the nemesis's reads of a restarted node's re-adopted objects and of the DFS with every node
    dead are checked like any client's; and once quiet, every disk and DFS file is one the
    master lists there, every replica it lists there has its file, and no temporary file is
    left (but a DFS one a killed node was writing: the master removes those after an hour)."""
    seed = int(os.environ.get("KVPOOL_HISTORY_SEED", "11"))
    run = HistoryRun(tmp_path, seed=seed, duration_s=12, fault_gap_s=0.8, tiers=True, disk_size="16MiB", key_space=400)
    violations, report, final = run_checked(run)
    assert violations == [], (violations[:10], report)
    assert report["fault_kinds"] == sorted(TIER_FAULTS), report  # the run did inject every fault
    assert report["reads"] > 100 and report["longest_ms"] < CALL_BOUND_MS, report
    counts = {t["tier"]: t for t in final["tier_counts"]}
    assert counts["disk"]["object_count"] > 0 and counts["dfs"]["object_count"] > 0, counts
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    tier_reads = [e for e in events if e["what"] == "read_tier"]
    assert any(e["tier"] == "dfs" and e["keys"] for e in tier_reads), tier_reads  # read with every node dead
