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
units, never the plan's. The first failed task (or a failing plan, or Ctrl-C) stops the run: the
outstanding tasks (a few per CPU) finish their shards, as the local pool's workers do, the driver
waits for them and raises the first error; committed shards stay, and the same command resumes.
They are not cancelled: Ray reports a task cancelled that it had just handed to a worker, which
then runs on, and re-sends a running task's interrupt until it ends, so a cancelled task could
still be writing, or leave a shard without its done record, after ``convert`` returned. A second
Ctrl-C (:meth:`RayExecutor.stop_now`) kills them (``ray.cancel(force=True)``): their shards are
written again by the re-run.

Stores must be reachable from every Ray node: object stores (``s3://``) are; a local directory
(source or destination) must be on a file system that every node mounts at the same path (on
one machine it is). A task that cannot see the state the driver wrote first raises
:class:`~fastload.errors.InvalidArgumentError` saying so.
"""

from __future__ import annotations

import contextlib
from typing import Any

from fastload.convert._engines import ENGINES, TaskExecutor, import_engine, write_shipped_job
from fastload.errors import InvalidArgumentError, WorkerError
from fastload.storage import Store

__all__ = ["IN_FLIGHT_PER_CPU", "RAY_RETRIES", "RayExecutor", "write_job"]

#: How often Ray re-runs a task whose worker process died (killed, out of memory). An error the
#: task raises (a bad input item, a full disk) is not retried: it fails the conversion.
RAY_RETRIES = 3
#: Tasks submitted and not yet finished, per CPU of the cluster: one running, one waiting, so no
#: CPU idles while the driver plans the next shard.
IN_FLIGHT_PER_CPU = 2


def write_job(data: bytes) -> dict[str, Any]:
    """A Ray task: :func:`~fastload.convert._pool.write_shipped_job` (write and commit the
    shard of one pickled :class:`ShardJob`; return its done record)."""
    return write_shipped_job(data, "Ray")


class RayExecutor(TaskExecutor):
    """Writes each shard job as a Ray task (see the module docstring).

    Args:
        address: The Ray cluster to use when this process has not called ``ray.init`` yet:
            ``"auto"``, ``"ray://host:10001"``, ``"host:6379"``; ``None`` connects to the
            cluster that ``RAY_ADDRESS`` names, else starts a local one. A runtime started here
            is shut down by :meth:`shutdown`; one the caller started is left running.
        source: The source's store (``convert`` refuses ``memory://`` stores for every
            cluster engine, :meth:`Engine.open <fastload.convert._engines.Engine.open>`).
        dst: The destination store.

    Raises:
        MissingDependencyError: ray is not installed.
        InvalidArgumentError: The cluster cannot be reached.
    """

    def __init__(self, address: str | None, source: Store, dst: Store) -> None:
        del source, dst  # every task opens them itself, from its job
        ray = import_engine("ray", ENGINES["ray"])
        self._ray = ray
        self._stop_now = False
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
        super().__init__(max(1, cpus) * IN_FLIGHT_PER_CPU)

    def submit(self, data: bytes, name: str) -> Any:
        return self._task.remote(data)

    def finished(self, handles: list[Any], timeout: float) -> list[Any]:
        ready: list[Any] = self._ray.wait(handles, num_returns=1, timeout=timeout)[0]
        return ready

    def result(self, handle: Any, name: str) -> dict[str, Any]:
        errors = self._ray.exceptions
        try:
            record: dict[str, Any] = self._ray.get(handle)
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

    def cancel(self, handles: list[Any]) -> None:
        """Wait until the tasks have finished their shards (their errors are not raised: the
        run is failing already), or, after :meth:`stop_now`, kill them and wait for that (see
        the module docstring)."""
        ray = self._ray
        pending = list(handles)
        while pending and not self._stop_now:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.1)
        for ref in pending:
            ray.cancel(ref, force=True)
        for ref in handles:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(ref)

    def stop_now(self) -> None:
        """Kill the outstanding tasks instead of letting them finish (a second Ctrl-C)."""
        self._stop_now = True

    def close(self) -> None:
        """Shut down the Ray runtime if this executor started it."""
        if self._started:
            self._ray.shutdown()
