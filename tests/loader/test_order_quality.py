"""The shuffle-quality measure (``fastload inspect --order``): against hand-computed values and
the theory of a uniform permutation."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fastload.errors import InvalidArgumentError
from fastload.loader import OrderOptions, order_quality


def test_the_dataset_order_by_hand() -> None:
    # Shards [0, 0, 1, 1]: in order, 2 of the 3 adjacent pairs share a shard; batches of 2 are
    # each one shard (1 mate per sample, 1 shard per batch). Uniform: 4 of the 12 ordered pairs
    # share a shard (1/3); a batch of 2 misses a shard with probability C(2,2)/C(4,2) = 1/6.
    q = order_quality([2, 2], OrderOptions(shuffle=False), batch_size=2)
    assert (q.num_samples, q.num_shards, q.positions, q.batch_size) == (4, 2, 4, 2)
    assert q.adjacent_same_shard == pytest.approx(2 / 3)
    assert q.adjacent_same_shard_uniform == pytest.approx(1 / 3)
    assert q.mates_per_sample == pytest.approx(1.0)
    assert q.mates_per_sample_uniform == pytest.approx(1 / 3)
    assert q.distinct_shards_per_batch == (1.0, 1.0, 1.0)
    assert q.distinct_shards_per_batch_uniform == pytest.approx(2 * (1 - 1 / 6))


def test_a_block_of_one_in_one_window_is_a_uniform_shuffle() -> None:
    sizes = [500] * 40  # 20,000 samples: one window holds them all
    q = order_quality(sizes, OrderOptions(block_size=1, window=20_000, seed=3), batch_size=100)
    assert q.adjacent_same_shard == pytest.approx(q.adjacent_same_shard_uniform, rel=0.15)
    assert q.mates_per_sample == pytest.approx(q.mates_per_sample_uniform, rel=0.1)
    assert q.distinct_shards_per_batch[1] == pytest.approx(
        q.distinct_shards_per_batch_uniform, abs=2
    )


def test_larger_blocks_and_smaller_windows_keep_shards_together() -> None:
    sizes = [1000] * 50
    measures = [
        order_quality(sizes, OrderOptions(block_size=b, window=w), batch_size=256)
        for b, w in [(1, 50_000), (64, 64), (64, 4), (None, 4)]
    ]
    mates = [m.mates_per_sample for m in measures]
    assert mates == sorted(mates), mates
    assert mates[-1] > 10 * mates[0]
    shards = [m.distinct_shards_per_batch[1] for m in measures]
    assert shards == sorted(shards, reverse=True), shards


def test_the_measure_is_the_loaders_order() -> None:
    """What is measured is the order a dataset iterates: count it from the samples' shards."""
    q = order_quality([7, 5, 9, 3], OrderOptions(block_size=2, window=3, seed=5), batch_size=4)
    from fastload.loader import EpochOrder

    order = EpochOrder([7, 5, 9, 3], seed=5, block_size=2, window=3)
    shard = np.searchsorted([0, 7, 12, 21], order.indices(np.arange(24)), side="right") - 1
    assert q.adjacent_same_shard == pytest.approx(float(np.mean(shard[1:] == shard[:-1])))
    distinct = sorted(len(set(shard[i : i + 4].tolist())) for i in range(0, 24, 4))
    assert q.distinct_shards_per_batch[1] == float(distinct[2])


def test_a_limit_measures_the_start_of_the_epoch() -> None:
    q = order_quality([100] * 30, OrderOptions(), batch_size=50, limit=1000)
    assert (q.positions, q.num_samples) == (1000, 3000)


@pytest.mark.parametrize(
    ("sizes", "kwargs", "message"),
    [([1], {}, "has no pairs"), ([5, 5], {"batch_size": 0}, "batch_size"),
     ([5, 5], {"limit": 1}, "limit")],
)  # fmt: skip
def test_bad_arguments(sizes: list[int], kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        order_quality(sizes, OrderOptions(), **kwargs)
