"""A weighted mix of token sources that is itself a token source.

:class:`MixedTokens` implements :class:`~fastload.loader.tokens._source.TokenSource` over token
sources of one ``seq_len``: position ``p`` of mix epoch ``e`` is the sequence that
:class:`~fastload.loader.mix._schedule.MixPlan` assigns it (a source, the source's own epoch, a
position in it), so the token loader partitions, loads and resumes a mix exactly as it does one
dataset. Make one with :func:`fastload.mix`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from fastload.errors import InvalidArgumentError
from fastload.loader.mix._schedule import (
    MixIdentity,
    source_epoch_groups,
)
from fastload.loader.tokens._source import TokenBatch, TokenSource

__all__ = ["MixedTokens"]


class MixedTokens(MixIdentity):
    """Token sources mixed by weight: a :class:`~fastload.loader.tokens._source.TokenSource`.

    Every window of ``window`` consecutive positions (counted from the start of the run, across
    mix epochs) holds exactly ``counts[i]`` sequences of source ``i``, evenly spread (see
    :mod:`fastload.loader.mix._schedule`); source ``i``'s sequences come in the order of its own
    epochs, each sequence once per own epoch, and a source that runs out continues with its next
    epoch. Ids are returned in the widest dtype of the sources; ``TokenBatch.sources`` gives each
    row's source number (the order of ``sources``).

    Args:
        sources: Token sources with the same ``seq_len``.
        counts: Sequences of each source per window (:func:`~fastload.loader.mix._schedule.
            mix_counts`).
        epoch_size: Sequences per mix epoch; ``None``: the sources' total, rounded up to a
            multiple of the window.
        seed: The mix's seed (recorded in states; the sources keep their own).
        names: Source names for messages and ``stats()`` (default: their URLs).

    Thread safety: :meth:`sequences` is as safe as the sources' own; the mix keeps no state
    between calls. Pickles when its sources do.
    """

    def __init__(
        self,
        sources: Sequence[TokenSource],
        counts: Sequence[int],
        *,
        epoch_size: int | None = None,
        seed: int = 0,
        names: Sequence[str] | None = None,
    ) -> None:
        self.sources = tuple(sources)
        for i, s in enumerate(self.sources):
            if not isinstance(s, TokenSource):
                raise InvalidArgumentError(
                    f"source {i} of a token mix is a {type(s).__name__}, not a token source; mix "
                    "token sources with token sources and datasets with datasets"
                )
        self._plan_mix(counts, [len(s) for s in self.sources], epoch_size, seed, names)
        lengths = {s.seq_len for s in self.sources}
        if len(lengths) != 1:
            detail = ", ".join(f"{n}: {s.seq_len}" for n, s in zip(self.names, self.sources))
            raise InvalidArgumentError(
                f"the sources of a token mix must have one seq_len, got {detail}; open them "
                "with the same seq_len"
            )
        self._seq_len = int(lengths.pop())
        self._dtype: np.dtype[Any] | None = None

    # ---- TokenSource ------------------------------------------------------------------------

    @property
    def seq_len(self) -> int:
        """Ids per input sequence (each row holds ``seq_len + 1``)."""
        return self._seq_len

    @property
    def url(self) -> str:
        """``mix(name: count/window, ...)``, for messages."""
        return f"mix({self.plan.describe()})"

    @property
    def fingerprint(self) -> str:
        """A hash of the sources' fingerprints (see :class:`~fastload.loader.mix._schedule.
        MixIdentity`)."""
        return self._data_fingerprint()

    def __len__(self) -> int:
        """Sequences per mix epoch."""
        return self.plan.epoch_size

    def order_options(self) -> dict[str, Any]:
        """The mix's options, its seed, and each source's fingerprint and order options."""
        return self._mix_options()

    def continues_order(self, version: object) -> bool:
        """True: the sources' order versions are in :meth:`order_options`, checked with them."""
        return True

    def node_stats(self) -> dict[str, int]:
        """Empty: a mix of token sources reports no node cache figures."""
        return {}

    @property
    def dtype(self) -> np.dtype[Any]:
        """The dtype of returned ids: the widest of the sources' (a source without a ``dtype``
        attribute is asked for one sequence, once)."""
        if self._dtype is None:
            dtypes = []
            for s in self.sources:
                dt = getattr(s, "dtype", None)
                if dt is None:
                    dt = s.sequences(0, np.zeros(1, dtype=np.int64)).tokens.dtype
                dtypes.append(np.dtype(dt))
            self._dtype = np.result_type(*dtypes)
        return self._dtype

    def sequences(
        self, epoch: int, positions: npt.NDArray[np.int64], *, with_starts: bool = False
    ) -> TokenBatch:
        """The sequences at ``positions`` (each in ``[0, len(self))``) of mix epoch ``epoch``,
        with ``sources`` set; ids in :attr:`dtype`.

        Raises:
            InvalidArgumentError: A position outside the epoch.
        """
        return self._gather(self.dtype, epoch, positions, with_starts)

    def sequences_as(
        self,
        dtype: np.dtype[Any],
        epoch: int,
        positions: npt.NDArray[np.int64],
        *,
        with_starts: bool = False,
    ) -> TokenBatch:
        """:meth:`sequences` with ids of ``dtype`` (e.g. ``int64``), converted while they are
        copied into the batch (one pass: the sources' stored ids are read and converted into
        the mixed batch at once, cheaper than asking each source to convert and copying
        again)."""
        return self._gather(np.dtype(dtype), epoch, positions, with_starts)

    def _gather(
        self,
        dtype: np.dtype[Any],
        epoch: int,
        positions: npt.NDArray[np.int64],
        with_starts: bool,
    ) -> TokenBatch:
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        source, src_epoch, src_pos = self.plan.locate(epoch, pos)
        tokens = np.empty((len(pos), self._seq_len + 1), dtype=dtype)
        starts = np.empty(tokens.shape, dtype=np.bool_) if with_starts else None
        for i, k, rows in source_epoch_groups(source, src_epoch):
            got = self.sources[i].sequences(k, src_pos[rows], with_starts=with_starts)
            tokens[rows] = got.tokens  # converts to ``dtype`` while copying
            if starts is not None:
                if got.starts is None:
                    raise InvalidArgumentError(
                        f"token source {self.names[i]} returned no starts for with_starts=True"
                    )
                starts[rows] = got.starts
        return TokenBatch(tokens, starts, source.astype(np.int8))

    def __repr__(self) -> str:
        return (
            f"MixedTokens({self.plan.describe()}, seq_len={self._seq_len}, "
            f"epoch_size={self.plan.epoch_size}, seed={self.seed})"
        )
