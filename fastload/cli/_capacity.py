"""``fastload plan-capacity``: the capacity model of :mod:`fastload._capacity` on the command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from fastload._units import plural
from fastload.cli._common import (
    EXIT_OK,
    UsageError,
    add_command,
    block_size,
    count,
    out,
    positive_int,
    size,
)

__all__ = ["add"]

_DESCRIPTION = """\
Predict what a training job asks of the store, the node caches and the CPUs: the request rate and
bandwidth the store serves (first epoch, later epochs), each node's cache footprint and hit rate,
CPU cores per GPU to decode on the CPU or with DALI, and the burst at the start of an epoch.

Inputs are measured per-sample costs (--sample-bytes, --decode-cpu-ms, ...; or a --preset of
them) and the target (--gpus x --samples-per-gpu, --gpus-per-node, shard and cache sizes, the
shuffle). The model and its validation against a measured run: benchmarks/SCALING.md.

Warns where the target cannot be met: an epoch that needs more than a node's network
(--node-bandwidth), the store's bandwidth (--store-bandwidth) or its request rate
(--store-requests) can deliver in the target's epoch time, with the time it takes at least.
"""


def add(sub: Any) -> None:
    """Add the ``plan-capacity`` subcommand to ``sub``."""
    from fastload._capacity import PRESETS, Cluster

    defaults = Cluster(gpus=1, samples_per_gpu=1)
    p = add_command(
        sub,
        "plan-capacity",
        _run,
        help="predict store bandwidth and requests, cache footprint and CPU needs of a job",
        description=_DESCRIPTION,
    )
    w = p.add_argument_group("the dataset and its measured per-sample costs")
    w.add_argument("--preset", choices=sorted(PRESETS), help="start from these costs")
    w.add_argument("--samples", type=positive_int, help="samples in the dataset")
    w.add_argument("--sample-bytes", type=size, help="mean bytes per sample in a shard")
    w.add_argument("--index-bytes-per-sample", type=float, help=".idx bytes per sample (0: none)")
    w.add_argument("--decode-cpu-ms", type=float, help="CPU-ms per sample, decoding on the CPU")
    w.add_argument("--dali-cpu-ms", type=float, help="host CPU-ms per sample with DALI on the GPU")
    t = p.add_argument_group("the target")
    t.add_argument("--gpus", type=positive_int, required=True, help="GPUs (ranks) in the job")
    t.add_argument(
        "--samples-per-gpu", type=float, required=True, help="samples/s each GPU trains on"
    )
    t.add_argument("--gpus-per-node", type=positive_int, default=defaults.gpus_per_node)
    t.add_argument("--batch-size", type=positive_int, default=defaults.batch_size, help="per GPU")
    t.add_argument("--workers", type=positive_int, default=defaults.workers, help="per GPU")
    t.add_argument("--shard-size", type=size, default=defaults.shard_bytes, help="bytes/shard")
    t.add_argument("--cache-size", type=size, default=defaults.cache_bytes, help="per node")
    t.add_argument(
        "--block-size",
        type=block_size,
        default=defaults.block_size,
        help="shuffle block in samples, or 'none' for the streaming shuffle",
    )
    t.add_argument("--window", type=positive_int, default=defaults.window)
    t.add_argument("--prefetch-shards", type=count, default=defaults.prefetch_shards)
    t.add_argument(
        "--max-open-shards",
        type=count,
        default=defaults.max_open_shards,
        help="shard readers a worker keeps open (the loader's max_open_shards)",
    )
    t.add_argument(
        "--node-bandwidth",
        type=size,
        default=int(defaults.node_bandwidth),
        help="bytes/s a node downloads (default 12.5GB: 100 Gbit/s)",
    )
    t.add_argument(
        "--store-bandwidth",
        type=size,
        default=int(defaults.store_bandwidth),
        help="bytes/s the store serves the whole job (default 1TB: a plausible ceiling; give yours)",
    )
    t.add_argument(
        "--store-requests",
        type=positive_int,
        default=int(defaults.store_requests),
        help="requests/s the store serves the whole job (default 100000; give yours)",
    )
    p.add_argument("--json", action="store_true", help="print inputs and plan as JSON")


def _workload(args: argparse.Namespace) -> Any:
    from fastload._capacity import PRESETS, Workload

    base = PRESETS[args.preset] if args.preset else None
    given = {
        "samples": args.samples,
        "sample_bytes": args.sample_bytes,
        "index_bytes_per_sample": args.index_bytes_per_sample,
        "decode_cpu_ms": args.decode_cpu_ms,
        "dali_cpu_ms": args.dali_cpu_ms,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if base is not None:
        return dataclasses.replace(base, **given)
    missing = [f"--{k.replace('_', '-')}" for k in ("samples", "sample_bytes") if k not in given]
    if missing:
        raise UsageError(f"give {' and '.join(missing)}, or a --preset")
    return Workload(**given)


def _run(args: argparse.Namespace) -> int:
    from fastload._capacity import Cluster, plan_capacity
    from fastload._units import format_bytes as _bytes

    block = args.block_size
    work = _workload(args)
    target = Cluster(
        gpus=args.gpus,
        samples_per_gpu=args.samples_per_gpu,
        gpus_per_node=args.gpus_per_node,
        batch_size=args.batch_size,
        workers=args.workers,
        shard_bytes=args.shard_size,
        cache_bytes=args.cache_size,
        block_size=block,
        window=args.window,
        prefetch_shards=args.prefetch_shards,
        max_open_shards=args.max_open_shards,
        node_bandwidth=float(args.node_bandwidth),
        store_bandwidth=float(args.store_bandwidth),
        store_requests=float(args.store_requests),
    )
    plan = plan_capacity(work, target)
    if args.json:
        doc = {
            "workload": dataclasses.asdict(work),
            "cluster": dataclasses.asdict(target),
            "plan": plan.to_dict(),
        }
        out(json.dumps(doc, indent=2))
        return EXIT_OK
    p = plan
    shuffle = "streaming" if block is None else f"block {block}"
    rows = [
        (
            "job",
            f"{plural(p.nodes, 'node')} x {plural(args.gpus_per_node, 'GPU')}, "
            f"{p.samples_per_s:,.0f} samples/s",
        ),
        ("epoch", f"{p.epoch_s:,.1f} s"),
        ("dataset", f"{_bytes(p.dataset_bytes)} in {p.shards:,} shards of {p.shard_samples:,}"),
        ("shuffle", f"{shuffle}, window {args.window}"),
        ("a node reads", f"{p.node_read_fraction:.1%} of the shards, {p.visits_per_shard}x each"),
        ("node footprint", f"{_bytes(p.node_footprint_bytes)} per epoch"),
        ("cache", f"{p.cache_slots:,} shards; holds: {'yes' if p.cache_holds else 'no'}"),
        ("node hit rate", f"{p.node_hit_rate:.1%} of shard visits (later epochs)"),
        (
            "node downloads",
            f"{_bytes(p.first_epoch_node_bytes)} first epoch, "
            f"{_bytes(p.later_epoch_node_bytes)} later epochs",
        ),
        (
            "store bandwidth",
            f"{_bytes(p.store_bandwidth_first)}/s first epoch, "
            f"{_bytes(p.store_bandwidth_later)}/s later",
        ),
        (
            "store requests",
            f"{p.store_requests_first:,.0f}/s first epoch, {p.store_requests_later:,.0f}/s later "
            f"({p.requests_per_shard} per shard)",
        ),
        (
            "CPU per GPU",
            f"{p.cpu_cores_per_gpu:.2f} cores decoding on CPU, "
            f"{p.dali_cores_per_gpu:.2f} with DALI",
        ),
        (
            "epoch start",
            f"{p.burst_node_shards:,.0f} shards per node at once: {_bytes(p.burst_bytes)} and "
            f"{p.burst_requests:,.0f} requests over the job, {p.burst_s:.1f} s per node",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        out(f"{name.ljust(width)}  {value}")
    for limit in p.limits:
        out(f"warning: {limit}")
    return EXIT_OK
