""":class:`WrapperStore`: the base of stores that add behaviour around another store.

A wrapper forwards every call to the store it wraps and overrides only what it changes (retries,
concurrency limits, caching). It reports the wrapped store's URL and capability flags, so callers
and the conformance suite see the same store, and it pickles as its configuration plus the
wrapped store.
"""

from __future__ import annotations

import builtins
import io
from collections.abc import Iterable, Iterator, Sequence

from fastload.errors import InvalidArgumentError
from fastload.storage._base import DEFAULT_COALESCE_BYTES, DEFAULT_READ_CHUNK, ObjectWriter, Store
from fastload.storage._keys import ByteRange, ObjectMeta

__all__ = ["WrapperStore"]


class WrapperStore(Store):
    """A store that forwards every operation to ``store``.

    Subclass it and override the operations whose behaviour changes; everything else, including
    the capability flags, :attr:`url`, :meth:`local_path`, :meth:`get_ranges` and
    :meth:`open_reader`, is the wrapped store's. Conveniences the wrapper does not forward
    (:meth:`exists`, :meth:`size`, :meth:`get_text`, :meth:`put_text`, :meth:`copy_to`, ...) go
    through the wrapper's own methods, so they get the wrapper's behaviour.

    Args:
        store: The store to wrap. The wrapper does not copy it; closing the wrapper closes it.

    Thread and process safety are those of the wrapped store unless a subclass says otherwise.
    """

    def __init__(self, store: Store) -> None:
        if not isinstance(store, Store):
            raise InvalidArgumentError(
                f"{type(self).__name__} wraps a fastload Store, got {type(store).__name__}; "
                "open one with fastload.open_store(url)"
            )
        self._store = store

    @property
    def inner(self) -> Store:
        """The wrapped store."""
        return self._store

    # ---- identity and capabilities: the wrapped store's ----------------------------------------

    @property
    def url(self) -> str:
        return self._store.url

    @property
    def read_only(self) -> bool:
        return self._store.read_only

    @property
    def supports_writes(self) -> bool:
        return self._store.supports_writes

    @property
    def supports_range_reads(self) -> bool:
        return self._store.supports_range_reads

    @property
    def supports_listing(self) -> bool:
        return self._store.supports_listing

    @property
    def has_local_paths(self) -> bool:
        return self._store.has_local_paths

    @property
    def local_root(self) -> str | None:
        return self._store.local_root

    @property
    def evicts_local_files(self) -> bool:
        return self._store.evicts_local_files

    @property
    def cache_dir(self) -> str | None:
        return self._store.cache_dir

    def node_stats(self, *, cached_bytes: bool = True) -> dict[str, int]:
        return self._store.node_stats(cached_bytes=cached_bytes)

    @property
    def shared_across_processes(self) -> bool:
        return self._store.shared_across_processes

    @property
    def supports_prefetch(self) -> bool:
        return self._store.supports_prefetch

    def prefetch(self, keys: Iterable[str]) -> None:
        self._store.prefetch(keys)

    # ---- required operations: forwarded ---------------------------------------------------------

    def get(self, key: str, byte_range: ByteRange | None = None) -> bytes:
        return self._store.get(key, byte_range)

    def head(self, key: str) -> ObjectMeta:
        return self._store.head(key)

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        return self._store.list(prefix)

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        self._store.put(key, data)

    def open_writer(self, key: str) -> ObjectWriter:
        return self._store.open_writer(key)

    def delete(self, key: str) -> None:
        self._store.delete(key)

    # ---- conveniences the wrapped store may have optimised: forwarded ---------------------------

    def get_ranges(
        self, key: str, ranges: Sequence[ByteRange], *, coalesce: int = DEFAULT_COALESCE_BYTES
    ) -> builtins.list[bytes]:
        return self._store.get_ranges(key, ranges, coalesce=coalesce)

    def open_reader(self, key: str, *, chunk_size: int = DEFAULT_READ_CHUNK) -> io.BufferedIOBase:
        return self._store.open_reader(key, chunk_size=chunk_size)

    def local_path(self, key: str) -> str | None:
        return self._store.local_path(key)

    def abort_incomplete_writes(self, prefix: str = "") -> builtins.list[str]:
        return self._store.abort_incomplete_writes(prefix)

    def child_url(self, key: str) -> str:
        return self._store.child_url(key)

    def close(self) -> None:
        self._store.close()

    # ---- display -------------------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._store!r})"
