"""``webdataset`` pipelines on a fastload source: keep the stages, gain exactly-once and resume.

A training script built on the ``webdataset`` library::

    ds = wds.WebDataset(urls).shuffle(1000).decode("pil").to_tuple("jpg", "cls").map(f).batched(64)
    loader = wds.WebLoader(ds, batch_size=None, num_workers=8)

runs on a fastload dataset with its stages unchanged::

    import fastload.wds

    ds = fastload.wds.WebDataset(url).decode("pil").to_tuple("jpg", "cls").map(f).batched(64)
    loader = fastload.wds.WebLoader(ds, num_workers=8)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for images, labels in loader: ...
    state = loader.state_dict()  # and later loader.load_state_dict(state)

``url`` is a dataset root (with a ``fastload.json``), or the very shard URLs ``wds`` took
(``"s3://b/train-{000000..000999}.tar"``), indexed on the fly (see
:func:`fastload.open_dataset`). Drop the ``.shuffle(n)`` stage (fastload shuffles the epoch order;
the stage still works but only reorders within a batch) and any ``.with_epoch(n)``.

* :class:`WebDataset`: a ``wds.DataPipeline`` with webdataset's ``FluidInterface`` stages whose
  source is a fastload dataset's epoch order for this rank and DataLoader worker.
* :class:`WebLoader`: runs it in ``torch.utils.data.DataLoader`` workers, resumably.

How it stays exactly-once and resumable: the epoch's order (a pure function of seed and epoch) is
cut into global steps of ``batch_size x world_size`` samples, as in :class:`fastload.DataLoader`;
each rank takes its ``batch_size`` samples of a step (a *chunk*), and each step goes to one
worker. The stages run on **each chunk on its own**: a ``.batched(batch_size)`` stage makes
exactly one batch of it, a ``.shuffle(n)`` stage only reorders inside it, and nothing a stage
buffers crosses a chunk boundary. Under :class:`WebLoader` each worker sends one message per chunk,
in step order, so the order of outputs does not depend on the number of workers, and a position is
``(epoch, step, outputs of that step already delivered)``.

Needs the ``webdataset`` library (``pip install 'fastload[wds]'``); without it, importing this
module raises :class:`~fastload.errors.MissingDependencyError` saying so. Nothing else in fastload
imports ``webdataset``: :class:`fastload.loader.decode.Decoder` decodes webdataset's field
extensions with fastload's own decoders.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator, Sequence
from itertools import islice
from typing import Any, cast

import torch
import torch.utils.data

from fastload._plugins import missing_dependency
from fastload._units import check_int
from fastload.errors import InvalidArgumentError, WorkerError
from fastload.loader import (
    STATE_VERSION,
    BatchStream,
    Dataset,
    EpochCursor,
    Partition,
    check_seed,
    detect_rank_world,
    open_dataset,
)

try:  # the one module of fastload that imports webdataset (tests/test_structure.py keeps it so)
    from webdataset import filters
    from webdataset.compat import FluidInterface
    from webdataset.pipeline import DataPipeline
except ImportError as exc:
    raise missing_dependency("webdataset", extra="wds", feature="fastload.wds") from exc

__all__ = ["STATE_VERSION", "WebDataset", "WebLoader"]

#: What a :class:`WebLoader` state says it is (its steps count outputs of the pipeline, not
#: batches of a :class:`fastload.DataLoader`).
_KIND = "fastload.wds.WebLoader"


def _as_list(samples: list[Any]) -> list[Any]:
    return list(samples)


class _Source:
    """Stage 0 of a :class:`WebDataset` (for display): the raw samples of this rank and worker."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __repr__(self) -> str:
        return f"fastload source: {self.dataset!r}"


class WebDataset(DataPipeline, FluidInterface):  # type: ignore[misc]
    """A ``webdataset`` pipeline on a fastload dataset: keep your stages, gain exactly-once.

    ``fastload.wds.WebDataset(url).decode("pil").to_tuple("jpg", "cls").map(f).batched(64)``
    builds the same pipeline as ``wds.WebDataset(urls)...``, but its samples come from a fastload
    dataset: every sample once per epoch over all ranks and DataLoader workers, in fastload's
    seeded shuffle order, with ``set_epoch``. Iterate it directly, with
    ``torch.utils.data.DataLoader(pipeline, batch_size=None, num_workers=...)`` or
    ``wds.WebLoader``; for resumption use :class:`WebLoader`.

    Raw samples are ``{"__key__", "__url__", "__index__", field: bytes}``, as webdataset's own
    source gives them (``__url__`` is the shard's URL; there is no ``__local_path__``).

    Args:
        source: A dataset root with a ``fastload.json``, a brace pattern or list of shard URLs
            (see :func:`fastload.open_dataset`), or an open :class:`~fastload.loader.Dataset` (then the
            dataset's own shuffle/seed/decode options apply and ``open_options`` must be empty).
        batch_size: Samples per chunk: the stages run on each chunk of ``batch_size`` samples on
            its own (see the module docstring). Default: the size of the first ``.batched(n)`` or
            ``.listed(n)`` stage, else 64. A ``.batched(n)`` with ``n > batch_size`` is refused (its
            batches could never be full).
        shuffle: Shuffle the epoch order (fastload's block shuffle; a ``.shuffle()`` stage is not
            needed and only reorders within a chunk).
        seed: Seed of the order.
        drop_last: Drop the incomplete last global step (as :class:`fastload.DataLoader`); by
            default it is split evenly over the ranks, padded with at most ``world_size - 1``
            repeated samples so every rank yields as many chunks.
        epoch: The first epoch (change it with :meth:`set_epoch`).
        rank: This rank; detected (``torch.distributed``, the launcher's variables, see
            :func:`~fastload.loader.detect_launch`) when ``None``.
        world_size: Number of ranks; detected when ``None``.
        open_options: Passed to :func:`~fastload.loader.open_dataset` (``on_error``,
            ``store_options``, ``cache_dir``, ``block_size``, ...).

    ``.with_epoch()`` and ``.repeat()`` are refused: an epoch here is every sample once, and every
    rank yields the same number of chunks without them.
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | Sequence[str] | Dataset,
        *,
        batch_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        epoch: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        **open_options: Any,
    ) -> None:
        super().__init__()
        if isinstance(source, Dataset):
            if open_options:
                raise InvalidArgumentError(
                    f"options {sorted(open_options)} apply when the source is a URL; a Dataset "
                    "keeps its own"
                )
            dataset = source
        else:
            dataset = open_dataset(source, shuffle=shuffle, seed=seed, **open_options)
        self.dataset = dataset
        self.batch_size = (
            None if batch_size is None else check_int("batch_size", batch_size, minimum=1)
        )
        self.drop_last = bool(drop_last)
        self.rank, self.world_size = detect_rank_world(rank, world_size)
        # [epoch, start step, outputs of the start step to skip], shared with the workers.
        self._control = torch.zeros(3, dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]
        self._tagged = False  # under WebLoader: one (step, outputs) item per chunk
        self.set_epoch(epoch)
        self.pipeline.append(_Source(dataset))

    # ---- configuration -------------------------------------------------------------------------

    @property
    def chunk_size(self) -> int:
        """Samples per chunk (``batch_size``, or the default of 64)."""
        return self.batch_size if self.batch_size is not None else 64

    def set_epoch(self, epoch: int, start_step: int = 0, skip_outputs: int = 0) -> None:
        """Iterate epoch ``epoch`` next, from global step ``start_step`` on, leaving out the first
        ``skip_outputs`` outputs of that step (what :class:`WebLoader` resumes with). Reaches
        persistent DataLoader workers."""
        check_seed("epoch", epoch)
        check_int("start_step", start_step)
        check_int("skip_outputs", skip_outputs)
        self._control[0], self._control[1], self._control[2] = epoch, start_step, skip_outputs

    @property
    def epoch(self) -> int:
        """The epoch the next iteration yields."""
        return int(self._control[0])

    def batched(
        self,
        batchsize: int,
        collation_fn: Any = filters.default_collation_fn,
        partial: bool = True,
    ) -> WebDataset:
        """webdataset's ``batched`` stage; the first one also sets the chunk size."""
        stage = filters.batched(batchsize, collation_fn=collation_fn, partial=partial)
        return cast(WebDataset, self._batching(batchsize).compose(stage))

    def listed(self, batchsize: int, partial: bool = True) -> WebDataset:
        """webdataset's ``listed`` stage; the first one also sets the chunk size."""
        stage = filters.batched(batchsize=batchsize, collation_fn=None, partial=partial)
        return cast(WebDataset, self._batching(batchsize).compose(stage))

    def _batching(self, batchsize: int) -> WebDataset:
        size = check_int("batchsize", batchsize, minimum=1)
        result = copy.copy(self)
        if result.batch_size is None:
            result.batch_size = size
        elif size > result.batch_size:
            raise InvalidArgumentError(
                f"batched({size}) on a fastload WebDataset with batch_size={result.batch_size}: "
                f"the stages run on chunks of {result.batch_size} samples, so no batch could "
                f"hold {size}; pass batch_size={size} (or leave it unset)"
            )
        return result

    def with_epoch(self, nsamples: int = -1, nbatches: int = -1) -> WebDataset:
        """Refused: see the class docstring."""
        raise InvalidArgumentError(
            "with_epoch() is not needed on a fastload WebDataset: an epoch delivers every sample "
            "once over all ranks and workers, and every rank yields the same number of batches; "
            "remove it and call set_epoch(epoch) before each epoch"
        )

    def repeat(self, nepochs: int = -1, nbatches: int = -1) -> WebDataset:
        """Refused: see the class docstring."""
        raise InvalidArgumentError(
            "repeat() is not supported on a fastload WebDataset: iterate once per epoch and call "
            "set_epoch(epoch) in between, so each epoch gets its own order"
        )

    # ---- iteration -----------------------------------------------------------------------------

    @property
    def partition(self) -> Partition:
        """How an epoch is cut into global steps of ``chunk_size x world_size`` samples."""
        return Partition(self.dataset.num_samples, self.world_size, self.chunk_size, self.drop_last)

    def _stream(self) -> BatchStream:
        return BatchStream(
            self.dataset,
            self.chunk_size,
            drop_last=self.drop_last,
            collate_fn=_as_list,
            rank=self.rank,
            world_size=self.world_size,
            with_meta=True,
        )

    def iterator1(self) -> Iterator[Any]:
        """One epoch of this rank and worker: the stages run on each chunk on its own."""
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch, start, skip = (int(x) for x in self._control.tolist())
        stages = self.pipeline[1:]
        chunks = self._stream().generate(
            worker=worker,
            num_workers=num_workers,
            epoch=epoch,
            start_step=start,
            seed_rngs=info is not None,
        )
        for meta, samples in chunks:
            out: Any = iter(samples)
            for stage in stages:
                out = self.invoke(stage, out)
            if skip and meta.step == start:
                out = islice(out, skip, None)
            if self._tagged:
                yield (meta.step, list(out))
            else:
                yield from out

    def iterator(self) -> Iterator[Any]:
        return self.iterator1()

    def __iter__(self) -> Iterator[Any]:
        return self.iterator1()

    def __repr__(self) -> str:
        return (
            f"fastload.wds.WebDataset({self.dataset.url!r}, batch_size={self.batch_size}, "
            f"stages={len(self.pipeline) - 1}, rank={self.rank}, world_size={self.world_size})"
        )


class WebLoader:
    """Runs a :class:`WebDataset` in ``torch.utils.data.DataLoader`` workers, resumably.

    Iterating yields the pipeline's outputs (usually the batches of its ``.batched(n)`` stage), in
    an order that does not depend on ``num_workers``. :meth:`state_dict` is the position (epoch,
    global step, outputs of that step already yielded); :meth:`load_state_dict` continues from it,
    also with another number of workers, so that every sample is delivered once per epoch across
    the interruption. It needs the same dataset, order options, ``batch_size`` and world size, and
    stages that give the same outputs for the same chunk (deterministic stages; randomness drawn
    from Python's ``random``, NumPy's or torch's global generators is reseeded per chunk from
    (seed, epoch, step, rank) in the workers).

    Args:
        pipeline: The :class:`WebDataset` with its stages.
        dataloader_options: ``torch.utils.data.DataLoader`` options (``num_workers``,
            ``pin_memory``, ``persistent_workers``, ``collate_fn``, ...). ``batch_size`` must
            stay unset: batching is the pipeline's. As with ``wds.WebLoader``, torch's default
            conversion turns NumPy arrays in the outputs into tensors.
    """

    def __init__(self, pipeline: WebDataset, **dataloader_options: Any) -> None:
        if not isinstance(pipeline, WebDataset):
            raise InvalidArgumentError(
                f"WebLoader needs a fastload.wds.WebDataset pipeline, got {type(pipeline).__name__}"
            )
        if dataloader_options.get("batch_size") is not None:
            raise InvalidArgumentError(
                "do not pass batch_size to WebLoader: batch in the pipeline with .batched(n)"
            )
        dataloader_options.pop("batch_size", None)
        tagged = copy.copy(pipeline)
        tagged._tagged = True
        self.pipeline = tagged
        self._options = dataloader_options
        self._cursor = EpochCursor(pipeline.dataset, pipeline.partition, what="WebLoader")
        self._cursor.set_epoch(pipeline.epoch)

    @property
    def epoch(self) -> int:
        """The epoch the next iteration yields."""
        return self._cursor.epoch

    def set_epoch(self, epoch: int, *, discard_resume: bool = False) -> None:
        """Iterate epoch ``epoch`` next (as :meth:`fastload.DataLoader.set_epoch`: a pending resume
        of that epoch is kept; one into the middle of another epoch is refused unless
        ``discard_resume``)."""
        self._cursor.set_epoch(epoch, discard_resume=discard_resume)

    def state_dict(self) -> dict[str, Any]:
        """The position: O(1), taken in the main process. An output counts once it is yielded.

        The keys of :class:`fastload.DataLoader`'s state (:mod:`fastload.loader.order._cursor`; ``step``
        is the global step in progress), plus ``kind``, ``outputs`` (outputs of ``step`` already
        yielded) and ``batch_size``.
        """
        p = self.pipeline
        return {
            **self._cursor.state_dict(),
            "kind": _KIND,
            "outputs": self._cursor.outputs,
            "batch_size": p.chunk_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`).

        Raises:
            InvalidArgumentError: The state is from another dataset, order, batch size or world
                size, or is not a WebLoader state; the message says which.
        """
        p = self.pipeline
        outputs = state.get("outputs", 0) if isinstance(state, dict) else 0

        def check(state: dict[str, Any]) -> None:
            if state.get("kind") != _KIND:
                raise InvalidArgumentError(
                    "not a fastload.wds.WebLoader state dict (a fastload.DataLoader state counts "
                    "batches of another pipeline); resume with the loader that saved it"
                )
            # The stages run on chunks of batch_size samples: another chunking (even with the
            # same global batch) would give other outputs.
            mine = {
                "batch_size": p.chunk_size,
                "world_size": p.world_size,
                "drop_last": p.drop_last,
            }
            for name, value in mine.items():
                if state.get(name) != value:
                    raise InvalidArgumentError(
                        f"the state was saved with {name}={state.get(name)!r}, but this loader "
                        f"has {name}={value!r}; resume with the same dataset, order options, "
                        "batch_size and world size"
                    )
            if isinstance(outputs, bool) or not isinstance(outputs, int) or outputs < 0:
                raise InvalidArgumentError(f"malformed WebLoader state: outputs={outputs!r}")

        self._cursor.load_state_dict(state, extra_check=check, outputs=outputs)

    def __iter__(self) -> Iterator[Any]:
        epoch, start, skip = self._cursor.begin()
        self.pipeline.set_epoch(epoch, start, skip)
        loader: torch.utils.data.DataLoader[Any] = torch.utils.data.DataLoader(
            self.pipeline, batch_size=None, **self._options
        )
        return self._run(loader, epoch, start, skip)

    def _run(
        self, loader: torch.utils.data.DataLoader[Any], epoch: int, start: int, skip: int
    ) -> Iterator[Any]:
        cursor = self._cursor
        expected = start
        try:
            for item in loader:
                step, outputs = item
                step = int(step)
                if step != expected:
                    raise WorkerError(
                        f"internal error: expected the outputs of global step {expected}, got "
                        f"step {step}; please report this"
                    )
                expected += 1
                done = skip if step == start else 0
                for output in outputs:
                    done += 1
                    cursor.reached(epoch, step, done)
                    yield output
                cursor.reached(epoch, step + 1)
        finally:
            cursor.end()

    def __repr__(self) -> str:
        return f"fastload.wds.WebLoader({self.pipeline!r}, {self._options})"
