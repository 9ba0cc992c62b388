"""fastload's decoders of the webdataset ecosystem's extensions give what webdataset's give.

Every comparison encodes with the real ``webdataset`` library (its ``tenbin`` and ``TarWriter``
encoders) and decodes with both ``webdataset.autodecode`` and fastload's ``Decoder``; and fastload
decodes every such extension with ``webdataset`` unimportable, in a fresh process.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from webdataset import autodecode, tenbin

from fastload.errors import CorruptDataError
from fastload.loader.decode import Decoder
from fastload.loader.images._wds_codecs import (
    TENBIN_DTYPES,
    decode_cbor,
    decode_npz,
    decode_tenbin,
    gunzip,
)

REPO = Path(__file__).resolve().parents[2]

#: The dtypes webdataset's tenbin writes (its table misspells uint32, so not that one).
WDS_TENBIN_DTYPES = ["float16", "float32", "float64", "int8", "int16", "int32", "int64",
                     "uint8", "uint16", "uint64"]  # fmt: skip


def _same(ours: Any, ref: Any) -> None:
    """``ours`` equals ``ref`` exactly: types, dtypes, shapes, bytes (NaNs included)."""
    assert type(ours) is type(ref), (type(ours), type(ref))
    if isinstance(ref, np.ndarray):
        assert (ours.dtype, ours.shape) == (ref.dtype, ref.shape)
        assert ours.tobytes() == ref.tobytes()
    elif isinstance(ref, dict):
        assert list(ours) == list(ref)
        for k in ref:
            _same(ours[k], ref[k])
    elif isinstance(ref, list | tuple):
        assert len(ours) == len(ref)
        for a, b in zip(ours, ref):
            _same(a, b)
    else:
        assert ours == ref


def _reference(sample: dict[str, Any]) -> dict[str, Any]:
    """webdataset's decoding of ``sample`` (``WebDataset(...).decode()``'s default handlers:
    ``gzfilter`` then ``basichandlers``)."""
    return autodecode.Decoder([])(dict(sample))


# ---- tenbin ---------------------------------------------------------------------------------

_ARRAYS = st.lists(
    hnp.arrays(
        dtype=st.sampled_from(WDS_TENBIN_DTYPES),
        shape=hnp.array_shapes(min_dims=1, max_dims=5, min_side=0, max_side=6),
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=150, deadline=None)
@given(arrays=_ARRAYS, info=st.sampled_from(["", "x", "info1234"]))
def test_tenbin_decodes_as_webdataset(arrays: list[np.ndarray], info: str) -> None:
    data = bytes(tenbin.encode_buffer(arrays, infos=[info] * len(arrays)))
    ours = decode_tenbin(data)
    _same(ours, autodecode.decoders["ten"](data))
    _same(ours, [np.ascontiguousarray(a) for a in arrays])
    assert all(a.flags.writeable and a.flags.owndata for a in ours)


@pytest.mark.parametrize("dtype", WDS_TENBIN_DTYPES)
@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (2, 3), (3, 0, 2), (2, 3, 4), (1, 1, 1, 5)])
def test_tenbin_every_dtype_and_shape(dtype: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(len(shape))
    arr = (rng.random(shape) * 100).astype(dtype)
    pair = [arr, -arr if np.dtype(dtype).kind != "u" else arr[::-1]]
    data = bytes(tenbin.encode_buffer(pair))
    sample = {"__key__": "k", "ten": data, "tb": data}
    ours, ref = Decoder()(sample), _reference(sample)
    for ext in ("ten", "tb"):
        _same(ours[ext], ref[ext])


def test_tenbin_reads_what_webdataset_cannot() -> None:
    """uint32 (``u4``: webdataset's table has ``unit32``) and 0-d arrays (webdataset's decoder
    raises ``TypeError``) decode here."""
    arr = np.arange(6, dtype=np.int32).reshape(2, 3)
    data = bytearray(tenbin.encode_buffer([arr]))
    assert data[16:18] == b"i4"  # the header chunk's payload starts with the dtype code
    data[16:18] = b"u4"
    with pytest.raises(TypeError):
        autodecode.decoders["ten"](bytes(data))
    (u4,) = decode_tenbin(bytes(data))
    _same(u4, arr.astype(np.uint32))

    scalar = np.array(2.5, np.float64)
    data = bytes(tenbin.encode_buffer([scalar]))
    with pytest.raises(TypeError):
        autodecode.decoders["ten"](data)
    _same(decode_tenbin(data), [scalar])
    assert set(TENBIN_DTYPES) == {b"f2", b"f4", b"f8", b"i1", b"i2", b"i4", b"i8", b"u1",
                                  b"u2", b"u4", b"u8"}  # fmt: skip


def test_damaged_tenbin_is_refused_with_the_offset() -> None:
    arrays = [np.arange(10, dtype=np.float32), np.ones((2, 2), np.int64)]
    data = bytes(tenbin.encode_buffer(arrays))
    assert decode_tenbin(b"") == [] == autodecode.decoders["ten"](b"")
    with pytest.raises(ValueError, match=r"no chunk magic .* at byte 0"):
        decode_tenbin(b"X" + data[1:])
    # Cut anywhere: an error, or the arrays whose chunks are whole (the format has no count, so
    # a cut between two arrays is a valid buffer of the first; a cut in the zero padding after
    # the last payload loses nothing) - never a damaged array.
    end = [
        len(tenbin.encode_buffer(arrays[: i + 1])) - (-a.nbytes % 64) for i, a in enumerate(arrays)
    ]
    first = len(tenbin.encode_buffer(arrays[:1]))
    for cut in range(1, len(data)):
        if end[0] <= cut <= first or cut >= end[1]:
            _same(decode_tenbin(data[:cut]), arrays[: 1 if cut <= first else 2])
        else:
            with pytest.raises(ValueError, match="tenbin: "):
                decode_tenbin(data[:cut])
    header_only = bytes(tenbin.encode_buffer(arrays[:1]))[:80]
    with pytest.raises(ValueError, match="has no data chunk"):
        decode_tenbin(header_only)
    bad = bytearray(data)
    bad[16:18] = b"c8"
    with pytest.raises(ValueError, match=r"unsupported dtype code b'c8\\x00"):
        decode_tenbin(bytes(bad))
    with pytest.raises(CorruptDataError, match=r"'s\.ten'") as info:
        Decoder()({"__key__": "k1", "__url__": "file:///d/a.tar", "s.ten": data[:100]})
    assert (info.value.key, info.value.url) == ("k1", "file:///d/a.tar")


@settings(max_examples=300, deadline=None)
@given(arrays=_ARRAYS, flips=st.lists(st.tuples(st.integers(0), st.integers(1, 255)), max_size=3))
def test_damaged_tenbin_is_a_value_error_or_arrays(
    arrays: list[np.ndarray], flips: list[tuple[int, int]]
) -> None:
    """Flipped bytes (lengths, dimensions, dtype codes included) give arrays or a ValueError,
    never another exception or an allocation beyond the field's size."""
    data = bytearray(tenbin.encode_buffer(arrays))
    for pos, xor in flips:
        data[pos % len(data)] ^= xor
    try:
        got = decode_tenbin(bytes(data))
    except ValueError as exc:
        assert str(exc).startswith("tenbin: ")  # noqa: PT017 - the message, for any damage
    else:
        assert sum(a.nbytes for a in got) <= len(data)


# ---- npz, msg, jsn, inx, gz ------------------------------------------------------------------


def _npz(compressed: bool, **arrays: Any) -> bytes:
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, **arrays)
    return buf.getvalue()


@pytest.mark.parametrize("compressed", [False, True])
def test_npz_decodes_as_webdataset(compressed: bool) -> None:
    data = _npz(
        compressed,
        x=np.arange(12, dtype=np.float32).reshape(3, 4),
        y=np.array([1, -2], np.int8),
        empty=np.zeros((0, 2), np.uint16),
        scalar=np.array(3.5),
        text=np.array(["ab", "c"]),
    )
    ours = decode_npz(data)
    _same(ours, autodecode.decoders["npz"](data))
    assert list(ours) == ["x", "y", "empty", "scalar", "text"]


def test_npz_object_arrays_and_non_archives_are_refused() -> None:
    data = _npz(False, o=np.array([{"a": 1}, None], dtype=object))
    for decode in (decode_npz, autodecode.decoders["npz"]):
        with pytest.raises(ValueError, match="allow_pickle"):
            decode(data)
    with pytest.raises(CorruptDataError, match=r"'npz' cannot be decoded.*allow_pickle"):
        Decoder()({"__key__": "k", "npz": data})
    buf = io.BytesIO()
    np.save(buf, np.arange(3))
    with pytest.raises(ValueError, match="not an npz archive"):
        decode_npz(buf.getvalue())


_VALUES = [
    {"a": [1, 2.5, None, True], "b": {"c": "héllo"}},
    [1, -(2**40), 2**63, "x" * 300],
    "just a string",
    3,
]


@pytest.mark.parametrize("value", _VALUES)
def test_msg_jsn_and_gz_decode_as_webdataset(value: Any) -> None:
    raw = json.dumps(value).encode()
    sample = {
        "__key__": "k",
        "msg": msgpack.packb(value, use_bin_type=True),
        "jsn": raw,
        "jsn.gz": gzip.compress(raw),
        "json.gz": gzip.compress(raw),
        "meta.msg.gz": gzip.compress(msgpack.packb(value)),
        "two.jsn.gz": gzip.compress(raw[:1]) + gzip.compress(raw[1:]),  # two gzip members
    }
    ours, ref = Decoder()(sample), _reference(sample)
    assert list(ours) == list(sample)
    for name in sample:
        _same(ours[name], ref[name])
        if name != "__key__":
            assert ours[name] == value


def test_msg_bytes_and_binary_values() -> None:
    value = {"raw": b"\x00\xff", "s": "t", "nested": [b"", {"k": 1.0}]}
    data = msgpack.packb(value, use_bin_type=True)
    sample = {"__key__": "k", "msg": data, "msg.gz": gzip.compress(data)}
    ours, ref = Decoder()(sample), _reference(sample)
    _same(ours, ref)


@pytest.mark.parametrize("text", [b"7", b" 42\n", b"-3", b"+0", b"1_000", b"0012"])
def test_inx_decodes_as_webdataset(text: bytes) -> None:
    sample = {"__key__": "k", "inx": text, "inx.gz": gzip.compress(text)}
    _same(Decoder()(sample), _reference(sample))


def test_gz_of_binary_fields_decodes_as_webdataset() -> None:
    arrays = [np.arange(5, dtype=np.uint8), np.eye(3)]
    npz = _npz(True, a=arrays[1])
    sample = {
        "__key__": "k",
        "ten.gz": gzip.compress(bytes(tenbin.encode_buffer(arrays))),
        "npz.gz": gzip.compress(npz),
        "txt.gz": gzip.compress("héllo".encode()),
        "cls.gz": gzip.compress(b"3"),
        "bin.gz": gzip.compress(b"\x00\x01"),  # no decoder for "bin": the gunzipped bytes
        "empty.gz": gzip.compress(b""),
    }
    ours, ref = Decoder()(sample), _reference(sample)
    for name in sample:
        _same(ours[name], ref[name])
    assert ours["bin.gz"] == b"\x00\x01"
    assert gunzip(gzip.compress(b"abc") + b"\0\0") == b"abc"  # zero padding after a member


def test_gz_that_is_not_gzip_is_corrupt() -> None:
    with pytest.raises(CorruptDataError, match=r"'json\.gz' is not valid gzip"):
        Decoder()({"__key__": "k", "json.gz": b"{}"})
    with pytest.raises(CorruptDataError, match=r"'json\.gz' is not valid gzip"):
        Decoder()({"__key__": "k", "json.gz": gzip.compress(b"{}")[:-3]})


def test_pickles_decode_as_webdataset_when_allowed() -> None:
    value = {"p": [1, 2], "t": torch.arange(3)}
    buf = io.BytesIO()
    torch.save(value, buf)
    sample = {"__key__": "k", "pkl": pickle.dumps([1, "a"]), "pth": buf.getvalue()}
    ours, ref = Decoder(allow_pickle=True)(sample), _reference(sample)
    assert ours["pkl"] == ref["pkl"] == [1, "a"]
    assert ours["pth"].keys() == ref["pth"].keys()
    assert ours["pth"]["p"] == ref["pth"]["p"]
    assert torch.equal(ours["pth"]["t"], ref["pth"]["t"])


def test_cbor_goes_to_the_cbor_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both decoders hand the bytes to ``cbor.loads`` (the package is optional, so a stand-in)."""
    calls: list[bytes] = []

    class FakeCbor:
        @staticmethod
        def loads(data: bytes) -> Any:
            calls.append(data)
            return {"decoded": data}

    monkeypatch.setitem(sys.modules, "cbor", FakeCbor)
    assert decode_cbor(b"\xa0") == autodecode.decoders["cbor"](b"\xa0") == {"decoded": b"\xa0"}
    assert calls == [b"\xa0", b"\xa0"]


# ---- without webdataset ---------------------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import pickle, sys

    import fastload, fastload.loader, fastload.loader.decode
    from fastload.loader.decode import Decoder

    with open(sys.argv[1], "rb") as f:
        sample = pickle.load(f)
    decoded = Decoder()(sample)
    assert "webdataset" not in sys.modules, "importing or decoding imported webdataset"

    sys.modules["webdataset"] = None  # as if not installed: `import webdataset` raises
    decoded_blocked = Decoder()(sample)
    try:
        import fastload.wds
    except fastload.errors.MissingDependencyError as exc:
        message = str(exc)
    else:
        raise AssertionError("fastload.wds imported without webdataset")
    with open(sys.argv[2], "wb") as f:
        pickle.dump((decoded, decoded_blocked, message), f)
    """
)


def test_fastload_decodes_every_extension_without_webdataset(tmp_path: Path) -> None:
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array([1, 2], np.int64)]
    ten = bytes(tenbin.encode_buffer(arrays))
    value = {"a": [1, 2], "b": "c"}
    sample = {
        "__key__": "s0",
        "__url__": "file:///d/s.tar",
        "ten": ten,
        "tb": ten,
        "msg": msgpack.packb(value),
        "npz": _npz(False, x=arrays[0], y=arrays[1]),
        "jsn": json.dumps(value).encode(),
        "inx": b"7",
        "json.gz": gzip.compress(json.dumps(value).encode()),
        "ten.gz": gzip.compress(ten),
        "mp": msgpack.packb(value),
        "cls": b"3",
    }
    (tmp_path / "in.pkl").write_bytes(pickle.dumps(sample))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "in.pkl"), str(tmp_path / "out.pkl")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr
    decoded, decoded_blocked, message = pickle.loads((tmp_path / "out.pkl").read_bytes())
    ref = _reference(sample)
    _same(decoded, ref)
    _same(decoded_blocked, ref)
    assert "fastload.wds needs the Python package 'webdataset'" in message
    assert "pip install 'fastload[wds]'" in message
