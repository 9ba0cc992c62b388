"""How a :class:`~fastload.storage.CachingStore` copies an object into its directory: :func:`fill`.

The object is streamed from the wrapped store into a temporary file of the cache directory and
renamed into place with its description, so that no process ever sees part of it; see
:mod:`fastload.storage._cache` for the locks around a fill and :mod:`fastload.storage._cache_dir`
for the layout and the budget.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable

from fastload.errors import StoreError
from fastload.storage._base import Store
from fastload.storage._cache_dir import NO_SPACE, CacheDirectory
from fastload.storage._keys import ObjectMeta
from fastload.storage._streams import reader_version

__all__ = ["FILL_BUFFER", "FILL_READ_CHUNK", "fill"]

#: Bytes per read when the cache copies an object in (the buffer each fill in progress holds):
#: large enough that a read costs little next to its bytes, small enough that its allocations
#: are reused instead of mapped and faulted in afresh (as a whole-object ``get`` of a shard is).
FILL_BUFFER = 2 * 1024 * 1024
#: ``chunk_size`` of the reader a fill opens: its buffer (S3), or the bytes per ranged get of
#: stores without a native stream. Smaller than FILL_BUFFER, so reads bypass the buffer.
FILL_READ_CHUNK = 1024 * 1024


def fill(
    store: Store,
    disk: CacheDirectory,
    url: str,
    key: str,
    entry: str,
    meta: ObjectMeta,
    count: Callable[[str, int], None],
) -> None:
    """Download ``key`` of ``store`` into ``disk`` as ``entry``, one consistent version of it.

    The caller holds the entry's lock; ``meta`` is a recent
    head of the object; ``url`` is the cache's (recorded in the description); ``count(name, n)``
    adds to the cache's counters (requests, evictions, downloads, bytes downloaded).

    The object is streamed through ``store.open_reader`` (for S3 one GET, resumed where it broke
    by a :class:`~fastload.storage.RetryStore` below the cache) into its temporary file,
    :data:`FILL_BUFFER` bytes at a time through one buffer. The copy is one version of the
    object when the reader names the version it reads (an S3 ETag, pinned across resumptions)
    and that is the version ``meta`` describes; for a reader that cannot tell, a second head
    afterwards must report the same size, etag and mtime. An object that changed meanwhile is
    copied again (three copies at most).

    A write that finds no room on the cache's filesystem (``ENOSPC``, ``EDQUOT``) removes the
    copy, evicts objects holding at least the object's size and copies again, once.

    Raises:
        CacheFullError: No room on the cache's filesystem for the object, even after evicting
            (it names the directory, the budget and the free space).
        StoreError: The object changed during each of the three copies (it names the object).
            The store's errors pass through; nothing of the copy is left behind.
    """
    where = store.child_url(key)
    path = disk.object_path(entry)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    buf = memoryview(bytearray(FILL_BUFFER))
    copies = 0  # copies made (the object may change during one)
    reclaim = 0  # bytes to evict beyond what the free space asks for (after a write found none)
    code = errno.ENOSPC  # the errno of the write that found no room
    while True:
        room = disk.reserve(entry, meta.size, url=where, reclaim=reclaim, code=code)
        count("evictions", room.evicted + room.disk_evicted)
        count("disk_full_evictions", room.disk_evicted)
        tmp = room.path
        described = False
        try:
            got, version = _download(store, key, tmp, buf, count)
            copies += 1
            if version is not None and meta.etag is not None:
                same = got == meta.size and version == meta.etag
            else:
                after = store.head(key)
                count("requests", 1)
                same = got == meta.size and (after.size, after.etag, after.mtime) == (
                    meta.size,
                    meta.etag,
                    meta.mtime,
                )
                meta = after
            if not same:
                os.unlink(tmp)
                if copies < 3:
                    if version is not None:
                        meta = store.head(key)
                        count("requests", 1)
                    continue
                raise StoreError(
                    f"could not copy {where} into the cache: it changed during each of 3 "
                    "downloads; datasets being read must not be rewritten",
                    url=where,
                )
            described = True
            disk.describe(entry, ObjectMeta(key, got, meta.mtime, meta.etag), url)
            os.replace(tmp, path)
        except OSError as exc:
            _discard(tmp, disk.meta_path(entry) if described else None, path)
            # The store's own errors are StoreErrors; an OSError of no room is the cache's disk.
            if isinstance(exc, StoreError) or exc.errno not in NO_SPACE:
                raise
            if reclaim:  # evicted for it already, and still no room
                raise disk.full_error(where, meta.size, exc.errno) from exc
            reclaim, code = meta.size, exc.errno  # the free space said there was room: retry
            continue
        except BaseException:
            _discard(tmp, disk.meta_path(entry) if described else None, path)
            raise
        count("downloads", 1)
        count("bytes_downloaded", got)
        return


def _discard(tmp: str, description: str | None, path: str) -> None:
    """Remove what a failed fill left: its temporary file, and the description it wrote unless
    an object (an older copy) is in place."""
    with contextlib.suppress(OSError):
        os.unlink(tmp)
    if description is not None and not os.path.exists(path):
        with contextlib.suppress(OSError):
            os.unlink(description)


def _download(
    store: Store, key: str, tmp: str, buf: memoryview, count: Callable[[str, int], None]
) -> tuple[int, str | None]:
    """Copy ``key`` into the file ``tmp`` (truncated to what was copied) through ``buf``;
    return the bytes copied and the object version the reader named (None: unknown)."""
    got = 0
    fd = os.open(tmp, os.O_WRONLY | os.O_CLOEXEC)
    try:
        count("requests", 1)
        # Reads of len(buf) go straight into buf (past the readers' smaller buffers).
        with store.open_reader(key, chunk_size=FILL_READ_CHUNK) as reader:
            version = reader_version(reader)
            while n := reader.readinto(buf):
                view = buf[:n]
                while view:
                    view = view[os.write(fd, view) :]
                got += n
        os.ftruncate(fd, got)
    finally:
        os.close(fd)
    return got, version
