"""The mixing arithmetic (fastload.loader.mix._schedule): counts, pattern, position map, states.

Properties over random weights, source sizes, epoch sizes and batch layouts: every window of
``M`` positions holds exactly ``c_i`` of source ``i``; every run of positions holds its share up
to less than 2; each source's items are delivered exactly once per own epoch, in order; the
positions of a batch are the same whatever the world size, worker count or resume point.
"""

from __future__ import annotations

import warnings
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload.errors import InvalidArgumentError
from fastload.loader import MixRoundingWarning, Partition
from fastload.loader.mix._schedule import (
    MAX_AUTO_WINDOW,
    MixPlan,
    check_mix_state,
    mix_counts,
    smooth_pattern,
    unique_names,
)

counts_st = st.lists(st.integers(1, 30), min_size=1, max_size=7)


def _onehot_cumsum(sources: np.ndarray, n: int) -> np.ndarray:
    """``out[t, i]``: positions of source ``i`` among the first ``t`` of ``sources``."""
    out = np.zeros((len(sources) + 1, n), dtype=np.int64)
    out[1:][np.arange(len(sources)), sources] = 1
    return np.cumsum(out, axis=0)


@settings(max_examples=200, deadline=None)
@given(counts=counts_st, start=st.integers(0, 10**6))
def test_every_window_holds_exactly_the_counts_and_every_run_its_share_within_2(
    counts: list[int], start: int
) -> None:
    plan = MixPlan(counts, [1] * len(counts))
    m = plan.window
    # Three windows of the stream from an arbitrary position (windows counted from 0).
    positions = np.arange(start, start + 3 * m)
    sources, _ = plan.stream(positions)
    cum = _onehot_cumsum(sources, len(counts))
    first = -start % m  # first aligned window in the slice
    for w in range(2):
        lo = first + w * m
        assert (cum[lo + m] - cum[lo]).tolist() == counts
    share = np.asarray(counts) / m
    for run in range(1, 2 * m + 1):
        got = cum[run:] - cum[:-run]
        assert np.abs(got - run * share).max() < 2, (counts, run)


@settings(max_examples=100, deadline=None)
@given(counts=counts_st, batch=st.integers(1, 64))
def test_batches_hold_their_share_rounded_within_one_and_exactly_when_the_window_divides(
    counts: list[int], batch: int
) -> None:
    plan = MixPlan(counts, [1] * len(counts))
    m = plan.window
    steps = 3 * m
    sources, _ = plan.stream(np.arange(steps * batch))
    per_batch = np.stack(
        [np.bincount(b, minlength=len(counts)) for b in sources.reshape(steps, batch)]
    )
    share = batch * np.asarray(counts) / m
    assert (per_batch >= np.floor(share) - 1).all()
    assert (per_batch <= np.ceil(share) + 1).all()
    if batch % m == 0:
        assert (per_batch == batch // m * np.asarray(counts)).all()


def test_the_pattern_is_spread_and_fixed() -> None:
    assert smooth_pattern([7, 3]).tolist() == [0, 1, 0, 0, 0, 1, 0, 0, 1, 0]
    assert smooth_pattern([1, 1, 1]).tolist() == [0, 1, 2]
    assert smooth_pattern([2, 1, 1]).tolist() == [0, 1, 2, 0]


@settings(max_examples=150, deadline=None)
@given(
    counts=counts_st,
    data=st.data(),
    epoch_size=st.one_of(st.none(), st.integers(1, 200)),
)
def test_each_source_delivers_its_items_once_per_own_epoch_in_order(
    counts: list[int], data: st.DataObject, epoch_size: int | None
) -> None:
    sizes = data.draw(st.lists(st.integers(1, 25), min_size=len(counts), max_size=len(counts)))
    plan = MixPlan(counts, sizes, epoch_size=epoch_size)
    if epoch_size is None:
        assert plan.epoch_size % plan.window == 0
        assert plan.epoch_size - plan.window < sum(sizes) <= plan.epoch_size
    seen: list[list[tuple[int, int]]] = [[] for _ in counts]
    epochs = 4
    for e in range(epochs):
        src, own_epoch, pos = plan.locate(e, np.arange(plan.epoch_size))
        assert np.bincount(src, minlength=len(counts)).tolist() == plan.epoch_counts(e).tolist()
        for i, k, p in zip(src.tolist(), own_epoch.tolist(), pos.tolist(), strict=True):
            seen[i].append((k, p))
    for i, n in enumerate(sizes):
        # Item number j of the source is position j % n of own epoch j // n: each own epoch
        # delivers every position once, and the next starts only when it is done.
        assert seen[i] == [(j // n, j % n) for j in range(len(seen[i]))]
        total = sum(plan.epoch_counts(e)[i] for e in range(epochs))
        assert len(seen[i]) == total
    assert plan.before(epochs * plan.epoch_size).tolist() == [len(s) for s in seen]


@settings(max_examples=100, deadline=None)
@given(
    counts=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    world=st.sampled_from([1, 2, 3, 4]),
    other_world=st.sampled_from([1, 2, 4]),
    batch=st.integers(1, 6),
    workers=st.integers(1, 3),
    epoch=st.integers(0, 3),
    data=st.data(),
)
def test_positions_are_the_same_across_world_sizes_workers_and_resume_points(
    counts: list[int],
    world: int,
    other_world: int,
    batch: int,
    workers: int,
    epoch: int,
    data: st.DataObject,
) -> None:
    """The loaders split a mix epoch's positions with Partition; the sources of each global step
    are the same in every layout of the same global batch and after a resume at any step."""
    g = world * batch
    if g % other_world:
        other_world = 1
    sizes = data.draw(st.lists(st.integers(1, 20), min_size=len(counts), max_size=len(counts)))
    plan = MixPlan(counts, sizes)

    def global_steps(w: int, n_workers: int, start: int) -> list[list[tuple[int, int, int]]]:
        part = Partition(plan.epoch_size, w, g // w)
        steps: dict[int, list[tuple[int, int, int]]] = {}
        for worker in range(n_workers):
            for step in part.worker_steps(start, worker, n_workers):
                rows: list[tuple[int, int, int]] = []
                for rank in range(w):
                    positions, pad = part.positions(step, rank)
                    located = plan.locate(epoch, positions[~pad])
                    rows.extend(zip(*(a.tolist() for a in located), strict=True))
                steps[step] = rows
        return [steps[s] for s in sorted(steps)]

    reference = global_steps(world, 1, 0)
    resume_at = data.draw(st.integers(0, len(reference)))
    assert global_steps(other_world, workers, resume_at) == reference[resume_at:]
    delivered = [row for step in reference for row in step]
    assert len(delivered) == len(set(delivered)) == plan.epoch_size


@settings(max_examples=200, deadline=None)
@given(
    weights=st.lists(
        st.one_of(st.integers(1, 1000), st.floats(0.001, 1000), st.fractions(1, 100)),
        min_size=1,
        max_size=6,
    ).filter(lambda ws: all(w > 0 for w in ws)),
    window=st.one_of(st.none(), st.integers(50, 5000)),
)
def test_counts_are_exact_when_they_can_be_and_rounded_within_one_otherwise(
    weights: list[float], window: int | None
) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            counts = mix_counts(weights, window)
        except InvalidArgumentError as exc:
            refused: InvalidArgumentError | None = exc
        else:
            refused = None
    if refused is not None:  # only a weight too small for the window is refused
        assert "gets no position" in str(refused)
        return
    m = sum(counts)
    assert all(c >= 1 for c in counts)
    fracs = [
        Fraction(w).limit_denominator(10**9) if isinstance(w, float) else Fraction(w)
        for w in weights
    ]
    shares = [f / sum(fracs) for f in fracs]
    if window is not None:
        assert m == window
    else:
        assert m <= MAX_AUTO_WINDOW
    exact = all(Fraction(c, m) == s for c, s in zip(counts, shares, strict=True))
    if exact:
        assert not caught
    else:
        assert [type(w.message) for w in caught] == [MixRoundingWarning]
        assert all(abs(c - s * m) < 1 for c, s in zip(counts, shares, strict=True))


def test_decimal_weights_give_the_smallest_exact_window() -> None:
    assert mix_counts([0.7, 0.3]) == (7, 3)
    assert mix_counts([70, 30]) == (7, 3)
    assert mix_counts([1 / 3, 2 / 3]) == (1, 2)
    assert mix_counts([0.5, 0.25, 0.25]) == (2, 1, 1)
    assert mix_counts([0.7, 0.3], window=20) == (14, 6)


def test_rounding_warns_with_the_effective_weights() -> None:
    with pytest.warns(MixRoundingWarning, match=r"a: 4/10 = 0.4 .*multiple of 3"):
        assert mix_counts([1, 1, 1], window=10, names=["a", "b", "c"]) == (4, 3, 3)


@pytest.mark.parametrize(
    ("weights", "window", "match"),
    [
        ([], None, "1 to 127 sources"),
        ([1, 0], None, "must be > 0.*leave a source out"),
        ([1, -2], None, "must be > 0"),
        ([1, float("nan")], None, "positive number"),
        ([1, True], None, "positive number"),
        ([1, "2"], None, "positive number"),
        ([1000, 1], 100, "gets no position in a window of 100; pass window= of at least 1001"),
        ([1, 1, 1], 2, "window must be"),
    ],
)
def test_bad_weights_are_refused_with_the_fix(
    weights: list[object], window: int | None, match: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        mix_counts(weights, window)


def test_bad_plans_and_positions_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="source b has 0 items"):
        MixPlan([1, 1], [3, 0], names=["a", "b"])
    with pytest.raises(InvalidArgumentError, match="2 counts for 3 sources"):
        MixPlan([1, 1], [3, 3, 3])
    plan = MixPlan([1, 1], [3, 3])
    with pytest.raises(InvalidArgumentError, match=r"mix positions must lie in \[0, 6\)"):
        plan.locate(0, [6])
    with pytest.raises(InvalidArgumentError, match="epoch must be a non-negative int"):
        plan.locate(-1, [0])


def test_states_of_other_mixes_are_refused_naming_the_difference() -> None:
    plan = MixPlan([7, 3], [10, 20], names=["a", "b"])
    options = {**plan.options(), "seed": 0}
    state = {**options, "mix_sources": ["fa", "fb"]}
    check_mix_state(state, options, ["fa", "fb"], plan.names)  # the same mix: accepted
    cases = [
        ({**state, "mix_sources": ["fa", "fX"]}, "other data in source\\(s\\) b"),
        ({**state, "mix_sources": ["fa"]}, "1 sources, this mix has 2"),
        (
            {**state, "mix_counts": [6, 4]},
            r"mix_counts=\[6, 4\] but this mix has mix_counts=\[7, 3\]",
        ),
        ({**state, "mix_epoch_size": 20}, "mix_epoch_size=20"),
        ({**state, "seed": 3}, "seed=3"),
        ({"epoch": 0, "step": 1}, "not of a mix"),
    ]
    for bad, match in cases:
        with pytest.raises(InvalidArgumentError, match=match):
            check_mix_state(bad, options, ["fa", "fb"], plan.names)


def test_unique_names_mark_repeats() -> None:
    assert unique_names(["a", "b", "a", "a"]) == ("a", "b", "a#2", "a#3")
