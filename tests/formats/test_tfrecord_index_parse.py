"""The array parse of a TFRecord index (DALI's ``<offset> <size>`` lines) gives exactly what
``int()`` per token gives, and leaves everything else to it: signs, underscores, stray bytes and
values too large for its parser reach the token-by-token parse, so errors read as before."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload.errors import CorruptDataError
from fastload.formats.tfrecord._index import _decimal_values, parse_index

_ALPHABET = b"0123456789" * 3 + b" \n\t\r\x0b\x0c+-_x\x00."


def _by_int(text: bytes) -> list[int] | None:
    try:
        return [int(token) for token in text.split()]
    except ValueError:
        return None


@settings(max_examples=3000, deadline=None)
@given(st.lists(st.sampled_from(list(_ALPHABET)), max_size=24).map(bytes))
def test_array_parse_agrees_with_int_or_declines(text: bytes) -> None:
    values = _decimal_values(text)
    if values is not None:
        assert values.dtype == np.int64
        assert values.tolist() == _by_int(text)
    elif set(text) <= set(b"0123456789 \n\t\r\x0b\x0c"):
        # only digits and whitespace: declined only for a value the array parse cannot hold
        assert any(len(token) >= 19 for token in text.split())


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b"", []),
        (b" \n\t", []),  # NumPy's parser reads whitespace alone as one 0: not taken from it
        (b"0 16\n16 20\n", [0, 16, 16, 20]),
        (b"\n\n000 16\r\n", [0, 16]),
        (b"123456789012345678 16", [123456789012345678, 16]),
    ],
)
def test_array_parse_values(text: bytes, expected: list[int]) -> None:
    values = _decimal_values(text)
    assert values is not None
    assert values.tolist() == expected


@pytest.mark.parametrize(
    "text", [b"+0 16", b"0 1_6", b"0 16 x", b"0 1\x006", b"99999999999999999999 16", b"1.0 2"]
)
def test_array_parse_declines(text: bytes) -> None:
    assert _decimal_values(text) is None


def test_parse_index_of_many_records_and_its_errors() -> None:
    rng = np.random.default_rng(7)
    sizes = rng.integers(16, 400, 50_000)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    text = "".join(f"{o} {s}\n" for o, s in zip(offsets.tolist(), sizes.tolist())).encode()
    index = parse_index(text, url="mem://i.idx", shard_size=int(sizes.sum()))
    assert len(index) == 50_000
    assert index.offsets.tolist() == offsets.tolist()
    assert index.sizes.tolist() == sizes.tolist()
    # The token-by-token parse still names what is wrong.
    with pytest.raises(CorruptDataError, match="not an integer"):
        parse_index(text + b"12x 16\n", url="mem://i.idx")
    with pytest.raises(CorruptDataError, match="odd number"):
        parse_index(text + b"7\n", url="mem://i.idx")
    with pytest.raises(CorruptDataError, match="line 3 "):
        parse_index(b"0 16\n16 16\n33 16\n", url="mem://i.idx")


def test_index_of_a_shard_under_4_gib_holds_4_bytes_a_record() -> None:
    text = b"".join(b"%d 16\n" % (16 * i) for i in range(1000))
    index = parse_index(text, url="mem://i.idx", shard_size=16_000)
    assert index.nbytes == 4 * 1001
    assert index.record(999) == (15_984, 16)
    assert index.sizes.dtype == np.int64
    assert index.sizes.tolist() == [16] * 1000
    big = parse_index(b"0 16\n16 4294967296\n", url="mem://i.idx", shard_size=4294967312)
    assert big.nbytes == 8 * 3  # past 4 GiB: 8 bytes a record
    assert big.record(1) == (16, 4294967296)
    assert big.end == 4294967312
