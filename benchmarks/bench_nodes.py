"""Many ranks per node through one cache per node, under ``torchrun``: measured against the model.

``python -m benchmarks.bench_nodes [--quick] [--json FILE]``

Runs the job of ``tests/e2e/test_torchrun_nodes.py`` (:mod:`fastload.testing.nodes`: 2 simulated
nodes x 2 ranks x 2 workers, gloo, one cache directory per node) on a generated dataset in the
local Ceph RGW, in three set-ups: the streaming shuffle with a cache of 75 % of the dataset, the
same with a cache that holds it, and the block shuffle (blocks of 5 of a shard's 20 samples) with
the 75 % cache. For each it reads the nodes' cache counters at every epoch boundary and radosgw's
own request and byte counters (from its admin socket), and sets them beside the prediction of
:func:`fastload._capacity.plan_capacity`: bytes and requests per node, first epoch and later
epochs (mean over nodes and epochs). The figures are counts, not times, so the machine's load does
not change them (it is printed all the same). radosgw's counters include every client of the
cluster: use a private one (``CEPH_RUN=... RGW_PORT=...``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._harness import Table, fmt_ratio, ratio

NODES, RANKS, WORKERS, BATCH = 2, 2, 2, 2

#: (name, job options, cache budget as a fraction of the dataset)
SETUPS: tuple[tuple[str, tuple[str, ...], float], ...] = (
    ("streaming, cache 75%", ("--block-size", "0", "--window", "1"), 0.75),
    ("streaming, cache 150%", ("--block-size", "0", "--window", "1"), 1.5),
    ("block 5, cache 75%", ("--block-size", "5", "--window", "1"), 0.75),
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_setup(
    url: str, env: dict[str, str], work_dir: Path, options: Sequence[str], cache: int, epochs: int
) -> tuple[list[dict[str, int]], list[dict[str, int]]]:
    """Run the job; return per-epoch deltas of each node's counters and of radosgw's."""
    from fastload.testing.ceph import run_dir
    from fastload.testing.nodes import launch_node, node_snapshots

    log = work_dir / "log"
    asok = run_dir() / "asok" / "client.rgw.local.asok"
    args = ["--url", url, "--cache-size", str(cache), "--log-dir", str(log)]
    args += ["--epochs", ",".join(map(str, range(epochs))), "--batch-size", str(BATCH)]
    args += ["--workers", str(WORKERS), *options]
    if asok.exists():
        args += ["--rgw-asok", str(asok)]
    port = _free_port()
    procs = [
        launch_node(
            n,
            NODES,
            RANKS,
            port,
            [*args, "--cache-dir", str(work_dir / f"cache-{n}")],
            env=env,
            log=work_dir / f"torchrun-{n}.log",
        )
        for n in range(NODES)
    ]
    codes = [p.wait(900) for p in procs]
    if any(codes):
        tail = (work_dir / "torchrun-0.log").read_text()[-2000:]
        raise SystemExit(f"the job failed ({codes}):\n{tail}")
    nodes = []
    for node in range(NODES):
        snaps = node_snapshots(log, node)
        for e in range(epochs):
            start, end = snaps[(e, "start")], snaps[(e, "end")]
            nodes.append(
                {"epoch": e, **{k: end[k] - start[k] for k in ("bytes_downloaded", "requests")}}
            )
    rgw = []
    path = log / "rgw.jsonl"
    records = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    by = {(r["epoch"], r["when"]): r for r in records}
    for e in range(epochs):
        if (e, "start") in by and (e, "end") in by:
            s, t = by[(e, "start")], by[(e, "end")]
            rgw.append({"epoch": e, "req": t["req"] - s["req"], "get_b": t["get_b"] - s["get_b"]})
    return nodes, rgw


def _mean(rows: list[dict[str, int]], key: str, first: bool) -> float | None:
    values = [r[key] for r in rows if (r["epoch"] == 0) == first]
    return statistics.fmean(values) if values else None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 epochs per set-up instead of 5")
    parser.add_argument("--images", type=int, default=160, help="images (20 per shard)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    from fastload.testing.ceph import acquire, release
    from fastload.testing.nodes import capacity_model, delete_bucket, job_env, write_corpus

    epochs = 3 if args.quick else 5
    cluster = acquire()
    tmp = Path(tempfile.mkdtemp(prefix="bench-nodes-"))
    client = cluster.client()
    bucket = f"fl-bench-nodes-{os.getpid()}"
    client.create_bucket(Bucket=bucket)
    results: list[dict[str, Any]] = []
    try:
        corpus = write_corpus(tmp, f"s3://{bucket}/ds", args.images, cluster.store_options())
        env = job_env(cluster)
        print(
            f"dataset: {corpus.shards} shards, {corpus.nbytes:,} bytes with indexes; "
            f"load {os.getloadavg()[0]:.1f}"
        )
        for name, job, fraction in SETUPS:
            cache = int(corpus.nbytes * fraction)
            block = int(job[job.index("--block-size") + 1])
            plan = capacity_model(
                corpus,
                nodes=NODES,
                ranks=RANKS,
                workers=WORKERS,
                batch_size=BATCH,
                cache_bytes=cache,
                block_size=block or None,
                window=int(job[job.index("--window") + 1]),
            )
            work_dir = tmp / name.replace(" ", "").replace(",", "-").replace("%", "")
            nodes, rgw = _run_setup(corpus.url, env, work_dir, job, cache, epochs)
            results.append(
                {
                    "setup": name,
                    "cache_bytes": cache,
                    "predicted": plan.to_dict(),
                    "nodes": nodes,
                    "rgw": rgw,
                    "load": os.getloadavg()[0],
                }
            )
            shutil.rmtree(work_dir, ignore_errors=True)
    finally:
        delete_bucket(client, bucket)
        shutil.rmtree(tmp, ignore_errors=True)
        release(cluster)

    table = Table(
        ("set-up, per node and epoch", 26),
        ("predicted", 11),
        ("measured", 11),
        ("ratio", 7),
        ("radosgw/2", 11),
    )
    print(table.header())
    for r in results:
        p = r["predicted"]
        for first, label in ((True, "first"), (False, "later")):
            for key, pkey, rkey in (
                ("bytes_downloaded", "epoch_node_bytes", "get_b"),
                ("requests", "epoch_node_requests", "req"),
            ):
                predicted = p[f"{label}_{pkey}"]
                measured = _mean(r["nodes"], key, first)
                server = _mean(r["rgw"], rkey, first)
                table_row = table.row(
                    f"{r['setup']}: {label} {'bytes' if key.startswith('bytes') else 'requests'}",
                    f"{predicted:,.0f}",
                    "-" if measured is None else f"{measured:,.0f}",
                    fmt_ratio(ratio(measured, predicted)) if predicted else "-",
                    "-" if server is None else f"{server / NODES:,.0f}",
                )
                print(table_row)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
