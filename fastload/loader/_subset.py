"""Subsets of a dataset at load time: a contiguous range of its samples, read and shuffled alone.

``open_dataset(..., subset=...)`` keeps the samples ``[start, stop)`` of the dataset order (the
order of the manifest's shards and of the samples in them), as Hugging Face's ``train[:10%]``
slices do:

* ``subset=0.1``: the first 10 % (``round(0.1 x N)`` samples);
* ``subset=(0.9, 1.0)``: a range in fractions of the dataset (the last 10 %);
* ``subset=(1000, 2000)`` or ``range(1000, 2000)``: a range of sample numbers;
* ``subset=["cat/001", "dog/007", ...]`` (a list or set of keys): those samples.

The subset is a dataset of its own: its epochs shuffle, partition and resume over its samples
only, and only its samples are read (the shards it does not touch are never opened; the two it
cuts are read from the cut on). Each shard keeps its number; a shard outside the range holds no
sample of the subset. Resume states name the range (``subset`` in the order options), so a state
of one subset is refused by another.

**By key** (:class:`KeySelection`): a key list, and ``split=(lo, hi)``, the deterministic
train/validation split by key hash (a sample belongs to ``[lo, hi)`` when the hash of its key,
scaled to ``[0, 1)``, falls there: ``(0.0, 0.9)`` and ``(0.9, 1.0)`` are disjoint and cover the
dataset, on every machine and with any worker count). The key is known only once the sample is
read, so these read every sample of the dataset (or of its range) and drop the others before
``decode``, counting them in ``stats()["filtered"]`` as ``filter=`` does: exactly once over what
is kept. For a cheap split of a large dataset, prefer ranges.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fastload.errors import InvalidArgumentError

__all__ = ["KeySelection", "SubsetSpec", "parse_subset", "subset_shards"]

IntArray = npt.NDArray[np.int64]
SubsetSpec = float | tuple[float, float] | tuple[int, int] | range | Collection[str] | None

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
    if spec is None or _is_key_list(spec):
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
        raise InvalidArgumentError(f"subset must be {_ACCEPTED} or a list of keys, got {spec!r}")
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


def _is_key_list(spec: object) -> bool:
    return (
        isinstance(spec, Collection)
        and not isinstance(spec, str | bytes | range)
        and len(spec) > 0
        and all(isinstance(k, str) for k in spec)
    )


@dataclass(frozen=True)
class KeySelection:
    """Which samples to keep by their key: a key list (``subset=[...]``) and/or a key-hash range
    (``split=(lo, hi)``); see the module doc. Pickles (to worker processes) with its keys."""

    keys: frozenset[str] | None = None
    split: tuple[float, float] | None = None

    @classmethod
    def of(cls, subset: SubsetSpec, split: tuple[float, float] | None) -> KeySelection | None:
        """The selection ``subset`` (when it is a key list) and ``split`` ask for, or ``None``.

        Raises:
            InvalidArgumentError: ``split`` is not ``(lo, hi)`` with ``0 <= lo < hi <= 1``.
        """
        keys = (
            frozenset(str(k) for k in subset)  # type: ignore[union-attr]
            if _is_key_list(subset)
            else None
        )
        if split is not None:
            ok = isinstance(split, tuple) and len(split) == 2
            lo, hi = split if ok else (None, None)
            if not (
                ok
                and all(isinstance(v, int | float) and not isinstance(v, bool) for v in split)
                and 0.0 <= lo < hi <= 1.0  # type: ignore[operator]
            ):
                raise InvalidArgumentError(
                    f"split must be (lo, hi) with 0 <= lo < hi <= 1, a range of the key-hash "
                    f"space: (0.0, 0.9) for training, (0.9, 1.0) for validation; got {split!r}"
                )
            split = (float(lo), float(hi))  # type: ignore[arg-type]
        if keys is None and split is None:
            return None
        return cls(keys, split)

    def __call__(self, key: object) -> bool:
        """Whether the sample with ``key`` is kept."""
        if not isinstance(key, str):
            return False
        if self.keys is not None and key not in self.keys:
            return False
        if self.split is not None:
            lo, hi = self.split
            return lo <= key_hash(key) < hi
        return True

    def state(self) -> dict[str, object]:
        """The selection's entries of a resume state: another selection refuses the state."""
        out: dict[str, object] = {}
        if self.keys is not None:
            digest = hashlib.sha256("\0".join(sorted(self.keys)).encode()).hexdigest()[:16]
            out["subset_keys"] = f"{len(self.keys)} keys, sha256 {digest}"
        if self.split is not None:
            out["split"] = list(self.split)
        return out


def key_hash(key: str) -> float:
    """A sample key's place in ``[0, 1)``: the first 8 bytes of its BLAKE2b digest, scaled. The
    same on every machine, Python version and process (unlike ``hash()``)."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64
