"""The growth study of issue 17: how each cost grows with the dataset, fitted as log-log slopes.

Eight kinds of series, each at two or three sizes, every measurement in a fresh child process
(:func:`benchmarks._harness.run_child`), through the public API only, so that the same script
measures the code as it is changed:

1. ``convert-dry-run``: ``fastload convert --dry-run`` of a JSONL file of N small records (the
   CLI in a grandchild; its peak RSS from ``getrusage(RUSAGE_CHILDREN)``) and its wall time;
2. ``epoch``: samples/s of a shuffled epoch (``open_dataset`` + ``DataLoader``, batch 256, 2
   workers; at most 200,000 samples timed) over LMDB datasets of ~16-byte samples in shards of
   a fixed sample count, so that the shard count grows with N;
3. ``state-dict``: ``DataLoader.state_dict()`` time against the shard count, on a synthetic
   manifest listing N tiny shards (``state_dict`` reads no shard): the median of the calls after
   the first, the first call, and ``load_state_dict`` on a fresh loader (its first call);
4. ``epoch-order``: ``EpochOrder`` construction time and ``tracemalloc`` peak against the
   samples (shards of 100,000);
5. ``verify``: ``verify_dataset`` samples/s against the shard count (WebDataset shards of 10
   samples; default workers);
6. ``convert-first-shard``: seconds from the start of ``fastload convert`` of a JSONL file of N
   small records (TFRecord, ``--shard-samples 10000 --workers 2``; the CLI in a grandchild) until
   its first shard is committed (its done record is there), and the converting process's peak RSS
   then; the conversion is then killed (the rest is not measured).
7. ``shards-lmdb``, ``shards-tfrecord``, ``shards-webdataset``: samples/s of one whole shuffled
   epoch (start-up included; batch 256, 2 workers) over the same 10^6 ~16-byte samples
   (``--quick``: 10^5) cut into 10, 100 and 1,000 shards: the shard count alone grows, so every
   per-shard cost (opening, index parsing, the reader LRU's reopening) shows in the slope.
8. ``epoch-1e8-lmdb``, ``epoch-1e8-tfrecord``: the issue's point, 10^6 and 10^8 ~16-byte samples
   in shards of 10^5 (10 and 1,000 shards), written straight with the shard writers
   (:mod:`benchmarks._scale_1e8`): samples/s over the first 960,000 samples at both sizes, at
   10^8 also over the 2,000,000 after them, an epoch-rate estimate, CPU per sample, start-up,
   first batch, and each worker's descriptors and mappings at the end. (WebDataset at 10^8
   samples would take 205 GB: a tar member costs >= 1 KiB.)

Every child starts with no parsed index files (``FASTLOAD_INDEX_DIR`` set to an empty temporary
directory: each run parses and writes its indexes, as a first run on a machine does); set
``FASTLOAD_INDEX_DIR`` to share one directory across the children (runs after the first).

For each series the table gives the figure at each size and the slope ``k`` between consecutive
sizes, ``log(f2 / f1) / log(n2 / n1)``: 0 is flat, 1 linear in the size (for a rate, -1 means
the rate halves when the size doubles). The datasets are built once under
``$FASTLOAD_BENCH_ROOT/scale`` (default ``/tmp/fastload-bench/scale``) and reused.

Each size is measured ``--rounds`` times (default 1), sizes alternating within a round; the
table gives the medians.

Run: ``python -m benchmarks.bench_scale [--quick] [--rounds R] [--only SERIES,...] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._harness import REPO, Table, alternating, emit_result, run_child, time_batches
from benchmarks._scale_1e8 import build_sixteen, child_epoch_1e8
from benchmarks.corpus import DEFAULT_ROOT

ROOT = Path(DEFAULT_ROOT) / "scale"
#: Samples per shard of the ``epoch`` datasets (``--quick``: 10,000).
EPOCH_SHARD = 100_000
#: Samples timed in each ``epoch`` run, at most (after the harness's warm-up batches;
#: ``--quick``: 50,000).
EPOCH_SAMPLES = 200_000
#: Samples of the ``shards-*`` datasets (``--quick``: 10^5).
SHARDS_SAMPLES = 10**6
#: Formats of the ``shards-*`` series.
SHARDS_FORMATS = ("lmdb", "tfrecord", "webdataset")
#: Formats of the ``epoch-1e8-*`` series (WebDataset: ~200 GB at 10^8 samples, see README).
E8_FORMATS = ("lmdb", "tfrecord")
#: Samples per shard of the ``epoch-1e8-*`` datasets; samples timed from the start at every size
#: (the 10^6 epoch less 40,000: its workers must still be alive for their footprints); then,
#: where the epoch is long enough, samples timed after those (the steady rate) (``--quick``:
#: 10^3, 9,000 and 20,000).
E8_SHARD, E8_TIMED, E8_LATER = 10**5, 960_000, 2_000_000
#: Samples per shard of the ``verify`` datasets.
VERIFY_SHARD = 10
#: ``state_dict()`` calls timed per run (the median is reported).
STATE_DICT_CALLS = 21
#: Seconds before a child is killed.
CHILD_TIMEOUT = 900


@dataclass(frozen=True)
class Series:
    """One growth series: its sizes, what one child measures, and how the figures read."""

    name: str
    what: str  # the size's unit, e.g. "records"
    sizes: tuple[int, ...]
    quick: tuple[int, ...]
    figures: tuple[tuple[str, str], ...]  # (result key, column title)


SERIES = (
    Series(
        "convert-dry-run",
        "records",
        (10**4, 10**5, 10**6),
        (10**4, 10**5),
        (("peak_rss_mb", "peak RSS MB"), ("seconds", "wall s")),
    ),
    Series(
        "epoch",
        "samples",
        (10**6, 10**7),
        (10**5, 10**6),
        (("samples_per_s", "samples/s"), ("shards", "shards")),
    ),
    Series(
        "state-dict",
        "shards",
        (10, 10**3, 10**5),
        (10, 10**3, 10**4),
        (("ms", "ms/call"), ("first_ms", "1st call ms"), ("load_ms", "load ms")),
    ),
    Series(
        "epoch-order",
        "samples",
        (10**6, 10**7, 10**8),
        (10**6, 10**7),
        (("seconds", "build s"), ("peak_mb", "peak MB"), ("kept_mb", "kept MB")),
    ),
    Series(
        "verify",
        "shards",
        (10**3, 10**4),
        (10**2, 10**3),
        (("samples_per_s", "samples/s"),),
    ),
    Series(
        "convert-first-shard",
        "records",
        (10**5, 10**6, 10**7),
        (10**5, 10**6),
        (("first_s", "1st shard s"), ("rss_mb", "RSS MB then")),
    ),
    *(
        Series(
            f"shards-{fmt}",
            "shards",
            (10, 100, 1000),
            (10, 100, 1000),
            (("samples_per_s", "samples/s"), ("total_seconds", "epoch s")),
        )
        for fmt in SHARDS_FORMATS
    ),
    *(
        Series(
            f"epoch-1e8-{fmt}",
            "samples",
            (10**6, 10**8),
            (10**4, 10**6),
            (
                ("samples_per_s", "samples/s"),
                ("later_per_s", "later /s"),
                ("epoch_per_s", "epoch /s est"),
                ("cpu_us", "CPU us/smp"),
                ("later_cpu_us", "later CPU us"),
                ("startup_s", "start-up s"),
                ("first_batch_s", "1st batch s"),
                ("fds", "fds/worker"),
                ("data_map_mb", "mapped MB"),
                ("data_rss_mb", "mapped RSS"),
                ("anon_mb", "anon MB"),
            ),
        )
        for fmt in E8_FORMATS
    ),
)


# ---- datasets (built once, reused) --------------------------------------------------------------


def _jsonl(path: Path, n: int, text: Callable[[int], str]) -> Path:
    """A JSONL file of ``n`` records ``{"cls": i % 10, "txt": text(i)}``, written once."""
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        with tmp.open("w") as f:
            for i in range(n):
                f.write(json.dumps({"cls": i % 10, "txt": text(i)}) + "\n")
        tmp.rename(path)
    return path


def _converted(name: str, src: Path, *, fmt: str, shard_samples: int) -> Path:
    """``src`` converted once to ``ROOT/name`` (the manifest's presence marks it complete)."""
    dst = ROOT / name
    if not (dst / "fastload.json").exists():
        cli = [sys.executable, "-m", "fastload.cli", "convert", str(src), str(dst)]
        options = ["--format", fmt, "--shard-samples", str(shard_samples), "--workers", "2"]
        subprocess.run(
            [*cli, *options, "--quiet", "--overwrite"],
            cwd=REPO,
            check=True,
        )
    return dst


def _sixteen(i: int) -> str:
    return f"{i:016d}"


def prepare(series: Series, n: int, quick: bool) -> list[str]:
    """The child's arguments for size ``n`` of ``series``, building its input when needed."""
    ROOT.mkdir(parents=True, exist_ok=True)
    if series.name in ("convert-dry-run", "convert-first-shard"):
        return [str(_jsonl(ROOT / f"records-{n}.jsonl", n, lambda i: f"record number {i}"))]
    if series.name == "epoch":
        shard, timed = (10_000, 50_000) if quick else (EPOCH_SHARD, EPOCH_SAMPLES)
        src = _jsonl(ROOT / f"sixteen-{n}.jsonl", n, _sixteen)
        root = _converted(f"epoch-lmdb-{n}-{shard}", src, fmt="lmdb", shard_samples=shard)
        return [str(root), str(min(n, timed))]
    if series.name.startswith("shards-"):
        fmt, total = series.name.removeprefix("shards-"), 10**5 if quick else SHARDS_SAMPLES
        src = _jsonl(ROOT / f"sixteen-{total}.jsonl", total, _sixteen)
        root = _converted(f"shards-{fmt}-{n}x{total // n}", src, fmt=fmt, shard_samples=total // n)
        return [str(root), str(total)]
    if series.name.startswith("epoch-1e8-"):
        fmt = series.name.removeprefix("epoch-1e8-")
        shard, timed, later = (10**3, 9_000, 20_000) if quick else (E8_SHARD, E8_TIMED, E8_LATER)
        root = build_sixteen(ROOT / f"sixteen-{fmt}-{n}-{shard}", fmt, n, shard)
        return [str(root), str(timed), str(later if n > 2 * (timed + later) else 0)]
    if series.name == "verify":
        src = _jsonl(ROOT / f"sixteen-{n * VERIFY_SHARD}.jsonl", n * VERIFY_SHARD, _sixteen)
        name = f"verify-wds-{n}x{VERIFY_SHARD}"
        return [str(_converted(name, src, fmt="webdataset", shard_samples=VERIFY_SHARD))]
    return []


# ---- children: one measurement each ----------------------------------------------------------------


def child_convert_dry_run(n: int, src: str) -> dict[str, Any]:
    out = ROOT / f"dry-run-out-{os.getpid()}"
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "fastload.cli", "convert", src, str(out), "--dry-run", "--quiet"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"}
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux
    return {"peak_rss_mb": peak_kib * 1024 / 1e6, "seconds": seconds}


def child_convert_first_shard(n: int, src: str) -> dict[str, Any]:
    out = ROOT / f"first-shard-out-{os.getpid()}"
    cli = [sys.executable, "-m", "fastload.cli", "convert", src, str(out), "--quiet"]
    options = ["--format", "tfrecord", "--shard-samples", "10000", "--workers", "2"]
    done = out / "_fastload_convert" / "done"
    t0 = time.perf_counter()
    proc = subprocess.Popen([*cli, *options], cwd=REPO, start_new_session=True)
    first = rss = None
    try:
        while proc.poll() is None and first is None:
            status = Path(f"/proc/{proc.pid}/status").read_text()
            rss = int(status.split("VmHWM:")[1].split()[0]) * 1024 / 1e6
            if done.is_dir() and any(done.iterdir()):
                first = time.perf_counter() - t0
            time.sleep(0.005)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        proc.wait()
        subprocess.run(["rm", "-rf", str(out)], check=False)
    if first is None:
        return {"error": f"the conversion ended (exit {proc.returncode}) before a shard was done"}
    return {"first_s": first, "rss_mb": rss}


def child_epoch(n: int, root: str, timed: str) -> dict[str, Any]:
    from fastload import DataLoader, open_dataset
    from fastload.formats import read_manifest
    from fastload.storage import open_store

    shards = len(read_manifest(open_store(root)).shards)
    loader = DataLoader(open_dataset(root, shuffle=True), batch_size=256, num_workers=2)
    result = time_batches(loader, int(timed))
    return {"samples_per_s": result["samples"] / result["seconds"], "shards": shards, **result}


def child_shards(n: int, root: str, total: str) -> dict[str, Any]:
    """One whole shuffled epoch: samples/s over its wall time, start-up included."""
    from fastload import DataLoader, open_dataset

    loader = DataLoader(open_dataset(root, shuffle=True), batch_size=256, num_workers=2)
    result = time_batches(loader, int(total))
    return {**result, "samples_per_s": int(total) / result["total_seconds"]}


def child_state_dict(n: int) -> dict[str, Any]:
    import statistics
    import tempfile

    from fastload import DataLoader, open_dataset
    from fastload.formats import Manifest, ShardEntry, write_manifest
    from fastload.storage import open_store

    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        shards = [ShardEntry(f"shard-{i:08d}.tar", 1, 1024, f"{i:064x}", None) for i in range(n)]
        write_manifest(open_store(tmp), Manifest(format="webdataset", shards=shards))
        loader = DataLoader(open_dataset(tmp, shuffle=True), batch_size=256)
        times = []
        for _ in range(STATE_DICT_CALLS):
            t0 = time.perf_counter()
            state = loader.state_dict()
            times.append(time.perf_counter() - t0)
        loads = []
        for _ in range(STATE_DICT_CALLS):
            fresh = DataLoader(open_dataset(tmp, shuffle=True), batch_size=256)
            t0 = time.perf_counter()
            fresh.load_state_dict(state)
            loads.append(time.perf_counter() - t0)
    return {
        "ms": statistics.median(times[1:]) * 1e3,
        "first_ms": times[0] * 1e3,
        "load_ms": statistics.median(loads) * 1e3,
    }


def child_epoch_order(n: int) -> dict[str, Any]:
    from fastload.loader import EpochOrder

    shard = 100_000
    sizes = [shard] * (n // shard) + ([n % shard] if n % shard else [])
    tracemalloc.start()
    t0 = time.perf_counter()
    order = EpochOrder(sizes, seed=0, epoch=0)
    seconds = time.perf_counter() - t0
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    if len(order) != n:
        return {"error": f"EpochOrder has {len(order)} positions, expected {n}"}
    return {"seconds": seconds, "peak_mb": peak / 1e6, "kept_mb": kept / 1e6}


def child_verify(n: int, root: str) -> dict[str, Any]:
    from fastload.convert import verify_dataset

    t0 = time.perf_counter()
    report = verify_dataset(root)
    seconds = time.perf_counter() - t0
    if not report.ok:
        return {"error": f"verify found problems: {report.problems[:1]}"}
    return {"samples_per_s": report.samples_read / seconds, "seconds": seconds}


CHILDREN: dict[str, Callable[..., dict[str, Any]]] = {
    "convert-dry-run": child_convert_dry_run,
    "epoch": child_epoch,
    "state-dict": child_state_dict,
    "epoch-order": child_epoch_order,
    "verify": child_verify,
    "convert-first-shard": child_convert_first_shard,
    **{f"shards-{fmt}": child_shards for fmt in SHARDS_FORMATS},
    **{f"epoch-1e8-{fmt}": child_epoch_1e8 for fmt in E8_FORMATS},
}


# ---- the parent -------------------------------------------------------------------------------------


def slope(n1: int, f1: float, n2: int, f2: float) -> float | None:
    """The log-log slope between ``(n1, f1)`` and ``(n2, f2)``; ``None`` where a figure is 0."""
    if f1 <= 0 or f2 <= 0:
        return None
    return math.log(f2 / f1) / math.log(n2 / n1)


def _child_env(fresh: str) -> dict[str, str]:
    """A child's environment: parsed index files (``fastload/formats/_cache/_files.py``) in the
    empty directory ``fresh``, so that every run parses its indexes as a first run on the machine
    does (the slower case), unless ``FASTLOAD_INDEX_DIR`` is set (then the children share it:
    set it to measure runs after the first)."""
    env = dict(os.environ)
    env.setdefault("FASTLOAD_INDEX_DIR", fresh)
    return env


def run_series(series: Series, quick: bool, rounds: int = 1) -> dict[str, Any]:
    """Measure ``series`` at each size (in a fresh child each, sizes alternating over ``rounds``)
    and print its table of medians."""
    sizes = series.quick if quick else series.sizes
    print(f"== {series.name}: {series.what} {', '.join(f'{n:,}' for n in sizes)} ==", flush=True)
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in sizes}
    argv: dict[int, list[str] | str] = {}
    for n in sizes:
        try:
            argv[n] = prepare(series, n, quick)
        except subprocess.CalledProcessError as exc:
            argv[n] = f"building the input failed: {exc}"
    for r, n in alternating(sizes, rounds):
        args = argv[n]
        if isinstance(args, str):
            runs[n].append({"error": args})
            continue
        cmd = [sys.executable, "-m", "benchmarks.bench_scale", "--child", series.name, str(n)]
        with tempfile.TemporaryDirectory(prefix="fastload-index-files-") as fresh:
            runs[n].append(run_child(cmd + args, timeout=CHILD_TIMEOUT, env=_child_env(fresh)))
        if rounds > 1:
            figure = runs[n][-1].get(series.figures[0][0], 0.0)
            print(f"  round {r} {n:,}: {_fmt(figure)} (load {os.getloadavg()[0]:.1f})", flush=True)
    rows = [{"size": n, **_median(runs[n], series)} for n in sizes]
    table = Table((series.what, 12), *((title, 12) for _, title in series.figures), ("k", 14))
    print(table.header())
    slopes: list[dict[str, Any]] = []
    previous: dict[str, Any] | None = None
    for row in rows:
        if "error" in row:
            print(table.error(f"{row['size']:,}", row["error"]))
            previous = None
            continue
        cells = [_fmt(row[key]) for key, _ in series.figures]
        k = ""
        if previous is not None:
            first = series.figures[0][0]
            ks = slope(previous["size"], previous[first], row["size"], row[first])
            slopes.append({"from": previous["size"], "to": row["size"], first: ks})
            k = "-" if ks is None else f"{ks:+.2f}"
        print(table.row(f"{row['size']:,}", *cells, k), flush=True)
        previous = row
    if len(rows) == 2 and len(slopes) == 1 and slopes[0][series.figures[0][0]] is not None:
        ratio = rows[-1][series.figures[0][0]] / rows[0][series.figures[0][0]]
        print(f"{rows[-1]['size']:,} / {rows[0]['size']:,}: {ratio:.2f}x")
    print()
    return {"what": series.what, "rows": rows, "slopes": slopes, "runs": runs}


def _median(runs: list[dict[str, Any]], series: Series) -> dict[str, Any]:
    """The per-figure medians of ``runs`` (the first error if any run failed)."""
    import statistics

    for run in runs:
        if "error" in run:
            return run
    out = dict(runs[0])
    for key, _ in series.figures:
        out[key] = statistics.median(run[key] for run in runs)
    return out


def _fmt(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="the smallest sizes only")
    parser.add_argument("--only", help="comma-separated series (default: all)")
    parser.add_argument("--rounds", type=int, default=1, help="runs per size (medians)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        name, n, *rest = args.child
        emit_result(CHILDREN[name](int(n), *rest))
        return 0
    names = {s.name for s in SERIES}
    only = set(args.only.split(",")) if args.only else names
    if only - names:
        parser.error(f"unknown series {sorted(only - names)}; known: {sorted(names)}")
    print(
        f"bench_scale{' --quick' if args.quick else ''}: {os.cpu_count()} CPUs, "
        f"load {os.getloadavg()[0]:.1f}; k = log-log slope of the first figure between sizes",
        flush=True,
    )
    results = {s.name: run_series(s, args.quick, args.rounds) for s in SERIES if s.name in only}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    failed = any("error" in row for r in results.values() for row in r["rows"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
