"""The external-source feed: fastload's readers hand each rank's batches to DALI.

:class:`BatchSource` is the callable given to ``fn.external_source(batch=True, batch_info=True,
parallel=True)``. For DALI iteration ``i`` it produces the batch of global step
``start_step + i`` of this rank: the epoch positions come from
:meth:`~fastload.loader.Partition.positions` (with the padding rows), the samples from the
epoch's :class:`~fastload.loader.EpochOrder`: the arithmetic :class:`fastload.DataLoader`'s
stream uses, so both deliver the same samples per rank and step. After the last step it raises ``StopIteration``,
which ends DALI's epoch.

It is a pure function of (dataset, partition, rank, epoch, start step, iteration): DALI may call
it from any of its worker processes, in any order. It pickles by configuration (the dataset
reopens its readers in each process), so ``fork`` and ``spawn`` both work.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt

from fastload._lazy import PerProcess
from fastload.errors import FormatError, InvalidArgumentError, WorkerError
from fastload.formats import decode_field
from fastload.loader import (
    Dataset,
    Partition,
    StoreOptions,
    check_seed,
    open_dataset,
    sample_nbytes,
)
from fastload.storage import DEFAULT_CACHE_SIZE, Store

__all__ = ["META_COLUMNS", "BatchSource", "FieldSpec", "resolve_dataset"]

IntArray = npt.NDArray[np.int64]

#: Columns of the per-sample metadata output: dataset index, raw field bytes, 1 if padding.
META_COLUMNS = ("index", "nbytes", "padded")


def resolve_dataset(
    dataset: str | os.PathLike[str] | Store | Dataset,
    seed: int | None,
    shuffle: bool | None,
    on_error: str,
    store_options: Mapping[str, Any] | None,
    cache_dir: str | os.PathLike[str] | None,
    cache_size: int | str,
) -> Dataset:
    """The dataset a ``DALILoader`` reads: ``dataset`` itself, or a copy with the loader's
    overrides (``seed``/``shuffle`` ``None`` keep the dataset's), or one opened from a URL or
    store (shuffled, seed 0 by default); remote shards go through a cache in ``cache_dir``
    (local files do not: they are read in place)."""
    sources = StoreOptions(store_options, cache_dir, cache_size, entry="DALILoader")
    if isinstance(dataset, Dataset):
        if dataset.filter is not None or dataset.key_selection is not None:
            raise InvalidArgumentError(
                "DALILoader does not apply a dataset's filter=, key-list subset= or split= (its "
                "pipeline takes every sample of its steps): open the dataset without them, or "
                "load it with fastload.DataLoader"
            )
        if sources.store_options:
            raise InvalidArgumentError(
                "store_options apply only when dataset is a URL, not a Dataset"
            )
        changes: dict[str, Any] = {}
        if seed is not None and check_seed("seed", seed) != dataset.seed:
            changes["seed"] = seed
        if shuffle is not None and bool(shuffle) != dataset.shuffle:
            changes["shuffle"] = bool(shuffle)
        if on_error != dataset.on_error:
            changes["on_error"] = on_error
        if sources.cache_dir is not None and not dataset.store.has_local_paths:
            changes["store"] = sources.cache(dataset.store)
        return dataset.replace(**changes) if changes else dataset
    return open_dataset(
        sources.open(dataset, cache_local=False),
        shuffle=True if shuffle is None else bool(shuffle),
        seed=0 if seed is None else seed,
        on_error=on_error,
    )


def cache_budget(cache_size: int | str, cache_bytes: int | str | None) -> int | str:
    """The cache budget of a :class:`~fastload.dali.DALILoader`: ``cache_size``, or its former
    name ``cache_bytes`` with a ``DeprecationWarning``.

    Raises:
        InvalidArgumentError: Both were given.
    """
    if cache_bytes is None:
        return cache_size
    if cache_size != DEFAULT_CACHE_SIZE:
        raise InvalidArgumentError(
            "pass cache_size only (cache_bytes is its former name), not both"
        )
    warnings.warn(
        "DALILoader(cache_bytes=...) is now cache_size=..., as in open_dataset; cache_bytes will "
        "be removed",
        DeprecationWarning,
        stacklevel=3,
    )
    return cache_bytes


@dataclass(frozen=True)
class FieldSpec:
    """Which sample fields feed the pipeline: the image (first present of ``image``) and the label
    (first present of ``label``), as in :func:`fastload.loader.to_tuple` (``"jpg;png"``)."""

    image: tuple[str, ...]
    label: tuple[str, ...]

    @classmethod
    def parse(cls, fields: tuple[str, str] | list[str]) -> FieldSpec:
        if isinstance(fields, str) or len(fields) != 2:
            raise InvalidArgumentError(
                f"fields must be (image field, label field), e.g. ('jpg;png', 'cls'), got {fields!r}"
            )
        image, label = (tuple(a.strip() for a in f.split(";") if a.strip()) for f in fields)
        if not image or not label:
            raise InvalidArgumentError(f"fields names must not be empty, got {fields!r}")
        return cls(image, label)

    @staticmethod
    def pick(sample: dict[str, Any], names: tuple[str, ...]) -> tuple[str, Any] | None:
        for name in names:
            if name in sample:
                return name, sample[name]
        return None


class BatchSource:
    """``fn.external_source`` callable: the batches of one rank for one epoch (see module doc).

    Returns, per batch, three lists with one entry per delivered sample: encoded image bytes
    (uint8, 1-D), the label (int64, shape ``(1,)``) and metadata (int64 ``[index, nbytes,
    padded]``). Samples skipped as corrupt (``on_error="skip"``/``"warn"``) are left out.

    Args:
        dataset: The fastload dataset (order options and error policy come from it).
        partition: The epoch's partition (world size, batch size, remainder policy).
        rank: This rank.
        epoch: The epoch.
        start_step: Global step of DALI iteration 0 (resumption).
        fields: The image and label fields.
        io_threads: Threads reading one batch's samples concurrently (0 = sequential); helps
            with remote stores, where reads wait on the network.
    """

    def __init__(
        self,
        dataset: Dataset,
        partition: Partition,
        *,
        rank: int,
        epoch: int,
        start_step: int,
        fields: FieldSpec,
        io_threads: int = 0,
    ) -> None:
        self.dataset = dataset
        self.partition = partition
        self.rank = rank
        self.epoch = epoch
        self.start_step = start_step
        self.fields = fields
        self.io_threads = io_threads
        # Made once in each process that DALI calls this from (the epoch order caches windows).
        self._order = PerProcess(partial(dataset.order, epoch))
        self._pool = PerProcess(partial(ThreadPoolExecutor, io_threads)) if io_threads > 0 else None

    def plan(self, step: int) -> tuple[IntArray, npt.NDArray[np.bool_]]:
        """Dataset indices and padding flags of this rank's batch at global ``step``."""
        positions, pad = self.partition.positions(step, self.rank)
        return self._order.get().indices(positions), pad

    def __call__(self, info: Any) -> tuple[list[Any], list[Any], list[Any]]:
        step = self.start_step + int(info.iteration)
        if step >= self.partition.num_steps:
            raise StopIteration
        indices, pad = self.plan(step)
        ds = self.dataset
        shards, positions = ds.locate(indices)
        items = [(int(s), int(p)) for s, p in zip(shards.tolist(), positions.tolist())]
        where = f"rank {self.rank}, epoch {self.epoch}, global step {step}"
        if self._pool is not None and len(items) > 1:
            raws = list(self._pool.get().map(lambda sp: self._read(sp, where), items))
        else:
            raws = [self._read(sp, where) for sp in items]
        images: list[Any] = []
        labels: list[Any] = []
        metas: list[Any] = []
        for i, raw in enumerate(raws):
            if raw is None:
                continue
            shard, pos = items[i]
            key = raw.get("__key__")
            image = FieldSpec.pick(raw, self.fields.image)
            label = FieldSpec.pick(raw, self.fields.label)
            if image is None or label is None:
                missing = self.fields.image if image is None else self.fields.label
                raise WorkerError(
                    f"{where}: {ds.describe(shard, pos, key)} has none of the fields "
                    f"{'/'.join(missing)} (it has {sorted(k for k in raw if not k.startswith('__'))});"
                    " pass fields=(image, label) naming fields the dataset has"
                )
            images.append(np.frombuffer(image[1], dtype=np.uint8))
            labels.append(self._label(label[0], label[1], ds.describe(shard, pos, key)))
            metas.append(
                np.array([int(indices[i]), sample_nbytes(raw), int(pad[i])], dtype=np.int64)
            )
        return images, labels, metas

    def _read(self, item: tuple[int, int], where: str) -> dict[str, Any] | None:
        shard, pos = item
        try:
            return self.dataset.read_raw(shard, pos)
        except FormatError:
            raise
        except Exception as exc:
            raise WorkerError(
                f"{where}: reading {self.dataset.describe(shard, pos)} failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    @staticmethod
    def _label(name: str, data: bytes, where: str) -> Any:
        try:
            value = decode_field(name, bytes(data))
            arr = np.asarray(value, dtype=np.int64).reshape(-1)
        except (FormatError, TypeError, ValueError) as exc:
            raise WorkerError(
                f"label field {name!r} of {where} is not an integer ({exc}); DALI pipelines take "
                "integer labels (cls fields); choose another field with fields=(image, label)"
            ) from exc
        if arr.size != 1:
            raise WorkerError(
                f"label field {name!r} of {where} holds {arr.size} values; one integer expected"
            )
        return arr
