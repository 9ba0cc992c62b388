"""The epoch order (EpochOrder) and the partition arithmetic (Partition)."""

from __future__ import annotations

import itertools
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload.errors import InvalidArgumentError
from fastload.loader import EpochOrder, Partition
from fastload.loader.order import _permute
from fastload.loader.order._order import ORDER_VERSION, computes_order_version

sizes_st = st.lists(st.integers(0, 40), min_size=1, max_size=8)
#: The block permutations: NumPy's table (small datasets) and the Feistel network (large ones).
PERMUTATIONS = ["table", "feistel"]


@contextmanager
def block_permutation(kind: str) -> Iterator[None]:
    """Make EpochOrder use the ``kind`` block permutation whatever the dataset size."""
    limit = _permute.TABLE_LIMIT if kind == "table" else 0
    with mock.patch.object(_permute, "TABLE_LIMIT", limit):
        yield


@pytest.mark.parametrize("kind", PERMUTATIONS)
@settings(max_examples=50, deadline=None)
@given(
    sizes=sizes_st,
    seed=st.integers(0, 2**32),
    epoch=st.integers(0, 5),
    block=st.one_of(st.none(), st.integers(1, 9)),
    window=st.integers(1, 5),
)
def test_order_is_a_deterministic_permutation(
    kind: str, sizes: list[int], seed: int, epoch: int, block: int | None, window: int
) -> None:
    with block_permutation(kind):
        _check_deterministic_permutation(sizes, seed, epoch, block, window)


def _check_deterministic_permutation(
    sizes: list[int], seed: int, epoch: int, block: int | None, window: int
) -> None:
    n = sum(sizes)
    order = EpochOrder(sizes, seed=seed, epoch=epoch, block_size=block, window=window)
    idx = order.indices(np.arange(n))
    assert sorted(idx.tolist()) == list(range(n))
    again = EpochOrder(sizes, seed=seed, epoch=epoch, block_size=block, window=window)
    # same result in any query order and chunking (lazy windows, cache effects)
    rev = again.indices(np.arange(n)[::-1])[::-1]
    assert rev.tolist() == idx.tolist()
    if n:
        chunks = [again.indices(c) for c in np.array_split(np.arange(n), 3)]
        assert np.concatenate(chunks).tolist() == idx.tolist()


@pytest.mark.parametrize("kind", PERMUTATIONS)
@settings(max_examples=30, deadline=None)
@given(sizes=sizes_st, block=st.integers(1, 9), window=st.integers(1, 4))
def test_windows_touch_few_blocks(kind: str, sizes: list[int], block: int, window: int) -> None:
    """Locality: the samples of one window come from at most `window` blocks of `block` samples,
    each block consecutive samples of one shard."""
    with block_permutation(kind):
        order = EpochOrder(sizes, seed=7, epoch=1, block_size=block, window=window)
    n = sum(sizes)
    idx = order.indices(np.arange(n))
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    block_id = {}
    for s, (start, size) in enumerate(zip(starts.tolist(), sizes)):
        for p in range(size):
            block_id[start + p] = (s, p // block)
    bounds = [order.window_range(w)[0] for w in range(order.num_windows)] + [n] if n else [0]
    assert [order.window_range(w)[1] for w in range(order.num_windows)] == bounds[1:] * (n > 0)
    for lo, hi in itertools.pairwise(bounds):
        assert len({block_id[i] for i in idx[lo:hi].tolist()}) <= window


def test_no_shuffle_is_dataset_order() -> None:
    order = EpochOrder([3, 0, 4], shuffle=False)
    assert order.indices(np.arange(7)).tolist() == list(range(7))


def test_epochs_and_seeds_change_the_order() -> None:
    sizes = [100, 57, 0, 300]
    a = EpochOrder(sizes, seed=1, epoch=0).indices(np.arange(457))
    b = EpochOrder(sizes, seed=1, epoch=1).indices(np.arange(457))
    c = EpochOrder(sizes, seed=2, epoch=0).indices(np.arange(457))
    assert a.tolist() != b.tolist()
    assert a.tolist() != c.tolist()


def test_order_values_are_pinned() -> None:
    """The order is part of the resume contract: changing it must bump ORDER_VERSION (and these
    values). The table values are those of fastload's first order algorithm."""
    pinned = {
        "table": [3, 6, 7, 2, 9, 5, 8, 4, 0, 1],
        "feistel": [7, 2, 3, 6, 9, 1, 8, 0, 4, 5],
    }
    for kind, expected in pinned.items():
        with block_permutation(kind):
            order = EpochOrder([10], seed=0, epoch=0, block_size=2, window=2)
            assert order.indices(np.arange(10)).tolist() == expected
    with block_permutation("feistel"):
        order = EpochOrder([7, 0, 5], seed=3, epoch=1, block_size=3, window=2)
        assert order.indices(np.arange(12)).tolist() == [6, 0, 2, 1, 10, 5, 4, 3, 11, 7, 8, 9]
    assert ORDER_VERSION == 2


def test_order_versions_that_resume_exactly() -> None:
    """Version 1 (states saved before versions were recorded) shuffled every block with NumPy:
    its orders are this version's up to 4,096 blocks, and never differ without shuffle."""
    small, large = [4096 * 64], [4096 * 64 + 1]  # 4,096 and 4,097 blocks of 64
    assert computes_order_version(ORDER_VERSION, large, shuffle=True, block_size=64)
    assert computes_order_version(1, small, shuffle=True, block_size=64)
    assert not computes_order_version(1, large, shuffle=True, block_size=64)
    assert computes_order_version(1, large, shuffle=False, block_size=64)
    assert computes_order_version(1, [5] * 4096, shuffle=True, block_size=None)
    assert not computes_order_version(1, [5] * 4097, shuffle=True, block_size=None)
    assert not computes_order_version(ORDER_VERSION + 1, small, shuffle=True, block_size=64)
    assert computes_order_version(ORDER_VERSION + 1, small, shuffle=False, block_size=64)


def test_large_order_is_an_exact_permutation() -> None:
    """Past the table limit (here 13,116 blocks, four of them short): every position maps to a
    distinct sample, batch by batch as the loaders ask, and in one call."""
    sizes = [20_000, 0, 13_333, 7, 6_001]
    n = sum(sizes)
    order = EpochOrder(sizes, seed=9, epoch=2, block_size=3, window=16)
    assert order.num_windows > _permute.TABLE_LIMIT // 16
    idx = np.concatenate([order.indices(b) for b in np.array_split(np.arange(n), n // 256)])
    assert np.array_equal(np.sort(idx), np.arange(n))
    assert np.array_equal(order.indices(np.arange(n)[::-1])[::-1], idx)
    assert order.window_range(order.num_windows - 1)[1] == n


def test_order_memory_does_not_grow_with_the_dataset() -> None:
    """10^10 samples in 10^5 shards (each with a short last block): the order is built and used in
    a few MB (the old block table needed 3.7 GB)."""
    sizes = [100_000] * 100_000
    tracemalloc.start()
    try:
        order = EpochOrder(sizes, seed=1, epoch=3)
        idx = order.indices(np.arange(10**10 - 300, 10**10))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(set(idx.tolist())) == 300
    assert idx.min() >= 0
    assert idx.max() < 10**10
    assert peak < 16 * 2**20


def test_whole_shard_blocks_are_streaming_order() -> None:
    """block_size=None, window=1: each shard is read whole, shards in a permuted order."""
    sizes = [5, 7, 3]
    idx = EpochOrder(sizes, seed=3, block_size=None, window=1).indices(np.arange(15)).tolist()
    shard_of = [0] * 5 + [1] * 7 + [2] * 3
    runs = [shard_of[i] for i in idx]
    changes = sum(1 for x, y in itertools.pairwise(runs) if x != y)
    assert changes == 2


def test_order_rejects_bad_arguments() -> None:
    with pytest.raises(InvalidArgumentError, match="seed"):
        EpochOrder([3], seed=-1)
    with pytest.raises(InvalidArgumentError, match="block_size"):
        EpochOrder([3], block_size=0)
    with pytest.raises(InvalidArgumentError, match="window"):
        EpochOrder([3], window=0)
    with pytest.raises(InvalidArgumentError, match=r"\[0, 3\)"):
        EpochOrder([3]).indices([3])


def test_empty_dataset() -> None:
    order = EpochOrder([0, 0])
    assert order.indices(np.arange(0)).tolist() == []


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(0, 200),
    world=st.integers(1, 8),
    batch=st.integers(1, 17),
    drop_last=st.booleans(),
)
def test_partition_covers_positions(n: int, world: int, batch: int, drop_last: bool) -> None:
    p = Partition(n, world, batch, drop_last)
    seen: list[int] = []
    for step in range(p.num_steps):
        sizes = set()
        for rank in range(world):
            a, b = p.rank_range(step, rank)
            sizes.add(b - a)
            seen.extend(p.source_position(x) for x in range(a, b))
        assert len(sizes) == 1  # every rank's batch has the same size at each step
        assert 0 < sizes.pop() <= batch
    if drop_last:
        assert len(seen) == len(set(seen)) == p.num_steps * world * batch
        assert p.dropped == n - len(seen) < world * batch
        assert p.padded == 0
    else:
        assert sorted(set(seen)) == list(range(n))
        assert len(seen) == n + p.padded
        assert 0 <= p.padded < world


def test_partition_worker_steps() -> None:
    p = Partition(100, 2, 5)
    assert p.num_steps == 10
    got = sorted(s for w in range(3) for s in p.worker_steps(4, w, 3))
    assert got == list(range(4, 10))
    assert list(p.worker_steps(4, 0, 3)) == [4, 7]
    assert p.remaining_steps(12) == 0
    with pytest.raises(InvalidArgumentError):
        Partition(10, 0, 1)
    with pytest.raises(InvalidArgumentError):
        p.rank_range(10, 0)
