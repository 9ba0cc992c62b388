"""Stores with the awkward streams real backends give, for reader tests."""

from __future__ import annotations

import io
from typing import Any

from fastload.storage import MemoryStore

__all__ = ["ForwardOnlyStore"]


class _ForwardOnlyRaw(io.RawIOBase):
    """A stream that cannot seek and returns at most 700 bytes per read (a plain HTTP body)."""

    def __init__(self, data: bytes) -> None:
        super().__init__()
        self._data, self._pos = data, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), len(self._data) - self._pos, 700)
        buffer[:n] = self._data[self._pos : self._pos + n]
        self._pos += n
        return n


class ForwardOnlyStore(MemoryStore):
    """A memory store whose readers are forward-only streams with short reads, so readers are
    tested against streams that can neither seek nor fill a request in one call."""

    def open_reader(self, key: str, *, chunk_size: int = 0) -> io.BufferedIOBase:
        return io.BufferedReader(_ForwardOnlyRaw(self.get(key)), buffer_size=1024)
