"""A dataset opened from its manifest: the map-style and iterable forms of its samples.

:class:`Dataset` is a map-style ``torch.utils.data.Dataset`` (``ds[i]`` is sample ``i`` in dataset
order, i.e. shard by shard as the manifest lists them). :meth:`Dataset.batches` gives the iterable
form (whole collated batches, partitioned across ranks and workers); :class:`fastload.DataLoader`
drives that form and adds epochs, resumption and statistics. What a dataset knows about its
shards and samples is :class:`~fastload.loader._shards.ShardedDataset`'s; open one with
:func:`~fastload.loader.open_dataset`.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch.utils.data

from fastload.errors import InvalidArgumentError
from fastload.loader._shards import NOT_DATA_ERRORS, ShardedDataset

__all__ = ["Dataset"]

log = logging.getLogger("fastload.loader")


class Dataset(ShardedDataset, torch.utils.data.Dataset[Any]):
    """A fastload dataset: shards listed by a manifest, read through shard readers.

    Create it with :func:`open_dataset`. ``len(ds)`` is the number of samples; ``ds[i]`` reads,
    decodes and transforms sample ``i`` in dataset order (random access through the shard index).
    Under ``on_error="skip"``/``"warn"``, ``ds[i]`` returns ``None`` for a corrupt sample (use
    :func:`fastload.loader.default_collate`-compatible handling, or prefer :class:`fastload.DataLoader`
    which drops it from the batch and counts it).

    ``ds[i]`` does not add the ``"__rng_seed__"`` entry (it knows no epoch), so seeded random
    transforms draw fresh randomness there; the iterable form and :class:`fastload.DataLoader`
    seed every sample from (seed, epoch, index).

    Pickling, thread safety and caching are :class:`~fastload.loader._shards.ShardedDataset`'s:
    a dataset pickles by configuration (readers reopen in each process), reads safely from several
    threads, and with ``cache_dir=`` reads local copies that the iterable form prefetches.
    """

    def __getitem__(self, index: int) -> Any:
        """Sample ``index`` in dataset order, decoded and transformed (``None`` if skipped, or
        rejected by the dataset's ``filter``)."""
        if isinstance(index, bool) or not isinstance(index, int | np.integer):
            raise InvalidArgumentError(f"dataset index must be an int, got {index!r}")
        i = int(index)
        if i < 0:
            i += self.num_samples
        if not 0 <= i < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        shard, pos = (int(x) for x in self.locate(i))
        raw = self.read_raw(shard, pos)
        if raw is None or not self.keep_raw(raw):
            return None
        try:
            decoded = self.decode_raw(raw)
        except Exception as exc:
            if self.on_error == "raise" or isinstance(exc, NOT_DATA_ERRORS):
                exc.add_note(
                    f"while decoding sample {raw.get('__key__')!r} of {self.shard_url(shard)}"
                )
                raise
            log.debug("skipping undecodable sample %r: %s", raw.get("__key__"), exc)
            return None
        return self.finish(decoded) if self.keep(decoded) else None
