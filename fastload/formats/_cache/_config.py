"""The machine caches' settings: read once, from the environment, into an object code can set.

:func:`config` returns this process's :class:`CacheConfig`. It is made on first use from the
environment (:meth:`CacheConfig.from_environ`) and kept: later changes to ``os.environ`` are not
seen. Code and tests set another with :func:`set_config` (or, for a while, :func:`configured`).
Forked children inherit the parent's; processes started otherwise (``spawn``, another run) read
their own environment, so settings meant for every process of a job belong in the environment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CacheConfig", "EnvBudget", "IndexBudget", "config", "configured", "set_config"]

_DEFAULT_DIR_BYTES = 4 << 30


@dataclass(frozen=True)
class IndexBudget:
    """What one process keeps in parsed indexes (:mod:`~fastload.formats._cache._parsed`).

    Attributes:
        entries: Parsed indexes kept.
        nbytes: Their total size in bytes (their ``nbytes``).
    """

    entries: int
    nbytes: int


@dataclass(frozen=True)
class EnvBudget:
    """What one process keeps open in LMDB environments (:mod:`~fastload.formats.lmdb._envs`).

    Attributes:
        environments: Open environments (two file descriptors each).
        mapped_bytes: Total size of their files (each mapped twice).
    """

    environments: int
    mapped_bytes: int


def default_env_budget() -> EnvBudget:
    """1,024 environments, or fewer where the descriptor limit is low (their descriptors take at
    most half of ``RLIMIT_NOFILE``: 256 environments under the common soft limit of 1,024), and
    1 TiB of files (2 TiB of address space, under 2 % of a 64-bit process's)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    environments = 1024 if soft == resource.RLIM_INFINITY else max(16, min(1024, soft // 4))
    return EnvBudget(environments=environments, mapped_bytes=1 << 40)


@dataclass(frozen=True)
class CacheConfig:
    """Where and how much the machine caches keep.

    Attributes:
        index_dir: The directory of the parsed index files and trust records
            (:mod:`~fastload.formats._cache._files`); ``None`` turns both off.
        index_dir_bytes: The most that directory holds (files written or used longest ago are
            removed beyond it).
        parsed: What one process keeps in parsed indexes (65,536 within 1 GiB: a WebDataset
            index of two fields takes ~26 bytes a sample plus its key, a TFRecord index 4 bytes
            a record; twice that for shards of 4 GiB or more: 1 GiB holds ~2.9 x 10^7 and
            ~2.7 x 10^8 samples).
        envs: What one process keeps open in LMDB environments (:func:`default_env_budget`).
    """

    index_dir: Path | None
    index_dir_bytes: int = _DEFAULT_DIR_BYTES
    parsed: IndexBudget = IndexBudget(entries=65_536, nbytes=1 << 30)
    envs: EnvBudget = field(default_factory=default_env_budget)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> CacheConfig:
        """The settings the environment gives (``os.environ`` when ``environ`` is ``None``):

        * ``FASTLOAD_INDEX_DIR``: :attr:`index_dir` (an empty value turns it off); else
          ``$XDG_CACHE_HOME/fastload/indexes``, else ``~/.cache/fastload/indexes``;
        * ``FASTLOAD_INDEX_CACHE_BYTES``: :attr:`index_dir_bytes` (default 4 GiB; a value that
          is not an integer keeps the default).
        """
        env = os.environ if environ is None else environ
        value = env.get("FASTLOAD_INDEX_DIR")
        where: Path | None
        if value is not None:
            where = Path(value) if value else None
        else:
            base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
            where = Path(base) / "fastload" / "indexes"
        try:
            nbytes = int(env.get("FASTLOAD_INDEX_CACHE_BYTES", _DEFAULT_DIR_BYTES))
        except ValueError:
            nbytes = _DEFAULT_DIR_BYTES
        return cls(index_dir=where, index_dir_bytes=nbytes)


class _Current:
    """This process's settings (``None`` until first read)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.value: CacheConfig | None = None


_CURRENT = _Current()


def config() -> CacheConfig:
    """This process's settings, read from the environment on first use (see module doc)."""
    value = _CURRENT.value
    if value is None:
        with _CURRENT.lock:
            if _CURRENT.value is None:
                _CURRENT.value = CacheConfig.from_environ()
            value = _CURRENT.value
    return value


def set_config(new: CacheConfig | None) -> CacheConfig | None:
    """Use ``new`` from now on in this process (``None``: read the environment again at the next
    use); returns the settings in use before (``None`` if none had been read)."""
    with _CURRENT.lock:
        old, _CURRENT.value = _CURRENT.value, new
    return old


@contextlib.contextmanager
def configured(**changes: Any) -> Iterator[CacheConfig]:
    """The current settings with ``changes`` (fields of :class:`CacheConfig`) for the duration
    of the ``with`` block, then the previous ones again."""
    new = dataclasses.replace(config(), **changes)
    old = set_config(new)
    try:
        yield new
    finally:
        set_config(old)
