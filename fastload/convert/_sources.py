"""Where conversion reads from: raw corpora behind one small interface.

A :class:`Source` does two things:

* :meth:`Source.plan_units` enumerates the corpus **deterministically** (sorted by store key, then by
  position in the file) into :class:`Unit` records, one per sample. A unit is small, picklable and
  JSON-able; it carries an estimate of the sample's bytes so the planner can cut shards by size.
  Record sources (JSONL, text, CSV, Parquet, shards) make one cheap pass here to count records.
* :meth:`Source.read_units` turns a list of units back into samples, in the order given, in a worker
  process. Each unit yields either a sample ``{"__key__": str, field: bytes}`` or the exception that
  made it unreadable, so the caller applies the ``on_error`` policy per item.

Sources read through a :class:`~fastload.storage.Store`, so a corpus on S3 or HDFS works like a local
one. Hidden files and directories (a path segment starting with ``.``) are ignored everywhere.

Sample keys and field names (documented in ``fastload/convert/README.md``):

* **Keys** must not contain ``.`` in their last path segment (WebDataset splits member names there)
  nor whitespace (DALI's index format cannot hold it): :func:`sanitize_key` replaces such dots, and
  NUL and whitespace anywhere, with ``_``. Two items
  that end up with the same key are a *collision*: an error naming both items (skippable).
* **Field names** from file extensions are lower-cased, and ``jpeg`` becomes ``jpg``.
* **Field values** from structured records (JSON, CSV, Parquet) become bytes by type: bytes stay as
  they are, ``str`` is UTF-8, ``int`` is ASCII decimal, everything else (float, bool, list, dict) is
  canonical JSON text; ``null`` / missing values omit the field.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

from fastload._plugins import PluginRegistry
from fastload.convert._progress import plural
from fastload.errors import (
    ConversionError,
    CorruptDataError,
    FastloadError,
    FormatError,
    InvalidArgumentError,
    ObjectNotFoundError,
)
from fastload.formats._base import ErrorPolicy
from fastload.formats._sample import KEY, validate_field_name
from fastload.formats.manifest import IMAGE_EXTENSIONS, MANIFEST_NAME, read_manifest
from fastload.storage import ObjectMeta, Store, open_store

__all__ = [
    "IMAGE_EXTENSIONS",
    "IMAGE_FOLDER_STRAYS",
    "IMAGE_FOLDER_STRAY_FRACTION",
    "SOURCES",
    "ConversionError",
    "CsvSource",
    "FileTreeSource",
    "ImageFolderSource",
    "JsonlSource",
    "ParquetSource",
    "PlanReporter",
    "ShardSource",
    "Source",
    "TextSource",
    "Unit",
    "detect_source_type",
    "field_value_bytes",
    "list_visible",
    "open_source",
    "sanitize_field_name",
    "sanitize_key",
]

_EXT_ALIASES = {"jpeg": "jpg"}
_JSONL_EXT = frozenset({"jsonl", "ndjson"})
_TEXT_EXT = frozenset({"txt"})
_CSV_EXT = frozenset({"csv"})
_PARQUET_EXT = frozenset({"parquet", "pq"})
_SHARD_EXT = {
    "tar": "webdataset",
    "tgz": "webdataset",  # compressed tars, as the webdataset library reads them
    "tbz": "webdataset",
    "tbz2": "webdataset",
    "txz": "webdataset",
    "tfrecord": "tfrecord",
    "tfrecords": "tfrecord",
    "lmdb": "lmdb",
}
#: Whole-file compression suffixes after ``.tar`` (``x.tar.gz``).
_TAR_COMPRESSED = frozenset({"gz", "bz2", "xz"})
#: Whole-file compression suffixes after a TFRecord extension (TensorFlow's GZIP and ZLIB).
_TFRECORD_COMPRESSED = frozenset({"gz", "gzip", "zz", "zlib"})
#: Objects conversion writes next to a dataset; never treated as input.
_OWN_PREFIXES = ("_fastload",)


class Unit(NamedTuple):
    """One planned sample.

    Attributes:
        item: Human-readable name of the input item for messages and the skip report
            (``"cat/001.jpg"``, ``"data.jsonl:17"``).
        ref: Source-specific, picklable and JSON-able reference that :meth:`Source.read_units` reads.
        size: Estimated payload bytes of the sample (exact for file sources).
        nfields: Estimated number of fields (for the shard-size estimate of per-field overhead).
    """

    item: str
    ref: tuple[Any, ...]
    size: int
    nfields: int = 1


#: ``report(item, reason)``: called for an item that cannot be planned; raises under ``on_error=raise``.
PlanReporter = Callable[[str, str], None]


ItemError = ConversionError


def sanitize_key(key: str) -> str:
    """Make ``key`` a valid sample key for every format: in its last ``/`` segment every ``.``
    becomes ``_`` (WebDataset splits member names at dots); NUL and whitespace (DALI's index format
    cannot hold it) become ``_`` everywhere. Deterministic; other characters are kept."""
    if not key.isprintable() or " " in key:
        key = "".join("_" if (c.isspace() or c == "\x00") else c for c in key)
    head, sep, last = key.rpartition("/")
    return head + sep + last.replace(".", "_")


@functools.lru_cache(maxsize=4096)
def sanitize_field_name(name: str) -> str:
    """Make a column / JSON key usable as a field name: whitespace, ``/`` and NUL become ``_``;
    leading ``_`` and ``.`` and a trailing ``.`` are dropped; an empty result becomes ``field``.

    Memoized: the same few names repeat in every record."""
    out = "".join("_" if (c.isspace() or c in "/\x00") else c for c in name)
    out = out.lstrip("_.").rstrip(".")
    return out or "field"


def field_value_bytes(value: Any) -> bytes | None:
    """Bytes of a structured-record value (see the module docstring); ``None`` omits the field."""
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value).encode("ascii")
    return json.dumps(
        value, ensure_ascii=False, separators=(",", ":"), sort_keys=True, default=_json_default
    ).encode("utf-8")


def _json_default(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError("bytes nested inside a list or struct cannot be stored as JSON text")
    iso = getattr(value, "isoformat", None)
    if callable(iso):
        return iso()
    return str(value)


def _ext(name: str) -> str:
    base = name.rsplit("/", 1)[-1]
    return base.rsplit(".", 1)[-1].lower() if "." in base else ""


def _shard_format(name: str) -> str | None:
    """The format a shard's name says (``x.tar``, ``x.tfrecord``, ``x.tfrecord.gz``, ...), or
    ``None``."""
    parts = name.rsplit("/", 1)[-1].lower().split(".")
    if len(parts) >= 3 and parts[-2] == "tar" and parts[-1] in _TAR_COMPRESSED:
        return "webdataset"
    if len(parts) >= 3 and parts[-1] in _TFRECORD_COMPRESSED:
        return "tfrecord" if _SHARD_EXT.get(parts[-2]) == "tfrecord" else None
    return _SHARD_EXT.get(parts[-1]) if len(parts) >= 2 else None


def _stem(key: str) -> str:
    """``a/b/x.jpg`` → ``a/b/x`` (the part before the last dot of the basename)."""
    head, sep, base = key.rpartition("/")
    return head + sep + (base.rsplit(".", 1)[0] if "." in base else base)


def _field_from_ext(ext: str) -> str:
    return _EXT_ALIASES.get(ext, ext)


def _image_depth(key: str) -> int | None:
    """Directories above ``key`` if it names an image (by extension), else ``None``."""
    return key.count("/") if _ext(key) in IMAGE_EXTENSIONS else None


def _few(names: Sequence[str], shown: int = 5) -> str:
    """``a, b, c`` or ``a, b, c, d, e and 7 more``: a few names for a message."""
    text = ", ".join(names[:shown])
    return text + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _visible(key: str) -> bool:
    parts = key.split("/")
    if any(p.startswith(".") for p in parts):
        return False
    return not (
        len(parts) == 1 and (parts[0] == MANIFEST_NAME or parts[0].startswith(_OWN_PREFIXES))
    )


class Source(ABC):
    """A corpus to convert: enumerates units up front, reads them back in workers.

    Sources pickle cheaply (a store plus a few options) because every worker task carries one.

    Args:
        store: Store holding the corpus.
        keys: The corpus's objects when it is one file (or a given list); ``None`` means every
            visible object in the store.
        options: Source-specific options (none are defined by the built-in sources yet).
    """

    #: Name accepted by ``--source-type``.
    type_name: ClassVar[str] = ""

    def __init__(self, store: Store, keys: Sequence[str] | None = None, **options: Any) -> None:
        self.store = store
        self.keys = list(keys) if keys is not None else None
        self.options = dict(options)
        self._metadata: dict[str, Any] = {}
        self._listing: list[ObjectMeta] | None = None
        #: What the user should know about the corpus (how it was detected, files left out);
        #: filled by :func:`open_source` and :meth:`plan_units`, printed by ``convert``.
        self.warnings: list[str] = []
        #: Objects of the corpus that are not samples and not errors (an image folder's
        #: ``README.txt``), known after :meth:`plan_units`.
        self.ignored: list[str] = []

    def listing(self) -> list[ObjectMeta]:
        """The visible objects of the corpus, sorted by key (listed once, then cached)."""
        if self._listing is None:
            if self.keys is not None:
                self._listing = [self.store.head(k) for k in self.keys]
            else:
                self._listing = list_visible(self.store)
        return self._listing

    def _warn(self, text: str) -> None:
        if text not in self.warnings:  # planning twice says it once
            self.warnings.append(text)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        # Workers never need these; keep task pickles small.
        state["_listing"], state["warnings"], state["ignored"] = None, [], []
        return state

    @abstractmethod
    def plan_units(self, report: PlanReporter) -> list[Unit]:
        """Every sample of the corpus as a :class:`Unit`, in a deterministic order.

        Items that cannot even be planned (a file with the wrong columns, a key collision) go to
        ``report(item, reason)``, which raises under ``on_error=raise``.
        """

    @abstractmethod
    def read_units(
        self, units: Sequence[Unit]
    ) -> Iterator[tuple[Unit, dict[str, Any] | Exception]]:
        """Yield ``(unit, sample or the exception that made it unreadable)`` for each unit, in
        the order given. Samples are ``{"__key__": str, field: bytes}``."""

    def metadata(self) -> dict[str, Any]:
        """Dataset metadata for the manifest (known after :meth:`plan_units`)."""
        return dict(self._metadata)

    def describe(self) -> dict[str, Any]:
        """How the source is identified in ``created_by`` (type and URL)."""
        out: dict[str, Any] = {"type": self.type_name, "url": self.store.url}
        if self.keys is not None:
            out["keys"] = list(self.keys)
        return out


# ---- file sources ------------------------------------------------------------------------------


class _FileSource(Source):
    """Units are samples made of whole files; ``ref = (key, cls or None, ((field, file key), ...))``."""

    def read_units(
        self, units: Sequence[Unit]
    ) -> Iterator[tuple[Unit, dict[str, Any] | Exception]]:
        for unit in units:
            key, cls, files = unit.ref
            sample: dict[str, Any] = {KEY: key}
            try:
                for field, file_key in files:
                    sample[field] = self.store.get(file_key)
            except (OSError, FastloadError) as exc:
                yield unit, exc
                continue
            if cls is not None:
                sample["cls"] = str(cls).encode("ascii")
            yield unit, sample


class ImageFolderSource(_FileSource):
    """``root/<class>/<image>``: one sample per image, its bytes as they are.

    Fields: the file's extension lower-cased (``jpeg`` → ``jpg``), and ``cls`` = the index of the
    class directory among all class directories (those holding an image) sorted by name. Key:
    ``<class>/<file stem>``, sanitized. The manifest metadata gets ``{"classes": [name, ...]}``
    (index order). Files that are not images (``README.txt``, ``Thumbs.db``, ``labels.csv``,
    anywhere in the tree) are left out, counted in :attr:`Source.ignored` and named in a
    warning. Empty images and images not exactly one directory deep are item errors (skippable).
    A folder holding no image at all (say ``root/<class>/<clip>.wav``) takes every file one
    directory deep as a sample.
    """

    type_name = "imagefolder"

    def plan_units(self, report: PlanReporter) -> list[Unit]:
        entries = self.listing()
        has_images = any(_image_depth(m.key) == 1 for m in entries)
        candidates = [m for m in entries if not has_images or _ext(m.key) in IMAGE_EXTENSIONS]
        self.ignored = [
            m.key for m in entries if has_images and _ext(m.key) not in IMAGE_EXTENSIONS
        ]
        if self.ignored:
            self._warn(
                f"left out {plural(len(self.ignored), 'file')} of {self.store.url} that "
                f"{'is not an image' if len(self.ignored) == 1 else 'are not images'}: "
                f"{_few(self.ignored)}. An image folder's samples are its images "
                f"(extensions {', '.join(sorted(IMAGE_EXTENSIONS))}); pass --source-type files "
                "(source_type='files') to convert every file instead"
            )
        classes = sorted({m.key.split("/")[0] for m in candidates if m.key.count("/") == 1})
        index = {name: i for i, name in enumerate(classes)}
        self._metadata = {"classes": classes}
        units: list[Unit] = []
        seen: dict[str, str] = {}
        for meta in candidates:
            if meta.key.count("/") != 1:
                report(meta.key, "not inside a class directory (expected root/<class>/<file>)")
                continue
            cls_name = meta.key.split("/")[0]
            ext = _ext(meta.key)
            if not ext:
                report(meta.key, "has no file extension to name its field")
                continue
            if meta.size == 0:
                report(meta.key, "is an empty file (0 bytes)")
                continue
            key = sanitize_key(_stem(meta.key))
            if key in seen:
                report(meta.key, f"maps to sample key {key!r}, already taken by {seen[key]!r}")
                continue
            seen[key] = meta.key
            field = _field_from_ext(ext)
            units.append(Unit(meta.key, (key, index[cls_name], ((field, meta.key),)), meta.size, 2))
        return units


class FileTreeSource(_FileSource):
    """Any directory tree: files grouped into samples by path without extension.

    ``a/b/x.jpg`` + ``a/b/x.json`` → key ``a/b/x`` with fields ``jpg`` and ``json``. The extension is
    the part after the **last** dot, lower-cased (``jpeg`` → ``jpg``); dots left in the file stem
    become ``_`` in the key. Two files giving the same key and field, files without an
    extension and empty image files are errors (skippable).
    """

    type_name = "files"

    def plan_units(self, report: PlanReporter) -> list[Unit]:
        groups: dict[str, dict[str, str]] = {}
        sizes: dict[str, int] = {}
        for meta in self.listing():
            ext = _ext(meta.key)
            if not ext:
                report(meta.key, "has no file extension to name its field")
                continue
            if meta.size == 0 and ext in IMAGE_EXTENSIONS:
                report(meta.key, "is an empty image file (0 bytes)")
                continue
            field = _field_from_ext(ext)
            key = sanitize_key(_stem(meta.key))
            fields = groups.setdefault(key, {})
            if field in fields:
                report(
                    meta.key,
                    f"maps to sample key {key!r} field {field!r}, already taken by "
                    f"{fields[field]!r}",
                )
                continue
            try:
                validate_field_name(field)
            except InvalidArgumentError as exc:
                report(meta.key, str(exc))
                continue
            fields[field] = meta.key
            sizes[key] = sizes.get(key, 0) + meta.size
        units = []
        for key in sorted(groups):
            files = tuple(sorted(groups[key].items()))
            if files:
                units.append(Unit(files[0][1], (key, None, files), sizes[key], len(files)))
        return units


# ---- record sources ----------------------------------------------------------------------------


def _record_key(stem: str, index: int) -> str:
    return sanitize_key(f"{stem}/{index:09d}")


class _RecordSource(Source):
    """Units are records of files; ``ref = (file key, group, record index)``.

    ``group`` is the file's row group (Parquet) or 0. Reading groups the units by file and group,
    reads each group once, and yields in the order asked (buffering when the order is shuffled).
    """

    def _file_stem(self, key: str) -> str:
        return _stem(key)

    @abstractmethod
    def _read_group(
        self, key: str, group: int, indices: Sequence[int]
    ) -> Iterator[tuple[int, dict[str, Any] | Exception]]:
        """Yield ``(index, sample or error)`` for the sorted record ``indices`` of one group."""

    def read_units(
        self, units: Sequence[Unit]
    ) -> Iterator[tuple[Unit, dict[str, Any] | Exception]]:
        ordered = all(a.ref[:3] < b.ref[:3] for a, b in itertools.pairwise(units))
        if not ordered:
            # Shuffled: read every group the units need once, then emit in the order asked.
            yield from self._read_buffered(units)
            return
        pos = 0
        while pos < len(units):  # runs of one group stream without buffering
            key, group = units[pos].ref[0], units[pos].ref[1]
            end = pos + 1
            while end < len(units) and units[end].ref[:2] == (key, group):
                end += 1
            run = units[pos:end]
            results = self._read_group(key, group, [u.ref[2] for u in run])
            yield from _zip_results(run, results, self._item_error)
            pos = end

    def _read_buffered(
        self, units: Sequence[Unit]
    ) -> Iterator[tuple[Unit, dict[str, Any] | Exception]]:
        wanted: dict[tuple[str, int], list[int]] = {}
        for u in units:
            wanted.setdefault((u.ref[0], u.ref[1]), []).append(u.ref[2])
        got: dict[tuple[str, int, int], dict[str, Any] | Exception | None] = {}
        for (key, group), indices in sorted(wanted.items()):
            for index, result in self._read_group(key, group, sorted(indices)):
                got[(key, group, index)] = result
        for u in units:
            found = got.pop((u.ref[0], u.ref[1], u.ref[2]), None)
            yield u, found if found is not None else self._item_error(u, "was not found")

    @staticmethod
    def _item_error(unit: Unit, reason: str) -> Exception:
        return ItemError(f"{unit.item} {reason}")


def _zip_results(
    run: Sequence[Unit],
    results: Iterable[tuple[int, dict[str, Any] | Exception]],
    item_error: Callable[[Unit, str], Exception],
) -> Iterator[tuple[Unit, dict[str, Any] | Exception]]:
    by_index = {u.ref[2]: u for u in run}
    done = 0
    for index, result in results:
        unit = by_index.get(index)
        if unit is None:
            continue
        # Results come in ascending order; fill any unit the reader passed over.
        while run[done].ref[2] < index:
            yield run[done], item_error(run[done], "was not found in the input")
            done += 1
        yield unit, result
        done += 1
    while done < len(run):
        yield run[done], item_error(run[done], "was not found in the input")
        done += 1


def _lines(store: Store, key: str) -> Iterator[tuple[int, int, int]]:
    """``(line index, byte offset, length without the line break)`` of each non-blank line."""
    offset = 0
    with store.open_reader(key) as f:
        for n, line in enumerate(f):
            length = len(line)
            body = line.rstrip(b"\r\n")
            if body.strip():
                yield n, offset, len(body)
            offset += length


class _LineSource(_RecordSource):
    """One sample per non-blank line; ``ref = (file key, 0, line index)`` plus the byte span."""

    def plan_units(self, report: PlanReporter) -> list[Unit]:
        units: list[Unit] = []
        for meta in self.listing():
            try:
                for n, offset, length in _lines(self.store, meta.key):
                    units.append(
                        Unit(f"{meta.key}:{n + 1}", (meta.key, 0, n, offset, length), length)
                    )
            except (OSError, FastloadError) as exc:
                report(meta.key, f"cannot be read: {exc}")
        return units

    def read_units(
        self, units: Sequence[Unit]
    ) -> Iterator[tuple[Unit, dict[str, Any] | Exception]]:
        # Lines carry their byte span: read runs of nearby lines with one ranged get each.
        from fastload.storage import ByteRange

        pos = 0
        while pos < len(units):
            key, _, _, start, length = units[pos].ref
            end_byte = start + length
            end = pos + 1
            while end < len(units):
                k, _, _, s, n = units[end].ref
                if k != key or s < end_byte or s - end_byte > 65536 or s + n - start > 16 << 20:
                    break
                end_byte = s + n
                end += 1
            try:
                blob = memoryview(self.store.get(key, ByteRange(start, end_byte)))
            except (OSError, FastloadError) as exc:
                for u in units[pos:end]:
                    yield u, exc
                pos = end
                continue
            for u in units[pos:end]:
                _, _, n, s, length = u.ref
                yield u, self._parse(u, key, n, bytes(blob[s - start : s - start + length]))
            pos = end

    def _read_group(
        self, key: str, group: int, indices: Sequence[int]
    ) -> Iterator[
        tuple[int, dict[str, Any] | Exception]
    ]:  # pragma: no cover - read_units overrides
        raise NotImplementedError

    @abstractmethod
    def _parse(self, unit: Unit, key: str, line: int, data: bytes) -> dict[str, Any] | Exception:
        """The sample of one line."""


class TextSource(_LineSource):
    """Plain text: one sample per non-blank line, field ``txt`` = the line's bytes without its
    line break. Key: ``<file stem>/<0-based line index, 9 digits>``."""

    type_name = "text"

    def _parse(self, unit: Unit, key: str, line: int, data: bytes) -> dict[str, Any] | Exception:
        return {KEY: _record_key(self._file_stem(key), line), "txt": data}


def _record_sample(
    record: Mapping[str, Any], default_key: str, item: str
) -> dict[str, Any] | Exception:
    """A sample from a structured record: ``__key__`` (a str) is honoured, other entries become
    fields (names sanitized, values per :func:`field_value_bytes`)."""
    key = record.get(KEY)
    if key is not None and not isinstance(key, str):
        return ItemError(f"{item}: '__key__' must be a string, got {type(key).__name__}")
    sample: dict[str, Any] = {KEY: sanitize_key(key) if key else default_key}
    for name, value in record.items():
        if name == KEY:
            continue
        field = sanitize_field_name(str(name))
        try:
            data = field_value_bytes(value)
        except (TypeError, ValueError) as exc:
            return ItemError(f"{item}: field {name!r} cannot be stored: {exc}")
        if data is None:
            continue
        if field in sample:
            return ItemError(f"{item}: fields {name!r} and another both map to field {field!r}")
        sample[field] = data
    return sample


class JsonlSource(_LineSource):
    """JSON Lines: one sample per non-blank line, which must be a JSON object.

    Each entry becomes a field named by its key (sanitized) with the value's bytes as described in
    the module docstring; a string ``__key__`` entry gives the sample key, otherwise the key is
    ``<file stem>/<0-based line index, 9 digits>``.
    """

    type_name = "jsonl"

    def _parse(self, unit: Unit, key: str, line: int, data: bytes) -> dict[str, Any] | Exception:
        try:
            record = json.loads(data)
        except ValueError as exc:
            return CorruptDataError(
                f"line {line + 1} is not valid JSON ({exc})", url=self.store.child_url(key)
            )
        if not isinstance(record, dict):
            return CorruptDataError(
                f"line {line + 1} is a JSON {type(record).__name__}, not an object",
                url=self.store.child_url(key),
            )
        return _record_sample(record, _record_key(self._file_stem(key), line), unit.item)


def _pyarrow(module: str) -> Any:
    from fastload._plugins import require

    return require(module, extra="parquet", feature="converting CSV and Parquet")


class _TableSource(_RecordSource):
    """Shared column handling of CSV and Parquet: every file must have the same columns."""

    def _check_columns(
        self, key: str, names: list[str], first: list[str] | None, report: PlanReporter
    ) -> bool:
        if first is not None and names != first:
            report(
                key,
                f"has columns {names}, but the first file has {first}; every file must have the "
                "same columns (inconsistent columns)",
            )
            return False
        fields = [sanitize_field_name(n) for n in names if n != KEY]
        if len(set(fields)) != len(fields):
            report(key, f"columns {names} map to duplicate field names {fields}")
            return False
        return True

    def _rows(
        self, key: str, rows: Iterable[tuple[int, Mapping[str, Any]]]
    ) -> Iterator[tuple[int, dict[str, Any] | Exception]]:
        stem = self._file_stem(key)
        for index, row in rows:
            yield index, _record_sample(row, _record_key(stem, index), f"{key}:row {index}")


class CsvSource(_TableSource):
    """CSV with a header row (read with pyarrow): one sample per row, columns become fields.

    Cells are kept as their text (UTF-8 bytes); empty cells omit the field. A ``__key__`` column
    gives the sample key, otherwise ``<file stem>/<0-based row index, 9 digits>``. Every file must
    have the same header.
    """

    type_name = "csv"

    def _open(self, key: str, names: list[str] | None) -> Any:
        pa = _pyarrow("pyarrow")
        csv = _pyarrow("pyarrow.csv")
        convert = (
            csv.ConvertOptions(
                column_types={n: pa.string() for n in names}, strings_can_be_null=True
            )
            if names is not None
            else None
        )
        return csv.open_csv(
            self.store.open_reader(key),
            read_options=csv.ReadOptions(block_size=1 << 22),
            convert_options=convert,
        )

    def plan_units(self, report: PlanReporter) -> list[Unit]:
        units: list[Unit] = []
        first: list[str] | None = None
        for meta in self.listing():
            try:
                names = list(self._open(meta.key, None).schema.names)
                if not self._check_columns(meta.key, names, first, report):
                    continue
                first = first or names
                row = 0
                for batch in self._open(meta.key, names):
                    per_row = max(1, batch.nbytes // max(1, batch.num_rows))
                    for _ in range(batch.num_rows):
                        units.append(
                            Unit(f"{meta.key}:row {row}", (meta.key, 0, row), per_row, len(names))
                        )
                        row += 1
            except (OSError, FastloadError) as exc:
                report(meta.key, f"cannot be read: {exc}")
            except Exception as exc:  # pyarrow.ArrowInvalid and friends
                report(meta.key, f"is not valid CSV: {exc}")
        return units

    def _read_group(
        self, key: str, group: int, indices: Sequence[int]
    ) -> Iterator[tuple[int, dict[str, Any] | Exception]]:
        wanted = iter(indices)
        nxt = next(wanted, None)
        try:
            names = list(self._open(key, None).schema.names)
            row = 0
            for batch in self._open(key, names):
                if nxt is None:
                    return
                if nxt >= row + batch.num_rows:
                    row += batch.num_rows
                    continue
                records = batch.to_pylist()
                picked = []
                while nxt is not None and nxt < row + len(records):
                    picked.append((nxt, records[nxt - row]))
                    nxt = next(wanted, None)
                yield from self._rows(key, picked)
                row += len(records)
        except Exception as exc:
            err = (
                exc
                if isinstance(exc, (OSError, FastloadError))
                else CorruptDataError(f"cannot read CSV: {exc}", url=self.store.child_url(key))
            )
            while nxt is not None:
                yield nxt, err
                nxt = next(wanted, None)


class ParquetSource(_TableSource):
    """Parquet (read with pyarrow, one row group at a time): one sample per row.

    Binary columns stay bytes; other types per the module docstring. A ``__key__`` column gives the
    sample key, otherwise ``<file stem>/<0-based row index in the file, 9 digits>``. Every file must
    have the same column names. ``ref = (file key, row group, row index in the file)``.
    """

    type_name = "parquet"

    def _file(self, key: str) -> Any:
        pq = _pyarrow("pyarrow.parquet")
        return pq.ParquetFile(self.store.open_reader(key))

    def plan_units(self, report: PlanReporter) -> list[Unit]:
        units: list[Unit] = []
        first: list[str] | None = None
        for meta in self.listing():
            try:
                pf = self._file(meta.key)
                names = list(pf.schema_arrow.names)
                if not self._check_columns(meta.key, names, first, report):
                    continue
                first = first or names
                row = 0
                for g in range(pf.metadata.num_row_groups):
                    rg = pf.metadata.row_group(g)
                    per_row = max(1, rg.total_byte_size // max(1, rg.num_rows))
                    for _ in range(rg.num_rows):
                        units.append(
                            Unit(f"{meta.key}:row {row}", (meta.key, g, row), per_row, len(names))
                        )
                        row += 1
            except (OSError, FastloadError) as exc:
                report(meta.key, f"cannot be read: {exc}")
            except Exception as exc:
                report(meta.key, f"is not valid Parquet: {exc}")
        return units

    def _read_group(
        self, key: str, group: int, indices: Sequence[int]
    ) -> Iterator[tuple[int, dict[str, Any] | Exception]]:
        try:
            pf = self._file(key)
            first_row = sum(pf.metadata.row_group(g).num_rows for g in range(group))
            records = pf.read_row_group(group).to_pylist()
        except Exception as exc:
            err = (
                exc
                if isinstance(exc, (OSError, FastloadError))
                else CorruptDataError(
                    f"cannot read row group {group}: {exc}", url=self.store.child_url(key)
                )
            )
            for i in indices:
                yield i, err
            return
        yield from self._rows(
            key, ((i, records[i - first_row]) for i in indices if 0 <= i - first_row < len(records))
        )


# ---- existing shards ---------------------------------------------------------------------------


class _CollectErrors(ErrorPolicy):
    """A reader's ``on_error`` policy that goes on like ``skip`` and keeps every error."""

    def __init__(self) -> None:
        super().__init__("skip")
        self.caught: list[Exception] = []

    def handle(self, exc: FormatError) -> None:
        self.skipped += 1
        self.caught.append(exc)


class _Ended(Exception):
    """Wraps the error that ended a shard's reading early (in a list of skipped-past errors)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _errors_with_end(errors: Sequence[Exception]) -> Iterator[tuple[Exception, bool]]:
    """``(error, whether it ended the reading)`` for the errors :meth:`ShardSource._intact` kept."""
    for exc in errors:
        if isinstance(exc, _Ended):
            yield exc.error, True
        else:
            yield exc, False


def _damage_item(key: str, exc: Exception) -> str:
    """``shard@offset`` (the byte offset the error gives, in the decompressed stream for a
    compressed file), else the shard's key."""
    offset = getattr(exc, "offset", None)
    return f"{key}@{offset}" if isinstance(offset, int) else key


def _damage_reason(exc: Exception, ended: bool, kept: int) -> str:
    text = str(exc) or type(exc).__name__
    rest = "the rest of the file cannot be read" if ended else "the damaged part is left out"
    return f"damaged: {text}; {rest}, the {kept} intact samples of the file are converted"


class ShardSource(_RecordSource):
    """Existing shards: a fastload dataset (its ``fastload.json`` lists the shards) or a directory
    of third-party WebDataset tars / TFRecords / LMDB shards (format by extension, confirmed by
    the format's ``detect``). Samples keep their keys and field bytes exactly.
    ``ref = (shard key, 0, sample position in the shard)``.
    """

    type_name = "shards"

    def __init__(self, store: Store, keys: Sequence[str] | None = None, **options: Any) -> None:
        super().__init__(store, keys, **options)
        self.format_name: str | None = options.get("format")

    def _shards(self, report: PlanReporter) -> list[tuple[str, int | None, int | None]]:
        """``(key, num_samples or None, num_bytes or None)`` per shard, in dataset order."""
        if self.keys is None and self.store.exists(MANIFEST_NAME):
            manifest = read_manifest(self.store)
            manifest.resolve_format(url=self.store.child_url(MANIFEST_NAME))  # fail, not skip
            self.format_name = manifest.format
            self._metadata = dict(manifest.metadata)
            return [(s.name, s.num_samples, s.num_bytes) for s in manifest.shards]
        out: list[tuple[str, int | None, int | None]] = []
        formats: set[str] = set()
        for meta in self.listing():
            fmt = _shard_format(meta.key)
            if fmt is None:
                continue
            formats.add(fmt)
            out.append((meta.key, None, meta.size))
        if len(formats) > 1:
            raise InvalidArgumentError(
                f"{self.store.url} holds shards of several formats ({sorted(formats)}); convert "
                "one format at a time by pointing at a directory of one format"
            )
        if formats and self.format_name is None:
            self.format_name = formats.pop()
        return out

    def _format(self) -> Any:
        from fastload.formats import get_format

        if self.format_name is None:
            raise InvalidArgumentError(f"no shards found in {self.store.url}")
        return get_format(self.format_name)

    def plan_units(self, report: PlanReporter) -> list[Unit]:
        units: list[Unit] = []
        for key, count, nbytes in self._shards(report):
            if count is not None:  # a fastload dataset: the manifest's count
                positions: Sequence[int] = range(count)
            else:
                # Read the shard once; its damage (each record the reader skips past, and what
                # ends the reading early) is reported, every intact sample is kept.
                errors: list[Exception] = []
                positions = [pos for pos, _ in self._intact(key, errors)]
                for exc, ended in _errors_with_end(errors):
                    report(_damage_item(key, exc), _damage_reason(exc, ended, len(positions)))
            per = max(1, (nbytes or 0) // max(1, len(positions)))
            units.extend(Unit(f"{key}#{i}", (key, 0, i), per, 1) for i in positions)
        return units

    def _intact(
        self, key: str, errors: list[Exception], last: int | None = None
    ) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(position, sample)`` of every sample of shard ``key`` its reader delivers intact, in
        order, up to position ``last``. What the reader skips past goes to ``errors``; so does,
        last and wrapped in :class:`_Ended`, an error that ends the reading early (a truncated or
        undecompressable file: the samples before it are still yielded)."""
        policy = _CollectErrors()
        try:
            with self._format().reader(self.store, key) as reader:
                reader.policy = policy  # go on past damaged samples, and keep their errors
                for n, sample in enumerate(reader):
                    pos = sample.get("__index__")
                    if not isinstance(pos, int) or isinstance(pos, bool) or pos < n:
                        pos = n
                    yield (
                        pos,
                        {k: v for k, v in sample.items() if k == KEY or not k.startswith("__")},
                    )
                    if last is not None and pos >= last:
                        break
        except (OSError, FastloadError) as exc:
            errors.extend(policy.caught)
            errors.append(_Ended(exc))
            return
        errors.extend(policy.caught)

    def _read_group(
        self, key: str, group: int, indices: Sequence[int]
    ) -> Iterator[tuple[int, dict[str, Any] | Exception]]:
        wanted = set(indices)
        last = max(indices) if indices else -1
        errors: list[Exception] = []
        seen = -1
        for pos, sample in self._intact(key, errors, last):
            if pos in wanted:
                yield pos, sample
            seen = pos
        if seen < last and errors:  # the shard changed since it was planned
            exc = errors[-1]
            cause = exc.error if isinstance(exc, _Ended) else exc
            for i in indices:
                if i > seen:
                    yield i, cause

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out["format"] = self.format_name
        return out


# ---- registry and detection --------------------------------------------------------------------

SOURCES = PluginRegistry(
    "conversion source",
    "fastload.convert.sources",
    "Pass one of these as source_type=... or --source-type.",
)
SOURCES.register("imagefolder", ImageFolderSource, aliases=("image-folder", "images"))
SOURCES.register("files", FileTreeSource, aliases=("filetree", "file-tree", "tree"))
SOURCES.register("jsonl", JsonlSource, aliases=("json", "ndjson"))
SOURCES.register("text", TextSource, aliases=("txt", "lines"))
SOURCES.register("csv", CsvSource)
SOURCES.register("parquet", ParquetSource, aliases=("pq",))
SOURCES.register("shards", ShardSource, aliases=("webdataset", "wds", "tfrecord", "lmdb"))

_RECORD_TYPES = (
    (_JSONL_EXT, "jsonl"),
    (_TEXT_EXT, "text"),
    (_CSV_EXT, "csv"),
    (_PARQUET_EXT, "parquet"),
)


def list_visible(store: Store) -> list[ObjectMeta]:
    """Every visible object of ``store`` (no hidden path segment, not our own state), sorted."""
    return [m for m in store.list("") if _visible(m.key)]


#: How many files that are not images an image folder may hold and still be detected as one:
#: :data:`IMAGE_FOLDER_STRAYS` files, or :data:`IMAGE_FOLDER_STRAY_FRACTION` of its files if that
#: is more (``README.txt``, ``Thumbs.db``, ``labels.csv``, ...; they are left out and named).
IMAGE_FOLDER_STRAYS = 3
IMAGE_FOLDER_STRAY_FRACTION = 0.1


def _not_an_image_folder(names: Sequence[str], depth: int) -> str | None:
    """Why ``names`` do not make an image folder whose images are ``depth`` directories deep, or
    ``None`` if they do (see :func:`detect_source_type`)."""
    images = [n for n in names if _image_depth(n) == depth]
    if not images:
        deep = {1: "one directory", 2: "two directories"}.get(depth, f"{depth} directories")
        return f"no image is {deep} deep"
    stems = {_stem(n) for n in images}
    image_set = set(images)
    others = [n for n in names if n not in image_set]
    paired = [n for n in others if _stem(n) in stems]
    if paired:
        return (
            f"{plural(len(paired), 'file')} such as {_few(paired, 3)} share the name of an image "
            "beside them, which makes samples of several fields"
        )
    allowed = max(IMAGE_FOLDER_STRAYS, int(len(names) * IMAGE_FOLDER_STRAY_FRACTION))
    if len(others) > allowed:
        return (
            f"{len(others)} of its {len(names)} files are not images inside a class directory "
            f"(such as {_few(others, 3)}); an image folder may hold at most {allowed} such files"
        )
    return None


def _detect(
    store: Store,
    keys: Sequence[str] | None,
    listing: Sequence[ObjectMeta] | None,
    where: str | None = None,
) -> tuple[str, list[str]]:
    """The source type of a corpus and the warnings that go with the guess (see
    :func:`detect_source_type`). ``where`` names the corpus in warnings (default: its URL)."""
    if keys is None and store.exists(MANIFEST_NAME):
        return "shards", []
    if keys is not None:
        names = list(keys)
    else:
        names = [m.key for m in (listing if listing is not None else list_visible(store))]
    if not names:
        raise InvalidArgumentError(
            f"no input files in {store.url} (empty input; hidden files are ignored)"
        )
    exts = {_ext(n) for n in names}
    for family, name in _RECORD_TYPES:
        if exts <= family:
            return name, []
    shard_names = [n for n in names if _ext(n) != "idx"]
    if shard_names and all(_shard_format(n) is not None for n in shard_names):
        return "shards", []
    why = _not_an_image_folder(names, 1)
    if why is None:
        return "imagefolder", []
    where = where or store.url
    n_images = sum(_image_depth(n) is not None for n in names)
    if 2 * n_images <= len(names):  # not mostly images: a file tree, nothing to say
        return "files", []
    if _not_an_image_folder(names, 2) is None:
        example = next(n for n in names if _image_depth(n) == 2)
        splits = sorted({n.split("/")[0] for n in names if _image_depth(n) == 2})
        inner = where.rstrip("/") + "/" + splits[0]
        return "files", [
            f"{where} is taken as a file tree (source type files), so its samples get no class "
            f"label: its images are two directories deep (such as {example}), as in image "
            f"folders one level down ({_few(splits)}). To convert one of them as an image folder "
            f"with a class label per image, point the source at it, e.g. {inner}; pass "
            "--source-type files (source_type='files') to keep the whole tree as files without "
            "this warning"
        ]
    if not any(_image_depth(n) == 1 for n in names):  # a flat or deeper tree: files, clearly
        return "files", []
    return "files", [
        f"{where} is taken as a file tree (source type files), so its samples get no class "
        f"label: {n_images} of its {plural(len(names), 'file')} "
        f"{'is an image' if n_images == 1 else 'are images'}, but it is not an image folder "
        f"(root/<class>/<image>) because {why}. Pass --source-type imagefolder "
        "(source_type='imagefolder') to convert it as an image folder with a class label per "
        "image (the other files are then left out and named), or --source-type files to keep it "
        "a file tree without this warning"
    ]


def detect_source_type(
    store: Store, keys: Sequence[str] | None = None, listing: Sequence[ObjectMeta] | None = None
) -> str:
    """Guess the source type of a corpus (see ``fastload/convert/README.md``).

    Order: a ``fastload.json`` → ``shards``; all files JSONL / text / CSV / Parquet → that type;
    all files shards (``.tar``, ``.tfrecord`` also compressed as ``.tfrecord.gz``/``.zz``,
    ``.lmdb``) → ``shards``; images (by extension) exactly one directory deep, with at most
    :data:`IMAGE_FOLDER_STRAYS` other files or :data:`IMAGE_FOLDER_STRAY_FRACTION` of the files
    (whichever is more) and no other file named like an image beside it (``x.jpg`` +
    ``x.json`` is one sample of two fields) → ``imagefolder``; anything else → ``files``.
    :func:`open_source` also warns when a tree of mostly images falls back to ``files``.

    Raises:
        InvalidArgumentError: The corpus is empty.
    """
    return _detect(store, keys, listing)[0]


def open_source(
    src: str | os.PathLike[str],
    *,
    source_type: str | None = None,
    store_options: Mapping[str, Any] | None = None,
) -> Source:
    """Open ``src`` (a directory / prefix URL, or one file) as a :class:`Source`.

    A local path naming a file, or a URL whose last segment has a known record or shard extension,
    is a one-file corpus read from its parent directory.

    Raises:
        InvalidArgumentError: Unknown ``source_type`` or empty corpus.
        ObjectNotFoundError: ``src`` does not exist.
    """
    text = os.fspath(src)
    options = dict(store_options or {})
    keys: list[str] | None = None
    if "://" not in text:
        if os.path.isfile(text):
            parent, base = os.path.split(os.path.abspath(text))
            store, keys = open_store(parent, **options), [base]
        elif os.path.isdir(text):
            store = open_store(text, **options)
        else:
            raise ObjectNotFoundError(f"conversion source {text!r} does not exist", url=text)
    else:
        base = text.rstrip("/").rsplit("/", 1)[-1]
        known = _JSONL_EXT | _TEXT_EXT | _CSV_EXT | _PARQUET_EXT | set(_SHARD_EXT)
        if not text.endswith("/") and (_ext(base) in known or _shard_format(base) is not None):
            store, keys = open_store(text.rstrip("/").rsplit("/", 1)[0], **options), [base]
            if not store.exists(base):
                raise ObjectNotFoundError(f"conversion source {text} does not exist", url=text)
        else:
            store = open_store(text, **options)
    listing = list_visible(store) if keys is None else None
    warnings: list[str] = []
    if source_type:
        name = source_type
    else:
        name, warnings = _detect(store, keys, listing, where=text)
    cls = SOURCES.load(name)
    canonical = SOURCES.canonical(name)
    extra: dict[str, Any] = {}
    if cls is ShardSource and canonical == "shards" and name.lower() in _FORMAT_ALIASES:
        extra["format"] = _FORMAT_ALIASES[name.lower()]
    source: Source = cls(store, keys, **extra)
    source._listing = listing
    source.warnings.extend(warnings)
    return source


_FORMAT_ALIASES = {
    "webdataset": "webdataset",
    "wds": "webdataset",
    "tfrecord": "tfrecord",
    "lmdb": "lmdb",
}
