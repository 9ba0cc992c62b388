"""DALI pipelines reading a dataset from the real Ceph RGW (S3), through fastload's local cache."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fastload.dali import DALILoader, ImageAugment
from fastload.storage import open_store

pytestmark = [pytest.mark.timeout(300)]
SIZES = [9, 7]


def test_external_and_native_from_ceph_rgw(
    kit: SimpleNamespace, ceph_s3: Any, s3_bucket: str, tmp_path: Path
) -> None:
    options = ceph_s3.store_options()
    url = f"s3://{s3_bucket}/ds"
    n = kit.write_dataset(open_store(url, **options), "webdataset", SIZES)
    common: dict[str, Any] = {
        "device": "cpu",
        "augment": ImageAugment(size=16),
        "store_options": options,
        "num_threads": 1,
        "py_workers": 1,
    }
    # straight from S3 (ranged reads through the index), two ranks
    labels = []
    for rank in range(2):
        loader = DALILoader(url, 4, rank=rank, world_size=2, io_threads=2, **common)
        labels += [x for _, y in loader for x in y.tolist()]
        assert loader.stats()["bytes"] > 0
    assert sorted(labels) == list(range(n))
    # through the local cache, then DALI's native reader on the cached files
    cache = tmp_path / "cache"
    cached = DALILoader(url, 4, cache_dir=cache, shuffle=False, **common)
    assert [x for _, y in cached for x in y.tolist()] == list(range(n))
    native = DALILoader(url, 4, cache_dir=cache, reader="native", shuffle=False, **common)
    assert [x for _, y in native for x in y.tolist()] == list(range(n))
    assert any(cache.rglob("*")), "the cache holds the shards"
