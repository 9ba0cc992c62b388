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

The mapping between sample fields and Features is the format's spec; see ``README.md``. This module
holds the messages, the mapping and the encoder; :mod:`._decode` holds the decoders, which reverse
exactly what :func:`encode_example` writes.
"""

from __future__ import annotations

import re
import struct
import sys
from array import array
from collections.abc import Mapping
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from fastload.errors import CorruptDataError
from fastload.formats.manifest import field_type

__all__ = [
    "BYTES",
    "FLOAT",
    "INT64",
    "INT64_MAX",
    "KEY_FEATURE",
    "PIECE_MIN",
    "UINT64_MASK",
    "Example",
    "ProtoError",
    "encode_example",
    "float_bytes",
    "npy_bytes",
]

#: The Feature that holds the sample key.
KEY_FEATURE = "__key__"

#: Feature kinds, numbered as the fields of ``Feature.kind``.
BYTES, FLOAT, INT64 = 1, 2, 3

#: The int64 range; :data:`UINT64_MASK` maps an int64 to its two's-complement varint value.
_INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
_BIG_ENDIAN_HOST = sys.byteorder == "big"


def _floats(raw: bytes) -> array[float]:
    """float32 values from little-endian bytes."""
    values = array("f", raw)
    if _BIG_ENDIAN_HOST:  # pragma: no cover - no big-endian CI
        values.byteswap()
    return values


def float_bytes(values: array[float]) -> bytes:
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
    return value if _INT64_MIN <= value <= INT64_MAX else None


# ---- encoding -------------------------------------------------------------------------------------

UINT64_MASK = (1 << 64) - 1
_SMALL_VARINTS = [bytes((i,)) for i in range(128)]
#: Values at least this long are returned as their own piece instead of being copied.
PIECE_MIN = 4096


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
                out.append((name.encode("utf-8"), INT64, _varint(value & UINT64_MASK)))
                continue
        elif kind == "npy":
            npy = _canonical_npy(data)
            if npy is not None:
                descr, n, start = npy
                raw = data[start:]
                if descr == "<i8":
                    ints = struct.unpack(f"<{n}q", raw)
                    packed = b"".join(_varint(v & UINT64_MASK) for v in ints)
                    out.append((name.encode("utf-8"), INT64, packed))
                    continue
                # Readers (protobuf, TensorFlow) turn float32 into double and back. That is exact
                # except for signalling-NaN payloads, which the CPU may quiet; arrays holding one
                # stay bytes so that they round-trip.
                if float_bytes(array("f", _floats(raw).tolist())) == raw:
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
            if len(data) >= PIECE_MIN:
                pieces.append(bytes(buf))
                pieces.append(data)
                buf = bytearray()
            else:
                buf += data
    if buf:
        pieces.append(bytes(buf))
    return pieces, 1 + _varint_len(features_len) + features_len
