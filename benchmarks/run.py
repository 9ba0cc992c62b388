"""Run every benchmark in sequence: ``python -m benchmarks.run [--quick] [--json DIR]``.

Each benchmark runs as its own process (``python -m benchmarks.<name>``, the same interpreter as
this one), one after the other, never two at once: they all measure throughput on the same CPUs.
Its output streams to the terminal as it runs; with ``--json DIR`` each one also writes
``DIR/<name>.json`` (those that have a JSON report) and its full output to ``DIR/<name>.log``,
and ``DIR/summary.json`` lists what ran, its exit status and how long it took.

Before the benchmarks, ``tools/bench-env.sh`` builds or checks ``.venv-bench``, the peers'
virtualenv (litdata, mosaicml-streaming, FFCV; idempotent, about 15 s when it is already complete,
1-2 min from scratch plus the apt packages FFCV needs). ``--no-env`` skips that step; if it fails,
the benchmarks still run and report the peers they cannot run as skipped. The children get
``FASTLOAD_PEERS_PYTHON`` pointing at that venv unless it is already set.

Benchmarks that need the local Ceph cluster (``stream``, ``s3_clients``) are skipped with the
reason when ``radosgw`` is not installed (``tools/system-deps.sh`` installs it).

The exit status is 1 when a benchmark that ran failed, 0 otherwise (skips are not failures).
See benchmarks/README.md for what each benchmark compares and how to read its ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCH_ENV_SCRIPT = REPO / "tools" / "bench-env.sh"
BENCH_VENV_PYTHON = REPO / ".venv-bench" / "bin" / "python"


@dataclass(frozen=True)
class Bench:
    """One benchmark module and how to call it.

    Attributes:
        name: Module ``benchmarks.bench_<name>``.
        quick: Arguments for ``--quick`` runs.
        full: Arguments for full runs.
        has_json: Whether the module takes ``--json PATH``.
        needs: Executables that must be on PATH (else the benchmark is skipped).
    """

    name: str
    quick: tuple[str, ...] = ("--quick",)
    full: tuple[str, ...] = ()
    has_json: bool = True
    needs: tuple[str, ...] = field(default_factory=tuple)


# Cheapest first, so that a quick run reports the storage/format ratios before the long loaders.
BENCHES: tuple[Bench, ...] = (
    Bench("storage"),
    Bench("formats"),
    Bench("convert"),
    Bench("tokenize"),
    Bench("loader"),
    Bench("memory"),
    Bench("tokens"),
    Bench("mix"),
    Bench("ffcv"),
    Bench("dali"),
    Bench("stream", needs=("radosgw", "ceph-mon", "ceph-osd")),
    Bench(
        "s3_clients",
        quick=("--objects", "4", "--object-mib", "16", "--rounds", "1", "--ranged-reads", "100"),
        has_json=False,
        needs=("radosgw", "ceph-mon", "ceph-osd"),
    ),
    Bench("soak", needs=("radosgw", "ceph-mon", "ceph-osd")),
    Bench("scale"),
)


def _build_env(log_dir: Path | None) -> tuple[bool, str]:
    """Run tools/bench-env.sh; (ok, the last line of its output or why it failed)."""
    t0 = time.perf_counter()
    print(f"== bench-env: {BENCH_ENV_SCRIPT.relative_to(REPO)} ==", flush=True)
    proc = subprocess.run(
        ["bash", str(BENCH_ENV_SCRIPT)], cwd=REPO, capture_output=True, text=True, check=False
    )
    noise = "WARNING: Location 'file://"  # pip warnings about unused local find-links on this host
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith(noise)]
    print("\n".join(lines), flush=True)
    if log_dir is not None:
        (log_dir / "bench-env.log").write_text(proc.stdout + proc.stderr)
    took = time.perf_counter() - t0
    if proc.returncode != 0:
        why = next((ln for ln in reversed(lines) if "ERROR" in ln), f"exit {proc.returncode}")
        return False, f"{why} ({took:.0f} s)"
    return True, f"{proc.stdout.strip().splitlines()[-1]} ({took:.0f} s)"


def _run_one(
    bench: Bench, quick: bool, out_dir: Path | None, env: dict[str, str]
) -> dict[str, Any]:
    missing = [exe for exe in bench.needs if shutil.which(exe) is None]
    if missing:
        why = f"{', '.join(missing)} not installed (tools/system-deps.sh installs Ceph)"
        print(f"\n== {bench.name}: skipped, {why} ==", flush=True)
        return {"status": "skipped", "why": why}
    cmd = [sys.executable, "-m", f"benchmarks.bench_{bench.name}"]
    cmd += list(bench.quick if quick else bench.full)
    if out_dir is not None and bench.has_json:
        cmd += ["--json", str(out_dir / f"{bench.name}.json")]
    print(f"\n== {bench.name}: {' '.join(cmd[1:])} ==", flush=True)
    t0 = time.perf_counter()
    log = (out_dir / f"{bench.name}.log").open("w") if out_dir is not None else None
    try:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for line in proc.stdout or ():
            sys.stdout.write(line)
            sys.stdout.flush()
            if log is not None:
                log.write(line)
        code = proc.wait()
    finally:
        if log is not None:
            log.close()
    took = time.perf_counter() - t0
    result: dict[str, Any] = {"status": "ok" if code == 0 else "failed", "exit": code}
    result["seconds"] = round(took, 1)
    if out_dir is not None and bench.has_json and (out_dir / f"{bench.name}.json").exists():
        result["json"] = str(out_dir / f"{bench.name}.json")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    names = [b.name for b in BENCHES]
    parser = argparse.ArgumentParser(description="Run every fastload benchmark in sequence.")
    parser.add_argument("--quick", action="store_true", help="each benchmark's --quick size")
    parser.add_argument("--json", metavar="DIR", help="write <name>.json, <name>.log here")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {','.join(names)}")
    parser.add_argument("--skip", default="", help="comma-separated benchmarks to leave out")
    parser.add_argument("--no-env", action="store_true", help="do not run tools/bench-env.sh")
    args = parser.parse_args(argv)
    only = {x for x in args.only.split(",") if x}
    skip = {x for x in args.skip.split(",") if x}
    unknown = sorted((only | skip) - set(names))
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(names)}")
    selected = [b for b in BENCHES if (not only or b.name in only) and b.name not in skip]

    out_dir = Path(args.json) if args.json else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    summary: dict[str, Any] = {
        "quick": args.quick,
        "cpus": os.cpu_count(),
        "load_at_start": os.getloadavg()[0],
        "python": sys.executable,
        "benchmarks": {},
    }
    if not args.no_env:
        ok, detail = _build_env(out_dir)
        summary["bench_env"] = {"ok": ok, "detail": detail}
        if not ok:
            print(f"bench-env failed, peers in .venv-bench will be skipped: {detail}", flush=True)

    env = dict(os.environ)
    env.setdefault("FASTLOAD_PEERS_PYTHON", str(BENCH_VENV_PYTHON))
    summary["peers_python"] = env["FASTLOAD_PEERS_PYTHON"]
    for bench in selected:
        summary["benchmarks"][bench.name] = _run_one(bench, args.quick, out_dir, env)
    summary["seconds"] = round(time.perf_counter() - t_start, 1)

    print(f"\n== summary ({summary['seconds']:.0f} s) ==")
    for name, res in summary["benchmarks"].items():
        detail = res.get("why") or f"{res['seconds']:.0f} s" + (
            f", exit {res['exit']}" if res["status"] == "failed" else ""
        )
        print(f"{name:12s} {res['status']:8s} {detail}")
    if "bench_env" in summary and not summary["bench_env"]["ok"]:
        print(f"bench-env    failed   {summary['bench_env']['detail']}")
    if out_dir is not None:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(f"reports in {out_dir}/")
    failed = [n for n, r in summary["benchmarks"].items() if r["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
