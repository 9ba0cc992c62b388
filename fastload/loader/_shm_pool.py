"""The shared-memory blocks that collation fills inside DataLoader workers, reused across batches.

Inside the worker processes of :class:`fastload.DataLoader`, the buffers that collation fills
(:class:`~fastload.loader._packed.PackedBytes` and stacked tensors of at least
:data:`POOL_MIN_BYTES`) come from a small per-worker pool of shared-memory blocks
(:class:`BufferPool`). A block is handed out again only after the main process has dropped every
tensor, array or memoryview that refers to it (the loader watches the storages with weak
references, :class:`~fastload.loader._collate.BufferReleaser`, and marks the block free in a
shared table), so reuse never changes data a user still holds. Reuse matters because fresh
shared memory costs a page fault per 4 KiB page on first write, which on the benchmark machine
cost more than the copy itself (~80 us per 100 KB sample). Where no block is free (the user keeps
batches, ``pin_memory`` copies them elsewhere, a custom batch type hides the tensors) collation
allocates fresh shared memory as torch does.

This module is the worker side and the allocator (:func:`alloc_uint8`); it knows nothing of
batch structure, so that the batch types can allocate from it.
"""

from __future__ import annotations

import os

import numpy as np
import numpy.typing as npt
import torch
import torch.multiprocessing
from torch.utils.data import get_worker_info

from fastload._os import populate

__all__ = ["POOL_MIN_BYTES", "BufferPool", "alloc_uint8", "pooling", "set_buffer_pool"]

#: Collation buffers at least this large come from the worker's reusable shared-memory pool.
POOL_MIN_BYTES = 256 * 1024
_ALIGN = 1 << 20  # pool blocks are sized in MiB steps, with headroom, so blocks fit later batches


class BufferPool:
    """Reusable shared-memory blocks of one DataLoader worker process (see the module docstring).

    ``flags`` is this worker's row of a shared ``int64`` table made in the main process: entry
    ``i`` is 0 when block ``i`` is free, else the token of the batch that holds it. Only the
    worker sets an entry to a token (from 0, or over the stale token of a previous worker
    process when it creates block ``i``); only the main process sets it from that token back
    to 0 (:class:`BufferReleaser`, which compares first), so no lock is needed. Tokens hold the
    worker's pid, so a token of a dead worker never matches a block of its successor.

    Memory: a block is made for a batch's size plus 25 % (rounded up to 1 MiB) and kept; a
    worker holds about as many blocks as it has batches in flight (``prefetch_factor`` plus
    the one or two the training loop holds), at most ``len(flags)``.

    Needs torch's ``file_descriptor`` sharing strategy (the Linux default): blocks are told apart
    by the inode of their shared-memory file. Not thread-safe: collation runs in the worker's
    main thread.
    """

    @staticmethod
    def supported() -> bool:
        """Whether blocks can be pooled in this process (``file_descriptor`` sharing)."""
        strategy = torch.multiprocessing.get_sharing_strategy()  # type: ignore[no-untyped-call]
        return bool(strategy == "file_descriptor")

    def __init__(self, flags: torch.Tensor) -> None:
        self._flags: npt.NDArray[np.int64] = flags.numpy()
        self._blocks: list[tuple[torch.UntypedStorage, int] | None] = [None] * len(self._flags)
        self._counter = 0
        self._used: list[tuple[int, int, int]] = []

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A ``uint8`` tensor of ``nbytes`` in shared memory, from a free block when one fits."""
        flags, blocks = self._flags, self._blocks
        small = empty = -1  # a free block too small to use; a slot without a block
        for i, block in enumerate(blocks):
            if block is None:
                empty = i if empty < 0 else empty
            elif flags[i] == 0:
                if block[0].nbytes() >= nbytes:
                    return self._hand_out(i, block, nbytes)
                small = i if small < 0 else small
        # Replace a free block that is too small before adding one, so that the pool holds
        # about as many blocks as batches are in flight.
        slot = small if small >= 0 else empty
        if slot < 0:
            return _new_shared(nbytes)  # every block is held: fresh memory, as torch does
        blocks[slot] = None  # free the old block before making the new one
        capacity = -(-(nbytes + nbytes // 4) // _ALIGN) * _ALIGN
        storage = torch.UntypedStorage._new_shared(capacity)  # type: ignore[no-untyped-call]
        populate(storage.data_ptr(), capacity)
        fd = storage._share_fd_cpu_()[0]
        block = (storage, os.fstat(fd).st_ino)
        blocks[slot] = block
        return self._hand_out(slot, block, nbytes)

    def _hand_out(
        self, i: int, block: tuple[torch.UntypedStorage, int], nbytes: int
    ) -> torch.Tensor:
        self._counter = (self._counter + 1) & 0xFFFFFF
        token = (os.getpid() << 24) | self._counter | 1
        self._flags[i] = token
        self._used.append((block[1], i, token))
        out = torch.empty(0, dtype=torch.uint8)
        out.set_(block[0], 0, (nbytes,))  # type: ignore[call-overload]
        return out

    def take_used(self) -> tuple[tuple[int, int, int], ...]:
        """``(inode, block, token)`` of the blocks handed out since the last call."""
        used, self._used = tuple(self._used), []
        return used


_POOL: BufferPool | None = None  # this process's pool, installed by BatchStream in workers


def set_buffer_pool(pool: BufferPool | None) -> BufferPool | None:
    """Install the collation pool of this process; returns the previous one."""
    global _POOL
    old, _POOL = _POOL, pool
    return old


def pooling() -> bool:
    """Whether this process has a collation pool installed (a fastload DataLoader worker)."""
    return _POOL is not None


def _new_shared(nbytes: int) -> torch.Tensor:
    """A fresh ``uint8`` tensor of ``nbytes`` in shared memory (not pooled)."""
    storage = torch.UntypedStorage._new_shared(nbytes)  # type: ignore[no-untyped-call]
    populate(storage.data_ptr(), nbytes)
    out = torch.empty(0, dtype=torch.uint8)
    out.set_(storage, 0, (nbytes,))  # type: ignore[call-overload]
    return out


def alloc_uint8(nbytes: int) -> torch.Tensor:
    """A ``uint8`` buffer for a batch: pooled in fastload workers, shared memory in other
    DataLoader workers (so the batch is not copied again on its way out), private otherwise."""
    if _POOL is not None and nbytes >= POOL_MIN_BYTES:
        return _POOL.alloc(nbytes)
    if get_worker_info() is not None:
        return _new_shared(max(nbytes, 1))[:nbytes]
    return torch.empty(nbytes, dtype=torch.uint8)
