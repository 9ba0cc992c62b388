"""What a new user meets in the first hour of ``fastload convert`` (issue 12, items 1, 5 and 7).

* An image folder with a few stray files stays an image folder; a tree that only looks like one
  says why it is not, and how to get one; empty images are item errors in every source.
* ``--map module:function`` finds ``module.py`` in the current directory, tells a missing module
  from a missing function, and shows the user's traceback when the function raises.
* Convert's manners: one line for "nothing to do", how far an interrupted run got, singular and
  plural counts, messages naming the command-line flags.

Command-line tests run the installed ``fastload`` command, as a user does.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest

from fastload.convert.sources import (
    IMAGE_FOLDER_STRAYS,
    detect_source_type,
)
from fastload.errors import ConversionError, InvalidArgumentError
from fastload.formats import read_manifest
from fastload.storage import open_store

fc = importlib.import_module("fastload.convert")
pool_module = importlib.import_module("fastload.convert._pool")

FASTLOAD = str(Path(sys.executable).with_name("fastload"))


def run_cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [FASTLOAD, *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def write_files(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def image_bytes(name: str) -> bytes:
    return b"\xff\xd8\xff" + name.encode() * 20


def images(*names: str) -> dict[str, bytes]:
    return {n: image_bytes(n) for n in names}


# ---- 1. an image folder with stray files -------------------------------------------------------


def test_stray_files_leave_an_image_folder_an_image_folder(tmp_path: Path, cv: Any) -> None:
    files = images("cat/0.jpg", "cat/1.jpg", "cat/2.jpg", "dog/0.png", "dog/1.jpg", "dog/2.jpg")
    files |= {"cat/README.txt": b"cats", "dog/Thumbs.db": b"\0" * 9, "labels.csv": b"a,b\n"}
    write_files(tmp_path / "root", files)
    proc = run_cli("convert", "root", "out", "--shard-samples", "100", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0] == (
        "fastload convert: warning: left out 3 files of "
        f"{open_store(tmp_path / 'root').url} that are not images: cat/README.txt, "
        "dog/Thumbs.db, labels.csv. An image folder's samples are its images (extensions avif, "
        "bmp, gif, jfif, jpe, jpeg, jpg, jxl, pbm, pgm, png, pnm, ppm, tif, tiff, webp); pass "
        "--source-type files "
        "(source_type='files') to convert every file instead"
    )
    assert lines[1].startswith("converted 6 samples (source imagefolder, 2 classes) into 1 ")
    assert lines[1].endswith("; skipped 0 items; left out 3 files that are not samples")
    assert cv.read_dataset(tmp_path / "out") == {
        f"{c}/{i}": {ext: image_bytes(f"{c}/{i}.{ext}"), "cls": str(ci).encode()}
        for ci, c in enumerate(("cat", "dog"))
        for i in range(3)
        for ext in [("png" if (c, i) == ("dog", 0) else "jpg")]
    }
    manifest = read_manifest(open_store(tmp_path / "out"))
    assert manifest.metadata == {"classes": ["cat", "dog"]}


def test_detection_thresholds(tmp_path: Path) -> None:
    def detect(name: str, files: dict[str, bytes]) -> str:
        write_files(tmp_path / name, files)
        return detect_source_type(open_store(tmp_path / name))

    pics = images(*(f"c{c}/{i}.jpg" for c in range(3) for i in range(10)))  # 30 images
    strays = {f"c0/note{i}.txt": b"n" for i in range(5)}
    assert IMAGE_FOLDER_STRAYS == 3
    # At most 3 other files, or 10% of the files if that is more.
    assert detect("three", pics | dict(list(strays.items())[:3])) == "imagefolder"
    assert detect("four", pics | dict(list(strays.items())[:4])) == "files"  # 4 > max(3, 3)
    many = images(*(f"c{c}/{i}.jpg" for c in range(5) for i in range(20)))  # 100 images
    ten = {f"c0/note{i}.txt": b"n" for i in range(10)}
    assert detect("ten", many | ten) == "imagefolder"  # 10 <= 110 // 10
    assert detect("eleven", many | ten | {"c1/x.txt": b"x"}) == "imagefolder"  # 11 <= 111 // 10
    twelve = many | ten | {"c1/x.txt": b"x", "c1/y.txt": b"y"}
    assert detect("twelve", twelve) == "files"  # 12 > 112 // 10
    # A file named like an image beside it makes samples of several fields: a file tree.
    assert detect("pairs", pics | {"c0/0.json": b"{}"}) == "files"
    # Files outside class directories are strays like any other.
    assert detect("top", pics | {"README.md": b"r", "labels.csv": b"a"}) == "imagefolder"


def test_forced_image_folder_leaves_out_non_images_and_counts_classes_with_images(
    tmp_path: Path, cv: Any
) -> None:
    files = images("a/0.jpg", "b/0.jpg", "b/1.jpg") | {
        "a/0.txt": b"caption",  # named like an image: detection says files
        "aa_docs/notes.md": b"no images here",  # a directory without images is no class
    }
    write_files(tmp_path / "src", files)
    stream = _Stream()
    result = fc.convert(
        tmp_path / "src",
        tmp_path / "out",
        source_type="imagefolder",
        workers=1,
        progress_stream=stream,
    )
    assert cv.read_dataset(tmp_path / "out") == {
        "a/0": {"jpg": image_bytes("a/0.jpg"), "cls": b"0"},
        "b/0": {"jpg": image_bytes("b/0.jpg"), "cls": b"1"},
        "b/1": {"jpg": image_bytes("b/1.jpg"), "cls": b"1"},
    }
    assert (result.source_type, result.num_classes, result.ignored) == ("imagefolder", 2, 2)
    assert result.manifest is not None
    assert result.manifest.metadata == {"classes": ["a", "b"]}
    assert "left out 2 files" in stream.text
    assert "a/0.txt, aa_docs/notes.md" in stream.text


def test_a_mostly_image_tree_that_falls_back_to_files_says_why(tmp_path: Path) -> None:
    files = images(*(f"{c}/{i}.jpg" for c in ("cat", "dog") for i in range(3)))
    files |= {f"cat/notes{i}.txt": b"n" for i in range(4)}  # 4 strays: more than 3
    write_files(tmp_path / "root", files)
    proc = run_cli("convert", "root", "out", "--dry-run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first.startswith(
        "fastload convert: warning: root is taken as a file tree (source type files), so its "
        "samples get no class label: 6 of its 10 files are images, but it is not an image "
        "folder (root/<class>/<image>) because 4 of its 10 files are not images inside a class "
        "directory (such as cat/notes0.txt, cat/notes1.txt, cat/notes2.txt and 1 more); an "
        "image folder may hold at most 3 such files. Pass --source-type imagefolder"
    )
    assert "dry run: would write 10 samples (source files, no class list)" in proc.stderr
    forced = run_cli(
        "convert", "root", "out", "--source-type", "imagefolder", "--dry-run", cwd=tmp_path
    )
    assert "would write 6 samples (source imagefolder, 2 classes)" in forced.stderr


def test_one_extra_level_is_refused_and_the_inner_folders_suggested(tmp_path: Path) -> None:
    # Issue 29: converted whole, train/ and val/ would be mixed without labels; exit 0 with a
    # warning let scripts that check exit codes go on with that dataset.
    files = images(*(f"{s}/{c}/{i}.jpg" for s in ("train", "val") for c in "ab" for i in "01"))
    write_files(tmp_path / "root", files)
    proc = run_cli("convert", "root", "out", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == (
        "fastload convert: error: root holds 2 image folders one level down (train, val: its "
        "images are two directories deep, such as train/a/0.jpg), so its type is ambiguous: "
        "converted whole, it would mix them in one dataset without class labels. Convert each "
        "one as an image folder, with a class label per image: fastload convert root/train "
        "DST/train and fastload convert root/val DST/val; or pass --source-type files "
        "(source_type='files') to convert the whole tree as files keyed by path, without labels\n"
    )
    assert not (tmp_path / "out").exists()
    with pytest.raises(InvalidArgumentError, match="2 image folders one level down"):
        detect_source_type(open_store(tmp_path / "root"))
    inner = run_cli("convert", "root/train", "out-train", cwd=tmp_path)
    assert inner.returncode == 0, inner.stderr
    assert inner.stderr.startswith("converted 4 samples (source imagefolder, 2 classes)")
    whole = run_cli("convert", "root", "out", "--source-type", "files", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    assert whole.stderr.startswith("converted 8 samples (source files, no class list) into 1 ")


def test_empty_images_are_item_errors_in_every_source(tmp_path: Path, cv: Any) -> None:
    # A file tree: the empty x.jpg is skipped (exit 3, in the skip report), not packed.
    write_files(tmp_path / "tree", {"a/x.jpg": b"", "a/x.json": b"{}", "a/y.jpg": b"\xff\xd8"})
    proc = run_cli("convert", "tree", "out", "--on-error", "skip", cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr
    report = (tmp_path / "out" / "_fastload_skipped.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in report] == [
        {"item": "a/x.jpg", "reason": "is an empty image file (0 bytes)", "shard": None}
    ]
    assert cv.read_dataset(tmp_path / "out") == {
        "a/x": {"json": b"{}"},
        "a/y": {"jpg": b"\xff\xd8"},
    }
    # JSON Lines: an empty string in an image field (read in the worker).
    cv.write_jsonl(tmp_path / "d.jsonl", [{"png": "", "txt": "a"}, {"png": "P", "txt": "b"}])
    with pytest.raises(ConversionError, match=r"d\.jsonl:1 .*field 'png' is an empty image"):
        fc.convert(tmp_path / "d.jsonl", tmp_path / "o2", workers=1, quiet=True)
    # Third-party shards: a tar member k0.png of 0 bytes.
    (tmp_path / "tars").mkdir()
    with tarfile.open(tmp_path / "tars" / "part-0.tar", "w") as tar:
        for name, data in (("k0.png", b""), ("k0.cls", b"1"), ("k1.png", b"P"), ("k1.cls", b"2")):
            member = tarfile.TarInfo(name)
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    result = fc.convert(tmp_path / "tars", tmp_path / "o3", workers=1, quiet=True, on_error="skip")
    assert [(s.item, s.reason) for s in result.skipped] == [
        ("part-0.tar#0", "field 'png' is an empty image (0 bytes)")
    ]
    assert cv.read_dataset(tmp_path / "o3") == {"k1": {"png": b"P", "cls": b"2"}}


# ---- 2. --map ------------------------------------------------------------------------------------

_MAP_MODULE = """\
def upper(sample):
    sample["txt"] = sample["__key__"].upper()
    return sample


def boom(sample):
    raise ValueError("cannot handle " + sample["__key__"])
"""


@pytest.fixture
def map_corpus(tmp_path: Path) -> Path:
    write_files(tmp_path / "root", images("cat/0.jpg", "cat/1.jpg", "dog/0.jpg"))
    (tmp_path / "first_hour_map.py").write_text(_MAP_MODULE)
    return tmp_path


def test_map_module_in_the_current_directory(map_corpus: Path, cv: Any) -> None:
    proc = run_cli(
        "convert", "root", "out", "--map", "first_hour_map:upper", "--workers", "2",
        "--shard-samples", "1", cwd=map_corpus,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    got = cv.read_dataset(map_corpus / "out")
    assert {k: v["txt"] for k, v in got.items()} == {
        "cat/0": b"CAT/0",
        "cat/1": b"CAT/1",
        "dog/0": b"DOG/0",
    }


def test_map_module_in_the_current_directory_with_forkserver_workers(
    map_corpus: Path, cv: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import multiprocessing

    monkeypatch.chdir(map_corpus)
    monkeypatch.setattr(sys, "path", list(sys.path))  # convert appends the current directory
    monkeypatch.delitem(sys.modules, "first_hour_map", raising=False)
    monkeypatch.setattr(
        pool_module, "pool_context", lambda: multiprocessing.get_context("forkserver")
    )
    fc.convert("root", "out", map_fn="first_hour_map:upper", workers=2, shard_samples=1, quiet=True)
    assert sorted(v["txt"] for v in cv.read_dataset(map_corpus / "out").values()) == [
        b"CAT/0",
        b"CAT/1",
        b"DOG/0",
    ]
    assert sys.path[-1] == str(map_corpus)


def test_map_missing_module_and_missing_function_are_told_apart(map_corpus: Path) -> None:
    no_module = run_cli("convert", "root", "o1", "--map", "first_hour_mapp:upper", cwd=map_corpus)
    assert no_module.returncode == 1
    assert no_module.stderr == (
        "fastload convert: error: cannot load map function 'first_hour_mapp:upper': there is no "
        "module 'first_hour_mapp'; it must be a file first_hour_mapp.py (or a package) in the "
        f"current directory ({map_corpus}), a directory on PYTHONPATH, or installed; did you "
        "mean 'first_hour_map'?\n"
    )
    no_function = run_cli("convert", "root", "o2", "--map", "first_hour_map:uper", cwd=map_corpus)
    assert no_function.returncode == 1
    assert no_function.stderr == (
        "fastload convert: error: cannot load map function 'first_hour_map:uper': module "
        f"'first_hour_map' ({map_corpus / 'first_hour_map.py'}) has no attribute 'uper'; did "
        "you mean 'upper'? It has these functions and classes: boom, upper\n"
    )
    (map_corpus / "broken_map.py").write_text("import numpyy_not_installed\n")
    broken = run_cli("convert", "root", "o3", "--map", "broken_map:f", cwd=map_corpus)
    assert broken.stderr == (
        "fastload convert: error: cannot load map function 'broken_map:f': importing module "
        "'broken_map' raised ModuleNotFoundError: No module named 'numpyy_not_installed'; fix "
        "the module (its traceback is below)\n"
        "  Traceback (most recent call last):\n"
        f'  File "{map_corpus / "broken_map.py"}", line 1, in <module>\n'
        "    import numpyy_not_installed\n"
        "ModuleNotFoundError: No module named 'numpyy_not_installed'\n"
    )


def test_map_function_that_raises_shows_the_users_traceback(map_corpus: Path) -> None:
    module = map_corpus / "first_hour_map.py"
    proc = run_cli(
        "convert", "root", "out", "--map", "first_hour_map:boom", "--workers", "2",
        "--shard-samples", "1", cwd=map_corpus,
    )  # fmt: skip
    assert proc.returncode == 1
    head, _, trace = proc.stderr.partition("\n")
    assert re.fullmatch(
        r"fastload convert: error: cannot convert (cat/0\.jpg|cat/1\.jpg|dog/0\.jpg) \(planned "
        r"for shard \S+\): on sample '(cat/0|cat/1|dog/0)' the map function first_hour_map:boom "
        r"raised ValueError: cannot handle \2 \(at "
        + re.escape(str(module))
        + r":7, in boom\); fix the map function \(its traceback is below\), or pass "
        r"on_error='skip' \(--on-error skip\) to leave such items out and list them in "
        r"_fastload_skipped.jsonl",
        head,
    ), head
    named = re.search(r"on sample '([^']+)'", head)
    assert named, head
    key = named.group(1)
    assert trace == (
        "  Traceback (most recent call last):\n"
        f'  File "{module}", line 7, in boom\n'
        '    raise ValueError("cannot handle " + sample["__key__"])\n'
        f"ValueError: cannot handle {key}\n"
    )
    skip = run_cli(
        "convert", "root", "out2", "--map", "first_hour_map:boom", "--on-error", "skip",
        cwd=map_corpus,
    )  # fmt: skip
    # Every sample raised: nothing is kept, which fails (issue 29), the skip report still named.
    assert skip.returncode == 1, skip.stderr
    assert "error: no sample was kept: 3 items skipped" in skip.stderr
    assert f"{open_store(map_corpus / 'out2').url}/_fastload_skipped.jsonl" in skip.stderr
    assert not (map_corpus / "out2" / "fastload.json").exists()
    report = (map_corpus / "out2" / "_fastload_skipped.jsonl").read_text().splitlines()
    assert [json.loads(line)["reason"] for line in report] == [
        f"on sample '{k}' the map function first_hour_map:boom raised ValueError: cannot "
        f"handle {k} (at {module}:7, in boom)"
        for k in ("cat/0", "cat/1", "dog/0")
    ]


# ---- 3. manners ------------------------------------------------------------------------------


def test_rerunning_a_finished_conversion_prints_one_accurate_line(tmp_path: Path) -> None:
    write_files(tmp_path / "root", images("cat/0.jpg", "dog/0.jpg", "dog/1.jpg"))
    first = run_cli("convert", "root", "out", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    found = re.search(r"1 webdataset shard, ([0-9.]+ KB),", first.stderr)
    assert found, first.stderr
    size = found.group(1)
    again = run_cli("convert", "root", "out", cwd=tmp_path)
    assert again.returncode == 0
    assert again.stderr == (
        f"nothing to do: {open_store(tmp_path / 'out').url} already holds this dataset, 3 "
        f"samples (source imagefolder, 2 classes) in 1 webdataset shard, {size}; skipped 0 "
        "items\n"
    )


def test_counts_are_singular_and_plural(tmp_path: Path) -> None:
    write_files(tmp_path / "root", {"cat/0.jpg": image_bytes("c"), "cat/1.jpg": b""})
    proc = run_cli("convert", "root", "out", "--on-error", "skip", cwd=tmp_path)
    assert proc.returncode == 3
    out = open_store(tmp_path / "out").url
    assert re.fullmatch(
        r"converted 1 sample \(source imagefolder, 1 class\) into 1 webdataset shard, "
        rf"[0-9.]+ KB, in 0:0\d \([0-9.]+ MB/s\) at {re.escape(out)}; skipped 1 item "
        rf"\(listed in {re.escape(out)}/_fastload_skipped\.jsonl\)\n",
        proc.stderr,
    ), proc.stderr
    dry = run_cli("convert", "root", "dry", "--on-error", "skip", "--dry-run", cwd=tmp_path)
    assert "  shard-000000.tar: 1 sample, ~" in dry.stdout + dry.stderr
    assert not re.search(r"\b1 (samples|shards|items|classes|files)\b", dry.stdout + dry.stderr)


def test_option_errors_name_the_command_line_flags(tmp_path: Path) -> None:
    # One message for both users: the Python keyword and the command-line flag.
    write_files(tmp_path / "root", images("cat/0.jpg"))
    cases: dict[tuple[str, Any], str] = {
        ("shard_samples", 0): "shard_samples (--shard-samples) must be an int >= 1, got 0",
        ("shard_size", "0"): "shard_size (--shard-size): size must be positive, got '0'",
        ("workers", 0): "workers (--workers) must be an int >= 1, got 0",
        ("on_error", "ignore"): "on_error (--on-error) must be 'raise' or 'skip', got 'ignore'",
        ("prefix", "_x"): "prefix (--prefix) '_x' must be a non-empty name without '/' that "
        "does not start with '.' or '_'",
    }
    for (name, value), message in cases.items():
        with pytest.raises(InvalidArgumentError) as info:
            fc.convert(tmp_path / "root", tmp_path / "out", **{name: value})
        assert str(info.value) == message
    # A value the command line passes on as it is reaches the user with the flag's name.
    proc = run_cli("convert", "root", "out", "--prefix", "_x", cwd=tmp_path)
    assert proc.returncode != 0
    assert proc.stderr.splitlines()[-1].endswith(f"error: {cases[('prefix', '_x')]}")
    assert not (tmp_path / "out").exists()


def test_the_options_object_has_every_keyword_of_convert_with_its_default() -> None:
    # convert() checks its keywords once, as a ConvertOptions: one field per keyword, so that
    # a keyword added to one and not the other fails here, not in a user's hands.
    options_module = importlib.import_module("fastload.convert._options")
    keywords = {
        p.name: p.default
        for p in inspect.signature(fc.convert).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    fields = {
        f.name: f.default for f in dataclasses.fields(options_module.ConvertOptions) if f.init
    }
    assert fields == keywords
    options = options_module.ConvertOptions(format="wds", shard_samples=5, workers=3)
    assert (options.format_name, options.size_limit, options.n_workers) == ("webdataset", None, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.workers = 4


class _Stream:
    """A text stream that keeps what is written (progress_stream)."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> int:
        self.text += text
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def test_ctrl_c_while_planning_says_nothing_was_written(
    tmp_path: Path, image_folder: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastload.convert.sources import ImageFolderSource

    root, _ = image_folder

    def interrupted(self: ImageFolderSource, report: Any) -> Any:
        signal.raise_signal(signal.SIGINT)  # a real Ctrl-C, in the middle of planning
        raise AssertionError("SIGINT did not interrupt")  # pragma: no cover

    monkeypatch.setattr(ImageFolderSource, "plan_units", interrupted)
    stream = _Stream()
    with pytest.raises(KeyboardInterrupt) as info:
        fc.convert(root, tmp_path / "out", workers=1, progress_stream=stream)
    text = (
        "interrupted while planning, before anything was written; re-run the same command to "
        "start again"
    )
    assert info.value.__notes__ == [text]
    assert stream.text == f"fastload convert: {text}\n"
    assert not (tmp_path / "out").exists()


_SLOW_MAP = """\
import os, time

def slow(sample):
    if sample["__key__"] in os.environ["SLOW_KEYS"].split(","):
        time.sleep(float(os.environ["SLOW_SECONDS"]))
    return sample
"""


def _interrupt_when(
    tmp_path: Path, args: list[str], env: dict[str, str], done_records: int, settle: float = 0
) -> subprocess.CompletedProcess[str]:
    """Run the CLI, send Ctrl-C (SIGINT to its process group, as a terminal does) ``settle``
    seconds after ``done_records`` shards are recorded done, and return the finished process."""
    done_dir = tmp_path / "out" / "_fastload_convert" / "done"
    proc = subprocess.Popen(
        [FASTLOAD, *args],
        cwd=tmp_path,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if done_dir.is_dir() and len(list(done_dir.glob("*.json"))) >= done_records:
            break
        time.sleep(0.01)
    time.sleep(settle)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_ctrl_c_says_how_far_it_got_and_the_rerun_resumes(tmp_path: Path) -> None:
    write_files(tmp_path / "root", images(*(f"c/{i:02d}.jpg" for i in range(12))))
    (tmp_path / "slow_map.py").write_text(_SLOW_MAP)
    args = ["convert", "root", "out", "--shard-samples", "2", "--workers", "2"]
    args += ["--map", "slow_map:slow"]
    every = ",".join(f"c/{i:02d}" for i in range(12))
    proc = _interrupt_when(tmp_path, args, {"SLOW_KEYS": every, "SLOW_SECONDS": "0.15"}, 1)
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr
    found = re.search(
        r"^fastload convert: interrupted after (\d) of 6 shards \((\d+) of 12 samples\); re-run "
        r"the same command to resume: the finished shards are kept$",
        proc.stderr,
        re.M,
    )
    assert found, proc.stderr
    done = int(found.group(1))
    assert 1 <= done < 6
    assert int(found.group(2)) == 2 * done
    assert proc.stderr.endswith("the finished shards are kept\n")  # said once, by convert
    rerun = run_cli(*args, cwd=tmp_path, env={"SLOW_KEYS": "", "SLOW_SECONDS": "0"})
    assert rerun.returncode == 0, rerun.stderr
    shards = f"{done} shard{'' if done == 1 else 's'}"
    assert rerun.stderr.startswith(f"resuming: {shards} recorded done by an earlier run (")
    assert f"{shards} {'was' if done == 1 else 'were'} already done" in rerun.stderr


def test_ctrl_c_with_an_idle_worker_prints_no_traceback(tmp_path: Path) -> None:
    # Four fast shards and a slow last one: one worker writes it, the other has nothing left
    # to do and waits in the pool; Ctrl-C reaches both.
    write_files(tmp_path / "root", images(*(f"c/{i}.jpg" for i in range(5))))
    (tmp_path / "slow_map.py").write_text(_SLOW_MAP)
    args = ["convert", "root", "out", "--shard-samples", "1", "--workers", "2"]
    args += ["--map", "slow_map:slow"]
    slow = {"SLOW_KEYS": "c/4", "SLOW_SECONDS": "1.5"}
    proc = _interrupt_when(tmp_path, args, slow, 4, settle=0.3)  # the other worker is idle
    assert proc.returncode == 130
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        "fastload convert: interrupted after writing every shard (5 of 5), before the manifest; "
        "re-run the same command to complete the dataset"
    )
    assert proc.stderr.count("interrupted after") == 1
    rerun = run_cli(*args, cwd=tmp_path, env={"SLOW_KEYS": "", "SLOW_SECONDS": "0"})
    assert rerun.returncode == 0, rerun.stderr
