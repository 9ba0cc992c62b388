"""``fastload verify``: every shard of a dataset checked against its manifest, every problem said.

Each problem is one sentence naming the object, what is wrong (expected against found, the byte
offset where there is one) and the command that repairs it.

The shards are checked by worker processes (:mod:`._shard_check`), several at once, in runs of
consecutive shards; this process merges their results **in shard order**, so the report is the
same whatever the number of workers or their timing, and judges what spans shards (repeated
keys, the schema's field counts) from the merged results.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastload._units import check_int
from fastload.convert._pool import pool_context
from fastload.convert._progress import plural
from fastload.convert.tools._common import Grouping, Progress, open_dataset_store
from fastload.convert.tools._shard_check import ShardCheck, check_shards
from fastload.errors import ManifestError, ManifestTotalsError
from fastload.formats import MANIFEST_NAME, Manifest, ShardEntry, read_manifest
from fastload.formats.tokens import METADATA_KEY as TOKENS_KEY
from fastload.formats.tokens import TokenLayout
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


#: A run of consecutive shards given to one worker holds at most this many shards ...
_RUN_SHARDS = 64
#: ... and at most this many bytes (one shard more when a single shard is larger).
_RUN_BYTES = 64 << 20
#: By default a dataset smaller than both of these is checked in this process: starting worker
#: processes costs more than they save on it (0.3 s against 0.15 s for 100 shards of 10 samples).
_POOL_MIN_SHARDS = 256
_POOL_MIN_BYTES = 256 << 20
#: Runs submitted ahead of the one being merged, per worker: enough to keep every worker busy
#: while bounding the results held in memory.
_RUNS_AHEAD = 4


def verify_dataset(
    url: str | os.PathLike[str] | Store,
    *,
    store_options: Mapping[str, Any] | None = None,
    check_index: bool = True,
    progress: Progress | None = None,
    workers: int | None = None,
) -> VerifyReport:
    """Check every shard of a dataset against its manifest.

    For each shard: it exists; its size and SHA-256 match; reading it yields the manifest's sample
    count without errors; its index (rebuilt with the format's ``build_index``) equals the stored
    ``.idx`` byte for byte. Then the field counts read must match the manifest's schema, and a
    token dataset's ``metadata["tokens"]`` must agree with the shards' sample counts (blocks).
    Every problem is reported; nothing stops at the first one.

    Shards are checked by ``workers`` processes at once; the report (problems in shard order,
    the first damage of each shard) is identical for every ``workers``. ``progress`` (see
    :data:`Progress`) is called in this process after each shard, in shard order.

    Args:
        url: The dataset root, or its store.
        store_options: Options of the store ``url`` names.
        check_index: Also compare each shard's index file with one rebuilt from the shard.
        progress: Called with (shards done, shards in all, bytes of the shard just done).
        workers: Worker processes; 1 checks in this process. Default: ``os.cpu_count()``
            for a dataset of at least 256 shards or 256 MB, else 1. Fewer start when the
            dataset has fewer runs of shards than workers. Processes rather than threads, because
            reading samples back is Python work that holds the GIL; the store is pickled to
            them (every fastload store pickles by configuration).

    A damage verdict needs data that was read: a store that cannot be read (the network or
    the server failing past the retries) raises instead of reporting problems, so an intact
    shard is never called damaged for a network fault.

    Raises:
        StoreUnavailableError: The store could not be read, even after the retries of its
            :class:`~fastload.storage.RetryStore` (a retryable :class:`StoreError` for a store
            without one); no verdict. ``fastload verify`` exits 4 then.
        ObjectNotFoundError: No manifest.
        ManifestError: The manifest itself is malformed (totals that disagree with its shard
            entries are reported as a problem, and every shard is checked).
        InvalidArgumentError: ``workers`` is not an int >= 1.
    """
    if workers is not None:
        check_int("workers", workers, minimum=1)
    store = open_dataset_store(url, store_options)
    totals_off = None
    try:
        manifest = read_manifest(store)
    except ManifestTotalsError as exc:  # an edited entry or total: check every shard anyway
        if not isinstance(exc.manifest, Manifest):
            raise
        manifest, totals_off = exc.manifest, str(exc)
    if workers is None:
        large = len(manifest.shards) >= _POOL_MIN_SHARDS or manifest.num_bytes >= _POOL_MIN_BYTES
        workers = (os.cpu_count() or 1) if large else 1
    report = VerifyReport(store.url)
    if totals_off is not None:
        report.problems.append(totals_off)
    fmt = manifest.resolve_format(url=store.child_url(MANIFEST_NAME))
    field_counts: dict[str, int] = {}
    grouping = Grouping()
    checks = _checks(store, fmt.name, manifest.shards, check_index, workers)
    for check, entry in zip(checks, manifest.shards):  # checks first: run to its end
        report.shards_checked += 1
        report.samples_read += check.samples
        report.problems.extend(check.problems)
        grouping.add_shard(store.child_url(entry.name), check.keys, check.field_sets)
        for name, n in check.field_counts.items():
            field_counts[name] = field_counts.get(name, 0) + n
        if progress is not None:
            progress(report.shards_checked, len(manifest.shards), entry.num_bytes)
    problem = grouping.problem()
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
    if TOKENS_KEY in manifest.metadata:  # a token dataset: its layout against the shard list
        try:
            TokenLayout.from_metadata(
                manifest.metadata,
                shard_samples=[e.num_samples for e in manifest.shards],
                where=store.child_url(MANIFEST_NAME),
            )
        except ManifestError as exc:
            report.problems.append(str(exc))
    if sum(e.num_samples for e in manifest.shards) == 0:  # nothing to load is no dataset
        report.problems.append(
            f"{store.child_url(MANIFEST_NAME)}: the dataset holds no sample "
            f"({plural(len(manifest.shards), 'shard')}, 0 samples): a loader would yield nothing; "
            "convert the source again (a conversion that keeps no sample now fails, naming why)"
        )
    return report


def _runs(entries: Sequence[ShardEntry], workers: int) -> list[Sequence[ShardEntry]]:
    """``entries`` cut into runs of consecutive shards: small enough that every worker gets
    several (so none idles at the end), large enough that a run's inter-process cost is small
    beside its checks (see :data:`_RUN_SHARDS`, :data:`_RUN_BYTES`)."""
    most = max(1, min(_RUN_SHARDS, math.ceil(len(entries) / (workers * _RUNS_AHEAD))))
    runs: list[Sequence[ShardEntry]] = []
    start = nbytes = 0
    for i, entry in enumerate(entries):
        nbytes += entry.num_bytes
        if i + 1 - start >= most or nbytes >= _RUN_BYTES:
            runs.append(entries[start : i + 1])
            start, nbytes = i + 1, 0
    if start < len(entries):
        runs.append(entries[start:])
    return runs


def _checks(
    store: Store,
    format_name: str,
    entries: Sequence[ShardEntry],
    check_index: bool,
    workers: int,
) -> Iterator[ShardCheck]:
    """The :class:`ShardCheck` of each of ``entries``, in order, checked by up to ``workers``
    processes (in this process when one would do); at most :data:`_RUNS_AHEAD` runs per
    worker are in flight or waiting to be merged."""
    runs = _runs(entries, workers)
    if workers == 1 or len(runs) == 1:
        for run in runs:
            yield from check_shards(store, format_name, run, check_index)
        return
    pool = ProcessPoolExecutor(min(workers, len(runs)), mp_context=pool_context())
    todo = iter(runs)

    def submit(count: int) -> Iterator[Future[list[ShardCheck]]]:
        for run in itertools.islice(todo, count):
            yield pool.submit(check_shards, store, format_name, run, check_index)

    try:
        pending = deque(submit(workers * _RUNS_AHEAD))
        while pending:
            done = pending.popleft().result()
            pending.extend(submit(1))
            yield from done
    finally:  # also when the caller stops early (an error in progress, Ctrl-C)
        pool.shutdown(wait=True, cancel_futures=True)
