"""Before/after: one whole epoch of the W1 train or bytes workload with two fastload checkouts.

Each run is a fresh process that imports fastload (and this harness) from the checkout given,
reads the corpus's WebDataset shards (``benchmarks/corpus.py``, built by ``bench_loader``) with 2
workers, and reports the epoch rate (loader creation to the last batch), the steady rate (after
batch 2), the first batch's time and the CPU of the process tree per sample. Checkouts alternate
round by round (ABAB, then BABA); the report gives medians.

Run: ``python -m benchmarks.ab_commits --before /path/to/old/checkout [--after .] [--workload
train|bytes] [--rounds 3]``; make the old checkout with ``git worktree add /tmp/old <commit>``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks._harness import REPO, alternating, emit_result, run_child
from benchmarks.corpus import ensure_corpus

_CHILD = r"""
import json, sys, time
here, repo, shards, workload = sys.argv[1:5]
sys.path.insert(0, here)  # this checkout's harness (standard library only: no fastload import)
from benchmarks._harness import tree_cpu_seconds, warm
sys.path.insert(0, repo)  # fastload from the checkout under test
from pathlib import Path
import torch
import fastload.loader as fl
from fastload.loader.decode import Decoder
from fastload.loader.transforms import ImageTrainTransform

warm(sorted(Path(shards).glob("*.tar")))
torch.set_num_threads(1)
t0 = time.perf_counter()
if workload == "train":
    tf, bs = ImageTrainTransform(), 64
    ds = fl.open_dataset(shards, seed=0, decode=Decoder(image=tf), fields=("jpg", "cls"))
else:
    tf, bs = None, 256
    ds = fl.open_dataset(shards, seed=0, decode=Decoder(image="bytes"), fields=("jpg", "cls"))
n, first, ts, cs, ns, last_cpu = 0, 0.0, 0.0, 0.0, 0, 0.0
total = ds.num_samples
for i, (x, y) in enumerate(fl.DataLoader(ds, batch_size=bs, num_workers=2)):
    if tf is not None:
        x = tf.batch_transform(x)
    n += len(y)
    if i == 0:
        first = time.perf_counter() - t0
    if i == 1:
        ts, cs, ns = time.perf_counter(), tree_cpu_seconds(), n
    if n >= total - bs:
        last_cpu = tree_cpu_seconds()  # before the workers exit
t1 = time.perf_counter()
print("RESULT " + json.dumps({"epoch_rate": n / (t1 - t0), "steady_rate": (n - ns) / (t1 - ts),
      "first_batch_s": first, "cpu_us_per_sample": (last_cpu - cs) / (n - ns) * 1e6, "n": n}))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the old fastload checkout")
    parser.add_argument("--after", default=str(REPO), help="the new checkout (default: this)")
    parser.add_argument("--workload", choices=("train", "bytes"), default="train")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--count", type=int, default=10_000, help="corpus images")
    parser.add_argument("--json", help="write the runs and medians here")
    args = parser.parse_args(argv)
    shards = ensure_corpus(args.count, None).webdataset(shards=16, workers=2)
    trees = {"before": str(Path(args.before).resolve()), "after": str(Path(args.after).resolve())}
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    for r, name in alternating(list(trees), args.rounds):
        res = run_child(
            [sys.executable, "-c", _CHILD, str(REPO), trees[name], str(shards), args.workload],
            timeout=900,
        )
        runs[name].append(res)
        print(f"round {r} {name:6s} {json.dumps(res)}", flush=True)
    medians = {
        name: {
            key: statistics.median(r[key] for r in rs if "error" not in r)
            for key in ("epoch_rate", "steady_rate", "first_batch_s", "cpu_us_per_sample")
        }
        for name, rs in runs.items()
        if any("error" not in r for r in rs)
    }
    for name, m in medians.items():
        print(
            f"{name:6s} epoch {m['epoch_rate']:8.0f}/s  steady {m['steady_rate']:8.0f}/s  first "
            f"batch {m['first_batch_s']:.2f} s  CPU {m['cpu_us_per_sample']:.0f} us/sample"
        )
    emit_result({"workload": args.workload, "medians": medians, "runs": runs})
    if args.json:
        Path(args.json).write_text(json.dumps({"medians": medians, "runs": runs}, indent=2))
    return 0 if len(medians) == 2 else 1


if __name__ == "__main__":
    sys.exit(main())
