"""``open_dataset``: a dataset by its manifest, or by the shard URLs ``webdataset`` takes."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from fastload.errors import InvalidArgumentError
from fastload.formats import MANIFEST_NAME, read_manifest
from fastload.loader._dataset import Dataset
from fastload.loader._options import DEFAULT_PREFETCH_SHARDS, ReadOptions, StoreOptions
from fastload.loader._select import Transform
from fastload.loader._subset import SubsetSpec
from fastload.loader._wds import is_shard_pattern, open_shard_urls
from fastload.loader.order._order import DEFAULT_BLOCK_SIZE, DEFAULT_WINDOW, OrderOptions
from fastload.storage import DEFAULT_CACHE_SIZE, Store

__all__ = ["open_dataset"]


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
    max_open_shards: int | None = None,
    store_options: Mapping[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_size: int | str = DEFAULT_CACHE_SIZE,
    prefetch_shards: int = DEFAULT_PREFETCH_SHARDS,
    filter: Callable[[Any], bool] | None = None,  # noqa: A002 - webdataset's name for it
    subset: SubsetSpec = None,
    split: tuple[float, float] | None = None,
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
        max_open_shards: Open shard readers kept per reading thread (LRU). ``None`` (default):
            every shard for local files, up to an eighth of ``RLIMIT_NOFILE`` (the block
            shuffle then never reopens a shard), 16 for remote stores and caches.
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
        filter: ``decoded sample -> bool``, applied in the workers after ``decode`` and before
            ``transform``: a sample it rejects is not delivered and is counted in the loaders'
            ``stats()["filtered"]``; every sample that passes is delivered exactly once per
            epoch (the order, partition and resume are over all samples, so batches are short by
            the rejected ones). It must be a pure function of the sample (the same answer on
            every read, in every process) and picklable for worker processes. The map-style
            ``ds[i]`` returns ``None`` for a rejected sample. Not applied by ``DALILoader``
            (refused there).
        subset: Keep only samples ``[start, stop)`` of the dataset order (module doc of
            :mod:`fastload.loader._subset`): ``0.1`` (the first 10 %), ``(0.9, 1.0)``,
            ``(1000, 2000)`` or ``range(1000, 2000)``. The subset is read, shuffled,
            partitioned and resumed as a dataset of its own; only its samples are read. A
            list of keys keeps those samples (every sample is read to learn its key; the others
            are dropped before ``decode`` and counted as ``filtered``).
        split: ``(lo, hi)``, the deterministic split by key hash: keep the samples whose key
            hashes into ``[lo, hi)`` of ``[0, 1)`` (``(0.0, 0.9)`` to train, ``(0.9, 1.0)`` to
            validate: disjoint, covering, the same everywhere). Reads every sample, as a key
            list does.

    The manifest is always read from the store itself, not from the cache. Cached shards are
    assumed immutable: after overwriting a dataset in place, use a new ``cache_dir`` (or
    :meth:`~fastload.storage.CachingStore.clear` the old one).

    Raises:
        ObjectNotFoundError: No manifest at ``url`` (or a shard URL names no object).
        ManifestError: The manifest is malformed.
        InvalidArgumentError: An option is invalid, or the format is unknown.
    """
    order = OrderOptions(shuffle, seed, block_size, window)
    reading = ReadOptions(
        decode,
        transform,
        fields,
        on_error,  # type: ignore[arg-type]  # checked by ReadOptions
        max_open_shards,
        prefetch_shards,
        filter,
    )
    sources = StoreOptions(store_options, cache_dir, cache_size)
    if is_shard_pattern(url) or not isinstance(url, Store | str | os.PathLike):
        if not isinstance(url, str | Sequence):
            raise InvalidArgumentError(
                "open_dataset takes a dataset URL, a Store, a brace pattern of shard URLs or a "
                f"list of shard URLs, got {type(url).__name__}"
            )
        return open_shard_urls(url, sources=sources, order=order, reading=reading, subset=subset)
    store = sources.open(url)
    # The manifest decides what the shards are: read it from the store, never from a cache.
    source = store.uncached
    manifest = read_manifest(source, "")
    manifest.resolve_format(url=source.child_url(MANIFEST_NAME))  # fail early, naming the manifest
    return Dataset(store, manifest, order=order, reading=reading, subset=subset, split=split)
