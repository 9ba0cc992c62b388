"""open_store: one registry from URL scheme to backend, with install hints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fastload import open_store
from fastload.errors import InvalidArgumentError, MissingDependencyError, UnknownSchemeError
from fastload.storage import LocalStore, MemoryStore, _registry, known_schemes, register_store


@pytest.fixture(autouse=True)
def _restore_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations made by a test vanish after it."""
    monkeypatch.setattr(_registry.STORES, "_entries", dict(_registry.STORES._entries))
    monkeypatch.setattr(_registry.STORES, "_aliases", dict(_registry.STORES._aliases))


def test_builtin_schemes() -> None:
    schemes = known_schemes()
    assert schemes == sorted(schemes)
    assert {"file", "memory", "s3", "hdfs"} <= set(schemes)


def test_open_store_picks_backends(tmp_path: Path) -> None:
    assert isinstance(open_store(tmp_path), LocalStore)
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    assert isinstance(open_store(f"file://{tmp_path}"), LocalStore)
    assert isinstance(open_store(f"FILE://{tmp_path}"), LocalStore)  # schemes are case-blind
    memory = open_store("memory://registry-test")
    assert isinstance(memory, MemoryStore)
    assert memory.url == "memory://registry-test"


def test_unknown_scheme_lists_the_known_ones() -> None:
    with pytest.raises(UnknownSchemeError) as info:
        open_store("gopher://host/data")
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "'gopher'" in message
    for scheme in ("file", "memory", "s3", "hdfs"):
        assert scheme in message
    assert "Plain local paths need no scheme" in message


def test_register_store_with_a_class() -> None:
    class Custom(MemoryStore):
        opened: list[tuple[str, dict[str, Any]]] = []

        @classmethod
        def from_url(cls, url: str, **options: Any) -> Custom:
            cls.opened.append((url, options))
            return cls(url.split("://", 1)[1])

    register_store("custom", Custom)
    assert "custom" in known_schemes()
    store = open_store("custom://bucket/x", flavour="vanilla")
    assert isinstance(store, Custom)
    assert Custom.opened == [("custom://bucket/x", {"flavour": "vanilla"})]


def test_register_store_with_a_lazy_path() -> None:
    register_store("mem2", "fastload.storage._memory:MemoryStore")
    with pytest.raises(InvalidArgumentError, match="not a memory:// URL"):
        open_store("mem2://x")  # the class was imported and asked; it refuses foreign URLs


def test_missing_module_gives_an_install_hint() -> None:
    register_store("fancy", "fastload_no_such_module_xyz:FancyStore", extra="fancy")
    with pytest.raises(MissingDependencyError) as info:
        open_store("fancy://bucket")
    assert isinstance(info.value, ImportError)
    assert "pip install 'fastload[fancy]'" in str(info.value)
    assert isinstance(info.value.__cause__, ImportError)


def test_missing_third_party_dependency_gives_an_install_hint() -> None:
    register_store(
        "fancier",
        "fastload.storage._memory:MemoryStore",
        extra="fancier",
        modules=("no_such_client_library_xyz",),
    )
    with pytest.raises(MissingDependencyError, match=r"pip install 'fastload\[fancier\]'") as info:
        open_store("fancier://bucket")
    assert "no_such_client_library_xyz" in str(info.value)


def test_entry_point_plugins_are_found(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib.metadata import EntryPoint

    from fastload import _plugins

    def fake_entry_points(group: str) -> list[EntryPoint]:
        assert group == "fastload.stores"
        return [EntryPoint("thirdparty", "fastload.storage._memory:MemoryStore", group)]

    monkeypatch.setattr(_plugins, "entry_points", fake_entry_points)
    monkeypatch.setattr(_registry.STORES, "_loaded_entry_points", False)
    assert "thirdparty" in known_schemes()
    with pytest.raises(InvalidArgumentError, match="not a memory:// URL"):
        open_store("thirdparty://x")  # the entry point's class was imported and asked


# ---- cross-cutting wrappers: one place, one order ----------------------------------------------


def test_wrappers_stack_in_the_documented_order(tmp_path: Path) -> None:
    from fastload.storage import CachingStore, LimitStore, RetryConfig, RetryStore

    config = RetryConfig(max_retries=3)
    store = open_store(
        tmp_path / "data",
        retry=config,
        cache_dir=tmp_path / "cache",
        cache_size="1MB",
        max_concurrency=2,
    )
    assert isinstance(store, CachingStore)
    assert store.cache_dir == str(tmp_path / "cache")
    retry = store.inner
    assert isinstance(retry, RetryStore)
    assert retry.config is config
    limit = retry.inner
    assert isinstance(limit, LimitStore)
    assert limit.max_concurrency == 2
    assert isinstance(limit.inner, LocalStore)
    assert store.url == limit.inner.url  # wrappers report the backend's URL


def test_retry_default_follows_the_backend(tmp_path: Path) -> None:
    from fastload.storage import RetryConfig, RetryStore
    from fastload.storage._hdfs import HDFSStore
    from fastload.storage._s3 import S3Store

    # Local and memory stores do not fail transiently: no retry wrapper unless asked for.
    assert isinstance(open_store(tmp_path), LocalStore)
    assert isinstance(open_store("memory://retry-default"), MemoryStore)
    assert isinstance(open_store(tmp_path, retry=True), RetryStore)
    # Network stores retry by default; retry=False gives the bare backend.
    for url, backend in (("s3://bkt/p", S3Store), ("hdfs://nn:8020/p", HDFSStore)):
        store = open_store(url)
        assert isinstance(store, RetryStore)
        assert isinstance(store.inner, backend)
        assert store.config == RetryConfig()
        assert isinstance(open_store(url, retry=False), backend)
        custom = open_store(url, retry=RetryConfig(retry_timeout=5.0))
        assert isinstance(custom, RetryStore)
        assert custom.config.retry_timeout == 5.0


def test_plugin_backends_choose_their_retry_default() -> None:
    from fastload.storage import RetryStore

    class Flaky(MemoryStore):
        default_retry = True

        @classmethod
        def from_url(cls, url: str, **options: Any) -> Flaky:
            return cls(url.split("://", 1)[1])

    register_store("flaky", Flaky)
    store = open_store("flaky://x")
    assert isinstance(store, RetryStore)
    assert isinstance(store.inner, Flaky)


def test_wrapper_options_are_validated(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="RetryConfig"):
        open_store(tmp_path, retry="yes")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="max_concurrency"):
        open_store(tmp_path, max_concurrency=0)
    with pytest.raises(InvalidArgumentError, match="cannot parse size"):
        open_store(tmp_path, cache_dir=tmp_path / "c", cache_size="lots")


def test_the_cached_stack_reads_writes_and_pickles(tmp_path: Path) -> None:
    import pickle

    from fastload.storage import CachingStore

    store = open_store(tmp_path / "data", retry=True, cache_dir=tmp_path / "cache")
    store.put("a/b.bin", b"payload")
    assert store.get("a/b.bin") == b"payload"
    assert isinstance(store, CachingStore)
    assert store.stats()["misses"] == 1
    path = store.local_path("a/b.bin")
    assert path is not None
    assert path.startswith(str(tmp_path / "cache"))
    clone = pickle.loads(pickle.dumps(store))
    assert isinstance(clone, CachingStore)
    assert clone.get("a/b.bin") == b"payload"
    assert clone.stats()["hits"] == 1  # the copy in the cache directory is shared


def test_wrap_store_adds_nothing_by_default(tmp_path: Path) -> None:
    from fastload.storage import wrap_store

    local = LocalStore(tmp_path)
    assert wrap_store(local) is local
    with pytest.raises(InvalidArgumentError, match="Store"):
        wrap_store("not a store")  # type: ignore[arg-type]


def test_unknown_backend_option_is_a_clear_error(tmp_path: Path) -> None:
    # `fastload verify ./ds --store-option endpoint_url=...`: not a TypeError with a traceback
    with pytest.raises(InvalidArgumentError) as info:
        open_store(tmp_path, endpoint_url="http://127.0.0.1:7480")
    assert str(info.value) == (
        f"unknown file store option 'endpoint_url' for {tmp_path}; accepted: read_only, fsync, "
        "and for every store retry, cache_dir, cache_size, max_concurrency"
    )
    assert isinstance(info.value.__cause__, TypeError)
    assert open_store(tmp_path, read_only=True).supports_writes is False
