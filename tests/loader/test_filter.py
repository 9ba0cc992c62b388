"""``open_dataset(..., filter=...)``: a predicate applied in the workers; every sample that
passes is delivered exactly once per epoch (also across resumes), the rejected ones are counted."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

import fastload.loader as fl
from fastload.errors import InvalidArgumentError, WorkerError
from fastload.testing.resume import Layout, check_resume

pytestmark = [pytest.mark.timeout(300)]
SIZES = [7, 5, 11]  # 23 samples, labels s * 1000 + p


def _label(sample: dict[str, Any]) -> int:
    return int(sample["cls"])


def _even(sample: dict[str, Any]) -> bool:
    return _label(sample) % 2 == 0


def _broken(sample: dict[str, Any]) -> bool:
    raise RuntimeError("a bug in the predicate")


def _passing(fake: SimpleNamespace) -> list[str]:
    return [
        fake.key_of(s, p) for s, n in enumerate(SIZES) for p in range(n) if (s * 1000 + p) % 2 == 0
    ]


@pytest.mark.parametrize("workers", [0, 2])
def test_only_what_passes_is_delivered_once_and_the_rest_is_counted(
    fake: SimpleNamespace, workers: int
) -> None:
    ds = fake.make_dataset(SIZES, seed=2, filter=_even)
    loader = fl.DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=fake.keys_collate)
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        batches = list(loader)
        keys = [k for b in batches for k in b]
        assert sorted(keys) == sorted(_passing(fake))  # each passing sample once
        assert len(batches) == 6  # the partition is over all 23 samples: short batches
    stats = loader.stats()
    passing = len(_passing(fake))
    assert (stats["samples"], stats["filtered"], stats["skipped"]) == (
        2 * passing,
        2 * (23 - passing),
        0,
    )


def test_resumes_exactly_over_what_passes(fake: SimpleNamespace) -> None:
    ds = fake.make_dataset(SIZES, seed=4, block_size=3, window=2, filter=_even)

    def make(*, world_size: int, rank: int, batch_size: int, num_workers: int) -> fl.DataLoader:
        return fl.DataLoader(
            ds, batch_size=batch_size, rank=rank, world_size=world_size,
            num_workers=num_workers, collate_fn=fake.keys_collate,
        )  # fmt: skip

    report = check_resume(
        make,
        global_batch_size=4,
        sample_ids=list,
        layouts=[Layout(2), Layout(1, num_workers=2), Layout(4)],
        expected=_passing(fake),
    )
    assert report.steps == {0: 6, 1: 6}


def test_the_map_style_form_gives_none_for_a_rejected_sample(fake: SimpleNamespace) -> None:
    ds = fake.make_dataset(SIZES, shuffle=False, filter=_even)
    assert ds[0] is not None
    assert _label(ds[0]) == 0
    assert ds[1] is None
    assert _label(ds[2]) == 2


def test_a_filter_that_raises_names_the_sample(fake: SimpleNamespace) -> None:
    ds = fake.make_dataset(SIZES, filter=_broken)
    with pytest.raises(WorkerError, match=r"filter failed on sample .* RuntimeError: a bug"):
        list(fl.DataLoader(ds, batch_size=4, collate_fn=fake.keys_collate))


def test_a_filter_must_be_callable(fake: SimpleNamespace) -> None:
    with pytest.raises(InvalidArgumentError, match="filter must be a callable"):
        fake.make_dataset(SIZES, filter="even")
