"""The machine caches of the formats: one package, one settings object.

* :mod:`._config`: :class:`CacheConfig`, read once from the environment (:func:`config`), set by
  code and tests (:func:`set_config`, :func:`configured`);
* :mod:`._stamps`: a file's identity (:class:`FileStamp`) and the racy rule (:func:`settled`);
* :mod:`._files`: parsed indexes kept as files every process maps (:class:`IndexFiles`: the
  directory, its budget and its trimming);
* :mod:`._parsed`: parsed indexes kept per process (:func:`cached`);
* :mod:`._trust`: files found to match a manifest's hash, recorded in the same directory
  (:func:`known`, :func:`remember`).

LMDB's open environments are a table of their own (:mod:`fastload.formats.lmdb._envs`), bounded
by :attr:`CacheConfig.envs`.
"""

from fastload.formats._cache._config import (
    CacheConfig,
    EnvBudget,
    IndexBudget,
    config,
    configured,
    set_config,
)
from fastload.formats._cache._files import IndexFiles, index_files
from fastload.formats._cache._parsed import Codec, cached, clear, held_bytes, parse_count
from fastload.formats._cache._stamps import (
    STABLE_AGE_NS,
    FileStamp,
    settled,
    stamp_from,
    stamp_of,
)
from fastload.formats._cache._trust import known, remember

__all__ = [
    "STABLE_AGE_NS",
    "CacheConfig",
    "Codec",
    "EnvBudget",
    "FileStamp",
    "IndexBudget",
    "IndexFiles",
    "cached",
    "clear",
    "config",
    "configured",
    "held_bytes",
    "index_files",
    "known",
    "parse_count",
    "remember",
    "set_config",
    "settled",
    "stamp_from",
    "stamp_of",
]
