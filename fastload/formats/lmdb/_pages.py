"""LMDB's file structure (LMDB 0.9 data format, 64-bit builds): page constants, meta pages,
and recognising an LMDB file by its first bytes.

Nothing here knows about fastload's keys (:mod:`._layout`); :mod:`._pagemap` checks the B+tree
pages these constants describe before LMDB reads them.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from dataclasses import dataclass
from typing import Any, TypeAlias

__all__ = [
    "F_BIGDATA",
    "NODE_HEADER",
    "P_BRANCH",
    "P_INVALID",
    "P_LEAF",
    "P_LEAF2",
    "P_META",
    "P_OVERFLOW",
    "P_SUBP",
    "PAGE_HEADER",
    "PAGE_HEADER_STRUCT",
    "TRUST_BYTES_PER_ENTRY",
    "FileBytes",
    "MetaPage",
    "PageError",
    "detect",
    "read_meta",
    "matches_manifest",
]

# Pages (64-bit little-endian builds). Every page starts with a 16-byte header: ``mp_pgno``
# (uint64), ``mp_pad`` (uint16), ``mp_flags`` (uint16), then ``mp_lower``/``mp_upper`` (uint16
# each; one uint32 ``mp_pages`` in an overflow page). Branch and leaf pages hold
# ``(mp_lower - 16) / 2`` uint16 node offsets after the header; each node starts with ``lo, hi,
# flags, ksize`` (uint16 each) and its key. A leaf node's data size is ``lo | hi << 16``; its data
# follows the key, or (``F_BIGDATA``) a uint64 page number of the overflow pages that hold it. A
# branch node's child page is ``lo | hi << 16 | flags << 32``.

PAGE_HEADER = 16
NODE_HEADER = 8
P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_LEAF2, P_SUBP = 0x01, 0x02, 0x04, 0x08, 0x20, 0x40
F_BIGDATA = 0x01
P_INVALID = (1 << 64) - 1
PAGE_HEADER_STRUCT = struct.Struct("<QHHHH")  # pgno, pad, flags, lower, upper
# The meta record after the page header: magic, version, address, map size; the free database's
# record (whose ``md_pad`` is the page size), the main database's record
# (pad, flags, depth, branch, leaf, overflow pages, entries, root); last page, transaction id.
_META = struct.Struct("<IIQQIHHQQQQQIHHQQQQQQQ")
#: ``mm_magic`` and ``mm_version`` of a meta page in LMDB 0.9's data format.
_MAGIC = 0xBEEFC0DE
_DATA_VERSION = 1
_M_MAGIC, _M_VERSION, _M_PSIZE = 0, 1, 4
_M_FLAGS, _M_ENTRIES, _M_ROOT, _M_LAST_PAGE, _M_TXNID = 13, 18, 19, 20, 21
#: Page sizes LMDB can have (512 bytes to 64 KiB).
_PSIZES = tuple(1 << n for n in range(9, 17))

#: What the page checks read: a read-only map of the file (or its bytes).
FileBytes: TypeAlias = mmap.mmap | bytes


class PageError(Exception):
    """Damage in a shard's LMDB page structure, found before LMDB reads the bytes.

    Internal to this package: the reader turns it into a
    :class:`~fastload.errors.CorruptDataError` naming the shard and the sample.

    Attributes:
        offset: Byte offset in the file of the damaged page or node.
    """

    def __init__(self, message: str, offset: int) -> None:
        super().__init__(message)
        self.offset = offset


@dataclass(frozen=True)
class MetaPage:
    """The meta page LMDB uses: of the two at the start of the file, the one with the higher
    transaction id (the first on a tie), as LMDB 0.9 picks it.

    Attributes:
        number: Which meta page (0 or 1).
        psize: Page size in bytes.
        last_page: Number of the last page in use; the file needs ``(last_page + 1) * psize`` bytes.
        txnid: Transaction id.
        root: Root page of the main database, or :data:`P_INVALID` when it is empty.
        entries: Entries in the main database.
        other_entries: Entries according to the other meta page (to explain a damaged pick).
    """

    number: int
    psize: int
    last_page: int
    txnid: int
    root: int
    entries: int
    other_entries: int

    @property
    def needed(self) -> int:
        """Bytes the file needs according to this meta page."""
        return (self.last_page + 1) * self.psize


def _unpack_meta(buf: FileBytes, offset: int, size: int) -> tuple[Any, ...] | str:
    """The meta record of the page at ``offset``, or what is wrong with it."""
    if offset + PAGE_HEADER + _META.size > size:
        return f"the file ends at byte {size}, before the meta page at byte {offset}"
    _pgno, _pad, flags, _lower, _upper = PAGE_HEADER_STRUCT.unpack_from(buf, offset)
    meta = _META.unpack_from(buf, offset + PAGE_HEADER)
    if not flags & P_META or meta[_M_MAGIC] != _MAGIC:
        return (
            f"no LMDB meta page at byte {offset} (flags {flags:#x}, magic {meta[_M_MAGIC]:#010x})"
        )
    if meta[_M_VERSION] != _DATA_VERSION:
        return f"the meta page at byte {offset} has LMDB data version {meta[_M_VERSION]}, not 1"
    return meta


def read_meta(buf: FileBytes, size: int) -> MetaPage:
    """Check both meta pages of an LMDB file (the first ``size`` bytes of ``buf``) the way LMDB
    checks them when it opens the file, and more; return the one LMDB will use.

    Raises:
        PageError: The file is not an LMDB file of data version 1, or a meta page is damaged.
    """
    first = _unpack_meta(buf, 0, size)
    if isinstance(first, str):
        for psize in _PSIZES:  # is there a second meta page, at one of the page sizes?
            if not isinstance(_unpack_meta(buf, psize, size), str):
                raise PageError(f"meta page 0 is damaged: {first}", 0)
        raise PageError(f"not an LMDB file: {first}", 0)
    psize = first[_M_PSIZE]
    second = _unpack_meta(buf, psize, size) if psize in _PSIZES else "no page size"
    if isinstance(second, str):
        for candidate in _PSIZES:  # where is the second meta page, if anywhere?
            if candidate != psize and not isinstance(_unpack_meta(buf, candidate, size), str):
                raise PageError(
                    f"meta page 0 is damaged: it records page size {psize}, but meta page 1 is "
                    f"at byte {candidate}",
                    40,
                )
        if psize not in _PSIZES:
            raise PageError(f"meta page 0 records an impossible page size {psize}", 40)
        raise PageError(f"meta page 1 is damaged or missing: {second}", psize)
    if second[_M_PSIZE] != psize:
        raise PageError(
            f"meta page 1 records page size {second[_M_PSIZE]}, meta page 0 {psize}", psize + 40
        )
    number = 1 if first[_M_TXNID] < second[_M_TXNID] else 0
    meta, other = (first, second) if number == 0 else (second, first)
    base = number * psize + PAGE_HEADER
    db_flags, last_page, root = meta[_M_FLAGS], meta[_M_LAST_PAGE], meta[_M_ROOT]
    if db_flags != 0:
        raise PageError(
            f"meta page {number} gives the main database flags {db_flags:#x} (a fastload shard "
            "has plain keys and one value per key)",
            base + 76,
        )
    if not 1 <= last_page < 1 << 48:
        raise PageError(
            f"meta page {number} records an impossible last page {last_page}", base + 120
        )
    if root != P_INVALID and not 2 <= root <= last_page:
        raise PageError(
            f"meta page {number} records root page {root}, outside pages 2..{last_page}",
            base + 112,
        )
    return MetaPage(
        number, psize, last_page, meta[_M_TXNID], root, meta[_M_ENTRIES], other[_M_ENTRIES]
    )


# LMDB meta page (the first page of the file) on 64-bit builds: a 16-byte page header whose
# ``mp_flags`` (uint16 at offset 10) has P_META (0x08), then ``mm_magic`` (uint32 0xBEEFC0DE at
# offset 16) and ``mm_version`` (uint32 1 at offset 20), in the writing machine's byte order.
_MAGIC_OFFSET = 16
_LITTLE = struct.Struct("<HH4xII")  # at offset 8: pad, flags, (lower, upper), magic, version
_BIG = struct.Struct(">HH4xII")


def detect(head: bytes) -> bool:
    """Whether ``head`` (the first bytes of a file, at least 24) starts with an LMDB meta page.

    Checks the page header's P_META flag, the magic ``0xBEEFC0DE`` at byte 16 and data version 1,
    in either byte order. This recognises any LMDB file written by a 64-bit build, not only
    fastload shards; the reader checks the fastload meta key.
    """
    if len(head) < _MAGIC_OFFSET + 8:
        return False
    for layout in (_LITTLE, _BIG):
        _pad, flags, magic, version = layout.unpack_from(head, 8)
        if magic == _MAGIC and version == _DATA_VERSION and flags & P_META:
            return True
    return False


#: Bytes per entry up to which an LMDB file is hashed to be trusted instead of having its pages
#: checked (:func:`matches_manifest`). SHA-256 costs ~0.8 ns a byte with the CPU's SHA
#: instructions (~2.5 ns without); the page checks ~0.3 us an entry, in Python, per process (a
#: shard of 10^5 16-byte samples: 7.5 ms to hash, ~85 ms to walk and check every page). Large
#: values live on overflow pages that the checks do not read, so there hashing costs more.
TRUST_BYTES_PER_ENTRY = 256


def matches_manifest(
    buf: FileBytes, size: int, meta: MetaPage, sha256: str | None, num_bytes: int | None
) -> bool | None:
    """Whether the file's ``size`` bytes in ``buf`` are the ones the manifest lists (its size
    and SHA-256): ``None`` when that is not worth finding out (no manifest figures, a file of
    another size or larger values than :data:`TRUST_BYTES_PER_ENTRY`, or one its meta page
    says is truncated)."""
    if sha256 is None or num_bytes != size or size < meta.needed:
        return None
    if size > max(meta.entries, 1) * TRUST_BYTES_PER_ENTRY:
        return None
    with memoryview(buf) as view:
        return hashlib.sha256(view[:size]).hexdigest() == sha256
