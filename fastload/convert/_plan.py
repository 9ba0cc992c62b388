"""Planning a conversion: sample order, assignment to shards, the plan's identity.

Everything here is a pure function of the source's units and the options, so the same input and
options give the same shards whatever the number of workers, and a re-run can recognise its plan.

Planning streams: :func:`shard_starts` cuts shards as the units come and :class:`PlanHash` hashes
them as they go, so a plan keeps one small :class:`ShardPlan` per shard and no unit. The units of a shard are enumerated again when it is written
(:meth:`ConversionPlan.shard_units`), and checked against the plan's running hash, so a source
that changed in between is an error, never a shard that differs from its plan.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastload._units import parse_size
from fastload.convert.sources import ConversionError, PlanReporter, Source, Unit

__all__ = [
    "DEFAULT_SHARD_SIZE",
    "ConversionPlan",
    "PlanHash",
    "ShardLayout",
    "ShardPlan",
    "estimate_sample_bytes",
    "parse_size",
    "planned_units",
    "shard_name",
    "shard_starts",
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


def planned_units(
    source: Source, report: PlanReporter, *, shuffle: bool, seed: int
) -> tuple[Iterable[Unit], Callable[[], Iterable[Unit]]]:
    """The units of ``source`` to plan from, in their final order (permuted by ``seed`` if
    ``shuffle``), and how to enumerate them again to write the shards.

    A :attr:`~Source.replannable` source in its own order streams twice (the second enumeration
    reports nothing again: the first reported, or raised); otherwise the units are kept.
    """
    units = source.plan_units(report)
    if source.replannable and not shuffle:
        return units, lambda: source.plan_units(_already_reported)
    kept = list(units)
    if shuffle:
        kept = shuffle_units(kept, seed)
    return kept, lambda: kept


def _already_reported(item: str, reason: str) -> None:
    """The reporter of the second enumeration of a streamed plan: see :func:`planned_units`."""


@dataclass(frozen=True)
class ShardPlan:
    """One planned shard (its samples are not kept: :meth:`ConversionPlan.shard_units`).

    Attributes:
        index: Shard number (``n`` in the name).
        name: Shard key relative to the dataset root.
        num_samples: Samples it will hold.
        est_bytes: Estimated shard size in bytes.
        digest: :class:`PlanHash` of the plan up to and including this shard, which the units
            enumerated again for writing it must reproduce.
    """

    index: int
    name: str
    num_samples: int
    est_bytes: int
    digest: str


@dataclass(frozen=True)
class ShardLayout:
    """How units are cut into shards and named: the options of :func:`shard_starts`.

    A shard is closed before the sample that would make it exceed ``shard_samples`` samples or
    ``shard_size`` estimated bytes, whichever comes first; a sample larger than ``shard_size`` gets a
    shard of its own.

    ``token_size`` is set for a tokenizing conversion: ``(bytes per id, text bytes per id)``. A
    record (a document) is then estimated as its bytes * bytes per id / text bytes per id (its
    ids, without framing: blocks are few and large), so ``shard_size`` still means the shard's
    size, and ``shard_samples`` counts documents.
    """

    format_name: str
    extension: str
    prefix: str
    shard_samples: int | None
    shard_size: int | None
    token_size: tuple[int, int] | None = None


def shard_starts(units: Iterable[Unit], layout: ShardLayout) -> Iterator[tuple[Unit, int, bool]]:
    """Each of ``units`` (in their final order) with its estimated bytes and whether it begins a
    new shard under ``layout``; the first unit does. Keeps nothing but the current shard's count
    and size."""
    count = size = 0
    for unit in units:
        if layout.token_size is not None:
            est = -(-unit.size * layout.token_size[0] // layout.token_size[1])
        else:
            est = estimate_sample_bytes(layout.format_name, unit)
        first = count == 0 or (
            (layout.shard_samples is not None and count >= layout.shard_samples)
            or (layout.shard_size is not None and size + est > layout.shard_size)
        )
        if first:
            count = size = 0
        count += 1
        size += est
        yield unit, est, first


class PlanHash:
    """SHA-256 identifying a plan, fed as the plan is cut: the source, the content-relevant
    options and every shard's units (references and sizes). Equal hashes mean a re-run would write
    the same shards.

    The bytes hashed are the head (source and options as JSON), then per shard a line naming it
    and one JSON line per unit; they are buffered a few thousand lines at a time.
    """

    _BUFFERED = 4096

    def __init__(self, source: Mapping[str, Any], options: Mapping[str, Any]) -> None:
        self._sha = hashlib.sha256()
        head = {"source": source, "options": options}
        self._sha.update(
            json.dumps(head, sort_keys=True, separators=(",", ":"), default=str).encode()
        )
        # One encoder for all units (json.dumps with options builds a new one per call).
        self._encode = json.JSONEncoder(separators=(",", ":")).encode
        self._lines: list[str] = []

    def shard(self, name: str) -> None:
        """Begin shard ``name``: the units added next are its own."""
        self._lines.append(f"\nshard {name}\n")

    def add(self, unit: Unit) -> None:
        """Hash ``unit``, the next of the current shard."""
        self._lines.append(self._encode([unit.ref, unit.size]) + "\n")
        if len(self._lines) >= self._BUFFERED:
            self._flush()

    def _flush(self) -> None:
        self._sha.update("".join(self._lines).encode())
        self._lines = []

    def hexdigest(self) -> str:
        """The hash of everything added so far (the plan up to here)."""
        self._flush()
        return self._sha.hexdigest()


@dataclass(frozen=True)
class ConversionPlan:
    """A whole planned conversion: its shards, what identifies it, and how to get their units.

    Attributes:
        shards: The shards, in dataset order.
        source: How the source is identified (:meth:`Source.describe`).
        options: The options that shape the content (format, shard limits, order, map, ...).
        sha256: :class:`PlanHash` of the three: equal hashes mean the same shards.
        layout: How the units were cut into shards.
        units: Enumerates the units of the plan again, in their final order.
    """

    shards: list[ShardPlan]
    source: dict[str, Any]
    options: dict[str, Any]
    sha256: str
    layout: ShardLayout
    units: Callable[[], Iterable[Unit]]

    @classmethod
    def build(
        cls,
        units: Iterable[Unit],
        layout: ShardLayout,
        source: dict[str, Any],
        options: dict[str, Any],
        replay: Callable[[], Iterable[Unit]],
    ) -> ConversionPlan:
        """Plan ``units`` as they come, keeping none of them; ``replay`` enumerates the same units
        again when the shards are written."""
        hasher = PlanHash(source, options)
        shards: list[ShardPlan] = []
        name, count, size = "", 0, 0

        def close() -> None:
            shards.append(ShardPlan(len(shards), name, count, size, hasher.hexdigest()))

        for unit, est, first in shard_starts(units, layout):
            if first:
                if count:
                    close()
                name, count, size = shard_name(layout.prefix, len(shards), layout.extension), 0, 0
                hasher.shard(name)
            hasher.add(unit)
            count += 1
            size += est
        if count:
            close()
        return cls(shards, source, options, hasher.hexdigest(), layout, replay)

    @property
    def num_samples(self) -> int:
        """Samples planned, in all shards."""
        return sum(s.num_samples for s in self.shards)

    @property
    def est_bytes(self) -> int:
        """Estimated bytes of all shards."""
        return sum(s.est_bytes for s in self.shards)

    def shard_units(self) -> Iterator[tuple[ShardPlan, list[Unit]]]:
        """Each shard with its units, enumerated again and streamed (one shard at a time).

        Raises:
            ConversionError: The source no longer gives the planned units (it changed since it
                was planned); the shard that differs is not given.
        """
        hasher = PlanHash(self.source, self.options)
        planned = iter(self.shards)
        shard: ShardPlan | None = None
        units: list[Unit] = []

        def checked(shard: ShardPlan) -> tuple[ShardPlan, list[Unit]]:
            if hasher.hexdigest() != shard.digest:
                raise _changed(shard.name)
            return shard, units

        for unit, _, first in shard_starts(self.units(), self.layout):
            if first:
                if shard is not None:
                    yield checked(shard)
                    units = []
                shard = next(planned, None)
                if shard is None:
                    raise _changed(f"after {self.shards[-1].name}")
                hasher.shard(shard.name)
            hasher.add(unit)
            units.append(unit)
        if shard is not None:
            yield checked(shard)
        missing = next(planned, None)
        if missing is not None:
            raise _changed(missing.name)


def _changed(where: str) -> ConversionError:
    """The error of a source whose units differ from its plan's at ``where`` when written."""
    return ConversionError(
        f"the source changed while it was converted (from shard {where} on it gives other "
        "samples than planned); once it no longer changes, re-run with overwrite=True "
        "(--overwrite) to convert it afresh"
    )
