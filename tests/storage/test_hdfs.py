"""HDFS backend, against a real HDFS: Hadoop's own MiniDFSCluster (1 NameNode, 2 DataNodes,
1 MiB blocks, replication 2) that ``tools/hdfs-up.sh`` starts on 127.0.0.1, or reuses, through the
``hdfs_cluster`` fixture (fails under ``CI=true`` when it cannot start). The whole conformance
suite runs against :class:`HDFSStore` and the ``hdfs-native`` client on it, plus what a cluster
adds: objects spanning blocks, the writer's temporary file, a read-only user, reads while a
DataNode is down and a NameNode that is away. Also, without a cluster: URL parsing,
configuration, pickling and the errors users get when the client library or the cluster is
missing.

``FASTLOAD_TEST_HDFS_URL=hdfs://namenode:8020/scratch/dir`` runs the conformance suite against
another cluster too (a writable scratch directory on it).
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import time
import uuid
from collections.abc import Iterator

import pytest

import fastload
from fastload.errors import (
    InvalidArgumentError,
    MissingDependencyError,
    StoreUnavailableError,
    TransientStoreError,
)
from fastload.storage import Store
from fastload.storage._hdfs import HDFSStore
from fastload.testing.hdfs import HDFSCluster, hdfs_cluster, scratch_url
from fastload.testing.store import StoreTests

__all__ = ["hdfs_cluster"]  # the fixture, imported for pytest

HDFS_URL = os.environ.get("FASTLOAD_TEST_HDFS_URL", "")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when the block ends: connections are refused


def test_open_store_picks_hdfs_and_parses_the_url() -> None:
    store = fastload.open_store("hdfs://namenode.example:8020/data/sets/", retry=False)
    assert isinstance(store, HDFSStore)
    assert store.url == "hdfs://namenode.example:8020/data/sets"
    assert store.child_url("a/b.tar") == "hdfs://namenode.example:8020/data/sets/a/b.tar"
    root = HDFSStore("hdfs://nameservice1")
    assert root.url == "hdfs://nameservice1/"
    assert root.child_url("x") == "hdfs://nameservice1/x"


@pytest.mark.parametrize(
    "bad", ["s3://bucket/x", "hdfs:///no-host", "hdfs://user:secret@nn:8020/p"]
)
def test_bad_urls_are_rejected(bad: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        HDFSStore(bad)
    assert "secret" not in str(info.value)


def test_client_failover_loop_is_bounded_by_default() -> None:
    store = HDFSStore("hdfs://nn:8020/x")
    assert store._config["dfs.client.failover.max.attempts"] == "0"
    custom = HDFSStore("hdfs://nn:8020/x", config={"dfs.client.failover.max.attempts": "7"})
    assert custom._config["dfs.client.failover.max.attempts"] == "7"


def test_pickles_without_a_client() -> None:
    store = HDFSStore("hdfs://nn:8020/x", read_only=True)
    clone = pickle.loads(pickle.dumps(store))
    assert clone.url == store.url
    assert clone.supports_writes is False
    assert clone._clients.peek() is None


def test_unreachable_cluster_fails_fast_and_names_the_url() -> None:
    port = closed_port()
    store = HDFSStore(f"hdfs://127.0.0.1:{port}/data")
    start = time.monotonic()
    with pytest.raises(TransientStoreError) as info:
        store.head("shard-000000.tar")
    assert time.monotonic() - start < 10
    assert f"hdfs://127.0.0.1:{port}/data/shard-000000.tar" in str(info.value)
    assert "is up and reachable" in str(info.value)


def test_unreachable_cluster_behind_retries_gives_up_with_a_clear_error() -> None:
    from fastload.storage import RetryConfig, RetryStore

    port = closed_port()
    store = RetryStore(
        HDFSStore(f"hdfs://127.0.0.1:{port}/data"),
        RetryConfig(max_retries=2, initial_backoff=0.01, max_backoff=0.02),
    )
    with pytest.raises(StoreUnavailableError, match=f"127.0.0.1:{port}"):
        store.get("x")


def test_missing_client_library_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "hdfs_native", None)  # makes `import hdfs_native` fail
    with pytest.raises(MissingDependencyError, match=r"pip install 'fastload\[hdfs\]'"):
        fastload.open_store("hdfs://nn:8020/x")
    with pytest.raises(MissingDependencyError, match="hdfs_native"):
        HDFSStore("hdfs://nn:8020/x").get("k")


class TestHDFSConformance(StoreTests):
    """The whole suite against the local MiniDFSCluster (objects of 3 MiB span four blocks)."""

    @pytest.fixture
    def store(self, hdfs_cluster: HDFSCluster) -> Iterator[Store]:
        store = HDFSStore(scratch_url(hdfs_cluster, "conformance"))
        yield store
        store.delete_many(store.list_keys())

    def read_only_view(self, store: Store) -> Store:
        return HDFSStore(store.url, read_only=True)


if HDFS_URL:  # another cluster: the same suite

    class TestOtherHDFSConformance(StoreTests):
        """The cluster named by ``FASTLOAD_TEST_HDFS_URL``."""

        large_size = 1024 * 1024 + 7
        many_keys = 60

        @pytest.fixture
        def store(self) -> Iterator[Store]:
            store = HDFSStore(f"{HDFS_URL.rstrip('/')}/{uuid.uuid4().hex}")
            yield store
            store.delete_many(store.list_keys())

        def read_only_view(self, store: Store) -> Store:
            return HDFSStore(store.url, read_only=True)
