"""Reads fastload LMDB shards: streaming in insertion order, random access by position and key."""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import tempfile
import threading
import weakref
from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from typing import Any, Unpack

import lmdb

from fastload._lazy import current_pid
from fastload.errors import CorruptDataError, FormatError
from fastload.formats._base import ReaderOptions, ShardReader
from fastload.formats._mmap import local_file
from fastload.formats.lmdb._envs import SharedEnv, acquire, open_env, release
from fastload.formats.lmdb._layout import (
    META_KEY,
    REMEDY,
    position_key,
    unpack_meta,
    unpack_value,
)
from fastload.formats.lmdb._opened import OpenedFile, check_file
from fastload.formats.lmdb._pagemap import GOOD
from fastload.formats.lmdb._pages import P_INVALID, FileBytes, PageError
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
#: LMDB's longest key (``MDB_MAXKEYSIZE`` of default builds).
_MAX_KEY = 511


def _remove(path: str, owner: int | None = None) -> None:
    """Delete ``path`` (only in process ``owner``, when given: forked children share the file)."""
    if owner is None or owner == os.getpid():
        with contextlib.suppress(OSError):
            os.unlink(path)


def _map(path: str) -> tuple[FileBytes, os.stat_result]:
    """The file mapped read-only (``b""`` when it is empty), and its ``fstat``."""
    with open(path, "rb") as file:
        st = os.fstat(file.fileno())
        if st.st_size == 0:
            return b"", st
        return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ), st


class LMDBReader(ShardReader):
    """Reads one LMDB shard written by :class:`~fastload.formats.lmdb.LMDBWriter`.

    LMDB needs a file it can memory-map: the reader uses :meth:`Store.local_path` where the store
    has local paths (a local directory, or a caching wrapper), and otherwise downloads the shard
    once, streamed, to a temporary file that :meth:`close` removes.

    The environment is opened lazily, read-only and without a lock file, and shared by all readers
    of the same file in a process (LMDB allows one open per file and process); after the last of
    them closes it stays open, checked, for the next reader of the file, within the process's
    budget of open environments (see :mod:`~fastload.formats.lmdb._envs`; not for a downloaded
    copy or a :class:`~fastload.storage.CachingStore`'s file, which may go away). A reader used
    in a parent and then in a forked child reopens the file in the child; iterators started
    before the fork must not be continued in the child. Pickling carries the store, key and
    options, never the open environment. Each thread gets its own read transaction, so one reader may be shared by
    threads; a transaction in which LMDB reported an error is ended and the next read begins a
    new one.

    Samples are ``{"__key__", "__url__", "__index__", field: bytes}``; ``__index__`` is the
    position in insertion order.

    Damage: LMDB trusts the pages it maps, and a damaged page can make it read outside the file
    (``SIGBUS``) or outside the page. So before LMDB opens the file the reader checks both meta
    pages and the file's length, and before LMDB looks a key up it checks every page the lookup
    reads (see :class:`~fastload.formats.lmdb._pagemap.PageMap` and the package README). A
    truncated file is read as far as its pages are present. Every damage found, in a page, a
    node, a reserved key or a value, is a :class:`~fastload.errors.CorruptDataError` naming the
    shard URL, the sample key (or position) and the byte offset where known; it affects only
    the samples whose bytes are damaged. While iterating, the ``skip``/``warn`` policies skip
    exactly those samples (a shard that cannot be opened at all counts as one skip); random
    access (:meth:`read`, :meth:`get_key`) always raises, as it has no sample to return. Damage
    inside a value's bytes that still decodes is only caught by comparing the shard's SHA-256
    with the manifest (``fastload verify``).

    With the manifest's figures (``num_samples``, ``num_bytes``), the reader serves the samples
    the manifest lists: a shard shorter than the manifest's size is truncated, and a manifest
    that lists more samples than the shard holds makes each missing position a
    :class:`~fastload.errors.CorruptDataError` naming both counts.

    Args:
        store: Where the shard is.
        key: The shard's key.
        on_error: ``raise`` (default), ``skip`` or ``warn`` for corrupt samples while iterating.
        index_key: Ignored; an LMDB shard is its own index.
        num_samples: Samples the manifest lists for the shard, or ``None``.
        num_bytes: The shard's size according to the manifest, or ``None``.
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
        readahead: bool = True,
        **options: Unpack[ReaderOptions],
    ) -> None:
        options["index_key"] = None  # an LMDB shard is its own index
        super().__init__(store, key, **options)
        self.readahead = readahead
        self._entry: SharedEnv | None = None
        self._release: weakref.finalize[[SharedEnv, bool], None] | None = None
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
        path = local_file(self.store, self.key)  # None: also when a cache cannot hold it
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

    def _open(self) -> tuple[SharedEnv, OpenedFile]:
        """This process's shared environment for the shard, opened and checked on first use."""
        entry = self._entry
        if entry is None or entry.pid != current_pid() or entry.closed:
            with self._lock:
                entry = self._entry
                if entry is None or entry.pid != current_pid() or entry.closed:
                    entry = acquire(self._local_file(), opener=self._open_file)
                    self._entry = entry
                    # No idle environment of a file that goes away (a downloaded copy, a
                    # cache's file: an idle environment would keep an evicted file's space).
                    keep = self._download is None and not self.store.evicts_local_files
                    self._release = weakref.finalize(
                        self,  # type: ignore[arg-type]
                        release,
                        entry,
                        keep,
                    )
        opened: OpenedFile = entry.info
        return entry, opened

    def _open_file(self, path: str) -> tuple[Any, OpenedFile]:
        """Check the file, open it with LMDB and read its meta key (for :func:`acquire`)."""
        view, st = _map(path)
        try:
            opened = check_file(view, len(view), self, st)
            try:
                env = open_env(path, readahead=self.readahead)
            except lmdb.Error as exc:
                problem = f"LMDB cannot open the shard ({type(exc).__name__}: {exc})"
                if opened.size < opened.meta.needed:  # e.g. no address space for the map
                    raise CorruptDataError(
                        f"{problem}: its meta page says it needs {opened.meta.needed} bytes, "
                        f"it has {opened.size} (truncated, or the meta page is damaged); "
                        f"{REMEDY}",
                        url=self.url,
                    ) from exc
                if isinstance(exc, _CORRUPT):
                    raise CorruptDataError(
                        f"{problem}; the shard is damaged: {REMEDY}", url=self.url
                    ) from exc
                raise FormatError(problem, url=self.url) from exc
            try:
                opened.count = self._read_meta_key(env, opened)
            except BaseException:
                env.close()
                raise
        except BaseException:
            if isinstance(view, mmap.mmap):
                view.close()
            raise
        return env, opened

    def _read_meta_key(self, env: Any, opened: OpenedFile) -> int:
        """The sample count from the meta key, checked."""
        with env.begin(buffers=False) as txn:
            raw = self._lookup(None, txn, opened, META_KEY, key=META_KEY.decode())
            raw = None if raw is None else bytes(raw)
        if raw is not None:
            return unpack_meta(raw, url=self.url)
        meta = opened.meta
        if meta.root == P_INVALID and meta.other_entries:
            raise CorruptDataError(
                f"meta page {meta.number}, which LMDB uses, describes an empty database, while "
                f"the other meta page lists {meta.other_entries} entries: a meta page is damaged; "
                f"{REMEDY}",
                url=self.url,
                offset=meta.number * meta.psize,
            )
        raise CorruptDataError(
            f"LMDB file has no reserved key {META_KEY!r}: not a fastload LMDB shard "
            f"(see fastload/formats/lmdb/README.md); {REMEDY}",
            url=self.url,
            key=META_KEY.decode(),
        )

    # ---- lookups and decoding -----------------------------------------------------------------

    def _corrupt(
        self,
        problem: str,
        *,
        key: str | None = None,
        position: int | None = None,
        offset: int | None = None,
    ) -> CorruptDataError:
        where = "" if position is None else f"sample at position {position}: "
        return CorruptDataError(f"{where}{problem}; {REMEDY}", url=self.url, key=key, offset=offset)

    def _lookup(
        self,
        entry: SharedEnv | None,
        txn: Any,
        opened: OpenedFile,
        kbytes: bytes,
        *,
        key: str | None = None,
        position: int | None = None,
    ) -> Any:
        """The value stored under ``kbytes`` (a view valid while ``txn`` lives), or ``None``.

        The pages the lookup reads are checked first. After an LMDB error the thread's
        transaction of ``entry`` is discarded, so that the next read starts a fresh one.

        Raises:
            CorruptDataError: A page or node on the way is damaged, or LMDB failed.
        """
        pages = opened.pages
        try:
            # The common case inline: the leaf page was checked and no node on any page is bad.
            table = pages.table
            i = bisect_right(table.lows, kbytes) - 1
            if (i < 0 or table.state[i] != GOOD or pages.bad_nodes) and not pages.check(kbytes):
                return None
            return txn.get(kbytes)
        except PageError as exc:
            raise self._corrupt(str(exc), key=key, position=position, offset=exc.offset) from exc
        except lmdb.Error as exc:
            if entry is not None:
                entry.discard_txn()
            raise self._corrupt(
                f"LMDB failed to read it ({type(exc).__name__}: {exc})", key=key, position=position
            ) from exc

    def _sample_key(self, kbytes: bytes, position: int) -> str:
        """The sample key a position entry names, checked."""
        try:
            key = kbytes.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self._corrupt(
                f"its position entry holds a key that is not UTF-8: {kbytes!r:.80}",
                position=position,
            ) from exc
        if not kbytes or kbytes[0] == 0 or len(kbytes) > _MAX_KEY:  # empty, reserved, too long
            raise self._corrupt(
                f"its position entry holds an impossible sample key {kbytes!r:.80}",
                position=position,
            )
        return key

    def _missing(self, opened: OpenedFile, position: int) -> CorruptDataError:
        return self._corrupt(
            f"the manifest lists {self.expected_samples} samples for this shard, but the "
            f"shard holds {opened.count}, so this sample is missing (the shard or the "
            "manifest was replaced or damaged)",
            position=position,
        )

    def _read(
        self, entry: SharedEnv, opened: OpenedFile, position: int, kbytes: bytes | None = None
    ) -> dict[str, Any]:
        """The sample at ``position`` (within the manifest's count), whose key is ``kbytes``
        when the caller read its position entry already."""
        if position >= opened.count:
            raise self._missing(opened, position)
        txn = entry.txn()
        if kbytes is None:
            found = self._lookup(entry, txn, opened, position_key(position), position=position)
            if found is None:
                raise self._corrupt("its reserved position entry is missing", position=position)
            kbytes = bytes(found)
        key = self._sample_key(kbytes, position)
        value = self._lookup(entry, txn, opened, kbytes, key=key, position=position)
        if value is None:
            raise self._corrupt(
                "its position entry names a sample that is not in the shard",
                key=key,
                position=position,
            )
        return self._decode(key, position, value)

    def _positions(self, opened: OpenedFile, position: int) -> tuple[int, list[bytes | None]]:
        """The position entries on the page that holds ``position``'s: ``(first, keys)``,
        where ``keys[j]`` is the sample key at position ``first + j`` (``None`` where the
        entry is missing or malformed, so that reading it by position reports why).

        Raises:
            PageError: The page is damaged or missing.
        """
        keys, values = opened.pages.run(position_key(position))
        lo = bisect_left(keys, position_key(position))
        out: list[bytes | None] = []
        for j in range(lo, len(keys)):
            if keys[j] != position_key(position + len(out)):
                break
            out.append(values[j])
        return position, out

    def _decode(self, key: str, position: int, value: Any) -> dict[str, Any]:
        try:
            fields = unpack_value(value)
        except ValueError as exc:
            raise self._corrupt(
                str(exc), key=key, position=None if position < 0 else position
            ) from exc
        sample: dict[str, Any] = {"__key__": key, "__url__": self.url, "__index__": position}
        sample.update(fields)
        return sample

    def _count(self, opened: OpenedFile) -> int:
        """Samples served: the manifest's count when known, else the shard's own."""
        return opened.count if self.expected_samples is None else self.expected_samples

    # ---- public API ---------------------------------------------------------------------------

    def __len__(self) -> int:
        """Number of samples: the manifest's count when the reader was given it, else the one
        in the shard's meta key (0 for a shard that cannot be opened under the ``skip``/``warn``
        policies).

        Raises:
            CorruptDataError: Under ``raise``, the shard cannot be opened.
        """
        try:
            _, opened = self._open()
        except CorruptDataError:
            # ``list(reader)`` asks for the length first; under skip/warn an unreadable shard
            # has no samples, and iterating it counts the skip.
            if self.policy.on_error == "raise":
                raise
            return 0
        return self._count(opened)

    def read(self, i: int) -> dict[str, Any]:
        """The sample at position ``i`` (insertion order; negative counts from the end).

        Raises:
            IndexError: ``i`` is out of range.
            CorruptDataError: The shard or the sample is damaged, or the manifest lists more
                samples than the shard holds and ``i`` is one of the missing ones.
        """
        entry, opened = self._open()
        n = self._count(opened)
        position = i + n if i < 0 else i
        if not 0 <= position < n:
            raise IndexError(f"sample position {i} out of range for {self.url} ({n} samples)")
        opened.shrunk()
        return self._read(entry, opened, position)

    def get_key(self, key: str) -> dict[str, Any]:
        """The sample whose ``__key__`` is ``key``; its ``__index__`` is ``-1`` (looking up the
        position would need a scan).

        Raises:
            KeyError: No sample has this key.
            CorruptDataError: The shard or the sample is damaged.
        """
        entry, opened = self._open()
        opened.shrunk()
        kbytes = key.encode("utf-8", "surrogatepass")
        value = None
        if kbytes and not kbytes.startswith(b"\x00") and len(kbytes) <= _MAX_KEY:
            value = self._lookup(entry, entry.txn(), opened, kbytes, key=key)
        if value is None:
            raise KeyError(f"no sample with key {key!r} in {self.url}")
        return self._decode(key, -1, value)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Yield every sample in insertion order, streaming through the mapped file."""
        return self.iter_from(0)

    def iter_from(self, start: int) -> Iterator[dict[str, Any]]:
        """Yield samples from position ``start`` on, in insertion order (seeks directly).

        Position entries are read a leaf page at a time and each sample is then looked up by
        its key, so damage anywhere loses only the samples whose own bytes (their position
        entry, the pages on the way, their value) are damaged.
        """
        try:
            entry, opened = self._open()
        except CorruptDataError as exc:
            self.policy.handle(exc)
            return
        total = self._count(opened)
        position = max(start, 0)
        first = position
        run: list[bytes | None] = []  # sample keys at positions first, first + 1, ...
        while position < total:
            if opened.shrunk():
                run = []  # read the position entries again, through the new page map
            if not position - first < len(run):
                run = []
                if position < opened.count:
                    try:
                        first, run = self._positions(opened, position)
                    except PageError:
                        pass  # reading by position reports the damage for each sample
            kbytes = run[position - first] if position - first < len(run) else None
            try:
                sample = self._read(entry, opened, position, kbytes)
            except CorruptDataError as exc:
                self.policy.handle(exc)
            else:
                yield sample
            position += 1
        if opened.count > total and start <= total:
            self.policy.handle(
                CorruptDataError(
                    f"the shard holds {opened.count} samples, but the manifest lists {total}: "
                    f"the last {opened.count - total} are not read (the shard or the manifest "
                    f"was replaced or damaged); {REMEDY}",
                    url=self.url,
                )
            )

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
