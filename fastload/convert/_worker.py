"""The worker side of ``convert``: writing and committing whole shards.

A :class:`ShardJob` says everything a worker needs to write one planned shard. :func:`write_shards`
writes jobs in order, committing each (the store's commit, then the index, then the shard's done
record) on a helper thread while it writes the next. In the converting process it runs the jobs of
a one-worker conversion; in a worker process of the pool (:mod:`fastload.convert._pool`)
:func:`run_worker` feeds it from the pool's job queue. Samples and bytes written go to shared
counters that the converting process reads for its progress line.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import pickle
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from fastload._fsutil import pid_alive
from fastload._os import die_with_parent
from fastload.convert._map import (
    MapFn,
    describe,
    map_name,
    raised_where,
    resolve_map,
    user_traceback,
)
from fastload.convert._plan import ShardPlan
from fastload.convert._results import SkippedItem
from fastload.convert._space import raise_if_no_space
from fastload.convert._state import SKIPPED_KEY, done_key, json_bytes
from fastload.convert._token_blocks import TokenBlocks
from fastload.convert._tokenizer import TokenizerSpec
from fastload.convert.sources import ConversionError, Source, Unit
from fastload.errors import InvalidArgumentError, StoreError
from fastload.formats import KEY, ShardWriter, get_format
from fastload.formats.manifest import IMAGE_EXTENSIONS
from fastload.storage import Store

__all__ = [
    "Counters",
    "ShardJob",
    "Written",
    "commit_shard",
    "counting",
    "init_worker",
    "run_worker",
    "write_samples",
    "write_shards",
]

log = logging.getLogger("fastload.convert")
T = TypeVar("T")


@dataclass(frozen=True)
class ShardJob:
    """Everything a worker needs to write one planned shard (pickled into the job queue): the
    shard's own units, never the rest of the plan."""

    source: Source
    dst: Store
    format_name: str
    shard: ShardPlan
    units: list[Unit]
    map_spec: str | MapFn | None
    on_error: str
    #: Where ``map_spec``'s module is also looked for (the directory ``convert`` was called in).
    map_dir: str | None = None
    #: For a tokenizing conversion: the records' texts become blocks of token ids.
    tokenize: TokenizerSpec | None = None


class Counters:
    """Samples and bytes written, shared with the parent (``multiprocessing.Value``s or plain)."""

    def __init__(self, samples: Any = None, nbytes: Any = None) -> None:
        self.samples, self.nbytes = samples, nbytes
        self.local_samples = 0
        self.local_bytes = 0

    def add(self, samples: int, nbytes: int) -> None:
        """Count ``samples`` more samples and ``nbytes`` more bytes written."""
        if self.samples is None:
            self.local_samples += samples
            self.local_bytes += nbytes
            return
        with self.samples.get_lock():
            self.samples.value += samples
        with self.nbytes.get_lock():
            self.nbytes.value += nbytes

    def totals(self) -> tuple[int, int]:
        """``(samples, bytes)`` written so far."""
        if self.samples is None:
            return self.local_samples, self.local_bytes
        # Read without the locks (an 8-byte read; a progress figure): a Ctrl-C in the parent
        # while it held a lock would leave it held and block the workers' next add().
        return int(self.samples.get_obj().value), int(self.nbytes.get_obj().value)


_COUNTERS = Counters()
#: Times a shard is written before a transient store error fails the conversion (the write of a
#: shard cannot resume where a cut connection left it; written again, it is the same shard).
SHARD_ATTEMPTS = 4
#: Values of the pool's stop flag: stop after the shard being written (the first Ctrl-C, a
#: failure), or at once, aborting it (a second Ctrl-C).
STOP_AFTER_SHARD = 1
STOP_NOW = 2
#: In a worker process: the queue of pickled shard jobs (``None`` ends it), the count of jobs
#: taken from it (shared by the workers), the stop flag and the converting process's id.
_JOBS: Any = None
_TAKEN: Any = None
_STOP: Any = None
_PARENT = 0


def init_worker(samples: Any, nbytes: Any, jobs: Any, taken: Any, stop: Any, parent: int) -> None:
    """Set up a worker process. It is killed when the converting process dies (Linux: by the
    kernel, ``PR_SET_PDEATHSIG``; elsewhere it stops before its next shard), so that a killed
    conversion leaves no orphan writing into the destination or waiting forever for work."""
    global _COUNTERS, _JOBS, _TAKEN, _STOP, _PARENT
    _COUNTERS = Counters(samples, nbytes)
    _JOBS, _TAKEN, _STOP, _PARENT = jobs, taken, stop, parent
    # Ctrl-C reaches the whole process group; only the converting process acts on it (it stops
    # the workers after their shards, see Pool.shutdown). A KeyboardInterrupt in a worker
    # would print a traceback per idle worker, and one raised while a worker holds a shared
    # lock (a counter, the stop flag) would leave it held and hang the others.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # One process per core already: tokenizers' own threads would only compete with the others.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    die_with_parent(signal.SIGKILL)
    if not pid_alive(parent):  # it died before the signal was armed
        os._exit(1)


@contextlib.contextmanager
def counting(counters: Counters) -> Iterator[None]:
    """Count what :func:`write_shards` writes in this process into ``counters`` meanwhile."""
    global _COUNTERS
    previous, _COUNTERS = _COUNTERS, counters
    try:
        yield
    finally:
        _COUNTERS = previous


@dataclass
class Written:
    """A shard whose samples are all written, waiting for :func:`commit_shard`."""

    job: ShardJob
    writer: ShardWriter
    skipped: list[dict[str, Any]]
    dropped: int
    #: A token shard's counts (:meth:`TokenBlocks.finish`), else ``None``.
    tokens: dict[str, int] | None = None


def write_samples(job: ShardJob) -> Written:
    """Write the samples of one planned shard; the writer is left open (not committed)."""
    fmt = get_format(job.format_name)
    map_fn = resolve_map(job.map_spec, job.map_dir)
    hook = map_name(job.map_spec)
    name = job.shard.name
    skipped: list[dict[str, Any]] = []
    dropped = 0
    keys: dict[str, str] = {}
    pending_samples = pending_bytes = 0

    def fail(
        unit: Unit,
        reason: str,
        exc: BaseException | None,
        remedy: str = "fix the input",
        note: str | None = None,
    ) -> None:
        if job.on_error == "raise":
            error = ConversionError(
                f"cannot convert {unit.item} (planned for shard {job.dst.child_url(name)}): "
                f"{reason}; {remedy}, or pass on_error='skip' (--on-error skip) to leave such "
                f"items out and list them in {SKIPPED_KEY}"
            )
            if note is not None:
                error.add_note(note)
            raise error from exc
        skipped.append(SkippedItem(unit.item, reason, name).to_json())

    try:
        writer = fmt.writer(job.dst, name, index=True)
    except BaseException as exc:
        raise_if_no_space(exc, job.dst, job.shard)
        raise
    try:
        blocks = None
        if job.tokenize is not None:
            url = job.dst.child_url(name)
            blocks = TokenBlocks(job.tokenize, writer, job.shard.index, url, fail)
        for unit, result in job.source.read_units(job.units):
            if _STOP is not None and _STOP.get_obj().value == STOP_NOW:
                raise _Aborted(f"shard {name} aborted: the conversion was stopped at once")
            if isinstance(result, Exception):
                fail(unit, describe(result), result)
                continue
            empty = _empty_image(result)
            if empty is not None:
                fail(unit, f"field {empty!r} is an empty image (0 bytes)", None)
                continue
            sample: Mapping[str, Any] = result
            if map_fn is not None:
                key_in = result.get(KEY)
                try:
                    mapped: Any = map_fn(result)
                except Exception as exc:
                    where = raised_where(exc)
                    fail(
                        unit,
                        f"on sample {key_in!r} the map function {hook} raised "
                        f"{describe(exc)}" + (f" (at {where})" if where else ""),
                        exc,
                        remedy="fix the map function (its traceback is below)",
                        note=user_traceback(exc),
                    )
                    continue
                if mapped is None:
                    dropped += 1
                    continue
                if not isinstance(mapped, Mapping):
                    fail(
                        unit,
                        f"the map function {hook} returned a {type(mapped).__name__}, not a "
                        "sample dict or None",
                        None,
                        remedy="fix the map function",
                    )
                    continue
                sample = mapped
                empty = _empty_image(sample)
                if empty is not None:
                    fail(
                        unit,
                        f"the map function {hook} returned a sample whose field {empty!r} is "
                        "an empty image (0 bytes)",
                        None,
                        remedy="fix the map function",
                    )
                    continue
            key = sample.get(KEY)
            before = writer.num_bytes
            if blocks is not None:  # records' keys are not kept: the blocks have their own
                blocks.add(unit, sample)
            elif isinstance(key, str) and key in keys:
                fail(unit, f"sample key {key!r} is already used by {keys[key]} in this shard", None)
                continue
            else:
                try:
                    # Writers validate a sample completely before writing any of it.
                    writer.write(sample)
                except InvalidArgumentError as exc:
                    remedy = (
                        "fix the input" if map_fn is None else "fix the input or the map function"
                    )
                    fail(unit, describe(exc), exc, remedy=remedy)
                    continue
                keys[str(key)] = unit.item
            pending_samples += 1
            pending_bytes += writer.num_bytes - before
            if pending_samples >= 64:
                _COUNTERS.add(pending_samples, pending_bytes)
                pending_samples = pending_bytes = 0
        before = writer.num_bytes
        tokens = blocks.finish() if blocks is not None else None
    except BaseException as exc:
        writer.abort()
        raise_if_no_space(exc, job.dst, job.shard)
        raise
    _COUNTERS.add(pending_samples, pending_bytes + writer.num_bytes - before)
    return Written(job, writer, skipped, dropped, tokens)


class _Aborted(Exception):
    """A worker's shard abandoned on the pool's :data:`STOP_NOW` (nobody waits for its result)."""


def _empty_image(sample: Mapping[str, Any]) -> str | None:
    """The first field of ``sample`` named like an image (``jpg``, ``left.png``) whose value is
    empty bytes, or ``None``. An empty image is an item error in every source."""
    for name, value in sample.items():
        if (
            isinstance(value, (bytes, bytearray, memoryview))
            and len(value) == 0
            and name.rsplit(".", 1)[-1].lower() in IMAGE_EXTENSIONS
            and not name.startswith("__")
        ):
            return name
    return None


def commit_shard(written: Written) -> dict[str, Any]:
    """Commit a written shard (then its index), then put its done record; return the record."""
    job = written.job
    try:
        info = written.writer.close()
    except BaseException as exc:
        written.writer.abort()
        raise_if_no_space(exc, job.dst, job.shard)
        raise
    record = {
        "shard_sha256": job.shard.digest,
        "shard": job.shard.name,
        "info": {
            "key": info.key,
            "num_samples": info.num_samples,
            "num_bytes": info.num_bytes,
            "sha256": info.sha256,
            "index_key": info.index_key,
            "fields": dict(sorted(info.fields.items())),
        },
        "skipped": written.skipped,
        "dropped": written.dropped,
    }
    if written.tokens is not None:
        record["tokens"] = written.tokens
    try:
        job.dst.put(done_key(job.shard.name), json_bytes(record))
    except BaseException as exc:
        raise_if_no_space(exc, job.dst, job.shard)
        raise
    return record


def write_shards(
    jobs: Iterator[ShardJob], on_written: Callable[[], None] | None = None
) -> list[dict[str, Any]]:
    """Write the shards of ``jobs`` in order; return their done records.

    A helper thread commits each shard (the store's commit: fsync and rename for local files; then
    the index and the done record) while the samples of the next shard are written, so the wait
    for the disk overlaps with work. At most one shard is committing at a time. On an error the
    shard being written is aborted, the one committing is finished, and the error is raised.
    """
    records: list[dict[str, Any]] = []
    pending: Future[dict[str, Any]] | None = None
    committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastload-commit")
    try:
        for job in jobs:
            written = _attempts(job, functools.partial(write_samples, job))
            if on_written is not None:
                on_written()
            if pending is not None:
                try:
                    records.append(pending.result())
                except BaseException:
                    written.writer.abort()
                    raise
            pending = committer.submit(_commit_retrying, written)
        if pending is not None:
            records.append(pending.result())
    finally:
        _finish_commits(committer)
    return records


def _transient(exc: BaseException) -> bool:
    """Whether a shard that failed with ``exc`` may succeed written again: a store error that a
    retry may cure (a connection cut mid-write, a DataNode lost from the write pipeline)."""
    return isinstance(exc, StoreError) and exc.retryable


def _attempts(job: ShardJob, write: Callable[[], T], first: BaseException | None = None) -> T:
    """``write()``, called again (after a pause) while it fails on a transient store error, at
    most :data:`SHARD_ATTEMPTS` times in all (``first``: a failure already met). A shard's bytes
    depend only on its job, so writing it again from its units gives the same shard; an aborted
    attempt leaves nothing visible. The last failure is raised with a note saying so."""
    failures = 0 if first is None else 1
    last = first
    while True:
        if failures:
            if last is None or not _transient(last) or failures >= SHARD_ATTEMPTS:
                assert last is not None
                if failures > 1:
                    last.add_note(
                        f"(shard {job.shard.name} was written {failures} times; each attempt "
                        "failed on the store)"
                    )
                raise last
            log.warning(
                "fastload convert: writing shard %s again (attempt %d of %d) after a transient "
                "store error: %s",
                job.dst.child_url(job.shard.name),
                failures + 1,
                SHARD_ATTEMPTS,
                last,
            )
            time.sleep(min(8.0, 0.5 * 2 ** (failures - 1)))
        try:
            return write()
        except BaseException as exc:
            failures, last = failures + 1, exc


def _commit_retrying(written: Written) -> dict[str, Any]:
    """:func:`commit_shard`; on a transient store error, the shard written again from its units
    and committed (see :func:`_attempts`)."""
    try:
        return commit_shard(written)
    except BaseException as exc:
        job = written.job
        return _attempts(job, lambda: commit_shard(write_samples(job)), first=exc)


def _finish_commits(committer: ThreadPoolExecutor) -> None:
    """Wait until the commit in flight (if any) has ended, whatever interrupts the wait: a shard
    is then either committed with its done record or not visible. (Under ``convert`` in the main
    thread only the first Ctrl-C raises, :func:`fastload._os.interrupts_escalate`; elsewhere, a
    second ``KeyboardInterrupt`` during the wait would otherwise leave the commit running after
    this returned.)"""
    while True:
        with contextlib.suppress(KeyboardInterrupt):
            committer.shutdown(wait=True)
            return


def _queued_jobs() -> Iterator[ShardJob]:
    """In a worker: jobs from the pool's queue until its end marker or the stop flag."""
    while not _STOP.value:
        if not pid_alive(_PARENT):  # the conversion was killed: nobody will use the shard
            os._exit(1)
        data = _JOBS.get()
        if data is None:
            return
        with _TAKEN.get_lock():
            _TAKEN.value += 1
        job: ShardJob = pickle.loads(data)
        yield job


def run_worker() -> list[dict[str, Any]]:
    """A worker process's task: write shards from the queue until it is empty or stopped."""
    try:
        return write_shards(_queued_jobs())
    except BaseException:
        with _STOP.get_lock():  # the conversion fails: other workers take no new shard
            _STOP.value = max(_STOP.value, STOP_AFTER_SHARD)
        raise
