"""Arrow sources: Arrow IPC / Feather files, and Hugging Face ``datasets`` saved with
``save_to_disk`` (or passed as a ``datasets.Dataset`` backed by its arrow files).

Rows become samples exactly as Parquet rows do (:class:`~._tables.ParquetSource`): the same
keys, field names and value bytes, planned by record batch (``ref = (file key, batch index,
row index in the file)``), so the output is a pure function of the files and the plan.

Hugging Face feature types (from the schema's ``huggingface`` metadata, or a saved dataset's
``dataset_info.json``) are mapped to fields: an ``Image`` / ``Audio`` / ``Video`` / ``Pdf``
column (stored as a struct ``{bytes, path}``) becomes a field named by the media's extension
(from ``path``, else sniffed from the bytes; ``jpeg`` → ``jpg``) holding the bytes as stored,
or ``<column>.<extension>`` when the dataset has several such columns. A ``ClassLabel`` stays
its int; the class names of the one ``ClassLabel`` column go to the manifest's
``metadata.classes``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from fastload.convert.sources._base import (
    ItemError,
    PlanReporter,
    few,
    field_from_extension,
    file_extension,
)
from fastload.convert.sources._records import record_key, record_sample
from fastload.convert.sources._tables import _pyarrow, _TableSource
from fastload.errors import (
    CorruptDataError,
    FastloadError,
    InvalidArgumentError,
)
from fastload.storage import ObjectMeta, Store

__all__ = [
    "ARROW_EXTENSIONS",
    "ArrowBackedDataset",
    "ArrowSource",
    "HuggingFaceSource",
    "arrow_files_of",
    "hf_dataset_dict_error",
    "is_hf_saved_dataset",
]

#: File extensions of Arrow IPC files (file or stream format) and Feather (version 2) files.
ARROW_EXTENSIONS = frozenset({"arrow", "feather", "ipc"})

#: Hugging Face feature types stored as a struct ``{bytes, path}`` of encoded media.
_MEDIA_TYPES = frozenset({"Image", "Audio", "Video", "Pdf"})

_FILE_MAGIC = b"ARROW1"
_FEATHER_V1_MAGIC = b"FEA1"

# Leading bytes of encoded media → extension (checked in order; RIFF containers by subtype).
_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\xff\xd8\xff", "jpg"),
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"GIF87a", "gif"),
    (b"GIF89a", "gif"),
    (b"BM", "bmp"),
    (b"II*\x00", "tif"),
    (b"MM\x00*", "tif"),
    (b"\xff\x0a", "jxl"),
    (b"\x00\x00\x00\x0cJXL ", "jxl"),
    (b"fLaC", "flac"),
    (b"ID3", "mp3"),
    (b"OggS", "ogg"),
    (b"%PDF", "pdf"),
    (b"\x1aE\xdf\xa3", "webm"),
)


def sniff_extension(data: bytes) -> str | None:
    """The extension of encoded media from its leading bytes (``jpg``, ``png``, ``webp``,
    ``wav``, ``flac``, ``mp3``, ...), or ``None`` when not recognised."""
    if data[:4] == b"RIFF" and len(data) >= 12:
        return {b"WEBP": "webp", b"WAVE": "wav", b"AVI ": "avi"}.get(data[8:12])
    if data[4:8] == b"ftyp":
        brand = data[8:12]
        return "avif" if brand in (b"avif", b"avis") else "mp4"
    for magic, ext in _MAGIC:
        if data.startswith(magic):
            return ext
    if len(data) >= 2 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0:
        return "mp3"  # an MPEG audio frame without an ID3 tag
    return None


def _features(metadata: Mapping[bytes, bytes] | None) -> dict[str, Any]:
    """The Hugging Face features recorded in an arrow schema's metadata (``{}`` if none)."""
    raw = (metadata or {}).get(b"huggingface")
    if not raw:
        return {}
    try:
        info = json.loads(raw)
        features = info.get("info", {}).get("features", {})
    except (ValueError, AttributeError):
        return {}
    return features if isinstance(features, dict) else {}


def _feature_type(feature: Any) -> str | None:
    return feature.get("_type") if isinstance(feature, dict) else None


class _Columns:
    """How the columns of a dataset become fields: which hold media, the class names."""

    def __init__(self, features: Mapping[str, Any]) -> None:
        self.media = sorted(n for n, f in features.items() if _feature_type(f) in _MEDIA_TYPES)
        labels = {
            n: f.get("names") for n, f in features.items() if _feature_type(f) == "ClassLabel"
        }
        names = next(iter(labels.values())) if len(labels) == 1 else None
        self.classes: list[str] | None = (
            [str(c) for c in names] if isinstance(names, list) else None
        )

    def field(self, column: str, value: Any, item: str) -> tuple[str, bytes | None]:
        """The field name and bytes of one media value (``None``: the field is omitted).

        Raises:
            ItemError: The value holds a path but no bytes (media not embedded in the dataset).
        """
        if value is None:
            return column, None
        data = value.get("bytes") if isinstance(value, dict) else None
        path = value.get("path") if isinstance(value, dict) else None
        if data is None:
            if path:
                raise ItemError(
                    f"{item}: column {column!r} holds only a path ({path!r}), not the media's "
                    "bytes; fastload converts what the dataset stores: embed the files first "
                    "(datasets: ds.cast_column(name, Image(decode=True)) then save_to_disk, or "
                    "load the images from their files) and convert again"
                )
            return column, None
        data = bytes(data)
        ext = file_extension(path) if isinstance(path, str) else ""
        ext = field_from_extension(ext or sniff_extension(data) or "")
        if not ext:
            return column, data  # unknown media: the bytes under the column's name
        return (ext if len(self.media) == 1 else f"{column}.{ext}"), data


class ArrowSource(_TableSource):
    """Arrow IPC files, in the file or the stream format, and Feather (version 2) files, read
    with pyarrow one record batch at a time: one sample per row, exactly as Parquet rows.

    Hugging Face features in the schema's metadata are mapped (see the module docstring).
    Every file must have the same column names. ``ref = (file key, batch, row index in the
    file)``. Feather version 1 files are refused (rewrite them with
    ``pyarrow.feather.write_feather``, version 2 by default).
    """

    type_name = "arrow"
    _invalid = "is not a valid Arrow IPC file"

    def __init__(self, store: Store, keys: Sequence[str] | None = None, **options: Any) -> None:
        super().__init__(store, keys, **options)
        self._columns: _Columns | None = None
        self._planned_features: Mapping[str, Any] = {}

    def _reader(self, key: str) -> Any:
        """A pyarrow reader of ``key``'s record batches (file or stream format): a local file is
        memory-mapped (batches passed over cost nothing), others read through the store."""
        pa = _pyarrow("pyarrow")
        root = self.store.local_root
        source: Any = (
            pa.memory_map(os.path.join(root, key))
            if root is not None
            else pa.PythonFile(self.store.open_reader(key), mode="r")
        )
        head = source.read(8)
        source.seek(0)
        if head.startswith(_FEATHER_V1_MAGIC):
            raise CorruptDataError(
                "is a Feather version 1 file, which is not read: rewrite it as version 2 "
                "(pyarrow.feather.write_feather(pyarrow.feather.read_table(path), path))",
                url=self.store.child_url(key),
            )
        if head.startswith(_FILE_MAGIC):
            return _FileBatches(pa.ipc.open_file(source))
        return pa.ipc.open_stream(source)

    def _features(self, schema: Any) -> Mapping[str, Any]:
        return _features(schema.metadata)

    def _set_columns(self, features: Mapping[str, Any]) -> None:
        self._columns = _Columns(features)
        if self._columns.classes is not None:
            self._metadata = {"classes": self._columns.classes}

    def _table(self, key: str) -> tuple[list[str], Iterable[tuple[int, int, int]], Any]:
        reader = self._reader(key)
        groups = ((b, batch.num_rows, batch.nbytes) for b, batch in enumerate(reader))
        return list(reader.schema.names), groups, reader.schema

    def _check_file(self, key: str, schema: Any, first: bool, report: PlanReporter) -> bool:
        features = self._features(schema)
        if first:
            self._planned_features = features
            self._set_columns(features)
        elif features != self._planned_features:
            # Workers take the features of the file they read first: they must agree.
            report(
                key,
                "has other Hugging Face features than the first file; every file must have the "
                "same features",
            )
            return False
        return True

    def _read_group(
        self, key: str, group: int, indices: Sequence[int]
    ) -> Iterator[tuple[int, dict[str, Any] | Exception]]:
        def load() -> tuple[int, list[dict[str, Any]]]:
            reader = self._reader(key)
            if self._columns is None:  # a worker: the features again, from the schema
                self._set_columns(self._features(reader.schema))
            first_row = 0
            for b, batch in enumerate(reader):
                if b == group:
                    return first_row, batch.to_pylist()
                first_row += batch.num_rows
            return first_row, []

        return self._group_rows(key, indices, load, f"cannot read record batch {group}")

    def _rows(
        self, key: str, rows: Iterable[tuple[int, Mapping[str, Any]]]
    ) -> Iterator[tuple[int, dict[str, Any] | Exception]]:
        columns = self._columns
        if columns is None or not columns.media:
            yield from super()._rows(key, rows)
            return
        stem = self._file_stem(key)
        for index, row in rows:
            item = f"{key}:row {index}"
            media: dict[str, bytes] = {}
            try:
                for column in columns.media:
                    field, data = columns.field(column, row.get(column), item)
                    if data is not None:
                        media[field] = data
            except ItemError as exc:
                yield index, exc
                continue
            plain = {k: v for k, v in row.items() if k not in columns.media}
            sample = record_sample(plain, record_key(stem, index), item)
            if isinstance(sample, dict):
                for field, data in media.items():
                    if field in sample:
                        sample = ItemError(f"{item}: media field {field!r} is also a column")
                        break
                    sample[field] = data
            yield index, sample

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_columns"] = None  # read again from the files in the worker
        return state


class _FileBatches:
    """The batches of an IPC *file* reader, iterable like a stream reader."""

    def __init__(self, reader: Any) -> None:
        self._reader = reader
        self.schema = reader.schema

    def __iter__(self) -> Iterator[Any]:
        for b in range(self._reader.num_record_batches):
            yield self._reader.get_batch(b)


_STATE = "state.json"
_INFO = "dataset_info.json"
_DICT = "dataset_dict.json"


def is_hf_saved_dataset(names: Sequence[str]) -> bool:
    """Whether the listing ``names`` is a Hugging Face ``save_to_disk`` directory of one
    ``Dataset``: ``state.json``, ``dataset_info.json`` and ``data-*.arrow`` files at the top."""
    top = {n for n in names if "/" not in n}
    return (
        _STATE in top
        and _INFO in top
        and any(n.startswith("data-") and n.endswith(".arrow") for n in top)
    )


def hf_dataset_dict_error(store: Store, where: str) -> InvalidArgumentError | None:
    """The error of a ``DatasetDict`` saved with ``save_to_disk`` (a ``dataset_dict.json`` and a
    directory per split), or ``None`` if ``store`` does not hold one."""
    if not store.exists(_DICT):
        return None
    try:
        splits = [str(s) for s in json.loads(store.get(_DICT)).get("splits", [])]
    except (ValueError, AttributeError, OSError, FastloadError):
        splits = []
    root = where.rstrip("/")
    named = few(splits) if splits else "(none listed)"
    each = " and ".join(f"fastload convert {root}/{s} DST/{s}" for s in splits[:2])
    return InvalidArgumentError(
        f"{root} is a Hugging Face DatasetDict (dataset_dict.json) with "
        f"{len(splits)} split{'s' if len(splits) != 1 else ''}: {named}; a dataset is one "
        "split. Point at one split directory, or convert each" + (f": {each}" if each else "")
    )


class HuggingFaceSource(ArrowSource):
    """A Hugging Face ``datasets.Dataset`` saved with ``save_to_disk``: its ``data-*.arrow``
    files (IPC stream format) in the order ``state.json`` lists them (``_data_files``), read as
    :class:`ArrowSource` reads them, with the features of ``dataset_info.json``.

    ``dataset_info.json`` and ``state.json`` are not samples. A ``DatasetDict`` directory is
    refused by :func:`~fastload.convert.sources.open_source` (:func:`hf_dataset_dict_error`).
    """

    type_name = "huggingface"

    def listing(self, report: PlanReporter | None = None) -> list[ObjectMeta]:
        if self._listing is not None:
            return self._listing
        try:
            state = json.loads(self.store.get(_STATE))
            files = [str(f["filename"]) for f in state["_data_files"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptDataError(
                f"is not a Hugging Face state.json (no _data_files list of filenames: {exc})",
                url=self.store.child_url(_STATE),
            ) from exc
        if not files:
            raise InvalidArgumentError(f"{self.store.child_url(_STATE)} lists no data files")
        self._listing = [self.store.head(f) for f in files]
        return self._listing

    def _features(self, schema: Any) -> Mapping[str, Any]:
        try:
            info = json.loads(self.store.get(_INFO))
            features = info.get("features")
        except (ValueError, AttributeError, OSError, FastloadError):
            features = None
        return features if isinstance(features, dict) else super()._features(schema)


class ArrowBackedDataset(Protocol):
    """What :func:`arrow_files_of` needs of a ``datasets.Dataset``."""

    @property
    def cache_files(self) -> Sequence[Mapping[str, str]]: ...


def arrow_files_of(dataset: Any) -> tuple[str, list[str]]:
    """The directory and the arrow files (relative, in order) of a ``datasets.Dataset`` backed
    by its cache files, whose rows are exactly the rows of those files.

    Raises:
        InvalidArgumentError: The dataset is held in memory (no cache files), or its rows are
            not the files' rows as they are (an indices mapping from ``select`` / ``shuffle`` /
            ``filter``, columns removed or renamed, a part held in memory); the message says to
            ``save_to_disk`` it and convert the directory.
    """
    what = type(dataset).__name__
    fix = (
        "save it first (ds.save_to_disk(DIR)) and convert DIR, or convert the Arrow files "
        "yourself; workers are separate processes and read the dataset from files"
    )
    files = [str(f["filename"]) for f in dataset.cache_files if "filename" in f]
    if not files:
        raise InvalidArgumentError(f"cannot convert an in-memory {what} (no cache files): {fix}")
    if getattr(dataset, "_indices", None) is not None:
        raise InvalidArgumentError(
            f"cannot convert this {what}: it has an indices mapping (from select, shuffle, "
            f"filter or sort), so its rows are not the rows of its cache files; {fix} "
            "(or call ds.flatten_indices() first)"
        )
    pa = _pyarrow("pyarrow")
    names: list[str] | None = None
    rows = 0
    for path in files:
        with pa.memory_map(path) as source:
            head = source.read(8)
            source.seek(0)
            reader = (
                _FileBatches(pa.ipc.open_file(source))
                if head.startswith(_FILE_MAGIC)
                else pa.ipc.open_stream(source)
            )
            names = names or list(reader.schema.names)
            rows += sum(batch.num_rows for batch in reader)
    columns = list(getattr(dataset, "column_names", names) or [])
    if columns != names or rows != getattr(dataset, "num_rows", rows):
        raise InvalidArgumentError(
            f"cannot convert this {what}: its rows or columns ({columns}) are not those of its "
            f"cache files ({rows} rows, columns {names}): {fix}"
        )
    root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in files])
    return root, [os.path.relpath(os.path.abspath(p), root).replace(os.sep, "/") for p in files]
