"""The token demo (``python -m fastload.demo_tokens``), run in-process on a small corpus: text is
tokenized by ``convert --tokenize``, a tiny causal LM trains with the token loader, the loader is
resumed from its state mid-epoch, and the demo's own checks (loss falls, exactly-once over tokens
across the resume) pass. Also: the exactly-once check itself catches a repeated and a lost row."""

from __future__ import annotations

import contextlib
import io
import re
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
