"""The counters behind the loaders' ``stats()``: one definition, so every loader reports the same
keys (kept by :class:`~fastload.loader.order._cursor.EpochCursor`)."""

from __future__ import annotations

__all__ = ["LoaderStats"]


class LoaderStats:
    """Counters of one loader since it was made or reset (main process only, one thread)."""

    __slots__ = (
        "batches", "elapsed", "filtered", "nbytes", "padded", "samples", "skipped", "stages",
        "stall",
    )  # fmt: skip

    #: The ``stats()`` keys of the workers' stages, in :attr:`BatchMeta.stages` order.
    STAGES = ("read_s", "decode_s", "transform_s", "collate_s")

    def __init__(self) -> None:
        self.batches = self.samples = self.nbytes = self.padded = self.skipped = 0
        self.filtered = 0
        self.elapsed = self.stall = 0.0
        self.stages = [0.0] * len(self.STAGES)

    def add(
        self,
        *,
        size: int,
        nbytes: int,
        padded: int,
        skipped: int,
        filtered: int = 0,
        stages: tuple[float, ...] = (),
    ) -> None:
        """Count one delivered batch (``stages``: its workers' seconds per stage, if known)."""
        self.batches += 1
        self.samples += size
        self.nbytes += nbytes
        self.padded += padded
        self.skipped += skipped
        self.filtered += filtered
        for i, seconds in enumerate(stages):
            self.stages[i] += seconds

    def report(self, *, dropped_per_epoch: int, epoch: int, step: int) -> dict[str, float | int]:
        """The ``stats()`` dictionary.

        Keys: ``batches``, ``samples`` (delivered), ``bytes`` (raw field bytes read),
        ``elapsed_s`` (wall time inside iterations), ``samples_per_s``, ``bytes_per_s``,
        ``data_stall_s`` (time the training loop waited for the next batch), ``padded`` (repeated
        samples delivered to even out ranks), ``skipped`` (corrupt samples dropped),
        ``filtered`` (samples the dataset's ``filter`` rejected), and where the workers' time
        went, summed over this rank's workers: ``read_s`` (waiting for reads the read-ahead did
        not hide: storage, cache fills), ``decode_s``, ``transform_s`` (``filter``,
        ``transform``, ``fields``), ``collate_s`` (0 for loaders that do not report them),
        ``dropped_per_epoch`` (samples ``drop_last`` leaves out of each epoch), ``epoch``, ``step``.

        A loader whose dataset reads through a cache (``cache_dir=``) adds the node's cache
        counters, summed over every process that used the cache directory (all ranks and workers
        of the node): ``node_cache_hits``, ``node_cache_misses``, ``node_cache_downloads``,
        ``node_cache_evictions``,
        ``node_cache_bytes_downloaded``, ``node_cache_bytes_read_through``,
        ``node_cache_prefetched``, ``node_cache_requests``, ``node_cache_disk_full_evictions``,
        ``node_cache_disk_full_uncached``, and what the retries below the cache had to do:
        ``node_cache_store_retries``, ``node_cache_store_resumed_reads``,
        ``node_cache_store_gave_up`` (see :meth:`fastload.storage.CachingStore.node_stats`).
        """
        rate = 1.0 / self.elapsed if self.elapsed > 0 else 0.0
        return {
            "batches": self.batches,
            "samples": self.samples,
            "bytes": self.nbytes,
            "elapsed_s": self.elapsed,
            "samples_per_s": self.samples * rate,
            "bytes_per_s": self.nbytes * rate,
            "data_stall_s": self.stall,
            "padded": self.padded,
            "skipped": self.skipped,
            "filtered": self.filtered,
            **dict(zip(self.STAGES, self.stages, strict=True)),
            "dropped_per_epoch": dropped_per_epoch,
            "epoch": epoch,
            "step": step,
        }
