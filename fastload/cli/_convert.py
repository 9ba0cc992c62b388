"""``fastload convert SRC DST``: :func:`fastload.convert.convert` on the command line."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from fastload.cli._common import (
    EXIT_OK,
    EXIT_SKIPPED,
    UsageError,
    add_command,
    positive_int,
    registered,
    size,
)
from fastload.cli._store_options import add_store_options, check_endpoint_used, options_for
from fastload.convert import DEFAULT_BLOCK_TOKENS, ENGINES, Tokenize

if TYPE_CHECKING:
    from fastload.convert import ConvertResult

__all__ = ["add", "convert_exit_status"]

#: The options of :func:`fastload.convert.convert` that the command line passes on as they are,
#: under the same names (the store options are combined with ``--endpoint-url`` first).
_PASSED_ON = (
    "format",
    "shard_size",
    "shard_samples",
    "workers",
    "executor",
    "ray_address",
    "spark_master",
    "shuffle",
    "seed",
    "on_error",
    "overwrite",
    "dry_run",
    "map_fn",
    "source_type",
    "prefix",
    "quiet",
)


def convert_exit_status(result: ConvertResult) -> int:
    """The exit status of a conversion that completed: :data:`EXIT_SKIPPED` if items were
    skipped, else :data:`EXIT_OK`."""
    return EXIT_SKIPPED if result.skipped else EXIT_OK


def add(sub: Any) -> None:
    """Add the ``convert`` subcommand to ``sub``."""
    p = add_command(
        sub,
        "convert",
        _run,
        help="convert a corpus (image folder, files, JSONL, text, CSV, Parquet, shards) to shards",
        description=(
            "Convert SRC (a directory, store URL or file) into a sharded dataset at DST with a "
            "fastload.json manifest. Deterministic (same input and options give the same bytes "
            "whatever --workers is) and resumable (re-run the same command after an interruption, "
            "even kill -9, to finish). Sources are auto-detected: a fastload dataset or shard files "
            "(.tar/.tfrecord/.lmdb); .jsonl, .txt, .csv or .parquet files; root/<class>/<image> "
            "(imagefolder); anything else is a file tree grouped by path without extension."
        ),
    )
    p.add_argument("src", help="the corpus: directory, store URL or single file")
    p.add_argument("dst", help="the dataset root: directory or store URL (s3://, hdfs://, ...)")
    p.add_argument(
        "--format",
        default="webdataset",
        type=registered("format"),
        help="webdataset (wds), tfrecord or lmdb (default: webdataset)",
    )
    p.add_argument(
        "--shard-size",
        default=None,
        type=size,
        help="target shard size, e.g. 256MB (decimal) or 1GiB (binary); default 256MB",
    )
    p.add_argument(
        "--shard-samples", type=positive_int, default=None, help="at most N samples per shard"
    )
    p.add_argument(
        "--workers", type=positive_int, default=None, help="worker processes (default: all cores)"
    )
    p.add_argument(
        "--executor",
        choices=tuple(ENGINES),
        default="local",
        help="what writes the shards: "
        + "; ".join(f"{e.name}: {e.summary}" for e in ENGINES.values())
        + ". Every executor writes the same bytes; with a cluster's, stores must be reachable "
        "from every node: s3://, hdfs://, or a directory every node mounts at the same path",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="the Ray cluster for --executor ray (auto, HOST:6379, ray://HOST:10001; default "
        "$RAY_ADDRESS, else a local Ray runtime)",
    )
    p.add_argument(
        "--spark-master",
        default=None,
        metavar="URL",
        help="the Spark master for --executor spark (spark://HOST:7077, yarn, k8s://..., "
        "local[4]; default: the one spark-submit sets, else local[*]; an active SparkContext "
        "in this process is used as it is)",
    )
    p.add_argument("--shuffle", action="store_true", help="mix the sample order (see --seed)")
    p.add_argument("--seed", type=int, default=0, help="seed of --shuffle (default 0)")
    p.add_argument(
        "--on-error",
        choices=("raise", "skip"),
        default="raise",
        help="stop at the first bad item (raise, default) or skip bad items and list them in "
        "_fastload_skipped.jsonl beside the manifest (exit status 3; a conversion that keeps "
        "no sample fails)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a different dataset at DST")
    p.add_argument("--dry-run", action="store_true", help="print the plan; write nothing")
    p.add_argument(
        "--map",
        dest="map_fn",
        default=None,
        metavar="MODULE:FUNCTION",
        help="transform each sample with FUNCTION(sample) -> sample, or None to drop it",
    )
    p.add_argument(
        "--source-type",
        default=None,
        type=registered("source type"),
        help="force the source type: imagefolder, files, jsonl, text, csv, parquet, shards",
    )
    p.add_argument("--prefix", default="shard", help="shard name prefix (default: shard)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress and no summary")
    t = p.add_argument_group(
        "token datasets",
        "tokenize each record's text into blocks of token ids (see fastload/convert/README.md)",
    )
    t.add_argument(
        "--tokenize",
        metavar="TOKENIZER",
        default=None,
        help="a Hugging Face tokenizer.json file (local), MODULE:FUNCTION returning ids, or byte",
    )
    t.add_argument(
        "--text-field",
        default=None,
        help="the field (JSONL key, CSV/Parquet column) holding the text (default: text)",
    )
    t.add_argument(
        "--eos",
        default=None,
        help="token or id appended after each document, or none (default: the tokenizer's own)",
    )
    t.add_argument(
        "--block-tokens",
        type=positive_int,
        default=None,
        help=f"token ids per block, i.e. per sample (default {DEFAULT_BLOCK_TOKENS})",
    )
    add_store_options(p, src=True)


def _tokenize(args: argparse.Namespace) -> Tokenize | None:
    """The :class:`Tokenize` options of ``--tokenize`` and its companions (``None`` without it).

    Raises:
        UsageError: A companion option without ``--tokenize``.
    """
    if args.tokenize is None:
        given = [
            flag
            for flag, value in (
                ("--text-field", args.text_field),
                ("--eos", args.eos),
                ("--block-tokens", args.block_tokens),
            )
            if value is not None
        ]
        if given:
            raise UsageError(f"{', '.join(given)} only applies with --tokenize TOKENIZER")
        return None
    eos = int(args.eos) if args.eos is not None and args.eos.strip().isdigit() else args.eos
    return Tokenize(
        args.tokenize,
        text_field=args.text_field,
        eos=eos,
        block_tokens=args.block_tokens or DEFAULT_BLOCK_TOKENS,
    )


def _run(args: argparse.Namespace) -> int:
    from fastload.convert import convert

    check_endpoint_used(args, SRC=args.src, DST=args.dst)
    result = convert(
        args.src,
        args.dst,
        **{name: getattr(args, name) for name in _PASSED_ON},
        tokenize=_tokenize(args),
        store_options=options_for(args.dst, args, args.store_options),
        source_options=options_for(args.src, args, args.src_store_options),
    )
    return convert_exit_status(result)
