"""One read-only LMDB environment per file per process, shared by every reader of that file and
kept open, checked, after its last reader closes, within a budget.

py-lmdb refuses to open a file that is already open in the process (LMDB forbids it), so readers
share environments through this table, keyed by the file's ``(st_dev, st_ino)`` and reference
counted. After ``fork`` the child's table still lists the parent's environments; the child closes
those copies (which releases nothing in the parent: the mappings and descriptors are the child's
own) and opens the files again on first use.

Opening a shard is expensive (LMDB's own opening, and hashing the file where it is compared with
the manifest's SHA-256: ~8 ms for a shard of 100,000 small samples), and the block shuffle reads
from many more shards than a reader cache keeps open, so an environment whose last reader closed
stays open, *idle*, and the next reader of the file takes it over with one ``stat``: each file
is opened and checked once per process, not once per reader. The :data:`budget` bounds what a process keeps open: idle environments are closed,
least recently used first, while the process has more than ``budget.environments`` open or their
files total more than ``budget.mapped_bytes``; only environments that readers hold exceed it.
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
import resource
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lmdb

from fastload._lazy import current_pid
from fastload.formats._index_cache import STABLE_AGE_NS

__all__ = [
    "STABLE_AGE_NS",
    "EnvBudget",
    "SharedEnv",
    "acquire",
    "budget",
    "open_count",
    "open_env",
    "release",
]


@dataclass(frozen=True)
class EnvBudget:
    """What one process keeps open in LMDB environments (see module doc).

    Attributes:
        environments: Open environments (two file descriptors each).
        mapped_bytes: Total size of their files (each mapped twice).
    """

    environments: int
    mapped_bytes: int


def _default_budget() -> EnvBudget:
    """1,024 environments, or fewer where the descriptor limit is low (their descriptors take at
    most half of ``RLIMIT_NOFILE``: 256 environments under the common soft limit of 1,024), and
    1 TiB of files (2 TiB of address space, under 2 % of a 64-bit process's)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    environments = 1024 if soft == resource.RLIM_INFINITY else max(16, min(1024, soft // 4))
    return EnvBudget(environments=environments, mapped_bytes=1 << 40)


#: This process's budget (read at every release; assign another :class:`EnvBudget` to change it).
budget = _default_budget()


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


#: Guards the tables. Re-entrant because :func:`acquire` holds it while the opener runs, and a
#: garbage collection then may finalize another reader, whose finalizer calls :func:`release`
#: in the same thread (with a plain lock that thread would wait for itself forever).
_LOCK = threading.RLock()
#: Every open environment of this process, held by readers or idle.
_TABLE: dict[tuple[int, int], SharedEnv] = {}
#: The idle ones (no reader holds them), least recently released first.
_IDLE: OrderedDict[tuple[int, int], SharedEnv] = OrderedDict()
#: Total size of the files of the environments in ``_TABLE``.
_mapped = 0
_PID = current_pid()
#: Environments this process opened (each one a check of its file), for tests and benchmarks.
_opens = 0


def open_count() -> int:
    """How many environments this process has opened (each opening checked its file)."""
    return _opens


def _drop_inherited() -> None:
    """In a forked child: close the parent's environments (our copies of them) and forget them."""
    global _PID, _opens, _mapped
    if current_pid() == _PID:
        return
    for entry in _TABLE.values():
        entry.close()
    _TABLE.clear()
    _IDLE.clear()
    _PID, _opens, _mapped = current_pid(), 0, 0


def _forget(entry: SharedEnv) -> None:
    """Close ``entry`` and remove it from the tables (it must be idle or unreferenced)."""
    global _mapped
    if _IDLE.get(entry.ident) is entry:
        del _IDLE[entry.ident]
    if _TABLE.get(entry.ident) is entry:
        del _TABLE[entry.ident]
        _mapped -= entry.stamp[0]
    entry.close()


def _trim() -> None:
    """Close idle environments, least recently released first, while the process is over its
    :data:`budget`."""
    while _IDLE and (len(_TABLE) > budget.environments or _mapped > budget.mapped_bytes):
        _forget(next(iter(_IDLE.values())))


def _sweep_gone() -> None:
    """Close the idle environments whose path no longer names their file (removed, replaced)."""
    for entry in list(_IDLE.values()):
        try:
            st = os.stat(entry.path)
        except OSError:
            _forget(entry)
            continue
        if (st.st_dev, st.st_ino) != entry.ident:
            _forget(entry)


def acquire(path: str, *, opener: Callable[[str], tuple[Any, Any]]) -> SharedEnv:
    """Share this process's open environment of ``path``, or open it with ``opener``.

    ``opener(path)`` runs once per opening and returns ``(environment, info)``; ``info`` is kept
    as :attr:`SharedEnv.info`. If it raises, it must have closed what it opened; the exception
    propagates and nothing is kept. Every successful call must be matched by :func:`release`.

    Raises:
        OSError: The file cannot be stat'ed.
        Exception: Whatever ``opener`` raises.
    """
    global _opens, _mapped
    st = os.stat(path)
    ident, stamp = (st.st_dev, st.st_ino), (st.st_size, st.st_mtime_ns)
    with _LOCK:
        _drop_inherited()
        entry = _TABLE.get(ident)
        if entry is not None and entry.refs == 0 and not entry.unchanged(stamp):
            _forget(entry)  # changed since it was checked (or may have): check it again
            entry = None
        if entry is not None:
            _IDLE.pop(ident, None)
            entry.refs += 1
            return entry
        _sweep_gone()
        env, info = opener(path)
        _opens += 1
        entry = _TABLE[ident] = SharedEnv(env, ident, info, path, stamp)
        _mapped += stamp[0]
        _trim()
        return entry


def release(entry: SharedEnv, keep: bool = True) -> None:
    """Drop one reference. When none are left the environment stays open, idle, if ``keep``
    and the :data:`budget` allows, and closes otherwise. A no-op in a process other than the one
    that acquired ``entry`` (a forked child), and after the entry was closed."""
    with _LOCK:
        if entry.pid != current_pid() or entry.closed:
            return
        entry.refs -= 1
        if entry.refs > 0:
            return
        if keep and _TABLE.get(entry.ident) is entry:
            _IDLE[entry.ident] = entry
            _trim()
        else:
            _forget(entry)
