"""``convert --tokenize``: token datasets read back and compared with a plain tokenizing loop,
for every format and source; determinism across workers; resumption after SIGKILL; interop."""

from __future__ import annotations

import importlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import tarfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload.formats import get_format, read_manifest
from fastload.formats.tokens import TokenLayout
from fastload.storage import open_store

fc = importlib.import_module("fastload.convert")
CLI = [sys.executable, "-m", "fastload.cli"]
WORDS = ["the", "quick", "brown", "fox", "über", "naïve", "日本", "data", "shard", "token", "a"]


def documents(n: int, seed: int = 0) -> list[str]:
    """Generated documents, an empty one among them (it yields no token: no document)."""
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 80))) for _ in range(n)]
    docs[3] = ""
    return docs


def train_bpe(path: Path, special: tuple[str, ...] = ("<|endoftext|>",)) -> Path:
    """A tiny byte-level BPE trained on generated text (nothing is downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(documents(500, seed=1), trainer)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_bpe(tmp_path_factory.mktemp("bpe") / "tokenizer.json")


def expected_stream(docs: list[str], encode: Any, eos: int | None) -> tuple[list[int], list[int]]:
    """The plain loop: each document's ids then EOS; and where each document starts."""
    stream: list[int] = []
    starts: list[int] = []
    for text in docs:
        ids = list(encode(text))
        if not ids:
            continue
        starts.append(len(stream))
        stream += ids + ([eos] if eos is not None else [])
    return stream, starts


def read_tokens(url: Path | str) -> tuple[TokenLayout, list[int], list[int]]:
    """A token dataset read back with its format's reader: the layout (checked), the stream
    (blocks concatenated in manifest and key order) and the documents' global starts; checks
    the layout's promises on the way."""
    store = open_store(url)
    manifest = read_manifest(store)
    layout = TokenLayout.from_metadata(
        manifest.metadata, shard_samples=[s.num_samples for s in manifest.shards], where=str(url)
    )
    fmt = get_format(manifest.format)
    stream: list[int] = []
    starts: list[int] = []
    for entry, shard_tokens in zip(manifest.shards, layout.shard_tokens, strict=True):
        with fmt.reader(store, entry.name) as reader:
            samples = list(reader)
        keys = [s["__key__"] for s in samples]
        assert keys == sorted(keys)
        begin = len(stream)
        for i, sample in enumerate(samples):
            block = np.load(io.BytesIO(bytes(sample["tokens.npy"])), allow_pickle=False)
            docs = np.load(io.BytesIO(bytes(sample["docs.npy"])), allow_pickle=False)
            assert block.dtype == layout.dtype
            assert docs.dtype == np.dtype("<u4")
            if i < len(samples) - 1:
                assert len(block) == layout.block_tokens
            assert 1 <= len(block) <= layout.block_tokens
            assert list(docs) == sorted(set(docs.tolist()))
            assert all(d < len(block) for d in docs)
            starts += [len(stream) + int(d) for d in docs]
            stream += block.tolist()
        assert len(stream) - begin == shard_tokens
        assert begin in starts  # a shard begins with a document (whole documents per shard)
        if layout.eos_id is not None:
            assert stream[-1] == layout.eos_id
    assert len(stream) == layout.num_tokens
    assert len(starts) == layout.num_documents
    return layout, stream, starts


def write_jsonl(path: Path, docs: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs)))


def test_bpe_round_trip_every_format(tmp_path: Path, real_fmt: str, bpe: Path) -> None:
    from tokenizers import Tokenizer

    docs = documents(300)
    write_jsonl(tmp_path / "src" / "c.jsonl", docs)
    dst = tmp_path / "dst"
    tokenize = fc.Tokenize(str(bpe), text_field="body", block_tokens=100)
    fc.convert(
        tmp_path / "src", dst, format=real_fmt, tokenize=tokenize, shard_size="4KB", quiet=True
    )
    tok = Tokenizer.from_file(str(bpe))
    eos = tok.token_to_id("<|endoftext|>")
    stream, starts = expected_stream(
        docs, lambda t: tok.encode(t, add_special_tokens=False).ids, eos
    )
    layout, got, got_starts = read_tokens(dst)
    assert (got, got_starts) == (stream, starts)
    assert len(layout.shard_tokens) > 3  # several shards, so the shard cuts are exercised
    assert layout.eos_id == eos
    assert layout.vocab_size == max(tok.get_vocab(with_added_tokens=True).values()) + 1
    assert layout.dtype == np.dtype("<u2")
    assert layout.num_documents == len(docs) - 1
    assert layout.tokenizer["kind"] == "hf-json"
    assert layout.tokenizer["text_field"] == "body"
    assert layout.tokenizer["eos_token"] == "<|endoftext|>"


def test_workers_do_not_change_the_bytes(tmp_path: Path, bpe: Path, cv: Any) -> None:
    write_jsonl(tmp_path / "src" / "c.jsonl", documents(400))
    trees = []
    for workers in (1, 2):
        dst = tmp_path / f"w{workers}"
        tokenize = fc.Tokenize(str(bpe), text_field="body", block_tokens=64)
        fc.convert(
            tmp_path / "src", dst, tokenize=tokenize, shard_size="3KB", workers=workers, quiet=True
        )
        trees.append(cv.tree_bytes(dst))
    assert trees[0] == trees[1]
    assert sum(1 for k in trees[0] if k.endswith(".tar")) > 4


@pytest.mark.parametrize("source", ["text", "csv", "parquet", "shards"])
def test_byte_tokenizer_from_every_text_source(tmp_path: Path, source: str) -> None:
    docs = [d for d in documents(120) if d]  # blank lines are not records of a text source
    src = tmp_path / "src"
    src.mkdir()
    if source == "text":
        (src / "a.txt").write_text("".join(d + "\n" for d in docs))
    elif source in ("csv", "parquet"):
        import pyarrow as pa
        import pyarrow.csv as pacsv
        import pyarrow.parquet as pq

        table = pa.table({"title": [f"t{i}" for i in range(len(docs))], "content": docs})
        if source == "csv":
            pacsv.write_csv(table, src / "a.csv")
        else:
            pq.write_table(table, src / "a.parquet", row_group_size=50)
    else:  # an existing dataset whose samples hold the text in a field
        write_jsonl(tmp_path / "raw" / "a.jsonl", docs)
        fc.convert(tmp_path / "raw", src, format="tfrecord", shard_samples=40, quiet=True)
    field = {"text": None, "csv": "content", "parquet": "content", "shards": "body"}[source]
    dst = tmp_path / "dst"
    fc.convert(
        src,
        dst,
        format="lmdb",
        tokenize=fc.Tokenize("byte", text_field=field, block_tokens=256),
        shard_samples=30,
        workers=1,
        quiet=True,
    )
    layout, got, starts = read_tokens(dst)
    want, want_starts = expected_stream(docs, lambda t: t.encode("utf-8"), 256)
    assert (got, starts) == (want, want_starts)
    assert (layout.vocab_size, layout.eos_id, layout.dtype) == (257, 256, np.dtype("<u2"))
    assert len(layout.shard_tokens) == 4  # shard_samples counts documents (records)


def _tokenizer_module(tmp_path: Path, body: str) -> None:
    (tmp_path / "tok_fn_test.py").write_text(body)
    importlib.invalidate_caches()
    sys.modules.pop("tok_fn_test", None)


def test_function_tokenizer_with_a_large_vocabulary_is_uint32(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _tokenizer_module(
        tmp_path,
        "def ids(text):\n"
        "    return [70000 + len(w) for w in text.split()]\n"
        "ids.vocab_size = 70100\n"
        "ids.eos_id = 70099\n",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    docs = documents(200)
    write_jsonl(tmp_path / "src" / "a.jsonl", docs)
    dst = tmp_path / "dst"
    fc.convert(
        tmp_path / "src",
        dst,
        tokenize=fc.Tokenize("tok_fn_test:ids", text_field="body", block_tokens=50),
        shard_size="1KB",
        workers=2,
        quiet=True,
    )
    layout, got, starts = read_tokens(dst)
    want, want_starts = expected_stream(docs, lambda t: [70000 + len(w) for w in t.split()], 70099)
    assert (got, starts) == (want, want_starts)
    assert layout.dtype == np.dtype("<u4")
    assert layout.vocab_size == 70100
    assert layout.tokenizer["function"] == "tok_fn_test:ids"


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=30),
    block_tokens=st.integers(1, 33),
    per_shard=st.integers(1, 12),
    eos=st.booleans(),
)
def test_blocks_hold_the_stream_for_any_lengths(
    lengths: list[int], block_tokens: int, per_shard: int, eos: bool
) -> None:
    docs = ["".join(chr(97 + (i + j) % 26) for j in range(n)) for i, n in enumerate(lengths)]
    name = f"tok-{uuid.uuid4().hex}"
    src, dst = open_store(f"memory://{name}-src"), open_store(f"memory://{name}-dst")
    src.put("a.jsonl", "".join(json.dumps({"text": d}) + "\n" for d in docs).encode())

    def run() -> None:
        fc.convert(
            src.url,
            dst.url,
            tokenize=fc.Tokenize("byte", eos=None if eos else "none", block_tokens=block_tokens),
            shard_samples=per_shard,
            quiet=True,
        )

    # An empty document yields no token, so it is no document; a shard of only those is an error.
    if any(not any(docs[i : i + per_shard]) for i in range(0, len(docs), per_shard)):
        with pytest.raises(fc.ConversionError, match="would hold no token"):
            run()
        return
    run()
    want, want_starts = expected_stream(docs, lambda t: t.encode(), 256 if eos else None)
    assert read_tokens(dst.url)[1:] == (want, want_starts)


def test_webdataset_library_reads_a_token_shard(tmp_path: Path) -> None:
    import webdataset as wds

    docs = documents(50)
    write_jsonl(tmp_path / "src" / "a.jsonl", docs)
    dst = tmp_path / "dst"
    fc.convert(
        tmp_path / "src",
        dst,
        tokenize=fc.Tokenize("byte", text_field="body", block_tokens=500),
        quiet=True,
    )
    shard = dst / "shard-000000.tar"
    with tarfile.open(shard) as tar:
        assert tar.getnames()[:2] == ["000000-000000000.tokens.npy", "000000-000000000.docs.npy"]
    stream: list[int] = []
    for sample in wds.WebDataset(str(shard), shardshuffle=False):
        stream += np.load(io.BytesIO(sample["tokens.npy"]), allow_pickle=False).tolist()
    assert stream == expected_stream(docs, lambda t: t.encode(), 256)[0]


def test_inspect_and_verify_a_token_dataset(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "src" / "a.jsonl", documents(60))
    dst = tmp_path / "dst"
    argv = [*CLI, "convert", str(tmp_path / "src"), str(dst), "--tokenize", "byte"]
    argv += ["--text-field", "body", "--block-tokens", "300", "--shard-samples", "20"]
    subprocess.run([*argv, "-q"], check=True, timeout=120)
    layout = read_tokens(dst)[0]
    again = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=120).stderr
    assert f"(source jsonl, no class list) holding {layout.num_tokens} tokens of 59 docu" in again
    shown = subprocess.run(
        [*CLI, "inspect", str(dst)], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert (
        f"tokens    {layout.num_tokens} in 59 documents (uint16, vocab 257, EOS 256, blocks of 300; "
        "tokenizer byte)"
    ) in shown
    assert fc.inspect_dataset(dst)["tokens"]["tokens"] == layout.num_tokens
    assert fc.verify_dataset(dst).ok
    # metadata that disagrees with the shards is a problem verify names
    manifest = json.loads((dst / "fastload.json").read_text())
    manifest["metadata"]["tokens"]["shard_tokens"][0] += 300
    manifest["metadata"]["tokens"]["num_tokens"] += 300
    (dst / "fastload.json").write_text(json.dumps(manifest))
    problems = fc.verify_dataset(dst).problems
    assert len(problems) == 1, problems
    assert "shard 0 holds" in problems[0]


def test_resume_after_sigkill_is_byte_identical(tmp_path: Path, cv: Any) -> None:
    (tmp_path / "slowtok_test.py").write_text(
        "import time\n\n"
        "def ids(text):\n"
        "    time.sleep(0.002)\n"
        "    return list(text.encode())\n\n"
        "ids.vocab_size = 256\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    write_jsonl(tmp_path / "src" / "a.jsonl", documents(600))

    def cmd(dst: Path) -> list[str]:
        return [
            *CLI, "convert", str(tmp_path / "src"), str(dst), "--tokenize", "slowtok_test:ids",
            "--eos", "0", "--text-field", "body", "--block-tokens", "128", "--shard-samples", "40",
            "--workers", "2", "--quiet",
        ]  # fmt: skip

    subprocess.run(cmd(tmp_path / "ref"), env=env, check=True, timeout=120)
    reference = cv.tree_bytes(tmp_path / "ref")
    dst = tmp_path / "dst"
    proc = subprocess.Popen(cmd(dst), env=env, start_new_session=True)
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            done = dst / "_fastload_convert" / "done"
            if done.exists() and len(os.listdir(done)) >= 2:
                break
            time.sleep(0.005)
        else:
            pytest.fail("the conversion did not get far enough to be killed")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (dst / "fastload.json").exists()
    finished = subprocess.run(cmd(dst), env=env, timeout=120, capture_output=True, text=True)
    assert finished.returncode == 0, finished.stderr
    assert cv.tree_bytes(dst) == reference
    assert read_tokens(dst)[0].num_documents == 599


def test_converting_a_token_dataset_again_keeps_its_layout_only_if_it_holds(
    tmp_path: Path,
) -> None:
    docs = [f"{i:03d}" + "x" * 396 for i in range(100)]  # one block of 400 ids each, with EOS
    write_jsonl(tmp_path / "src" / "a.jsonl", docs)
    tokens = tmp_path / "tokens"
    fc.convert(
        tmp_path / "src",
        tokens,
        tokenize=fc.Tokenize("byte", text_field="body", block_tokens=400),
        shard_samples=25,
        quiet=True,
    )
    layout, stream, starts = read_tokens(tokens)
    assert layout.shard_blocks() == [25, 25, 25, 25]
    fc.convert(tokens, tmp_path / "same", format="lmdb", shard_samples=25, quiet=True)
    assert read_tokens(tmp_path / "same") == (layout, stream, starts)
    fc.convert(tokens, tmp_path / "other", shard_samples=30, quiet=True)
    manifest = read_manifest(open_store(tmp_path / "other"))
    assert "tokens" not in manifest.metadata
    assert manifest.num_samples == 100
