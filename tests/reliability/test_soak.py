"""Soak: epochs from the local Ceph RGW through a disk cache smaller than the dataset, 2 workers.

Every epoch must deliver every sample exactly once, evict from the cache (it holds about a third of
the dataset), and leave nothing behind: after a warm-up epoch the loader's open file descriptors,
its ``/dev/shm`` entries, temporary files (the temp dir and the cache's) and cache lock files are
the same count every epoch, no evicted shard stays mapped after its epoch, and the private memory
(RssAnon) of the process tree and the main process's RSS stay within a bound. CI runs a shortened soak (5 epochs of a 3 MB corpus, seconds);
``python -m benchmarks.bench_soak`` runs the full one (20 epochs) and prints the per-epoch table.
The soak loop and its sampling of ``/proc`` are the benchmark's (:mod:`benchmarks.bench_soak`),
so the two measure the same things.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

import fastload
from benchmarks.bench_soak import SoakCollate, growth_kb, key_of, soak, table, write_corpus
from fastload.storage import CachingStore
from fastload.testing.ceph import CephS3

pytestmark = [pytest.mark.ceph, pytest.mark.timeout(120)]

EPOCHS = 5
SHARDS, PER_SHARD, PAYLOAD = 12, 16, 16384  # 192 samples, ~3.2 MB with headers and indexes
BATCH = 16  # 256 KiB of payload per batch: collated into the workers' reusable shm blocks
CACHE_BYTES = 1_100_000  # about a third of the dataset
RSS_GROWTH_KB = 20 * 1024  # RssAnon (tree) and RSS (main) growth allowed, epochs 1-2 to 3-4


@pytest.fixture
def soak_url(ceph_s3: CephS3, s3_bucket: str) -> str:
    url = f"s3://{s3_bucket}/soak"
    write_corpus(url, ceph_s3.store_options(), SHARDS, PER_SHARD, PAYLOAD)
    return url


@pytest.mark.parametrize("persistent", [False, True])
def test_soak_from_rgw_through_a_small_cache_leaves_nothing_behind(
    ceph_s3: CephS3,
    soak_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    persistent: bool,
) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # the workers fork with it
    cache = tmp_path / "cache"
    ds = fastload.open_dataset(
        soak_url,
        cache_dir=cache,
        cache_size=CACHE_BYTES,
        seed=3,
        block_size=None,  # the streaming shuffle, for a cache smaller than the dataset
        window=2,
        prefetch_shards=1,
        fields=("__key__", "cls", "bin"),
        store_options=ceph_s3.store_options(),
    )
    assert isinstance(ds.store, CachingStore)
    loader = fastload.DataLoader(
        ds, batch_size=BATCH, num_workers=2, collate_fn=SoakCollate(), persistent_workers=persistent
    )
    keys = [key_of(s, p) for s in range(SHARDS) for p in range(PER_SHARD)]
    samples = list(soak(loader, cache, temp, EPOCHS, keys, PAYLOAD))
    shown = table(samples)
    first, final = samples[1], samples[-1]  # epoch 0 warms up (first fills, imports, pools)
    assert final.fds_main == first.fds_main, shown
    # Worker fds move with the work in flight (S3 connections, fills, readers; each open shard
    # reader holds its mapping's fd, up to max_open_shards per thread): bounded, not equal.
    assert final.fds_workers <= first.fds_workers + 8, shown
    assert final.shm == first.shm == 0, shown
    # Temp files: none, but each live worker's multiprocessing fd-passing socket (pymp-*), made
    # here unless an earlier test of this process already made the process's pymp directory.
    assert final.temp == first.temp <= (2 if persistent else 0), shown
    assert all(s.held == 0 for s in samples), shown  # no evicted shard kept on disk by a reader
    assert final.locks == first.locks, shown
    assert final.locks <= 2 * SHARDS + 1, shown  # one per object (shard, index) + evict.lock
    assert growth_kb(samples, "anon_tree_kb") < RSS_GROWTH_KB, shown  # private memory
    assert growth_kb(samples, "rss_main_kb") < RSS_GROWTH_KB, shown
    assert all(s.evictions > 0 for s in samples[1:]), shown  # the cache is too small: every epoch
    assert all(s.downloaded_mb > 1.0 for s in samples[1:]), shown  # and downloads again
    assert ds.store.cached_bytes() <= CACHE_BYTES
