"""Meeting webdataset users where they are: webdataset's field decoders in ``Decoder``, ``wds``
pipelines on a fastload source (``fastload.wds``), and ``open_dataset`` on shard URL patterns.
Every comparison runs the real webdataset library."""

from __future__ import annotations

import gzip
import io
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

import fastload
import fastload.wds
from fastload.errors import (
    InvalidArgumentError,
    MissingDependencyError,
    ObjectNotFoundError,
    UnsafeDataError,
)
from fastload.formats import get_format
from fastload.formats.webdataset import WebDatasetReader, WebDatasetWriter, build_index
from fastload.loader.decode import Decoder
from fastload.storage import LocalStore, MemoryStore
from fastload.testing.resume import Layout, check_resume

# ---- decoding the webdataset ecosystem's extensions -----------------------------------------


def _png(value: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((4, 5, 3), value, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _ecosystem_shard(path: Path) -> None:
    """One shard written by webdataset's TarWriter with its own encoders per extension."""
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    with wds.TarWriter(str(path)) as writer:
        writer.write(
            {
                "__key__": "s0",
                "ten": [arr, arr * 2],
                "mp": {"a": [1, 2]},
                "msg": {"b": "c"},
                "npz": {"x": arr, "y": np.arange(3)},
                "jsn": {"j": 1},
                "inx": 7,
                "npy": arr,
                "cls": 3,
                "txt": "héllo",
                "json.gz": {"z": [3]},  # TarWriter encodes as JSON, then gzips
            }
        )


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b)) and np.asarray(a).dtype == np.asarray(b).dtype
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def test_decoder_decodes_the_ecosystem_extensions_like_webdataset(tmp_path: Path) -> None:
    _ecosystem_shard(tmp_path / "e.tar")
    (ref,) = list(wds.WebDataset([str(tmp_path / "e.tar")], shardshuffle=False).decode())
    (raw,) = list(WebDatasetReader(LocalStore(str(tmp_path)), "e.tar"))
    ours = Decoder()(raw)
    fields = ["ten", "mp", "msg", "npz", "jsn", "inx", "npy", "cls", "txt", "json.gz"]
    assert sorted(k for k in ours if not k.startswith("__")) == sorted(fields)
    for name in fields:
        assert _equal(ours[name], ref[name]), name
    assert ours["json.gz"] == {"z": [3]}
    assert ours["inx"] == 7
    assert len(ours["ten"]) == 2


@pytest.mark.parametrize("ext", ["pyd", "pickle", "pkl", "pth"])
def test_pickled_extensions_are_refused_unless_allowed(ext: str) -> None:
    value = {"p": [1, 2]}
    if ext == "pth":
        buf = io.BytesIO()
        torch.save(value, buf)
        data = buf.getvalue()
    else:
        data = pickle.dumps(value)
    sample = {"__key__": "k1", "__url__": "file:///d/s.tar", ext: data}
    with pytest.raises(UnsafeDataError, match="allow_pickle") as info:
        Decoder()(sample)
    assert info.value.url == "file:///d/s.tar"
    assert info.value.key == "k1"
    assert Decoder(allow_pickle=True)(sample)[ext] == value


def test_cbor_needs_its_package() -> None:
    try:
        import cbor  # noqa: F401
    except ImportError:
        with pytest.raises(MissingDependencyError, match="pip install cbor"):
            Decoder()({"__key__": "k", "cbor": b"\xa0"})
        assert Decoder(extra={"cbor": bytes})({"__key__": "k", "cbor": b"\xa0"})["cbor"] == b"\xa0"
    else:
        assert Decoder()({"__key__": "k", "cbor": b"\xa0"})["cbor"] == {}


# ---- a small dataset of webdataset shards --------------------------------------------------


def _shards(root: Path, counts: tuple[int, ...] = (7, 6, 5)) -> list[str]:
    """Shards ``s-00000N.tar`` written by webdataset's TarWriter; returns the keys in order."""
    keys = []
    for n, count in enumerate(counts):
        with wds.TarWriter(str(root / f"s-{n:06d}.tar")) as writer:
            for i in range(count):
                key = f"n{n}i{i:02d}"
                writer.write({"__key__": key, "png": _png(n * 16 + i), "cls": n * 100 + i})
                keys.append(key)
    return keys


def mean_and_label(sample: tuple[np.ndarray, int]) -> tuple[float, int]:
    image, label = sample
    return float(image.mean()), label


def _stages(pipeline: Any, batch: int = 4) -> Any:
    """The user's stages, identical on both sources."""
    return pipeline.decode("rgb8").to_tuple("png", "cls").map(mean_and_label).batched(batch)


def _plain(batches: list[Any]) -> list[tuple[list[float], list[int]]]:
    return [([float(x) for x in b[0]], [int(x) for x in b[1]]) for b in batches]


def test_same_stages_give_the_same_batches_as_webdataset(tmp_path: Path) -> None:
    _shards(tmp_path)
    pattern = str(tmp_path / "s-{000000..000002}.tar")
    ref = list(_stages(wds.WebDataset(pattern, shardshuffle=False)))
    ours = list(_stages(fastload.wds.WebDataset(pattern, shuffle=False)))
    assert len(ref) == 5  # 18 samples in batches of 4
    assert _plain(ours) == _plain(ref)
    assert [len(b[1]) for b in ours] == [4, 4, 4, 4, 2]


def _keys_pipeline(source: Any, batch_size: int | None = None, per_batch: int = 4) -> Any:
    pipe = fastload.wds.WebDataset(source, seed=3, batch_size=batch_size)
    return pipe.decode("rgb8").to_tuple("__key__", "cls").batched(per_batch)


def test_exactly_once_over_two_workers_and_in_the_same_order_as_one(tmp_path: Path) -> None:
    keys = _shards(tmp_path)
    pattern = str(tmp_path / "s-{000000..000002}.tar")
    two = [list(b[0]) for b in fastload.wds.WebLoader(_keys_pipeline(pattern), num_workers=2)]
    flat = [k for b in two for k in b]
    assert sorted(flat) == sorted(keys)
    assert len(flat) == len(keys)
    assert flat != keys  # shuffled
    one = [list(b[0]) for b in fastload.wds.WebLoader(_keys_pipeline(pattern), num_workers=0)]
    assert one == two
    # A plain torch DataLoader over the pipeline is exactly-once too (order interleaved).
    loader = torch.utils.data.DataLoader(_keys_pipeline(pattern), batch_size=None, num_workers=2)
    assert sorted(k for b in loader for k in b[0]) == sorted(keys)


@pytest.mark.parametrize(("batch_size", "per_batch", "taken"), [(4, 4, 2), (4, 2, 3)])
def test_resume_delivers_the_rest_exactly_once(
    tmp_path: Path, batch_size: int, per_batch: int, taken: int
) -> None:
    _shards(tmp_path)
    pattern = str(tmp_path / "s-{000000..000002}.tar")
    full = [
        list(b[0])
        for b in fastload.wds.WebLoader(
            _keys_pipeline(pattern, batch_size, per_batch), num_workers=2
        )
    ]
    loader = fastload.wds.WebLoader(_keys_pipeline(pattern, batch_size, per_batch), num_workers=2)
    loader.set_epoch(1)
    loader.set_epoch(0)
    head = []
    for batch in loader:
        head.append(list(batch[0]))
        if len(head) == taken:
            break
    state = loader.state_dict()
    assert (state["epoch"], state["step"]) == (0, (taken * per_batch - 1) // batch_size)
    resumed = fastload.wds.WebLoader(_keys_pipeline(pattern, batch_size, per_batch), num_workers=1)
    resumed.load_state_dict(state)
    resumed.set_epoch(0)  # the saved epoch: the resume is kept
    tail = [list(b[0]) for b in resumed]
    assert head + tail == full
    assert resumed.state_dict()["step"] == 5  # ceil(18 / 4) chunks: the epoch is done


def test_pipeline_options_that_would_break_exactly_once_are_refused(tmp_path: Path) -> None:
    _shards(tmp_path)
    pattern = str(tmp_path / "s-{000000..000002}.tar")
    pipe = fastload.wds.WebDataset(pattern, batch_size=4)
    with pytest.raises(InvalidArgumentError, match="with_epoch"):
        pipe.with_epoch(100)
    with pytest.raises(InvalidArgumentError, match="batch_size=8"):
        pipe.batched(8)
    other = fastload.wds.WebLoader(fastload.wds.WebDataset(pattern, batch_size=2))
    with pytest.raises(InvalidArgumentError, match="batch_size"):
        other.load_state_dict(fastload.wds.WebLoader(pipe).state_dict())


# ---- open_dataset on shard URL patterns -----------------------------------------------------


def test_open_dataset_on_a_brace_pattern_indexes_in_memory(tmp_path: Path) -> None:
    keys = _shards(tmp_path, (5, 4, 6))
    store = LocalStore(str(tmp_path))
    store.put("s-000000.tar.idx", build_index(store, "s-000000.tar"))  # one shard has an index
    compressed = tmp_path / "c-000000.tar.gz"
    compressed.write_bytes(gzip.compress((tmp_path / "s-000002.tar").read_bytes()))
    before = sorted(os.listdir(tmp_path))
    urls = [str(tmp_path / "s-{000000..000001}.tar"), str(compressed)]
    ds = fastload.open_dataset(urls, fields=("__key__",), shuffle=False)
    assert sorted(os.listdir(tmp_path)) == before  # nothing written
    entries = ds.manifest.shards
    assert [(e.name, e.num_samples, e.index) for e in entries] == [
        ("s-000000.tar", 5, "s-000000.tar.idx"),
        ("s-000001.tar", 4, "s-000001.tar.idx"),  # built in memory
        ("c-000000.tar.gz", 6, None),
    ]
    assert [e.num_bytes for e in entries] == [(tmp_path / e.name).stat().st_size for e in entries]
    assert ds.manifest.schema == {
        "cls": {"count": 15, "type": "int"},
        "png": {"count": 15, "type": "image"},
    }
    assert [ds[i][0] for i in range(len(ds))] == keys  # the last shard's keys, compressed
    shuffled = fastload.open_dataset(urls, fields=("__key__",))
    got = [
        k for (batch,) in fastload.DataLoader(shuffled, batch_size=4, num_workers=2) for k in batch
    ]
    assert sorted(got) == sorted(keys)
    assert len(got) == len(keys)


def test_open_dataset_on_patterns_of_a_non_local_store() -> None:
    store = MemoryStore("wds-brace-bucket")
    for n in range(3):
        local = MemoryStore(f"wds-brace-tmp-{n}")
        with WebDatasetWriter(local, "x.tar", index=False) as writer:
            for i in range(3):
                writer.write({"__key__": f"m{n}{i}", "cls": i})
        store.put(f"t-{n}.tar", local.get("x.tar"))
    ds = fastload.open_dataset("memory://wds-brace-bucket/t-{0..2}.tar", shuffle=False)
    assert len(ds) == 9
    assert [ds[i]["__key__"] for i in range(9)] == [f"m{n}{i}" for n in range(3) for i in range(3)]
    with pytest.raises(ObjectNotFoundError, match="check the brace range") as info:
        fastload.open_dataset("memory://wds-brace-bucket/t-{0..3}.tar")
    assert info.value.url == "memory://wds-brace-bucket/t-3.tar"
    with pytest.raises(InvalidArgumentError, match="appears twice"):
        fastload.open_dataset("memory://wds-brace-bucket/t-{0,1,0}.tar")
    with pytest.raises(InvalidArgumentError, match="do not share"):
        fastload.open_dataset(["memory://a/t.tar", "file:///b/t.tar"])


def test_open_dataset_on_tfrecord_urls_builds_their_indexes_in_memory(tmp_path: Path) -> None:
    store = LocalStore(str(tmp_path))
    tfrecord = get_format("tfrecord")
    for n in range(2):
        with tfrecord.writer(store, f"r-{n}.tfrecord", index=False) as writer:
            for i in range(3 + n):
                writer.write({"__key__": f"r{n}{i}", "cls": i})
    ds = fastload.open_dataset(str(tmp_path / "r-{0..1}.tfrecord"), fields=("__key__",))
    assert [(e.num_samples, e.index) for e in ds.manifest.shards] == [
        (3, "r-0.tfrecord.idx"),
        (4, "r-1.tfrecord.idx"),
    ]
    assert not (tmp_path / "r-0.tfrecord.idx").exists()
    got = [k for (batch,) in fastload.DataLoader(ds, batch_size=2, num_workers=2) for k in batch]
    assert sorted(got) == ["r00", "r01", "r02", "r10", "r11", "r12", "r13"]


@pytest.mark.parametrize(("batch_size", "per_batch"), [(4, 4), (4, 2)])
def test_webloader_passes_the_resume_checker(
    tmp_path: Path, batch_size: int, per_batch: int
) -> None:
    """Resume after every output (several per step with per_batch < batch_size), with another
    number of workers; the WebLoader promises no other world size (its stages run per chunk)."""
    keys = _shards(tmp_path)
    pattern = str(tmp_path / "s-{000000..000002}.tar")

    def make(*, world_size: int, rank: int, batch_size: int, num_workers: int) -> Any:
        pipe = fastload.wds.WebDataset(
            pattern, seed=3, batch_size=batch_size, rank=rank, world_size=world_size
        )
        pipe = pipe.to_tuple("__key__", "cls").batched(per_batch)
        return fastload.wds.WebLoader(pipe, num_workers=num_workers)

    report = check_resume(
        make,
        global_batch_size=2 * batch_size,
        sample_ids=lambda output: list(output[0]),
        layouts=[Layout(2), Layout(2, num_workers=2)],
        expected=keys,
        epochs=(0, 1),
        stop_checks=1,
    )
    assert report.steps[0] == -(-len(keys) // (2 * per_batch))
