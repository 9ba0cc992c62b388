"""A weighted mix of sample datasets that :class:`fastload.DataLoader` loads like one dataset.

:class:`MixedDataset` presents the union of its sources' shards (source 0's shards, then source
1's, ...) and an epoch order (:class:`MixedOrder`) that maps each position of a mix epoch, through
:class:`~fastload.loader.mix._schedule.MixPlan`, to a source, the source's own epoch and a
position in it, and from there through the source's own :class:`~fastload.loader.order._order.
EpochOrder` to one of its samples. The batch stream, partitioning, workers, resumption and
error handling are the loader's own, unchanged.

**Mixed indices.** What the order returns for a position is ``k x T + first_i + j`` for sample
``j`` of source ``i`` (``first_i``: the samples of the sources before ``i``; ``T``: all sources'
samples) in the source's own epoch ``k``. It locates a sample (``index mod T`` is its place in the
union) and, being different for each delivery of a sample (each own epoch), seeds each
delivery's augmentation apart (``"__rng_seed__" = (mix seed, mix epoch, mixed index)``).

**Per-source steps.** Each sample is read, decoded and transformed by its own source (its
``decode``, ``transform`` and ``fields``), so sources with other field names can be mapped onto
one structure by their transforms. What the sources must share is what collation needs: the
samples they finish with must collate together (the same structure, e.g. images of one size and
a label). Checked up front: the same ``fields`` selection (or none) and ``on_error`` policy in
every source; a structure that still does not collate fails in the workers with a
:class:`~fastload.errors.WorkerError` naming the batch's shards.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Self

import numpy as np
import numpy.typing as npt

from fastload._memo import BoundedMemo
from fastload.errors import InvalidArgumentError
from fastload.loader._dataset import Dataset
from fastload.loader._shards import SampleOrder
from fastload.loader.mix._schedule import (
    MixIdentity,
    source_epoch_groups,
)
from fastload.loader.order._order import ORDER_VERSION
from fastload.loader.order._seeds import check_seed
from fastload.storage import Store

__all__ = ["MixedDataset", "MixedOrder"]

IntArray = npt.NDArray[np.int64]
#: What a single dataset has and a mix does not (they describe one manifest's shards).
_ONE_DATASET = frozenset({"manifest", "format_name", "_format", "index_keys", "prefix"})


class MixedOrder:
    """The order of one mix epoch: epoch positions -> mixed indices (see the module doc).

    Not a bijection: a source weighted above its size repeats, each time in its next own epoch.
    Thread safety: one thread at a time (it caches the sources' epoch orders).
    """

    _CACHED_ORDERS = 2  # per source: a batch spans at most a few own epochs, in increasing order

    def __init__(self, mix: MixedDataset, epoch: int) -> None:
        self.mix = mix
        self.epoch = check_seed("epoch", epoch)
        self._orders: list[BoundedMemo[int, SampleOrder]] = [
            BoundedMemo(self._CACHED_ORDERS) for _ in mix.sources
        ]

    def _order(self, source: int, epoch: int) -> SampleOrder:
        return self._orders[source].get_or_make(
            epoch, lambda: self.mix.sources[source].order(epoch)
        )

    def indices(self, positions: npt.ArrayLike) -> IntArray:
        """Mixed indices of the given positions of the epoch (each in ``[0, len(mix))``)."""
        pos = np.asarray(positions, dtype=np.int64)
        flat = pos.reshape(-1)
        source, src_epoch, src_pos = self.mix.plan.locate(self.epoch, flat)
        out = np.empty_like(flat)
        for i, k, rows in source_epoch_groups(source, src_epoch):
            local = self._order(i, k).indices(src_pos[rows])
            out[rows] = k * self.mix.total + self.mix.first_sample[i] + local
        return out.reshape(pos.shape)

    def __len__(self) -> int:
        return self.mix.num_samples


class MixedDataset(MixIdentity, Dataset):
    """Sample datasets mixed by weight, for :class:`fastload.DataLoader` (make one with
    :func:`fastload.mix`).

    ``len(mix)`` is the mix epoch's positions (``epoch_size``). Every window of ``window``
    consecutive positions (counted from the start of the run, across mix epochs) holds exactly
    ``counts[i]`` samples of source ``i``, evenly spread (see :mod:`fastload.loader.
    _mix_schedule`); a source's samples come in its own epoch orders, each sample once per own
    epoch, and a source that runs out continues with its next own epoch.
    :meth:`fastload.DataLoader.stats` adds ``samples[<name>]`` per source.

    Not map-style: ``mix[i]`` raises (a mix position means something only in an epoch); read a
    source's samples from the source. DALI loaders do not take mixes.

    Args:
        sources: Datasets from :func:`fastload.open_dataset` (see the module doc for what they
            must share).
        counts: Samples of each source per window.
        epoch_size: Positions per mix epoch; ``None``: the sources' total, rounded up to a
            multiple of the window.
        seed: The mix's seed: seeds each delivery's augmentation and the workers' global
            generators (the sources' orders keep their own seeds).
        names: Source names for messages and ``stats()`` (default: URLs, made unique).

    Pickling and thread safety are the sources' (readers reopen in each process).
    """

    def __init__(
        self,
        sources: Sequence[Dataset],
        counts: Sequence[int],
        *,
        epoch_size: int | None = None,
        seed: int = 0,
        names: Sequence[str] | None = None,
    ) -> None:
        self.sources = tuple(sources)
        for i, s in enumerate(self.sources):
            if not isinstance(s, Dataset) or isinstance(s, MixedDataset):
                raise InvalidArgumentError(
                    f"source {i} of a sample mix is a {type(s).__name__}; pass datasets from "
                    "fastload.open_dataset (or their URLs); a mix of mixes is one mix with the "
                    "weights multiplied out"
                )
        self._plan_mix(counts, [s.num_samples for s in self.sources], epoch_size, seed, names)
        first = self.sources[0]
        for name, s in zip(self.names[1:], self.sources[1:]):
            if s.select != first.select:
                raise InvalidArgumentError(
                    f"the sources of a mix must select the same fields to collate together: "
                    f"{self.names[0]} has fields={_fields(first)}, {name} has fields={_fields(s)}; "
                    "open them with the same fields=..."
                )
            if s.on_error != first.on_error:
                raise InvalidArgumentError(
                    f"the sources of a mix must share one on_error policy: {self.names[0]} has "
                    f"{first.on_error!r}, {name} has {s.on_error!r}"
                )
        self._setup()

    def _setup(self) -> None:
        """The attributes derived from the sources (again after :meth:`replace`)."""
        sources = self.sources
        self.num_samples = self.plan.epoch_size
        sizes = np.asarray([s.num_samples for s in sources], dtype=np.int64)
        self.total = int(sizes.sum())
        self.first_sample = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        shards = np.asarray([s.num_shards for s in sources], dtype=np.int64)
        self.first_shard = np.concatenate([[0], np.cumsum(shards)[:-1]]).astype(np.int64)
        self.shard_sizes = np.concatenate([s.shard_sizes for s in sources]).astype(np.int64)
        self.shard_keys = [k for s in sources for k in s.shard_keys]
        self._shards: list[tuple[Dataset, int]] = [
            (s, j) for s in sources for j in range(s.num_shards)
        ]
        self.shuffle = all(s.shuffle for s in sources)
        self.block_size = None
        self.window = self.plan.window
        self.on_error = sources[0].on_error
        self.select = sources[0].select
        self.decode = self.transform = self.filter = self.subset = self.key_selection = None
        self.store = sources[0].store
        same_store = all(s.store is self.store for s in sources)
        # The lookahead prefetches through ``self.store``: only when every source reads from it.
        self.prefetch_shards = min(s.prefetch_shards for s in sources) if same_store else 0
        # One reader LRU serves every source: room for what each would keep open on its own.
        self.max_open_shards = sum(s.reader_capacity for s in sources)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # ---- description ------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``mix(name: count/window, ...)``, for messages."""
        return f"mix({self.plan.describe()})"

    @property
    def stores(self) -> tuple[Store, ...]:
        """Every source's store."""
        return tuple(s.store for s in self.sources)

    @property
    def source_names(self) -> tuple[str, ...]:
        """The sources' names, in source order (the keys of ``stats()``'s per-source counts)."""
        return self.names

    @functools.cached_property
    def fingerprint(self) -> str:
        """A hash of the sources' fingerprints (see :class:`~fastload.loader.mix._schedule.
        MixIdentity`)."""
        return self._data_fingerprint()

    def order_options(self) -> dict[str, Any]:
        """The mix's options, its seed, and each source's fingerprint and order options."""
        return {"order_version": ORDER_VERSION, **self._mix_options()}

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse a state saved by another mix, or by a single dataset, saying what differs."""
        MixIdentity.check_state(self, state)

    def replace(
        self,
        *,
        store: Store | None = None,
        shuffle: bool | None = None,
        seed: int | None = None,
        on_error: str | None = None,
    ) -> Self:
        """A copy with ``shuffle``/``on_error`` changed in every source (``seed`` changes the
        mix's seed and every source's); another ``store`` is refused (sources have their own)."""
        if store is not None:
            raise InvalidArgumentError(
                "a mix reads each source from its own store; replace the sources' stores instead"
            )
        copy = type(self).__new__(type(self))
        copy.__setstate__(self.__getstate__())
        copy.__dict__.pop("fingerprint", None)
        copy.sources = tuple(
            s.replace(shuffle=shuffle, seed=seed, on_error=on_error) for s in self.sources
        )
        if seed is not None:
            copy.seed = check_seed("seed", seed)
        copy._setup()
        return copy

    def __repr__(self) -> str:
        return (
            f"MixedDataset({self.plan.describe()}, epoch_size={self.num_samples}, seed={self.seed})"
        )

    # ---- order and location -----------------------------------------------------------------

    def order(self, epoch: int) -> MixedOrder:
        """The order of mix epoch ``epoch`` (positions -> mixed indices, see module doc)."""
        return MixedOrder(self, epoch)

    def _source_of(self, indices: IntArray) -> tuple[IntArray, IntArray]:
        """``(source, index in the source)`` of mixed indices."""
        union = np.asarray(indices, dtype=np.int64) % self.total
        source = np.searchsorted(self.first_sample, union, side="right") - 1
        return source, union - self.first_sample[source]

    def locate(self, indices: npt.ArrayLike) -> tuple[IntArray, IntArray]:
        """``(shard of the union, position in shard)`` of mixed indices."""
        source, local = self._source_of(np.asarray(indices, dtype=np.int64))
        shard = np.empty_like(local)
        pos = np.empty_like(local)
        for i in np.flatnonzero(np.bincount(source)).tolist():
            rows = source == i
            s, p = self.sources[i].locate(local[rows])
            shard[rows], pos[rows] = s + self.first_shard[i], p
        return shard, pos

    def has_index(self, index: int) -> bool:
        """Whether ``index`` is a mixed index (any ``>= 0``: own epochs are unbounded)."""
        return index >= 0

    def source_counts(self, indices: npt.ArrayLike) -> tuple[int, ...]:
        """Samples of each source among mixed indices."""
        source, _ = self._source_of(np.asarray(indices, dtype=np.int64).reshape(-1))
        return tuple(np.bincount(source, minlength=len(self.sources)).tolist())

    def _shard(self, shard: int) -> tuple[Dataset, int]:
        """The source of shard ``shard`` of the union and its number there (a list lookup:
        this runs for every sample read, decoded and transformed)."""
        return self._shards[shard]

    # ---- reading ----------------------------------------------------------------------------

    def shard_objects(self, shard: int) -> list[str]:
        """Store keys of shard ``shard`` of the union, in its source's store."""
        ds, local = self._shard(shard)
        return ds.shard_objects(local)

    def shard_url(self, shard: int) -> str:
        """The URL of shard ``shard`` of the union."""
        ds, local = self._shard(shard)
        return ds.shard_url(local)

    def read_raw(self, shard: int, pos: int, *, views: bool = False) -> dict[str, Any] | None:
        """Sample ``pos`` of shard ``shard`` of the union, read by its source."""
        ds, local = self._shard(shard)
        return ds.read_raw(local, pos, views=views)

    def raw_views_ok(self) -> bool:
        """Whether every source may read its byte fields as views (see the sources')."""
        return all(s.raw_views_ok() for s in self.sources)

    def decode_raw(self, raw: dict[str, Any], shard: int | None = None) -> Any:
        """Decode with the ``decode`` of the source of ``shard`` (required for a mix)."""
        return self._steps_of(shard).decode_raw(raw)

    def keep_raw(self, raw: dict[str, Any], shard: int | None = None) -> bool:
        """Whether ``raw`` passes the key selection of the source of ``shard`` (required)."""
        return self._steps_of(shard).keep_raw(raw)

    def keep(self, sample: Any, shard: int | None = None) -> bool:
        """Whether ``sample`` passes the ``filter`` of the source of ``shard`` (required)."""
        return self._steps_of(shard).keep(sample)

    def finish(self, sample: Any, shard: int | None = None) -> Any:
        """Transform and select with the steps of the source of ``shard`` (required)."""
        return self._steps_of(shard).finish(sample)

    def _steps_of(self, shard: int | None) -> Dataset:
        if shard is None:
            raise InvalidArgumentError(
                "a mix decodes each sample with its own source's steps: pass the shard"
            )
        return self._shards[shard][0]

    def describe(self, shard: int, pos: int, key: str | None = None) -> str:
        """Where a sample lives, for error messages (its source's description)."""
        ds, local = self._shard(shard)
        return ds.describe(local, pos, key)

    def close(self) -> None:
        """Close this process's open shard readers of every source."""
        for s in self.sources:
            s.close()

    def __getattr__(self, name: str) -> Any:
        # Only for attributes a mix does not have: a single dataset's manifest and layout.
        if name in _ONE_DATASET:
            raise InvalidArgumentError(
                f"a mix has no {name.lstrip('_')}: it reads several datasets (DALI loaders and "
                "tools that read one dataset's manifest do not take mixes); use one of "
                "mix.sources there"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __getitem__(self, index: int) -> Any:
        raise InvalidArgumentError(
            "a mix has no map-style access (a position means something only within an epoch); "
            "iterate it with fastload.DataLoader, or index one of mix.sources"
        )


def _fields(ds: Dataset) -> str:
    return "None" if ds.select is None else repr(ds.select.fields)
