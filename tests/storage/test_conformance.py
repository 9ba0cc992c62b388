"""Every store backend and wrapper of this package passes the shared conformance suite."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fastload.storage import LimitStore, LocalStore, MemoryStore, RetryStore, Store, WrapperStore
from fastload.testing.store import StoreTests


def _fresh_memory_store() -> MemoryStore:
    return MemoryStore(f"conformance-{uuid.uuid4().hex}")


class TestLocalStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return LocalStore(tmp_path / "root")

    def read_only_view(self, store: Store) -> Store | None:
        assert isinstance(store, LocalStore)
        return LocalStore(store.root, read_only=True)


class TestMemoryStore(StoreTests):
    @pytest.fixture
    def store(self) -> Iterator[Store]:
        store = _fresh_memory_store()
        yield store
        store.delete_many(store.list_keys())  # free the process-wide bucket's memory

    def read_only_view(self, store: Store) -> Store | None:
        return MemoryStore.from_url(store.url, read_only=True)


class TestRetryStoreOverLocal(StoreTests):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return RetryStore(LocalStore(tmp_path / "root"))

    def read_only_view(self, store: Store) -> Store | None:
        assert isinstance(store, RetryStore)
        assert isinstance(store.inner, LocalStore)
        return RetryStore(LocalStore(store.inner.root, read_only=True))


class TestLimitStoreOverMemory(StoreTests):
    """A limit of one slot: any operation that holds a slot while waiting for another deadlocks."""

    @pytest.fixture
    def store(self) -> Iterator[Store]:
        inner = _fresh_memory_store()
        yield LimitStore(inner, max_concurrency=1)
        inner.delete_many(inner.list_keys())

    def read_only_view(self, store: Store) -> Store | None:
        return LimitStore(MemoryStore.from_url(store.url, read_only=True), max_concurrency=1)


class TestRetryOverLimitOverLocal(StoreTests):
    """Wrappers compose."""

    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return RetryStore(LimitStore(LocalStore(tmp_path / "root"), max_concurrency=2))

    def read_only_view(self, store: Store) -> Store | None:
        assert isinstance(store, RetryStore)
        assert isinstance(store.inner, LimitStore)
        local = store.inner.inner
        assert isinstance(local, LocalStore)
        return RetryStore(LimitStore(LocalStore(local.root, read_only=True), max_concurrency=2))


class TestPlainWrapperOverLocal(StoreTests):
    """A wrapper that overrides nothing is indistinguishable from the store it wraps."""

    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return WrapperStore(LocalStore(tmp_path / "root"))

    def read_only_view(self, store: Store) -> Store | None:
        assert isinstance(store, WrapperStore)
        assert isinstance(store.inner, LocalStore)
        return WrapperStore(LocalStore(store.inner.root, read_only=True))
