"""The iterable form of a dataset: whole collated batches for one rank, split across workers.

A :class:`BatchStream` yields the batches of one rank for one epoch, in global-step order, each one
collated inside the worker that produced it (one inter-process message per batch, not per sample).
Which batches a (rank, worker) produces is pure arithmetic (:class:`~fastload.loader.order._partition.
Partition`), and which samples a batch holds comes from the epoch's global order
(:class:`~fastload.loader.order._order.EpochOrder`): no communication, no shared state but the epoch
number and the step to start from.

Inside a worker, reads run ahead: while batch ``k`` is decoded, reader threads already read the
samples of the worker's next batches (:mod:`fastload.loader._reads`).

**Error accounting** (``on_error="skip"``/``"warn"``): a sample that cannot be read (corrupt data)
or decoded is dropped from its batch and counted in the batch's :class:`BatchMeta` (``skipped``;
a sample the dataset's ``filter`` rejects likewise, in ``filtered``).
For every global step the loader consumes, ``delivered + skipped + filtered`` equals the step's positions, so
over an epoch every sample is delivered once or counted as skipped once (plus the counted padding).
A batch whose samples were all skipped is still yielded, with zero rows, so that every rank yields
the same number of batches. Store errors (missing shard, network) and ``transform`` errors always
raise :class:`~fastload.errors.WorkerError` naming the shard URL and sample key.

**Prefetch into a cache**: when the dataset's store can prefetch (a
:class:`~fastload.storage.CachingStore`, from ``open_dataset(..., cache_dir=...)``), each worker
asks it to download, in the background, the next ``dataset.prefetch_shards`` shards its coming
batches read first (:mod:`fastload.loader._lookahead`). Workers needing one shard share one
download (the cache's per-object file lock). A worker closes its shard readers when its epoch
ends: a reader keeps its shard mapped, so a shard evicted from the cache would otherwise keep its
disk space (beyond the cache's budget) for as long as a persistent worker lives.

**Randomness**: every raw sample gets ``"__rng_seed__": (seed, epoch, index)`` (``index`` = its
dataset index) before ``decode``/``transform`` run; the transforms of :mod:`fastload.loader.
transforms` draw from ``sample_rng(*sample["__rng_seed__"])``, so augmentation depends only on
(seed, epoch, sample), not on ranks, workers, batch size or where training resumed. The entry is
removed from dict samples after ``transform``. For transforms that use global generators instead,
Python's ``random``, NumPy's global generator and torch's default generator are reseeded before
each batch from (seed, epoch, step) inside DataLoader worker processes (never in the main process).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Callable, Iterator
from time import perf_counter
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.utils.data

from fastload._lazy import current_pid
from fastload._units import check_int
from fastload.errors import FastloadError, FormatError, InvalidArgumentError, WorkerError
from fastload.loader._batch_meta import BatchMeta
from fastload.loader._collate import collate_batch, default_collate, empty_like_batch
from fastload.loader._dist import detect_rank_world
from fastload.loader._lookahead import ShardLookahead
from fastload.loader._progress import ProgressTable, WorkerProgress
from fastload.loader._reads import (
    DEFAULT_IO_THREADS,
    BatchReads,
    PendingReads,
    PlannedBatch,
    default_io_threads,
)
from fastload.loader._shards import NOT_DATA_ERRORS, ShardedDataset, sample_nbytes
from fastload.loader._shm_pool import BufferPool, set_buffer_pool
from fastload.loader.order._partition import Partition
from fastload.loader.order._seeds import RNG_SEED_KEY, check_seed, seed_global_rngs

__all__ = [
    "DEFAULT_IO_THREADS",
    "BatchStream",
    "WorkerProgress",
    "default_io_threads",
]

log = logging.getLogger("fastload.loader")

IntArray = npt.NDArray[np.int64]
_TEMPLATE_TRIES = 1000
#: What :meth:`BatchStream._process` returns for a sample the error policy drops ...
_SKIPPED = object()
#: ... and for one the dataset's ``filter`` rejects.
_FILTERED = object()


class BatchStream(torch.utils.data.IterableDataset[Any]):
    """Collated batches of one rank, for ``torch.utils.data.DataLoader(stream, batch_size=None)``.

    Args:
        dataset: The :class:`~fastload.loader.Dataset` (order options, decode and transform come
            from it).
        batch_size: Samples per batch on this rank (``B``); the global batch is ``B x world_size``.
        drop_last: Drop the incomplete last global step instead of padding (see
            :mod:`fastload.loader.order._partition`).
        collate_fn: ``list of samples -> batch``; default :func:`default_collate`.
        rank: This rank; ``None``: ``torch.distributed``'s or the launcher's (``detect_launch``).
        world_size: Number of ranks; ``None``: detected likewise.
        epoch: Initial epoch (change it with :meth:`set_epoch`).
        io_threads: Reader threads per process (0 reads in the calling thread); ``None``:
            :func:`default_io_threads` of the dataset's store.
        prefetch_batches: Batches whose reads run ahead of decoding, per worker; ``None``: 1
            with reader threads, 0 without (reads in the decoding thread overlap nothing).

    ``len(stream)`` is the number of batches this rank yields for the current epoch and start step
    (the same on every rank). The epoch and start step live in shared memory, so
    :meth:`set_epoch` reaches persistent DataLoader workers too.
    """

    def __init__(
        self,
        dataset: ShardedDataset,
        batch_size: int,
        *,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        epoch: int = 0,
        io_threads: int | None = None,
        prefetch_batches: int | None = None,
        with_meta: bool = False,
    ) -> None:
        if not isinstance(dataset, ShardedDataset):
            raise InvalidArgumentError(
                f"BatchStream needs a fastload Dataset (from fastload.open_dataset), got "
                f"{type(dataset).__name__}"
            )
        if io_threads is None:
            io_threads = max(default_io_threads(store) for store in dataset.stores)
        io_threads = check_int("io_threads", io_threads)
        if prefetch_batches is None:  # reading ahead in the decoding thread only adds latency
            prefetch_batches = 1 if io_threads else 0
        prefetch_batches = check_int("prefetch_batches", prefetch_batches)
        if collate_fn is not None and not callable(collate_fn):
            raise InvalidArgumentError(f"collate_fn must be callable, got {collate_fn!r}")
        self.dataset = dataset
        self.rank, self.world_size = detect_rank_world(rank, world_size)
        self.partition = Partition(
            dataset.num_samples, self.world_size, batch_size, bool(drop_last)
        )
        self.batch_size = batch_size
        self.drop_last = bool(drop_last)
        self.collate_fn = collate_fn if collate_fn is not None else default_collate
        self.io_threads = io_threads
        self.prefetch_batches = prefetch_batches
        self.with_meta = with_meta
        # [epoch, start step], in shared memory so that persistent workers see changes.
        self._control = torch.zeros(2, dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]
        self.set_epoch(epoch)
        self._reads = BatchReads(dataset, self.partition, io_threads)
        self._template: Any = None
        self._decode_s = 0.0  # decode seconds of the batch being made (in its worker)
        self._progress: ProgressTable | None = None
        self._release: torch.Tensor | None = None  # [worker, block] -> 0 or token; shared
        self._buffers: BufferPool | None = None
        self._buffers_pid = -1

    def track_progress(self, num_workers: int) -> None:
        """Let each worker publish in shared memory what it is doing: the sample it decodes, and
        the sample each of its threads is reading (reads run ahead of decoding, in the reader
        threads or between batches), so that a worker that dies (a crash in a decoder, SIGBUS
        from a shard truncated while mapped, the OOM killer) can be reported with the sample it
        was decoding or reading (:meth:`progress`). Call before the workers start."""
        self._progress = ProgressTable(num_workers, self.io_threads)
        self._reads.progress = self._progress

    def enable_buffer_reuse(self, num_workers: int, blocks: int) -> torch.Tensor:
        """Let each worker collate into up to ``blocks`` reusable shared-memory blocks (see
        :mod:`fastload.loader._shm_pool`). Call before the workers start; the returned table is
        what the consumer's :class:`~fastload.loader._collate.BufferReleaser` frees blocks in.
        Only for consumers that release blocks (``fastload.DataLoader`` without pinning):
        otherwise every block stays marked in use and collation falls back to fresh memory."""
        rows = max(1, num_workers)
        self._release = torch.zeros((rows, max(1, blocks)), dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]
        return self._release

    def progress(self) -> list[WorkerProgress]:
        """What each worker was last doing (:class:`WorkerProgress`), in worker order; empty
        without :meth:`track_progress`."""
        return [] if self._progress is None else self._progress.snapshot()

    # ---- pickling ---------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_template"] = None
        state["_buffers"] = None
        state["_buffers_pid"] = -1
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        # A plain pickle copies tensors into private memory: share the control tables again so
        # that the worker processes started from this copy see them (torch's own pickler, used
        # for spawned workers, keeps them shared and this is a no-op).
        for name in ("_control", "_release"):
            table = getattr(self, name)
            if table is not None and not table.is_shared():
                table.share_memory_()

    @property
    def buffer_table(self) -> torch.Tensor | None:
        """The shared block table of :meth:`enable_buffer_reuse`, or ``None``."""
        return self._release

    # ---- epoch control ----------------------------------------------------------------------

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Make the next iteration yield epoch ``epoch`` from global step ``start_step`` on."""
        check_seed("epoch", epoch)
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise InvalidArgumentError(f"start_step must be an int >= 0, got {start_step!r}")
        self._control[0] = epoch
        self._control[1] = start_step

    @property
    def epoch(self) -> int:
        """The epoch the next iteration yields."""
        return int(self._control[0])

    @property
    def start_step(self) -> int:
        """The global step the next iteration starts at."""
        return int(self._control[1])

    def __len__(self) -> int:
        return self.partition.remaining_steps(self.start_step)

    # ---- iteration --------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if (
            info is not None
            and self._release is not None
            and worker < len(self._release)
            and (self._buffers is None or self._buffers_pid != current_pid())
            and BufferPool.supported()
        ):
            self._buffers = BufferPool(self._release[worker])
            self._buffers_pid = current_pid()
        return self.generate(
            worker=worker,
            num_workers=num_workers,
            epoch=self.epoch,
            start_step=self.start_step,
            seed_rngs=info is not None,
        )

    def generate(
        self,
        *,
        rank: int | None = None,
        worker: int = 0,
        num_workers: int = 1,
        epoch: int | None = None,
        start_step: int | None = None,
        seed_rngs: bool = False,
    ) -> Iterator[Any]:
        """Yield the batches of (``rank``, ``worker``) of ``num_workers`` for ``epoch``, from
        global step ``start_step`` on: ``(BatchMeta, batch)`` pairs when the stream was made with
        ``with_meta=True``, else batches. Pure function of its arguments and the dataset.

        This is what each DataLoader worker runs; tests call it directly to check partitioning
        without worker processes.
        """
        rank = self.rank if rank is None else rank
        epoch = self.epoch if epoch is None else epoch
        start_step = self.start_step if start_step is None else start_step
        steps = self.partition.worker_steps(start_step, worker, num_workers)
        if not 0 <= rank < self.world_size:
            raise InvalidArgumentError(f"rank must be in [0, {self.world_size}), got {rank}")
        if len(steps) == 0:
            return
        order = self.dataset.order(epoch)
        reads = self._reads
        # Byte fields only the default collation sees: views of the mapped shards, copied once.
        reads.views = self.collate_fn is default_collate and self.dataset.raw_views_ok()
        lookahead = ShardLookahead.create(
            self.dataset, steps, lambda step: reads.plan(order, step, rank).shards
        )
        pending: deque[tuple[PlannedBatch, PendingReads]] = deque()
        step_iter = iter(steps)
        submitted = 0  # batches of this worker whose reads were submitted

        def fill() -> None:
            nonlocal submitted
            while len(pending) < self.prefetch_batches + 1:
                step = next(step_iter, None)
                if step is None:
                    return
                planned = reads.plan(order, step, rank)
                if lookahead is not None:
                    lookahead.advance(submitted)
                submitted += 1
                pending.append((planned, reads.submit(planned, worker)))

        try:
            self._report(worker, int(steps[0]), -1)
            fill()
            while pending:
                planned, batch_reads = pending.popleft()
                # From here on a death is this batch's: its reads, the next batches' reads
                # (each recorded where it happens) or its decode.
                self._report(worker, planned.step, -1)
                if self.prefetch_batches:
                    fill()  # the next batches' reads run (in threads) while this one is decoded
                if seed_rngs:
                    seed_global_rngs(self.dataset.seed, epoch, planned.step, self.rank)
                meta, batch = self._assemble(planned, batch_reads, rank, worker, epoch)
                self._report(worker, planned.step, -1)  # decoded: not processing a sample
                yield (meta, batch) if self.with_meta else batch
                fill()
        finally:
            for _, batch_reads in pending:
                BatchReads.cancel(batch_reads)
            if any(store.evicts_local_files for store in self.dataset.stores):
                # An open reader maps its shard: an evicted shard's disk space stays taken, and
                # reads keep bypassing the cache, for as long as the reader lives (persistent
                # workers: forever). The next epoch reopens what it reads through the cache.
                self.dataset.close()

    # ---- internals --------------------------------------------------------------------------

    def _assemble(
        self,
        planned: PlannedBatch,
        reads: PendingReads,
        rank: int,
        worker: int,
        epoch: int,
    ) -> tuple[BatchMeta, Any]:
        ds = self.dataset
        n = len(planned.indices)
        raws: list[dict[str, Any] | None] = [None] * n
        errors: list[BaseException | None] = [None] * n
        t_read = perf_counter()
        for i, raw, err in BatchReads.results(reads):
            raws[i], errors[i] = raw, err
        t_prepare = perf_counter()
        self._decode_s = 0.0
        where = f"rank {rank}, worker {worker}, global step {planned.step}"
        samples: list[Any] = []
        delivered: list[int] = []  # dataset indices of the samples
        keys: list[str | None] = []  # their keys, for the default collation's errors
        skipped = filtered = nbytes = 0
        shards, positions = planned.shards.tolist(), planned.positions.tolist()
        indices = planned.indices.tolist()
        for i in range(n):
            shard, pos, index = shards[i], positions[i], indices[i]
            self._report(worker, planned.step, index)
            err = errors[i]
            if err is not None:
                raise WorkerError(
                    f"{where}: reading {ds.describe(shard, pos)} failed: "
                    f"{type(err).__name__}: {err}"
                ) from err
            raw = raws[i]
            if raw is None:
                skipped += 1
                continue
            nbytes += sample_nbytes(raw)
            raw.setdefault(RNG_SEED_KEY, (ds.seed, epoch, index))
            sample = self._process(raw, where, shard, pos)
            if sample is _SKIPPED:
                skipped += 1
            elif sample is _FILTERED:
                filtered += 1
            else:
                samples.append(sample)
                delivered.append(index)
                keys.append(raw.get("__key__"))
        pooled: tuple[tuple[int, int, int], ...] = ()
        t_collate = perf_counter()
        if samples:
            buffers = self._buffers if self._buffers_pid == current_pid() else None
            previous = set_buffer_pool(buffers)
            try:
                batch = collate_batch(self.collate_fn, samples, keys, ds, where, planned.shards)
            finally:
                set_buffer_pool(previous)
                if buffers is not None:
                    pooled = buffers.take_used()
            if self._template is None:
                self._template = empty_like_batch(batch)
        else:
            batch = self._empty_batch(where, worker, planned.step)
        prepare_s = t_collate - t_prepare
        stages = (t_prepare - t_read, self._decode_s, prepare_s - self._decode_s)
        meta = BatchMeta(
            planned.step, rank, worker, len(samples), planned.padded, skipped, nbytes, filtered,
            stages=(*stages, perf_counter() - t_collate),
        )  # fmt: skip
        return dataclasses.replace(meta, pooled=pooled, sources=ds.source_counts(delivered)), batch

    def _process(self, raw: dict[str, Any], where: str, shard: int, pos: int) -> Any:
        """Decode, filter, transform and select one raw sample; :data:`_SKIPPED` when the error
        policy drops it, :data:`_FILTERED` when the dataset's ``filter`` rejects it. Errors
        raise :class:`~fastload.errors.WorkerError` naming the sample."""
        ds = self.dataset
        if not ds.keep_raw(raw, shard):
            return _FILTERED
        t_decode = perf_counter()
        try:
            decoded = ds.decode_raw(raw, shard)
            self._decode_s += perf_counter() - t_decode
        except Exception as exc:
            sample = ds.describe(shard, pos, raw.get("__key__"))
            # A missing package or a refused pickle is a setup problem, not bad data: it would
            # "skip" every sample.
            fatal = isinstance(exc, NOT_DATA_ERRORS)
            self._bad_sample(
                exc, f"{where}: decoding {sample} failed", "undecodable", sample, fatal
            )
            return _SKIPPED
        try:
            if not ds.keep(decoded, shard):
                return _FILTERED
        except Exception as exc:  # a bug in the predicate, not bad data
            raise WorkerError(
                f"{where}: filter failed on {ds.describe(shard, pos, raw.get('__key__'))}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        try:
            return ds.finish(decoded, shard)
        except FormatError as exc:
            # Bad data found by a transform (e.g. a fused decode-and-crop of a corrupt JPEG)
            # follows the error policy like a decode error; other transform errors are bugs.
            sample = ds.describe(shard, pos, raw.get("__key__"))
            self._bad_sample(exc, f"{where}: transform failed on {sample}", "corrupt", sample)
            return _SKIPPED
        except Exception as exc:
            raise WorkerError(
                f"{where}: transform failed on {ds.describe(shard, pos, raw.get('__key__'))}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def _bad_sample(
        self, exc: Exception, failed: str, kind: str, sample: str, fatal: bool = False
    ) -> None:
        """Apply the error policy to a sample whose decode or transform raised ``exc``: raise
        (message ``failed``) under ``on_error="raise"`` or when ``fatal``; else log ``sample``
        under ``"warn"`` and return, for the caller to skip it."""
        on_error = self.dataset.on_error
        if on_error == "raise" or fatal:
            raise WorkerError(
                f"{failed}: {type(exc).__name__}: {exc} (pass on_error='skip' to drop corrupt "
                "samples)"
            ) from exc
        if on_error == "warn":
            log.warning("skipping %s %s: %s", kind, sample, exc)

    def _report(self, worker: int, step: int, index: int) -> None:
        """Record that ``worker`` assembles global step ``step`` and decodes dataset index
        ``index`` (-1: no sample)."""
        if self._progress is not None:
            self._progress.report(worker, step, index)

    def _empty_batch(self, where: str, worker: int, step: int) -> Any:
        """A zero-row batch with the structure of a good one (every sample was skipped)."""
        if self._template is None:
            ds = self.dataset
            for i in range(min(ds.num_samples, _TEMPLATE_TRIES)):
                shard, pos = (int(x) for x in ds.locate(i))
                try:
                    raw = self._reads.read_one(shard, pos, i, worker, step)
                    if raw is None:
                        continue
                    self._report(worker, step, i)
                    sample = ds.finish(ds.decode_raw(raw, shard), shard)
                except (FastloadError, FormatError, ValueError, OSError):
                    continue
                finally:
                    self._report(worker, step, -1)
                self._template = empty_like_batch(self.collate_fn([sample]))
                return self._template
            raise WorkerError(
                f"{where}: every sample of the batch was skipped as corrupt, and none of the "
                f"first {_TEMPLATE_TRIES} samples of {ds.url} decodes either, so no empty batch "
                "of the right structure can be built; check the data with `fastload verify`"
            )
        return self._template

    def __repr__(self) -> str:
        options = f"batch_size={self.batch_size}, rank={self.rank}, world_size={self.world_size}"
        return (
            f"BatchStream({self.dataset!r}, {options}, drop_last={self.drop_last}, "
            f"epoch={self.epoch}, start_step={self.start_step})"
        )
