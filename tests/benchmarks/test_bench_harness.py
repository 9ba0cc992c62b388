"""The benchmark harness's arithmetic, on fake loaders with an injected clock (no timing).

:func:`benchmarks._harness.time_epoch` is what every loader benchmark reports (epoch rate from the
loader's creation, first-batch time, steady rate after batch 2, CPU time), so its spans are
checked exactly here: a fake loader advances a fake clock by known amounts at creation and at
each batch. Also :func:`time_batches` (its steady-window view), :func:`dali_batches`' cut to one
epoch, the medians, and the process-tree sampling of :mod:`benchmarks._proctree`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks._harness import (
    EpochError,
    check_labels,
    child_pids,
    counting_labels,
    dali_batches,
    median_of,
    median_rate,
    rate_of,
    time_batches,
    time_epoch,
    tree_cpu_seconds,
    tree_memory,
)


class FakeClock:
    """A clock that moves only when told to (seconds)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.readings = 0

    def __call__(self) -> float:
        self.readings += 1
        return self.now


def fake_loader(
    clock: FakeClock, startup: float, steps: Sequence[tuple[int, float]], served: list[int]
) -> Callable[[], Iterator[Any]]:
    """``make`` for a loader that takes ``startup`` s to create and ``dt`` s per batch of
    ``size`` samples (``(images, labels)`` batches); ``served`` counts the batches handed out."""

    def make() -> Iterator[Any]:
        clock.now += startup

        def batches() -> Iterator[Any]:
            for size, dt in steps:
                clock.now += dt
                served.append(size)
                yield None, list(range(size))

        return batches()

    return make


def test_time_epoch_spans_on_a_known_loader() -> None:
    clock = FakeClock()
    steps = [(64, 0.5), (64, 0.25), (64, 0.25), (16, 0.125)]
    served: list[int] = []
    r = time_epoch(
        fake_loader(clock, 1.0, steps, served), 208, clock=clock, cpu_clock=lambda: 3 * clock.now
    )
    assert r["samples"] == 208
    assert r["batches"] == 4
    assert r["epoch_seconds"] == r["seconds"] == 2.125  # creation included
    assert r["first_batch_seconds"] == 1.5  # creation + the first batch
    assert r["steady_samples"] == 80  # batches 3 and 4
    assert r["steady_seconds"] == 0.375  # from the arrival of batch 2
    assert r["cpu_seconds"] == pytest.approx(3 * 2.125)
    assert r["steady_cpu_seconds"] == pytest.approx(3 * 0.375)
    assert rate_of(r) == pytest.approx(208 / 2.125)
    assert rate_of(r, "steady_samples", "steady_seconds") == pytest.approx(80 / 0.375)


@settings(max_examples=200, deadline=None)
@given(
    startup=st.integers(0, 1000),
    steps=st.lists(st.tuples(st.integers(1, 300), st.integers(0, 1000)), min_size=1, max_size=40),
    warmup=st.integers(1, 4),
)
def test_time_epoch_arithmetic_holds_for_any_loader(
    startup: int, steps: list[tuple[int, int]], warmup: int
) -> None:
    # Milliseconds as whole numbers of seconds / 1024 keep the float sums exact.
    clock = FakeClock()
    timed = [(size, ms / 1024) for size, ms in steps]
    served: list[int] = []
    total = sum(size for size, _ in steps)
    r = time_epoch(
        fake_loader(clock, startup / 1024, timed, served), total, warmup=warmup, clock=clock
    )
    assert served == [size for size, _ in steps]  # every batch, nothing more
    assert r["samples"] == total
    assert r["batches"] == len(steps)
    assert r["epoch_seconds"] == (startup + sum(ms for _, ms in steps)) / 1024
    assert r["first_batch_seconds"] == (startup + steps[0][1]) / 1024
    if len(steps) > warmup:
        assert r["steady_samples"] == sum(size for size, _ in steps[warmup:])
        assert r["steady_seconds"] == sum(ms for _, ms in steps[warmup:]) / 1024
    else:  # no batch after the warm-up: no steady span
        assert r["steady_samples"] == 0
        assert r["steady_seconds"] == 0.0
        assert rate_of(r, "steady_samples", "steady_seconds") is None
    assert "cpu_seconds" not in r


def test_time_epoch_stops_at_the_epoch_size_when_a_loader_pads_or_never_ends() -> None:
    clock = FakeClock()
    served: list[int] = []
    endless = [(64, 0.5)] * 100  # e.g. a DALI pipeline, or a loader padding its last batch
    r = time_epoch(fake_loader(clock, 0.0, endless, served), 150, clock=clock)
    assert served == [64, 64, 64]  # the batch that reaches 150 is the last one taken
    assert r["samples"] == 192
    assert r["epoch_seconds"] == 1.5


def test_time_epoch_fails_a_loader_that_loses_samples() -> None:
    clock = FakeClock()
    with pytest.raises(EpochError, match=r"delivered 128 samples in 2 batches, expected 130"):
        time_epoch(fake_loader(clock, 0.0, [(64, 0.5), (64, 0.5)], []), 130, clock=clock)


def test_time_epoch_syncs_before_each_reading_that_ends_a_span() -> None:
    clock = FakeClock()
    events: list[str] = []

    def sync() -> None:
        events.append(f"sync@{clock.readings}")

    steps = [(8, 1.0), (8, 1.0), (8, 1.0)]
    time_epoch(fake_loader(clock, 0.0, steps, []), 24, clock=clock, sync=sync)
    # readings: start (1), first batch (2), batch 2 = steady start (3), end (4); a sync before
    # each of the last three
    assert events == ["sync@1", "sync@2", "sync@3"]
    assert clock.readings == 4


def test_time_batches_is_the_steady_window_of_the_same_loop() -> None:
    clock = FakeClock()
    steps = [(10, 2.0), (10, 1.0), (10, 1.0), (10, 1.0), (10, 1.0)]
    served: list[int] = []
    make = fake_loader(clock, 5.0, steps, served)
    r = time_batches(make(), 30, clock=clock, cpu_clock=lambda: clock.now / 2)
    assert served == [10, 10, 10]  # stopped at the limit
    assert r == {"samples": 10, "seconds": 1.0, "total_seconds": 4.0, "cpu_seconds": 0.5}
    # too few batches: everything counts
    clock2 = FakeClock()
    r2 = time_batches(fake_loader(clock2, 0.0, [(7, 3.0)], [])(), 100, clock=clock2)
    assert r2 == {"samples": 7, "seconds": 3.0, "total_seconds": 3.0}


def test_medians_skip_failed_runs_and_empty_spans() -> None:
    runs: list[dict[str, Any]] = [
        {"samples": 100, "seconds": 2.0, "steady_samples": 80, "steady_seconds": 1.0},
        {"samples": 100, "seconds": 4.0, "steady_samples": 0, "steady_seconds": 0.0},
        {"samples": 100, "seconds": 1.0, "steady_samples": 90, "steady_seconds": 0.5},
        {"error": "exit 1: boom"},
    ]
    assert median_rate(runs) == 50.0  # 50, 25, 100
    assert median_rate(runs, "steady_samples", "steady_seconds") == 130.0  # 80, 180
    assert median_of(runs, "seconds") == 2.0
    assert median_of(runs, "seconds", "samples") == 0.02
    assert median_rate([{"error": "x"}]) is None
    assert median_of([], "seconds") is None


class _FakeTensorList:
    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def as_tensor(self) -> np.ndarray:
        return self.array


class _FakePipe:
    """A DALI pipeline stand-in: batch ``i`` holds labels ``i * batch ...``, and never ends."""

    def __init__(self, batch: int) -> None:
        self.batch, self.runs = batch, 0

    def run(self) -> tuple[_FakeTensorList, _FakeTensorList]:
        base = self.runs * self.batch
        self.runs += 1
        labels = np.arange(base, base + self.batch, dtype=np.int32).reshape(-1, 1)
        return _FakeTensorList(np.zeros((self.batch, 3), np.float32)), _FakeTensorList(labels)


def test_dali_batches_delivers_exactly_one_epoch_and_cuts_the_last_batch() -> None:
    pipe = _FakePipe(64)
    batches = list(dali_batches(pipe, 150))
    assert pipe.runs == 3
    assert [len(labels) for _, labels in batches] == [64, 64, 22]
    assert [len(images) for images, _ in batches] == [64, 64, 22]
    assert batches[-1][1].tolist() == list(range(128, 150))
    endless = dali_batches(_FakePipe(4))
    assert [next(endless)[1].tolist() for _ in range(3)][-1] == [8, 9, 10, 11]


def test_process_tree_sampling_sees_a_child_and_its_memory() -> None:
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) as proc:
        try:
            deadline = time.monotonic() + 10
            while proc.pid not in child_pids(os.getpid()) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert proc.pid in child_pids(os.getpid())
            tree = {row["pid"]: row for row in tree_memory()}
            me, child = tree[os.getpid()], tree[proc.pid]
            assert me["role"] == "main"
            assert child["role"].startswith(sys.executable)  # not forked: its own program
            for row in (me, child):
                assert row["rss_kb"] > 1000  # a Python interpreter: megabytes
                assert 0 < row["pss_kb"] <= row["rss_kb"]
                assert 0 < row["anon_kb"] <= row["rss_kb"]
                assert 0 < row["pss_file_kb"] < row["pss_kb"]  # the interpreter's own code
            own = time.process_time()
            assert tree_cpu_seconds() >= own  # this process's threads, plus the child's share
        finally:
            proc.kill()
    assert proc.pid not in child_pids(os.getpid())


def test_counting_labels_sees_every_batch_and_check_labels_names_what_is_off() -> None:
    clock = FakeClock()
    # labels 0..9 as a W1-like corpus: label = i % 5
    batches = [(None, np.array([0, 1, 2, 3])), (None, [4, 0, 1, 2]), (None, np.array([3, 4]))]

    def make() -> Iterator[Any]:
        clock.now += 1.0
        return iter(batches)

    counts: Counter[int] = Counter()
    r = time_epoch(counting_labels(make, counts), 10, clock=clock)
    assert r["first_batch_seconds"] == 1.0  # creation still inside the timed span
    expected = Counter(i % 5 for i in range(10))
    assert counts == expected
    check_labels(counts, expected)  # every sample once: no error
    counts[3] += 1  # a sample delivered twice ...
    counts[4] -= 1  # ... and one dropped: the count alone would not notice
    with pytest.raises(EpochError, match=r"2 classes off \(class 3: 3 not 2, class 4: 1 not 2\)"):
        check_labels(counts, expected, "peer")
