"""The benchmarks' one harness: contenders in fresh processes, alternating rounds, medians, tables.

Every benchmark measures each contender in a fresh process, so that one contender's threads,
caches and memory do not slow the next, and passes the result back on stdout:

* the child prints one line ``RESULT <JSON object>`` (:func:`emit_result`), whatever else it
  prints before or after;
* the parent (:func:`run_child`) runs the child with a timeout and returns that object, or
  ``{"error": "..."}`` saying why there is none: the exit status and the last lines of output,
  or the timeout. Every report treats a run that has an ``"error"`` key as failed.

Around that protocol: the child-side measurement pieces (:func:`warm`, :func:`time_batches`,
:func:`dali_batches`), the round order (:func:`alternating`: ABAB, then BABA, so that drifting
load on this shared machine hits every contender alike), per-round lines (:func:`print_round`),
medians and ratios (:func:`median_rate`, :func:`ratio`, :func:`fmt_ratio`) and fixed-width tables
(:class:`Table`).

Only the standard library is imported at the top (torch, numpy inside the functions that need
them): children run this module in other interpreters too (``.venv-bench``, an s3fs venv).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "PEERS_PYTHON",
    "REPO",
    "RESULT_PREFIX",
    "Table",
    "alternating",
    "batch_size",
    "dali_batches",
    "emit_result",
    "fmt_ratio",
    "median_rate",
    "ok_runs",
    "print_round",
    "ratio",
    "run_child",
    "time_batches",
    "warm",
]

T = TypeVar("T")

#: The repository root: children run with it as their working directory, so ``-m benchmarks.x``
#: imports from this checkout in any interpreter.
REPO = Path(__file__).resolve().parent.parent
#: The peers' interpreter (litdata, mosaicml-streaming, FFCV; built by ``tools/bench-env.sh``):
#: ``$FASTLOAD_PEERS_PYTHON``, else ``<repo>/.venv-bench/bin/python``.
PEERS_PYTHON = os.environ.get("FASTLOAD_PEERS_PYTHON") or str(
    REPO / ".venv-bench" / "bin" / "python"
)
#: What starts the child's result line on stdout.
RESULT_PREFIX = "RESULT "
#: Lines of a failed child's output quoted in its error.
_ERROR_TAIL_LINES = 3


# ---- the child-process protocol -----------------------------------------------------------------


def emit_result(result: Mapping[str, Any]) -> None:
    """Print ``result`` (JSON-serialisable) as this child's result line, flushed at once."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_child(
    argv: Sequence[str], *, timeout: float | None = None, env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Run ``argv`` in the repository root and return the object of its ``RESULT`` line.

    Args:
        argv: The child's command line, interpreter first.
        timeout: Seconds before the child is killed (``None``: no limit).
        env: The child's whole environment (``None``: this process's).

    Returns:
        The first result line's object, or ``{"error": ...}`` when the child timed out or printed
        no result line (then with its exit status and the last lines of its stderr, else stdout).
    """
    try:
        proc = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            cwd=REPO,
            env=None if env is None else dict(env),
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result: dict[str, Any] = json.loads(line[len(RESULT_PREFIX) :])
            return result
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-_ERROR_TAIL_LINES:]
    return {"error": f"exit {proc.returncode}: {' | '.join(tail)}"}


# ---- measuring inside a child -------------------------------------------------------------------


def warm(paths: Iterable[str | os.PathLike[str]]) -> int:
    """Read every file once, unbuffered in 4 MiB blocks, so that it is in the page cache.

    Returns:
        The bytes read (the page-cache reference of ``bench_loader`` times a second pass).
    """
    total = 0
    buf = bytearray(4 << 20)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total


def batch_size(batch: Any) -> int:
    """Samples in a batch: the length of its labels, the last element of a tuple or list batch,
    or the ``"cls"`` field of a dict batch."""
    labels = batch[-1] if isinstance(batch, (tuple, list)) else batch["cls"]
    return len(labels)


def time_batches(
    batches: Iterable[Any],
    limit: int,
    *,
    warmup: int = 2,
    cpu_clock: Callable[[], float] | None = None,
    sync: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Consume ``batches`` until ``limit`` samples have been seen; time what follows the warm-up.

    The rate counts from the end of the first ``warmup`` batches (loader or pipeline start-up is
    excluded for every contender alike) to the last batch; with ``warmup`` batches or fewer in
    all, everything counts.

    Args:
        batches: The loader under test; samples per batch come from :func:`batch_size`.
        limit: Samples after which to stop (the batch that reaches it is the last).
        warmup: Batches not counted.
        cpu_clock: A CPU-seconds clock; when given the result has ``cpu_seconds`` over the same
            span as ``seconds``.
        sync: Called before each clock reading that ends a span (e.g. a CUDA synchronize, so the
            device's queued work is counted).

    Returns:
        ``samples`` and ``seconds`` of the timed span, ``total_seconds`` from the first request
        (start-up included) and, with ``cpu_clock``, ``cpu_seconds``.
    """
    n = seen = counted = 0
    t0 = start = time.perf_counter()
    cpu0 = cpu_start = cpu_clock() if cpu_clock is not None else 0.0
    for batch in batches:
        size = batch_size(batch)
        seen += size
        n += 1
        if n == warmup:
            if sync is not None:
                sync()
            start, counted = time.perf_counter(), 0
            if cpu_clock is not None:
                cpu_start = cpu_clock()
        elif n > warmup:
            counted += size
        if seen >= limit:
            break
    if sync is not None:
        sync()
    end = time.perf_counter()
    if n <= warmup:  # too few batches: count everything
        counted, start, cpu_start = seen, t0, cpu0
    result = {"samples": counted, "seconds": end - start, "total_seconds": end - t0}
    if cpu_clock is not None:
        result["cpu_seconds"] = cpu_clock() - cpu_start
    return result


def dali_batches(pipe: Any) -> Iterator[Any]:
    """Endless ``(images, labels)`` torch CPU tensors from a built DALI pipeline with two outputs
    (labels flattened to one dimension)."""
    import numpy as np
    import torch

    while True:
        images, labels = pipe.run()
        yield (
            torch.from_numpy(np.array(images.as_tensor())),
            torch.from_numpy(np.array(labels.as_tensor())).view(-1),
        )


# ---- the parent: rounds, medians, ratios, tables ------------------------------------------------


def alternating(items: Sequence[T], rounds: int) -> Iterator[tuple[int, T]]:
    """``(round number from 1, item)`` for ``rounds`` rounds over ``items``: in order in odd
    rounds, reversed in even ones (ABAB, then BABA), so that load that drifts during a run
    does not favour whichever contender runs first."""
    for r in range(rounds):
        for item in items if r % 2 == 0 else items[::-1]:
            yield r + 1, item


def print_round(
    round_no: int,
    label: str,
    result: Mapping[str, Any],
    *,
    unit: str = "samples/s",
    amount: str = "samples",
    scale: float = 1.0,
) -> None:
    """Print one run's line: ``round N <label> <rate> <unit>``, or its error.

    The rate is ``result[amount] / result["seconds"] / scale`` (e.g. ``amount="bytes"``,
    ``scale=1e6`` for MB/s).
    """
    if "error" in result:
        print(f"  round {round_no} {label} ERROR {result['error']}", flush=True)
    else:
        rate = result[amount] / result["seconds"] / scale
        print(f"  round {round_no} {label} {rate:9.0f} {unit}", flush=True)


def ok_runs(runs: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The runs that succeeded: no ``"error"`` and a positive ``"seconds"``."""
    return [r for r in runs if "error" not in r and r["seconds"] > 0]


def median_rate(runs: Iterable[Mapping[str, Any]], amount: str = "samples") -> float | None:
    """Median over the successful runs of ``run[amount] / run["seconds"]``; ``None`` if none."""
    rates = [r[amount] / r["seconds"] for r in ok_runs(runs)]
    return statistics.median(rates) if rates else None


def ratio(value: float | None, base: float | None) -> float | None:
    """``value / base``, or ``None`` when either is missing or zero."""
    return value / base if value and base else None


def fmt_ratio(x: float | None) -> str:
    """A ratio as ``1.23x``; ``-`` when there is none."""
    return "-" if x is None else f"{x:.2f}x"


class Table:
    """A fixed-width text table: a left-aligned name column, then right-aligned columns, one space
    apart, under a header line.

    Args:
        first: Title and width of the name column.
        columns: Title and width of each further column.
    """

    def __init__(self, first: tuple[str, int], *columns: tuple[str, int]) -> None:
        self._first = first
        self._columns = columns

    def header(self) -> str:
        """The line of column titles."""
        return self.row(self._first[0], *(title for title, _ in self._columns))

    def row(self, name: str, *cells: str) -> str:
        """One row; with fewer cells than columns the row ends after the last cell given."""
        if len(cells) > len(self._columns):
            raise ValueError(f"{len(cells)} cells for {len(self._columns)} columns")
        parts = [f"{name:{self._first[1]}s}"]
        parts += [f"{cell:>{width}s}" for cell, (_, width) in zip(cells, self._columns)]
        return " ".join(parts)

    def error(self, name: str, why: str) -> str:
        """The row of a contender that has no result."""
        return f"{name:{self._first[1]}s} ERROR {why}"
