"""Shard URLs as the ``webdataset`` library takes them, opened as a dataset without a manifest.

:func:`open_shard_urls` is what :func:`~fastload.loader.open_dataset` does with a brace pattern
(``"s3://b/train-{000000..000999}.tar"``, ``"/data/{a,b}-{0..9}.tar"``) or a list of shard URLs:
it expands the braces, counts each shard's samples from its ``.idx`` (or by scanning its tar
headers when it has none), and returns a normal :class:`~fastload.loader.Dataset` over an
in-memory manifest. Nothing is written to the store. The ``wds`` pipelines that run on such a
dataset are in :mod:`fastload.wds`.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from fastload.errors import FormatError, InvalidArgumentError, ObjectNotFoundError
from fastload.formats import Manifest, ShardEntry, ShardNames, get_format
from fastload.formats.webdataset import (
    HEAD_BYTES,
    build_index,
    compressed_name,
    compression_of,
    parse_index,
)
from fastload.loader._dataset import Dataset
from fastload.loader._options import ReadOptions, StoreOptions
from fastload.loader._subset import SubsetSpec
from fastload.loader.order._order import OrderOptions
from fastload.storage import (
    DEFAULT_READ_CHUNK,
    ByteRange,
    ObjectMeta,
    Store,
    WrapperStore,
    check_range,
    open_store,
)

__all__ = [
    "UNKNOWN_SHA256",
    "expand_shard_urls",
    "is_shard_pattern",
    "open_shard_urls",
    "shard_list_manifest",
]

#: The ``sha256`` of shards in a manifest built on the fly: not computed (it would mean reading
#: every shard in full before training starts).
UNKNOWN_SHA256 = "0" * 64
_PATTERN = re.compile(r"\{[^{}]*(\.\.|,)[^{}]*\}")


def is_shard_pattern(url: object) -> bool:
    """Whether ``url`` is a brace pattern of shard URLs (``train-{000000..000999}.tar``,
    ``{a,b}.tar``), as the ``webdataset`` library takes them."""
    return isinstance(url, str) and _PATTERN.search(url) is not None


def expand_shard_urls(urls: str | Sequence[str]) -> list[str]:
    """The shard URLs of a brace pattern, or of a list of URLs and patterns, in order.

    Uses ``braceexpand`` (the ``webdataset`` library's own dependency): ``{000000..000999}`` keeps
    the zero padding, ``{a,b}`` lists alternatives, several groups multiply.

    Raises:
        InvalidArgumentError: Nothing to expand, or a URL appears twice (its samples would be
            read twice per epoch).
    """
    from braceexpand import braceexpand

    items = [urls] if isinstance(urls, str) else list(urls)
    out: list[str] = []
    for item in items:
        if not isinstance(item, str | os.PathLike):
            raise InvalidArgumentError(f"shard URLs must be strings, got {item!r}")
        out.extend(braceexpand(os.fspath(item)))
    if not out:
        raise InvalidArgumentError("no shard URLs given (an empty list)")
    seen: dict[str, int] = {}
    for i, url in enumerate(out):
        if url in seen:
            raise InvalidArgumentError(
                f"shard URL {url!r} appears twice (positions {seen[url]} and {i} of the "
                f"{len(out)} expanded URLs); a shard listed twice would be read twice per epoch"
            )
        seen[url] = i
    return out


def _split_root(urls: Sequence[str]) -> tuple[str, list[str]]:
    """``(root URL, keys)``: the deepest directory (or bucket prefix) holding every URL."""
    prefix = os.path.commonprefix(list(urls))  # noqa: RUF071 - cut at its last '/' below
    cut = prefix.rfind("/")
    scheme = urls[0].find("://")
    if scheme >= 0 and (cut <= scheme + 2 or any(u.find("://") != scheme for u in urls)):
        raise InvalidArgumentError(
            f"the shard URLs {urls[0]!r} ... {urls[-1]!r} do not share a bucket or directory; "
            "open the shards of each location as a dataset of its own"
        )
    if cut < 0:
        return ".", list(urls)
    root = prefix[:cut] or "/"
    return root, [u[cut + 1 :] for u in urls]


class _BuiltIndexStore(WrapperStore):
    """A store that also serves the ``.idx`` objects built in memory for shards that have none,
    so that readers get random access to them. Reads of those keys are served from memory;
    everything else is the wrapped store's. Pickles with the indexes (tens of bytes per
    sample)."""

    def __init__(self, store: Store, indexes: Mapping[str, bytes]) -> None:
        super().__init__(store)
        self._indexes = dict(indexes)

    def get(self, key: str, byte_range: ByteRange | None = None) -> bytes:
        data = self._indexes.get(key)
        if data is None:
            return super().get(key, byte_range)
        if byte_range is None:
            return data
        check_range(byte_range, len(data), url=self.child_url(key))
        return data[byte_range.start : byte_range.end]

    def head(self, key: str) -> ObjectMeta:
        data = self._indexes.get(key)
        return super().head(key) if data is None else ObjectMeta(key, len(data))

    def local_path(self, key: str) -> str | None:
        return None if key in self._indexes else super().local_path(key)

    def open_reader(self, key: str, *, chunk_size: int = DEFAULT_READ_CHUNK) -> io.BufferedIOBase:
        data = self._indexes.get(key)
        if data is None:
            return super().open_reader(key, chunk_size=chunk_size)
        return io.BytesIO(data)


def _count_tar(store: Store, key: str, size: int) -> tuple[int, dict[str, int], bytes | None]:
    """``(samples, field counts, index built here or None)`` of an uncompressed WebDataset
    shard: from its ``.idx`` when there is one, else from its tar headers.

    Raises:
        FormatError: The shard is compressed after all (its name did not say so), or damaged.
    """
    try:
        data = store.get(key + ".idx")
        built = None
    except ObjectNotFoundError:
        data = build_index(store, key)
        built = data
    index = parse_index(data, url=store.child_url(key + ".idx"), shard_size=size)
    fields: dict[str, int] = {}
    for comps in index:
        for comp in comps:
            fields[comp.ext] = fields.get(comp.ext, 0) + 1
    return len(index), fields, built


def _count_read(store: Store, key: str, fmt_name: str) -> tuple[int, dict[str, int]]:
    """``(samples, field counts)`` of a shard by reading it through (compressed, other formats)."""
    fmt = get_format(fmt_name)
    n = 0
    fields: dict[str, int] = {}
    with fmt.reader(store, key) as reader:
        for sample in reader:
            n += 1
            for name in sample:
                if not name.startswith("__"):
                    fields[name] = fields.get(name, 0) + 1
    return n, fields


def _describe(
    store: Store, key: str, fmt_name: str, first: str, last: str, total: int
) -> tuple[ShardEntry, dict[str, int], bytes | None]:
    """One shard's manifest entry, field counts and built index (see :func:`shard_list_manifest`)."""
    try:
        size = store.size(key)
    except ObjectNotFoundError:
        raise ObjectNotFoundError(
            f"shard {store.child_url(key)} does not exist (it is one of the {total} shard URLs, "
            f"{store.child_url(first)} ... {store.child_url(last)}); check the brace range",
            url=store.child_url(key),
        ) from None
    if fmt_name == "webdataset":
        if not compressed_name(key):
            try:
                n, fields, built = _count_tar(store, key, size)
            except FormatError:
                head = store.get(key, ByteRange(0, min(size, HEAD_BYTES)))
                if compression_of(head) is None:
                    raise
            else:
                return ShardEntry(key, n, size, UNKNOWN_SHA256, key + ".idx"), fields, built
        n, fields = _count_read(store, key, fmt_name)  # compressed: read in order, no index
        return ShardEntry(key, n, size, UNKNOWN_SHA256, None), fields, None
    n, fields = _count_read(store, key, fmt_name)
    fmt = get_format(fmt_name)
    if fmt.build_index is None:
        return ShardEntry(key, n, size, UNKNOWN_SHA256, None), fields, None
    index_key = key + ".idx"
    # Raises FormatError for a compressed TFRecord file: it cannot be read by position.
    built = None if store.exists(index_key) else fmt.build_index(store, key)
    return ShardEntry(key, n, size, UNKNOWN_SHA256, index_key), fields, built


def shard_list_manifest(store: Store, keys: Sequence[str]) -> tuple[Manifest, dict[str, bytes]]:
    """An in-memory manifest of the shards ``keys`` of ``store``, and the indexes built for the
    shards that have no ``.idx`` (by index key).

    What is checked: every shard exists and all are of one format. An uncompressed WebDataset
    shard's ``.idx``, when present, is parsed and checked against the shard's size (the checks
    readers make before using an index); without one, its tar headers are scanned (every header
    checksum, the member rules of the format README) into an index kept in memory. Compressed
    WebDataset shards and other formats are read through once to count their samples; a
    TFRecord file without an ``.idx`` also gets one built in memory (a compressed one is refused:
    it cannot be read by position). Not checked: the shards' SHA-256 (``sha256`` is
    :data:`UNKNOWN_SHA256`), and that a sample key is not repeated across shards.

    Raises:
        ObjectNotFoundError: A shard does not exist.
        InvalidArgumentError: Shards of several formats, or of none fastload knows.
        CorruptDataError, FormatError: A shard or its index is damaged, or a TFRecord file is
            compressed.
    """
    names = ShardNames.from_registry()
    formats = {k: names.format_of(k) for k in keys}
    unknown = [k for k, f in formats.items() if f is None]
    if unknown:
        known = ", ".join(f".{ext}" for ext in names.extensions())
        raise InvalidArgumentError(
            f"{store.child_url(unknown[0])} does not have a shard name fastload knows ({known}, "
            "or one of these compressed: .tar.gz/.tgz, .tfrecord.gz, ...); point at the shards "
            "themselves"
        )
    kinds = sorted({f for f in formats.values() if f is not None})
    if len(kinds) > 1:
        raise InvalidArgumentError(
            f"the shard URLs mix formats ({', '.join(kinds)}); open one format at a time"
        )
    fmt_name = kinds[0]
    entries: list[ShardEntry] = []
    counts: list[dict[str, int]] = []
    built: dict[str, bytes] = {}
    # Network stores answer one request at a time per call: describe the shards concurrently.
    workers = 1 if store.has_local_paths or len(keys) == 1 else min(16, len(keys))
    with ThreadPoolExecutor(workers, thread_name_prefix="fastload-scan") as pool:
        described = pool.map(
            lambda k: _describe(store, k, fmt_name, keys[0], keys[-1], len(keys)), keys
        )
        for entry, fields, index in described:
            entries.append(entry)
            counts.append(fields)
            if index is not None and entry.index is not None:
                built[entry.index] = index
    manifest = Manifest(
        format=fmt_name,
        shards=entries,
        schema=Manifest.schema_from_fields(counts),
        created_by={"tool": "fastload open_dataset (shard URLs, in memory)"},
    )
    return manifest, built


def open_shard_urls(
    urls: str | Sequence[str],
    *,
    sources: StoreOptions,
    order: OrderOptions,
    reading: ReadOptions,
    subset: SubsetSpec = None,
    split: tuple[float, float] | None = None,
) -> Dataset:
    """A :class:`~fastload.loader.Dataset` over shard URLs (a brace pattern or a list), indexed
    on the fly (see :func:`shard_list_manifest` for what is read and checked).

    The shards must share one store root (a directory, a bucket prefix). Shards without an
    ``.idx`` get one built in memory from their headers (they then have random access, like
    indexed shards); compressed shards are read in order. The options are
    :func:`~fastload.loader.open_dataset`'s.

    Opening reads every shard's index, or its headers (a header scan reads the tar's header
    blocks, seeking over the data where the store allows), so for many shards without indexes,
    run ``fastload index`` once instead: it writes the indexes and a manifest.
    """
    expanded = expand_shard_urls(urls)
    root, keys = _split_root(expanded)
    base = open_store(root, **(sources.store_options or {}))  # the cache goes in front of the
    manifest, built = shard_list_manifest(base, keys)  # indexes built here, not of the base
    store: Store = _BuiltIndexStore(base, built) if built else base
    store = sources.cache(store)
    return Dataset(store, manifest, order=order, reading=reading, subset=subset, split=split)
