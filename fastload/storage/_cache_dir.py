"""The directory of a :class:`~fastload.storage.CachingStore`: layout, locks and byte budget.

One directory is shared by every process of a node (all DataLoader workers of all ranks) and by
the caches of several stores. Its layout::

    objects/<e[:2]>/<e>        a cached object (e = sha256 of "<store url>\\0<key>", hex)
    objects/<e[:2]>/<e>.json   what it is: {"key", "size", "etag", "mtime", "url"}
    locks/<e>.lock             flock held while the entry is filled, replaced or removed
    tmp/<e[:16]>.<pid>.<rand>  a fill in progress, created at its full size
    evict.lock                 flock held while room is made in the budget
    counters/                  the node's counters, one file per process (see _cache_counters.py)

Fills in progress count against the budget (their temporary files are created full-size under
the eviction lock) but are never evicted; eviction takes each victim's entry lock without
waiting, so it never removes an object that another process is filling.

The filesystem's free space is a second budget (node-local disks are shared with other jobs, so
it is often smaller than the byte budget). Under the same lock a fill also checks that the
filesystem has room for the object, counting the bytes that the fills in progress have yet to
write (their temporary files are sparse), and evicts least recently used objects until it has;
a write that still finds no room (``ENOSPC``, or ``EDQUOT``: a quota ``statvfs`` does not show)
makes the fill evict again and retry once. An object that cannot fit even then raises
:class:`~fastload.errors.CacheFullError`, and the cache reads it uncached. An evicted object that a
reader still has open keeps its space until the reader closes it.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator

from fastload.errors import CacheFullError
from fastload.storage._cache_counters import NO_SPACE, NodeCounters
from fastload.storage._keys import ObjectMeta

__all__ = ["NO_SPACE", "ROOM_WAIT_S", "CacheDirectory", "CacheSpaceWarning", "Reservation"]

#: How long a fill waits for other fills in progress to free the budget before going over it.
ROOM_WAIT_S = 30.0

logger = logging.getLogger("fastload.storage")

_warned_lock = threading.Lock()
_warned: set[tuple[str, str]] = set()  # (what, cache directory): warned once per process


class CacheSpaceWarning(UserWarning):
    """A cache directory's filesystem has less room than its byte budget: when opening the cache
    (the budget exceeds the free space) and when an object that does not fit is read uncached.
    Each is given once per process and cache directory."""


def warn_once(what: str, path: str, message: str, stacklevel: int) -> bool:
    """Warn ``message`` (a :class:`CacheSpaceWarning`, for the caller ``stacklevel`` frames up)
    unless this process already warned ``what`` about the cache directory ``path``; return
    whether it warned."""
    with _warned_lock:
        if (what, path) in _warned:
            return False
        _warned.add((what, path))
    warnings.warn(message, CacheSpaceWarning, stacklevel=stacklevel + 1)
    return True


def size_text(n: int) -> str:
    """``n`` bytes for people: ``"1.00 GB"``, ``"61.4 kB"``, ``"512 B"`` (powers of 1000)."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.2f} {unit}" if value < 10 else f"{value:.1f} {unit}"
    return f"{n} B"


@dataclasses.dataclass(frozen=True)
class Reservation:
    """The temporary file a fill writes, made by :meth:`CacheDirectory.reserve`."""

    #: Path of the temporary file, created at the object's size (sparse).
    path: str
    #: Objects evicted to keep the byte budget.
    evicted: int
    #: Objects evicted, beyond those, because the filesystem had no room.
    disk_evicted: int


class CacheDirectory:
    """The cache directory at ``path`` with a budget of ``max_bytes``; see the module docs.

    Holds no open files or threads, so it pickles as its fields and works in any process.
    """

    def __init__(self, path: str, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.counters = NodeCounters(path)

    def create(self) -> None:
        """Make the directory tree, and remove the fills of processes that are gone."""
        for sub in ("objects", "locks", "tmp"):
            os.makedirs(os.path.join(self.path, sub), exist_ok=True)
        self._remove_dead_fills()
        self.counters.create()

    # ---- layout ---------------------------------------------------------------------------------

    def object_path(self, entry: str) -> str:
        """Where the cached copy of ``entry`` lives."""
        return os.path.join(self.path, "objects", entry[:2], entry)

    def meta_path(self, entry: str) -> str:
        """Where the description (key, size, etag, store URL) of ``entry`` lives."""
        return self.object_path(entry) + ".json"

    def lock_path(self, entry: str) -> str:
        """The file whose ``flock`` guards filling, replacing and removing ``entry``."""
        return os.path.join(self.path, "locks", entry + ".lock")

    def object_files(self) -> Iterator[str]:
        """Paths of the cached objects (not their ``.json`` descriptions), any store's."""
        for dirpath, _, files in os.walk(os.path.join(self.path, "objects")):
            for name in files:
                if not name.endswith((".json", ".tmp")):
                    yield os.path.join(dirpath, name)

    def describe(self, entry: str, meta: ObjectMeta, url: str) -> None:
        """Write the description of ``entry`` (the object ``meta`` of the store at ``url``)
        atomically; done before the object itself is renamed into place. A failed write (a
        full disk) leaves no temporary file."""
        path = self.meta_path(entry)
        try:
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                record = {"key": meta.key, "size": meta.size, "etag": meta.etag}
                json.dump({**record, "mtime": meta.mtime, "url": url}, f)
            os.replace(path + ".tmp", path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path + ".tmp")
            raise

    def description(self, entry: str, key: str) -> ObjectMeta | None:
        """What the cached copy of ``key`` (entry ``entry``) is, None when it is not cached (or
        its description is being replaced)."""
        try:
            with open(self.meta_path(entry), encoding="utf-8") as f:
                meta = json.load(f)
            if not os.path.exists(self.object_path(entry)) or meta.get("key") != key:
                return None
            mtime = meta.get("mtime")
            return ObjectMeta(
                key,
                int(meta["size"]),
                mtime=float(mtime) if mtime is not None else None,
                etag=meta.get("etag"),
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def cached_bytes(self) -> int:
        """Bytes of the cached objects (all stores), fills in progress not included."""
        total = 0
        for path in self.object_files():
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(path).st_size
        return total

    def remove_store(self, url: str) -> None:
        """Remove every cached object of the store at ``url``."""
        for path in builtins.list(self.object_files()):
            try:
                with open(path + ".json", encoding="utf-8") as f:
                    owner = json.load(f).get("url")
            except (OSError, ValueError, AttributeError):
                owner = None
            if owner == url:
                for p in (path, path + ".json"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(p)

    @contextlib.contextmanager
    def locked(self, entry: str | None) -> Iterator[None]:
        """Hold the exclusive lock of ``entry``, or of the budget for ``None``."""
        path = self.lock_path(entry) if entry else os.path.join(self.path, "evict.lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    @contextlib.contextmanager
    def locked_if_free(self, entry: str) -> Iterator[bool]:
        """Hold the exclusive lock of ``entry`` if no one holds it (yields True), else yield
        False at once without it (another thread or process is filling or removing the entry)."""
        fd = os.open(self.lock_path(entry), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)  # releases the lock, if held

    def _remove_dead_fills(self) -> None:
        """Remove temporary files of fills whose process is gone (SIGKILL, crash)."""
        tmp = os.path.join(self.path, "tmp")
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

    # ---- the budget -----------------------------------------------------------------------------

    def reserve(
        self, entry: str, size: int, *, url: str, reclaim: int = 0, code: int = errno.ENOSPC
    ) -> Reservation:
        """Make room for ``size`` bytes, in the budget and on the filesystem, and create the
        fill's temporary file at that size.

        Runs under the cache-wide eviction lock, and the temporary file is created full-size
        (sparse) before the lock is released, so concurrent fills in all processes count each
        other's bytes: the budget holds even while many shards download at once. On the
        filesystem, the bytes the fills in progress have yet to write are counted as used.

        Args:
            entry: The entry being filled.
            size: The object's size in bytes.
            url: The object's URL (for the error).
            reclaim: Evict objects holding at least this many bytes even if the filesystem
                seems to have room (after a write found none: a quota, or another program
                filling the disk).
            code: The errno a :class:`CacheFullError` carries (that of the failed write).

        Raises:
            CacheFullError: The filesystem has no room for the object even after evicting every
                object that can be evicted (none is then evicted more than that).
        """
        deadline = time.monotonic() + ROOM_WAIT_S
        evicted = 0
        while True:
            with self.locked(None):
                fits, more = self._make_room(size)
                evicted += more
                if fits or time.monotonic() >= deadline:
                    if not fits:
                        logger.warning(
                            "cache %s: %d bytes of fills in progress leave no room for %d more "
                            "within the %d-byte budget after %.0f s; going over it (raise "
                            "cache_size or lower the number of workers prefetching)",
                            self.path,
                            self._in_flight_bytes(),
                            size,
                            self.max_bytes,
                            ROOM_WAIT_S,
                        )
                    disk_evicted = self._make_disk_room(size, url, reclaim, code)
                    # Reserve under the same hold of the lock that made the room.
                    try:
                        fd, tmp = tempfile.mkstemp(
                            prefix=f"{entry[:16]}.{os.getpid()}.",
                            dir=os.path.join(self.path, "tmp"),
                        )
                    except OSError as exc:
                        if exc.errno not in NO_SPACE:
                            raise
                        raise self.full_error(url, size, exc.errno) from exc
                    try:
                        os.ftruncate(fd, size)
                    except BaseException:
                        os.unlink(tmp)
                        raise
                    finally:
                        os.close(fd)
                    return Reservation(tmp, evicted, disk_evicted)
            # Only fills in progress (never evicted) hold the budget: wait for them to finish.
            time.sleep(0.05)

    def _in_flight_bytes(self) -> int:
        return self._in_flight()[0]

    def _in_flight(self) -> tuple[int, int]:
        """Bytes of the fills in progress: their sizes, and what they have yet to write."""
        total = unwritten = 0
        for f in os.scandir(os.path.join(self.path, "tmp")):
            with contextlib.suppress(FileNotFoundError):
                st = f.stat()
                total += st.st_size
                unwritten += max(0, st.st_size - 512 * st.st_blocks)
        return total, unwritten

    # ---- the filesystem's room ------------------------------------------------------------------

    def free_bytes(self) -> int:
        """Bytes the filesystem of the directory has free for unprivileged writes."""
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def _on_disk(self, size: int) -> int:
        """Room an object of ``size`` bytes takes, with its description: whole blocks."""
        block = os.statvfs(self.path).f_frsize or 4096
        return -(-size // block) * block + block

    def _make_disk_room(self, size: int, url: str, reclaim: int, code: int) -> int:
        """Evict least recently used objects until the filesystem has room for ``size`` more
        bytes (and at least ``reclaim`` bytes of objects are gone); return how many were evicted.
        The caller holds the eviction lock.

        Raises:
            CacheFullError: Not enough room even with every evictable object gone.
        """
        need = self._on_disk(size)
        _, unwritten = self._in_flight()
        room = self.free_bytes() - unwritten
        if room >= need and reclaim <= 0:
            return 0
        evicted = freed = 0
        entries = self._lru()
        for _, nbytes, path in entries:
            if room >= need and freed >= reclaim:
                break
            if self._evict(path):
                evicted += 1
                freed += nbytes
                room = self.free_bytes() - unwritten
        if room < need or (reclaim > 0 and freed == 0):
            held = sum(nbytes for _, nbytes, _ in entries) - freed
            raise self.full_error(url, size, code, room=max(0, room), evicted=evicted, held=held)
        return evicted

    def full_error(
        self,
        url: str,
        size: int | None,
        code: int,
        *,
        room: int | None = None,
        evicted: int = 0,
        held: int | None = None,
    ) -> CacheFullError:
        """The :class:`CacheFullError` for ``url`` (``size`` bytes, if known) that found no room:
        it names the directory, the budget, the free space (``room``, else asked now), what the
        cache holds (``held``, else counted now) and what to change."""
        free = self.free_bytes() if room is None else room
        cached = self.cached_bytes() if held is None else held
        gone = (
            f" after evicting {evicted} cached objects (evicted objects still open in a reader "
            "keep their space until it closes them)"
            if evicted
            else ""
        )
        return CacheFullError(
            f"no room for {url}{'' if size is None else f' ({size_text(size)})'} in the cache "
            f"{self.path}: its filesystem has "
            f"{size_text(free)} free{gone} ({os.strerror(code)}), while the cache's budget "
            f"(cache_size) is {size_text(self.max_bytes)} and it holds {size_text(cached)}; "
            f"lower cache_size to at most {size_text(free + cached)}, free space on that "
            f"filesystem{' (or raise your disk quota there)' if code == errno.EDQUOT else ''}, "
            "or point cache_dir at a larger one",
            url=url,
            cache_dir=self.path,
            code=code,
        )

    def warn_uncached(self, exc: CacheFullError) -> None:
        """Warn (once per process and directory) that an object is read uncached for ``exc``."""
        warn_once(
            "uncached",
            self.path,
            f"{exc}. Reading it uncached; further objects that do not fit are read uncached "
            "without a warning, counted in stats()['disk_full_uncached']",
            stacklevel=4,  # the caller of the cache's read
        )

    def check_space(self) -> None:
        """Warn (once per process and directory) when the budget exceeds what the filesystem can
        hold: its free space plus the objects already cached."""
        free = self.free_bytes()
        if self.max_bytes <= free:
            return
        cached = self.cached_bytes()
        if self.max_bytes <= free + cached:
            return
        warn_once(
            "budget",
            self.path,
            f"the cache {self.path} has a budget (cache_size) of {size_text(self.max_bytes)} "
            f"but its filesystem has {size_text(free)} free (and the cache holds "
            f"{size_text(cached)}): when the disk fills, least recently used objects are "
            "evicted early and objects that still do not fit are read uncached; lower "
            f"cache_size to at most {size_text(free + cached)}, or point cache_dir at a larger "
            "filesystem",
            stacklevel=3,  # the caller of CachingStore(...)
        )

    # ---- eviction -------------------------------------------------------------------------------

    def _lru(self, *, ordered: bool = True) -> list[tuple[float, int, str]]:
        """(last use, size, path) of the cached objects, least recently used first (in no
        particular order unless ``ordered``). The last use is the modification time of the
        object's description (``CachingStore._touch``), else of the object."""
        entries: list[tuple[float, int, str]] = []
        for path in self.object_files():
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            try:
                used = os.stat(path + ".json").st_mtime
            except FileNotFoundError:
                used = st.st_mtime
            entries.append((used, st.st_size, path))
        if ordered:
            entries.sort()
        return entries

    def _evict(self, path: str) -> bool:
        """Remove the cached object at ``path`` and its description unless its entry is being
        (re)filled right now; return whether the object was removed. The caller holds the
        eviction lock."""
        with self.locked_if_free(os.path.basename(path)) as free:
            if not free:
                return False
            removed = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed = True
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path + ".json")
            return removed

    def _make_room(self, incoming: int) -> tuple[bool, int]:
        """Evict least recently used objects until ``incoming`` more bytes fit in the budget;
        return whether they fit and how many objects were evicted.

        The caller holds the eviction lock. Fills in progress (temporary files, created at their
        full size) count against the budget but are never evicted.
        """
        # Fills in progress first: one that finishes during the scan (renamed from tmp/ into
        # objects/ without this lock) is then counted twice, never missed.
        total = self._in_flight_bytes()
        entries = self._lru(ordered=False)
        total += sum(size for _, size, _ in entries)
        evicted = 0
        if total + incoming <= self.max_bytes:
            return True, evicted
        entries.sort()
        for _, size, path in entries:
            if total + incoming <= self.max_bytes:
                break
            if self._evict(path):  # skips entries being (re)filled right now
                total -= size
                evicted += 1
        return total + incoming <= self.max_bytes, evicted
