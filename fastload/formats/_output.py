"""Shard output for format writers: bytes gathered into chunks, hashed and written chunk by chunk.

Writers produce a shard as many small pieces (a 512-byte tar header, a 100 KB image, a 16-byte
record frame). Hashing and writing each piece separately costs a few Python calls per piece;
:class:`ShardOutput` copies the pieces into one chunk buffer and hashes (SHA-256) and writes whole
chunks. The chunk is small enough to stay in a core's L2 cache between the copy, the hash and the
write: 4 MiB chunks measured ~25% more CPU per shard than 512 KiB ones on a 1 MiB-L2 machine.
"""

from __future__ import annotations

import hashlib
from typing import Final

from fastload.storage import ObjectWriter

__all__ = ["CHUNK_SIZE", "ShardOutput"]

#: Default chunk size in bytes.
CHUNK_SIZE: Final = 512 * 1024


class ShardOutput:
    """Gathers, hashes and writes one shard's bytes, in the order given.

    Bytes passed to :meth:`write` are copied into a chunk buffer; a full chunk is hashed and
    written to ``out``. Values of at least ``chunk_size`` bytes are hashed and written as they are,
    without a copy. End with :meth:`commit` or :meth:`discard` (or, to handle ``out`` yourself,
    :meth:`finish` or :meth:`abort`).

    Not thread-safe: one thread at a time, like the writers that use it.

    Args:
        out: The store's streamed writer for the shard object.
        chunk_size: Bytes per chunk.

    Raises:
        ValueError: ``chunk_size`` < 1.
    """

    def __init__(self, out: ObjectWriter, *, chunk_size: int = CHUNK_SIZE) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.out = out
        #: Bytes passed to :meth:`write` so far.
        self.nbytes = 0
        self._sha = hashlib.sha256()
        self._limit = chunk_size
        self._buf = bytearray(chunk_size)
        self._pos = 0
        self._digest: str | None = None

    def write(self, data: bytes) -> None:
        """Append ``data`` (``bytes``) to the shard.

        Raises:
            ValueError: The output was finished or aborted.
            FastloadError: The store failed to write (the output is then unusable: abort it).
        """
        n = len(data)
        pos = self._pos
        if pos + n <= self._limit:
            self._buf[pos : pos + n] = data
            self._pos = pos + n
        else:
            self._write_over(data, n)
        self.nbytes += n

    def _write_over(self, data: bytes, n: int) -> None:
        if not self._limit:
            raise ValueError("write to a finished or aborted ShardOutput")
        self._flush()
        if n >= self._limit:
            self._sha.update(data)
            self.out.write(data)
        else:
            self._buf[:n] = data
            self._pos = n

    def _flush(self) -> None:
        if self._pos:
            with memoryview(self._buf) as whole, whole[: self._pos] as view:
                self._sha.update(view)
                self.out.write(view)
            self._pos = 0

    def finish(self) -> str:
        """Write what is buffered; return the hex SHA-256 of the shard. Does not commit ``out``.

        Calling it again returns the same digest.
        """
        if self._digest is None:
            self._flush()
            self._digest = self._sha.hexdigest()
            self._buf, self._limit = bytearray(), 0
        return self._digest

    def abort(self) -> None:
        """Drop what is buffered; later writes fail. Does not abort ``out``. Safe to repeat."""
        self._buf, self._pos, self._limit = bytearray(), 0, 0

    def commit(self) -> str:
        """:meth:`finish`, then commit ``out`` (the shard becomes visible); return the hex SHA-256.

        Raises:
            BaseException: Whatever finishing or committing raised, after :meth:`discard`:
                nothing becomes visible.
        """
        try:
            digest = self.finish()
            self.out.commit()
        except BaseException:
            self.discard()
            raise
        return digest

    def discard(self) -> None:
        """:meth:`abort`, and abort ``out``: nothing becomes visible. Safe to repeat."""
        self.abort()
        self.out.abort()
