"""Selecting fields and collating samples into batches."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate as _torch_default_collate

from fastload.errors import InvalidArgumentError

__all__ = ["ToTuple", "default_collate", "empty_like_batch", "to_tuple"]


def default_collate(samples: Sequence[Any]) -> Any:
    """Collate processed samples into a batch.

    Like ``torch.utils.data.default_collate`` for tensors (stacked; in shared memory when called
    inside a DataLoader worker, so the batch reaches the main process without a copy), NumPy
    arrays (stacked into a tensor), ``int``/``float``/``bool`` (an ``int64``/``float64``/``bool``
    tensor) and mappings (collated key by key). The differences: ``bytes``, ``str``, ``None`` and
    other objects become a **list**, and tuple samples give a **tuple** of collated fields (torch
    gives lists), so ``images, labels = batch`` reads naturally.

    Raises:
        InvalidArgumentError: Samples have different structures (the message names the keys).
    """
    if not samples:
        raise InvalidArgumentError("cannot collate an empty list of samples")
    first = samples[0]
    if isinstance(first, torch.Tensor):
        return _torch_default_collate(list(samples))
    if isinstance(first, np.ndarray) and first.dtype != object:
        return _torch_default_collate(list(samples))
    if isinstance(first, bool | np.bool_):
        return torch.tensor(samples, dtype=torch.bool)
    if isinstance(first, int | np.integer):
        return torch.tensor(samples, dtype=torch.int64)
    if isinstance(first, float | np.floating):
        return torch.tensor(samples, dtype=torch.float64)
    if isinstance(first, Mapping):
        keys = list(first)
        for s in samples:
            if not isinstance(s, Mapping) or s.keys() != first.keys():
                have = sorted(s) if isinstance(s, Mapping) else type(s).__name__
                raise InvalidArgumentError(
                    f"cannot collate samples with different fields: {sorted(keys)} and {have}; "
                    "select common fields with fields=(...) or pass a collate_fn"
                )
        return {k: default_collate([s[k] for s in samples]) for k in keys}
    if isinstance(first, tuple):
        width = len(first)
        if any(not isinstance(s, tuple) or len(s) != width for s in samples):
            raise InvalidArgumentError(
                f"cannot collate tuples of different lengths (first has {width} fields)"
            )
        fields = tuple(default_collate(list(col)) for col in zip(*samples))
        if hasattr(first, "_fields"):  # namedtuple
            return type(first)(*fields)
        return fields
    return list(samples)


def empty_like_batch(batch: Any) -> Any:
    """A batch with the structure of ``batch`` and zero rows (used when every sample of a batch
    was skipped, so that every rank still yields the same number of batches)."""
    if isinstance(batch, torch.Tensor):
        return batch[:0].clone()  # a copy: do not keep the (shared-memory) batch alive
    if isinstance(batch, np.ndarray):
        return batch[:0].copy()
    if isinstance(batch, Mapping):
        return {k: empty_like_batch(v) for k, v in batch.items()}
    if isinstance(batch, tuple):  # collated tuple samples
        fields = [empty_like_batch(v) for v in batch]
        return type(batch)(*fields) if hasattr(batch, "_fields") else tuple(fields)
    return []  # a list of per-sample values (str, bytes, objects)


class ToTuple:
    """Select fields of a sample as a tuple: ``ToTuple("jpg;png", "cls")(sample)``.

    A field spec may list alternatives separated by ``;`` (the first present is taken), as in
    WebDataset's ``to_tuple``. Picklable, so it works with every multiprocessing start method.

    Args:
        *fields: Field names (or ``;``-separated alternatives), e.g. ``"jpg"``, ``"__key__"``.

    Raises:
        InvalidArgumentError: (when called) The sample has none of a spec's alternatives; the
            message names the sample key and the fields it has.
    """

    def __init__(self, *fields: str) -> None:
        if not fields:
            raise InvalidArgumentError("to_tuple needs at least one field name, e.g. 'jpg'")
        specs = []
        for spec in fields:
            if not isinstance(spec, str) or not spec or any(not p for p in spec.split(";")):
                raise InvalidArgumentError(
                    f"field specs are non-empty str like 'jpg' or 'jpg;png', got {spec!r}"
                )
            specs.append(tuple(spec.split(";")))
        self.fields: tuple[str, ...] = tuple(fields)
        self._specs = tuple(specs)

    def __call__(self, sample: Mapping[str, Any]) -> tuple[Any, ...]:
        out = []
        for alternatives in self._specs:
            for name in alternatives:
                if name in sample:
                    out.append(sample[name])
                    break
            else:
                have = sorted(k for k in sample if not k.startswith("__"))
                raise InvalidArgumentError(
                    f"sample {sample.get('__key__')!r} has none of the fields "
                    f"{';'.join(alternatives)!r} (it has {have}); fix the fields=... selection"
                )
        return tuple(out)

    def __repr__(self) -> str:
        return f"to_tuple({', '.join(repr(f) for f in self.fields)})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ToTuple) and other.fields == self.fields

    def __hash__(self) -> int:
        return hash(self.fields)


def to_tuple(*fields: str) -> ToTuple:
    """A picklable callable returning the given fields of a sample as a tuple.

    ``to_tuple("jpg;png", "cls")`` turns ``{"__key__": "a", "jpg": img, "cls": 3}`` into
    ``(img, 3)``; see :class:`ToTuple`.
    """
    return ToTuple(*fields)


#: A per-field transform table or a whole-sample transform.
Transform = Callable[[Any], Any] | Mapping[str, Callable[[Any], Any]]
