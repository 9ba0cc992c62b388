"""The options of one conversion, checked once: :class:`ConvertOptions`.

:func:`fastload.convert` takes its options as keywords (``fastload/convert/README.md`` lists them)
and builds a :class:`ConvertOptions` from them before it opens anything, so that every bad value
fails at once, with the same typed error and message whatever the later steps would have met.
The steps after it (plan, destination, run, finish) read the checked values from the object,
never the raw keywords again.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import IO, Any

from fastload._units import check_int
from fastload.convert._engines import Engine, get_engine
from fastload.convert._map import MapFn, resolve_map
from fastload.convert._plan import option_name, shard_size_limit
from fastload.convert._tokenizer import TokenFn, Tokenize, TokenizerSpec, resolve_tokenizer
from fastload.convert.sources import SOURCES, Source
from fastload.errors import InvalidArgumentError
from fastload.formats import FORMATS, ErrorPolicy, Format, get_format

__all__ = ["ON_ERROR", "ConvertOptions"]

#: The ``on_error`` policies convert accepts: those of
#: :class:`~fastload.formats._base.ErrorPolicy` but ``warn``, since every item left out is listed
#: in the skip report rather than only logged.
ON_ERROR = ("raise", "skip")


@dataclass(frozen=True)
class ConvertOptions:
    """Every option of one conversion, as :func:`fastload.convert` takes them (its docstring
    says what each means; the defaults are its defaults), checked when the object is made.

    The fields after ``tokenize`` are derived once from the others: the format, the shard size
    limit in bytes, the worker count, the engine and its address, the directory a ``map_fn``
    name is looked up in and the stream progress goes to.

    Raises:
        InvalidArgumentError: A value is invalid; the message names the option in both
            spellings (``shard_samples (--shard-samples)``) and what it must be.
        Exception: Whatever finding ``map_fn`` raises (a module or function that does not
            exist: :func:`~fastload.convert._map.resolve_map`), here, before anything is opened.
    """

    format: str = "webdataset"
    shard_size: int | str | None = None
    shard_samples: int | None = None
    workers: int | None = None
    executor: str = "local"
    ray_address: str | None = None
    spark_master: str | None = None
    shuffle: bool = False
    seed: int = 0
    on_error: str = "raise"
    overwrite: bool = False
    dry_run: bool = False
    map_fn: str | MapFn | None = None
    source_type: str | None = None
    prefix: str = "shard"
    quiet: bool = False
    store_options: Mapping[str, Any] | None = None
    source_options: Mapping[str, Any] | None = None
    progress_stream: IO[str] | None = None
    tokenize: str | TokenFn | Tokenize | None = None

    #: The output format, and its canonical name (``wds`` -> ``webdataset``).
    fmt: Format = field(init=False, repr=False, compare=False)
    format_name: str = field(init=False, compare=False)
    #: ``shard_size`` in bytes; the default when neither limit is given; None: samples only.
    size_limit: int | None = field(init=False, compare=False)
    #: ``workers``, ``os.cpu_count()`` when not given.
    n_workers: int = field(init=False, compare=False)
    #: The engine ``executor`` names, and its cluster address (``ray_address``, ...) if any.
    engine: Engine = field(init=False, repr=False, compare=False)
    address: str | None = field(init=False, compare=False)
    #: The directory a ``"module:function"`` ``map_fn`` is looked for in (the current one).
    map_dir: str | None = field(init=False, compare=False)
    #: Where progress and the summary go: ``progress_stream``, else ``sys.stderr``.
    stream: IO[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ErrorPolicy.check(self.on_error, choices=ON_ERROR, name=option_name("on_error"))
        self._derive("fmt", get_format(self.format))
        self._derive("format_name", FORMATS.canonical(self.format))
        self._derive("size_limit", shard_size_limit(self.shard_size, self.shard_samples))
        if self.shard_samples is not None:
            check_int(option_name("shard_samples"), self.shard_samples, minimum=1)
        n_workers = (os.cpu_count() or 1) if self.workers is None else self.workers
        check_int(option_name("workers"), n_workers, minimum=1)
        self._derive("n_workers", n_workers)
        engine = get_engine(self.executor)
        addresses = {"ray_address": self.ray_address, "spark_master": self.spark_master}
        for option, value in addresses.items():
            if value is not None and option != engine.address_option:
                raise InvalidArgumentError(
                    f"{option_name(option)} is not used by executor={self.executor!r}; pass the "
                    "executor it is for, or leave it out"
                )
        self._derive("engine", engine)
        self._derive("address", addresses.get(engine.address_option or ""))
        prefix = self.prefix
        if not prefix or "/" in prefix or prefix.startswith((".", "_")):
            raise InvalidArgumentError(
                f"{option_name('prefix')} {prefix!r} must be a non-empty name without '/' that "
                "does not start with '.' or '_'"
            )
        self._derive("map_dir", os.getcwd() if isinstance(self.map_fn, str) else None)
        resolve_map(self.map_fn, self.map_dir)  # fail early, in the parent, for a bad spec
        stream = self.progress_stream if self.progress_stream is not None else sys.stderr
        self._derive("stream", stream)

    def _derive(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # a derived field of a frozen dataclass

    def tokenizer(self, source: Source) -> TokenizerSpec | None:
        """The tokenizer ``tokenize`` names, checked against the source (a source without text
        is refused), or None for a plain conversion."""
        if self.tokenize is None:
            return None
        return resolve_tokenizer(self.tokenize, SOURCES.canonical(source.type_name), os.getcwd())
