"""The leaf helpers behind the machine caches: the bounded memo (``fastload/_memo.py``) and the
OS calls (``fastload/_os.py``)."""

from __future__ import annotations

import mmap
import os
import signal
import sys
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest

from fastload._memo import BoundedMemo
from fastload._os import (
    die_with_parent,
    interrupts_escalate,
    interrupts_ignored,
    map_read_only,
    never_free,
    populate,
)


def test_memo_keeps_the_most_recently_used_within_its_entries() -> None:
    evicted: list[tuple[str, int]] = []
    memo: BoundedMemo[str, int] = BoundedMemo(2, on_evict=lambda k, v: evicted.append((k, v)))
    memo.put("a", 1)
    memo.put("b", 2)
    assert memo.get("a") == 1  # now the most recent
    memo.put("c", 3)
    assert list(memo) == ["a", "c"]
    assert evicted == [("b", 2)]
    assert memo.get("b") is None
    assert memo.get_or_make("d", lambda: 4) == 4
    assert memo.get_or_make("d", lambda: 5) == 4  # kept, not made again
    assert list(memo) == ["c", "d"]
    assert memo.pop("c") == 3
    assert evicted == [("b", 2), ("a", 1)]  # pop does not call on_evict
    memo.limit(0)
    assert len(memo) == 0


def test_memo_bounded_by_weight() -> None:
    memo: BoundedMemo[int, bytes] = BoundedMemo(100, weight=len, max_weight=10)
    for i in range(5):
        memo.put(i, bytes(4))
    assert list(memo) == [3, 4]
    assert memo.total_weight == 8
    memo.put(4, bytes(1))  # replaced: the old weight goes
    assert memo.total_weight == 5
    memo.put(9, bytes(20))  # heavier than the bound alone: nothing stays
    assert len(memo) == 0
    assert memo.total_weight == 0
    memo.put(1, b"xy")
    memo.clear()
    assert (len(memo), memo.total_weight) == (0, 0)


def test_memo_shared_by_racing_threads_never_raises() -> None:
    memo: BoundedMemo[int, int] = BoundedMemo(2)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for i in range(20_000):
                key = (i * seed) % 5
                assert memo.get_or_make(key, lambda k=key: k * 10) == key * 10
                memo.pop((i + seed) % 5)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in (1, 3, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(memo) <= 2


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/fd is Linux's")
def test_map_read_only_holds_no_descriptor(tmp_path: Path) -> None:
    path = tmp_path / "f"
    data = bytes(range(256)) * 100
    path.write_bytes(data)
    before = _fds()
    views = [map_read_only(path) for _ in range(20)]
    assert _fds() == before
    for found in views:
        assert found is not None
        view, st = found
        assert st.st_size == len(data)
        assert bytes(view) == data
        array = np.frombuffer(view, dtype=np.uint8)
        assert not array.flags.writeable
        with pytest.raises(TypeError):
            view[0] = 1  # type: ignore[index]
    assert map_read_only(tmp_path / "missing") is None
    (tmp_path / "empty").write_bytes(b"")
    assert map_read_only(tmp_path / "empty") is None


def test_map_read_only_outlives_its_file_name(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"abc" * 1000)
    found = map_read_only(path)
    assert found is not None
    array = np.frombuffer(found[0], dtype=np.uint8)[:3]
    del found
    path.unlink()  # the mapping keeps the pages, and the array keeps the mapping
    assert bytes(array) == b"abc"


def test_never_free_keeps_an_object_that_nothing_else_references() -> None:
    class Owned:
        pass

    kept, dropped = Owned(), Owned()
    kept_ref, dropped_ref = weakref.ref(kept), weakref.ref(dropped)
    never_free(kept)
    del kept, dropped
    assert dropped_ref() is None
    assert isinstance(kept_ref(), Owned)


def test_populate_leaves_the_memory_usable() -> None:
    block = mmap.mmap(-1, 1 << 20)
    array = np.frombuffer(block, dtype=np.uint8)
    done = populate(array.ctypes.data + 100, (1 << 20) - 100)
    assert isinstance(done, bool)
    array[:] = 7
    assert int(array.sum()) == 7 << 20
    assert populate(array.ctypes.data, 0) is False
    del array
    block.close()


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_die_with_parent_kills_the_child_when_its_parent_dies(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild"
    middle = os.fork()
    if middle == 0:  # the parent-to-be-killed
        try:
            child = os.fork()
            if child == 0:  # the grandchild arms the signal, then waits forever
                if die_with_parent(signal.SIGKILL):
                    tmp = tmp_path / "tmp"
                    tmp.write_text(str(os.getpid()))
                    tmp.rename(pid_file)
                time.sleep(60)
            time.sleep(60)
        finally:
            os._exit(0)
    deadline = time.monotonic() + 30
    while not pid_file.exists():
        assert time.monotonic() < deadline, "the grandchild did not arm the signal"
        time.sleep(0.01)
    grandchild = int(pid_file.read_text())
    os.kill(middle, signal.SIGKILL)
    os.waitpid(middle, 0)
    while _running(grandchild):  # killed by the kernel (a zombie until someone reaps it)
        assert time.monotonic() < deadline, "the grandchild outlived its parent"
        time.sleep(0.01)


def test_interrupts_escalate_raises_once_then_calls_back() -> None:
    calls: list[int] = []
    with interrupts_escalate(lambda: calls.append(1)):
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)
    assert calls == [1, 1]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with interrupts_ignored():
        signal.raise_signal(signal.SIGINT)  # ignored: nothing raised
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
