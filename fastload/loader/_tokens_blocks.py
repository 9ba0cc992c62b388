"""The blocks of a token dataset as NumPy arrays: mapped in place, or read into a bounded cache.

A block (one sample of a token dataset, :mod:`fastload.formats.tokens`) is needed as two arrays:
its token ids and the offsets of the documents starting in it. :class:`TokenBlocks` gets them
one of two ways, per shard:

* **Mapped** (local files: a local store, or the local copy in a ``cache_dir=`` cache): when the
  shard's format can say where a field's bytes lie (:meth:`fastload.formats.ShardReader.
  field_location`; WebDataset from its index), the shard is memory-mapped and a block's ids are
  a NumPy view of the mapping (no copy, no read). Its ``.npy`` header is parsed and checked once
  per block and process while the block is cached.
* **Read** (other stores, TFRecord and LMDB shards): the block is read through the dataset's shard
  readers (``fastload.loader.Dataset.read_raw``) and its ``.npy`` fields parsed (the arrays are
  views of the bytes read: one copy, from the store or page cache).

Both go through one LRU of ``capacity`` blocks per process. A read block holds its bytes
(``block_tokens x itemsize`` plus its document offsets), so a process holds at most
``capacity`` of them; a mapped block holds only a view (address space over the page cache).
Mapped shards are kept in an LRU of ``max_open_shards`` (the dataset's option; each holds a
mapping, its file descriptor and its reader's index, O(blocks of the shard)).

Every block is checked against the layout before use: its ids' dtype and count (``block_tokens``,
or the shard's remainder for its last block) and its document offsets (increasing, inside the
block). A mismatch is a :class:`~fastload.errors.CorruptDataError` naming the shard, the block
and the sample key.

Not thread-safe: one thread per :class:`TokenBlocks` per process (the token loader's reading
thread, or the main thread).
"""

from __future__ import annotations

import io
import mmap
from collections import OrderedDict
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from fastload._lazy import PerProcess
from fastload.errors import CorruptDataError
from fastload.formats import DAMAGED_SHARD_REMEDY, ShardReader
from fastload.formats._mmap import local_file, map_file
from fastload.formats.tokens import DOCS_FIELD, TOKENS_FIELD, TokenLayout
from fastload.loader._dataset import Dataset

__all__ = ["Block", "TokenBlocks", "parse_npy"]

_NPY_MAGIC = b"\x93NUMPY"
_DOCS_DTYPE = np.dtype("<u4")


class Block(NamedTuple):
    """One block's arrays: ``tokens`` (1-D, the layout's dtype) and ``docs`` (``<u4`` offsets of
    the documents starting in the block, increasing)."""

    tokens: npt.NDArray[Any]
    docs: npt.NDArray[np.uint32]


def parse_npy(buf: Any, offset: int, size: int, *, what: str, url: str) -> npt.NDArray[Any]:
    """The 1-D array stored as ``.npy`` (v1.0/2.0) in ``buf[offset : offset + size]``, as a view
    of ``buf`` (no copy; read-only when ``buf`` is). Object and non-1-D arrays are refused.

    Raises:
        CorruptDataError: Not a readable 1-D ``.npy`` of plain numbers; names ``what`` and ``url``.
    """
    from numpy.lib import format as npy_format

    def bad(reason: str) -> CorruptDataError:
        return CorruptDataError(f"{what}: {reason}{DAMAGED_SHARD_REMEDY}", url=url, offset=offset)

    head = bytes(buf[offset : offset + min(size, 10)])
    if len(head) < 10 or not head.startswith(_NPY_MAGIC):
        raise bad("not an .npy array (no NUMPY magic)")
    major = head[6]
    header_len = int.from_bytes(head[8:10], "little")
    start = 10
    if major >= 2:
        header_len = int.from_bytes(bytes(buf[offset + 8 : offset + 12]), "little")
        start = 12
    if start + header_len > size:
        raise bad(f"the .npy header of {header_len} bytes runs past the field's {size} bytes")
    stream = io.BytesIO(bytes(buf[offset : offset + start + header_len]))
    try:
        npy_format.read_magic(stream)
        read = npy_format.read_array_header_1_0 if major == 1 else npy_format.read_array_header_2_0
        shape, _fortran, dtype = read(stream)
    except ValueError as exc:
        raise bad(f"unreadable .npy header ({exc})") from None
    if dtype.hasobject or len(shape) != 1:
        raise bad(f"expected a 1-D array of numbers, found shape {shape} and dtype {dtype}")
    count = shape[0]
    data = offset + start + header_len
    if data + count * dtype.itemsize > offset + size:
        raise bad(
            f"the .npy header declares {count} values of {dtype}, more than the field's bytes"
        )
    return np.frombuffer(buf, dtype=dtype, count=count, offset=data)


class _MappedShard(NamedTuple):
    reader: ShardReader
    view: Any  # mmap.mmap or bytes


class _ProcessState:
    """One process's caches (made per process by :class:`~fastload._lazy.PerProcess`)."""

    def __init__(self) -> None:
        self.blocks: OrderedDict[tuple[int, int], Block] = OrderedDict()
        # shard -> its mapping and reader, or None when it is read through the readers
        self.shards: OrderedDict[int, _MappedShard | None] = OrderedDict()


class TokenBlocks:
    """The blocks of a token dataset, mapped or read, in an LRU of ``capacity`` (module doc).

    Args:
        dataset: The token dataset's shards (``open_dataset`` of its root).
        layout: Its token layout.
        capacity: Blocks kept per process (``>= 1``).
        mapped: Use memory mapping where possible (``False``: always read through the readers).
    """

    def __init__(
        self, dataset: Dataset, layout: TokenLayout, capacity: int, *, mapped: bool = True
    ) -> None:
        self.dataset = dataset
        self.layout = layout
        self.capacity = capacity
        self.mapped = mapped
        self._dtype = layout.dtype
        self._state = PerProcess(_ProcessState)
        self.reads = 0  # blocks made (mapped or read) in this process: cache misses

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_state"] = PerProcess(_ProcessState)
        state["reads"] = 0
        return state

    def block_length(self, shard: int, block: int) -> int:
        """Ids block ``block`` of shard ``shard`` must hold according to the layout."""
        b = self.layout.block_tokens
        return min(b, self.layout.shard_tokens[shard] - block * b)

    def get(self, shard: int, block: int) -> Block:
        """Block ``block`` of shard ``shard`` (checked against the layout), from the cache or
        mapped/read now.

        Raises:
            CorruptDataError: The block disagrees with the layout or is not a token block.
            StoreError: The store failed.
        """
        state = self._state.get()
        key = (shard, block)
        found = state.blocks.get(key)
        if found is not None:
            state.blocks.move_to_end(key)
            return found
        made = self._make(state, shard, block)
        self.reads += 1
        state.blocks[key] = made
        while len(state.blocks) > self.capacity:
            state.blocks.popitem(last=False)
        return made

    def _make(self, state: _ProcessState, shard: int, block: int) -> Block:
        url = self.dataset.shard_url(shard)
        mapped = self._mapped_shard(state, shard) if self.mapped else None
        if mapped is not None:
            where_tokens = mapped.reader.field_location(block, TOKENS_FIELD)
            where_docs = mapped.reader.field_location(block, DOCS_FIELD)
            if where_tokens is not None and where_docs is not None:
                what = f"block {block} of shard {url}"
                tokens = parse_npy(
                    mapped.view, *where_tokens, what=f"{what}, {TOKENS_FIELD}", url=url
                )
                docs = parse_npy(mapped.view, *where_docs, what=f"{what}, {DOCS_FIELD}", url=url)
                return self._checked(shard, block, tokens, docs, key=None)
        raw = self.dataset.read_raw(shard, block)
        if raw is None:  # only under on_error="skip"/"warn", which open_tokens never sets
            raise CorruptDataError(f"block {block} of shard {url} could not be read", url=url)
        key = raw.get("__key__")
        what = f"block {block} (sample {key!r}) of shard {url}"
        fields = []
        for name in (TOKENS_FIELD, DOCS_FIELD):
            data = raw.get(name)
            if not isinstance(data, bytes | bytearray | memoryview):
                raise CorruptDataError(
                    f"{what} has no {name!r} field (it has {sorted(k for k in raw if not k.startswith('__'))}): "
                    f"not a token dataset block{DAMAGED_SHARD_REMEDY}",
                    url=url,
                )
            fields.append(parse_npy(data, 0, len(data), what=f"{what}, {name}", url=url))
        return self._checked(shard, block, fields[0], fields[1], key=key)

    def _mapped_shard(self, state: _ProcessState, shard: int) -> _MappedShard | None:
        """Shard ``shard`` mapped with its reader, or ``None`` when it must be read instead."""
        if shard in state.shards:
            state.shards.move_to_end(shard)
            return state.shards[shard]
        ds = self.dataset
        key = ds.shard_keys[shard]
        path = local_file(ds.store, key)
        view = None if path is None else map_file(path, sequential=False)
        entry: _MappedShard | None = None
        if view is not None:
            reader = ds.format.reader(
                ds.store,
                key,
                index_key=ds.index_keys[shard],
                num_samples=int(ds.shard_sizes[shard]),
                num_bytes=ds.manifest.shards[shard].num_bytes,
            )
            if reader.field_location(0, TOKENS_FIELD) is not None:
                entry = _MappedShard(reader, view)
            else:
                _close(view)
        state.shards[shard] = entry
        while len(state.shards) > ds.max_open_shards:
            _, old = state.shards.popitem(last=False)
            if old is not None:
                old.reader.close()  # the mapping goes when the last block view of it does
        return entry

    def _checked(
        self,
        shard: int,
        block: int,
        tokens: npt.NDArray[Any],
        docs: npt.NDArray[Any],
        *,
        key: str | None,
    ) -> Block:
        url = self.dataset.shard_url(shard)
        what = f"block {block}" + (f" (sample {key!r})" if key else "") + f" of shard {url}"
        want = self.block_length(shard, block)
        problem = None
        if tokens.dtype != self._dtype:
            problem = f"its ids are {tokens.dtype}, the layout stores {self._dtype}"
        elif len(tokens) != want:
            problem = (
                f"it holds {len(tokens)} ids, but the layout (block_tokens="
                f"{self.layout.block_tokens}, {self.layout.shard_tokens[shard]} ids in the "
                f"shard) says {want}"
            )
        elif docs.dtype != _DOCS_DTYPE:
            problem = f"its document offsets are {docs.dtype}, not uint32"
        elif len(docs) and (
            int(docs[-1]) >= want or (len(docs) > 1 and (np.diff(docs.astype(np.int64)) <= 0).any())
        ):
            problem = (
                f"its document offsets {docs.tolist()[:8]}... are not increasing within [0, {want})"
            )
        if problem is not None:
            raise CorruptDataError(
                f"{what} does not match the dataset's token layout: {problem}; check the dataset "
                f"with `fastload verify`{DAMAGED_SHARD_REMEDY}",
                url=url,
            )
        return Block(tokens, docs)

    def close(self) -> None:
        """Drop this process's cached blocks and close its mapped shards' readers."""
        state = self._state.clear()
        if state is None:
            return
        for entry in state.shards.values():
            if entry is not None:
                entry.reader.close()


def _close(view: Any) -> None:
    if isinstance(view, mmap.mmap):
        view.close()
