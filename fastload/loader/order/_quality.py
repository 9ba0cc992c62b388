"""How far an epoch's block shuffle is from a uniform permutation, measured on the order itself.

The block shuffle (:mod:`._order`) reads ``block_size`` consecutive samples of a shard together
and mixes them within windows of ``window`` blocks: that is what makes it fast, and also what
keeps samples of one shard near each other. :func:`order_quality` measures that closeness for a
dataset's shard sizes and shuffle options, beside what a uniform permutation of the same samples
gives, so that ``block_size`` and ``window`` can be chosen knowingly (``fastload inspect
--order`` prints it):

* ``adjacent_same_shard``: the share of consecutive epoch positions whose samples come from the
  same shard (uniform: ``sum n_s (n_s - 1) / (N (N - 1))``);
* ``mates_per_sample``: for a sample, the other samples of its shard in the same batch, on
  average over samples (uniform: ``(B - 1)`` times the share above);
* ``distinct_shards_per_batch``: the 10th, 50th and 90th percentile of the number of shards a
  batch draws from (uniform: its expectation, from the hypergeometric law).

Nothing is read: the order is a pure function of (seed, epoch, shard sizes, options). The first
``limit`` positions of the epoch are measured (the whole epoch when it is shorter), in
O(``limit``) time and memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fastload._units import check_int
from fastload.errors import InvalidArgumentError
from fastload.loader.order._order import EpochOrder, OrderOptions

__all__ = ["OrderQuality", "order_quality"]

#: Positions measured by default: enough for stable shares at any dataset size (~0.2 s).
DEFAULT_LIMIT = 1_000_000


@dataclass(frozen=True)
class OrderQuality:
    """What :func:`order_quality` measured (see the module doc); ``*_uniform`` are the values a
    uniform permutation of the same samples has (expectations)."""

    num_samples: int
    num_shards: int
    positions: int
    batch_size: int
    adjacent_same_shard: float
    adjacent_same_shard_uniform: float
    mates_per_sample: float
    mates_per_sample_uniform: float
    distinct_shards_per_batch: tuple[float, float, float]
    distinct_shards_per_batch_uniform: float

    def rows(self) -> list[tuple[str, str, str]]:
        """``(measure, this order, uniform)`` rows for a table."""
        p10, p50, p90 = self.distinct_shards_per_batch
        return [
            (
                "adjacent pairs from one shard",
                f"{self.adjacent_same_shard:.2%}",
                f"{self.adjacent_same_shard_uniform:.2%}",
            ),
            (
                f"shard-mates of a sample in its batch of {self.batch_size}",
                f"{self.mates_per_sample:.2f}",
                f"{self.mates_per_sample_uniform:.2f}",
            ),
            (
                "shards per batch (p10 / p50 / p90)",
                f"{p10:g} / {p50:g} / {p90:g}",
                f"{self.distinct_shards_per_batch_uniform:.1f} (mean)",
            ),
        ]


def order_quality(
    shard_sizes: Sequence[int] | npt.NDArray[np.int64],
    order: OrderOptions,
    *,
    batch_size: int = 256,
    epoch: int = 0,
    limit: int = DEFAULT_LIMIT,
) -> OrderQuality:
    """Measure the epoch order of ``order``'s options over shards of ``shard_sizes``.

    Args:
        shard_sizes: Samples per shard, in manifest order.
        order: The shuffle options (``shuffle=False`` measures the dataset order).
        batch_size: Samples per batch (the global batch: what one optimizer step sees).
        epoch: The epoch whose order is measured.
        limit: Positions measured at most (the first ``limit`` of the epoch).

    Raises:
        InvalidArgumentError: A bad option, or a dataset of fewer than two samples.
    """
    check_int("batch_size", batch_size, minimum=1)
    check_int("limit", limit, minimum=2)
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    n = int(sizes.sum())
    if n < 2:
        raise InvalidArgumentError(f"an order of {n} samples has no pairs to measure")
    epoch_order = EpochOrder(
        sizes.tolist(),
        seed=order.seed,
        epoch=epoch,
        shuffle=order.shuffle,
        block_size=order.block_size,
        window=order.window,
    )
    positions = min(n, limit)
    starts = np.cumsum(sizes) - sizes
    shard = np.searchsorted(starts, epoch_order.indices(np.arange(positions)), side="right") - 1
    same = _n_pairs_same(sizes) / (n * (n - 1))
    b = min(batch_size, positions)
    batches = np.sort(shard[: positions // b * b].reshape(-1, b), axis=1)
    new_shard = np.ones_like(batches, dtype=bool)
    new_shard[:, 1:] = batches[:, 1:] != batches[:, :-1]
    distinct = new_shard.sum(axis=1)
    return OrderQuality(
        num_samples=n,
        num_shards=len(sizes),
        positions=positions,
        batch_size=b,
        adjacent_same_shard=float(np.mean(shard[1:] == shard[:-1])),
        adjacent_same_shard_uniform=same,
        mates_per_sample=_mates(batches, new_shard),
        mates_per_sample_uniform=(b - 1) * same,
        distinct_shards_per_batch=tuple(  # type: ignore[arg-type]
            float(v) for v in np.percentile(distinct, [10, 50, 90], method="lower")
        ),
        distinct_shards_per_batch_uniform=_distinct_uniform(sizes, n, b),
    )


def _n_pairs_same(sizes: npt.NDArray[np.int64]) -> float:
    """Ordered pairs of distinct samples that share a shard: ``sum n_s (n_s - 1)``."""
    s = sizes.astype(np.float64)
    return float(np.sum(s * (s - 1)))


def _mates(batches: npt.NDArray[np.int64], new_shard: npt.NDArray[np.bool_]) -> float:
    """Mean over samples of the other samples of their shard in their (row-sorted) batch."""
    run_id = np.cumsum(new_shard, axis=1) - 1  # which run of equal shards each slot is in
    rows = np.repeat(np.arange(len(batches)), batches.shape[1])
    counts = np.zeros((len(batches), batches.shape[1]), dtype=np.int64)
    np.add.at(counts, (rows, run_id.ravel()), 1)
    return float(np.sum(counts * (counts - 1)) / batches.size)


def _distinct_uniform(sizes: npt.NDArray[np.int64], n: int, b: int) -> float:
    """The expected number of shards a uniform batch of ``b`` of the ``n`` samples draws from:
    the sum over shards of 1 - P(none of its n_s samples drawn), hypergeometric."""
    total = 0.0
    values, counts = np.unique(sizes[sizes > 0], return_counts=True)
    log_all = math.lgamma(n + 1) - math.lgamma(n - b + 1)
    for size, count in zip(values.tolist(), counts.tolist(), strict=True):
        if n - size < b:
            total += count  # every batch draws from it
            continue
        log_none = math.lgamma(n - size + 1) - math.lgamma(n - size - b + 1) - log_all
        total += count * -math.expm1(log_none)
    return total
