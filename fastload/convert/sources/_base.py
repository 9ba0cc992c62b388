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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

from fastload.convert._progress import plural
from fastload.convert.sources._tree import Tree, visible, walk_tree
from fastload.errors import ConversionError
from fastload.formats.manifest import IMAGE_EXTENSIONS
from fastload.storage import ObjectMeta, Store

__all__ = [
    "ItemError",
    "PlanReporter",
    "Reporter",
    "Source",
    "Unit",
    "few",
    "field_from_extension",
    "field_value_bytes",
    "file_extension",
    "image_depth",
    "key_stem",
    "list_visible",
    "report_left_out",
    "sanitize_field_name",
    "sanitize_key",
    "visible",
]

_EXT_ALIASES = {"jpeg": "jpg"}


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


class Reporter:
    """A :data:`PlanReporter` that also hears of items left out that are no errors.

    Sources call :func:`report_left_out` for those (a duplicate of a file converted under
    another path, a symbolic link loop not followed): a :class:`Reporter` passes them to
    ``left_out`` (the conversion lists them in the skip report, whatever ``on_error`` says);
    a plain reporter function does not hear of them.

    Args:
        error: Called for item errors (may raise).
        left_out: Called as ``left_out(item, reason, duplicate_of)``; ``duplicate_of`` is the
            path converted instead, for a duplicate, else ``None``. Never raises.
    """

    def __init__(
        self, error: PlanReporter, left_out: Callable[[str, str, str | None], None]
    ) -> None:
        self._error = error
        self.left_out = left_out

    def __call__(self, item: str, reason: str) -> None:
        self._error(item, reason)


def report_left_out(
    report: PlanReporter, item: str, reason: str, duplicate_of: str | None = None
) -> None:
    """Report an item left out that is no error (see :class:`Reporter`)."""
    if isinstance(report, Reporter):
        report.left_out(item, reason, duplicate_of)


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
        self._tree: Tree | None = None
        #: What the user should know about the corpus (how it was detected, files left out);
        #: filled by :func:`open_source` and :meth:`plan_units`, printed by ``convert``.
        self.warnings: list[str] = []
        #: Objects of the corpus that are not samples and not errors (an image folder's
        #: ``README.txt``), known after :meth:`plan_units`.
        self.ignored: list[str] = []

    def listing(self, report: PlanReporter | None = None) -> list[ObjectMeta]:
        """The visible objects of the corpus, sorted by key, each file once (listed once, then
        cached; see :func:`~fastload.convert.sources._tree.walk_tree` for symbolic links).

        With ``report`` (a :meth:`plan_units` calls it so), what the walk left out is reported
        too: the loops and repeated directories not followed and the duplicate paths of a file
        (not errors), and the dangling links (item errors).
        """
        if self.keys is not None:
            if self._listing is None:
                self._listing = [self.store.head(k) for k in self.keys]
            return self._listing
        tree = self._walked()
        if self._listing is None:
            self._listing = tree.unique()
        if report is not None:
            self._report_tree(tree, report, tree.duplicate_of)
        return self._listing

    def tree(self) -> Tree | None:
        """The walk of the corpus's tree (every path, duplicates included), or ``None`` when the
        corpus is a given list of objects."""
        return None if self.keys is not None else self._walked()

    def _walked(self) -> Tree:
        tree = self._tree
        if tree is None:
            tree = walk_tree(self.store)
            self.adopt_tree(tree)
        return tree

    def adopt_tree(self, tree: Tree) -> None:
        """Use ``tree``, the walk of the store already made (by source detection)."""
        self._tree = tree
        self._listing = None
        for text in tree.warnings():
            self._warn(text)

    def _report_tree(self, tree: Tree, report: PlanReporter, duplicates: Mapping[str, str]) -> None:
        """Report what the walk of ``tree`` left out, by path: its notes and ``duplicates``
        (path → the path converted instead), which a warning also names."""
        if duplicates:
            named = ", ".join(
                f"{k} (the same file as {v})" for k, v in list(duplicates.items())[:3]
            )
            more = f" and {len(duplicates) - 3} more" if len(duplicates) > 3 else ""
            self._warn(
                f"{self.store.url} reaches {plural(len(duplicates), 'file')} by a second path "
                "(symbolic or hard links): each file is converted once, under its own path in "
                f"the source, else the first in sorted order; left out: {named}{more}"
            )
        items: list[tuple[str, str, bool, str | None]] = [
            (n.item, n.reason, n.error, None) for n in tree.notes
        ]
        items.extend(
            (key, tree.duplicate_reason(key, first), False, first)
            for key, first in duplicates.items()
        )
        for item, reason, error, first in sorted(items, key=lambda t: t[0]):
            if error:
                report(item, reason)
            else:
                report_left_out(report, item, reason, first)

    def _warn(self, text: str) -> None:
        if text not in self.warnings:  # planning twice says it once
            self.warnings.append(text)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        # Workers never need these; keep task pickles small.
        state["_listing"], state["_tree"], state["warnings"], state["ignored"] = None, None, [], []
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
        ``report(item, reason)``, which raises under ``on_error=raise``; items left out that are
        no errors (duplicates, links not followed) go to :func:`report_left_out`. Sources that
        list a tree call :meth:`listing` with ``report``, which reports what the walk left out. A :attr:`replannable`
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
    """Every visible object of ``store`` (no hidden path segment, not our own state), sorted,
    each file once (symbolic links followed, loops not: see
    :func:`~fastload.convert.sources._tree.walk_tree`)."""
    return walk_tree(store).unique()
