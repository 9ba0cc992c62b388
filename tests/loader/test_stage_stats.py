"""``stats()`` says where the workers' time went: read, decode, transform, collate."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

import fastload.loader as fl

SIZES = [6, 6]
DECODE_S, TRANSFORM_S = 0.004, 0.002


def _slow_decode(raw: dict[str, Any]) -> dict[str, Any]:
    time.sleep(DECODE_S)
    return raw


def _slow_transform(sample: dict[str, Any]) -> dict[str, Any]:
    time.sleep(TRANSFORM_S)
    return sample


@pytest.mark.parametrize("workers", [0, 2])
def test_the_stages_add_up_to_what_the_samples_cost(fake: SimpleNamespace, workers: int) -> None:
    ds = fake.make_dataset(SIZES, decode=_slow_decode, transform=_slow_transform)
    loader = fl.DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=fake.keys_collate)
    assert sum(len(b) for b in loader) == 12
    stats = loader.stats()
    # sleeps are lower bounds: each sample slept that long in its stage
    assert stats["decode_s"] >= 12 * DECODE_S
    assert stats["transform_s"] >= 12 * TRANSFORM_S
    assert stats["decode_s"] < 12 * DECODE_S + 1.0  # and the stages are not mixed up:
    assert stats["transform_s"] < stats["decode_s"]  # the transform sleeps half as long
    assert stats["read_s"] >= 0
    assert stats["collate_s"] >= 0
    if workers == 0:  # one process: its stages fit in the time the loop took
        total = stats["read_s"] + stats["decode_s"] + stats["transform_s"] + stats["collate_s"]
        assert total <= stats["elapsed_s"]
    loader.reset_stats()
    assert loader.stats()["decode_s"] == 0.0
