"""Writes one LMDB environment per shard, as a single file, through any store."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from typing import Any

import lmdb

from fastload.errors import FormatError, InvalidArgumentError
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
        fsync: For a local store, flush the shard to the device before renaming it into place.

    Raises:
        InvalidArgumentError: Non-positive ``map_size`` or ``batch_bytes``.
    """

    def __init__(
        self,
        store: Store,
        key: str,
        *,
        index: bool = True,
        map_size: int = 64 * 1024 * 1024,
        batch_bytes: int = 32 * 1024 * 1024,
        fsync: bool = True,
    ) -> None:
        super().__init__(store, key, index=False)
        if map_size <= 0 or batch_bytes <= 0:
            raise InvalidArgumentError(
                f"map_size and batch_bytes must be positive, got {map_size} and {batch_bytes}"
            )
        self.url = store.child_url(key)
        validate_key(key, url=store.url)
        self._batch_bytes = batch_bytes
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
            shard_path = os.path.join(self._workdir, "shard.lmdb")
            fd = os.open(shard_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            try:
                self._env.copyfd(fd, compact=True)
                if self._fsync and self._target is not None:
                    os.fsync(fd)
            finally:
                os.close(fd)
            self._env.close()
            info = self._publish(shard_path)
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

    def _publish(self, shard_path: str) -> ShardInfo:
        sha = hashlib.sha256()
        size = 0
        if self._target is not None:
            with open(shard_path, "rb") as f:
                while block := f.read(_COPY_CHUNK):
                    sha.update(block)
                    size += len(block)
            os.replace(shard_path, self._target)
            if self._fsync:
                _fsync_dir(os.path.dirname(self._target))
        else:
            with open(shard_path, "rb") as f, self.store.open_writer(self.key) as out:
                while block := f.read(_COPY_CHUNK):
                    sha.update(block)
                    size += len(block)
                    out.write(block)
        return ShardInfo(
            key=self.key,
            num_samples=self._flushed,
            num_bytes=size,
            sha256=sha.hexdigest(),
            index_key=None,
            fields=dict(self.fields),
        )

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
