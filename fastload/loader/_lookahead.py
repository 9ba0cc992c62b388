"""Prefetch into a cache: keep a caching store fetching the next shards a worker will read.

When the dataset's store can prefetch (a :class:`~fastload.storage.CachingStore`), each worker asks
it to download, in the background, the next ``dataset.prefetch_shards`` shards that its own coming
batches will read first, in the order they will be read, and a worker requests each shard at most
once per epoch.

The shards a batch reads are requested too when its reads are submitted, all but the first (the
reads start with that one, and fill it themselves): a batch's reads walk its shards one after the
other, and where a batch spans many shards (the block shuffle's first batch of a cold cache reads
from every shard of its window) the prefetch threads download the later ones in parallel with
that walk instead of leaving one download at a time. They are not counted in
``prefetch_shards`` (the batch needs them now). The cache's prefetch skips an object another
thread or process is already filling, so the reads and the prefetch threads of all workers spread
over different shards.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import numpy.typing as npt

from fastload.loader._shards import ShardedDataset

__all__ = ["ShardLookahead"]

log = logging.getLogger("fastload.loader")


class ShardLookahead:
    """Keeps a caching store fetching the next shards one worker's batches will read first.

    Walks the worker's steps in order (``shards_of(step)``: the shards a step's batch reads, pure
    arithmetic) and records, for every shard, the first of the worker's batches that reads it.
    :meth:`advance` is called with the number of the batch whose reads are submitted next; it
    requests (in first-read order) the shards that batch reads first, except the one its reads
    start with, then the shards first read by later batches until ``depth`` of those are
    requested and not yet reached.
    """

    def __init__(
        self,
        dataset: ShardedDataset,
        steps: Sequence[int],
        shards_of: Callable[[int], npt.NDArray[np.int64]],
        depth: int,
        prefetch: Callable[[list[str]], None],
    ) -> None:
        self._dataset, self._steps, self._shards_of = dataset, steps, shards_of
        self._depth, self._prefetch = depth, prefetch
        self._touches = self._first_touches()
        self._next: tuple[int, int, bool] | None = None
        self._requested: deque[int] = deque()  # batch numbers of requested, unreached shards

    @classmethod
    def create(
        cls,
        dataset: ShardedDataset,
        steps: Sequence[int],
        shards_of: Callable[[int], npt.NDArray[np.int64]],
    ) -> ShardLookahead | None:
        """A lookahead when the dataset's store can prefetch and ``prefetch_shards > 0``."""
        depth = dataset.prefetch_shards
        if not dataset.store.supports_prefetch or depth <= 0:
            return None
        return cls(dataset, steps, shards_of, depth, dataset.store.prefetch)

    def _first_touches(self) -> Iterator[tuple[int, int, bool]]:
        """(worker batch number, shard, whether the batch's reads start with it) for each shard
        the first time the worker's batches read it (a batch reads its shards in ascending
        order: :meth:`~fastload.loader._reads.BatchReads.submit`)."""
        seen: set[int] = set()
        for j, step in enumerate(self._steps):
            shards = np.unique(self._shards_of(int(step))).tolist()
            for shard in shards:
                if shard not in seen:
                    seen.add(shard)
                    yield j, shard, shard == shards[0]

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
            j, shard, first = self._next
            if j > batch and len(self._requested) >= self._depth:
                break
            self._next = None
            if j > batch:
                self._requested.append(j)
                keys.extend(self._dataset.shard_objects(shard))
            elif not first:  # read by this batch after others: download it meanwhile
                keys.extend(self._dataset.shard_objects(shard))
        if keys:
            try:
                self._prefetch(keys)
            except Exception as exc:  # prefetching is an optimisation; reads report errors
                log.debug("prefetch of %s failed: %s", keys, exc)
