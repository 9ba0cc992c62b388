"""A conversion without a sample is an error, never an empty dataset (``convert``'s two cases).

* :func:`no_samples`: the source gives no sample to plan (an empty input, or every item left out
  while planning): nothing is written.
* :func:`nothing_kept`: every planned sample was skipped (``on_error="skip"``) or dropped by the
  map function: the skip report is written and named, no manifest, and the empty shards and the
  conversion state are removed so that a re-run starts afresh.
"""

from __future__ import annotations

from fastload.convert._progress import plural
from fastload.convert._results import SkippedItem
from fastload.convert._state import SKIPPED_KEY, clear_state
from fastload.convert.sources import Source
from fastload.errors import ConversionError, InvalidArgumentError
from fastload.storage import Store

__all__ = ["no_samples", "nothing_kept"]


def no_samples(source: Source, skipped: list[SkippedItem]) -> InvalidArgumentError:
    """The error of a source that gives no sample to plan; names the items left out while
    planning and why (under ``on_error="skip"`` nothing else has said it)."""
    where = source.store.url
    if source.keys is not None and len(source.keys) == 1:
        where = source.store.child_url(source.keys[0])
    why = ""
    if skipped:
        shown = "; ".join(f"{s.item}: {s.reason}" for s in skipped[:3])
        more = f"; and {len(skipped) - 3} more" if len(skipped) > 3 else ""
        why = f"; {plural(len(skipped), 'item')} left out: {shown}{more}"
    return InvalidArgumentError(
        f"no samples to convert in {where} (source type {source.type_name}{why}); "
        "check the path and --source-type"
    )


def nothing_kept(
    store: Store, written: list[str], skipped: list[SkippedItem], dropped: int
) -> ConversionError:
    """A conversion that keeps no sample (each was skipped or dropped): the ``written`` empty
    shards and the state go (a re-run starts afresh), the skip report stays, and the error
    names it."""
    store.delete_many(written)
    clear_state(store)
    parts = [f"{plural(len(skipped), 'item')} skipped (on_error='skip')"] if skipped else []
    parts += [f"{plural(dropped, 'sample')} dropped by the map function"] if dropped else []
    text = f"no sample was kept: {' and '.join(parts)}, so {store.url} holds no dataset"
    if skipped:
        text += (
            f"; the reasons are in {store.child_url(SKIPPED_KEY)} (the first: "
            f"{skipped[0].item}: {skipped[0].reason})"
        )
    return ConversionError(f"{text}. Fix the input (or the map function) and convert again")
