"""Streaming from object storage: training epochs from the local Ceph RGW, and raw shard downloads.

Two measurements (issues 6 and 15), each in fresh subprocesses, alternating variants round by
round (this machine is shared and noisy); the report gives medians and ratios, and beside each the
CPU it cost: the child's own (its threads and its loader workers) and radosgw's plus the OSD's
(from ``/proc/<pid>/stat`` of the cluster's daemons, whose pids ``tools/ceph-up.sh`` records),
per GB moved, since wall time on a loaded machine is noisy and the server runs on the same cores:

1. **Epoch**: one full epoch of the train workload (decode + random-resized-crop 224 + flip +
   normalize with :class:`fastload.loader.transforms.ImageTrainTransform`, batch 64, 2 workers,
   shuffled) over the W1 corpus as WebDataset shards:

   * ``local``: the shards on local disk (warm page cache), the reference;
   * ``s3-cold``: ``open_dataset("s3://…", cache_dir=<empty>)``, the first epoch streams from RGW
     while filling the cache (per-worker prefetch of the next shards);
   * ``s3-warm``: the same with the cache already filled (later epochs);
   * ``s3-direct``: no cache, every sample a ranged GET (for information).

   Goals (issue 15): ``s3-cold`` >= 0.8x and ``s3-warm`` >= 0.95x ``local`` (epoch wall time,
   start-up included for all alike).
2. **Download**: every shard of the dataset read whole, with 1 and 4 concurrent requests: through
   the S3 backend (``open_store("s3://…")``: the S3Store behind a RetryStore) with ``get`` and with
   ``open_reader``, and as a cache fill (``open_store(..., cache_dir=...)``, ``local_path``: the
   object streamed into a local file); against plain boto3 ``get_object().read()`` (``boto3``,
   the best client of ``benchmarks/bench_s3_clients.py``; the reference of ``get`` and
   ``open_reader``) and boto3's ``download_fileobj`` into a local file (``boto3-file``, s3transfer's
   threaded ranged parts; the reference of the cache fill, which also writes a file). Goal >= 0.9x.

The cluster is started or reused through :mod:`fastload.testing.ceph` (``CEPH_RUN`` etc. pick a
private one; on a cluster others use, the server CPU includes their requests). The shards are
uploaded once to the bucket ``fastload-bench-stream``, byte-identical to the local ones.

Run: ``.venv/bin/python -m benchmarks.bench_stream [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks._harness import (
    emit_result,
    median_rate,
    ok_runs,
    print_round,
    ratio,
    run_child,
    warm,
)

BUCKET = "fastload-bench-stream"
WORKERS = 2
BATCH = 64
EPOCH_VARIANTS = ("local", "s3-cold", "s3-warm", "s3-direct")
DOWNLOAD_VARIANTS = ("boto3", "boto3-file", "fastload-get", "fastload-reader", "fastload-cache")
#: The reference of each download variant (boto3's way of doing the same thing).
DOWNLOAD_BASE = {"fastload-cache": "boto3-file", "boto3-file": "boto3-file"}
#: The cluster's daemons whose CPU time is counted (pid files under ``$CEPH_RUN/pid``).
SERVER_DAEMONS = ("rgw", "osd.0")


def _cpu_self() -> float:
    """CPU seconds of this process (all threads) and its reaped children (loader workers)."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def server_cpu(run_dir: str) -> float | None:
    """CPU seconds used so far by radosgw and the OSD of the cluster at ``run_dir``; None when a
    pid file or process is missing."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for name in SERVER_DAEMONS:
        try:
            pid = Path(run_dir, "pid", name).read_text().strip()
            fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
        except (OSError, ValueError):
            return None
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


# ---------------------------------------------------------------------------------------------
# Children
# ---------------------------------------------------------------------------------------------


def child_epoch(spec: dict[str, Any]) -> dict[str, Any]:
    """One epoch of the train workload; returns samples and seconds."""
    import torch

    import fastload
    from fastload.loader.decode import Decoder
    from fastload.loader.transforms import ImageTrainTransform

    variant = spec["variant"]
    tf = ImageTrainTransform(normalize_on="batch")
    common: dict[str, Any] = {"seed": 0, "decode": Decoder(image=tf), "fields": ("jpg", "cls")}
    if variant == "local":
        warm(sorted(str(p) for p in Path(spec["local"]).glob("*.tar")))
        ds = fastload.open_dataset(spec["local"], **common)
    else:
        cache = None if variant == "s3-direct" else spec["cache_dir"]
        ds = fastload.open_dataset(
            spec["url"],
            cache_dir=cache,
            cache_size="100GB",
            store_options=spec["store_options"],
            **common,
        )
        if variant == "s3-warm":  # fill the cache first (as an earlier epoch would have)
            keys = [k for s in range(ds.num_shards) for k in ds.shard_objects(s)]
            warm([str(ds.store.local_path(k)) for k in keys])
    loader = fastload.DataLoader(ds, batch_size=BATCH, num_workers=WORKERS)
    torch.set_num_threads(1)
    cpu0 = _cpu_self()
    t0 = time.perf_counter()
    samples = 0
    for images, labels in loader:
        tf.batch_transform(images)
        samples += len(labels)
    seconds = time.perf_counter() - t0
    del loader  # its workers have exited: their CPU time is this process's children's
    gc.collect()
    cpu = _cpu_self() - cpu0
    return {"samples": samples, "seconds": seconds, "rate": samples / seconds, "cpu": cpu}


def child_download(spec: dict[str, Any]) -> dict[str, Any]:
    """Read every shard whole; returns bytes and seconds."""
    variant, keys, threads = spec["variant"], spec["keys"], spec["threads"]
    opts = spec["store_options"]
    read: Callable[[str], int]
    if variant in ("boto3", "boto3-file"):
        import boto3
        from botocore.config import Config

        client = boto3.client(
            "s3",
            endpoint_url=opts["endpoint_url"],
            region_name=opts["region"],
            aws_access_key_id=opts["access_key_id"],
            aws_secret_access_key=opts["secret_access_key"],
            config=Config(
                s3={"addressing_style": "path"},
                max_pool_connections=64,
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )
        prefix = spec["prefix"]

        if variant == "boto3-file":
            out_dir = tempfile.mkdtemp(prefix="fastload-bench-boto3-")

            def read(key: str) -> int:
                path = os.path.join(out_dir, key)
                with open(path, "wb") as f:
                    client.download_fileobj(BUCKET, f"{prefix}/{key}", f)
                return os.path.getsize(path)

        else:

            def read(key: str) -> int:
                return len(client.get_object(Bucket=BUCKET, Key=f"{prefix}/{key}")["Body"].read())

    else:
        import fastload

        cache_dir = tempfile.mkdtemp(prefix="fastload-bench-fill-")
        cached = variant == "fastload-cache"
        store = fastload.open_store(spec["url"], cache_dir=cache_dir if cached else None, **opts)
        if cached:  # a cache fill: download to a local file

            def read(key: str) -> int:
                path = store.local_path(key)
                assert path is not None
                return os.path.getsize(path)

        elif variant == "fastload-get":

            def read(key: str) -> int:
                return len(store.get(key))

        else:

            def read(key: str) -> int:
                n = 0
                with store.open_reader(key) as f:
                    while block := f.read(8 << 20):
                        n += len(block)
                return n

    # Connection set-up outside the timing, for every client alike (a HEAD for those that write
    # files, which would otherwise find the first shard there).
    if variant == "fastload-cache":
        store.head(keys[0])
    elif variant == "boto3-file":
        client.head_object(Bucket=BUCKET, Key=f"{spec['prefix']}/{keys[0]}")
    else:
        read(keys[0])
    cpu0 = _cpu_self()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(read, keys))
    seconds = time.perf_counter() - t0
    cpu = _cpu_self() - cpu0
    if variant == "boto3-file":
        shutil.rmtree(out_dir, ignore_errors=True)
    elif variant != "boto3":
        shutil.rmtree(cache_dir, ignore_errors=True)
    return {"bytes": total, "seconds": seconds, "rate": total / seconds, "cpu": cpu}


# ---------------------------------------------------------------------------------------------
# Parent
# ---------------------------------------------------------------------------------------------


def _run_child(spec: dict[str, Any], timeout: float, run_dir: str) -> dict[str, Any]:
    """Run one epoch or download child; its result or error, with ``server_cpu``: the CPU
    seconds radosgw and the OSD used meanwhile (absent when they cannot be read)."""
    argv = [sys.executable, "-m", "benchmarks.bench_stream", "--child", json.dumps(spec)]
    before = server_cpu(run_dir)
    res = run_child(argv, timeout=timeout)
    after = server_cpu(run_dir)
    if before is not None and after is not None:
        res["server_cpu"] = after - before
    return res


def _median(runs: Sequence[dict[str, Any]], key: str) -> float | None:
    """Median of ``run[key]`` over the successful runs that have it."""
    values = sorted(r[key] for r in ok_runs(runs) if key in r)
    return statistics.median(values) if values else None


def _cpu_text(
    runs: Sequence[dict[str, Any]], gigabytes: float, base: Sequence[dict[str, Any]] = ()
) -> str:
    """``CPU client C s, server S s (c + s CPU-s/GB)``: the median CPU seconds of the runs, and
    per GB of the ``gigabytes`` each moved from the server: the client's beyond the median of
    ``base`` (the same work without the download) when given, and the server's."""
    client, server = _median(runs, "cpu"), _median(runs, "server_cpu")
    text = f"CPU client {client or 0:5.2f} s"
    if server is not None:
        text += f", server {server:5.2f} s"
    base_cpu = _median(base, "cpu") if base else 0.0
    if gigabytes > 0 and client is not None and base_cpu is not None:
        text += f" ({(client - base_cpu) / gigabytes:.2f}"
        text += f" + {server / gigabytes:.2f}" if server is not None else ""
        text += " CPU-s/GB" + (" beyond local)" if base else ")")
    return text


def _upload(local: Path, url: str, store_options: dict[str, Any]) -> None:
    """Copy the local dataset to ``url`` byte for byte (once: skipped when the manifest matches)."""
    import fastload
    from fastload.storage import LocalStore

    src = LocalStore(local)
    dst = fastload.open_store(url, **store_options)
    manifest = src.get("fastload.json")
    if dst.exists("fastload.json") and dst.get("fastload.json") == manifest:
        return
    t0 = time.perf_counter()
    keys = [k for k in src.list_keys() if k != "fastload.json"]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda k: src.copy_to(k, dst), keys))
    dst.put("fastload.json", manifest)  # last, as the converter does
    print(f"uploaded {len(keys)} objects to {url} in {time.perf_counter() - t0:.1f} s")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="fastload streaming benchmark (Ceph RGW)")
    parser.add_argument("--quick", action="store_true", help="2000 images, 2 rounds")
    parser.add_argument("--count", type=int, default=None, help="images (default 10000)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 3)")
    parser.add_argument("--json", help="write results as JSON here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        fn = child_epoch if spec["kind"] == "epoch" else child_download
        emit_result(fn(spec))
        return 0

    from benchmarks.corpus import ensure_corpus
    from fastload.testing.ceph import acquire, release

    count = args.count or (2000 if args.quick else 10_000)
    rounds = args.rounds or (2 if args.quick else 3)
    corpus = ensure_corpus(count)
    local = corpus.webdataset(shards=16, workers=WORKERS)
    cluster = acquire()
    report: dict[str, Any] = {"count": count, "rounds": rounds}
    try:
        options = cluster.store_options()
        client = cluster.client()
        try:
            client.create_bucket(Bucket=BUCKET)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        prefix = f"w1-{count}"
        url = f"s3://{BUCKET}/{prefix}"
        _upload(local, url, options)
        shard_keys = sorted(p.name for p in local.glob("*.tar"))
        nbytes = sum((local / k).stat().st_size for k in shard_keys)
        print(
            f"corpus {count} images in {len(shard_keys)} shards ({nbytes / 1e6:.0f} MB), "
            f"{rounds} rounds, endpoint {cluster.endpoint_url}; load {os.getloadavg()[0]:.1f}"
        )

        # 1. epochs
        epochs: dict[str, list[dict[str, Any]]] = {v: [] for v in EPOCH_VARIANTS}
        for r in range(rounds):
            cache_root = Path(tempfile.mkdtemp(prefix="fastload-bench-cache-"))
            try:
                for variant in EPOCH_VARIANTS:  # s3-warm reuses the cache s3-cold filled
                    spec = {
                        "kind": "epoch",
                        "variant": variant,
                        "local": str(local),
                        "url": url,
                        "store_options": options,
                        "cache_dir": str(cache_root / "cache"),
                    }
                    res = _run_child(spec, timeout=1800, run_dir=cluster.run_dir)
                    epochs[variant].append(res)
                    print_round(r + 1, f"epoch {variant:10s}", res)
            finally:
                shutil.rmtree(cache_root, ignore_errors=True)
        local_rate = median_rate(epochs["local"])
        report["epoch"] = {}
        print(f"\nEpoch of the train workload ({count} images, batch {BATCH}, {WORKERS} workers):")
        for variant in EPOCH_VARIANTS:
            rate = median_rate(epochs[variant])
            vs_local = ratio(rate, local_rate)
            report["epoch"][variant] = {"rate": rate, "ratio": vs_local, "runs": epochs[variant]}
            ratio_text = "-" if vs_local is None else f"{vs_local:.2f}x local"
            moved = nbytes / 1e9 if variant in ("s3-cold", "s3-direct") else 0.0
            cpu_text = _cpu_text(epochs[variant], moved, epochs["local"])
            print(f"  {variant:10s} {rate or 0:8.0f} samples/s  {ratio_text:11s}  {cpu_text}")

        # 2. downloads
        downloads: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for r in range(rounds):
            for threads in (1, 4):
                for variant in DOWNLOAD_VARIANTS:
                    spec = {
                        "kind": "download",
                        "variant": variant,
                        "threads": threads,
                        "keys": shard_keys,
                        "url": url,
                        "prefix": prefix,
                        "store_options": options,
                    }
                    res = _run_child(spec, timeout=900, run_dir=cluster.run_dir)
                    downloads.setdefault((variant, threads), []).append(res)
                    label = f"download {variant:15s} x{threads}"
                    print_round(r + 1, label, res, unit="MB/s", amount="bytes", scale=1e6)
        report["download"] = {}
        print(f"\nWhole-shard downloads ({len(shard_keys)} shards, {nbytes / 1e6:.0f} MB):")
        for threads in (1, 4):
            for variant in DOWNLOAD_VARIANTS:
                base_variant = DOWNLOAD_BASE.get(variant, "boto3")
                base = median_rate(downloads[(base_variant, threads)], "bytes")
                rate = median_rate(downloads[(variant, threads)], "bytes")
                vs_base = ratio(rate, base)
                report["download"][f"{variant}-x{threads}"] = {
                    "rate": rate,
                    "ratio": vs_base,
                    "reference": base_variant,
                    "runs": downloads[(variant, threads)],
                }
                ratio_text = "-" if vs_base is None else f"{vs_base:.2f}x {base_variant}"
                cpu_text = _cpu_text(downloads[(variant, threads)], nbytes / 1e9)
                print(
                    f"  {variant:15s} x{threads}  {(rate or 0) / 1e6:7.0f} MB/s  "
                    f"{ratio_text:16s}  {cpu_text}"
                )
        print(f"load at the end {os.getloadavg()[0]:.1f}")
    finally:
        release(cluster)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
