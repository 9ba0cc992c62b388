"""RetryStore: what is retried, how long it waits, and when it gives up (no real sleeping)."""

from __future__ import annotations

import dataclasses
import io
import logging
import pickle
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from fastload.errors import (
    InvalidArgumentError,
    InvalidRangeError,
    ObjectNotFoundError,
    StoreError,
    StoreUnavailableError,
    TransientStoreError,
)
from fastload.storage import (
    ByteRange,
    MemoryStore,
    ObjectMeta,
    ObjectWriter,
    RetryConfig,
    RetryStore,
    Store,
    WrapperStore,
)
from fastload.storage._retry import _jitter, is_retryable, unreachable_reason


class FakeTime:
    """A clock that advances only when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def clock(self) -> float:
        return self.now


class Flaky(WrapperStore):
    """Fails the first ``failures[op]`` calls of each operation with ``error``; counts calls."""

    def __init__(
        self, store: Store, failures: dict[str, int], error: BaseException | None = None
    ) -> None:
        super().__init__(store)
        self.failures = dict(failures)
        self.calls: Counter[str] = Counter()
        self.error = error if error is not None else TransientStoreError("503 Slow Down")

    def _maybe_fail(self, op: str) -> None:
        self.calls[op] += 1
        if self.failures.get(op, 0) > 0:
            self.failures[op] -= 1
            raise self.error

    def get(self, key: str, byte_range: ByteRange | None = None) -> bytes:
        self._maybe_fail("get")
        return super().get(key, byte_range)

    def head(self, key: str) -> ObjectMeta:
        self._maybe_fail("head")
        return super().head(key)

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        self._maybe_fail("put")
        super().put(key, data)

    def delete(self, key: str) -> None:
        self._maybe_fail("delete")
        super().delete(key)

    def open_writer(self, key: str) -> ObjectWriter:
        self._maybe_fail("open_writer")
        return super().open_writer(key)

    def get_ranges(
        self, key: str, ranges: Sequence[ByteRange], *, coalesce: int = 0
    ) -> list[bytes]:
        self._maybe_fail("get_ranges")
        return super().get_ranges(key, ranges, coalesce=coalesce)


@pytest.fixture
def memory() -> Iterator[MemoryStore]:
    store = MemoryStore(f"retry-{uuid.uuid4().hex}")
    yield store
    store.delete_many(store.list_keys())


def make(
    inner: Store, config: RetryConfig | None = None, jitter: float = 1.0
) -> tuple[RetryStore, FakeTime]:
    fake = FakeTime()
    store = RetryStore(inner, config, sleep=fake.sleep, clock=fake.clock, jitter=lambda: jitter)
    return store, fake


def test_defaults_are_documented_values() -> None:
    config = RetryConfig()
    assert (config.max_retries, config.initial_backoff, config.max_backoff) == (10, 0.1, 15.0)
    assert (config.backoff_base, config.retry_timeout) == (2.0, 180.0)
    assert config.retry_builtin_errors is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_retries = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_retries": -1},
        {"max_retries": 1.5},
        {"initial_backoff": -0.1},
        {"max_backoff": -1},
        {"retry_timeout": -5},
        {"backoff_base": 0.5},
    ],
)
def test_config_validation(kwargs: dict[str, float]) -> None:
    with pytest.raises(InvalidArgumentError):
        RetryConfig(**kwargs)  # type: ignore[arg-type]


def test_config_type_checked(memory: MemoryStore) -> None:
    with pytest.raises(InvalidArgumentError, match="RetryConfig"):
        RetryStore(memory, {"max_retries": 3})  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="wraps a fastload Store"):
        RetryStore("memory://x")  # type: ignore[arg-type]


def test_retries_transient_errors_with_exponential_backoff(memory: MemoryStore) -> None:
    memory.put("k", b"value")
    flaky = Flaky(memory, {"get": 3})
    store, fake = make(flaky)
    assert store.get("k") == b"value"
    assert flaky.calls["get"] == 4
    assert fake.sleeps == pytest.approx([0.1, 0.2, 0.4])


def test_full_jitter_scales_each_sleep(memory: MemoryStore) -> None:
    memory.put("k", b"value")
    flaky = Flaky(memory, {"head": 3})
    store, fake = make(flaky, jitter=0.25)
    assert store.head("k").size == 5
    assert fake.sleeps == pytest.approx([0.025, 0.05, 0.1])


def test_default_jitter_is_uniform_below_the_bound(memory: MemoryStore) -> None:
    memory.put("k", b"v")
    flaky = Flaky(memory, {"get": 8})
    fake = FakeTime()
    store = RetryStore(flaky, sleep=fake.sleep, clock=fake.clock)
    assert store.get("k") == b"v"
    bounds = [0.1 * 2**i for i in range(8)]
    assert len(fake.sleeps) == 8
    assert all(0 <= s < b for s, b in zip(fake.sleeps, bounds))
    assert len(set(fake.sleeps)) == 8  # random, not a fixed schedule
    samples = [_jitter() for _ in range(1000)]
    assert 0 <= min(samples) < 0.05
    assert 0.95 < max(samples) < 1


def test_backoff_is_capped_by_max_backoff(memory: MemoryStore) -> None:
    memory.put("k", b"v")
    flaky = Flaky(memory, {"get": 5})
    store, fake = make(flaky, RetryConfig(initial_backoff=1.0, max_backoff=3.0))
    store.get("k")
    assert fake.sleeps == pytest.approx([1.0, 2.0, 3.0, 3.0, 3.0])
    assert RetryConfig().backoff_bound(10_000) == 15.0  # no overflow for huge retry counts


@pytest.mark.parametrize(
    ("op", "call"),
    [
        ("get", lambda s: s.get("missing")),
        ("head", lambda s: s.head("missing")),
        ("delete", lambda s: s.delete("missing")),
    ],
)
def test_not_found_is_not_retried(memory: MemoryStore, op: str, call: object) -> None:
    flaky = Flaky(memory, {})
    store, fake = make(flaky)
    with pytest.raises(ObjectNotFoundError):
        call(store)  # type: ignore[operator]
    assert flaky.calls[op] == 1
    assert fake.sleeps == []


def test_non_retryable_errors_pass_through_unchanged(memory: MemoryStore) -> None:
    memory.put("k", b"abc")
    store, fake = make(memory)
    with pytest.raises(InvalidRangeError, match="3 bytes"):
        store.get("k", ByteRange(0, 10))
    error = StoreError("disk on fire")
    flaky = Flaky(memory, {"get": 1}, error=error)
    store, fake = make(flaky)
    with pytest.raises(StoreError) as info:
        store.get("k")
    assert info.value is error
    assert flaky.calls["get"] == 1
    assert fake.sleeps == []


def test_gives_up_after_max_retries(memory: MemoryStore) -> None:
    memory.put("data/k", b"v")
    flaky = Flaky(memory, {"get": 100})
    store, fake = make(flaky, RetryConfig(max_retries=3))
    with pytest.raises(StoreUnavailableError) as info:
        store.get("data/k")
    error = info.value
    assert flaky.calls["get"] == 4
    assert len(fake.sleeps) == 3
    assert isinstance(error, ConnectionError)
    assert isinstance(error.__cause__, TransientStoreError)
    assert not error.retryable
    message = str(error)
    assert "memory://" in message
    assert "data/k" in message
    assert "failed 4 times over 0.7 s" in message
    assert "all 3 retries used" in message
    assert "503 Slow Down" in message
    assert error.url == memory.child_url("data/k")


def test_gives_up_when_the_time_budget_runs_out(memory: MemoryStore) -> None:
    memory.put("k", b"v")
    flaky = Flaky(memory, {"get": 100})
    store, fake = make(flaky, RetryConfig(initial_backoff=0.4, retry_timeout=1.0))
    with pytest.raises(StoreUnavailableError, match=r"failed 2 times over 0\.4 s") as info:
        store.get("k")
    # 0.4 s slept, the next sleep (0.8 s) would end after the 1 s budget.
    assert fake.sleeps == pytest.approx([0.4])
    assert "1 s budget" in str(info.value)


def test_time_spent_in_attempts_counts_against_the_budget(memory: MemoryStore) -> None:
    fake = FakeTime()

    class Slow(Flaky):
        def get(self, key: str, byte_range: ByteRange | None = None) -> bytes:
            fake.now += 10.0  # each attempt takes 10 s (a timeout)
            return super().get(key, byte_range)

    memory.put("k", b"v")
    slow = Slow(memory, {"get": 100})
    store = RetryStore(
        slow, RetryConfig(retry_timeout=25), sleep=fake.sleep, clock=fake.clock, jitter=lambda: 1
    )
    with pytest.raises(StoreUnavailableError, match="failed 3 times"):
        store.get("k")
    assert slow.calls["get"] == 3


def test_builtin_connection_errors_are_retried(memory: MemoryStore) -> None:
    memory.put("k", b"v")
    for error in (ConnectionResetError("reset by peer"), TimeoutError("timed out")):
        flaky = Flaky(memory, {"get": 2}, error=error)
        store, fake = make(flaky)
        assert store.get("k") == b"v"
        assert flaky.calls["get"] == 3
        assert len(fake.sleeps) == 2
        flaky = Flaky(memory, {"get": 2}, error=error)
        store, _ = make(flaky, RetryConfig(retry_builtin_errors=False))
        with pytest.raises(type(error)):
            store.get("k")
        assert flaky.calls["get"] == 1


def test_is_retryable() -> None:
    assert is_retryable(TransientStoreError("x"))
    assert not is_retryable(StoreUnavailableError("x"))  # an inner RetryStore already gave up
    assert not is_retryable(ObjectNotFoundError("x"))
    assert is_retryable(ConnectionRefusedError())
    assert not is_retryable(ConnectionRefusedError(), builtin_errors=False)
    assert not is_retryable(ValueError("x"))
    assert not is_retryable(FileNotFoundError())


def test_nested_retry_stores_do_not_multiply(memory: MemoryStore) -> None:
    memory.put("k", b"v")
    flaky = Flaky(memory, {"get": 100})
    inner, _ = make(flaky, RetryConfig(max_retries=2))
    outer, outer_time = make(inner, RetryConfig(max_retries=5))
    with pytest.raises(StoreUnavailableError):
        outer.get("k")
    assert flaky.calls["get"] == 3
    assert outer_time.sleeps == []


def test_put_and_get_ranges_are_retried(memory: MemoryStore) -> None:
    flaky = Flaky(memory, {"put": 2, "get_ranges": 1})
    store, _ = make(flaky)
    store.put("k", b"0123456789")
    assert flaky.calls["put"] == 3
    assert store.get_ranges("k", [ByteRange(0, 2), ByteRange(8, 10)]) == [b"01", b"89"]
    assert flaky.calls["get_ranges"] == 2


def test_delete_retried_after_it_succeeded_counts_as_done(memory: MemoryStore) -> None:
    class DeletesThenFails(Flaky):
        def delete(self, key: str) -> None:
            self.calls["delete"] += 1
            if self.calls["delete"] == 1:
                self._store.delete(key)  # the server deleted it, but the reply was lost
                raise TransientStoreError("connection dropped")
            self._store.delete(key)

    memory.put("k", b"v")
    flaky = DeletesThenFails(memory, {})
    store, fake = make(flaky)
    store.delete("k")
    assert flaky.calls["delete"] == 2
    assert len(fake.sleeps) == 1
    assert not memory.exists("k")


class ListFailsOnce(WrapperStore):
    """The first listing fails after yielding ``after`` entries."""

    def __init__(self, store: Store, after: int, times: int = 1) -> None:
        super().__init__(store)
        self.after, self.times, self.listings = after, times, 0

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        self.listings += 1
        fail = self.listings <= self.times
        for i, meta in enumerate(self._store.list(prefix)):
            if fail and i == self.after:
                raise TransientStoreError("listing page timed out")
            yield meta


def test_list_resumes_after_a_failure_without_duplicates(memory: MemoryStore) -> None:
    keys = [f"k{i:03d}" for i in range(50)]
    for key in keys:
        memory.put(key, b"")
    flaky = ListFailsOnce(memory, after=20, times=3)
    store, fake = make(flaky)
    assert store.list_keys() == keys
    assert flaky.listings == 4
    assert len(fake.sleeps) == 3


def test_list_gives_up(memory: MemoryStore) -> None:
    memory.put("a", b"")
    flaky = ListFailsOnce(memory, after=0, times=100)
    store, _ = make(flaky, RetryConfig(max_retries=2))
    with pytest.raises(StoreUnavailableError, match="list"):
        store.list_keys()
    assert flaky.listings == 3


def test_open_writer_is_retried_but_writes_are_not(memory: MemoryStore) -> None:
    flaky = Flaky(memory, {"open_writer": 2})
    store, fake = make(flaky)
    with store.open_writer("w") as writer:
        writer.write(b"abc")
    assert memory.get("w") == b"abc"
    assert flaky.calls["open_writer"] == 3
    assert len(fake.sleeps) == 2

    class FailingWriter(ObjectWriter):
        writes = 0

        def _write(self, data: memoryview) -> None:
            FailingWriter.writes += 1
            raise TransientStoreError("connection reset mid-upload")

        def _commit(self) -> None:
            raise AssertionError("not reached")

        def _abort(self) -> None:
            pass

    class BrokenUploads(WrapperStore):
        def open_writer(self, key: str) -> ObjectWriter:
            return FailingWriter()

    store, fake = make(BrokenUploads(memory))
    with pytest.raises(TransientStoreError), store.open_writer("x") as writer:
        writer.write(b"data")
    assert FailingWriter.writes == 1
    assert fake.sleeps == []
    assert not memory.exists("x")


class _BreakingStream(io.RawIOBase):
    """Serves ``data`` from ``start`` and raises a transient error after ``limit`` bytes."""

    def __init__(self, data: bytes, limit: int) -> None:
        super().__init__()
        self.data, self.limit, self.pos, self.served = data, limit, 0, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = offset
        return offset

    def readinto(self, buffer: Any) -> int:
        if self.served >= self.limit:
            raise TransientStoreError("connection reset mid-stream")
        n = min(len(buffer), self.limit - self.served, len(self.data) - self.pos)
        buffer[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        self.served += n
        return n


def test_open_reader_resumes_a_broken_stream_where_it_stopped(memory: MemoryStore) -> None:
    data = bytes(range(256)) * 1200
    memory.put("big", data)
    opened: list[int] = []

    class BreaksEvery100k(WrapperStore):
        def open_reader(self, key: str, *, chunk_size: int = 0) -> io.BufferedIOBase:
            opened.append(1)
            return io.BufferedReader(_BreakingStream(data, 100_000), buffer_size=4096)

    store, fake = make(BreaksEvery100k(memory))
    with store.open_reader("big") as reader:
        assert reader.read() == data
        reader.seek(10)
        assert reader.read(5) == data[10:15]
    # 307,200 bytes in streams that break every 100,000 bytes: 3 breaks, 3 resumed streams,
    # then one more stream for the seek back.
    assert len(opened) == 5
    assert len(fake.sleeps) == 3


def test_open_reader_gives_up_when_the_stream_keeps_breaking(memory: MemoryStore) -> None:
    memory.put("big", b"x" * 1000)

    class AlwaysBreaks(WrapperStore):
        def open_reader(self, key: str, *, chunk_size: int = 0) -> io.BufferedIOBase:
            return io.BufferedReader(_BreakingStream(b"x" * 1000, 0))

    store, _ = make(AlwaysBreaks(memory))
    with store.open_reader("big") as reader, pytest.raises(StoreUnavailableError, match="read"):
        reader.read()


def test_pickles_with_its_config(tmp_path: object) -> None:
    store = RetryStore(MemoryStore("pickled-retry"), RetryConfig(max_retries=3))
    copy = pickle.loads(pickle.dumps(store))
    assert isinstance(copy, RetryStore)
    assert copy.config == RetryConfig(max_retries=3)
    assert copy.url == "memory://pickled-retry"
    assert "RetryConfig(max_retries=3" in repr(copy)


# ---- stores that never answered fail fast; stores that answered get the full budget ----------


def _refused() -> ConnectionRefusedError:
    """A real ConnectionRefusedError: connect to a port on 127.0.0.1 that nothing listens on."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError as exc:
        return exc
    raise AssertionError(f"something listens on 127.0.0.1:{port}")


def _unresolved() -> OSError:
    """A real name-resolution error (``.invalid`` never resolves, RFC 6761)."""
    import socket

    try:
        socket.getaddrinfo("nonexistent.invalid", 80)
    except socket.gaierror as exc:
        return exc
    raise AssertionError("nonexistent.invalid resolved")


def _chained(cause: BaseException, message: str) -> TransientStoreError:
    """A backend's translated error, raised from ``cause`` as backends do."""
    try:
        try:
            raise cause
        except OSError as exc:
            raise TransientStoreError(message, url="memory://x/k") from exc
    except TransientStoreError as err:
        return err


def test_unreachable_reason_classifies_real_errors() -> None:
    refused, unresolved = _refused(), _unresolved()
    assert unreachable_reason(refused) == "connect"
    assert unreachable_reason(unresolved) == "dns"
    assert unreachable_reason(_chained(refused, "cannot read")) == "connect"
    assert unreachable_reason(_chained(unresolved, "cannot read")) == "dns"
    assert unreachable_reason(_chained(ConnectionResetError(104, "reset"), "x")) is None
    assert unreachable_reason(TransientStoreError("503 Slow Down")) is None
    assert unreachable_reason(TimeoutError("read timed out")) is None


def test_connection_refused_before_any_answer_fails_after_two_quick_retries(
    memory: MemoryStore,
) -> None:
    memory.put("k", b"v")
    flaky = Flaky(memory, {"get": 100}, error=_chained(_refused(), "connection refused by X"))
    store, fake = make(flaky)
    assert not store.answered
    with pytest.raises(StoreUnavailableError) as info:
        store.get("k")
    assert flaky.calls["get"] == 3  # 2 retries, not 10
    assert fake.sleeps == pytest.approx([0.1, 0.2])
    message = str(info.value)
    assert message.startswith(f"get {memory.child_url('k')} failed: no connection to the server")
    assert "gave up after 3 attempts in 0.3 s" in message
    assert "has not answered any request yet" in message
    assert "connection refused by X" in message  # the backend's message, naming the endpoint
    assert "RetryConfig" not in message  # no advice to allow more retries
    assert isinstance(info.value.__cause__, TransientStoreError)


def test_unresolvable_host_fails_after_one_retry(memory: MemoryStore) -> None:
    flaky = Flaky(memory, {"head": 100}, error=_chained(_unresolved(), "host does not resolve"))
    store, fake = make(flaky)
    with pytest.raises(StoreUnavailableError, match="host name does not resolve") as info:
        store.head("k")
    assert flaky.calls["head"] == 2
    assert fake.sleeps == pytest.approx([0.1])
    assert "gave up after 2 attempts" in str(info.value)


def test_fast_fail_limits_are_configurable_and_capped_by_max_retries(
    memory: MemoryStore,
) -> None:
    error = _chained(_refused(), "refused")
    flaky = Flaky(memory, {"get": 100}, error=error)
    store, _ = make(flaky, RetryConfig(connect_retries=5))
    with pytest.raises(StoreUnavailableError):
        store.get("k")
    assert flaky.calls["get"] == 6
    flaky = Flaky(memory, {"get": 100}, error=error)
    store, _ = make(flaky, RetryConfig(max_retries=1, connect_retries=5))
    with pytest.raises(StoreUnavailableError):
        store.get("k")
    assert flaky.calls["get"] == 2
    for bad in ({"connect_retries": -1}, {"dns_retries": 1.0}, {"connect_retries": True}):
        with pytest.raises(InvalidArgumentError, match="must be an int >= 0"):
            RetryConfig(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("cause", [_refused, _unresolved], ids=["refused", "dns"])
def test_after_the_store_answered_unreachable_gets_the_full_budget(
    memory: MemoryStore, cause: Any
) -> None:
    # A server restarting mid-epoch: it answered before, so it is waited for.
    memory.put("k", b"v")
    flaky = Flaky(memory, {}, error=_chained(cause(), "cannot connect"))
    store, fake = make(flaky)
    assert store.get("k") == b"v"
    assert store.answered
    flaky.failures["get"] = 7
    assert store.get("k") == b"v"
    assert flaky.calls["get"] == 1 + 8
    assert len(fake.sleeps) == 7
    flaky.failures["get"] = 100
    with pytest.raises(StoreUnavailableError) as info:
        store.get("k")
    assert "all 10 retries used" in str(info.value)
    assert "RetryConfig(max_retries=" in str(info.value)  # here waiting longer may help


def test_an_error_the_server_sent_counts_as_an_answer(memory: MemoryStore) -> None:
    flaky = Flaky(memory, {}, error=_chained(_refused(), "refused"))
    store, _ = make(flaky)
    with pytest.raises(ObjectNotFoundError):
        store.get("missing")  # a 404 comes from a server that runs
    assert store.answered
    memory.put("k", b"v")
    flaky.failures["get"] = 4
    assert store.get("k") == b"v"  # 4 > connect_retries: the full budget applied
    store, _ = make(Flaky(memory, {"get": 1}))  # a 503, then success
    assert store.get("k") == b"v"
    assert store.answered


def test_answered_travels_with_the_pickled_store(memory: MemoryStore) -> None:
    memory.put("k", b"v")
    store = RetryStore(memory)
    assert not pickle.loads(pickle.dumps(store)).answered
    store.get("k")
    assert pickle.loads(pickle.dumps(store)).answered  # DataLoader workers of an opened dataset


def test_list_and_reader_record_the_answer(memory: MemoryStore) -> None:
    memory.put("k", b"value")
    listing, _ = make(memory)
    assert listing.list_keys() == ["k"]
    assert listing.answered
    reading, _ = make(memory)
    with reading.open_reader("k") as reader:
        assert reader.read() == b"value"
    assert reading.answered


def test_each_retry_is_one_info_line(memory: MemoryStore, caplog: pytest.LogCaptureFixture) -> None:
    memory.put("k", b"v")
    error = TransientStoreError("cannot read memory://x/k: HTTP 503; retry later\nsecond line")
    store, _ = make(Flaky(memory, {"get": 2}, error=error), jitter=0.5)
    with caplog.at_level(logging.INFO, logger="fastload.storage"):
        assert store.get("k") == b"v"
    lines = [r.getMessage() for r in caplog.records if r.name == "fastload.storage"]
    assert lines == [
        "retrying (1/10) in 0.05 s: cannot read memory://x/k: HTTP 503",
        "retrying (2/10) in 0.1 s: cannot read memory://x/k: HTTP 503",
    ]
    assert all(r.levelno == logging.INFO for r in caplog.records)
