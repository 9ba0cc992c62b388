"""Quality of the fused transforms' DCT-scaled decode (issue 15).

The reference is what the unfused pipeline computes: Pillow's full-size decode, then Pillow's
bilinear resize of the same float box. Each scale the transform can choose (1, 1/2, 1/4, 1/8) is
forced by choosing, for each random-resized-crop box, an output size for which
:func:`dct_scale` picks that scale; the goal is >= 40 dB mean and >= 35 dB minimum PSNR.
"""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from fastload.loader.images._jpeg import (
    DCT_SCALES,
    MIN_DECODED_PER_OUTPUT,
    dct_scale,
    decode_at_scale,
)
from fastload.loader.transforms import ImageTrainTransform, random_resized_crop_box, sample_rng
from fastload.testing.corpus import make_image

#: Crops per scale; with the images below the test runs in a few seconds.
CROPS = 80
MIN_SIDE = 8  # smaller outputs say little about quality


def _decode(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def _encode(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


@pytest.fixture(scope="module")
def images() -> list[tuple[bytes, np.ndarray]]:
    """Generated photo-like JPEGs of several sizes: corpus images at half size (about 250x187),
    at full size (about 500x375, some portrait or other), and 2x2 mosaics of them (1000x750)."""
    datas = [make_image(i, scale=2)[1] for i in range(4)]
    datas += [make_image(i)[1] for i in range(8)]
    landscape = [a for a in (_decode(d) for d in datas[4:]) if a.shape[:2] == (375, 500)]
    assert len(landscape) >= 4
    for tiles in (landscape[:4], landscape[-4:]):
        datas.append(_encode(np.concatenate([np.hstack(tiles[:2]), np.hstack(tiles[2:])])))
    return [(d, _decode(d)) for d in datas]


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def _sizes(factor: float, side: int) -> tuple[int, int]:
    """The range of square output sides for which :func:`dct_scale` picks ``factor`` for a box
    whose shorter side is ``side`` source pixels (upsampling included at full scale)."""
    hi = math.floor(factor * side / MIN_DECODED_PER_OUTPUT) if factor < 1 else 2 * side
    lo = (
        1
        if factor == DCT_SCALES[-1]
        else math.floor(factor * side / MIN_DECODED_PER_OUTPUT / 2) + 1
    )
    return max(lo, MIN_SIDE), hi


@pytest.mark.parametrize("factor", DCT_SCALES)
def test_fused_decode_psnr_against_pil_bilinear(
    images: list[tuple[bytes, np.ndarray]], factor: float
) -> None:
    pick = np.random.default_rng(int(factor * 8))
    psnrs: list[float] = []
    attempt = 0
    while len(psnrs) < CROPS:
        attempt += 1
        assert attempt < 20 * CROPS, "too few boxes large enough for this scale"
        data, full = images[attempt % len(images)]
        seed = (15, int(factor * 8), attempt)
        # The transform draws its box first from the sample's generator: the same box.
        box = random_resized_crop_box(full.shape[0], full.shape[1], sample_rng(*seed))
        lo, hi = _sizes(factor, min(box[2], box[3]))
        if hi < lo:
            continue
        side = int(pick.integers(lo, hi + 1))
        assert dct_scale(box, (side, side)) == factor, (box, side)
        out = ImageTrainTransform(size=side, flip_p=0.0)(data, sample_rng(*seed))
        top, left, h, w = box
        ref = Image.fromarray(full).resize(
            (side, side), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h)
        )
        psnrs.append(_psnr(out.permute(1, 2, 0).numpy(), np.asarray(ref)))
        if factor == 1.0:  # full-scale decodes are exactly what they were without DCT scaling
            full_only = ImageTrainTransform(size=side, flip_p=0.0, dct_scaling=False)
            assert torch.equal(out, full_only(data, sample_rng(*seed)))
    mean, low = float(np.mean(psnrs)), min(psnrs)
    assert mean >= 40.0, (factor, mean, low)
    assert low >= 35.0, (factor, mean, low)


@pytest.mark.parametrize("factor", DCT_SCALES)
def test_decode_at_scale_maps_the_box_by_the_factor(factor: float) -> None:
    data = make_image(3)[1]  # 500x375: odd height, so ceil(375 * factor) / 375 != factor
    height, width = _decode(data).shape[:2]
    box = (101, 37, 203, 311)
    arr, fbox = decode_at_scale(data, (height, width), box, factor)
    assert arr.shape == (math.ceil(height * factor), math.ceil(width * factor), 3)
    assert fbox == (37 * factor, 101 * factor, (37 + 311) * factor, (101 + 203) * factor)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4000), st.integers(1, 4000), st.integers(1, 1000), st.integers(1, 1000))
def test_dct_scale_keeps_enough_decoded_pixels(ch: int, cw: int, oh: int, ow: int) -> None:
    factor = dct_scale((0, 0, ch, cw), (oh, ow))
    assert factor in DCT_SCALES
    enough = min(ch * factor / oh, cw * factor / ow) >= MIN_DECODED_PER_OUTPUT
    assert factor == 1.0 or enough
    if factor > DCT_SCALES[-1]:  # the smallest such scale: half of it would not be enough
        half = factor / 2
        assert min(ch * half / oh, cw * half / ow) < MIN_DECODED_PER_OUTPUT
