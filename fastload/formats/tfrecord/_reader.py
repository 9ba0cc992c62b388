"""The TFRecord shard reader."""

from __future__ import annotations

import io
import mmap
import posixpath
from collections.abc import Iterator
from functools import partial
from typing import Any, Unpack

from fastload.errors import CorruptDataError, FormatError, MissingIndexError, ObjectNotFoundError
from fastload.formats import _cache
from fastload.formats._base import ReaderOptions, ShardReader
from fastload.formats._mmap import local_file, map_file
from fastload.formats.tfrecord._compression import (
    InflateReader,
    detect_compression,
    normalize_compression,
)
from fastload.formats.tfrecord._decode import FAST_PATH_MISSES, Buffer, decode_fast
from fastload.formats.tfrecord._example import ProtoError
from fastload.formats.tfrecord._framing import HEADER, HEADER_SIZE, U32LE, crc32c, mask, masked_crc
from fastload.formats.tfrecord._index import CODEC as INDEX_CODEC
from fastload.formats.tfrecord._index import (
    RecordIndex,
    parse_index,
    parse_local_index,
    scan_index,
)
from fastload.formats.tfrecord._record import BadChecksum, RecordErrors, decode_record, read_exact
from fastload.storage import ByteRange, Store

__all__ = ["TFRecordReader"]

#: protobuf's limit on a message: a longer record cannot hold a tf.train.Example.
_MAX_RECORD = 2**31 - 1
_EXTENSIONS = (".tfrecords", ".tfrecord", ".tfr")
_COMPRESSED_SUFFIXES = (".gz", ".gzip", ".zz", ".zlib")


class TFRecordReader(ShardReader):
    """Reads ``tf.train.Example`` records of one TFRecord shard as samples.

    Yields ``{"__key__", "__url__", "__index__", field: bytes, ...}`` in record order; fields in
    the order they were written. ``__index__`` is the record's position in the shard (records
    skipped under ``on_error="skip"`` keep their positions). Examples without a ``__key__``
    feature (written by other tools) get the key ``<shard key without extension>/<position:08d>``.

    A shard that is a local file (``store.has_local_paths``) is memory-mapped read-only: each
    value is copied once, from the page cache into the ``bytes`` of the sample, and the payload
    CRC is computed over those copies (no system call per record, no copy of whole payloads).
    Any other shard is streamed through ``store.open_reader``, never downloaded whole, holding
    one record at a time. A mapped shard must not be truncated in place while it is read
    (touching a page past the new end raises ``SIGBUS``, which ends the process); replacing it
    atomically, as fastload's writers and stores do, is safe.

    With an index (``key + ".idx"`` or ``index_key``), :meth:`__len__`, :meth:`read` (a slice of
    the map for local shards, else one ranged get) and :meth:`iter_from` (seeks) work too. gzip-
    and zlib-compressed files (TensorFlow's ``compression_type="GZIP"``/``"ZLIB"``) stream
    through a decompressor, local or not; they have no random access, and byte offsets in their
    errors are offsets in the decompressed stream.

    A reader is used by one thread at a time; it opens nothing until used, so it pickles and can
    be created before forking (the pickle holds no map or index; each process maps the shard
    itself). :meth:`close` unmaps what :meth:`read` mapped; iteration unmaps at its end.

    Args:
        store: Where the shard is.
        key: The shard's key.
        on_error: ``raise`` (default), ``skip`` or ``warn``. A bad payload CRC or an undecodable
            Example skips that record; a bad length CRC or a truncated record ends the shard (the
            rest cannot be located) and counts one skip.
        index_key: Key of the index; ``None`` means ``key + ".idx"`` when it exists.
        verify: Check both CRCs of every record (default). ``False`` skips the checks (faster;
            corruption then surfaces as undecodable Examples, or not at all).
        compression: ``"auto"`` (default: detect gzip/zlib from the first bytes), ``None``,
            ``"gzip"`` or ``"zlib"``.
        chunk_size: Read-ahead of the underlying store stream, in bytes (0: the store's
            default); not used for mapped local shards.
    """

    def __init__(
        self,
        store: Store,
        key: str,
        *,
        verify: bool = True,
        compression: str | None = "auto",
        chunk_size: int = 0,
        **options: Unpack[ReaderOptions],
    ) -> None:
        super().__init__(store, key, **options)
        self.verify = verify
        self.compression = normalize_compression(compression, allow_auto=True)
        self.chunk_size = chunk_size
        self._index: RecordIndex | None = None
        self._index_loaded = False
        self._no_access = ""  # why there is no random access, once known
        self._stem = default_stem(key)
        self._errors = RecordErrors(self.url)
        self._map: mmap.mmap | bytes | None = None  # this process's map of a local shard
        self._map_tried = False
        self._size = -1  # the shard's size when the index was loaded

    # ---- streaming ------------------------------------------------------------------------------

    def _open(self, offset: int = 0) -> tuple[io.BufferedIOBase, str | None]:
        """Open the shard positioned at ``offset``; return the stream and its compression."""
        if self.chunk_size:
            raw = self.store.open_reader(self.key, chunk_size=self.chunk_size)
        else:
            raw = self.store.open_reader(self.key)
        compression = self.compression
        try:
            if compression == "auto":
                head = raw.read(HEADER_SIZE + 64)
                compression = detect_compression(head)[1]
                raw.seek(0)
            if compression is None:
                if offset:
                    raw.seek(offset)
                return raw, None
            if offset:
                raise FormatError(
                    f"cannot seek to byte {offset} of a {compression}-compressed TFRecord file",
                    url=self.url,
                )
            stream = io.BufferedReader(InflateReader(raw, compression, url=self.url), 1 << 20)
        except BaseException:
            raw.close()
            raise
        return stream, compression

    def _records(self, start: int, offset: int) -> Iterator[dict[str, Any]]:
        """Samples from record ``start`` (at byte ``offset``) to the end of the shard: out of a
        memory map for a plain local file, else streamed. Opens nothing until first used."""
        path = local_file(self.store, self.key)
        view = None if path is None else map_file(path, sequential=True)
        if view is not None:
            compression = self.compression
            if compression == "auto":
                compression = detect_compression(view[: HEADER_SIZE + 64])[1]
            if compression is None:
                yield from self._mapped(view, start, offset)
                return
            if isinstance(view, mmap.mmap):  # one deflate stream: inflate it as it streams
                view.close()
        yield from self._streamed(start, offset)

    def _mapped(self, view: mmap.mmap | bytes, start: int, offset: int) -> Iterator[dict[str, Any]]:
        """:meth:`_records` out of ``view``, a read-only map of the whole shard, closed at the end.

        Each value is copied once, from the page cache into the ``bytes`` of the sample; the
        payload CRC is computed over those copies and the framing bytes between them.
        """
        url, verify, handle, stem = self.url, self.verify, self.policy.handle, self._stem
        unpack_header, unpack_crc = HEADER.unpack_from, U32LE.unpack_from
        crc_init = 0 if verify else None
        size = len(view)
        i = start
        try:
            while offset < size:
                if size - offset < HEADER_SIZE:
                    handle(self._errors.truncated_header(size - offset, offset, None))
                    return
                length, length_crc = unpack_header(view, offset)
                if verify and mask(crc32c(view[offset : offset + 8])) != length_crc:
                    handle(self._errors.length_crc(i, offset, None))
                    return
                begin = offset + HEADER_SIZE
                end = begin + length
                if end + 4 > size:
                    handle(self._errors.truncated_record(i, length, size - offset, offset, None))
                    return
                record_offset = offset
                offset = end + 4
                sample: dict[str, Any] = {"__key__": None, "__url__": url, "__index__": i}
                try:
                    try:  # the common case, inline: decode_record does the same
                        key, crc = decode_fast(view, begin, end, crc_init, sample)
                    except FAST_PATH_MISSES:
                        key = decode_record(
                            view, begin, end, unpack_crc(view, end)[0] if verify else None, sample
                        )
                    else:
                        if verify and mask(crc) != unpack_crc(view, end)[0]:
                            raise BadChecksum
                except (BadChecksum, ProtoError) as exc:
                    handle(self._errors.undecodable(exc, i, record_offset, None))
                else:
                    sample["__key__"] = f"{stem}/{i:08d}" if key is None else key
                    yield sample
                i += 1
        finally:
            if isinstance(view, mmap.mmap):
                view.close()

    def _streamed(self, start: int, offset: int) -> Iterator[dict[str, Any]]:
        """:meth:`_records` through ``store.open_reader`` (any store; compressed files)."""
        stream, compression = self._open(offset)
        url, verify, handle, stem = self.url, self.verify, self.policy.handle, self._stem
        unpack_header, unpack_crc = HEADER.unpack, U32LE.unpack
        failed: list[CorruptDataError] = []  # a damaged compressed stream ends the reading
        # The size bounds a plain file's records before they are read (compressed: unknown).
        size = self.store.size(self.key) if compression is None else None

        def read(n: int) -> bytes:
            try:
                return read_exact(stream.read, n)
            except CorruptDataError as exc:  # what inflated before the damage was returned
                failed.append(exc)
                return b""

        with stream:
            i = start
            while True:
                header = read(HEADER_SIZE)
                if len(header) < HEADER_SIZE:
                    if failed:
                        handle(failed[0])
                    elif header:
                        handle(self._errors.truncated_header(len(header), offset, compression))
                    return
                length, length_crc = unpack_header(header)
                if verify and masked_crc(header[:8]) != length_crc:
                    handle(self._errors.length_crc(i, offset, compression))
                    return
                if length > _MAX_RECORD or (size is not None and offset + length + 16 > size):
                    handle(
                        self._errors.corrupt(
                            f"truncated TFRecord: record {i} declares {length + 16} bytes, "
                            + (
                                f"the file has {size - offset} left"
                                if size is not None and length <= _MAX_RECORD
                                else "more than a tf.train.Example can hold (2 GiB)"
                            ),
                            offset,
                            compression,
                        )
                    )
                    return
                payload = read(length)
                footer = read(4) if not failed else b""
                if failed:
                    handle(failed[0])
                    return
                if len(payload) < length or len(footer) < 4:
                    found = HEADER_SIZE + len(payload) + len(footer)
                    handle(self._errors.truncated_record(i, length, found, offset, compression))
                    return
                record_offset = offset
                offset += length + 16
                sample: dict[str, Any] = {"__key__": None, "__url__": url, "__index__": i}
                try:
                    key = decode_record(
                        payload, 0, length, unpack_crc(footer)[0] if verify else None, sample
                    )
                except (BadChecksum, ProtoError) as exc:
                    handle(self._errors.undecodable(exc, i, record_offset, compression))
                else:
                    sample["__key__"] = f"{stem}/{i:08d}" if key is None else key
                    yield sample
                i += 1

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Yield the shard's samples in order, streaming.

        Raises:
            CorruptDataError: Under ``on_error="raise"``, for the first damaged record (the URL
                and the record's byte offset are in the message and on the exception).
        """
        return self._records(0, 0)

    # ---- random access --------------------------------------------------------------------------

    def _load_index(self) -> RecordIndex:
        if not self._index_loaded:
            index_key = self.index_key if self.index_key is not None else self.key + ".idx"
            iurl = self.store.child_url(index_key)
            shard_path = local_file(self.store, self.key)
            index_path = local_file(self.store, index_key)
            found: tuple[RecordIndex, _cache.FileStamp] | None = None
            if shard_path is not None and index_path is not None:  # parsed once per process
                parse = partial(parse_local_index, url=iurl, shard=shard_path)
                try:
                    found = _cache.cached("tfrecord", shard_path, index_path, parse, INDEX_CODEC)
                except (CorruptDataError, OSError):
                    found = None  # compressed, damaged, or gone: the checks below say which
            if found is not None:
                self._size = found[1].size
                self._index = self._checked(found[0], iurl, self._size)
            else:
                self._index = self._fetch_index(index_key, iurl)
            self._index_loaded = True
        if self._index is None:
            raise MissingIndexError(self._no_access, url=self.url)
        return self._index

    def _fetch_index(self, index_key: str, iurl: str) -> RecordIndex | None:
        """The index read through the store (not cached); ``None`` (and :attr:`_no_access` says
        why) when there is none or the shard is compressed."""
        try:
            text: bytes | None = self.store.get(index_key)
        except ObjectNotFoundError:
            text = None
        size = self.store.size(self.key)
        compression = detect_compression(self.store.get(self.key, ByteRange(0, min(size, 512))))[1]
        if compression is not None:
            self._no_access = (
                f"{self.url} is {compression}-compressed: records have no byte offsets, so "
                "there is no len() or read(i) (an index does not apply); stream it by "
                "iterating, or decompress it / rewrite it with fastload"
            )
            return None
        if text is None:
            self._no_access = (
                f"{type(self).__name__} needs the index {index_key} for len() and read(i), "
                "and it does not exist; build it with `fastload index` (or stream the shard "
                "by iterating)"
            )
            return None
        self._size = size
        try:
            index = parse_index(text, url=iurl)
        except CorruptDataError as exc:
            return self._damaged(exc)
        return self._checked(index, iurl, size)

    def _checked(self, index: RecordIndex, iurl: str, size: int) -> RecordIndex:
        """``index`` checked against the shard's size and the manifest; under ``skip`` and
        ``warn`` a damaged index is replaced by one read from the shard's record headers."""
        try:
            index.check_bound(self.index_bound(size), iurl)
            self.check_index_count(len(index), iurl)
        except CorruptDataError as exc:
            return self._damaged(exc)
        return index

    def _damaged(self, exc: CorruptDataError) -> RecordIndex:
        self.index_damaged(exc, "record headers")
        index, _damage = scan_index(self.store, self.key)
        if self.expected_samples is not None:
            index = index.truncated(self.expected_samples)
        return index

    @property
    def supports_random_access(self) -> bool:  # type: ignore[override]
        """True when the shard is uncompressed and has an index (loaded on first access)."""
        try:
            self._load_index()
        except MissingIndexError:
            return False
        return True

    def __len__(self) -> int:
        """Number of records, from the index.

        Raises:
            FormatError: There is no index, or the file is compressed. The error is also a
                ``TypeError`` (Python's "no length"), so ``list(reader)`` still works.
        """
        return len(self._load_index())

    def read(self, i: int) -> dict[str, Any]:
        """The ``i``-th sample (negative ``i`` counts from the end).

        A plain local file is memory-mapped on the first call (per process; :meth:`close`
        unmaps it) and each field is one copy out of the map; other stores get one ranged
        request per record. Raises whatever the record's damage is (:class:`CorruptDataError`)
        regardless of ``on_error``, since there is no sample to return.

        Raises:
            IndexError: ``i`` is out of range.
            FormatError: There is no index, or the file is compressed.
            CorruptDataError: The record is damaged or does not match the index.
        """
        index = self._load_index()
        n = len(index)
        if not -n <= i < n:
            missing = self.missing_sample(i, n)
            if missing is not None:
                raise missing
            raise IndexError(f"record {i} out of range: {self.url} has {n} records")
        i %= n
        offset, size = index.record(i)
        if offset + size > self._size:
            raise self.past_end(i, offset, offset + size, self._size)
        buf: Buffer
        view = self._local_map()
        if view is not None:
            buf, base = view, offset
            past_end: Exception | None = None if offset + size <= len(view) else ValueError()
        else:
            base, past_end = 0, None
            try:
                buf = self.store.get(self.key, ByteRange(offset, offset + size))
            except ValueError as exc:  # InvalidRangeError: the index points past the end
                past_end = exc
        if past_end is not None:
            raise CorruptDataError(
                f"the index entry of record {i} ({offset} {size}) reaches past the end of the "
                "shard; rebuild the index with `fastload index`",
                url=self.url,
                offset=offset,
            ) from past_end
        length, length_crc = HEADER.unpack_from(buf, base)
        if length + 16 != size:
            raise CorruptDataError(
                f"record {i} has length {length} but its index entry says {size} bytes; the "
                "index does not belong to this shard, rebuild it with `fastload index`",
                url=self.url,
                offset=offset,
            )
        stored: int | None = None
        if self.verify:
            if masked_crc(buf[base : base + 8]) != length_crc:
                raise CorruptDataError(
                    f"TFRecord length CRC mismatch in record {i}", url=self.url, offset=offset
                )
            stored = U32LE.unpack_from(buf, base + size - 4)[0]
        sample: dict[str, Any] = {"__key__": None, "__url__": self.url, "__index__": i}
        try:
            key = decode_record(buf, base + HEADER_SIZE, base + size - 4, stored, sample)
        except BadChecksum:
            raise self._errors.payload_crc(i, offset, None) from None
        except ProtoError as exc:
            raise self._errors.corrupt(f"record {i}: {exc}", offset, None) from exc
        sample["__key__"] = f"{self._stem}/{i:08d}" if key is None else key
        return sample

    def _local_map(self) -> mmap.mmap | bytes | None:
        """The shard mapped into memory when it is a plain local file (kept until :meth:`close`;
        only called once the index exists, which implies an uncompressed file)."""
        if not self._map_tried:
            path = local_file(self.store, self.key)
            self._map = None if path is None else map_file(path, sequential=False)
            self._map_tried = True
        return self._map

    def close(self) -> None:
        """Unmap the shard if :meth:`read` mapped it. The reader stays usable."""
        view, self._map, self._map_tried = self._map, None, False
        if isinstance(view, mmap.mmap):
            view.close()

    def iter_from(self, start: int) -> Iterator[dict[str, Any]]:
        """Yield samples from position ``start`` on: with an index it seeks there; without one
        (or for compressed files) it reads and drops the records before ``start``."""
        if start <= 0:
            return iter(self)
        try:
            index = self._load_index()
        except FormatError:
            return super().iter_from(start)
        if start >= len(index):
            return iter(())
        return self._records(start, index.record(start)[0])

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # reload and remap lazily in the new process; keeps pickles small
        state["_index"], state["_index_loaded"] = None, False
        state["_map"], state["_map_tried"] = None, False
        return state


def default_stem(key: str) -> str:
    """The shard key without a compression suffix and TFRecord extension (``data/a.tfrecord.gz``
    → ``data/a``); keys of records without ``__key__`` are ``<stem>/<position:08d>``."""
    for suffixes in (_COMPRESSED_SUFFIXES, _EXTENSIONS):
        base = posixpath.basename(key)
        for ext in suffixes:
            if base.endswith(ext) and len(base) > len(ext):
                key = key[: -len(ext)]
                break
    return key
