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
    ManifestError,
    ObjectNotFoundError,
    UnsupportedManifestVersionError,
)
from fastload.formats._base import ShardInfo
from fastload.storage import Store

__all__ = [
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "Manifest",
    "ShardEntry",
    "field_type",
    "read_manifest",
    "write_manifest",
]

MANIFEST_NAME = "fastload.json"
MANIFEST_VERSION = 1

_TYPES = {
    "int": ("cls", "cls2", "index", "id", "label"),
    "text": ("txt", "text", "transcript"),
    "json": ("json",),
    "npy": ("npy",),
    "msgpack": ("msgpack", "mp"),
    "pickle": ("pyd", "pickle"),
    "image": ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm", "pgm"),
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
        except ValueError as exc:
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
        try:
            shards = [
                ShardEntry(
                    str(s["name"]),
                    int(s["num_samples"]),
                    int(s["num_bytes"]),
                    str(s["sha256"]),
                    s.get("index"),
                )
                for s in doc["shards"]
            ]
            manifest = cls(
                format=str(doc["format"]),
                shards=shards,
                schema=dict(doc.get("schema", {})),
                created_by=dict(doc.get("created_by", {})),
                metadata=dict(doc.get("metadata", {})),
                version=version,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(
                f"manifest is missing or has a malformed field: {exc!r}", url=url
            ) from exc
        if "num_samples" in doc and doc["num_samples"] != manifest.num_samples:
            raise ManifestError(
                f"manifest says num_samples={doc['num_samples']} but its shards add up to "
                f"{manifest.num_samples}; rebuild it with `fastload index`",
                url=url,
            )
        return manifest


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
        raise ObjectNotFoundError(
            f"no dataset manifest at {url}; create a dataset with `fastload convert`, or index "
            f"existing shards with `fastload index {store.child_url(prefix) if prefix else store.url}`",
            url=url,
        ) from exc
    return Manifest.from_json(text, url=store.child_url(key))


def write_manifest(store: Store, manifest: Manifest, prefix: str = "") -> str:
    """Write the manifest atomically to the dataset root; returns its key."""
    key = _join(prefix, MANIFEST_NAME)
    store.put(key, manifest.to_json().encode("utf-8"))
    return key
