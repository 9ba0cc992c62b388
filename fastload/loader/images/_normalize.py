"""Normalization: uint8 images or batches to ``(x / 255 - mean) / std`` float CHW tensors."""

from __future__ import annotations

import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fastload.errors import InvalidArgumentError
from fastload.loader.images._fields import is_image_field

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "Normalize"]

#: ImageNet channel means and standard deviations, in 0..1 units, RGB order.
IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)


#: Batch outputs a :class:`Normalize` keeps for reuse: the batch the loop holds and the next
#: (77 MB of float32 at 64 x 3 x 224 x 224; a loop that holds more gets fresh ones, as before).
_POOL_SIZE = 2


def _storage_uses(t: torch.Tensor) -> int | None:
    """How many tensors (and storage objects) share ``t``'s storage; ``None`` where this torch
    cannot tell (then nothing is reused)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    return int(count(t.untyped_storage()._cdata))


class _OutputPool:
    """Float batch outputs of one :class:`Normalize`, reused once nothing else refers to them.

    A fresh 38 MB output (64 x 3 x 224 x 224 float32) is above glibc's largest mmap threshold,
    so every batch maps new memory and takes a page fault per 4 KiB page on first write: that
    was 12 of the 14 ms a batch's normalization took (one core). An output is handed out again
    only when no Python reference to it is left but the pool's own and no other tensor (a
    view, a slice) shares its storage: both counts equal what they were when the pool made it.
    Anything still holding the batch, or any part of it, keeps it out of reuse.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: list[tuple[torch.Tensor, int, int]] = []  # tensor, refs, storage uses

    def get(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised CPU tensor of ``shape`` and ``dtype``: a free pooled one, else new."""
        with self._lock:
            entries = self._entries
            for i, (out, refs, uses) in enumerate(entries):
                # References now: the entry, ``out`` and the call's argument, as when made.
                if (
                    out.shape == shape
                    and out.dtype == dtype
                    and sys.getrefcount(out) == refs
                    and _storage_uses(out) == uses
                ):
                    entries.append(entries.pop(i))  # most recently used last
                    return out
            out = torch.empty(shape, dtype=dtype)
            made_uses = _storage_uses(out)
            if made_uses is None:
                return out
            if len(entries) >= _POOL_SIZE:
                entries.pop(0)
            entries.append((out, 0, made_uses))
            refs = sys.getrefcount(out)  # the entry, ``out`` and the argument, as in the loop
            entries[-1] = (out, refs, made_uses)
            return out


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
        self._outputs = _OutputPool()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_outputs"]  # per process: a copy makes its own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._outputs = _OutputPool()

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
        if t.dtype == self.dtype:
            out = t * scale + shift
        elif t.ndim == 4 and t.device.type == "cpu":  # a batch: into a reused output
            out = self._outputs.get(t.shape, self.dtype)
            out.copy_(t).mul_(scale).add_(shift)
        else:
            out = t.to(self.dtype).mul_(scale).add_(shift)
        return out.contiguous()

    def __repr__(self) -> str:
        return f"Normalize(mean={self.mean}, std={self.std}, dtype={self.dtype})"
