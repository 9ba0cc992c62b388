"""A shard's bytes as slices: the view the tar scanner reads, over a map, bytes or a stream."""

from __future__ import annotations

import io
from typing import Protocol

__all__ = ["ShardView", "StreamView", "stream_size"]


class ShardView(Protocol):
    """A shard's bytes by slicing: ``view[a:b]`` is ``bytes`` (shorter only where the shard
    ends) and ``len(view)`` is the shard's size. ``bytes`` and ``mmap.mmap`` are views; so is
    :class:`StreamView` over a stream."""

    def __len__(self) -> int: ...

    def __getitem__(self, item: slice, /) -> bytes: ...


class StreamView:
    """A :class:`ShardView` over a binary stream, for shards that are not local files.

    :func:`~._scan.scan` slices in increasing order (it may ask for the last slice again, which is
    kept), so a stream that cannot seek is only read forward (gaps are read and dropped); a seekable
    stream is positioned with ``seek`` when a slice starts elsewhere, except past gaps of up to
    4 KiB (a member's padding), which are read. Slices must have a start and a stop and no step.

    Args:
        stream: The stream, positioned at byte ``position`` of the shard.
        size: The shard's size in bytes.
        position: The shard offset of the stream's current position.
    """

    __slots__ = ("_last", "_last_start", "_pos", "_read", "_size", "_stream")

    def __init__(self, stream: io.BufferedIOBase, size: int, position: int = 0) -> None:
        self._stream = stream
        self._read = stream.read
        self._size = size
        self._pos = position
        self._last = b""  # the last slice returned, which began at _last_start
        self._last_start = -1

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, item: slice, /) -> bytes:
        start, stop = item.start, item.stop
        if start != self._pos:
            if start == self._last_start and stop - start == len(self._last):
                return self._last
            self._move(start)
        n = min(stop, self._size) - start
        if n <= 0:
            return b""
        data = self._read(n)
        if 0 < len(data) < n:  # a raw stream may return less than asked before its end
            parts = [data]
            got = len(data)
            while got < n and (more := self._read(n - got)):
                parts.append(more)
                got += len(more)
            data = b"".join(parts)
        self._pos = start + len(data)
        self._last, self._last_start = data, start
        return data

    def _move(self, offset: int) -> None:
        stream = self._stream
        # A small gap forward (a member's padding) is cheaper to read past than to seek over.
        if not 0 < offset - self._pos <= 4096 and stream.seekable():
            stream.seek(offset)
            self._pos = offset
            return
        if offset < self._pos:
            raise ValueError(
                f"cannot go back from byte {self._pos} to {offset} in a stream that cannot seek"
            )
        while self._pos < offset:
            chunk = self._read(min(offset - self._pos, 1 << 20))
            if not chunk:
                return  # the stream ended early; the read that follows comes back empty
            self._pos += len(chunk)


def stream_size(stream: io.BufferedIOBase) -> int | None:
    """The size of a seekable stream's object in bytes (its position is kept), else ``None``."""
    if not stream.seekable():
        return None
    here = stream.tell()
    size = stream.seek(0, io.SEEK_END)
    stream.seek(here)
    return size
