"""``tf.train.Example`` payloads: the protobuf messages and the field ↔ Feature mapping.

The messages are TensorFlow's (``tensorflow/core/example/{example,feature}.proto``, proto3)::

    message Example   { Features features = 1; }
    message Features  { map<string, Feature> feature = 1; }
    message Feature   { oneof kind { BytesList bytes_list = 1; FloatList float_list = 2;
                                     Int64List int64_list = 3; } }
    message BytesList { repeated bytes value = 1; }
    message FloatList { repeated float value = 1 [packed = true]; }
    message Int64List { repeated int64 value = 1 [packed = true]; }

They are built at import time from a ``FileDescriptorProto`` in a private descriptor pool and parsed
and serialized by the ``protobuf`` runtime (its upb C backend): no ``protoc``, no generated module,
no TensorFlow. One deliberate difference: ``Features.feature`` is declared as a ``repeated
FeatureEntry {string key = 1; Feature value = 2;}`` instead of a ``map``. On the wire a map *is*
exactly that repeated message, so the bytes are identical, but the repeated form keeps the entries
in the order they were written (protobuf maps are unordered), so a sample's fields come back in
their original order and the serialization is deterministic. As with a map, a repeated feature name
keeps its last entry.

The mapping between sample fields and Features is the format's spec; see ``README.md``.
"""

from __future__ import annotations

import mmap
import re
import struct
import sys
from array import array
from collections.abc import Mapping
from typing import Any

import msgpack
from google.protobuf import descriptor_pb2, descriptor_pool, message, message_factory

from fastload.errors import CorruptDataError
from fastload.formats.manifest import field_type
from fastload.formats.tfrecord._framing import crc32c_extend

__all__ = [
    "BYTES",
    "FAST_PATH_MISSES",
    "FLOAT",
    "INT64",
    "KEY_FEATURE",
    "Buffer",
    "Example",
    "ProtoError",
    "Unusual",
    "decode_example",
    "decode_fast",
    "decode_runtime",
    "encode_example",
    "npy_bytes",
]

#: The Feature that holds the sample key.
KEY_FEATURE = "__key__"

#: Feature kinds, numbered as the fields of ``Feature.kind``.
BYTES, FLOAT, INT64 = 1, 2, 3

_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
_BIG_ENDIAN_HOST = sys.byteorder == "big"


def _floats(raw: bytes) -> array[float]:
    """float32 values from little-endian bytes."""
    values = array("f", raw)
    if _BIG_ENDIAN_HOST:  # pragma: no cover - no big-endian CI
        values.byteswap()
    return values


def _float_bytes(values: array[float]) -> bytes:
    """Little-endian bytes of float32 values."""
    if _BIG_ENDIAN_HOST:  # pragma: no cover - no big-endian CI
        values = array("f", values)
        values.byteswap()
    return values.tobytes()


class ProtoError(CorruptDataError):
    """The payload is not a valid ``tf.train.Example`` (or its ``__key__`` is unusable).

    A :class:`~fastload.errors.CorruptDataError`, so that :func:`decode_example` raises only
    fastload's format errors; the reader adds the shard, record and offset to the message.
    """


def _build_example_class() -> Any:
    f = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(
        name="fastload/formats/tfrecord/example.proto", package="tensorflow", syntax="proto3"
    )

    def add(name: str, fields: list[tuple[str, int, int, int, str]]) -> Any:
        msg = proto.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            field = msg.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                field.type_name = type_name
        return msg

    rep, opt = f.LABEL_REPEATED, f.LABEL_OPTIONAL
    add("BytesList", [("value", 1, f.TYPE_BYTES, rep, "")])
    add("FloatList", [("value", 1, f.TYPE_FLOAT, rep, "")]).field[0].options.packed = True
    add("Int64List", [("value", 1, f.TYPE_INT64, rep, "")]).field[0].options.packed = True
    feature = add(
        "Feature",
        [
            ("bytes_list", BYTES, f.TYPE_MESSAGE, opt, ".tensorflow.BytesList"),
            ("float_list", FLOAT, f.TYPE_MESSAGE, opt, ".tensorflow.FloatList"),
            ("int64_list", INT64, f.TYPE_MESSAGE, opt, ".tensorflow.Int64List"),
        ],
    )
    feature.oneof_decl.add(name="kind")
    for field in feature.field:
        field.oneof_index = 0
    add(
        "FeatureEntry",
        [
            ("key", 1, f.TYPE_STRING, opt, ""),
            ("value", 2, f.TYPE_MESSAGE, opt, ".tensorflow.Feature"),
        ],
    )
    add("Features", [("feature", 1, f.TYPE_MESSAGE, rep, ".tensorflow.FeatureEntry")])
    add("Example", [("features", 1, f.TYPE_MESSAGE, opt, ".tensorflow.Features")])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.Example"))


#: The ``tf.train.Example`` message class of the protobuf runtime (wire-compatible;
#: ``features.feature`` is a list of ``FeatureEntry(key=..., value=Feature(...))`` in wire order).
Example = _build_example_class()


# ---- npy for numeric lists ----------------------------------------------------------------------

_NPY_MAGIC = b"\x93NUMPY\x01\x00"
_NPY_HEADER_RE = re.compile(
    rb"\{'descr': '(<f4|<i8)', 'fortran_order': False, 'shape': \((\d+),\), \} *\n"
)
_U16 = struct.Struct("<H")


def _npy_header(descr: str, n: int) -> bytes:
    """The header ``numpy.save`` (numpy >= 1.23, format 1.0) writes for a 1-D array of ``n``."""
    text = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': ({n},), }}"
    text += " " * (21 - len(repr(n)))  # numpy leaves room for the shape to grow in place
    hlen = len(text) + 1
    padlen = 64 - ((len(_NPY_MAGIC) + 2 + hlen) % 64)
    return _NPY_MAGIC + _U16.pack(hlen + padlen) + text.encode("latin1") + b" " * padlen + b"\n"


def npy_bytes(descr: str, data: bytes, n: int) -> bytes:
    """``.npy`` bytes of a 1-D array of ``n`` items whose raw little-endian bytes are ``data``."""
    return _npy_header(descr, n) + data


def _canonical_npy(data: bytes) -> tuple[str, int, int] | None:
    """``(descr, n, header_length)`` if ``data`` is exactly what :func:`npy_bytes` writes for a
    1-D ``<f4`` or ``<i8`` array, else ``None``."""
    if len(data) < 10 or not data.startswith(_NPY_MAGIC):
        return None
    (hlen,) = _U16.unpack_from(data, 8)
    match = _NPY_HEADER_RE.fullmatch(data, 10, 10 + hlen)
    if match is None:
        return None
    descr, n = match.group(1).decode("ascii"), int(match.group(2))
    header = _npy_header(descr, n)
    itemsize = 4 if descr == "<f4" else 8
    if not data.startswith(header) or len(data) - len(header) != itemsize * n:
        return None
    return descr, n, len(header)


# ---- the field <-> Feature mapping ---------------------------------------------------------------

_CANONICAL_INT = re.compile(rb"0|-?[1-9][0-9]{0,18}")


def _canonical_int(data: bytes) -> int | None:
    """The int64 whose canonical decimal text is exactly ``data``, else ``None``."""
    if len(data) > 20 or _CANONICAL_INT.fullmatch(data) is None:
        return None
    value = int(data)
    return value if _I64_MIN <= value <= _I64_MAX else None


# ---- encoding -------------------------------------------------------------------------------------

_U64 = (1 << 64) - 1
_SMALL_VARINTS = [bytes((i,)) for i in range(128)]
#: Values at least this long are returned as their own piece instead of being copied.
_PIECE_MIN = 4096


def _varint(n: int) -> bytes:
    """Protobuf base-128 varint of an int in ``[0, 2**64)``."""
    if n < 128:
        return _SMALL_VARINTS[n]
    out = bytearray()
    while n >= 128:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _varint_len(n: int) -> int:
    return 1 if n < 128 else (n.bit_length() + 6) // 7


def _to_features(key: str, fields: Mapping[str, bytes]) -> list[tuple[bytes, int, bytes]]:
    """The mapping rules: ``(name, kind, data)`` per feature, ``__key__`` first.

    ``data`` is the one value of a :data:`BYTES` list, the packed varints of an :data:`INT64`
    list, or the packed little-endian float32s of a :data:`FLOAT` list.
    """
    out = [(KEY_FEATURE.encode(), BYTES, key.encode("utf-8"))]
    for name, data in fields.items():
        kind = field_type(name)
        if kind == "int":
            value = _canonical_int(data)
            if value is not None:
                out.append((name.encode("utf-8"), INT64, _varint(value & _U64)))
                continue
        elif kind == "npy":
            npy = _canonical_npy(data)
            if npy is not None:
                descr, n, start = npy
                raw = data[start:]
                if descr == "<i8":
                    ints = struct.unpack(f"<{n}q", raw)
                    packed = b"".join(_varint(v & _U64) for v in ints)
                    out.append((name.encode("utf-8"), INT64, packed))
                    continue
                # Readers (protobuf, TensorFlow) turn float32 into double and back. That is exact
                # except for signalling-NaN payloads, which the CPU may quiet; arrays holding one
                # stay bytes so that they round-trip.
                if _float_bytes(array("f", _floats(raw).tolist())) == raw:
                    out.append((name.encode("utf-8"), FLOAT, raw))
                    continue
        out.append((name.encode("utf-8"), BYTES, data))
    return out


def encode_example(key: str, fields: Mapping[str, bytes]) -> tuple[list[bytes], int]:
    """Serialize a sample as an Example (see the README for the mapping rules).

    The encoder is hand-written so that large values are not copied: it returns the serialized
    bytes as pieces (each large value is its own piece). The bytes equal what the protobuf runtime
    serializes for the same features in the same order (the tests check this).

    Args:
        key: The sample key; stored as the one-value ``bytes_list`` feature ``__key__``.
        fields: Field name → bytes, in the order the features are written. Every mapping applied
            here is reversed exactly by :func:`decode_example`.

    Returns:
        ``(pieces, length)``: the payload as a list of ``bytes``, and its total length.
    """
    features = _to_features(key, fields)
    sizes = []
    features_len = 0
    for name, kind, data in features:
        n = len(data)
        # Feature.<kind> = <Kind>List{ value = 1 }: one bytes value, or the packed scalars
        # (an empty packed list is omitted, as protobuf does).
        list_len = (1 + _varint_len(n) + n) if (kind == BYTES or n) else 0
        feature_len = 1 + _varint_len(list_len) + list_len
        entry_len = 2 + _varint_len(len(name)) + len(name) + _varint_len(feature_len) + feature_len
        features_len += 1 + _varint_len(entry_len) + entry_len
        sizes.append((list_len, feature_len, entry_len))

    pieces: list[bytes] = []
    buf = bytearray(b"\x0a")  # Example.features
    buf += _varint(features_len)
    for (name, kind, data), (list_len, feature_len, entry_len) in zip(features, sizes):
        buf += b"\x0a"  # Features.feature entry
        buf += _varint(entry_len)
        buf += b"\x0a"  # entry.key
        buf += _varint(len(name))
        buf += name
        buf += b"\x12"  # entry.value (Feature)
        buf += _varint(feature_len)
        buf += _SMALL_VARINTS[(kind << 3) | 2]  # Feature.bytes_list / float_list / int64_list
        buf += _varint(list_len)
        if list_len:
            buf += b"\x0a"  # <Kind>List.value
            buf += _varint(len(data))
            if len(data) >= _PIECE_MIN:
                pieces.append(bytes(buf))
                pieces.append(data)
                buf = bytearray()
            else:
                buf += data
    if buf:
        pieces.append(bytes(buf))
    return pieces, 1 + _varint_len(features_len) + features_len


# ---- decoding -------------------------------------------------------------------------------------

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
            return value & _U64, pos
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
                if crc is not None and n >= _PIECE_MIN:  # checksum the copy, not the source
                    crc = crc32c_extend(crc32c_extend(crc, buf[done:pos]), value)
                    done = entry_end
                into[name] = value
            elif role == _KEY:
                key = buf[pos:entry_end].decode("utf-8")
        elif kind == 0x1A and role == _FIELD:  # int64_list, packed, of one value
            n = buf[pos]
            if n < 0x80:
                pos = pos + 1
            else:  # 2- and 3-byte varints (lengths below 2 MiB) inline
                b = buf[pos + 1]
                if b < 0x80:
                    n = (n & 0x7F) | b << 7
                    pos = pos + 2
                else:
                    c = buf[pos + 2]
                    if c < 0x80:
                        n = (n & 0x7F) | (b & 0x7F) << 7 | c << 14
                        pos = pos + 3
                    else:
                        n, pos = _read_varint(buf, pos)
            if pos != entry_end:
                raise Unusual
            into[name] = _int_field(name, n - (1 << 64) if n > _I64_MAX else n)
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
            fields[name] = npy_bytes("<f4", _float_bytes(floats), len(floats))
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
