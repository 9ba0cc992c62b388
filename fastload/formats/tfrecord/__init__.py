"""TFRecord shards of ``tf.train.Example`` records, readable by TensorFlow and DALI.

The on-disk spec, including the field → Feature mapping and a ``tf.io.parse_single_example``
feature spec, is ``README.md`` beside this file. Public names:

* :class:`TFRecordWriter` / :class:`TFRecordReader`: the shard writer and reader.
* :func:`build_index`: DALI ``tfrecord2idx``-identical index bytes for an existing shard.
* :func:`detect`: whether a file's first bytes look like a (possibly compressed) TFRecord file.
* :data:`FORMAT`: the :class:`~fastload.formats.Format` registered as ``"tfrecord"``.
"""

from __future__ import annotations

from fastload.formats._base import Format
from fastload.formats.tfrecord._compression import detect_compression
from fastload.formats.tfrecord._index import build_index
from fastload.formats.tfrecord._reader import TFRecordReader
from fastload.formats.tfrecord._writer import TFRecordWriter

__all__ = [
    "FORMAT",
    "TFRecordReader",
    "TFRecordWriter",
    "build_index",
    "detect",
    "detect_compression",
]


def detect(head: bytes) -> bool:
    """True if ``head`` (a file's first bytes; 12 are enough for plain files, a few dozen for
    compressed ones) starts like a TFRecord file: a record header whose length CRC matches, or a
    gzip/zlib stream that decompresses to one. An empty ``head`` is not detected."""
    if not head:
        return False
    plausible, _compression = detect_compression(bytes(head))
    return plausible


FORMAT = Format(
    name="tfrecord",
    extension="tfrecord",
    writer=TFRecordWriter,
    reader=TFRecordReader,
    build_index=build_index,
    detect=detect,
    # With TensorFlow's whole-file GZIP and ZLIB compression too.
    source_extensions=tuple(
        base + suffix
        for base in ("tfrecord", "tfrecords")
        for suffix in ("", ".gz", ".gzip", ".zz", ".zlib")
    ),
)
