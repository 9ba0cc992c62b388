"""The streamed-write, streamed-read and convenience tests of
:class:`~fastload.testing.store.StoreTests` (a part of the suite; subclass ``StoreTests``)."""

from __future__ import annotations

import io
import uuid

import pytest

from fastload.storage import MemoryStore, ObjectWriter, Store
from fastload.testing._store_common import payload


def _write_then_fail(writer: ObjectWriter, data: bytes) -> None:
    with writer:
        writer.write(data)
        raise RuntimeError("boom")


class StreamTests:
    """``open_writer``, ``open_reader`` and the conveniences built on them (a part of
    :class:`~fastload.testing.store.StoreTests`, which provides the ``store`` fixture)."""

    # ---- streamed writes ----------------------------------------------------------------------

    def test_open_writer_commits_on_success(self, store: Store) -> None:
        parts = [payload(1000, seed=i) for i in range(5)]
        with store.open_writer("stream/obj") as writer:
            for part in parts:
                assert writer.write(part) == len(part)
                assert not store.exists("stream/obj"), "visible before commit"
            writer.write(b"")
            assert writer.tell() == 5000
            if store.supports_listing:
                assert store.list_keys() == []
        assert writer.closed
        assert store.get("stream/obj") == b"".join(parts)

    def test_open_writer_accepts_memoryview(self, store: Store) -> None:
        with store.open_writer("mv") as writer:
            writer.write(memoryview(b"abcdef")[1:4])
            writer.write(bytearray(b"xyz"))
        assert store.get("mv") == b"bcdxyz"

    def test_open_writer_exception_leaves_nothing(self, store: Store) -> None:
        writer = store.open_writer("fail/new")
        with pytest.raises(RuntimeError, match="boom"):
            _write_then_fail(writer, b"partial data")
        assert writer.closed
        assert not store.exists("fail/new")
        # Over an existing object, the old object stays whole.
        store.put("fail/old", b"old content")
        with pytest.raises(RuntimeError, match="boom"):
            _write_then_fail(store.open_writer("fail/old"), b"new")
        assert store.get("fail/old") == b"old content"
        if store.supports_listing:
            assert store.list_keys() == ["fail/old"]

    def test_open_writer_abort(self, store: Store) -> None:
        writer = store.open_writer("aborted")
        writer.write(b"data")
        writer.abort()
        writer.abort()  # idempotent
        assert writer.closed
        assert not store.exists("aborted")
        with pytest.raises(ValueError, match="committed or aborted"):
            writer.write(b"more")
        writer.commit()  # a no-op once closed
        assert not store.exists("aborted")
        if store.supports_listing:
            assert store.list_keys() == []

    def test_open_writer_empty_object(self, store: Store) -> None:
        writer = store.open_writer("empty")
        writer.commit()
        assert store.get("empty") == b""

    # ---- streamed reads -----------------------------------------------------------------------

    def test_open_reader_streams_and_seeks(self, store: Store) -> None:
        data = payload(300_000, seed=5)
        store.put("reader", data)
        with store.open_reader("reader", chunk_size=4096) as reader:
            assert reader.readable()
            assert reader.read(10) == data[:10]
            chunks = [reader.read(50_000)]
            assert reader.tell() == 50_010
            chunks.append(reader.read())
            assert data[10:] == b"".join(chunks)
            assert reader.read(5) == b""
            assert reader.seekable()
            assert reader.seek(1234) == 1234
            assert reader.read(100) == data[1234:1334]
            assert reader.seek(-100, io.SEEK_END) == len(data) - 100
            assert reader.read() == data[-100:]
            reader.seek(10)
            assert reader.seek(5, io.SEEK_CUR) == 15
            buf = bytearray(20)
            assert reader.readinto(buf) == 20
            assert bytes(buf) == data[15:35]

    def test_open_reader_empty_object(self, store: Store) -> None:
        store.put("empty", b"")
        with store.open_reader("empty") as reader:
            assert reader.read() == b""

    # ---- conveniences -------------------------------------------------------------------------

    def test_conveniences(self, store: Store) -> None:
        store.put_text("t/text", "grüße ✓")
        assert store.get("t/text") == "grüße ✓".encode()
        assert store.get_text("t/text") == "grüße ✓"
        store.put_text("t/latin", "é", encoding="latin-1")
        assert store.get("t/latin") == b"\xe9"
        assert store.get_text("t/latin", encoding="latin-1") == "é"
        assert store.exists("t/text")
        assert not store.exists("t/none")
        assert store.size("t/text") == len("grüße ✓".encode())
        if store.supports_listing:
            assert store.list_keys("t/") == ["t/latin", "t/text"]
        path = store.local_path("t/text")
        if store.has_local_paths:
            assert path is not None
            with open(path, "rb") as f:
                assert f.read() == "grüße ✓".encode()
        else:
            assert path is None

    def test_copy_to_between_stores(self, store: Store) -> None:
        data = payload(100_000, seed=6)
        other = MemoryStore(f"copy-{uuid.uuid4().hex}")
        try:
            store.put("src/obj", data)
            assert store.copy_to("src/obj", other, chunk_size=7000) == len(data)
            assert other.get("src/obj") == data
            other.put("incoming", data[::-1])
            assert other.copy_to("incoming", store, "dst/in", chunk_size=6000) == len(data)
            assert store.get("dst/in") == data[::-1]
            assert store.copy_to("src/obj", store, "same/copy") == len(data)
            assert store.get("same/copy") == data
        finally:
            other.delete_many(other.list_keys())
