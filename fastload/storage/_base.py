"""The abstract :class:`Store`: bytes under string keys.

A backend implements six methods (:meth:`Store.get`, :meth:`Store.head`, :meth:`Store.list`,
:meth:`Store.put`, :meth:`Store.open_writer`, :meth:`Store.delete`) plus the ``url`` property;
everything else (ranged multi-reads, streamed reading, ``exists``, text helpers, copying between
stores) is written once here. Incomplete backends fail at construction because the required
methods are ``@abstractmethod``.

Guarantees every backend gives (and the conformance suite in :mod:`fastload.testing.store` checks):

* ``put`` and a committed ``open_writer`` are atomic: a reader sees the old object, no object, or
  the whole new object, never a prefix.
* A streamed writer that is aborted or whose ``with`` block raises leaves nothing visible.
* ``list`` yields keys in ascending code-point order (which equals UTF-8 byte order).
* Keys are ``/``-separated relative paths: non-empty, no leading ``/``, no ``.`` or ``..``
  segment, no empty segment, no NUL byte.
* Stores pickle cheaply and reopen OS or network resources lazily in each process, so a store can
  be handed to DataLoader workers under the fork, spawn and forkserver start methods.

The values stores take and return (keys, :class:`ByteRange`, :class:`ObjectMeta`) are defined in
:mod:`fastload.storage._keys`, the stream types (:class:`ObjectWriter`, :class:`SeekableReader`)
in :mod:`fastload.storage._streams`; both are re-exported here. ``fastload/storage/README.md``
is the guide for writing a backend.
"""

from __future__ import annotations

import builtins
import io
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence

from fastload.errors import ObjectNotFoundError, ReadOnlyStoreError
from fastload.storage._keys import ByteRange, ObjectMeta, check_range, validate_key, validate_prefix
from fastload.storage._streams import ObjectWriter, RangedReader, SeekableReader

__all__ = [
    "DEFAULT_COALESCE_BYTES",
    "DEFAULT_READ_CHUNK",
    "ByteRange",
    "ObjectMeta",
    "ObjectWriter",
    "SeekableReader",
    "Store",
    "check_range",
    "validate_key",
    "validate_prefix",
]

#: Ranges closer than this many bytes are fetched with one request by :meth:`Store.get_ranges`.
DEFAULT_COALESCE_BYTES = 1024 * 1024
#: Chunk size of the default streaming reader built from ranged gets.
DEFAULT_READ_CHUNK = 8 * 1024 * 1024


class Store(ABC):
    """Bytes under ``/``-separated string keys, somewhere.

    Subclasses implement :attr:`url`, :meth:`get`, :meth:`head`, :meth:`list`, :meth:`put`,
    :meth:`open_writer` and :meth:`delete`; they may override the conveniences for speed.
    Capability flags tell callers (and the conformance suite) what a backend can do.

    Read-only handling is written once here: a backend passes its ``read_only`` option to
    ``super().__init__`` and calls :meth:`_check_writable` first in every write;
    :attr:`supports_writes` follows from it.

    Thread safety: every method may be called from several threads at once. Process safety:
    stores pickle by configuration and reopen resources lazily in the new process.

    Args:
        read_only: Refuse ``put``, ``open_writer``, ``delete`` and other writes with
            :class:`~fastload.errors.ReadOnlyStoreError`.
    """

    # Capabilities are read-only properties; a backend whose answer is fixed sets the class
    # attribute of the same name instead (``has_local_paths = True``), one whose answer depends on
    # the instance overrides the property. Each property's docstring says what it promises.
    # The class-level default serves subclasses that do not call ``Store.__init__``.
    _read_only: bool = False

    def __init__(self, *, read_only: bool = False) -> None:
        self._read_only = bool(read_only)

    @property
    def read_only(self) -> bool:
        """The store was opened read-only: every write raises :class:`ReadOnlyStoreError`."""
        return self._read_only

    @property
    def supports_writes(self) -> bool:
        """``put``, ``open_writer`` and ``delete`` work (False for read-only stores)."""
        return not self.read_only

    @property
    def supports_range_reads(self) -> bool:
        """``get`` with a byte range costs about the range, not the whole object."""
        return True

    @property
    def supports_listing(self) -> bool:
        """``list`` works."""
        return True

    @property
    def has_local_paths(self) -> bool:
        """Objects are files on a local filesystem; :meth:`local_path` returns their paths."""
        return False

    @property
    def local_root(self) -> str | None:
        """The local directory whose plain files are this store's objects (key ``a/b`` at
        ``<root>/a/b``), where the caller may lock, rename into and walk; ``None`` for every
        other store (a cache's files are its entries, not keys under a root)."""
        return None

    @property
    def evicts_local_files(self) -> bool:
        """The local files :meth:`local_path` hands out are copies the store may evict and
        replace at any time (a cache): a reader must not hold one open for long, nor keep an
        idle handle to it."""
        return False

    @property
    def uncached(self) -> Store:
        """The store without a local cache in front: what to read when the answer must come
        from the source itself (a dataset's manifest). The store itself unless it is a cache."""
        return self

    @property
    def cache_dir(self) -> str | None:
        """The node-local directory of the cache this store reads through, shared by every
        process of the node that uses it; ``None`` for a store without a cache."""
        return None

    def node_stats(self, *, cached_bytes: bool = True) -> dict[str, int]:
        """Counters of the node's cache (:attr:`cache_dir`) summed over every process that used
        it; empty for a store without a cache. ``cached_bytes=False`` leaves out the one
        counter that costs a directory walk."""
        return {}

    @property
    def shared_across_processes(self) -> bool:
        """A copy of the store in another process (pickled, or opened from the same URL) sees
        the same objects, including those written after the copy was made. False for
        ``memory://``, whose pickled copies carry a snapshot: writes in a worker process are not
        seen by the parent."""
        return True

    def _check_writable(self, key: str) -> None:
        """Raise :class:`ReadOnlyStoreError` if the store is read-only; every backend calls it
        first in ``put``, ``open_writer``, ``delete`` and any other write."""
        if self.read_only:
            raise ReadOnlyStoreError(
                f"store {self.url} was opened read-only; cannot write {key!r}",
                url=self.child_url(key),
            )

    # ---- required -------------------------------------------------------------------------------

    @property
    @abstractmethod
    def url(self) -> str:
        """The store's root URL, without credentials (safe to log)."""

    @abstractmethod
    def get(self, key: str, byte_range: ByteRange | None = None) -> bytes:
        """Return the whole object, or the bytes of ``byte_range``.

        Raises:
            ObjectNotFoundError: The key does not exist.
            InvalidRangeError: The range reaches past the end; the message gives the object size.
        """

    @abstractmethod
    def head(self, key: str) -> ObjectMeta:
        """Return the object's size, modification time and etag (where the backend has them).

        Raises:
            ObjectNotFoundError: The key does not exist.
        """

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        """Yield every object whose key starts with ``prefix``, in ascending key order.

        The prefix is a plain string prefix (``"a/b"`` matches ``"a/b/c"`` and ``"a/bc"``). Objects
        written while a listing runs may or may not appear in it.
        """

    @abstractmethod
    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Store ``data`` under ``key`` atomically, replacing any existing object.

        Raises:
            ReadOnlyStoreError: The store does not accept writes.
        """

    @abstractmethod
    def open_writer(self, key: str) -> ObjectWriter:
        """Start a streamed write of ``key``; see :class:`ObjectWriter` for commit/abort rules."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``. Deleting a missing key raises :class:`ObjectNotFoundError`."""

    # ---- conveniences, written once -----------------------------------------------------------

    def get_ranges(
        self, key: str, ranges: Sequence[ByteRange], *, coalesce: int = DEFAULT_COALESCE_BYTES
    ) -> builtins.list[bytes]:
        """Return the bytes of each range of one object, in the order given.

        Ranges whose gaps are at most ``coalesce`` bytes are fetched with one :meth:`get`; each
        result is a separate ``bytes``. Ranges may overlap and come in any order.
        """
        if not ranges:
            return []
        order = sorted(range(len(ranges)), key=lambda i: (ranges[i].start, ranges[i].end))
        out: builtins.list[bytes] = [b""] * len(ranges)
        group: builtins.list[int] = []
        group_end = -1

        def flush() -> None:
            lo = ranges[group[0]].start
            hi = max(ranges[i].end for i in group)
            # Also for an empty span: the get checks that it lies within the object.
            blob = self.get(key, ByteRange(lo, hi))
            view = memoryview(blob)
            for i in group:
                r = ranges[i]
                if r.start == lo and r.end == hi:
                    out[i] = blob
                else:
                    out[i] = bytes(view[r.start - lo : r.end - lo])

        for i in order:
            r = ranges[i]
            if group and r.start - group_end > coalesce:
                flush()
                group = []
            group.append(i)
            group_end = max(group_end, r.end) if len(group) > 1 else r.end
        flush()
        return out

    def open_reader(self, key: str, *, chunk_size: int = DEFAULT_READ_CHUNK) -> io.BufferedIOBase:
        """Open the object for sequential (and seekable) binary reading without downloading it all.

        The default implementation issues ranged gets of ``chunk_size`` bytes; backends with a
        native stream override it. The reader is for one thread; close it when done.
        """
        size = self.head(key).size
        raw = RangedReader(lambda byte_range: self.get(key, byte_range), size, chunk_size)
        return io.BufferedReader(raw, buffer_size=1 << 16)

    def exists(self, key: str) -> bool:
        """True if ``key`` names an object."""
        try:
            self.head(key)
        except ObjectNotFoundError:
            return False
        return True

    def size(self, key: str) -> int:
        """Size of the object in bytes."""
        return self.head(key).size

    def get_text(self, key: str, encoding: str = "utf-8") -> str:
        """The object decoded as text."""
        return self.get(key).decode(encoding)

    def put_text(self, key: str, text: str, encoding: str = "utf-8") -> None:
        """Store ``text`` encoded, atomically."""
        self.put(key, text.encode(encoding))

    def list_keys(self, prefix: str = "") -> builtins.list[str]:
        """The keys :meth:`list` yields, as a list."""
        return [m.key for m in self.list(prefix)]

    def local_path(self, key: str) -> str | None:
        """The local filesystem path holding ``key``, or ``None`` if objects are not local files.

        Only stores with :attr:`has_local_paths` return paths; the object must exist.
        """
        return None

    def _put_through_writer(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """:meth:`put` for a backend whose atomic write is the commit of its streamed writer."""
        with self.open_writer(key) as writer:
            writer.write(data)

    def delete_many(self, keys: Iterable[str]) -> None:
        """Delete several keys; missing keys are ignored."""
        for key in keys:
            try:
                self.delete(key)
            except ObjectNotFoundError:
                pass

    def copy_to(
        self,
        key: str,
        dest: Store,
        dest_key: str | None = None,
        *,
        chunk_size: int = DEFAULT_READ_CHUNK,
    ) -> int:
        """Copy one object into another (or the same) store, streamed; return the bytes copied.

        The destination object appears atomically.
        """
        copied = 0
        with (
            self.open_reader(key, chunk_size=chunk_size) as src,
            dest.open_writer(dest_key if dest_key is not None else key) as dst,
        ):
            while True:
                block = src.read(chunk_size)
                if not block:
                    break
                dst.write(block)
                copied += len(block)
        return copied

    @property
    def supports_prefetch(self) -> bool:
        """:meth:`prefetch` does something (a store that fills a local cache ahead of use)."""
        return False

    def prefetch(self, keys: Iterable[str]) -> None:
        """Hint that ``keys`` will be read soon, in this order; returns at once.

        The default does nothing. A store that can act on the hint (a cache) overrides this and
        :attr:`supports_prefetch`; errors are never raised here but by the read that needs the key.
        """
        del keys

    def abort_incomplete_writes(self, prefix: str = "") -> builtins.list[str]:
        """Discard the unfinished writes under ``prefix`` that writers killed mid-write left, and
        return their keys.

        A store whose unfinished writes take space but are invisible to :meth:`list` (S3's
        multipart uploads) overrides this; the default has nothing to discard and returns ``[]``.
        Call it only when no live writer uses those keys: their writes would be discarded too.
        """
        validate_prefix(prefix, url=self.url)
        return []

    def child_url(self, key: str) -> str:
        """The URL of ``key`` within this store, for messages (no credentials)."""
        return self.url.rstrip("/") + "/" + key

    def close(self) -> None:
        """Release connections and file handles held by this process. The store stays usable."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
