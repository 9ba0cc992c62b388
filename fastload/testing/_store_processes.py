"""The pickling and multi-process tests of :class:`~fastload.testing.store.StoreTests` (a part
of the suite; subclass ``StoreTests``).

They pickle the store into ``spawn``-ed processes, so the store (and any store it wraps) must be
importable and picklable by reference, as stores that users hand to DataLoader workers are.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import pickle
import random
from collections.abc import Iterator
from multiprocessing.pool import Pool

import pytest

from fastload.storage import ByteRange, Store
from fastload.testing._store_common import digest, payload

# ---- functions run in spawned processes (module level, so they pickle by reference) -----------


def _child_read_ranges(store: Store, jobs: list[tuple[str, int, int]], rounds: int) -> str:
    parts: list[bytes] = []
    for _ in range(rounds):
        for key, start, end in jobs:
            parts.append(store.get(key, ByteRange(start, end)))
    return digest(parts)


def _child_read_whole(store: Store, keys: list[str]) -> dict[str, str]:
    return {key: hashlib.sha256(store.get(key)).hexdigest() for key in keys}


def _child_put(store: Store, key: str, data: bytes) -> int:
    store.put(key, data)
    return len(data)


class ProcessTests:
    """Pickling, and reads and writes from spawned processes (a part of
    :class:`~fastload.testing.store.StoreTests`, which provides the ``store`` fixture)."""

    #: Processes of the concurrent multi-process read test.
    reader_processes: int = 3

    @pytest.fixture(scope="class")
    @classmethod
    def process_pool(cls) -> Iterator[Pool]:
        """``reader_processes`` spawned processes, shared by the tests of one subclass."""
        ctx = multiprocessing.get_context("spawn")
        pool = ctx.Pool(cls.reader_processes)
        try:
            yield pool
        finally:
            pool.terminate()
            pool.join()

    # ---- pickling and processes ---------------------------------------------------------------

    def test_pickle_roundtrip(self, store: Store) -> None:
        store.put("p/obj", b"pickled")
        blob = pickle.dumps(store)
        copy = pickle.loads(blob)
        assert type(copy) is type(store)
        assert copy.url == store.url
        assert copy.get("p/obj") == b"pickled"
        # In the same process, the copy and the original are the same namespace.
        copy.put("p/from-copy", b"1")
        assert store.get("p/from-copy") == b"1"
        if store.shared_across_processes:
            # Pickles by configuration, not by content: cheap to send to every worker.
            store.put("p/big", bytes(1 << 20))
            assert len(pickle.dumps(store)) < 64 * 1024

    def test_spawned_processes_read_concurrently(self, store: Store, process_pool: Pool) -> None:
        rng = random.Random(7)
        objects = {f"mp/{i}": payload(200_000 + i, seed=10 + i) for i in range(3)}
        for key, data in objects.items():
            store.put(key, data)
        keys = sorted(objects)
        whole = process_pool.apply_async(_child_read_whole, (store, keys)).get(120)
        assert whole == {k: hashlib.sha256(objects[k]).hexdigest() for k in keys}
        jobs_per_proc: list[list[tuple[str, int, int]]] = []
        for _ in range(self.reader_processes):
            jobs = []
            for _ in range(50):
                key = rng.choice(keys)
                start = rng.randrange(len(objects[key]))
                jobs.append((key, start, min(len(objects[key]), start + rng.randrange(1, 20_000))))
            jobs_per_proc.append(jobs)
        rounds = 4
        results = [
            process_pool.apply_async(_child_read_ranges, (store, jobs, rounds))
            for jobs in jobs_per_proc
        ]
        for jobs, result in zip(jobs_per_proc, results):
            expected = digest([objects[k][s:e] for _ in range(rounds) for k, s, e in jobs])
            assert result.get(120) == expected

    def test_spawned_process_writes_are_visible(self, store: Store, process_pool: Pool) -> None:
        if not store.shared_across_processes:
            pytest.skip(
                f"{type(store).__name__} copies in other processes are snapshots "
                "(shared_across_processes is False)"
            )
        data = payload(50_000, seed=8)
        assert process_pool.apply_async(_child_put, (store, "mp/written", data)).get(120) == len(
            data
        )
        assert store.get("mp/written") == data
