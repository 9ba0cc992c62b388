#!/usr/bin/env python3
"""GPU check for fastload's DALI path (issue 7): one script, end to end, in under 5 minutes.

What it measures, on one GPU, with the same augmentation (decode + random-resized-crop 224 +
flip + normalize to float32 NCHW, batch 256):

  (a) ``fastload-dali``: :class:`fastload.dali.DALILoader` over fastload WebDataset shards,
      ``device="gpu"`` (nvJPEG / hardware decoder through ``decoders.image_random_crop(device=
      "mixed")``), external-source feeding (fastload's order) and, as a variant, DALI's native
      WebDataset reader (``fastload-dali-native``);
  (b) ``dali-file``: DALI's own ``fn.readers.file`` pipeline on the same JPEGs with the same
      augmentation graph, through DALI's ``DALIGenericIterator`` (the reference);
  (c) ``fastload-torch``: ``fastload.DataLoader`` with CPU decoding (``ImageTrainTransform``),
      ``--workers`` processes, batches moved to the GPU (``device="cuda"``).

plus peak GPU memory per loader: ``torch.cuda.max_memory_allocated`` (torch's allocator: the
batches) and the peak of ``nvidia-smi``'s used memory sampled every 100 ms minus the idle value
(everything, DALI's own pools included). Goal of the issue: (a) within 10 % of (b).

Steps: generate a corpus of ``--count`` (5,000) photo-like JPEGs with ``benchmarks/corpus.py``
(all cores), convert it to WebDataset shards with ``fastload.convert``, then run every loader in
a fresh subprocess, alternating, ``--rounds`` times; medians. Each run is 3 whole epochs (1 in
``--cpu-smoke``) timed from the loader's creation to its last batch (start-up included), with the
steady rate after batch 2 and the first-batch time beside it; the goal is checked on both. Prints
a table; writes ``$OUT/gpu_check.json`` when ``$OUT`` is set (else ``--json``).

Assumes (nothing is installed by this script; the GPU machine may have no network):
  * Linux, Python >= 3.11, an NVIDIA driver for CUDA 12 (``nvidia-smi`` on the PATH for the
    whole-device memory figure; without it only torch's figure is reported);
  * this repository installed with the DALI extra and a CUDA build of torch 2.13.0:
        python -m venv .venv-gpu && .venv-gpu/bin/pip install torch==2.13.0 -e '.[dali]'
    (``fastload[dali]`` pulls ``nvidia-dali-cuda120``; PyPI's Linux torch wheels are CUDA
    builds). The script checks this first and says what is missing.
  * ~2 GB of free disk under ``--root`` (default ``$TMPDIR/fastload-gpu-check``).

``--cpu-smoke`` runs the same code paths on the CPU with a tiny corpus (no GPU needed): it checks
the script itself, e.g. in CI or on a laptop.

Run: ``python benchmarks/gpu/run_gpu_check.py [--cpu-smoke] [--count 5000] [--rounds 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # this file runs as a script: make the benchmarks package importable
    sys.path.insert(0, str(REPO))

from benchmarks._harness import (  # noqa: E402
    Table,
    alternating,
    emit_result,
    fmt_ratio,
    median_of,
    median_rate,
    ok_runs,
    print_round,
    ratio,
    run_child,
    time_epoch,
)

# ---- environment ----------------------------------------------------------------------------


def check_environment(cpu_smoke: bool) -> dict[str, Any]:
    """Versions of what the check needs; exits with instructions when something is missing."""
    info: dict[str, Any] = {"python": sys.version.split()[0]}
    missing = []
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        info["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        missing.append("torch==2.13.0 (a CUDA build)")
    try:
        import nvidia.dali as dali

        info["dali"] = dali.__version__
    except ImportError:
        missing.append("nvidia-dali-cuda120 (pip install -e '.[dali]')")
    try:
        import fastload.dali  # noqa: F401
    except ImportError:
        missing.append("fastload (pip install -e '.[dali]' from the repository root)")
    smi = shutil.which("nvidia-smi")
    info["nvidia_smi"] = smi is not None
    if smi:
        out = subprocess.run(
            [smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        )
        info["nvidia_smi_gpu"] = out.stdout.strip().splitlines()[:1]
    if missing:
        sys.exit("missing: " + "; ".join(missing) + "\nsee the header of this script for setup")
    if not cpu_smoke and not info.get("cuda_available"):
        sys.exit(
            "torch.cuda.is_available() is False: no GPU, no driver, or a CPU-only torch build "
            f"(torch {info.get('torch')}, CUDA {info.get('torch_cuda')}). Use --cpu-smoke to "
            "check the script without a GPU"
        )
    return info


class GpuMemory:
    """Peak device memory used, from nvidia-smi sampled in a thread (MiB; None without it)."""

    def __init__(self, index: int = 0, period: float = 0.1) -> None:
        self.index, self.period = index, period
        self.smi = shutil.which("nvidia-smi")
        self.base: float | None = None
        self.peak: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _used(self) -> float | None:
        if self.smi is None:
            return None
        out = subprocess.run(
            [
                self.smi,
                "--query-gpu=memory.used",
                "--format=csv,noheader,nounits",
                "-i",
                str(self.index),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        try:
            return float(out.stdout.strip().splitlines()[0])
        except (ValueError, IndexError):
            return None

    def __enter__(self) -> GpuMemory:
        self.base = self._used()
        self.peak = self.base

        def loop() -> None:
            while not self._stop.wait(self.period):
                used = self._used()
                if used is not None and (self.peak is None or used > self.peak):
                    self.peak = used

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def delta_mib(self) -> float | None:
        if self.base is None or self.peak is None:
            return None
        return self.peak - self.base


# ---- children: one loader each ----------------------------------------------------------------


def _sync() -> None:
    """Wait for the GPU's queued work, so that a timed span counts it."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()


def _epochs(make: Any, epochs: int) -> Iterator[Any]:
    """Batches of ``epochs`` epochs of a fastload loader (set_epoch between them)."""
    loader = make()
    for e in range(epochs):
        loader.set_epoch(e)
        yield from loader


def child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    kind, cfg = spec["kind"], spec["cfg"]
    device: Literal["cpu", "gpu"] = "cpu" if cfg["cpu_smoke"] else "gpu"
    batch, threads, epochs = cfg["batch"], cfg["threads"], cfg["epochs"]
    total = epochs * cfg["count"]  # every epoch whole; the clock starts before the loader exists
    from fastload.dali import DALILoader, ImageAugment

    augment = ImageAugment(size=224)
    mem = GpuMemory() if device == "gpu" else None
    if mem is not None:
        mem.__enter__()
    if kind in ("fastload-dali", "fastload-dali-native"):

        def make() -> Any:
            return DALILoader(
                cfg["wds"],
                batch,
                augment=augment,
                device=device,
                num_threads=threads,
                reader="native" if kind.endswith("native") else "external",
                py_workers=cfg["py_workers"],
                seed=0,
            )

        result: dict[str, Any] = time_epoch(lambda: _epochs(make, epochs), total, sync=_sync)
    elif kind == "dali-file":
        import importlib

        dali: Any = importlib.import_module("nvidia.dali")
        plugin: Any = importlib.import_module("nvidia.dali.plugin.pytorch")
        DALIGenericIterator, LastBatchPolicy = plugin.DALIGenericIterator, plugin.LastBatchPolicy

        def batches() -> Iterator[Any]:
            pipe = dali.Pipeline(
                batch_size=batch,
                num_threads=threads,
                seed=0,
                device_id=None if device == "cpu" else 0,
            )
            with pipe:
                jpegs, labels = dali.fn.readers.file(
                    file_root=cfg["folder"], random_shuffle=True, name="files"
                )
                images, labels = augment(jpegs, labels, device=device)
                pipe.set_outputs(images, labels)
            it = DALIGenericIterator(
                [pipe],
                ["images", "labels"],
                reader_name="files",
                last_batch_policy=LastBatchPolicy.PARTIAL,  # exact epochs
                auto_reset=True,
            )
            for _ in range(epochs):
                for out in it:
                    yield out[0]["images"], out[0]["labels"]

        result = time_epoch(batches, total, sync=_sync)
    elif kind == "fastload-torch":
        import fastload.loader as fl
        from fastload.loader.decode import Decoder
        from fastload.loader.transforms import ImageTrainTransform

        tf = ImageTrainTransform()
        ds = fl.open_dataset(
            cfg["wds"],
            seed=0,
            decode=Decoder(image="bytes"),
            transform=tf,
            fields=("jpg", "cls"),
        )
        to = None if device == "cpu" else "cuda"

        def make() -> Any:
            return fl.DataLoader(ds, batch_size=batch, num_workers=cfg["workers"], device=to)

        def batches() -> Iterator[Any]:
            for images, labels in _epochs(make, epochs):
                yield tf.batch_transform(images), labels

        torch.set_num_threads(1)
        result = time_epoch(batches, total, sync=_sync)
    else:
        raise ValueError(f"unknown loader {kind!r}")
    if mem is not None:
        mem.__exit__()
        result["gpu_mem_smi_mib"] = mem.delta_mib
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        result["torch_max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return result


# ---- parent -----------------------------------------------------------------------------------


def prepare(root: Path, count: int, workers: int) -> tuple[Path, Path]:
    from benchmarks.corpus import ensure_corpus

    t0 = time.perf_counter()
    corpus = ensure_corpus(count, root / "w1", processes=workers)
    folder = corpus.folder()
    wds = corpus.webdataset(shards=16, workers=workers)
    print(f"corpus + webdataset shards ready in {time.perf_counter() - t0:.1f} s ({count} images)")
    return folder, wds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny run on the CPU (no GPU)")
    p.add_argument("--count", type=int, default=None, help="images (default 5000; smoke 96)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 2; smoke 1)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default 256; smoke 16)")
    p.add_argument("--threads", type=int, default=None, help="DALI threads (default 8; smoke 2)")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="torch loader workers (default min(16, cores); smoke 2)",
    )
    p.add_argument("--root", default=None, help="work directory")
    p.add_argument(
        "--json", default=None, help="write the report here ($OUT/gpu_check.json when $OUT is set)"
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        emit_result(child(json.loads(args.child)))
        return 0
    t_start = time.perf_counter()
    smoke = args.cpu_smoke
    env = check_environment(smoke)
    print("environment:", json.dumps(env))
    cores = os.cpu_count() or 2
    count = args.count or (96 if smoke else 5000)
    rounds = args.rounds or (1 if smoke else 2)
    workers = args.workers or (2 if smoke else min(16, cores))
    root = Path(args.root or Path(tempfile.gettempdir()) / "fastload-gpu-check")
    folder, wds = prepare(root, count, workers)
    cfg = {
        "cpu_smoke": smoke,
        "folder": str(folder),
        "wds": str(wds),
        "count": count,
        "batch": args.batch or (16 if smoke else 256),
        "threads": args.threads or (2 if smoke else 8),
        "workers": workers,
        "py_workers": 2 if smoke else 4,
        "epochs": 1 if smoke else 3,
    }
    names = ["dali-file", "fastload-dali", "fastload-dali-native", "fastload-torch"]
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r, name in alternating(names, rounds):
        argv = [sys.executable, str(Path(__file__).resolve()), "--child"]
        res = run_child(
            [*argv, json.dumps({"kind": name, "cfg": cfg})], timeout=600 if smoke else 240
        )
        results[name].append(res)
        print_round(r, f"{name:22s}", res, unit="img/s")
    table: dict[str, dict[str, Any]] = {}
    for name, runs in results.items():
        ok = ok_runs(runs)
        row: dict[str, Any] = {
            "img_per_s": median_rate(ok),
            "steady_img_per_s": median_rate(ok, "steady_samples", "steady_seconds"),
            "first_batch_s": median_of(ok, "first_batch_seconds"),
            "samples": [x["samples"] for x in ok],
            "errors": [x["error"] for x in runs if "error" in x],
        }
        for key in ("gpu_mem_smi_mib", "torch_max_allocated_mib"):
            vals = [x[key] for x in ok if x.get(key) is not None]
            row[key] = max(vals) if vals else None
        table[name] = row
    ref = table["dali-file"]["img_per_s"]
    ref_steady = table["dali-file"]["steady_img_per_s"]
    text = Table(
        ("loader", 22),
        ("img/s", 8),
        ("steady/s", 8),
        ("1st batch s", 11),
        ("vs dali-file", 12),
        ("steady", 6),
        ("GPU MiB (smi)", 13),
        ("torch MiB", 9),
    )
    print(f"\n{cfg['epochs']} whole epoch(s) per run, timed from the loader's creation")
    print(text.header())

    def mib(x: float | None) -> str:
        return "-" if x is None else f"{x:.0f}"

    for name, row in table.items():
        rate = row["img_per_s"]
        if rate is None:
            print(text.error(name, str(row["errors"][-1:])))
            continue
        steady = row["steady_img_per_s"]
        print(
            text.row(
                name,
                f"{rate:.0f}",
                mib(steady),
                f"{row['first_batch_s']:.2f}",
                fmt_ratio(ratio(rate, ref)),
                fmt_ratio(ratio(steady, ref_steady)),
                mib(row["gpu_mem_smi_mib"]),
                mib(row["torch_max_allocated_mib"]),
            )
        )
    a, a_steady = table["fastload-dali"]["img_per_s"], table["fastload-dali"]["steady_img_per_s"]
    verdict = None if not (a and ref) else a >= 0.9 * ref
    verdict_steady = None if not (a_steady and ref_steady) else a_steady >= 0.9 * ref_steady
    print(f"goal (a) within 10% of (b): {verdict} (whole run), {verdict_steady} (steady)")
    report = {
        "environment": env,
        "config": cfg,
        "table": table,
        "runs": results,
        "goal_within_10_percent": verdict,
        "goal_within_10_percent_steady": verdict_steady,
        "elapsed_s": time.perf_counter() - t_start,
    }
    out = args.json or (
        os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else None
    )
    if out:
        Path(out).write_text(json.dumps(report, indent=2))
        print(f"wrote {out}")
    print(f"total {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
