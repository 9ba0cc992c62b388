"""Memory-mapping local shards, shared by the readers of every format.

A shard on a store with local paths (:class:`~fastload.storage.LocalStore`, or the local copy in a
:class:`~fastload.storage.CachingStore`) is mapped read-only, so each field is copied once, from
the page cache into the ``bytes`` the reader returns, without a system call per record. Other
stores are streamed by the readers themselves.

A mapped shard must not be truncated in place while it is read: touching a page past the new end
raises ``SIGBUS``, which ends the process. fastload's writers and stores replace objects atomically
(a new file renamed over the old one), which is safe: the reader keeps the file it opened.
"""

from __future__ import annotations

import mmap
import os

from fastload.errors import CacheFullError, ObjectNotFoundError
from fastload.storage import Store

__all__ = ["local_file", "map_file"]

_O_RDONLY = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)


def local_file(store: Store, key: str) -> str | None:
    """The local path of ``key`` when the store has one (else ``None``, also when it is missing).

    A missing object gives ``None`` so that the store's own reader raises its usual error; so does
    one that a cache cannot hold (too large for its budget, or no room on its disk: the readers
    then stream it).
    """
    if not store.has_local_paths:
        return None
    try:
        return store.local_path(key)
    except (ObjectNotFoundError, CacheFullError):  # missing, too large for a cache, no room
        return None


def map_file(path: str, *, sequential: bool = True) -> mmap.mmap | bytes | None:
    """``path`` mapped read-only (``b""`` when empty), or ``None`` if it cannot be mapped.

    ``sequential`` asks the kernel to read ahead further and drop pages behind sooner (for
    iteration); otherwise the default read-ahead stays, which suits records of many pages read in
    any order (``MADV_RANDOM`` would fetch a cold record one page per fault).
    """
    try:
        fd = os.open(path, _O_RDONLY)
    except OSError:
        return None  # gone or unreadable: the store's reader raises the proper error
    try:
        if os.fstat(fd).st_size == 0:
            return b""
        view = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None  # e.g. a filesystem without mmap support: stream it instead
    finally:
        os.close(fd)  # the mapping keeps the file
    if sequential and hasattr(view, "madvise") and hasattr(mmap, "MADV_SEQUENTIAL"):
        view.madvise(mmap.MADV_SEQUENTIAL)
    return view
