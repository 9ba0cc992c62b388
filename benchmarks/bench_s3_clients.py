"""Compare S3 clients on the local Ceph RGW: boto3, obstore, s3fs and fastload's S3Store.

Measures, for each client in its own process (so one client's threads and buffers do not slow
the next):

* whole-object GET throughput (MB/s) over ``--objects`` objects of ``--object-mib`` MiB with 1, 4
  and 16 concurrent requests;
* ranged GETs of ``--range-kib`` at random offsets, in requests per second, with 1 and 16
  concurrent requests.

Each metric is a client's best of ``--rounds`` runs; the rounds alternate the clients, so load
from other processes does not favour one. It starts the cluster with tools/ceph-up.sh unless one answers (and stops it afterwards only if it
started it), uploads the objects once into the bucket ``fastload-bench`` and prints a table with
each client's ratio to the best. The memstore OSD holds about 2x the stored bytes in RAM, and a
pass with 16 concurrent requests holds ``16 x object size`` in this process.

s3fs pins an older botocore through aiobotocore than boto3 needs, so it usually lives in its own
virtualenv: ``--s3fs-python /path/to/venv/bin/python`` runs the s3fs worker there. A client whose
package is missing is reported as such.

Usage::

    .venv/bin/python -m benchmarks.bench_s3_clients [--clients boto3,obstore,s3fs,fastload]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks._harness import emit_result, run_child

BUCKET = "fastload-bench"
MB = 1_000_000
CLIENTS = ("boto3", "obstore", "s3fs", "fastload")


# ---- workers (run in a child process; only the client under test is imported) -------------------


def _reader_boto3(
    args: argparse.Namespace,
) -> tuple[Callable[[str], int], Callable[[str, int, int], int]]:
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=args.endpoint,
        region_name="us-east-1",
        config=Config(
            s3={"addressing_style": "path"},
            max_pool_connections=64,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )

    def whole(key: str) -> int:
        return len(client.get_object(Bucket=args.bucket, Key=key)["Body"].read())

    def ranged(key: str, start: int, length: int) -> int:
        rng = f"bytes={start}-{start + length - 1}"
        return len(client.get_object(Bucket=args.bucket, Key=key, Range=rng)["Body"].read())

    return whole, ranged


def _reader_obstore(
    args: argparse.Namespace,
) -> tuple[Callable[[str], int], Callable[[str, int, int], int]]:
    import obstore
    from obstore.store import S3Store

    store = S3Store(
        args.bucket,
        endpoint=args.endpoint,
        region="us-east-1",
        access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
        secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        virtual_hosted_style_request=False,
        client_options={"allow_http": True, "pool_max_idle_per_host": "64"},
    )

    def whole(key: str) -> int:
        return len(memoryview(obstore.get(store, key).bytes()))

    def ranged(key: str, start: int, length: int) -> int:
        return len(memoryview(obstore.get_range(store, key, start=start, length=length)))

    return whole, ranged


def _reader_s3fs(
    args: argparse.Namespace,
) -> tuple[Callable[[str], int], Callable[[str, int, int], int]]:
    import s3fs

    fs = s3fs.S3FileSystem(
        endpoint_url=args.endpoint,
        client_kwargs={"region_name": "us-east-1"},
        config_kwargs={"s3": {"addressing_style": "path"}, "max_pool_connections": 64},
    )

    def whole(key: str) -> int:
        return len(fs.cat_file(f"{args.bucket}/{key}"))

    def ranged(key: str, start: int, length: int) -> int:
        return len(fs.cat_file(f"{args.bucket}/{key}", start=start, end=start + length))

    return whole, ranged


def _reader_fastload(
    args: argparse.Namespace,
) -> tuple[Callable[[str], int], Callable[[str, int, int], int]]:
    from fastload.storage import ByteRange
    from fastload.storage._s3 import S3Store

    store = S3Store(args.bucket, endpoint_url=args.endpoint, region="us-east-1")

    def whole(key: str) -> int:
        return len(store.get(key))

    def ranged(key: str, start: int, length: int) -> int:
        return len(store.get(key, ByteRange.from_length(start, length)))

    return whole, ranged


def _pass(
    pool: ThreadPoolExecutor, fn: Callable[..., int], jobs: list[tuple[Any, ...]]
) -> tuple[int, float]:
    t0 = time.perf_counter()
    total = sum(pool.map(lambda job: fn(*job), jobs))
    return total, time.perf_counter() - t0


def worker(args: argparse.Namespace) -> None:
    """Measure one client; print its results as the child's result line."""
    make = {
        "boto3": _reader_boto3,
        "obstore": _reader_obstore,
        "s3fs": _reader_s3fs,
        "fastload": _reader_fastload,
    }
    try:
        whole, ranged = make[args.worker](args)
    except ImportError as exc:
        emit_result({"error": f"not installed: {exc}"})
        return
    keys = [f"obj-{i:03d}" for i in range(args.objects)]
    size = args.object_mib * 1024 * 1024
    length = args.range_kib * 1000
    rng = random.Random(1)
    result: dict[str, Any] = {"whole_mbps": {}, "ranged_ops": {}}
    ranged(keys[0], 0, length)  # connect, warm up
    for conc in args.concurrency:
        with ThreadPoolExecutor(conc) as pool:
            best = 0.0
            for _ in range(args.repeat):
                total, secs = _pass(pool, whole, [(k,) for k in keys])
                if total != size * len(keys):
                    raise RuntimeError(
                        f"{args.worker}: read {total} bytes, expected {size * len(keys)}"
                    )
                best = max(best, total / secs / MB)
            result["whole_mbps"][conc] = best
    for conc in args.range_concurrency:
        n = args.ranged_reads * conc if conc > 1 else args.ranged_reads
        jobs = [(rng.choice(keys), rng.randrange(size - length), length) for _ in range(n)]
        with ThreadPoolExecutor(conc) as pool:
            total, secs = _pass(pool, ranged, jobs)
        if total != n * length:
            raise RuntimeError(f"{args.worker}: ranged reads returned {total} bytes")
        result["ranged_ops"][conc] = n / secs
    emit_result(result)


# ---- driver -----------------------------------------------------------------------------------


def _prepare(cluster: Any, args: argparse.Namespace) -> None:
    from fastload.errors import ObjectNotFoundError
    from fastload.storage._s3 import S3Store

    client = cluster.client()
    try:
        client.create_bucket(Bucket=args.bucket)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    store = S3Store(args.bucket, **cluster.store_options())
    size = args.object_mib * 1024 * 1024
    block = random.Random(0).randbytes(size)
    t0, written = time.perf_counter(), 0
    for i in range(args.objects):
        key = f"obj-{i:03d}"
        try:
            if store.head(key).size == size:
                continue
        except ObjectNotFoundError:
            pass
        store.put(key, block[i:] + block[:i])
        written += size
    if written:
        secs = time.perf_counter() - t0
        print(
            f"uploaded {written / MB:.0f} MB with S3Store.put (multipart) at {written / secs / MB:.0f} MB/s"
        )


def _run_worker(name: str, cluster: Any, args: argparse.Namespace) -> dict[str, Any]:
    python = args.s3fs_python if name == "s3fs" and args.s3fs_python else sys.executable
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": cluster.access_key_id,
        "AWS_SECRET_ACCESS_KEY": cluster.secret_access_key,
        "AWS_DEFAULT_REGION": cluster.region,
    }
    cmd = [python, "-m", "benchmarks.bench_s3_clients", "--worker", name]
    cmd += ["--endpoint", cluster.endpoint_url]
    for flag in ("objects", "object_mib", "repeat", "ranged_reads", "range_kib", "bucket"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    cmd += ["--concurrency", ",".join(map(str, args.concurrency))]
    cmd += ["--range-concurrency", ",".join(map(str, args.range_concurrency))]
    return run_child(cmd, env=env)


def _table(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    cols = [("whole_mbps", c, f"GET {args.object_mib}MiB x{c} MB/s") for c in args.concurrency]
    cols += [
        ("ranged_ops", c, f"{args.range_kib}KB ranged x{c} req/s") for c in args.range_concurrency
    ]
    ok = {n: r for n, r in results.items() if "error" not in r}
    best = {(m, c): max((r[m][str(c)] for r in ok.values()), default=0.0) for m, c, _ in cols}
    width = max(len(h) for _, _, h in cols)
    print("\n" + "client".ljust(10) + "".join(h.rjust(width + 2) for _, _, h in cols))
    for name, res in results.items():
        if "error" in res:
            print(name.ljust(10) + "  " + res["error"])
            continue
        cells = []
        for m, c, _ in cols:
            value = res[m][str(c)]
            ratio = value / best[(m, c)] if best[(m, c)] else 0.0
            cells.append(f"{value:8.0f} ({ratio:4.2f})".rjust(width + 2))
        print(name.ljust(10) + "".join(cells))
    print("(value (ratio to the best client in the column))")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    parser.add_argument("--clients", default=",".join(CLIENTS))
    parser.add_argument("--objects", type=int, default=16)
    parser.add_argument("--object-mib", type=int, default=64)
    parser.add_argument("--concurrency", type=ints, default=[1, 4, 16])
    parser.add_argument("--range-concurrency", type=ints, default=[1, 16])
    parser.add_argument("--ranged-reads", type=int, default=300, help="per concurrent request")
    parser.add_argument(
        "--range-kib", type=int, default=100, help="range length in kB (1000 bytes)"
    )
    parser.add_argument("--repeat", type=int, default=1, help="passes per worker run")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs per client")
    parser.add_argument("--bucket", default=BUCKET)
    parser.add_argument("--keep", action="store_true", help="keep the objects for the next run")
    parser.add_argument("--s3fs-python", default="", help="interpreter of a virtualenv with s3fs")
    parser.add_argument("--worker", choices=CLIENTS, help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return

    from fastload.testing.ceph import ceph_cluster

    with ceph_cluster() as cluster:
        print(f"RGW {cluster.endpoint_url}: {args.objects} x {args.object_mib} MiB objects")
        _prepare(cluster, args)
        # Rounds alternate the clients, and each metric keeps a client's best round, so that
        # load from other processes on the machine does not favour whichever client ran first.
        results: dict[str, dict[str, Any]] = {}
        for round_no in range(args.rounds):
            for name in args.clients.split(","):
                res = _run_worker(name, cluster, args)
                print(f"round {round_no + 1} {name}: {json.dumps(res)}", flush=True)
                prev = results.setdefault(name, res)
                if "error" in prev or "error" in res:
                    continue
                for metric in ("whole_mbps", "ranged_ops"):
                    for conc, value in res[metric].items():
                        prev[metric][conc] = max(prev[metric][conc], value)
        _table(results, args)
        if not args.keep:  # memstore keeps objects in RAM: free them
            client = cluster.client()
            keys = [{"Key": f"obj-{i:03d}"} for i in range(args.objects)]
            client.delete_objects(Bucket=args.bucket, Delete={"Objects": keys, "Quiet": True})
            client.delete_bucket(Bucket=args.bucket)


if __name__ == "__main__":
    main()
