"""Two real image datasets (a WebDataset and an LMDB one) mixed 70/30 through fastload.DataLoader
with 2 worker processes: exact proportions in every batch, decoded and augmented images, each
source's own epochs whole, per-source counts in stats(), and an exact resume."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import fastload
from fastload.loader.decode import Decoder
from fastload.loader.transforms import ImageTrainTransform
from fastload.testing.corpus import write_image_folder

pytestmark = pytest.mark.timeout(300)
SIZES = {"webdataset": 30, "lmdb": 12}


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for fmt, count in SIZES.items():
        base = tmp_path_factory.mktemp(f"mix-{fmt}")
        write_image_folder(base / "images", count, seed=len(fmt), scale=4, processes=1)
        fastload.convert(
            base / "images", base / "ds", format=fmt, shard_samples=5, workers=1, quiet=True
        )
        out[fmt] = base / "ds"
    return out


def _open(root: Path, seed: int) -> Any:
    return fastload.open_dataset(
        root,
        seed=seed,
        decode=Decoder(image="bytes"),
        transform=ImageTrainTransform(size=24),
        fields=("jpg", "cls", "__key__", "__url__"),
    )


def _epoch(loader: fastload.DataLoader, epoch: int, roots: dict[str, Path]) -> list[list[Any]]:
    """Per batch: (format of the source, key) of each row, after checking the images."""
    loader.set_epoch(epoch)
    out = []
    for images, labels, keys, urls in loader:
        assert images.shape == (len(keys), 3, 24, 24)
        assert images.dtype == torch.uint8
        assert [int(c) for c in labels] == [int(k[1:4]) for k in keys]  # labels match keys
        fmts = [next(f for f, r in roots.items() if url.startswith(r.as_uri())) for url in urls]
        out.append(list(zip(fmts, keys, strict=True)))
    return out


def test_two_image_datasets_mixed_70_30_through_the_dataloader(roots: dict[str, Path]) -> None:
    mixed = fastload.mix({_open(roots["webdataset"], 1): 0.7, _open(roots["lmdb"], 2): 0.3})
    assert (mixed.plan.counts, mixed.num_samples) == ((7, 3), 50)  # 42 rounded up to 10s
    loader = fastload.DataLoader(mixed, batch_size=10, num_workers=2)
    epochs = [_epoch(loader, e, roots) for e in range(2)]
    for batch in (b for epoch in epochs for b in epoch):
        assert Counter(fmt for fmt, _ in batch) == {"webdataset": 7, "lmdb": 3}
    for fmt, n in SIZES.items():
        keys = [k for epoch in epochs for batch in epoch for f, k in batch if f == fmt]
        assert len(keys) == 2 * (35 if fmt == "webdataset" else 15)
        everything = sorted(set(keys))
        assert len(everything) == n
        for k in range(len(keys) // n):  # every own epoch is the whole source once
            assert sorted(keys[k * n : (k + 1) * n]) == everything
    stats = loader.stats()
    names = mixed.source_names
    assert (stats[f"samples[{names[0]}]"], stats[f"samples[{names[1]}]"]) == (70, 30)

    # Resume after 2 batches of epoch 1 with one worker: exactly the rest.
    loader.set_epoch(1)
    it = iter(loader)
    for _ in range(2):
        next(it)
    state = loader.state_dict()
    del it
    resumed = fastload.DataLoader(mixed, batch_size=10, num_workers=1)
    resumed.load_state_dict(state)
    assert _epoch(resumed, 1, roots) == epochs[1][2:]
