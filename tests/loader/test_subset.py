"""``open_dataset(..., subset=...)``: a range of the dataset order, read, shuffled, partitioned
and resumed as a dataset of its own."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

import fastload.loader as fl
from fastload.errors import InvalidArgumentError
from fastload.loader._subset import parse_subset
from fastload.storage import ByteRange, WrapperStore
from fastload.testing.resume import Layout, check_resume

pytestmark = [pytest.mark.timeout(300)]
SIZES = [7, 5, 11]  # 23 samples; shard 1 holds dataset samples 7..11


@pytest.mark.parametrize(
    ("spec", "expected"),
    [(None, None), (0.1, (0, 2)), (1.0, (0, 23)), ((0.5, 1.0), (12, 23)), ((3, 10), (3, 10)),
     (range(3, 10), (3, 10))],
)  # fmt: skip
def test_specs(spec: Any, expected: tuple[int, int] | None) -> None:
    assert parse_subset(spec, 23) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [((0.5, 3), "mixes ints and fractions"), (1.5, r"in \[0, 1\], got 1.5"),
     ((5, 5), r"samples \[5, 5\) of a dataset of 23"), ((0, 24), "within"),
     (range(0, 10, 2), "step 1"), ("0:10", "must be a fraction"), ((1, 2, 3), "must be")],
)  # fmt: skip
def test_bad_specs(spec: Any, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        parse_subset(spec, 23)


class Recording(WrapperStore):
    """Remembers the keys read."""

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        self.keys: set[str] = set()

    def get(self, key: str, byte_range: ByteRange | None = None) -> bytes:
        self.keys.add(key)
        return super().get(key, byte_range)


@pytest.mark.parametrize("workers", [0, 2])
def test_the_subset_is_delivered_once_and_only_it_is_read(
    fake: SimpleNamespace, workers: int
) -> None:
    store = Recording(fake.build_store(SIZES))
    ds = fl.open_dataset(store, subset=(3, 10), seed=5, block_size=2, window=2)
    assert len(ds) == 7
    assert ds.shard_sizes.tolist() == [4, 3, 0]
    expected = fake.all_keys(SIZES)[3:10]
    assert [ds[i]["__key__"] for i in range(7)] == expected  # map-style: in dataset order
    loader = fl.DataLoader(ds, batch_size=2, num_workers=workers, collate_fn=fake.keys_collate)
    keys = [k for batch in loader for k in batch]
    assert sorted(keys) == sorted(expected)
    assert keys != expected  # shuffled, within the subset
    if workers == 0:  # the recording is this process's
        assert any("shard-000001" in k for k in store.keys), sorted(store.keys)
        assert not any("shard-000002" in k for k in store.keys), sorted(store.keys)


def test_resumes_exactly_within_the_subset(fake: SimpleNamespace) -> None:
    ds = fake.make_dataset(SIZES, seed=4, block_size=3, window=2, subset=(0.25, 0.9))
    assert len(ds) == 21 - 6  # samples [6, 21)

    def make(*, world_size: int, rank: int, batch_size: int, num_workers: int) -> fl.DataLoader:
        return fl.DataLoader(
            ds, batch_size=batch_size, rank=rank, world_size=world_size,
            num_workers=num_workers, collate_fn=fake.keys_collate,
        )  # fmt: skip

    check_resume(
        make,
        global_batch_size=4,
        sample_ids=list,
        layouts=[Layout(2), Layout(1, num_workers=2), Layout(4)],
        expected=fake.all_keys(SIZES)[6:21],
    )


def test_a_state_of_one_subset_is_refused_by_another(fake: SimpleNamespace) -> None:
    store = fake.build_store(SIZES)
    first = fl.DataLoader(fl.open_dataset(store, subset=(0, 8)), batch_size=2)
    it = iter(first)
    next(it)
    state = first.state_dict()
    assert state["subset"] == [0, 8]
    other = fl.DataLoader(fl.open_dataset(store, subset=(8, 16)), batch_size=2)
    with pytest.raises(InvalidArgumentError, match=r"subset=\[0, 8\] but this dataset has"):
        other.load_state_dict(state)
    same = fl.DataLoader(fl.open_dataset(store, subset=(0, 8)), batch_size=2)
    same.load_state_dict(state)  # the same subset resumes
    assert len(list(same)) == 3


@pytest.mark.parametrize("fmt", ["webdataset", "tfrecord", "lmdb", "fakeseq"])
def test_real_and_sequential_readers_start_at_the_cut(
    fake: SimpleNamespace, tmp_path: Any, fmt: str
) -> None:
    if fmt == "fakeseq":  # a reader without random access: read on from the cut
        ds = fl.open_dataset(fake.build_store(SIZES, fmt=fmt), subset=(5, 19), shuffle=False)
    else:
        root = fake.build_format_dataset(str(tmp_path / fmt), SIZES, fmt)
        ds = fl.open_dataset(root, subset=(5, 19), shuffle=False)
    loader = fl.DataLoader(ds, batch_size=4, collate_fn=fake.keys_collate)
    assert [k for batch in loader for k in batch] == fake.all_keys(SIZES)[5:19]


def _delivered(fake: SimpleNamespace, ds: fl.Dataset, workers: int = 0) -> list[str]:
    loader = fl.DataLoader(ds, batch_size=3, num_workers=workers, collate_fn=fake.keys_collate)
    return [k for batch in loader for k in batch]


def test_a_key_list_keeps_those_samples(fake: SimpleNamespace) -> None:
    wanted = [fake.key_of(0, 1), fake.key_of(1, 4), fake.key_of(2, 0), fake.key_of(2, 10)]
    ds = fake.make_dataset(SIZES, subset=set(wanted), seed=1)
    assert len(ds) == 23  # the keys are learnt by reading: the order is the whole dataset's
    loader = fl.DataLoader(ds, batch_size=3, num_workers=2, collate_fn=fake.keys_collate)
    assert sorted(k for batch in loader for k in batch) == sorted(wanted)
    assert loader.stats()["filtered"] == 23 - 4
    assert ds[1] is not None
    assert ds[0] is None


def test_the_key_hash_split_is_disjoint_covering_and_stable(fake: SimpleNamespace) -> None:
    import hashlib

    store = fake.build_store(SIZES)
    train = _delivered(fake, fl.open_dataset(store, split=(0.0, 0.7)), workers=2)
    val = _delivered(fake, fl.open_dataset(store, split=(0.7, 1.0)))
    assert sorted(train + val) == sorted(fake.all_keys(SIZES))  # disjoint and covering
    assert 0 < len(val) < len(train)
    # The hash is BLAKE2b's first 8 bytes of the UTF-8 key, big-endian, over 2**64: the same
    # on every machine, so a key's split can be computed outside fastload.
    for key in fake.all_keys(SIZES):
        h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") / 2**64
        assert (key in val) == (h >= 0.7)
    state = fl.DataLoader(fl.open_dataset(store, split=(0.0, 0.7)), batch_size=2).state_dict()
    other = fl.DataLoader(fl.open_dataset(store, split=(0.7, 1.0)), batch_size=2)
    with pytest.raises(InvalidArgumentError, match=r"split=\[0.0, 0.7\]"):
        other.load_state_dict(state)


@pytest.mark.parametrize("split", [(0.5, 0.5), (0.2, 1.5), (-0.1, 0.5), (0.1,), "train", (True, 1)])
def test_bad_splits(fake: SimpleNamespace, split: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="split must be"):
        fake.make_dataset(SIZES, split=split)
