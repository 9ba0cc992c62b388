"""``fastload.convert``: parallel, resumable, deterministic conversion of a corpus into shards.

The steps (``fastload/convert/README.md`` has the user-facing version):

1. **Plan** in the calling process, as the source is enumerated (:class:`._plan.PlanStream`):
   samples in a fixed order (or a seeded permutation of all of them) are cut into shards by
   ``shard_samples`` and/or ``shard_size`` and hashed; each shard's digest covers the plan up to
   it, the last one the whole plan (the manifest's ``plan_sha256``). The plan keeps a few numbers
   per shard and the units of the shards not yet handed out, so memory is bounded by the number
   of shards, and the first shards are written while the source is still being enumerated.
2. **State**, once the first shard is cut: ``_fastload_convert/plan.json`` (the source and
   options) is written before any shard. A destination holding another dataset is refused with
   :class:`~fastload.errors.DatasetExistsError` unless ``overwrite=True``; one holding a manifest
   (or a state from before plans streamed) is compared with the whole plan, planned first.
3. **Shards**: an executor (:mod:`._pool`: this process or worker processes) writes whole shards
   through the store's atomic streamed writer, then records ``_fastload_convert/done/<shard>.json``
   with the shard's digest. A re-run keeps a shard whose record has the digest the plan gives it
   and whose objects are present, and refuses one recorded with another digest.
4. **Finish**: the skip report ``_fastload_skipped.jsonl`` (if anything was skipped), then the
   manifest ``fastload.json`` **last**, then the state objects are deleted.

Nothing written depends on time, worker count or scheduling, so an interrupted run (even by
SIGKILL) resumed with the same command gives the same bytes as an uninterrupted one. The parts
live beside this module: the plan (``_plan``), the destination's state (``_state``) and its lock
and what dead runs leave (``_guard``), the workers (``_worker``) and their executors (``_pool``),
the map hook (``_map``), running out of space (``_space``) and the result (``_results``).

Why one file: :func:`convert` is one ``try``/``finally`` that owns the executor, the
destination's lock and the note of an interruption across all four steps; its helpers here only
check its options and plan.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import IO, Any

from fastload._os import interrupts_escalate
from fastload._units import check_int
from fastload._version import __version__
from fastload.convert._empty import no_samples, nothing_kept
from fastload.convert._engines import ExecutorChoice, get_engine
from fastload.convert._guard import Guard, check_not_inside
from fastload.convert._map import MapFn, map_name, resolve_map
from fastload.convert._overhead import measured_tar_overhead, planned_tar_overhead
from fastload.convert._plan import (
    ConversionPlan,
    PlanStream,
    ShardLayout,
    ShardPlan,
    option_name,
    planned_units,
    shard_size_limit,
)
from fastload.convert._pool import (
    Pool,
    ShardRecords,
    run_jobs,
)
from fastload.convert._progress import Progress, WarningPrinter, plural
from fastload.convert._results import (
    ConvertResult,
    SkippedItem,
    add_source_facts,
    print_dry_run,
    result_from_manifest,
)
from fastload.convert._space import space_for
from fastload.convert._state import (
    PLAN_KEY,
    SKIPPED_KEY,
    check_destination,
    check_leftovers,
    check_whole_plan,
    clear_state,
    interrupted_note,
    shards_to_write,
    write_plan,
)
from fastload.convert._token_blocks import check_text_field, token_metadata
from fastload.convert._tokenizer import TokenFn, Tokenize, TokenizerSpec, resolve_tokenizer
from fastload.convert._worker import ShardJob
from fastload.convert.sources import (
    SOURCES,
    ConversionError,
    Reporter,
    Source,
    Unit,
    open_source,
)
from fastload.errors import InvalidArgumentError
from fastload.formats import (
    FORMATS,
    MANIFEST_NAME,
    ErrorPolicy,
    Format,
    Manifest,
    ShardEntry,
    ShardInfo,
    get_format,
)
from fastload.formats.manifest import write_manifest
from fastload.storage import Store, open_store

__all__ = ["convert"]

#: The ``on_error`` policies convert accepts: those of
#: :class:`~fastload.formats._base.ErrorPolicy` but ``warn``, since every item left out is listed
#: in the skip report rather than only logged.
_ON_ERROR = ("raise", "skip")
_KEPT = "each is kept if the plan still gives it the same samples"


def convert(
    src: str | os.PathLike[str],
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
            Parquet files, existing shards or a fastload dataset), or a single file.
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
    ErrorPolicy.check(on_error, choices=_ON_ERROR, name=option_name("on_error"))
    fmt = get_format(format)
    format_name = FORMATS.canonical(format)
    size_limit = shard_size_limit(shard_size, shard_samples)
    if shard_samples is not None:
        check_int(option_name("shard_samples"), shard_samples, minimum=1)
    n_workers = (os.cpu_count() or 1) if workers is None else workers
    check_int(option_name("workers"), n_workers, minimum=1)
    engine = get_engine(executor)
    addresses = {"ray_address": ray_address, "spark_master": spark_master}
    for option, value in addresses.items():
        if value is not None and option != engine.address_option:
            raise InvalidArgumentError(
                f"{option_name(option)} is not used by executor={executor!r}; pass the "
                "executor it is for, or leave it out"
            )
    if not prefix or "/" in prefix or prefix.startswith((".", "_")):
        raise InvalidArgumentError(
            f"{option_name('prefix')} {prefix!r} must be a non-empty name without '/' that does not "
            "start with '.' or '_'"
        )
    map_dir = os.getcwd() if isinstance(map_fn, str) else None
    resolve_map(map_fn, map_dir)  # fail early, in the parent, for a bad spec
    stream = progress_stream if progress_stream is not None else sys.stderr

    choice: ExecutorChoice | None = None
    guard: Guard | None = None
    dst_store: Store | None = None
    plan: PlanStream | None = None  # for the message of an interruption
    phase = "planning"
    interrupted: KeyboardInterrupt | None = None

    # Ctrl-C raises KeyboardInterrupt once; again, it has the pool stop at once (and raises
    # nothing in the middle of the shutdown or of the message saying how far it got).
    def stop_now() -> None:
        if choice is not None and choice.started is not None:
            choice.started.stop_now()

    escalation = contextlib.ExitStack()
    escalation.enter_context(interrupts_escalate(stop_now))
    try:
        source = open_source(src, source_type=source_type, store_options=source_options)
        warn = WarningPrinter(source.warnings, stream, quiet)
        warn()
        spec = None
        if tokenize is not None:
            spec = resolve_tokenizer(tokenize, SOURCES.canonical(source.type_name), os.getcwd())
        dst_store = open_store(dst, **dict(store_options or {}))
        check_not_inside(source.store, source.keys is not None, dst_store)
        address = addresses.get(engine.address_option or "")
        choice = ExecutorChoice(
            engine, n_workers, address, fmt, source.store, dst_store, dry_run=dry_run
        )
        choice.start_early()

        # 1. plan: shards are cut (and hashed) as the source is enumerated
        plan_skipped: list[SkippedItem] = []
        plan, replay = _plan(
            source,
            fmt,
            format_name,
            on_error=on_error,
            skipped=plan_skipped,
            shuffle=shuffle,
            seed=seed,
            prefix=prefix,
            shard_samples=shard_samples,
            shard_size=size_limit,
            map_fn=map_fn,
            keep_units=not dry_run,
            tokenize=spec,
        )
        if dry_run:
            whole = _whole(plan, replay, source, plan_skipped, warn)
            result = ConvertResult(
                url=dst_store.url,
                format=format_name,
                num_samples=whole.num_samples,
                num_shards=len(whole.shards),
                num_bytes=whole.est_bytes,
                skipped=plan_skipped,
                dry_run=True,
                plan_sha256=whole.sha256,
                shard_names=[s.name for s in whole.shards],
                elapsed=time.monotonic() - start,
            )
            add_source_facts(result, source)
            if not quiet:
                print_dry_run(stream, source, whole.shards, result)
            return result
        first = next(plan, None)
        framing = format_name == "webdataset" and spec is None  # issue 29: tar on small records
        if framing and first is not None and (text := planned_tar_overhead(first[1])):
            source.warnings.append(text)
            framing = False  # said once, from the plan
        warn()
        if first is None:
            raise no_samples(source, plan_skipped)
        if spec is not None and on_error == "raise":
            check_text_field(source, first[1], spec)
        progress = Progress(0, 0, quiet=quiet, stream=stream)

        # 2. destination state: ours alone from here on; what dead runs left goes
        guard = Guard(dst_store, format_name)
        with space_for(dst_store, PLAN_KEY):
            guard.acquire()
        found = check_destination(dst_store, plan.head_sha256, overwrite=overwrite, prefix=prefix)
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
                progress.close()
                if not quiet:
                    progress.message(result.summary())
                return result
            shards = whole.shard_units()
        guard.abort_uploads(prefix)
        phase = "writing"
        if not found.resume:
            write_plan(dst_store, plan.head_sha256, plan.source, plan.options)

        # 3. shards, written as they are planned
        done = ShardRecords(progress)
        if found.done and not quiet:
            n_done = plural(len(found.done), "shard")
            progress.message(f"resuming: {n_done} recorded done by an earlier run ({_KEPT})")

        def jobs() -> Iterator[ShardJob]:
            for shard, units in shards_to_write(dst_store, shards, found, done.keep):
                progress.planned(plan.num_samples, plan.est_bytes, complete=plan.complete)
                yield ShardJob(
                    source, dst_store, format_name, shard, units, map_fn, on_error, map_dir, spec
                )

        ahead = list(itertools.islice(feed := jobs(), 2))  # one job is written in this process
        runner = choice.runner(several=len(ahead) > 1)
        feed = itertools.chain(ahead, feed)
        del ahead  # the chain alone holds those two jobs, until they are written
        try:
            run_jobs(runner, feed, done, map_fn)
        finally:
            progress.close()
        check_leftovers(dst_store, found, plan.shards)

        # 4. finish: skip report, manifest (last), state cleanup
        phase = "finishing"
        whole = plan.finish(replay)
        result = _finish(dst_store, source, whole, done.records, plan_skipped, start, done.resumed)
        add_source_facts(result, source)
        if framing and result.manifest and (text := measured_tar_overhead(result.manifest)):
            source.warnings.append(text)
            warn()
        if not quiet:
            progress.message(result.summary())
        return result
    except KeyboardInterrupt as exc:
        interrupted = exc
        pool = choice.started if choice is not None else None
        if isinstance(pool, Pool) and phase == "writing" and not quiet:
            stream.write(
                "fastload convert: interrupted; the workers finish the shards they are writing "
                "(Ctrl-C again to stop at once; those shards are then written again by a re-run)\n"
            )
            stream.flush()
        raise
    finally:
        try:
            if choice is not None and choice.started is not None:
                choice.started.shutdown()  # waits for the workers: their writers are done after it
        finally:
            try:
                if guard is not None:
                    guard.release()
                if interrupted is not None:
                    shards_so_far = (
                        plan.shards if plan is not None and phase != "planning" else None
                    )
                    complete = plan is not None and plan.complete
                    text = interrupted_note(dst_store, shards_so_far, phase, complete)
                    interrupted.add_note(text)
                    if not quiet:
                        stream.write(f"fastload convert: {text}\n")
                        stream.flush()
            finally:
                escalation.close()


def _plan(
    source: Source,
    fmt: Format,
    format_name: str,
    *,
    on_error: str,
    skipped: list[SkippedItem],
    shuffle: bool,
    seed: int,
    prefix: str,
    shard_samples: int | None,
    shard_size: int | None,
    map_fn: str | MapFn | None,
    keep_units: bool,
    tokenize: TokenizerSpec | None,
) -> tuple[PlanStream, Callable[[], Iterable[Unit]]]:
    """Plan the conversion of ``source`` as it is enumerated: its samples in order (shuffled if
    asked) cut into shards, each shard given with its units (if ``keep_units``) as soon as it is
    cut; and how to enumerate the units again. Items that cannot be planned raise (as the stream
    reaches them) under ``on_error="raise"``, else go to ``skipped``.
    """

    def report(item: str, reason: str) -> None:
        if on_error == "raise":
            raise ConversionError(
                f"cannot convert {source.store.child_url(item) if ':' not in item else item}: "
                f"{reason}; fix the input, or pass on_error='skip' (--on-error skip) to leave "
                f"it out and list it in {SKIPPED_KEY}"
            )
        skipped.append(SkippedItem(item, reason, None))

    def left_out(item: str, reason: str, duplicate_of: str | None) -> None:
        skipped.append(SkippedItem(item, reason, None, duplicate_of))

    units, replay = planned_units(source, Reporter(report, left_out), shuffle=shuffle, seed=seed)
    options: dict[str, Any] = {
        "format": format_name,
        "shard_size": shard_size,
        "shard_samples": shard_samples,
        "shuffle": bool(shuffle),
        "seed": int(seed) if shuffle else None,
        "prefix": prefix,
        "map": map_name(map_fn),
        "source_type": SOURCES.canonical(source.type_name),
    }
    if tokenize is not None:  # only then: other plans keep their hashes
        options["tokenize"] = tokenize.identity()
    token_size = tokenize.token_size if tokenize is not None else None
    layout = ShardLayout(format_name, fmt.extension, prefix, shard_samples, shard_size, token_size)
    return PlanStream(units, layout, source.describe(), options, keep_units=keep_units), replay


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
    records: Mapping[str, dict[str, Any]],
    plan_skipped: list[SkippedItem],
    start: float,
    resumed: int,
) -> ConvertResult:
    """Complete the dataset from the done ``records`` of every shard: the skip report (or its
    removal), then the manifest, last, then the removal of the conversion state."""
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
    return ConvertResult.for_dataset(
        store,
        manifest,
        plan_sha256=plan.sha256,
        skipped=skipped,
        elapsed=time.monotonic() - start,
        resumed_shards=resumed,
    )
