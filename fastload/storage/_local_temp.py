"""Temporary files and scratch directories of local writes, and removing those of dead writers.

Every temporary file (and scratch directory) a writer makes starts with :data:`TMP_PREFIX` and is
locked with ``flock(LOCK_EX)`` by its writer from just after it is created until it is renamed
into place or removed. The kernel drops the lock when the last descriptor of the writer's open
file goes away, i.e. when the writer (and any process that inherited the descriptor) has exited,
however it died. So :func:`remove_stale_temporaries` removes exactly the temporary files whose
owner is gone: it takes the lock without waiting, and a lock it cannot take belongs to a live
writer. A writer checks, once it holds its lock, that its file still has a name (a remover may
have taken the lock in the instant between creating and locking), and starts over if not.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import tempfile
from collections.abc import Callable

__all__ = ["TMP_PREFIX", "make_scratch_dir", "new_temp_file", "remove_stale_temporaries"]

#: Names of unfinished writes start with this; the local store never lists them and rejects such
#: keys.
TMP_PREFIX = ".fastload-tmp-"


def _try_lock(fd: int, *, wait: bool) -> bool:
    """``flock(LOCK_EX)``; False if another open file holds it (only when not waiting) or the
    file system cannot lock (then nobody can, and a remover leaves the file alone)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # EWOULDBLOCK: held; ENOLCK/EOPNOTSUPP/EINVAL: no locks on this file system
        return False
    return True


def _created_locked(create: Callable[[], tuple[int, str]]) -> tuple[int, str]:
    """``create()`` a file or directory (``(descriptor, path)``) and lock it; again when a
    remover deleted it before it was locked (its link count is then 0)."""
    while True:
        fd, path = create()
        try:
            _try_lock(fd, wait=True)
            if os.fstat(fd).st_nlink:
                return fd, path
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def new_temp_file(directory: str) -> tuple[int, str]:
    """A new, locked temporary file in ``directory``: ``(descriptor, path)``."""
    return _created_locked(lambda: tempfile.mkstemp(prefix=TMP_PREFIX, dir=directory))


def make_scratch_dir(directory: str | None = None, *, prefix: str = TMP_PREFIX) -> tuple[str, int]:
    """A new, locked scratch directory: ``(path, descriptor holding the lock)``.

    The lock lasts until the descriptor is closed; remove the directory before closing it, so that
    a dead owner's directory is the only kind :func:`remove_stale_temporaries` ever finds
    unlocked. ``directory=None`` means the system temporary directory.
    """

    def create() -> tuple[int, str]:
        path = tempfile.mkdtemp(prefix=prefix, dir=directory)
        flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
        return os.open(path, flags), path

    fd, path = _created_locked(create)
    return path, fd


def remove_stale_temporaries(directory: str, *, prefix: str = TMP_PREFIX) -> list[str]:
    """Remove the temporary files and scratch directories in ``directory`` (not below it) whose
    names start with ``prefix`` and whose writer is no longer alive; return their paths, sorted.

    Safe while other processes write into ``directory``: an entry is removed only while this
    function holds its ``flock``, which a live writer never lets go of (see the comment above).
    Entries that cannot be opened or locked (other owners, file systems without ``flock``),
    symbolic links and special files are left alone. A missing ``directory`` is not an error.
    """
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed: list[str] = []
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        try:
            if not (entry.is_file(follow_symlinks=False) or entry.is_dir(follow_symlinks=False)):
                continue
            fd = os.open(entry.path, flags)
        except OSError:
            continue
        try:
            if not _try_lock(fd, wait=False):
                continue  # a live writer's
            held, now = os.fstat(fd), os.lstat(entry.path)
            if (held.st_dev, held.st_ino) != (now.st_dev, now.st_ino):
                continue  # renamed or replaced since we opened it
            if stat.S_ISDIR(held.st_mode):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
            removed.append(entry.path)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed
