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

import numpy as np

from fastload.dali._augment import AugmentFn, ImageAugment, check_augment
from fastload.dali._backend import Device, local_rank, require_dali, resolve
from fastload.dali._native import NativePlan
from fastload.dali._source import BatchSource, FieldSpec
from fastload.errors import CorruptDataError, FastloadError, InvalidArgumentError, WorkerError
from fastload.formats import DAMAGED_SHARD_REMEDY
from fastload.loader import STATE_VERSION, Dataset, Partition, detect_rank_world, open_dataset
from fastload.loader._order import check_seed
from fastload.loader._stats import LoaderStats, check_pending_resume, parse_state_position
from fastload.storage import Store, open_store

__all__ = ["DALILoader"]

_READERS = ("auto", "external", "native")
_NATIVE_FORMATS = ("webdataset", "tfrecord")
_TAG_PIPELINE = 5  # SeedSequence domain tag for DALI pipeline seeds (see fastload.loader._order)


def _positive(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _with(dataset: Dataset, **changes: Any) -> Dataset:
    """A copy of ``dataset`` with attributes changed and its own (unopened) readers."""
    state = dataset.__getstate__()
    state.update(changes)
    copy = Dataset.__new__(Dataset)
    copy.__setstate__(state)
    return copy


def _cached(store: Store, cache_dir: str | os.PathLike[str], cache_bytes: int | str) -> Store:
    from fastload.storage._cache import CachingStore

    if store.has_local_paths or isinstance(store, CachingStore):
        return store
    return CachingStore(store, cache_dir, cache_bytes)


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
        rank: This rank (detected from ``torch.distributed`` / ``RANK`` when ``None``).
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
        cache_bytes: Byte budget of the cache (``"50GB"`` or an int).
        on_error: Corrupt samples when reading (external mode): ``"raise"``, ``"skip"`` or
            ``"warn"``; undecodable images always raise (DALI's decoders cannot skip).
        store_options: Options for :func:`fastload.open_store` when ``dataset`` is a URL.
        device_id: The GPU for ``device="gpu"``; default ``LOCAL_RANK`` or rank modulo GPUs.
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
        cache_bytes: int | str = "10GB",
        on_error: str = "raise",
        store_options: Mapping[str, Any] | None = None,
        device_id: int | None = None,
        prebuild: bool = True,
    ) -> None:
        require_dali()
        self.batch_size = _positive("batch_size", batch_size)
        self.num_threads = _positive("num_threads", num_threads)
        self.py_workers = _positive("py_workers", py_workers, 0)
        self.io_threads = _positive("io_threads", io_threads, 0)
        self.prefetch = _positive("prefetch", prefetch)
        self.initial_fill = _positive("initial_fill", initial_fill)
        if on_error not in ("raise", "skip", "warn"):
            raise InvalidArgumentError(
                f"on_error must be 'raise', 'skip' or 'warn', got {on_error!r}"
            )
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
        self.rank, self.world_size = detect_rank_world(rank, world_size)
        self.device_id: int | None = None
        if self.device == "gpu":
            self.device_id = device_id if device_id is not None else local_rank(self.rank)
        self.dataset = self._open(
            dataset, seed, shuffle, on_error, store_options, cache_dir, cache_bytes
        )
        self.reader = "external" if reader == "auto" else reader
        self._native_paths: tuple[list[str], list[str]] | None = None
        if self.reader == "native":
            self._check_native()
        self.partition = Partition(
            self.dataset.num_samples, self.world_size, self.batch_size, self.drop_last
        )
        self._epoch = 0
        self._step = 0
        self._resume: int | None = None
        self._iter_start = 0
        self._iterating = False
        self._stats = LoaderStats()
        self.prebuild = bool(prebuild)
        self._next: tuple[int, Future[Any]] | None = None  # (epoch, pipeline being built)
        self._builder: ThreadPoolExecutor | None = None

    # ---- construction helpers ---------------------------------------------------------------

    @staticmethod
    def _open(
        dataset: str | os.PathLike[str] | Store | Dataset,
        seed: int | None,
        shuffle: bool | None,
        on_error: str,
        store_options: Mapping[str, Any] | None,
        cache_dir: str | os.PathLike[str] | None,
        cache_bytes: int | str,
    ) -> Dataset:
        if isinstance(dataset, Dataset):
            if store_options:
                raise InvalidArgumentError(
                    "store_options apply only when dataset is a URL, not a Dataset"
                )
            changes: dict[str, Any] = {}
            if seed is not None and check_seed("seed", seed) != dataset.seed:
                changes["seed"] = seed
            if shuffle is not None and bool(shuffle) != dataset.shuffle:
                changes["shuffle"] = bool(shuffle)
            if on_error != dataset.on_error:
                changes["on_error"] = on_error
            if cache_dir is not None:
                cached = _cached(dataset.store, cache_dir, cache_bytes)
                if cached is not dataset.store:
                    changes["store"] = cached
            return _with(dataset, **changes) if changes else dataset
        store = (
            dataset
            if isinstance(dataset, Store)
            else open_store(dataset, **dict(store_options or {}))
        )
        if cache_dir is not None:
            store = _cached(store, cache_dir, cache_bytes)
        return open_dataset(
            store,
            shuffle=True if shuffle is None else bool(shuffle),
            seed=0 if seed is None else seed,
            on_error=on_error,
        )

    def _check_native(self) -> None:
        ds = self.dataset
        if ds.format_name not in _NATIVE_FORMATS:
            raise InvalidArgumentError(
                f"reader='native' reads {' and '.join(_NATIVE_FORMATS)} shards with DALI's own "
                f"readers; {ds.url} is {ds.format_name!r} (DALI has no reader for fastload's "
                "layout): use reader='external'"
            )
        for shard, key in enumerate(ds.shard_keys):
            if ds.index_keys[shard] is None:
                raise InvalidArgumentError(
                    f"reader='native' needs DALI index files, but shard {ds.shard_url(shard)} has "
                    f"none; build them with `fastload index {ds.url}` or use reader='external'"
                )
            if ds.format_name == "tfrecord" and not key.endswith((".tfrecord", ".tfrecords")):
                raise InvalidArgumentError(
                    f"DALI's TFRecord reader reads uncompressed shards only; {ds.shard_url(shard)} "
                    "is compressed: use reader='external'"
                )
        from fastload.storage._cache import CachingStore

        if not ds.store.has_local_paths and not isinstance(ds.store, CachingStore):
            raise InvalidArgumentError(
                f"reader='native' needs local files, but {ds.url} is remote: pass cache_dir= "
                "(shards are downloaded into it) or use reader='external'"
            )
        if self.on_error_policy != "raise":
            raise InvalidArgumentError(
                "on_error='skip'/'warn' needs reader='external' (DALI's readers cannot skip)"
            )

    @property
    def on_error_policy(self) -> str:
        """The dataset's corrupt-sample policy."""
        return str(self.dataset.on_error)

    def _local_paths(self) -> tuple[list[str], list[str]]:
        if self._native_paths is None:
            ds = self.dataset
            paths: list[str] = []
            indexes: list[str] = []
            for shard, key in enumerate(ds.shard_keys):
                if ds.shard_sizes[shard] == 0:
                    continue  # DALI rejects index files of zero samples
                index_key = ds.index_keys[shard]
                assert index_key is not None  # checked in _check_native
                self._check_native_shard(shard, key, index_key)
                for k, out in ((key, paths), (index_key, indexes)):
                    path = ds.store.local_path(k)
                    if path is None:
                        raise InvalidArgumentError(
                            f"{ds.store.child_url(k)} has no local path; pass cache_dir= or use "
                            "reader='external'"
                        )
                    out.append(path)
            self._native_paths = paths, indexes
        return self._native_paths

    def _check_native_shard(self, shard: int, key: str, index_key: str) -> None:
        """Check a shard and its index as fastload's readers do before DALI reads them: DALI trusts
        both, so a truncated shard or a damaged index would give wrong samples (or a crash)
        instead of an error. Raises :class:`~fastload.errors.CorruptDataError` naming the file."""
        ds = self.dataset
        entry = ds.manifest.shards[shard]
        size = ds.store.size(key)
        if size != entry.num_bytes:
            raise CorruptDataError(
                f"shard has {size} bytes, the dataset manifest says {entry.num_bytes}; DALI's "
                f"reader cannot read it safely (run `fastload verify {ds.url}`)"
                f"{DAMAGED_SHARD_REMEDY}",
                url=ds.shard_url(shard),
            )
        reader = ds.format.reader(
            ds.store,
            key,
            index_key=index_key,
            num_samples=entry.num_samples,
            num_bytes=entry.num_bytes,
        )
        try:
            len(reader)  # parses the index and checks it against the shard and the manifest
        finally:
            reader.close()

    # ---- epochs and state -------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch the loader iterates (set with :meth:`set_epoch`)."""
        return self._epoch

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
            self._epoch if epoch is None else epoch,
            self.drop_last,
        )

    def _num_steps(self) -> int:
        if self.reader == "native":
            return self.native_plan().num_steps
        return self.partition.num_steps

    def set_epoch(self, epoch: int, *, discard_resume: bool = False) -> None:
        """Iterate epoch ``epoch`` next (changes the order and the augmentation draws).

        After :meth:`load_state_dict`, ``set_epoch`` with the saved epoch keeps the resume point.
        Another epoch while a mid-epoch resume is pending raises, as in
        :meth:`fastload.DataLoader.set_epoch`, unless ``discard_resume=True``.

        Raises:
            InvalidArgumentError: The call would silently drop a pending mid-epoch resume.
        """
        check_seed("epoch", epoch)
        if epoch == self._epoch and self._resume is not None:
            return
        if not discard_resume:
            check_pending_resume(
                epoch,
                pending_epoch=self._epoch,
                pending_step=self._resume,
                total_steps=self._num_steps(),
            )
        self._epoch, self._step, self._resume = epoch, 0, None

    def __len__(self) -> int:
        start = self._iter_start if self._iterating else (self._resume or 0)
        return max(0, self._num_steps() - start)

    def state_dict(self) -> dict[str, Any]:
        """The resumable position (O(1)): epoch and global steps handed to the training loop.

        In external mode the layout is :class:`fastload.DataLoader`'s, and either loader can
        resume from the other's state.
        """
        state: dict[str, Any] = {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "step": self._step,
            "global_batch_size": self.partition.global_batch_size,
            "num_samples": self.partition.num_samples,
            "world_size": self.world_size,
            "drop_last": self.drop_last,
            **self.dataset.order_options(),
        }
        if self.reader == "native":
            state["reader"] = "native"
            state["initial_fill"] = self.initial_fill
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict` or :class:`fastload.DataLoader`).

        External mode: the world size may differ when the global batch size is the same. Native
        mode: the world size, batch size and shuffle buffer must be the same.

        Raises:
            InvalidArgumentError: The state belongs to another dataset, order, global batch size
                or reader mode; the message says which.
        """
        epoch, step, saved_g = parse_state_position(state, version=STATE_VERSION, what="DALILoader")
        saved_reader = state.get("reader", "external")
        if saved_reader != self.reader:
            raise InvalidArgumentError(
                f"the state was saved by a loader with reader={saved_reader!r}, this one has "
                f"reader={self.reader!r}; their orders differ, so it cannot resume exactly"
            )
        g = self.partition.global_batch_size
        if saved_g != g:
            raise InvalidArgumentError(
                f"the state was saved with a global batch size of {saved_g} (batch_size x "
                f"world_size), this loader has {self.batch_size} x {self.world_size} = {g}; "
                "resuming exactly needs the same global batch size"
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
        if state.get("num_samples") != self.partition.num_samples:
            raise InvalidArgumentError(
                f"the state is for a dataset of {state.get('num_samples')} samples, but "
                f"{self.dataset.url} has {self.partition.num_samples}; resume on the same dataset"
            )
        for name, value in self.dataset.order_options().items():
            if name in state and state[name] != value:
                raise InvalidArgumentError(
                    f"the state was saved with {name}={state[name]!r} but this loader has "
                    f"{name}={value!r}; use the same order options to resume"
                )
        self._epoch, self._step, self._resume = epoch, step, step

    # ---- pipelines --------------------------------------------------------------------------

    def _pipeline_seed(self, epoch: int) -> int:
        state = np.random.SeedSequence([self.dataset.seed, epoch, _TAG_PIPELINE]).generate_state(1)
        return int(state[0]) & 0x7FFFFFFF

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
            seed=self._pipeline_seed(epoch),
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
                images, labels = self._native_reader(fn, types, epoch)
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

    def _native_reader(self, fn: Any, types: Any, epoch: int) -> tuple[Any, Any]:
        paths, indexes = self._local_paths()
        plan = self.native_plan(epoch)
        common: dict[str, Any] = {
            **plan.options(),
            "random_shuffle": self.dataset.shuffle,
            "initial_fill": self.initial_fill,
            "seed": self._pipeline_seed(epoch),
            "name": "Reader",
        }
        if self.dataset.format_name == "webdataset":
            images, labels = fn.readers.webdataset(
                paths=paths,
                index_paths=indexes,
                ext=[";".join(self.fields.image), ";".join(self.fields.label)],
                missing_component_behavior="error",
                **common,
            )
            return images, labels
        schema = self.dataset.manifest.schema
        image = next((f for f in self.fields.image if f in schema), self.fields.image[0])
        label = next((f for f in self.fields.label if f in schema), self.fields.label[0])
        tfrec = require_dali().tfrecord
        out = fn.readers.tfrecord(
            path=paths,
            index_path=indexes,
            features={
                image: tfrec.FixedLenFeature((), tfrec.string, ""),
                label: tfrec.FixedLenFeature([1], tfrec.int64, -1),
            },
            **common,
        )
        return out[image], out[label]

    # ---- iteration --------------------------------------------------------------------------

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        start = self._resume if self._resume is not None else 0
        self._resume = None
        self._step = start
        self._iter_start = start
        self._iterating = True
        return self._run(self._epoch, start)

    def _run(self, epoch: int, start: int) -> Iterator[tuple[Any, ...]]:
        stats = self._stats
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
                batch, size, padded, nbytes = self._convert(outputs, step, plan)
                now = time.perf_counter()
                stats.stall += now - t0
                skipped = 0
                if plan is None:
                    lo, hi = self.partition.rank_range(step, self.rank)
                    skipped = (hi - lo) - size
                stats.add(size=size, nbytes=nbytes, padded=padded, skipped=skipped)
                stats.elapsed += now - began
                began = now
                if self._epoch == epoch:
                    self._step = step + 1
                yield batch
        finally:
            self._iterating = False
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
        state["_iterating"] = False
        return state

    def _convert(
        self, outputs: Sequence[Any], step: int, plan: NativePlan | None
    ) -> tuple[tuple[Any, ...], int, int, int]:
        """Torch tensors of one batch, and its (size, padded rows, bytes)."""
        *data, meta = outputs
        metas = _to_numpy(meta)
        if plan is None:
            rows = len(metas)
            keep: int | None = None
            padded = int(metas[:, 2].sum()) if rows else 0
            nbytes = int(metas[:, 1].sum()) if rows else 0
        else:
            keep, padded = plan.kept_rows(step)
            rows = keep
            nbytes = int(metas[:keep].sum())
        converted = []
        for position, tl in enumerate(data):
            value = self._to_torch(tl, label=position == 1)
            if keep is not None:
                value = value[:keep]
            converted.append(value)
        return tuple(converted), rows, padded, nbytes

    def _to_torch(self, tl: Any, *, label: bool) -> Any:
        import torch

        if self.device == "gpu" and _on_gpu(tl):
            return _gpu_tensor(tl, self.device_id or 0)
        if tl.is_dense_tensor():
            arr = np.array(tl.as_tensor())
        else:
            items = [np.array(tl[i]) for i in range(len(tl))]
            if not label:
                return [torch.from_numpy(a) for a in items]
            arr = np.array([_parse_label(a) for a in items], dtype=np.int64)
        if label and arr.dtype == np.uint8:  # native webdataset: the label field's ASCII bytes
            arr = np.array([_parse_label(a) for a in arr], dtype=np.int64)
        if label and arr.ndim == 2 and arr.shape[1] == 1:
            arr = arr.reshape(-1)
        tensor = torch.from_numpy(arr)
        if label and self.device == "gpu":
            tensor = tensor.to(f"cuda:{self.device_id or 0}", non_blocking=True)
        return tensor

    # ---- statistics -------------------------------------------------------------------------

    def stats(self) -> dict[str, float | int]:
        """Counters since the loader was made (or :meth:`reset_stats`); the keys and meanings of
        :meth:`fastload.DataLoader.stats` (``bytes`` counts the image field only in native
        mode; ``data_stall_s`` is the time spent waiting for DALI's next batch)."""
        dropped = self.native_plan().dropped if self.reader == "native" else self.partition.dropped
        return self._stats.report(dropped_per_epoch=dropped, epoch=self._epoch, step=self._step)

    def reset_stats(self) -> None:
        """Zero the counters of :meth:`stats`."""
        self._stats = LoaderStats()

    def __repr__(self) -> str:
        return (
            f"fastload.dali.DALILoader({self.dataset!r}, batch_size={self.batch_size}, "
            f"device={self.device!r}, reader={self.reader!r}, rank={self.rank}, "
            f"world_size={self.world_size}, drop_last={self.drop_last}, epoch={self._epoch}, "
            f"step={self._step})"
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


def _on_gpu(tl: Any) -> bool:
    backend: Any = require_dali().backend
    return isinstance(tl, backend.TensorListGPU)


def _to_numpy(tl: Any) -> Any:
    if _on_gpu(tl):
        tl = tl.as_cpu()
    if len(tl) == 0:
        return np.zeros((0, 3), dtype=np.int64)
    return np.array(tl.as_tensor())


def _parse_label(data: Any) -> int:
    text = bytes(np.asarray(data, dtype=np.uint8)).decode("ascii", "replace").strip()
    try:
        return int(text)
    except ValueError:
        raise WorkerError(
            f"label bytes {text!r} are not an integer; DALI pipelines take integer labels (cls)"
        ) from None


def _gpu_tensor(tl: Any, device_index: int) -> Any:
    import importlib

    import torch

    plugin: Any = importlib.import_module("nvidia.dali.plugin.pytorch")
    feed_ndarray, to_torch_type = plugin.feed_ndarray, plugin.to_torch_type

    if not tl.is_dense_tensor():
        raise WorkerError(
            "a GPU output of the augmentation has samples of different shapes; resize or crop "
            "to a fixed size so the batch is one tensor"
        )
    tensor = tl.as_tensor()
    device = torch.device("cuda", device_index)
    out = torch.empty(tensor.shape(), dtype=to_torch_type[tl.dtype], device=device)
    stream = torch.cuda.current_stream(device)
    feed_ndarray(tl, out, cuda_stream=stream)
    return out
