"""The token demo: generate text, tokenize it into shards, train a tiny causal LM, resume mid-epoch.

``python -m fastload.demo_tokens`` does, on local storage only:

1. writes a text corpus (one document per line: sentences from a small random grammar, so that a
   tiny model can learn something in a few hundred steps);
2. converts it with ``fastload.convert(..., tokenize=Tokenize("byte"))`` into a token dataset
   (WebDataset shards of blocks of byte ids, EOS 256 after each document);
3. opens it with :func:`fastload.open_tokens` (``seq_len`` ids per sequence) and trains a small
   causal model (an embedding, a causal convolution over the last few ids and an MLP) with
   :class:`fastload.TokenLoader`, printing the loss;
4. stops half-way through the epoch, saves ``loader.state_dict()``, builds a new loader from it
   (as a restarted job would) and trains to the end of the epoch;
5. checks exactly-once over tokens: the rows delivered before and after the resume are those of an
   uninterrupted epoch, in order, and their input ids, counted, are the dataset's ids less the
   stream's last ``tail`` ids (the ids no sequence has as an input, see ``open_tokens``).

Exits 0 when the loss fell (the mean of the last 20 steps below the first step's) and the
exactly-once check passed, 1 otherwise. Everything lands under ``--out`` (default
``./demo-output/tokens``); re-running reuses the corpus and the dataset.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # torch's import takes seconds: say something first
    print("demo_tokens: starting (importing torch) ...", flush=True)

import numpy as np
import torch
from torch import nn

import fastload
from fastload.convert import Tokenize
from fastload.formats.tokens import TOKENS_FIELD

_SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher"]
_VERBS = ["sees", "likes", "follows", "finds", "paints", "hears"]
_OBJECTS = ["the river", "a red ball", "the garden", "an apple", "the quiet town", "a song"]
VOCAB = 257  # the byte tokenizer: bytes 0..255 and EOS 256


def write_corpus(path: Path, documents: int, seed: int = 0) -> None:
    """``documents`` lines of 1-6 grammatical sentences each, written atomically."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(documents):
        sentences = [
            f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}."
            for _ in range(int(rng.integers(1, 7)))
        ]
        lines.append(" ".join(sentences).capitalize())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)


class TinyLM(nn.Module):
    """Next-id model: embedding, a causal convolution over the last ``context`` ids, an MLP."""

    def __init__(self, dim: int = 64, context: int = 8) -> None:
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(VOCAB, dim)
        self.conv = nn.Conv1d(dim, dim, context)
        self.head = nn.Sequential(nn.GELU(), nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, VOCAB))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids).transpose(1, 2)  # (n, dim, L)
        x = nn.functional.pad(x, (self.context - 1, 0))  # causal: position t sees t-7..t
        out: torch.Tensor = self.head(self.conv(x).transpose(1, 2))  # (n, L, VOCAB)
        return out


def _step(model: TinyLM, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> float:
    logits = model(batch["input_ids"])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1))
    optimizer.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    return loss.item()


def dataset_id_counts(root: Path) -> np.ndarray[Any, Any]:
    """How often each id occurs in the dataset (read through its shards, every block once)."""
    counts = np.zeros(VOCAB, dtype=np.int64)
    ds = fastload.open_dataset(str(root), shuffle=False)
    for i in range(len(ds)):
        counts += np.bincount(np.load(io.BytesIO(ds[i][TOKENS_FIELD])), minlength=VOCAB)
    return counts


def check_exactly_once(
    before: list[list[int]],
    after: list[list[int]],
    reference: list[list[int]],
    dataset_counts: np.ndarray[Any, Any],
    tail: int,
) -> str | None:
    """``None`` when the rows of the two halves are the reference epoch's and their inputs are
    the dataset's ids less ``tail`` of them; else what is wrong."""
    if before + after != reference:
        return (
            f"the resumed epoch differs from an uninterrupted one ({len(before)} + {len(after)} "
            f"rows against {len(reference)})"
        )
    inputs = np.bincount([t for row in reference for t in row[:-1]], minlength=VOCAB)
    left = dataset_counts - inputs
    if (left < 0).any():
        return f"ids delivered more often than the dataset holds them: {np.flatnonzero(left < 0)}"
    if int(left.sum()) != tail:
        return f"{int(left.sum())} ids were never an input, but the epoch leaves out {tail}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="fastload token demo: tokenize, train, resume")
    parser.add_argument("--out", default="demo-output/tokens", help="working directory")
    parser.add_argument("--documents", type=int, default=3000, help="documents in the corpus")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=300, help="training steps (<= one epoch)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    text = out / "corpus" / "docs.txt"
    data = out / "tokens"
    if text.exists():
        print(f"corpus: {text}, kept from an earlier run", flush=True)
    else:
        print(f"corpus: writing {args.documents} documents to {text} ...", flush=True)
        write_corpus(text, args.documents, args.seed)
    if (data / "fastload.json").exists():
        print(f"tokens: {data}, kept from an earlier run", flush=True)
    else:
        print(f"tokens: converting {text} with the byte tokenizer into {data} ...", flush=True)
        t0 = time.perf_counter()
        fastload.convert(
            text.parent, data, tokenize=Tokenize("byte", block_tokens=1024), quiet=True
        )
        print(f"converted {text} into {data} in {time.perf_counter() - t0:.1f} s")

    source = fastload.open_tokens(str(data), args.seq_len, seed=args.seed)
    print(f"{source!r}: {source.tail} ids of the epoch are no sequence's input")
    loader = fastload.TokenLoader(source, args.batch_size, rank=0, world_size=1)
    steps = min(args.steps, len(loader))
    half = steps // 2
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses: list[float] = []
    before: list[list[int]] = []
    loader.set_epoch(0)
    print(f"training {steps} steps of {args.batch_size} sequences, resuming after {half} ...")
    for batch in loader:
        losses.append(_step(model, optimizer, batch))
        before.extend(_rows(batch))
        if len(losses) in (1, half) or len(losses) % 50 == 0:
            print(f"step {len(losses)}: loss {np.mean(losses[-20:]):.3f}", flush=True)
        if len(losses) == half:
            break
    state = loader.state_dict()  # what a checkpoint stores
    print(f"step {half}: saved loader state {state}")

    resumed = fastload.TokenLoader(
        fastload.open_tokens(str(data), args.seq_len, seed=args.seed),
        args.batch_size,
        rank=0,
        world_size=1,
    )
    resumed.load_state_dict(state)
    resumed.set_epoch(0)  # the saved epoch: continues at the saved step
    after: list[list[int]] = []
    t0 = time.perf_counter()
    for batch in resumed:
        if len(losses) < steps:
            losses.append(_step(model, optimizer, batch))
            if len(losses) % 50 == 0:
                print(f"step {len(losses)}: loss {np.mean(losses[-20:]):.3f}")
        after.extend(_rows(batch))
    stats = resumed.stats()
    print(
        f"resumed and finished the epoch in {time.perf_counter() - t0:.1f} s, "
        f"{stats['data_stall_s']:.2f} s of it waiting for data"
    )

    reference_loader = fastload.TokenLoader(source, args.batch_size, rank=0, world_size=1)
    reference_loader.set_epoch(0)
    reference = [row for batch in reference_loader for row in _rows(batch)]
    problem = check_exactly_once(before, after, reference, dataset_id_counts(data), source.tail)
    fell = float(np.mean(losses[-20:])) < losses[0]
    print(f"loss: first step {losses[0]:.3f}, last 20 steps {np.mean(losses[-20:]):.3f}")
    print("exactly-once over tokens across the resume: " + ("ok" if problem is None else problem))
    return 0 if problem is None and fell else 1


def _rows(batch: dict[str, Any]) -> list[list[int]]:
    """Each row's ids (inputs and the last target)."""
    ids = torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1)
    rows: list[list[int]] = ids.tolist()
    return rows


if __name__ == "__main__":
    sys.exit(main())
