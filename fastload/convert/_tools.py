"""The companion commands of ``convert``: inspect, verify and index a dataset.

* :func:`inspect_dataset` summarises a dataset (manifest, schema, shards, the first samples).
* :func:`verify_dataset` recomputes every shard's checksum, size, sample count and index and
  reports **every** problem, precisely.
* :func:`index_dataset` builds or rebuilds the DALI-compatible ``<shard>.idx`` files, and writes a
  manifest for a directory of third-party shards (WebDataset tars, TFRecords, LMDB files).
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastload.convert._sources import _SHARD_EXT, _ext, _visible
from fastload.errors import (
    CorruptDataError,
    FastloadError,
    InvalidArgumentError,
    ObjectNotFoundError,
)
from fastload.formats import (
    MANIFEST_NAME,
    Format,
    Manifest,
    ShardEntry,
    get_format,
    read_manifest,
    write_manifest,
)
from fastload.formats._base import DAMAGED_SHARD_REMEDY, FORMATS, ShardReader
from fastload.formats.manifest import why_empty
from fastload.storage import Store, open_store

__all__ = [
    "IndexResult",
    "VerifyReport",
    "index_dataset",
    "inspect_dataset",
    "verify_dataset",
]

_CHUNK = 8 << 20
#: ``progress(shards done, shards in all, bytes of the shard just done)``, called per shard.
Progress = Callable[[int, int, int], None]
_DETECT_BYTES = 4096


def _open(url: str | os.PathLike[str] | Store, options: Mapping[str, Any] | None) -> Store:
    if isinstance(url, Store):
        return url
    return open_store(url, **dict(options or {}))


def _sha256(store: Store, key: str) -> tuple[str, int]:
    sha = hashlib.sha256()
    n = 0
    with store.open_reader(key) as f:
        while block := f.read(_CHUNK):
            sha.update(block)
            n += len(block)
    return sha.hexdigest(), n


class _Grouping:
    """Checks that every sample key appears once in a dataset, and tallies the field sets.

    A tar whose members are not grouped by sample (``tar -cf x.tar -C dir .`` lists files in
    directory order) reads as many one-field fragments with repeated keys; a sample split across
    two shards reads as two samples with one key. Both are found here.
    """

    _SHOWN = 3

    def __init__(self) -> None:
        self.first: dict[str, tuple[str, int]] = {}
        self.repeats = 0
        self.examples: list[str] = []
        self.field_sets: Counter[tuple[str, ...]] = Counter()

    def add(self, shard_url: str, position: int, sample: Mapping[str, Any]) -> None:
        key = sample.get("__key__")
        self.field_sets[tuple(sorted(k for k in sample if not k.startswith("__")))] += 1
        if not isinstance(key, str):
            return
        seen = self.first.setdefault(key, (shard_url, position))
        if seen != (shard_url, position):
            self.repeats += 1
            if len(self.examples) < self._SHOWN:
                where = (
                    f"samples {seen[1]} and {position} of {shard_url}"
                    if seen[0] == shard_url
                    else f"sample {seen[1]} of {seen[0]} and sample {position} of {shard_url}"
                )
                self.examples.append(f"{key!r} ({where})")

    def problem(self) -> str | None:
        """The repeated keys, with the fix, or ``None``."""
        if not self.repeats:
            return None
        return (
            f"{self.repeats} sample(s) repeat the key of an earlier sample, e.g. "
            f"{'; '.join(self.examples)}. A WebDataset sample's members must be adjacent: a tar "
            "made with `tar -cf x.tar -C dir .` lists files in directory order, which splits "
            "samples into fragments. Re-create it with `tar --sort=name -cf x.tar -C dir .` "
            "(GNU tar), or convert the files themselves with `fastload convert dir DST`; keep "
            "each sample's members in one shard"
        )

    def warning(self) -> str | None:
        """A note when samples have different field sets (optional fields, or fragments)."""
        if len(self.field_sets) <= 1:
            return None
        sets = ", ".join(f"{list(f)} in {n}" for f, n in self.field_sets.most_common(4))
        more = f" and {len(self.field_sets) - 4} more" if len(self.field_sets) > 4 else ""
        return (
            f"samples have {len(self.field_sets)} different field sets: {sets}{more}; that is "
            "expected when some fields are optional, otherwise members of one sample are not "
            "adjacent in the shards"
        )


# ---- inspect -----------------------------------------------------------------------------------


def inspect_dataset(
    url: str | os.PathLike[str] | Store,
    *,
    samples: int = 3,
    store_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Describe a dataset as a JSON-able dict.

    Keys: ``url``, ``format``, ``num_samples``, ``num_bytes``, ``num_shards``, ``schema``,
    ``created_by``, ``metadata``, ``shards`` (name, samples, bytes, sha256, index per shard) and
    ``samples``: the first ``samples`` samples of the first shards as ``{"key", "shard",
    "field_bytes": {name: size in bytes}}``.

    Raises:
        ObjectNotFoundError: No ``fastload.json`` (the message says to run ``fastload index``).
    """
    store = _open(url, store_options)
    manifest = read_manifest(store)
    fmt = manifest.resolve_format(url=store.child_url(MANIFEST_NAME))
    first: list[dict[str, Any]] = []
    for entry in manifest.shards:
        if len(first) >= samples:
            break
        with fmt.reader(store, entry.name) as reader:
            for sample in reader:
                first.append(
                    {
                        "key": sample["__key__"],
                        "shard": entry.name,
                        "field_bytes": {
                            k: len(v) for k, v in sample.items() if not k.startswith("__")
                        },
                    }
                )
                if len(first) >= samples:
                    break
    return {
        "url": store.url,
        "format": manifest.format,
        "manifest_version": manifest.version,
        "num_samples": manifest.num_samples,
        "num_bytes": manifest.num_bytes,
        "num_shards": len(manifest.shards),
        "schema": manifest.schema,
        "created_by": manifest.created_by,
        "metadata": manifest.metadata,
        "shards": [s.to_json() for s in manifest.shards],
        "samples": first,
    }


# ---- verify ------------------------------------------------------------------------------------


@dataclass
class VerifyReport:
    """What :func:`verify_dataset` found.

    Attributes:
        url: The dataset root.
        shards_checked: Shards examined.
        samples_read: Samples read back from all shards.
        problems: One precise sentence per problem (shard URL, expected vs found); empty if OK.
        warnings: Observations that need not be problems (e.g. samples with different fields).
    """

    url: str
    shards_checked: int = 0
    samples_read: int = 0
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing is wrong."""
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "ok": self.ok,
            "shards_checked": self.shards_checked,
            "samples_read": self.samples_read,
            "problems": list(self.problems),
            "warnings": list(self.warnings),
        }


def _first_difference(a: bytes, b: bytes) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def verify_dataset(
    url: str | os.PathLike[str] | Store,
    *,
    store_options: Mapping[str, Any] | None = None,
    check_index: bool = True,
    progress: Progress | None = None,
) -> VerifyReport:
    """Check every shard of a dataset against its manifest.

    For each shard: it exists; its size and SHA-256 match; reading it yields the manifest's sample
    count without errors; its index (rebuilt with the format's ``build_index``) equals the stored
    ``.idx`` byte for byte. Then the field counts read must match the manifest's schema. Every
    problem is reported; nothing stops at the first one. ``progress`` (see :data:`Progress`) is
    called after each shard.

    Raises:
        ObjectNotFoundError: No manifest.
        ManifestError: The manifest itself is malformed.
    """
    store = _open(url, store_options)
    manifest = read_manifest(store)
    report = VerifyReport(store.url)
    fmt = manifest.resolve_format(url=store.child_url(MANIFEST_NAME))
    field_counts: dict[str, int] = {}
    grouping = _Grouping()
    for entry in manifest.shards:
        report.shards_checked += 1
        where = store.child_url(entry.name)
        try:
            sha, size = _sha256(store, entry.name)
        except ObjectNotFoundError:
            report.problems.append(f"{where}: shard is missing")
            continue
        except (OSError, FastloadError) as exc:
            report.problems.append(f"{where}: cannot be read: {exc}")
            continue
        remedy = DAMAGED_SHARD_REMEDY.removeprefix("; ")
        if size != entry.num_bytes:
            report.problems.append(
                f"{where}: size is {size} bytes, the manifest says {entry.num_bytes} "
                f"({'truncated' if size < entry.num_bytes else 'changed'}); {remedy}"
            )
        if sha != entry.sha256:
            report.problems.append(
                f"{where}: SHA-256 is {sha}, the manifest says {entry.sha256} (the shard's "
                f"bytes changed); {remedy}"
            )
        count = 0
        reader: ShardReader | None = None
        try:
            reader = fmt.reader(
                store,
                entry.name,
                on_error="skip",
                num_samples=entry.num_samples,
                num_bytes=entry.num_bytes,
            )
            for sample in reader:
                grouping.add(where, count, sample)
                count += 1
                for name in sample:
                    if not name.startswith("__"):
                        field_counts[name] = field_counts.get(name, 0) + 1
        except (OSError, FastloadError) as exc:
            report.problems.append(f"{where}: reading failed after {count} samples: {exc}")
        except Exception as exc:  # a damaged shard must never crash verify: report it
            report.problems.append(
                f"{where}: reading failed after {count} samples with an unexpected "
                f"{type(exc).__name__}: {exc} (please report this as a fastload bug)"
            )
        else:
            if reader.skipped:
                first = reader.policy.errors[0] if reader.policy.errors else "?"
                report.problems.append(
                    f"{where}: {reader.skipped} damaged sample(s) or region(s), {count} intact "
                    f"samples read; first damage: {first}; {remedy}"
                )
            elif count != entry.num_samples:
                report.problems.append(
                    f"{where}: holds {count} samples, the manifest says {entry.num_samples}"
                )
        finally:
            if reader is not None:
                reader.close()
        report.samples_read += count
        if check_index:
            _verify_index(store, fmt, entry, report)
        if progress is not None:
            progress(report.shards_checked, len(manifest.shards), entry.num_bytes)
    for problem in (grouping.problem(),):
        if problem is not None:
            report.problems.append(f"{store.url}: {problem}")
    note = grouping.warning()
    if note is not None:
        report.warnings.append(note)
    schema_counts = {name: int(s.get("count", -1)) for name, s in manifest.schema.items()}
    if not report.problems and schema_counts and schema_counts != field_counts:
        report.problems.append(
            f"{store.child_url(MANIFEST_NAME)}: schema field counts {schema_counts} do not match "
            f"the fields read from the shards {field_counts}"
        )
    return report


def _verify_index(store: Store, fmt: Format, entry: ShardEntry, report: VerifyReport) -> None:
    where = store.child_url(entry.name)
    if fmt.build_index is None:
        if entry.index:
            report.problems.append(
                f"{where}: the manifest names an index {entry.index!r}, but the {fmt.name} "
                "format has none"
            )
        return
    if not entry.index:
        return
    try:
        stored = store.get(entry.index)
    except ObjectNotFoundError:
        report.problems.append(
            f"{store.child_url(entry.index)}: index is missing; rebuild it with `fastload index`"
        )
        return
    try:
        expected = fmt.build_index(store, entry.name)
    except Exception as exc:  # a damaged shard (reported above) cannot be indexed
        report.problems.append(f"{where}: cannot rebuild its index to compare: {exc}")
        return
    if expected is not None and stored != expected:
        report.problems.append(
            f"{store.child_url(entry.index)}: index differs from the shard's contents "
            f"({len(stored)} bytes stored, {len(expected)} expected, first difference at byte "
            f"{_first_difference(stored, expected)}); rebuild it with `fastload index "
            f"{store.url}`"
        )


# ---- index -------------------------------------------------------------------------------------


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
    """

    url: str
    format: str
    indexed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    manifest_written: bool = False
    ignored: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    unindexed: list[str] = field(default_factory=list)

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
    from fastload.formats.tfrecord._compression import detect_compression
    from fastload.formats.webdataset._compressed import compression_of

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
    from fastload.formats.webdataset._source import open_shard
    from fastload.formats.webdataset._tar import BLOCK

    try:
        with open_shard(store, key, inflate=True) as view:
            return view[0:BLOCK]
    except (OSError, FastloadError, ValueError):
        return b""


def _detect_format(store: Store, key: str) -> str | None:
    head = _head(store, key)
    if head is None:
        return None
    by_ext = _SHARD_EXT.get(_ext(key))
    candidates = ([by_ext] if by_ext else []) + [n for n in FORMATS.names() if n != by_ext]
    inner: bytes | None = None  # the tar inside a compressed shard, looked at when needed
    for name in candidates:
        try:
            fmt = get_format(name)
        except FastloadError:
            continue
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
    format. Each is indexed, hashed and read to count samples and fields, and a manifest listing
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
    import fastload

    store = _open(url, store_options)
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
    for meta in store.list(""):
        key = meta.key
        if not _visible(key) or key.endswith(".idx"):
            continue
        found = _detect_format(store, key)
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
    grouping = _Grouping()
    counted: list[tuple[str, str, int, int]] = []  # key, sha256, size, samples
    fields: list[dict[str, int]] = []
    for key, _ in shards:
        sha, size = _sha256(store, key)
        counts: dict[str, int] = {}
        n = 0
        with fmt.reader(store, key) as reader:
            for sample in reader:
                grouping.add(store.child_url(key), n, sample)
                n += 1
                for name in sample:
                    if not name.startswith("__"):
                        counts[name] = counts.get(name, 0) + 1
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
            created_by={"tool": "fastload index", "version": fastload.__version__},
        )
        write_manifest(store, manifest)
        result.manifest_written = True
    return result
