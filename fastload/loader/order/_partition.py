"""Partitioning an epoch's global order into global steps, rank batches and worker tasks.

Definitions (``N`` samples, world size ``W``, per-rank batch size ``B``, global batch ``G = W x B``):

* The epoch's positions ``0 .. N-1`` are visited in the order of :class:`~fastload.loader.order._order.
  EpochOrder`. **Global step** ``s`` covers positions ``[s·G, (s+1)·G)``; rank ``r`` takes
  ``[s·G + r·B, s·G + (r+1)·B)``.
* **Remainder policy** ``pad`` (``drop_last=False``, the default): the positions are padded to a
  multiple of ``W`` (at most ``W - 1`` extra positions); padded position ``p >= N`` repeats position
  ``(p - N) mod N`` (the first positions of the epoch). The final, incomplete global step is split
  into ``W`` equal parts, so every rank yields the same number of batches and the last batch of each
  rank may be smaller than ``B``. Every sample is delivered exactly once plus the counted repeats.
* ``drop_last=True`` drops the incomplete final global step: ``N mod G`` samples are not delivered
  this epoch (which ones changes with the epoch when shuffling) and every batch has ``B`` samples.
* **Workers**: a rank's batch for global step ``s`` (``s >= start``) is produced by worker
  ``(s - start) mod num_workers``. That is the order in which ``torch.utils.data.DataLoader`` asks
  its workers for items, so the rank receives its batches in step order.

Everything here is arithmetic on integers: O(1) memory, no communication between ranks, and a rank
can never wait for another (each knows its own batch count).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fastload._units import check_int
from fastload.errors import InvalidArgumentError

__all__ = ["Partition"]


@dataclass(frozen=True)
class Partition:
    """How one epoch of ``num_samples`` positions is split into global steps and rank batches.

    The derived sizes (``num_steps``, ``full_steps``, ...) are computed once per instance (the
    step planner asks for them every batch).

    Attributes:
        num_samples: ``N``, samples in the epoch.
        world_size: ``W``, number of ranks.
        batch_size: ``B``, samples per rank batch.
        drop_last: Drop the incomplete last global step instead of padding.
    """

    num_samples: int
    world_size: int
    batch_size: int
    drop_last: bool = False

    def __post_init__(self) -> None:
        check_int("num_samples", self.num_samples)
        check_int("world_size", self.world_size, minimum=1)
        check_int("batch_size", self.batch_size, minimum=1)

    @property
    def global_batch_size(self) -> int:
        """``G = W x B``."""
        return self.world_size * self.batch_size

    @functools.cached_property
    def padded(self) -> int:
        """Repeated positions added this epoch (``0 <= padded < W``; 0 with ``drop_last``)."""
        if self.drop_last or self.num_samples == 0:
            return 0
        return -self.num_samples % self.world_size

    @functools.cached_property
    def total_positions(self) -> int:
        """Positions delivered by all ranks in a full epoch (``N + padded``, or ``steps x G``)."""
        if self.drop_last:
            return self.full_steps * self.global_batch_size
        return self.num_samples + self.padded

    @functools.cached_property
    def full_steps(self) -> int:
        """Global steps with exactly ``G`` positions."""
        if self.drop_last:
            return self.num_samples // self.global_batch_size
        return (self.num_samples + self.padded) // self.global_batch_size

    @functools.cached_property
    def tail(self) -> int:
        """Positions in the final, incomplete global step (a multiple of ``W``; 0 if none)."""
        if self.drop_last:
            return 0
        return self.num_samples + self.padded - self.full_steps * self.global_batch_size

    @functools.cached_property
    def num_steps(self) -> int:
        """Global steps in the epoch = batches every rank yields."""
        return self.full_steps + (1 if self.tail else 0)

    @property
    def dropped(self) -> int:
        """Samples not delivered this epoch because of ``drop_last``."""
        return self.num_samples - self.total_positions if self.drop_last else 0

    def rank_range(self, step: int, rank: int) -> tuple[int, int]:
        """Epoch positions ``[start, stop)`` of rank ``rank``'s batch at global step ``step``.

        Positions ``>= N`` are padding (see :meth:`source_position`).
        """
        if not 0 <= rank < self.world_size:
            raise InvalidArgumentError(f"rank must be in [0, {self.world_size}), got {rank}")
        if not 0 <= step < self.num_steps:
            raise InvalidArgumentError(f"step must be in [0, {self.num_steps}), got {step}")
        if step < self.full_steps:
            start = step * self.global_batch_size + rank * self.batch_size
            return start, start + self.batch_size
        per_rank = self.tail // self.world_size
        start = self.full_steps * self.global_batch_size + rank * per_rank
        return start, start + per_rank

    def positions(
        self, step: int, rank: int
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
        """The epoch positions whose samples make up rank ``rank``'s batch at global ``step``, in
        batch order, and which rows are padding (a padding row repeats the position
        :meth:`source_position` gives). Every loader builds its batches from this."""
        start, stop = self.rank_range(step, rank)
        positions = np.arange(start, stop, dtype=np.int64)
        pad = positions >= self.num_samples
        if pad.any():
            positions[pad] = (positions[pad] - self.num_samples) % self.num_samples
        return positions, pad

    def source_position(self, position: int) -> int:
        """The epoch position whose sample fills ``position`` (itself unless it is padding)."""
        if position < self.num_samples:
            return position
        return (position - self.num_samples) % self.num_samples

    def worker_steps(self, start_step: int, worker: int, num_workers: int) -> range:
        """Global steps (``>= start_step``) whose batches worker ``worker`` of ``num_workers``
        produces, in increasing order."""
        check_int("num_workers", num_workers, minimum=1)
        if not 0 <= worker < num_workers:
            raise InvalidArgumentError(f"worker must be in [0, {num_workers}), got {worker}")
        if start_step < 0:
            raise InvalidArgumentError(f"start step must be >= 0, got {start_step}")
        return range(start_step + worker, self.num_steps, num_workers)

    def remaining_steps(self, start_step: int) -> int:
        """Batches a rank yields when it starts at global step ``start_step``."""
        return max(0, self.num_steps - start_step)
