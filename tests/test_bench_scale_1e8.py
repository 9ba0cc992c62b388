"""The ``bench_scale`` 10^8-sample series' pieces: the direct dataset builder and the ``/proc``
footprint of a process (the benchmark's figures are only as good as these)."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from benchmarks._scale_1e8 import build_sixteen, footprint
from fastload import open_dataset
from fastload.formats import read_manifest
from fastload.storage import open_store


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_build_sixteen_writes_every_sample_once_in_order(tmp_path: Path, fmt: str) -> None:
    root = build_sixteen(tmp_path / fmt, fmt, 250, 100, processes=2)
    manifest = read_manifest(open_store(str(root)))
    assert manifest.format == fmt
    assert [s.num_samples for s in manifest.shards] == [100, 100, 50]
    assert [s.name for s in manifest.shards] == [f"shard-{i:06d}.{fmt}" for i in range(3)]
    assert {name: f["count"] for name, f in manifest.schema.items()} == {"cls": 250, "txt": 250}
    ds = open_dataset(str(root))
    samples = [ds[i] for i in range(len(ds))]
    # the fields as ``fastload convert`` stores a JSONL record's int and str (undecoded bytes)
    assert [s["txt"] for s in samples] == [b"%016d" % i for i in range(250)]
    assert [s["cls"] for s in samples] == [b"%d" % (i % 10) for i in range(250)]
    assert [s["__key__"] for s in samples] == [f"s/{i:09d}" for i in range(250)]


def test_build_sixteen_reuses_a_complete_dataset(tmp_path: Path) -> None:
    root = build_sixteen(tmp_path / "d", "lmdb", 20, 10)
    stamp = (root / "shard-000000.lmdb").stat().st_mtime_ns
    assert build_sixteen(root, "lmdb", 20, 10) == root
    assert (root / "shard-000000.lmdb").stat().st_mtime_ns == stamp


def test_footprint_counts_the_dataset_files_this_process_holds(tmp_path: Path) -> None:
    root = build_sixteen(tmp_path / "d", "tfrecord", 30, 10)
    before = footprint(os.getpid(), str(root))
    assert (before["data_fds"], before["data_maps"], before["data_map_mb"]) == (0, 0, 0)
    size = (root / "shard-000000.tfrecord").stat().st_size
    with (
        open(root / "shard-000000.tfrecord", "rb") as f,
        mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m,
    ):
        assert m[:1]  # touch the first page
        held = footprint(os.getpid(), str(root))
    page = os.sysconf("SC_PAGE_SIZE")
    assert held["data_fds"] == before["data_fds"] + 2  # the file, and the map's duplicate
    assert held["fds"] == before["fds"] + 2
    assert held["data_maps"] == 1
    assert held["data_map_mb"] * 1e6 == pytest.approx(-(-size // page) * page)
    assert held["data_rss_mb"] * 1e6 == pytest.approx(page)
    assert held["anon_mb"] > 0
    assert held["rss_mb"] >= held["anon_mb"]
