"""An opened LMDB shard file: its checks before LMDB maps it (:func:`check_file`) and what they
found (:class:`OpenedFile`)."""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time

from fastload.errors import CorruptDataError
from fastload.formats import _cache
from fastload.formats._base import ShardReader
from fastload.formats.lmdb._layout import REMEDY
from fastload.formats.lmdb._pagemap import PageMap
from fastload.formats.lmdb._pages import (
    FileBytes,
    MetaPage,
    PageError,
    matches_manifest,
    read_meta,
)

__all__ = ["OpenedFile", "check_file"]

log = logging.getLogger("fastload.formats.lmdb")


def check_file(
    view: FileBytes, size: int, reader: ShardReader, st: os.stat_result | None = None
) -> OpenedFile:
    """The meta pages and the length of the file of ``reader``'s shard (``size`` bytes in
    ``view``; ``st``: its ``fstat``), before LMDB maps it; and whether its bytes are the
    manifest's (:func:`~fastload.formats.lmdb._pages.matches_manifest`, or a process on this
    machine found so: :mod:`~fastload.formats._cache._trust`): then no page of it needs checks.

    A file whose bytes differ from the manifest's is read with the page checks, and a warning
    says so once per opening (damaged values that still decode are not found by them).

    Raises:
        CorruptDataError: A meta page is damaged, or the file is no LMDB file.
    """
    try:
        meta = read_meta(view, size)
    except PageError as exc:
        raise CorruptDataError(
            f"{exc}: the shard is damaged or not an LMDB file ({size} bytes); {REMEDY}",
            url=reader.url,
            offset=exc.offset,
        ) from exc
    expected = reader.expected_bytes
    truncation = ""
    if size < meta.needed or (expected is not None and size < expected):
        sizes = [f"its meta page needs {meta.needed}"]
        if expected is not None:
            sizes.append(f"the manifest says {expected}")
        truncation = f"the shard is truncated at {size} bytes ({', '.join(sizes)})"
    intact = _intact(view, size, meta, reader, st)
    if intact is False:
        log.warning(
            "%s: the shard's bytes do not match the SHA-256 of the dataset manifest; reading it "
            "with checks of the pages it reads, which find damaged structure but not damaged "
            "values that still decode (`fastload verify` compares the whole shard); %s",
            reader.url,
            REMEDY,
        )
    return OpenedFile(view, size, meta, PageMap(view, size, meta, truncation, trusted=bool(intact)))


def _intact(
    view: FileBytes, size: int, meta: MetaPage, reader: ShardReader, st: os.stat_result | None
) -> bool | None:
    """:func:`matches_manifest`, remembered for the file ``st`` on the machine
    (:mod:`~fastload.formats._cache._trust`)."""
    sha256, expected = reader.expected_sha256, reader.expected_bytes
    if st is None or sha256 is None or st.st_size != size:
        return matches_manifest(view, size, meta, sha256, expected)
    if expected == size and size >= meta.needed and _cache.known(st, sha256):
        return True
    started = time.time_ns()
    intact = matches_manifest(view, size, meta, sha256, expected)
    if intact:
        _cache.remember(st, sha256, started)
    return intact


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
