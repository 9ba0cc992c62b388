"""fastload over a network that misbehaves, against the real Ceph RGW through a fault proxy.

:class:`fastload.testing.faultproxy.FaultProxy` sits between fastload and radosgw and damages a
seeded share of the responses: connections cut inside a response's headers or body, resets,
stalls past the client's read timeout. Every case asserts outcomes: the right bytes (by hash),
every sample exactly once, an intact dataset called intact, a damaged one still damaged, a real
overwrite still caught, and no partial object visible in the cache or the bucket. Timeouts are
short (``read_timeout``, the retry backoff) so that the faults cost little time; the decisions
are a function of the seed and the connection and response numbers, never of timing.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload.cli import main as cli_main
from fastload.errors import StoreError, StoreUnavailableError, TransientStoreError
from fastload.storage import MemoryStore, RetryConfig, RetryStore
from fastload.storage._keys import ObjectMeta
from fastload.storage._s3_responses import ResponseCutError, check_response
from fastload.storage._streams import SeekableReader
from fastload.storage._wrapper import WrapperStore
from fastload.testing.ceph import CephS3
from fastload.testing.faultproxy import BREAKING_KINDS, FaultPlan, FaultProxy

#: Short enough that a stall costs little, long enough for a loaded 2-core machine's radosgw.
READ_TIMEOUT = 1.0
STALL_S = 1.3
FAST_RETRY = RetryConfig(initial_backoff=0.02, max_backoff=0.2, max_retries=10, retry_timeout=60)


@pytest.fixture
def proxy(ceph_s3: CephS3) -> Iterator[FaultProxy]:
    with FaultProxy(ceph_s3.endpoint_url, FaultPlan(stall_s=STALL_S)) as p:
        yield p


def s3_options(ceph_s3: CephS3, proxy: FaultProxy, **extra: Any) -> dict[str, Any]:
    """Store options that send every request through ``proxy``."""
    options = dict(ceph_s3.store_options())
    options.update(
        endpoint_url=proxy.endpoint_url,
        read_timeout=READ_TIMEOUT,
        connect_timeout=2.0,
        retry=FAST_RETRY,
        **extra,
    )
    return options


def fault_next(proxy: FaultProxy, kind: str, seed: int = 0) -> None:
    """Damage the proxy's next response with ``kind`` (then none)."""
    base = proxy.stats()["responses"]
    proxy.set_plan(FaultPlan(seed=seed, stall_s=STALL_S, script={base: kind}))


def faults(proxy: FaultProxy, fraction: float, seed: int) -> None:
    proxy.set_plan(FaultPlan(seed=seed, fraction=fraction, stall_s=STALL_S))


# ---- the response check, without a network ----------------------------------------------------


@pytest.mark.parametrize(
    ("operation", "headers", "what"),
    [
        ("GetObject", {"Content-Length": "", "ETag": '"ab"'}, "not a number"),
        ("HeadObject", {"Content-Length": "12", "ETag": '"5494ab'}, "no closing quote"),
        ("HeadObject", {"Content-Length": "12"}, "no etag header"),
        ("GetObject", {"ETag": '"ab"'}, "nothing says where its body ends"),
        ("ListObjectsV2", {}, "nothing says where its body ends"),
        (
            "GetObject",
            {"Content-Length": "3", "ETag": '"ab"', "Content-Range": "bytes 0-2/1"},
            None,
        ),
        (
            "GetObject",
            {"Content-Length": "3", "ETag": '"ab"', "Content-Range": "bytes 0-"},
            "Range",
        ),
        (
            "HeadObject",
            {"Content-Length": "3", "ETag": '"ab"', "Last-Modified": "Thu, 03 Dec 20"},
            "whole HTTP date",
        ),
        ("HeadObject", {"Content-Length": "3", "ETag": '"ab"'}, None),
        ("ListObjectsV2", {"Transfer-Encoding": "chunked"}, None),
    ],
)
def test_a_response_cut_inside_its_headers_is_recognised(
    operation: str, headers: dict[str, str], what: str | None
) -> None:
    import botocore.session
    from urllib3 import HTTPHeaderDict

    model = botocore.session.get_session().get_service_model("s3").operation_model(operation)
    response = {"status_code": 200, "headers": HTTPHeaderDict(headers), "body": b""}
    if what is None:
        check_response(response, model)
        return
    with pytest.raises(ResponseCutError, match=what):
        check_response(response, model)
    assert isinstance(ResponseCutError("x"), ConnectionError)  # retried if it escapes


def test_a_value_error_from_botocores_parser_is_a_transient_store_error() -> None:
    from botocore.parsers import RestXMLParser

    from fastload.storage._s3_errors import ErrorContext, is_transport_error, translate

    try:
        RestXMLParser()._handle_integer(None, "")  # what a cut "Content-Length: " gave
    except ValueError as exc:
        parse_error = exc
    assert is_transport_error(parse_error)
    assert not is_transport_error(ValueError("a bug of ours"))
    ctx = ErrorContext("b", "http://127.0.0.1:9", "nowhere", lambda _e: None)
    err = translate(parse_error, "s3://b/k", "read", ctx)
    assert isinstance(err, TransientStoreError)
    assert "http://127.0.0.1:9" in str(err)
    assert "could not be parsed" in str(err)


def test_untranslated_transport_errors_are_retried_and_others_are_not() -> None:
    import http.client

    from urllib3.exceptions import ProtocolError, ReadTimeoutError

    from fastload.storage._retry import is_retryable

    assert is_retryable(http.client.IncompleteRead(b"abc", 10))
    assert is_retryable(http.client.BadStatusLine("HTTP/1."))
    assert is_retryable(ProtocolError("Connection broken: IncompleteRead"))
    assert is_retryable(ReadTimeoutError(None, "/", "read timed out"))  # type: ignore[arg-type]
    assert is_retryable(ResponseCutError("cut"))
    assert not is_retryable(ValueError("invalid literal for int() with base 10: ''"))
    assert not is_retryable(http.client.IncompleteRead(b""), builtin_errors=False)


def test_count_listeners_hear_every_count_of_this_process() -> None:
    heard: list[str] = []
    store = _Versions(os.urandom(1000), ["v1", None], ["v1"])
    retry = _retry(store)
    retry.add_count_listener(heard.append)
    with retry.open_reader("x") as f:
        f.read()
    assert heard == ["retries", "resumed_reads"]
    assert pickle.loads(pickle.dumps(retry)).stats()["retries"] == 0  # a copy counts anew


# ---- the identity of a resumed read, with a stand-in store -------------------------------------


class _BreakingReader(SeekableReader):
    """Reads ``data`` naming ``version``; raises a transient error at byte ``break_at``."""

    def __init__(self, data: bytes, version: str | None, break_at: int | None) -> None:
        super().__init__()
        self._data, self._ver, self._break = data, version, break_at

    @property
    def version(self) -> str | None:
        return self._ver

    def _size(self) -> int:
        return len(self._data)

    def _read_into(self, out: memoryview) -> int:
        if self._break is not None and self._pos >= self._break:
            self._break = None
            raise TransientStoreError("connection reset mid-body", url="memory://x")
        end = len(self._data) if self._break is None else self._break
        n = min(out.nbytes, end - self._pos)
        out[:n] = self._data[self._pos : self._pos + n]
        return n


class _Versions(WrapperStore):
    """A store whose readers name the versions listed (one per open) and break once, and whose
    head names ``head_etags`` in turn."""

    def __init__(self, data: bytes, versions: list[str | None], head_etags: list[str | None]):
        super().__init__(MemoryStore())
        self.data, self.versions, self.heads = data, versions, head_etags
        self.opens = 0

    def open_reader(self, key: str, *, chunk_size: int = 0) -> io.BufferedIOBase:
        version = self.versions[min(self.opens, len(self.versions) - 1)]
        self.opens += 1
        brk = 100 if self.opens == 1 else None
        return io.BufferedReader(_BreakingReader(self.data, version, brk), buffer_size=64)

    def head(self, key: str) -> ObjectMeta:
        etag = self.heads.pop(0) if len(self.heads) > 1 else self.heads[0]
        return ObjectMeta(key, len(self.data), None, etag)


def _no_sleep(_seconds: float) -> None:
    pass


def _retry(store: _Versions) -> RetryStore:
    return RetryStore(store, RetryConfig(max_retries=4), sleep=_no_sleep)


def test_a_resumed_read_without_a_version_is_not_a_change() -> None:
    data = os.urandom(1000)
    store = _Versions(data, ["v1", None], ["v1"])
    retry = _retry(store)
    with retry.open_reader("x") as f:
        assert f.read() == data  # the HEAD named v1: the same object, read on
    assert retry.stats() == {"retries": 1, "resumed_reads": 1, "gave_up": 0}


def test_a_resumed_read_whose_version_is_contradicted_by_head_asks_again() -> None:
    data = os.urandom(1000)
    store = _Versions(data, ["v1", "garbled", "v1"], ["v1"])
    retry = _retry(store)
    with retry.open_reader("x") as f:
        assert f.read() == data
    assert store.opens == 3
    assert retry.stats()["retries"] == 2


def test_a_resumed_read_where_no_answer_names_a_version_gives_up_typed() -> None:
    store = _Versions(os.urandom(1000), ["v1", None], [None])
    with (
        pytest.raises(StoreUnavailableError, match="cannot tell whether"),
        _retry(store).open_reader("x") as f,
    ):
        f.read()


def test_a_real_change_is_still_caught_on_resume() -> None:
    store = _Versions(os.urandom(1000), ["v1", None], ["v2"])
    pattern = r"changed while it was being read.*'v1'.*'v2'"
    with pytest.raises(StoreError, match=pattern) as err, _retry(store).open_reader("x") as f:
        f.read()
    assert not isinstance(err.value, StoreUnavailableError)
    assert not err.value.retryable


# ---- the S3 store through the proxy ------------------------------------------------------------


def _objects(seed: int, n: int = 6) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {f"obj{i}": rng.randbytes(rng.choice([0, 1, 700, 9000, 300_000])) for i in range(n)}


@pytest.mark.parametrize("kind", BREAKING_KINDS)
@pytest.mark.parametrize("op", ["get", "range", "head", "stream", "list", "put"])
def test_each_fault_on_each_request_is_retried_to_the_right_answer(
    ceph_s3: CephS3, s3_bucket: str, proxy: FaultProxy, kind: str, op: str
) -> None:
    store = fastload.open_store(f"s3://{s3_bucket}/p", **s3_options(ceph_s3, proxy))
    data = random.Random(7).randbytes(200_000)
    store.put("k", data)
    for seed in range(2):  # two cut points of each kind
        fault_next(proxy, kind, seed)
        before = proxy.stats()[kind]
        if op == "get":
            assert store.get("k") == data
        elif op == "range":
            assert store.get("k", fastload.storage.ByteRange(1000, 150_000)) == data[1000:150_000]
        elif op == "head":
            meta = store.head("k")
            assert (meta.size, meta.etag) == (len(data), hashlib.md5(data).hexdigest())
        elif op == "stream":
            with store.open_reader("k") as f:
                assert f.read() == data
        elif op == "list":
            assert [m.key for m in store.list()] == ["k"]
        else:
            store.put(f"new{seed}", data[:5000])
            assert store.get(f"new{seed}") == data[:5000]
        assert proxy.stats()[kind] == before + 1  # the fault happened
    # A cut after everything a bodiless answer needs (a HEAD's or a PUT's last headers) may need
    # no retry; every other fault does.
    lenient = op in ("head", "put") and kind in ("cut_headers", "cut_body")  # no body to cut
    assert store.stats()["retries"] >= (0 if lenient else 2)
    assert store.stats()["gave_up"] == 0


def test_cuts_at_many_points_of_the_headers(
    ceph_s3: CephS3, s3_bucket: str, proxy: FaultProxy
) -> None:
    """The issue's untyped ``int('')`` and false "changed": cuts at 60 seeded points inside the
    headers of HEAD and GET answers, each retried to the right answer."""
    store = fastload.open_store(f"s3://{s3_bucket}/p", **s3_options(ceph_s3, proxy))
    data = os.urandom(300_000)  # larger than the reader's buffer: a far seek sends a request
    store.put("k", data)
    etag = hashlib.md5(data).hexdigest()
    for seed in range(30):
        fault_next(proxy, "cut_headers", seed)
        meta = store.head("k")
        assert (meta.size, meta.etag) == (len(data), etag)
        fault_next(proxy, "cut_headers", 1000 + seed)
        with store.open_reader("k") as f:
            assert f.read(10) == data[:10]
            fault_next(proxy, "cut_headers", 2000 + seed)  # the resumed request is cut too
            f.seek(250_000)
            assert f.read() == data[250_000:]
    assert proxy.stats()["cut_headers"] == 90
    assert store.stats()["gave_up"] == 0


def test_a_real_overwrite_during_a_broken_read_is_caught(
    ceph_s3: CephS3, s3_bucket: str, proxy: FaultProxy, s3_client: Any
) -> None:
    store = fastload.open_store(f"s3://{s3_bucket}/p", **s3_options(ceph_s3, proxy))
    old, new = os.urandom(3_000_000), os.urandom(3_000_000)
    store.put("k", old)
    fault_next(proxy, "cut_body", seed=5)  # the reader's GET is cut inside its body
    with store.open_reader("k") as f:
        s3_client.put_object(Bucket=s3_bucket, Key="p/k", Body=new)  # behind the reader's back
        with pytest.raises(StoreError, match="changed while it was being read") as err:
            f.read()
    assert not isinstance(err.value, StoreUnavailableError)
    assert proxy.stats()["cut_body"] == 1
    with store.open_reader("k") as f:  # read again, as the message says: the new bytes
        assert f.read() == new


def test_a_network_that_never_answers_whole_gives_up_typed(
    ceph_s3: CephS3, s3_bucket: str, proxy: FaultProxy
) -> None:
    options = s3_options(ceph_s3, proxy)
    options["retry"] = RetryConfig(initial_backoff=0.01, max_backoff=0.02, max_retries=3)
    store = fastload.open_store(f"s3://{s3_bucket}/p", **options)
    store.put("k", b"abc")
    proxy.set_plan(FaultPlan(fraction=1.0, kinds=("cut_headers", "cut_body", "reset")))
    with pytest.raises(StoreUnavailableError) as err:
        store.get("k")
    message = str(err.value)
    assert "failed 4 times" in message
    assert "all 3 retries used" in message
    assert proxy.endpoint_url in message  # the endpoint the client talked to
    assert store.stats()["gave_up"] == 1


# ---- a dataset: convert, load, cache, verify ---------------------------------------------------


N_SAMPLES = 160
SHARD_SAMPLES = 10


def _source(root: Path) -> dict[str, str]:
    """A JSONL corpus of 160 records with random payloads; returns key -> SHA-256 of payload."""
    rng = random.Random(32)
    hashes = {}
    with open(root, "w", encoding="utf-8") as f:
        for i in range(N_SAMPLES):
            text = rng.randbytes(rng.randint(2000, 9000)).hex()
            key = f"r{i:05d}"
            f.write(json.dumps({"__key__": key, "txt": text}) + "\n")
            hashes[key] = hashlib.sha256(text.encode()).hexdigest()
    return hashes


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    path = tmp_path / "corpus.jsonl"
    return path, _source(path)


def _listing(ceph_s3: CephS3, bucket: str, prefix: str) -> dict[str, bytes]:
    """Every object under ``prefix``, read straight from radosgw (not through the proxy)."""
    store = fastload.open_store(f"s3://{bucket}/{prefix}", **ceph_s3.store_options())
    return {key: store.get(key) for key in store.list_keys()}


def _convert(corpus: Path, url: str, options: dict[str, Any]) -> None:
    fastload.convert(
        corpus,
        url,
        format="webdataset",
        shard_samples=SHARD_SAMPLES,
        workers=2,
        quiet=True,
        store_options=options,
    )


def test_convert_through_faults_writes_what_a_clean_run_writes(
    ceph_s3: CephS3,
    s3_bucket: str,
    proxy: FaultProxy,
    s3_client: Any,
    corpus: tuple[Path, dict[str, str]],
) -> None:
    path, _ = corpus
    _convert(path, f"s3://{s3_bucket}/clean", dict(ceph_s3.store_options()))
    faults(proxy, 0.08, seed=11)
    _convert(path, f"s3://{s3_bucket}/faulty", s3_options(ceph_s3, proxy))
    assert proxy.stats()["faults"] >= 3  # the run met faults
    clean = _listing(ceph_s3, s3_bucket, "clean")
    faulty = _listing(ceph_s3, s3_bucket, "faulty")
    assert len(clean) == 2 * (N_SAMPLES // SHARD_SAMPLES) + 1  # shards, indexes, manifest
    assert faulty == clean  # every object whole and the same: no partial shard or manifest
    uploads = s3_client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
    assert uploads == []


@pytest.fixture
def dataset(
    ceph_s3: CephS3, s3_bucket: str, corpus: tuple[Path, dict[str, str]]
) -> tuple[str, dict[str, str]]:
    path, hashes = corpus
    url = f"s3://{s3_bucket}/ds"
    _convert(path, url, dict(ceph_s3.store_options()))
    return url, hashes


def _key_and_hash(sample: dict[str, Any]) -> tuple[str, str]:
    text = sample["txt"]
    raw = text.encode() if isinstance(text, str) else bytes(text)
    return sample["__key__"], hashlib.sha256(raw).hexdigest()


def _pairs(batch: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return batch


class _CacheWatcher:
    """Hashes every complete-looking file in the cache while the loader runs: each must be a
    whole object of the dataset (no partial object is ever visible)."""

    def __init__(self, cache: Path, whole: set[str]) -> None:
        self.cache, self.whole = cache, whole
        self.seen: set[str] = set()
        self.partial: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.05):
            self.scan()

    def scan(self) -> None:
        for dirpath, _, names in os.walk(self.cache / "objects"):
            for name in names:
                if name.endswith((".json", ".tmp")) or name.startswith("."):
                    continue
                try:
                    with open(os.path.join(dirpath, name), "rb") as f:
                        digest = hashlib.sha256(f.read()).hexdigest()
                except FileNotFoundError:
                    continue  # evicted meanwhile
                self.seen.add(digest)
                if digest not in self.whole:
                    self.partial.append(os.path.join(dirpath, name))

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.scan()


@pytest.mark.parametrize("seed", [32, 33, 34])  # three runs, as the report had
def test_epochs_through_faults_and_an_evicting_cache_are_exact(
    seed: int,
    ceph_s3: CephS3,
    s3_bucket: str,
    proxy: FaultProxy,
    s3_client: Any,
    dataset: tuple[str, dict[str, str]],
    tmp_path: Path,
) -> None:
    url, hashes = dataset
    objects = _listing(ceph_s3, s3_bucket, "ds")
    whole = {hashlib.sha256(b).hexdigest() for b in objects.values()}
    shard_bytes = sum(len(b) for k, b in objects.items() if k != "fastload.json")
    cache = tmp_path / "cache"
    ds = fastload.open_dataset(
        url,
        store_options=s3_options(ceph_s3, proxy),
        cache_dir=cache,
        cache_size=shard_bytes // 2,  # half the dataset: shards are evicted and fetched again
        shuffle=True,
        seed=3,
        transform=_key_and_hash,
    )
    loader = fastload.DataLoader(ds, batch_size=8, num_workers=2, collate_fn=_pairs)
    faults(proxy, 0.05, seed=seed)
    watcher = _CacheWatcher(cache, whole)
    try:
        for epoch in range(3):
            loader.set_epoch(epoch)
            got = [pair for batch in loader for pair in batch]
            keys = [k for k, _ in got]
            assert len(keys) == N_SAMPLES
            assert set(keys) == set(hashes)
            assert dict(got) == hashes  # the right bytes
    finally:
        watcher.close()
    assert watcher.partial == []  # no partial object was ever visible in the cache
    assert watcher.seen  # the watcher did see cached objects
    stats = loader.stats()
    network = proxy.stats()
    assert network["faults"] >= 3  # the runs met faults ...
    assert stats["node_cache_evictions"] > 0  # ... and an evicting cache
    assert stats["node_cache_downloads"] > len(objects) - 1
    # The retries the faults needed, summed over the workers of the node; none gave up.
    assert stats["node_cache_store_retries"] >= 1
    assert stats["node_cache_store_gave_up"] == 0
    print(f"\nloader through faults: proxy {network}; loader {stats}")


def test_verify_through_faults_calls_intact_intact_and_damaged_damaged(
    ceph_s3: CephS3,
    s3_bucket: str,
    proxy: FaultProxy,
    s3_client: Any,
    dataset: tuple[str, dict[str, str]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, _ = dataset
    creds = ceph_s3.store_options()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", creds["access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", creds["secret_access_key"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", ceph_s3.region)
    args = ["verify", url, "--endpoint-url", proxy.endpoint_url]
    args += ["--store-option", f"read_timeout={READ_TIMEOUT}"]
    faults(proxy, 0.05, seed=4)
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "PROBLEM" not in out
    assert "OK: checked 16 shards, read 160 samples" in out
    assert proxy.stats()["faults"] >= 2
    # A shard damaged for real (one byte) is still a problem, through the same network.
    key = "ds/shard-000005.tar"
    body = bytearray(s3_client.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    body[700] ^= 0xFF
    s3_client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(body))
    assert cli_main(args) == 1
    out = capsys.readouterr().out
    problems = [line for line in out.splitlines() if line.startswith("PROBLEM")]
    assert problems
    assert all(f"{url}/shard-000005.tar" in line for line in problems)
    assert any("SHA-256 is" in line for line in problems)
    # A store that cannot be read at all: no verdict, exit 4, the endpoint named.
    proxy.set_plan(FaultPlan(fraction=1.0, kinds=("reset",)))
    status = cli_main([*args, "--store-option", "retry=false"])
    captured = capsys.readouterr()
    assert status == 4
    assert "PROBLEM" not in captured.out
    assert "UNREADABLE" in captured.err
    assert "No verdict" in captured.err
    assert proxy.endpoint_url in captured.err


def test_verify_that_cannot_read_the_store_raises_naming_the_attempts(
    ceph_s3: CephS3, proxy: FaultProxy, dataset: tuple[str, dict[str, str]]
) -> None:
    from fastload.convert import verify_dataset

    url, _ = dataset
    options = s3_options(ceph_s3, proxy)
    options["retry"] = RetryConfig(initial_backoff=0.01, max_backoff=0.02, max_retries=2)
    store = fastload.open_store(url, **options)
    assert verify_dataset(store).ok
    proxy.set_plan(FaultPlan(fraction=1.0, kinds=("cut_body", "reset"), seed=2))
    with pytest.raises(StoreUnavailableError) as err:
        verify_dataset(store)
    message = str(err.value)
    assert "failed 3 times" in message
    assert proxy.endpoint_url in message
