"""Reopening shards is cheap and bounded: an LMDB shard is opened and checked once per process,
and a WebDataset or TFRecord index parsed once per process and kept compact within a budget,
however many more shards an epoch reads than ``max_open_shards`` keeps open (issue 17, item 2); a
changed file is opened or parsed again, and damage is still found after a reopen."""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

import fastload as fl
from fastload.errors import CorruptDataError
from fastload.formats import ShardReader, _cache
from fastload.formats._cache import CacheConfig, EnvBudget, IndexBudget, _parsed
from fastload.formats.lmdb import _envs
from fastload.formats.lmdb._reader import LMDBReader
from fastload.formats.tfrecord._reader import TFRecordReader
from fastload.formats.webdataset.reader import WebDatasetReader
from fastload.loader._readers import DEFAULT_OPEN_SHARDS, default_capacity
from fastload.storage import CachingStore, LocalStore

SHARDS = 24
PER_SHARD = 8


def _age(root: Path, pattern: str = "*.lmdb") -> None:
    """Date the shards (and indexes) an hour back, so that their environments or parses may be
    kept (``STABLE_AGE_NS``)."""
    old = time.time() - 3600
    for path in root.glob(pattern):
        os.utime(path, (old, old))


def _lmdb_fds() -> int:
    """Descriptors of this process open on LMDB shard files."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return sum(1 for link in links if link.endswith(".lmdb"))


@pytest.fixture
def closed_envs() -> Iterator[None]:
    """No environment open before or after the test (other tests' idle ones would count)."""
    _close_idle()
    yield
    _close_idle()


def _close_idle() -> None:
    _envs.ENVS.close_idle()


@pytest.fixture
def dataset_root(fake: SimpleNamespace, tmp_path: Path) -> Path:
    root = tmp_path / "ds"
    fake.build_format_dataset(str(root), [PER_SHARD] * SHARDS, "lmdb")
    _age(root)
    return root


@contextmanager
def _counting(cls: type[ShardReader]) -> Iterator[list[int]]:
    """Count the readers of ``cls`` made in the block (the one-element list's value)."""
    made = cls.__init__
    count = [0]

    def counted(self: ShardReader, *args: object, **kwargs: object) -> None:
        count[0] += 1
        made(self, *args, **kwargs)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cls, "__init__", counted)
        yield count


def _two_epochs(root: Path, cls: type[ShardReader], max_open_shards: int | None = 2) -> int:
    """Two shuffled epochs through an LRU of ``max_open_shards`` readers (default 2), each
    delivering every sample once; how many readers of ``cls`` were made."""
    ds = fl.open_dataset(
        str(root), fields=("__key__",), block_size=2, max_open_shards=max_open_shards
    )
    with _counting(cls) as readers:
        for epoch in range(2):
            loader = fl.DataLoader(ds, batch_size=4)
            loader.set_epoch(epoch)
            keys = [k for batch in loader for k in batch[0]]
            assert len(keys) == len(set(keys)) == SHARDS * PER_SHARD
    ds.close()
    return readers[0]


@pytest.mark.timeout(120)
def test_epoch_opens_each_shard_once_per_process(dataset_root: Path, closed_envs: None) -> None:
    """The shuffle reads from all 24 shards in every few batches, through an LRU of 2 readers:
    every reader is closed and made again many times, each file is opened and checked once."""
    before = _envs.open_count()
    readers = _two_epochs(dataset_root, LMDBReader)
    assert readers > 2 * SHARDS  # the LRU did close and remake readers
    assert _envs.open_count() - before == SHARDS


@pytest.mark.timeout(120)
def test_open_files_stay_within_the_budget(
    dataset_root: Path, closed_envs: None, cache_config: Callable[..., CacheConfig]
) -> None:
    """With a budget of 4 environments the process never holds more than 4 shards' descriptors
    (2 each) beyond the readers' own 2, and opens shards again once they were trimmed."""
    cache_config(envs=EnvBudget(environments=4, mapped_bytes=1 << 40))
    ds = fl.open_dataset(str(dataset_root), fields=("__key__",), block_size=2, max_open_shards=2)
    before, peak = _envs.open_count(), 0
    for batch in fl.DataLoader(ds, batch_size=4):
        assert batch
        peak = max(peak, _lmdb_fds())
        assert len(_envs.ENVS.open) <= 4
    assert 0 < peak <= 2 * 4
    assert _envs.open_count() - before > SHARDS  # trimmed environments are opened again
    ds.close()


@pytest.mark.timeout(60)
def test_mapped_bytes_budget_closes_idle_environments(
    dataset_root: Path, closed_envs: None, cache_config: Callable[..., CacheConfig]
) -> None:
    one = (dataset_root / "train-000000.lmdb").stat().st_size
    # Environments still in use elsewhere in this process (readers other tests have not closed
    # yet) count against the budget too; give this test three shards' worth on top of them.
    base = _envs.ENVS.mapped
    cache_config(envs=EnvBudget(environments=100, mapped_bytes=base + 3 * one))
    store = LocalStore(str(dataset_root))
    for s in range(6):
        reader = LMDBReader(store, f"train-{s:06d}.lmdb")
        assert len(reader) == PER_SHARD
        reader.close()
    assert len(_envs.ENVS.idle) == 3
    assert _envs.ENVS.mapped <= base + 3 * one


@pytest.mark.timeout(60)
def test_damage_after_close_is_found(dataset_root: Path, closed_envs: None) -> None:
    """An idle environment is not taken over once its file changed: the new bytes are checked."""
    path = dataset_root / "train-000003.lmdb"
    store = LocalStore(str(dataset_root))
    reader = LMDBReader(store, path.name)
    assert reader.read(0)["__key__"]
    reader.close()
    assert len(_envs.ENVS.idle) == 1
    stat = path.stat()
    with path.open("r+b") as f:  # both meta pages zeroed, in place: same inode, same size
        f.write(bytes(2 * 4096))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    for _ in range(2):  # a failed check is not kept either: the second open checks again
        with pytest.raises(CorruptDataError, match="damaged"):
            LMDBReader(store, path.name).read(0)
    assert all(entry.path != str(path) for entry in _envs.ENVS.open.values())


@pytest.mark.timeout(60)
def test_recently_written_file_is_checked_again(dataset_root: Path, closed_envs: None) -> None:
    """A file modified less than ``STABLE_AGE_NS`` before it was opened could change again
    without its timestamp moving: its idle environment is not taken over."""
    path = dataset_root / "train-000005.lmdb"
    os.utime(path)  # just now
    store = LocalStore(str(dataset_root))
    before = _envs.open_count()
    for _ in range(2):
        reader = LMDBReader(store, path.name)
        assert len(reader) == PER_SHARD
        reader.close()
    assert _envs.open_count() - before == 2


@pytest.mark.timeout(60)
def test_removed_file_is_not_held(dataset_root: Path, closed_envs: None, tmp_path: Path) -> None:
    """An idle environment of a file removed since (a cache's eviction) is closed at the next
    opening, so the process does not keep the removed file's disk space."""
    store = LocalStore(str(dataset_root))
    gone = dataset_root / "train-000001.lmdb"
    reader = LMDBReader(store, gone.name)
    assert len(reader) == PER_SHARD
    reader.close()
    gone.unlink()
    assert len(LMDBReader(store, "train-000002.lmdb")) == PER_SHARD
    assert all(entry.path != str(gone) for entry in _envs.ENVS.open.values())


FORMATS = ("webdataset", "tfrecord")
READERS = {"webdataset": WebDatasetReader, "tfrecord": TFRecordReader}
EXT = {"webdataset": "tar", "tfrecord": "tfrecord"}


@pytest.fixture
def empty_cache() -> Iterator[None]:
    _cache.clear()
    yield
    _cache.clear()


@pytest.fixture(params=FORMATS)
def fmt(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def indexed_root(fake: SimpleNamespace, tmp_path: Path, fmt: str) -> Path:
    root = tmp_path / "ds"
    fake.build_format_dataset(str(root), [PER_SHARD] * SHARDS, fmt)
    _age(root, "*")
    return root


def _shard(root: Path, fmt: str, s: int) -> Path:
    return root / f"train-{s:06d}.{EXT[fmt]}"


@pytest.mark.timeout(120)
def test_epoch_parses_each_index_once_per_process(
    indexed_root: Path, fmt: str, empty_cache: None
) -> None:
    before = _cache.parse_count()
    assert _two_epochs(indexed_root, READERS[fmt]) > 2 * SHARDS
    assert _cache.parse_count() - before == SHARDS


@pytest.mark.timeout(60)
@pytest.mark.parametrize("files", [True, False], ids=["index-files", "no-index-files"])
def test_budget_holds_and_trimmed_indexes_are_parsed_again(
    indexed_root: Path,
    fmt: str,
    empty_cache: None,
    cache_config: Callable[..., CacheConfig],
    tmp_path: Path,
    files: bool,
) -> None:
    """Without index files a trimmed index is parsed again; with them it is mapped again."""
    cache_config(index_dir=tmp_path / "index-files" if files else None)
    store = LocalStore(str(indexed_root))
    cache_config(parsed=IndexBudget(entries=3, nbytes=1 << 30))
    before = _cache.parse_count()
    for _ in range(2):
        for s in range(6):
            reader = READERS[fmt](store, _shard(indexed_root, fmt, s).name)
            assert len(reader) == PER_SHARD
            assert len(_parsed.PARSED.table) <= 3
            reader.close()
    # LRU of 3 over a cycle of 6: all missed, and parsed again unless kept as files
    assert _cache.parse_count() - before == (6 if files else 12)
    one = _cache.held_bytes() // 3
    cache_config(parsed=IndexBudget(100, 2 * one))
    reader = READERS[fmt](store, _shard(indexed_root, fmt, 7).name)
    assert len(reader) == PER_SHARD
    assert 0 < _cache.held_bytes() <= 2 * one


@pytest.mark.timeout(60)
def test_changed_index_is_parsed_again_and_damage_found(
    indexed_root: Path, fmt: str, empty_cache: None
) -> None:
    """A parse is reused only while both files are unchanged: a damaged index written after it
    (same size, newer time) is parsed again and refused."""
    store = LocalStore(str(indexed_root))
    shard = _shard(indexed_root, fmt, 3)
    index = Path(f"{shard}.idx")
    assert READERS[fmt](store, shard.name).read(0)["__key__"]
    before = _cache.parse_count()
    assert READERS[fmt](store, shard.name).read(1)["__key__"]
    assert _cache.parse_count() == before  # taken over
    data = bytearray(index.read_bytes())
    data[0:1] = b"X"  # "v1.2 ..." / "0 <size>": same size, no longer an index
    stat = index.stat()
    index.write_bytes(bytes(data))
    os.utime(index, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    for _ in range(2):  # a failed parse is not kept either
        with pytest.raises(CorruptDataError, match="index"):
            READERS[fmt](store, shard.name).read(0)
    assert _cache.parse_count() == before + 2


@pytest.mark.timeout(60)
def test_recently_written_files_are_parsed_again(
    indexed_root: Path, fmt: str, empty_cache: None
) -> None:
    """A file modified less than ``STABLE_AGE_NS`` before the parse could change again without
    its time moving: its parse is not kept."""
    store = LocalStore(str(indexed_root))
    shard = _shard(indexed_root, fmt, 5)
    os.utime(shard)  # just now
    before = _cache.parse_count()
    for _ in range(2):
        assert len(READERS[fmt](store, shard.name)) == PER_SHARD
    assert _cache.parse_count() - before == 2


@pytest.mark.timeout(120)
def test_default_keeps_every_local_shard_open(
    indexed_root: Path, fmt: str, empty_cache: None
) -> None:
    """With ``max_open_shards=None`` (default) a local dataset's readers all stay open: each
    shard's reader is made once per process over two epochs, never reopened."""
    assert _two_epochs(indexed_root, READERS[fmt], max_open_shards=None) == SHARDS


def test_default_capacity_is_bounded_by_the_descriptor_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = LocalStore(str(tmp_path))
    cached = CachingStore(LocalStore(str(tmp_path / "remote")), str(tmp_path / "cache"))
    limits = {"soft": 20_000}
    monkeypatch.setattr(resource, "getrlimit", lambda _which: (limits["soft"], 1 << 20))
    assert default_capacity(local, 1000) == 1000  # every shard
    assert default_capacity(local, 10**6) == 2500  # an eighth of the limit
    assert default_capacity(cached, 1000) == DEFAULT_OPEN_SHARDS
    limits["soft"] = 1024
    assert default_capacity(local, 1000) == 128
    limits["soft"] = 64
    assert default_capacity(local, 1000) == DEFAULT_OPEN_SHARDS  # never below 16
    limits["soft"] = resource.RLIM_INFINITY
    assert default_capacity(local, 10**6) == 4096
