"""A JSON-lines log of a loader's ``stats()``: one file per rank, a line every few seconds.

:func:`log_stats` appends ``{"time", "rank", "world_size", "node", "pid", **loader.stats()}`` to
``<log_dir>/rank-<rank>.jsonl`` every ``every_s`` seconds of iteration, at the end of each
iteration (so every epoch has its line) and a last time on :meth:`StatsLog.close`. The lines are
cumulative counters (as ``stats()`` gives them), so rates are differences of two lines; a crash
loses at most the last interval. ``fastload report LOG_DIR`` draws the files of every rank.

No glue and no thread: the log watches the loader's cursor, which every fastload loader keeps, and
writes from the loader's own thread between two batches (one clock read per batch otherwise). A
thread would be unsafe: ``stats()`` reads the node cache's counters under a file lock, and a
DataLoader forking its workers while another thread holds that lock leaves the workers waiting
for it forever.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any, Protocol

from fastload._units import check_int
from fastload.errors import InvalidArgumentError
from fastload.loader.order._cursor import EpochCursor

__all__ = ["StatsLog", "log_stats"]


class _HasStats(Protocol):
    def stats(self) -> dict[str, Any]: ...


class StatsLog:
    """The log :func:`log_stats` started; :meth:`close` (or ``with``) writes a last line and
    stops logging."""

    def __init__(
        self, loader: _HasStats, cursor: Any, path: str, every_s: float, rank: int, world: int
    ):
        self.loader, self.path, self.every_s = loader, path, every_s
        self._head = {"rank": rank, "world_size": world, "node": socket.gethostname()}
        self._cursor = cursor
        self._epoch: Any = None
        self._next_at = time.monotonic() + every_s
        self._closed = False
        cursor.watchers.append(self._watch)
        self.write()

    def write(self) -> dict[str, Any]:
        """Append one line now; returns it."""
        line = {"time": time.time(), **self._head, "pid": os.getpid(), **self.loader.stats()}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
        self._epoch = line.get("epoch")
        self._next_at = time.monotonic() + self.every_s
        return line

    def _watch(self) -> None:
        if time.monotonic() >= self._next_at or self._cursor.epoch != self._epoch:
            self.write()

    def close(self) -> None:
        """Write the last line and stop logging."""
        if not self._closed:
            self._closed = True
            self._cursor.watchers.remove(self._watch)
            self.write()

    def __enter__(self) -> StatsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def log_stats(
    loader: _HasStats, log_dir: str | os.PathLike[str], *, every_s: float = 10.0
) -> StatsLog:
    """Log ``loader.stats()`` to ``<log_dir>/rank-<rank>.jsonl`` (see the module doc).

    Args:
        loader: A fastload loader (``DataLoader``, ``TokenLoader``, ``DALILoader``,
            ``WebLoader``); its ``rank`` and ``world_size`` name the file (0 of 1 without).
        log_dir: A local directory (made if missing), shared by the ranks of a job or not.
        every_s: Seconds between lines while iterating (each iteration's end also writes one).

    Raises:
        InvalidArgumentError: ``every_s`` is not positive, or ``loader`` is not a fastload
            loader.
    """
    if not isinstance(every_s, int | float) or isinstance(every_s, bool) or every_s <= 0:
        raise InvalidArgumentError(f"every_s must be a positive number of seconds, got {every_s!r}")
    cursor = getattr(loader, "_cursor", None)  # every fastload loader keeps one (order/_cursor)
    if not isinstance(cursor, EpochCursor):
        raise InvalidArgumentError(
            f"log_stats logs fastload's loaders (DataLoader, TokenLoader, DALILoader, WebLoader), "
            f"got {type(loader).__name__}"
        )
    rank = check_int("rank", getattr(loader, "rank", 0) or 0)
    world = check_int("world_size", getattr(loader, "world_size", 1) or 1, minimum=1)
    os.makedirs(log_dir, exist_ok=True)
    path = os.path.join(os.fspath(log_dir), f"rank-{rank}.jsonl")
    return StatsLog(loader, cursor, path, every_s, rank, world)
