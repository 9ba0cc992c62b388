"""One read-only LMDB environment per file per process, shared by every reader of that file.

py-lmdb refuses to open a file that is already open in the process (LMDB forbids it), so readers
share environments through this table, keyed by the file's ``(st_dev, st_ino)`` and reference
counted. After ``fork`` the child's table still lists the parent's environments; the child closes
those copies (which releases nothing in the parent: the mappings and descriptors are the child's
own) and opens the files again on first use.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import lmdb

__all__ = ["SharedEnv", "acquire", "open_env", "release"]


class SharedEnv:
    """An open environment, what its opener returned with it, and one read transaction per
    thread.

    Attributes:
        env: The ``lmdb.Environment``.
        info: The opener's second result (closed with the environment if it has ``close()``).
    """

    def __init__(self, env: Any, ident: tuple[int, int], info: Any) -> None:
        self.env, self.ident, self.info = env, ident, info
        self.pid = os.getpid()
        self.refs = 1
        self.closed = False
        self._local = threading.local()

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


#: Guards the table. Re-entrant because :func:`acquire` holds it while the opener runs, and a
#: garbage collection then may finalize another reader, whose finalizer calls :func:`release`
#: in the same thread (with a plain lock that thread would wait for itself forever).
_LOCK = threading.RLock()
_TABLE: dict[tuple[int, int], SharedEnv] = {}
_PID = os.getpid()


def _drop_inherited() -> None:
    """In a forked child: close the parent's environments (our copies of them) and forget them."""
    global _PID
    if os.getpid() == _PID:
        return
    for entry in _TABLE.values():
        entry.close()
    _TABLE.clear()
    _PID = os.getpid()


def acquire(path: str, *, opener: Callable[[str], tuple[Any, Any]]) -> SharedEnv:
    """Share this process's open environment of ``path``, or open it with ``opener``.

    ``opener(path)`` runs once per opening and returns ``(environment, info)``; ``info`` is kept
    as :attr:`SharedEnv.info`. If it raises, it must have closed what it opened; the exception
    propagates. Every successful call must be matched by :func:`release`.

    Raises:
        OSError: The file cannot be stat'ed.
        Exception: Whatever ``opener`` raises.
    """
    st = os.stat(path)
    ident = (st.st_dev, st.st_ino)
    with _LOCK:
        _drop_inherited()
        entry = _TABLE.get(ident)
        if entry is not None:
            entry.refs += 1
            return entry
        env, info = opener(path)
        entry = _TABLE[ident] = SharedEnv(env, ident, info)
        return entry


def release(entry: SharedEnv) -> None:
    """Drop one reference; the environment closes when none are left. A no-op in a process other
    than the one that acquired ``entry`` (a forked child), and after the entry was closed."""
    with _LOCK:
        if entry.pid != os.getpid() or entry.closed:
            return
        entry.refs -= 1
        if entry.refs <= 0:
            entry.closed = True
            if _TABLE.get(entry.ident) is entry:
                del _TABLE[entry.ident]
            entry.close()
