"""The dataset manifest, ``fastload.json``: the single source of truth for a dataset.

It sits at the dataset root and is written last, atomically, after every shard and index. Its JSON
is canonical (sorted keys, two-space indent, ``\\n`` at the end) and holds no timestamps, so the same
dataset always gives the same bytes. Layout (version 1)::

    {
      "fastload_manifest": 1,
      "format": "webdataset",
      "num_samples": 10000,
      "num_bytes": 1023410176,
      "schema": {"cls": {"count": 10000, "type": "int"}, "jpg": {"count": 10000, "type": "image"}},
      "shards": [
        {"name": "train-000000.tar", "num_samples": 2500, "num_bytes": 256000000,
         "sha256": "…", "index": "train-000000.tar.idx"},
        …
      ],
      "created_by": {"tool": "fastload", "version": "0.1.0", "source": "…", "options": {…}},
      "metadata": {"classes": ["cat", "dog"]}
    }

Shard names are relative to the dataset root. Readers refuse a ``fastload_manifest`` version newer
than they know with :class:`~fastload.errors.UnsupportedManifestVersionError`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastload.errors import (
    InvalidArgumentError,
    ManifestError,
    ManifestTotalsError,
    ObjectNotFoundError,
    UnsupportedManifestVersionError,
)
from fastload.formats._base import FORMATS, Format, ShardInfo, get_format
from fastload.storage import Store

__all__ = [
    "IMAGE_EXTENSIONS",
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "Manifest",
    "ShardEntry",
    "field_type",
    "read_manifest",
    "unsafe_key_reason",
    "why_empty",
    "write_manifest",
]

MANIFEST_NAME = "fastload.json"
MANIFEST_VERSION = 1

#: Extensions of image fields and files (lower case, no dot): what makes a directory an image
#: folder for ``convert``, and the ``image`` type of a manifest's schema. The one list.
IMAGE_EXTENSIONS: frozenset[str] = frozenset(
    {"jpg", "jpeg", "jpe", "jfif", "png", "webp", "bmp", "gif", "tif", "tiff"}
    | {"ppm", "pgm", "pbm", "pnm", "jxl", "avif"}
)

_TYPES = {
    "int": ("cls", "cls2", "index", "id", "label"),
    "text": ("txt", "text", "transcript"),
    "json": ("json",),
    "npy": ("npy",),
    "msgpack": ("msgpack", "mp"),
    "pickle": ("pyd", "pickle"),
    "image": tuple(sorted(IMAGE_EXTENSIONS)),
    "audio": ("wav", "flac", "mp3", "ogg"),
    "video": ("mp4", "webm", "avi", "mkv"),
}
_EXT_TYPE = {ext: kind for kind, exts in _TYPES.items() for ext in exts}


def field_type(name: str) -> str:
    """The schema type of a field name, from its extension (``"bytes"`` when unknown)."""
    return _EXT_TYPE.get(name.rsplit(".", 1)[-1].lower(), "bytes")


@dataclass(frozen=True)
class ShardEntry:
    """One shard in the manifest.

    Attributes:
        name: Key of the shard relative to the dataset root.
        num_samples: Samples in the shard.
        num_bytes: Size of the shard object in bytes.
        sha256: Hex SHA-256 of the shard's bytes.
        index: Key of the shard's index relative to the dataset root, or ``None``.
    """

    name: str
    num_samples: int
    num_bytes: int
    sha256: str
    index: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "num_samples": self.num_samples,
            "num_bytes": self.num_bytes,
            "sha256": self.sha256,
        }
        if self.index is not None:
            out["index"] = self.index
        return out

    @classmethod
    def from_info(cls, info: ShardInfo, root: str = "") -> ShardEntry:
        """Entry for a shard a writer reported; ``root`` is stripped from its keys."""

        def rel(key: str) -> str:
            if root and key.startswith(root.rstrip("/") + "/"):
                return key[len(root.rstrip("/")) + 1 :]
            return key

        return cls(
            rel(info.key),
            info.num_samples,
            info.num_bytes,
            info.sha256,
            rel(info.index_key) if info.index_key else None,
        )


@dataclass
class Manifest:
    """A dataset: its format, schema, shards and provenance.

    Attributes:
        format: Canonical format name.
        shards: The shards, in dataset order.
        schema: Field name → ``{"type": ..., "count": samples having it}``.
        created_by: How the dataset was made (tool, version, source, options). No timestamps.
        metadata: Free-form dataset metadata (e.g. ``classes`` for image folders).
        version: Manifest layout version.
    """

    format: str
    shards: list[ShardEntry]
    schema: dict[str, dict[str, Any]] = field(default_factory=dict)
    created_by: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    version: int = MANIFEST_VERSION

    @property
    def num_samples(self) -> int:
        """Total samples over all shards."""
        return sum(s.num_samples for s in self.shards)

    @property
    def num_bytes(self) -> int:
        """Total shard bytes."""
        return sum(s.num_bytes for s in self.shards)

    @staticmethod
    def schema_from_fields(counts: Iterable[Mapping[str, int]]) -> dict[str, dict[str, Any]]:
        """Merge per-shard field counts into a schema."""
        total: dict[str, int] = {}
        for c in counts:
            for name, n in c.items():
                total[name] = total.get(name, 0) + n
        return {name: {"type": field_type(name), "count": n} for name, n in sorted(total.items())}

    def to_json(self) -> str:
        """Canonical JSON text (sorted keys, ends with a newline)."""
        doc = {
            "fastload_manifest": self.version,
            "format": self.format,
            "num_samples": self.num_samples,
            "num_bytes": self.num_bytes,
            "schema": self.schema,
            "shards": [s.to_json() for s in self.shards],
            "created_by": self.created_by,
            "metadata": self.metadata,
        }
        return json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, url: str = "") -> Manifest:
        """Parse and validate a manifest.

        Raises:
            ManifestError: Not JSON, or a required field is missing or has the wrong type.
            UnsupportedManifestVersionError: Written by a newer fastload.
        """
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
            raise ManifestError(f"manifest is not valid JSON: {exc}", url=url) from exc
        if not isinstance(doc, dict) or "fastload_manifest" not in doc:
            raise ManifestError(
                "not a fastload manifest (no 'fastload_manifest' version field)", url=url
            )
        version = doc["fastload_manifest"]
        if not isinstance(version, int) or version < 1:
            raise ManifestError(f"invalid manifest version {version!r}", url=url)
        if version > MANIFEST_VERSION:
            raise UnsupportedManifestVersionError(
                f"manifest version {version} is newer than this fastload understands "
                f"(up to {MANIFEST_VERSION}); upgrade fastload (pip install -U fastload)",
                url=url,
            )
        if not isinstance(doc.get("shards"), list):
            raise ManifestError(f"manifest has no 'shards' list{_fix(url)}", url=url)
        shards = [_shard_entry(s, i, url) for i, s in enumerate(doc["shards"])]
        _check_unique(shards, url)
        fmt = doc.get("format")
        if not isinstance(fmt, str) or not fmt:
            raise ManifestError(
                f"manifest 'format' must be a format name, got {fmt!r}{_fix(url)}", url=url
            )
        try:
            manifest = cls(
                format=fmt,
                shards=shards,
                schema=dict(doc.get("schema", {})),
                created_by=dict(doc.get("created_by", {})),
                metadata=dict(doc.get("metadata", {})),
                version=version,
            )
        except (TypeError, ValueError) as exc:
            raise ManifestError(
                f"manifest has a malformed 'schema', 'created_by' or 'metadata' field: {exc}",
                url=url,
            ) from exc
        for total in ("num_samples", "num_bytes"):
            if total in doc and doc[total] != getattr(manifest, total):
                raise ManifestTotalsError(
                    f"manifest says {total}={doc[total]} but its shards add up to "
                    f"{getattr(manifest, total)}",
                    _fix(url),
                    url=url,
                    manifest=manifest,
                )
        return manifest

    def resolve_format(self, *, url: str = "") -> Format:
        """The :class:`Format` this manifest names.

        Raises:
            ManifestError: The format is not installed; the message names the manifest and the
                formats this fastload knows.
        """
        try:
            return get_format(self.format)
        except InvalidArgumentError as exc:
            raise ManifestError(
                f"the manifest names shard format {self.format!r}, which this fastload does not "
                f"know (known: {', '.join(FORMATS.names())}); the dataset was written by a newer "
                "fastload or with a format plugin that is not installed here: upgrade fastload "
                "or install the plugin",
                url=url,
            ) from exc


_HEX = frozenset("0123456789abcdef")


def _fix(url: str) -> str:
    """The remedy for a damaged manifest at ``url``."""
    root = url[: -len(MANIFEST_NAME) - 1] if url.endswith("/" + MANIFEST_NAME) else "DATASET"
    return (
        "; the manifest was edited or damaged: restore it from a backup, or move it aside and "
        f"rebuild one from the shards with `fastload index {root}` (its metadata, e.g. class "
        "names, is then lost)"
    )


def unsafe_key_reason(name: str) -> str | None:
    """Why ``name`` cannot be a key relative to the dataset root, or ``None`` if it can."""
    if not name:
        return "is empty"
    if "\0" in name:
        return "contains a NUL character"
    if name.startswith("/"):
        return "is an absolute path (shard names are relative to the dataset root)"
    parts = name.split("/")
    if ".." in parts or ".." in name.replace("\\", "/").split("/"):
        return "escapes the dataset root with a '..' segment"
    if "" in parts or "." in parts:
        return "has an empty or '.' path segment"
    return None


def _count(value: Any, what: str, i: int, url: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ManifestError(
            f"shard entry {i} has {what}={value!r}; it must be an integer >= 0{_fix(url)}", url=url
        )
    return value


def _shard_entry(raw: Any, i: int, url: str) -> ShardEntry:
    """One validated ``shards[i]`` entry."""
    if not isinstance(raw, dict):
        raise ManifestError(f"shard entry {i} is not an object: {raw!r:.80}{_fix(url)}", url=url)
    for name in ("name", "num_samples", "num_bytes", "sha256"):
        if name not in raw:
            raise ManifestError(f"shard entry {i} has no {name!r} field{_fix(url)}", url=url)
    names = [("name", raw["name"])]
    if raw.get("index") is not None:
        names.append(("index", raw["index"]))
    for what, value in names:
        if not isinstance(value, str):
            raise ManifestError(
                f"shard entry {i} has {what}={value!r}; it must be a string{_fix(url)}", url=url
            )
        reason = unsafe_key_reason(value)
        if reason is not None:
            raise ManifestError(f"shard entry {i}: {what} {value!r} {reason}{_fix(url)}", url=url)
    sha = raw["sha256"]
    if not isinstance(sha, str) or len(sha) != 64 or not _HEX.issuperset(sha):
        raise ManifestError(
            f"shard entry {i} ({raw['name']!r}) has sha256={sha!r:.80}; it must be 64 lower-case "
            f"hex digits{_fix(url)}",
            url=url,
        )
    return ShardEntry(
        raw["name"],
        _count(raw["num_samples"], "num_samples", i, url),
        _count(raw["num_bytes"], "num_bytes", i, url),
        sha,
        raw.get("index"),
    )


def _check_unique(shards: list[ShardEntry], url: str) -> None:
    """Every shard and index key appears once: a repeated shard would deliver its samples twice."""
    seen: dict[str, int] = {}
    for i, entry in enumerate(shards):
        for key in (entry.name, entry.index):
            if key is None:
                continue
            if key in seen:
                raise ManifestError(
                    f"shard entries {seen[key]} and {i} both name {key!r}; a shard listed twice "
                    f"would be read twice per epoch{_fix(url)}",
                    url=url,
                )
            seen[key] = i


def _join(prefix: str, name: str) -> str:
    return f"{prefix.rstrip('/')}/{name}" if prefix.strip("/") else name


def read_manifest(store: Store, prefix: str = "") -> Manifest:
    """Read ``fastload.json`` from the dataset root ``prefix`` of ``store``.

    Raises:
        ObjectNotFoundError: No manifest there (the message says how to make one).
        ManifestError: Malformed manifest.
    """
    key = _join(prefix, MANIFEST_NAME)
    try:
        text = store.get(key)
    except ObjectNotFoundError as exc:
        url = store.child_url(key)
        root = store.child_url(prefix) if prefix else store.url
        missing = why_empty(store, prefix)
        if missing is not None:
            raise ObjectNotFoundError(missing, url=root) from exc
        raise ObjectNotFoundError(
            f"no dataset manifest at {url}; create a dataset with `fastload convert`, or index "
            f"existing shards with `fastload index {root}`",
            url=url,
        ) from exc
    try:
        return Manifest.from_json(text, url=store.child_url(key))
    except ManifestTotalsError as exc:
        if not isinstance(exc.manifest, Manifest):
            raise
        off = _entries_off(store, prefix, exc.manifest)
        if not off:
            raise
        raise ManifestTotalsError(
            f"{exc.found} ({off})", exc.remedy, url=store.child_url(key), manifest=exc.manifest
        ) from None


def _entries_off(store: Store, prefix: str, manifest: Manifest, most: int = 5) -> str:
    """The shards whose manifest entries disagree with the objects stored (missing, or another
    size), said in a clause naming up to ``most`` of them; ``""`` when none do or the store
    cannot be listed. One listing of the dataset root: asked only once a total is off."""
    try:
        sizes = {m.key: m.size for m in store.list(prefix)} if store.supports_listing else None
    except Exception:  # the totals error stands on its own; the store's fault is not this one
        return ""
    if sizes is None:
        return ""
    off = []
    for entry in manifest.shards:
        found = sizes.get(_join(prefix, entry.name))
        if found is None:
            off.append(f"{entry.name} is missing")
        elif found != entry.num_bytes:
            off.append(
                f"{entry.name} has {found:,} bytes where the manifest says {entry.num_bytes:,}"
            )
    if not off:
        return ""
    more = f" (and {len(off) - most} more shards)" if len(off) > most else ""
    return "; ".join(off[:most]) + more


def write_manifest(store: Store, manifest: Manifest, prefix: str = "") -> str:
    """Write the manifest atomically to the dataset root; returns its key."""
    key = _join(prefix, MANIFEST_NAME)
    store.put(key, manifest.to_json().encode("utf-8"))
    return key


def why_empty(store: Store, prefix: str = "") -> str | None:
    """Why there is no dataset at all at ``prefix`` of ``store``, or ``None`` if objects are there.

    Tells a path that does not exist and a file given where a directory is expected (a single
    shard, typically) from a directory that holds no dataset, so that the messages of
    ``inspect``/``verify``/``index``/``open_dataset`` say what to do instead of pointing at each
    other.
    """
    import os

    root = store.uncached.local_root  # a cache in front: the directory it caches
    if root is not None:
        path = os.path.join(root, prefix) if prefix else root
        if os.path.isfile(path):
            return (
                f"{path} is a file, not a dataset directory (it may be a single shard): point "
                f"at the directory that holds the shards (`fastload index {os.path.dirname(path)}` "
                f"makes a dataset of them), or convert the file with `fastload convert {path} DST`"
            )
        if not os.path.exists(path):
            return f"{path} does not exist; check the path"
        return None
    try:
        empty = next(iter(store.list(prefix)), None) is None
    except Exception:  # a listing error is reported by the caller's own request
        return None
    if empty:
        url = store.child_url(prefix) if prefix else store.url
        return f"nothing is stored under {url}; check the bucket and prefix (and endpoint)"
    return None
