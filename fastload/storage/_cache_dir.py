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
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator

from fastload.storage._cache_counters import NodeCounters
from fastload.storage._keys import ObjectMeta

__all__ = ["ROOM_WAIT_S", "CacheDirectory"]

#: How long a fill waits for other fills in progress to free the budget before going over it.
ROOM_WAIT_S = 30.0

logger = logging.getLogger("fastload.storage")


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
        atomically; done before the object itself is renamed into place."""
        path = self.meta_path(entry)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            record = {"key": meta.key, "size": meta.size, "etag": meta.etag, "mtime": meta.mtime}
            json.dump({**record, "url": url}, f)
        os.replace(path + ".tmp", path)

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

    def reserve(self, entry: str, size: int) -> tuple[str, int]:
        """Make room for ``size`` bytes and create the fill's temporary file at that size;
        return its path and the number of objects evicted for it.

        Runs under the cache-wide eviction lock, and the temporary file is created full-size
        (sparse) before the lock is released, so concurrent fills in all processes count each
        other's bytes: the budget holds even while many shards download at once.
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
                    # Reserve under the same hold of the lock that made the room.
                    fd, tmp = tempfile.mkstemp(
                        prefix=f"{entry[:16]}.{os.getpid()}.", dir=os.path.join(self.path, "tmp")
                    )
                    try:
                        os.ftruncate(fd, size)
                    finally:
                        os.close(fd)
                    return tmp, evicted
            # Only fills in progress (never evicted) hold the budget: wait for them to finish.
            time.sleep(0.05)

    def _in_flight_bytes(self) -> int:
        total = 0
        for f in os.scandir(os.path.join(self.path, "tmp")):
            with contextlib.suppress(FileNotFoundError):
                total += f.stat().st_size
        return total

    def _make_room(self, incoming: int) -> tuple[bool, int]:
        """Evict least recently used objects until ``incoming`` more bytes fit in the budget;
        return whether they fit and how many objects were evicted.

        The caller holds the eviction lock. Fills in progress (temporary files, created at their
        full size) count against the budget but are never evicted.
        """
        entries: list[tuple[float, int, str]] = []
        # Fills in progress first: one that finishes during the scan (renamed from tmp/ into
        # objects/ without this lock) is then counted twice, never missed.
        total = self._in_flight_bytes()
        for path in self.object_files():
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime, st.st_size, path))
            total += st.st_size
        evicted = 0
        if total + incoming <= self.max_bytes:
            return True, evicted
        entries.sort()
        for _, size, path in entries:
            if total + incoming <= self.max_bytes:
                break
            with self.locked_if_free(os.path.basename(path)) as free:
                if not free:  # skip entries being (re)filled right now
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    total -= size
                    evicted += 1
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path + ".json")
        return total + incoming <= self.max_bytes, evicted
