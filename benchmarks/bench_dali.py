"""DALI benchmark on the W1 corpus (CPU mode): fastload's DALI pipelines against plain DALI.

One workload, the training path: decode + random-resized-crop 224 + horizontal flip + normalize
to float32 NCHW, batch 64, shuffled, 2 threads (DALI ``num_threads=2``; 2 workers for the torch
loader). Side by side in one run:

* ``fastload-dali-external``: :class:`fastload.dali.DALILoader` with ``reader="external"`` (the
  default): fastload's order and partition, bytes read by fastload's WebDataset reader in
  ``py_workers`` external-source processes, decode + augment in DALI (fused crop-while-decoding).
* ``fastload-dali-native``: the same with ``reader="native"`` (DALI's ``fn.readers.webdataset``
  on fastload's shards and ``.idx`` files).
* ``dali-file``: the reference, a plain DALI pipeline: ``fn.readers.file`` over the loose JPEGs,
  the same augmentation graph (``ImageAugment``'s).
* ``fastload-torch``: ``fastload.DataLoader`` with ``ImageTrainTransform`` (fused PIL decode),
  2 worker processes, normalized on the batch.

Every measurement runs in a fresh subprocess; loaders alternate round by round (this machine is
shared); the report gives medians and ratios. Data are in the warm page cache. Each run is **one
whole epoch** of the corpus (10,000 images; ``--quick`` 2,000, labelled ``QUICK RUN``), timed
from the loader's (or pipeline's) creation to its last batch: the epoch rate (start-up included),
the steady rate after batch 2, the first-batch time and the CPU time per image of the process
tree. Ratios are on the epoch rate, with the steady ratio to ``dali-file`` beside it.

Run: ``.venv/bin/python -m benchmarks.bench_dali [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from benchmarks._harness import (
    Table,
    alternating,
    check_labels,
    counting_labels,
    dali_batches,
    emit_result,
    fmt_ratio,
    median_of,
    median_rate,
    print_round,
    ratio,
    run_child,
    run_label,
    time_epoch,
    tree_cpu_seconds,
    warm,
)
from benchmarks._loader_children import corpus_labels
from benchmarks.corpus import ensure_corpus

THREADS = 2
BATCH = 64


# ---- children: one whole epoch each (time_epoch: creation to the last batch) ---------------------


def _epoch(make: Callable[[], Iterable[Any]], cfg: dict[str, Any]) -> dict[str, float]:
    """One epoch of ``cfg["count"]`` samples, with the CPU time of the process tree; every
    sample once (the labels are the corpus's)."""
    counts: Counter[int] = Counter()
    result = time_epoch(counting_labels(make, counts), cfg["count"], cpu_clock=tree_cpu_seconds)
    check_labels(counts, corpus_labels(cfg))
    return result


def child_fastload_dali(cfg: dict[str, Any], reader: str, py_workers: int) -> dict[str, float]:
    from fastload.dali import DALILoader, ImageAugment

    warm(Path(cfg["wds"]).glob("*"))
    loaders: list[Any] = []

    def make() -> Iterable[Any]:
        loader = DALILoader(
            cfg["wds"],
            BATCH,
            augment=ImageAugment(size=224),
            device="cpu",
            num_threads=THREADS,
            reader=reader,
            py_workers=py_workers,
            seed=0,
        )
        loaders.append(loader)
        return loader

    result = _epoch(make, cfg)
    result["stall_s"] = loaders[0].stats()["data_stall_s"]
    return result


def child_dali_file(cfg: dict[str, Any]) -> dict[str, float]:
    import importlib

    from fastload.dali import ImageAugment

    dali: Any = importlib.import_module("nvidia.dali")
    root = cfg["folder"]
    warm(p for p in Path(root).rglob("*.jpg"))

    def make() -> Iterable[Any]:
        augment = ImageAugment(size=224)
        pipe = dali.Pipeline(batch_size=BATCH, num_threads=THREADS, device_id=None, seed=0)
        with pipe:
            jpegs, labels = dali.fn.readers.file(file_root=root, random_shuffle=True, name="files")
            pipe.set_outputs(*augment(jpegs, labels, device="cpu"))
        pipe.build()
        if pipe.epoch_size("files") != cfg["count"]:
            raise RuntimeError(f"DALI's reader sees {pipe.epoch_size('files')} files")
        return dali_batches(pipe, cfg["count"])  # one epoch, the last batch cut to its rest

    return _epoch(make, cfg)


def child_fastload_torch(cfg: dict[str, Any]) -> dict[str, float]:
    import torch

    import fastload.loader as fl
    from fastload.loader.decode import Decoder
    from fastload.loader.transforms import ImageTrainTransform

    warm(Path(cfg["wds"]).glob("*"))

    def make() -> Iterable[Any]:
        tf = ImageTrainTransform()
        ds = fl.open_dataset(
            cfg["wds"], seed=0, decode=Decoder(image="bytes"), transform=tf, fields=("jpg", "cls")
        )
        loader = fl.DataLoader(ds, batch_size=BATCH, num_workers=THREADS)
        return ((tf.batch_transform(images), labels) for images, labels in loader)

    torch.set_num_threads(1)
    return _epoch(make, cfg)


def child(spec: dict[str, Any]) -> dict[str, float]:
    kind, cfg = spec["kind"], spec["cfg"]
    if kind == "fastload-dali-external":
        return child_fastload_dali(cfg, "external", spec.get("py_workers", 1))
    if kind == "fastload-dali-native":
        return child_fastload_dali(cfg, "native", 0)
    if kind == "dali-file":
        return child_dali_file(cfg)
    if kind == "fastload-torch":
        return child_fastload_torch(cfg)
    raise ValueError(f"unknown child kind {kind!r}")


# ---- parent -------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="fastload DALI benchmark (W1 images, CPU)")
    parser.add_argument("--quick", action="store_true", help="2,000 images, 2 rounds")
    parser.add_argument("--count", type=int, default=None, help="corpus size (default 10,000)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--only", default="", help="comma-separated loader names")
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        emit_result(child(json.loads(args.child)))
        return 0
    count = args.count or (2000 if args.quick else 10_000)
    rounds = args.rounds or (2 if args.quick else 3)
    corpus = ensure_corpus(count)
    folder = corpus.folder()
    wds = corpus.webdataset(shards=16, workers=THREADS)
    cfg = {"root": str(corpus.root), "folder": str(folder), "wds": str(wds), "count": count}
    plan: list[tuple[str, dict[str, Any]]] = [
        ("dali-file", {"kind": "dali-file"}),
        ("fastload-dali-external", {"kind": "fastload-dali-external", "py_workers": 1}),
        ("fastload-dali-native", {"kind": "fastload-dali-native"}),
        ("fastload-torch", {"kind": "fastload-torch"}),
    ]
    if not args.quick:
        plan.insert(
            2,
            ("fastload-dali-external-pw2", {"kind": "fastload-dali-external", "py_workers": 2}),
        )
    want = {w for w in args.only.split(",") if w}
    plan = [(name, spec) for name, spec in plan if not want or name in want]
    print(
        f"bench_dali: {run_label(args.quick, count, rounds)}, one epoch per run, at {folder};"
        f" batch {BATCH}, {THREADS} threads;"
        f" {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}"
    )
    results: dict[str, list[dict[str, Any]]] = {}
    t_start = time.perf_counter()
    for r, (name, spec) in alternating(plan, rounds):
        argv = [sys.executable, "-m", "benchmarks.bench_dali", "--child"]
        res = run_child([*argv, json.dumps({**spec, "cfg": cfg})], timeout=900)
        results.setdefault(name, []).append(res)
        print_round(r, f"{name:28s}", res, unit="img/s")
    label = run_label(args.quick, count, rounds)
    rates = {name: median_rate(runs) for name, runs in results.items()}
    steady = {n: median_rate(r, "steady_samples", "steady_seconds") for n, r in results.items()}
    first = {n: median_of(r, "first_batch_seconds") for n, r in results.items()}
    cpu_ms = {
        n: (v * 1e3 if (v := median_of(r, "cpu_seconds", "samples")) else None)
        for n, r in results.items()
    }
    ref, ref_steady = rates.get("dali-file"), steady.get("dali-file")
    torch_rate = rates.get("fastload-torch")
    print(f"\n== train path, one epoch per run, medians of {rounds} rounds; {label} ==")
    table = Table(
        ("loader", 28),
        ("epoch/s", 8),
        ("steady/s", 8),
        ("1st batch s", 11),
        ("CPU ms/img", 10),
        ("vs dali-file", 12),
        ("steady", 6),
        ("vs fastload-torch", 17),
    )
    print(table.header())
    for name, rate in rates.items():
        if rate is None:
            print(table.error(name, results[name][-1].get("error", "")))
            continue
        print(
            table.row(
                name,
                f"{rate:.0f}",
                f"{steady[name] or 0:.0f}",
                f"{first[name] or 0:.2f}",
                "-" if cpu_ms[name] is None else f"{cpu_ms[name]:.2f}",
                fmt_ratio(ratio(rate, ref)),
                fmt_ratio(ratio(steady[name], ref_steady)),
                fmt_ratio(ratio(rate, torch_rate)),
            )
        )
    print(f"load {os.getloadavg()[0]:.2f} at the end ({os.cpu_count()} CPUs)")
    report = {
        "quick": args.quick,
        "label": label,
        "rates": rates,
        "steady_rates": steady,
        "first_batch_seconds": first,
        "cpu_ms_per_img": cpu_ms,
        "runs": results,
        "config": {"count": count, "rounds": rounds, "batch": BATCH, "threads": THREADS},
        "elapsed_s": time.perf_counter() - t_start,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
