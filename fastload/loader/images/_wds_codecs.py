"""Decoders for the field extensions of the ``webdataset`` ecosystem, written for fastload.

Each gives, for the same bytes, the value ``webdataset.autodecode``'s decoder of the extension
gives (tested against the library in ``tests/loader/test_wds_codecs.py``), without importing
``webdataset``:

========  ========================================================================================
``jsn``   ``json.loads``
``inx``   ``int`` of the ASCII digits (``int(data)``: surrounding whitespace, a sign and ``_``
          separators allowed)
``msg``   ``msgpack.unpackb`` with msgpack's defaults (str keys and values, map keys str or bytes)
``npz``   ``dict`` name -> value of ``numpy.load(..., allow_pickle=False)`` (object arrays refused
          by NumPy; bytes that are not a zip archive refused)
``cbor``  ``cbor.loads`` (the ``cbor`` package, optional)
``ten``   list of arrays in the *tenbin* layout below (``tb`` is the same)
``pkl``   ``pickle.loads`` / ``torch.load(..., map_location="cpu")``; only reached with
``pth``   ``allow_pickle=True``
``*.gz``  :func:`gunzip`, then the decoder of the rest of the name
========  ========================================================================================

**Tenbin** (webdataset's ``.ten``, also written by tensorcom): a sequence of chunks, each

* 8 bytes: the magic ``b"~TenBin~"``;
* 8 bytes: the chunk's length ``n`` in bytes, a signed 64-bit integer;
* ``n`` bytes of payload, then zero bytes up to the next multiple of 64 (of ``n``, so a chunk
  takes ``16 + ceil(n / 64) * 64`` bytes and every payload starts 8-byte aligned).

Chunks come in pairs, one per array: a header chunk, then a data chunk. The header chunk holds
64-bit integers: the dtype code (up to 8 ASCII characters, NUL-padded: ``f2 f4 f8 i1 i2 i4 i8
u1 u2 u4 u8``), an *info* string encoded the same way (ignored here, as by webdataset's decoder),
the number of dimensions ``d``, then the ``d`` dimensions. The data chunk holds the array's
elements in C order, ``prod(shape) * itemsize`` bytes. Integers and elements are in the byte
order of the machine that wrote them, which is little-endian on every platform webdataset runs
on (x86-64, ARM64); they are read as little-endian here.

Where this decoder and webdataset's differ, webdataset's fails or loses data: a tenbin ``u4``
array is ``uint32`` here (webdataset 1.0's table misspells it, so it can neither write nor read
one), a 0-d array is decoded (webdataset raises ``TypeError``), and a header chunk without its
data chunk, a chunk cut short, or a data chunk shorter than its header's shape is a ``ValueError``
naming the byte offset (webdataset drops such a last array, or fails in NumPy). The layout has
no array count, so a buffer cut exactly between two arrays' chunks reads as the arrays before the
cut, by both. Arrays are writable and own their memory (webdataset's are read-only views of a copy
of the chunk).
"""

from __future__ import annotations

import gzip
import io
import json
import math
import pickle
import struct
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

__all__ = [
    "TENBIN_DTYPES",
    "TENBIN_MAGIC",
    "WDS_DECODERS",
    "decode_cbor",
    "decode_inx",
    "decode_jsn",
    "decode_msg",
    "decode_npz",
    "decode_pickle",
    "decode_pth",
    "decode_tenbin",
    "gunzip",
]

#: The first 8 bytes of every tenbin chunk.
TENBIN_MAGIC = b"~TenBin~"
#: Chunk payloads are padded with zero bytes to a multiple of this.
_TENBIN_ALIGN = 64
#: The 16-byte chunk head: magic and payload length.
_CHUNK_HEAD = struct.Struct("<8sq")
#: The fixed part of a header chunk: dtype code, info string, number of dimensions.
_ARRAY_HEAD = struct.Struct("<8s8sq")
#: Tenbin dtype codes (NUL-stripped) -> NumPy dtypes.
TENBIN_DTYPES: dict[bytes, np.dtype[Any]] = {
    code.encode("ascii"): np.dtype("<" + code)
    for code in ("f2", "f4", "f8", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8")
}


def _tenbin_chunks(data: bytes) -> list[tuple[int, int]]:
    """(payload offset, payload length) of every chunk of ``data``, checked to lie inside it."""
    spans: list[tuple[int, int]] = []
    pos, total = 0, len(data)
    while pos < total:
        if total - pos < _CHUNK_HEAD.size:
            raise ValueError(
                f"tenbin: {total - pos} bytes at byte {pos} are too few for a chunk head "
                f"({_CHUNK_HEAD.size}): the field is truncated"
            )
        magic, length = _CHUNK_HEAD.unpack_from(data, pos)
        if magic != TENBIN_MAGIC:
            raise ValueError(
                f"tenbin: no chunk magic {TENBIN_MAGIC!r} at byte {pos} (found {magic!r})"
            )
        start = pos + _CHUNK_HEAD.size
        if not 0 <= length <= total - start:
            raise ValueError(
                f"tenbin: the chunk at byte {pos} declares {length} bytes, but {total - start} "
                "follow its head: the field is damaged or truncated"
            )
        spans.append((start, length))
        pos = start + -(-length // _TENBIN_ALIGN) * _TENBIN_ALIGN
    return spans


def _tenbin_array(data: bytes, header: tuple[int, int], body: tuple[int, int]) -> np.ndarray:
    (h_start, h_len), (d_start, d_len) = header, body
    if h_len < _ARRAY_HEAD.size or h_len % 8:
        raise ValueError(
            f"tenbin: the array header at byte {h_start} is {h_len} bytes; it must be a multiple "
            f"of 8 of at least {_ARRAY_HEAD.size}"
        )
    code, _info, ndim = _ARRAY_HEAD.unpack_from(data, h_start)
    dtype = TENBIN_DTYPES.get(code.strip(b"\0"))
    if dtype is None:
        known = " ".join(c.decode() for c in TENBIN_DTYPES)
        raise ValueError(
            f"tenbin: unsupported dtype code {code!r} in the header at byte {h_start} "
            f"(known: {known})"
        )
    if not 0 <= ndim <= (h_len - _ARRAY_HEAD.size) // 8:
        raise ValueError(
            f"tenbin: the header at byte {h_start} declares {ndim} dimensions in {h_len} bytes"
        )
    shape = struct.unpack_from(f"<{ndim}q", data, h_start + _ARRAY_HEAD.size)
    need = math.prod(shape) * dtype.itemsize
    # NumPy refuses a shape whose nonzero dimensions multiply past its index range, even empty.
    huge = math.prod(d for d in shape if d) * dtype.itemsize > np.iinfo(np.intp).max
    if min(shape, default=0) < 0 or need > d_len or huge:
        raise ValueError(
            f"tenbin: the header at byte {h_start} declares shape {shape} of {dtype} "
            f"({need} bytes), but its data chunk at byte {d_start} holds {d_len}"
        )
    flat = np.frombuffer(data, dtype, math.prod(shape), d_start) if need else np.empty(0, dtype)
    return flat.reshape(shape).copy()


def decode_tenbin(data: bytes) -> list[np.ndarray]:
    """The arrays of a tenbin buffer (``.ten``/``.tb``; layout in the module docstring), in order.

    Raises:
        ValueError: The bytes are not a whole tenbin buffer; the message names the byte offset.
    """
    spans = _tenbin_chunks(data)
    if len(spans) % 2:
        raise ValueError(
            f"tenbin: the array header at byte {spans[-1][0]} has no data chunk after it: the "
            "field is truncated"
        )
    return [_tenbin_array(data, h, d) for h, d in zip(spans[::2], spans[1::2])]


def decode_npz(data: bytes) -> dict[str, Any]:
    """``{name: array}`` of an ``.npz`` archive (NumPy's ``allow_pickle=False``: object arrays
    raise ``ValueError``); a member that is not an ``.npy`` file is its bytes, as NumPy gives it.

    Raises:
        ValueError: The bytes are not a zip archive, or a member is an object array.
    """
    loaded = np.load(io.BytesIO(data), allow_pickle=False)
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise ValueError(
            f"not an npz archive (a zip of .npy members): the bytes start with {data[:6]!r}"
        )
    with loaded:
        return {name: loaded[name] for name in loaded.files}


def decode_msg(data: bytes) -> Any:
    """The unpacked msgpack value, with msgpack's defaults (webdataset's ``msg``; fastload's own
    ``mp``/``msgpack`` codec also accepts maps with non-string keys)."""
    return msgpack.unpackb(data)


def decode_jsn(data: bytes) -> Any:
    """The parsed JSON value (webdataset's spelling of ``json``)."""
    return json.loads(data)


def decode_inx(data: bytes) -> int:
    """The integer (webdataset's ``inx``)."""
    return int(data)


def decode_cbor(data: bytes) -> Any:
    """The CBOR value, by the optional ``cbor`` package (the one webdataset uses)."""
    import cbor  # the Decoder checks first that it is installed, to say how to install it

    return cbor.loads(data)


def decode_pickle(data: bytes) -> Any:
    """Unpickle ``data`` (``pkl``): runs code; only with ``allow_pickle=True``."""
    return pickle.loads(data)


def decode_pth(data: bytes) -> Any:
    """``torch.load`` of ``data`` onto the CPU, pickles allowed (``pth``): runs code; only with
    ``allow_pickle=True``."""
    import torch

    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def gunzip(data: bytes) -> bytes:
    """The decompressed bytes of a gzip stream (several members are concatenated).

    Raises:
        gzip.BadGzipFile, EOFError, zlib.error: ``data`` is not a whole gzip stream.
    """
    return gzip.decompress(data)


#: The decoders of the webdataset ecosystem's extensions that are safe to run on any data.
WDS_DECODERS: dict[str, Callable[[bytes], Any]] = {
    "ten": decode_tenbin,
    "tb": decode_tenbin,
    "msg": decode_msg,
    "npz": decode_npz,
    "cbor": decode_cbor,
    "jsn": decode_jsn,
    "inx": decode_inx,
}
