"""Local-store read throughput against a plain ``open``/``os.pread`` loop over the same files.

Run::

    .venv/bin/python -m benchmarks.bench_storage            # about a minute
    .venv/bin/python -m benchmarks.bench_storage --quick    # a few seconds
    .venv/bin/python -m benchmarks.bench_storage --json bench-output/storage.json

It writes ``--files`` files of ``--file-mib`` MiB into a temporary directory, reads them all once
so they are in the page cache, then measures in one run, alternating the two contenders in
every round (ABAB, then BABA) so that machine load affects both alike:

* whole-object reads: ``LocalStore.get(key)`` vs ``open(path, "rb").read()``;
* random-range reads of 4 KiB, 64 KiB and 1 MiB: ``LocalStore.get(key, ByteRange)`` vs
  ``os.open`` + ``os.pread`` + ``os.close`` (the plain loop that, like the store, addresses
  objects by name), and, for reference, ``os.pread`` on descriptors kept open.

Both contenders read the same (file, offset) sequence. Reported: median ops/s and MB/s over the
rounds, and the median over rounds of the per-round ratio fastload/plain (paired, so drifting
load cancels out). The goal is a ratio >= 0.95.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from fastload.storage import ByteRange, LocalStore

KiB = 1024
MiB = 1024 * KiB
MB = 1_000_000


@dataclass
class Result:
    """Measurements of one workload for one contender: seconds per batch, paired by index."""

    workload: str
    contender: str
    op_bytes: int
    ops: int = 0
    seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)

    @property
    def ops_per_s(self) -> float:
        return self.ops / sum(self.seconds)

    @property
    def mb_per_s(self) -> float:
        return self.ops * self.op_bytes / sum(self.seconds) / MB


@dataclass
class Workload:
    """One workload: the same batches of operations, timed for each contender in turn."""

    name: str
    op_bytes: int
    batches: list[Any]
    fastload: Callable[[Any], None]
    plain: Callable[[Any], None]
    reference: Callable[[Any], None] | None = None
    plain_label: str = "plain"
    results: list[Result] = field(default_factory=list)

    def measure(self, rounds: int) -> None:
        fl = Result(self.name, "fastload", self.op_bytes)
        plain = Result(self.name, self.plain_label, self.op_bytes)
        ref = Result(self.name, "pread, fds kept open (reference)", self.op_bytes)
        contenders = [(fl, self.fastload), (plain, self.plain)]
        for rnd in range(rounds):
            for b, batch in enumerate(self.batches):
                order = contenders if (rnd + b) % 2 == 0 else contenders[::-1]
                for result, fn in order:
                    _timed(fn, batch, result)
                if self.reference is not None:
                    _timed(self.reference, batch, ref)
        self.results = [fl, plain] + ([ref] if self.reference is not None else [])


def _make_files(directory: str, files: int, size: int) -> list[str]:
    block = random.Random(0).randbytes(MiB)
    keys = []
    for i in range(files):
        key = f"bench/shard-{i:06d}.bin"
        path = os.path.join(directory, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            remaining = size
            while remaining:
                n = min(remaining, len(block))
                f.write(block[:n])
                remaining -= n
        keys.append(key)
    return keys


def _warm(paths: Sequence[str]) -> None:
    for path in paths:
        with open(path, "rb") as f:
            while f.read(8 * MiB):
                pass


def _timed(fn: Callable[[Any], None], batch: Any, result: Result) -> None:
    cpu = time.thread_time()
    start = time.perf_counter()
    fn(batch)
    result.seconds.append(time.perf_counter() - start)
    result.cpu_seconds.append(time.thread_time() - cpu)
    result.ops += len(batch)


def _batches(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def run(args: argparse.Namespace) -> dict[str, object]:
    size = args.file_mib * MiB
    directory = tempfile.mkdtemp(prefix="fastload-bench-", dir=args.dir)
    fds: list[int] = []
    try:
        t0 = time.perf_counter()
        keys = _make_files(directory, args.files, size)
        store = LocalStore(directory)
        paths = [os.path.join(directory, k) for k in keys]
        _warm(paths)
        fds.extend(os.open(p, os.O_RDONLY) for p in paths)
        setup_s = time.perf_counter() - t0
        rng = random.Random(args.seed)

        def fl_whole(batch: list[tuple[str, str]]) -> None:
            get = store.get
            for key, _ in batch:
                get(key)

        def plain_whole(batch: list[tuple[str, str]]) -> None:
            for _, path in batch:
                with open(path, "rb") as f:
                    f.read()

        order = list(zip(keys, paths))
        rng.shuffle(order)
        workloads = [
            Workload(
                "whole object",
                size,
                _batches(order, max(1, (64 * MiB) // size)),
                fl_whole,
                plain_whole,
                plain_label="plain open().read()",
            )
        ]
        for length in (4 * KiB, 64 * KiB, 1 * MiB):
            ops = min(args.max_ops, max(1, int(args.range_mb * MB // length)))
            picks = [(rng.randrange(len(keys)), rng.randrange(size - length)) for _ in range(ops)]
            jobs = [(keys[i], ByteRange(off, off + length), paths[i], i, off) for i, off in picks]

            def fl_ranges(batch: list[tuple[str, ByteRange, str, int, int]]) -> None:
                get = store.get
                for key, byte_range, _, _, _ in batch:
                    get(key, byte_range)

            def plain_ranges(
                batch: list[tuple[str, ByteRange, str, int, int]], n: int = length
            ) -> None:
                pread, osopen, close, flags = os.pread, os.open, os.close, os.O_RDONLY
                for _, _, path, _, off in batch:
                    fd = osopen(path, flags)
                    try:
                        pread(fd, n, off)
                    finally:
                        close(fd)

            def fd_ranges(
                batch: list[tuple[str, ByteRange, str, int, int]], n: int = length
            ) -> None:
                pread = os.pread
                for _, _, _, i, off in batch:
                    pread(fds[i], n, off)

            workloads.append(
                Workload(
                    f"random {length // KiB} KiB" if length < MiB else "random 1 MiB",
                    length,
                    _batches(jobs, max(1, (8 * MiB) // length) if length > 4 * KiB else 500),
                    fl_ranges,
                    plain_ranges,
                    fd_ranges,
                    plain_label="plain open+pread+close",
                )
            )

        bench_start = time.perf_counter()
        for workload in workloads:
            workload.measure(args.rounds)
        bench_s = time.perf_counter() - bench_start
        return _report(workloads, args, setup_s, bench_s)
    finally:
        for fd in fds:
            os.close(fd)
        shutil.rmtree(directory, ignore_errors=True)


def _paired_ratio(fastload: list[float], other: list[float]) -> float:
    """Median over batches of other's time / fastload's time (> 1: fastload is faster)."""
    return statistics.median(o / f for f, o in zip(fastload, other) if f > 0)


def _report(
    workloads: list[Workload], args: argparse.Namespace, setup_s: float, bench_s: float
) -> dict[str, object]:
    header = (
        f"{'workload':<14} {'contender':<34} {'ops':>7} {'ops/s':>9} {'MB/s':>7} "
        f"{'wall ratio':>10} {'cpu ratio':>10}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    ratios: dict[str, dict[str, float]] = {}
    for workload in workloads:
        fastload = workload.results[0]
        for result in workload.results:
            # Paired: the same batch, timed back to back; the median shrugs off load spikes.
            wall = _paired_ratio(fastload.seconds, result.seconds)
            cpu = _paired_ratio(fastload.cpu_seconds, result.cpu_seconds)
            if result is workload.results[1]:
                ratios[workload.name] = {"wall": wall, "cpu": cpu}
            shown = ("", "") if result is fastload else (f"{wall:.3f}", f"{cpu:.3f}")
            print(
                f"{workload.name:<14} {result.contender:<34} {result.ops:>7} "
                f"{result.ops_per_s:>9.0f} {result.mb_per_s:>7.0f} {shown[0]:>10} {shown[1]:>10}"
            )
            row = asdict(result)
            row.update(
                ops_per_s=result.ops_per_s,
                mb_per_s=result.mb_per_s,
                batches=len(result.seconds),
                ratio_wall=None if result is fastload else wall,
                ratio_cpu=None if result is fastload else cpu,
            )
            rows.append(row)
    worst_wall = min(r["wall"] for r in ratios.values())
    worst_cpu = min(r["cpu"] for r in ratios.values())
    batches = ", ".join(f"{w.name}: {len(w.results[0].seconds)}" for w in workloads)
    print(
        "\nratio = median over paired batches (same operations, back to back, order alternating)"
        "\n        of (contender's time / fastload's time); > 1 means fastload is faster."
        "\n        wall: elapsed time; cpu: this thread's CPU time (robust on a loaded machine)."
        f"\nbatches: {batches}"
        f"\nGoal >= 0.95 against the plain loops. Worst: wall {worst_wall:.3f}, "
        f"cpu {worst_cpu:.3f}. Setup {setup_s:.1f} s, measurement {bench_s:.1f} s, "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs."
    )
    return {
        "benchmark": "storage.local_reads",
        "files": args.files,
        "file_mib": args.file_mib,
        "rounds": args.rounds,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg()[0],
        "ratios_vs_plain": ratios,
        "worst_ratio_wall": worst_wall,
        "worst_ratio_cpu": worst_cpu,
        "results": rows,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_storage", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--files", type=int, default=64, help="number of files (default 64)")
    parser.add_argument("--file-mib", type=int, default=16, help="file size in MiB (default 16)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="passes over every workload (default 3)"
    )
    parser.add_argument(
        "--range-mb",
        type=float,
        default=1000,
        help="MB read per pass per range size (default 1000; ops capped by --max-ops)",
    )
    parser.add_argument(
        "--max-ops", type=int, default=30_000, help="cap on ops per pass per range size"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dir", default=None, help="where to create the temporary files")
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.files, args.file_mib, args.rounds = 16, 8, 3
        args.range_mb, args.max_ops = 200, 8_000
    if args.files < 1 or args.file_mib < 2 or args.rounds < 1:
        parser.error("need --files >= 1, --file-mib >= 2 and --rounds >= 1")
    report = run(args)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
