"""Token mixes (fastload.mix of token sources -> MixedTokens) against an array-backed source.

The source here is the smallest TokenSource there is (rows of a NumPy array, a seeded
permutation per epoch), so these tests check the mix, not a token format: exact counts per
window from ``TokenBatch.sources``, each source's sequences exactly once per own epoch,
positions independent of how they are asked for (any split, any resume point), dtypes, starts,
and refused resumes.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastload
from fastload.errors import InvalidArgumentError
from fastload.loader import MixedTokens, Partition
from fastload.loader.tokens._dataset import open_tokens
from fastload.loader.tokens._loader import TokenLoader
from fastload.loader.tokens._source import TokenBatch, TokenSource
from fastload.testing.resume import Layout, check_resume
from fastload.testing.tokens import write_token_dataset


class ArraySource:
    """``n`` sequences of ``seq_len + 1`` ids; row ``r``'s first id is ``base + r``. Epoch ``e``
    visits the rows in ``default_rng([seed, e]).permutation(n)`` order; a document starts at
    column 0 and wherever an id is a multiple of 5."""

    def __init__(
        self, n: int, seq_len: int, *, base: int, seed: int = 0, dtype: Any = np.uint16
    ) -> None:
        self.rows = (base + np.arange(n)[:, None] + np.arange(seq_len + 1)[None, :]).astype(dtype)
        self._seq_len, self.seed, self.base = seq_len, seed, base

    @property
    def seq_len(self) -> int:
        return self._seq_len

    @property
    def url(self) -> str:
        return f"array://{self.base}"

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.rows.tobytes()).hexdigest()[:16]

    def __len__(self) -> int:
        return len(self.rows)

    def order_options(self) -> dict[str, Any]:
        return {"seed": self.seed}

    def continues_order(self, version: object) -> bool:
        return True

    def node_stats(self) -> dict[str, int]:
        return {}

    def sequences(
        self, epoch: int, positions: npt.NDArray[np.int64], *, with_starts: bool = False
    ) -> TokenBatch:
        assert int(np.min(positions)) >= 0
        assert int(np.max(positions)) < len(self)
        perm = np.random.default_rng([self.seed, epoch]).permutation(len(self))
        tokens = self.rows[perm[positions]]
        starts = None
        if with_starts:
            starts = tokens % 5 == 0
            starts[:, 0] = True
        return TokenBatch(tokens, starts)


def _first_ids(batch: TokenBatch) -> list[int]:
    return batch.tokens[:, 0].tolist()


def test_a_token_mix_is_a_token_source_with_the_widest_dtype_and_each_rows_source() -> None:
    a = ArraySource(7, 4, base=0)
    b = ArraySource(5, 4, base=100_000, dtype=np.uint32)
    mixed = fastload.mix({a: 0.7, b: 0.3})
    assert isinstance(mixed, MixedTokens)
    assert isinstance(mixed, TokenSource)
    assert (mixed.seq_len, len(mixed), mixed.plan.counts) == (4, 20, (7, 3))
    got = mixed.sequences(0, np.arange(20), with_starts=True)
    assert got.tokens.dtype == np.uint32
    assert got.tokens.shape == (20, 5)
    assert got.sources is not None
    assert got.sources.dtype == np.int8
    assert got.sources[:10].tolist() == [0, 1, 0, 0, 0, 1, 0, 0, 1, 0]
    # Each row is what its source holds at (own epoch, position) of the plan.
    src, own_epoch, pos = mixed.plan.locate(0, np.arange(20))
    for row, (i, k, p) in enumerate(zip(src.tolist(), own_epoch.tolist(), pos.tolist())):
        want = (a, b)[i].sequences(k, np.array([p]), with_starts=True)
        assert got.tokens[row].tolist() == want.tokens[0].tolist()
        assert got.starts is not None
        assert want.starts is not None
        assert got.starts[row].tolist() == want.starts[0].tolist()
    assert mixed.sequences(0, np.arange(3)).starts is None
    wide = mixed.sequences_as(np.dtype(np.int64), 0, np.arange(20), with_starts=True)
    assert wide.tokens.dtype == np.int64
    assert wide.tokens.tolist() == got.tokens.tolist()
    assert wide.sources is not None
    assert wide.sources.tolist() == got.sources.tolist()


@settings(max_examples=40, deadline=None)
@given(
    weights=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    data=st.data(),
    epochs=st.integers(1, 3),
)
def test_exact_counts_per_window_and_each_source_once_per_own_epoch(
    weights: list[int], data: st.DataObject, epochs: int
) -> None:
    sizes = data.draw(st.lists(st.integers(1, 12), min_size=len(weights), max_size=len(weights)))
    sources = [ArraySource(n, 3, base=1000 * i, seed=i) for i, n in enumerate(sizes)]
    mixed = fastload.mix([(s, w) for s, w in zip(sources, weights, strict=True)])
    m = mixed.plan.window
    rows: list[list[int]] = [[] for _ in sources]
    stream: list[int] = []
    for e in range(epochs):
        got = mixed.sequences(e, np.arange(len(mixed)))
        assert got.sources is not None
        stream.extend(got.sources.tolist())
        for i, first in zip(got.sources.tolist(), _first_ids(got), strict=True):
            rows[i].append(first - 1000 * i)
    counts = np.asarray(mixed.plan.counts)
    for w in range(len(stream) // m):
        window = np.bincount(stream[w * m : (w + 1) * m], minlength=len(sources))
        assert window.tolist() == counts.tolist()
    for i, n in enumerate(sizes):
        full = len(rows[i]) // n
        for k in range(full):
            assert sorted(rows[i][k * n : (k + 1) * n]) == list(range(n))
        assert len(set(rows[i][full * n :])) == len(rows[i]) - full * n  # a partial own epoch


@settings(max_examples=40, deadline=None)
@given(
    world=st.sampled_from([1, 2, 4]),
    batch=st.integers(1, 5),
    workers=st.integers(1, 3),
    epoch=st.integers(0, 2),
    data=st.data(),
)
def test_batches_are_the_same_across_world_sizes_workers_and_resume_points(
    world: int, batch: int, workers: int, epoch: int, data: st.DataObject
) -> None:
    """What the token loader does with a source (Partition positions -> sequences), done on the
    mix in two layouts of one global batch, the second resumed at a random step."""
    mixed = fastload.mix({ArraySource(9, 2, base=0): 2, ArraySource(4, 2, base=500): 1})
    g = world * batch
    other = data.draw(st.sampled_from([w for w in (1, 2, 4) if g % w == 0]))

    def steps(w: int, n_workers: int, start: int) -> list[list[int]]:
        part = Partition(len(mixed), w, g // w)
        out: dict[int, list[int]] = {}
        for worker in range(n_workers):
            for step in part.worker_steps(start, worker, n_workers):
                ids: list[int] = []
                for rank in range(w):
                    positions, pad = part.positions(step, rank)
                    ids.extend(_first_ids(mixed.sequences(epoch, positions[~pad])))
                out[step] = ids
        return [out[s] for s in sorted(out)]

    reference = steps(world, 1, 0)
    start = data.draw(st.integers(0, len(reference)))
    assert steps(other, workers, start) == reference[start:]


def test_states_record_the_mix_and_other_mixes_are_refused() -> None:
    a, b = ArraySource(7, 4, base=0), ArraySource(5, 4, base=100)
    mixed = fastload.mix({a: 0.7, b: 0.3})
    state = {"epoch": 0, "step": 3, **mixed.order_options()}
    assert state["mix_counts"] == [7, 3]
    assert state["mix_sources"] == [a.fingerprint, b.fingerprint]
    mixed.check_state(state)
    with pytest.raises(InvalidArgumentError, match="mix_counts=\\[7, 3\\] but this mix has"):
        fastload.mix({a: 0.6, b: 0.4}).check_state(state)
    other_b = ArraySource(5, 4, base=101)  # other data, same URL scheme
    with pytest.raises(InvalidArgumentError, match="other data in source\\(s\\) array://101"):
        fastload.mix({a: 0.7, other_b: 0.3}).check_state(state)
    assert fastload.mix({a: 0.7, b: 0.3}).fingerprint == mixed.fingerprint
    assert fastload.mix({a: 0.6, b: 0.4}).order_options() != mixed.order_options()
    assert fastload.mix({a: 0.7, other_b: 0.3}).fingerprint != mixed.fingerprint


def test_token_sources_must_share_seq_len_and_kind() -> None:
    with pytest.raises(InvalidArgumentError, match="one seq_len, got array://0: 4, array://1: 8"):
        fastload.mix({ArraySource(3, 4, base=0): 1, ArraySource(3, 8, base=1): 1})
    with pytest.raises(InvalidArgumentError, match="is a token source, but other sources are"):
        fastload.mix([("some/dataset/path", 1), (ArraySource(3, 4, base=0), 1)])
    with pytest.raises(InvalidArgumentError, match="positions must lie in"):
        fastload.mix({ArraySource(3, 4, base=0): 1}).sequences(0, np.array([3]))


# ---- real token datasets (fastload.open_tokens) through the token loader ----------------------


def _token_dataset(root: Any, base: int, doc_lengths: list[int]) -> str:
    """A token dataset whose ids are ``base`` + their stream positions (no EOS)."""
    docs, at = [], base
    for n in doc_lengths:
        docs.append(list(range(at, at + n)))
        at += n
    write_token_dataset(
        fastload.open_store(str(root)),
        docs,
        shard_docs=[len(docs) // 2, len(docs) - len(docs) // 2],
        block_tokens=16,
        vocab_size=1 << 20,
        eos_id=None,
    )
    return str(root)


@pytest.fixture(scope="module")
def token_roots(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    a = _token_dataset(tmp_path_factory.mktemp("mix-tok-a"), 0, [37, 5, 60, 23, 81, 14])
    b = _token_dataset(tmp_path_factory.mktemp("mix-tok-b"), 500_000, [19, 44, 7, 30])
    return a, b


def test_real_token_datasets_mixed_through_the_token_loader(token_roots: tuple[str, str]) -> None:
    a = open_tokens(token_roots[0], 8, seed=1, window=4)
    b = open_tokens(token_roots[1], 8, seed=2, window=4)
    mixed = fastload.mix({a: 2, b: 1}, epoch_size=24)
    assert (len(a), len(b)) == (27, 12)
    loader = TokenLoader(mixed, 6, rank=0, world_size=1)
    firsts: list[list[int]] = [[], []]
    for epoch in range(4):
        loader.set_epoch(epoch)
        for batch in loader:
            assert batch["sources"].tolist() == [0, 1, 0, 0, 1, 0]
            for i, row in zip(batch["sources"].tolist(), batch["input_ids"].tolist(), strict=True):
                assert (row[0] >= 500_000) == (i == 1)  # each row from the source it names
                firsts[i].append(row[0])
    # 4 mix epochs: 64 sequences of a (2 own epochs and 10 more), 32 of b (2 own epochs and 8):
    # each own epoch delivers exactly the sequences of that epoch of the source, once each.
    for source, got in ((a, firsts[0]), (b, firsts[1])):
        n = len(source)
        for k in range(len(got) // n):
            own = source.sequences(k, np.arange(n)).tokens[:, 0].tolist()
            assert sorted(got[k * n : (k + 1) * n]) == sorted(own)
    report = loader.stats()
    assert report["samples"] == 96
    assert (report[f"samples[{a.url}]"], report[f"samples[{b.url}]"]) == (64, 32)
    loader.reset_stats()
    assert loader.stats()[f"samples[{a.url}]"] == 0


def test_token_mix_counts_per_source_leave_out_padding(token_roots: tuple[str, str]) -> None:
    a = open_tokens(token_roots[0], 8, seed=1, window=4)
    b = open_tokens(token_roots[1], 8, seed=2, window=4)
    mixed = fastload.mix({a: 2, b: 1}, epoch_size=21)  # 2 ranks of 6: the last step is padded
    rows, counts = 0, np.zeros(2, dtype=np.int64)
    for rank in (0, 1):
        loader = TokenLoader(mixed, 6, rank=rank, world_size=2)
        rows += sum(len(batch["input_ids"]) for batch in loader)
        report = loader.stats()
        counts += [report[f"samples[{a.url}]"], report[f"samples[{b.url}]"]]
        own = report[f"samples[{a.url}]"] + report[f"samples[{b.url}]"]
        assert own == report["samples"] - report["padded"]
    assert rows == 22  # 21 sequences and one padding row
    assert counts.tolist() == [14, 7]


def test_a_token_dataset_url_in_a_mix_names_open_tokens(token_roots: tuple[str, str]) -> None:
    with pytest.raises(InvalidArgumentError, match=r"fastload\.open_tokens\(url, seq_len="):
        fastload.mix({token_roots[0]: 0.7, token_roots[1]: 0.3}, seed=0)


def test_real_token_mix_resumes_at_every_step_elastic(token_roots: tuple[str, str]) -> None:
    a = open_tokens(token_roots[0], 8, seed=1, window=4)
    b = open_tokens(token_roots[1], 8, seed=2, window=4)
    mixed = fastload.mix({a: 0.6, b: 0.4}, epoch_size=25)  # no repeats within a mix epoch

    def make(*, world_size: int, rank: int, batch_size: int, num_workers: int) -> TokenLoader:
        return TokenLoader(
            mixed, batch_size, rank=rank, world_size=world_size, prefetch=num_workers
        )

    report = check_resume(
        make,
        global_batch_size=6,
        sample_ids=lambda batch: [int(x) for x in batch["input_ids"][:, 0]],
        layouts=[Layout(2), Layout(1), Layout(3, num_workers=2), Layout(6)],
        epochs=(0, 1, 2),
    )
    assert report.steps == {0: 5, 1: 5, 2: 5}


def test_the_token_loader_refuses_a_resume_with_other_weights_or_sources(
    token_roots: tuple[str, str],
) -> None:
    a = open_tokens(token_roots[0], 8, seed=1, window=4)
    b = open_tokens(token_roots[1], 8, seed=2, window=4)
    loader = TokenLoader(fastload.mix({a: 2, b: 1}, epoch_size=24), 6, rank=0, world_size=1)
    next(iter(loader))
    state = loader.state_dict()
    assert state["mix_counts"] == [2, 1]
    other = TokenLoader(fastload.mix({a: 1, b: 2}, epoch_size=24), 6, rank=0, world_size=1)
    with pytest.raises(InvalidArgumentError, match=r"mix_counts=\[2, 1\] but"):
        other.load_state_dict(state)
    swapped = TokenLoader(fastload.mix({b: 1, a: 2}, epoch_size=24), 6, rank=0, world_size=1)
    with pytest.raises(InvalidArgumentError, match="another dataset"):
        swapped.load_state_dict(state)
    same = TokenLoader(fastload.mix({a: 2, b: 1}, epoch_size=24), 6, rank=0, world_size=1)
    same.load_state_dict(state)
    assert len(same) == 3
