"""DALILoader (external reader, CPU pipelines) against the shared resume checker, and its states
against fastload.DataLoader's: the same keys, the dataset fingerprint checked by both."""

from __future__ import annotations

from typing import Any

import pytest

import fastload.loader as fl
from fastload.dali import DALILoader, ImageAugment
from fastload.errors import InvalidArgumentError
from fastload.testing.resume import Layout, check_resume

pytestmark = [pytest.mark.timeout(600)]
N = 46  # the datasets fixture: shards of 17, 12 and 17 samples; label = sample number
SMALL = ImageAugment(size=16)


def _make(root: str, **options: Any) -> Any:
    def make(*, world_size: int, rank: int, batch_size: int, num_workers: int) -> DALILoader:
        return DALILoader(
            root,
            batch_size,
            device="cpu",
            augment=SMALL,
            num_threads=1,
            py_workers=num_workers,
            prebuild=False,
            rank=rank,
            world_size=world_size,
            seed=5,
            **options,
        )

    return make


def _labels(batch: Any) -> list[int]:
    return [int(x) for x in batch[1].tolist()]


def test_resumes_exactly_at_every_step_and_into_another_world_size(
    datasets: dict[str, str],
) -> None:
    report = check_resume(
        _make(datasets["webdataset"]),
        global_batch_size=12,
        sample_ids=_labels,
        layouts=[Layout(2), Layout(1), Layout(3), Layout(2, num_workers=1)],
        expected=range(N),
        epochs=(0, 1),
        stop_checks=1,
    )
    assert report.steps == {0: 4, 1: 4}


def test_states_are_interchangeable_with_the_torch_loader(datasets: dict[str, str]) -> None:
    root = datasets["tfrecord"]
    dali = _make(root)(world_size=1, rank=0, batch_size=8, num_workers=0)
    ds = fl.open_dataset(root, decode="bytes", fields=("cls",), seed=5)
    torch_loader = fl.DataLoader(ds, batch_size=8)
    it = iter(dali)
    next(it)
    it.close()
    state = dali.state_dict()
    assert set(state) == set(torch_loader.state_dict())  # the same keys, fingerprint included
    assert state["dataset"] == ds.fingerprint
    torch_loader.load_state_dict(state)
    rest = [b[0].tolist() for b in torch_loader]
    again = _make(root)(world_size=1, rank=0, batch_size=8, num_workers=0)
    again.load_state_dict(torch_loader.state_dict() | {"step": 1})  # the torch loader's state
    assert [_labels(b) for b in again] == rest


def test_a_state_of_another_dataset_is_refused_and_an_old_state_still_loads(
    datasets: dict[str, str],
) -> None:
    make = _make(datasets["webdataset"])
    state = make(world_size=1, rank=0, batch_size=8, num_workers=0).state_dict()
    # The same sample count and order options, another shard list: only the fingerprint differs.
    other = make(world_size=1, rank=0, batch_size=8, num_workers=0)
    with pytest.raises(InvalidArgumentError, match="another dataset"):
        other.load_state_dict(state | {"dataset": "0123456789abcdef"})
    # A state saved by a DALILoader before the fingerprint was added has no "dataset" key.
    old = {k: v for k, v in state.items() if k != "dataset"} | {"step": 2}
    other.load_state_dict(old)
    assert len(other) == other.partition.num_steps - 2
