"""TFRecord format: round trips, the Example mapping, DALI and TensorFlow interop, corrupt input.

Interop is proven against the reference implementations: DALI's ``tfrecord2idx`` and
``fn.readers.tfrecord`` (CPU mode), and TensorFlow itself, run in the separate virtualenv that
``tools/tf-venv.sh`` builds (TensorFlow pins its own protobuf and numpy).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import importlib.util
import io
import json
import logging
import mmap
import os
import pickle
import re
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastload.errors import CorruptDataError, FormatError, InvalidArgumentError
from fastload.formats import get_format
from fastload.formats.tfrecord import FORMAT, TFRecordReader, TFRecordWriter, build_index, detect
from fastload.formats.tfrecord import _decode as dec
from fastload.formats.tfrecord import _example as ex
from fastload.formats.tfrecord._framing import crc32c, crc32c_extend, frame_footer, frame_header
from fastload.storage import LocalStore, MemoryStore, Store
from fastload.testing import need

REPO = Path(__file__).resolve().parents[2]
README = REPO / "fastload" / "formats" / "tfrecord" / "README.md"
TF_PYTHON = Path(os.environ.get("FASTLOAD_TF_PYTHON", REPO / ".venv-tf" / "bin" / "python"))
TFRECORD2IDX = Path(sys.executable).parent / "tfrecord2idx"


def npy(array: Any) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.asarray(array), allow_pickle=False)
    return buf.getvalue()


def fields_of(sample: dict[str, Any]) -> dict[str, bytes]:
    return {k: v for k, v in sample.items() if not k.startswith("__")}


def write(store: Store, key: str, samples: list[dict[str, Any]], **options: Any) -> Any:
    with TFRecordWriter(store, key, **options) as writer:
        for sample in samples:
            writer.write(sample)
    return writer.close()


@contextlib.contextmanager
def _mapped(data: bytes) -> Iterator[mmap.mmap]:
    """``data`` in an anonymous memory map (the buffer type a local shard is read through)."""
    view = mmap.mmap(-1, len(data))
    try:
        view.write(data)
        yield view
    finally:
        view.close()


def frame(payload: bytes) -> bytes:
    """One TFRecord record around ``payload``."""
    return frame_header(len(payload)) + payload + frame_footer(crc32c(payload))


# ---- the sample model round-trips --------------------------------------------------------------

_KEY_SEGMENT = st.text(
    alphabet=st.characters(categories=("L", "N", "S"), exclude_characters="./\x00\n\r"),
    min_size=1,
    max_size=10,
)
_KEYS = st.lists(_KEY_SEGMENT, min_size=1, max_size=3).map("/".join)
_INT_TEXT = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1).map(lambda i: str(i).encode()),
    st.sampled_from([b"007", b"-0", b"+1", b" 1", b"1_000", b"1\n", str(2**63).encode(), b""]),
)
_NPY = st.one_of(
    st.lists(st.floats(width=32, allow_nan=False), max_size=6).map(
        lambda v: npy(np.array(v, dtype="<f4"))
    ),
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=6).map(
        lambda v: npy(np.array(v, dtype="<i8"))
    ),
    st.just(npy(np.zeros((2, 3), dtype="<f4"))),
    st.just(npy(np.array(3.5))),
    st.just(npy(np.arange(4, dtype="<i4"))),
    st.binary(max_size=40),
)


@st.composite
def samples(draw: st.DrawFn) -> list[dict[str, Any]]:
    keys = draw(st.lists(_KEYS, min_size=1, max_size=6, unique=True))
    out = []
    for key in keys:
        sample: dict[str, Any] = {"__key__": key}
        names = draw(
            st.lists(
                st.sampled_from(
                    ["jpg", "cls", "label", "txt", "bin", "x.npy", "npy", "seg.png", "a.cls"]
                    + [f"f{i}" for i in range(20)]
                ),
                max_size=12,
                unique=True,
            )
        )
        for name in names:
            if name.endswith(("cls", "label")):
                sample[name] = draw(st.one_of(_INT_TEXT, st.binary(max_size=8)))
            elif name.endswith("npy"):
                sample[name] = draw(_NPY)
            else:
                sample[name] = draw(
                    st.one_of(
                        st.binary(max_size=64),
                        st.just(b""),
                        st.binary(min_size=5000, max_size=9000),
                    )
                )
        out.append(sample)
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=samples())
def test_round_trip_is_lossless(batch: list[dict[str, Any]]) -> None:
    store = MemoryStore("tfrecord-hypothesis")
    write(store, "s.tfrecord", batch)
    with TFRecordReader(store, "s.tfrecord") as reader:
        got = list(reader)
        assert [s["__key__"] for s in got] == [s["__key__"] for s in batch]
        # same bytes, same field order
        assert [list(fields_of(s).items()) for s in got] == [
            list(fields_of(s).items()) for s in batch
        ]
        assert len(reader) == len(batch)
        last = len(batch) - 1
        assert fields_of(reader.read(last)) == fields_of(batch[last])


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=samples())
def test_encoder_matches_protobuf_runtime_and_fast_decoder_matches_runtime(
    batch: list[dict[str, Any]],
) -> None:
    for sample in batch:
        fields = fields_of(sample)
        pieces, length = ex.encode_example(sample["__key__"], fields)
        payload = b"".join(pieces)
        assert len(payload) == length
        # protobuf's own serializer, fed the same features, gives the same bytes
        message = ex.Example.FromString(payload)
        assert message.SerializeToString() == payload
        assert dec.decode_runtime(payload) == (sample["__key__"], fields)
        got: dict[str, bytes] = {}
        try:
            key = dec.decode_fast(payload, 0, len(payload), None, got)
        except dec.Unusual:
            continue
        assert (key, got) == ((sample["__key__"], 0), fields)
        # the same payload inside a memory map of a larger buffer (as in a mapped shard), with
        # the CRC32C computed while decoding
        with _mapped(b"\x0a\xff" * 9 + payload + b"\x0a\x7f" * 9) as view:
            for crc in (0, 12345):
                got = {"__url__": "u"}
                assert dec.decode_fast(view, 18, 18 + len(payload), crc, got) == (
                    sample["__key__"],
                    crc32c_extend(crc, payload),
                )
                assert got == {"__url__": "u", **fields}
                assert list(got)[1:] == list(fields)


def test_typed_features_for_tensorflow_users() -> None:
    fields = {
        "cls": b"42",
        "neg.cls": b"-7",
        "big.label": str(2**63 - 1).encode(),
        "lead.cls": b"007",  # not canonical: stays bytes
        "huge.cls": str(2**63).encode(),  # out of int64: stays bytes
        "emb.npy": npy(np.array([0.5, -1.0, 3.25], dtype="<f4")),
        "ids.npy": npy(np.array([1, -2, 2**40], dtype="<i8")),
        "one.npy": npy(np.array([9], dtype="<i8")),
        "img.npy": npy(np.zeros((2, 2), dtype="<f4")),  # 2-D: stays bytes
        "jpg": b"\xff\xd8",
        "empty": b"",
    }
    payload = b"".join(ex.encode_example("k", fields)[0])
    message = ex.Example.FromString(payload)
    kinds = {e.key: e.value.WhichOneof("kind") for e in message.features.feature}
    assert kinds == {
        "__key__": "bytes_list",
        "cls": "int64_list",
        "neg.cls": "int64_list",
        "big.label": "int64_list",
        "lead.cls": "bytes_list",
        "huge.cls": "bytes_list",
        "emb.npy": "float_list",
        "ids.npy": "int64_list",
        "one.npy": "int64_list",
        "img.npy": "bytes_list",
        "jpg": "bytes_list",
        "empty": "bytes_list",
    }
    values = {e.key: e.value for e in message.features.feature}
    assert list(values["cls"].int64_list.value) == [42]
    assert list(values["big.label"].int64_list.value) == [2**63 - 1]
    assert list(values["emb.npy"].float_list.value) == [0.5, -1.0, 3.25]
    assert list(values["ids.npy"].int64_list.value) == [1, -2, 2**40]
    assert list(values["empty"].bytes_list.value) == [b""]
    assert dec.decode_example(payload) == ("k", fields)


def test_signalling_nan_float_arrays_stay_bytes() -> None:
    raw = struct.pack("<2I", 0x7F800001, 0x3F800000)  # a signalling NaN, then 1.0
    data = ex.npy_bytes("<f4", raw, 2)
    assert np.load(io.BytesIO(data)).tobytes() == raw
    payload = b"".join(ex.encode_example("k", {"x.npy": data})[0])
    assert dec.decode_example(payload) == ("k", {"x.npy": data})


@pytest.mark.parametrize("n", [0, 1, 3, 10**6, 10**21 - 1])
def test_npy_header_matches_numpy(n: int) -> None:
    for descr in ("<f4", "<i8"):
        expected = npy(np.zeros(min(n, 4), dtype=descr))
        header = ex._npy_header(descr, n)
        if n <= 4:
            assert header == expected[: len(header)]
        assert len(header) % 64 == 0
        assert header.endswith(b"\n")


def test_python_values_and_deterministic_golden_bytes() -> None:
    store = MemoryStore("tfrecord-golden")
    info = write(store, "g.tfrecord", [{"__key__": "a/b", "cls": 3, "txt": "hé"}])
    data = store.get("g.tfrecord")
    # Example{features{feature{key:"__key__" value{bytes_list{value:"a/b"}}}
    #                  feature{key:"cls" value{int64_list{value:3}}}
    #                  feature{key:"txt" value{bytes_list{value:"h\xc3\xa9"}}}}}
    payload = bytes.fromhex(
        "0a32"
        "0a12"
        "0a075f5f6b65795f5f"
        "1207"
        "0a05"
        "0a03612f62"
        "0a0c"
        "0a03636c73"
        "1205"
        "1a03"
        "0a0103"
        "0a0e"
        "0a03747874"
        "1207"
        "0a05"
        "0a0368c3a9"
    )
    assert data == frame(payload)
    assert info.sha256 == hashlib.sha256(data).hexdigest()
    assert store.get("g.tfrecord.idx") == f"0 {len(payload) + 16}\n".encode()


def test_registry_and_format_record() -> None:
    assert get_format("tfrecord") is FORMAT
    assert get_format("tfr") is FORMAT
    assert FORMAT.extension == "tfrecord"
    assert FORMAT.build_index is build_index
    assert FORMAT.detect is detect


# ---- third-party Examples -----------------------------------------------------------------------


def _example(features: list[tuple[str, str, list[Any]]]) -> bytes:
    message = ex.Example()
    for name, kind, values in features:
        entry = message.features.feature.add()
        entry.key = name
        if kind == "none":
            entry.value.SetInParent()
            continue
        target = getattr(entry.value, kind)
        target.SetInParent()
        target.value.extend(values)
    payload: bytes = message.SerializeToString()
    return payload


def test_third_party_examples_map_to_fields() -> None:
    payload = _example(
        [
            ("image/encoded", "bytes_list", [b"JPEG"]),
            ("image/class/label", "int64_list", [-5]),
            ("bbox", "float_list", [0.25, 0.5]),
            ("one_float", "float_list", [1.5]),
            ("tags", "bytes_list", [b"a", b""]),
            ("no_tags", "bytes_list", []),
            ("ids", "int64_list", [1, 2, 3]),
            ("nothing", "none", []),
            ("__reserved__", "bytes_list", [b"dropped"]),
        ]
    )
    store = MemoryStore("tfrecord-third-party")
    store.put("data/train.tfrecord-00003-of-00010", frame(payload) + frame(payload))
    got = list(TFRecordReader(store, "data/train.tfrecord-00003-of-00010"))
    assert [s["__key__"] for s in got] == [
        "data/train.tfrecord-00003-of-00010/00000000",
        "data/train.tfrecord-00003-of-00010/00000001",
    ]
    sample = got[0]
    assert list(fields_of(sample)) == [
        "image/encoded",
        "image/class/label",
        "bbox",
        "one_float",
        "tags",
        "no_tags",
        "ids",
        "nothing",
    ]
    assert sample["image/encoded"] == b"JPEG"
    assert sample["image/class/label"] == b"-5"
    np.testing.assert_array_equal(np.load(io.BytesIO(sample["bbox"])), np.float32([0.25, 0.5]))
    assert np.load(io.BytesIO(sample["one_float"])).dtype == np.float32
    assert msgpack.unpackb(sample["tags"]) == [b"a", b""]
    assert msgpack.unpackb(sample["no_tags"]) == []
    assert np.load(io.BytesIO(sample["ids"])).tolist() == [1, 2, 3]
    assert msgpack.unpackb(sample["nothing"]) == []

    keyed = frame(_example([("__key__", "bytes_list", [b"mine"]), ("x", "bytes_list", [b"1"])]))
    store.put("k.tfrecord.gz", gzip.compress(keyed, mtime=0))
    assert [s["__key__"] for s in TFRecordReader(store, "k.tfrecord.gz")] == ["mine"]
    store.put("n.tfrecord.gz", gzip.compress(frame(payload), mtime=0))
    assert next(iter(TFRecordReader(store, "n.tfrecord.gz")))["__key__"] == "n/00000000"


def test_protobuf_edge_cases_follow_protobuf_rules() -> None:
    # repeated feature name: last entry wins; unknown fields are skipped; unpacked scalars work
    payload = _example([("a", "bytes_list", [b"1"]), ("a", "bytes_list", [b"2"])])
    assert dec.decode_example(payload) == (None, {"a": b"2"})
    unknown = b"\x10\x05" + _example([("a", "int64_list", [7])]) + b"\x1a\x02hi"
    assert dec.decode_example(unknown) == (None, {"a": b"7"})
    # Feature{int64_list{value: 5 (unpacked)}}
    entry = b"\x0a\x01b\x12\x04\x1a\x02\x08\x05"
    unpacked = b"\x0a" + bytes([len(entry) + 2]) + b"\x0a" + bytes([len(entry)]) + entry
    assert dec.decode_example(unpacked) == (None, {"b": b"5"})
    assert dec.decode_example(b"") == (None, {})
    with pytest.raises(ex.ProtoError, match="__key__"):
        dec.decode_example(_example([("__key__", "int64_list", [1])]))
    with pytest.raises(ex.ProtoError, match="UTF-8"):
        dec.decode_example(_example([("__key__", "bytes_list", [b"\xff"])]))
    with pytest.raises(ex.ProtoError):
        dec.decode_example(b"\x0a\x05\x0a\x03\x0a\x01")


# ---- the writer -----------------------------------------------------------------------------------


def test_writer_compression_round_trip_without_index(tmp_path: Path) -> None:
    batch = [{"__key__": f"k{i}", "bin": bytes([i]) * 3000, "cls": i} for i in range(30)]
    a, b = LocalStore(tmp_path / "a"), LocalStore(tmp_path / "b")
    for compression, opener in (("gzip", gzip.decompress), ("zlib", zlib.decompress)):
        key = f"s.{compression}.tfrecord"
        info = write(a, key, batch, compression=compression)
        write(b, key, batch, compression=compression.upper())
        data = a.get(key)
        assert data == b.get(key)  # deterministic (gzip mtime 0)
        assert info.index_key is None
        assert not a.exists(key + ".idx")
        assert info.num_bytes == len(data)
        assert info.sha256 == hashlib.sha256(data).hexdigest()
        plain = opener(data)
        write(a, "plain.tfrecord", batch)
        assert plain == a.get("plain.tfrecord")  # the same records inside
        got = list(TFRecordReader(a, key))
        assert [fields_of(s) for s in got] == [
            {"bin": s["bin"], "cls": str(s["cls"]).encode()} for s in batch
        ]
        reader = TFRecordReader(a, key)
        with pytest.raises(FormatError, match="compressed"):
            len(reader)
        assert [s["__key__"] for s in reader.iter_from(28)] == ["k28", "k29"]


def test_writer_rejects_bad_options_and_samples() -> None:
    store = MemoryStore("tfrecord-bad-options")
    with pytest.raises(InvalidArgumentError, match="compression"):
        TFRecordWriter(store, "x.tfrecord", compression="lz4")
    with pytest.raises(InvalidArgumentError, match="compression_level"):
        TFRecordWriter(store, "x.tfrecord", compression="gzip", compression_level=11)
    writer = TFRecordWriter(store, "x.tfrecord")
    with pytest.raises(InvalidArgumentError, match="field name"):
        writer.write({"__key__": "a", "bad/name": b"x"})
    with pytest.raises(InvalidArgumentError, match="__key__"):
        writer.write({"__key__": "", "bin": b"x"})
    writer.write({"__key__": "a", "bin": b"x"})  # still usable after rejected samples
    info = writer.close()
    assert info.num_samples == 1
    assert writer.close() is info
    with pytest.raises(ValueError, match="closed"):
        writer.write({"__key__": "b", "bin": b"y"})
    assert [s["__key__"] for s in TFRecordReader(store, "x.tfrecord")] == ["a"]


# ---- the index: DALI's tfrecord2idx --------------------------------------------------------------


def test_index_equals_dali_tfrecord2idx(tmp_path: Path) -> None:
    need("DALI tfrecord2idx", TFRECORD2IDX.exists(), "pip install nvidia-dali-cuda120")
    store = LocalStore(tmp_path)
    batch = [{"__key__": f"s/{i:04d}", "jpg": os.urandom(37 * i * i), "cls": i} for i in range(40)]
    info = write(store, "s.tfrecord", batch)
    dali_idx = tmp_path / "dali.idx"
    subprocess.run(
        [sys.executable, str(TFRECORD2IDX), str(tmp_path / "s.tfrecord"), str(dali_idx)],
        check=True,
        capture_output=True,
    )
    expected = dali_idx.read_bytes()
    assert len(expected.splitlines()) == 40
    assert store.get(info.index_key) == expected
    assert build_index(store, "s.tfrecord") == expected


def test_build_index_errors(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    write(store, "s.tfrecord", [{"__key__": f"k{i}", "bin": b"x" * 100} for i in range(3)])
    data = store.get("s.tfrecord")
    store.put("t.tfrecord", data[:-10])
    with pytest.raises(CorruptDataError, match="truncated") as info:
        build_index(store, "t.tfrecord")
    assert info.value.offset == 2 * (len(data) // 3)
    assert info.value.url.endswith("t.tfrecord")
    store.put("g.tfrecord", gzip.compress(data))
    with pytest.raises(FormatError, match="gzip-compressed"):
        build_index(store, "g.tfrecord")
    store.put("e.tfrecord", b"")
    assert build_index(store, "e.tfrecord") == b""


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_random_access_and_index_problems(backend: str, tmp_path: Path) -> None:
    store = MemoryStore("tfrecord-index") if backend == "memory" else LocalStore(tmp_path)
    write(store, "s.tfrecord", [{"__key__": f"k{i}", "bin": bytes([i]) * i} for i in range(10)])
    reader = TFRecordReader(store, "s.tfrecord")
    assert len(reader) == 10
    assert reader.read(-1)["__key__"] == "k9"
    assert reader.read(3)["bin"] == b"\x03" * 3
    assert reader.read(3)["__index__"] == 3
    with pytest.raises(IndexError, match="10 records"):
        reader.read(10)
    assert [s["__index__"] for s in reader.iter_from(7)] == [7, 8, 9]
    assert list(reader.iter_from(10)) == []
    clone = pickle.loads(pickle.dumps(reader))
    assert clone.read(2)["__key__"] == "k2"

    write(store, "other.tfrecord", [{"__key__": "x", "bin": b"y" * 50}])
    wrong = TFRecordReader(store, "s.tfrecord", index_key="other.tfrecord.idx")
    with pytest.raises(CorruptDataError, match="index"):
        wrong.read(0)
    store.put("garbage.idx", b"0 17\nhello 3\n")
    with pytest.raises(CorruptDataError, match="not an integer"):
        len(TFRecordReader(store, "s.tfrecord", index_key="garbage.idx"))
    store.put("odd.idx", b"0 17\n17\n")
    with pytest.raises(CorruptDataError, match="odd"):
        len(TFRecordReader(store, "s.tfrecord", index_key="odd.idx"))
    store.put("past.idx", b"0 100000\n")
    with pytest.raises(CorruptDataError, match=r"covers bytes \[0, 100000\) but the shard is"):
        TFRecordReader(store, "s.tfrecord", index_key="past.idx").read(0)
    store.put("gap.idx", b"0 17\n34 17\n")  # a record left out: its sample would be lost
    with pytest.raises(CorruptDataError, match=r"line 2 .* should start at byte 17"):
        len(TFRecordReader(store, "s.tfrecord", index_key="gap.idx"))

    store.delete("s.tfrecord.idx")
    no_index = TFRecordReader(store, "s.tfrecord")
    with pytest.raises(FormatError, match="fastload index"):
        len(no_index)
    with pytest.raises(FormatError, match="fastload index"):
        no_index.read(0)
    assert [s["__key__"] for s in no_index.iter_from(8)] == ["k8", "k9"]


def test_local_shards_are_read_through_a_memory_map(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = [
        {"__key__": f"k{i}", "jpg": bytes([i]) * (5000 * i), "cls": i, "txt": b"t" * i}
        for i in range(6)
    ]
    local = LocalStore(tmp_path)
    write(local, "s.tfrecord", batch)
    memory = MemoryStore("tfrecord-mapped")
    memory.put("s.tfrecord", local.get("s.tfrecord"))
    memory.put("s.tfrecord.idx", local.get("s.tfrecord.idx"))
    streamed = list(TFRecordReader(memory, "s.tfrecord"))
    assert [fields_of(s) for s in streamed] == [
        {"jpg": s["jpg"], "cls": str(s["cls"]).encode(), "txt": s["txt"]} for s in batch
    ]

    def no_streaming(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a local shard must not be streamed")

    monkeypatch.setattr(local, "open_reader", no_streaming)
    monkeypatch.setattr(local, "get_ranges", no_streaming)
    reader = TFRecordReader(local, "s.tfrecord")
    mapped = list(reader)
    assert [{k: v for k, v in s.items() if k != "__url__"} for s in mapped] == [
        {k: v for k, v in s.items() if k != "__url__"} for s in streamed
    ]
    assert [list(s) for s in mapped] == [list(s) for s in streamed]  # same field order
    assert all(type(v) is bytes for s in mapped for k, v in s.items() if k[:2] != "__")
    assert [s["__index__"] for s in reader.iter_from(4)] == [4, 5]

    # read(i) slices a map kept until close(); the reader pickles without it
    real_get = local.get
    monkeypatch.setattr(
        local, "get", lambda key, *a: no_streaming() if key == "s.tfrecord" else real_get(key, *a)
    )
    assert reader.read(5) == mapped[5]
    assert reader.read(-6) == mapped[0]
    clone = pickle.loads(pickle.dumps(reader))
    reader.close()
    assert reader.read(3) == mapped[3]
    assert clone.read(2) == mapped[2]
    clone.close()
    reader.close()

    # an empty local file is an empty shard
    monkeypatch.undo()
    local.put("empty.tfrecord", b"")
    assert list(TFRecordReader(local, "empty.tfrecord")) == []


# ---- detection ------------------------------------------------------------------------------------


def test_detect() -> None:
    store = MemoryStore("tfrecord-detect")
    write(store, "s.tfrecord", [{"__key__": "a", "bin": b"1"}])
    plain = store.get("s.tfrecord")
    assert detect(plain[:12])
    assert detect(plain[:4096])
    assert detect(gzip.compress(plain)[:64])
    assert detect(zlib.compress(plain)[:64])
    assert not detect(b"")
    assert not detect(plain[:11])
    assert not detect(b"\x00" * 64)
    assert not detect(gzip.compress(b"ustar tar bytes " * 100)[:256])  # e.g. a .tar.gz
    assert not detect(bytes(12))
    assert not detect(b"x^" + b"\x00" * 30)


# ---- corrupt input --------------------------------------------------------------------------------


@pytest.fixture(params=["memory", "local"])
def shard(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Store, bytes, list[int]]:
    """A 3-record shard, in a MemoryStore (streamed) or a LocalStore (memory-mapped)."""
    store: Store
    if request.param == "local":
        store = LocalStore(tmp_path / "corrupt")
    else:
        store = MemoryStore("tfrecord-corrupt")
        for meta in list(store.list()):
            store.delete(meta.key)
    write(
        store, "s.tfrecord", [{"__key__": f"k{i}", "bin": bytes([65 + i]) * 200} for i in range(3)]
    )
    data = store.get("s.tfrecord")
    size = len(data) // 3
    return store, data, [0, size, 2 * size]


def _read_all(store: Store, **options: Any) -> tuple[list[str], TFRecordReader]:
    reader = TFRecordReader(store, "s.tfrecord", **options)
    return [s["__key__"] for s in reader], reader


def _assert_error(
    store: Store, match: str, offset: int, **options: Any
) -> pytest.ExceptionInfo[CorruptDataError]:
    with pytest.raises(CorruptDataError, match=match) as info:
        _read_all(store, **options)
    url = store.child_url("s.tfrecord")
    assert info.value.offset == offset
    assert info.value.url == url
    assert f"byte offset {offset}" in str(info.value)
    assert url in str(info.value)
    return info


def test_bad_payload_crc(shard: tuple[Store, bytes, list[int]]) -> None:
    store, data, offsets = shard
    broken = bytearray(data)
    broken[offsets[1] + 100] ^= 0xFF  # inside record 1's value
    store.put("s.tfrecord", bytes(broken))
    _assert_error(store, "payload CRC mismatch in record 1", offsets[1])
    keys, reader = _read_all(store, on_error="skip")
    assert keys == ["k0", "k2"]
    assert reader.skipped == 1
    keys, reader = _read_all(store, verify=False)  # unchecked: the damaged bytes come through
    assert keys == ["k0", "k1", "k2"]
    with pytest.raises(CorruptDataError, match="payload CRC"):
        TFRecordReader(store, "s.tfrecord").read(1)
    assert TFRecordReader(store, "s.tfrecord").read(2)["__key__"] == "k2"


def test_bad_length_crc_stops_the_shard(
    shard: tuple[Store, bytes, list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    store, data, offsets = shard
    broken = bytearray(data)
    broken[offsets[1] + 9] ^= 0x01  # record 1's length CRC
    store.put("s.tfrecord", bytes(broken))
    _assert_error(store, "length CRC mismatch in record 1", offsets[1])
    keys, reader = _read_all(store, on_error="skip")
    assert keys == ["k0"]
    assert reader.skipped == 1
    with caplog.at_level(logging.WARNING, logger="fastload.formats"):
        keys, reader = _read_all(store, on_error="warn")
    assert keys == ["k0"]
    assert reader.skipped == 1
    assert "length CRC" in caplog.text
    # unchecked, an absurd length reads to the end of the file and reports truncation
    broken = bytearray(data)
    broken[offsets[1] + 6] = 0x7F  # record 1's length becomes ~2**55
    store.put("s.tfrecord", bytes(broken))
    _assert_error(store, "truncated TFRecord: record 1", offsets[1], verify=False)


def test_truncated_record_and_header(shard: tuple[Store, bytes, list[int]]) -> None:
    store, data, offsets = shard
    store.put("s.tfrecord", data[: offsets[2] + 50])
    _assert_error(store, "truncated TFRecord: record 2", offsets[2])
    keys, reader = _read_all(store, on_error="skip")
    assert keys == ["k0", "k1"]
    assert reader.skipped == 1
    store.put("s.tfrecord", data[: offsets[2] + 5])
    _assert_error(store, "truncated TFRecord: the file ends 5 bytes into", offsets[2])


def test_garbage_protobuf(shard: tuple[Store, bytes, list[int]]) -> None:
    store, data, offsets = shard
    garbage = frame(b"\x0a\xff\xff\xff\x0f\x00garbage")
    store.put("s.tfrecord", data[: offsets[1]] + garbage + data[offsets[1] :])
    _assert_error(store, "record 1: payload is not a valid tf.train.Example", offsets[1])
    keys, reader = _read_all(store, on_error="skip")
    assert keys == ["k0", "k1", "k2"]
    assert reader.skipped == 1
    # positions are record numbers: the skipped record keeps its place
    assert [s["__index__"] for s in TFRecordReader(store, "s.tfrecord", on_error="skip")] == [
        0,
        2,
        3,
    ]


def test_corrupt_compressed_streams(shard: tuple[Store, bytes, list[int]]) -> None:
    store, data, offsets = shard
    packed = gzip.compress(data, mtime=0)
    store.put("s.tfrecord", packed[:-30])
    with pytest.raises(CorruptDataError, match="gzip-compressed TFRecord stream ends") as info:
        _read_all(store)
    assert info.value.url == store.child_url("s.tfrecord")
    broken = bytearray(packed)
    broken[len(broken) // 2] ^= 0xFF
    store.put("s.tfrecord", bytes(broken))
    with pytest.raises(CorruptDataError, match="gzip"):
        _read_all(store)
    # a damaged record inside a good gzip stream names its decompressed offset
    inner = bytearray(data)
    inner[offsets[1] + 50] ^= 0xFF
    store.put("s.tfrecord", gzip.compress(bytes(inner), mtime=0))
    with pytest.raises(CorruptDataError, match="decompressed stream") as info:
        _read_all(store)
    assert info.value.offset == offsets[1]
    # concatenated gzip members are one stream
    store.put("s.tfrecord", gzip.compress(data[:300]) + gzip.compress(data[300:]))
    assert _read_all(store)[0] == ["k0", "k1", "k2"]


# ---- DALI reads our shards with our index ---------------------------------------------------------


@pytest.mark.dali
def test_dali_reads_our_shards(tmp_path: Path) -> None:
    need(
        "DALI", importlib.util.find_spec("nvidia.dali") is not None, "pip install 'fastload[dali]'"
    )
    from nvidia.dali import fn, pipeline_def
    from nvidia.dali import tfrecord as tfrec

    store = LocalStore(tmp_path)
    batch = [
        {"__key__": f"img/{i:03d}", "jpg": hashlib.sha256(b"%d" % i).digest() * i, "cls": 7 * i - 5}
        for i in range(13)
    ]
    paths, indexes = [], []
    for n in range(2):
        info = write(store, f"train-{n:06d}.tfrecord", batch[n * 7 : n * 7 + 7])
        paths.append(str(tmp_path / info.key))
        indexes.append(str(tmp_path / info.index_key))

    @pipeline_def(batch_size=5, num_threads=1, device_id=None)  # type: ignore[misc]
    def pipeline() -> Any:
        features = fn.readers.tfrecord(
            path=paths,
            index_path=indexes,
            features={
                "__key__": tfrec.FixedLenFeature((), tfrec.string, ""),
                "jpg": tfrec.FixedLenFeature((), tfrec.string, ""),
                "cls": tfrec.FixedLenFeature([1], tfrec.int64, -1),
            },
            random_shuffle=False,
            name="reader",
        )
        return features["__key__"], features["jpg"], features["cls"]

    pipe = pipeline()
    pipe.build()
    assert pipe.epoch_size("reader") == 13
    got: list[tuple[str, bytes, int]] = []
    while len(got) < 13:
        keys, jpgs, labels = pipe.run()
        for i in range(len(keys)):
            got.append(
                (
                    bytes(keys.at(i)).decode(),
                    bytes(jpgs.at(i)),
                    int(labels.at(i)[0]),
                )
            )
    assert got[:13] == [(s["__key__"], s["jpg"], s["cls"]) for s in batch]


# ---- TensorFlow interop ---------------------------------------------------------------------------

_TF_SCRIPT = r"""
import hashlib, json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf

job = json.loads(sys.argv[1])
namespace = {}
exec(job["readme_code"], namespace)  # defines feature_spec and parse(), verbatim from the README
out = {"version": tf.__version__, "parsed": {}, "written": {}}
for name, (path, compression) in job["parse"].items():
    rows = []
    for record in tf.data.TFRecordDataset(path, compression_type=compression):
        example = namespace["parse"](record)
        rows.append({
            "key": example["__key__"].numpy().decode("utf-8"),
            "jpg_sha256": hashlib.sha256(example["jpg"].numpy()).hexdigest(),
            "cls": int(example["cls"].numpy()),
            "emb": [float(x) for x in example["emb.npy"].numpy()],
        })
    out["parsed"][name] = rows

def feature(kind, values):
    if kind == "bytes":
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=values))
    if kind == "int64":
        return tf.train.Feature(int64_list=tf.train.Int64List(value=values))
    return tf.train.Feature(float_list=tf.train.FloatList(value=values))

for name, (path, compression) in job["write"].items():
    options = tf.io.TFRecordOptions(compression_type=compression)
    with tf.io.TFRecordWriter(path, options) as writer:
        for i in range(job["count"]):
            image = hashlib.sha256(f"{name}{i}".encode()).digest() * (1 + 400 * i)
            features = {
                "image/encoded": feature("bytes", [image]),
                "image/class/label": feature("int64", [i - 2]),
                "bbox": feature("float", [0.25 * i, 0.5, -1.5, 3.0]),
                "tags": feature("bytes", [b"a%d" % i, b""]),
                "ids": feature("int64", [i, -i, 2**40]),
            }
            if i % 2:
                features["__key__"] = feature("bytes", [f"tf/{name}/{i}".encode()])
            example = tf.train.Example(features=tf.train.Features(feature=features))
            writer.write(example.SerializeToString())
print(json.dumps(out))
"""


def readme_tf_code() -> str:
    """The TensorFlow snippet of the format README (between the tf-parse-spec markers)."""
    text = README.read_text(encoding="utf-8")
    match = re.search(
        r"<!-- tf-parse-spec: begin -->\s*```python\n(.*?)```\s*<!-- tf-parse-spec: end -->",
        text,
        re.S,
    )
    assert match, f"{README} lost its tf-parse-spec block"
    return match.group(1)


_TF_SAMPLES = [
    {
        "__key__": f"tf/ünï/{i:03d}",
        "jpg": hashlib.sha256(b"%d" % i).digest() * (i * 500),
        "cls": i * 13 - 40,
        "emb.npy": np.array([i, 0.5, -2.0, 1e-3], dtype="<f4"),
    }
    for i in range(12)
]


@pytest.fixture(scope="module")
def tf_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    need("TensorFlow venv", TF_PYTHON.exists(), f"run tools/tf-venv.sh (expected {TF_PYTHON})")
    root = tmp_path_factory.mktemp("tf")
    store = LocalStore(root)
    write(store, "ours.tfrecord", _TF_SAMPLES)
    write(store, "ours-gz.tfrecord", _TF_SAMPLES, compression="gzip")
    job = {
        "readme_code": readme_tf_code(),
        "parse": {
            "plain": [str(root / "ours.tfrecord"), ""],
            "gzip": [str(root / "ours-gz.tfrecord"), "GZIP"],
        },
        "write": {
            "plain": [str(root / "tf-plain.tfrecord"), ""],
            "gzip": [str(root / "tf-gzip.tfrecord.gz"), "GZIP"],
            "zlib": [str(root / "tf-zlib.tfrecord"), "ZLIB"],
        },
        "count": 7,
    }
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [str(TF_PYTHON), "-c", _TF_SCRIPT, json.dumps(job)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.tensorflow
@pytest.mark.parametrize("variant", ["plain", "gzip"])
def test_tensorflow_parses_our_shards(tf_run: tuple[Path, dict[str, Any]], variant: str) -> None:
    _root, result = tf_run
    assert result["parsed"][variant] == [
        {
            "key": s["__key__"],
            "jpg_sha256": hashlib.sha256(s["jpg"]).hexdigest(),
            "cls": s["cls"],
            "emb": [float(x) for x in s["emb.npy"]],
        }
        for s in _TF_SAMPLES
    ]


@pytest.mark.tensorflow
@pytest.mark.parametrize(
    ("variant", "key"),
    [("plain", "tf-plain.tfrecord"), ("gzip", "tf-gzip.tfrecord.gz"), ("zlib", "tf-zlib.tfrecord")],
)
def test_we_read_tensorflow_writer_output(
    tf_run: tuple[Path, dict[str, Any]], variant: str, key: str
) -> None:
    root, _result = tf_run
    store = LocalStore(root)
    assert detect(store.get(key)[:128])
    got = list(TFRecordReader(store, key))
    assert len(got) == 7
    stem = key.removesuffix(".gz").removesuffix(".tfrecord")
    for i, sample in enumerate(got):
        image = hashlib.sha256(f"{variant}{i}".encode()).digest() * (1 + 400 * i)
        assert sample["__key__"] == (f"tf/{variant}/{i}" if i % 2 else f"{stem}/{i:08d}")
        assert sample["__index__"] == i
        assert sample["image/encoded"] == image
        assert sample["image/class/label"] == str(i - 2).encode()
        np.testing.assert_array_equal(
            np.load(io.BytesIO(sample["bbox"]), allow_pickle=False),
            np.array([0.25 * i, 0.5, -1.5, 3.0], dtype=np.float32),
        )
        assert msgpack.unpackb(sample["tags"]) == [b"a%d" % i, b""]
        assert np.load(io.BytesIO(sample["ids"])).tolist() == [i, -i, 2**40]
    if variant == "plain":
        # and the index we build for TensorFlow's file gives random access
        store.put(key + ".idx", build_index(store, key))
        reader = TFRecordReader(store, key)
        assert len(reader) == 7
        assert reader.read(5)["image/encoded"] == got[5]["image/encoded"]


_SMALL_SAMPLE = st.fixed_dictionaries(
    {"__key__": _KEYS},
    optional={
        "jpg": st.binary(max_size=300),
        "cls": _INT_TEXT,
        "txt": st.binary(max_size=20),
        "bin": st.sampled_from([16_380, 16_400]).map(lambda n: bytes(range(256)) * (n // 256)),
    },
)


@pytest.mark.parametrize(
    "size", [0, 1, 120, 127, 128, 16_370, 16_383, 16_384, 2**21 - 20, 2**21, 2**21 + 5]
)
def test_fast_decoder_at_every_varint_width(size: int) -> None:
    """Lengths of 1, 2, 3 and 4 varint bytes, in every length field of a feature."""
    fields = {"bin": b"\xab" * size, "cls": str(size * 977 - 5).encode(), "txt": b"x"}
    payload = b"".join(ex.encode_example("k", fields)[0])
    got: dict[str, bytes] = {}
    assert dec.decode_fast(payload, 0, len(payload), 7, got) == ("k", crc32c_extend(7, payload))
    assert got == fields
    assert dec.decode_runtime(payload) == ("k", fields)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    sample=_SMALL_SAMPLE,
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=3),
    cut=st.one_of(st.none(), st.integers(0, 10**6)),
    trailer=st.one_of(st.just(b"\x0a"), st.just(b"\x12\x01"), st.binary(min_size=1, max_size=12)),
)
def test_fast_decoder_never_disagrees_with_protobuf_on_damaged_bytes(
    sample: dict[str, Any], flips: list[tuple[int, int]], cut: int | None, trailer: bytes
) -> None:
    data = bytearray(b"".join(ex.encode_example(sample["__key__"], fields_of(sample))[0]))
    for where, xor in flips:
        data[where % len(data)] ^= xor
    if cut is not None:
        del data[cut % len(data) :]
    payload = bytes(data)
    try:
        expected: Any = dec.decode_runtime(payload)
    except ex.ProtoError:
        expected = "error"
    fields: dict[str, bytes] = {}
    try:
        key, _ = dec.decode_fast(payload, 0, len(payload), None, fields)
    except dec.FAST_PATH_MISSES:
        pass  # the runtime decides
    else:
        assert (key, fields) == expected
    # in a shard's memory map, the bytes after the payload (the footer, the next record) never
    # change the decision
    with _mapped(payload + trailer) as view:
        fields = {}
        try:
            key, crc = dec.decode_fast(view, 0, len(payload), 0, fields)
        except dec.FAST_PATH_MISSES:
            return
        assert (key, fields) == expected
        assert crc == crc32c(payload)


def test_damaged_compressed_stream_under_skip_keeps_the_records_before_it(
    tmp_path: Path,
) -> None:
    """A damaged gzip/zlib stream used to escape the iterator even under on_error='skip'."""
    store = LocalStore(tmp_path)
    batch = [{"__key__": f"k{i:03d}", "bin": bytes([i]) * 2000} for i in range(120)]
    for compression in ("gzip", "zlib"):
        key = f"s.{compression}.tfrecord"
        write(store, key, batch, compression=compression)
        data = store.get(key)
        store.put(key, data[: len(data) * 3 // 4])  # the compressed stream ends early
        with pytest.raises(CorruptDataError, match=compression):
            list(TFRecordReader(store, key))
        reader = TFRecordReader(store, key, on_error="skip")
        keys = [s["__key__"] for s in reader]
        assert reader.skipped == 1
        assert 0 < len(keys) < 120
        assert keys == [f"k{i:03d}" for i in range(len(keys))]  # the intact leading records
        # a flipped byte inflates to garbage: CRCs catch it, the records before it are kept
        broken = bytearray(data)
        broken[len(broken) * 3 // 4] ^= 0xFF
        store.put(key, bytes(broken))
        reader = TFRecordReader(store, key, on_error="skip")
        keys = [s["__key__"] for s in reader]
        assert reader.skipped >= 1
        assert keys[: len(keys) - 1] == [f"k{i:03d}" for i in range(len(keys) - 1)]
