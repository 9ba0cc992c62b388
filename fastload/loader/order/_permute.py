"""Keyed permutations of ``range(n)`` evaluated on demand: the block shuffle of the epoch order.

:func:`block_permutation` returns a :class:`Permutation` of ``range(n)``, a pure function of
``(n, entropy)``, that maps a batch of values at a time (NumPy, vectorised) both ways:

* ``n <= TABLE_LIMIT`` (4,096): a uniformly random permutation, ``numpy.random.default_rng(entropy)
  .permutation(n)``, held as a table (and its inverse): at most 64 KiB.
* larger ``n``: :class:`FeistelPermutation`, a keyed pseudo-random bijection computed per value in
  O(1) memory (eight round keys), so a dataset of any size shuffles its blocks without a table.

**The Feistel network.** A value of ``k = ceil(log2 n)`` bits is split into a high and a low part
(``ceil(k/2)`` and ``floor(k/2)`` bits); each of the eight rounds replaces ``(high, low)`` with
``(low, high XOR f(low))``, where ``f`` is multiplicative hashing of ``low XOR round key`` (the top
bits of its product with an odd 64-bit constant, as many as ``high`` has; the parts swap widths each
round, so odd ``k`` works too). Every round is invertible, so the network is a bijection of
``range(2**k)``; *cycle walking* (apply it again while the result is ``>= n``) restricts it to a
bijection of ``range(n)``: since ``2**k < 2n``, fewer than one extra pass per value on average. The
round keys are ``SeedSequence(entropy).generate_state(8)``.

**Randomness.** The table path is exactly the uniform permutation NumPy draws. The Feistel path is a
pseudo-random permutation (Luby-Rackoff: four or more rounds of independent random functions are
indistinguishable from a random permutation); it is not cryptographic and reaches only a subset of
the ``n!`` permutations, but every value's image is spread over the whole range and the images of
neighbouring values are unrelated (``tests/loader/test_permute.py`` measures both).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import numpy.typing as npt

__all__ = [
    "TABLE_LIMIT",
    "FeistelPermutation",
    "IdentityPermutation",
    "Permutation",
    "TablePermutation",
    "block_permutation",
]

#: Largest domain permuted with an explicit table (uniform); larger ones use the Feistel network.
TABLE_LIMIT = 4096

IntArray = npt.NDArray[np.int64]
_U64 = npt.NDArray[np.uint64]
_ROUNDS = 8


class Permutation(Protocol):
    """A bijection of ``range(n)``, applied to arrays of values in ``[0, n)``."""

    n: int

    def __call__(self, values: IntArray) -> IntArray:
        """The images of ``values`` (same shape)."""
        ...

    def inverse(self, images: IntArray) -> IntArray:
        """The values whose images are ``images`` (same shape)."""
        ...


def block_permutation(n: int, entropy: list[int]) -> Permutation:
    """The keyed permutation of ``range(n)`` for ``entropy`` (a ``SeedSequence`` entropy list):
    a uniform table up to :data:`TABLE_LIMIT` values, the Feistel network above it."""
    if n <= TABLE_LIMIT:
        return TablePermutation(n, entropy)
    return FeistelPermutation(n, entropy)


class IdentityPermutation:
    """The identity of ``range(n)`` (blocks in dataset order, where an order needs a permutation)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, values: IntArray) -> IntArray:
        return np.asarray(values, dtype=np.int64).copy()

    def inverse(self, images: IntArray) -> IntArray:
        return np.asarray(images, dtype=np.int64).copy()


class TablePermutation:
    """``numpy.random.default_rng(entropy).permutation(n)`` and its inverse, as tables."""

    def __init__(self, n: int, entropy: list[int]) -> None:
        self.n = n
        self._forward: IntArray = np.random.default_rng(entropy).permutation(n).astype(np.int64)
        self._backward: IntArray = np.empty_like(self._forward)
        self._backward[self._forward] = np.arange(n, dtype=np.int64)

    def __call__(self, values: IntArray) -> IntArray:
        return self._forward[values]

    def inverse(self, images: IntArray) -> IntArray:
        return self._backward[images]


class FeistelPermutation:
    """A keyed Feistel network with cycle walking on ``range(n)`` (see the module doc); O(1) state."""

    def __init__(self, n: int, entropy: list[int]) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        keys = np.random.SeedSequence(entropy).generate_state(_ROUNDS, dtype=np.uint64)
        # Round i maps (high, low) of widths (high_bits, low_bits) to (low, high ^ f(low)).
        self._rounds: list[_Round] = []
        high_bits = (bits + 1) // 2
        for key in keys:
            low_bits = bits - high_bits
            self._rounds.append(_Round(key, high_bits, low_bits))
            high_bits = low_bits

    def __call__(self, values: IntArray) -> IntArray:
        return self._walk(values, self._encrypt)

    def inverse(self, images: IntArray) -> IntArray:
        return self._walk(images, self._decrypt)

    def _walk(self, values: IntArray, network: Callable[[_U64], _U64]) -> IntArray:
        """Apply ``network`` until every value is back in ``[0, n)`` (cycle walking)."""
        flat = np.asarray(values, dtype=np.uint64)
        out = network(flat.reshape(-1))
        outside = np.flatnonzero(out >= self.n)
        while outside.size:
            out[outside] = network(out[outside])
            outside = outside[out[outside] >= self.n]
        return out.astype(np.int64).reshape(flat.shape)

    def _encrypt(self, x: _U64) -> _U64:
        for r in self._rounds:
            low = x & r.low_mask
            x = (low << r.high_shift) | ((x >> r.low_shift) ^ r.f(low))
        return x

    def _decrypt(self, x: _U64) -> _U64:
        for r in reversed(self._rounds):
            low = x >> r.high_shift
            x = (((x & r.high_mask) ^ r.f(low)) << r.low_shift) | low
        return x


class _Round:
    """One Feistel round's constants: its key and the widths of its parts as shifts and masks.

    The round function ``f(low)`` is multiplicative hashing of ``low XOR key``: the top
    ``high_bits`` bits of its product with an odd constant (each depends on every bit of ``low``).
    """

    _MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio, odd

    def __init__(self, key: np.uint64, high_bits: int, low_bits: int) -> None:
        self.key = key
        self.high_shift, self.low_shift = np.uint64(high_bits), np.uint64(low_bits)
        self.high_mask = np.uint64((1 << high_bits) - 1)
        self.low_mask = np.uint64((1 << low_bits) - 1)
        self._top = np.uint64(64 - high_bits)

    def f(self, low: _U64) -> _U64:
        """The round function: ``high_bits`` bits from ``low`` and the key."""
        return ((low ^ self.key) * self._MULTIPLIER) >> self._top
