"""The benchmarks' one harness: contenders in fresh processes, alternating rounds, medians, tables.

Every benchmark measures each contender in a fresh process, so that one contender's threads,
caches and memory do not slow the next, and passes the result back on stdout:

* the child prints one line ``RESULT <JSON object>`` (:func:`emit_result`), whatever else it
  prints before or after;
* the parent (:func:`run_child`) runs the child with a timeout and returns that object, or
  ``{"error": "..."}`` saying why there is none: the exit status and the last lines of output,
  or the timeout. Every report treats a run that has an ``"error"`` key as failed.

Around that protocol: the child-side measurement pieces (:func:`warm`; :func:`time_epoch`, which
times one whole epoch from the loader's creation, first batch and steady span apart;
:func:`time_batches`, a steady window only; :func:`dali_batches`; the process tree's CPU time and
memory, :func:`tree_cpu_seconds` and :func:`tree_memory` from :mod:`benchmarks._proctree`), the
round order (:func:`alternating`: ABAB, then BABA, so that drifting load on this shared machine
hits every contender alike), per-round lines (:func:`print_round`), medians and ratios
(:func:`median_rate`, :func:`median_of`, :func:`ratio`, :func:`fmt_ratio`), the label of a
``--quick`` run (:func:`run_label`) and fixed-width tables (:class:`Table`).

Only the standard library is imported at the top (torch, numpy inside the functions that need
them): children run this module in other interpreters too (``.venv-bench``, an s3fs venv).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from benchmarks._proctree import (
    child_pids,
    count_fds,
    status_kb,
    tree_cpu_seconds,
    tree_memory,
)

__all__ = [
    "EpochError",
    "PEERS_PYTHON",
    "REPO",
    "RESULT_PREFIX",
    "Table",
    "alternating",
    "batch_labels",
    "batch_size",
    "check_labels",
    "child_pids",
    "count_fds",
    "counting_labels",
    "dali_batches",
    "emit_result",
    "fmt_ratio",
    "median_of",
    "median_rate",
    "ok_runs",
    "print_round",
    "rate_of",
    "ratio",
    "run_child",
    "run_label",
    "status_kb",
    "time_batches",
    "time_epoch",
    "tree_cpu_seconds",
    "tree_memory",
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


def batch_labels(batch: Any) -> Any:
    """A batch's labels: the last element of a tuple or list batch, or the ``"cls"`` field of a
    dict batch (a tensor, an array or a list)."""
    return batch[-1] if isinstance(batch, (tuple, list)) else batch["cls"]


def batch_size(batch: Any) -> int:
    """Samples in a batch: the length of its labels (:func:`batch_labels`)."""
    return len(batch_labels(batch))


def counting_labels(
    make: Callable[[], Iterable[Any]], counts: Counter[int]
) -> Callable[[], Iterator[Any]]:
    """``make`` for :func:`time_epoch`, wrapped so that the labels of every batch it yields are
    added to ``counts`` (the loader is still created inside the timed span). Costs a ``tolist``
    per batch in the consuming process, as a training loop's use of the labels would."""

    def batches() -> Iterator[Any]:
        for batch in make():
            labels = batch_labels(batch)
            counts.update(labels.tolist() if hasattr(labels, "tolist") else list(labels))
            yield batch

    return batches


def check_labels(counts: Counter[int], expected: Counter[int], name: str = "the loader") -> None:
    """Raise :class:`EpochError` unless the labels an epoch delivered (``counts``, from
    :func:`counting_labels`) are those of the corpus (``expected``): with the W1 corpus's labels
    (``i % 100``) a sample dropped, repeated or read twice shows as a class count off."""
    if counts != expected:
        off = sorted(k for k in set(counts) | set(expected) if counts[k] != expected[k])
        detail = ", ".join(f"class {k}: {counts[k]} not {expected[k]}" for k in off[:5])
        raise EpochError(
            f"{name}'s epoch did not deliver every sample once: {len(off)} classes off ({detail})"
        )


class EpochError(RuntimeError):
    """A loader's epoch did not deliver every sample of the corpus exactly once (too few samples,
    or labels counted that do not match the corpus's)."""


def time_epoch(
    make: Callable[[], Iterable[Any]],
    samples: int | None = None,
    *,
    warmup: int = 2,
    clock: Callable[[], float] = time.perf_counter,
    cpu_clock: Callable[[], float] | None = None,
    sync: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Time one whole epoch: start-up, first batch, and the steady span after the warm-up.

    The clock starts before ``make()`` is called, so creating the loader (or pipeline) and its
    first ``iter()`` are counted; it stops after the last batch. Every contender of a benchmark is
    timed the same way, and the epoch rate is what a training job sees in its first epoch.

    Args:
        make: Creates the loader under test (or returns one already built, e.g. for a second
            epoch); it is called once, then iterated. Samples per batch come from
            :func:`batch_size`.
        samples: The epoch's size: iteration stops at the batch that reaches it (a loader that
            repeats samples to fill its last batch or a DALI pipeline that never ends stops
            there), and a loader that ends before it raises :class:`EpochError`.
            ``None``: until the loader is exhausted.
        warmup: Batches before the steady span (the steady span starts when batch ``warmup``
            has arrived and counts the batches after it).
        clock: Wall clock in seconds (injectable for tests).
        cpu_clock: A CPU-seconds clock (e.g. :func:`tree_cpu_seconds`); when given the result
            has ``cpu_seconds`` (the whole epoch) and ``steady_cpu_seconds``.
        sync: Called before each clock reading that ends a span (e.g. a CUDA synchronize, so
            that the device's queued work is counted).

    Returns:
        ``samples`` and ``seconds`` (= ``epoch_seconds``: creation to last batch, so
        :func:`median_rate` gives the epoch rate), ``first_batch_seconds`` (creation to the first
        batch), ``steady_samples`` and ``steady_seconds`` (after batch ``warmup``; both 0 when
        the epoch has no more batches than that), ``batches`` and, with ``cpu_clock``,
        ``cpu_seconds`` and ``steady_cpu_seconds``.

    Raises:
        EpochError: ``samples`` was given and the loader delivered fewer.
    """
    result = _timed_loop(make, samples, warmup, clock, cpu_clock, sync)
    if samples is not None and result["samples"] < samples:
        raise EpochError(
            f"the epoch delivered {result['samples']:.0f} samples in {result['batches']:.0f}"
            f" batches, expected {samples}: the loader drops or loses samples"
        )
    return result


def _timed_loop(
    make: Callable[[], Iterable[Any]],
    limit: int | None,
    warmup: int,
    clock: Callable[[], float],
    cpu_clock: Callable[[], float] | None,
    sync: Callable[[], None] | None,
) -> dict[str, float]:
    """The one timing loop of :func:`time_epoch` and :func:`time_batches`."""
    cpu = cpu_clock if cpu_clock is not None else (lambda: 0.0)
    n = seen = steady = 0
    t0 = clock()
    cpu0 = cpu()
    first = start = end = t0
    cpu_start = cpu0
    for batch in make():
        size = batch_size(batch)
        seen += size
        n += 1
        if n == 1 or n == warmup:
            if sync is not None:
                sync()
            now = clock()
            if n == 1:
                first = now
            if n == warmup:
                start, cpu_start = now, cpu()
        if n > warmup:
            steady += size
        if limit is not None and seen >= limit:
            break
    if sync is not None:
        sync()
    end = clock()
    cpu_end = cpu()
    result = {
        "samples": seen,
        "seconds": end - t0,
        "epoch_seconds": end - t0,
        "first_batch_seconds": first - t0,
        "steady_samples": steady,
        "steady_seconds": end - start if n > warmup else 0.0,
        "batches": n,
    }
    if cpu_clock is not None:
        result["cpu_seconds"] = cpu_end - cpu0
        result["steady_cpu_seconds"] = cpu_end - cpu_start if n > warmup else 0.0
    return result


def time_batches(
    batches: Iterable[Any],
    limit: int,
    *,
    warmup: int = 2,
    clock: Callable[[], float] = time.perf_counter,
    cpu_clock: Callable[[], float] | None = None,
    sync: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Consume ``batches`` until ``limit`` samples have been seen; time what follows the warm-up.

    A steady-state window only (start-up excluded): for costs that grow with the dataset
    (``bench_scale``) or runs capped below an epoch. Loader comparisons use :func:`time_epoch`,
    whose epoch rate includes start-up. With ``warmup`` batches or fewer in all, everything
    counts.

    Args:
        batches: The loader under test; samples per batch come from :func:`batch_size`.
        limit: Samples after which to stop (the batch that reaches it is the last).
        warmup: Batches not counted.
        clock: Wall clock in seconds (injectable for tests).
        cpu_clock: A CPU-seconds clock; when given the result has ``cpu_seconds`` over the same
            span as ``seconds``.
        sync: Called before each clock reading that ends a span (e.g. a CUDA synchronize).

    Returns:
        ``samples`` and ``seconds`` of the timed span, ``total_seconds`` from the first request
        (start-up included) and, with ``cpu_clock``, ``cpu_seconds``.
    """
    r = _timed_loop(lambda: batches, limit, warmup, clock, cpu_clock, sync)
    whole = r["steady_seconds"] == 0.0  # too few batches: count everything
    result = {
        "samples": r["samples"] if whole else r["steady_samples"],
        "seconds": r["epoch_seconds"] if whole else r["steady_seconds"],
        "total_seconds": r["epoch_seconds"],
    }
    if cpu_clock is not None:
        result["cpu_seconds"] = r["cpu_seconds"] if whole else r["steady_cpu_seconds"]
    return result


def dali_batches(pipe: Any, samples: int | None = None) -> Iterator[Any]:
    """``(images, labels)`` torch CPU tensors from a built DALI pipeline with two outputs (labels
    flattened to one dimension).

    Args:
        pipe: The pipeline; ``pipe.run()`` is called once per batch.
        samples: Stop after this many samples, the last batch cut to the rest (a reader that
            wraps into the next epoch to fill its last batch delivers exactly one epoch);
            ``None``: endless.
    """
    import numpy as np
    import torch

    left = samples
    while left is None or left > 0:
        images, labels = pipe.run()
        out_images = torch.from_numpy(np.array(images.as_tensor()))
        out_labels = torch.from_numpy(np.array(labels.as_tensor())).view(-1)
        if left is not None:
            out_images, out_labels = out_images[:left], out_labels[:left]
            left -= len(out_labels)
        yield out_images, out_labels


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
    ``scale=1e6`` for MB/s). A :func:`time_epoch` result adds its steady rate and first-batch time.
    """
    if "error" in result:
        print(f"  round {round_no} {label} ERROR {result['error']}", flush=True)
        return
    rate = result[amount] / result["seconds"] / scale
    line = f"  round {round_no} {label} {rate:9.0f} {unit}"
    if "first_batch_seconds" in result:
        steady = rate_of(result, "steady_samples", "steady_seconds")
        line += (
            f" epoch, {steady or 0:9.0f} steady, first batch {result['first_batch_seconds']:.2f} s"
        )
    print(line, flush=True)


def ok_runs(runs: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The runs that succeeded: no ``"error"`` and a positive ``"seconds"``."""
    return [r for r in runs if "error" not in r and r["seconds"] > 0]


def rate_of(
    run: Mapping[str, Any], amount: str = "samples", seconds: str = "seconds"
) -> float | None:
    """``run[amount] / run[seconds]``; ``None`` for a failed run or a span of no time."""
    if "error" in run or not run.get(seconds):
        return None
    return float(run[amount]) / float(run[seconds])


def median_rate(
    runs: Iterable[Mapping[str, Any]], amount: str = "samples", seconds: str = "seconds"
) -> float | None:
    """Median over the successful runs of ``run[amount] / run[seconds]`` (e.g.
    ``"steady_samples", "steady_seconds"`` for a :func:`time_epoch` run's steady rate); ``None``
    if no run has it."""
    rates = [x for r in runs if (x := rate_of(r, amount, seconds)) is not None]
    return statistics.median(rates) if rates else None


def median_of(runs: Iterable[Mapping[str, Any]], key: str, per: str | None = None) -> float | None:
    """Median over the successful runs of ``run[key]`` (divided by ``run[per]`` when given, e.g.
    ``"cpu_seconds", "samples"`` for CPU seconds per sample); ``None`` if no run has it."""
    values = [
        float(r[key]) / (float(r[per]) if per else 1.0)
        for r in ok_runs(runs)
        if r.get(key) is not None and (per is None or r.get(per))
    ]
    return statistics.median(values) if values else None


def run_label(quick: bool, count: int, rounds: int | None = None) -> str:
    """How a run names itself in its header, its last line and its JSON (``"label"``): a
    ``--quick`` run says ``QUICK RUN`` (a check of the benchmark, not a result)."""
    size = f"{count} images" + ("" if rounds is None else f", {rounds} rounds")
    return f"QUICK RUN ({size}: not a result)" if quick else f"full epochs of {size}"


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
