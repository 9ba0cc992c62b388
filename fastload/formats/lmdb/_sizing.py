"""How large the LMDB file of a shard's entries will be: LMDB's page arithmetic, for the writer's
:attr:`~fastload.formats.lmdb.LMDBWriter.num_bytes` and the map size it builds the file in."""

from __future__ import annotations

from fastload.formats.lmdb._pages import NODE_HEADER, PAGE_HEADER

__all__ = ["PageCount"]

#: A node pointer (uint16) and an overflow page number (uint64), 64-bit builds.
_NODE_POINTER = 2
_PGNO = 8


class _Leaves:
    """Leaf pages filled the way ``MDB_APPEND`` fills them: each node goes on the current page if
    it fits, else on a new one."""

    def __init__(self, usable: int) -> None:
        self.usable = usable
        self.pages = 0
        self.free = 0  # bytes left on the current page
        self.largest = 0  # largest node (with its pointer) seen

    def add(self, node: int) -> None:
        if node > self.free:
            self.pages += 1
            self.free = self.usable
        self.free -= node
        self.largest = max(self.largest, node)


class PageCount:
    """Page arithmetic of an LMDB database whose entries are inserted in key order
    (``MDB_APPEND``): LMDB fills each leaf page before starting the next, puts values too large
    for a leaf on their own run of overflow pages, and indexes the leaves with branch pages.

    Reserved entries are counted in their real order; samples in the order they were written,
    which gives the same page count as key order up to how nodes of different sizes happen to
    pack. Every query is O(1).
    """

    def __init__(self, psize: int) -> None:
        self.psize = psize
        self.usable = psize - PAGE_HEADER
        # LMDB 0.9 ``me_nodemax``: larger leaf nodes move their value to overflow pages.
        self.node_max = ((self.usable // 2) & ~1) - _NODE_POINTER
        self.overflow_pages = 0
        self.reserved = _Leaves(self.usable)
        self.samples = _Leaves(self.usable)
        self.key_bytes = 0
        self.entries = 0
        self.longest_key = 0

    def add(self, key_len: int, value_len: int, *, reserved: bool = False) -> None:
        """Count one entry of a ``key_len``-byte key and a ``value_len``-byte value."""
        node = NODE_HEADER + key_len + value_len
        if node > self.node_max:
            self.overflow_pages += (PAGE_HEADER - 1 + value_len) // self.psize + 1
            node = NODE_HEADER + key_len + _PGNO
        (self.reserved if reserved else self.samples).add(((node + 1) & ~1) + _NODE_POINTER)
        self.key_bytes += key_len
        self.entries += 1
        self.longest_key = max(self.longest_key, key_len)

    def _branch_pages(self, leaves: int, node: int, fill: float) -> int:
        """Branch pages above ``leaves`` leaf pages, for branch nodes of ``node`` bytes and
        pages at least ``fill`` used."""
        per_page = max(2, int(self.usable * fill) // node)
        total, level = 0, leaves
        while level > 1:
            level = -(-level // per_page)
            total += level
        return total

    def estimate(self) -> int:
        """Expected file size in bytes: two meta pages, overflow pages, leaf and branch pages."""
        leaves = self.reserved.pages + self.samples.pages
        mean_key = self.key_bytes // max(1, self.entries)
        node = ((NODE_HEADER + mean_key + 1) & ~1) + _NODE_POINTER
        return (2 + self.overflow_pages + leaves + self._branch_pages(leaves, node, 1.0)) * (
            self.psize
        )

    def bound(self) -> int:
        """A map size in bytes that the database surely fits in: another order of the samples
        leaves every leaf page at least half full (no node is larger than half a page), so at
        most twice the leaf bytes; branch pages at least half full with the longest key."""
        leaves = self.reserved.pages + 2 * self.samples.pages + 2
        node = ((NODE_HEADER + self.longest_key + 1) & ~1) + _NODE_POINTER
        pages = 2 + self.overflow_pages + leaves + self._branch_pages(leaves, node, 0.5) + 16
        return pages * self.psize
