"""Compressed WebDataset shards (``.tar.gz``/``.tgz``, ``.tar.bz2``, ``.tar.xz``) and compressed
TFRecords: read in order like the webdataset library, indexed as streaming shards, loaded
exactly once."""

from __future__ import annotations

import gzip
import io
import os
import random
import tarfile
from pathlib import Path
from typing import Any

import pytest
import webdataset as wds

import fastload
from fastload.convert import index_dataset, verify_dataset
from fastload.errors import CorruptDataError, FormatError, MissingIndexError
from fastload.formats import get_format, read_manifest
from fastload.formats.webdataset import WebDatasetReader, build_index
from fastload.formats.webdataset._compressed import compression_of
from fastload.storage import LocalStore, MemoryStore


def _members(prefix: str, n: int, payload: int = 0) -> list[tuple[str, bytes]]:
    """``(member name, data)`` of ``n`` samples with fields ``cls`` and ``bin``; ``payload``
    random bytes per ``bin`` (random: the compressed size grows with the data)."""
    rng = random.Random(prefix)
    out = []
    for i in range(n):
        out.append((f"{prefix}{i:04d}.cls", str(i).encode()))
        out.append((f"{prefix}{i:04d}.bin", rng.randbytes(payload) if payload else b"x" * i))
    return out


def _tar(members: list[tuple[str, bytes]], mode: str = "w") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode, format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _wds_samples(path: Path) -> list[tuple[str, dict[str, bytes]]]:
    """What the webdataset library reads from a shard: (key, fields)."""
    ds = wds.WebDataset([str(path)], shardshuffle=False, empty_check=False)
    return [(s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")}) for s in ds]


def _ours(store: Any, key: str, **kw: Any) -> list[tuple[str, dict[str, bytes]]]:
    with WebDatasetReader(store, key, **kw) as reader:
        return [
            (s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")}) for s in reader
        ]


@pytest.mark.parametrize(
    ("name", "mode"),
    [("s.tar.gz", "w:gz"), ("s.tgz", "w:gz"), ("s.tar.bz2", "w:bz2"), ("s.tar.xz", "w:xz")],
)
def test_compressed_shards_read_like_the_webdataset_library(
    tmp_path: Path, name: str, mode: str
) -> None:
    (tmp_path / name).write_bytes(_tar(_members("k", 12), mode))
    ref = _wds_samples(tmp_path / name)
    assert [k for k, _ in ref] == [f"k{i:04d}" for i in range(12)]
    assert _ours(LocalStore(str(tmp_path)), name) == ref


def test_webdataset_tarwriter_gz_output_streams_from_any_store(tmp_path: Path) -> None:
    path = tmp_path / "w-000000.tar.gz"
    with wds.TarWriter(str(path)) as writer:  # gzip because of the name, pax headers inside
        for i in range(6):
            writer.write({"__key__": f"s{i}", "cls": i, "txt": "t" * i})
    ref = _wds_samples(path)
    memory = MemoryStore("wds-compressed-any-store")
    memory.put("w.tar.gz", path.read_bytes())
    assert _ours(memory, "w.tar.gz") == ref
    assert [k for k, _ in ref] == [f"s{i}" for i in range(6)]


def test_compressed_shard_has_no_random_access_and_says_so() -> None:
    store = MemoryStore("wds-compressed-no-random")
    store.put("c.tar.gz", gzip.compress(_tar(_members("k", 5))))
    reader = WebDatasetReader(store, "c.tar.gz")
    assert reader.supports_random_access is False
    for call in (lambda: len(reader), lambda: reader.read(0)):
        with pytest.raises(MissingIndexError, match="gzip-compressed tar") as info:
            call()
        assert "fastload convert" in str(info.value)
        assert info.value.url == "memory://wds-compressed-no-random/c.tar.gz"
    assert [s["__key__"] for s in reader.iter_from(3)] == ["k0003", "k0004"]
    with pytest.raises(FormatError, match="gzip-compressed tar") as refused:
        build_index(store, "c.tar.gz")
    assert "fastload convert" in str(refused.value)


def test_compressed_shard_under_a_plain_name_is_still_read() -> None:
    store = MemoryStore("wds-compressed-plain-name")
    store.put("c.tar", gzip.compress(_tar(_members("k", 3))))
    assert [k for k, _ in _ours(store, "c.tar")] == ["k0000", "k0001", "k0002"]


def test_a_tar_whose_first_member_looks_like_bzip2_magic_stays_a_tar() -> None:
    data = _tar([("BZh91.cls", b"1")])
    assert compression_of(data[:512]) is None
    assert compression_of(gzip.compress(data)[:512]) == "gzip"


def _damaged_store(name: str, damage: Any) -> tuple[MemoryStore, list[str]]:
    members = _members("k", 40, payload=2000)  # ~2 KiB of random bytes per sample
    data = damage(gzip.compress(_tar(members)))
    store = MemoryStore(name)
    store.put("d.tar.gz", data)
    return store, [f"k{i:04d}" for i in range(40)]


def test_truncated_gzip_keeps_every_sample_before_the_cut() -> None:
    store, keys = _damaged_store("wds-gz-truncated", lambda d: d[: len(d) * 6 // 10])
    with WebDatasetReader(store, "d.tar.gz", on_error="skip") as reader:
        got = [s["__key__"] for s in reader]
        assert reader.skipped == 1
        assert "truncated" in reader.policy.errors[0]
    # About 60 % of the samples lie before the cut; the one open at the cut is dropped.
    assert got == keys[: len(got)]
    assert 20 <= len(got) <= 24
    with pytest.raises(CorruptDataError, match="gzip stream") as info:
        list(WebDatasetReader(store, "d.tar.gz"))
    assert info.value.url == "memory://wds-gz-truncated/d.tar.gz"
    assert "decompressed stream" in str(info.value)


def test_gzip_crc_mismatch_is_reported() -> None:
    def bad_crc(data: bytes) -> bytes:
        return data[:-8] + bytes(b ^ 0xFF for b in data[-8:-4]) + data[-4:]

    store, keys = _damaged_store("wds-gz-crc", bad_crc)
    with WebDatasetReader(store, "d.tar.gz", on_error="skip") as reader:
        got = [s["__key__"] for s in reader]
        assert reader.skipped == 1
        assert "CRC" in reader.policy.errors[0]
    assert got == keys[:39]  # the stream ends at the check: the last, open sample is dropped
    with pytest.raises(CorruptDataError, match="CRC"):
        list(WebDatasetReader(store, "d.tar.gz"))


def _compressed_dir(root: Path) -> list[str]:
    (root / "a-000000.tar.gz").write_bytes(gzip.compress(_tar(_members("a", 7))))
    (root / "a-000001.tgz").write_bytes(gzip.compress(_tar(_members("b", 5))))
    (root / "notes.txt.gz").write_bytes(gzip.compress(b"not a shard\n" * 50))
    return [f"a{i:04d}" for i in range(7)] + [f"b{i:04d}" for i in range(5)]


def test_index_lists_compressed_shards_and_the_loader_reads_them_exactly_once(
    tmp_path: Path,
) -> None:
    keys = _compressed_dir(tmp_path)
    result = index_dataset(str(tmp_path))
    assert result.format == "webdataset"
    assert result.unindexed == ["a-000000.tar.gz", "a-000001.tgz"]
    assert result.indexed == []
    assert result.ignored == ["notes.txt.gz"]
    assert any("fastload convert" in w and "compressed" in w for w in result.warnings)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".idx")]
    manifest = read_manifest(LocalStore(str(tmp_path)))
    assert [(e.name, e.num_samples, e.index) for e in manifest.shards] == [
        ("a-000000.tar.gz", 7, None),
        ("a-000001.tgz", 5, None),
    ]
    assert manifest.shards[0].num_bytes == (tmp_path / "a-000000.tar.gz").stat().st_size
    assert verify_dataset(str(tmp_path)).problems == []
    again = index_dataset(str(tmp_path))  # with the manifest: still no index, nothing rewritten
    assert again.unindexed == ["a-000000.tar.gz", "a-000001.tgz"]
    assert not again.manifest_written

    ds = fastload.open_dataset(str(tmp_path), fields=("__key__",))
    loader = fastload.DataLoader(ds, batch_size=3, num_workers=2)
    got = [k for (batch,) in loader for k in batch]
    assert sorted(got) == sorted(keys)
    assert len(got) == len(keys)


def test_index_lists_gzip_tfrecords_and_they_load_exactly_once(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    store = LocalStore(str(src))
    fmt = get_format("tfrecord")
    for n, name in enumerate(["t-000000", "t-000001"]):
        with fmt.writer(store, name + ".tfrecord", index=False) as writer:
            for i in range(4 + n):
                writer.write({"__key__": f"{name}-{i}", "cls": i})
        plain = src / f"{name}.tfrecord"
        (src / f"{name}.tfrecord.gz").write_bytes(gzip.compress(plain.read_bytes()))
        plain.unlink()
    expected = sorted([f"t-000000-{i}" for i in range(4)] + [f"t-000001-{i}" for i in range(5)])
    result = index_dataset(str(src))
    assert result.unindexed == ["t-000000.tfrecord.gz", "t-000001.tfrecord.gz"]
    assert not [p for p in os.listdir(src) if p.endswith(".idx")]
    ds = fastload.open_dataset(str(src), fields=("__key__", "cls"))
    got = sorted(
        k for keys, _ in fastload.DataLoader(ds, batch_size=4, num_workers=2) for k in keys
    )
    assert got == expected
    # and convert makes indexed shards of them
    fastload.convert(str(src), str(tmp_path / "dst"), format="tfrecord")
    ds = fastload.open_dataset(str(tmp_path / "dst"), fields=("__key__", "cls"))
    got = sorted(k for keys, _ in fastload.DataLoader(ds, batch_size=4) for k in keys)
    assert got == sorted([f"t-000000-{i}" for i in range(4)] + [f"t-000001-{i}" for i in range(5)])


def test_convert_of_a_folder_of_compressed_shards_reads_their_samples(tmp_path: Path) -> None:
    """It used to make a 1-sample dataset per file, with a field named `tgz`."""
    src = tmp_path / "src"
    src.mkdir()
    keys = _compressed_dir(src)
    (src / "notes.txt.gz").unlink()
    dst = tmp_path / "dst"
    result = fastload.convert(str(src), str(dst), quiet=True, workers=1)
    assert result.num_samples == len(keys)
    ds = fastload.open_dataset(str(dst), shuffle=False, fields=("__key__", "cls"))
    assert sorted(ds[i][0] for i in range(len(ds))) == sorted(keys)
