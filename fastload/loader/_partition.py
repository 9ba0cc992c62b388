"""Partitioning an epoch's global order into global steps, rank batches and worker tasks.

Definitions (``N`` samples, world size ``W``, per-rank batch size ``B``, global batch ``G = W x B``):

* The epoch's positions ``0 .. N-1`` are visited in the order of :class:`~fastload.loader._order.
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

from dataclasses import dataclass

from fastload.errors import InvalidArgumentError

__all__ = ["Partition"]


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class Partition:
    """How one epoch of ``num_samples`` positions is split into global steps and rank batches.

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
        if (
            isinstance(self.num_samples, bool)
            or not isinstance(self.num_samples, int)
            or self.num_samples < 0
        ):
            raise InvalidArgumentError(
                f"num_samples must be a non-negative int, got {self.num_samples!r}"
            )
        _positive("world_size", self.world_size)
        _positive("batch_size", self.batch_size)

    @property
    def global_batch_size(self) -> int:
        """``G = W x B``."""
        return self.world_size * self.batch_size

    @property
    def padded(self) -> int:
        """Repeated positions added this epoch (``0 <= padded < W``; 0 with ``drop_last``)."""
        if self.drop_last or self.num_samples == 0:
            return 0
        return -self.num_samples % self.world_size

    @property
    def total_positions(self) -> int:
        """Positions delivered by all ranks in a full epoch (``N + padded``, or ``steps x G``)."""
        if self.drop_last:
            return self.full_steps * self.global_batch_size
        return self.num_samples + self.padded

    @property
    def full_steps(self) -> int:
        """Global steps with exactly ``G`` positions."""
        if self.drop_last:
            return self.num_samples // self.global_batch_size
        return (self.num_samples + self.padded) // self.global_batch_size

    @property
    def tail(self) -> int:
        """Positions in the final, incomplete global step (a multiple of ``W``; 0 if none)."""
        if self.drop_last:
            return 0
        return self.num_samples + self.padded - self.full_steps * self.global_batch_size

    @property
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

    def source_position(self, position: int) -> int:
        """The epoch position whose sample fills ``position`` (itself unless it is padding)."""
        if position < self.num_samples:
            return position
        return (position - self.num_samples) % self.num_samples

    def worker_steps(self, start_step: int, worker: int, num_workers: int) -> range:
        """Global steps (``>= start_step``) whose batches worker ``worker`` of ``num_workers``
        produces, in increasing order."""
        _positive("num_workers", num_workers)
        if not 0 <= worker < num_workers:
            raise InvalidArgumentError(f"worker must be in [0, {num_workers}), got {worker}")
        if start_step < 0:
            raise InvalidArgumentError(f"start step must be >= 0, got {start_step}")
        return range(start_step + worker, self.num_steps, num_workers)

    def remaining_steps(self, start_step: int) -> int:
        """Batches a rank yields when it starts at global step ``start_step``."""
        return max(0, self.num_steps - start_step)
