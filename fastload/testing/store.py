"""The conformance suite every :class:`~fastload.storage.Store` backend and wrapper must pass.

Subclass :class:`StoreTests` in a test module and provide a ``store`` fixture that returns a
writable store over a fresh, *empty* namespace for each test (a temporary directory, a unique
``memory://`` name, a unique S3 prefix)::

    class TestLocalStore(StoreTests):
        @pytest.fixture
        def store(self, tmp_path):
            return LocalStore(tmp_path / "root")

        def read_only_view(self, store):
            return LocalStore(store.root, read_only=True)

A remote backend gives each test its own prefix and cleans up after it, e.g.::

    class TestS3Store(StoreTests):
        @pytest.fixture
        def store(self, s3_bucket):
            store = S3Store(f"s3://{s3_bucket}/test-{uuid.uuid4().hex}", endpoint_url=...)
            yield store
            store.delete_many(store.list_keys())

What a backend cannot do it declares with the store's capability flags
(``supports_listing``, ``shared_across_processes``, ...); the tests that need a capability skip
when the flag is off. Never disable a test of this suite by overriding it.

The multi-process tests pickle the store into ``spawn``-ed processes, so the store (and any
store it wraps) must be importable and picklable by reference, as stores that users hand to
DataLoader workers are.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload.errors import (
    InvalidKeyError,
    InvalidRangeError,
    ObjectNotFoundError,
    ReadOnlyStoreError,
    StoreError,
)
from fastload.storage import ByteRange, ObjectMeta, Store
from fastload.testing._store_common import MiB, need_listing, payload
from fastload.testing._store_processes import ProcessTests
from fastload.testing._store_streams import StreamTests

__all__ = ["INVALID_KEYS", "StoreTests"]

#: Keys every store must reject with :class:`~fastload.errors.InvalidKeyError`.
INVALID_KEYS: tuple[str, ...] = (
    "",
    "/absolute",
    "/",
    "..",
    ".",
    "../escape",
    "a/../../escape",
    "a/./b",
    "a//b",
    "trailing/",
    "nul\x00byte",
)


class StoreTests(StreamTests, ProcessTests):
    """Conformance tests for one store implementation; subclass and provide ``store``."""

    #: Size of the "large" object of the round-trip tests; backends with slow writes may lower it.
    large_size: int = 3 * MiB + 7
    #: Number of keys of the listing test.
    many_keys: int = 300

    # ---- what a subclass provides -----------------------------------------------------------

    @pytest.fixture
    def store(self) -> Store:
        """A writable store over a fresh, empty namespace. Subclasses must override this."""
        raise NotImplementedError(f"{type(self).__name__} must define a `store` fixture")

    def read_only_view(self, store: Store) -> Store | None:
        """A read-only store over the same objects as ``store``, or None if there is no such mode."""
        return None

    # ---- basics -----------------------------------------------------------------------------

    def test_capabilities_and_url(self, store: Store) -> None:
        for flag in (
            "supports_writes",
            "supports_range_reads",
            "supports_listing",
            "has_local_paths",
            "shared_across_processes",
        ):
            assert isinstance(getattr(store, flag), bool), flag
        assert store.supports_writes, "the `store` fixture must return a writable store"
        assert isinstance(store.url, str)
        assert "://" in store.url
        assert store.child_url("a/b").endswith("/a/b")

    def test_new_store_is_empty(self, store: Store) -> None:
        need_listing(store)
        assert store.list_keys() == []

    @pytest.mark.parametrize("size", [0, 1, 4097])
    def test_put_get_roundtrip(self, store: Store, size: int) -> None:
        data = payload(size, seed=size)
        store.put("obj", data)
        got = store.get("obj")
        assert type(got) is bytes
        assert got == data
        assert store.head("obj").size == size

    def test_put_get_large(self, store: Store) -> None:
        data = payload(self.large_size, seed=1)
        store.put("dir/large.bin", data)
        assert store.get("dir/large.bin") == data
        assert store.size("dir/large.bin") == self.large_size

    def test_put_accepts_bytearray_and_memoryview(self, store: Store) -> None:
        buf = bytearray(b"0123456789")
        store.put("ba", buf)
        store.put("mv", memoryview(buf)[2:6])
        buf[:] = b"xxxxxxxxxx"  # the store must have copied the data
        assert store.get("ba") == b"0123456789"
        assert store.get("mv") == b"2345"

    def test_overwrite_replaces(self, store: Store) -> None:
        store.put("k", b"first version, longer")
        store.put("k", b"second")
        assert store.get("k") == b"second"
        assert store.head("k").size == 6

    @pytest.mark.parametrize(
        "key",
        [
            "plain",
            "a/b/c/d/e/deep.bin",
            "ünïcödé/файл/数据.txt",
            "emoji-😀.bin",
            "spaces and+plus=eq&amp%25.bin",
            ".hidden",
            "a/..dots../b...",
            "x" * 200,
        ],
    )
    def test_valid_keys_roundtrip(self, store: Store, key: str) -> None:
        data = key.encode("utf-8")
        store.put(key, data)
        assert store.get(key) == data
        assert store.head(key).key == key
        if store.supports_listing:
            assert store.list_keys() == [key]
        store.delete(key)
        assert not store.exists(key)

    @pytest.mark.parametrize("key", INVALID_KEYS)
    def test_invalid_keys_rejected(self, store: Store, key: str) -> None:
        calls: dict[str, Callable[[], object]] = {
            "get": lambda: store.get(key),
            "get range": lambda: store.get(key, ByteRange(0, 1)),
            "head": lambda: store.head(key),
            "put": lambda: store.put(key, b"x"),
            "open_writer": lambda: store.open_writer(key),
            "delete": lambda: store.delete(key),
        }
        for name, call in calls.items():
            with pytest.raises(InvalidKeyError) as info:
                call()
            assert isinstance(info.value, ValueError), name
        if store.supports_listing:
            assert store.list_keys() == [], "a rejected key must not write anything"

    # ---- ranges -----------------------------------------------------------------------------

    def test_get_range_matches_slicing(self, store: Store) -> None:
        size = 10_000
        data = payload(size, seed=2)
        store.put("ranged", data)

        @settings(max_examples=60, deadline=None)
        @given(start=st.integers(0, size), length=st.integers(0, size))
        def check(start: int, length: int) -> None:
            end = min(size, start + length)
            got = store.get("ranged", ByteRange(start, end))
            assert type(got) is bytes
            assert got == data[start:end]

        check()
        # The edges, explicitly.
        assert store.get("ranged", ByteRange(0, 0)) == b""
        assert store.get("ranged", ByteRange(size, size)) == b""
        assert store.get("ranged", ByteRange(0, size)) == data
        assert store.get("ranged", ByteRange(size - 1, size)) == data[-1:]

    def test_range_on_empty_object(self, store: Store) -> None:
        store.put("empty", b"")
        assert store.get("empty", ByteRange(0, 0)) == b""
        with pytest.raises(InvalidRangeError, match=r"\b0 bytes"):
            store.get("empty", ByteRange(0, 1))

    @pytest.mark.parametrize(("start", "end"), [(0, 101), (100, 101), (99, 200), (150, 160)])
    def test_range_past_end_names_size(self, store: Store, start: int, end: int) -> None:
        store.put("hundred", payload(100))
        with pytest.raises(InvalidRangeError, match=r"\b100 bytes") as info:
            store.get("hundred", ByteRange(start, end))
        assert isinstance(info.value, ValueError)
        assert "hundred" in str(info.value)

    def test_empty_range_past_end_is_an_error(self, store: Store) -> None:
        store.put("hundred", payload(100))
        with pytest.raises(InvalidRangeError, match=r"\b100 bytes"):
            store.get("hundred", ByteRange(150, 150))

    def test_malformed_ranges(self) -> None:
        with pytest.raises(InvalidRangeError):
            ByteRange(-1, 3)
        with pytest.raises(InvalidRangeError):
            ByteRange(5, 4)
        assert ByteRange.from_length(3, 4) == ByteRange(3, 7)
        assert ByteRange(3, 7).length == 4

    def test_get_ranges(self, store: Store) -> None:
        size = 3000
        data = payload(size, seed=3)
        store.put("multi", data)
        ranges = [
            ByteRange(2000, 2100),  # unsorted
            ByteRange(0, 10),
            ByteRange(5, 50),  # overlaps the previous one
            ByteRange(5, 50),  # duplicate
            ByteRange(60, 60),  # empty
            ByteRange(2990, 3000),  # reaches the end exactly
            ByteRange(0, 3000),  # everything
        ]
        for coalesce in (0, 100, 1 << 20):
            got = store.get_ranges("multi", ranges, coalesce=coalesce)
            assert got == [data[r.start : r.end] for r in ranges], coalesce
            assert all(type(g) is bytes for g in got)
        assert store.get_ranges("multi", []) == []
        with pytest.raises(InvalidRangeError, match=r"\b3000 bytes"):
            store.get_ranges("multi", [ByteRange(0, 1), ByteRange(2999, 3001)])
        with pytest.raises(ObjectNotFoundError):
            store.get_ranges("missing", [ByteRange(0, 1)])

    def test_get_ranges_property(self, store: Store) -> None:
        size = 2300
        data = payload(size, seed=4)
        store.put("o", data)

        @settings(max_examples=30, deadline=None)
        @given(
            spans=st.lists(st.tuples(st.integers(0, size), st.integers(0, 300)), max_size=12),
            coalesce=st.sampled_from([0, 64, 4096]),
        )
        def check(spans: list[tuple[int, int]], coalesce: int) -> None:
            ranges = [ByteRange(s, min(size, s + n)) for s, n in spans]
            assert store.get_ranges("o", ranges, coalesce=coalesce) == [
                data[r.start : r.end] for r in ranges
            ]

        check()

    # ---- metadata ---------------------------------------------------------------------------

    def test_head(self, store: Store) -> None:
        store.put("h", b"abc")
        meta = store.head("h")
        assert isinstance(meta, ObjectMeta)
        assert (meta.key, meta.size) == ("h", 3)
        assert meta.mtime is None or isinstance(meta.mtime, float)
        store.put("h", b"abcdefg")
        meta2 = store.head("h")
        assert meta2.size == 7
        if meta.etag is not None:
            assert meta2.etag is not None
            assert meta2.etag != meta.etag, "the etag must change when the content changes"

    # ---- listing ----------------------------------------------------------------------------

    LIST_KEYS = ("a/b/c", "a/b/d/e", "a/bc", "a/b-1", "a-b", "a0", "ab", "b")

    def test_list_prefix_semantics(self, store: Store) -> None:
        need_listing(store)
        for i, key in enumerate(self.LIST_KEYS):
            store.put(key, b"x" * i)
        expected = sorted(self.LIST_KEYS)
        assert store.list_keys() == expected
        assert store.list_keys("a/b") == ["a/b-1", "a/b/c", "a/b/d/e", "a/bc"]
        assert store.list_keys("a/b/") == ["a/b/c", "a/b/d/e"]
        assert store.list_keys("a/b/d/e") == ["a/b/d/e"]
        assert store.list_keys("a") == [k for k in expected if k.startswith("a")]
        assert store.list_keys("a/x") == []
        assert store.list_keys("zzz") == []
        metas = {m.key: m for m in store.list()}
        for i, key in enumerate(self.LIST_KEYS):
            assert metas[key].size == i
        assert store.list_keys("../") == []  # must not escape the namespace

    def test_list_many_keys(self, store: Store) -> None:
        need_listing(store)
        keys = [f"many/{i % 7}/item-{i:04d}" for i in range(self.many_keys)]
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda k: store.put(k, k.encode()), keys))
        assert store.list_keys("many/") == sorted(keys)
        assert store.list_keys("many/3/") == sorted(k for k in keys if k.startswith("many/3/"))
        assert sum(m.size for m in store.list("many")) == sum(len(k) for k in keys)

    # ---- missing keys and deletion ------------------------------------------------------------

    def test_missing_key(self, store: Store) -> None:
        calls: dict[str, Callable[[], object]] = {
            "get": lambda: store.get("no/such/key"),
            "get range": lambda: store.get("no/such/key", ByteRange(0, 1)),
            "head": lambda: store.head("no/such/key"),
            "delete": lambda: store.delete("no/such/key"),
            "open_reader": lambda: store.open_reader("no/such/key").read(),
        }
        for name, call in calls.items():
            with pytest.raises(ObjectNotFoundError) as info:
                call()
            assert isinstance(info.value, FileNotFoundError), name
            assert "no/such/key" in str(info.value), name
        assert not store.exists("no/such/key")

    def test_prefix_of_a_key_is_not_an_object(self, store: Store) -> None:
        store.put("dir/obj", b"1")
        assert not store.exists("dir")
        with pytest.raises(ObjectNotFoundError):
            store.get("dir")
        with pytest.raises(ObjectNotFoundError):
            store.head("dir")

    def test_delete(self, store: Store) -> None:
        store.put("gone/soon", b"1")
        store.put("gone/stays", b"2")
        store.delete("gone/soon")
        assert not store.exists("gone/soon")
        assert store.get("gone/stays") == b"2"
        with pytest.raises(ObjectNotFoundError):
            store.delete("gone/soon")
        if store.supports_listing:
            assert store.list_keys() == ["gone/stays"]
        store.delete_many(["gone/stays", "never/existed"])
        assert not store.exists("gone/stays")
        if store.supports_listing:
            assert store.list_keys() == []

    def test_abort_incomplete_writes_keeps_finished_objects(self, store: Store) -> None:
        store.put("partial/done", b"finished")
        # No writer died here: nothing is unfinished, whatever the store keeps of such writes.
        assert store.abort_incomplete_writes("partial/") == []
        assert store.get("partial/done") == b"finished"
        with pytest.raises(InvalidKeyError):
            store.abort_incomplete_writes("/absolute/")

    # ---- atomicity ----------------------------------------------------------------------------

    def test_put_is_atomic_for_concurrent_readers(self, store: Store) -> None:
        sizes = [64 * 1024, 512 * 1024, 200 * 1024 + 3]
        versions = [bytes([v]) * sizes[v % len(sizes)] for v in range(1, 25)]
        store.put("atomic", versions[0])
        done = threading.Event()
        seen: list[int] = []
        errors: list[str] = []

        def reader() -> None:
            transient = 0
            while not done.is_set() or not seen:
                try:
                    data = store.get("atomic")
                except StoreError as exc:
                    # A remote store may answer "try again"; that is allowed, within reason.
                    transient += 1
                    if exc.retryable and transient < 1000:
                        continue
                    errors.append(f"get failed during overwrites: {exc!r}")
                    return
                except Exception as exc:
                    errors.append(f"get failed during overwrites: {exc!r}")
                    return
                v = data[0] if data else -1
                if v < 1 or data != versions[v - 1]:
                    errors.append(f"partial or mixed object: {len(data)} bytes, first byte {v}")
                    return
                seen.append(v)

        thread = threading.Thread(target=reader)
        thread.start()
        try:
            for data in versions[1:]:
                store.put("atomic", data)
        finally:
            done.set()
            thread.join(60)
        assert not thread.is_alive(), "the reader thread hangs"
        assert not errors, errors[0]
        assert seen
        assert store.get("atomic") == versions[-1]

    # ---- threads ------------------------------------------------------------------------------

    def test_concurrent_readers_in_threads(self, store: Store) -> None:
        data = payload(100_000, seed=9)
        store.put("threads/obj", data)
        rng = random.Random(9)
        jobs = []
        for _ in range(400):
            start = rng.randrange(len(data))
            jobs.append((start, min(len(data), start + rng.randrange(1, 5000))))

        def read(job: tuple[int, int]) -> bool:
            return store.get("threads/obj", ByteRange(*job)) == data[job[0] : job[1]]

        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(read, jobs))

    def test_close_keeps_the_store_usable(self, store: Store) -> None:
        store.put("c", b"1")
        store.close()
        assert store.get("c") == b"1"
        with store as same:
            assert same is store
        assert store.get("c") == b"1"

    # ---- read-only mode -----------------------------------------------------------------------

    def test_read_only_view_refuses_writes(self, store: Store) -> None:
        store.put("ro/obj", b"content")
        view = self.read_only_view(store)
        if view is None:
            pytest.skip(f"{type(self).__name__} defines no read_only_view")
        assert not view.supports_writes
        assert view.get("ro/obj") == b"content"
        assert view.head("ro/obj").size == 7
        calls: dict[str, Callable[[], object]] = {
            "put": lambda: view.put("ro/obj", b"x"),
            "put new": lambda: view.put("ro/new", b"x"),
            "put_text": lambda: view.put_text("ro/new", "x"),
            "open_writer": lambda: view.open_writer("ro/new"),
            "delete": lambda: view.delete("ro/obj"),
        }
        for name, call in calls.items():
            with pytest.raises(ReadOnlyStoreError) as info:
                call()
            assert isinstance(info.value, PermissionError), name
        assert store.get("ro/obj") == b"content"
        assert not store.exists("ro/new")
