"""Arrow IPC / Feather files, Hugging Face ``save_to_disk`` directories and ``datasets.Dataset``
objects as conversion sources (issue 28), all built locally."""

from __future__ import annotations

import importlib
import io
import json
import wave
from pathlib import Path
from typing import Any

import datasets  # the dev extra: a missing one fails here, never skips
import pyarrow as pa
import pyarrow.feather as feather
import pytest
from PIL import Image

import fastload
from fastload.errors import ConversionError, InvalidArgumentError

fc = importlib.import_module("fastload.convert")


def _image(fmt: str, color: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 6), color).save(out, fmt)
    return out.getvalue()


def _wav() -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes(b"\x01\x00" * 16)
    return out.getvalue()


PNG = _image("PNG", (255, 0, 0))
JPEG = _image("JPEG", (0, 255, 0))
WEBP = _image("WEBP", (0, 0, 255))
CLASSES = ["cat", "dog", "fox"]


def _hf_dataset(n: int = 7) -> Any:
    """A ``datasets.Dataset`` with an Image (PNG and JPEG bytes, with and without a path), a
    ClassLabel and a string column."""
    images = [
        {"bytes": PNG, "path": None}
        if i % 3 == 0
        else {"bytes": JPEG, "path": f"photo{i}.jpeg"}
        if i % 3 == 1
        else {"bytes": WEBP, "path": None}
        for i in range(n)
    ]
    features = datasets.Features(
        {
            "image": datasets.Image(),
            "label": datasets.ClassLabel(names=CLASSES),
            "caption": datasets.Value("string"),
        }
    )
    return datasets.Dataset.from_dict(
        {
            "image": images,
            "label": [i % 3 for i in range(n)],
            "caption": [f"c{i}" for i in range(n)],
        },
        features=features,
    )


def _expected(n: int = 7, stem: str = "data-00000-of-00001") -> dict[str, dict[str, bytes]]:
    out = {}
    for i in range(n):
        image = {0: {"png": PNG}, 1: {"jpg": JPEG}, 2: {"webp": WEBP}}[i % 3]
        out[f"{stem}/{i:09d}"] = {
            **image,
            "label": str(i % 3).encode(),
            "caption": f"c{i}".encode(),
        }
    return out


def _read(url: Path) -> dict[str, dict[str, bytes]]:
    """Every sample, read back with fastload's loader."""
    out = {}
    for sample in fastload.open_dataset(str(url)):
        out[sample["__key__"]] = {k: bytes(v) for k, v in sample.items() if not k.startswith("__")}
    return out


def _convert(src: Any, dst: Path, fmt: str, **kw: Any) -> Any:
    kw.setdefault("workers", 1)
    kw.setdefault("quiet", True)
    kw.setdefault("shard_samples", 3)
    return fc.convert(src, dst, format=fmt, **kw)


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    path = tmp_path / "hf"
    _hf_dataset().save_to_disk(str(path))
    return path


def test_hf_save_to_disk(tmp_path: Path, hf_dir: Path, real_fmt: str, cv: Any) -> None:
    assert fc.detect_source_type(fc.open_source(hf_dir).store) == "huggingface"
    result = _convert(hf_dir, tmp_path / "out", real_fmt)
    assert result.source_type == "huggingface"
    assert _read(tmp_path / "out") == _expected()
    assert cv.read_dataset(tmp_path / "out") == _expected()
    manifest = json.loads((tmp_path / "out" / "fastload.json").read_text())
    assert manifest["metadata"]["classes"] == CLASSES
    assert result.num_classes == 3


def test_workers_give_identical_shards(tmp_path: Path, real_fmt: str, cv: Any) -> None:
    src = tmp_path / "hf"
    ds = _hf_dataset(40)
    ds.save_to_disk(str(src), num_shards=3)  # three arrow files, read in state.json's order
    one = _convert(src, tmp_path / "one", real_fmt, workers=1, shard_samples=7)
    _convert(src, tmp_path / "two", real_fmt, workers=2, shard_samples=7)
    assert one.num_shards == 6
    assert cv.tree_bytes(tmp_path / "one") == cv.tree_bytes(tmp_path / "two")
    keys = cv.ordered_keys(tmp_path / "one")
    assert keys[0] == "data-00000-of-00003/000000000"
    assert keys[-1].startswith("data-00002-of-00003/")


def test_state_json_order(tmp_path: Path, hf_dir: Path, cv: Any) -> None:
    """The arrow files are read in the order state.json lists, not sorted by name."""
    _hf_dataset(30).save_to_disk(str(tmp_path / "hf3"), num_shards=3)
    state_path = tmp_path / "hf3" / "state.json"
    state = json.loads(state_path.read_text())
    state["_data_files"].reverse()
    state_path.write_text(json.dumps(state))
    _convert(tmp_path / "hf3", tmp_path / "out", "webdataset", shard_samples=100)
    keys = cv.ordered_keys(tmp_path / "out")
    assert keys[0].startswith("data-00002-of-00003/")
    assert keys[-1].startswith("data-00000-of-00003/")


def test_dataset_object(tmp_path: Path, hf_dir: Path, real_fmt: str, cv: Any) -> None:
    ds = datasets.load_from_disk(str(hf_dir))
    one = _convert(ds, tmp_path / "one", real_fmt, workers=1)
    _convert(ds, tmp_path / "two", real_fmt, workers=2)
    assert one.source_type == "arrow"
    assert _read(tmp_path / "one") == _expected()
    assert cv.tree_bytes(tmp_path / "one") == cv.tree_bytes(tmp_path / "two")
    assert json.loads((tmp_path / "one" / "fastload.json").read_text())["metadata"] == {
        "classes": CLASSES
    }


def test_dataset_object_refused(tmp_path: Path, hf_dir: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"in-memory Dataset.*save_to_disk"):
        _convert(_hf_dataset(), tmp_path / "a", "webdataset")
    ds = datasets.load_from_disk(str(hf_dir))
    with pytest.raises(InvalidArgumentError, match="indices mapping"):
        _convert(ds.select([2, 0]), tmp_path / "b", "webdataset")
    with pytest.raises(InvalidArgumentError, match="columns"):
        _convert(ds.remove_columns(["caption"]), tmp_path / "c", "webdataset")
    dd = datasets.DatasetDict({"train": ds, "test": ds})
    with pytest.raises(InvalidArgumentError, match=r"2 splits \(train, test\).*one split"):
        _convert(dd, tmp_path / "d", "webdataset")
    assert not (tmp_path / "a").exists()


def test_dataset_dict_directory_refused(tmp_path: Path, hf_dir: Path) -> None:
    ds = datasets.load_from_disk(str(hf_dir))
    datasets.DatasetDict({"train": ds, "validation": ds}).save_to_disk(str(tmp_path / "dd"))
    for source_type in (None, "huggingface"):
        with pytest.raises(InvalidArgumentError) as err:
            _convert(tmp_path / "dd", tmp_path / "out", "webdataset", source_type=source_type)
        text = str(err.value)
        assert "DatasetDict" in text
        assert "train, validation" in text
        assert f"fastload convert {tmp_path / 'dd'}/train DST/train" in text
    assert not (tmp_path / "out").exists()
    _convert(tmp_path / "dd" / "train", tmp_path / "out", "webdataset")
    assert _read(tmp_path / "out") == _expected()


def _table() -> pa.Table:
    return pa.table(
        {
            "jpg": pa.array([b"\xff\xd8a", b"\xff\xd8b", None, b"\xff\xd8d", b"\xff\xd8e"]),
            "cls": pa.array([1, 2, 3, 4, 5], pa.int64()),
            "caption": pa.array(["one", "two", None, "four", "five"]),
            "score": pa.array([0.25, 1.0, 2.5, None, 3.0]),
        }
    )


_TABLE_SAMPLES = {
    "000000000": {"jpg": b"\xff\xd8a", "cls": b"1", "caption": b"one", "score": b"0.25"},
    "000000001": {"jpg": b"\xff\xd8b", "cls": b"2", "caption": b"two", "score": b"1.0"},
    "000000002": {"cls": b"3", "score": b"2.5"},
    "000000003": {"jpg": b"\xff\xd8d", "cls": b"4", "caption": b"four"},
    "000000004": {"jpg": b"\xff\xd8e", "cls": b"5", "caption": b"five", "score": b"3.0"},
}


def _write_ipc(path: Path, table: pa.Table, kind: str) -> None:
    """``kind``: ``file`` / ``stream`` (IPC, batches of 2 rows) or ``feather`` (version 2)."""
    if kind == "feather":
        feather.write_feather(table, str(path), chunksize=2)
        return
    open_writer = pa.ipc.new_file if kind == "file" else pa.ipc.new_stream
    with pa.OSFile(str(path), "wb") as sink, open_writer(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=2):
            writer.write_batch(batch)


@pytest.mark.parametrize(
    ("name", "kind"),
    [("t.arrow", "file"), ("t.arrow", "stream"), ("t.ipc", "stream"), ("t.feather", "feather")],
)
def test_arrow_ipc_and_feather(
    tmp_path: Path, name: str, kind: str, real_fmt: str, cv: Any
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    _write_ipc(src / name, _table(), kind)
    _write_ipc(src / f"u{name}", _table(), kind)  # a second file, after the first
    assert fc.detect_source_type(fc.open_source(src).store) == "arrow"
    one = _convert(src, tmp_path / "one", real_fmt)
    _convert(src, tmp_path / "two", real_fmt, workers=2)
    assert one.source_type == "arrow"
    stem = name.split(".")[0]
    expected = {f"{s}/{k}": v for s in (stem, f"u{stem}") for k, v in _TABLE_SAMPLES.items()}
    assert _read(tmp_path / "one") == expected
    assert cv.tree_bytes(tmp_path / "one") == cv.tree_bytes(tmp_path / "two")
    # One file alone, and the type named.
    _convert(src / name, tmp_path / "single", real_fmt, source_type="feather")
    assert cv.read_dataset(tmp_path / "single") == {
        f"{stem}/{k}": v for k, v in _TABLE_SAMPLES.items()
    }


def test_arrow_same_as_parquet(tmp_path: Path, cv: Any) -> None:
    """The same table as Parquet and as Arrow gives the same samples."""
    import pyarrow.parquet as pq

    (tmp_path / "a").mkdir()
    (tmp_path / "p").mkdir()
    table = _table().append_column("__key__", pa.array([f"k{i}" for i in range(5)]))
    _write_ipc(tmp_path / "a" / "t.arrow", table, "stream")
    pq.write_table(table, tmp_path / "p" / "t.parquet", row_group_size=2)
    _convert(tmp_path / "a", tmp_path / "oa", "webdataset")
    _convert(tmp_path / "p", tmp_path / "op", "webdataset")
    assert cv.read_dataset(tmp_path / "oa") == cv.read_dataset(tmp_path / "op")
    assert sorted(cv.read_dataset(tmp_path / "oa")) == [f"k{i}" for i in range(5)]


def test_audio_and_several_media_columns(tmp_path: Path, cv: Any) -> None:
    """HF features in an arrow file's schema metadata: Audio by path or magic bytes; with two
    media columns each field is ``<column>.<extension>``."""
    wav = _wav()
    media = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    features = {
        "audio": {"_type": "Audio"},
        "image": {"_type": "Image"},
        "label": {"names": ["a", "b"], "_type": "ClassLabel"},
    }
    schema = pa.schema(
        [("audio", media), ("image", media), ("label", pa.int64())],
        metadata={"huggingface": json.dumps({"info": {"features": features}})},
    )
    table = pa.table(
        {
            "audio": [
                {"bytes": wav, "path": None},
                {"bytes": b"fLaC\x00\x00", "path": None},
                {"bytes": b"ID3\x03abc", "path": "x.MP3"},
            ],
            "image": [{"bytes": PNG, "path": "a.png"}, None, {"bytes": JPEG, "path": None}],
            "label": [0, 1, 1],
        },
        schema=schema,
    )
    (tmp_path / "src").mkdir()
    _write_ipc(tmp_path / "src" / "media.arrow", table, "stream")
    _convert(tmp_path / "src", tmp_path / "out", "webdataset")
    assert cv.read_dataset(tmp_path / "out") == {
        "media/000000000": {"audio.wav": wav, "image.png": PNG, "label": b"0"},
        "media/000000001": {"audio.flac": b"fLaC\x00\x00", "label": b"1"},
        "media/000000002": {"audio.mp3": b"ID3\x03abc", "image.jpg": JPEG, "label": b"1"},
    }
    manifest = json.loads((tmp_path / "out" / "fastload.json").read_text())
    assert manifest["metadata"]["classes"] == ["a", "b"]


def test_media_path_without_bytes_is_an_item_error(tmp_path: Path) -> None:
    media = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema(
        [("image", media)],
        metadata={"huggingface": json.dumps({"info": {"features": {"image": {"_type": "Image"}}}})},
    )
    table = pa.table(
        {"image": [{"bytes": PNG, "path": None}, {"bytes": None, "path": "/elsewhere/x.png"}]},
        schema=schema,
    )
    (tmp_path / "src").mkdir()
    _write_ipc(tmp_path / "src" / "m.arrow", table, "stream")
    with pytest.raises(ConversionError, match=r"m\.arrow:row 1.*only a path"):
        _convert(tmp_path / "src", tmp_path / "out", "webdataset")
    result = _convert(tmp_path / "src", tmp_path / "skip", "webdataset", on_error="skip")
    assert [s.item for s in result.skipped] == ["m.arrow:row 1"]
    assert result.num_samples == 1


@pytest.mark.parametrize("kind", ["file", "stream"])
def test_truncated_arrow_file_names_the_file(tmp_path: Path, kind: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    _write_ipc(src / "a.arrow", _table(), kind)
    _write_ipc(src / "b.arrow", _table(), kind)
    data = (src / "b.arrow").read_bytes()
    (src / "b.arrow").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConversionError, match=r"b\.arrow.*not a valid Arrow IPC file"):
        _convert(src, tmp_path / "out", "webdataset")
    result = _convert(src, tmp_path / "skip", "webdataset", on_error="skip")
    assert result.num_samples >= 5  # a.arrow whole; b.arrow's readable batches, if any
    assert any(s.item == "b.arrow" for s in result.skipped)


@pytest.mark.filterwarnings("ignore:Feather V1:DeprecationWarning")
def test_feather_v1_refused(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    feather.write_feather(
        _table().drop_columns(["jpg"]), str(tmp_path / "src" / "old.feather"), version=1
    )
    with pytest.raises(ConversionError, match=r"old\.feather.*Feather version 1"):
        _convert(tmp_path / "src", tmp_path / "out", "webdataset")


def test_arrow_from_an_object_store(tmp_path: Path, cv: Any) -> None:
    """Through a store that is not a local directory (read through the store, not mapped)."""
    from fastload.storage import open_store

    store = open_store("memory://arrow-src")
    for kind in ("file", "stream"):
        _write_ipc(tmp_path / f"{kind}.arrow", _table(), kind)
        store.put(f"{kind}.arrow", (tmp_path / f"{kind}.arrow").read_bytes())
    _convert("memory://arrow-src", tmp_path / "out", "webdataset")
    assert cv.read_dataset(tmp_path / "out") == {
        f"{s}/{k}": v for s in ("file", "stream") for k, v in _TABLE_SAMPLES.items()
    }
