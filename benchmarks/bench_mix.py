"""The cost of mixing (``fastload.mix``): a 70/30 mix against one dataset, samples and tokens.

Corpora (written once under ``--root``, default ``/tmp/fastload-bench/mix``):

* two LMDB sample datasets, A with 40,000 and B with 20,000 samples of 64 random bytes plus a
  label, shards of 5,000 (``--quick``: 10,000 and 5,000), the workload where the loader's
  per-sample overhead shows most;
* two token datasets of 16 M ``uint16`` ids each (``--quick``: 4 M), random ids, documents of
  1,000 ids, blocks of 8,192 ids.

Contenders, each in a fresh process, alternated (ABCD, DCBA, ...), data warm in the page cache;
each runs epoch 0 untimed (shards opened and indexed, workers started: a mix has twice the
shards to open, a one-time cost) and times epoch 1, the steady state:

* ``samples-single``: ``DataLoader(A, batch_size=256, num_workers=2, persistent_workers=True)``;
* ``samples-mix``: the same over ``mix({A: 0.7, B: 0.3}, epoch_size=len(A))`` (as many
  samples per epoch); also the planning cost alone (the epoch order's indices and their
  shard locations for every batch, in the main process), in microseconds per batch, for the
  mix and for A alone;
* ``tokens-single``: ``TokenLoader(open_tokens(TA, 2048), 32)`` (``int64`` ids);
* ``tokens-mix``: the same over ``mix({TA: 0.7, TB: 0.3}, epoch_size=len(TA))``.

Reported: wall rates with 2 workers (noisy on a shared machine) and, robust to load, the CPU time
per row in the main process (samples: a third epoch without workers; tokens: the timed epoch);
ratios mix over single for rates and single over mix for CPU (1.0 = mixing costs nothing).

    python -m benchmarks.bench_mix [--quick] [--rounds N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._harness import (
    Table,
    alternating,
    emit_result,
    fmt_ratio,
    median_rate,
    print_round,
    ratio,
    run_child,
    warm,
)

DEFAULT_ROOT = Path("/tmp/fastload-bench/mix")
BATCH = 256
TOKEN_BATCH = 32
SEQ = 2048
CONTENDERS = ("samples-single", "samples-mix", "tokens-single", "tokens-mix")


def _write_samples(root: Path, count: int, seed: int) -> None:
    from fastload.formats import Manifest, ShardEntry, get_format, write_manifest
    from fastload.storage import LocalStore

    store, fmt = LocalStore(str(root)), get_format("lmdb")
    rng = np.random.default_rng(seed)
    entries = []
    for s in range(-(-count // 5000)):
        w = fmt.writer(store, f"train-{s:06d}.{fmt.extension}")
        for p in range(min(5000, count - s * 5000)):
            w.write({"__key__": f"s{s:03d}/k{p:05d}", "cls": p % 100, "bin": rng.bytes(64)})
        entries.append(ShardEntry.from_info(w.close()))
    write_manifest(store, Manifest(format=fmt.name, shards=entries))


def _write_tokens(root: Path, num_tokens: int, seed: int) -> None:
    from fastload.storage import open_store
    from fastload.testing.tokens import write_token_shards

    stream = np.random.default_rng(seed).integers(0, 50_000, num_tokens, dtype=np.uint16)
    starts = np.arange(0, num_tokens, 1000, dtype=np.int64)
    half = num_tokens // 2  # two shards, cut at a document start
    cut = int(starts[np.searchsorted(starts, half)])
    shards = [(stream[:cut], starts[starts < cut]), (stream[cut:], starts[starts >= cut] - cut)]
    write_token_shards(
        open_store(str(root)),
        shards,
        num_documents=len(starts),
        block_tokens=8192,
        vocab_size=50_257,
        eos_id=None,
    )


def ensure_corpus(root: Path, quick: bool) -> Path:
    """Write (once) the four datasets; returns their directory."""
    scale = 1 if quick else 4
    base = root / ("quick" if quick else "full")
    done = base / ".complete"
    if done.exists():
        return base
    t0 = time.perf_counter()
    _write_samples(base / "A", 10_000 * scale, 1)
    _write_samples(base / "B", 5_000 * scale, 2)
    _write_tokens(base / "TA", 4_000_000 * scale, 3)
    _write_tokens(base / "TB", 4_000_000 * scale, 4)
    done.write_text("ok")
    print(f"corpus written in {time.perf_counter() - t0:.0f} s")
    return base


def _collate(samples: list[Any]) -> int:
    return len(samples)


def _planning_us(ds: Any, batches: int) -> float:
    """Microseconds per batch to compute an epoch's indices and locations, batch by batch."""
    order = ds.order(0)
    t0 = time.perf_counter()
    for s in range(batches):
        ds.locate(order.indices(np.arange(s * BATCH, (s + 1) * BATCH)))
    return (time.perf_counter() - t0) / batches * 1e6


def child_samples(base: Path, mixed: bool) -> dict[str, float]:
    import fastload

    warm(p for d in ("A", "B") for p in (base / d).rglob("*") if p.is_file())
    a = fastload.open_dataset(base / "A", seed=0)
    ds: Any = a
    if mixed:
        ds = fastload.mix(
            {a: 0.7, fastload.open_dataset(base / "B", seed=1): 0.3}, epoch_size=len(a)
        )
    loader = fastload.DataLoader(
        ds, batch_size=BATCH, num_workers=2, collate_fn=_collate, persistent_workers=True
    )
    for _ in loader:  # epoch 0: untimed
        pass
    loader.set_epoch(1)
    start = time.perf_counter()
    samples = sum(loader)
    seconds = time.perf_counter() - start
    # CPU time per sample in the main process (no workers): what a busy machine cannot blur.
    inline = fastload.DataLoader(ds, batch_size=BATCH, collate_fn=_collate)
    inline.set_epoch(2)
    cpu = time.process_time()
    rows = sum(inline)
    cpu_us = (time.process_time() - cpu) / rows * 1e6
    return {
        "samples": samples,
        "seconds": seconds,
        "cpu_us": cpu_us,
        "plan_us": _planning_us(ds, len(ds) // BATCH),
    }


def child_tokens(base: Path, mixed: bool) -> dict[str, float]:
    import fastload
    from fastload.loader.tokens._dataset import open_tokens
    from fastload.loader.tokens._loader import TokenLoader

    warm(p for d in ("TA", "TB") for p in (base / d).rglob("*") if p.is_file())
    a = open_tokens(str(base / "TA"), SEQ, seed=0)
    source: Any = a
    if mixed:
        b = open_tokens(str(base / "TB"), SEQ, seed=1)
        source = fastload.mix({a: 0.7, b: 0.3}, epoch_size=len(a))
    loader = TokenLoader(source, TOKEN_BATCH, rank=0, world_size=1)
    for _ in loader:  # epoch 0: untimed
        pass
    loader.set_epoch(1)
    start, cpu = time.perf_counter(), time.process_time()
    tokens = sum(batch["input_ids"].shape[0] * (SEQ + 1) for batch in loader)
    seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    return {"tokens": tokens, "seconds": seconds, "cpu_us": cpu_s / (tokens / (SEQ + 1)) * 1e6}


def run_contender(kind: str, base: Path) -> dict[str, float]:
    what, _, variant = kind.partition("-")
    fn = child_samples if what == "samples" else child_tokens
    return fn(base, variant == "mix")


_TABLE = Table(
    ("contender", 16),
    ("rate", 12),
    ("mix/single", 10),
    ("CPU us/row", 10),
    ("CPU single/mix", 14),
    ("plan us/batch", 13),
)


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if key in r and "error" not in r]
    return float(np.median(values)) if values else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="fastload.mix overhead benchmark")
    parser.add_argument("--quick", action="store_true", help="a quarter of the data, 2 rounds")
    parser.add_argument("--rounds", type=int, help="alternating rounds (default 3, quick 2)")
    parser.add_argument("--root", default=str(DEFAULT_ROOT), help="corpus directory")
    parser.add_argument("--json", help="write results as JSON here")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, base = args.child
        emit_result(run_contender(kind, Path(base)))
        return 0
    rounds = args.rounds or (2 if args.quick else 3)
    base = ensure_corpus(Path(args.root), args.quick)
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in CONTENDERS}
    for r, kind in alternating(CONTENDERS, rounds):
        res = run_child(
            [sys.executable, "-m", "benchmarks.bench_mix", "--child", kind, str(base)], timeout=900
        )
        results[kind].append(res)
        amount = "tokens" if kind.startswith("tokens") else "samples"
        unit, scale = ("Mtok/s", 1e6) if amount == "tokens" else ("k/s", 1e3)
        print_round(r, f"{kind:16s}", res, unit=unit, amount=amount, scale=scale)
    print(f"\n== fastload.mix 70/30 vs one dataset (medians of {rounds} rounds) ==")
    print(_TABLE.header())
    out: dict[str, Any] = {}
    for what, amount, unit, scale in (
        ("samples", "samples", "k/s", 1e3),
        ("tokens", "tokens", "Mtok/s", 1e6),
    ):
        single = median_rate(results[f"{what}-single"], amount)
        single_cpu = _median(results[f"{what}-single"], "cpu_us")
        for kind in (f"{what}-single", f"{what}-mix"):
            rate = median_rate(results[kind], amount)
            if rate is None:
                print(_TABLE.error(kind, results[kind][-1].get("error", "")))
                continue
            cpu, plan = _median(results[kind], "cpu_us"), _median(results[kind], "plan_us")
            print(
                _TABLE.row(
                    kind,
                    f"{rate / scale:.1f} {unit}",
                    fmt_ratio(ratio(rate, single)),
                    f"{cpu:.1f}" if cpu else "-",
                    fmt_ratio(ratio(single_cpu, cpu)),
                    f"{plan:.0f}" if plan else "-",
                )
            )
            out[kind] = {"rate": rate, "ratio": ratio(rate, single), "cpu_us": cpu, "plan_us": plan}
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "summary": out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
