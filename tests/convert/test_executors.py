"""The executors of shard jobs (``fastload.convert._pool.Executor``): each one writes every job's
shard with its done record, and takes the next job (which plans it: enumerates the source) only
when it has room, so planning runs a bounded number of shards ahead of the committed ones."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fastload.convert._plan import PlanStream, ShardLayout
from fastload.convert._pool import Executor, InProcess, Pool, ShardRecords, run_jobs
from fastload.convert._progress import Progress
from fastload.convert._worker import ShardJob
from fastload.convert.sources import Source, open_source
from fastload.formats import get_format
from fastload.storage import Store, open_store

#: Shards a job may be planned ahead of the committed ones, per executor: in this process, the
#: one being written and the one committing; a pool of two, per worker the one being written and
#: the one committing, plus the two per worker queued.
_AHEAD = {"in-process": 2, "pool": 2 * 2 + 2 * 2}


def _executor(kind: str) -> Executor:
    return InProcess() if kind == "in-process" else Pool(2, get_format("webdataset"))


def _planned(tmp_path: Path, records: int) -> tuple[Source, Store, PlanStream]:
    """A JSONL file of ``records`` records, its destination store, and its plan (shards of 5),
    not yet cut."""
    src = tmp_path / "src.jsonl"
    src.write_text("".join(f'{{"i": {i}, "pad": "{"x" * (i % 90)}"}}\n' for i in range(records)))
    source = open_source(str(src))
    layout = ShardLayout("webdataset", "tar", "shard", 5, None)
    units = source.plan_units(lambda item, reason: None)
    plan = PlanStream(units, layout, source.describe(), {"shard_samples": 5})
    return source, open_store(str(tmp_path / "out")), plan


@pytest.mark.parametrize("kind", sorted(_AHEAD))
def test_an_executor_writes_every_job_taking_them_as_it_has_room(
    tmp_path: Path, cv: Any, kind: str
) -> None:
    source, dst, plan = _planned(tmp_path, 300)
    done_dir = tmp_path / "out" / "_fastload_convert" / "done"
    ahead: list[int] = []

    def jobs() -> Iterator[ShardJob]:
        for shard, units in plan:
            committed = len(list(done_dir.glob("*.json"))) if done_dir.is_dir() else 0
            ahead.append(shard.index - committed)
            yield ShardJob(source, dst, "webdataset", shard, units, None, "raise")

    records = ShardRecords(Progress(0, 0, quiet=True))
    executor = _executor(kind)
    try:
        run_jobs(executor, jobs(), records, None)
    finally:
        executor.shutdown()
    assert len(plan.shards) == 60
    assert sorted(records.records) == [s.name for s in plan.shards]
    for shard in plan.shards:
        record = records.records[shard.name]
        assert record["shard_sha256"] == shard.digest
        assert record["info"]["num_samples"] == 5
        assert (tmp_path / "out" / shard.name).stat().st_size == record["info"]["num_bytes"]
    assert max(ahead) <= _AHEAD[kind], ahead


def test_a_pool_stops_on_a_failing_plan_and_keeps_what_it_committed(
    tmp_path: Path,
) -> None:
    source, dst, plan = _planned(tmp_path, 100)

    def jobs() -> Iterator[ShardJob]:
        for shard, units in plan:
            if shard.index == 12:
                raise RuntimeError("the source failed")
            yield ShardJob(source, dst, "webdataset", shard, units, None, "raise")

    records = ShardRecords(Progress(0, 0, quiet=True))
    executor = _executor("pool")
    try:
        with pytest.raises(RuntimeError, match="the source failed"):
            run_jobs(executor, jobs(), records, None)
    finally:
        executor.shutdown()
    # The jobs queued are dropped; those taken are finished: each shard there is committed
    # whole, with its done record.
    written = sorted(p.name for p in (tmp_path / "out").glob("shard-*.tar"))
    recorded = sorted(
        p.name.removesuffix(".json")
        for p in (tmp_path / "out" / "_fastload_convert" / "done").glob("*.json")
    )
    assert written == recorded
    assert set(written) <= {f"shard-{n:06d}.tar" for n in range(12)}
    for name in written:
        with get_format("webdataset").reader(dst, name) as reader:
            assert len(list(reader)) == 5


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
