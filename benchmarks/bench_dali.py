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
shared); the report gives medians and ratios. Data are in the warm page cache. Throughput counts
from the end of the first 2 batches to the last one (pipeline start-up excluded for all alike).

Run: ``.venv/bin/python -m benchmarks.bench_dali [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.corpus import Corpus, ensure_corpus

THREADS = 2
BATCH = 64
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def _warm(paths: Iterable[str | Path]) -> None:
    buf = bytearray(4 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def _timed(batches: Iterable[Any], limit: int, warmup: int = 2) -> dict[str, float]:
    """Consume batches up to ``limit`` samples; the rate counts after ``warmup`` batches."""
    n = seen = counted = 0
    t0 = start = time.perf_counter()
    for batch in batches:
        size = len(batch[1])
        seen += size
        n += 1
        if n == warmup:
            start, counted = time.perf_counter(), 0
        elif n > warmup:
            counted += size
        if seen >= limit:
            break
    end = time.perf_counter()
    if n <= warmup:
        counted, start = seen, t0
    return {"samples": counted, "seconds": end - start, "total_seconds": end - t0}


# ---- children -----------------------------------------------------------------------------------


def child_fastload_dali(cfg: dict[str, Any], reader: str, py_workers: int) -> dict[str, float]:
    from fastload.dali import DALILoader, ImageAugment

    _warm(Path(cfg["wds"]).glob("*"))
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
    result = _timed(loader, min(cfg["limit"], len(loader) * BATCH))
    result["stall_s"] = loader.stats()["data_stall_s"]
    return result


def child_dali_file(cfg: dict[str, Any]) -> dict[str, float]:
    import importlib

    import numpy as np
    import torch

    from fastload.dali import ImageAugment

    dali: Any = importlib.import_module("nvidia.dali")
    root = cfg["folder"]
    _warm(p for p in Path(root).rglob("*.jpg"))
    augment = ImageAugment(size=224)
    pipe = dali.Pipeline(batch_size=BATCH, num_threads=THREADS, device_id=None, seed=0)
    with pipe:
        jpegs, labels = dali.fn.readers.file(file_root=root, random_shuffle=True, name="files")
        pipe.set_outputs(*augment(jpegs, labels, device="cpu"))
    pipe.build()

    def batches() -> Iterable[Any]:
        while True:
            images, labels = pipe.run()
            yield (
                torch.from_numpy(np.array(images.as_tensor())),
                torch.from_numpy(np.array(labels.as_tensor())).view(-1),
            )

    return _timed(batches(), cfg["limit"])


def child_fastload_torch(cfg: dict[str, Any]) -> dict[str, float]:
    import torch

    import fastload.loader as fl
    from fastload.loader.decode import Decoder
    from fastload.loader.transforms import ImageTrainTransform

    _warm(Path(cfg["wds"]).glob("*"))
    tf = ImageTrainTransform()
    ds = fl.open_dataset(
        cfg["wds"], seed=0, decode=Decoder(image="bytes"), transform=tf, fields=("jpg", "cls")
    )
    loader = fl.DataLoader(ds, batch_size=BATCH, num_workers=THREADS)

    def batches() -> Iterable[Any]:
        for images, labels in loader:
            yield tf.batch_transform(images), labels

    torch.set_num_threads(1)
    return _timed(batches(), cfg["limit"])


def run_child(spec: dict[str, Any]) -> dict[str, float]:
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


def prepare_wds(corpus: Corpus, shards: int = 16) -> Path:
    """The corpus as fastload WebDataset shards (shared with bench_loader's ``-wds-`` copy)."""
    import fastload.convert as fc

    dst = corpus.root.parent / f"{corpus.root.name}-wds-{corpus.count}"
    if not (dst / "fastload.json").exists():
        t0 = time.perf_counter()
        fc.convert(
            str(corpus.folder()),
            str(dst),
            format="webdataset",
            shard_samples=math.ceil(corpus.count / shards),
            workers=THREADS,
            quiet=True,
        )
        print(f"prepared fastload webdataset shards in {time.perf_counter() - t0:.1f} s: {dst}")
    return dst


def _run(spec: dict[str, Any], timeout: float = 900) -> dict[str, Any]:
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.bench_dali", "--child", json.dumps(spec)],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent.parent,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[7:])
            return result
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {proc.returncode}: {' | '.join(tail)}"}


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
        print("RESULT " + json.dumps(run_child(json.loads(args.child))), flush=True)
        return 0
    count = args.count or (2000 if args.quick else 10_000)
    rounds = args.rounds or (2 if args.quick else 3)
    corpus = ensure_corpus(count)
    folder = corpus.folder()
    wds = prepare_wds(corpus)
    cfg = {"folder": str(folder), "wds": str(wds), "limit": count}
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
    print(f"corpus: {count} JPEGs at {folder}; {rounds} rounds, batch {BATCH}, {THREADS} threads")
    results: dict[str, list[dict[str, Any]]] = {}
    t_start = time.perf_counter()
    for r in range(rounds):
        for name, spec in plan:
            res = _run({**spec, "cfg": cfg})
            results.setdefault(name, []).append(res)
            if "error" in res:
                print(f"  round {r + 1} {name:28s} ERROR {res['error']}", flush=True)
            else:
                rate = res["samples"] / res["seconds"]
                print(f"  round {r + 1} {name:28s} {rate:8.0f} img/s", flush=True)
    rates: dict[str, float | None] = {}
    for name, runs in results.items():
        ok = [x["samples"] / x["seconds"] for x in runs if "error" not in x and x["seconds"] > 0]
        rates[name] = statistics.median(ok) if ok else None
    ref = rates.get("dali-file")
    torch_rate = rates.get("fastload-torch")
    print(f"\n== train path, medians of {rounds} rounds ==")
    print(f"{'loader':28s} {'img/s':>8s} {'vs dali-file':>13s} {'vs fastload-torch':>18s}")
    for name, rate in rates.items():
        if rate is None:
            print(f"{name:28s} ERROR {results[name][-1].get('error', '')}")
            continue
        vs_ref = f"{rate / ref:.2f}x" if ref else "-"
        vs_torch = f"{rate / torch_rate:.2f}x" if torch_rate else "-"
        print(f"{name:28s} {rate:8.0f} {vs_ref:>13s} {vs_torch:>18s}")
    report = {
        "rates": rates,
        "runs": results,
        "config": {"count": count, "rounds": rounds, "batch": BATCH, "threads": THREADS},
        "elapsed_s": time.perf_counter() - t_start,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
