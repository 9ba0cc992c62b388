"""S3Store against the real Ceph RGW started by tools/ceph-up.sh (fixtures in tests/conftest.py)."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import socket
import threading
import time
import traceback
from typing import Any
from urllib.parse import urlsplit

import pytest
from botocore.exceptions import ResponseStreamingError

from fastload.errors import (
    InvalidArgumentError,
    InvalidRangeError,
    ObjectNotFoundError,
    StoreAuthError,
    StoreError,
    StoreUnavailableError,
    TransientStoreError,
)
from fastload.storage import ByteRange, RetryConfig, RetryStore, Store, open_store
from fastload.storage._s3 import MIN_PART_SIZE, S3Config, S3Store
from fastload.testing import need
from fastload.testing.ceph import CephS3, is_sole_user, start_rgw, stop_rgw
from fastload.testing.store import StoreTests

SECRET = "not-the-real-secret-0123456789abcdef"


def _store(ceph: CephS3, bucket: str, prefix: str = "", **options: Any) -> S3Store:
    return S3Store(bucket, prefix, **{**ceph.store_options(), **options})


def _blob(n: int, seed: int = 1) -> bytes:
    return (bytes(range(256)) * (n // 256 + 1))[seed % 256 : seed % 256 + n]


# ---- no server needed -----------------------------------------------------------------------------


def test_url_parsing_and_options() -> None:
    store = S3Store.from_url("s3://bkt/some/prefix/")
    assert isinstance(store, S3Store)
    assert (store.bucket, store.prefix, store.url) == ("bkt", "some/prefix", "s3://bkt/some/prefix")
    assert store.child_url("a/b") == "s3://bkt/some/prefix/a/b"
    assert S3Store.from_url("s3://bkt").url == "s3://bkt"
    with pytest.raises(InvalidArgumentError, match="accepted"):
        S3Store.from_url("s3://bkt", no_such_option=1)
    with pytest.raises(InvalidArgumentError, match="credentials") as info:
        S3Store.from_url(f"s3://key:{SECRET}@bkt/x")
    assert SECRET not in str(info.value)
    redacted = S3Store("bkt", endpoint_url=f"http://user:{SECRET}@127.0.0.1:1")
    assert SECRET not in repr(redacted)
    assert "127.0.0.1:1" in repr(redacted)
    with pytest.raises(InvalidArgumentError, match="5242880"):
        S3Config(part_size=1024)
    with pytest.raises(InvalidArgumentError, match="both"):
        S3Config(access_key_id="AK")


def test_open_store_wraps_in_retry_store() -> None:
    store = open_store("s3://bkt/p", endpoint_url="http://127.0.0.1:1")
    assert isinstance(store, RetryStore)
    assert isinstance(store.inner, S3Store)
    assert store.url == "s3://bkt/p"
    custom = open_store("s3://bkt/p", retry=RetryConfig(max_retries=2))
    assert isinstance(custom, RetryStore)
    assert custom.config.max_retries == 2
    assert isinstance(open_store("s3://bkt/p", retry=False), S3Store)


def test_credentials_never_in_repr_but_survive_pickle() -> None:
    store = S3Store("bkt", access_key_id="AKEXAMPLE", secret_access_key=SECRET, session_token="TOK")
    for text in (repr(store), str(store), repr(store.config), repr(RetryStore(store))):
        assert SECRET not in text
        assert "TOK" not in text
    clone = pickle.loads(pickle.dumps(store))
    assert clone.config.secret_access_key == SECRET
    assert clone.url == store.url


def test_connection_refused_is_transient_and_names_endpoint() -> None:
    store = S3Store(
        "bkt", endpoint_url="http://127.0.0.1:1", access_key_id="A", secret_access_key=SECRET
    )
    with pytest.raises(TransientStoreError) as info:
        store.get("k")
    assert "http://127.0.0.1:1" in str(info.value)
    assert "s3://bkt/k" in str(info.value)
    assert info.value.retryable
    assert SECRET not in "".join(traceback.format_exception(info.value))
    retried = RetryStore(store, RetryConfig(max_retries=2, initial_backoff=0.01))
    with pytest.raises(StoreUnavailableError, match="s3://bkt/k"):
        retried.get("k")


def _closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def no_endpoint_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No endpoint or config file from the developer's shell (eval "$(tools/ceph-up.sh)")."""
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_refused_endpoint_fails_fast_naming_it(no_endpoint_env: None) -> None:
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    store = open_store(
        "s3://bkt/ds", endpoint_url=endpoint, access_key_id="A", secret_access_key=SECRET
    )
    began = time.monotonic()
    with pytest.raises(StoreUnavailableError) as info:
        store.get("fastload.json")
    assert time.monotonic() - began < 10  # was 10 retries with backoff up to 15 s each
    message = str(info.value)
    assert message.startswith("get s3://bkt/ds/fastload.json failed: no connection to the server")
    assert f"connection refused by {endpoint}" in message
    assert "gave up after 3 attempts" in message
    assert "--endpoint-url" in message  # what a CLI user can change
    assert SECRET not in "".join(traceback.format_exception(info.value))


def test_unresolvable_endpoint_fails_after_one_retry(no_endpoint_env: None) -> None:
    endpoint = "http://nonexistent.invalid:80"  # .invalid never resolves (RFC 6761)
    store = open_store(
        "s3://bkt/ds", endpoint_url=endpoint, access_key_id="A", secret_access_key=SECRET
    )
    began = time.monotonic()
    with pytest.raises(StoreUnavailableError) as info:
        store.head("fastload.json")
    assert time.monotonic() - began < 10
    message = str(info.value)
    assert "the server's host name does not resolve" in message
    assert f"the host name of {endpoint} does not resolve" in message
    assert "gave up after 2 attempts" in message
    assert "check the host name of the endpoint" in message


def test_endpoint_from_the_environment_as_boto3_reads_it(
    no_endpoint_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    generic, specific, explicit = (f"http://127.0.0.1:{_closed_port()}" for _ in range(3))

    def refused_by(**options: Any) -> str:
        store = S3Store("bkt", access_key_id="A", secret_access_key=SECRET, **options)
        with pytest.raises(TransientStoreError) as info:
            store.head("k")
        assert store._client().meta.endpoint_url == store._endpoint()
        return str(info.value)

    monkeypatch.setenv("AWS_ENDPOINT_URL", generic)
    assert f"connection refused by {generic};" in refused_by()
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", specific)  # the S3-specific one wins
    assert f"connection refused by {specific};" in refused_by()
    assert f"connection refused by {explicit};" in refused_by(endpoint_url=explicit)
    assert S3Store("bkt")._client().meta.config.s3["addressing_style"] == "path"


def test_without_any_endpoint_messages_say_aws(no_endpoint_env: None) -> None:
    store = S3Store("bkt", access_key_id="A", secret_access_key=SECRET, region="us-east-1")
    assert store._endpoint() == "AWS S3"
    store._client()  # creating the client sends nothing
    assert store._endpoint() == "AWS S3 (https://s3.amazonaws.com)"


@pytest.mark.parametrize(
    "endpoint",
    ["127.0.0.1:7480", "ftp://127.0.0.1", "http://", "http://127.0.0.1:port", 7480],
)
def test_invalid_endpoint_is_refused_up_front(endpoint: object) -> None:
    with pytest.raises(InvalidArgumentError, match=r"http:// or https:// URL .* got "):
        S3Store("bkt", endpoint_url=endpoint)
    with pytest.raises(InvalidArgumentError) as info:
        S3Store("bkt", endpoint_url=f"http://user:{SECRET}@host:port")
    assert SECRET not in str(info.value)


def test_invalid_endpoint_in_the_environment_is_named(
    no_endpoint_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "not a url")
    store = open_store("s3://bkt", access_key_id="A", secret_access_key=SECRET)
    with pytest.raises(InvalidArgumentError, match="check AWS_ENDPOINT_URL=not a url"):
        store.get("k")


# ---- against the Ceph RGW ---------------------------------------------------------------------------


@pytest.mark.ceph
class TestS3StoreConformance(StoreTests):
    """The bare S3Store under a prefix of a fresh bucket; small list pages exercise pagination.

    RGW 16 sometimes answers a GET or PUT that races an overwrite of the same key with HTTP 500
    (ECANCELED in its log); the store rightly raises TransientStoreError. Users get RetryStore
    (the next class); the bare store here lets botocore retry such answers instead.
    """

    @pytest.fixture
    def store(self, ceph_s3: CephS3, s3_bucket: str) -> S3Store:
        return _store(
            ceph_s3, s3_bucket, "conformance/root", list_page_size=100, botocore_max_attempts=3
        )

    def read_only_view(self, store: Store) -> Store | None:
        assert isinstance(store, S3Store)
        return S3Store(store.bucket, store.prefix, store.config, read_only=True)


@pytest.mark.ceph
class TestOpenStoreS3Conformance(StoreTests):
    """What users get from open_store("s3://..."): the S3Store inside a RetryStore."""

    @pytest.fixture
    def store(self, ceph_s3: CephS3, s3_bucket: str) -> Store:
        return open_store(f"s3://{s3_bucket}", **ceph_s3.store_options())

    def read_only_view(self, store: Store) -> Store | None:
        assert isinstance(store, RetryStore)
        return open_store(store.url, **{**store.inner.config.__dict__, "read_only": True})


@pytest.mark.ceph
def test_round_trip_head_list_delete(ceph_s3: CephS3, s3_bucket: str) -> None:
    store = _store(ceph_s3, s3_bucket, "ds")
    store.put("a/one.bin", b"hello")
    store.put("a/two.bin", bytearray(b"world!"))
    store.put("b.bin", memoryview(b"xyz"))
    store.put("empty", b"")
    assert store.get("a/one.bin") == b"hello"
    assert store.get("empty") == b""
    meta = store.head("a/two.bin")
    assert (meta.key, meta.size) == ("a/two.bin", 6)
    assert meta.etag
    assert meta.mtime is not None
    assert meta.mtime > 1.6e9
    assert store.list_keys() == ["a/one.bin", "a/two.bin", "b.bin", "empty"]
    assert store.list_keys("a/") == ["a/one.bin", "a/two.bin"]
    assert [m.size for m in store.list("a/")] == [5, 6]
    store.delete("a/one.bin")
    assert not store.exists("a/one.bin")
    with pytest.raises(ObjectNotFoundError, match=r"s3://.*/ds/a/one\.bin"):
        store.delete("a/one.bin")
    # the prefix is a directory of the bucket: the object lives under ds/
    assert store.get("b.bin") == _store(ceph_s3, s3_bucket).get("ds/b.bin")


@pytest.mark.ceph
def test_ranged_reads(ceph_s3: CephS3, s3_bucket: str) -> None:
    store = _store(ceph_s3, s3_bucket)
    data = _blob(1000)
    store.put("obj", data)
    for start, end in [(0, 1), (0, 1000), (10, 20), (999, 1000), (500, 1000)]:
        assert store.get("obj", ByteRange(start, end)) == data[start:end]
    assert store.get("obj", ByteRange(1000, 1000)) == b""
    assert store.get("obj", ByteRange(7, 7)) == b""
    for bad in [
        ByteRange(990, 1001),
        ByteRange(1000, 1001),
        ByteRange(5000, 6000),
        ByteRange(1001, 1001),
    ]:
        with pytest.raises(InvalidRangeError, match="1000 bytes"):
            store.get("obj", bad)
    with pytest.raises(ObjectNotFoundError):
        store.get("missing", ByteRange(0, 0))
    assert store.get_ranges("obj", [ByteRange(5, 9), ByteRange(0, 3), ByteRange(900, 1000)]) == [
        data[5:9],
        data[0:3],
        data[900:1000],
    ]


@pytest.mark.ceph
def test_parallel_get_whole_and_range(
    ceph_s3: CephS3, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    part = 256 * 1024
    store = _store(
        ceph_s3,
        s3_bucket,
        parallel_get_part_size=part,
        parallel_get_threshold=part,
        parallel_get_threads=4,
    )
    data = _blob(5 * part + 123, seed=7)
    store.put("big", data)
    calls: list[tuple[int, int | None]] = []
    original = S3Store._get_object

    def spy(
        self: S3Store, key: str, full: str, start: int, end: int | None, etag: str | None = None
    ) -> Any:
        calls.append((start, end))
        return original(self, key, full, start, end, etag)

    monkeypatch.setattr(S3Store, "_get_object", spy)
    assert store.get("big") == data
    assert sorted(calls) == [(i * part, min((i + 1) * part, len(data))) for i in range(6)]
    calls.clear()
    assert store.get("big", ByteRange(100, 3 * part + 5)) == data[100 : 3 * part + 5]
    assert len(calls) == 3  # 3 * part - 95 bytes in part-sized GETs
    with pytest.raises(InvalidRangeError, match=str(len(data))):
        store.get("big", ByteRange(part, len(data) + 1))


@pytest.mark.ceph
def test_multipart_writer_invisible_until_commit(
    ceph_s3: CephS3, s3_bucket: str, s3_client: Any
) -> None:
    store = _store(ceph_s3, s3_bucket, part_size=MIN_PART_SIZE, upload_concurrency=2)
    data = _blob(2 * MIN_PART_SIZE + 4321, seed=3)
    writer = store.open_writer("dir/mp.bin")
    for i in range(0, len(data), 777_777):
        writer.write(data[i : i + 777_777])
    assert writer.tell() == len(data)
    uploads = s3_client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
    assert [u["Key"] for u in uploads] == ["dir/mp.bin"]
    assert not store.exists("dir/mp.bin")
    writer.commit()
    assert store.get("dir/mp.bin") == data
    assert store.head("dir/mp.bin").size == len(data)
    assert s3_client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    etag = s3_client.head_object(Bucket=s3_bucket, Key="dir/mp.bin")["ETag"]
    assert etag.strip('"').endswith("-3")  # a multipart object's ETag ends with -<parts>


@pytest.mark.ceph
def test_aborted_writer_leaves_nothing(ceph_s3: CephS3, s3_bucket: str, s3_client: Any) -> None:
    store = _store(ceph_s3, s3_bucket, part_size=MIN_PART_SIZE)
    store.put("keep", b"old")

    def failing_write() -> None:
        with store.open_writer("keep") as writer:
            writer.write(_blob(2 * MIN_PART_SIZE + 1))
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        failing_write()
    assert store.get("keep") == b"old"
    assert s3_client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    writer = store.open_writer("never")
    writer.write(b"small")
    writer.abort()
    assert not store.exists("never")
    assert store.list_keys() == ["keep"]


@pytest.mark.ceph
def test_small_writer_and_large_put(ceph_s3: CephS3, s3_bucket: str, s3_client: Any) -> None:
    store = _store(ceph_s3, s3_bucket, part_size=MIN_PART_SIZE, multipart_threshold=MIN_PART_SIZE)
    with store.open_writer("small") as writer:
        writer.write(b"abc")
        writer.write(b"def")
        assert s3_client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    assert store.get("small") == b"abcdef"
    with store.open_writer("empty"):
        pass
    assert store.get("empty") == b""
    data = _blob(MIN_PART_SIZE + 10, seed=9)
    store.put("large", data)  # above multipart_threshold: uploaded as parts
    assert store.get("large") == data
    assert s3_client.head_object(Bucket=s3_bucket, Key="large")["ETag"].strip('"').endswith("-2")
    assert s3_client.head_object(Bucket=s3_bucket, Key="small")["ETag"].count("-") == 0


@pytest.mark.ceph
def test_listing_pages_order_and_markers(ceph_s3: CephS3, s3_bucket: str, s3_client: Any) -> None:
    store = _store(ceph_s3, s3_bucket, "root", list_page_size=2)
    keys = ["a", "a/b", "a~", "b/c/d", "z", "é", "\uf8ffx", "😀", "a-1"]
    for key in keys:
        store.put(key, key.encode())
    s3_client.put_object(Bucket=s3_bucket, Key="root/dir/", Body=b"")  # a console's folder marker
    s3_client.put_object(Bucket=s3_bucket, Key="rootless", Body=b"")  # outside the prefix
    expected = sorted(keys, key=lambda k: k.encode())
    assert store.list_keys() == expected == sorted(keys)
    assert store.list_keys("a") == ["a", "a-1", "a/b", "a~"]
    assert store.list_keys("nothing") == []
    calls = []
    client = store._client()
    original = client.list_objects_v2

    def counting(**kwargs: Any) -> Any:
        calls.append(kwargs)
        return original(**kwargs)

    client.list_objects_v2 = counting
    assert len(store.list_keys()) == len(keys)
    assert len(calls) == 5
    assert all(c["MaxKeys"] == 2 for c in calls)


@pytest.mark.ceph
def test_missing_key_and_bucket(ceph_s3: CephS3, s3_bucket: str) -> None:
    store = _store(ceph_s3, s3_bucket, "p")
    for call in (
        lambda: store.get("nope"),
        lambda: store.head("nope"),
        lambda: store.delete("nope"),
    ):
        with pytest.raises(ObjectNotFoundError, match=f"s3://{s3_bucket}/p/nope"):
            call()
    with pytest.raises(ObjectNotFoundError, match="nope"):
        store.open_reader("nope")
    with pytest.raises(ObjectNotFoundError) as missing:
        store.head("nope")  # a bare 404: the code botocore gives is the status
    assert str(missing.value) == f"no object s3://{s3_bucket}/p/nope (HTTP 404)"
    gone = _store(ceph_s3, f"{s3_bucket}-missing")
    with pytest.raises(ObjectNotFoundError, match=r"bucket .* does not exist"):
        gone.get("k")
    with pytest.raises(ObjectNotFoundError, match=r"bucket .* does not exist"):
        gone.put("k", b"x")
    with pytest.raises(ObjectNotFoundError, match=r"bucket .* does not exist"):
        list(gone.list())
    with pytest.raises(ObjectNotFoundError) as info:
        gone.head("k")  # HEAD answers a bare 404; the store checks the bucket to say which
    assert "does not exist" in "".join(traceback.format_exception(info.value))


@pytest.mark.ceph
def test_wrong_credentials_fail_at_once(ceph_s3: CephS3, s3_bucket: str) -> None:
    cases = [
        {"secret_access_key": SECRET},
        {"access_key_id": "NOSUCHKEY0000000", "secret_access_key": SECRET},
    ]
    for override in cases:
        store = open_store(f"s3://{s3_bucket}/x", **{**ceph_s3.store_options(), **override})
        assert isinstance(store, RetryStore)
        for call in (store.get, store.head, lambda k, s=store: list(s.list(k))):
            with pytest.raises(StoreAuthError) as info:  # raised as is: RetryStore does not retry
                call("k")
            text = "".join(traceback.format_exception(info.value)) + repr(store)
            assert SECRET not in text
            assert "credentials" in str(info.value)
            assert f"s3://{s3_bucket}/x" in str(info.value)
            assert isinstance(info.value, PermissionError)


def _breaking_bodies(store: S3Store, every: int) -> list[str]:
    """Make every GET body of ``store``'s client break after ``every`` bytes (as a dropped
    connection does); return the list the Range header of each GET is appended to."""
    client = store._client()
    original = client.get_object
    ranges: list[str] = []

    def get_object(**kwargs: Any) -> Any:
        ranges.append(kwargs.get("Range", "bytes=0-"))
        resp = original(**kwargs)
        body, budget = resp["Body"], [every]

        class Breaking:
            def read(self, n: int) -> bytes:
                if budget[0] <= 0:
                    raise ResponseStreamingError(error="simulated IncompleteRead")
                chunk = body.read(min(n, budget[0]))
                budget[0] -= len(chunk)
                return bytes(chunk)

            def close(self) -> None:
                body.close()

        resp["Body"] = Breaking()
        return resp

    client.get_object = get_object
    return ranges


@pytest.mark.ceph
def test_bare_streaming_reader_does_not_resume_by_itself(ceph_s3: CephS3, s3_bucket: str) -> None:
    store = _store(ceph_s3, s3_bucket)
    data = _blob(3 * 1024 * 1024 + 17, seed=5)
    store.put("stream", data)
    ranges = _breaking_bodies(store, 700_000)
    with (
        store.open_reader("stream", chunk_size=64 * 1024) as reader,
        pytest.raises(TransientStoreError, match="stream"),
    ):
        reader.read()
    assert ranges == ["bytes=0-"]  # one GET: resuming is RetryStore's job, not the backend's


@pytest.mark.ceph
def test_streaming_reader_resumes_after_broken_stream(ceph_s3: CephS3, s3_bucket: str) -> None:
    """What open_store gives: RetryStore resumes each break once, where it broke."""
    bare = _store(ceph_s3, s3_bucket)
    data = _blob(3 * 1024 * 1024 + 17, seed=5)
    bare.put("stream", data)
    sleeps: list[float] = []
    store = RetryStore(bare, sleep=sleeps.append)
    ranges = _breaking_bodies(bare, 700_000)
    reader = store.open_reader("stream", chunk_size=64 * 1024)
    got = reader.read()
    assert got == data
    breaks = len(data) // 700_000
    assert len(sleeps) == breaks  # each break retried once, by the one retry layer
    # Each resumed stream starts where reading had got to: later than the one before, and
    # within one stream's worth of it (bytes buffered by the broken reader are read again).
    starts = [int(r.removeprefix("bytes=").partition("-")[0]) for r in ranges]
    resumed = [s for s in starts if s]
    assert len(resumed) == breaks
    for before, after in zip([0, *resumed], resumed):
        assert before < after <= before + 700_000
    reader.seek(1000)
    assert reader.read(10) == data[1000:1010]
    reader.close()


@pytest.mark.ceph
def test_streaming_reader_detects_replacement(ceph_s3: CephS3, s3_bucket: str) -> None:
    store = _store(ceph_s3, s3_bucket)
    data = _blob(2 * 1024 * 1024)
    store.put("obj", data)
    with store.open_reader("obj") as reader:
        assert reader.read(10) == data[:10]
        store.put("obj", b"replaced")
        reader.seek(1_500_000)  # forces a new request, pinned to the old ETag
        with pytest.raises(StoreError, match="changed while"):
            reader.read(10)


@pytest.mark.ceph
def test_resumed_stream_detects_replacement_between_break_and_resume(
    ceph_s3: CephS3, s3_bucket: str
) -> None:
    """RetryStore reopens a broken stream: an object replaced meanwhile raises, never mixes."""
    bare = _store(ceph_s3, s3_bucket)
    data = _blob(2 * 1024 * 1024, seed=7)
    bare.put("swapped", data)
    replacement = _blob(2 * 1024 * 1024, seed=8)  # same size: only the version tells them apart
    store = RetryStore(bare, sleep=lambda _s: bare.put("swapped", replacement))
    _breaking_bodies(bare, 700_000)
    with store.open_reader("swapped", chunk_size=64 * 1024) as reader:
        assert reader.read(1000) == data[:1000]
        with pytest.raises(StoreError, match="changed while it was being read") as info:
            reader.read()
    assert not isinstance(info.value, TransientStoreError)  # not retried into the new version


def test_stream_resume_attempts_is_deprecated() -> None:
    with pytest.warns(DeprecationWarning, match="RetryStore"):
        S3Config(stream_resume_attempts=3)


@pytest.mark.ceph
def test_pickled_store_works_in_forked_child(ceph_s3: CephS3, s3_bucket: str) -> None:
    store = _store(ceph_s3, s3_bucket)
    store.put("k", b"value")
    clone = pickle.loads(pickle.dumps(store))
    assert clone.get("k") == b"value"
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reuses the parent's store object: a new client for the new process
        try:
            os.write(write_fd, store.get("k"))
        finally:
            os._exit(0)
    os.close(write_fd)
    os.waitpid(pid, 0)
    assert os.read(read_fd, 100) == b"value"
    os.close(read_fd)


@pytest.mark.ceph
def test_writer_retries_a_failed_part(ceph_s3: CephS3, s3_bucket: str, s3_client: Any) -> None:
    from botocore.exceptions import EndpointConnectionError

    store = _store(ceph_s3, s3_bucket, part_size=MIN_PART_SIZE)
    client = store._client()
    original = client.upload_part
    failures = []

    def flaky(**kwargs: Any) -> Any:
        if kwargs["PartNumber"] == 2 and not failures:
            failures.append(kwargs["PartNumber"])
            raise EndpointConnectionError(endpoint_url=ceph_s3.endpoint_url)
        return original(**kwargs)

    client.upload_part = flaky
    data = _blob(2 * MIN_PART_SIZE + 99, seed=11)
    with store.open_writer("retried") as writer:
        writer.write(memoryview(data)[:100])
        writer.write(memoryview(data)[100:])  # tops up part 1, then a whole part from the view
    assert failures == [2]
    assert store.get("retried") == data
    store2 = _store(ceph_s3, s3_bucket, part_size=MIN_PART_SIZE, part_attempts=1)
    client2 = store2._client()
    client2.upload_part = lambda **kw: (_ for _ in ()).throw(
        EndpointConnectionError(endpoint_url=ceph_s3.endpoint_url)
    )
    with (
        pytest.raises(TransientStoreError, match="upload part 1"),
        store2.open_writer("failed") as w,
    ):
        w.write(data)
    assert not store2.exists("failed")
    assert s3_client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []


@pytest.mark.ceph
def test_stream_resumes_after_radosgw_restart(ceph_s3: CephS3, s3_client: Any) -> None:
    need(
        "sole use of the Ceph cluster",
        is_sole_user(ceph_s3),
        "other processes use this cluster and killing radosgw would disturb them; give this test "
        "a private one (CEPH_RUN=/tmp/my-ceph RGW_PORT=7491 MON_PORT=3311 MON_V1_PORT=6791)",
    )
    # Not the s3_bucket fixture: after radosgw was SIGKILLed, the next bucket deletion can wait
    # ~25 s (for the dead gateway's watch to time out), so this bucket stays, emptied.
    bucket = f"fl-restart-{os.getpid()}"
    s3_client.create_bucket(Bucket=bucket)
    store = _store(ceph_s3, bucket)
    data = _blob(48 * 1024 * 1024, seed=13)
    store.put("restart", data)
    # The reader resumes under RetryStore, as open_store would wrap it; the head below asks the
    # bare store, which answers at once.
    resuming = RetryStore(store, RetryConfig(initial_backoff=0.2, max_backoff=2.0))
    with resuming.open_reader("restart", chunk_size=64 * 1024) as reader:
        head = reader.read(1024 * 1024)
        stop_rgw(ceph_s3)  # SIGKILL mid-stream; the socket may still hold some buffered bytes
        try:
            with pytest.raises(TransientStoreError, match=r"127\.0\.0\.1"):
                store.head("restart")  # down: a retryable error naming the endpoint, at once
        finally:
            start_rgw(ceph_s3)
        rest = reader.read()
    store.delete("restart")
    assert head + rest == data


class _Proxy:
    """A TCP forwarder from a port on 127.0.0.1 to radosgw that can be stopped (connections to it
    are then refused, as to a crashed server) and started again on the same port."""

    def __init__(self, target: str) -> None:
        parts = urlsplit(target)
        self._target = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.port = 0
        self._server: socket.socket | None = None
        self._conns: list[socket.socket] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", self.port))
        server.listen(64)
        self.port = server.getsockname()[1]
        self._server = server
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return  # stopped
            upstream = socket.create_connection(self._target, timeout=10)
            self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        """Stop listening and cut every open connection (pooled keep-alive ones too)."""
        server, self._server = self._server, None
        if server is not None:
            with contextlib.suppress(OSError):
                server.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
            server.close()
        conns, self._conns = self._conns, []
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()


@pytest.mark.ceph
def test_server_that_answered_is_waited_for_one_that_never_did_is_not(
    ceph_s3: CephS3, s3_bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A private "server" in front of the shared radosgw, so that stopping it disturbs nobody.
    proxy = _Proxy(ceph_s3.endpoint_url)
    proxy.start()
    patient = RetryConfig(max_retries=60, initial_backoff=0.05, max_backoff=0.2, retry_timeout=20)
    options = {**ceph_s3.store_options(), "endpoint_url": proxy.url, "retry": patient}
    store = open_store(f"s3://{s3_bucket}/p", **options)
    try:
        store.put("k", b"value")  # answered: from now on outages are ridden out
        proxy.stop()
        fresh = open_store(f"s3://{s3_bucket}/p", **options)
        began = time.monotonic()
        with pytest.raises(StoreUnavailableError, match=f"connection refused by {proxy.url}"):
            fresh.get("k")  # never answered: a few quick retries, then the error
        assert time.monotonic() - began < 5
        restart = threading.Timer(1.0, proxy.start)
        restart.start()
        began = time.monotonic()
        with caplog.at_level(logging.INFO, logger="fastload.storage"):
            assert store.get("k") == b"value"
        restart.join()
        assert time.monotonic() - began >= 0.9  # it waited for the restart
        retries = [r.getMessage() for r in caplog.records if "retrying (" in r.getMessage()]
        assert len(retries) > 3  # more than a never-answered store gets
        assert all(line.endswith(f"connection refused by {proxy.url}") for line in retries[1:])
    finally:
        proxy.stop()


@pytest.mark.ceph
def test_endpoint_from_aws_endpoint_url_alone(
    ceph_s3: CephS3, s3_bucket: str, no_endpoint_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", ceph_s3.endpoint_url)
    options = {k: v for k, v in ceph_s3.store_options().items() if k != "endpoint_url"}
    store = open_store(f"s3://{s3_bucket}/env", **options)
    store.put("k", b"through the environment")
    assert store.get("k") == b"through the environment"
    assert store.inner._endpoint() == ceph_s3.endpoint_url  # type: ignore[attr-defined]
