"""A loader's state costs O(1) after the dataset is opened: the shard list is hashed once."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import fastload.loader as fl


class _CountingShards(list):  # type: ignore[type-arg]
    """The manifest's shard list, counting how often it is walked."""

    walks = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        type(self).walks += 1
        return super().__iter__()


def test_state_dict_and_load_state_dict_do_not_rehash_the_shard_list(
    fake: SimpleNamespace,
) -> None:
    ds = fake.make_dataset([5, 6, 7], seed=3)
    ds.manifest.shards = _CountingShards(ds.manifest.shards)
    _CountingShards.walks = 0
    loader = fl.DataLoader(ds, batch_size=2, collate_fn=fake.keys_collate)
    first = loader.state_dict()
    walks = _CountingShards.walks
    assert walks <= 1  # the fingerprint, computed once
    for _ in range(50):
        state = loader.state_dict()
        loader.load_state_dict(state)
    assert state == first
    assert _CountingShards.walks == walks
    # Copies and pickles (DataLoader workers) carry the fingerprint, not a recomputation.
    assert ds.replace(seed=9).fingerprint == ds.fingerprint
    assert _CountingShards.walks == walks
    copy = pickle.loads(pickle.dumps(ds))  # pickling walks the list once, to copy it
    walks = _CountingShards.walks
    assert copy.fingerprint == ds.fingerprint
    assert _CountingShards.walks == walks
