"""The WebDataset shard writer: samples → a deterministic POSIX tar, plus its DALI index."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastload.errors import InvalidArgumentError
from fastload.formats._base import ShardInfo, ShardWriter
from fastload.formats._output import ShardOutput
from fastload.formats._sample import encode_sample
from fastload.formats.webdataset._tar import (
    BLOCK,
    END_OF_ARCHIVE,
    MAX_USTAR_SIZE,
    encode_member_header,
)
from fastload.formats.webdataset.index import Component, format_index, has_index_whitespace
from fastload.storage import Store

__all__ = ["WebDatasetWriter"]

_ZEROS = bytes(BLOCK)
#: Data up to this size is joined with its header into one write.
_SMALL = 4096

# A fast path for the common member header (name <= 100 bytes, size < 8 GiB): every field but
# name, size and checksum is fixed, so the header is spliced from a template that
# ``encode_member_header`` itself made (ustar offsets: name 0, size 124, chksum 148, end 512).
_TEMPLATE = encode_member_header(b"x", 0)
_HEAD, _MID, _TAIL = _TEMPLATE[100:124], _TEMPLATE[136:148], _TEMPLATE[156:]
# Checksum of the fixed fields, with the checksum field counted as eight spaces (POSIX).
_FIXED_SUM = sum(_HEAD) + sum(_MID) + 8 * 0x20 + sum(_TAIL)


def _member_header(name: bytes, size: int) -> bytes:
    """``encode_member_header(name, size)``, faster for the names and sizes of ordinary samples."""
    if len(name) > 100 or size > MAX_USTAR_SIZE or size < 0:
        return encode_member_header(name, size)
    size_field = b"%011o\x00" % size
    checksum = _FIXED_SUM + sum(name) + sum(size_field)
    return b"".join(
        (name.ljust(100, b"\0"), _HEAD, size_field, _MID, b"%06o\x00 " % checksum, _TAIL)
    )


class WebDatasetWriter(ShardWriter):
    """Writes samples as tar members ``KEY.FIELD``, grouped by sample, in the order given.

    The shard is streamed through ``store.open_writer(key)`` in chunks of a few MiB, hashed and
    written by a helper thread (:class:`~fastload.formats._output.ShardOutput`): memory use does
    not grow with the shard (apart from the index entries, ~100 bytes per field). Output is deterministic: the same
    samples written in the same order give byte-identical shards (mtime 0, uid/gid 0, empty
    owner names, mode 0644, ustar headers, no record padding). After the shard is committed,
    its DALI ``v1.2`` index is stored as ``key + ".idx"`` (unless ``index=False``).

    A writer is used by one thread at a time.

    Args:
        store: Where the shard goes.
        key: The shard's key, e.g. ``"train-000000.tar"``.
        index: Also write the DALI index ``key + ".idx"``.

    Raises:
        InvalidArgumentError: From :meth:`write`, for a sample that cannot be stored losslessly:
            no ``__key__`` or no fields, a key that repeats the previous sample's key, a key that
            is absolute, has a ``..`` segment or ends with ``/``, a key with whitespace while
            ``index=True`` (DALI's index format splits on whitespace), or an unencodable field.
    """

    def __init__(self, store: Store, key: str, *, index: bool = True) -> None:
        super().__init__(store, key, index=index)
        self.index_key = key + ".idx" if index else None
        self._output = ShardOutput(store.open_writer(key))
        self._pad = 0  # zero bytes owed after the previous member's data
        self._last_key: str | None = None
        self._samples: list[list[Component]] = []
        self._info: ShardInfo | None = None
        self._done = False

    @property
    def num_bytes(self) -> int:
        """Bytes of shard written so far (headers and data, before the end-of-archive blocks)."""
        return self._output.nbytes

    def _check_key(self, key: str) -> None:
        where = f"writing {self.store.child_url(self.key)}"
        if key.startswith("/") or ".." in key.split("/"):
            raise InvalidArgumentError(
                f"sample key {key!r} is absolute or has a '..' segment; tar readers refuse such "
                f"member names as unsafe ({where})"
            )
        if key.endswith("/"):
            raise InvalidArgumentError(
                f"sample key {key!r} ends with '/', so its members would be hidden files "
                f"('{key}.jpg') that WebDataset readers skip ({where})"
            )
        if self.write_index and has_index_whitespace(key):
            raise InvalidArgumentError(
                f"sample key {key!r} contains whitespace, which DALI's WebDataset index format "
                f"cannot represent; replace it (e.g. with '_') or pass index=False ({where})"
            )
        if key == self._last_key:
            raise InvalidArgumentError(
                f"sample key {key!r} repeats the previous sample's key; tar readers would merge "
                f"the two samples into one. Give every sample a unique key ({where})"
            )

    def write(self, sample: Mapping[str, Any]) -> None:
        """Append one sample; its fields become members in the sample's insertion order.

        Nothing of the sample is written if it is rejected.
        """
        if self._done:
            raise InvalidArgumentError(
                f"write to a closed or aborted writer of {self.store.child_url(self.key)}"
            )
        encoded = encode_sample(sample)
        key = str(encoded.pop("__key__"))
        self._check_key(key)
        if not encoded:
            raise InvalidArgumentError(
                f"sample {key!r} has no fields; a tar shard stores samples as their fields' "
                "members, so a sample without fields would vanish. Add at least one field"
            )
        members = []
        for field, data in encoded.items():
            name = f"{key}.{field}"
            try:
                raw = name.encode("utf-8", "surrogateescape")
            except UnicodeEncodeError as exc:
                raise InvalidArgumentError(
                    f"member name {name!r} cannot be encoded as UTF-8: {exc}"
                ) from exc
            members.append((field, name, _member_header(raw, len(data)), data))

        comps = []
        output = self._output
        pad = self._pad
        for field, name, header, data in members:
            size = len(data)
            if pad:
                header = _ZEROS[:pad] + header
            comps.append(Component(field, output.nbytes + len(header), size, name))
            if size <= _SMALL:
                output.write(header + data)
            else:
                output.write(header)
                output.write(data)
            pad = -size % BLOCK
        self._pad = pad
        self._samples.append(comps)
        self._last_key = key
        self._count_fields(encoded)

    def close(self) -> ShardInfo:
        """Finish the archive, commit the shard, then store the index; describe the shard.

        Calling it again returns the same :class:`ShardInfo`.
        """
        if self._info is not None:
            return self._info
        if self._done:
            raise InvalidArgumentError(
                f"cannot close an aborted writer of {self.store.child_url(self.key)}"
            )
        self._done = True
        try:
            self._output.write(bytes(self._pad) + END_OF_ARCHIVE)
        except BaseException:
            self._output.discard()
            raise
        self._pad = 0
        sha256 = self._output.commit()
        if self.index_key is not None:
            self.store.put(self.index_key, format_index(self._samples))
        self._samples = []
        self._info = self._shard_info(
            num_bytes=self._output.nbytes, sha256=sha256, index_key=self.index_key
        )
        return self._info

    def abort(self) -> None:
        """Discard the shard; nothing becomes visible. Safe to call more than once."""
        if self._info is not None:
            return
        self._done = True
        self._samples = []
        self._output.discard()
