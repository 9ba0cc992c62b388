"""DALI ``tfrecord2idx``-format index files: ``<offset> <size>\\n`` per record."""

from __future__ import annotations

import io
from array import array

from fastload.errors import CorruptDataError, FormatError
from fastload.formats.tfrecord._compression import detect_compression
from fastload.formats.tfrecord._framing import HEADER, HEADER_SIZE, masked_crc
from fastload.storage import Store

__all__ = ["RecordIndex", "build_index", "parse_index"]


class RecordIndex:
    """Byte ranges of a shard's records, from its index file.

    Attributes:
        offsets: Byte offset of each record's length field.
        sizes: Whole framed size of each record (``16 + payload length``).
    """

    def __init__(self, offsets: array[int], sizes: array[int]) -> None:
        self.offsets, self.sizes = offsets, sizes

    def __len__(self) -> int:
        return len(self.offsets)


def parse_index(text: bytes, *, url: str) -> RecordIndex:
    """Parse index bytes (any whitespace between numbers, as DALI accepts).

    Raises:
        CorruptDataError: A token is not a non-negative integer, the count is odd, a size is
            below 16, or records overlap or go backwards.
    """
    tokens = text.split()
    if len(tokens) % 2:
        raise CorruptDataError(
            "TFRecord index has an odd number of values; expected '<offset> <size>' per line. "
            "Rebuild it with `fastload index`",
            url=url,
        )
    try:
        numbers = array("q", map(int, tokens))
    except (ValueError, OverflowError) as exc:
        raise CorruptDataError(
            f"TFRecord index holds a value that is not an integer ({exc}); rebuild it with "
            "`fastload index`",
            url=url,
        ) from exc
    offsets, sizes = numbers[0::2], numbers[1::2]
    end = 0
    for i, (offset, size) in enumerate(zip(offsets, sizes)):
        if size < 16 or offset < end:
            raise CorruptDataError(
                f"TFRecord index line {i + 1} ('{offset} {size}') is impossible: records are "
                "at least 16 bytes and follow each other; rebuild the index with `fastload index`",
                url=url,
            )
        end = offset + size
    return RecordIndex(offsets, sizes)


def build_index(store: Store, key: str) -> bytes:
    """The index of an uncompressed TFRecord shard, byte-identical to DALI's ``tfrecord2idx``.

    Reads only the 12-byte record headers (seeking over payloads) and checks each length's CRC.

    Raises:
        FormatError: The file is gzip/zlib-compressed (records have no byte offsets there).
        CorruptDataError: A length CRC does not match or the last record is truncated.
    """
    url = store.child_url(key)
    size = store.size(key)
    lines: list[str] = []
    offset = 0
    with store.open_reader(key) as f:
        while offset < size:
            header = f.read(HEADER_SIZE)
            if offset == 0:
                _plausible, compression = detect_compression(header)
                if compression is not None:
                    raise FormatError(
                        f"{compression}-compressed TFRecord files cannot be indexed: records in "
                        "them have no byte offsets, and DALI cannot read compressed files. "
                        "Decompress the file (or rewrite it with fastload) to index it",
                        url=url,
                    )
            if len(header) < HEADER_SIZE:
                raise CorruptDataError(
                    f"truncated TFRecord header: {len(header)} of 12 bytes at the end of the file",
                    url=url,
                    offset=offset,
                )
            length, stored = HEADER.unpack(header)
            if masked_crc(header[:8]) != stored:
                raise CorruptDataError(
                    "TFRecord length CRC mismatch; the record length cannot be trusted, so no "
                    "later record can be located",
                    url=url,
                    offset=offset,
                )
            record = length + 16
            if offset + record > size:
                raise CorruptDataError(
                    f"truncated TFRecord record: needs {record} bytes, the file has "
                    f"{size - offset} left",
                    url=url,
                    offset=offset,
                )
            lines.append(f"{offset} {record}\n")
            offset += record
            f.seek(offset, io.SEEK_SET)
    return "".join(lines).encode("ascii")
