"""Planning a conversion up front: sample order, assignment to shards, the plan's identity.

Everything here is a pure function of the source's units and the options, so the same input and
options give the same shards whatever the number of workers, and a re-run can recognise its plan.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastload._units import parse_size
from fastload.convert.sources import Unit

__all__ = [
    "DEFAULT_SHARD_SIZE",
    "ConversionPlan",
    "ShardPlan",
    "estimate_sample_bytes",
    "parse_size",
    "plan_hash",
    "plan_shards",
    "shard_name",
    "shuffle_units",
]

#: Target shard size when neither ``shard_size`` nor ``shard_samples`` is given: 256 MB.
DEFAULT_SHARD_SIZE = 256_000_000


def shard_name(prefix: str, n: int, extension: str) -> str:
    """``{prefix}-{n:06d}.{extension}``."""
    return f"{prefix}-{n:06d}.{extension}"


def estimate_sample_bytes(format_name: str, unit: Unit) -> int:
    """Bytes a sample will take in a shard of ``format_name`` (payload plus framing), estimated."""
    payload, nfields = unit.size, max(1, unit.nfields)
    if format_name == "webdataset":  # a 512-byte header per member, data padded to 512 bytes
        return payload + nfields * (512 + 511)
    if format_name == "tfrecord":  # record framing, Example feature maps and the key feature
        return payload + 16 + nfields * 24 + 64
    if format_name == "lmdb":  # key, msgpack map headers, page and node overhead
        return payload + nfields * 16 + 96
    return payload + nfields * 64


def shuffle_units(units: Sequence[Unit], seed: int) -> list[Unit]:
    """Deterministic permutation of ``units``: ordered by BLAKE2b-64 of ``(seed, position)``.

    Independent of Python and NumPy versions (no PRNG stream involved), so the same seed gives the
    same order everywhere.
    """
    prefix = f"{int(seed)}:".encode()

    def rank(i: int) -> bytes:
        return hashlib.blake2b(prefix + str(i).encode(), digest_size=8).digest()

    order = sorted(range(len(units)), key=rank)
    return [units[i] for i in order]


@dataclass(frozen=True)
class ShardPlan:
    """One planned shard.

    Attributes:
        index: Shard number (``n`` in the name).
        name: Shard key relative to the dataset root.
        units: The samples it will hold, in order.
        est_bytes: Estimated shard size in bytes.
    """

    index: int
    name: str
    units: tuple[Unit, ...]
    est_bytes: int


def plan_shards(
    units: Sequence[Unit],
    *,
    format_name: str,
    extension: str,
    prefix: str,
    shard_samples: int | None,
    shard_size: int | None,
) -> list[ShardPlan]:
    """Cut ``units`` (in their final order) into consecutive shards.

    A shard is closed before the sample that would make it exceed ``shard_samples`` samples or
    ``shard_size`` estimated bytes, whichever comes first; a sample larger than ``shard_size`` gets a
    shard of its own.
    """
    shards: list[ShardPlan] = []
    current: list[Unit] = []
    size = 0

    def flush() -> None:
        nonlocal current, size
        if current:
            n = len(shards)
            shards.append(ShardPlan(n, shard_name(prefix, n, extension), tuple(current), size))
        current, size = [], 0

    for unit in units:
        est = estimate_sample_bytes(format_name, unit)
        if current and (
            (shard_samples is not None and len(current) >= shard_samples)
            or (shard_size is not None and size + est > shard_size)
        ):
            flush()
        current.append(unit)
        size += est
    flush()
    return shards


def plan_hash(
    source: Mapping[str, Any], options: Mapping[str, Any], shards: Iterable[ShardPlan]
) -> str:
    """SHA-256 identifying a plan: the source, the content-relevant options and every shard's units
    (references and sizes). Equal hashes mean a re-run would write the same shards."""
    sha = hashlib.sha256()
    head = {"source": source, "options": options}
    sha.update(json.dumps(head, sort_keys=True, separators=(",", ":"), default=str).encode())
    # One encoder for all units (json.dumps with options builds a new one per call) and one
    # update per shard: the same bytes as one dumps and one update per unit.
    encode = json.JSONEncoder(separators=(",", ":")).encode
    for shard in shards:
        lines = [f"\nshard {shard.name}\n"]
        lines.extend([encode([unit.ref, unit.size]) + "\n" for unit in shard.units])
        sha.update("".join(lines).encode())
    return sha.hexdigest()


@dataclass(frozen=True)
class ConversionPlan:
    """A whole planned conversion: its shards and what identifies it.

    Attributes:
        shards: The shards, in dataset order.
        source: How the source is identified (:meth:`Source.describe`).
        options: The options that shape the content (format, shard limits, order, map, ...).
        sha256: :func:`plan_hash` of the three: equal hashes mean the same shards.
    """

    shards: list[ShardPlan]
    source: dict[str, Any]
    options: dict[str, Any]
    sha256: str

    @property
    def num_samples(self) -> int:
        """Samples planned, in all shards."""
        return sum(len(s.units) for s in self.shards)

    @property
    def est_bytes(self) -> int:
        """Estimated bytes of all shards."""
        return sum(s.est_bytes for s in self.shards)
