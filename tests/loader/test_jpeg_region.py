"""The native region decoder (``fastload.loader.images._jpegroi``, setup.py): same pixels as a whole
decode, for every layout libjpeg-turbo handles, and the same transform outputs with it or without.
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np
import pytest
import simplejpeg
import torch
from PIL import Image

import fastload.loader.images._jpeg as jpeg
from fastload.errors import CorruptDataError
from fastload.loader.images._jpeg import (
    DCT_SCALES,
    decode_at_scale,
    decode_region_for_box,
    region_decoder_available,
)
from fastload.loader.transforms import (
    ImageEvalTransform,
    ImageTrainTransform,
    random_resized_crop_box,
    sample_rng,
)
from fastload.testing import need
from fastload.testing.corpus import make_image


@pytest.fixture(autouse=True)
def _built() -> None:
    need(
        "the native JPEG region decoder (fastload.loader.images._jpegroi)",
        region_decoder_available(),
        "install a C compiler and libjpeg-turbo's headers (tools/system-deps.sh: gcc, "
        "libjpeg62-turbo-dev), then reinstall fastload (pip install -e .)",
    )


def _jpeg(arr: np.ndarray, **save: Any) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90, **save)
    return buf.getvalue()


def _images() -> list[tuple[str, bytes]]:
    """Layouts: chroma subsampling 4:4:4, 4:2:2, 4:2:0; progressive; grayscale; restart
    markers; odd sizes that are not whole MCUs."""
    photo = np.asarray(Image.open(io.BytesIO(make_image(3, 0)[1])).convert("RGB"))
    odd = np.ascontiguousarray(photo[:333, :301])
    out = [(f"subsampling={s}", _jpeg(photo, subsampling=s)) for s in (0, 1, 2)]
    out.append(("progressive", _jpeg(photo, progressive=True)))
    out.append(("odd 333x301", _jpeg(odd)))
    out.append(("grayscale", _jpeg(np.ascontiguousarray(photo[..., 1]))))
    out.append(("corpus photo", make_image(11, 0)[1]))
    return out


IMAGES = _images()


@pytest.mark.parametrize(("name", "data"), IMAGES, ids=[n for n, _ in IMAGES])
@pytest.mark.parametrize("factor", DCT_SCALES)
def test_region_pixels_equal_a_whole_decode(name: str, data: bytes, factor: float) -> None:
    h, w, _, _ = simplejpeg.decode_jpeg_header(data)
    rng = np.random.default_rng(7)
    boxes = [random_resized_crop_box(h, w, rng) for _ in range(25)]
    boxes += [(0, 0, h, w), (h - 1, w - 1, 1, 1), (0, w // 2, h // 3, w - w // 2)]
    for box in boxes:
        whole, wbox = decode_at_scale(data, (h, w), box, factor)
        for context in (0, 5):
            part, pbox = decode_region_for_box(data, (h, w), box, factor, context)
            # Placed where it lies in the whole decode, the region's pixels within the box and
            # the context (its outermost ROI_EDGE ring is decoded without neighbours) are the
            # same, and the region covers them.
            dy, dx = wbox[1] - pbox[1], wbox[0] - pbox[0]
            assert float(dy).is_integer()
            assert float(dx).is_integer()
            y, x = int(dy), int(dx)
            top = max(0, math.floor(wbox[1]) - context)
            left = max(0, math.floor(wbox[0]) - context)
            bottom = min(whole.shape[0], math.ceil(wbox[3]) + context)
            right = min(whole.shape[1], math.ceil(wbox[2]) + context)
            assert y <= top
            assert x <= left
            assert y + part.shape[0] >= bottom
            assert x + part.shape[1] >= right
            np.testing.assert_array_equal(
                part[top - y : bottom - y, left - x : right - x],
                whole[top:bottom, left:right],
                err_msg=f"box {box}, context {context}",
            )


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic", "lanczos"])
@pytest.mark.parametrize("size", [224, 64, 16])
def test_transforms_give_the_same_output_with_and_without_it(
    interpolation: str, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Region decodes change no output pixel: train and eval transforms, every filter, output
    sizes that choose full and reduced DCT scales."""
    datas = [d for _, d in IMAGES]
    transforms = [
        ImageTrainTransform(size, interpolation=interpolation),  # type: ignore[arg-type]
        ImageEvalTransform(size, resize=size + size // 7, interpolation=interpolation),  # type: ignore[arg-type]
    ]
    with_it = [[tf(d, sample_rng(1, 2, i)) for i, d in enumerate(datas * 3)] for tf in transforms]
    monkeypatch.setattr(jpeg, "_decode_region", None)
    without = [[tf(d, sample_rng(1, 2, i)) for i, d in enumerate(datas * 3)] for tf in transforms]
    for a, b in zip(with_it, without, strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)


def _outcome(tf: ImageTrainTransform, data: bytes) -> Any:
    try:
        return tf(data, sample_rng(0, 0, 0))
    except CorruptDataError as exc:
        return type(exc)


def test_bad_data_falls_back_to_the_whole_decode_and_its_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the region decoder refuses is decoded whole, so damaged and unusual images end as
    they did without it: the same output, or the same CorruptDataError."""
    data = IMAGES[0][1]
    h, w, _, _ = simplejpeg.decode_jpeg_header(data)
    with pytest.raises(ValueError, match="region decode failed"):
        decode_region_for_box(data[:300], (h, w), (0, 0, h, w), 1.0, 0)
    cmyk = io.BytesIO()
    Image.new("CMYK", (64, 48), (10, 20, 30, 40)).save(cmyk, format="JPEG")
    with pytest.raises(ValueError, match="CMYK"):
        decode_region_for_box(cmyk.getvalue(), (48, 64), (0, 0, 48, 64), 1.0, 0)
    damaged = [
        data[: len(data) // 2],  # truncated
        data[:600] + bytes(len(data) - 600),  # zeroed entropy data
        data[:50],  # header only
        cmyk.getvalue(),
        data[:600] + bytes(len(data) - 602) + b"\xff\xd9",  # zeroed, yet ends with EOI
        data[: len(data) // 2] + b"\xff\xd9",  # truncated, yet ends with EOI
    ]
    with pytest.raises(ValueError, match="region decode failed"):  # libjpeg's warning: refused
        decode_region_for_box(damaged[5], (h, w), (h - 8, 0, 8, w), 1.0, 0)
    tf = ImageTrainTransform()
    with_it = [_outcome(tf, d) for d in damaged]
    monkeypatch.setattr(jpeg, "_decode_region", None)
    without = [_outcome(tf, d) for d in damaged]
    for a, b in zip(with_it, without, strict=True):
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor)
            assert torch.equal(a, b)
        else:
            assert a is b is CorruptDataError
    assert with_it[2] is CorruptDataError

    assert isinstance(with_it[3], torch.Tensor)  # CMYK: whole decode through Pillow
