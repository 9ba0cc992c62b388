"""The first hour of ``fastload convert``, round 3 (issue 29, items 3, 4, 6, 7, 8 and 9).

Command-line tests run the installed ``fastload`` command, as a user does.
"""

from __future__ import annotations

import io
import json
import os
import re
import sys
from pathlib import Path

import pytest

from fastload.formats import Manifest
from fastload.formats.manifest import write_manifest
from fastload.storage import open_store
from tests.convert.test_first_hour import run_cli


def url(path: Path) -> str:
    return open_store(path).url


# ---- 3. CSV and Parquet without pyarrow ---------------------------------------------------------


@pytest.fixture
def without_pyarrow(tmp_path: Path) -> dict[str, str]:
    """The environment of a ``fastload`` process in which pyarrow cannot be imported."""
    blocker = tmp_path / "no_pyarrow"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['pyarrow'] = None\n")
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(blocker) + (os.pathsep + path if path else "")}


@pytest.mark.parametrize("on_error", ["raise", "skip"])
@pytest.mark.parametrize("name", ["rows.csv", "rows.parquet"])
def test_csv_and_parquet_without_pyarrow_name_the_extra_once(
    tmp_path: Path, without_pyarrow: dict[str, str], name: str, on_error: str
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / name).write_bytes(b"a,b\n1,2\n" if name.endswith("csv") else b"PAR1 not read")
    (src / f"more{Path(name).suffix}").write_bytes(b"a,b\n3,4\n")
    kind = "csv" if name.endswith("csv") else "parquet"
    proc = run_cli(
        "convert", "src", "out", "--on-error", on_error, cwd=tmp_path, env=without_pyarrow
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == (
        f"fastload convert: error: the {kind} conversion source needs the Python package "
        "'pyarrow', which is not installed; install it with: pip install 'fastload[parquet]'\n"
        f"  (converting src as source type {kind})\n"
    )
    assert not (tmp_path / "out").exists()  # refused before the destination is touched


def test_missing_pyarrow_is_a_missing_dependency_error_in_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fastload
    from fastload.errors import MissingDependencyError

    (tmp_path / "one.csv").write_text("a\n1\n")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'fastload\[parquet\]'") as info:
        fastload.convert(tmp_path / "one.csv", tmp_path / "out", on_error="skip", quiet=True)
    assert f"converting {tmp_path / 'one.csv'} as source type csv" in "".join(info.value.__notes__)


def test_readme_says_which_sources_need_which_extra() -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    convert = readme.split("## Convert", 1)[1].split("\n## ", 1)[0]
    assert "CSV and Parquet sources need `pip install 'fastload[parquet]'`" in convert


# ---- 4. a conversion that keeps no sample -----------------------------------------------------


def test_every_record_bad_under_skip_fails_and_names_the_skip_report(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.jsonl").write_text("not json\n{bad\n[1]\n")
    proc = run_cli("convert", "src", "out", "--on-error", "skip", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    report = tmp_path / "out" / "_fastload_skipped.jsonl"
    assert proc.stderr.startswith(
        f"fastload convert: error: no sample was kept: 3 items skipped (on_error='skip'), so "
        f"{url(tmp_path / 'out')} holds no dataset; the reasons are in "
        f"{url(tmp_path / 'out')}/_fastload_skipped.jsonl (the first: a.jsonl:1: "
    )
    assert [json.loads(line)["item"] for line in report.read_text().splitlines()] == [
        "a.jsonl:1",
        "a.jsonl:2",
        "a.jsonl:3",
    ]
    # Nothing else is left: no manifest, no empty shard, no state; a fixed input converts.
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["_fastload_skipped.jsonl"]
    (tmp_path / "src" / "a.jsonl").write_text('{"text": "fixed"}\n')
    again = run_cli("convert", "src", "out", "--on-error", "skip", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert not report.exists()
    assert run_cli("verify", "out", cwd=tmp_path).returncode == 0


def test_every_item_left_out_while_planning_names_the_file_and_the_reasons(
    tmp_path: Path,
) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "b.csv").write_text("x,y\n1,2,3\n")  # a row with too many cells
    proc = run_cli("convert", "src/b.csv", "out", "--on-error", "skip", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith(
        f"fastload convert: error: no samples to convert in {url(tmp_path / 'src')}/b.csv "
        "(source type csv; 1 item left out: b.csv: is not valid CSV: "
    ), proc.stderr
    assert proc.stderr.rstrip().endswith("check the path and --source-type")


def test_verify_flags_a_dataset_without_samples(tmp_path: Path) -> None:
    store = open_store(tmp_path / "empty")
    write_manifest(store, Manifest(format="webdataset", shards=[], schema={}, created_by={}))
    proc = run_cli("verify", "empty", cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stdout.splitlines()[0] == (
        f"PROBLEM {store.url}/fastload.json: the dataset holds no sample (0 shards, 0 samples): "
        "a loader would yield nothing; convert the source again (a conversion that keeps no "
        "sample now fails, naming why)"
    )


# ---- 6. WebDataset's tar framing on small records ---------------------------------------------


@pytest.fixture
def short_records(tmp_path: Path) -> Path:
    lines = (json.dumps({"text": f"short line {i}", "id": i}) + "\n" for i in range(20_000))
    (tmp_path / "c.jsonl").write_text("".join(lines))
    return tmp_path


def test_small_records_as_webdataset_warn_from_the_plan(short_records: Path) -> None:
    proc = run_cli("convert", "c.jsonl", "wds", cwd=short_records)
    assert proc.returncode == 0, proc.stderr
    warning, summary = proc.stderr.splitlines()
    assert summary.startswith("converted 20000 samples (source jsonl, no class list) into 1 ")
    assert warning.startswith(
        "fastload convert: warning: the first shard's 20000 samples hold 40 bytes of data each on "
        "average; as WebDataset (tar) members each field costs a 512-byte header and pads its "
        "data to a multiple of 512 bytes, so the shards will be about 20x the data"
    ), warning
    assert "pass --format tfrecord or --format lmdb" in warning
    tfr = run_cli("convert", "c.jsonl", "tfr", "--format", "tfrecord", cwd=short_records)
    assert tfr.returncode == 0, tfr.stderr
    assert "warning" not in tfr.stderr
    wds_bytes = sum(p.stat().st_size for p in (short_records / "wds").glob("*.tar"))
    tfr_bytes = sum(p.stat().st_size for p in (short_records / "tfr").glob("*.tfrecord"))
    assert wds_bytes > 15 * tfr_bytes  # what the warning is about (41.0 MB against 1.8 MB)


def test_small_records_in_small_shards_warn_from_the_finished_dataset(
    short_records: Path,
) -> None:
    # The first shard alone is too small to be worth a word; the dataset is not.
    proc = run_cli("convert", "c.jsonl", "wds", "--shard-samples", "500", cwd=short_records)
    assert proc.returncode == 0, proc.stderr
    warning, summary = proc.stderr.splitlines()
    assert warning.startswith(
        "fastload convert: warning: 50% of the 41.0 MB of these WebDataset shards are tar "
        "headers alone (40000 members for 20000 samples, 512 bytes each), and each member's "
        "data is padded to a multiple of 512 bytes on top (about 10.2 MB more). "
    ), warning
    assert summary.startswith("converted 20000 samples (source jsonl, no class list) into 40 ")


def test_large_samples_as_webdataset_do_not_warn(tmp_path: Path) -> None:
    for c in ("cat", "dog"):
        (tmp_path / "root" / c).mkdir(parents=True)
        for i in range(40):
            (tmp_path / "root" / c / f"{i}.jpg").write_bytes(b"\xff\xd8\xff" + bytes(60_000))
    proc = run_cli("convert", "root", "out", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith("converted 80 samples"), proc.stderr


# ---- 8. the progress bar while the plan streams ------------------------------------------------


class _Terminal(io.StringIO):
    """A stream that says it is a terminal: ``convert`` draws its tqdm bar on it."""

    def isatty(self) -> bool:
        return True


def test_the_bar_shows_no_percentage_or_eta_until_the_plan_is_whole(tmp_path: Path) -> None:
    import fastload

    lines = "".join(json.dumps({"text": f"record {i}"}) + "\n" for i in range(400))
    (tmp_path / "c.jsonl").write_text(lines)
    terminal = _Terminal()
    fastload.convert(
        tmp_path / "c.jsonl",
        tmp_path / "out",
        format="tfrecord",
        shard_samples=20,
        workers=1,
        progress_stream=terminal,
    )
    frames = [f for f in re.split(r"[\r\n]", terminal.getvalue()) if f.startswith("converting")]
    planning = [f for f in frames if "(planning)" in f]
    # 20 shards, planned one ahead of the writing: the total grows while the bar is drawn.
    totals = [int(m.group(1)) for f in planning if (m := re.search(r"/(\d+) samples", f))]
    assert len(set(totals)) > 5, frames
    assert max(totals) < 400
    for frame in planning:
        assert "%" not in frame, frame  # no percentage
        assert "<" not in frame, frame  # no ETA
    whole = frames[frames.index(planning[-1]) + 1 :]
    assert whole, frames
    assert all("(planning)" not in f for f in whole), frames
    assert re.match(r"converting: 100%\|#+\| 400/400 \[", whole[-1]), whole[-1]


# ---- 9. wording -------------------------------------------------------------------------------


def test_one_shard_one_sample_lmdb_index_and_token_dtype_read_right(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello world\nsecond line\n")
    made = run_cli("convert", "a.txt", "ds", "--tokenize", "byte", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    verify = run_cli("verify", "ds", cwd=tmp_path)
    assert verify.stdout == f"OK: checked 1 shard, read 1 sample at {url(tmp_path / 'ds')}\n"
    shown = run_cli("inspect", "ds", cwd=tmp_path).stdout.splitlines()
    assert "tokens    24 in 2 documents (uint16, vocab 257, EOS 256, blocks of 8192; " in "\n".join(
        shown
    )
    assert "first 1 sample" in shown
    lmdb = run_cli("convert", "a.txt", "lm", "--format", "lmdb", cwd=tmp_path)
    assert lmdb.returncode == 0, lmdb.stderr
    (tmp_path / "lm" / "fastload.json").unlink()
    index = run_cli("index", "lm", cwd=tmp_path)
    assert index.stdout == (
        "lmdb: no index files needed (an LMDB shard is looked up by key); wrote fastload.json "
        f"at {url(tmp_path / 'lm')}\n"
    )


def test_exit_status_3_names_what_the_walk_leaves_out() -> None:
    text = (
        "  3    convert completed, but items were left out (skipped under --on-error skip, or\n"
        "       loops, links not followed and duplicates in the tree; see _fastload_skipped.jsonl)"
    )
    for args in (["--help"], ["convert", "--help"], ["verify", "--help"]):
        proc = run_cli(*args, cwd=Path.cwd())
        assert proc.returncode == 0
        assert text in proc.stdout, args


def test_plan_capacity_counts_one_node_in_the_singular(tmp_path: Path) -> None:
    args = ["--preset", "imagenet", "--gpus", "8", "--samples-per-gpu", "2500"]
    proc = run_cli("plan-capacity", *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "job              1 node x 8 GPUs, 20,000 samples/s"
