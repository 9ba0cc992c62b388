"""The ``fastload`` command: ``convert``, ``inspect``, ``verify``, ``index``.

Each subcommand is a thin layer over the Python API in :mod:`fastload.convert`; adding one means
writing a ``_add_<name>(subparsers)`` function that sets ``func`` and listing it in
:data:`SUBCOMMANDS`.

Subcommands that open a store take the store options of :func:`_add_store_options`
(``--endpoint-url``, ``--store-option KEY=VALUE``; ``convert`` also ``--src-store-option``), and
the retry lines of :class:`fastload.storage.RetryStore` (INFO on the ``fastload.storage`` logger)
are printed on stderr, one per retry.

Exit status (every subcommand):
  0  success
  1  error (message on stderr), or ``verify`` found problems
  2  invalid command line
  3  ``convert`` completed, but ``--on-error skip`` skipped items (listed in the skip report)
  130 interrupted (Ctrl-C); a re-run of ``convert`` resumes
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

from fastload.errors import FastloadError

__all__ = ["SUBCOMMANDS", "build_parser", "main"]

_EXIT_CODES = """exit status:
  0    success
  1    error (message on stderr), or verify found problems
  2    invalid command line
  3    convert completed, but --on-error skip skipped items (see _fastload_skipped.jsonl)
  130  interrupted; re-run the same convert command to resume
"""


def _out(text: str = "") -> None:
    sys.stdout.write(text + "\n")


def _table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if c[:1].isdigit() else c.ljust(w) for c, w in zip(r, widths))

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(x.rstrip() for x in out)


# ---- store options ------------------------------------------------------------------------------


class _UsageError(Exception):
    """A command line that parses but makes no sense (exit status 2)."""


_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?([0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)([eE][+-]?[0-9]+)?")
_BOOLS = {"true": True, "false": False}


def parse_option_value(text: str) -> bool | int | float | str:
    """A ``--store-option`` value: ``true``/``false`` (any case) are bools, ``8``/``-1`` ints,
    ``0.5``/``1e3`` floats, anything else stays a string."""
    if text.lower() in _BOOLS:
        return _BOOLS[text.lower()]
    if _INT.fullmatch(text):
        return int(text)
    if _FLOAT.fullmatch(text):
        return float(text)
    return text


def _store_option(text: str) -> tuple[str, bool | int | float | str]:
    """argparse type of ``--store-option KEY=VALUE``. Messages never echo the value (secrets)."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep:  # the text may be a secret meant as a value: not shown
        raise argparse.ArgumentTypeError("expected KEY=VALUE, such as region=us-east-1 (no '=')")
    if not key.isidentifier():
        fixed = key.replace("-", "_")
        hint = f" (did you mean {fixed}?)" if fixed.isidentifier() else ""
        raise argparse.ArgumentTypeError(
            f"{key!r} is not an option name such as endpoint_url or read_only{hint}"
        )
    return key, parse_option_value(value)


class _StoreOptionAction(argparse.Action):
    """Collects repeated ``KEY=VALUE`` options into a dict; a key given twice is an error."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        key, value = values
        options = dict(getattr(namespace, self.dest) or {})
        if key in options:
            parser.error(f"{option_string} {key}=... is given twice")
        options[key] = value
        setattr(namespace, self.dest, options)


_STORE_OPTIONS_DOC = (
    "--endpoint-url goes to every s3:// URL of the command; without it the standard "
    "AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL environment variable (or endpoint_url in "
    "~/.aws/config) is used, else AWS. Credentials come from AWS_ACCESS_KEY_ID/"
    "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws (keep secrets off the command line: it is "
    "visible to other users in ps). {targets} Retries are printed on stderr, one line each."
)


def _add_store_options(p: argparse.ArgumentParser, *, src: bool = False) -> None:
    """Add ``--endpoint-url`` and ``--store-option`` (and for ``convert`` ``--src-store-option``).

    How they apply: ``--endpoint-url URL`` sets ``endpoint_url`` of every ``s3://`` URL on the
    command line (SRC and DST of ``convert``); ``--store-option`` goes to the store of the URL
    (``convert``: DST) and overrides ``--endpoint-url`` there; ``--src-store-option`` goes to
    ``convert``'s SRC and overrides ``--endpoint-url`` there. Options reach
    :func:`fastload.open_store` unchanged, so the backend rejects unknown keys itself.
    """
    targets = (
        "--store-option goes to DST's store and --src-store-option to SRC's; either overrides "
        "--endpoint-url for its side."
        if src
        else "--store-option goes to the store of URL and overrides --endpoint-url."
    )
    doc = textwrap.fill(_STORE_OPTIONS_DOC.format(targets=targets), 76)
    group = p.add_argument_group("store options", doc)
    group.add_argument(
        "--endpoint-url",
        metavar="URL",
        default=None,
        help="S3 endpoint of Ceph RGW or MinIO, e.g. http://127.0.0.1:7480",
    )
    side = "DST's store" if src else "the store"
    group.add_argument(
        "--store-option",
        dest="store_options",
        metavar="KEY=VALUE",
        type=_store_option,
        action=_StoreOptionAction,
        default=None,
        help=f"an option of {side} (repeatable), e.g. region=us-east-1, max_concurrency=8, "
        "retry=false; true/false, integers and decimals are converted",
    )
    if src:
        group.add_argument(
            "--src-store-option",
            dest="src_store_options",
            metavar="KEY=VALUE",
            type=_store_option,
            action=_StoreOptionAction,
            default=None,
            help="an option of SRC's store (repeatable), as --store-option",
        )


def _is_s3(url: str) -> bool:
    return url[:5].lower() == "s3://"


def _options_for(
    url: str, args: argparse.Namespace, own: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The store options of ``url``: ``--endpoint-url`` if it is an s3:// URL, then ``own``."""
    options: dict[str, Any] = {}
    if args.endpoint_url is not None and _is_s3(url):
        options["endpoint_url"] = args.endpoint_url
    options.update(own or {})
    return options or None


def _check_endpoint_used(args: argparse.Namespace, **urls: str) -> None:
    """``--endpoint-url`` without any s3:// URL is a mistake (a path missing ``s3://``?)."""
    if args.endpoint_url is None or any(_is_s3(u) for u in urls.values()):
        return
    names = " nor ".join(urls)
    raise _UsageError(
        f"--endpoint-url applies to s3:// URLs, and {'neither ' if len(urls) > 1 else ''}"
        f"{names} is {'one' if len(urls) > 1 else 'not one'} "
        f"({', '.join(repr(u) for u in urls.values())}); write an S3 dataset as "
        "s3://bucket/prefix, or pass options of other stores with --store-option"
    )


class _RetryLines(logging.StreamHandler):  # type: ignore[type-arg]
    """Prints ``fastload.storage`` records (one line per retry) on the current ``sys.stderr``."""

    def emit(self, record: logging.LogRecord) -> None:
        self.setStream(sys.stderr)
        super().emit(record)


def _show_retries(command: str, *, quiet: bool) -> None:
    """Print the store's retry lines (INFO) on stderr; with ``--quiet`` only its warnings."""
    log = logging.getLogger("fastload.storage")
    for old in [h for h in log.handlers if isinstance(h, _RetryLines)]:
        log.removeHandler(old)
    handler = _RetryLines(sys.stderr)
    handler.setFormatter(logging.Formatter(f"fastload {command}: %(message)s"))
    handler.setLevel(logging.WARNING if quiet else logging.INFO)
    log.addHandler(handler)
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO)


# ---- option values ------------------------------------------------------------------------------
# Bad values are usage errors (exit 2, with the usage line), found before anything runs.


def _whole(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
    return value


def _positive_int(text: str) -> int:
    return _whole(text, 1)


def _count(text: str) -> int:
    return _whole(text, 0)


def _size(text: str) -> int:
    from fastload._units import parse_size

    try:
        return parse_size(text)
    except FastloadError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _registered(registry: str) -> Callable[[str], str]:
    """argparse type for a name of a plugin registry (formats, sources), with did-you-mean."""

    def parse(text: str) -> str:
        if registry == "format":
            from fastload.formats._base import FORMATS as reg
        else:
            from fastload.convert._sources import SOURCES as reg
        try:
            return str(reg.canonical(text))
        except FastloadError as exc:
            message = str(exc).split(". Pass one of these", 1)[0]
            raise argparse.ArgumentTypeError(message) from None

    parse.__name__ = registry  # argparse names the type in its messages
    return parse


def _shard_progress(command: str) -> Callable[[int, int, int], None] | None:
    """A progress bar on stderr for ``verify``/``index`` (shards and bytes), on a terminal only."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    bar = tqdm(desc=f"fastload {command}", unit="shard", file=sys.stderr, leave=False)

    def update(done: int, total: int, nbytes: int) -> None:
        bar.total = total
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return update


# ---- convert -----------------------------------------------------------------------------------


def _add_convert(sub: Any) -> None:
    p = sub.add_parser(
        "convert",
        help="convert a corpus (image folder, files, JSONL, text, CSV, Parquet, shards) to shards",
        description=(
            "Convert SRC (a directory, store URL or file) into a sharded dataset at DST with a "
            "fastload.json manifest. Deterministic (same input and options give the same bytes "
            "whatever --workers is) and resumable (re-run the same command after an interruption, "
            "even kill -9, to finish). Sources are auto-detected: a fastload dataset or shard files "
            "(.tar/.tfrecord/.lmdb); .jsonl, .txt, .csv or .parquet files; root/<class>/<image> "
            "(imagefolder); anything else is a file tree grouped by path without extension."
        ),
        epilog=_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src", help="the corpus: directory, store URL or single file")
    p.add_argument("dst", help="the dataset root: directory or store URL (s3://, hdfs://, ...)")
    p.add_argument(
        "--format",
        default="webdataset",
        type=_registered("format"),
        help="webdataset (wds), tfrecord or lmdb (default: webdataset)",
    )
    p.add_argument(
        "--shard-size",
        default=None,
        type=_size,
        help="target shard size, e.g. 256MB (decimal) or 1GiB (binary); default 256MB",
    )
    p.add_argument(
        "--shard-samples", type=_positive_int, default=None, help="at most N samples per shard"
    )
    p.add_argument(
        "--workers", type=_positive_int, default=None, help="worker processes (default: all cores)"
    )
    p.add_argument("--shuffle", action="store_true", help="mix the sample order (see --seed)")
    p.add_argument("--seed", type=int, default=0, help="seed of --shuffle (default 0)")
    p.add_argument(
        "--on-error",
        choices=("raise", "skip"),
        default="raise",
        help="stop at the first bad item (raise, default) or skip bad items and list them in "
        "_fastload_skipped.jsonl beside the manifest (exit status 3)",
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
        type=_registered("source type"),
        help="force the source type: imagefolder, files, jsonl, text, csv, parquet, shards",
    )
    p.add_argument("--prefix", default="shard", help="shard name prefix (default: shard)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress and no summary")
    _add_store_options(p, src=True)
    p.set_defaults(func=_run_convert)


def _run_convert(args: argparse.Namespace) -> int:
    from fastload.convert import convert

    _check_endpoint_used(args, SRC=args.src, DST=args.dst)
    result = convert(
        args.src,
        args.dst,
        format=args.format,
        shard_size=args.shard_size,
        shard_samples=args.shard_samples,
        workers=args.workers,
        shuffle=args.shuffle,
        seed=args.seed,
        on_error=args.on_error,
        overwrite=args.overwrite,
        dry_run=args.dry_run,
        map_fn=args.map_fn,
        source_type=args.source_type,
        prefix=args.prefix,
        quiet=args.quiet,
        store_options=_options_for(args.dst, args, args.store_options),
        source_options=_options_for(args.src, args, args.src_store_options),
    )
    return result.exit_code


# ---- inspect -----------------------------------------------------------------------------------


def _add_inspect(sub: Any) -> None:
    p = sub.add_parser(
        "inspect",
        help="summarise a dataset: manifest, schema, shards, first samples",
        epilog=_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("url", help="dataset root (directory or store URL)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--samples", type=_count, default=3, help="samples to show (default 3)")
    p.add_argument(
        "--shards", type=_positive_int, default=20, help="shard rows to show (default 20)"
    )
    _add_store_options(p)
    p.set_defaults(func=_run_inspect)


def _run_inspect(args: argparse.Namespace) -> int:
    from fastload.convert import inspect_dataset
    from fastload.convert._progress import format_bytes

    _check_endpoint_used(args, URL=args.url)
    info = inspect_dataset(
        args.url,
        samples=args.samples,
        store_options=_options_for(args.url, args, args.store_options),
    )
    if args.json:
        _out(json.dumps(info, indent=2, sort_keys=True, ensure_ascii=False))
        return 0
    _out(f"dataset   {info['url']}")
    _out(f"format    {info['format']} (manifest v{info['manifest_version']})")
    _out(f"samples   {info['num_samples']}")
    _out(f"shards    {info['num_shards']}")
    _out(f"bytes     {info['num_bytes']} ({format_bytes(info['num_bytes'])})")
    created = info["created_by"]
    if created:
        _out(f"created   {created.get('tool', '?')} {created.get('version', '')}".rstrip())
    classes = info["metadata"].get("classes")
    if isinstance(classes, list):
        shown = ", ".join(map(str, classes[:10])) + (" ..." if len(classes) > 10 else "")
        _out(f"classes   {len(classes)}: {shown}")
    _out()
    _out("schema")
    _out(
        _table(
            [(name, s.get("type", "?"), s.get("count", "?")) for name, s in info["schema"].items()],
            ("field", "type", "samples"),
        )
    )
    _out()
    shards = info["shards"]
    _out(f"shards ({len(shards)})")
    rows = [
        (s["name"], s["num_samples"], s["num_bytes"], s["sha256"][:16], s.get("index") or "-")
        for s in shards[: args.shards]
    ]
    _out(_table(rows, ("name", "samples", "bytes", "sha256", "index")))
    if len(shards) > args.shards:
        _out(f"... {len(shards) - args.shards} more (--shards N or --json to see all)")
    if info["samples"]:
        _out()
        _out(f"first {len(info['samples'])} samples")
        sample_rows = [
            (s["key"], s["shard"], ", ".join(f"{k}={v}B" for k, v in s["field_bytes"].items()))
            for s in info["samples"]
        ]
        _out(_table(sample_rows, ("key", "shard", "fields (bytes)")))
    return 0


# ---- verify ------------------------------------------------------------------------------------


def _add_verify(sub: Any) -> None:
    p = sub.add_parser(
        "verify",
        help="recompute checksums, sizes, sample counts and indexes against the manifest",
        epilog=_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("url", help="dataset root (directory or store URL)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-index", action="store_true", help="do not check index files")
    _add_store_options(p)
    p.set_defaults(func=_run_verify)


def _run_verify(args: argparse.Namespace) -> int:
    from fastload.convert import verify_dataset

    _check_endpoint_used(args, URL=args.url)
    report = verify_dataset(
        args.url,
        check_index=not args.no_index,
        store_options=_options_for(args.url, args, args.store_options),
        progress=_shard_progress("verify"),
    )
    if args.json:
        _out(json.dumps(report.to_json(), indent=2, sort_keys=True))
    else:
        for problem in report.problems:
            _out(f"PROBLEM {problem}")
        for note in report.warnings:
            _out(f"NOTE {note}")
        status = "OK" if report.ok else f"{len(report.problems)} problem(s)"
        _out(
            f"{status}: checked {report.shards_checked} shards, read {report.samples_read} "
            f"samples at {report.url}"
        )
    return 0 if report.ok else 1


# ---- index -------------------------------------------------------------------------------------


def _add_index(sub: Any) -> None:
    p = sub.add_parser(
        "index",
        help="build DALI-compatible .idx files; write a manifest for third-party shards",
        epilog=_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("url", help="dataset root or a directory of shards")
    p.add_argument(
        "--format", default=None, type=_registered("format"), help="only shards of this format"
    )
    p.add_argument("--no-manifest", action="store_true", help="write index files only, no manifest")
    _add_store_options(p)
    p.set_defaults(func=_run_index)


def _run_index(args: argparse.Namespace) -> int:
    from fastload.convert import index_dataset

    _check_endpoint_used(args, URL=args.url)
    result = index_dataset(
        args.url,
        format=args.format,
        write_manifest_file=not args.no_manifest,
        store_options=_options_for(args.url, args, args.store_options),
        progress=_shard_progress("index"),
    )
    _out(
        f"{result.format}: wrote {len(result.indexed)} index files, {len(result.unchanged)} "
        f"were up to date"
        + ("; wrote fastload.json" if result.manifest_written else "")
        + (f"; ignored {len(result.ignored)} other objects" if result.ignored else "")
        + f" at {result.url}"
    )
    for note in result.warnings:
        _out(f"note: {note}")
    return 0


#: Subcommand name → function adding its parser (which sets ``func``).
SUBCOMMANDS: dict[str, Callable[[Any], None]] = {
    "convert": _add_convert,
    "inspect": _add_inspect,
    "verify": _add_verify,
    "index": _add_index,
}


def build_parser() -> argparse.ArgumentParser:
    """The ``fastload`` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="fastload",
        description="fastload: convert corpora to shards, inspect, verify and index datasets.",
        epilog=_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from fastload import __version__

    parser.add_argument("--version", action="version", version=f"fastload {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for add in SUBCOMMANDS.values():
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``fastload`` command; returns the exit status (see the module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _show_retries(args.command, quiet=bool(getattr(args, "quiet", False)))
    try:
        code: int = args.func(args)
    except _UsageError as exc:
        sys.stderr.write(f"fastload {args.command}: error: {exc}\n")
        return 2
    except KeyboardInterrupt as exc:
        # convert has said how far it got and how to resume (its note; printed already unless
        # --quiet); the other commands have nothing to resume
        notes = getattr(exc, "__notes__", None)
        if not notes:
            sys.stderr.write(f"fastload {args.command}: interrupted\n")
        elif getattr(args, "quiet", False):
            for note in notes:
                sys.stderr.write(f"fastload {args.command}: {note}\n")
        return 130
    except BrokenPipeError:  # `fastload inspect ... | head`: the reader has what it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so that flushing at exit does not fail again
        return 0
    except (FastloadError, OSError) as exc:
        sys.stderr.write(f"fastload {args.command}: error: {exc}\n")
        for note in getattr(exc, "__notes__", ()):
            sys.stderr.write(f"  {note}\n")
        return 1
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
