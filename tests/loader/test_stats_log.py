"""``log_stats``: a JSON-lines log per rank; ``fastload report`` draws it as a PNG."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from PIL import Image

import fastload.loader as fl
from fastload.errors import InvalidArgumentError
from fastload.report import PANELS, draw_report, read_logs

pytestmark = [pytest.mark.timeout(300)]
SIZES = [20, 20, 20, 20]


def _slow(raw: dict[str, Any]) -> dict[str, Any]:
    time.sleep(0.01)
    return raw


def test_two_ranks_of_a_cached_two_worker_run_are_logged_and_drawn(
    fake: SimpleNamespace, tmp_path: Path
) -> None:
    root = fake.build_format_dataset(str(tmp_path / "ds"), SIZES)
    logs = tmp_path / "logs"
    for rank in (0, 1):
        ds = fl.open_dataset(root, decode=_slow, cache_dir=tmp_path / "cache", seed=rank)
        loader = fl.DataLoader(
            ds, batch_size=4, rank=rank, world_size=2, num_workers=2,
            collate_fn=fake.keys_collate,
        )  # fmt: skip
        with fl.log_stats(loader, logs, every_s=0.05):
            for epoch in (0, 1):
                loader.set_epoch(epoch)
                for _ in loader:
                    pass
    lines = read_logs(logs)
    assert sorted(lines) == [0, 1]
    for rank, rank_lines in lines.items():
        assert len(rank_lines) >= 3
        assert {line["epoch"] for line in rank_lines} >= {0, 1}
        last = rank_lines[-1]
        assert (last["rank"], last["world_size"]) == (rank, 2)
        assert last["samples"] == 2 * 40  # two epochs of this rank's half
        assert last["decode_s"] >= 80 * 0.01
        assert last["node_cache_hits"] + last["node_cache_misses"] > 0
        times = [line["time"] for line in rank_lines]
        assert times == sorted(times)
    out = tmp_path / "run.png"
    proc = subprocess.run(
        [sys.executable, "-m", "fastload.cli", "report", str(logs), "-o", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert all(title in proc.stdout for title in PANELS)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(out) as image:
        assert image.size == (1300, 800)
        assert len(image.convert("L").getcolors(maxcolors=256**2) or []) > 20  # drawn, not blank
    assert draw_report(logs, tmp_path / "again.png") == list(PANELS)


def test_bad_logs_are_named(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="no stats logs"):
        read_logs(tmp_path)
    good = json.dumps({"time": 1.0, "rank": 0, "samples": 1})
    (tmp_path / "rank-0.jsonl").write_text(f"{good}\n{{not json\n{good}\n")
    with pytest.raises(InvalidArgumentError, match=r"rank-0.jsonl:2 is not a JSON line"):
        read_logs(tmp_path)
    (tmp_path / "rank-0.jsonl").write_text(f'{good}\n{good}\n{{"time": 3')  # cut by a crash
    assert len(read_logs(tmp_path)[0]) == 2


def test_every_s_must_be_positive_and_the_loader_a_fastload_one(
    fake: SimpleNamespace, tmp_path: Path
) -> None:
    loader = fl.DataLoader(fake.make_dataset([3]), batch_size=2)
    with pytest.raises(InvalidArgumentError, match="every_s must be a positive"):
        fl.log_stats(loader, tmp_path, every_s=0)
    with pytest.raises(InvalidArgumentError, match="log_stats logs fastload's loaders"):
        fl.log_stats(SimpleNamespace(stats=dict), tmp_path)


def test_a_closed_log_writes_no_more(fake: SimpleNamespace, tmp_path: Path) -> None:
    loader = fl.DataLoader(fake.make_dataset([3, 3]), batch_size=2)
    log = fl.log_stats(loader, tmp_path, every_s=1e-6)
    list(loader)
    log.close()
    lines = read_logs(tmp_path)[0]
    assert len(lines) >= 1 + 3 + 1  # start, a line per step (every_s is tiny), close
    list(loader)  # iterating after close: nothing more is written
    assert len(read_logs(tmp_path)[0]) == len(lines)
    assert lines[-1]["samples"] == 6
