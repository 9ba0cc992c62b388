"""Epochs from a real HDFS against the same dataset on local disk, and the cache fill against a
plain ``hdfs_native`` read loop, as ratios.

Issue 25. The HDFS is the project's own (``tools/hdfs-up.sh``: Hadoop's MiniDFSCluster, 1
NameNode and 2 DataNodes on 127.0.0.1, 1 MiB blocks, replication 2), shared with the tests
(:func:`fastload.testing.hdfs.acquire`). One dataset, ``--count`` samples of 16-48 KB of random
bytes in WebDataset shards of 100 samples, is written once to HDFS and once to a local directory
(the same bytes). Each variant runs in a child process, alternating round by round:

* ``local``: the local copy (its files in the page cache after the first round: the ceiling);
* ``hdfs-cold``: HDFS through a fresh, empty node cache (``cache_dir``; the workers' prefetch
  fills it), what a first epoch on a training node costs;
* ``hdfs-warm``: the second epoch over that cache (every shard cached: no HDFS read);
* ``hdfs-direct``: HDFS without a cache (each worker streams its shards from the DataNodes).

Epochs are whole (start-up included), 2 workers, batch 32, and every sample is checked delivered
exactly once with the right bytes. The fill rate is one process filling the cache with every
shard in turn (``CachingStore.local_path``: download to a temporary file, fsync, rename) against
a loop reading the same files with ``hdfs_native`` into memory (``client.read(path).read()``,
``hdfs_native-read``) and one that also writes each to a local file, fsyncs and renames it
(``hdfs_native-to-disk``: the least a cache fill must do), alternating; all are MB/s of shard
bytes.

Run: ``.venv/bin/python -m benchmarks.bench_hdfs [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import _random_dataset
from benchmarks._harness import emit_result, median_rate, print_round, ratio, run_child, time_epoch

WORKERS = 2
BATCH = 32
SHARD_SAMPLES = 100
VARIANTS = ("local", "hdfs-cold", "hdfs-warm", "hdfs-direct")
FILL_VARIANTS = ("fastload-cache-fill", "hdfs_native-read", "hdfs_native-to-disk")


# ---- children -----------------------------------------------------------------------------------


def _epoch(url: str, count: int, cache_dir: str | None) -> dict[str, Any]:
    import fastload
    from benchmarks import _random_dataset as dataset  # by name: workers pickle

    expected = dataset.expected_digests(count)
    seen: dict[str, str] = {}

    def make() -> Any:
        ds = fastload.open_dataset(
            url,
            cache_dir=cache_dir,
            cache_size="100GB" if cache_dir else None,
            seed=0,
            transform=dataset.digest_of,
        )
        loader = fastload.DataLoader(
            ds, batch_size=BATCH, num_workers=WORKERS, collate_fn=dataset.collate
        )

        def batches() -> Any:
            for keys, digests in loader:
                for k, d in zip(keys, digests, strict=True):
                    if k in seen:
                        raise RuntimeError(f"sample {k} delivered twice")
                    seen[k] = d
                yield keys, digests

        return batches()

    result: dict[str, Any] = dict(time_epoch(make, count))
    if seen != expected:
        wrong = sum(1 for k, d in seen.items() if expected.get(k) != d)
        raise RuntimeError(f"{len(seen)} of {count} samples, {wrong} with the wrong bytes")
    return result


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One variant's run (see the module docstring)."""
    variant, count = spec["variant"], spec["count"]
    if variant == "local":
        return _epoch(spec["local"], count, None)
    if variant == "hdfs-direct":
        return _epoch(spec["hdfs"], count, None)
    if variant in ("hdfs-cold", "hdfs-warm"):
        cache = tempfile.mkdtemp(prefix="fastload-bench-hdfs-")
        try:
            first = _epoch(spec["hdfs"], count, cache)
            return first if variant == "hdfs-cold" else _epoch(spec["hdfs"], count, cache)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    return _fill(spec, variant)


def _fill(spec: dict[str, Any], variant: str) -> dict[str, Any]:
    """Read every shard of the dataset once, one after the other: into a fresh node cache, or
    into memory with a plain ``hdfs_native`` client; ``bytes`` and ``seconds``."""
    import fastload
    from fastload.storage import CachingStore

    store = fastload.open_store(spec["hdfs"])
    keys = sorted(k for k in store.list_keys() if k.endswith(".tar"))
    nbytes = 0
    if variant == "fastload-cache-fill":
        cache_dir = tempfile.mkdtemp(prefix="fastload-bench-hdfs-fill-")
        try:
            cache = CachingStore(store, cache_dir, "100GB", prefetch_threads=0)
            start = time.perf_counter()
            for key in keys:
                nbytes += os.path.getsize(cache.local_path(key))
            seconds = time.perf_counter() - start
        finally:
            shutil.rmtree(cache_dir, ignore_errors=True)
    else:
        import hdfs_native

        cluster, _, root = spec["hdfs"].removeprefix("hdfs://").partition("/")
        to_disk = variant == "hdfs_native-to-disk"
        out_dir = tempfile.mkdtemp(prefix="fastload-bench-hdfs-copy-")
        try:
            start = time.perf_counter()
            client = hdfs_native.Client(f"hdfs://{cluster}")
            for key in keys:
                data = client.read(f"/{root}/{key}").read()
                nbytes += len(data)
                if to_disk:  # what a cache fill must do at least: a whole file, durably
                    tmp = os.path.join(out_dir, f".{key}.tmp")
                    with open(tmp, "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                    os.rename(tmp, os.path.join(out_dir, key))
            seconds = time.perf_counter() - start
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)
    return {"bytes": nbytes, "seconds": seconds, "objects": len(keys)}


# ---- the parent ---------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="epochs and cache fills from a real local HDFS")
    parser.add_argument("--quick", action="store_true", help="600 samples, 1 round")
    parser.add_argument("--count", type=int, default=None, help="samples (default 3000)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 3)")
    parser.add_argument("--json", help="write results as JSON here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        emit_result(child(json.loads(args.child)))
        return 0

    from fastload.testing.hdfs import acquire, release

    count = args.count or (600 if args.quick else 3000)
    rounds = args.rounds or (1 if args.quick else 3)
    cluster = acquire()
    local = Path(tempfile.gettempdir()) / f"fastload-bench-hdfs-local-{count}"
    report: dict[str, Any] = {"count": count, "rounds": rounds, "quick": args.quick}
    try:
        hdfs_url = f"{cluster.url}/bench/random-{count}"
        nbytes = _random_dataset.build(hdfs_url, count, SHARD_SAMPLES)
        _random_dataset.build(str(local), count, SHARD_SAMPLES)  # the same bytes, on local disk
        label = "QUICK RUN (not a result), " if args.quick else ""
        print(
            f"{label}{count} samples in {-(-count // SHARD_SAMPLES)} WebDataset shards "
            f"({nbytes / 1e6:.0f} MB), {rounds} rounds; HDFS {cluster.url} (MiniDFSCluster, "
            f"1 NameNode + 2 DataNodes, 1 MiB blocks, replication 2); load "
            f"{os.getloadavg()[0]:.1f}"
        )
        base_spec = {"count": count, "hdfs": hdfs_url, "local": str(local)}
        argv_child = [sys.executable, "-m", "benchmarks.bench_hdfs", "--child"]
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in (*VARIANTS, *FILL_VARIANTS)}
        for r in range(rounds):
            for group, unit in ((VARIANTS, "samples"), (FILL_VARIANTS, "bytes")):
                for name in group if r % 2 == 0 else group[::-1]:
                    spec = dict(base_spec, variant=name)
                    res = run_child([*argv_child, json.dumps(spec)], timeout=1800)
                    runs[name].append(res)
                    if unit == "samples":
                        print_round(r + 1, f"{name:20s}", res)
                    else:
                        print_round(
                            r + 1, f"{name:20s}", res, unit="MB/s", amount="bytes", scale=1e6
                        )

        print(f"\nWhole epochs ({count} samples, {WORKERS} workers, batch {BATCH}):")
        base = median_rate(runs["local"])
        report["epochs"] = {}
        for name in VARIANTS:
            rate = median_rate(runs[name])
            vs = ratio(rate, base)
            report["epochs"][name] = {"rate": rate, "ratio_to_local": vs, "runs": runs[name]}
            text = "-" if vs is None else f"{vs:.2f}x local"
            print(f"  {name:20s} {rate or 0:8.0f} samples/s  {text}")
        print(
            "\nFilling a node cache with every shard vs reading them with hdfs_native into memory"
            " (read) or into local files, fsynced (to-disk):"
        )
        plain = median_rate(runs["hdfs_native-read"], "bytes")
        report["fill"] = {}
        for name in FILL_VARIANTS:
            rate = median_rate(runs[name], "bytes")
            vs = ratio(rate, plain)
            report["fill"][name] = {"bytes_per_s": rate, "ratio": vs, "runs": runs[name]}
            mbps = (rate or 0) / 1e6
            print(f"  {name:20s} {mbps:8.0f} MB/s  {'-' if vs is None else f'{vs:.2f}x plain'}")
        spread = [r["seconds"] for r in runs["hdfs-cold"] if "error" not in r and r.get("seconds")]
        if len(spread) > 1:
            print(
                f"  (hdfs-cold epoch seconds: {[round(s, 1) for s in spread]}, "
                f"stdev {statistics.stdev(spread):.1f})"
            )
        report["load_at_end"] = os.getloadavg()[0]
        print(f"load at the end {report['load_at_end']:.1f}")
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
    finally:
        release(cluster)
    return 0


if __name__ == "__main__":
    sys.exit(main())
