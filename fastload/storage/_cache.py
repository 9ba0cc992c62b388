"""A local disk cache in front of any store: :class:`CachingStore`.

Whole objects (shards, indexes, manifests) are copied to a local directory on first read and served
from there afterwards, within a byte budget with least-recently-used eviction. It is built for the
usual training node: every DataLoader worker of every rank on the node opens the same cache
directory, and

* a fill is atomic: the object is streamed into a temporary file and renamed into place, so a
  reader never sees a partial file (:mod:`fastload.storage._cache_fill`);
* one object is downloaded once: fills take an exclusive ``flock`` on a per-object lock file, and
  whoever waits on it finds the finished file; a prefetch skips an object being filled, so the
  prefetch threads of all processes download different objects at once;
* a SIGKILLed process leaves nothing harmful: its ``flock`` locks are released by the kernel, and its
  temporary files are removed by the next process that opens the cache;
* eviction runs under a cache-wide lock and never removes a file another process is filling.
  Unlinking a file that a reader already has open is safe on POSIX (the reader keeps its data); a
  path returned by :meth:`CachingStore.local_path` should be opened right away.

Objects are assumed immutable while cached (datasets are written once). Writes and deletes made
through this wrapper invalidate the cached copy; with ``revalidate=True`` every first access in a
process also compares the remote etag and size with the cached copy's.

Counters (hits, misses, evictions, bytes downloaded, requests) are kept per process
(:meth:`CachingStore.stats`) and for the whole node (:meth:`CachingStore.node_stats`: summed over
every process that used the cache directory, those gone included, from small memory-mapped
counter files in the directory; see :mod:`fastload.storage._cache_counters`).
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import io
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import cast

from fastload._lazy import PerProcess
from fastload._units import parse_size
from fastload.errors import CacheFullError, InvalidArgumentError, ObjectNotFoundError, StoreError
from fastload.storage._base import DEFAULT_COALESCE_BYTES, DEFAULT_READ_CHUNK, ObjectWriter, Store
from fastload.storage._cache_counters import ProcessCounters
from fastload.storage._cache_dir import NO_SPACE, CacheDirectory
from fastload.storage._cache_fill import fill
from fastload.storage._cache_state import CacheWriter, ProcessState
from fastload.storage._keys import ByteRange, ObjectMeta, check_range, validate_key
from fastload.storage._retry import RetryStore
from fastload.storage._wrapper import WrapperStore

__all__ = ["CachingStore", "parse_size"]  # parse_size re-exported from fastload._units

#: A fill reuses the answer of a head of the same object forwarded this long ago at most.
HEAD_REUSE_S = 10.0
#: An object that found no room on the cache's filesystem is read uncached, without trying to
#: cache it again, for this long (per process): a shard read sample by sample tries once.
NO_ROOM_RETRY_S = 30.0
#: A process records a use of the same cached object at most this often (seconds).
_TOUCH_EVERY_S = 1.0


class CachingStore(WrapperStore):
    """Serves reads of ``store`` from a local directory, filled on demand, within a byte budget.

    Args:
        store: The (usually remote) store to cache.
        cache_dir: Local directory for cached objects; shared safely by all processes on a node.
            Several caches of different stores may share one directory (entries are keyed by the
            store URL and key).
        max_bytes: Byte budget (int or ``"50GB"``); least recently used objects are evicted to
            stay within it. An object larger than the whole budget is read through, uncached.
            The filesystem's free space is a budget too: when it runs out first, least
            recently used objects are evicted to make room, and an object that cannot fit even
            then is read uncached (one :class:`~fastload.storage.CacheSpaceWarning` per
            process; counted in :meth:`stats`). Opening a cache whose budget exceeds the free
            space warns once.
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
        self._disk = CacheDirectory(
            os.path.abspath(os.fspath(cache_dir)), parse_size(max_bytes, allow_zero=True)
        )
        if prefetch_threads < 0:
            raise InvalidArgumentError(f"prefetch_threads must be >= 0, got {prefetch_threads}")
        self._prefetch_threads = prefetch_threads
        self._revalidate = revalidate
        # Threads, locks and counters do not survive a fork or a pickle: made again per process.
        self._proc: PerProcess[ProcessState] = PerProcess(self._process_state)
        self._disk.create()
        self._disk.check_space()

    def _process_state(self) -> ProcessState:
        """This process's state (made on first use in each process). From then on, the retry
        counts of a :class:`~fastload.storage.RetryStore` below this cache are counted here
        too, as ``store_<name>`` (see :meth:`stats`)."""
        layer: Store = self._store
        while not isinstance(layer, RetryStore) and isinstance(layer, WrapperStore):
            layer = layer.inner
        if isinstance(layer, RetryStore):
            layer.add_count_listener(self._count_retry)
        return ProcessState()

    def _count_retry(self, name: str) -> None:
        self._count(f"store_{name}")

    def __repr__(self) -> str:
        return (
            f"CachingStore({self._store!r}, cache_dir={self._disk.path!r}, "
            f"max_bytes={self._disk.max_bytes})"
        )

    @property
    def cache_dir(self) -> str:
        """The local cache directory."""
        return self._disk.path

    has_local_paths = True
    evicts_local_files = True
    local_root = None  # its files are cache entries, not the wrapped store's keys

    @property
    def uncached(self) -> Store:
        return self._store.uncached

    def _entry(self, key: str) -> str:
        """The cache entry name of ``key``: unique across the stores sharing the directory."""
        return hashlib.sha256(f"{self._store.url}\x00{key}".encode()).hexdigest()

    # ---- filling ------------------------------------------------------------------------------

    def _is_valid(self, key: str, entry: str, path: str) -> bool:
        if not os.path.exists(path):
            return False
        validated = self._proc.get().validated
        if not self._revalidate or key in validated:
            return True
        cached = self._disk.description(entry, key)
        if cached is None:
            return False
        remote = self._store.head(key)
        self._count("requests")
        ok = (cached.size, cached.etag) == (remote.size, remote.etag)
        if ok:
            validated.add(key)
        return ok

    def _ensure(self, key: str, *, prefetch: bool = False, copy: bool = False) -> str | None:
        """Path of the cached copy of ``key``, filling it if needed; None if it bypasses the cache
        (larger than the budget, or no room on the filesystem).

        A prefetch (``prefetch=True``) of an object that another thread or process is filling
        returns None at once instead of waiting: the prefetching thread moves on to the next
        object, so the prefetch threads of all the node's processes download different objects
        in parallel.

        Raises:
            CacheFullError: With ``prefetch=True`` or ``copy=True`` (a local copy is required),
                when the filesystem has no room for the object; otherwise the first such object
                of the process is warned about, each is counted, and None is returned.
        """
        validate_key(key, url=self.url)
        entry = self._entry(key)
        path = self._disk.object_path(entry)
        if self._is_valid(key, entry, path):
            self._touch(path)
            if not prefetch:
                self._count("hits")
            return path
        state = self._proc.get()
        if state.no_room:
            with state.lock:
                seen = state.no_room.get(key)
            if seen is not None and time.monotonic() - seen[0] < NO_ROOM_RETRY_S:
                if prefetch or copy:
                    raise seen[1]
                return None
        try:
            return self._fill(key, entry, path, prefetch)
        except CacheFullError as exc:
            full = exc
        except OSError as exc:  # e.g. the lock file of the entry: no room on the cache's disk
            if isinstance(exc, StoreError) or exc.errno not in NO_SPACE:
                raise
            full = self._disk.full_error(self.child_url(key), None, exc.errno)
            full.__cause__ = exc
        if prefetch:
            raise full  # the read that needs the object decides
        with state.lock:
            state.no_room.put(key, (time.monotonic(), full))
        self._count("disk_full_uncached")
        self._disk.warn_uncached(full)
        if copy:
            raise full
        return None

    def _fill(self, key: str, entry: str, path: str, prefetch: bool) -> str | None:
        """:meth:`_ensure` for an object not found in the cache: wait for a fill in progress or
        fill it."""
        with contextlib.ExitStack() as held:
            if not prefetch:
                held.enter_context(self._disk.locked(entry))
            elif not held.enter_context(self._disk.locked_if_free(entry)):
                return None  # being filled elsewhere
            if self._is_valid(key, entry, path):  # another process filled it while we waited
                self._touch(path)
                if not prefetch:
                    self._count("hits")
                return path
            meta = self._recent_head(key)
            if meta is None:
                meta = self._store.head(key)
                self._count("requests")
            if meta.size > self._disk.max_bytes:
                return None
            if not prefetch:
                self._count("misses")
            fill(self._store, self._disk, self.url, key, entry, meta, self._count)
            self._proc.get().validated.add(key)
            return path

    def _touch(self, path: str) -> None:
        """Record a use of the cached object at ``path`` for the LRU order, on its description
        (:meth:`CacheDirectory._lru`): a ``utime`` of the object itself moves its ``ctime``, and
        readers that keep what they derive from it (a parsed index) would parse it again."""
        now = time.monotonic()
        touched = self._proc.get().touched
        last = touched.get(path)
        if last is not None and now - last < _TOUCH_EVERY_S:
            return  # recorded less than a second ago: the LRU order needs no finer time
        touched.put(path, now)
        with contextlib.suppress(OSError):
            os.utime(path + ".json")

    def _count(self, name: str, n: int = 1) -> None:
        state = self._proc.get()
        with state.lock:
            state.counters[name] += n
            if state.shared is None:
                state.shared = self._disk.counters.open_or_warn() or False
            if isinstance(state.shared, ProcessCounters):
                state.shared.add(name, n)

    # ---- public cache API ---------------------------------------------------------------------

    def invalidate(self, key: str) -> None:
        """Drop the cached copy of ``key`` (if any), in every process sharing the cache."""
        entry = self._entry(key)
        with self._disk.locked(entry):
            for path in (self._disk.object_path(entry), self._disk.meta_path(entry)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        self._proc.get().validated.discard(key)

    @property
    def supports_prefetch(self) -> bool:
        return self._prefetch_threads > 0

    def prefetch(self, keys: Iterable[str]) -> None:
        """Start filling the cache with ``keys`` in the background, in the order given.

        Returns at once. Errors are not raised here; a later read of the key raises them.
        """
        if self._prefetch_threads == 0:
            return
        state = self._proc.get()
        with state.lock:
            if state.pool is None:
                state.pool = ThreadPoolExecutor(
                    self._prefetch_threads, thread_name_prefix="fastload-prefetch"
                )
            for key in keys:
                if key in state.pending and not state.pending[key].done():
                    continue
                state.pending[key] = state.pool.submit(self._prefetch_one, key)

    def _prefetch_one(self, key: str) -> None:
        try:
            if self._ensure(key, prefetch=True) is not None:
                self._count("prefetched")
        except Exception:  # surfaced by the read that needs the key
            pass

    def cached_bytes(self) -> int:
        """Bytes currently held in the cache directory (all processes, all stores)."""
        return self._disk.cached_bytes()

    def stats(self) -> dict[str, int]:
        """This process's counters (see :meth:`node_stats` for the node's).

        Keys: ``hits`` and ``misses`` (reads served from a cached copy / that had to fill it;
        prefetches are not counted), ``downloads`` (objects copied into the cache, by reads and
        prefetches), ``evictions`` (objects removed to make room),
        ``bytes_downloaded`` (copied into the cache), ``bytes_read_through`` (bytes read
        uncached: objects larger than the budget or with no room on the filesystem),
        ``disk_full_evictions`` (the evictions made because the filesystem had no room, not the
        budget; included in ``evictions``), ``disk_full_uncached`` (objects read uncached
        because the filesystem had no room for them even after evicting; counted once per
        object and :data:`NO_ROOM_RETRY_S` seconds), ``prefetched`` (objects filled ahead of
        use) and ``requests``
        (calls this cache made to the wrapped store to fill or read through the objects it serves:
        heads (:meth:`head` of an uncached object included), whole and ranged gets,
        ``get_ranges`` and ``open_reader`` calls; retries made below it, :meth:`list` and
        writes are not counted).

        With a :class:`~fastload.storage.RetryStore` below (``open_store`` puts one under every
        object-store cache), what it had to do, counted since this process first used the cache:
        ``store_retries`` (attempts made after a transient failure: a reset, a response cut in
        its headers or body, a stall past the read timeout, a 5xx), ``store_resumed_reads``
        (broken streams reopened where they stopped) and ``store_gave_up`` (operations that
        ended in :class:`~fastload.errors.StoreUnavailableError`): how rough the network was.
        """
        state = self._proc.get()
        with state.lock:
            return dict(state.counters)

    def node_stats(self, *, cached_bytes: bool = True) -> dict[str, int]:
        """The :meth:`stats` counters summed over every process that has used this cache
        directory since it was made (all ranks and workers of the node, the SIGKILLed included),
        plus ``cached_bytes`` (:meth:`cached_bytes`; left out with ``cached_bytes=False``).

        The counts are the directory's, not this store's: caches of several stores sharing the
        directory add up. Take two readings and subtract them to count an interval (an epoch).
        A process that counts while this runs may have its last update missed. Cost: one small
        file read per live process (well under a millisecond for a node's few dozen), and a walk
        of the cached files for ``cached_bytes``.
        """
        out = self._disk.counters.totals()
        if cached_bytes:
            out["cached_bytes"] = self.cached_bytes()
        return out

    def clear(self) -> None:
        """Remove every cached object of this store from the cache directory."""
        self._disk.remove_store(self.url)

    def close(self) -> None:
        state = self._proc.peek()
        if state is not None:
            with state.lock:
                pool, state.pool = state.pool, None
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        super().close()

    # ---- reads ----------------------------------------------------------------------------------

    def get(self, key: str, byte_range: ByteRange | None = None) -> bytes:
        path = self._ensure(key)
        if path is None:
            data = self._store.get(key, byte_range)
            self._count("requests")
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
            self._count("requests")
            return self._store.get(key, byte_range)

    def get_ranges(
        self, key: str, ranges: Sequence[ByteRange], *, coalesce: int = DEFAULT_COALESCE_BYTES
    ) -> builtins.list[bytes]:
        path = self._ensure(key)
        fd = -1
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        if fd < 0:  # over the budget, or evicted between fill and open
            self._count("requests")
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
        self._count("requests")
        return self._store.open_reader(key, chunk_size=chunk_size)

    def local_path(self, key: str) -> str | None:
        """The path of the cached copy of ``key``, filled now if needed. Raises
        :class:`ObjectNotFoundError` for an object larger than the budget and
        :class:`~fastload.errors.CacheFullError` for one the filesystem has no room for."""
        path = self._ensure(key, copy=True)
        if path is None:
            raise ObjectNotFoundError(
                f"{self.child_url(key)} is larger than the cache budget ({self._disk.max_bytes} "
                "bytes), so it has no local copy; raise max_bytes",
                url=self.child_url(key),
            )
        return path

    # ---- writes: forwarded, then the cached copy is dropped ------------------------------------

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        self._store.put(key, data)
        self.invalidate(key)

    def open_writer(self, key: str) -> ObjectWriter:
        return CacheWriter(self, key, self._store.open_writer(key))

    def delete(self, key: str) -> None:
        try:
            self._store.delete(key)
        finally:
            self.invalidate(key)

    def head(self, key: str) -> ObjectMeta:
        """The object's size, mtime and etag: from the cached copy's description when the object
        is cached (no request: shard readers ask for the size each time they open a shard), or
        once a fill of it in progress in any process has finished; else from the wrapped store,
        and a fill of the object in this process within :data:`HEAD_REUSE_S` seconds then reuses
        that answer instead of asking again. With ``revalidate=True`` always from the wrapped
        store."""
        if not self._revalidate:
            entry = self._entry(validate_key(key, url=self.url))
            cached = self._disk.description(entry, key)
            if cached is None:
                with self._disk.locked(entry):  # waits for a fill in progress, if any
                    cached = self._disk.description(entry, key)
            if cached is not None:
                return cached
        meta = self._store.head(key)
        self._count("requests")
        if not self._revalidate:
            state = self._proc.get()
            with state.lock:
                state.heads.put(key, (time.monotonic(), meta))
        return meta

    def _recent_head(self, key: str) -> ObjectMeta | None:
        """The answer of a head of ``key`` this process forwarded in the last
        :data:`HEAD_REUSE_S` seconds (then forgotten), else None."""
        state = self._proc.get()
        with state.lock:
            seen = state.heads.pop(key)
        if seen is None or time.monotonic() - seen[0] > HEAD_REUSE_S:
            return None
        return seen[1]

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        return self._store.list(prefix)

    def wait_prefetch(self, timeout: float | None = None) -> None:
        """Block until pending prefetches finish (for tests and benchmarks)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        state = self._proc.get()
        with state.lock:
            pending = builtins.list(state.pending.values())
        for fut in pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            with contextlib.suppress(Exception):
                fut.result(remaining)
