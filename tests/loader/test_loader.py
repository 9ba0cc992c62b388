"""fastload.DataLoader: epochs, state_dict/load_state_dict, stats, errors, worker processes."""

from __future__ import annotations

import os
import pickle
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import fastload.loader as fl
from fastload.errors import InvalidArgumentError, WorkerError
from fastload.loader import BatchStream
from fastload.loader.order._order import ORDER_VERSION


def keys_of(batches: list[Any]) -> list[str]:
    return [k for b in batches for k in b]


def epoch_keys(loader: fl.DataLoader) -> list[str]:
    return keys_of(list(loader))


# ---- main-process loading ---------------------------------------------------------------------


def test_epoch_exactly_once_and_stats(fake: SimpleNamespace) -> None:
    sizes = [10, 0, 7, 1]
    ds = fake.make_dataset(sizes, on_error="skip")
    loader = fl.DataLoader(
        ds, batch_size=4, collate_fn=fake.keys_collate, rank=0, world_size=1, io_threads=2
    )
    assert len(loader) == 5
    got = epoch_keys(loader)
    assert sorted(got) == sorted(fake.all_keys(sizes))
    st = loader.stats()
    assert st["batches"] == 5
    assert st["samples"] == 18
    assert st["bytes"] == sum(len(str(s * 1000 + p)) for s, n in enumerate(sizes) for p in range(n))
    assert st["padded"] == st["skipped"] == 0
    assert st["data_stall_s"] >= 0
    assert st["samples_per_s"] > 0
    state = loader.state_dict()
    assert state["step"] == 5
    assert state["epoch"] == 0
    assert len(pickle.dumps(state)) < 1000  # O(1)


def test_set_epoch_and_replay(fake: SimpleNamespace) -> None:
    ds = fake.make_dataset([20, 13], seed=3, block_size=4, window=2)
    loader = fl.DataLoader(ds, batch_size=8, collate_fn=fake.keys_collate)
    e0 = epoch_keys(loader)
    assert epoch_keys(loader) == e0  # without set_epoch the same order replays
    loader.set_epoch(1)
    e1 = epoch_keys(loader)
    assert sorted(e1) == sorted(e0)
    assert e1 != e0
    loader.set_epoch(0)
    assert epoch_keys(loader) == e0


def test_shuffle_override_and_no_shuffle(fake: SimpleNamespace) -> None:
    ds = fake.make_dataset([5, 4])
    loader = fl.DataLoader(ds, batch_size=3, shuffle=False, collate_fn=fake.keys_collate)
    assert epoch_keys(loader) == fake.all_keys([5, 4])
    assert ds.shuffle  # the user's dataset is not modified


@pytest.mark.parametrize("stop_after", [0, 1, 3, 6])
def test_resume_mid_epoch_exact(fake: SimpleNamespace, stop_after: int) -> None:
    sizes = [9, 14, 3]
    ds = fake.make_dataset(sizes, seed=11)
    ref = fl.DataLoader(ds, batch_size=4, collate_fn=fake.keys_collate)
    ref.set_epoch(2)
    full = list(ref)
    first = fl.DataLoader(ds, batch_size=4, collate_fn=fake.keys_collate)
    first.set_epoch(2)
    it = iter(first)
    seen = [next(it) for _ in range(stop_after)]
    state = first.state_dict()
    assert state["step"] == stop_after
    resumed = fl.DataLoader(ds, batch_size=4, collate_fn=fake.keys_collate)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # the saved epoch: keeps the resume point
    assert len(resumed) == len(full) - stop_after
    rest = list(resumed)
    assert seen + rest == full
    assert resumed.state_dict()["step"] == len(full)
    resumed.set_epoch(3)  # the next epoch starts at step 0
    assert len(resumed) == len(full)
    assert sorted(epoch_keys(resumed)) == sorted(fake.all_keys(sizes))


def _state_at(fake: SimpleNamespace, ds: fl.Dataset, epoch: int, steps: int) -> dict[str, Any]:
    """The state of a loader (batch 4) after ``steps`` batches of ``epoch``."""
    src = fl.DataLoader(ds, batch_size=4, collate_fn=fake.keys_collate)
    src.set_epoch(epoch)
    it = iter(src)
    for _ in range(steps):
        next(it)
    return src.state_dict()


def test_set_epoch_to_another_epoch_with_a_pending_mid_epoch_resume_raises(
    fake: SimpleNamespace,
) -> None:
    sizes = [9, 14, 3]  # 26 samples: 7 global steps of 4
    ds = fake.make_dataset(sizes, seed=11)
    ref = fl.DataLoader(ds, batch_size=4, collate_fn=fake.keys_collate)
    ref.set_epoch(3)
    full3 = list(ref)
    state = _state_at(fake, ds, 3, 4)
    loader = fl.DataLoader(ds, batch_size=4, collate_fn=fake.keys_collate)
    loader.load_state_dict(state)
    with pytest.raises(InvalidArgumentError) as err:
        loader.set_epoch(5)
    assert str(err.value) == (
        "set_epoch(5) would drop the resume that load_state_dict() set up: epoch 3 at global step "
        "4 of 7, with 3 global steps not delivered yet, which would never be trained. To finish "
        "epoch 3 first, call set_epoch(3) (or iterate without set_epoch) and move on to epoch 5 "
        "after it, e.g. `for epoch in range(state['epoch'], epochs): loader.set_epoch(epoch)`; "
        "to start epoch 5 from its beginning instead, call set_epoch(5, discard_resume=True)"
    )
    # Nothing changed: the usual loop (set_epoch with the saved epoch) still resumes exactly.
    assert (loader.epoch, len(loader)) == (3, 3)
    loader.set_epoch(3)
    assert list(loader) == full3[4:]
    loader.set_epoch(5)  # the resumed epoch was consumed: moving on is normal
    assert sorted(epoch_keys(loader)) == sorted(fake.all_keys(sizes))


def test_set_epoch_discard_resume_starts_the_epoch_afresh(fake: SimpleNamespace) -> None:
    sizes = [9, 14, 3]
    ds = fake.make_dataset(sizes, seed=11)
    full = {}
    for epoch in (3, 5):
        ref = fl.DataLoader(ds, batch_size=4, collate_fn=fake.keys_collate)
        ref.set_epoch(epoch)
        full[epoch] = list(ref)
    loader = fl.DataLoader(ds, batch_size=4, collate_fn=fake.keys_collate)
    loader.load_state_dict(_state_at(fake, ds, 3, 2))
    loader.set_epoch(5, discard_resume=True)
    assert list(loader) == full[5]
    loader.load_state_dict(_state_at(fake, ds, 3, 2))
    loader.set_epoch(3, discard_resume=True)  # the saved epoch, from its first step
    assert list(loader) == full[3]


@pytest.mark.parametrize("steps", [0, 7])
def test_set_epoch_replaces_a_resume_with_nothing_pending(
    fake: SimpleNamespace, steps: int
) -> None:
    """A state saved before an epoch's first batch or after its last holds no partial epoch:
    another epoch replaces it silently (the loop that saves the state at the end of each
    epoch and calls set_epoch(epoch + 1) on resume)."""
    sizes = [9, 14, 3]
    ds = fake.make_dataset(sizes, seed=11)
    ref = fl.DataLoader(ds, batch_size=4, collate_fn=fake.keys_collate)
    ref.set_epoch(4)
    full4 = list(ref)
    loader = fl.DataLoader(ds, batch_size=4, collate_fn=fake.keys_collate)
    loader.load_state_dict(_state_at(fake, ds, 3, steps))
    loader.set_epoch(4)
    assert list(loader) == full4


def test_elastic_resume_other_world_size(fake: SimpleNamespace) -> None:
    """Save on 2 ranks x batch 3, resume on 3 ranks x batch 2 (global batch 6)."""
    sizes = [11, 8, 0, 5]
    ds = fake.make_dataset(sizes, seed=2, block_size=3)
    old = [
        fl.DataLoader(ds, batch_size=3, rank=r, world_size=2, collate_fn=fake.keys_collate)
        for r in range(2)
    ]
    iters = [iter(ld) for ld in old]
    done = [k for _ in range(2) for it in iters for k in next(it)]
    states = [ld.state_dict() for ld in old]
    assert states[0]["step"] == states[1]["step"] == 2
    new = [
        fl.DataLoader(ds, batch_size=2, rank=r, world_size=3, collate_fn=fake.keys_collate)
        for r in range(3)
    ]
    for ld in new:
        ld.load_state_dict(states[0])
    lens = {len(ld) for ld in new}
    assert len(lens) == 1
    rest = [k for ld in new for k in epoch_keys(ld)]
    padded = sum(ld.stats()["padded"] for ld in new)
    counts = Counter(done + rest)
    assert set(counts) == set(fake.all_keys(sizes))
    assert sum(counts.values()) == sum(sizes) + padded
    assert padded == new[0].partition.padded
    with pytest.raises(InvalidArgumentError, match="global batch size of 6"):
        fl.DataLoader(ds, batch_size=4, rank=0, world_size=2).load_state_dict(states[0])


def test_load_state_dict_rejects_other_order(fake: SimpleNamespace) -> None:
    ds = fake.make_dataset([10], seed=1)
    state = fl.DataLoader(ds, batch_size=2).state_dict()
    with pytest.raises(InvalidArgumentError, match="seed"):
        fl.DataLoader(fake.make_dataset([10], seed=2), batch_size=2).load_state_dict(state)
    with pytest.raises(InvalidArgumentError, match=r"11 samples|10 samples"):
        fl.DataLoader(fake.make_dataset([11], seed=1), batch_size=2).load_state_dict(state)
    other = fl.DataLoader(fake.make_dataset([4, 6], seed=1), batch_size=2)  # same size
    with pytest.raises(InvalidArgumentError, match="another dataset"):
        other.load_state_dict(state)
    with pytest.raises(InvalidArgumentError, match="version"):
        fl.DataLoader(ds, batch_size=2).load_state_dict({**state, "version": 99})
    with pytest.raises(InvalidArgumentError, match="state dict"):
        fl.DataLoader(ds, batch_size=2).load_state_dict({})


def test_drop_last_and_padding_stats(fake: SimpleNamespace) -> None:
    ds = fake.make_dataset([7], shuffle=False)
    loaders = [
        fl.DataLoader(ds, batch_size=2, rank=r, world_size=2, collate_fn=fake.keys_collate)
        for r in range(2)
    ]
    out = [list(ld) for ld in loaders]
    assert [len(o) for o in out] == [2, 2]
    assert [len(b) for b in out[0]] == [2, 2]
    assert [len(b) for b in out[1]] == [2, 2]
    assert sum(ld.stats()["padded"] for ld in loaders) == 1
    dropped = [
        fl.DataLoader(
            ds, batch_size=2, rank=r, world_size=2, drop_last=True, collate_fn=fake.keys_collate
        )
        for r in range(2)
    ]
    assert [len(d) for d in dropped] == [1, 1]
    assert dropped[0].stats()["dropped_per_epoch"] == 3
    assert keys_of(list(dropped[0])) + keys_of(list(dropped[1])) == fake.all_keys([7])[:4]


def test_rejects_torch_only_arguments(fake: SimpleNamespace) -> None:
    ds = fake.make_dataset([3])
    with pytest.raises(InvalidArgumentError, match="sampler"):
        fl.DataLoader(ds, sampler=[0, 1])
    with pytest.raises(InvalidArgumentError, match="in_order"):
        fl.DataLoader(ds, in_order=False)
    with pytest.raises(InvalidArgumentError, match="open_dataset"):
        fl.DataLoader([1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="batch_size"):
        fl.DataLoader(ds, batch_size=0)
    if not torch.cuda.is_available():
        with pytest.raises(InvalidArgumentError, match="cuda"):
            fl.DataLoader(ds, device="cuda")


def test_cpu_device_is_a_no_op(fake: SimpleNamespace) -> None:
    ds = fake.make_dataset([5], transform={"cls": int}, fields=("cls",))
    loader = fl.DataLoader(ds, batch_size=5, device="cpu")
    ((cls,),) = list(loader)
    assert cls.device.type == "cpu"
    assert sorted(cls.tolist()) == [0, 1, 2, 3, 4]


def test_rank_detection_from_environment(
    fake: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = fake.make_dataset([10])
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    loader = fl.DataLoader(ds, batch_size=2)
    assert (loader.rank, loader.world_size) == (1, 2)
    assert len(loader) == 3
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(InvalidArgumentError, match="rank"):
        fl.DataLoader(ds, batch_size=2)


def test_loader_and_dataset_pickle(fake: SimpleNamespace) -> None:
    ds = fake.make_dataset([6, 2], transform={"cls": int})
    loader = fl.DataLoader(ds, batch_size=3, collate_fn=fake.keys_collate)
    next(iter(loader))  # open readers, start a pool: none of it may leak into the pickle
    clone = pickle.loads(pickle.dumps(loader))
    assert sorted(epoch_keys(clone)) == sorted(fake.all_keys([6, 2]))
    ds2 = pickle.loads(pickle.dumps(ds))
    assert ds2[0]["cls"] == ds[0]["cls"] == 0


def test_plain_torch_dataloader_over_both_forms(fake: SimpleNamespace) -> None:
    ds = fake.make_dataset([4, 3], fields=("__key__",))
    mapped = torch.utils.data.DataLoader(ds, batch_size=3, shuffle=True)
    assert sorted(k for (keys,) in mapped for k in keys) == sorted(fake.all_keys([4, 3]))
    stream = BatchStream(ds, 3, rank=0, world_size=1)
    plain = torch.utils.data.DataLoader(stream, batch_size=None)
    assert len(plain) == 3
    assert sorted(k for (keys,) in plain for k in keys) == sorted(fake.all_keys([4, 3]))


# ---- worker processes -------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_workers_same_batches_as_main_process(fake: SimpleNamespace) -> None:
    ds = fake.make_dataset([13, 0, 9, 2], seed=4, block_size=3)
    ref = list(fl.DataLoader(ds, batch_size=3, collate_fn=fake.keys_collate))
    loader = fl.DataLoader(
        ds,
        batch_size=3,
        num_workers=2,
        collate_fn=fake.keys_collate,
        persistent_workers=True,
        prefetch_factor=2,
    )
    assert list(loader) == ref
    loader.set_epoch(1)  # persistent workers must see the new epoch
    e1 = list(loader)
    assert e1 != ref
    assert e1 == list(fl.DataLoader(ds, batch_size=3, collate_fn=fake.keys_collate).__iter__()) or (
        sorted(keys_of(e1)) == sorted(keys_of(ref))
    )
    main = fl.DataLoader(ds, batch_size=3, collate_fn=fake.keys_collate)
    main.set_epoch(1)
    assert e1 == list(main)
    # resume with a different number of workers, persistent workers already running
    state_src = fl.DataLoader(ds, batch_size=3, num_workers=3, collate_fn=fake.keys_collate)
    state_src.set_epoch(1)
    it = iter(state_src)
    head = [next(it) for _ in range(4)]
    loader.load_state_dict(state_src.state_dict())
    assert head + list(loader) == e1
    assert loader.stats()["samples"] == 2 * 24 + len(keys_of(e1[4:]))


def _die_on_key_5(sample: dict[str, Any]) -> dict[str, Any]:
    if sample["__key__"] == "s000/k00005":
        os._exit(3)  # simulate a worker killed (OOM killer, segfault)
    return sample


def _fail_on_key_5(sample: dict[str, Any]) -> dict[str, Any]:
    if sample["__key__"] == "s000/k00005":
        raise ValueError("bad pixels")
    return sample


@pytest.mark.timeout(120)
def test_worker_exception_names_shard_and_key(fake: SimpleNamespace) -> None:
    ds = fake.make_dataset([8], decode=_fail_on_key_5, shuffle=False)
    loader = fl.DataLoader(ds, batch_size=2, num_workers=2, collate_fn=fake.keys_collate)
    with pytest.raises(WorkerError, match=r"(?s)s000/k00005.*shard-000000\.fake.*bad pixels"):
        list(loader)


@pytest.mark.timeout(120)
def test_dead_worker_is_an_error_not_a_hang(fake: SimpleNamespace) -> None:
    ds = fake.make_dataset([8], decode=_die_on_key_5, shuffle=False)
    loader = fl.DataLoader(ds, batch_size=2, num_workers=2, collate_fn=fake.keys_collate)
    with pytest.raises(
        WorkerError,
        match=r"died at global step 2 processing sample at position 5 of shard [^ ]*shard-000000\.fake",
    ):
        list(loader)


# ---- a real format ----------------------------------------------------------------------------


def _wds_dataset(fake: SimpleNamespace, tmp_path: Path, sizes: list[int], **kw: Any) -> fl.Dataset:
    return fl.open_dataset(
        fake.build_format_dataset(str(tmp_path / "ds"), sizes, "webdataset"), **kw
    )


@pytest.mark.timeout(120)
def test_webdataset_workers_exactly_once_and_resume(fake: SimpleNamespace, tmp_path: Path) -> None:
    sizes = [17, 5, 0, 12]
    ds = _wds_dataset(fake, tmp_path, sizes, decode="rgb8", fields=("__key__", "cls", "bin"))
    loader = fl.DataLoader(ds, batch_size=4, num_workers=2)
    batches = list(loader)
    keys = [k for b in batches for k in b[0]]
    assert sorted(keys) == sorted(fake.all_keys(sizes))
    for key_batch, cls, payload in batches:
        assert cls.dtype == torch.int64
        for k, c, p in zip(key_batch, cls.tolist(), payload):
            s, i = int(k[1:4]), int(k[-5:])
            assert c == s * 1000 + i
            assert p == bytes([i % 256]) * 16
    st = loader.stats()
    assert st["samples"] == 34
    assert st["bytes"] == sum(len(str(int(k[1:4]) * 1000 + int(k[-5:]))) + 16 for k in keys)
    # stop after 3 batches, resume in a new loader with 1 worker
    first = fl.DataLoader(ds, batch_size=4, num_workers=2)
    it = iter(first)
    head = [next(it)[0] for _ in range(3)]
    state = first.state_dict()
    del it
    again = fl.DataLoader(ds, batch_size=4, num_workers=1)
    again.load_state_dict(state)
    assert head + [b[0] for b in again] == [b[0] for b in batches]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["webdataset", "tfrecord", "lmdb"])
def test_every_format_exactly_once_with_workers(
    fake: SimpleNamespace, tmp_path: Path, fmt: str
) -> None:
    sizes = [5, 0, 3, 9]
    root = fake.build_format_dataset(str(tmp_path / fmt), sizes, fmt)
    ds = fl.open_dataset(root, decode="rgb8", fields=("__key__", "cls"), block_size=2, window=2)
    assert ds[3] == (fake.key_of(0, 3), 3)  # map-style random access
    assert ds[len(ds) - 1] == (fake.key_of(3, 8), 3008)
    main = [b[0] for b in fl.DataLoader(ds, batch_size=3)]
    workers = [b[0] for b in fl.DataLoader(ds, batch_size=3, num_workers=2)]
    assert workers == main
    assert sorted(k for b in main for k in b) == sorted(fake.all_keys(sizes))


@pytest.mark.timeout(120)
def test_spawn_context(fake: SimpleNamespace, tmp_path: Path) -> None:
    """Datasets and loaders pickle: spawned workers (no fork) produce the same batches."""
    ds = _wds_dataset(fake, tmp_path, [6, 3], decode="rgb8", fields=("__key__", "cls"))
    main = fl.DataLoader(ds, batch_size=4)
    ref = [b[0] for b in main]
    main.set_epoch(1)
    ref1 = [b[0] for b in main]
    loader = fl.DataLoader(
        ds, batch_size=4, num_workers=1, multiprocessing_context="spawn", persistent_workers=True
    )
    assert [b[0] for b in loader] == ref
    loader.set_epoch(1)  # reaches the spawned, persistent worker through shared memory
    assert [b[0] for b in loader] == ref1
    assert ref1 != ref


@pytest.mark.timeout(120)
def test_corrupt_webdataset_sample_skip_and_raise(fake: SimpleNamespace, tmp_path: Path) -> None:
    root = fake.build_format_dataset(str(tmp_path / "ds"), [5, 3], "webdataset")
    tar = tmp_path / "ds" / "train-000000.tar"
    data = tar.read_bytes()
    at = data.index(b"s000/k00002.cls")  # damage one member header (its checksum no longer fits)
    tar.write_bytes(data[:at] + b"s000/k00002.clz" + data[at + 15 :])
    ds = fl.open_dataset(root, decode="rgb8", fields=("__key__", "cls"), on_error="skip")
    loader = fl.DataLoader(ds, batch_size=3, num_workers=1)
    keys = [k for b in loader for k in b[0]]
    assert sorted(keys) == sorted(set(fake.all_keys([5, 3])) - {fake.key_of(0, 2)})
    assert loader.stats()["skipped"] == 1
    assert len(loader) == 3  # the batch count does not change
    ds = fl.open_dataset(root, decode="rgb8", fields=("__key__", "cls"), shuffle=False)
    with pytest.raises(WorkerError, match=r"(?s)position 2 of shard \S*train-000000\.tar.*Corrupt"):
        list(fl.DataLoader(ds, batch_size=3, num_workers=1))


def test_load_state_dict_checks_the_order_version(fake: SimpleNamespace) -> None:
    small = fake.make_dataset([10], seed=1)
    state = fl.DataLoader(small, batch_size=2).state_dict()
    assert state["order_version"] == ORDER_VERSION
    before_versions = {k: v for k, v in state.items() if k != "order_version"}
    fl.DataLoader(small, batch_size=2).load_state_dict(
        before_versions
    )  # same order up to 4,096 blocks
    with pytest.raises(InvalidArgumentError, match="order version 3"):
        fl.DataLoader(small, batch_size=2).load_state_dict({**state, "order_version": 3})
    large = fake.make_dataset([4097], seed=1, block_size=1)
    saved = fl.DataLoader(large, batch_size=2).state_dict()
    del saved["order_version"]
    with pytest.raises(InvalidArgumentError, match=r"order version 1\b.*set_epoch\(1\)"):
        fl.DataLoader(large, batch_size=2).load_state_dict(saved)


class _GlobalDraws:
    """A transform that draws from Python's, NumPy's and torch's global generators (picklable)."""

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        import random

        import numpy as np

        return {
            "key": sample["__key__"],
            "draws": (random.random(), float(np.random.random()), float(torch.rand(1))),
        }


def _draws_by_key(root: str, workers: int, epoch: int) -> dict[str, tuple[float, ...]]:
    ds = fl.open_dataset(root, seed=5, transform=_GlobalDraws())
    loader = fl.DataLoader(ds, batch_size=4, num_workers=workers)
    loader.set_epoch(epoch)
    out: dict[str, tuple[float, ...]] = {}
    for batch in loader:
        for key, *draws in zip(batch["key"], *(d.tolist() for d in batch["draws"]), strict=True):
            out[key] = tuple(draws)
    return out


def test_global_generators_are_reseeded_per_batch_in_workers(
    tmp_path: Path, fake: SimpleNamespace
) -> None:
    """Transforms that draw from the global generators make the same draws for a sample
    whatever the number of workers (each batch reseeds them from seed, epoch, step, rank), and
    other draws in another epoch."""
    root = fake.build_format_dataset(str(tmp_path / "ds"), [10, 14])
    one, two = _draws_by_key(root, 1, 0), _draws_by_key(root, 2, 0)
    assert sorted(one) == sorted(fake.all_keys([10, 14]))
    assert one == two
    assert len({d for d in one.values()}) == len(one)  # every sample drew its own values
    other = _draws_by_key(root, 2, 1)
    assert all(other[k] != one[k] for k in one)
