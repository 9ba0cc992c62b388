"""The bytes fastload puts in an LMDB shard: reserved keys and the encoding of values.

See ``README.md`` in this package for the specification; this module is its single implementation
of names and constants, shared by the writer and the reader. LMDB's own file structure (pages,
meta pages, detection) is in :mod:`._pages`; the reader's page checks are in :mod:`._pagemap`.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from fastload.errors import CorruptDataError, FormatError

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_FIELD_BYTES",
    "META_KEY",
    "POSITION_PREFIX",
    "REMEDY",
    "RESERVED_PREFIX",
    "pack_meta",
    "pack_value",
    "position_key",
    "unpack_meta",
    "unpack_value",
    "value_parts",
]

#: Every reserved key starts with these bytes. Sample keys never contain NUL, so they cannot collide.
RESERVED_PREFIX = b"\x00fastload/"
#: msgpack map describing the shard: ``{"format": "fastload-lmdb", "version": 1, "num_samples": N}``.
META_KEY = RESERVED_PREFIX + b"meta"
#: ``POSITION_PREFIX + position.to_bytes(8, "big")`` → the UTF-8 sample key at that position.
POSITION_PREFIX = RESERVED_PREFIX + b"pos/"
#: Value of ``"format"`` in the meta map.
FORMAT_NAME = "fastload-lmdb"
#: Layout version written by this code; readers refuse newer versions.
FORMAT_VERSION = 1
#: What a damaged shard's error tells the user to do. ``fastload index`` cannot help: an LMDB
#: shard is its own index.
REMEDY = "re-create the shard with `fastload convert` or restore it from a copy"

_POS = struct.Struct(">Q")


def position_key(position: int) -> bytes:
    """The reserved key holding the sample key at ``position`` (0-based, insertion order)."""
    return POSITION_PREFIX + _POS.pack(position)


#: msgpack's length headers, per type: ``(fix, fix_limit, tag8, tag16, tag32)``. Below
#: ``fix_limit`` the header is the one byte ``fix | size``; else the type byte of the smallest
#: big-endian length that holds the size (``tag8`` 0: the type has no 8-bit length).
_STR = (0xA0, 32, 0xD9, 0xDA, 0xDB)
_BIN = (0x00, 0, 0xC4, 0xC5, 0xC6)
_MAP = (0x80, 16, 0x00, 0xDE, 0xDF)


def _header(kind: tuple[int, int, int, int, int], size: int) -> bytes:
    """The msgpack header of a ``kind`` (:data:`_STR`, :data:`_BIN`, :data:`_MAP`) of ``size``
    bytes or entries, the smallest there is, as ``msgpack.packb`` writes it."""
    fix, fix_limit, tag8, tag16, tag32 = kind
    if size < fix_limit:
        return bytes((fix | size,))
    if tag8 and size < 1 << 8:
        return bytes((tag8, size))
    if size < 1 << 16:
        return bytes((tag16,)) + size.to_bytes(2, "big")
    return bytes((tag32,)) + size.to_bytes(4, "big")


#: Largest field (and field count) msgpack can frame: its length prefixes are 32-bit.
MAX_FIELD_BYTES = (1 << 32) - 1

_NAME_CACHE: dict[str, bytes] = {}


def value_parts(fields: dict[str, bytes]) -> list[bytes]:
    """A sample's LMDB value as pieces whose concatenation is :func:`pack_value`'s result,
    ``[header, data, header, data, ...]``: the field bytes are the caller's objects, not copies,
    so the value can be written out with one gathering write.

    The encoding is msgpack's smallest for each item, exactly what ``msgpack.packb(fields,
    use_bin_type=True)`` produces.

    Raises:
        ValueError: A field name is not encodable as UTF-8, or a field is 4 GiB or larger.
    """
    parts: list[bytes] = []
    header = _header(_MAP, len(fields))
    for name, data in fields.items():
        packed_name = _NAME_CACHE.get(name)
        if packed_name is None:
            raw = name.encode("utf-8")
            packed_name = _header(_STR, len(raw)) + raw
            if len(_NAME_CACHE) < 4096:
                _NAME_CACHE[name] = packed_name
        size = len(data)
        if size > MAX_FIELD_BYTES:
            raise ValueError(f"field {name!r} is {size} bytes; msgpack frames at most 4 GiB - 1")
        parts.append(header + packed_name + _header(_BIN, size))
        parts.append(data)
        header = b""
    if not parts:
        parts.append(header)
    return parts


def pack_value(fields: dict[str, bytes]) -> bytes:
    """A sample's LMDB value: msgpack map field name (str) → bytes (msgpack ``bin``), in the
    sample's field order."""
    return b"".join(value_parts(fields))


def unpack_value(value: Any) -> dict[str, bytes]:
    """The fields of a sample value (``bytes`` or a buffer), checked: the inverse of
    :func:`pack_value`, for values written by any msgpack writer, in their stored order.

    Raises:
        ValueError: The value is not a msgpack map of field names (``str``, not reserved) to
            ``bytes``, or it repeats a field name; the message says which.
    """
    try:
        fields = msgpack.unpackb(value, raw=False)
    except Exception as exc:
        raise ValueError(
            f"sample value is not valid msgpack ({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(fields, dict):
        raise ValueError(
            f"sample value is a msgpack {type(fields).__name__}, expected a map of fields"
        )
    head = value[0]
    if len(fields) != (head & 0x0F if head & 0xF0 == 0x80 else _map_length(value)):
        raise ValueError("sample value repeats a field name")  # msgpack keeps the last one
    for name, data in fields.items():
        if (
            type(data) is not bytes
            or type(name) is not str
            or not name
            or name[0] == "_" == name[1:2]
        ):
            raise ValueError(f"sample field {name!r:.80} is not a str name with a bytes value")
    return fields


def _map_length(value: Any) -> int:
    """The entry count in the header of the msgpack map that starts ``value``."""
    first = value[0]
    if first & 0xF0 == 0x80:
        return int(first & 0x0F)
    width = 2 if first == 0xDE else 4
    return int.from_bytes(bytes(value[1 : 1 + width]), "big")


def pack_meta(num_samples: int) -> bytes:
    """The value stored under :data:`META_KEY`."""
    meta: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "num_samples": num_samples,
    }
    packed: bytes = msgpack.packb(meta, use_bin_type=True)
    return packed


def unpack_meta(raw: bytes, *, url: str) -> int:
    """The sample count in the meta value ``raw`` of shard ``url``, checked: the inverse of
    :func:`pack_meta`.

    Raises:
        CorruptDataError: The value is not a valid meta map.
        FormatError: The shard's layout version is newer than this fastload reads.
    """
    key = META_KEY.decode()
    try:
        meta = msgpack.unpackb(raw, raw=False)
    except Exception as exc:
        raise CorruptDataError(
            f"meta value is not valid msgpack ({type(exc).__name__}: {exc}); {REMEDY}",
            url=url,
            key=key,
        ) from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise CorruptDataError(
            f"meta value is not a {FORMAT_NAME!r} map: {meta!r:.200}; {REMEDY}",
            url=url,
            key=key,
        )
    version, count = meta.get("version"), meta.get("num_samples")
    if (
        type(version) is not int
        or type(count) is not int
        or count < 0
        or count >= 1 << 48  # more entries than an LMDB file can hold
    ):
        raise CorruptDataError(
            f"meta value has no valid version/num_samples: {meta!r:.200}; {REMEDY}",
            url=url,
            key=key,
        )
    if version > FORMAT_VERSION:
        raise FormatError(
            f"shard uses LMDB layout version {version}, this fastload reads up to "
            f"{FORMAT_VERSION}; upgrade fastload",
            url=url,
            key=key,
        )
    return count
