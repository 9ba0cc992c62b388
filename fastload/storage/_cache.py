"""A local disk cache in front of any store: :class:`CachingStore`.

Whole objects (shards, indexes, manifests) are copied to a local directory on first read and served
from there afterwards, within a byte budget with least-recently-used eviction. It is built for the
usual training node: every DataLoader worker of every rank on the node opens the same cache
directory, and

* a fill is atomic: the object is downloaded into a temporary file and renamed into place, so a
  reader never sees a partial file;
* one object is downloaded once: fills take an exclusive ``flock`` on a per-object lock file, and
  whoever waits on it finds the finished file;
* a SIGKILLed process leaves nothing harmful: its ``flock`` locks are released by the kernel, and its
  temporary files are removed by the next process that opens the cache;
* eviction runs under a cache-wide lock and never removes a file another process is filling.
  Unlinking a file that a reader already has open is safe on POSIX (the reader keeps its data); a
  path returned by :meth:`CachingStore.local_path` should be opened right away.

Objects are assumed immutable while cached (datasets are written once). Writes and deletes made
through this wrapper invalidate the cached copy; with ``revalidate=True`` every first access in a
process also compares the remote etag and size with the cached copy's.

Counters (hits, misses, evictions, bytes downloaded) are per process: see :meth:`CachingStore.stats`.
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import hashlib
import io
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

from fastload._units import parse_size
from fastload.errors import (
    InvalidArgumentError,
    InvalidRangeError,
    ObjectNotFoundError,
    StoreError,
)
from fastload.storage._base import (
    DEFAULT_COALESCE_BYTES,
    DEFAULT_READ_CHUNK,
    ByteRange,
    ObjectMeta,
    ObjectWriter,
    Store,
    check_range,
    validate_key,
)
from fastload.storage._wrapper import WrapperStore

__all__ = ["CachingStore", "parse_size"]  # parse_size re-exported from fastload._units

#: Bytes per request when the cache copies an object in (memory per fill in progress).
FILL_CHUNK = 32 * 1024 * 1024
#: How long a fill waits for other fills in progress to free the budget before going over it.
ROOM_WAIT_S = 30.0

logger = logging.getLogger("fastload.storage")


class _CacheWriter(ObjectWriter):
    """Forwards to the wrapped store's writer and drops the cached copy on commit."""

    def __init__(self, cache: CachingStore, key: str, inner: ObjectWriter) -> None:
        super().__init__()
        self._cache, self._key, self._inner = cache, key, inner

    def _write(self, data: memoryview) -> None:
        self._inner.write(data)

    def _commit(self) -> None:
        self._inner.commit()
        self._cache.invalidate(self._key)

    def _abort(self) -> None:
        self._inner.abort()


class CachingStore(WrapperStore):
    """Serves reads of ``store`` from a local directory, filled on demand, within a byte budget.

    Args:
        store: The (usually remote) store to cache.
        cache_dir: Local directory for cached objects; shared safely by all processes on a node.
            Several caches of different stores may share one directory (entries are keyed by the
            store URL and key).
        max_bytes: Byte budget (int or ``"50GB"``); least recently used objects are evicted to
            stay within it. An object larger than the whole budget is read through, uncached.
        prefetch_threads: Threads per process that fill the cache ahead of use
            (:meth:`prefetch`).
        revalidate: On the first access in each process, compare the remote etag and size with
            the cached copy and refetch if they differ (one HEAD per object and process).

    Thread and process safety: all methods may be called concurrently from threads and from
    processes sharing ``cache_dir``.
    """

    def __init__(
        self,
        store: Store,
        cache_dir: str | os.PathLike[str],
        max_bytes: int | str = "10GB",
        *,
        prefetch_threads: int = 2,
        revalidate: bool = False,
    ) -> None:
        super().__init__(store)
        self._dir = os.path.abspath(os.fspath(cache_dir))
        self._max_bytes = parse_size(max_bytes, allow_zero=True)
        if prefetch_threads < 0:
            raise InvalidArgumentError(f"prefetch_threads must be >= 0, got {prefetch_threads}")
        self._prefetch_threads = prefetch_threads
        self._revalidate = revalidate
        self._init_process_state()
        os.makedirs(os.path.join(self._dir, "objects"), exist_ok=True)
        os.makedirs(os.path.join(self._dir, "locks"), exist_ok=True)
        os.makedirs(os.path.join(self._dir, "tmp"), exist_ok=True)
        self._clean_stale_temp_files()

    def _init_process_state(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[str, Future[None]] = {}
        self._validated: set[str] = set()
        self._counters = {
            "hits": 0,
            "misses": 0,
            "evictions": 0,
            "bytes_downloaded": 0,
            "bytes_read_through": 0,
            "prefetched": 0,
        }

    def __getstate__(self) -> dict[str, Any]:
        return {
            "store": self._store,
            "dir": self._dir,
            "max_bytes": self._max_bytes,
            "prefetch_threads": self._prefetch_threads,
            "revalidate": self._revalidate,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._store = state["store"]
        self._dir = state["dir"]
        self._max_bytes = state["max_bytes"]
        self._prefetch_threads = state["prefetch_threads"]
        self._revalidate = state["revalidate"]
        self._init_process_state()

    def _check_process(self) -> None:
        if self._pid != os.getpid():  # forked: threads and locks did not come along
            self._init_process_state()

    def __repr__(self) -> str:
        return (
            f"CachingStore({self._store!r}, cache_dir={self._dir!r}, max_bytes={self._max_bytes})"
        )

    @property
    def cache_dir(self) -> str:
        """The local cache directory."""
        return self._dir

    @property
    def has_local_paths(self) -> bool:  # type: ignore[override]
        return True

    # ---- layout ---------------------------------------------------------------------------------

    def _entry(self, key: str) -> str:
        digest = hashlib.sha256(f"{self._store.url}\x00{key}".encode()).hexdigest()
        return digest

    def _object_path(self, entry: str) -> str:
        return os.path.join(self._dir, "objects", entry[:2], entry)

    def _meta_path(self, entry: str) -> str:
        return self._object_path(entry) + ".json"

    def _lock_path(self, entry: str) -> str:
        return os.path.join(self._dir, "locks", entry + ".lock")

    @contextlib.contextmanager
    def _flock(self, path: str, exclusive: bool = True) -> Iterator[None]:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _clean_stale_temp_files(self) -> None:
        """Remove temporary files of fills whose process is gone (SIGKILL, crash)."""
        tmp = os.path.join(self._dir, "tmp")
        try:
            names = os.listdir(tmp)
        except FileNotFoundError:
            return
        for name in names:
            pid_text = name.split(".", 2)[1] if name.count(".") >= 2 else ""
            alive = False
            if pid_text.isdigit():
                try:
                    os.kill(int(pid_text), 0)
                    alive = True
                except ProcessLookupError:
                    alive = False
                except PermissionError:
                    alive = True
            if not alive:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(tmp, name))

    # ---- filling ------------------------------------------------------------------------------

    def _is_valid(self, key: str, entry: str, path: str) -> bool:
        if not os.path.exists(path):
            return False
        if not self._revalidate or key in self._validated:
            return True
        try:
            with open(self._meta_path(entry), encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, ValueError):
            return False
        remote = self._store.head(key)
        ok = bool(meta.get("size") == remote.size and meta.get("etag") == remote.etag)
        if ok:
            self._validated.add(key)
        return ok

    def _ensure(self, key: str, *, prefetch: bool = False) -> str | None:
        """Path of the cached copy of ``key``, filling it if needed; None if it bypasses the cache."""
        self._check_process()
        validate_key(key, url=self.url)
        entry = self._entry(key)
        path = self._object_path(entry)
        if self._is_valid(key, entry, path):
            self._touch(path)
            if not prefetch:
                self._count("hits")
            return path
        with self._flock(self._lock_path(entry)):
            if self._is_valid(key, entry, path):  # another process filled it while we waited
                self._touch(path)
                if not prefetch:
                    self._count("hits")
                return path
            meta = self._store.head(key)
            if meta.size > self._max_bytes:
                return None
            if not prefetch:
                self._count("misses")
            self._fill(key, entry, path, meta)
            self._validated.add(key)
            return path

    def _reserve(self, entry: str, size: int) -> str:
        """Make room for ``size`` bytes and create the fill's temporary file at that size.

        Runs under the cache-wide eviction lock, and the temporary file is created full-size
        (sparse) before the lock is released, so concurrent fills in all processes count each
        other's bytes: the budget holds even while many shards download at once.
        """
        deadline = time.monotonic() + ROOM_WAIT_S
        while True:
            with self._flock(os.path.join(self._dir, "evict.lock")):
                fits = self._make_room(size)
                if fits or time.monotonic() >= deadline:
                    if not fits:
                        logger.warning(
                            "cache %s: %d bytes of fills in progress leave no room for %d more "
                            "within the %d-byte budget after %.0f s; going over it (raise "
                            "cache_size or lower the number of workers prefetching)",
                            self._dir,
                            self._in_flight_bytes(),
                            size,
                            self._max_bytes,
                            ROOM_WAIT_S,
                        )
                    # Reserve under the same hold of the lock that made the room.
                    fd, tmp = tempfile.mkstemp(
                        prefix=f"{entry[:16]}.{os.getpid()}.", dir=os.path.join(self._dir, "tmp")
                    )
                    try:
                        os.ftruncate(fd, size)
                    finally:
                        os.close(fd)
                    return tmp
            # Only fills in progress (never evicted) hold the budget: wait for them to finish.
            time.sleep(0.05)

    def _fill(self, key: str, entry: str, path: str, meta: ObjectMeta) -> None:
        """Download ``key`` into the cache, one consistent version of it.

        An object of at most :data:`FILL_CHUNK` bytes is one whole ``get`` (one version by the
        store's atomicity). A larger one is copied in ranged gets of ``FILL_CHUNK`` bytes, each
        retried on its own by a :class:`~fastload.storage.RetryStore` below the cache; a second
        ``head`` afterwards must report the same size, etag and mtime as the first, else the
        object changed meanwhile and the copy starts again (at most three times).
        """
        os.makedirs(os.path.dirname(path), exist_ok=True)
        url = self._store.child_url(key)
        for attempt in range(3):
            tmp = self._reserve(entry, meta.size)
            try:
                with open(tmp, "r+b") as out:
                    if meta.size <= FILL_CHUNK:
                        data = self._store.get(key)
                        out.write(data)
                        got, same = len(data), True
                        if got != meta.size:
                            meta = ObjectMeta(key, got)  # replaced since the head: etag unknown
                    else:
                        got = self._download(key, meta.size, out)
                        after = self._store.head(key)
                        same = got == meta.size and (after.size, after.etag, after.mtime) == (
                            meta.size,
                            meta.etag,
                            meta.mtime,
                        )
                        meta = after
                    out.truncate(got)
                if not same:
                    os.unlink(tmp)
                    if attempt < 2:
                        continue
                    raise StoreError(
                        f"could not copy {url} into the cache: it changed during each of 3 "
                        "downloads; datasets being read must not be rewritten",
                        url=url,
                    )
                meta_tmp = self._meta_path(entry) + ".tmp"
                with open(meta_tmp, "w", encoding="utf-8") as f:
                    json.dump({"key": key, "size": got, "etag": meta.etag, "url": self.url}, f)
                os.replace(meta_tmp, self._meta_path(entry))
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            self._count("bytes_downloaded", got)
            return

    def _download(self, key: str, size: int, out: io.BufferedRandom) -> int:
        """Copy the first ``size`` bytes of ``key`` into ``out`` in ranged gets of
        :data:`FILL_CHUNK` bytes; return the bytes copied (fewer if the object shrank)."""
        got = 0
        while got < size:
            want = min(size - got, FILL_CHUNK)
            try:
                block = self._store.get(key, ByteRange.from_length(got, want))
            except InvalidRangeError:
                return got
            out.write(block)
            got += len(block)
            if len(block) != want:
                return got
        return got

    def _touch(self, path: str) -> None:
        with contextlib.suppress(OSError):
            os.utime(path)  # mtime = last use, for LRU

    def _in_flight_bytes(self) -> int:
        total = 0
        for f in os.scandir(os.path.join(self._dir, "tmp")):
            with contextlib.suppress(FileNotFoundError):
                total += f.stat().st_size
        return total

    def _make_room(self, incoming: int) -> bool:
        """Evict least recently used objects until ``incoming`` more bytes fit in the budget;
        return whether they fit.

        The caller holds the eviction lock. Fills in progress (temporary files, created at their
        full size) count against the budget but are never evicted.
        """
        entries: list[tuple[float, int, str]] = []
        # Fills in progress first: one that finishes during the scan (renamed from tmp/ into
        # objects/ without this lock) is then counted twice, never missed.
        total = self._in_flight_bytes()
        root = os.path.join(self._dir, "objects")
        for sub in os.scandir(root):
            if not sub.is_dir():
                continue
            for f in os.scandir(sub.path):
                if f.name.endswith(".json") or f.name.endswith(".tmp"):
                    continue
                try:
                    st = f.stat()
                except FileNotFoundError:
                    continue
                entries.append((st.st_mtime, st.st_size, f.path))
                total += st.st_size
        if total + incoming <= self._max_bytes:
            return True
        entries.sort()
        for _, size, path in entries:
            if total + incoming <= self._max_bytes:
                break
            entry = os.path.basename(path)
            lock_fd = os.open(self._lock_path(entry), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
            try:
                try:  # skip entries being (re)filled right now
                    fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    total -= size
                    self._count("evictions")
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path + ".json")
            finally:
                os.close(lock_fd)
        return total + incoming <= self._max_bytes

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    # ---- public cache API ---------------------------------------------------------------------

    def invalidate(self, key: str) -> None:
        """Drop the cached copy of ``key`` (if any), in every process sharing the cache."""
        self._check_process()
        entry = self._entry(key)
        with self._flock(self._lock_path(entry)):
            for path in (self._object_path(entry), self._meta_path(entry)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        self._validated.discard(key)

    @property
    def supports_prefetch(self) -> bool:
        return self._prefetch_threads > 0

    def prefetch(self, keys: Iterable[str]) -> None:
        """Start filling the cache with ``keys`` in the background, in the order given.

        Returns at once. Errors are not raised here; a later read of the key raises them.
        """
        self._check_process()
        if self._prefetch_threads == 0:
            return
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self._prefetch_threads, thread_name_prefix="fastload-prefetch"
                )
            for key in keys:
                if key in self._pending and not self._pending[key].done():
                    continue
                self._pending[key] = self._pool.submit(self._prefetch_one, key)

    def _prefetch_one(self, key: str) -> None:
        try:
            if self._ensure(key, prefetch=True) is not None:
                self._count("prefetched")
        except Exception:  # surfaced by the read that needs the key
            pass

    def cached_bytes(self) -> int:
        """Bytes currently held in the cache directory (all processes, all stores)."""
        total = 0
        for dirpath, _, files in os.walk(os.path.join(self._dir, "objects")):
            for name in files:
                if not name.endswith((".json", ".tmp")):
                    with contextlib.suppress(FileNotFoundError):
                        total += os.stat(os.path.join(dirpath, name)).st_size
        return total

    def stats(self) -> dict[str, int]:
        """This process's counters: hits, misses, evictions, bytes_downloaded,
        bytes_read_through (objects over budget), prefetched."""
        self._check_process()
        with self._lock:
            return dict(self._counters)

    def clear(self) -> None:
        """Remove every cached object of this store from the cache directory."""
        self._check_process()
        for dirpath, _, files in os.walk(os.path.join(self._dir, "objects")):
            for name in files:
                if name.endswith(".json"):
                    continue
                path = os.path.join(dirpath, name)
                try:
                    with open(path + ".json", encoding="utf-8") as f:
                        url = json.load(f).get("url")
                except (OSError, ValueError):
                    url = None
                if url == self.url:
                    for p in (path, path + ".json"):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(p)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None and self._pid == os.getpid():
            pool.shutdown(wait=True, cancel_futures=True)
        super().close()

    # ---- reads ----------------------------------------------------------------------------------

    def get(self, key: str, byte_range: ByteRange | None = None) -> bytes:
        path = self._ensure(key)
        if path is None:
            data = self._store.get(key, byte_range)
            self._count("bytes_read_through", len(data))
            return data
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                if byte_range is None:
                    return f.read()
                check_range(byte_range, size, url=self.child_url(key))
                return os.pread(f.fileno(), byte_range.length, byte_range.start)
        except FileNotFoundError:  # evicted between fill and open: read through once
            return self._store.get(key, byte_range)

    def get_ranges(
        self,
        key: str,
        ranges: Sequence[ByteRange],
        *,
        coalesce: int = DEFAULT_COALESCE_BYTES,
    ) -> builtins.list[bytes]:
        path = self._ensure(key)
        if path is None:
            return self._store.get_ranges(key, ranges, coalesce=coalesce)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return self._store.get_ranges(key, ranges, coalesce=coalesce)
        try:
            size = os.fstat(fd).st_size
            out = []
            for r in ranges:
                check_range(r, size, url=self.child_url(key))
                out.append(os.pread(fd, r.length, r.start) if r.length else b"")
            return out
        finally:
            os.close(fd)

    def open_reader(self, key: str, *, chunk_size: int = DEFAULT_READ_CHUNK) -> io.BufferedIOBase:
        path = self._ensure(key)
        if path is not None:
            try:
                return cast(io.BufferedIOBase, open(path, "rb", buffering=1 << 20))
            except FileNotFoundError:
                pass
        return self._store.open_reader(key, chunk_size=chunk_size)

    def local_path(self, key: str) -> str | None:
        path = self._ensure(key)
        if path is None:
            raise ObjectNotFoundError(
                f"{self.child_url(key)} is larger than the cache budget ({self._max_bytes} "
                "bytes), so it has no local copy; raise max_bytes",
                url=self.child_url(key),
            )
        return path

    # ---- writes: forwarded, then the cached copy is dropped ------------------------------------

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        self._store.put(key, data)
        self.invalidate(key)

    def open_writer(self, key: str) -> ObjectWriter:
        return _CacheWriter(self, key, self._store.open_writer(key))

    def delete(self, key: str) -> None:
        try:
            self._store.delete(key)
        finally:
            self.invalidate(key)

    def head(self, key: str) -> ObjectMeta:
        return self._store.head(key)

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        return self._store.list(prefix)

    def wait_prefetch(self, timeout: float | None = None) -> None:
        """Block until pending prefetches finish (for tests and benchmarks)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            pending = builtins.list(self._pending.values())
        for fut in pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            with contextlib.suppress(Exception):
                fut.result(remaining)
