"""A cache whose filesystem is smaller than its byte budget (issue 33): the free space is a budget
too. On a real small filesystem (a tmpfs each test mounts), an epoch through the cache delivers
every sample once with the right bytes, evicting to make room and counting those evictions; an
object that cannot fit at all is read uncached with one warning; nothing partial is ever left.

The tmpfs needs root (the tests run as root here and in CI); elsewhere they skip, and fail under
``CI=true``.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import struct
import subprocess
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload.errors import CacheFullError
from fastload.storage import CacheSpaceWarning, CachingStore, LocalStore, ObjectMeta, Store
from fastload.storage._cache_counters import COUNTER_NAMES, NodeCounters
from fastload.storage._cache_dir import CacheDirectory
from fastload.testing import need

pytestmark = pytest.mark.timeout(180)

SAMPLES = 96
SAMPLE_BYTES = 4000
PER_SHARD = 8  # 12 shards of about 37 kB (tar headers and padding included)


def _mount_tmpfs(path: Path, kib: int) -> str | None:
    """Mount a tmpfs of ``kib`` KiB at ``path``; None if it worked, else why not."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root (run the tests as root, as CI does)"
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={kib}k,mode=0755", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        return f"mount -t tmpfs failed: {done.stderr.strip() or done.returncode}"
    return None


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """``small_fs(kib)``: the path of a new tmpfs of ``kib`` KiB, unmounted after the test."""
    mounted: list[Path] = []

    def make(kib: int) -> Path:
        path = tmp_path / f"fs{len(mounted)}"
        why = _mount_tmpfs(path, kib)
        need("a small filesystem (tmpfs) for the cache", why is None, why or "")
        mounted.append(path)
        return path

    yield make
    for path in mounted:
        # Lazy: this process keeps its cache counter file mapped for life.
        subprocess.run(["umount", "-l", str(path)], check=False)


def sample_bytes(key: str) -> bytes:
    """The content of sample ``key``: incompressible, different for every key."""
    return random.Random(hashlib.sha256(key.encode()).digest()).randbytes(SAMPLE_BYTES)


def sample_keys() -> list[str]:
    return [f"a/s{i:04d}" for i in range(SAMPLES)]


def write_corpus(root: Path) -> Path:
    """The source folder: one ``.bin`` file per sample (the ``files`` source)."""
    for key in sample_keys():
        path = root / f"{key}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(sample_bytes(key))
    return root


@pytest.fixture(scope="module")
def local_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The corpus as a WebDataset of 12 shards (~450 kB) in a local directory (the "remote")."""
    base = tmp_path_factory.mktemp("disk-full")
    root = base / "ds"
    fastload.convert(
        write_corpus(base / "src"),
        root,
        format="webdataset",
        shard_samples=PER_SHARD,
        workers=1,
        quiet=True,
    )
    return root


def epoch(loader: fastload.DataLoader) -> dict[str, int]:
    """Run one epoch; return how often each key came, checking every sample's bytes."""
    seen: dict[str, int] = {}
    for keys, blobs in loader:
        for key, blob in zip(keys, blobs):
            assert bytes(blob) == sample_bytes(key), f"wrong bytes for {key}"
            seen[key] = seen.get(key, 0) + 1
    return seen


def assert_nothing_partial(cache_dir: Path, remote: Store) -> None:
    """No fill in progress is left, and every cached object is whole and described."""
    assert os.listdir(cache_dir / "tmp") == []
    disk = CacheDirectory(str(cache_dir), 1)
    for path in disk.object_files():
        entry = os.path.basename(path)
        meta = json_of(path + ".json")
        assert os.path.getsize(path) == meta["size"]
        assert Path(path).read_bytes() == remote.get(meta["key"]), entry
    leftovers = [
        name
        for _, _, names in os.walk(cache_dir / "objects")
        for name in names
        if name.endswith(".tmp")
    ]
    assert leftovers == []


def json_of(path: str) -> dict[str, Any]:
    import json

    with open(path, encoding="utf-8") as f:
        return dict(json.load(f))


def dataset_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.iterdir() if p.name != "fastload.json")


def run_small_disk_epoch(url: str | Path, cache_dir: Path, **options: Any) -> dict[str, int]:
    """Open the dataset with a 1 GB budget on ``cache_dir`` and run one epoch with 2 workers;
    check it is exact and return the loader's stats."""
    with pytest.warns(CacheSpaceWarning, match=r"budget \(cache_size\) of 1\.00 GB"):
        ds = fastload.open_dataset(
            url,
            cache_dir=cache_dir,
            cache_size="1GB",
            fields=("__key__", "bin"),
            seed=3,
            **options,
        )
    assert isinstance(ds.store, CachingStore)
    loader = fastload.DataLoader(ds, batch_size=8, num_workers=2)
    seen = epoch(loader)
    assert seen == dict.fromkeys(sample_keys(), 1)  # every sample exactly once
    return loader.stats()


def test_an_epoch_through_a_cache_on_a_disk_smaller_than_the_dataset(
    local_dataset: Path, small_fs: Callable[[int], Path]
) -> None:
    fs = small_fs(192)  # a third of the dataset; the budget says 1 GB
    assert os.statvfs(fs).f_blocks * os.statvfs(fs).f_frsize < dataset_bytes(local_dataset) / 2
    stats = run_small_disk_epoch(local_dataset, fs / "cache")
    # The disk filled before the budget did: objects were evicted to make room, and counted.
    assert stats["node_cache_disk_full_evictions"] > 0
    assert stats["node_cache_evictions"] >= stats["node_cache_disk_full_evictions"]
    assert stats["node_cache_downloads"] > 0
    assert_nothing_partial(fs / "cache", LocalStore(local_dataset))


@pytest.mark.ceph
def test_an_epoch_streamed_from_ceph_through_a_small_cache_disk(
    local_dataset: Path, small_fs: Callable[[int], Path], ceph_s3: Any, s3_bucket: str
) -> None:
    options = ceph_s3.store_options()
    url = f"s3://{s3_bucket}/ds"
    remote = fastload.open_store(url, **options)
    for path in sorted(local_dataset.iterdir()):
        remote.put(path.name, path.read_bytes())
    fs = small_fs(192)
    stats = run_small_disk_epoch(url, fs / "cache", store_options=options)
    assert stats["node_cache_disk_full_evictions"] > 0
    assert stats["node_cache_evictions"] >= stats["node_cache_disk_full_evictions"]
    assert_nothing_partial(fs / "cache", remote)


def test_an_epoch_whose_shards_are_larger_than_the_disk_reads_them_uncached(
    local_dataset: Path, small_fs: Callable[[int], Path]
) -> None:
    fs = small_fs(32)  # every shard is larger (about 37 kB)
    stats = run_small_disk_epoch(local_dataset, fs / "cache")
    shards = len([p for p in local_dataset.iterdir() if p.suffix == ".tar"])
    # Every shard was read uncached (once per worker that read it: at least once each).
    assert stats["node_cache_disk_full_uncached"] >= shards
    assert_nothing_partial(fs / "cache", LocalStore(local_dataset))


# ---- the cache itself ---------------------------------------------------------------------------


@pytest.fixture
def remote(tmp_path: Path) -> LocalStore:
    store = LocalStore(tmp_path / "remote")
    for i in range(8):
        store.put(f"obj-{i}", bytes([i]) * 20_000)
    store.put("big", os.urandom(200_000))
    return store


def quiet_cache(remote: Store, cache_dir: Path, budget: int | str = "1GB") -> CachingStore:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheSpaceWarning)
        return CachingStore(remote, cache_dir, budget, prefetch_threads=0)


def test_opening_a_budget_larger_than_the_free_space_warns_once_with_numbers(
    remote: LocalStore, small_fs: Callable[[int], Path]
) -> None:
    fs = small_fs(256)
    with pytest.warns(CacheSpaceWarning) as caught:
        CachingStore(remote, fs / "cache", "1GB")
    assert len(caught) == 1
    text = str(caught[0].message)
    assert str(fs / "cache") in text
    assert "1.00 GB" in text
    free = os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize
    assert f"{free / 1000:.0f}" in text or f"{free / 1000:.1f}" in text  # the free space in kB
    assert "cache_size" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheSpaceWarning)
        CachingStore(remote, fs / "cache", "1GB")  # once per process and directory
        CachingStore(remote, fs / "other", 100_000)  # within the free space: no warning


def test_a_full_disk_evicts_the_least_recently_used_and_counts_it(
    remote: LocalStore, small_fs: Callable[[int], Path]
) -> None:
    fs = small_fs(100)  # four 20 kB objects, with counters and descriptions
    cache = quiet_cache(remote, fs / "cache")
    for i in range(8):
        assert cache.get(f"obj-{i}") == bytes([i]) * 20_000
    stats = cache.stats()
    assert stats["downloads"] == 8
    assert stats["disk_full_evictions"] >= 4
    assert stats["evictions"] == stats["disk_full_evictions"]  # the budget never asked
    assert stats["disk_full_uncached"] == 0
    # The most recent objects are the ones kept.
    kept = {json_of(p + ".json")["key"] for p in cache._disk.object_files()}
    assert "obj-7" in kept
    assert "obj-0" not in kept
    assert cache.node_stats()["disk_full_evictions"] == stats["disk_full_evictions"]
    assert_nothing_partial(fs / "cache", remote)


def test_an_object_larger_than_the_disk_is_read_uncached_with_one_warning(
    remote: LocalStore, small_fs: Callable[[int], Path]
) -> None:
    fs = small_fs(64)
    cache = quiet_cache(remote, fs / "cache")
    cache.get("obj-1")
    with pytest.warns(CacheSpaceWarning, match="no room for .*big") as caught:
        assert cache.get("big") == remote.get("big")
    assert len(caught) == 1
    text = str(caught[0].message)
    for part in (str(fs / "cache"), "1.00 GB", "free", "cache_size", "uncached"):
        assert part in text, part
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheSpaceWarning)  # one warning per process
        with cache.open_reader("big") as f:
            assert f.read() == remote.get("big")
        assert cache.get_ranges("big", [fastload.storage.ByteRange(5, 9)]) == [
            remote.get("big")[5:9]
        ]
        with pytest.raises(CacheFullError) as raised:
            cache.local_path("big")  # a local copy cannot be made: the typed error
    exc = raised.value
    assert isinstance(exc, OSError)
    assert exc.errno == errno.ENOSPC
    assert exc.cache_dir == str(fs / "cache")
    assert exc.url.endswith("/big")
    assert "lower cache_size" in str(exc)
    stats = cache.stats()
    assert stats["disk_full_uncached"] == 1  # tried once, then read uncached without trying
    assert stats["bytes_read_through"] >= 200_000
    assert cache.get("obj-1") == bytes([1]) * 20_000  # what was cached is intact
    assert_nothing_partial(fs / "cache", remote)


def test_a_write_that_finds_no_room_evicts_and_retries(
    remote: LocalStore, small_fs: Callable[[int], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The free space lied (a quota, or another program filling the disk): the write itself
    hits ENOSPC, the fill evicts what it needs and copies again."""
    fs = small_fs(100)
    cache = quiet_cache(remote, fs / "cache")
    for i in range(3):
        cache.get(f"obj-{i}")
    monkeypatch.setattr(CacheDirectory, "free_bytes", lambda self: 10**12)
    for i in range(3, 8):
        assert cache.get(f"obj-{i}") == bytes([i]) * 20_000
    stats = cache.stats()
    assert stats["downloads"] == 8
    assert stats["disk_full_evictions"] > 0
    assert stats["disk_full_uncached"] == 0
    assert_nothing_partial(fs / "cache", remote)


def test_a_write_with_nothing_left_to_evict_reads_uncached_and_leaves_nothing(
    remote: LocalStore, small_fs: Callable[[int], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    fs = small_fs(64)
    cache = quiet_cache(remote, fs / "cache")
    monkeypatch.setattr(CacheDirectory, "free_bytes", lambda self: 10**12)
    with pytest.warns(CacheSpaceWarning, match="No space left on device"):
        assert cache.get("big") == remote.get("big")
    assert cache.stats()["disk_full_uncached"] == 1
    assert cache.cached_bytes() == 0
    assert_nothing_partial(fs / "cache", remote)


def test_a_spent_quota_evicts_once_then_reads_uncached_naming_the_quota(
    remote: LocalStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``EDQUOT`` (invisible to ``statvfs``): the fill evicts at least the object's size, copies
    once more, and when that finds no room either, the object is read uncached and the error
    carries ``EDQUOT``. (A stand-in: the quota is simulated at the write; no mount needed.)"""
    from fastload.storage import _cache_fill

    cache = quiet_cache(remote, tmp_path / "cache")
    for i in range(3):
        cache.get(f"obj-{i}")
    real = _cache_fill._download
    calls = []

    def over_quota(*args: Any) -> Any:
        calls.append(args[1])
        if args[1] == "obj-7":
            real(*args)  # written, then refused: the copy must not stay
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
        return real(*args)

    monkeypatch.setattr(_cache_fill, "_download", over_quota)
    with pytest.warns(CacheSpaceWarning, match="Disk quota exceeded.*raise your disk quota"):
        assert cache.get("obj-7") == bytes([7]) * 20_000
    assert calls.count("obj-7") == 2  # copied, evicted for it, copied again
    with pytest.raises(CacheFullError) as raised:
        cache.local_path("obj-7")
    assert raised.value.errno == errno.EDQUOT
    stats = cache.stats()
    assert stats["disk_full_evictions"] >= 1  # at least 20 kB of objects went for the retry
    assert stats["disk_full_uncached"] == 1
    assert_nothing_partial(tmp_path / "cache", remote)


def test_a_completely_full_disk_reads_uncached_and_never_kills_the_process(
    remote: LocalStore, small_fs: Callable[[int], Path]
) -> None:
    """Counters are kept in memory-mapped files: on a full disk they must fail to open (an
    OSError, counted only in this process), never fault (SIGBUS) at the first count."""
    fs = small_fs(64)
    cache = quiet_cache(remote, fs / "cache")
    fd = os.open(fs / "filler", os.O_WRONLY | os.O_CREAT)  # another program takes every byte
    try:
        with pytest.raises(OSError, match="No space left on device"):
            _write_until_full(fd)
    finally:
        os.close(fd)
    with pytest.warns(CacheSpaceWarning):
        assert cache.get("obj-2") == bytes([2]) * 20_000
    assert cache.stats()["disk_full_uncached"] == 1
    assert_nothing_partial(fs / "cache", remote)


def _write_until_full(fd: int) -> None:
    while True:
        os.write(fd, b"\0" * 4096)


def test_counter_files_of_the_previous_version_are_still_counted(tmp_path: Path) -> None:
    """A process of an older fastload left a ``.v1.cnt`` file (eight counters)."""
    counters = NodeCounters(str(tmp_path))
    counters.create()
    old = struct.pack("<8q", *range(1, 9))
    Path(counters.dir, "999999999.abc.v1.cnt").write_bytes(old)
    live = counters.open()
    live.add("disk_full_evictions", 5)
    totals = counters.totals()
    assert [totals[n] for n in COUNTER_NAMES[:8]] == list(range(1, 9))
    assert totals["disk_full_evictions"] == 5
    assert totals["disk_full_uncached"] == 0
    assert not Path(counters.dir, "999999999.abc.v1.cnt").exists()  # merged: its pid is gone


def test_reservation_reports_what_it_evicted(remote: LocalStore, tmp_path: Path) -> None:
    """Without a small disk: the byte budget's evictions are not counted as the disk's."""
    cache = quiet_cache(remote, tmp_path / "cache", 50_000)
    for i in range(5):
        cache.get(f"obj-{i}")
    stats = cache.stats()
    assert stats["evictions"] >= 3
    assert stats["disk_full_evictions"] == 0
    assert isinstance(cache.head("obj-4"), ObjectMeta)
