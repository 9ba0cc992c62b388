"""Conversion of raw corpora into sharded datasets, and the tools that inspect, verify and index them.

``fastload.convert(src, dst, ...)`` does what ``fastload convert SRC DST ...`` does; see
:func:`convert` and this package's ``README.md`` (sources, key and field naming, resumption, the
skip report). Nothing here imports torch. The sources live in :mod:`fastload.convert.sources`,
the dataset tools in :mod:`fastload.convert.tools`; the command's exit statuses are the CLI's
(:mod:`fastload.cli`).
"""

from fastload.convert._convert import convert
from fastload.convert._engines import ENGINES
from fastload.convert._plan import parse_size
from fastload.convert._results import ConvertResult, SkippedItem
from fastload.convert._state import SKIPPED_KEY
from fastload.convert._tokenizer import DEFAULT_BLOCK_TOKENS, Tokenize
from fastload.convert.sources import (
    SOURCES,
    ConversionError,
    Source,
    Unit,
    detect_source_type,
    open_source,
    sanitize_field_name,
    sanitize_key,
)
from fastload.convert.tools import (
    IndexResult,
    VerifyReport,
    index_dataset,
    inspect_dataset,
    verify_dataset,
)

__all__ = [
    "DEFAULT_BLOCK_TOKENS",
    "ENGINES",
    "SKIPPED_KEY",
    "SOURCES",
    "ConversionError",
    "ConvertResult",
    "IndexResult",
    "SkippedItem",
    "Source",
    "Tokenize",
    "Unit",
    "VerifyReport",
    "convert",
    "detect_source_type",
    "index_dataset",
    "inspect_dataset",
    "open_source",
    "parse_size",
    "sanitize_field_name",
    "sanitize_key",
    "verify_dataset",
]
