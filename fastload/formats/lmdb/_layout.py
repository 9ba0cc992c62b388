"""The bytes of a fastload LMDB shard: reserved keys, value encoding, file detection.

See ``README.md`` in this package for the specification; this module is its single implementation
of names and constants, shared by the writer and the reader.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_FIELD_BYTES",
    "META_KEY",
    "POSITION_PREFIX",
    "RESERVED_PREFIX",
    "detect",
    "pack_meta",
    "pack_value",
    "position_key",
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

_POS = struct.Struct(">Q")

# LMDB meta page (the first page of the file) on 64-bit builds: a 16-byte page header whose
# ``mp_flags`` (uint16 at offset 10) has P_META (0x08), then ``mm_magic`` (uint32 0xBEEFC0DE at
# offset 16) and ``mm_version`` (uint32 1 at offset 20), in the writing machine's byte order.
_MAGIC_OFFSET = 16
_P_META = 0x08
_LITTLE = struct.Struct("<HH4xII")  # at offset 8: pad, flags, (lower, upper), magic, version
_BIG = struct.Struct(">HH4xII")
_MAGIC = 0xBEEFC0DE
_DATA_VERSION = 1


def position_key(position: int) -> bytes:
    """The reserved key holding the sample key at ``position`` (0-based, insertion order)."""
    return POSITION_PREFIX + _POS.pack(position)


def _str_header(size: int) -> bytes:
    if size < 32:
        return bytes((0xA0 | size,))
    if size < 1 << 8:
        return b"\xd9" + bytes((size,))
    if size < 1 << 16:
        return b"\xda" + size.to_bytes(2, "big")
    return b"\xdb" + size.to_bytes(4, "big")


def _bin_header(size: int) -> bytes:
    if size < 1 << 8:
        return b"\xc4" + bytes((size,))
    if size < 1 << 16:
        return b"\xc5" + size.to_bytes(2, "big")
    return b"\xc6" + size.to_bytes(4, "big")


def _map_header(size: int) -> bytes:
    if size < 16:
        return bytes((0x80 | size,))
    if size < 1 << 16:
        return b"\xde" + size.to_bytes(2, "big")
    return b"\xdf" + size.to_bytes(4, "big")


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
    header = _map_header(len(fields))
    for name, data in fields.items():
        packed_name = _NAME_CACHE.get(name)
        if packed_name is None:
            raw = name.encode("utf-8")
            packed_name = _str_header(len(raw)) + raw
            if len(_NAME_CACHE) < 4096:
                _NAME_CACHE[name] = packed_name
        size = len(data)
        if size > MAX_FIELD_BYTES:
            raise ValueError(f"field {name!r} is {size} bytes; msgpack frames at most 4 GiB - 1")
        parts.append(header + packed_name + _bin_header(size))
        parts.append(data)
        header = b""
    if not parts:
        parts.append(header)
    return parts


def pack_value(fields: dict[str, bytes]) -> bytes:
    """A sample's LMDB value: msgpack map field name (str) → bytes (msgpack ``bin``), in the
    sample's field order."""
    return b"".join(value_parts(fields))


def pack_meta(num_samples: int) -> bytes:
    """The value stored under :data:`META_KEY`."""
    meta: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "num_samples": num_samples,
    }
    packed: bytes = msgpack.packb(meta, use_bin_type=True)
    return packed


def detect(head: bytes) -> bool:
    """Whether ``head`` (the first bytes of a file, at least 24) starts with an LMDB meta page.

    Checks the page header's P_META flag, the magic ``0xBEEFC0DE`` at byte 16 and data version 1,
    in either byte order. This recognises any LMDB file written by a 64-bit build, not only
    fastload shards; the reader checks the fastload meta key.
    """
    if len(head) < _MAGIC_OFFSET + 8:
        return False
    for layout in (_LITTLE, _BIG):
        _pad, flags, magic, version = layout.unpack_from(head, 8)
        if magic == _MAGIC and version == _DATA_VERSION and flags & _P_META:
            return True
    return False
