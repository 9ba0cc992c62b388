"""Every source type converts to every format and reads back with the same keys and bytes."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds

from fastload.errors import InvalidArgumentError
from fastload.formats import read_manifest
from fastload.storage import open_store

# fastload.convert is also the function re-exported as fastload.convert once fastload/__init__.py
# exports it, which shadows the package attribute: take the module from sys.modules.
fc = importlib.import_module("fastload.convert")


def _convert(src: Path | str, dst: Path, fmt: str, **kw: Any) -> fc.ConvertResult:
    kw.setdefault("workers", 1)
    kw.setdefault("quiet", True)
    kw.setdefault("shard_samples", 5)
    return fc.convert(src, dst, format=fmt, **kw)


def test_image_folder(tmp_path: Path, fmt: str, cv: Any, image_folder: Any) -> None:
    root, expected = image_folder
    result = _convert(root, tmp_path / "out", fmt)
    assert cv.read_dataset(tmp_path / "out") == expected
    assert result.num_samples == len(expected) == 21
    assert result.num_shards == 5
    manifest = read_manifest(open_store(tmp_path / "out"))
    assert manifest.metadata == {"classes": ["class00", "class01", "class02"]}
    assert manifest.created_by["source"]["type"] == "imagefolder"
    assert set(manifest.schema) == {"cls", "jpg"}
    assert manifest.schema["jpg"] == {"type": "image", "count": 21}
    # Shards follow the sorted enumeration: class00's files first.
    assert cv.ordered_keys(tmp_path / "out") == sorted(expected)


def test_file_tree(tmp_path: Path, fmt: str, cv: Any) -> None:
    src = tmp_path / "tree"
    (src / "a" / "b").mkdir(parents=True)
    (src / "c").mkdir()
    files = {
        "a/b/x.jpg": b"jpeg-bytes",
        "a/b/x.json": b'{"caption": "x"}',
        "a/b/y.JPEG": b"other",
        "c/z.txt": "héllo".encode(),
        "c/z.cls": b"7",
        "top.v2.npy": b"\x93NUMPY",
        ".hidden/ignored.jpg": b"no",
    }
    for name, data in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    _convert(src, tmp_path / "out", fmt)
    assert cv.read_dataset(tmp_path / "out") == {
        "a/b/x": {"jpg": b"jpeg-bytes", "json": b'{"caption": "x"}'},
        "a/b/y": {"jpg": b"other"},
        "c/z": {"txt": "héllo".encode(), "cls": b"7"},
        "top_v2": {"npy": b"\x93NUMPY"},
    }


def test_jsonl(tmp_path: Path, fmt: str, cv: Any) -> None:
    src = tmp_path / "data"
    src.mkdir()
    cv.write_jsonl(
        src / "part-0.jsonl",
        [
            {"text": "hello", "label": 3, "score": 0.5, "tags": ["a", "b"], "none": None},
            "",
            {"__key__": "custom/key.1", "txt": "ünïcode", "ok": True},
        ],
    )
    cv.write_jsonl(src / "part-1.jsonl", [{"my field": "spaces", "n": -2}])
    result = _convert(src, tmp_path / "out", fmt)
    assert result.num_samples == 3
    assert cv.read_dataset(tmp_path / "out") == {
        "part-0/000000000": {
            "text": b"hello",
            "label": b"3",
            "score": b"0.5",
            "tags": b'["a","b"]',
        },
        "custom/key_1": {"txt": "ünïcode".encode(), "ok": b"true"},
        "part-1/000000000": {"my_field": b"spaces", "n": b"-2"},
    }


def test_text_single_file(tmp_path: Path, fmt: str, cv: Any) -> None:
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"first line\r\nsecond\n\n   \nlast without newline")
    _convert(path, tmp_path / "out", fmt)
    assert cv.read_dataset(tmp_path / "out") == {
        "corpus/000000000": {"txt": b"first line"},
        "corpus/000000001": {"txt": b"second"},
        "corpus/000000004": {"txt": b"last without newline"},
    }


def test_csv(tmp_path: Path, fmt: str, cv: Any) -> None:
    src = tmp_path / "csv"
    src.mkdir()
    (src / "a.csv").write_text('id,caption,label\n1,"a, quoted\nnewline",3\n2,,4\n')
    (src / "b.csv").write_text("id,caption,label\n3,plain,5\n")
    _convert(src, tmp_path / "out", fmt, shard_samples=2)
    assert cv.read_dataset(tmp_path / "out") == {
        "a/000000000": {"id": b"1", "caption": b"a, quoted\nnewline", "label": b"3"},
        "a/000000001": {"id": b"2", "label": b"4"},
        "b/000000000": {"id": b"3", "caption": b"plain", "label": b"5"},
    }


def test_parquet(tmp_path: Path, fmt: str, cv: Any) -> None:
    src = tmp_path / "pq"
    src.mkdir()
    table = pa.table(
        {
            "jpg": pa.array([b"\xff\xd8a", b"\xff\xd8b", b"", None], pa.binary()),
            "cls": pa.array([1, 2, 3, 4], pa.int64()),
            "caption": pa.array(["one", "two", None, "four"]),
            "score": pa.array([0.25, 1.0, 2.5, None]),
        }
    )
    pq.write_table(table, src / "train.parquet", row_group_size=3)
    result = _convert(src, tmp_path / "out", fmt, shard_samples=3, on_error="skip")
    assert cv.read_dataset(tmp_path / "out") == {
        "train/000000000": {"jpg": b"\xff\xd8a", "cls": b"1", "caption": b"one", "score": b"0.25"},
        "train/000000001": {"jpg": b"\xff\xd8b", "cls": b"2", "caption": b"two", "score": b"1.0"},
        "train/000000003": {"cls": b"4", "caption": b"four"},
    }
    # An empty image is an item error in every source, here a binary cell of 0 bytes.
    assert [(s.item, s.reason, s.shard) for s in result.skipped] == [
        (
            "train.parquet:row 2",
            "field 'jpg' is an empty image (0 bytes)",
            f"shard-000000.{result.shard_names[0].rsplit('.', 1)[-1]}",
        )
    ]


def _third_party_tars(
    directory: Path, n_shards: int = 2, per: int = 4
) -> dict[str, dict[str, bytes]]:
    directory.mkdir(parents=True, exist_ok=True)
    expected = {}
    for s in range(n_shards):
        with wds.TarWriter(str(directory / f"data-{s:03d}.tar")) as sink:
            for i in range(per):
                key = f"s{s}/sample{i:02d}"
                fields = {"png": bytes([s, i]) * 10, "cls": str(i).encode()}
                sink.write({"__key__": key, **fields})
                expected[key] = fields
    return expected


def test_third_party_webdataset_tars(tmp_path: Path, fmt: str, cv: Any) -> None:
    expected = _third_party_tars(tmp_path / "wds")
    assert fc.detect_source_type(open_store(tmp_path / "wds")) == "shards"
    _convert(tmp_path / "wds", tmp_path / "out", fmt, shard_samples=3)
    assert cv.read_dataset(tmp_path / "out") == expected


@pytest.mark.parametrize("target", ["fake", "webdataset", "tfrecord", "lmdb"])
def test_format_to_format(
    tmp_path: Path, fmt: str, target: str, cv: Any, image_folder: Any
) -> None:
    root, expected = image_folder
    _convert(root, tmp_path / "first", fmt)
    result = _convert(tmp_path / "first", tmp_path / "second", target, shard_samples=8)
    assert cv.read_dataset(tmp_path / "second") == expected
    manifest = read_manifest(open_store(tmp_path / "second"))
    assert manifest.metadata == {"classes": ["class00", "class01", "class02"]}  # carried over
    assert result.num_shards == 3


def test_map_hook_transforms_and_drops(tmp_path: Path, cv: Any, image_folder: Any) -> None:
    root, expected = image_folder
    mod = tmp_path / "hooks_for_convert_test.py"
    mod.write_text(
        "def keep_class0(sample):\n"
        "    if sample['cls'] != b'0':\n"
        "        return None\n"
        "    sample['txt'] = sample['__key__'].upper()\n"
        "    return sample\n"
    )
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        result = _convert(
            root, tmp_path / "out", "fake", map_fn="hooks_for_convert_test:keep_class0"
        )
    finally:
        sys.path.remove(str(tmp_path))
    got = cv.read_dataset(tmp_path / "out")
    want = {k: {**v, "txt": k.upper().encode()} for k, v in expected.items() if v["cls"] == b"0"}
    assert got == want
    assert result.dropped == 14
    assert result.manifest is not None
    assert result.manifest.created_by["options"]["map"] == "hooks_for_convert_test:keep_class0"


def test_memory_store_destination(cv: Any, image_folder: Any) -> None:
    root, expected = image_folder
    result = fc.convert(root, "memory://convert-test-dst", format="fake", workers=4, quiet=True)
    assert result.num_samples == len(expected)
    store = open_store("memory://convert-test-dst")
    assert store.exists("fastload.json")
    assert not store.list_keys("_fastload_convert")


def test_detection(tmp_path: Path) -> None:
    cases = {
        "img": ["a/1.jpg", "b/2.PNG"],
        "tree": ["a/1.jpg", "a/1.json"],
        "deeper": ["a/b/c/1.jpg"],
        "jl": ["x.jsonl", "y.ndjson"],
        "txt": ["x.txt"],
        "csv": ["x.csv"],
        "pq": ["x.parquet"],
        "shards": ["s-000000.tar", "s-000000.tar.idx"],
    }
    want = {
        "img": "imagefolder",
        "tree": "files",
        "deeper": "files",
        "jl": "jsonl",
        "txt": "text",
        "csv": "csv",
        "pq": "parquet",
        "shards": "shards",
    }
    for name, files in cases.items():
        for f in files:
            p = tmp_path / name / f
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(b"x")
        assert fc.detect_source_type(open_store(tmp_path / name)) == want[name], name
    # Images all two directories deep are image folders one level down: ambiguous, refused.
    (tmp_path / "deep" / "a" / "b").mkdir(parents=True)
    (tmp_path / "deep" / "a" / "b" / "1.jpg").write_bytes(b"x")
    with pytest.raises(InvalidArgumentError, match="1 image folder one level down"):
        fc.detect_source_type(open_store(tmp_path / "deep"))


def test_sanitizers() -> None:
    assert fc.sanitize_key("a.b/c.d.e") == "a.b/c_d_e"
    assert fc.sanitize_key("x\ny") == "x_y"
    assert fc.sanitize_field_name("my col/x") == "my_col_x"
    assert fc.sanitize_field_name("__weird") == "weird"
    assert fc.sanitize_field_name("...") == "field"


def test_parse_size() -> None:
    assert fc.parse_size("256MB") == 256_000_000
    assert fc.parse_size("1GiB") == 2**30
    assert fc.parse_size("1.5 kb") == 1500
    assert fc.parse_size("64M") == 64 * 2**20
    assert fc.parse_size(1234) == 1234
    for bad in ("", "12 parsecs", "-1MB", "0", True):
        with pytest.raises(ValueError, match="size"):
            fc.parse_size(bad)  # type: ignore[arg-type]


def test_json_value_encoding() -> None:
    from fastload.convert.sources import field_value_bytes

    assert field_value_bytes({"b": 1, "a": [1.5, None]}) == b'{"a":[1.5,null],"b":1}'
    assert field_value_bytes(False) == b"false"
    assert field_value_bytes(None) is None
    assert json.loads(field_value_bytes(2.0) or b"") == 2.0
