"""Tokenizing conversion: ``fastload convert --tokenize`` against a plain tokenizing loop.

The corpus is generated JSON Lines (``{"id": n, "text": ...}``: sentences of words drawn from a
Zipf-like vocabulary; ~200 MB, ``--quick`` ~50 MB) under ``--root`` (default
``/tmp/fastload-bench-tokenize``, reused when present). A tiny byte-level BPE (vocabulary
4,096, ``<|endoftext|>`` as EOS) is trained with the ``tokenizers`` library on the corpus's first
MB and cached beside it; nothing is downloaded.

Contenders, each in a fresh process, in alternating order each round:

* ``loop-encode``: one process reads the JSONL line by line, ``json.loads`` each line and calls
  ``Tokenizer.encode(text, add_special_tokens=False)`` per document;
* ``loop-batch``: the same loop but ``encode_batch_fast`` over 512 documents at a time, with
  tokenizers' own threads (``TOKENIZERS_PARALLELISM`` unset: every core);
* ``loop-batch-1t``: ``loop-batch`` with ``TOKENIZERS_PARALLELISM=false`` (one thread);
* ``fastload``: ``fastload convert SRC DST --tokenize tokenizer.json --workers 2
  --shard-size 4MB --quiet`` (webdataset, default blocks; small shards because parallelism is
  per shard, see :data:`SHARD_SIZE`), wall time of the whole command (start-up, planning,
  tokenizing, writing, fsync, manifest).

Tokens/s counts the documents' ids plus one EOS per document, the same for all. The reference is
the fastest loop (by median); the goal is fastload >= 1.6x the reference on 2 cores. The CPU
seconds of each process tree are reported too (tokens per CPU-second), which hold on a busy
machine where wall times do not.

Run: ``python -m benchmarks.bench_tokenize [--quick] [--rounds N] [--root DIR] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._harness import (
    Table,
    alternating,
    emit_result,
    fmt_ratio,
    median_rate,
    print_round,
    ratio,
    run_child,
)

GOAL = 1.6
CONTENDERS = ("loop-encode", "loop-batch", "loop-batch-1t", "fastload")
LOOPS = CONTENDERS[:3]
#: fastload writes shards in parallel, one per worker at a time: this corpus would fit one
#: default (256 MB) shard, so the benchmark asks for shards of a few MB.
SHARD_SIZE = "4MB"
DEFAULT_ROOT = Path("/tmp/fastload-bench-tokenize")
_BATCH = 512


def ensure_corpus(root: Path, mbytes: int) -> tuple[Path, Path]:
    """``root/jsonl-<mbytes>MB/corpus.jsonl`` (generated once) and the BPE trained on it."""
    src = root / f"jsonl-{mbytes}MB"
    corpus = src / "corpus.jsonl"
    if not corpus.exists():
        src.mkdir(parents=True, exist_ok=True)
        rng = random.Random(14)
        letters = "etaoinshrdlucmfwypvbgkjqxz"
        vocab = [
            "".join(rng.choice(letters[: rng.randint(5, 26)]) for _ in range(rng.randint(1, 10)))
            for _ in range(20000)
        ]
        weights = [1 / (i + 1) for i in range(len(vocab))]
        tmp = corpus.with_suffix(".tmp")
        with open(tmp, "w") as f:
            n = written = 0
            while written < mbytes * 1_000_000:
                words = rng.choices(vocab, weights, k=rng.randint(20, 600))
                line = json.dumps({"id": n, "text": " ".join(words) + "."}) + "\n"
                f.write(line)
                written += len(line)
                n += 1
        os.replace(tmp, corpus)
    tokenizer = root / "bpe-4096.json"
    if not tokenizer.exists():
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=4096,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        with open(corpus) as f:
            sample = [json.loads(line)["text"] for _, line in zip(range(2000), f)]
        tok.train_from_iterator(sample, trainer)
        tok.save(str(tokenizer.with_suffix(".tmp")))
        os.replace(tokenizer.with_suffix(".tmp"), tokenizer)
    return corpus, tokenizer


def _child(kind: str, corpus: Path, tokenizer: Path, out: Path) -> None:
    """Run one contender in this (fresh) process and emit its result."""
    if kind == "fastload":
        dst = out / "dst"
        t0 = time.perf_counter()
        subprocess.run(
            [
                *(sys.executable, "-m", "fastload.cli", "convert", str(corpus.parent), str(dst)),
                *("--tokenize", str(tokenizer), "--workers", "2", "--shard-size", SHARD_SIZE),
                "--quiet",
            ],
            check=True,
        )
        seconds = time.perf_counter() - t0
        tokens = json.loads((dst / "fastload.json").read_text())["metadata"]["tokens"]
        emit_result(
            {
                "seconds": seconds,
                "cpu": _cpu(resource.RUSAGE_CHILDREN),
                "tokens": tokens["num_tokens"],
                "docs": tokens["num_documents"],
            }
        )
        return
    if kind == "loop-batch-1t":
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    t0 = time.perf_counter()
    tok = Tokenizer.from_file(str(tokenizer))
    n_tokens = n_docs = 0
    with open(corpus, "rb") as f:
        if kind == "loop-encode":
            for line in f:
                ids = tok.encode(json.loads(line)["text"], add_special_tokens=False).ids
                n_tokens += len(ids) + 1
                n_docs += 1
        else:
            batch: list[str] = []
            for line in f:
                batch.append(json.loads(line)["text"])
                if len(batch) == _BATCH:
                    n_tokens += sum(len(e.ids) + 1 for e in tok.encode_batch_fast(batch, False))
                    n_docs += len(batch)
                    batch = []
            if batch:
                n_tokens += sum(len(e.ids) + 1 for e in tok.encode_batch_fast(batch, False))
                n_docs += len(batch)
    emit_result(
        {
            "seconds": time.perf_counter() - t0,
            "cpu": _cpu(resource.RUSAGE_SELF),
            "tokens": n_tokens,
            "docs": n_docs,
        }
    )


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _per_cpu(runs: list[dict[str, Any]]) -> float | None:
    """Median tokens per CPU-second of the successful runs."""
    values = sorted(r["tokens"] / r["cpu"] for r in runs if "error" not in r and r.get("cpu"))
    return values[len(values) // 2] if values else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="~50 MB corpus, 3 rounds")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--child", nargs=4, metavar=("KIND", "CORPUS", "TOKENIZER", "OUT"))
    args = p.parse_args(argv)
    if args.child:
        kind, corpus, tokenizer, out = args.child
        _child(kind, Path(corpus), Path(tokenizer), Path(out))
        return 0
    mbytes = 50 if args.quick else 200
    rounds = args.rounds or (3 if args.quick else 5)
    corpus, tokenizer = ensure_corpus(args.root, mbytes)
    print(f"corpus {corpus} ({corpus.stat().st_size / 1e6:.0f} MB), tokenizer {tokenizer}")
    print(f"load before: {os.getloadavg()[0]:.2f} (1-min), {os.cpu_count()} CPUs", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in CONTENDERS}
    for round_no, kind in alternating(CONTENDERS, rounds):
        out = Path(tempfile.mkdtemp(prefix="bench-tokenize-", dir=args.root))
        try:
            result = run_child(
                [
                    *(sys.executable, "-m", "benchmarks.bench_tokenize", "--child", kind),
                    *(str(corpus), str(tokenizer), str(out)),
                ],
                timeout=1800,
            )
        finally:
            shutil.rmtree(out, ignore_errors=True)
        runs[kind].append(result)
        print_round(round_no, kind, result, unit="tokens/s", amount="tokens")
    rates = {k: median_rate(v, "tokens") for k, v in runs.items()}
    loops = {k: rates[k] for k in LOOPS if rates[k]}
    reference = max(loops, key=lambda k: loops[k]) if loops else None
    base = rates.get(reference) if reference else None
    load = os.getloadavg()[0]
    per_cpu = {k: _per_cpu(v) for k, v in runs.items()}
    table = Table(
        ("contender", 14),
        ("Mtokens/s", 10),
        ("vs " + str(reference), 18),
        ("Mtokens/CPU-s", 14),
    )
    print(table.header())
    for kind in CONTENDERS:
        rate = rates[kind]
        if rate is None:
            print(table.error(kind, str(runs[kind][0].get("error", "no result"))))
            continue
        print(
            table.row(
                kind,
                f"{rate / 1e6:.2f}",
                fmt_ratio(ratio(rate, base)),
                f"{(per_cpu[kind] or 0) / 1e6:.2f}",
            )
        )
    speedup = ratio(rates["fastload"], base)
    verdict = "met" if speedup is not None and speedup >= GOAL else "NOT met"
    print(
        f"fastload / {reference} (the faster loop) = {fmt_ratio(speedup)}; goal >= {GOAL}x "
        f"{verdict}; load after: {load:.2f} (1-min){' (quick run)' if args.quick else ''}"
    )
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "runs": runs,
                    "rates": rates,
                    "tokens_per_cpu_s": per_cpu,
                    "reference": reference,
                    "speedup": speedup,
                },
                indent=1,
            )
        )
    ok = all(r is not None for r in rates.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
