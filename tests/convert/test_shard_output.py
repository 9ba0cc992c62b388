"""The writers' fast paths used by conversion: chunked shard output and tar member headers.

The WebDataset and TFRecord writers must keep writing exactly the bytes they wrote before these
fast paths existed: the golden digests below were produced by the writers as of commit f3cc771.
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload.formats import get_format
from fastload.formats._output import ShardOutput
from fastload.formats.webdataset._tar import MAX_USTAR_SIZE, encode_member_header
from fastload.formats.webdataset.writer import _member_header
from fastload.storage import MemoryStore


def _store() -> MemoryStore:
    """A fresh, empty memory store (``MemoryStore()`` alone shares the process-wide default)."""
    return MemoryStore(f"shard-output-{uuid.uuid4().hex}")


def _golden_samples() -> list[dict[str, Any]]:
    samples = []
    for i in range(300):
        size = [0, 1, 100, 511, 512, 513, 4095, 4096, 4097, 70000, 600000][i % 11]
        data = hashlib.sha256(str(i).encode()).digest() * (size // 32 + 1)
        samples.append(
            {"__key__": f"c{i % 7}/s{i:05d}", "jpg": data[:size], "cls": i % 7, "txt": f"t{i}"}
        )
    return samples


@pytest.mark.parametrize(
    ("format_name", "key", "shard_sha", "index_sha", "size"),
    [
        (
            "webdataset",
            "a.tar",
            "0dcd1a2517ce9bf17201212f65575a5f04dc42acecf4e6c61b48be3ecbb727ad",
            "fb5b1483fe61593bbe9960071424776ff6c6b916b5607bbf0d88b3dd234572f8",
            19294208,
        ),
        (
            "tfrecord",
            "a.tfrecord",
            "70c900654e678a8751dbb0b10a9d45ceb270743c3202806aac4b07102e85ab5d",
            "0e92a28abbf3b117a9ba08e17e5eef4dc92b438d858848d71d7343f77d7cfca5",
            18493744,
        ),
    ],
)
def test_writers_keep_their_bytes(
    format_name: str, key: str, shard_sha: str, index_sha: str, size: int
) -> None:
    store = _store()
    writer = get_format(format_name).writer(store, key)
    for sample in _golden_samples():
        writer.write(sample)
    info = writer.close()
    data = store.get(key)
    assert (info.num_bytes, info.sha256) == (size, shard_sha)
    assert (len(data), hashlib.sha256(data).hexdigest()) == (size, shard_sha)
    assert hashlib.sha256(store.get(key + ".idx")).hexdigest() == index_sha


@settings(max_examples=200, deadline=None)
@given(
    pieces=st.lists(st.binary(max_size=300), max_size=40),
    big=st.lists(st.integers(min_value=0, max_value=39), max_size=3),
    chunk=st.integers(min_value=1, max_value=257),
)
def test_shard_output_writes_and_hashes_everything_in_order(
    pieces: list[bytes], big: list[int], chunk: int
) -> None:
    # Some pieces larger than a chunk (passed through without a copy) among small ones.
    for i in big:
        if i < len(pieces):
            pieces[i] = pieces[i] * 3 + bytes(range(256)) * 2
    store = _store()
    out = store.open_writer("x")
    output = ShardOutput(out, chunk_size=chunk)
    for piece in pieces:
        output.write(piece)
    expected = b"".join(pieces)
    assert output.nbytes == len(expected)
    digest = output.finish()
    assert output.finish() == digest == hashlib.sha256(expected).hexdigest()
    out.commit()
    assert store.get("x") == expected
    with pytest.raises(ValueError, match="finished or aborted"):
        output.write(b"y" * (chunk + 1))


def test_shard_output_abort_writes_nothing_more() -> None:
    store = _store()
    out = store.open_writer("x")
    output = ShardOutput(out, chunk_size=8)
    output.write(b"0123456789")  # one full chunk written, 2 bytes buffered
    output.write(b"ab")
    output.abort()
    output.abort()
    with pytest.raises(ValueError, match="finished or aborted"):
        output.write(b"z" * 9)
    out.abort()
    assert not store.exists("x")
    with pytest.raises(ValueError, match="chunk_size"):
        ShardOutput(store.open_writer("y"), chunk_size=0)


@settings(max_examples=300, deadline=None)
@given(
    name=st.binary(min_size=1, max_size=140),
    size=st.one_of(
        st.integers(min_value=0, max_value=4096),
        st.integers(min_value=0, max_value=1 << 40),
        st.sampled_from([MAX_USTAR_SIZE, MAX_USTAR_SIZE + 1]),
    ),
)
def test_member_header_fast_path_matches_the_tar_module(name: bytes, size: int) -> None:
    assert _member_header(name, size) == encode_member_header(name, size)
