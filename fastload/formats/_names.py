"""Shard file names as the format registry defines them.

Which formats exist, their shard extensions (``Format.extension``) and the names their files go by
as a source (``Format.source_extensions``: ``x.tgz``, ``x.tar.gz``, ``x.tfrecords``, ...) come from
:data:`fastload.formats._base.FORMATS`, so a format registered there (built in or through the
``fastload.formats`` entry points) is known to ``convert``, ``index`` and source detection alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastload.errors import MissingDependencyError
from fastload.formats._base import FORMATS, Format, get_format

__all__ = ["ShardNames", "registered_formats"]


def registered_formats() -> list[Format]:
    """Every registered format that can be loaded, in name order. A third-party format whose
    dependencies are missing is left out: no shard of it can be read or written here anyway."""
    formats: list[Format] = []
    for name in FORMATS.names():
        try:
            formats.append(get_format(name))
        except MissingDependencyError:
            continue
    return formats


class ShardNames:
    """The format a file name says, by the suffixes the formats declare.

    The longest declared suffix that ends a name wins (``x.tar.gz``: ``tar.gz``), and a name must
    have something before its suffix (``tar.gz`` alone is no shard). Matching ignores case.
    Build one per listing (:meth:`from_registry`), not per name: it loads every format.

    Args:
        formats: The formats, earlier ones first where two declare the same suffix.
    """

    def __init__(self, formats: Sequence[Format]) -> None:
        self.formats = list(formats)
        self._by_suffix: dict[str, str] = {}
        for fmt in self.formats:
            for suffix in fmt.source_extensions:
                self._by_suffix.setdefault(suffix.lower(), fmt.name)
        self._most_parts = max((s.count(".") + 1 for s in self._by_suffix), default=0)

    @classmethod
    def from_registry(cls) -> ShardNames:
        """The names of every format in :data:`~fastload.formats._base.FORMATS`."""
        return cls(registered_formats())

    def format_of(self, name: str) -> str | None:
        """The canonical format name that file ``name`` (a key or path) says, or ``None``."""
        parts = name.rsplit("/", 1)[-1].lower().split(".")
        for n in range(min(self._most_parts, len(parts) - 1), 0, -1):
            found = self._by_suffix.get(".".join(parts[-n:]))
            if found is not None:
                return found
        return None

    def extensions(self) -> list[str]:
        """The extensions of the shards the formats write (``tar``, ``tfrecord``, ...), sorted."""
        return sorted({fmt.extension for fmt in self.formats})
