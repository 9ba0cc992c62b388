"""Crop geometry of the image transforms: which box of the source image a crop keeps.

Pure arithmetic on image sizes (no pixels): the Inception-style random-resized-crop box, the
"resize shorter side, centre-crop" box of evaluation, and the checks of the size and range
options that define them. Shared by the composable and the fused (JPEG) transforms, so both crop
exactly the same boxes for the same draws.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from fastload._units import check_int
from fastload.errors import InvalidArgumentError

__all__ = [
    "CropBox",
    "center_crop_box",
    "check_range",
    "check_size",
    "pil_box",
    "random_resized_crop_box",
]

#: ``(top, left, height, width)`` in pixels of the source image; top/left inclusive.
CropBox = tuple[int, int, int, int]


def check_size(size: int | tuple[int, int], what: str) -> tuple[int, int]:
    """``size`` as ``(height, width)``; an int means a square.

    Raises:
        InvalidArgumentError: Not an int or a pair, or a side that is not an int >= 1 (the
            message starts with ``what``, the transform's name).
    """
    hw = (size, size) if isinstance(size, int) else tuple(size)
    if len(hw) != 2:
        raise InvalidArgumentError(
            f"{what}: size must be a positive int or (height, width), got {size!r}"
        )
    name = f"{what}: size"
    return check_int(name, hw[0], minimum=1), check_int(name, hw[1], minimum=1)


def check_range(value: Sequence[float], what: str, low: float) -> tuple[float, float]:
    """``value`` as a float ``(min, max)`` with ``low < min <= max`` (a ``scale`` or ``ratio``)."""
    if len(value) != 2 or not (low < value[0] <= value[1]):
        raise InvalidArgumentError(
            f"{what} must be (min, max) with {low} < min <= max, got {value!r}"
        )
    return float(value[0]), float(value[1])


def random_resized_crop_box(
    height: int,
    width: int,
    rng: np.random.Generator,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> CropBox:
    """Choose a random-resized-crop box, the Inception-style sampling ResNet training uses.

    Up to 10 attempts draw an area fraction uniformly from ``scale`` and an aspect ratio
    (width/height) log-uniformly from ``ratio``; the first box that fits is placed uniformly at
    random. If none fits, the largest centred box with an aspect ratio clamped to ``ratio``.

    Returns:
        ``(top, left, crop_height, crop_width)``, always within the image, both sizes >= 1.
    """
    area = height * width
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    areas = rng.uniform(scale[0], scale[1], size=10) * area
    aspects = np.exp(rng.uniform(log_lo, log_hi, size=10))
    for target, aspect in zip(areas.tolist(), aspects.tolist()):
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, max(1, round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        h, w = height, max(1, round(height * ratio[1]))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def center_crop_box(height: int, width: int, size: tuple[int, int], resize: int | None) -> CropBox:
    """The box of the source that "resize shorter side to ``resize``, centre-crop ``size``" keeps.

    With ``resize=None`` the crop is ``size`` pixels of the source itself (clamped to the image).
    """
    if resize is None:
        ch, cw = min(size[0], height), min(size[1], width)
    else:
        factor = min(height, width) / resize  # source pixels per output pixel
        ch = min(height, max(1, round(size[0] * factor)))
        cw = min(width, max(1, round(size[1] * factor)))
    return (height - ch) // 2, (width - cw) // 2, ch, cw


def pil_box(box: CropBox) -> tuple[float, float, float, float]:
    """``box`` as the float ``(left, top, right, bottom)`` that Pillow's ``resize(box=...)`` and
    the resize kernels of :mod:`fastload.loader.images._pixels` take."""
    top, left, h, w = box
    return float(left), float(top), float(left + w), float(top + h)
