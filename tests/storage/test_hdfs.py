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
    ObjectNotFoundError,
    StoreAuthError,
    StoreError,
    StorePermissionError,
    StoreUnavailableError,
    TransientStoreError,
)
from fastload.storage import ByteRange, Store
from fastload.storage._hdfs import HDFSStore
from fastload.storage._local_temp import TMP_PREFIX
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


# ---- what a real cluster adds ------------------------------------------------------------------


def test_objects_span_blocks_and_are_replicated(hdfs_cluster: HDFSCluster) -> None:
    import hdfs_native

    store = HDFSStore(scratch_url(hdfs_cluster, "blocks"))
    data = os.urandom(3 * 1024 * 1024 + 7)  # four 1 MiB blocks
    store.put("big.bin", data)
    status = hdfs_native.Client(hdfs_cluster.url).get_file_info(store._path("big.bin"))
    assert (status.length, status.blocksize, status.replication) == (len(data), 1024 * 1024, 2)
    edge = 1024 * 1024
    assert store.get("big.bin", ByteRange(edge - 5, edge + 5)) == data[edge - 5 : edge + 5]
    spans = [
        ByteRange(0, 1),
        ByteRange(edge - 1, 3 * edge + 1),
        ByteRange(len(data) - 3, len(data)),
    ]
    assert store.get_ranges("big.bin", spans) == [data[r.start : r.end] for r in spans]
    store.delete("big.bin")


def test_an_open_writer_is_invisible_and_an_aborted_one_leaves_nothing(
    hdfs_cluster: HDFSCluster,
) -> None:
    import hdfs_native

    store = HDFSStore(scratch_url(hdfs_cluster, "writer"))
    client = hdfs_native.Client(hdfs_cluster.url)
    directory = store._path("d/x").rsplit("/", 1)[0]
    writer = store.open_writer("d/x")
    writer.write(b"partial" * 1000)
    assert store.list_keys() == []
    with pytest.raises(ObjectNotFoundError):
        store.head("d/x")
    names = [s.path.rsplit("/", 1)[-1] for s in client.list_status(directory)]
    assert len(names) == 1
    assert names[0].startswith(TMP_PREFIX)  # the temporary file, hidden from list and head
    writer.abort()
    assert list(client.list_status(directory)) == []
    with store.open_writer("d/x") as done:
        done.write(b"whole")
    assert store.get("d/x") == b"whole"
    assert [s.path.rsplit("/", 1)[-1] for s in client.list_status(directory)] == ["x"]


def test_a_user_without_access_gets_a_typed_error_without_the_java_stack(
    hdfs_cluster: HDFSCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hdfs_native

    url = scratch_url(hdfs_cluster, "private")
    owner = HDFSStore(url)
    owner.put("secret/x", b"1")
    hdfs_native.Client(hdfs_cluster.url).set_permission(owner._path("secret"), 0o700)
    monkeypatch.setenv("HADOOP_USER_NAME", "fastload-other-user")  # read when a client is made
    other = HDFSStore(url)
    for call in (lambda: other.get("secret/x"), lambda: other.put("secret/y", b"2")):
        with pytest.raises(StorePermissionError) as info:
            call()
        message = str(info.value)
        assert f"{url}/secret/" in message
        assert "user=fastload-other-user" in message
        assert "drwx------" in message
        assert "\tat " not in message
        assert "\\tat " not in message
        assert "HADOOP_USER_NAME" in message  # says what to check


def test_namenode_in_safe_mode_refuses_writes_as_retryable(hdfs_cluster: HDFSCluster) -> None:
    store = HDFSStore(scratch_url(hdfs_cluster, "safemode"))
    store.put("before", b"1")
    hdfs_cluster.control("safemode enter")
    try:
        with pytest.raises(TransientStoreError, match="SafeModeException") as info:
            store.put("during", b"2")
        assert store.child_url("during") in str(info.value)
        assert store.get("before") == b"1"  # reads go on
    finally:
        hdfs_cluster.control("safemode leave")
    store.put("after", b"3")
    assert store.list_keys() == ["after", "before"]


@pytest.mark.parametrize(
    ("message", "error", "fragment"),
    [
        (
            'RPCError("org.apache.hadoop.hdfs.server.namenode.SafeModeException", '
            '"Cannot create file /x. Name node is in safe mode.\\n\\tat org.apache.X(X.java:1)")',
            TransientStoreError,
            "SafeModeException: Cannot create file /x. Name node is in safe mode.",
        ),
        (
            'RPCError("org.apache.hadoop.ipc.StandbyException", "Operation category READ is '
            'not supported in state standby")',
            TransientStoreError,
            "StandbyException",
        ),
        (
            'RPCError("org.apache.hadoop.hdfs.protocol.DSQuotaExceededException", "The DiskSpace '
            'quota of /q is exceeded\\n\\tat x")',
            StoreError,
            "DSQuotaExceededException: The DiskSpace quota of /q is exceeded",
        ),
        (
            'DataTransferError("All DataNodes failed: [DatanodeInfoProto { id: DatanodeIdProto { '
            'ip_addr: \\"10.0.0.7\\", host_name: \\"dn7\\", xfer_port: 9866, info_port: 1 } }]")',
            TransientStoreError,
            "tried 10.0.0.7:9866",
        ),
        ('GSSAPIError("No Kerberos credentials available")', StoreAuthError, "klist"),
    ],
)
def test_client_errors_are_translated(message: str, error: type[StoreError], fragment: str) -> None:
    store = HDFSStore("hdfs://nn:8020/data")
    translated = store._translate(RuntimeError(message), "k")
    assert type(translated) is error
    assert fragment in str(translated)
    assert "hdfs://nn:8020/data/k" in str(translated)
    assert "\\tat" not in str(translated)
