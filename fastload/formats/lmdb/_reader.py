"""Reads fastload LMDB shards: streaming in insertion order, random access by position and key."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import lmdb
import msgpack

from fastload.errors import CorruptDataError, FormatError
from fastload.formats._base import OnError, ShardReader
from fastload.formats.lmdb._envs import SharedEnv, acquire, release
from fastload.formats.lmdb._layout import (
    FORMAT_NAME,
    FORMAT_VERSION,
    META_KEY,
    position_key,
)
from fastload.storage import Store

__all__ = ["LMDBReader"]

_COPY_CHUNK = 8 * 1024 * 1024
#: LMDB errors that mean the file's bytes are not a valid environment.
_CORRUPT = (
    lmdb.InvalidError,
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.VersionMismatchError,
)


def _remove(path: str, owner: int | None = None) -> None:
    """Delete ``path`` (only in process ``owner``, when given: forked children share the file)."""
    if owner is not None and owner != os.getpid():
        return
    try:
        os.unlink(path)
    except OSError:
        pass


class LMDBReader(ShardReader):
    """Reads one LMDB shard written by :class:`~fastload.formats.lmdb.LMDBWriter`.

    LMDB needs a file it can memory-map: the reader uses :meth:`Store.local_path` where the store
    has local paths (a local directory, or a caching wrapper), and otherwise downloads the shard
    once, streamed, to a temporary file that :meth:`close` removes.

    The environment is opened lazily, read-only and without a lock file, and shared by all readers
    of the same file in a process (LMDB allows one open per file and process). A reader used in a
    parent and then in a forked child reopens the file in the child; iterators started before the
    fork must not be continued in the child. Pickling carries the store, key and options, never the
    open environment. Each thread gets its own read transaction, so one reader may be shared by
    threads.

    Samples are ``{"__key__", "__url__", "__index__", field: bytes}``; ``__index__`` is the
    position in insertion order. Corrupt values, missing reserved keys and files that are not
    LMDB raise :class:`~fastload.errors.CorruptDataError` naming the shard URL and the sample key;
    while iterating, the ``skip``/``warn`` policies skip the sample (or, for a shard that cannot be
    opened, the whole shard) instead. Random access (:meth:`read`, :meth:`get_key`) always raises,
    as it has no sample to return.

    LMDB trusts the pages it maps: the reader checks the file header, the version and that the file
    is as long as its meta page says (a truncated file would otherwise crash the process with
    SIGBUS), but damage inside pages is only caught by comparing the shard's SHA-256 with the
    manifest (``fastload verify``).

    Args:
        store: Where the shard is.
        key: The shard's key.
        on_error: ``raise`` (default), ``skip`` or ``warn`` for corrupt samples while iterating.
        index_key: Ignored; an LMDB shard is its own index.
        readahead: Let the OS read ahead in the mapped file. Good for sequential reads of
            a cold file; turn off for random access on shards larger than memory. Applies when
            this reader is the first in the process to open the file.
    """

    supports_random_access = True

    def __init__(
        self,
        store: Store,
        key: str,
        *,
        on_error: OnError = "raise",
        index_key: str | None = None,
        readahead: bool = True,
    ) -> None:
        super().__init__(store, key, on_error=on_error, index_key=None)
        self.readahead = readahead
        self._entry: SharedEnv | None = None
        self._release: weakref.finalize[[SharedEnv], None] | None = None
        self._path: str | None = None
        self._download: tuple[str, int] | None = None  # (temporary path, owning pid)
        self._lock = threading.Lock()

    # ---- opening ------------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_entry=None, _release=None, _path=None, _download=None, _lock=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _local_file(self) -> str:
        if self._path is not None and os.path.exists(self._path):
            return self._path
        path = self.store.local_path(self.key) if self.store.has_local_paths else None
        if path is None:
            path = self._fetch()
        self._path = path
        return path

    def _fetch(self) -> str:
        """Download the shard to a temporary file, streamed; return its path."""
        fd, tmp = tempfile.mkstemp(prefix="fastload-lmdb-", suffix=".lmdb")
        try:
            with os.fdopen(fd, "wb") as out, self.store.open_reader(self.key) as src:
                shutil.copyfileobj(src, out, _COPY_CHUNK)
        except BaseException:
            _remove(tmp)
            raise
        self._download = (tmp, os.getpid())
        weakref.finalize(self, _remove, tmp, os.getpid())
        return tmp

    def _env(self) -> SharedEnv:
        """This process's shared environment for the shard, opened and validated on first use."""
        entry = self._entry
        if entry is not None and entry.pid == os.getpid() and not entry.closed:
            return entry
        with self._lock:
            entry = self._entry
            if entry is not None and entry.pid == os.getpid() and not entry.closed:
                return entry
            path = self._local_file()
            try:
                entry = acquire(path, readahead=self.readahead, validate=self._validate)
            except lmdb.Error as exc:
                corrupt = isinstance(exc, _CORRUPT)
                cls = CorruptDataError if corrupt else FormatError
                raise cls(
                    f"cannot open the shard as an LMDB file ({type(exc).__name__}: {exc})"
                    + ("; the shard is damaged or not in the lmdb format" if corrupt else ""),
                    url=self.url,
                ) from exc
            self._entry = entry
            self._release = weakref.finalize(self, release, entry)  # type: ignore[arg-type]
            return entry

    def _validate(self, env: Any) -> int:
        """Check the file length and the meta key of a freshly opened environment; return the
        number of samples."""
        psize: int = env.stat()["psize"]
        needed = (env.info()["last_pgno"] + 1) * psize
        size = os.path.getsize(env.path())
        if size < needed:
            raise CorruptDataError(
                f"LMDB file is truncated: {size} bytes, but its meta page needs {needed}; "
                "copy the shard again",
                url=self.url,
                offset=size,
            )
        with env.begin(buffers=False) as txn:
            raw = txn.get(META_KEY)
        if raw is None:
            raise CorruptDataError(
                f"LMDB file has no reserved key {META_KEY!r}: not a fastload LMDB shard "
                "(see fastload/formats/lmdb/README.md)",
                url=self.url,
                key=META_KEY.decode(),
            )
        return self._parse_meta(raw)

    def _parse_meta(self, raw: bytes) -> int:
        url, key = self.url, META_KEY.decode()
        try:
            meta = msgpack.unpackb(raw, raw=False)
        except Exception as exc:
            raise CorruptDataError(
                f"meta value is not valid msgpack ({exc})", url=url, key=key
            ) from exc
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
            raise CorruptDataError(
                f"meta value is not a {FORMAT_NAME!r} map: {meta!r:.200}", url=url, key=key
            )
        version, count = meta.get("version"), meta.get("num_samples")
        if not isinstance(version, int) or not isinstance(count, int) or count < 0:
            raise CorruptDataError(
                f"meta value has no valid version/num_samples: {meta}", url=url, key=key
            )
        if version > FORMAT_VERSION:
            raise FormatError(
                f"shard uses LMDB layout version {version}, this fastload reads up to "
                f"{FORMAT_VERSION}; upgrade fastload",
                url=url,
                key=key,
            )
        return count

    def _txn(self) -> tuple[int, Any]:
        entry = self._env()
        return entry.info, entry.txn()

    # ---- decoding -----------------------------------------------------------------------------

    def _sample(self, txn: Any, position: int, kbytes: Any) -> dict[str, Any]:
        try:
            key = bytes(kbytes).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CorruptDataError(
                f"position entry {position} holds a key that is not UTF-8: {bytes(kbytes)!r:.80}",
                url=self.url,
            ) from exc
        value = txn.get(kbytes)
        if value is None:
            raise CorruptDataError(
                f"position {position} names a sample that is not in the shard",
                url=self.url,
                key=key,
            )
        return self._decode(key, position, value)

    def _decode(self, key: str, position: int, value: Any) -> dict[str, Any]:
        try:
            fields = msgpack.unpackb(value, raw=False)
        except Exception as exc:
            raise CorruptDataError(
                f"sample value is not valid msgpack ({type(exc).__name__}: {exc})",
                url=self.url,
                key=key,
            ) from exc
        if not isinstance(fields, dict):
            raise CorruptDataError(
                f"sample value is a msgpack {type(fields).__name__}, expected a map of fields",
                url=self.url,
                key=key,
            )
        sample: dict[str, Any] = {"__key__": key, "__url__": self.url, "__index__": position}
        for name, data in fields.items():
            if type(data) is not bytes or not isinstance(name, str) or name.startswith("__"):
                raise CorruptDataError(
                    f"sample field {name!r} is not a str name with a bytes value",
                    url=self.url,
                    key=key,
                )
            sample[name] = data
        return sample

    def _position_entry(self, txn: Any, position: int) -> Any:
        kbytes = txn.get(position_key(position))
        if kbytes is None:
            raise CorruptDataError(
                f"reserved position key for sample {position} is missing", url=self.url
            )
        return kbytes

    # ---- public API ---------------------------------------------------------------------------

    def __len__(self) -> int:
        """Number of samples, from the shard's meta key (0 for a shard that cannot be opened
        under the ``skip``/``warn`` policies).

        Raises:
            CorruptDataError: Under ``raise``, the shard cannot be opened.
        """
        try:
            n: int = self._env().info
        except CorruptDataError:
            # ``list(reader)`` asks for the length first; under skip/warn an unreadable shard
            # has no samples, and iterating it counts the skip.
            if self.policy.on_error == "raise":
                raise
            return 0
        return n

    def read(self, i: int) -> dict[str, Any]:
        """The sample at position ``i`` (insertion order; negative counts from the end).

        Raises:
            IndexError: ``i`` is out of range.
            CorruptDataError: The shard or the sample is damaged.
        """
        n, txn = self._txn()
        position = i + n if i < 0 else i
        if not 0 <= position < n:
            raise IndexError(f"sample position {i} out of range for {self.url} ({n} samples)")
        return self._sample(txn, position, self._position_entry(txn, position))

    def get_key(self, key: str) -> dict[str, Any]:
        """The sample whose ``__key__`` is ``key``; its ``__index__`` is ``-1`` (looking up the
        position would need a scan).

        Raises:
            KeyError: No sample has this key.
            CorruptDataError: The shard or the sample is damaged.
        """
        _, txn = self._txn()
        kbytes = key.encode("utf-8")
        value = txn.get(kbytes) if kbytes and not kbytes.startswith(b"\x00") else None
        if value is None:
            raise KeyError(f"no sample with key {key!r} in {self.url}")
        return self._decode(key, -1, value)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Yield every sample in insertion order, streaming through the mapped file."""
        return self.iter_from(0)

    def iter_from(self, start: int) -> Iterator[dict[str, Any]]:
        """Yield samples from position ``start`` on, in insertion order (seeks directly)."""
        try:
            n, txn = self._txn()
        except CorruptDataError as exc:
            self.policy.handle(exc)
            return
        position = max(start, 0)
        if position >= n:
            return
        cursor = txn.cursor()
        found = cursor.set_key(position_key(position))
        while position < n:
            try:
                if not found or cursor.key() != position_key(position):
                    found = cursor.set_key(position_key(position))
                    if not found:
                        raise CorruptDataError(
                            f"reserved position key for sample {position} is missing",
                            url=self.url,
                        )
                sample = self._sample(txn, position, cursor.value())
            except CorruptDataError as exc:
                self.policy.handle(exc)
                position += 1
                found = cursor.next()
                continue
            yield sample
            position += 1
            found = cursor.next()

    def close(self) -> None:
        """Release the shared environment and remove a downloaded temporary copy (in the process
        that made it). The reader reopens on next use; iterators started before stay invalid."""
        with self._lock:
            release_fn, self._release, self._entry = self._release, None, None
            if release_fn is not None:
                release_fn()
            if self._download is not None and self._download[1] == os.getpid():
                _remove(self._download[0])
                self._download = None
                self._path = None
