"""One conversion at a time per destination, and the removal of what killed runs left.

:class:`Guard` holds an ``flock`` on a local destination for the length of a run, and removes the
temporary files and scratch directories of writers that died. The lock's protocol (create, lock,
check that it is still the file at that path, record the holder for a refused run's message)
reads in one place here.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time

from fastload.convert._state import DONE_PREFIX, SKIPPED_KEY, STATE_PREFIX
from fastload.errors import (
    DatasetExistsError,
    InvalidArgumentError,
    StoreError,
    StorePermissionError,
)
from fastload.formats import MANIFEST_NAME
from fastload.storage import Store, remove_stale_temporaries

__all__ = ["LOCK_WAIT", "Guard", "check_not_inside"]

#: The lock file in the state directory. Its name is one of a local store's temporary names, so
#: the store never lists it as an object (nor lets a key name it).
_LOCK_NAME = ".fastload-tmp-convert.lock"
#: Seconds a new run waits for the lock, long enough for the processes of a run killed a moment
#: ago to be gone.
LOCK_WAIT = 2.0


class Guard:
    """One conversion at a time per destination, and the removal of what killed runs left.

    On a local destination (:class:`~fastload.storage.LocalStore`), :meth:`acquire` takes an
    exclusive ``flock`` on ``_fastload_convert/.fastload-tmp-convert.lock`` (waiting up to
    ``LOCK_WAIT`` seconds, then raising :class:`DatasetExistsError` naming the process that holds
    it). Forked workers inherit the lock, so it is held until every process of the run is gone.
    Holding it, the run removes the temporary files and LMDB scratch directories that dead
    writers left in the dataset root and the state directory. That is safe even while other
    processes write there: the store removes only a temporary file whose writer's own ``flock``
    is free, i.e. whose writer has exited (see ``LocalStore.remove_stale_temporaries``).
    :meth:`release` removes dead writers' files once more, then the lock file, then the state
    directory if nothing is left in it. On a file system without ``flock`` there is no guard,
    and nothing is removed.

    Other stores have no locks. A run removes LMDB scratch directories of dead processes from
    the system temporary directory, and, through the store's ``abort_incomplete_writes(prefix)``
    (S3: multipart uploads), the unfinished uploads of the dataset's own keys
    (``{prefix}-*``, the state, the manifest and the skip report), once it knows the destination
    holds this conversion (or nothing, or ``overwrite`` was asked). Two conversions into one
    object-store destination at once are not supported: the later one aborts the earlier one's
    uploads, which then fails naming the shard and can be re-run.
    """

    def __init__(self, store: Store, format_name: str) -> None:
        self.store = store
        self.format_name = format_name
        source = store.uncached
        #: The destination's local directory, if it is one (and writable).
        self.local_root = source.local_root if source.supports_writes else None
        self._fd: int | None = None
        self._path = ""

    def _dirs(self, root: str) -> list[str]:
        state = os.path.join(root, STATE_PREFIX.rstrip("/"))
        return [root, state, os.path.join(state, DONE_PREFIX[len(STATE_PREFIX) :].rstrip("/"))]

    def acquire(self) -> None:
        """Take the destination and remove what dead runs left (see the class docstring)."""
        if self.local_root is not None:
            self._lock(self.local_root)
            self._sweep()
        elif self.format_name == "lmdb":
            from fastload.formats.lmdb._writer import remove_stale_scratch

            remove_stale_scratch()

    def _lock(self, root: str) -> None:
        state = self._dirs(root)[1]
        path = os.path.join(state, _LOCK_NAME)
        deadline = time.monotonic() + LOCK_WAIT
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        holder = ""
        while time.monotonic() < deadline:
            try:
                os.makedirs(state, exist_ok=True)
                fd = os.open(path, flags, 0o644)
            except FileNotFoundError:  # a run that just finished removed the directory
                continue
            except OSError as exc:
                error = StorePermissionError if isinstance(exc, PermissionError) else StoreError
                raise error(
                    f"cannot create the conversion lock {path}: {exc.strerror}; the destination "
                    "directory must be writable",
                    url=self.store.url,
                ) from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # held by a live conversion (or one dying this instant)
                holder = _read_holder(fd)
                os.close(fd)
                time.sleep(0.05)
                continue
            except OSError:  # no locks on this file system: no guard
                self._fd, self._path = fd, path
                return
            try:
                held, now = os.fstat(fd), os.stat(path)
                same = (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)
            except FileNotFoundError:
                same = False
            if not same:  # removed by the run that held it before us: lock the new one
                os.close(fd)
                continue
            self._fd, self._path = fd, path
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}".encode(), 0)
            except OSError:
                pass  # only for the message of a run that finds it busy
            return
        raise DatasetExistsError(
            f"{self.store.url} is being written by another fastload convert "
            f"({holder or 'it holds the lock ' + path}); wait for it to finish (the same "
            "command then finds the dataset complete), or stop it and re-run this command to "
            "resume"
        )

    def _sweep(self) -> None:
        if self.local_root is not None:
            for directory in self._dirs(self.local_root):
                remove_stale_temporaries(directory)

    def abort_uploads(self, prefix: str) -> None:
        """Abort the unfinished uploads of the dataset's keys, on stores that keep them."""
        if self.local_root is not None:
            return
        for key_prefix in (f"{prefix}-", STATE_PREFIX, MANIFEST_NAME, SKIPPED_KEY):
            self.store.abort_incomplete_writes(key_prefix)

    def release(self) -> None:
        """Remove dead writers' files, the lock file and the empty state directory; unlock."""
        fd = self._fd
        if fd is None or self.local_root is None:
            return
        self._fd = None
        try:
            self._sweep()
            try:
                held, now = os.fstat(fd), os.stat(self._path)
                if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
                    os.unlink(self._path)  # while locked; a waiting run then makes a new one
            except OSError:
                pass
            for directory in reversed(self._dirs(self.local_root)[1:]):
                try:
                    os.rmdir(directory)
                except OSError:
                    pass  # not empty: the state of an unfinished conversion
        finally:
            os.close(fd)


def _read_holder(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""


def check_not_inside(src: Store, one_file: bool, dst: Store) -> None:
    """Refuse a local destination inside the local source directory ``src`` (it would become
    input), unless the source is given as its files (``one_file``).

    Raises:
        InvalidArgumentError: ``dst`` is ``src`` or inside it.
    """
    src_root = getattr(src, "root", None)
    dst_root = getattr(dst, "root", None)
    if not isinstance(src_root, str) or not isinstance(dst_root, str) or one_file:
        return
    src_real, dst_real = os.path.realpath(src_root), os.path.realpath(dst_root)
    if dst_real == src_real or dst_real.startswith(src_real.rstrip(os.sep) + os.sep):
        raise InvalidArgumentError(
            f"the destination {dst.url} is inside the source {src.url}; the shards would "
            "become part of the input. Choose a destination outside the source directory"
        )
