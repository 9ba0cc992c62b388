"""Ctrl-C during ``fastload convert``, any number of times (issue 29, item 1).

The installed command runs in its own process group and gets SIGINT there, as a terminal sends
it. Whatever the count and spacing of the interrupts, the command ends promptly with exit status
130 and no traceback, no process of its group is left behind, and the re-run completes a dataset
byte-identical to an uninterrupted conversion. (Before: a second Ctrl-C while the workers were
finishing their shards let the process exit while the pool was still shutting down; the queue
that would have given the workers their end markers was closed first, and the command waited
for them forever.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.convert.test_first_hour import FASTLOAD, run_cli

#: Generous: a hang is what this catches, not a slow exit (an exit takes well under a second).
EXIT_TIMEOUT = 60

_SLOW_MAP = """\
import os, time

def slow(sample):
    marker = os.environ.get("STARTED_MARKER")
    if marker and not os.path.exists(marker):
        open(marker, "w").close()
    time.sleep(float(os.environ.get("SLOW_SECONDS", "0")))
    return sample
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """400 small JPEGs in 4 classes, a map module, and an uninterrupted conversion (``ref``)."""
    from fastload.testing.corpus import write_image_folder

    root = tmp_path_factory.mktemp("interrupts")
    write_image_folder(root / "images", 400, num_classes=4, scale=4, processes=1)
    (root / "slow_map.py").write_text(_SLOW_MAP)
    proc = run_cli(*_args("ref"), cwd=root, env={"PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr
    return root


def _args(dst: str, workers: int = 2) -> list[str]:
    layout = ["--shard-samples", "20", "--workers", str(workers), "--map", "slow_map:slow"]
    return ["convert", "images", dst, *layout]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _interrupt(
    root: Path, dst: str, workers: int, count: int, spacing: float
) -> subprocess.CompletedProcess[str]:
    """Start the conversion (10 ms a sample), send ``count`` SIGINTs ``spacing`` s apart once
    the first sample is being written, and return the finished process."""
    marker = root / f"{dst}.started"
    env = {"PYTHONPATH": str(root), "SLOW_SECONDS": "0.01", "STARTED_MARKER": str(marker)}
    proc = subprocess.Popen(
        [FASTLOAD, *_args(dst, workers)],
        cwd=root,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + EXIT_TIMEOUT
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert marker.exists(), "the conversion never started writing"
        time.sleep(0.3)  # a few shards into the conversion
        for n in range(count):
            if n:
                time.sleep(spacing)
            with contextlib.suppress(ProcessLookupError):  # ended by an earlier one
                os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=EXIT_TIMEOUT)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    alive = _group_alive(proc.pid)
    if alive:
        os.killpg(proc.pid, signal.SIGKILL)
    assert not alive, f"a process of the conversion outlived it:\n{err}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize(
    ("workers", "count", "spacing"),
    [
        (2, 1, 0.0),
        (2, 2, 0.02),  # the second while the first is being handled
        (2, 2, 0.3),  # the second while the workers finish their shards
        (2, 3, 0.05),
        (2, 6, 0.01),
        (1, 2, 0.05),  # in-process writing
        (1, 4, 0.01),
    ],
)
def test_any_number_of_interrupts_end_the_command_and_the_rerun_is_identical(
    corpus: Path, cv: Any, workers: int, count: int, spacing: float
) -> None:
    dst = f"out-{workers}-{count}-{int(spacing * 1000)}"
    proc = _interrupt(corpus, dst, workers, count, spacing)
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("fastload convert: interrupted after "), proc.stderr
    assert not (corpus / dst / "fastload.json").exists()

    rerun = run_cli(*_args(dst, workers), cwd=corpus, env={"PYTHONPATH": str(corpus)})
    assert rerun.returncode == 0, rerun.stderr
    assert cv.tree_bytes(corpus / dst) == cv.tree_bytes(corpus / "ref")
