"""``fastload report LOG_DIR``: a run's stats logs (:func:`fastload.loader.log_stats`) drawn as
one PNG a person would rather look at than read.

Four panels, from the ``rank-*.jsonl`` files of every rank:

1. **samples/s over time**, one line per rank (differences of consecutive lines);
2. **data stall over time**: the share of each interval the training loop waited for data;
3. **where the workers' time went**, per rank: ``read_s``, ``decode_s``, ``transform_s``,
   ``collate_s`` of the last line, beside the loop's ``data_stall_s``;
4. **node caches**: hits and misses per node (from ``node_cache_*``, the largest reading among the
   node's ranks, as they share one cache), or a note that the run read without a cache.

Needs matplotlib (``pip install 'fastload[report]'``); draws without a display (Agg).
"""

from __future__ import annotations

import itertools
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

from fastload.errors import InvalidArgumentError, MissingDependencyError

__all__ = ["PANELS", "draw_report", "read_logs"]

#: The panel titles, in order (tests check the drawing has them).
PANELS = (
    "samples/s per rank",
    "data stall (share of time waiting)",
    "where the workers' time went (s)",
    "node cache",
)
_STAGES = ("read_s", "decode_s", "transform_s", "collate_s", "data_stall_s")


def read_logs(log_dir: str | os.PathLike[str]) -> dict[int, list[dict[str, Any]]]:
    """Each rank's log lines, in order.

    Raises:
        InvalidArgumentError: No ``rank-*.jsonl`` file in ``log_dir``, or a line that is not
            JSON (naming the file and line).
    """
    files = sorted(Path(log_dir).glob("rank-*.jsonl"))
    if not files:
        raise InvalidArgumentError(
            f"no stats logs (rank-*.jsonl) in {log_dir}: write them with "
            "fastload.loader.log_stats(loader, LOG_DIR) during training"
        )
    logs: dict[int, list[dict[str, Any]]] = {}
    for path in files:
        lines = []
        texts = path.read_text(encoding="utf-8").splitlines()
        for number, text in enumerate(texts, 1):
            if not text.strip():
                continue
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError as exc:
                if number == len(texts):
                    break  # a last line cut by a crash: the rest stands
                raise InvalidArgumentError(f"{path}:{number} is not a JSON line: {exc}") from exc
        if lines:
            logs[int(lines[0].get("rank", len(logs)))] = lines
    return logs


def draw_report(log_dir: str | os.PathLike[str], out: str | os.PathLike[str]) -> list[str]:
    """Draw the run logged in ``log_dir`` into the PNG ``out``; returns the panel titles.

    Raises:
        MissingDependencyError: matplotlib is not installed.
        InvalidArgumentError: See :func:`read_logs`.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise MissingDependencyError(
            "fastload report draws with matplotlib, which is not installed; install it with: "
            "pip install 'fastload[report]'"
        ) from exc
    logs = read_logs(log_dir)
    fig, axes = plt.subplots(2, 2, figsize=(13, 8), constrained_layout=True)
    (rate_ax, stall_ax), (stage_ax, cache_ax) = axes
    start = min(lines[0]["time"] for lines in logs.values())
    for rank, lines in sorted(logs.items()):
        times, rates, stalls = [], [], []
        for a, b in itertools.pairwise(lines):
            dt = b["time"] - a["time"]
            if dt <= 0:
                continue
            times.append(b["time"] - start)
            rates.append((b.get("samples", 0) - a.get("samples", 0)) / dt)
            stall = (b.get("data_stall_s", 0) - a.get("data_stall_s", 0)) / dt
            stalls.append(min(1.0, max(0.0, stall)))
        rate_ax.plot(times, rates, marker=".", label=f"rank {rank}")
        stall_ax.plot(times, stalls, marker=".", label=f"rank {rank}")
    for ax, title, unit in ((rate_ax, PANELS[0], "samples/s"), (stall_ax, PANELS[1], "share")):
        ax.set_title(title)
        ax.set_xlabel("seconds since the first line")
        ax.set_ylabel(unit)
        ax.legend(loc="best", fontsize="small")
    _stages(stage_ax, logs)
    _caches(cache_ax, logs)
    fig.suptitle(f"fastload run: {log_dir} ({len(logs)} ranks)")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return [ax.get_title() for ax in axes.flat]


def _stages(ax: Any, logs: dict[int, list[dict[str, Any]]]) -> None:
    ranks = sorted(logs)
    left = [0.0] * len(ranks)
    for stage in _STAGES:
        values = [float(logs[r][-1].get(stage, 0.0)) for r in ranks]
        ax.barh([f"rank {r}" for r in ranks], values, left=left, label=stage)
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax.set_title(PANELS[2])
    ax.set_xlabel("seconds (workers summed; data_stall_s: the training loop)")
    ax.legend(loc="best", fontsize="small")


def _caches(ax: Any, logs: dict[int, list[dict[str, Any]]]) -> None:
    nodes: dict[str, dict[str, int]] = defaultdict(lambda: {"hits": 0, "misses": 0})
    for lines in logs.values():
        last = lines[-1]
        if "node_cache_hits" not in last:
            continue
        node = nodes[str(last.get("node", "?"))]
        node["hits"] = max(node["hits"], int(last["node_cache_hits"]))
        node["misses"] = max(node["misses"], int(last["node_cache_misses"]))
    ax.set_title(PANELS[3])
    if not nodes:
        ax.text(0.5, 0.5, "read without a cache (no cache_dir=)", ha="center", va="center")
        ax.set_axis_off()
        return
    names = sorted(nodes)
    hits = [nodes[n]["hits"] for n in names]
    ax.bar(names, hits, label="hits")
    ax.bar(names, [nodes[n]["misses"] for n in names], bottom=hits, label="misses")
    ax.set_ylabel("requests")
    ax.legend(loc="best", fontsize="small")
