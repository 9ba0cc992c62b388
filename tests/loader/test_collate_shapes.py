"""Images of different sizes under the default collation (issue 33): a typed error that names the
field, two of the shapes with their sample keys and the ways out, instead of torch's "Trying to
resize storage that is not resizable"; and both ways out work."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import fastload
from fastload.errors import BatchShapeError, FastloadError
from fastload.loader import default_collate
from fastload.loader.transforms import ImageTrainTransform

pytestmark = pytest.mark.timeout(120)

#: (height, width) of the images: every batch of 4 holds at least two sizes.
SIZES = [(40, 48), (40, 48), (32, 56), (48, 40), (40, 48), (36, 36), (40, 48), (52, 44)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An image folder of 16 real JPEGs of several sizes, converted to WebDataset shards."""
    base = tmp_path_factory.mktemp("shapes")
    rng = np.random.default_rng(0)
    for i in range(16):
        h, w = SIZES[i % len(SIZES)]
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        folder = base / "images" / f"c{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
        (folder / f"img{i:02d}.jpg").write_bytes(buf.getvalue())
    root = base / "ds"
    fastload.convert(
        base / "images", root, format="webdataset", shard_samples=8, workers=1, quiet=True
    )
    return root


KEY = re.compile(r"sample '(c\d/img\d\d)'")
SHAPE = re.compile(r"\((\d+), (\d+), 3\)")


@pytest.mark.parametrize("fields", [None, ("jpg", "cls")])
def test_images_of_different_sizes_raise_a_typed_error_naming_field_shapes_and_fixes(
    dataset: Path, fields: tuple[str, ...] | None
) -> None:
    ds = fastload.open_dataset(dataset, decode="rgb8", fields=fields, shuffle=False)
    loader = fastload.DataLoader(ds, batch_size=4, num_workers=2)
    with pytest.raises(BatchShapeError) as raised:
        for _ in loader:
            pass
    err = raised.value
    assert isinstance(err, ValueError)
    assert isinstance(err, FastloadError)
    text = str(err)
    assert "resize storage" not in text  # torch's words are gone, also from the traceback
    assert "field 'jpg'" in text
    assert "ImageTrainTransform" in text
    assert "collate_fn=list" in text
    # Two different shapes, each with the key of a sample that has it.
    shapes = [(int(h), int(w)) for h, w in SHAPE.findall(text)[:2]]
    assert len(shapes) == 2
    assert shapes[0] != shapes[1]
    keys = KEY.findall(text)[:2]
    assert len(keys) == 2
    for key, shape in zip(keys, shapes):
        index = int(key[-2:])
        assert SIZES[index % len(SIZES)] == shape, (key, shape)
    assert "worker" in text  # where: the rank, worker and step
    # In the main process (no workers) the error keeps its attributes.
    with pytest.raises(BatchShapeError) as here:
        for _ in fastload.DataLoader(ds, batch_size=4, num_workers=0):
            pass
    assert here.value.field == "jpg"
    assert here.value.shapes[0] != here.value.shapes[1]
    assert all(k is not None and k.startswith("c") for k in here.value.keys)


def test_the_two_ways_out_work(dataset: Path) -> None:
    as_lists = fastload.DataLoader(
        fastload.open_dataset(dataset, decode="rgb8", fields=("jpg", "cls"), shuffle=False),
        batch_size=4,
        num_workers=2,
        collate_fn=list,
    )
    shapes = [tuple(img.shape[:2]) for batch in as_lists for img, _ in batch]
    assert sorted(shapes) == sorted(SIZES[i % len(SIZES)] for i in range(16))
    resized = fastload.DataLoader(
        fastload.open_dataset(
            dataset,
            decode="rgb8",
            fields=("jpg", "cls"),
            transform={"jpg": ImageTrainTransform(24)},
            shuffle=False,
        ),
        batch_size=4,
        num_workers=2,
    )
    batches = list(resized)
    assert [tuple(images.shape) for images, _ in batches] == [(4, 3, 24, 24)] * 4


def test_default_collate_names_the_field_in_dicts_and_tuples() -> None:
    dicts = [{"__key__": f"k{i}", "x": torch.zeros(2, 3 + (i == 3)), "y": i} for i in range(5)]
    with pytest.raises(
        BatchShapeError, match=r"field 'x'.*\(2, 3\) \(sample 'k0'\).*\(2, 4\) \(sample 'k3'\)"
    ):
        default_collate(dicts)
    arrays = [(np.zeros((2, 2 + (i % 2)), np.float32), i) for i in range(4)]
    with pytest.raises(BatchShapeError) as raised:
        default_collate(arrays, keys=["a", "b", "c", "d"], fields=("npy", "cls"))
    assert raised.value.field == "npy"
    assert raised.value.shapes == ((2, 2), (2, 3))
    assert raised.value.keys == ("a", "b")
    with pytest.raises(BatchShapeError, match=r"field '\[0\]'.*sample 0 of the batch"):
        default_collate(arrays)
    nested = [{"img": {"data": torch.zeros(1 + i)}} for i in range(2)]
    with pytest.raises(BatchShapeError, match=r"field 'img\.data'"):
        default_collate(nested)


def test_equal_shapes_still_stack_and_other_errors_pass_through() -> None:
    same = [{"x": torch.full((2, 3), i), "y": i} for i in range(4)]
    batch = default_collate(same)
    assert batch["x"].shape == (4, 2, 3)
    assert batch["x"][:, 0, 0].tolist() == [0, 1, 2, 3]
    mixed = [torch.zeros(2, dtype=torch.float32), torch.zeros(2, dtype=torch.int64)]
    out = default_collate(mixed)  # torch promotes rather than fails: no shape error invented
    assert out.shape == (2, 2)
