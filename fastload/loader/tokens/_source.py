"""The contract between token sources (one token dataset, or a weighted mix of several) and the
token loader.

A **token source** delivers, for an epoch, ``len(source)`` fixed-length sequences of
``seq_len + 1`` ids at positions ``0 .. len - 1`` (inputs are ``[:, :-1]``, targets ``[:, 1:]``).
What sits at a position is a pure function of (the source's options, seed, epoch, position): never
of ranks, workers, batch size or what was read before, so a loader can partition positions over
ranks and resume anywhere with O(1) state.

Added by the token loader (engineer B), nothing above changed: :class:`WideningTokenSource`, an
optional capability. A source that can write its ids straight into a wider integer dtype
(``sequences_as``) saves the loader a conversion pass (~15 % of a batch at 2049-id rows); the
loader uses it when ``isinstance(source, WideningTokenSource)``, and converts otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from fastload.loader.order._cursor import Resumable

__all__ = ["TokenBatch", "TokenSource", "WideningTokenSource"]


@dataclass(frozen=True)
class TokenBatch:
    """Sequences read from a token source.

    Attributes:
        tokens: ``(n, seq_len + 1)`` ids, in the order of the requested positions; dtype
            ``uint16`` or ``uint32`` as stored (a mix uses the widest of its sources).
        starts: ``None``, or when asked for, a ``bool`` array of the same shape that is ``True``
            where a document (or a piece of one whose beginning is not right before it in this
            sequence) starts; column 0 is always ``True``. From it the loader derives
            ``position_ids`` and ``cu_seqlens``.
        sources: ``None``, or for a mix, the ``int8`` index of the source of each row.
    """

    tokens: npt.NDArray[Any]
    starts: npt.NDArray[np.bool_] | None = None
    sources: npt.NDArray[np.int8] | None = None


@runtime_checkable
class TokenSource(Resumable, Protocol):
    """What the token loader reads from (see the module doc); resumable as every loader's data
    (:class:`~fastload.loader.order._cursor.Resumable`: ``url``, ``fingerprint``,
    ``order_options()``, ``continues_order()``, ``node_stats()``)."""

    @property
    def seq_len(self) -> int:
        """Ids per input sequence (each row holds ``seq_len + 1``)."""
        ...

    def __len__(self) -> int:
        """Sequences per epoch."""
        ...

    def sequences(
        self, epoch: int, positions: npt.NDArray[np.int64], *, with_starts: bool = False
    ) -> TokenBatch:
        """The sequences at ``positions`` (each in ``[0, len(self))``) of epoch ``epoch``."""
        ...


@runtime_checkable
class WideningTokenSource(TokenSource, Protocol):
    """A token source that also delivers its ids converted to a wider dtype while copying."""

    def sequences_as(
        self,
        dtype: np.dtype[Any],
        epoch: int,
        positions: npt.NDArray[np.int64],
        *,
        with_starts: bool = False,
    ) -> TokenBatch:
        """:meth:`~TokenSource.sequences` with ``tokens`` of ``dtype`` (``int32``/``int64``)."""
        ...
