"""Writes one LMDB environment per shard, as a single file, through any store."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import lmdb

from fastload.errors import FormatError, InvalidArgumentError, ReadOnlyStoreError
from fastload.formats._base import ShardInfo, ShardWriter
from fastload.formats._sample import encode_sample
from fastload.formats.lmdb._layout import META_KEY, pack_meta, pack_value, position_key
from fastload.storage import LocalStore, Store, validate_key

__all__ = ["LMDBWriter"]

#: Name prefix of the writer's scratch directory; LocalStore never lists names with this prefix.
_TMP_PREFIX = ".fastload-tmp-lmdb-"
_COPY_CHUNK = 8 * 1024 * 1024
#: Bytes LMDB spends per entry besides key and value (node header), and per page (header).
_NODE_OVERHEAD = 16


def _local_target(store: Store, key: str) -> str | None:
    """The file path ``key`` will have, for stores whose objects are plain files we can rename into."""
    if store.has_local_paths and isinstance(store, LocalStore):
        validate_key(key, url=store.url)
        return os.path.join(store.root, *key.split("/"))
    return None


def _open_build_env(path: str, map_size: int) -> Any:
    """The scratch environment, in LMDB 0.9's data format (version 1) whatever py-lmdb's default."""
    options: dict[str, Any] = dict(
        subdir=False,
        lock=False,
        map_size=map_size,
        sync=False,
        metasync=False,
        readahead=False,
        max_dbs=0,
    )
    try:
        return lmdb.open(path, lib_version=0, **options)  # py-lmdb >= 3 bundles two LMDBs
    except TypeError:  # older py-lmdb: LMDB 0.9 only
        return lmdb.open(path, **options)


def _cleanup(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


class LMDBWriter(ShardWriter):
    """Writes samples into one LMDB shard (see the package README for the layout).

    Samples are collected in an LMDB environment in a scratch file (beside the final file for a
    :class:`~fastload.storage.LocalStore`, else in the system temporary directory), committed in
    batches. :meth:`close` writes the reserved keys, makes a compacted copy of the environment (only
    live pages, no free list) and publishes it atomically: a ``rename`` for a local store, a streamed
    upload through :meth:`~fastload.storage.Store.open_writer` otherwise. Nothing is visible under
    ``key`` before :meth:`close` returns; :meth:`abort` (or garbage collection) removes the scratch
    files.

    The map size grows by itself: when a batch does not fit, the environment's map is enlarged and
    the batch retried, so callers never see ``MapFullError``.

    Determinism: the same samples written with the same ``map_size`` and ``batch_bytes`` on a
    machine with the same page size give byte-identical shards. LMDB leaves the unused tails of
    some pages holding stale bytes of this same shard, whose content depends on the batching, so
    different batch settings may give different (equally valid) bytes.

    A writer is used by one thread.

    Args:
        store: Where the shard goes.
        key: The shard's key, e.g. ``"train-000000.lmdb"``.
        index: Ignored: an LMDB shard is its own index, so no ``.idx`` object is written.
        map_size: Initial LMDB map size in bytes (it grows by doubling as needed).
        batch_bytes: Commit a write transaction after about this many bytes of values.
        fsync: For a local store, flush the shard to the device before renaming it into place;
            ``None`` (default) does what the store does for its own writes.

    Raises:
        InvalidArgumentError: Non-positive ``map_size`` or ``batch_bytes``.
        ReadOnlyStoreError: The store does not accept writes.
    """

    def __init__(
        self,
        store: Store,
        key: str,
        *,
        index: bool = True,
        map_size: int = 64 * 1024 * 1024,
        batch_bytes: int = 32 * 1024 * 1024,
        fsync: bool | None = None,
    ) -> None:
        super().__init__(store, key, index=False)
        if map_size <= 0 or batch_bytes <= 0:
            raise InvalidArgumentError(
                f"map_size and batch_bytes must be positive, got {map_size} and {batch_bytes}"
            )
        self.url = store.child_url(key)
        validate_key(key, url=store.url)
        self._batch_bytes = batch_bytes
        if not store.supports_writes:
            raise ReadOnlyStoreError(
                f"store {store.url} was opened read-only; cannot write {key!r}", url=self.url
            )
        if fsync is None:  # follow the store's own durability setting
            fsync = bool(getattr(store, "fsync", getattr(store, "_fsync", True)))
        self._fsync = fsync
        self._target = _local_target(store, key)
        if self._target is not None:
            directory = os.path.dirname(self._target)
            os.makedirs(directory, exist_ok=True)
            self._workdir = tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=directory)
        else:
            self._workdir = tempfile.mkdtemp(prefix="fastload-lmdb-")
        self._finalizer = weakref.finalize(self, _cleanup, self._workdir)
        self._env: Any = _open_build_env(os.path.join(self._workdir, "build.mdb"), map_size)
        self._psize: int = self._env.stat()["psize"]
        self._max_key: int = self._env.max_key_size()
        self._keys: set[bytes] = set()
        self._pending: list[tuple[bytes, bytes]] = []
        self._pending_bytes = 0
        self._flushed = 0  # samples committed to the scratch environment
        self._committed_bytes: int = 2 * self._psize  # the two meta pages
        self._closed = False

    # ---- writing ------------------------------------------------------------------------------

    def write(self, sample: Mapping[str, Any]) -> None:
        """Append one sample; see :class:`~fastload.formats.ShardWriter`.

        Raises:
            InvalidArgumentError: No valid ``__key__``, a field that cannot be encoded, a key longer
                than LMDB allows (511 UTF-8 bytes), or a key already written to this shard.
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
        value = pack_value(encoded)
        self._keys.add(kbytes)
        self._pending.append((kbytes, value))
        self._pending_bytes += len(kbytes) + len(value)
        self._count_fields(sample)
        if self._pending_bytes >= self._batch_bytes:
            self._flush()

    def _entry_bytes(self, key: bytes, value: bytes) -> int:
        """Approximate bytes an uncommitted entry and its position entry add to the shard."""
        psize = self._psize
        position_entry = len(position_key(0)) + len(key) + _NODE_OVERHEAD
        if len(key) + len(value) + _NODE_OVERHEAD > psize // 2:  # LMDB puts it on overflow pages
            pages = -(-(len(value) + _NODE_OVERHEAD) // psize)
            return pages * psize + len(key) + _NODE_OVERHEAD + 8 + position_entry
        return len(key) + len(value) + _NODE_OVERHEAD + position_entry

    def _flush(self) -> None:
        if not self._pending:
            return
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    for i, (kbytes, value) in enumerate(self._pending, start=self._flushed):
                        txn.put(kbytes, value)
                        txn.put(position_key(i), kbytes)
                break
            except lmdb.MapFullError:
                self._grow(self._pending_bytes)
            except lmdb.Error as exc:
                raise FormatError(
                    f"LMDB failed while building shard {self.url} in {self._workdir}: {exc}",
                    url=self.url,
                ) from exc
        self._committed_bytes = self._used_bytes()
        self._flushed += len(self._pending)
        self._pending = []
        self._pending_bytes = 0

    def _grow(self, need: int) -> None:
        current: int = self._env.info()["map_size"]
        self._env.set_mapsize(max(2 * current, current + 2 * need))

    def _used_bytes(self) -> int:
        stat = self._env.stat()
        pages: int = stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]
        return (pages + 2) * self._psize

    @property
    def num_bytes(self) -> int:
        """Approximate size of the shard so far, in bytes: the pages committed to the scratch
        environment plus an estimate for samples not yet committed."""
        return self._committed_bytes + sum(self._entry_bytes(k, v) for k, v in self._pending)

    # ---- finishing ----------------------------------------------------------------------------

    def close(self) -> ShardInfo:
        """Commit the shard and publish it atomically; return its :class:`ShardInfo`.

        ``index_key`` is ``None``: the shard is its own index. On failure nothing is published and
        the scratch files are removed.
        """
        if self._closed:
            raise InvalidArgumentError(f"LMDB shard writer for {self.url} is already closed")
        try:
            self._flush()
            meta = pack_meta(self._flushed)
            while True:
                try:
                    with self._env.begin(write=True) as txn:
                        txn.put(META_KEY, meta)
                    break
                except lmdb.MapFullError:
                    self._grow(len(meta) + self._psize)
            # The compacted copy records the map size in its meta pages: make it a function of
            # the data alone (LMDB raises a too-small size to the minimum it needs).
            self._env.set_mapsize(self._psize)
            info = self._publish()
            self._env.close()
        except lmdb.Error as exc:
            self.abort()
            raise FormatError(
                f"LMDB failed while finishing shard {self.url}: {exc}", url=self.url
            ) from exc
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self._finalizer()
        return info

    def _publish(self) -> ShardInfo:
        """Stream a compacted copy of the scratch environment to its destination, hashing it on
        the way: a temporary file renamed over the target for a local store, else the store's
        streamed writer. Large sequential writes also leave the page cache in large folios, which
        later plain reads of the file are measurably faster on."""
        sha = hashlib.sha256()
        size = 0
        if self._target is not None:
            tmp = os.path.join(self._workdir, "shard.lmdb")
            with open(tmp, "xb", buffering=0) as out:
                for block in self._compacted_blocks():
                    sha.update(block)
                    size += len(block)
                    out.write(block)
                if self._fsync:
                    os.fsync(out.fileno())
            os.replace(tmp, self._target)
            if self._fsync:
                _fsync_dir(os.path.dirname(self._target))
        else:
            with self.store.open_writer(self.key) as writer:
                for block in self._compacted_blocks():
                    sha.update(block)
                    size += len(block)
                    writer.write(block)
        return ShardInfo(
            key=self.key,
            num_samples=self._flushed,
            num_bytes=size,
            sha256=sha.hexdigest(),
            index_key=None,
            fields=dict(self.fields),
        )

    def _compacted_blocks(self) -> Iterator[memoryview]:
        """The bytes of LMDB's compacted copy (``mdb_env_copyfd2`` with ``MDB_CP_COMPACT``), in
        blocks of :data:`_COPY_CHUNK` (the last may be shorter). LMDB writes into a pipe from a
        helper thread (py-lmdb releases the GIL meanwhile); each block is valid until the next."""
        read_fd, write_fd = os.pipe()
        errors: list[BaseException] = []

        def copy() -> None:
            try:
                self._env.copyfd(write_fd, compact=True)
            except BaseException as exc:  # re-raised in the caller's thread
                errors.append(exc)
            finally:
                os.close(write_fd)

        thread = threading.Thread(target=copy, name="fastload-lmdb-copy", daemon=True)
        buf = bytearray(_COPY_CHUNK)
        view = memoryview(buf)
        try:
            with open(read_fd, "rb", buffering=0) as pipe:
                thread.start()
                while True:
                    filled = 0
                    while filled < len(buf):
                        n = pipe.readinto(view[filled:])
                        if not n:
                            break
                        filled += n
                    if filled:
                        yield view[:filled]
                    if filled < len(buf):
                        break
        finally:
            # Closing the read end (above) makes a still-writing LMDB fail with EPIPE and return.
            if thread.ident is not None:
                thread.join()
            else:
                os.close(write_fd)
        if errors:
            raise errors[0]

    def abort(self) -> None:
        """Discard the shard and its scratch files; nothing becomes visible. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pending = []
        try:
            self._env.close()
        finally:
            self._finalizer()


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
