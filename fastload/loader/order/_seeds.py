"""Seeds: every random stream of the loaders, derived from (seed, epoch, ...) in one place.

All of fastload's randomness is a pure function of the dataset's seed and the epoch, so that an
epoch (its order, its augmentation) is the same whatever ran before it and wherever it resumed.
The streams are NumPy ``SeedSequence`` entropy lists ``[seed, epoch, tag, ...]`` with a distinct
non-zero domain tag per use (``SeedSequence`` ignores trailing zeros, so the tag keeps the
streams apart): 1 and 2 for the epoch order (:mod:`fastload.loader.order._order`), 3 for the global
generators reseeded per batch (:func:`seed_global_rngs`), 5 for DALI pipelines
(:func:`pipeline_seed`), 6 for the token loader's sequence windows (:mod:`fastload.loader.tokens._dataset`). Per-sample generators come from the ``"__rng_seed__"`` entry of a sample
(:data:`RNG_SEED_KEY`, see :func:`fastload.loader.transforms.sample_rng`).

A leaf module: it imports nothing of fastload's loader, so every loader module can use it.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from fastload.errors import InvalidArgumentError

__all__ = [
    "RNG_SEED_KEY",
    "TAG_BLOCKS",
    "TAG_SEQUENCES",
    "TAG_WINDOW",
    "check_seed",
    "pipeline_seed",
    "seed_global_rngs",
]

#: Metadata entry the loader adds to each raw sample: ``(seed, epoch, dataset index)``, from which
#: :func:`fastload.loader.transforms.sample_rng` builds the sample's random generator.
RNG_SEED_KEY = "__rng_seed__"
#: Domain tag of the epoch order's block permutation.
TAG_BLOCKS = 1
#: Domain tag of the epoch order's per-window permutations.
TAG_WINDOW = 2
_TAG_AUGMENT = 3
_TAG_PIPELINE = 5
#: Domain tag of the token loader's per-window sequence permutations.
TAG_SEQUENCES = 6


def check_seed(name: str, value: object) -> int:
    """Validate a seed or epoch: a non-negative int (numpy SeedSequence entropy)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise InvalidArgumentError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


def seed_global_rngs(seed: int, epoch: int, step: int, rank: int) -> None:
    """Reseed Python's ``random``, NumPy's global generator and torch's default generator for
    the batch of global ``step`` on ``rank``.

    For transforms that draw from the global generators instead of the sample's own: their draws
    then depend on (seed, epoch, step, rank) only. The rank is part of the seed: ranks build
    different batches of the same step and must not make the same draws. Only for worker
    processes (it would reset the training loop's generators in the main process).
    """
    state = np.random.SeedSequence([seed, epoch, _TAG_AUGMENT, step, rank]).generate_state(2)
    seed32 = int(state[0])
    random.seed(seed32)
    np.random.seed(seed32)
    # The CPU generator only: workers do not use CUDA (a forked one cannot), and
    # torch.manual_seed's lazy seeding of CUDA records a stack trace per call (~150 us).
    torch.default_generator.manual_seed((seed32 << 32) | int(state[1]))


def pipeline_seed(seed: int, epoch: int) -> int:
    """The seed of the DALI pipeline of ``epoch`` (a non-negative 31-bit int, as DALI takes)."""
    state = np.random.SeedSequence([seed, epoch, _TAG_PIPELINE]).generate_state(1)
    return int(state[0]) & 0x7FFFFFFF
