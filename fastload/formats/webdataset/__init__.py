"""WebDataset shards: POSIX tar archives whose members are ``KEY.FIELD``, grouped by sample.

Readable by the ``webdataset`` library, GNU tar and DALI's ``fn.readers.webdataset`` (with the
``<shard>.idx`` index this package writes). The on-disk layout is specified in this package's
``README.md``.
"""

from __future__ import annotations

from fastload.formats._base import Format
from fastload.formats.webdataset._compressed import HEAD_BYTES, compressed_name, compression_of
from fastload.formats.webdataset._source import open_shard
from fastload.formats.webdataset._tar import BLOCK, checksum_ok
from fastload.formats.webdataset.index import build_index, format_index, parse_index
from fastload.formats.webdataset.reader import WebDatasetReader
from fastload.formats.webdataset.writer import WebDatasetWriter

__all__ = [
    "BLOCK",
    "FORMAT",
    "HEAD_BYTES",
    "WebDatasetReader",
    "WebDatasetWriter",
    "build_index",
    "compressed_name",
    "compression_of",
    "detect",
    "format_index",
    "open_shard",
    "parse_index",
]


def detect(head: bytes) -> bool:
    """Whether ``head`` (a shard's first bytes, at least 512) starts with a POSIX/GNU tar header.

    Checks the ``ustar`` magic and the header checksum. An archive with no members (only the
    end-of-archive zero blocks) is not recognised.
    """
    return len(head) >= BLOCK and head[257:262] == b"ustar" and checksum_ok(head[:BLOCK])


FORMAT = Format(
    name="webdataset",
    extension="tar",
    writer=WebDatasetWriter,
    reader=WebDatasetReader,
    build_index=build_index,
    detect=detect,
    # Compressed tars too, as the webdataset library reads them.
    source_extensions=("tar", "tar.gz", "tgz", "tar.bz2", "tbz", "tbz2", "tar.xz", "txz"),
)
