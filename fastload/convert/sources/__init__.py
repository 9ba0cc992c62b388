"""Where conversion reads from: one :class:`Source` per kind of corpus, found by name or detected.

* :mod:`._base`: the :class:`Source` interface, :class:`Unit`, and the naming rules for keys and
  fields shared by every source.
* :mod:`._tree`: the one walk of a tree that every source and ``fastload index`` list through:
  symbolic links followed, each real directory and file once, loops not followed.
* :mod:`._files`: image folders and file trees (samples of whole files).
* :mod:`._records`: JSON Lines and text (records of files); :mod:`._tables`: CSV and Parquet.
* :mod:`._shards`: existing shards (a fastload dataset or third-party shards).
* :mod:`._detect`: the :data:`SOURCES` registry, source-type detection and :func:`open_source`.
"""

from fastload.convert.sources._arrow import ArrowBackedDataset
from fastload.convert.sources._base import (
    PlanReporter,
    Reporter,
    Source,
    Unit,
    field_value_bytes,
    list_visible,
    sanitize_field_name,
    sanitize_key,
)
from fastload.convert.sources._detect import (
    IMAGE_FOLDER_STRAY_FRACTION,
    IMAGE_FOLDER_STRAYS,
    SOURCES,
    detect_source_type,
    open_source,
)
from fastload.convert.sources._files import FileTreeSource, ImageFolderSource
from fastload.convert.sources._records import JsonlSource, TextSource
from fastload.convert.sources._shards import ShardSource
from fastload.convert.sources._tables import CsvSource, ParquetSource
from fastload.errors import ConversionError

__all__ = [
    "ArrowBackedDataset",
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
    "Reporter",
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
