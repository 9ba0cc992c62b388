"""The transform classes: composable steps on decoded images, and the fused JPEG pipelines.

* Composable: :class:`RandomResizedCrop`, :class:`RandomHorizontalFlip`, :class:`Resize` and
  :class:`CenterCrop` work on decoded ``(H, W, C)`` uint8 images, chained by :class:`Compose`
  with one shared random generator.
* Fused: :class:`ImageTrainTransform` and :class:`ImageEvalTransform` take encoded bytes, choose
  the crop from the JPEG header, decode only the DCT scale the crop needs
  (:mod:`fastload.loader.images._jpeg`) and resize with torch's uint8 antialiased bilinear kernel, or
  with Pillow's (the same filter) where a reduced scale leaves the box on fractional pixels.

Both kinds crop the boxes of :mod:`fastload.loader.images._geometry` and resize with the kernels of
:mod:`fastload.loader.images._pixels`, so for the same draws they keep the same pixels; see
:mod:`fastload.loader.transforms` for the whole picture.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image

from fastload.errors import InvalidArgumentError
from fastload.loader.images._fields import ImageFieldTransform
from fastload.loader.images._geometry import (
    CropBox,
    center_crop_box,
    check_range,
    check_size,
    pil_box,
    random_resized_crop_box,
)
from fastload.loader.images._jpeg import decode_for_box, header_size
from fastload.loader.images._normalize import IMAGENET_MEAN, IMAGENET_STD, Normalize
from fastload.loader.images._pixels import (
    FILTERS,
    Interpolation,
    as_rgb_array,
    check_interpolation,
    decode_full,
    pil_to_hwc,
    resize_pil,
    resize_torch,
)
from fastload.loader.order._sample_rng import rng_for

__all__ = [
    "CenterCrop",
    "Compose",
    "ImageEvalTransform",
    "ImageTrainTransform",
    "NormalizeOn",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "Resize",
]


# ---- composable steps on decoded images -----------------------------------------------------


class RandomResizedCrop(ImageFieldTransform):
    """Crop a random area/aspect box (see :func:`random_resized_crop_box`) and resize it.

    Args:
        size: Output ``(height, width)``, or an int for a square. Default 224.
        scale: Range of the crop's area as a fraction of the image's.
        ratio: Range of the crop's aspect ratio (width/height), sampled log-uniformly.
        interpolation: Pillow filter; ``bilinear`` (antialiased when shrinking) by default.
        field: With sample dicts, the one field to transform (default: every image field).

    Input: ``(H, W, C)`` uint8 array, PIL image, or encoded bytes. Output: ``(size, size, C)``
    uint8 array (a new array).
    """

    def __init__(
        self,
        size: int | tuple[int, int] = 224,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        interpolation: Interpolation = "bilinear",
        *,
        field: str | None = None,
    ) -> None:
        self.size = check_size(size, "RandomResizedCrop")
        self.scale = check_range(scale, "RandomResizedCrop scale", 0.0)
        self.ratio = check_range(ratio, "RandomResizedCrop ratio", 0.0)
        check_interpolation(interpolation)
        self.interpolation = interpolation
        self.field = field

    def apply(self, image: Any, rng: np.random.Generator) -> np.ndarray:
        arr = as_rgb_array(image)
        box = random_resized_crop_box(arr.shape[0], arr.shape[1], rng, self.scale, self.ratio)
        return pil_to_hwc(resize_pil(arr, pil_box(box), self.size, FILTERS[self.interpolation]))


class RandomHorizontalFlip(ImageFieldTransform):
    """Mirror the image left-right with probability ``p``.

    Input/output: ``(H, W, C)`` arrays (a contiguous copy when flipped, the input otherwise), PIL
    images, or ``(C, H, W)`` tensors.
    """

    def __init__(self, p: float = 0.5, *, field: str | None = None) -> None:
        if not 0.0 <= p <= 1.0:
            raise InvalidArgumentError(f"RandomHorizontalFlip: p must be in [0, 1], got {p}")
        self.p = p
        self.field = field

    def apply(self, image: Any, rng: np.random.Generator) -> Any:
        if rng.random() >= self.p:
            return image
        if isinstance(image, Image.Image):
            return image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        if isinstance(image, torch.Tensor):
            return image.flip(-1)
        return np.ascontiguousarray(np.asarray(image)[:, ::-1])


class Resize(ImageFieldTransform):
    """Resize so the shorter side is ``size`` pixels (aspect kept), or to ``(height, width)``.

    Input: ``(H, W, C)`` uint8 array, PIL image or encoded bytes. Output: ``(H', W', C)`` uint8.
    """

    def __init__(
        self,
        size: int | tuple[int, int],
        interpolation: Interpolation = "bilinear",
        *,
        field: str | None = None,
    ) -> None:
        self.size = size
        check_size(size, "Resize")
        check_interpolation(interpolation)
        self.interpolation = interpolation
        self.field = field

    def apply(self, image: Any, rng: np.random.Generator) -> np.ndarray:
        arr = as_rgb_array(image)
        h, w = arr.shape[:2]
        if isinstance(self.size, int):
            f = self.size / min(h, w)
            out = (max(1, round(h * f)), max(1, round(w * f)))
        else:
            out = self.size
        box = (0.0, 0.0, float(w), float(h))
        return pil_to_hwc(resize_pil(arr, box, out, FILTERS[self.interpolation]))


class CenterCrop(ImageFieldTransform):
    """Cut the central ``size`` box (clamped to the image). Output: an ``(h, w, C)`` view."""

    def __init__(self, size: int | tuple[int, int], *, field: str | None = None) -> None:
        self.size = check_size(size, "CenterCrop")
        self.field = field

    def apply(self, image: Any, rng: np.random.Generator) -> np.ndarray:
        arr = as_rgb_array(image)
        top, left, h, w = center_crop_box(arr.shape[0], arr.shape[1], self.size, None)
        return arr[top : top + h, left : left + w]


class Compose:
    """Apply transforms in order, passing all of them the same random generator.

    ``Compose([RandomResizedCrop(), RandomHorizontalFlip(), Normalize()])`` is the classic
    (unfused) training pipeline over decoded arrays. For sample dicts the generator comes from
    ``__rng_seed__`` once and is shared, so the result is deterministic.
    """

    def __init__(self, transforms: Sequence[Callable[..., Any]]) -> None:
        self.transforms = list(transforms)

    def __call__(self, x: Any, rng: np.random.Generator | None = None) -> Any:
        generator = rng_for(x, rng)
        for t in self.transforms:
            x = t(x, generator)
        return x


# ---- fused JPEG decode + augment ------------------------------------------------------------


def _whole(box: tuple[float, float, float, float]) -> bool:
    """Whether every side of ``box`` falls on a whole pixel (torch's kernel takes only those)."""
    return all(v.is_integer() for v in box)


#: Where a fused transform's output is normalized: per sample (float) or later per batch (uint8).
NormalizeOn = Literal["sample", "batch"]


class FusedJpegTransform(ImageFieldTransform):
    """Common parts of the fused train/eval transforms: decode for a box, resize, emit.

    Subclasses choose the crop box (:meth:`_box`) and whether to flip (:meth:`_flip`), and set
    their output options with :meth:`_set_output`.
    """

    size: tuple[int, int]
    dct_scaling: bool
    interpolation: Interpolation
    normalize_on: NormalizeOn
    normalize: Normalize

    def _set_output(
        self,
        mean: Sequence[float],
        std: Sequence[float],
        normalize_on: NormalizeOn,
        dct_scaling: bool,
        interpolation: Interpolation,
        field: str | None,
    ) -> None:
        """Check and set the options both fused transforms share (after ``size``)."""
        if normalize_on not in ("sample", "batch"):
            raise InvalidArgumentError("normalize_on must be 'sample' or 'batch'")
        check_interpolation(interpolation)
        self.normalize = Normalize(mean, std)
        self.normalize_on = normalize_on
        self.dct_scaling = dct_scaling
        self.interpolation = interpolation
        self.field = field

    @abstractmethod
    def _box(self, height: int, width: int, rng: np.random.Generator) -> CropBox:
        """The crop box of a ``height`` x ``width`` source image."""

    def _flip(self, rng: np.random.Generator) -> bool:
        """Whether to mirror this image (drawn after the box)."""
        return False

    def apply(self, image: Any, rng: np.random.Generator) -> torch.Tensor:
        resample = FILTERS[self.interpolation]
        hw = None
        if isinstance(image, (bytes, bytearray, memoryview)):
            data = bytes(image)
            hw = header_size(data)
            if hw is None:  # not a JPEG (or one simplejpeg cannot read): full decode
                image = decode_full(data)
        if hw is not None:
            box = self._box(hw[0], hw[1], rng)
            try:
                arr, fbox = decode_for_box(
                    data,
                    hw,
                    box,
                    self.size,
                    self.dct_scaling,
                    whole_box_inside=self.interpolation == "bilinear",
                )
            except ValueError:
                arr = decode_full(data)  # CMYK & co. via Pillow; raises CorruptDataError
                fbox = pil_box(box)
        else:
            arr = as_rgb_array(image)
            fbox = pil_box(self._box(arr.shape[0], arr.shape[1], rng))
        out: torch.Tensor
        if self.interpolation == "bilinear" and arr.shape[2] == 3 and _whole(fbox):
            out = resize_torch(arr, fbox, self.size)
            if self._flip(rng):
                out = out.flip(-1)
        else:
            pil = resize_pil(arr, fbox, self.size, resample)
            if self._flip(rng):
                pil = pil.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            out = torch.from_numpy(pil_to_hwc(pil)).permute(2, 0, 1)  # CHW view, uint8
        if self.normalize_on == "sample":
            normalized: torch.Tensor = self.normalize(out)
            return normalized
        return out

    def batch_transform(self, batch: torch.Tensor) -> torch.Tensor:
        """Finish a collated batch: normalize ``(N, C, H, W)`` uint8 to float when
        ``normalize_on="batch"``; returns ``batch`` unchanged otherwise. Run it in the main
        process, ideally after moving the uint8 batch to the GPU."""
        if self.normalize_on == "batch" and batch.dtype == torch.uint8:
            result: torch.Tensor = self.normalize(batch)
            return result
        return batch


class ImageTrainTransform(FusedJpegTransform):
    """The standard training augmentation, fused with JPEG decoding.

    random-resized-crop → resize to ``size`` → horizontal flip → (normalize), where the crop box is
    chosen from the JPEG header and only the DCT scale the crop needs is decoded. Draw order from
    the generator: crop box, then flip.

    Args:
        size: Output side (or ``(height, width)``). Default 224.
        scale: Crop area range as a fraction of the image's. Default (0.08, 1).
        ratio: Crop aspect ratio range (width/height). Default (3/4, 4/3).
        flip_p: Probability of a horizontal flip. Default 0.5.
        mean, std: Normalization constants in 0..1 units (ImageNet's by default).
        normalize_on: ``"batch"`` (default): output ``(C, H, W)`` uint8 tensors; call
            :meth:`batch_transform` (or a :class:`Normalize`) on the collated batch.
            ``"sample"``: output normalized float32 ``(C, H, W)`` tensors.
        dct_scaling: Decode JPEGs at DCT scale 1/2, 1/4 or 1/8 where the reduced crop still
            has >= 2 decoded pixels per output pixel on both axes (default True); the output
            then stays within >= 40 dB mean, >= 35 dB minimum PSNR of the full-size decode's
            (tests/loader/test_decode_quality.py). False always decodes the full resolution.
        interpolation: Resize filter; antialiased bilinear by default (torch's uint8 kernel);
            other filters use Pillow's resize (slower).
        field: With sample dicts, the one field to transform (default: every image field).

    Input: encoded bytes (fastest for JPEG; other formats are fully decoded with Pillow), or a
    decoded ``(H, W, C)`` array / PIL image. The returned uint8 tensor may be a non-contiguous
    view; ``torch.stack`` (collation) makes one contiguous copy.
    """

    def __init__(
        self,
        size: int | tuple[int, int] = 224,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        flip_p: float = 0.5,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        *,
        normalize_on: NormalizeOn = "batch",
        dct_scaling: bool = True,
        interpolation: Interpolation = "bilinear",
        field: str | None = None,
    ) -> None:
        self.size = check_size(size, "ImageTrainTransform")
        self.scale = check_range(scale, "ImageTrainTransform scale", 0.0)
        self.ratio = check_range(ratio, "ImageTrainTransform ratio", 0.0)
        if not 0.0 <= flip_p <= 1.0:
            raise InvalidArgumentError(
                f"ImageTrainTransform: flip_p must be in [0, 1], got {flip_p}"
            )
        self.flip_p = flip_p
        self._set_output(mean, std, normalize_on, dct_scaling, interpolation, field)

    def _box(self, height: int, width: int, rng: np.random.Generator) -> CropBox:
        return random_resized_crop_box(height, width, rng, self.scale, self.ratio)

    def _flip(self, rng: np.random.Generator) -> bool:
        return bool(rng.random() < self.flip_p)


class ImageEvalTransform(FusedJpegTransform):
    """The standard evaluation transform, fused with JPEG decoding: resize the shorter side to
    ``resize`` and centre-crop ``size`` (224 of 256 by default), decoding only the DCT scale needed.

    Deterministic (no random draws). Arguments and output as in :class:`ImageTrainTransform`.
    """

    def __init__(
        self,
        size: int | tuple[int, int] = 224,
        resize: int = 256,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        *,
        normalize_on: NormalizeOn = "batch",
        dct_scaling: bool = True,
        interpolation: Interpolation = "bilinear",
        field: str | None = None,
    ) -> None:
        self.size = check_size(size, "ImageEvalTransform")
        if resize < max(self.size):
            raise InvalidArgumentError(
                f"ImageEvalTransform: resize ({resize}) must be >= size {self.size}"
            )
        self.resize = resize
        self._set_output(mean, std, normalize_on, dct_scaling, interpolation, field)

    def _box(self, height: int, width: int, rng: np.random.Generator) -> CropBox:
        return center_crop_box(height, width, self.size, self.resize)
