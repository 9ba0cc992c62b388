"""Normalization: uint8 images or batches to ``(x / 255 - mean) / std`` float CHW tensors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fastload.errors import InvalidArgumentError
from fastload.loader._image_fields import is_image_field

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "Normalize"]

#: ImageNet channel means and standard deviations, in 0..1 units, RGB order.
IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)


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
        """Normalize ``x`` (``rng`` is accepted for the transform protocol and not used)."""
        if isinstance(x, Mapping):
            return {k: self(v) if is_image_field(k) else v for k, v in x.items()}
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
