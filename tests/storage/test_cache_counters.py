"""The node's cache counters: summed over processes, kept across SIGKILL, merged exactly once."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload.storage import LocalStore
from fastload.storage._cache import CachingStore
from fastload.storage._cache_counters import COUNTER_NAMES, NodeCounters

KEYS = [f"shard-{i}.tar" for i in range(6)]


def make_remote(root: Path) -> LocalStore:
    store = LocalStore(root)
    for i, key in enumerate(KEYS):
        store.put(key, bytes([i]) * (1000 + i))
    return store


def _read_keys(cache: CachingStore, keys: list[str], conn: Connection) -> None:
    for key in keys:
        assert cache.get(key)[:1] == bytes([int(key[6])])
    conn.send(cache.stats())  # synchronous: sent before the process ends


def _read_then_die(cache: CachingStore, keys: list[str], conn: Connection) -> None:
    _read_keys(cache, keys, conn)
    os.kill(os.getpid(), signal.SIGKILL)


def counter_files(cache_dir: Path) -> list[str]:
    return sorted(p.name for p in (cache_dir / "counters").glob("*.cnt"))


def test_node_stats_sum_every_process_live_and_dead(tmp_path: Path) -> None:
    remote = make_remote(tmp_path / "remote")
    cache_dir = tmp_path / "cache"
    cache = CachingStore(remote, cache_dir, 4000)  # room for ~3 of the 6 objects
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    plans = [(_read_keys, KEYS[:4]), (_read_keys, KEYS[2:]), (_read_then_die, KEYS)]
    stats = []
    for target, keys in plans:  # one after another: the counts per process are deterministic
        proc = ctx.Process(target=target, args=(cache, keys, send))
        proc.start()
        assert receive.poll(30)
        stats.append(receive.recv())
        proc.join(30)
    assert proc.exitcode == -signal.SIGKILL
    here = cache.get(KEYS[0])  # this process counts too
    assert here[:1] == b"\0"
    mine = cache.stats()
    expected = {k: sum(int(s[k]) for s in stats) + mine[k] for k in COUNTER_NAMES}  # type: ignore[index]
    node = cache.node_stats()
    assert {k: node[k] for k in COUNTER_NAMES} == expected
    assert node["cached_bytes"] == cache.cached_bytes() <= 4000
    # Every object read once per process; evictions force downloads again in later processes.
    assert expected["hits"] + expected["misses"] == 4 + 4 + 6 + 1
    assert expected["misses"] > len(KEYS)
    assert expected["evictions"] > 0
    assert expected["bytes_downloaded"] >= sum(1000 + i for i in range(len(KEYS)))
    # Each fill is one head and one get.
    assert expected["requests"] == 2 * expected["misses"] == 2 * expected["downloads"]
    # The three children are gone: their files were merged into merged.json and removed.
    assert len(counter_files(cache_dir)) == 1  # this process's
    merged = json.loads((cache_dir / "counters" / "merged.json").read_text())
    assert merged["totals"]["misses"] == expected["misses"] - mine["misses"]
    # A fresh store on the directory (another process's view) reads the same totals.
    again = CachingStore(remote, cache_dir, 4000).node_stats()
    assert {k: again[k] for k in COUNTER_NAMES} == expected


def test_a_merge_cut_short_is_not_counted_twice(tmp_path: Path) -> None:
    counters = NodeCounters(str(tmp_path))
    counters.create()
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=_count_and_exit, args=(counters, 7))
    proc.start()
    proc.join(30)
    names = counter_files(tmp_path)
    assert len(names) == 1
    # A merger that wrote merged.json but died before removing the file it absorbed:
    merged = tmp_path / "counters" / "merged.json"
    totals = dict.fromkeys(COUNTER_NAMES, 0) | {"hits": 7}
    merged.write_text(json.dumps({"totals": totals, "absorbed": names}))
    assert counters.totals()["hits"] == 7
    assert counter_files(tmp_path) == []
    assert counters.totals()["hits"] == 7


def _count_and_exit(counters: NodeCounters, n: int) -> None:
    counters.open().add("hits", n)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.sampled_from(COUNTER_NAMES), st.integers(0, 10**12)),
        max_size=40,
    ),
    st.lists(st.integers(0, 40), max_size=4),
)
def test_totals_are_the_sum_of_the_adds(
    tmp_path_factory: object, adds: list[tuple[int, str, int]], merge_at: list[int]
) -> None:
    root = Path(tmp_path_factory.mktemp("counters"))  # type: ignore[attr-defined]
    counters = NodeCounters(str(root))
    counters.create()
    files = [counters.open() for _ in range(3)]
    expected = dict.fromkeys(COUNTER_NAMES, 0)
    for i, (which, name, n) in enumerate(adds):
        if i in merge_at:
            assert counters.merge_dead() == 0  # all three are alive (this process holds them)
        files[which].add(name, n)
        expected[name] += n
    assert counters.totals() == expected


def test_a_cache_directory_without_room_for_counters_still_serves_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    remote = make_remote(tmp_path / "remote")
    cache = CachingStore(remote, tmp_path / "cache", "1MB")

    def full(self: NodeCounters) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(NodeCounters, "open", full)
    assert cache.get(KEYS[1])[:1] == b"\1"
    assert cache.get(KEYS[1])[:1] == b"\1"
    assert cache.stats()["misses"] == 1  # this process's counters still count
    assert cache.stats()["hits"] == 1
    assert "No space left on device" in caplog.text
    assert cache.node_stats()["misses"] == 0  # the node's did not get them
