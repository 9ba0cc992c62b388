"""In-process store, for tests and scratch data: ``memory://name``.

Stores opened with the same name in one process share their objects. A pickled memory store
carries its objects with it (a DataLoader worker gets a snapshot), so keep them small.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Iterator
from typing import Any

from fastload.errors import InvalidArgumentError, ObjectNotFoundError
from fastload.storage._base import ObjectWriter, Store
from fastload.storage._keys import ByteRange, ObjectMeta, check_range, validate_key, validate_prefix

__all__ = ["MemoryStore"]


class _Bucket:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.objects: dict[str, tuple[bytes, float, int]] = {}  # key -> (data, mtime, version)
        self.keys: list[str] = []  # sorted
        self.version = 0

    def set(self, key: str, data: bytes) -> None:
        with self.lock:
            self.version += 1
            if key not in self.objects:
                bisect.insort(self.keys, key)
            self.objects[key] = (data, time.time(), self.version)


_BUCKETS: dict[str, _Bucket] = {}
_BUCKETS_LOCK = threading.Lock()


def _bucket(name: str) -> _Bucket:
    with _BUCKETS_LOCK:
        return _BUCKETS.setdefault(name, _Bucket())


class _MemoryWriter(ObjectWriter):
    def __init__(self, store: MemoryStore, key: str) -> None:
        super().__init__()
        self._store, self._key = store, key
        self._parts: list[bytes] = []

    def _write(self, data: memoryview) -> None:
        self._parts.append(bytes(data))

    def _commit(self) -> None:
        self._store._bucket.set(self._key, b"".join(self._parts))
        self._parts = []

    def _abort(self) -> None:
        self._parts = []


class MemoryStore(Store):
    """Objects in a process-wide dict, named by ``memory://name``.

    Args:
        name: Stores with the same name in one process share objects.
        read_only: Refuse writes.

    A pickled copy unpickled in another process carries a snapshot of the objects at pickling
    time (:attr:`shared_across_processes` is False): what a worker process writes stays there.
    """

    shared_across_processes = False

    def __init__(self, name: str = "default", *, read_only: bool = False) -> None:
        super().__init__(read_only=read_only)
        self._name = name
        self._bucket = _bucket(name)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> MemoryStore:
        if not url.startswith("memory://"):
            raise InvalidArgumentError(f"not a memory:// URL: {url!r}")
        return cls(url[len("memory://") :].strip("/") or "default", **options)

    @property
    def url(self) -> str:
        return f"memory://{self._name}"

    def __reduce__(self) -> tuple[Any, ...]:
        with self._bucket.lock:
            snapshot = {k: v[0] for k, v in self._bucket.objects.items()}
        return (_rebuild, (self._name, self._read_only, snapshot))

    def _lookup(self, key: str) -> tuple[bytes, float, int]:
        validate_key(key, url=self.url)
        try:
            return self._bucket.objects[key]
        except KeyError:
            where = self.child_url(key)
            raise ObjectNotFoundError(f"no object {where}", url=where) from None

    def get(self, key: str, byte_range: ByteRange | None = None) -> bytes:
        data = self._lookup(key)[0]
        if byte_range is None:
            return data
        check_range(byte_range, len(data), url=self.child_url(key))
        return data[byte_range.start : byte_range.end]

    def head(self, key: str) -> ObjectMeta:
        data, mtime, version = self._lookup(key)
        return ObjectMeta(key, len(data), mtime, f"v{version}")

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        validate_prefix(prefix, url=self.url)
        with self._bucket.lock:
            keys = self._bucket.keys
            lo = bisect.bisect_left(keys, prefix)
            selected = []
            for key in keys[lo:]:
                if not key.startswith(prefix):
                    break
                data, mtime, version = self._bucket.objects[key]
                selected.append(ObjectMeta(key, len(data), mtime, f"v{version}"))
        yield from selected

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        self._check_writable(key)
        validate_key(key, url=self.url)
        self._bucket.set(key, bytes(data))

    def open_writer(self, key: str) -> ObjectWriter:
        self._check_writable(key)
        validate_key(key, url=self.url)
        return _MemoryWriter(self, key)

    def delete(self, key: str) -> None:
        self._check_writable(key)
        self._lookup(key)
        with self._bucket.lock:
            if self._bucket.objects.pop(key, None) is not None:
                i = bisect.bisect_left(self._bucket.keys, key)
                del self._bucket.keys[i]


def _rebuild(name: str, read_only: bool, snapshot: dict[str, bytes]) -> MemoryStore:
    store = MemoryStore(name, read_only=read_only)
    bucket = store._bucket
    for key, data in snapshot.items():
        if key not in bucket.objects:
            bucket.set(key, data)
    return store
