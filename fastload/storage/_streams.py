"""The stream types of stores: :class:`ObjectWriter` (what ``open_writer`` returns) and
:class:`SeekableReader`, the base of the raw readers behind ``open_reader``."""

from __future__ import annotations

import io
from abc import ABC, abstractmethod
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Self

from fastload.storage._keys import ByteRange

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

__all__ = ["CommitOnExit", "ObjectWriter", "RangedReader", "SeekableReader", "reader_version"]


class CommitOnExit(ABC):
    """The ``with`` block of a writer that publishes its output whole: leaving the block
    normally publishes it (:meth:`_publish_on_exit`), leaving it with an exception calls
    :meth:`abort`.

    Shared by :class:`ObjectWriter` (which publishes with ``commit()``) and the shard writers of
    :mod:`fastload.formats` (``close()``), so that the rule is written once.
    """

    @abstractmethod
    def _publish_on_exit(self) -> object:
        """Publish what was written: what leaving the block normally does."""

    @abstractmethod
    def abort(self) -> None:
        """Discard what was written; safe to call more than once."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self._publish_on_exit()
        else:
            self.abort()


class ObjectWriter(CommitOnExit):
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

    def _publish_on_exit(self) -> None:
        self.commit()

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

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                self.abort()
            except Exception:  # pragma: no cover - best effort at interpreter shutdown
                pass


class SeekableReader(io.RawIOBase):
    """The one base of fastload's raw, read-only, seekable streams over a store object.

    It keeps the position and does the file-object bookkeeping (``readable``, ``seekable``,
    ``tell``, ``seek`` with the three ``whence`` values, ``readinto`` on any writable buffer);
    a subclass supplies the bytes:

    * :meth:`_read_into` fills a buffer from the current position (``self._pos``) and returns
      how many bytes it wrote, 0 at the end of the object. The base advances the position.
    * :meth:`_size` is the object's size in bytes, asked only by ``seek(..., io.SEEK_END)``.
    * :meth:`_moved` is called after a seek changed the position, for a subclass that holds an
      open stream that no longer starts at the position (it drops the stream).

    Wrap it in :class:`io.BufferedReader` for ``read``/``readline``. One thread per reader.
    """

    def __init__(self) -> None:
        super().__init__()
        self._pos = 0

    @abstractmethod
    def _read_into(self, out: memoryview) -> int:
        """Copy up to ``out.nbytes`` (> 0) bytes from ``self._pos`` into ``out``; 0 at the end."""

    @abstractmethod
    def _size(self) -> int:
        """The object's size in bytes."""

    def _moved(self) -> None:
        """The position changed by a seek; the default keeps nothing that depends on it."""

    @property
    def version(self) -> str | None:
        """An opaque name of the object version this reader reads (an S3 ETag), or ``None`` where
        the backend cannot tell. :class:`~fastload.storage.RetryStore` compares it when it reopens
        a broken stream, so a stream resumed across a replacement of its object raises instead of
        mixing the bytes of two versions."""
        return None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            target = offset
        elif whence == io.SEEK_CUR:
            target = self._pos + offset
        elif whence == io.SEEK_END:
            target = self._size() + offset
        else:
            raise ValueError(f"invalid whence {whence!r}; use io.SEEK_SET, SEEK_CUR or SEEK_END")
        if target < 0:
            raise ValueError(f"negative seek position {target}")
        if target != self._pos:
            self._pos = target
            self._moved()
        return self._pos

    def readinto(self, buffer: WriteableBuffer, /) -> int:
        out = memoryview(buffer).cast("B")
        if not out.nbytes:
            return 0
        n = self._read_into(out)
        self._pos += n
        return n


class RangedReader(SeekableReader):
    """A read-only file object over an object of ``size`` bytes, fetched in ranged gets of at
    least ``chunk`` bytes by ``get(byte_range)`` (the default reader of every store)."""

    def __init__(self, get: Callable[[ByteRange], bytes], size: int, chunk: int) -> None:
        super().__init__()
        self._get, self._object_size, self._chunk = get, size, chunk
        self._buf = b""
        self._buf_start = 0

    def _size(self) -> int:
        return self._object_size

    def _read_into(self, out: memoryview) -> int:
        if self._pos >= self._object_size:
            return 0
        rel = self._pos - self._buf_start
        if not (0 <= rel < len(self._buf)):
            end = min(self._object_size, self._pos + max(self._chunk, out.nbytes))
            self._buf = self._get(ByteRange(self._pos, end))
            self._buf_start, rel = self._pos, 0
        n = min(out.nbytes, len(self._buf) - rel)
        out[:n] = self._buf[rel : rel + n]
        return n


def reader_version(reader: io.IOBase) -> str | None:
    """The object version a store's reader reads: its ``version`` attribute, or that of the raw
    stream under an :class:`io.BufferedReader` (:attr:`SeekableReader.version`); ``None`` where
    the reader cannot tell (a store without versions, the default ranged reader)."""
    for layer in (reader, getattr(reader, "raw", None)):
        version = getattr(layer, "version", None)
        if isinstance(version, str):
            return version
    return None
