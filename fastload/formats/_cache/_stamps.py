"""What identifies a file's contents without reading them, and when that identity can be trusted.

A result derived from a file (a parsed index, a hash, an open LMDB environment) is reused only
while the file's :class:`FileStamp` is the same and the file was :func:`settled` when the result
was made: its modification time at least :data:`STABLE_AGE_NS` older (a change within the file
system's timestamp granularity could keep the time; Git's "racy" rule).
"""

from __future__ import annotations

import os
from typing import NamedTuple

__all__ = ["STABLE_AGE_NS", "FileStamp", "settled", "stamp_from", "stamp_of"]

#: How much older than a parse (or an opening, or a hash) a file's modification time must be for
#: the result to be reused without reading the file again.
STABLE_AGE_NS = 2_000_000_000


class FileStamp(NamedTuple):
    """What identifies a file's contents without reading them (``os.stat`` fields; the change
    time moves whenever the file is written or replaced and cannot be set back)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int


def stamp_of(path: str) -> FileStamp:
    """``path``'s :class:`FileStamp`.

    Raises:
        OSError: The file cannot be stat'ed.
    """
    return stamp_from(os.stat(path))


def stamp_from(st: os.stat_result) -> FileStamp:
    """The :class:`FileStamp` of a ``stat`` result (e.g. an ``fstat`` of an open file)."""
    return FileStamp(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def settled(stamp: FileStamp, at_ns: int) -> bool:
    """Whether a file last modified at ``stamp.mtime_ns`` cannot have changed, at ``at_ns``,
    without its modification time moving (it is at least :data:`STABLE_AGE_NS` older)."""
    return stamp.mtime_ns <= at_ns - STABLE_AGE_NS
