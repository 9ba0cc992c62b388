"""Opening a shard for :func:`~fastload.formats.webdataset._tar.scan`: local files by offset,
everything else as a stream.

A local file is read with ``os.pread`` on an unbuffered descriptor: each member's data is one
read straight into the ``bytes`` object the reader returns (copied once, from the page cache),
and the small members and headers between large ones come out of a small look-ahead window.
Other stores are streamed through ``store.open_reader``; the shard is never downloaded whole.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

from fastload.errors import ObjectNotFoundError
from fastload.formats.webdataset._tar import BLOCK, ReadAt, StreamReadAt, stream_size
from fastload.storage import Store

__all__ = ["LOCAL_LOOKAHEAD", "local_file", "open_shard"]

#: Bytes read at a time where a local shard has headers and small members. A sample of one
#: large and one small member (an image and its label) needs one read for the image and one of
#: these for the label's header, the label and the next image's header.
LOCAL_LOOKAHEAD = 4096

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


@contextmanager
def open_shard(store: Store, key: str) -> Iterator[tuple[ReadAt, int, int]]:
    """Open ``key`` for scanning: yields ``(read_at, size, lookahead)`` for :func:`scan`.

    Local files are read with ``os.pread`` (see the module docstring); other objects through
    ``store.open_reader``, whose stream is only read forward (``lookahead`` is one block).
    The file or stream is closed when the ``with`` block ends. One thread at a time.

    Raises:
        ObjectNotFoundError: No object under ``key`` (from the store).
    """
    path = local_file(store, key)
    fd = -1
    if path is not None:
        try:
            fd = os.open(path, _O_RDONLY)
        except OSError:
            fd = -1  # gone or unreadable: the store's reader raises the proper error
    if fd >= 0:
        try:
            local_size = os.fstat(fd).st_size
            if hasattr(os, "posix_fadvise"):  # larger kernel read-ahead when not cached
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            yield partial(os.pread, fd), local_size, LOCAL_LOOKAHEAD
        finally:
            os.close(fd)
        return
    with store.open_reader(key) as stream:
        known = stream_size(stream)
        size = store.size(key) if known is None else known
        yield StreamReadAt(stream, stream.tell() if stream.seekable() else 0), size, BLOCK
