"""W2 tokens: packed 2049-id sequences, batch 32, shuffled — fastload's token loader and the peers.

Corpus (W2-like, BENCHMARKS.md): lognormal document lengths (median 1,000 ids, sigma 0.8), random
ids below 50,257 and an EOS id after each document, ``uint16``; 500 M ids (363k documents), or
50 M with ``--quick``. It is written once per size under ``--root`` as:

* ``flat.bin``: the raw stream (the memmap contenders);
* ``fastload/``: a token dataset (WebDataset shards of 32 M ids, blocks of 8,192 ids, the
  layout of :mod:`fastload.formats.tokens`, written by :func:`fastload.testing.tokens.
  write_token_shards`);
* ``litdata/``: ``litdata.optimize(..., item_loader=TokensLoader())`` of the documents;
* ``mds/``: mosaicml-streaming MDS, packed at write time into 2049-id samples.

Contenders, each in a fresh process, alternated (ABC, CBA, ...), data warm in the page cache:

* ``memmap-gather``: the limit — a NumPy memmap of ``flat.bin`` in the main process, shuffled
  sequence starts, one ``int64`` batch per step filled with 32 slice copies;
* ``torch-dl``: ``torch.utils.data.DataLoader`` (2 workers, ``batch_size=32``, shuffle) over a
  map-style dataset of the same memmap slices;
* ``fastload`` (``int64``), ``fastload-u16`` (the stored ``uint16``, no conversion),
  ``fastload-thread`` (``int64``, ``prefetch=2`` read-ahead thread):
  ``TokenLoader(open_tokens(fastload/, 2048), 32)``;
* ``litdata``: ``StreamingDataLoader(StreamingDataset(item_loader=TokensLoader(2049)), 32,
  num_workers=2)``;
* ``mosaic``: ``streaming.StreamingDataset`` + torch DataLoader (2 workers).

Rate: ids delivered per second (rows x 2,049) after two warm-up batches, over at most one epoch
(and at most 256 M ids); for the contenders that work in one process only (memmap-gather,
fastload, fastload-u16) also ids per CPU second of that process, which a loaded machine disturbs
less than wall time. Ratios: fastload over the memmap gather (goal >= 0.8x) and over litdata
(goal >= 10x). Peers run with ``benchmarks._harness.PEERS_PYTHON`` (``tools/bench-env.sh
--no-ffcv``); one that cannot run is reported as skipped with the reason.

    python -m benchmarks.bench_tokens [--quick] [--rounds N] [--loaders a,b] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._harness import (
    PEERS_PYTHON,
    REPO,
    Table,
    alternating,
    emit_result,
    fmt_ratio,
    median_rate,
    print_round,
    ratio,
    run_child,
    warm,
)

DEFAULT_ROOT = Path("/tmp/fastload-bench/w2")
SEQ = 2048
BATCH = 32
WORKERS = 2
VOCAB = 50257
EOS = VOCAB - 1
SHARD_TOKENS = 32 << 20
BLOCK_TOKENS = 8192
MAX_TOKENS = 256 << 20
PEER_KINDS = frozenset({"litdata", "mosaic"})
CONTENDERS = (
    "memmap-gather",
    "fastload",
    "fastload-u16",
    "fastload-thread",
    "torch-dl",
    "litdata",
    "mosaic",
)


# ---------------------------------------------------------------------------------------------
# The corpus
# ---------------------------------------------------------------------------------------------


def doc_lengths(num_tokens: int, seed: int = 0) -> np.ndarray[Any, Any]:
    """Lognormal document lengths (ids before EOS) summing, with one EOS each, to ``num_tokens``."""
    rng = np.random.default_rng(seed)
    mean = 1000 * np.exp(0.8**2 / 2) + 1
    lengths = np.maximum(1, rng.lognormal(np.log(1000), 0.8, int(num_tokens / mean * 1.1) + 16))
    lengths = lengths.astype(np.int64)
    ends = np.cumsum(lengths + 1)
    n = int(np.searchsorted(ends, num_tokens, side="left")) + 1
    lengths = lengths[:n]
    lengths[-1] -= int(ends[n - 1]) - num_tokens  # the last document ends the corpus exactly
    return lengths[lengths > 0] if lengths[-1] > 0 else lengths[:-1]


def ensure_corpus(num_tokens: int, root: Path) -> Path:
    """Write (once) the stream, its documents and the fastload dataset for ``num_tokens`` ids."""
    base = root / f"{num_tokens // 1_000_000}M"
    done = base / ".complete"
    if done.exists():
        return base
    base.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    lengths = doc_lengths(num_tokens)
    total = int((lengths + 1).sum())
    rng = np.random.default_rng(1)
    stream = rng.integers(0, EOS, total, dtype=np.uint16)
    ends = np.cumsum(lengths + 1)
    stream[ends - 1] = EOS
    starts = ends - (lengths + 1)
    stream.tofile(base / "flat.bin")
    np.save(base / "doc_starts.npy", starts)
    _write_fastload(stream, starts, base / "fastload")
    done.write_text("ok")
    print(
        f"corpus: {total / 1e6:.0f} M ids, {len(lengths)} documents in {time.perf_counter() - t0:.0f} s"
    )
    return base


def _write_fastload(stream: np.ndarray[Any, Any], starts: np.ndarray[Any, Any], out: Path) -> None:
    from fastload.storage import open_store
    from fastload.testing.tokens import write_token_shards

    shards = []
    doc_ends = np.append(starts[1:], len(stream))
    lo = 0
    while lo < len(stream):  # shards of ~32 M ids, cut at document ends
        cut = int(np.searchsorted(doc_ends, lo + SHARD_TOKENS, side="left"))
        hi = int(doc_ends[min(cut, len(doc_ends) - 1)])
        first, last = np.searchsorted(starts, [lo, hi])
        shards.append((stream[lo:hi], starts[first:last] - lo))
        lo = hi
    write_token_shards(
        open_store(str(out)),
        shards,
        num_documents=len(starts),
        block_tokens=BLOCK_TOKENS,
        vocab_size=VOCAB,
        eos_id=EOS,
    )


_PREP_MDS = """
import sys
import numpy as np
from streaming import MDSWriter

base, L = sys.argv[1], int(sys.argv[2])
stream = np.fromfile(base + "/flat.bin", dtype=np.uint16)
n = (len(stream) - 1) // L
with MDSWriter(out=base + "/mds", columns={"tokens": f"ndarray:uint16:{L + 1}"},
               size_limit="64mb") as w:
    for k in range(n):
        w.write({"tokens": stream[k * L : k * L + L + 1]})
"""


def _lit_docs(span: tuple[str, int, int]) -> Iterable[Any]:
    """litdata ``optimize`` function: the documents of one span of the corpus, as uint16 arrays."""
    base, first, last = span
    stream = np.memmap(f"{base}/flat.bin", dtype=np.uint16, mode="r")
    starts = np.load(f"{base}/doc_starts.npy")
    ends = np.append(starts[1:], len(stream))
    for d in range(first, last):
        yield np.array(stream[starts[d] : ends[d]])


def prep_litdata(base: str) -> None:
    """Write the documents with ``litdata.optimize`` and ``TokensLoader`` (in .venv-bench)."""
    import litdata
    from litdata import TokensLoader

    count = len(np.load(f"{base}/doc_starts.npy"))
    step = -(-count // 64)
    spans = [(base, i, min(i + step, count)) for i in range(0, count, step)]
    litdata.optimize(
        fn=_lit_docs,
        inputs=spans,
        output_dir=f"{base}/litdata",
        chunk_size=(SEQ + 1) * 1024,
        item_loader=TokensLoader(),
        num_workers=WORKERS,
    )
    index = json.loads((Path(base) / "litdata" / "index.json").read_text())
    if not index.get("chunks"):  # litdata can exit 0 having written nothing
        raise RuntimeError(f"litdata.optimize wrote no chunks to {base}/litdata")


def _prepare_peer(kind: str, base: Path) -> str:
    """Convert the corpus for a peer in .venv-bench (once); the reason when it cannot."""
    if not Path(PEERS_PYTHON).exists():
        return f"{PEERS_PYTHON} missing: build it with tools/bench-env.sh --no-ffcv"
    done = base / f".{kind}.complete"
    if done.exists():
        return ""
    if kind == "litdata":
        cmd = [PEERS_PYTHON, "-m", "benchmarks.bench_tokens", "--prep-litdata", str(base)]
    else:
        cmd = [PEERS_PYTHON, "-c", _PREP_MDS, str(base), str(SEQ)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=3600)
    if proc.returncode != 0:
        return f"{kind} conversion failed: {proc.stderr.strip().splitlines()[-1:]}"
    done.write_text("ok")
    print(f"prepared {kind} in {time.perf_counter() - t0:.0f} s")
    return ""


# ---------------------------------------------------------------------------------------------
# Children: one contender each, in a fresh process
# ---------------------------------------------------------------------------------------------


def _timed(batches: Iterable[Any], rows_of: Callable[[Any], int], limit: int) -> dict[str, float]:
    """Ids (rows x (SEQ + 1)) per second after 2 warm-up batches, up to ``limit`` ids."""
    ids = 0
    start = t0 = time.perf_counter()
    cpu0 = time.process_time()
    for n, batch in enumerate(batches, start=1):
        if n == 2:
            start, ids, cpu0 = time.perf_counter(), 0, time.process_time()
        elif n > 2:
            ids += rows_of(batch) * (SEQ + 1)
        if ids >= limit:
            break
    cpu = time.process_time() - cpu0  # this process only (not worker processes)
    return {
        "tokens": ids,
        "seconds": time.perf_counter() - start,
        "total_s": time.perf_counter() - t0,
        "cpu_seconds": cpu,
    }


def _limit(base: Path) -> int:
    return min(MAX_TOKENS, (base / "flat.bin").stat().st_size // 2)


def child_memmap(base: Path) -> dict[str, float]:
    import torch

    warm([base / "flat.bin"])
    mm = np.memmap(base / "flat.bin", dtype=np.uint16, mode="r")
    starts = np.random.default_rng(0).permutation((len(mm) - 1) // SEQ) * SEQ

    def batches() -> Iterable[Any]:
        for i in range(0, len(starts) - BATCH + 1, BATCH):
            out = np.empty((BATCH, SEQ + 1), dtype=np.int64)
            for j, s in enumerate(starts[i : i + BATCH].tolist()):
                out[j] = mm[s : s + SEQ + 1]
            yield torch.from_numpy(out)

    return _timed(batches(), len, _limit(base))


class _MemmapSequences:
    """Map-style dataset: sequence ``k`` of ``flat.bin`` as an int64 tensor."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.n = (Path(path).stat().st_size // 2 - 1) // SEQ
        self.mm: Any = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, k: int) -> Any:
        import torch

        if self.mm is None:
            self.mm = np.memmap(self.path, dtype=np.uint16, mode="r")
        return torch.from_numpy(self.mm[k * SEQ : k * SEQ + SEQ + 1].astype(np.int64))


def child_torch(base: Path) -> dict[str, float]:
    import torch.utils.data

    warm([base / "flat.bin"])
    ds = _MemmapSequences(str(base / "flat.bin"))
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=WORKERS)
    return _timed(loader, len, _limit(base))


def child_fastload(base: Path, variant: str) -> dict[str, float]:
    import torch

    from fastload.loader.tokens._dataset import open_tokens
    from fastload.loader.tokens._loader import TokenLoader

    warm(p for p in (base / "fastload").iterdir())
    source = open_tokens(str(base / "fastload"), SEQ, seed=0)
    loader = TokenLoader(
        source,
        BATCH,
        rank=0,
        world_size=1,
        dtype=None if variant == "u16" else torch.int64,
        prefetch=2 if variant == "thread" else 0,
    )
    result = _timed(loader, lambda b: len(b["input_ids"]), _limit(base))
    result["block_reads"] = source.blocks.reads
    return result


def child_litdata(base: Path) -> dict[str, float]:
    from litdata import StreamingDataLoader, StreamingDataset, TokensLoader

    warm(p for p in (base / "litdata").iterdir())
    ds = StreamingDataset(
        input_dir=str(base / "litdata"), item_loader=TokensLoader(block_size=SEQ + 1), shuffle=True
    )
    loader = StreamingDataLoader(ds, batch_size=BATCH, num_workers=WORKERS)
    return _timed(loader, len, _limit(base))


def child_mosaic(base: Path) -> dict[str, float]:
    import streaming
    import torch.utils.data

    class Sequences(streaming.StreamingDataset):  # type: ignore[misc]
        def __getitem__(self, index: Any) -> Any:
            return torch.from_numpy(super().__getitem__(index)["tokens"].astype(np.int64))

    warm(p for p in (base / "mds").iterdir())
    streaming.base.util.clean_stale_shared_memory()
    ds = Sequences(local=str(base / "mds"), shuffle=True, batch_size=BATCH)
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=WORKERS)
    return _timed(loader, len, _limit(base))


def run_contender(kind: str, base: Path) -> dict[str, float]:
    """Measure one contender (in this process)."""
    if kind.startswith("fastload"):
        return child_fastload(base, kind.partition("-")[2])
    fn: dict[str, Callable[[Path], dict[str, float]]] = {
        "memmap-gather": child_memmap,
        "torch-dl": child_torch,
        "litdata": child_litdata,
        "mosaic": child_mosaic,
    }
    return fn[kind](base)


# ---------------------------------------------------------------------------------------------
# Parent
# ---------------------------------------------------------------------------------------------

_TABLE = Table(
    ("loader", 16),
    ("Mtok/s", 8),
    ("vs memmap", 10),
    ("vs litdata", 10),
    ("Mtok/CPU-s", 10),
    ("vs memmap", 10),
)
#: Contenders that do all their work in the measured process (their CPU rate is comparable).
IN_PROCESS = frozenset({"memmap-gather", "fastload", "fastload-u16"})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="fastload token loader benchmark (W2)")
    parser.add_argument("--quick", action="store_true", help="50 M ids, 2 rounds")
    parser.add_argument("--tokens", type=int, help="corpus ids (default 500 M, quick 50 M)")
    parser.add_argument("--rounds", type=int, help="alternating rounds (default 3, quick 2)")
    parser.add_argument("--loaders", default="", help="comma-separated subset of contenders")
    parser.add_argument("--root", default=str(DEFAULT_ROOT), help="corpus cache directory")
    parser.add_argument("--json", help="write results as JSON here")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--prep-litdata", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.prep_litdata:
        prep_litdata(args.prep_litdata)
        return 0
    if args.child:
        kind, base = args.child
        emit_result(run_contender(kind, Path(base)))
        return 0

    num_tokens = args.tokens or (50_000_000 if args.quick else 500_000_000)
    rounds = args.rounds or (2 if args.quick else 3)
    base = ensure_corpus(num_tokens, Path(args.root))
    want = [x for x in args.loaders.split(",") if x] or list(CONTENDERS)
    skipped: dict[str, str] = {}
    for kind in PEER_KINDS & set(want):
        why = _prepare_peer(kind, base)
        if why:
            skipped[kind] = why
            print(f"skipping {kind}: {why}")
    runs = [k for k in CONTENDERS if k in want and k not in skipped]
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in runs}
    t0 = time.perf_counter()
    for r, kind in alternating(runs, rounds):
        python = PEERS_PYTHON if kind in PEER_KINDS else sys.executable
        res = run_child(
            [python, "-m", "benchmarks.bench_tokens", "--child", kind, str(base)], timeout=900
        )
        results[kind].append(res)
        print_round(r, f"{kind:16s}", res, unit="Mtok/s", amount="tokens", scale=1e6)
    rates = {k: median_rate(v, "tokens") for k, v in results.items()}
    cpu_rates = {k: _median_cpu_rate(v) if k in IN_PROCESS else None for k, v in results.items()}
    limit, lit = rates.get("memmap-gather"), rates.get("litdata")
    cpu_limit = cpu_rates.get("memmap-gather")
    print(
        f"\n== W2 tokens: {num_tokens / 1e6:.0f} M ids, 2049-id rows, batch {BATCH} (medians of {rounds} rounds) =="
    )
    print(_TABLE.header())
    for kind, rate in rates.items():
        if rate is None:
            print(_TABLE.error(kind, results[kind][-1].get("error", "")))
            continue
        cpu = cpu_rates.get(kind)
        print(
            _TABLE.row(
                kind,
                f"{rate / 1e6:.0f}",
                fmt_ratio(ratio(rate, limit)),
                fmt_ratio(ratio(rate, lit)),
                "-" if cpu is None else f"{cpu / 1e6:.0f}",
                fmt_ratio(ratio(cpu, cpu_limit)),
            )
        )
    for kind, why in skipped.items():
        print(f"skipped {kind}: {why}")
    print("goals: fastload >= 0.80x memmap-gather, >= 10x litdata")
    print("Mtok/CPU-s: ids per CPU second of the measured process, in-process contenders only")
    if args.json:
        report = {
            "rates_tok_per_s": rates,
            "cpu_rates_tok_per_cpu_s": cpu_rates,
            "skipped": skipped,
            "config": {"tokens": num_tokens, "rounds": rounds, "quick": args.quick},
            "elapsed_s": time.perf_counter() - t0,
        }
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def _median_cpu_rate(runs: list[dict[str, Any]]) -> float | None:
    """Median ids per CPU second of the measured process over the successful runs."""
    ok = [r["tokens"] / r["cpu_seconds"] for r in runs if "error" not in r and r.get("cpu_seconds")]
    return statistics.median(ok) if ok else None


if __name__ == "__main__":
    sys.exit(main())
