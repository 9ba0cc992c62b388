"""The token demo (``python -m fastload.demo_tokens``), run in-process on a small corpus: text is
tokenized by ``convert --tokenize``, a tiny causal LM trains with the token loader, the loader is
resumed from its state mid-epoch, and the demo's own checks (loss falls, exactly-once over tokens
across the resume) pass. Also: the exactly-once check itself catches a repeated and a lost row."""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from fastload.demo_tokens import VOCAB, check_exactly_once, main


def test_demo_trains_resumes_and_delivers_every_token_once(tmp_path: Path) -> None:
    out = io.StringIO()
    argv = ["--out", str(tmp_path), "--documents", "300", "--seq-len", "32", "--steps", "40"]
    with contextlib.redirect_stdout(out):
        rc = main(argv)
    text = out.getvalue()
    assert rc == 0, text
    assert "exactly-once over tokens across the resume: ok" in text
    found = re.search(r"first step ([\d.]+), last 20 steps ([\d.]+)", text)
    assert found is not None, text
    first, last = (float(x) for x in found.groups())
    assert last < first - 1.0  # from ~ln(257) = 5.5 to well below
    assert (tmp_path / "tokens" / "fastload.json").exists()


def test_exactly_once_check_catches_repeats_and_losses() -> None:
    rows = [[1, 2, 3], [3, 4, 5], [5, 6, 7]]
    counts = np.bincount([1, 2, 3, 4, 5, 6, 7], minlength=VOCAB)
    assert check_exactly_once(rows[:1], rows[1:], rows, counts, tail=1) is None
    assert check_exactly_once(rows[:2], rows[1:], rows, counts, tail=1) is not None  # repeat
    assert check_exactly_once(rows[:1], rows[2:], rows, counts, tail=1) is not None  # lost
    assert check_exactly_once(rows[:1], rows[1:], rows, counts, tail=2) is not None  # tail


def test_demo_says_what_it_does_before_each_slow_step(tmp_path: Path) -> None:
    # Issue 29: ~10 s of silence before the first line (torch's import, the corpus, the
    # conversion). Each step is announced before it runs, flushed; a re-run says what it reuses.
    argv = [sys.executable, "-m", "fastload.demo_tokens", "--out", str(tmp_path)]
    argv += ["--documents", "200", "--seq-len", "32", "--steps", "4"]
    first = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    lines = first.stdout.splitlines()
    text, data = tmp_path / "corpus" / "docs.txt", tmp_path / "tokens"
    assert lines[:3] == [
        "demo_tokens: starting (importing torch) ...",
        f"corpus: writing 200 documents to {text} ...",
        f"tokens: converting {text} with the byte tokenizer into {data} ...",
    ], first.stdout + first.stderr
    assert lines[3].startswith(f"converted {text} into {data} in ")
    assert lines[5] == "training 4 steps of 16 sequences, resuming after 2 ..."
    assert lines[6].startswith("step 1: loss ")
    again = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert again.stdout.splitlines()[:3] == [
        "demo_tokens: starting (importing torch) ...",
        f"corpus: {text}, kept from an earlier run",
        f"tokens: {data}, kept from an earlier run",
    ]
