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
"""

from __future__ import annotations

import builtins
import io
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import ClassVar

from fastload.errors import InvalidKeyError, InvalidRangeError, ObjectNotFoundError

__all__ = [
    "ByteRange",
    "ObjectMeta",
    "ObjectWriter",
    "Store",
    "check_range",
    "validate_key",
    "validate_prefix",
]

#: Ranges closer than this many bytes are fetched with one request by :meth:`Store.get_ranges`.
DEFAULT_COALESCE_BYTES = 1024 * 1024
#: Chunk size of the default streaming reader built from ranged gets.
DEFAULT_READ_CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ByteRange:
    """A half-open byte range of an object.

    Attributes:
        start: First byte, inclusive, ``>= 0``.
        end: One past the last byte, exclusive, ``>= start``. ``ByteRange(0, 0)`` is empty.
    """

    start: int
    end: int

    def __post_init__(self) -> None:
        if not isinstance(self.start, int) or not isinstance(self.end, int):
            raise InvalidRangeError(f"byte range bounds must be integers, got {self!r}")
        if self.start < 0 or self.end < self.start:
            raise InvalidRangeError(
                f"invalid byte range [{self.start}, {self.end}): need 0 <= start <= end "
                "(start inclusive, end exclusive)"
            )

    @classmethod
    def from_length(cls, start: int, length: int) -> ByteRange:
        """The range of ``length`` bytes beginning at ``start``."""
        return cls(start, start + length)

    @property
    def length(self) -> int:
        """Number of bytes in the range."""
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class ObjectMeta:
    """What a store knows about one object.

    Attributes:
        key: The object's key, relative to the store root.
        size: Size in bytes.
        mtime: Last modification as seconds since the Unix epoch, or ``None`` if unknown.
        etag: An opaque version tag that changes when the content changes, or ``None``.
    """

    key: str
    size: int
    mtime: float | None = None
    etag: str | None = None


def validate_key(key: str, *, url: str = "") -> str:
    """Check that ``key`` is a valid store key and return it.

    Raises:
        InvalidKeyError: If the key is empty, absolute, has a ``.``/``..``/empty segment or a NUL.
    """
    if not isinstance(key, str):
        raise InvalidKeyError(f"store keys are str, got {type(key).__name__}: {key!r}", url=url)
    if not key:
        raise InvalidKeyError(
            "store key is empty; name an object, e.g. 'data/shard-000000.tar'", url=url
        )
    if "\x00" in key:
        raise InvalidKeyError(f"store key {key!r} contains a NUL byte", url=url)
    if key[0] == "/":
        raise InvalidKeyError(
            f"store key {key!r} is absolute; keys are relative to the store root {url!r}", url=url
        )
    # Fast path (this runs on every read): no empty segment and no segment starting with ".".
    if "//" not in key and key[-1] != "/" and key[0] != "." and "/." not in key:
        return key
    for part in key.split("/"):
        if part in ("", ".", ".."):
            raise InvalidKeyError(
                f"store key {key!r} has an empty, '.' or '..' path segment; keys may not escape "
                f"or alias within the store root {url!r}",
                url=url,
            )
    return key


def validate_prefix(prefix: str, *, url: str = "") -> str:
    """Check a listing prefix: ``""`` or a relative string without NUL (it may end with ``/``)."""
    if not isinstance(prefix, str) or prefix.startswith("/") or "\x00" in prefix:
        raise InvalidKeyError(
            f"listing prefix {prefix!r} must be a relative str without NUL bytes", url=url
        )
    return prefix


def check_range(byte_range: ByteRange, size: int, *, url: str) -> None:
    """Raise :class:`InvalidRangeError` if ``byte_range`` reaches past an object of ``size`` bytes."""
    if byte_range.end > size:
        raise InvalidRangeError(
            f"byte range [{byte_range.start}, {byte_range.end}) reaches past the end of {url}, "
            f"which is {size} bytes long; request at most [.., {size})",
            url=url,
        )


class ObjectWriter(ABC):
    """A streamed writer for one object, returned by :meth:`Store.open_writer`.

    Use it as a context manager: leaving the block normally commits the object (atomically: it
    becomes visible whole, under its key, at that moment); leaving it with an exception aborts and
    leaves nothing visible. Outside a ``with`` block call :meth:`commit` or :meth:`abort` yourself.
    A writer is used by one thread at a time.
    """

    def __init__(self) -> None:
        self._closed = False
        self._written = 0

    @abstractmethod
    def _write(self, data: memoryview) -> None:
        """Append ``data`` to the pending object."""

    @abstractmethod
    def _commit(self) -> None:
        """Make the pending object visible under its key, atomically."""

    @abstractmethod
    def _abort(self) -> None:
        """Discard the pending object and release resources; must not raise for cleanup failures."""

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Append ``data``; return the number of bytes written (always ``len(data)``)."""
        if self._closed:
            raise ValueError("write to a committed or aborted ObjectWriter")
        view = memoryview(data).cast("B")
        if view.nbytes:
            self._write(view)
            self._written += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        """Bytes written so far."""
        return self._written

    def commit(self) -> None:
        """Publish the object. Idempotent after success; raises if already aborted."""
        if self._closed:
            return
        try:
            self._commit()
        except BaseException:
            self._closed = True
            self._abort()
            raise
        self._closed = True

    def abort(self) -> None:
        """Discard everything written. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        self._abort()

    @property
    def closed(self) -> bool:
        """True once committed or aborted."""
        return self._closed

    def __enter__(self) -> ObjectWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                self.abort()
            except Exception:  # pragma: no cover - best effort at interpreter shutdown
                pass


class _RangedReader(io.RawIOBase):
    """A sequential, read-only file object over a store object, fetched in ranged chunks."""

    def __init__(self, store: Store, key: str, size: int, chunk: int) -> None:
        super().__init__()
        self._store, self._key, self._size, self._chunk = store, key, size, chunk
        self._pos = 0
        self._buf = b""
        self._buf_start = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            base = 0
        elif whence == io.SEEK_CUR:
            base = self._pos
        elif whence == io.SEEK_END:
            base = self._size
        else:
            raise ValueError(f"invalid whence {whence!r}; use io.SEEK_SET, SEEK_CUR or SEEK_END")
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        out = memoryview(buffer).cast("B")
        if self._pos >= self._size or not out.nbytes:
            return 0
        rel = self._pos - self._buf_start
        if not (0 <= rel < len(self._buf)):
            end = min(self._size, self._pos + max(self._chunk, out.nbytes))
            self._buf = self._store.get(self._key, ByteRange(self._pos, end))
            self._buf_start, rel = self._pos, 0
        n = min(out.nbytes, len(self._buf) - rel)
        out[:n] = self._buf[rel : rel + n]
        self._pos += n
        return n


class Store(ABC):
    """Bytes under ``/``-separated string keys, somewhere.

    Subclasses implement :attr:`url`, :meth:`get`, :meth:`head`, :meth:`list`, :meth:`put`,
    :meth:`open_writer` and :meth:`delete`; they may override the conveniences for speed.
    Capability flags tell callers (and the conformance suite) what a backend can do.

    Thread safety: every method may be called from several threads at once. Process safety:
    stores pickle by configuration and reopen resources lazily in the new process.
    """

    #: ``put``, ``open_writer`` and ``delete`` work (False for read-only stores).
    supports_writes: ClassVar[bool] = True
    #: ``get`` with a byte range costs about the range, not the whole object.
    supports_range_reads: ClassVar[bool] = True
    #: ``list`` works.
    supports_listing: ClassVar[bool] = True
    #: Objects are files on a local filesystem; :meth:`local_path` returns their paths.
    has_local_paths: ClassVar[bool] = False
    #: A copy of the store in another process (pickled, or opened from the same URL) sees the same
    #: objects, including those written after the copy was made. False for ``memory://``, whose
    #: pickled copies carry a snapshot: writes in a worker process are not seen by the parent.
    shared_across_processes: ClassVar[bool] = True

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
        self,
        key: str,
        ranges: Sequence[ByteRange],
        *,
        coalesce: int = DEFAULT_COALESCE_BYTES,
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
        return io.BufferedReader(_RangedReader(self, key, size, chunk_size), buffer_size=1 << 16)

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
