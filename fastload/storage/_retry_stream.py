"""The stream of :meth:`RetryStore.open_reader <fastload.storage.RetryStore.open_reader>`: a
broken stream resumed where it stopped, and the check that it still reads the object it began
with (see :mod:`fastload.storage._retry` for the policy)."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Protocol, TypeVar

from fastload.errors import StoreError, TransientStoreError
from fastload.storage._base import Store
from fastload.storage._keys import ObjectMeta
from fastload.storage._streams import SeekableReader, reader_version

__all__ = ["ResumingReader", "Retrying"]

T = TypeVar("T")


class Retrying(Protocol):
    """What the reader needs of its :class:`~fastload.storage.RetryStore` (named so, not
    imported, to keep the two modules free of an import cycle)."""

    @property
    def inner(self) -> Store: ...

    def head(self, key: str) -> ObjectMeta: ...

    def child_url(self, key: str) -> str: ...

    def _clock(self) -> float: ...

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T: ...

    def _retryable(self, exc: BaseException) -> bool: ...

    def _note(self, exc: BaseException | None) -> None: ...

    def _count(self, name: str) -> None: ...

    def _wait_or_give_up(
        self, op: str, key: str, exc: Exception, retry: int, began: float
    ) -> None: ...


class ResumingReader(SeekableReader):
    """A read-only stream over the wrapped store's reader that survives transient failures.

    Opening and reading run under :meth:`RetryStore._call`'s policy; after a failure the inner
    reader is reopened and positioned at the current offset, so no byte is read twice or lost.
    This is the one place a broken stream is resumed: backends' readers raise instead.
    """

    def __init__(self, retry: Retrying, key: str, chunk_size: int) -> None:
        super().__init__()
        self._retry, self._key, self._chunk = retry, key, chunk_size
        self._inner: io.BufferedIOBase | None = None
        self._version: str | None = None  # the object version the first open read
        self._size_at_open: int | None = None
        self._broken = False  # the stream broke; the next open resumes it
        self._inner = self._open()
        self._version = reader_version(self._inner)
        if self._version is not None:
            self._size_at_open = _reader_size(self._inner)

    def _open(self) -> io.BufferedIOBase:
        def attempt() -> io.BufferedIOBase:
            reader = self._retry.inner.open_reader(self._key, chunk_size=self._chunk)
            if self._inner is None and self._version is not None:  # a reopen: same version?
                try:
                    self._check_same(reader_version(reader))
                except BaseException:
                    reader.close()
                    raise
            if self._pos:
                reader.seek(self._pos)
            return reader

        reader = self._retry._call("open_reader", self._key, attempt)
        if self._broken:
            self._broken = False
            self._retry._count("resumed_reads")
        return reader

    def _check_same(self, now: str | None) -> None:
        """Raise unless the object a reopened reader names (``now``) is the one the read began
        with, judged only from what the answers say (see the module documentation):
        :class:`StoreError` for a change, :class:`TransientStoreError` (asked again under the
        retry budget) when the answers cannot tell."""
        if now == self._version:
            return
        url = self._retry.child_url(self._key)
        meta = self._retry.inner.head(self._key)  # errors: retried by the caller's loop
        if meta.etag is None:
            raise TransientStoreError(
                f"cannot tell whether {url} changed while it was being read: the resumed read "
                f"named version {now!r} (the read began with {self._version!r}) and a HEAD "
                "named none; asking again",
                url=url,
            )
        if meta.etag != self._version:
            raise StoreError(
                f"{url} changed while it was being read (version {self._version!r} when the "
                f"read began, {meta.etag!r} when it resumed at byte {self._pos}); read it again",
                url=url,
            )
        if now is None and (self._size_at_open is None or meta.size == self._size_at_open):
            return  # the answer left its version out; the object is the one the read began with
        raise TransientStoreError(
            f"the resumed read of {url} named version {now!r}, but a HEAD names "
            f"{self._version!r}, the version the read began with; asking again",
            url=url,
        )

    @property
    def version(self) -> str | None:
        return self._version

    def _drop(self) -> None:
        if self._inner is not None:
            try:
                self._inner.close()
            except Exception:  # a broken stream may fail to close; it is discarded anyway
                pass
            self._inner = None

    def _size(self) -> int:
        return self._retry.head(self._key).size

    def _moved(self) -> None:
        self._drop()

    def _read_into(self, out: memoryview) -> int:
        began = self._retry._clock()
        retry = 0
        while True:
            try:
                if self._inner is None:
                    self._inner = self._open()
                return self._inner.readinto(out)
            except Exception as exc:
                if not self._retry._retryable(exc):
                    self._retry._note(exc)
                    raise
                self._drop()
                self._broken = True
                self._retry._wait_or_give_up("read", self._key, exc, retry, began)
                retry += 1

    def close(self) -> None:
        self._drop()
        super().close()


def _reader_size(reader: io.IOBase) -> int | None:
    """The object size a reader knows without asking (``size`` or the raw stream's
    ``_size()`` where that is answered from the first response), or None."""
    for layer in (reader, getattr(reader, "raw", None)):
        size = getattr(layer, "object_size", None)
        if isinstance(size, int):
            return size
    return None
