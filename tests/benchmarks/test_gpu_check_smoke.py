"""``benchmarks/gpu/run_gpu_check.py --cpu-smoke``: the GPU check's own code paths, on the CPU.

The GPU check runs only on a GPU machine, rarely; this keeps the script working in between. It
runs as a user would run it (a fresh interpreter, the script path), on a tiny generated corpus,
and the test reads its JSON report: every loader ran its whole epoch in every round and produced
positive rates, and the table has exactly the expected rows. About 15 s on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fastload.dali import dali_available
from fastload.testing import need

pytestmark = [pytest.mark.dali, pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu" / "run_gpu_check.py"
LOADERS = {"dali-file", "fastload-dali", "fastload-dali-native", "fastload-torch"}
COUNT = 64


def test_gpu_check_cpu_smoke_runs_every_loader_for_a_whole_epoch(tmp_path: Path) -> None:
    need("NVIDIA DALI", dali_available(), "pip install nvidia-dali-cuda120 (or 'fastload[dali]')")
    out = tmp_path / "gpu_check.json"
    args = [
        "--cpu-smoke",
        "--count",
        str(COUNT),
        "--root",
        str(tmp_path / "work"),
        "--json",
        str(out),
    ]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=tmp_path,  # the script finds the repository from its own path
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["config"]["cpu_smoke"] is True
    assert report["config"]["count"] == COUNT
    assert report["config"]["epochs"] == 1
    assert report["environment"]["dali"]
    table = report["table"]
    assert set(table) == LOADERS
    for name, row in table.items():
        assert row["errors"] == [], name
        assert row["samples"] == [COUNT], name  # one whole epoch, every image once
        assert row["img_per_s"] > 0, name
        assert row["steady_img_per_s"] > 0, name
        assert row["first_batch_s"] > 0, name
        assert row["gpu_mem_smi_mib"] is None, name  # CPU: no device memory measured
    for name, runs in report["runs"].items():
        (run,) = runs  # --cpu-smoke: one round
        assert run["samples"] == COUNT, name
        assert run["batches"] == COUNT // report["config"]["batch"], name
        assert 0 < run["first_batch_seconds"] <= run["epoch_seconds"], name
        assert 0 < run["steady_seconds"] < run["epoch_seconds"], name
    assert isinstance(report["goal_within_10_percent"], bool)
    assert isinstance(report["goal_within_10_percent_steady"], bool)
    assert "goal (a) within 10% of (b)" in proc.stdout
    assert "ERROR" not in proc.stdout
    for name in LOADERS:
        assert f"\n{name} " in proc.stdout  # its table row
