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
writing. Another engine (a cluster's tasks) is another :class:`Executor`, registered by name in
:mod:`fastload.convert._engines` (Ray and Spark there share its :class:`TaskExecutor` loop).
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from fastload.convert import _worker
from fastload.convert._map import MapFn
from fastload.convert._progress import Progress, plural
from fastload.convert._worker import Counters, ShardJob
from fastload.errors import InvalidArgumentError, WorkerError
from fastload.formats import Format, get_format

__all__ = [
    "Executor",
    "InProcess",
    "Pool",
    "ShardRecords",
    "pool_context",
    "run_jobs",
    "starts_before_planning",
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
#: After a second Ctrl-C, how long a worker may take to abort its shard (it looks at the stop
#: flag before each sample) before it is killed.
STOP_GRACE = 3.0


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
    #: Whether a conversion of a single shard uses this executor too (a cluster engine's task);
    #: an executor that is not worth one shard (this machine's pool) leaves it to
    #: :class:`InProcess`.
    runs_single_job = True
    #: What the shards being written become on a first Ctrl-C, told to the user before the
    #: conversion waits for them; None: nothing worth telling.
    interrupt_notice: str | None = None

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

    def stop_now(self) -> None:
        """Ask a :meth:`shutdown` under way (or to come) to abort the shards being written
        instead of finishing them (a second Ctrl-C). Called from a signal handler: sets a flag
        and returns. Executors that cannot abort a shard any faster do nothing."""


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
    runs_single_job = False
    interrupt_notice = (
        "the workers finish the shards they are writing (Ctrl-C again to stop at once; those "
        "shards are then written again by a re-run)"
    )

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
        #: The workers' long tasks (:func:`fastload.convert._worker.run_worker`), once started.
        self.tasks: set[Future[list[dict[str, Any]]]] = set()
        self._stop_now_at: float | None = None
        self._shut = False
        self.executor = ProcessPoolExecutor(
            max_workers=n_workers,
            mp_context=ctx,
            initializer=_init_worker,
            initargs=(
                dict(os.environ),
                (self.samples, self.nbytes, self.jobs, self.taken, self.stop, os.getpid()),
            ),
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

    def stop_now(self) -> None:
        # The flag's value without its lock: a signal handler must not wait for a lock its
        # thread may hold (a byte store; the workers read it before each sample).
        self.stop.get_obj().value = _worker.STOP_NOW
        if self._stop_now_at is None:
            self._stop_now_at = time.monotonic()

    def shutdown(self) -> None:
        """Stop the workers after the shard each is writing (and committing), and wait for them
        (once; later calls do nothing).

        After :meth:`stop_now` (a second Ctrl-C), before or during the wait, the workers abort
        their shards instead (they look at the stop flag before each sample; an aborted shard
        leaves nothing visible, the re-run writes it), and those still busy
        :data:`STOP_GRACE` seconds later (a map function slow on one sample) are killed.
        A ``KeyboardInterrupt`` during the wait is taken as :meth:`stop_now` (where
        :func:`~fastload._os.interrupts_escalate` is not in force).

        This returns only when the executor's own shutdown has finished: a process that exits
        while it is still under way has closed the queue that gives the workers their end
        markers first, and waits for them forever.
        """
        if self._shut:
            return
        self._shut = True
        with self.stop.get_lock():
            self.stop.value = max(self.stop.value, _worker.STOP_AFTER_SHARD)
        self.end_jobs()  # wakes the workers waiting for a job that will not come
        while True:
            try:
                busy = [task for task in self.tasks if not task.done()]
                if busy and not self._past_grace():
                    wait(busy, timeout=0.05)
                    continue
                if busy:
                    # ProcessPoolExecutor has no public way to stop its processes.
                    for pid in list(getattr(self.executor, "_processes", None) or {}):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                self.executor.shutdown(wait=True, cancel_futures=True)
                break
            except KeyboardInterrupt:
                self.stop_now()
        self.jobs.close()

    def _past_grace(self) -> bool:
        return self._stop_now_at is not None and time.monotonic() > self._stop_now_at + STOP_GRACE

    def run(self, jobs: Iterator[ShardJob], done: ShardRecords) -> None:
        _run_pool(self, jobs, done)


def _init_worker(environ: dict[str, str], args: tuple[Any, ...]) -> None:
    """A worker's initializer: the converting process's environment as it is now (a forkserver
    started by an earlier conversion keeps the environment of its start, which its children would
    inherit), then :func:`fastload.convert._worker.init_worker`."""
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    _worker.init_worker(*args)


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
    pool.tasks = set(pending)
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
