"""The vectorised parse of the common WebDataset index shape accepts exactly what the line-by-line
parse accepts, with the same result, and the compact index reads back as the samples it holds;
the index rebuilt from a read pass (``fastload verify``) is the one ``build_index`` gives."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload.errors import CorruptDataError
from fastload.formats.webdataset._compact import SampleIndex, parse_uniform
from fastload.formats.webdataset.index import (
    Component,
    _parse_lines,
    build_index,
    format_index,
    load_index,
    parse_index,
)
from fastload.formats.webdataset.reader import WebDatasetReader
from fastload.storage import LocalStore, Store

#: Path segments and fields, well-formed ones drawn far more often than the rest.
_SEGMENT = st.sampled_from(["a", "dir", "x.y", "é"] * 6 + ["..", "", "\\", "/", "__k", "a b"])
_EXT = st.sampled_from(["cls", "jpg", "seg.png", "txt", "é"] * 4 + ["__key__", "a/b", "c\\d"])


@st.composite
def _samples(draw: st.DrawFn) -> list[list[Component]]:
    """Samples in shard order: mostly well-formed, sometimes with a bad name, field or number."""
    exts = draw(st.lists(_EXT, min_size=1, max_size=3))
    offset = 512
    out: list[list[Component]] = []
    dirs = draw(st.lists(_SEGMENT, max_size=2))
    for i in range(draw(st.integers(1, 12))):
        if draw(st.booleans()):
            dirs = draw(st.lists(_SEGMENT, max_size=2))
        base = st.sampled_from([f"k{i}"] * 20 + [f"k{i // 2}", ".h", f"k.{i}", ""])
        key = "/".join([*dirs, draw(base)])
        if draw(st.integers(0, 40)) == 0:
            key = "/" + key
        comps = []
        for ext in exts:
            size = draw(st.sampled_from([0, 1, 511, 512, 700]))
            offset += draw(st.sampled_from([0] * 40 + [512, -512, 1]))
            comps.append(Component(ext, offset, size, f"{key}.{ext}"))
            offset += size + (-size % 512) + 512
        out.append(comps)
    return out


def _lines(data: bytes) -> list[bytes]:
    lines = data.split(b"\n")
    while lines and not lines[-1].strip():
        lines.pop()
    return lines


@settings(max_examples=400, deadline=None)
@given(samples=_samples(), spacing=st.sampled_from([b" ", b"  ", b"\t"]))
def test_vectorised_parse_agrees_with_the_line_by_line_parse(
    samples: list[list[Component]], spacing: bytes
) -> None:
    data = format_index(samples).replace(b" ", spacing).replace(b"v1.2" + spacing, b"v1.2 ", 1)
    lines = _lines(data)
    try:
        expected: list[list[Component]] | None = _parse_lines(lines, 4, "u")
    except CorruptDataError:
        expected = None
    fast = parse_uniform(data, lines[1:])
    if fast is not None:
        assert expected is not None, data
        assert fast.samples() == expected
    if expected is None:
        with pytest.raises(CorruptDataError):
            load_index(data)
    else:
        assert parse_index(data) == expected


def test_common_shape_takes_the_vectorised_parse() -> None:
    samples = [
        [
            Component("cls", 512 + 2048 * i, 1, f"d/k{i}.cls"),
            Component("jpg", 1536 + 2048 * i, 9, f"d/k{i}.jpg"),
        ]
        for i in range(5)
    ]
    data = format_index(samples)
    index = parse_uniform(data, _lines(data)[1:])
    assert index is not None
    assert index.samples() == samples
    assert index.key(3) == "d/k3"
    assert len(index) == 5
    assert index.truncated(2).samples() == samples[:2]
    assert SampleIndex.from_samples(samples).samples() == samples
    assert 0 < index.nbytes < 400
    with pytest.raises(CorruptDataError, match=r"line 6 points at bytes \[9728, 9737\)"):
        index.check_bound(9736, "u")
    index.check_bound(9737, "u")


def _never(_store: Store, _key: str) -> bytes:
    raise AssertionError("the index must come from the read pass")


@pytest.mark.parametrize(
    "tar_format", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]
)
def test_index_from_the_read_pass_equals_build_index(tmp_path: Path, tar_format: int) -> None:
    """``fastload verify`` reads a shard once: the index rebuilt from the samples' pass is the
    bytes ``build_index`` gives, for long names (ustar prefix, GNU and pax headers) too."""
    long = "d" * 90 if tar_format == tarfile.USTAR_FORMAT else "é" * 120
    with tarfile.open(tmp_path / "s.tar", "w", format=tar_format) as tar:
        for i in range(5):
            for ext, data in (("cls", str(i).encode()), ("bin", bytes(700 * i))):
                info = tarfile.TarInfo(f"{long}/k{i}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    store = LocalStore(str(tmp_path))
    reader = WebDatasetReader(store, "s.tar", on_error="skip")
    samples, index = reader.iter_and_index(_never)
    assert [s["__key__"] for s in samples] == [f"{long}/k{i}" for i in range(5)]
    assert index() == build_index(store, "s.tar")


def test_index_after_damage_comes_from_build_index(tmp_path: Path) -> None:
    """A pass that met damage (skipped under ``skip``) leaves the index to ``build_index``, which
    reports the damage as it always did."""
    with tarfile.open(tmp_path / "s.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(4):
            info = tarfile.TarInfo(f"k{i}.cls")
            info.size = 3
            tar.addfile(info, io.BytesIO(b"abc"))
    data = bytearray((tmp_path / "s.tar").read_bytes())
    data[1024 + 148] ^= 0x01  # the second member's header checksum
    (tmp_path / "s.tar").write_bytes(bytes(data))
    store = LocalStore(str(tmp_path))
    reader = WebDatasetReader(store, "s.tar", on_error="skip")
    samples, index = reader.iter_and_index(build_index)
    assert [s["__key__"] for s in samples] == ["k3"]  # the samples around the bad header drop
    assert reader.skipped > 0
    with pytest.raises(CorruptDataError, match="checksum"):
        index()


def test_compact_index_is_held_in_narrow_types_where_the_values_fit() -> None:
    comps = [
        [
            Component("cls", 512 + 2048 * i, 1, f"s/{i:09d}.cls"),
            Component("txt", 1536 + 2048 * i, 16, f"s/{i:09d}.txt"),
        ]
        for i in range(1000)
    ]
    index = SampleIndex.from_samples(comps)
    assert index.nbytes == 1000 * (2 * (4 + 4 + 1) + 4 + 4 + 11) + 2 * 4  # ~37 bytes a sample
    assert index.samples() == comps
    assert index.field_locations("txt", "u") == [(1536 + 2048 * i, 16) for i in range(1000)]
    index.check_bound(2048 * 1000, "u")
    with pytest.raises(CorruptDataError, match="index line 1001"):
        index.check_bound(2048 * 1000 - 1024, "u")
    # a member that ends past 4 GiB: offsets and sizes stay 8 bytes, and their sums are right
    far = [
        [Component("bin", 512, 2**32 - 512, "a.bin")],
        [Component("bin", 2**32 + 512, 7, "b.bin")],
    ]
    big = SampleIndex.from_samples(far)
    assert big.samples() == far
    big.check_bound(2**32 + 519, "u")
    with pytest.raises(CorruptDataError, match="index line 3"):
        big.check_bound(2**32 + 518, "u")
