"""``fastload inspect``, ``verify`` and ``index``: the dataset tools of
:mod:`fastload.convert.tools` on the command line, each on one dataset URL."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from typing import Any

from fastload._units import plural
from fastload.cli._common import (
    EXIT_ERROR,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    add_command,
    block_size,
    count,
    out,
    positive_int,
    registered,
    shard_progress,
    table,
)
from fastload.cli._store_options import add_store_options, url_store_options
from fastload.errors import StoreUnavailableError, TransientStoreError
from fastload.storage import unreachable_reason

__all__ = ["add_index", "add_inspect", "add_verify"]


_DATASET_URL = "dataset root (directory or store URL)"
#: Subcommand → its line in ``fastload --help``, and what its URL argument is.
_HELP = {
    "inspect": ("summarise a dataset: manifest, schema, shards, first samples", _DATASET_URL),
    "verify": (
        "recompute checksums, sizes, sample counts and indexes against the manifest "
        "(exit 1: problems found; 4: the store could not be read, no verdict)",
        _DATASET_URL,
    ),
    "index": (
        "build DALI-compatible .idx files; write a manifest for third-party shards",
        "dataset root or a directory of shards",
    ),
}


def _url_command(
    sub: Any, name: str, run: Callable[[argparse.Namespace], int]
) -> argparse.ArgumentParser:
    """Add subcommand ``name`` (see :data:`_HELP`) with its one argument, the dataset URL."""
    help_line, url_help = _HELP[name]
    p = add_command(sub, name, run, help=help_line)
    p.add_argument("url", help=url_help)
    return p


# ---- inspect -----------------------------------------------------------------------------------


def add_inspect(sub: Any) -> None:
    """Add the ``inspect`` subcommand to ``sub``."""
    p = _url_command(sub, "inspect", _run_inspect)
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--samples", type=count, default=3, help="samples to show (default 3)")
    p.add_argument(
        "--shards", type=positive_int, default=20, help="shard rows to show (default 20)"
    )
    order = p.add_argument_group(
        "shuffle quality (--order)",
        "how far the epoch order of these shuffle options is from a uniform permutation: "
        "samples of one shard next to each other, and together in a batch; nothing is read",
    )
    order.add_argument(
        "--order", action="store_true", help="report the shuffle's quality instead of the summary"
    )
    order.add_argument("--batch-size", type=positive_int, default=256, help="global batch")
    # Unset: open_dataset's defaults (read in _run_order: importing the loader here would import
    # torch for every command).
    order.add_argument(
        "--block-size",
        type=block_size,
        default=argparse.SUPPRESS,
        help="shuffle block in samples, or 'none' (default: open_dataset's, 64)",
    )
    order.add_argument("--window", type=positive_int, default=argparse.SUPPRESS, help="default: 64")
    order.add_argument("--seed", type=count, default=0)
    order.add_argument("--epoch", type=count, default=0)
    add_store_options(p)


def _run_order(args: argparse.Namespace) -> int:
    from fastload.formats import read_manifest
    from fastload.loader import DEFAULT_BLOCK_SIZE, DEFAULT_WINDOW, OrderOptions, order_quality
    from fastload.storage import open_store

    manifest = read_manifest(open_store(args.url, **(url_store_options(args) or {})))
    block = getattr(args, "block_size", DEFAULT_BLOCK_SIZE)
    window = getattr(args, "window", DEFAULT_WINDOW)
    options = OrderOptions(True, args.seed, block, window)
    sizes = [s.num_samples for s in manifest.shards]
    q = order_quality(sizes, options, batch_size=args.batch_size, epoch=args.epoch)
    if args.json:
        out(json.dumps({"order": dataclasses.asdict(options), "epoch": args.epoch,
                        **dataclasses.asdict(q)}))  # fmt: skip
        return EXIT_OK
    shuffle = "whole shards" if block is None else f"blocks of {block}"
    measured = "the whole epoch" if q.positions == q.num_samples else f"its first {q.positions:,}"
    out(
        f"shuffle order of {args.url}: {q.num_samples:,} samples in {q.num_shards:,} shards, "
        f"{shuffle}, window {window}, seed {args.seed}, epoch {args.epoch}; "
        f"measured over {measured}"
    )
    out(table(q.rows(), ("measure", "this order", "uniform shuffle")))
    return EXIT_OK


def _run_inspect(args: argparse.Namespace) -> int:
    from fastload._units import format_bytes
    from fastload.convert import inspect_dataset
    from fastload.convert.tools import write_inspect_json

    if args.order:
        return _run_order(args)
    if args.json:  # streamed: the shard list is 22 MB of JSON at 100,000 shards
        write_inspect_json(
            args.url, sys.stdout, samples=args.samples, store_options=url_store_options(args)
        )
        out()
        return EXIT_OK
    info = inspect_dataset(
        args.url,
        samples=args.samples,
        store_options=url_store_options(args),
    )
    out(f"dataset   {info['url']}")
    out(f"format    {info['format']} (manifest v{info['manifest_version']})")
    out(f"samples   {info['num_samples']}")
    out(f"shards    {info['num_shards']}")
    out(f"bytes     {info['num_bytes']} ({format_bytes(info['num_bytes'])})")
    created = info["created_by"]
    if created:
        out(f"created   {created.get('tool', '?')} {created.get('version', '')}".rstrip())
    classes = info["metadata"].get("classes")
    if isinstance(classes, list):
        shown = ", ".join(map(str, classes[:10])) + (" ..." if len(classes) > 10 else "")
        out(f"classes   {len(classes)}: {shown}")
    tokens = info.get("tokens")
    if tokens is not None:  # a token dataset (fastload/formats/tokens.py)
        tokenizer = tokens.get("tokenizer") or {}
        name = tokenizer.get("file") or tokenizer.get("function") or ""
        out(
            f"tokens    {tokens['tokens']} in {tokens['documents']} documents "
            f"({_dtype_name(tokens['dtype'])}, "
            f"vocab {tokens['vocab_size']}, EOS {tokens['eos_id']}, blocks of "
            f"{tokens['block_tokens']}; tokenizer {tokenizer.get('kind', '?')}"
            + (f" {name})" if name else ")")
        )
    out()
    out("schema")
    out(
        table(
            [(name, s.get("type", "?"), s.get("count", "?")) for name, s in info["schema"].items()],
            ("field", "type", "samples"),
        )
    )
    out()
    shards = info["shards"]
    out(f"shards ({len(shards)})")
    rows = [
        (s["name"], s["num_samples"], s["num_bytes"], s["sha256"][:16], s.get("index") or "-")
        for s in shards[: args.shards]
    ]
    out(table(rows, ("name", "samples", "bytes", "sha256", "index")))
    if len(shards) > args.shards:
        out(f"... {len(shards) - args.shards} more (--shards N or --json to see all)")
    if info["samples"]:
        out()
        out(f"first {plural(len(info['samples']), 'sample')}")
        sample_rows = [
            (s["key"], s["shard"], ", ".join(f"{k}={v}B" for k, v in s["field_bytes"].items()))
            for s in info["samples"]
        ]
        out(table(sample_rows, ("key", "shard", "fields (bytes)")))
    return EXIT_OK


# ---- verify ------------------------------------------------------------------------------------


def add_verify(sub: Any) -> None:
    """Add the ``verify`` subcommand to ``sub``."""
    p = _url_command(sub, "verify", _run_verify)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-index", action="store_true", help="do not check index files")
    p.add_argument(
        "--workers",
        type=positive_int,
        default=None,
        help="processes checking shards at once (default: all cores, 1 for a small dataset)",
    )
    add_store_options(p)


def _run_verify(args: argparse.Namespace) -> int:
    from fastload.convert import verify_dataset

    bar = shard_progress("verify")
    checked = 0

    def progress(done: int, total: int, nbytes: int) -> None:
        nonlocal checked
        checked = done
        if bar is not None:
            bar(done, total, nbytes)

    try:
        report = verify_dataset(
            args.url,
            check_index=not args.no_index,
            store_options=url_store_options(args),
            progress=progress,
            workers=args.workers,
        )
    except (StoreUnavailableError, TransientStoreError) as exc:
        if not checked and unreachable_reason(exc) is not None:
            raise  # no connection from the start: the address is wrong or no server runs there
        # The store could not be read: say so, and give no verdict on the data.
        sys.stderr.write(
            f"fastload verify: UNREADABLE {exc}\nNo verdict on {args.url}: the store could not "
            "be read (network or server), which says nothing about whether the data is "
            "damaged; run verify again when the store answers (for slow answers: --store-option "
            "read_timeout=SECONDS)\n"
        )
        return EXIT_UNAVAILABLE
    if args.json:
        out(json.dumps(report.to_json(), indent=2, sort_keys=True))
    else:
        for problem in report.problems:
            out(f"PROBLEM {problem}")
        for note in report.warnings:
            out(f"NOTE {note}")
        status = "OK" if report.ok else plural(len(report.problems), "problem")
        out(
            f"{status}: checked {plural(report.shards_checked, 'shard')}, read "
            f"{plural(report.samples_read, 'sample')} at {report.url}"
        )
    return EXIT_OK if report.ok else EXIT_ERROR


def _dtype_name(dtype: str) -> str:
    """A token dataset's id type as numpy names it (``u2`` → ``uint16``)."""
    import numpy as np

    try:
        return np.dtype(dtype).name
    except TypeError:
        return dtype


# ---- index -------------------------------------------------------------------------------------


def add_index(sub: Any) -> None:
    """Add the ``index`` subcommand to ``sub``."""
    p = _url_command(sub, "index", _run_index)
    p.add_argument(
        "--format", default=None, type=registered("format"), help="only shards of this format"
    )
    p.add_argument("--no-manifest", action="store_true", help="write index files only, no manifest")
    add_store_options(p)


def _run_index(args: argparse.Namespace) -> int:
    from fastload.convert import index_dataset
    from fastload.formats import get_format

    result = index_dataset(
        args.url,
        format=args.format,
        write_manifest_file=not args.no_manifest,
        store_options=url_store_options(args),
        progress=shard_progress("index"),
    )
    if get_format(result.format).build_index is None:  # LMDB: the environment is its index
        done = "no index files needed (an LMDB shard is looked up by key)"
    else:
        done = (
            f"wrote {plural(len(result.indexed), 'index file')}, {len(result.unchanged)} "
            f"{'was' if len(result.unchanged) == 1 else 'were'} up to date"
        )
    out(
        f"{result.format}: {done}"
        + ("; wrote fastload.json" if result.manifest_written else "")
        + (f"; ignored {plural(len(result.ignored), 'other object')}" if result.ignored else "")
        + f" at {result.url}"
    )
    for note in result.warnings:
        out(f"note: {note}")
    return EXIT_OK
