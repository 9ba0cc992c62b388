"""Conversion under faults: SIGKILL at many points (local and S3), a full disk, live writers
beside a re-run, damaged compressed and truncated streamed sources.

Every kill test runs the real ``fastload convert`` command line and kills only the converting
process (``SIGKILL``), never its workers: they must die with it. A kill lands while a shard is being
written (a temporary file is present when the signal is sent); a slow ``--map`` hook, which is part
of the plan of the reference run too, keeps the shards small and slow enough to be caught.
"""

from __future__ import annotations

import gzip
import importlib
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fastload.cli import EXIT_SKIPPED, convert_exit_status
from fastload.errors import DatasetExistsError
from fastload.formats import get_format, read_manifest
from fastload.storage import LocalStore, MemoryStore, open_store
from fastload.testing.ceph import CephS3
from fastload.testing.corpus import write_image_folder

fc = importlib.import_module("fastload.convert")
_guard_module = importlib.import_module("fastload.convert._guard")

CLI = [sys.executable, "-m", "fastload.cli", "convert"]
FORMATS = ["webdataset", "tfrecord", "lmdb"]
EXT = {"webdataset": "tar", "tfrecord": "tfrecord", "lmdb": "lmdb"}
TMP = ".fastload-tmp-"
STATE = "_fastload_convert"

_HOOK = textwrap.dedent(
    """
    import time

    def slow(sample):
        time.sleep(0.003)
        return sample

    def slower(sample):
        time.sleep(0.03)
        return sample
    """
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """48 small photo-like JPEGs in 4 classes (``fastload.testing.corpus``)."""
    root = tmp_path_factory.mktemp("corpus") / "images"
    write_image_folder(root, 48, num_classes=4, scale=4, processes=1)
    return root


@pytest.fixture(scope="module")
def hook_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment for CLI runs: the slow map hooks importable by the workers."""
    hooks = tmp_path_factory.mktemp("hooks")
    (hooks / "convert_faults_hooks.py").write_text(_HOOK)
    path = os.pathsep.join(p for p in (str(hooks), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def _args(fmt: str, hook: str = "slow") -> list[str]:
    return [
        "--format", fmt, "--shard-samples", "4", "--workers", "2", "--quiet",
        "--map", f"convert_faults_hooks:{hook}",
    ]  # fmt: skip


def _tree(root: Path) -> dict[str, bytes]:
    """Relative path → bytes of every file under ``root``, hidden temporary files included."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rpartition(")")[2].split()[1]) == pid:
            out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _kill_when(
    proc: subprocess.Popen[bytes], ready: Callable[[], bool], what: str, poll: float = 0.0005
) -> list[int]:
    """SIGKILL ``proc`` (only it) as soon as ``ready()`` (asked every ``poll`` seconds); return
    the ids of its workers."""
    deadline = time.monotonic() + 30
    try:
        while not ready():
            if proc.poll() is not None:
                pytest.fail(f"the conversion finished before {what}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} within 30 s")
            time.sleep(poll)
        workers = _children(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    return workers


def _assert_workers_gone(workers: list[int]) -> None:
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.01)
    orphans = [p for p in workers if _alive(p)]
    for pid in orphans:  # do not leave them running when the test fails
        os.kill(pid, signal.SIGKILL)
    assert orphans == [], "workers outlived the killed conversion"


def _writing_shard(dst: Path, done_before: int) -> Callable[[], bool]:
    """True once ``done_before`` shards are recorded done and a shard file is being written."""
    done = dst / STATE / "done"

    def ready() -> bool:
        try:
            if len(os.listdir(done)) < done_before:
                return False
            return any(n.startswith(TMP) for n in os.listdir(dst))
        except FileNotFoundError:
            return False

    return ready


@pytest.fixture(scope="module")
def reference(
    tmp_path_factory: pytest.TempPathFactory, corpus: Path, hook_env: dict[str, str]
) -> Callable[[str], Path]:
    """An uninterrupted run of the CLI per format (made once, on first use)."""
    made: dict[str, Path] = {}

    def get(fmt: str) -> Path:
        if fmt not in made:
            ref = tmp_path_factory.mktemp(f"ref-{fmt}")
            subprocess.run([*CLI, str(corpus), str(ref), *_args(fmt)], env=hook_env, check=True)
            made[fmt] = ref
        return made[fmt]

    return get


@pytest.mark.parametrize("done_before", range(8))  # of 12 shards
@pytest.mark.parametrize("fmt", FORMATS)
def test_sigkill_mid_shard_then_rerun_leaves_exactly_the_dataset(
    tmp_path: Path,
    corpus: Path,
    hook_env: dict[str, str],
    reference: Callable[[str], Path],
    fmt: str,
    done_before: int,
) -> None:
    ref = reference(fmt)
    assert sorted(os.listdir(ref)) == sorted(
        ["fastload.json"]
        + [f"shard-{n:06d}.{EXT[fmt]}" for n in range(12)]
        + ([f"shard-{n:06d}.{EXT[fmt]}.idx" for n in range(12)] if fmt != "lmdb" else [])
    )
    dst = tmp_path / "dst"
    proc = subprocess.Popen([*CLI, str(corpus), str(dst), *_args(fmt)], env=hook_env)
    workers = _kill_when(proc, _writing_shard(dst, done_before), "a shard being written")
    assert workers, "the conversion had no worker processes"
    _assert_workers_gone(workers)
    assert not (dst / "fastload.json").exists()

    rerun = subprocess.run(
        [*CLI, str(corpus), str(dst), *_args(fmt)], env=hook_env, capture_output=True
    )

    assert rerun.returncode == 0, rerun.stderr.decode()
    assert sorted(os.listdir(dst)) == sorted(os.listdir(ref))
    assert _tree(dst) == _tree(ref)


@pytest.fixture(scope="module")
def jsonl_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three JSONL files of 40 records: 30 shards of 4, planned as they are written."""
    root = tmp_path_factory.mktemp("jsonl") / "records"
    root.mkdir()
    for f in range(3):
        lines = [json.dumps({"i": f * 40 + i, "txt": "r" * (i * 7 % 50)}) for i in range(40)]
        (root / f"part-{f}.jsonl").write_text("\n".join(lines) + "\n")
    return root


@pytest.mark.parametrize("point", ["plan", "1", "4", "9"])
def test_sigkill_while_the_plan_streams_then_rerun_is_byte_identical(
    tmp_path: Path, jsonl_corpus: Path, hook_env: dict[str, str], point: str
) -> None:
    """A JSONL conversion killed once its ``plan.json`` is written, or while a shard is written
    after 1, 4 or 9 of its 30 shards are done (the plan, a few shards ahead of the writing, is not
    whole yet), re-run: exactly the dataset of an uninterrupted run."""
    args = [*_args("webdataset", "slower"), "--on-error", "skip"]
    ref = tmp_path / "ref"
    subprocess.run([*CLI, str(jsonl_corpus), str(ref), *args], env=hook_env, check=True)
    assert len([n for n in os.listdir(ref) if n.endswith(".tar")]) == 30
    dst = tmp_path / "dst"
    proc = subprocess.Popen([*CLI, str(jsonl_corpus), str(dst), *args], env=hook_env)
    if point == "plan":
        ready: Callable[[], bool] = (dst / STATE / "plan.json").exists
    else:
        ready = _writing_shard(dst, int(point))
    workers = _kill_when(proc, ready, f"the kill point {point}")
    _assert_workers_gone(workers)
    assert not (dst / "fastload.json").exists()
    done = len(os.listdir(dst / STATE / "done")) if (dst / STATE / "done").is_dir() else 0
    assert done < 30
    rerun = subprocess.run(
        [*CLI, str(jsonl_corpus), str(dst), *args], env=hook_env, capture_output=True
    )
    assert rerun.returncode == 0, rerun.stderr.decode()
    assert _tree(dst) == _tree(ref)


_DEAD_WRITERS = textwrap.dedent(
    """
    import os, signal, sys
    from fastload.formats import get_format
    from fastload.storage import LocalStore
    store = LocalStore(sys.argv[1])
    shard = store.open_writer("shard-000001.tar")
    shard.write(b"x" * 1000)
    lmdb = get_format("lmdb").writer(store, "shard-000002.lmdb")
    lmdb.write({"__key__": "a", "txt": b"y" * 100000})
    done = store.open_writer("_fastload_convert/done/shard-000001.tar.json")
    done.write(b"{")
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_rerun_removes_dead_writers_files_and_keeps_live_ones(tmp_path: Path, corpus: Path) -> None:
    ref = tmp_path / "ref"
    fc.convert(corpus, ref, shard_samples=4, workers=1, quiet=True)
    dst = tmp_path / "dst"
    dead = subprocess.run([sys.executable, "-c", _DEAD_WRITERS, str(dst)])
    assert dead.returncode == -signal.SIGKILL
    left = sorted(n for n in os.listdir(dst) if n.startswith(TMP))
    assert len(left) == 2
    assert any(n.startswith(TMP + "lmdb-") for n in left)
    assert any(n.startswith(TMP) for n in os.listdir(dst / STATE / "done"))
    # A live writer (this process) in the same directory.
    store = LocalStore(dst)
    live = store.open_writer("notes.txt")
    live.write(b"still writing")
    live_tmp = [n for n in os.listdir(dst) if n.startswith(TMP) and n not in left]
    assert len(live_tmp) == 1

    fc.convert(corpus, dst, shard_samples=4, workers=1, quiet=True)

    assert sorted(os.listdir(dst)) == sorted([*os.listdir(ref), live_tmp[0]])
    assert _tree(ref) == {k: v for k, v in _tree(dst).items() if k != live_tmp[0]}
    live.commit()
    assert store.get("notes.txt") == b"still writing"
    assert sorted(os.listdir(dst)) == sorted([*os.listdir(ref), "notes.txt"])


def test_rerun_after_a_kill_past_the_manifest_removes_the_state(
    tmp_path: Path, corpus: Path
) -> None:
    dst = tmp_path / "dst"
    fc.convert(corpus, dst, shard_samples=4, workers=1, quiet=True)
    expected = _tree(dst)
    # What a run killed between its manifest and its clean-up leaves: state, lock, temporaries.
    (dst / STATE / "done").mkdir(parents=True)
    (dst / STATE / "done" / "shard-000000.tar.json").write_text("{}")
    (dst / STATE / ".fastload-tmp-convert.lock").write_text("pid 1 on host gone")
    (dst / (TMP + "abc123")).write_bytes(b"half a shard")

    result = fc.convert(corpus, dst, shard_samples=4, workers=1, quiet=True)

    assert result.resumed_shards == 12
    assert _tree(dst) == expected


_DEAD_SCRATCH = textwrap.dedent(
    """
    import os, signal
    from fastload.formats import get_format
    from fastload.storage import MemoryStore
    writer = get_format("lmdb").writer(MemoryStore(), "x.lmdb")
    writer.write({"__key__": "a", "txt": b"y" * 1000})
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_stale_temporaries_are_told_from_live_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastload.formats.lmdb._writer import remove_stale_scratch

    root = tmp_path / "store"
    dead = subprocess.run([sys.executable, "-c", _DEAD_WRITERS, str(root)])
    assert dead.returncode == -signal.SIGKILL
    store = LocalStore(root)
    state = root / STATE / "done"
    (dead_done,) = os.listdir(state)  # the dead writer's
    live = store.open_writer("_fastload_convert/done/live.json")
    live.write(b"{}")
    assert store.remove_stale_temporaries("elsewhere/") == []
    assert store.remove_stale_temporaries("_fastload_convert/done/x") == [str(state / dead_done)]
    assert len([n for n in os.listdir(state) if n.startswith(TMP)]) == 1  # the live one
    live.commit()
    assert os.listdir(state) == ["live.json"]
    # The root still holds the dead shard writer's file and LMDB scratch directory.
    assert len(store.remove_stale_temporaries()) == 2
    assert sorted(os.listdir(root)) == [STATE]

    # LMDB writers for non-local stores keep their scratch in the system temporary directory.
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}
    dead = subprocess.run([sys.executable, "-c", _DEAD_SCRATCH], env=env)
    assert dead.returncode == -signal.SIGKILL
    monkeypatch.setattr("tempfile.tempdir", str(scratch))
    writer = get_format("lmdb").writer(MemoryStore(), "live.lmdb")
    assert len(os.listdir(scratch)) == 2
    (removed,) = remove_stale_scratch()
    assert os.listdir(scratch) != []
    assert not os.path.exists(removed)
    writer.abort()
    assert os.listdir(scratch) == []


def test_a_second_conversion_into_a_busy_destination_is_refused(
    tmp_path: Path, corpus: Path, hook_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = tmp_path / "dst"
    args = [*CLI, str(corpus), str(dst), *_args("webdataset", "slower")]
    proc = subprocess.Popen(args, env=hook_env)
    try:
        lock = dst / STATE / ".fastload-tmp-convert.lock"
        deadline = time.monotonic() + 30
        while not (lock.exists() and lock.read_bytes()):
            assert proc.poll() is None
            assert time.monotonic() < deadline
            time.sleep(0.005)
        monkeypatch.setattr(_guard_module, "LOCK_WAIT", 0.2)
        with pytest.raises(DatasetExistsError) as refused:
            fc.convert(corpus, dst, shard_samples=4, workers=1, quiet=True)
        assert f"is being written by another fastload convert (pid {proc.pid} on host" in str(
            refused.value
        )
        assert proc.wait(60) == 0
    finally:
        proc.kill()
        proc.wait()
    assert sorted(os.listdir(dst)) == [
        "fastload.json",
        *sorted(f"shard-{n:06d}.tar{idx}" for n in range(12) for idx in ("", ".idx")),
    ]


# ---- S3 --------------------------------------------------------------------------------------


def _s3_env(ceph_s3: CephS3, hook_env: dict[str, str]) -> dict[str, str]:
    return {
        **hook_env,
        "AWS_ENDPOINT_URL": ceph_s3.endpoint_url,
        "AWS_ACCESS_KEY_ID": ceph_s3.access_key_id,
        "AWS_SECRET_ACCESS_KEY": ceph_s3.secret_access_key,
        "AWS_DEFAULT_REGION": ceph_s3.region,
    }


def _objects(client: Any, bucket: str, prefix: str) -> dict[str, bytes]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", ()):
            body = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
            out[obj["Key"][len(prefix) :]] = body
    return out


def _uploads(client: Any, bucket: str, prefix: str) -> list[str]:
    found = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", ())
    return [u["Key"] for u in found]


def _done_records(client: Any, bucket: str, prefix: str, at_least: int) -> Callable[[], bool]:
    """True once the plan (``at_least=0``) or ``at_least`` done records are in the bucket."""
    where = f"{prefix}{STATE}/done/" if at_least else f"{prefix}{STATE}/plan.json"

    def ready() -> bool:
        listed = client.list_objects_v2(Bucket=bucket, Prefix=where)
        return int(listed.get("KeyCount", 0)) >= max(1, at_least)

    return ready


#: ``slower`` (30 ms a sample, 0.36 s a shard): the last shards cannot finish between the done
#: records the kill waits for and the kill itself (shards are written as soon as they are planned).
_S3_ARGS = [
    "--format", "webdataset", "--shard-samples", "12", "--workers", "2", "--quiet",
    "--map", "convert_faults_hooks:slower",
]  # fmt: skip


@pytest.fixture(scope="module")
def s3_reference(
    ceph_s3: CephS3, s3_client: Any, corpus: Path, hook_env: dict[str, str]
) -> Iterator[dict[str, bytes]]:
    """The objects of an uninterrupted conversion into S3 (4 shards), in a bucket of its own."""
    bucket = f"fl-ref-{os.getpid()}"
    s3_client.create_bucket(Bucket=bucket)
    try:
        url = f"s3://{bucket}/ref"
        subprocess.run(
            [*CLI, str(corpus), url, *_S3_ARGS], env=_s3_env(ceph_s3, hook_env), check=True
        )
        objects = _objects(s3_client, bucket, "ref/")
        yield objects
    finally:
        for key in _objects(s3_client, bucket, ""):
            s3_client.delete_object(Bucket=bucket, Key=key)
        s3_client.delete_bucket(Bucket=bucket)


@pytest.mark.ceph
@pytest.mark.parametrize("done_before", [0, 1, 2])  # of 4 shards; 0: once the plan is written
def test_sigkill_then_rerun_on_s3_leaves_exactly_the_dataset(
    ceph_s3: CephS3,
    s3_bucket: str,
    s3_client: Any,
    corpus: Path,
    hook_env: dict[str, str],
    s3_reference: dict[str, bytes],
    done_before: int,
) -> None:
    assert len(s3_reference) == 9  # 4 shards, 4 indexes, the manifest
    env = _s3_env(ceph_s3, hook_env)
    dst = f"s3://{s3_bucket}/ds/"
    proc = subprocess.Popen([*CLI, str(corpus), dst, *_S3_ARGS], env=env)
    ready = _done_records(s3_client, s3_bucket, "ds/", done_before)
    _assert_workers_gone(_kill_when(proc, ready, f"kill point {done_before}", poll=0.02))
    assert "fastload.json" not in _objects(s3_client, s3_bucket, "ds/")

    rerun = subprocess.run([*CLI, str(corpus), dst, *_S3_ARGS], env=env, capture_output=True)

    assert rerun.returncode == 0, rerun.stderr.decode()
    assert _objects(s3_client, s3_bucket, "ds/") == s3_reference
    assert _uploads(s3_client, s3_bucket, "ds/") == []


@pytest.mark.ceph
def test_rerun_on_s3_aborts_the_multipart_upload_of_a_killed_run(
    ceph_s3: CephS3, s3_bucket: str, s3_client: Any, tmp_path: Path, hook_env: dict[str, str]
) -> None:
    src = tmp_path / "big" / "c0"
    src.mkdir(parents=True)
    for i in range(4):  # two shards of 9 MiB: more than one 8 MiB part each
        (src / f"{i}.bin").write_bytes(bytes([i]) * (4_500_000 + i))
    env = _s3_env(ceph_s3, hook_env)
    args = ["--format", "webdataset", "--shard-samples", "2", "--workers", "1", "--quiet"]
    dst = f"s3://{s3_bucket}/ds/"
    proc = subprocess.Popen([*CLI, str(src.parent), dst, *args], env=env)
    uploading = lambda: bool(_uploads(s3_client, s3_bucket, "ds/"))  # noqa: E731
    _kill_when(proc, uploading, "a multipart upload", poll=0.02)
    assert _uploads(s3_client, s3_bucket, "ds/")
    rerun = subprocess.run([*CLI, str(src.parent), dst, *args], env=env, capture_output=True)
    assert rerun.returncode == 0, rerun.stderr.decode()
    assert _uploads(s3_client, s3_bucket, "ds/") == []
    assert sorted(_objects(s3_client, s3_bucket, "ds/")) == [
        "fastload.json",
        "shard-000000.tar",
        "shard-000000.tar.idx",
        "shard-000001.tar",
        "shard-000001.tar.idx",
    ]


# ---- a full disk -------------------------------------------------------------------------------


def _file_size_limit(limit: int) -> Callable[[], None]:
    def apply() -> None:  # in the child, before exec: write() then fails with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.parametrize("fmt", FORMATS)
def test_disk_full_stops_with_a_clear_error_and_the_rerun_completes(
    tmp_path: Path, fmt: str
) -> None:
    src = tmp_path / "src" / "c0"
    src.mkdir(parents=True)
    for i in range(30):  # shard 5 (samples 20..24) holds the one 300 KB file
        (src / f"f{i:03d}.bin").write_bytes(bytes([i]) * (300_000 if i == 22 else 10_000 + i))
    args = [str(src.parent), "", "--format", fmt, "--shard-samples", "4", "--workers", "2", "-q"]
    ref, dst = tmp_path / "ref", tmp_path / "dst"
    subprocess.run([*CLI, *args[:1], str(ref), *args[2:]], check=True)

    full = subprocess.run(
        [*CLI, *args[:1], str(dst), *args[2:]],
        preexec_fn=_file_size_limit(200_000),
        capture_output=True,
        text=True,
    )
    assert full.returncode == 1  # "error" in the CLI's exit codes
    shard = f"shard-000005.{EXT[fmt]}"
    assert f"cannot write shard {dst.as_uri()}/{shard} " in full.stderr
    assert "file size limit" in full.stderr
    assert "then re-run the same command" in full.stderr
    assert "Traceback" not in full.stderr
    names = os.listdir(dst)
    assert shard not in names
    assert not [n for n in names if n.startswith(TMP)]
    assert not [p for p in dst.rglob("*") if p.name.startswith(TMP)]
    shards = [n for n in names if n.startswith("shard-")]
    assert sorted(names) == sorted([*shards, STATE])
    assert sorted(os.listdir(dst / STATE)) == ["done", "plan.json"]  # resume state; no lock
    assert all(_tree(ref)[n] == (dst / n).read_bytes() for n in shards)  # finished ones are whole

    rerun = subprocess.run([*CLI, *args[:1], str(dst), *args[2:]], capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    assert sorted(os.listdir(dst)) == sorted(os.listdir(ref))
    assert _tree(dst) == _tree(ref)


# ---- damaged sources that stream ---------------------------------------------------------------


def _tfrecord(n: int) -> tuple[bytes, list[int]]:
    """A TFRecord file of ``n`` records (keys ``r000``...) and the end offset of each record."""
    store = MemoryStore()
    writer = get_format("tfrecord").writer(store, "plain.tfrecord", index=False)
    for i in range(n):
        writer.write({"__key__": f"r{i:03d}", "txt": f"record {i} ".encode() * (20 + i % 7)})
    writer.close()
    data = store.get("plain.tfrecord")
    ends, pos = [], 0
    while pos < len(data):
        pos += int.from_bytes(data[pos : pos + 8], "little") + 16
        ends.append(pos)
    return data, ends


def _damaged(raw: bytes, wbits: int) -> tuple[bytes, int]:
    """``raw`` compressed (gzip or zlib by ``wbits``) in 8 KiB pieces, each ending with a full
    flush, with the block after the middle flush point damaged (block type 3, which does not
    exist); and the decompressed length before the damage."""
    packer = zlib.compressobj(6, zlib.DEFLATED, wbits)
    parts, flushes, size = [], [], 0
    for pos in range(0, len(raw), 8192):
        parts.append(packer.compress(raw[pos : pos + 8192]) + packer.flush(zlib.Z_FULL_FLUSH))
        size += len(parts[-1])
        flushes.append((size, min(pos + 8192, len(raw))))
    packed = b"".join([*parts, packer.flush()])
    at, good = flushes[len(flushes) // 2]
    return packed[:at] + b"\x07" + packed[at + 1 :], good


@pytest.mark.parametrize("compression", ["gzip", "zlib"])
@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_damaged_compressed_tfrecord_source_keeps_its_intact_records(
    tmp_path: Path, compression: str, damage: str
) -> None:
    raw, ends = _tfrecord(200)
    wbits = 31 if compression == "gzip" else 15
    if damage == "truncated":
        packed = gzip.compress(raw, mtime=0) if compression == "gzip" else zlib.compress(raw)
        bad = packed[: len(packed) * 2 // 3]
        good = len(zlib.decompressobj(wbits).decompress(bad))
    else:
        bad, good = _damaged(raw, wbits)
    kept = [f"r{i:03d}" for i, end in enumerate(ends) if end <= good]
    assert 50 < len(kept) < 200
    name = "part.tfrecord.gz" if compression == "gzip" else "part.tfrecord.zz"
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (src / name).write_bytes(bad)

    result = fc.convert(src, dst, format="tfrecord", on_error="skip", workers=1, quiet=True)

    assert convert_exit_status(result) == EXIT_SKIPPED == 3
    assert [s.item for s in result.skipped] == [f"{name}@{good}"]
    assert f"{compression}-compressed TFRecord stream" in result.skipped[0].reason
    assert f"the {len(kept)} intact samples of the file are converted" in result.skipped[0].reason
    lines = (dst / "_fastload_skipped.jsonl").read_text().splitlines()
    assert [json.loads(line)["item"] for line in lines] == [f"{name}@{good}"]
    manifest = read_manifest(open_store(str(dst)))
    assert manifest.created_by["skipped"] == 1
    got = [s["__key__"] for s in get_format("tfrecord").reader(open_store(str(dst)), _one(dst))]
    assert got == kept


def _one(dst: Path) -> str:
    (shard,) = [n for n in os.listdir(dst) if n.endswith(".tfrecord")]
    return shard


def test_truncated_webdataset_source_keeps_the_samples_before_the_cut(tmp_path: Path) -> None:
    store = MemoryStore()
    writer = get_format("webdataset").writer(store, "a.tar", index=False)
    for i in range(20):
        writer.write({"__key__": f"k{i:02d}", "txt": bytes([i]) * 3000, "cls": str(i).encode()})
    writer.close()
    full = store.get("a.tar")
    per_sample = len(full[:-1024]) // 20  # 512 + 3072 (txt) + 512 + 512 (cls)
    cut = 10 * per_sample + 3584 + 600  # inside sample 10's second member
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (src / "a.tar").write_bytes(full[:cut])

    result = fc.convert(src, dst, format="lmdb", on_error="skip", workers=1, quiet=True)

    assert result.num_samples == 10
    assert len(result.skipped) == 1
    assert result.skipped[0].item.startswith("a.tar@")
    assert "the 10 intact samples of the file are converted" in result.skipped[0].reason
    reader = get_format("lmdb").reader(open_store(str(dst)), "shard-000000.lmdb")
    assert [s["__key__"] for s in reader] == [f"k{i:02d}" for i in range(10)]
