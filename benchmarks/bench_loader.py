"""Loader benchmark on the W1 corpus: fastload against its peers, side by side in one run.

Two workloads, 2 loader workers each (see issue 5 and /work/shared/BENCHMARKS.md):

* **bytes**: raw JPEG bytes + integer label, batch 256, shuffled. fastload delivers the bytes as
  its default :class:`~fastload.loader.PackedBytes` (one shared-memory buffer per batch);
  ``fastload-list`` collates them into a list of ``bytes`` like the peers. Peers: a plain
  ``torch.utils.data.DataLoader`` over the loose files (the baseline), the webdataset library over
  the same tar shards fastload reads, litdata and mosaicml-streaming (optional, from
  ``.venv-bench``). Reference: the warm page-cache read bandwidth of the same shard bytes.
* **train**: decode + random-resized-crop 224 + horizontal flip + normalize to float, batch 64.
  Peers: torch DataLoader + PIL over the loose files, webdataset + PIL, litdata/mosaicml + PIL
  (optional), and the DALI CPU pipeline with fused crop-while-decoding
  (``fn.decoders.image_random_crop`` over ``fn.readers.file``, 2 threads) as the reference.
  Reference: the single-core decode+augment rate of fastload's fused transform, x 2 (the 2-core
  limit), measured in the same run.

**Every loader runs one whole epoch of the corpus** (10,000 images by default; ``--quick`` 2,000,
and then its header and JSON say ``QUICK RUN``) in a fresh subprocess (children:
:mod:`benchmarks._loader_children`), data in the warm page cache. Reported per loader, medians
over rounds: the **epoch rate** (samples over the time from the loader's creation to its last
batch: start-up included, what a training job gets), the **steady rate** (after batch 2), the
**first-batch time**, and the **CPU time per sample** of the loader process and its workers over
the epoch (steadier than wall time when other jobs share the cores). Ratios are on the epoch rate,
with the steady-rate ratio beside the goal ratios. Loaders alternate round by round (ABAB, BABA).
The train workload's slow PIL peers (webdataset, litdata, mosaic + PIL: ~400 img/s, 25 s an epoch
each) run ``--pil-rounds`` rounds (default 1) so that the default run fits in ~15 minutes on
2 cores; torch + PIL, the PIL baseline, runs every round.

Run: ``.venv/bin/python -m benchmarks.bench_loader [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._harness import (
    PEERS_PYTHON,
    REPO,
    Table,
    alternating,
    fmt_ratio,
    median_of,
    median_rate,
    print_round,
    ratio,
    run_child,
    run_label,
)
from benchmarks._loader_children import CHILDREN, WORKERS, transforms_comparison
from benchmarks.corpus import DEFAULT_ROOT, Corpus, ensure_corpus

#: Loader kinds that run in the peers' interpreter (they do not install beside fastload).
PEER_KINDS = frozenset({"litdata", "mosaic"})
#: The train workload's peers that decode with PIL ("vs best PIL peer").
PIL_PEERS = ("torch", "webdataset", "litdata", "mosaic")
#: The slow PIL peers that run ``--pil-rounds`` rounds in the train workload.
SLOW_PIL_PEERS = frozenset({"webdataset", "litdata", "mosaic"})

# ---------------------------------------------------------------------------------------------
# Preparation of the peers' copies of the corpus
# ---------------------------------------------------------------------------------------------


_PREP_MDS = """
import sys
from pathlib import Path
from streaming import MDSWriter
from benchmarks.corpus import Corpus

root, count, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with MDSWriter(out=out, columns={"jpg": "bytes", "cls": "int"}, size_limit="64mb") as w:
    for path, label in Corpus(Path(root), count).files():
        w.write({"jpg": Path(path).read_bytes(), "cls": label})
"""


def _lit_item(entry: tuple[str, int]) -> dict[str, Any]:
    """litdata ``optimize`` item function (module level, so its worker processes can import it)."""
    path, label = entry
    return {"jpg": Path(path).read_bytes(), "cls": label}


def prep_litdata(root: str, count: int, out: str) -> None:
    """Write the corpus with ``litdata.optimize`` (runs in .venv-bench)."""
    import litdata

    files = Corpus(Path(root), count).files()
    litdata.optimize(fn=_lit_item, inputs=files, output_dir=out, chunk_bytes="64MB", num_workers=2)
    index = json.loads((Path(out) / "index.json").read_text())
    if not index.get("chunks"):  # litdata can exit 0 having written nothing
        raise RuntimeError(f"litdata.optimize wrote no chunks to {out}")


def _prepare_peer(kind: str, corpus: Corpus) -> tuple[Path | None, str]:
    """Convert the corpus for litdata / mosaicml-streaming in .venv-bench; (path, why not)."""
    if not Path(PEERS_PYTHON).exists():
        return None, f"{PEERS_PYTHON} missing: build it with tools/bench-env.sh"
    dst = corpus.root.parent / f"{corpus.root.name}-{kind}-{corpus.count}"
    done = dst.parent / f".{dst.name}.complete"
    if done.exists():
        return dst, ""
    if kind == "litdata":
        cmd = [PEERS_PYTHON, "-m", "benchmarks.bench_loader", "--prep-litdata"]
    else:
        cmd = [PEERS_PYTHON, "-c", _PREP_MDS]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [*cmd, str(corpus.root), str(corpus.count), str(dst)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=900,
    )
    if proc.returncode != 0:
        return None, f"{kind} conversion failed: {proc.stderr.strip().splitlines()[-1:]}"
    done.write_text("ok")
    print(f"prepared {kind} in {time.perf_counter() - t0:.1f} s: {dst}")
    return dst, ""


# ---------------------------------------------------------------------------------------------
# Parent: alternating rounds, report
# ---------------------------------------------------------------------------------------------


def _plans(cfg: dict[str, Any], workloads: list[str], quick: bool) -> dict[str, list[Any]]:
    """Per workload: ``(name, child spec)`` of each contender, in round order."""

    def spec(kind: str, c: dict[str, Any], workload: str, variant: str = "") -> dict[str, Any]:
        return {"kind": kind, "workload": workload, "variant": variant, "cfg": c}

    plans: dict[str, list[Any]] = {}
    if "bytes" in workloads:
        b = {**cfg, "batch": 256}
        plans["bytes"] = [
            ("pagecache", spec("pagecache", b, "")),
            ("fastload", spec("fastload", b, "bytes")),
            ("fastload-list", spec("fastload", b, "bytes", "list")),
            *((k, spec(k, b, "bytes")) for k in ("torch", "webdataset", "litdata", "mosaic")),
        ]
    if "train" in workloads:
        t = {**cfg, "batch": 64}
        singles = ["fused", "pil"]
        if not quick:
            singles += ["fused-float", "decode-pil", "decode-simplejpeg"]
        plans["train"] = [
            *((f"single-{v}", spec("single", t, "train", v)) for v in singles),
            ("fastload", spec("fastload", t, "train")),
            ("fastload-float", spec("fastload", t, "train", "float")),
            ("dali", spec("dali", t, "train")),
            *((k, spec(k, t, "train")) for k in PIL_PEERS),
        ]
    return plans


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="fastload loader benchmark (W1 images)")
    parser.add_argument("--quick", action="store_true", help="2,000 images, 2 rounds: QUICK RUN")
    parser.add_argument("--json", help="write results as JSON here")
    parser.add_argument("--count", type=int, help="corpus images (default 10000, quick 2000)")
    parser.add_argument("--rounds", type=int, help="alternating rounds (default 3, quick 2)")
    parser.add_argument(
        "--pil-rounds", type=int, default=1, help="rounds of webdataset/litdata/mosaic + PIL"
    )
    parser.add_argument("--workloads", default="bytes,train")
    parser.add_argument("--loaders", default="", help="comma-separated subset of loaders")
    parser.add_argument("--root", default=None, help=f"corpus cache (default {DEFAULT_ROOT})")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--prep-litdata", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument(
        "--transforms",
        action="store_true",
        help="only compare decoders and train transforms on one core, interleaved",
    )
    args = parser.parse_args(argv)

    if args.prep_litdata:
        root, n, out = args.prep_litdata
        prep_litdata(root, int(n), out)
        return 0

    if args.child:
        from benchmarks._harness import emit_result

        spec = json.loads(args.child)
        kwargs = {k: spec[k] for k in ("workload", "variant") if spec.get(k)}
        emit_result(CHILDREN[spec["kind"]](spec["cfg"], **kwargs))
        return 0

    quick = args.quick
    count = args.count or (2000 if quick else 10_000)
    rounds = args.rounds or (2 if quick else 3)
    corpus = ensure_corpus(count, None if args.root is None else Path(args.root) / "w1")
    if args.transforms:
        return _transforms(corpus, quick, args.json)
    folder = corpus.folder()
    nbytes = corpus.total_bytes()
    mean_kb = nbytes / count / 1e3
    label = run_label(quick, count, rounds)
    print(
        f"bench_loader: {label}; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}\n"
        f"corpus: {count} JPEGs, {nbytes / 1e6:.0f} MB, mean {mean_kb:.1f} KB at {folder}",
        flush=True,
    )
    cfg: dict[str, Any] = {
        "root": str(corpus.root),
        "folder": str(folder),
        "count": count,
        "wds": str(corpus.webdataset(shards=16, workers=WORKERS)),
        "single_n": 128 if quick else 600,
    }
    skipped: dict[str, str] = {}
    for kind, prepared in (("litdata", "litdata"), ("mosaic", "mds")):
        path, why = _prepare_peer(prepared, corpus)
        if path is None:
            skipped[kind] = why
            print(f"skipping {kind}: {why}")
        else:
            cfg[prepared] = str(path)
    try:
        import nvidia.dali  # noqa: F401
    except ImportError as exc:
        skipped["dali"] = f"nvidia-dali not importable: {exc}"

    want = {x for x in args.loaders.split(",") if x}
    plans = _plans(cfg, [w for w in args.workloads.split(",") if w], quick)
    runs = [
        (workload, name, spec)
        for workload, plan in plans.items()
        for name, spec in plan
        if (not want or name in want or spec["kind"] in want) and spec["kind"] not in skipped
    ]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {w: {} for w in plans}
    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    for r, (workload, name, spec) in alternating(runs, rounds):
        if workload == "train" and name in SLOW_PIL_PEERS and r > args.pil_rounds:
            continue
        python = PEERS_PYTHON if spec["kind"] in PEER_KINDS else sys.executable
        res = run_child(
            [python, "-m", "benchmarks.bench_loader", "--child", json.dumps(spec)], timeout=900
        )
        results[workload].setdefault(name, []).append(res)
        print_round(r, f"{workload:5s} {name:22s}", res)
    report = _report(results, mean_kb, skipped, count)
    elapsed = time.perf_counter() - t_start
    loads = (load_start, os.getloadavg()[0])
    print(f"\n{label}; load {loads[0]:.2f} -> {loads[1]:.2f}; {elapsed / 60:.1f} min")
    report["quick"] = quick
    report["label"] = label
    report["config"] = {
        "count": count,
        "rounds": rounds,
        "pil_rounds": args.pil_rounds,
        "workers": WORKERS,
        "quick": quick,
        "timing": "one whole epoch per run, from loader creation to the last batch; steady "
        "after batch 2; CPU of the process tree",
    }
    report["load_average"] = {"start": loads[0], "end": loads[1], "cpus": os.cpu_count()}
    report["elapsed_s"] = elapsed
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def _transforms(corpus: Corpus, quick: bool, json_path: str | None) -> int:
    """``--transforms``: single-core decoders and train transforms, interleaved."""
    cfg = {"root": str(corpus.root), "count": corpus.count}
    rates = transforms_comparison(cfg, 6 if quick else 20)
    base = rates["pil-rrc-float"]
    table = Table(("single core, interleaved", 30), ("img/s", 7), ("vs PIL RRC", 10))
    print(table.header())
    for name, rate in rates.items():
        print(table.row(name, f"{rate:.0f}", fmt_ratio(rate / base)))
    if json_path:
        Path(json_path).write_text(json.dumps({"single_core": rates}, indent=2))
    return 0


def _summary(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    """Medians over a contender's runs: epoch and steady rates, first batch, CPU per sample."""
    return {
        "epoch": median_rate(runs),
        "steady": median_rate(runs, "steady_samples", "steady_seconds"),
        "first_batch_s": median_of(runs, "first_batch_seconds"),
        "cpu_us": (v * 1e6 if (v := median_of(runs, "cpu_seconds", "samples")) else None),
        "steady_cpu_us": (
            v * 1e6 if (v := median_of(runs, "steady_cpu_seconds", "steady_samples")) else None
        ),
    }


def _fmt(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


_BYTES_TABLE = Table(
    ("loader", 22),
    ("epoch/s", 8),
    ("steady/s", 8),
    ("1st batch s", 11),
    ("MB/s", 5),
    ("vs torch", 8),
    ("vs best peer", 12),
    ("steady", 6),
    ("of page cache", 13),
    ("CPU us/smp", 10),
)
_TRAIN_TABLE = Table(
    ("loader", 22),
    ("epoch/s", 8),
    ("steady/s", 8),
    ("1st batch s", 11),
    ("vs DALI", 7),
    ("steady", 6),
    ("vs best PIL peer", 16),
    ("steady", 6),
    ("of 2-core limit", 15),
    ("CPU ms/img", 10),
)


def _best(rows: dict[str, dict[str, float | None]], names: Any, key: str) -> float | None:
    return max((v for k in names if k in rows and (v := rows[k][key])), default=None)


def _bytes_table(
    rows: dict[str, dict[str, float | None]], bw: float | None, errors: dict[str, str], kb: float
) -> None:
    """Print the bytes workload's table (``bw``: the page cache's read bandwidth, bytes/s)."""
    peers = [k for k in rows if not k.startswith(("fastload", "pagecache"))]
    best, best_steady = _best(rows, peers, "epoch"), _best(rows, peers, "steady")
    torch_rate = rows.get("torch", {}).get("epoch")
    print(_BYTES_TABLE.header())
    if bw:
        print(
            _BYTES_TABLE.row(
                "page cache (dd-like)", f"{bw / kb / 1e3:.0f}", "", "", f"{bw / 1e6:.0f}"
            )
        )
    for name, row in rows.items():
        rate = row["epoch"]
        if name == "pagecache":
            continue
        if rate is None:
            print(_BYTES_TABLE.error(name, errors.get(name, "")))
            continue
        ours = name.startswith("fastload")
        mbs = rate * kb / 1e3
        print(
            _BYTES_TABLE.row(
                name,
                f"{rate:.0f}",
                _fmt(row["steady"]),
                _fmt(row["first_batch_s"], ".2f"),
                f"{mbs:.0f}",
                fmt_ratio(ratio(rate, torch_rate)),
                fmt_ratio(ratio(rate, best) if ours else None),
                fmt_ratio(ratio(row["steady"], best_steady) if ours else None),
                f"{mbs * 1e6 / bw * 100:.1f}%" if bw else "-",
                _fmt(row["cpu_us"]),
            )
        )


def _train_table(rows: dict[str, dict[str, float | None]], errors: dict[str, str]) -> float | None:
    """Print the train workload's table; return the 2-core limit (img/s)."""
    single = rows.get("single-fused", {}).get("epoch")
    limit = 2 * single if single else None
    dali = rows.get("dali", {})
    best, best_steady = _best(rows, PIL_PEERS, "epoch"), _best(rows, PIL_PEERS, "steady")
    print(_TRAIN_TABLE.header())
    for name, row in rows.items():
        rate = row["epoch"]
        if rate is None:
            print(_TRAIN_TABLE.error(name, errors.get(name, "")))
            continue
        if name.startswith("single"):
            print(_TRAIN_TABLE.row(name, f"{rate:.0f}") + "   (one core, no loader)")
            continue
        print(
            _TRAIN_TABLE.row(
                name,
                f"{rate:.0f}",
                _fmt(row["steady"]),
                _fmt(row["first_batch_s"], ".2f"),
                fmt_ratio(ratio(rate, dali.get("epoch"))),
                fmt_ratio(ratio(row["steady"], dali.get("steady"))),
                fmt_ratio(ratio(rate, best)),
                fmt_ratio(ratio(row["steady"], best_steady)),
                f"{rate / limit * 100:.0f}%" if limit else "-",
                _fmt(None if row["cpu_us"] is None else row["cpu_us"] / 1e3, ".2f"),
            )
        )
    if limit:
        print(f"2-core limit (single-core fused x 2): {limit:.0f} img/s")
    return limit


def _report(
    results: dict[str, dict[str, list[dict[str, Any]]]],
    mean_kb: float,
    skipped: dict[str, str],
    count: int,
) -> dict[str, Any]:
    out: dict[str, Any] = {"skipped": skipped, "workloads": {}}
    for workload, by_name in results.items():
        if not by_name:
            continue
        rows = {name: _summary(runs) for name, runs in by_name.items()}
        errors = {n: r[-1].get("error", "") for n, r in by_name.items() if rows[n]["epoch"] is None}
        short = {
            n: sorted({r["samples"] for r in runs if "error" not in r} - {count})
            for n, runs in by_name.items()
            if n != "pagecache" and not n.startswith("single")
        }
        rounds = {n: len(r) for n, r in by_name.items()}
        print(
            f"\n== {workload}: one epoch of {count} samples per run, medians (rounds {rounds}) =="
        )
        table: dict[str, Any] = {
            "rates": {n: row["epoch"] for n, row in rows.items()},
            "steady_rates": {n: row["steady"] for n, row in rows.items()},
            "first_batch_seconds": {n: row["first_batch_s"] for n, row in rows.items()},
            "cpu_us_per_sample": {n: row["cpu_us"] for n, row in rows.items()},
            "steady_cpu_us_per_sample": {n: row["steady_cpu_us"] for n, row in rows.items()},
            "rounds": rounds,
            "errors": errors,
            "runs": by_name,
        }
        if workload == "bytes":
            bw = median_rate(by_name.get("pagecache", []), "bytes")
            table["pagecache_bytes_per_s"] = bw
            _bytes_table(rows, bw, errors, mean_kb)
        else:
            table["two_core_limit"] = _train_table(rows, errors)
        for name, counts in short.items():
            if counts:  # time_epoch stops at `count`; more than that is a batch overshoot
                print(f"note: {name} delivered {counts} samples in an epoch, not {count}")
        out["workloads"][workload] = table
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    return out


if __name__ == "__main__":
    sys.exit(main())
