"""The image augmentation part of a DALI pipeline: a standard recipe, or the user's own graph.

An *augmentation* is any callable ``augment(images, labels, *, device) -> outputs`` where
``images`` is the DataNode of **encoded** image bytes (on the CPU), ``labels`` the DataNode of
int64 labels, and ``device`` is ``"cpu"`` or ``"gpu"`` (decode with ``device="mixed"`` on a GPU
pipeline, ``"cpu"`` otherwise; :func:`decoder_device` says which). It returns a DataNode or a tuple
of DataNodes: the pipeline's outputs, in order, handed to the training loop as torch tensors.

:class:`ImageAugment` is the standard recipe: decode, random-resized-crop (or resize + center
crop for evaluation), horizontal flip, optional colour jitter, normalize, layout and dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from fastload.dali._backend import Device, require_dali
from fastload.errors import InvalidArgumentError
from fastload.loader import IMAGENET_MEAN, IMAGENET_STD

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "AugmentFn", "ImageAugment", "decoder_device"]


class AugmentFn(Protocol):
    """``augment(images, labels, *, device) -> DataNode or tuple of DataNodes`` (see module doc)."""

    def __call__(self, images: Any, labels: Any, *, device: Device) -> Any: ...


def decoder_device(device: Device) -> str:
    """The ``device=`` for DALI's image decoders: ``"mixed"`` on a GPU pipeline, else ``"cpu"``."""
    return "mixed" if device == "gpu" else "cpu"


def _pair(value: Any, name: str) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{name} must be a pair (low, high), got {value!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo <= 0 or lo > hi:
        raise InvalidArgumentError(f"{name} must satisfy 0 < low <= high, got {value!r}")
    return lo, hi


_INTERP = {"nearest": "INTERP_NN", "linear": "INTERP_LINEAR", "cubic": "INTERP_CUBIC"}


@dataclass(frozen=True)
class ImageAugment:
    """The standard image recipe, built into the pipeline by calling it (see :class:`AugmentFn`).

    Training (``train=True``): decode → random-resized-crop (area fraction in ``scale``, aspect
    ratio width/height in ``ratio``, as torchvision's ``RandomResizedCrop``) → resize to ``size``
    → optional colour jitter → horizontal flip with probability ``flip_p`` → normalize.
    Evaluation (``train=False``): decode → resize the shorter side to ``resize`` → center crop
    ``size`` → normalize (no randomness).

    Randomness comes from DALI operators seeded by the pipeline's seed, which
    :class:`~fastload.dali.DALILoader` derives from (seed, epoch): the same seed and epoch give the
    same images on every run (for the same number of threads and batch size).

    Attributes:
        size: Output side, or ``(height, width)``, in pixels. Default 224.
        train: Training recipe (random) or evaluation recipe (deterministic).
        scale: Random crop area as a fraction of the image area. Default ``(0.08, 1.0)``.
        ratio: Random crop aspect ratio range (width / height). Default ``(3/4, 4/3)``.
        flip_p: Probability of a horizontal flip (training only). Default 0.5.
        resize: Evaluation: shorter side before the center crop; default ``size * 256 / 224``.
        brightness, contrast, saturation: Jitter strength ``j``: a factor drawn uniformly from
            ``[1 - j, 1 + j]`` per image (0 = off), as torchvision's ``ColorJitter``.
        hue: Hue jitter ``h`` in ``[0, 0.5]``: a shift drawn from ``[-h, h]`` turns (x 360
            degrees), as torchvision's ``ColorJitter`` (0 = off).
        mean, std: Per-channel normalization in **0..1 units** (ImageNet's by default); DALI gets
            them multiplied by 255: ``out = (pixel - 255 mean) / (255 std)``.
        dtype: ``"float32"`` or ``"float16"`` output.
        layout: ``"CHW"`` (batches are NCHW, the default) or ``"HWC"`` (NHWC).
        fused_decode: Training: decode only the crop window (``fn.decoders.image_random_crop``),
            faster; ``False`` decodes whole images, then crops (``fn.random_resized_crop``).
        interpolation: ``"linear"`` (default), ``"cubic"`` or ``"nearest"``.
        antialias: Antialias when downscaling (as PIL and torchvision's antialiased resize).
    """

    size: int | tuple[int, int] = 224
    train: bool = True
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip_p: float = 0.5
    resize: int | None = None
    brightness: float = 0.0
    contrast: float = 0.0
    saturation: float = 0.0
    hue: float = 0.0
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    dtype: Literal["float32", "float16"] = "float32"
    layout: Literal["CHW", "HWC"] = "CHW"
    fused_decode: bool = True
    interpolation: Literal["linear", "cubic", "nearest"] = "linear"
    antialias: bool = True

    def __post_init__(self) -> None:
        h, w = self.hw
        if min(h, w) < 1:
            raise InvalidArgumentError(f"size must be positive, got {self.size!r}")
        _pair(self.scale, "scale")
        if self.scale[1] > 1.0:
            raise InvalidArgumentError(f"scale must lie in (0, 1], got {self.scale!r}")
        _pair(self.ratio, "ratio")
        if not 0.0 <= self.flip_p <= 1.0:
            raise InvalidArgumentError(f"flip_p must lie in [0, 1], got {self.flip_p!r}")
        if self.resize is not None and self.resize < min(h, w):
            raise InvalidArgumentError(
                f"resize={self.resize} is smaller than the crop {self.size!r}; use resize >= size"
            )
        for name in ("brightness", "contrast", "saturation"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise InvalidArgumentError(f"{name} must lie in [0, 1), got {value!r}")
        if not 0.0 <= self.hue <= 0.5:
            raise InvalidArgumentError(f"hue must lie in [0, 0.5], got {self.hue!r}")
        if len(self.mean) != 3 or len(self.std) != 3 or any(s <= 0 for s in self.std):
            raise InvalidArgumentError(
                f"mean and std need 3 values (RGB, 0..1 units; std > 0), got {self.mean!r}, "
                f"{self.std!r}"
            )
        if self.dtype not in ("float32", "float16"):
            raise InvalidArgumentError(f"dtype must be 'float32' or 'float16', got {self.dtype!r}")
        if self.layout not in ("CHW", "HWC"):
            raise InvalidArgumentError(f"layout must be 'CHW' or 'HWC', got {self.layout!r}")
        if self.interpolation not in _INTERP:
            raise InvalidArgumentError(
                f"interpolation must be one of {sorted(_INTERP)}, got {self.interpolation!r}"
            )

    @property
    def hw(self) -> tuple[int, int]:
        """``(height, width)`` of the output images."""
        if isinstance(self.size, int):
            return self.size, self.size
        h, w = self.size
        return int(h), int(w)

    @property
    def jitter(self) -> bool:
        """True when any colour jitter is on."""
        return bool(self.brightness or self.contrast or self.saturation or self.hue)

    def __call__(self, images: Any, labels: Any, *, device: Device) -> tuple[Any, Any]:
        """Add the recipe to the pipeline being defined; returns ``(images, labels)``."""
        dali = require_dali()
        fn, types = dali.fn, dali.types
        h, w = self.hw
        interp = getattr(types, _INTERP[self.interpolation])
        decode = decoder_device(device)
        mirror: Any = 0
        crop: list[int] | None = None
        if self.train:
            if self.fused_decode:
                images = fn.decoders.image_random_crop(
                    images,
                    device=decode,
                    output_type=types.RGB,
                    random_area=list(self.scale),
                    random_aspect_ratio=list(self.ratio),
                    num_attempts=10,
                )
                images = fn.resize(
                    images, resize_x=w, resize_y=h, interp_type=interp, antialias=self.antialias
                )
            else:
                images = fn.decoders.image(images, device=decode, output_type=types.RGB)
                images = fn.random_resized_crop(
                    images,
                    size=[h, w],
                    random_area=list(self.scale),
                    random_aspect_ratio=list(self.ratio),
                    num_attempts=10,
                    interp_type=interp,
                    antialias=self.antialias,
                )
            if self.flip_p > 0:
                mirror = fn.random.coin_flip(probability=self.flip_p)
        else:
            images = fn.decoders.image(images, device=decode, output_type=types.RGB)
            shorter = self.resize if self.resize is not None else round(min(h, w) * 256 / 224)
            images = fn.resize(
                images, resize_shorter=shorter, interp_type=interp, antialias=self.antialias
            )
            crop = [h, w]
        if self.train and self.jitter:
            images = self._jitter(fn, images)
        images = fn.crop_mirror_normalize(
            images,
            dtype=types.FLOAT16 if self.dtype == "float16" else types.FLOAT,
            output_layout=self.layout,
            crop=crop,
            mean=[255.0 * m for m in self.mean],
            std=[255.0 * s for s in self.std],
            mirror=mirror,
        )
        return images, labels

    def _jitter(self, fn: Any, images: Any) -> Any:
        kwargs: dict[str, Any] = {}
        for name in ("brightness", "contrast", "saturation"):
            j = getattr(self, name)
            if j:
                kwargs[name] = fn.random.uniform(range=[1.0 - j, 1.0 + j])
        if self.hue:
            kwargs["hue"] = fn.random.uniform(range=[-360.0 * self.hue, 360.0 * self.hue])
        return fn.color_twist(images, **kwargs)


def check_augment(augment: object) -> Callable[..., Any]:
    """Validate the ``augment=`` argument (an :class:`AugmentFn`)."""
    if not callable(augment):
        raise InvalidArgumentError(
            "augment must be an ImageAugment or a callable augment(images, labels, *, device) "
            f"returning DALI DataNodes, got {type(augment).__name__}"
        )
    return augment
