"""DALI ``tfrecord2idx``-format index files: ``<offset> <size>\\n`` per record."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import numpy.typing as npt

from fastload.errors import CorruptDataError, FormatError
from fastload.formats.tfrecord._compression import detect_compression
from fastload.formats.tfrecord._framing import HEADER, HEADER_SIZE, masked_crc
from fastload.storage import ByteRange, Store

__all__ = ["CODEC", "RecordIndex", "build_index", "parse_index", "parse_local_index", "scan_index"]

_FIX = "; the index is damaged or stale: rebuild it with `fastload index`"
#: Record boundaries below this fit 4 bytes (:class:`RecordIndex`).
_NARROW = 1 << 32


class RecordIndex:
    """Byte ranges of a shard's records, which follow each other without gaps from byte 0.

    Held as one NumPy array of ``n + 1`` record boundaries: 4 bytes a record for a shard under
    4 GiB, else 8 (every open reader of a shard keeps its index: at 10^8 records in 1,000 shards,
    ~400 MB per process that keeps them all open); immutable, so one instance may be shared by
    any number of readers and threads.

    Args:
        bounds: ``n + 1`` increasing byte offsets from 0: record ``i`` is ``[bounds[i], bounds[i + 1])``,
            its length field first (so its whole framed size is ``16 + payload length``).
    """

    def __init__(self, bounds: npt.NDArray[np.integer[Any]]) -> None:
        narrow = len(bounds) > 0 and int(bounds[-1]) < _NARROW  # bounds rise from 0
        self._bounds: npt.NDArray[np.integer[Any]] = (
            bounds.astype(np.uint32, copy=False) if narrow else bounds
        )

    def __len__(self) -> int:
        return len(self._bounds) - 1

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return int(self._bounds.nbytes)

    @property
    def offsets(self) -> npt.NDArray[np.int64]:
        """Each record's offset (of its length field)."""
        return self._bounds[:-1].astype(np.int64)

    @property
    def sizes(self) -> npt.NDArray[np.int64]:
        """Each record's whole framed size (``16 + payload length``)."""
        bounds: npt.NDArray[np.int64] = self._bounds.astype(np.int64)
        return np.diff(bounds)

    @property
    def end(self) -> int:
        """Where the last record ends (0 without records)."""
        return int(self._bounds[-1])

    def record(self, i: int) -> tuple[int, int]:
        """``(offset, size)`` of record ``i`` (``0 <= i < len(self)``)."""
        offset, end = self._bounds[i : i + 2].tolist()
        return offset, end - offset

    def truncated(self, n: int) -> RecordIndex:
        """The first ``n`` records."""
        return self if n >= len(self) else RecordIndex(self._bounds[: n + 1])

    def check_bound(self, shard_size: int, url: str) -> None:
        """Raise unless the records end exactly where a shard of ``shard_size`` bytes does.

        Raises:
            CorruptDataError: Names both sizes.
        """
        if self.end != shard_size:
            raise CorruptDataError(
                f"TFRecord index covers bytes [0, {self.end}) but the shard is {shard_size} bytes "
                f"long{_FIX}",
                url=url,
            )


#: Values :func:`_decimal_values` leaves to ``int()`` (NumPy's parser saturates above 2^63 - 1).
_HUGE = 10**18


def _decimal_values(text: bytes) -> npt.NDArray[np.int64] | None:
    """The whitespace-separated unsigned decimal integers of ``text``, parsed by NumPy's C
    parser (~5x faster than ``int()`` per token: a shard of 10^5 records has 2 x 10^5); or
    ``None`` when ``text`` holds anything but ASCII digits and whitespace (as ``bytes.split()``
    and C's ``isspace`` know it), or a value of 10^18 or more: then ``int()`` per token decides
    what it is."""
    b = np.frombuffer(text, dtype=np.uint8)
    digit = b - np.uint8(48) < 10
    if np.count_nonzero(digit | (b == 32) | (b - np.uint8(9) < 5)) != len(b):  # \t \n \v \f \r
        return None
    tokens = np.count_nonzero(digit[1:] & ~digit[:-1]) + int(len(b) > 0 and digit[0])
    if not tokens:
        return np.zeros(0, dtype=np.int64)
    values = np.fromstring(text, dtype=np.int64, sep=" ")
    if len(values) != tokens or int(values.max()) >= _HUGE:
        return None
    return values


class Codec:
    """A :class:`RecordIndex` as arrays and back, for the index files every process maps
    (:mod:`fastload.formats._cache._files`)."""

    @staticmethod
    def to_arrays(value: RecordIndex) -> tuple[dict[str, npt.NDArray[Any]], dict[str, Any]]:
        return {"bounds": value._bounds}, {}

    @staticmethod
    def from_arrays(arrays: dict[str, npt.NDArray[Any]], values: dict[str, Any]) -> RecordIndex:
        return RecordIndex(arrays["bounds"])


#: The codec of TFRecord's parsed indexes.
CODEC = Codec()


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
    values = _decimal_values(text)
    if values is None:  # a sign, an underscore, a stray byte, a huge value: Python's int() says
        tokens = text.split()
        try:
            values = np.fromiter(map(int, tokens), np.int64, len(tokens))
        except (ValueError, OverflowError) as exc:
            raise CorruptDataError(
                f"TFRecord index holds a value that is not an integer ({exc}){_FIX}", url=url
            ) from exc
    if len(values) % 2:
        raise CorruptDataError(
            f"TFRecord index has an odd number of values; expected '<offset> <size>' per line{_FIX}",
            url=url,
        )
    numbers = values.reshape(-1, 2)
    offsets, sizes = numbers[:, 0], numbers[:, 1]
    bounds = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=bounds[1:])
    bad = np.flatnonzero((sizes < 16) | (offsets < 0) | (offsets != bounds[:-1]))
    if len(bad):
        i = int(bad[0])
        raise CorruptDataError(
            f"TFRecord index line {i + 1} ('{offsets[i]} {sizes[i]}') is impossible: records are "
            f"at least 16 bytes and follow each other without gaps, so this one should start at "
            f"byte {bounds[i]}{_FIX}",
            url=url,
        )
    index = RecordIndex(bounds)
    if shard_size is not None:
        index.check_bound(shard_size, url)
    return index


def parse_local_index(text: bytes, size: int, *, url: str, shard: str) -> RecordIndex:
    """The index of the uncompressed local shard file ``shard`` of ``size`` bytes, whose records
    it must cover exactly (what :func:`~fastload.formats._cache.cached` keeps).

    Raises:
        CorruptDataError: The index is damaged, or does not end where the shard does, or the
            shard is compressed (no index applies).
        OSError: ``shard`` cannot be read.
    """
    with open(shard, "rb") as f:
        compression = detect_compression(f.read(HEADER_SIZE + 64))[1]
    if compression is not None:
        raise CorruptDataError(f"{compression}-compressed: no index applies", url=url)
    return parse_index(text, url=url, shard_size=size)


def scan_index(store: Store, key: str) -> tuple[RecordIndex, CorruptDataError | None]:
    """The records of an uncompressed shard found by reading their headers, up to the first damage.

    Returns the index of the records before the first damaged header (length CRC mismatch or
    truncation) and that damage (``None`` for an intact shard). Payloads are not checked.
    """
    url = store.child_url(key)
    size = store.size(key)
    bounds = [0]
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
            offset += record
            bounds.append(offset)
            f.seek(offset, io.SEEK_SET)
    return RecordIndex(np.array(bounds, dtype=np.int64)), damage


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
    lines = (index.record(i) for i in range(len(index)))
    return "".join(f"{offset} {size}\n" for offset, size in lines).encode("ascii")
