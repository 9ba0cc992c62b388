"""Moving batches to an accelerator ahead of use."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from fastload.errors import InvalidArgumentError

__all__ = ["resolve_device", "to_device", "prefetch_to_device"]


def resolve_device(device: str | torch.device | None) -> torch.device | None:
    """``None`` for the CPU (no transfer), else a CUDA device that exists.

    Raises:
        InvalidArgumentError: An unknown device string, or CUDA requested without a GPU.
    """
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgumentError(f"device {device!r} is not a torch device: {exc}") from exc
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        raise InvalidArgumentError(
            f"device={device!r}: fastload moves batches only to 'cuda' devices (or 'cpu' for none)"
        )
    if not torch.cuda.is_available():
        raise InvalidArgumentError(
            f"device={device!r} but torch.cuda.is_available() is False (no GPU or a CPU-only "
            "torch build); pass device=None"
        )
    return dev


def to_device(obj: Any, device: torch.device, *, non_blocking: bool = True) -> Any:
    """Move the tensors inside ``obj`` (tensors, mappings, lists, tuples) to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, Mapping):
        return {k: to_device(v, device, non_blocking=non_blocking) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(to_device(v, device, non_blocking=non_blocking) for v in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(to_device(v, device, non_blocking=non_blocking) for v in obj)
    return obj


def _record(obj: Any, stream: Any) -> None:
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            obj.record_stream(stream)
    elif isinstance(obj, Mapping):
        for v in obj.values():
            _record(v, stream)
    elif isinstance(obj, list | tuple):
        for v in obj:
            _record(v, stream)


def prefetch_to_device(items: Iterable[tuple[Any, Any]], device: torch.device) -> Iterator[Any]:
    """Yield ``(meta, batch)`` with ``batch`` on ``device``, copied one item ahead on a side stream.

    The copy of item ``k + 1`` is issued on a separate CUDA stream before item ``k`` is handed
    out, so the host-to-device transfer overlaps with the consumer's work on item ``k``. Batches
    should be pinned (``pin_memory=True``) for the copies to be asynchronous. The consumer's
    current stream waits for the copy before it gets the batch, and the tensors are recorded on it
    so their memory is not reused too early.
    """
    side = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    pending: tuple[Any, Any, Any] | None = None
    for meta, batch in items:
        with torch.cuda.stream(side):
            moved = to_device(batch, device, non_blocking=True)
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record(side)
        if pending is not None:
            yield _hand_out(pending, device)
        pending = (meta, moved, ready)
    if pending is not None:
        yield _hand_out(pending, device)


def _hand_out(pending: tuple[Any, Any, Any], device: torch.device) -> tuple[Any, Any]:
    meta, batch, ready = pending
    current = torch.cuda.current_stream(device)
    current.wait_event(ready)
    _record(batch, current)
    return meta, batch
