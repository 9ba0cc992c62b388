"""Open shard readers of a dataset: an LRU per thread, never shared across threads or processes.

A shard reader holds an open shard (a memory map, a connection, a decompressor's state) and is
not thread-safe, so each reading thread keeps its own; after ``fork`` the parent's readers are
forgotten in the child, never used or closed there (:class:`~fastload._lazy.PerProcess`).
Readers without random access also keep a sequential cursor (:class:`ReaderSlot`).

``max_open_shards`` is the LRU's capacity: the readers one thread keeps open. The block shuffle
reads from shards all over the dataset (a batch of 256 touches dozens), so readers are closed
and made again all the time; what that costs is the format's. An LMDB reader is cheap to make
again: its shard's environment, opened and checked once per process, stays open after the
reader closes (:mod:`fastload.formats.lmdb._envs`), so a process keeps open, besides its
readers' shards, at most ``_envs.budget`` LMDB shards (1,024, or a quarter of ``RLIMIT_NOFILE``
where that is lower: 2 file descriptors and 2 mappings of the file each, within 1 TiB of files).
Bound per worker process: open files <= 2 x max(``budget.environments``, threads x
``max_open_shards``) for LMDB, 2 x threads x ``max_open_shards`` for the other formats (a
shard's memory map holds a duplicate descriptor in CPython 3.11); mapped memory is address
space over the page cache (clean, shared, reclaimable pages), not private memory.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

from fastload._lazy import PerProcess
from fastload.formats import ShardReader

__all__ = ["ReaderCache", "ReaderSlot", "close_quietly"]

log = logging.getLogger("fastload.loader")


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
