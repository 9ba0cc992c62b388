"""Parsed shard indexes kept as files that every process maps: parsed once per machine, held once.

A parsed index (TFRecord's record boundaries, WebDataset's compact arrays) is a few NumPy arrays.
:mod:`~fastload.formats._index_cache` keeps them per process; without this module every worker of
every epoch parses every shard's index again (~4 ms for 10^5 TFRecord records, ~150 ms for 10^5
WebDataset samples) and holds a private copy while its reader is open (at 10^8 samples in 1,000
shards: +400 MB per worker for TFRecord, ~3.7 GB for WebDataset). So the first process to parse
an index writes its arrays to a file here, and every process then maps that file read-only:
the arrays are page cache, clean and shared by every process of the machine, dropped by the
kernel under memory pressure and read back on use, never private memory.

Where: ``$FASTLOAD_INDEX_DIR`` (an empty value turns the files off), else
``$XDG_CACHE_HOME/fastload/indexes``, else ``~/.cache/fastload/indexes``. A file's name is a
digest of the index's kind, both files' real paths and their identities (device, inode, size,
modification and change times): a shard or index written again gets another name, and the old
file is never read again. Only indexes of files modified at least
:data:`~fastload.formats._index_cache.STABLE_AGE_NS` before the parse are written (the rule the
in-process cache keeps). The directory holds at most :func:`budget_bytes` (``$FASTLOAD_INDEX_
CACHE_BYTES``, default 4 GiB, checked at a process's first write and after each 1/64 of it
written); beyond it the files written or used longest ago are removed.

A file is ``MAGIC``, an 8-byte little-endian header length, a JSON header (the kind, the arrays'
names, dtypes, lengths and offsets, the parser's small values, and a BLAKE2b digest of the array
bytes) and the arrays, each at a multiple of 64 bytes. It is written to a temporary file and
renamed (atomic), and checked whole when mapped (the digest: ~1 ms a MB): a damaged, truncated
or foreign file is ignored and the index parsed again. Nothing here raises for a directory that
cannot be written or read: the parse is then used as before.

The mapping is made with ``mmap(2)`` through ``ctypes`` so that it holds no file descriptor
(Python's ``mmap`` keeps one open per mapping); it is unmapped when the last array over it goes.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import mmap
import os
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["MAGIC", "MARK", "budget_bytes", "directory", "entry_name", "load", "mark", "save"]

log = logging.getLogger("fastload.formats")

MAGIC = b"FLIDX01\n"
#: The suffix of the empty files that record a fact (:func:`mark`).
MARK = ".ok"
_BLOCK = 4096
#: A file used this much later than its modification time is touched (its age orders the trim).
_USED_NS = 3600 * 10**9
#: A temporary file this much older than a trim belongs to a writer that died.
_ABANDONED_NS = 3600 * 10**9
_ALIGN = 64
_DEFAULT_BUDGET = 4 << 30
_SUFFIX = ".fidx"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
#: The directory's size is checked after a process wrote this fraction of the budget since its
#: last check (and at its first write): it may exceed the budget by about that much per process.
_TRIM_EVERY = 64
_unchecked = 1 << 62  # bytes written since the last check: the first write checks


def directory() -> Path | None:
    """Where the index files are, or ``None`` when they are turned off (see module doc)."""
    value = os.environ.get("FASTLOAD_INDEX_DIR")
    if value is not None:
        return Path(value) if value else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fastload" / "indexes"


def budget_bytes() -> int:
    """The most the directory holds (``$FASTLOAD_INDEX_CACHE_BYTES``, default 4 GiB)."""
    try:
        return int(os.environ.get("FASTLOAD_INDEX_CACHE_BYTES", _DEFAULT_BUDGET))
    except ValueError:
        return _DEFAULT_BUDGET


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


def save(name: str, kind: str, arrays: dict[str, npt.NDArray[Any]], values: dict[str, Any]) -> bool:
    """Write the index file ``name`` (``arrays`` and the JSON-able ``values``) atomically;
    whether it was written (never raises for a file system problem)."""
    where = directory()
    if where is None:
        return False
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
    global _unchecked
    _unchecked += start + offset
    budget = budget_bytes()
    if _unchecked > budget // _TRIM_EVERY:  # the whole directory is read: not at every write
        _unchecked = 0
        _trim(where, budget)
    return True


def mark(path: str) -> None:
    """Create the empty file ``path`` in the directory (a record that something was found true,
    e.g. :mod:`~fastload.formats._verified`'s; trimmed with the index files, counted as one
    block each); never raises for a file system problem."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644))
    except OSError as exc:
        log.debug("cannot record %s: %s", path, exc)


def _map(path: Path) -> tuple[npt.NDArray[np.uint8], int] | None:
    """The file mapped read-only as bytes, holding no descriptor, and its modification time;
    ``None`` if it cannot be mapped."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        size = st.st_size
        if size == 0:
            return None
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    if addr is None or addr == _MAP_FAILED:
        return None
    pages = (ctypes.c_uint8 * size).from_address(addr)
    weakref.finalize(pages, _libc.munmap, addr, size)  # after the last array over it
    array: npt.NDArray[np.uint8] = np.frombuffer(memoryview(pages).cast("B"), dtype=np.uint8)
    array.flags.writeable = False
    return array, st.st_mtime_ns


def load(name: str, kind: str) -> tuple[dict[str, npt.NDArray[Any]], dict[str, Any]] | None:
    """The arrays (mapped, read-only) and values of index file ``name`` of kind ``kind``;
    ``None`` when there is none or it is damaged, truncated or of another kind."""
    where = directory()
    if where is None:
        return None
    found = _map(where / name)
    if found is None:
        return None
    raw, mtime_ns = found
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
    if mtime_ns < time.time_ns() - _USED_NS:  # used now: trimmed last (a write at most hourly)
        with contextlib.suppress(OSError):
            os.utime(where / name)
    return arrays, values


def _trim(where: Path, budget: int) -> None:
    """Remove the files written or used longest ago while the directory holds more than
    ``budget`` bytes (down to 90 % of it), and temporary files older than an hour (left by a
    writer that was killed)."""
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
