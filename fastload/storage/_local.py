"""Local filesystem store: objects are files under a root directory.

Temporary files of unfinished writes, and the removal of those whose writer died, live in
:mod:`fastload.storage._local_temp` (re-exported here).
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import stat
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote, urlsplit

from fastload._fsutil import fsync_dir
from fastload.errors import (
    InvalidArgumentError,
    InvalidKeyError,
    ObjectNotFoundError,
    StoreError,
    StorePermissionError,
)
from fastload.storage._base import ObjectWriter, Store
from fastload.storage._keys import (
    ByteRange,
    ObjectMeta,
    check_range,
    prefix_directory,
    validate_key,
    validate_prefix,
)
from fastload.storage._local_temp import (
    TMP_PREFIX,
    make_scratch_dir,
    new_temp_file,
    remove_stale_temporaries,
)

__all__ = ["LocalStore", "make_scratch_dir", "remove_stale_temporaries"]

_O_RDONLY = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
_PATH_CACHE_SIZE = 1 << 16  # validated key -> path entries kept per store (then cleared)


def _etag(st: os.stat_result) -> str:
    """The etag of a file with status ``st``: changes when a write replaces it."""
    return f"{st.st_mtime_ns:x}-{st.st_size:x}"


class _LocalReader(io.BufferedReader):
    """A file opened by :meth:`LocalStore.open_reader`, with the version it reads."""

    version: str | None = None


class _LocalWriter(ObjectWriter):
    """Writes to a locked temporary file beside the target, then fsync + rename on commit (the
    lock is held until after the rename, so a remover of stale temporaries never takes it)."""

    def __init__(self, store: LocalStore, key: str, path: str, fsync: bool) -> None:
        super().__init__()
        self._store, self._key, self._path, self._fsync = store, key, path, fsync
        directory = os.path.dirname(path)
        try:
            os.makedirs(directory, exist_ok=True)
            fd, self._tmp = new_temp_file(directory)
        except OSError as exc:
            raise store._translate(exc, key, writing=True) from exc
        self._file = os.fdopen(fd, "wb", buffering=1 << 20)

    def _write(self, data: memoryview) -> None:
        try:
            self._file.write(data)
        except OSError as exc:
            raise self._store._translate(exc, self._key, writing=True) from exc

    def _commit(self) -> None:
        try:
            try:
                self._file.flush()
                if self._fsync:
                    os.fsync(self._file.fileno())
                os.fchmod(self._file.fileno(), 0o666 & ~_umask())
                os.replace(self._tmp, self._path)
            finally:
                self._file.close()  # releases the lock, after the rename
        except OSError as exc:
            raise self._store._translate(exc, self._key, writing=True) from exc
        if self._fsync:
            fsync_dir(os.path.dirname(self._path))

    def _abort(self) -> None:
        try:
            os.unlink(self._tmp)  # while still locked
        except OSError:
            pass
        try:
            self._file.close()
        except OSError:
            pass  # buffered bytes that cannot be written (a full disk) belong to a removed file


_UMASK: int | None = None


def _umask() -> int:
    global _UMASK
    if _UMASK is None:
        current = os.umask(0)
        os.umask(current)
        _UMASK = current
    return _UMASK


class LocalStore(Store):
    """Objects as files under ``root``; keys map to relative paths.

    Reads use ``os.pread`` on a fresh descriptor (no shared file position, so threads and forked
    workers can read concurrently). Writes go to a temporary file in the target's directory, are
    fsynced, then renamed over the target, so readers never see a partial object. Temporary files
    start with ``.fastload-tmp-`` and are never listed; keys with a segment of that name are
    rejected. A writer holds an ``flock`` on its temporary file until it commits or aborts; a
    temporary file left by a killed writer stays on disk (invisible) until
    :meth:`remove_stale_temporaries` (which ``fastload convert`` calls on its destination)
    removes it, and that never touches a live writer's file.

    Filesystem limits: a key cannot be both an object and a prefix of another key followed by
    ``/`` (``a`` and ``a/b``), since ``a`` would have to be a file and a directory; such a write
    raises :class:`~fastload.errors.InvalidKeyError`. Symbolic links inside the root are followed.

    Args:
        root: Directory holding the objects. Created on first write.
        read_only: Refuse ``put``, ``open_writer`` and ``delete``.
        fsync: Flush file data and directory entries to the device on commit (durable against power
            loss). Turn off only for scratch data.
    """

    has_local_paths = True

    def __init__(
        self, root: str | os.PathLike[str], *, read_only: bool = False, fsync: bool = True
    ):
        self._root = os.path.abspath(os.fspath(root))
        self._root_sep = self._root.rstrip("/") + "/"
        # key -> validated, encoded path, for reads; per process, never pickled
        self._paths: dict[str, bytes] = {}
        super().__init__(read_only=read_only)
        self._fsync = fsync

    @classmethod
    def from_url(cls, url: str, **options: Any) -> LocalStore:
        """Open ``/path``, ``relative/path`` or ``file:///path``."""
        if url.startswith("file://"):
            parts = urlsplit(url)
            if parts.netloc not in ("", "localhost"):
                raise InvalidArgumentError(
                    f"file:// URL {url!r} names host {parts.netloc!r}; use file:///absolute/path"
                )
            url = unquote(parts.path)
        if not url:
            raise InvalidArgumentError("empty local path; pass a directory such as ./data")
        return cls(url, **options)

    @property
    def url(self) -> str:
        return "file://" + self._root

    @property
    def root(self) -> str:
        """Absolute path of the root directory."""
        return self._root

    @property
    def local_root(self) -> str:
        return self.root

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self._root, self._read_only, self._fsync))

    # ---- helpers ----------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        """The file path of ``key``, validated."""
        return self._make_path(key)

    def _read_path(self, key: str) -> bytes:
        """The file path of ``key``, validated and encoded; cached, as small reads are hot."""
        try:
            path = self._paths.get(key)
        except TypeError:  # unhashable: not a str; _make_path raises the proper error
            path = None
        if path is None:
            path = os.fsencode(self._make_path(key))
            if len(self._paths) >= _PATH_CACHE_SIZE:
                self._paths.clear()
            self._paths[key] = path
        return path

    def _make_path(self, key: str) -> str:
        validate_key(key, url=self.url)
        if TMP_PREFIX in key and any(p.startswith(TMP_PREFIX) for p in key.split("/")):
            raise InvalidKeyError(
                f"store key {key!r} has a segment starting with {TMP_PREFIX!r}, which "
                f"{self.url} reserves for temporary files of unfinished writes",
                url=self.child_url(key),
            )
        if os.sep == "/":
            return self._root_sep + key
        return os.path.join(self._root, *key.split("/"))  # pragma: no cover - not POSIX

    def _translate(self, exc: OSError, key: str, *, writing: bool = False) -> StoreError:
        where = self.child_url(key)
        if writing and exc.errno in (errno.ENOTDIR, errno.EISDIR, errno.EEXIST):
            return InvalidKeyError(
                f"cannot write {where}: on a local store a key cannot be both an object and a "
                f"directory of other objects (as with 'a' and 'a/b'); rename one of them ({exc})",
                url=where,
            )
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.EISDIR):
            return ObjectNotFoundError(f"no object {where}", url=where)
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return StorePermissionError(
                f"permission denied on {where}: {exc.strerror}; check the directory's owner and mode",
                url=where,
            )
        return StoreError(f"I/O error on {where}: {exc}", url=where)

    # ---- Store API --------------------------------------------------------------------------

    def get(self, key: str, byte_range: ByteRange | None = None) -> bytes:
        # The hot path of random access: keep it lean (benchmarks/bench_storage.py measures it).
        try:
            path = self._paths[key]
        except (KeyError, TypeError):
            path = self._read_path(key)
        try:
            fd = os.open(path, _O_RDONLY)
        except OSError as exc:
            raise self._translate(exc, key) from exc
        try:
            if byte_range is not None:
                start = byte_range.start
                length = byte_range.end - start
                if length:
                    # No fstat: a short read tells us the range may reach past the end, and only
                    # then do we look at the size.
                    data = os.pread(fd, length, start)
                    if len(data) == length:
                        return data
                    return self._finish_short_read(fd, key, start, length, data)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ObjectNotFoundError(
                    f"no object {self.child_url(key)} (it is a directory)",
                    url=self.child_url(key),
                )
            if byte_range is not None:  # empty range: only check that it lies within the object
                check_range(byte_range, st.st_size, url=self.child_url(key))
                return b""
            if st.st_size == 0:
                return b""
            data = os.pread(fd, st.st_size, 0)
            if len(data) == st.st_size:
                return data
            return self._finish_short_read(fd, key, 0, st.st_size, data)
        except OSError as exc:
            if isinstance(exc, StoreError):
                raise
            raise self._translate(exc, key) from exc
        finally:
            os.close(fd)

    def _finish_short_read(self, fd: int, key: str, start: int, length: int, data: bytes) -> bytes:
        """Complete a short ``pread``: a range past the end, or a short read on a slow filesystem."""
        size = os.fstat(fd).st_size
        if start + length > size:
            check_range(ByteRange(start, start + length), size, url=self.child_url(key))
        parts = [data]
        got = len(data)
        while got < length:
            more = os.pread(fd, length - got, start + got)
            if not more:
                raise StoreError(
                    f"{self.child_url(key)} shrank while being read (it was replaced in place, "
                    "not atomically); retry the read",
                    url=self.child_url(key),
                )
            parts.append(more)
            got += len(more)
        return b"".join(parts)

    def head(self, key: str) -> ObjectMeta:
        path = self._read_path(key)
        try:
            st = os.stat(path)
        except OSError as exc:
            raise self._translate(exc, key) from exc
        if not stat.S_ISREG(st.st_mode):
            raise ObjectNotFoundError(
                f"no object {self.child_url(key)} (it is a directory)", url=self.child_url(key)
            )
        return ObjectMeta(key, st.st_size, st.st_mtime, _etag(st))

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        validate_prefix(prefix, url=self.url)
        # Walk only the directory that can contain the prefix.
        head = prefix_directory(prefix)
        if head is None:
            return
        start = os.path.join(self._root, *head.split("/")) if head else self._root
        if not os.path.isdir(start):
            return
        yield from self._walk(start, head + "/" if head else "", prefix)

    def _walk(self, directory: str, rel: str, prefix: str) -> Iterator[ObjectMeta]:
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise self._translate(exc, rel or ".") from exc
        # Keys sort by full string; a directory "a" sorts its children "a/..." after "a-b" but
        # before "a0" since '/' < '0'. Sort entries by the key they produce.
        items = []
        for entry in entries:
            if entry.name.startswith(TMP_PREFIX):
                continue
            key = rel + entry.name
            try:
                is_dir = entry.is_dir(follow_symlinks=True)
            except OSError:
                continue
            items.append((key + "/" if is_dir else key, entry, is_dir))
        items.sort(key=lambda t: t[0])
        for sort_key, entry, is_dir in items:
            if is_dir:
                if sort_key.startswith(prefix) or prefix.startswith(sort_key):
                    yield from self._walk(entry.path, sort_key, prefix)
            elif sort_key.startswith(prefix):
                try:
                    st = entry.stat(follow_symlinks=True)
                except FileNotFoundError:
                    continue
                yield ObjectMeta(
                    sort_key, st.st_size, st.st_mtime, f"{st.st_mtime_ns:x}-{st.st_size:x}"
                )

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        self._put_through_writer(key, data)  # the writer checks that the store is writable

    def open_writer(self, key: str) -> ObjectWriter:
        self._check_writable(key)
        return _LocalWriter(self, key, self._path(key), self._fsync)

    def delete(self, key: str) -> None:
        self._check_writable(key)
        path = self._path(key)
        try:
            os.unlink(path)
        except OSError as exc:
            raise self._translate(exc, key) from exc
        # Remove now-empty parent directories up to the root, as object stores have no directories.
        parent = os.path.dirname(path)
        while parent != self._root and parent.startswith(self._root):
            try:
                os.rmdir(parent)
            except OSError:
                break
            parent = os.path.dirname(parent)

    def open_reader(self, key: str, *, chunk_size: int = 0) -> io.BufferedIOBase:
        """The file, opened for reading; its ``version`` is the etag :meth:`head` gives the file
        opened (a file replaced meanwhile, as writes replace them, is not the one read)."""
        path = self._path(key)
        try:
            raw = io.FileIO(path, "rb")
        except OSError as exc:
            raise self._translate(exc, key) from exc
        reader = _LocalReader(raw, buffer_size=max(chunk_size, 1 << 20))
        reader.version = _etag(os.fstat(raw.fileno()))
        return reader

    def remove_stale_temporaries(self, prefix: str = "") -> builtins.list[str]:
        """Remove temporary files and scratch directories left by writers that died (killed
        processes) in the directory that holds the keys starting with ``prefix`` (``""``: the
        root; ``"a/b/"``: directory ``a/b``; not below it). Live writers' files are kept, also
        those of other processes. Returns the removed paths.

        Raises:
            ReadOnlyStoreError: The store was opened read-only.
        """
        self._check_writable(prefix)
        validate_prefix(prefix, url=self.url)
        head = prefix_directory(prefix)
        if head is None:
            return []  # no key lives there
        directory = os.path.join(self._root, *head.split("/")) if head else self._root
        return remove_stale_temporaries(directory)

    def local_path(self, key: str) -> str | None:
        path = self._path(key)
        if not os.path.isfile(path):
            raise ObjectNotFoundError(f"no object {self.child_url(key)}", url=self.child_url(key))
        return path


def _rebuild(root: str, read_only: bool, fsync: bool) -> LocalStore:
    return LocalStore(root, read_only=read_only, fsync=fsync)
