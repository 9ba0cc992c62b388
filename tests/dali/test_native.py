"""DALILoader with DALI's native readers (fn.readers.webdataset / tfrecord) on fastload's .idx
files: what native mode guarantees (see fastload/dali/_native.py), tested in CPU mode."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fastload.dali import DALILoader, ImageAugment, NativePlan
from fastload.errors import InvalidArgumentError

pytestmark = [pytest.mark.timeout(300)]
N = 46
SIZES = (17, 12, 17)


def make(root: str, batch: int, **kw: Any) -> DALILoader:
    kw.setdefault("augment", ImageAugment(size=16))
    return DALILoader(root, batch, device="cpu", reader="native", num_threads=1, **kw)


def steps_of(loader: DALILoader) -> list[list[int]]:
    return [b[1].tolist() for b in loader]


@pytest.mark.parametrize("fmt", ["webdataset", "tfrecord"])
@pytest.mark.parametrize(("world", "batch"), [(1, 8), (2, 5), (3, 5), (3, 4), (4, 3)])
def test_exactly_once_equal_batches(
    datasets: dict[str, str], fmt: str, world: int, batch: int
) -> None:
    for epoch in (0, 1):
        delivered: list[int] = []
        counts = set()
        padded = 0
        for rank in range(world):
            loader = make(datasets[fmt], batch, rank=rank, world_size=world, seed=4)
            loader.set_epoch(epoch)
            plan = loader.native_plan()
            assert len(loader) == plan.num_steps == math.ceil(math.ceil(N / world) / batch)
            steps = steps_of(loader)
            counts.add(len(steps))
            assert all(0 < len(s) <= batch for s in steps)
            delivered += [x for s in steps for x in s]
            padded += loader.stats()["padded"]
            assert loader.stats()["samples"] == sum(len(s) for s in steps)
        assert counts == {plan.num_steps}
        real = delivered
        # exactly once, plus the counted padding rows that keep batch counts equal
        assert sorted(set(real)) == list(range(N))
        assert len(real) == N + padded
        assert padded <= world


@pytest.mark.parametrize("fmt", ["webdataset", "tfrecord"])
def test_unshuffled_slices_rotate_with_the_epoch(datasets: dict[str, str], fmt: str) -> None:
    world = 3
    for epoch in (0, 1, 2):
        for rank in range(world):
            loader = make(datasets[fmt], 4, rank=rank, world_size=world, shuffle=False)
            loader.set_epoch(epoch)
            s = (rank + epoch) % world
            assert [x for b in steps_of(loader) for x in b] == list(
                range(N * s // world, N * (s + 1) // world)
            )


def test_drop_last(datasets: dict[str, str]) -> None:
    world, batch = 3, 4
    delivered = []
    for rank in range(world):
        loader = make(datasets["webdataset"], batch, rank=rank, world_size=world, drop_last=True)
        steps = steps_of(loader)
        assert len(steps) == (N // world) // batch == 3
        assert all(len(s) == batch for s in steps)
        delivered += [x for s in steps for x in s]
        assert loader.stats()["dropped_per_epoch"] == N - 3 * batch * world
    assert len(delivered) == len(set(delivered)) == 36


def test_deterministic_and_resumable(datasets: dict[str, str]) -> None:
    root = datasets["tfrecord"]
    a = [b for b in make(root, 6, seed=2, world_size=2, rank=1)]
    b = [b for b in make(root, 6, seed=2, world_size=2, rank=1)]
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))
    first = make(root, 6, seed=2, world_size=2, rank=1)
    it = iter(first)
    next(it)
    next(it)
    state = first.state_dict()
    it.close()
    assert state["reader"] == "native"
    assert state["step"] == 2
    again = make(root, 6, seed=2, world_size=2, rank=1)
    again.load_state_dict(state)
    assert len(again) == len(a) - 2
    assert steps_of(again) == [x[1].tolist() for x in a[2:]]
    with pytest.raises(InvalidArgumentError, match="same world size"):
        make(root, 12, seed=2).load_state_dict(state)
    with pytest.raises(InvalidArgumentError, match="reader"):
        DALILoader(root, 6, device="cpu", seed=2, world_size=2, rank=1).load_state_dict(state)


def _encoded(images: Any, labels: Any, *, device: str) -> Any:
    return images, labels


@pytest.mark.parametrize("fmt", ["webdataset", "tfrecord"])
def test_native_readers_return_our_bytes(
    kit: SimpleNamespace, datasets: dict[str, str], fmt: str
) -> None:
    loader = make(datasets[fmt], 10, augment=_encoded, shuffle=False)
    seen = 0
    for raw, labels in loader:
        assert labels.dtype == torch.int64
        for t, g in zip(raw, labels.tolist()):
            assert bytes(t.numpy()) == kit.jpeg(g)
            seen += 1
    assert seen == N


def test_plan_arithmetic() -> None:
    plan = NativePlan(10, 3, 3, rank=0, epoch=0)
    assert plan.slice == (0, 3)
    assert plan.num_steps == 2
    assert [plan.real_rows(s) for s in range(2)] == [3, 0]
    assert plan.kept_rows(1) == (1, 1)
    assert NativePlan(10, 3, 3, rank=2, epoch=0).slice == (6, 10)
    assert NativePlan(10, 3, 3, rank=2, epoch=1).slice == (0, 3)
    with pytest.raises(InvalidArgumentError, match="at least one sample per rank"):
        NativePlan(2, 3, 1, rank=0, epoch=0)


@pytest.mark.parametrize("fmt", ["webdataset", "tfrecord"])
def test_damaged_index_or_shard_is_refused_before_dali_reads_it(
    datasets: dict[str, str], fmt: str, tmp_path: Any
) -> None:
    """DALI trusts .idx files: a duplicated line would deliver one sample twice and lose its
    neighbour. fastload checks each index (and each shard's size) first, naming the file."""
    import shutil
    from pathlib import Path

    from fastload.errors import CorruptDataError

    root = tmp_path / "ds"
    shutil.copytree(datasets[fmt], root)
    shard = sorted(p for p in root.iterdir() if p.suffix in (".tar", ".tfrecord"))[1]
    index = Path(str(shard) + ".idx")
    lines = index.read_bytes().splitlines(keepends=True)
    lines[3] = lines[2]  # a line repeated over its neighbour, the count unchanged
    index.write_bytes(b"".join(lines))
    with pytest.raises(CorruptDataError, match="index") as ei:
        steps_of(make(str(root), 4))
    assert shard.name + ".idx" in str(ei.value)
    shutil.copy(Path(datasets[fmt]) / (shard.name + ".idx"), index)  # index repaired
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 700)
    with pytest.raises(CorruptDataError, match="the dataset manifest says") as ei:
        steps_of(make(str(root), 4))
    assert shard.name in str(ei.value)
