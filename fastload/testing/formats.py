"""Conformance suite every shard format passes.

Subclass :class:`ShardFormatTests` and set :attr:`~ShardFormatTests.format_name`::

    class TestWebDataset(ShardFormatTests):
        format_name = "webdataset"

The suite checks the contract in :mod:`fastload.formats._base`: lossless round trips of the sample
model (hypothesis-generated keys and fields), deterministic bytes, truthful :class:`ShardInfo`,
nothing visible before ``close`` or after ``abort``, the reader options every format takes, random
access equal to streaming, indexes equal to what ``build_index`` derives from the shard, and format
detection.
"""

from __future__ import annotations

import hashlib
import string
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastload.errors import InvalidArgumentError
from fastload.formats import Format, ShardReader, get_format
from fastload.storage import LocalStore, MemoryStore, Store

__all__ = ["ShardFormatTests", "sample_lists"]

_SEGMENT = st.text(
    alphabet=st.characters(
        categories=("L", "N"), include_characters="-_", exclude_characters="./\x00"
    ),
    min_size=1,
    max_size=12,
)
_KEY = st.lists(_SEGMENT, min_size=1, max_size=3).map("/".join)
_FIELD = st.sampled_from(["jpg", "cls", "json", "txt", "npy", "bin", "seg.png", "meta.json"])
_VALUE = st.one_of(
    st.binary(max_size=64),
    st.just(b""),
    st.binary(min_size=1000, max_size=5000),
)


@st.composite
def sample_lists(draw: st.DrawFn, max_samples: int = 12) -> list[dict[str, Any]]:
    """Lists of samples with unique keys and raw bytes fields (the sample model at rest)."""
    keys = draw(st.lists(_KEY, min_size=1, max_size=max_samples, unique=True))
    samples = []
    for key in keys:
        fields = draw(st.lists(_FIELD, min_size=1, max_size=4, unique=True))
        sample: dict[str, Any] = {"__key__": key}
        for name in fields:
            sample[name] = draw(_VALUE)
        samples.append(sample)
    return samples


def _fields(sample: dict[str, Any]) -> dict[str, bytes]:
    return {k: bytes(v) for k, v in sample.items() if not k.startswith("__")}


class ShardFormatTests:
    """The shared tests; a subclass sets :attr:`format_name`."""

    format_name: ClassVar[str]
    #: Set False for formats whose shard bytes are legitimately not reproducible.
    deterministic_bytes: ClassVar[bool] = True

    @property
    def fmt(self) -> Format:
        return get_format(self.format_name)

    @pytest.fixture(params=["memory", "local"])
    def store(self, request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Store]:
        if request.param == "memory":
            yield MemoryStore(f"fmt-{self.format_name}-{id(request)}-{request.node.name}")
        else:
            yield LocalStore(tmp_path / "store")

    def shard_key(self, n: int = 0) -> str:
        return f"ds/shard-{n:06d}.{self.fmt.extension}"

    def write(self, store: Store, samples: list[dict[str, Any]], n: int = 0) -> Any:
        writer = self.fmt.writer(store, self.shard_key(n))
        for sample in samples:
            writer.write(sample)
        return writer.close()

    def reader(self, store: Store, n: int = 0) -> ShardReader:
        return self.fmt.reader(store, self.shard_key(n))

    # ---- round trips --------------------------------------------------------------------------

    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
    @given(samples=sample_lists())
    def test_round_trip_is_lossless(self, samples: list[dict[str, Any]]) -> None:
        store = MemoryStore(f"fmt-rt-{self.format_name}")
        for meta in list(store.list()):
            store.delete(meta.key)
        self.write(store, samples)
        with self.reader(store) as reader:
            got = list(reader)
        assert [s["__key__"] for s in got] == [s["__key__"] for s in samples]
        assert [_fields(s) for s in got] == [_fields(s) for s in samples]
        assert [s["__index__"] for s in got] == list(range(len(samples)))
        assert all(s["__url__"] == store.child_url(self.shard_key()) for s in got)

    def test_python_values_are_encoded(self, store: Store) -> None:
        self.write(store, [{"__key__": "a", "cls": 7, "txt": "héllo", "json": {"b": [1, 2]}}])
        (got,) = list(self.reader(store))
        assert got["cls"] == b"7"
        assert got["txt"] == "héllo".encode()
        assert got["json"] == b'{"b":[1,2]}'

    def test_large_field(self, store: Store) -> None:
        big = hashlib.sha256(b"x").digest() * (3 * 1024 * 1024 // 32)
        self.write(store, [{"__key__": "big", "bin": big}, {"__key__": "small", "bin": b"1"}])
        got = list(self.reader(store))
        assert got[0]["bin"] == big
        assert got[1]["bin"] == b"1"

    def test_unicode_and_nested_keys(self, store: Store) -> None:
        keys = ["ünïcödé", "a/b/c", "日本語/画像_01", "x-y_z"]
        self.write(store, [{"__key__": k, "txt": k.encode()} for k in keys])
        got = list(self.reader(store))
        assert [s["__key__"] for s in got] == keys
        assert [s["txt"] for s in got] == [k.encode() for k in keys]

    def test_reader_takes_the_common_options(self, store: Store) -> None:
        """Every reader accepts :class:`~fastload.formats.ReaderOptions` by keyword, and refuses
        an unknown ``on_error`` (checked by :class:`~fastload.formats._base.ErrorPolicy`)."""
        samples = [{"__key__": f"k{i}", "bin": bytes([i]) * 10} for i in range(3)]
        info = self.write(store, samples)
        key = self.shard_key()
        with self.fmt.reader(
            store,
            key,
            on_error="warn",
            index_key=None,
            num_samples=info.num_samples,
            num_bytes=info.num_bytes,
        ) as reader:
            assert [s["__key__"] for s in reader] == ["k0", "k1", "k2"]
        with pytest.raises(
            InvalidArgumentError, match="on_error must be 'raise', 'skip' or 'warn'"
        ):
            self.fmt.reader(store, key, on_error="ignore")  # type: ignore[arg-type]

    # ---- what the writer reports and publishes -------------------------------------------------

    def test_shard_info_is_truthful(self, store: Store) -> None:
        samples = [{"__key__": f"k{i:03d}", "bin": bytes([i]) * i, "cls": i} for i in range(20)]
        info = self.write(store, samples)
        data = store.get(info.key)
        assert info.key == self.shard_key()
        assert info.num_samples == 20
        assert info.num_bytes == len(data)
        assert info.sha256 == hashlib.sha256(data).hexdigest()
        assert info.fields == {"bin": 20, "cls": 20}
        if info.index_key is not None:
            assert store.exists(info.index_key)
            if self.fmt.build_index is not None:
                assert self.fmt.build_index(store, info.key) == store.get(info.index_key)

    def test_deterministic_bytes(self, tmp_path: Any) -> None:
        if not self.deterministic_bytes:
            pytest.skip(f"{self.format_name} does not promise byte-identical shards")
        samples = [
            {"__key__": f"k{i}", "txt": string.ascii_letters * i, "cls": i} for i in range(9)
        ]
        a, b = LocalStore(tmp_path / "a"), LocalStore(tmp_path / "b")
        info_a, info_b = self.write(a, samples), self.write(b, samples)
        assert a.get(info_a.key) == b.get(info_b.key)
        assert info_a.sha256 == info_b.sha256

    def test_nothing_visible_before_close_or_after_abort(self, store: Store) -> None:
        writer = self.fmt.writer(store, self.shard_key())
        for i in range(5):
            writer.write({"__key__": f"k{i}", "bin": b"x" * 100})
        assert store.list_keys("ds/") == []
        writer.abort()
        assert store.list_keys("ds/") == []

        def fail_midway() -> None:
            with self.fmt.writer(store, self.shard_key(1)) as w:
                w.write({"__key__": "k", "bin": b"x"})
                raise RuntimeError("boom")

        with pytest.raises(RuntimeError):
            fail_midway()
        assert store.list_keys("ds/") == []

    def test_num_bytes_grows(self, store: Store) -> None:
        writer = self.fmt.writer(store, self.shard_key())
        before = writer.num_bytes
        for i in range(10):
            writer.write({"__key__": f"k{i}", "bin": b"y" * 10_000})
        assert writer.num_bytes >= before + 100_000 or writer.num_bytes >= 100_000
        writer.abort()

    def test_missing_key_is_rejected(self, store: Store) -> None:
        writer = self.fmt.writer(store, self.shard_key())
        with pytest.raises(ValueError, match="__key__"):
            writer.write({"bin": b"x"})
        writer.abort()

    # ---- random access ------------------------------------------------------------------------

    def test_random_access_equals_streaming(self, store: Store) -> None:
        samples = [
            {"__key__": f"s{i:04d}", "bin": bytes([i % 256]) * (i * 37 % 500)} for i in range(40)
        ]
        self.write(store, samples)
        reader = self.reader(store)
        if not reader.supports_random_access:
            pytest.skip(f"{self.format_name} reader has no random access")
        streamed = list(reader)
        assert len(reader) == 40
        for i in (0, 1, 17, 39):
            got = reader.read(i)
            assert got["__key__"] == streamed[i]["__key__"]
            assert _fields(got) == _fields(streamed[i])
        tail = list(reader.iter_from(33))
        assert [s["__key__"] for s in tail] == [f"s{i:04d}" for i in range(33, 40)]
        reader.close()

    # ---- detection ----------------------------------------------------------------------------

    def test_detect_recognises_own_shards_only(self, store: Store) -> None:
        if self.fmt.detect is None:
            pytest.skip(f"{self.format_name} has no detector")
        self.write(store, [{"__key__": "a", "bin": b"123"}])
        head = store.get(self.shard_key())[:4096]
        assert self.fmt.detect(head)
        assert not self.fmt.detect(b"\x00" * 4096)
        assert not self.fmt.detect(b'{"json": "text"}\n' * 64)
