"""Property tests of the loader's guarantees, without worker processes.

Each (rank, worker) batch generator is called directly (``BatchStream.generate``), which is exactly
what every DataLoader worker runs, so shards x ranks x workers x batch sizes x uneven shard sizes are
explored quickly over the in-memory fake format (see conftest.py).
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastload.errors import CorruptDataError, InvalidArgumentError, WorkerError
from fastload.loader import BatchMeta, BatchStream, Dataset

SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

# fewer shards than ranks x workers, empty shards, single samples
sizes_st = st.lists(st.integers(0, 23), min_size=1, max_size=6)


def run(
    ds: Dataset,
    fake: SimpleNamespace,
    *,
    world: int,
    batch: int,
    workers: int,
    drop_last: bool = False,
    epoch: int = 0,
    start: int = 0,
    io_threads: int = 0,
) -> tuple[dict[tuple[int, int], list[str]], dict[tuple[int, int], BatchMeta], BatchStream]:
    """All batches of one epoch: {(step, rank): keys}, checking per-worker step order."""
    out: dict[tuple[int, int], list[str]] = {}
    metas: dict[tuple[int, int], BatchMeta] = {}
    stream = None
    for rank in range(world):
        stream = BatchStream(
            ds,
            batch,
            drop_last=drop_last,
            collate_fn=fake.keys_collate,
            rank=rank,
            world_size=world,
            io_threads=io_threads,
            with_meta=True,
        )
        stream.set_epoch(epoch, start)
        per_rank = []
        for worker in range(workers):
            got = list(
                stream.generate(worker=worker, num_workers=workers, epoch=epoch, start_step=start)
            )
            steps = [m.step for m, _ in got]
            assert steps == sorted(steps)
            assert all((m.step - start) % workers == worker for m, _ in got)
            for meta, keys in got:
                assert meta.rank == rank
                assert meta.worker == worker
                assert meta.size == len(keys)
                out[(meta.step, rank)] = keys
                metas[(meta.step, rank)] = meta
            per_rank.append(len(got))
        assert sum(per_rank) == len(stream)  # len() is right on every rank
        # torch asks workers round-robin: worker w gets every workers-th batch, lower ids first
        assert per_rank == sorted(per_rank, reverse=True)
        assert per_rank[0] - per_rank[-1] <= 1
    assert stream is not None
    return out, metas, stream


def global_sequence(batches: dict[tuple[int, int], list[str]], world: int) -> list[str]:
    steps = sorted({s for s, _ in batches})
    return [k for s in steps for r in range(world) for k in batches[(s, r)]]


@SETTINGS
@given(
    sizes=sizes_st,
    world=st.integers(1, 8),
    batch=st.integers(1, 9),
    workers=st.integers(1, 4),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_exactly_once_equal_batches_deterministic(
    fake: SimpleNamespace,
    sizes: list[int],
    world: int,
    batch: int,
    workers: int,
    drop_last: bool,
    shuffle: bool,
    seed: int,
) -> None:
    ds = fake.make_dataset(sizes, shuffle=shuffle, seed=seed, block_size=3, window=2)
    batches, metas, stream = run(
        ds, fake, world=world, batch=batch, workers=workers, drop_last=drop_last
    )
    part = stream.partition
    n = sum(sizes)
    # equal batch counts on every rank, and every step present for every rank
    assert set(batches) == {(s, r) for s in range(part.num_steps) for r in range(world)}
    seq = global_sequence(batches, world)
    counts = Counter(seq)
    if drop_last:
        assert len(seq) == len(counts) == part.num_steps * world * batch
        assert n - len(seq) == part.dropped < world * batch
        assert all(len(v) == batch for v in batches.values())
    else:
        assert sorted(counts) == sorted(fake.all_keys(sizes))  # every sample ...
        assert len(seq) == n + part.padded  # ... once, plus counted repeats
        assert sum(m.padded for m in metas.values()) == part.padded < world
        assert sum(c - 1 for c in counts.values()) == part.padded
    # the global sequence is the epoch's order (independent of world size, batch, workers)
    order = ds.order(0).indices(np.arange(n)).tolist()
    all_keys = fake.all_keys(sizes)
    expected = [all_keys[i] for i in order]
    assert seq[: min(n, len(seq))] == expected[: len(seq)]
    # deterministic: the same again
    again, _, _ = run(ds, fake, world=world, batch=batch, workers=workers, drop_last=drop_last)
    assert again == batches


@SETTINGS
@given(
    sizes=st.lists(st.integers(0, 23), min_size=1, max_size=6).filter(lambda s: sum(s) > 0),
    global_batch=st.sampled_from([1, 2, 4, 6, 8, 12]),
    world_a=st.integers(1, 12),
    world_b=st.integers(1, 12),
    workers_a=st.integers(1, 4),
    workers_b=st.integers(1, 4),
    drop_last=st.booleans(),
    data=st.data(),
)
def test_elastic_resume_equals_uninterrupted(
    fake: SimpleNamespace,
    sizes: list[int],
    global_batch: int,
    world_a: int,
    world_b: int,
    workers_a: int,
    workers_b: int,
    drop_last: bool,
    data: Any,
) -> None:
    """Stop after k global steps with (W, workers); resume with (W', workers'), same G: the
    remaining samples are exactly those not yet delivered, in the same order per global step."""
    if global_batch % world_a or global_batch % world_b:
        world_a = world_b = 1
    ds = fake.make_dataset(sizes, seed=5, block_size=2, window=3)
    ref, _, ref_stream = run(
        ds,
        fake,
        world=world_a,
        batch=global_batch // world_a,
        workers=workers_a,
        drop_last=drop_last,
        epoch=2,
    )
    k = data.draw(st.integers(0, ref_stream.partition.num_steps), label="resume step")
    done = [key for (s, _), keys in sorted(ref.items()) if s < k for key in keys]
    resumed, _, res_stream = run(
        ds,
        fake,
        world=world_b,
        batch=global_batch // world_b,
        workers=workers_b,
        drop_last=drop_last,
        epoch=2,
        start=k,
    )
    rest = global_sequence(resumed, world_b)
    n = sum(sizes)
    if drop_last:
        # full global steps are identical whatever the world size
        ref_rest = [key for (s, r), keys in sorted(ref.items()) if s >= k for key in keys]
        assert sorted(rest) == sorted(ref_rest)
        assert not set(rest) & set(done)
        for s in range(k, res_stream.partition.num_steps):
            a = sorted(k2 for r in range(world_a) for k2 in ref[(s, r)])
            b = sorted(k2 for r in range(world_b) for k2 in resumed[(s, r)])
            assert a == b
    else:
        assert res_stream.partition.num_steps == ref_stream.partition.num_steps
        delivered = set(done) | set(rest)
        assert delivered == set(fake.all_keys(sizes))  # nothing missing
        # the samples still to come are exactly the uninterrupted run's, in the same order ...
        ref_seq = global_sequence(ref, world_a)[:n]
        m = max(0, n - k * global_batch)
        assert rest[:m] == ref_seq[k * global_batch :]
        assert not set(rest[:m]) & set(done)
        # ... followed by the resumed job's padding (repeats of the epoch's first samples)
        total = n + res_stream.partition.padded
        pad_from = max(k * global_batch, n)
        assert rest[m:] == [ref_seq[(p - n) % n] for p in range(pad_from, total)]


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(sizes=sizes_st.filter(lambda s: sum(s) > 1), epoch=st.integers(0, 3))
def test_set_epoch_changes_order(fake: SimpleNamespace, sizes: list[int], epoch: int) -> None:
    ds = fake.make_dataset(sizes, seed=1, block_size=1, window=64)
    a = global_sequence(run(ds, fake, world=1, batch=4, workers=1, epoch=epoch)[0], 1)
    b = global_sequence(run(ds, fake, world=1, batch=4, workers=1, epoch=epoch + 1)[0], 1)
    assert sorted(a) == sorted(b)
    if sum(sizes) >= 8:
        assert a != b


def test_io_threads_and_prefetch_give_the_same_batches(fake: SimpleNamespace) -> None:
    ds = fake.make_dataset([17, 0, 40, 3], seed=2)
    base, _, _ = run(ds, fake, world=2, batch=5, workers=2, io_threads=0)
    threaded, _, _ = run(ds, fake, world=2, batch=5, workers=2, io_threads=3)
    assert threaded == base


def test_sequential_fallback_without_random_access(fake: SimpleNamespace) -> None:
    ref = fake.make_dataset([9, 4, 11], seed=4, block_size=2)
    seq = fake.make_dataset([9, 4, 11], seed=4, block_size=2, fmt="fakeseq")
    assert (
        run(seq, fake, world=2, batch=3, workers=2)[0]
        == run(ref, fake, world=2, batch=3, workers=2)[0]
    )


def test_skip_policy_counts_and_keeps_batch_counts(fake: SimpleNamespace) -> None:
    bad = {(0, 1), (1, 0), (1, 2)}
    ds = fake.make_dataset(
        [4, 3], corrupt=lambda s, p: (s, p) in bad, on_error="skip", shuffle=False
    )
    batches, metas, _ = run(ds, fake, world=2, batch=2, workers=1)
    # 7 samples, W=2: padded to 8, steps: [0..3] [4..7]
    assert len(batches) == 4
    assert sum(m.skipped for m in metas.values()) == 3
    delivered = [k for v in batches.values() for k in v]
    assert sorted(set(delivered)) == sorted(
        set(fake.all_keys([4, 3])) - {fake.key_of(s, p) for s, p in bad}
    )
    # step 1, rank 0 holds positions 4, 5 = (1,0), (1,1): one skipped
    assert batches[(1, 0)] == [fake.key_of(1, 1)]
    # step 1, rank 1 holds positions 6 (1,2) and padding 7 -> position 0 (0,0)
    assert batches[(1, 1)] == [fake.key_of(0, 0)]


def test_all_skipped_batch_is_empty_not_missing(fake: SimpleNamespace) -> None:
    ds = fake.make_dataset(
        [6], corrupt=lambda s, p: p in (2, 3), on_error="skip", shuffle=False, fields=("cls",)
    )
    stream = BatchStream(ds, 2, rank=0, world_size=1, io_threads=0, with_meta=True)
    got = list(stream.generate())
    assert [m.size for m, _ in got] == [2, 0, 2]
    meta, empty = got[1]
    assert meta.skipped == 2
    assert empty == ([],)
    assert got[0][1] == ([b"0", b"1"],)


def test_raise_policy_names_shard_and_key(fake: SimpleNamespace) -> None:
    ds = fake.make_dataset([5], corrupt=lambda s, p: p == 3, shuffle=False)
    stream = BatchStream(ds, 2, rank=0, world_size=1, io_threads=2)
    with pytest.raises(
        WorkerError, match=r"shard-000000\.fake.*position 3|position 3.*shard-000000"
    ):
        list(stream)


def _explode(sample: dict[str, Any]) -> dict[str, Any]:
    if sample["__key__"].endswith("2"):
        raise ValueError("cannot decode this")
    return sample


def test_decode_errors_follow_policy(fake: SimpleNamespace) -> None:
    ds = fake.make_dataset([5], decode=_explode, shuffle=False)
    with pytest.raises(WorkerError, match=r"s000/k00002.*cannot decode this"):
        list(BatchStream(ds, 5, rank=0, world_size=1))
    ds = fake.make_dataset([5], decode=_explode, shuffle=False, on_error="skip")
    ((meta, keys),) = BatchStream(
        ds, 5, rank=0, world_size=1, with_meta=True, collate_fn=fake.keys_collate
    )
    assert meta.skipped == 1
    assert len(keys) == 4


def test_transform_errors_always_raise(fake: SimpleNamespace) -> None:
    ds = fake.make_dataset([3], transform={"cls": int}, on_error="skip", shuffle=False)
    assert next(iter(BatchStream(ds, 3, rank=0, world_size=1)))["cls"].tolist() == [0, 1, 2]
    ds = fake.make_dataset([3], transform=_explode, on_error="skip", shuffle=False)
    with pytest.raises(WorkerError, match="transform failed"):
        list(BatchStream(ds, 3, rank=0, world_size=1))


def _corrupt_in_transform(sample: dict[str, Any]) -> dict[str, Any]:
    if sample["__key__"].endswith("1"):
        raise CorruptDataError("bad JPEG data", url="memory://x/s.fake", key=sample["__key__"])
    return sample


def test_corrupt_data_found_by_a_transform_follows_policy(fake: SimpleNamespace) -> None:
    ds = fake.make_dataset([4], transform=_corrupt_in_transform, shuffle=False)
    with pytest.raises(WorkerError, match=r"transform failed.*bad JPEG data"):
        list(BatchStream(ds, 4, rank=0, world_size=1))
    ds = fake.make_dataset([4], transform=_corrupt_in_transform, shuffle=False, on_error="skip")
    ((meta, keys),) = BatchStream(
        ds, 4, rank=0, world_size=1, with_meta=True, collate_fn=fake.keys_collate
    )
    assert meta.skipped == 1
    assert keys == [fake.key_of(0, p) for p in (0, 2, 3)]


def test_map_style_dataset(fake: SimpleNamespace) -> None:
    ds = fake.make_dataset([3, 0, 2], fields=("__key__", "cls"))
    assert len(ds) == 5
    assert ds[0] == (fake.key_of(0, 0), b"0")
    assert ds[3] == (fake.key_of(2, 0), b"2000")
    assert ds[-1] == (fake.key_of(2, 1), b"2001")
    with pytest.raises(IndexError):
        ds[5]
    skip = fake.make_dataset([3], corrupt=lambda s, p: p == 1, on_error="skip")
    assert skip[1] is None


def test_batches_rejects_bad_options(fake: SimpleNamespace) -> None:
    ds = fake.make_dataset([3])
    with pytest.raises(InvalidArgumentError):
        BatchStream(ds, 0)
    with pytest.raises(InvalidArgumentError):
        BatchStream(ds, 2, rank=2, world_size=2)
    with pytest.raises(InvalidArgumentError):
        BatchStream(ds, 2, io_threads=-1)


@pytest.mark.parametrize("io_threads", [0, 3])
def test_progress_records_each_read_where_it_happens(
    fake: SimpleNamespace, io_threads: int
) -> None:
    """A worker that dies inside a read (SIGBUS from a shard truncated while mapped) must be
    reported with the sample being read: reads run ahead of decoding (between batches, or in the
    reader threads), so the record of the sample being decoded names another one."""
    ds = fake.make_dataset([7, 9], shuffle=False)
    stream = BatchStream(ds, 3, rank=0, world_size=1, io_threads=io_threads, prefetch_batches=1)
    stream.track_progress(1)
    seen_reads: list[tuple[int, int, set[tuple[int, int]]]] = []  # (shard, pos, reads recorded)
    seen_decodes: list[tuple[int, int]] = []  # (dataset index of the sample, index recorded)
    read_raw = ds.read_raw

    def recording_read(shard: int, pos: int, *, views: bool = False) -> dict[str, Any] | None:
        seen_reads.append((shard, pos, set(stream.progress()[0].reads)))
        return read_raw(shard, pos, views=views)

    def recording_decode(raw: dict[str, Any]) -> dict[str, Any]:
        seen_decodes.append((raw["__rng_seed__"][2], stream.progress()[0].index))
        return raw

    ds.read_raw = recording_read  # type: ignore[method-assign]
    ds.decode = recording_decode
    batches = list(stream.generate())
    assert [k for b in batches for k in b["__key__"]] == fake.all_keys([7, 9])
    assert len(seen_reads) == 16
    for shard, pos, reads in seen_reads:
        index = shard * 7 + pos
        assert (index // 3, index) in reads  # (global step, dataset index) of this very read
    assert seen_decodes == [(i, i) for i in range(16)]
    # Afterwards nothing is in progress.
    progress = stream.progress()[0]
    assert (progress.index, progress.reads) == (-1, ())
