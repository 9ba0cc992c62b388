"""The samples a dataset manifest lists: where each one lives, reading it, decode and transform.

:class:`ShardedDataset` is everything a dataset knows without torch's dataset protocols: the shard
list and the location of every sample (dataset index -> shard and position), the epoch order
(:class:`~fastload.loader.order._order.EpochOrder`), raw reads through per-thread shard readers, the
``on_error`` policy for corrupt samples, and the ``decode``/``transform``/``fields`` steps. The
batch stream (:mod:`fastload.loader._stream`) is built on it; :class:`fastload.loader.Dataset`
adds the map-style and iterable forms on top.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Mapping
from typing import Any, Protocol, Self

import numpy as np
import numpy.typing as npt

from fastload.errors import (
    CorruptDataError,
    FormatError,
    InvalidArgumentError,
    MissingDependencyError,
    UnsafeDataError,
)
from fastload.formats import DAMAGED_SHARD_REMEDY, ErrorPolicy, Format, OnError, get_format
from fastload.formats.manifest import Manifest
from fastload.loader._options import ReadOptions
from fastload.loader._readers import ReaderCache, ReaderSlot, close_quietly, default_capacity
from fastload.loader._select import ToTuple
from fastload.loader._subset import KeySelection, SubsetSpec, parse_subset, subset_shards
from fastload.loader.order._order import EpochOrder, OrderOptions, computes_order_version
from fastload.loader.order._seeds import RNG_SEED_KEY, check_seed
from fastload.storage import Store

__all__ = ["NOT_DATA_ERRORS", "SampleOrder", "ShardedDataset", "sample_nbytes"]

log = logging.getLogger("fastload.loader")

IntArray = npt.NDArray[np.int64]
#: Errors of ``decode`` that are not about the sample's bytes (a missing package, a refused
#: pickle): they raise under every ``on_error`` policy instead of skipping every sample.
NOT_DATA_ERRORS = (MissingDependencyError, UnsafeDataError)


class SampleOrder(Protocol):
    """What the batch stream needs of an epoch's order: positions -> dataset indices (an
    :class:`~fastload.loader.order._order.EpochOrder`, or a mix's order)."""

    def indices(self, positions: npt.ArrayLike) -> IntArray:
        """Dataset indices of epoch positions (what :meth:`ShardedDataset.locate` takes)."""
        ...


_BYTES_TYPES = (bytes, bytearray, memoryview)


def sample_nbytes(sample: Mapping[str, Any]) -> int:
    """Bytes of a raw sample's fields (metadata entries such as ``__key__`` not counted)."""
    total = 0
    for k, v in sample.items():
        if isinstance(v, _BYTES_TYPES) and k[:2] != "__":
            total += v.nbytes if isinstance(v, memoryview) else len(v)
    return total


def _keeps_field_names(decode: Any) -> bool:
    """Whether samples reach the ``fields`` selection with the field names of the shards."""
    from fastload.loader.images._decode import Decoder

    return decode is None or isinstance(decode, Decoder)


def _check_fields(select: ToTuple, manifest: Manifest) -> None:
    """Refuse, before any worker starts, a ``fields`` selection the dataset cannot satisfy."""
    known = set(manifest.schema)
    if not known:  # no schema (e.g. an old or hand-made manifest): nothing to check against
        return
    meta = {"__key__", "__url__", "__index__"}
    for spec, alternatives in zip(select.fields, select._specs, strict=True):
        if any(name in known or name in meta for name in alternatives):
            continue
        import difflib

        close = difflib.get_close_matches(alternatives[0], sorted(known), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise InvalidArgumentError(
            f"fields=... asks for {spec!r}, but the dataset's samples have the fields "
            f"{sorted(known)} (and __key__, __url__, __index__){hint}"
        )


class ShardedDataset:
    """The samples of a manifest's shards, read through shard readers (see module doc).

    The options are :func:`~fastload.loader.open_dataset`'s; :class:`~fastload.loader.Dataset`
    (what ``open_dataset`` returns) is the class to use.

    Pickling: a dataset pickles by configuration (store, manifest, options, callables); open readers
    are not pickled and reopen lazily in each process. ``decode``/``transform`` must themselves be
    picklable (module-level functions, not lambdas) for the ``spawn``/``forkserver`` start methods.

    Thread safety: reading from several threads is safe (each thread has its own readers).

    Caching: when :attr:`store` is a :class:`~fastload.storage.CachingStore` (``open_dataset(...,
    cache_dir=...)``), readers work from the local copies, and the iterable form asks the cache to
    fetch each process's next ``prefetch_shards`` shards (in the order its batches first read
    them) in the background.
    """

    def __init__(
        self,
        store: Store,
        manifest: Manifest,
        *,
        prefix: str = "",
        order: OrderOptions = OrderOptions(),  # noqa: B008 (frozen: one shared default is fine)
        reading: ReadOptions = ReadOptions(),  # noqa: B008
        subset: SubsetSpec = None,
        split: tuple[float, float] | None = None,
    ) -> None:
        self.store = store
        self.prefix = prefix.strip("/")
        self.manifest = manifest
        self.format_name = manifest.format
        self.shuffle, self.seed = order.shuffle, order.seed
        self.block_size, self.window = order.block_size, order.window
        self.decode, self.transform, self.select = (
            reading.decoder,
            reading.transform,
            reading.select,
        )
        if self.select is not None and self.transform is None and _keeps_field_names(self.decode):
            _check_fields(self.select, manifest)
        self.on_error: OnError = reading.on_error
        self.max_open_shards = reading.max_open_shards
        self.prefetch_shards = reading.prefetch_shards
        self.filter = reading.filter
        self.shard_keys = [self._key(s.name) for s in manifest.shards]
        self.index_keys = [self._key(s.index) if s.index else None for s in manifest.shards]
        self.shard_sizes: IntArray = np.asarray(
            [s.num_samples for s in manifest.shards], dtype=np.int64
        )
        self.subset = parse_subset(subset, int(self.shard_sizes.sum()))
        self.key_selection = KeySelection.of(subset, split)
        self._offsets: IntArray | None = None  # a subset's first sample in each shard
        if self.subset is not None:
            self.shard_sizes, self._offsets = subset_shards(self.shard_sizes, self.subset)
        self._starts: IntArray = np.zeros(len(self.shard_sizes), dtype=np.int64)
        if len(self.shard_sizes) > 1:
            np.cumsum(self.shard_sizes[:-1], out=self._starts[1:])
        self.num_samples = int(self.shard_sizes.sum())
        self._format: Format | None = None
        self._readers = ReaderCache(self.reader_capacity)
        self._warned_sequential = False

    # ---- pickling ---------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_format"] = None
        state["_readers"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._readers = ReaderCache(self.reader_capacity)

    def replace(
        self,
        *,
        store: Store | None = None,
        shuffle: bool | None = None,
        seed: int | None = None,
        on_error: str | None = None,
    ) -> Self:
        """A copy with the given options changed (``None`` keeps one): the loaders' overrides of
        a dataset's ``shuffle``/``seed``/``on_error``, or another store for its shards (a cache).

        The copy shares the manifest, ``decode``/``transform`` and (unless replaced) the store,
        and has its own shard readers, opened on first use; the original is unchanged.
        """
        state = self.__getstate__()
        if store is not None:
            state["store"] = store
        if shuffle is not None:
            state["shuffle"] = bool(shuffle)
        if seed is not None:
            state["seed"] = check_seed("seed", seed)
        if on_error is not None:
            state["on_error"] = ErrorPolicy(on_error).on_error
        copy = type(self).__new__(type(self))
        copy.__setstate__(state)
        return copy

    # ---- description ------------------------------------------------------------------------

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    @property
    def url(self) -> str:
        """The dataset root URL (no credentials)."""
        return self.store.child_url(self.prefix) if self.prefix else self.store.url

    @property
    def reader_capacity(self) -> int:
        """Shard readers each reading thread keeps open: ``max_open_shards``, or with ``None``
        :func:`~fastload.loader._readers.default_capacity` for this dataset's store."""
        if self.max_open_shards is not None:
            return self.max_open_shards
        return default_capacity(self.store, len(self.shard_keys))

    @property
    def num_shards(self) -> int:
        """Number of shards in the manifest (empty ones included)."""
        return len(self.shard_keys)

    @property
    def format(self) -> Format:
        """The shard format (resolved lazily in each process)."""
        if self._format is None:
            self._format = get_format(self.format_name)
        return self._format

    def shard_objects(self, shard: int) -> list[str]:
        """The store keys a reader of shard ``shard`` reads: its index (first, if any), then the
        shard itself."""
        index = self.index_keys[shard]
        return [self.shard_keys[shard]] if index is None else [index, self.shard_keys[shard]]

    def shard_url(self, shard: int) -> str:
        """The URL of shard number ``shard``."""
        return self.store.child_url(self.shard_keys[shard])

    @functools.cached_property
    def fingerprint(self) -> str:
        """A short hash of the shard list (names, sample counts, checksums): identifies the data
        a resume state belongs to. Computed once per dataset (O(shards)); every ``state_dict()``
        and ``load_state_dict()`` after that reads it in O(1). Copies and pickles carry it."""
        h = hashlib.sha256()
        for entry in self.manifest.shards:
            h.update(f"{entry.name}\0{entry.num_samples}\0{entry.sha256}\n".encode())
        return h.hexdigest()[:16]

    def order_options(self) -> dict[str, Any]:
        """The options that define the epoch order (they go into loader state dicts)."""
        state = OrderOptions(self.shuffle, self.seed, self.block_size, self.window).state()
        if self.subset is not None:
            state["subset"] = list(self.subset)
        return state if self.key_selection is None else {**state, **self.key_selection.state()}

    def continues_order(self, version: object) -> bool:
        """Whether a state saved with epoch-order ``version`` continues exactly here (this
        fastload orders this dataset's epochs as that version did)."""
        return isinstance(version, int) and computes_order_version(
            version, self.shard_sizes, shuffle=self.shuffle, block_size=self.block_size
        )

    def node_stats(self) -> dict[str, int]:
        """The counters of the one node cache the samples are read through (without
        ``cached_bytes``, a directory walk); empty when there is none, or several (a mix whose
        sources use several caches)."""
        caches = {s.cache_dir: s for s in self.stores if s.cache_dir is not None}
        if len(caches) != 1:
            return {}
        return next(iter(caches.values())).node_stats(cached_bytes=False)

    def __len__(self) -> int:
        return self.num_samples

    # ---- hooks a mix (fastload.mix) overrides -------------------------------------------------

    @property
    def stores(self) -> tuple[Store, ...]:
        """The stores samples are read from (one; a mix has its sources')."""
        return (self.store,)

    @property
    def source_names(self) -> tuple[str, ...]:
        """Names of a mix's sources, whose samples ``source_counts`` counts; empty here."""
        return ()

    def has_index(self, index: int) -> bool:
        """Whether ``index`` is a dataset index (what :meth:`locate` takes)."""
        return 0 <= index < self.num_samples

    def source_counts(self, indices: npt.ArrayLike) -> tuple[int, ...]:
        """Samples of each of :attr:`source_names` among dataset indices; empty here."""
        return ()

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse a loader state this dataset cannot resume beyond the loaders' common checks
        (a mix's state on a single dataset)."""
        if "mix_counts" in state:
            raise InvalidArgumentError(
                f"the state was saved by a loader of a mix (fastload.mix), not of {self.url}; "
                "resume on the mix that saved it"
            )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.url!r}, format={self.format_name!r}, samples={self.num_samples}, "
            f"shards={self.num_shards}, shuffle={self.shuffle}, seed={self.seed})"
        )

    # ---- order and location -----------------------------------------------------------------

    def order(self, epoch: int) -> SampleOrder:
        """The global order of ``epoch`` (an :class:`~fastload.loader.order._order.EpochOrder`)."""
        return EpochOrder(
            self.shard_sizes.tolist(),
            seed=self.seed,
            epoch=epoch,
            shuffle=self.shuffle,
            block_size=self.block_size,
            window=self.window,
        )

    def locate(self, indices: npt.ArrayLike) -> tuple[IntArray, IntArray]:
        """``(shard numbers, positions in shard)`` of dataset indices."""
        idx = np.asarray(indices, dtype=np.int64)
        shard = np.searchsorted(self._starts, idx, side="right") - 1
        if self._offsets is None:
            return shard, idx - self._starts[shard]
        return shard, idx - self._starts[shard] + self._offsets[shard]

    # ---- reading ----------------------------------------------------------------------------

    def _slot(self, shard: int) -> ReaderSlot:
        table = self._readers.slots()
        slot = table.get(shard)
        if slot is not None:
            table.move_to_end(shard)
            return slot
        reader = self.format.reader(
            self.store,
            self.shard_keys[shard],
            on_error=self.on_error,
            index_key=self.index_keys[shard],
            num_samples=self.manifest.shards[shard].num_samples,
            num_bytes=self.manifest.shards[shard].num_bytes,
            sha256=self.manifest.shards[shard].sha256,
        )
        slot = ReaderSlot(reader)
        table[shard] = slot
        while len(table) > self._readers.capacity:
            _, old = table.popitem(last=False)
            close_quietly(old.reader)
        return slot

    def read_raw(self, shard: int, pos: int, *, views: bool = False) -> dict[str, Any] | None:
        """Read sample ``pos`` of shard ``shard`` as stored (``{"__key__", field: bytes}``).

        ``views=True`` lets a memory-mapped shard return its byte fields as read-only
        ``memoryview`` slices of the map instead of copies (``ShardReader.read_view``): only
        for callers that copy them before handing anything out (:meth:`raw_views_ok`).

        Returns ``None`` when the sample is corrupt and the error policy is ``skip``/``warn``.

        Raises:
            FormatError: Corrupt data under ``on_error="raise"`` (names shard URL and offset/key).
            StoreError: The store failed (missing shard, network): never skipped.
        """
        slot = self._slot(shard)
        reader = slot.reader
        try:
            sample: dict[str, Any] | None
            if reader.supports_random_access:
                sample = reader.read_view(pos) if views else reader.read(pos)
            else:
                sample = self._read_sequential(slot, shard, pos)
        except FormatError as exc:
            if self.on_error == "raise":
                raise
            if self.on_error == "warn":
                log.warning("skipping corrupt sample %d of %s: %s", pos, self.shard_url(shard), exc)
            return None
        return sample

    def _read_sequential(self, slot: ReaderSlot, shard: int, pos: int) -> dict[str, Any] | None:
        if not self._warned_sequential:
            self._warned_sequential = True
            log.warning(
                "shard reader %s has no random access to %s; reading sequentially (slow for "
                "shuffled access). Build indexes with `fastload index %s`, or, for compressed "
                "shards, which cannot be indexed, convert them into indexed shards with "
                "`fastload convert %s DST`",
                type(slot.reader).__name__,
                self.shard_url(shard),
                self.url,
                self.url,
            )
        if slot.cursor is None or slot.cursor[1] is None or slot.cursor[1]["__index__"] > pos:
            it = slot.reader.iter_from(pos)
            slot.cursor = (it, next(it, None))
        it, ahead = slot.cursor
        while ahead is not None and ahead.get("__index__", pos) < pos:
            ahead = next(it, None)
        slot.cursor = (it, ahead)
        if ahead is None and self.on_error == "raise":
            raise CorruptDataError(
                f"sample {pos} is missing: the dataset manifest says the shard holds "
                f"{self.manifest.shards[shard].num_samples} samples, but it ended before sample "
                f"{pos}; the "
                f"shard is damaged or the manifest is wrong (check with `fastload verify "
                f"{self.url}`){DAMAGED_SHARD_REMEDY}",
                url=self.shard_url(shard),
            )
        if ahead is None or ahead.get("__index__", pos) != pos:
            return None  # the reader skipped it as corrupt (and counted it)
        slot.cursor = (it, next(it, None))
        return ahead

    def raw_views_ok(self) -> bool:
        """Whether raw byte fields may be read as views of a mapped shard because nothing but
        collation sees them: no ``transform``, and no ``decode`` or a
        :class:`~fastload.loader.decode.Decoder` (which copies what it decodes and passes the
        rest through). The batch stream then asks for views only with its default collation,
        which copies byte fields into the batch buffer."""
        from fastload.loader.images._decode import Decoder

        return self.transform is None and (self.decode is None or type(self.decode) is Decoder)

    def decode_raw(self, raw: dict[str, Any], shard: int | None = None) -> Any:
        """Apply ``decode`` (if any) to a raw sample (read from ``shard``: a mix decodes with
        the shard's source)."""
        return raw if self.decode is None else self.decode(raw)

    def keep_raw(self, raw: dict[str, Any], shard: int | None = None) -> bool:
        """Whether the raw sample (read from ``shard``: a mix asks the shard's source) is kept
        by the dataset's key selection (a key-list ``subset``, a ``split``); before decoding."""
        return self.key_selection is None or self.key_selection(raw.get("__key__"))

    def keep(self, sample: Any, shard: int | None = None) -> bool:
        """Whether the decoded ``sample`` (read from ``shard``: a mix asks the shard's source)
        passes the dataset's ``filter`` (every sample does without one)."""
        return self.filter is None or bool(self.filter(sample))

    def finish(self, sample: Any, shard: int | None = None) -> Any:
        """Apply ``transform`` and the ``fields`` selection to a decoded sample (from ``shard``:
        a mix applies the shard's source's)."""
        transform = self.transform
        if isinstance(transform, Mapping):
            if not isinstance(sample, Mapping):
                raise InvalidArgumentError(
                    "a per-field transform mapping needs samples that are dicts; decode returned "
                    f"{type(sample).__name__}"
                )
            sample = dict(sample)
            for name, fn in transform.items():
                if name in sample:
                    sample[name] = fn(sample[name])
        elif transform is not None:
            sample = transform(sample)
        if isinstance(sample, dict) and RNG_SEED_KEY in sample:
            del sample[RNG_SEED_KEY]
        if self.select is not None:
            sample = self.select(sample)
        return sample

    def describe(self, shard: int, pos: int, key: str | None = None) -> str:
        """Where a sample lives, for error messages."""
        if key is None:
            return f"sample at position {pos} of shard {self.shard_url(shard)}"
        return f"sample {key!r} of shard {self.shard_url(shard)} (position {pos})"

    def close(self) -> None:
        """Close this process's open shard readers; the dataset stays usable."""
        if self._readers is not None:
            self._readers.close_all()
