"""Open shard readers of a dataset: an LRU per thread, never shared across threads or processes.

A shard reader holds an open shard (a memory map, a connection, a decompressor's state) and is
not thread-safe, so each reading thread keeps its own; after ``fork`` the parent's readers are
forgotten in the child, never used or closed there (:class:`~fastload._lazy.PerProcess`).
Readers without random access also keep a sequential cursor (:class:`ReaderSlot`).

``max_open_shards`` is the LRU's capacity: the readers one thread keeps open; ``None`` (the
default) is :func:`default_capacity`: every shard of a local dataset, up to an eighth of the soft
``RLIMIT_NOFILE``, so that the block shuffle, which reads from shards all over the dataset (a
batch of 256 touches dozens), does not close and remake readers; 16 for remote stores and caches.
Where readers are remade, what it costs is the format's, and it is kept small per process: an
LMDB shard's environment stays open, checked, after its reader closes
(:mod:`fastload.formats.lmdb._envs`), and a WebDataset or TFRecord index stays parsed
(:mod:`fastload.formats._cache`). Bound per worker process: open files <= 2 x threads x
capacity for the readers (a shard's memory map holds a duplicate descriptor in CPython 3.11; an
LMDB environment holds 2), plus 2 x ``config().envs.environments`` for LMDB's idle environments
(:mod:`fastload.formats._cache`); mapped memory is address space over the page cache (clean,
shared, reclaimable pages), not private memory.
"""

from __future__ import annotations

import logging
import resource
import threading
from collections import OrderedDict
from typing import Any

from fastload._lazy import PerProcess
from fastload.formats import ShardReader
from fastload.storage import Store

__all__ = ["DEFAULT_OPEN_SHARDS", "ReaderCache", "ReaderSlot", "close_quietly", "default_capacity"]

#: ``max_open_shards=None`` for shards that are not plain local files (a remote store, a cache).
DEFAULT_OPEN_SHARDS = 16
#: ``max_open_shards=None`` keeps at most this many readers open per thread for local files.
MAX_AUTO_OPEN_SHARDS = 4096

log = logging.getLogger("fastload.loader")


def default_capacity(store: Store, shards: int) -> int:
    """The readers a thread keeps open with ``max_open_shards=None``.

    Local files (a store with local paths that is not a :class:`~fastload.storage.CachingStore`):
    every shard of the dataset, so that the block shuffle never closes and remakes a reader, up
    to an eighth of the soft ``RLIMIT_NOFILE`` (a reader holds at most 2 file descriptors: the
    readers then take at most a quarter of the limit), at least 16 and at most 4,096. Other
    stores: 16 (:data:`DEFAULT_OPEN_SHARDS`): remote readers hold connections, and a cache's
    files must not be held open long after it evicts them.
    """
    if not store.has_local_paths or store.evicts_local_files:
        return DEFAULT_OPEN_SHARDS
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = MAX_AUTO_OPEN_SHARDS if soft == resource.RLIM_INFINITY else soft // 8
    return max(1, min(shards, max(DEFAULT_OPEN_SHARDS, min(MAX_AUTO_OPEN_SHARDS, limit))))


class ReaderSlot:
    """One open shard reader plus a sequential cursor for readers without random access."""

    __slots__ = ("cursor", "reader")

    def __init__(self, reader: ShardReader) -> None:
        self.reader = reader
        self.cursor: tuple[Any, dict[str, Any] | None] | None = None  # (iterator, lookahead)


class _ThreadTables:
    """One process's ``thread id -> LRU table of shard number -> slot``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tables: dict[int, OrderedDict[int, ReaderSlot]] = {}


class ReaderCache:
    """Open shard readers, an LRU of ``capacity`` per thread (see module doc)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._process = PerProcess(_ThreadTables)

    def slots(self) -> OrderedDict[int, ReaderSlot]:
        """This thread's table (most recently used last)."""
        process = self._process.get()
        ident = threading.get_ident()
        table = process.tables.get(ident)
        if table is None:
            with process.lock:
                table = process.tables.setdefault(ident, OrderedDict())
        return table

    def close_all(self) -> None:
        """Close every reader this process opened (of all its threads)."""
        process = self._process.clear()
        if process is None:
            return
        with process.lock:
            tables = list(process.tables.values())
        for table in tables:
            for slot in table.values():
                close_quietly(slot.reader)


def close_quietly(reader: ShardReader) -> None:
    """Close ``reader``, logging (not raising) a failure: closing must not mask the error being
    handled."""
    try:
        reader.close()
    except Exception as exc:
        log.debug("closing reader %s failed: %s", reader.url, exc)
