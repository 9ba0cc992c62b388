"""LMDB shards: round trips, map growth, interop with py-lmdb + msgpack alone, fork safety, bad input."""

from __future__ import annotations

import errno
import gc
import hashlib
import multiprocessing
import os
import pickle
import shutil
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import lmdb
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastload.errors import (
    CorruptDataError,
    FormatError,
    InvalidArgumentError,
    ReadOnlyStoreError,
)
from fastload.formats import get_format
from fastload.formats.lmdb import LMDBReader, LMDBWriter, _reader, _sizing, _writer, detect
from fastload.formats.lmdb._layout import pack_value, value_parts
from fastload.storage import LocalStore, MemoryStore, ObjectWriter, Store

KEY = "ds/train-000000.lmdb"

_SEGMENT = st.text(
    alphabet=st.characters(exclude_characters="./\x00\r\n", exclude_categories=("Cs",)),
    min_size=1,
    max_size=10,
)
_KEYS = st.lists(st.lists(_SEGMENT, min_size=1, max_size=3).map("/".join), unique=True, max_size=8)
_FIELD_NAMES = st.lists(
    st.sampled_from(["jpg", "png", "cls", "txt", "json", "npy", "seg.png", "meta.json", "bin"]),
    unique=True,
    min_size=1,
    max_size=9,
)
_VALUES = st.one_of(
    st.just(b""),
    st.binary(max_size=50),
    st.binary(min_size=2000, max_size=4500),  # LMDB overflow pages
    st.integers(0, 255).map(lambda b: bytes([b]) * 300_000),  # large field
)


@st.composite
def _samples(draw: st.DrawFn) -> list[dict[str, Any]]:
    out = []
    for key in draw(_KEYS):
        sample: dict[str, Any] = {"__key__": key}
        for name in draw(_FIELD_NAMES):
            sample[name] = draw(_VALUES)
        out.append(sample)
    return out


def _fields(sample: dict[str, Any]) -> dict[str, bytes]:
    return {k: v for k, v in sample.items() if not k.startswith("__")}


def _write(store: Store, samples: list[dict[str, Any]], key: str = KEY, **options: Any) -> Any:
    writer = LMDBWriter(store, key, **options)
    for sample in samples:
        writer.write(sample)
    return writer.close()


@pytest.fixture(params=["local", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    return MemoryStore(f"lmdb-{request.node.name}")


def test_format_is_registered() -> None:
    fmt = get_format("lmdb")
    assert fmt.writer is LMDBWriter
    assert fmt.reader is LMDBReader
    assert fmt.extension == "lmdb"
    assert fmt.build_index is None
    assert get_format("mdb") is fmt


@pytest.mark.parametrize("kind", ["local", "memory"])
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(samples=_samples())
def test_round_trip(
    kind: str, tmp_path_factory: pytest.TempPathFactory, samples: list[Any]
) -> None:
    if kind == "local":
        store: Store = LocalStore(tmp_path_factory.mktemp("rt"))
    else:
        store = MemoryStore("lmdb-round-trip")
        store.delete_many(store.list_keys())
    writer = LMDBWriter(store, KEY)
    for sample in samples:
        writer.write(sample)
    info = writer.close()
    data = store.get(KEY)
    assert info.num_samples == len(samples)
    assert (info.num_bytes, info.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert info.index_key is None
    assert store.list_keys() == [KEY]  # no scratch files or index left behind

    reader = LMDBReader(store, KEY)
    got = list(reader)
    assert [s["__key__"] for s in got] == [s["__key__"] for s in samples]
    assert [_fields(s) for s in got] == [_fields(s) for s in samples]
    assert [list(_fields(s)) for s in got] == [list(_fields(s)) for s in samples]  # field order
    assert [s["__index__"] for s in got] == list(range(len(samples)))
    assert len(reader) == len(samples)
    for i, sample in enumerate(samples):
        assert _fields(reader.read(i)) == _fields(sample)
        by_key = reader.get_key(sample["__key__"])
        assert by_key["__key__"] == sample["__key__"]
        assert _fields(by_key) == _fields(sample)
    reader.close()


def test_insertion_order_is_kept_not_key_order(store: Store) -> None:
    keys = ["zebra", "apple", "mango", "b/2", "b/10", "Ähre"]
    _write(store, [{"__key__": k, "txt": k} for k in keys])
    with LMDBReader(store, KEY) as reader:
        assert [s["__key__"] for s in reader] == keys
        assert [s["__key__"] for s in reader.iter_from(4)] == keys[4:]
        assert list(reader.iter_from(6)) == []
        assert reader.read(-1)["txt"] == "Ähre".encode()
        with pytest.raises(IndexError):
            reader.read(6)
        with pytest.raises(KeyError):
            reader.get_key("pear")
        with pytest.raises(KeyError):
            reader.get_key("\x00fastload/meta")  # reserved keys are not samples


def test_empty_shard(store: Store) -> None:
    _write(store, [])
    with LMDBReader(store, KEY) as reader:
        assert len(reader) == 0
        assert list(reader) == []


def test_short_map_estimate_is_grown_and_rebuilt(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    samples = [{"__key__": f"s{i:04d}", "bin": os.urandom(20_000)} for i in range(300)]
    samples.append({"__key__": "huge", "bin": os.urandom(3 * 1024 * 1024)})  # > several maps
    expected = _write(MemoryStore("lmdb-map-reference"), samples)
    attempts: list[int] = []
    real_open = _writer._open_env

    def counting_open(path: str, map_size: int) -> Any:
        attempts.append(map_size)
        return real_open(path, map_size)

    monkeypatch.setattr(_sizing.PageCount, "bound", lambda self: 64 * 1024)
    monkeypatch.setattr(_writer, "_open_env", counting_open)
    info = _write(store, samples)
    assert attempts == [64 * 1024 * 2**i for i in range(len(attempts))]
    assert len(attempts) >= 7  # 64 KiB doubled until ~9 MB fit
    assert info.num_samples == 301
    with LMDBReader(store, KEY) as reader:
        got = list(reader)
    assert [s["bin"] for s in got] == [s["bin"] for s in samples]
    assert store.list_keys() == [KEY]
    # Only the recorded map size differs from a first-time build.
    assert info.num_bytes == expected.num_bytes


_DETERMINISM_SAMPLES = """
import random
rng = random.Random(7)
samples = [{"__key__": f"k{(i * 7) % 60}", "jpg": rng.randbytes(i * 997 % 9000)} for i in range(60)]
# Enough long keys for several levels of branch pages, which LMDB splits in halves.
samples += [{"__key__": f"tiny{i:05d}" + "-" * 120, "cls": i} for i in range(3000)]
"""

_WRITE_IN_CHILD = """
import sys
from fastload.formats.lmdb import LMDBWriter
from fastload.storage import LocalStore
writer = LMDBWriter(LocalStore(sys.argv[1]), sys.argv[2])
for sample in samples:
    writer.write(sample)
writer.close()
"""


def test_same_samples_give_identical_bytes_in_any_process_and_store(tmp_path: Path) -> None:
    scope: dict[str, Any] = {}
    exec(_DETERMINISM_SAMPLES, scope)
    samples: list[dict[str, Any]] = scope["samples"]
    a, b = LocalStore(tmp_path / "a"), MemoryStore("lmdb-determinism")
    info_a, info_b = _write(a, samples), _write(b, samples)
    # A fresh interpreter: another heap, other addresses, other hash seeds.
    subprocess.run(
        [sys.executable, "-c", _DETERMINISM_SAMPLES + _WRITE_IN_CHILD, str(tmp_path / "c"), KEY],
        check=True,
        timeout=120,
        env={**os.environ, "PYTHONHASHSEED": "123"},
    )
    data = a.get(KEY)
    assert data == b.get(KEY) == (tmp_path / "c" / KEY).read_bytes()
    assert info_a.sha256 == info_b.sha256 == hashlib.sha256(data).hexdigest()
    # Another insertion order is another shard (the positions differ), with the same samples.
    c = MemoryStore("lmdb-determinism-reversed")
    _write(c, samples[::-1])
    assert c.get(KEY) != data
    by_key = {s["__key__"]: _fields(s) for s in LMDBReader(a, KEY)}
    assert {s["__key__"]: _fields(s) for s in LMDBReader(c, KEY)} == by_key


def test_file_is_compact_with_the_meta_pages_the_readme_describes(tmp_path: Path) -> None:
    samples = [
        {"__key__": f"n{i % 7}/img_{i:05d}", "jpg": os.urandom(i * 131 % 7000)} for i in range(800)
    ]
    _write(LocalStore(tmp_path), samples)
    path = tmp_path / KEY
    raw = path.read_bytes()
    psize = os.sysconf("SC_PAGE_SIZE")
    metas = [struct.unpack_from("<QQ", raw, page * psize + 136) for page in (0, 1)]
    assert [txnid for _, txnid in metas] == [0, 1]
    last_pg = metas[1][0]
    assert len(raw) == (last_pg + 1) * psize
    env = lmdb.open(str(path), subdir=False, readonly=True, lock=False)
    try:
        stat = env.stat()
        assert stat["entries"] == 1 + 2 * len(samples)
        used = stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]
        assert used + 2 == last_pg + 1  # every page but the two meta pages is live: no free pages
        assert env.info()["map_size"] >= len(raw)
    finally:
        env.close()
    # Keys were appended in order, so leaf pages are full: the file is at most a few pages
    # larger than the entries' node bytes.
    pages = _sizing.PageCount(psize)
    pages.add(len(b"\x00fastload/meta"), 40, reserved=True)
    for s in samples:
        pages.add(len(s["__key__"].encode()), len(pack_value(_fields(s))))
        pages.add(22, len(s["__key__"].encode()), reserved=True)
    assert len(raw) <= pages.estimate() + 4 * psize


def test_num_bytes_estimates_the_published_size(tmp_path: Path) -> None:
    for size, count in ((30_000, 100), (40, 3000), (1500, 400)):
        store = LocalStore(tmp_path / str(size))
        writer = LMDBWriter(store, KEY)
        for i in range(count):
            writer.write({"__key__": f"k{i:05d}", "jpg": os.urandom(size), "cls": i})
        estimate = writer.num_bytes
        info = writer.close()
        assert 0.98 * info.num_bytes <= estimate <= 1.02 * info.num_bytes, size


@settings(max_examples=200, deadline=None)
@given(
    fields=st.dictionaries(
        st.text(min_size=1, max_size=300),
        st.one_of(st.binary(max_size=300), st.sampled_from([b"x" * 65_535, b"y" * 65_536])),
        max_size=20,
    )
)
def test_value_encoding_is_msgpacks(fields: dict[str, bytes]) -> None:
    assert pack_value(fields) == msgpack.packb(fields, use_bin_type=True)
    assert b"".join(value_parts(fields)) == pack_value(fields)


def test_many_fields_round_trip(store: Store) -> None:
    sample: dict[str, Any] = {"__key__": "wide"}
    sample.update({f"f{i}.bin": bytes([i]) * (i * 40) for i in range(40)})  # msgpack map16
    _write(store, [sample])
    with LMDBReader(store, KEY) as reader:
        got = reader.read(0)
    assert list(_fields(got)) == list(_fields(sample))
    assert _fields(got) == _fields(sample)


def test_fsync_path_publishes(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    samples = [{"__key__": f"k{i}", "bin": bytes([i]) * 5000} for i in range(10)]
    info = _write(store, samples, fsync=True)
    assert info.sha256 == hashlib.sha256(store.get(KEY)).hexdigest()
    assert os.listdir(tmp_path / "ds") == ["train-000000.lmdb"]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EOPNOTSUPP])
def test_space_reservation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    def no_space(fd: int, offset: int, size: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    store = LocalStore(tmp_path)
    writer = LMDBWriter(store, KEY)
    writer.write({"__key__": "a", "bin": b"1" * 10_000})
    if code == errno.ENOSPC:  # a full disk is an error before LMDB writes through its map
        with pytest.raises(OSError, match="No space") as info:
            writer.close()
        assert any("LMDB shard" in note for note in getattr(info.value, "__notes__", []))
        assert store.list_keys() == []
        assert os.listdir(tmp_path / "ds") == []
    else:  # a file system that cannot reserve space still gets its shard
        writer.close()
        assert LMDBReader(store, KEY).read(0)["bin"] == b"1" * 10_000


def test_bad_samples_are_rejected(store: Store) -> None:
    writer = LMDBWriter(store, KEY)
    writer.write({"__key__": "a", "bin": b"1"})
    with pytest.raises(InvalidArgumentError, match="already written"):
        writer.write({"__key__": "a", "bin": b"2"})
    with pytest.raises(InvalidArgumentError, match="511"):
        writer.write({"__key__": "k" * 600, "bin": b"2"})
    with pytest.raises(InvalidArgumentError):
        writer.write({"__key__": "nul\x00key", "bin": b"2"})
    writer.write({"__key__": "b", "bin": b"3"})
    writer.close()
    assert [s["__key__"] for s in LMDBReader(store, KEY)] == ["a", "b"]


def test_read_only_store_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ReadOnlyStoreError):
        LMDBWriter(LocalStore(tmp_path, read_only=True), KEY)
    assert list(tmp_path.iterdir()) == []


def test_abort_leaves_no_scratch_files(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    writer = LMDBWriter(store, KEY)
    writer.write({"__key__": "a", "bin": b"1" * 10_000})
    writer.abort()
    writer.abort()
    assert store.list_keys() == []
    assert os.listdir(tmp_path / "ds") == []


class _FailingUploadStore(MemoryStore):
    """A remote-like store whose streamed upload fails after the first block."""

    def open_writer(self, key: str) -> ObjectWriter:
        inner = super().open_writer(key)

        class Failing(ObjectWriter):
            def _write(self, data: memoryview) -> None:
                if inner.tell():
                    raise OSError("connection reset")
                inner.write(data)

            def _commit(self) -> None:
                inner.commit()

            def _abort(self) -> None:
                inner.abort()

        return Failing()


def test_failed_upload_publishes_nothing_and_does_not_hang() -> None:
    store = _FailingUploadStore("lmdb-failing-upload")
    writer = LMDBWriter(store, KEY)
    for i in range(100):  # 20 MB, 3 blocks: the upload fails after the first
        writer.write({"__key__": f"k{i}", "bin": os.urandom(200_000)})
    workdir = writer._workdir
    with pytest.raises(OSError, match="connection reset"):
        writer.close()
    assert store.list_keys() == []
    assert not os.path.exists(workdir)


# ---- interop: py-lmdb + msgpack alone, following README.md -------------------------------------


def test_readme_reader_with_py_lmdb_and_msgpack_only(tmp_path: Path) -> None:
    samples = [
        {"__key__": "n01/img_0002", "jpg": b"\xff\xd8jpeg2", "cls": 3},
        {"__key__": "n01/img_0001", "jpg": b"\xff\xd8" + b"j" * 200_000, "cls": 1, "txt": ""},
        {"__key__": "ünï/κλειδί", "json": {"a": 1}, "cls": 0},
    ]
    _write(LocalStore(tmp_path), samples)
    path = str(tmp_path / KEY)

    head = Path(path).read_bytes()[:24]
    assert head[10] & 0x08  # P_META
    assert head[16:20] == bytes.fromhex("dec0efbe")
    assert head[20:24] == b"\1\0\0\0"
    raw = Path(path).read_bytes()
    psize = os.sysconf("SC_PAGE_SIZE")
    metas = [struct.unpack_from("<QQ", raw, page * psize + 136) for page in (0, 1)]
    last_pg, _txnid = max(metas, key=lambda m: m[1])
    assert len(raw) == (last_pg + 1) * psize

    env = lmdb.open(path, subdir=False, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            meta = msgpack.unpackb(txn.get(b"\x00fastload/meta"))
            assert meta == {"format": "fastload-lmdb", "version": 1, "num_samples": 3}
            got = []
            for i in range(meta["num_samples"]):
                key = txn.get(b"\x00fastload/pos/" + i.to_bytes(8, "big"))
                got.append({"__key__": key.decode("utf-8"), **msgpack.unpackb(txn.get(key))})
            all_keys = [k for k, _ in txn.cursor()]
    finally:
        env.close()
    assert got == [
        {"__key__": "n01/img_0002", "jpg": b"\xff\xd8jpeg2", "cls": b"3"},
        {"__key__": "n01/img_0001", "jpg": b"\xff\xd8" + b"j" * 200_000, "cls": b"1", "txt": b""},
        {"__key__": "ünï/κλειδί", "json": b'{"a":1}', "cls": b"0"},
    ]
    reserved = [k for k in all_keys if k.startswith(b"\x00")]
    assert all_keys[: len(reserved)] == reserved  # reserved keys come first in a cursor walk
    assert all(k.startswith(b"\x00fastload/") for k in reserved)
    assert len(reserved) == 1 + 3
    assert all_keys[len(reserved) :] == sorted(s["__key__"].encode() for s in samples)


def test_reads_a_shard_built_with_py_lmdb_following_the_readme(tmp_path: Path) -> None:
    path = tmp_path / "foreign.lmdb"
    env = lmdb.open(str(path), subdir=False, lock=False, map_size=1 << 24)
    with env.begin(write=True) as txn:
        txn.put(
            b"\x00fastload/meta",
            msgpack.packb(
                {"format": "fastload-lmdb", "version": 1, "num_samples": 2, "extra": "ignored"}
            ),
        )
        for i, key in enumerate([b"b", b"a"]):
            txn.put(b"\x00fastload/pos/" + i.to_bytes(8, "big"), key)
            txn.put(key, msgpack.packb({"txt": key * 3}, use_bin_type=True))
    env.close()
    got = list(LMDBReader(LocalStore(tmp_path), "foreign.lmdb"))
    assert [(s["__key__"], s["txt"]) for s in got] == [("b", b"bbb"), ("a", b"aaa")]


def test_detect() -> None:
    store = MemoryStore("lmdb-detect")
    _write(store, [{"__key__": "a", "bin": b"1"}])
    assert detect(store.get(KEY)[:4096])
    assert not detect(b"\x00" * 4096)
    assert not detect(b"ustar" * 100)
    assert not detect(b"")


# ---- processes ----------------------------------------------------------------------------------


def _child_read(reader: LMDBReader, queue: Any) -> None:
    try:
        queue.put(([s["__key__"] for s in reader], reader.read(5)["bin"], os.getpid()))
    except BaseException as exc:  # report, don't hang the parent
        queue.put(repr(exc))


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_reader_works_in_forked_child_after_use_in_parent(kind: str, tmp_path: Path) -> None:
    store: Store = LocalStore(tmp_path) if kind == "local" else MemoryStore("lmdb-fork")
    samples = [{"__key__": f"k{i}", "bin": bytes([i]) * 5000} for i in range(10)]
    _write(store, samples)
    reader = LMDBReader(store, KEY)
    assert reader.read(5)["bin"] == bytes([5]) * 5000  # opened in the parent
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_read, args=(reader, queue))
    proc.start()
    result = queue.get(timeout=60)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    assert result == ([f"k{i}" for i in range(10)], bytes([5]) * 5000, proc.pid)
    # The parent's environment still works after the child exited.
    assert [s["__key__"] for s in reader] == [f"k{i}" for i in range(10)]
    reader.close()


def test_reader_pickles_without_its_environment(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    _write(store, [{"__key__": "a", "bin": b"1"}])
    reader = LMDBReader(store, KEY, readahead=False)
    assert reader.read(0)["bin"] == b"1"
    clone = pickle.loads(pickle.dumps(reader))
    assert clone._entry is None
    assert clone.readahead is False
    assert clone.read(0)["bin"] == b"1"  # same file, same process: the environment is shared
    reader.close()
    assert clone.read(0)["bin"] == b"1"
    clone.close()


def test_many_readers_of_one_file_in_one_process(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    _write(store, [{"__key__": f"k{i}", "bin": bytes([i])} for i in range(5)])
    readers = [LMDBReader(store, KEY) for _ in range(3)]
    iterators = [iter(r) for r in readers]
    assert [next(it)["__key__"] for it in iterators] == ["k0", "k0", "k0"]
    readers[0].close()
    assert [s["__key__"] for s in iterators[1]] == ["k1", "k2", "k3", "k4"]
    del readers[1], iterators[1]
    assert readers[-1].read(4)["bin"] == b"\x04"
    readers[-1].close()
    assert LMDBReader(store, KEY).read(2)["bin"] == b"\x02"  # reopened after all were closed


def test_reader_finalized_while_another_file_opens_does_not_deadlock(tmp_path: Path) -> None:
    """A garbage collection while a shard is being opened may finalize another reader, whose
    finalizer releases its environment in the same thread, inside the table's lock."""
    store = LocalStore(tmp_path)
    _write(store, [{"__key__": "a", "bin": b"1"}], key="a.lmdb")
    _write(store, [{"__key__": "b", "bin": b"2"}], key="b.lmdb")
    gc.disable()  # so that only the collection inside the opener frees the reader
    try:
        doomed = LMDBReader(store, "a.lmdb")
        assert doomed.read(0)["bin"] == b"1"
        doomed.cycle = doomed  # type: ignore[attr-defined]  # only a collection frees it
        del doomed
        real_open = _reader.open_env

        def open_after_collecting(path: str, *, readahead: bool) -> Any:
            gc.collect()  # runs the finalizer of the reader of a.lmdb, here
            return real_open(path, readahead=readahead)

        result: list[bytes] = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_reader, "open_env", open_after_collecting)
            thread = threading.Thread(
                target=lambda: result.append(LMDBReader(store, "b.lmdb").read(0)["bin"]),
                daemon=True,  # a deadlocked thread must not keep the test process alive
            )
            thread.start()
            thread.join(timeout=60)
        assert not thread.is_alive(), "opening b.lmdb deadlocked"
        assert result == [b"2"]
    finally:
        gc.enable()


def test_remote_store_download_is_removed_on_close() -> None:
    store = MemoryStore("lmdb-remote")
    _write(store, [{"__key__": "a", "bin": b"1"}])
    reader = LMDBReader(store, KEY)
    assert reader.read(0)["bin"] == b"1"
    tmp = reader._path
    assert tmp is not None
    assert os.path.exists(tmp)
    reader.close()
    assert not os.path.exists(tmp)
    assert reader.read(0)["bin"] == b"1"  # reopens (downloads again)
    reader.close()


# ---- bad input ----------------------------------------------------------------------------------


def _corrupt_copy(tmp_path: Path, edit: Any) -> LocalStore:
    """A shard of three samples, then ``edit(txn)`` applied to it with py-lmdb."""
    store = LocalStore(tmp_path)
    _write(store, [{"__key__": f"k{i}", "bin": b"v" * 10} for i in range(3)])
    env = lmdb.open(str(tmp_path / KEY), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        edit(txn)
    env.close()
    return store


def test_garbage_file_raises_corrupt_data_naming_the_url(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put(KEY, os.urandom(50_000))
    reader = LMDBReader(store, KEY)
    with pytest.raises(CorruptDataError, match=r"train-000000\.lmdb") as info:
        len(reader)
    assert info.value.url == store.child_url(KEY)
    with pytest.raises(CorruptDataError):
        list(reader)
    skipping = LMDBReader(store, KEY, on_error="skip")
    assert list(skipping) == []
    assert skipping.skipped == 1


def test_truncated_file_raises_instead_of_crashing(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    _write(store, [{"__key__": f"k{i}", "bin": os.urandom(8000)} for i in range(20)])
    data = store.get(KEY)
    store.put(KEY, data[: len(data) // 2])
    with pytest.raises(CorruptDataError, match="truncated") as info:
        LMDBReader(store, KEY).read(19)
    assert info.value.url == store.child_url(KEY)


def test_invalid_msgpack_value_names_the_key(tmp_path: Path) -> None:
    store = _corrupt_copy(tmp_path, lambda txn: txn.put(b"k1", b"\xc1\xc1 not msgpack"))
    with pytest.raises(CorruptDataError, match="'k1'") as info:
        list(LMDBReader(store, KEY))
    assert info.value.key == "k1"
    assert info.value.url == store.child_url(KEY)
    with pytest.raises(CorruptDataError):
        LMDBReader(store, KEY).get_key("k1")
    skipping = LMDBReader(store, KEY, on_error="skip")
    assert [s["__key__"] for s in skipping] == ["k0", "k2"]
    assert skipping.skipped == 1


def test_value_of_wrong_shape_is_corrupt(tmp_path: Path) -> None:
    store = _corrupt_copy(tmp_path, lambda txn: txn.put(b"k2", msgpack.packb({"bin": 5})))
    warning = LMDBReader(store, KEY, on_error="warn")
    assert [s["__key__"] for s in warning] == ["k0", "k1"]
    assert warning.skipped == 1


def test_missing_position_entry_is_corrupt(tmp_path: Path) -> None:
    pos1 = b"\x00fastload/pos/" + (1).to_bytes(8, "big")
    store = _corrupt_copy(tmp_path, lambda txn: txn.delete(pos1))
    with pytest.raises(CorruptDataError, match="position"):
        LMDBReader(store, KEY).read(1)
    skipping = LMDBReader(store, KEY, on_error="skip")
    assert [s["__key__"] for s in skipping] == ["k0", "k2"]


def test_missing_meta_key_is_corrupt(tmp_path: Path) -> None:
    store = _corrupt_copy(tmp_path, lambda txn: txn.delete(b"\x00fastload/meta"))
    with pytest.raises(CorruptDataError, match="not a fastload LMDB shard"):
        len(LMDBReader(store, KEY))


def test_newer_layout_version_is_refused(tmp_path: Path) -> None:
    meta = msgpack.packb({"format": "fastload-lmdb", "version": 99, "num_samples": 3})
    store = _corrupt_copy(tmp_path, lambda txn: txn.put(b"\x00fastload/meta", meta))
    with pytest.raises(FormatError, match="upgrade fastload"):
        len(LMDBReader(store, KEY))


def test_plain_lmdb_file_without_fastload_keys(tmp_path: Path) -> None:
    env = lmdb.open(str(tmp_path / "plain.lmdb"), subdir=False, lock=False, map_size=1 << 20)
    with env.begin(write=True) as txn:
        txn.put(b"a", b"b")
    env.close()
    shutil.copy(tmp_path / "plain.lmdb", tmp_path / "copy.lmdb")
    with pytest.raises(CorruptDataError, match="meta"):
        len(LMDBReader(LocalStore(tmp_path), "copy.lmdb"))


def test_failed_spill_write_poisons_the_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalStore(tmp_path)
    writer = LMDBWriter(store, KEY)
    writer.write({"__key__": "a", "bin": b"1" * 10})

    def disk_full(fd: int, parts: list[bytes]) -> None:
        os.write(fd, b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_writer, "_write_all", disk_full)
    with pytest.raises(OSError, match="No space"):
        writer.write({"__key__": "b", "bin": b"2" * 2_000_000})  # over the spill buffer
    monkeypatch.undo()
    with pytest.raises(FormatError, match="abort this writer"):
        writer.close()
    assert store.list_keys() == []
    assert os.listdir(tmp_path / "ds") == []


def test_dropped_writer_leaves_no_files_or_descriptors(tmp_path: Path) -> None:
    def open_files() -> set[str]:
        found = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                found.add(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass  # closed while listing
        return found

    store = LocalStore(tmp_path)
    before = open_files() if os.path.isdir("/proc/self/fd") else None
    writer = LMDBWriter(store, KEY)
    writer.write({"__key__": "a", "bin": b"1" * 10_000})
    del writer
    gc.collect()
    assert os.listdir(tmp_path / "ds") == []
    if before is not None:
        # Descriptors other tests left for the collector may close meanwhile, and threads other
        # tests started (a Ray or Spark client, a connection pool) may open sockets: no file of
        # the writer's (under tmp_path) may still be open.
        assert {f for f in open_files() - before if f.startswith(str(tmp_path))} == set()
