"""Streaming training from the real Ceph RGW, end to end, and the faults users meet.

``fastload convert`` writes the generated corpus to ``s3://bucket/ds``; ``open_dataset`` with a local
cache trains for several epochs through ``fastload.DataLoader``; radosgw is killed and restarted
under a running epoch, kept down past the retry budget, given wrong credentials, and the converter
is SIGKILLed while it writes to S3.

The tests that stop radosgw need the cluster to themselves (every user of the shared cluster sees
the outage): they skip when other processes use it, and fail under ``CI=true``. To run them beside
other sessions, start a private cluster::

    CEPH_RUN=/tmp/my-ceph RGW_PORT=7491 MON_PORT=3311 MON_V1_PORT=6791 .venv/bin/pytest tests/e2e
"""

from __future__ import annotations

import os
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
from fastload.errors import StoreAuthError, StoreUnavailableError, WorkerError
from fastload.storage import CachingStore, RetryConfig
from fastload.testing import need
from fastload.testing.ceph import CephS3, is_sole_user, start_rgw, stop_rgw

pytestmark = [pytest.mark.ceph, pytest.mark.timeout(120)]

#: Retries that ride out a radosgw restart (a few seconds) with room to spare.
PATIENT = RetryConfig(max_retries=60, initial_backoff=0.05, max_backoff=0.5, retry_timeout=60.0)


def empty_bucket(client: Any, bucket: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": obj["Key"]} for obj in page.get("Contents", ())]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})


@pytest.fixture(scope="module")
def fault_dataset(ceph_s3: CephS3, s3_client: Any, image_folder: Path) -> Iterator[str]:
    """``s3://…/ds`` holding the corpus (15 shards), for the tests that stop radosgw.

    Not the ``s3_bucket`` fixture: after radosgw was killed, the next bucket deletion waits
    ~25 s for the dead gateway's watch to time out, so this bucket is emptied but kept.
    """
    bucket = f"fl-e2e-faults-{os.getpid()}"
    s3_client.create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/ds"
    fastload.convert(
        image_folder,
        url,
        format="webdataset",
        shard_samples=10,
        workers=1,
        quiet=True,
        store_options=ceph_s3.store_options(),
    )
    yield url
    empty_bucket(s3_client, bucket)


def own_cluster(ceph_s3: CephS3) -> None:
    need(
        "sole use of the Ceph cluster (this test kills radosgw)",
        is_sole_user(ceph_s3),
        "run it where no other test session uses the cluster, or against a private one: "
        "CEPH_RUN=/tmp/my-ceph RGW_PORT=7491 MON_PORT=3311 MON_V1_PORT=6791 pytest tests/e2e",
    )


# ---- the user's path ----------------------------------------------------------------------------


def test_convert_to_s3_then_train_from_a_cache(
    ceph_s3: CephS3,
    s3_bucket: str,
    image_folder: Path,
    image_keys: list[str],
    tmp_path: Path,
    e2e: Any,
) -> None:
    url = f"s3://{s3_bucket}/ds"
    result = fastload.convert(
        image_folder,
        url,
        format="webdataset",
        shard_samples=10,
        quiet=True,
        store_options=ceph_s3.store_options(),
    )
    assert result.num_samples == len(image_keys)
    cache = tmp_path / "cache"
    ds = fastload.open_dataset(
        url,
        cache_dir=cache,
        cache_size="20MB",
        seed=7,
        fields=("__key__", "cls"),
        store_options=ceph_s3.store_options(),
    )
    assert isinstance(ds.store, CachingStore)
    assert ds.url == url
    assert e2e.cache_files(cache) == {}
    loader = fastload.DataLoader(ds, batch_size=16, num_workers=2)

    # Epoch 0 streams from RGW while filling the cache; epochs 1 and 2 download nothing.
    orders = [e2e.epoch_keys(loader, 0)]
    filled = e2e.cache_files(cache)
    assert len(filled) == 2 * ds.num_shards  # each shard and its index, downloaded once
    for epoch in (1, 2):
        orders.append(e2e.epoch_keys(loader, epoch))
        assert e2e.cache_files(cache) == filled
    for keys in orders:
        assert sorted(keys) == image_keys  # every sample exactly once per epoch
    assert orders[0] != orders[1]  # and a new order each epoch

    # Resume mid-epoch with another number of workers: exactly the remainder, in order.
    loader.set_epoch(3)
    head: list[str] = []
    for batch_keys, _ in loader:
        head.extend(batch_keys)
        if len(head) >= 48:
            break
    state = loader.state_dict()
    resumed = fastload.DataLoader(ds, batch_size=16, num_workers=1)
    resumed.load_state_dict(state)
    tail = e2e.epoch_keys(resumed, 3)
    full = e2e.epoch_keys(fastload.DataLoader(ds, batch_size=16, num_workers=0), 3)
    assert head + tail == full
    assert sorted(full) == image_keys
    assert e2e.cache_files(cache) == filled


# ---- the converter killed while writing to S3 ----------------------------------------------------


class ListingWatcher:
    """Lists a prefix over and over in a thread, recording every (key, size) it ever sees."""

    def __init__(self, client: Any, bucket: str, prefix: str) -> None:
        self.client, self.bucket, self.prefix = client, bucket, prefix
        self.seen: dict[str, set[int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            resp = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix)
            for obj in resp.get("Contents", ()):
                self.seen.setdefault(obj["Key"], set()).add(int(obj["Size"]))
            time.sleep(0.005)

    def shards_seen(self) -> int:
        return sum(1 for k in list(self.seen) if k.endswith(".tar"))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def objects(client: Any, bucket: str, prefix: str) -> dict[str, bytes]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", ()):
            body = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
            out[obj["Key"][len(prefix) :]] = body
    return out


def test_converter_killed_while_writing_to_s3_resumes_byte_identical(
    ceph_s3: CephS3, s3_bucket: str, s3_client: Any, image_folder: Path
) -> None:
    args = ["--format", "webdataset", "--shard-samples", "5", "--workers", "1", "--quiet"]
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": ceph_s3.endpoint_url,
        "AWS_ACCESS_KEY_ID": ceph_s3.access_key_id,
        "AWS_SECRET_ACCESS_KEY": ceph_s3.secret_access_key,
        "AWS_DEFAULT_REGION": ceph_s3.region,
    }
    command = [sys.executable, "-m", "fastload.cli", "convert", str(image_folder)]
    dst = f"s3://{s3_bucket}/ds"

    # The reference: an uninterrupted run of the same command.
    subprocess.run([*command, f"s3://{s3_bucket}/ref", *args], env=env, check=True, timeout=90)
    reference = objects(s3_client, s3_bucket, "ref/")
    assert "fastload.json" in reference
    assert not any(k.startswith("_fastload_convert/") for k in reference)

    watcher = ListingWatcher(s3_client, s3_bucket, "ds/")
    try:
        proc = subprocess.Popen([*command, dst, *args], env=env)
        deadline = time.monotonic() + 60
        while watcher.shards_seen() == 0 and proc.poll() is None:
            assert time.monotonic() < deadline, "no shard appeared within 60 s"
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed = {k[len("ds/") :] for k in watcher.seen}
        assert "fastload.json" not in killed, "the conversion finished before it was killed"
        assert "_fastload_convert/plan.json" in killed  # it was killed mid-way
        # The same command again completes the dataset.
        subprocess.run([*command, dst, *args], env=env, check=True, timeout=90)
    finally:
        watcher.stop()
    result = objects(s3_client, s3_bucket, "ds/")
    assert result == reference  # byte-identical to the uninterrupted run, state objects gone
    # No partial object was ever visible: every size ever listed is the object's final size.
    for key, sizes in watcher.seen.items():
        name = key[len("ds/") :]
        if name.startswith("_fastload_convert/"):
            continue
        assert sizes == {len(result[name])}, f"{key} was listed with sizes {sorted(sizes)}"
    assert s3_client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []


# ---- faults -------------------------------------------------------------------------------------


@pytest.mark.parametrize("cached", [True, False], ids=["cache", "direct"])
def test_radosgw_killed_mid_epoch_and_restarted(
    ceph_s3: CephS3,
    fault_dataset: str,
    image_keys: list[str],
    tmp_path: Path,
    cached: bool,
    e2e: Any,
) -> None:
    own_cluster(ceph_s3)
    cache = tmp_path / "cache"
    ds = fastload.open_dataset(
        fault_dataset,
        cache_dir=cache if cached else None,
        # The streaming shuffle reads shard after shard, so most downloads come after the kill.
        block_size=None,
        window=1,
        prefetch_shards=1,
        fields=("__key__", "cls"),
        store_options={**ceph_s3.store_options(), "retry": PATIENT},
    )
    loader = fastload.DataLoader(ds, batch_size=5, num_workers=2)
    batches = iter(loader)
    batch_keys, _ = next(batches)
    keys = list(batch_keys)
    stop_rgw(ceph_s3)  # SIGKILL, as a crash
    if cached:
        assert len(e2e.cache_files(cache)) < 2 * ds.num_shards  # shards are still to be downloaded
    restart = threading.Timer(1.0, start_rgw, args=(ceph_s3,))
    restart.start()
    try:
        for batch_keys, _ in batches:
            keys.extend(batch_keys)
    finally:
        restart.join()
    assert sorted(keys) == image_keys  # the retries absorbed the outage: every sample once


def test_radosgw_down_past_the_retry_budget_fails_clearly(
    ceph_s3: CephS3,
    fault_dataset: str,
    tmp_path: Path,
    e2e: Any,
) -> None:
    own_cluster(ceph_s3)
    brief = RetryConfig(max_retries=3, initial_backoff=0.05, max_backoff=0.2, retry_timeout=3.0)
    options = {**ceph_s3.store_options(), "retry": brief}
    ds = fastload.open_dataset(
        fault_dataset,
        cache_dir=tmp_path / "cache",
        fields=("__key__", "cls"),
        store_options=options,
    )
    loader = fastload.DataLoader(ds, batch_size=16, num_workers=2)
    stop_rgw(ceph_s3)
    try:
        began = time.monotonic()
        with pytest.raises(WorkerError) as info:
            e2e.epoch_keys(loader, 0)
        assert time.monotonic() - began < 60  # no hang: the budget is a few seconds
        text = str(info.value)
        assert f"{fault_dataset}/shard-" in text  # names the object that could not be read
        assert "StoreUnavailableError" in text
        assert "RetryConfig" in text  # says how to allow more
        with pytest.raises(StoreUnavailableError) as opened:
            fastload.open_dataset(fault_dataset, store_options=options)
        assert f"{fault_dataset}/fastload.json" in str(opened.value)
        assert ceph_s3.endpoint_url in "".join(map(str, (opened.value, opened.value.__cause__)))
    finally:
        start_rgw(ceph_s3)


def test_wrong_credentials_fail_at_once(
    ceph_s3: CephS3, fault_dataset: str, tmp_path: Path
) -> None:
    secret = "not-the-secret-0123456789"
    options = {**ceph_s3.store_options(), "secret_access_key": secret}
    began = time.monotonic()
    with pytest.raises(StoreAuthError) as info:
        fastload.open_dataset(fault_dataset, cache_dir=tmp_path / "cache", store_options=options)
    assert time.monotonic() - began < 10  # not retried
    text = str(info.value)
    assert f"{fault_dataset}/fastload.json" in text
    assert "credentials" in text
    assert secret not in text
    assert isinstance(info.value, PermissionError)
