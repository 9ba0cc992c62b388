"""Memory of fastload's loader process tree over epochs, per process (issue 15).

fastload's two W1 loaders of ``bench_loader`` (``bytes``: raw JPEG bytes, batch 256; ``train``:
fused decode + augment, batch 64), 2 workers, over the W1 WebDataset shards in the page cache,
for ``--epochs`` (5) epochs, with ``persistent_workers=False`` (fresh workers every epoch) and
``True``: four configurations, each in a fresh process. Every epoch it checks that the loader
delivered every sample, and samples each process of the loader's tree (:func:`tree_memory`):

* mid-epoch (both workers alive, batches in flight): the main process and each worker;
* after the epoch: the main process (and the persistent workers).

Per process: **RSS** (``VmRSS``: counts every resident page it maps, so pages the processes
share, such as forked copy-on-write memory, shared-memory batches and the mapped shards' page
cache, are counted once per process), **PSS** (``Pss`` from ``/proc/PID/smaps_rollup``: shared
pages divided among the processes that map them, so the tree's PSS adds up to what the loader
really holds), **own** (PSS less ``Pss_File``, the mapped files' share: the shards' page cache is
also divided with any other process on the machine that maps the same files, so PSS moves with
them; ``own`` does not) and **anon** (``RssAnon``: private memory, where a leak shows). Reported per epoch
and as the growth from epoch 2 to the last. **Goal: flat**: the anon growth of the main process
and of each worker under ``bench_soak``'s bound (20 MB; exit 1 otherwise).

``bench_soak`` does the same over 20 epochs from Ceph through a small cache (descriptors, temp
files, evictions); this one states what the local loader costs per worker on the realistic corpus.

Run: ``.venv/bin/python -m benchmarks.bench_memory [--quick] [--epochs N] [--json PATH]``
(10,000 images; ``--quick``: 2,000, labelled ``QUICK RUN``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._harness import (
    batch_size,
    child_pids,
    emit_result,
    run_child,
    run_label,
    tree_memory,
    warm,
)
from benchmarks.bench_soak import RSS_GROWTH_KB
from benchmarks.corpus import ensure_corpus

WORKERS = 2
BATCH = {"bytes": 256, "train": 64}
FIELDS = ("rss_kb", "pss_kb", "own_kb", "anon_kb")


# ---- the child: one configuration, all its epochs -----------------------------------------------


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """Run ``spec["epochs"]`` epochs of one loader configuration; the per-epoch samples.

    ``spec``: ``workload`` (``bytes``/``train``), ``persistent``, ``epochs``, ``count`` (samples
    per epoch, checked), ``wds`` (the shards) and optionally ``batch`` (default :data:`BATCH`).
    """
    import torch

    import fastload.loader as fl
    from fastload.loader.decode import Decoder
    from fastload.loader.transforms import ImageTrainTransform

    torch.set_num_threads(1)
    warm(sorted(Path(spec["wds"]).glob("*.tar")))
    workload = spec["workload"]
    finish = None
    if workload == "bytes":
        decoder = Decoder(image="bytes")
    else:
        tf = ImageTrainTransform()
        decoder, finish = Decoder(image=tf), tf.batch_transform
    ds = fl.open_dataset(spec["wds"], seed=0, decode=decoder, fields=("jpg", "cls"))
    loader = fl.DataLoader(
        ds,
        batch_size=spec.get("batch") or BATCH[workload],
        num_workers=WORKERS,
        persistent_workers=spec["persistent"],
    )
    main = os.getpid()
    others = set(child_pids(main))  # not the loader's
    epochs = []
    for epoch in range(spec["epochs"]):
        loader.set_epoch(epoch)
        n, seen, mid = len(loader), 0, []
        t0 = time.perf_counter()
        for i, batch in enumerate(loader):
            if finish is not None:
                finish(batch[0])
            seen += batch_size(batch)
            if i == n // 2:
                mid = [p for p in tree_memory(main) if p["pid"] not in others]
        seconds = time.perf_counter() - t0
        del batch  # the last batch's shared memory belongs to the loop
        gc.collect()
        if seen != spec["count"]:
            raise RuntimeError(f"epoch {epoch + 1} delivered {seen} samples, not {spec['count']}")
        after = [p for p in tree_memory(main) if p["pid"] not in others]
        epochs.append({"epoch": epoch + 1, "rate": seen / seconds, "mid": mid, "after": after})
    return {"epochs": epochs}


# ---- the parent ---------------------------------------------------------------------------------


def _by_role(rows: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The main process's row and the workers' rows (pid order) of one sample."""
    main = next((r for r in rows if r["role"] == "main"), None)
    return main, sorted((r for r in rows if r["role"] == "worker"), key=lambda r: r["pid"])


def _kb(row: dict[str, Any] | None, field: str) -> int:
    """A figure of a :func:`tree_memory` row; ``own_kb`` is PSS without the mapped files."""
    if row is None:
        return 0
    if field == "own_kb":
        return int(row["pss_kb"] - row.get("pss_file_kb", 0))
    return int(row[field])


def summarize(epochs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-epoch MB figures and the growth from epoch 2 to the last (MB): ``main_*`` after the
    epoch, ``worker_*`` the largest worker mid-epoch, ``tree_pss`` the tree's PSS mid-epoch."""
    rows = []
    for e in epochs:
        main, _ = _by_role(e["after"])
        _, mid_workers = _by_role(e["mid"])
        row: dict[str, Any] = {"epoch": e["epoch"], "rate": e["rate"], "workers": len(mid_workers)}
        for f in FIELDS:
            name = f.removesuffix("_kb")
            row[f"main_{name}"] = _kb(main, f) / 1024
            row[f"worker_{name}"] = [_kb(w, f) / 1024 for w in mid_workers]
        row["tree_pss"] = sum(r["pss_kb"] for r in e["mid"]) / 1024
        rows.append(row)
    growth: dict[str, float] = {}
    if len(rows) >= 2:
        first, last = rows[1], rows[-1]
        for f in FIELDS:
            name = f.removesuffix("_kb")
            growth[f"main_{name}"] = last[f"main_{name}"] - first[f"main_{name}"]
            growth[f"worker_{name}"] = max(
                (b - a for a, b in zip(first[f"worker_{name}"], last[f"worker_{name}"])),
                default=0.0,
            )
        growth["tree_pss"] = last["tree_pss"] - first["tree_pss"]
    return {"epochs": rows, "growth_from_epoch_2": growth}


def print_table(summary: dict[str, Any]) -> None:
    """The per-epoch table of one configuration and its growth line."""

    def each(values: list[float]) -> str:
        return "/".join(f"{v:.0f}" for v in values) or "-"

    print(
        f"{'epoch':>5} {'main RSS':>8} {'main PSS':>8} {'main own':>8} {'main anon':>9}"
        f" {'worker RSS':>11} {'worker PSS':>11} {'worker own':>11} {'worker anon':>11}"
        f" {'tree PSS':>8} {'img/s':>7}   (MB)"
    )
    for r in summary["epochs"]:
        print(
            f"{r['epoch']:>5} {r['main_rss']:>8.0f} {r['main_pss']:>8.0f} {r['main_own']:>8.0f}"
            f" {r['main_anon']:>9.0f} {each(r['worker_rss']):>11} {each(r['worker_pss']):>11}"
            f" {each(r['worker_own']):>11} {each(r['worker_anon']):>11} {r['tree_pss']:>8.0f}"
            f" {r['rate']:>7.0f}"
        )
    g = summary["growth_from_epoch_2"]
    if g:
        print(
            "growth epoch 2 -> last (MB): "
            + ", ".join(f"{k} {v:+.1f}" for k, v in g.items())
            + " (worker: the largest)"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="2,000 images: QUICK RUN")
    parser.add_argument("--count", type=int, default=None, help="images (default 10,000)")
    parser.add_argument("--epochs", type=int, default=5, help="epochs per configuration")
    parser.add_argument("--workloads", default="bytes,train")
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        emit_result(child(json.loads(args.child)))
        return 0
    count = args.count or (2_000 if args.quick else 10_000)
    corpus = ensure_corpus(count)
    wds = corpus.webdataset(shards=16, workers=WORKERS)
    label = run_label(args.quick, count)
    print(
        f"bench_memory: {label}, {args.epochs} epochs per configuration, {WORKERS} workers;"
        f" {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    bound_mb = RSS_GROWTH_KB / 1024
    report: dict[str, Any] = {"quick": args.quick, "label": label, "configs": {}}
    report["config"] = {"count": count, "epochs": args.epochs, "workers": WORKERS, "batch": BATCH}
    failed = False
    for workload in [w for w in args.workloads.split(",") if w]:
        for persistent in (False, True):
            name = f"{workload}, {'persistent workers' if persistent else 'workers per epoch'}"
            spec = {"workload": workload, "persistent": persistent, "epochs": args.epochs}
            spec |= {"count": count, "wds": str(wds)}
            res = run_child(
                [sys.executable, "-m", "benchmarks.bench_memory", "--child", json.dumps(spec)],
                timeout=1800,
            )
            print(f"\n== {name} ==")
            if "error" in res:
                print(f"ERROR {res['error']}")
                report["configs"][name] = res
                failed = True
                continue
            summary = summarize(res["epochs"])
            print_table(summary)
            g = summary["growth_from_epoch_2"]
            flat = all(g.get(k, 0.0) < bound_mb for k in ("main_anon", "worker_anon"))
            print(f"{'PASS' if flat else 'FAIL'}: anon growth under {bound_mb:.0f} MB", flush=True)
            failed = failed or not flat
            report["configs"][name] = {**summary, "flat": flat, "raw": res["epochs"]}
    print(f"\n{label}; load {os.getloadavg()[0]:.2f} at the end")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
