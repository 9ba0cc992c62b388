"""Storage: bytes under keys, on any backend, behind one small interface.

Open a store by URL with :func:`open_store`, which also adds the cross-cutting behaviour as
wrappers: retries (:class:`RetryStore`, on by default for network stores), a concurrency limit
(:class:`LimitStore`) and a local disk cache (:class:`CachingStore`); :func:`wrap_store` stacks the
same wrappers around a store you already have. Backends never know about shard formats.
"""

from fastload.storage._base import (
    DEFAULT_READ_CHUNK,
    ByteRange,
    ObjectMeta,
    ObjectWriter,
    Store,
    check_range,
    validate_key,
)
from fastload.storage._cache import CachingStore, parse_size
from fastload.storage._cache_dir import CacheSpaceWarning
from fastload.storage._limit import LimitStore
from fastload.storage._local import LocalStore, make_scratch_dir, remove_stale_temporaries
from fastload.storage._memory import MemoryStore
from fastload.storage._registry import (
    DEFAULT_CACHE_SIZE,
    known_schemes,
    open_store,
    register_store,
    wrap_store,
)
from fastload.storage._retry import RetryConfig, RetryStore, unreachable_reason
from fastload.storage._streams import CommitOnExit
from fastload.storage._wrapper import WrapperStore

__all__ = [
    "DEFAULT_CACHE_SIZE",
    "DEFAULT_READ_CHUNK",
    "check_range",
    "CommitOnExit",
    "make_scratch_dir",
    "remove_stale_temporaries",
    "unreachable_reason",
    "ByteRange",
    "CacheSpaceWarning",
    "CachingStore",
    "LimitStore",
    "LocalStore",
    "MemoryStore",
    "ObjectMeta",
    "ObjectWriter",
    "RetryConfig",
    "RetryStore",
    "Store",
    "WrapperStore",
    "known_schemes",
    "open_store",
    "parse_size",
    "register_store",
    "validate_key",
    "wrap_store",
]
