"""Conversion of an image folder into shards: fastload against ``tar -cf`` and the peers.

The W1 corpus (:mod:`benchmarks.corpus`: photo-like JPEGs of ~100 KB in 100 class directories;
10,000 images, ``--quick`` 2,000) is converted, keeping the JPEG bytes as they are, by:

* ``tar``: ``tar -cf`` of the folder, the practical limit (one process, no per-sample work);
* ``fastload-<format>``: ``fastload convert`` to ``webdataset``, ``tfrecord`` and ``lmdb`` with
  ``--workers 2`` (the CLI, default options: 256 MB shards, indexes, SHA-256 of every shard,
  fsync of every shard);
* ``wds-shardwriter``: the webdataset library's ``ShardWriter`` loop (read file, write sample);
* ``litdata``: ``litdata.optimize`` with 2 workers; ``mds``: mosaicml-streaming's ``MDSWriter``.
  These run in the interpreter named by ``$FASTLOAD_PEERS_PYTHON`` (default
  ``.venv-bench/bin/python``, built by ``tools/bench-env.sh``) because they pull dependencies fastload's environment must not
  have (a CUDA torch); a peer that does not import is skipped with the reason printed.

Every contender runs in a fresh subprocess, in alternating order each round, writing into an empty
directory on the same filesystem; the table gives the median wall time over the rounds, images/s,
MB/s of JPEG bytes, the CPU seconds of the subprocess tree (user + system of every reaped
process: fastload's forked workers are included, a forkserver's would not be), and the ratios of
each fastload format to ``tar`` (goal >= 0.8) and to the best peer (goal >= 2), by wall time and,
as a check that holds on a busy machine, by CPU time.

Output goes to a fresh temporary directory under the corpus root (removed at the end), so runs
started by different people at the same time do not collide.

``--baseline DIR`` adds ``fastload-<format>@baseline`` contenders that run the ``fastload`` package
found in ``DIR`` (put first on ``PYTHONPATH``), to measure a change against the version before it in
the same run.

Run: ``python -m benchmarks.bench_convert [--quick] [--rounds N] [--formats F,...] [--no-peers]
[--baseline DIR] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._harness import PEERS_PYTHON, Table, alternating
from benchmarks.corpus import DEFAULT_ROOT, ensure_corpus

FORMATS = ("webdataset", "tfrecord", "lmdb")
GOAL_TAR = 0.8
GOAL_PEER = 2.0

_WDS = """
import os, sys, webdataset as wds
src, out = sys.argv[1], sys.argv[2]
classes = sorted(os.listdir(src))
with wds.ShardWriter(os.path.join(out, "shard-%06d.tar"), maxsize=256_000_000, verbose=0) as sink:
    for ci, c in enumerate(classes):
        d = os.path.join(src, c)
        for name in sorted(os.listdir(d)):
            with open(os.path.join(d, name), "rb") as f:
                data = f.read()
            sink.write({"__key__": c + "/" + name.rsplit(".", 1)[0], "jpg": data, "cls": ci})
"""

_MDS = """
import os, sys
from streaming import MDSWriter
src, out = sys.argv[1], sys.argv[2]
classes = sorted(os.listdir(src))
with MDSWriter(out=out, columns={"jpg": "bytes", "cls": "int"}, size_limit="256mb") as sink:
    for ci, c in enumerate(classes):
        d = os.path.join(src, c)
        for name in sorted(os.listdir(d)):
            with open(os.path.join(d, name), "rb") as f:
                sink.write({"jpg": f.read(), "cls": ci})
"""

_LITDATA = """
import os, sys
from litdata import optimize
src, out = sys.argv[1], sys.argv[2]
classes = sorted(os.listdir(src))
index = {c: i for i, c in enumerate(classes)}
inputs = [os.path.join(src, c, n) for c in classes for n in sorted(os.listdir(os.path.join(src, c)))]

def load(path):
    with open(path, "rb") as f:
        return {"jpg": f.read(), "cls": index[os.path.basename(os.path.dirname(path))]}

if __name__ == "__main__":
    optimize(fn=load, inputs=inputs, output_dir=out, chunk_bytes="256MB", num_workers=2,
             mode="overwrite")
"""

_IMPORT_CHECK = {
    "mds": "from streaming import MDSWriter",
    "litdata": "from litdata import optimize",
}


@dataclass
class Contender:
    name: str
    argv: list[str]
    peer: bool = False
    env: dict[str, str] | None = None
    walls: list[float] = field(default_factory=list)
    cpus: list[float] = field(default_factory=list)
    out_bytes: int = 0


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _run(c: Contender, out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    if c.name != "tar":
        out.mkdir(parents=True)
    argv = [a.replace("{OUT}", str(out)) for a in c.argv]
    cpu0, t0 = _children_cpu(), time.perf_counter()
    env = {**os.environ, **c.env} if c.env else None
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    if proc.returncode != 0:
        raise RuntimeError(f"{c.name} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    c.walls.append(wall)
    c.cpus.append(cpu)
    c.out_bytes = (
        out.stat().st_size
        if out.is_file()
        else sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    )


def _peer_ok(name: str) -> str | None:
    """``None`` if the peer imports in the peers' interpreter, else the reason it does not."""
    if not os.path.exists(PEERS_PYTHON):
        return f"no peers interpreter at {PEERS_PYTHON} (set FASTLOAD_PEERS_PYTHON)"
    proc = subprocess.run(
        [PEERS_PYTHON, "-c", _IMPORT_CHECK[name]], capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 0:
        return proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "import failed"
    return None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2,000 images, 2 rounds")
    parser.add_argument("--count", type=int, default=None, help="images (default 10,000)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 3, quick 2)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--no-peers", action="store_true", help="skip litdata and mds")
    parser.add_argument(
        "--baseline",
        default=None,
        help="also run fastload from this directory holding another version's fastload package "
        "(e.g. `git archive REV fastload | tar -x -C DIR`), as fastload-<format>@baseline",
    )
    parser.add_argument(
        "--formats",
        default=",".join(FORMATS),
        help=f"comma-separated fastload formats to run (default {','.join(FORMATS)})",
    )
    args = parser.parse_args(argv)
    count = args.count or (2_000 if args.quick else 10_000)
    rounds = args.rounds or (2 if args.quick else 3)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown or not formats:
        parser.error(f"--formats takes names from {', '.join(FORMATS)}, got {args.formats!r}")

    corpus = ensure_corpus(count)
    folder = corpus.folder()
    jpeg_bytes = corpus.total_bytes()
    work = Path(tempfile.mkdtemp(prefix="convert-bench-out-", dir=DEFAULT_ROOT))
    scripts = work / "scripts"
    scripts.mkdir(parents=True, exist_ok=True)
    for name, text in (("wds.py", _WDS), ("mds.py", _MDS), ("litdata_opt.py", _LITDATA)):
        (scripts / name).write_text(textwrap.dedent(text))

    py = sys.executable
    contenders = [Contender("tar", ["tar", "-cf", "{OUT}", "-C", str(folder), "."])]
    variants: list[tuple[str, dict[str, str] | None]] = [("", None)]
    if args.baseline:
        variants.append(("@baseline", {"PYTHONPATH": os.path.abspath(args.baseline)}))
    for fmt in formats:
        for suffix, env in variants:
            contenders.append(
                Contender(
                    f"fastload-{fmt}{suffix}",
                    [
                        py,
                        "-m",
                        "fastload.cli",
                        "convert",
                        str(folder),
                        "{OUT}",
                        "--format",
                        fmt,
                        "--workers",
                        "2",
                        "--quiet",
                    ],
                    env=env,
                )
            )
    contenders.append(
        Contender("wds-shardwriter", [py, str(scripts / "wds.py"), str(folder), "{OUT}"], peer=True)
    )
    skipped: dict[str, str] = {}
    for name, script in (("litdata", "litdata_opt.py"), ("mds", "mds.py")):
        reason = "--no-peers" if args.no_peers else _peer_ok(name)
        if reason:
            skipped[name] = reason
            print(f"skipping {name}: {reason}")
            continue
        contenders.append(
            Contender(name, [PEERS_PYTHON, str(scripts / script), str(folder), "{OUT}"], peer=True)
        )

    print(
        f"corpus: {count} images, {jpeg_bytes / 1e6:.0f} MB at {folder}; {rounds} rounds, "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    )
    try:
        for r, c in alternating(contenders, rounds):
            _run(c, work / ("out.tar" if c.name == "tar" else f"out-{c.name}"))
            print(f"  round {r}: {c.name:18s} {c.walls[-1]:7.2f} s wall {c.cpus[-1]:7.2f} s CPU")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = {c.name: statistics.median(c.walls) for c in contenders}
    tar = med["tar"]
    peers = {c.name: med[c.name] for c in contenders if c.peer}
    best_peer = min(peers, key=lambda n: peers[n])
    results: dict[str, Any] = {
        "count": count,
        "jpeg_bytes": jpeg_bytes,
        "rounds": rounds,
        "skipped": skipped,
        "contenders": {},
    }
    print()
    cpu_med = {c.name: statistics.median(c.cpus) for c in contenders}
    table = Table(
        ("contender", 18),
        ("wall s", 8),
        ("img/s", 8),
        ("MB/s", 7),
        ("CPU s", 7),
        ("out MB", 7),
        ("x tar", 6),
        ("x best peer", 11),
        ("CPU x tar", 9),
        ("CPU x peer", 10),
    )
    print(table.header())
    for c in contenders:
        wall = med[c.name]
        row = {
            "wall_s": wall,
            "walls": c.walls,
            "cpu_s": statistics.median(c.cpus),
            "images_per_s": count / wall,
            "mb_per_s": jpeg_bytes / wall / 1e6,
            "out_bytes": c.out_bytes,
            "ratio_tar": tar / wall,
            "ratio_best_peer": peers[best_peer] / wall,
            "cpu_ratio_tar": cpu_med["tar"] / max(cpu_med[c.name], 1e-9),
            "cpu_ratio_best_peer": cpu_med[best_peer] / max(cpu_med[c.name], 1e-9),
        }
        results["contenders"][c.name] = row
        print(
            table.row(
                c.name,
                f"{wall:.2f}",
                f"{row['images_per_s']:.0f}",
                f"{row['mb_per_s']:.0f}",
                f"{row['cpu_s']:.2f}",
                f"{c.out_bytes / 1e6:.0f}",
                f"{row['ratio_tar']:.2f}",
                f"{row['ratio_best_peer']:.2f}",
                f"{row['cpu_ratio_tar']:.2f}",
                f"{row['cpu_ratio_best_peer']:.2f}",
            )
        )
    print(f"\nbest peer: {best_peer}; goals: >= {GOAL_TAR} x tar, >= {GOAL_PEER} x best peer")
    for fmt in formats:
        row = results["contenders"][f"fastload-{fmt}"]
        ok = row["ratio_tar"] >= GOAL_TAR and row["ratio_best_peer"] >= GOAL_PEER
        print(
            f"fastload-{fmt}: {row['ratio_tar']:.2f} x tar, {row['ratio_best_peer']:.2f} x "
            f"{best_peer} -> {'meets' if ok else 'MISSES'} the goals"
        )
        base = results["contenders"].get(f"fastload-{fmt}@baseline")
        if base is not None:
            print(
                f"  against the baseline: {base['wall_s'] / row['wall_s']:.2f} x by wall time, "
                f"{base['cpu_s'] / max(row['cpu_s'], 1e-9):.2f} x by CPU time "
                f"(baseline {base['ratio_tar']:.2f} x tar, {base['ratio_best_peer']:.2f} x "
                f"{best_peer})"
            )
    results["best_peer"] = best_peer
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    return results


if __name__ == "__main__":
    main()
