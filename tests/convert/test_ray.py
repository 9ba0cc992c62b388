"""``convert(..., executor="ray")`` on a real local Ray runtime (2 CPUs, loopback): the same bytes
as the local executors, on the local Ceph RGW and on local disk, with a Ray worker killed
mid-shard (Ray retries the task) and with a failing task (the conversion stops; a re-run
resumes). Faults are injected by a map function (a module written here and importable by the
Ray workers) that acts once per marker file: ``kill`` (the worker SIGKILLs itself) or ``fail``
(raises on one sample)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fastload.cli import main
from fastload.convert import convert
from fastload.convert._ray import IN_FLIGHT_PER_CPU
from fastload.convert.sources import ConversionError
from fastload.errors import InvalidArgumentError
from fastload.storage import open_store
from fastload.testing import need
from fastload.testing.ceph import CephS3

try:
    import ray
except ImportError:  # pragma: no cover - the ray extra is in dev
    ray = None

_MAP = "fl_ray_faults:faulty"
_FAULTS_MODULE = '''
import os
import signal
import time


def faulty(sample):
    """The identity, but: with a marker file 'kill', the first process to take it is killed;
    with 'fail', the sample src/000000410 raises; with 'hold', samples from src/000000450 on wait
    for a 'release' marker (until cancelled); with 'slow', each sample takes 20 ms."""
    faults = FAULTS_DIR
    try:
        os.rename(os.path.join(faults, "kill"), os.path.join(faults, "killed"))
    except FileNotFoundError:
        pass
    else:
        with open(os.path.join(faults, "killed"), "w") as f:
            f.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    if sample["__key__"] == "src/000000410" and os.path.exists(os.path.join(faults, "fail")):
        raise ValueError("injected failure")
    if os.path.exists(os.path.join(faults, "hold")) and sample["__key__"] >= "src/000000450":
        # Shards 9 and later wait (for a marker that never comes) until cancelled.
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(faults, "release")):
            if time.monotonic() > deadline:
                raise RuntimeError("held for 120 s and never cancelled")
            time.sleep(0.05)
    if os.path.exists(os.path.join(faults, "slow")):
        time.sleep(0.02)
    return sample
'''


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A Ray runtime for this module (2 CPUs, no dashboard) whose workers import the fault
    module; yields the directory of the fault markers."""
    need("Ray", ray is not None, "pip install 'fastload[ray]' (or '.[dev]')")
    directory = tmp_path_factory.mktemp("ray-faults")
    # The marker directory is written into the module: a forkserver started by an earlier test
    # (convert's local pool, after Ray's threads) does not see environment variables set here.
    (directory / "fl_ray_faults.py").write_text(
        _FAULTS_MODULE + f"\n\nFAULTS_DIR = {str(directory)!r}\n"
    )
    saved = {"PYTHONPATH": os.environ.get("PYTHONPATH")}
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(directory), saved["PYTHONPATH"]) if p
    )
    sys.path.insert(0, str(directory))
    ray.init(
        num_cpus=2,
        address="local",
        include_dashboard=False,
        configure_logging=False,
        _node_ip_address="127.0.0.1",  # loopback only
    )
    try:
        yield directory
    finally:
        ray.shutdown()
        sys.path.remove(str(directory))
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _jsonl(records: int) -> bytes:
    return "".join(
        json.dumps({"i": i, "pad": "x" * (i * 7 % 97)}) + "\n" for i in range(records)
    ).encode()


def _objects(store_url: str, options: dict[str, Any]) -> dict[str, bytes]:
    """Every object under ``store_url``, by key."""
    store = open_store(store_url, **options)
    return {meta.key: store.get(meta.key) for meta in store.list("")}


#: The options of the conversions into local directories (12 shards of 50 samples).
_LOCAL_OPTIONS: dict[str, Any] = {"shard_samples": 50, "map_fn": _MAP, "quiet": True}


def _local_reference(tmp_path: Path) -> Path:
    """A JSONL file of 600 records in ``tmp_path``, converted by the local executor in this
    process into ``tmp_path/local``; returns the file."""
    src = tmp_path / "src.jsonl"
    src.write_bytes(_jsonl(600))
    convert(str(src), str(tmp_path / "local"), workers=1, **_LOCAL_OPTIONS)
    return src


def _assert_same_files(expected: Path, got: Path) -> None:
    """The trees hold the same paths (no state or temporary left) with the same bytes."""
    paths = sorted(p.relative_to(expected) for p in expected.rglob("*"))
    assert sorted(p.relative_to(got) for p in got.rglob("*")) == paths
    assert "fastload.json" in {str(p) for p in paths}
    for rel in paths:
        if (expected / rel).is_file():
            assert (got / rel).read_bytes() == (expected / rel).read_bytes(), rel


def test_ray_on_ceph_writes_the_pools_bytes_with_a_worker_killed(
    faults: Path, ceph_s3: CephS3, s3_bucket: str
) -> None:
    options = ceph_s3.store_options()
    root = f"s3://{s3_bucket}"
    open_store(f"{root}/in", **options).put("src.jsonl", _jsonl(1000))
    common: dict[str, Any] = {
        "shard_samples": 50,
        "map_fn": _MAP,
        "quiet": True,
        "store_options": options,
        "source_options": options,
    }
    pool = convert(f"{root}/in", f"{root}/pool", workers=2, **common)
    (faults / "kill").write_text("")
    by_ray = convert(f"{root}/in", f"{root}/ray", executor="ray", **common)

    killed = faults / "killed"
    assert killed.exists(), "no Ray worker took the kill marker"
    assert int(killed.read_text()) != os.getpid()  # a Ray worker died, not this process
    killed.unlink()
    assert pool.num_shards == by_ray.num_shards == 20 > 2 * IN_FLIGHT_PER_CPU
    expected = _objects(f"{root}/pool", options)
    got = _objects(f"{root}/ray", options)
    assert "fastload.json" in expected
    assert sorted(got) == sorted(expected)  # no conversion state or temporary left
    for key, data in expected.items():
        assert got[key] == data, key


def test_a_failing_ray_task_stops_the_run_and_the_cli_resumes_it(
    faults: Path, tmp_path: Path
) -> None:
    src = _local_reference(tmp_path)
    (faults / "fail").write_text("")
    (faults / "hold").write_text("")  # shards 9-11 wait until cancelled: they cannot finish
    try:
        with pytest.raises(ConversionError, match="injected failure") as info:
            convert(str(src), str(tmp_path / "ray"), executor="ray", **_LOCAL_OPTIONS)
    finally:
        (faults / "hold").unlink()
    assert "Ray task writing shard shard-000008.tar" in "".join(info.value.__notes__)
    # Shard 8 was submitted only when at most 4 tasks were outstanding, so at least 5 shards
    # were committed before it; the held shards 9-11 were cancelled, not written.
    done = {p.name for p in (tmp_path / "ray/_fastload_convert/done").iterdir()}
    assert len(done) >= 5, done
    assert done <= {f"shard-{n:06d}.tar.json" for n in range(8)}, done
    shards = {p.name + ".json" for p in (tmp_path / "ray").glob("shard-*.tar")}
    assert shards == done  # every shard there is whole and recorded
    assert not (tmp_path / "ray/fastload.json").exists()

    (faults / "fail").unlink()
    argv = [str(src), str(tmp_path / "ray"), "--shard-samples", "50", "--map", _MAP, "-q"]
    address = ray.get_runtime_context().gcs_address
    assert main(["convert", *argv, "--executor", "ray", "--ray-address", address]) == 0
    _assert_same_files(tmp_path / "local", tmp_path / "ray")


def test_ray_refuses_memory_stores_and_unknown_executors(tmp_path: Path) -> None:
    src = tmp_path / "src.jsonl"
    src.write_bytes(_jsonl(10))
    with pytest.raises(InvalidArgumentError, match="memory:// store lives in the converting"):
        convert(str(src), "memory://ray-out", executor="ray", quiet=True)
    with pytest.raises(InvalidArgumentError, match=r"executor \(--executor\) must be one of"):
        convert(str(src), str(tmp_path / "out"), executor="spark", quiet=True)


def test_a_killed_ray_driver_leaves_committed_shards_that_a_rerun_resumes(
    faults: Path, tmp_path: Path
) -> None:
    src = _local_reference(tmp_path)
    (faults / "slow").write_text("")  # 1 s per shard: the driver is killed half way
    address = ray.get_runtime_context().gcs_address
    argv = [str(src), str(tmp_path / "ray"), "--shard-samples", "50", "--map", _MAP, "-q"]
    driver = subprocess.Popen(
        [sys.executable, "-m", "fastload.cli", "convert", *argv, "--executor", "ray"],
        env={**os.environ, "RAY_ADDRESS": address},
    )
    done = tmp_path / "ray/_fastload_convert/done"
    try:
        while len(list(done.glob("*.json")) if done.is_dir() else []) < 3:
            assert driver.poll() is None, "the driver ended before it was killed"
            time.sleep(0.05)
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    (faults / "slow").unlink()
    assert not (tmp_path / "ray/fastload.json").exists()

    result = convert(str(src), str(tmp_path / "ray"), executor="ray", **_LOCAL_OPTIONS)
    assert 3 <= result.resumed_shards < result.num_shards == 12
    _assert_same_files(tmp_path / "local", tmp_path / "ray")
