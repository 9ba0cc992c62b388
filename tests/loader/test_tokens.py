"""The token loader: packed sequences, exactly-once over tokens, (seed, epoch) order, resume.

The datasets here give every token a unique id: its position in the dataset's token stream
(``eos_id=None``; vocabularies above 65,536 store ``<u4``). A delivered row then says exactly
which tokens it holds, so the tests reconstruct the epoch's stream from the rows alone: rows
overlap by one id (the last target of sequence ``k`` is the first input of ``k + 1``), so
following last id -> row starting with it chains every row of the epoch in stream order.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastload.errors import CorruptDataError, InvalidArgumentError, ManifestError
from fastload.formats import read_manifest, write_manifest
from fastload.loader.tokens._dataset import TokenDataset, open_tokens
from fastload.loader.tokens._loader import TokenLoader
from fastload.loader.tokens._source import TokenSource
from fastload.storage import LocalStore, MemoryStore, Store
from fastload.testing.resume import Layout, check_resume
from fastload.testing.tokens import WrittenTokens, write_token_dataset

FORMATS = ["webdataset", "tfrecord", "lmdb"]
BIG_VOCAB = 1 << 20  # ids up to 2**20: stored as <u4, so ids can be stream positions


def unique_dataset(
    store: Store,
    doc_lengths: list[int],
    shard_docs: list[int],
    *,
    block_tokens: int,
    format_name: str = "webdataset",
) -> WrittenTokens:
    """Documents whose ids are their stream positions (no EOS)."""
    docs, at = [], 0
    for n in doc_lengths:
        docs.append(list(range(at, at + n)))
        at += n
    written = write_token_dataset(
        store,
        docs,
        shard_docs=shard_docs,
        block_tokens=block_tokens,
        vocab_size=BIG_VOCAB,
        eos_id=None,
        format_name=format_name,
    )
    assert written.stream.tolist() == list(range(at))
    return written


def chain(rows: list[list[int]]) -> list[int]:
    """The epoch stream ``stream[0 : S*L + 1]`` reconstructed from its sequences (module doc)."""
    by_first = {row[0]: row for row in rows}
    assert len(by_first) == len(rows), "two sequences start with the same id"
    successors = {row[-1] for row in rows}
    heads = [row for row in rows if row[0] not in successors]
    assert len(heads) == 1, f"the sequences do not form one chain (heads: {len(heads)})"
    stream, row = list(heads[0]), heads[0]
    for _ in range(len(rows) - 1):
        row = by_first[row[-1]]
        stream.extend(row[1:])
    return stream


def check_block_stream(stream: list[int], written: WrittenTokens) -> None:
    """``stream`` is the dataset's blocks in some order (each whole, but the last cut short)."""
    layout = written.layout
    ends = np.cumsum(layout.shard_tokens)
    starts = ends - np.asarray(layout.shard_tokens)
    i, seen = 0, set()
    while i < len(stream):
        first = stream[i]
        shard = int(np.searchsorted(ends, first, side="right"))
        offset = first - int(starts[shard])
        assert offset % layout.block_tokens == 0, f"stream position {i} is inside a block"
        n = min(layout.block_tokens, int(ends[shard]) - first)
        piece = stream[i : i + n]
        assert piece == list(range(first, first + len(piece))), "a block is not in order"
        assert first not in seen
        seen.add(first)
        i += n
        if len(piece) < n:
            assert i >= len(stream), "only the last block of the epoch's sequences is cut"


def rows_of(loader: TokenLoader) -> list[list[int]]:
    rows: list[list[int]] = []
    for batch in loader:
        ids, labels = batch["input_ids"], batch["labels"]
        assert torch.equal(ids[:, 1:], labels[:, :-1]), "labels are not inputs shifted by one"
        full = torch.cat([ids, labels[:, -1:]], dim=1)
        rows.extend(full.tolist())
    return rows


# ---- exactly-once, over shard layouts x seq_len x world sizes x batch sizes x drop_last -------

layouts_st = st.lists(st.integers(0, 40), min_size=1, max_size=12).flatmap(
    lambda lengths: st.tuples(
        st.just(lengths),
        st.lists(st.integers(1, 4), min_size=1, max_size=5),
    )
)


def split_docs(lengths: list[int], groups: list[int]) -> tuple[list[int], list[int]]:
    """Documents per shard from ``groups`` (cycled); a shard without ids joins the next one
    (the last one joins the one before), since a shard holds at least one id."""
    if sum(lengths) == 0:
        lengths = [1, *lengths[1:]]
    sizes, i, g = [], 0, 0
    while i < len(lengths):
        take = groups[g % len(groups)]
        sizes.append(
            (take if i + take <= len(lengths) else len(lengths) - i, sum(lengths[i : i + take]))
        )
        i, g = i + take, g + 1
    shards: list[int] = []
    pending = 0
    for n, tokens in sizes:
        pending += n
        if tokens:
            shards.append(pending)
            pending = 0
    shards[-1] += pending
    return lengths, shards


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=layouts_st,
    block_tokens=st.integers(1, 20),
    seq_len=st.integers(1, 12),
    world_size=st.sampled_from([1, 2, 3]),
    batch_size=st.integers(1, 4),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    window=st.integers(1, 6),
    mapped=st.booleans(),
)
def test_exactly_once_over_tokens(
    layout: tuple[list[int], list[int]],
    block_tokens: int,
    seq_len: int,
    world_size: int,
    batch_size: int,
    drop_last: bool,
    shuffle: bool,
    window: int,
    mapped: bool,
) -> None:
    lengths, shard_docs = split_docs(*layout)
    if sum(lengths) < seq_len + 1:
        lengths = [*lengths, seq_len + 1]
        shard_docs = [*shard_docs, 1]
    with tempfile.TemporaryDirectory(prefix="engB-") as root:
        written = unique_dataset(LocalStore(root), lengths, shard_docs, block_tokens=block_tokens)
        source = open_tokens(root, seq_len, shuffle=shuffle, seed=3, window=window)
        if not mapped:
            source = TokenDataset(
                source.dataset,
                source.layout,
                seq_len,
                shuffle=shuffle,
                seed=3,
                window=window,
                mapped=False,
            )
        total = written.layout.num_tokens
        S = (total - 1) // seq_len
        assert len(source) == S
        assert source.tail == total - S * seq_len
        for epoch in (0, 1):
            per_rank = []
            for rank in range(world_size):
                loader = TokenLoader(
                    source, batch_size, rank=rank, world_size=world_size, drop_last=drop_last
                )
                loader.set_epoch(epoch)
                per_rank.append(rows_of(loader))
            rows = [row for rank_rows in per_rank for row in rank_rows]
            counts = Counter(row[0] for row in rows)
            repeats = sum(counts.values()) - len(counts)
            G = batch_size * world_size
            if drop_last:
                assert repeats == 0
                assert len(counts) == S // G * G
            else:
                assert repeats == (-S) % world_size
                assert len(counts) == S
                distinct = list({row[0]: row for row in rows}.values())
                stream = chain(distinct)  # every sequence, once, in stream order
                assert len(stream) == S * seq_len + 1
                inputs = stream[:-1]
                assert len(set(inputs)) == S * seq_len  # every input id once
                check_block_stream(stream, written)
                if not shuffle:
                    assert stream == list(range(S * seq_len + 1))


# ---- the order: a pure function of (seed, epoch), and its randomness ------------------------


@pytest.fixture(scope="module")
def medium(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, WrittenTokens]:
    root = str(tmp_path_factory.mktemp("tokens-medium"))
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 60, 200).tolist()
    written = unique_dataset(LocalStore(root), lengths, [50, 50, 60, 40], block_tokens=32)
    return root, written


def epoch_rows(source: TokenSource, epoch: int) -> list[list[int]]:
    batch = source.sequences(epoch, np.arange(len(source), dtype=np.int64))
    rows: list[list[int]] = batch.tokens.astype(np.int64).tolist()
    return rows


def test_order_is_a_pure_function_of_seed_and_epoch(medium: tuple[str, WrittenTokens]) -> None:
    root, _ = medium
    a = open_tokens(root, 16, seed=1, window=8)
    b = open_tokens(root, 16, seed=1, window=8)
    for epoch in (2, 0, 1):  # any order of calls
        assert epoch_rows(a, epoch) == epoch_rows(b, epoch)
    # Positions asked in any order and batch give the same sequences.
    perm = np.random.default_rng(0).permutation(len(a))
    single = [a.sequences(1, perm[i : i + 1]).tokens[0].tolist() for i in range(5)]
    assert single == [row for row in np.asarray(epoch_rows(b, 1))[perm[:5]].tolist()]
    assert epoch_rows(a, 0) != epoch_rows(a, 1)
    assert epoch_rows(a, 0) != epoch_rows(open_tokens(root, 16, seed=2, window=8), 0)


def test_sequence_shuffle_stays_within_windows_and_mixes_them(
    medium: tuple[str, WrittenTokens],
) -> None:
    root, _ = medium
    window = 8
    source = open_tokens(root, 16, seed=5, window=window)
    k = source.sequence_of(0, np.arange(len(source)))
    # A bijection that keeps every position in its window ...
    assert sorted(k.tolist()) == list(range(len(source)))
    assert (k // window == np.arange(len(source)) // window).all()
    # ... and moves positions around inside it: over 60 windows, the mean displacement of a
    # uniform shuffle of 8 is 2.625 (far from 0 for an identity, and from ~7 for a reversal).
    full = len(source) // window * window
    moved = np.abs(k[:full] - np.arange(full)).mean()
    assert 1.5 < moved < 4.0
    # The block permutation moves blocks all over the stream: the first sequence of an epoch
    # starts in a different place for most seeds.
    firsts = {
        open_tokens(root, 16, seed=s).sequences(0, np.array([0])).tokens[0, 0] for s in range(8)
    }
    assert len(firsts) >= 5


def test_no_shuffle_reads_the_stream_in_order(medium: tuple[str, WrittenTokens]) -> None:
    root, written = medium
    source = open_tokens(root, 10, shuffle=False)
    rows = np.asarray(epoch_rows(source, 3))
    expected = np.stack([written.stream[k * 10 : k * 10 + 11] for k in range(len(source))])
    assert (rows == expected).all()


# ---- resume: the shared checker, at every step, other world sizes and read-ahead -------------


@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_at_every_step_elastic(medium: tuple[str, WrittenTokens], drop_last: bool) -> None:
    root, _ = medium
    source = open_tokens(root, 24, seed=4, window=5)  # ~230 sequences
    source = TokenDataset(source.dataset, source.layout, 24, seed=4, window=5)
    S = len(source)

    def make(*, world_size: int, rank: int, batch_size: int, num_workers: int) -> TokenLoader:
        return TokenLoader(
            source,
            batch_size,
            rank=rank,
            world_size=world_size,
            drop_last=drop_last,
            prefetch=num_workers,
        )

    report = check_resume(
        make,
        global_batch_size=36,
        sample_ids=lambda batch: [int(x) for x in batch["input_ids"][:, 0]],
        layouts=[Layout(4), Layout(1), Layout(2, num_workers=2), Layout(3), Layout(6)],
        complete=not drop_last,
    )
    assert report.steps[0] == (S // 36 if drop_last else -(-S // 36))
    assert report.resumes > 0


def test_state_is_small_and_checked(medium: tuple[str, WrittenTokens]) -> None:
    root, _ = medium
    loader = TokenLoader(open_tokens(root, 16, seed=1), 4, rank=0, world_size=1)
    it = iter(loader)
    next(it)
    next(it)
    state = loader.state_dict()
    assert state["step"] == 2
    assert state["seq_len"] == 16
    assert state["num_samples"] == len(loader.source)
    assert len(repr(state)) < 400  # O(1): no buffers, no positions
    other = TokenLoader(open_tokens(root, 8, seed=1), 4, rank=0, world_size=1)
    with pytest.raises(InvalidArgumentError, match=r"seq_len=16.*seq_len=8.*seq_len=16"):
        other.load_state_dict(state)
    seeded = TokenLoader(open_tokens(root, 16, seed=2), 4, rank=0, world_size=1)
    with pytest.raises(InvalidArgumentError, match="seed=1"):
        seeded.load_state_dict(state)
    bigger = TokenLoader(open_tokens(root, 16, seed=1), 8, rank=0, world_size=1)
    with pytest.raises(InvalidArgumentError, match="batch_size=4"):
        bigger.load_state_dict(state)
    resumed = TokenLoader(open_tokens(root, 16, seed=1), 2, rank=1, world_size=2)
    resumed.load_state_dict(state)
    assert len(resumed) == len(loader) - 2


# ---- document boundaries ---------------------------------------------------------------------


@pytest.mark.parametrize("boundaries", ["position_ids", "cu_seqlens"])
def test_boundaries_match_the_documents(medium: tuple[str, WrittenTokens], boundaries: str) -> None:
    root, written = medium
    doc_starts = set(written.doc_starts.tolist())
    loader = TokenLoader(
        open_tokens(root, 20, seed=9, window=4),
        3,
        rank=0,
        world_size=1,
        boundaries=boundaries,  # type: ignore[arg-type]
    )
    checked = 0
    for batch in loader:
        ids = batch["input_ids"].tolist()
        expected_pos: list[list[int]] = []
        for row in ids:
            pos: list[int] = []
            for j, t in enumerate(row):
                begins = j == 0 or t in doc_starts or t != row[j - 1] + 1
                pos.append(0 if begins else pos[-1] + 1)
            expected_pos.append(pos)
        if boundaries == "position_ids":
            assert batch["position_ids"].tolist() == expected_pos
        else:
            flat = [p for row in expected_pos for p in row]
            starts = [i for i, p in enumerate(flat) if p == 0] + [len(flat)]
            assert batch["cu_seqlens"].tolist() == starts
            assert batch["cu_seqlens"].dtype == torch.int32
            assert batch["max_seqlen"] == max(np.diff(starts))
        checked += len(ids)
    assert checked == len(loader.source)


# ---- formats and stores ----------------------------------------------------------------------


@pytest.mark.parametrize("format_name", FORMATS)
@pytest.mark.parametrize("where", ["local", "memory"])
def test_every_format_and_a_remote_like_store(tmp_path: Any, format_name: str, where: str) -> None:
    store: Store = LocalStore(str(tmp_path)) if where == "local" else MemoryStore()
    rng = np.random.default_rng(1)
    lengths = rng.integers(0, 30, 40).tolist()
    written = unique_dataset(store, lengths, [10, 15, 15], block_tokens=8, format_name=format_name)
    source = open_tokens(store, 6, seed=0, window=3)
    rows = epoch_rows(source, 0)
    stream = chain(rows)
    assert len(stream) == len(source) * 6 + 1
    check_block_stream(stream, written)
    # The mapped path serves local WebDataset shards; everything else is read into the cache.
    expect_mapped = where == "local" and format_name == "webdataset"
    assert (source.blocks.maps > 0) == expect_mapped
    assert (source.blocks.reads > 0) != expect_mapped
    assert len(source.blocks._state.get().blocks) <= source.blocks.capacity


def test_small_vocabulary_is_uint16_and_dtypes(tmp_path: Any) -> None:
    store = LocalStore(str(tmp_path))
    docs = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    write_token_dataset(store, docs, block_tokens=4, vocab_size=100, eos_id=1)
    source = open_tokens(store, 3, shuffle=False)
    stream = [5, 6, 7, 1, 8, 9, 1, 10, 11, 12, 13, 1]
    for dtype, want in [
        (torch.int64, torch.int64),
        (torch.int32, torch.int32),
        (None, torch.uint16),
    ]:
        batch = next(iter(TokenLoader(source, 2, rank=0, world_size=1, dtype=dtype)))
        assert batch["input_ids"].dtype == want
        assert batch["input_ids"].to(torch.int64).tolist() == [stream[0:3], stream[3:6]]
        assert batch["labels"].to(torch.int64).tolist() == [stream[1:4], stream[4:7]]


# ---- errors ----------------------------------------------------------------------------------


def test_errors_name_the_problem_and_the_fix(tmp_path: Any) -> None:
    store = LocalStore(str(tmp_path / "t"))
    unique_dataset(store, [10, 20, 10], [1, 2], block_tokens=16)
    root = str(tmp_path / "t")
    with pytest.raises(InvalidArgumentError, match="seq_len"):
        open_tokens(root, 0)
    with pytest.raises(InvalidArgumentError, match=r"40 tokens.*seq_len=40.*41"):
        open_tokens(root, 40)
    with pytest.raises(InvalidArgumentError, match="token source"):
        TokenLoader([1, 2, 3], 2)  # type: ignore[arg-type]
    # Not a token dataset.
    plain = MemoryStore()
    manifest = read_manifest(store, "")
    manifest.metadata = {}
    write_manifest(plain, manifest)
    with pytest.raises(ManifestError, match=r"not a token dataset.*--tokenize"):
        open_tokens(plain)
    # A block whose size disagrees with the layout: the manifest says blocks of 15 ids (which
    # still gives each shard its number of samples: 10 ids -> 1, 30 -> 2), the shards hold
    # blocks of 16.
    manifest = read_manifest(store, "")
    manifest.metadata["tokens"]["block_tokens"] = 15
    write_manifest(store, manifest)
    source = open_tokens(root, 4, shuffle=False)
    with pytest.raises(
        CorruptDataError, match=r"block 0 of shard .*tokens-000001.*16 ids.*says 15"
    ):
        source.sequences(0, np.arange(len(source)))


def test_is_a_token_source(medium: tuple[str, WrittenTokens]) -> None:
    root, _ = medium
    source = open_tokens(root, 16)
    assert isinstance(source, TokenSource)
    assert source.fingerprint == open_tokens(root, 16).fingerprint
    # The data's identity; seq_len is an order option, checked on its own.
    assert source.fingerprint == open_tokens(root, 8).fingerprint
    assert source.order_options()["seq_len"] == 16


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=layouts_st,
    block_tokens=st.integers(2, 12),
    seq_len=st.integers(2, 6),
    global_batch=st.sampled_from([2, 4, 6]),
    drop_last=st.booleans(),
)
def test_resume_anywhere_property(
    layout: tuple[list[int], list[int]],
    block_tokens: int,
    seq_len: int,
    global_batch: int,
    drop_last: bool,
) -> None:
    """check_resume over random shard layouts: every step, world sizes dividing the global batch."""
    lengths, shard_docs = split_docs(*layout)
    lengths = [*lengths, 3 * global_batch * seq_len]  # a few global steps at least
    shard_docs = [*shard_docs, 1]
    store = MemoryStore()
    unique_dataset(store, lengths, shard_docs, block_tokens=block_tokens)
    source = open_tokens(store, seq_len, seed=11, window=3)

    def make(*, world_size: int, rank: int, batch_size: int, num_workers: int) -> TokenLoader:
        return TokenLoader(
            source, batch_size, rank=rank, world_size=world_size, drop_last=drop_last
        )

    worlds = [w for w in (2, 1, 3, 6) if global_batch % w == 0]
    check_resume(
        make,
        global_batch_size=global_batch,
        sample_ids=lambda batch: [int(x) for x in batch["input_ids"][:, 0]],
        layouts=[Layout(w) for w in worlds],
        complete=not drop_last,
        stop_checks=1,
    )


def test_remote_store_through_a_cache_is_mapped(tmp_path: Any) -> None:
    store = MemoryStore()
    written = unique_dataset(store, [30] * 20, [5, 5, 10], block_tokens=16)
    source = open_tokens(store, 10, seed=2, cache_dir=str(tmp_path / "cache"))
    stream = chain(epoch_rows(source, 0))
    check_block_stream(stream, written)
    assert source.blocks.maps == 3  # each shard fetched into the cache and mapped once
    assert source.blocks.reads == 0
