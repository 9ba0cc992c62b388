"""What the dataset tools share: opening the dataset's store, hashing a shard, the key check."""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fastload.formats import local_file
from fastload.storage import Store, open_store

__all__ = ["Grouping", "Progress", "count_fields", "open_dataset_store", "sha256_of"]

_CHUNK = 8 << 20
#: ``progress(shards done, shards in all, bytes of the shard just done)``, called per shard.
Progress = Callable[[int, int, int], None]


def open_dataset_store(
    url: str | os.PathLike[str] | Store, options: Mapping[str, Any] | None
) -> Store:
    """``url`` itself when it is a store, else the store it names, opened with ``options``."""
    if isinstance(url, Store):
        return url
    return open_store(url, **dict(options or {}))


def sha256_of(store: Store, key: str) -> tuple[str, int]:
    """The hex SHA-256 and the size of object ``key``: a local file of up to 8 MiB in one read,
    a larger one through :func:`hashlib.file_digest`, other objects in 8 MiB blocks."""
    path = local_file(store, key)
    if path is not None:
        with open(path, "rb", buffering=0) as file:
            if os.fstat(file.fileno()).st_size <= _CHUNK:  # small: one read, one buffer
                data = file.readall()
                return hashlib.sha256(data).hexdigest(), len(data)
            digest = hashlib.file_digest(file, "sha256")
            return digest.hexdigest(), file.tell()
    sha = hashlib.sha256()
    n = 0
    with store.open_reader(key) as f:
        while block := f.read(_CHUNK):
            sha.update(block)
            n += len(block)
    return sha.hexdigest(), n


def count_fields(sample: Mapping[str, Any], counts: dict[str, int]) -> None:
    """Add one to ``counts`` for each field of ``sample`` (not the ``__key__``-like entries)."""
    for name in sample:
        if not name.startswith("__"):
            counts[name] = counts.get(name, 0) + 1


class Grouping:
    """Checks that every sample key appears once in a dataset, and tallies the field sets.

    A tar whose members are not grouped by sample (``tar -cf x.tar -C dir .`` lists files in
    directory order) reads as many one-field fragments with repeated keys; a sample split across
    two shards reads as two samples with one key. Both are found here.
    """

    _SHOWN = 3

    def __init__(self) -> None:
        self.first: dict[str, tuple[str, int]] = {}
        self.repeats = 0
        self.examples: list[str] = []
        self.field_sets: Counter[tuple[str, ...]] = Counter()

    def add(self, shard_url: str, position: int, sample: Mapping[str, Any]) -> None:
        """Note sample number ``position`` of the shard at ``shard_url``."""
        key = sample.get("__key__")
        self.field_sets[tuple(sorted(k for k in sample if not k.startswith("__")))] += 1
        if isinstance(key, str):
            self._see(key, shard_url, position)

    def add_shard(
        self,
        shard_url: str,
        keys: Sequence[str | None],
        field_sets: Mapping[tuple[str, ...], int],
    ) -> None:
        """Note a whole shard at once: its samples' keys in order (``None``: no string key) and
        how many samples have each sorted field set; the same as :meth:`add` for each sample."""
        self.field_sets.update(field_sets)
        for position, key in enumerate(keys):
            if key is not None:
                self._see(key, shard_url, position)

    def _see(self, key: str, shard_url: str, position: int) -> None:
        seen = self.first.setdefault(key, (shard_url, position))
        if seen != (shard_url, position):
            self.repeats += 1
            if len(self.examples) < self._SHOWN:
                where = (
                    f"samples {seen[1]} and {position} of {shard_url}"
                    if seen[0] == shard_url
                    else f"sample {seen[1]} of {seen[0]} and sample {position} of {shard_url}"
                )
                self.examples.append(f"{key!r} ({where})")

    def problem(self) -> str | None:
        """The repeated keys, with the fix, or ``None``."""
        if not self.repeats:
            return None
        return (
            f"{self.repeats} sample(s) repeat the key of an earlier sample, e.g. "
            f"{'; '.join(self.examples)}. A WebDataset sample's members must be adjacent: a tar "
            "made with `tar -cf x.tar -C dir .` lists files in directory order, which splits "
            "samples into fragments. Re-create it with `tar --sort=name -cf x.tar -C dir .` "
            "(GNU tar), or convert the files themselves with `fastload convert dir DST`; keep "
            "each sample's members in one shard"
        )

    def warning(self) -> str | None:
        """A note when samples have different field sets (optional fields, or fragments)."""
        if len(self.field_sets) <= 1:
            return None
        sets = ", ".join(f"{list(f)} in {n}" for f, n in self.field_sets.most_common(4))
        more = f" and {len(self.field_sets) - 4} more" if len(self.field_sets) > 4 else ""
        return (
            f"samples have {len(self.field_sets)} different field sets: {sets}{more}; that is "
            "expected when some fields are optional, otherwise members of one sample are not "
            "adjacent in the shards"
        )
