"""The global order of an epoch: a pure function of (seed, epoch, shard sizes, shuffle options).

Every rank and worker computes the same order independently; nothing is communicated. The order
never depends on the number of ranks, workers or the batch size, which is what makes exactly-once
partitioning and elastic resumption possible.

**Block shuffle with a window** (``shuffle=True``):

1. Each shard is cut into *blocks* of ``block_size`` consecutive samples; the last block of a shard
   is *short* when the shard size is not a multiple of ``block_size``; empty shards have no blocks.
   The ``M`` blocks are numbered in dataset order. ``block_size=None`` acts as a block size of the
   largest shard: every non-empty shard is one block.
2. *Slot* ``k`` of the epoch holds block ``perm(k)``, where ``perm`` is a keyed permutation of
   ``range(M)`` drawn from ``[seed, epoch, 1]`` (:func:`~fastload.loader.order._permute.block_permutation`:
   NumPy's uniform permutation up to 4,096 blocks, a Feistel network computed on demand above).
3. Consecutive slots are grouped into *windows* of ``window`` slots, and the samples of window ``w``
   are permuted with ``default_rng([seed, epoch, 2, w])``.

Position ``p`` of the epoch is therefore: find its window, apply that window's permutation, find the
slot the permuted offset falls in, and add the offset within the block to the block's first sample.
Reads for a batch touch at most ``window`` blocks (locality for range reads and shard caches), while
blocks come from anywhere in the dataset (global mixing). ``block_size=None`` with a small ``window``
is the classic streaming shuffle: shard order plus a buffer of ``window`` shards.

**Where the slots start.** Only short blocks (at most one per shard) break the ``k x block_size``
arithmetic, so their slots (``perm`` inverted) are found once per epoch and kept sorted, with the
running sum of their shortfalls: slot ``k`` starts at ``k x block_size`` minus the shortfall of the
short slots before ``k``, and position ``p`` is in slot ``(p + shortfall of the short slots ending at
or before p) // block_size`` (one binary search over the short slots either way).

**Cost** (``S`` shards, ``N`` samples; nothing depends on ``N``):

* O(1): the block permutation (8 Feistel round keys, or a table of at most 4,096 blocks, 64 KiB).
* O(S): built per epoch, kept while the order lives: shard starts and first blocks, the sorted
  short slots, their end positions and shortfall sums (five int64 arrays of at most ``S + 1``
  entries: 4 MB at 10^5 shards); :meth:`EpochOrder.indices` does O(log S) per position on them.
* O(window x block_size): a window's sample permutation and block table, built on first use; the
  last four are cached, with the blocks of the run of 1,024 slots the last one came from (the block
  permutation is evaluated a run at a time).

**Randomness.** With NumPy's permutation of the blocks (up to 4,096 blocks) the order is the one
earlier versions computed: a uniform block permutation, then a uniform permutation inside each
window. Above 4,096 blocks the block permutation is the Feistel network's (a pseudo-random
permutation, see :mod:`fastload.loader.order._permute`): every block lands in a slot spread over the whole
epoch and neighbouring blocks land apart, but it is not a uniform draw from all ``M!`` orders. The
in-window shuffle stays uniform. :data:`ORDER_VERSION` names this algorithm: a change to any of it
(the numbering, the permutation, the windows) must bump it, since a resume state saved under one
order cannot be continued exactly under another.

Without shuffle the order is the dataset order (shard by shard, as the manifest lists them).

**The block stream** (:meth:`EpochOrder.block_spans`, used by the token loader): the same slots
without step 3, i.e. the blocks in slot order with the samples of each block in dataset order
(without shuffle, the dataset order cut at block boundaries). Token datasets use tokens as the
samples and their blocks as the blocks, so the epoch's token stream is this stream.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.ma  # np.unique imports it on first use (15-50 ms): here, not in every worker
import numpy.typing as npt

from fastload.errors import InvalidArgumentError
from fastload.loader.order._permute import TABLE_LIMIT, IdentityPermutation, block_permutation
from fastload.loader.order._seeds import TAG_BLOCKS, TAG_WINDOW, check_seed

__all__ = [
    "OrderOptions",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_WINDOW",
    "ORDER_VERSION",
    "EpochOrder",
    "computes_order_version",
]

#: Default samples per block.
DEFAULT_BLOCK_SIZE = 64
#: Default blocks per shuffle window (so a window holds up to 4096 samples by default).
DEFAULT_WINDOW = 64
#: Version of the order algorithm (module doc); resume states record it with the order options.
#: Version 1 (states without the entry) permuted every block with NumPy, as version 2 does up to
#: 4,096 blocks.
ORDER_VERSION = 2

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class OrderOptions:
    """The options of a sample dataset's epoch order, validated once (here).

    ``open_dataset``'s ``shuffle``, ``seed``, ``block_size`` and ``window`` (see there); what
    :class:`EpochOrder` computes with, and what a resume state must match (:meth:`state`).

    Raises:
        InvalidArgumentError: A negative or non-int seed, a ``block_size`` that is not a
            positive int or ``None``, a ``window`` that is not a positive int.
    """

    shuffle: bool = True
    seed: int = 0
    block_size: int | None = DEFAULT_BLOCK_SIZE
    window: int = DEFAULT_WINDOW

    def __post_init__(self) -> None:
        object.__setattr__(self, "shuffle", bool(self.shuffle))
        check_seed("seed", self.seed)
        b = self.block_size
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise InvalidArgumentError(
                f"block_size must be a positive int or None (whole shards), got {b!r}"
            )
        w = self.window
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise InvalidArgumentError(f"window must be a positive int, got {w!r}")

    def state(self) -> dict[str, Any]:
        """The order's entries of a loader state: this fastload's order version and the options."""
        return {"order_version": ORDER_VERSION, **dataclasses.asdict(self)}


def computes_order_version(
    version: int, shard_sizes: npt.ArrayLike, *, shuffle: bool, block_size: int | None
) -> bool:
    """Whether this fastload's epoch orders for these options are those of order algorithm
    ``version``, so that a resume state saved under it continues exactly.

    True for this version; for any version without shuffle (the dataset order); and for version 1
    when the dataset has at most 4,096 blocks (the block permutation is NumPy's in both).
    O(shards).
    """
    if version == ORDER_VERSION or not shuffle:
        return True
    if version != 1:
        return False
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    block = block_size if block_size is not None else max(1, int(sizes.max(initial=0)))
    return int((-(-sizes // block)).sum()) <= TABLE_LIMIT


class _Window(NamedTuple):
    """One shuffle window: where it starts, its sample permutation and its blocks."""

    start: int  # first epoch position
    stop: int  # epoch position after the last
    perm: IntArray  # offset in the window -> permuted offset
    block_first: IntArray  # dataset index of each block's first sample, in slot order
    block_offset: IntArray  # offset of each block in the window; one more entry: the window size


class EpochOrder:
    """The order in which one epoch visits the dataset's samples.

    ``order.indices(positions)`` maps positions of the epoch (``0 <= p < N``) to dataset indices
    (sample ``i`` of the dataset is sample ``i - offset[s]`` of shard ``s``). It is a bijection of
    ``range(N)`` and a pure function of the constructor's arguments.

    Args:
        shard_sizes: Samples per shard, in manifest order (zeros allowed).
        seed: Non-negative shuffle seed.
        epoch: Non-negative epoch number.
        shuffle: ``False`` gives the dataset order.
        block_size: Samples per block; ``None`` makes each shard one block.
        window: Blocks per shuffle window (``>= 1``).

    Thread safety: :meth:`indices` may be called from one thread at a time (it caches windows).
    """

    _CACHED_WINDOWS = 4
    #: Slots whose blocks are computed together (see :meth:`_blocks_of_window`).
    _SLOTS_PER_RUN = 1024

    def __init__(
        self,
        shard_sizes: Sequence[int],
        *,
        seed: int = 0,
        epoch: int = 0,
        shuffle: bool = True,
        block_size: int | None = DEFAULT_BLOCK_SIZE,
        window: int = DEFAULT_WINDOW,
    ) -> None:
        OrderOptions(shuffle, seed, block_size, window)  # validates
        self.seed = seed
        self.epoch = check_seed("epoch", epoch)
        sizes = np.asarray(list(shard_sizes), dtype=np.int64)
        if sizes.ndim != 1 or (sizes < 0).any():
            raise InvalidArgumentError(f"shard sizes must be non-negative ints, got {shard_sizes}")
        self.shuffle = bool(shuffle)
        self.block_size = block_size
        self.window = window
        self.num_samples = int(sizes.sum())
        self._windows: OrderedDict[int, _Window] = OrderedDict()
        self._sizes = sizes
        if not self.shuffle or self.num_samples == 0:
            self._num_blocks = 0
            return
        self._build_blocks()

    def _build_blocks(self) -> None:
        """The block tables (shard starts, first blocks, permutation, short slots): O(shards)."""
        sizes = self._sizes
        self._block = self.block_size if self.block_size is not None else int(sizes.max())
        # _shard_start[s] = dataset index of shard s's first sample; _shard_start[-1] == N.
        self._shard_start: IntArray = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=self._shard_start[1:])
        # _first_block[s] = number of shard s's first block; _first_block[-1] == M.
        self._first_block: IntArray = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(-(-sizes // self._block), out=self._first_block[1:])
        self._num_blocks = int(self._first_block[-1])
        if self.shuffle:
            self._perm = block_permutation(self._num_blocks, [self.seed, self.epoch, TAG_BLOCKS])
        else:  # only for block_spans: the blocks in dataset order
            self._perm = IdentityPermutation(self._num_blocks)
        self._windows_per_run = max(1, self._SLOTS_PER_RUN // self.window)
        self._run_blocks: tuple[int, IntArray] | None = None
        self._span_run: tuple[int, IntArray] | None = None  # for block_spans
        self._locate_short_blocks(sizes)

    def _locate_short_blocks(self, sizes: IntArray) -> None:
        """Find the slots of the short blocks and the running sum of their shortfalls."""
        tail = sizes % self._block
        has_short = tail > 0
        slots = self._perm.inverse(self._first_block[1:][has_short] - 1)
        order = np.argsort(slots)
        # Slots holding a short block, increasing.
        self._short_slot: IntArray = slots[order]
        # _shortfall[j] = samples missing from the first j short slots (vs full blocks).
        self._shortfall: IntArray = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(self._block - tail[has_short][order], out=self._shortfall[1:])
        # First epoch position after each short slot.
        self._short_end: IntArray = (self._short_slot + 1) * self._block - self._shortfall[1:]

    @property
    def num_windows(self) -> int:
        """Number of shuffle windows (0 without shuffle)."""
        return -(-self._num_blocks // self.window) if self.shuffle else 0

    def window_range(self, w: int) -> tuple[int, int]:
        """Epoch positions ``[start, stop)`` of shuffle window ``w`` (``0 <= w < num_windows``):
        their samples come from at most ``window`` blocks."""
        if not 0 <= w < self.num_windows:
            raise InvalidArgumentError(f"window number must be in [0, {self.num_windows}), got {w}")
        first = w * self.window
        start, stop = self._slot_start(
            np.array([first, min(first + self.window, self._num_blocks)])
        )
        return int(start), int(stop)

    def _slot_start(self, slots: IntArray) -> IntArray:
        """First epoch position of each slot (``slots`` may include ``M``, which starts at ``N``)."""
        short_before = np.searchsorted(self._short_slot, slots, side="left")
        return slots * self._block - self._shortfall[short_before]

    def _slot_of(self, positions: IntArray) -> IntArray:
        """The slot of each epoch position."""
        short_before = np.searchsorted(self._short_end, positions, side="right")
        slots: IntArray = (positions + self._shortfall[short_before]) // self._block
        return slots

    def _window_of(self, positions: IntArray) -> IntArray:
        """The window of each epoch position."""
        return self._slot_of(positions) // self.window

    def block_spans(
        self, starts: npt.ArrayLike, stops: npt.ArrayLike
    ) -> tuple[IntArray, IntArray, IntArray]:
        """Cover ranges of the *block stream* (module doc) with pieces of single blocks.

        Args:
            starts: First stream position of each range (1-D ints, ``0 <= start``).
            stops: Stream position after each range's last (``start < stop <= N``).

        Returns:
            ``(row, first, length)``, one entry per piece, ranges in order and each range's
            pieces in stream order: the range the piece belongs to, the dataset index of its
            first sample and its number of samples. A piece lies within one block, so its
            samples are consecutive in the dataset and in one shard.

        Cost: O(pieces + log shards) vectorised; the first call without shuffle builds the
        O(shards) block tables.

        Raises:
            InvalidArgumentError: A range is empty or outside ``[0, N)``.
        """
        lo = np.asarray(starts, dtype=np.int64).reshape(-1)
        hi = np.asarray(stops, dtype=np.int64).reshape(-1)
        if lo.shape != hi.shape:
            raise InvalidArgumentError("block_spans takes as many starts as stops")
        empty = np.zeros(0, dtype=np.int64)
        if not lo.size:
            return empty, empty, empty
        if (lo < 0).any() or (hi > self.num_samples).any() or (hi <= lo).any():
            raise InvalidArgumentError(
                f"block stream ranges must be non-empty and lie in [0, {self.num_samples})"
            )
        if not self._num_blocks:
            self._build_blocks()
        first_slot = self._slot_of(lo)
        counts = self._slot_of(hi - 1) - first_slot + 1
        total = int(counts.sum())
        row = np.repeat(np.arange(len(lo), dtype=np.int64), counts)
        begin = np.cumsum(counts) - counts
        slots = np.repeat(first_slot - begin, counts) + np.arange(total, dtype=np.int64)
        slot_start = self._slot_start(slots)
        blocks = self._slot_blocks(slots)
        shard = np.searchsorted(self._first_block, blocks, side="right") - 1
        first = self._shard_start[shard] + (blocks - self._first_block[shard]) * self._block
        length = np.minimum(self._block, self._shard_start[shard + 1] - first)
        piece_lo = np.maximum(lo[row], slot_start)
        piece_hi = np.minimum(hi[row], slot_start + length)
        return row, first + (piece_lo - slot_start), piece_hi - piece_lo

    def _window_table(self, w: int) -> _Window:
        """Window ``w``'s table, from the cache or built (O(window x block_size))."""
        table = self._windows.get(w)
        if table is not None:
            self._windows.move_to_end(w)
            return table
        slots = np.arange(w * self.window, min((w + 1) * self.window, self._num_blocks))
        blocks = self._blocks_of_window(w)
        shard = np.searchsorted(self._first_block, blocks, side="right") - 1
        first = self._shard_start[shard] + (blocks - self._first_block[shard]) * self._block
        block_offset = np.zeros(len(slots) + 1, dtype=np.int64)
        np.cumsum(
            np.minimum(self._block, self._shard_start[shard + 1] - first), out=block_offset[1:]
        )
        rng = np.random.default_rng([self.seed, self.epoch, TAG_WINDOW, w])
        perm = rng.permutation(int(block_offset[-1])).astype(np.int64, copy=False)
        start = int(self._slot_start(slots[:1])[0])
        table = _Window(start, start + len(perm), perm, first, block_offset)
        self._windows[w] = table
        if len(self._windows) > self._CACHED_WINDOWS:
            self._windows.popitem(last=False)
        return table

    def _blocks_of_window(self, w: int) -> IntArray:
        """The blocks in window ``w``'s slots. The permutation is evaluated for a run of
        consecutive windows at once (NumPy's cost per call dominates a window's few blocks), the
        last run kept: the next windows are usually the next ones asked for."""
        run = w // self._windows_per_run
        if self._run_blocks is None or self._run_blocks[0] != run:
            first = run * self._windows_per_run * self.window
            stop = min(first + self._windows_per_run * self.window, self._num_blocks)
            self._run_blocks = (run, self._perm(np.arange(first, stop)))
        offset = (w - run * self._windows_per_run) * self.window
        return self._run_blocks[1][offset : offset + self.window]

    def _slot_blocks(self, slots: IntArray) -> IntArray:
        """The blocks in ``slots``: from the block permutation evaluated for the run of
        ``_SLOTS_PER_RUN`` slots they lie in (kept: the next ranges are usually close), or
        directly when they span runs."""
        run = int(slots.min()) // self._SLOTS_PER_RUN
        if int(slots.max()) // self._SLOTS_PER_RUN != run:
            return self._perm(slots)
        cached = self._span_run
        if cached is None or cached[0] != run:
            first = run * self._SLOTS_PER_RUN
            stop = min(first + self._SLOTS_PER_RUN, self._num_blocks)
            cached = self._span_run = (run, self._perm(np.arange(first, stop)))
        return cached[1][slots - run * self._SLOTS_PER_RUN]

    def _cached_window_holding(self, lo: int, hi: int) -> _Window | None:
        """The cached window holding positions ``lo`` to ``hi``, if any (the usual case: a batch
        is consecutive positions, smaller than a window)."""
        for w, table in reversed(self._windows.items()):
            if table.start <= lo and hi < table.stop:
                self._windows.move_to_end(w)
                return table
        return None

    def indices(self, positions: npt.ArrayLike) -> IntArray:
        """Dataset indices of the given epoch positions (any shape of ints in ``[0, N)``).

        Raises:
            InvalidArgumentError: A position is outside ``[0, N)``.
        """
        pos = np.asarray(positions, dtype=np.int64)
        if not pos.size:
            return pos.copy()
        lo, hi = int(pos.min()), int(pos.max())
        if lo < 0 or hi >= self.num_samples:
            raise InvalidArgumentError(
                f"epoch positions must lie in [0, {self.num_samples}), got [{lo}, {hi}]"
            )
        if not self.shuffle:
            return pos.copy()
        flat = pos.reshape(-1)
        table = self._cached_window_holding(lo, hi)
        if table is not None:
            return _in_window(table, flat).reshape(pos.shape)
        win = self._window_of(flat)
        out = np.empty_like(flat)
        for w in np.unique(win).tolist():
            mask = win == w
            out[mask] = _in_window(self._window_table(w), flat[mask])
        return out.reshape(pos.shape)

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        return (
            f"EpochOrder(num_samples={self.num_samples}, seed={self.seed}, epoch={self.epoch}, "
            f"shuffle={self.shuffle}, block_size={self.block_size}, window={self.window})"
        )


def _in_window(table: _Window, positions: IntArray) -> IntArray:
    """Dataset indices of epoch positions that all lie in ``table``'s window."""
    shifted = table.perm[positions - table.start]
    block = np.searchsorted(table.block_offset, shifted, side="right") - 1
    return table.block_first[block] + (shifted - table.block_offset[block])
