"""Parsed shard indexes kept as files that every process maps: parsed once per machine, held once.

A parsed index (TFRecord's record boundaries, WebDataset's compact arrays) is a few NumPy arrays.
:mod:`~fastload.formats._cache._parsed` keeps them per process; without this module every worker
of every epoch parses every shard's index again (~4 ms for 10^5 TFRecord records, ~150 ms for
10^5 WebDataset samples) and holds a private copy while its reader is open (at 10^8 samples in
1,000 shards: +400 MB per worker for TFRecord, ~3.7 GB for WebDataset). So the first process to
parse an index writes its arrays to a file here, and every process then maps that file
read-only: the arrays are page cache, clean and shared by every process of the machine, dropped
by the kernel under memory pressure and read back on use, never private memory.

Where, and how much: :class:`~fastload.formats._cache.CacheConfig`'s ``index_dir`` (``None``
turns the files off) and ``index_dir_bytes``, read once per process (by default from
``$FASTLOAD_INDEX_DIR`` and ``$FASTLOAD_INDEX_CACHE_BYTES``: ``~/.cache/fastload/indexes``,
4 GiB). :func:`index_files` gives the :class:`IndexFiles` of the current settings: the one object
that holds the directory, its budget and its trimming. A file's name is a digest of the index's
kind, both files' real paths and their identities (device, inode, size, modification and change
times): a shard or index written again gets another name, and the old file is never read again.
Only indexes of files modified at least :data:`~fastload.formats._cache.STABLE_AGE_NS` before
the parse are written (the rule the in-process cache keeps). The directory's size is checked at
a process's first write and after each 1/64 of the budget written; beyond the budget the files
written or used longest ago are removed. The directory also holds the trust records
(:mod:`~fastload.formats._cache._trust`: empty files, counted as one block each).

A file is ``MAGIC``, an 8-byte little-endian header length, a JSON header (the kind, the arrays'
names, dtypes, lengths and offsets, the parser's small values, and a BLAKE2b digest of the array
bytes) and the arrays, each at a multiple of 64 bytes. It is written to a temporary file and
renamed (atomic), and checked whole when mapped (the digest: ~1 ms a MB): a damaged, truncated
or foreign file is ignored and the index parsed again. Nothing here raises for a directory that
cannot be written or read: the parse is then used as before.

The mapping holds no file descriptor (:func:`fastload._os.map_read_only`; Python's ``mmap``
before 3.13 keeps one open per mapping); it is unmapped when the last array over it goes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from fastload._os import map_read_only
from fastload.formats._cache._config import CacheConfig, config

__all__ = ["MAGIC", "MARK", "IndexFiles", "entry_name", "index_files"]

log = logging.getLogger("fastload.formats")

MAGIC = b"FLIDX01\n"
#: The suffix of the empty files that record a fact (:meth:`IndexFiles.mark`).
MARK = ".ok"
_BLOCK = 4096
#: A file used this much later than its modification time is touched (its age orders the trim).
_USED_NS = 3600 * 10**9
#: A temporary file this much older than a trim belongs to a writer that died.
_ABANDONED_NS = 3600 * 10**9
_ALIGN = 64
_SUFFIX = ".fidx"
#: The directory's size is checked after a process wrote this fraction of the budget since its
#: last check (and at its first write): it may exceed the budget by about that much per process.
_TRIM_EVERY = 64


def entry_name(kind: str, paths: tuple[str, str], stamps: tuple[tuple[int, ...], ...]) -> str:
    """The file name of the index of kind ``kind`` parsed from ``paths`` (shard, index) whose
    identities are ``stamps``."""
    who = json.dumps([kind, [os.path.realpath(p) for p in paths], [list(s) for s in stamps]])
    return hashlib.blake2b(who.encode(), digest_size=20).hexdigest() + _SUFFIX


def _digest(arrays: dict[str, npt.NDArray[Any]]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(arrays):
        h.update(np.ascontiguousarray(arrays[name]).view(np.uint8).data)
    return h.hexdigest()


class IndexFiles:
    """The directory of parsed index files and trust records, its budget and its trimming.

    Args:
        directory: Where the files are.
        budget: The most bytes the directory holds (see module doc).
    """

    def __init__(self, directory: Path, budget: int) -> None:
        self.directory, self.budget = directory, budget
        #: Bytes this process wrote since its last check of the directory's size (the first
        #: write checks).
        self.unchecked = 1 << 62
        self._lock = threading.Lock()

    def save(
        self, name: str, kind: str, arrays: dict[str, npt.NDArray[Any]], values: dict[str, Any]
    ) -> bool:
        """Write the index file ``name`` (``arrays`` and the JSON-able ``values``) atomically;
        whether it was written (never raises for a file system problem)."""
        where = self.directory
        specs: list[tuple[str, str, int, int]] = []
        offset = 0
        for key in sorted(arrays):
            array = np.ascontiguousarray(arrays[key])
            specs.append((key, array.dtype.str, int(array.size), offset))
            offset += -(-array.nbytes // _ALIGN) * _ALIGN
        header = json.dumps(
            {"kind": kind, "arrays": specs, "values": values, "digest": _digest(arrays)}
        ).encode()
        start = -(-(len(MAGIC) + 8 + len(header)) // _ALIGN) * _ALIGN
        try:
            where.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=_SUFFIX, dir=where)
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(MAGIC + len(header).to_bytes(8, "little") + header)
                    out.write(bytes(start - out.tell()))
                    for key, _, _, at in specs:
                        out.write(bytes(start + at - out.tell()))
                        out.write(np.ascontiguousarray(arrays[key]).view(np.uint8).data)
                os.replace(tmp, where / name)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as exc:
            log.debug("cannot keep the parsed index %s in %s: %s", name, where, exc)
            return False
        with self._lock:
            self.unchecked += start + offset
            due = self.unchecked > self.budget // _TRIM_EVERY  # not at every write
            if due:
                self.unchecked = 0
        if due:
            self.trim()
        return True

    def load(
        self, name: str, kind: str
    ) -> tuple[dict[str, npt.NDArray[Any]], dict[str, Any]] | None:
        """The arrays (mapped, read-only) and values of index file ``name`` of kind ``kind``;
        ``None`` when there is none or it is damaged, truncated or of another kind."""
        path = self.directory / name
        found = map_read_only(path)
        if found is None:
            return None
        view, st = found
        raw = np.frombuffer(view, dtype=np.uint8)
        try:
            if bytes(raw[: len(MAGIC)]) != MAGIC:
                return None
            length = int.from_bytes(bytes(raw[len(MAGIC) : len(MAGIC) + 8]), "little")
            header = json.loads(bytes(raw[len(MAGIC) + 8 : len(MAGIC) + 8 + length]))
            if header.get("kind") != kind:
                return None
            start = -(-(len(MAGIC) + 8 + length) // _ALIGN) * _ALIGN
            arrays: dict[str, npt.NDArray[Any]] = {}
            for key, dtype, count, at in header["arrays"]:
                width = np.dtype(dtype).itemsize
                lo = start + int(at)
                if lo + int(count) * width > len(raw):
                    return None
                arrays[key] = raw[lo : lo + int(count) * width].view(dtype)
            if _digest(arrays) != header["digest"]:
                return None
            values: dict[str, Any] = header["values"]
        except (ValueError, TypeError, KeyError, IndexError):
            return None
        if st.st_mtime_ns < time.time_ns() - _USED_NS:  # used now: trimmed last (at most hourly)
            with contextlib.suppress(OSError):
                os.utime(path)
        return arrays, values

    def mark(self, name: str) -> None:
        """Create the empty file ``name`` in the directory (a record that something was found
        true: :mod:`~fastload.formats._cache._trust`'s; trimmed with the index files, counted as
        one block each); never raises for a file system problem."""
        path = self.directory / name
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644))
        except OSError as exc:
            log.debug("cannot record %s: %s", path, exc)

    def marked(self, name: str) -> bool:
        """Whether the record ``name`` (:meth:`mark`) is there (one ``stat``)."""
        return os.path.exists(self.directory / name)

    def trim(self) -> None:
        """Remove the files written or used longest ago while the directory holds more than the
        budget (down to 90 % of it), and temporary files older than an hour (left by a writer
        that was killed)."""
        where, budget = self.directory, self.budget
        try:
            files = []
            total = 0
            with os.scandir(where) as entries:
                for entry in entries:
                    if entry.name.startswith(".tmp-"):  # a writer's; one killed left it behind
                        with contextlib.suppress(OSError):
                            if entry.stat().st_mtime_ns < time.time_ns() - _ABANDONED_NS:
                                os.unlink(entry.path)
                        continue
                    if entry.name.endswith((_SUFFIX, MARK)):
                        st = entry.stat()
                        size = max(st.st_size, _BLOCK)  # an empty record still takes an inode
                        files.append((st.st_mtime_ns, size, entry.path))
                        total += size
            if total <= budget:
                return
            files.sort()
            for _, size, path in files:
                if total <= budget * 9 // 10:
                    break
                with contextlib.suppress(OSError):
                    os.unlink(path)
                    total -= size
        except OSError as exc:
            log.debug("cannot trim the parsed indexes in %s: %s", where, exc)


class _Made:
    """The :class:`IndexFiles` made for one :class:`CacheConfig` (remade when it changes)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.made: tuple[CacheConfig, IndexFiles | None] | None = None


_MADE = _Made()


def index_files() -> IndexFiles | None:
    """The index files of this process's settings (:func:`~fastload.formats._cache.config`), or
    ``None`` when they are turned off."""
    settings = config()
    made = _MADE.made
    if made is not None and made[0] is settings:
        return made[1]
    with _MADE.lock:
        made = _MADE.made
        if made is None or made[0] is not settings:
            where = settings.index_dir
            made = (
                settings,
                None if where is None else IndexFiles(where, settings.index_dir_bytes),
            )
            _MADE.made = made
    return made[1]
