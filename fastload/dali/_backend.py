"""Importing DALI lazily, and choosing where a pipeline runs (CPU or a GPU).

Nothing here imports ``nvidia.dali`` at module import time, so ``import fastload.dali`` works
without DALI installed; the first call that needs DALI raises
:class:`~fastload.errors.MissingDependencyError` with the install command.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any, Literal

from fastload._plugins import require
from fastload.errors import InvalidArgumentError

if TYPE_CHECKING:
    from fastload.loader import Launch

__all__ = ["Device", "dali_available", "gpu_available", "local_rank", "require_dali", "resolve"]

#: Where a pipeline runs: ``"cpu"`` (``device_id=None``), ``"gpu"`` (mixed decode on the GPU).
Device = Literal["cpu", "gpu"]

_FEATURE = "fastload.dali (DALI pipelines)"


def require_dali() -> Any:
    """Import and return ``nvidia.dali``.

    Raises:
        MissingDependencyError: DALI is not installed; the message says
            ``pip install 'fastload[dali]'``.
    """
    require("nvidia.dali.fn", extra="dali", feature=_FEATURE)
    return require("nvidia.dali", extra="dali", feature=_FEATURE)


def dali_available() -> bool:
    """True when ``nvidia.dali`` can be imported (does not import it)."""
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except (ImportError, ValueError):
        return False


def gpu_available() -> bool:
    """True when a CUDA GPU is usable from this process (``torch.cuda.is_available()``)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a core dependency
        return False
    return bool(torch.cuda.is_available() and torch.cuda.device_count() > 0)


def local_rank(launch: Launch) -> int:
    """The GPU this process drives: the launcher's local rank (``LOCAL_RANK``,
    ``OMPI_COMM_WORLD_LOCAL_RANK``, ``SLURM_LOCALID``, ..., see :func:`fastload.loader.detect_launch`),
    else the rank modulo the number of visible GPUs."""
    if launch.local_rank is not None:
        return launch.local_rank
    import torch

    count = torch.cuda.device_count()
    return launch.rank % count if count else 0


def resolve(device: str) -> Device:
    """``"auto"`` → ``"gpu"`` when a GPU is usable, else ``"cpu"``; ``"gpu"``/``"cuda"`` checked.

    Raises:
        InvalidArgumentError: An unknown device, or ``"gpu"`` without a usable GPU.
    """
    name = str(device).lower()
    if name == "auto":
        return "gpu" if gpu_available() else "cpu"
    if name == "cpu":
        return "cpu"
    if name in ("gpu", "cuda", "mixed"):
        if not gpu_available():
            raise InvalidArgumentError(
                f"device={device!r} needs a CUDA GPU, but torch.cuda.is_available() is False (no "
                "GPU, no driver, or a CPU-only torch build). Use device='cpu' (or 'auto', which "
                "falls back to the CPU)"
            )
        return "gpu"
    raise InvalidArgumentError(f"device must be 'auto', 'cpu' or 'gpu', got {device!r}")
