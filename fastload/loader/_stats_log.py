"""A JSON-lines log of a loader's ``stats()``: one file per rank, a line every few seconds.

:func:`log_stats` starts a daemon thread that appends ``{"time", "rank", "world_size", "node",
"pid", **loader.stats()}`` to ``<log_dir>/rank-<rank>.jsonl`` every ``every_s`` seconds, one more
whenever the loader's epoch changes, and a last one on :meth:`StatsLog.close`. The lines are
cumulative counters (as ``stats()`` gives them), so rates are differences of two lines; a crash
loses at most the last interval. ``fastload report LOG_DIR`` draws the files of every rank.

No glue: the thread only calls ``loader.stats()`` (a snapshot of plain counters, and the node
cache's counters when the dataset reads through ``cache_dir``), so it works for every fastload
loader and costs the training loop nothing.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Any, Protocol

from fastload._units import check_int
from fastload.errors import InvalidArgumentError

__all__ = ["StatsLog", "log_stats"]


class _HasStats(Protocol):
    def stats(self) -> dict[str, Any]: ...


class StatsLog:
    """The log :func:`log_stats` started; :meth:`close` (or ``with``) writes a last line and
    stops the thread."""

    def __init__(self, loader: _HasStats, path: str, every_s: float, rank: int, world: int):
        self.loader, self.path, self.every_s = loader, path, every_s
        self._head = {"rank": rank, "world_size": world, "node": socket.gethostname()}
        self._stop = threading.Event()
        self._epoch: Any = None
        self._thread = threading.Thread(target=self._run, name="fastload-stats-log", daemon=True)
        self._thread.start()

    def write(self) -> dict[str, Any]:
        """Append one line now; returns it."""
        line = {"time": time.time(), **self._head, "pid": os.getpid(), **self.loader.stats()}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
        self._epoch = line.get("epoch")
        return line

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.wait(min(0.2, self.every_s)):
            epoch = getattr(self.loader, "epoch", self._epoch)  # every fastload loader has it
            if epoch != self._epoch or time.monotonic() >= next_at:
                self.write()
                next_at = time.monotonic() + self.every_s

    def close(self) -> None:
        """Stop the thread and write the last line."""
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join()
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
        every_s: Seconds between lines (a line is also written when the epoch changes).

    Raises:
        InvalidArgumentError: ``every_s`` is not positive.
    """
    if not isinstance(every_s, int | float) or isinstance(every_s, bool) or every_s <= 0:
        raise InvalidArgumentError(f"every_s must be a positive number of seconds, got {every_s!r}")
    rank = check_int("rank", getattr(loader, "rank", 0) or 0)
    world = check_int("world_size", getattr(loader, "world_size", 1) or 1, minimum=1)
    os.makedirs(log_dir, exist_ok=True)
    return StatsLog(
        loader, os.path.join(os.fspath(log_dir), f"rank-{rank}.jsonl"), every_s, rank, world
    )
