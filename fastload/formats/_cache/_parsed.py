"""Parsed shard indexes kept per process, so that reopening a shard costs two ``stat`` calls.

The block shuffle reads from many more shards than a thread's reader cache keeps open
(``max_open_shards``), so shard readers are closed and made again all the time. A reader with a
separate index file (WebDataset's ``.tar.idx``, TFRecord's ``.tfrecord.idx``) would read and
parse that file each time: ~1 s for a WebDataset shard of 100,000 samples before this cache. A
reader of a shard and an index that are both local files (a local directory, or a
:class:`~fastload.storage.CachingStore`'s copies) therefore asks :func:`cached` for the parsed
index: the first reader of the pair in a process parses it, the next ones take it over after one
``stat`` of each file. With a ``codec`` the parse is also written to the machine's index files
and mapped from there (:mod:`~fastload.formats._cache._files`): other processes map it instead
of parsing, and every process's entry is shared page cache rather than private memory. Nothing
here holds a file open: an entry is parsed or mapped data (compact NumPy arrays), so a cache may
evict and replace the shard files at any time.

An entry is used only if both files are unchanged (same :class:`~fastload.formats._cache.
FileStamp`) and both were :func:`~fastload.formats._cache.settled` at the parse. A changed file
is parsed again; an index that fails to parse is never kept. Entries survive ``fork`` (they are
plain data, shared copy-on-write).

The settings' ``parsed`` budget (:class:`~fastload.formats._cache.IndexBudget`, read at every
store) bounds what a process keeps: entries are dropped, least recently used first, while there
are more than ``entries`` or they hold more than ``nbytes`` bytes. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, TypeVar

import numpy.typing as npt

from fastload._memo import BoundedMemo
from fastload.formats._cache._config import config
from fastload.formats._cache._files import entry_name, index_files
from fastload.formats._cache._stamps import FileStamp, settled, stamp_of

__all__ = ["Codec", "ParsedIndexes", "cached", "clear", "held_bytes", "parse_count"]

log = logging.getLogger("fastload.formats")


class Parsed(Protocol):
    """A parsed index: it says how many bytes it holds."""

    @property
    def nbytes(self) -> int: ...


P = TypeVar("P", bound=Parsed)

#: A parsed index as arrays and small JSON-able values, for the index files.
Arrays = tuple[dict[str, npt.NDArray[Any]], dict[str, Any]]


class Codec(Protocol[P]):
    """How a kind of parsed index becomes arrays (to be kept in a file) and back (from the
    file's mapped arrays)."""

    def to_arrays(self, value: P) -> Arrays: ...

    def from_arrays(self, arrays: dict[str, npt.NDArray[Any]], values: dict[str, Any]) -> P: ...


class _Entry(NamedTuple):
    stamps: tuple[FileStamp, FileStamp]
    value: Parsed


def _weight(entry: _Entry) -> int:
    return entry.value.nbytes


class ParsedIndexes:
    """One process's parsed indexes (see module doc): a bounded memo under a lock, and the count
    of parses begun (for tests and benchmarks)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # Bounded by the settings' budget as each entry is stored (settings are read on first
        # use, never at import).
        self.table: BoundedMemo[tuple[str, str, str], _Entry] = BoundedMemo(0, weight=_weight)
        self.parses = 0

    def cached(
        self,
        kind: str,
        shard: str,
        index: str,
        parse: Callable[[bytes, int], P],
        codec: Codec[P] | None = None,
    ) -> tuple[P, FileStamp]:
        """The index file ``index`` of the shard file ``shard`` parsed by ``parse``, from this
        process's cache, or from the machine's index files (mapped through ``codec``), or parsed now
        and kept (within the settings' ``parsed`` budget; and as a file, mapped from then on, with a
        ``codec``); and the shard's :class:`~fastload.formats._cache.FileStamp` the parse belongs to.

        ``parse(index_bytes, shard_size)`` must depend only on the two files' contents (checks that
        depend on the caller, such as a manifest's sample count, belong after this call), and
        ``kind`` must name it (``"webdataset"``, ``"tfrecord"``). What ``parse`` raises propagates
        and nothing is kept.

        Raises:
            OSError: A file cannot be stat'ed or read.
        """
        key = (kind, shard, index)
        stamps = (stamp_of(shard), stamp_of(index))
        with self.lock:
            entry = self.table.get(key)
            if entry is not None and entry.stamps == stamps:
                return entry.value, stamps[0]  # type: ignore[return-value]
        now = time.time_ns()
        steady = settled(stamps[0], now) and settled(stamps[1], now)
        files = index_files() if codec is not None and steady else None
        name = entry_name(kind, (shard, index), stamps) if files is not None else None
        value: P | None = None
        if codec is not None and files is not None and name is not None:
            kept = files.load(name, kind)
            if kept is not None:
                value = _from_arrays(codec, kept, name)
        if value is None:
            with open(index, "rb") as f:
                data = f.read()
            with self.lock:
                self.parses += 1
            value = parse(data, stamps[0].size)
            again = (stamp_of(shard), stamp_of(index))
            if codec is not None and files is not None and name is not None and again == stamps:
                arrays, values = codec.to_arrays(value)
                if files.save(name, kind, arrays, values):
                    kept = files.load(name, kind)  # the mapped copy, shared, instead
                    mapped = None if kept is None else _from_arrays(codec, kept, name)
                    value = value if mapped is None else mapped
        else:
            again = (stamp_of(shard), stamp_of(index))
        with self.lock:
            self.table.pop(key)
            if again == stamps and steady:
                budget = config().parsed
                self.table.entries, self.table.max_weight = budget.entries, budget.nbytes
                self.table.put(key, _Entry(stamps, value))
        return value, stamps[0]

    def clear(self) -> None:
        """Drop every entry."""
        with self.lock:
            self.table.clear()


def _from_arrays(codec: Codec[P], kept: Arrays, name: str) -> P | None:
    """The index from a file's arrays, or ``None`` when they do not make one (a file written by
    another version: the index is parsed again)."""
    try:
        return codec.from_arrays(*kept)
    except (KeyError, ValueError, TypeError, IndexError) as exc:
        log.debug("ignoring the parsed index file %s: %s", name, exc)
        return None


#: This process's parsed indexes.
PARSED = ParsedIndexes()


#: This process's :meth:`ParsedIndexes.cached`.
cached = PARSED.cached


def clear() -> None:
    """Drop every entry (tests; a process that wants the memory back)."""
    PARSED.clear()


def held_bytes() -> int:
    """Bytes this process's entries hold."""
    return PARSED.table.total_weight


def parse_count() -> int:
    """How many index parses this process began in :func:`cached`, failed ones included (for
    tests and benchmarks)."""
    return PARSED.parses
