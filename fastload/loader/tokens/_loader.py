"""``TokenLoader``: batches of packed sequences from any token source, exactly-once and resumable.

Built on the sample loaders' parts: :class:`~fastload.loader.order._partition.Partition` splits the
source's ``len(source)`` positions of an epoch into global steps and rank batches (the same
arithmetic, padding and ``drop_last``), and :class:`~fastload.loader.order._cursor.EpochCursor` keeps
epoch, step, resume and the state dict. A batch is one call of ``source.sequences(epoch,
positions)``: one gather of memory-mapped or cached blocks, no decode.

Why not ``fastload.DataLoader``: its batches are built in worker processes and sent over IPC,
which is what decoding needs. Token batches need no decode: a 2-worker torch DataLoader over a
memmap reaches 52-55 Mtok/s here, the same gather in-process ~800 Mtok/s. So this loader runs in
the main process, optionally with one read-ahead thread (``prefetch``), and shares the order,
partition and state code instead of the worker machinery.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch

from fastload._units import check_int
from fastload.errors import InvalidArgumentError
from fastload.loader._dist import detect_rank_world
from fastload.loader.order._cursor import EpochCursor
from fastload.loader.order._partition import Partition
from fastload.loader.tokens._source import TokenBatch, TokenSource, WideningTokenSource

__all__ = ["TokenLoader", "cu_seqlens", "position_ids"]

Boundaries = Literal["position_ids", "cu_seqlens"]


def position_ids(starts: np.ndarray[Any, np.dtype[np.bool_]]) -> np.ndarray[Any, Any]:
    """``int64`` positions within each document: 0 where ``starts`` is True, +1 after each id.

    ``starts`` is ``(n, width)`` with column 0 True (as a :class:`TokenBatch` has it).
    """
    columns = np.arange(starts.shape[1], dtype=np.int64)
    last_start = np.maximum.accumulate(np.where(starts, columns, 0), axis=1)
    out: np.ndarray[Any, Any] = columns - last_start
    return out


def cu_seqlens(starts: np.ndarray[Any, np.dtype[np.bool_]]) -> np.ndarray[Any, Any]:
    """``int32`` cumulative document lengths over the flattened rows (FlashAttention's varlen
    ``cu_seqlens``): the flat index of every start, then the total; every row begins one."""
    flat = np.flatnonzero(starts.reshape(-1))
    return np.append(flat, starts.size).astype(np.int32)


class TokenLoader:
    """Batches of packed sequences for one rank (module doc).

    Yields dicts of tensors: ``input_ids`` and ``labels``, ``(n, seq_len)`` each, views of one
    ``(n, seq_len + 1)`` tensor (``labels`` is ``input_ids`` shifted by one id; use
    ``.contiguous()`` where a kernel needs it); with ``boundaries="position_ids"`` also
    ``position_ids`` (``int64``, restarting at 0 where each document, or each piece of one,
    begins); with ``"cu_seqlens"`` ``cu_seqlens`` (``int32``, over the ``n * seq_len`` inputs
    flattened) and ``max_seqlen`` (an int); ``sources`` (``int8`` per row) when the source
    says where rows come from (a mix). ``n`` is ``batch_size`` except in the last batch without
    ``drop_last``.

    Args:
        source: Any :class:`~fastload.loader.tokens._source.TokenSource` (``fastload.open_tokens``,
            a mix).
        batch_size: Sequences per rank batch.
        rank, world_size: This rank and the number of ranks (default: detected from
            ``torch.distributed`` or the environment).
        drop_last: Drop the incomplete last global step (else it is padded and split evenly,
            as for :class:`fastload.DataLoader`).
        dtype: Tensor dtype of the ids: ``torch.int64`` (default; what embeddings and
            cross-entropy take), ``torch.int32``, or ``None`` for the stored ``uint16``/
            ``uint32`` without a conversion (zero-copy).
        boundaries: ``None``, ``"position_ids"`` or ``"cu_seqlens"`` (document boundaries for
            attention masking across packed documents).
        prefetch: Batches a read-ahead thread keeps ready (``0``: read in the main thread when
            asked; default). Reads hold the GIL for NumPy's copies, so a thread helps when the
            training step releases it (GPU work), not on a CPU-bound loop.
        pin_memory: Copy batches into pinned memory (for ``.to("cuda", non_blocking=True)``).

    ``set_epoch``, ``state_dict``, ``load_state_dict``, ``stats``, ``len`` are those of
    :class:`fastload.DataLoader` (same state layout, :mod:`fastload.loader.order._cursor`), with the
    source's order options (``seq_len``, ``seed``, ``window``, ...) in the state: resume with
    any world size that keeps ``batch_size x world_size``.

    Not thread-safe: iterate from one thread.
    """

    def __init__(
        self,
        source: TokenSource,
        batch_size: int,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        dtype: torch.dtype | None = torch.int64,
        boundaries: Boundaries | None = None,
        prefetch: int = 0,
        pin_memory: bool = False,
    ) -> None:
        if not isinstance(source, TokenSource):
            raise InvalidArgumentError(
                f"TokenLoader takes a token source (fastload.open_tokens(...) or a mix), got "
                f"{type(source).__name__}"
            )
        if boundaries not in (None, "position_ids", "cu_seqlens"):
            raise InvalidArgumentError(
                f"boundaries must be None, 'position_ids' or 'cu_seqlens', got {boundaries!r}"
            )
        if dtype not in (None, torch.int64, torch.int32):
            raise InvalidArgumentError(
                f"dtype must be torch.int64, torch.int32 or None (stored), got {dtype!r}"
            )
        self.source = source
        self.rank, self.world_size = detect_rank_world(rank, world_size)
        self.batch_size = check_int("batch_size", batch_size, minimum=1)
        self.drop_last = bool(drop_last)
        self.dtype = dtype
        self.boundaries = boundaries
        self.prefetch = check_int("prefetch", prefetch)
        self.pin_memory = bool(pin_memory)
        self._np_dtype: np.dtype[Any] | None = None
        if dtype is not None:
            self._np_dtype = np.dtype(np.int64 if dtype == torch.int64 else np.int32)
        self._widen = (
            source.sequences_as
            if self._np_dtype is not None and isinstance(source, WideningTokenSource)
            else None
        )
        self.partition = Partition(len(source), self.world_size, self.batch_size, self.drop_last)
        self._cursor = EpochCursor(source, self.partition, what="TokenLoader")
        # A mix's sources, for the per-source counts of stats() (none for a plain source).
        self._source_names: tuple[str, ...] = tuple(getattr(source, "names", ()))
        self._source_sequences = np.zeros(len(self._source_names), dtype=np.int64)

    # ---- epochs and state ---------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch the loader iterates (next, or now)."""
        return self._cursor.epoch

    def set_epoch(self, epoch: int, *, discard_resume: bool = False) -> None:
        """Iterate ``epoch`` next; see :meth:`fastload.DataLoader.set_epoch` (same rules)."""
        self._cursor.set_epoch(epoch, discard_resume=discard_resume)

    def __len__(self) -> int:
        """Batches the next (or running) iteration yields."""
        return self._cursor.remaining()

    def state_dict(self) -> dict[str, Any]:
        """The resumable position: O(1), the same on every rank (:mod:`fastload.loader.order._cursor`);
        a batch counts once it is yielded."""
        return self._cursor.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``.

        Raises:
            InvalidArgumentError: Another ``seq_len``, dataset, order option, global batch size
                or version; the message says which and how to fix it.
        """
        self._cursor.load_state_dict(state, extra_check=self._check_seq_len)

    def _check_seq_len(self, state: dict[str, Any]) -> None:
        saved = state.get("seq_len")
        if saved is not None and saved != self.source.seq_len:
            raise InvalidArgumentError(
                f"the state was saved with seq_len={saved}, but this loader's source "
                f"({self.source.url}) has seq_len={self.source.seq_len}; open it with "
                f"seq_len={saved} to resume"
            )

    def stats(self) -> dict[str, float | int]:
        """Counters as :meth:`fastload.DataLoader.stats` (``samples`` are sequences, ``bytes``
        the delivered id arrays' bytes) plus ``tokens`` (input ids delivered) and ``tokens_per_s``;
        a mix (:func:`fastload.mix`) adds ``samples[<source name>]``: sequences delivered per
        source on this rank (padding rows not counted)."""
        report = self._cursor.report()
        report["tokens"] = int(report["samples"]) * self.source.seq_len
        elapsed = float(report["elapsed_s"])
        report["tokens_per_s"] = report["tokens"] / elapsed if elapsed > 0 else 0.0
        for name, n in zip(self._source_names, self._source_sequences.tolist(), strict=True):
            report[f"samples[{name}]"] = n
        return report

    def reset_stats(self) -> None:
        """Zero the counters."""
        self._cursor.reset_stats()
        self._source_sequences[:] = 0

    # ---- iteration ----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, Any]]:
        epoch, start, _ = self._cursor.begin()
        return self._run(epoch, start)

    def _read(
        self, epoch: int, step: int
    ) -> tuple[dict[str, Any], int, int, npt.NDArray[np.int64] | None]:
        """The batch of global ``step`` on this rank, its padded rows, its ids' bytes and, for a
        mix, the rows (not padding) of each source."""
        positions, pad = self.partition.positions(step, self.rank)
        with_starts = self.boundaries is not None
        if self._widen is not None and self._np_dtype is not None:
            batch = self._widen(self._np_dtype, epoch, positions, with_starts=with_starts)
        else:
            batch = self.source.sequences(epoch, positions, with_starts=with_starts)
        per_source = None
        if batch.sources is not None and self._source_names:
            per_source = np.bincount(batch.sources[~pad], minlength=len(self._source_names))
        return self._tensors(batch), int(pad.sum()), batch.tokens.nbytes, per_source

    def _run(self, epoch: int, start: int) -> Iterator[dict[str, Any]]:
        cursor = self._cursor
        stats = cursor.stats
        began = time.perf_counter()
        steps = range(start, self.partition.num_steps)
        batches = _read_ahead(self._read, epoch, steps, self.prefetch) if self.prefetch else None
        try:
            for step in steps:
                t0 = time.perf_counter()
                out, padded, nbytes, per_source = (
                    next(batches) if batches is not None else self._read(epoch, step)
                )
                now = time.perf_counter()
                stats.stall += now - t0
                stats.add(size=len(out["input_ids"]), nbytes=nbytes, padded=padded, skipped=0)
                if per_source is not None:
                    self._source_sequences += per_source
                stats.elapsed += now - began
                began = now
                cursor.reached(epoch, step + 1)
                yield out
        finally:
            if batches is not None:
                batches.close()
            cursor.end()

    def _tensors(self, batch: TokenBatch) -> dict[str, Any]:
        tokens = batch.tokens
        if self._np_dtype is not None and tokens.dtype != self._np_dtype:
            tokens = tokens.astype(self._np_dtype)  # a source that cannot widen while copying
        ids = torch.from_numpy(tokens)  # uint16/uint32 as stored when dtype is None
        if self.pin_memory:
            ids = ids.pin_memory()
        out: dict[str, Any] = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
        if batch.starts is not None:
            starts = batch.starts[:, :-1]
            if self.boundaries == "position_ids":
                out["position_ids"] = torch.from_numpy(position_ids(starts))
            else:
                cu = cu_seqlens(starts)
                out["cu_seqlens"] = torch.from_numpy(cu)
                out["max_seqlen"] = int(np.diff(cu).max()) if len(cu) > 1 else 0
        if batch.sources is not None:
            out["sources"] = torch.from_numpy(batch.sources)
        return out

    def __repr__(self) -> str:
        return (
            f"TokenLoader({self.source!r}, batch_size={self.batch_size}, rank={self.rank}, "
            f"world_size={self.world_size}, drop_last={self.drop_last}, epoch={self.epoch}, "
            f"step={self._cursor.step})"
        )


def _read_ahead(read: Any, epoch: int, steps: range, depth: int) -> Any:
    """A generator of ``read(epoch, step)`` for ``steps``, computed by one thread up to ``depth``
    batches ahead; its ``close()`` stops the thread. Errors re-raise in the consumer."""
    q: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        for step in steps:
            if stop.is_set():
                return
            try:
                item = (True, read(epoch, step))
            except BaseException as exc:  # handed to the consumer
                item = (False, exc)
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if not item[0]:
                return

    thread = threading.Thread(target=produce, name="fastload-token-read-ahead", daemon=True)
    thread.start()

    def consume() -> Iterator[Any]:
        try:
            for _ in steps:
                ok, value = q.get()
                if not ok:
                    raise value
                yield value
        finally:
            stop.set()
            thread.join()

    return consume()
