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
from collections.abc import Iterator
from contextlib import contextmanager

from fastload.formats._mmap import local_file, map_file
from fastload.formats.webdataset._tar import ShardView, StreamView, stream_size
from fastload.storage import Store

__all__ = ["open_shard"]


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
