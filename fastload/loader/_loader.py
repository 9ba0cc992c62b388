"""``fastload.DataLoader``: PyTorch's DataLoader arguments, plus epochs, exact resumption and stats.

The loader wraps ``torch.utils.data.DataLoader(batch_size=None)`` around a :class:`BatchStream`:
workers build whole collated batches, and the main process counts what it hands to the training
loop. That count is the resumable state: ``state_dict()`` is O(1) (epoch, global step, and the
options that define the order), taken in the main process, with no per-step snapshot of workers.

**Epochs**: call :meth:`DataLoader.set_epoch` before each epoch (as with ``DistributedSampler``);
without it every iteration replays the same order. ``len(loader)`` is the number of batches the
next (or current) iteration yields on this rank; every rank gets the same number.

**Resume**: :meth:`DataLoader.load_state_dict` makes the next iteration continue the saved epoch at
the saved global step: the remaining samples are exactly those not yet delivered. The number of
workers may change, and so may the world size, as long as the global batch size (``batch_size x
world_size``) is the same. ``set_epoch(e)`` with the saved epoch keeps the pending resume (the
usual loop: ``load_state_dict`` once, then ``set_epoch(epoch)`` at the top of every epoch). While a
resume into the middle of an epoch is pending, ``set_epoch`` with another epoch raises
:class:`~fastload.errors.InvalidArgumentError` (it would silently drop the rest of the saved epoch
and break exactly-once); ``set_epoch(e, discard_resume=True)`` drops it on purpose. A resume of a
finished epoch, or of one at step 0, holds no undelivered partial epoch: another epoch replaces
it without complaint. A resumed epoch's following epochs start at step 0.

**Worker failures**: a worker that dies (killed by a signal, a crash in native code, the OOM
killer, ``SIGBUS`` from a shard truncated while memory-mapped) or times out ends the iteration with
a :class:`~fastload.errors.WorkerError` naming the rank, the global step the loop waited for, and
for each dead worker its pid, exit signal, the sample it was decoding and the samples its threads
were reading (shard URL, position, dataset index). The iteration's workers are shut down; the next
iteration starts fresh ones (also with ``persistent_workers``).
"""

from __future__ import annotations

import logging
import re
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.data

from fastload._units import check_int
from fastload.errors import FastloadError, InvalidArgumentError, WorkerError
from fastload.loader._batch_meta import BatchMeta
from fastload.loader._collate import BufferReleaser
from fastload.loader._dataset import Dataset
from fastload.loader._device import prefetch_to_device, resolve_device
from fastload.loader._progress import WorkerProgress
from fastload.loader._stream import BatchStream
from fastload.loader.order._cursor import EpochCursor
from fastload.loader.order._partition import Partition

__all__ = ["DataLoader"]

log = logging.getLogger("fastload.loader")


def _exit_codes(torch_iter: Any) -> dict[int, int | None]:
    """``pid -> exit code`` (negative: killed by that signal; ``None``: alive) of the worker
    processes of a torch DataLoader iterator (empty for other iterators)."""
    out: dict[int, int | None] = {}
    for proc in getattr(torch_iter, "_workers", ()):
        pid = getattr(proc, "pid", None)
        if isinstance(pid, int):
            try:
                out[pid] = proc.exitcode
            except (ValueError, AssertionError):  # a closed process object
                out[pid] = None
    return out


def _unwrap(item: Any) -> Any:
    """Collate function of the inner torch DataLoader: items are already whole batches."""
    return item


class DataLoader:
    """Batches from a fastload dataset: exactly once per epoch across ranks, resumable, fast.

    Arguments follow ``torch.utils.data.DataLoader``; the differences:

    * ``shuffle`` defaults to the dataset's setting (``open_dataset(shuffle=..., seed=...)``); the
      order is a pure function of (seed, epoch), so ``sampler``, ``batch_sampler`` and
      ``generator`` are not accepted (use ``torch.utils.data.DataLoader`` with the map-style
      dataset to bring your own sampler).
    * ``batch_size`` is per rank; ``drop_last`` applies to the global step (see
      :mod:`fastload.loader.order._partition`): by default the last global step is split evenly over the
      ranks, padding at most ``world_size - 1`` repeated samples (counted in :meth:`stats`).
    * ``collate_fn`` runs inside the workers on the list of processed samples.
    * ``in_order`` must stay ``True`` (exact resumption needs the batches in step order).

    Args:
        dataset: A :class:`~fastload.loader.Dataset` from :func:`fastload.open_dataset`, or a
            weighted mix of several from :func:`fastload.mix` (:meth:`stats` then counts each
            source's samples).
        batch_size: Samples per batch on this rank.
        shuffle: Override the dataset's ``shuffle``.
        num_workers: Worker processes (0 = load in the main process, with I/O threads).
        collate_fn: ``list of samples -> batch`` (default: like torch's ``default_collate``).
        pin_memory: Pin batches in page-locked memory (for fast copies to a GPU).
        drop_last: Drop the incomplete last global step instead of padding.
        timeout: Seconds to wait for a batch from a worker (0 = no limit; a dead worker is
            always detected).
        worker_init_fn: Called in each worker process at start-up with the worker id.
        multiprocessing_context: ``"fork"``, ``"spawn"``, ``"forkserver"`` or a context object.
        prefetch_factor: Batches each worker prepares ahead (torch's meaning).
        persistent_workers: Keep workers alive between epochs; ``set_epoch`` still reaches them.
        pin_memory_device: Passed to torch.
        device: ``"cuda"`` (or ``"cuda:N"``) moves every batch to that GPU on a side stream one
            batch ahead (and turns on ``pin_memory``); ``None``/``"cpu"`` leaves batches on the CPU.
        rank: This process's rank (``None``: detected from ``torch.distributed`` or the launcher's
            variables: ``torchrun``, ``horovodrun``, ``mpirun``, ``srun``; see
            :func:`~fastload.loader.detect_launch`).
        world_size: Number of ranks (detected likewise if ``None``).
        io_threads: Reader threads per worker that fetch the next batch's samples ahead;
            ``None`` (default): none for local files, 4 for remote stores and caches (see
            :func:`~fastload.loader._stream.default_io_threads`).
        prefetch_batches: Batches per worker whose reads run ahead of decoding (``None``: 1
            with reader threads, else 0).

    Thread and process safety: use one loader from one thread. The loader, its dataset and its
    stream pickle, so every multiprocessing start method works (``decode``, ``transform`` and
    ``collate_fn`` must be picklable for ``spawn``/``forkserver``).
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0.0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        device: str | torch.device | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        io_threads: int | None = None,
        prefetch_batches: int | None = None,
    ) -> None:
        if not isinstance(dataset, Dataset):
            raise InvalidArgumentError(
                f"fastload.DataLoader needs a dataset from fastload.open_dataset, got "
                f"{type(dataset).__name__}; for other datasets use torch.utils.data.DataLoader"
            )
        for name, value in (
            ("sampler", sampler),
            ("batch_sampler", batch_sampler),
            ("generator", generator),
        ):
            if value is not None:
                raise InvalidArgumentError(
                    f"fastload.DataLoader does not take {name}=: the order is a pure function of "
                    "(seed, epoch); set shuffle/seed in fastload.open_dataset, or use "
                    "torch.utils.data.DataLoader with the map-style dataset and your own sampler"
                )
        if not in_order:
            raise InvalidArgumentError(
                "in_order=False is not supported: exact resumption needs batches in step order"
            )
        num_workers = check_int("num_workers", num_workers)
        batch_size = check_int("batch_size", batch_size, minimum=1)
        if shuffle is not None and bool(shuffle) != dataset.shuffle:
            dataset = dataset.replace(shuffle=bool(shuffle))
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.drop_last = bool(drop_last)
        self.device = resolve_device(device)
        self.pin_memory = bool(pin_memory) or self.device is not None
        self._stream = BatchStream(
            dataset,
            batch_size,
            drop_last=drop_last,
            collate_fn=collate_fn,
            rank=rank,
            world_size=world_size,
            io_threads=io_threads,
            prefetch_batches=prefetch_batches,
            with_meta=True,
        )
        self.rank, self.world_size = self._stream.rank, self._stream.world_size
        self._releaser: BufferReleaser | None = None
        if num_workers > 0:
            self._stream.track_progress(num_workers)
            if not self.pin_memory:
                # Pinned batches are copies: the workers' blocks could not be tracked, so
                # collation then uses fresh shared memory as torch does.
                depth = prefetch_factor if prefetch_factor is not None else 2
                table = self._stream.enable_buffer_reuse(num_workers, 2 * (depth + 3))
                self._releaser = BufferReleaser(table)
        torch_kwargs: dict[str, Any] = {
            "batch_size": None,
            "num_workers": num_workers,
            "collate_fn": _unwrap,
            "pin_memory": self.pin_memory,
            "timeout": timeout,
            "worker_init_fn": worker_init_fn,
            "multiprocessing_context": multiprocessing_context if num_workers else None,
            "persistent_workers": persistent_workers and num_workers > 0,
            "pin_memory_device": pin_memory_device,
        }
        if num_workers > 0 and prefetch_factor is not None:
            torch_kwargs["prefetch_factor"] = prefetch_factor
        self._torch_kwargs = torch_kwargs
        self._torch: torch.utils.data.DataLoader[Any] | None = None
        self._cursor = EpochCursor(dataset, self._stream.partition, what="DataLoader")
        self._source_samples = [0] * len(dataset.source_names)  # a mix's per-source counts

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_torch"] = None  # holds worker processes; rebuilt on first iteration
        state["_releaser"] = None  # weak references of this process; rebuilt below
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        table = self._stream.buffer_table
        self._releaser = BufferReleaser(table) if table is not None else None

    # ---- epochs and state -------------------------------------------------------------------

    @property
    def partition(self) -> Partition:
        """The :class:`~fastload.loader.order._partition.Partition` of an epoch on this job."""
        return self._stream.partition

    @property
    def epoch(self) -> int:
        """The epoch the loader iterates (set with :meth:`set_epoch`)."""
        return self._cursor.epoch

    @property
    def global_batch_size(self) -> int:
        """``batch_size x world_size``."""
        return self._stream.partition.global_batch_size

    def set_epoch(self, epoch: int, *, discard_resume: bool = False) -> None:
        """Iterate epoch ``epoch`` next (changes the order when shuffling).

        After :meth:`load_state_dict`, ``set_epoch`` with the saved epoch keeps the resume point;
        another epoch starts from step 0.

        Args:
            epoch: The epoch to iterate next (an int >= 0).
            discard_resume: Drop a pending resume (from :meth:`load_state_dict`) and start
                ``epoch`` from step 0, also when it is the saved epoch.

        Raises:
            InvalidArgumentError: A resume into the middle of another epoch is pending (loaded
                and not yet iterated) and ``discard_resume`` is false: moving on would silently
                skip the rest of that epoch. The message says which epoch and step were pending.
        """
        self._cursor.set_epoch(epoch, discard_resume=discard_resume)

    def __len__(self) -> int:
        return self._cursor.remaining()

    def state_dict(self) -> dict[str, Any]:
        """The resumable position: small, O(1) in the dataset size, taken in the main process
        (the layout: :mod:`fastload.loader.order._cursor`).

        ``step`` counts the global steps of ``epoch`` whose batches this loader has handed to the
        training loop (a batch counts once it is yielded).
        """
        return self._cursor.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`, possibly of another job size, or
        from a ``fastload.dali.DALILoader`` in external mode).

        Raises:
            InvalidArgumentError: The state is from another dataset or order (sample count, seed,
                shuffle options; for a mix: other sources, weights, window or epoch size), a
                different global batch size, or an unknown version; the message says which and
                how to fix it.
        """
        self._cursor.load_state_dict(state, extra_check=self.dataset.check_state)

    # ---- iteration --------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        epoch, start, _ = self._cursor.begin()
        self._stream.set_epoch(epoch, start)
        return self._run(epoch, start)

    def _run(self, epoch: int, start: int) -> Iterator[Any]:
        cursor = self._cursor
        stats = cursor.stats
        began = time.perf_counter()
        if self._torch is None:
            self._torch = torch.utils.data.DataLoader(self._stream, **self._torch_kwargs)
        torch_iter: Iterator[tuple[BatchMeta, Any]] = iter(self._torch)
        source = torch_iter
        if self.device is not None:
            source = prefetch_to_device(source, self.device)
        expected = start
        releaser = self._releaser
        try:
            while True:
                if releaser is not None:
                    releaser.poll()
                t0 = time.perf_counter()
                try:
                    meta, batch = next(source)
                except StopIteration:
                    break
                except FastloadError:
                    self._abandon(torch_iter)
                    raise
                except Exception as exc:
                    error = self._worker_error(epoch, expected, exc, torch_iter)
                    self._abandon(torch_iter)
                    raise error from exc
                now = time.perf_counter()
                stats.stall += now - t0
                if meta.step != expected:
                    raise WorkerError(
                        f"internal error: expected the batch of global step {expected} on rank "
                        f"{self.rank}, got step {meta.step} from worker {meta.worker}; please "
                        "report this"
                    )
                expected += 1
                if releaser is not None and meta.pooled:
                    releaser.track(batch, meta.worker, meta.pooled)
                stats.add(
                    size=meta.size,
                    nbytes=meta.nbytes,
                    padded=meta.padded,
                    skipped=meta.skipped,
                    filtered=meta.filtered,
                    stages=meta.stages,
                )
                for i, n in enumerate(meta.sources):
                    self._source_samples[i] += n
                stats.elapsed += now - began
                began = now
                cursor.reached(epoch, meta.step + 1)
                yield batch
        finally:
            cursor.end()

    def _abandon(self, torch_iter: Iterator[Any]) -> None:
        """Shut down the workers of a failed iteration now (the exception's traceback would keep
        them alive), and make the next iteration start fresh ones: persistent workers of a
        failed iteration may be dead or mid-epoch."""
        shutdown = getattr(torch_iter, "_shutdown_workers", None)
        if callable(shutdown):
            try:
                shutdown()
            except Exception as exc:  # must not mask the error being raised
                log.debug("shutting down the workers of a failed iteration: %s", exc)
        self._torch = None

    def _worker_error(
        self, epoch: int, step: int, exc: BaseException, torch_iter: Iterator[Any]
    ) -> WorkerError:
        """A WorkerError for a failure (death, timeout) while waiting for ``step``'s batch."""
        text = str(exc)
        dead: set[int] = set()
        for group in re.findall(r"pid\(s\) ([\d, ]+)", text):
            dead.update(int(p) for p in re.findall(r"\d+", group))
        dead.update(int(p) for p in re.findall(r"worker \(pid (\d+)\)", text))
        codes = _exit_codes(torch_iter)
        dead.update(pid for pid, code in codes.items() if code is not None and code != 0)
        where = [f"rank {self.rank}, waiting for global step {step} of epoch {epoch}"]
        bus = "Bus error" in text or "SIGBUS" in text
        for worker, progress in enumerate(self._stream.progress()):
            pid = progress.pid
            if pid < 0 or (dead and pid not in dead):
                continue
            code = codes.get(pid)
            bus = bus or code == -signal.SIGBUS
            where.append(f"worker {worker} " + self._describe_progress(progress, pid in dead, code))
        hint = (
            "A worker that died was killed by a signal or crashed in native code (a decoder), or "
            "by the out-of-memory killer (then lower num_workers, prefetch_factor or batch_size)"
        )
        if bus:
            hint = (
                "SIGBUS means a memory-mapped file could not be read: a shard that shrank "
                "(truncated or rewritten in place) while it was read (check it with `fastload "
                f"verify {self.dataset.url}`, restore it from the source, and replace shards only "
                "atomically: write a new file, then rename it over the old one), or a full "
                "/dev/shm (torch's guess; then give it more room, e.g. docker --shm-size). " + hint
            )
        return WorkerError(
            f"loading failed: {type(exc).__name__}: {text}. " + "; ".join(where) + f". {hint}"
        )

    def _describe_progress(self, progress: WorkerProgress, died: bool, code: int | None) -> str:
        """``(pid …) died at global step …, processing … while reading …`` for one worker."""
        ds = self.dataset
        how = ""
        if code is not None and code < 0:
            try:
                how = f", killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f", killed by signal {-code}"
        elif code is not None and code > 0:
            how = f", exit status {code}"
        what = (
            f"(pid {progress.pid}{how}) {'died' if died else 'was'} at global step {progress.step}"
        )

        def sample(index: int) -> str:
            shard, pos = (int(x) for x in ds.locate(index))
            return f"{ds.describe(shard, pos)} (dataset index {index})"

        parts = []
        if ds.has_index(progress.index):
            parts.append(f"processing {sample(progress.index)}")
        reads = [
            f"{sample(index)} for global step {rstep}"
            for rstep, index in progress.reads
            if ds.has_index(index)
        ]
        if reads:
            parts.append("while reading " + " and ".join(reads))
        if not parts:
            parts.append("between samples (no read or decode in progress)")
        return what + " " + ", ".join(parts)

    # ---- statistics -------------------------------------------------------------------------

    def stats(self) -> dict[str, float | int]:
        """Counters since the loader was made (or since :meth:`reset_stats`); see
        :meth:`fastload.loader.order._stats.LoaderStats.report` for the keys. A mix
        (:func:`fastload.mix`) adds ``samples[<source name>]``: samples delivered per source."""
        report = self._cursor.report()
        for name, n in zip(self.dataset.source_names, self._source_samples, strict=True):
            report[f"samples[{name}]"] = n
        return report

    def reset_stats(self) -> None:
        """Zero the counters of :meth:`stats`."""
        self._cursor.reset_stats()
        self._source_samples = [0] * len(self._source_samples)

    def __repr__(self) -> str:
        return (
            f"fastload.DataLoader({self.dataset!r}, batch_size={self.batch_size}, "
            f"num_workers={self.num_workers}, rank={self.rank}, world_size={self.world_size}, "
            f"drop_last={self.drop_last}, epoch={self.epoch}, step={self._cursor.step})"
        )
