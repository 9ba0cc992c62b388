"""Per-sample random generators: what every random transform draws from.

The protocol (described for users in :mod:`fastload.loader.transforms`): the loader puts
``"__rng_seed__": (seed, epoch, index)`` (:data:`~fastload.loader.order._seeds.RNG_SEED_KEY`) into each
raw sample, and a transform builds its generator from those three integers with
:func:`sample_rng`, so augmentation depends only on (seed, epoch, sample).

A leaf module (it imports only :mod:`fastload.loader.order._seeds`), so that both
:mod:`fastload.loader.decode` (fused decode+augment) and the transforms use it without importing
each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fastload.loader.order._seeds import RNG_SEED_KEY

__all__ = ["RNG_SEED_KEY", "rng_for", "sample_rng"]


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The random generator for one sample of one epoch (see the module docstring).

    Args:
        seed: The run's seed (any int; negative values are mapped to 64-bit two's complement).
        epoch: The epoch number (>= 0).
        index: The sample's global index in the dataset (>= 0).
    """
    return np.random.default_rng([seed & 0xFFFF_FFFF_FFFF_FFFF, epoch, index])


def rng_for(x: Any, rng: np.random.Generator | None = None) -> np.random.Generator:
    """The generator a transform uses for ``x``: ``rng`` if given, else :func:`sample_rng` of a
    sample dict's ``__rng_seed__``, else one seeded from NumPy's global generator."""
    if rng is not None:
        return rng
    if isinstance(x, Mapping) and RNG_SEED_KEY in x:
        seed, epoch, index = x[RNG_SEED_KEY]
        return sample_rng(int(seed), int(epoch), int(index))
    # Drawn from NumPy's global generator, which fastload's loader reseeds per batch from
    # (seed, epoch, step) in its workers (and torch's DataLoader seeds per worker): reproducible
    # there, though not independent of the batch a sample lands in.
    return np.random.default_rng(np.random.randint(0, 2**31 - 1, size=4))
