"""Streaming from object storage: training epochs from the local Ceph RGW, and raw shard downloads.

Two measurements (issue 6), each in fresh subprocesses, alternating variants round by round (this
machine is shared and noisy); the report gives medians and ratios:

1. **Epoch**: one full epoch of the train workload (decode + random-resized-crop 224 + flip +
   normalize with :class:`fastload.loader.transforms.ImageTrainTransform`, batch 64, 2 workers,
   shuffled) over the W1 corpus as WebDataset shards:

   * ``local``: the shards on local disk (warm page cache), the reference;
   * ``s3-cold``: ``open_dataset("s3://…", cache_dir=<empty>)``, the first epoch streams from RGW
     while filling the cache (per-worker prefetch of the next shards);
   * ``s3-warm``: the same with the cache already filled (later epochs);
   * ``s3-direct``: no cache, every sample a ranged GET (for information).

   Goal: ``s3-cold`` and ``s3-warm`` at least 0.9x ``local`` (epoch wall time, start-up included
   for all alike).
2. **Download**: every shard of the dataset read whole through the S3 backend
   (``open_store("s3://…")``: the S3Store behind a RetryStore), with ``get``, with
   ``open_reader``, and as a cache fill (``open_store(..., cache_dir=...)``, ``local_path``: ranged
   gets of 32 MiB written to a local file), against plain boto3 ``get_object().read()`` (the best
   client of ``benchmarks/bench_s3_clients.py``), with 1 and 4 concurrent requests. Goal >= 0.9x.

The cluster is started or reused through :mod:`fastload.testing.ceph` (``CEPH_RUN`` etc. pick a
private one). The shards are uploaded once to the bucket ``fastload-bench-stream``, byte-identical
to the local ones.

Run: ``.venv/bin/python -m benchmarks.bench_stream [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks._harness import emit_result, median_rate, print_round, ratio, run_child, warm

BUCKET = "fastload-bench-stream"
WORKERS = 2
BATCH = 64
EPOCH_VARIANTS = ("local", "s3-cold", "s3-warm", "s3-direct")
DOWNLOAD_VARIANTS = ("boto3", "fastload-get", "fastload-reader", "fastload-cache")


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
    t0 = time.perf_counter()
    samples = 0
    for images, labels in loader:
        tf.batch_transform(images)
        samples += len(labels)
    seconds = time.perf_counter() - t0
    return {"samples": samples, "seconds": seconds, "rate": samples / seconds}


def child_download(spec: dict[str, Any]) -> dict[str, Any]:
    """Read every shard whole; returns bytes and seconds."""
    variant, keys, threads = spec["variant"], spec["keys"], spec["threads"]
    opts = spec["store_options"]
    read: Callable[[str], int]
    if variant == "boto3":
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

    # Connection set-up outside the timing, for every client alike (a HEAD for the cache fill,
    # which would otherwise find the first shard cached).
    if variant == "fastload-cache":
        store.head(keys[0])
    else:
        read(keys[0])
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(read, keys))
    seconds = time.perf_counter() - t0
    if variant != "boto3":
        shutil.rmtree(cache_dir, ignore_errors=True)
    return {"bytes": total, "seconds": seconds, "rate": total / seconds}


# ---------------------------------------------------------------------------------------------
# Parent
# ---------------------------------------------------------------------------------------------


def _run_child(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one epoch or download child; its result or error."""
    argv = [sys.executable, "-m", "benchmarks.bench_stream", "--child", json.dumps(spec)]
    return run_child(argv, timeout=timeout)


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
            f"{rounds} rounds, endpoint {cluster.endpoint_url}"
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
                    res = _run_child(spec, timeout=1800)
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
            print(f"  {variant:10s} {rate or 0:8.0f} samples/s  {ratio_text}")

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
                    res = _run_child(spec, timeout=900)
                    downloads.setdefault((variant, threads), []).append(res)
                    label = f"download {variant:15s} x{threads}"
                    print_round(r + 1, label, res, unit="MB/s", amount="bytes", scale=1e6)
        report["download"] = {}
        print(f"\nWhole-shard downloads ({len(shard_keys)} shards, {nbytes / 1e6:.0f} MB):")
        for threads in (1, 4):
            base = median_rate(downloads[("boto3", threads)], "bytes")
            for variant in DOWNLOAD_VARIANTS:
                rate = median_rate(downloads[(variant, threads)], "bytes")
                vs_boto3 = ratio(rate, base)
                report["download"][f"{variant}-x{threads}"] = {
                    "rate": rate,
                    "ratio": vs_boto3,
                    "runs": downloads[(variant, threads)],
                }
                ratio_text = "-" if vs_boto3 is None else f"{vs_boto3:.2f}x boto3"
                print(f"  {variant:15s} x{threads}  {(rate or 0) / 1e6:7.0f} MB/s  {ratio_text}")
    finally:
        release(cluster)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
