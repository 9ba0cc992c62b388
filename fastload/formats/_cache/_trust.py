"""Files found to hold the bytes a manifest lists, remembered on the machine.

A reader that hashes a shard to trust it (the LMDB reader, for shards of small values) records
here that the file, as identified by its :class:`~fastload.formats._cache.FileStamp`, matched
the manifest's SHA-256. The record is an empty file (``<digest>.ok``) in the directory of the
parsed index files (:mod:`~fastload.formats._cache._files`), named by a 128-bit digest of the
file's identity (device, inode, size, modification and change times) and the hash. Every process
that reads the file later, a DataLoader's workers of this epoch and the next and later runs
alike, finds the record with one ``stat`` and skips the hash: a dataset is hashed about once per
machine, not once per worker and epoch (at 10^8 samples in 1,000 LMDB shards: ~8 s of CPU,
against ~8 s per worker per epoch without). Where the index files are turned off nothing is
recorded, and every process hashes the files it opens (once per process: LMDB environments stay
open, :mod:`~fastload.formats.lmdb._envs`).

A record is made only when the file's modification time is at least
:data:`~fastload.formats._cache.STABLE_AGE_NS` older than the hash (the racy rule, as for parsed
indexes and open LMDB environments). A file written again gets new times (the change time cannot
be set back), so its old record no longer applies.
"""

from __future__ import annotations

import hashlib
import os
import time

from fastload.formats._cache._files import MARK, index_files
from fastload.formats._cache._stamps import settled, stamp_from

__all__ = ["known", "remember"]


def _record(st: os.stat_result, sha256: str) -> str:
    """The record's file name: a digest of the file's identity and the hash."""
    who = ":".join(map(str, (*stamp_from(st), sha256))).encode()
    return hashlib.blake2b(who, digest_size=16).hexdigest() + MARK


def known(st: os.stat_result, sha256: str) -> bool:
    """Whether a process on this machine found the file ``st`` describes to hash to ``sha256``."""
    files = index_files()
    return files is not None and files.marked(_record(st, sha256))


def remember(st: os.stat_result, sha256: str, at_ns: int | None = None) -> bool:
    """Record that the file ``st`` describes hashed to ``sha256`` (hashed at ``at_ns``, by
    ``time.time_ns()``: now when not given); whether a record was made (not for a file modified
    less than :data:`~fastload.formats._cache.STABLE_AGE_NS` before the hash, nor where the
    index files are turned off)."""
    if not settled(stamp_from(st), time.time_ns() if at_ns is None else at_ns):
        return False
    files = index_files()
    if files is None:
        return False
    files.mark(_record(st, sha256))
    return True
