"""CachingStore: conformance as a wrapper, plus the cache's own guarantees."""

from __future__ import annotations

import fcntl
import io
import multiprocessing
import os
import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from fastload.errors import (
    InvalidArgumentError,
    ObjectNotFoundError,
    StoreError,
    TransientStoreError,
)
from fastload.storage import ByteRange, LocalStore, ObjectMeta, RetryStore, Store
from fastload.storage._base import DEFAULT_READ_CHUNK
from fastload.storage._cache import CachingStore, parse_size
from fastload.storage._streams import reader_version
from fastload.storage._wrapper import WrapperStore
from fastload.testing.store import StoreTests


class CountingStore(WrapperStore):
    """Counts downloads (a cache fill streams the object through ``open_reader``) in a file, so
    counts add up across processes."""

    def __init__(self, store: Store, counter: str) -> None:
        super().__init__(store)
        self.counter = counter

    def open_reader(self, key: str, *, chunk_size: int = DEFAULT_READ_CHUNK) -> io.BufferedIOBase:
        with open(self.counter, "a") as f:
            f.write(key + "\n")
        time.sleep(0.05)  # widen the window in which a second process could start a download
        return super().open_reader(key, chunk_size=chunk_size)


def downloads(counter: str) -> list[str]:
    try:
        return Path(counter).read_text().split()
    except FileNotFoundError:
        return []


class TestCachingStoreConformance(StoreTests):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return CachingStore(LocalStore(tmp_path / "remote"), tmp_path / "cache", "1GB")

    def read_only_view(self, store: Store) -> Store | None:
        assert isinstance(store, CachingStore)
        inner = store.inner
        assert isinstance(inner, LocalStore)
        return CachingStore(LocalStore(inner.root, read_only=True), store.cache_dir + "-ro", "1GB")


@pytest.fixture
def remote(tmp_path: Path) -> LocalStore:
    store = LocalStore(tmp_path / "remote")
    for i in range(6):
        store.put(f"shard-{i}.tar", bytes([i]) * 1000)
    return store


def test_second_read_is_a_hit(remote: LocalStore, tmp_path: Path) -> None:
    counter = str(tmp_path / "count")
    cache = CachingStore(CountingStore(remote, counter), tmp_path / "cache", 10_000)
    assert cache.get("shard-1.tar") == bytes([1]) * 1000
    assert cache.get("shard-1.tar", ByteRange(10, 20)) == bytes([1]) * 10
    assert cache.get_ranges("shard-1.tar", [ByteRange(0, 1), ByteRange(999, 1000)]) == [
        b"\x01",
        b"\x01",
    ]
    assert downloads(counter) == ["shard-1.tar"]
    assert cache.stats()["misses"] == 1
    assert cache.stats()["hits"] == 2
    assert cache.stats()["bytes_downloaded"] == 1000
    path = cache.local_path("shard-1.tar")
    assert path is not None
    assert Path(path).read_bytes() == bytes([1]) * 1000


def test_lru_eviction_keeps_budget(remote: LocalStore, tmp_path: Path) -> None:
    cache = CachingStore(remote, tmp_path / "cache", 3500)
    for i in range(3):
        cache.get(f"shard-{i}.tar")
        time.sleep(0.01)
    cache.local_path("shard-0.tar")  # a use: shard-0 is now the most recently used
    time.sleep(0.01)
    cache.get("shard-3.tar")  # needs room: evicts shard-1, the least recently used
    assert cache.cached_bytes() <= 3500
    assert cache.stats()["evictions"] == 1
    before = cache.stats()["misses"]
    cache.get("shard-0.tar")
    assert cache.stats()["misses"] == before  # still cached
    cache.get("shard-1.tar")
    assert cache.stats()["misses"] == before + 1  # was evicted


def test_a_use_leaves_the_cached_file_as_it_is(remote: LocalStore, tmp_path: Path) -> None:
    # Readers keep what they derive from a local file (a parsed index) while its stat is the
    # same: recording a use for the LRU order must not change it (ctime moves with any utime).
    cache = CachingStore(remote, tmp_path / "cache", 10_000)
    path = cache.local_path("shard-0.tar") or ""
    before = os.stat(path)
    time.sleep(0.02)
    for _ in range(3):
        assert cache.local_path("shard-0.tar") == path
        cache.get("shard-0.tar")
    after = os.stat(path)
    assert (after.st_mtime_ns, after.st_ctime_ns) == (before.st_mtime_ns, before.st_ctime_ns)
    assert os.stat(path + ".json").st_mtime_ns > before.st_mtime_ns  # the use was recorded


def test_object_over_budget_is_read_through(remote: LocalStore, tmp_path: Path) -> None:
    cache = CachingStore(remote, tmp_path / "cache", 500)
    assert cache.get("shard-2.tar", ByteRange(0, 3)) == b"\x02\x02\x02"
    assert cache.cached_bytes() == 0
    with pytest.raises(ObjectNotFoundError, match="larger than the cache budget"):
        cache.local_path("shard-2.tar")


def test_writes_through_the_cache_invalidate(remote: LocalStore, tmp_path: Path) -> None:
    cache = CachingStore(remote, tmp_path / "cache", 10_000)
    assert cache.get("shard-0.tar")[:1] == b"\x00"
    cache.put("shard-0.tar", b"new")
    assert cache.get("shard-0.tar") == b"new"
    with cache.open_writer("shard-0.tar") as w:
        w.write(b"newer")
    assert cache.get("shard-0.tar") == b"newer"
    cache.delete("shard-0.tar")
    with pytest.raises(ObjectNotFoundError):
        cache.get("shard-0.tar")


def test_revalidate_sees_changes_made_elsewhere(remote: LocalStore, tmp_path: Path) -> None:
    cache = CachingStore(remote, tmp_path / "cache", 10_000)
    cache.get("shard-4.tar")
    remote.put("shard-4.tar", b"changed behind the cache's back")
    fresh = CachingStore(remote, tmp_path / "cache", 10_000, revalidate=True)
    assert fresh.get("shard-4.tar") == b"changed behind the cache's back"


def test_stale_temp_files_are_cleaned(remote: LocalStore, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    CachingStore(remote, cache_dir, 10_000)
    # A fill by a process that no longer exists (pid far beyond pid_max) left a temp file.
    stale = cache_dir / "tmp" / "abcdef.999999999.xyz"
    stale.write_bytes(b"partial")
    mine = cache_dir / "tmp" / f"abcdef.{os.getpid()}.xyz"
    mine.write_bytes(b"in progress")
    CachingStore(remote, cache_dir, 10_000)
    assert not stale.exists()
    assert mine.exists()


def _worker_read(cache: CachingStore, keys: list[str]) -> list[int]:
    return [len(cache.get(k)) for k in keys]


def test_processes_share_the_cache_without_double_downloads(
    remote: LocalStore, tmp_path: Path
) -> None:
    counter = str(tmp_path / "count")
    cache = CachingStore(CountingStore(remote, counter), tmp_path / "cache", 100_000)
    keys = [f"shard-{i}.tar" for i in range(6)]
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(3) as pool:
        results = pool.starmap(_worker_read, [(cache, keys)] * 3, chunksize=1)
    assert results == [[1000] * 6] * 3
    assert sorted(downloads(counter)) == sorted(keys)  # each object downloaded exactly once


def test_sigkilled_fill_leaves_no_partial_object(remote: LocalStore, tmp_path: Path) -> None:
    big = remote
    big.put("big.bin", os.urandom(4 << 20))

    class SlowStore(WrapperStore):
        def open_reader(
            self, key: str, *, chunk_size: int = DEFAULT_READ_CHUNK
        ) -> io.BufferedIOBase:
            time.sleep(30)
            return super().open_reader(key, chunk_size=chunk_size)

    cache_dir = tmp_path / "cache"
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(
        target=_worker_read, args=(CachingStore(SlowStore(big), cache_dir, "1GB"), ["big.bin"])
    )
    proc.start()
    time.sleep(1.0)
    proc.kill()
    proc.join()
    cache = CachingStore(big, cache_dir, "1GB")  # the kill left the lock free and no object
    assert cache.get("big.bin") == big.get("big.bin")
    assert cache.stats()["misses"] == 1


def test_prefetch_fills_in_the_background(remote: LocalStore, tmp_path: Path) -> None:
    cache = CachingStore(remote, tmp_path / "cache", 100_000, prefetch_threads=2)
    cache.prefetch([f"shard-{i}.tar" for i in range(4)])
    cache.wait_prefetch(timeout=30)
    assert cache.stats()["prefetched"] == 4
    cache.get("shard-3.tar")
    assert cache.stats()["hits"] == 1
    assert cache.stats()["misses"] == 0
    cache.close()


def test_pickles_without_threads(remote: LocalStore, tmp_path: Path) -> None:
    cache = CachingStore(remote, tmp_path / "cache", "1MB")
    cache.prefetch(["shard-0.tar"])
    clone = pickle.loads(pickle.dumps(cache))
    assert clone.get("shard-0.tar") == bytes([0]) * 1000
    assert clone.cache_dir == cache.cache_dir
    cache.close()


@pytest.mark.parametrize(
    ("text", "expected"),
    [("256MB", 256_000_000), ("1GiB", 2**30), ("1.5 kB", 1500), (4096, 4096), ("12", 12)],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["-1", "12 parsecs", "MB", -5])
def test_parse_size_rejects(bad: str | int) -> None:
    with pytest.raises(InvalidArgumentError, match="size"):
        parse_size(bad)


class BudgetProbe(WrapperStore):
    """Records, whenever a fill starts downloading, the bytes the cache directory holds."""

    def __init__(self, store: Store, cache_dir: Path, log: str) -> None:
        super().__init__(store)
        self.probe_dir, self.log = cache_dir, log

    def open_reader(self, key: str, *, chunk_size: int = DEFAULT_READ_CHUNK) -> io.BufferedIOBase:
        held = 0
        # Under the cache's eviction lock, so no eviction + reservation happens mid-scan (a fill
        # finishing mid-scan can only make this undercount).
        lock = open(self.probe_dir / "evict.lock", "a")  # noqa: SIM115
        fcntl.flock(lock, fcntl.LOCK_EX)
        for sub in ("objects", "tmp"):
            for p in (self.probe_dir / sub).rglob("*"):
                if ".json" in p.name:  # metadata files (and their temporaries) are not budgeted
                    continue
                try:
                    if p.is_file():
                        held += p.stat().st_size
                except FileNotFoundError:  # renamed while we looked
                    pass
        lock.close()
        with open(self.log, "a") as f:
            f.write(f"{held}\n")
        time.sleep(0.05)  # keep fills overlapping
        return super().open_reader(key, chunk_size=chunk_size)


def test_concurrent_fills_keep_the_budget(remote: LocalStore, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    log = str(tmp_path / "held")
    budget = 3_500  # three of the 1000-byte objects
    cache = CachingStore(BudgetProbe(remote, cache_dir, log), cache_dir, budget)
    keys = [f"shard-{i}.tar" for i in range(6)]
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(3) as pool:
        results = pool.starmap(
            _worker_read, [(cache, keys), (cache, keys[::-1]), (cache, keys[2:] + keys[:2])]
        )
    assert results == [[1000] * 6] * 3
    held = [int(x) for x in Path(log).read_text().split()]
    assert held  # fills happened
    assert max(held) <= budget  # in-flight fills are reserved at full size and counted
    assert cache.cached_bytes() <= budget


def test_a_fill_streams_one_version_and_copies_again_after_a_change(
    remote: LocalStore, tmp_path: Path
) -> None:
    opened: list[str | None] = []

    class ReplacedBeforeOpen(WrapperStore):
        """Replaces the object once, after the fill's head and before its read."""

        def open_reader(
            self, key: str, *, chunk_size: int = DEFAULT_READ_CHUNK
        ) -> io.BufferedIOBase:
            if not opened:
                remote.put(key, b"\x07" * 900)
            reader = super().open_reader(key, chunk_size=chunk_size)
            opened.append(reader_version(reader))
            return reader

    cache = CachingStore(ReplacedBeforeOpen(remote), tmp_path / "cache", 100_000)
    assert cache.get("shard-2.tar") == b"\x07" * 900  # the new version, read whole
    new_meta = remote.head("shard-2.tar")
    # The first read named a version other than the head's: copied again after a new head.
    assert opened == [new_meta.etag, new_meta.etag]
    assert cache.head("shard-2.tar") == new_meta
    assert cache.stats()["bytes_downloaded"] == 900
    assert cache.stats()["requests"] == 4  # head, read, head, read: no head after a read


def test_a_reader_without_versions_is_checked_by_a_second_head(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastload.storage import MemoryStore, _cache_fill

    monkeypatch.setattr(_cache_fill, "FILL_BUFFER", 100_000)  # read in several ranged gets
    remote = MemoryStore(f"cache-fill-{tmp_path.name}")
    remote.put("obj", b"\x01" * 300_000)
    ranges: list[ByteRange | None] = []

    class Rewriting(WrapperStore):
        """Replaces the object once, between the second and third ranged get of a fill."""

        def get(self, key: str, byte_range: ByteRange | None = None) -> bytes:
            ranges.append(byte_range)
            data = super().get(key, byte_range)
            if len(ranges) == 2:
                remote.put(key, b"\x07" * 300_000)
            return data

        def open_reader(
            self, key: str, *, chunk_size: int = DEFAULT_READ_CHUNK
        ) -> io.BufferedIOBase:
            reader = Store.open_reader(self, key, chunk_size=1000)  # ranged gets through get()
            assert reader_version(reader) is None
            return reader

    cache = CachingStore(Rewriting(remote), tmp_path / "cache", 1_000_000)
    assert cache.get("obj") == b"\x07" * 300_000  # the new version, never a mix
    assert ranges[:3] == [
        ByteRange(0, 100_000),
        ByteRange(100_000, 200_000),
        ByteRange(200_000, 300_000),
    ]
    assert len(ranges) == 6  # copied again after the second head saw the change
    assert cache.stats()["bytes_downloaded"] == 300_000
    assert cache.head("obj") == remote.head("obj")


def test_an_object_rewritten_during_every_fill_is_refused_by_name(
    remote: LocalStore, tmp_path: Path
) -> None:
    class AlwaysReplaced(WrapperStore):
        def open_reader(
            self, key: str, *, chunk_size: int = DEFAULT_READ_CHUNK
        ) -> io.BufferedIOBase:
            remote.put(key, os.urandom(int.from_bytes(os.urandom(2)) % 500 + 1001))
            return super().open_reader(key, chunk_size=chunk_size)

    cache = CachingStore(AlwaysReplaced(remote), tmp_path / "cache", 100_000)
    with pytest.raises(StoreError, match=r"shard-3\.tar.*changed during each of 3 downloads"):
        cache.get("shard-3.tar")
    assert cache.cached_bytes() == 0
    assert os.listdir(tmp_path / "cache" / "tmp") == []


class _Gate:
    """Set by a GatedStore reader when it is halfway through its object (``halfway``); the
    reader waits for ``release`` before going on."""

    def __init__(self) -> None:
        self.halfway = threading.Event()
        self.release = threading.Event()


class GatedStore(WrapperStore):
    """Its readers stop halfway through an object until the gate opens; they fail there
    instead when ``fail`` is set."""

    def __init__(self, store: Store, gate: _Gate, fail: bool = False) -> None:
        super().__init__(store)
        self.gate, self.fail = gate, fail

    def open_reader(self, key: str, *, chunk_size: int = DEFAULT_READ_CHUNK) -> io.BufferedIOBase:
        data = self._store.get(key)
        gate, fail = self.gate, self.fail

        class Reader(io.RawIOBase):
            pos = 0

            def readable(self) -> bool:
                return True

            def readinto(self, out: Any) -> int:
                if self.pos == len(data) // 2:
                    gate.halfway.set()
                    gate.release.wait(30)
                    if fail:
                        raise TransientStoreError("connection dropped", url="mem://x")
                end = len(data) // 2 if self.pos < len(data) // 2 else len(data)
                n = min(len(out), end - self.pos)
                out[:n] = data[self.pos : self.pos + n]
                self.pos += n
                return n

        return io.BufferedReader(Reader())


def test_a_fill_in_progress_is_invisible_and_skipped_by_prefetch(
    remote: LocalStore, tmp_path: Path
) -> None:
    gate = _Gate()
    cache = CachingStore(GatedStore(remote, gate), tmp_path / "cache", 100_000)
    with ThreadPoolExecutor(1) as pool:
        filling = pool.submit(cache.get, "shard-4.tar")
        assert gate.halfway.wait(30)
        # Half the object is in the temporary file; nothing is visible under objects/.
        assert cache.cached_bytes() == 0
        assert len(os.listdir(tmp_path / "cache" / "tmp")) == 1
        view = CachingStore(remote, tmp_path / "cache", 100_000)  # another process's view
        assert view.cached_bytes() == 0
        # A prefetch of it returns at once (the fill is another thread's) and downloads nothing.
        cache.prefetch(["shard-4.tar"])
        cache.wait_prefetch(timeout=30)
        assert cache.stats()["prefetched"] == 0
        assert cache.stats()["downloads"] == 0
        gate.release.set()
        assert filling.result(30) == bytes([4]) * 1000
    assert cache.stats()["downloads"] == 1
    assert view.get("shard-4.tar") == bytes([4]) * 1000
    assert view.stats()["hits"] == 1
    cache.close()


def test_a_failed_fill_leaves_nothing_and_raises_the_stores_error(
    remote: LocalStore, tmp_path: Path
) -> None:
    gate = _Gate()
    gate.release.set()
    cache = CachingStore(GatedStore(remote, gate, fail=True), tmp_path / "cache", 100_000)
    with pytest.raises(TransientStoreError, match="connection dropped"):
        cache.get("shard-5.tar")
    assert cache.cached_bytes() == 0
    assert os.listdir(tmp_path / "cache" / "tmp") == []
    assert cache.stats()["downloads"] == 0
    ok = CachingStore(remote, tmp_path / "cache", 100_000)  # the next fill starts afresh
    assert ok.get("shard-5.tar") == bytes([5]) * 1000


class HeadCounter(WrapperStore):
    """Counts the heads that reach the wrapped store."""

    heads = 0

    def head(self, key: str) -> ObjectMeta:
        self.heads += 1
        return super().head(key)


def test_head_of_a_cached_object_is_answered_locally(remote: LocalStore, tmp_path: Path) -> None:
    inner = HeadCounter(remote)
    cache = CachingStore(inner, tmp_path / "cache", "1MB")
    remote_meta = remote.head("shard-1.tar")
    assert cache.head("shard-1.tar") == remote_meta  # not cached: asked of the store
    assert inner.heads == 1
    cache.get("shard-1.tar")  # the fill reuses the head just forwarded
    assert inner.heads == 1
    for _ in range(3):
        assert cache.head("shard-1.tar") == remote_meta  # size, mtime and etag from the cache
    assert inner.heads == 1
    cache.get("shard-3.tar")  # no head before it: the fill asks
    assert inner.heads == 2
    cache.invalidate("shard-1.tar")
    assert cache.head("shard-1.tar") == remote_meta
    assert inner.heads == 3
    assert cache.stats()["requests"] == 5  # three heads and two gets
    checking = CachingStore(inner, tmp_path / "cache", "1MB", revalidate=True)
    checking.get("shard-2.tar")
    before = inner.heads
    checking.head("shard-2.tar")
    assert inner.heads == before + 1  # revalidate: always the store's answer


def test_capabilities_of_a_cache_a_local_store_and_a_wrapper(
    remote: LocalStore, tmp_path: Path
) -> None:
    cache = CachingStore(remote, tmp_path / "cache", 10_000)
    assert cache.evicts_local_files
    assert cache.has_local_paths
    assert cache.uncached is remote
    assert not remote.evicts_local_files
    assert remote.uncached is remote
    retried = RetryStore(remote)  # a wrapper that caches nothing: both answers are its own
    assert not retried.evicts_local_files
    assert retried.uncached is retried
    # Where the objects are plain files under one directory: the local store's root, through
    # wrappers; never a cache's (its files are entries, not keys under a root).
    assert remote.local_root == remote.root
    assert retried.local_root == remote.root
    assert cache.local_root is None
    assert cache.uncached.local_root == remote.root
    # The node's cache: asked of the store (and through a wrapper), never of its class.
    assert cache.cache_dir == str(tmp_path / "cache")
    assert RetryStore(cache).cache_dir == cache.cache_dir
    assert remote.cache_dir is None
    assert retried.cache_dir is None
    assert remote.node_stats() == {}
    assert RetryStore(cache).node_stats(cached_bytes=False) == cache.node_stats(cached_bytes=False)
