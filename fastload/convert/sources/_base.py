"""Where conversion reads from: raw corpora behind one small interface, :class:`Source`.

A :class:`Source` does two things:

* :meth:`Source.plan_units` enumerates the corpus **deterministically** (sorted by store key, then by
  position in the file) into :class:`Unit` records, one per sample. A unit is small, picklable and
  JSON-able; it carries an estimate of the sample's bytes so the planner can cut shards by size.
  Record sources (JSONL, text, CSV, Parquet, shards) make one cheap pass here over the records.
  The conversion cuts shards from the units as they come and writes each shard as it is cut.
  Where that pass is cheap to repeat (:attr:`Source.replannable`), a conversion that must plan
  everything first (see ``fastload/convert/README.md``) enumerates again to write, and never holds
  every unit; other sources' units are then kept.
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
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar, NamedTuple

from fastload.errors import ConversionError
from fastload.formats.manifest import IMAGE_EXTENSIONS, MANIFEST_NAME
from fastload.storage import ObjectMeta, Store

__all__ = [
    "ItemError",
    "PlanReporter",
    "Source",
    "Unit",
    "few",
    "field_from_extension",
    "field_value_bytes",
    "file_extension",
    "image_depth",
    "key_stem",
    "list_visible",
    "sanitize_field_name",
    "sanitize_key",
    "visible",
]

_EXT_ALIASES = {"jpeg": "jpg"}
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


def file_extension(name: str) -> str:
    """``x.JPG`` → ``jpg``: the part of the basename after its last dot, lower-cased (or ``""``)."""
    base = name.rsplit("/", 1)[-1]
    return base.rsplit(".", 1)[-1].lower() if "." in base else ""


def key_stem(key: str) -> str:
    """``a/b/x.jpg`` → ``a/b/x`` (the part before the last dot of the basename)."""
    head, sep, base = key.rpartition("/")
    return head + sep + (base.rsplit(".", 1)[0] if "." in base else base)


def field_from_extension(ext: str) -> str:
    """The field a file extension names (``jpeg`` → ``jpg``)."""
    return _EXT_ALIASES.get(ext, ext)


def image_depth(key: str) -> int | None:
    """Directories above ``key`` if it names an image (by extension), else ``None``."""
    return key.count("/") if file_extension(key) in IMAGE_EXTENSIONS else None


def few(names: Sequence[str], shown: int = 5) -> str:
    """``a, b, c`` or ``a, b, c, d, e and 7 more``: a few names for a message."""
    text = ", ".join(names[:shown])
    return text + (f" and {len(names) - shown} more" if len(names) > shown else "")


def visible(key: str) -> bool:
    """Whether ``key`` is input: no hidden path segment, not the manifest nor our own objects."""
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

    @property
    def replannable(self) -> bool:
        """Whether :meth:`plan_units` streams its units and is cheap to run again (one pass over
        the records, no state kept across it), so that a conversion that must plan everything
        before writing runs it twice rather than keep every unit. Otherwise its units are kept
        as the one planning pass gives them."""
        return False

    @abstractmethod
    def plan_units(self, report: PlanReporter) -> Iterable[Unit]:
        """Every sample of the corpus as a :class:`Unit`, in a deterministic order.

        Items that cannot even be planned (a file with the wrong columns, a key collision) go to
        ``report(item, reason)``, which raises under ``on_error=raise``. A :attr:`replannable`
        source yields the units as it enumerates them, the same ones on every run while the
        corpus is unchanged. :meth:`describe` is final when this returns (before its units are
        consumed): it heads the plan's hash.
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


def list_visible(store: Store) -> list[ObjectMeta]:
    """Every visible object of ``store`` (no hidden path segment, not our own state), sorted."""
    return [m for m in store.list("") if visible(m.key)]
