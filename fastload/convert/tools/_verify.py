"""``fastload verify``: every shard of a dataset checked against its manifest, every problem said.

Each problem is one sentence naming the object, what is wrong (expected against found, the byte
offset where there is one) and the command that repairs it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fastload.convert.tools._common import (
    Grouping,
    Progress,
    count_fields,
    open_dataset_store,
    sha256_of,
)
from fastload.errors import FastloadError, ObjectNotFoundError
from fastload.formats import MANIFEST_NAME, Format, ShardEntry, read_manifest
from fastload.formats._base import DAMAGED_SHARD_REMEDY, ShardReader
from fastload.storage import Store

__all__ = ["VerifyReport", "verify_dataset"]


@dataclass
class VerifyReport:
    """What :func:`verify_dataset` found.

    Attributes:
        url: The dataset root.
        shards_checked: Shards examined.
        samples_read: Samples read back from all shards.
        problems: One precise sentence per problem (shard URL, expected vs found); empty if OK.
        warnings: Observations that need not be problems (e.g. samples with different fields).
    """

    url: str
    shards_checked: int = 0
    samples_read: int = 0
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing is wrong."""
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON-able dict: the attributes and ``ok``."""
        return {**dataclasses.asdict(self), "ok": self.ok}


def _first_difference(a: bytes, b: bytes) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def verify_dataset(
    url: str | os.PathLike[str] | Store,
    *,
    store_options: Mapping[str, Any] | None = None,
    check_index: bool = True,
    progress: Progress | None = None,
) -> VerifyReport:
    """Check every shard of a dataset against its manifest.

    For each shard: it exists; its size and SHA-256 match; reading it yields the manifest's sample
    count without errors; its index (rebuilt with the format's ``build_index``) equals the stored
    ``.idx`` byte for byte. Then the field counts read must match the manifest's schema. Every
    problem is reported; nothing stops at the first one. ``progress`` (see :data:`Progress`) is
    called after each shard.

    Raises:
        ObjectNotFoundError: No manifest.
        ManifestError: The manifest itself is malformed.
    """
    store = open_dataset_store(url, store_options)
    manifest = read_manifest(store)
    report = VerifyReport(store.url)
    fmt = manifest.resolve_format(url=store.child_url(MANIFEST_NAME))
    field_counts: dict[str, int] = {}
    grouping = Grouping()
    for entry in manifest.shards:
        report.shards_checked += 1
        where = store.child_url(entry.name)
        try:
            sha, size = sha256_of(store, entry.name)
        except ObjectNotFoundError:
            report.problems.append(f"{where}: shard is missing")
            continue
        except (OSError, FastloadError) as exc:
            report.problems.append(f"{where}: cannot be read: {exc}")
            continue
        remedy = DAMAGED_SHARD_REMEDY.removeprefix("; ")
        if size != entry.num_bytes:
            report.problems.append(
                f"{where}: size is {size} bytes, the manifest says {entry.num_bytes} "
                f"({'truncated' if size < entry.num_bytes else 'changed'}); {remedy}"
            )
        if sha != entry.sha256:
            report.problems.append(
                f"{where}: SHA-256 is {sha}, the manifest says {entry.sha256} (the shard's "
                f"bytes changed); {remedy}"
            )
        count = 0
        reader: ShardReader | None = None
        try:
            reader = fmt.reader(
                store,
                entry.name,
                on_error="skip",
                num_samples=entry.num_samples,
                num_bytes=entry.num_bytes,
            )
            for sample in reader:
                grouping.add(where, count, sample)
                count += 1
                count_fields(sample, field_counts)
        except (OSError, FastloadError) as exc:
            report.problems.append(f"{where}: reading failed after {count} samples: {exc}")
        except Exception as exc:  # a damaged shard must never crash verify: report it
            report.problems.append(
                f"{where}: reading failed after {count} samples with an unexpected "
                f"{type(exc).__name__}: {exc} (please report this as a fastload bug)"
            )
        else:
            if reader.skipped:
                first = reader.policy.errors[0] if reader.policy.errors else "?"
                report.problems.append(
                    f"{where}: {reader.skipped} damaged sample(s) or region(s), {count} intact "
                    f"samples read; first damage: {first}; {remedy}"
                )
            elif count != entry.num_samples:
                report.problems.append(
                    f"{where}: holds {count} samples, the manifest says {entry.num_samples}"
                )
        finally:
            if reader is not None:
                reader.close()
        report.samples_read += count
        if check_index:
            _verify_index(store, fmt, entry, report)
        if progress is not None:
            progress(report.shards_checked, len(manifest.shards), entry.num_bytes)
    for problem in (grouping.problem(),):
        if problem is not None:
            report.problems.append(f"{store.url}: {problem}")
    note = grouping.warning()
    if note is not None:
        report.warnings.append(note)
    schema_counts = {name: int(s.get("count", -1)) for name, s in manifest.schema.items()}
    if not report.problems and schema_counts and schema_counts != field_counts:
        report.problems.append(
            f"{store.child_url(MANIFEST_NAME)}: schema field counts {schema_counts} do not match "
            f"the fields read from the shards {field_counts}"
        )
    return report


def _verify_index(store: Store, fmt: Format, entry: ShardEntry, report: VerifyReport) -> None:
    where = store.child_url(entry.name)
    if fmt.build_index is None:
        if entry.index:
            report.problems.append(
                f"{where}: the manifest names an index {entry.index!r}, but the {fmt.name} "
                "format has none"
            )
        return
    if not entry.index:
        return
    try:
        stored = store.get(entry.index)
    except ObjectNotFoundError:
        report.problems.append(
            f"{store.child_url(entry.index)}: index is missing; rebuild it with `fastload index`"
        )
        return
    try:
        expected = fmt.build_index(store, entry.name)
    except Exception as exc:  # a damaged shard (reported above) cannot be indexed
        report.problems.append(f"{where}: cannot rebuild its index to compare: {exc}")
        return
    if expected is not None and stored != expected:
        report.problems.append(
            f"{store.child_url(entry.index)}: index differs from the shard's contents "
            f"({len(stored)} bytes stored, {len(expected)} expected, first difference at byte "
            f"{_first_difference(stored, expected)}); rebuild it with `fastload index "
            f"{store.url}`"
        )
