"""FFCV's train path on the W1 corpus, to stand beside the train table of ``bench_loader``.

FFCV 1.0.2 (libturbojpeg decode, OpenCV resize, numba-compiled pipeline on threads, no IPC) is the
fastest CPU peer of the train workload in /work/shared/BENCHMARKS.md. It only runs in
``.venv-bench`` (built by ``tools/bench-env.sh``), so this script is its own benchmark rather than a
loader of ``bench_loader`` (whose children run in fastload's venv).

What is measured, with the same settings as ``bench_loader``'s train workload:

* **write** (once, cached): the corpus is written to ``<corpus>-ffcv-<count>.beton`` with a field
  that stores each **original JPEG file's bytes** unchanged (FFCV's own ``RGBImageField`` with
  ``write_mode='jpg'`` decodes and re-encodes every image, so the loader would then read different,
  usually smaller, files than every other loader) plus an ``IntField`` label, with
  ``DatasetWriter(num_workers=2)``. The write rate is printed for information only (conversion is
  ``bench_convert``'s job and is not alternated here).
* **train**: ``Loader(batch_size=64, num_workers=2, order=RANDOM, os_cache=True)`` with
  ``RandomResizedCropRGBImageDecoder((224, 224))`` (decode, random-resized crop with the torchvision
  defaults scale=(0.08, 1), ratio=(3/4, 4/3)) + ``RandomHorizontalFlip`` + ``NormalizeImage``
  (ImageNet mean/std, to float32) + ``ToTensor`` + ``ToTorchImage``: a float32 batch of
  64 x 3 x 224 x 224 (a channels-last view, as FFCV hands it to a model). Epoch 1 is untimed: it
  includes numba's compilation of the pipeline (~9 s). Epoch 2 is timed whole (every image once,
  ``drop_last=False``), from its ``iter()`` to its last batch, like every loader of
  ``bench_loader``: epoch rate, steady rate after batch 2, first-batch time, and the process's
  CPU time (all threads) per image. ``--quick`` (2,000 images) is labelled ``QUICK RUN``.

Each round runs in a fresh process of the peers' interpreter (``$FASTLOAD_PEERS_PYTHON``, default
``<repo>/.venv-bench/bin/python``), the .beton warm in the page cache; the report is the median over
rounds. When that interpreter is missing or cannot import ffcv the benchmark prints why, records
``skipped`` in the JSON and exits 0 (``--require`` makes it exit 1 instead).

Run: ``.venv/bin/python -m benchmarks.bench_ffcv [--quick] [--count N] [--rounds N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._harness import (
    PEERS_PYTHON,
    REPO,
    Table,
    check_labels,
    counting_labels,
    emit_result,
    median_of,
    median_rate,
    ok_runs,
    print_round,
    run_child,
    run_label,
    time_epoch,
    tree_cpu_seconds,
)
from benchmarks._loader_children import MEAN, STD, WORKERS, corpus_labels
from benchmarks.corpus import Corpus, FileBytes, ensure_corpus

BATCH = 64

# ---------------------------------------------------------------------------------------------
# Child side (runs in the peers' interpreter, where ffcv imports)
# ---------------------------------------------------------------------------------------------


def _jpeg_field_class() -> type:
    """An ``RGBImageField`` that stores the given JPEG bytes as they are (no decode, no re-encode).

    The metadata (mode ``jpg``, width, height, data pointer) is exactly what ``RGBImageField``
    writes, so FFCV's own decoders read it unchanged; width and height come from the JPEG header.
    """
    import numpy as np
    from ffcv.fields import RGBImageField
    from ffcv.fields.rgb_image import IMAGE_MODES
    from PIL import Image

    class JpegBytesField(RGBImageField):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(write_mode="jpg")

        @staticmethod
        def from_binary(binary: Any) -> JpegBytesField:
            return JpegBytesField()

        def encode(self, destination: Any, data: bytes, malloc: Any) -> None:
            with Image.open(io.BytesIO(data)) as im:  # reads the header only
                width, height = im.size
                if im.format != "JPEG" or im.mode != "RGB":
                    raise ValueError(f"not an RGB JPEG: format {im.format}, mode {im.mode}")
            destination["mode"] = IMAGE_MODES["jpg"]
            destination["height"], destination["width"] = height, width
            destination["data_ptr"], storage = malloc(len(data))
            storage[:] = np.frombuffer(data, dtype=np.uint8)

    return JpegBytesField


def _child_write(spec: dict[str, Any]) -> dict[str, Any]:
    from ffcv.fields import IntField
    from ffcv.writer import DatasetWriter

    corpus = Corpus(Path(spec["root"]), spec["count"])
    out = Path(spec["beton"])
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    field = _jpeg_field_class()
    writer = DatasetWriter(str(tmp), {"image": field(), "label": IntField()}, num_workers=WORKERS)
    t0 = time.perf_counter()
    writer.from_indexed_dataset(FileBytes(corpus.files()), chunksize=100)
    seconds = time.perf_counter() - t0
    tmp.rename(out)
    return {"seconds": seconds, "samples": corpus.count, "bytes": out.stat().st_size}


def _child_train(spec: dict[str, Any]) -> dict[str, Any]:
    import cv2
    import ffcv
    import numpy as np
    from ffcv.fields.basics import IntDecoder
    from ffcv.fields.rgb_image import RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import (
        NormalizeImage,
        RandomHorizontalFlip,
        Squeeze,
        ToTensor,
        ToTorchImage,
    )

    beton = spec["beton"]
    with open(beton, "rb") as f:  # warm the page cache like every bench_loader child
        while f.read(1 << 24):
            pass
    loader = Loader(
        beton,
        batch_size=BATCH,
        num_workers=WORKERS,
        order=OrderOption.RANDOM,
        os_cache=True,
        drop_last=False,  # every image once per epoch, like every bench_loader loader
        custom_fields={"image": _jpeg_field_class()},
        pipelines={
            "image": [
                RandomResizedCropRGBImageDecoder((224, 224)),
                RandomHorizontalFlip(),
                NormalizeImage(np.array(MEAN) * 255, np.array(STD) * 255, np.float32),
                ToTensor(),
                ToTorchImage(),
            ],
            "label": [IntDecoder(), ToTensor(), Squeeze()],
        },
    )
    t0 = time.perf_counter()
    first = 0
    shape: list[int] = []
    dtype = ""
    for images, labels in loader:
        if not shape:
            shape, dtype = list(images.shape), str(images.dtype)
            if tuple(shape) != (BATCH, 3, 224, 224) or labels.shape[0] != BATCH:
                raise RuntimeError(f"unexpected batch: images {shape}, labels {list(labels.shape)}")
        first += images.shape[0]
    epoch1 = time.perf_counter() - t0
    if first != spec["count"]:
        raise RuntimeError(f"epoch 1 delivered {first} images, not {spec['count']}")

    checksum = [0.0]

    def epoch2() -> Any:
        for images, labels in loader:  # iter(loader) starts the epoch: counted
            checksum[0] += float(images[0, 0, 112, 112])  # touch the data as a consumer would
            yield images, labels

    counts: Counter[int] = Counter()
    result: dict[str, Any] = time_epoch(
        counting_labels(epoch2, counts), spec["count"], cpu_clock=tree_cpu_seconds
    )
    check_labels(counts, corpus_labels(spec), "ffcv")
    result.update(
        {
            "epoch1_samples": first,
            "epoch1_seconds": epoch1,
            "shape": shape,
            "dtype": dtype,
            "checksum": checksum[0],
            "ffcv": getattr(ffcv, "__version__", ""),
            "cv2_threads": cv2.getNumThreads(),
        }
    )
    return result


# ---------------------------------------------------------------------------------------------
# Parent side (runs anywhere; only needs the corpus module)
# ---------------------------------------------------------------------------------------------


def _run_child(mode: str, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run the ``write`` or ``train`` child in the peers' interpreter; its result or error."""
    argv = [PEERS_PYTHON, "-m", "benchmarks.bench_ffcv", "--child", mode, json.dumps(spec)]
    return run_child(argv, timeout=timeout)


def _why_not() -> str:
    """Empty when the peers' interpreter imports ffcv, else the reason."""
    if not Path(PEERS_PYTHON).exists():
        return f"{PEERS_PYTHON} missing: build it with tools/bench-env.sh (or set FASTLOAD_PEERS_PYTHON)"
    proc = subprocess.run(
        [PEERS_PYTHON, "-c", "import ffcv.loader, ffcv.writer"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return f"{PEERS_PYTHON} cannot import ffcv ({last}); rebuild with tools/bench-env.sh"
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="FFCV train-path benchmark (W1 images)")
    parser.add_argument("--quick", action="store_true", help="2,000 images, 2 rounds")
    parser.add_argument("--count", type=int, default=None, help="images (default 10,000)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 3, quick 2)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--require", action="store_true", help="exit 1 when FFCV cannot run")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        mode, spec = args.child[0], json.loads(args.child[1])
        emit_result(_child_write(spec) if mode == "write" else _child_train(spec))
        return 0

    count = args.count or (2_000 if args.quick else 10_000)
    rounds = args.rounds or (2 if args.quick else 3)
    report: dict[str, Any] = {
        "loader": "ffcv",
        "workload": "train",
        "config": {
            "count": count,
            "rounds": rounds,
            "batch": BATCH,
            "workers": WORKERS,
            "timing": "epoch 2 whole, from iter() to the last batch; steady after batch 2",
            "python": PEERS_PYTHON,
        },
        "skipped": None,
    }

    def finish(code: int) -> int:
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        return code

    why = _why_not()
    if why:
        report["skipped"] = why
        print(f"skipping ffcv: {why}")
        return finish(1 if args.require else 0)

    corpus = ensure_corpus(count)
    beton = corpus.root.parent / f"{corpus.root.name}-ffcv-{count}.beton"
    spec = {"root": str(corpus.root), "count": count, "beton": str(beton)}
    if not beton.exists():
        w = _run_child("write", spec, timeout=1800)
        if "error" in w:
            report["skipped"] = f"writing {beton} failed: {w['error']}"
            print(f"skipping ffcv: {report['skipped']}")
            return finish(1)
        report["write"] = {**w, "img_per_s": w["samples"] / w["seconds"]}
        print(
            f"wrote {beton} ({w['bytes'] / 1e6:.0f} MB, original JPEG bytes) in {w['seconds']:.1f} s:"
            f" {w['samples'] / w['seconds']:.0f} img/s with {WORKERS} writer processes"
        )
    label = run_label(args.quick, count, rounds)
    report["quick"], report["label"] = args.quick, label
    print(
        f"ffcv train path: {label}, batch {BATCH}, {WORKERS} threads, epoch 2 timed whole;"
        f" {rounds} rounds, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    )
    runs: list[dict[str, Any]] = []
    for r in range(rounds):
        res = _run_child("train", spec, timeout=900)
        runs.append(res)
        print_round(r + 1, "ffcv epoch 2", res, unit="img/s")
        if "error" not in res:
            print(f"    epoch 1 {res['epoch1_seconds']:.1f} s (with numba compilation)", flush=True)
    report["runs"] = runs
    ok = ok_runs(runs)
    if not ok:
        report["skipped"] = f"every round failed: {runs[-1].get('error')}"
        print(f"ffcv: {report['skipped']}")
        return finish(1)
    rate = median_rate(ok)
    steady = median_rate(ok, "steady_samples", "steady_seconds")
    first = median_of(ok, "first_batch_seconds")
    cpu_ms = 1e3 * (median_of(ok, "cpu_seconds", "samples") or 0.0)
    epoch1 = median_of(ok, "epoch1_seconds")
    report.update(
        {
            "img_per_s": rate,
            "steady_img_per_s": steady,
            "first_batch_seconds": first,
            "cpu_ms_per_img": cpu_ms,
            "epoch1_seconds": epoch1,
            # the shape of bench_loader's report, so the two tables merge by key
            "workloads": {
                "train": {
                    "rates": {"ffcv": rate},
                    "steady_rates": {"ffcv": steady},
                    "first_batch_seconds": {"ffcv": first},
                    "cpu_us_per_sample": {"ffcv": cpu_ms * 1e3},
                }
            },
        }
    )
    print(f"\n== train, ffcv: epoch 2, median of {len(ok)} rounds; {label} ==")
    table = Table(
        ("loader", 22),
        ("epoch/s", 8),
        ("steady/s", 8),
        ("1st batch s", 11),
        ("CPU ms/img", 10),
        ("epoch 1 s", 10),
    )
    print(table.header())
    print(
        table.row(
            "ffcv",
            f"{rate or 0:.0f}",
            f"{steady or 0:.0f}",
            f"{first or 0:.2f}",
            f"{cpu_ms:.2f}",
            f"{epoch1 or 0:.1f}",
        )
    )
    return finish(0)


if __name__ == "__main__":
    sys.exit(main())
