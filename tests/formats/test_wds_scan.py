"""The tar header scanner, ``scan``: both ways of reading (with and without data) agree with
Python's tarfile, and the damage the corpus tests in ``tests/reliability`` do not reach is
reported as it should be."""

from __future__ import annotations

import io
import tarfile

from hypothesis import given, settings
from hypothesis import strategies as st

from fastload.errors import CorruptDataError
from fastload.formats.webdataset._scan import DIRECTORY, OTHER, REGULAR, Bad, Member, scan

URL = "memory://x/s.tar"
BLOCK = 512
END = bytes(2 * BLOCK)


def _header(name: str, size: int, kind: bytes = tarfile.REGTYPE) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.type = size, kind
    return info.tobuf(tarfile.USTAR_FORMAT)


def _padded(data: bytes) -> bytes:
    return data + bytes(-len(data) % BLOCK)


def _member(name: str, data: bytes) -> bytes:
    return _header(name, len(data)) + _padded(data)


def _pax(body: bytes) -> bytes:
    return _header("././@PaxHeader", len(body), tarfile.XHDTYPE) + _padded(body)


def _scan(shard: bytes, want_data: bool) -> list[Member | Bad]:
    return list(scan(shard, URL, want_data=want_data))


def _members(items: list[Member | Bad]) -> list[Member]:
    return [item for item in items if isinstance(item, tuple)]


def _problem(item: Member | Bad) -> tuple[str, int | None, bool, bool, str | None]:
    assert isinstance(item, Bad), item
    assert isinstance(item.error, CorruptDataError)
    return str(item.error), item.error.offset, item.fatal, item.lost_next, item.member


_SEGMENT = st.text("abcxyz_0", min_size=1, max_size=70)


@st.composite
def _archives(draw: st.DrawFn) -> tuple[int, bytes]:
    """A tar written by tarfile in one of its formats: regular files (short paths, paths that
    need a ustar prefix, a GNU long name or a pax path, non-ASCII ones), directories and links."""
    fmt = draw(st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for i in range(draw(st.integers(0, 8))):
            path = "/".join(draw(st.lists(_SEGMENT, min_size=1, max_size=4)))
            if fmt != tarfile.USTAR_FORMAT and draw(st.booleans()):
                path += "\u00e9" * draw(st.integers(1, 60))  # beyond 100 bytes, or not ASCII
            info = tarfile.TarInfo(f"{path}.{i}")
            kind = draw(st.sampled_from([tarfile.REGTYPE] * 4 + [tarfile.DIRTYPE, tarfile.SYMTYPE]))
            data = draw(st.binary(max_size=1100)) if kind == tarfile.REGTYPE else b""
            info.type, info.size, info.linkname = kind, len(data), "target"
            try:
                tar.addfile(info, io.BytesIO(data))
            except ValueError:  # a path that ustar cannot hold
                pass
    return fmt, buf.getvalue()


@settings(max_examples=60, deadline=None)
@given(archive=_archives())
def test_scan_with_and_without_data_agrees_with_tarfile(archive: tuple[int, bytes]) -> None:
    _fmt, shard = archive
    with tarfile.open(fileobj=io.BytesIO(shard)) as tar:
        expected = [
            (m.name, f.read())
            for m in tar.getmembers()
            if m.isreg() and (f := tar.extractfile(m)) is not None
        ]
        kinds = [m.type for m in tar.getmembers()]
    items = _scan(shard, want_data=True), _scan(shard, want_data=False)
    with_data, without = _members(items[0]), _members(items[1])
    assert (len(with_data), len(without)) == (len(items[0]), len(items[1]))  # no problem found
    assert [(m[0], m[6]) for m in with_data if m[1] == REGULAR] == expected
    assert [(*m[:6], None) for m in with_data] == without
    assert [m[1] for m in without] == [
        {tarfile.REGTYPE: REGULAR, tarfile.DIRTYPE: DIRECTORY}.get(k, OTHER) for k in kinds
    ]


def test_a_cut_member_is_reported_with_and_without_data() -> None:
    shard = _member("a.txt", b"a" * 10) + _header("b.bin", 1000) + b"b" * 300
    for want_data, message, offset in [
        (True, "inside member 'b.bin', which declares 1000 bytes at byte offset 1536", 1836),
        (False, "inside member 'b.bin' (declared size 1000 at byte offset 1536)", 1836),
    ]:
        items = _scan(shard, want_data)
        assert _members(items)[0][:6] == ("a.txt", REGULAR, "regular file", 0, 512, 10)
        text, at, fatal, lost_next, member = _problem(items[1])
        assert f"tar archive ends {message}; the shard is truncated" in text
        assert (at, fatal, lost_next, member, len(items)) == (offset, True, False, "b.bin", 2)


def test_a_pax_size_record_that_is_not_a_number_stops_the_scan() -> None:
    shard = _member("a.txt", b"a") + _pax(b"12 size=abc\n") + _member("b.txt", b"b") + END
    for want_data in (True, False):
        items = _scan(shard, want_data)
        assert [m[0] for m in _members(items)] == ["a.txt"]
        text, at, fatal, lost_next, _ = _problem(items[1])
        assert text.startswith("pax size record b'abc' is not a number")
        assert (at, fatal, lost_next, len(items)) == (2048, True, False, 2)  # b.txt's header


def test_an_empty_pax_path_loses_the_member_it_describes() -> None:
    pax = _pax(b"8 path=\n")
    shard = _member("a.txt", b"a") + pax + _member("b.txt", b"b") + _member("c.txt", b"c") + END
    for want_data in (True, False):
        items = _scan(shard, want_data)
        text, at, fatal, lost_next, _ = _problem(items[1])
        assert "malformed pax extended header: its 'path' record is empty" in text
        assert (at, fatal, lost_next) == (1024, False, True)
        members = _members(items)
        assert [m[0] for m in members] == ["a.txt", "c.txt"]
        assert len(items) == 3
        assert members[1][3:6] == (3072, 3584, 1)


def test_the_shard_ending_inside_a_member_passed_over_is_a_truncation() -> None:
    shard = _pax(b"8 path=\n") + _header("b.bin", 5000) + b"b" * 700
    for want_data in (True, False):
        items = _scan(shard, want_data)
        assert _problem(items[0])[1:] == (0, False, True, None)
        text, at, fatal, lost_next, member = _problem(items[1])
        assert "ends inside a member of declared size 5000 at byte offset 1536" in text
        assert (at, fatal, lost_next, member, len(items)) == (len(shard), True, False, None, 2)
