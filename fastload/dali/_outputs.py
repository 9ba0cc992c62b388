"""DALI's pipeline outputs as torch tensors, and the per-batch numbers ``stats()`` counts.

A pipeline's outputs are the augmentation's outputs plus a metadata output (external mode: one
``[dataset index, raw bytes, padding]`` row per sample, :data:`~fastload.dali._source.
META_COLUMNS`; native mode: the image shapes). Output 1 is the labels: integers, parsed from the
ASCII bytes of a ``cls`` field where DALI's native WebDataset reader hands those over.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from fastload.dali._backend import Device, require_dali
from fastload.dali._native import NativePlan
from fastload.errors import WorkerError

__all__ = ["convert_batch", "to_torch"]


def convert_batch(
    outputs: Sequence[Any],
    step: int,
    plan: NativePlan | None,
    *,
    device: Device,
    device_id: int | None,
) -> tuple[tuple[Any, ...], int, int, int]:
    """Torch tensors of the batch of global ``step``, and its (size, padded rows, bytes).

    ``plan`` is the native reader's sharding (its padding rows are cut off), ``None`` in external
    mode (padding is flagged in the metadata rows).
    """
    *data, meta = outputs
    metas = _to_numpy(meta)
    if plan is None:
        rows = len(metas)
        keep: int | None = None
        padded = int(metas[:, 2].sum()) if rows else 0
        nbytes = int(metas[:, 1].sum()) if rows else 0
    else:
        keep, padded = plan.kept_rows(step)
        rows = keep
        nbytes = int(metas[:keep].sum())
    converted = []
    for position, tl in enumerate(data):
        value = to_torch(tl, label=position == 1, device=device, device_id=device_id)
        if keep is not None:
            value = value[:keep]
        converted.append(value)
    return tuple(converted), rows, padded, nbytes


def to_torch(tl: Any, *, label: bool, device: Device, device_id: int | None) -> Any:
    """One DALI TensorList as a torch tensor (a list of tensors for images of several shapes
    on the CPU); labels become int64 ``(B,)``, on the GPU for ``device="gpu"``."""
    import torch

    if device == "gpu" and _on_gpu(tl):
        return _gpu_tensor(tl, device_id or 0)
    if tl.is_dense_tensor():
        arr = np.array(tl.as_tensor())
    else:
        items = [np.array(tl[i]) for i in range(len(tl))]
        if not label:
            return [torch.from_numpy(a) for a in items]
        arr = np.array([_parse_label(a) for a in items], dtype=np.int64)
    if label and arr.dtype == np.uint8:  # native webdataset: the label field's ASCII bytes
        arr = np.array([_parse_label(a) for a in arr], dtype=np.int64)
    if label and arr.ndim == 2 and arr.shape[1] == 1:
        arr = arr.reshape(-1)
    tensor = torch.from_numpy(arr)
    if label and device == "gpu":
        tensor = tensor.to(f"cuda:{device_id or 0}", non_blocking=True)
    return tensor


def _on_gpu(tl: Any) -> bool:
    backend: Any = require_dali().backend
    return isinstance(tl, backend.TensorListGPU)


def _to_numpy(tl: Any) -> Any:
    if _on_gpu(tl):
        tl = tl.as_cpu()
    if len(tl) == 0:
        return np.zeros((0, 3), dtype=np.int64)
    return np.array(tl.as_tensor())


def _parse_label(data: Any) -> int:
    text = bytes(np.asarray(data, dtype=np.uint8)).decode("ascii", "replace").strip()
    try:
        return int(text)
    except ValueError:
        raise WorkerError(
            f"label bytes {text!r} are not an integer; DALI pipelines take integer labels (cls)"
        ) from None


def _gpu_tensor(tl: Any, device_index: int) -> Any:
    import torch

    plugin: Any = importlib.import_module("nvidia.dali.plugin.pytorch")
    feed_ndarray, to_torch_type = plugin.feed_ndarray, plugin.to_torch_type

    if not tl.is_dense_tensor():
        raise WorkerError(
            "a GPU output of the augmentation has samples of different shapes; resize or crop "
            "to a fixed size so the batch is one tensor"
        )
    tensor = tl.as_tensor()
    device = torch.device("cuda", device_index)
    out = torch.empty(tensor.shape(), dtype=to_torch_type[tl.dtype], device=device)
    stream = torch.cuda.current_stream(device)
    feed_ndarray(tl, out, cuda_stream=stream)
    return out
