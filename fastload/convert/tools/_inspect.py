"""``fastload inspect``: a dataset summarised from its manifest and its first samples."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from fastload.convert.tools._common import open_dataset_store
from fastload.formats import MANIFEST_NAME, read_manifest
from fastload.storage import Store

__all__ = ["inspect_dataset"]


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
    store = open_dataset_store(url, store_options)
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
