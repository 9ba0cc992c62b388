"""The bytes of a fastload LMDB shard: reserved keys, value encoding, file detection, and the
LMDB page structure the reader checks before LMDB touches a page.

See ``README.md`` in this package for the specification; this module is its single implementation
of names and constants, shared by the writer and the reader.
"""

from __future__ import annotations

import mmap
import struct
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any, TypeAlias

import msgpack

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "GOOD",
    "MAX_FIELD_BYTES",
    "META_KEY",
    "POSITION_PREFIX",
    "RESERVED_PREFIX",
    "MetaPage",
    "PageError",
    "PageMap",
    "detect",
    "pack_meta",
    "pack_value",
    "position_key",
    "read_meta",
    "value_parts",
]

#: Every reserved key starts with these bytes. Sample keys never contain NUL, so they cannot collide.
RESERVED_PREFIX = b"\x00fastload/"
#: msgpack map describing the shard: ``{"format": "fastload-lmdb", "version": 1, "num_samples": N}``.
META_KEY = RESERVED_PREFIX + b"meta"
#: ``POSITION_PREFIX + position.to_bytes(8, "big")`` → the UTF-8 sample key at that position.
POSITION_PREFIX = RESERVED_PREFIX + b"pos/"
#: Value of ``"format"`` in the meta map.
FORMAT_NAME = "fastload-lmdb"
#: Layout version written by this code; readers refuse newer versions.
FORMAT_VERSION = 1

_POS = struct.Struct(">Q")

# LMDB meta page (the first page of the file) on 64-bit builds: a 16-byte page header whose
# ``mp_flags`` (uint16 at offset 10) has P_META (0x08), then ``mm_magic`` (uint32 0xBEEFC0DE at
# offset 16) and ``mm_version`` (uint32 1 at offset 20), in the writing machine's byte order.
_MAGIC_OFFSET = 16
_P_META = 0x08
_LITTLE = struct.Struct("<HH4xII")  # at offset 8: pad, flags, (lower, upper), magic, version
_BIG = struct.Struct(">HH4xII")
_MAGIC = 0xBEEFC0DE
_DATA_VERSION = 1


def position_key(position: int) -> bytes:
    """The reserved key holding the sample key at ``position`` (0-based, insertion order)."""
    return POSITION_PREFIX + _POS.pack(position)


def _str_header(size: int) -> bytes:
    if size < 32:
        return bytes((0xA0 | size,))
    if size < 1 << 8:
        return b"\xd9" + bytes((size,))
    if size < 1 << 16:
        return b"\xda" + size.to_bytes(2, "big")
    return b"\xdb" + size.to_bytes(4, "big")


def _bin_header(size: int) -> bytes:
    if size < 1 << 8:
        return b"\xc4" + bytes((size,))
    if size < 1 << 16:
        return b"\xc5" + size.to_bytes(2, "big")
    return b"\xc6" + size.to_bytes(4, "big")


def _map_header(size: int) -> bytes:
    if size < 16:
        return bytes((0x80 | size,))
    if size < 1 << 16:
        return b"\xde" + size.to_bytes(2, "big")
    return b"\xdf" + size.to_bytes(4, "big")


#: Largest field (and field count) msgpack can frame: its length prefixes are 32-bit.
MAX_FIELD_BYTES = (1 << 32) - 1

_NAME_CACHE: dict[str, bytes] = {}


def value_parts(fields: dict[str, bytes]) -> list[bytes]:
    """A sample's LMDB value as pieces whose concatenation is :func:`pack_value`'s result,
    ``[header, data, header, data, ...]``: the field bytes are the caller's objects, not copies,
    so the value can be written out with one gathering write.

    The encoding is msgpack's smallest for each item, exactly what ``msgpack.packb(fields,
    use_bin_type=True)`` produces.

    Raises:
        ValueError: A field name is not encodable as UTF-8, or a field is 4 GiB or larger.
    """
    parts: list[bytes] = []
    header = _map_header(len(fields))
    for name, data in fields.items():
        packed_name = _NAME_CACHE.get(name)
        if packed_name is None:
            raw = name.encode("utf-8")
            packed_name = _str_header(len(raw)) + raw
            if len(_NAME_CACHE) < 4096:
                _NAME_CACHE[name] = packed_name
        size = len(data)
        if size > MAX_FIELD_BYTES:
            raise ValueError(f"field {name!r} is {size} bytes; msgpack frames at most 4 GiB - 1")
        parts.append(header + packed_name + _bin_header(size))
        parts.append(data)
        header = b""
    if not parts:
        parts.append(header)
    return parts


def pack_value(fields: dict[str, bytes]) -> bytes:
    """A sample's LMDB value: msgpack map field name (str) → bytes (msgpack ``bin``), in the
    sample's field order."""
    return b"".join(value_parts(fields))


def pack_meta(num_samples: int) -> bytes:
    """The value stored under :data:`META_KEY`."""
    meta: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "num_samples": num_samples,
    }
    packed: bytes = msgpack.packb(meta, use_bin_type=True)
    return packed


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
        if magic == _MAGIC and version == _DATA_VERSION and flags & _P_META:
            return True
    return False


# ---- the LMDB page structure (LMDB 0.9 data format, 64-bit little-endian builds) ---------------
#
# Every page starts with a 16-byte header: ``mp_pgno`` (uint64), ``mp_pad`` (uint16), ``mp_flags``
# (uint16), then ``mp_lower``/``mp_upper`` (uint16 each; one uint32 ``mp_pages`` in an overflow
# page). Branch and leaf pages hold ``(mp_lower - 16) / 2`` uint16 node offsets after the header;
# each node starts with ``lo, hi, flags, ksize`` (uint16 each) and its key. A leaf node's data size
# is ``lo | hi << 16``; its data follows the key, or (``F_BIGDATA``) a uint64 page number of the
# overflow pages that hold it. A branch node's child page is ``lo | hi << 16 | flags << 32``.

PAGE_HEADER = 16
_NODE_HEADER = 8
P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_LEAF2, P_SUBP = 0x01, 0x02, 0x04, 0x08, 0x20, 0x40
_TYPE_BITS = P_BRANCH | P_LEAF | P_OVERFLOW | P_META | P_LEAF2 | P_SUBP
F_BIGDATA = 0x01
P_INVALID = (1 << 64) - 1
#: LMDB's cursor stack depth: no tree is deeper.
_MAX_DEPTH = 32
_HEADER = struct.Struct("<QHHHH")  # pgno, pad, flags, lower, upper
_OVERFLOW = struct.Struct("<QHHI")  # pgno, pad, flags, pages
_NODE = struct.Struct("<HHHH")  # lo, hi, flags, ksize
_U64 = struct.Struct("<Q")
# The meta record after the page header: magic, version, address, map size; the free database's
# record (whose ``md_pad`` is the page size), the main database's record
# (pad, flags, depth, branch, leaf, overflow pages, entries, root); last page, transaction id.
_META = struct.Struct("<IIQQIHHQQQQQIHHQQQQQQQ")
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
    _pgno, _pad, flags, _lower, _upper = _HEADER.unpack_from(buf, offset)
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


@dataclass
class _Leaf:
    """A leaf page as the branch pages describe it: its page number and the keys it may hold
    (``low`` up to, not including, the next leaf's ``low``). ``damage`` is set when the leaf
    cannot be reached (a damaged branch page or pointer above it)."""

    pgno: int
    damage: PageError | None = None


#: :attr:`PageMap.state` of a leaf page that passed its checks (0: not checked yet).
GOOD = 1


class PageMap:
    """The main database's B+tree as far as the file's bytes allow: every leaf page with the key
    range it covers, found by walking the branch pages from the root (at construction), and each
    leaf page checked the first time a key on it is wanted (:meth:`check`).

    The checks make sure that LMDB, searching for a key the way it does, only reads bytes inside
    the file that form valid pages: every page on the way lies wholly in the file, has the right
    type and consistent bounds, its node offsets and sizes stay inside the page, its keys are
    sorted and within the range its parent gives it, and an overflow value lies inside the file
    on a run of overflow pages of the right length. A damaged page fails the lookups of the keys
    it covers (whole subtrees for a branch page); a damaged node only the lookup of its own key.

    Thread safety: lookups may run in several threads; a page is checked at most a few times.

    Attributes:
        lows: For each leaf, in key order, the lowest key it may hold; a key belongs to the last
            leaf whose low is not above it (LMDB's own descent, for a tree that passed the
            checks of its branch pages).
        leaves: The leaves, parallel to ``lows``.
        state: Per leaf, :data:`GOOD` once its page passed its checks.
        bad_nodes: Keys whose own node is damaged (on a page that is otherwise good).

    Args:
        buf: The file's bytes (e.g. a read-only ``mmap``); only the first ``size`` are read.
        size: Bytes present in the file.
        meta: The file's :func:`read_meta`.
        truncation: Words explaining where a page beyond ``size`` went (e.g. "the shard is
            truncated at 8192 bytes, its meta page needs 24576").
    """

    def __init__(self, buf: FileBytes, size: int, meta: MetaPage, truncation: str = "") -> None:
        self.buf, self.size, self.meta = buf, size, meta
        self.psize = meta.psize
        self.pages = meta.last_page + 1
        self.truncation = truncation or f"the file ends at byte {size}"
        self.lows: list[bytes] = []
        self.leaves: list[_Leaf] = []
        self.state = bytearray()
        self.bad_nodes: dict[bytes, PageError] = {}
        self._bad_pages: dict[int, PageError] = {}
        if meta.root != P_INVALID:
            self._walk()
            self.state = bytearray(len(self.leaves))

    # ---- structure ----------------------------------------------------------------------------

    def _header(self, pgno: int, what: str) -> tuple[int, int, int]:
        """``(flags, lower, upper)`` of page ``pgno``, which must lie wholly in the file."""
        offset = pgno * self.psize
        if offset + self.psize > self.size:
            raise PageError(
                f"{what} page {pgno} (bytes {offset}-{offset + self.psize - 1}) is missing: "
                f"{self.truncation}",
                min(offset, self.size),
            )
        mp_pgno, _pad, flags, lower, upper = _HEADER.unpack_from(self.buf, offset)
        if mp_pgno != pgno:
            raise PageError(
                f"{what} page {pgno} is damaged: its header says page {mp_pgno}", offset
            )
        return flags, lower, upper

    def _nodes(self, pgno: int, want: int, what: str) -> list[int]:
        """The node offsets (within the page) of branch or leaf page ``pgno``, checked."""
        offset = pgno * self.psize
        flags, lower, upper = self._header(pgno, what)
        if flags & _TYPE_BITS != want:
            raise PageError(
                f"{what} page {pgno} is damaged: page flags {flags:#x}, expected {want:#x}", offset
            )
        if not PAGE_HEADER < lower <= upper <= self.psize or (lower - PAGE_HEADER) % 2:
            raise PageError(
                f"{what} page {pgno} is damaged: impossible bounds lower={lower} upper={upper}",
                offset,
            )
        count = (lower - PAGE_HEADER) // 2
        nodes = list(struct.unpack_from(f"<{count}H", self.buf, offset + PAGE_HEADER))
        limit = self.psize - _NODE_HEADER
        for i, node in enumerate(nodes):
            if not upper <= node <= limit:
                raise PageError(
                    f"{what} page {pgno} is damaged: node {i} at {node} is outside the page's "
                    f"node area {upper}-{self.psize}",
                    offset + PAGE_HEADER + 2 * i,
                )
        return nodes

    def _node_key(self, page: int, node: int, i: int, ksize: int, what: str) -> bytes:
        start = page + node + _NODE_HEADER
        if node + _NODE_HEADER + ksize > self.psize:
            raise PageError(
                f"{what} page {page // self.psize} is damaged: key {i} ({ksize} bytes) runs past "
                "the page",
                page + node,
            )
        return bytes(self.buf[start : start + ksize])

    def _walk(self) -> None:
        """Find every leaf from the root through the branch pages, recording key ranges."""
        seen: set[int] = set()
        # (page, low key, high key, depth, whether a leaf); children pushed in reverse so leaves come out in key order.
        stack: list[tuple[int, bytes, bytes | None, int, bool | None]] = [
            (self.meta.root, b"", None, 1, None)
        ]
        while stack:
            pgno, low, high, depth, is_leaf = stack.pop()
            if pgno in seen:
                self._lost(
                    low, pgno, PageError(f"page {pgno} is referenced twice", pgno * self.psize)
                )
                continue
            seen.add(pgno)
            if is_leaf is None:  # the root: its own type says
                try:
                    flags = self._header(pgno, "root")[0] & _TYPE_BITS
                except PageError as exc:
                    self._lost(low, pgno, exc)
                    continue
                is_leaf = flags == P_LEAF
            if is_leaf:
                self.lows.append(low)
                self.leaves.append(_Leaf(pgno))
                continue
            try:
                children = self._branch(pgno, low, high, depth)
            except PageError as exc:
                self._lost(low, pgno, exc)
                continue
            child_is_leaf = self._children_are_leaves([c for c, _ in children])
            for i in range(len(children) - 1, -1, -1):
                child, child_low = children[i]
                child_high = children[i + 1][1] if i + 1 < len(children) else high
                stack.append((child, child_low, child_high, depth + 1, child_is_leaf))

    def _lost(self, low: bytes, pgno: int, exc: PageError) -> None:
        """Record that the keys from ``low`` up to the next leaf's low cannot be reached."""
        self.lows.append(low)
        self.leaves.append(_Leaf(pgno, exc))

    def _branch(
        self, pgno: int, low: bytes, high: bytes | None, depth: int
    ) -> list[tuple[int, bytes]]:
        """The children ``(page, low key)`` of branch page ``pgno``, checked."""
        offset = pgno * self.psize
        if depth >= _MAX_DEPTH:
            raise PageError(
                f"branch page {pgno} is {depth} levels deep: the tree is damaged", offset
            )
        children: list[tuple[int, bytes]] = []
        previous = low
        for i, node in enumerate(self._nodes(pgno, P_BRANCH, "branch")):
            lo, hi, top, ksize = _NODE.unpack_from(self.buf, offset + node)
            child = lo | hi << 16 | top << 32
            if not 2 <= child < self.pages or child == pgno:
                raise PageError(
                    f"branch page {pgno} is damaged: node {i} points to page {child}, outside "
                    f"pages 2..{self.pages - 1}",
                    offset + node,
                )
            if i == 0:  # LMDB ignores the first key: the child covers everything from ``low``
                children.append((child, low))
                continue
            key = self._node_key(offset, node, i, ksize, "branch")
            if key <= previous or (high is not None and key >= high):
                raise PageError(
                    f"branch page {pgno} is damaged: its keys are out of order at node {i}",
                    offset + node,
                )
            previous = key
            children.append((child, key))
        return children

    def _children_are_leaves(self, children: list[int]) -> bool:
        """Whether the children of a branch page are leaves (all are at the same level): the
        type of the first child that lies in the file and has a page type; leaves if none."""
        for child in children:
            offset = child * self.psize
            if offset + self.psize > self.size:
                continue
            mp_pgno, _pad, flags, _lower, _upper = _HEADER.unpack_from(self.buf, offset)
            kind = flags & _TYPE_BITS
            if mp_pgno == child and kind in (P_BRANCH, P_LEAF):
                return bool(kind == P_LEAF)
        return True

    # ---- lookups ------------------------------------------------------------------------------

    def check(self, key: bytes) -> bool:
        """Make sure LMDB may look ``key`` up; whether it can be in the database at all.

        Raises:
            PageError: A page LMDB would read for ``key`` is damaged or missing, or the key's own
                node is (its value lies outside the file or on damaged overflow pages).
        """
        i = bisect_right(self.lows, key) - 1
        if i < 0:
            return False
        if self.state[i] != GOOD:
            self._check_leaf(i, None, None)
        if self.bad_nodes:
            damage = self.bad_nodes.get(key)
            if damage is not None:
                raise damage
        return True

    def run(self, key: bytes) -> tuple[list[bytes], list[bytes | None]]:
        """The keys of the leaf page that would hold ``key``, in order, and their values
        (``None`` for a value on overflow pages), read by the same checks as :meth:`check`;
        empty lists for an empty database. Iteration reads position entries this way, a page
        at a time.

        Raises:
            PageError: The leaf page, or a page above it, is damaged or missing.
        """
        i = bisect_right(self.lows, key) - 1
        keys: list[bytes] = []
        values: list[bytes | None] = []
        if i >= 0:
            self._check_leaf(i, keys, values)
        return keys, values

    def _check_leaf(
        self, i: int, keys: list[bytes] | None, values: list[bytes | None] | None
    ) -> None:
        leaf = self.leaves[i]
        if leaf.damage is not None:
            raise leaf.damage
        damage = self._bad_pages.get(i)
        if damage is not None:
            raise damage
        high = self.lows[i + 1] if i + 1 < len(self.lows) else None
        try:
            self._scan_leaf(leaf.pgno, self.lows[i], high, keys, values)
        except PageError as exc:
            self._bad_pages[i] = exc
            raise
        self.state[i] = GOOD

    def _scan_leaf(
        self,
        pgno: int,
        low: bytes,
        high: bytes | None,
        keys: list[bytes] | None,
        values: list[bytes | None] | None,
    ) -> None:
        """Check leaf page ``pgno`` (its keys must lie in ``low`` up to ``high``); append its
        keys and values to ``keys``/``values`` when given."""
        buf, psize, offset = self.buf, self.psize, pgno * self.psize
        unpack = _NODE.unpack_from
        previous = low
        first = True
        for i, node in enumerate(self._nodes(pgno, P_LEAF, "leaf")):
            lo, hi, flags, ksize = unpack(buf, offset + node)
            start = node + _NODE_HEADER
            data = start + ksize
            if flags & ~F_BIGDATA or not ksize or data > psize:
                raise PageError(
                    f"leaf page {pgno} is damaged: node {i} has flags {flags:#x} and a "
                    f"{ksize}-byte key",
                    offset + node,
                )
            key = buf[offset + start : offset + data]
            if (
                key < previous
                or (key == previous and not first)
                or (high is not None and key >= high)
            ):
                raise PageError(
                    f"leaf page {pgno} is damaged: its keys are out of order at node {i}",
                    offset + node,
                )
            previous, first = key, False
            dsize = lo | hi << 16
            if not flags:
                if data + dsize > psize:
                    raise PageError(
                        f"leaf page {pgno} is damaged: the {dsize}-byte value of node {i} runs "
                        "past the page",
                        offset + node,
                    )
                if keys is not None and values is not None:
                    keys.append(key)
                    values.append(buf[offset + data : offset + data + dsize])
                continue
            if data + 8 > psize:
                raise PageError(
                    f"leaf page {pgno} is damaged: node {i} runs past the page", offset + node
                )
            damage = self._overflow(_U64.unpack_from(buf, offset + data)[0], dsize)
            if damage is not None:
                self.bad_nodes[key] = damage
            if keys is not None and values is not None:
                keys.append(key)
                values.append(None)

    def _overflow(self, pgno: int, dsize: int) -> PageError | None:
        """What is wrong with the overflow pages of a ``dsize``-byte value at ``pgno``, if any."""
        if not 2 <= pgno < self.pages:
            return PageError(
                f"the value's overflow page number {pgno} is outside pages 2..{self.pages - 1}",
                min(pgno, self.pages) * self.psize,
            )
        offset = pgno * self.psize
        end = offset + PAGE_HEADER + dsize
        if end > self.size:
            return PageError(
                f"the value (bytes {offset + PAGE_HEADER}-{end - 1}) is missing: {self.truncation}",
                min(offset, self.size),
            )
        mp_pgno, _pad, flags, pages = _OVERFLOW.unpack_from(self.buf, offset)
        needed = (PAGE_HEADER - 1 + dsize) // self.psize + 1
        if mp_pgno != pgno or flags & _TYPE_BITS != P_OVERFLOW or pages != needed:
            return PageError(
                f"overflow page {pgno} of a {dsize}-byte value is damaged (header: page "
                f"{mp_pgno}, flags {flags:#x}, {pages} pages where {needed} are needed)",
                offset,
            )
        return None
