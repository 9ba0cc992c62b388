"""Shared fixtures: the local Ceph cluster's S3 endpoint (``ceph_s3``) and a fresh bucket per test.

The cluster is reused when one answers (``tools/ceph-up.sh`` run by hand or by another test
session) and otherwise started once per session; it is stopped at the end only if this session
started it and no other session still uses it (see :mod:`fastload.testing.ceph`). Without the Ceph
programs the tests that use these fixtures skip with the command to fix it, and fail under
``CI=true``.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from fastload.formats._cache import CacheConfig
from fastload.formats._cache import config as cache_settings
from fastload.formats._cache import set_config as set_cache_config
from fastload.testing import need
from fastload.testing.ceph import CephS3, CephStartError, acquire, release

_bucket_numbers = itertools.count()


@pytest.fixture(autouse=True, scope="session")
def _index_files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Parsed index files and trust records (``fastload/formats/_cache``) go to this session's
    temporary directory, never to the user's cache: set in the environment (the settings' source
    in this process and in any process it starts) before any worker forks."""
    before = os.environ.get("FASTLOAD_INDEX_DIR")
    os.environ["FASTLOAD_INDEX_DIR"] = str(tmp_path_factory.mktemp("index-files"))
    set_cache_config(None)  # read the environment again at the next use
    yield
    if before is None:
        os.environ.pop("FASTLOAD_INDEX_DIR", None)
    else:
        os.environ["FASTLOAD_INDEX_DIR"] = before
    set_cache_config(None)


@pytest.fixture
def cache_config() -> Iterator[Callable[..., CacheConfig]]:
    """A function that changes this process's machine-cache settings (fields of
    :class:`~fastload.formats._cache.CacheConfig`) for the test; the settings before come back
    after it. Forked workers inherit them."""
    before = cache_settings()

    def change(**changes: Any) -> CacheConfig:
        new = dataclasses.replace(cache_settings(), **changes)
        set_cache_config(new)
        return new

    yield change
    set_cache_config(before)


@pytest.fixture(scope="session")
def ceph_s3() -> Iterator[CephS3]:
    """The S3 endpoint and credentials of the local Ceph cluster (started or reused)."""
    try:
        cluster = acquire()
    except CephStartError as exc:
        need("Ceph cluster", False, str(exc))  # the message says how to fix it
        raise  # unreachable: need() skips or fails
    try:
        yield cluster
    finally:
        release(cluster)


@pytest.fixture(scope="session")
def s3_client(ceph_s3: CephS3) -> Any:
    """A boto3 client for the cluster, for checking what the store did behind its back."""
    return ceph_s3.client()


@pytest.fixture
def s3_bucket(ceph_s3: CephS3, s3_client: Any) -> Iterator[str]:
    """A new, empty bucket for one test; its objects and uploads are deleted afterwards."""
    name = f"fl-{os.getpid()}-{next(_bucket_numbers)}"
    s3_client.create_bucket(Bucket=name)
    yield name
    for upload in s3_client.list_multipart_uploads(Bucket=name).get("Uploads", ()):
        s3_client.abort_multipart_upload(
            Bucket=name, Key=upload["Key"], UploadId=upload["UploadId"]
        )
    for page in s3_client.get_paginator("list_objects_v2").paginate(Bucket=name):
        keys = [{"Key": obj["Key"]} for obj in page.get("Contents", ())]
        if keys:
            s3_client.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
    s3_client.delete_bucket(Bucket=name)
