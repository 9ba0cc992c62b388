"""The same conversion with the local pool, Ray and Spark: each engine's overhead, as a ratio.

A JSONL corpus (``--records``, default 200,000 records of ~60 bytes; ``--quick`` 50,000) is
converted to WebDataset shards of ``--shard-samples`` samples (default 5,000) in a local
directory by five contenders, each in a fresh process, in alternating order each round:

* ``pool``: ``convert(..., workers=2)``, the local executor (2 forked worker processes);
  fastload is imported before the clock starts, in every contender;
* ``ray``: ``convert(..., executor="ray")`` on a Ray runtime the child starts first
  (``ray.init(num_cpus=2)``) and does not count: the engine's per-shard cost (task submission,
  a worker process per CPU, pickled jobs and results through Ray's object store);
* ``ray+init``: the same with the runtime's start counted (what ``fastload convert --executor
  ray`` costs on one machine without a running cluster);
* ``spark``: ``convert(..., executor="spark")`` on a ``local[2]`` Spark application the child
  starts first (and runs one task in, so a Python worker is up) and does not count: one Spark
  job of one task per shard, submitted from driver threads, pickled jobs and results through
  the JVM;
* ``spark+init``: the same with the application's start counted (the JVM's start and Spark's
  set-up: what ``fastload convert --executor spark`` costs on one machine).

Every contender's output is compared with the first ``pool`` run's, byte for byte (a mismatch
is an error). The table gives the median wall time and each contender's ratio to ``pool``
(>1: slower), and the median seconds the engine took to start (counted only by the ``+init``
contenders). Run: ``python -m benchmarks.bench_convert_ray [--quick] [--rounds N]``.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._harness import (
    Table,
    alternating,
    emit_result,
    fmt_ratio,
    ok_runs,
    print_round,
    ratio,
    run_child,
)

CONTENDERS = ("pool", "ray", "ray+init", "spark", "spark+init")


def child(kind: str, src: str, dst: str, shard_samples: int) -> None:
    """Convert ``src`` into ``dst`` with ``kind``; emit the seconds and samples (fastload's
    import is not counted, the engine's start only for ``ray+init`` and ``spark+init``)."""
    from fastload.convert import convert

    start = time.perf_counter()
    options: dict[str, Any] = {"workers": 2}
    engine_start = 0.0
    if kind.startswith("ray"):
        import ray

        ray.init(num_cpus=2, address="local", include_dashboard=False, configure_logging=False)
        if kind == "ray":
            ray.get(ray.remote(lambda: None).remote())  # a worker process is up
        engine_start = time.perf_counter() - start
        if kind == "ray":
            start = time.perf_counter()
        options = {"executor": "ray"}
    elif kind.startswith("spark"):
        import pyspark

        from fastload.convert._spark import spark_conf, start_context

        conf = spark_conf(pyspark, "local[2]").set("spark.ui.enabled", "false")
        sc = start_context(pyspark, conf)
        sc.setLogLevel("ERROR")
        engine_start = time.perf_counter() - start
        if kind == "spark":
            sc.parallelize([0], 1).map(lambda x: x).collect()  # a Python worker is up
            start = time.perf_counter()
        options = {"executor": "spark"}
    result = convert(src, dst, shard_samples=shard_samples, quiet=True, **options)
    seconds = time.perf_counter() - start
    emit_result(
        {
            "seconds": seconds,
            "samples": result.num_samples,
            "shards": result.num_shards,
            "engine_start_s": engine_start,
        }
    )


def _same_tree(a: Path, b: Path) -> bool:
    names = sorted(p.relative_to(a) for p in a.rglob("*"))
    if names != sorted(p.relative_to(b) for p in b.rglob("*")):
        return False
    return all(filecmp.cmp(a / n, b / n, shallow=False) for n in names if (a / n).is_file())


def main() -> None:
    """Run the benchmark (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="50,000 records")
    parser.add_argument("--records", type=int, default=None)
    parser.add_argument("--shard-samples", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--contenders", default=",".join(CONTENDERS), help="a comma-separated subset, pool first"
    )
    parser.add_argument("--child", nargs=3, metavar=("KIND", "SRC", "DST"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child, shard_samples=args.shard_samples)
        return
    records = args.records or (50_000 if args.quick else 200_000)
    work = Path(tempfile.mkdtemp(prefix="bench-convert-engines-"))
    try:
        src = work / "src.jsonl"
        with src.open("w") as f:
            for i in range(records):
                f.write(json.dumps({"i": i, "text": "x" * (i * 7 % 80)}) + "\n")
        print(f"{records} records, {src.stat().st_size / 1e6:.1f} MB; load {os.getloadavg()}")
        contenders = tuple(args.contenders.split(","))
        if contenders[0] != "pool" or not set(contenders) <= set(CONTENDERS):
            parser.error(f"--contenders: pool first, then any of {CONTENDERS}")
        runs: dict[str, list[dict[str, float]]] = {k: [] for k in contenders}
        reference: Path | None = None
        for n, (round_no, kind) in enumerate(alternating(contenders, args.rounds)):
            dst = work / f"out-{n}"
            argv = [sys.executable, "-m", "benchmarks.bench_convert_engines", "--child", kind]
            argv += [str(src), str(dst), "--shard-samples", str(args.shard_samples)]
            result = run_child(argv, timeout=600)
            if "error" not in result:
                if reference is None and kind == "pool":
                    reference = dst
                elif reference is not None and not _same_tree(reference, dst):
                    result = {"error": f"output differs from the pool's ({dst})"}
            print_round(round_no, kind, result)
            runs[kind].append(result)
            if dst != reference:
                shutil.rmtree(dst, ignore_errors=True)
        table = Table(
            ("contender", 10), ("median s", 9), ("vs pool", 8), ("start s", 8), ("runs", 5)
        )
        print(table.header())
        medians = {
            k: statistics.median(r["seconds"] for r in ok_runs(v)) if ok_runs(v) else None
            for k, v in runs.items()
        }
        for kind in contenders:
            value = medians[kind]
            if value is None:
                table_row = table.error(kind, "no successful run")
            else:
                ok = ok_runs(runs[kind])
                started = statistics.median(r.get("engine_start_s", 0.0) for r in ok)
                cells = (f"{value:.2f}", fmt_ratio(ratio(value, medians["pool"])))
                table_row = table.row(kind, *cells, f"{started:.2f}", str(len(ok)))
            print(table_row)
        print(f"load after: {os.getloadavg()}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
