"""Subsets of a dataset at load time: a contiguous range of its samples, read and shuffled alone.

``open_dataset(..., subset=...)`` keeps the samples ``[start, stop)`` of the dataset order (the
order of the manifest's shards and of the samples in them), as Hugging Face's ``train[:10%]``
slices do:

* ``subset=0.1``: the first 10 % (``round(0.1 x N)`` samples);
* ``subset=(0.9, 1.0)``: a range in fractions of the dataset (the last 10 %);
* ``subset=(1000, 2000)`` or ``range(1000, 2000)``: a range of sample numbers.

The subset is a dataset of its own: its epochs shuffle, partition and resume over its samples
only, and only its samples are read (the shards it does not touch are never opened; the two it
cuts are read from the cut on). Each shard keeps its number; a shard outside the range holds no
sample of the subset. Resume states name the range (``subset`` in the order options), so a state
of one subset is refused by another.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from fastload.errors import InvalidArgumentError

__all__ = ["SubsetSpec", "parse_subset", "subset_shards"]

IntArray = npt.NDArray[np.int64]
SubsetSpec = float | tuple[float, float] | tuple[int, int] | range | None

_ACCEPTED = (
    "a fraction (0.1: the first 10 %), a pair of fractions ((0.9, 1.0)), a pair of sample "
    "numbers ((1000, 2000)) or a range(start, stop)"
)


def parse_subset(spec: SubsetSpec, num_samples: int) -> tuple[int, int] | None:
    """The ``[start, stop)`` sample range ``spec`` keeps of a dataset of ``num_samples``, or
    ``None`` for the whole dataset (see the module doc).

    Raises:
        InvalidArgumentError: A spec of another form, fractions outside ``[0, 1]``, a range
            outside the dataset, or one that keeps no sample.
    """
    if spec is None:
        return None
    n = num_samples
    if isinstance(spec, range):
        if spec.step != 1:
            raise InvalidArgumentError(f"subset: a range must have step 1, got {spec!r}")
        start, stop = spec.start, spec.stop
    elif isinstance(spec, float):
        start, stop = 0, _of(spec, n)
    elif isinstance(spec, tuple) and len(spec) == 2:
        a, b = spec
        if all(isinstance(v, float) for v in spec):
            start, stop = _of(a, n), _of(b, n)
        elif all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in spec):
            start, stop = int(a), int(b)
        else:
            raise InvalidArgumentError(
                f"subset={spec!r} mixes ints and fractions; give {_ACCEPTED}"
            )
    else:
        raise InvalidArgumentError(f"subset must be {_ACCEPTED}, got {spec!r}")
    if not 0 <= start < stop <= n:
        raise InvalidArgumentError(
            f"subset={spec!r} is samples [{start}, {stop}) of a dataset of {n}: it must keep at "
            f"least one sample, within [0, {n})"
        )
    return start, stop


def _of(fraction: float, n: int) -> int:
    if not 0.0 <= fraction <= 1.0:
        raise InvalidArgumentError(f"subset: a fraction must be in [0, 1], got {fraction!r}")
    return round(fraction * n)


def subset_shards(sizes: IntArray, subset: tuple[int, int]) -> tuple[IntArray, IntArray]:
    """``(samples of each shard in the subset, the first of them in its shard)`` for the
    samples ``[start, stop)`` of shards of ``sizes``."""
    start, stop = subset
    first = np.cumsum(sizes) - sizes
    lo = np.clip(start - first, 0, sizes)
    hi = np.clip(stop - first, 0, sizes)
    return (hi - lo).astype(np.int64), lo.astype(np.int64)
