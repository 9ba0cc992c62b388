"""LimitStore: never more than N operations in flight, and no deadlock for streamed I/O."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from fastload.errors import InvalidArgumentError
from fastload.storage import (
    ByteRange,
    LimitStore,
    MemoryStore,
    ObjectMeta,
    Store,
    WrapperStore,
)


class Gate(WrapperStore):
    """Counts operations in flight; every operation waits for ``release`` before finishing."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.lock = threading.Condition()
        self.active = 0
        self.max_active = 0
        self.entered = 0
        self.release = threading.Event()

    def _run(self, fn: Callable[[], object]) -> object:
        with self.lock:
            self.active += 1
            self.entered += 1
            self.max_active = max(self.max_active, self.active)
            self.lock.notify_all()
        try:
            self.release.wait(30)
            return fn()
        finally:
            with self.lock:
                self.active -= 1

    def get(self, key: str, byte_range: ByteRange | None = None) -> bytes:
        return self._run(lambda: super(Gate, self).get(key, byte_range))  # type: ignore[return-value]

    def head(self, key: str) -> ObjectMeta:
        return self._run(lambda: super(Gate, self).head(key))  # type: ignore[return-value]

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        self._run(lambda: super(Gate, self).put(key, data))

    def wait_for(self, entered: int) -> None:
        with self.lock:
            assert self.lock.wait_for(lambda: self.entered >= entered, timeout=30)


@pytest.fixture
def memory() -> Iterator[MemoryStore]:
    store = MemoryStore(f"limit-{uuid.uuid4().hex}")
    yield store
    store.delete_many(store.list_keys())


@pytest.mark.parametrize("limit", [1, 3])
def test_never_more_than_the_limit_in_flight(memory: MemoryStore, limit: int) -> None:
    memory.put("k", b"value")
    gate = Gate(memory)
    store = LimitStore(gate, max_concurrency=limit)
    calls = [lambda: store.get("k"), lambda: store.head("k"), lambda: store.put("p", b"x")] * 4
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        gate.wait_for(limit)
        time.sleep(0.05)  # give an (erroneous) extra thread the chance to enter
        assert gate.entered == limit, "more operations entered the store than the limit allows"
        gate.release.set()
        for future in futures:
            future.result(30)
    assert gate.max_active == limit
    assert gate.entered == len(calls)


def test_without_the_limit_the_gate_sees_all_threads(memory: MemoryStore) -> None:
    """The counting fake itself works: unlimited, all operations are in flight together."""
    memory.put("k", b"value")
    gate = Gate(memory)
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(gate.get, "k") for _ in range(6)]
        gate.wait_for(6)
        gate.release.set()
        assert [f.result(30) for f in futures] == [b"value"] * 6
    assert gate.max_active == 6


def _run_with_timeout(fn: Callable[[], object], seconds: float = 20) -> None:
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "deadlock: the operation did not finish"
    if errors:
        raise errors[0]


def test_streamed_io_does_not_hold_a_slot_between_calls(memory: MemoryStore) -> None:
    store = LimitStore(memory, max_concurrency=1)
    memory.put("src", b"source bytes")
    for i in range(3):
        memory.put(f"list/{i}", b"x")

    def scenario() -> None:
        with store.open_writer("dst") as writer:
            writer.write(store.get("src"))  # a get while the writer is open
            writer.write(store.get_ranges("src", [ByteRange(0, 6)])[0])
        with store.open_reader("src", chunk_size=4) as reader:
            first = reader.read(6)
            assert store.head("src").size == 12  # a head while the reader is open
            assert first + reader.read() == b"source bytes"
        for meta in store.list("list/"):
            assert store.get(meta.key) == b"x"  # a get inside a listing
        store.copy_to("src", store, "copy")

    _run_with_timeout(scenario)
    assert memory.get("dst") == b"source bytessource"
    assert memory.get("copy") == b"source bytes"


def test_writer_abort_needs_no_slot(memory: MemoryStore) -> None:
    store = LimitStore(memory, max_concurrency=1)

    def scenario() -> None:
        writer = store.open_writer("w")
        writer.write(b"abc")
        with store._slots:  # all slots taken, e.g. by the thread that is unwinding
            writer.abort()

    _run_with_timeout(scenario)
    assert not memory.exists("w")


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4", None])
def test_invalid_limit(memory: MemoryStore, bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="max_concurrency"):
        LimitStore(memory, max_concurrency=bad)  # type: ignore[arg-type]


def test_pickled_copy_gets_fresh_slots(memory: MemoryStore) -> None:
    memory.put("k", b"v")
    store = LimitStore(memory, max_concurrency=1)
    with store._slots:  # the original's only slot is taken
        copy = pickle.loads(pickle.dumps(store))
        assert isinstance(copy, LimitStore)
        assert copy.max_concurrency == 1
        _run_with_timeout(lambda: copy.get("k"), 5)
    assert "max_concurrency=1" in repr(copy)


def _get_in_child(store: LimitStore, queue: multiprocessing.Queue[bytes]) -> None:
    queue.put(store.get("k"))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork start method needs os.fork")
def test_forked_child_gets_fresh_slots(memory: MemoryStore) -> None:
    memory.put("k", b"from parent")
    store = LimitStore(memory, max_concurrency=1)
    ctx = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue[bytes] = ctx.Queue()
    with store._slots:  # a parent thread holds the only slot when the child forks
        child = ctx.Process(target=_get_in_child, args=(store, queue))
        child.start()
        try:
            assert queue.get(timeout=30) == b"from parent"
        finally:
            child.join(30)
            if child.is_alive():
                child.kill()
    assert child.exitcode == 0


def test_capabilities_and_url_pass_through(memory: MemoryStore) -> None:
    store = LimitStore(memory, max_concurrency=2)
    assert store.url == memory.url
    assert store.inner is memory
    assert store.shared_across_processes is False
    read_only = LimitStore(MemoryStore.from_url(memory.url, read_only=True), max_concurrency=2)
    assert read_only.supports_writes is False
