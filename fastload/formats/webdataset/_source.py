"""Opening a shard for :func:`~fastload.formats.webdataset._scan.scan`: local files are
memory-mapped, everything else is streamed; compressed shards are decompressed on the way.

A local file is mapped read-only, so each member's data is copied once, from the page cache
into the ``bytes`` object the reader returns, without a system call per member. Other stores are
streamed through ``store.open_reader``; the shard is never downloaded whole.

A mapped shard must not be truncated in place while it is read: touching a page past the new end
raises ``SIGBUS``, which ends the process (as with LMDB, which maps its files too). fastload's
writers and stores replace objects atomically (a new file renamed over the old one), which is
safe: the reader keeps the file it opened.

A shard whose first bytes are a gzip, bzip2 or xz stream (and not a tar header) is a compressed
tar (see :mod:`fastload.formats.webdataset._compressed`): with ``inflate=True`` it is given as an
:class:`~fastload.formats.webdataset._compressed.InflatedView` that decompresses as it is read;
read it with :func:`scan_shard`. Without, it is refused, since offsets into it mean nothing.
"""

from __future__ import annotations

import io
import mmap
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastload.errors import FormatError
from fastload.formats._mmap import local_file, map_file
from fastload.formats.webdataset._compressed import (
    HEAD_BYTES,
    Codec,
    InflatedView,
    compression_of,
    scan_inflated,
)
from fastload.formats.webdataset._scan import Bad, Member, scan
from fastload.formats.webdataset._view import ShardView, StreamView, stream_size
from fastload.storage import Store

__all__ = ["open_shard", "scan_shard"]


def _refuse(codec: Codec, url: str) -> FormatError:
    return FormatError(
        f"this WebDataset shard is a {codec}-compressed tar: its members have no byte offsets "
        "(they exist only in the decompressed stream), so it cannot be indexed or read by "
        "position, and DALI cannot read it. It can be read in order (fastload's readers stream "
        "it); for an indexed dataset, convert it with `fastload convert SRC DST`",
        url=url,
    )


class _Prefixed(io.RawIOBase):
    """``head`` followed by the rest of ``stream``: a stream whose first bytes were read to
    sniff its format and can be neither peeked at nor sought back to."""

    def __init__(self, head: bytes, stream: io.BufferedIOBase) -> None:
        super().__init__()
        self._head, self._stream = head, stream

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        if self._head:
            n = min(len(out), len(self._head))
            out[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        data = self._stream.read(len(out))
        out[: len(data)] = data
        return len(data)


def _sniff(stream: io.BufferedIOBase) -> tuple[bytes, io.BufferedIOBase]:
    """The first :data:`HEAD_BYTES` of ``stream`` and a stream that still starts at them."""
    peek = getattr(stream, "peek", None)
    if peek is not None:
        head = peek(HEAD_BYTES)
        if len(head) >= HEAD_BYTES:
            return head[:HEAD_BYTES], stream
    if stream.seekable():
        here = stream.tell()
        head = stream.read(HEAD_BYTES)
        stream.seek(here)
        return head, stream
    head = stream.read(HEAD_BYTES)
    return head, io.BufferedReader(_Prefixed(head, stream), buffer_size=1 << 16)


@contextmanager
def _inflated(source: Any, codec: Codec, url: str, inflate: bool) -> Iterator[InflatedView]:
    """The decompressed view of a compressed shard (closed at the end), or the refusal."""
    if not inflate:
        raise _refuse(codec, url)
    view = InflatedView(source, codec, url)
    try:
        yield view
    finally:
        view.close()


@contextmanager
def open_shard(store: Store, key: str, *, inflate: bool = False) -> Iterator[ShardView]:
    """Open ``key`` for :func:`scan_shard`: a memory map of a local file, else a stream view;
    with ``inflate``, a compressed shard as an
    :class:`~fastload.formats.webdataset._compressed.InflatedView`.

    The map or stream is closed when the ``with`` block ends. One thread at a time.

    Raises:
        ObjectNotFoundError: No object under ``key`` (from the store).
        FormatError: The shard is compressed and ``inflate`` is False (the message says how to
            make an indexed shard of it).
    """
    path = local_file(store, key)
    view = None if path is None else map_file(path)
    if view is not None:
        try:
            codec = compression_of(view[:HEAD_BYTES])
            if codec is None:
                yield view
            else:
                with _inflated(view, codec, store.child_url(key), inflate) as inflated:
                    yield inflated
        finally:
            if isinstance(view, mmap.mmap):
                view.close()
        return
    with store.open_reader(key) as raw:
        head, stream = _sniff(raw)
        codec = compression_of(head)
        if codec is not None:
            with _inflated(stream, codec, store.child_url(key), inflate) as inflated:
                yield inflated
            return
        size = stream_size(stream)
        if size is None:
            size = store.size(key)
        yield StreamView(stream, size, stream.tell() if stream.seekable() else 0)


def scan_shard(
    shard: ShardView, url: str, *, start: int = 0, want_data: bool = True
) -> Iterator[Member | Bad]:
    """:func:`~fastload.formats.webdataset._scan.scan` for what :func:`open_shard` gave:
    compressed shards are scanned from their start, with data (``start`` must be 0).

    Raises:
        FormatError: ``start`` is not 0 for a compressed shard.
    """
    if isinstance(shard, InflatedView):
        if start:
            raise _refuse(shard.codec, url)
        return scan_inflated(shard, url)
    return scan(shard, url, start=start, want_data=want_data)
