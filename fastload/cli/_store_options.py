"""Store options on the command line: ``--endpoint-url``, ``--store-option KEY=VALUE`` (and for
``convert`` ``--src-store-option``), and the store's retry lines printed on stderr."""

from __future__ import annotations

import argparse
import logging
import re
import sys
import textwrap
from typing import Any

from fastload.cli._common import UsageError

__all__ = [
    "add_store_options",
    "check_endpoint_used",
    "options_for",
    "parse_option_value",
    "show_retries",
    "url_store_options",
]

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


def add_store_options(p: argparse.ArgumentParser, *, src: bool = False) -> None:
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


def options_for(
    url: str, args: argparse.Namespace, own: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The store options of ``url``: ``--endpoint-url`` if it is an s3:// URL, then ``own``."""
    options: dict[str, Any] = {}
    if args.endpoint_url is not None and _is_s3(url):
        options["endpoint_url"] = args.endpoint_url
    options.update(own or {})
    return options or None


def check_endpoint_used(args: argparse.Namespace, **urls: str) -> None:
    """``--endpoint-url`` without any s3:// URL is a mistake (a path missing ``s3://``?)."""
    if args.endpoint_url is None or any(_is_s3(u) for u in urls.values()):
        return
    names = " nor ".join(urls)
    raise UsageError(
        f"--endpoint-url applies to s3:// URLs, and {'neither ' if len(urls) > 1 else ''}"
        f"{names} is {'one' if len(urls) > 1 else 'not one'} "
        f"({', '.join(repr(u) for u in urls.values())}); write an S3 dataset as "
        "s3://bucket/prefix, or pass options of other stores with --store-option"
    )


class _RetryLines(logging.StreamHandler):  # type: ignore[type-arg]
    """Prints ``fastload.storage`` records (one line per retry) on the current ``sys.stderr``."""

    def emit(self, record: logging.LogRecord) -> None:
        # Not setStream(): it flushes the previous stream, which may be closed by now (a
        # replaced sys.stderr, such as pytest's capture of an earlier test).
        self.stream = sys.stderr
        super().emit(record)


def show_retries(command: str, *, quiet: bool) -> None:
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


def url_store_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """The store options of a one-URL subcommand (``inspect``, ``verify``, ``index``), after
    checking that ``--endpoint-url`` applies to its URL."""
    check_endpoint_used(args, URL=args.url)
    return options_for(args.url, args, args.store_options)
