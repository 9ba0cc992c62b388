"""A training job for ``torchrun`` that records what every rank delivers: the node-cache harness.

The tests and the benchmark of many ranks per node sharing one cache (``tests/e2e/
test_torchrun_nodes.py``, ``benchmarks/bench_nodes.py``) start this job once per simulated node with
:func:`launch_node`, each node with its own cache directory::

    python -m torch.distributed.run --nnodes 2 --node-rank R --nproc-per-node 2 \\
        --master-addr 127.0.0.1 --master-port P -m fastload.testing.nodes \\
        --url s3://bucket/ds --cache-dir /tmp/node-R --log-dir LOG --epochs 0,1

Every rank joins a gloo process group (rank and world size come from ``torchrun``'s environment, as
in training), opens the dataset through the node's cache (``fields=("__key__", "cls")``), and for
each epoch iterates a :class:`fastload.DataLoader` with one ``all_reduce`` per step, as DDP does, so
the ranks stay within a few batches of each other. It checks each label against its key (data
intact) and appends one JSON line per delivered batch to ``LOG/rank-<RANK>.jsonl``:
``{"epoch", "step", "rank", "keys"}``. Between barriers at the start and at the end of each epoch,
local rank 0 appends the node's cache counters (:meth:`~fastload.storage.CachingStore.node_stats`)
to ``LOG/node-<NODE>.jsonl``, and global rank 0 appends radosgw's request and byte counters to
``LOG/rgw.jsonl`` when ``--rgw-asok`` names its admin socket.

``--save-at E:S`` makes rank 0 write ``loader.state_dict()`` to ``LOG/state.json`` after ``S``
batches of epoch ``E``; ``--kill-at E:S:R`` makes global rank ``R`` SIGKILL itself when it receives
batch ``S`` of epoch ``E`` (that batch is not logged); ``--resume PATH`` loads a saved state first.
Store options (endpoint, credentials) come from the ``AWS_*`` environment variables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastload._capacity import CapacityPlan
    from fastload.testing.ceph import CephS3

__all__ = [
    "SHARD_SAMPLES",
    "NodeCorpus",
    "capacity_model",
    "delete_bucket",
    "job_env",
    "launch_node",
    "main",
    "node_snapshots",
    "rank_batches",
    "rgw_counters",
    "write_corpus",
]

#: Samples per shard of :func:`write_corpus`'s datasets.
SHARD_SAMPLES = 20


@dataclasses.dataclass(frozen=True)
class NodeCorpus:
    """A generated image dataset in the store, as :func:`write_corpus` left it.

    Attributes:
        url: The dataset URL (``s3://bucket/ds``).
        keys: Its sample keys, sorted.
        shards: Number of shards.
        tar_bytes: Bytes of the shards.
        idx_bytes: Bytes of their ``.idx`` files.
    """

    url: str
    keys: list[str]
    shards: int
    tar_bytes: int
    idx_bytes: int

    @property
    def nbytes(self) -> int:
        """Shards plus indexes: what a node downloads for one copy of the dataset."""
        return self.tar_bytes + self.idx_bytes


def write_corpus(
    work_dir: Path, url: str, images: int, store_options: Mapping[str, Any]
) -> NodeCorpus:
    """Generate ``images`` small JPEGs under ``work_dir`` and convert them to webdataset shards
    of :data:`SHARD_SAMPLES` samples at ``url``."""
    import fastload
    from fastload.testing.corpus import write_image_folder

    folder = work_dir / "images"
    write_image_folder(folder, images, scale=4, processes=1)
    options = dict(store_options)
    fastload.convert(
        folder,
        url,
        format="webdataset",
        shard_samples=SHARD_SAMPLES,
        workers=1,
        quiet=True,
        store_options=options,
    )
    ds = fastload.open_dataset(url, store_options=options)
    return NodeCorpus(
        url=url,
        keys=sorted(f"{p.parent.name}/{p.stem}" for p in folder.glob("*/*.jpg")),
        shards=ds.num_shards,
        tar_bytes=sum(ds.store.size(k) for k in ds.shard_keys),
        idx_bytes=sum(ds.store.size(f"{k}.idx") for k in ds.shard_keys),
    )


def delete_bucket(client: Any, bucket: str) -> None:
    """Delete ``bucket`` and every object in it (``client``: boto3's)."""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        objs = [{"Key": o["Key"]} for o in page.get("Contents", ())]
        if objs:
            client.delete_objects(Bucket=bucket, Delete={"Objects": objs, "Quiet": True})
    client.delete_bucket(Bucket=bucket)


def job_env(cluster: CephS3) -> dict[str, str]:
    """This process's environment plus the cluster's S3 settings, with this checkout first on
    ``PYTHONPATH`` (the ranks import the same fastload)."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH", "")
    return {
        **os.environ,
        "PYTHONPATH": f"{root}{os.pathsep}{path}" if path else root,
        "AWS_ENDPOINT_URL": cluster.endpoint_url,
        "AWS_ACCESS_KEY_ID": cluster.access_key_id,
        "AWS_SECRET_ACCESS_KEY": cluster.secret_access_key,
        "AWS_DEFAULT_REGION": cluster.region,
    }


def capacity_model(
    corpus: NodeCorpus,
    *,
    nodes: int,
    ranks: int,
    workers: int,
    batch_size: int,
    cache_bytes: int,
    block_size: int | None = None,
    window: int = 1,
) -> CapacityPlan:
    """What :func:`fastload._capacity.plan_capacity` predicts for this job on ``corpus`` (the
    job's ``prefetch_shards`` is 1; the rate does not change the per-epoch figures)."""
    from fastload._capacity import Cluster, Workload, plan_capacity

    samples = len(corpus.keys)
    work = Workload(samples, corpus.tar_bytes / samples, corpus.idx_bytes / samples)
    target = Cluster(
        gpus=nodes * ranks,
        samples_per_gpu=1.0,
        gpus_per_node=ranks,
        batch_size=batch_size,
        workers=workers,
        shard_bytes=corpus.tar_bytes // corpus.shards,
        cache_bytes=cache_bytes,
        block_size=block_size,
        window=window,
        prefetch_shards=1,
    )
    return plan_capacity(work, target)


def rgw_counters(asok: str) -> dict[str, int]:
    """radosgw's counters since it started, read from its admin socket: ``req`` (requests),
    ``get`` (GET requests) and ``get_b`` (bytes sent for GETs)."""
    out = subprocess.run(
        ["ceph", "--admin-daemon", asok, "perf", "dump"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    rgw = json.loads(out)["rgw"]
    return {name: int(rgw[name]) for name in ("req", "get", "get_b")}


def _append(path: Path, record: Mapping[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")  # one write per line: whole lines even under SIGKILL


def _parse_at(text: str | None, parts: int) -> tuple[int, ...] | None:
    if text is None:
        return None
    values = tuple(int(x) for x in text.split(":"))
    if len(values) != parts:
        raise SystemExit(f"expected {parts} integers separated by ':', got {text!r}")
    return values


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fastload.testing.nodes", description=__doc__)
    p.add_argument("--url", required=True, help="dataset URL")
    p.add_argument("--cache-dir", required=True, help="this node's cache directory")
    p.add_argument("--cache-size", required=True, help="cache budget (bytes or '5MB')")
    p.add_argument("--log-dir", required=True, type=Path)
    p.add_argument("--epochs", default="0", help="comma-separated epochs to run")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=0, help="0: the streaming shuffle")
    p.add_argument("--window", type=int, default=1)
    p.add_argument("--prefetch-shards", type=int, default=1)
    p.add_argument("--save-at", help="E:S")
    p.add_argument("--kill-at", help="E:S:RANK")
    p.add_argument("--resume", type=Path)
    p.add_argument("--rgw-asok", help="radosgw admin socket (global rank 0 logs its counters)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run one rank of the job (see the module docstring); returns the exit status."""
    args = _parser().parse_args(argv)
    import torch
    import torch.distributed as dist

    import fastload
    from fastload.loader import detect_launch

    save_at, kill_at = _parse_at(args.save_at, 2), _parse_at(args.kill_at, 3)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = detect_launch().local_rank  # torchrun's LOCAL_RANK, or any launcher's
    node = int(os.environ.get("GROUP_RANK", "0"))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    ds = fastload.open_dataset(
        args.url,
        seed=args.seed,
        block_size=args.block_size or None,
        window=args.window,
        prefetch_shards=args.prefetch_shards,
        cache_dir=args.cache_dir,
        cache_size=args.cache_size,
        fields=("__key__", "cls"),
    )
    store = ds.store
    if store.cache_dir is None:
        raise SystemExit(f"expected the dataset to read through a cache, got {store!r}")
    loader = fastload.DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers)
    if args.resume is not None:
        loader.load_state_dict(json.loads(args.resume.read_text()))
    rank_log = args.log_dir / f"rank-{rank}.jsonl"

    def snapshot(epoch: int, when: str) -> None:
        dist.barrier()
        if local_rank == 0:
            record = {"epoch": epoch, "when": when, "node": node, **store.node_stats()}
            _append(args.log_dir / f"node-{node}.jsonl", record)
        if rank == 0 and args.rgw_asok:
            record = {"epoch": epoch, "when": when, **rgw_counters(args.rgw_asok)}
            _append(args.log_dir / "rgw.jsonl", record)
        dist.barrier()

    for epoch in (int(e) for e in args.epochs.split(",")):
        loader.set_epoch(epoch)
        snapshot(epoch, "start")
        step = loader.state_dict()["step"]
        for keys, labels in loader:
            if kill_at == (epoch, step, rank):
                os.kill(os.getpid(), signal.SIGKILL)
            if [int(c) for c in labels] != [int(k[1:4]) for k in keys]:
                raise SystemExit(f"rank {rank}: labels {labels} do not match keys {list(keys)}")
            _append(rank_log, {"epoch": epoch, "step": step, "rank": rank, "keys": list(keys)})
            dist.all_reduce(torch.zeros(1))  # the gradient exchange of a training step
            step += 1
            if rank == 0 and save_at == (epoch, step):
                tmp = args.log_dir / "state.json.tmp"
                tmp.write_text(json.dumps(loader.state_dict()))
                os.replace(tmp, args.log_dir / "state.json")
        snapshot(epoch, "end")
    _append(rank_log, {"done": True, "rank": rank, "world": world, "stats": loader.stats()})
    dist.destroy_process_group()
    return 0


def launch_node(
    node_rank: int,
    nnodes: int,
    nproc: int,
    port: int,
    job_args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    log: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``torchrun`` for one simulated node of the job (see the module docstring).

    Args:
        node_rank: This node's rank (``--node-rank``).
        nnodes: Nodes in the job.
        nproc: Ranks on this node (``--nproc-per-node``).
        port: The rendezvous port on 127.0.0.1 (node 0 serves it).
        job_args: Arguments of this module's job (``--url``, ``--cache-dir``, ...).
        env: The environment (default: this process's).
        log: File for torchrun's output (default: inherited).

    Returns:
        The ``torchrun`` process, in a new session (kill its process group to stop it all).
    """
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        "--max-restarts=0",
        "--monitor-interval=0.5",
        "-m",
        "fastload.testing.nodes",
        *job_args,
    ]
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
    out = open(log, "ab") if log is not None else None  # noqa: SIM115 - handed to the child
    try:
        return subprocess.Popen(
            command,
            env=dict(env) if env is not None else None,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
            start_new_session=True,
        )
    finally:
        if out is not None:
            out.close()


def rank_batches(log_dir: Path) -> list[dict[str, Any]]:
    """Every batch record of every rank's log (``{"epoch", "step", "rank", "keys"}``)."""
    out = []
    for path in sorted(log_dir.glob("rank-*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "keys" in record:
                out.append(record)
    return out


def node_snapshots(log_dir: Path, node: int) -> dict[tuple[int, str], dict[str, int]]:
    """The node's cache counters at the start and end of each epoch: ``(epoch, "start"|"end")``
    -> counters (the last record wins when a job ran the epoch twice)."""
    out: dict[tuple[int, str], dict[str, int]] = {}
    path = log_dir / f"node-{node}.jsonl"
    for line in path.read_text().splitlines() if path.exists() else ():
        record = json.loads(line)
        out[(int(record.pop("epoch")), str(record.pop("when")))] = record
    return out


if __name__ == "__main__":
    raise SystemExit(main())
