"""PackedBytes: a batch of byte strings in one ``uint8`` tensor, what byte fields collate into.

One tensor (offsets, then the bytes back to back) instead of a list of ``bytes`` objects, so a
batch crosses from a DataLoader worker to the main process as one shared-memory buffer instead of
being pickled through a pipe. Inside fastload's workers the buffer comes from the reusable pool of
:mod:`fastload.loader._shm_pool`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np
import numpy.typing as npt
import torch

from fastload.errors import InvalidArgumentError
from fastload.loader._shm_pool import alloc_uint8

__all__ = ["BytesLike", "PackedBytes", "pack_bytes"]

#: The byte-string types that pack (and collate) into a :class:`PackedBytes`.
BytesLike = bytes | bytearray | memoryview


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
    def pack(cls, items: Sequence[BytesLike]) -> PackedBytes:
        """Copy ``items`` (``bytes``, ``bytearray`` or ``memoryview``) into one buffer (shared
        memory inside DataLoader workers)."""
        views = [x if isinstance(x, bytes) else memoryview(x).cast("B") for x in items]
        n = len(views)
        header = 8 * (n + 1)
        sizes = np.fromiter((len(v) for v in views), dtype=np.int64, count=n)
        total = header + int(sizes.sum())
        buffer = alloc_uint8(total)
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


def pack_bytes(items: Sequence[BytesLike]) -> PackedBytes:
    """Pack byte strings into a :class:`PackedBytes` (for custom ``collate_fn`` s)."""
    return PackedBytes.pack(items)
