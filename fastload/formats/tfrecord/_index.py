"""DALI ``tfrecord2idx``-format index files: ``<offset> <size>\\n`` per record."""

from __future__ import annotations

import io
from array import array

from fastload.errors import CorruptDataError, FormatError
from fastload.formats.tfrecord._compression import detect_compression
from fastload.formats.tfrecord._framing import HEADER, HEADER_SIZE, masked_crc
from fastload.storage import ByteRange, Store

__all__ = ["RecordIndex", "build_index", "parse_index", "scan_index"]


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


def parse_index(text: bytes, *, url: str, shard_size: int | None = None) -> RecordIndex:
    """Parse index bytes (any whitespace between numbers, as DALI accepts) and check that they
    describe every record of a shard exactly once.

    Records follow each other without gaps from byte 0 (as ``tfrecord2idx`` writes them): a gap
    would hide a record, an overlap or a repeated line would deliver one twice.

    Args:
        text: The index file's bytes.
        url: The index URL, for messages.
        shard_size: If given, the records must end exactly at this many bytes.

    Raises:
        CorruptDataError: A token is not a non-negative integer, the count is odd, a size is
            below 16, records do not follow each other from byte 0, or they do not end where
            the shard does.
    """
    fix = "; the index is damaged or stale: rebuild it with `fastload index`"
    tokens = text.split()
    if len(tokens) % 2:
        raise CorruptDataError(
            f"TFRecord index has an odd number of values; expected '<offset> <size>' per line{fix}",
            url=url,
        )
    try:
        numbers = array("q", map(int, tokens))
    except (ValueError, OverflowError) as exc:
        raise CorruptDataError(
            f"TFRecord index holds a value that is not an integer ({exc}){fix}", url=url
        ) from exc
    offsets, sizes = numbers[0::2], numbers[1::2]
    end = 0
    for i, (offset, size) in enumerate(zip(offsets, sizes)):
        if size < 16 or offset != end:
            raise CorruptDataError(
                f"TFRecord index line {i + 1} ('{offset} {size}') is impossible: records are at "
                f"least 16 bytes and follow each other without gaps, so this one should start at "
                f"byte {end}{fix}",
                url=url,
            )
        end = offset + size
    if shard_size is not None and end != shard_size:
        raise CorruptDataError(
            f"TFRecord index covers bytes [0, {end}) but the shard is {shard_size} bytes long{fix}",
            url=url,
        )
    return RecordIndex(offsets, sizes)


def scan_index(store: Store, key: str) -> tuple[RecordIndex, CorruptDataError | None]:
    """The records of an uncompressed shard found by reading their headers, up to the first damage.

    Returns the index of the records before the first damaged header (length CRC mismatch or
    truncation) and that damage (``None`` for an intact shard). Payloads are not checked.
    """
    url = store.child_url(key)
    size = store.size(key)
    offsets, sizes = array("q"), array("q")
    offset = 0
    damage: CorruptDataError | None = None
    with store.open_reader(key) as f:
        while offset < size:
            header = f.read(HEADER_SIZE)
            if len(header) < HEADER_SIZE:
                damage = CorruptDataError(
                    f"truncated TFRecord header: {len(header)} of 12 bytes at the end of the file",
                    url=url,
                    offset=offset,
                )
                break
            length, stored = HEADER.unpack(header)
            if masked_crc(header[:8]) != stored:
                damage = CorruptDataError(
                    "TFRecord length CRC mismatch; the record length cannot be trusted, so no "
                    "later record can be located",
                    url=url,
                    offset=offset,
                )
                break
            record = length + 16
            if offset + record > size:
                damage = CorruptDataError(
                    f"truncated TFRecord record: needs {record} bytes, the file has "
                    f"{size - offset} left",
                    url=url,
                    offset=offset,
                )
                break
            offsets.append(offset)
            sizes.append(record)
            offset += record
            f.seek(offset, io.SEEK_SET)
    return RecordIndex(offsets, sizes), damage


def build_index(store: Store, key: str) -> bytes:
    """The index of an uncompressed TFRecord shard, byte-identical to DALI's ``tfrecord2idx``.

    Reads only the 12-byte record headers (seeking over payloads) and checks each length's CRC.

    Raises:
        FormatError: The file is gzip/zlib-compressed (records have no byte offsets there).
        CorruptDataError: A length CRC does not match or the last record is truncated.
    """
    url = store.child_url(key)
    head = store.get(key, ByteRange(0, min(store.size(key), HEADER_SIZE)))
    _plausible, compression = detect_compression(head)
    if compression is not None:
        raise FormatError(
            f"{compression}-compressed TFRecord files cannot be indexed: records in "
            "them have no byte offsets, and DALI cannot read compressed files. "
            "Decompress the file (or rewrite it with fastload) to index it",
            url=url,
        )
    index, damage = scan_index(store, key)
    if damage is not None:
        raise damage
    return "".join(f"{o} {n}\n" for o, n in zip(index.offsets, index.sizes)).encode("ascii")
