"""A synthetic dataset of random bytes for the storage benchmarks (``bench_faults``,
``bench_hdfs``): sample ``s<i>`` holds 16-48 KB drawn from ``random.Random(i)``, so any process can
check a delivered sample's bytes without the dataset at hand.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

__all__ = ["build", "collate", "digest_of", "expected_digests", "payload"]


def payload(i: int) -> bytes:
    """The bytes of sample ``i``."""
    rng = random.Random(i)
    return rng.randbytes(rng.randint(16_000, 48_000))


def expected_digests(count: int) -> dict[str, str]:
    """Key -> the 16 first hex digits of the SHA-256 of its bytes, for ``count`` samples."""
    return {f"s{i:06d}": hashlib.sha256(payload(i)).hexdigest()[:16] for i in range(count)}


def digest_of(sample: dict[str, Any]) -> dict[str, Any]:
    """A loader transform: the sample's key and the digest of its bytes."""
    return {"__key__": sample["__key__"], "sha": hashlib.sha256(sample["bin"]).hexdigest()[:16]}


def collate(batch: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """A collate function: (keys, digests)."""
    return [s["__key__"] for s in batch], [s["sha"] for s in batch]


def build(url: str, count: int, shard_samples: int, options: dict[str, Any] | None = None) -> int:
    """Write the dataset of ``count`` samples in WebDataset shards of ``shard_samples`` to
    ``url`` (once: kept when its manifest has ``count`` samples); return its shard bytes."""
    import fastload
    from fastload.formats import Manifest, ShardEntry, get_format, read_manifest, write_manifest

    store = fastload.open_store(url, **(options or {}))
    if store.exists("fastload.json"):
        manifest = read_manifest(store)
        if manifest.num_samples == count:
            return int(manifest.num_bytes)
    fmt = get_format("webdataset")
    entries = []
    for s in range(0, count, shard_samples):
        writer = fmt.writer(store, f"shard-{s // shard_samples:06d}.{fmt.extension}")
        for i in range(s, min(count, s + shard_samples)):
            writer.write({"__key__": f"s{i:06d}", "bin": payload(i)})
        entries.append(ShardEntry.from_info(writer.close()))
    manifest = Manifest(format=fmt.name, shards=entries)
    write_manifest(store, manifest)
    return int(manifest.num_bytes)
