"""The TFRecord shard writer."""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any, cast

from fastload.errors import InvalidArgumentError
from fastload.formats._base import ShardInfo, ShardWriter
from fastload.formats._output import ShardOutput
from fastload.formats._sample import encode_sample
from fastload.formats.tfrecord._compression import normalize_compression, wbits
from fastload.formats.tfrecord._example import encode_example
from fastload.formats.tfrecord._framing import crc32c_extend, frame_footer, frame_header
from fastload.storage import Store

__all__ = ["TFRecordWriter"]


class TFRecordWriter(ShardWriter):
    """Writes samples as ``tf.train.Example`` records into one TFRecord shard.

    The shard streams through ``store.open_writer(key)`` in chunks of a few MiB, hashed and written
    by a helper thread (:class:`~fastload.formats._output.ShardOutput`); nothing is visible under
    ``key`` until :meth:`close` commits it; then, for uncompressed shards with ``index=True``, the
    DALI ``tfrecord2idx``-format index is put at ``key + ".idx"``. The same samples always give the same
    bytes (shard and index). The field → Feature mapping is in the format README.

    A writer is used by one thread at a time.

    Args:
        store: Where the shard goes.
        key: The shard's key, e.g. ``"train-000000.tfrecord"``.
        index: Write ``key + ".idx"`` after the shard (ignored when ``compression`` is set: records
            in a compressed file have no byte offsets, and DALI cannot read compressed files).
        compression: ``None`` (default), ``"gzip"`` or ``"zlib"``: compress the whole file as
            TensorFlow's ``TFRecordOptions(compression_type="GZIP" | "ZLIB")`` does. Readable by
            TensorFlow and fastload; not by DALI; no random access.
        compression_level: zlib level 0-9 for compressed shards (default 6).

    Raises:
        InvalidArgumentError: Unknown ``compression`` or ``compression_level``.
    """

    def __init__(
        self,
        store: Store,
        key: str,
        *,
        index: bool = True,
        compression: str | None = None,
        compression_level: int = 6,
    ) -> None:
        super().__init__(store, key, index=index)
        self.compression = normalize_compression(compression, allow_auto=False)
        if not isinstance(compression_level, int) or not 0 <= compression_level <= 9:
            raise InvalidArgumentError(
                f"compression_level must be an int from 0 to 9, got {compression_level!r}"
            )
        self._compressor = (
            zlib.compressobj(compression_level, zlib.DEFLATED, wbits(self.compression))
            if self.compression
            else None
        )
        if self.compression:
            self.write_index = False
        self._output = ShardOutput(store.open_writer(key))
        self._offset = 0  # uncompressed position: where the next record starts
        self._index: list[str] = []
        self._info: ShardInfo | None = None

    @property
    def num_bytes(self) -> int:
        """Bytes of the shard object written so far. With compression this lags behind, as the
        compressor buffers up to a few hundred KiB."""
        return self._output.nbytes

    def _emit(self, data: bytes) -> None:
        if self._compressor is not None:
            data = self._compressor.compress(data)
            if not data:
                return
        self._output.write(data)

    def write(self, sample: Mapping[str, Any]) -> None:
        """Append one sample as one record.

        Raises:
            InvalidArgumentError: The sample has no valid ``__key__``, a field name is invalid, or
                a value cannot be encoded; nothing is written in that case.
            ValueError: The writer is already closed or aborted.
        """
        if self._info is not None or self._output.out.closed:
            raise ValueError(f"write to a closed TFRecordWriter ({self.store.child_url(self.key)})")
        encoded = encode_sample(sample)
        key = cast(str, encoded.pop("__key__"))  # encode_sample validated it as a str
        pieces, length = encode_example(key, encoded)
        crc = 0
        for piece in pieces:
            crc = crc32c_extend(crc, piece)
        emit = self._emit if self._compressor is not None else self._output.write
        emit(frame_header(length))
        for piece in pieces:
            emit(piece)
        emit(frame_footer(crc))
        size = length + 16
        if self.write_index:
            self._index.append(f"{self._offset} {size}\n")
        self._offset += size
        self._count_fields(encoded)

    def close(self) -> ShardInfo:
        """Commit the shard, then its index; describe the shard.

        Calling it again returns the same :class:`ShardInfo`.
        """
        if self._info is not None:
            return self._info
        if self._compressor is not None:
            try:
                tail = self._compressor.flush()
                self._compressor = None
                if tail:
                    self._emit(tail)
            except BaseException:
                self._output.discard()
                raise
        sha256 = self._output.commit()
        index_key = None
        if self.write_index:
            index_key = self.key + ".idx"
            self.store.put(index_key, "".join(self._index).encode("ascii"))
        self._info = self._shard_info(
            num_bytes=self._output.nbytes, sha256=sha256, index_key=index_key
        )
        return self._info

    def abort(self) -> None:
        """Discard the shard; nothing becomes visible. Safe to call more than once."""
        if self._info is not None:
            return
        self._output.discard()
