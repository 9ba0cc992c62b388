"""The fastload exception hierarchy.

Every error fastload raises on purpose derives from :class:`FastloadError`. Specific errors also derive
from the matching built-in exception, so callers can catch what they already know::

    try:
        store.get("missing")
    except FileNotFoundError:  # ObjectNotFoundError is one
        ...

Messages name the store URL, key, shard or byte offset involved and say what to do about it.
Errors never carry credentials.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "BatchShapeError",
    "CacheFullError",
    "ConversionError",
    "CorruptDataError",
    "DatasetExistsError",
    "FastloadError",
    "FormatError",
    "InvalidArgumentError",
    "InvalidKeyError",
    "InvalidRangeError",
    "LaunchEnvironmentError",
    "ManifestError",
    "ManifestTotalsError",
    "MissingDependencyError",
    "MissingIndexError",
    "ObjectNotFoundError",
    "ReadOnlyStoreError",
    "StoreAuthError",
    "StoreError",
    "StorePermissionError",
    "StoreUnavailableError",
    "TransientStoreError",
    "UnknownSchemeError",
    "UnsafeDataError",
    "UnsupportedManifestVersionError",
    "WorkerError",
]


class FastloadError(Exception):
    """Root of every error fastload raises on purpose."""


# --- arguments and environment ------------------------------------------------------------------


class InvalidArgumentError(FastloadError, ValueError):
    """An argument or option has a value fastload cannot use; the message lists what is accepted."""


class UnknownSchemeError(InvalidArgumentError):
    """A URL's scheme names no registered store backend; the message lists the known schemes."""


class LaunchEnvironmentError(InvalidArgumentError):
    """The environment shows a multi-process launch (``torchrun``, ``horovodrun``, ``mpirun``,
    ``srun``) whose rank or world size is missing, malformed or contradicted.

    Raised instead of taking rank 0 of 1, which would make every process read the whole dataset.
    The message lists the variables seen and says to pass ``rank=``/``world_size=``.

    Attributes:
        variables: The launch variables set in the environment, ``{name: value}``.
    """

    def __init__(self, message: str, *, variables: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.variables: dict[str, str] = dict(variables or {})


class MissingDependencyError(FastloadError, ImportError):
    """An optional dependency is not installed; the message gives the ``pip install`` command."""


# --- storage -------------------------------------------------------------------------------------


class StoreError(FastloadError):
    """A storage operation failed.

    Attributes:
        url: The URL of the object or store involved (without credentials), or ``""``.
        retryable: Whether repeating the same operation may succeed (network blips, throttling, 5xx).
            :class:`fastload.storage.RetryStore` retries exactly the errors for which this is true.
    """

    retryable: bool = False

    def __init__(self, message: str, *, url: str = "") -> None:
        super().__init__(message)
        self.url = url


class ObjectNotFoundError(StoreError, FileNotFoundError):
    """The key (or bucket, or dataset) does not exist in the store."""


class StorePermissionError(StoreError, PermissionError):
    """The store refused the operation (permissions, ACLs)."""


class StoreAuthError(StorePermissionError):
    """The credentials were rejected. The message says where credentials were looked for."""


class ReadOnlyStoreError(StorePermissionError):
    """A write, delete or streamed write was attempted on a store that does not accept writes."""


class InvalidKeyError(StoreError, ValueError):
    """A key is not acceptable: empty, absolute, escaping the store root (``..``), or has NUL bytes."""


class InvalidRangeError(StoreError, ValueError):
    """A byte range is malformed or reaches past the end of the object; the message gives its size."""


class TransientStoreError(StoreError, ConnectionError):
    """A failure that may go away when retried: timeouts, throttling, server errors, dropped
    connections."""

    retryable = True


class StoreUnavailableError(StoreError, ConnectionError):
    """The store could not be reached even after retrying; the message says for how long it tried."""


class CacheFullError(StoreError, OSError):
    """A local cache could not hold an object: its filesystem had no room (``ENOSPC``) or the
    disk quota was spent (``EDQUOT``) even after evicting what could be evicted.

    The message names the object, the cache directory, its byte budget and the free space, and
    says what to change. :attr:`errno` is ``ENOSPC`` or ``EDQUOT``, so code that checks an
    ``OSError``'s errno keeps working. A :class:`~fastload.storage.CachingStore` raises it only
    where a local copy is required (:meth:`~fastload.storage.Store.local_path`); its reads stream
    such an object uncached instead.

    Attributes:
        url: The URL of the object that did not fit.
        cache_dir: The cache directory.
    """

    def __init__(self, message: str, *, url: str = "", cache_dir: str = "", code: int = 0) -> None:
        super().__init__(message, url=url)
        self.cache_dir = cache_dir
        self.errno = code or None


# --- data and formats ---------------------------------------------------------------------------


class FormatError(FastloadError, ValueError):
    """Data does not follow the format it claims to be in.

    Attributes:
        url: The store URL of the shard (or file) involved, or ``""``.
        offset: Byte offset in the shard where the problem was found, or ``None``.
        key: The sample key involved, or ``None``.
    """

    def __init__(
        self,
        message: str,
        *,
        url: str = "",
        offset: int | None = None,
        key: str | None = None,
    ) -> None:
        parts = [message]
        where = []
        if url:
            where.append(url)
        if offset is not None:
            where.append(f"byte offset {offset}")
        if key is not None:
            where.append(f"key {key!r}")
        if where:
            parts.append(f"({', '.join(where)})")
        super().__init__(" ".join(parts))
        self.url = url
        self.offset = offset
        self.key = key


class CorruptDataError(FormatError):
    """Bytes are damaged: a truncated shard, a bad checksum, undecodable payload."""


class UnsafeDataError(FormatError, PermissionError):
    """Decoding would run untrusted code (pickle). Refused unless explicitly allowed."""


class MissingIndexError(FormatError, TypeError):
    """A shard has no index, so it cannot be counted or read by position; build one with
    ``fastload index``. Also a :class:`TypeError`, so ``len()`` length hints fall back to
    iteration."""


class ManifestError(FormatError):
    """A dataset manifest (``fastload.json``) is missing fields or inconsistent with the shards."""


class ManifestTotalsError(ManifestError):
    """The manifest's ``num_samples`` or ``num_bytes`` disagrees with the sum of its shard entries:
    an entry or a total was edited. The message names the shards whose entries disagree with the
    objects stored, where the store could be asked.

    Attributes:
        manifest: The manifest as parsed (a :class:`~fastload.formats.Manifest`), for a caller
            that checks every shard anyway (``fastload verify`` reports this and goes on).
        found: What disagrees (``"manifest says num_bytes=... but its shards add up to ..."``).
        remedy: How to repair the manifest (starts with ``"; "``).
    """

    def __init__(self, found: str, remedy: str, *, url: str = "", manifest: object = None) -> None:
        super().__init__(found + remedy, url=url)
        self.manifest, self.found, self.remedy = manifest, found, remedy


class UnsupportedManifestVersionError(ManifestError):
    """The manifest was written by a newer fastload; upgrade fastload to read it."""


class DatasetExistsError(FastloadError, FileExistsError):
    """The destination already holds a different dataset; pass ``overwrite=True`` to replace it."""


# --- conversion ----------------------------------------------------------------------------------


class ConversionError(FastloadError):
    """An input item could not be read or converted; the message names the item (file, line,
    row or shard position) and the shard it was planned for. Raised under ``on_error="raise"``;
    with ``on_error="skip"`` the item is listed in the skip report instead."""


# --- loading -------------------------------------------------------------------------------------


class BatchShapeError(FastloadError, ValueError):
    """The samples of a batch cannot be stacked: a field holds arrays of different shapes (images
    of different sizes without a resizing transform, say).

    The message names the field, two of the shapes (with their sample keys when known) and the
    ways out: a transform that gives every sample one shape, or a ``collate_fn`` that keeps a list.

    Attributes:
        field: The field, as a name (``'jpg'``) or a position in tuple samples (``'[0]'``).
        shapes: Two of the differing shapes.
        keys: The sample keys of those two shapes, ``None`` where unknown.
    """

    def __init__(
        self,
        message: str,
        *,
        field: str = "",
        shapes: tuple[tuple[int, ...], tuple[int, ...]] = ((), ()),
        keys: tuple[str | None, str | None] = (None, None),
    ) -> None:
        super().__init__(message)
        self.field = field
        self.shapes = shapes
        self.keys = keys


class WorkerError(FastloadError, RuntimeError):
    """A loader worker failed; the message names the worker, shard and sample key when known."""
