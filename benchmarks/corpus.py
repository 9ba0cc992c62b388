"""The W1 benchmark corpus: deterministic photo-like JPEGs in an image-folder layout.

``root/<class>/<name>.jpg`` with 100 classes (``c000`` .. ``c099``). Each image is a smooth colour
field plus oriented texture, a few shapes and sensor-like noise, mostly 500x375 (landscape) or
375x500 (portrait), JPEG quality 90, about 97 KB on average (see /work/shared/BENCHMARKS.md).

Image ``i`` depends only on ``(seed, i)``, so any count is a prefix of a larger corpus and the
corpus is identical on every machine. Generation runs in a process pool; a finished corpus is
marked by ``root/.complete-<count>`` and reused by later runs. :meth:`Corpus.webdataset` is the
one fastload WebDataset copy of a corpus that the loader benchmarks read; :class:`FileBytes`
reads the loose files as a map-style dataset (the plain-files baseline, FFCV's writer input).

Run ``python -m benchmarks.corpus --count 10000`` to (re)generate it and print its statistics.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from fastload.testing.corpus import NUM_CLASSES, SEED, make_image

__all__ = ["DEFAULT_ROOT", "NUM_CLASSES", "Corpus", "FileBytes", "ensure_corpus", "make_image"]

DEFAULT_ROOT = Path(os.environ.get("FASTLOAD_BENCH_ROOT", "/tmp/fastload-bench"))


def _relpath(index: int) -> str:
    return f"c{index % NUM_CLASSES:03d}/img{index:07d}.jpg"


def _write_range(args: tuple[str, int, int, int]) -> int:
    root, start, stop, seed = args
    total = 0
    for i in range(start, stop):
        path = Path(root) / _relpath(i)
        if path.exists():
            total += path.stat().st_size
            continue
        _, data = make_image(i, seed)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.rename(path)
        total += len(data)
    return total


class Corpus:
    """A generated corpus on disk.

    Attributes:
        root: The image-folder root (``root/<class>/<name>.jpg``).
        count: Number of images.
    """

    def __init__(self, root: Path, count: int) -> None:
        self.root = root
        self.count = count

    def files(self) -> list[tuple[str, int]]:
        """``(absolute path, label)`` for every image, in index order."""
        return [(str(self.root / _relpath(i)), i % NUM_CLASSES) for i in range(self.count)]

    def folder(self) -> Path:
        """An image folder holding exactly this corpus's ``count`` images (hard links, made once).

        The generation directory may hold more images (a larger corpus) and marker files; tools
        that take a directory (``fastload convert``, DALI's file reader) get this view instead.
        """
        view = self.root.parent / f"{self.root.name}-view-{self.count}"
        marker = view.parent / f".{view.name}.complete"
        if marker.exists():
            return view
        for c in range(NUM_CLASSES):
            (view / f"c{c:03d}").mkdir(parents=True, exist_ok=True)
        for i in range(self.count):
            dst = view / _relpath(i)
            if not dst.exists():
                os.link(self.root / _relpath(i), dst)
        marker.write_text(str(self.count))
        return view

    def total_bytes(self) -> int:
        """Sum of the JPEG file sizes in bytes."""
        return sum(os.path.getsize(p) for p, _ in self.files())

    def webdataset(self, shards: int = 16, workers: int = 2) -> Path:
        """This corpus as fastload WebDataset shards (``fastload.convert`` of :meth:`folder`,
        original JPEG bytes kept), made once beside the corpus as ``<root>-wds-<count>``.

        The loader, DALI and streaming benchmarks and the GPU check all read this one copy.
        """
        from fastload.convert import convert

        dst = self.root.parent / f"{self.root.name}-wds-{self.count}"
        if not (dst / "fastload.json").exists():
            t0 = time.perf_counter()
            convert(
                str(self.folder()),
                str(dst),
                format="webdataset",
                shard_samples=math.ceil(self.count / shards),
                workers=workers,
                quiet=True,
            )
            print(f"prepared fastload webdataset shards in {time.perf_counter() - t0:.1f} s: {dst}")
        return dst


class FileBytes:
    """Map-style dataset over loose files: item ``i`` is ``(file bytes, label)`` of ``files[i]``.

    Args:
        files: ``(path, label)`` pairs, e.g. :meth:`Corpus.files`.
    """

    def __init__(self, files: Sequence[tuple[str, int]]) -> None:
        self.files = list(files)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[bytes, int]:
        path, label = self.files[i]
        with open(path, "rb") as f:
            return f.read(), label


def ensure_corpus(
    count: int = 10_000,
    root: Path | str | None = None,
    *,
    seed: int = SEED,
    processes: int | None = None,
    verbose: bool = True,
) -> Corpus:
    """Generate (or reuse) a corpus of ``count`` images under ``root`` and return it.

    The default root is ``$FASTLOAD_BENCH_ROOT/w1-<seed>`` (``/tmp/fastload-bench/w1-<seed>``).
    Existing images are kept, so growing a corpus only generates the new ones. Not safe to run
    twice concurrently on the same root.
    """
    base = Path(root) if root is not None else DEFAULT_ROOT / f"w1-{seed}"
    marker = base / f".complete-{count}"
    if marker.exists():
        return Corpus(base, count)
    for c in range(NUM_CLASSES):
        (base / f"c{c:03d}").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    step = 100
    jobs = [(str(base), s, min(s + step, count), seed) for s in range(0, count, step)]
    with ProcessPoolExecutor(max_workers=processes or os.cpu_count() or 1) as pool:
        total = sum(pool.map(_write_range, jobs))
    if verbose:
        dt = time.perf_counter() - t0
        print(
            f"corpus: {count} images, {total / 1e6:.1f} MB (mean {total / max(count, 1) / 1e3:.1f} KB)"
            f" at {base} in {dt:.1f} s"
        )
    marker.write_text(json.dumps({"count": count, "bytes": total, "seed": seed}))
    return Corpus(base, count)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=10_000)
    parser.add_argument("--root", default=None)
    args = parser.parse_args(argv)
    corpus = ensure_corpus(args.count, args.root)
    sizes = np.array([os.path.getsize(p) for p, _ in corpus.files()])
    print(
        f"{corpus.count} images, mean {sizes.mean() / 1e3:.1f} KB, min {sizes.min() / 1e3:.1f} KB,"
        f" max {sizes.max() / 1e3:.1f} KB, total {sizes.sum() / 1e6:.1f} MB"
    )


if __name__ == "__main__":
    main()
