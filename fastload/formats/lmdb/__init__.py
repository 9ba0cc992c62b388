"""LMDB shards: one single-file LMDB environment per shard, readable with py-lmdb and msgpack alone.

Key = the sample's ``__key__`` in UTF-8, value = a msgpack map of field name → bytes; insertion
order, the sample count and the layout version live under reserved keys that begin with a NUL byte.
The on-disk specification is this package's ``README.md``.
"""

from fastload.formats._base import Format
from fastload.formats.lmdb._layout import (
    FORMAT_VERSION,
    META_KEY,
    POSITION_PREFIX,
    RESERVED_PREFIX,
    position_key,
)
from fastload.formats.lmdb._pages import detect
from fastload.formats.lmdb._reader import LMDBReader
from fastload.formats.lmdb._writer import LMDBWriter

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "META_KEY",
    "POSITION_PREFIX",
    "RESERVED_PREFIX",
    "LMDBReader",
    "LMDBWriter",
    "detect",
    "position_key",
]

#: The ``lmdb`` format as registered in :data:`fastload.formats._base.FORMATS`.
FORMAT = Format(
    name="lmdb",
    extension="lmdb",
    writer=LMDBWriter,
    reader=LMDBReader,
    build_index=None,
    detect=detect,
)
