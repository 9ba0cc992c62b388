"""Opening a shard for :func:`~fastload.formats.webdataset._tar.scan`: local files are
memory-mapped, everything else is streamed.

A local file is mapped read-only, so each member's data is copied once, from the page cache
into the ``bytes`` object the reader returns, without a system call per member. Other stores are
streamed through ``store.open_reader``; the shard is never downloaded whole.

A mapped shard must not be truncated in place while it is read: touching a page past the new end
raises ``SIGBUS``, which ends the process (as with LMDB, which maps its files too). fastload's
writers and stores replace objects atomically (a new file renamed over the old one), which is
safe: the reader keeps the file it opened.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager

from fastload.errors import ObjectNotFoundError
from fastload.formats.webdataset._tar import ShardView, StreamView, stream_size
from fastload.storage import Store

__all__ = ["local_file", "map_file", "open_shard"]

_O_RDONLY = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)


def local_file(store: Store, key: str) -> str | None:
    """The local path of ``key`` when the store has one (else ``None``, also when it is missing).

    A missing object gives ``None`` so that the store's own reader raises its usual error.
    """
    if not store.has_local_paths:
        return None
    try:
        return store.local_path(key)
    except ObjectNotFoundError:  # missing, or e.g. too large for a local cache
        return None


def map_file(path: str) -> mmap.mmap | bytes | None:
    """``path`` mapped read-only (``b""`` when empty), or ``None`` if it cannot be mapped."""
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
    if hasattr(view, "madvise") and hasattr(mmap, "MADV_SEQUENTIAL"):
        view.madvise(mmap.MADV_SEQUENTIAL)  # read ahead more, drop pages behind sooner
    return view


@contextmanager
def open_shard(store: Store, key: str) -> Iterator[ShardView]:
    """Open ``key`` for :func:`scan`: a memory map of a local file, else a stream view.

    The map or stream is closed when the ``with`` block ends. One thread at a time.

    Raises:
        ObjectNotFoundError: No object under ``key`` (from the store).
    """
    path = local_file(store, key)
    view = None if path is None else map_file(path)
    if view is not None:
        try:
            yield view
        finally:
            if isinstance(view, mmap.mmap):
                view.close()
        return
    with store.open_reader(key) as stream:
        size = stream_size(stream)
        if size is None:
            size = store.size(key)
        yield StreamView(stream, size, stream.tell() if stream.seekable() else 0)
