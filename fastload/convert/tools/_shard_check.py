"""One shard of ``fastload verify``: the checks that need only the shard, runnable in a worker.

:func:`check_shards` checks a run of manifest entries and returns one :class:`ShardCheck` per
entry, in order. Everything it returns is plain data (strings, ints, tuples), so that a worker
process can send it back cheaply; what spans shards (repeated keys, the schema's field counts)
is judged by :func:`fastload.convert.tools.verify_dataset` from these results, merged in shard
order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fastload.convert.tools._common import count_fields, sha256_of
from fastload.errors import (
    FastloadError,
    ObjectNotFoundError,
    StoreError,
    StoreUnavailableError,
)
from fastload.formats import DAMAGED_SHARD_REMEDY, Format, ShardEntry, ShardReader, get_format
from fastload.storage import Store

__all__ = ["ShardCheck", "check_shards", "store_failure"]

_REMEDY = DAMAGED_SHARD_REMEDY.removeprefix("; ")


@dataclass
class ShardCheck:
    """What checking one shard found.

    Attributes:
        problems: One sentence per problem, in the order the checks ran (exists, size, SHA-256,
            samples, index).
        samples: Samples read back.
        keys: Each sample's ``__key__`` in shard order (``None`` where it is not a string), for
            the repeated-key check across shards.
        field_sets: How many samples have each (sorted) set of field names.
        field_counts: How many samples have each field.
    """

    problems: list[str] = field(default_factory=list)
    samples: int = 0
    keys: list[str | None] = field(default_factory=list)
    field_sets: Counter[tuple[str, ...]] = field(default_factory=Counter)
    field_counts: dict[str, int] = field(default_factory=dict)


def check_shards(
    store: Store, format_name: str, entries: Sequence[ShardEntry], check_index: bool
) -> list[ShardCheck]:
    """Check each of ``entries`` (see :func:`check_shard`); the format is looked up by name so
    that the call pickles small."""
    fmt = get_format(format_name)
    return [check_shard(store, fmt, entry, check_index) for entry in entries]


def check_shard(store: Store, fmt: Format, entry: ShardEntry, check_index: bool) -> ShardCheck:
    """Check one shard against its manifest entry: it exists; its size and SHA-256 match;
    reading it yields the entry's sample count without errors; and, with ``check_index``, its
    index (rebuilt with the format's ``build_index``) equals the stored one byte for byte.

    A damaged shard never raises here: every fault becomes a problem sentence. A store that
    could not be read (the network, the server: :func:`store_failure`) is no fault of the shard
    and gives no verdict: that error is raised.
    """
    check = ShardCheck()
    where = store.child_url(entry.name)
    try:
        sha, size = sha256_of(store, entry.name)
    except ObjectNotFoundError:
        check.problems.append(f"{where}: shard is missing")
        return check
    except (OSError, FastloadError) as exc:
        _raise_store_failure(exc)
        check.problems.append(f"{where}: cannot be read: {exc}")
        return check
    if size != entry.num_bytes:
        check.problems.append(
            f"{where}: size is {size} bytes, the manifest says {entry.num_bytes} "
            f"({'truncated' if size < entry.num_bytes else 'changed'}); {_REMEDY}"
        )
    if sha != entry.sha256:
        check.problems.append(
            f"{where}: SHA-256 is {sha}, the manifest says {entry.sha256} (the shard's "
            f"bytes changed); {_REMEDY}"
        )
    rebuilt = _read_back(store, fmt, entry, check)
    if check_index:
        _check_index(store, fmt, entry, check, rebuilt)
    return check


def _read_back(
    store: Store, fmt: Format, entry: ShardEntry, check: ShardCheck
) -> Callable[[], bytes | None]:
    """Read every sample of the shard, noting keys and fields, and the problems met; return what
    rebuilds its index (from the same pass where the reader can: see
    :meth:`~fastload.formats.ShardReader.iter_and_index`)."""
    where = store.child_url(entry.name)
    reader: ShardReader | None = None
    build = fmt.build_index or (lambda _store, _key: None)
    rebuilt: Callable[[], bytes | None] = lambda: build(store, entry.name)  # noqa: E731
    try:
        reader = fmt.reader(
            store,
            entry.name,
            on_error="skip",
            num_samples=entry.num_samples,
            num_bytes=entry.num_bytes,
        )
        samples, rebuilt = reader.iter_and_index(build)
        for sample in samples:
            key = sample.get("__key__")
            check.keys.append(key if isinstance(key, str) else None)
            check.field_sets[tuple(sorted(k for k in sample if not k.startswith("__")))] += 1
            check.samples += 1
            count_fields(sample, check.field_counts)
    except (OSError, FastloadError) as exc:
        _raise_store_failure(exc)
        check.problems.append(f"{where}: reading failed after {check.samples} samples: {exc}")
    except Exception as exc:  # a damaged shard must never crash verify: report it
        check.problems.append(
            f"{where}: reading failed after {check.samples} samples with an unexpected "
            f"{type(exc).__name__}: {exc} (please report this as a fastload bug)"
        )
    else:
        if reader.skipped:
            first = reader.policy.errors[0] if reader.policy.errors else "?"
            check.problems.append(
                f"{where}: {reader.skipped} damaged sample(s) or region(s), {check.samples} "
                f"intact samples read; first damage: {first}; {_REMEDY}"
            )
        elif check.samples != entry.num_samples:
            check.problems.append(
                f"{where}: holds {check.samples} samples, the manifest says {entry.num_samples}"
            )
    finally:
        if reader is not None:
            reader.close()
    return rebuilt


def store_failure(exc: BaseException) -> StoreError | None:
    """The error in ``exc``'s chain (itself, its ``__cause__``/``__context__``) that says the
    store could not be read, not that the data is damaged: a
    :class:`~fastload.errors.StoreUnavailableError` (the retries ran out) or a retryable
    :class:`~fastload.errors.StoreError` (a store without retries); else None."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and len(seen) < 32 and all(current is not e for e in seen):
        if isinstance(current, StoreUnavailableError) or (
            isinstance(current, StoreError) and current.retryable
        ):
            return current
        seen.append(current)
        current = current.__cause__ or current.__context__
    return None


def _raise_store_failure(exc: BaseException) -> None:
    """Raise the store failure in ``exc``'s chain, if there is one (see :func:`store_failure`)."""
    failure = store_failure(exc)
    if failure is not None:
        raise failure from failure.__cause__  # keeps its own chain


def _first_difference(a: bytes, b: bytes) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _check_index(
    store: Store,
    fmt: Format,
    entry: ShardEntry,
    check: ShardCheck,
    rebuild: Callable[[], bytes | None],
) -> None:
    where = store.child_url(entry.name)
    if fmt.build_index is None:
        if entry.index:
            check.problems.append(
                f"{where}: the manifest names an index {entry.index!r}, but the {fmt.name} "
                "format has none"
            )
        return
    if not entry.index:
        return
    try:
        stored = store.get(entry.index)
    except ObjectNotFoundError:
        check.problems.append(
            f"{store.child_url(entry.index)}: index is missing; rebuild it with `fastload index`"
        )
        return
    try:
        expected = rebuild()
    except Exception as exc:  # a damaged shard (reported above) cannot be indexed
        _raise_store_failure(exc)
        check.problems.append(f"{where}: cannot rebuild its index to compare: {exc}")
        return
    if expected is not None and stored != expected:
        check.problems.append(
            f"{store.child_url(entry.index)}: index differs from the shard's contents "
            f"({len(stored)} bytes stored, {len(expected)} expected, first difference at byte "
            f"{_first_difference(stored, expected)}); rebuild it with `fastload index "
            f"{store.url}`"
        )
