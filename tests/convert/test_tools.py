"""``fastload inspect``, ``verify`` and ``index`` on our datasets and on third-party shards; on many
shards, parallel ``verify`` reports what a sequential one does and ``inspect --json`` streams."""

from __future__ import annotations

import importlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import webdataset as wds

from fastload import open_dataset
from fastload.errors import ManifestTotalsError
from fastload.formats import read_manifest
from fastload.loader import OrderOptions, order_quality
from fastload.storage import open_store

# fastload.convert is also the function re-exported as fastload.convert once fastload/__init__.py
# exports it, which shadows the package attribute: take the module from sys.modules.
fc = importlib.import_module("fastload.convert")

CLI = [sys.executable, "-m", "fastload.cli"]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)


def _converted(tmp_path: Path, image_folder: Any, fmt: str, shard_samples: int) -> Path:
    """The 21-image folder converted to ``fmt`` in shards of ``shard_samples``."""
    root, _ = image_folder
    dst = tmp_path / "ds"
    fc.convert(root, dst, format=fmt, shard_samples=shard_samples, workers=1, quiet=True)
    return dst


@pytest.fixture
def dataset(tmp_path: Path, image_folder: Any, real_fmt: str) -> Path:
    """21 samples in 3 shards."""
    return _converted(tmp_path, image_folder, real_fmt, 8)


@pytest.fixture
def many_shards(tmp_path: Path, image_folder: Any, real_fmt: str) -> Path:
    """21 samples in 11 shards of 2 (the last of 1): enough for several verify workers."""
    return _converted(tmp_path, image_folder, real_fmt, 2)


def test_inspect_table_and_json(dataset: Path, real_fmt: str) -> None:
    proc = _cli("inspect", str(dataset))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"format    {real_fmt}" in out
    assert "samples   21" in out
    assert "classes   3: class00, class01, class02" in out
    assert "shard-000002." in out
    assert "class00/im_000" in out
    assert "jpg=" in out
    info = json.loads(_cli("inspect", str(dataset), "--json", "--samples", "2").stdout)
    assert info["num_samples"] == 21
    assert info["num_shards"] == 3
    assert [s["key"] for s in info["samples"]] == ["class00/im_000", "class00/im_001"]
    assert set(info["samples"][0]["field_bytes"]) == {"cls", "jpg"}
    assert info["samples"][0]["field_bytes"]["cls"] == 1


def test_verify_ok_then_flipped_byte(dataset: Path, real_fmt: str) -> None:
    proc = _cli("verify", str(dataset))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("OK: checked 3 shards, read 21 samples")
    manifest = read_manifest(open_store(dataset))
    victim = dataset / manifest.shards[1].name
    data = bytearray(victim.read_bytes())
    pos = len(data) // 3
    data[pos] ^= 0x01
    victim.write_bytes(bytes(data))
    proc = _cli("verify", str(dataset), "--json")
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    assert not report["ok"]
    assert any(manifest.shards[1].name in p and "SHA-256" in p for p in report["problems"])
    assert all(manifest.shards[0].name not in p for p in report["problems"])


def test_verify_reports_missing_shard_and_bad_index(dataset: Path, real_fmt: str) -> None:
    manifest = read_manifest(open_store(dataset))
    (dataset / manifest.shards[0].name).unlink()
    if manifest.shards[2].index:
        idx = dataset / manifest.shards[2].index
        idx.write_bytes(idx.read_bytes() + b"0 0\n")
    report = fc.verify_dataset(dataset)
    assert any("shard is missing" in p for p in report.problems)
    if manifest.shards[2].index:
        assert any("index differs" in p for p in report.problems)
    # index rebuilds the damaged index; only the missing shard remains a problem
    if manifest.shards[2].index:
        with pytest.raises(FileNotFoundError):
            fc.index_dataset(dataset)  # the missing shard cannot be indexed


def test_an_edited_shard_entry_is_named_and_verify_lists_every_other_problem(
    dataset: Path, real_fmt: str
) -> None:
    """A shard entry whose size was edited (and a shard deleted): opening names both shards;
    verify reports the totals, the wrong size and the missing shard, and a damaged shard too."""
    doc = json.loads((dataset / "fastload.json").read_text())
    first, second, third = (s["name"] for s in doc["shards"])
    real = doc["shards"][1]["num_bytes"]
    doc["shards"][1]["num_bytes"] = real + 512  # the totals now disagree with the entries
    (dataset / "fastload.json").write_text(json.dumps(doc))
    (dataset / first).unlink()
    with pytest.raises(ManifestTotalsError) as ei:
        open_dataset(dataset)
    message = str(ei.value)
    assert f"but its shards add up to {sum(s['num_bytes'] for s in doc['shards'])}" in message
    assert f"{first} is missing" in message
    assert f"{second} has {real:,} bytes where the manifest says {real + 512:,}" in message
    assert third not in message  # only the shards that disagree are named
    assert f"`fastload index {dataset.as_uri()}`" in message  # and how to repair the manifest
    victim = dataset / third
    victim.write_bytes(victim.read_bytes()[:-700])  # a third problem, in another shard
    report = fc.verify_dataset(dataset)
    assert report.shards_checked == 3
    problems = "\n".join(report.problems)
    assert len(report.problems) >= 4, problems
    assert f"{first} is missing" in report.problems[0]
    assert any(p.endswith(f"{first}: shard is missing") for p in report.problems), problems
    assert any(f"{second}: size is {real} bytes" in p for p in report.problems), problems
    assert any(f"{third}: size is" in p for p in report.problems), problems


def test_index_rebuilds_our_indexes(dataset: Path, real_fmt: str) -> None:
    manifest = read_manifest(open_store(dataset))
    index_keys = [s.index for s in manifest.shards if s.index]
    before = {k: (dataset / k).read_bytes() for k in index_keys}
    for k in index_keys:
        (dataset / k).unlink()
    proc = _cli("index", str(dataset))
    assert proc.returncode == 0, proc.stderr
    assert {k: (dataset / k).read_bytes() for k in index_keys} == before
    assert fc.verify_dataset(dataset).ok


def test_index_third_party_tars(tmp_path: Path, cv: Any) -> None:
    src = tmp_path / "thirdparty"
    src.mkdir()
    expected = {}
    for s in range(3):
        with wds.TarWriter(str(src / f"part-{s}.tar")) as sink:
            for i in range(5):
                key = f"{s}_{i}"
                sample = {"__key__": key, "jpg": bytes([s, i]) * 50, "json": b'{"i": %d}' % i}
                sink.write(sample)
                expected[key] = {"jpg": sample["jpg"], "json": sample["json"]}
    (src / "README.txt").write_text("not a shard")
    proc = _cli("index", str(src))
    assert proc.returncode == 0, proc.stderr
    assert "wrote 3 index files" in proc.stdout
    assert "ignored 1" in proc.stdout
    for s in range(3):
        assert (src / f"part-{s}.tar.idx").exists()
    manifest = read_manifest(open_store(src))
    assert manifest.format == "webdataset"
    assert [e.name for e in manifest.shards] == ["part-0.tar", "part-1.tar", "part-2.tar"]
    assert manifest.num_samples == 15
    assert manifest.schema["jpg"]["count"] == 15
    assert cv.read_dataset(src) == expected
    verify = _cli("verify", str(src))
    assert verify.returncode == 0, verify.stdout
    inspect = _cli("inspect", str(src), "--json")
    assert json.loads(inspect.stdout)["samples"][0]["key"] == "0_0"
    # the indexed directory is now a dataset that converts like ours
    out = tmp_path / "converted"
    result = fc.convert(src, out, format="lmdb", workers=1, quiet=True)
    assert result.num_samples == 15
    assert cv.read_dataset(out) == expected


def test_index_without_shards(tmp_path: Path) -> None:
    (tmp_path / "x.txt").write_text("hi")
    proc = _cli("index", str(tmp_path))
    assert proc.returncode == 1
    assert "no shards found" in proc.stderr


def test_inspect_without_manifest(tmp_path: Path) -> None:
    proc = _cli("inspect", str(tmp_path))
    assert proc.returncode == 1
    assert "fastload index" in proc.stderr


def test_index_and_convert_unindexed_tfrecords(tmp_path: Path, cv: Any) -> None:
    from fastload.formats import get_format

    fmt = get_format("tfrecord")
    src = tmp_path / "tfr"
    store = open_store(src)
    expected = {}
    for s in range(2):
        with fmt.writer(store, f"train.{s}.tfrecords", index=False) as writer:
            for i in range(4):
                sample = {
                    "__key__": f"k{s}{i}",
                    "jpg": bytes([i]) * (i + 1),
                    "cls": str(s).encode(),
                }
                writer.write(sample)
                expected[sample["__key__"]] = {"jpg": sample["jpg"], "cls": sample["cls"]}
    assert not list(src.glob("*.idx"))
    # convert straight from the unindexed directory (samples are counted by reading)
    result = fc.convert(src, tmp_path / "wds", format="webdataset", workers=1, quiet=True)
    assert result.num_samples == 8
    assert cv.read_dataset(tmp_path / "wds") == expected
    # index it into a dataset: .idx files and a manifest, which verify accepts
    result_index = fc.index_dataset(src)
    assert result_index.format == "tfrecord"
    assert sorted(result_index.indexed) == ["train.0.tfrecords.idx", "train.1.tfrecords.idx"]
    assert result_index.manifest_written
    assert fc.verify_dataset(src).ok
    assert cv.read_dataset(src) == expected
    # a second run finds everything up to date
    again = fc.index_dataset(src)
    assert again.indexed == []
    assert len(again.unchanged) == 2


def _ungrouped_tree(root: Path) -> Path:
    """Files of 12 samples (jpg + cls + json) in a directory, as a user would tar them by hand."""
    src = root / "files"
    src.mkdir()
    for i in range(12):
        (src / f"s{i:02d}.jpg").write_bytes(b"\xff\xd8" + bytes([i]) * 50)
        (src / f"s{i:02d}.cls").write_text(str(i))
        (src / f"s{i:02d}.json").write_text(json.dumps({"i": i}))
    return src


def test_index_refuses_a_tar_whose_members_are_not_grouped(tmp_path: Path) -> None:
    """`tar -cf x.tar -C dir .` lists files in directory order, not by sample: fastload index
    used to accept it and verify said OK, with 36 one-field fragments instead of 12 samples."""
    src = _ungrouped_tree(tmp_path)
    shards = tmp_path / "shards"
    shards.mkdir()
    # --sort=none keeps the directory order; make it deterministic and ungrouped by passing the
    # names in a shuffled order, as the directory order of a real file system would be.
    names = sorted(p.name for p in src.iterdir())
    shuffled = names[1::2] + names[0::2]
    subprocess.run(["tar", "-cf", str(shards / "x.tar"), "-C", str(src), *shuffled], check=True)
    result = subprocess.run(
        [sys.executable, "-m", "fastload.cli", "index", str(shards)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "repeat the key of an earlier sample" in result.stderr
    assert "tar --sort=name" in result.stderr
    assert not (shards / "fastload.json").exists()
    assert not (shards / "x.tar.idx").exists()
    # made the right way, the same files index into 12 samples of 3 fields
    subprocess.run(
        ["tar", "--sort=name", "-cf", str(shards / "x.tar"), "-C", str(src), "."], check=True
    )
    result = subprocess.run(
        [sys.executable, "-m", "fastload.cli", "index", str(shards)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    manifest = read_manifest(open_store(shards))
    assert manifest.num_samples == 12
    assert manifest.schema["json"]["count"] == 12
    assert "note:" not in result.stdout


def test_index_finds_a_sample_split_across_two_shards(tmp_path: Path) -> None:
    src = _ungrouped_tree(tmp_path)
    shards = tmp_path / "shards"
    shards.mkdir()
    names = sorted(p.name for p in src.iterdir())
    # s05's json lands in the second shard
    first = [n for n in names if n < "s05.json"]
    second = [n for n in names if n >= "s05.json"]
    subprocess.run(["tar", "-cf", str(shards / "a.tar"), "-C", str(src), *first], check=True)
    subprocess.run(["tar", "-cf", str(shards / "b.tar"), "-C", str(src), *second], check=True)
    result = subprocess.run(
        [sys.executable, "-m", "fastload.cli", "index", str(shards)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1
    assert "'s05' (sample 5 of" in result.stderr
    assert "a.tar and sample 0 of" in result.stderr


def test_a_shard_file_or_a_wrong_path_gets_an_error_that_says_so(tmp_path: Path) -> None:
    """These used to send the user between 'no manifest, run fastload index X' and 'no shards
    found in X'."""
    src = _ungrouped_tree(tmp_path)
    shard = tmp_path / "one.tar"
    subprocess.run(["tar", "--sort=name", "-cf", str(shard), "-C", str(src), "."], check=True)
    for command in ("inspect", "verify", "index"):
        result = _cli(command, str(shard))
        assert result.returncode == 1
        assert f"{shard} is a file, not a dataset directory" in result.stderr
        assert f"`fastload index {tmp_path}`" in result.stderr
        missing = _cli(command, str(tmp_path / "nope"))
        assert missing.returncode == 1
        assert f"{tmp_path / 'nope'} does not exist" in missing.stderr
    # the advice works: the directory indexes into a dataset
    assert _cli("index", str(tmp_path)).returncode == 0


def test_output_into_a_closed_pipe_is_not_an_error(dataset: Path) -> None:
    """`fastload inspect DS | head` used to die with 'Broken pipe'."""
    command = f"set -o pipefail; {sys.executable} -m fastload.cli inspect {dataset} | true"
    result = subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--format", "webdatset"], "did you mean 'webdataset'?"),
        (["--source-type", "imagefolders"], "did you mean 'imagefolder'?"),
        (["--shard-size", "12XB"], "argument --shard-size: cannot parse size '12XB'"),
        (["--shard-samples", "0"], "argument --shard-samples: must be at least 1, got 0"),
        (["--workers", "two"], "argument --workers: expected a whole number, got 'two'"),
    ],
)
def test_bad_option_values_are_usage_errors(tmp_path: Path, args: list[str], message: str) -> None:
    """They used to exit 1 after starting the conversion; --help documents 2."""
    result = _cli("convert", str(tmp_path / "src"), str(tmp_path / "dst"), *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "usage: fastload convert" in result.stderr
    assert not (tmp_path / "dst").exists()


def test_verify_and_index_report_progress_per_shard(dataset: Path) -> None:
    calls: list[tuple[int, int, int]] = []
    report = fc.verify_dataset(dataset, progress=lambda *a: calls.append(a))
    n = report.shards_checked
    assert n > 1
    manifest = read_manifest(open_store(dataset))
    assert calls == [(i + 1, n, s.num_bytes) for i, s in enumerate(manifest.shards)]
    calls.clear()
    fc.index_dataset(dataset, progress=lambda *a: calls.append(a))
    assert [c[0] for c in calls] == list(range(1, n + 1))


# ---- many shards: parallel verify, streamed inspect --json ---------------------------------------


def _damage(dataset: Path) -> None:
    """Damage four shards in four ways: missing, a flipped byte, truncated, a wrong index."""
    shards = read_manifest(open_store(dataset)).shards
    (dataset / shards[1].name).unlink()
    for victim, cut in ((shards[4], False), (shards[7], True)):
        path = dataset / victim.name
        data = bytearray(path.read_bytes())
        if cut:
            del data[len(data) // 2 :]
        else:
            data[len(data) // 3] ^= 0x01
        path.write_bytes(bytes(data))
    if shards[9].index:
        idx = dataset / shards[9].index
        idx.write_bytes(idx.read_bytes() + b"0 0\n")


def test_parallel_verify_reports_what_sequential_does(many_shards: Path) -> None:
    _damage(many_shards)
    sequential = fc.verify_dataset(many_shards, workers=1)
    assert len(sequential.problems) >= 3
    calls: list[tuple[int, int, int]] = []
    for workers in (2, 4):
        calls.clear()
        parallel = fc.verify_dataset(
            many_shards, workers=workers, progress=lambda *a: calls.append(a)
        )
        assert parallel.to_json() == sequential.to_json()
        shards = read_manifest(open_store(many_shards)).shards
        assert calls == [(i + 1, len(shards), s.num_bytes) for i, s in enumerate(shards)]
    # problems come in shard order: the first damage reported is the first damaged shard's
    named = [int(m.group(1)) for p in sequential.problems if (m := re.search(r"-(\d{6})\.", p))]
    assert named == sorted(named)
    assert named[0] == 1


def test_verify_cli_workers(many_shards: Path) -> None:
    _damage(many_shards)
    one, three = (_cli("verify", str(many_shards), "--workers", n) for n in ("1", "3"))
    assert one.returncode == three.returncode == 1
    assert one.stdout == three.stdout
    assert one.stdout.count("PROBLEM ") >= 3


def test_verify_refuses_zero_workers(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="workers must be an int >= 1, got 0"):
        fc.verify_dataset(tmp_path, workers=0)
    proc = _cli("verify", str(tmp_path), "--workers", "0")
    assert proc.returncode == 2
    assert "--workers: must be at least 1, got 0" in proc.stderr


def test_inspect_json_streams_the_whole_document(many_shards: Path) -> None:
    expected = fc.inspect_dataset(many_shards, samples=2)
    out = io.StringIO()
    fc.tools.write_inspect_json(many_shards, out, samples=2)
    assert out.getvalue() == json.dumps(expected, indent=2, sort_keys=True, ensure_ascii=False)
    proc = _cli("inspect", str(many_shards), "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    names = [s.name for s in read_manifest(open_store(many_shards)).shards]
    assert [s["name"] for s in info["shards"]] == names
    assert info["num_shards"] == len(names) == 11
    assert len(info["samples"]) == 3


def test_inspect_order_on_the_command_line(tmp_path: Path, image_folder: Any) -> None:
    ds = _converted(tmp_path, image_folder, "webdataset", 4)
    cli = [*CLI, "inspect", str(ds), "--order"]
    proc = subprocess.run([*cli, "--batch-size", "4"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "21 samples in 6 shards, blocks of 64, window 64, seed 0" in proc.stdout
    assert "shard-mates of a sample in its batch of 4" in proc.stdout
    args = ["--json", "--batch-size", "4", "--block-size", "none", "--window", "2", "--seed", "1"]
    doc = json.loads(subprocess.run([*cli, *args], capture_output=True, text=True).stdout)
    assert doc["order"] == {"shuffle": True, "seed": 1, "block_size": None, "window": 2}
    expected = order_quality(
        [4, 4, 4, 4, 4, 1], OrderOptions(seed=1, block_size=None, window=2), batch_size=4
    )
    assert doc["mates_per_sample"] == pytest.approx(expected.mates_per_sample)
    bad = subprocess.run([*cli, "--block-size", "0"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert "--block-size: must be at least 1, got 0 (or 'none')" in bad.stderr
