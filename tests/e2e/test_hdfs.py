"""HDFS end to end, on a real cluster: Hadoop's MiniDFSCluster (1 NameNode, 2 DataNodes,
replication 2) of this module's own (``private_cluster``: the faults below must not reach other
users of the shared one), with 128 KiB blocks so that every shard spans several blocks.

``fastload convert`` writes the generated corpus to ``hdfs://…`` in each format, ``fastload
verify`` and ``inspect`` read it back, and a 2-worker ``DataLoader`` streams epochs through a node
cache. Then the faults: a DataNode stopped mid-epoch (reads fail over to the other replica), the
NameNode restarted mid-epoch (retries ride it out) or kept down past the retry budget (a typed
error naming the URL, no hang), and the converter SIGKILLed while it writes.
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload.errors import StoreUnavailableError, TransientStoreError, WorkerError
from fastload.loader import Dataset
from fastload.storage import RetryConfig
from fastload.storage._hdfs import HDFSStore
from fastload.storage._local_temp import TMP_PREFIX
from fastload.testing import need
from fastload.testing.hdfs import (
    ConnectionCutter,
    HDFSCluster,
    HDFSStartError,
    private_cluster,
    scratch_url,
)

pytestmark = pytest.mark.timeout(180)

BLOCK = 128 * 1024
FORMATS = ("webdataset", "tfrecord", "lmdb")
#: Retries that ride out a NameNode restart (~8 s here) with room to spare.
PATIENT = RetryConfig(max_retries=100, initial_backoff=0.05, max_backoff=0.5, retry_timeout=90.0)
CLI = [sys.executable, "-m", "fastload.cli"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[HDFSCluster]:
    try:
        with private_cluster(block_size=BLOCK) as cluster:
            yield cluster
    except HDFSStartError as exc:
        need("HDFS (MiniDFSCluster)", False, str(exc))


@pytest.fixture(scope="module")
def datasets(cluster: HDFSCluster, image_folder: Path) -> dict[str, str]:
    """The corpus converted by ``fastload convert`` into each format: 6 shards of 25 samples."""
    urls = {}
    for fmt in FORMATS:
        url = f"{cluster.url}/datasets/{fmt}"
        subprocess.run(
            [
                *CLI,
                *("convert", str(image_folder), url, "--format", fmt),
                *("--shard-samples", "25", "--workers", "2", "--quiet"),
            ],
            check=True,
            timeout=120,
        )
        urls[fmt] = url
    return urls


def shard_by_shard(url: str, cache: Path | None, **options: Any) -> Dataset:
    """The dataset at ``url`` read a whole shard at a time, one shard ahead (long reads of each
    shard's blocks, so that a fault lands in the middle of them), through ``cache`` if given."""
    return fastload.open_dataset(
        url, cache_dir=cache, block_size=None, window=1, prefetch_shards=1, **options
    )


def shard_bytes(url: str) -> dict[str, bytes]:
    store = HDFSStore(url)
    return {key: store.get(key) for key in store.list_keys()}


# ---- the user's path ----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_convert_inspect_verify(
    cluster: HDFSCluster, datasets: dict[str, str], image_keys: list[str], fmt: str
) -> None:
    url = datasets[fmt]
    info = json.loads(
        subprocess.run(
            [*CLI, "inspect", url, "--json", "--samples", "2"],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    )
    assert info["format"] == fmt
    assert (info["num_samples"], info["num_shards"]) == (len(image_keys), 6)
    assert [s["key"] for s in info["samples"]] == image_keys[:2]
    verify = subprocess.run(
        [*CLI, "verify", url], capture_output=True, text=True, timeout=120, check=False
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert verify.stdout.startswith(f"OK: checked 6 shards, read {len(image_keys)} samples")

    # The shards are HDFS files of several blocks, two replicas each.
    import hdfs_native

    client = hdfs_native.Client(cluster.url)
    manifest = json.loads(HDFSStore(url).get("fastload.json"))
    for shard in manifest["shards"]:
        status = client.get_file_info(f"/datasets/{fmt}/{shard['name']}")
        assert status.length > BLOCK
        assert (status.blocksize, status.replication) == (BLOCK, 2)

    # A flipped byte in a shard is what verify is for: it names the shard.
    store = HDFSStore(url)
    victim = manifest["shards"][1]["name"]
    original = store.get(victim)
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0x01
    store.put(victim, bytes(damaged))
    try:
        bad = subprocess.run([*CLI, "verify", url, "--json"], capture_output=True, text=True)
        assert bad.returncode == 1
        problems = json.loads(bad.stdout)["problems"]
        assert any(f"{url}/{victim}" in p or victim in p for p in problems), problems
    finally:
        store.put(victim, original)


@pytest.mark.parametrize("fmt", FORMATS)
def test_two_workers_stream_an_epoch_through_the_node_cache_once(
    datasets: dict[str, str],
    image_keys: list[str],
    tmp_path: Path,
    fmt: str,
    e2e: Any,
) -> None:
    cache = tmp_path / "cache"
    ds = fastload.open_dataset(
        datasets[fmt], cache_dir=cache, cache_size="50MB", seed=3, fields=("__key__", "cls")
    )
    loader = fastload.DataLoader(ds, batch_size=8, num_workers=2)
    first = e2e.epoch_keys(loader, 0)
    assert sorted(first) == image_keys  # every sample exactly once
    filled = e2e.cache_files(cache)
    assert 6 <= len(filled) <= 12  # each shard (and its index) fetched from HDFS once
    second = e2e.epoch_keys(loader, 1)
    assert sorted(second) == image_keys
    assert second != first  # a new order
    assert e2e.cache_files(cache) == filled  # the second epoch fetched nothing


# ---- faults -------------------------------------------------------------------------------------


def test_with_one_datanode_down_every_block_is_read_from_the_other(
    cluster: HDFSCluster, datasets: dict[str, str]
) -> None:
    url = datasets["webdataset"]
    whole = shard_bytes(url)
    cluster.stop_datanode(0)
    try:
        assert shard_bytes(url) == whole  # both replicas are needed no more
        cluster.stop_datanode(1)
        store = HDFSStore(url)
        began = time.monotonic()
        with pytest.raises(TransientStoreError) as info:
            store.get("fastload.json")
        assert time.monotonic() - began < 30
        assert f"{url}/fastload.json" in str(info.value)
        assert "no HDFS DataNode" in str(info.value)
    finally:
        cluster.start_datanode(0)
        cluster.start_datanode(1)
    assert shard_bytes(url) == whole


@pytest.mark.parametrize("cached", [True, False], ids=["cache", "direct"])
def test_datanode_killed_mid_epoch(
    cluster: HDFSCluster,
    datasets: dict[str, str],
    image_keys: list[str],
    tmp_path: Path,
    cached: bool,
    e2e: Any,
) -> None:
    cache = tmp_path / "cache"
    # whole shards in turn: most reads come after the kill
    ds = shard_by_shard(datasets["tfrecord"], cache if cached else None, fields=("__key__", "cls"))
    loader = fastload.DataLoader(ds, batch_size=5, num_workers=2)
    batches = iter(loader)
    keys = list(next(batches)[0])
    cluster.stop_datanode(1)
    try:
        if cached:
            assert len(e2e.cache_files(cache)) < 2 * ds.num_shards  # shards still to fetch
        for batch_keys, _ in batches:
            keys.extend(batch_keys)
    finally:
        cluster.start_datanode(1)
    assert sorted(keys) == image_keys  # every sample once, read from the surviving replicas


@pytest.mark.parametrize("cached", [True, False], ids=["cache", "direct"])
def test_namenode_restarted_mid_epoch(
    cluster: HDFSCluster,
    datasets: dict[str, str],
    image_keys: list[str],
    tmp_path: Path,
    cached: bool,
) -> None:
    ds = shard_by_shard(
        datasets["webdataset"],
        tmp_path / "cache" if cached else None,
        fields=("__key__", "cls"),
        store_options={"retry": PATIENT},
    )
    loader = fastload.DataLoader(ds, batch_size=5, num_workers=2)
    batches = iter(loader)
    keys = list(next(batches)[0])
    restart = threading.Thread(target=cluster.restart_namenode, args=(2.0,))
    began = time.monotonic()
    restart.start()
    try:
        for batch_keys, _ in batches:
            keys.extend(batch_keys)
    finally:
        restart.join()
    assert sorted(keys) == image_keys  # the retries rode out the restart: every sample once
    assert time.monotonic() - began < 120


def test_namenode_down_past_the_retry_budget_fails_clearly(
    cluster: HDFSCluster,
    datasets: dict[str, str],
    tmp_path: Path,
    e2e: Any,
) -> None:
    url = datasets["lmdb"]
    brief = RetryConfig(max_retries=3, initial_backoff=0.05, max_backoff=0.2, retry_timeout=3.0)
    ds = fastload.open_dataset(
        url, cache_dir=tmp_path / "cache", fields=("__key__", "cls"), store_options={"retry": brief}
    )
    loader = fastload.DataLoader(ds, batch_size=8, num_workers=2)
    cluster.control("stop-namenode")
    try:
        began = time.monotonic()
        with pytest.raises(WorkerError) as info:
            e2e.epoch_keys(loader, 0)
        assert time.monotonic() - began < 60  # no hang: the budget is a few seconds
        text = str(info.value)
        assert f"{url}/shard-" in text  # names the object that could not be read
        assert "StoreUnavailableError" in text
        with pytest.raises(StoreUnavailableError) as opened:
            fastload.open_dataset(url, store_options={"retry": brief})
        assert f"{url}/fastload.json" in str(opened.value)
    finally:
        cluster.control("start-namenode")


# ---- a flaky network to the DataNodes ------------------------------------------------------------


@pytest.fixture
def cutter_ready() -> None:
    why = ConnectionCutter.check()
    need("cutting TCP connections (ss -K, root)", why is None, why or "")


def _jpeg_digest(sample: dict[str, Any]) -> tuple[str, str]:
    return sample["__key__"], hashlib.sha256(sample["jpg"]).hexdigest()


def _pairs(batch: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return batch


@pytest.mark.parametrize("cached", [True, False], ids=["cache", "direct"])
def test_datanode_connections_cut_mid_epoch_deliver_every_sample_once_intact(
    cluster: HDFSCluster,
    datasets: dict[str, str],
    image_folder: Path,
    tmp_path: Path,
    cutter_ready: None,
    cached: bool,
) -> None:
    expected = {
        f"{p.parent.name}/{p.stem}": hashlib.sha256(p.read_bytes()).hexdigest()
        for p in image_folder.glob("*/*.jpg")
    }
    # whole shards: long transfers, cut part-way
    ds = shard_by_shard(
        datasets["webdataset"],
        tmp_path / "cache" if cached else None,
        transform=_jpeg_digest,
        store_options={"retry": PATIENT},
    )
    loader = fastload.DataLoader(ds, batch_size=5, num_workers=2, collate_fn=_pairs)
    with ConnectionCutter(cluster.datanode_ports(), every=0.05, seed=25) as cutter:
        got = [pair for batch in loader for pair in batch]
    assert cutter.cut >= 1, "no DataNode connection was cut: the test tested nothing"
    assert len(got) == len(expected)  # every sample once ...
    assert dict(got) == expected  # ... with its own bytes
    stats = loader.stats()
    if cached:
        assert stats["node_cache_store_gave_up"] == 0
    retried = {k: v for k, v in stats.items() if k.startswith("node_cache_store_")}
    print(f"\n{cutter.cut} DataNode connections cut during the epoch; {retried}")


def test_verify_through_cut_datanode_connections_calls_intact_intact(
    cluster: HDFSCluster, datasets: dict[str, str], cutter_ready: None
) -> None:
    with ConnectionCutter(cluster.datanode_ports(), every=0.05, seed=26) as cutter:
        proc = subprocess.run(
            [*CLI, "verify", datasets["tfrecord"]], capture_output=True, text=True, timeout=300
        )
    assert cutter.cut >= 1, "no DataNode connection was cut: the test tested nothing"
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("OK: checked 6 shards")
    print(f"\n{cutter.cut} DataNode connections cut during verify")


def test_convert_through_cut_datanode_connections_writes_what_a_clean_run_writes(
    cluster: HDFSCluster, image_folder: Path, cutter_ready: None
) -> None:
    args = ["--format", "tfrecord", "--shard-samples", "10", "--workers", "2", "--quiet"]
    base = scratch_url(cluster, "cut-convert")
    subprocess.run([*CLI, "convert", str(image_folder), f"{base}/ref", *args], check=True)
    with ConnectionCutter(cluster.datanode_ports(), every=0.05, seed=27) as cutter:
        proc = subprocess.run(
            [*CLI, "convert", str(image_folder), f"{base}/ds", *args],
            capture_output=True,
            text=True,
            timeout=300,
        )
    rewrites = proc.stderr.count("again (attempt")
    print(f"\n{cutter.cut} DataNode connections cut during the conversion; {rewrites} rewrites")
    assert cutter.cut >= 1, "no DataNode connection was cut: the test tested nothing"
    assert proc.returncode == 0, proc.stderr
    assert shard_bytes(f"{base}/ds") == shard_bytes(f"{base}/ref")


# ---- the converter killed while writing -----------------------------------------------------------


class ListingWatcher:
    """Lists a directory over and over (the raw client, temporary files included), recording
    every (name, size) it ever sees."""

    def __init__(self, cluster: HDFSCluster, path: str) -> None:
        import hdfs_native

        self.client, self.path = hdfs_native.Client(cluster.url), path
        self.seen: dict[str, set[int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                statuses = list(self.client.list_status(self.path, recursive=True))
            except FileNotFoundError:
                statuses = []
            for status in statuses:
                if not status.isdir:
                    name = status.path[len(self.path) + 1 :]
                    self.seen.setdefault(name, set()).add(int(status.length))
            time.sleep(0.005)

    def shards_seen(self) -> int:
        return sum(1 for name in list(self.seen) if name.endswith(".tfrecord"))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def test_converter_killed_while_writing_resumes_byte_identical(
    cluster: HDFSCluster, image_folder: Path
) -> None:
    args = ["--format", "tfrecord", "--shard-samples", "5", "--workers", "1", "--quiet"]
    command = [*CLI, "convert", str(image_folder)]
    base = scratch_url(cluster, "killed")
    reference_url, url = f"{base}/ref", f"{base}/ds"
    subprocess.run([*command, reference_url, *args], check=True, timeout=120)
    reference = shard_bytes(reference_url)
    assert "fastload.json" in reference
    assert not any(k.startswith("_fastload_convert/") for k in reference)

    watcher = ListingWatcher(cluster, url[len(cluster.url) :])
    try:
        proc = subprocess.Popen([*command, url, *args])
        deadline = time.monotonic() + 60
        while watcher.shards_seen() < 2 and proc.poll() is None:
            assert time.monotonic() < deadline, "no shard appeared within 60 s"
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed = set(watcher.seen)
        assert "fastload.json" not in killed, "the conversion finished before it was killed"
        visible = fastload.open_store(url, retry=False).list_keys()
        assert "fastload.json" not in visible
        assert not any(TMP_PREFIX in k for k in visible)  # no partial file is listed
        subprocess.run([*command, url, *args], check=True, timeout=120)  # the same command again
    finally:
        watcher.stop()
    result = shard_bytes(url)
    assert result == reference  # byte-identical to the uninterrupted run, state files gone
    # No partial shard was ever visible under its name: every size seen is the final size.
    for name, sizes in watcher.seen.items():
        if name.startswith("_fastload_convert/") or TMP_PREFIX in name:
            continue
        assert sizes == {len(result[name])}, f"{name} was listed with sizes {sorted(sizes)}"
