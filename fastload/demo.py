"""The README demo: generate an image corpus, convert it to shards, train a tiny model on it.

``python -m fastload.demo`` (what ``make demo`` runs) does, on local storage only:

1. writes a corpus of photo-like JPEGs as an image folder (``root/<class>/<file>.jpg``);
2. converts it with :func:`fastload.convert` into WebDataset shards with DALI-compatible indexes and
   a ``fastload.json`` manifest, then verifies them;
3. opens the shards with :func:`fastload.open_dataset` and trains a small CNN for a few steps with
   :class:`fastload.DataLoader` (2 worker processes, random-resized-crop + flip decoded at reduced
   JPEG DCT scale), printing samples/s and the time the training loop waited for data;
4. stops half-way through an epoch, saves ``loader.state_dict()``, and resumes a new loader from it,
   checking that the resumed run delivers exactly the samples not yet seen.

Everything lands under ``--out`` (default ``./demo-output``); re-running reuses the corpus and
the shards.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

import fastload
from fastload.loader.transforms import ImageTrainTransform
from fastload.testing.corpus import write_image_folder


def _model(num_classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, num_classes),
    )


def _say(text: str) -> None:
    print(text, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fastload.demo", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", default="demo-output", help="working directory")
    parser.add_argument("--images", type=int, default=1200, help="corpus size")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20, help="training steps before the resume")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--size", type=int, default=96, help="crop size fed to the model")
    args = parser.parse_args(argv)

    out = Path(args.out)
    images, shards = out / "images", out / "shards"
    torch.manual_seed(0)

    # 1. A corpus (kept between runs).
    t0 = time.perf_counter()
    nbytes = write_image_folder(images, args.images, num_classes=args.classes, scale=2)
    _say(
        f"[1/4] corpus: {args.images} JPEGs, {nbytes / 1e6:.1f} MB in {images} "
        f"({time.perf_counter() - t0:.1f} s)"
    )

    # 2. Convert to WebDataset shards (resumable; a finished dataset is kept as it is).
    result = fastload.convert(
        str(images),
        str(shards),
        format="webdataset",
        shard_samples=max(1, args.images // 8),
        workers=args.workers,
        shuffle=True,
        seed=0,
        overwrite=False,
        quiet=True,
    )
    _say(
        f"[2/4] converted: {result.num_samples} samples in {result.num_shards} shards, "
        f"{result.num_bytes / 1e6:.1f} MB ({result.elapsed:.1f} s) -> {shards}/fastload.json"
    )

    # 3. Train a few steps.
    transform = ImageTrainTransform(size=args.size)
    dataset = fastload.open_dataset(
        str(shards),
        shuffle=True,
        seed=0,
        decode="bytes",
        transform=transform,
        fields=("jpg", "cls"),
    )
    loader = fastload.DataLoader(dataset, batch_size=args.batch_size, num_workers=args.workers)
    model = _model(args.classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    seen: list[int] = []
    loader.set_epoch(0)
    state = None
    for step, (images_u8, labels) in enumerate(loader):
        x = transform.batch_transform(images_u8)
        loss = nn.functional.cross_entropy(model(x), labels)
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        seen.extend(labels.tolist())
        if step % 5 == 0:
            _say(f"      step {step:3d}  loss {loss.item():.3f}  batch {tuple(x.shape)}")
        if step + 1 == min(args.steps, len(loader) // 2):
            state = loader.state_dict()
            break
    stats = loader.stats()
    _say(
        f"[3/4] trained {stats['batches']} steps: {stats['samples_per_s']:.0f} samples/s, "
        f"data stall {stats['data_stall_s']:.2f} s of {stats['elapsed_s']:.2f} s"
    )

    # 4. Resume mid-epoch in a new loader (as after a restart), here with one worker fewer.
    assert state is not None
    resumed = fastload.DataLoader(
        dataset, batch_size=args.batch_size, num_workers=max(0, args.workers - 1)
    )
    resumed.load_state_dict(state)
    rest = [int(label) for _, labels in resumed for label in labels]
    total = len(seen) + len(rest)
    _say(
        f"[4/4] resumed at step {state['step']} with {max(0, args.workers - 1)} worker(s): "
        f"{len(seen)} + {len(rest)} = {total} samples in the epoch "
        f"(dataset has {result.num_samples}; padding {resumed.stats()['padded']})"
    )
    if total != result.num_samples + resumed.stats()["padded"]:
        _say("demo: the resumed epoch did not add up — please report this as a bug")
        return 1
    _say(f"done: inspect the dataset with `fastload inspect {shards}`")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sys.exit(main())
