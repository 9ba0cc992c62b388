"""Running shard jobs: the :class:`Executor` interface, in this process or in worker processes.

An :class:`Executor` writes a conversion's shard jobs and feeds their done records to a
:class:`ShardRecords` (and its progress line) as they are committed. The jobs come from an
iterator that plans them as it is advanced (the converting process enumerates the source and
cuts the next shard when a job is taken), so an executor takes a job only when it has room for
it: :class:`InProcess` one at a time (:func:`fastload.convert._worker.write_shards`), the
:class:`Pool` a few per worker ahead of the shards being written. The converting process thus
holds a few shards' units at a time, never the whole plan's, and the first shards are written
while the source is still being enumerated. :func:`run_jobs` runs them with the executor given.

:class:`Pool`'s workers each run :func:`fastload.convert._worker.run_worker`, which takes jobs
from a shared queue in plan order; the first failure stops them all after the shard each is
writing. Another engine (a cluster's tasks) is another :class:`Executor`: it must write each job's
shard with :func:`fastload.convert._worker.write_shards` (the shard, its index, then its done
record), report the records and progress, and stop on :meth:`Executor.shutdown`.
"""

from __future__ import annotations

import gc
import importlib
import multiprocessing
import os
import pickle
import socket
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from fastload.convert import _worker
from fastload.convert._map import MapFn
from fastload.convert._progress import Progress, plural
from fastload.convert._state import PLAN_KEY
from fastload.convert._worker import Counters, ShardJob
from fastload.errors import InvalidArgumentError, MissingDependencyError, WorkerError
from fastload.formats import Format, get_format
from fastload.storage import MemoryStore, Store

__all__ = [
    "ENGINES",
    "Engine",
    "Executor",
    "InProcess",
    "Pool",
    "ShardRecords",
    "TaskExecutor",
    "get_engine",
    "import_engine",
    "pool_context",
    "run_jobs",
    "starts_before_planning",
    "write_shipped_job",
]


class ShardRecords:
    """The done records of a conversion's shards by name, and the progress line they feed.

    Args:
        progress: The progress line.
    """

    def __init__(self, progress: Progress) -> None:
        self.records: dict[str, dict[str, Any]] = {}
        self.progress = progress
        #: Shards kept from an earlier run.
        self.resumed = 0
        self.base_samples = self.base_bytes = 0

    def add(self, record: dict[str, Any]) -> None:
        """Record a shard just committed."""
        self.records[record["shard"]] = record

    def keep(self, record: dict[str, Any]) -> None:
        """Record a shard an earlier run committed (counted as done from now on)."""
        self.records[record["shard"]] = record
        self.resumed += 1
        self.base_samples += record["info"]["num_samples"]
        self.base_bytes += record["info"]["num_bytes"]

    def show(self, counters: Counters) -> None:
        """Update the progress line with what the running jobs have written so far."""
        samples, nbytes = counters.totals()
        self.progress.update(self.base_samples + samples, self.base_bytes + nbytes)


#: Jobs queued ahead of the workers, per worker: enough that none waits for the next shard's units
#: to be enumerated, few enough that the queue holds a few shards, not the plan.
_QUEUED_PER_WORKER = 2


def pool_context() -> multiprocessing.context.BaseContext:
    """The start method for worker processes.

    ``fork`` when this process runs a single Python thread (workers then start at once, import
    nothing and inherit no lock another thread could hold); otherwise ``forkserver`` (``spawn``
    where there is none), which re-imports the main script in each worker, so scripts must call
    :func:`convert` under ``if __name__ == "__main__":``. A main script that is not a file
    (``python - < script``) cannot be re-imported, so then fork is used anyway.
    """
    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods:
        main_file = getattr(sys.modules.get("__main__"), "__file__", None)
        if threading.active_count() == 1 or (
            main_file is not None and not os.path.isfile(main_file)
        ):
            return multiprocessing.get_context("fork")
    return multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")


def starts_before_planning() -> bool:
    """Whether a pool should be started before planning: workers that import fastload
    (forkserver, spawn) then import while the converting process plans. Forked workers start when
    the jobs are known: forking costs little, and forked children would slow the planning
    (copy-on-write faults, CPU)."""
    return pool_context().get_start_method() != "fork"


class Executor(ABC):
    """Runs shard jobs: what a conversion needs from the engine that writes its shards.

    Every executor writes the same bytes: a shard's content depends only on its job.
    """

    #: Whether jobs are pickled to other processes (then a ``map_fn`` must be picklable).
    ships_jobs = False

    @abstractmethod
    def run(self, jobs: Iterator[ShardJob], done: ShardRecords) -> None:
        """Write the shard of every job of ``jobs`` and return when all are committed.

        ``jobs`` is advanced in the calling thread, in plan order, and only when there is room
        for another job (advancing it plans the next shard: it may enumerate the source, and
        may raise). Each done record goes to ``done.add`` as its shard is committed, and the
        progress line is updated meanwhile (:meth:`ShardRecords.show`). On the first failure
        (of a job, or of ``jobs``) the jobs being written are stopped after their shard and the
        error is raised; committed shards stay (a re-run resumes).
        """

    @abstractmethod
    def shutdown(self) -> None:
        """Cancel: stop after the shards being written (and committed), and wait for that.
        Idempotent; the executor runs nothing afterwards."""


@dataclass(frozen=True)
class Engine:
    """An engine that ``convert(..., executor=NAME)`` (``--executor NAME``) can write shards with.

    ``local`` is this machine's :class:`Pool` (or :class:`InProcess`), chosen by ``convert`` from
    ``workers`` and the job count. A cluster engine is an :class:`Executor` class, imported when
    it is first used, constructed as ``cls(address, source, dst)``, started before planning and
    used for every job, even a single one: its tasks run in other processes, maybe on other
    machines, so it refuses ``memory://`` stores and ignores ``workers``.
    """

    #: The name ``executor=`` and ``--executor`` take.
    name: str
    #: ``"module:Class"`` of a cluster engine's :class:`Executor`; ``None`` for ``local``.
    target: str | None = None
    #: The ``convert`` keyword naming the cluster (``ray_address``), if the engine takes one.
    address_option: str | None = None
    #: One line for ``--executor``'s help.
    summary: str = ""

    @property
    def remote(self) -> bool:
        """Whether jobs run as an engine's tasks (not this machine's worker processes)."""
        return self.target is not None

    def open(self, address: str | None, source: Store, dst: Store) -> Executor:
        """Construct this cluster engine's executor for a conversion of ``source`` into
        ``dst`` (see the class docstring).

        Raises:
            InvalidArgumentError: A store is a ``memory://`` store, or the engine's package is
                missing or its cluster unreachable (raised by the executor, saying which).
        """
        if self.target is None:
            raise InvalidArgumentError(f"executor {self.name!r} is not a cluster engine")
        for store in (source, dst):
            if isinstance(store, MemoryStore):
                raise InvalidArgumentError(
                    f"executor={self.name!r} (--executor {self.name}) cannot use {store.url}: "
                    f"a memory:// store lives in the converting process, out of the "
                    f"{self.name} tasks' reach; use a directory or an object store, or the "
                    "local executor"
                )
        module, _, attr = self.target.partition(":")
        cls = getattr(importlib.import_module(module), attr)
        executor: Executor = cls(address, source, dst)
        return executor


#: The engines by name: the one place ``executor=`` values are defined (``convert`` checks
#: against it, ``--executor`` takes its names, the executor conformance suite runs each).
ENGINES: dict[str, Engine] = {
    e.name: e
    for e in (
        Engine("local", summary="this machine's --workers processes (default)"),
        Engine(
            "ray",
            "fastload.convert._ray:RayExecutor",
            "ray_address",
            "one Ray task per shard (needs fastload[ray])",
        ),
        Engine(
            "spark",
            "fastload.convert._spark:SparkExecutor",
            "spark_master",
            "one Spark task per shard (needs fastload[spark] and Java 17+)",
        ),
    )
}


def get_engine(name: str) -> Engine:
    """The engine registered as ``name``.

    Raises:
        InvalidArgumentError: No engine has that name (the message lists them).
    """
    try:
        return ENGINES[name]
    except (KeyError, TypeError):
        raise InvalidArgumentError(
            f"executor (--executor) must be one of {tuple(ENGINES)}, not {name!r}"
        ) from None


class TaskExecutor(Executor):
    """The shared part of the cluster engines' executors: each job is pickled here and written
    by one task of the engine (:func:`write_shipped_job`), which returns its done record.

    :meth:`run` keeps at most :attr:`slots` tasks submitted and not yet finished, taking the
    next job (planning it) only then, so the driver holds a few shards' units, never the plan's;
    the first failure (of a task, of the plan, or Ctrl-C) cancels the outstanding tasks. An
    engine implements five small methods: :meth:`submit`, :meth:`finished`, :meth:`result`,
    :meth:`cancel` and :meth:`close`.
    """

    ships_jobs = True

    def __init__(self, slots: int) -> None:
        #: Tasks submitted and not yet finished, at most.
        self.slots = max(1, slots)
        self._outstanding: dict[Any, str] = {}  # task handle -> its shard's name
        self._shut = False

    @abstractmethod
    def submit(self, data: bytes, name: str) -> Any:
        """Start a task writing the pickled job ``data`` (shard ``name``); its handle."""

    @abstractmethod
    def finished(self, handles: list[Any], timeout: float) -> list[Any]:
        """Those of ``handles`` that have finished, waiting up to ``timeout`` s for one."""

    @abstractmethod
    def result(self, handle: Any, name: str) -> dict[str, Any]:
        """A finished task's done record; or raise its error: the task's own exception (with a
        note naming shard ``name``), or :class:`~fastload.errors.WorkerError` when the engine
        gave up on it (its process died more often than the engine retries)."""

    @abstractmethod
    def cancel(self, handles: list[Any]) -> None:
        """Cancel the tasks ``handles`` (interrupting running ones: a shard being written is
        aborted, nothing partial is visible) and wait for them to end."""

    @abstractmethod
    def close(self) -> None:
        """Release the engine (stop a runtime the executor started). Called once, last."""

    def run(self, jobs: Iterator[ShardJob], done: ShardRecords) -> None:
        try:
            self._run(jobs, done)
        except BaseException:
            self.shutdown()
            raise

    def _run(self, jobs: Iterator[ShardJob], done: ShardRecords) -> None:
        counters = Counters()
        feeding = True
        while True:
            while feeding and len(self._outstanding) < self.slots:
                job = next(jobs, None)
                if job is None:
                    feeding = False
                    break
                data = pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)
                self._outstanding[self.submit(data, job.shard.name)] = job.shard.name
            if not self._outstanding:
                return
            for handle in self.finished(list(self._outstanding), timeout=0.5):
                record = self.result(handle, self._outstanding.pop(handle))
                done.add(record)
                counters.add(record["info"]["num_samples"], record["info"]["num_bytes"])
            done.show(counters)

    def shutdown(self) -> None:
        """Cancel the outstanding tasks and wait for them to end (see :meth:`cancel`), then
        :meth:`close`. Idempotent."""
        if self._shut:
            return
        self._shut = True
        handles = list(self._outstanding)
        self._outstanding.clear()
        try:
            if handles:
                self.cancel(handles)
        finally:
            self.close()


def import_engine(module: str, engine: Engine) -> Any:
    """Import a cluster engine's package (``ray``, ``pyspark``).

    Raises:
        MissingDependencyError: It is not installed; the message gives the ``pip install``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(
            f"executor={engine.name!r} (--executor {engine.name}) needs the {module} package "
            f"({exc}); install it with: pip install 'fastload[{engine.name}]'"
        ) from exc


def write_shipped_job(data: bytes, engine: str) -> dict[str, Any]:
    """A cluster engine's task: write and commit the shard of one pickled :class:`ShardJob`
    (pickled by the converting process); return its done record. Idempotent: run again (a
    retry after its process died), it writes the same bytes over nothing visible.

    Args:
        data: The pickled job.
        engine: The engine's name, for the message below (``Ray``, ``Spark``).

    Raises:
        InvalidArgumentError: The destination's conversion state (written by the converting
            process before any shard) is not visible here: a local directory not shared with
            this node.
    """
    job: ShardJob = pickle.loads(data)  # pickled by the converting process, as for the pool
    if not job.dst.exists(PLAN_KEY):
        raise InvalidArgumentError(
            f"the {engine} task writing shard {job.shard.name} on host {socket.gethostname()} "
            f"does not see {job.dst.child_url(PLAN_KEY)}, which the converting process wrote "
            f"before any shard: under {engine} a local destination (and source) must be on a "
            f"file system every {engine} node mounts at the same path (e.g. NFS); or convert "
            "to an object store (s3://) or HDFS (hdfs://)"
        )
    return _worker.write_shards(iter([job]))[0]


class InProcess(Executor):
    """Writes the jobs one after the other in the calling process (a commit thread overlaps
    each shard's commit with the next shard's writing)."""

    def run(self, jobs: Iterator[ShardJob], done: ShardRecords) -> None:
        counters = Counters()
        with _worker.counting(counters):
            for record in _worker.write_shards(jobs, lambda: done.show(counters)):
                done.add(record)

    def shutdown(self) -> None:
        """Nothing to stop: the jobs run in the caller's thread."""


class Pool(Executor):
    """Worker processes for shard jobs (see :func:`pool_context` for the start method; a
    forkserver preloads the conversion and format writer modules).

    Each worker runs one long task, :func:`fastload.convert._worker.run_worker`, which takes
    pickled jobs from a shared queue in plan order (so faster workers take more shards) and
    commits each shard while it writes the next. Forked workers start with the parent's objects frozen (``gc.freeze``), so their
    garbage collector does not touch, and so copy, the parent's heap (e.g. the plan).
    """

    ships_jobs = True

    def __init__(self, n_workers: int, fmt: Format) -> None:
        ctx = pool_context()
        if ctx.get_start_method() == "forkserver":
            # Only takes effect if this process's forkserver is not running yet.
            ctx.set_forkserver_preload([_worker.__name__, fmt.writer.__module__])
        self.n_workers = n_workers
        self.samples, self.nbytes = ctx.Value("q", 0), ctx.Value("q", 0)
        self.counters = Counters(self.samples, self.nbytes)
        self.jobs: Any = ctx.Queue()
        # Jobs left in the queue when the workers stop are dropped, not waited for.
        self.jobs.cancel_join_thread()
        self.taken: Any = ctx.Value("q", 0)
        self.stop: Any = ctx.Value("b", 0)
        self._shut = False
        self.executor = ProcessPoolExecutor(
            max_workers=n_workers,
            mp_context=ctx,
            initializer=_worker.init_worker,
            initargs=(self.samples, self.nbytes, self.jobs, self.taken, self.stop, os.getpid()),
        )
        forking = ctx.get_start_method() == "fork"
        if forking:
            gc.freeze()
        try:
            for _ in range(n_workers):  # the first submit forks them all; else one per submit
                self.executor.submit(get_format, fmt.name)
        finally:
            if forking:
                gc.unfreeze()

    def end_jobs(self) -> None:
        """Queue an end marker per worker: each stops when it reaches one."""
        for _ in range(self.n_workers):
            self.jobs.put(None)

    def shutdown(self) -> None:
        """Stop the workers after the shard each is writing (and committing), and wait for them
        (once; later calls do nothing)."""
        if self._shut:
            return
        self._shut = True
        self.stop.value = 1
        self.end_jobs()  # wakes the workers waiting for a job that will not come
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.jobs.close()

    def run(self, jobs: Iterator[ShardJob], done: ShardRecords) -> None:
        _run_pool(self, jobs, done)


def run_jobs(
    executor: Executor, jobs: Iterable[ShardJob], done: ShardRecords, map_fn: str | MapFn | None
) -> None:
    """Write the shards of ``jobs`` (planned as they are taken) with ``executor``."""
    if executor.ships_jobs and map_fn is not None and not isinstance(map_fn, str):
        _check_picklable(map_fn)
    executor.run(iter(jobs), done)


def _check_picklable(map_fn: MapFn) -> None:
    try:
        pickle.dumps(map_fn)
    except Exception as exc:
        raise InvalidArgumentError(
            f"map_fn {map_fn!r} cannot be sent to worker processes ({exc}); pass a module-level "
            "function or its name as 'module:function', or use workers=1"
        ) from exc


def _run_pool(pool: Pool, feed: Iterator[ShardJob], done: ShardRecords) -> None:
    fed: list[str] = []  # the names of the shards queued

    def top_up() -> bool:
        """Queue jobs until a few per worker wait; whether more are to come."""
        while len(fed) - pool.taken.value < pool.n_workers * _QUEUED_PER_WORKER:
            job = next(feed, None)
            if job is None:
                pool.end_jobs()
                return False
            # Pickled here, so that an unpicklable job fails now (the queue would pickle it in
            # a thread).
            pool.jobs.put(pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL))
            fed.append(job.shard.name)
        return True

    pending = {pool.executor.submit(_worker.run_worker) for _ in range(pool.n_workers)}
    feeding = top_up()
    failure: BaseException | None = None
    while pending:
        # While jobs are still to come, look at the queue often enough to keep it topped up.
        timeout = 0.02 if feeding else 0.5
        finished, pending = wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)
        for fut in finished:
            exc = fut.exception()
            if isinstance(exc, BrokenProcessPool):
                exc = WorkerError(
                    f"a conversion worker process died ({exc}); it may have run out of memory or "
                    "been killed. Finished shards are kept: re-run the same command to resume "
                    "(workers=1 runs in this process). When calling fastload.convert from a "
                    "script, call it under `if __name__ == '__main__':`"
                )
            if exc is not None:
                failure = failure or exc
                continue
            for record in fut.result():
                done.add(record)
        if failure is not None:
            pool.shutdown()
            raise failure
        done.show(pool.counters)
        if feeding:
            feeding = top_up()
    missing = [name for name in fed if name not in done.records]
    if missing:  # cannot happen unless a worker lost jobs; never write a manifest without them
        raise WorkerError(
            f"conversion workers finished without writing {plural(len(missing), 'shard')} (first: "
            f"{missing[0]}); re-run the same command to resume"
        )
