"""Where this process sits in a distributed job: its rank and the world size."""

from __future__ import annotations

import os

from fastload.errors import InvalidArgumentError

__all__ = ["detect_rank_world"]


def _env_int(name: str) -> int | None:
    text = os.environ.get(name)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise InvalidArgumentError(
            f"environment variable {name}={text!r} is not an integer; unset it or fix it"
        ) from None


def detect_rank_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """Return ``(rank, world_size)`` for this process.

    Explicit arguments win. Otherwise: ``torch.distributed`` when it is available and a process
    group is initialised; else the ``RANK`` and ``WORLD_SIZE`` environment variables (as set by
    ``torchrun``); else ``(0, 1)``.

    Raises:
        InvalidArgumentError: Inconsistent values (rank outside ``[0, world_size)``).
    """
    detected_rank, detected_world = 0, 1
    try:
        import torch.distributed as dist

        initialised = dist.is_available() and dist.is_initialized()
    except ImportError:  # pragma: no cover - torch is a core dependency
        initialised = False
    if initialised:
        detected_rank, detected_world = dist.get_rank(), dist.get_world_size()
    else:
        env_world = _env_int("WORLD_SIZE")
        env_rank = _env_int("RANK")
        if env_world is not None:
            detected_world = env_world
            detected_rank = env_rank if env_rank is not None else 0
    r = detected_rank if rank is None else rank
    w = detected_world if world_size is None else world_size
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise InvalidArgumentError(f"world_size must be a positive int, got {w!r}")
    if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < w:
        raise InvalidArgumentError(
            f"rank must be an int in [0, world_size={w}), got {r!r}; check RANK/WORLD_SIZE or "
            "the rank/world_size arguments"
        )
    return r, w
