"""Parsed TFRecord and WebDataset indexes kept as files that every process maps
(``fastload/formats/_index_files.py``): parsed once per machine, read-only shared memory without a
file descriptor, ignored when damaged, truncated or stale, bounded in size, off on request, and a
directory that cannot be written changes nothing but speed."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fastload.formats import _index_cache, _index_files, get_format
from fastload.formats.tfrecord import TFRecordReader
from fastload.formats.webdataset import WebDatasetReader
from fastload.storage import LocalStore

READERS = {"webdataset": WebDatasetReader, "tfrecord": TFRecordReader}
EXT = {"webdataset": "tar", "tfrecord": "tfrecord"}
N = 500


@pytest.fixture(params=sorted(READERS))
def fmt(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    where = tmp_path / "index-files"
    monkeypatch.setenv("FASTLOAD_INDEX_DIR", str(where))
    _index_cache.clear()
    yield where
    _index_cache.clear()


def _write(root: Path, fmt: str, name: str = "s", n: int = N) -> str:
    """A shard of ``n`` samples with its index, both modified 10 s ago (settled)."""
    store = LocalStore(str(root))
    key = f"{name}.{EXT[fmt]}"
    writer = get_format(fmt).writer(store, key)
    for i in range(n):
        writer.write({"__key__": f"k/{i:05d}", "txt": f"{i:016d}".encode()})
    writer.close()
    for path in (root / key, root / f"{key}.idx"):
        old = path.stat().st_mtime - 10
        os.utime(path, (old, old))
    return key


def _read_all(root: Path, fmt: str, key: str) -> list[bytes]:
    reader = READERS[fmt](LocalStore(str(root)), key)
    try:
        return [reader.read(i)["txt"] for i in range(len(reader))]
    finally:
        reader.close()


EXPECTED = [f"{i:016d}".encode() for i in range(N)]


def _entries(where: Path) -> list[Path]:
    return sorted(p for p in where.glob("*.fidx") if not p.name.startswith(".tmp-"))


def test_an_index_is_parsed_once_then_mapped(tmp_path: Path, fmt: str, files: Path) -> None:
    key = _write(tmp_path, fmt)
    before = _index_cache.parse_count()
    assert _read_all(tmp_path, fmt, key) == EXPECTED
    assert _index_cache.parse_count() - before == 1
    assert len(_entries(files)) == 1
    _index_cache.clear()  # a new process would start here
    assert _read_all(tmp_path, fmt, key) == EXPECTED
    assert _index_cache.parse_count() - before == 1  # mapped, not parsed
    ((_, entry),) = _index_cache._TABLE.items()
    arrays = [v for v in vars(entry.value).values() if isinstance(v, np.ndarray)]
    assert arrays
    assert all(not a.flags.writeable for a in arrays)  # the file's pages, read-only


def test_another_process_maps_what_one_parsed(tmp_path: Path, fmt: str, files: Path) -> None:
    key = _write(tmp_path, fmt)
    assert _read_all(tmp_path, fmt, key) == EXPECTED
    code = (
        "import sys\n"
        "from fastload.formats import _index_cache\n"
        "from fastload.formats.tfrecord import TFRecordReader\n"
        "from fastload.formats.webdataset import WebDatasetReader\n"
        "from fastload.storage import LocalStore\n"
        "cls = {'tfrecord': TFRecordReader, 'webdataset': WebDatasetReader}[sys.argv[1]]\n"
        "r = cls(LocalStore(sys.argv[2]), sys.argv[3])\n"
        "print(len(r), r.read(7)['txt'].decode(), _index_cache.parse_count())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, fmt, str(tmp_path), key],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "FASTLOAD_INDEX_DIR": str(files)},
    ).stdout.split()
    assert out == [str(N), f"{7:016d}", "0"]


def test_mapped_indexes_hold_no_file_descriptor(tmp_path: Path, fmt: str, files: Path) -> None:
    keys = [_write(tmp_path, fmt, f"s{j}", 50) for j in range(20)]
    store = LocalStore(str(tmp_path))
    for key in keys:  # parse and write
        READERS[fmt](store, key).close()
    _index_cache.clear()
    fds = len(os.listdir("/proc/self/fd"))
    for key in keys:  # map, kept in the process's table
        reader = READERS[fmt](store, key)
        assert len(reader) == 50
        reader.close()
    assert len(_index_cache._TABLE) == 20
    assert len(os.listdir("/proc/self/fd")) == fds


@pytest.mark.parametrize("damage", ["array byte", "header", "truncated", "empty", "other kind"])
def test_a_damaged_file_is_ignored_and_replaced(
    tmp_path: Path, fmt: str, files: Path, damage: str
) -> None:
    key = _write(tmp_path, fmt)
    assert _read_all(tmp_path, fmt, key) == EXPECTED
    (entry,) = _entries(files)
    raw = bytearray(entry.read_bytes())
    if damage == "array byte":
        raw[-40] ^= 0x01  # inside the last array
    elif damage == "header":
        raw[20] ^= 0x20
    elif damage == "truncated":
        raw = raw[: len(raw) // 2]
    elif damage == "empty":
        raw = bytearray()
    else:
        raw = raw.replace(f'"kind": "{fmt}"'.encode(), b'"kind": "zzzz"' + b" " * (len(fmt) - 4))
    entry.write_bytes(bytes(raw))
    _index_cache.clear()
    before = _index_cache.parse_count()
    assert _read_all(tmp_path, fmt, key) == EXPECTED
    assert _index_cache.parse_count() - before == 1  # parsed again, not read from the file
    _index_cache.clear()
    assert _read_all(tmp_path, fmt, key) == EXPECTED
    assert _index_cache.parse_count() - before == 1  # and the file written again, intact


def test_a_rewritten_shard_gets_a_new_file(tmp_path: Path, fmt: str, files: Path) -> None:
    key = _write(tmp_path, fmt)
    assert _read_all(tmp_path, fmt, key) == EXPECTED
    _write(tmp_path, fmt, n=N - 1)  # the same names, other contents (times set back too)
    _index_cache.clear()
    before = _index_cache.parse_count()
    assert _read_all(tmp_path, fmt, key) == EXPECTED[: N - 1]
    assert _index_cache.parse_count() - before == 1
    assert len(_entries(files)) == 2


def test_recent_files_are_not_kept(tmp_path: Path, fmt: str, files: Path) -> None:
    key = _write(tmp_path, fmt)
    os.utime(tmp_path / key)  # modified just now
    assert _read_all(tmp_path, fmt, key) == EXPECTED
    assert not files.exists() or not _entries(files)


def test_the_directory_is_bounded(
    tmp_path: Path, fmt: str, files: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = [_write(tmp_path, fmt, f"s{j}") for j in range(6)]
    _read_all(tmp_path, fmt, keys[0])
    one = max(_entries(files)[0].stat().st_size, 4096)  # a file counts at least one block
    monkeypatch.setenv("FASTLOAD_INDEX_CACHE_BYTES", str(3 * one + one // 2))
    for key in keys[1:]:
        _read_all(tmp_path, fmt, key)
        assert sum(p.stat().st_size for p in _entries(files)) <= 3 * one + one // 2
    assert 2 <= len(_entries(files)) <= 3


def test_off_or_unwritable_changes_nothing_but_speed(
    tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = _write(tmp_path, fmt)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for value in ("", str(blocker / "sub")):
        monkeypatch.setenv("FASTLOAD_INDEX_DIR", value)
        _index_cache.clear()
        before = _index_cache.parse_count()
        for _ in range(2):
            _index_cache.clear()
            assert _read_all(tmp_path, fmt, key) == EXPECTED
        assert _index_cache.parse_count() - before == 2
    assert _index_files.directory() == blocker / "sub"


def test_default_directory_is_the_user_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FASTLOAD_INDEX_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere")
    assert _index_files.directory() == Path("/somewhere/fastload/indexes")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert _index_files.directory() == Path.home() / ".cache" / "fastload" / "indexes"


def test_temporary_files_of_a_killed_writer_are_removed(
    tmp_path: Path, files: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files.mkdir(parents=True)
    stale, fresh = files / ".tmp-abc.fidx", files / ".tmp-def.fidx"
    for path in (stale, fresh):
        path.write_bytes(b"partial")
    old = stale.stat().st_mtime - 7200
    os.utime(stale, (old, old))
    monkeypatch.setattr(_index_files, "_unchecked", 1 << 62)  # the next write checks
    key = _write(tmp_path, "tfrecord")
    assert _read_all(tmp_path, "tfrecord", key) == EXPECTED
    assert not stale.exists()
    assert fresh.exists()  # another writer may still be writing it
