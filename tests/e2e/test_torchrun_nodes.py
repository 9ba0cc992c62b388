"""Many ranks per node, one cache per node, under ``torchrun`` itself, streaming from the Ceph RGW.

Two simulated nodes (two ``torchrun`` agents on this machine, gloo, static rendezvous) of two ranks
with two DataLoader workers each train on a 160-image dataset of 8 shards in ``s3://``, each node
through its own cache directory whose budget (75 % of the dataset) is smaller than the dataset.
The job (:mod:`fastload.testing.nodes`) logs every delivered batch per rank and each node's cache
counters (:meth:`~fastload.storage.CachingStore.node_stats`) at epoch boundaries.

Checked: every epoch delivers each sample exactly once over the global batch; in the first epoch
each node downloads each shard and index exactly once (one copy of the dataset per node) and the
node counters say so; the caches stay within budget. Then global rank 3 is SIGKILLed mid-epoch
after rank 0 saved the loader state, and the job is restarted at another world size (one node of
two ranks with twice the batch size, so the global batch is kept) on the killed rank's node cache:
it resumes exactly (the samples delivered before the checkpoint plus those after are the dataset),
the cache is usable (no fill left behind, within budget) and its counters kept the killed
processes' counts.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fastload.testing.ceph import CephS3
from fastload.testing.nodes import (
    NodeCorpus,
    capacity_model,
    delete_bucket,
    job_env,
    launch_node,
    node_snapshots,
    rank_batches,
    write_corpus,
)

pytestmark = [pytest.mark.ceph, pytest.mark.timeout(600)]

NODES, RANKS, WORKERS, BATCH = 2, 2, 2, 2
IMAGES = 160  # 8 shards of 20; 160 = 20 global steps of 8, no padding
SAVE_AT = (2, 5)  # rank 0 saves the state after 5 steps of epoch 2
KILL_AT = (2, 8, 3)  # global rank 3 SIGKILLs itself on batch 8 of epoch 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_all(procs: list[subprocess.Popen[bytes]], logs: list[Path]) -> list[int]:
    codes = []
    try:
        for proc in procs:
            codes.append(proc.wait(timeout=400))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if len(codes) < len(procs):
        tails = "\n".join(log.read_text()[-3000:] for log in logs if log.exists())
        pytest.fail(f"torchrun did not finish within 400 s:\n{tails}")
    return codes


@pytest.fixture(scope="module")
def dataset(
    ceph_s3: CephS3, s3_client: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[NodeCorpus]:
    """160 images in 8 webdataset shards in a new bucket."""
    bucket = f"fl-nodes-{os.getpid()}"
    s3_client.create_bucket(Bucket=bucket)
    work = tmp_path_factory.mktemp("nodes-corpus")
    try:
        yield write_corpus(work, f"s3://{bucket}/ds", IMAGES, ceph_s3.store_options())
    finally:
        delete_bucket(s3_client, bucket)


def budget(ds: NodeCorpus) -> int:
    return ds.nbytes * 3 // 4


def job_args(ds: NodeCorpus, cache: Path, log: Path, *extra: str) -> list[str]:
    return [
        *("--url", ds.url, "--cache-dir", str(cache), "--cache-size", str(budget(ds))),
        *("--log-dir", str(log), "--workers", str(WORKERS)),
        *extra,
    ]


@pytest.fixture(scope="module")
def first_run(
    dataset: NodeCorpus, ceph_s3: CephS3, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[int]]:
    """The 2 x 2 x 2 job over epochs 0-2, killed in epoch 2: (its directory, exit codes)."""
    run = tmp_path_factory.mktemp("nodes-run")
    port, env = free_port(), job_env(ceph_s3)
    extra = ["--epochs", "0,1,2", "--batch-size", str(BATCH)]
    extra += ["--save-at", "{}:{}".format(*SAVE_AT), "--kill-at", "{}:{}:{}".format(*KILL_AT)]
    logs = [run / f"torchrun-{n}.log" for n in range(NODES)]
    procs = [
        launch_node(
            n,
            NODES,
            RANKS,
            port,
            job_args(dataset, run / f"cache-{n}", run / "log", *extra),
            env=env,
            log=logs[n],
        )
        for n in range(NODES)
    ]
    return run, wait_all(procs, logs)


def keys_of(batches: list[dict[str, Any]], epoch: int, before_step: int | None = None) -> list[str]:
    return sorted(
        k
        for b in batches
        if b["epoch"] == epoch and (before_step is None or b["step"] < before_step)
        for k in b["keys"]
    )


def delta(snaps: dict[tuple[int, str], dict[str, int]], epoch: int) -> dict[str, int]:
    start, end = snaps[(epoch, "start")], snaps[(epoch, "end")]
    return {k: end[k] - start[k] for k in start if k not in ("node", "cached_bytes")}


def test_each_epoch_is_exact_and_each_node_downloads_one_copy(
    dataset: NodeCorpus, first_run: tuple[Path, list[int]]
) -> None:
    run, _ = first_run
    batches = rank_batches(run / "log")
    assert budget(dataset) < dataset.nbytes  # the cache is smaller than the dataset
    objects = 2 * dataset.shards  # shards and their indexes
    plan = capacity_model(
        dataset,
        nodes=NODES,
        ranks=RANKS,
        workers=WORKERS,
        batch_size=BATCH,
        cache_bytes=budget(dataset),
    )
    for epoch in (0, 1):
        assert keys_of(batches, epoch) == dataset.keys  # exactly once over the global batch
        per_rank = Counter(b["rank"] for b in batches if b["epoch"] == epoch)
        assert per_rank == dict.fromkeys(range(NODES * RANKS), IMAGES // (NODES * RANKS * BATCH))
    for node in range(NODES):
        snaps = node_snapshots(run / "log", node)
        first = delta(snaps, 0)
        # One download per shard and index on each node: one copy of the dataset per node.
        assert first["downloads"] == objects, first
        assert first["bytes_downloaded"] == dataset.nbytes, first
        # A head and a get per object (a few more heads where two ranks opened a shard at once).
        assert objects * 2 <= first["requests"] <= objects * 3, first
        assert first["hits"] > 0
        # The capacity model predicts the first epoch within 20 % (bytes: exactly).
        assert first["bytes_downloaded"] == pytest.approx(plan.first_epoch_node_bytes, rel=1e-6)
        assert first["requests"] == pytest.approx(plan.first_epoch_node_requests, rel=0.2)
        second = delta(snaps, 1)
        # The cache cannot keep the dataset: epoch 1 downloads what epoch 0 evicted, no more.
        assert 0 < second["bytes_downloaded"] <= dataset.nbytes, second
        assert second["evictions"] > 0
        assert all(s["cached_bytes"] <= budget(dataset) for s in snaps.values())


def test_a_sigkilled_rank_leaves_a_usable_cache_and_the_job_resumes_at_another_world_size(
    dataset: NodeCorpus, ceph_s3: CephS3, first_run: tuple[Path, list[int]]
) -> None:
    run, codes = first_run
    assert all(code != 0 for code in codes)  # the kill ended the job on both nodes
    state = json.loads((run / "log" / "state.json").read_text())
    assert (state["epoch"], state["step"], state["world_size"]) == (*SAVE_AT, NODES * RANKS)
    batches = rank_batches(run / "log")
    killed = [b for b in batches if b["rank"] == KILL_AT[2] and b["epoch"] == KILL_AT[0]]
    assert max(b["step"] for b in killed) == KILL_AT[1] - 1  # it died on receiving step 8
    before = keys_of(batches, SAVE_AT[0], before_step=SAVE_AT[1])
    assert len(before) == SAVE_AT[1] * NODES * RANKS * BATCH
    cache = run / f"cache-{KILL_AT[2] // RANKS}"
    counts_before = node_snapshots(run / "log", KILL_AT[2] // RANKS)[(SAVE_AT[0], "start")]

    # Restart on the killed rank's node: one node of 2 ranks, batch 4 keeps the global batch of 8.
    log = run / "resumed"
    args = job_args(dataset, cache, log, "--epochs", str(SAVE_AT[0]), "--batch-size", "4")
    args += ["--resume", str(run / "log" / "state.json")]
    proc = launch_node(0, 1, RANKS, free_port(), args, env=job_env(ceph_s3), log=run / "r.log")
    assert wait_all([proc], [run / "r.log"]) == [0], (run / "r.log").read_text()[-3000:]

    after = keys_of(rank_batches(log), SAVE_AT[0])
    assert sorted(before + after) == dataset.keys  # exactly once across the restart
    snaps = node_snapshots(log, 0)
    start = snaps[(SAVE_AT[0], "start")]
    # The node's counters kept what the killed run's processes counted in epoch 2.
    assert start["hits"] > counts_before["hits"]
    assert start["bytes_downloaded"] >= counts_before["bytes_downloaded"]
    # No fill of the killed processes is left, and the cache kept its budget.
    assert list((cache / "tmp").iterdir()) == []
    assert all(s["cached_bytes"] <= budget(dataset) for s in snaps.values())
    done = [json.loads(x) for x in (log / "rank-0.jsonl").read_text().splitlines()][-1]
    assert done["stats"]["node_cache_hits"] == snaps[(SAVE_AT[0], "end")]["hits"]
