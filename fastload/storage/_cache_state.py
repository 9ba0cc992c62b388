"""Parts of a :class:`~fastload.storage.CachingStore`: what one process of it keeps
(:class:`ProcessState`) and its writer (:class:`CacheWriter`)."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from fastload._memo import BoundedMemo
from fastload.errors import CacheFullError
from fastload.storage._cache_counters import COUNTER_NAMES, ProcessCounters
from fastload.storage._keys import ObjectMeta
from fastload.storage._streams import ObjectWriter

__all__ = ["CacheWriter", "ProcessState"]

_MAX_HEADS = 4096  # remembered forwarded heads (and the like) per process, least recent out beyond


@dataclasses.dataclass
class ProcessState:
    """What one process of a :class:`~fastload.storage.CachingStore` keeps: prefetch threads,
    counters and bounded memories (made again in each process: threads, locks and counters do not
    survive a fork or a pickle)."""

    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    pool: ThreadPoolExecutor | None = None
    pending: dict[str, Future[None]] = dataclasses.field(default_factory=dict)
    #: Keys whose cached copy this process has compared with the remote (``revalidate``).
    validated: set[str] = dataclasses.field(default_factory=set)
    #: Heads of uncached objects this process forwarded (key -> (monotonic time, answer)): the
    #: fill that usually follows (a shard reader asks for the size, then reads) reuses the answer
    #: instead of asking again.
    heads: BoundedMemo[str, tuple[float, ObjectMeta]] = dataclasses.field(
        default_factory=lambda: BoundedMemo(_MAX_HEADS)
    )
    counters: dict[str, int] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(COUNTER_NAMES, 0)
    )
    #: This process's counter file in the cache directory (the node's counts), made on first use;
    #: False when it could not be made.
    shared: ProcessCounters | bool | None = None
    #: Objects that found no room on the cache's filesystem: key -> (monotonic time, the error),
    #: read uncached until :data:`fastload.storage._cache.NO_ROOM_RETRY_S` has passed.
    no_room: BoundedMemo[str, tuple[float, CacheFullError]] = dataclasses.field(
        default_factory=lambda: BoundedMemo(_MAX_HEADS)
    )
    #: When this process last recorded a use of a cached object (path -> monotonic time).
    touched: BoundedMemo[str, float] = dataclasses.field(
        default_factory=lambda: BoundedMemo(_MAX_HEADS)
    )


class CacheWriter(ObjectWriter):
    """A :class:`~fastload.storage.CachingStore`'s writer: forwards to the wrapped store's writer
    and drops the cached copy on commit."""

    def __init__(self, cache: Any, key: str, inner: ObjectWriter) -> None:
        super().__init__()
        self._cache, self._key, self._inner = cache, key, inner

    def _write(self, data: memoryview) -> None:
        self._inner.write(data)

    def _commit(self) -> None:
        self._inner.commit()
        self._cache.invalidate(self._key)

    def _abort(self) -> None:
        self._inner.abort()
