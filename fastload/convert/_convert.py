"""``fastload.convert``: parallel, resumable, deterministic conversion of a corpus into shards.

The steps (``fastload/convert/README.md`` has the user-facing version):

1. **Plan** in the calling process: the source enumerates its samples in a fixed order, an optional
   seeded permutation mixes them, and they are cut into shards by ``shard_samples`` and/or
   ``shard_size``. The plan's SHA-256 covers the source, the content options and every sample
   reference, so it identifies the result.
2. **State**: ``_fastload_convert/plan.json`` is written (atomically) before any shard. A destination
   holding another dataset (a manifest or a plan with a different hash) is refused with
   :class:`~fastload.errors.DatasetExistsError` unless ``overwrite=True``.
3. **Shards**: worker processes each write whole shards (disjoint by construction) through the
   store's atomic streamed writer, so no partial shard is ever visible under its final name. After a
   shard and its index are committed, the worker records ``_fastload_convert/done/<shard>.json``.
   A re-run skips shards whose done record matches the plan and whose objects are present.
4. **Finish**: the skip report ``_fastload_skipped.jsonl`` (if anything was skipped), then the
   manifest ``fastload.json`` **last**, then the state objects are deleted.

Nothing written depends on time, worker count or scheduling, so an interrupted run (even by
SIGKILL) resumed with the same command gives the same bytes as an uninterrupted one.

**What dead runs leave** (see :class:`_Guard`): on a local destination a run holds an ``flock``
on ``_fastload_convert/.fastload-tmp-convert.lock`` from the end of planning to its last write, so
a second conversion into the same directory is refused while one is alive; holding it, a run
removes the temporary files that killed runs left (which the store can tell from a live writer's:
every writer locks its own). Worker processes die with the converting process (``PR_SET_PDEATHSIG``
on Linux), so nothing writes after it is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import difflib
import errno
import fcntl
import gc
import importlib
import json
import multiprocessing
import os
import pickle
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import (
    FIRST_COMPLETED,
    Future,
    ProcessPoolExecutor,
    ThreadPoolExecutor,
    wait,
)
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import IO, Any

from fastload._fsutil import pid_alive
from fastload.convert._plan import (
    DEFAULT_SHARD_SIZE,
    ShardPlan,
    parse_size,
    plan_hash,
    plan_shards,
    shuffle_units,
)
from fastload.convert._progress import Progress, format_bytes, format_duration, plural
from fastload.convert._sources import (
    IMAGE_EXTENSIONS,
    SOURCES,
    ConversionError,
    Source,
    Unit,
    open_source,
)
from fastload.errors import (
    DatasetExistsError,
    FastloadError,
    InvalidArgumentError,
    ManifestError,
    ObjectNotFoundError,
    StoreError,
    StorePermissionError,
    WorkerError,
)
from fastload.formats import MANIFEST_NAME, Format, Manifest, ShardEntry, ShardInfo, get_format
from fastload.formats._base import FORMATS, ShardWriter
from fastload.formats._sample import KEY
from fastload.formats.manifest import read_manifest, write_manifest
from fastload.storage import LocalStore, MemoryStore, Store, open_store
from fastload.storage._local import remove_stale_temporaries
from fastload.storage._wrapper import WrapperStore

__all__ = [
    "DONE_PREFIX",
    "EXIT_ERROR",
    "EXIT_OK",
    "EXIT_SKIPPED",
    "EXIT_USAGE",
    "PLAN_KEY",
    "SKIPPED_KEY",
    "STATE_PREFIX",
    "ConvertResult",
    "SkippedItem",
    "convert",
]

#: Exit status: success.
EXIT_OK = 0
#: Exit status: an error stopped the command (message on stderr), or ``verify`` found problems.
EXIT_ERROR = 1
#: Exit status: invalid command line.
EXIT_USAGE = 2
#: Exit status: conversion completed, but ``--on-error skip`` skipped items (see the report).
EXIT_SKIPPED = 3

STATE_PREFIX = "_fastload_convert/"
PLAN_KEY = STATE_PREFIX + "plan.json"
DONE_PREFIX = STATE_PREFIX + "done/"
SKIPPED_KEY = "_fastload_skipped.jsonl"
_PLAN_VERSION = 1


@dataclass(frozen=True)
class SkippedItem:
    """An input item left out under ``on_error="skip"``.

    Attributes:
        item: The item (``"cat/001.jpg"``, ``"data.jsonl:17"``, ``"train-000003.tar#12"``).
        reason: Why, as the error message said.
        shard: The shard it was planned for, or ``None`` when it was dropped while planning.
    """

    item: str
    reason: str
    shard: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"item": self.item, "reason": self.reason, "shard": self.shard}


@dataclass
class ConvertResult:
    """What :func:`convert` did.

    Attributes:
        url: The destination store URL (dataset root).
        format: Canonical format name.
        num_samples: Samples written (planned samples for a dry run).
        num_shards: Shards in the dataset.
        num_bytes: Bytes of shard objects written (estimated for a dry run).
        skipped: Items left out under ``on_error="skip"``, in plan order.
        dropped: Samples the ``map_fn`` hook dropped (returned ``None``); not errors.
        elapsed: Wall-clock seconds.
        resumed_shards: Shards already complete from an earlier, interrupted run.
        dry_run: Nothing was written.
        plan_sha256: Identity of the plan (also in the manifest's ``created_by``).
        manifest: The manifest written (``None`` for a dry run).
        skipped_report: URL of the skip report, or ``None`` when nothing was skipped.
        shard_names: Shard keys, in dataset order.
        source_type: The source type used (detected or forced): ``imagefolder``, ``files``, ...
        num_classes: Classes in the dataset's metadata (``metadata.classes``: an image folder's
            class directories), or ``None`` when it lists none.
        ignored: Input objects that are not samples and not errors, such as the ``README.txt``
            of an image folder (named in ``warnings``).
        warnings: What the user should know about the input: how the source type was guessed
            when the guess may be wrong, files left out (printed unless ``quiet``).
        unchanged: The destination already held exactly this dataset; nothing was written.
    """

    url: str
    format: str
    num_samples: int
    num_shards: int
    num_bytes: int
    skipped: list[SkippedItem] = field(default_factory=list)
    dropped: int = 0
    elapsed: float = 0.0
    resumed_shards: int = 0
    dry_run: bool = False
    plan_sha256: str = ""
    manifest: Manifest | None = None
    skipped_report: str | None = None
    shard_names: list[str] = field(default_factory=list)
    source_type: str = ""
    num_classes: int | None = None
    ignored: int = 0
    warnings: list[str] = field(default_factory=list)
    unchanged: bool = False

    @property
    def exit_code(self) -> int:
        """:data:`EXIT_SKIPPED` (3) if items were skipped, else :data:`EXIT_OK` (0)."""
        return EXIT_SKIPPED if self.skipped else EXIT_OK

    def _what(self) -> str:
        """``12 samples (source imagefolder, 2 classes)``."""
        classes = (
            "no class list"
            if self.num_classes is None
            else plural(self.num_classes, "class", "classes")
        )
        source = f"source {self.source_type}, " if self.source_type else ""
        return f"{plural(self.num_samples, 'sample')} ({source}{classes})"

    def _skips(self, verb: str = "skipped") -> str:
        text = f"{verb} {plural(len(self.skipped), 'item')}"
        if self.skipped_report:
            text += f" (listed in {self.skipped_report})"
        if self.ignored:
            text += f"; left out {plural(self.ignored, 'file')} that " + (
                "is not a sample" if self.ignored == 1 else "are not samples"
            )
        return text

    def summary(self) -> str:
        """One line: the source type and class count, samples, shards, bytes, skipped items,
        elapsed time (or that nothing was to do)."""
        shards = f"{plural(self.num_shards, f'{self.format} shard')}"
        if self.dry_run:
            return (
                f"dry run: would write {self._what()} into {shards} (about "
                f"{format_bytes(self.num_bytes)}) at {self.url}; {self._skips('would skip')}"
            )
        if self.unchanged:
            return (
                f"nothing to do: {self.url} already holds this dataset, {self._what()} in "
                f"{shards}, {format_bytes(self.num_bytes)}; {self._skips()}"
            )
        rate = self.num_bytes / self.elapsed / 1e6 if self.elapsed > 0 else 0.0
        text = (
            f"converted {self._what()} into {shards}, {format_bytes(self.num_bytes)}, in "
            f"{format_duration(self.elapsed)} ({rate:.1f} MB/s) at {self.url}"
        )
        if self.resumed_shards:
            text += (
                f"; {plural(self.resumed_shards, 'shard')} "
                f"{'was' if self.resumed_shards == 1 else 'were'} already done"
            )
        if self.dropped:
            text += f"; the map hook dropped {plural(self.dropped, 'sample')}"
        return text + "; " + self._skips()


# ---- the map hook ------------------------------------------------------------------------------

MapFn = Callable[[dict[str, Any]], "dict[str, Any] | None"]


def _resolve_map(spec: str | MapFn | None, search_dir: str | None = None) -> MapFn | None:
    """The map function ``spec`` names (``"module:function"``), or ``spec`` if it is one.

    ``search_dir`` (the directory the conversion was started from) is appended to ``sys.path``
    first, so that ``mymap.py`` there is found, like ``python -m`` finds it; appended, not
    prepended, so that a file there never shadows a module fastload itself imports.

    Raises:
        InvalidArgumentError: A malformed spec, no such module, no such function in it (the
            message lists the names it has), or an error while importing the module (the
            module's traceback is a note of the error).
    """
    if spec is None or callable(spec):
        return spec
    module_name, sep, qualname = spec.partition(":")
    if not sep or not module_name or not qualname:
        raise InvalidArgumentError(
            f"map function {spec!r} must be written 'module:function' (an importable module and "
            "a function in it that takes a sample and returns a sample or None)"
        )
    if search_dir and search_dir not in sys.path:
        sys.path.append(search_dir)
    module = _import_map_module(spec, module_name, search_dir)
    obj: Any = module
    for n, part in enumerate(qualname.split(".")):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            owner = module_name + "".join("." + p for p in qualname.split(".")[:n])
            raise InvalidArgumentError(
                f"cannot load map function {spec!r}: {_describe_module(obj, owner)} has no "
                f"attribute {part!r}{_close_names(part, obj)}"
            ) from None
    if not callable(obj):
        raise InvalidArgumentError(f"map function {spec!r} is a {type(obj).__name__}, not callable")
    result: MapFn = obj
    return result


def _import_map_module(spec: str, module_name: str, search_dir: str | None) -> Any:
    """Import the module of map function ``spec``; tell a missing module from a failing one."""
    error: BaseException
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            here = f"the current directory ({search_dir}), " if search_dir else ""
            hint = ""
            if search_dir and "." not in module_name:
                hint = _close_files(module_name, search_dir)
            raise InvalidArgumentError(
                f"cannot load map function {spec!r}: there is no module {missing!r}; it must be "
                f"a file {missing.replace('.', '/')}.py (or a package) in {here}a directory on "
                f"PYTHONPATH, or installed{hint}"
            ) from None
        error = exc
    except Exception as exc:  # the module's own code failed: SyntaxError, NameError, ...
        error = exc
    failure = InvalidArgumentError(
        f"cannot load map function {spec!r}: importing module {module_name!r} raised "
        f"{_describe(error)}; fix the module (its traceback is below)"
    )
    failure.add_note(_user_traceback(error))
    raise failure from error


def _describe_module(obj: Any, name: str) -> str:
    """``module 'mymap' (/work/mymap.py)``: where an object whose attribute is missing came from,
    which tells an installed module from the user's file of the same name."""
    where = getattr(obj, "__file__", None)
    kind = "module" if isinstance(where, str) else type(obj).__name__
    return f"{kind} {name!r}" + (f" ({where})" if isinstance(where, str) else "")


def _close_names(name: str, obj: Any) -> str:
    """``; did you mean 'fn'? It has these functions and classes: boom, fn`` (``name`` missing)."""
    public = sorted(
        n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None))
    )
    close = difflib.get_close_matches(name, public, n=3, cutoff=0.5)
    text = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    lead = " It" if close else "; it"
    if public:
        text += f"{lead} has these functions and classes: {', '.join(public[:20])}"
        text += " ..." if len(public) > 20 else ""
    else:
        text += f"{lead} has no public function"
    return text


def _close_files(name: str, directory: str) -> str:
    try:
        stems = [f[:-3] for f in os.listdir(directory) if f.endswith(".py")]
    except OSError:
        return ""
    close = difflib.get_close_matches(name, stems, n=3, cutoff=0.5)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


#: Files of fastload itself and of the import system, left out of the tracebacks shown for a
#: user's map function and its module.
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_IMPORTLIB_DIR = os.path.dirname(os.path.abspath(importlib.__file__)) + os.sep


def _import_system(filename: str) -> bool:
    return filename.startswith(("<frozen importlib", _IMPORTLIB_DIR))


def _user_traceback(exc: BaseException) -> str:
    """The traceback of ``exc`` from the first frame that is neither fastload's nor the import
    system's (the frames of the user's code, and whatever it called), without the import
    system's frames between modules importing each other."""
    frames = traceback.extract_tb(exc.__traceback__)
    first = 0
    while first < len(frames) and (
        frames[first].filename.startswith(_OWN_DIR) or _import_system(frames[first].filename)
    ):
        first += 1
    kept = [f for f in frames[first:] if not _import_system(f.filename)]
    lines = ["Traceback (most recent call last):\n"]
    lines += traceback.format_list(kept)
    lines += traceback.format_exception_only(type(exc), exc)
    return "".join(lines).rstrip("\n")


def _raised_where(exc: BaseException) -> str:
    """``/work/mymap.py:4, in boom``: where ``exc`` was raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    return f"{last.filename}:{last.lineno}, in {last.name}"


def _map_name(spec: str | MapFn | None) -> str | None:
    if spec is None or isinstance(spec, str):
        return spec
    return f"{getattr(spec, '__module__', '?')}:{getattr(spec, '__qualname__', repr(spec))}"


# ---- worker side -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ShardJob:
    source: Source
    dst: Store
    format_name: str
    shard: ShardPlan
    map_spec: str | MapFn | None
    on_error: str
    plan_sha256: str
    #: Where ``map_spec``'s module is also looked for (the directory ``convert`` was called in).
    map_dir: str | None = None


class _Counters:
    """Samples and bytes written, shared with the parent (``multiprocessing.Value``s or plain)."""

    def __init__(self, samples: Any = None, nbytes: Any = None) -> None:
        self.samples, self.nbytes = samples, nbytes
        self.local_samples = 0
        self.local_bytes = 0

    def add(self, samples: int, nbytes: int) -> None:
        if self.samples is None:
            self.local_samples += samples
            self.local_bytes += nbytes
            return
        with self.samples.get_lock():
            self.samples.value += samples
        with self.nbytes.get_lock():
            self.nbytes.value += nbytes

    def totals(self) -> tuple[int, int]:
        if self.samples is None:
            return self.local_samples, self.local_bytes
        # Read without the locks (an 8-byte read; a progress figure): a Ctrl-C in the parent
        # while it held a lock would leave it held and block the workers' next add().
        return int(self.samples.get_obj().value), int(self.nbytes.get_obj().value)


_COUNTERS = _Counters()
#: In a worker process: the queue of pickled shard jobs (``None`` ends it), the stop flag and the
#: converting process's id.
_JOBS: Any = None
_STOP: Any = None
_PARENT = 0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _init_worker(samples: Any, nbytes: Any, jobs: Any, stop: Any, parent: int) -> None:
    """Set up a worker process. It is killed when the converting process dies (Linux: by the
    kernel, ``PR_SET_PDEATHSIG``; elsewhere it stops before its next shard), so that a killed
    conversion leaves no orphan writing into the destination or waiting forever for work."""
    global _COUNTERS, _JOBS, _STOP, _PARENT
    _COUNTERS = _Counters(samples, nbytes)
    _JOBS, _STOP, _PARENT = jobs, stop, parent
    # Ctrl-C reaches the whole process group; only the converting process acts on it (it stops
    # the workers after their shards, see _Pool.shutdown). A KeyboardInterrupt in a worker
    # would print a traceback per idle worker, and one raised while a worker holds a shared
    # lock (a counter, the stop flag) would leave it held and hang the others.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # pragma: no cover - no prctl in this libc
            pass
    if not pid_alive(parent):  # it died before the signal was armed
        os._exit(1)


def _done_key(name: str) -> str:
    return f"{DONE_PREFIX}{name}.json"


@dataclass
class _Written:
    """A shard whose samples are all written, waiting for :func:`_commit_shard`."""

    job: _ShardJob
    writer: ShardWriter
    skipped: list[dict[str, Any]]
    dropped: int


def _write_samples(job: _ShardJob) -> _Written:
    """Write the samples of one planned shard; the writer is left open (not committed)."""
    fmt = get_format(job.format_name)
    map_fn = _resolve_map(job.map_spec, job.map_dir)
    map_name = _map_name(job.map_spec)
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
        _raise_if_no_space(exc, job)
        raise
    try:
        for unit, result in job.source.read_units(job.shard.units):
            if isinstance(result, Exception):
                fail(unit, _describe(result), result)
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
                    where = _raised_where(exc)
                    fail(
                        unit,
                        f"on sample {key_in!r} the map function {map_name} raised "
                        f"{_describe(exc)}" + (f" (at {where})" if where else ""),
                        exc,
                        remedy="fix the map function (its traceback is below)",
                        note=_user_traceback(exc),
                    )
                    continue
                if mapped is None:
                    dropped += 1
                    continue
                if not isinstance(mapped, Mapping):
                    fail(
                        unit,
                        f"the map function {map_name} returned a {type(mapped).__name__}, not a "
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
                        f"the map function {map_name} returned a sample whose field {empty!r} is "
                        "an empty image (0 bytes)",
                        None,
                        remedy="fix the map function",
                    )
                    continue
            key = sample.get(KEY)
            if isinstance(key, str) and key in keys:
                fail(unit, f"sample key {key!r} is already used by {keys[key]} in this shard", None)
                continue
            before = writer.num_bytes
            try:
                # Writers validate a sample completely before writing any of it.
                writer.write(sample)
            except InvalidArgumentError as exc:
                remedy = "fix the input" if map_fn is None else "fix the input or the map function"
                fail(unit, _describe(exc), exc, remedy=remedy)
                continue
            keys[str(key)] = unit.item
            pending_samples += 1
            pending_bytes += writer.num_bytes - before
            if pending_samples >= 64:
                _COUNTERS.add(pending_samples, pending_bytes)
                pending_samples = pending_bytes = 0
    except BaseException as exc:
        writer.abort()
        _raise_if_no_space(exc, job)
        raise
    _COUNTERS.add(pending_samples, pending_bytes)
    return _Written(job, writer, skipped, dropped)


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


def _commit_shard(written: _Written) -> dict[str, Any]:
    """Commit a written shard (then its index), then put its done record; return the record."""
    job = written.job
    try:
        info = written.writer.close()
    except BaseException as exc:
        written.writer.abort()
        _raise_if_no_space(exc, job)
        raise
    record = {
        "plan_sha256": job.plan_sha256,
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
    try:
        job.dst.put(_done_key(job.shard.name), _json_bytes(record))
    except BaseException as exc:
        _raise_if_no_space(exc, job)
        raise
    return record


def _write_shards(
    jobs: Iterator[_ShardJob], on_written: Callable[[], None] | None = None
) -> list[dict[str, Any]]:
    """Write the shards of ``jobs`` in order; return their done records.

    A helper thread commits each shard (the store's commit: fsync and rename for local files; then
    the index and the done record) while the samples of the next shard are written, so the wait
    for the disk overlaps with work. At most one shard is committing at a time. On an error the
    shard being written is aborted, the one committing is finished, and the error is raised.
    """
    records: list[dict[str, Any]] = []
    pending: Future[dict[str, Any]] | None = None
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastload-commit") as committer:
        for job in jobs:
            written = _write_samples(job)
            if on_written is not None:
                on_written()
            if pending is not None:
                try:
                    records.append(pending.result())
                except BaseException:
                    written.writer.abort()
                    raise
            pending = committer.submit(_commit_shard, written)
        if pending is not None:
            records.append(pending.result())
    return records


def _queued_jobs() -> Iterator[_ShardJob]:
    """In a worker: jobs from the pool's queue until its end marker or the stop flag."""
    while not _STOP.value:
        if not pid_alive(_PARENT):  # the conversion was killed: nobody will use the shard
            os._exit(1)
        data = _JOBS.get()
        if data is None:
            return
        job: _ShardJob = pickle.loads(data)
        yield job


def _run_worker() -> list[dict[str, Any]]:
    """A worker process's task: write shards from the queue until it is empty or stopped."""
    try:
        return _write_shards(_queued_jobs())
    except BaseException:
        _STOP.value = 1  # the conversion fails: other workers take no new shard
        raise


#: ``errno`` values that mean the destination has no room: a full disk, a quota, a size limit.
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def _space_errno(exc: BaseException) -> int | None:
    """The ``errno`` of a full disk (or quota, or file size limit) behind ``exc``, if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _NO_SPACE:
            return current.errno
        text = str(current)
        if "No space left on device" in text or "Disk quota exceeded" in text:
            return errno.ENOSPC  # LMDB reports the errno only in its message
        current = current.__cause__ or current.__context__
    return None


def _space_message(where: str, code: int) -> str:
    why = {
        errno.ENOSPC: "the destination has no space left",
        errno.EDQUOT: "the destination's disk quota is used up",
        errno.EFBIG: "a file grew past the largest size allowed (a file system limit or this "
        "process's file size limit, `ulimit -f`)",
    }[code]
    return (
        f"cannot write {where}: {why} ({os.strerror(code)}). Nothing partial is left under the "
        "final name. Free space (or raise the limit), then re-run the same command: the "
        "finished shards are kept and the conversion resumes"
    )


def _raise_if_no_space(exc: BaseException, job: _ShardJob) -> None:
    """Raise a clear error if shard ``job`` failed with ``exc`` for lack of space. Called in the
    worker: the errno does not survive the error's trip to the parent."""
    code = _space_errno(exc)
    if code is not None:
        url = job.dst.child_url(job.shard.name)
        what = f"shard {url} (planned for about {format_bytes(job.shard.est_bytes)})"
        raise StoreError(_space_message(what, code), url=url) from exc


@contextlib.contextmanager
def _space_for(store: Store, key: str) -> Iterator[None]:
    """Turn a lack of space while the parent writes ``key`` into a clear error."""
    try:
        yield
    except (OSError, FastloadError) as exc:
        code = _space_errno(exc)
        if code is None:
            raise
        url = store.child_url(key)
        raise StoreError(_space_message(url, code), url=url) from exc


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _json_bytes(doc: Any) -> bytes:
    return (json.dumps(doc, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


# ---- parent side -------------------------------------------------------------------------------


def _valid_done(store: Store, name: str, plan: str) -> dict[str, Any] | None:
    """The done record of shard ``name`` if it belongs to ``plan`` and its objects are intact."""
    try:
        record = json.loads(store.get(_done_key(name)))
        if record.get("plan_sha256") != plan:
            return None
        info = record["info"]
        if store.size(info["key"]) != info["num_bytes"]:
            return None
        if info.get("index_key") and not store.exists(info["index_key"]):
            return None
    except (FastloadError, OSError, ValueError, KeyError, TypeError):
        return None
    result: dict[str, Any] = record
    return result


_SHARD_RE_TEMPLATE = r"^{prefix}-[0-9]{{6}}\.(?:{exts})(?:\.idx)?$"


def _shard_pattern(prefix: str) -> re.Pattern[str]:
    exts = "|".join(sorted({"tar", "tfrecord", "lmdb"}))
    return re.compile(_SHARD_RE_TEMPLATE.format(prefix=re.escape(prefix), exts=exts))


def _clear_destination(store: Store, old: Manifest | None, prefix: str) -> None:
    """Remove a previous dataset: manifest first (so it is never half-valid), then its shards and
    indexes, our-pattern shard objects, the skip report and conversion state."""
    store.delete_many([MANIFEST_NAME])
    keys: list[str] = []
    if old is not None:
        for entry in old.shards:
            keys.append(entry.name)
            if entry.index:
                keys.append(entry.index)
    pattern = _shard_pattern(prefix)
    keys.extend(m.key for m in store.list(f"{prefix}-") if pattern.match(m.key))
    keys.append(SKIPPED_KEY)
    keys.extend(store.list_keys(STATE_PREFIX))
    store.delete_many(sorted(set(keys)))


#: The lock file in the state directory. Its name is one of a local store's temporary names, so
#: the store never lists it as an object (nor lets a key name it).
_LOCK_NAME = ".fastload-tmp-convert.lock"
#: Seconds a new run waits for the lock, long enough for the processes of a run killed a moment
#: ago to be gone.
_LOCK_WAIT = 2.0


def _innermost(store: Store) -> Store:
    while isinstance(store, WrapperStore):
        store = store.inner
    return store


class _Guard:
    """One conversion at a time per destination, and the removal of what killed runs left.

    On a local destination (:class:`~fastload.storage.LocalStore`), :meth:`acquire` takes an
    exclusive ``flock`` on ``_fastload_convert/.fastload-tmp-convert.lock`` (waiting up to
    ``_LOCK_WAIT`` seconds, then raising :class:`DatasetExistsError` naming the process that holds
    it). Forked workers inherit the lock, so it is held until every process of the run is gone.
    Holding it, the run removes the temporary files and LMDB scratch directories that dead
    writers left in the dataset root and the state directory. That is safe even while other
    processes write there: the store removes only a temporary file whose writer's own ``flock``
    is free, i.e. whose writer has exited (see ``LocalStore.remove_stale_temporaries``).
    :meth:`release` removes dead writers' files once more, then the lock file, then the state
    directory if nothing is left in it. On a file system without ``flock`` there is no guard,
    and nothing is removed.

    Other stores have no locks. A run removes LMDB scratch directories of dead processes from
    the system temporary directory, and, through the store's ``abort_incomplete_writes(prefix)``
    when it has one (S3: multipart uploads), the unfinished uploads of the dataset's own keys
    (``{prefix}-*``, the state, the manifest and the skip report), once it knows the destination
    holds this conversion (or nothing, or ``overwrite`` was asked). Two conversions into one
    object-store destination at once are not supported: the later one aborts the earlier one's
    uploads, which then fails naming the shard and can be re-run.
    """

    def __init__(self, store: Store, format_name: str) -> None:
        self.store = store
        self.format_name = format_name
        inner = _innermost(store)
        self.local = inner if isinstance(inner, LocalStore) and inner.supports_writes else None
        self._fd: int | None = None
        self._path = ""

    def _dirs(self, root: str) -> list[str]:
        state = os.path.join(root, STATE_PREFIX.rstrip("/"))
        return [root, state, os.path.join(state, DONE_PREFIX[len(STATE_PREFIX) :].rstrip("/"))]

    def acquire(self) -> None:
        """Take the destination and remove what dead runs left (see the class docstring)."""
        if self.local is not None:
            self._lock(self.local.root)
            self._sweep()
        elif self.format_name == "lmdb":
            from fastload.formats.lmdb._writer import remove_stale_scratch

            remove_stale_scratch()

    def _lock(self, root: str) -> None:
        state = self._dirs(root)[1]
        path = os.path.join(state, _LOCK_NAME)
        deadline = time.monotonic() + _LOCK_WAIT
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        holder = ""
        while time.monotonic() < deadline:
            try:
                os.makedirs(state, exist_ok=True)
                fd = os.open(path, flags, 0o644)
            except FileNotFoundError:  # a run that just finished removed the directory
                continue
            except OSError as exc:
                error = StorePermissionError if isinstance(exc, PermissionError) else StoreError
                raise error(
                    f"cannot create the conversion lock {path}: {exc.strerror}; the destination "
                    "directory must be writable",
                    url=self.store.url,
                ) from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # held by a live conversion (or one dying this instant)
                holder = _read_holder(fd)
                os.close(fd)
                time.sleep(0.05)
                continue
            except OSError:  # no locks on this file system: no guard
                self._fd, self._path = fd, path
                return
            try:
                held, now = os.fstat(fd), os.stat(path)
                same = (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)
            except FileNotFoundError:
                same = False
            if not same:  # removed by the run that held it before us: lock the new one
                os.close(fd)
                continue
            self._fd, self._path = fd, path
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}".encode(), 0)
            except OSError:
                pass  # only for the message of a run that finds it busy
            return
        raise DatasetExistsError(
            f"{self.store.url} is being written by another fastload convert "
            f"({holder or 'it holds the lock ' + path}); wait for it to finish (the same "
            "command then finds the dataset complete), or stop it and re-run this command to "
            "resume"
        )

    def _sweep(self) -> None:
        if self.local is not None:
            for directory in self._dirs(self.local.root):
                remove_stale_temporaries(directory)

    def abort_uploads(self, prefix: str) -> None:
        """Abort the unfinished uploads of the dataset's keys, on stores that keep them."""
        if self.local is not None:
            return
        abort = getattr(_innermost(self.store), "abort_incomplete_writes", None)
        if callable(abort):
            for key_prefix in (f"{prefix}-", STATE_PREFIX, MANIFEST_NAME, SKIPPED_KEY):
                abort(key_prefix)

    def release(self) -> None:
        """Remove dead writers' files, the lock file and the empty state directory; unlock."""
        fd = self._fd
        if fd is None or self.local is None:
            return
        self._fd = None
        try:
            self._sweep()
            try:
                held, now = os.fstat(fd), os.stat(self._path)
                if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
                    os.unlink(self._path)  # while locked; a waiting run then makes a new one
            except OSError:
                pass
            for directory in reversed(self._dirs(self.local.root)[1:]):
                try:
                    os.rmdir(directory)
                except OSError:
                    pass  # not empty: the state of an unfinished conversion
        finally:
            os.close(fd)


def _read_holder(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _existing_manifest(store: Store) -> Manifest | bool | None:
    """The manifest at the root, ``None`` if there is none, ``False`` if it is unreadable."""
    if not store.exists(MANIFEST_NAME):
        return None
    try:
        return read_manifest(store)
    except ManifestError:
        return False


def _pool_context() -> multiprocessing.context.BaseContext:
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


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    format: str = "webdataset",  # noqa: A002 - the public name the design fixes
    shard_size: int | str | None = None,
    shard_samples: int | None = None,
    workers: int | None = None,
    shuffle: bool = False,
    seed: int = 0,
    on_error: str = "raise",
    overwrite: bool = False,
    dry_run: bool = False,
    map_fn: str | MapFn | None = None,
    source_type: str | None = None,
    prefix: str = "shard",
    quiet: bool = False,
    store_options: Mapping[str, Any] | None = None,
    source_options: Mapping[str, Any] | None = None,
    progress_stream: IO[str] | None = None,
) -> ConvertResult:
    """Convert a corpus into a sharded dataset with a ``fastload.json`` manifest.

    The same input and options give byte-identical shards and manifest whatever ``workers`` is. An
    interrupted conversion (even by SIGKILL) re-run with the same arguments completes without
    redoing finished shards, with the same bytes as an uninterrupted run. No partial shard is ever
    visible under its final name; the manifest is written last. See ``fastload/convert/README.md``
    for the sources, key and field naming, and the skip report.

    Args:
        src: The corpus: a directory or store URL (image folder, file tree, JSONL / text / CSV /
            Parquet files, existing shards or a fastload dataset), or a single file.
        dst: The dataset root: a local directory or store URL.
        format: ``webdataset`` (``wds``), ``tfrecord`` or ``lmdb``.
        shard_size: Target shard size in bytes, or a string such as ``"256MB"`` / ``"1GiB"``.
            Estimated while planning (from file sizes; for record sources from record or row-group
            sizes). Default 256 MB when ``shard_samples`` is not given either.
        shard_samples: Maximum samples per shard. With ``shard_size`` the first limit reached wins.
        workers: Worker processes writing shards (default: ``os.cpu_count()``). 1 writes in this
            process. ``memory://`` stores always write in this process. Workers are forked when
            the calling process runs one thread, else started by multiprocessing's forkserver,
            which re-imports the calling script: call ``convert`` under
            ``if __name__ == "__main__":`` in scripts.
        shuffle: Mix the sample order with a permutation derived from ``seed``.
        seed: Seed of the permutation (only used with ``shuffle``).
        on_error: ``raise`` (stop at the first bad item; finished shards are kept and a re-run
            resumes) or ``skip`` (leave bad items out, list them in ``_fastload_skipped.jsonl``).
        overwrite: Replace a different dataset (or unfinished conversion) at ``dst``.
        dry_run: Plan, report, write nothing.
        map_fn: ``"module:function"`` or a picklable module-level function taking a sample
            (``{"__key__": str, field: bytes}``) and returning a sample or ``None`` to drop it. It
            runs in the worker processes (imported by name there). The current directory is
            appended to ``sys.path`` (here and in the workers), so ``"mymap:fn"`` finds
            ``./mymap.py``. When it raises, the item error names the item and where it raised,
            and carries the function's traceback as a note.
        source_type: Force the source type (``imagefolder``, ``files``, ``jsonl``, ``text``,
            ``csv``, ``parquet``, ``shards``) instead of detecting it.
        prefix: Shard name prefix: shards are ``{prefix}-{n:06d}.{tar|tfrecord|lmdb}``.
        quiet: No progress output or summary.
        store_options: Options for the destination store (e.g. ``endpoint_url``).
        source_options: Options for the source store.
        progress_stream: Where progress and the summary go (default ``sys.stderr``).

    Returns:
        A :class:`ConvertResult`.

    On Ctrl-C (``KeyboardInterrupt``) the workers finish the shards they are writing; the
    exception then gets a note saying how many shards were done and that re-running resumes (also
    printed unless ``quiet``).

    Raises:
        InvalidArgumentError: Bad options, empty input, or ``dst`` inside ``src``.
        DatasetExistsError: ``dst`` already holds a different dataset and ``overwrite`` is False,
            or another conversion is writing into the local directory ``dst`` (see the README's
            "What killed runs leave, and one conversion at a time").
        StoreError: The destination ran out of space (or a file size limit was reached); the
            message names the shard and says to free space and re-run, which resumes.
        ConversionError: An input item is bad and ``on_error="raise"``; the message names it.
        ObjectNotFoundError: ``src`` does not exist.
    """
    start = time.monotonic()
    if on_error not in ("raise", "skip"):
        raise InvalidArgumentError(
            f"{_option('on_error')} must be 'raise' or 'skip', got {on_error!r}"
        )
    fmt = get_format(format)
    format_name = FORMATS.canonical(format)
    try:
        size_limit = parse_size(shard_size) if shard_size is not None else None
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{_option('shard_size')}: {exc}") from None
    if shard_samples is not None and (
        not isinstance(shard_samples, int) or isinstance(shard_samples, bool) or shard_samples <= 0
    ):
        raise InvalidArgumentError(
            f"{_option('shard_samples')} must be a positive integer, got {shard_samples!r}"
        )
    if size_limit is None and shard_samples is None:
        size_limit = DEFAULT_SHARD_SIZE
    n_workers = (os.cpu_count() or 1) if workers is None else workers
    if not isinstance(n_workers, int) or isinstance(n_workers, bool) or n_workers < 1:
        raise InvalidArgumentError(f"{_option('workers')} must be at least 1, got {workers!r}")
    if not prefix or "/" in prefix or prefix.startswith((".", "_")):
        raise InvalidArgumentError(
            f"{_option('prefix')} {prefix!r} must be a non-empty name without '/' that does not "
            "start with '.' or '_'"
        )
    map_dir = os.getcwd() if isinstance(map_fn, str) else None
    _resolve_map(map_fn, map_dir)  # fail early, in the parent, for a bad spec
    stream = progress_stream if progress_stream is not None else sys.stderr

    pool: _Pool | None = None
    guard: _Guard | None = None
    dst_store: Store | None = None
    planned: list[ShardPlan] | None = None  # for the message of an interruption
    phase = "planning"
    interrupted: KeyboardInterrupt | None = None
    try:
        source = open_source(src, source_type=source_type, store_options=source_options)
        said: list[str] = []

        def warn() -> None:
            """Print the source's warnings not printed yet (unless quiet)."""
            for text in source.warnings:
                if text not in said:
                    said.append(text)
                    if not quiet:
                        stream.write(f"fastload convert: warning: {text}\n")
                        stream.flush()

        warn()
        dst_store = open_store(dst, **dict(store_options or {}))
        _check_not_inside(source, dst_store)
        use_pool = (
            n_workers > 1
            and not dry_run
            and not isinstance(dst_store, MemoryStore)
            and not isinstance(source.store, MemoryStore)
        )
        # Workers that import fastload (forkserver, spawn) start now, importing while this process
        # plans. Forked workers start when the jobs are known: forking costs little, and forked
        # children would slow the planning here (copy-on-write faults, CPU).
        if use_pool and _pool_context().get_start_method() != "fork":
            pool = _Pool(n_workers, fmt)

        # 1. plan
        plan_skipped: list[SkippedItem] = []

        def report(item: str, reason: str) -> None:
            if on_error == "raise":
                raise ConversionError(
                    f"cannot convert {source.store.child_url(item) if ':' not in item else item}: "
                    f"{reason}; fix the input, or pass on_error='skip' (--on-error skip) to leave "
                    f"it out and list it in {SKIPPED_KEY}"
                )
            plan_skipped.append(SkippedItem(item, reason, None))

        units = source.plan_units(report)
        warn()
        if not units:
            raise InvalidArgumentError(
                f"no samples to convert in {source.store.url} (source type {source.type_name}"
                + (
                    f"; {plural(len(plan_skipped), 'item')} skipped, see the reasons above"
                    if plan_skipped
                    else ""
                )
                + "); check the path and --source-type"
            )
        if shuffle:
            units = shuffle_units(units, seed)
        shards = plan_shards(
            units,
            format_name=format_name,
            extension=fmt.extension,
            prefix=prefix,
            shard_samples=shard_samples,
            shard_size=size_limit,
        )
        options = {
            "format": format_name,
            "shard_size": size_limit,
            "shard_samples": shard_samples,
            "shuffle": bool(shuffle),
            "seed": int(seed) if shuffle else None,
            "prefix": prefix,
            "map": _map_name(map_fn),
            "source_type": SOURCES.canonical(source.type_name),
        }
        described = source.describe()
        digest = plan_hash(described, options, shards)
        planned = shards
        est_bytes = sum(s.est_bytes for s in shards)
        progress = Progress(len(units), est_bytes, quiet=quiet or dry_run, stream=stream)

        if dry_run:
            result = ConvertResult(
                url=dst_store.url,
                format=format_name,
                num_samples=len(units),
                num_shards=len(shards),
                num_bytes=est_bytes,
                skipped=plan_skipped,
                dry_run=True,
                plan_sha256=digest,
                shard_names=[s.name for s in shards],
                elapsed=time.monotonic() - start,
            )
            _add_source_facts(result, source)
            if not quiet:
                _print_dry_run(stream, source, shards, result)
            return result

        # 2. destination state: ours alone from here on; what dead runs left goes
        guard = _Guard(dst_store, format_name)
        with _space_for(dst_store, PLAN_KEY):
            guard.acquire()
        old = _existing_manifest(dst_store)
        if (
            isinstance(old, Manifest)
            and old.created_by.get("plan_sha256") == digest
            and not overwrite
        ):
            dst_store.delete_many(dst_store.list_keys(STATE_PREFIX))
            result = _result_from_manifest(dst_store, old, digest, start, plan_skipped)
            _add_source_facts(result, source)
            result.unchanged = True
            progress.close()
            if not quiet:
                progress.message(result.summary())
            return result
        resume = False
        try:
            plan_doc = json.loads(dst_store.get(PLAN_KEY))
        except ObjectNotFoundError:
            plan_doc = None
        except ValueError:
            plan_doc = {}
        if not overwrite:
            if old is not None:
                raise DatasetExistsError(
                    f"{dst_store.url} already holds a different dataset ({MANIFEST_NAME} was made from "
                    "another source or with other options); pass overwrite=True (--overwrite) to "
                    "replace it, or choose another destination"
                )
            if plan_doc is not None:
                if plan_doc.get("plan_sha256") != digest:
                    raise DatasetExistsError(
                        f"{dst_store.url} holds an unfinished conversion of a different input or with "
                        f"other options ({PLAN_KEY}); re-run that command to finish it, or pass "
                        "overwrite=True (--overwrite) to start over"
                    )
                resume = True
            else:
                pattern = _shard_pattern(prefix)
                clash = [m.key for m in dst_store.list(f"{prefix}-") if pattern.match(m.key)]
                if clash:
                    raise DatasetExistsError(
                        f"{dst_store.url} already holds shards such as {clash[0]!r} that no fastload "
                        "conversion plan accounts for; pass overwrite=True (--overwrite) to replace "
                        "them, or choose another destination or prefix"
                    )
        else:
            _clear_destination(dst_store, old if isinstance(old, Manifest) else None, prefix)
        guard.abort_uploads(prefix)
        if not resume:
            with _space_for(dst_store, PLAN_KEY):
                dst_store.put(
                    PLAN_KEY,
                    _json_bytes(
                        {
                            "fastload_convert_plan": _PLAN_VERSION,
                            "plan_sha256": digest,
                            "source": described,
                            "options": options,
                            "num_samples": len(units),
                            "num_shards": len(shards),
                            "est_bytes": est_bytes,
                        }
                    ),
                )

        # 3. shards
        phase = "writing"
        records: dict[str, dict[str, Any]] = {}
        if resume:
            for shard in shards:
                record = _valid_done(dst_store, shard.name, digest)
                if record is not None:
                    records[shard.name] = record
        resumed = len(records)
        done_samples = sum(r["info"]["num_samples"] for r in records.values())
        done_bytes = sum(r["info"]["num_bytes"] for r in records.values())
        progress.update(done_samples, done_bytes)
        if resumed and not quiet:
            progress.message(
                f"resuming: {resumed} of {plural(len(shards), 'shard')} "
                f"{'is' if resumed == 1 else 'are'} already done"
            )
        jobs = [
            _ShardJob(source, dst_store, format_name, shard, map_fn, on_error, digest, map_dir)
            for shard in shards
            if shard.name not in records
        ]
        if pool is None and use_pool and len(jobs) > 1:
            pool = _Pool(min(n_workers, len(jobs)), fmt)
        try:
            if pool is None or len(jobs) <= 1:
                _run_in_process(jobs, records, progress, done_samples, done_bytes)
            else:
                if map_fn is not None and not isinstance(map_fn, str):
                    _check_picklable(map_fn)
                _run_pool(pool, jobs, records, progress, done_samples, done_bytes)
        finally:
            progress.close()

        # 4. finish: skip report, manifest (last), state cleanup
        phase = "finishing"
        skipped = list(plan_skipped)
        infos: list[ShardInfo] = []
        dropped = 0
        for shard in shards:
            record = records[shard.name]
            skipped.extend(
                SkippedItem(s["item"], s["reason"], s["shard"]) for s in record["skipped"]
            )
            dropped += int(record["dropped"])
            info = record["info"]
            infos.append(
                ShardInfo(
                    info["key"],
                    info["num_samples"],
                    info["num_bytes"],
                    info["sha256"],
                    info["index_key"],
                    dict(info["fields"]),
                )
            )
        if skipped:
            with _space_for(dst_store, SKIPPED_KEY):
                dst_store.put(
                    SKIPPED_KEY,
                    "".join(
                        json.dumps(s.to_json(), sort_keys=True, ensure_ascii=False) + "\n"
                        for s in skipped
                    ).encode("utf-8"),
                )
        else:
            dst_store.delete_many([SKIPPED_KEY])
        import fastload

        manifest = Manifest(
            format=format_name,
            shards=[ShardEntry.from_info(i) for i in infos],
            schema=Manifest.schema_from_fields(i.fields for i in infos),
            created_by={
                "tool": "fastload convert",
                "version": fastload.__version__,
                "source": described,
                "options": options,
                "plan_sha256": digest,
                "skipped": len(skipped),
                "dropped": dropped,
            },
            metadata=source.metadata(),
        )
        with _space_for(dst_store, MANIFEST_NAME):
            write_manifest(dst_store, manifest)
        dst_store.delete_many(dst_store.list_keys(STATE_PREFIX))
        result = ConvertResult(
            url=dst_store.url,
            format=format_name,
            num_samples=manifest.num_samples,
            num_shards=len(manifest.shards),
            num_bytes=manifest.num_bytes,
            skipped=skipped,
            dropped=dropped,
            elapsed=time.monotonic() - start,
            resumed_shards=resumed,
            plan_sha256=digest,
            manifest=manifest,
            skipped_report=dst_store.child_url(SKIPPED_KEY) if skipped else None,
            shard_names=[s.name for s in manifest.shards],
        )
        _add_source_facts(result, source)
        if not quiet:
            progress.message(result.summary())
        return result
    except KeyboardInterrupt as exc:
        interrupted = exc
        if pool is not None and phase == "writing" and not quiet:
            stream.write(
                "fastload convert: interrupted; the workers finish the shards they are writing "
                "(Ctrl-C again to stop at once; those shards are then written again by a re-run)\n"
            )
            stream.flush()
        raise
    finally:
        try:
            if pool is not None:
                pool.shutdown()  # waits for the workers: their writers are done after it
        finally:
            if guard is not None:
                guard.release()
            if interrupted is not None:
                text = _interrupted(dst_store, planned if phase != "planning" else None, phase)
                interrupted.add_note(text)
                if not quiet:
                    stream.write(f"fastload convert: {text}\n")
                    stream.flush()


def _option(name: str) -> str:
    """An option as messages name it, for the Python API and the command line at once:
    ``shard_samples (--shard-samples)``."""
    flag = {"map_fn": "--map"}.get(name, "--" + name.replace("_", "-"))
    return f"{name} ({flag})"


def _add_source_facts(result: ConvertResult, source: Source) -> None:
    """Fill in what the summary says about the source: its type, classes, files left out."""
    result.source_type = SOURCES.canonical(source.type_name)
    classes = source.metadata().get("classes")
    result.num_classes = len(classes) if isinstance(classes, list) else None
    result.ignored = len(source.ignored)
    result.warnings = list(source.warnings)


def _interrupted(store: Store | None, shards: Sequence[ShardPlan] | None, phase: str) -> str:
    """How far an interrupted conversion got, and what to do about it."""
    if shards is None or store is None:
        return (
            "interrupted while planning, before anything was written; re-run the same command "
            "to start again"
        )
    if phase == "finishing":
        return (
            "interrupted while finishing (every shard was written); re-run the same command to "
            "complete the dataset"
        )
    try:
        done_keys = set(store.list_keys(DONE_PREFIX))
    except (FastloadError, OSError):
        done_keys = set()
    done = [s for s in shards if _done_key(s.name) in done_keys]
    samples = sum(len(s.units) for s in shards)
    if len(done) == len(shards):
        return (
            f"interrupted after writing every shard ({len(shards)} of {len(shards)}), before the "
            "manifest; re-run the same command to complete the dataset"
        )
    return (
        f"interrupted after {len(done)} of {plural(len(shards), 'shard')} "
        f"({sum(len(s.units) for s in done)} of {plural(samples, 'sample')}); re-run the same "
        "command to resume: the finished shards are kept"
    )


def _check_not_inside(source: Source, dst: Store) -> None:
    src_root = getattr(source.store, "root", None)
    dst_root = getattr(dst, "root", None)
    if not isinstance(src_root, str) or not isinstance(dst_root, str) or source.keys is not None:
        return
    src_real, dst_real = os.path.realpath(src_root), os.path.realpath(dst_root)
    if dst_real == src_real or dst_real.startswith(src_real.rstrip(os.sep) + os.sep):
        raise InvalidArgumentError(
            f"the destination {dst.url} is inside the source {source.store.url}; the shards would "
            "become part of the input. Choose a destination outside the source directory"
        )


def _check_picklable(map_fn: MapFn) -> None:
    try:
        pickle.dumps(map_fn)
    except Exception as exc:
        raise InvalidArgumentError(
            f"map_fn {map_fn!r} cannot be sent to worker processes ({exc}); pass a module-level "
            "function or its name as 'module:function', or use workers=1"
        ) from exc


def _run_in_process(
    jobs: Sequence[_ShardJob],
    records: dict[str, dict[str, Any]],
    progress: Progress,
    base_samples: int,
    base_bytes: int,
) -> None:
    global _COUNTERS
    counters = _Counters()
    previous, _COUNTERS = _COUNTERS, counters

    def on_written() -> None:
        s, b = counters.totals()
        progress.update(base_samples + s, base_bytes + b)

    try:
        for record in _write_shards(iter(jobs), on_written):
            records[record["shard"]] = record
    finally:
        _COUNTERS = previous


class _Pool:
    """Worker processes for shard jobs (see :func:`_pool_context` for the start method; a
    forkserver preloads the conversion and format writer modules).

    Each worker runs one long task, :func:`_run_worker`, which takes pickled jobs from a shared
    queue in plan order (so faster workers take more shards) and commits each shard while it writes
    the next. Forked workers start with the parent's objects frozen (``gc.freeze``), so their
    garbage collector does not touch, and so copy, the parent's heap (e.g. the plan).
    """

    def __init__(self, n_workers: int, fmt: Format) -> None:
        ctx = _pool_context()
        if ctx.get_start_method() == "forkserver":
            # Only takes effect if this process's forkserver is not running yet.
            ctx.set_forkserver_preload([__name__, fmt.writer.__module__])
        self.n_workers = n_workers
        self.samples, self.nbytes = ctx.Value("q", 0), ctx.Value("q", 0)
        self.counters = _Counters(self.samples, self.nbytes)
        self.jobs: Any = ctx.Queue()
        # Jobs left in the queue when the workers stop are dropped, not waited for.
        self.jobs.cancel_join_thread()
        self.stop: Any = ctx.Value("b", 0)
        self.executor = ProcessPoolExecutor(
            max_workers=n_workers,
            mp_context=ctx,
            initializer=_init_worker,
            initargs=(self.samples, self.nbytes, self.jobs, self.stop, os.getpid()),
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

    def shutdown(self) -> None:
        """Stop the workers after the shard each is writing (and committing), and wait for them."""
        self.stop.value = 1
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.jobs.close()


def _run_pool(
    pool: _Pool,
    jobs: Sequence[_ShardJob],
    records: dict[str, dict[str, Any]],
    progress: Progress,
    base_samples: int,
    base_bytes: int,
) -> None:
    # Pickled here, so that an unpicklable job fails now (the queue would pickle it in a thread).
    for job in jobs:
        pool.jobs.put(pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL))
    runners = min(pool.n_workers, len(jobs))
    for _ in range(runners):
        pool.jobs.put(None)
    pending = {pool.executor.submit(_run_worker) for _ in range(runners)}
    failure: BaseException | None = None
    while pending:
        finished, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
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
                records[record["shard"]] = record
        if failure is not None:
            pool.shutdown()
            raise failure
        s, b = pool.counters.totals()
        progress.update(base_samples + s, base_bytes + b)
    missing = [job.shard.name for job in jobs if job.shard.name not in records]
    if missing:  # cannot happen unless a worker lost jobs; never write a manifest without them
        raise WorkerError(
            f"conversion workers finished without writing {plural(len(missing), 'shard')} (first: "
            f"{missing[0]}); re-run the same command to resume"
        )


def _result_from_manifest(
    store: Store, manifest: Manifest, digest: str, start: float, plan_skipped: list[SkippedItem]
) -> ConvertResult:
    skipped: list[SkippedItem] = []
    try:
        for line in store.get(SKIPPED_KEY).decode("utf-8").splitlines():
            doc = json.loads(line)
            skipped.append(SkippedItem(doc["item"], doc["reason"], doc.get("shard")))
    except (ObjectNotFoundError, ValueError, KeyError):
        skipped = list(plan_skipped)
    return ConvertResult(
        url=store.url,
        format=manifest.format,
        num_samples=manifest.num_samples,
        num_shards=len(manifest.shards),
        num_bytes=manifest.num_bytes,
        skipped=skipped,
        dropped=int(manifest.created_by.get("dropped", 0)),
        elapsed=time.monotonic() - start,
        resumed_shards=len(manifest.shards),
        plan_sha256=digest,
        manifest=manifest,
        skipped_report=store.child_url(SKIPPED_KEY) if skipped else None,
        shard_names=[s.name for s in manifest.shards],
    )


def _print_dry_run(
    stream: IO[str], source: Source, shards: Sequence[ShardPlan], result: ConvertResult
) -> None:
    lines = [
        f"source: {source.store.url} ({source.type_name})",
        f"destination: {result.url} ({result.format})",
        f"samples: {result.num_samples}",
        f"shards: {result.num_shards} (about {format_bytes(result.num_bytes)} in all)",
    ]
    for shard in list(shards[:5]):
        lines.append(
            f"  {shard.name}: {plural(len(shard.units), 'sample')}, "
            f"~{format_bytes(shard.est_bytes)}"
        )
    if len(shards) > 5:
        lines.append(f"  ... and {len(shards) - 5} more")
    for item in result.skipped[:20]:
        lines.append(f"would skip {item.item}: {item.reason}")
    if len(result.skipped) > 20:
        lines.append(f"... and {plural(len(result.skipped) - 20, 'more item')} would be skipped")
    lines.append(result.summary())
    stream.write("\n".join(lines) + "\n")
    stream.flush()
