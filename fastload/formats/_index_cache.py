"""Parsed shard indexes kept per process, so that reopening a shard costs two ``stat`` calls.

The block shuffle reads from many more shards than a thread's reader cache keeps open
(``max_open_shards``), so shard readers are closed and made again all the time. A reader with a
separate index file (WebDataset's ``.tar.idx``, TFRecord's ``.tfrecord.idx``) would read and
parse that file each time: ~1 s for a WebDataset shard of 100,000 samples before this cache. A
reader of a shard and an index that are both local files (a local directory, or a
:class:`~fastload.storage.CachingStore`'s copies) therefore asks :func:`cached` for the parsed
index: the first reader of the pair in a process parses it, the next ones take it over after one
``stat`` of each file. With a ``codec`` the parse is also written to the machine's index files
and mapped from there (:mod:`~fastload.formats._index_files`): other processes map it instead
of parsing, and every process's entry is shared page cache rather than private memory. Nothing
here holds a file open: an entry is parsed or mapped data (compact NumPy arrays), so a cache may
evict and replace the shard files at any time.

An entry is used only if both files are unchanged: same device, inode, size, modification and
change time, and both modification times were at least :data:`STABLE_AGE_NS` older than the parse (a change within
the file system's timestamp granularity of the parse could keep the time; Git's "racy" rule,
the rule LMDB environments are kept by too). A changed file is parsed again; an index that fails
to parse is never kept. Entries survive ``fork`` (they are plain data, shared copy-on-write).

The :data:`budget` bounds what a process keeps: entries are dropped, least recently used first,
while there are more than ``budget.entries`` or they hold more than ``budget.nbytes`` bytes.
Thread-safe.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

import numpy.typing as npt

from fastload.formats import _index_files

__all__ = [
    "STABLE_AGE_NS",
    "Codec",
    "FileStamp",
    "IndexBudget",
    "budget",
    "cached",
    "clear",
    "held_bytes",
    "parse_count",
    "settled",
    "stamp_from",
    "stamp_of",
]

log = logging.getLogger("fastload.formats")

#: How much older than a parse (or an opening) a file's modification time must be for the result
#: to be reused without reading the file again (see module doc).
STABLE_AGE_NS = 2_000_000_000


class FileStamp(NamedTuple):
    """What identifies a file's contents without reading them (``os.stat`` fields; the change
    time moves whenever the file is written or replaced and cannot be set back)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int


def stamp_of(path: str) -> FileStamp:
    """``path``'s :class:`FileStamp`.

    Raises:
        OSError: The file cannot be stat'ed.
    """
    return stamp_from(os.stat(path))


def stamp_from(st: os.stat_result) -> FileStamp:
    """The :class:`FileStamp` of a ``stat`` result (e.g. an ``fstat`` of an open file)."""
    return FileStamp(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def settled(stamp: FileStamp, at_ns: int) -> bool:
    """Whether a file last modified at ``stamp.mtime_ns`` cannot have changed, at ``at_ns``,
    without its modification time moving (it is at least :data:`STABLE_AGE_NS` older)."""
    return stamp.mtime_ns <= at_ns - STABLE_AGE_NS


@dataclass(frozen=True)
class IndexBudget:
    """What one process keeps in parsed indexes (see module doc).

    Attributes:
        entries: Parsed indexes kept.
        nbytes: Their total size in bytes (:attr:`Parsed.nbytes`).
    """

    entries: int
    nbytes: int


#: This process's budget: 65,536 indexes within 1 GiB (a WebDataset index of two fields per
#: sample takes ~26 bytes a sample plus its key, a TFRecord index 4 bytes a record; twice that
#: for shards of 4 GiB or more: 1 GiB holds ~2.9 x 10^7 and ~2.7 x 10^8 samples). Assign another :class:`IndexBudget` to change it.
budget = IndexBudget(entries=65_536, nbytes=1 << 30)


class Parsed(Protocol):
    """A parsed index: it says how many bytes it holds."""

    @property
    def nbytes(self) -> int: ...


P = TypeVar("P", bound=Parsed)

#: A parsed index as arrays and small JSON-able values, for :mod:`~fastload.formats._index_files`.
Arrays = tuple[dict[str, npt.NDArray[Any]], dict[str, Any]]


class Codec(Protocol[P]):
    """How a kind of parsed index becomes arrays (to be kept in a file) and back (from the
    file's mapped arrays)."""

    def to_arrays(self, value: P) -> Arrays: ...

    def from_arrays(self, arrays: dict[str, npt.NDArray[Any]], values: dict[str, Any]) -> P: ...


class _Entry(NamedTuple):
    stamps: tuple[FileStamp, FileStamp]
    value: Parsed


_LOCK = threading.Lock()
_TABLE: OrderedDict[tuple[str, str, str], _Entry] = OrderedDict()
_held = 0
_parses = 0


def cached(
    kind: str,
    shard: str,
    index: str,
    parse: Callable[[bytes, int], P],
    codec: Codec[P] | None = None,
) -> tuple[P, FileStamp]:
    """The index file ``index`` of the shard file ``shard`` parsed by ``parse``, from this
    process's cache, or from the machine's index files (:mod:`~fastload.formats._index_files`,
    mapped through ``codec``), or parsed now and kept (within :data:`budget`; and as a file,
    mapped from then on, with a ``codec``); and the shard's :class:`FileStamp` the parse
    belongs to.

    ``parse(index_bytes, shard_size)`` must depend only on the two files' contents (checks that
    depend on the caller, such as a manifest's sample count, belong after this call), and
    ``kind`` must name it (``"webdataset"``, ``"tfrecord"``). What ``parse`` raises propagates
    and nothing is kept.

    Raises:
        OSError: A file cannot be stat'ed or read.
    """
    global _held, _parses
    key = (kind, shard, index)
    stamps = (stamp_of(shard), stamp_of(index))
    with _LOCK:
        entry = _TABLE.get(key)
        if entry is not None and entry.stamps == stamps:
            _TABLE.move_to_end(key)
            return entry.value, stamps[0]  # type: ignore[return-value]
    now = time.time_ns()
    steady = settled(stamps[0], now) and settled(stamps[1], now)
    name = _index_files.entry_name(kind, (shard, index), stamps) if codec and steady else None
    value: P | None = None
    if codec is not None and name is not None:
        kept = _index_files.load(name, kind)
        if kept is not None:
            value = _from_arrays(codec, kept, name)
    if value is None:
        with open(index, "rb") as f:
            data = f.read()
        with _LOCK:
            _parses += 1
        value = parse(data, stamps[0].size)
        again = (stamp_of(shard), stamp_of(index))
        if codec is not None and name is not None and again == stamps:
            arrays, values = codec.to_arrays(value)
            if _index_files.save(name, kind, arrays, values):
                kept = _index_files.load(name, kind)  # the mapped copy, shared, instead
                mapped = None if kept is None else _from_arrays(codec, kept, name)
                value = value if mapped is None else mapped
    else:
        again = (stamp_of(shard), stamp_of(index))
    with _LOCK:
        old = _TABLE.pop(key, None)
        if old is not None:
            _held -= old.value.nbytes
        if again == stamps and steady:
            _TABLE[key] = _Entry(stamps, value)
            _held += value.nbytes
            _trim()
    return value, stamps[0]


def _from_arrays(codec: Codec[P], kept: Arrays, name: str) -> P | None:
    """The index from a file's arrays, or ``None`` when they do not make one (a file written by
    another version: the index is parsed again)."""
    try:
        return codec.from_arrays(*kept)
    except (KeyError, ValueError, TypeError, IndexError) as exc:
        log.debug("ignoring the parsed index file %s: %s", name, exc)
        return None


def _trim() -> None:
    global _held
    while _TABLE and (len(_TABLE) > budget.entries or _held > budget.nbytes):
        _, entry = _TABLE.popitem(last=False)
        _held -= entry.value.nbytes


def clear() -> None:
    """Drop every entry (tests; a process that wants the memory back)."""
    global _held
    with _LOCK:
        _TABLE.clear()
        _held = 0


def held_bytes() -> int:
    """Bytes this process's entries hold."""
    return _held


def parse_count() -> int:
    """How many index parses this process began in :func:`cached`, failed ones included (for
    tests and benchmarks)."""
    return _parses
