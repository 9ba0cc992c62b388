"""Shard formats: WebDataset (tar), TFRecord and LMDB, one sample model, the dataset manifest.

Formats read and write shards through a :class:`~fastload.storage.Store`; they do not know where
the bytes live, and nothing here imports torch. Each format's ``README.md`` is its on-disk spec.
"""

from fastload.formats._base import (
    DAMAGED_SHARD_REMEDY,
    Format,
    OnError,
    ReaderOptions,
    ShardInfo,
    ShardReader,
    ShardWriter,
    get_format,
)
from fastload.formats._cache import CacheConfig, EnvBudget, IndexBudget
from fastload.formats._cache import config as cache_config
from fastload.formats._cache import set_config as set_cache_config
from fastload.formats._sample import (
    Codec,
    Sample,
    decode_field,
    decode_sample,
    encode_field,
    encode_sample,
    register_codec,
)
from fastload.formats.manifest import (
    MANIFEST_NAME,
    Manifest,
    ShardEntry,
    read_manifest,
    write_manifest,
)

__all__ = [
    "DAMAGED_SHARD_REMEDY",
    "MANIFEST_NAME",
    "CacheConfig",
    "Codec",
    "EnvBudget",
    "Format",
    "IndexBudget",
    "Manifest",
    "OnError",
    "ReaderOptions",
    "Sample",
    "ShardEntry",
    "ShardInfo",
    "ShardReader",
    "ShardWriter",
    "cache_config",
    "decode_field",
    "decode_sample",
    "encode_field",
    "encode_sample",
    "get_format",
    "read_manifest",
    "register_codec",
    "set_cache_config",
    "write_manifest",
]
