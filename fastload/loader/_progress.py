"""What each DataLoader worker is doing, published in shared memory for failure reports.

A worker that dies (a crash in a decoder, ``SIGBUS`` from a shard truncated while memory-mapped,
the OOM killer) cannot say what it was doing, so it says it beforehand: each worker owns one row
of a shared table, and writes into it the global step it assembles, the dataset index it decodes,
and, per reading thread, the (step, dataset index) of the read in progress. The main process reads
the table when a worker is gone (:meth:`ProgressTable.snapshot`) and names the sample.

Writes go through a NumPy view of the shared tensor (about 0.1 us each, against 8 us for a torch
``__setitem__``: they happen once per sample).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from fastload._lazy import current_pid

__all__ = ["ProgressTable", "WorkerProgress", "read_slot_initializer"]

# Columns of a worker's row: pid, the step being assembled, the dataset index being decoded, then
# (step, dataset index) of the read in progress in each read slot.
_COL_PID, _COL_STEP, _COL_INDEX, _COL_READS = 0, 1, 2, 3
# Which read slot the current thread writes: 0 for a worker's own thread, 1.. for the reader
# threads of its pool (assigned when a pool thread starts).
_THREAD = threading.local()


def _assign_read_slot(slots: Iterator[int]) -> None:
    _THREAD.slot = next(slots)


def read_slot_initializer() -> tuple[Any, tuple[Iterator[int]]]:
    """``(initializer, initargs)`` for a reader thread pool: each new thread gets its own read
    slot (1, 2, ...; the worker's own thread writes slot 0)."""
    return _assign_read_slot, (itertools.count(1),)


@dataclass(frozen=True)
class WorkerProgress:
    """What one worker was doing when last seen (from the shared progress table).

    Attributes:
        pid: The worker's process id (-1: it never started).
        step: Global step of the batch it was assembling.
        index: Dataset index of the sample it was decoding/transforming, -1 when none (between
            samples, or while it waited for the training loop).
        reads: ``(global step, dataset index)`` of each read in progress (one per reader
            thread that was inside a read), in thread order.
    """

    pid: int
    step: int
    index: int
    reads: tuple[tuple[int, int], ...]


class ProgressTable:
    """The shared table: one row per worker, one read slot per reading thread (see module doc).

    Args:
        num_workers: Rows (at least one: the main process reads as worker 0).
        io_threads: Reader threads per worker (each gets a slot, beside the worker's own).

    Pickles with its shared memory (made before the workers start, inherited by them).
    """

    def __init__(self, num_workers: int, io_threads: int) -> None:
        rows, cols = max(1, num_workers), _COL_READS + 2 * (1 + io_threads)
        self._table = torch.full((rows, cols), -1, dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]
        self._view: npt.NDArray[np.int64] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"_table": self._table, "_view": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        # A plain pickle copies the tensor into private memory: share it again so that workers
        # started from this copy see it (torch's own pickler keeps it shared: a no-op then).
        if not self._table.is_shared():
            self._table.share_memory_()

    def _numpy(self) -> npt.NDArray[np.int64]:
        if self._view is None:
            self._view = self._table.numpy()
        return self._view

    def report(self, worker: int, step: int, index: int) -> None:
        """Record that ``worker`` (in this process) assembles global ``step`` and decodes dataset
        index ``index`` (-1: no sample)."""
        view = self._numpy()
        if worker < len(view):
            row = view[worker]
            row[_COL_PID] = current_pid()
            row[_COL_STEP] = step
            row[_COL_INDEX] = index

    def read_slot(self, worker: int) -> npt.NDArray[np.int64] | None:
        """The calling thread's ``[step, index]`` read record in ``worker``'s row (a view to
        write into; ``index`` -1 when no read is in progress), or ``None`` if it has none."""
        view = self._numpy()
        if worker >= len(view):
            return None
        col = _COL_READS + 2 * getattr(_THREAD, "slot", 0)
        if col + 2 > view.shape[1]:
            return None
        return view[worker, col : col + 2]

    def snapshot(self) -> list[WorkerProgress]:
        """What each worker was last doing, in worker order."""
        out = []
        for row in self._table.tolist():
            slots = row[_COL_READS:]
            reads = tuple(
                (int(slots[j]), int(slots[j + 1]))
                for j in range(0, len(slots), 2)
                if slots[j + 1] >= 0
            )
            out.append(
                WorkerProgress(int(row[_COL_PID]), int(row[_COL_STEP]), int(row[_COL_INDEX]), reads)
            )
        return out
