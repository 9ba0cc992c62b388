"""Determinism, resumption after SIGKILL, error policies, existing destinations, dry runs."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fastload.cli import EXIT_SKIPPED, convert_exit_status
from fastload.errors import DatasetExistsError, InvalidArgumentError, WorkerError

# fastload.convert is also the function re-exported as fastload.convert once fastload/__init__.py
# exports it, which shadows the package attribute: take the module from sys.modules.
fc = importlib.import_module("fastload.convert")

CLI = [sys.executable, "-m", "fastload.cli"]


def test_workers_do_not_change_the_bytes(
    tmp_path: Path, real_fmt: str, cv: Any, image_folder: Any
) -> None:
    root, expected = image_folder
    fmt = real_fmt
    runs = {}
    for workers in (1, 2):
        dst = tmp_path / f"w{workers}"
        fc.convert(
            root,
            dst,
            format=fmt,
            workers=workers,
            shard_samples=4,
            shuffle=True,
            seed=7,
            quiet=True,
        )
        runs[workers] = cv.tree_bytes(dst)
    assert runs[1] == runs[2]
    assert len([k for k in runs[1] if k.startswith("shard-")]) >= 6
    assert cv.read_dataset(tmp_path / "w2") == expected
    # shuffled: not the sorted order, and another seed gives another order
    keys = cv.ordered_keys(tmp_path / "w1")
    assert keys != sorted(keys)
    fc.convert(
        root,
        tmp_path / "s8",
        format=fmt,
        workers=1,
        shard_samples=4,
        shuffle=True,
        seed=8,
        quiet=True,
    )
    assert cv.ordered_keys(tmp_path / "s8") != keys
    assert sorted(cv.ordered_keys(tmp_path / "s8")) == sorted(keys)


def test_shuffled_record_source_is_deterministic(tmp_path: Path, cv: Any, real_fmt: str) -> None:
    src = tmp_path / "a.jsonl"
    cv.write_jsonl(src, [{"i": i, "pad": "x" * (i % 7)} for i in range(40)])
    outs = []
    for workers in (1, 2):
        dst = tmp_path / f"o{workers}"
        fc.convert(
            src,
            dst,
            format=real_fmt,
            workers=workers,
            shard_samples=6,
            shuffle=True,
            seed=3,
            quiet=True,
        )
        outs.append(cv.tree_bytes(dst))
    assert outs[0] == outs[1]
    got = cv.read_dataset(tmp_path / "o1")
    assert {v["i"] for v in got.values()} == {str(i).encode() for i in range(40)}


def test_shard_size_limit(tmp_path: Path, cv: Any, image_folder: Any) -> None:
    root, expected = image_folder
    result = fc.convert(
        root, tmp_path / "o", format="fake", shard_size="8KB", workers=1, quiet=True
    )
    assert result.num_shards > 3
    assert result.manifest is not None
    # every shard holds several samples unless one sample alone is over the limit
    assert all(s.num_bytes <= 8000 + 3100 for s in result.manifest.shards)
    assert cv.read_dataset(tmp_path / "o") == expected


def _slow_hook(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "slowhook_convert_test.py").write_text(
        "import time\n\ndef slow(sample):\n    time.sleep(0.01)\n    return sample\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    return env


def _many_files(root: Path, n: int = 160) -> None:
    for i in range(n):
        d = root / f"c{i % 4}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i:04d}.jpg").write_bytes(bytes([i % 256]) * (100 + i))


@pytest.mark.parametrize("kill_after", ["first_shard", "planning"])
def test_resume_after_sigkill_is_byte_identical(tmp_path: Path, cv: Any, kill_after: str) -> None:
    fmt = "webdataset" if "webdataset" in cv.real_formats() else "fake"
    src = tmp_path / "src"
    _many_files(src)
    env = _slow_hook(tmp_path)
    args = [
        "convert", str(src), "", "--format", fmt, "--shard-samples", "10", "--workers", "2",
        "--map", "slowhook_convert_test:slow", "--quiet",
    ]  # fmt: skip

    def cmd(dst: Path) -> list[str]:
        a = list(args)
        a[2] = str(dst)
        return CLI + a

    ref = tmp_path / "ref"
    subprocess.run(cmd(ref), env=env, check=True, timeout=120)
    reference = cv.tree_bytes(ref)
    shard_names = [k for k in reference if k.startswith("shard-")]
    assert len(shard_names) == 32  # 16 shards + indexes

    dst = tmp_path / "dst"
    proc = subprocess.Popen(cmd(dst), env=env, start_new_session=True)
    deadline = time.monotonic() + 60
    seen_complete = 0
    try:
        while time.monotonic() < deadline:
            if dst.exists():
                # No partial shard is ever visible under its final name.
                for name in os.listdir(dst):
                    if name in reference:
                        data = (dst / name).read_bytes()
                        if name.startswith("shard-") and name.endswith(
                            ".tar" if fmt == "webdataset" else ".fake"
                        ):
                            assert data == reference[name], f"{name} visible but incomplete"
                            seen_complete += 1
                if kill_after == "planning" and (dst / "_fastload_convert" / "plan.json").exists():
                    break
                if kill_after == "first_shard" and seen_complete:
                    break
            time.sleep(0.005)
        else:
            pytest.fail("the conversion did not get far enough to be killed")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (dst / "fastload.json").exists()
    done = cv.tree_bytes(dst)
    for name, data in done.items():
        if name.startswith("shard-"):
            assert data == reference[name], f"{name} differs after the kill"
    finished = subprocess.run(cmd(dst), env=env, timeout=120, capture_output=True, text=True)
    assert finished.returncode == 0, finished.stderr
    assert cv.tree_bytes(dst) == reference


def test_on_error_skip_reports_every_item(tmp_path: Path, cv: Any) -> None:
    src = tmp_path / "src"
    src.mkdir()
    cv.write_jsonl(src / "a.jsonl", [{"t": "ok"}, "{not json", [1, 2], {"t": "ok2"}])
    (src / "b.jsonl").write_bytes(b'{"t": "fine"}\n')
    dst = tmp_path / "dst"
    proc = subprocess.run(
        [
            *CLI,
            "convert",
            str(src),
            str(dst),
            "--format",
            "webdataset",
            "--on-error",
            "skip",
            "--workers",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3, proc.stderr
    assert "skipped 2 items" in proc.stderr
    report = [
        json.loads(line) for line in (dst / "_fastload_skipped.jsonl").read_text().splitlines()
    ]
    assert [r["item"] for r in report] == ["a.jsonl:2", "a.jsonl:3"]
    assert "not valid JSON" in report[0]["reason"]
    assert "not an object" in report[1]["reason"]
    assert report[0]["shard"] == "shard-000000.tar"
    assert set(cv.read_dataset(dst)) == {"a/000000000", "a/000000003", "b/000000000"}
    manifest = json.loads((dst / "fastload.json").read_text())
    assert manifest["created_by"]["skipped"] == 2


def test_on_error_raise_names_the_item_and_keeps_finished_shards(tmp_path: Path, cv: Any) -> None:
    src = tmp_path / "a.jsonl"
    cv.write_jsonl(src, [{"i": i} for i in range(10)] + ["{broken"])
    dst = tmp_path / "dst"
    proc = subprocess.run(
        [
            *CLI,
            "convert",
            str(src),
            str(dst),
            "--format",
            "webdataset",
            "--shard-samples",
            "5",
            "--workers",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "a.jsonl:11" in proc.stderr
    assert "not valid JSON" in proc.stderr
    assert "--on-error skip" in proc.stderr
    assert not (dst / "fastload.json").exists()
    # the two finished shards are kept, the failed one is not visible
    assert (dst / "shard-000000.tar").exists()
    assert (dst / "shard-000001.tar").exists()
    assert not (dst / "shard-000002.tar").exists()
    assert (dst / "_fastload_convert" / "done" / "shard-000001.tar.json").exists()


def test_planning_errors(tmp_path: Path, cv: Any) -> None:
    src = tmp_path / "img"
    (src / "cat").mkdir(parents=True)
    (src / "cat" / "a.b.jpg").write_bytes(b"1")
    (src / "cat" / "a_b.jpg").write_bytes(b"2")  # same key after sanitizing: a collision
    (src / "cat" / "empty.jpg").write_bytes(b"")
    (src / "cat" / "good.jpg").write_bytes(b"3")
    with pytest.raises(fc.ConversionError, match=r"a_b\.jpg.*already taken by 'cat/a\.b\.jpg'"):
        fc.convert(src, tmp_path / "o", format="fake", workers=1, quiet=True)
    assert not (tmp_path / "o").exists()
    result = fc.convert(src, tmp_path / "o", format="fake", workers=1, quiet=True, on_error="skip")
    assert convert_exit_status(result) == EXIT_SKIPPED == 3
    assert [(s.item, s.shard) for s in result.skipped] == [
        ("cat/a_b.jpg", None),
        ("cat/empty.jpg", None),
    ]
    assert set(cv.read_dataset(tmp_path / "o")) == {"cat/a_b", "cat/good"}


def test_missing_and_empty_inputs(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        fc.convert(tmp_path / "nope", tmp_path / "o", format="fake", quiet=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidArgumentError, match="empty input"):
        fc.convert(tmp_path / "empty", tmp_path / "o", format="fake", quiet=True)
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(InvalidArgumentError, match="no samples"):
        fc.convert(tmp_path / "blank.jsonl", tmp_path / "o", format="fake", quiet=True)
    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "a.csv").write_text("x,y\n1,2\n")
    (tmp_path / "csv" / "b.csv").write_text("x,z\n1,2\n")
    with pytest.raises(fc.ConversionError, match="inconsistent columns"):
        fc.convert(tmp_path / "csv", tmp_path / "o", format="fake", quiet=True)
    with pytest.raises(InvalidArgumentError, match="inside the source"):
        fc.convert(tmp_path / "csv", tmp_path / "csv" / "out", format="fake", quiet=True)
    with pytest.raises(InvalidArgumentError, match="unknown shard format"):
        fc.convert(tmp_path / "csv", tmp_path / "o", format="zip", quiet=True)
    assert not (tmp_path / "o").exists()


def test_existing_destination(tmp_path: Path, cv: Any, image_folder: Any) -> None:
    root, _ = image_folder
    dst = tmp_path / "dst"
    first = fc.convert(root, dst, format="fake", workers=1, quiet=True, shard_samples=5)
    before = cv.tree_bytes(dst)
    again = fc.convert(root, dst, format="fake", workers=1, quiet=True, shard_samples=5)
    assert again.resumed_shards == first.num_shards
    assert cv.tree_bytes(dst) == before
    with pytest.raises(DatasetExistsError, match="overwrite"):
        fc.convert(root, dst, format="fake", workers=1, quiet=True, shard_samples=3)
    assert cv.tree_bytes(dst) == before
    result = fc.convert(
        root, dst, format="fake", workers=1, quiet=True, shard_samples=10, overwrite=True
    )
    assert result.num_shards == 3
    names = sorted(k for k in cv.tree_bytes(dst) if k.startswith("shard-"))
    assert names == [f"shard-{i:06d}.fake{x}" for i in range(3) for x in ("", ".idx")]
    # foreign shards with our names are not silently mixed in
    other = tmp_path / "other"
    other.mkdir()
    (other / "shard-000000.tar").write_bytes(b"x")
    with pytest.raises(DatasetExistsError):
        fc.convert(root, other, format="fake", workers=1, quiet=True)


def test_dry_run_writes_nothing(tmp_path: Path, image_folder: Any) -> None:
    root, _expected = image_folder
    dst = tmp_path / "dst"
    proc = subprocess.run(
        [
            *CLI,
            "convert",
            str(root),
            str(dst),
            "--format",
            "webdataset",
            "--shard-samples",
            "4",
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "samples: 21" in proc.stderr
    assert "shards: 6" in proc.stderr
    assert "shard-000005.tar" not in proc.stderr or "..." in proc.stderr
    assert not dst.exists()


def test_cli_usage_errors() -> None:
    proc = subprocess.run([*CLI, "convert", "--bogus"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    helptext = subprocess.run(
        [*CLI, "convert", "--help"], capture_output=True, text=True, timeout=60
    )
    assert "exit status" in helptext.stdout
    assert "3    convert completed" in helptext.stdout


def test_file_vanishing_after_planning_is_skipped(
    tmp_path: Path, cv: Any, image_folder: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastload.convert.sources import ImageFolderSource

    root, expected = image_folder
    victim = root / "class01" / "im.004.jpg"
    original = ImageFolderSource.plan_units

    def plan_then_delete(self: ImageFolderSource, report: Any) -> Any:
        units = original(self, report)
        victim.unlink()
        return units

    monkeypatch.setattr(ImageFolderSource, "plan_units", plan_then_delete)
    result = fc.convert(root, tmp_path / "o", format="fake", workers=1, quiet=True, on_error="skip")
    assert [(s.item, s.shard) for s in result.skipped] == [
        ("class01/im.004.jpg", "shard-000000.fake")
    ]
    assert "ObjectNotFoundError" in result.skipped[0].reason
    assert result.skipped_report is not None
    lines = (tmp_path / "o" / "_fastload_skipped.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["item"] == "class01/im.004.jpg"
    got = cv.read_dataset(tmp_path / "o")
    del expected["class01/im_004"]
    assert got == expected


def test_progress_lines_when_not_a_tty() -> None:
    import io

    from fastload.convert._progress import Progress

    out = io.StringIO()
    progress = Progress(100, 10_000, stream=out, interval=0.0)
    progress.update(40, 4_000_000)
    progress.update(100, 10_000_000)
    progress.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("fastload convert: 40/100 samples (40.0%)")
    assert "MB/s" in lines[1]
    assert "ETA" in lines[1]
    quiet = io.StringIO()
    Progress(10, 10, stream=quiet, quiet=True, interval=0.0).update(5, 5)
    assert quiet.getvalue() == ""


def test_whitespace_in_file_names(tmp_path: Path, real_fmt: str, cv: Any) -> None:
    src = tmp_path / "src" / "my class"
    src.mkdir(parents=True)
    (src / "IMG 0001.JPG").write_bytes(b"a")
    (src / "IMG\t0002.jpg").write_bytes(b"b")
    fc.convert(tmp_path / "src", tmp_path / "o", format=real_fmt, workers=1, quiet=True)
    assert cv.read_dataset(tmp_path / "o") == {
        "my_class/IMG_0001": {"jpg": b"a", "cls": b"0"},
        "my_class/IMG_0002": {"jpg": b"b", "cls": b"0"},
    }


def test_worker_death_is_reported_and_the_rerun_resumes(
    tmp_path: Path, cv: Any, image_folder: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, _ = image_folder
    hook, marker = cv.kill_hook(tmp_path, monkeypatch, "class02/im_003")
    options: dict[str, Any] = {
        "format": "webdataset",
        "shard_samples": 3,
        "map_fn": hook,
        "quiet": True,
    }
    fc.convert(root, tmp_path / "ref", workers=1, **options)
    reference = cv.tree_bytes(tmp_path / "ref")

    marker.touch()
    dst = tmp_path / "dst"
    with pytest.raises(WorkerError, match="worker process died"):
        fc.convert(root, dst, workers=2, **options)
    assert not (dst / "fastload.json").exists()
    for name, data in cv.tree_bytes(dst).items():  # whatever is there is complete
        if name.startswith("shard-"):
            assert data == reference[name], name

    marker.unlink()
    fc.convert(root, dst, workers=2, **options)
    assert cv.tree_bytes(dst) == reference


def test_commits_overlap_the_next_shard_and_errors_stop_cleanly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker_module = importlib.import_module("fastload.convert._worker")
    events: list[str] = []

    class Writer:
        def __init__(self, n: int) -> None:
            self.n = n

        def abort(self) -> None:
            events.append(f"abort {self.n}")

    def write_samples(job: Any) -> Any:
        events.append(f"write {job}")
        return worker_module.Written(job, Writer(job), [], 0)

    def commit_shard(written: Any) -> dict[str, Any]:
        events.append(f"commit start {written.job}")
        time.sleep(0.2)
        if written.job == 1:
            raise OSError("disk full (test)")
        events.append(f"commit end {written.job}")
        return {"shard": written.job}

    monkeypatch.setattr(worker_module, "write_samples", write_samples)
    monkeypatch.setattr(worker_module, "commit_shard", commit_shard)

    assert worker_module.write_shards(iter([0])) == [{"shard": 0}]
    events.clear()
    with pytest.raises(OSError, match="disk full"):
        worker_module.write_shards(iter([0, 1, 2, 3]))
    # Shard 1 is written while shard 0 commits; shard 2 is written while shard 1 commits; when
    # shard 1's commit fails, shard 2 (written, not committed) is aborted and no more is written.
    assert events.index("write 1") < events.index("commit end 0") < events.index("commit start 1")
    assert events.index("write 2") < events.index("abort 2") == len(events) - 1
    assert not {"commit end 1", "commit start 2", "write 3"} & set(events)


def test_forkserver_workers_write_the_same_bytes(
    tmp_path: Path, cv: Any, image_folder: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Forked workers are the default; a process that runs threads starts them by forkserver,
    # which passes the job queue at spawn time and starts the workers before planning.
    import multiprocessing

    pool_module = importlib.import_module("fastload.convert._pool")
    root, _ = image_folder
    options: dict[str, Any] = {"format": "webdataset", "shard_samples": 4, "quiet": True}
    fc.convert(root, tmp_path / "ref", workers=1, **options)
    monkeypatch.setattr(
        pool_module, "pool_context", lambda: multiprocessing.get_context("forkserver")
    )
    fc.convert(root, tmp_path / "fs", workers=2, **options)
    assert cv.tree_bytes(tmp_path / "fs") == cv.tree_bytes(tmp_path / "ref")
