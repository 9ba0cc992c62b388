"""Writes one LMDB environment per shard, as a single file, through any store."""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import lmdb

from fastload._fsutil import fsync_dir
from fastload.errors import FormatError, InvalidArgumentError, ReadOnlyStoreError
from fastload.formats._base import ShardInfo, ShardWriter
from fastload.formats._sample import encode_sample
from fastload.formats.lmdb._layout import (
    META_KEY,
    POSITION_PREFIX,
    pack_meta,
    position_key,
    value_parts,
)
from fastload.formats.lmdb._sizing import PageCount
from fastload.storage import (
    Store,
    make_scratch_dir,
    remove_stale_temporaries,
    validate_key,
)

__all__ = ["LMDBWriter", "remove_stale_scratch"]

#: Name prefix of the writer's scratch directory beside a local shard; LocalStore never lists
#: names with this prefix, and removes them once their writer is dead.
_TMP_PREFIX = ".fastload-tmp-lmdb-"
#: Name prefix of the scratch directory in the system temporary directory (other stores).
_SCRATCH_PREFIX = "fastload-lmdb-scratch-"
#: Block size when streaming the finished file to a store that is not a local directory.
_COPY_CHUNK = 8 * 1024 * 1024
#: Values are gathered and written to the spill file when this many bytes (or pieces) are pending.
_SPILL_BYTES = 1024 * 1024
_SPILL_PIECES = 512


def _local_target(store: Store, key: str) -> str | None:
    """The file path ``key`` will have, for stores whose objects are plain files we can rename into."""
    root = store.local_root
    if root is not None:
        validate_key(key, url=store.url)
        return os.path.join(root, *key.split("/"))
    return None


def _open_env(path: str, map_size: int) -> Any:
    """A new environment at ``path`` in LMDB 0.9's data format (version 1), written through a
    shared writable map (no dirty-page copies in memory) and never synced by LMDB (the writer
    flushes the finished file itself)."""
    options: dict[str, Any] = dict(
        subdir=False,
        lock=False,
        map_size=map_size,
        writemap=True,
        sync=False,
        metasync=False,
        readahead=False,
        max_dbs=0,
    )
    try:
        return lmdb.open(path, lib_version=0, **options)  # py-lmdb >= 3 bundles two LMDBs
    except TypeError:  # older py-lmdb: LMDB 0.9 only
        return lmdb.open(path, **options)


def _cleanup(path: str, lock_fd: int, owner: int) -> None:
    """Remove the scratch directory, then let go of its lock (in this order: an unlocked scratch
    directory is a dead writer's). In a forked child (which inherited the writer) only the
    child's copy of the descriptor is closed: the directory is the parent's."""
    try:
        if os.getpid() == owner:
            shutil.rmtree(path, ignore_errors=True)
    finally:
        os.close(lock_fd)


def remove_stale_scratch(directory: str | None = None) -> list[str]:
    """Remove scratch directories that LMDB writers for non-local stores left in ``directory``
    (default: the system temporary directory) when their process was killed; return their paths.

    A live writer (in any process) holds a lock on its directory, which is never removed.
    Scratch directories beside local shards (``.fastload-tmp-lmdb-*``) are the local store's
    temporaries: :meth:`~fastload.storage.LocalStore.remove_stale_temporaries` removes those.
    """
    return remove_stale_temporaries(directory or tempfile.gettempdir(), prefix=_SCRATCH_PREFIX)


def _write_all(fd: int, parts: list[bytes]) -> None:
    """Write ``parts`` one after another at ``fd``'s position, with as few system calls as the
    kernel allows (one gathering write, unless it is cut short)."""
    written = os.writev(fd, parts)
    if written == sum(len(p) for p in parts):
        return
    rest = memoryview(b"".join(parts))[written:]  # rare: a signal or a full disk cut it short
    while rest:
        rest = rest[os.write(fd, rest) :]


class LMDBWriter(ShardWriter):
    """Writes samples into one LMDB shard (see the package README for the layout).

    :meth:`write` appends each sample's value (the msgpack map of its fields) to a spill file in a
    scratch directory (beside the final file for a :class:`~fastload.storage.LocalStore`, else in
    the system temporary directory) and keeps only keys and offsets in memory. :meth:`close`
    builds the LMDB file in one write transaction, inserting the meta key, the position entries
    and then the samples in key order with ``MDB_APPEND`` straight into the file's writable map:
    full pages, no free pages, no copy. It then publishes the file atomically: a ``rename`` for a
    local store, a streamed upload through :meth:`~fastload.storage.Store.open_writer` otherwise,
    hashing it on the way. Nothing is visible under ``key`` before :meth:`close` returns;
    :meth:`abort` (or garbage collection) removes the scratch files. The writer holds an
    ``flock`` on its scratch directory while it lives; the directory of a killed process stays
    until :meth:`~fastload.storage.LocalStore.remove_stale_temporaries` (beside local shards)
    or :func:`remove_stale_scratch` (system temporary directory) removes it; ``fastload
    convert`` calls both for its destination.

    Determinism: the same samples in the same order give byte-identical shards on machines with
    the same page size: the file's bytes depend only on the entries and their order, never on
    timing, the store or memory contents.

    The scratch directory needs about twice the shard's size while :meth:`close` runs (the spill
    file and the new file). A writer is used by one thread.

    Args:
        store: Where the shard goes.
        key: The shard's key, e.g. ``"train-000000.lmdb"``.
        index: Ignored: an LMDB shard is its own index, so no ``.idx`` object is written.
        fsync: For a local store, flush the shard to the device before renaming it into place;
            ``None`` (default) does what the store does for its own writes.

    Raises:
        ReadOnlyStoreError: The store does not accept writes.
    """

    def __init__(
        self,
        store: Store,
        key: str,
        *,
        index: bool = True,
        fsync: bool | None = None,
    ) -> None:
        super().__init__(store, key, index=False)
        self.url = store.child_url(key)
        validate_key(key, url=store.url)
        if not store.supports_writes:
            raise ReadOnlyStoreError(
                f"store {store.url} was opened read-only; cannot write {key!r}", url=self.url
            )
        if fsync is None:  # follow the store's own durability setting
            fsync = bool(getattr(store, "fsync", getattr(store, "_fsync", True)))
        self._fsync = fsync
        self._target = _local_target(store, key)
        # A scratch directory locked while this writer lives (see make_scratch_dir), so that a
        # killed writer's directory can be told from a live one's and removed.
        if self._target is not None:
            directory = os.path.dirname(self._target)
            os.makedirs(directory, exist_ok=True)
            self._workdir, lock_fd = make_scratch_dir(directory, prefix=_TMP_PREFIX)
        else:
            self._workdir, lock_fd = make_scratch_dir(None, prefix=_SCRATCH_PREFIX)
        self._finalizer = weakref.finalize(self, _cleanup, self._workdir, lock_fd, os.getpid())
        # A file object, so that garbage collection closes it (the finalizer removes the files).
        self._spill = open(os.path.join(self._workdir, "values"), "xb", buffering=0)  # noqa: SIM115
        self._spill_size = 0  # bytes of values so far, written or pending
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._psize = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._max_key = 511  # LMDB's default MDB_MAXKEYSIZE
        self._keys: set[bytes] = set()
        self._entries: list[tuple[bytes, int, int]] = []  # (key, offset, length), insertion order
        self._pages = PageCount(self._psize)
        self._pages.add(len(META_KEY), len(pack_meta(0)) + 8, reserved=True)
        self._closed = False
        self._failed: BaseException | None = None  # a spill write that failed part-way

    # ---- writing ------------------------------------------------------------------------------

    def write(self, sample: Mapping[str, Any]) -> None:
        """Append one sample; see :class:`~fastload.formats.ShardWriter`.

        Raises:
            InvalidArgumentError: No valid ``__key__``, a field that cannot be encoded (or is
                4 GiB or larger), a key longer than LMDB allows (511 UTF-8 bytes), or a key
                already written to this shard.
            OSError: The spill file cannot be written (e.g. the disk is full).
        """
        if self._closed:
            raise InvalidArgumentError(f"write to a closed LMDB shard writer ({self.url})")
        encoded = encode_sample(sample)
        key = str(encoded.pop("__key__"))
        kbytes = key.encode("utf-8")
        if len(kbytes) > self._max_key:
            raise InvalidArgumentError(
                f"sample key {key!r} is {len(kbytes)} UTF-8 bytes; LMDB keys are at most "
                f"{self._max_key} bytes ({self.url}). Shorten the key, e.g. hash the long part"
            )
        if kbytes in self._keys:
            raise InvalidArgumentError(
                f"sample key {key!r} was already written to {self.url}; keys in one LMDB shard "
                "must be unique"
            )
        try:
            parts = value_parts(encoded)
        except ValueError as exc:
            raise InvalidArgumentError(f"cannot store sample {key!r} in {self.url}: {exc}") from exc
        length = sum(len(p) for p in parts)
        self._keys.add(kbytes)
        self._entries.append((kbytes, self._spill_size, length))
        self._spill_size += length
        self._pending += parts
        self._pending_bytes += length
        self._pages.add(len(kbytes), length)
        self._pages.add(len(POSITION_PREFIX) + 8, len(kbytes), reserved=True)
        self._count_fields(sample)
        if self._pending_bytes >= _SPILL_BYTES or len(self._pending) >= _SPILL_PIECES:
            self._drain()

    def _drain(self) -> None:
        """Write the pending values to the spill file. A failure (e.g. a full disk) leaves the
        spill file incomplete, so the writer refuses to go on; it must be aborted."""
        if self._failed is not None:
            raise FormatError(
                f"an earlier write to the scratch file of {self.url} failed ({self._failed}); "
                "abort this writer and write the shard again",
                url=self.url,
            ) from self._failed
        if self._pending:
            try:
                _write_all(self._spill.fileno(), self._pending)
            except BaseException as exc:
                self._failed = exc
                raise
            self._pending = []
            self._pending_bytes = 0

    @property
    def num_bytes(self) -> int:
        """Expected size of the shard so far, in bytes (LMDB's page arithmetic for the samples
        written; typically within 1 % of the published size). O(1)."""
        return self._pages.estimate()

    # ---- finishing ----------------------------------------------------------------------------

    def close(self) -> ShardInfo:
        """Build the shard, publish it atomically and return its :class:`ShardInfo`.

        ``index_key`` is ``None``: the shard is its own index. On failure nothing is published and
        the scratch files are removed.

        Raises:
            FormatError: LMDB failed while building the file.
            OSError: Writing the file or publishing it failed (e.g. the disk is full).
        """
        if self._closed:
            raise InvalidArgumentError(f"LMDB shard writer for {self.url} is already closed")
        try:
            self._drain()
            self._spill.close()
            path = os.path.join(self._workdir, "shard.lmdb")
            self._build(path)
            info = self._publish(path)
        except lmdb.Error as exc:
            self.abort()
            raise FormatError(
                f"LMDB failed while building shard {self.url} in {self._workdir}: {exc}",
                url=self.url,
            ) from exc
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self._finalizer()
        return info

    def _build(self, path: str) -> None:
        """Write the LMDB file at ``path``: one transaction, every key in order, with a map size
        computed from the entries (grown and rebuilt in the unexpected case that it is short)."""
        map_size = self._pages.bound()
        spill_path = os.path.join(self._workdir, "values")
        with open(spill_path, "rb") as spill_file:
            spill = (
                mmap.mmap(spill_file.fileno(), 0, access=mmap.ACCESS_READ)
                if self._spill_size
                else None
            )
            values = memoryview(spill if spill is not None else b"")
            try:
                while not self._build_once(path, map_size, values):
                    map_size *= 2
            finally:
                values.release()
                if spill is not None:
                    spill.close()
        os.unlink(spill_path)

    def _build_once(self, path: str, map_size: int, values: memoryview) -> bool:
        """One attempt at :meth:`_build`; False when the map was too small (nothing is left)."""
        if os.path.exists(path):
            os.unlink(path)
        env = _open_env(path, map_size)
        try:
            self._reserve(path, env.info()["map_size"])
            with env.begin(write=True) as txn:
                cursor = txn.cursor()
                expected = 1 + 2 * len(self._entries)
                _, added = cursor.putmulti(self._items(values), append=True)
                cursor.close()
                if added != expected:  # pragma: no cover - keys are unique and sorted
                    raise FormatError(
                        f"LMDB stored {added} of {expected} entries of shard {self.url}",
                        url=self.url,
                    )
            last_page: int = env.info()["last_pgno"]
            psize: int = env.stat()["psize"]
        except lmdb.MapFullError:
            last_page = -1
            psize = 0
        finally:
            env.close()
        if last_page < 0:
            os.unlink(path)
            return False
        # LMDB sized the file to the whole map; the data ends at the last page.
        os.truncate(path, (last_page + 1) * psize)
        return True

    def _items(self, values: memoryview) -> Iterator[tuple[bytes, Any]]:
        """Every entry in ascending key order: the meta key (``b"\\x00fastload/m…"``), the
        position entries (``b"\\x00fastload/p…"`` + big-endian position), then the samples
        (which never start with NUL)."""
        yield META_KEY, pack_meta(len(self._entries))
        for position, (kbytes, _, _) in enumerate(self._entries):
            yield position_key(position), kbytes
        for kbytes, offset, length in sorted(self._entries):
            value = values[offset : offset + length]
            yield kbytes, value
            value.release()

    def _reserve(self, path: str, size: int) -> None:
        """Allocate the file's blocks up front, so that a full disk is an ``OSError`` here
        rather than a ``SIGBUS`` while LMDB writes through its map."""
        if not hasattr(os, "posix_fallocate"):
            return
        fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return  # the file system cannot reserve space; LMDB's writes still work
            exc.add_note(f"while reserving {size} bytes for LMDB shard {self.url} at {path}")
            raise
        finally:
            os.close(fd)

    def _publish(self, path: str) -> ShardInfo:
        """Hash the finished file and move it to its destination: a rename over the target for a
        local store (flushed to the device meanwhile, if asked), else the store's streamed
        writer."""
        sha = hashlib.sha256()
        with open(path, "rb") as src:
            size = os.fstat(src.fileno()).st_size
            flush = _Flush(src.fileno()) if self._target is not None and self._fsync else None
            try:
                if self._target is not None:
                    _hash_mapped(sha, src.fileno(), size)
                else:
                    _upload(src, self.store, self.key, sha)
            finally:
                if flush is not None:
                    flush.wait()
            if self._target is not None:
                os.replace(path, self._target)
                if self._fsync:
                    fsync_dir(os.path.dirname(self._target))
        return self._shard_info(num_bytes=size, sha256=sha.hexdigest(), index_key=None)

    def abort(self) -> None:
        """Discard the shard and its scratch files; nothing becomes visible. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pending = []
        try:
            self._spill.close()
        finally:
            self._finalizer()


def _hash_mapped(sha: Any, fd: int, size: int) -> None:
    """Feed the file's first ``size`` bytes to ``sha`` through a memory map (no copy)."""
    if not size:
        return
    with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as data:
        data.madvise(mmap.MADV_SEQUENTIAL)
        with memoryview(data) as view:
            sha.update(view)


def _upload(src: Any, store: Store, key: str, sha: Any) -> None:
    """Stream ``src`` to ``store`` under ``key`` in blocks, feeding ``sha`` on the way."""
    buf = bytearray(_COPY_CHUNK)
    view = memoryview(buf)
    with store.open_writer(key) as writer:
        while True:
            n = src.readinto(buf)
            if not n:
                break
            sha.update(view[:n])
            writer.write(view[:n])


class _Flush:
    """``fsync`` of a file descriptor in a helper thread (the call releases the GIL), so that the
    device write overlaps the caller's hashing; :meth:`wait` re-raises its error."""

    def __init__(self, fd: int) -> None:
        self._error: OSError | None = None
        self._thread = threading.Thread(
            target=self._run, args=(fd,), name="fastload-lmdb-fsync", daemon=True
        )
        self._thread.start()

    def _run(self, fd: int) -> None:
        try:
            os.fsync(fd)
        except OSError as exc:
            self._error = exc

    def wait(self) -> None:
        """Block until the flush is done; raise its ``OSError``, if any."""
        self._thread.join()
        if self._error is not None:
            raise self._error
