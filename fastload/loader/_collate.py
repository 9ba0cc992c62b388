"""Selecting fields and collating samples into batches.

Byte-string fields collate into :class:`PackedBytes`: one ``uint8`` tensor (offsets, then the
bytes back to back) instead of a list of ``bytes`` objects, so a batch crosses from a DataLoader
worker to the main process as one shared-memory buffer instead of being pickled through a pipe.

**Buffer reuse**: inside the worker processes of :class:`fastload.DataLoader`, the buffers that
collation fills (:class:`PackedBytes` and stacked tensors of at least :data:`POOL_MIN_BYTES`)
come from a small per-worker pool of shared-memory blocks. A block is handed out again only after
the main process has dropped every tensor, array or memoryview that refers to it (the loader
watches the storages with weak references and marks the block free in a shared table), so reuse
never changes data a user still holds. Reuse matters because fresh shared memory costs a page
fault per 4 KiB page on first write, which on the benchmark machine cost more than the copy
itself (~80 us per 100 KB sample). Where no block is free (the user keeps batches, ``pin_memory``
copies them elsewhere, a custom batch type hides the tensors) collation allocates fresh shared
memory as torch does.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

import numpy as np
import numpy.typing as npt
import torch
import torch.multiprocessing
from torch.utils.data import default_collate as _torch_default_collate
from torch.utils.data import get_worker_info

from fastload.errors import InvalidArgumentError

__all__ = [
    "POOL_MIN_BYTES",
    "PackedBytes",
    "ToTuple",
    "default_collate",
    "empty_like_batch",
    "pack_bytes",
    "to_tuple",
]

#: Collation buffers at least this large come from the worker's reusable shared-memory pool.
POOL_MIN_BYTES = 256 * 1024
_ALIGN = 1 << 20  # pool blocks are sized in MiB steps, with headroom, so blocks fit later batches
_BytesLike = bytes | bytearray | memoryview


# ---- shared-memory buffers -------------------------------------------------------------------


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


class BufferReleaser:
    """Main-process side of :class:`BufferPool`: frees blocks once nothing refers to them.

    :meth:`track` finds the pooled storages in a received batch (tensors and
    :class:`PackedBytes` inside tuples, lists and dicts) and watches them with weak references;
    :meth:`poll` marks the blocks of storages that died as free. A block listed by a worker but
    not found in the batch (hidden in a custom object, or replaced by ``pin_memory``) is never
    marked free, so it cannot be overwritten while in use.
    """

    def __init__(self, flags: torch.Tensor) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self._weakref = StorageWeakRef
        self._flags: npt.NDArray[np.int64] = flags.numpy()
        self._pending: list[tuple[Any, int, int, int]] = []  # weakref, worker, block, token

    def track(self, batch: Any, worker: int, used: Sequence[tuple[int, int, int]]) -> None:
        """Watch the blocks ``used`` (from the worker's :meth:`BufferPool.take_used`) in ``batch``."""
        if not used or not 0 <= worker < len(self._flags):
            return
        wanted = {inode: (block, token) for inode, block, token in used}
        for storage in _shared_storages(batch, 0):
            try:
                inode = os.fstat(storage._share_fd_cpu_()[0]).st_ino
            except (RuntimeError, OSError):  # another sharing strategy: no fd to identify
                continue
            hit = wanted.pop(inode, None)
            if hit is not None:
                ref = self._weakref(storage)  # type: ignore[no-untyped-call]
                self._pending.append((ref, worker, hit[0], hit[1]))
                if not wanted:
                    break

    def poll(self) -> None:
        """Mark the blocks whose storages the main process no longer holds as free."""
        if not self._pending:
            return
        keep = []
        for ref, worker, block, token in self._pending:
            if ref.expired():
                if self._flags[worker, block] == token:
                    self._flags[worker, block] = 0
            else:
                keep.append((ref, worker, block, token))
        self._pending = keep


def _shared_storages(batch: Any, depth: int) -> Iterator[torch.UntypedStorage]:
    if isinstance(batch, torch.Tensor):
        storage = batch.untyped_storage()
        if batch.device.type == "cpu" and storage.is_shared():
            yield storage
    elif isinstance(batch, PackedBytes):
        yield from _shared_storages(batch.buffer, depth)
    elif depth < 4 and isinstance(batch, (tuple, list)):
        for item in batch:
            yield from _shared_storages(item, depth + 1)
    elif depth < 4 and isinstance(batch, Mapping):
        for item in batch.values():
            yield from _shared_storages(item, depth + 1)


_POOL: BufferPool | None = None  # this process's pool, installed by BatchStream in workers


def set_buffer_pool(pool: BufferPool | None) -> BufferPool | None:
    """Install the collation pool of this process; returns the previous one."""
    global _POOL
    old, _POOL = _POOL, pool
    return old


def _new_shared(nbytes: int) -> torch.Tensor:
    storage = torch.UntypedStorage._new_shared(nbytes)  # type: ignore[no-untyped-call]
    out = torch.empty(0, dtype=torch.uint8)
    out.set_(storage, 0, (nbytes,))  # type: ignore[call-overload]
    return out


def _alloc_uint8(nbytes: int) -> torch.Tensor:
    """A ``uint8`` buffer for a batch: pooled in fastload workers, shared memory in other
    DataLoader workers (so the batch is not copied again on its way out), private otherwise."""
    if _POOL is not None and nbytes >= POOL_MIN_BYTES:
        return _POOL.alloc(nbytes)
    if get_worker_info() is not None:
        return _new_shared(max(nbytes, 1))[:nbytes]
    return torch.empty(nbytes, dtype=torch.uint8)


# ---- packed byte strings ---------------------------------------------------------------------


def _rebuild_packed(buffer: torch.Tensor, n: int) -> PackedBytes:
    return PackedBytes(buffer, n)


class PackedBytes:
    """A batch of byte strings in one ``uint8`` tensor; what byte fields collate into.

    Behaves as a read-only sequence of ``bytes`` (``len``, indexing, slicing to a list,
    iteration, ``in``, ``==`` with a list of bytes), so code written for lists keeps working;
    ``tolist()`` gives the list. It is deliberately not a ``collections.abc.Sequence``, so
    that ``torch.utils.data.DataLoader``'s ``default_convert`` passes it through instead of
    turning it back into a list.
    Zero-copy access: :meth:`view` (a ``memoryview``), :meth:`tensor` (a ``uint8`` tensor, e.g.
    for ``torchvision.io.decode_jpeg`` on a GPU after :meth:`to`), :attr:`data` and
    :attr:`offsets` (item ``i`` is ``data[offsets[i]:offsets[i + 1]]``).

    Layout of :attr:`buffer`: ``n + 1`` native-endian ``int64`` offsets, then the bytes of the
    items back to back. It pickles as that one tensor (so a DataLoader worker passes it in one
    shared-memory block). Indexing copies the item into a new ``bytes``; views keep the whole
    buffer alive.

    Args:
        buffer: The ``uint8`` tensor in the layout above (on any device; item access and
            :meth:`view` need it on the CPU).
        n: Number of items.
    """

    __slots__ = ("_array", "_bounds", "buffer", "n")

    def __init__(self, buffer: torch.Tensor, n: int) -> None:
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < 8 * (n + 1):
            raise InvalidArgumentError(
                f"PackedBytes needs a 1-D uint8 tensor holding {n + 1} int64 offsets and the "
                f"data, got {buffer.dtype} of shape {tuple(buffer.shape)}"
            )
        self.buffer = buffer
        self.n = n
        self._bounds: list[int] | None = None
        self._array: npt.NDArray[np.uint8] | None = None

    @classmethod
    def pack(cls, items: Sequence[_BytesLike]) -> PackedBytes:
        """Copy ``items`` (``bytes``, ``bytearray`` or ``memoryview``) into one buffer (shared
        memory inside DataLoader workers)."""
        views = [x if isinstance(x, bytes) else memoryview(x).cast("B") for x in items]
        n = len(views)
        header = 8 * (n + 1)
        sizes = np.fromiter((len(v) for v in views), dtype=np.int64, count=n)
        total = header + int(sizes.sum())
        buffer = _alloc_uint8(total)
        array = buffer.numpy()
        offsets = array[:header].view(np.int64)
        offsets[0] = 0
        np.cumsum(sizes, out=offsets[1:])
        out = memoryview(array[header:])  # type: ignore[arg-type]
        pos = 0
        for v in views:
            end = pos + len(v)
            out[pos:end] = v
            pos = end
        return cls(buffer, n)

    @classmethod
    def empty(cls) -> PackedBytes:
        """No items (private memory)."""
        return cls(torch.zeros(8, dtype=torch.uint8), 0)

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_packed, (self.buffer, self.n)

    # ---- access -------------------------------------------------------------------------------

    @property
    def offsets(self) -> torch.Tensor:
        """``int64`` tensor of ``n + 1`` offsets into :attr:`data` (a view)."""
        return self.buffer[: 8 * (self.n + 1)].view(torch.int64)

    @property
    def data(self) -> torch.Tensor:
        """``uint8`` tensor of all items back to back (a view)."""
        return self.buffer[8 * (self.n + 1) :]

    @property
    def nbytes(self) -> int:
        """Bytes of all items (without the offsets)."""
        return self.buffer.numel() - 8 * (self.n + 1)

    def sizes(self) -> list[int]:
        """Length of each item."""
        b = self._offsets_list()
        return [b[i + 1] - b[i] for i in range(self.n)]

    def _offsets_list(self) -> list[int]:
        if self._bounds is None:
            self._bounds = self.offsets.tolist()
        return self._bounds

    def _np(self) -> npt.NDArray[np.uint8]:
        if self._array is None:
            self._array = self.data.numpy()
        return self._array

    def _span(self, i: int) -> tuple[int, int]:
        if isinstance(i, bool) or not isinstance(i, int | np.integer):
            raise TypeError(f"PackedBytes indices must be int or slice, not {type(i).__name__}")
        j = int(i) + self.n if i < 0 else int(i)
        if not 0 <= j < self.n:
            raise IndexError(f"index {i} out of range for {self.n} items")
        b = self._offsets_list()
        return b[j], b[j + 1]

    def view(self, i: int) -> memoryview:
        """Item ``i`` without a copy (read-write; keeps the buffer alive)."""
        start, stop = self._span(i)
        return memoryview(self._np()[start:stop])  # type: ignore[arg-type]

    def tensor(self, i: int) -> torch.Tensor:
        """Item ``i`` as a ``uint8`` tensor view (on the buffer's device)."""
        start, stop = self._span(i)
        return self.data[start:stop]

    @overload
    def __getitem__(self, i: int) -> bytes: ...

    @overload
    def __getitem__(self, i: slice) -> list[bytes]: ...

    def __getitem__(self, i: int | slice) -> bytes | list[bytes]:
        """Item ``i`` as a new ``bytes``; a slice gives a list of ``bytes``."""
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        start, stop = self._span(i)
        return self._np()[start:stop].tobytes()

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[bytes]:
        array, b = self._np(), self._offsets_list()
        for i in range(self.n):
            yield array[b[i] : b[i + 1]].tobytes()

    def tolist(self) -> list[bytes]:
        """The items as a list of ``bytes``."""
        return list(self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedBytes):
            return self.n == other.n and self.tolist() == other.tolist()
        if isinstance(other, Sequence) and not isinstance(other, str | bytes | bytearray):
            return len(other) == self.n and self.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    # ---- devices ------------------------------------------------------------------------------

    def pin_memory(self, device: str | torch.device | None = None) -> PackedBytes:
        """A copy in page-locked memory (called by torch's ``pin_memory``)."""
        pinned = self.buffer.pin_memory() if device is None else self.buffer.pin_memory(device)
        return PackedBytes(pinned, self.n)

    def to(self, device: str | torch.device, non_blocking: bool = False) -> PackedBytes:
        """The same items with the buffer on ``device``."""
        return PackedBytes(self.buffer.to(device, non_blocking=non_blocking), self.n)

    def __repr__(self) -> str:
        return f"PackedBytes(n={self.n}, nbytes={self.nbytes}, device={self.buffer.device})"


def pack_bytes(items: Sequence[_BytesLike]) -> PackedBytes:
    """Pack byte strings into a :class:`PackedBytes` (for custom ``collate_fn`` s)."""
    return PackedBytes.pack(items)


def _stack(samples: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.stack`` into a pooled shared buffer (workers of fastload.DataLoader)."""
    first = samples[0]
    nbytes = first.numel() * first.element_size() * len(samples)
    raw = _alloc_uint8(nbytes)
    out = raw.view(first.dtype).view(len(samples), *first.shape)
    return torch.stack(list(samples), out=out)


def default_collate(samples: Sequence[Any]) -> Any:
    """Collate processed samples into a batch.

    Like ``torch.utils.data.default_collate`` for tensors (stacked; in shared memory when called
    inside a DataLoader worker, so the batch reaches the main process without a copy), NumPy
    arrays (stacked into a tensor), ``int``/``float``/``bool`` (an ``int64``/``float64``/``bool``
    tensor) and mappings (collated key by key). The differences: ``bytes`` (and ``bytearray``,
    ``memoryview``) become a :class:`PackedBytes` (a sequence of ``bytes`` in one tensor),
    ``str``, ``None`` and other objects become a **list**, and tuple samples give a **tuple** of
    collated fields (torch gives lists), so ``images, labels = batch`` reads naturally.

    Raises:
        InvalidArgumentError: Samples have different structures (the message names the keys).
    """
    if not samples:
        raise InvalidArgumentError("cannot collate an empty list of samples")
    first = samples[0]
    if isinstance(first, torch.Tensor):
        if (
            _POOL is not None
            and first.layout == torch.strided
            and first.device.type == "cpu"
            and first.numel() * first.element_size() * len(samples) >= POOL_MIN_BYTES
            and all(
                isinstance(s, torch.Tensor) and s.shape == first.shape and s.dtype == first.dtype
                for s in samples
            )
        ):
            return _stack(samples)
        return _torch_default_collate(list(samples))
    if isinstance(first, _BytesLike) and all(isinstance(s, _BytesLike) for s in samples):
        return PackedBytes.pack(samples)
    if isinstance(first, np.ndarray) and first.dtype != object:
        return _torch_default_collate(list(samples))
    if isinstance(first, bool | np.bool_):
        return torch.tensor(samples, dtype=torch.bool)
    if isinstance(first, int | np.integer):
        return torch.tensor(samples, dtype=torch.int64)
    if isinstance(first, float | np.floating):
        return torch.tensor(samples, dtype=torch.float64)
    if isinstance(first, Mapping):
        keys = list(first)
        for s in samples:
            if not isinstance(s, Mapping) or s.keys() != first.keys():
                have = sorted(s) if isinstance(s, Mapping) else type(s).__name__
                raise InvalidArgumentError(
                    f"cannot collate samples with different fields: {sorted(keys)} and {have}; "
                    "select common fields with fields=(...) or pass a collate_fn"
                )
        return {k: default_collate([s[k] for s in samples]) for k in keys}
    if isinstance(first, tuple):
        width = len(first)
        if any(not isinstance(s, tuple) or len(s) != width for s in samples):
            raise InvalidArgumentError(
                f"cannot collate tuples of different lengths (first has {width} fields)"
            )
        fields = tuple(default_collate(list(col)) for col in zip(*samples))
        if hasattr(first, "_fields"):  # namedtuple
            return type(first)(*fields)
        return fields
    return list(samples)


def empty_like_batch(batch: Any) -> Any:
    """A batch with the structure of ``batch`` and zero rows (used when every sample of a batch
    was skipped, so that every rank still yields the same number of batches)."""
    if isinstance(batch, torch.Tensor):
        return batch[:0].clone()  # a copy: do not keep the (shared-memory) batch alive
    if isinstance(batch, np.ndarray):
        return batch[:0].copy()
    if isinstance(batch, PackedBytes):
        return PackedBytes.empty()
    if isinstance(batch, Mapping):
        return {k: empty_like_batch(v) for k, v in batch.items()}
    if isinstance(batch, tuple):  # collated tuple samples
        fields = [empty_like_batch(v) for v in batch]
        return type(batch)(*fields) if hasattr(batch, "_fields") else tuple(fields)
    return []  # a list of per-sample values (str, bytes, objects)


class ToTuple:
    """Select fields of a sample as a tuple: ``ToTuple("jpg;png", "cls")(sample)``.

    A field spec may list alternatives separated by ``;`` (the first present is taken), as in
    WebDataset's ``to_tuple``. Picklable, so it works with every multiprocessing start method.

    Args:
        *fields: Field names (or ``;``-separated alternatives), e.g. ``"jpg"``, ``"__key__"``.

    Raises:
        InvalidArgumentError: (when called) The sample has none of a spec's alternatives; the
            message names the sample key and the fields it has.
    """

    def __init__(self, *fields: str) -> None:
        if not fields:
            raise InvalidArgumentError("to_tuple needs at least one field name, e.g. 'jpg'")
        specs = []
        for spec in fields:
            if not isinstance(spec, str) or not spec or any(not p for p in spec.split(";")):
                raise InvalidArgumentError(
                    f"field specs are non-empty str like 'jpg' or 'jpg;png', got {spec!r}"
                )
            specs.append(tuple(spec.split(";")))
        self.fields: tuple[str, ...] = tuple(fields)
        self._specs = tuple(specs)

    def __call__(self, sample: Mapping[str, Any]) -> tuple[Any, ...]:
        out = []
        for alternatives in self._specs:
            for name in alternatives:
                if name in sample:
                    out.append(sample[name])
                    break
            else:
                have = sorted(k for k in sample if not k.startswith("__"))
                raise InvalidArgumentError(
                    f"sample {sample.get('__key__')!r} has none of the fields "
                    f"{';'.join(alternatives)!r} (it has {have}); fix the fields=... selection"
                )
        return tuple(out)

    def __repr__(self) -> str:
        return f"to_tuple({', '.join(repr(f) for f in self.fields)})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ToTuple) and other.fields == self.fields

    def __hash__(self) -> int:
        return hash(self.fields)


def to_tuple(*fields: str) -> ToTuple:
    """A picklable callable returning the given fields of a sample as a tuple.

    ``to_tuple("jpg;png", "cls")`` turns ``{"__key__": "a", "jpg": img, "cls": 3}`` into
    ``(img, 3)``; see :class:`ToTuple`.
    """
    return ToTuple(*fields)


#: A per-field transform table or a whole-sample transform.
Transform = Callable[[Any], Any] | Mapping[str, Callable[[Any], Any]]
