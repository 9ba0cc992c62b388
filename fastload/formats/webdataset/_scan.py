"""The streaming member scanner of a tar shard: members in order, and each problem found.

:func:`scan` walks the archive block by block over any :class:`~._view.ShardView` (a memory map,
bytes, or a :class:`~._view.StreamView` over a stream), applying pax and GNU extension headers and
resuming after damage; the header fields themselves are parsed by :mod:`._tar`. It reads plain
members itself and hands the rest on: extension headers to :func:`_read_extension`, other members
to :func:`_read_member`, a header that fails its checksum to :func:`_recover`.
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Generator, Iterator
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


#: Where the shard ends when a header block is cut short, or missing.
_CUT_HEADER, _NO_END = "inside a header block", "without the end-of-archive blocks"


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


class _Extensions:
    """What the pax and GNU extension headers read so far say about the members after them."""

    __slots__ = ("drop_next", "global_pax", "long_name", "offset", "pax", "pending")

    def __init__(self) -> None:
        self.long_name: bytes | None = None  # GNU long name ("L") of the next member
        self.pax: dict[bytes, bytes] = {}  # pax extended ("x") records of the next member
        self.global_pax: dict[bytes, bytes] = {}  # pax global ("g") records: every later member
        self.offset: int | None = None  # offset of the first pax/GNU block of the next member
        self.drop_next = False  # the next member's name cannot be trusted: pass over it
        #: Any of the above applies to the next member (offset set, global_pax or drop_next).
        self.pending = False

    def forget(self, drop_next: bool) -> None:
        """Forget the headers for the next member only, as it was read or they were lost;
        ``drop_next``: pass over the next member."""
        self.long_name, self.pax, self.offset, self.drop_next = None, {}, None, drop_next
        self.pending = drop_next or bool(self.global_pax)


def _lost_name(url: str, offset: int, what: str) -> Bad:
    """The extension header at ``offset`` is unusable, so the member after it is passed over."""
    what += "; the member it describes is lost, re-create or re-download the shard"
    return Bad(CorruptDataError(what, url=url, offset=offset), fatal=False, lost_next=True)


def _read_extension(
    shard: ShardView, url: str, pos: int, typeflag: int, msize: int, ext: _Extensions
) -> tuple[Bad | None, int]:
    """Read the pax or GNU extension header at ``pos`` (``typeflag`` one of ``_META_FLAGS``, with
    ``msize`` bytes of body) into ``ext``, for the member after it; the next header's offset.

    The problem returned is a fatal :class:`Bad` if the shard ends inside the body, a non-fatal
    one if the name of the member it describes is lost (``ext.drop_next`` is then set).
    """
    padded = msize + (-msize % BLOCK)
    body = shard[pos + BLOCK : pos + BLOCK + padded]
    if len(body) < padded:
        return _truncated(url, pos, f"inside a {chr(typeflag)!r} extension header"), pos
    if ext.offset is None:
        ext.offset = pos
        ext.pending = True
    body = body[:msize]
    problem = None
    if typeflag == 0x4C:  # "L": a GNU long name
        ext.long_name = body.split(b"\0", 1)[0] or None
        if ext.long_name is None:
            problem = _lost_name(url, pos, "GNU long-name header with an empty name")
            ext.drop_next = True
    elif typeflag != 0x4B:  # "x" or "g"; "K" (GNU long link name) is not needed
        try:
            records = parse_pax(body)
            if records.get(b"path", b"x") == b"":
                raise ValueError("its 'path' record is empty")
        except ValueError as exc:
            problem = _lost_name(url, pos, f"malformed pax extended header: {exc}")
            records = {}
            ext.drop_next = ext.drop_next or typeflag == 0x78
        (ext.pax if typeflag == 0x78 else ext.global_pax).update(records)
    return problem, pos + BLOCK + padded


def _ustar_name(hdr: bytes) -> str:
    """The member path in a ustar header's name field, after its prefix field if it has one."""
    end = hdr.find(0, 0, 100)
    raw = hdr[:end] if end >= 0 else hdr[:100]
    if hdr[345] and hdr[257:263] == b"ustar\x00":
        end = hdr.find(0, 345, 500)
        raw = hdr[345 : end if end >= 0 else 500] + b"/" + raw
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return _decode(raw)


def _entry_kind(typeflag: int, msize: int) -> tuple[int, str, int]:
    """``(kind, type_name, size_on_disk)`` of a member that is not a regular file."""
    if typeflag in (0x35, 0, 0x56):  # "5", an old-style "name/", "V" (GNU volume label)
        type_name = "volume label" if typeflag == 0x56 else "directory"
        return DIRECTORY, type_name, 0 if typeflag == 0x35 else msize
    flag = bytes((typeflag,))
    type_name = _TYPE_NAMES.get(flag, f"entry of unknown type {flag!r}")
    # As POSIX and Python's tarfile: links, devices and FIFOs store no data.
    return OTHER, type_name, 0 if typeflag in _NO_DATA_FLAGS else msize


def _read_member(
    shard: ShardView, url: str, pos: int, hdr: bytes, msize: int, ext: _Extensions, want: bool
) -> tuple[Member | Bad | None, int]:
    """The member whose ustar header ``hdr`` (size field ``msize``) is at ``pos``, after the
    extension headers in ``ext``, and the next header's offset.

    The item is the :class:`Member` (with its data if ``want``), ``None`` for a member passed
    over as its name cannot be trusted, or a fatal :class:`Bad`. Its name is the pax ``path``,
    else the GNU long name, else the ustar name; a pax ``size`` record overrides ``msize``.
    """
    typeflag, header_offset, data_offset = hdr[156], pos, pos + BLOCK
    if not ext.pending:
        name = _ustar_name(hdr)
    else:  # inline, not a helper: a call costs ~1.5 % of a member with a pax header
        if ext.offset is not None:
            header_offset = ext.offset
        eff = {**ext.global_pax, **ext.pax} if ext.global_pax else ext.pax
        if b"path" in eff:
            name = _decode(eff[b"path"])
        elif ext.long_name is not None:
            name = _decode(ext.long_name)
        else:
            name = _ustar_name(hdr)
        if b"size" in eff:
            try:
                msize = int(eff[b"size"])
            except ValueError:
                msize = -1
            if msize < 0:
                what = f"pax size record {eff[b'size']!r} is not a number"
                return Bad(CorruptDataError(what, url=url, offset=pos), fatal=True), pos
        drop = ext.drop_next
        ext.forget(False)
        if drop:  # its name cannot be trusted (see scan): pass over it
            size_on_disk = 0 if typeflag in _NO_DATA_FLAGS else msize
            if data_offset + size_on_disk > len(shard):
                where = f"inside a member of declared size {msize} at byte offset {data_offset}"
                return _truncated(url, len(shard), where), pos
            return None, data_offset + size_on_disk + (-size_on_disk % BLOCK)
    data: bytes | None = None
    if typeflag in _REGULAR_FLAGS and not (typeflag == 0 and name.endswith("/")):
        kind, type_name, size_on_disk = REGULAR, "regular file", msize
        if want:
            data = shard[data_offset : data_offset + msize]
            if len(data) < msize:
                return _data_truncated(url, name, data_offset, msize, len(data)), pos
    else:
        kind, type_name, size_on_disk = _entry_kind(typeflag, msize)
    if data is None and data_offset + size_on_disk > len(shard):
        where = f"inside member {name!r} (declared size {msize} at byte offset {data_offset})"
        return _truncated(url, len(shard), where, name), pos
    member = (name, kind, type_name, header_offset, data_offset, msize, data)
    return member, data_offset + size_on_disk + (-size_on_disk % BLOCK)


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


def _corrupt_header(shard: ShardView, url: str, pos: int, hdr: bytes) -> tuple[Bad, int] | None:
    """For the header ``hdr`` at ``pos`` that failed its checksum: the problem, and the block
    after which to look for the next valid header; ``None`` if it is the end of the archive.

    The end of the archive is a zero block that only zeros follow. Zero blocks with more archive
    after them are headers that were wiped (a lost page reads back as zeros), not the end:
    reading them as the end would drop every later member without a word.
    """
    if hdr == ZERO_BLOCK:
        # Not read when at most the second end block can follow: no member could start there.
        more = None if pos + 2 * BLOCK >= len(shard) else _first_nonzero(shard, pos + BLOCK)
        if more is None:
            return None
        problem = (
            f"{more - pos} zero bytes where a tar header belongs, with more archive "
            f"after them (from byte offset {more}): tar headers were wiped, so the "
            "members they described are lost"
        )
        resume = more - BLOCK  # resynchronise from the first block after the zeros
    else:
        problem = (
            "tar header checksum mismatch (corrupt or not a tar archive); the member "
            "at this offset is lost"
        )
        resume = pos
    problem += "; the shard is damaged, re-create or re-download it"
    return Bad(CorruptDataError(problem, url=url, offset=pos), fatal=False, lost_next=True), resume


def _recover(
    shard: ShardView, url: str, pos: int, hdr: bytes, ext: _Extensions
) -> Generator[Bad, None, int | None]:
    """After the header ``hdr`` at ``pos`` failed its checksum: yield the problem, and return the
    offset of the next valid ustar header, searched block by block; ``None`` to stop (the end
    of the archive, or of the shard after a fatal :class:`Bad`)."""
    damage = _corrupt_header(shard, url, pos, hdr)
    if damage is None:
        return None
    bad, search = damage
    yield bad
    zeros = 0
    skipped: deque[bytes] = deque(maxlen=_META_BLOCKS)  # the last blocks passed over
    while True:
        search += BLOCK
        found = shard[search : search + BLOCK]
        if len(found) < BLOCK:
            if zeros >= 2 and not found:
                return None
            yield Bad(
                CorruptDataError(
                    f"no valid tar header after the corrupt one at byte offset {pos} "
                    "up to the end of the shard, which lacks the end-of-archive blocks; "
                    "the shard is truncated or is not a tar archive",
                    url=url,
                    offset=search,
                ),
                fatal=True,
            )
            return None
        if found[257:262] == b"ustar" and checksum_ok(found):
            break
        skipped.append(found)
        zeros = zeros + 1 if found == ZERO_BLOCK else 0
    # A lost pax/GNU header leaves its member with the stand-in name of its ustar header
    # (truncated, or with '?' for other characters): drop that member too.
    ext.forget(
        hdr[156] in _META_FLAGS
        or (found[156] not in _META_FLAGS and _extension_body(skipped, found))
    )
    return search


def _padded_size(hdr: bytes) -> int:
    """The size field where plain octal failed: base-256 or NUL-padded digits; -1 if neither."""
    try:
        return parse_octal(hdr[124:136])
    except ValueError:
        return -1


def _invalid_size(url: str, pos: int, hdr: bytes) -> Bad:
    """The header at ``pos`` has a size field that is no number: its member cannot be passed."""
    what = f"tar header has an invalid size field {hdr[124:136]!r}"
    return Bad(CorruptDataError(what, url=url, offset=pos), fatal=True)


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
    ext = _Extensions()
    item: Member | Bad | None  # what a header that is not on the fast path gave
    pos = start
    while True:
        hdr = shard[pos : pos + BLOCK]
        if len(hdr) != BLOCK:
            yield _truncated(url, pos, _CUT_HEADER if hdr else _NO_END)
            return
        # Fast path for the common member: a regular file ("0") with a valid checksum, a plain
        # octal size, a UTF-8 name (in the name field, after a ustar prefix if any), and no
        # pax/GNU header before it. Anything else, and any problem, goes the general way below.
        if (
            hdr[156] == 0x30
            and not ext.pending
            and not hdr[135]
            and (adler(hdr) & 0xFFFF) == cache_get(hdr[148:156])
        ):
            end = hdr.find(0, 0, 100)
            if end > 0:
                try:
                    raw = hdr[:end]
                    if hdr[345] and hdr[257:263] == b"ustar\x00":  # not _ustar_name(): 10 % faster
                        raw = hdr[345:500].split(b"\0", 1)[0] + b"/" + raw
                    name = raw.decode()
                    msize = int(hdr[124:135], 8)
                except ValueError:
                    msize = -1
                # Without data, a member that the shard cuts short goes the general way, too.
                if msize >= 0 and (want_data or pos + BLOCK + msize <= size):
                    data_offset = pos + BLOCK
                    data = shard[data_offset : data_offset + msize] if want_data else None
                    if data is not None and len(data) != msize:
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
            resumed = yield from _recover(shard, url, pos, hdr, ext)
            if resumed is None:
                return
            pos = resumed
            continue
        try:  # the size field: octal, or GNU base-256
            msize = int(hdr[124:135], 8) if hdr[135] in (0, 32) else parse_octal(hdr[124:136])
        except ValueError:
            msize = _padded_size(hdr)
        if msize < 0:
            yield _invalid_size(url, pos, hdr)
            return
        if hdr[156] in _META_FLAGS:  # metadata for the next member
            item, pos = _read_extension(shard, url, pos, hdr[156], msize, ext)
        else:
            item, pos = _read_member(shard, url, pos, hdr, msize, ext, want_data)
        if item is not None:
            yield item
            if type(item) is Bad and item.fatal:
                return
