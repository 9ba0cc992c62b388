"""One resume checker for every fastload loader: resume at every step, in other job shapes.

:func:`check_resume` takes a factory that builds a loader for one rank of a job and checks the
loaders' promise: ``load_state_dict(state)`` continues exactly where ``state_dict()`` was taken,
with the remaining samples exactly those not yet delivered, also (where the loader promises it)
with another number of workers or another world size at the same global batch size. ::

    def make(*, world_size, rank, batch_size, num_workers):
        return fastload.DataLoader(ds, batch_size=batch_size, rank=rank,
                                   world_size=world_size, num_workers=num_workers)

    check_resume(make, global_batch_size=4, sample_ids=lambda batch: batch["__key__"],
                 layouts=[Layout(2), Layout(2, num_workers=2), Layout(1), Layout(4)],
                 expected=all_keys)

What it does, for each epoch of ``epochs``:

1. **Reference**: every rank of ``layouts[0]`` iterates the epoch; the state after each batch
   is recorded, and must be the same on every rank. The epoch must deliver every expected sample
   exactly once, apart from at most ``world_size - 1`` repeats in its last global step (the
   padding of :class:`~fastload.loader.Partition`), or, with ``complete=False`` (``drop_last``),
   a subset of them once each.
2. **Stop**: at a few steps, a fresh loader iterates ``k`` batches and stops; its state must be
   the one recorded (a loader must not count batches it prefetched but did not hand over).
3. **Resume**: for every ``k`` (0 to the end of the epoch) and every layout, fresh loaders of
   every rank load the state after ``k`` batches; ``len()`` (if the loader has one) must be the
   number of batches left, and what they yield must be the reference's remainder: batch for
   batch, sample identities in order, when the world size is the reference's; global step by
   global step (the ranks' batches in rank order) when it differs, apart from the padding,
   which depends on the world size. The next epoch of ``epochs`` must then start at step 0 and
   equal the reference's.

Failures raise :class:`ResumeMismatch` naming the epoch, the step, the layout and the first
difference. The cost is (steps + 1) x layouts resumed iterations, so use small datasets (tens
of samples) and few layouts with worker processes.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Sequence, Sized
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastload.errors import InvalidArgumentError

__all__ = [
    "Layout",
    "LoaderFactory",
    "ResumableLoader",
    "ResumeMismatch",
    "ResumeReport",
    "check_resume",
]


class ResumableLoader(Protocol):
    """What the checker needs of a loader (:class:`fastload.DataLoader` and friends)."""

    def __iter__(self) -> Iterator[Any]: ...

    def set_epoch(self, epoch: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class LoaderFactory(Protocol):
    """Builds the loader of one rank: ``batch_size`` is the per-rank batch of the layout."""

    def __call__(
        self, *, world_size: int, rank: int, batch_size: int, num_workers: int
    ) -> ResumableLoader: ...


@dataclass(frozen=True)
class Layout:
    """One shape of a job: ``world_size`` ranks, each loader with ``num_workers`` workers (passed
    to the factory as it is: the loader's own meaning, e.g. DALI's ``py_workers``)."""

    world_size: int
    num_workers: int = 0


class ResumeMismatch(AssertionError):
    """A loader broke its resume promise; the message says where and how."""


@dataclass
class ResumeReport:
    """What :func:`check_resume` ran (for a test to assert that it ran what it meant to).

    Attributes:
        steps: Global steps of each checked epoch in the reference layout.
        resumes: Resumed iterations (one per step, layout and rank).
        stops: Iterations stopped early whose state was compared.
    """

    steps: dict[int, int] = field(default_factory=dict)
    resumes: int = 0
    stops: int = 0


# Per rank, the sample ids of each batch, in yield order.
_RankBatches = list[list[Hashable]]


def check_resume(
    factory: LoaderFactory,
    *,
    global_batch_size: int,
    sample_ids: Callable[[Any], Iterable[Hashable]],
    layouts: Sequence[Layout],
    expected: Collection[Hashable] | None = None,
    complete: bool = True,
    epochs: Sequence[int] = (0, 1),
    stop_checks: int = 2,
) -> ResumeReport:
    """Check that loaders from ``factory`` resume exactly (see the module docstring).

    Args:
        factory: Builds one rank's loader of a layout.
        global_batch_size: Samples per global step; each layout's world size must divide it.
        sample_ids: The identities of a batch's samples, in batch order (keys, labels, ...).
        layouts: The job shapes; the first is the reference, every one (the reference too) is
            resumed into. Only list shapes the loader promises to resume into.
        expected: Every sample an epoch must deliver; ``None`` skips that check.
        complete: Whether every expected sample is delivered (``False`` with ``drop_last``).
        epochs: Epochs to check, in order; after a resume into one, the next one is iterated
            too (it must start at step 0).
        stop_checks: Steps (spread over the epoch) at which an early stop's state is checked.

    Raises:
        ResumeMismatch: The loader repeated, skipped or reordered samples across a resume, or
            its state depends on the rank or on prefetching.
        InvalidArgumentError: Bad arguments (no layouts, a world size that does not divide the
            global batch size).
    """
    if not layouts:
        raise InvalidArgumentError(
            "check_resume needs at least one layout (the first is the reference)"
        )
    for layout in layouts:
        if layout.world_size < 1 or global_batch_size % layout.world_size:
            raise InvalidArgumentError(
                f"world size {layout.world_size} does not divide the global batch size "
                f"{global_batch_size}"
            )
    checker = _Checker(factory, global_batch_size, sample_ids, layouts[0], complete)
    report = ResumeReport()
    reference, states = checker.reference(epochs)
    for e_index, epoch in enumerate(epochs):
        batches = reference[epoch]
        steps = len(batches[0])
        report.steps[epoch] = steps
        _check_exactly_once(batches, expected, complete, epoch, checker.ref_layout)
        following = epochs[e_index + 1] if e_index + 1 < len(epochs) else None
        then = (following, reference[following]) if following is not None else None
        for k in _spread(steps, stop_checks):
            checker.check_stop(epoch, k, states[epoch][k])
            report.stops += 1
        for k, layout in itertools.product(range(steps + 1), layouts):
            checker.check_resume(layout, epoch, k, states[epoch][k], batches, then)
            report.resumes += layout.world_size
    return report


@dataclass(frozen=True)
class _Checker:
    """The fixed parts of one :func:`check_resume` call."""

    factory: LoaderFactory
    global_batch_size: int
    sample_ids: Callable[[Any], Iterable[Hashable]]
    ref_layout: Layout
    complete: bool

    def loaders(self, layout: Layout) -> list[ResumableLoader]:
        """Fresh loaders of every rank of ``layout``."""
        return [
            self.factory(
                world_size=layout.world_size,
                rank=rank,
                batch_size=self.global_batch_size // layout.world_size,
                num_workers=layout.num_workers,
            )
            for rank in range(layout.world_size)
        ]

    def epoch_of(self, loader: ResumableLoader) -> _RankBatches:
        """The sample ids of each batch the next iteration of ``loader`` yields."""
        return [list(self.sample_ids(batch)) for batch in loader]

    def reference(
        self, epochs: Sequence[int]
    ) -> tuple[dict[int, list[_RankBatches]], dict[int, list[dict[str, Any]]]]:
        """Per epoch: each reference rank's batches; and the state after ``k`` batches (k = 0,
        1, ...), checked equal on every rank."""
        layout = self.ref_layout
        loaders = self.loaders(layout)
        reference: dict[int, list[_RankBatches]] = {}
        states: dict[int, list[dict[str, Any]]] = {}
        for epoch in epochs:
            per_rank: list[_RankBatches] = []
            rank_states: list[list[dict[str, Any]]] = []
            for loader in loaders:
                loader.set_epoch(epoch)
                recorded = [loader.state_dict()]
                batches: _RankBatches = []
                for batch in loader:
                    batches.append(list(self.sample_ids(batch)))
                    recorded.append(loader.state_dict())
                per_rank.append(batches)
                rank_states.append(recorded)
            if len({len(b) for b in per_rank}) != 1:
                raise ResumeMismatch(
                    f"epoch {epoch}, {layout}: the ranks yield different numbers of batches "
                    f"{[len(b) for b in per_rank]}; every rank must yield the same number"
                )
            for rank, recorded in enumerate(rank_states[1:], start=1):
                for k, (mine, first) in enumerate(zip(recorded, rank_states[0], strict=True)):
                    if mine != first:
                        raise ResumeMismatch(
                            f"epoch {epoch}, {layout}: after {k} batches rank {rank}'s state "
                            f"{mine} differs from rank 0's {first}; a state must not depend on "
                            "the rank"
                        )
            reference[epoch] = per_rank
            states[epoch] = rank_states[0]
        return reference, states

    def check_stop(self, epoch: int, k: int, state: dict[str, Any]) -> None:
        """A loader stopped after ``k`` batches reports the state recorded after the k-th."""
        loader = self.loaders(self.ref_layout)[0]
        loader.set_epoch(epoch)
        it = iter(loader)
        for _ in itertools.islice(it, k):
            pass
        close = getattr(it, "close", None)
        if callable(close):
            close()
        got = loader.state_dict()
        if got != state:
            raise ResumeMismatch(
                f"epoch {epoch}, {self.ref_layout}: stopped after {k} batches the state is "
                f"{got}, but it was {state} right after the {k}-th batch; only batches handed "
                "over may count"
            )

    def check_resume(
        self,
        layout: Layout,
        epoch: int,
        k: int,
        state: dict[str, Any],
        reference: list[_RankBatches],
        then: tuple[int, list[_RankBatches]] | None,
    ) -> None:
        """Resume every rank of ``layout`` from ``state`` (taken after ``k`` batches of
        ``epoch``) and compare the rest of the epoch, then the ``then`` epoch, with the
        reference."""
        loaders = self.loaders(layout)
        where = (
            f"epoch {epoch}, resumed after {k} batches into {layout} (reference {self.ref_layout})"
        )
        left = len(reference[0]) - k
        rest: list[_RankBatches] = []
        for rank, loader in enumerate(loaders):
            loader.load_state_dict(state)
            loader.set_epoch(epoch)  # the usual loop: the saved epoch keeps the resume
            if isinstance(loader, Sized) and len(loader) != left:
                raise ResumeMismatch(
                    f"{where}: rank {rank} has len() {len(loader)}, but {left} batches are left"
                )
            rest.append(self.epoch_of(loader))
        self.compare(where, layout, rest, reference, k)
        if then is not None:
            following, following_reference = then
            after = []
            for loader in loaders:
                loader.set_epoch(following)
                after.append(self.epoch_of(loader))
            self.compare(f"{where}, then epoch {following}", layout, after, following_reference, 0)

    def compare(
        self,
        where: str,
        layout: Layout,
        got: list[_RankBatches],
        reference: list[_RankBatches],
        first: int,
    ) -> None:
        """``got`` (each rank's batches from global step ``first`` on) against the reference:
        batch for batch in the reference's world size, global step by global step in another."""
        if layout.world_size == self.ref_layout.world_size:
            for rank, (mine, ref) in enumerate(zip(got, reference, strict=True)):
                _compare(f"{where}, rank {rank}", mine, ref[first:], first)
            return
        steps = _global_steps(reference)
        max_repeats = layout.world_size - 1 if self.complete else 0
        _compare_global(where, steps[:first], _global_steps(got), steps[first:], first, max_repeats)


def _check_exactly_once(
    per_rank: list[_RankBatches],
    expected: Collection[Hashable] | None,
    complete: bool,
    epoch: int,
    layout: Layout,
) -> None:
    """Every sample once (or a subset once, ``complete=False``), repeats only as padding."""
    steps = _global_steps(per_rank)
    counts = Counter(i for step in steps for i in step)
    where = f"epoch {epoch}, {layout}"
    if expected is not None:
        unknown = set(counts) - set(expected)
        if unknown:
            raise ResumeMismatch(f"{where}: delivered samples not in the dataset: {unknown}")
        missing = set(expected) - set(counts)
        if complete and missing:
            raise ResumeMismatch(f"{where}: samples never delivered: {sorted(map(repr, missing))}")
    head = Counter(i for step in steps[:-1] for i in step)
    if any(n > 1 for n in head.values()):
        raise ResumeMismatch(
            f"{where}: samples delivered twice before the last global step: "
            f"{sorted(repr(i) for i, n in head.items() if n > 1)}"
        )
    repeats = sum(counts.values()) - len(counts)
    allowed = layout.world_size - 1 if complete else 0
    if repeats > allowed:
        raise ResumeMismatch(
            f"{where}: {repeats} samples delivered twice; padding allows at most {allowed}"
        )


def _global_steps(per_rank: list[_RankBatches]) -> list[list[Hashable]]:
    """The samples of each global step: the ranks' batches of that step, in rank order."""
    return [[i for batch in step for i in batch] for step in zip(*per_rank, strict=True)]


def _compare(where: str, got: list[list[Hashable]], want: list[list[Hashable]], first: int) -> None:
    if len(got) != len(want):
        raise ResumeMismatch(
            f"{where}: {len(got)} batches after the resume, expected {len(want)} (steps "
            f"{first}..{first + len(want) - 1})"
        )
    for j, (g, w) in enumerate(zip(got, want, strict=True)):
        if g != w:
            raise ResumeMismatch(f"{where}: global step {first + j} gave {g}, expected {w}")


def _compare_global(
    where: str,
    head: list[list[Hashable]],
    got: list[list[Hashable]],
    want: list[list[Hashable]],
    first: int,
    max_repeats: int,
) -> None:
    """Compare global steps of two world sizes: the same new samples per step, in order; repeats
    (padding, which depends on the world size) of samples delivered earlier are left out, and
    there may be at most ``max_repeats`` of them in the whole epoch."""
    seen = {i for step in head for i in step}
    if len(got) != len(want):
        raise ResumeMismatch(
            f"{where}: {len(got)} global steps after the resume, expected {len(want)}"
        )
    seen_want = set(seen)
    for j, (g, w) in enumerate(zip(got, want, strict=True)):
        new_g = [i for i in g if i not in seen]
        new_w = [i for i in w if i not in seen_want]
        if new_g != new_w:
            raise ResumeMismatch(
                f"{where}: global step {first + j} gave {new_g} (not counting repeats), "
                f"expected {new_w}"
            )
        seen.update(g)
        seen_want.update(w)
    before = [i for step in head for i in step]
    delivered = [*before, *(i for step in got for i in step)]
    # The reference's own padding (when the head reaches its last step) is not the resume's.
    repeats = (len(delivered) - len(set(delivered))) - (len(before) - len(set(before)))
    if repeats > max_repeats:
        raise ResumeMismatch(
            f"{where}: {repeats} samples delivered twice in the epoch; padding allows at most "
            f"{max_repeats}"
        )


def _spread(steps: int, count: int) -> list[int]:
    """Up to ``count`` distinct steps in ``1 .. steps - 1``, spread evenly."""
    inner = list(range(1, steps))
    if count <= 0 or not inner:
        return []
    if count >= len(inner):
        return inner
    return sorted({inner[(len(inner) - 1) * j // max(1, count - 1)] for j in range(count)})
