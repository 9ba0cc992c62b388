"""Checks of an LMDB file's B+tree pages, made before LMDB reads them (see :class:`PageMap`)."""

from __future__ import annotations

import struct
import threading
from bisect import bisect_right
from dataclasses import dataclass

from fastload.formats.lmdb._pages import (
    F_BIGDATA,
    NODE_HEADER,
    P_BRANCH,
    P_INVALID,
    P_LEAF,
    P_LEAF2,
    P_META,
    P_OVERFLOW,
    P_SUBP,
    PAGE_HEADER,
    PAGE_HEADER_STRUCT,
    FileBytes,
    MetaPage,
    PageError,
)

__all__ = ["GOOD", "PageMap"]

_TYPE_BITS = P_BRANCH | P_LEAF | P_OVERFLOW | P_META | P_LEAF2 | P_SUBP
#: LMDB's cursor stack depth: no tree is deeper.
_MAX_DEPTH = 32
_OVERFLOW = struct.Struct("<QHHI")  # pgno, pad, flags, pages
_NODE = struct.Struct("<HHHH")  # lo, hi, flags, ksize
_U64 = struct.Struct("<Q")


@dataclass(slots=True)
class _Leaf:
    """A leaf page as the branch pages describe it: its page number and the keys it may hold
    (``low`` up to, not including, the next entry's ``low``). ``damage`` is set when the leaf
    cannot be reached (a damaged branch page or pointer above it) or failed its checks."""

    pgno: int
    damage: PageError | None = None


@dataclass(slots=True)
class _Branch:
    """A branch page not read yet (:meth:`PageMap._expand` reads it when a key below it is
    wanted): its page number, its depth, and whether it is the root (whose own type says
    whether it is a leaf)."""

    pgno: int
    depth: int
    root: bool = False


@dataclass(slots=True)
class _Table:
    """What lookups bisect, replaced whole when a branch is read (see :class:`PageMap`).

    Attributes:
        lows: For each entry, in key order, the lowest key it may hold.
        entries: The leaves and the branches not read yet, parallel to ``lows``.
        state: Per entry, :data:`GOOD` once it is a leaf whose page passed its checks.
    """

    lows: list[bytes]
    entries: list[_Leaf | _Branch]
    state: bytearray


#: :attr:`_Table.state` of a leaf page that passed its checks (0: not checked yet).
GOOD = 1


class PageMap:
    """The main database's B+tree as far as the file's bytes allow, read as lookups need it: a
    branch page when the first key below it is wanted (its checks once per process, never for
    the subtrees nobody reads), each leaf page the first time a key on it is wanted
    (:meth:`check`). Opening a shard therefore reads only its meta pages (the walk of every
    branch page at opening took ~18 ms for a shard of 10^5 samples, paid for every shard a
    worker touches before its first batch).

    The checks make sure that LMDB, searching for a key the way it does, only reads bytes inside
    the file that form valid pages: every page on the way lies wholly in the file, has the right
    type and consistent bounds, its node offsets and sizes stay inside the page, its keys are
    sorted and within the range its parent gives it, no page is referenced twice, and an
    overflow value lies inside the file on a run of overflow pages of the right length. A damaged
    page fails the lookups of the keys it covers (whole subtrees for a branch page); a damaged
    node only the lookup of its own key.

    Thread safety: lookups may run in several threads. :attr:`table` is replaced whole, never
    changed but for :data:`GOOD` marks, so a reader may bisect it without a lock: an entry that
    says :data:`GOOD` is a leaf that passed its checks. Reading branches and checking leaves
    happen under a lock.

    Attributes:
        table: The :class:`_Table` of entries: a key belongs to the last entry whose low is not
            above it (LMDB's own descent, for branch pages that passed their checks).
        bad_nodes: Keys whose own node is damaged (on a page that is otherwise good).

    A *trusted* map (a file whose bytes are known to be what a writer committed: its SHA-256 is
    the manifest's) lets every lookup through without reading a page: :attr:`table` is one
    :data:`GOOD` entry that covers every key. :meth:`run` still reads the branches and leaves it
    needs, as it collects a leaf's keys.

    Args:
        buf: The file's bytes (e.g. a read-only ``mmap``); only the first ``size`` are read.
        size: Bytes present in the file.
        meta: The file's :func:`read_meta`.
        truncation: Words explaining where a page beyond ``size`` went (e.g. "the shard is
            truncated at 8192 bytes, its meta page needs 24576").
        trusted: Whether the file's bytes are known to be intact (see above).
    """

    def __init__(
        self,
        buf: FileBytes,
        size: int,
        meta: MetaPage,
        truncation: str = "",
        *,
        trusted: bool = False,
    ) -> None:
        self.buf, self.size, self.meta = buf, size, meta
        self.psize = meta.psize
        self.pages = meta.last_page + 1
        self.truncation = truncation or f"the file ends at byte {size}"
        self.bad_nodes: dict[bytes, PageError] = {}
        # A bit per page that some branch (or the meta page) points to: pages in the file only
        # (one past its end is missing anyway, and a damaged meta page may claim any number).
        self._seen = bytearray((min(self.pages, size // self.psize + 1) + 7) // 8)
        self._lock = threading.Lock()
        if meta.root == P_INVALID:
            self._tree = _Table([], [], bytearray())
        else:
            self._mark_seen(meta.root)
            self._tree = _Table([b""], [_Branch(meta.root, 1, root=True)], bytearray(1))
        self.trusted = trusted
        self.table = _Table([b""], [_Leaf(-1)], bytearray([GOOD])) if trusted else self._tree

    # ---- structure ----------------------------------------------------------------------------

    def _mark_seen(self, pgno: int) -> bool:
        """Record that a pointer to ``pgno`` was met; whether one was met before."""
        byte, bit = divmod(pgno, 8)
        if byte >= len(self._seen):
            return False
        before = self._seen[byte] >> bit & 1
        self._seen[byte] |= 1 << bit
        return bool(before)

    def _header(self, pgno: int, what: str) -> tuple[int, int, int]:
        """``(flags, lower, upper)`` of page ``pgno``, which must lie wholly in the file."""
        offset = pgno * self.psize
        if offset + self.psize > self.size:
            raise PageError(
                f"{what} page {pgno} (bytes {offset}-{offset + self.psize - 1}) is missing: "
                f"{self.truncation}",
                min(offset, self.size),
            )
        mp_pgno, _pad, flags, lower, upper = PAGE_HEADER_STRUCT.unpack_from(self.buf, offset)
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
        limit = self.psize - NODE_HEADER
        for i, node in enumerate(nodes):
            if not upper <= node <= limit:
                raise PageError(
                    f"{what} page {pgno} is damaged: node {i} at {node} is outside the page's "
                    f"node area {upper}-{self.psize}",
                    offset + PAGE_HEADER + 2 * i,
                )
        return nodes

    def _node_key(self, page: int, node: int, i: int, ksize: int, what: str) -> bytes:
        start = page + node + NODE_HEADER
        if node + NODE_HEADER + ksize > self.psize:
            raise PageError(
                f"{what} page {page // self.psize} is damaged: key {i} ({ksize} bytes) runs past "
                "the page",
                page + node,
            )
        return bytes(self.buf[start : start + ksize])

    def _expand(self, table: _Table, i: int) -> _Table:
        """``table`` with branch entry ``i`` replaced by the children of its page (leaves, or
        branches not read yet), or by a leaf entry that carries the damage that makes the keys
        below it unreachable; the new table becomes the tree (and :attr:`table`, unless the map
        is trusted). Under the lock."""
        entry = table.entries[i]
        assert isinstance(entry, _Branch)
        low = table.lows[i]
        high = table.lows[i + 1] if i + 1 < len(table.lows) else None
        lows: list[bytes]
        entries: list[_Leaf | _Branch]
        try:
            if entry.root and self._header(entry.pgno, "root")[0] & _TYPE_BITS == P_LEAF:
                lows, entries = [low], [_Leaf(entry.pgno)]
            else:
                children = self._branch(entry.pgno, low, high, entry.depth)
                leaves = self._children_are_leaves([child for child, _ in children])
                lows, entries = [], []
                for child, child_low in children:
                    lows.append(child_low)
                    if self._mark_seen(child):
                        offset = child * self.psize
                        entries.append(
                            _Leaf(child, PageError(f"page {child} is referenced twice", offset))
                        )
                    elif leaves:
                        entries.append(_Leaf(child))
                    else:
                        entries.append(_Branch(child, entry.depth + 1))
        except PageError as exc:
            lows, entries = [low], [_Leaf(entry.pgno, exc)]
        state = table.state
        new = _Table(
            table.lows[:i] + lows + table.lows[i + 1 :],
            table.entries[:i] + entries + table.entries[i + 1 :],
            state[:i] + bytearray(len(entries)) + state[i + 1 :],
        )
        self._tree = new
        if not self.trusted:
            self.table = new
        return new

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
            mp_pgno, _pad, flags, _lower, _upper = PAGE_HEADER_STRUCT.unpack_from(self.buf, offset)
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
        if self.trusted:
            return True
        if not self._checked_leaf(key, None, None):
            return False
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
        keys: list[bytes] = []
        values: list[bytes | None] = []
        self._checked_leaf(key, keys, values)
        return keys, values

    def _checked_leaf(
        self, key: bytes, keys: list[bytes] | None, values: list[bytes | None] | None
    ) -> bool:
        """Read the branches down to the leaf that would hold ``key`` and check it (collecting
        its keys and values when asked, even if it was checked before); whether there is one.

        Raises:
            PageError: The leaf page, or a page above it, is damaged or missing.
        """
        with self._lock:
            table = self._tree
            i = bisect_right(table.lows, key) - 1
            if i < 0:
                return False
            while isinstance(table.entries[i], _Branch):
                table = self._expand(table, i)
                i = bisect_right(table.lows, key) - 1
            if table.state[i] == GOOD and keys is None:
                return True
            leaf = table.entries[i]
            assert isinstance(leaf, _Leaf)
            if leaf.damage is not None:
                raise leaf.damage
            high = table.lows[i + 1] if i + 1 < len(table.lows) else None
            try:
                self._scan_leaf(leaf.pgno, table.lows[i], high, keys, values)
            except PageError as exc:
                leaf.damage = exc
                raise
            table.state[i] = GOOD
            return True

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
            start = node + NODE_HEADER
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
