"""Parsed shard indexes kept per process, so that reopening a shard costs two ``stat`` calls.

The block shuffle reads from many more shards than a thread's reader cache keeps open
(``max_open_shards``), so shard readers are closed and made again all the time. A reader with a
separate index file (WebDataset's ``.tar.idx``, TFRecord's ``.tfrecord.idx``) would read and
parse that file each time: ~1 s for a WebDataset shard of 100,000 samples before this cache. A
reader of a shard and an index that are both local files (a local directory, or a
:class:`~fastload.storage.CachingStore`'s copies) therefore asks :func:`cached` for the parsed
index: the first reader of the pair in a process parses it, the next ones take it over after one
``stat`` of each file. Nothing here holds a file open: an entry is parsed data (compact NumPy
arrays), so a cache may evict and replace the files at any time.

An entry is used only if both files are unchanged: same device, inode, size and modification
time, and both times were at least :data:`STABLE_AGE_NS` older than the parse (a change within
the file system's timestamp granularity of the parse could keep the time; Git's "racy" rule,
the rule LMDB environments are kept by too). A changed file is parsed again; an index that fails
to parse is never kept. Entries survive ``fork`` (they are plain data, shared copy-on-write).

The :data:`budget` bounds what a process keeps: entries are dropped, least recently used first,
while there are more than ``budget.entries`` or they hold more than ``budget.nbytes`` bytes.
Thread-safe.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol, TypeVar

__all__ = [
    "STABLE_AGE_NS",
    "FileStamp",
    "IndexBudget",
    "budget",
    "cached",
    "clear",
    "held_bytes",
    "parse_count",
    "settled",
    "stamp_of",
]

#: How much older than a parse (or an opening) a file's modification time must be for the result
#: to be reused without reading the file again (see module doc).
STABLE_AGE_NS = 2_000_000_000


class FileStamp(NamedTuple):
    """What identifies a file's contents without reading them (``os.stat`` fields)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int


def stamp_of(path: str) -> FileStamp:
    """``path``'s :class:`FileStamp`.

    Raises:
        OSError: The file cannot be stat'ed.
    """
    st = os.stat(path)
    return FileStamp(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


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


class _Entry(NamedTuple):
    stamps: tuple[FileStamp, FileStamp]
    value: Parsed


_LOCK = threading.Lock()
_TABLE: OrderedDict[tuple[str, str, str], _Entry] = OrderedDict()
_held = 0
_parses = 0


def cached(
    kind: str, shard: str, index: str, parse: Callable[[bytes, int], P]
) -> tuple[P, FileStamp]:
    """The index file ``index`` of the shard file ``shard`` parsed by ``parse``, from this
    process's cache, or parsed now and kept (within :data:`budget`); and the shard's
    :class:`FileStamp` the parse belongs to.

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
    with open(index, "rb") as f:
        data = f.read()
    with _LOCK:
        _parses += 1
    value = parse(data, stamps[0].size)
    again = (stamp_of(shard), stamp_of(index))
    with _LOCK:
        old = _TABLE.pop(key, None)
        if old is not None:
            _held -= old.value.nbytes
        if again == stamps and settled(stamps[0], now) and settled(stamps[1], now):
            _TABLE[key] = _Entry(stamps, value)
            _held += value.nbytes
            _trim()
    return value, stamps[0]


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
