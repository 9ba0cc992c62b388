"""The README demo: generate an image corpus, convert it to shards, train a tiny model on it.

``python -m fastload.demo`` (what ``make demo`` runs) does, on local storage only:

1. writes a corpus of photo-like JPEGs as an image folder (``root/<class>/<file>.jpg``), printing
   progress (a bar on a terminal, a line every tenth of the corpus otherwise); a re-run keeps
   the images already there and says so;
2. converts it with :func:`fastload.convert` into WebDataset shards with DALI-compatible indexes and
   a ``fastload.json`` manifest;
3. verifies the shards as ``fastload verify`` does (:func:`fastload.convert.verify_dataset`: sizes,
   SHA-256, sample counts and indexes against the manifest);
4. opens the shards with :func:`fastload.open_dataset` and trains a small CNN for a few steps with
   :class:`fastload.DataLoader` (2 worker processes, random-resized-crop + flip decoded at reduced
   JPEG DCT scale), printing samples/s and the time the training loop waited for data;
5. stops half-way through an epoch, saves ``loader.state_dict()``, resumes a new loader from it
   with one worker fewer, and checks exactly-once by key: the keys delivered before the checkpoint
   plus those delivered after are the dataset's keys, each exactly once (one process, so the epoch
   has no padding and any repeat is a bug).

Exits 0 when verify and the exactly-once check pass, 1 otherwise. Everything lands under ``--out``
(default ``./demo-output``); re-running reuses the corpus and the shards.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

import fastload
from fastload.cli._common import whole_number
from fastload.convert import ConvertResult, verify_dataset
from fastload.errors import DatasetExistsError
from fastload.loader.transforms import ImageTrainTransform
from fastload.testing.corpus import write_image_folder

__all__ = ["check_exactly_once", "main"]

#: Keys named per kind of problem in :func:`check_exactly_once`'s messages.
_SHOW = 5


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


_positive = whole_number(1, "a number of at least 1")
_non_negative = whole_number(0, "0 or more")


class _CorpusProgress:
    """Progress of the corpus generation: a tqdm bar on a terminal, plain lines otherwise.

    Plain lines come about every tenth of the corpus (the generator reports in chunks of 50
    images), so a log stays short.
    """

    def __init__(self, total: int) -> None:
        self.total = total
        self.start = time.perf_counter()
        self.bar: tqdm[Any] | None = None
        if sys.stdout.isatty():
            self.bar = tqdm(
                total=total, desc="      corpus", unit="img", file=sys.stdout, leave=False
            )
        self.every = max(1, total // 10)
        self.shown = 0

    def __call__(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            return
        if done - self.shown >= self.every or (done == self.total and self.shown < done):
            self.shown = done
            _say(
                f"      corpus: {done}/{self.total} images ({100 * done // self.total} %), "
                f"{time.perf_counter() - self.start:.1f} s"
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _few(keys: Iterable[str]) -> str:
    items = sorted(keys)
    shown = ", ".join(repr(k) for k in items[:_SHOW])
    return shown + (f", ... ({len(items) - _SHOW} more)" if len(items) > _SHOW else "")


def check_exactly_once(
    before: Sequence[str], after: Sequence[str], dataset_keys: Sequence[str]
) -> list[str]:
    """What is wrong with one epoch split at a checkpoint, compared by sample key.

    Args:
        before: Keys delivered before the checkpoint (in delivery order).
        after: Keys delivered by the loader resumed from the checkpoint.
        dataset_keys: Every key of the dataset (read from its shards).

    Returns:
        One sentence per kind of problem (keys repeated, missing, or not in the dataset; a key
        delivered on both sides of the checkpoint), naming a few keys; empty when the two parts
        together deliver every key of the dataset exactly once.
    """
    expected = Counter(dataset_keys)
    delivered = Counter(before) + Counter(after)
    problems: list[str] = []
    in_dataset_twice = [k for k, n in expected.items() if n > 1]
    if in_dataset_twice:
        problems.append(
            f"the dataset itself holds {len(in_dataset_twice)} key(s) more than once: "
            f"{_few(in_dataset_twice)}"
        )
    straddling = set(before) & set(after)
    if straddling:
        problems.append(
            f"{len(straddling)} key(s) delivered both before and after the checkpoint: "
            f"{_few(straddling)}"
        )
    repeated = [k for k, n in delivered.items() if k in expected and n > expected[k]]
    if repeated:
        problems.append(f"{len(repeated)} key(s) delivered more than once: {_few(repeated)}")
    missing = [k for k in expected if delivered[k] == 0]
    if missing:
        problems.append(f"{len(missing)} key(s) of the dataset never delivered: {_few(missing)}")
    unknown = [k for k in delivered if k not in expected]
    if unknown:
        problems.append(f"{len(unknown)} key(s) delivered that the dataset lacks: {_few(unknown)}")
    return problems


def _dataset_keys(shards: Path) -> list[str]:
    """Every key of the dataset in dataset order, read from the shards (no loader involved)."""
    dataset = fastload.open_dataset(str(shards), shuffle=False, fields=("__key__",))
    try:
        return [str(dataset[i][0]) for i in range(len(dataset))]
    finally:
        dataset.close()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fastload.demo", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--out", default="demo-output", help="working directory")
    parser.add_argument("--images", type=_positive, default=1200, help="corpus size")
    parser.add_argument("--classes", type=_positive, default=10)
    parser.add_argument(
        "--steps", type=_positive, default=20, help="most training steps before the resume"
    )
    parser.add_argument("--batch-size", type=_positive, default=64)
    parser.add_argument("--workers", type=_non_negative, default=2)
    parser.add_argument("--size", type=_positive, default=96, help="crop size fed to the model")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; return the exit status (0: verify and exactly-once passed, 1: not)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.images < 2 * args.batch_size:
        parser.error(
            f"--images {args.images} is less than two batches of --batch-size "
            f"{args.batch_size}; the demo stops half-way through the epoch, so it needs at "
            f"least {2 * args.batch_size} images"
        )

    out = Path(args.out)
    images, shards = out / "images", out / "shards"
    torch.manual_seed(0)

    # 1. A corpus (kept between runs).
    t0 = time.perf_counter()
    kept = sum(1 for _ in images.glob("c*/img*.jpg")) if images.is_dir() else 0
    if kept >= args.images:  # a re-run: the generator only checks that each image is there
        progress = None
        _say(f"[1/5] corpus: the {args.images} photo-like JPEGs of an earlier run, in {images}")
    else:
        more = f" more ({kept} kept from an earlier run)" if kept else ""
        _say(f"[1/5] corpus: writing {args.images - kept}{more} photo-like JPEGs to {images} ...")
        progress = _CorpusProgress(args.images)
    try:
        nbytes = write_image_folder(
            images, args.images, num_classes=args.classes, scale=2, progress=progress
        )
    finally:
        if progress is not None:
            progress.close()
    _say(
        f"[1/5] corpus: {args.images} JPEGs, {nbytes / 1e6:.1f} MB in {images} "
        f"({time.perf_counter() - t0:.1f} s)"
    )

    # 2. Convert to WebDataset shards (resumable; a finished dataset is kept as it is, one made
    # from another corpus, e.g. after a run with more --images, is replaced: it is the demo's own).
    def convert(overwrite: bool) -> ConvertResult:
        return fastload.convert(
            str(images),
            str(shards),
            format="webdataset",
            shard_samples=max(1, args.images // 8),
            workers=max(1, args.workers),  # --workers 0 loads in-process; conversion needs one
            shuffle=True,
            seed=0,
            overwrite=overwrite,
            quiet=True,
        )

    try:
        result = convert(overwrite=False)
    except DatasetExistsError:
        _say(f"      {shards} holds the dataset of an earlier, different corpus: replacing it")
        result = convert(overwrite=True)
    _say(
        f"[2/5] converted: {result.num_samples} samples in {result.num_shards} shards, "
        f"{result.num_bytes / 1e6:.1f} MB ({result.elapsed:.1f} s) -> {shards}/fastload.json"
    )

    # 3. What `fastload verify` checks: every shard against the manifest.
    t0 = time.perf_counter()
    report = verify_dataset(str(shards))
    for warning in report.warnings:
        _say(f"      verify warning: {warning}")
    if not report.ok:
        found = f"{len(report.problems)} problem{'s' if len(report.problems) != 1 else ''}"
        _say(f"demo: `fastload verify {shards}` found {found}:")
        for problem in report.problems:
            _say(f"      {problem}")
        _say(f"demo: delete {shards} and run the demo again to re-create the dataset")
        return 1
    _say(
        f"[3/5] verified: OK, {report.shards_checked} shards, {report.samples_read} samples read "
        f"back; sizes, SHA-256 and indexes match the manifest ({time.perf_counter() - t0:.1f} s)"
    )

    # 4. Train a few steps, remembering the key of every sample delivered.
    transform = ImageTrainTransform(size=args.size)
    dataset = fastload.open_dataset(
        str(shards),
        shuffle=True,
        seed=0,
        decode="bytes",
        transform=transform,
        fields=("jpg", "cls", "__key__"),
    )
    loader = fastload.DataLoader(dataset, batch_size=args.batch_size, num_workers=args.workers)
    model = _model(args.classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    before: list[str] = []
    stop = max(1, min(args.steps, len(loader) // 2))
    loader.set_epoch(0)
    state: dict[str, Any] | None = None
    for step, (images_u8, labels, keys) in enumerate(loader):
        x = transform.batch_transform(images_u8)
        loss = nn.functional.cross_entropy(model(x), labels)
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        before.extend(keys)
        if step % 5 == 0:
            _say(f"      step {step:3d}  loss {loss.item():.3f}  batch {tuple(x.shape)}")
        if step + 1 == stop:
            state = loader.state_dict()
            break
    stats = loader.stats()
    _say(
        f"[4/5] trained {stats['batches']} steps: {stats['samples_per_s']:.0f} samples/s, "
        f"data stall {stats['data_stall_s']:.2f} s of {stats['elapsed_s']:.2f} s"
    )
    if state is None:
        _say(f"demo: the epoch ended before step {stop} — please report this as a bug")
        return 1

    # 5. Resume mid-epoch in a new loader (as after a restart), here with one worker fewer.
    workers = max(0, args.workers - 1)
    resumed = fastload.DataLoader(dataset, batch_size=args.batch_size, num_workers=workers)
    resumed.load_state_dict(state)
    after = [str(key) for _, _, keys in resumed for key in keys]
    expected = _dataset_keys(shards)
    problems = check_exactly_once(before, after, expected)
    if problems:
        _say(
            f"demo: resumed at step {state['step']} with {workers} worker(s), but the epoch did "
            "not deliver every key exactly once — please report this as a bug:"
        )
        for problem in problems:
            _say(f"      {problem}")
        return 1
    _say(
        f"[5/5] resumed at step {state['step']} with {workers} worker(s): exactly once: "
        f"{len(before)} keys before the checkpoint + {len(after)} after = the dataset's "
        f"{len(expected)} keys, none repeated or missing"
    )
    _say(f"done: inspect the dataset with `fastload inspect {shards}`")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sys.exit(main())
