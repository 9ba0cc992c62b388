"""Collating samples into batches, and returning a batch's pooled buffers once it is dropped.

:func:`default_collate` stacks tensors and arrays, turns numbers into tensors, byte strings into
a :class:`~fastload.loader._packed.PackedBytes` and anything else into a list; inside fastload's
workers its buffers come from the reusable shared-memory pool of :mod:`fastload.loader._shm_pool`
(the module docstring there explains the reuse). :class:`BufferReleaser` is the main-process side
of that pool; it lives here because it walks collated batches (tensors and ``PackedBytes`` inside
tuples, lists and dicts), as :func:`empty_like_batch` does.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import default_collate as _torch_default_collate

from fastload.errors import BatchShapeError, InvalidArgumentError, WorkerError
from fastload.loader._packed import BytesLike, PackedBytes
from fastload.loader._shm_pool import POOL_MIN_BYTES, alloc_uint8, pooling

__all__ = ["BufferReleaser", "collate_batch", "default_collate", "empty_like_batch"]


def _stack(samples: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.stack`` into a pooled shared buffer (workers of fastload.DataLoader)."""
    first = samples[0]
    nbytes = first.numel() * first.element_size() * len(samples)
    raw = alloc_uint8(nbytes)
    out = raw.view(first.dtype).view(len(samples), *first.shape)
    return torch.stack(list(samples), out=out)


def default_collate(
    samples: Sequence[Any],
    *,
    keys: Sequence[str | None] | None = None,
    fields: Sequence[str] | None = None,
) -> Any:
    """Collate processed samples into a batch.

    Like ``torch.utils.data.default_collate`` for tensors (stacked; in shared memory when called
    inside a DataLoader worker, so the batch reaches the main process without a copy), NumPy
    arrays (stacked into a tensor), ``int``/``float``/``bool`` (an ``int64``/``float64``/``bool``
    tensor) and mappings (collated key by key). The differences: ``bytes`` (and ``bytearray``,
    ``memoryview``) become a :class:`PackedBytes` (a sequence of ``bytes`` in one tensor),
    ``str``, ``None`` and other objects become a **list**, and tuple samples give a **tuple** of
    collated fields (torch gives lists), so ``images, labels = batch`` reads naturally.

    Tensors or arrays of different shapes in one field (images of different sizes without a
    resizing transform) raise :class:`~fastload.errors.BatchShapeError`. The shapes are compared
    only after stacking failed, so the check costs nothing when they agree.

    Args:
        samples: The processed samples of one batch.
        keys: The samples' keys (``__key__``), in the same order, for error messages only
            (fastload's loader passes them); dict samples that hold ``__key__`` need none.
        fields: The names of the positions of tuple samples (the dataset's ``fields=``), for
            error messages only.

    Raises:
        InvalidArgumentError: Samples have different structures (the message names the keys).
        BatchShapeError: A field's tensors or arrays have different shapes; the message names
            the field, two shapes with their sample keys, and the ways out.
    """
    if not samples:
        raise InvalidArgumentError("cannot collate an empty list of samples")
    return _collate(samples, _Where(samples, keys, fields, ""))


class _Where:
    """What error messages say about the values being collated: the batch's samples and keys,
    the names of tuple positions, and the field being collated (``""`` at the top). Only an
    error reads it."""

    __slots__ = ("batch", "fields", "given_keys", "path")

    def __init__(
        self,
        batch: Sequence[Any],
        keys: Sequence[str | None] | None,
        fields: Sequence[str] | None,
        path: str,
    ) -> None:
        self.batch, self.given_keys, self.fields, self.path = batch, keys, fields, path

    def key(self, name: str) -> _Where:
        path = f"{self.path}.{name}" if self.path else name
        return _Where(self.batch, self.given_keys, self.fields, path)

    def position(self, i: int) -> _Where:
        if self.path:
            name = f"{self.path}[{i}]"
        elif self.fields is not None and i < len(self.fields):
            name = self.fields[i]
        else:
            name = f"[{i}]"
        return _Where(self.batch, self.given_keys, None, name)

    @property
    def keys(self) -> Sequence[str | None] | None:
        """The samples' keys: as given, or the ``__key__`` of dict samples; None if unknown."""
        if self.given_keys is not None:
            return self.given_keys
        if all(isinstance(s, Mapping) and "__key__" in s for s in self.batch):
            return [str(s["__key__"]) for s in self.batch]
        return None


def _stack_or_explain(samples: Sequence[Any], where: _Where) -> Any:
    """torch's collation of tensors or arrays; if it fails on shapes that differ, the
    :class:`BatchShapeError` that says so."""
    try:
        return _torch_default_collate(list(samples))
    except (RuntimeError, TypeError, ValueError):
        shape_error = _shape_error(samples, where)
        if shape_error is None:
            raise
        raise shape_error from None  # what torch said adds nothing to the shapes


def _shape_error(samples: Sequence[Any], where: _Where) -> BatchShapeError | None:
    """The error for samples whose shapes differ, or None if they all have one shape."""
    shapes = [tuple(getattr(s, "shape", ())) for s in samples]
    first = shapes[0]
    other = next((i for i, shape in enumerate(shapes) if shape != first), None)
    if other is None:
        return None
    keys = where.keys
    key0 = keys[0] if keys is not None and len(keys) == len(samples) else None
    key1 = keys[other] if keys is not None and len(keys) == len(samples) else None
    distinct = len(set(shapes))
    field = where.path or "the samples"
    named = f"field {field!r}" if where.path else "the samples"

    def one(shape: tuple[int, ...], key: str | None, i: int) -> str:
        return (
            f"{shape} (sample {key!r})" if key is not None else f"{shape} (sample {i} of the batch)"
        )

    return BatchShapeError(
        f"cannot stack {named} into a batch: its arrays have different shapes, "
        f"{one(first, key0, 0)} and {one(shapes[other], key1, other)} ({distinct} different "
        f"shapes among the {len(samples)} samples); give every sample one shape with a "
        "transform that resizes (e.g. transform=fastload.loader.transforms.ImageTrainTransform"
        "(224), or RandomResizedCrop/Resize), or keep the samples as a list with "
        "collate_fn=list",
        field=field,
        shapes=(first, shapes[other]),
        keys=(key0, key1),
    )


def _collate(samples: Sequence[Any], where: _Where) -> Any:
    """:func:`default_collate` of the values at ``where``."""
    first = samples[0]
    if isinstance(first, torch.Tensor):
        if (
            pooling()
            and first.layout == torch.strided
            and first.device.type == "cpu"
            and first.numel() * first.element_size() * len(samples) >= POOL_MIN_BYTES
            and all(
                isinstance(s, torch.Tensor) and s.shape == first.shape and s.dtype == first.dtype
                for s in samples
            )
        ):
            return _stack(samples)
        return _stack_or_explain(samples, where)
    if isinstance(first, BytesLike) and all(isinstance(s, BytesLike) for s in samples):
        return PackedBytes.pack(samples)
    if isinstance(first, np.ndarray) and first.dtype != object:
        return _stack_or_explain(samples, where)
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
        return {k: _collate([s[k] for s in samples], where.key(str(k))) for k in keys}
    if isinstance(first, tuple):
        width = len(first)
        if any(not isinstance(s, tuple) or len(s) != width for s in samples):
            raise InvalidArgumentError(
                f"cannot collate tuples of different lengths (first has {width} fields)"
            )
        fields = tuple(
            _collate(list(col), where.position(i)) for i, col in enumerate(zip(*samples))
        )
        if hasattr(first, "_fields"):  # namedtuple
            return type(first)(*fields)
        return fields
    return list(samples)


class _BatchSource(Protocol):
    """What :func:`collate_batch` asks of the dataset: its ``fields=`` selection (``select``,
    optional) and the URL of a shard."""

    def shard_url(self, shard: int) -> str: ...


def collate_batch(
    collate_fn: Callable[[list[Any]], Any],
    samples: list[Any],
    keys: Sequence[str | None],
    dataset: _BatchSource,
    where: str,
    shards: Iterable[Any],
) -> Any:
    """Collate one batch of fastload's loader: ``collate_fn(samples)``; the default collation
    also gets the samples' ``keys`` and the names of the dataset's ``fields=``, for its errors.

    Raises:
        BatchShapeError: As itself, with a note saying ``where`` (the rank, worker and step)
            and which of the dataset's ``shards`` the samples came from, so that it reaches the
            user typed also from worker processes.
        WorkerError: Any other failure of ``collate_fn``, naming the same.
    """
    try:
        if collate_fn is default_collate:
            select = getattr(dataset, "select", None)
            return default_collate(samples, keys=keys, fields=getattr(select, "fields", None))
        return collate_fn(samples)
    except BatchShapeError as exc:
        urls = sorted({dataset.shard_url(int(s)) for s in shards})
        exc.add_note(f"collating the batch of {where} ({len(samples)} samples from shards {urls})")
        raise
    except Exception as exc:
        urls = sorted({dataset.shard_url(int(s)) for s in shards})
        raise WorkerError(
            f"{where}: collate_fn failed on a batch of {len(samples)} samples from "
            f"shards {urls}: {type(exc).__name__}: {exc}"
        ) from exc


def empty_like_batch(batch: Any) -> Any:
    """A batch with the structure of ``batch`` and zero rows (used when every sample of a batch
    was skipped, so that every rank still yields the same number of batches)."""
    if isinstance(batch, torch.Tensor):
        return batch[:0].clone()  # a copy: do not keep the (shared-memory) batch alive
    if isinstance(batch, np.ndarray):
        return batch[:0].copy()
    if isinstance(batch, PackedBytes):
        return PackedBytes.empty()
    if isinstance(batch, Mapping):
        return {k: empty_like_batch(v) for k, v in batch.items()}
    if isinstance(batch, tuple):  # collated tuple samples
        fields = [empty_like_batch(v) for v in batch]
        return type(batch)(*fields) if hasattr(batch, "_fields") else tuple(fields)
    return []  # a list of per-sample values (str, bytes, objects)


class BufferReleaser:
    """Main-process side of :class:`BufferPool`: frees blocks once nothing refers to them.

    :meth:`track` finds the pooled storages in a received batch (tensors and
    :class:`PackedBytes` inside tuples, lists and dicts) and watches them with weak references;
    :meth:`poll` marks the blocks of storages that died as free. A block listed by a worker but
    not found in the batch (hidden in a custom object, or replaced by ``pin_memory``) is never
    marked free, so it cannot be overwritten while in use.
    """

    def __init__(self, flags: torch.Tensor) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self._weakref = StorageWeakRef
        self._flags: npt.NDArray[np.int64] = flags.numpy()
        self._pending: list[tuple[Any, int, int, int]] = []  # weakref, worker, block, token

    def track(self, batch: Any, worker: int, used: Sequence[tuple[int, int, int]]) -> None:
        """Watch the blocks ``used`` (from the worker's :meth:`BufferPool.take_used`) in ``batch``."""
        if not used or not 0 <= worker < len(self._flags):
            return
        wanted = {inode: (block, token) for inode, block, token in used}
        for storage in _shared_storages(batch, 0):
            try:
                inode = os.fstat(storage._share_fd_cpu_()[0]).st_ino
            except (RuntimeError, OSError):  # another sharing strategy: no fd to identify
                continue
            hit = wanted.pop(inode, None)
            if hit is not None:
                ref = self._weakref(storage)  # type: ignore[no-untyped-call]
                self._pending.append((ref, worker, hit[0], hit[1]))
                if not wanted:
                    break

    def poll(self) -> None:
        """Mark the blocks whose storages the main process no longer holds as free."""
        if not self._pending:
            return
        keep = []
        for ref, worker, block, token in self._pending:
            if ref.expired():
                if self._flags[worker, block] == token:
                    self._flags[worker, block] = 0
            else:
                keep.append((ref, worker, block, token))
        self._pending = keep


def _shared_storages(batch: Any, depth: int) -> Iterator[torch.UntypedStorage]:
    """The shared-memory CPU storages of the tensors in a collated batch (nested up to 4 deep)."""
    if isinstance(batch, torch.Tensor):
        storage = batch.untyped_storage()
        if batch.device.type == "cpu" and storage.is_shared():
            yield storage
    elif isinstance(batch, PackedBytes):
        yield from _shared_storages(batch.buffer, depth)
    elif depth < 4 and isinstance(batch, (tuple, list)):
        for item in batch:
            yield from _shared_storages(item, depth + 1)
    elif depth < 4 and isinstance(batch, Mapping):
        for item in batch.values():
            yield from _shared_storages(item, depth + 1)
