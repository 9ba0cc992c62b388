"""One registry from URL scheme to store backend.

Entries are lazily imported class paths with an install hint, so ``import fastload`` never imports
boto3 or pyarrow. Third-party packages add schemes through the ``fastload.stores`` entry-point group
(``scheme = "package.module:StoreClass"``); :func:`register_store` does the same at run time.

A backend class provides ``from_url(url, **options) -> Store`` returning the bare backend, and may
set ``default_retry: ClassVar[bool]`` (``True`` for network stores such as S3 and HDFS) to ask
:func:`open_store` for a :class:`~fastload.storage.RetryStore` unless the caller says otherwise.

**Cross-cutting behaviour is added here, and only here**, as wrappers stacked from the inside out::

    CachingStore( RetryStore( LimitStore( backend ) ) )
    (cache_dir)   (retry)     (max_concurrency)

* :class:`~fastload.storage.LimitStore` is innermost, so a slot is held only while a request talks
  to the backend: a retry sleeping through its backoff does not keep a slot from other threads.
* :class:`~fastload.storage.RetryStore` is next, so every attempt passes the limit again, and every
  request the cache makes to fill itself (``head``, ranged reads) is retried on its own.
* :class:`~fastload.storage.CachingStore` is outermost: a cache hit touches neither the retry loop
  nor the limit, a fill that fails for good (retries exhausted) leaves no file behind, and readers
  get local paths (LMDB maps files; WebDataset and TFRecord shards are memory-mapped or read with
  ``pread`` from the cached copy).
"""

from __future__ import annotations

import inspect
import os
import re
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from fastload._plugins import PluginRegistry
from fastload.errors import InvalidArgumentError, UnknownSchemeError
from fastload.storage._base import Store

if TYPE_CHECKING:
    from fastload.storage._retry import RetryConfig

__all__ = ["known_schemes", "open_store", "register_store", "split_scheme", "wrap_store"]

#: Default byte budget of the local cache of :func:`open_store` (``cache_dir``).
DEFAULT_CACHE_SIZE = "10GB"

STORES = PluginRegistry("store backend", "fastload.stores", "Plain local paths need no scheme.")
STORES.register("file", "fastload.storage._local:LocalStore")
STORES.register("memory", "fastload.storage._memory:MemoryStore")
STORES.register("s3", "fastload.storage._s3:S3Store", extra="s3", modules=("boto3",))
STORES.register("hdfs", "fastload.storage._hdfs:HDFSStore", extra="hdfs", modules=("hdfs_native",))


def register_store(
    scheme: str, target: str | type, *, extra: str | None = None, modules: tuple[str, ...] = ()
) -> None:
    """Register (or replace) the backend for ``scheme``.

    Args:
        scheme: URL scheme without ``://``.
        target: A class with ``from_url(url, **options)``, or its path ``"package.module:Class"``.
        extra: The pip extra that provides the backend's dependencies, for install hints.
        modules: Third-party modules the backend imports, checked before it is loaded.
    """
    STORES.register(scheme, target, extra=extra, modules=modules)


def known_schemes() -> list[str]:
    """The registered URL schemes, sorted (plain paths count as ``file``)."""
    return STORES.names()


def split_scheme(url: str) -> tuple[str, str]:
    """Split ``url`` into (scheme, url); a plain path has scheme ``file``."""
    if "://" not in url:
        return "file", url
    return urlsplit(url).scheme.lower(), url


def open_store(
    url: str | os.PathLike[str],
    *,
    retry: bool | RetryConfig | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_size: int | str = DEFAULT_CACHE_SIZE,
    max_concurrency: int | None = None,
    **options: Any,
) -> Store:
    """Open the store that ``url`` names, with retries, a concurrency limit and a local cache.

    The wrappers are stacked as the module documentation describes:
    backend → :class:`~fastload.storage.LimitStore` → :class:`~fastload.storage.RetryStore` →
    :class:`~fastload.storage.CachingStore`.

    Args:
        url: A plain local path or ``file://`` URL (local disk), ``memory://name`` (in-process,
            for tests), ``s3://bucket/prefix`` (AWS S3, Ceph RGW, MinIO: pass ``endpoint_url``),
            ``hdfs://namenode:port/path``, or a scheme registered by a plugin.
        retry: ``None`` (default) = the backend's default: retries with the default
            :class:`~fastload.storage.RetryConfig` for network stores (``s3://``, ``hdfs://``),
            none for local and memory stores. ``True``/``False`` force them on/off; a
            ``RetryConfig`` turns them on with those limits (e.g. a shorter time budget).
        cache_dir: A local directory: cache whole objects there (shared safely by every process
            on the node; see :class:`~fastload.storage.CachingStore`). ``None`` = no cache.
        cache_size: Byte budget of the cache, an int or a string such as ``"50GB"``/``"1.5GiB"``
            (least recently used objects are evicted). Only used with ``cache_dir``.
        max_concurrency: At most this many requests in flight to the backend per process
            (:class:`~fastload.storage.LimitStore`). ``None`` = no limit.
        **options: Backend options (e.g. ``endpoint_url``, ``region``, ``read_only``).

    Raises:
        UnknownSchemeError: No backend is registered for the scheme; lists the known ones.
        MissingDependencyError: The backend's optional dependency is missing; gives the hint.
        InvalidArgumentError: An option is invalid, or unknown to the backend (the message lists
            the options it accepts).
    """
    text = os.fspath(url)
    scheme, _ = split_scheme(text)
    factory = STORES.load(scheme, error=UnknownSchemeError)
    try:
        store: Store = factory.from_url(text, **options)
    except TypeError as exc:
        unknown = _UNEXPECTED.search(str(exc))
        if unknown is None or unknown.group(1) not in options:
            raise
        raise InvalidArgumentError(
            f"unknown {scheme} store option {unknown.group(1)!r} for {text}; accepted: "
            f"{_accepted(factory)}, and for every store {', '.join(_WRAPPER_OPTIONS)}"
        ) from exc
    if retry is None:
        retry = bool(getattr(factory, "default_retry", False))
    return wrap_store(
        store,
        retry=retry,
        cache_dir=cache_dir,
        cache_size=cache_size,
        max_concurrency=max_concurrency,
    )


_UNEXPECTED = re.compile(r"unexpected keyword argument '(\w+)'")
_WRAPPER_OPTIONS = ("retry", "cache_dir", "cache_size", "max_concurrency")


def _accepted(factory: type) -> str:
    """The keyword options a backend's constructor names, for messages."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return "see the backend's documentation"
    names = [
        p.name
        for p in params
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is not p.empty
    ]
    return ", ".join(names) if names else "none"


def wrap_store(
    store: Store,
    *,
    retry: bool | RetryConfig = False,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_size: int | str = DEFAULT_CACHE_SIZE,
    max_concurrency: int | None = None,
) -> Store:
    """Stack the cross-cutting wrappers around an already open ``store``, in :func:`open_store`'s
    order (limit, then retries, then the cache). Nothing is added for the defaults.

    Args:
        store: The store to wrap.
        retry: ``False`` (default): no retries; ``True``: the default
            :class:`~fastload.storage.RetryConfig`; a ``RetryConfig``: those limits.
        cache_dir: Local cache directory, or ``None`` for no cache.
        cache_size: Byte budget of the cache (int or ``"50GB"``).
        max_concurrency: Requests in flight per process, or ``None`` for no limit.

    Raises:
        InvalidArgumentError: An argument has the wrong type or value.
    """
    from fastload.storage._cache import CachingStore
    from fastload.storage._limit import LimitStore
    from fastload.storage._retry import RetryConfig, RetryStore

    if not isinstance(store, Store):
        raise InvalidArgumentError(f"wrap_store needs a fastload Store, got {type(store).__name__}")
    if not isinstance(retry, bool | RetryConfig):
        raise InvalidArgumentError(
            f"retry must be None, True, False or a fastload.storage.RetryConfig, got {retry!r}"
        )
    if max_concurrency is not None:
        store = LimitStore(store, max_concurrency)
    if retry is not False:
        store = RetryStore(store, retry if isinstance(retry, RetryConfig) else None)
    if cache_dir is not None:
        store = CachingStore(store, cache_dir, cache_size)
    return store
