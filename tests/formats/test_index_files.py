"""Parsed TFRecord and WebDataset indexes kept as files that every process maps
(``fastload/formats/_cache/_files.py``): parsed once per machine, read-only shared memory without a
file descriptor, ignored when damaged, truncated or stale, bounded in size, off on request, and a
directory that cannot be written changes nothing but speed."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fastload.formats import _cache, get_format
from fastload.formats._cache import CacheConfig, _parsed
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
def files(tmp_path: Path, cache_config: Callable[..., CacheConfig]) -> Iterator[Path]:
    where = tmp_path / "index-files"
    cache_config(index_dir=where)
    _cache.clear()
    yield where
    _cache.clear()


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


def _table_items() -> list[tuple[object, Any]]:
    table = _parsed.PARSED.table
    return [(key, table.get(key)) for key in list(table)]


def _entries(where: Path) -> list[Path]:
    return sorted(p for p in where.glob("*.fidx") if not p.name.startswith(".tmp-"))


def test_an_index_is_parsed_once_then_mapped(tmp_path: Path, fmt: str, files: Path) -> None:
    key = _write(tmp_path, fmt)
    before = _cache.parse_count()
    assert _read_all(tmp_path, fmt, key) == EXPECTED
    assert _cache.parse_count() - before == 1
    assert len(_entries(files)) == 1
    _cache.clear()  # a new process would start here
    assert _read_all(tmp_path, fmt, key) == EXPECTED
    assert _cache.parse_count() - before == 1  # mapped, not parsed
    ((_, entry),) = _table_items()
    arrays = [v for v in vars(entry.value).values() if isinstance(v, np.ndarray)]
    assert arrays
    assert all(not a.flags.writeable for a in arrays)  # the file's pages, read-only


def test_another_process_maps_what_one_parsed(tmp_path: Path, fmt: str, files: Path) -> None:
    key = _write(tmp_path, fmt)
    assert _read_all(tmp_path, fmt, key) == EXPECTED
    code = (
        "import sys\n"
        "from fastload.formats import _cache\n"
        "from fastload.formats.tfrecord import TFRecordReader\n"
        "from fastload.formats.webdataset import WebDatasetReader\n"
        "from fastload.storage import LocalStore\n"
        "cls = {'tfrecord': TFRecordReader, 'webdataset': WebDatasetReader}[sys.argv[1]]\n"
        "r = cls(LocalStore(sys.argv[2]), sys.argv[3])\n"
        "print(len(r), r.read(7)['txt'].decode(), _cache.parse_count())\n"
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
    _cache.clear()
    fds = len(os.listdir("/proc/self/fd"))
    for key in keys:  # map, kept in the process's table
        reader = READERS[fmt](store, key)
        assert len(reader) == 50
        reader.close()
    assert len(_parsed.PARSED.table) == 20
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
    _cache.clear()
    before = _cache.parse_count()
    assert _read_all(tmp_path, fmt, key) == EXPECTED
    assert _cache.parse_count() - before == 1  # parsed again, not read from the file
    _cache.clear()
    assert _read_all(tmp_path, fmt, key) == EXPECTED
    assert _cache.parse_count() - before == 1  # and the file written again, intact


def test_a_rewritten_shard_gets_a_new_file(tmp_path: Path, fmt: str, files: Path) -> None:
    key = _write(tmp_path, fmt)
    assert _read_all(tmp_path, fmt, key) == EXPECTED
    _write(tmp_path, fmt, n=N - 1)  # the same names, other contents (times set back too)
    _cache.clear()
    before = _cache.parse_count()
    assert _read_all(tmp_path, fmt, key) == EXPECTED[: N - 1]
    assert _cache.parse_count() - before == 1
    assert len(_entries(files)) == 2


def test_recent_files_are_not_kept(tmp_path: Path, fmt: str, files: Path) -> None:
    key = _write(tmp_path, fmt)
    os.utime(tmp_path / key)  # modified just now
    assert _read_all(tmp_path, fmt, key) == EXPECTED
    assert not files.exists() or not _entries(files)


def test_the_directory_is_bounded(
    tmp_path: Path, fmt: str, files: Path, cache_config: Callable[..., CacheConfig]
) -> None:
    keys = [_write(tmp_path, fmt, f"s{j}") for j in range(6)]
    _read_all(tmp_path, fmt, keys[0])
    one = max(_entries(files)[0].stat().st_size, 4096)  # a file counts at least one block
    cache_config(index_dir_bytes=3 * one + one // 2)
    for key in keys[1:]:
        _read_all(tmp_path, fmt, key)
        assert sum(p.stat().st_size for p in _entries(files)) <= 3 * one + one // 2
    assert 2 <= len(_entries(files)) <= 3


def test_off_or_unwritable_changes_nothing_but_speed(
    tmp_path: Path, fmt: str, cache_config: Callable[..., CacheConfig]
) -> None:
    key = _write(tmp_path, fmt)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for value in (None, blocker / "sub"):
        cache_config(index_dir=value)
        _cache.clear()
        before = _cache.parse_count()
        for _ in range(2):
            _cache.clear()
            assert _read_all(tmp_path, fmt, key) == EXPECTED
        assert _cache.parse_count() - before == 2
    files = _cache.index_files()
    assert files is not None
    assert files.directory == blocker / "sub"


def test_default_directory_is_the_user_cache() -> None:
    from_environ = CacheConfig.from_environ
    assert from_environ({"XDG_CACHE_HOME": "/somewhere"}).index_dir == Path(
        "/somewhere/fastload/indexes"
    )
    assert from_environ({}).index_dir == Path.home() / ".cache" / "fastload" / "indexes"
    assert from_environ({"FASTLOAD_INDEX_DIR": ""}).index_dir is None  # off
    assert from_environ({"FASTLOAD_INDEX_DIR": "/x"}).index_dir == Path("/x")
    assert from_environ({}).index_dir_bytes == 4 << 30
    assert from_environ({"FASTLOAD_INDEX_CACHE_BYTES": "12345"}).index_dir_bytes == 12345
    assert from_environ({"FASTLOAD_INDEX_CACHE_BYTES": "lots"}).index_dir_bytes == 4 << 30


def test_settings_are_read_once_and_can_be_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = _cache.set_config(None)
    try:
        monkeypatch.setenv("FASTLOAD_INDEX_DIR", str(tmp_path / "a"))
        first = _cache.config()
        assert first.index_dir == tmp_path / "a"
        monkeypatch.setenv("FASTLOAD_INDEX_DIR", str(tmp_path / "b"))
        assert _cache.config() is first  # read once: a later change of the environment is unseen
        files = _cache.index_files()
        assert files is not None
        assert files.directory == tmp_path / "a"
        assert _cache.index_files() is files  # one object per settings
        with _cache.configured(index_dir=None, index_dir_bytes=7) as off:
            assert _cache.config() is off
            assert off.index_dir_bytes == 7
            assert _cache.index_files() is None
        assert _cache.config() is first
        assert _cache.set_config(None) is first
        assert _cache.config().index_dir == tmp_path / "b"  # read again
    finally:
        _cache.set_config(before)


def test_temporary_files_of_a_killed_writer_are_removed(tmp_path: Path, files: Path) -> None:
    files.mkdir(parents=True)
    stale, fresh = files / ".tmp-abc.fidx", files / ".tmp-def.fidx"
    for path in (stale, fresh):
        path.write_bytes(b"partial")
    old = stale.stat().st_mtime - 7200
    os.utime(stale, (old, old))
    index_files = _cache.index_files()
    assert index_files is not None
    index_files.unchecked = 1 << 62  # the next write checks
    key = _write(tmp_path, "tfrecord")
    assert _read_all(tmp_path, "tfrecord", key) == EXPECTED
    assert not stale.exists()
    assert fresh.exists()  # another writer may still be writing it
