"""Image transforms for training and evaluation, without torchvision, deterministic and resumable.

Two ways to build an image pipeline:

* **Fused (fast)**: :class:`ImageTrainTransform` and :class:`ImageEvalTransform` take the *encoded
  JPEG bytes* (use ``Decoder(image="bytes")``). They read the image size from the JPEG header,
  choose the crop, and let libjpeg-turbo decode at the smallest DCT scale (1/8, 1/4, 1/2 or 1 —
  the scales its SIMD code accelerates; 3/8..7/8 are slower than a full decode) that still gives
  at least ``size`` pixels across the crop, so large crops of large images decode 4-64x fewer
  pixels. The crop is a
  view of the decoded buffer, resized by torch's uint8 antialiased-bilinear kernel (the same filter
  as Pillow's, 3-4x faster, and it writes CHW directly). Output is ``uint8`` CHW by default (150 KB per 224² sample instead
  of 600 KB of float32), so moving samples between worker processes is cheap; normalization to
  float runs later on the whole batch (``normalize_on="batch"``), in the main process or on the GPU.
* **Composable**: :class:`RandomResizedCrop`, :class:`RandomHorizontalFlip`, :class:`CenterCrop`,
  :class:`Resize` work on decoded ``(H, W, C)`` ``uint8`` arrays (``Decoder(image="rgb8")``);
  :class:`Normalize` turns ``(H, W, C)``/``(C, H, W)`` images or ``(N, C, H, W)`` batches into
  normalized float32 CHW tensors. :class:`Compose` chains them sharing one random generator.

Randomness protocol (for the loader and for users)
---------------------------------------------------
Every random transform's ``__call__`` takes ``(x, rng=None)``:

* ``x`` is an image, or a **sample dict**. For a sample dict the transform is applied to every
  image field (extensions in :data:`~fastload.loader.decode.IMAGE_EXTENSIONS`, or only the field
  named by ``field=``), other entries are copied, and a new dict is returned.
* The random generator is, in order of precedence: the ``rng`` argument; for a sample dict,
  :func:`sample_rng` of ``sample["__rng_seed__"]``; otherwise a generator seeded from NumPy's
  global generator (reproducible where the worker seeds it, as fastload's loader does per batch,
  but then the draws depend on the batch a sample falls into).

The loader makes augmentation deterministic and resumable by putting ``"__rng_seed__": (seed,
epoch, index)`` into every raw sample before ``decode``/``transform`` run, where ``index`` is the
sample's global index in the dataset (its position in the dataset's un-shuffled order). The draws
then depend only on (seed, epoch, sample), not on the worker, rank, world size, batch size or on
where training was resumed. ``sample_rng`` builds ``numpy.random.default_rng`` from a
``SeedSequence`` over the three integers, so nearby seeds give independent streams. A user
transform that wants the same guarantee calls ``sample_rng(*sample["__rng_seed__"])``.

Transforms hold only their options: they pickle (spawn/forkserver workers) and are thread-safe.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import simplejpeg
import torch
from PIL import Image

from fastload.errors import CorruptDataError, InvalidArgumentError
from fastload.loader.decode import IMAGE_EXTENSIONS, decode_image, is_jpeg

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "RNG_SEED_KEY",
    "CenterCrop",
    "Compose",
    "CropBox",
    "ImageEvalTransform",
    "ImageTrainTransform",
    "Normalize",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "Resize",
    "center_crop_box",
    "random_resized_crop_box",
    "rng_for",
    "sample_rng",
]

#: Sample metadata entry holding ``(seed, epoch, index)`` for :func:`sample_rng`.
RNG_SEED_KEY = "__rng_seed__"
#: ImageNet channel means and standard deviations, in 0..1 units, RGB order.
IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)

Interpolation = Literal["nearest", "bilinear", "bicubic", "lanczos", "box", "hamming"]
_FILTERS: dict[str, Image.Resampling] = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
    "box": Image.Resampling.BOX,
    "hamming": Image.Resampling.HAMMING,
}

#: ``(top, left, height, width)`` in pixels of the source image; top/left inclusive.
CropBox = tuple[int, int, int, int]


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The random generator for one sample of one epoch (see the module docstring).

    Args:
        seed: The run's seed (any int; negative values are mapped to 64-bit two's complement).
        epoch: The epoch number (>= 0).
        index: The sample's global index in the dataset (>= 0).
    """
    return np.random.default_rng([seed & 0xFFFF_FFFF_FFFF_FFFF, epoch, index])


def rng_for(x: Any, rng: np.random.Generator | None = None) -> np.random.Generator:
    """The generator a transform uses for ``x``: ``rng`` if given, else :func:`sample_rng` of a
    sample dict's ``__rng_seed__``, else one seeded from NumPy's global generator."""
    if rng is not None:
        return rng
    if isinstance(x, Mapping) and RNG_SEED_KEY in x:
        seed, epoch, index = x[RNG_SEED_KEY]
        return sample_rng(int(seed), int(epoch), int(index))
    # Drawn from NumPy's global generator, which fastload's loader reseeds per batch from
    # (seed, epoch, step) in its workers (and torch's DataLoader seeds per worker): reproducible
    # there, though not independent of the batch a sample lands in.
    return np.random.default_rng(np.random.randint(0, 2**31 - 1, size=4))


def _check_size(size: int | tuple[int, int], what: str) -> tuple[int, int]:
    """``size`` as ``(height, width)``; an int means a square."""
    hw = (size, size) if isinstance(size, int) else tuple(size)
    if len(hw) != 2 or not all(isinstance(v, int) and v > 0 for v in hw):
        raise InvalidArgumentError(
            f"{what}: size must be a positive int or (height, width), got {size!r}"
        )
    return int(hw[0]), int(hw[1])


def _check_range(value: Sequence[float], what: str, low: float) -> tuple[float, float]:
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


def _header_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) from a JPEG header, or None when it is not a JPEG simplejpeg can read."""
    if not is_jpeg(data):
        return None
    try:
        h, w, _, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    return int(h), int(w)


def _decode_for_box(
    data: bytes, src_hw: tuple[int, int], box: CropBox, out_hw: tuple[int, int], dct_scaling: bool
) -> tuple[np.ndarray, tuple[float, float, float, float]]:
    """Decode a JPEG at the smallest DCT scale (1/8, 1/4, 1/2, 1) keeping >= ``out_hw`` px across ``box``.

    Returns the decoded HWC uint8 RGB array and the box as a float ``(left, top, right, bottom)``
    in that array's coordinates (what PIL's ``resize(box=...)`` takes).
    """
    top, left, ch, cw = box
    height, width = src_hw
    min_h = min_w = 0
    if dct_scaling:
        need = max(out_hw[0] / ch, out_hw[1] / cw)  # decoded px per source px
        # Only 1/2, 1/4 and 1/8: libjpeg-turbo has SIMD kernels for those reduced IDCTs; the other
        # M/8 scales run plain C and are slower than a full-size decode (measured on W1).
        factor = 1.0
        while factor > 0.125 and factor / 2 >= need:
            factor /= 2
        if factor < 1.0:
            min_h, min_w = math.ceil(height * factor), math.ceil(width * factor)
    arr = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=min_h, min_width=min_w)
    sy, sx = arr.shape[0] / height, arr.shape[1] / width
    return arr, (left * sx, top * sy, (left + cw) * sx, (top + ch) * sy)


class _ImageTransform:
    """Base: dispatch a sample dict to its image fields; subclasses implement ``apply``."""

    field: str | None = None

    def apply(self, image: Any, rng: np.random.Generator) -> Any:
        raise NotImplementedError

    def __call__(self, x: Any, rng: np.random.Generator | None = None) -> Any:
        """Transform an image, or every image field of a sample dict (see the module docstring).

        Raises:
            CorruptDataError: An encoded image cannot be decoded (the message names the sample's
                ``__url__`` and ``__key__`` when ``x`` is a sample).
        """
        generator = rng_for(x, rng)
        if not isinstance(x, Mapping):
            return self.apply(x, generator)
        url = str(x.get("__url__", ""))
        key = x.get("__key__")
        out = dict(x)
        for name, value in x.items():
            if name.startswith("__"):
                continue
            if self.field is not None:
                if name != self.field:
                    continue
            elif name.rsplit(".", 1)[-1].lower() not in IMAGE_EXTENSIONS:
                continue
            try:
                out[name] = self.apply(value, generator)
            except CorruptDataError as exc:
                raise CorruptDataError(
                    f"field {name!r}: {exc}", url=url, key=None if key is None else str(key)
                ) from exc
        return out


def _as_rgb_array(image: Any) -> np.ndarray:
    """HWC uint8 from an HWC array, a PIL image or encoded bytes."""
    if isinstance(image, np.ndarray):
        if image.ndim == 2:
            return image[:, :, None]
        if image.ndim != 3:
            raise InvalidArgumentError(
                f"expected an (H, W, C) image array, got shape {image.shape}"
            )
        return image
    if isinstance(image, Image.Image):
        return np.asarray(image if image.mode in ("RGB", "L") else image.convert("RGB"))
    if isinstance(image, (bytes, bytearray, memoryview)):
        return _decode_full(bytes(image))
    if isinstance(image, torch.Tensor):
        raise InvalidArgumentError(
            "this transform takes (H, W, C) uint8 arrays, PIL images or encoded bytes, not tensors; "
            "use Decoder(image='rgb8')"
        )
    raise InvalidArgumentError(f"unsupported image type {type(image).__name__}")


def _decode_full(data: bytes) -> np.ndarray:
    try:
        arr: np.ndarray = decode_image(data, "rgb8")
    except Exception as exc:
        raise CorruptDataError(f"image cannot be decoded ({type(exc).__name__}: {exc})") from exc
    return arr


def _resize_box(
    arr: np.ndarray,
    box: tuple[float, float, float, float],
    out_hw: tuple[int, int],
    resample: Image.Resampling,
) -> Image.Image:
    pil = Image.fromarray(arr[:, :, 0] if arr.shape[2] == 1 else arr)
    return pil.resize((out_hw[1], out_hw[0]), resample, box=box)


def _pil_to_hwc(img: Image.Image) -> np.ndarray:
    arr = np.array(img)  # writable (np.asarray of a PIL image is read-only)
    return arr[:, :, None] if arr.ndim == 2 else arr


def _resize_box_torch(
    arr: np.ndarray, box: tuple[float, float, float, float], out_hw: tuple[int, int]
) -> torch.Tensor:
    """Crop ``box`` (rounded to whole pixels) of an HWC uint8 array and resize it to ``out_hw``
    with antialiased bilinear filtering (same filter as Pillow's); returns a contiguous CHW uint8
    tensor.

    torch's uint8 channels-last kernel is 3-4x faster than Pillow's resize here and writes CHW
    directly, so collation needs no transposing copy.
    """
    h, w = arr.shape[:2]
    left = min(max(0, round(box[0])), w - 1)
    top = min(max(0, round(box[1])), h - 1)
    right = min(max(left + 1, round(box[2])), w)
    bottom = min(max(top + 1, round(box[3])), h)
    region = arr[top:bottom, left:right]
    if not region.flags.writeable:  # torch warns on read-only arrays (e.g. np.asarray(PIL image))
        region = region.copy()
    view = torch.from_numpy(region).permute(2, 0, 1).unsqueeze(0)
    if (bottom - top, right - left) == out_hw:
        return view[0].contiguous()
    out = torch.nn.functional.interpolate(
        view, size=out_hw, mode="bilinear", antialias=True, align_corners=False
    )
    return out[0].contiguous()


class RandomResizedCrop(_ImageTransform):
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
        self.size = _check_size(size, "RandomResizedCrop")
        self.scale = _check_range(scale, "RandomResizedCrop scale", 0.0)
        self.ratio = _check_range(ratio, "RandomResizedCrop ratio", 0.0)
        if interpolation not in _FILTERS:
            raise InvalidArgumentError(f"interpolation must be one of {sorted(_FILTERS)}")
        self.interpolation = interpolation
        self.field = field

    def apply(self, image: Any, rng: np.random.Generator) -> np.ndarray:
        arr = _as_rgb_array(image)
        top, left, h, w = random_resized_crop_box(
            arr.shape[0], arr.shape[1], rng, self.scale, self.ratio
        )
        box = (float(left), float(top), float(left + w), float(top + h))
        return _pil_to_hwc(_resize_box(arr, box, self.size, _FILTERS[self.interpolation]))


class RandomHorizontalFlip(_ImageTransform):
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


class Resize(_ImageTransform):
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
        _check_size(size, "Resize")
        self.interpolation = interpolation
        self.field = field

    def apply(self, image: Any, rng: np.random.Generator) -> np.ndarray:
        arr = _as_rgb_array(image)
        h, w = arr.shape[:2]
        if isinstance(self.size, int):
            f = self.size / min(h, w)
            out = (max(1, round(h * f)), max(1, round(w * f)))
        else:
            out = self.size
        box = (0.0, 0.0, float(w), float(h))
        return _pil_to_hwc(_resize_box(arr, box, out, _FILTERS[self.interpolation]))


class CenterCrop(_ImageTransform):
    """Cut the central ``size`` box (clamped to the image). Output: an ``(h, w, C)`` view."""

    def __init__(self, size: int | tuple[int, int], *, field: str | None = None) -> None:
        self.size = _check_size(size, "CenterCrop")
        self.field = field

    def apply(self, image: Any, rng: np.random.Generator) -> np.ndarray:
        arr = _as_rgb_array(image)
        top, left, h, w = center_crop_box(arr.shape[0], arr.shape[1], self.size, None)
        return arr[top : top + h, left : left + w]


class Normalize:
    """``(x / 255 - mean) / std`` as float32 CHW tensors; for single images or whole batches.

    Input: a ``(H, W, C)`` uint8 array (converted to CHW), a ``(C, H, W)`` uint8/float tensor, or a
    batch ``(N, C, H, W)`` tensor — on any device, so a uint8 batch can be normalized on the GPU
    after the transfer (4x fewer bytes to copy). Values are in 0..255 units before normalization.
    Sample dicts: every image field is normalized.

    Args:
        mean: Per-channel means in 0..1 units (ImageNet's by default).
        std: Per-channel standard deviations in 0..1 units.
        dtype: Output floating dtype (float32 default; float16/bfloat16 for mixed precision).
    """

    def __init__(
        self,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if len(mean) != len(std) or any(s <= 0 for s in std):
            raise InvalidArgumentError(
                f"Normalize: mean and std need the same length and std > 0, got {mean!r}, {std!r}"
            )
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        self.dtype = dtype
        # x * scale + shift == (x / 255 - mean) / std
        self._scale = [1.0 / (255.0 * s) for s in self.std]
        self._shift = [-m / s for m, s in zip(self.mean, self.std)]

    def __call__(self, x: Any, rng: np.random.Generator | None = None) -> Any:
        if isinstance(x, Mapping):
            return {
                k: (
                    self(v)
                    if not k.startswith("__") and k.rsplit(".", 1)[-1].lower() in IMAGE_EXTENSIONS
                    else v
                )
                for k, v in x.items()
            }
        if isinstance(x, np.ndarray):
            if x.ndim != 3:
                raise InvalidArgumentError(f"Normalize: expected an (H, W, C) array, got {x.shape}")
            t = torch.from_numpy(np.ascontiguousarray(x)).permute(2, 0, 1)
        elif isinstance(x, torch.Tensor):
            t = x
        else:
            raise InvalidArgumentError(f"Normalize: unsupported input {type(x).__name__}")
        if t.ndim not in (3, 4) or t.shape[-3] != len(self.mean):
            raise InvalidArgumentError(
                f"Normalize: expected (C, H, W) or (N, C, H, W) with C={len(self.mean)}, "
                f"got {tuple(t.shape)}"
            )
        shape = (len(self.mean), 1, 1)
        scale = torch.tensor(self._scale, dtype=self.dtype, device=t.device).view(shape)
        shift = torch.tensor(self._shift, dtype=self.dtype, device=t.device).view(shape)
        out = (
            t.to(self.dtype).mul_(scale).add_(shift) if t.dtype != self.dtype else t * scale + shift
        )
        return out.contiguous()

    def __repr__(self) -> str:
        return f"Normalize(mean={self.mean}, std={self.std}, dtype={self.dtype})"


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


_NormalizeOn = Literal["sample", "batch"]


class _FusedJpegTransform(_ImageTransform):
    """Common parts of the fused train/eval transforms: decode for a box, resize, emit."""

    size: tuple[int, int]
    dct_scaling: bool
    interpolation: Interpolation
    normalize_on: _NormalizeOn
    normalize: Normalize

    def _box(self, height: int, width: int, rng: np.random.Generator) -> CropBox:
        raise NotImplementedError

    def _flip(self, rng: np.random.Generator) -> bool:
        return False

    def apply(self, image: Any, rng: np.random.Generator) -> torch.Tensor:
        resample = _FILTERS[self.interpolation]
        hw = None
        if isinstance(image, (bytes, bytearray, memoryview)):
            data = bytes(image)
            hw = _header_size(data)
            if hw is None:  # not a JPEG (or one simplejpeg cannot read): full decode
                image = _decode_full(data)
        if hw is not None:
            box = self._box(hw[0], hw[1], rng)
            try:
                arr, fbox = _decode_for_box(data, hw, box, self.size, self.dct_scaling)
            except ValueError:
                arr = _decode_full(data)  # CMYK & co. via Pillow; raises CorruptDataError
                top, left, h, w = box
                fbox = (float(left), float(top), float(left + w), float(top + h))
        else:
            arr = _as_rgb_array(image)
            top, left, h, w = self._box(arr.shape[0], arr.shape[1], rng)
            fbox = (float(left), float(top), float(left + w), float(top + h))
        out: torch.Tensor
        if self.interpolation == "bilinear" and arr.shape[2] == 3:
            out = _resize_box_torch(arr, fbox, self.size)
            if self._flip(rng):
                out = out.flip(-1)
        else:
            pil = _resize_box(arr, fbox, self.size, resample)
            if self._flip(rng):
                pil = pil.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            out = torch.from_numpy(_pil_to_hwc(pil)).permute(2, 0, 1)  # CHW view, uint8
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


class ImageTrainTransform(_FusedJpegTransform):
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
        dct_scaling: Decode JPEGs at reduced DCT scale when the crop allows (default True);
            False always decodes the full resolution.
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
        normalize_on: _NormalizeOn = "batch",
        dct_scaling: bool = True,
        interpolation: Interpolation = "bilinear",
        field: str | None = None,
    ) -> None:
        self.size = _check_size(size, "ImageTrainTransform")
        self.scale = _check_range(scale, "ImageTrainTransform scale", 0.0)
        self.ratio = _check_range(ratio, "ImageTrainTransform ratio", 0.0)
        if not 0.0 <= flip_p <= 1.0:
            raise InvalidArgumentError(
                f"ImageTrainTransform: flip_p must be in [0, 1], got {flip_p}"
            )
        if normalize_on not in ("sample", "batch"):
            raise InvalidArgumentError("normalize_on must be 'sample' or 'batch'")
        if interpolation not in _FILTERS:
            raise InvalidArgumentError(f"interpolation must be one of {sorted(_FILTERS)}")
        self.flip_p = flip_p
        self.normalize = Normalize(mean, std)
        self.normalize_on = normalize_on
        self.dct_scaling = dct_scaling
        self.interpolation = interpolation
        self.field = field

    def _box(self, height: int, width: int, rng: np.random.Generator) -> CropBox:
        return random_resized_crop_box(height, width, rng, self.scale, self.ratio)

    def _flip(self, rng: np.random.Generator) -> bool:
        return bool(rng.random() < self.flip_p)


class ImageEvalTransform(_FusedJpegTransform):
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
        normalize_on: _NormalizeOn = "batch",
        dct_scaling: bool = True,
        interpolation: Interpolation = "bilinear",
        field: str | None = None,
    ) -> None:
        self.size = _check_size(size, "ImageEvalTransform")
        if resize < max(self.size):
            raise InvalidArgumentError(
                f"ImageEvalTransform: resize ({resize}) must be >= size {self.size}"
            )
        if normalize_on not in ("sample", "batch"):
            raise InvalidArgumentError("normalize_on must be 'sample' or 'batch'")
        self.resize = resize
        self.normalize = Normalize(mean, std)
        self.normalize_on = normalize_on
        self.dct_scaling = dct_scaling
        self.interpolation = interpolation
        self.field = field

    def _box(self, height: int, width: int, rng: np.random.Generator) -> CropBox:
        return center_crop_box(height, width, self.size, self.resize)
