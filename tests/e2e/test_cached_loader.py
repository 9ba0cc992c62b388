"""The loader over a local disk cache, without a server: a local directory plays the remote store.

Checks what streaming from object storage relies on, cheaply: every epoch delivers every sample
exactly once through the cache, the first epoch fills the cache and later ones download nothing,
the cache stays within its budget, and each worker's prefetch follows the epoch's shard order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload.errors import InvalidArgumentError
from fastload.loader import BatchStream, Dataset
from fastload.storage import CachingStore, LocalStore

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def remote(image_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The corpus as a WebDataset of 15 shards in a local directory (the "remote" store)."""
    root = tmp_path_factory.mktemp("e2e-remote") / "ds"
    fastload.convert(
        image_folder, root, format="webdataset", shard_samples=10, workers=1, quiet=True
    )
    return root


def test_epochs_through_the_cache_are_exact_and_download_once(
    remote: Path,
    image_keys: list[str],
    tmp_path: Path,
    e2e: Any,
) -> None:
    cache = tmp_path / "cache"
    ds = fastload.open_dataset(
        remote, cache_dir=cache, cache_size="50MB", seed=5, fields=("__key__", "cls")
    )
    assert isinstance(ds.store, CachingStore)
    assert e2e.cache_files(cache) == {}  # the manifest is read from the store, not cached
    loader = fastload.DataLoader(ds, batch_size=16, num_workers=2)
    assert sorted(e2e.epoch_keys(loader, 0)) == image_keys
    filled = e2e.cache_files(cache)
    assert len(filled) == 2 * ds.num_shards  # every shard and its index, once
    # The node's counters, summed over the two workers (gone: not persistent), say the same.
    sizes = sum(ds.store.size(k) + ds.store.size(f"{k}.idx") for k in ds.shard_keys)
    stats = loader.stats()
    assert stats["node_cache_downloads"] == 2 * ds.num_shards
    assert stats["node_cache_misses"] <= 2 * ds.num_shards  # the others were prefetched
    assert stats["node_cache_bytes_downloaded"] == sizes
    # A head and a get per object, and a head from a worker that opened a shard while the other
    # worker was filling it.
    assert 4 * ds.num_shards <= stats["node_cache_requests"] <= 5 * ds.num_shards
    assert stats["node_cache_evictions"] == 0
    for epoch in (1, 2):
        keys = e2e.epoch_keys(loader, epoch)
        assert sorted(keys) == image_keys
        assert e2e.cache_files(cache) == filled  # nothing downloaded again
    again = loader.stats()
    assert again["node_cache_bytes_downloaded"] == sizes
    assert again["node_cache_hits"] > stats["node_cache_hits"]


def test_streaming_shuffle_stays_within_a_small_cache(
    remote: Path,
    image_keys: list[str],
    tmp_path: Path,
    e2e: Any,
) -> None:
    budget = 400_000  # ~4 of the 15 shards (with their indexes)
    ds = fastload.open_dataset(
        remote,
        cache_dir=tmp_path / "cache",
        cache_size=budget,
        block_size=None,
        window=1,
        prefetch_shards=1,
        fields=("__key__", "cls"),
    )
    loader = fastload.DataLoader(ds, batch_size=10, num_workers=2)
    for epoch in (0, 1):
        assert sorted(e2e.epoch_keys(loader, epoch)) == image_keys
        assert isinstance(ds.store, CachingStore)
        assert ds.store.cached_bytes() <= budget


def first_read_order(ds: Dataset, stream: Any, worker: int, num_workers: int) -> list[int]:
    """Shards in the order the worker's batches first read them."""
    order = ds.order(stream.epoch)
    seen: list[int] = []
    for step in stream.partition.worker_steps(0, worker, num_workers):
        planned = stream._reads.plan(order, int(step), 0)
        for shard in sorted(set(planned.shards.tolist())):
            if shard not in seen:
                seen.append(shard)
    return seen


def first_batch_shards(ds: Dataset, stream: Any, worker: int, num_workers: int) -> list[int]:
    """The shards the worker's first batch reads, in the order it reads them."""
    step = int(stream.partition.worker_steps(0, worker, num_workers)[0])
    return sorted(set(stream._reads.plan(ds.order(stream.epoch), step, 0).shards.tolist()))


def is_subsequence(part: list[int], whole: list[int]) -> bool:
    it = iter(whole)
    return all(x in it for x in part)


@pytest.mark.parametrize("num_workers", [1, 2])
@pytest.mark.parametrize(("block_size", "window"), [(None, 1), (4, 2)])
def test_each_worker_prefetches_its_next_shards_in_order(
    remote: Path, tmp_path: Path, num_workers: int, block_size: int | None, window: int
) -> None:
    ds = fastload.open_dataset(
        remote,
        cache_dir=tmp_path / "cache",
        block_size=block_size,
        window=window,
        prefetch_shards=2,
        seed=11,
        fields=("__key__", "cls"),
    )
    index = {key: shard for shard, key in enumerate(ds.shard_keys)}
    stream = BatchStream(ds, 10, epoch=3, rank=0, world_size=1, io_threads=0)
    for worker in range(num_workers):
        requests: list[list[str]] = []
        ds.store.prefetch = requests.append  # type: ignore[method-assign]
        batches = list(stream.generate(worker=worker, num_workers=num_workers))
        assert batches
        requested = [index[k] for keys in requests for k in keys if k in index]
        for keys in requests:  # each shard's index is asked for just before the shard
            assert [k for k in keys if k.endswith(".idx")] == [
                f"{k}.idx" for k in keys if k in index
            ]
        expected = first_read_order(ds, stream, worker, num_workers)
        # Shards in the order the worker's batches first read them, each at most once; the
        # shard each batch's reads start with is read at once, not prefetched, the first
        # batch's others are (its reads walk them one after the other).
        assert len(requested) == len(set(requested))
        assert is_subsequence(requested, expected)
        assert requested
        first = first_batch_shards(ds, stream, worker, num_workers)
        assert len(first) > 1 or block_size is None  # block shuffle: a batch spans shards
        assert first[0] not in requested
        assert requested[: len(first) - 1] == first[1:]
        if block_size is None and window == 1:
            # The streaming shuffle with shard-sized batches: one shard per batch, in the
            # epoch's shard order; every shard after the first batch's is prefetched.
            assert requested == expected[1:]
            assert expected == [
                s
                for s in ds.order(3).indices(range(0, 150, 10)).tolist()[worker::num_workers]
                for s in [s // 10]
            ]


def test_prefetch_can_be_turned_off(remote: Path, tmp_path: Path) -> None:
    ds = fastload.open_dataset(remote, cache_dir=tmp_path / "cache", prefetch_shards=0)
    requests: list[list[str]] = []
    ds.store.prefetch = requests.append  # type: ignore[method-assign]
    list(BatchStream(ds, 10, rank=0, world_size=1, io_threads=0).generate())
    assert requests == []
    with pytest.raises(InvalidArgumentError, match="prefetch_shards"):
        fastload.open_dataset(remote, prefetch_shards=-1)


def test_cache_options_and_stores(remote: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="open_dataset itself"):
        fastload.open_dataset(remote, store_options={"cache_dir": str(tmp_path)})
    ds = fastload.open_dataset(LocalStore(remote), cache_dir=tmp_path / "c", cache_size="1MB")
    assert isinstance(ds.store, CachingStore)
    assert ds.store.inner.url == LocalStore(remote).url
    assert ds[0]["__key__"] == "c000/img0000000"
    plain = fastload.open_dataset(remote)
    assert isinstance(plain.store, LocalStore)
