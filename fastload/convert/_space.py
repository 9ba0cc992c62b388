"""A destination without room, said clearly: a full disk, a quota, a file size limit.

The errno that tells a full disk apart is lost when an error travels from a worker process to the
converting one, so workers turn such a failure into a :class:`~fastload.errors.StoreError` naming
the shard (:func:`raise_if_no_space`), and the converting process does the same for the objects it
writes itself (:func:`space_for`).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator

from fastload.convert._plan import ShardPlan
from fastload.convert._progress import format_bytes
from fastload.errors import FastloadError, StoreError
from fastload.storage import Store

__all__ = ["raise_if_no_space", "space_for"]

#: ``errno`` values that mean the destination has no room: a full disk, a quota, a size limit.
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def _space_errno(exc: BaseException) -> int | None:
    """The ``errno`` of a full disk (or quota, or file size limit) behind ``exc``, if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _NO_SPACE:
            return current.errno
        text = str(current)
        if "No space left on device" in text or "Disk quota exceeded" in text:
            return errno.ENOSPC  # LMDB reports the errno only in its message
        current = current.__cause__ or current.__context__
    return None


def _space_message(where: str, code: int) -> str:
    why = {
        errno.ENOSPC: "the destination has no space left",
        errno.EDQUOT: "the destination's disk quota is used up",
        errno.EFBIG: "a file grew past the largest size allowed (a file system limit or this "
        "process's file size limit, `ulimit -f`)",
    }[code]
    return (
        f"cannot write {where}: {why} ({os.strerror(code)}). Nothing partial is left under the "
        "final name. Free space (or raise the limit), then re-run the same command: the "
        "finished shards are kept and the conversion resumes"
    )


def raise_if_no_space(exc: BaseException, store: Store, shard: ShardPlan) -> None:
    """Raise a clear error if ``shard`` failed with ``exc`` for lack of space. Called in the
    worker: the errno does not survive the error's trip to the parent."""
    code = _space_errno(exc)
    if code is not None:
        url = store.child_url(shard.name)
        what = f"shard {url} (planned for about {format_bytes(shard.est_bytes)})"
        raise StoreError(_space_message(what, code), url=url) from exc


@contextlib.contextmanager
def space_for(store: Store, key: str) -> Iterator[None]:
    """Turn a lack of space while the parent writes ``key`` into a clear error."""
    try:
        yield
    except (OSError, FastloadError) as exc:
        code = _space_errno(exc)
        if code is None:
            raise
        url = store.child_url(key)
        raise StoreError(_space_message(url, code), url=url) from exc
