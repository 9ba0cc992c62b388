"""Record sources: samples that are records of files (JSON Lines, text lines), read in groups.

:class:`RecordSource` is also the base of the table sources (:mod:`._tables`) and of
:class:`~fastload.convert.sources._shards.ShardSource`.
"""

from __future__ import annotations

import itertools
import json
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from fastload.convert.sources._base import (
    ItemError,
    PlanReporter,
    Source,
    Unit,
    field_value_bytes,
    key_stem,
    sanitize_field_name,
    sanitize_key,
)
from fastload.errors import CorruptDataError, FastloadError
from fastload.formats import KEY
from fastload.storage import Store

__all__ = ["JsonlSource", "RecordSource", "TextSource", "record_key", "record_sample"]


def record_key(stem: str, index: int) -> str:
    """``<stem>/<index, 9 digits>``, sanitized: the key of a record that names none itself."""
    return sanitize_key(f"{stem}/{index:09d}")


class RecordSource(Source):
    """Units are records of files; ``ref = (file key, group, record index)``.

    ``group`` is the file's row group (Parquet) or 0. Reading groups the units by file and group,
    reads each group once, and yields in the order asked (buffering when the order is shuffled).
    """

    def _file_stem(self, key: str) -> str:
        return key_stem(key)

    @abstractmethod
    def _read_group(
        self, key: str, group: int, indices: Sequence[int]
    ) -> Iterator[tuple[int, dict[str, Any] | Exception]]:
        """Yield ``(index, sample or error)`` for the sorted record ``indices`` of one group."""

    def read_units(
        self, units: Sequence[Unit]
    ) -> Iterator[tuple[Unit, dict[str, Any] | Exception]]:
        ordered = all(a.ref[:3] < b.ref[:3] for a, b in itertools.pairwise(units))
        if not ordered:
            # Shuffled: read every group the units need once, then emit in the order asked.
            yield from self._read_buffered(units)
            return
        pos = 0
        while pos < len(units):  # runs of one group stream without buffering
            key, group = units[pos].ref[0], units[pos].ref[1]
            end = pos + 1
            while end < len(units) and units[end].ref[:2] == (key, group):
                end += 1
            run = units[pos:end]
            results = self._read_group(key, group, [u.ref[2] for u in run])
            yield from _zip_results(run, results, self._item_error)
            pos = end

    def _read_buffered(
        self, units: Sequence[Unit]
    ) -> Iterator[tuple[Unit, dict[str, Any] | Exception]]:
        wanted: dict[tuple[str, int], list[int]] = {}
        for u in units:
            wanted.setdefault((u.ref[0], u.ref[1]), []).append(u.ref[2])
        got: dict[tuple[str, int, int], dict[str, Any] | Exception | None] = {}
        for (key, group), indices in sorted(wanted.items()):
            for index, result in self._read_group(key, group, sorted(indices)):
                got[(key, group, index)] = result
        for u in units:
            found = got.pop((u.ref[0], u.ref[1], u.ref[2]), None)
            yield u, found if found is not None else self._item_error(u, "was not found")

    @staticmethod
    def _item_error(unit: Unit, reason: str) -> Exception:
        return ItemError(f"{unit.item} {reason}")


def _zip_results(
    run: Sequence[Unit],
    results: Iterable[tuple[int, dict[str, Any] | Exception]],
    item_error: Callable[[Unit, str], Exception],
) -> Iterator[tuple[Unit, dict[str, Any] | Exception]]:
    by_index = {u.ref[2]: u for u in run}
    done = 0
    for index, result in results:
        unit = by_index.get(index)
        if unit is None:
            continue
        # Results come in ascending order; fill any unit the reader passed over.
        while run[done].ref[2] < index:
            yield run[done], item_error(run[done], "was not found in the input")
            done += 1
        yield unit, result
        done += 1
    while done < len(run):
        yield run[done], item_error(run[done], "was not found in the input")
        done += 1


def _lines(store: Store, key: str) -> Iterator[tuple[int, int, int]]:
    """``(line index, byte offset, length without the line break)`` of each non-blank line."""
    offset = 0
    with store.open_reader(key) as f:
        for n, line in enumerate(f):
            length = len(line)
            body = line.rstrip(b"\r\n")
            if body.strip():
                yield n, offset, len(body)
            offset += length


class _LineSource(RecordSource):
    """One sample per non-blank line; ``ref = (file key, 0, line index)`` plus the byte span."""

    @property
    def replannable(self) -> bool:
        return True

    def plan_units(self, report: PlanReporter) -> Iterator[Unit]:
        for meta in self.listing(report):
            try:
                for n, offset, length in _lines(self.store, meta.key):
                    yield Unit(f"{meta.key}:{n + 1}", (meta.key, 0, n, offset, length), length)
            except (OSError, FastloadError) as exc:
                report(meta.key, f"cannot be read: {exc}")

    def read_units(
        self, units: Sequence[Unit]
    ) -> Iterator[tuple[Unit, dict[str, Any] | Exception]]:
        # Lines carry their byte span: read runs of nearby lines with one ranged get each.
        from fastload.storage import ByteRange

        pos = 0
        while pos < len(units):
            key, _, _, start, length = units[pos].ref
            end_byte = start + length
            end = pos + 1
            while end < len(units):
                k, _, _, s, n = units[end].ref
                if k != key or s < end_byte or s - end_byte > 65536 or s + n - start > 16 << 20:
                    break
                end_byte = s + n
                end += 1
            try:
                blob = memoryview(self.store.get(key, ByteRange(start, end_byte)))
            except (OSError, FastloadError) as exc:
                for u in units[pos:end]:
                    yield u, exc
                pos = end
                continue
            for u in units[pos:end]:
                _, _, n, s, length = u.ref
                yield u, self._parse(u, key, n, bytes(blob[s - start : s - start + length]))
            pos = end

    def _read_group(
        self, key: str, group: int, indices: Sequence[int]
    ) -> Iterator[
        tuple[int, dict[str, Any] | Exception]
    ]:  # pragma: no cover - read_units overrides
        raise NotImplementedError

    @abstractmethod
    def _parse(self, unit: Unit, key: str, line: int, data: bytes) -> dict[str, Any] | Exception:
        """The sample of one line."""


class TextSource(_LineSource):
    """Plain text: one sample per non-blank line, field ``txt`` = the line's bytes without its
    line break. Key: ``<file stem>/<0-based line index, 9 digits>``."""

    type_name = "text"

    def _parse(self, unit: Unit, key: str, line: int, data: bytes) -> dict[str, Any] | Exception:
        return {KEY: record_key(self._file_stem(key), line), "txt": data}


def record_sample(
    record: Mapping[str, Any], default_key: str, item: str
) -> dict[str, Any] | Exception:
    """A sample from a structured record: ``__key__`` (a str) is honoured, other entries become
    fields (names sanitized, values per :func:`field_value_bytes`)."""
    key = record.get(KEY)
    if key is not None and not isinstance(key, str):
        return ItemError(f"{item}: '__key__' must be a string, got {type(key).__name__}")
    sample: dict[str, Any] = {KEY: sanitize_key(key) if key else default_key}
    for name, value in record.items():
        if name == KEY:
            continue
        field = sanitize_field_name(str(name))
        try:
            data = field_value_bytes(value)
        except (TypeError, ValueError) as exc:
            return ItemError(f"{item}: field {name!r} cannot be stored: {exc}")
        if data is None:
            continue
        if field in sample:
            return ItemError(f"{item}: fields {name!r} and another both map to field {field!r}")
        sample[field] = data
    return sample


class JsonlSource(_LineSource):
    """JSON Lines: one sample per non-blank line, which must be a JSON object.

    Each entry becomes a field named by its key (sanitized) with the value's bytes as described in
    the module docstring; a string ``__key__`` entry gives the sample key, otherwise the key is
    ``<file stem>/<0-based line index, 9 digits>``.
    """

    type_name = "jsonl"

    def _parse(self, unit: Unit, key: str, line: int, data: bytes) -> dict[str, Any] | Exception:
        try:
            record = json.loads(data)
        except ValueError as exc:
            return CorruptDataError(
                f"line {line + 1} is not valid JSON ({exc})", url=self.store.child_url(key)
            )
        if not isinstance(record, dict):
            return CorruptDataError(
                f"line {line + 1} is a JSON {type(record).__name__}, not an object",
                url=self.store.child_url(key),
            )
        return record_sample(record, record_key(self._file_stem(key), line), unit.item)
