"""PackedBytes, default_collate of byte fields, and reuse of the workers' shared-memory blocks."""

from __future__ import annotations

import gc
import os
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fastload.loader as fl
from fastload.errors import InvalidArgumentError
from fastload.loader import BatchStream, PackedBytes, default_collate, pack_bytes
from fastload.loader._collate import empty_like_batch
from fastload.loader._shm_pool import POOL_MIN_BYTES

ITEMS = [b"abc", b"", b"\x00\xff" * 5, bytearray(b"xyz"), memoryview(b"hello world")[6:]]
EXPECT = [b"abc", b"", b"\x00\xff" * 5, b"xyz", b"world"]


def test_pack_round_trip_and_sequence_behaviour() -> None:
    pb = PackedBytes.pack(ITEMS)
    assert len(pb) == 5
    assert pb.tolist() == EXPECT
    assert list(pb) == EXPECT
    assert [pb[i] for i in range(5)] == EXPECT
    assert all(type(x) is bytes for x in pb)
    assert pb[-1] == b"world"
    assert pb[-5] == b"abc"
    assert pb[1:4] == EXPECT[1:4]
    assert pb[::-2] == EXPECT[::-2]
    assert pb == EXPECT
    assert pb != EXPECT[:4]
    assert pb != [*EXPECT[:4], b"worle"]
    assert pb == PackedBytes.pack(EXPECT)
    assert pb.sizes() == [3, 0, 10, 3, 5]
    assert pb.nbytes == 21
    assert pb.offsets.tolist() == [0, 3, 3, 13, 16, 21]
    assert bytes(pb.data.numpy()) == b"".join(EXPECT)
    assert bytes(pb.view(4)) == b"world"
    assert pb.tensor(0).tolist() == list(b"abc")
    assert "n=5" in repr(pb)
    with pytest.raises(IndexError):
        pb[5]
    with pytest.raises(IndexError):
        pb[-6]
    with pytest.raises(TypeError):
        pb["0"]  # type: ignore[call-overload]


def test_view_is_zero_copy_and_pickle_copies_the_buffer() -> None:
    pb = pack_bytes([b"aa", b"bbb"])
    pb.view(1)[0] = ord("B")
    assert pb[1] == b"Bbb"
    back = pickle.loads(pickle.dumps(pb))
    assert isinstance(back, PackedBytes)
    assert back == [b"aa", b"Bbb"]


def test_memoryview_of_wider_items_is_packed_as_its_bytes() -> None:
    arr = np.arange(4, dtype=np.int32)
    pb = pack_bytes([memoryview(arr)])
    assert pb[0] == arr.tobytes()


def test_empty_and_invalid() -> None:
    e = PackedBytes.empty()
    assert len(e) == 0
    assert e.tolist() == []
    assert e.nbytes == 0
    assert pack_bytes([]) == []
    with pytest.raises(InvalidArgumentError):
        PackedBytes(torch.zeros(4, dtype=torch.uint8), 1)
    with pytest.raises(InvalidArgumentError):
        PackedBytes(torch.zeros(16, dtype=torch.int64), 1)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=40))
def test_pack_hypothesis(items: list[bytes]) -> None:
    pb = pack_bytes(items)
    assert pb.tolist() == items
    assert pb.sizes() == [len(x) for x in items]
    assert pickle.loads(pickle.dumps(pb)).tolist() == items


def test_default_collate_packs_byte_fields() -> None:
    batch = default_collate([(b"a", 1, "k1"), (b"bc", 2, "k2")])
    assert isinstance(batch[0], PackedBytes)
    assert batch[0] == [b"a", b"bc"]
    assert batch[1].tolist() == [1, 2]
    assert batch[2] == ["k1", "k2"]  # str stays a list
    d = default_collate([{"jpg": b"x"}, {"jpg": b"yz"}])
    assert d["jpg"].tolist() == [b"x", b"yz"]
    mixed = default_collate([b"a", None])
    assert mixed == [b"a", None]
    assert isinstance(mixed, list)
    empty = empty_like_batch(batch)
    assert isinstance(empty[0], PackedBytes)
    assert len(empty[0]) == 0


# ---- through worker processes -----------------------------------------------------------------

PAYLOAD = 40_000  # x batch 8 >= POOL_MIN_BYTES: batches use the pooled blocks


def _inode(t: torch.Tensor) -> int:
    return os.fstat(t.untyped_storage()._share_fd_cpu_()[0]).st_ino


def _expected_payload(key: str) -> bytes:
    return bytes([int(key[-5:]) % 256]) * PAYLOAD


@pytest.mark.timeout(120)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_reused_blocks_never_change_held_batches(
    fake: SimpleNamespace, tmp_path: Path, context: str
) -> None:
    assert 8 * PAYLOAD >= POOL_MIN_BYTES
    sizes = [40, 23, 17]
    root = fake.build_format_dataset(str(tmp_path / "ds"), sizes, "webdataset", payload=PAYLOAD)
    ds = fl.open_dataset(root, seed=3, fields=("__key__", "bin"))
    loader = fl.DataLoader(
        ds,
        batch_size=8,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context=context,
    )
    held: list[tuple[list[str], Any, memoryview, torch.Tensor, np.ndarray]] = []
    inodes: set[int] = set()
    batches = 0
    for epoch in range(3):
        loader.set_epoch(epoch)
        keys_seen = []
        for i, (keys, payload) in enumerate(loader):
            assert isinstance(payload, PackedBytes)
            assert payload == [_expected_payload(k) for k in keys]
            inodes.add(_inode(payload.buffer))
            batches += 1
            keys_seen += keys
            if i in (1, 4):  # keep views of a few batches alive across later batches
                held.append(
                    (keys, payload, payload.view(0), payload.tensor(1), payload.data.numpy())
                )
            del payload
            gc.collect()
        assert sorted(keys_seen) == sorted(fake.all_keys(sizes))
    # Blocks were reused (far fewer distinct buffers than batches) ...
    assert len(inodes) < batches // 2
    # ... but never while a batch, a view or an array of it was alive.
    for keys, payload, view, tensor, array in held:
        assert payload == [_expected_payload(k) for k in keys]
        assert bytes(view) == _expected_payload(keys[0])
        assert bytes(tensor.numpy()) == _expected_payload(keys[1])
        assert bytes(array[:PAYLOAD]) == _expected_payload(keys[0])


def _as_tensor(sample: dict[str, Any]) -> dict[str, Any]:
    out = dict(sample)
    out["bin"] = torch.frombuffer(bytearray(sample["bin"]), dtype=torch.uint8).view(-1, 100)
    return out


@pytest.mark.timeout(120)
def test_stacked_tensors_use_reusable_blocks(fake: SimpleNamespace, tmp_path: Path) -> None:
    sizes = [30, 30]
    root = fake.build_format_dataset(str(tmp_path / "ds"), sizes, "webdataset", payload=PAYLOAD)
    ds = fl.open_dataset(root, seed=1, transform=_as_tensor, fields=("__key__", "bin"))
    loader = fl.DataLoader(ds, batch_size=8, num_workers=2, persistent_workers=True)
    first = None
    inodes = set()
    for epoch in range(3):
        loader.set_epoch(epoch)
        for keys, images in loader:
            assert images.shape == (len(keys), PAYLOAD // 100, 100)
            for k, img in zip(keys, images):
                assert bytes(img.flatten().numpy()) == _expected_payload(k)
            inodes.add(_inode(images))
            if first is None:
                first = (keys, images)
            del images
    assert first is not None
    assert len(inodes) < 12
    for k, img in zip(*first):
        assert bytes(img.flatten().numpy()) == _expected_payload(k)


@pytest.mark.timeout(120)
def test_pinned_loader_and_plain_torch_loader_get_packed_bytes(
    fake: SimpleNamespace, tmp_path: Path
) -> None:
    sizes = [9, 4]
    root = fake.build_format_dataset(str(tmp_path / "ds"), sizes, "webdataset", payload=PAYLOAD)
    ds = fl.open_dataset(root, seed=0, fields=("__key__", "bin"))
    got = []
    for keys, payload in fl.DataLoader(ds, batch_size=4, num_workers=2, pin_memory=True):
        assert payload == [_expected_payload(k) for k in keys]
        got += keys
    stream = BatchStream(ds, 4)
    for keys, payload in torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2):
        assert isinstance(payload, PackedBytes)
        assert payload == [_expected_payload(k) for k in keys]
        got += keys
    assert sorted(got) == sorted(fake.all_keys(sizes) * 2)


@pytest.mark.timeout(120)
def test_file_system_sharing_strategy_works_without_reuse(
    fake: SimpleNamespace, tmp_path: Path
) -> None:
    sizes = [12, 7]
    root = fake.build_format_dataset(str(tmp_path / "ds"), sizes, "webdataset", payload=PAYLOAD)
    ds = fl.open_dataset(root, seed=0, fields=("__key__", "bin"))
    old = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        got = []
        for keys, payload in fl.DataLoader(ds, batch_size=4, num_workers=2):
            assert payload == [_expected_payload(k) for k in keys]
            got += keys
    finally:
        torch.multiprocessing.set_sharing_strategy(old)
    assert sorted(got) == sorted(fake.all_keys(sizes))


@pytest.mark.timeout(120)
def test_pickled_loader_still_reuses_blocks(fake: SimpleNamespace, tmp_path: Path) -> None:
    sizes = [40, 40]
    root = fake.build_format_dataset(str(tmp_path / "ds"), sizes, "webdataset", payload=PAYLOAD)
    ds = fl.open_dataset(root, seed=2, fields=("__key__", "bin"))
    loader = fl.DataLoader(ds, batch_size=8, num_workers=2)
    next(iter(loader))
    clone = pickle.loads(pickle.dumps(loader))
    inodes = set()
    keys_seen = []
    for keys, payload in clone:
        assert payload == [_expected_payload(k) for k in keys]
        inodes.add(_inode(payload.buffer))
        keys_seen += keys
        del payload
    assert sorted(keys_seen) == sorted(fake.all_keys(sizes))
    assert len(inodes) < 10  # 10 batches: at least one block was reused


# ---- byte fields read as views of the mapped shards and copied once -------------------------


def _payload_dataset(root: Path, n: int) -> list[bytes]:
    """A local one-shard WebDataset of ``n`` samples of random ``jpg`` bytes and a ``cls``."""
    from fastload.formats import Manifest, ShardEntry, get_format, write_manifest
    from fastload.storage import LocalStore

    rng = np.random.default_rng(0)
    sizes = rng.integers(0, 20_000, n)
    payloads = [rng.integers(0, 256, int(k), dtype=np.uint8).tobytes() for k in sizes]
    store = LocalStore(str(root))
    fmt = get_format("webdataset")
    w = fmt.writer(store, f"s-000000.{fmt.extension}")
    for i, p in enumerate(payloads):
        w.write({"__key__": f"k{i:03d}", "jpg": p, "cls": i})
    write_manifest(store, Manifest(format=fmt.name, shards=[ShardEntry.from_info(w.close())]))
    return payloads


class _FieldTypes:
    """A transform that records the type of the ``jpg`` field it is given (picklable)."""

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        return {**sample, "jpg_type": type(sample["jpg"]).__name__}


@pytest.mark.parametrize("workers", [0, 2])
def test_byte_fields_packed_from_views_equal_the_bytes(tmp_path: Path, workers: int) -> None:
    """Decoder(image="bytes") + the default collation: the jpg fields are read as views of the
    mapped shard and copied once into the batch; the batch holds exactly the stored bytes."""
    from fastload.loader.decode import Decoder

    payloads = _payload_dataset(tmp_path / "ds", 40)
    ds = fl.open_dataset(
        str(tmp_path / "ds"), seed=3, decode=Decoder(image="bytes"), fields=("jpg", "cls")
    )
    assert ds.raw_views_ok()
    loader = fl.DataLoader(ds, batch_size=8, num_workers=workers)
    seen = {}
    for jpgs, labels in loader:
        assert isinstance(jpgs, PackedBytes)
        for data, label in zip(jpgs, labels.tolist(), strict=True):
            seen[label] = data
    assert seen == dict(enumerate(payloads))
    if workers == 0:  # (the workers' copies of the stream set it in their processes)
        assert loader._stream._reads.views  # the one-copy path was taken


def test_a_transform_sees_bytes_not_views(tmp_path: Path) -> None:
    """Views are only read where nothing but the default collation sees the fields."""
    from fastload.loader.decode import Decoder

    _payload_dataset(tmp_path / "ds", 10)
    ds = fl.open_dataset(
        str(tmp_path / "ds"), decode=Decoder(image="bytes"), transform=_FieldTypes()
    )
    assert not ds.raw_views_ok()
    batch = next(iter(fl.DataLoader(ds, batch_size=10)))
    assert set(batch["jpg_type"]) == {"bytes"}
    plain = fl.open_dataset(str(tmp_path / "ds"), decode=Decoder(image="bytes"))
    assert plain.raw_views_ok()
    # A collate_fn of the user's own sees copies too.
    own = fl.DataLoader(plain, batch_size=10, collate_fn=list)
    got = next(iter(own))
    assert {type(s["jpg"]) for s in got} == {bytes}
    assert not own._stream._reads.views
