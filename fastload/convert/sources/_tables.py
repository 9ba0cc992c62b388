"""Table sources: CSV and Parquet files read with pyarrow, one sample per row."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

from fastload.convert.sources._base import PlanReporter, Unit, sanitize_field_name
from fastload.convert.sources._records import RecordSource, record_key, record_sample
from fastload.errors import CorruptDataError, FastloadError, MissingDependencyError
from fastload.formats import KEY

__all__ = ["CsvSource", "ParquetSource"]


def _pyarrow(module: str) -> Any:
    from fastload._plugins import require

    return require(module, extra="parquet", feature="converting CSV and Parquet")


class _TableSource(RecordSource):
    """Shared column handling of CSV and Parquet: every file must have the same columns."""

    @property
    def replannable(self) -> bool:
        return True

    def _check_columns(
        self, key: str, names: list[str], first: list[str] | None, report: PlanReporter
    ) -> bool:
        if first is not None and names != first:
            report(
                key,
                f"has columns {names}, but the first file has {first}; every file must have the "
                "same columns (inconsistent columns)",
            )
            return False
        fields = [sanitize_field_name(n) for n in names if n != KEY]
        if len(set(fields)) != len(fields):
            report(key, f"columns {names} map to duplicate field names {fields}")
            return False
        return True

    #: How a file that pyarrow cannot parse is reported (``"is not valid CSV"``).
    _invalid: ClassVar[str] = "is not a valid table"

    def _table(self, key: str) -> tuple[list[str], Iterable[tuple[int, int, int]], Any]:
        """The column names of file ``key``, its groups of rows in order as ``(group, rows,
        bytes)``, and its schema (for :meth:`_check_file`)."""
        raise NotImplementedError

    def _check_file(self, key: str, schema: Any, first: bool, report: PlanReporter) -> bool:
        """Whether file ``key`` (the ``first`` one planned, or a later one) may be planned, its
        columns being right; ``report`` it if not. Every file may, unless a source says."""
        return True

    def plan_units(self, report: PlanReporter) -> Iterator[Unit]:
        first: list[str] | None = None
        for meta in self.listing(report):
            try:
                names, groups, schema = self._table(meta.key)
                if not self._check_columns(meta.key, names, first, report):
                    continue
                if not self._check_file(meta.key, schema, first is None, report):
                    continue
                first = first or names
                row = 0
                for group, num_rows, nbytes in groups:
                    per_row = max(1, nbytes // max(1, num_rows))
                    for _ in range(num_rows):
                        ref = (meta.key, group, row)
                        yield Unit(f"{meta.key}:row {row}", ref, per_row, len(names))
                        row += 1
            except MissingDependencyError:
                raise  # the whole source needs it: not an error of this file
            except (OSError, FastloadError) as exc:
                report(meta.key, f"cannot be read: {exc}")
            except Exception as exc:  # pyarrow.ArrowInvalid and friends
                report(meta.key, f"{self._invalid}: {exc}")

    def _group_rows(
        self,
        key: str,
        indices: Sequence[int],
        load: Callable[[], tuple[int, list[dict[str, Any]]]],
        what: str,
    ) -> Iterator[tuple[int, dict[str, Any] | Exception]]:
        """The samples of the rows ``indices`` of one group, which ``load()`` reads as ``(index
        of its first row in the file, its rows)``; if it fails, ``what`` failed for each."""
        try:
            first_row, records = load()
        except MissingDependencyError:
            raise
        except Exception as exc:
            err = self._read_error(key, exc, what)
            for i in indices:
                yield i, err
            return
        yield from self._rows(
            key, ((i, records[i - first_row]) for i in indices if 0 <= i - first_row < len(records))
        )

    def _read_error(self, key: str, exc: Exception, what: str) -> Exception:
        """The error of every row ``_read_group`` could not read: ``exc`` itself when it is a
        read error (``OSError``, fastload's own), else a :class:`CorruptDataError` saying
        ``what`` failed (a pyarrow parse error) and naming the file."""
        if isinstance(exc, (OSError, FastloadError)):
            return exc
        return CorruptDataError(f"{what}: {exc}", url=self.store.child_url(key))

    def _rows(
        self, key: str, rows: Iterable[tuple[int, Mapping[str, Any]]]
    ) -> Iterator[tuple[int, dict[str, Any] | Exception]]:
        stem = self._file_stem(key)
        for index, row in rows:
            yield index, record_sample(row, record_key(stem, index), f"{key}:row {index}")


class CsvSource(_TableSource):
    """CSV with a header row (read with pyarrow): one sample per row, columns become fields.

    Cells are kept as their text (UTF-8 bytes); empty cells omit the field. A ``__key__`` column
    gives the sample key, otherwise ``<file stem>/<0-based row index, 9 digits>``. Every file must
    have the same header.
    """

    type_name = "csv"
    _invalid = "is not valid CSV"

    def _open(self, key: str, names: list[str] | None) -> Any:
        pa = _pyarrow("pyarrow")
        csv = _pyarrow("pyarrow.csv")
        convert = (
            csv.ConvertOptions(
                column_types={n: pa.string() for n in names}, strings_can_be_null=True
            )
            if names is not None
            else None
        )
        return csv.open_csv(
            self.store.open_reader(key),
            read_options=csv.ReadOptions(block_size=1 << 22),
            convert_options=convert,
        )

    def _table(self, key: str) -> tuple[list[str], Iterable[tuple[int, int, int]], Any]:
        names = list(self._open(key, None).schema.names)
        batches = self._open(key, names)
        return names, ((0, b.num_rows, b.nbytes) for b in batches), None

    def _read_group(
        self, key: str, group: int, indices: Sequence[int]
    ) -> Iterator[tuple[int, dict[str, Any] | Exception]]:
        wanted = iter(indices)
        nxt = next(wanted, None)
        try:
            names = list(self._open(key, None).schema.names)
            row = 0
            for batch in self._open(key, names):
                if nxt is None:
                    return
                if nxt >= row + batch.num_rows:
                    row += batch.num_rows
                    continue
                records = batch.to_pylist()
                picked = []
                while nxt is not None and nxt < row + len(records):
                    picked.append((nxt, records[nxt - row]))
                    nxt = next(wanted, None)
                yield from self._rows(key, picked)
                row += len(records)
        except MissingDependencyError:
            raise
        except Exception as exc:
            err = self._read_error(key, exc, "cannot read CSV")
            while nxt is not None:
                yield nxt, err
                nxt = next(wanted, None)


class ParquetSource(_TableSource):
    """Parquet (read with pyarrow, one row group at a time): one sample per row.

    Binary columns stay bytes; other types per the module docstring. A ``__key__`` column gives the
    sample key, otherwise ``<file stem>/<0-based row index in the file, 9 digits>``. Every file must
    have the same column names. ``ref = (file key, row group, row index in the file)``.
    """

    type_name = "parquet"
    _invalid = "is not valid Parquet"

    def _file(self, key: str) -> Any:
        pq = _pyarrow("pyarrow.parquet")
        return pq.ParquetFile(self.store.open_reader(key))

    def _table(self, key: str) -> tuple[list[str], Iterable[tuple[int, int, int]], Any]:
        pf = self._file(key)
        meta = pf.metadata
        groups = (meta.row_group(g) for g in range(meta.num_row_groups))
        names = list(pf.schema_arrow.names)
        return names, ((g, rg.num_rows, rg.total_byte_size) for g, rg in enumerate(groups)), None

    def _read_group(
        self, key: str, group: int, indices: Sequence[int]
    ) -> Iterator[tuple[int, dict[str, Any] | Exception]]:
        def load() -> tuple[int, list[dict[str, Any]]]:
            pf = self._file(key)
            first_row = sum(pf.metadata.row_group(g).num_rows for g in range(group))
            return first_row, pf.read_row_group(group).to_pylist()

        return self._group_rows(key, indices, load, f"cannot read row group {group}")
