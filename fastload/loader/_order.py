"""The global order of an epoch: a pure function of (seed, epoch, shard sizes, shuffle options).

Every rank and worker computes the same order independently; nothing is communicated. The order
never depends on the number of ranks, workers or the batch size, which is what makes exactly-once
partitioning and elastic resumption possible.

**Block shuffle with a window** (``shuffle=True``):

1. Each shard is cut into *blocks* of ``block_size`` consecutive samples (the last block of a shard
   may be shorter; empty shards have no blocks). ``block_size=None`` makes every shard one block.
2. All blocks of the dataset are permuted with ``numpy.random.default_rng([seed, epoch, 1])``.
3. Consecutive permuted blocks are grouped into *windows* of ``window`` blocks, and the samples of
   window ``w`` are permuted with ``default_rng([seed, epoch, 2, w])``.

Position ``p`` of the epoch is therefore: find its window, apply that window's permutation, find the
block the permuted offset falls in, and add the offset within the block to the block's first sample.
Reads for a batch touch at most ``window`` blocks (locality for range reads and shard caches), while
blocks come from anywhere in the dataset (global mixing). ``block_size=None`` with a small ``window``
is the classic streaming shuffle: shard order plus a buffer of ``window`` shards.

**Cost**: the permuted block table is O(N / block_size) integers per epoch (three int64 arrays: for
100 M samples and the default block size of 64, about 37 MB); a window's permutation is computed on
demand (O(window x block_size)) and a few are cached. No O(N) array is ever built.

Without shuffle the order is the dataset order (shard by shard, as the manifest lists them).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from fastload.errors import InvalidArgumentError
from fastload.loader._seeds import TAG_BLOCKS, TAG_WINDOW, check_seed

__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_WINDOW", "EpochOrder"]

#: Default samples per block.
DEFAULT_BLOCK_SIZE = 64
#: Default blocks per shuffle window (so a window holds up to 4096 samples by default).
DEFAULT_WINDOW = 64

IntArray = npt.NDArray[np.int64]


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
        self.seed = check_seed("seed", seed)
        self.epoch = check_seed("epoch", epoch)
        if block_size is not None and (
            isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1
        ):
            raise InvalidArgumentError(
                f"block_size must be a positive int or None (whole shards), got {block_size!r}"
            )
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise InvalidArgumentError(f"window must be a positive int, got {window!r}")
        sizes = np.asarray(list(shard_sizes), dtype=np.int64)
        if sizes.ndim != 1 or (sizes < 0).any():
            raise InvalidArgumentError(f"shard sizes must be non-negative ints, got {shard_sizes}")
        self.shuffle = bool(shuffle)
        self.block_size = block_size
        self.window = window
        self.num_samples = int(sizes.sum())
        self._windows: OrderedDict[int, IntArray] = OrderedDict()
        if not self.shuffle or self.num_samples == 0:
            return
        starts, lengths = _blocks(sizes, block_size)
        rng = np.random.default_rng([self.seed, self.epoch, TAG_BLOCKS])
        perm = rng.permutation(len(starts))
        self._bstart: IntArray = starts[perm]
        self._blen: IntArray = lengths[perm]
        # _bcum[k] = first epoch position of permuted block k; _bcum[-1] == N.
        self._bcum: IntArray = np.zeros(len(perm) + 1, dtype=np.int64)
        np.cumsum(self._blen, out=self._bcum[1:])
        self._num_blocks = len(perm)
        self._wstart: IntArray = self._bcum[0 : self._num_blocks : window]

    @property
    def num_windows(self) -> int:
        """Number of shuffle windows (0 without shuffle)."""
        return len(self._wstart) if self.shuffle and self.num_samples else 0

    def _window_perm(self, w: int) -> IntArray:
        perm = self._windows.get(w)
        if perm is not None:
            self._windows.move_to_end(w)
            return perm
        lo = int(self._bcum[w * self.window])
        hi = int(self._bcum[min((w + 1) * self.window, self._num_blocks)])
        rng = np.random.default_rng([self.seed, self.epoch, TAG_WINDOW, w])
        perm = rng.permutation(hi - lo).astype(np.int64, copy=False)
        self._windows[w] = perm
        if len(self._windows) > self._CACHED_WINDOWS:
            self._windows.popitem(last=False)
        return perm

    def indices(self, positions: npt.ArrayLike) -> IntArray:
        """Dataset indices of the given epoch positions (any shape of ints in ``[0, N)``).

        Raises:
            InvalidArgumentError: A position is outside ``[0, N)``.
        """
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= self.num_samples):
            raise InvalidArgumentError(
                f"epoch positions must lie in [0, {self.num_samples}), got "
                f"[{int(pos.min())}, {int(pos.max())}]"
            )
        if not self.shuffle or self.num_samples == 0:
            return pos.copy()
        flat = pos.reshape(-1)
        out = np.empty_like(flat)
        win = np.searchsorted(self._wstart, flat, side="right") - 1
        for w in np.unique(win).tolist():
            mask = win == w
            lo = int(self._wstart[w])
            shifted = lo + self._window_perm(w)[flat[mask] - lo]
            block = np.searchsorted(self._bcum, shifted, side="right") - 1
            out[mask] = self._bstart[block] + (shifted - self._bcum[block])
        return out.reshape(pos.shape)

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        return (
            f"EpochOrder(num_samples={self.num_samples}, seed={self.seed}, epoch={self.epoch}, "
            f"shuffle={self.shuffle}, block_size={self.block_size}, window={self.window})"
        )


def _blocks(sizes: IntArray, block_size: int | None) -> tuple[IntArray, IntArray]:
    """First dataset index and length of every non-empty block, in dataset order."""
    offsets = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1], out=offsets[1:])
    nonempty = sizes > 0
    if block_size is None:
        return offsets[nonempty], sizes[nonempty]
    per_shard = (sizes + block_size - 1) // block_size
    total = int(per_shard.sum())
    shard_of_block = np.repeat(np.arange(len(sizes)), per_shard)
    first_block = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(per_shard[:-1], out=first_block[1:])
    k = np.arange(total, dtype=np.int64) - first_block[shard_of_block]
    starts = offsets[shard_of_block] + k * block_size
    lengths = np.minimum(block_size, sizes[shard_of_block] - k * block_size)
    return starts, lengths.astype(np.int64)
