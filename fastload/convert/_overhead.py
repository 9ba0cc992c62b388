"""When WebDataset's tar framing outweighs the data: a warning naming the formats that do not.

A tar member costs a 512-byte header, and its data is padded to a multiple of 512 bytes, so a
sample of small fields (a JSON line, a short caption, a label) takes about 0.75 KiB per field in
a WebDataset shard, against tens of bytes of framing per record in TFRecord and LMDB (a JSONL
corpus of short records: 6.1 MB as WebDataset, 548 KB as TFRecord). ``convert`` warns when the
framing is most of the shards' bytes and that is worth a user's attention (at least
:data:`WARN_BYTES` of it): once from the plan of the first shard (an estimate), else once from
the finished dataset (measured: one header per field, counted in the manifest's schema).
"""

from __future__ import annotations

from collections.abc import Sequence

from fastload.convert._progress import format_bytes, plural
from fastload.convert.sources import Unit
from fastload.formats import Manifest

__all__ = ["WARN_BYTES", "WARN_FRACTION", "measured_tar_overhead", "planned_tar_overhead"]

#: Warn when tar framing is more than this fraction of the shards' bytes ...
WARN_FRACTION = 0.5
#: ... and at least this many bytes (a tiny dataset's framing costs nothing worth saying).
WARN_BYTES = 1_000_000
_HEADER = 512
_MEAN_PADDING = 256  # data padded to 512 bytes: half a block per member, on average
_ADVICE = (
    "TFRecord and LMDB frame a record in tens of bytes: pass --format tfrecord or --format lmdb "
    "(format='tfrecord' or 'lmdb') for shards several times smaller; WebDataset pays off for "
    "samples of tens of KB and more (images, audio)"
)


def planned_tar_overhead(units: Sequence[Unit]) -> str | None:
    """The warning for WebDataset shards planned from ``units`` (the first shard's), or ``None``.

    The estimate counts a header and half a block of padding per field; a source that does not
    know its records' field count (JSON Lines) counts one, so the estimate errs low.
    """
    if not units:
        return None
    payload = sum(u.size for u in units)
    fields = sum(max(1, u.nfields) for u in units)
    framing = fields * (_HEADER + _MEAN_PADDING)
    if framing < WARN_BYTES or framing <= WARN_FRACTION * (framing + payload):
        return None
    ratio = (framing + payload) / max(1, payload)
    return (
        f"the first shard's {plural(len(units), 'sample')} hold {payload / len(units):.0f} bytes "
        f"of data each on average; as WebDataset (tar) members each field costs a 512-byte header and pads its data to a multiple of 512 "
        f"bytes, so the shards will be about {ratio:.0f}x the data "
        f"(~{format_bytes(framing)} of framing in this shard). {_ADVICE}"
    )


def measured_tar_overhead(manifest: Manifest) -> str | None:
    """The warning for a finished WebDataset dataset, from its manifest, or ``None``.

    Every field of every sample is one tar member with a 512-byte header (counted: the schema
    counts the fields); its padding to 512 bytes is estimated at half a block per member.
    """
    members = sum(int(s.get("count", 0)) for s in manifest.schema.values())
    framing = members * (_HEADER + _MEAN_PADDING)
    total = manifest.num_bytes
    if total <= 0 or framing < WARN_BYTES or framing <= WARN_FRACTION * total:
        return None
    headers = members * _HEADER
    return (
        f"{headers / total:.0%} of the {format_bytes(total)} of these WebDataset shards are tar "
        f"headers alone ({plural(members, 'member')} for {plural(manifest.num_samples, 'sample')}, "
        f"512 bytes each), and each member's data is padded to a multiple of 512 bytes on top "
        f"(about {format_bytes(members * _MEAN_PADDING)} more). {_ADVICE}"
    )
