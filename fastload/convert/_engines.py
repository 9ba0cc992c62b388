"""The engines that write a conversion's shards, by name (``convert(..., executor=NAME)``), and
the shared part of the cluster engines' executors.

:data:`ENGINES` is the one place executor names live: ``convert`` checks ``executor`` against it,
``--executor`` takes its names and help from it, and the executor conformance suite
(:mod:`fastload.testing.executors`) runs each. ``local`` is this machine's pool
(:mod:`fastload.convert._pool`); a cluster engine (Ray, Spark) is a :class:`TaskExecutor`: every
job is pickled in the converting process and written by one task of the engine with
:func:`write_shipped_job`, at most :attr:`TaskExecutor.slots` tasks outstanding.
"""

from __future__ import annotations

import importlib
import pickle
import socket
from abc import abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from fastload.convert import _worker
from fastload.convert._pool import Executor, InProcess, Pool, ShardRecords, starts_before_planning
from fastload.convert._state import PLAN_KEY
from fastload.convert._worker import Counters, ShardJob
from fastload.errors import InvalidArgumentError, MissingDependencyError
from fastload.formats import Format
from fastload.storage import Store

__all__ = [
    "ENGINES",
    "Engine",
    "ExecutorChoice",
    "TaskExecutor",
    "get_engine",
    "import_engine",
    "write_shipped_job",
]


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
            if not store.shared_across_processes:
                raise InvalidArgumentError(
                    f"executor={self.name!r} (--executor {self.name}) cannot use {store.url}: "
                    f"it lives in the converting process (a memory:// store), out of the "
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


class ExecutorChoice:
    """Which executor writes a conversion's shards, decided once from the options and the
    capabilities of the stores and the executors, and started when it pays off.

    Shards are written in parallel unless this is a dry run, or (for the local engine) there is
    one worker or a store that other processes cannot see (``shared_across_processes``: a
    ``memory://`` store); a cluster engine always runs its tasks. :meth:`start_early` starts,
    before planning, what gains from it: a cluster engine's executor, or a pool whose workers
    import while the plan is made (forkserver, :func:`~fastload.convert._pool.
    starts_before_planning`). :meth:`runner` gives the executor for the jobs once the first two
    are planned: a single job is written in this process (:class:`InProcess`) unless the
    executor runs single jobs too (:attr:`Executor.runs_single_job`: a cluster engine's task).
    :meth:`stop_now` and :meth:`shutdown` stop what was started.

    Args:
        engine: The engine (``executor=``).
        workers: Local worker processes.
        address: The cluster engine's address option (``ray_address``, ``spark_master``).
        fmt: The output format (a forkserver preloads its writer).
        source: The source's store.
        dst: The destination store.
        dry_run: Nothing is written.
    """

    def __init__(
        self,
        engine: Engine,
        workers: int,
        address: str | None,
        fmt: Format,
        source: Store,
        dst: Store,
        dry_run: bool,
    ) -> None:
        self.engine, self.workers, self.address, self.fmt = engine, workers, address, fmt
        self.source, self.dst = source, dst
        self.parallel = not dry_run and (
            engine.remote  # which refuses stores other processes cannot see
            or (workers > 1 and dst.shared_across_processes and source.shared_across_processes)
        )
        #: The executor started (to stop when the conversion ends), or None.
        self.started: Executor | None = None

    def start_early(self) -> None:
        """Start, before planning, the executor that gains from it (see the class docstring)."""
        if self.parallel and (self.engine.remote or starts_before_planning()):
            self._start()

    def runner(self, several: bool) -> Executor:
        """The executor for the jobs, ``several`` of them or one (see the class docstring)."""
        if several and self.started is None and self.parallel:
            self._start()
        if self.started is not None and (several or self.started.runs_single_job):
            return self.started
        return InProcess()

    def _start(self) -> None:
        """Start the engine's executor: a cluster engine's, else this machine's pool."""
        if self.engine.remote:
            self.started = self.engine.open(self.address, self.source, self.dst)
        else:
            self.started = Pool(self.workers, self.fmt)

    @property
    def interrupt_notice(self) -> str | None:
        """What the started executor's jobs do on a first Ctrl-C (:attr:`Executor.
        interrupt_notice`), or None."""
        return self.started.interrupt_notice if self.started is not None else None

    def stop_now(self) -> None:
        """Have the started executor abort its shards (a second Ctrl-C): only sets a flag."""
        if self.started is not None:
            self.started.stop_now()

    def shutdown(self) -> None:
        """Stop the started executor and wait for its jobs: their writers are done after it."""
        if self.started is not None:
            self.started.shutdown()
