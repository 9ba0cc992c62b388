"""MemoryStore specifics: names share objects within a process; pickles carry a snapshot."""

from __future__ import annotations

import hashlib
import multiprocessing
import pickle
import uuid

from fastload.storage import MemoryStore

# Functions run in spawned processes must be importable there: use the suite's helpers.
from fastload.testing._store_processes import _child_put, _child_read_whole


def test_same_name_shares_objects() -> None:
    name = f"mem-{uuid.uuid4().hex}"
    a, b = MemoryStore(name), MemoryStore.from_url(f"memory://{name}")
    a.put("k", b"v")
    assert b.get("k") == b"v"
    assert MemoryStore(f"other-{uuid.uuid4().hex}").list_keys() == []
    a.delete("k")


def test_spawned_copy_is_a_snapshot() -> None:
    store = MemoryStore(f"mem-{uuid.uuid4().hex}")
    store.put("k", b"parent")
    assert store.shared_across_processes is False
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        got = pool.apply_async(_child_read_whole, (store, ["k"])).get(60)
        assert pool.apply_async(_child_put, (store, "written-in-child", b"c")).get(60) == 1
    assert got == {"k": hashlib.sha256(b"parent").hexdigest()}
    assert not store.exists("written-in-child")  # the child's write stayed in the child
    store.delete("k")


def test_unpickling_in_the_same_process_keeps_newer_objects() -> None:
    store = MemoryStore(f"mem-{uuid.uuid4().hex}")
    store.put("k", b"old")
    blob = pickle.dumps(store)
    store.put("k", b"new")
    copy = pickle.loads(blob)
    assert copy.get("k") == b"new"
    store.delete("k")
