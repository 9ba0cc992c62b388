"""WebDataset (tar) shards: round trips, determinism, interop with webdataset / GNU tar / DALI,
corrupt input and random access."""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastload.errors import CorruptDataError, FormatError, InvalidArgumentError
from fastload.formats import get_format
from fastload.formats.webdataset import (
    FORMAT,
    WebDatasetReader,
    WebDatasetWriter,
    build_index,
    detect,
    parse_index,
)
from fastload.storage import LocalStore, MemoryStore, Store
from fastload.testing import need
from fastload.testing.streams import ForwardOnlyStore

KEY = "ds/shard-000000.tar"


def _fields(sample: dict[str, Any]) -> dict[str, bytes]:
    return {k: v for k, v in sample.items() if not k.startswith("__")}


def _write(store: Store, samples: list[dict[str, Any]], key: str = KEY, **kw: Any) -> Any:
    with WebDatasetWriter(store, key, **kw) as writer:
        for sample in samples:
            writer.write(sample)
    return writer.close()


def _samples(n: int, size: int = 300) -> list[dict[str, Any]]:
    return [
        {"__key__": f"s{i:04d}", "jpg": bytes([i % 256]) * (size + i), "cls": str(i).encode()}
        for i in range(n)
    ]


def _tar_bytes(
    members: list[tuple[tarfile.TarInfo, bytes]],
    fmt: int,
    pax_headers: dict[str, str] | None = None,
) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt, pax_headers=pax_headers) as tf:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tf.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buf.getvalue()


def _reg(name: str) -> tarfile.TarInfo:
    return tarfile.TarInfo(name)


def test_registry_entry() -> None:
    fmt = get_format("wds")
    assert fmt is FORMAT
    assert (fmt.name, fmt.extension) == ("webdataset", "tar")
    assert fmt.writer is WebDatasetWriter
    assert fmt.reader is WebDatasetReader


#: How a shard reaches the reader: a memory map (local), a seekable ranged stream (memory), a
#: stream that cannot seek.
_STORE_KINDS = ["local", "memory", "forward-only"]


@pytest.fixture(params=_STORE_KINDS)
def corrupt_store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """``make(name, data)``: a store of the parametrised kind holding ``data`` as ``bad.tar``."""

    def make(name: str, data: bytes) -> Store:
        store: Store
        if request.param == "local":
            store = LocalStore(tmp_path / name)
        elif request.param == "memory":
            store = MemoryStore(name)
        else:
            store = ForwardOnlyStore(name + "-fwd")
        store.put("bad.tar", data)
        return store

    return make


# ---- round trips -----------------------------------------------------------------------------

_SEGMENT = st.text(
    alphabet=st.characters(categories=("L", "N", "S"), exclude_characters="./\\\x00"),
    min_size=1,
    max_size=40,
).filter(lambda s: not any(c.isspace() for c in s))
_KEYS = st.lists(_SEGMENT, min_size=1, max_size=4).map("/".join)
_FIELD = st.one_of(
    st.sampled_from(["jpg", "cls", "json", "seg.png", "a.b.c", "TXT", "x-y_z"]),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789", min_size=1, max_size=8),
)
_VALUE = st.one_of(st.just(b""), st.binary(max_size=700), st.binary(min_size=510, max_size=514))


@st.composite
def _sample_lists(draw: st.DrawFn) -> list[dict[str, Any]]:
    keys = draw(st.lists(_KEYS, min_size=0, max_size=8, unique=True))
    out = []
    for key in keys:
        names = draw(st.lists(_FIELD, min_size=1, max_size=12, unique=True))
        out.append({"__key__": key, **{n: draw(_VALUE) for n in names}})
    return out


@pytest.mark.parametrize("kind", _STORE_KINDS)
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(samples=_sample_lists())
def test_round_trip_hypothesis(kind: str, samples: list[dict[str, Any]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store: Store = {
            "local": lambda: LocalStore(tmp),
            "memory": lambda: MemoryStore("wds-hyp"),
            "forward-only": lambda: ForwardOnlyStore("wds-hyp-fwd"),
        }[kind]()
        _check_round_trip(store, samples)


def _check_round_trip(store: Store, samples: list[dict[str, Any]]) -> None:
    info = _write(store, samples)
    got = list(WebDatasetReader(store, KEY))
    assert [s["__key__"] for s in got] == [s["__key__"] for s in samples]
    assert [_fields(s) for s in got] == [_fields(s) for s in samples]
    assert [s["__index__"] for s in got] == list(range(len(samples)))
    assert info.num_samples == len(samples)
    # The index the writer stored is the one derived from the bytes.
    assert store.get(KEY + ".idx") == build_index(store, KEY)
    reader = WebDatasetReader(store, KEY)
    assert len(reader) == len(samples)
    for i in range(len(samples)):
        assert _fields(reader.read(i)) == _fields(samples[i])


def test_round_trip_large_field_long_and_unicode_keys(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    big = hashlib.sha256(b"seed").digest() * (2 * 1024 * 1024 // 32 + 7)  # ~2 MB, unaligned
    samples = [
        {"__key__": "ünï/cödé/画像_01", "jpg": big, "seg.png": b"", "json": {"a": 1}},
        {"__key__": "a/b/c", "cls": 3, "txt": "héllo"},
        {"__key__": "d" * 99, "bin": b"fits in name"},  # 99 + ".bin" > 100: prefix needed
        {"__key__": "p" * 120 + "/" + "q" * 90, "bin": b"prefix split"},
        {"__key__": "r" * 300, "bin": b"pax path"},
        {"__key__": "/".join(["s" * 60] * 5), "bin": b"long nested"},
    ]
    info = _write(store, samples)
    got = list(WebDatasetReader(store, KEY))
    assert [s["__key__"] for s in got] == [s["__key__"] for s in samples]
    assert got[0]["jpg"] == big
    assert got[0]["seg.png"] == b""
    assert got[0]["json"] == b'{"a":1}'
    assert got[1]["cls"] == b"3"
    assert got[1]["txt"] == "héllo".encode()
    assert [g["bin"] for g in got[2:]] == [s["bin"] for s in samples[2:]]
    assert info.fields == {"jpg": 1, "seg.png": 1, "json": 1, "cls": 1, "txt": 1, "bin": 4}
    # Python's tarfile agrees on every member name and payload.
    with tarfile.open(tmp_path / KEY) as tf:
        names = [m.name for m in tf.getmembers()]
        assert names[-1] == "/".join(["s" * 60] * 5) + ".bin"
        assert tf.extractfile("r" * 300 + ".bin").read() == b"pax path"  # type: ignore[union-attr]
    # Member headers: fixed metadata, ustar prefix where the path fits, pax only beyond.
    with tarfile.open(tmp_path / KEY) as tf:
        for m in tf.getmembers():
            assert (m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) == (0, 0, 0, "", "", 0o644)
        assert set(tf.pax_headers) == set()


# ---- writer contract -------------------------------------------------------------------------


def test_deterministic_bytes_and_truthful_info(tmp_path: Path) -> None:
    samples = [*_samples(30), {"__key__": "z" * 200, "cls": 1}]
    a, b = LocalStore(tmp_path / "a"), MemoryStore("wds-det")
    info_a, info_b = _write(a, samples), _write(b, samples)
    data = a.get(KEY)
    assert data == b.get(KEY)
    assert a.get(KEY + ".idx") == b.get(KEY + ".idx")
    assert info_a == info_b
    assert info_a.num_bytes == len(data) == os.path.getsize(tmp_path / "a" / KEY)
    assert info_a.sha256 == hashlib.sha256(data).hexdigest()
    assert info_a.index_key == KEY + ".idx"
    assert info_a.num_samples == 31
    assert info_a.fields == {"jpg": 30, "cls": 31}
    assert data.endswith(bytes(1024))
    assert len(data) % 512 == 0


def test_writer_rejections() -> None:
    store = MemoryStore("wds-reject")
    writer = WebDatasetWriter(store, KEY)
    writer.write({"__key__": "a", "bin": b"1"})
    with pytest.raises(InvalidArgumentError, match="repeats the previous"):
        writer.write({"__key__": "a", "bin": b"2"})
    with pytest.raises(InvalidArgumentError, match="whitespace"):
        writer.write({"__key__": "has space", "bin": b"2"})
    with pytest.raises(InvalidArgumentError, match="no fields"):
        writer.write({"__key__": "empty"})
    for bad in ("../evil", "/abs", "x/../y", "dir/"):
        with pytest.raises(InvalidArgumentError, match=r"'\.\.'|ends with"):
            writer.write({"__key__": bad, "bin": b"2"})
    with pytest.raises(ValueError, match=r"dot|'\.'"):
        writer.write({"__key__": "a.b", "bin": b"2"})
    writer.write({"__key__": "b", "bin": b"3"})
    info = writer.close()
    assert info.num_samples == 2
    assert [s["bin"] for s in WebDatasetReader(store, KEY)] == [b"1", b"3"]
    with pytest.raises(InvalidArgumentError, match="closed"):
        writer.write({"__key__": "c", "bin": b"4"})


def test_whitespace_keys_without_index() -> None:
    store = MemoryStore("wds-ws")
    info = _write(
        store, [{"__key__": "a b", "txt": "x"}, {"__key__": "c\td", "txt": "y"}], index=False
    )
    assert info.index_key is None
    assert not store.exists(KEY + ".idx")
    reader = WebDatasetReader(store, KEY)
    assert [s["__key__"] for s in reader] == ["a b", "c\td"]
    assert not reader.supports_random_access
    with pytest.raises(FormatError, match="fastload index"):
        reader.read(0)
    with pytest.raises(FormatError, match="whitespace"):
        build_index(store, KEY)


def test_abort_leaves_nothing() -> None:
    store = MemoryStore("wds-abort")

    def fail_midway() -> None:
        with WebDatasetWriter(store, KEY) as writer:
            writer.write({"__key__": "a", "bin": b"1"})
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        fail_midway()
    assert store.list_keys() == []


def test_empty_shard() -> None:
    store = MemoryStore("wds-empty")
    info = _write(store, [])
    assert store.get(KEY) == bytes(1024)
    assert store.get(KEY + ".idx") == b"v1.2 0\n" == build_index(store, KEY)
    assert info.num_samples == 0
    reader = WebDatasetReader(store, KEY)
    assert list(reader) == []
    assert len(reader) == 0


def test_detect() -> None:
    store = MemoryStore("wds-detect")
    _write(store, _samples(1))
    assert detect(store.get(KEY)[:512])
    assert not detect(bytes(4096))
    assert not detect(b"\x01" * 4096)
    assert not detect(store.get(KEY)[:100])


# ---- interop: the webdataset library ----------------------------------------------------------


def test_webdataset_library_reads_our_shards(tmp_path: Path) -> None:
    import webdataset as wds

    store = LocalStore(tmp_path)
    samples = [
        *_samples(12),
        {"__key__": "dir/sub/x", "seg.png": b"\x89PNG", "json": b"{}"},
        {"__key__": "y" * 150 + "/z", "bin": b"long"},
    ]
    _write(store, samples)
    got = list(wds.WebDataset(str(tmp_path / KEY), shardshuffle=False))
    assert [g["__key__"] for g in got] == [s["__key__"] for s in samples]
    for g, s in zip(got, samples, strict=True):
        assert {k: v for k, v in g.items() if not k.startswith("__")} == _fields(s)


def test_we_read_webdataset_tarwriter_and_shardwriter(tmp_path: Path) -> None:
    import webdataset as wds

    samples = [
        {"__key__": f"k{i:03d}", "jpg": os.urandom(700 + i), "cls": str(i).encode()}
        for i in range(10)
    ]
    with wds.TarWriter(str(tmp_path / "tw.tar")) as sink:
        for s in samples:
            sink.write(s)
    pattern = str(tmp_path / "sw-%06d.tar")
    with wds.ShardWriter(pattern, maxcount=4, verbose=0) as sink:
        for s in samples:
            sink.write(s)
    store = LocalStore(tmp_path)
    got = list(WebDatasetReader(store, "tw.tar"))
    assert [(g["__key__"], _fields(g)) for g in got] == [
        (s["__key__"], _fields(s)) for s in samples
    ]
    shards = sorted(k for k in store.list_keys() if k.startswith("sw-"))
    assert len(shards) == 3
    got = [g for key in shards for g in WebDatasetReader(store, key)]
    assert [(g["__key__"], _fields(g)) for g in got] == [
        (s["__key__"], _fields(s)) for s in samples
    ]
    # Index derived for a third-party shard enables random access.
    store.put("tw.tar.idx", build_index(store, "tw.tar"))
    reader = WebDatasetReader(store, "tw.tar")
    assert len(reader) == 10
    assert _fields(reader.read(7)) == _fields(samples[7])


# ---- interop: GNU tar and Python tarfile ------------------------------------------------------


def _make_tree(root: Path) -> list[tuple[str, dict[str, bytes]]]:
    long_dir = "L" * 60 + "/" + "M" * 60
    expected = [
        ("a", {"jpg": b"A" * 1000, "cls": b"1"}),
        ("sub/b", {"jpg": b"B" * 513, "cls": b"2", "json": b"{}"}),
        (f"sub/{long_dir}/c", {"jpg": b"C" * 10, "cls": b"3"}),
        ("sub/d", {"v2.jpg": b"D", "v2.cls": b"4"}),
    ]
    for key, fields in expected:
        for field, data in fields.items():
            path = root / f"{key}.{field}"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
    return expected


@pytest.mark.parametrize("tar_format", ["gnu", "posix", "ustar"])
def test_we_read_gnu_tar(tmp_path: Path, tar_format: str) -> None:
    need("GNU tar", shutil.which("tar") is not None, "apt-get install tar")
    src = tmp_path / "src"
    expected = _make_tree(src)
    names = [f"{k}.{f}" for k, fields in expected for f in fields]
    out = tmp_path / "out"
    out.mkdir()
    # A directory entry first, then files in sample order (GNU tar lists directories itself).
    subprocess.run(
        [
            "tar",
            f"--format={tar_format}",
            "--no-recursion",
            "-cf",
            str(out / "g.tar"),
            "-C",
            str(src),
            "sub",
            *names,
        ],
        check=True,
    )
    store = LocalStore(out)
    got = list(WebDatasetReader(store, "g.tar"))
    assert [(g["__key__"], _fields(g)) for g in got] == expected
    # build_index gives correct offsets even for GNU long names (wds2idx does not).
    index = parse_index(build_index(store, "g.tar"))
    data = store.get("g.tar")
    for comps, (key, fields) in zip(index, expected, strict=True):
        assert [c.name for c in comps] == [f"{key}.{f}" for f in fields]
        assert [data[c.offset : c.offset + c.size] for c in comps] == list(fields.values())
    store.put("g.tar.idx", build_index(store, "g.tar"))
    reader = WebDatasetReader(store, "g.tar")
    assert [_fields(reader.read(i)) for i in range(len(reader))] == [f for _, f in expected]


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_we_read_python_tarfile(fmt: int) -> None:
    long = "dir/" + "n" * 130 if fmt != tarfile.USTAR_FORMAT else "dir/" + "n" * 90
    members = [
        (_reg("dir/"), b""),
        (_reg(f"{long}.jpg"), b"J" * 1500),
        (_reg(f"{long}.cls"), b"7"),
        (_reg("README"), b"not a component"),
        (_reg(".hidden"), b"skipped"),
        (_reg("ünï.txt"), "ü".encode()),
    ]
    members[0][0].type = tarfile.DIRTYPE
    store = MemoryStore("wds-tarfile")
    globals_ = {"comment": "global pax header"} if fmt == tarfile.PAX_FORMAT else None
    store.put("t.tar", _tar_bytes(members, fmt, globals_))
    got = list(WebDatasetReader(store, "t.tar"))
    assert [(g["__key__"], _fields(g)) for g in got] == [
        (long, {"jpg": b"J" * 1500, "cls": b"7"}),
        ("ünï", {"txt": "ü".encode()}),
    ]


# ---- interop: DALI's index tool and reader ----------------------------------------------------


def _wds2idx() -> str | None:
    path = Path(sys.executable).parent / "wds2idx"
    return str(path) if path.exists() else shutil.which("wds2idx")


def test_index_equals_dali_wds2idx(tmp_path: Path) -> None:
    tool = _wds2idx()
    need("DALI wds2idx", tool is not None, "pip install nvidia-dali-cuda120")
    assert tool is not None
    store = LocalStore(tmp_path)
    samples = [
        *_samples(20),
        {"__key__": "sub/x", "seg.png": b"p", "v2.cls": b"1"},
        {"__key__": "p" * 120 + "/" + "q" * 50, "jpg": b"prefix"},  # ustar prefix
        {"__key__": "r" * 280, "jpg": b"pax"},  # pax path
        {"__key__": "ü/日本", "jpg": b"utf8"},
    ]
    _write(store, samples)
    subprocess.run(
        [tool, str(tmp_path / KEY), str(tmp_path / "dali.idx")], check=True, capture_output=True
    )
    assert (tmp_path / "dali.idx").read_bytes() == store.get(KEY + ".idx")
    # Third-party tar (Python tarfile, pax) with directories and a hidden file.
    members = [
        (_reg("d/"), b""),
        (_reg("d/a.jpg"), b"x" * 600),
        (_reg("d/.h"), b"h"),
        (_reg("d/a.cls"), b"1"),
        (_reg("b.jpg"), b"y"),
    ]
    members[0][0].type = tarfile.DIRTYPE
    (tmp_path / "third.tar").write_bytes(_tar_bytes(members, tarfile.PAX_FORMAT))
    subprocess.run(
        [tool, str(tmp_path / "third.tar"), str(tmp_path / "third.idx")],
        check=True,
        capture_output=True,
    )
    assert (tmp_path / "third.idx").read_bytes() == build_index(store, "third.tar")


def test_dali_reads_our_shards_with_our_index(tmp_path: Path) -> None:
    try:
        import numpy as np
        from nvidia.dali import fn, pipeline_def, types

        ok = True
    except ImportError:
        ok = False
    need("DALI", ok, "pip install nvidia-dali-cuda120")
    store = LocalStore(tmp_path)
    samples = [
        {
            "__key__": ("sub/" if i % 3 else "") + f"s{i:03d}",
            "jpg": os.urandom(100 + 37 * i),
            "cls": str(i).encode(),
        }
        for i in range(10)
    ]
    samples[4]["__key__"] = "l" * 120 + "/" + "m" * 60  # ustar prefix split
    _write(store, samples)

    @pipeline_def(batch_size=5, num_threads=1, device_id=None)  # type: ignore[misc]
    def pipe() -> Any:
        jpg, cls = fn.readers.webdataset(
            paths=[str(tmp_path / KEY)],
            index_paths=[str(tmp_path / (KEY + ".idx"))],
            ext=["jpg", "cls"],
            missing_component_behavior="error",
            dtypes=[types.UINT8, types.UINT8],
        )
        return jpg, cls

    p = pipe()
    p.build()
    got = []
    for _ in range(2):
        jpgs, clss = p.run()
        got += [(bytes(np.array(j)), bytes(np.array(c))) for j, c in zip(jpgs, clss, strict=True)]
    assert got == [(s["jpg"], s["cls"]) for s in samples]


# ---- corrupt input -------------------------------------------------------------------------


def _good_tar(n: int = 6) -> bytes:
    store = MemoryStore("wds-good-src")
    _write(store, _samples(n, size=100), key="g.tar", index=False)
    return store.get("g.tar")


def test_truncated_shard(corrupt_store: Any) -> None:
    data = _good_tar()
    url_store = corrupt_store("wds-trunc", data[: len(data) - 1024 - 700])
    url = url_store.child_url("bad.tar")
    with pytest.raises(CorruptDataError, match=rf"truncated.*{re.escape(url)}.*byte offset") as ei:
        list(WebDatasetReader(url_store, "bad.tar"))
    assert ei.value.url == url
    assert "inside a header block" in str(ei.value)
    assert ei.value.offset == 11264  # s0005.cls's header: 5 samples of 4 blocks, then 1 block
    assert ei.value.offset is not None
    reader = WebDatasetReader(url_store, "bad.tar", on_error="skip")
    got = list(reader)
    assert [g["__key__"] for g in got] == [f"s{i:04d}" for i in range(5)]
    assert reader.skipped == 1
    # Cut exactly at a member boundary: only the end-of-archive blocks are missing.
    store = corrupt_store("wds-trunc2", data[:-1024])
    with pytest.raises(CorruptDataError, match="end-of-archive"):
        list(WebDatasetReader(store, "bad.tar"))
    # Cut inside a header.
    store = corrupt_store("wds-trunc3", data[: 1024 + 100])
    with pytest.raises(CorruptDataError, match="inside a header") as ei:
        list(WebDatasetReader(store, "bad.tar"))
    assert ei.value.offset == 1024
    # Cut inside a member's data.
    store = corrupt_store("wds-trunc4", data[: 4 * 512 + 512 + 50])
    with pytest.raises(CorruptDataError, match=r"inside member 's0001\.jpg'") as ei:
        list(WebDatasetReader(store, "bad.tar"))
    assert ei.value.offset == 4 * 512 + 512 + 50
    # An empty file.
    store = corrupt_store("wds-trunc5", b"")
    with pytest.raises(CorruptDataError, match="without the end-of-archive") as ei:
        list(WebDatasetReader(store, "bad.tar"))
    assert ei.value.offset == 0


def test_flipped_header_byte(corrupt_store: Any) -> None:
    data = bytearray(_good_tar())
    # Sample 2's jpg header: samples are jpg (100+i bytes → 1 block) + cls: 4 blocks each.
    at = 2 * 4 * 512
    data[at + 3] ^= 0x01
    store = corrupt_store("wds-flip", bytes(data))
    with pytest.raises(CorruptDataError, match="checksum") as ei:
        list(WebDatasetReader(store, "bad.tar"))
    assert ei.value.offset == at
    assert store.child_url("bad.tar") in str(ei.value)
    reader = WebDatasetReader(store, "bad.tar", on_error="skip")
    got = list(reader)
    # The lost member may have belonged to the sample before the corrupt header or to the one
    # after it, so both are dropped; the rest comes back whole.
    assert [g["__key__"] for g in got] == ["s0000", "s0003", "s0004", "s0005"]
    assert all(len(_fields(g)) == 2 for g in got)
    assert reader.skipped == 2
    with pytest.raises(CorruptDataError, match="checksum"):
        build_index(store, "bad.tar")


def test_garbage_is_not_a_tar(corrupt_store: Any) -> None:
    store = corrupt_store("wds-garbage", b"this is not a tar archive\n" * 100)
    with pytest.raises(CorruptDataError, match=r"checksum.*byte offset 0"):
        list(WebDatasetReader(store, "bad.tar"))
    reader = WebDatasetReader(store, "bad.tar", on_error="skip")
    assert list(reader) == []
    assert reader.skipped >= 1


@pytest.mark.parametrize(
    ("member", "message"),
    [
        ("symlink", "symbolic link, not a regular file"),
        ("hardlink", "hard link, not a regular file"),
        ("../evil", r"'\.\.' segment"),
        ("/abs", "absolute path"),
        ("fifo", "FIFO, not a regular file"),
    ],
)
def test_unsafe_members(corrupt_store: Any, member: str, message: str) -> None:
    good = [(_reg("a.jpg"), b"1"), (_reg("a.cls"), b"1")]
    tail = [(_reg("c.jpg"), b"3"), (_reg("c.cls"), b"3")]
    if member in ("symlink", "hardlink", "fifo"):
        info = _reg("b.jpg")
        info.type = {
            "symlink": tarfile.SYMTYPE,
            "hardlink": tarfile.LNKTYPE,
            "fifo": tarfile.FIFOTYPE,
        }[member]
        info.linkname = "/etc/passwd"
        bad = [(info, b""), (_reg("b.cls"), b"2")]
    else:
        bad = [(_reg(f"{member}.jpg"), b"2"), (_reg(f"{member}.cls"), b"2")]
    data = _tar_bytes(good + bad + tail, tarfile.USTAR_FORMAT)
    store = corrupt_store(f"wds-unsafe-{member.strip('./')}", data)
    with pytest.raises(CorruptDataError, match=message) as ei:
        list(WebDatasetReader(store, "bad.tar"))
    assert ei.value.offset == 2048  # a.jpg, a.cls: 2 blocks each
    assert ei.value.url == store.child_url("bad.tar")
    assert "b.jpg" in str(ei.value) or f"{member}.jpg" in str(ei.value)
    reader = WebDatasetReader(store, "bad.tar", on_error="skip")
    got = list(reader)
    assert [(g["__key__"], _fields(g)) for g in got] == [
        ("a", {"jpg": b"1", "cls": b"1"}),
        ("c", {"jpg": b"3", "cls": b"3"}),
    ]
    assert reader.skipped == 1
    with pytest.raises(FormatError, match=message):
        build_index(store, "bad.tar")


def test_duplicate_field_in_sample(corrupt_store: Any) -> None:
    data = _tar_bytes(
        [(_reg("a.jpg"), b"1"), (_reg("a.jpg"), b"2"), (_reg("b.jpg"), b"3")], tarfile.USTAR_FORMAT
    )
    store = corrupt_store("wds-dup", data)
    with pytest.raises(CorruptDataError, match="appears twice"):
        list(WebDatasetReader(store, "bad.tar"))
    reader = WebDatasetReader(store, "bad.tar", on_error="warn")
    assert [g["__key__"] for g in reader] == ["b"]
    assert reader.skipped == 1


# ---- random access ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_random_access_equals_streaming(tmp_path: Path, kind: str) -> None:
    store: Store = MemoryStore("wds-ra") if kind == "memory" else LocalStore(tmp_path)
    samples = [*_samples(50), {"__key__": "x" * 300, "jpg": b"pax", "cls": b"9"}]
    _write(store, samples)
    reader = WebDatasetReader(store, KEY)
    assert reader.supports_random_access
    streamed = list(reader)
    assert len(reader) == 51
    for i in (50, 0, 17, 49, 3):
        got = reader.read(i)
        assert got == streamed[i]
    for start in (0, 1, 25, 50, 51, 80):
        tail = list(reader.iter_from(start))
        assert tail == streamed[start:]
    with pytest.raises(IndexError):
        reader.read(51)
    # Without an index, iter_from still works (by streaming) and read() explains what to do.
    store.delete(KEY + ".idx")
    plain = WebDatasetReader(store, KEY)
    assert not plain.supports_random_access
    assert list(plain.iter_from(48)) == streamed[48:]
    with pytest.raises(FormatError, match="fastload index"):
        len(plain)


def test_explicit_index_key_and_stale_index() -> None:
    store = MemoryStore("wds-stale")
    _write(store, _samples(5), index=False)
    store.put("elsewhere.idx", build_index(store, KEY))
    reader = WebDatasetReader(store, KEY, index_key="elsewhere.idx")
    assert len(reader) == 5
    assert reader.read(4)["__key__"] == "s0004"
    with pytest.raises(FileNotFoundError, match=r"missing\.idx"):
        len(WebDatasetReader(store, KEY, index_key="missing.idx"))
    # An index from another shard: offsets point at data, not at the headers it expects.
    _write(store, _samples(5, size=2000), key="other.tar")
    reader = WebDatasetReader(store, KEY, index_key="other.tar.idx")
    with pytest.raises(FormatError, match="rebuild"):
        reader.read(3)


@pytest.mark.parametrize(
    ("index", "message"),
    [
        (b"", "empty"),
        (b"v1.0 1\njpg 512 1 a.jpg\n", "not 'v1.2"),
        (b"v1.2 2\njpg 512 1 a.jpg\n", "declares 2 samples but has 1"),
        (b"v1.2 1\njpg 512 1\n", "multiple of 4"),
        (b"v1.2 1\njpg 100 1 a.jpg\n", "multiples of 512"),
        (b"v1.2 1\njpg 512 999999 a.jpg\n", "reach|points at bytes"),
        # consistency: reading by the index must deliver every sample of the shard once
        (b"v1.2 2\njpg 512 1 a.jpg\njpg 512 1 a.jpg\n", "line 3: .* overlaps or precedes"),
        (b"v1.2 2\njpg 1536 1 b.jpg\njpg 512 1 a.jpg\n", "line 3: .* overlaps or precedes"),
        (b"v1.2 1\njpg 512 600 a.jpg cls 1024 1 a.cls\n", "overlaps"),
        (b"v1.2 2\njpg 512 1 a.jpg\ncls 1536 1 a.cls\n", "lines 2 and 3 both hold sample 'a'"),
        (b"v1.2 1\njpg 512 1 a.jpg cls 1536 1 b.cls\n", "belongs to sample 'b', not to 'a'"),
        (b"v1.2 1\njpg 512 1 a.jpg jpg 1536 1 a.jpg\n", "repeats field 'jpg'"),
        (b"v1.2 1\njpg 512 1 ../a.jpg\n", "'..' segment"),
        (b"v1.2 1\njpg 512 1 /a.jpg\n", "absolute path"),
        (b"v1.2 1\n__key__ 512 1 a.__key__\n", "reserved field name"),
        (b"v1.2 1\npng 512 1 a.jpg\n", "does not have field 'png'"),
    ],
)
def test_malformed_index(index: bytes, message: str) -> None:
    store = MemoryStore("wds-badidx")
    _write(store, _samples(1), index=False)
    store.put(KEY + ".idx", index)
    reader = WebDatasetReader(store, KEY)
    with pytest.raises(CorruptDataError, match=message) as ei:
        len(reader)
    assert "fastload index" in str(ei.value)
    assert KEY + ".idx" in str(ei.value)


def test_damaged_index_under_skip_reads_the_shard_headers() -> None:
    """A damaged index loses nothing under skip: the shard's own headers replace it."""
    store = MemoryStore("wds-skipidx")
    _write(store, _samples(4))
    expected = list(WebDatasetReader(store, KEY))
    lines = store.get(KEY + ".idx").splitlines(keepends=True)
    store.put(KEY + ".idx", b"".join([lines[0], lines[1], lines[1], lines[3], lines[4]]))
    with pytest.raises(CorruptDataError, match="overlaps"):
        len(WebDatasetReader(store, KEY))
    reader = WebDatasetReader(store, KEY, on_error="skip", num_samples=4)
    assert [reader.read(i) for i in range(len(reader))] == expected
    assert reader.skipped == 0


def test_index_count_is_checked_against_the_manifest() -> None:
    store = MemoryStore("wds-count")
    _write(store, _samples(3))
    with pytest.raises(CorruptDataError, match="lists 3 samples, but the dataset manifest says"):
        len(WebDatasetReader(store, KEY, num_samples=5))
    reader = WebDatasetReader(store, KEY, on_error="skip", num_samples=5)
    assert reader.read(2)["__key__"] == "s0002"
    with pytest.raises(CorruptDataError, match="sample 3 is missing"):
        reader.read(3)  # the loader counts it as skipped
    with pytest.raises(IndexError):
        reader.read(5)


def test_truncated_shard_keeps_the_samples_before_the_cut(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    _write(store, _samples(4, size=2000))
    size = store.size(KEY)
    jpg2 = parse_index(store.get(KEY + ".idx"))[2][0]
    store.put(KEY, store.get(KEY)[: jpg2.offset + 10])
    reader = WebDatasetReader(store, KEY, num_samples=4, num_bytes=size)
    assert [reader.read(i)["__key__"] for i in range(2)] == ["s0000", "s0001"]
    for i in (2, 3):
        with pytest.raises(CorruptDataError, match="truncated") as ei:
            reader.read(i)
        assert f"manifest says it has {size} bytes" in str(ei.value)
        assert "fastload index" not in str(ei.value)


def test_v11_index_is_accepted() -> None:
    store = MemoryStore("wds-v11")
    _write(store, _samples(3))
    v12 = parse_index(store.get(KEY + ".idx"))
    lines = [" ".join(f"{c.ext} {c.offset} {c.size}" for c in comps) for comps in v12]
    store.put(KEY + ".idx", ("v1.1 3\n" + "".join(line + "\n" for line in lines)).encode())
    reader = WebDatasetReader(store, KEY)
    assert reader.read(2) == list(WebDatasetReader(store, KEY))[2]


def test_reader_pickles_without_its_index(tmp_path: Path) -> None:
    import pickle

    store = LocalStore(tmp_path)
    _write(store, _samples(4))
    reader = WebDatasetReader(store, KEY, on_error="skip")
    assert len(reader) == 4
    blob = pickle.dumps(reader)
    assert b"s0003.jpg" not in blob  # the parsed index stays behind
    clone = pickle.loads(blob)
    assert clone.policy.on_error == "skip"
    assert len(clone) == 4
    assert clone.read(3) == reader.read(3)
    # read() maps the local shard; the map is not pickled, and close() unmaps it.
    assert reader._map is not None
    assert pickle.loads(pickle.dumps(reader))._map is None
    reader.close()
    assert reader._map is None
    assert reader.read(0)["__key__"] == "s0000"


def test_read_checks_data_length_after_the_shard_shrank(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    _write(store, _samples(4, size=2000))
    reader = WebDatasetReader(store, KEY)
    assert len(reader) == 4  # the index is loaded (and checked) against the full shard
    jpg3 = parse_index(store.get(KEY + ".idx"))[3][0]
    store.put(KEY, store.get(KEY)[: jpg3.offset + 1000])  # replaced, atomically: s0003.jpg cut
    assert reader.read(2)["__key__"] == "s0002"
    with pytest.raises(CorruptDataError, match="shard ends after 1000") as ei:
        reader.read(3)
    assert ei.value.url == store.child_url(KEY)
    assert ei.value.offset == jpg3.offset


def test_huge_member_size_uses_pax_and_base256_is_read() -> None:
    from fastload.formats.webdataset._scan import scan
    from fastload.formats.webdataset._tar import encode_member_header, parse_octal

    size = 2**34 + 3  # above ustar's 8 GiB - 1
    header = encode_member_header(b"big.bin", size)
    assert len(header) == 3 * 512  # pax header block, its record block, the member header
    assert b"size=17179869187\n" in header
    data_end = len(header) + size + (-size % 512)
    slices: list[slice] = []

    class Sparse:  # the headers, a 16 GiB hole for the data, the end-of-archive blocks
        def __len__(self) -> int:
            return data_end + 1024

        def __getitem__(self, item: slice) -> bytes:
            slices.append(item)
            if item.start < len(header):
                return header[item]
            assert item.start >= data_end, "the scanner read member data it was told to skip"
            return bytes(min(item.stop, len(self)) - item.start)

    items = list(scan(Sparse(), "mem://x", want_data=False))
    assert items == [("big.bin", 0, "regular file", 0, 1536, size, None)]
    assert slices[-1].start == data_end  # the next header is looked for right after the data
    assert parse_octal(b"\x80" + size.to_bytes(11, "big")) == size
    assert parse_octal(b"00000001750\x00") == 1000
    assert parse_octal(b"   1750 \x00\x00\x00\x00") == 1000


# ---- read_view: fields as views of the mapped shard ------------------------------------------


def test_read_view_gives_views_of_the_map_equal_to_read(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    samples = _samples(20, size=5000)
    _write(store, samples)
    reader = WebDatasetReader(store, KEY)
    for i in (0, 7, 19):
        copied, viewed = reader.read(i), reader.read_view(i)
        assert {k: type(v) for k, v in _fields(copied).items()} == {"jpg": bytes, "cls": bytes}
        assert {k: type(v) for k, v in _fields(viewed).items()} == {
            "jpg": memoryview,
            "cls": memoryview,
        }
        assert viewed["__key__"] == copied["__key__"] == samples[i]["__key__"]
        assert bytes(viewed["jpg"]) == copied["jpg"] == samples[i]["jpg"]
        assert bytes(viewed["cls"]) == samples[i]["cls"]
        assert viewed["jpg"].readonly
    held = reader.read_view(3)["jpg"]
    reader.close()  # the map stays while a view holds it: no BufferError, and the bytes stay
    assert bytes(held) == samples[3]["jpg"]
    assert bytes(reader.read_view(4)["jpg"]) == samples[4]["jpg"]  # remapped after close
    reader.close()
    with pytest.raises(IndexError, match="out of range"):
        reader.read_view(20)


def test_read_view_without_a_map_gives_bytes() -> None:
    store = MemoryStore()
    samples = _samples(5)
    _write(store, samples)
    got = WebDatasetReader(store, KEY).read_view(2)
    assert type(got["jpg"]) is bytes
    assert got["jpg"] == samples[2]["jpg"]
