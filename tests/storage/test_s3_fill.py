"""The S3 store's reads as the cache fills from them (issue 15): acknowledgements sent at once, the
client made cheaply in forked workers, a fill streamed as one pinned GET."""

from __future__ import annotations

import multiprocessing
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from fastload.errors import InvalidArgumentError
from fastload.storage import ByteRange, CachingStore, LimitStore, RetryStore, _s3_config, open_store
from fastload.storage._s3 import S3Store
from fastload.storage._s3_connection import ack_now, response_socket
from fastload.storage._streams import reader_version
from fastload.testing.ceph import CephS3


def _store(ceph: CephS3, bucket: str, **options: Any) -> S3Store:
    return S3Store(bucket, "", **{**ceph.store_options(), **options})


class _Sock(socket.socket):
    """A socket that records the options set on it."""

    def __init__(self) -> None:
        super().__init__(socket.AF_INET, socket.SOCK_STREAM)
        self.options: list[tuple[int, int, int]] = []

    def setsockopt(self, level: int, name: int, value: Any, *args: Any) -> None:  # type: ignore[override]
        self.options.append((level, name, value))
        super().setsockopt(level, name, value, *args)


class _Body:
    """A stand-in for botocore's StreamingBody: ``_raw_stream.connection.sock``."""

    def __init__(self, sock: object) -> None:
        connection = type("Connection", (), {"sock": sock})()
        self._raw_stream = type("Raw", (), {"connection": connection})()


@pytest.mark.skipif(not hasattr(socket, "TCP_QUICKACK"), reason="TCP_QUICKACK is Linux's")
def test_ack_now_sets_quickack_on_the_bodys_socket() -> None:
    with _Sock() as sock:
        ack_now(_Body(sock))
        assert sock.options == [(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)]


def test_ack_now_ignores_bodies_without_a_socket() -> None:
    assert response_socket(object()) is None
    assert response_socket(_Body(None)) is None
    assert response_socket(_Body("not a socket")) is None
    ack_now(object())  # a stubbed client's body: nothing to do, no error
    ack_now(_Body(None))
    closed = socket.socket()
    closed.close()
    ack_now(_Body(closed))  # a closed socket: the OSError is swallowed


def test_missing_profile_is_an_argument_error_naming_it() -> None:
    store = S3Store("bkt", profile="no-such-profile-9f3", endpoint_url="http://127.0.0.1:1")
    with pytest.raises(InvalidArgumentError, match=r"'no-such-profile-9f3'.*AWS_PROFILE"):
        store.head("x")


def _client_loader(config: Any) -> int:
    """In a forked child: the id of the data loader a new client's session got."""
    client = _s3_config.make_client(config, "s3://bkt")
    loader = client._loader if hasattr(client, "_loader") else None
    shared = next(iter(_s3_config._LOADERS.values()))
    return int(loader is shared) if loader is not None else -1


def test_clients_share_one_data_loader_also_in_forked_children() -> None:
    config = _s3_config.S3Config(endpoint_url="http://127.0.0.1:1", region="us-east-1")
    first = _s3_config.make_client(config, "s3://bkt")
    second = _s3_config.make_client(config, "s3://bkt")
    assert first is not second
    loaders = list(_s3_config._LOADERS.values())
    assert len(loaders) == 1
    assert first._loader is loaders[0]
    assert second._loader is loaders[0]
    with multiprocessing.get_context("fork").Pool(1) as pool:
        assert pool.apply(_client_loader, (config,)) == 1  # the parent's, not parsed again


@pytest.mark.ceph
def test_real_responses_expose_their_socket(ceph_s3: CephS3, s3_bucket: str) -> None:
    """ack_now relies on botocore's and urllib3's internals; a release that moves the socket
    must fail here rather than silently bring the 40 ms delays back."""
    store = _store(ceph_s3, s3_bucket)
    store.put("small", b"x" * 9000)
    resp = store._client().get_object(Bucket=s3_bucket, Key="small")
    sock = response_socket(resp["Body"])
    assert isinstance(sock, socket.socket)
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0  # botocore's socket
    assert resp["Body"].read() == b"x" * 9000


@pytest.mark.ceph
def test_every_get_and_stream_acknowledges_at_once(
    ceph_s3: CephS3, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    acked: list[socket.socket | None] = []

    def record(body: Any) -> None:
        acked.append(response_socket(body))
        ack_now(body)

    from fastload.storage import _s3, _s3_reader

    monkeypatch.setattr(_s3, "ack_now", record)
    monkeypatch.setattr(_s3_reader, "ack_now", record)
    store = _store(ceph_s3, s3_bucket)
    data = os.urandom(100_000)
    store.put("obj", data)
    assert store.get("obj") == data
    assert store.get("obj", ByteRange(10, 20)) == data[10:20]
    with store.open_reader("obj") as reader:
        assert reader.read() == data
    assert len(acked) == 3
    assert all(isinstance(s, socket.socket) for s in acked)


@pytest.mark.ceph
def test_a_cache_fill_from_s3_is_one_head_and_one_get(
    ceph_s3: CephS3, s3_bucket: str, tmp_path: Path
) -> None:
    store = _store(ceph_s3, s3_bucket)
    data = os.urandom(5 * 1024 * 1024 + 3)  # several fill buffers
    store.put("shard.tar", data)
    requests: list[str] = []
    client = store._client()
    for name in ("get_object", "head_object"):
        original = getattr(client, name)

        def counted(*args: Any, _name: str = name, _original: Any = original, **kw: Any) -> Any:
            requests.append(_name)
            return _original(*args, **kw)

        setattr(client, name, counted)
    cache = CachingStore(RetryStore(store), tmp_path / "cache", "1GB")
    path = cache.local_path("shard.tar")
    assert path is not None
    assert Path(path).read_bytes() == data
    # The GET's ETag is the head's: the copy is that version, no second head needed.
    assert requests == ["head_object", "get_object"]
    assert cache.head("shard.tar").etag == store.head("shard.tar").etag
    assert cache.stats()["requests"] == 2


@pytest.mark.ceph
def test_limited_readers_name_their_version(ceph_s3: CephS3, s3_bucket: str) -> None:
    """A LimitStore's reader passes the version on, so a RetryStore above it can tell a resumed
    stream of a replaced object (and a cache can trust a fill)."""
    store = _store(ceph_s3, s3_bucket)
    store.put("obj", b"v1" * 1000)
    etag = store.head("obj").etag
    limited = LimitStore(store, 2)
    with limited.open_reader("obj") as reader:
        assert reader_version(reader) == etag
    with open_store(f"s3://{s3_bucket}", max_concurrency=2, **ceph_s3.store_options()).open_reader(
        "obj"
    ) as reader:
        assert reader_version(reader) == etag


@pytest.mark.ceph
def test_streamed_reads_take_at_most_a_piece_from_the_body(ceph_s3: CephS3, s3_bucket: str) -> None:
    """Large reads are served in pieces of at most READ_PIECE bytes straight from the body
    (small allocations that are reused), never by one allocation of the whole read."""
    from fastload.storage._s3_reader import READ_PIECE

    store = _store(ceph_s3, s3_bucket)
    data = os.urandom(3 * READ_PIECE + 17)
    store.put("obj", data)
    client = store._client()
    original = client.get_object
    asked: list[int] = []

    def get_object(**kwargs: Any) -> Any:
        resp = original(**kwargs)
        body = resp["Body"]
        read = body.read

        def spy(n: int | None = None) -> bytes:
            asked.append(-1 if n is None else n)
            return bytes(read(n))

        body.read = spy
        return resp

    client.get_object = get_object
    with store.open_reader("obj", chunk_size=8 * READ_PIECE) as reader:
        assert reader.read(8 * READ_PIECE) == data
    assert asked
    assert max(asked) <= READ_PIECE
    assert min(asked) > 0
