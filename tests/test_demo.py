"""The README demo (``make demo`` = ``python -m fastload.demo``), run in-process on a small corpus.

It must print progress while it writes the corpus, verify the converted dataset the way
``fastload verify`` does (and stop on a damaged shard), and check exactly-once by key, not by count.
"""

from __future__ import annotations

import contextlib
import io
import re
import tarfile
from pathlib import Path

import pytest

from fastload.demo import check_exactly_once, main

# 96 images in batches of 16: 6 steps; stopping after 2 leaves 4 for the resumed loader.
# 96 // 8 = 12 samples per shard: 8 shards.
SMALL = ["--images", "96", "--classes", "4", "--batch-size", "16", "--steps", "2", "--size", "32"]


def _run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(argv)
    return rc, out.getvalue()


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
    """One demo run (2 workers, resumed with 1) under a fresh directory: (dir, exit code, stdout)."""
    out = tmp_path_factory.mktemp("demo")
    rc, text = _run(["--out", str(out), "--workers", "2", *SMALL])
    return out, rc, text


@pytest.mark.slow  # the module's one demo run takes 5-10 s
def test_demo_verifies_and_checks_every_key_exactly_once(demo_run: tuple[Path, int, str]) -> None:
    out, rc, text = demo_run
    assert rc == 0, text
    lines = text.splitlines()
    assert lines[4].startswith("[2/5] converted: 96 samples in 8 shards, ")
    verified = [line for line in lines if line.startswith("[3/5]")]
    assert len(verified) == 1
    assert verified[0].startswith(
        "[3/5] verified: OK, 8 shards, 96 samples read back; "
        "sizes, SHA-256 and indexes match the manifest ("
    )
    assert (
        "[5/5] resumed at step 2 with 1 worker(s): exactly once: 32 keys before the checkpoint "
        "+ 64 after = the dataset's 96 keys, none repeated or missing"
    ) in lines
    assert lines[-1] == f"done: inspect the dataset with `fastload inspect {out / 'shards'}`"


@pytest.mark.slow  # the module's one demo run takes 5-10 s
def test_demo_prints_corpus_progress_as_plain_lines_off_a_terminal(
    demo_run: tuple[Path, int, str],
) -> None:
    _, _, text = demo_run
    lines = text.splitlines()
    assert lines[0] == f"[1/5] corpus: writing 96 photo-like JPEGs to {demo_run[0] / 'images'} ..."
    # The corpus is written in chunks of 50; a line at least every tenth, one at the end.
    progress = [re.sub(r", [0-9.]+ s$", "", line) for line in lines[1:3]]
    assert progress == ["      corpus: 50/96 images (52 %)", "      corpus: 96/96 images (100 %)"]
    assert lines[3].startswith("[1/5] corpus: 96 JPEGs, ")


@pytest.mark.slow  # the module's one demo run takes 5-10 s
def test_demo_stops_on_a_shard_that_fails_verify(demo_run: tuple[Path, int, str]) -> None:
    out, rc, _ = demo_run
    assert rc == 0
    # Damaged in place (a copy elsewhere is another source: the demo would re-convert it) and
    # restored afterwards for the other tests.
    shard = sorted((out / "shards").glob("*.tar"))[3]
    with tarfile.open(shard) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(".jpg"))
    offset = member.offset_data + 100  # JPEG payload: the tar still reads, the hash differs
    with shard.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))
    try:
        rc, text = _run(["--out", str(out), "--workers", "0", *SMALL])
    finally:
        with shard.open("r+b") as f:
            f.seek(offset)
            f.write(bytes([byte]))

    assert rc == 1
    lines = text.splitlines()
    # A re-run writes no image and says so (issue 29).
    assert (
        lines[0] == f"[1/5] corpus: the 96 photo-like JPEGs of an earlier run, in {out / 'images'}"
    )
    assert lines[1].startswith("[1/5] corpus: 96 JPEGs, ")
    start = lines.index(f"demo: `fastload verify {out / 'shards'}` found 1 problem:")
    assert lines[start + 1].startswith(f"      {shard.as_uri()}: SHA-256 is ")
    assert "the manifest says" in lines[start + 1]
    assert lines[start + 2 :] == [
        f"demo: delete {out / 'shards'} and run the demo again to re-create the dataset"
    ]
    assert not any(line.startswith("[4/5]") for line in lines)  # no training on damaged data


def test_check_exactly_once_accepts_a_split_epoch() -> None:
    assert check_exactly_once(["b", "a"], ["d", "c"], ["a", "b", "c", "d"]) == []


def test_check_exactly_once_catches_a_repeat_that_a_count_check_misses() -> None:
    # 2 + 2 = 4 samples, as many as the dataset has: the old count comparison passed this.
    problems = check_exactly_once(["a", "b"], ["b", "c"], ["a", "b", "c", "d"])
    assert problems == [
        "1 key(s) delivered both before and after the checkpoint: 'b'",
        "1 key(s) delivered more than once: 'b'",
        "1 key(s) of the dataset never delivered: 'd'",
    ]


def test_check_exactly_once_names_keys_the_dataset_lacks_and_its_own_repeats() -> None:
    problems = check_exactly_once(["a"], ["x", "y"], ["a", "a", "b"])
    assert problems == [
        "the dataset itself holds 1 key(s) more than once: 'a'",
        "1 key(s) of the dataset never delivered: 'b'",
        "2 key(s) delivered that the dataset lacks: 'x', 'y'",
    ]


def test_check_exactly_once_names_at_most_five_keys_per_problem() -> None:
    keys = [f"k{i}" for i in range(8)]
    assert check_exactly_once([], [], keys) == [
        "8 key(s) of the dataset never delivered: 'k0', 'k1', 'k2', 'k3', 'k4', ... (3 more)"
    ]


def test_demo_refuses_a_corpus_smaller_than_two_batches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path), "--images", "20", "--batch-size", "16"])
    assert exc.value.code == 2
    assert "--images 20 is less than two batches of --batch-size 16" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before writing anything
