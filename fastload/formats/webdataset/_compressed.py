"""Compressed WebDataset shards: a tar inside one gzip, bzip2 or xz stream (``.tar.gz``/``.tgz``,
``.tar.bz2``, ``.tar.xz``), as the ``webdataset`` library reads them.

Such a shard is read **in order only**: byte offsets of members exist only in the decompressed
stream, so there is no index, no ``len()`` and no random access. :class:`InflatedView` is a
forward-only :class:`~fastload.formats.webdataset._view.ShardView` over the decompressed bytes and
:func:`scan_inflated` runs the tar scanner over it, so a compressed shard yields exactly the
samples, and follows exactly the member rules, of the tar inside it.

Decompression is streamed (the standard library's ``gzip``, ``bz2`` and ``lzma`` readers, one
bounded read at a time): a shard is never held in memory or written to disk. Concatenated
members (``cat a.gz b.gz``) and zero padding after a gzip member are read as gzip does; the gzip
CRC and length of each member are checked when its end is reached.

Damage (a stream that does not decompress, ends early, or fails its CRC) ends the shard: every
sample decompressed before it is delivered, and the damage is reported as a fatal
:class:`~fastload.errors.CorruptDataError` through the reader's error policy, with the offset in
the *decompressed* stream.
"""

from __future__ import annotations

import bz2
import dataclasses
import gzip
import lzma
import zlib
from collections.abc import Iterator
from typing import IO, Any, Literal, cast

from fastload.errors import CorruptDataError
from fastload.formats._base import DAMAGED_SHARD_REMEDY
from fastload.formats.webdataset._scan import Bad, Member, scan
from fastload.formats.webdataset._tar import BLOCK, checksum_ok

__all__ = [
    "COMPRESSED_SUFFIXES",
    "HEAD_BYTES",
    "Codec",
    "InflatedView",
    "compressed_name",
    "compression_of",
    "scan_inflated",
]

Codec = Literal["gzip", "bzip2", "xz"]

#: Bytes of a shard's start that :func:`compression_of` looks at (one tar header block).
HEAD_BYTES = BLOCK
#: Shard names that mark a compressed tar (the ``webdataset`` library's conventions).
COMPRESSED_SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".tbz", ".tbz2", ".tar.xz", ".txz")
#: What :class:`InflatedView` reports as its length: the decompressed size is known only at the
#: end, so the scanner is given an upper bound and finds the end by short reads.
UNKNOWN_SIZE = 1 << 62
#: Most decompressed bytes one read asks for (each is one bounded decompression step, so damage
#: loses at most what that step decompressed).
_STEP = 1 << 20
_XZ_MAGIC = b"\xfd7zXZ\x00"


def compression_of(head: bytes) -> Codec | None:
    """The compression of a shard from its first bytes (:data:`HEAD_BYTES`), ``None`` for a plain
    tar or anything else.

    A valid tar header wins over a magic number: a plain tar whose first member is named
    ``BZh9...`` stays a plain tar.
    """
    if len(head) >= BLOCK and head[257:262] == b"ustar" and checksum_ok(head[:BLOCK]):
        return None
    if head[:3] == b"\x1f\x8b\x08":
        return "gzip"
    if head[:3] == b"BZh" and head[3:4] in (b"1", b"2", b"3", b"4", b"5", b"6", b"7", b"8", b"9"):
        return "bzip2"
    if head[:6] == _XZ_MAGIC:
        return "xz"
    return None


def compressed_name(key: str) -> bool:
    """Whether a shard's name says it is a compressed tar (see :data:`COMPRESSED_SUFFIXES`)."""
    return key.lower().endswith(COMPRESSED_SUFFIXES)


def _decompressing_reader(source: Any, codec: Codec) -> IO[bytes]:
    """The standard library's reader of ``codec`` over ``source`` (closed by
    :meth:`InflatedView.close`; closing it leaves ``source`` open)."""
    if codec == "gzip":
        return cast(IO[bytes], gzip.GzipFile(fileobj=source, mode="rb"))
    if codec == "bzip2":
        return cast(IO[bytes], bz2.BZ2File(source, mode="rb"))
    return cast(IO[bytes], lzma.LZMAFile(source, mode="rb"))


#: What the standard library's decompressing readers raise on damaged or truncated input.
_DAMAGE = (OSError, EOFError, zlib.error, lzma.LZMAError)


class EndOfStream(Exception):
    """Raised by :class:`InflatedView` when a read starts past the end the stream already
    reported: the scanner is looking for data after the end of the archive (there is none)."""


class InflatedView:
    """A forward-only :class:`~fastload.formats.webdataset._view.ShardView` over the
    decompressed bytes of a compressed shard.

    ``len(view)`` is :data:`UNKNOWN_SIZE` (an upper bound; the size is known only at the end).
    Slices must start at or after the end of the previous one (the previous slice may be asked
    for again); gaps are decompressed and dropped. A slice that reaches past the end comes back
    short; a later slice raises :class:`EndOfStream`, which :func:`scan_inflated` turns into the
    end of the archive. Damage makes the stream end where it was found and is kept in
    :attr:`failure`.

    Args:
        source: The compressed bytes: a binary stream (or an ``mmap``) at its start. Not closed
            by the view.
        codec: ``"gzip"``, ``"bzip2"`` or ``"xz"``.
        url: The shard URL, for messages.
    """

    __slots__ = (
        "_ended",
        "_last",
        "_last_start",
        "_pos",
        "_read1",
        "_stream",
        "codec",
        "failure",
        "url",
    )

    def __init__(self, source: Any, codec: Codec, url: str) -> None:
        self._stream = _decompressing_reader(source, codec)
        self._read1 = cast(Any, self._stream).read1
        self.codec: Codec = codec
        self.url = url
        self._pos = 0  # decompressed bytes consumed
        self._last = b""  # the last slice returned, which began at _last_start
        self._last_start = -1
        self._ended = False  # a read came back short: the stream ended (or failed) at _pos
        #: The damage that ended the stream early, or ``None``.
        self.failure: CorruptDataError | None = None

    def __len__(self) -> int:
        return UNKNOWN_SIZE

    def __getitem__(self, item: slice, /) -> bytes:
        start, stop = item.start, item.stop
        if start == self._last_start and stop - start == len(self._last):
            return self._last
        if start < self._pos:
            raise ValueError(
                f"cannot go back from byte {self._pos} to {start} of the decompressed stream of "
                f"{self.url}: compressed shards are read in order only"
            )
        if stop <= start:
            return b""
        if self._ended:
            raise EndOfStream
        if start > self._pos and not self._skip(start - self._pos):
            return b""
        data = self._read(stop - start)
        self._last, self._last_start = data, start
        return data

    def close(self) -> None:
        """Release the decompressor (the source stays open)."""
        self._stream.close()

    def _skip(self, n: int) -> bool:
        """Decompress and drop ``n`` bytes; False when the stream ended first."""
        while n > 0:
            chunk = self._read1_checked(min(n, _STEP))
            if not chunk:
                self._ended = True
                return False
            n -= len(chunk)
            self._pos += len(chunk)
        return True

    def _read(self, n: int) -> bytes:
        data = self._read1_checked(min(n, _STEP))
        if len(data) < n and data:
            parts = [data]
            got = len(data)
            while got < n and (more := self._read1_checked(min(n - got, _STEP))):
                parts.append(more)
                got += len(more)
            data = b"".join(parts)
        self._pos += len(data)
        if len(data) < n:
            self._ended = True
        return data

    def _read1_checked(self, n: int) -> bytes:
        """One bounded decompression step; damage is recorded and reads as the end."""
        if self.failure is not None:
            return b""
        try:
            return cast(bytes, self._read1(n))
        except _DAMAGE as exc:
            self.failure = self._damage(exc)
            return b""

    def _damage(self, exc: BaseException) -> CorruptDataError:
        if isinstance(exc, EOFError):
            what = "ends before the end of its compressed data (the shard is truncated)"
        else:
            what = f"does not decompress ({type(exc).__name__}: {exc})"
        return CorruptDataError(
            f"the {self.codec} stream of this compressed tar shard {what} after {self._pos} "
            "decompressed bytes (the error's offset is in the decompressed stream); the samples "
            f"from there on are lost{DAMAGED_SHARD_REMEDY}",
            url=self.url,
            offset=self._pos,
        )


_OFFSET_NOTE = (
    "byte offsets of a compressed shard are positions in its decompressed tar stream, not in the "
    "file"
)


def scan_inflated(view: InflatedView, url: str) -> Iterator[Member | Bad]:
    """:func:`~fastload.formats.webdataset._scan.scan` over a compressed shard, with data.

    The end of the decompressed stream ends the scan as the end of the archive does. When the
    stream was damaged, the problem the scanner reports where the bytes ran out (a truncated
    archive) is replaced by the decompression error, which says what happened.
    """
    try:
        for item in scan(view, url):
            if isinstance(item, Bad):
                if item.fatal and view.failure is not None:
                    yield dataclasses.replace(item, error=view.failure)  # where it was cut
                    return
                item.error.add_note(_OFFSET_NOTE)
            yield item
    except EndOfStream:
        if view.failure is not None:
            yield Bad(view.failure, fatal=True)
