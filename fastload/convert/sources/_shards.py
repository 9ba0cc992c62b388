"""Existing shards as a source: a fastload dataset, or a directory of third-party shards."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from fastload.convert.sources._base import PlanReporter, Unit
from fastload.convert.sources._records import RecordSource
from fastload.errors import FastloadError, FormatError, InvalidArgumentError
from fastload.formats import KEY, ErrorPolicy, ShardNames
from fastload.formats.manifest import MANIFEST_NAME, read_manifest
from fastload.storage import Store

__all__ = ["ShardSource"]


class _CollectErrors(ErrorPolicy):
    """A reader's ``on_error`` policy that goes on like ``skip`` and keeps every error."""

    def __init__(self) -> None:
        super().__init__("skip")
        self.caught: list[Exception] = []

    def handle(self, exc: FormatError) -> None:
        self.skipped += 1
        self.caught.append(exc)


class _Ended(Exception):
    """Wraps the error that ended a shard's reading early (in a list of skipped-past errors)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _errors_with_end(errors: Sequence[Exception]) -> Iterator[tuple[Exception, bool]]:
    """``(error, whether it ended the reading)`` for the errors :meth:`ShardSource._intact` kept."""
    for exc in errors:
        if isinstance(exc, _Ended):
            yield exc.error, True
        else:
            yield exc, False


def _damage_item(key: str, exc: Exception) -> str:
    """``shard@offset`` (the byte offset the error gives, in the decompressed stream for a
    compressed file), else the shard's key."""
    offset = getattr(exc, "offset", None)
    return f"{key}@{offset}" if isinstance(offset, int) else key


def _damage_reason(exc: Exception, ended: bool, kept: int) -> str:
    text = str(exc) or type(exc).__name__
    rest = "the rest of the file cannot be read" if ended else "the damaged part is left out"
    return f"damaged: {text}; {rest}, the {kept} intact samples of the file are converted"


class ShardSource(RecordSource):
    """Existing shards: a fastload dataset (its ``fastload.json`` lists the shards) or a directory
    of third-party WebDataset tars / TFRecords / LMDB shards (format by extension, confirmed by
    the format's ``detect``). Samples keep their keys and field bytes exactly.
    ``ref = (shard key, 0, sample position in the shard)``.
    """

    type_name = "shards"

    def __init__(self, store: Store, keys: Sequence[str] | None = None, **options: Any) -> None:
        super().__init__(store, keys, **options)
        self.format_name: str | None = options.get("format")

    def _shards(self, report: PlanReporter) -> list[tuple[str, int | None, int | None]]:
        """``(key, num_samples or None, num_bytes or None)`` per shard, in dataset order."""
        if self.keys is None and self.store.exists(MANIFEST_NAME):
            manifest = read_manifest(self.store)
            manifest.resolve_format(url=self.store.child_url(MANIFEST_NAME))  # fail, not skip
            self.format_name = manifest.format
            self._metadata = dict(manifest.metadata)
            return [(s.name, s.num_samples, s.num_bytes) for s in manifest.shards]
        out: list[tuple[str, int | None, int | None]] = []
        formats: set[str] = set()
        names = ShardNames.from_registry()
        for meta in self.listing(report):
            fmt = names.format_of(meta.key)
            if fmt is None:
                continue
            formats.add(fmt)
            out.append((meta.key, None, meta.size))
        if len(formats) > 1:
            raise InvalidArgumentError(
                f"{self.store.url} holds shards of several formats ({sorted(formats)}); convert "
                "one format at a time by pointing at a directory of one format"
            )
        if formats and self.format_name is None:
            self.format_name = formats.pop()
        return out

    def _format(self) -> Any:
        from fastload.formats import get_format

        if self.format_name is None:
            raise InvalidArgumentError(f"no shards found in {self.store.url}")
        return get_format(self.format_name)

    @property
    def replannable(self) -> bool:
        """A fastload dataset's units come from its manifest's counts; third-party shards are
        read whole to find their intact samples, which is not repeated."""
        return self.keys is None and self.store.exists(MANIFEST_NAME)

    def plan_units(self, report: PlanReporter) -> Iterator[Unit]:
        # The shard list is read now, not when the units are: it sets the format, which
        # describe() names.
        return self._units(self._shards(report), report)

    def _units(
        self, shards: Sequence[tuple[str, int | None, int | None]], report: PlanReporter
    ) -> Iterator[Unit]:
        for key, count, nbytes in shards:
            if count is not None:  # a fastload dataset: the manifest's count
                positions: Sequence[int] = range(count)
            else:
                # Read the shard once; its damage (each record the reader skips past, and what
                # ends the reading early) is reported, every intact sample is kept.
                errors: list[Exception] = []
                positions = [pos for pos, _ in self._intact(key, errors)]
                for exc, ended in _errors_with_end(errors):
                    report(_damage_item(key, exc), _damage_reason(exc, ended, len(positions)))
            per = max(1, (nbytes or 0) // max(1, len(positions)))
            yield from (Unit(f"{key}#{i}", (key, 0, i), per, 1) for i in positions)

    def _intact(
        self, key: str, errors: list[Exception], last: int | None = None
    ) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(position, sample)`` of every sample of shard ``key`` its reader delivers intact, in
        order, up to position ``last``. What the reader skips past goes to ``errors``; so does,
        last and wrapped in :class:`_Ended`, an error that ends the reading early (a truncated or
        undecompressable file: the samples before it are still yielded)."""
        policy = _CollectErrors()
        try:
            with self._format().reader(self.store, key) as reader:
                reader.policy = policy  # go on past damaged samples, and keep their errors
                for n, sample in enumerate(reader):
                    pos = sample.get("__index__")
                    if not isinstance(pos, int) or isinstance(pos, bool) or pos < n:
                        pos = n
                    yield (
                        pos,
                        {k: v for k, v in sample.items() if k == KEY or not k.startswith("__")},
                    )
                    if last is not None and pos >= last:
                        break
        except (OSError, FastloadError) as exc:
            errors.extend(policy.caught)
            errors.append(_Ended(exc))
            return
        errors.extend(policy.caught)

    def _read_group(
        self, key: str, group: int, indices: Sequence[int]
    ) -> Iterator[tuple[int, dict[str, Any] | Exception]]:
        wanted = set(indices)
        last = max(indices) if indices else -1
        errors: list[Exception] = []
        seen = -1
        for pos, sample in self._intact(key, errors, last):
            if pos in wanted:
                yield pos, sample
            seen = pos
        if seen < last and errors:  # the shard changed since it was planned
            exc = errors[-1]
            cause = exc.error if isinstance(exc, _Ended) else exc
            for i in indices:
                if i > seen:
                    yield i, cause

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out["format"] = self.format_name
        return out
