"""Shard format read throughput against plain file reads, and LMDB gets against raw py-lmdb.

Generates random ~100 KB samples (``bin`` bytes + ``cls`` label) in a temporary directory, writes
them with every format that imports (``webdataset``, ``tfrecord``, ``lmdb``; a format that fails
to import is skipped with the reason), then measures in one run, alternating the contenders in
every round and reporting medians over the rounds:

* sequential read of each format's shards with fastload's reader (samples/s, MB/s of shard bytes)
  as a ratio to reading the same shard files with plain ``open().read()`` in 1 MiB chunks;
* for LMDB, the same sequential read done with raw py-lmdb + msgpack (following the format README),
  and random gets by key (:meth:`LMDBReader.get_key` vs ``txn.get`` + ``msgpack.unpackb``) and by
  position (:meth:`LMDBReader.read` vs the two raw gets the README describes).

All files sit in the page cache after writing, so this measures CPU cost per byte, not the disk;
by default the clock is this process's CPU time, so that other work on a shared machine does not
skew the ratios (``--clock wall`` for elapsed time).
Goals (issue 3): WebDataset >= 0.9x plain read, TFRecord with CRC checks >= 0.8x, LMDB >= 0.9x raw.

Run: ``python -m benchmarks.bench_formats`` (about a minute), ``--quick`` (under 15 s),
``--json PATH`` to save the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import lmdb
import msgpack
import numpy as np

from benchmarks._harness import alternating
from fastload.formats import Format, get_format
from fastload.formats.lmdb import LMDBReader
from fastload.storage import LocalStore

FORMATS = ("webdataset", "tfrecord", "lmdb")
GOALS = {"webdataset": 0.9, "tfrecord": 0.8, "lmdb": 0.9}
CHUNK = 1 << 20
POS = b"\x00fastload/pos/"
META = b"\x00fastload/meta"


@dataclass
class Written:
    """One format's shards on disk."""

    fmt: Format
    keys: list[str]
    paths: list[str]
    num_bytes: int
    write_s: float


@dataclass
class Timings:
    """Seconds per round for each contender."""

    by_name: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.by_name.setdefault(name, []).append(seconds)

    def median(self, name: str) -> float:
        return statistics.median(self.by_name[name])


def make_samples(count: int, mean_bytes: int, seed: int) -> list[dict[str, Any]]:
    """``count`` samples with random ``bin`` payloads of ``mean_bytes`` ± 20 % and a ``cls``."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(int(mean_bytes * 0.8), int(mean_bytes * 1.2) + 1, size=count)
    blob = rng.bytes(int(sizes.sum()))
    samples, offset = [], 0
    for i, size in enumerate(sizes.tolist()):
        samples.append(
            {"__key__": f"s{i:07d}", "bin": blob[offset : offset + size], "cls": i % 1000}
        )
        offset += size
    return samples


def write_format(
    store: LocalStore, name: str, samples: list[dict[str, Any]], per_shard: int
) -> Written | str:
    """Write ``samples`` as shards of ``per_shard``; return what was written, or why not."""
    try:
        fmt = get_format(name)
    except Exception as exc:  # a format still being written by someone else: report and skip
        return f"{type(exc).__name__}: {exc}"
    keys, paths, total = [], [], 0
    start = time.perf_counter()
    try:
        for n, first in enumerate(range(0, len(samples), per_shard)):
            key = f"{name}/bench-{n:06d}.{fmt.extension}"
            writer = fmt.writer(store, key)
            for sample in samples[first : first + per_shard]:
                writer.write(sample)
            info = writer.close()
            keys.append(key)
            paths.append(os.path.join(store.root, *key.split("/")))
            total += info.num_bytes
    except Exception as exc:
        return f"writing failed: {type(exc).__name__}: {exc}"
    return Written(fmt, keys, paths, total, time.perf_counter() - start)


def _must(value: bytes | None) -> bytes:
    if value is None:
        raise KeyError("a key the benchmark wrote is missing")
    return value


# ---- contenders ---------------------------------------------------------------------------------


def plain_read(paths: list[str]) -> int:
    """Read every file with ``open().read()`` in 1 MiB chunks; return the bytes read."""
    total = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(CHUNK):
                total += len(chunk)
    return total


def fastload_read(store: LocalStore, written: Written) -> int:
    """Iterate every shard with the format's reader; return the number of samples."""
    count = 0
    for key in written.keys:
        reader = written.fmt.reader(store, key)
        try:
            for sample in reader:
                count += len(sample["bin"]) > 0
        finally:
            reader.close()
    return count


def raw_lmdb_read(paths: list[str]) -> int:
    """Sequential read with py-lmdb + msgpack alone, in insertion order, as the README shows."""
    count = 0
    for path in paths:
        env = lmdb.open(path, subdir=False, readonly=True, lock=False)
        try:
            with env.begin() as txn:
                n = msgpack.unpackb(txn.get(META))["num_samples"]
                for i in range(n):
                    key = _must(txn.get(POS + i.to_bytes(8, "big")))
                    fields = msgpack.unpackb(_must(txn.get(key)))
                    count += len(fields["bin"]) > 0
        finally:
            env.close()
    return count


def lmdb_random(
    store: LocalStore, written: Written, picks: list[tuple[int, int, str]], by: str
) -> float:
    """Seconds for our reader to fetch ``picks`` (shard, position, key) by key or by position."""
    readers = [LMDBReader(store, key) for key in written.keys]
    try:
        for r in readers:
            len(r)  # open outside the timed part
        start = CLOCK()
        if by == "key":
            for shard, _, key in picks:
                assert len(readers[shard].get_key(key)["bin"])
        else:
            for shard, pos, _ in picks:
                assert len(readers[shard].read(pos)["bin"])
        return CLOCK() - start
    finally:
        for r in readers:
            r.close()


def raw_random(paths: list[str], picks: list[tuple[int, int, str]], by: str) -> float:
    """Seconds for raw py-lmdb ``txn.get`` + ``msgpack.unpackb`` to fetch the same picks."""
    envs = [lmdb.open(p, subdir=False, readonly=True, lock=False) for p in paths]
    try:
        txns = [env.begin() for env in envs]
        keys = [k.encode() for _, _, k in picks]
        start = CLOCK()
        if by == "key":
            for (shard, _, _), kb in zip(picks, keys):
                assert len(msgpack.unpackb(txns[shard].get(kb))["bin"])
        else:
            for shard, pos, _ in picks:
                txn = txns[shard]
                key = _must(txn.get(POS + pos.to_bytes(8, "big")))
                assert len(msgpack.unpackb(_must(txn.get(key)))["bin"])
        elapsed = CLOCK() - start
        for txn in txns:
            txn.abort()
        return elapsed
    finally:
        for env in envs:
            env.close()


#: The clock every measurement uses; ``--clock wall`` switches to elapsed time.
CLOCK: Callable[[], float] = time.process_time


def timed(fn: Callable[[], Any]) -> float:
    start = CLOCK()
    fn()
    return CLOCK() - start


# ---- the run -----------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="fastload-bench-formats-", dir=args.dir))
    try:
        return _run(args, root)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"kept shards in {root}")


def _run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    samples = make_samples(args.samples, args.sample_kb * 1000, args.seed)
    payload = sum(len(s["bin"]) for s in samples)
    print(
        f"{len(samples)} samples, {payload / 1e6:.0f} MB payload, {args.per_shard} per shard, "
        f"{args.rounds} rounds, in {root}"
    )
    store = LocalStore(root, fsync=False)
    written: dict[str, Written] = {}
    skipped: dict[str, str] = {}
    for name in args.formats:
        result = write_format(store, name, samples, args.per_shard)
        if isinstance(result, str):
            skipped[name] = result
            print(f"  skip {name}: {result}")
        else:
            written[name] = result
            print(
                f"  wrote {name}: {len(result.keys)} shards, {result.num_bytes / 1e6:.0f} MB "
                f"in {result.write_s:.1f} s ({result.num_bytes / 1e6 / result.write_s:.0f} MB/s)"
            )
    del samples

    rng = random.Random(args.seed)
    picks: list[tuple[int, int, str]] = []
    if "lmdb" in written:
        for _ in range(args.gets):
            i = rng.randrange(args.samples)
            picks.append((i // args.per_shard, i % args.per_shard, f"s{i:07d}"))

    contenders: list[tuple[str, Callable[[], float]]] = []
    for name, w in written.items():
        contenders.append((f"{name}:plain", partial(timed, partial(plain_read, w.paths))))
        contenders.append((f"{name}:fastload", partial(timed, partial(fastload_read, store, w))))
    if "lmdb" in written:
        w = written["lmdb"]
        contenders.append(("lmdb:raw", partial(timed, partial(raw_lmdb_read, w.paths))))
        for by in ("key", "position"):
            contenders.append(
                (f"lmdb:get-{by}:fastload", partial(lmdb_random, store, w, picks, by))
            )
            contenders.append((f"lmdb:get-{by}:raw", partial(raw_random, w.paths, picks, by)))

    for _, fn in contenders:  # warm-up: page cache, imports, first opens
        fn()
    timings = Timings()
    for _, (name, fn) in alternating(contenders, args.rounds):
        timings.add(name, fn())

    results: dict[str, Any] = {
        "samples": args.samples,
        "payload_bytes": payload,
        "rounds": args.rounds,
        "clock": args.clock,
        "skipped": skipped,
        "sequential": {},
        "random": {},
    }
    print()
    print(f"{'format':<12}{'samples/s':>12}{'MB/s':>10}{'plain MB/s':>12}{'ratio':>8}{'goal':>7}")
    for name, w in written.items():
        plain, ours = timings.median(f"{name}:plain"), timings.median(f"{name}:fastload")
        mbs, plain_mbs = w.num_bytes / ours / 1e6, w.num_bytes / plain / 1e6
        ratio = plain / ours
        goal = GOALS.get(name, 0.0)
        row = {
            "samples_per_s": args.samples / ours,
            "mb_per_s": mbs,
            "plain_mb_per_s": plain_mbs,
            "ratio_vs_plain": ratio,
            "goal": goal,
            "shard_bytes": w.num_bytes,
            "write_mb_per_s": w.num_bytes / w.write_s / 1e6,
        }
        if name == "lmdb":  # the LMDB goal is against raw py-lmdb, not against plain reads
            raw = timings.median("lmdb:raw")
            row["raw_lmdb_mb_per_s"] = w.num_bytes / raw / 1e6
            row["ratio_vs_raw_lmdb"] = raw / ours
            verdict = f"{'ok' if raw / ours >= goal else 'LOW'} ({raw / ours:.2f}x raw py-lmdb)"
        else:
            verdict = "ok" if ratio >= goal else "LOW"
        print(
            f"{name:<12}{args.samples / ours:>12.0f}{mbs:>10.0f}{plain_mbs:>12.0f}"
            f"{ratio:>7.2f}x{goal:>6.1f} {verdict}"
        )
        if name == "lmdb":
            print(
                f"{'lmdb raw':<12}{args.samples / raw:>12.0f}{w.num_bytes / raw / 1e6:>10.0f}"
                f"{plain_mbs:>12.0f}{plain / raw:>7.2f}x   (py-lmdb + msgpack, README order)"
            )
        results["sequential"][name] = row
    if "lmdb" in written:
        print()
        print(f"{'LMDB random':<22}{'fastload gets/s':>16}{'raw gets/s':>12}{'ratio':>8}")
        for by in ("key", "position"):
            ours, raw = (
                timings.median(f"lmdb:get-{by}:fastload"),
                timings.median(f"lmdb:get-{by}:raw"),
            )
            results["random"][by] = {
                "gets_per_s": len(picks) / ours,
                "raw_gets_per_s": len(picks) / raw,
                "ratio_vs_raw": raw / ours,
                "goal": GOALS["lmdb"],
            }
            print(
                f"{'get by ' + by:<22}{len(picks) / ours:>16.0f}{len(picks) / raw:>12.0f}"
                f"{raw / ours:>7.2f}x"
            )
    results["elapsed_s"] = time.perf_counter() - t0
    print(
        f"\n{results['elapsed_s']:.1f} s in all; medians of {args.rounds} rounds, "
        f"rates per {'CPU' if args.clock == 'cpu' else 'wall-clock'} second"
    )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--sample-kb", type=int, default=100, help="mean payload size (KB)")
    parser.add_argument("--per-shard", type=int, default=500, help="samples per shard")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--gets", type=int, default=4000, help="LMDB random gets per round")
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    parser.add_argument("--quick", action="store_true", help="small run, under 15 s")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dir", default=None, help="where to write the temporary shards")
    parser.add_argument("--keep", action="store_true", help="keep the shards")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu (default): this process's CPU seconds, robust on a shared machine; "
        "wall: elapsed seconds",
    )
    args = parser.parse_args(argv)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.quick:
        args.samples, args.per_shard, args.rounds, args.gets = 400, 200, 5, 1000
    results = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
