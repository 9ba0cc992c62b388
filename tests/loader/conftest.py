"""Fixtures for loader tests: a tiny in-memory shard format ("fakefmt") over a MemoryStore.

A fakefmt shard is a msgpack list of samples. A sample with a ``corrupt`` field raises
CorruptDataError when read (or is skipped under the reader's skip policy), which lets tests
exercise the error policies without a real format.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest

from fastload.errors import CorruptDataError
from fastload.formats import Manifest, ShardEntry, write_manifest
from fastload.formats._base import FORMATS, Format, ShardInfo, ShardReader, ShardWriter
from fastload.loader import Dataset, open_dataset
from fastload.storage import MemoryStore, Store

FAKE = "fakefmt"


class FakeWriter(ShardWriter):
    def __init__(self, store: Store, key: str, *, index: bool = True) -> None:
        super().__init__(store, key, index=index)
        self.samples: list[dict[str, Any]] = []

    def write(self, sample: Mapping[str, Any]) -> None:
        self._count_fields(sample)
        self.samples.append(dict(sample))

    @property
    def num_bytes(self) -> int:
        return len(msgpack.packb(self.samples))

    def close(self) -> ShardInfo:
        data = msgpack.packb(self.samples, use_bin_type=True)
        self.store.put(self.key, data)
        return ShardInfo(
            self.key, len(self.samples), len(data), hashlib.sha256(data).hexdigest(), None
        )

    def abort(self) -> None:
        self.samples = []


class FakeReader(ShardReader):
    supports_random_access = True
    opened = itertools.count()

    def __init__(self, store: Store, key: str, **kw: Any) -> None:
        super().__init__(store, key, **kw)
        next(FakeReader.opened)
        self._samples: list[dict[str, Any]] | None = None

    def _load(self) -> list[dict[str, Any]]:
        if self._samples is None:
            self._samples = msgpack.unpackb(self.store.get(self.key), raw=False)
        return self._samples

    def _sample(self, i: int) -> dict[str, Any]:
        s = dict(self._load()[i])
        if "corrupt" in s:
            raise CorruptDataError("fake corruption", url=self.url, key=s["__key__"])
        s["__url__"] = self.url
        s["__index__"] = i
        return s

    def __len__(self) -> int:
        return len(self._load())

    def read(self, i: int) -> dict[str, Any]:
        return self._sample(i)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(len(self)):
            try:
                yield self._sample(i)
            except CorruptDataError as exc:
                self.policy.handle(exc)


class SequentialFakeReader(FakeReader):
    """Same shards, but without random access (exercises the sequential fallback)."""

    supports_random_access = False

    def read(self, i: int) -> dict[str, Any]:
        raise AssertionError("read() must not be called without random access")


FORMATS.register(FAKE, Format(FAKE, "fake", FakeWriter, FakeReader))
FORMATS.register("fakeseq", Format("fakeseq", "fake", FakeWriter, SequentialFakeReader))

_names = itertools.count()


def key_of(shard: int, pos: int) -> str:
    return f"s{shard:03d}/k{pos:05d}"


def build_store(
    sizes: Sequence[int],
    *,
    fmt: str = FAKE,
    corrupt: Callable[[int, int], bool] | None = None,
    extra: Callable[[int, int], dict[str, Any]] | None = None,
) -> MemoryStore:
    """A memory store holding a fakefmt dataset with shards of the given sizes."""
    store = MemoryStore(f"loader-test-{next(_names)}")
    entries = []
    for s, n in enumerate(sizes):
        w = FakeWriter(store, f"shard-{s:06d}.fake")
        for p in range(n):
            sample: dict[str, Any] = {"__key__": key_of(s, p), "cls": str(s * 1000 + p).encode()}
            if extra is not None:
                sample.update(extra(s, p))
            if corrupt is not None and corrupt(s, p):
                sample["corrupt"] = b"1"
            w.write(sample)
        entries.append(ShardEntry.from_info(w.close()))
    write_manifest(store, Manifest(format=fmt, shards=entries))
    return store


def build_format_dataset(
    root: str, sizes: Sequence[int], fmt: str = "webdataset", payload: int = 16
) -> str:
    """A local dataset in a real shard format (with indexes and a manifest); returns its path."""
    from fastload.formats import get_format
    from fastload.storage import LocalStore

    store = LocalStore(root)
    f = get_format(fmt)
    entries = []
    for s, n in enumerate(sizes):
        w = f.writer(store, f"train-{s:06d}.{f.extension}")
        for p in range(n):
            w.write(
                {"__key__": key_of(s, p), "cls": s * 1000 + p, "bin": bytes([p % 256]) * payload}
            )
        entries.append(ShardEntry.from_info(w.close()))
    write_manifest(store, Manifest(format=f.name, shards=entries))
    return root


def all_keys(sizes: Sequence[int]) -> list[str]:
    return [key_of(s, p) for s, n in enumerate(sizes) for p in range(n)]


def keys_collate(samples: list[Any]) -> list[str]:
    """Collate to the list of sample keys (module level: picklable)."""
    return [s["__key__"] for s in samples]


def make_dataset(sizes: Sequence[int], **kw: Any) -> Dataset:
    store_kw = {k: kw.pop(k) for k in ("fmt", "corrupt", "extra") if k in kw}
    return open_dataset(build_store(sizes, **store_kw), **kw)


@pytest.fixture(scope="session")
def fake() -> SimpleNamespace:
    """Helpers for tests (test modules cannot import conftest under --import-mode=importlib)."""
    return SimpleNamespace(
        make_dataset=make_dataset,
        build_store=build_store,
        build_format_dataset=build_format_dataset,
        all_keys=all_keys,
        key_of=key_of,
        keys_collate=keys_collate,
        FakeReader=FakeReader,
    )
