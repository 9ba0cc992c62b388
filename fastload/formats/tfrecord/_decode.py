"""Decoding ``tf.train.Example`` payloads back into sample fields (see :mod:`._example`).

Two decoders: :func:`decode_fast`, a hand-written reader of the common shape that copies each
value once (straight out of a memory-mapped shard) and computes the payload CRC on the way, and
:func:`decode_runtime`, the protobuf runtime for everything else. :func:`decode_example` tries the
first and falls back to the second; both reverse :func:`~._example.encode_example` exactly.
"""

from __future__ import annotations

import mmap
import struct
from array import array
from typing import Any

import msgpack
from google.protobuf import message

from fastload.formats.manifest import field_type
from fastload.formats.tfrecord._example import (
    INT64_MAX,
    KEY_FEATURE,
    PIECE_MIN,
    UINT64_MASK,
    Example,
    ProtoError,
    float_bytes,
    npy_bytes,
)
from fastload.formats.tfrecord._framing import crc32c_extend

__all__ = [
    "FAST_PATH_MISSES",
    "Buffer",
    "Unusual",
    "decode_example",
    "decode_fast",
    "decode_runtime",
]

#: What :func:`decode_fast` reads from: ``bytes``, or a read-only ``mmap`` of a whole shard (both
#: give an ``int`` for ``buf[i]`` and a new ``bytes`` for ``buf[i:j]``).
Buffer = bytes | mmap.mmap


class Unusual(Exception):
    """The fast decoder met something outside its common shape; use the protobuf runtime."""


#: Everything :func:`decode_fast` raises when it does not decide: the caller then hands the
#: payload to :func:`decode_runtime`, which accepts it or raises :class:`ProtoError`.
FAST_PATH_MISSES = (Unusual, IndexError, UnicodeDecodeError)


def _read_varint(buf: Buffer, pos: int) -> tuple[int, int]:
    """A varint at ``pos`` (at most 10 bytes); ``(value, next_pos)``. Raises IndexError at the end
    of ``buf`` and :class:`Unusual` when too long."""
    b = buf[pos]
    if b < 0x80:
        return b, pos + 1
    value = b & 0x7F
    shift = 7
    pos += 1
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value & UINT64_MASK, pos
        shift += 7
        if shift > 63:
            raise Unusual


def _varint_tail(buf: Buffer, pos: int, low: int) -> tuple[int, int]:
    """The rest of a varint whose first byte ``low`` (>= 0x80) was at ``pos - 1``:
    ``(value, next_pos)``. Two- and three-byte varints (lengths below 2 MiB) take no loop."""
    b = buf[pos]
    if b < 0x80:
        return (low & 0x7F) | b << 7, pos + 1
    c = buf[pos + 1]
    if c < 0x80:
        return (low & 0x7F) | (b & 0x7F) << 7 | c << 14, pos + 2
    return _read_varint(buf, pos - 1)


#: Field name -> whether an int64 feature of that name becomes ``npy`` bytes (else decimal text).
_INT_AS_NPY: dict[str, bool] = {}


def _int_field(name: str, value: int) -> bytes:
    as_npy = _INT_AS_NPY.get(name)
    if as_npy is None:
        as_npy = field_type(name) == "npy"
        if len(_INT_AS_NPY) < 4096:
            _INT_AS_NPY[name] = as_npy
    if as_npy:
        return npy_bytes("<i8", struct.pack("<q", value), 1)
    return str(value).encode("ascii")


#: Roles of feature names: a field, the sample key, or another reserved ``__name__`` (skipped).
_FIELD, _KEY, _RESERVED = 0, 1, 2
#: Encoded feature name -> (name, role); bounded, since names come from data.
_NAMES: dict[bytes, tuple[str, int]] = {}


def _name_role(raw: bytes) -> tuple[str, int]:
    """``(name, role)`` of an encoded feature name. Raises UnicodeDecodeError."""
    name = raw.decode("utf-8")
    role = _KEY if name == KEY_FEATURE else _RESERVED if name.startswith("__") else _FIELD
    if len(_NAMES) < 4096:
        _NAMES[raw] = (name, role)
    return name, role


def decode_fast(
    buf: Buffer, start: int, end: int, crc: int | None, into: dict[str, Any]
) -> tuple[str | None, int]:
    """Decode the common shape of the Example in ``buf[start:end]``, copying each value once.

    The common shape is what fastload and TensorFlow write for one-value features: every entry is
    ``key`` then ``value`` (a name shorter than 128 bytes), every Feature holds one
    ``bytes_list`` of one value or one ``int64_list`` of one value. Anything else raises one of
    :data:`FAST_PATH_MISSES`, and the caller falls back to :func:`decode_runtime`, which
    decides. Bytes of ``buf`` outside ``[start, end)`` may be read but never decide the result
    (every length is checked against ``end``), so ``buf`` can be a memory map of a whole shard.

    Args:
        buf: The buffer holding the payload.
        start: Offset of the payload's first byte in ``buf``.
        end: Offset just past the payload's last byte (exclusive).
        crc: ``None``: no checksum. Otherwise a CRC32C to extend: the result's second item is
            then ``crc32c_extend(crc, buf[start:end])``, computed while decoding, over the
            ``bytes`` each large value is copied into anyway (``google_crc32c`` takes only
            ``bytes``), so no byte of the payload is copied twice just to be checksummed.
        into: The fields are added to this dict, in wire order (a repeated name keeps its last
            value; names starting with ``__`` are not fields). When this raises, ``into`` may
            hold some of the fields: discard it.

    Returns:
        ``(key, crc)``: the ``__key__`` (``None`` if absent) and the extended CRC32C (``0`` when
        ``crc`` is ``None``).
    """
    key: str | None = None
    if end == start:
        return key, crc or 0
    if buf[start] != 0x0A:  # Example.features
        raise Unusual
    n = buf[start + 1]
    pos = start + 2
    if n >= 0x80:
        n, pos = _varint_tail(buf, pos, n)
    if pos + n != end:
        raise Unusual
    done = start  # with crc: the payload bytes before this offset are in it
    names = _NAMES
    while pos < end:
        if buf[pos] != 0x0A:  # Features.feature (a map entry)
            raise Unusual
        # The four lengths of each entry are read inline, not by a helper: this loop is the
        # TFRecord hot path, and a call per length costs ~15 % on 128 B - 16 KiB fields (measured
        # against the helper form; re-measured at 13-20 %, and a loop over the three nested
        # headers at 21-33 %). The repetition is deliberate.
        n = buf[pos + 1]
        if n < 0x80:
            pos = pos + 2
        else:  # 2- and 3-byte varints (lengths below 2 MiB) inline
            b = buf[pos + 2]
            if b < 0x80:
                n = (n & 0x7F) | b << 7
                pos = pos + 3
            else:
                c = buf[pos + 3]
                if c < 0x80:
                    n = (n & 0x7F) | (b & 0x7F) << 7 | c << 14
                    pos = pos + 4
                else:
                    n, pos = _read_varint(buf, pos + 1)
        entry_end = pos + n
        n = buf[pos + 1]  # entry.key, one length byte
        if entry_end > end or buf[pos] != 0x0A or n >= 0x80 or pos + n + 2 >= entry_end:
            raise Unusual
        pos += 2
        raw = buf[pos : pos + n]
        pos += n
        name_role = names.get(raw)
        if name_role is None:
            name_role = _name_role(raw)
        if buf[pos] != 0x12:  # entry.value (Feature)
            raise Unusual
        n = buf[pos + 1]
        if n < 0x80:
            pos = pos + 2
        else:  # 2- and 3-byte varints (lengths below 2 MiB) inline
            b = buf[pos + 2]
            if b < 0x80:
                n = (n & 0x7F) | b << 7
                pos = pos + 3
            else:
                c = buf[pos + 3]
                if c < 0x80:
                    n = (n & 0x7F) | (b & 0x7F) << 7 | c << 14
                    pos = pos + 4
                else:
                    n, pos = _read_varint(buf, pos + 1)
        if pos + n != entry_end or n < 3:
            raise Unusual
        kind = buf[pos]  # Feature.<kind> tag
        n = buf[pos + 1]
        if n < 0x80:
            pos = pos + 2
        else:  # 2- and 3-byte varints (lengths below 2 MiB) inline
            b = buf[pos + 2]
            if b < 0x80:
                n = (n & 0x7F) | b << 7
                pos = pos + 3
            else:
                c = buf[pos + 3]
                if c < 0x80:
                    n = (n & 0x7F) | (b & 0x7F) << 7 | c << 14
                    pos = pos + 4
                else:
                    n, pos = _read_varint(buf, pos + 1)
        if pos + n != entry_end or n < 2 or buf[pos] != 0x0A:  # <Kind>List.value
            raise Unusual
        n = buf[pos + 1]
        if n < 0x80:
            pos = pos + 2
        else:  # 2- and 3-byte varints (lengths below 2 MiB) inline
            b = buf[pos + 2]
            if b < 0x80:
                n = (n & 0x7F) | b << 7
                pos = pos + 3
            else:
                c = buf[pos + 3]
                if c < 0x80:
                    n = (n & 0x7F) | (b & 0x7F) << 7 | c << 14
                    pos = pos + 4
                else:
                    n, pos = _read_varint(buf, pos + 1)
        if pos + n != entry_end:
            raise Unusual
        name, role = name_role
        if kind == 0x0A:  # bytes_list of one value
            if role == _FIELD:
                value = buf[pos:entry_end]
                if crc is not None and n >= PIECE_MIN:  # checksum the copy, not the source
                    crc = crc32c_extend(crc32c_extend(crc, buf[done:pos]), value)
                    done = entry_end
                into[name] = value
            elif role == _KEY:
                key = buf[pos:entry_end].decode("utf-8")
        elif kind == 0x1A and role == _FIELD:  # int64_list, packed, of one value
            n = buf[pos]
            if n < 0x80:
                pos = pos + 1
            else:
                n, pos = _varint_tail(buf, pos + 1, n)
            if pos != entry_end:
                raise Unusual
            into[name] = _int_field(name, n - (1 << 64) if n > INT64_MAX else n)
        else:
            raise Unusual
        pos = entry_end
    if crc is None:
        return key, 0
    return key, crc32c_extend(crc, buf[done:end]) if done < end else crc


def decode_runtime(payload: bytes) -> tuple[str | None, dict[str, bytes]]:
    """Decode any Example with the protobuf runtime."""
    try:
        example = Example.FromString(payload)
    except message.DecodeError as exc:
        raise ProtoError(f"payload is not a valid tf.train.Example protobuf: {exc}") from exc
    key: str | None = None
    fields: dict[str, bytes] = {}
    for entry in example.features.feature:
        name: str = entry.key
        feature = entry.value
        kind = feature.WhichOneof("kind")
        if name.startswith("__"):
            if name == KEY_FEATURE:
                values = feature.bytes_list.value
                if kind != "bytes_list" or len(values) != 1:
                    raise ProtoError(
                        "the __key__ feature must be a bytes_list of exactly one value"
                    )
                try:
                    key = values[0].decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise ProtoError(f"the __key__ feature is not valid UTF-8 ({exc})") from exc
            continue  # other __reserved__ names are metadata, not fields
        if kind == "bytes_list":
            values = feature.bytes_list.value
            fields[name] = values[0] if len(values) == 1 else msgpack.packb(list(values))
        elif kind == "int64_list":
            ints = feature.int64_list.value
            if len(ints) == 1:
                fields[name] = _int_field(name, ints[0])
            else:
                n = len(ints)
                fields[name] = npy_bytes("<i8", struct.pack(f"<{n}q", *ints), n)
        elif kind == "float_list":
            floats = array("f", feature.float_list.value)
            fields[name] = npy_bytes("<f4", float_bytes(floats), len(floats))
        else:  # a Feature with no kind set holds no values
            fields[name] = msgpack.packb([])
    return key, fields


def decode_example(payload: bytes) -> tuple[str | None, dict[str, bytes]]:
    """Parse an Example and map its features back to ``(key, fields)``.

    ``key`` is ``None`` when the Example has no ``__key__`` feature (third-party data); the caller
    derives one. Fields come in wire order; a repeated feature name keeps its last value.

    Raises:
        ProtoError: The payload is not a valid Example, or ``__key__`` is not one UTF-8 value.
    """
    fields: dict[str, bytes] = {}
    try:
        key, _ = decode_fast(payload, 0, len(payload), None, fields)
    except FAST_PATH_MISSES:
        return decode_runtime(payload)
    return key, fields
