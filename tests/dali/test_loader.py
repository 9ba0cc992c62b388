"""DALILoader in external-source mode (CPU pipelines): the torch loader's guarantees through DALI."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import fastload.loader as fl
from fastload.dali import DALILoader, ImageAugment, decoder_device
from fastload.errors import InvalidArgumentError
from fastload.storage import open_store

pytestmark = [pytest.mark.timeout(300)]
N = 46  # the datasets fixture: shards of 17, 12 and 17 samples
SMALL = ImageAugment(size=16)


def make(root: str, batch: int, **kw: Any) -> DALILoader:
    kw.setdefault("augment", SMALL)
    kw.setdefault("py_workers", 1)
    kw.setdefault("num_threads", 1)
    return DALILoader(root, batch, device="cpu", **kw)


def labels_per_step(loader: DALILoader) -> list[list[int]]:
    return [batch[1].tolist() for batch in loader]


def torch_loader_steps(root: str, batch: int, **kw: Any) -> list[list[int]]:
    ds = fl.open_dataset(root, decode="bytes", fields=("cls",), seed=kw.pop("seed", 0))
    return [b[0].tolist() for b in fl.DataLoader(ds, batch_size=batch, **kw)]


@pytest.mark.parametrize(
    ("fmt", "world", "drop_last"),
    [
        ("webdataset", 3, False),
        ("tfrecord", 3, False),
        ("lmdb", 3, False),
        ("webdataset", 2, True),
        ("webdataset", 1, False),
    ],
)
def test_ranks_exactly_once_and_same_as_torch_loader(
    datasets: dict[str, str], fmt: str, world: int, drop_last: bool
) -> None:
    batch = 5
    per_rank = []
    for rank in range(world):
        loader = make(
            datasets[fmt], batch, rank=rank, world_size=world, drop_last=drop_last, seed=3
        )
        expected_len = len(loader)
        steps = labels_per_step(loader)
        assert len(steps) == expected_len == loader.partition.num_steps
        # the same samples per step as fastload.DataLoader with the same (seed, epoch, ranks)
        assert steps == torch_loader_steps(
            datasets[fmt], batch, rank=rank, world_size=world, drop_last=drop_last, seed=3
        )
        st = loader.stats()
        assert st["batches"] == len(steps)
        assert st["samples"] == sum(len(s) for s in steps)
        assert st["bytes"] > 0
        assert st["skipped"] == 0
        per_rank.append((steps, st))
    assert len({len(steps) for steps, _ in per_rank}) == 1  # equal batch counts
    delivered = [label for steps, _ in per_rank for s in steps for label in s]
    padded = sum(st["padded"] for _, st in per_rank)
    if drop_last:
        g = batch * world
        assert padded == 0
        assert len(delivered) == len(set(delivered)) == N // g * g
        assert per_rank[0][1]["dropped_per_epoch"] == N % g
    else:
        assert sorted(set(delivered)) == list(range(N))  # every sample at least once
        assert len(delivered) == N + padded
        assert padded == -N % world


def test_in_process_source_and_spawn_give_the_same_batches(datasets: dict[str, str]) -> None:
    ref = labels_per_step(make(datasets["webdataset"], 8))
    assert labels_per_step(make(datasets["webdataset"], 8, py_workers=0)) == ref
    spawned = make(datasets["webdataset"], 8, py_workers=1, py_start_method="spawn")
    assert labels_per_step(spawned) == ref


def test_determinism_and_set_epoch(datasets: dict[str, str]) -> None:
    aug = ImageAugment(size=16, brightness=0.2, contrast=0.2, saturation=0.2, hue=0.05)
    a = [b for b in make(datasets["webdataset"], 8, augment=aug, seed=5)]
    b = [b for b in make(datasets["webdataset"], 8, augment=aug, seed=5)]
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))
    other = make(datasets["webdataset"], 8, augment=aug, seed=5)
    other.set_epoch(1)
    c = [b for b in other]
    assert [x[1].tolist() for x in a] != [x[1].tolist() for x in c]
    assert sorted(t for x in c for t in x[1].tolist()) == list(range(N))
    # augmentation depends on (seed, epoch), not on the epochs run before
    again = make(datasets["webdataset"], 8, augment=aug, seed=5)
    list(again)
    assert again._next is not None  # epoch 1's pipeline was built in the background
    again.set_epoch(1)
    assert all(torch.equal(x[0], y[0]) for x, y in zip(c, again))
    # without set_epoch the same epoch replays
    assert [x[1].tolist() for x in again] == [x[1].tolist() for x in c]
    unshuffled = make(datasets["webdataset"], 8, shuffle=False)
    assert [t for x in unshuffled for t in x[1].tolist()] == list(range(N))


@pytest.mark.parametrize("stop_after", [1, 3])
def test_resume_mid_epoch_and_elastic(datasets: dict[str, str], stop_after: int) -> None:
    root = datasets["tfrecord"]
    full = [labels_per_step(make(root, 4, rank=r, world_size=2, seed=9)) for r in range(2)]
    states = []
    for r in range(2):
        loader = make(root, 4, rank=r, world_size=2, seed=9)
        it = iter(loader)
        head = [next(it)[1].tolist() for _ in range(stop_after)]
        assert head == full[r][:stop_after]
        states.append(loader.state_dict())
        it.close()
    assert states[0] == states[1]
    assert states[0]["step"] == stop_after
    for r in range(2):
        again = make(root, 4, rank=r, world_size=2, seed=9)
        again.load_state_dict(states[r])
        assert len(again) == len(full[r]) - stop_after
        assert labels_per_step(again) == full[r][stop_after:]
    # another world size, same global batch: one rank of 8 gets both ranks' batches per step
    single = make(root, 8, seed=9)
    single.load_state_dict(states[0])
    rest = labels_per_step(single)
    assert rest == [a + b for a, b in zip(full[0], full[1])][stop_after:]
    # the state is the torch loader's: fastload.DataLoader continues where DALI stopped
    ds = fl.open_dataset(root, decode="bytes", fields=("cls",), seed=9)
    torch_loader = fl.DataLoader(ds, batch_size=8)
    torch_loader.load_state_dict(states[0])
    assert [b[0].tolist() for b in torch_loader] == rest
    with pytest.raises(InvalidArgumentError, match="global batch size"):
        make(root, 5, seed=9).load_state_dict(states[0])
    with pytest.raises(InvalidArgumentError, match="seed"):
        make(root, 8, seed=1).load_state_dict(states[0])


def test_set_epoch_does_not_silently_drop_a_resume(datasets: dict[str, str]) -> None:
    root = datasets["tfrecord"]
    loader = make(root, 4, seed=9)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    it.close()
    resumed = make(root, 4, seed=9)
    resumed.load_state_dict(state)
    with pytest.raises(InvalidArgumentError, match=r"set_epoch\(5\) would drop the resume"):
        resumed.set_epoch(5)
    resumed.set_epoch(0)  # the saved epoch: the resume stays
    assert len(resumed) == len(make(root, 4, seed=9)) - 1
    resumed.set_epoch(5, discard_resume=True)
    assert len(resumed) == len(make(root, 4, seed=9))


def _reference(jpeg: Any, g: int, flip: bool) -> np.ndarray:
    img = np.asarray(Image.open(io.BytesIO(jpeg(g))).convert("RGB"), dtype=np.float32)
    if flip:
        img = img[:, ::-1]
    mean = np.array([0.485, 0.456, 0.406]) * 255
    std = np.array([0.229, 0.224, 0.225]) * 255
    return ((img - mean) / std).transpose(2, 0, 1).astype(np.float32)


@pytest.mark.parametrize("flip", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_images_match_a_pil_reference(
    kit: SimpleNamespace, tmp_path: Path, flip: bool, fused: bool
) -> None:
    # sample g has size (40 + (g % 5) * 4, 48 + (g % 3) * 8): g = 0, 15, 30 are 40 x 48
    root = str(tmp_path / "ds")
    kit.write_dataset(open_store(root), "webdataset", [31])
    aug = ImageAugment(
        size=(40, 48),
        scale=(1.0, 1.0),
        ratio=(1.2, 1.2),
        flip_p=1.0 if flip else 0.0,
        fused_decode=fused,
    )
    loader = make(root, 31, augment=aug, shuffle=False, fields=("jpg", "cls"))
    images, labels = next(iter(loader))
    assert images.shape == (31, 3, 40, 48)
    assert images.dtype == torch.float32
    for g in (0, 15, 30):
        got = images[labels.tolist().index(g)].numpy()
        ref = _reference(kit.jpeg, g, flip)
        # JPEG decoders differ by a few levels (IDCT, chroma upsampling): compare in 0..255 units
        diff = np.abs(got - ref) * (np.array([0.229, 0.224, 0.225]) * 255)[:, None, None]
        assert diff.mean() < 1.5, (g, diff.mean())
        assert np.percentile(diff, 99) < 8, (g, np.percentile(diff, 99))


def test_half_precision_hwc_and_eval_recipe(datasets: dict[str, str]) -> None:
    aug = ImageAugment(size=(16, 24), dtype="float16", layout="HWC")
    images, labels = next(iter(make(datasets["lmdb"], 6, augment=aug)))
    assert images.shape == (6, 16, 24, 3)
    assert images.dtype == torch.float16
    assert labels.dtype == torch.int64
    assert labels.shape == (6,)
    ev = ImageAugment(size=20, train=False)
    first = [b[0] for b in make(datasets["lmdb"], 6, augment=ev, seed=1)]
    second = [b[0] for b in make(datasets["lmdb"], 6, augment=ev, seed=2, shuffle=False)]
    assert first[0].shape == (6, 3, 20, 20)
    assert abs(float(first[0].mean())) < 3  # normalized, not 0..255
    assert sum(len(b) for b in second) == N


def _raw_and_small(images: Any, labels: Any, *, device: str) -> Any:
    from nvidia.dali import fn, types

    decoded = fn.decoders.image(images, device=decoder_device(device), output_type=types.RGB)
    return fn.resize(decoded, resize_x=8, resize_y=8), labels, images


def test_custom_augmentation_graph(kit: SimpleNamespace, datasets: dict[str, str]) -> None:
    loader = make(datasets["webdataset"], 7, augment=_raw_and_small, shuffle=False)
    batches = list(loader)
    small, labels, raw = batches[0]
    assert small.shape == (7, 8, 8, 3)
    assert small.dtype == torch.uint8
    # ragged outputs come back as lists: here the encoded bytes, exactly the stored ones
    assert [bytes(t.numpy()) for t in raw] == [kit.jpeg(g) for g in labels.tolist()]
    assert sum(len(b[1]) for b in batches) == N


def test_skip_policy_counts_corrupt_samples(kit: SimpleNamespace, tmp_path: Path) -> None:
    root = tmp_path / "ds"
    kit.write_dataset(open_store(str(root)), "tfrecord", [10])
    shard = root / "train-000000.tfrecord"
    data = bytearray(shard.read_bytes())
    first = int((root / "train-000000.tfrecord.idx").read_text().split()[1])
    data[first + 20] ^= 0xFF  # corrupt record 1's payload (its CRC no longer matches)
    shard.write_bytes(bytes(data))
    loader = make(str(root), 4, shuffle=False, on_error="skip")
    labels = [t for b in loader for t in b[1].tolist()]
    assert labels == [0, *list(range(2, 10))]
    assert loader.stats()["skipped"] == 1


def test_options_are_checked(datasets: dict[str, str]) -> None:
    root = datasets["webdataset"]
    with pytest.raises(InvalidArgumentError, match="reader must be"):
        make(root, 4, reader="fast")
    with pytest.raises(InvalidArgumentError, match="fields"):
        make(root, 4, fields=("jpg",))
    with pytest.raises(InvalidArgumentError, match="lmdb"):
        make(datasets["lmdb"], 4, reader="native")
    with pytest.raises(InvalidArgumentError, match="scale"):
        ImageAugment(scale=(0.5, 2.0))
    loader = make(root, 4, fields=("png", "cls"))
    with pytest.raises(Exception, match="none of the fields png"):
        list(loader)


def test_gpu_device_without_a_gpu_is_a_clear_error(datasets: dict[str, str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(InvalidArgumentError, match="needs a CUDA GPU"):
        DALILoader(datasets["webdataset"], 4, device="gpu")
    assert DALILoader(datasets["webdataset"], 4, device="auto").device == "cpu"


def test_cache_size_is_the_one_spelling_and_cache_bytes_still_works(
    datasets: dict[str, str], tmp_path: Path
) -> None:
    from fastload.storage import CachingStore, MemoryStore

    local = open_store(datasets["webdataset"])
    remote = MemoryStore(f"memory://dali-cache-{tmp_path.name}")  # not local files: cached
    for key in local.list_keys():
        remote.put(key, local.get(key))
    loader = DALILoader(remote, 4, cache_dir=tmp_path / "a", cache_size="1MB", device="cpu")
    assert isinstance(loader.dataset.store, CachingStore)
    assert "max_bytes=1000000)" in repr(loader.dataset.store)
    with pytest.warns(DeprecationWarning, match="cache_bytes=...\\) is now cache_size"):
        old = DALILoader(remote, 4, cache_dir=tmp_path / "b", cache_bytes="2MB", device="cpu")
    assert "max_bytes=2000000)" in repr(old.dataset.store)
    with pytest.raises(InvalidArgumentError, match="not both"):
        DALILoader(remote, 4, cache_dir=tmp_path / "c", cache_size="1MB", cache_bytes="2MB")
