""":class:`LimitStore`: bound the number of concurrent operations on any store."""

from __future__ import annotations

import builtins
import io
import os
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from fastload.errors import InvalidArgumentError
from fastload.storage._base import DEFAULT_COALESCE_BYTES, DEFAULT_READ_CHUNK, ObjectWriter, Store
from fastload.storage._keys import ByteRange, ObjectMeta
from fastload.storage._streams import reader_version
from fastload.storage._wrapper import WrapperStore

__all__ = ["LimitStore"]

# Every LimitStore of this process, so that a forked child gets fresh semaphores: slots held by
# threads of the parent at fork time would otherwise stay taken forever in the child.
_LIVE: weakref.WeakSet[LimitStore] = weakref.WeakSet()


def _reset_after_fork() -> None:
    for store in builtins.list(_LIVE):
        store._reset_slots()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


class LimitStore(WrapperStore):
    """Allow at most ``max_concurrency`` operations on ``store`` at once, per process.

    Each call into the wrapped store holds one slot for its duration: ``get``, ``head``, ``put``,
    ``delete``, ``get_ranges`` (one slot for the whole call), fetching the next listing entry,
    opening a reader or writer, and each ``read``/``write``/``commit`` of a streamed reader or
    writer. Callers beyond the limit wait (threads block) until a slot frees.

    Open readers and writers, and unfinished listings, do not hold a slot between calls: holding
    one for a writer's lifetime would deadlock code that reads from the same store while writing
    (with a limit of 1: ``with s.open_writer(a) as w: w.write(s.get(b))``). ``abort`` takes no
    slot, because it runs during error handling and garbage collection, where waiting could
    deadlock.

    The limit is per process and per wrapper object: a pickled copy (e.g. in a DataLoader
    worker) and a forked child start with all ``max_concurrency`` slots free.

    Args:
        store: The store to wrap.
        max_concurrency: Maximum concurrent operations, ``>= 1``.
    """

    def __init__(self, store: Store, max_concurrency: int) -> None:
        super().__init__(store)
        if (
            not isinstance(max_concurrency, int)
            or isinstance(max_concurrency, bool)
            or max_concurrency < 1
        ):
            raise InvalidArgumentError(
                f"LimitStore max_concurrency must be an int >= 1, got {max_concurrency!r}"
            )
        self._max_concurrency = max_concurrency
        self._reset_slots()
        _LIVE.add(self)

    def _reset_slots(self) -> None:
        self._slots = threading.BoundedSemaphore(self._max_concurrency)

    @property
    def max_concurrency(self) -> int:
        """Maximum number of operations in flight at once in this process."""
        return self._max_concurrency

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_slots"]  # a semaphore is per process; recreated on unpickling
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_slots()
        _LIVE.add(self)

    # ---- operations ---------------------------------------------------------------------------

    def get(self, key: str, byte_range: ByteRange | None = None) -> bytes:
        with self._slots:
            return self._store.get(key, byte_range)

    def head(self, key: str) -> ObjectMeta:
        with self._slots:
            return self._store.head(key)

    def get_ranges(
        self, key: str, ranges: Sequence[ByteRange], *, coalesce: int = DEFAULT_COALESCE_BYTES
    ) -> builtins.list[bytes]:
        with self._slots:
            return self._store.get_ranges(key, ranges, coalesce=coalesce)

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        with self._slots:
            self._store.put(key, data)

    def delete(self, key: str) -> None:
        with self._slots:
            self._store.delete(key)

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        with self._slots:
            iterator = iter(self._store.list(prefix))
        while True:
            with self._slots:
                meta = next(iterator, None)
            if meta is None:
                return
            yield meta

    def open_writer(self, key: str) -> ObjectWriter:
        with self._slots:
            inner = self._store.open_writer(key)
        return _LimitedWriter(inner, self._slots)

    def open_reader(self, key: str, *, chunk_size: int = DEFAULT_READ_CHUNK) -> io.BufferedIOBase:
        with self._slots:
            inner = self._store.open_reader(key, chunk_size=chunk_size)
        return _LimitedReader(inner, self._slots)

    def __repr__(self) -> str:
        return f"LimitStore({self._store!r}, max_concurrency={self._max_concurrency})"


class _LimitedWriter(ObjectWriter):
    """Forwards to the wrapped store's writer, holding a slot for each write and the commit."""

    def __init__(self, inner: ObjectWriter, slots: threading.BoundedSemaphore) -> None:
        super().__init__()
        self._inner, self._slots = inner, slots

    def _write(self, data: memoryview) -> None:
        with self._slots:
            self._inner.write(data)

    def _commit(self) -> None:
        with self._slots:
            self._inner.commit()

    def _abort(self) -> None:
        self._inner.abort()


class _LimitedReader(io.BufferedIOBase):
    """Forwards to the wrapped store's reader, holding a slot for each read."""

    def __init__(self, inner: io.BufferedIOBase, slots: threading.BoundedSemaphore) -> None:
        super().__init__()
        self._inner, self._slots = inner, slots

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self._inner.seekable()

    def read(self, size: int | None = -1) -> bytes:
        with self._slots:
            return self._inner.read(size)

    def read1(self, size: int = -1) -> bytes:
        with self._slots:
            return self._inner.read1(size)

    def readinto(self, buffer: Any) -> int:
        with self._slots:
            return self._inner.readinto(buffer)

    def readinto1(self, buffer: Any) -> int:
        with self._slots:
            return self._inner.readinto1(buffer)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._inner.seek(offset, whence)

    @property
    def version(self) -> str | None:
        """The object version the wrapped reader reads (see :func:`reader_version`)."""
        return reader_version(self._inner)

    def tell(self) -> int:
        return self._inner.tell()

    def close(self) -> None:
        try:
            self._inner.close()
        finally:
            super().close()
