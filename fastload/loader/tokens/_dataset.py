"""Packed sequences from a token dataset: :func:`open_tokens` and :class:`TokenDataset`.

A :class:`TokenDataset` is the :class:`~fastload.loader.tokens._source.TokenSource` of one token
dataset (:mod:`fastload.formats.tokens`): for each epoch, ``len(ds)`` sequences of
``seq_len + 1`` ids at positions ``0 .. len - 1``, a pure function of (dataset, ``seq_len``,
``shuffle``, ``seed``, ``window``, epoch, position).

**The epoch stream.** The dataset's blocks in the slots of the epoch's block permutation
(:class:`~fastload.loader.order._order.EpochOrder` with tokens as the items and ``block_tokens`` as the
block size, the same permutation the sample loaders use; see its "block stream"), each block's
ids in order. Without shuffle: the dataset's token stream as it is.

**Sequences.** With ``T`` tokens and ``L = seq_len``, an epoch has ``S = (T - 1) // L``
sequences; sequence ``k`` is ``stream[k*L : k*L + L + 1]`` (inputs ``[:-1]``, targets ``[1:]``;
consecutive sequences share one id: the last target of ``k`` is the first input of ``k + 1``).
Every id of ``stream[0 : S*L]`` is an input exactly once per epoch. The last
``T - S*L`` ids (between 1 and ``L``) are never an input in that epoch: ``stream[S*L]`` is the
last sequence's final target, the rest is not read. With shuffle the stream changes every
epoch, so the ids left out change too (e.g. 10^9 tokens, ``L = 2048``: at most 2,048 ids, 2 x
10^-6 of an epoch).

**Sequence order.** Positions map to sequences through a shuffle within windows of ``window``
consecutive sequences: position ``p`` lies in window ``w = p // window`` and holds sequence
``w * window + perm_w(p - w * window)``, ``perm_w`` drawn uniformly by
``numpy.random.default_rng([seed, epoch, 6, w])`` (tag 6, :data:`~fastload.loader.order._seeds.
TAG_SEQUENCES`). A window covers ``window x seq_len`` consecutive ids of the stream, hence at most
``window x seq_len / block_tokens + 2`` blocks: reads stay local (a per-process block cache of
that size serves every read), while the blocks of the stream come from all over the dataset
(the block permutation). Randomness kept: which sequences share a batch is uniform within a
window; across windows the order is the stream's. Without shuffle, position ``p`` is sequence
``p``.

**Cost.** O(shards) per epoch (the block permutation's tables); O(window) for the last two
windows' permutations; the block cache (``max_cached_blocks`` blocks: views into mapped
shards, or ``block_tokens x itemsize`` bytes each when read through a store). Nothing grows with
the number of tokens.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from fastload._memo import BoundedMemo
from fastload._units import check_int
from fastload.errors import InvalidArgumentError
from fastload.formats.tokens import TokenLayout
from fastload.loader._dataset import Dataset
from fastload.loader._open import open_dataset
from fastload.loader._options import StoreOptions
from fastload.loader.order._order import ORDER_VERSION, EpochOrder
from fastload.loader.order._seeds import TAG_SEQUENCES, check_seed
from fastload.loader.tokens._blocks import TokenBlocks
from fastload.loader.tokens._source import TokenBatch
from fastload.storage import DEFAULT_CACHE_SIZE, Store

__all__ = ["DEFAULT_SEQ_WINDOW", "TokenDataset", "open_tokens"]

#: Default sequences per shuffle window.
DEFAULT_SEQ_WINDOW = 1024
IntArray = npt.NDArray[np.int64]


def open_tokens(
    url: str | os.PathLike[str] | Store,
    seq_len: int = 2048,
    *,
    shuffle: bool = True,
    seed: int = 0,
    window: int = DEFAULT_SEQ_WINDOW,
    max_cached_blocks: int | None = None,
    store_options: Mapping[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_size: int | str = DEFAULT_CACHE_SIZE,
    max_open_shards: int | None = None,
) -> TokenDataset:
    """Open a token dataset (``fastload convert --tokenize``) as packed sequences.

    Args:
        url: The dataset root (as :func:`fastload.open_dataset` takes it), or a store.
        seq_len: ``L``, input ids per sequence (``>= 1``); each row holds ``L + 1`` ids.
        shuffle: Shuffle blocks and sequences per epoch (module doc); ``False`` reads the
            token stream in order.
        seed: Non-negative seed; the order is a pure function of (seed, epoch).
        window: Sequences per shuffle window (``>= 1``): how far sequences mix; the block
            cache holds about ``window x seq_len / block_tokens`` blocks.
        max_cached_blocks: Blocks each process keeps (``None``: two windows' worth plus 4).
        store_options, cache_dir, cache_size: As for :func:`fastload.open_dataset`; with
            ``cache_dir=`` a remote dataset's shards are cached whole on local disk and then
            read memory-mapped.
        max_open_shards: Shards kept open (mapped, one file descriptor each) per process.
            ``None``: a quarter of the soft ``RLIMIT_NOFILE``, between 16 and 1,024. A
            window's blocks come from all over the dataset, so keep it at or above the number
            of shards: reopening a shard costs a parse of its index.

    Raises:
        ManifestError: ``url`` is not a token dataset (no ``metadata["tokens"]``) or its
            layout disagrees with its shards.
        InvalidArgumentError: A bad option, or a dataset shorter than one sequence.
        ObjectNotFoundError: No manifest at ``url``.
    """
    ds = open_dataset(
        StoreOptions(store_options, cache_dir, cache_size, entry="open_tokens").open(url),
        shuffle=False,
        decode=None,
        max_open_shards=default_open_shards() if max_open_shards is None else max_open_shards,
        prefetch_shards=0,
    )
    layout = TokenLayout.from_metadata(
        ds.manifest.metadata, shard_samples=ds.shard_sizes.tolist(), where=ds.url
    )
    return TokenDataset(
        ds,
        layout,
        seq_len,
        shuffle=shuffle,
        seed=seed,
        window=window,
        max_cached_blocks=max_cached_blocks,
    )


def default_open_shards() -> int:
    """A quarter of the soft limit on open files, between 16 and 1,024."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 16
    if soft == resource.RLIM_INFINITY:
        return 1024
    return max(16, min(1024, soft // 4))


class TokenDataset:
    """A token dataset as packed sequences (see the module doc); a ``TokenSource``.

    Make one with :func:`open_tokens`. Pickles by configuration (the block cache is per process).
    Not thread-safe: :meth:`sequences` from one thread at a time.

    Attributes:
        layout: The dataset's :class:`~fastload.formats.tokens.TokenLayout`.
        num_tokens: ``T``, ids in an epoch's stream.
        tail: Ids of the stream that are no sequence's input (``T - S*L``, 1 to ``seq_len``).
    """

    def __init__(
        self,
        dataset: Dataset,
        layout: TokenLayout,
        seq_len: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        window: int = DEFAULT_SEQ_WINDOW,
        max_cached_blocks: int | None = None,
        mapped: bool = True,
    ) -> None:
        self._seq_len = check_int("seq_len", seq_len, minimum=1)
        self.window = check_int("window", window, minimum=1)
        self.seed = check_seed("seed", seed)
        self.shuffle = bool(shuffle)
        self.dataset = dataset
        self.layout = layout
        self.num_tokens = layout.num_tokens
        self._num_sequences = (self.num_tokens - 1) // self._seq_len if self.num_tokens else 0
        if self._num_sequences < 1:
            raise InvalidArgumentError(
                f"{dataset.url} holds {self.num_tokens} tokens, fewer than one sequence of "
                f"seq_len={self._seq_len} needs ({self._seq_len + 1}); use a smaller seq_len or "
                "more data"
            )
        self.tail = self.num_tokens - self._num_sequences * self._seq_len
        if max_cached_blocks is None:
            per_window = -(-self.window * self._seq_len // layout.block_tokens) + 2
            max_cached_blocks = 2 * per_window + 4
        capacity = check_int("max_cached_blocks", max_cached_blocks, minimum=1)
        self.blocks = TokenBlocks(dataset, layout, capacity, mapped=mapped)
        starts = np.zeros(len(layout.shard_tokens) + 1, dtype=np.int64)
        np.cumsum(layout.shard_tokens, out=starts[1:])
        self._shard_start: IntArray = starts
        # The last two epochs' orders and windows' tables (a batch spans at most two windows).
        self._orders: BoundedMemo[int, EpochOrder] = BoundedMemo(2)
        self._perms: BoundedMemo[tuple[int, int], IntArray] = BoundedMemo(2)
        self._tables: BoundedMemo[tuple[int, int], _WindowTable] = BoundedMemo(2)

    # ---- the TokenSource contract -------------------------------------------------------------

    @property
    def seq_len(self) -> int:
        """``L``: input ids per sequence (rows hold ``L + 1``)."""
        return self._seq_len

    @property
    def url(self) -> str:
        """The dataset root URL."""
        return self.dataset.url

    @property
    def fingerprint(self) -> str:
        """The shard list's fingerprint and the block size (O(1) after the first call)."""
        return f"{self.dataset.fingerprint}/b{self.layout.block_tokens}"

    def __len__(self) -> int:
        """``S``: sequences per epoch."""
        return self._num_sequences

    def order_options(self) -> dict[str, Any]:
        """What decides the sequence at a position (saved in and checked against states)."""
        return {
            "order_version": ORDER_VERSION,
            "seq_len": self._seq_len,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "window": self.window,
        }

    def continues_order(self, version: object) -> bool:
        """True: the order version is one of :meth:`order_options`, checked with them."""
        return True

    def node_stats(self) -> dict[str, int]:
        """Empty: a token dataset reports no node cache figures."""
        return {}

    def sequences(
        self, epoch: int, positions: npt.NDArray[np.int64], *, with_starts: bool = False
    ) -> TokenBatch:
        """The sequences at ``positions`` of ``epoch`` (module doc), in the given order.

        Returns:
            ``tokens`` of shape ``(len(positions), seq_len + 1)`` in the stored dtype; with
            ``with_starts``, ``starts`` marks column 0 and every id that begins a document or a
            block not continuing the id before it.

        Raises:
            InvalidArgumentError: A position outside ``[0, len(self))``.
            CorruptDataError: A block disagrees with the layout.
        """
        return self.sequences_as(self.layout.dtype, epoch, positions, with_starts=with_starts)

    def sequences_as(
        self,
        dtype: np.dtype[Any],
        epoch: int,
        positions: npt.NDArray[np.int64],
        *,
        with_starts: bool = False,
    ) -> TokenBatch:
        """:meth:`sequences` with ``tokens`` of ``dtype`` (an integer dtype that holds every id:
        the stored one, ``int32`` or ``int64``), converted while they are copied."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        width = self._seq_len + 1
        out = np.empty((len(pos), width), dtype=dtype)
        starts = np.zeros((len(pos), width), dtype=np.bool_) if with_starts else None
        if not pos.size:
            return TokenBatch(out, starts)
        low, high = int(pos.min()), int(pos.max())
        if low < 0 or high >= self._num_sequences:
            raise InvalidArgumentError(
                f"sequence positions must lie in [0, {self._num_sequences}), got [{low}, {high}]"
            )
        flat = out.reshape(-1)
        marks = None if starts is None else starts.reshape(-1)
        first = (self._sequence_of(epoch, pos, low, high) * self._seq_len).tolist()
        if marks is not None:
            table = self._window_table(epoch, first[0])
            for row, a in enumerate(first):
                if not table.start <= a < table.stop:
                    table = self._window_table(epoch, a)
                table.copy(flat, row * width, a, width, marks)
            return TokenBatch(out, starts)
        table = self._window_table(epoch, first[0])
        lo, hi, at, arrays, firsts, lengths, ends, base = table.parts()
        bisect_right = bisect.bisect_right
        dest = 0
        for a in first:
            if not lo <= a < hi:
                table = self._window_table(epoch, a)
                lo, hi, at, arrays, firsts, lengths, ends, base = table.parts()
            j = bisect_right(at, a) - 1
            room = ends[j] - a
            f = base[j] + a
            if room >= width:  # the usual case: one piece
                flat[dest : dest + width] = arrays[j][f : f + width]
            elif room + lengths[j + 1] >= width:  # two pieces
                flat[dest : dest + room] = arrays[j][f : f + room]
                g = firsts[j + 1]
                flat[dest + room : dest + width] = arrays[j + 1][g : g + width - room]
            else:  # more (short blocks)
                table.copy(flat, dest, a, width, None)
            dest += width
        return TokenBatch(out, starts)

    # ---- order --------------------------------------------------------------------------------

    def sequence_of(self, epoch: int, positions: npt.ArrayLike) -> IntArray:
        """The sequence number ``k`` at each position of ``epoch`` (module doc)."""
        pos = np.asarray(positions, dtype=np.int64)
        if not pos.size:
            return pos.copy()
        return self._sequence_of(epoch, pos, int(pos.min()), int(pos.max()))

    def _sequence_of(self, epoch: int, pos: IntArray, low: int, high: int) -> IntArray:
        """:meth:`sequence_of` of non-empty ``pos`` whose least and greatest are given."""
        if not self.shuffle:
            return pos.copy()
        check_seed("epoch", epoch)
        w = low // self.window
        if high // self.window == w:  # the usual case: a batch within one window
            base = w * self.window
            out: IntArray = base + self._window_perm(epoch, w)[pos - base]
            return out
        window = pos // self.window
        out = np.empty_like(pos)
        for w in np.unique(window).tolist():
            mask = window == w
            base = w * self.window
            out[mask] = base + self._window_perm(epoch, w)[pos[mask] - base]
        return out

    def _window_perm(self, epoch: int, w: int) -> IntArray:
        key = (epoch, w)
        perm = self._perms.get(key)
        if perm is None:
            size = min(self.window, self._num_sequences - w * self.window)
            rng = np.random.default_rng([self.seed, epoch, TAG_SEQUENCES, w])
            perm = rng.permutation(size).astype(np.int64, copy=False)
            self._perms.put(key, perm)
        return perm

    def _window_table(self, epoch: int, at: int) -> _WindowTable:
        """The pieces of the stream that the sequences of the window holding stream position
        ``at`` read (the last two kept)."""
        w = at // self._seq_len // self.window
        key = (epoch, w)
        table = self._tables.get(key)
        if table is None:
            start = w * self.window * self._seq_len
            last = min((w + 1) * self.window, self._num_sequences)  # sequences before it
            stop = last * self._seq_len + 1
            _row, src, length = self._order(epoch).block_spans([start], [stop])
            shard = np.searchsorted(self._shard_start, src, side="right") - 1
            block, inside = np.divmod(src - self._shard_start[shard], self.layout.block_tokens)
            table = _WindowTable(
                start, last * self._seq_len, self.blocks, src, length, shard, block, inside
            )
            self._tables.put(key, table)
        return table

    def _order(self, epoch: int) -> EpochOrder:
        order = self._orders.get(epoch)
        if order is None:
            order = EpochOrder(
                list(self.layout.shard_tokens),
                seed=self.seed,
                epoch=check_seed("epoch", epoch),
                shuffle=self.shuffle,
                block_size=self.layout.block_tokens,
                window=1,
            )
            self._orders.put(epoch, order)
        return order

    def close(self) -> None:
        """Release this process's mapped shards and cached blocks (reopened on next use)."""
        self.blocks.close()
        self.dataset.close()

    def __repr__(self) -> str:
        return (
            f"TokenDataset({self.url!r}, seq_len={self._seq_len}, sequences="
            f"{self._num_sequences}, tokens={self.num_tokens}, shuffle={self.shuffle}, "
            f"seed={self.seed}, window={self.window})"
        )


class _WindowTable:
    """The stream positions ``[start, stop]`` of one sequence window as pieces of blocks, each
    resolved to an ids array and an offset (:meth:`TokenBlocks.locate`), for per-sequence
    copies in plain Python (a window's few hundred pieces are resolved once; a sequence then
    costs a bisection and one or two slice copies)."""

    __slots__ = (
        "_blocks",
        "arrays",
        "base",
        "blocks",
        "ends",
        "firsts",
        "lengths",
        "sources",
        "start",
        "starts",
        "stop",
    )

    def __init__(
        self,
        start: int,
        stop: int,
        blocks: TokenBlocks,
        sources: IntArray,
        lengths: IntArray,
        shard: IntArray,
        block: IntArray,
        inside: IntArray,
    ) -> None:
        self.start, self.stop = start, stop  # sequences start in [start, stop)
        self._blocks = blocks
        self.lengths: list[int] = lengths.tolist()
        self.sources: list[int] = sources.tolist()  # dataset index of each piece's first id
        self.starts: list[int] = (start + np.cumsum(lengths) - lengths).tolist()  # in the stream
        shards, blocks_of, insides = shard.tolist(), block.tolist(), inside.tolist()
        self.blocks = list(zip(shards, blocks_of, insides, strict=True))  # (shard, block, offset)
        # Each piece's ids array and the index of its first id in it.
        self.arrays, self.firsts = blocks.locate_all(shards, blocks_of, insides)
        self.ends = [a + n for a, n in zip(self.starts, self.lengths, strict=True)]
        self.base = [f - a for f, a in zip(self.firsts, self.starts, strict=True)]

    def parts(
        self,
    ) -> tuple[
        int, int, list[int], list[npt.NDArray[Any]], list[int], list[int], list[int], list[int]
    ]:
        """``(start, stop, piece starts, arrays, firsts, lengths, ends, base)`` for a caller's
        fast path: piece ``j`` covers stream ``[starts[j], ends[j])``, and stream position
        ``a`` in it is ``arrays[j][base[j] + a]``."""
        return (
            self.start,
            self.stop,
            self.starts,
            self.arrays,
            self.firsts,
            self.lengths,
            self.ends,
            self.base,
        )

    def copy(
        self,
        out: npt.NDArray[Any],
        dest: int,
        at: int,
        n: int,
        marks: npt.NDArray[np.bool_] | None,
    ) -> None:
        """Copy stream ``[at, at + n)`` to ``out[dest:]``; with ``marks``, mark its first id,
        document starts and pieces that do not continue the piece before them."""
        j = bisect.bisect_right(self.starts, at) - 1
        offset = at - self.starts[j]
        col = 0
        while col < n:
            take = min(n - col, self.lengths[j] - offset)
            first = self.firsts[j] + offset
            out[dest + col : dest + col + take] = self.arrays[j][first : first + take]
            if marks is not None:
                self._mark(marks, j, dest, col, offset, take)
            col += take
            j += 1
            offset = 0

    def _mark(
        self, marks: npt.NDArray[np.bool_], j: int, dest: int, col: int, offset: int, take: int
    ) -> None:
        if col == 0 or self.sources[j] != self.sources[j - 1] + self.lengths[j - 1]:
            marks[dest + col] = True
        shard, block, inside = self.blocks[j]
        docs = self._blocks.docs(shard, block)
        lo, hi = np.searchsorted(docs, [inside + offset, inside + offset + take])
        if hi > lo:
            marks[dest + col + docs[lo:hi].astype(np.int64) - inside - offset] = True
