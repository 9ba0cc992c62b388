"""What a worker reports with each batch of a :class:`~fastload.loader._stream.BatchStream`: the
batch's step and place, and its accounting (delivered, padded, skipped, filtered, bytes read)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BatchMeta"]


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
        filtered: Samples the dataset's ``filter`` rejected.
        nbytes: Bytes of the raw fields read for the batch.
        stages: Seconds the worker spent on the batch in each stage: waiting for its samples'
            reads (storage or cache; the reads run ahead in threads, so this is what they did not
            hide), decoding, transforming (``filter``, ``transform`` and ``fields``), collating.
        pooled: ``(inode, block, token)`` of the worker's reusable shared-memory blocks that the
            batch uses (see :class:`~fastload.loader._shm_pool.BufferPool`); empty without reuse.
        sources: For a mix (:func:`fastload.mix`), the batch's samples of each source (after
            skips); empty otherwise.
    """

    step: int
    rank: int
    worker: int
    size: int
    padded: int
    skipped: int
    nbytes: int
    filtered: int = 0
    stages: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    pooled: tuple[tuple[int, int, int], ...] = ()
    sources: tuple[int, ...] = ()
