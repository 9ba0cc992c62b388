"""Weighted mixing as arithmetic: whole counts per window, a smooth pattern, and where each
position of each mix epoch comes from.

No torch, no I/O: :class:`MixPlan` is what both mixes (:func:`fastload.mix` of token sources and of
sample datasets) compute positions with, in every rank and worker, without communication.

**Counts** (:func:`mix_counts`). Weights ``w_i > 0`` become whole counts ``c_i >= 1`` per window
of ``M = sum c_i`` positions. Without ``window``, ``M`` is the smallest window in which the
weights are exact (the least common denominator of the normalised weights, floats read as the
decimals they print as: ``0.7`` is 7/10), as long as that is at most :data:`MAX_AUTO_WINDOW`;
above it (and when ``window`` is given and the weights do not fit it) the counts are rounded by
largest remainders (each ``c_i`` within 1 of ``M x w_i / sum w``, ties to the earlier source) and
:class:`MixRoundingWarning` names the effective weights ``c_i / M``.

**Pattern** (:func:`smooth_pattern`). The ``M`` positions of a window are dealt by a greedy
"furthest behind its share first" rule: offset ``t`` goes to the source maximising
``(t + 1) c_i - x_i M`` (``x_i``: the source's positions so far; ties to the earlier source). Every
window of ``M`` positions then holds exactly ``c_i`` positions of source ``i`` (no source can
overshoot: its deficit is then <= 0 while the deficits sum to ``M > 0``), and the sources are
spread evenly inside it: every run of ``L`` consecutive positions of the stream, wherever it
starts, holds source ``i`` ``L c_i / M`` times up to less than 2 (checked by property tests, not
proved here), so a batch of ``B`` positions holds ``B c_i / M`` rows of source ``i`` rounded up or
down, give or take one, and exactly that when ``M`` divides ``B``. The pattern is the same in
every window and for every seed and epoch: the randomness of a mix is in the sources' own orders,
which is enough for training and makes batches regular.

**Where a position comes from** (:class:`MixPlan`). The mix is one endless stream; mix epoch
``e`` is its positions ``[e L, (e + 1) L)`` (``L``: ``epoch_size``, by default the sources' total
rounded up to a multiple of ``M``, so that every mix epoch is whole windows). Position ``P`` of the
stream is offset ``P mod M`` of window ``P // M``: its source is ``i = pattern[P mod M]`` and it is
source ``i``'s item number ``n = (P // M) c_i + (source i's offsets before it in the window)``,
counted from the start of the run, across mix epochs. Item ``n`` of a source of ``N_i`` items is
position ``n mod N_i`` of the source's own epoch ``n // N_i``: a source that runs out starts its
next epoch (in its next order) right away, and its items are delivered exactly once per own
epoch. O(1) per position, O(M x sources) memory (a table of counts before each offset).
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np
import numpy.typing as npt

from fastload._units import check_int
from fastload.errors import InvalidArgumentError
from fastload.loader.order._seeds import check_seed

__all__ = [
    "MAX_AUTO_WINDOW",
    "MAX_SOURCES",
    "MIX_VERSION",
    "MixIdentity",
    "MixPlan",
    "MixRoundingWarning",
    "check_mix_state",
    "mix_counts",
    "smooth_pattern",
    "source_epoch_groups",
    "unique_names",
]

IntArray = npt.NDArray[np.int64]
#: The largest window chosen automatically for exact weights; beyond it weights are rounded.
MAX_AUTO_WINDOW = 10_000
#: Sources a mix may have (source numbers are ``int8``).
MAX_SOURCES = 127
#: Version of the mixing arithmetic (counts, pattern, position map); states record it.
MIX_VERSION = 1
# Floats are read as the shortest fraction within this denominator (0.7 -> 7/10).
_FLOAT_DENOMINATOR = 10**9


class MixRoundingWarning(UserWarning):
    """The weights of a mix do not fit its window exactly; the message gives the effective
    weights."""


def _fraction(weight: object, where: str) -> Fraction:
    if isinstance(weight, bool) or not isinstance(weight, int | float | Fraction | np.number):
        raise InvalidArgumentError(f"{where} must be a positive number, got {weight!r}")
    if isinstance(weight, float | np.floating):
        if not math.isfinite(float(weight)):
            raise InvalidArgumentError(f"{where} must be a positive number, got {weight!r}")
        value = Fraction(float(weight)).limit_denominator(_FLOAT_DENOMINATOR)
    else:
        value = Fraction(weight)  # type: ignore[arg-type]
    if value <= 0:
        raise InvalidArgumentError(
            f"{where} must be > 0, got {weight!r} (leave a source out of the mix instead of "
            "giving it weight 0)"
        )
    return value


def mix_counts(
    weights: Sequence[object], window: int | None = None, *, names: Sequence[str] | None = None
) -> tuple[int, ...]:
    """Whole counts per window for ``weights`` (see the module doc).

    Args:
        weights: One positive weight per source (ints, floats, fractions; only ratios matter).
        window: Positions per window ``M``; ``None`` picks the smallest exact one (at most
            :data:`MAX_AUTO_WINDOW`, else rounds to that).
        names: Source names for messages.

    Returns:
        ``c_i >= 1`` with ``sum == M``.

    Raises:
        InvalidArgumentError: No weights, more than :data:`MAX_SOURCES`, a weight that is not a
            positive number, or a weight too small to get one position per window.

    Warns:
        MixRoundingWarning: The counts are rounded (the message names the effective weights).
    """
    labels = list(names) if names is not None else [f"source {i}" for i in range(len(weights))]
    if not 1 <= len(weights) <= MAX_SOURCES:
        raise InvalidArgumentError(
            f"a mix needs 1 to {MAX_SOURCES} sources, got {len(weights)} weights"
        )
    fracs = [_fraction(w, f"the weight of {labels[i]}") for i, w in enumerate(weights)]
    total = sum(fracs, Fraction(0))
    shares = [f / total for f in fracs]
    exact = math.lcm(*(s.denominator for s in shares))
    if window is None:
        window = exact if exact <= MAX_AUTO_WINDOW else MAX_AUTO_WINDOW
    else:
        window = check_int("window", window, minimum=len(weights))
    quotas = [s * window for s in shares]
    counts = [math.floor(q) for q in quotas]
    rest = window - sum(counts)
    by_remainder = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[:rest]:
        counts[i] += 1
    for i, c in enumerate(counts):
        if c == 0:
            need = math.ceil(1 / shares[i])
            raise InvalidArgumentError(
                f"the weight of {labels[i]} ({float(shares[i]):.3g} of the mix) gets no position "
                f"in a window of {window}; pass window= of at least {need}, or a larger weight"
            )
    if window % exact:
        effective = ", ".join(
            f"{labels[i]}: {c}/{window} = {c / window:.6g} (asked {float(shares[i]):.6g})"
            for i, c in enumerate(counts)
        )
        warnings.warn(
            f"the mix weights are not exact in a window of {window} positions; effective weights "
            f"{effective}. For exact weights pass window= a multiple of {exact}, or weights with "
            "a smaller common denominator",
            MixRoundingWarning,
            stacklevel=3,
        )
    return tuple(counts)


def smooth_pattern(counts: Sequence[int]) -> npt.NDArray[np.int8]:
    """The source of each offset of a window (see the module doc): ``c_i`` offsets of source
    ``i``, spread evenly. O(M x sources)."""
    c = np.asarray(counts, dtype=np.int64)
    window = int(c.sum())
    taken = np.zeros(len(c), dtype=np.int64)
    out = np.empty(window, dtype=np.int8)
    for t in range(window):
        i = int(np.argmax((t + 1) * c - taken * window))  # first maximum: earlier source on ties
        out[t] = i
        taken[i] += 1
    return out


class MixPlan:
    """Where each position of each mix epoch comes from (see the module doc).

    Args:
        counts: Positions of each source per window (:func:`mix_counts`).
        source_sizes: Items in each source's own epoch (``>= 1`` each).
        epoch_size: Positions per mix epoch ``L``; ``None``: the sources' total rounded up to a
            multiple of the window.
        names: Source names for messages.

    Thread safety: immutable after construction; safe to share and to pickle.
    """

    def __init__(
        self,
        counts: Sequence[int],
        source_sizes: Sequence[int],
        *,
        epoch_size: int | None = None,
        names: Sequence[str] | None = None,
    ) -> None:
        if len(counts) != len(source_sizes):
            raise InvalidArgumentError(
                f"{len(counts)} counts for {len(source_sizes)} sources; give one per source"
            )
        self.names = (
            tuple(names) if names is not None else tuple(f"{i}" for i in range(len(counts)))
        )
        for i, n in enumerate(source_sizes):
            if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
                raise InvalidArgumentError(
                    f"source {self.names[i]} has {n!r} items; every source of a mix needs at "
                    "least one (leave empty ones out)"
                )
        self.counts = tuple(check_int("count", int(c), minimum=1) for c in counts)
        self.window = sum(self.counts)
        self.source_sizes = tuple(int(n) for n in source_sizes)
        if epoch_size is None:
            total = sum(self.source_sizes)
            epoch_size = -(-total // self.window) * self.window
        self.epoch_size = check_int("epoch_size", epoch_size, minimum=1)
        self._counts = np.asarray(self.counts, dtype=np.int64)
        self._sizes = np.asarray(self.source_sizes, dtype=np.int64)
        self.pattern = smooth_pattern(self.counts)
        # _before[o, i]: offsets of source i before offset o of a window (o = 0 .. M).
        onehot = np.zeros((self.window, len(self.counts)), dtype=np.int64)
        onehot[np.arange(self.window), self.pattern] = 1
        self._before = np.zeros((self.window + 1, len(self.counts)), dtype=np.int64)
        np.cumsum(onehot, axis=0, out=self._before[1:])
        self._rank = self._before[np.arange(self.window), self.pattern]

    @property
    def num_sources(self) -> int:
        """Sources in the mix."""
        return len(self.counts)

    @property
    def weights(self) -> tuple[float, ...]:
        """The effective weights ``c_i / M``."""
        return tuple(c / self.window for c in self.counts)

    def stream(self, positions: npt.ArrayLike) -> tuple[IntArray, IntArray]:
        """``(source, n)`` of positions of the endless stream: position ``P`` is source
        ``source``'s item number ``n`` (counted from the start of the run)."""
        pos = np.asarray(positions, dtype=np.int64)
        window, offset = np.divmod(pos, self.window)
        source = self.pattern[offset].astype(np.int64)
        return source, window * self._counts[source] + self._rank[offset]

    def before(self, position: int) -> IntArray:
        """Items of each source in the stream's positions ``[0, position)``."""
        window, offset = divmod(check_int("position", position), self.window)
        out: IntArray = window * self._counts + self._before[offset]
        return out

    def epoch_counts(self, epoch: int) -> IntArray:
        """Items of each source in mix epoch ``epoch``."""
        start = check_seed("epoch", epoch) * self.epoch_size
        return self.before(start + self.epoch_size) - self.before(start)

    def locate(self, epoch: int, positions: npt.ArrayLike) -> tuple[IntArray, IntArray, IntArray]:
        """``(source, source epoch, position in the source epoch)`` of positions
        ``0 <= p < epoch_size`` of mix epoch ``epoch``.

        Raises:
            InvalidArgumentError: A position outside ``[0, epoch_size)``, a negative epoch.
        """
        epoch = check_seed("epoch", epoch)
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= self.epoch_size):
            raise InvalidArgumentError(
                f"mix positions must lie in [0, {self.epoch_size}), got "
                f"[{int(pos.min())}, {int(pos.max())}]"
            )
        source, n = self.stream(pos + epoch * self.epoch_size)
        size = self._sizes[source]
        return source, n // size, n % size

    def options(self) -> dict[str, Any]:
        """What a resume state must match (beside each source's identity)."""
        return {
            "mix_version": MIX_VERSION,
            "mix_counts": list(self.counts),
            "mix_epoch_size": self.epoch_size,
        }

    def describe(self) -> str:
        """``name: c/M, ...`` for messages and reprs."""
        return ", ".join(f"{n}: {c}/{self.window}" for n, c in zip(self.names, self.counts))


def source_epoch_groups(
    source: IntArray, own_epoch: IntArray
) -> Iterator[tuple[int, int, IntArray]]:
    """``(source, own epoch, rows)`` for each pair present among rows of :meth:`MixPlan.locate`'s
    output, sources in increasing order: what a mix reads with one call per pair (a batch spans
    few own epochs of each source)."""
    for i in np.flatnonzero(np.bincount(source)).tolist():
        rows = np.flatnonzero(source == i)
        epochs = own_epoch[rows]
        lo, hi = int(epochs.min()), int(epochs.max())
        if lo == hi:
            yield i, lo, rows
            continue
        for k in range(lo, hi + 1):
            some = rows[epochs == k]
            if len(some):
                yield i, k, some


class MixIdentity:
    """What identifies a mix in resume states, for both kinds (samples and tokens): the
    sources' fingerprints (the data), the plan's options, the seed, each source's order
    options; and the check of a state against them. Subclasses set the attributes."""

    sources: tuple[Any, ...]  # each with ``url``, ``fingerprint`` and ``order_options()``
    plan: MixPlan
    seed: int
    names: tuple[str, ...]

    def _plan_mix(
        self,
        counts: Sequence[int],
        sizes: Sequence[int],
        epoch_size: int | None,
        seed: int,
        names: Sequence[str] | None,
    ) -> None:
        """Set :attr:`names` (default: the sources' URLs, made unique), :attr:`plan` over the
        sources' ``sizes`` and :attr:`seed`: what both kinds' constructors do first."""
        self.names = (
            tuple(names) if names is not None else unique_names(s.url for s in self.sources)
        )
        self.plan = MixPlan(counts, sizes, epoch_size=epoch_size, names=self.names)
        self.seed = check_seed("seed", seed)

    def _data_fingerprint(self) -> str:
        """A hash of the sources' fingerprints, in source order: the data. The weights,
        window and epoch size are in the order options, so that a loader's state check names
        them when they differ."""
        doc = json.dumps([s.fingerprint for s in self.sources])
        return hashlib.sha256(doc.encode()).hexdigest()[:16]

    def _mix_options(self) -> dict[str, Any]:
        """The plan's options, the seed, and each source's fingerprint and order options."""
        return {
            **self.plan.options(),
            "seed": self.seed,
            "mix_sources": [s.fingerprint for s in self.sources],
            "mix_source_options": [s.order_options() for s in self.sources],
        }

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse a loader state saved by another mix (other sources, source options, weights,
        window, epoch size or seed) or by a single dataset, with a message saying which."""
        check_mix_state(
            state, self._mix_options(), [s.fingerprint for s in self.sources], self.names
        )


def check_mix_state(
    state: Mapping[str, Any],
    options: Mapping[str, Any],
    sources: Sequence[str],
    names: Sequence[str],
) -> None:
    """Refuse a resume state saved by another mix, saying what differs.

    Args:
        state: The loader state dict.
        options: This mix's options (:meth:`MixPlan.options` plus its seed).
        sources: This mix's source fingerprints, in source order.
        names: Source names, for the message.

    Raises:
        InvalidArgumentError: The state is not a mix's, or its sources, counts, epoch size or
            version differ.
    """
    if "mix_counts" not in state:
        raise InvalidArgumentError(
            "the state was saved by a loader of a single dataset, not of a mix "
            f"({', '.join(names)}); resume on what saved it"
        )
    saved = list(state.get("mix_sources", []))
    if saved != list(sources):
        if len(saved) != len(sources):
            what = f"{len(saved)} sources, this mix has {len(sources)}"
        else:
            which = [names[i] for i, (a, b) in enumerate(zip(saved, sources)) if a != b]
            what = f"other data in source(s) {', '.join(which)} (shard lists or layouts differ)"
        raise InvalidArgumentError(
            f"the state was saved on another mix: {what}. A mix resumes only with the same "
            "sources in the same order; resuming otherwise would repeat and skip items"
        )
    saved_options = state.get("mix_source_options")
    mine = options.get("mix_source_options")
    if saved_options is not None and mine is not None and saved_options != mine:
        for name, theirs, ours in zip(names, saved_options, mine, strict=False):
            if theirs != ours:
                raise InvalidArgumentError(
                    f"the state was saved with source {name} opened with order options "
                    f"{theirs}, but it now has {ours}; open it with the same options (seed, "
                    "shuffle, block_size, window) to resume"
                )
    for key in ("mix_version", "mix_counts", "mix_epoch_size", "seed"):
        if key in state and key in options and state[key] != options[key]:
            raise InvalidArgumentError(
                f"the state was saved with {key}={state[key]!r} but this mix has "
                f"{key}={options[key]!r}: every source's position counts from the start of the "
                "run, so a resume with other weights, window, epoch size or seed would repeat "
                "and skip items. Resume with the mix that saved the state (same weights and "
                "window=, epoch_size=, seed=)"
            )


def unique_names(urls: Iterable[str]) -> tuple[str, ...]:
    """Source names from URLs, with ``#k`` added to repeats (the same data mixed twice)."""
    out: list[str] = []
    for url in urls:
        name, k = url, 1
        while name in out:
            k += 1
            name = f"{url}#{k}"
        out.append(name)
    return tuple(out)
