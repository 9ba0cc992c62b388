"""Storage: bytes under keys, on any backend, behind one small interface.

Open a store by URL with :func:`open_store`; wrap it with :class:`RetryStore`,
:class:`LimitStore` (and, for remote stores, a local cache) to add cross-cutting behaviour.
Backends never know about shard formats.
"""

from fastload.storage._base import ByteRange, ObjectMeta, ObjectWriter, Store, validate_key
from fastload.storage._limit import LimitStore
from fastload.storage._local import LocalStore
from fastload.storage._memory import MemoryStore
from fastload.storage._registry import known_schemes, open_store, register_store
from fastload.storage._retry import RetryConfig, RetryStore
from fastload.storage._wrapper import WrapperStore

__all__ = [
    "ByteRange",
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
    "register_store",
    "validate_key",
]
