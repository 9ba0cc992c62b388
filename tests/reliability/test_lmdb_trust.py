"""An LMDB shard whose bytes are the manifest's (size and SHA-256) is read without page checks;
one whose bytes differ is read with them, as before, and a warning says so; shards of large values
are never hashed; and without a manifest the branch pages are read as lookups reach them, not all
at opening.

Shards are written by the real writer and damaged at the byte level (as in
``test_lmdb_damage.py``, whose layout helpers these tests share).
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fastload.formats import get_format
from fastload.formats.lmdb import LMDBReader
from fastload.formats.lmdb._pagemap import _Branch, _Leaf
from fastload.formats.lmdb._pages import TRUST_BYTES_PER_ENTRY
from fastload.storage import open_store

pytestmark = pytest.mark.timeout(60)

KEY = "ds/train-000000.lmdb"


def _build(root: Path, n: int, value: int, key_size: int = 6) -> tuple[Any, list[str], bytes]:
    """``n`` samples of a ``value``-byte field; the store, the keys in order, the file's bytes."""
    store = open_store(root)
    writer = get_format("lmdb").writer(store, KEY)
    keys = [f"{i:0{key_size}d}" for i in range(n)]
    for i, key in enumerate(keys):
        writer.write({"__key__": key, "v": (f"<{i}>" * value).encode()[:value]})
    writer.close()
    return store, keys, (root / KEY).read_bytes()


def _reader(store: Any, raw: bytes, sha256: str | None, **options: Any) -> LMDBReader:
    return LMDBReader(store, KEY, num_bytes=len(raw), sha256=sha256, **options)


def _trusted(reader: LMDBReader) -> bool:
    return bool(reader._open()[1].pages.trusted)


def _values(reader: LMDBReader) -> list[tuple[str, bytes]]:
    return [(s["__key__"], s["v"]) for s in reader]


def test_shard_that_matches_the_manifest_is_read_without_page_checks(tmp_path: Path) -> None:
    store, keys, raw = _build(tmp_path, 2000, 16)
    reader = _reader(store, raw, hashlib.sha256(raw).hexdigest())
    assert _trusted(reader)
    pages = reader._open()[1].pages
    assert pages.table.state == bytearray([1])  # one entry, good, for every key
    expected = [(k, (f"<{i}>" * 16).encode()[:16]) for i, k in enumerate(keys)]
    assert _values(reader) == expected
    assert [reader.read(i)["v"] for i in (0, 999, 1999)] == [expected[i][1] for i in (0, 999, 1999)]
    assert reader.get_key(keys[1234])["v"] == expected[1234][1]
    with pytest.raises(KeyError):
        reader.get_key("nope")
    reader.close()
    # the same shard without the manifest's hash: the page checks, the same samples
    plain = _reader(store, raw, None)
    assert not _trusted(plain)
    assert _values(plain) == expected
    plain.close()


def _page_holding(raw: bytes, needle: bytes) -> int:
    psize: int = struct.unpack_from("<I", raw, 40)[0]
    return raw.index(needle) // psize


def test_damaged_structure_under_a_manifest_hash_falls_back_to_the_page_checks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store, _, raw = _build(tmp_path, 2000, 16)
    sha = hashlib.sha256(raw).hexdigest()
    psize = struct.unpack_from("<I", raw, 40)[0]
    victim = _page_holding(raw, (b"<1000>" * 3)[:16])  # the leaf holding sample 1000's value
    damaged = bytearray(raw)
    damaged[victim * psize + 10] ^= 0x07  # its flags: no longer a leaf
    (tmp_path / KEY).write_bytes(bytes(damaged))

    with caplog.at_level(logging.WARNING, logger="fastload.formats.lmdb"):
        reader = _reader(store, raw, sha, on_error="skip")
        assert not _trusted(reader)
        got = [s["__key__"] for s in reader]
    assert any(
        "do not match the SHA-256 of the dataset manifest" in r.getMessage()
        and str(store.child_url(KEY)) in r.getMessage()
        for r in caplog.records
    )
    assert "1000" not in [k.lstrip("0") for k in got]
    assert 0 < reader.skipped < 200  # the samples on that page only (~110 fit on a page)
    assert len(got) + reader.skipped == 2000
    assert all(f"leaf page {victim} is damaged" in e for e in reader.policy.errors)
    reader.close()
    # exactly what the page checks give without any hash
    plain = _reader(store, raw, None, on_error="skip")
    assert [s["__key__"] for s in plain] == got
    plain.close()


def test_damaged_value_bytes_are_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store, _, raw = _build(tmp_path, 500, 16)
    sha = hashlib.sha256(raw).hexdigest()
    value = (b"<321>" * 4)[:16]
    damaged = raw.replace(value, value[:-1] + b"!", 1)  # still decodes: only a hash tells
    (tmp_path / KEY).write_bytes(damaged)
    with caplog.at_level(logging.WARNING, logger="fastload.formats.lmdb"):
        reader = _reader(store, raw, sha)
        assert reader.read(321)["v"] == value[:-1] + b"!"
    assert any("SHA-256" in r.getMessage() for r in caplog.records)
    reader.close()


def test_large_values_are_not_hashed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store, _, raw = _build(tmp_path, 60, 4 * TRUST_BYTES_PER_ENTRY)
    with caplog.at_level(logging.WARNING, logger="fastload.formats.lmdb"):
        right = _reader(store, raw, hashlib.sha256(raw).hexdigest())
        wrong = _reader(store, raw, "0" * 64)
        assert not _trusted(right)
        assert not _trusted(wrong)
        assert len(_values(right)) == len(_values(wrong)) == 60
    assert not caplog.records  # not hashed, so nothing to warn about
    right.close()
    wrong.close()


def test_a_shard_of_another_size_is_not_trusted(tmp_path: Path) -> None:
    store, _, raw = _build(tmp_path, 200, 16)
    reader = LMDBReader(
        store, KEY, num_bytes=len(raw) + 4096, sha256=hashlib.sha256(raw).hexdigest()
    )
    assert not _trusted(reader)
    reader.close()


def test_branch_pages_are_read_as_lookups_reach_them(tmp_path: Path) -> None:
    # 300-byte keys: few nodes per page, so a tree of three levels
    store, keys, raw = _build(tmp_path, 600, 16, key_size=300)
    assert struct.unpack_from("<H", raw, struct.unpack_from("<I", raw, 40)[0] + 94)[0] == 3
    reader = _reader(store, raw, None)
    pages = reader._open()[1].pages  # opening read the meta key: one path down
    tree = pages._tree
    branches = sum(isinstance(e, _Branch) for e in tree.entries)
    assert branches > 0  # the subtrees nobody looked into are still unread
    reader.read(599)
    after = pages._tree
    assert len(after.entries) > len(tree.entries)
    assert sum(isinstance(e, _Branch) for e in after.entries) < branches + 2
    assert [s["__key__"] for s in reader] == keys  # and everything reads
    assert all(isinstance(e, _Leaf) for e in pages._tree.entries)
    reader.close()


def test_the_loader_passes_the_manifest_hash_and_reads_trusted(tmp_path: Path) -> None:
    from fastload import open_dataset
    from fastload.formats import Manifest, ShardEntry, write_manifest

    store = open_store(tmp_path)
    writer = get_format("lmdb").writer(store, "s-0.lmdb")
    for i in range(300):
        writer.write({"__key__": f"k{i:04d}", "v": f"{i:016d}".encode()})
    info = writer.close()
    manifest = Manifest(
        format="lmdb",
        shards=[ShardEntry.from_info(info)],
        schema=Manifest.schema_from_fields([info.fields]),
    )
    write_manifest(store, manifest)
    ds = open_dataset(str(tmp_path))
    reader = ds._slot(0).reader
    assert reader.expected_sha256 == info.sha256
    assert _trusted(reader)  # type: ignore[arg-type]
    assert [ds.read_raw(0, i)["v"] for i in range(300)] == [  # type: ignore[index]
        f"{i:016d}".encode() for i in range(300)
    ]


# ---- the hash is remembered across the process tree ----------------------------------------------


def _open_in_child(store: Any, raw: bytes, sha: str, out: Any) -> None:
    out.put(_trusted(_reader(store, raw, sha)))


def test_a_hashed_file_is_remembered_by_the_process_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import multiprocessing

    from fastload.formats import _cache
    from fastload.formats.lmdb import _pages

    store, _, raw = _build(tmp_path, 500, 16)
    path = tmp_path / KEY
    old = path.stat().st_mtime - 10
    os.utime(path, (old, old))  # settled: older than the hash by more than STABLE_AGE_NS
    sha = hashlib.sha256(raw).hexdigest()
    assert not _cache.known(os.stat(path), sha)

    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_open_in_child, args=(store, raw, sha, out))
    child.start()
    assert out.get(timeout=30) is True  # the child hashed it
    child.join(30)
    assert _cache.known(os.stat(path), sha)

    class NoHash:
        @staticmethod
        def sha256(data: Any) -> Any:
            raise AssertionError("hashed again")

    monkeypatch.setattr(_pages, "hashlib", NoHash)
    reader = _reader(store, raw, sha)
    assert _trusted(reader)  # from the record, without hashing
    reader.close()
    assert not _cache.known(os.stat(path), "0" * 64)  # the record is for that hash only


def test_a_file_written_again_or_just_now_is_not_remembered(tmp_path: Path) -> None:
    from fastload.formats import _cache

    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    sha = hashlib.sha256(b"x" * 100).hexdigest()
    assert not _cache.remember(os.stat(path), sha)  # modified just now
    assert not _cache.known(os.stat(path), sha)
    old = path.stat().st_mtime - 10
    os.utime(path, (old, old))
    assert _cache.remember(os.stat(path), sha)
    assert _cache.known(os.stat(path), sha)
    path.write_bytes(b"x" * 100)  # the same bytes, written again: new times
    os.utime(path, (old, old))  # even with the old modification time (the change time moves)
    assert not _cache.known(os.stat(path), sha)


def test_a_match_is_remembered_by_later_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache_config: Callable[..., Any]
) -> None:
    import subprocess
    import sys

    from fastload.formats import _cache
    from fastload.formats.lmdb import _pages

    monkeypatch.setenv("FASTLOAD_INDEX_DIR", str(tmp_path / "records"))  # the other run's
    cache_config(index_dir=tmp_path / "records")  # this process's
    store, _, raw = _build(tmp_path, 300, 16)
    path = tmp_path / KEY
    old = path.stat().st_mtime - 10
    os.utime(path, (old, old))
    sha = hashlib.sha256(raw).hexdigest()
    code = (
        "import sys\n"
        "from fastload.formats.lmdb import LMDBReader\n"
        "from fastload.storage import open_store\n"
        "r = LMDBReader(open_store(sys.argv[1]), sys.argv[2], num_bytes=int(sys.argv[3]),"
        " sha256=sys.argv[4])\n"
        "print(r._open()[1].pages.trusted, r.read(5)['__key__'])\n"
    )
    out = subprocess.run(  # another run: a process that is not forked from this one
        [sys.executable, "-c", code, str(tmp_path), KEY, str(len(raw)), sha],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == ["True", "000005"]
    assert len(list((tmp_path / "records").glob("*.ok"))) == 1

    class NoHash:
        @staticmethod
        def sha256(data: Any) -> Any:
            raise AssertionError("hashed again")

    monkeypatch.setattr(_pages, "hashlib", NoHash)
    assert _cache.known(os.stat(path), sha)
    reader = _reader(store, raw, sha)
    assert _trusted(reader)
    reader.close()
    cache_config(index_dir=None)  # records off: none written, none found
    assert not _cache.remember(os.stat(path), "1" * 64)
    assert not _cache.known(os.stat(path), sha)
    assert len(list((tmp_path / "records").glob("*.ok"))) == 1
