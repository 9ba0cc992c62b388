"""The executors of shard jobs (``fastload.convert._pool.Executor``): each one writes every job's
shard with its done record, and takes the next job (which plans it: enumerates the source) only
when it has room, so planning runs a bounded number of shards ahead of the committed ones."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, ClassVar

import pytest

from fastload.cli import main
from fastload.convert import convert
from fastload.convert._engines import ExecutorChoice, get_engine
from fastload.convert._pool import InProcess
from fastload.convert._progress import Progress
from fastload.errors import InvalidArgumentError
from fastload.formats import get_format
from fastload.storage import open_store
from fastload.testing.executors import ExecutorTests, check_writes_every_job
from fastload.testing.hdfs import hdfs_cluster  # noqa: F401 - the HDFS test's fixture

#: Shards a job may be planned ahead of the committed ones, per executor: in this process, the
#: one being written and the one committing; a pool of two, per worker the one being written and
#: the one committing, plus the two per worker queued.
_AHEAD = {"in-process": 2, "pool": 2 * 2 + 2 * 2}


def test_in_process_writes_every_job_taking_them_as_it_has_room(tmp_path: Path) -> None:
    check_writes_every_job(InProcess(), tmp_path, _AHEAD["in-process"])


class TestPoolExecutor(ExecutorTests):
    """The local executor's pool (2 worker processes) under the executor conformance suite: it
    does not retry a job whose worker died (the run fails, a re-run resumes) and lets the jobs
    being written finish when it stops."""

    executor = "local"
    options: ClassVar[dict[str, Any]] = {"workers": 2}
    ahead = _AHEAD["pool"]
    retries_dead_workers = False
    cancels_running = False

    def cli_options(self) -> list[str]:
        return ["--executor", "local", "--workers", "2"]


def test_the_executor_and_its_address_options_are_checked(tmp_path: Path) -> None:
    src = tmp_path / "src.jsonl"
    src.write_text('{"i": 1}\n')
    with pytest.raises(InvalidArgumentError, match=r"must be one of \('local', 'ray', 'spark'\)"):
        convert(str(src), str(tmp_path / "out"), executor="dask", quiet=True)
    with pytest.raises(InvalidArgumentError, match=r"ray_address \(--ray-address\) is not used"):
        convert(str(src), str(tmp_path / "out"), executor="spark", ray_address="auto", quiet=True)
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as info:
        main(["convert", str(src), str(tmp_path / "out"), "--executor", "dask"])
    assert info.value.code == 2


def test_the_executor_for_a_single_job_is_chosen_by_its_capability(tmp_path: Path) -> None:
    # A single job is written in this process unless the executor started runs single jobs
    # too (a cluster engine's task); the choice asks the executor, never its class.
    stores = [open_store(str(tmp_path / name)) for name in ("src", "dst")]
    choice = ExecutorChoice(get_engine("local"), 2, None, get_format("webdataset"), *stores, False)

    class Started(InProcess):
        runs_single_job = False

    choice.started = Started()
    assert type(choice.runner(several=False)) is InProcess
    assert choice.runner(several=True) is choice.started
    Started.runs_single_job = True
    assert choice.runner(several=False) is choice.started


def test_progress_while_the_plan_streams() -> None:
    out = io.StringIO()
    progress = Progress(0, 0, stream=out, interval=0.0)
    progress.planned(120, 10_000, complete=False)
    progress.update(40, 4_000)
    progress.planned(300, 30_000, complete=True)
    progress.update(100, 10_000)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("fastload convert: 40/120 samples (planning), ")
    assert lines[0].endswith("ETA ?")
    assert lines[1].startswith("fastload convert: 100/300 samples (33.3%), ")
    assert not lines[1].endswith("ETA ?")
