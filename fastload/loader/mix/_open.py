"""``fastload.mix``: datasets mixed by weight, for the sample loader and the token loader alike.

One function for both kinds, as :func:`~fastload.loader.open_dataset` is one function for every
format: what it returns follows what it is given (sample datasets or their URLs: a
:class:`~fastload.loader.mix._samples.MixedDataset` for :class:`fastload.DataLoader`; token
sources: a :class:`~fastload.loader.mix._tokens.MixedTokens` for the token loader), and the
arithmetic behind both is the same (:mod:`fastload.loader.mix._schedule`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar, overload

from fastload.errors import InvalidArgumentError
from fastload.formats.tokens import METADATA_KEY
from fastload.loader._dataset import Dataset
from fastload.loader._open import open_dataset
from fastload.loader.mix._samples import MixedDataset
from fastload.loader.mix._schedule import mix_counts, unique_names
from fastload.loader.mix._tokens import MixedTokens
from fastload.loader.tokens._source import TokenSource

__all__ = ["mix"]

_Tokens = TypeVar("_Tokens", bound=TokenSource)
_Samples = TypeVar("_Samples", bound=Dataset | str | os.PathLike[str])


@overload
def mix(
    sources: Mapping[_Tokens, float] | Sequence[tuple[_Tokens, float]],
    *,
    seed: int = 0,
    window: int | None = None,
    epoch_size: int | None = None,
) -> MixedTokens: ...


@overload
def mix(
    sources: Mapping[_Samples, float] | Sequence[tuple[_Samples, float]],
    *,
    seed: int = 0,
    window: int | None = None,
    epoch_size: int | None = None,
) -> MixedDataset: ...


def mix(
    sources: Mapping[Any, float] | Sequence[tuple[Any, float]],
    *,
    seed: int = 0,
    window: int | None = None,
    epoch_size: int | None = None,
) -> MixedDataset | MixedTokens:
    """Mix datasets by weight: exact proportions in every window, resumable and elastic.

    ``fastload.mix({"data/a": 0.7, "data/b": 0.3})`` gives a dataset for
    :class:`fastload.DataLoader` in which every window of ``M`` consecutive samples (here 10)
    holds exactly ``M x weight`` samples of each source, spread evenly (so a batch of ``B`` holds
    ``B x weight`` of each rounded up or down, give or take one, and exactly that when ``M``
    divides ``B``). Given token sources, it gives a token source for the token loader.

    **What happens to each source.** The mix is one stream counted from the start of the run;
    mix epoch ``e`` is its positions ``[e x L, (e + 1) x L)`` (``L = epoch_size``). A source of
    ``N`` items delivers its items in its own epoch order (its own seed and shuffle), each exactly
    once per own epoch; when it runs out it starts its next own epoch (a new order) right away,
    also in the middle of a mix epoch. So a source weighted above its share of ``L`` repeats
    (in new orders) within a mix epoch, and one weighted below it continues its own epoch in the
    next mix epoch. ``L`` defaults to the sources' total rounded up to a multiple of ``M``.

    **Determinism and resumption.** Everything is a pure function of (the sources and their
    seeds, the weights, ``M``, ``L``, the mix epoch): a loader's O(1) state (epoch, step) resumes
    it exactly, with any number of workers and any world size of the same global batch. A
    state records the sources' fingerprints, the counts, ``M``, ``L`` and ``seed``: resuming with
    other ones is refused (it would repeat and skip items), naming what differs.

    Args:
        sources: ``{source: weight}`` (or ``[(source, weight), ...]`` to mix the same dataset
            twice). Sources are all sample datasets (:func:`fastload.open_dataset` results, used
            as they are, or URLs, opened with ``open_dataset(url, seed=seed)``), or all token
            sources (:class:`~fastload.loader.tokens._source.TokenSource`, e.g. from
            :func:`fastload.open_tokens`, with one ``seq_len``). Weights are positive numbers; only their
            ratios matter; floats count as the decimals they print as (``0.7`` is 7/10).
        seed: The seed URLs are opened with; for sample mixes also the seed of each delivery's
            augmentation (``"__rng_seed__"``) and of the workers' global generators.
        window: ``M``, positions per window; ``None``: the smallest window in which the weights
            are exact (at most 10,000; beyond it they are rounded, see below).
        epoch_size: ``L``, positions (samples or sequences) per mix epoch.

    Returns:
        A :class:`~fastload.loader.mix._samples.MixedDataset` or
        :class:`~fastload.loader.mix._tokens.MixedTokens`; both have ``plan.counts``,
        ``plan.window`` and ``plan.weights`` (the effective weights), ``plan.epoch_counts(e)``
        and ``sources``. :meth:`fastload.DataLoader.stats` counts ``samples[<name>]`` per
        source (names: the sources' URLs).

    Raises:
        InvalidArgumentError: No sources, a weight that is not positive, a weight too small for
            the window, sample datasets mixed with token sources, a URL of a token dataset
            (open it with :func:`fastload.open_tokens` and mix the token source), sources that
            cannot be collated together (other ``fields``, ``on_error``, ``seq_len``).

    Warns:
        MixRoundingWarning: The weights are not exact in the window; the message gives the
            effective weights and the window that would make them exact.
    """
    pairs = list(sources.items()) if isinstance(sources, Mapping) else list(sources)
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise InvalidArgumentError(
                f"mix takes {{source: weight}} or [(source, weight), ...], got an item {pair!r}"
            )
    if not pairs:
        raise InvalidArgumentError("mix needs at least one source: {source: weight, ...}")
    items = [s for s, _ in pairs]
    weights = [w for _, w in pairs]
    tokens = [isinstance(s, TokenSource) for s in items]
    if all(tokens):
        names = unique_names(s.url for s in items)
        counts = mix_counts(weights, window, names=names)
        return MixedTokens(items, counts, epoch_size=epoch_size, seed=seed, names=names)
    if any(tokens):
        i = tokens.index(True)
        raise InvalidArgumentError(
            f"source {i} ({items[i].url}) is a token source, but other sources are sample "
            "datasets; a mix takes one kind"
        )
    datasets = []
    for i, source in enumerate(items):
        if isinstance(source, str | os.PathLike):
            source = open_dataset(source, seed=seed)
            if METADATA_KEY in source.manifest.metadata:
                raise InvalidArgumentError(
                    f"{source.url} is a token dataset: open each token dataset with "
                    f"fastload.open_tokens(url, seq_len=..., seed=...) and mix those, e.g. "
                    f"fastload.mix({{fastload.open_tokens({str(source.url)!r}, seq_len=2048): "
                    "0.7, ...}})"
                )
        elif not isinstance(source, Dataset):
            raise InvalidArgumentError(
                f"source {i} of the mix is a {type(source).__name__}; pass datasets from "
                "fastload.open_dataset, their URLs, or token sources"
            )
        datasets.append(source)
    names = unique_names(d.url for d in datasets)
    counts = mix_counts(weights, window, names=names)
    return MixedDataset(datasets, counts, epoch_size=epoch_size, seed=seed, names=names)
