"""Symbolic links and hard links in a source tree: every real directory and file once.

A loop (``cat/up -> ..``) is not followed, two links to one directory list it once, links out of
the root are followed and keyed by their path under the root, a file reached by two paths
(symbolic or hard links) is converted once and named in the skip report, a dangling link is an
item error; the same for every file-tree source, for ``fastload index`` on a tree, whatever order
``os.scandir`` gives, and across a worker killed mid-conversion and the resumed run.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fastload.convert.sources import open_source
from fastload.errors import ConversionError, WorkerError
from fastload.formats import read_manifest
from fastload.storage import open_store

fc = importlib.import_module("fastload.convert")
SkippedItem = fc.SkippedItem

CLI = [sys.executable, "-m", "fastload.cli"]

#: What every duplicate's reason ends with.
_ONCE = (
    "a file reached by several paths is converted once, under its own path in the source or else "
    "the first in sorted order"
)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)


def _cli_convert(src: Path, dst: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``fastload convert SRC DST --format webdataset`` (``--workers 1`` unless ``args`` say)."""
    workers = [] if "--workers" in args else ["--workers", "1"]
    return _cli("convert", str(src), str(dst), "--format", "webdataset", *workers, *args)


def _convert(src: Path, dst: Path, **kw: Any) -> Any:
    kw.setdefault("workers", 1)
    kw.setdefault("quiet", True)
    kw.setdefault("format", "webdataset")
    return fc.convert(src, dst, **kw)


def _skip_report(dst: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (dst / "_fastload_skipped.jsonl").read_text().splitlines()]


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _loop_folder(root: Path) -> Path:
    """The issue's tree: ``loop/cat/`` with 2 JPEGs and ``loop/cat/up -> ..``."""
    src = root / "loop"
    for i in range(2):
        _write(src / "cat" / f"img_{i:05d}.jpg", b"jpeg-%d" % i)
    (src / "cat" / "up").symlink_to("..")
    return src


_LOOP_REASON = (
    "symbolic link loop: cat/up -> .. leads back to the root directory, which contains it; not "
    "followed (what it holds is converted under its own path)"
)


def test_a_loop_is_reported_and_not_followed_cli(tmp_path: Path, cv: Any) -> None:
    src = _loop_folder(tmp_path)
    dst = tmp_path / "out"
    proc = _cli_convert(src, dst)
    assert proc.returncode == 3, proc.stderr  # completed, with items left out
    assert cv.read_dataset(dst) == {
        "cat/img_00000": {"jpg": b"jpeg-0", "cls": b"0"},
        "cat/img_00001": {"jpg": b"jpeg-1", "cls": b"0"},
    }
    assert _skip_report(dst) == [{"item": "cat/up", "reason": _LOOP_REASON, "shard": None}]
    assert (
        f"warning: file://{src} has 1 symbolic link loop, not followed: cat/up -> .." in proc.stderr
    )
    assert "converted 2 samples (source imagefolder, 1 class)" in proc.stderr
    assert "skipped 1 item" in proc.stderr


def test_a_loop_python_api(tmp_path: Path) -> None:
    src = _loop_folder(tmp_path)
    result = _convert(src, tmp_path / "out")
    assert result.num_samples == 2
    assert result.source_type == "imagefolder"
    assert result.num_classes == 1
    assert result.skipped == [SkippedItem("cat/up", _LOOP_REASON, None)]
    assert result.manifest is not None
    assert result.manifest.created_by["skipped"] == 1
    assert any("cat/up -> .." in w for w in result.warnings)


def test_a_loop_deeper_down_and_a_loop_of_links(tmp_path: Path, cv: Any) -> None:
    src = tmp_path / "src"
    _write(src / "a" / "b" / "x.txt", b"x")
    (src / "a" / "b" / "back").symlink_to("../../a")  # leads back to a/, which contains it
    (src / "a" / "self.txt").symlink_to("self.txt")  # a loop of links: cannot be followed
    result = _convert(src, tmp_path / "out", source_type="files", on_error="skip")
    assert cv.read_dataset(tmp_path / "out") == {"a/b/x": {"txt": b"x"}}
    assert result.skipped == [
        SkippedItem(
            "a/b/back",
            "symbolic link loop: a/b/back -> ../../a leads back to the directory 'a/', which "
            "contains it; not followed (what it holds is converted under its own path)",
        ),
        SkippedItem(
            "a/self.txt",
            "symbolic link a/self.txt -> self.txt cannot be followed: it is a loop of links",
        ),
    ]


def test_two_links_to_one_directory_outside_the_root(tmp_path: Path, cv: Any) -> None:
    shared = tmp_path / "elsewhere" / "felines"
    _write(shared / "1.jpg", b"one")
    _write(shared / "2.jpg", b"two")
    src = tmp_path / "src"
    _write(src / "dog" / "3.jpg", b"three")
    (src / "cat").symlink_to(shared)  # followed: keyed cat/...
    (src / "kitten").symlink_to(shared)  # the same directory again: not followed
    dst = tmp_path / "out"
    proc = _cli_convert(src, dst, "--workers", "2")
    assert proc.returncode == 3, proc.stderr
    assert cv.read_dataset(dst) == {
        "cat/1": {"jpg": b"one", "cls": b"0"},
        "cat/2": {"jpg": b"two", "cls": b"0"},
        "dog/3": {"jpg": b"three", "cls": b"1"},
    }
    assert read_manifest(open_store(dst)).metadata == {"classes": ["cat", "dog"]}
    assert _skip_report(dst) == [
        {
            "item": "kitten",
            "reason": "the same directory as 'cat/', reached first in sorted order (through the "
            f"symbolic link kitten -> {shared}); not followed: its files are listed once, under "
            "'cat/'",
            "shard": None,
        }
    ]
    assert "has 1 second path to a directory, not followed" in proc.stderr


def test_two_links_to_one_directory_inside_the_root(tmp_path: Path, cv: Any) -> None:
    src = tmp_path / "src"
    _write(src / "v2" / "a.txt", b"a")
    _write(src / "v2" / "b.txt", b"b")
    (src / "current").symlink_to("v2")  # sorts before v2: still v2 keeps its own path
    (src / "latest").symlink_to("v2")
    result = _convert(src, tmp_path / "out", source_type="files")
    assert cv.ordered_keys(tmp_path / "out") == ["v2/a", "v2/b"]
    reason = (
        "symbolic link {} -> v2 leads to the directory 'v2/' of the source; not followed: that "
        "directory is converted under its own path, once"
    )
    assert result.skipped == [
        SkippedItem("current", reason.format("current")),
        SkippedItem("latest", reason.format("latest")),
    ]


def test_links_to_a_file_a_directory_outside_the_root_and_a_hidden_one(
    tmp_path: Path, cv: Any
) -> None:
    ext = tmp_path / "mnt"
    _write(ext / "big" / "train" / "s0.jpg", b"s0")
    _write(ext / "big" / "train" / "s0.json", b'{"y": 0}')
    _write(ext / "photo.jpg", b"photo")
    src = tmp_path / "src"
    src.mkdir()
    (src / "train").symlink_to(ext / "big" / "train")
    (src / "extra.jpg").symlink_to(ext / "photo.jpg")
    _write(src / ".store" / "val" / "v.txt", b"v")  # hidden: listed only through the link
    (src / "val").symlink_to(".store/val")
    result = _convert(src, tmp_path / "out", source_type="files")
    assert result.source_type == "files"
    assert result.skipped == []
    assert cv.read_dataset(tmp_path / "out") == {
        "extra": {"jpg": b"photo"},
        "train/s0": {"jpg": b"s0", "json": b'{"y": 0}'},
        "val/v": {"txt": b"v"},
    }
    assert result.warnings == []


def _dangling_folder(root: Path) -> Path:
    src = root / "src"
    _write(src / "cat" / "a.jpg", b"a")
    (src / "cat" / "gone.jpg").symlink_to("missing.jpg")
    return src


_DANGLING = "dangling symbolic link cat/gone.jpg -> missing.jpg: its target does not exist"


def test_a_dangling_link_is_an_item_error(tmp_path: Path) -> None:
    src = _dangling_folder(tmp_path)
    dst = tmp_path / "out"
    proc = _cli_convert(src, dst)
    assert proc.returncode == 1
    assert f"cannot convert file://{src}/cat/gone.jpg: {_DANGLING}" in proc.stderr
    assert "--on-error skip" in proc.stderr
    assert not (dst / "fastload.json").exists()
    with pytest.raises(ConversionError, match=r"dangling symbolic link cat/gone\.jpg -> missing"):
        _convert(src, tmp_path / "out2")


def test_a_dangling_link_is_skipped_and_counted(tmp_path: Path, cv: Any) -> None:
    src = _dangling_folder(tmp_path)
    dst = tmp_path / "out"
    proc = _cli_convert(src, dst, "--on-error", "skip")
    assert proc.returncode == 3, proc.stderr
    assert cv.read_dataset(dst) == {"cat/a": {"jpg": b"a", "cls": b"0"}}
    assert _skip_report(dst) == [{"item": "cat/gone.jpg", "reason": _DANGLING, "shard": None}]
    assert "symbolic link that cannot be followed, left out: cat/gone.jpg -> missing.jpg" in (
        proc.stderr
    )
    result = _convert(src, tmp_path / "out2", on_error="skip")
    assert result.skipped == [SkippedItem("cat/gone.jpg", _DANGLING, None)]


def test_a_file_reached_twice_is_converted_once(tmp_path: Path, cv: Any) -> None:
    src = tmp_path / "src"
    _write(src / "cat" / "a.jpg", b"a")
    _write(src / "cat" / "z.jpg", b"z")
    (src / "cat" / "b.jpg").symlink_to("a.jpg")  # sorts after its target
    (src / "cat" / "0.jpg").symlink_to("z.jpg")  # sorts before it: z.jpg keeps its own path
    os.link(src / "cat" / "a.jpg", src / "cat" / "hard.jpg")  # a hard link: the same file
    dst = tmp_path / "out"
    proc = _cli_convert(src, dst)
    assert proc.returncode == 3, proc.stderr
    assert cv.read_dataset(dst) == {
        "cat/a": {"jpg": b"a", "cls": b"0"},
        "cat/z": {"jpg": b"z", "cls": b"0"},
    }
    assert _skip_report(dst) == [
        {
            "item": "cat/0.jpg",
            "reason": "duplicate: the same file as 'cat/z.jpg' (through the symbolic link "
            f"cat/0.jpg -> z.jpg); {_ONCE}",
            "shard": None,
            "duplicate_of": "cat/z.jpg",
        },
        {
            "item": "cat/b.jpg",
            "reason": "duplicate: the same file as 'cat/a.jpg' (through the symbolic link "
            f"cat/b.jpg -> a.jpg); {_ONCE}",
            "shard": None,
            "duplicate_of": "cat/a.jpg",
        },
        {
            "item": "cat/hard.jpg",
            "reason": "duplicate: the same file as 'cat/a.jpg' (a hard link: the same device and "
            f"inode); {_ONCE}",
            "shard": None,
            "duplicate_of": "cat/a.jpg",
        },
    ]
    assert (
        f"skipped 3 items (listed in file://{dst}/_fastload_skipped.jsonl), 3 duplicates of a "
        "file converted under another path (such as cat/0.jpg, the same file as cat/z.jpg)"
        in proc.stderr
    )
    assert "reaches 3 files by a second path" in proc.stderr
    # The same through the Python API, and a finished conversion re-run says the same.
    result = _convert(src, dst)
    assert result.unchanged
    assert [(s.item, s.duplicate_of) for s in result.skipped] == [
        ("cat/0.jpg", "cat/z.jpg"),
        ("cat/b.jpg", "cat/a.jpg"),
        ("cat/hard.jpg", "cat/a.jpg"),
    ]


def test_file_tree_samples_duplicated_whole_and_a_shared_sidecar(tmp_path: Path, cv: Any) -> None:
    src = tmp_path / "src"
    _write(src / "a" / "x.jpg", b"x")
    _write(src / "a" / "x.json", b'{"k": 1}')
    _write(src / "a" / "y.jpg", b"y")
    (src / "a" / "y.json").symlink_to("x.json")  # a sidecar shared by two samples: kept in both
    _write(src / "b" / "keep.txt", b"k")
    (src / "b" / "x.jpg").symlink_to("../a/x.jpg")  # the whole sample a/x again: a duplicate
    (src / "b" / "x.json").symlink_to("../a/x.json")
    _write(src / "z" / "w.png", b"w")  # a sample whose links sort before it: z/w is kept
    _write(src / "z" / "w.cls", b"3")
    (src / "0").mkdir()
    (src / "0" / "w.png").symlink_to("../z/w.png")
    (src / "0" / "w.cls").symlink_to("../z/w.cls")
    result = _convert(src, tmp_path / "out", source_type="files")
    assert cv.read_dataset(tmp_path / "out") == {
        "a/x": {"jpg": b"x", "json": b'{"k": 1}'},
        "a/y": {"jpg": b"y", "json": b'{"k": 1}'},
        "b/keep": {"txt": b"k"},
        "z/w": {"png": b"w", "cls": b"3"},
    }
    assert [(s.item, s.duplicate_of, s.shard) for s in result.skipped] == [
        ("0/w.cls", "z/w.cls", None),
        ("0/w.png", "z/w.png", None),
        ("b/x.jpg", "a/x.jpg", None),
        ("b/x.json", "a/x.json", None),
    ]
    assert result.skipped[2].reason == (
        f"duplicate: the same file as 'a/x.jpg' (through the symbolic link b/x.jpg -> ../a/x.jpg); "
        f"{_ONCE}"
    )


def test_record_sources_read_each_file_once(tmp_path: Path, cv: Any) -> None:
    src = tmp_path / "src"
    src.mkdir()
    cv.write_jsonl(src / "a.jsonl", [{"t": "one"}, {"t": "two"}])
    (src / "b.jsonl").symlink_to("a.jsonl")
    (src / "loop").symlink_to(".")
    result = _convert(src, tmp_path / "out")
    assert result.source_type == "jsonl"
    assert cv.ordered_keys(tmp_path / "out") == ["a/000000000", "a/000000001"]
    assert [(s.item, s.duplicate_of) for s in result.skipped] == [
        ("b.jsonl", "a.jsonl"),
        ("loop", None),
    ]


def test_the_plan_does_not_depend_on_scandir_order(
    tmp_path: Path, cv: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _mixed_tree(tmp_path)
    _convert(src, tmp_path / "ref", on_error="skip", shard_samples=2)
    reference = cv.tree_bytes(tmp_path / "ref")
    real_scandir = os.scandir

    class _Reversed:
        def __init__(self, path: Any) -> None:
            with real_scandir(path) as it:
                self.entries = sorted(it, key=lambda e: e.name, reverse=True)

        def __enter__(self) -> list[Any]:
            return self.entries

        def __exit__(self, *exc: object) -> None:
            return None

        def __iter__(self) -> Any:
            return iter(self.entries)

    monkeypatch.setattr(os, "scandir", _Reversed)
    _convert(src, tmp_path / "again", on_error="skip", shard_samples=2)
    assert cv.tree_bytes(tmp_path / "again") == reference
    assert len(_skip_report(tmp_path / "again")) == 4


def _mixed_tree(root: Path) -> Path:
    """An image folder with a loop, a repeated outside directory, a duplicate and a dangling link."""
    ext = root / "ext" / "birds"
    for i in range(3):
        _write(ext / f"b{i}.jpg", b"bird-%d" % i)
    src = root / "src"
    for c in ("cat", "dog"):
        for i in range(3):
            _write(src / c / f"{c}{i}.jpg", b"%s-%d" % (c.encode(), i))
    (src / "bird").symlink_to(ext)
    (src / "parrot").symlink_to(ext)
    (src / "cat" / "up").symlink_to("..")
    (src / "dog" / "again.jpg").symlink_to("../cat/cat0.jpg")
    (src / "dog" / "gone.jpg").symlink_to("nowhere.jpg")
    return src


def test_resumed_after_a_killed_worker_is_byte_identical(
    tmp_path: Path, cv: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _mixed_tree(tmp_path)
    hook, marker = cv.kill_hook(tmp_path, monkeypatch, "dog/dog1")
    options: dict[str, Any] = {"shard_samples": 2, "on_error": "skip", "map_fn": hook}
    ref = _convert(src, tmp_path / "ref", **options)
    reference = cv.tree_bytes(tmp_path / "ref")
    assert ref.num_samples == 9  # bird/ (3), cat/ (3), dog/ (3)
    assert cv.ordered_keys(tmp_path / "ref")[:3] == ["bird/b0", "bird/b1", "bird/b2"]
    assert [(s["item"], s.get("duplicate_of")) for s in _skip_report(tmp_path / "ref")] == [
        ("cat/up", None),
        ("dog/again.jpg", "cat/cat0.jpg"),
        ("dog/gone.jpg", None),
        ("parrot", None),
    ]

    marker.touch()
    dst = tmp_path / "dst"
    with pytest.raises(WorkerError, match="worker process died"):
        _convert(src, dst, **{**options, "workers": 2})
    assert not (dst / "fastload.json").exists()
    assert (dst / "_fastload_convert" / "plan.json").exists()  # the re-run resumes this plan
    marker.unlink()
    resumed = _convert(src, dst, **{**options, "workers": 2})
    assert resumed.num_samples == 9
    assert cv.tree_bytes(dst) == reference


def test_detection_and_the_listing_see_each_file_once(tmp_path: Path) -> None:
    src = _loop_folder(tmp_path)
    source = open_source(src)
    assert source.type_name == "imagefolder"
    assert [m.key for m in source.listing()] == ["cat/img_00000.jpg", "cat/img_00001.jpg"]
    tree = source.tree()
    assert tree is not None
    assert [(n.item, n.kind) for n in tree.notes] == [("cat/up", "loop")]


def _shard(path: Path, members: dict[str, bytes]) -> None:
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 0
            tar.addfile(info, io.BytesIO(data))
    _write(path, buf.getvalue())


def test_index_on_a_tree_lists_each_shard_once(tmp_path: Path) -> None:
    ext = tmp_path / "big" / "shards"
    _shard(ext / "part-1.tar", {"s2.txt": b"c", "s3.txt": b"d"})
    root = tmp_path / "ds"
    _shard(root / "part-0.tar", {"s0.txt": b"a", "s1.txt": b"b"})
    (root / "more").symlink_to(ext)
    (root / "zmore").symlink_to(ext)
    (root / "copy.tar").symlink_to("part-0.tar")
    (root / "up").symlink_to(".")
    (root / "gone.tar").symlink_to("nothing.tar")

    proc = _cli("index", str(root))
    assert proc.returncode == 0, proc.stderr
    manifest = read_manifest(open_store(root))
    assert [(s.name, s.num_samples) for s in manifest.shards] == [
        ("more/part-1.tar", 2),
        ("part-0.tar", 2),
    ]
    assert (ext / "part-1.tar.idx").exists()  # written where the link leads
    assert "copy.tar (the same file as part-0.tar)" in proc.stdout
    assert "1 symbolic link loop, not followed: up -> ." in proc.stdout
    assert "second path to a directory, not followed" in proc.stdout
    assert "cannot be followed, left out: gone.tar -> nothing.tar" in proc.stdout

    (root / "fastload.json").unlink()
    result = fc.index_dataset(root)
    assert result.duplicates == {"copy.tar": "part-0.tar"}
    assert [s.name for s in read_manifest(open_store(root)).shards] == [
        "more/part-1.tar",
        "part-0.tar",
    ]
    assert sum("symbolic link loop" in w for w in result.warnings) == 1
