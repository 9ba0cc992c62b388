"""One registry from URL scheme to store backend.

Entries are lazily imported class paths with an install hint, so ``import fastload`` never imports
boto3 or pyarrow. Third-party packages add schemes through the ``fastload.stores`` entry-point group
(``scheme = "package.module:StoreClass"``); :func:`register_store` does the same at run time.

A backend class provides ``from_url(url, **options) -> Store``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from fastload._plugins import PluginRegistry
from fastload.errors import UnknownSchemeError

if TYPE_CHECKING:
    from fastload.storage._base import Store

__all__ = ["known_schemes", "open_store", "register_store", "split_scheme"]

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


def open_store(url: str | os.PathLike[str], **options: Any) -> Store:
    """Open the store that ``url`` names.

    Args:
        url: A plain local path or ``file://`` URL (local disk), ``memory://name`` (in-process,
            for tests), ``s3://bucket/prefix`` (AWS S3, Ceph RGW, MinIO: pass ``endpoint_url``),
            ``hdfs://namenode:port/path``, or a scheme registered by a plugin.
        **options: Backend options (e.g. ``endpoint_url``, ``region``, ``read_only``).

    Raises:
        UnknownSchemeError: No backend is registered for the scheme; lists the known ones.
        MissingDependencyError: The backend's optional dependency is missing; gives the hint.
    """
    text = os.fspath(url)
    scheme, _ = split_scheme(text)
    factory = STORES.load(scheme, error=UnknownSchemeError)
    store: Store = factory.from_url(text, **options)
    return store
