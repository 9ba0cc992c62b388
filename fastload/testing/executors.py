"""The conformance suite every conversion executor (``convert(..., executor=NAME)``) must pass.

An executor (:class:`fastload.convert._pool.Executor`, registered by name in
:data:`fastload.convert._engines.ENGINES`) writes a conversion's shard jobs. The contract it keeps,
and this suite checks:

* every job's shard is written and committed with its done record, and the output is
  **byte-identical** to the local executor's for any partitioning and format;
* jobs are taken from the driver's iterator only when there is room (a bounded look-ahead:
  planning never runs far ahead of the committed shards);
* a failing plan or a failing job stops the run with the error's own type (naming the shard);
  committed shards stay whole and recorded, nothing partial is visible, and the same command
  resumes to the same bytes;
* a worker process killed mid-shard is retried by the engine (the result stays identical), or,
  for an engine that does not retry, fails the run with :class:`~fastload.errors.WorkerError` and
  the re-run resumes to the same bytes;
* a converting process (the driver) killed with SIGKILL leaves committed shards that a re-run
  resumes to the same bytes;
* an object store (the S3 API of the local Ceph RGW) and HDFS (a real local MiniDFSCluster) work
  as source and destination from the engine's tasks, a worker killed mid-shard included.

Subclass :class:`ExecutorTests` in a test module, set :attr:`~ExecutorTests.executor` and the
capability flags, and override the ``engine`` fixture to start the engine's runtime for the
module (a Ray runtime, a ``SparkContext``)::

    class TestSparkExecutor(ExecutorTests):
        executor = "spark"
        ahead = 4

        @pytest.fixture(scope="class")
        def engine(self):
            sc = SparkContext(conf=spark_conf(pyspark, "local[2]"))
            yield
            sc.stop()

Faults are injected by a map function in a module the suite writes (``fl_faults_<hex>``, found
by every worker through the directory ``convert`` is called in, which the tests make the
current directory). It acts on marker files: ``kill`` (the first process to take the marker
SIGKILLs itself), ``fail`` (the sample ``src/000000410`` raises), ``hold`` (samples from
``src/000000450`` on wait until cancelled) and ``slow`` (20 ms a sample). The object-store test
needs the ``ceph_s3`` and ``s3_bucket`` fixtures of fastload's ``tests/conftest.py``, the HDFS
test the ``hdfs_cluster`` fixture of :mod:`fastload.testing.hdfs` (import it into the test
module).

Why one file: it is one suite, read as one contract; the fault module, the reference conversion
and the comparison helpers exist only for its tests (as ``fastload.testing.store`` keeps its own).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fastload._fsutil import pid_alive
from fastload.cli import main
from fastload.convert import ENGINES, convert
from fastload.convert._plan import PlanStream, ShardLayout
from fastload.convert._pool import Executor, Pool, ShardRecords, run_jobs
from fastload.convert._progress import Progress
from fastload.convert._state import PLAN_KEY
from fastload.convert._worker import ShardJob
from fastload.convert.sources import ConversionError, Source, open_source
from fastload.errors import InvalidArgumentError, WorkerError
from fastload.formats import get_format
from fastload.storage import Store, open_store

__all__ = [
    "ExecutorTests",
    "Faults",
    "Reference",
    "check_writes_every_job",
    "jsonl",
    "planned",
    "same_files",
]

_FAULTS_MODULE = '''
import os
import signal
import time


def faulty(sample):
    """The identity, but: with a marker file 'kill', the first process to take it is killed;
    with 'fail', the sample src/000000410 raises; with 'hold', samples from src/000000450 on wait
    for a 'release' marker (until cancelled); with 'slow', each sample takes 20 ms."""
    faults = FAULTS_DIR
    try:
        os.rename(os.path.join(faults, "kill"), os.path.join(faults, "killed"))
    except FileNotFoundError:
        pass
    else:
        with open(os.path.join(faults, "killed"), "w") as f:
            f.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    if sample["__key__"] == "src/000000410" and os.path.exists(os.path.join(faults, "fail")):
        raise ValueError("injected failure")
    if os.path.exists(os.path.join(faults, "hold")) and sample["__key__"] >= "src/000000450":
        # A file names the process while it holds; a process killed holding leaves it.
        holding = os.path.join(faults, f"holding-{os.getpid()}-{time.monotonic_ns()}")
        open(holding, "w").close()
        try:
            deadline = time.monotonic() + 120
            while not os.path.exists(os.path.join(faults, "release")):
                if time.monotonic() > deadline:
                    raise RuntimeError("held for 120 s and never cancelled")
                time.sleep(0.05)
        finally:
            os.unlink(holding)
    if os.path.exists(os.path.join(faults, "slow")):
        time.sleep(0.02)
    return sample
'''


@dataclass(frozen=True)
class Reference:
    """A source converted by the local executor (the bytes every executor must write)."""

    #: The source file.
    src: Path
    #: The ``convert`` options used (with the fault module's map function).
    options: dict[str, Any]
    #: The fault module and its markers.
    faults: Faults


class Faults:
    """The fault-injecting map function's module and its marker files, in ``directory``.

    Attributes:
        directory: Where the module and the markers are; conversions using :attr:`map_fn` are
            run with it as the current directory (every worker then finds the module).
        map_fn: The ``module:function`` to pass as ``map_fn`` (unique per instance, so that a
            process that imported another instance's module does not use it).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        module = f"fl_faults_{uuid.uuid4().hex[:12]}"
        (directory / f"{module}.py").write_text(
            _FAULTS_MODULE + f"\n\nFAULTS_DIR = {str(directory)!r}\n"
        )
        self.map_fn = f"{module}:faulty"

    def set(self, *markers: str) -> None:
        """Create the marker files ``markers``."""
        for marker in markers:
            (self.directory / marker).write_text("")

    def clear(self, *markers: str) -> None:
        """Remove the marker files ``markers`` (those that exist)."""
        for marker in markers:
            (self.directory / marker).unlink(missing_ok=True)

    def holding(self) -> list[int]:
        """The live processes waiting in the ``hold`` fault (a process killed there is not)."""
        pids = [int(p.name.split("-")[1]) for p in self.directory.glob("holding-*")]
        return [pid for pid in pids if pid_alive(pid)]

    def killed_pid(self) -> int | None:
        """The process that took the ``kill`` marker (and killed itself), if one did; resets."""
        path = self.directory / "killed"
        if not path.exists():
            return None
        text = path.read_text()
        path.unlink()
        return int(text) if text else None


def jsonl(records: int) -> bytes:
    """``records`` JSONL records of varied sizes."""
    return "".join(
        json.dumps({"i": i, "pad": "x" * (i * 7 % 97)}) + "\n" for i in range(records)
    ).encode()


def same_files(expected: Path, got: Path) -> None:
    """Assert both trees hold the same paths (no state or temporary left) with the same bytes,
    and a manifest."""
    paths = sorted(p.relative_to(expected) for p in expected.rglob("*"))
    assert sorted(p.relative_to(got) for p in got.rglob("*")) == paths
    assert "fastload.json" in {str(p) for p in paths}
    for rel in paths:
        if (expected / rel).is_file():
            assert (got / rel).read_bytes() == (expected / rel).read_bytes(), rel


def _reference_argv(src: Path, dst: Path, options: dict[str, Any]) -> list[str]:
    """The command line of the reference conversion's options (without the executor)."""
    return [str(src), str(dst), "--shard-samples", "50", "--map", options["map_fn"]]


def _objects(url: str, options: dict[str, Any]) -> dict[str, bytes]:
    store = open_store(url, **options)
    return {meta.key: store.get(meta.key) for meta in store.list("")}


def planned(tmp_path: Path, records: int) -> tuple[Source, Store, PlanStream]:
    """A JSONL file of ``records`` records in ``tmp_path``, its destination store
    ``tmp_path/out`` (with the conversion state a run writes before any shard) and its plan
    (shards of 5), not yet cut."""
    src = tmp_path / "src.jsonl"
    src.write_bytes(jsonl(records))
    source = open_source(str(src))
    layout = ShardLayout("webdataset", "tar", "shard", 5, None)
    units = source.plan_units(lambda item, reason: None)
    plan = PlanStream(units, layout, source.describe(), {"shard_samples": 5})
    dst = open_store(str(tmp_path / "out"))
    dst.put(PLAN_KEY, b"{}")
    return source, dst, plan


def check_writes_every_job(executor: Executor, tmp_path: Path, ahead: int) -> None:
    """Check that ``executor`` writes the 60 jobs of a plan of 300 records in ``tmp_path``
    with their done records, planning a job at most ``ahead`` shards ahead of the committed
    ones; shuts it down (twice: idempotent)."""
    source, dst, plan = planned(tmp_path, 300)
    done_dir = tmp_path / "out" / "_fastload_convert" / "done"
    ahead_seen: list[int] = []

    def jobs() -> Iterator[ShardJob]:
        for shard, units in plan:
            committed = len(list(done_dir.glob("*.json"))) if done_dir.is_dir() else 0
            ahead_seen.append(shard.index - committed)
            yield ShardJob(source, dst, "webdataset", shard, units, None, "raise")

    records = ShardRecords(Progress(0, 0, quiet=True))
    try:
        run_jobs(executor, jobs(), records, None)
    finally:
        executor.shutdown()
    executor.shutdown()
    assert len(plan.shards) == 60
    assert sorted(records.records) == [s.name for s in plan.shards]
    for shard in plan.shards:
        record = records.records[shard.name]
        assert record["shard_sha256"] == shard.digest
        assert record["info"]["num_samples"] == 5
        assert (tmp_path / "out" / shard.name).stat().st_size == record["info"]["num_bytes"]
    assert max(ahead_seen) <= ahead, ahead_seen


class ExecutorTests:
    """Conformance tests for one executor; subclass, set :attr:`executor`, override ``engine``."""

    #: The executor's name in :data:`fastload.convert._engines.ENGINES`.
    executor: str = ""
    #: Shards a job may be planned ahead of the committed ones (the executor's look-ahead).
    ahead: int = 4
    #: Whether a job whose process dies is run again by the engine (else the run fails with
    #: :class:`~fastload.errors.WorkerError` and a re-run resumes).
    retries_dead_workers: bool = True
    #: Whether stopping interrupts the jobs being written (else they finish their shard).
    cancels_running: bool = True
    #: The ``convert`` options that select this executor (besides ``executor``).
    options: dict[str, Any] = {}

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls) -> None:
        """The engine's runtime for the tests of the class (override to start one)."""

    def cli_options(self) -> list[str]:
        """``fastload convert`` options selecting this executor in this process's runtime."""
        return ["--executor", self.executor]

    def driver(self) -> tuple[list[str], dict[str, str]]:
        """Options and extra environment of a ``fastload convert`` in another process (a
        driver the tests kill) running on this executor."""
        return self.cli_options(), {}

    def make_executor(self, source: Store, dst: Store) -> Executor:
        """An executor for jobs converting ``source`` into ``dst``."""
        engine = ENGINES[self.executor]
        if not engine.remote:
            return Pool(2, get_format("webdataset"))
        return engine.open(None, source, dst)

    def convert(self, src: str, dst: str, **options: Any) -> Any:
        """``convert`` on this executor."""
        return convert(src, dst, executor=self.executor, **{**self.options, **options})

    # --- fixtures -------------------------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def faults(cls, engine: None, tmp_path_factory: pytest.TempPathFactory) -> Faults:
        """The fault module for the class."""
        return Faults(tmp_path_factory.mktemp("executor-faults"))

    @pytest.fixture
    def in_faults(self, faults: Faults, monkeypatch: pytest.MonkeyPatch) -> Iterator[Faults]:
        """:func:`faults`, the current directory (so workers find the module), no marker left
        behind."""
        monkeypatch.chdir(faults.directory)
        yield faults
        faults.clear("kill", "killed", "fail", "hold", "slow", "release")
        for path in faults.directory.glob("holding-*"):
            path.unlink(missing_ok=True)

    @pytest.fixture
    def reference(self, tmp_path: Path, in_faults: Faults) -> Reference:
        """A JSONL file of 600 records converted in this process into ``tmp_path/local``
        (12 shards of 50)."""
        src = tmp_path / "src.jsonl"
        src.write_bytes(jsonl(600))
        options: dict[str, Any] = {"shard_samples": 50, "map_fn": in_faults.map_fn, "quiet": True}
        convert(str(src), str(tmp_path / "local"), workers=1, **options)
        return Reference(src, options, in_faults)

    # --- the executor alone -------------------------------------------------------------------

    def test_writes_every_job_taking_them_as_it_has_room(
        self, engine: None, tmp_path: Path
    ) -> None:
        source, dst, _ = planned(tmp_path, 0)
        check_writes_every_job(self.make_executor(source.store, dst), tmp_path, self.ahead)

    def test_a_failing_plan_stops_the_run_and_keeps_what_was_committed(
        self, engine: None, tmp_path: Path
    ) -> None:
        source, dst, plan = planned(tmp_path, 100)

        def jobs() -> Iterator[ShardJob]:
            for shard, units in plan:
                if shard.index == 12:
                    raise RuntimeError("the source failed")
                yield ShardJob(source, dst, "webdataset", shard, units, None, "raise")

        records = ShardRecords(Progress(0, 0, quiet=True))
        executor = self.make_executor(source.store, dst)
        try:
            with pytest.raises(RuntimeError, match="the source failed"):
                run_jobs(executor, jobs(), records, None)
        finally:
            executor.shutdown()
        # Each shard there is committed whole, with its done record; nothing else is visible.
        written = sorted(p.name for p in (tmp_path / "out").glob("shard-*.tar"))
        recorded = sorted(
            p.name.removesuffix(".json")
            for p in (tmp_path / "out" / "_fastload_convert" / "done").glob("*.json")
        )
        assert written == recorded, (written, recorded)
        assert set(written) <= {f"shard-{n:06d}.tar" for n in range(12)}
        for name in written:
            with get_format("webdataset").reader(dst, name) as reader:
                assert len(list(reader)) == 5

    # --- conversions --------------------------------------------------------------------------

    @pytest.mark.parametrize(
        ("out_format", "layout"),
        [
            ("webdataset", {"shard_samples": 7}),
            ("webdataset", {"shard_size": "8KB"}),
            ("webdataset", {"shard_samples": 16, "shuffle": True, "seed": 3}),
            ("tfrecord", {"shard_samples": 30}),
            ("lmdb", {"shard_samples": 200}),
        ],
        ids=["samples-7", "size-8KB", "shuffled", "tfrecord", "lmdb-one-shard"],
    )
    def test_same_bytes_as_the_local_executor_for_any_partitioning(
        self, engine: None, tmp_path: Path, out_format: str, layout: dict[str, Any]
    ) -> None:
        src = tmp_path / "src.jsonl"
        src.write_bytes(jsonl(150))
        options: dict[str, Any] = {"format": out_format, "quiet": True, **layout}
        local = convert(str(src), str(tmp_path / "local"), workers=1, **options)
        got = self.convert(str(src), str(tmp_path / "got"), **options)
        assert got.num_shards == local.num_shards
        assert got.plan_sha256 == local.plan_sha256
        same_files(tmp_path / "local", tmp_path / "got")

    def test_a_worker_killed_mid_shard(
        self, engine: None, tmp_path: Path, reference: Reference
    ) -> None:
        src, options, in_faults = reference.src, reference.options, reference.faults
        in_faults.set("kill")
        if self.retries_dead_workers:
            result = self.convert(str(src), str(tmp_path / "got"), **options)
            assert result.num_shards == 12
        else:
            with pytest.raises(WorkerError, match="re-run the same command to resume"):
                self.convert(str(src), str(tmp_path / "got"), **options)
            result = self.convert(str(src), str(tmp_path / "got"), **options)
            assert result.resumed_shards < 12
        killed = in_faults.killed_pid()
        assert killed is not None, "no worker took the kill marker"
        assert killed != os.getpid()  # a worker died, not this process
        same_files(tmp_path / "local", tmp_path / "got")

    def test_a_failing_job_stops_the_run_with_its_error_and_the_cli_resumes_it(
        self, engine: None, tmp_path: Path, reference: Reference
    ) -> None:
        src, options, in_faults = reference.src, reference.options, reference.faults
        in_faults.set("fail")
        if self.cancels_running:
            in_faults.set("hold")  # shards 9-11 wait until cancelled: they cannot finish
        try:
            with pytest.raises(ConversionError, match="injected failure") as info:
                self.convert(str(src), str(tmp_path / "got"), **options)
        finally:
            in_faults.clear("hold")
        text = str(info.value) + "".join(getattr(info.value, "__notes__", ()))
        assert "shard-000008.tar" in text
        done = {p.name for p in (tmp_path / "got/_fastload_convert/done").iterdir()}
        shards = {p.name + ".json" for p in (tmp_path / "got").glob("shard-*.tar")}
        assert shards == done  # every shard there is whole and recorded
        assert "shard-000008.tar.json" not in done
        if self.cancels_running:
            assert done <= {f"shard-{n:06d}.tar.json" for n in range(8)}, done
            # The held jobs were stopped before convert returned: none still holds.
            assert in_faults.holding() == [], "a cancelled job still runs"
        assert not (tmp_path / "got/fastload.json").exists()

        in_faults.clear("fail")
        argv = _reference_argv(src, tmp_path / "got", options)
        assert main(["convert", *argv, "-q", *self.cli_options()]) == 0
        same_files(tmp_path / "local", tmp_path / "got")

    def test_a_killed_driver_leaves_committed_shards_that_a_rerun_resumes(
        self, engine: None, tmp_path: Path, reference: Reference
    ) -> None:
        src, options, in_faults = reference.src, reference.options, reference.faults
        in_faults.set("slow")  # 1 s per shard: the driver is killed half way
        cli, env = self.driver()
        argv = _reference_argv(src, tmp_path / "got", options)
        driver = subprocess.Popen(
            [sys.executable, "-m", "fastload.cli", "convert", *argv, "-q", *cli],
            env={**os.environ, **env},
        )
        done = tmp_path / "got/_fastload_convert/done"
        try:
            deadline = time.monotonic() + 240
            while len(list(done.glob("*.json")) if done.is_dir() else []) < 3:
                assert driver.poll() is None, "the driver ended before it was killed"
                assert time.monotonic() < deadline, "the driver committed no 3 shards in 240 s"
                time.sleep(0.05)
        finally:
            driver.send_signal(signal.SIGKILL)
            driver.wait()
        in_faults.clear("slow")
        assert not (tmp_path / "got/fastload.json").exists()

        result = self.convert(str(src), str(tmp_path / "got"), **options)
        assert 3 <= result.resumed_shards < result.num_shards == 12
        same_files(tmp_path / "local", tmp_path / "got")

    def test_on_an_object_store_with_a_worker_killed(
        self, engine: None, in_faults: Faults, request: pytest.FixtureRequest
    ) -> None:
        ceph = request.getfixturevalue("ceph_s3")
        root = f"s3://{request.getfixturevalue('s3_bucket')}"
        self._check_on_a_shared_store(in_faults, root, ceph.store_options())

    def test_on_hdfs_with_a_worker_killed(
        self, engine: None, in_faults: Faults, request: pytest.FixtureRequest
    ) -> None:
        from fastload.testing.hdfs import scratch_url

        root = scratch_url(request.getfixturevalue("hdfs_cluster"), f"executor-{self.executor}")
        self._check_on_a_shared_store(in_faults, root, {})

    def _check_on_a_shared_store(
        self, in_faults: Faults, root: str, store_options: dict[str, Any]
    ) -> None:
        """Convert 1,000 records from ``root/in`` into ``root/got`` (20 shards), a worker
        killed mid-shard where the engine retries, and compare every object with the local
        executor's conversion into ``root/local``."""
        open_store(f"{root}/in", **store_options).put("src.jsonl", jsonl(1000))
        options: dict[str, Any] = {
            "shard_samples": 50,
            "map_fn": in_faults.map_fn,
            "quiet": True,
            "store_options": store_options,
            "source_options": store_options,
        }
        convert(f"{root}/in", f"{root}/local", workers=1, **options)
        if self.retries_dead_workers:
            in_faults.set("kill")
        result = self.convert(f"{root}/in", f"{root}/got", **options)
        if self.retries_dead_workers:
            killed = in_faults.killed_pid()
            assert killed is not None, "no worker took the kill marker"
            assert killed != os.getpid()
        assert result.num_shards == 20
        expected = _objects(f"{root}/local", store_options)
        got = _objects(f"{root}/got", store_options)
        assert "fastload.json" in expected
        assert sorted(got) == sorted(expected)  # no conversion state or temporary left
        for key, data in expected.items():
            assert got[key] == data, key

    def test_memory_stores_are_refused_by_cluster_engines(
        self, engine: None, tmp_path: Path
    ) -> None:
        src = tmp_path / "src.jsonl"
        src.write_bytes(jsonl(10))
        if not ENGINES[self.executor].remote:  # the local executor writes them in-process
            result = self.convert(str(src), f"memory://local-{uuid.uuid4().hex}", quiet=True)
            assert result.num_samples == 10
            return
        with pytest.raises(
            InvalidArgumentError, match="lives in the converting process \\(a memory:// store\\)"
        ):
            self.convert(str(src), "memory://cluster-out", quiet=True)
