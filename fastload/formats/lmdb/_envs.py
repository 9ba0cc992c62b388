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

__all__ = ["SharedEnv", "acquire", "release"]


class SharedEnv:
    """An open environment, what its validation returned, and one read transaction per thread."""

    def __init__(self, env: Any, ident: tuple[int, int], info: Any) -> None:
        self.env, self.ident, self.info = env, ident, info
        self.pid = os.getpid()
        self.refs = 1
        self.closed = False
        self._local = threading.local()

    def txn(self) -> Any:
        """This thread's read transaction (``buffers=True``: values are views into the map)."""
        txn = getattr(self._local, "txn", None)
        if txn is None:
            txn = self._local.txn = self.env.begin(buffers=True)
        return txn


_LOCK = threading.Lock()
_TABLE: dict[tuple[int, int], SharedEnv] = {}
_PID = os.getpid()


def _drop_inherited() -> None:
    """In a forked child: close the parent's environments (our copies of them) and forget them."""
    global _PID
    if os.getpid() == _PID:
        return
    for entry in _TABLE.values():
        entry.closed = True
        try:
            entry.env.close()
        except lmdb.Error:  # pragma: no cover - closing a copy cannot fail in practice
            pass
    _TABLE.clear()
    _PID = os.getpid()


def acquire(path: str, *, readahead: bool, validate: Callable[[Any], Any]) -> SharedEnv:
    """Open ``path`` read-only without a lock file, or share this process's open environment.

    ``validate(env)`` runs once per opening; its result is kept as :attr:`SharedEnv.info`, and if
    it raises, the environment is closed and the exception propagates. ``readahead`` applies when
    this call opens the file. Every successful call must be matched by :func:`release`.

    Raises:
        lmdb.Error: LMDB could not open the file.
        OSError: The file cannot be stat'ed.
    """
    st = os.stat(path)
    ident = (st.st_dev, st.st_ino)
    with _LOCK:
        _drop_inherited()
        entry = _TABLE.get(ident)
        if entry is not None:
            entry.refs += 1
            return entry
        env = lmdb.open(
            path,
            subdir=False,
            readonly=True,
            lock=False,
            readahead=readahead,
            max_readers=1,
            max_dbs=0,
        )
        try:
            info = validate(env)
        except BaseException:
            env.close()
            raise
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
            entry.env.close()
