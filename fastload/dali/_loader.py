"""``fastload.dali.DALILoader``: DALI pipelines over fastload datasets, with the loader's guarantees.

**Feeding** (``reader=``):

* ``"external"`` (the default, every store and format): ``fn.external_source(parallel=True)``
  fed by fastload's own shard readers (random access by sample). Which samples a rank gets at
  each step is exactly what :class:`fastload.DataLoader` gives for the same (seed, epoch, world
  size, batch size, ``drop_last``): the epoch's global order is
  :class:`~fastload.loader.EpochOrder`, split by :class:`~fastload.loader.Partition` (every
  sample once per epoch across ranks, the same number of batches on every rank, the last global
  step split evenly with at most ``world_size - 1`` repeated samples, or dropped with
  ``drop_last``). Remote shards are read through the store, or through a local cache with
  ``cache_dir=``. State dicts are interchangeable with :class:`fastload.DataLoader`'s: O(1),
  elastic (another world size with the same global batch).
* ``"native"`` (local WebDataset and TFRecord shards, or remote ones through ``cache_dir``):
  DALI's ``fn.readers.webdataset`` / ``fn.readers.tfrecord`` with fastload's ``.idx`` files.
  Exactly-once per epoch and equal batch counts hold, but the order is DALI's (per-rank slices
  rotated by epoch, buffer shuffle); see :mod:`fastload.dali._native` for the precise contract.

**Epochs**: each iteration builds one DALI pipeline for one epoch, seeded from (seed, epoch), so
augmentation draws are a function of (seed, epoch) and not of what ran before. ``set_epoch``,
``len()``, ``state_dict()`` and ``stats()`` behave as :class:`fastload.DataLoader`'s.

**Randomness on resume**: the *samples* of a resumed epoch are exactly the undelivered ones, but
DALI's random operators cannot be positioned at a step, so the random crops and flips after a
resume differ from those of an uninterrupted run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from fastload._units import check_int
from fastload.dali._augment import AugmentFn, ImageAugment, check_augment
from fastload.dali._backend import Device, local_rank, require_dali, resolve
from fastload.dali._native import NativePlan, check_native, local_paths, native_reader
from fastload.dali._outputs import convert_batch
from fastload.dali._source import BatchSource, FieldSpec, cache_budget, resolve_dataset
from fastload.errors import FastloadError, InvalidArgumentError, WorkerError
from fastload.formats import ErrorPolicy
from fastload.loader import Dataset, EpochCursor, Partition, detect_launch, pipeline_seed
from fastload.storage import DEFAULT_CACHE_SIZE, Store

__all__ = ["DALILoader"]

_READERS = ("auto", "external", "native")


class DALILoader:
    """Batches of a fastload dataset decoded and augmented by an NVIDIA DALI pipeline.

    Iterating yields tuples of torch tensors, one per output of ``augment`` (by default
    ``(images, labels)``: images ``(B, 3, H, W)`` float32/float16 normalized, labels ``(B,)``
    int64), on the GPU for ``device="gpu"``, else on the CPU. ``B`` is ``batch_size`` except in the
    last batch of an epoch (see :class:`fastload.loader.Partition`).

    Args:
        dataset: A dataset URL or path (``s3://...``, a directory), an open
            :class:`~fastload.storage.Store` at the dataset root, or a
            :class:`~fastload.loader.Dataset` from :func:`fastload.open_dataset`.
        batch_size: Samples per batch on this rank.
        augment: The augmentation graph: an :class:`~fastload.dali.ImageAugment` (default
            ``ImageAugment()``: the training recipe at 224 px) or any callable
            ``augment(images, labels, *, device)`` returning DALI DataNodes, with the labels at
            position 1 if it returns them (see :mod:`fastload.dali._augment`).
        fields: ``(image field, label field)``; ``;`` separates alternatives (``"jpg;png"``).
            Labels must be integers (``cls`` fields).
        device: ``"auto"`` (GPU when one is usable, else CPU), ``"cpu"`` or ``"gpu"`` (mixed
            decoding with nvJPEG on GPU ``device_id``; an error without a GPU).
        num_threads: DALI CPU threads (decoding on the CPU, resizing, ...).
        seed: Order and augmentation seed; ``None`` keeps the dataset's (0 for URLs).
        shuffle: Shuffle the order; ``None`` keeps the dataset's (True for URLs).
        rank: This rank (detected from ``torch.distributed`` or the launcher's variables when
            ``None``, see :func:`fastload.loader.detect_launch`).
        world_size: Number of ranks (detected likewise when ``None``).
        drop_last: Drop the incomplete last global step instead of padding.
        reader: ``"external"`` (fastload readers, exact semantics), ``"native"`` (DALI's
            readers, local WebDataset/TFRecord, DALI's order), or ``"auto"`` (= external).
        py_workers: Processes running the external source (``parallel=True``); 0 reads in the
            main process.
        py_start_method: ``"fork"`` or ``"spawn"`` for those processes; default ``"fork"``
            unless this process has already initialised CUDA (then ``"spawn"``).
        io_threads: Threads per external-source process reading one batch's samples
            concurrently (useful for remote stores without ``cache_dir``).
        prefetch: Batches DALI prepares ahead (``prefetch_queue_depth``).
        initial_fill: Native mode: DALI's shuffle buffer, in samples.
        cache_dir: Cache remote shards in this local directory (shared by processes); needed
            for ``reader="native"`` on remote stores.
        cache_size: Byte budget of the cache (``"50GB"`` or an int), as for
            :func:`fastload.open_dataset`.
        cache_bytes: The former name of ``cache_size``: still taken, with a
            ``DeprecationWarning``.
        on_error: Corrupt samples when reading (external mode): ``"raise"``, ``"skip"`` or
            ``"warn"``; undecodable images always raise (DALI's decoders cannot skip).
        store_options: Options for :func:`fastload.open_store` when ``dataset`` is a URL.
        device_id: The GPU for ``device="gpu"``; default: the launcher's local rank
            (``LOCAL_RANK``, ``OMPI_COMM_WORLD_LOCAL_RANK``, ``SLURM_LOCALID``, ... see
            :func:`fastload.loader.detect_launch`), else the rank modulo the GPUs.
        prebuild: External mode: from the middle of an epoch on, build the pipeline of the next
            epoch (``epoch + 1`` from step 0) in a background thread, so that its start-up
            (seconds when worker processes must be spawned, e.g. once CUDA is initialised)
            overlaps with training. It is used if the next iteration is that epoch, else
            discarded. Costs a second pipeline's memory for half an epoch.

    Raises:
        MissingDependencyError: DALI is not installed (``pip install 'fastload[dali]'``).
        InvalidArgumentError: Bad options; ``device="gpu"`` without a GPU; ``reader="native"``
            for a format or store DALI cannot read.

    Thread and process safety: use one loader from one thread. Each iteration starts DALI's
    threads and, in external mode, ``py_workers`` processes; they stop when the iteration ends.
    """

    def __init__(
        self,
        dataset: str | os.PathLike[str] | Store | Dataset,
        batch_size: int,
        *,
        augment: AugmentFn | None = None,
        fields: Sequence[str] = ("jpg;jpeg;png", "cls"),
        device: str = "auto",
        num_threads: int = 2,
        seed: int | None = None,
        shuffle: bool | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        reader: str = "auto",
        py_workers: int = 2,
        py_start_method: str | None = None,
        io_threads: int = 0,
        prefetch: int = 2,
        initial_fill: int = 1024,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_size: int | str = DEFAULT_CACHE_SIZE,
        cache_bytes: int | str | None = None,
        on_error: str = "raise",
        store_options: Mapping[str, Any] | None = None,
        device_id: int | None = None,
        prebuild: bool = True,
    ) -> None:
        require_dali()
        cache_size = cache_budget(cache_size, cache_bytes)
        self.batch_size = check_int("batch_size", batch_size, minimum=1)
        self.num_threads = check_int("num_threads", num_threads, minimum=1)
        self.py_workers = check_int("py_workers", py_workers)
        self.io_threads = check_int("io_threads", io_threads)
        self.prefetch = check_int("prefetch", prefetch, minimum=1)
        self.initial_fill = check_int("initial_fill", initial_fill, minimum=1)
        ErrorPolicy(on_error)  # validates
        if reader not in _READERS:
            raise InvalidArgumentError(f"reader must be one of {_READERS}, got {reader!r}")
        if py_start_method not in (None, "fork", "spawn"):
            raise InvalidArgumentError(
                f"py_start_method must be 'fork' or 'spawn', got {py_start_method!r}"
            )
        self.py_start_method = py_start_method
        self.fields = FieldSpec.parse(list(fields))
        self.augment: AugmentFn = check_augment(augment if augment is not None else ImageAugment())
        self.device: Device = resolve(device)
        self.drop_last = bool(drop_last)
        launch = detect_launch(rank, world_size)
        self.rank, self.world_size = launch.rank, launch.world_size
        self.device_id: int | None = None
        if self.device == "gpu":
            self.device_id = device_id if device_id is not None else local_rank(launch)
        self.dataset = resolve_dataset(
            dataset, seed, shuffle, on_error, store_options, cache_dir, cache_size
        )
        self.reader = "external" if reader == "auto" else reader
        self._native_paths: tuple[list[str], list[str]] | None = None
        if self.reader == "native":
            check_native(self.dataset)
        self.partition = Partition(
            self.dataset.num_samples, self.world_size, self.batch_size, self.drop_last
        )
        # Native mode shards its own way (NativePlan); its step count is the same every epoch. It
        # goes in as a number: a callable of the loader would make a reference cycle, leaving
        # finished pipelines to the cyclic garbage collector, and a pipeline collected while
        # another one starts its worker processes deadlocks DALI.
        native_steps = self.native_plan(0).num_steps if self.reader == "native" else None
        self._cursor = EpochCursor(
            self.dataset, self.partition, what="DALILoader", num_steps=native_steps
        )
        self.prebuild = bool(prebuild)
        self._next: tuple[int, Future[Any]] | None = None  # (epoch, pipeline being built)
        self._builder: ThreadPoolExecutor | None = None

    @property
    def on_error_policy(self) -> str:
        """The dataset's corrupt-sample policy."""
        return str(self.dataset.on_error)

    # ---- epochs and state -------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch the loader iterates (set with :meth:`set_epoch`)."""
        return self._cursor.epoch

    @property
    def global_batch_size(self) -> int:
        """``batch_size x world_size``."""
        return self.partition.global_batch_size

    def native_plan(self, epoch: int | None = None) -> NativePlan:
        """Native mode: this rank's share of ``epoch`` (default: the current one)."""
        return NativePlan(
            self.dataset.num_samples,
            self.world_size,
            self.batch_size,
            self.rank,
            self.epoch if epoch is None else epoch,
            self.drop_last,
        )

    def set_epoch(self, epoch: int, *, discard_resume: bool = False) -> None:
        """Iterate epoch ``epoch`` next (changes the order and the augmentation draws).

        As :meth:`fastload.DataLoader.set_epoch`: after :meth:`load_state_dict`, the saved epoch
        keeps the resume point; another epoch while a mid-epoch resume is pending raises unless
        ``discard_resume=True`` (which also drops a resume of the saved epoch).

        Raises:
            InvalidArgumentError: The call would silently drop a pending mid-epoch resume.
        """
        self._cursor.set_epoch(epoch, discard_resume=discard_resume)

    def __len__(self) -> int:
        return self._cursor.remaining()

    def state_dict(self) -> dict[str, Any]:
        """The resumable position (O(1)): epoch and global steps handed to the training loop.

        In external mode the layout is :class:`fastload.DataLoader`'s (dataset fingerprint
        included, :mod:`fastload.loader.order._cursor`), and either loader resumes from the other's
        state. Native mode adds ``reader`` and ``initial_fill``.
        """
        state = self._cursor.state_dict()
        if self.reader == "native":
            state["reader"] = "native"
            state["initial_fill"] = self.initial_fill
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict` or :class:`fastload.DataLoader`).

        External mode: the world size may differ when the global batch size is the same. Native
        mode: the world size, batch size and shuffle buffer must be the same. A state without a
        dataset fingerprint (saved by an older DALILoader) is checked by its sample count and
        order options only.

        Raises:
            InvalidArgumentError: The state belongs to another dataset, order, global batch size
                or reader mode; the message says which.
        """
        self._cursor.load_state_dict(state, extra_check=self._check_reader)

    def _check_reader(self, state: dict[str, Any]) -> None:
        """Refuse a state of the other reader mode, and a native one of another sharding."""
        saved_reader = state.get("reader", "external")
        if saved_reader != self.reader:
            raise InvalidArgumentError(
                f"the state was saved by a loader with reader={saved_reader!r}, this one has "
                f"reader={self.reader!r}; their orders differ, so it cannot resume exactly"
            )
        if self.reader == "native" and (
            state.get("world_size") != self.world_size
            or state.get("initial_fill") != self.initial_fill
        ):
            raise InvalidArgumentError(
                "reader='native' resumes only with the same world size and initial_fill "
                f"(saved {state.get('world_size')}/{state.get('initial_fill')}, now "
                f"{self.world_size}/{self.initial_fill}); use reader='external' for elastic resume"
            )

    # ---- pipelines --------------------------------------------------------------------------

    def _start_method(self) -> str:
        """``fork`` unless CUDA is initialised in this process (by torch, or by an earlier GPU
        pipeline): DALI refuses to fork then, and the workers must be spawned."""
        if self.py_start_method is not None:
            return self.py_start_method
        import torch

        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            return "spawn"
        backend: Any = require_dali().backend
        probe = getattr(backend, "IsDriverInitialized", None)
        return "spawn" if probe is not None and probe() else "fork"

    def build_pipeline(self, epoch: int, start_step: int = 0) -> Any:
        """Build (and return) the DALI pipeline of ``epoch`` from ``start_step`` on (external
        mode; native mode always starts at step 0). Its outputs are the augmentation's outputs
        plus a metadata output; :meth:`__iter__` drives it. Exposed for inspection and tests."""
        dali = require_dali()
        fn, types = dali.fn, dali.types
        pipe = dali.Pipeline(
            batch_size=self.batch_size,
            num_threads=self.num_threads,
            device_id=self.device_id,
            seed=pipeline_seed(self.dataset.seed, epoch),
            prefetch_queue_depth=self.prefetch,
            py_num_workers=max(1, self.py_workers),
            py_start_method=self._start_method(),
        )
        with pipe:
            if self.reader == "external":
                source = BatchSource(
                    self.dataset,
                    self.partition,
                    rank=self.rank,
                    epoch=epoch,
                    start_step=start_step,
                    fields=self.fields,
                    io_threads=self.io_threads,
                )
                parallel: dict[str, Any] = (
                    {"parallel": True, "prefetch_queue_depth": self.prefetch}
                    if self.py_workers > 0
                    else {}
                )
                images, labels, meta = fn.external_source(
                    source=source,
                    num_outputs=3,
                    batch=True,
                    batch_info=True,
                    dtype=[types.UINT8, types.INT64, types.INT64],
                    ndim=[1, 1, 1],
                    **parallel,
                )
            else:
                if self._native_paths is None:
                    self._native_paths = local_paths(self.dataset)
                images, labels = native_reader(
                    fn,
                    self.dataset,
                    self.fields,
                    self.native_plan(epoch),
                    self._native_paths,
                    initial_fill=self.initial_fill,
                    seed=pipeline_seed(self.dataset.seed, epoch),
                )
                meta = images.shape(dtype=types.INT64)
            outputs = self.augment(images, labels, device=self.device)
            if not isinstance(outputs, (tuple, list)):
                outputs = (outputs,)
            pipe.set_outputs(*outputs, meta)
        try:
            pipe.build()
        except Exception as exc:
            _shutdown(pipe)
            raise WorkerError(
                f"building the DALI pipeline for {self.dataset.url} failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        return pipe

    # ---- iteration --------------------------------------------------------------------------

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        epoch, start, _ = self._cursor.begin()
        return self._run(epoch, start)

    def _run(self, epoch: int, start: int) -> Iterator[tuple[Any, ...]]:
        cursor = self._cursor
        stats = cursor.stats
        native = self.reader == "native"
        plan = self.native_plan(epoch) if native else None
        steps = plan.num_steps if plan is not None else self.partition.num_steps
        pipe = None
        try:
            if start >= steps:
                return
            began = time.perf_counter()
            pipe = self._take_prebuilt(epoch, start)
            if pipe is None:
                pipe = self.build_pipeline(epoch, 0 if native else start)
            # Native mode cannot start mid-epoch: replay (and discard) the batches before start.
            first = 0 if native else start
            halfway = first + (steps - first) // 2
            for step in range(first, steps):
                if step == halfway and self.prebuild and not native:
                    self._start_prebuild(epoch + 1)
                t0 = time.perf_counter()
                try:
                    outputs = pipe.run()
                except StopIteration:
                    raise WorkerError(
                        f"internal error: the DALI pipeline ended at global step {step} of epoch "
                        f"{epoch} on rank {self.rank}, expected {steps} steps; please report this"
                    ) from None
                except FastloadError:
                    raise
                except Exception as exc:
                    raise WorkerError(
                        f"the DALI pipeline failed at global step {step} of epoch {epoch} on rank "
                        f"{self.rank} ({self.reader} reader, {self.dataset.url}): "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
                if step < start:
                    continue
                batch, size, padded, nbytes = convert_batch(
                    outputs, step, plan, device=self.device, device_id=self.device_id
                )
                now = time.perf_counter()
                stats.stall += now - t0
                skipped = 0
                if plan is None:
                    lo, hi = self.partition.rank_range(step, self.rank)
                    skipped = (hi - lo) - size
                stats.add(size=size, nbytes=nbytes, padded=padded, skipped=skipped)
                stats.elapsed += now - began
                began = now
                cursor.reached(epoch, step + 1)
                yield batch
        finally:
            cursor.end()
            if pipe is not None:
                _shutdown(pipe)

    def _start_prebuild(self, epoch: int) -> None:
        if self._next is not None:
            return
        if self._builder is None:
            self._builder = ThreadPoolExecutor(1, thread_name_prefix="fastload-dali-prebuild")
        self._next = (epoch, self._builder.submit(self.build_pipeline, epoch, 0))

    def _take_prebuilt(self, epoch: int, start: int) -> Any:
        """The prebuilt pipeline if it is the one wanted (``epoch`` from step 0), else ``None``
        (a wrong one is shut down)."""
        if self._next is None:
            return None
        next_epoch, future = self._next
        self._next = None
        if next_epoch == epoch and start == 0 and self.reader == "external":
            return future.result()  # a build error surfaces here, as it would have inline
        future.add_done_callback(_discard)
        return None

    def close(self) -> None:
        """Shut down a pipeline prebuilt for the next epoch (its threads and processes). The
        loader stays usable; iterating builds pipelines again."""
        if self._next is not None:
            self._next[1].add_done_callback(_discard)
            self._next = None
        if self._builder is not None:
            self._builder.shutdown(wait=True)
            self._builder = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_next"] = None
        state["_builder"] = None
        return state

    # ---- statistics -------------------------------------------------------------------------

    def stats(self) -> dict[str, float | int]:
        """Counters since the loader was made (or :meth:`reset_stats`); the keys and meanings of
        :meth:`fastload.DataLoader.stats` (``bytes`` counts the image field only in native
        mode; ``data_stall_s`` is the time spent waiting for DALI's next batch)."""
        native = self.reader == "native"
        return self._cursor.report(dropped_per_epoch=self.native_plan().dropped if native else None)

    def reset_stats(self) -> None:
        """Zero the counters of :meth:`stats`."""
        self._cursor.reset_stats()

    def __repr__(self) -> str:
        return (
            f"fastload.dali.DALILoader({self.dataset!r}, batch_size={self.batch_size}, "
            f"device={self.device!r}, reader={self.reader!r}, rank={self.rank}, "
            f"world_size={self.world_size}, drop_last={self.drop_last}, epoch={self.epoch}, "
            f"step={self._cursor.step})"
        )


def _shutdown(pipe: Any) -> None:
    """Stop a pipeline's threads and worker processes now rather than at garbage collection."""
    close = getattr(pipe, "_shutdown", None)  # DALI has no public close(); __del__ calls this
    if close is not None:
        try:
            close()
        except Exception:  # best effort while unwinding
            pass


def _discard(future: Future[Any]) -> None:
    """Shut down a pipeline built for nothing (done-callback of a prebuild)."""
    if not future.cancelled() and future.exception() is None:
        _shutdown(future.result())
