"""Sample mixes (fastload.mix of datasets -> MixedDataset) through fastload.DataLoader.

The shared resume checker resumes at every step with other worker counts and world sizes; the
sources' samples are told apart by their mixed index, which differs for each delivery (source,
own epoch, sample), so "exactly once" holds for deliveries and each source's own epochs are
checked separately. Also: exact proportions per batch, per-source counts in stats(), skips,
refused resumes and sources that cannot be mixed.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections import Counter
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastload
import fastload.loader as fl
from fastload.errors import InvalidArgumentError
from fastload.formats import read_manifest, write_manifest
from fastload.loader.order._seeds import RNG_SEED_KEY
from fastload.testing.resume import Layout, check_resume

pytestmark = [pytest.mark.timeout(300)]
A_SIZES, B_SIZES = [5, 4], [3]  # 9 and 3 samples


def tag(sample: dict[str, Any]) -> tuple[str, int]:
    """(key, mixed index): the index is different for each delivery of a sample."""
    return sample["__key__"], int(sample[RNG_SEED_KEY][2])


def as_list(samples: list[Any]) -> list[Any]:
    return list(samples)


def _sources(fake: SimpleNamespace, **kw: Any) -> tuple[fl.Dataset, fl.Dataset]:
    a = fake.make_dataset(A_SIZES, seed=1, block_size=2, window=2, transform=tag, **kw)
    b = fake.make_dataset(B_SIZES, seed=2, transform=tag, **kw)
    return a, b


def _source_of(mixed: fl.MixedDataset, index: int) -> int:
    return int(mixed.source_counts([index]).index(1))


def test_resumes_exactly_at_every_step_with_other_workers_and_world_sizes(
    fake: SimpleNamespace,
) -> None:
    a, b = _sources(fake)
    mixed = fastload.mix({a: 2, b: 1}, epoch_size=10)  # the window: 3 positions

    def make(*, world_size: int, rank: int, batch_size: int, num_workers: int) -> fl.DataLoader:
        return fl.DataLoader(
            mixed,
            batch_size=batch_size,
            rank=rank,
            world_size=world_size,
            num_workers=num_workers,
            collate_fn=as_list,
        )

    report = check_resume(
        make,
        global_batch_size=4,
        sample_ids=list,
        layouts=[Layout(2), Layout(2, num_workers=2), Layout(1), Layout(4)],
        epochs=(0, 1, 2),
    )
    assert report.steps == {0: 3, 1: 3, 2: 3}


def test_every_batch_holds_the_exact_proportions_and_sources_run_whole_own_epochs(
    fake: SimpleNamespace,
) -> None:
    a, b = _sources(fake)
    mixed = fastload.mix({a: 0.7, b: 0.3})  # window 10; a: 9 samples, b: 3
    assert (mixed.plan.counts, mixed.num_samples) == ((7, 3), 20)
    loader = fl.DataLoader(mixed, batch_size=10, num_workers=2, collate_fn=as_list)
    deliveries: list[list[tuple[str, int]]] = [[], []]
    for epoch in range(3):
        loader.set_epoch(epoch)
        for batch in loader:
            per_source = Counter(_source_of(mixed, index) for _, index in batch)
            assert per_source == {0: 7, 1: 3}
            for key, index in batch:
                deliveries[_source_of(mixed, index)].append((key, index // mixed.total))
    # Each source's samples, in delivery order, cut into own epochs: every own epoch is the
    # whole source once, and the own epochs follow each other.
    for source, sizes in ((0, A_SIZES), (1, B_SIZES)):
        n = sum(sizes)
        got = deliveries[source]
        assert [k for _, k in got] == [j // n for j in range(len(got))]
        for k in range(len(got) // n):
            assert sorted(key for key, _ in got[k * n : (k + 1) * n]) == fake.all_keys(sizes)
    stats = loader.stats()
    assert stats[f"samples[{a.url}]"] == 3 * 14
    assert stats[f"samples[{b.url}]"] == 3 * 6
    assert stats["samples"] == 60
    loader.reset_stats()
    assert loader.stats()[f"samples[{a.url}]"] == 0


def test_skipped_samples_are_not_counted_for_their_source(fake: SimpleNamespace) -> None:
    a = fake.make_dataset(A_SIZES, on_error="skip", corrupt=lambda s, p: (s, p) == (0, 1))
    b = fake.make_dataset(B_SIZES, on_error="skip")
    mixed = fastload.mix({a: 1, b: 1}, epoch_size=12)  # a: 6 deliveries, at most one corrupt
    loader = fl.DataLoader(mixed, batch_size=4, collate_fn=fake.keys_collate)
    keys = [k for batch in loader for k in batch]
    stats = loader.stats()
    assert stats[f"samples[{b.url}]"] == 6
    assert stats[f"samples[{a.url}]"] == 6 - stats["skipped"] == len(keys) - 6


def test_urls_open_with_the_mix_seed_and_the_same_dataset_twice_gets_two_names(
    fake: SimpleNamespace, tmp_path: Any
) -> None:
    root = fake.build_format_dataset(str(tmp_path / "ds"), [4, 3])
    mixed = fastload.mix([(root, 1), (root, 3)], seed=7)
    assert [s.seed for s in mixed.sources] == [7, 7]
    assert mixed.source_names == (mixed.sources[0].url, mixed.sources[0].url + "#2")
    loader = fl.DataLoader(mixed, batch_size=4, shuffle=False)
    assert loader.dataset.sources[0].shuffle is False
    assert (mixed.plan.counts, mixed.num_samples) == ((1, 3), 16)  # 7 + 7 rounded up to 4s
    batches = list(loader)
    assert [len(b["cls"]) for b in batches] == [4, 4, 4, 4]
    assert loader.stats()[f"samples[{mixed.source_names[1]}]"] == 12


def test_resumes_of_other_mixes_and_of_single_datasets_are_refused(fake: SimpleNamespace) -> None:
    a, b = _sources(fake)
    mixed = fastload.mix({a: 0.7, b: 0.3})
    loader = fl.DataLoader(mixed, batch_size=5, collate_fn=as_list)
    next(iter(loader))
    state = loader.state_dict()
    assert state["mix_counts"] == [7, 3]
    assert state["step"] == 1
    fl.DataLoader(mixed, batch_size=5).load_state_dict(state)  # the same mix: accepted
    other_weights = fastload.mix({a: 0.6, b: 0.4})
    with pytest.raises(InvalidArgumentError, match=r"mix_counts=\[7, 3\] but this mix has"):
        fl.DataLoader(other_weights, batch_size=5).load_state_dict(state)
    c = fake.make_dataset([3], seed=2, extra=lambda s, p: {"x": b"1"})  # other data than b's
    with pytest.raises(InvalidArgumentError, match=r"other data in source\(s\)"):
        fl.DataLoader(fastload.mix({a: 0.7, c: 0.3}), batch_size=5).load_state_dict(state)
    reshuffled = fastload.mix({a.replace(seed=9): 0.7, b: 0.3})
    with pytest.raises(InvalidArgumentError, match=r"source .* opened with order options"):
        fl.DataLoader(reshuffled, batch_size=5).load_state_dict(state)
    with pytest.raises(InvalidArgumentError, match="saved by a loader of a mix"):
        fl.DataLoader(a, batch_size=5).load_state_dict(state)
    single = fl.DataLoader(a, batch_size=5)
    with pytest.raises(InvalidArgumentError, match="not of a mix"):
        fl.DataLoader(mixed, batch_size=5).load_state_dict(single.state_dict())


def test_sources_that_cannot_be_mixed_are_refused(fake: SimpleNamespace) -> None:
    a = fake.make_dataset([3], fields=("cls",))
    b = fake.make_dataset([3], fields=("__key__",))
    with pytest.raises(InvalidArgumentError, match="select the same fields"):
        fastload.mix({a: 1, b: 1})
    c = fake.make_dataset([3], on_error="skip")
    with pytest.raises(InvalidArgumentError, match="one on_error policy"):
        fastload.mix({fake.make_dataset([3]): 1, c: 1})
    with pytest.raises(InvalidArgumentError, match="is a list; pass datasets"):
        fastload.mix([([1, 2], 1)])
    with pytest.raises(InvalidArgumentError, match="at least one source"):
        fastload.mix({})
    mixed = fastload.mix({fake.make_dataset([3]): 1})
    with pytest.raises(InvalidArgumentError, match="a mix of mixes"):
        fastload.mix({mixed: 1})
    with pytest.raises(InvalidArgumentError, match="no map-style access"):
        mixed[0]
    with pytest.raises(InvalidArgumentError, match=r"a mix has no manifest: .*DALI"):
        _ = mixed.manifest
    with pytest.raises(InvalidArgumentError, match="a mix has no format"):
        _ = mixed.format
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        _ = mixed.nonsense


def test_a_token_dataset_url_is_sent_to_the_token_opener(
    fake: SimpleNamespace, tmp_path: Any
) -> None:
    root = fake.build_format_dataset(str(tmp_path / "tok"), [2])
    store = fastload.open_store(root)
    manifest = read_manifest(store)
    write_manifest(store, dataclasses.replace(manifest, metadata={"tokens": {"layout": 1}}))
    with pytest.raises(
        InvalidArgumentError,
        match=r"is a token dataset: open each token dataset with fastload\.open_tokens",
    ):
        fastload.mix({root: 1})


def test_mixed_indices_locate_and_describe_the_sample_of_their_source(
    fake: SimpleNamespace,
) -> None:
    a, b = _sources(fake)
    mixed = fastload.mix({a: 1, b: 1})
    index = 2 * mixed.total + 9 + 2  # b's sample 2 (b follows a's 9), in b's own epoch 2
    assert mixed.has_index(index)
    assert not a.has_index(9)
    shards, positions = mixed.locate([index, 6])
    assert mixed.describe(int(shards[0]), int(positions[0])) == b.describe(0, 2)
    assert mixed.shard_url(int(shards[1])) == a.shard_url(1)  # a's sample 6: shard 1
    assert mixed.source_counts([index, 0, 1]) == (2, 1)


def test_a_mix_pickles_by_configuration(fake: SimpleNamespace) -> None:
    a, b = _sources(fake)
    mixed = fastload.mix({a: 0.7, b: 0.3})
    copy = pickle.loads(pickle.dumps(mixed))
    positions = np.arange(len(mixed))
    assert copy.order(3).indices(positions).tolist() == mixed.order(3).indices(positions).tolist()
    shards, pos = copy.locate(copy.order(3).indices(positions[:4]))
    raws = [copy.read_raw(int(s), int(p)) for s, p in zip(shards, pos, strict=True)]
    assert [r["__key__"] for r in raws if r is not None] == [
        r["__key__"]
        for r in (mixed.read_raw(int(s), int(p)) for s, p in zip(shards, pos, strict=True))
        if r is not None
    ]
    assert copy.fingerprint == mixed.fingerprint
    assert copy.source_names == mixed.source_names


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    weights=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    data=st.data(),
    world=st.sampled_from([1, 2, 4]),
    per_rank=st.integers(1, 4),
    epoch=st.integers(0, 2),
)
def test_exact_windows_through_the_dataloader_across_world_sizes_and_resume_points(
    fake: SimpleNamespace,
    weights: list[int],
    data: st.DataObject,
    world: int,
    per_rank: int,
    epoch: int,
) -> None:
    sizes = data.draw(st.lists(st.integers(1, 9), min_size=len(weights), max_size=len(weights)))
    sources = [fake.make_dataset([n], seed=i, transform=tag) for i, n in enumerate(sizes)]
    mixed = fastload.mix([(s, w) for s, w in zip(sources, weights, strict=True)])
    g = world * per_rank
    other = data.draw(st.sampled_from([w for w in (1, 2, 4) if g % w == 0]))

    def global_steps(w: int, state: dict[str, Any] | None = None) -> list[list[int]]:
        loaders = [
            fl.DataLoader(mixed, batch_size=g // w, rank=r, world_size=w, collate_fn=as_list)
            for r in range(w)
        ]
        per_rank_batches = []
        for loader in loaders:
            if state is not None:
                loader.load_state_dict(state)
            loader.set_epoch(epoch)
            per_rank_batches.append([[index for _, index in batch] for batch in loader])
        return [
            [i for batch in step for i in batch] for step in zip(*per_rank_batches, strict=True)
        ]

    reference = global_steps(world)
    # Every aligned window of the epoch's positions holds exactly the counts (positions are
    # counted from the start of the run: an epoch starts at e x L).
    stream = [_source_of(mixed, i) for step in reference for i in step][: len(mixed)]
    m, start = mixed.plan.window, epoch * len(mixed)
    for lo in range(-start % m, len(stream) - m + 1, m):
        counts = Counter(stream[lo : lo + m])
        assert [counts[i] for i in range(len(sources))] == list(mixed.plan.counts)
    # Resumed at a random step with another world size: the same samples, step by step (the
    # padding of the last step aside, which depends on the world size).
    k = data.draw(st.integers(0, len(reference)))
    probe = fl.DataLoader(mixed, batch_size=per_rank, rank=0, world_size=world, collate_fn=as_list)
    probe.set_epoch(epoch)
    it = iter(probe)
    for _ in range(k):
        next(it)
    resumed = global_steps(other, probe.state_dict())
    assert len(resumed) == len(reference) - k
    for got, want in zip(resumed[:-1], reference[k:-1], strict=True):
        assert got == want
    if resumed:  # the last step: its padding repeats earlier samples of the epoch
        earlier = {i for step in reference[:-1] for i in step}
        assert set(resumed[-1]) - earlier == set(reference[-1]) - earlier
