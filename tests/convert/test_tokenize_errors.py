"""``convert --tokenize``: every mistake gets a typed error that names what is wrong and the fix."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fastload.errors import (
    ConversionError,
    DatasetExistsError,
    InvalidArgumentError,
    MissingDependencyError,
)

fc = importlib.import_module("fastload.convert")
CLI = [sys.executable, "-m", "fastload.cli"]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    lines = [{"body": f"doc {i} " + "word " * i, "lang": "en"} for i in range(12)]
    (src / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return src


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, body: str) -> None:
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()


def test_a_source_without_text_is_refused(tmp_path: Path, cv: Any) -> None:
    cv.make_image_folder(tmp_path / "images")
    with pytest.raises(InvalidArgumentError, match="needs a source with text") as info:
        fc.convert(tmp_path / "images", tmp_path / "dst", tokenize="byte", quiet=True)
    assert "imagefolder" in str(info.value)
    assert not (tmp_path / "dst").exists()


def test_a_missing_text_field_says_which_fields_there_are(corpus: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    with pytest.raises(InvalidArgumentError) as info:
        fc.convert(corpus, dst, tokenize=fc.Tokenize("byte", text_field="bdy"), quiet=True)
    text = str(info.value)
    assert "a.jsonl:1" in text
    assert "no text field 'bdy'" in text
    assert "its fields are: body, lang; did you mean 'body'?" in text
    # Nothing was written, so the right field then converts into the same destination.
    assert not (dst / "_fastload_convert").exists()
    result = fc.convert(corpus, dst, tokenize=fc.Tokenize("byte", text_field="body"), quiet=True)
    assert result.manifest is not None
    assert result.manifest.metadata["tokens"]["num_documents"] == 12


def test_companion_options_need_tokenize(corpus: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [*CLI, "convert", str(corpus), str(tmp_path / "dst"), "--text-field", "body"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--text-field only applies with --tokenize TOKENIZER" in proc.stderr


def test_ids_outside_the_vocabulary_name_the_record(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _module(
        tmp_path,
        monkeypatch,
        "badids_test",
        "def ids(text):\n"
        "    return [len(text) % 7, 9 + ('7 ' in text)]\n"
        "ids.vocab_size = 10\n"
        "ids.eos_id = 0\n",
    )
    tokenize = fc.Tokenize("badids_test:ids", text_field="body")
    with pytest.raises(ConversionError) as info:
        fc.convert(corpus, tmp_path / "dst", tokenize=tokenize, workers=1, quiet=True)
    assert "a.jsonl:8" in str(info.value)  # the record "doc 7 ..."
    assert "returned id 10 at position 1, outside [0, 10) (its vocab_size)" in str(info.value)
    result = fc.convert(
        corpus, tmp_path / "skip", tokenize=tokenize, on_error="skip", workers=1, quiet=True
    )
    assert [s.item for s in result.skipped] == ["a.jsonl:8"]
    assert result.manifest is not None
    assert result.manifest.metadata["tokens"]["num_documents"] == 11
    assert result.manifest.metadata["tokens"]["num_tokens"] == 33


def test_a_function_must_declare_its_vocabulary(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _module(tmp_path, monkeypatch, "novocab_test", "def ids(text):\n    return [1]\n")
    with pytest.raises(InvalidArgumentError, match=r"vocab_size = 50257"):
        fc.convert(corpus, tmp_path / "d1", tokenize="novocab_test:ids", quiet=True)
    with pytest.raises(InvalidArgumentError, match="there is no module 'novocab_tes'"):
        fc.convert(corpus, tmp_path / "d2", tokenize="novocab_tes:ids", quiet=True)


def _bpe_without_eos(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["some words to learn from"] * 20, trainer)
    tok.save(str(path))
    return path


def test_a_tokenizer_file_without_eos_asks_for_one(corpus: Path, tmp_path: Path) -> None:
    path = str(_bpe_without_eos(tmp_path / "tok.json"))
    with pytest.raises(InvalidArgumentError) as info:
        fc.convert(corpus, tmp_path / "d1", tokenize=fc.Tokenize(path, text_field="body"))
    assert "declares no end-of-sequence token" in str(info.value)
    assert "pass --eos TOKEN or --eos ID (its special tokens: <pad>)" in str(info.value)
    with pytest.raises(InvalidArgumentError, match=r"did you mean '<pad>'\?"):
        fc.convert(corpus, tmp_path / "d2", tokenize=fc.Tokenize(path, "body", eos="<pa>"))
    result = fc.convert(
        corpus, tmp_path / "d3", tokenize=fc.Tokenize(path, "body", eos="none"), quiet=True
    )
    assert result.manifest is not None
    assert result.manifest.metadata["tokens"]["eos_id"] is None
    result = fc.convert(
        corpus, tmp_path / "d4", tokenize=fc.Tokenize(path, "body", eos="<pad>"), quiet=True
    )
    assert result.manifest is not None
    assert result.manifest.metadata["tokens"]["eos_id"] == 0


def test_missing_tokenizers_package_says_how_to_install(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _bpe_without_eos(tmp_path / "tok.json")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'fastload\[tokens\]'"):
        fc.convert(corpus, tmp_path / "dst", tokenize=str(path))


def test_another_tokenizer_is_refused_not_mixed(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = tmp_path / "dst"
    fc.convert(corpus, dst, tokenize=fc.Tokenize("byte", "body", block_tokens=16), quiet=True)
    for other in (
        fc.Tokenize("byte", "body", block_tokens=32),
        fc.Tokenize("byte", "body", block_tokens=16, eos="none"),
        fc.Tokenize("byte", "lang", block_tokens=16),
    ):
        with pytest.raises(DatasetExistsError, match="already holds a different dataset"):
            fc.convert(corpus, dst, tokenize=other, quiet=True)
    unchanged = fc.convert(
        corpus, dst, tokenize=fc.Tokenize("byte", "body", block_tokens=16), quiet=True
    )
    assert unchanged.unchanged


@pytest.mark.parametrize(
    ("tokenize", "match"),
    [
        (fc.Tokenize("byte", "body", eos=5), "byte tokenizer is 256 or 'none'"),
        (fc.Tokenize("byte", "body", block_tokens=0), r"block_tokens \(--block-tokens\)"),
        (fc.Tokenize("nosuchfile.json", "body"), "neither a tokenizer JSON file"),
    ],
)
def test_bad_options(corpus: Path, tmp_path: Path, tokenize: Any, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        fc.convert(corpus, tmp_path / "dst", tokenize=tokenize, quiet=True)


def test_text_that_is_not_utf8_is_an_item_error(tmp_path: Path) -> None:
    path = str(_bpe_without_eos(tmp_path / "tok.json"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"some words\n\xff\xfe to learn\nwords\n")
    tokenize = fc.Tokenize(path, eos="none")
    with pytest.raises(ConversionError, match=r"a\.txt:2 .*the text is not UTF-8"):
        fc.convert(src, tmp_path / "d1", tokenize=tokenize, quiet=True)
    result = fc.convert(src, tmp_path / "d2", tokenize=tokenize, on_error="skip", quiet=True)
    assert [s.item for s in result.skipped] == ["a.txt:2"]
    assert result.manifest is not None
    assert result.manifest.metadata["tokens"]["num_documents"] == 2


def test_a_tokenizer_callable_must_pickle_and_name_an_id(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def local(text: str) -> list[int]:
        return [1]

    local.vocab_size = 4  # type: ignore[attr-defined]
    local.eos_id = 0  # type: ignore[attr-defined]
    with pytest.raises(InvalidArgumentError, match="cannot be sent to worker processes"):
        fc.convert(corpus, tmp_path / "d1", tokenize=local, quiet=True)
    _module(
        tmp_path,
        monkeypatch,
        "tokeos_test",
        "def ids(text):\n    return [1]\nids.vocab_size = 4\nids.eos_id = '</s>'\n",
    )
    with pytest.raises(InvalidArgumentError, match="must be an id or 'none', got '</s>'"):
        fc.convert(corpus, tmp_path / "d2", tokenize="tokeos_test:ids", quiet=True)
