"""Planning a conversion: sample order, assignment to shards, the plan's identity.

Everything here is a pure function of the source's units and the options, so the same input and
options give the same shards whatever the number of workers, and a re-run can recognise its plan.

Planning streams: :class:`PlanStream` cuts shards as the units come (:func:`shard_starts`) and
hashes them as they go (:class:`PlanHash`), giving each shard with its units as soon as it is cut,
so a conversion writes its first shards while the source is still being enumerated and keeps one
small :class:`ShardPlan` per shard. Each shard's digest is the plan's hash up to and including it,
which is what a resumed run checks a finished shard against. Where a whole plan is needed first
(:class:`ConversionPlan`: a dry run, a destination that names a whole plan's hash), the units are
enumerated again to be written (:meth:`ConversionPlan.shard_units`) and checked against the
plan's running hash, so a source that changed in between is an error, never a shard that differs
from its plan.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastload._units import parse_size
from fastload.convert.sources import ConversionError, PlanReporter, Source, Unit
from fastload.errors import InvalidArgumentError

__all__ = [
    "DEFAULT_SHARD_SIZE",
    "ConversionPlan",
    "PlanHash",
    "PlanStream",
    "ShardLayout",
    "ShardPlan",
    "estimate_sample_bytes",
    "option_name",
    "parse_size",
    "planned_units",
    "shard_size_limit",
    "shard_name",
    "shard_starts",
    "shuffle_units",
]

#: Target shard size when neither ``shard_size`` nor ``shard_samples`` is given: 256 MB.
DEFAULT_SHARD_SIZE = 256_000_000


def option_name(name: str) -> str:
    """An option as messages name it, for the Python API and the command line at once:
    ``shard_samples (--shard-samples)``."""
    flag = {"map_fn": "--map"}.get(name, "--" + name.replace("_", "-"))
    return f"{name} ({flag})"


def shard_size_limit(shard_size: int | str | None, shard_samples: int | None) -> int | None:
    """The shard size limit in bytes: ``shard_size`` parsed, the default when neither limit is
    given, else ``None`` (only ``shard_samples`` limits the shards)."""
    try:
        size_limit = parse_size(shard_size) if shard_size is not None else None
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{option_name('shard_size')}: {exc}") from None
    if size_limit is None and shard_samples is None:
        return DEFAULT_SHARD_SIZE
    return size_limit


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
    reports nothing again: the first reported, or raised); otherwise the units are kept as they
    come (all of them first when shuffled), for the second enumeration, which may only begin
    once the first is over.
    """
    units = source.plan_units(report)
    if source.replannable and not shuffle:
        return units, lambda: source.plan_units(_already_reported)
    if shuffle:
        shuffled = shuffle_units(list(units), seed)
        return shuffled, lambda: shuffled
    kept: list[Unit] = []

    def keeping() -> Iterator[Unit]:
        for unit in units:
            kept.append(unit)
            yield unit

    return keeping(), lambda: kept


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
        head_bytes = json.dumps(head, sort_keys=True, separators=(",", ":"), default=str).encode()
        self._sha.update(head_bytes)
        #: SHA-256 of the head alone: the source and options, before any unit.
        self.head_sha256 = hashlib.sha256(head_bytes).hexdigest()
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


class PlanStream:
    """A plan cut and hashed as its units come: iterating it gives each shard, with its units,
    as soon as the shard is closed (when the next shard's first unit, or the end, is seen).

    Keeps the :class:`ShardPlan` of every shard cut so far (a few numbers each) and the units of
    the shard being cut (none with ``keep_units=False``), never more, so a conversion can write
    shards while the rest of the source is still being enumerated. Each shard's
    :attr:`ShardPlan.digest` covers the plan up to and including it; after the last shard,
    :attr:`sha256` is the whole plan's :class:`PlanHash` (the same bytes hashed as when a plan
    was made whole before writing). Used from one thread.

    Args:
        units: The units in their final order (see :func:`planned_units`).
        layout: How they are cut into shards.
        source: How the source is identified (:meth:`Source.describe`).
        options: The options that shape the content.
        keep_units: Give each shard's units (else an empty list, for a plan only counted).
    """

    def __init__(
        self,
        units: Iterable[Unit],
        layout: ShardLayout,
        source: dict[str, Any],
        options: dict[str, Any],
        *,
        keep_units: bool = True,
    ) -> None:
        self.layout, self.source, self.options = layout, source, options
        self._hasher = PlanHash(source, options)
        #: SHA-256 of the plan's head (source and options): what a resumed run checks first.
        self.head_sha256 = self._hasher.head_sha256
        #: The shards cut so far, in dataset order.
        self.shards: list[ShardPlan] = []
        #: The whole plan's hash, once the last shard is cut (``None`` until then).
        self.sha256: str | None = None
        #: Samples and estimated bytes of the shards cut so far.
        self.num_samples = self.est_bytes = 0
        self._cut = self._shards(units, keep_units)

    def __iter__(self) -> Iterator[tuple[ShardPlan, list[Unit]]]:
        return self

    def __next__(self) -> tuple[ShardPlan, list[Unit]]:
        return next(self._cut)

    @property
    def complete(self) -> bool:
        """Whether every shard is cut (the source fully enumerated)."""
        return self.sha256 is not None

    def finish(self, replay: Callable[[], Iterable[Unit]]) -> ConversionPlan:
        """Cut the remaining shards (their units are dropped) and return the whole plan, whose
        units ``replay`` enumerates again."""
        for _ in self._cut:
            pass
        assert self.sha256 is not None  # the generator has run to its end
        return ConversionPlan(
            self.shards, self.source, self.options, self.sha256, self.layout, replay
        )

    def _shards(
        self, units: Iterable[Unit], keep_units: bool
    ) -> Iterator[tuple[ShardPlan, list[Unit]]]:
        hasher, layout = self._hasher, self.layout
        name, count, size = "", 0, 0
        batch: list[Unit] = []

        def close() -> tuple[ShardPlan, list[Unit]]:
            shard = ShardPlan(len(self.shards), name, count, size, hasher.hexdigest())
            self.shards.append(shard)
            self.num_samples += count
            self.est_bytes += size
            return shard, batch

        for unit, est, first in shard_starts(units, layout):
            if first:
                if count:
                    yield close()
                name = shard_name(layout.prefix, len(self.shards), layout.extension)
                count, size, batch = 0, 0, []
                hasher.shard(name)
            hasher.add(unit)
            if keep_units:
                batch.append(unit)
            count += 1
            size += est
        # Complete before the last shard is given: nothing is hashed after it.
        last = close() if count else None
        self.sha256 = hasher.hexdigest()
        if last is not None:
            yield last


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
        planned = iter(self.shards)
        for shard, units in PlanStream(self.units(), self.layout, self.source, self.options):
            expected = next(planned, None)
            if expected is None:
                raise _changed(f"after {self.shards[-1].name}")
            if shard.digest != expected.digest:
                raise _changed(expected.name)
            yield expected, units
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
