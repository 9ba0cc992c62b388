"""``fastload index``: DALI-compatible ``<shard>.idx`` files, and a manifest for third-party shards.

With a ``fastload.json`` every listed shard's index is rebuilt; without one, the objects whose
first bytes match a registered format are taken as the shards of a new manifest.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fastload._version import __version__
from fastload.convert.sources._tree import Tree, walk_tree
from fastload.convert.tools._common import (
    Grouping,
    Progress,
    count_fields,
    open_dataset_store,
    sha256_of,
)
from fastload.errors import (
    CorruptDataError,
    FastloadError,
    InvalidArgumentError,
    ObjectNotFoundError,
)
from fastload.formats import (
    FORMATS,
    MANIFEST_NAME,
    Format,
    Manifest,
    ShardEntry,
    ShardNames,
    get_format,
    read_manifest,
    write_manifest,
)
from fastload.formats.manifest import why_empty
from fastload.storage import Store

__all__ = ["IndexResult", "index_dataset"]

_DETECT_BYTES = 4096


@dataclass
class IndexResult:
    """What :func:`index_dataset` did.

    Attributes:
        url: The dataset root.
        format: The shards' format.
        indexed: Index keys written (new or changed).
        unchanged: Index keys that were already correct.
        manifest_written: Whether ``fastload.json`` was (re)written.
        ignored: Objects that are not shards of the format (not indexed).
        warnings: Observations worth a look (e.g. samples with different field sets).
        unindexed: Compressed shards (``.tar.gz``, ``.tgz``, ``.tfrecord.gz``, ...): listed in the
            manifest without an index, because they are read in order only.
        duplicates: Paths that reach a shard listed under another path (a symbolic or hard
            link): path → the path listed. Each file is listed once (see
            ``fastload/convert/README.md``, *Symbolic links and hard links*).
    """

    url: str
    format: str
    indexed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    manifest_written: bool = False
    ignored: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    unindexed: list[str] = field(default_factory=list)
    duplicates: dict[str, str] = field(default_factory=dict)

    def note_unindexed(self) -> None:
        """Add the warning about compressed shards to :attr:`warnings` (once)."""
        if not self.unindexed:
            return
        shown = ", ".join(self.unindexed[:3]) + (" ..." if len(self.unindexed) > 3 else "")
        self.warnings.append(
            f"{len(self.unindexed)} shard(s) are compressed ({shown}): they are listed without "
            "an index and read in order only, so loading them shuffled re-reads a shard for "
            "every step back, and DALI cannot read them; for training, convert them into "
            f"indexed shards with `fastload convert {self.url} DST`"
        )


def _head(store: Store, key: str) -> bytes | None:
    """The first bytes of ``key`` (up to 4 KiB), or ``None`` when it cannot be read."""
    from fastload.storage import ByteRange

    try:
        return store.get(key, ByteRange(0, min(store.size(key), _DETECT_BYTES)))
    except (OSError, FastloadError):
        return None


def _compression(head: bytes) -> str | None:
    """Whether a shard's first bytes are a compressed stream: a tar inside gzip/bzip2/xz (the
    ``webdataset`` library's ``.tar.gz``/``.tgz``) or a gzip/zlib TFRecord file. Such shards are
    read in order only: they get no index."""
    from fastload.formats.tfrecord import detect_compression
    from fastload.formats.webdataset import compression_of

    codec = compression_of(head)
    if codec is not None:
        return codec
    plausible, tf_codec = detect_compression(head)
    return tf_codec if plausible else None


def _is_compressed(store: Store, key: str) -> bool:
    head = _head(store, key)
    return head is not None and _compression(head) is not None


def _inflated_tar_head(store: Store, key: str) -> bytes:
    """The first tar block inside a compressed shard (empty when it does not decompress)."""
    from fastload.formats.webdataset import BLOCK, open_shard

    try:
        with open_shard(store, key, inflate=True) as view:
            return view[0:BLOCK]
    except (OSError, FastloadError, ValueError):
        return b""


def _detect_format(store: Store, key: str, names: ShardNames) -> str | None:
    """The format whose ``detect`` accepts the first bytes of ``key`` (the one its name says
    tried first), or ``None``."""
    head = _head(store, key)
    if head is None:
        return None
    by_name = names.format_of(key)
    candidates = sorted(names.formats, key=lambda f: f.name != by_name)  # stable: name order
    inner: bytes | None = None  # the tar inside a compressed shard, looked at when needed
    for fmt in candidates:
        if fmt.detect is None:
            continue
        if fmt.detect(head):
            return fmt.name
        if fmt.name == "webdataset" and _compression(head) in ("gzip", "bzip2", "xz"):
            inner = _inflated_tar_head(store, key) if inner is None else inner
            if fmt.detect(inner):
                return fmt.name
    return None


def _write_index(store: Store, fmt: Format, key: str, result: IndexResult) -> str | None:
    if fmt.build_index is None:
        return None
    if _is_compressed(store, key):
        result.unindexed.append(key)  # read in order only: there is nothing to index
        return None
    data = fmt.build_index(store, key)
    if data is None:
        return None
    index_key = key + ".idx"
    try:
        same = store.get(index_key) == data
    except ObjectNotFoundError:
        same = False
    if same:
        result.unchanged.append(index_key)
    else:
        store.put(index_key, data)
        result.indexed.append(index_key)
    return index_key


def _note_links(result: IndexResult, tree: Tree, shards: set[str]) -> None:
    """Name what the walk of the tree left out: directory links not followed, dangling links,
    and the second paths of the shards (:attr:`IndexResult.duplicates`)."""
    result.warnings.extend(tree.warnings())
    result.duplicates = {
        k: v for k, v in tree.duplicate_of.items() if v in shards and not k.endswith(".idx")
    }
    if result.duplicates:
        named = ", ".join(
            f"{k} (the same file as {v})" for k, v in list(result.duplicates.items())[:3]
        )
        more = f" and {len(result.duplicates) - 3} more" if len(result.duplicates) > 3 else ""
        result.warnings.append(
            f"{result.url} reaches {len(result.duplicates)} shard file(s) by a second path "
            "(symbolic or hard links): each is listed once, under its own path in the directory, "
            f"else the first in sorted order; not listed again: {named}{more}"
        )


def index_dataset(
    url: str | os.PathLike[str] | Store,
    *,
    format: str | None = None,  # noqa: A002 - mirrors convert(format=...)
    write_manifest_file: bool = True,
    store_options: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
) -> IndexResult:
    """Build or rebuild ``<shard>.idx`` files, and a manifest where there is none.

    With a ``fastload.json``: every listed shard gets its index rebuilt (written only when it
    changed); the manifest is rewritten if an index entry changed. Without one: every visible
    object whose first bytes match a format (``format`` forces one) is a shard; all must be of one
    format. A local directory is listed as conversion sources are: symbolic links followed, each
    real directory and file once (a second path to a shard is in
    :attr:`IndexResult.duplicates`; loops, links not followed and dangling links are warnings). Each is indexed, hashed and read to count samples and fields, and a manifest listing
    them in key order is written (``created_by.tool = "fastload index"``). Objects that are not
    shards are left alone and listed in :attr:`IndexResult.ignored`.

    Compressed WebDataset shards (a tar inside gzip/bzip2/xz, as the ``webdataset`` library reads
    ``.tar.gz``/``.tgz``) are recognised by their first bytes, whatever their names. They are
    listed as they are, without an index (:attr:`IndexResult.unindexed`, with a warning): the
    loader reads them in order, exactly once per epoch, but slowly when shuffled; ``fastload
    convert`` turns them into indexed shards. Compressed TFRecord files are refused with the
    ``fastload convert`` command that makes indexed shards of them.

    Raises:
        InvalidArgumentError: No shards, shards of several formats, or compressed TFRecords.
    """
    store = open_dataset_store(url, store_options)
    if store.exists(MANIFEST_NAME):
        manifest = read_manifest(store)
        fmt = manifest.resolve_format(url=store.child_url(MANIFEST_NAME))
        result = IndexResult(store.url, fmt.name)
        changed = False
        entries = []
        for entry in manifest.shards:
            index_key = _write_index(store, fmt, entry.name, result)
            if index_key != entry.index:
                changed = True
            entries.append(
                ShardEntry(entry.name, entry.num_samples, entry.num_bytes, entry.sha256, index_key)
            )
            if progress is not None:
                progress(len(entries), len(manifest.shards), entry.num_bytes)
        if changed and write_manifest_file:
            manifest.shards = entries
            write_manifest(store, manifest)
            result.manifest_written = True
        result.note_unindexed()
        return result

    wanted = FORMATS.canonical(format) if format else None
    shards: list[tuple[str, str]] = []
    ignored: list[str] = []
    names = ShardNames.from_registry()
    tree = walk_tree(store)
    for meta in tree.unique():
        key = meta.key
        if key.endswith(".idx"):
            continue
        found = _detect_format(store, key, names)
        if found is None or (wanted is not None and found != wanted):
            ignored.append(key)
            continue
        shards.append((key, found))
    kinds = sorted({f for _, f in shards})
    if not shards:
        missing = why_empty(store)
        if missing is not None:
            raise ObjectNotFoundError(missing, url=store.url)
        raise InvalidArgumentError(
            f"no shards found in {store.url}"
            + (f" (format {wanted})" if wanted else " (no WebDataset tar, TFRecord or LMDB file)")
            + "; point at the directory that holds them"
        )
    if len(kinds) > 1:
        raise InvalidArgumentError(
            f"{store.url} holds shards of several formats ({', '.join(kinds)}); pass --format to "
            "index one of them"
        )
    fmt = get_format(kinds[0])
    result = IndexResult(store.url, fmt.name, ignored=ignored)
    _note_links(result, tree, {k for k, _ in shards})
    grouping = Grouping()
    counted: list[tuple[str, str, int, int]] = []  # key, sha256, size, samples
    fields: list[dict[str, int]] = []
    for key, _ in shards:
        sha, size = sha256_of(store, key)
        counts: dict[str, int] = {}
        n = 0
        with fmt.reader(store, key) as reader:
            for sample in reader:
                grouping.add(store.child_url(key), n, sample)
                n += 1
                count_fields(sample, counts)
        fields.append(counts)
        counted.append((key, sha, size, n))
        if progress is not None:
            progress(len(counted), len(shards), size)
    problem = grouping.problem()
    if problem is not None:  # nothing is written for shards that would load wrongly
        raise CorruptDataError(f"cannot index {store.url}: {problem}", url=store.url)
    note = grouping.warning()
    if note is not None:
        result.warnings.append(note)
    entries = []
    for key, sha, size, n in counted:
        index_key = _write_index(store, fmt, key, result)
        entries.append(ShardEntry(key, n, size, sha, index_key))
    result.note_unindexed()
    if write_manifest_file:
        manifest = Manifest(
            format=fmt.name,
            shards=entries,
            schema=Manifest.schema_from_fields(fields),
            created_by={"tool": "fastload index", "version": __version__},
        )
        write_manifest(store, manifest)
        result.manifest_written = True
    return result
