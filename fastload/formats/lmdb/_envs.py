"""One read-only LMDB environment per file per process, shared by every reader of that file and
kept open, checked, after its last reader closes, within a budget.

py-lmdb refuses to open a file that is already open in the process (LMDB forbids it), so readers
share environments through this table (:class:`EnvTable`), keyed by the file's ``(st_dev, st_ino)`` and reference
counted. After ``fork`` the child's table still lists the parent's environments; the child closes
those copies (which releases nothing in the parent: the mappings and descriptors are the child's
own) and opens the files again on first use.

Opening a shard is expensive (LMDB's own opening, and hashing the file where it is compared with
the manifest's SHA-256: ~8 ms for a shard of 100,000 small samples), and the block shuffle reads
from many more shards than a reader cache keeps open, so an environment whose last reader closed
stays open, *idle*, and the next reader of the file takes it over with one ``stat``: each file
is opened and checked once per process, not once per reader. The settings' ``envs`` budget
(:class:`~fastload.formats._cache.EnvBudget` of :func:`~fastload.formats._cache.config`, read at
every release) bounds what a process keeps open: idle environments are closed, least recently
used first, while the process has more than ``environments`` open or their files total more
than ``mapped_bytes``; only environments that readers hold exceed it.
Each open environment costs two file descriptors (LMDB's and the checks' memory map) and maps
its file twice (address space, not memory: the pages are the page cache's, clean and shared).

An idle environment is taken over only if its file is unchanged: same size and modification
time, and that time was at least :data:`STABLE_AGE_NS` older than the opening (a change within
the file system's timestamp granularity of the opening could keep the time; Git's "racy" rule).
Otherwise it is closed and the file opened and checked again, so damage written into a shard
is found as before. A failed opening leaves nothing behind. Idle environments of files removed
or replaced (a cache's eviction) are closed at the next opening, not kept until trimmed.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import lmdb

from fastload._lazy import current_pid
from fastload.formats._cache import STABLE_AGE_NS, config

__all__ = [
    "ENVS",
    "STABLE_AGE_NS",
    "EnvTable",
    "SharedEnv",
    "acquire",
    "open_count",
    "open_env",
    "release",
]


class SharedEnv:
    """An open environment, what its opener returned with it, and one read transaction per
    thread.

    Attributes:
        env: The ``lmdb.Environment``.
        info: The opener's second result (closed with the environment if it has ``close()``).
        path: The file opened.
        stamp: The file's ``(st_size, st_mtime_ns)`` when it was opened.
    """

    def __init__(
        self, env: Any, ident: tuple[int, int], info: Any, path: str, stamp: tuple[int, int]
    ) -> None:
        self.env, self.ident, self.info = env, ident, info
        self.path, self.stamp = path, stamp
        self.opened_ns = time.time_ns()
        self.pid = current_pid()
        self.refs = 1
        self.closed = False
        self._local = threading.local()

    def unchanged(self, stamp: tuple[int, int]) -> bool:
        """Whether a file whose ``(st_size, st_mtime_ns)`` is ``stamp`` is surely the file this
        environment checked (see module doc)."""
        return stamp == self.stamp and self.stamp[1] <= self.opened_ns - STABLE_AGE_NS

    def txn(self) -> Any:
        """This thread's read transaction (``buffers=True``: values are views into the map,
        valid until the transaction ends)."""
        txn = getattr(self._local, "txn", None)
        if txn is None:
            txn = self._local.txn = self.env.begin(buffers=True)
        return txn

    def discard_txn(self) -> None:
        """End this thread's read transaction; the next :meth:`txn` begins a fresh one.

        Call it after any LMDB error in the transaction: LMDB marks a transaction that met an
        error as failed and refuses everything later in it (``MDB_BAD_TXN``), so one damaged
        page would otherwise fail every later read in the thread.
        """
        txn = getattr(self._local, "txn", None)
        self._local.txn = None
        if txn is not None:
            try:
                txn.abort()
            except lmdb.Error:  # pragma: no cover - aborting a read transaction cannot fail
                pass

    def close(self) -> None:
        """Close the environment and the opener's resources (in any process: forked copies are
        this process's own)."""
        self.closed = True
        try:
            self.env.close()
        except lmdb.Error:  # pragma: no cover - closing cannot fail in practice
            pass
        close = getattr(self.info, "close", None)
        if close is not None:
            close()


def open_env(path: str, *, readahead: bool) -> Any:
    """``path`` opened read-only, without a lock file, as one file (``MDB_NOSUBDIR``).

    LMDB reads the two meta pages with ``pread`` and maps the file; it touches no other page
    until a transaction looks a key up.

    Raises:
        lmdb.Error: LMDB could not open the file.
    """
    return lmdb.open(
        path,
        subdir=False,
        readonly=True,
        lock=False,
        readahead=readahead,
        max_readers=1,
        max_dbs=0,
    )


class EnvTable:
    """One process's open environments: those readers hold and the idle ones, their files'
    total size and the count of openings (see module doc). One instance per process
    (:data:`ENVS`); after ``fork`` the child's first use closes the copies of the parent's
    environments and starts empty.

    Attributes:
        lock: Guards the table. Re-entrant because :meth:`acquire` holds it while the opener
            runs, and a garbage collection then may finalize another reader, whose finalizer
            calls :meth:`release` in the same thread (with a plain lock that thread would wait
            for itself forever).
        open: Every open environment of this process, held by readers or idle.
        idle: The idle ones (no reader holds them), least recently released first.
        mapped: Total size of the files of the environments in :attr:`open`.
        opens: Environments this process opened (each one a check of its file).
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.open: dict[tuple[int, int], SharedEnv] = {}
        self.idle: OrderedDict[tuple[int, int], SharedEnv] = OrderedDict()
        self.mapped = 0
        self.opens = 0
        self.pid = current_pid()

    def _drop_inherited(self) -> None:
        """In a forked child: close the parent's environments (our copies) and forget them."""
        if current_pid() == self.pid:
            return
        for entry in self.open.values():
            entry.close()
        self.open.clear()
        self.idle.clear()
        self.pid, self.opens, self.mapped = current_pid(), 0, 0

    def forget(self, entry: SharedEnv) -> None:
        """Close ``entry`` and remove it from the table (it must be idle or unreferenced)."""
        if self.idle.get(entry.ident) is entry:
            del self.idle[entry.ident]
        if self.open.get(entry.ident) is entry:
            del self.open[entry.ident]
            self.mapped -= entry.stamp[0]
        entry.close()

    def close_idle(self) -> None:
        """Close every idle environment (tests; a process that wants the descriptors back)."""
        with self.lock:
            for entry in list(self.idle.values()):
                self.forget(entry)

    def _trim(self) -> None:
        """Close idle environments, least recently released first, while the process is over
        its budget (the settings' ``envs``)."""
        budget = config().envs
        while self.idle and (
            len(self.open) > budget.environments or self.mapped > budget.mapped_bytes
        ):
            self.forget(next(iter(self.idle.values())))

    def _sweep_gone(self) -> None:
        """Close the idle environments whose path no longer names their file (removed,
        replaced)."""
        for entry in list(self.idle.values()):
            try:
                st = os.stat(entry.path)
            except OSError:
                self.forget(entry)
                continue
            if (st.st_dev, st.st_ino) != entry.ident:
                self.forget(entry)

    def acquire(self, path: str, *, opener: Callable[[str], tuple[Any, Any]]) -> SharedEnv:
        """See :func:`acquire`."""
        st = os.stat(path)
        ident, stamp = (st.st_dev, st.st_ino), (st.st_size, st.st_mtime_ns)
        with self.lock:
            self._drop_inherited()
            entry = self.open.get(ident)
            if entry is not None and entry.refs == 0 and not entry.unchanged(stamp):
                self.forget(entry)  # changed since it was checked (or may have): check it again
                entry = None
            if entry is not None:
                self.idle.pop(ident, None)
                entry.refs += 1
                return entry
            self._sweep_gone()
            env, info = opener(path)
            self.opens += 1
            entry = self.open[ident] = SharedEnv(env, ident, info, path, stamp)
            self.mapped += stamp[0]
            self._trim()
            return entry

    def release(self, entry: SharedEnv, keep: bool = True) -> None:
        """See :func:`release`."""
        with self.lock:
            if entry.pid != current_pid() or entry.closed:
                return
            entry.refs -= 1
            if entry.refs > 0:
                return
            if keep and self.open.get(entry.ident) is entry:
                self.idle[entry.ident] = entry
                self._trim()
            else:
                self.forget(entry)


#: This process's table.
ENVS = EnvTable()


def open_count() -> int:
    """How many environments this process has opened (each opening checked its file)."""
    return ENVS.opens


def acquire(path: str, *, opener: Callable[[str], tuple[Any, Any]]) -> SharedEnv:
    """Share this process's open environment of ``path``, or open it with ``opener``.

    ``opener(path)`` runs once per opening and returns ``(environment, info)``; ``info`` is kept
    as :attr:`SharedEnv.info`. If it raises, it must have closed what it opened; the exception
    propagates and nothing is kept. Every successful call must be matched by :func:`release`.

    Raises:
        OSError: The file cannot be stat'ed.
        Exception: Whatever ``opener`` raises.
    """
    return ENVS.acquire(path, opener=opener)


def release(entry: SharedEnv, keep: bool = True) -> None:
    """Drop one reference. When none are left the environment stays open, idle, if ``keep``
    and the budget (the settings' ``envs``) allows, and closes otherwise. A no-op in a process
    other than the one that acquired ``entry`` (a forked child), and after the entry was
    closed."""
    ENVS.release(entry, keep)
