"""Running shard jobs as Spark tasks: :class:`SparkExecutor` (``convert(..., executor="spark")``).

The same contract as the Ray executor (:mod:`fastload.convert._ray`): each planned shard's
:class:`~fastload.convert._worker.ShardJob` (one shard's units, the source and destination
stores as URLs and options, never live clients) is pickled in the converting process (the Spark
driver) and written by one Spark task, :func:`spark_task`, which writes the shard, commits it
(the store's atomic commit, then the index, then the done record) and returns the done record.
A shard's bytes depend only on its job, so the output is byte-identical to the local pool's for
any partitioning, and a task that Spark re-runs (its Python worker or executor died: up to
``spark.task.maxFailures`` attempts in all) writes the same bytes over nothing visible.

Each job is one small Spark job (``sc.parallelize([job], 1).map(spark_task)``) submitted from a
driver thread; at most :data:`IN_FLIGHT_PER_CORE` jobs per core of the Spark application
(``defaultParallelism``) are outstanding, so the driver plans as the tasks complete and holds a
few shards' units, never the plan's. An error a task raises (a bad item, a full disk) is caught
in the task and returned, so Spark does not retry it, and raised in the driver as the task's own
typed error with a note naming the shard. The first failure, a failing plan or Ctrl-C cancels
the conversion's job group (Spark kills the running tasks' Python workers: their shards are
aborted, nothing partial is visible); committed shards stay, and the same command resumes.

Stores must be reachable from every executor: object stores (``s3://``) and HDFS are; a local
directory must be on a file system every node mounts at the same path (on one machine it is).
fastload must be installed in the executors' Python (``spark.pyspark.python``).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from fastload.convert._engines import ENGINES, TaskExecutor, import_engine, write_shipped_job
from fastload.errors import InvalidArgumentError, WorkerError
from fastload.storage import Store

__all__ = [
    "DEFAULT_MASTER",
    "IN_FLIGHT_PER_CORE",
    "SPARK_TASK_ATTEMPTS",
    "SparkExecutor",
    "spark_conf",
    "spark_task",
    "start_context",
]

#: Attempts Spark makes at a task whose Python worker or executor died (killed, out of memory),
#: unless ``spark.task.maxFailures`` is configured: Spark's own default on a cluster, and what a
#: ``local[N]`` master is given too (``local[N,4]``; Spark's local mode would otherwise try once).
SPARK_TASK_ATTEMPTS = 4
#: Jobs submitted and not yet finished, per core of the Spark application: one running, one
#: waiting, so no core idles while the driver plans the next shard.
IN_FLIGHT_PER_CORE = 2
#: The master when neither ``spark_master`` nor ``spark-submit`` names one.
DEFAULT_MASTER = "local[*]"
#: How long :meth:`SparkExecutor.shutdown` waits for cancelled tasks to end (Spark kills a
#: cancelled task's Python worker after ``spark.python.task.killTimeout``, 2 s by default).
_CANCEL_WAIT_S = 60.0
#: The last line of a Python traceback: ``ValueError: ...``, ``ModuleNotFoundError: ...``.
_PYTHON_ERROR = re.compile(r"[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit): ")
#: ``local``, ``local[N]``, ``local[*]``: a local master without a failure count.
_LOCAL = re.compile(r"local(?:\[(\d+|\*)\])?")


def spark_task(data: bytes) -> tuple[str, Any]:
    """A Spark task: write and commit the shard of one pickled :class:`ShardJob`.

    Returns ``("done", record)`` with the shard's done record, or ``("error", pickled)`` with
    the exception the job raised, pickled, so that Spark does not retry an error that a retry
    would raise again, and the driver raises it with its own type. A task whose process dies
    returns nothing: Spark runs it again (it writes the same bytes).
    """
    try:
        return "done", write_shipped_job(data, "Spark")
    except Exception as exc:
        return "error", _pickled(exc)


def _pickled(exc: Exception) -> bytes:
    """``exc`` pickled, or a :class:`WorkerError` with its text if it does not round-trip."""
    with contextlib.suppress(Exception):
        data = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(data)
        return data
    error = WorkerError(f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}")
    error.add_note("".join(traceback.format_exception(exc)).rstrip())
    return pickle.dumps(error, protocol=pickle.HIGHEST_PROTOCOL)


def spark_conf(pyspark: Any, master: str | None) -> Any:
    """The ``SparkConf`` of an application the executor starts itself.

    The master is ``master``, else the ``spark.master`` that ``spark-submit`` set, else
    :data:`DEFAULT_MASTER`. A local master without a failure count gets
    :data:`SPARK_TASK_ATTEMPTS` (``local[2]`` becomes ``local[2,4]``), the executors' Python is
    this interpreter (unless ``PYSPARK_PYTHON`` or ``spark.pyspark.python`` says otherwise) and
    the driver binds to 127.0.0.1. Spark's console progress bar is off (``convert`` has its own);
    every setting the caller made (``spark-defaults.conf`` through ``spark-submit``) is kept.
    """
    conf = pyspark.SparkConf()
    chosen = master or conf.get("spark.master") or DEFAULT_MASTER
    local = _LOCAL.fullmatch(chosen)
    if local is not None:
        threads = local.group(1) or "1"
        attempts = conf.get("spark.task.maxFailures") or str(SPARK_TASK_ATTEMPTS)
        chosen = f"local[{threads},{attempts}]"
    conf.setMaster(chosen)
    conf.setIfMissing("spark.app.name", "fastload convert")
    conf.setIfMissing("spark.task.maxFailures", str(SPARK_TASK_ATTEMPTS))
    conf.setIfMissing("spark.ui.showConsoleProgress", "false")
    if chosen.startswith("local"):
        conf.setIfMissing("spark.driver.host", "127.0.0.1")
        conf.setIfMissing("spark.driver.bindAddress", "127.0.0.1")
        if "PYSPARK_PYTHON" not in os.environ:
            conf.setIfMissing("spark.pyspark.python", sys.executable)
    return conf


class SparkExecutor(TaskExecutor):
    """Writes each shard job as a Spark task (see the module docstring).

    Args:
        master: The Spark master when this process has no active ``SparkContext``
            (``"spark://host:7077"``, ``"yarn"``, ``"k8s://https://host:443"``, ``"local[4]"``);
            ``None``: the one ``spark-submit`` set, else ``local[*]`` (see :func:`spark_conf`).
            An application started here is stopped by :meth:`shutdown`; an active one (a
            ``SparkSession`` the caller made) is used as it is and left running.
        source: The source's store (``convert`` refuses ``memory://`` stores for every cluster
            engine).
        dst: The destination store.

    Raises:
        MissingDependencyError: pyspark is not installed.
        InvalidArgumentError: Spark cannot start (no Java 17+, a bad master), saying how to fix.
    """

    def __init__(self, master: str | None, source: Store, dst: Store) -> None:
        del source, dst  # every task opens them itself, from its job
        pyspark = import_engine("pyspark", ENGINES["spark"])
        active = pyspark.SparkContext._active_spark_context
        self._started = active is None
        self._sc: Any = active if active is not None else _start(pyspark, master)
        super().__init__(int(self._sc.defaultParallelism) * IN_FLIGHT_PER_CORE)
        self._group = f"fastload-convert-{uuid.uuid4().hex}"
        self._threads = ThreadPoolExecutor(self.slots, thread_name_prefix="fastload-spark")
        self._cancelled = False  # set by cancel(): no driver thread submits a job after it

    def submit(self, data: bytes, name: str) -> Any:
        return self._threads.submit(self._job, data, name)

    def _job(self, data: bytes, name: str) -> tuple[str, Any]:
        """In a driver thread: run one shard's job as a Spark job of one task; its result."""
        if self._cancelled:
            return "cancelled", None
        sc = self._sc
        sc.setJobGroup(self._group, f"fastload convert: {name}", interruptOnCancel=True)
        results: list[tuple[str, Any]] = sc.parallelize([data], 1).map(spark_task).collect()
        return results[0]

    def finished(self, handles: list[Any], timeout: float) -> list[Any]:
        return list(wait(handles, timeout=timeout, return_when=FIRST_COMPLETED).done)

    def result(self, handle: Any, name: str) -> dict[str, Any]:
        future: Future[tuple[str, Any]] = handle
        try:
            kind, value = future.result()
        except Exception as exc:  # the job was aborted: its task failed every attempt
            raise WorkerError(
                f"the Spark task writing shard {name} failed on each of its attempts "
                f"(spark.task.maxFailures): {_reason(exc)}; an executor or its Python worker "
                "may have run out of memory or been killed, or fastload is not installed in the "
                "executors' Python (PYSPARK_PYTHON, spark.pyspark.python). Finished shards are "
                "kept: re-run the same command to resume"
            ) from exc
        if kind == "cancelled":  # not reached: run() stops before cancel() is called
            raise WorkerError(f"the Spark job writing shard {name} was cancelled")
        if kind == "error":
            error: Exception = pickle.loads(value)
            error.add_note(f"(raised by the Spark task writing shard {name})")
            raise error
        record: dict[str, Any] = value
        return record

    def cancel(self, handles: list[Any]) -> None:
        """Cancel the conversion's job group (Spark kills the running tasks' Python workers:
        their shards are aborted, nothing partial is visible, a re-run writes them) and wait
        for the jobs and their tasks to end."""
        self._cancelled = True
        deadline = time.monotonic() + _CANCEL_WAIT_S
        pending = set(handles)
        while pending and time.monotonic() < deadline:
            # Again while jobs remain: a driver thread may have submitted one just as the
            # flag was set, after the group was cancelled.
            self._sc.cancelJobGroup(self._group)
            pending = wait(pending, timeout=0.5).not_done
        _wait_for_tasks(self._sc, self._group, max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Stop the driver threads, and the Spark application if this executor started it."""
        try:
            self._threads.shutdown(wait=True, cancel_futures=True)
        finally:
            if self._started:
                self._sc.stop()


def start_context(pyspark: Any, conf: Any) -> Any:
    """Start a ``SparkContext`` with ``conf`` (see :func:`spark_conf`).

    The executors' Python is ``spark.pyspark.python`` when ``PYSPARK_PYTHON`` is not set
    (PySpark itself reads only the variable, ``spark-submit`` turns the setting into it), and
    the caller's SIGINT handler is kept (``SparkContext`` installs one that outlives it;
    ``convert``'s own Ctrl-C handling, a ``KeyboardInterrupt`` and then
    :meth:`SparkExecutor.shutdown`, stays in charge).
    """
    handler = signal.getsignal(signal.SIGINT) if _main_thread() else None
    python = conf.get("spark.pyspark.python")
    set_python = python is not None and "PYSPARK_PYTHON" not in os.environ
    if set_python:
        os.environ["PYSPARK_PYTHON"] = python
    try:
        return pyspark.SparkContext(conf=conf)
    finally:
        if set_python:
            del os.environ["PYSPARK_PYTHON"]
        if handler is not None:
            signal.signal(signal.SIGINT, handler)


def _start(pyspark: Any, master: str | None) -> Any:
    """Start a Spark application (the JVM's driver, through ``spark-submit``) for a conversion."""
    try:
        return start_context(pyspark, spark_conf(pyspark, master))
    except Exception as exc:
        raise InvalidArgumentError(
            f"cannot start Spark (master {master or DEFAULT_MASTER}) on {socket.gethostname()}: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}; "
            "Spark needs Java 17 or later (`java` on PATH or JAVA_HOME) and a reachable master: "
            "check --spark-master (spark_master)"
        ) from exc


def _reason(exc: BaseException) -> str:
    """The telling line of a failed Spark job's error: a crashed worker, else the last Python
    exception line of the task's traceback, else the first line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if "Python worker exited unexpectedly" in line:
            return line
    python = [line for line in lines if _PYTHON_ERROR.match(line)]
    return python[-1] if python else (lines[0] if lines else type(exc).__name__)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _wait_for_tasks(sc: Any, group: str, timeout: float = _CANCEL_WAIT_S) -> None:
    """Wait until no task of ``group``'s jobs runs (cancelled tasks end when Spark has killed
    them), or ``timeout`` seconds."""
    tracker = sc.statusTracker()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        active = 0
        for job_id in tracker.getJobIdsForGroup(group):
            job = tracker.getJobInfo(job_id)
            for stage_id in job.stageIds if job is not None else ():
                stage = tracker.getStageInfo(stage_id)
                active += stage.numActiveTasks if stage is not None else 0
        if not active:
            return
        time.sleep(0.1)
