"""Packed sequences from a token dataset: :func:`open_tokens` and :class:`TokenDataset`.

A :class:`TokenDataset` is the :class:`~fastload.loader._token_source.TokenSource` of one token
dataset (:mod:`fastload.formats.tokens`): for each epoch, ``len(ds)`` sequences of
``seq_len + 1`` ids at positions ``0 .. len - 1``, a pure function of (dataset, ``seq_len``,
``shuffle``, ``seed``, ``window``, epoch, position).

**The epoch stream.** The dataset's blocks in the slots of the epoch's block permutation
(:class:`~fastload.loader._order.EpochOrder` with tokens as the items and ``block_tokens`` as the
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
``numpy.random.default_rng([seed, epoch, 6, w])`` (tag 6, :data:`~fastload.loader._seeds.
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

import os
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from fastload._units import check_int
from fastload.errors import InvalidArgumentError
from fastload.formats.tokens import TokenLayout
from fastload.loader._dataset import Dataset
from fastload.loader._open import open_dataset
from fastload.loader._order import ORDER_VERSION, EpochOrder
from fastload.loader._seeds import TAG_SEQUENCES, check_seed
from fastload.loader._token_source import TokenBatch
from fastload.loader._tokens_blocks import TokenBlocks
from fastload.storage import Store
from fastload.storage._registry import DEFAULT_CACHE_SIZE

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
    max_open_shards: int = 16,
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
        max_open_shards: Shards kept open (mapped) per process.

    Raises:
        ManifestError: ``url`` is not a token dataset (no ``metadata["tokens"]``) or its
            layout disagrees with its shards.
        InvalidArgumentError: A bad option, or a dataset shorter than one sequence.
        ObjectNotFoundError: No manifest at ``url``.
    """
    ds = open_dataset(
        url,
        shuffle=False,
        decode=None,
        store_options=store_options,
        cache_dir=cache_dir,
        cache_size=cache_size,
        max_open_shards=max_open_shards,
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
        self._orders: OrderedDict[int, EpochOrder] = OrderedDict()
        self._perms: OrderedDict[tuple[int, int], IntArray] = OrderedDict()

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
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= self._num_sequences):
            raise InvalidArgumentError(
                f"sequence positions must lie in [0, {self._num_sequences}), got "
                f"[{int(pos.min())}, {int(pos.max())}]"
            )
        width = self._seq_len + 1
        out = np.empty((len(pos), width), dtype=self.layout.dtype)
        starts = np.zeros((len(pos), width), dtype=np.bool_) if with_starts else None
        if not pos.size:
            return TokenBatch(out, starts)
        first = self.sequence_of(epoch, pos) * self._seq_len
        row, src, length = self._order(epoch).block_spans(first, first + width)
        # Each piece lies in one block: its shard, block and offset in the block.
        shard = np.searchsorted(self._shard_start, src, side="right") - 1
        offset = src - self._shard_start[shard]
        block, inside = np.divmod(offset, self.layout.block_tokens)
        # Where each piece goes in the flat output.
        piece_start = np.cumsum(length) - length
        row_start = np.searchsorted(row, np.arange(len(pos)), side="left")
        column = piece_start - piece_start[row_start][row]
        dest = row * width + column
        flat = out.reshape(-1)
        get = self.blocks.get
        docs: list[tuple[npt.NDArray[np.uint32], int, int, int]] = []  # (docs, inside, n, dest)
        for s, b, i, n, d in zip(
            shard.tolist(),
            block.tolist(),
            inside.tolist(),
            length.tolist(),
            dest.tolist(),
            strict=True,
        ):
            found = get(s, b)
            flat[d : d + n] = found.tokens[i : i + n]
            if starts is not None:
                docs.append((found.docs, i, n, d))
        if starts is not None:
            _mark_starts(starts, docs, src, length, dest, column)
        return TokenBatch(out, starts)

    # ---- order --------------------------------------------------------------------------------

    def sequence_of(self, epoch: int, positions: npt.ArrayLike) -> IntArray:
        """The sequence number ``k`` at each position of ``epoch`` (module doc)."""
        pos = np.asarray(positions, dtype=np.int64)
        if not self.shuffle:
            return pos.copy()
        check_seed("epoch", epoch)
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
            self._perms[key] = perm
            while len(self._perms) > 2:
                self._perms.popitem(last=False)
        return perm

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
            self._orders[epoch] = order
            while len(self._orders) > 2:
                self._orders.popitem(last=False)
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


def _mark_starts(
    starts: npt.NDArray[np.bool_],
    docs: list[tuple[npt.NDArray[np.uint32], int, int, int]],
    src: IntArray,
    length: IntArray,
    dest: IntArray,
    column: IntArray,
) -> None:
    """Mark in ``starts`` the documents starting in each piece (``docs``: the block's document
    offsets, the piece's offset in the block, its length and its flat destination), and the
    pieces that do not continue the piece before them (they begin a piece of a document)."""
    flat = starts.reshape(-1)
    breaks = np.ones(len(src), dtype=np.bool_)
    breaks[1:] = src[1:] != src[:-1] + length[:-1]
    flat[dest[breaks | (column == 0)]] = True
    for offsets, i, n, d in docs:
        lo, hi = np.searchsorted(offsets, [i, i + n])
        if hi > lo:
            flat[d + offsets[lo:hi].astype(np.int64) - i] = True
