"""A dataset opened from its manifest: random access to samples, decode and transform hooks.

:class:`Dataset` is a map-style ``torch.utils.data.Dataset`` (``ds[i]`` is sample ``i`` in dataset
order, i.e. shard by shard as the manifest lists them). :meth:`Dataset.batches` gives the iterable
form (whole collated batches, partitioned across ranks and workers); :class:`fastload.DataLoader`
drives that form and adds epochs, resumption and statistics.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt
import torch.utils.data

from fastload.errors import (
    CorruptDataError,
    FormatError,
    InvalidArgumentError,
    MissingDependencyError,
    UnsafeDataError,
)
from fastload.formats import (
    DAMAGED_SHARD_REMEDY,
    MANIFEST_NAME,
    Format,
    OnError,
    ShardReader,
    get_format,
    read_manifest,
)
from fastload.formats.manifest import Manifest
from fastload.loader._collate import ToTuple, Transform
from fastload.loader._order import DEFAULT_BLOCK_SIZE, DEFAULT_WINDOW, EpochOrder, check_seed
from fastload.storage import CachingStore, Store, open_store, wrap_store
from fastload.storage._registry import DEFAULT_CACHE_SIZE

if TYPE_CHECKING:
    from fastload.loader._stream import BatchStream

__all__ = ["Dataset", "open_dataset", "sample_nbytes"]

log = logging.getLogger("fastload.loader")

_ON_ERROR = ("raise", "skip", "warn")
#: Metadata entry the loader adds to each raw sample: ``(seed, epoch, dataset index)``, from which
#: :func:`fastload.loader.transforms.sample_rng` builds the sample's random generator.
RNG_SEED_KEY = "__rng_seed__"
#: Shards each reading process asks a caching store to fetch ahead of its reads (see
#: :func:`open_dataset`, ``prefetch_shards``).
DEFAULT_PREFETCH_SHARDS = 2
IntArray = npt.NDArray[np.int64]
#: Errors of ``decode`` that are not about the sample's bytes (a missing package, a refused
#: pickle): they raise under every ``on_error`` policy instead of skipping every sample.
NOT_DATA_ERRORS = (MissingDependencyError, UnsafeDataError)


def sample_nbytes(sample: Mapping[str, Any]) -> int:
    """Bytes of a raw sample's fields (metadata entries such as ``__key__`` not counted)."""
    return sum(
        len(v)
        for k, v in sample.items()
        if not k.startswith("__") and isinstance(v, bytes | bytearray | memoryview)
    )


class _Slot:
    """One open shard reader plus a sequential cursor for readers without random access."""

    __slots__ = ("cursor", "reader")

    def __init__(self, reader: ShardReader) -> None:
        self.reader = reader
        self.cursor: tuple[Any, dict[str, Any] | None] | None = None  # (iterator, lookahead)


class _ReaderCache:
    """Open shard readers, an LRU per thread (readers are never shared between threads).

    Reset when the process changes (after ``fork``), so no reader crosses a process boundary.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._per_thread: dict[int, OrderedDict[int, _Slot]] = {}

    def slots(self) -> OrderedDict[int, _Slot]:
        if self._pid != os.getpid():  # inherited through fork: drop without touching
            self._pid = os.getpid()
            self._lock = threading.Lock()
            self._per_thread = {}
        ident = threading.get_ident()
        table = self._per_thread.get(ident)
        if table is None:
            with self._lock:
                table = self._per_thread.setdefault(ident, OrderedDict())
        return table

    def close_all(self) -> None:
        if self._pid != os.getpid():
            self._per_thread = {}
            return
        with self._lock:
            tables, self._per_thread = list(self._per_thread.values()), {}
        for table in tables:
            for slot in table.values():
                _close_quietly(slot.reader)


def _close_quietly(reader: ShardReader) -> None:
    try:
        reader.close()
    except Exception as exc:  # closing must not mask the error being handled
        log.debug("closing reader %s failed: %s", reader.url, exc)


def _keeps_field_names(decode: Any) -> bool:
    """Whether samples reach the ``fields`` selection with the field names of the shards."""
    from fastload.loader.decode import Decoder

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


class Dataset(torch.utils.data.Dataset[Any]):
    """A fastload dataset: shards listed by a manifest, read through shard readers.

    Create it with :func:`open_dataset`. ``len(ds)`` is the number of samples; ``ds[i]`` reads,
    decodes and transforms sample ``i`` in dataset order (random access through the shard index).
    Under ``on_error="skip"``/``"warn"``, ``ds[i]`` returns ``None`` for a corrupt sample (use
    :func:`fastload.loader.default_collate`-compatible handling, or prefer :class:`fastload.DataLoader`
    which drops it from the batch and counts it).

    ``ds[i]`` does not add the ``"__rng_seed__"`` entry (it knows no epoch), so seeded random
    transforms draw fresh randomness there; the iterable form and :class:`fastload.DataLoader`
    seed every sample from (seed, epoch, index).

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
        shuffle: bool = True,
        seed: int = 0,
        decode: Callable[[dict[str, Any]], Any] | str | Literal[False] | None = None,
        transform: Transform | None = None,
        fields: Sequence[str] | str | None = None,
        on_error: str = "raise",
        block_size: int | None = DEFAULT_BLOCK_SIZE,
        window: int = DEFAULT_WINDOW,
        max_open_shards: int = 16,
        prefetch_shards: int = DEFAULT_PREFETCH_SHARDS,
    ) -> None:
        if on_error not in _ON_ERROR:
            raise InvalidArgumentError(f"on_error must be one of {_ON_ERROR}, got {on_error!r}")
        if decode is False:  # webdataset users write decode=False for "keep the bytes"
            decode = None
        if isinstance(decode, str):
            from fastload.loader.decode import Decoder

            decode = Decoder(image=decode)  # type: ignore[arg-type]
        if decode is not None and not callable(decode):
            raise InvalidArgumentError(
                "decode must be a callable taking a sample dict, or an image mode for "
                f"fastload.loader.decode.Decoder ('rgb8', 'torch', ...), got {decode!r}"
            )
        if transform is not None and not (callable(transform) or isinstance(transform, Mapping)):
            raise InvalidArgumentError(
                "transform must be a callable or a mapping field name -> callable, got "
                f"{type(transform).__name__}"
            )
        if isinstance(transform, Mapping):
            for name, fn in transform.items():
                if not callable(fn):
                    raise InvalidArgumentError(f"transform[{name!r}] is not callable: {fn!r}")
        if isinstance(max_open_shards, bool) or not isinstance(max_open_shards, int):
            raise InvalidArgumentError(f"max_open_shards must be an int, got {max_open_shards!r}")
        if max_open_shards < 1:
            raise InvalidArgumentError(f"max_open_shards must be >= 1, got {max_open_shards}")
        if (
            isinstance(prefetch_shards, bool)
            or not isinstance(prefetch_shards, int)
            or prefetch_shards < 0
        ):
            raise InvalidArgumentError(
                f"prefetch_shards must be an int >= 0, got {prefetch_shards!r}"
            )
        self.store = store
        self.prefix = prefix.strip("/")
        self.manifest = manifest
        self.format_name = manifest.format
        self.shuffle = bool(shuffle)
        self.seed = check_seed("seed", seed)
        self.block_size = block_size
        self.window = window
        EpochOrder([1], seed=self.seed, block_size=block_size, window=window)  # validates options
        self.decode = decode
        self.transform = transform
        if isinstance(fields, str):
            fields = (fields,)
        self.select: ToTuple | None = ToTuple(*fields) if fields is not None else None
        if self.select is not None and transform is None and _keeps_field_names(decode):
            _check_fields(self.select, manifest)
        self.on_error: OnError = on_error  # type: ignore[assignment]
        self.max_open_shards = max_open_shards
        self.prefetch_shards = prefetch_shards
        self.shard_keys = [self._key(s.name) for s in manifest.shards]
        self.index_keys = [self._key(s.index) if s.index else None for s in manifest.shards]
        self.shard_sizes: IntArray = np.asarray(
            [s.num_samples for s in manifest.shards], dtype=np.int64
        )
        self._starts: IntArray = np.zeros(len(self.shard_sizes), dtype=np.int64)
        if len(self.shard_sizes) > 1:
            np.cumsum(self.shard_sizes[:-1], out=self._starts[1:])
        self.num_samples = int(self.shard_sizes.sum())
        self._format: Format | None = None
        self._readers = _ReaderCache(max_open_shards)
        self._warned_sequential = False

    # ---- pickling ---------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_format"] = None
        state["_readers"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._readers = _ReaderCache(self.max_open_shards)

    # ---- description ------------------------------------------------------------------------

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    @property
    def url(self) -> str:
        """The dataset root URL (no credentials)."""
        return self.store.child_url(self.prefix) if self.prefix else self.store.url

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

    @property
    def fingerprint(self) -> str:
        """A short hash of the shard list (names, sample counts, checksums): identifies the data
        a resume state belongs to."""
        h = hashlib.sha256()
        for entry in self.manifest.shards:
            h.update(f"{entry.name}\0{entry.num_samples}\0{entry.sha256}\n".encode())
        return h.hexdigest()[:16]

    def order_options(self) -> dict[str, Any]:
        """The options that define the epoch order (they go into loader state dicts)."""
        return {
            "shuffle": self.shuffle,
            "seed": self.seed,
            "block_size": self.block_size,
            "window": self.window,
        }

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        return (
            f"Dataset({self.url!r}, format={self.format_name!r}, samples={self.num_samples}, "
            f"shards={self.num_shards}, shuffle={self.shuffle}, seed={self.seed})"
        )

    # ---- order and location -----------------------------------------------------------------

    def order(self, epoch: int) -> EpochOrder:
        """The global order of ``epoch`` (see :mod:`fastload.loader._order`)."""
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
        return shard, idx - self._starts[shard]

    # ---- reading ----------------------------------------------------------------------------

    def _slot(self, shard: int) -> _Slot:
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
            num_samples=int(self.shard_sizes[shard]),
            num_bytes=self.manifest.shards[shard].num_bytes,
        )
        slot = _Slot(reader)
        table[shard] = slot
        while len(table) > self._readers.capacity:
            _, old = table.popitem(last=False)
            _close_quietly(old.reader)
        return slot

    def read_raw(self, shard: int, pos: int) -> dict[str, Any] | None:
        """Read sample ``pos`` of shard ``shard`` as stored (``{"__key__", field: bytes}``).

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
                sample = reader.read(pos)
            else:
                sample = self._read_sequential(slot, shard, pos)
        except FormatError as exc:
            if self.on_error == "raise":
                raise
            if self.on_error == "warn":
                log.warning("skipping corrupt sample %d of %s: %s", pos, self.shard_url(shard), exc)
            return None
        return sample

    def _read_sequential(self, slot: _Slot, shard: int, pos: int) -> dict[str, Any] | None:
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
                f"{int(self.shard_sizes[shard])} samples, but it ended before sample {pos}; the "
                f"shard is damaged or the manifest is wrong (check with `fastload verify "
                f"{self.url}`){DAMAGED_SHARD_REMEDY}",
                url=self.shard_url(shard),
            )
        if ahead is None or ahead.get("__index__", pos) != pos:
            return None  # the reader skipped it as corrupt (and counted it)
        slot.cursor = (it, next(it, None))
        return ahead

    def decode_raw(self, raw: dict[str, Any]) -> Any:
        """Apply ``decode`` (if any) to a raw sample."""
        return raw if self.decode is None else self.decode(raw)

    def finish(self, sample: Any) -> Any:
        """Apply ``transform`` and the ``fields`` selection to a decoded sample."""
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

    def __getitem__(self, index: int) -> Any:
        """Sample ``index`` in dataset order, decoded and transformed (``None`` if skipped)."""
        if isinstance(index, bool) or not isinstance(index, int | np.integer):
            raise InvalidArgumentError(f"dataset index must be an int, got {index!r}")
        i = int(index)
        if i < 0:
            i += self.num_samples
        if not 0 <= i < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        shard, pos = (int(x) for x in self.locate(i))
        raw = self.read_raw(shard, pos)
        if raw is None:
            return None
        try:
            decoded = self.decode_raw(raw)
        except Exception as exc:
            if self.on_error == "raise" or isinstance(exc, NOT_DATA_ERRORS):
                exc.add_note(
                    f"while decoding sample {raw.get('__key__')!r} of {self.shard_url(shard)}"
                )
                raise
            log.debug("skipping undecodable sample %r: %s", raw.get("__key__"), exc)
            return None
        return self.finish(decoded)

    def describe(self, shard: int, pos: int, key: str | None = None) -> str:
        """Where a sample lives, for error messages."""
        if key is None:
            return f"sample at position {pos} of shard {self.shard_url(shard)}"
        return f"sample {key!r} of shard {self.shard_url(shard)} (position {pos})"

    def close(self) -> None:
        """Close this process's open shard readers; the dataset stays usable."""
        if self._readers is not None:
            self._readers.close_all()

    # ---- iterable form ----------------------------------------------------------------------

    def batches(
        self,
        batch_size: int,
        *,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        epoch: int = 0,
        io_threads: int | None = None,
        prefetch_batches: int = 1,
    ) -> BatchStream:
        """The iterable form: an ``IterableDataset`` of collated batches for this rank.

        Use it with ``torch.utils.data.DataLoader(stream, batch_size=None, num_workers=...)``, or
        let :class:`fastload.DataLoader` build it. Rank and world size are detected now (see
        :func:`~fastload.loader._dist.detect_rank_world`) unless given.
        """
        from fastload.loader._stream import BatchStream

        return BatchStream(
            self,
            batch_size,
            drop_last=drop_last,
            collate_fn=collate_fn,
            rank=rank,
            world_size=world_size,
            epoch=epoch,
            io_threads=io_threads,
            prefetch_batches=prefetch_batches,
        )


def open_dataset(
    url: str | os.PathLike[str] | Store | Sequence[str],
    *,
    shuffle: bool = True,
    seed: int = 0,
    decode: Callable[[dict[str, Any]], Any] | str | Literal[False] | None = None,
    transform: Transform | None = None,
    fields: Sequence[str] | str | None = None,
    on_error: str = "raise",
    block_size: int | None = DEFAULT_BLOCK_SIZE,
    window: int = DEFAULT_WINDOW,
    max_open_shards: int = 16,
    store_options: Mapping[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_size: int | str = DEFAULT_CACHE_SIZE,
    prefetch_shards: int = DEFAULT_PREFETCH_SHARDS,
) -> Dataset:
    """Open a dataset by its manifest (``fastload.json`` at ``url``), or shard URLs as they are.

    Args:
        url: The dataset root: a local path, ``file://``, ``s3://bucket/prefix``, ... (opened with
            :func:`fastload.open_store`), or an open :class:`~fastload.storage.Store` whose root
            is the dataset root. Or, as the ``webdataset`` library takes them, a brace pattern
            of shard URLs (``"s3://b/train-{000000..000999}.tar"``, ``"/data/{a,b}-{0..9}.tar"``)
            or a list of shard URLs: these are indexed on the fly into an in-memory manifest
            (each shard's ``.idx`` is read, or its tar headers are scanned when it has none;
            compressed shards are read through; nothing is written, and no SHA-256 is computed:
            see :func:`fastload.loader._wds.shard_list_manifest`). The shards must share one
            directory or bucket.
        shuffle: Shuffle the epoch order (block shuffle with a window, see ``block_size``).
        seed: Non-negative seed of the order; the order is a pure function of (seed, epoch).
        decode: ``raw sample -> sample``: runs first on each sample (in the worker). ``None``
            or ``False`` keeps the bytes. The raw
            sample is ``{"__key__": str, "__url__": shard URL, "__index__": int, field: bytes}``
            plus, in the iterable form, ``"__rng_seed__": (seed, epoch, dataset index)``.
            ``None`` keeps the bytes; a string is an image mode for
            :class:`fastload.loader.decode.Decoder` (``"rgb8"``, ``"torch"``, ``"pil"``,
            ``"bytes"``), which decodes every field by its extension.
        transform: ``sample -> sample`` after decoding, or a mapping ``field -> callable``
            applied to those fields of a dict sample.
        fields: Return tuples of these fields (``("jpg;png", "cls")``, see :func:`to_tuple`)
            instead of dicts; applied after ``transform``.
        on_error: For corrupt samples: ``"raise"`` (default), ``"skip"`` (drop and count) or
            ``"warn"`` (drop, count and log). Errors raised by ``decode`` count as corrupt data;
            errors raised by ``transform`` always raise (they are bugs, not bad data).
        block_size: Samples per shuffle block (locality of reads); ``None`` = whole shards.
        window: Blocks per shuffle window (how far samples mix locally).
        max_open_shards: Open shard readers kept per reading thread (LRU).
        store_options: Options for :func:`fastload.open_store`: backend options
            (``endpoint_url``, credentials, ...) and its wrappers' (``retry=RetryConfig(...)``,
            ``max_concurrency``). Not allowed when ``url`` is a store.
        cache_dir: A local directory that caches the shards (whole objects, see
            :class:`~fastload.storage.CachingStore`): the first epoch downloads each shard once
            (per node: all workers and ranks on the node share the directory) while training on
            those already there; later epochs read local files. ``None`` (default) reads the store
            directly. Also applies when ``url`` is a store (it is wrapped).
        cache_size: Byte budget of the cache (``"50GB"``, ``"1.5GiB"`` or an int; default 10 GB),
            least recently used shards are evicted. When the dataset is larger than the budget,
            prefer the streaming shuffle (``block_size=None``, a small ``window``), which reads
            whole shards in a random order, so each shard is downloaded once per epoch.
        prefetch_shards: With a cache: each reading process (each DataLoader worker) keeps the
            next ``prefetch_shards`` shards that its coming batches will read downloading in the
            background, in the epoch's order. Workers that need the same shard share one
            download. ``0`` disables prefetching. Reserve ``prefetch_shards x workers x ranks per
            node`` shards of the cache budget for it.

    The manifest is always read from the store itself, not from the cache. Cached shards are
    assumed immutable: after overwriting a dataset in place, use a new ``cache_dir`` (or
    :meth:`~fastload.storage.CachingStore.clear` the old one).

    Raises:
        ObjectNotFoundError: No manifest at ``url`` (or a shard URL names no object).
        ManifestError: The manifest is malformed.
        InvalidArgumentError: An option is invalid, or the format is unknown.
    """
    options_of_dataset: dict[str, Any] = {
        "shuffle": shuffle,
        "seed": seed,
        "decode": decode,
        "transform": transform,
        "fields": fields,
        "on_error": on_error,
        "block_size": block_size,
        "window": window,
        "max_open_shards": max_open_shards,
        "prefetch_shards": prefetch_shards,
    }
    from fastload.loader._wds import is_shard_pattern, open_shard_urls

    if is_shard_pattern(url) or not isinstance(url, Store | str | os.PathLike):
        if not isinstance(url, str | Sequence):
            raise InvalidArgumentError(
                "open_dataset takes a dataset URL, a Store, a brace pattern of shard URLs or a "
                f"list of shard URLs, got {type(url).__name__}"
            )
        return open_shard_urls(
            url,
            store_options=store_options,
            cache_dir=cache_dir,
            cache_size=cache_size,
            **options_of_dataset,
        )
    if isinstance(url, Store):
        if store_options:
            raise InvalidArgumentError("store_options apply only when url is a URL, not a Store")
        store = (
            url
            if cache_dir is None
            else wrap_store(url, cache_dir=cache_dir, cache_size=cache_size)
        )
    else:
        options = dict(store_options or {})
        for name in ("cache_dir", "cache_size"):
            if name in options:
                raise InvalidArgumentError(
                    f"pass {name} to open_dataset itself, not in store_options"
                )
        store = open_store(url, cache_dir=cache_dir, cache_size=cache_size, **options)
    # The manifest decides what the shards are: read it from the store, never from a cache.
    source = store.inner if isinstance(store, CachingStore) else store
    manifest = read_manifest(source, "")
    manifest.resolve_format(url=source.child_url(MANIFEST_NAME))  # fail early, naming the manifest
    return Dataset(store, manifest, **options_of_dataset)
