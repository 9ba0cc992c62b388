"""Shard formats: WebDataset (tar), TFRecord and LMDB, one sample model, the dataset manifest.

Formats read and write shards through a :class:`~fastload.storage.Store`; they do not know where
the bytes live, and nothing here imports torch. Each format's ``README.md`` is its on-disk spec.
"""

from fastload.formats._base import (
    DAMAGED_SHARD_REMEDY,
    FORMATS,
    ErrorPolicy,
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
from fastload.formats._mmap import local_file, map_file
from fastload.formats._names import ShardNames
from fastload.formats._sample import (
    KEY,
    Codec,
    Sample,
    decode_field,
    decode_sample,
    encode_field,
    encode_sample,
    register_codec,
    validate_field_name,
)
from fastload.formats.manifest import (
    MANIFEST_NAME,
    Manifest,
    ShardEntry,
    read_manifest,
    write_manifest,
)

__all__ = [
    "local_file",
    "map_file",
    "DAMAGED_SHARD_REMEDY",
    "FORMATS",
    "KEY",
    "MANIFEST_NAME",
    "CacheConfig",
    "Codec",
    "ErrorPolicy",
    "EnvBudget",
    "Format",
    "IndexBudget",
    "Manifest",
    "OnError",
    "ReaderOptions",
    "Sample",
    "ShardEntry",
    "ShardInfo",
    "ShardNames",
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
    "validate_field_name",
    "write_manifest",
]
