"""What every shard format provides: a writer, a reader, an index builder.

A format is a :class:`Format` record registered under a name (``webdataset``, ``tfrecord``,
``lmdb``) in one registry; third parties add formats through the ``fastload.formats`` entry-point
group. Formats take a :class:`~fastload.storage.Store` and a key; they never know where the bytes live.

Contracts:

* :class:`ShardWriter` writes one shard through the store's streamed writer (or ``put``). Nothing is
  visible under the shard's key until :meth:`ShardWriter.close` returns; the index object (if the
  format has one) is written after the shard. An aborted writer leaves nothing visible.
* :class:`ShardReader` yields samples ``{"__key__": str, "__url__": shard URL, "__index__": int,
  field: bytes}`` in shard order. Field bytes are exactly the bytes written. Readers stream: they
  never need the whole shard in memory. With an index they also give random access by position.
* Corrupt data raises :class:`~fastload.errors.CorruptDataError` naming the shard URL and the byte
  offset or key, unless the reader's ``on_error`` policy says to skip or warn; skipped samples are
  counted in :attr:`ShardReader.skipped`.
"""

from __future__ import annotations

import hashlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypedDict, get_args

from fastload._plugins import PluginRegistry
from fastload.errors import CorruptDataError, FormatError, InvalidArgumentError, MissingIndexError
from fastload.storage import CommitOnExit, Store

__all__ = [
    "DAMAGED_SHARD_REMEDY",
    "FORMATS",
    "ErrorPolicy",
    "Format",
    "OnError",
    "ReaderOptions",
    "ShardInfo",
    "ShardReader",
    "ShardWriter",
    "get_format",
]

log = logging.getLogger("fastload.formats")

OnError = Literal["raise", "skip", "warn"]

#: What to tell a user about a shard whose bytes are damaged, appended to error messages
#: (``fastload index`` rebuilds indexes and manifests; it cannot repair a shard).
DAMAGED_SHARD_REMEDY = (
    "; restore the shard from its source, or re-create the dataset with `fastload convert`"
)
_ON_ERROR: tuple[str, ...] = get_args(OnError)


class ErrorPolicy:
    """Applies an ``on_error`` policy and counts what was skipped.

    ``raise``: re-raise. ``skip``: count and continue silently. ``warn``: count, log a warning,
    continue.
    """

    def __init__(self, on_error: str = "raise") -> None:
        self.on_error = self.check(on_error)
        self.skipped = 0
        self.errors: list[str] = []  # the first few messages, for reports

    @staticmethod
    def check(
        on_error: object, *, choices: tuple[str, ...] = _ON_ERROR, name: str = "on_error"
    ) -> str:
        """``on_error`` if it is one of ``choices`` (a subset of the policies: ``convert`` takes
        no ``warn``), else :class:`InvalidArgumentError` naming ``name`` and the choices."""
        if on_error not in choices or not isinstance(on_error, str):
            *rest, last = (repr(c) for c in choices)
            wanted = f"{', '.join(rest)} or {last}" if rest else last
            raise InvalidArgumentError(f"{name} must be {wanted}, got {on_error!r}")
        return on_error

    def handle(self, exc: FormatError) -> None:
        """Raise ``exc`` or record it, according to the policy."""
        if self.on_error == "raise":
            raise exc
        self.skipped += 1
        if len(self.errors) < 100:
            self.errors.append(str(exc))
        if self.on_error == "warn":
            log.warning("skipping corrupt data: %s", exc)


@dataclass
class ShardInfo:
    """What a writer reports about the shard it wrote; becomes a manifest entry.

    Attributes:
        key: The shard's key in the store.
        num_samples: Samples in the shard.
        num_bytes: Size of the shard object in bytes.
        sha256: Hex SHA-256 of the shard object's bytes.
        index_key: Key of the index object written beside the shard, or ``None``.
        fields: Field name → number of samples that have it.
    """

    key: str
    num_samples: int
    num_bytes: int
    sha256: str
    index_key: str | None = None
    fields: dict[str, int] = field(default_factory=dict)


class _HashingCounter:
    """SHA-256 and byte count of everything passed through :meth:`update`."""

    def __init__(self) -> None:
        self.sha = hashlib.sha256()
        self.nbytes = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self.sha.update(data)
        self.nbytes += len(data)


class ShardWriter(CommitOnExit):
    """Writes samples into one shard object.

    Use as a context manager, or call :meth:`close` (commit) / :meth:`abort` yourself.

    Args:
        store: Where the shard goes.
        key: The shard's key, e.g. ``"train-000000.tar"``.
        index: Also write the format's index as ``key + ".idx"`` (formats that have one).
    """

    def __init__(self, store: Store, key: str, *, index: bool = True) -> None:
        self.store, self.key, self.write_index = store, key, index
        self.num_samples = 0
        self.fields: dict[str, int] = {}

    @abstractmethod
    def write(self, sample: Mapping[str, Any]) -> None:
        """Append one sample (see :mod:`fastload.formats._sample` for what values are accepted).

        Raises:
            InvalidArgumentError: The sample has no valid ``__key__`` or a field cannot be encoded.
        """

    @property
    @abstractmethod
    def num_bytes(self) -> int:
        """Bytes of shard written so far (for rolling over at a target size)."""

    @abstractmethod
    def close(self) -> ShardInfo:
        """Finish the shard, commit it (then its index) to the store, and describe it."""

    @abstractmethod
    def abort(self) -> None:
        """Discard the shard; nothing becomes visible. Safe to call more than once."""

    def _shard_info(self, *, num_bytes: int, sha256: str, index_key: str | None) -> ShardInfo:
        """The :class:`ShardInfo` of the committed shard, with the samples and fields counted."""
        return ShardInfo(
            key=self.key,
            num_samples=self.num_samples,
            num_bytes=num_bytes,
            sha256=sha256,
            index_key=index_key,
            fields=dict(self.fields),
        )

    def _count_fields(self, sample: Mapping[str, Any]) -> None:
        self.num_samples += 1
        for name in sample:
            if not name.startswith("__"):
                self.fields[name] = self.fields.get(name, 0) + 1

    def _publish_on_exit(self) -> ShardInfo:
        return self.close()


class ReaderOptions(TypedDict, total=False):
    """The options every :class:`ShardReader` takes, by keyword (see its Args).

    A format's reader adds its own options and passes these on as ``**options``, so that the
    common ones are declared and checked in one place.
    """

    on_error: OnError
    index_key: str | None
    num_samples: int | None
    num_bytes: int | None
    sha256: str | None


class ShardReader(ABC):
    """Reads samples from one shard.

    Args:
        store: Where the shard is.
        key: The shard's key.
        on_error: ``raise`` (default), ``skip`` or ``warn`` for corrupt samples.
        index_key: Key of the shard's index; ``None`` means ``key + ".idx"`` if it exists.
        num_samples: Samples the shard holds according to the dataset manifest, or ``None``
            (unknown). Readers check their index (or own count) against it before use, so a
            damaged index or a manifest that lies is reported instead of breaking exactly-once.
        num_bytes: The shard's size in bytes according to the manifest, or ``None``. A shard
            found shorter is truncated: readers deliver only the samples that lie wholly within
            the bytes present and report the rest as corrupt.
        sha256: The shard's SHA-256 (hex) according to the manifest, or ``None``. A reader may
            hash the shard where that costs less than checking its structure (LMDB does, for
            shards of small samples): bytes that match need no further checks.
    """

    #: Whether :meth:`read` / :meth:`__len__` work (needs an index or a native random-access layout).
    supports_random_access: ClassVar[bool] = False

    def __init__(
        self,
        store: Store,
        key: str,
        *,
        on_error: OnError = "raise",
        index_key: str | None = None,
        num_samples: int | None = None,
        num_bytes: int | None = None,
        sha256: str | None = None,
    ) -> None:
        self.store, self.key = store, key
        self.url = store.child_url(key)
        self.policy = ErrorPolicy(on_error)
        self.index_key = index_key
        self.expected_samples = num_samples
        self.expected_bytes = num_bytes
        self.expected_sha256 = sha256

    @property
    def skipped(self) -> int:
        """Samples skipped so far under the ``skip``/``warn`` policies."""
        return self.policy.skipped

    @abstractmethod
    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Yield the shard's samples in order, streaming."""

    # ---- checks against the manifest, for readers with an index ---------------------------------

    def index_bound(self, size: int) -> int:
        """The size an index of this shard must fit in: the shard's ``size``, or the manifest's
        ``num_bytes`` when the shard is shorter (truncated: the index still describes the whole
        shard, and reads report the samples past the cut one by one)."""
        return size if self.expected_bytes is None else max(size, self.expected_bytes)

    def check_index_count(self, count: int, index_url: str) -> None:
        """Raise when an index lists another number of samples than the manifest gives the shard.

        Raises:
            CorruptDataError: The counts differ; names the index, the shard and both counts.
        """
        if self.expected_samples is not None and count != self.expected_samples:
            raise CorruptDataError(
                f"index {index_url} lists {count} samples, but the dataset manifest says shard "
                f"{self.url} holds {self.expected_samples}; the index is damaged or stale "
                "(rebuild it with `fastload index`), or the manifest is (check both with "
                "`fastload verify`)",
                url=index_url,
            )

    def index_damaged(self, exc: CorruptDataError, headers: str) -> None:
        """Decide what a damaged index (``exc``, from parsing it or :meth:`check_index_count`)
        costs: under ``raise`` it is raised; under ``skip`` and ``warn`` a warning says that the
        shard's own ``headers`` ("record headers") are read instead, and the caller rebuilds the
        index from them (the shard itself may well be intact)."""
        if self.policy.on_error == "raise":
            raise exc
        log.warning(
            "%s; reading the %s of %s instead (rebuild the index with `fastload index` to avoid "
            "this)",
            exc,
            headers,
            self.url,
        )

    def missing_sample(self, i: int, found: int) -> CorruptDataError | None:
        """The error for position ``i`` past the ``found`` samples of the shard, when the manifest
        lists it (``None`` when it does not: an ordinary out-of-range position)."""
        if self.expected_samples is None or not found <= i < self.expected_samples:
            return None
        return CorruptDataError(
            f"sample {i} is missing: the dataset manifest says the shard holds "
            f"{self.expected_samples} samples, but only {found} could be found in it; the shard "
            f"is damaged or the manifest is wrong (check with `fastload verify`)"
            f"{DAMAGED_SHARD_REMEDY}",
            url=self.url,
        )

    def past_end(self, i: int, start: int, end: int, size: int) -> CorruptDataError:
        """The error for sample ``i`` at bytes ``[start, end)`` of a shard that ends at ``size``."""
        truncated = self.expected_bytes is not None and size < self.expected_bytes
        return CorruptDataError(
            f"sample {i} lies at bytes [{start}, {end}) but the shard ends at byte {size}"
            + (
                f" (the manifest says it has {self.expected_bytes} bytes): the shard is "
                f"truncated{DAMAGED_SHARD_REMEDY}"
                if truncated
                else "; the shard is truncated, or the index belongs to another version of it "
                "(check with `fastload verify`)"
            ),
            url=self.url,
            offset=size,
        )

    def __len__(self) -> int:
        """Number of samples (needs random access)."""
        raise MissingIndexError(
            f"{type(self).__name__} has no index to count samples; build one with `fastload index`",
            url=self.url,
        )

    def read(self, i: int) -> dict[str, Any]:
        """The ``i``-th sample of the shard, by random access (needs an index)."""
        raise MissingIndexError(
            f"{type(self).__name__} cannot read sample {i} by position without an index; "
            "build one with `fastload index`",
            url=self.url,
        )

    def read_view(self, i: int) -> dict[str, Any]:
        """:meth:`read`, except that byte fields may be read-only ``memoryview`` slices of the
        reader's memory-mapped shard instead of ``bytes`` copies: one copy less for a caller
        that copies them anyway (the loader's collation into a batch buffer). A view stays
        valid after :meth:`close` (it keeps the mapping alive until it is released); a shard
        truncated while mapped raises ``SIGBUS`` where the view is read, not here. Readers that
        map nothing (the default) return :meth:`read`'s ``bytes``."""
        return self.read(i)

    def field_locations(self, field: str) -> list[tuple[int, int]] | None:
        """Where field ``field`` of every sample lies verbatim in the shard object: ``(byte
        offset, size)`` per sample in shard order, or ``None`` when the format cannot say
        without reading the samples (no index, a compressed shard, or fields inside an encoded
        record: TFRecord, LMDB).

        For readers that map or range-read a field's bytes directly (the token loader gathers
        token ids straight out of a memory-mapped shard). The locations come from the index and
        are not checked against the bytes there (:meth:`read` checks them); O(samples).

        Raises:
            KeyError: A sample has no such field.
        """
        return None

    def iter_and_index(
        self, build_index: Callable[[Store, str], bytes | None]
    ) -> tuple[Iterator[dict[str, Any]], Callable[[], bytes | None]]:
        """Iterate the shard, and rebuild its index from the same pass where the format can.

        Returns the samples (as :meth:`__iter__` yields them) and a function that, called after
        they were all consumed, returns what ``build_index(store, key)`` (the format's
        :attr:`Format.build_index`) returns for the shard: the same bytes, or the same exception.
        This base implementation calls ``build_index``, which reads the shard a second time;
        formats whose iteration sees what their index holds override it and index from the pass
        (and fall back to ``build_index`` where the pass met damage or did not finish).
        ``fastload verify`` reads each shard once this way.
        """
        return iter(self), lambda: build_index(self.store, self.key)

    def iter_from(self, start: int) -> Iterator[dict[str, Any]]:
        """Yield samples from position ``start`` on (seeks with an index, else skips)."""
        for i, sample in enumerate(self):
            if i >= start:
                yield sample

    def close(self) -> None:
        """Release file handles and environments held by this reader."""

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class Format:
    """A shard format as the rest of fastload sees it.

    Attributes:
        name: Canonical name (``"webdataset"``).
        extension: Shard file extension without the dot (``"tar"``).
        writer: The :class:`ShardWriter` subclass.
        reader: The :class:`ShardReader` subclass.
        build_index: ``(store, key) -> bytes | None``: the index bytes for an existing shard (as
            DALI's own tools would write them), or ``None`` if the format has no index file.
        detect: ``(head_bytes) -> bool``: whether a shard's first bytes look like this format.
        source_extensions: The file name suffixes, without the leading dot and lower-case, that
            mark a file as a shard of this format when it is read (``convert``'s source
            detection): ``extension`` and the other names the format's files go by, with their
            whole-file compression suffixes (``"tgz"``, ``"tar.gz"``, ``"tfrecords"``). A
            suffix of several parts (``"tar.gz"``) matches the last parts of a name. Empty means
            ``(extension,)``.
    """

    name: str
    extension: str
    writer: type[ShardWriter]
    reader: type[ShardReader]
    build_index: Any = None
    detect: Any = None
    source_extensions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.source_extensions:
            object.__setattr__(self, "source_extensions", (self.extension,))


FORMATS = PluginRegistry(
    "shard format", "fastload.formats", "Pass one of these as format=... or --format."
)
FORMATS.register("webdataset", "fastload.formats.webdataset:FORMAT", aliases=("wds", "tar"))
FORMATS.register("tfrecord", "fastload.formats.tfrecord:FORMAT", aliases=("tfr", "tfrecords"))
FORMATS.register("lmdb", "fastload.formats.lmdb:FORMAT", aliases=("mdb",))


def get_format(name: str) -> Format:
    """The :class:`Format` registered as ``name`` (aliases such as ``wds`` accepted).

    Raises:
        InvalidArgumentError: Unknown format; the message lists the known ones.
    """
    fmt: Format = FORMATS.load(name)
    return fmt
