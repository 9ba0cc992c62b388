"""The iterable form of a dataset: whole collated batches for one rank, split across workers.

A :class:`BatchStream` yields the batches of one rank for one epoch, in global-step order, each one
collated inside the worker that produced it (one inter-process message per batch, not per sample).
Which batches a (rank, worker) produces is pure arithmetic (:class:`~fastload.loader._partition.
Partition`), and which samples a batch holds comes from the epoch's global order
(:class:`~fastload.loader._order.EpochOrder`): no communication, no shared state but the epoch
number and the step to start from.

Inside a worker, reads run ahead: while batch ``k`` is decoded, a small thread pool already reads
the samples of the worker's next batch (store and shard I/O release the GIL). Reads of one batch are
sorted by (shard, position) and split over the threads; each thread keeps its own open readers.
For local files (memory-mapped shards) the default is no threads: see :func:`default_io_threads`.

**Error accounting** (``on_error="skip"``/``"warn"``): a sample that cannot be read (corrupt data)
or decoded is dropped from its batch and counted in the batch's :class:`BatchMeta` (``skipped``).
For every global step the loader consumes, ``delivered + skipped`` equals the step's positions, so
over an epoch every sample is delivered once or counted as skipped once (plus the counted padding).
A batch whose samples were all skipped is still yielded, with zero rows, so that every rank yields
the same number of batches. Store errors (missing shard, network) and ``transform`` errors always
raise :class:`~fastload.errors.WorkerError` naming the shard URL and sample key.

**Prefetch into a cache**: when the dataset's store can prefetch (a
:class:`~fastload.storage.CachingStore`, from ``open_dataset(..., cache_dir=...)``), each worker
also asks it to download, in the background, the next ``dataset.prefetch_shards`` shards that its
own coming batches will read first, in the order they will be read (so with ``block_size=None`` the
prefetch follows the epoch's shard order). Shards the worker's current batches already read are not
requested (the reads fill them), and a worker requests each shard at most once per epoch. Two
workers needing the same shard share one download: the cache's per-object file lock makes the
second wait for the first and then read the finished file. A worker closes its shard readers when
its epoch ends: a reader keeps its shard mapped, so a shard evicted from the cache would otherwise
keep its disk space (beyond the cache's budget) for as long as a persistent worker lives.

**Randomness**: every raw sample gets ``"__rng_seed__": (seed, epoch, index)`` (``index`` = its
dataset index) before ``decode``/``transform`` run; the transforms of :mod:`fastload.loader.
transforms` draw from ``sample_rng(*sample["__rng_seed__"])``, so augmentation depends only on
(seed, epoch, sample), not on ranks, workers, batch size or where training resumed. The entry is
removed from dict samples after ``transform``. For transforms that use global generators instead,
Python's ``random``, NumPy's global generator and torch's default generator are reseeded before
each batch from (seed, epoch, step) inside DataLoader worker processes (never in the main process).
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.utils.data

from fastload.errors import FastloadError, FormatError, InvalidArgumentError, WorkerError
from fastload.loader._collate import (
    BufferPool,
    default_collate,
    empty_like_batch,
    set_buffer_pool,
)
from fastload.loader._dataset import NOT_DATA_ERRORS, RNG_SEED_KEY, Dataset, sample_nbytes
from fastload.loader._dist import detect_rank_world
from fastload.loader._order import EpochOrder, check_seed
from fastload.loader._partition import Partition
from fastload.storage import CachingStore, Store

__all__ = [
    "DEFAULT_IO_THREADS",
    "BatchMeta",
    "BatchStream",
    "WorkerProgress",
    "default_io_threads",
]

log = logging.getLogger("fastload.loader")

IntArray = npt.NDArray[np.int64]
_TAG_AUGMENT = 3  # SeedSequence domain tag for per-batch augmentation seeds (see _order.py)
_TEMPLATE_TRIES = 1000
#: Reader threads per process for stores that are not local files (see default_io_threads).
DEFAULT_IO_THREADS = 4
# Columns of a worker's row in the progress table: pid, the step being assembled, the dataset
# index being decoded, then (step, dataset index) of the read in progress in each read slot.
_COL_PID, _COL_STEP, _COL_INDEX, _COL_READS = 0, 1, 2, 3
# Which progress read slot the current thread writes: 0 for a worker's own thread, 1.. for the
# reader threads of its pool (assigned when a pool thread starts).
_THREAD = threading.local()


def _assign_read_slot(slots: Iterator[int]) -> None:
    """ThreadPoolExecutor initializer: give the new reader thread its own progress slot."""
    _THREAD.slot = next(slots)


def default_io_threads(store: Store) -> int:
    """Reader threads per process when ``io_threads=None``: 0 for stores whose objects are
    local files (a local directory, or a :class:`~fastload.storage.CachingStore`), else 4.

    Local shards are memory-mapped and read by copying out of the page cache while holding
    the GIL, so threads add hand-off cost without overlapping anything: on the W1 benchmark
    (100 KB JPEGs, 2 workers) 4 threads cost ~40 % more CPU per sample than none. A cache counts
    as local: its downloads run ahead in the cache's prefetch threads (``prefetch_shards``), and
    with reader threads a warm-cache epoch of the train workload ran at 0.72x a local-disk epoch
    against 0.94x without. Remote stores read directly (S3, HDFS) block in the network with the
    GIL released, where reading the next batch ahead in threads pays.
    """
    if store.has_local_paths:
        return 0
    return DEFAULT_IO_THREADS


@dataclass(frozen=True)
class BatchMeta:
    """What a worker reports with each batch (travels beside it to the main process).

    Attributes:
        step: Global step of the batch.
        rank: Rank that produced it.
        worker: Worker id within the rank (0 without worker processes).
        size: Samples in the batch (after skips).
        padded: Padding positions in the batch (repeats of samples delivered elsewhere).
        skipped: Samples dropped as corrupt or undecodable.
        nbytes: Bytes of the raw fields read for the batch.
        pooled: ``(inode, block, token)`` of the worker's reusable shared-memory blocks that the
            batch uses (see :class:`~fastload.loader._collate.BufferPool`); empty without reuse.
    """

    step: int
    rank: int
    worker: int
    size: int
    padded: int
    skipped: int
    nbytes: int
    pooled: tuple[tuple[int, int, int], ...] = ()


@dataclass
class _Planned:
    step: int
    indices: IntArray  # dataset indices, batch order
    shards: IntArray
    positions: IntArray
    padded: int


# A read result: (item number in the batch, raw sample or None if skipped, exception or None).
_ReadResult = tuple[int, dict[str, Any] | None, BaseException | None]
# A read to make: (item number in the batch, shard, position in shard, dataset index).
_ReadItem = tuple[int, int, int, int]


@dataclass(frozen=True)
class WorkerProgress:
    """What one worker was doing when last seen (from the shared progress table).

    Attributes:
        pid: The worker's process id (-1: it never started).
        step: Global step of the batch it was assembling.
        index: Dataset index of the sample it was decoding/transforming, -1 when none (between
            samples, or while it waited for the training loop).
        reads: ``(global step, dataset index)`` of each read in progress (one per reader
            thread that was inside a read), in thread order.
    """

    pid: int
    step: int
    index: int
    reads: tuple[tuple[int, int], ...]


class BatchStream(torch.utils.data.IterableDataset[Any]):
    """Collated batches of one rank, for ``torch.utils.data.DataLoader(stream, batch_size=None)``.

    Args:
        dataset: The :class:`Dataset` (order options, decode and transform come from it).
        batch_size: Samples per batch on this rank (``B``); the global batch is ``B x world_size``.
        drop_last: Drop the incomplete last global step instead of padding (see
            :mod:`fastload.loader._partition`).
        collate_fn: ``list of samples -> batch``; default :func:`default_collate`.
        rank: This rank; detected (``torch.distributed``, ``RANK``) when ``None``.
        world_size: Number of ranks; detected (``torch.distributed``, ``WORLD_SIZE``) when ``None``.
        epoch: Initial epoch (change it with :meth:`set_epoch`).
        io_threads: Reader threads per process (0 reads in the calling thread); ``None``:
            :func:`default_io_threads` of the dataset's store.
        prefetch_batches: Batches whose reads run ahead of decoding, per worker.

    ``len(stream)`` is the number of batches this rank yields for the current epoch and start step
    (the same on every rank). The epoch and start step live in shared memory, so
    :meth:`set_epoch` reaches persistent DataLoader workers too.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        epoch: int = 0,
        io_threads: int | None = None,
        prefetch_batches: int = 1,
        with_meta: bool = False,
    ) -> None:
        if not isinstance(dataset, Dataset):
            raise InvalidArgumentError(
                f"BatchStream needs a fastload Dataset (from fastload.open_dataset), got "
                f"{type(dataset).__name__}"
            )
        if io_threads is None:
            io_threads = default_io_threads(dataset.store)
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 0:
            raise InvalidArgumentError(f"io_threads must be an int >= 0, got {io_threads!r}")
        if (
            isinstance(prefetch_batches, bool)
            or not isinstance(prefetch_batches, int)
            or prefetch_batches < 0
        ):
            raise InvalidArgumentError(
                f"prefetch_batches must be an int >= 0, got {prefetch_batches!r}"
            )
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
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = -1
        self._template: Any = None
        self._progress: torch.Tensor | None = None
        self._progress_view: npt.NDArray[np.int64] | None = None  # numpy view: fast writes
        self._release: torch.Tensor | None = None  # [worker, block] -> 0 or token; shared
        self._buffers: BufferPool | None = None
        self._buffers_pid = -1

    def track_progress(self, num_workers: int) -> None:
        """Let each worker publish in shared memory what it is doing: the sample it decodes, and
        the sample each of its threads is reading (reads run ahead of decoding, in the reader
        threads or between batches), so that a worker that dies (a crash in a decoder, SIGBUS
        from a shard truncated while mapped, the OOM killer) can be reported with the sample it
        was decoding or reading (:meth:`progress`). Call before the workers start."""
        rows = max(1, num_workers)
        cols = _COL_READS + 2 * (1 + self.io_threads)
        self._progress = torch.full((rows, cols), -1, dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]

    def enable_buffer_reuse(self, num_workers: int, blocks: int) -> torch.Tensor:
        """Let each worker collate into up to ``blocks`` reusable shared-memory blocks (see
        :mod:`fastload.loader._collate`). Call before the workers start; the returned table is
        what the consumer's :class:`~fastload.loader._collate.BufferReleaser` frees blocks in.
        Only for consumers that release blocks (``fastload.DataLoader`` without pinning):
        otherwise every block stays marked in use and collation falls back to fresh memory."""
        rows = max(1, num_workers)
        self._release = torch.zeros((rows, max(1, blocks)), dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]
        return self._release

    def progress(self) -> list[WorkerProgress]:
        """What each worker was last doing (:class:`WorkerProgress`), in worker order; empty
        without :meth:`track_progress`."""
        if self._progress is None:
            return []
        out = []
        for row in self._progress.tolist():
            slots = row[_COL_READS:]
            reads = tuple(
                (int(slots[j]), int(slots[j + 1]))
                for j in range(0, len(slots), 2)
                if slots[j + 1] >= 0
            )
            out.append(
                WorkerProgress(int(row[_COL_PID]), int(row[_COL_STEP]), int(row[_COL_INDEX]), reads)
            )
        return out

    # ---- pickling ---------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pool"] = None
        state["_pool_pid"] = -1
        state["_template"] = None
        state["_buffers"] = None
        state["_buffers_pid"] = -1
        state["_progress_view"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        # A plain pickle copies tensors into private memory: share the control tables again so
        # that the worker processes started from this copy see them (torch's own pickler, used
        # for spawned workers, keeps them shared and this is a no-op).
        for name in ("_control", "_progress", "_release"):
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
            and (self._buffers is None or self._buffers_pid != os.getpid())
            and BufferPool.supported()
        ):
            self._buffers = BufferPool(self._release[worker])
            self._buffers_pid = os.getpid()
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
        lookahead = _ShardLookahead.create(self, order, steps, rank)
        pool = self._io_pool()
        pending: deque[tuple[_Planned, list[Future[list[_ReadResult]]] | list[_ReadResult]]] = (
            deque()
        )
        step_iter = iter(steps)
        submitted = 0  # batches of this worker whose reads were submitted

        def fill() -> None:
            nonlocal submitted
            while len(pending) < self.prefetch_batches + 1:
                step = next(step_iter, None)
                if step is None:
                    return
                planned = self._plan(order, step, rank)
                if lookahead is not None:
                    lookahead.advance(submitted)
                submitted += 1
                pending.append((planned, self._submit(pool, planned, worker)))

        try:
            self._report(worker, int(steps[0]), -1)
            fill()
            while pending:
                planned, reads = pending.popleft()
                # From here on a death is this batch's: its reads, the next batches' reads
                # (each recorded where it happens) or its decode.
                self._report(worker, planned.step, -1)
                fill()  # the next batches' reads run while this one is decoded
                if seed_rngs:
                    self._seed_rngs(epoch, planned.step)
                meta, batch = self._assemble(planned, reads, rank, worker, epoch)
                self._report(worker, planned.step, -1)  # decoded: not processing a sample
                yield (meta, batch) if self.with_meta else batch
        finally:
            for _, reads in pending:
                for fut in reads:
                    if isinstance(fut, Future):
                        fut.cancel()
            if isinstance(self.dataset.store, CachingStore):
                # An open reader maps its shard: an evicted shard's disk space stays taken, and
                # reads keep bypassing the cache, for as long as the reader lives (persistent
                # workers: forever). The next epoch reopens what it reads through the cache.
                self.dataset.close()

    # ---- internals --------------------------------------------------------------------------

    def _io_pool(self) -> ThreadPoolExecutor | None:
        if self.io_threads == 0:
            return None
        if self._pool is None or self._pool_pid != os.getpid():
            self._pool = ThreadPoolExecutor(
                self.io_threads,
                thread_name_prefix="fastload-io",
                initializer=_assign_read_slot,
                initargs=(itertools.count(1),),
            )
            self._pool_pid = os.getpid()
        return self._pool

    def _plan(self, order: EpochOrder, step: int, rank: int) -> _Planned:
        start, stop = self.partition.rank_range(step, rank)
        n = self.partition.num_samples
        positions = np.arange(start, stop, dtype=np.int64)
        padded = max(0, stop - max(start, n))
        if padded:
            tail = positions >= n
            positions[tail] = (positions[tail] - n) % n
        indices = order.indices(positions)
        shards, pos = self.dataset.locate(indices)
        return _Planned(step, indices, shards, pos, padded)

    def _submit(
        self, pool: ThreadPoolExecutor | None, planned: _Planned, worker: int
    ) -> list[Future[list[_ReadResult]]] | list[_ReadResult]:
        # Sort by (shard, position) for locality, then split into one chunk per thread.
        order = np.lexsort((planned.positions, planned.shards)).tolist()
        shards, positions = planned.shards.tolist(), planned.positions.tolist()
        indices = planned.indices.tolist()
        items = [(i, shards[i], positions[i], indices[i]) for i in order]
        step = planned.step
        if pool is None or len(items) <= 1:
            return self._read_chunk(items, worker, step)
        chunks = np.array_split(np.arange(len(items)), min(self.io_threads, len(items)))
        return [
            pool.submit(self._read_chunk, [items[j] for j in chunk.tolist()], worker, step)
            for chunk in chunks
        ]

    def _read_chunk(self, items: list[_ReadItem], worker: int, step: int) -> list[_ReadResult]:
        """Read ``items`` in order, recording each read in this thread's progress slot first:
        a read that kills the process (SIGBUS from a shard truncated while memory-mapped) is
        then reported with the sample it was reading, not the one decoded last."""
        out: list[_ReadResult] = []
        slot = self._read_slot(worker)
        try:
            for i, shard, pos, index in items:
                if slot is not None:
                    slot[0], slot[1] = step, index
                try:
                    out.append((i, self.dataset.read_raw(shard, pos), None))
                except Exception as exc:
                    out.append((i, None, exc))
        finally:
            if slot is not None:
                slot[1] = -1
        return out

    def _read_slot(self, worker: int) -> npt.NDArray[np.int64] | None:
        """This thread's ``[step, index]`` read record in ``worker``'s progress row, if tracked."""
        view = self._progress_numpy()
        if view is None or worker >= len(view):
            return None
        col = _COL_READS + 2 * getattr(_THREAD, "slot", 0)
        if col + 2 > view.shape[1]:
            return None
        return view[worker, col : col + 2]

    def _assemble(
        self,
        planned: _Planned,
        reads: list[Future[list[_ReadResult]]] | list[_ReadResult],
        rank: int,
        worker: int,
        epoch: int,
    ) -> tuple[BatchMeta, Any]:
        ds = self.dataset
        n = len(planned.indices)
        raws: list[dict[str, Any] | None] = [None] * n
        errors: list[BaseException | None] = [None] * n
        results: list[_ReadResult] = []
        for r in reads:
            if isinstance(r, Future):
                results.extend(r.result())
            else:
                results.append(r)
        for i, raw, err in results:
            raws[i], errors[i] = raw, err
        where = f"rank {rank}, worker {worker}, global step {planned.step}"
        samples: list[Any] = []
        skipped = nbytes = 0
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
            key = raw.get("__key__")
            raw.setdefault(RNG_SEED_KEY, (ds.seed, epoch, index))
            try:
                decoded = ds.decode_raw(raw)
            except Exception as exc:
                # A missing package or a refused pickle is a setup problem, not bad data: it would
                # "skip" every sample.
                if ds.on_error == "raise" or isinstance(exc, NOT_DATA_ERRORS):
                    raise WorkerError(
                        f"{where}: decoding {ds.describe(shard, pos, key)} failed: "
                        f"{type(exc).__name__}: {exc} (pass on_error='skip' to drop corrupt "
                        "samples)"
                    ) from exc
                if ds.on_error == "warn":
                    log.warning("skipping undecodable %s: %s", ds.describe(shard, pos, key), exc)
                skipped += 1
                continue
            try:
                samples.append(ds.finish(decoded))
            except FormatError as exc:
                # Bad data found by a transform (e.g. a fused decode-and-crop of a corrupt JPEG)
                # follows the error policy like a decode error; other transform errors are bugs.
                if ds.on_error == "raise":
                    raise WorkerError(
                        f"{where}: transform failed on {ds.describe(shard, pos, key)}: "
                        f"{type(exc).__name__}: {exc} (pass on_error='skip' to drop corrupt "
                        "samples)"
                    ) from exc
                if ds.on_error == "warn":
                    log.warning("skipping corrupt %s: %s", ds.describe(shard, pos, key), exc)
                skipped += 1
                continue
            except Exception as exc:
                raise WorkerError(
                    f"{where}: transform failed on {ds.describe(shard, pos, key)}: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        pooled: tuple[tuple[int, int, int], ...] = ()
        if samples:
            buffers = self._buffers if self._buffers_pid == os.getpid() else None
            previous = set_buffer_pool(buffers)
            try:
                batch = self.collate_fn(samples)
            except Exception as exc:
                raise WorkerError(
                    f"{where}: collate_fn failed on a batch of {len(samples)} samples from "
                    f"shards {sorted({ds.shard_url(int(s)) for s in planned.shards})}: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            finally:
                set_buffer_pool(previous)
                if buffers is not None:
                    pooled = buffers.take_used()
            if self._template is None:
                self._template = empty_like_batch(batch)
        else:
            batch = self._empty_batch(where, worker, planned.step)
        meta = BatchMeta(
            planned.step, rank, worker, len(samples), planned.padded, skipped, nbytes, pooled
        )
        return meta, batch

    def _progress_numpy(self) -> npt.NDArray[np.int64] | None:
        view = self._progress_view
        if view is None and self._progress is not None:
            # Writing through NumPy costs ~0.1 us; a torch tensor __setitem__ ~8 us (per sample!).
            view = self._progress_view = self._progress.numpy()
        return view

    def _report(self, worker: int, step: int, index: int) -> None:
        """Record that ``worker`` assembles global step ``step`` and decodes dataset index
        ``index`` (-1: no sample)."""
        view = self._progress_numpy()
        if view is not None and worker < len(view):
            row = view[worker]
            row[_COL_PID] = os.getpid()
            row[_COL_STEP] = step
            row[_COL_INDEX] = index

    def _empty_batch(self, where: str, worker: int, step: int) -> Any:
        """A zero-row batch with the structure of a good one (every sample was skipped)."""
        if self._template is None:
            ds = self.dataset
            for i in range(min(ds.num_samples, _TEMPLATE_TRIES)):
                shard, pos = (int(x) for x in ds.locate(i))
                try:
                    ((_, raw, err),) = self._read_chunk([(0, shard, pos, i)], worker, step)
                    if err is not None:
                        raise err
                    if raw is None:
                        continue
                    self._report(worker, step, i)
                    sample = ds.finish(ds.decode_raw(raw))
                except (FastloadError, FormatError, ValueError, OSError):
                    continue
                finally:
                    self._report(worker, step, -1)
                self._template = empty_like_batch(self.collate_fn([sample]))
                break
            else:
                raise WorkerError(
                    f"{where}: every sample of the batch was skipped as corrupt, and none of the "
                    f"first {_TEMPLATE_TRIES} samples of {ds.url} decodes either, so no empty "
                    "batch of the right structure can be built; check the data with "
                    "`fastload verify`"
                )
        return self._template

    def _seed_rngs(self, epoch: int, step: int) -> None:
        # The rank is part of the seed: ranks build different batches of the same step, and
        # transforms drawing from the global generators must not make the same draws on each.
        state = np.random.SeedSequence(
            [self.dataset.seed, epoch, _TAG_AUGMENT, step, self.rank]
        ).generate_state(2)
        seed32 = int(state[0])
        random.seed(seed32)
        np.random.seed(seed32)
        torch.manual_seed((seed32 << 32) | int(state[1]))

    def __repr__(self) -> str:
        return (
            f"BatchStream({self.dataset!r}, batch_size={self.batch_size}, rank={self.rank}, "
            f"world_size={self.world_size}, drop_last={self.drop_last}, epoch={self.epoch}, "
            f"start_step={self.start_step})"
        )


class _ShardLookahead:
    """Keeps a caching store fetching the next shards one worker's batches will read first.

    Walks the worker's steps in order (planning each once more: pure arithmetic) and records, for
    every shard, the first of the worker's batches that reads it. :meth:`advance` is called with
    the number of the batch whose reads are submitted next; it requests (in first-read order) the
    shards first read by later batches until ``depth`` of them are requested and not yet reached.
    """

    def __init__(
        self,
        stream: BatchStream,
        order: EpochOrder,
        steps: Sequence[int],
        rank: int,
        depth: int,
        prefetch: Callable[[list[str]], None],
    ) -> None:
        self._stream, self._order, self._steps, self._rank = stream, order, steps, rank
        self._depth, self._prefetch = depth, prefetch
        self._touches = self._first_touches()
        self._next: tuple[int, int] | None = None
        self._requested: deque[int] = deque()  # batch numbers of requested, unreached shards

    @classmethod
    def create(
        cls, stream: BatchStream, order: EpochOrder, steps: Sequence[int], rank: int
    ) -> _ShardLookahead | None:
        """A lookahead when the dataset's store can prefetch and ``prefetch_shards > 0``."""
        ds = stream.dataset
        depth = ds.prefetch_shards
        if not ds.store.supports_prefetch or depth <= 0:
            return None
        return cls(stream, order, steps, rank, depth, ds.store.prefetch)

    def _first_touches(self) -> Iterator[tuple[int, int]]:
        """(worker batch number, shard) for each shard the first time the worker's batches read it."""
        seen: set[int] = set()
        for j, step in enumerate(self._steps):
            planned = self._stream._plan(self._order, int(step), self._rank)
            for shard in np.unique(planned.shards).tolist():
                if shard not in seen:
                    seen.add(shard)
                    yield j, shard

    def advance(self, batch: int) -> None:
        """Batch number ``batch`` of this worker is read next: top up the requested shards."""
        while self._requested and self._requested[0] <= batch:
            self._requested.popleft()
        keys: list[str] = []
        while True:
            if self._next is None:
                self._next = next(self._touches, None)
                if self._next is None:
                    break
            j, shard = self._next
            if j > batch and len(self._requested) >= self._depth:
                break
            self._next = None
            if j > batch:  # shards of the batches being read now are filled by those reads
                self._requested.append(j)
                keys.extend(self._stream.dataset.shard_objects(shard))
        if keys:
            try:
                self._prefetch(keys)
            except Exception as exc:  # prefetching is an optimisation; reads report errors
                log.debug("prefetch of %s failed: %s", keys, exc)
