"""Files found to hold the bytes a manifest lists, remembered by every process of a process tree.

A reader that hashes a shard to trust it (the LMDB reader, for shards of small values) records
here that the file, as identified by its ``stat``, matched the manifest's SHA-256. Every process
forked later from one that imported this module (a DataLoader's workers, this epoch's and the
next's) finds the record and skips the hash: a dataset is hashed about once per process tree, not
once per worker and epoch (at 10^8 samples in 1,000 LMDB shards: ~8 s of CPU, against ~8 s per
worker per epoch before).

The records live in a table of :data:`SLOTS` 64-bit words (1 MiB) in one anonymous shared memory
mapping made at import, which ``fork`` shares and which holds no file descriptor. A word is a
64-bit digest of the file's identity (device, inode, size, modification and change times) and
the manifest's hash; it is found by probing :data:`PROBES` slots from the digest's own. Writes of
aligned words are atomic, and the worst a race can do is lose a record (the file is hashed again).
Processes started otherwise (``spawn``) each have their own table.

Across runs, a match is also recorded as an empty file (``<digest>.ok``) in the directory of the
parsed index files (:mod:`~fastload.formats._index_files`; not where those are turned off), named
by a 128-bit digest of the same identity and hash: a later run on the machine finds it with one
``stat`` and does not hash the file either.

A record is made only when the file's modification time is at least
:data:`~fastload.formats._index_cache.STABLE_AGE_NS` older than the hash (a change within the
file system's timestamp granularity could keep the time: Git's "racy" rule, as for parsed indexes
and open LMDB environments). A file written again gets new times (the change time cannot be set
back), so its old record no longer applies.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import time

import numpy as np

from fastload.formats import _index_files
from fastload.formats._index_cache import settled, stamp_from
from fastload.formats._index_files import MARK

__all__ = ["PROBES", "SLOTS", "known", "remember"]

#: Words in the table.
SLOTS = 1 << 17
#: Slots probed for a digest before the first of them is overwritten.
PROBES = 8

_MAP = mmap.mmap(-1, SLOTS * 8)  # anonymous and shared: forked children see the same pages
_TABLE = np.frombuffer(_MAP, dtype=np.uint64)


def _who(st: os.stat_result, sha256: str) -> bytes:
    """The file's identity (its :class:`~fastload.formats._index_cache.FileStamp`) and the hash."""
    return ":".join(map(str, (*stamp_from(st), sha256))).encode()


def _digest(st: os.stat_result, sha256: str) -> int:
    word = int.from_bytes(hashlib.blake2b(_who(st, sha256), digest_size=8).digest(), "little")
    return word | 1  # never 0, the empty slot


def _slots(word: int) -> list[int]:
    first = word % SLOTS
    return [(first + i) % SLOTS for i in range(PROBES)]


def _marker(st: os.stat_result, sha256: str) -> str | None:
    """The path of the file that records the match across runs, or ``None`` (files off)."""
    where = _index_files.directory()
    if where is None:
        return None
    return str(where / (hashlib.blake2b(_who(st, sha256), digest_size=16).hexdigest() + MARK))


def known(st: os.stat_result, sha256: str) -> bool:
    """Whether a process of this tree, or of an earlier run on this machine, found the file
    ``st`` describes to hash to ``sha256``."""
    word = np.uint64(_digest(st, sha256))
    if any(_TABLE[slot] == word for slot in _slots(int(word))):
        return True
    marker = _marker(st, sha256)
    if marker is None or not os.path.exists(marker):
        return False
    _remember_here(int(word))
    return True


def _remember_here(word: int) -> None:
    slots = _slots(word)
    for slot in slots:
        if _TABLE[slot] in (0, word):
            _TABLE[slot] = word
            return
    _TABLE[slots[0]] = word


def remember(st: os.stat_result, sha256: str, at_ns: int | None = None) -> bool:
    """Record that the file ``st`` describes hashed to ``sha256`` (hashed at ``at_ns``, by
    ``time.time_ns()``: now when not given); whether it was recorded (not for a file modified
    less than :data:`~fastload.formats._index_cache.STABLE_AGE_NS` before the hash)."""
    if not settled(stamp_from(st), time.time_ns() if at_ns is None else at_ns):
        return False
    _remember_here(_digest(st, sha256))
    marker = _marker(st, sha256)
    if marker is not None:
        _index_files.mark(marker)
    return True
