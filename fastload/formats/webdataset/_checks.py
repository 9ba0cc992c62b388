"""The check every random read of a WebDataset shard makes: is the member's tar header where
the index says, and does it say what the index says (so a stale index raises, not wrong bytes)."""

from __future__ import annotations

from fastload.errors import CorruptDataError, FormatError
from fastload.formats.webdataset._compact import Component
from fastload.formats.webdataset._tar import BLOCK, checksum_ok, parse_octal

__all__ = ["check_indexed_header"]


def check_indexed_header(comp: Component, hdr: bytes, i: int, url: str) -> str:
    """Verify the ustar header ``hdr`` in front of member ``comp`` of index line ``i + 2`` of
    shard ``url``; return the member's name.

    Raises:
        CorruptDataError: The header is not a regular file's, or its size or name differ from
            the index (damaged bytes or a stale index).
        FormatError: A v1.1 index line whose member name only the header could give, and
            cannot.
    """
    stale = (
        "; the shard's bytes are damaged or the index is stale (`fastload verify` tells which; "
        "`fastload index` rebuilds a stale index)"
    )
    if len(hdr) != BLOCK or not checksum_ok(hdr) or hdr[156:157] not in (b"0", b"\0", b"7"):
        raise CorruptDataError(
            f"index line {i + 2}: no regular-file tar header in front of the data of "
            f"{comp.name or comp.ext!r}{stale}",
            url=url,
            offset=comp.offset - BLOCK,
        )
    try:
        size = parse_octal(hdr[124:136])
    except ValueError:
        raise CorruptDataError(
            f"index line {i + 2}: the tar header in front of the data of "
            f"{comp.name or comp.ext!r} has an invalid size field{stale}",
            url=url,
            offset=comp.offset - BLOCK,
        ) from None
    raw = hdr[0:100].split(b"\0", 1)[0]
    if hdr[345] != 0 and hdr[257:263] == b"ustar\x00":
        raw = hdr[345:500].split(b"\0", 1)[0] + b"/" + raw
    header_name = raw.decode("utf-8", "surrogateescape")
    if size != comp.size and not (size == 0 and comp.size > 0o77777777777):
        raise CorruptDataError(
            f"index line {i + 2} gives {comp.size} bytes for {comp.name or comp.ext!r} but "
            f"its tar header says {size}{stale}",
            url=url,
            offset=comp.offset - BLOCK,
        )
    if not comp.name:  # v1.1 index: the header is the only source of the name
        if header_name.endswith("." + comp.ext) and len(raw) < 100:
            return header_name
        raise FormatError(
            f"index line {i + 2} (v1.1, no member names) points at member "
            f"{header_name!r}, whose full name the header cannot give; rebuild the index "
            "with `fastload index` (v1.2)",
            url=url,
            offset=comp.offset - BLOCK,
        )
    if header_name != comp.name and len(comp.name.encode("utf-8", "surrogateescape")) <= 100:
        raise CorruptDataError(
            f"index line {i + 2} names member {comp.name!r} but the tar header there "
            f"names {header_name!r}{stale}",
            url=url,
            offset=comp.offset - BLOCK,
        )
    return comp.name
