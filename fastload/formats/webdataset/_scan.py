"""The streaming member scanner of a tar shard: members in order, and each problem found.

:func:`scan` walks the archive block by block over any :class:`~._view.ShardView` (a memory map,
bytes, or a :class:`~._view.StreamView` over a stream), applying pax and GNU extension headers and
resuming after damage; the header fields themselves are parsed by :mod:`._tar`.
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from fastload.errors import CorruptDataError
from fastload.formats.webdataset._tar import BLOCK, ZERO_BLOCK, checksum_ok, parse_octal, parse_pax
from fastload.formats.webdataset._view import ShardView

__all__ = [
    "DIRECTORY",
    "OTHER",
    "REGULAR",
    "Bad",
    "Member",
    "scan",
]

# Member kinds as the scanner reports them.
REGULAR, DIRECTORY, OTHER = 0, 1, 2
_TYPE_NAMES = {
    b"1": "hard link",
    b"2": "symbolic link",
    b"3": "character device",
    b"4": "block device",
    b"6": "FIFO",
    b"S": "GNU sparse file",
    b"D": "GNU dump directory",
    b"M": "GNU multi-volume continuation",
    b"N": "old GNU long-name entry",
}


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


#: One member as :func:`scan` yields it (a plain tuple, for speed):
#: ``(name, kind, type_name, header_offset, data_offset, size, data)``.
#:
#: * ``name``: the member path (pax ``path`` or GNU long name applied), decoded as UTF-8 with
#:   ``surrogateescape``;
#: * ``kind``: ``REGULAR``, ``DIRECTORY`` or ``OTHER`` (links, devices, FIFOs, ...);
#: * ``type_name``: human-readable entry type, for messages;
#: * ``header_offset``: byte offset of the member's first header block (its pax/GNU header if any);
#: * ``data_offset``: byte offset of its data (its ustar header's offset + 512);
#: * ``size``: data size in bytes, without padding;
#: * ``data``: the data when the scanner was asked for it and the member is a regular file.
Member = tuple[str, int, str, int, int, int, bytes | None]


@dataclass(slots=True)
class Bad:
    """A problem the scanner found; ``fatal`` means scanning stopped after it.

    ``lost_next``: the name of the next member cannot be trusted or the member before it was
    lost, so the sample the next member belongs to may be incomplete. ``member``: for a
    truncation inside a member's data, that member's name (its header was read intact), so the
    members before it are known to be complete.
    """

    error: CorruptDataError
    fatal: bool
    lost_next: bool = False
    member: str | None = None


_REGULAR_FLAGS = (0x30, 0, 0x37)  # "0", NUL (old tars), "7" (contiguous file)
_META_FLAGS = (0x78, 0x67, 0x4C, 0x4B)  # "x", "g", "L", "K"
_NO_DATA_FLAGS = (0x31, 0x32, 0x33, 0x34, 0x35, 0x36)  # "1".."6"
_CHK_CACHE: dict[bytes, int] = {}


def _expected_adler(field: bytes) -> int:
    """For a checksum field, the low half of ``adler32(header)`` that a valid header has.

    ``adler32``'s low half is ``1 + sum(bytes) mod 65521``; a header whose unsigned checksum is
    right has ``1 + field_sum - 256 + stored`` there. Cached per field value (-1: unparsable).
    """
    expected = _CHK_CACHE.get(field)
    if expected is None:
        try:
            stored = parse_octal(field)
        except ValueError:
            stored = -1
        expected = -1 if not 0 <= stored < 2 * 65521 else (1 + sum(field) - 256 + stored) % 65521
        if len(_CHK_CACHE) < 1 << 16:
            _CHK_CACHE[field] = expected
    return expected


#: Blocks in front of the header found after a corrupt one that are kept to tell whether the
#: corrupt one was a pax/GNU header (8 KiB: a pax body holds a path of at most 4 KiB).
_META_BLOCKS = 16


def _extension_body(blocks: deque[bytes], hdr: bytes) -> bool:
    """Whether the blocks right in front of ``hdr`` (the valid header found after a corrupt one)
    look like the body of a pax or GNU long-name header: then the corrupt header was most likely
    that extension header, and ``hdr`` is the member it described, under a stand-in name."""
    for n in range(1, len(blocks) + 1):
        body = b"".join(list(blocks)[-n:]).rstrip(b"\0")
        if not body:
            continue
        if hdr[99] and body.startswith(hdr[:100]) and b"\0" not in body:
            return True  # a GNU long name: its first 100 bytes are the stand-in name
        try:
            if parse_pax(body):
                return True
        except ValueError:
            pass
    return False


def _first_nonzero(shard: ShardView, start: int) -> int | None:
    """The offset of the first block at or after ``start`` (a block boundary) that is not all
    zeros, or ``None``. Reads block by block, so that :class:`StreamView` can hand the block
    found to the next read again."""
    pos, size = start, len(shard)
    while pos < size:
        if shard[pos : pos + BLOCK].strip(b"\0"):
            return pos
        pos += BLOCK
    return None


def _truncated(url: str, offset: int, what: str, member: str | None = None) -> Bad:
    return Bad(
        CorruptDataError(
            f"tar archive ends {what}; the shard is truncated, re-create or re-download it",
            url=url,
            offset=offset,
        ),
        fatal=True,
        member=member,
    )


def _data_truncated(url: str, name: str, data_offset: int, size: int, found: int) -> Bad:
    """The shard ends ``found`` bytes into the ``size`` bytes of data of member ``name``."""
    return _truncated(
        url,
        data_offset + found,
        f"inside member {name!r}, which declares {size} bytes at byte offset {data_offset}",
        name,
    )


def scan(
    shard: ShardView,
    url: str,
    *,
    start: int = 0,
    want_data: bool = True,
) -> Iterator[Member | Bad]:
    """Yield the members of a tar shard in order (see :data:`Member`), and :class:`Bad` for each
    problem found.

    Every member's data is one slice of ``shard``, so with a memory-mapped file it is copied
    once, from the page cache into the ``bytes`` returned. Slices come in increasing order.

    Args:
        shard: The shard's bytes (see :class:`ShardView`).
        url: The shard URL, for messages.
        start: Byte offset to start at (a header boundary).
        want_data: Read regular members' data; else skip over it (``data`` is ``None``).

    Scanning ends at a zero block that only zeros follow (the end of the archive). Zero blocks
    with data after them are headers that were wiped (a lost page reads back as zeros), and are
    reported like a header with a bad checksum: after one, the scanner looks for the next valid
    ustar header block by block and continues from there (``Bad.fatal`` False, ``lost_next``
    True). A member whose name cannot be trusted is passed over, not yielded: the one after a
    malformed pax header, a GNU long-name header with an empty name, or a lost pax/GNU header
    (recognised by its type flag, or by the pax/long-name body right in front of the header
    found). A truncated archive yields a fatal :class:`Bad` and stops.
    """
    adler = zlib.adler32
    cache_get = _CHK_CACHE.get
    size = len(shard)
    pos = start
    long_name: bytes | None = None
    pax: dict[bytes, bytes] = {}
    global_pax: dict[bytes, bytes] = {}
    meta_offset: int | None = None  # offset of the first pax/GNU block of the pending member
    pending = False  # pax/GNU headers apply to the next member: meta_offset or global_pax set
    drop_next = False  # the next member's name cannot be trusted; pending is set with it
    while True:
        hdr = shard[pos : pos + BLOCK]
        if len(hdr) != BLOCK:
            yield _truncated(
                url, pos, "inside a header block" if hdr else "without the end-of-archive blocks"
            )
            return
        # Fast path for the common member: a regular file ("0") with a valid checksum, a plain
        # octal size, a UTF-8 name in the name field alone, and no pax/GNU header before it.
        # Anything else, and any problem, goes through the general code below.
        if (
            want_data
            and hdr[156] == 0x30
            and not pending
            and not hdr[135]
            and not hdr[345]
            and (adler(hdr) & 0xFFFF) == cache_get(hdr[148:156])
        ):
            end = hdr.find(0, 0, 100)
            if end > 0:
                try:
                    name = hdr[:end].decode()
                    msize = int(hdr[124:135], 8)
                except ValueError:
                    msize = -1
                if msize >= 0:
                    data_offset = pos + BLOCK
                    data = shard[data_offset : data_offset + msize]
                    if len(data) != msize:
                        yield _data_truncated(url, name, data_offset, msize, len(data))
                        return
                    yield (name, REGULAR, "regular file", pos, data_offset, msize, data)
                    pos = data_offset + msize + (-msize % BLOCK)
                    continue
        chk = hdr[148:156]
        expected = cache_get(chk)
        if expected is None:
            expected = _expected_adler(chk)
        if (adler(hdr) & 0xFFFF) != expected and not checksum_ok(hdr):
            bad_at = pos
            if hdr == ZERO_BLOCK:
                # The end of the archive: only zeros follow (not read when at most the second
                # end block can follow: no member could start there).
                more = None if pos + 2 * BLOCK >= size else _first_nonzero(shard, pos + BLOCK)
                if more is None:
                    return
                # Zero blocks with more archive after them are headers that were wiped (a lost
                # page reads back as zeros), not the end: reading them as the end would drop
                # every later member without a word.
                problem = (
                    f"{more - pos} zero bytes where a tar header belongs, with more archive "
                    f"after them (from byte offset {more}): tar headers were wiped, so the "
                    "members they described are lost"
                )
                pos = more - BLOCK  # resynchronise from the first block after the zeros
            else:
                problem = (
                    "tar header checksum mismatch (corrupt or not a tar archive); the member "
                    "at this offset is lost"
                )
            yield Bad(
                CorruptDataError(
                    f"{problem}; the shard is damaged, re-create or re-download it",
                    url=url,
                    offset=bad_at,
                ),
                fatal=False,
                lost_next=True,
            )
            long_name, pax, meta_offset = None, {}, None
            # A lost pax/GNU header leaves its member with the stand-in name of its ustar
            # header (truncated, or with '?' for other characters): drop that member too.
            drop_next = hdr[156] in _META_FLAGS
            # Resynchronise: the next block that is a valid ustar header, or the end.
            zeros = 0
            skipped: deque[bytes] = deque(maxlen=_META_BLOCKS)  # the last blocks passed over
            while True:
                pos += BLOCK
                hdr = shard[pos : pos + BLOCK]
                if len(hdr) < BLOCK:
                    if zeros >= 2 and not hdr:
                        return
                    yield Bad(
                        CorruptDataError(
                            f"no valid tar header after the corrupt one at byte offset {bad_at} "
                            "up to the end of the shard, which lacks the end-of-archive blocks; "
                            "the shard is truncated or is not a tar archive",
                            url=url,
                            offset=pos,
                        ),
                        fatal=True,
                    )
                    return
                if hdr[257:262] == b"ustar" and checksum_ok(hdr):
                    break
                skipped.append(hdr)
                if hdr == ZERO_BLOCK:
                    zeros += 1
                    continue
                zeros = 0
            if not drop_next and hdr[156] not in _META_FLAGS:
                drop_next = _extension_body(skipped, hdr)
            pending = bool(global_pax) or drop_next
            continue

        typeflag = hdr[156]
        try:
            msize = int(hdr[124:135], 8) if hdr[135] in (0, 32) else parse_octal(hdr[124:136])
        except ValueError:
            try:
                msize = parse_octal(hdr[124:136])
            except ValueError:
                msize = -1
        if msize < 0:
            yield Bad(
                CorruptDataError(
                    f"tar header has an invalid size field {hdr[124:136]!r}", url=url, offset=pos
                ),
                fatal=True,
            )
            return
        if typeflag in _META_FLAGS:
            # Metadata for the next member: pax extended/global header, GNU long name/link.
            padded = msize + (-msize % BLOCK)
            body = shard[pos + BLOCK : pos + BLOCK + padded]
            if len(body) < padded:
                yield _truncated(url, pos, f"inside a {chr(typeflag)!r} extension header")
                return
            if meta_offset is None:
                meta_offset = pos
            pending = True
            body = body[:msize]
            if typeflag == 0x4C:  # "L"
                long_name = body.split(b"\0", 1)[0]
                if not long_name:
                    yield Bad(
                        CorruptDataError(
                            "GNU long-name header with an empty name; the member it describes "
                            "is lost, re-create or re-download the shard",
                            url=url,
                            offset=pos,
                        ),
                        fatal=False,
                        lost_next=True,
                    )
                    long_name, drop_next = None, True
            elif typeflag != 0x4B:  # "x" or "g"; "K" (GNU long link name) is not needed
                try:
                    records = parse_pax(body)
                    if records.get(b"path", b"x") == b"":
                        raise ValueError("its 'path' record is empty")
                except ValueError as exc:
                    yield Bad(
                        CorruptDataError(
                            f"malformed pax extended header: {exc}; the member it describes is "
                            "lost, re-create or re-download the shard",
                            url=url,
                            offset=pos,
                        ),
                        fatal=False,
                        lost_next=True,
                    )
                    records = {}
                    drop_next = drop_next or typeflag == 0x78  # pending is already set
                if typeflag == 0x78:
                    pax.update(records)
                else:
                    global_pax.update(records)
            pos += BLOCK + padded
            continue

        if not pending:
            header_offset = pos
            end = hdr.find(0, 0, 100)
            raw = hdr[:end] if end >= 0 else hdr[:100]
            if hdr[345] and hdr[257:263] == b"ustar\x00":
                end = hdr.find(0, 345, 500)
                raw = hdr[345 : end if end >= 0 else 500] + b"/" + raw
            try:
                name = raw.decode()
            except UnicodeDecodeError:
                name = raw.decode("utf-8", "surrogateescape")
        else:
            header_offset = pos if meta_offset is None else meta_offset
            eff = {**global_pax, **pax}
            if b"path" in eff:
                name = _decode(eff[b"path"])
            elif long_name is not None:
                name = _decode(long_name)
            else:
                raw = hdr[0:100].split(b"\0", 1)[0]
                if hdr[345] and hdr[257:263] == b"ustar\x00":
                    raw = hdr[345:500].split(b"\0", 1)[0] + b"/" + raw
                name = _decode(raw)
            if b"size" in eff:
                try:
                    msize = int(eff[b"size"])
                except ValueError:
                    msize = -1
                if msize < 0:
                    yield Bad(
                        CorruptDataError(
                            f"pax size record {eff[b'size']!r} is not a number",
                            url=url,
                            offset=pos,
                        ),
                        fatal=True,
                    )
                    return
            long_name, meta_offset, pax = None, None, {}
            pending = bool(global_pax) or drop_next

        data_offset = pos + BLOCK
        if drop_next:  # its name cannot be trusted (see above): pass over it
            drop_next, pending = False, bool(global_pax)
            size_on_disk = 0 if typeflag in _NO_DATA_FLAGS or typeflag == 0x35 else msize
            if data_offset + size_on_disk > size:
                yield _truncated(
                    url,
                    size,
                    f"inside a member of declared size {msize} at byte offset {data_offset}",
                )
                return
            pos = data_offset + size_on_disk + (-size_on_disk % BLOCK)
            continue
        if typeflag in _REGULAR_FLAGS and not (typeflag == 0 and name.endswith("/")):
            if want_data:
                data = shard[data_offset : data_offset + msize]
                if len(data) < msize:
                    yield _data_truncated(url, name, data_offset, msize, len(data))
                    return
                pos = data_offset + msize + (-msize % BLOCK)
                yield (name, REGULAR, "regular file", header_offset, data_offset, msize, data)
                continue
            kind, type_name, size_on_disk = REGULAR, "regular file", msize
        elif typeflag in (0x35, 0, 0x56):  # "5", an old-style "name/", "V" (GNU volume label)
            kind, type_name = DIRECTORY, "volume label" if typeflag == 0x56 else "directory"
            size_on_disk = 0 if typeflag == 0x35 else msize
        else:
            kind = OTHER
            flag = bytes((typeflag,))
            type_name = _TYPE_NAMES.get(flag, f"entry of unknown type {flag!r}")
            # As POSIX and Python's tarfile: links, devices and FIFOs store no data.
            size_on_disk = 0 if typeflag in _NO_DATA_FLAGS else msize
        if data_offset + size_on_disk > size:
            yield _truncated(
                url,
                size,
                f"inside member {name!r} (declared size {msize} at byte offset {data_offset})",
                name,
            )
            return
        yield (name, kind, type_name, header_offset, data_offset, msize, None)
        pos = data_offset + size_on_disk + (-size_on_disk % BLOCK)
