"""DALI's native readers over local fastload shards, and what their sharding guarantees.

``fn.readers.webdataset`` and ``fn.readers.tfrecord`` read fastload shards directly, with the
``.idx`` files fastload writes (byte-identical to DALI's ``wds2idx``/``tfrecord2idx``). DALI
shards a dataset its own way, which cannot reproduce fastload's global order; this module holds
the arithmetic of DALI's sharding so the loader can give exact guarantees about it.

**DALI's sharding** (checked against DALI 2.4; tests in ``tests/dali/test_native.py``): the ``N``
samples, in manifest order, are cut into ``W`` contiguous slices; slice ``s`` is
``[floor(N s / W), floor(N (s+1) / W))``. With ``pad_last_batch=True`` every slice is padded, by
repeating its last sample, to ``ceil(ceil(N / W) / B)`` batches of ``B``, so every rank reads the
same number of batches. ``random_shuffle`` shuffles within a slice through a buffer of
``initial_fill`` samples.

**What fastload's native mode guarantees**: per epoch, rank ``r`` reads slice ``(r + epoch) mod
W`` (``stick_to_shard=True``, so the slices rotate with *our* epoch number, not with DALI's
internal counter), so every sample is delivered exactly once per epoch across ranks; every rank
yields :attr:`NativePlan.num_steps` batches; the padding rows are cut off (the last batch of a
rank may be smaller; a batch that would be padding only keeps one repeated row, counted in
``stats()["padded"]``). With ``drop_last`` every rank yields ``floor(floor(N / W) / B)`` full
batches and the rest of its slice is not delivered. The order within a slice is DALI's buffer
shuffle, a function of (seed, epoch) for a given batch size and ``initial_fill``.

**What it does not guarantee**: fastload's global order (samples never cross slices within an
epoch, so mixing is per slice); resumption with another world size; an O(1) resume (a resumed
epoch replays, and discards, the batches before the saved step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastload.dali._backend import require_dali
from fastload.dali._source import FieldSpec
from fastload.errors import CorruptDataError, InvalidArgumentError
from fastload.formats import DAMAGED_SHARD_REMEDY
from fastload.loader import Dataset

__all__ = ["NativePlan", "check_native", "check_shard", "local_paths", "native_reader"]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class NativePlan:
    """One rank's view of one epoch under DALI's reader sharding (see module doc).

    Attributes:
        num_samples: ``N``.
        world_size: ``W`` (DALI's ``num_shards``).
        batch_size: ``B``.
        rank: This rank.
        epoch: The epoch (selects the slice: ``(rank + epoch) mod W``).
        drop_last: Yield only full batches, the same number on every rank.
    """

    num_samples: int
    world_size: int
    batch_size: int
    rank: int
    epoch: int
    drop_last: bool = False

    def __post_init__(self) -> None:
        if self.num_samples < self.world_size:
            raise InvalidArgumentError(
                f"DALI's native readers need at least one sample per rank, but the dataset has "
                f"{self.num_samples} samples for {self.world_size} ranks; use reader='external'"
            )

    @property
    def shard_id(self) -> int:
        """DALI ``shard_id`` of this rank in this epoch."""
        return (self.rank + self.epoch) % self.world_size

    @property
    def slice(self) -> tuple[int, int]:
        """``[start, stop)`` of the samples (manifest order) this rank reads this epoch."""
        n, w, s = self.num_samples, self.world_size, self.shard_id
        return n * s // w, n * (s + 1) // w

    @property
    def slice_size(self) -> int:
        """Real (not padding) samples this rank reads this epoch."""
        start, stop = self.slice
        return stop - start

    @property
    def num_steps(self) -> int:
        """Batches every rank yields in the epoch."""
        if self.drop_last:
            return (self.num_samples // self.world_size) // self.batch_size
        return _ceil_div(_ceil_div(self.num_samples, self.world_size), self.batch_size)

    def real_rows(self, step: int) -> int:
        """Rows of DALI batch ``step`` that are real samples (the rest repeat the last one)."""
        if not 0 <= step < self.num_steps:
            raise InvalidArgumentError(f"step must be in [0, {self.num_steps}), got {step}")
        return max(0, min(self.batch_size, self.slice_size - step * self.batch_size))

    def kept_rows(self, step: int) -> tuple[int, int]:
        """``(rows to keep, of which padding)`` of batch ``step``: all real rows, or one padded
        row when the batch is padding only (so that no rank yields an empty batch)."""
        real = self.real_rows(step)
        return (real, 0) if real else (1, 1)

    @property
    def dropped(self) -> int:
        """Samples of the whole dataset not delivered in the epoch (``drop_last``)."""
        if not self.drop_last:
            return 0
        return self.num_samples - self.num_steps * self.batch_size * self.world_size

    def options(self) -> dict[str, Any]:
        """Sharding keyword arguments for a DALI reader."""
        return {
            "shard_id": self.shard_id,
            "num_shards": self.world_size,
            "pad_last_batch": True,
            "stick_to_shard": True,
        }


_NATIVE_FORMATS = ("webdataset", "tfrecord")


def check_native(dataset: Dataset) -> None:
    """Refuse, before any pipeline is built, a dataset DALI's readers cannot read exactly: another
    format, shards without indexes, compressed TFRecord shards, remote shards without a cache, or
    an ``on_error`` policy other than ``raise`` (DALI's readers cannot skip).

    Raises:
        InvalidArgumentError: Naming what is missing and the remedy (often ``reader='external'``).
    """
    ds = dataset
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
    if not ds.store.has_local_paths:  # a cache's files are local
        raise InvalidArgumentError(
            f"reader='native' needs local files, but {ds.url} is remote: pass cache_dir= "
            "(shards are downloaded into it) or use reader='external'"
        )
    if ds.on_error != "raise":
        raise InvalidArgumentError(
            "on_error='skip'/'warn' needs reader='external' (DALI's readers cannot skip)"
        )
    if ds.subset is not None:
        raise InvalidArgumentError(
            "a subset= of a dataset needs reader='external' (DALI's readers read whole shards)"
        )


def local_paths(dataset: Dataset) -> tuple[list[str], list[str]]:
    """Local paths of the (non-empty) shards and of their indexes, each shard checked first (see
    :func:`check_shard`); a cached store downloads them now. Call after :func:`check_native`."""
    ds = dataset
    paths: list[str] = []
    indexes: list[str] = []
    for shard, key in enumerate(ds.shard_keys):
        if ds.shard_sizes[shard] == 0:
            continue  # DALI rejects index files of zero samples
        index_key = ds.index_keys[shard]
        if index_key is None:
            raise InvalidArgumentError(
                f"shard {ds.shard_url(shard)} has no index; see check_native"
            )
        check_shard(ds, shard, key, index_key)
        for k, out in ((key, paths), (index_key, indexes)):
            path = ds.store.local_path(k)
            if path is None:
                raise InvalidArgumentError(
                    f"{ds.store.child_url(k)} has no local path; pass cache_dir= or use "
                    "reader='external'"
                )
            out.append(path)
    return paths, indexes


def check_shard(dataset: Dataset, shard: int, key: str, index_key: str) -> None:
    """Check a shard and its index as fastload's readers do before DALI reads them: DALI trusts
    both, so a truncated shard or a damaged index would give wrong samples (or a crash)
    instead of an error.

    Raises:
        CorruptDataError: Naming the file.
    """
    ds = dataset
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


def native_reader(
    fn: Any,
    dataset: Dataset,
    fields: FieldSpec,
    plan: NativePlan,
    files: tuple[list[str], list[str]],
    *,
    initial_fill: int,
    seed: int,
) -> tuple[Any, Any]:
    """The ``(images, labels)`` DataNodes of DALI's reader for ``dataset``'s format, sharded by
    ``plan``, over ``files`` (:func:`local_paths`); ``fn`` is ``nvidia.dali.fn``."""
    paths, indexes = files
    common: dict[str, Any] = {
        **plan.options(),
        "random_shuffle": dataset.shuffle,
        "initial_fill": initial_fill,
        "seed": seed,
        "name": "Reader",
    }
    if dataset.format_name == "webdataset":
        images, labels = fn.readers.webdataset(
            paths=paths,
            index_paths=indexes,
            ext=[";".join(fields.image), ";".join(fields.label)],
            missing_component_behavior="error",
            **common,
        )
        return images, labels
    schema = dataset.manifest.schema
    image = next((f for f in fields.image if f in schema), fields.image[0])
    label = next((f for f in fields.label if f in schema), fields.label[0])
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
