"""``fastload.convert``: parallel, resumable, deterministic conversion of a corpus into shards.

:func:`convert` reads as its steps (``fastload/convert/README.md`` has the user-facing version):

1. **Options**, checked once (:class:`._options.ConvertOptions`), before anything is opened.
2. **Source**: opened and detected; its warnings printed; the destination store opened; the
   executor chosen and, if it gains from it, started (:class:`._run.ConversionRun`).
3. **Plan**, in the calling process, as the source is enumerated (:class:`._plan.PlanStream`):
   samples in a fixed order (or a seeded permutation of all of them) are cut into shards by
   ``shard_samples`` and/or ``shard_size`` and hashed; each shard's digest covers the plan up to
   it, the last one the whole plan (the manifest's ``plan_sha256``). The plan keeps a few numbers
   per shard and the units of the shards not yet handed out, so memory is bounded by the number
   of shards, and the first shards are written while the source is still being enumerated.
4. **Destination**, once the first shard is cut: its lock, then ``_fastload_convert/plan.json``
   (the source and options) written before any shard. A destination holding another dataset is
   refused with :class:`~fastload.errors.DatasetExistsError` unless ``overwrite=True``; one
   holding a manifest (or a state from before plans streamed) is compared with the whole plan,
   planned first.
5. **Run**: an executor (:mod:`._pool`: this process or worker processes; a cluster engine's
   tasks, :mod:`._engines`) writes whole shards through the store's atomic streamed writer, then
   records ``_fastload_convert/done/<shard>.json`` with the shard's digest. A re-run keeps a
   shard whose record has the digest the plan gives it and whose objects are present, and
   refuses one recorded with another digest.
6. **Finish**: the skip report ``_fastload_skipped.jsonl`` (if anything was skipped), then the
   manifest ``fastload.json`` **last**, then the state objects are deleted.

Nothing written depends on time, worker count or scheduling, so an interrupted run (even by
SIGKILL) resumed with the same command gives the same bytes as an uninterrupted one. The parts
live beside this module: the options (``_options``), the run with its executor, lock and Ctrl-C
handling (``_run``), the plan (``_plan``), the destination's state (``_state``) and its lock and
what dead runs leave (``_guard``), the workers (``_worker``) and their executors (``_pool``,
``_engines``), the map hook (``_map``), running out of space (``_space``) and the result
(``_results``). The helpers here are the steps' parts that only :func:`convert` uses.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import IO, Any

from fastload._version import __version__
from fastload.convert._empty import no_samples, nothing_kept
from fastload.convert._guard import check_not_inside
from fastload.convert._map import MapFn, map_name
from fastload.convert._options import ConvertOptions
from fastload.convert._overhead import measured_tar_overhead, planned_tar_overhead
from fastload.convert._plan import ConversionPlan, PlanStream, ShardLayout, ShardPlan, planned_units
from fastload.convert._pool import ShardRecords
from fastload.convert._progress import Progress, WarningPrinter, plural
from fastload.convert._results import (
    ConvertResult,
    SkippedItem,
    add_source_facts,
    print_dry_run,
    result_from_manifest,
)
from fastload.convert._run import running
from fastload.convert._space import space_for
from fastload.convert._state import (
    SKIPPED_KEY,
    Found,
    check_whole_plan,
    clear_state,
    shards_to_write,
)
from fastload.convert._token_blocks import check_text_field, token_metadata
from fastload.convert._tokenizer import TokenFn, Tokenize, TokenizerSpec
from fastload.convert._worker import ShardJob
from fastload.convert.sources import (
    SOURCES,
    ArrowBackedDataset,
    ConversionError,
    Reporter,
    Source,
    Unit,
    open_source,
)
from fastload.formats import MANIFEST_NAME, Manifest, ShardEntry, ShardInfo
from fastload.formats.manifest import write_manifest
from fastload.storage import Store, open_store

__all__ = ["convert"]

_KEPT = "each is kept if the plan still gives it the same samples"


def convert(
    src: str | os.PathLike[str] | ArrowBackedDataset,
    dst: str | os.PathLike[str],
    *,
    format: str = "webdataset",  # noqa: A002 - the public name the design fixes
    shard_size: int | str | None = None,
    shard_samples: int | None = None,
    workers: int | None = None,
    executor: str = "local",
    ray_address: str | None = None,
    spark_master: str | None = None,
    shuffle: bool = False,
    seed: int = 0,
    on_error: str = "raise",
    overwrite: bool = False,
    dry_run: bool = False,
    map_fn: str | MapFn | None = None,
    source_type: str | None = None,
    prefix: str = "shard",
    quiet: bool = False,
    store_options: Mapping[str, Any] | None = None,
    source_options: Mapping[str, Any] | None = None,
    progress_stream: IO[str] | None = None,
    tokenize: str | TokenFn | Tokenize | None = None,
) -> ConvertResult:
    """Convert a corpus into a sharded dataset with a ``fastload.json`` manifest.

    The same input and options give byte-identical shards and manifest whatever ``workers`` is. An
    interrupted conversion (even by SIGKILL) re-run with the same arguments completes without
    redoing finished shards, with the same bytes as an uninterrupted run. No partial shard is ever
    visible under its final name; the manifest is written last. See ``fastload/convert/README.md``
    for the sources, key and field naming, and the skip report.

    Args:
        src: The corpus: a directory or store URL (image folder, file tree, JSONL / text / CSV /
            Parquet / Arrow IPC / Feather files, a Hugging Face ``save_to_disk`` directory,
            existing shards or a fastload dataset), a single file, or a Hugging Face
            ``datasets.Dataset`` backed by its arrow cache files.
        dst: The dataset root: a local directory or store URL.
        format: ``webdataset`` (``wds``), ``tfrecord`` or ``lmdb``.
        shard_size: Target shard size in bytes, or a string such as ``"256MB"`` / ``"1GiB"``.
            Estimated while planning (from file sizes; for record sources from record or row-group
            sizes). Default 256 MB when ``shard_samples`` is not given either.
        shard_samples: Maximum samples per shard. With ``shard_size`` the first limit reached wins.
        workers: Worker processes writing shards (default: ``os.cpu_count()``). 1 writes in this
            process. ``memory://`` stores always write in this process. Workers are forked when
            the calling process runs one thread, else started by multiprocessing's forkserver,
            which re-imports the calling script: call ``convert`` under
            ``if __name__ == "__main__":`` in scripts. Ignored by the cluster executors.
        executor: ``local`` (this process or ``workers`` processes), ``ray`` (one Ray task
            per shard, on the cluster of ``ray.init`` if this process called it, else of
            ``ray_address``; needs ``fastload[ray]``) or ``spark`` (one Spark task per shard,
            on the active SparkContext if there is one, else on ``spark_master``; needs
            ``fastload[spark]`` and Java 17+). Every executor writes the same bytes; the
            cluster ones need stores reachable from every node: object stores, HDFS, or
            directories every node mounts at the same path.
        ray_address: The Ray cluster for ``executor="ray"`` (``"auto"``, ``"host:6379"``,
            ``"ray://host:10001"``); default ``RAY_ADDRESS``, else a local Ray runtime.
        spark_master: The Spark master for ``executor="spark"`` (``"spark://host:7077"``,
            ``"yarn"``, ``"k8s://..."``, ``"local[4]"``); default ``spark.master`` as
            ``spark-submit`` sets it, else ``local[*]``.
        shuffle: Mix the sample order with a permutation derived from ``seed``.
        seed: Seed of the permutation (only used with ``shuffle``).
        on_error: ``raise`` (stop at the first bad item; finished shards are kept and a re-run
            resumes) or ``skip`` (leave bad items out, list them in ``_fastload_skipped.jsonl``).
        overwrite: Replace a different dataset (or unfinished conversion) at ``dst``.
        dry_run: Plan, report, write nothing.
        map_fn: ``"module:function"`` or a picklable module-level function taking a sample
            (``{"__key__": str, field: bytes}``) and returning a sample or ``None`` to drop it. It
            runs in the worker processes (imported by name there). The current directory is
            appended to ``sys.path`` (here and in the workers), so ``"mymap:fn"`` finds
            ``./mymap.py``. When it raises, the item error names the item and where it raised,
            and carries the function's traceback as a note.
        source_type: Force the source type (``imagefolder``, ``files``, ``jsonl``, ``text``,
            ``csv``, ``parquet``, ``shards``) instead of detecting it.
        prefix: Shard name prefix: shards are ``{prefix}-{n:06d}.{tar|tfrecord|lmdb}``.
        quiet: No progress output or summary.
        store_options: Options for the destination store (e.g. ``endpoint_url``).
        source_options: Options for the source store.
        progress_stream: Where progress and the summary go (default ``sys.stderr``).
        tokenize: Make a token dataset (README "Token datasets"; the samples are blocks of ids,
            :mod:`fastload.formats.tokens`): a :class:`Tokenize`, or its tokenizer alone (a
            ``tokenizer.json`` path, ``"module:function"`` or ``"byte"``).

    Returns:
        A :class:`ConvertResult`.

    On Ctrl-C (``KeyboardInterrupt``) the workers finish the shards they are writing; the
    exception then gets a note saying how many shards were done and that re-running resumes (also
    printed unless ``quiet``).

    Raises:
        InvalidArgumentError: Bad options, empty input, or ``dst`` inside ``src``.
        DatasetExistsError: ``dst`` already holds a different dataset and ``overwrite`` is False,
            or another conversion is writing into the local directory ``dst`` (see the README's
            "What killed runs leave, and one conversion at a time").
        StoreError: The destination ran out of space (or a file size limit was reached); the
            message names the shard and says to free space and re-run, which resumes.
        ConversionError: An input item is bad and ``on_error="raise"``; the message names it.
            Or no sample is kept (each skipped under ``on_error="skip"``, or dropped by
            ``map_fn``): no manifest is written, the skip report is and the message names it.
        MissingDependencyError: The source needs an optional package (CSV, Parquet: pyarrow).
        ObjectNotFoundError: ``src`` does not exist.
    """
    start = time.monotonic()
    options = ConvertOptions(
        format=format,
        shard_size=shard_size,
        shard_samples=shard_samples,
        workers=workers,
        executor=executor,
        ray_address=ray_address,
        spark_master=spark_master,
        shuffle=shuffle,
        seed=seed,
        on_error=on_error,
        overwrite=overwrite,
        dry_run=dry_run,
        map_fn=map_fn,
        source_type=source_type,
        prefix=prefix,
        quiet=quiet,
        store_options=store_options,
        source_options=source_options,
        progress_stream=progress_stream,
        tokenize=tokenize,
    )
    with running(options) as run:
        # source: its warnings first; the destination store; the executor started early
        source = open_source(
            src, source_type=options.source_type, store_options=options.source_options
        )
        warn = WarningPrinter(source.warnings, options.stream, options.quiet)
        warn()
        spec = options.tokenizer(source)
        dst_store = open_store(dst, **dict(options.store_options or {}))
        check_not_inside(source.store, source.keys is not None, dst_store)
        run.start(source.store, dst_store)

        # plan: shards are cut (and hashed) as the source is enumerated
        plan_skipped: list[SkippedItem] = []
        plan, replay = _plan(source, options, plan_skipped, spec)
        if options.dry_run:
            whole = _whole(plan, replay, source, plan_skipped, warn)
            return _dry_run(dst_store, source, whole, plan_skipped, options, start)
        first = next(plan, None)
        framing = options.format_name == "webdataset" and spec is None  # issue 29
        if framing and first is not None and (text := planned_tar_overhead(first[1])):
            source.warnings.append(text)
            framing = False  # said once, from the plan
        warn()
        if first is None:
            raise no_samples(source, plan_skipped)
        if spec is not None and options.on_error == "raise":
            check_text_field(source, first[1], spec)
        progress = Progress(0, 0, quiet=options.quiet, stream=options.stream)

        # destination: ours alone from here on; what dead runs left goes
        found = run.claim(plan)
        shards: Iterator[tuple[ShardPlan, list[Unit]]] = itertools.chain([first], plan)
        del first  # the chain alone holds its units, until they are written
        if found.needs_whole_plan:
            # The destination names a whole plan's hash (a manifest, or a conversion begun
            # before plans streamed): plan everything first, then enumerate again to write.
            whole = _whole(plan, replay, source, plan_skipped, warn)
            manifest = check_whole_plan(dst_store, found, whole.sha256)
            if manifest is not None:
                result = result_from_manifest(
                    dst_store, manifest, whole.sha256, start, plan_skipped
                )
                add_source_facts(result, source)
                result.unchanged = True
                return _summary(result, progress, options.quiet)
            shards = whole.shard_units()
        run.begin_writing(plan, found)

        # run: the shards written as they are planned
        done = ShardRecords(progress)
        if found.done and not options.quiet:
            n_done = plural(len(found.done), "shard")
            progress.message(f"resuming: {n_done} recorded done by an earlier run ({_KEPT})")
        run.write(_jobs(source, dst_store, shards, found, done, plan, options, spec), done, found)

        # finish: skip report, manifest (last), state cleanup
        whole = plan.finish(replay)
        result = _finish(dst_store, source, whole, done, plan_skipped, start)
        if framing and result.manifest and (text := measured_tar_overhead(result.manifest)):
            source.warnings.append(text)
            warn()
        return _summary(result, progress, options.quiet)


def _plan(
    source: Source,
    options: ConvertOptions,
    skipped: list[SkippedItem],
    tokenize: TokenizerSpec | None,
) -> tuple[PlanStream, Callable[[], Iterable[Unit]]]:
    """Plan the conversion of ``source`` as it is enumerated: its samples in order (shuffled if
    asked) cut into shards, each shard given with its units (unless a dry run) as soon as it is
    cut; and how to enumerate the units again. Items that cannot be planned raise (as the stream
    reaches them) under ``on_error="raise"``, else go to ``skipped``.
    """

    def report(item: str, reason: str) -> None:
        if options.on_error == "raise":
            raise ConversionError(
                f"cannot convert {source.store.child_url(item) if ':' not in item else item}: "
                f"{reason}; fix the input, or pass on_error='skip' (--on-error skip) to leave "
                f"it out and list it in {SKIPPED_KEY}"
            )
        skipped.append(SkippedItem(item, reason, None))

    def left_out(item: str, reason: str, duplicate_of: str | None) -> None:
        skipped.append(SkippedItem(item, reason, None, duplicate_of))

    shuffle, seed = options.shuffle, options.seed
    units, replay = planned_units(source, Reporter(report, left_out), shuffle=shuffle, seed=seed)
    format_name, prefix = options.format_name, options.prefix
    shard_samples, shard_size = options.shard_samples, options.size_limit
    plan_options: dict[str, Any] = {
        "format": format_name,
        "shard_size": shard_size,
        "shard_samples": shard_samples,
        "shuffle": bool(shuffle),
        "seed": int(seed) if shuffle else None,
        "prefix": prefix,
        "map": map_name(options.map_fn),
        "source_type": SOURCES.canonical(source.type_name),
    }
    if tokenize is not None:  # only then: other plans keep their hashes
        plan_options["tokenize"] = tokenize.identity()
    token_size = tokenize.token_size if tokenize is not None else None
    extension = options.fmt.extension
    layout = ShardLayout(format_name, extension, prefix, shard_samples, shard_size, token_size)
    plan = PlanStream(
        units, layout, source.describe(), plan_options, keep_units=not options.dry_run
    )
    return plan, replay


def _jobs(
    source: Source,
    dst: Store,
    shards: Iterator[tuple[ShardPlan, list[Unit]]],
    found: Found,
    done: ShardRecords,
    plan: PlanStream,
    options: ConvertOptions,
    tokenize: TokenizerSpec | None,
) -> Iterator[ShardJob]:
    """The jobs of the shards still to write (those ``found`` done and kept go to
    ``done.keep``), each planned as it is taken; the progress line's total follows the plan."""
    for shard, units in shards_to_write(dst, shards, found, done.keep):
        done.progress.planned(plan.num_samples, plan.est_bytes, complete=plan.complete)
        yield ShardJob(
            source,
            dst,
            options.format_name,
            shard,
            units,
            options.map_fn,
            options.on_error,
            options.map_dir,
            tokenize,
        )


def _dry_run(
    dst: Store,
    source: Source,
    whole: ConversionPlan,
    skipped: list[SkippedItem],
    options: ConvertOptions,
    start: float,
) -> ConvertResult:
    """The result of a dry run (nothing written), printed unless ``quiet``."""
    result = ConvertResult(
        url=dst.url,
        format=options.format_name,
        num_samples=whole.num_samples,
        num_shards=len(whole.shards),
        num_bytes=whole.est_bytes,
        skipped=skipped,
        dry_run=True,
        plan_sha256=whole.sha256,
        shard_names=[s.name for s in whole.shards],
        elapsed=time.monotonic() - start,
    )
    add_source_facts(result, source)
    if not options.quiet:
        print_dry_run(options.stream, source, whole.shards, result)
    return result


def _summary(result: ConvertResult, progress: Progress, quiet: bool) -> ConvertResult:
    """``result``, its summary printed (after the progress line) unless ``quiet``."""
    progress.close()
    if not quiet:
        progress.message(result.summary())
    return result


def _whole(
    plan: PlanStream,
    replay: Callable[[], Iterable[Unit]],
    source: Source,
    skipped: list[SkippedItem],
    warn: WarningPrinter,
) -> ConversionPlan:
    """The rest of ``plan`` cut, and the whole plan.

    Raises:
        InvalidArgumentError: The source has no sample.
        ConversionError: An item cannot be planned and ``on_error="raise"``.
    """
    whole = plan.finish(replay)
    warn()
    if not whole.shards:
        raise no_samples(source, skipped)
    return whole


def _finish(
    store: Store,
    source: Source,
    plan: ConversionPlan,
    done: ShardRecords,
    plan_skipped: list[SkippedItem],
    start: float,
) -> ConvertResult:
    """Complete the dataset from the ``done`` records of every shard: the skip report (or its
    removal), then the manifest, last, then the removal of the conversion state. The result
    has the source's facts (type, classes, files left out, warnings so far)."""
    records = done.records
    skipped = list(plan_skipped)
    infos: list[ShardInfo] = []
    dropped = 0
    for shard in plan.shards:
        record = records[shard.name]
        skipped.extend(SkippedItem.from_json(s) for s in record["skipped"])
        dropped += int(record["dropped"])
        info = record["info"]
        infos.append(
            ShardInfo(
                info["key"],
                info["num_samples"],
                info["num_bytes"],
                info["sha256"],
                info["index_key"],
                dict(info["fields"]),
            )
        )
    kept = sum(int(i.num_samples) for i in infos)
    if skipped:
        with space_for(store, SKIPPED_KEY):
            store.put(
                SKIPPED_KEY,
                "".join(
                    json.dumps(s.to_json(), sort_keys=True, ensure_ascii=False) + "\n"
                    for s in skipped
                ).encode("utf-8"),
            )
    else:
        store.delete_many([SKIPPED_KEY])
    if kept == 0:  # no manifest for a dataset without a sample: an error, not exit status 3
        written = [k for i in infos for k in (i.key, i.index_key) if k]
        raise nothing_kept(store, written, skipped, dropped)
    manifest = Manifest(
        format=plan.options["format"],
        shards=[ShardEntry.from_info(i) for i in infos],
        schema=Manifest.schema_from_fields(i.fields for i in infos),
        created_by={
            "tool": "fastload convert",
            "version": __version__,
            "source": plan.source,
            "options": plan.options,
            "plan_sha256": plan.sha256,
            "skipped": len(skipped),
            "dropped": dropped,
        },
        metadata=token_metadata(store, plan, records, infos, source.metadata()),
    )
    with space_for(store, MANIFEST_NAME):
        write_manifest(store, manifest)
    clear_state(store)
    result = ConvertResult.for_dataset(
        store,
        manifest,
        plan_sha256=plan.sha256,
        skipped=skipped,
        elapsed=time.monotonic() - start,
        resumed_shards=done.resumed,
    )
    add_source_facts(result, source)
    return result
