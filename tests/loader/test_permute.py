"""The keyed block permutations of the epoch order (fastload.loader.order._permute)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload.loader.order._permute import (
    TABLE_LIMIT,
    FeistelPermutation,
    TablePermutation,
    block_permutation,
)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**32))
def test_feistel_is_a_bijection_with_its_inverse(n: int, seed: int) -> None:
    perm = FeistelPermutation(n, [seed, 0, 1])
    values = np.arange(n, dtype=np.int64)
    images = perm(values)
    assert images.dtype == np.int64
    assert np.array_equal(np.sort(images), values)
    assert np.array_equal(perm.inverse(images), values)
    assert np.array_equal(perm(values[::-1]), images[::-1])  # elementwise, any batch
    assert np.array_equal(perm(values.reshape(1, -1)), images.reshape(1, -1))  # any shape


@pytest.mark.parametrize("n", [4097, 2**13, 2**13 + 1, 100_003])
def test_feistel_at_the_sizes_it_is_used_for(n: int) -> None:
    perm = block_permutation(n, [7, 3, 1])
    assert isinstance(perm, FeistelPermutation)
    images = perm(np.arange(n))
    assert np.array_equal(np.sort(images), np.arange(n))
    assert np.array_equal(perm.inverse(images), np.arange(n))


def test_small_domains_use_numpy_uniform_permutation() -> None:
    perm = block_permutation(TABLE_LIMIT, [5, 1, 1])
    assert isinstance(perm, TablePermutation)
    expected = np.random.default_rng([5, 1, 1]).permutation(TABLE_LIMIT)
    assert perm(np.arange(TABLE_LIMIT)).tolist() == expected.tolist()
    assert perm.inverse(expected).tolist() == list(range(TABLE_LIMIT))


def test_feistel_is_keyed() -> None:
    values = np.arange(10_000)
    a = FeistelPermutation(10_000, [1, 0, 1])(values)
    assert np.array_equal(a, FeistelPermutation(10_000, [1, 0, 1])(values))
    assert not np.array_equal(a, FeistelPermutation(10_000, [1, 1, 1])(values))
    assert not np.array_equal(a, FeistelPermutation(10_000, [2, 0, 1])(values))
    # pinned: the permutation is part of the epoch order, which resume states depend on
    assert a[:6].tolist() == [1425, 4296, 2732, 1234, 3429, 643]


def test_feistel_mixes_like_a_random_permutation() -> None:
    """Neighbours land apart and a value's image is uniform over the range across keys: the
    statistics a uniform permutation has, within sampling error."""
    n = 100_003
    images = FeistelPermutation(n, [11, 0, 1])(np.arange(n)).astype(np.float64)
    assert abs(np.corrcoef(images[:-1], images[1:])[0, 1]) < 0.02  # neighbours unrelated
    assert abs(np.corrcoef(np.arange(n), images)[0, 1]) < 0.02  # no drift with the value
    # uniform: E|X - Y| / n = 1/3 for independent uniform X, Y
    assert abs(np.abs(np.diff(images)).mean() / n - 1 / 3) < 0.01
    # across 2,000 keys, the image of value 0 falls into each tenth of the range ~200 times
    firsts = [FeistelPermutation(n, [s, 0, 1])(np.zeros(1, np.int64))[0] for s in range(2000)]
    counts = np.bincount(np.asarray(firsts) * 10 // n, minlength=10)
    chi2 = float(((counts - 200) ** 2 / 200).sum())
    assert chi2 < 27.9  # chi-square, 9 degrees of freedom, p = 0.001
