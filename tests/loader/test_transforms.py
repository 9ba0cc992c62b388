"""Image transforms (fastload.loader.transforms): shapes, ranges, crop boxes, determinism."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from fastload.errors import CorruptDataError, InvalidArgumentError
from fastload.loader.transforms import (
    CenterCrop,
    Compose,
    ImageEvalTransform,
    ImageTrainTransform,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    center_crop_box,
    random_resized_crop_box,
    sample_rng,
)


def _photo(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A smooth, textured image (JPEG-friendly, like a photo)."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, size=(4, 5, 3), dtype=np.uint8)
    base = np.asarray(Image.fromarray(coarse).resize((w, h), Image.Resampling.BICUBIC), np.float32)
    yy, xx = np.mgrid[0:h, 0:w]
    base += 20 * np.sin(xx / 7.0)[..., None] + 15 * np.cos(yy / 11.0)[..., None]
    return base.clip(0, 255).astype(np.uint8)


def _jpeg(arr: np.ndarray, quality: int = 92) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


@pytest.fixture(scope="module")
def photo() -> np.ndarray:
    return _photo(375, 500)


@pytest.fixture(scope="module")
def photo_jpeg(photo: np.ndarray) -> bytes:
    return _jpeg(photo)


@settings(max_examples=300, deadline=None)
@given(
    h=st.integers(1, 4000),
    w=st.integers(1, 4000),
    seed=st.integers(0, 2**32),
    lo=st.floats(0.01, 1.0),
    r_lo=st.floats(0.2, 1.0),
    r_hi=st.floats(1.0, 5.0),
)
def test_crop_box_within_bounds(
    h: int, w: int, seed: int, lo: float, r_lo: float, r_hi: float
) -> None:
    top, left, ch, cw = random_resized_crop_box(
        h, w, np.random.default_rng(seed), (lo, 1.0), (r_lo, r_hi)
    )
    assert ch >= 1
    assert cw >= 1
    assert top >= 0
    assert top + ch <= h
    assert left >= 0
    assert left + cw <= w


@settings(max_examples=200, deadline=None)
@given(h=st.integers(1, 3000), w=st.integers(1, 3000), size=st.integers(1, 400))
def test_center_crop_box_within_bounds(h: int, w: int, size: int) -> None:
    for resize in (None, size, size + 32):
        top, left, ch, cw = center_crop_box(h, w, (size, size), resize)
        assert 1 <= ch <= h
        assert 1 <= cw <= w
        assert top >= 0
        assert top + ch <= h
        assert left >= 0
        assert left + cw <= w


def test_crop_box_statistics_follow_scale_and_ratio() -> None:
    rng = np.random.default_rng(1)
    boxes = np.array([random_resized_crop_box(375, 500, rng) for _ in range(2000)])
    area = boxes[:, 2] * boxes[:, 3] / (375 * 500)
    assert area.min() >= 0.07
    assert area.max() <= 1.0
    # E[U(0.08, 1)] = 0.54; large boxes of extreme aspect do not fit and are redrawn, so less.
    assert 0.38 < area.mean() < 0.54
    aspect = boxes[:, 3] / boxes[:, 2]
    inside = (aspect > 0.7) & (aspect < 1.4)
    assert inside.mean() > 0.99


def test_random_resized_crop_output(photo: np.ndarray) -> None:
    out = RandomResizedCrop(224)(photo, np.random.default_rng(0))
    assert out.shape == (224, 224, 3)
    assert out.dtype == np.uint8
    out = RandomResizedCrop((100, 60))(photo, np.random.default_rng(0))
    assert out.shape == (100, 60, 3)
    # scale=(1, 1), ratio = the image's: the crop is the whole image, merely resized.
    whole = RandomResizedCrop((375, 500), scale=(1.0, 1.0), ratio=(4 / 3, 4 / 3))
    np.testing.assert_array_equal(whole(photo, np.random.default_rng(5)), photo)


def test_flip_is_a_mirror(photo: np.ndarray) -> None:
    always = RandomHorizontalFlip(p=1.0)
    np.testing.assert_array_equal(always(photo, np.random.default_rng(0)), photo[:, ::-1])
    never = RandomHorizontalFlip(p=0.0)
    np.testing.assert_array_equal(never(photo, np.random.default_rng(0)), photo)
    t = torch.from_numpy(photo.copy()).permute(2, 0, 1)
    np.testing.assert_array_equal(
        always(t, np.random.default_rng(0)).permute(1, 2, 0).numpy(), photo[:, ::-1]
    )
    rng = np.random.default_rng(3)
    flips = [
        RandomHorizontalFlip()(photo[:2, :3], rng)[0, 0, 0] != photo[0, 0, 0] for _ in range(400)
    ]
    assert 150 < sum(flips) < 250


def test_normalize_values_and_batches() -> None:
    img = np.zeros((2, 3, 3), np.uint8)
    img[..., 0] = 255
    norm = Normalize(mean=(0.5, 0.5, 0.5), std=(0.5, 0.25, 0.5))
    out = norm(img)
    assert out.shape == (3, 2, 3)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out[0], torch.ones(2, 3))
    torch.testing.assert_close(out[1], torch.full((2, 3), -2.0))
    torch.testing.assert_close(out[2], torch.full((2, 3), -1.0))
    batch = torch.from_numpy(img).permute(2, 0, 1).unsqueeze(0).repeat(4, 1, 1, 1)
    torch.testing.assert_close(norm(batch), out.unsqueeze(0).repeat(4, 1, 1, 1))
    # float input in 0..255 gives the same values
    torch.testing.assert_close(norm(batch.float()), norm(batch))
    with pytest.raises(InvalidArgumentError):
        norm(np.zeros((2, 3, 4), np.uint8))
    with pytest.raises(InvalidArgumentError):
        Normalize(std=(0.0, 1.0, 1.0))


def test_normalize_reuses_a_batch_output_only_when_nothing_refers_to_it() -> None:
    """Batch outputs are reused (no fresh 38 MB per batch), but never while the caller holds
    the batch, a slice of it, or a NumPy array over it; values are always right."""
    norm = Normalize()
    rng = np.random.default_rng(0)
    batches = [
        torch.from_numpy(rng.integers(0, 256, (4, 3, 8, 8), dtype=np.uint8)) for _ in range(8)
    ]
    expect = [torch.stack([norm(img) for img in b]) for b in batches]  # per image: not pooled
    first = norm(batches[0])
    second = norm(batches[1])
    first_ptr, second_ptr = first.data_ptr(), second.data_ptr()
    assert first_ptr != second_ptr  # the first is held
    kept = first[1:3]  # a slice keeps the storage in use
    del first
    third = norm(batches[2])
    assert third.data_ptr() not in (first_ptr, second_ptr)
    array = second.numpy()  # a NumPy array over it keeps it in use
    del second
    fourth = norm(batches[3])
    assert fourth.data_ptr() not in (first_ptr, second_ptr, third.data_ptr())
    torch.testing.assert_close(kept, expect[0][1:3])  # nothing overwrote what is held
    torch.testing.assert_close(torch.from_numpy(array), expect[1])
    torch.testing.assert_close(third, expect[2])
    torch.testing.assert_close(fourth, expect[3])
    pooled = {third.data_ptr(), fourth.data_ptr()}  # the pool keeps the last 2
    del kept, array, third
    reused = norm(batches[4])
    assert reused.data_ptr() in pooled  # free again: reused, not fresh
    torch.testing.assert_close(reused, expect[4])
    torch.testing.assert_close(fourth, expect[3])
    # A pickled copy (a worker's) has its own, empty pool.
    again = pickle.loads(pickle.dumps(norm))
    torch.testing.assert_close(again(batches[5]), expect[5])


def test_compose_unfused_pipeline(photo: np.ndarray) -> None:
    pipe = Compose([RandomResizedCrop(), RandomHorizontalFlip(), Normalize()])
    out = pipe(photo, np.random.default_rng(0))
    assert out.shape == (3, 224, 224)
    assert out.dtype == torch.float32
    assert float(out.min()) > -2.2
    assert float(out.max()) < 2.7
    again = pipe(photo, np.random.default_rng(0))
    torch.testing.assert_close(out, again)


def test_resize_and_center_crop(photo: np.ndarray) -> None:
    small = Resize(100)(photo)
    assert small.shape == (100, 133, 3)
    crop = CenterCrop(90)(small)
    assert crop.shape == (90, 90, 3)
    np.testing.assert_array_equal(crop, small[5:95, 21:111])


@pytest.mark.parametrize("normalize_on", ["batch", "sample"])
def test_train_transform_output(photo_jpeg: bytes, normalize_on: str) -> None:
    tf = ImageTrainTransform(normalize_on=normalize_on)  # type: ignore[arg-type]
    out = tf(photo_jpeg, np.random.default_rng(0))
    assert out.shape == (3, 224, 224)
    if normalize_on == "batch":
        assert out.dtype == torch.uint8
        batch = torch.stack([out, out])
        finished = tf.batch_transform(batch)
        assert finished.dtype == torch.float32
        assert finished.shape == (2, 3, 224, 224)
    else:
        assert out.dtype == torch.float32
        assert float(out.min()) > -2.2
        assert float(out.max()) < 2.7


def test_train_transform_batch_normalize_equals_sample_normalize(photo_jpeg: bytes) -> None:
    u8 = ImageTrainTransform()(photo_jpeg, np.random.default_rng(7))
    f32 = ImageTrainTransform(normalize_on="sample")(photo_jpeg, np.random.default_rng(7))
    torch.testing.assert_close(ImageTrainTransform().batch_transform(u8.unsqueeze(0))[0], f32)


def test_train_transform_is_deterministic_per_seed(photo_jpeg: bytes) -> None:
    tf = ImageTrainTransform()
    a = tf(photo_jpeg, sample_rng(42, 3, 1000))
    b = tf(photo_jpeg, sample_rng(42, 3, 1000))
    torch.testing.assert_close(a, b)
    others = [tf(photo_jpeg, sample_rng(42, e, i)) for e, i in [(4, 1000), (3, 1001), (3, 999)]]
    assert all(not torch.equal(a, o) for o in others)


def test_sample_dict_protocol_uses_rng_seed(photo_jpeg: bytes) -> None:
    tf = ImageTrainTransform()
    sample = {
        "__key__": "k",
        "__url__": "u",
        "__rng_seed__": (42, 3, 1000),
        "jpg": photo_jpeg,
        "cls": 7,
    }
    out = tf(sample)
    assert out["cls"] == 7
    assert out["__key__"] == "k"
    assert sample["jpg"] is photo_jpeg  # input not modified
    torch.testing.assert_close(out["jpg"], tf(photo_jpeg, sample_rng(42, 3, 1000)))
    torch.testing.assert_close(tf(sample)["jpg"], out["jpg"])
    # Compose draws from one generator derived from the same metadata.
    pipe = Compose([RandomResizedCrop(field="jpg"), RandomHorizontalFlip(field="jpg")])
    dec = {**sample, "jpg": _photo(375, 500)}
    np.testing.assert_array_equal(pipe(dec)["jpg"], pipe(dec)["jpg"])


def test_transforms_pickle(photo_jpeg: bytes) -> None:
    for tf in (
        ImageTrainTransform(size=96, normalize_on="sample"),
        ImageEvalTransform(size=96, resize=110),
    ):
        clone = pickle.loads(pickle.dumps(tf))
        torch.testing.assert_close(
            clone(photo_jpeg, sample_rng(1, 2, 3)), tf(photo_jpeg, sample_rng(1, 2, 3))
        )


@pytest.mark.parametrize("shape", [(375, 500), (500, 375), (1000, 1500), (300, 230)])
def test_dct_scaled_path_is_close_to_full_decode(shape: tuple[int, int]) -> None:
    data = _jpeg(_photo(*shape, seed=shape[0]))
    fast = ImageTrainTransform(normalize_on="batch")
    full = ImageTrainTransform(normalize_on="batch", dct_scaling=False)
    diffs = []
    for i in range(20):
        a = fast(data, sample_rng(0, 0, i)).float()
        b = full(data, sample_rng(0, 0, i)).float()
        diffs.append(float((a - b).abs().mean()))
    assert max(diffs) < 4.0, diffs  # out of 255
    assert float(np.mean(diffs)) < 2.0, diffs


def test_fused_equals_unfused_on_full_decode(photo: np.ndarray, photo_jpeg: bytes) -> None:
    """Without DCT scaling the fused transform is exactly decode + RRC + flip."""
    fused = ImageTrainTransform(dct_scaling=False, normalize_on="batch")
    decoded = np.asarray(Image.open(io.BytesIO(photo_jpeg)).convert("RGB"))
    unfused = Compose([RandomResizedCrop(), RandomHorizontalFlip()])
    for i in range(5):
        a = fused(photo_jpeg, sample_rng(9, 0, i))
        b = unfused(decoded, sample_rng(9, 0, i))
        assert (
            float((a.permute(1, 2, 0).float() - torch.from_numpy(b.copy()).float()).abs().mean())
            < 1.0
        )


def test_fused_train_flip(photo_jpeg: bytes) -> None:
    flip = ImageTrainTransform(flip_p=1.0)
    keep = ImageTrainTransform(flip_p=0.0)
    torch.testing.assert_close(
        flip(photo_jpeg, sample_rng(0, 0, 1)), keep(photo_jpeg, sample_rng(0, 0, 1)).flip(-1)
    )


def test_fused_accepts_decoded_and_non_jpeg(photo: np.ndarray) -> None:
    tf = ImageTrainTransform(size=64)
    assert tf(photo, np.random.default_rng(0)).shape == (3, 64, 64)
    buf = io.BytesIO()
    Image.fromarray(photo).save(buf, format="PNG")
    assert tf(buf.getvalue(), np.random.default_rng(0)).shape == (3, 64, 64)
    assert tf(Image.fromarray(photo), np.random.default_rng(0)).shape == (3, 64, 64)


def test_eval_transform(photo: np.ndarray, photo_jpeg: bytes) -> None:
    tf = ImageEvalTransform()
    a = tf(photo_jpeg)
    assert a.shape == (3, 224, 224)
    assert a.dtype == torch.uint8
    torch.testing.assert_close(a, tf(photo_jpeg))
    # Equal to resize-256 then centre-crop-224 of the full decode, up to DCT scaling differences.
    decoded = np.asarray(Image.open(io.BytesIO(photo_jpeg)).convert("RGB"))
    ref = CenterCrop(224)(Resize(256)(decoded))
    assert (
        float((a.permute(1, 2, 0).float() - torch.from_numpy(ref.copy()).float()).abs().mean())
        < 3.0
    )


def test_corrupt_jpeg_in_sample_names_url_and_key(photo_jpeg: bytes) -> None:
    tf = ImageTrainTransform()
    bad = photo_jpeg[: len(photo_jpeg) // 2]
    sample = {"__key__": "img7", "__url__": "s3://bucket/train-000003.tar", "jpg": bad}
    with pytest.raises(CorruptDataError) as info:
        tf(sample, np.random.default_rng(0))
    assert info.value.key == "img7"
    assert "train-000003.tar" in str(info.value)
    assert "'jpg'" in str(info.value)
    with pytest.raises(CorruptDataError):
        tf(b"\xff\xd8\xff garbage", np.random.default_rng(0))


def test_invalid_arguments() -> None:
    with pytest.raises(InvalidArgumentError):
        ImageTrainTransform(size=0)
    with pytest.raises(InvalidArgumentError):
        ImageTrainTransform(scale=(0.9, 0.1))
    with pytest.raises(InvalidArgumentError):
        RandomResizedCrop(interpolation="cubic")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        ImageEvalTransform(size=224, resize=200)
    with pytest.raises(InvalidArgumentError):
        RandomHorizontalFlip(p=1.5)


@pytest.mark.parametrize(
    "make",
    [
        lambda: ImageTrainTransform(interpolation="cubic"),
        lambda: ImageEvalTransform(interpolation="cubic"),
        lambda: RandomResizedCrop(interpolation="cubic"),
        lambda: Resize(64, interpolation="cubic"),
    ],
)
def test_every_transform_checks_interpolation_when_built(make: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="interpolation must be one of"):
        make()


@pytest.mark.parametrize("size", [0, (224, 0), (224, 2.5), True, (1, 2, 3)])
def test_sizes_must_be_positive_ints_or_pairs(size: Any) -> None:
    for make in (ImageTrainTransform, ImageEvalTransform, RandomResizedCrop, CenterCrop, Resize):
        with pytest.raises(InvalidArgumentError, match=f"{make.__name__}: size must be"):
            make(size)


def test_without_seed_metadata_draws_follow_numpy_global_seed(photo_jpeg: bytes) -> None:
    """The loader reseeds NumPy's global generator per batch; transforms then repeat exactly."""
    tf = ImageTrainTransform(size=64)
    np.random.seed(123)
    a = [tf(photo_jpeg) for _ in range(3)]
    np.random.seed(123)
    b = [tf(photo_jpeg) for _ in range(3)]
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)
    assert not torch.equal(a[0], a[1])


def test_with_fastload_loader(tmp_path: Path) -> None:
    """Decoder(image="bytes") + ImageTrainTransform through open_dataset and fastload.DataLoader:
    uint8 CHW batches, normalized by batch_transform, reproducible for a seed and epoch."""
    import fastload.loader as fl
    from fastload.convert import convert
    from fastload.loader.decode import Decoder

    src = tmp_path / "images"
    for i in range(12):
        (src / f"c{i % 3}").mkdir(parents=True, exist_ok=True)
        (src / f"c{i % 3}" / f"img{i:02d}.jpg").write_bytes(_jpeg(_photo(60 + i, 80, seed=i)))
    convert(str(src), str(tmp_path / "ds"), format="webdataset", workers=1, quiet=True)
    tf = ImageTrainTransform(size=32)

    def run(epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        ds = fl.open_dataset(
            str(tmp_path / "ds"),
            seed=7,
            decode=Decoder(image="bytes"),
            transform=tf,
            fields=("jpg", "cls"),
        )
        loader = fl.DataLoader(ds, batch_size=4, num_workers=0)
        loader.set_epoch(epoch)
        return list(loader)

    first = run(0)
    assert len(first) == 3
    images, labels = first[0]
    assert images.shape == (4, 3, 32, 32)
    assert images.dtype == torch.uint8
    assert labels.dtype == torch.int64
    assert tf.batch_transform(images).dtype == torch.float32
    again = run(0)
    for (a, _), (b, _) in zip(first, again):
        torch.testing.assert_close(a, b)
    other = run(1)
    assert any(not torch.equal(a, b) for (a, _), (b, _) in zip(first, other))
