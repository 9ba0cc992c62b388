"""Running shard jobs as Ray tasks: :class:`RayExecutor` (``convert(..., executor="ray")``).

Each planned shard's :class:`~fastload.convert._worker.ShardJob` (one shard's units, the source
and destination stores as URLs and options, never live clients) is pickled in the converting
process and written by one Ray task, :func:`write_job`, which writes the shard, commits it (the
store's atomic commit, then the index, then the done record) and returns the done record. A
shard's bytes depend only on its job, so the output is byte-identical to the local pool's
whatever the number of Ray workers, and a task that Ray retries (its worker died: up to
:data:`RAY_RETRIES` times) writes the same bytes again over nothing visible (an interrupted
writer leaves only a temporary file or an unfinished upload, which the next run removes).

The converting process plans as the tasks complete: at most :data:`IN_FLIGHT_PER_CPU` tasks per
CPU of the Ray cluster are submitted and not yet finished, so the driver holds a few shards'
units, never the plan's. The first failed task (or a failing plan, or Ctrl-C) cancels the
outstanding tasks (Ray interrupts a running one: its shard is aborted, nothing partial is visible)
and raises the task's own error; committed shards stay, and the same command resumes.

Stores must be reachable from every Ray node: object stores (``s3://``) are; a local directory
(source or destination) must be on a file system that every node mounts at the same path (on
one machine it is). A task that cannot see the state the driver wrote first raises
:class:`~fastload.errors.InvalidArgumentError` saying so.
"""

from __future__ import annotations

import contextlib
import pickle
import socket
from collections.abc import Iterator
from typing import Any

from fastload.convert._pool import Executor, ShardRecords
from fastload.convert._state import PLAN_KEY
from fastload.convert._worker import Counters, ShardJob, write_shards
from fastload.errors import InvalidArgumentError, WorkerError
from fastload.storage import MemoryStore, Store

__all__ = ["IN_FLIGHT_PER_CPU", "RAY_RETRIES", "RayExecutor", "write_job"]

#: How often Ray re-runs a task whose worker process died (killed, out of memory). An error the
#: task raises (a bad input item, a full disk) is not retried: it fails the conversion.
RAY_RETRIES = 3
#: Tasks submitted and not yet finished, per CPU of the cluster: one running, one waiting, so no
#: CPU idles while the driver plans the next shard.
IN_FLIGHT_PER_CPU = 2

_INSTALL = "install it with: pip install 'fastload[ray]'"


def write_job(data: bytes) -> dict[str, Any]:
    """A Ray task: write and commit the shard of one pickled :class:`ShardJob` (pickled by the
    converting process); return its done record. Idempotent: run again, it writes the same
    bytes.

    Raises:
        InvalidArgumentError: The destination's conversion state (written by the driver before
            any shard) is not visible here: a local directory not shared with this node.
    """
    job: ShardJob = pickle.loads(data)  # pickled by the converting process, as for the pool
    if not job.dst.exists(PLAN_KEY):
        raise InvalidArgumentError(
            f"the Ray task writing shard {job.shard.name} on host {socket.gethostname()} does not "
            f"see {job.dst.child_url(PLAN_KEY)}, which the converting process wrote before any "
            "shard: under Ray a local destination (and source) must be on a file system every "
            "Ray node mounts at the same path (e.g. NFS); or convert to an object store (s3://)"
        )
    return write_shards(iter([job]))[0]


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise InvalidArgumentError(
            f"executor='ray' (--executor ray) needs the ray package ({exc}); {_INSTALL}"
        ) from exc
    return ray


class RayExecutor(Executor):
    """Writes each shard job as a Ray task (see the module docstring).

    Args:
        address: The Ray cluster to use when this process has not called ``ray.init`` yet:
            ``"auto"``, ``"ray://host:10001"``, ``"host:6379"``; ``None`` connects to the
            cluster that ``RAY_ADDRESS`` names, else starts a local one. A runtime started here
            is shut down by :meth:`shutdown`; one the caller started is left running.
        source: The source's store; with ``dst``, refused if it lives in this process.
        dst: The destination store.

    Raises:
        InvalidArgumentError: ray is not installed, the cluster cannot be reached, or a store is
            a ``memory://`` store.
    """

    ships_jobs = True

    def __init__(self, address: str | None, source: Store, dst: Store) -> None:
        for store in (source, dst):
            if isinstance(store, MemoryStore):
                raise InvalidArgumentError(
                    f"executor='ray' (--executor ray) cannot use {store.url}: a memory:// store "
                    "lives in the converting process, out of the Ray workers' reach; use a "
                    "directory or an object store, or the local executor"
                )
        ray = _import_ray()
        self._ray = ray
        self._started = not ray.is_initialized()
        if self._started:
            try:
                ray.init(address=address, include_dashboard=False, configure_logging=False)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise InvalidArgumentError(
                    f"cannot start or reach the Ray cluster {address or '(local)'} ({exc}); check "
                    "--ray-address (ray_address) and RAY_ADDRESS, e.g. start one with "
                    "`ray start --head` and pass --ray-address auto"
                ) from exc
        self._task = ray.remote(max_retries=RAY_RETRIES, retry_exceptions=False, num_cpus=1)(
            write_job
        )
        cpus = int(ray.cluster_resources().get("CPU", 1))
        self.slots = max(1, cpus) * IN_FLIGHT_PER_CPU
        self._refs: dict[Any, str] = {}  # the outstanding tasks, to their shard's name
        self._shut = False

    def run(self, jobs: Iterator[ShardJob], done: ShardRecords) -> None:
        try:
            self._run(jobs, done)
        except BaseException:
            self.shutdown()
            raise

    def _run(self, jobs: Iterator[ShardJob], done: ShardRecords) -> None:
        ray = self._ray
        counters = Counters()
        feeding = True
        while True:
            while feeding and len(self._refs) < self.slots:
                job = next(jobs, None)
                if job is None:
                    feeding = False
                    break
                data = pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)
                self._refs[self._task.remote(data)] = job.shard.name
            if not self._refs:
                return
            ready, _ = ray.wait(list(self._refs), num_returns=1, timeout=0.5)
            for ref in ready:
                name = self._refs.pop(ref)
                record = self._result(ref, name)
                done.add(record)
                counters.add(record["info"]["num_samples"], record["info"]["num_bytes"])
            done.show(counters)

    def _result(self, ref: Any, name: str) -> dict[str, Any]:
        """The done record of a finished task, or its error (the task's own exception)."""
        errors = self._ray.exceptions
        try:
            record: dict[str, Any] = self._ray.get(ref)
        except errors.RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, Exception):
                cause.add_note(f"(raised by the Ray task writing shard {name})")
                raise cause from None
            raise
        except errors.RayError as exc:  # its worker died more often than Ray retries
            raise WorkerError(
                f"the Ray task writing shard {name} failed ({type(exc).__name__}: {exc}) after "
                f"{RAY_RETRIES} retries; a worker may have run out of memory or been killed. "
                "Finished shards are kept: re-run the same command to resume"
            ) from exc
        return record

    def shutdown(self) -> None:
        """Cancel the outstanding tasks (a running one is interrupted; its shard is aborted,
        nothing partial is visible, a re-run writes it) and wait for them to end; then shut
        down the Ray runtime if this executor started it. Idempotent."""
        if self._shut:
            return
        self._shut = True
        ray = self._ray
        refs = list(self._refs)
        self._refs.clear()
        try:
            for ref in refs:
                ray.cancel(ref, force=False)
            for ref in refs:
                with contextlib.suppress(ray.exceptions.RayError):
                    ray.get(ref)
        finally:
            if self._started:
                ray.shutdown()
