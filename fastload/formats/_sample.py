"""The sample model and the one place where fields are encoded to and decoded from bytes.

A **sample** is a mapping from field names to values plus a ``__key__`` (``str``). Following
WebDataset's conventions, a field's name is its extension (``jpg``, ``cls``, ``json``, ...); for a
dotted name such as ``seg.png`` the codec is chosen by the part after the last dot (``png``).
Names starting with ``__`` are metadata (``__key__``, ``__url__`` = the shard it came from,
``__index__`` = position in the shard) and are never stored as fields.

At rest every format stores each field as **bytes**; readers return those exact bytes, so any format
converts to any other losslessly. Writers accept bytes as they are, or a Python value that the
field's codec encodes (an ``int`` for ``cls``, a ``dict`` for ``json``, an array for ``npy``).

Pickle fields (``pyd``, ``pickle``) run code when decoded; :func:`decode_field` refuses them unless
``allow_pickle=True``.
"""

from __future__ import annotations

import io
import json
import math
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from fastload.errors import CorruptDataError, FormatError, InvalidArgumentError, UnsafeDataError

__all__ = [
    "Codec",
    "Sample",
    "codec_for",
    "decode_field",
    "decode_sample",
    "encode_field",
    "encode_sample",
    "register_codec",
    "sample_fields",
    "validate_field_name",
    "validate_sample_key",
]

#: A sample: ``{"__key__": str, field: bytes | value, ...}``.
Sample = dict[str, Any]

KEY = "__key__"


@dataclass(frozen=True)
class Codec:
    """How one extension's values become bytes and back.

    Attributes:
        encode: Value → bytes. Receives only non-bytes values (bytes are stored as they are).
        decode: Bytes → value.
        unsafe: Decoding may execute code (pickle); refused unless explicitly allowed.
    """

    encode: Callable[[Any], bytes]
    decode: Callable[[bytes], Any]
    unsafe: bool = False


def _encode_int(value: Any) -> bytes:
    if type(value) is int:  # the common case, without importing numpy
        return str(value).encode("ascii")
    import numpy as np  # numpy integers are accepted too; imported lazily (CLI start-up time)

    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"expected an int, got {type(value).__name__}")
    return str(int(value)).encode("ascii")


def _decode_int(data: bytes) -> int:
    return int(data.decode("ascii").strip())


def _encode_text(value: Any) -> bytes:
    if not isinstance(value, str):
        raise TypeError(f"expected a str, got {type(value).__name__}")
    return value.encode("utf-8")


def _encode_json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True).encode()


def _encode_npy(value: Any) -> bytes:
    import numpy as np

    buf = io.BytesIO()
    np.save(buf, np.asarray(value), allow_pickle=False)
    return buf.getvalue()


def _decode_npy(data: bytes) -> Any:
    """An array from ``.npy`` bytes, checked before anything is allocated: numpy allocates the
    array its header declares before reading the data, so a header that lies about its shape
    would allocate up to the whole address space for a few bytes of input."""
    import numpy as np
    from numpy.lib import format as npy_format

    stream = io.BytesIO(data)
    version = npy_format.read_magic(stream)
    if version == (1, 0):
        shape, _fortran, dtype = npy_format.read_array_header_1_0(stream)
    else:  # 2.0 and 3.0 have the same layout (3.0's UTF-8 names read as Latin-1 here)
        shape, _fortran, dtype = npy_format.read_array_header_2_0(stream)
    if dtype.hasobject:
        raise ValueError(
            f"object arrays (dtype {dtype}) are refused: they are stored as pickles, which can "
            "run code when loaded; store a numeric array instead"
        )
    need, have = math.prod(shape) * dtype.itemsize, len(data) - stream.tell()
    if not 0 <= need <= have:
        raise ValueError(
            f"the npy header declares an array of shape {shape} and dtype {dtype} "
            f"({need} bytes), but {have} bytes follow it: the field is damaged or truncated"
        )
    return np.load(io.BytesIO(data), allow_pickle=False)


def _encode_msgpack(value: Any) -> bytes:
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


def _decode_msgpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def _encode_pickle(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _decode_pickle(data: bytes) -> Any:
    return pickle.loads(data)  # only reached with allow_pickle=True


def _identity_bytes(value: Any) -> bytes:
    raise TypeError(f"expected bytes, got {type(value).__name__}")


def _passthrough(data: bytes) -> bytes:
    return data


_CODECS: dict[str, Codec] = {}


def register_codec(extensions: str | tuple[str, ...], codec: Codec) -> None:
    """Register ``codec`` for one or more extensions (lower case, without the dot)."""
    for ext in (extensions,) if isinstance(extensions, str) else extensions:
        _CODECS[ext.lower()] = codec


register_codec(("cls", "cls2", "index", "id", "label"), Codec(_encode_int, _decode_int))
register_codec(("txt", "text", "transcript"), Codec(_encode_text, lambda b: b.decode("utf-8")))
register_codec("json", Codec(_encode_json, lambda b: json.loads(b)))
register_codec("npy", Codec(_encode_npy, _decode_npy))
register_codec(("msgpack", "mp"), Codec(_encode_msgpack, _decode_msgpack))
register_codec(("pyd", "pickle"), Codec(_encode_pickle, _decode_pickle, unsafe=True))

#: Fields kept as bytes when decoding (images are decoded by the loader, not here).
_BYTES = Codec(_identity_bytes, _passthrough)


_EXTENSIONS: dict[str, str] = {}  # field name -> extension (a dataset has few field names)


def field_extension(field: str) -> str:
    """The part of a field name after its last dot, lower case (the whole name if no dot)."""
    ext = _EXTENSIONS.get(field)
    if ext is None:
        ext = field.rsplit(".", 1)[-1].lower()
        if len(_EXTENSIONS) < 4096:
            _EXTENSIONS[field] = ext
    return ext


def codec_for(field: str) -> Codec:
    """The codec for a field name (by the part after its last dot); bytes passthrough if none."""
    return _CODECS.get(field_extension(field), _BYTES)


def validate_sample_key(key: Any, *, url: str = "") -> str:
    """Check a sample key: a non-empty ``str`` without NUL, newline or ``.`` in its last path
    segment (WebDataset splits member names at the first dot of the basename).
    """
    if not isinstance(key, str) or not key:
        raise InvalidArgumentError(f"sample __key__ must be a non-empty str, got {key!r} ({url})")
    if "\x00" in key or "\n" in key or "\r" in key:
        raise InvalidArgumentError(f"sample key {key!r} contains NUL or a line break ({url})")
    if "." in key.rsplit("/", 1)[-1]:
        raise InvalidArgumentError(
            f"sample key {key!r} has a '.' in its last path segment; WebDataset splits member "
            f"names at that dot, so the key would not round-trip. Replace the dot, e.g. with '_'"
        )
    return key


_VALID_FIELDS: set[str] = set()  # names that passed validate_field_name (a few per dataset)


def validate_field_name(name: Any) -> str:
    """Check a field name: non-empty ``str``, no ``/``, NUL or whitespace, not starting with ``__``
    or ``.``."""
    if name in _VALID_FIELDS:
        return str(name)
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"field names must be non-empty str, got {name!r}")
    if name.startswith(("__", ".")) or name.endswith("."):
        raise InvalidArgumentError(
            f"field name {name!r} may not start with '__' or '.' or end with '.'"
        )
    if any(c in name for c in "/\x00") or any(c.isspace() for c in name):
        raise InvalidArgumentError(f"field name {name!r} may not contain '/', NUL or whitespace")
    if len(_VALID_FIELDS) < 4096:
        _VALID_FIELDS.add(name)
    return name


def sample_fields(sample: Mapping[str, Any]) -> list[str]:
    """The field names of a sample (metadata entries excluded), in insertion order."""
    return [k for k in sample if not k.startswith("__")]


def encode_field(field: str, value: Any) -> bytes:
    """Bytes of one field value (bytes-like values are returned as bytes, unchanged)."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    try:
        return codec_for(field).encode(value)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(
            f"cannot encode field {field!r} from a {type(value).__name__}: {exc}; pass bytes or a "
            f"value its codec accepts (see fastload.formats.register_codec)"
        ) from exc


def encode_sample(sample: Mapping[str, Any]) -> dict[str, bytes]:
    """Validate and encode a sample to ``{"__key__": str, field: bytes}`` (metadata dropped,
    ``__key__`` kept)."""
    if KEY not in sample:
        raise InvalidArgumentError(
            f"sample has no '__key__' (fields: {sample_fields(sample)}); every sample needs a "
            "unique key"
        )
    key = validate_sample_key(sample[KEY])
    out: dict[str, Any] = {KEY: key}
    for name in sample_fields(sample):
        validate_field_name(name)
        out[name] = encode_field(name, sample[name])
    return out


def decode_field(
    field: str,
    data: bytes,
    *,
    allow_pickle: bool = False,
    url: str = "",
    key: str | None = None,
    codec: Codec | None = None,
) -> Any:
    """Decode one field's bytes by its extension (``codec``: the one :func:`codec_for` gives,
    when the caller has it already).

    Raises:
        UnsafeDataError: The field is a pickle and ``allow_pickle`` is False.
        CorruptDataError: The bytes are not valid for the extension.
    """
    codec = codec_for(field) if codec is None else codec
    if codec.unsafe and not allow_pickle:
        raise UnsafeDataError(
            f"field {field!r} is a pickle, and unpickling data from a shard can run arbitrary "
            "code; pass allow_pickle=True only if you trust the data's origin",
            url=url,
            key=key,
        )
    try:
        return codec.decode(data)
    except FormatError:
        raise
    except Exception as exc:
        raise CorruptDataError(
            f"field {field!r} cannot be decoded ({type(exc).__name__}: {exc})", url=url, key=key
        ) from exc


def decode_sample(
    sample: Mapping[str, Any],
    *,
    allow_pickle: bool = False,
    fields: Mapping[str, Callable[[bytes], Any]] | None = None,
) -> Sample:
    """Decode every field of a sample read from a shard; metadata entries are copied as they are.

    Args:
        sample: As returned by a shard reader (fields are bytes).
        allow_pickle: Permit ``pyd``/``pickle`` fields.
        fields: Extra decoders by extension that take precedence (e.g. image decoders).
    """
    url = str(sample.get("__url__", ""))
    key = sample.get(KEY)
    out: Sample = {}
    for name, value in sample.items():
        if name.startswith("__") or not isinstance(value, (bytes, bytearray, memoryview)):
            out[name] = value
            continue
        ext = field_extension(name)
        if fields is not None and ext in fields:
            try:
                out[name] = fields[ext](bytes(value))
            except FormatError:
                raise
            except Exception as exc:
                raise CorruptDataError(
                    f"field {name!r} cannot be decoded ({type(exc).__name__}: {exc})",
                    url=url,
                    key=key,
                ) from exc
        elif (codec := codec_for(name)) is _BYTES and not isinstance(value, bytearray):
            out[name] = value  # passed through as given (a view stays a view: no copy)
        else:
            out[name] = decode_field(
                name, bytes(value), allow_pickle=allow_pickle, url=url, key=key, codec=codec
            )
    return out
