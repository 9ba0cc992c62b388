"""Compressed TFRecord files: detection and streaming decompression (GZIP and ZLIB).

TensorFlow's ``TFRecordOptions(compression_type="GZIP" | "ZLIB")`` compresses the whole file as
one deflate stream (with a gzip or a zlib wrapper); the records inside are framed as usual.
There is no random access into such a file: offsets of records exist only in the decompressed
stream.
"""

from __future__ import annotations

import io
import zlib
from typing import Any, Literal

from fastload.errors import CorruptDataError, InvalidArgumentError
from fastload.formats.tfrecord._framing import valid_header

__all__ = ["Compression", "InflateReader", "detect_compression", "normalize_compression", "wbits"]

#: ``None`` for plain files, else the compression of the whole file.
Compression = Literal["gzip", "zlib"] | None

_GZIP_MAGIC = b"\x1f\x8b"
_CHUNK = 1 << 20


def normalize_compression(value: str | None, *, allow_auto: bool) -> str | None:
    """Map user spellings (``"GZIP"``, ``""``, ``"none"``, ``None``, ``"auto"``) to
    ``None``/``"gzip"``/``"zlib"``/``"auto"``."""
    text = (value or "").strip().lower()
    if text in ("", "none"):
        return None
    if text in ("gzip", "zlib") or (allow_auto and text == "auto"):
        return text
    accepted = "'auto', " if allow_auto else ""
    raise InvalidArgumentError(
        f"compression must be one of {accepted}None, 'gzip', 'zlib' (TensorFlow's "
        f"compression_type), got {value!r}"
    )


def wbits(compression: str) -> int:
    """The ``zlib`` window-bits value for a compression name (gzip: 31, zlib: 15)."""
    return 31 if compression == "gzip" else 15


def _looks_zlib(head: bytes) -> bool:
    return (
        len(head) >= 2
        and head[0] & 0x0F == 8
        and head[0] >> 4 <= 7
        and (head[0] << 8 | head[1]) % 31 == 0
    )


def _inflated_head(head: bytes, compression: str) -> tuple[bytes, bool]:
    """Up to 64 decompressed bytes of ``head`` and whether ``head`` inflates without error."""
    inflater = zlib.decompressobj(wbits(compression))
    try:
        out = inflater.decompress(head, 64)
    except zlib.error:
        return b"", False
    return out, True


def detect_compression(head: bytes) -> tuple[bool, Compression]:
    """Classify the first bytes of a file: ``(looks_like_tfrecord, compression)``.

    A plain file must start with a record header whose length CRC matches. A compressed file must
    carry the gzip magic (or a valid zlib header) *and* decompress to such a record header, so a
    ``.tar.gz`` or other gzip data is not mistaken for TFRecord. When ``head`` is too short to
    inflate 12 bytes (a dynamic Huffman table alone can take a hundred bytes), a gzip stream that
    inflates without error so far counts as plausible. An empty ``head`` is a plain, empty file.
    """
    if not head:
        return True, None
    if valid_header(head):
        return True, None
    compression: Compression
    if head.startswith(_GZIP_MAGIC):
        compression = "gzip"
    elif _looks_zlib(head):
        compression = "zlib"
    else:
        return False, None
    inner, ok = _inflated_head(head, compression)
    if len(inner) >= 12:
        return valid_header(inner), compression
    return ok and compression == "gzip", compression


#: Compressed bytes fed at a time when recovering the output that preceded damage.
_SALVAGE_STEP = 16 * 1024


def _salvage(inflater: Any, data: bytes) -> bytes:
    """What ``inflater`` (a copy taken before the call that failed on ``data``) decompresses
    from ``data`` before the damage: ``data`` is fed in steps, and the step that fails once more
    byte by byte, keeping every byte of output that a successful call returned.

    The output is at most what the failed call was allowed to return (it failed before reaching
    its limit), so this is as bounded as the normal path.
    """
    out: list[bytes] = []
    pos = 0
    while pos < len(data):
        piece = data[pos : pos + _SALVAGE_STEP]
        trial = inflater.copy()
        try:
            out.append(trial.decompress(piece))
        except zlib.error:
            for i in range(len(piece)):  # inflater is at the state before this piece
                try:
                    out.append(inflater.decompress(piece[i : i + 1]))
                except zlib.error:
                    break
            break
        inflater = trial
        pos += len(piece)
    return b"".join(out)


class InflateReader(io.RawIOBase):
    """A read-only stream of the decompressed bytes of a gzip or zlib stream.

    Handles concatenated members (``cat a.gz b.gz``). A stream that ends inside a member, or whose
    bytes do not inflate, raises :class:`CorruptDataError` naming ``url`` and, as its ``offset``,
    the position in the *decompressed* stream where the damage begins. Every byte decompressed
    before the damage is returned first (the error comes with the read after them), so a reader
    of records keeps all the records that precede it.
    """

    def __init__(self, source: io.BufferedIOBase, compression: str, *, url: str) -> None:
        super().__init__()
        self._source, self._wbits, self._url = source, wbits(compression), url
        self._compression = compression
        self._inflater = zlib.decompressobj(self._wbits)
        self._pending = b""
        self._pos = 0  # next unread byte of _pending
        self._eof = False
        self._consumed = 0  # compressed bytes handed to the inflater
        self._produced = 0  # decompressed bytes produced so far (_pending included)
        self._error: CorruptDataError | None = None  # raised once _pending is returned

    def readable(self) -> bool:
        return True

    def _fail(self, why: str) -> CorruptDataError:
        return CorruptDataError(
            f"{self._compression}-compressed TFRecord stream {why} after {self._produced} "
            f"decompressed bytes (around compressed byte {self._consumed}; the error's offset is "
            "in the decompressed stream); what follows is lost: the file is damaged or truncated",
            url=self._url,
            offset=self._produced,
        )

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        out = memoryview(buffer).cast("B")
        want = out.nbytes
        while self._pos >= len(self._pending) and not self._eof and want:
            if self._error is not None:
                raise self._error
            if self._inflater.eof:
                rest = self._inflater.unused_data
                self._inflater = zlib.decompressobj(self._wbits)
                if not rest:
                    rest = self._source.read(_CHUNK)
                    if not rest:
                        self._eof = True
                        break
                data = rest
            else:
                data = self._inflater.unconsumed_tail or self._source.read(_CHUNK)
                if not data:
                    raise self._fail("ends in the middle of a compressed member")
                if data is not self._inflater.unconsumed_tail:
                    self._consumed += len(data)
            before = self._inflater.copy()
            failure: zlib.error | None = None
            try:
                self._pending = self._inflater.decompress(data, max(want, _CHUNK))
            except zlib.error as exc:
                # The failed call's output is lost with the exception: recover it, return it,
                # and raise with the next read.
                self._pending = _salvage(before, data)
                failure = exc
            self._pos = 0
            self._produced += len(self._pending)
            if failure is not None:
                self._error = self._fail(f"does not decompress ({failure})")
        n = min(want, len(self._pending) - self._pos)
        out[:n] = memoryview(self._pending)[self._pos : self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        try:
            self._source.close()
        finally:
            super().close()
