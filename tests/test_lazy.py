"""fastload._lazy.PerProcess: one value per process, made on first use."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import pickle
import threading

from fastload._lazy import PerProcess, current_pid

_counter = itertools.count()


def _make() -> tuple[int, int]:
    return (os.getpid(), next(_counter))


def _child(holder: PerProcess[tuple[int, int]], conn: object) -> None:
    value = holder.get()
    conn.send((value, holder.get(), os.getpid()))  # type: ignore[attr-defined]


def test_made_once_per_process_even_when_threads_race() -> None:
    calls = []

    def factory() -> object:
        calls.append(1)
        return object()

    holder: PerProcess[object] = PerProcess(factory)
    assert holder.peek() is None
    seen: list[object] = []
    threads = [threading.Thread(target=lambda: seen.append(holder.get())) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert all(v is seen[0] for v in seen)
    assert holder.peek() is seen[0]


def test_clear_returns_the_value_and_the_next_get_makes_a_new_one() -> None:
    holder = PerProcess(_make)
    first = holder.get()
    assert holder.clear() == first
    assert holder.peek() is None
    second = holder.get()
    assert second != first
    assert second[0] == os.getpid()
    assert holder.clear() == second
    assert holder.clear() is None


def test_forked_child_makes_its_own_value_and_leaves_the_parents() -> None:
    holder = PerProcess(_make)
    parent_value = holder.get()
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(holder, send))
    proc.start()
    child_value, again, child_pid = recv.recv()
    proc.join(30)
    assert proc.exitcode == 0
    assert child_value[0] == child_pid != os.getpid()
    assert again == child_value  # made once in the child
    assert holder.get() == parent_value  # the parent's value untouched


def test_pickled_copy_carries_the_factory_not_the_value() -> None:
    holder = PerProcess(_make)
    made = holder.get()
    copy = pickle.loads(pickle.dumps(holder))
    assert copy.peek() is None
    assert copy.get() != made
    assert "not made" in repr(PerProcess(_make))


def _report_pids(queue: multiprocessing.Queue[tuple[int, int]]) -> None:
    queue.put((current_pid(), os.getpid()))


def test_current_pid_follows_forks() -> None:
    assert current_pid() == os.getpid()
    ctx = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue[tuple[int, int]] = ctx.Queue()
    child = ctx.Process(target=_report_pids, args=(queue,))
    child.start()
    cached, real = queue.get(timeout=30)
    child.join(30)
    assert cached == real == child.pid
    assert cached != os.getpid()
    assert current_pid() == os.getpid()  # the parent's is unchanged
