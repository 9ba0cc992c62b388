"""Counters of a cache directory summed over every process of the node: :class:`NodeCounters`.

Each process that counts something in a :class:`~fastload.storage.CachingStore` gets its own small
counter file in the cache directory and keeps it memory-mapped (``MAP_SHARED``): counting is a
store into the page cache (no system call, no lock shared with other processes), and the counts
survive the process, SIGKILL included, because the kernel owns the pages. Reading sums the files::

    counters/<pid>.<random>.v2.cnt   one process's counters: 16 int64 slots, little-endian, the
                                     first len(COUNTER_NAMES) in that order, the rest zero
    counters/merged.json             the totals of processes that are gone, and the files last merged

Files of the previous version (``.v1.cnt``: the first eight counters, as 8 slots), left by an older
fastload on the same directory, are read and merged too.

Merging takes an exclusive ``flock`` on the ``counters`` directory itself (no lock file).

A process holds a shared ``flock`` on its own counter file for as long as it lives. A file whose
lock can be taken exclusively belongs to a process that is gone: its counts are added to
``merged.json`` (written atomically, naming the files it absorbed) and the file is removed, so the
directory holds one file per live process plus one. A crash between the two steps is harmless:
a file named in ``absorbed`` is removed without being added again.

Reads are not synchronised with counting: a total read while a process counts may miss that one
update. Forked children inherit the parent's file descriptor, so a parent's file is merged only
once its children are gone too (its counts are read all the same).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import mmap
import os
import secrets
import struct
from collections.abc import Iterator

__all__ = ["COUNTER_NAMES", "NO_SPACE", "NodeCounters", "ProcessCounters"]

#: The errnos of a write that found no room: the filesystem is full, or the user's quota is.
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})

#: The counters, in the order of their int64 slots in a counter file.
COUNTER_NAMES = (
    "hits",
    "misses",
    "downloads",
    "evictions",
    "bytes_downloaded",
    "bytes_read_through",
    "prefetched",
    "requests",
    "disk_full_evictions",
    "disk_full_uncached",
    "store_retries",
    "store_resumed_reads",
    "store_gave_up",
)
_SLOTS = 16  # a new counter past the sixteenth needs a new file version (.v3.cnt)
_FILE_BYTES = 8 * _SLOTS
_SUFFIX = ".v2.cnt"
#: Counter files this version reads: suffix -> the counters their slots hold (a prefix of
#: COUNTER_NAMES; the .v1 files of older versions hold the first eight).
_VERSIONS = {_SUFFIX: COUNTER_NAMES, ".v1.cnt": COUNTER_NAMES[:8]}

logger = logging.getLogger("fastload.storage")


class ProcessCounters:
    """This process's counter file: memory-mapped int64 slots, one per name in
    :data:`COUNTER_NAMES`. Made by :meth:`NodeCounters.open`; not thread-safe by itself (the
    caller serialises :meth:`add`), never shared with another process."""

    def __init__(self, path: str) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # held for life: "this process is alive"
            # Written, not truncated to size: the page is then allocated now, so a full disk is
            # an OSError here rather than a SIGBUS at the first count through the map.
            if os.pwrite(fd, bytes(_FILE_BYTES), 0) != _FILE_BYTES:
                raise OSError(errno.ENOSPC, "short write", path)
            self._map = mmap.mmap(
                fd, _FILE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
            )
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd  # kept open: closing it would release the lock
        self._slots = memoryview(self._map).cast("q")
        self._index = {name: i for i, name in enumerate(COUNTER_NAMES)}

    def add(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name`` (one of :data:`COUNTER_NAMES`)."""
        self._slots[self._index[name]] += n


def _read(path: str) -> dict[str, int] | None:
    """The counts in a counter file (a short file reads as zeros); None if it is gone."""
    names = next((n for suffix, n in _VERSIONS.items() if path.endswith(suffix)), COUNTER_NAMES)
    size = 8 * len(names)
    try:
        with open(path, "rb") as f:
            data = f.read(size)
    except FileNotFoundError:
        return None
    counts = dict.fromkeys(COUNTER_NAMES, 0)
    counts.update(zip(names, struct.unpack(f"<{len(names)}q", data.ljust(size, b"\0"))))
    return counts


class NodeCounters:
    """The counters of every process that uses the cache directory ``root`` (see the module docs).

    Holds only the path, so it pickles and works in any process.
    """

    def __init__(self, root: str) -> None:
        self.dir = os.path.join(root, "counters")

    def create(self) -> None:
        """Make the counters directory and fold in the files of processes that are gone."""
        os.makedirs(self.dir, exist_ok=True)
        self.merge_dead()

    def open(self) -> ProcessCounters:
        """A new counter file for the calling process, after folding in those of processes that
        are gone (so a job whose workers start every epoch keeps a few files, not thousands)."""
        self.merge_dead()
        name = f"{os.getpid()}.{secrets.token_hex(6)}{_SUFFIX}"
        return ProcessCounters(os.path.join(self.dir, name))

    def open_or_warn(self) -> ProcessCounters | None:
        """:meth:`open`, or None with a warning when the directory cannot take the file (a read
        must never fail for its counters; the process then counts only for itself)."""
        try:
            return self.open()
        except OSError as exc:
            logger.warning(
                "cache counters in %s cannot be kept (%s): node_stats() will miss pid %d",
                self.dir,
                exc,
                os.getpid(),
            )
            return None

    def _files(self) -> Iterator[str]:
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.dir):
                if name.endswith(tuple(_VERSIONS)):
                    yield name

    def _merged_path(self) -> str:
        return os.path.join(self.dir, "merged.json")

    def _load_merged(self) -> tuple[dict[str, int], list[str]]:
        try:
            with open(self._merged_path(), encoding="utf-8") as f:
                doc = json.load(f)
            totals = {k: int(doc["totals"].get(k, 0)) for k in COUNTER_NAMES}
            return totals, [str(n) for n in doc.get("absorbed", [])]
        except (FileNotFoundError, ValueError, KeyError, TypeError, AttributeError):
            return dict.fromkeys(COUNTER_NAMES, 0), []

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        lock_fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(lock_fd)

    def totals(self) -> dict[str, int]:
        """Every counter summed over all processes that used the directory, live or gone.

        Runs under the merge lock, so a concurrent merge neither hides nor doubles a file.
        """
        with self._locked():
            self._merge_locked()
            totals, _ = self._load_merged()
            for name in self._files():
                counts = _read(os.path.join(self.dir, name))
                if counts is not None:
                    for k, v in counts.items():
                        totals[k] += v
        return totals

    def merge_dead(self) -> int:
        """Add the files of processes that are gone to ``merged.json`` and remove them; return
        how many were merged. Cheap when there are none (one ``flock`` attempt per file)."""
        with self._locked():
            return self._merge_locked()

    def _merge_locked(self) -> int:
        totals, absorbed = self._load_merged()
        for name in absorbed:  # added by the last merge, which stopped before removing them
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.dir, name))
        dead: list[tuple[str, int]] = []
        try:
            for name in self._files():
                path = os.path.join(self.dir, name)
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)  # its process (or a forked child of it) is alive
                    continue
                dead.append((name, fd))
            if not dead and not absorbed:
                return 0
            for name, _ in dead:
                counts = _read(os.path.join(self.dir, name)) or {}
                for k, v in counts.items():
                    totals[k] += v
            tmp = self._merged_path() + f".{os.getpid()}.tmp"
            try:
                with open(tmp, "w", encoding="utf-8") as f:
                    json.dump({"totals": totals, "absorbed": [n for n, _ in dead]}, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self._merged_path())
            except OSError as exc:
                if exc.errno not in NO_SPACE:
                    raise
                # A full disk: the files stay unmerged (and are read as they are) until later.
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                return 0
            for name, _ in dead:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.dir, name))
            return len(dead)
        finally:
            for _, fd in dead:
                os.close(fd)
