"""Damaged LMDB shards: every damage is a typed error naming the shard and the sample, only the
damaged samples are lost, and nothing crashes.

Shards are written by the real writer and then damaged at the byte level. The tests find their
way in the file by the LMDB layout the package README describes (meta pages at the start, page
size in the first meta page, 16-byte page headers, node offsets after them) and by searching for
a sample's value bytes, which are unique per sample (``<key>`` repeated).
"""

from __future__ import annotations

import random
import re
import struct
import subprocess
import sys
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb
import msgpack
import pytest

import fastload
from fastload.errors import CorruptDataError
from fastload.formats import get_format
from fastload.formats.lmdb import LMDBReader
from fastload.formats.lmdb._envs import acquire, open_env, release
from fastload.formats.lmdb._layout import POSITION_PREFIX, pack_meta, pack_value
from fastload.storage import open_store

pytestmark = pytest.mark.timeout(30)

KEY = "ds/train-000000.lmdb"
P_BRANCH, P_LEAF = 0x01, 0x02


# ---- building and reading shards -----------------------------------------------------------------


def _value(key: str, size: int) -> bytes:
    marker = f"<{key}>".encode()
    return (marker * (size // len(marker) + 1))[:size]


def _fields(key: str, size: int) -> dict[str, bytes]:
    return {"bin": _value(key, size), "cls": str(len(key)).encode()}


@dataclass
class Shard:
    """A shard written by the real writer, and what the tests know about it."""

    path: Path
    store: Any
    keys: list[str]  # insertion order
    size: int  # value bytes per sample
    num_bytes: int

    @property
    def url(self) -> str:
        return str(self.store.child_url(KEY))

    def raw(self) -> bytearray:
        return bytearray(self.path.read_bytes())

    def write(self, raw: bytes | bytearray) -> None:
        self.path.write_bytes(bytes(raw))

    def reader(self, on_error: str = "skip", **options: Any) -> LMDBReader:
        return LMDBReader(self.store, KEY, on_error=on_error, **options)  # type: ignore[arg-type]

    def position(self, key: str) -> int:
        return self.keys.index(key)


def _build(root: Path, keys: list[str], size: int) -> Shard:
    store = open_store(root)
    writer = get_format("lmdb").writer(store, KEY)
    for key in keys:
        writer.write({"__key__": key, **_fields(key, size)})
    info = writer.close()
    return Shard(root / KEY, store, keys, size, info.num_bytes)


@pytest.fixture
def shard(tmp_path: Path) -> Shard:
    """300 samples of 1,500 bytes, two per leaf page, inserted in an order unlike key order."""
    keys = [f"s{i:04d}" for i in range(300)]
    random.Random(0).shuffle(keys)
    return _build(tmp_path, keys, 1500)


def _skip(shard: Shard, **options: Any) -> tuple[list[str], int, list[str]]:
    """(keys delivered, skipped count, error messages) of one iteration under ``skip``."""
    reader = shard.reader("skip", **options)
    keys = [s["__key__"] for s in reader]
    reader.close()
    return keys, reader.skipped, reader.policy.errors


def _raise(shard: Shard, **options: Any) -> tuple[list[str], CorruptDataError]:
    """(keys delivered before the error, the error) of one iteration under ``raise``."""
    reader = shard.reader("raise", **options)
    keys: list[str] = []
    try:
        for sample in reader:
            keys.append(sample["__key__"])
    except CorruptDataError as exc:
        return keys, exc
    finally:
        reader.close()
    raise AssertionError(f"no CorruptDataError; read {len(keys)} samples")


def _check_message(exc: CorruptDataError, shard: Shard) -> None:
    """The message names the shard and gives a remedy that can work."""
    assert exc.url == shard.url
    assert shard.url in str(exc)
    assert "fastload convert" in str(exc)
    assert "fastload index" not in str(exc)


# ---- the test's own reading of the LMDB layout (package README) ----------------------------------


def _psize(raw: bytes | bytearray) -> int:
    psize: int = struct.unpack_from("<I", raw, 40)[0]
    return psize


def _meta_field(raw: bytes | bytearray, offset: int) -> int:
    """A uint64 of meta page 1 (the live one) at ``offset`` in the page."""
    value: int = struct.unpack_from("<Q", raw, _psize(raw) + offset)[0]
    return value


def _flags(raw: bytes | bytearray, page: int) -> int:
    flags: int = struct.unpack_from("<H", raw, page * _psize(raw) + 10)[0]
    return flags


def _nodes(raw: bytes | bytearray, page: int) -> list[int]:
    """Offsets (within the page) of the nodes of a branch or leaf page."""
    start = page * _psize(raw)
    lower = struct.unpack_from("<H", raw, start + 12)[0]
    return list(struct.unpack_from(f"<{(lower - 16) // 2}H", raw, start + 16))


def _children(raw: bytes | bytearray, page: int) -> list[int]:
    start = page * _psize(raw)
    out = []
    for node in _nodes(raw, page):
        lo, hi, top = struct.unpack_from("<HHH", raw, start + node)
        out.append(lo | hi << 16 | top << 32)
    return out


def _page_of(raw: bytes | bytearray, needle: bytes) -> int:
    """The page holding the first occurrence of ``needle``."""
    return raw.index(needle) // _psize(raw)


def _leaf_of(shard: Shard, raw: bytes | bytearray, key: str) -> int:
    """The leaf page holding ``key``'s node (its value is inline)."""
    return _page_of(raw, pack_value(_fields(key, shard.size)))


def _position_page_of(shard: Shard, raw: bytes | bytearray, key: str) -> int:
    return _page_of(raw, POSITION_PREFIX + shard.position(key).to_bytes(8, "big"))


def _samples_on(shard: Shard, raw: bytes | bytearray, pages: set[int]) -> set[str]:
    """Keys whose sample node or position entry lies on one of ``pages``."""
    return {
        key
        for key in shard.keys
        if _leaf_of(shard, raw, key) in pages or _position_page_of(shard, raw, key) in pages
    }


def _in_order(shard: Shard, keys: set[str]) -> list[str]:
    return [k for k in shard.keys if k in keys]


# ---- one damaged leaf page ----------------------------------------------------------------------


def _flip_flags(raw: bytearray, start: int) -> None:
    raw[start + 10] ^= 0x07  # P_LEAF becomes P_BRANCH | P_OVERFLOW


def _wrong_page_number(raw: bytearray, start: int) -> None:
    raw[start + 1] ^= 0x40


def _impossible_bounds(raw: bytearray, start: int) -> None:
    upper = struct.unpack_from("<H", raw, start + 14)[0]
    struct.pack_into("<H", raw, start + 12, upper + 2)  # mp_lower above mp_upper


def _node_outside_the_page(raw: bytearray, start: int) -> None:
    struct.pack_into("<H", raw, start + 16, 0xFFF0)  # node 0 points past the page end


def _key_size_past_the_page(raw: bytearray, start: int) -> None:
    node = struct.unpack_from("<H", raw, start + 16)[0]
    struct.pack_into("<H", raw, start + node + 6, 0x0FFF)  # node 0's key size


def _nodes_swapped(raw: bytearray, start: int) -> None:
    first, second = struct.unpack_from("<HH", raw, start + 16)
    struct.pack_into("<HH", raw, start + 16, second, first)  # keys out of order


def _zeroed(raw: bytearray, start: int) -> None:
    raw[start : start + _psize(raw)] = bytes(_psize(raw))


LEAF_DAMAGE: dict[str, Callable[[bytearray, int], None]] = {
    "flags": _flip_flags,
    "page number": _wrong_page_number,
    "bounds": _impossible_bounds,
    "node offset": _node_outside_the_page,
    "key size": _key_size_past_the_page,
    "node order": _nodes_swapped,
    "zeroed": _zeroed,
}


@pytest.mark.parametrize("damage", list(LEAF_DAMAGE))
def test_damaged_leaf_page_loses_exactly_its_samples(shard: Shard, damage: str) -> None:
    raw = shard.raw()
    victim = _leaf_of(shard, raw, shard.keys[150])
    lost = _samples_on(shard, raw, {victim})
    assert len(lost) == 2  # the two samples on that page, as in the issue
    LEAF_DAMAGE[damage](raw, victim * _psize(raw))
    shard.write(raw)

    keys, skipped, errors = _skip(shard)
    assert keys == [k for k in shard.keys if k not in lost]
    assert skipped == 2
    assert all(f"leaf page {victim} is damaged" in e for e in errors)

    first = _in_order(shard, lost)[0]
    before, exc = _raise(shard)
    assert before == shard.keys[: shard.position(first)]
    assert exc.key == first
    assert f"position {shard.position(first)}:" in str(exc)
    assert exc.offset is not None
    assert victim * _psize(raw) <= exc.offset < (victim + 1) * _psize(raw)
    _check_message(exc, shard)


def test_reads_after_a_damaged_sample_still_work(shard: Shard) -> None:
    """The issue's MDB_BAD_TXN: after one failed read, every later read in the thread failed."""
    raw = shard.raw()
    victim = _leaf_of(shard, raw, shard.keys[150])
    lost = _in_order(shard, _samples_on(shard, raw, {victim}))
    _flip_flags(raw, victim * _psize(raw))
    shard.write(raw)
    reader = shard.reader("raise")
    intact = [k for k in shard.keys if k not in lost]
    for key in lost:
        with pytest.raises(CorruptDataError, match=f"leaf page {victim}") as info:
            reader.read(shard.position(key))
        assert info.value.key == key
        with pytest.raises(CorruptDataError) as info:
            reader.get_key(key)
        assert info.value.key == key
        for other in intact[::25]:  # random access after the error
            assert reader.read(shard.position(other))["__key__"] == other
            assert reader.get_key(other)["bin"] == _value(other, shard.size)
    got = list(reader.iter_from(shard.position(lost[-1]) + 1))  # iteration after the errors
    assert [s["__key__"] for s in got] == shard.keys[shard.position(lost[-1]) + 1 :]
    assert len(reader) == 300
    reader.close()


def test_lmdb_error_ends_the_transaction_and_the_next_read_starts_a_fresh_one(
    shard: Shard,
) -> None:
    """What LMDB does after an error in a read transaction, and the shared environment's remedy
    (real LMDB on a damaged page, without the reader's page checks in front)."""
    raw = shard.raw()
    victim = _leaf_of(shard, raw, shard.keys[150])
    _flip_flags(raw, victim * _psize(raw))  # LMDB itself notices a page of the wrong type
    shard.write(raw)
    entry = acquire(str(shard.path), opener=lambda p: (open_env(p, readahead=False), None))
    try:
        txn = entry.txn()
        with pytest.raises(lmdb.Error) as info:
            txn.get(shard.keys[150].encode())
        assert not isinstance(info.value, lmdb.BadTxnError)
        with pytest.raises(lmdb.BadTxnError):  # LMDB refuses everything after the error
            txn.get(shard.keys[0].encode())
        entry.discard_txn()
        fresh = entry.txn()
        assert fresh is not txn
        assert msgpack.unpackb(fresh.get(shard.keys[0].encode())) == _fields(shard.keys[0], 1500)
    finally:
        release(entry)


_CRASH_CHILD = """
import sys
from fastload.formats.lmdb import LMDBReader
from fastload.storage import open_store
reader = LMDBReader(open_store(sys.argv[1]), sys.argv[2], on_error="skip")
print(" ".join(s["__key__"] for s in reader))
print(reader.skipped)
"""


def test_damaged_node_tables_do_not_crash_the_process(shard: Shard) -> None:
    """Node offsets pointing outside the page made LMDB read outside the map: SIGBUS. In a
    child process, so that a regression fails this test instead of killing the run."""
    raw = shard.raw()
    psize = _psize(raw)
    leaves = sorted({_leaf_of(shard, raw, k) for k in shard.keys})
    damaged = set(leaves[1::2])  # every other page of samples
    for page in damaged:
        start = page * psize
        count = len(_nodes(raw, page))
        raw[start + 16 : start + 16 + 2 * count] = b"\xff" * (2 * count)
    shard.write(raw)
    lost = _samples_on(shard, raw, damaged)
    proc = subprocess.run(
        [sys.executable, "-c", _CRASH_CHILD, str(shard.path.parent.parent), KEY],
        capture_output=True,
        text=True,
        timeout=25,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    keys, skipped = proc.stdout.splitlines()
    assert keys.split() == [k for k in shard.keys if k not in lost]
    assert int(skipped) == len(lost) > 100


# ---- branch pages ---------------------------------------------------------------------------------


@pytest.fixture
def deep(tmp_path: Path) -> Shard:
    """400 samples with 300-byte keys: a tree three levels deep."""
    keys = [f"{i:04d}" + "k" * 300 for i in range(400)]
    random.Random(3).shuffle(keys)
    shard = _build(tmp_path, keys, 200)
    raw = shard.raw()
    assert struct.unpack_from("<H", raw, _psize(raw) + 94)[0] == 3  # md_depth
    return shard


def test_damaged_branch_page_loses_only_the_samples_below_it(deep: Shard) -> None:
    raw = deep.raw()
    root = _meta_field(raw, 128)
    middle = [c for c in _children(raw, root) if _flags(raw, c) == P_BRANCH]
    victim = middle[1]
    leaves = set(_children(raw, victim))
    lost = _samples_on(deep, raw, leaves)
    assert 0 < len(lost) < 400
    raw[victim * _psize(raw) + 10] ^= 0x03  # P_BRANCH becomes P_LEAF
    deep.write(raw)

    keys, skipped, errors = _skip(deep)
    assert keys == [k for k in deep.keys if k not in lost]
    assert skipped == len(lost)
    assert all(f"branch page {victim} is damaged" in e for e in errors)
    first = _in_order(deep, lost)[0]
    _, exc = _raise(deep)
    assert exc.key == first or (exc.key is None and f"position {deep.position(first)}" in str(exc))
    _check_message(exc, deep)


def test_damaged_root_page_makes_the_shard_unreadable(shard: Shard) -> None:
    raw = shard.raw()
    root = _meta_field(raw, 128)
    raw[root * _psize(raw) + 10] ^= 0x03
    shard.write(raw)
    assert _skip(shard)[:2] == ([], 1)  # a shard that cannot be opened counts as one skip
    _, exc = _raise(shard)
    assert f"page {root} is damaged" in str(exc)  # the root now claims to be a leaf
    assert exc.key == "\x00fastload/meta"  # the first key the reader needs
    _check_message(exc, shard)
    with pytest.raises(CorruptDataError, match=f"page {root} is damaged"):
        shard.reader("skip").read(0)


# ---- truncated files ------------------------------------------------------------------------------


def _cuts(shard: Shard) -> dict[str, int]:
    raw = shard.raw()
    psize, size, root = _psize(raw), len(raw), _meta_field(raw, 128)
    return {
        "last byte": size - 1,
        "last page": size - psize,
        "mid page": size // 2 + 123,
        "page boundary": (size // psize // 2) * psize,
        "a quarter in": size // 4,
        "in the root": root * psize + 100,
        "in meta page 1": psize + 100,
        "in meta page 0": 100,
        "empty": 0,
    }


@pytest.mark.parametrize(
    "cut",
    [
        "last byte",
        "last page",
        "mid page",
        "page boundary",
        "a quarter in",
        "in the root",
        "in meta page 1",
        "in meta page 0",
        "empty",
    ],
)
@pytest.mark.parametrize("manifest", [True, False])
def test_truncated_shard_keeps_the_samples_before_the_cut(
    shard: Shard, cut: str, manifest: bool
) -> None:
    raw = shard.raw()
    psize, root = _psize(raw), _meta_field(raw, 128)
    at = _cuts(shard)[cut]
    whole = set(range(at // psize))  # pages wholly before the cut
    present = {
        k
        for k in shard.keys
        if _leaf_of(shard, raw, k) in whole and _position_page_of(shard, raw, k) in whole
    }
    shard.write(raw[:at])
    options: dict[str, Any] = {"num_bytes": shard.num_bytes} if manifest else {}

    keys, skipped, errors = _skip(shard, **options)
    before, exc = _raise(shard, **options)
    _check_message(exc, shard)
    if root in whole:
        assert 0 < len(present) < 300
        assert keys == _in_order(shard, present)
        assert skipped == 300 - len(present)
        missing = _in_order(shard, set(shard.keys) - present)[0]
        assert before == shard.keys[: shard.position(missing)]
        assert f"truncated at {at} bytes" in str(exc)
        assert exc.key == missing
        if manifest:
            assert f"the manifest says {shard.num_bytes}" in str(exc)
        reader = shard.reader("raise", **options)
        for key in shard.keys[::10]:
            if key in present:
                assert reader.get_key(key)["bin"] == _value(key, shard.size)
            else:
                with pytest.raises(CorruptDataError, match="truncated"):
                    reader.read(shard.position(key))
        reader.close()
    else:  # the root (or a meta page) is gone: nothing can be found
        assert (keys, skipped) == ([], 1)
        assert before == []
        expected = "not an LMDB file" if at < psize else "missing|truncated|damaged"
        assert errors
        assert len(errors) == 1
        assert exc.key is None or exc.key == "\x00fastload/meta"
        assert re.search(expected, str(exc))


def test_shard_truncated_in_place_while_open(shard: Shard) -> None:
    raw = shard.raw()
    psize = _psize(raw)
    at = (len(raw) // psize - 20) * psize
    whole = set(range(at // psize))
    present = {k for k in shard.keys if _leaf_of(shard, raw, k) in whole}
    reader = shard.reader("skip")
    assert reader.read(0)["__key__"] == shard.keys[0]  # opened and mapped
    it = iter(reader)
    head = [next(it)["__key__"] for _ in range(3)]
    with open(shard.path, "r+b") as file:
        file.truncate(at)  # in place: the mapping now ends early
    keys = head + [s["__key__"] for s in it]
    assert keys == _in_order(shard, present)
    assert reader.skipped == 300 - len(present)
    assert any("truncated to" in e and "while open" in e for e in reader.policy.errors)
    gone = _in_order(shard, set(shard.keys) - present)[0]
    with pytest.raises(CorruptDataError, match="while open"):
        reader.read(shard.position(gone))
    reader.close()


# ---- meta pages and files that are not LMDB -----------------------------------------------------


def _poke(offset: Callable[[int], int], value: int, width: int) -> Callable[[bytearray], None]:
    def edit(raw: bytearray) -> None:
        at = offset(_psize(raw))
        raw[at : at + width] = value.to_bytes(width, "little")

    return edit


def _zero_meta_1(raw: bytearray) -> None:
    psize = _psize(raw)
    raw[psize : 2 * psize] = bytes(psize)


META_DAMAGE: dict[str, tuple[Callable[[bytearray], None], str, Callable[[int], int] | None]] = {
    # name: (edit, message, byte offset named)
    "meta 0 magic": (_poke(lambda p: 16, 0xDEADBEEF, 4), "meta page 0 is damaged", lambda p: 0),
    "meta 1 magic": (_poke(lambda p: p + 16, 0xDEADBEEF, 4), "meta page 1 is damaged", None),
    "meta 0 page size": (
        _poke(lambda p: 40, 8192, 4),
        "meta page 0 is damaged: it records page size 8192",
        lambda p: 40,
    ),
    "meta 1 page size": (_poke(lambda p: p + 40, 512, 4), "meta page 1 records page size", None),
    "meta 1 txnid": (_poke(lambda p: p + 144, 0, 8), "describes an empty database", lambda p: 0),
    "meta 1 root": (_poke(lambda p: p + 128, 10**6, 8), "root page 1000000", None),
    "meta 1 flags": (_poke(lambda p: p + 92, 0x04, 2), "main database flags 0x4", None),
    "meta 1 last page": (_poke(lambda p: p + 136, 1 << 47, 8), "truncated, or the meta", None),
    "meta 1 zeroed": (_zero_meta_1, "meta page 1 is damaged", None),
}


@pytest.mark.parametrize("damage", list(META_DAMAGE))
def test_damaged_meta_page(shard: Shard, damage: str) -> None:
    edit, message, offset = META_DAMAGE[damage]
    raw = shard.raw()
    edit(raw)
    shard.write(raw)
    keys, skipped, errors = _skip(shard)
    assert (keys, skipped) == ([], 1)
    assert message in errors[0]
    _, exc = _raise(shard)
    assert message in str(exc)
    _check_message(exc, shard)
    if offset is not None:
        assert exc.offset == offset(_psize(raw))
    with pytest.raises(CorruptDataError, match=message):
        len(shard.reader("raise"))
    with pytest.raises(CorruptDataError, match=message):
        shard.reader("skip").read(0)


def _tar_bytes(tmp_path: Path) -> bytes:
    (tmp_path / "a.txt").write_bytes(b"x" * 10_000)
    with tarfile.open(tmp_path / "x.tar", "w") as tar:
        tar.add(tmp_path / "a.txt", arcname="a.txt")
    return (tmp_path / "x.tar").read_bytes()


@pytest.mark.parametrize("kind", ["random", "tar", "text", "empty", "zeros"])
def test_file_that_is_not_lmdb(shard: Shard, tmp_path: Path, kind: str) -> None:
    data = {
        "random": random.Random(1).randbytes(50_000),
        "tar": _tar_bytes(tmp_path),
        "text": b"hello\n" * 2000,
        "empty": b"",
        "zeros": bytes(20_000),
    }[kind]
    shard.write(data)
    assert _skip(shard)[:2] == ([], 1)
    _, exc = _raise(shard)
    assert "not an LMDB file" in str(exc)
    assert exc.offset == 0
    _check_message(exc, shard)


# ---- values and reserved keys -------------------------------------------------------------------


def _replace_once(raw: bytearray, old: bytes, new: bytes) -> None:
    assert len(old) == len(new)
    assert raw.count(old) == 1
    at = raw.index(old)
    raw[at : at + len(old)] = new


def _broken_value(value: bytes, edit: str) -> tuple[bytes, str]:
    """One sample's value (``{"bin": 1,500 bytes, "cls": 1 byte}``) edited in place, and the
    message it must give."""
    assert value[:8] == b"\x82\xa3bin\xc5\x05\xdc"
    cls = value.rindex(b"\xa3cls")
    if edit == "not msgpack":
        return b"\xc1" + value[1:], "not valid msgpack"
    if edit == "a list":
        return b"\x94" + value[1:], "msgpack list, expected a map"  # 4 items: all of them
    if edit == "str field":  # bin 16 becomes str 16 (the bytes are ASCII)
        return value[:5] + b"\xda" + value[6:], "not a str name with a bytes value"
    if edit == "repeated field":
        return value[:cls] + b"\xa3bin" + value[cls + 4 :], "repeats a field name"
    if edit == "reserved field":
        return value[:cls] + b"\xa3__k" + value[cls + 4 :], "not a str name"
    assert edit == "truncated map"  # the last field claims 9 bytes, 1 is there
    return value[: cls + 5] + b"\x09" + value[cls + 6 :], "not valid msgpack"


@pytest.mark.parametrize(
    "edit",
    ["not msgpack", "a list", "str field", "repeated field", "reserved field", "truncated map"],
)
def test_broken_sample_value_loses_only_that_sample(shard: Shard, edit: str) -> None:
    victim = shard.keys[77]
    value = pack_value(_fields(victim, 1500))
    damaged, message = _broken_value(value, edit)
    raw = shard.raw()
    _replace_once(raw, value, damaged)
    shard.write(raw)

    keys, skipped, errors = _skip(shard)
    assert keys == [k for k in shard.keys if k != victim]
    assert skipped == 1
    assert message in errors[0]
    before, exc = _raise(shard)
    assert before == shard.keys[:77]
    assert exc.key == victim
    assert "position 77:" in str(exc)
    _check_message(exc, shard)
    reader = shard.reader("raise")
    with pytest.raises(CorruptDataError, match=message):
        reader.get_key(victim)
    assert reader.read(78)["__key__"] == shard.keys[78]
    reader.close()


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        (b"\x83\xa6format", b"\xc1\xa6format", "meta value is not valid msgpack"),
        (b"fastload-lmdb", b"fastload-lmdc", "meta value is not a 'fastload-lmdb' map"),
        (b"\xabnum_samples\xcd", b"\xabnum_samples\xcb", "meta value"),
    ],
)
def test_damaged_meta_value(shard: Shard, old: bytes, new: bytes, message: str) -> None:
    raw = shard.raw()
    assert pack_meta(300) in raw
    _replace_once(raw, old, new)
    shard.write(raw)
    assert _skip(shard)[:2] == ([], 1)
    _, exc = _raise(shard)
    assert message in str(exc)
    assert exc.key == "\x00fastload/meta"
    _check_message(exc, shard)


def test_meta_count_larger_than_the_position_entries(shard: Shard) -> None:
    raw = shard.raw()
    _replace_once(raw, b"num_samples\xcd\x01\x2c", b"num_samples\xcd\x01\x2e")  # 300 -> 302
    shard.write(raw)
    keys, skipped, errors = _skip(shard)
    assert keys == shard.keys
    assert skipped == 2
    assert all("position entry is missing" in e for e in errors)
    assert "position 300:" in errors[0]
    assert "position 301:" in errors[1]
    # With the manifest's count the reader serves 300 samples and reports the surplus.
    keys, skipped, errors = _skip(shard, num_samples=300)
    assert (keys, skipped) == (shard.keys, 1)
    assert "holds 302 samples, but the manifest lists 300" in errors[0]


def test_damaged_position_entries(shard: Shard) -> None:
    raw = shard.raw()
    renamed, reserved = shard.keys[10], shard.keys[20]
    for key, new in ((renamed, b"t"), (reserved, b"\x00")):
        entry = POSITION_PREFIX + shard.position(key).to_bytes(8, "big")
        at = raw.index(entry) + len(entry)  # the entry's value, the sample key, follows its key
        assert raw[at : at + len(key)] == key.encode()
        raw[at : at + 1] = new
    shard.write(raw)
    keys, skipped, errors = _skip(shard)
    assert keys == [k for k in shard.keys if k not in (renamed, reserved)]
    assert skipped == 2
    assert "position 10: its position entry names a sample that is not in the shard" in errors[0]
    assert "position 20: its position entry holds an impossible sample key" in errors[1]
    reader = shard.reader("raise")
    assert reader.get_key(renamed)["bin"] == _value(renamed, 1500)  # still there by key
    with pytest.raises(CorruptDataError, match="not in the shard"):
        reader.read(10)
    reader.close()


# ---- values on overflow pages -------------------------------------------------------------------


@pytest.fixture
def big(tmp_path: Path) -> Shard:
    """60 samples of 20 kB: every value on its own run of overflow pages."""
    keys = [f"b{i:03d}" for i in range(60)]
    random.Random(2).shuffle(keys)
    return _build(tmp_path, keys, 20_000)


def _big_node(raw: bytes | bytearray, key: str) -> int:
    """File offset of the leaf node of ``key`` (flags F_BIGDATA, key, then an overflow page)."""
    kbytes = key.encode()
    at = raw.find(kbytes)
    while at >= 0:
        node = at - 8
        flags, ksize = struct.unpack_from("<HH", raw, node + 4)
        if flags == 1 and ksize == len(kbytes):
            return node
        at = raw.find(kbytes, at + 1)
    raise AssertionError(f"no leaf node for {key}")


def _overflow_page(raw: bytes | bytearray, key: str) -> int:
    node = _big_node(raw, key)
    ksize = struct.unpack_from("<H", raw, node + 6)[0]
    page: int = struct.unpack_from("<Q", raw, node + 8 + ksize)[0]
    return page


@pytest.mark.parametrize("damage", ["pointer", "overflow header", "value size"])
def test_damaged_overflow_value_loses_only_that_sample(big: Shard, damage: str) -> None:
    victim = big.keys[30]
    raw = big.raw()
    psize = _psize(raw)
    node = _big_node(raw, victim)
    page = _overflow_page(raw, victim)
    assert raw[page * psize + 16 :].startswith(b"\x82\xa3bin")
    if damage == "pointer":
        struct.pack_into("<Q", raw, node + 8 + len(victim), page + 1)  # into the run's middle
        message = "overflow page"
    elif damage == "overflow header":
        raw[page * psize + 10] ^= 0x06  # P_OVERFLOW becomes P_LEAF
        message = f"overflow page {page} of a"
    else:
        struct.pack_into("<H", raw, node + 2, 0x7FFF)  # the value would end far past the file
        message = "missing|damaged"
    big.write(raw)
    keys, skipped, errors = _skip(big)
    assert keys == [k for k in big.keys if k != victim]
    assert skipped == 1
    assert re.search(message, errors[0])
    before, exc = _raise(big)
    assert before == big.keys[:30]
    assert exc.key == victim
    _check_message(exc, big)


def test_truncated_in_an_overflow_run(big: Shard) -> None:
    raw = big.raw()
    psize = _psize(raw)
    last = max(big.keys, key=lambda k: _overflow_page(raw, k))
    start = _overflow_page(raw, last)
    assert len(raw) <= (start + 6) * psize  # its run (5 pages for 20 kB) ends the file
    big.write(raw[: start * psize + 3000])
    keys, skipped, errors = _skip(big, num_bytes=big.num_bytes)
    assert keys == [k for k in big.keys if k != last]
    assert skipped == 1
    assert "truncated at" in errors[0]
    assert f"key {last!r}" in errors[0]


# ---- the manifest's counts -----------------------------------------------------------------------


def test_manifest_that_lists_more_samples_than_the_shard_holds(shard: Shard) -> None:
    reader = shard.reader("raise", num_samples=303, num_bytes=shard.num_bytes)
    assert len(reader) == 303
    with pytest.raises(CorruptDataError) as info:
        reader.read(301)
    assert "the manifest lists 303 samples for this shard, but the shard holds 300" in str(
        info.value
    )
    assert "position 301" in str(info.value)
    _check_message(info.value, shard)
    with pytest.raises(IndexError):
        reader.read(303)
    assert reader.read(299)["__key__"] == shard.keys[299]
    keys, skipped, errors = _skip(shard, num_samples=303)
    assert (keys, skipped) == (shard.keys, 3)
    assert ["position 300" in errors[0], "position 302" in errors[2]] == [True, True]
    before, exc = _raise(shard, num_samples=303)
    assert before == shard.keys
    assert "holds 300" in str(exc)


def test_manifest_that_lists_fewer_samples_than_the_shard_holds(shard: Shard) -> None:
    reader = shard.reader("raise", num_samples=298)
    assert len(reader) == 298
    with pytest.raises(IndexError):
        reader.read(298)
    keys, skipped, errors = _skip(shard, num_samples=298)
    assert (keys, skipped) == (shard.keys[:298], 1)
    assert "holds 300 samples, but the manifest lists 298" in errors[0]


# ---- through the loader ---------------------------------------------------------------------------


def _keys_collate(samples: list[Any]) -> list[str]:
    return [s["__key__"] for s in samples]


@pytest.mark.timeout(60)
def test_loader_with_two_workers_skips_exactly_the_damaged_page(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for i in range(120):
        path = src / f"g{i % 3}" / f"x{i:04d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_value(f"g{i % 3}/x{i:04d}", 1500))
    dst = tmp_path / "ds"
    fastload.convert(src, dst, format="lmdb", shard_samples=60, workers=1, quiet=True)
    shards = sorted(dst.glob("*.lmdb"))
    assert len(shards) == 2
    raw = bytearray(shards[1].read_bytes())
    psize = _psize(raw)
    all_keys = sorted(f"g{i % 3}/x{i:04d}" for i in range(120))
    in_second = [k for k in all_keys if _value(k, 1500) in raw]
    assert len(in_second) == 60
    victim = raw.index(_value(in_second[30], 1500)) // psize
    page = raw[victim * psize : (victim + 1) * psize]
    lost = {k for k in in_second if _value(k, 1500) in page}
    assert len(lost) == 2
    raw[victim * _psize(raw) + 10] ^= 0x07
    shards[1].write_bytes(bytes(raw))

    ds = fastload.open_dataset(dst, on_error="skip", seed=3)
    loader = fastload.DataLoader(ds, batch_size=8, num_workers=2, collate_fn=_keys_collate)
    keys = [k for batch in loader for k in batch]
    assert sorted(keys) == sorted(set(all_keys) - lost)
    assert loader.stats()["skipped"] == 2
