"""fastload.DataLoader against the shared resume checker, and the checker against broken loaders.

The checker (:mod:`fastload.testing.resume`) resumes at every step of two epochs, with other
worker counts and world sizes at the same global batch; a loader that skips, repeats or
miscounts a batch must fail it.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

import fastload.loader as fl
from fastload.testing.resume import Layout, ResumeMismatch, check_resume

pytestmark = [pytest.mark.timeout(300)]
SIZES = [7, 5, 11]  # 23 samples: with a global batch of 4, 6 steps and a padded tail


def _factory(fake: SimpleNamespace, ds: fl.Dataset, **options: Any) -> Any:
    def make(*, world_size: int, rank: int, batch_size: int, num_workers: int) -> fl.DataLoader:
        return fl.DataLoader(
            ds,
            batch_size=batch_size,
            rank=rank,
            world_size=world_size,
            num_workers=num_workers,
            collate_fn=fake.keys_collate,
            **options,
        )

    return make


def test_resumes_exactly_at_every_step_with_other_workers_and_world_sizes(
    fake: SimpleNamespace,
) -> None:
    ds = fake.make_dataset(SIZES, seed=4, block_size=3, window=2)
    report = check_resume(
        _factory(fake, ds),
        global_batch_size=4,
        sample_ids=list,
        layouts=[Layout(2), Layout(2, num_workers=2), Layout(1), Layout(4)],
        expected=fake.all_keys(SIZES),
    )
    assert report.steps == {0: 6, 1: 6}
    assert report.resumes == 2 * 7 * (2 + 2 + 1 + 4)
    assert report.stops == 4


def test_resumes_exactly_with_drop_last(fake: SimpleNamespace) -> None:
    ds = fake.make_dataset(SIZES, seed=1)
    report = check_resume(
        _factory(fake, ds, drop_last=True),
        global_batch_size=6,
        sample_ids=list,
        layouts=[Layout(3), Layout(1), Layout(2)],
        expected=fake.all_keys(SIZES),
        complete=False,
        epochs=(3,),
    )
    assert report.steps == {3: 3}


# ---- the checker catches broken loaders ----------------------------------------------------


class _SkipsOnResume:
    """A DataLoader that resumes one batch too late (a lost batch)."""

    def __init__(self, loader: fl.DataLoader) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        steps = self.loader.partition.num_steps
        self.loader.load_state_dict({**state, "step": min(state["step"] + 1, steps)})


class _CountsPrefetched(_SkipsOnResume):
    """A loader whose state counts one batch more than it handed over, once stopped early."""

    def __iter__(self) -> Iterator[Any]:
        self._stopped = False
        try:
            yield from self.loader
        finally:
            self._stopped = True

    def state_dict(self) -> dict[str, Any]:
        state = self.loader.state_dict()
        if getattr(self, "_stopped", False) and 0 < state["step"] < self.loader.partition.num_steps:
            return {**state, "step": state["step"] + 1}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


class _ReordersOnResume(_SkipsOnResume):
    """A loader that resumes at the right step with the right counts, but other samples: the
    samples of each batch rotated (as if the resumed order lost the window permutation)."""

    def __iter__(self) -> Iterator[Any]:
        resumed = getattr(self, "_resumed", False)
        self._resumed = False
        for batch in self.loader:
            yield [*batch[1:], *batch[:1]] if resumed else batch

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
        self._resumed = True


class _RankDependentState(_CountsPrefetched):
    def state_dict(self) -> dict[str, Any]:
        return {**self.loader.state_dict(), "rank": self.loader.rank}


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        (_SkipsOnResume, r"len\(\) 5, but 6 batches are left"),
        (_ReordersOnResume, "global step 0 gave"),
        (_CountsPrefetched, "only batches handed over may count"),
        (_RankDependentState, "must not depend on the rank"),
    ],
)
def test_the_checker_catches_a_broken_loader(
    fake: SimpleNamespace, broken: type[_SkipsOnResume], message: str
) -> None:
    ds = fake.make_dataset(SIZES, seed=2)
    inner = _factory(fake, ds)

    def make(**kw: Any) -> _SkipsOnResume:
        return broken(inner(**kw))

    with pytest.raises(ResumeMismatch, match=message):
        check_resume(make, global_batch_size=4, sample_ids=list, layouts=[Layout(2)], epochs=(0,))


def test_the_checker_catches_a_lost_sample_in_another_world_size(fake: SimpleNamespace) -> None:
    ds = fake.make_dataset(SIZES, seed=2)
    inner = _factory(fake, ds)

    def make(*, world_size: int, **kw: Any) -> Any:
        loader = inner(world_size=world_size, **kw)
        return loader if world_size == 2 else _SkipsOnResume(loader)

    with pytest.raises(ResumeMismatch, match=r"into Layout\(world_size=1"):
        check_resume(
            make, global_batch_size=4, sample_ids=list, layouts=[Layout(2), Layout(1)], epochs=(0,)
        )


def test_the_checker_catches_a_repeated_sample(fake: SimpleNamespace) -> None:
    ds = fake.make_dataset(SIZES, seed=2)
    inner = _factory(fake, ds)

    class _Repeats(_SkipsOnResume):
        def __iter__(self) -> Iterator[Any]:
            for step, batch in enumerate(self.loader):
                yield [*batch, batch[0]] if step == 1 else batch

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.loader.load_state_dict(state)

    with pytest.raises(ResumeMismatch, match="twice"):
        check_resume(
            lambda **kw: _Repeats(inner(**kw)),
            global_batch_size=4,
            sample_ids=list,
            layouts=[Layout(1)],
            expected=fake.all_keys(SIZES),
            epochs=(0,),
        )
