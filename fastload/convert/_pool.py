"""Running shard jobs: in the converting process, or in a pool of worker processes.

:func:`run_jobs` writes a conversion's remaining shards, feeding their done records to a
:class:`ShardRecords` (and its progress line) as they come. One job, or no pool, runs in this
process (:func:`fastload.convert._worker.write_shards`). Otherwise :class:`Pool`'s workers each
run :func:`fastload.convert._worker.run_worker`, which takes jobs from a shared queue in plan
order; the first failure stops them all after the shard each is writing. The jobs are made (their
units enumerated) as the queue drains, a few per worker ahead, so the converting process holds a
few shards' units at a time, never the whole plan's.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import sys
import threading
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from fastload.convert import _worker
from fastload.convert._map import MapFn
from fastload.convert._progress import Progress, plural
from fastload.convert._worker import Counters, ShardJob
from fastload.errors import InvalidArgumentError, WorkerError
from fastload.formats import Format, get_format

__all__ = ["Pool", "ShardRecords", "pool_context", "run_jobs", "starts_before_planning"]


class ShardRecords:
    """The done records of a conversion's shards by name, and the progress line they feed.

    Args:
        records: The records of the shards already done (from an earlier run); filled in place.
        progress: The progress line, which counts these shards as done from the start.
    """

    def __init__(self, records: dict[str, dict[str, Any]], progress: Progress) -> None:
        self.records = records
        self.progress = progress
        self.base_samples = sum(r["info"]["num_samples"] for r in records.values())
        self.base_bytes = sum(r["info"]["num_bytes"] for r in records.values())
        progress.update(self.base_samples, self.base_bytes)

    def add(self, record: dict[str, Any]) -> None:
        """Record a shard just committed."""
        self.records[record["shard"]] = record

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


class Pool:
    """Worker processes for shard jobs (see :func:`pool_context` for the start method; a
    forkserver preloads the conversion and format writer modules).

    Each worker runs one long task, :func:`fastload.convert._worker.run_worker`, which takes
    pickled jobs from a shared queue in plan order (so faster workers take more shards) and
    commits each shard while it writes the next. Forked workers start with the parent's objects frozen (``gc.freeze``), so their
    garbage collector does not touch, and so copy, the parent's heap (e.g. the plan).
    """

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


def run_jobs(
    pool: Pool | None,
    jobs: Iterable[ShardJob],
    count: int,
    done: ShardRecords,
    map_fn: str | MapFn | None,
) -> None:
    """Write the shards of the ``count`` ``jobs`` (made as they are taken), in ``pool`` when there
    is one and more than one job."""
    if pool is None or count <= 1:
        _run_in_process(jobs, done)
        return
    if map_fn is not None and not isinstance(map_fn, str):
        _check_picklable(map_fn)
    _run_pool(pool, jobs, done)


def _check_picklable(map_fn: MapFn) -> None:
    try:
        pickle.dumps(map_fn)
    except Exception as exc:
        raise InvalidArgumentError(
            f"map_fn {map_fn!r} cannot be sent to worker processes ({exc}); pass a module-level "
            "function or its name as 'module:function', or use workers=1"
        ) from exc


def _run_in_process(jobs: Iterable[ShardJob], done: ShardRecords) -> None:
    counters = Counters()
    with _worker.counting(counters):
        for record in _worker.write_shards(iter(jobs), lambda: done.show(counters)):
            done.add(record)


def _run_pool(pool: Pool, jobs: Iterable[ShardJob], done: ShardRecords) -> None:
    feed = iter(jobs)
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
