"""A cold epoch from the Ceph RGW over a network that misbehaves, as a ratio of a clean network's.

Issue 32. One run of this benchmark puts three networks side by side, all through the same
:class:`fastload.testing.faultproxy.FaultProxy` between the loader and radosgw (so the proxy's own
cost is in every variant alike):

* ``clean``: no response damaged (the reference);
* ``faults-1%`` and ``faults-5%``: that share of the responses damaged, the kind drawn equally
  from a cut inside the headers, a cut inside the body, a TCP reset, a stall past the client's
  read timeout, and a delay of 1 s within it (what a shared cluster network or a load balancer
  does; the issue's proxy stalled responses for 0.5-2 s).

Each variant is one cold epoch (a fresh, empty cache directory; the workers' prefetch fills it as
``s3-cold`` of ``bench_stream`` does) of a synthetic dataset: ``--count`` samples of 16-48 KB of
random bytes in WebDataset shards of 10 samples (many requests, so that a share of responses is many faults), uploaded once to the bucket
``fastload-bench-faults``, read by 2 workers, batch 32, with the store options a user would pass
for such a network (``read_timeout=2``: a stall costs the 2 s timeout, then the default
:class:`~fastload.storage.RetryConfig` retries). The child checks that the epoch delivered every
sample exactly once (``EpochError`` or an error otherwise). Variants alternate round by round
(ABC, CBA, ...); the report gives the median epoch rate, its ratio to ``clean``, and per variant
the faults the proxy injected and the cache's node counters (downloads, requests).

Run: ``.venv/bin/python -m benchmarks.bench_faults [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import _random_dataset
from benchmarks._harness import (
    emit_result,
    median_rate,
    print_round,
    ratio,
    run_child,
    time_epoch,
)

BUCKET = "fastload-bench-faults"
WORKERS = 2
BATCH = 32
SHARD_SAMPLES = 10
READ_TIMEOUT = 2.0
#: variant -> share of responses damaged.
VARIANTS = {"clean": 0.0, "faults-1%": 0.01, "faults-5%": 0.05}
KINDS = ("cut_headers", "cut_body", "reset", "stall", "delay")


# ---- the child: one cold epoch ------------------------------------------------------------------


def child_epoch(spec: dict[str, Any]) -> dict[str, Any]:
    """One cold epoch through the proxy; returns time_epoch's result plus what the loader saw."""
    import fastload
    from benchmarks import _random_dataset as dataset  # by name: workers pickle

    count = spec["count"]
    options = dict(spec["store_options"], read_timeout=READ_TIMEOUT)
    expected = dataset.expected_digests(count)
    seen: dict[str, str] = {}
    holder: dict[str, Any] = {}

    def make() -> Any:
        ds = fastload.open_dataset(
            spec["url"],
            store_options=options,
            cache_dir=spec["cache_dir"],
            cache_size="100GB",
            seed=0,
            transform=dataset.digest_of,
        )
        loader = fastload.DataLoader(
            ds, batch_size=BATCH, num_workers=WORKERS, collate_fn=dataset.collate
        )
        holder["loader"] = loader

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
    stats = holder["loader"].stats()
    result["node_cache"] = {
        k.removeprefix("node_cache_"): v for k, v in stats.items() if k.startswith("node_cache_")
    }
    return result


# ---- the parent ---------------------------------------------------------------------------------


def _injected_wait(run: dict[str, Any]) -> float:
    """Seconds the proxy withheld answers in ``run``: each stall costs the client its read
    timeout, each delay 1 s."""
    net = run.get("network", {})
    return float(net.get("stall", 0) * READ_TIMEOUT + net.get("delay", 0) * 1.0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="cold epochs over a faulty network (Ceph RGW)")
    parser.add_argument("--quick", action="store_true", help="600 samples, 1 round")
    parser.add_argument("--count", type=int, default=None, help="samples (default 3000)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 3)")
    parser.add_argument("--json", help="write results as JSON here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        emit_result(child_epoch(json.loads(args.child)))
        return 0

    from fastload.testing.ceph import acquire, release
    from fastload.testing.faultproxy import FaultPlan, FaultProxy

    count = args.count or (600 if args.quick else 3000)
    rounds = args.rounds or (1 if args.quick else 3)
    cluster = acquire()
    report: dict[str, Any] = {"count": count, "rounds": rounds, "quick": args.quick}
    try:
        options = cluster.store_options()
        client = cluster.client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=BUCKET)
        url = f"s3://{BUCKET}/random-{count}"
        nbytes = _random_dataset.build(url, count, SHARD_SAMPLES, options)
        label = "QUICK RUN, " if args.quick else ""
        print(
            f"{label}{count} samples in {-(-count // SHARD_SAMPLES)} shards "
            f"({nbytes / 1e6:.0f} MB), {rounds} rounds, cold epochs through a fault proxy to "
            f"{cluster.endpoint_url}; load {os.getloadavg()[0]:.1f}"
        )
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
        names = list(VARIANTS)
        with FaultProxy(cluster.endpoint_url) as proxy:
            for r in range(rounds):
                for name in names if r % 2 == 0 else names[::-1]:
                    plan = FaultPlan(
                        seed=r,
                        fraction=VARIANTS[name],
                        kinds=KINDS,
                        stall_s=READ_TIMEOUT + 1.0,
                        delay_s=1.0,
                    )
                    proxy.set_plan(plan)
                    before = proxy.stats()
                    cache = tempfile.mkdtemp(prefix="fastload-bench-faults-")
                    spec = {
                        "count": count,
                        "url": url,
                        "store_options": dict(options, endpoint_url=proxy.endpoint_url),
                        "cache_dir": cache,
                    }
                    argv_child = [sys.executable, "-m", "benchmarks.bench_faults"]
                    try:
                        res = run_child([*argv_child, "--child", json.dumps(spec)], timeout=1800)
                    finally:
                        shutil.rmtree(cache, ignore_errors=True)
                    after = proxy.stats()
                    res["network"] = {k: after[k] - before[k] for k in after}
                    runs[name].append(res)
                    print_round(r + 1, f"{name:10s}", res)
                    net = res["network"]
                    print(
                        f"    {net['responses']} responses, {net['faults']} damaged "
                        + ", ".join(f"{k} {net[k]}" for k in KINDS if net[k])
                    )
        base = median_rate(runs["clean"])
        report["variants"] = {}
        print(f"\nCold epoch over a faulty network ({count} samples, {WORKERS} workers):")
        print(
            "  (wait: seconds the network itself withheld answers, stalls x the read timeout +"
            " delays x 1 s, per worker; extra: the epoch's seconds beyond clean's median)"
        )
        for name in VARIANTS:
            rate = median_rate(runs[name])
            vs = ratio(rate, base)
            report["variants"][name] = {"rate": rate, "ratio": vs, "runs": runs[name]}
            faults = [run.get("network", {}).get("faults", 0) for run in runs[name]]
            waits = [_injected_wait(run) / WORKERS for run in runs[name]]
            extra = [
                run["seconds"] - count / base for run in runs[name] if base and "seconds" in run
            ]
            text = "-" if vs is None else f"{vs:.2f}x clean"
            print(
                f"  {name:10s} {rate or 0:8.0f} samples/s  {text:12s}  faults per run {faults}"
                f"  wait {[round(w, 1) for w in waits]} s  extra {[round(e, 1) for e in extra]} s"
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
