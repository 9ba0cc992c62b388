"""Checks of an LMDB file's B+tree pages, made before LMDB reads them (see :class:`PageMap`), and
the opened file they are made on (:class:`OpenedFile`)."""

from __future__ import annotations

import mmap
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

__all__ = ["GOOD", "OpenedFile", "PageMap"]

_TYPE_BITS = P_BRANCH | P_LEAF | P_OVERFLOW | P_META | P_LEAF2 | P_SUBP
#: LMDB's cursor stack depth: no tree is deeper.
_MAX_DEPTH = 32
_OVERFLOW = struct.Struct("<QHHI")  # pgno, pad, flags, pages
_NODE = struct.Struct("<HHHH")  # lo, hi, flags, ksize
_U64 = struct.Struct("<Q")


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


class OpenedFile:
    """One opened shard file: the read-only map of the file that the page checks read, its meta
    page, its page map (rebuilt when the file shrinks) and the sample count the reader found in
    its meta key. The reader closes it with the LMDB environment."""

    def __init__(self, view: FileBytes, size: int, meta: MetaPage, pages: PageMap) -> None:
        self.view, self.size, self.meta, self.pages = view, size, meta, pages
        self.count = 0
        self._lock = threading.Lock()

    def shrunk(self) -> bool:
        """Whether the file became shorter than when it was checked (truncated in place while
        open); if so, the page map is rebuilt for the bytes left, so that no page past the new
        end is read (which would raise ``SIGBUS``).

        Readers call it before every read (one ``fstat``). It narrows the window, it cannot close
        it: a truncation between the check and the copy of the value still faults. Shards must
        be replaced atomically (fastload's writers and stores do), never rewritten in place.
        """
        view = self.view
        if not isinstance(view, mmap.mmap):
            return False
        try:
            size = view.size()  # fstat of the mapped file
        except (OSError, ValueError):  # closed meanwhile: the caller's next step fails cleanly
            return False
        if size >= self.size:
            return False
        with self._lock:
            if size < self.size:
                truncation = (
                    f"the shard was truncated to {size} bytes while open (it had {self.size})"
                )
                self.pages = PageMap(view, size, self.meta, truncation)
                self.size = size
        return True

    def close(self) -> None:
        """Unmap the file (the page map is unusable afterwards)."""
        if isinstance(self.view, mmap.mmap):
            self.view.close()
