"""The blocks of a token dataset as NumPy arrays: mapped in place, or read into a bounded cache.

A block (one sample of a token dataset, :mod:`fastload.formats.tokens`) is needed as two arrays:
its token ids and the offsets of the documents starting in it. :class:`TokenBlocks` gets them
one of two ways, per shard:

* **Mapped** (local files: a local store, or the local copy in a ``cache_dir=`` cache): when the
  shard's format can say where a field's bytes lie (:meth:`fastload.formats.ShardReader.
  field_locations`; WebDataset from its index), the shard is memory-mapped once per process and
  viewed as one array of ids; its table keeps, per block, the index of its first id in that
  array (8 bytes) and where its ``docs.npy`` lies. Every block's ``.npy`` header is checked when
  the shard is mapped, all at once (full blocks must carry the first full block's header bytes,
  itself checked against the layout; the others are parsed one by one). Reading a block is then
  a slice of the mapping: no copy until the caller's.
* **Read** (other stores, TFRecord and LMDB shards): the block is read through the dataset's shard
  readers (``fastload.loader.Dataset.read_raw``) and its ``.npy`` fields parsed (the arrays are
  views of the bytes read: one copy, from the store or page cache), kept in an LRU of
  ``capacity`` blocks per process (``block_tokens x itemsize`` bytes plus document offsets each).

Mapped shards are kept in an LRU of ``max_open_shards`` (the dataset's option; each holds a
mapping, its file descriptor and its table, O(blocks of the shard)). Documents' offsets of mapped
blocks are parsed on first use (only loaders asked for boundaries need them), LRU of ``capacity``.

Every block is checked against the layout before use: its ids' dtype and count (``block_tokens``,
or the shard's remainder for its last block) and its document offsets (increasing, inside the
block). A mismatch is a :class:`~fastload.errors.CorruptDataError` naming the shard, the block
and the sample key.

Not thread-safe: one thread per :class:`TokenBlocks` per process (the token loader's reading
thread, or the main thread).
"""

from __future__ import annotations

import array
import io
import mmap
from collections import OrderedDict
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from fastload._lazy import PerProcess
from fastload._memo import BoundedMemo
from fastload._units import check_int
from fastload.errors import CorruptDataError
from fastload.formats import DAMAGED_SHARD_REMEDY, local_file, map_file
from fastload.formats.tokens import DOCS_FIELD, TOKENS_FIELD, TokenLayout
from fastload.loader._dataset import Dataset

__all__ = ["Block", "TokenBlocks", "npy_layout", "parse_npy"]

_NPY_MAGIC = b"\x93NUMPY"
_DOCS_DTYPE = np.dtype("<u4")


class Block(NamedTuple):
    """One block read through the shard readers: its ids (1-D, the layout's dtype) and the
    offsets of the documents starting in it (``<u4``, increasing), both checked."""

    tokens: npt.NDArray[Any]
    docs: npt.NDArray[np.uint32]


#: Parsed ``.npy`` headers by their bytes (blocks repeat a few headers: parsing one with NumPy
#: costs ~100 us, a lookup well under 1 us), the ``_MAX_HEADERS`` used last.
_MAX_HEADERS = 4096
_HEADERS: BoundedMemo[bytes, tuple[tuple[int, ...], np.dtype[Any]] | str] = BoundedMemo(
    _MAX_HEADERS
)


def parse_npy(buf: Any, offset: int, size: int, *, what: str, url: str) -> npt.NDArray[Any]:
    """The 1-D array stored as ``.npy`` (v1.0/2.0) in ``buf[offset : offset + size]``, as a view
    of ``buf`` (no copy; read-only when ``buf`` is). Object and non-1-D arrays are refused.

    Raises:
        CorruptDataError: Not a readable 1-D ``.npy`` of plain numbers; names ``what`` and ``url``.
    """
    data, count, dtype = npy_layout(buf, offset, size, what=what, url=url)
    return np.frombuffer(buf, dtype=dtype, count=count, offset=data)


def npy_layout(
    buf: Any, offset: int, size: int, *, what: str, url: str
) -> tuple[int, int, np.dtype[Any]]:
    """``(byte offset of the data in buf, count, dtype)`` of the 1-D ``.npy`` array in
    ``buf[offset : offset + size]`` (see :func:`parse_npy`)."""

    def bad(reason: str) -> CorruptDataError:
        return CorruptDataError(f"{what}: {reason}{DAMAGED_SHARD_REMEDY}", url=url, offset=offset)

    head = bytes(buf[offset : offset + min(size, 12)])
    if len(head) < 10 or not head.startswith(_NPY_MAGIC):
        raise bad("not an .npy array (no NUMPY magic)")
    major = head[6]
    start = 10 if major == 1 else 12
    header_len = int.from_bytes(head[8:start], "little")
    if start + header_len > size:
        raise bad(f"the .npy header of {header_len} bytes runs past the field's {size} bytes")
    header = bytes(buf[offset : offset + start + header_len])
    parsed = _HEADERS.get(header)
    if parsed is None:
        parsed = _parse_header(header, major)
        _HEADERS.put(header, parsed)
    if isinstance(parsed, str):
        raise bad(parsed)
    shape, dtype = parsed
    count = shape[0]
    data = offset + start + header_len
    if data + count * dtype.itemsize > offset + size:
        raise bad(
            f"the .npy header declares {count} values of {dtype}, more than the field's bytes"
        )
    return data, count, dtype


def _parse_header(header: bytes, major: int) -> tuple[tuple[int, ...], np.dtype[Any]] | str:
    """``(shape, dtype)`` of a whole ``.npy`` header, or what is wrong with it."""
    from numpy.lib import format as npy_format

    stream = io.BytesIO(header)
    try:
        npy_format.read_magic(stream)
        read = npy_format.read_array_header_1_0 if major == 1 else npy_format.read_array_header_2_0
        shape, _fortran, dtype = read(stream)
    except ValueError as exc:
        return f"unreadable .npy header ({exc})"
    if dtype.hasobject or len(shape) != 1:
        return f"expected a 1-D array of numbers, found shape {shape} and dtype {dtype}"
    return tuple(shape), dtype


class _MappedShard(NamedTuple):
    """A shard mapped in place: its ids as one array and where each block's lie in it."""

    ids: npt.NDArray[Any]  # the whole file as ids (a view of its mapping)
    first: array.array[int]  # index in ``ids`` of each block's first id
    docs_at: list[tuple[int, int]]  # (byte offset, size) of each block's docs.npy in the file
    view: Any  # the mapping (mmap.mmap)


_NOT_MAPPED = "not mapped"  # a shard read through the readers (kept in the shard table)


class _ProcessState:
    """One process's tables (made per process by :class:`~fastload._lazy.PerProcess`)."""

    def __init__(self) -> None:
        self.blocks: OrderedDict[tuple[int, int], Block] = OrderedDict()  # read blocks
        self.docs: OrderedDict[tuple[int, int], npt.NDArray[np.uint32]] = OrderedDict()
        self.shards: OrderedDict[int, _MappedShard | str] = OrderedDict()


class TokenBlocks:
    """The blocks of a token dataset, mapped or read (module doc).

    Args:
        dataset: The token dataset's shards (``open_dataset`` of its root).
        layout: Its token layout.
        capacity: Read blocks (and parsed document offsets of mapped ones) kept per process.
        mapped: Map local shards where the format allows (``False``: always read).
    """

    def __init__(
        self, dataset: Dataset, layout: TokenLayout, capacity: int, *, mapped: bool = True
    ) -> None:
        self.dataset = dataset
        self.layout = layout
        self.capacity = check_int("max_cached_blocks", capacity, minimum=1)
        self.mapped = mapped
        self._dtype = layout.dtype
        self._state = PerProcess(_ProcessState)
        self.reads = 0  # blocks read through the readers in this process (cache misses)
        self.maps = 0  # shards mapped in this process

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_state"] = PerProcess(_ProcessState)
        state["reads"] = state["maps"] = 0
        return state

    def block_length(self, shard: int, block: int) -> int:
        """Ids block ``block`` of shard ``shard`` must hold according to the layout."""
        b = self.layout.block_tokens
        return min(b, self.layout.shard_tokens[shard] - block * b)

    def locate(self, shard: int, block: int) -> tuple[npt.NDArray[Any], int]:
        """``(ids, first)``: block ``block`` of shard ``shard`` is ``ids[first : first + n]``
        (``n`` = :meth:`block_length`). For a mapped shard ``ids`` is the whole file viewed as
        ids (no copy); otherwise the block read into the cache. Keep the array, not the pair's
        position, only while the block is in use (a read block may leave the cache).

        Raises:
            CorruptDataError: The block disagrees with the layout.
            StoreError: The store failed.
        """
        state = self._state.get()
        m = state.shards.get(shard)
        if m is None:
            m = self._open_shard(state, shard)
        else:
            state.shards.move_to_end(shard)
        if isinstance(m, _MappedShard):
            return m.ids, m.first[block]
        return self._read_block(state, shard, block).tokens, 0

    def locate_all(
        self, shards: list[int], blocks: list[int], insides: list[int]
    ) -> tuple[list[npt.NDArray[Any]], list[int]]:
        """:meth:`locate` for many blocks at once, each with an offset added: the arrays and
        the index of id ``insides[j]`` of block ``blocks[j]`` of shard ``shards[j]`` in them."""
        state = self._state.get()
        table = state.shards
        arrays: list[npt.NDArray[Any]] = []
        firsts: list[int] = []
        for s, b, i in zip(shards, blocks, insides, strict=True):
            m = table.get(s)
            if m.__class__ is _MappedShard:
                table.move_to_end(s)
                arrays.append(m.ids)
                firsts.append(m.first[b] + i)
            else:
                ids, first = self.locate(s, b)
                arrays.append(ids)
                firsts.append(first + i)
        return arrays, firsts

    def docs(self, shard: int, block: int) -> npt.NDArray[np.uint32]:
        """The checked document offsets of block ``block`` of shard ``shard``.

        Raises:
            CorruptDataError: They are not increasing offsets within the block.
        """
        state = self._state.get()
        m = state.shards.get(shard)
        if m is None:
            m = self._open_shard(state, shard)
        if not isinstance(m, _MappedShard):
            return self._read_block(state, shard, block).docs
        key = (shard, block)
        found = state.docs.get(key)
        if found is None:
            url = self.dataset.shard_url(shard)
            what = f"block {block} of shard {url}, {DOCS_FIELD}"
            parsed = parse_npy(m.view, *m.docs_at[block], what=what, url=url)
            found = _checked_docs(parsed, self.block_length(shard, block), what, url)
            state.docs[key] = found
            if len(state.docs) > self.capacity:
                state.docs.popitem(last=False)
        return found

    # ---- read blocks --------------------------------------------------------------------------

    def _read_block(self, state: _ProcessState, shard: int, block: int) -> Block:
        key = (shard, block)
        found = state.blocks.get(key)
        if found is not None:
            state.blocks.move_to_end(key)
            return found
        url = self.dataset.shard_url(shard)
        raw = self.dataset.read_raw(shard, block)
        if raw is None:  # only under on_error="skip"/"warn", which open_tokens never sets
            raise CorruptDataError(f"block {block} of shard {url} could not be read", url=url)
        what = f"block {block} (sample {raw.get('__key__')!r}) of shard {url}"
        fields = []
        for name in (TOKENS_FIELD, DOCS_FIELD):
            data = raw.get(name)
            if not isinstance(data, bytes | bytearray | memoryview):
                present = sorted(k for k in raw if not k.startswith("__"))
                raise CorruptDataError(
                    f"{what} has no {name!r} field (it has {present}): not a token dataset "
                    f"block{DAMAGED_SHARD_REMEDY}",
                    url=url,
                )
            fields.append(parse_npy(data, 0, len(data), what=f"{what}, {name}", url=url))
        tokens, docs = fields
        self._check_tokens(shard, block, tokens, what)
        made = Block(tokens, _checked_docs(docs, len(tokens), what, url))
        self.reads += 1
        state.blocks[key] = made
        if len(state.blocks) > self.capacity:
            state.blocks.popitem(last=False)
        return made

    def _check_tokens(self, shard: int, block: int, tokens: npt.NDArray[Any], what: str) -> None:
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
        if problem is not None:
            raise _layout_error(what, problem, self.dataset.shard_url(shard))

    # ---- mapped shards ------------------------------------------------------------------------

    def _open_shard(self, state: _ProcessState, shard: int) -> _MappedShard | str:
        """Map shard ``shard`` and check its blocks, or mark it to be read (kept in the LRU)."""
        entry: _MappedShard | str = _NOT_MAPPED
        if self.mapped:
            entry = self._map_shard(shard) or _NOT_MAPPED
        state.shards[shard] = entry
        if len(state.shards) > self.dataset.reader_capacity:  # open_tokens sets it
            state.shards.popitem(last=False)  # the mapping goes with the last view of it
        return entry

    def _map_shard(self, shard: int) -> _MappedShard | None:
        """The shard's table, or ``None`` when it is not a local file or its format cannot say
        where fields lie. Every block's ``.npy`` header is checked here, at once: full blocks'
        headers must equal the first full block's (checked against the layout), others are
        parsed and checked one by one."""
        ds = self.dataset
        key = ds.shard_keys[shard]
        path = local_file(ds.store, key)
        view = None if path is None else map_file(path, sequential=False)
        if not isinstance(view, mmap.mmap):
            return None
        reader = ds.format.reader(
            ds.store,
            key,
            index_key=ds.index_keys[shard],
            num_samples=int(ds.shard_sizes[shard]),
            num_bytes=ds.manifest.shards[shard].num_bytes,
        )
        try:
            tokens_at = reader.field_locations(TOKENS_FIELD)
            docs_at = reader.field_locations(DOCS_FIELD) if tokens_at is not None else None
        except KeyError as exc:
            raise CorruptDataError(
                f"{exc.args[0]}: not a token dataset block{DAMAGED_SHARD_REMEDY}",
                url=ds.shard_url(shard),
            ) from None
        finally:
            reader.close()
        if tokens_at is None or docs_at is None:
            return None
        self.maps += 1
        first = self._block_starts(shard, view, tokens_at)
        if first is None:
            return None
        isz = self._dtype.itemsize
        ids = np.frombuffer(view, dtype=self._dtype, count=len(view) // isz)
        return _MappedShard(ids, first, docs_at, view)

    def _block_starts(
        self, shard: int, view: mmap.mmap, tokens_at: list[tuple[int, int]]
    ) -> array.array[int] | None:
        """Each block's first id as an index into the file viewed as ids (``None`` when some
        block's ids are not aligned to the id size: such shards are read instead)."""
        url = self.dataset.shard_url(shard)
        isz = self._dtype.itemsize
        offsets = np.asarray([o for o, _ in tokens_at], dtype=np.int64)
        sizes = np.asarray([n for _, n in tokens_at], dtype=np.int64)
        data = np.empty(len(offsets), dtype=np.int64)  # byte offset of each block's ids
        full = self.layout.block_tokens
        reference = None  # (header bytes, header length) of a full block, checked
        checked = np.zeros(len(offsets), dtype=np.bool_)
        for b in range(len(offsets)):
            if self.block_length(shard, b) == full:
                what = f"block {b} of shard {url}, {TOKENS_FIELD}"
                ids = parse_npy(view, int(offsets[b]), int(sizes[b]), what=what, url=url)
                self._check_tokens(shard, b, ids, f"block {b} of shard {url}")
                header = int(sizes[b]) - full * isz
                reference = (bytes(view[offsets[b] : offsets[b] + header]), header)
                break
        if reference is not None:  # every full block with the same header and size: checked
            header_bytes, header = reference
            u8 = np.frombuffer(view, dtype=np.uint8)
            same = sizes == header + full * isz
            rows = np.flatnonzero(same & (offsets + header <= len(u8)))
            if len(rows):
                heads = u8[offsets[rows, None] + np.arange(header)]
                rows = rows[(heads == np.frombuffer(header_bytes, dtype=np.uint8)).all(axis=1)]
            checked[rows] = True
            data[rows] = offsets[rows] + header
        for b in np.flatnonzero(~checked).tolist():  # short blocks, and any other header
            what = f"block {b} of shard {url}"
            at, count, dtype = npy_layout(
                view, int(offsets[b]), int(sizes[b]), what=f"{what}, {TOKENS_FIELD}", url=url
            )
            self._check_tokens(shard, b, np.empty(count, dtype=dtype), what)
            data[b] = at
        if (data % isz).any():
            return None
        return array.array("q", (data // isz).tolist())

    def close(self) -> None:
        """Drop this process's tables and cached blocks (the mappings go with their views)."""
        self._state.clear()


def _checked_docs(docs: npt.NDArray[Any], n: int, what: str, url: str) -> npt.NDArray[np.uint32]:
    """``docs`` if they are ``<u4`` offsets increasing within ``[0, n)``."""
    problem = None
    if docs.dtype != _DOCS_DTYPE:
        problem = f"its document offsets are {docs.dtype}, not uint32"
    elif len(docs) and (int(docs[-1]) >= n or not (docs[1:] > docs[:-1]).all()):
        problem = (
            f"its document offsets {docs[:8].tolist()} (first 8 of {len(docs)}) are not "
            f"increasing within [0, {n})"
        )
    if problem is not None:
        raise _layout_error(what, problem, url)
    return docs


def _layout_error(what: str, problem: str, url: str) -> CorruptDataError:
    return CorruptDataError(
        f"{what} does not match the dataset's token layout: {problem}; check the dataset with "
        f"`fastload verify`{DAMAGED_SHARD_REMEDY}",
        url=url,
    )
