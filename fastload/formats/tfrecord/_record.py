"""One TFRecord record read into a sample, and the errors a damaged record raises.

The reader meets records three ways (out of a memory map, through a stream, by position with an
index); what a record's payload decodes to, how its CRC is checked and how each kind of damage is
worded is the same for all three, and lives here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastload.errors import CorruptDataError
from fastload.formats.tfrecord._decode import FAST_PATH_MISSES, Buffer, decode_fast, decode_runtime
from fastload.formats.tfrecord._example import ProtoError
from fastload.formats.tfrecord._framing import crc32c, mask

__all__ = ["BadChecksum", "RecordErrors", "decode_record", "read_exact"]

#: Reads of a stream are made in pieces of at most this size, so that a damaged length field
#: (or a decompression bomb) costs memory for the bytes that exist, not for the length declared.
_MAX_READ = 1024 * 1024
_META = ("__key__", "__url__", "__index__")


class BadChecksum(Exception):
    """A record's payload does not match the CRC32C in its footer."""


def decode_record(
    buf: Buffer, start: int, end: int, stored: int | None, sample: dict[str, Any]
) -> str | None:
    """Add the fields of the Example in ``buf[start:end]`` to ``sample``; return its ``__key__``.

    Each value is copied out of ``buf`` once. ``stored`` is the masked CRC32C from the record's
    footer (``None``: not checked); the CRC is checked before a decoding error is reported, so
    damage reads as damage, not as a bad Example.

    Raises:
        BadChecksum: The payload does not match ``stored``.
        ProtoError: The payload is not a valid Example.
    """
    try:
        key, crc = decode_fast(buf, start, end, None if stored is None else 0, sample)
    except FAST_PATH_MISSES:
        payload = buf[start:end]  # bytes; no copy when buf is that payload already
        if stored is not None and mask(crc32c(payload)) != stored:
            raise BadChecksum from None
        key, fields = decode_runtime(payload)
        meta = {name: sample[name] for name in _META if name in sample}
        sample.clear()  # drop what the fast path added before it gave up
        sample.update(meta)
        sample.update(fields)
        return key
    if stored is not None and mask(crc) != stored:
        raise BadChecksum
    return key


def read_exact(read: Callable[[int], bytes], n: int) -> bytes:
    """``n`` bytes from ``read``, in pieces of at most 1 MiB (fewer at the end of the stream)."""
    if n <= _MAX_READ:
        return read(n)
    parts = []
    while n > 0:
        part = read(min(n, _MAX_READ))
        if not part:
            break
        parts.append(part)
        n -= len(part)
    return b"".join(parts)


class RecordErrors:
    """The :class:`~fastload.errors.CorruptDataError` for each kind of damage in one shard.

    ``offset`` is the byte offset of the record concerned; ``compression`` the shard's
    (``None``: plain), in which case the offset is one in the decompressed stream and the
    message says so.

    Args:
        url: The shard's URL, named by every error.
    """

    def __init__(self, url: str) -> None:
        self.url = url

    def corrupt(self, message: str, offset: int, compression: str | None) -> CorruptDataError:
        """The error saying ``message`` about the bytes at ``offset``."""
        if compression is not None:
            message += f" (offset in the {compression}-decompressed stream)"
        return CorruptDataError(message, url=self.url, offset=offset)

    def truncated_header(
        self, found: int, offset: int, compression: str | None
    ) -> CorruptDataError:
        """The shard ends ``found`` bytes into the header of a record."""
        return self.corrupt(
            f"truncated TFRecord: the file ends {found} bytes into a 12-byte record header",
            offset,
            compression,
        )

    def length_crc(self, i: int, offset: int, compression: str | None) -> CorruptDataError:
        """The length of record ``i`` fails its CRC, so the records after it cannot be found."""
        return self.corrupt(
            f"TFRecord length CRC mismatch in record {i}: the record length cannot be trusted, "
            "so the rest of the shard cannot be read",
            offset,
            compression,
        )

    def truncated_record(
        self, i: int, length: int, found: int, offset: int, compression: str | None
    ) -> CorruptDataError:
        """Record ``i`` declares a ``length``-byte payload, and only ``found`` bytes of the
        record (framing included) are there."""
        return self.corrupt(
            f"truncated TFRecord: record {i} needs {length + 16} bytes, the file ends after "
            f"{found}",
            offset,
            compression,
        )

    def payload_crc(self, i: int, offset: int, compression: str | None) -> CorruptDataError:
        """The payload of record ``i`` fails its CRC."""
        return self.corrupt(
            f"TFRecord payload CRC mismatch in record {i}: the data is damaged", offset, compression
        )

    def undecodable(
        self, exc: BadChecksum | ProtoError, i: int, offset: int, compression: str | None
    ) -> CorruptDataError:
        """What :func:`decode_record` raised for record ``i``, as the error to report: its
        payload fails its CRC (:class:`BadChecksum`) or is not an Example (``ProtoError``)."""
        if isinstance(exc, BadChecksum):
            return self.payload_crc(i, offset, compression)
        return self.corrupt(f"record {i}: {exc}", offset, compression)
