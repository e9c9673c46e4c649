"""Replay reports: the JSON record, a markdown table, and the hit-rate plot.

The plot is hit rate against pool capacity (tokens, log scale), one curve per configuration
(everything but the capacity: `ReplayResult.label`), as Fig. 9 of the FAST'25 Mooncake paper
draws it. This module only formats results; it runs nothing (replay.py, live.py do).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import msgspec

from kvpool.sim.replay import ReplayResult, human_tokens
from kvpool.sim.trace import BLOCK_TOKENS


def human_bytes(size_bytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if size_bytes < 1000 or unit == "PB":
            return f"{size_bytes:.0f} {unit}" if unit == "B" else f"{size_bytes:.1f} {unit}"
        size_bytes /= 1000
    raise AssertionError("unreachable")


TABLE_COLUMNS = (
    "configuration", "mode", "capacity/instance", "pool", "block hit", "token hit",
    "prefill saved", "loaded (remote)", "stored (remote)", "evictions", "time",
)  # fmt: skip
# With a disk tier under DRAM (replay.py), after "capacity/instance" and before "time":
DISK_COLUMNS = ("disk/instance", "hit on disk", "offloads / promotions")
# When a put found no room (everything evictable leased or pinned), after "stored (remote)".
NOT_STORED_COLUMN = "not stored"


def table_columns(results: Sequence[ReplayResult]) -> list[str]:
    """TABLE_COLUMNS, with DISK_COLUMNS when any result had a disk tier, and NOT_STORED_COLUMN
    when any left blocks not stored."""
    columns = list(TABLE_COLUMNS)
    if any(r.blocks_not_stored for r in results):
        columns.insert(columns.index("stored (remote)") + 1, NOT_STORED_COLUMN)
    if not any(r.disk_capacity_blocks for r in results):
        return columns
    return [*columns[:3], DISK_COLUMNS[0], *columns[3:5], DISK_COLUMNS[1], *columns[5:-1],
            DISK_COLUMNS[2], columns[-1]]  # fmt: skip


def table_rows(results: Sequence[ReplayResult]) -> list[list[str]]:
    """One row of table_columns(results) per result, as text."""
    with_disk = any(r.disk_capacity_blocks for r in results)
    with_not_stored = any(r.blocks_not_stored for r in results)
    rows = []
    for r in results:
        row = [
            r.label,
            r.mode,
            human_tokens(r.capacity_tokens),
            human_tokens(r.pool_capacity_tokens),
            f"{r.block_hit_rate:.3f}",
            f"{r.token_hit_rate:.3f}",
            f"{human_tokens(r.prefill_tokens_saved)} tok",
            f"{human_bytes(r.loaded_bytes)} ({human_bytes(r.loaded_bytes_remote)})",
            f"{human_bytes(r.stored_bytes)} ({human_bytes(r.stored_bytes_remote)})",
            str(r.evictions),
            f"{r.runtime_s:.1f} s",
        ]
        if with_not_stored:
            row.insert(9, str(r.blocks_not_stored))
        if with_disk:
            has_disk = r.disk_capacity_blocks > 0
            row.insert(3, human_tokens(r.disk_capacity_blocks * BLOCK_TOKENS) if has_disk else "-")
            row.insert(6, f"{r.block_hits_disk / r.blocks:.3f}" if has_disk and r.blocks else "-")
            row.insert(-1, f"{r.offloads} / {r.promotions}" if has_disk else "-")
        rows.append(row)
    return rows


def live_rows(results: Sequence[ReplayResult]) -> list[list[str]]:
    """Throughput and latency of live results: configuration, capacity, req/s, load and store
    bytes per second, lookup+load p50/p99, request p50/p99, block size."""
    return [
        [
            r.label,
            human_tokens(r.capacity_tokens),
            f"{r.requests_per_s:.0f}",
            f"{human_bytes(r.loaded_bytes_per_s)}/s",
            f"{human_bytes(r.stored_bytes_per_s)}/s",
            f"{r.lookup_load_ms_p50:.2f} / {r.lookup_load_ms_p99:.2f} ms",
            f"{r.request_ms_p50:.2f} / {r.request_ms_p99:.2f} ms",
            human_bytes(r.block_size_bytes_live),
        ]
        for r in results
        if r.mode == "live"
    ]


LIVE_COLUMNS = (
    "configuration", "capacity/instance", "req/s", "load", "store", "lookup+load p50/p99", "request p50/p99", "block"
)


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_json(path: Path, results: Sequence[ReplayResult], meta: dict) -> None:
    payload = {**meta, "results": [msgspec.to_builtins(r) for r in results]}
    path.write_text(json.dumps(payload, indent=2) + "\n")


def write_markdown(path: Path, results: Sequence[ReplayResult], meta: dict) -> None:
    text = f"# kvpool replay\n\n`{meta.get('command', '')}`\n\n"
    text += markdown_table(table_columns(results), table_rows(results))
    live = live_rows(results)
    if live:
        text += "\n" + markdown_table(LIVE_COLUMNS, live)
    path.write_text(text)


def plot_hit_rates(path: Path, results: Sequence[ReplayResult], title: str) -> None:
    """Hit rate (blocks) against pool capacity in tokens (DRAM and disk tiers together), one
    curve per label, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display: a file only
    import matplotlib.pyplot as plt

    curves: dict[str, list[ReplayResult]] = {}
    for result in results:
        label = f"{result.label} ({result.mode})" if result.mode == "live" else result.label
        curves.setdefault(label, []).append(result)
    figure, axes = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    def all_tiers_tokens(r: ReplayResult) -> int:  # DRAM and any disk tier, all instances
        return r.pool_capacity_tokens + r.disk_capacity_blocks * BLOCK_TOKENS * r.instance_count

    for label, points in curves.items():
        points = sorted(points, key=all_tiers_tokens)
        xs = [all_tiers_tokens(r) for r in points]
        ys = [r.block_hit_rate for r in points]
        style = "--" if "belady" in label else ":" if "local" in label else "-"
        axes.plot(xs, ys, style, marker="o", label=label)
    axes.set_xscale("log")
    with_disk = any(r.disk_capacity_blocks for r in results)
    axes.set_xlabel("pool capacity (tokens, all instances" + ("; DRAM + disk)" if with_disk else ")"))
    axes.set_ylabel("prefix hit rate (blocks)")
    axes.set_ylim(0, 1)
    axes.grid(True, which="both", alpha=0.3)
    axes.set_title(title, fontsize=10)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
