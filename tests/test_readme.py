"""Every code line of the top-level README.md runs as written, or says here why not.

The README is read when the tests are collected; each fenced code block (```bash, ```sh,
```python) is one test, run in README order in one sandbox directory, the working directory of
every block, which the module prepares so that the names the README uses exist for real:

* ``./images`` (40 photo-like JPEGs in 4 classes, :mod:`fastload.testing.corpus`),
  ``corpus.jsonl`` (documents with a ``text`` field), ``books/`` (text files),
  ``data.parquet`` (a ``content`` column), ``mytok.py`` (``encode`` with ``encode.vocab_size``),
  ``tokenizer.json`` (a real word-level tokenizer trained with the ``tokenizers`` library, EOS
  ``</s>``), ``./third-party-tars`` (shards written by the ``webdataset`` library's ``TarWriter``),
  the token datasets ``ds_web`` and ``ds_code`` and the sample dataset ``train_a``;
* on the local Ceph cluster (the ``ceph_s3`` fixture): the buckets ``bucket``, ``raw`` and ``b``,
  emptied and made again first (bucket names are global in RGW; a file lock keeps two runs of this
  module apart), holding ``s3://raw/corpus/`` (JSONL), ``s3://bucket/train`` and
  ``s3://bucket/train_b`` (image datasets);
* the environment of a user who ran ``eval "$(tools/ceph-up.sh)"`` (``AWS_ACCESS_KEY_ID``,
  ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``), the venv's ``bin``
  first on ``PATH``, and a Ray head started with ``ray start --head`` (in a private
  ``RAY_TMPDIR``) for ``--ray-address auto``.

A shell block runs as one ``bash`` script, its lines as written (continuations included) but
for :data:`SUBSTITUTIONS`; every command's exit status is checked, and :data:`OUTPUT_CHECKS`
checks what some print. A Python block runs as a script in a fresh interpreter, after a prelude
that defines what a training script has defined before the README's lines (:data:`PREDEFINED`),
and must run to its end. A line that cannot run here is in :data:`NOT_RUN` with the reason and
the test that covers it. Every table entry must still occur in the README, so the tables cannot
rot, and a README line that is in no table runs: a new line that fails is a failing test.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from fastload.testing import need
from fastload.testing.ceph import CephS3

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
VENV_BIN = Path(sys.executable).parent

SHELL = {"bash", "sh", "shell"}
PYTHON = {"python", "py"}

#: Text in README code that the test replaces before running it: host names and paths that do
#: not exist on a test machine. Each key must occur in README's code. Nothing else is changed.
SUBSTITUTIONS_DOC: dict[str, str] = {
    "http://rgw:7480": "the local Ceph RGW's endpoint (http://127.0.0.1:PORT)",
    "http://other:7480": "the same endpoint (a second S3 service is not needed to run the line)",
    "/nvme/fastload-cache": "a cache directory in the sandbox",
    "AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=...": (
        "the cluster's real keys (the '...' placeholders; the values come from the environment, "
        "so they are never printed)"
    ),
}

#: README lines (a shell command without its trailing comment) that are not run here, with why
#: and the test that covers them instead.
NOT_RUN: dict[str, tuple[str, str]] = {
    "make demo": (
        "builds its own virtualenv (.venv-demo, a torch download) and runs the demo on 1,200 images",
        "tests/test_demo.py runs `python -m fastload.demo`; CI runs `make demo` itself",
    ),
    "make test": (
        "is the whole test suite, this test included",
        ".ci/run (CI) runs `make test`",
    ),
    "pip install 'fastload[tokens]'": (
        "would install the package from an index into the test's venv",
        "test_readme.py::test_extras_named_in_readme_exist (the extra exists and its modules import)",
    ),
    "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint node1 train.py": (
        "a launch over two 8-GPU nodes (node1, node2) running the user's train.py",
        "tests/e2e/test_torchrun_nodes.py (torchrun, 2 nodes x 2 ranks x 2 workers, Ceph RGW)",
    ),
    "horovodrun -np 16 -H node1:8,node2:8 python train.py": (
        "a launch over two 8-GPU nodes (node1, node2) running the user's train.py",
        "tests/loader/test_launch_env.py and tests/e2e/test_launchers.py (Horovod's variables "
        "by contract)",
    ),
    "mpirun -n 16 -H node1:8,node2:8 python train.py": (
        "a launch over two 8-GPU nodes (node1, node2) running the user's train.py",
        "tests/e2e/test_launchers.py (the real mpirun, 3 processes, exactly once, resumed on 2)",
    ),
    "srun -N 2 --ntasks-per-node 8 python train.py": (
        "a launch over two SLURM nodes running the user's train.py",
        "tests/e2e/test_launchers.py (the real srun on a one-node SLURM cluster)",
    ),
    "fastload convert hdfs://nn:8020/raw hdfs://nn:8020/ds --executor spark --spark-master yarn": (
        "needs a YARN cluster and a NameNode named nn; none can run on a test machine",
        "tests/convert/test_spark.py (the Spark executor on a local master, local disk, Ceph RGW "
        "and a real local HDFS)",
    ),
}

#: README commands (without their trailing comment) and a regular expression their output must
#: match: proof that the line did what it says, beyond exit status 0.
OUTPUT_CHECKS: dict[str, str] = {
    "fastload convert ./images ./shards --format webdataset --shard-size 256MB --workers 8": (
        r"converted 40 samples \(source imagefolder"
    ),
    "fastload inspect ./shards": r"(?m)^samples +40$",
    "fastload verify ./shards": r"\bOK\b",
    "fastload index ./third-party-tars": r"wrote 2 index files",
    "fastload convert s3://raw/corpus s3://bucket/ds --executor ray --ray-address auto": (
        r"converted 2000 samples \(source jsonl"
    ),
    "fastload convert corpus.jsonl ds --tokenize tokenizer.json --text-field text": (
        r"holding 82000 tokens of 2000 documents"
    ),
    "fastload convert books/ ds-bytes --tokenize byte": r"tokens of 150 documents",
    "fastload convert data.parquet ds2 --tokenize mytok:encode --text-field content --eos 2": (
        r"tokens of 200 documents"
    ),
    # the tokenizer's own EOS: "</s>", id 1 in the tokenizer the test trains
    "fastload inspect ds": r"(?m)^tokens +82000 in 2000 documents \(uint16, vocab \d+, EOS 1\b",
    "python -m fastload.demo_tokens": r"exactly-once over tokens across the resume: ok",
    "fastload inspect s3://bucket/text --endpoint-url http://rgw:7480": r"(?m)^samples +2000$",
    "fastload verify s3://bucket/text": r"\bOK\b",
}

#: Names a training script has defined before README's Python lines use them (the prelude of
#: every Python block). ``start_epoch = 89`` makes ``range(start_epoch, 90)`` one epoch; the
#: checkpoint holds the state of the README's loader at the start of epoch 89, as saved by the
#: previous epoch's loop; ``URL`` is the RGW endpoint.
PREDEFINED = ("checkpoint", "start_epoch", "URL")

IMAGES = 40
CLASSES = 4
BUCKETS = ("bucket", "raw")
LOCK = Path(tempfile.gettempdir()) / "fastload-test-readme.lock"
BLOCK_TIMEOUT = 600


# ---- README parsing ------------------------------------------------------------------------


@dataclass
class Command:
    """One logical shell command: its physical lines (continuations joined) and README line."""

    lineno: int
    lines: list[str]

    @property
    def text(self) -> str:
        """The command as one line, without its trailing comment."""
        joined = " ".join(line.rstrip("\\").strip() for line in self.lines)
        return " ".join(re.sub(r"(^|\s)#(\s.*)?$", "", joined).split())


@dataclass
class Block:
    """A fenced code block of README.md."""

    lang: str
    lineno: int  # the README line of the opening fence
    lines: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.lang}-line{self.lineno}"

    def commands(self) -> list[Command]:
        """The shell commands of the block (blank and comment-only lines dropped)."""
        out: list[Command] = []
        current: Command | None = None
        for i, line in enumerate(self.lines):
            if current is None:
                if not line.strip() or line.lstrip().startswith("#"):
                    continue
                current = Command(self.lineno + 1 + i, [])
            current.lines.append(line)
            if not line.rstrip().endswith("\\"):
                out.append(current)
                current = None
        if current is not None:
            out.append(current)
        return out


def readme_blocks(text: str | None = None) -> list[Block]:
    """The fenced code blocks of README.md, in order."""
    text = README.read_text() if text is None else text
    blocks: list[Block] = []
    current: Block | None = None
    for n, line in enumerate(text.splitlines(), start=1):
        if current is None:
            match = re.match(r"^```\s*([\w+-]*)\s*$", line)
            if match:
                current = Block(match.group(1).lower(), n)
        elif line.strip() == "```":
            blocks.append(current)
            current = None
        else:
            current.lines.append(line)
    assert current is None, (
        f"README.md: the code block opened at line {current.lineno} never closes"
    )
    return blocks


def readme_commands() -> list[str]:
    return [c.text for b in readme_blocks() if b.lang in SHELL for c in b.commands()]


def readme_code() -> str:
    return "\n".join("\n".join(b.lines) for b in readme_blocks())


# ---- tests that need nothing but the README -------------------------------------------------


def test_every_code_block_is_shell_or_python() -> None:
    blocks = readme_blocks()
    assert blocks, "README.md has no code block"
    for block in blocks:
        assert block.lang in SHELL | PYTHON, (
            f"README.md line {block.lineno}: a ```{block.lang} block; this test runs only "
            f"{sorted(SHELL | PYTHON)} blocks: give it one of those languages (or extend the test)"
        )


def test_the_tables_name_only_what_readme_has() -> None:
    """Every entry of the substitution, not-run and output tables still occurs in README's code:
    a line changed in README must change here too."""
    code = readme_code()
    commands = readme_commands()
    stale = [k for k in SUBSTITUTIONS_DOC if k not in code]
    stale += [k for k in NOT_RUN if k not in commands]
    stale += [k for k in OUTPUT_CHECKS if k not in commands]
    assert not stale, f"tests/test_readme.py names lines README.md no longer has: {stale}"


def test_extras_named_in_readme_exist() -> None:
    """``pip install 'fastload[X]'`` in README names an extra of pyproject.toml whose packages
    the test venv has (the line itself is not run: see NOT_RUN)."""
    import importlib.util
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    modules = {
        "tokens": "tokenizers",
        "ray": "ray",
        "spark": "pyspark",
        "parquet": "pyarrow",
        "s3": "boto3",
        "hdfs": "hdfs_native",
        "dali": "nvidia.dali",
        "wds": "webdataset",
        "report": "matplotlib",
    }
    named = re.findall(r"pip install 'fastload\[(\w+)\]'", README.read_text())
    assert named
    for extra in named:
        assert extra in extras, (
            f"README names fastload[{extra}], pyproject.toml has {sorted(extras)}"
        )
        if extra != "dali":  # DALI: tests/dali (need() fails under CI without it)
            assert importlib.util.find_spec(modules[extra]) is not None, extra


# ---- the sandbox ----------------------------------------------------------------------------


def _write_inputs(root: Path) -> None:
    """The local inputs README's lines name."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import webdataset as wds
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    import fastload
    from fastload.testing.corpus import write_image_folder

    write_image_folder(root / "images", IMAGES, num_classes=CLASSES, scale=2, processes=2)
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(300)]

    def doc(n: int) -> str:
        return " ".join(rng.choice(words, size=n))

    # 2,000 documents of 40 words: ~82,000 ids, more than one TokenLoader batch of 32 x 2,049.
    docs = [doc(40) for _ in range(2000)]
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (root / "books").mkdir()
    for i in range(3):
        (root / "books" / f"book{i}.txt").write_text("\n".join(doc(30) for _ in range(50)) + "\n")
    pq.write_table(pa.table({"content": [doc(20) for _ in range(200)]}), root / "data.parquet")
    (root / "mytok.py").write_text(
        '"""A tokenizer function for `--tokenize mytok:encode`: one id per byte, from 3."""\n\n\n'
        "def encode(text):\n"
        "    return [3 + b for b in text.encode()]\n\n\n"
        "encode.vocab_size = 259\n"
    )
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        docs, trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"], vocab_size=1000)
    )
    tok.save(str(root / "tokenizer.json"))
    (root / "third-party-tars").mkdir()
    for s in range(2):
        with wds.TarWriter(str(root / "third-party-tars" / f"part-{s:04d}.tar")) as sink:
            for i in range(10):
                sink.write({"__key__": f"s{s}_{i:03d}", "txt": doc(5), "cls": str(i % 3)})
    for name in ("ds_web", "ds_code"):
        fastload.convert(root / "books", root / name, tokenize="byte", quiet=True)
    fastload.convert(root / "images", root / "train_a", quiet=True)


def _reset_buckets(ceph_s3: CephS3) -> None:
    client = ceph_s3.client()
    for name in BUCKETS:
        with contextlib.suppress(client.exceptions.NoSuchBucket):
            for upload in client.list_multipart_uploads(Bucket=name).get("Uploads", ()):
                client.abort_multipart_upload(
                    Bucket=name, Key=upload["Key"], UploadId=upload["UploadId"]
                )
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
                keys = [{"Key": o["Key"]} for o in page.get("Contents", ())]
                if keys:
                    client.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
            client.delete_bucket(Bucket=name)
        client.create_bucket(Bucket=name)


def _write_remote_inputs(root: Path, ceph_s3: CephS3) -> None:
    import fastload

    client = ceph_s3.client()
    client.put_object(
        Bucket="raw", Key="corpus/part-0000.jsonl", Body=(root / "corpus.jsonl").read_bytes()
    )
    options = ceph_s3.store_options()
    fastload.convert(root / "images", "s3://bucket/train", store_options=options, quiet=True)
    fastload.convert(root / "images", "s3://bucket/train_b", store_options=options, quiet=True)


@dataclass
class Sandbox:
    root: Path
    env: dict[str, str]
    substitutions: dict[str, str]
    endpoint: str
    done: dict[int, Any] = field(default_factory=dict)

    def substitute(self, text: str) -> str:
        for old, new in self.substitutions.items():
            text = text.replace(old, new)
        return text


@contextlib.contextmanager
def _ray_head(env: dict[str, str]) -> Iterator[None]:
    """``ray start --head`` in the sandbox's private RAY_TMPDIR, for ``--ray-address auto``."""
    try:
        import ray  # noqa: F401
    except ImportError:
        need("Ray", False, "pip install 'fastload[ray]' (or '.[dev]')")
    log = Path(env["RAY_TMPDIR"]) / "head.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(VENV_BIN / "ray"), "start", "--head", "--block", "--port=0", "--num-cpus=2",
             "--include-dashboard=false", "--disable-usage-stats",
             "--object-store-memory=200000000", "--node-ip-address=127.0.0.1"],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log.read_text():
            assert proc.poll() is None, f"ray start --head failed:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"ray start --head hangs:\n{log.read_text()}"
            time.sleep(0.2)
        yield
    finally:
        # --block drains for up to 30 s on SIGTERM; the head is ours alone: end its group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def sandbox(ceph_s3: CephS3) -> Iterator[Sandbox]:
    LOCK.touch()
    with LOCK.open() as lock, contextlib.ExitStack() as stack:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the buckets are global: one run of this module at once
        # Short: Ray's socket paths must stay under 108 bytes.
        root = Path(tempfile.mkdtemp(prefix="fl-readme-"))
        stack.callback(shutil.rmtree, root, ignore_errors=True)
        (root / "ray").mkdir()
        env = {
            **os.environ,
            "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "AWS_ACCESS_KEY_ID": ceph_s3.access_key_id,
            "AWS_SECRET_ACCESS_KEY": ceph_s3.secret_access_key,
            "AWS_ENDPOINT_URL": ceph_s3.endpoint_url,
            "AWS_DEFAULT_REGION": ceph_s3.region,
            "RAY_TMPDIR": str(root / "ray"),
            "PYTHONUNBUFFERED": "1",
        }
        for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "RAY_ADDRESS", "VIRTUAL_ENV"):
            env.pop(name, None)
        work = root / "work"
        work.mkdir()
        cache = root / "nvme-cache"
        substitutions = {
            "http://rgw:7480": ceph_s3.endpoint_url,
            "http://other:7480": ceph_s3.endpoint_url,
            "/nvme/fastload-cache": str(cache),
            "AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=...": (
                'AWS_ACCESS_KEY_ID="$AWS_ACCESS_KEY_ID" AWS_SECRET_ACCESS_KEY="$AWS_SECRET_ACCESS_KEY"'
            ),
        }
        assert substitutions.keys() == SUBSTITUTIONS_DOC.keys()
        _write_inputs(work)
        _reset_buckets(ceph_s3)
        _write_remote_inputs(work, ceph_s3)
        if any("--ray-address auto" in c for c in readme_commands()):
            stack.enter_context(_ray_head(env))
        yield Sandbox(work, env, substitutions, ceph_s3.endpoint_url)


# ---- running blocks -------------------------------------------------------------------------


def _shell_script(block: Block, box: Sandbox) -> tuple[str, list[Command]]:
    """The block as a bash script that marks and checks every command."""
    parts = ["exec 2>&1", "set -o pipefail"]
    run: list[Command] = []
    for n, command in enumerate(block.commands()):
        if command.text in NOT_RUN:
            parts.append(f": not run: README line {command.lineno} is in NOT_RUN")
            continue
        run.append(command)
        parts.append(f"echo '@@readme-command {n}'")
        parts.extend(box.substitute(line) for line in command.lines)
        parts.append(f'rc=$?; if [ $rc -ne 0 ]; then echo "@@readme-failed {n} $rc"; exit $rc; fi')
    return "\n".join(parts) + "\n", run


def _run_shell(block: Block, box: Sandbox) -> None:
    script, run = _shell_script(block, box)
    proc = subprocess.run(
        ["bash", "-c", script], cwd=box.root, env=box.env, capture_output=True, text=True,
        timeout=BLOCK_TIMEOUT,
    )  # fmt: skip
    outputs: dict[int, str] = {}
    for part in proc.stdout.split("@@readme-command ")[1:]:
        n, _, text = part.partition("\n")
        outputs[int(n)] = text
    commands = block.commands()
    failed = re.search(r"@@readme-failed (\d+) (\d+)", proc.stdout)
    if failed:
        command = commands[int(failed.group(1))]
        pytest.fail(
            f"README.md line {command.lineno} exits {failed.group(2)}:\n  "
            + "\n  ".join(command.lines)
            + f"\noutput:\n{outputs.get(int(failed.group(1)), '')}"
        )
    assert proc.returncode == 0, proc.stdout
    assert len(outputs) == len(run), proc.stdout
    for n, command in enumerate(commands):
        pattern = OUTPUT_CHECKS.get(command.text)
        if pattern is not None:
            assert re.search(pattern, outputs[n]), (
                f"README.md line {command.lineno} ({command.text}) printed no match for "
                f"{pattern!r}:\n{outputs[n]}"
            )


_PRELUDE = """\
import pickle as _pickle
with open({checkpoint!r}, "rb") as _f:
    checkpoint = _pickle.load(_f)
start_epoch = 89
URL = {url!r}
# ---- README.md line {lineno} ----
"""

_EPILOGUE = """
# ---- end of the README block ----
import json as _json
_seen = {{"done": True}}
if isinstance(globals().get("checkpoint"), dict):
    _seen["checkpoint"] = {{k: repr(v) for k, v in checkpoint.items()}}
if hasattr(globals().get("loader"), "stats"):
    _seen["stats"] = loader.stats()
if hasattr(globals().get("ds"), "__len__"):
    _seen["len(ds)"] = len(ds)
with open({out!r}, "w") as _f:
    _json.dump(_seen, _f, default=repr)
"""


def _checkpoint(box: Sandbox) -> Path:
    """The state the README's image loader saved at the end of epoch 88 (for ``checkpoint``)."""
    path = box.root.parent / "checkpoint.pkl"
    if not path.exists():
        import fastload

        ds = fastload.open_dataset(
            box.root / "shards", shuffle=True, seed=0, decode="bytes", fields=("jpg", "cls")
        )
        loader = fastload.DataLoader(ds, batch_size=256, num_workers=0)
        loader.set_epoch(89)
        path.write_bytes(pickle.dumps({"loader": loader.state_dict()}))
    return path


def _first_checkpoint(box: Sandbox) -> str:
    """``repr`` of the loader state every Python block starts from."""
    state = pickle.loads(_checkpoint(box).read_bytes())["loader"]
    return repr(state)


def _run_python(block: Block, box: Sandbox) -> dict[str, Any]:
    out = box.root.parent / f"seen-{block.lineno}.json"
    out.unlink(missing_ok=True)
    code = "\n".join(
        [
            _PRELUDE.format(
                checkpoint=str(_checkpoint(box)), url=box.endpoint, lineno=block.lineno
            ),
            box.substitute("\n".join(block.lines)),
            _EPILOGUE.format(out=str(out)),
        ]
    )
    script = box.root.parent / f"readme-block-{block.lineno}.py"
    script.write_text(code)
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=box.root, env=box.env, capture_output=True, text=True,
        timeout=BLOCK_TIMEOUT,
    )  # fmt: skip
    if proc.returncode != 0 or not out.exists():
        pytest.fail(
            f"the README.md block at line {block.lineno} fails (exit {proc.returncode}):\n"
            f"{proc.stdout}\n{proc.stderr}"
        )
    seen: dict[str, Any] = json.loads(out.read_text())
    seen["stdout"] = proc.stdout
    return seen


def _run_upto(index: int, box: Sandbox) -> Any:
    """Run README's blocks in order up to ``index`` (each once); the result of block ``index``."""
    blocks = readme_blocks()
    for i in range(index + 1):
        if i in box.done:
            continue
        block = blocks[i]
        if block.lang in PYTHON and "fastload.dali" in "\n".join(block.lines):
            try:
                import nvidia.dali  # noqa: F401
            except ImportError:
                need("NVIDIA DALI", False, "pip install 'fastload[dali]' (or '.[dev]')")
        try:
            if block.lang in SHELL:
                _run_shell(block, box)
                box.done[i] = None
            else:
                box.done[i] = _run_python(block, box)
        except BaseException as exc:
            box.done[i] = exc
        if isinstance(box.done[i], BaseException) and i < index:
            pytest.fail(f"an earlier README block (line {block.lineno}) failed: {box.done[i]}")
    result = box.done[index]
    if isinstance(result, BaseException):
        raise result
    return result


_BLOCKS = readme_blocks()


@pytest.mark.slow
@pytest.mark.ceph
@pytest.mark.parametrize("index", range(len(_BLOCKS)), ids=[b.id for b in _BLOCKS])
def test_readme_block_runs_as_written(index: int, sandbox: Sandbox) -> None:
    block = _BLOCKS[index]
    assert readme_blocks()[index].lines == block.lines, "README.md changed during the test run"
    result = _run_upto(index, sandbox)
    code = "\n".join(block.lines)
    if 'fastload.open_dataset("./shards"' in code:
        # the loop ran epoch 89 to its end: the 40 images in one batch, then printed the stats
        assert result["stats"]["samples"] == IMAGES, result
        assert result["stats"]["epoch"] == 89, result
        assert f"'samples': {IMAGES}," in result["stdout"], result["stdout"]
    if 'fastload.open_tokens("ds"' in code:
        # the token loop's body ran: checkpoint["loader"] is now the TokenLoader's state
        assert result["checkpoint"]["loader"] != _first_checkpoint(sandbox), result
    if "DALILoader(" in code:
        # epoch 89 of the 40 images of s3://bucket/train, read through the cache
        assert result["stats"]["samples"] == IMAGES, result
    elif '"s3://bucket/train"' in code:
        assert result["len(ds)"] == IMAGES, result
