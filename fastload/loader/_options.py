"""The reading and store options of the entry points, each validated once, in one place.

:func:`~fastload.loader.open_dataset`, :func:`~fastload.loader.open_tokens`, the webdataset
adapter (:mod:`fastload.wds`) and ``fastload.dali.DALILoader`` keep their keywords (one spelling
each); they gather them into these objects first, and what they build takes the objects:

* :class:`ReadOptions`: how samples are read and prepared (``decode``, ``transform``,
  ``fields``, ``on_error``, ``max_open_shards``, ``prefetch_shards``, ``filter``), taken by
  :class:`~fastload.loader._shards.ShardedDataset`;
* :class:`StoreOptions`: where the shards come from and the local cache in front
  (``store_options``, ``cache_dir``, ``cache_size``): :meth:`StoreOptions.open` is the one
  place a URL or a store becomes the store a dataset reads;
* the epoch order's options are :class:`~fastload.loader.order._order.OrderOptions`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from fastload._units import check_int
from fastload.errors import InvalidArgumentError
from fastload.formats import ErrorPolicy, OnError
from fastload.loader._select import ToTuple, Transform
from fastload.storage import DEFAULT_CACHE_SIZE, Store, open_store, parse_size, wrap_store

__all__ = ["DEFAULT_PREFETCH_SHARDS", "ReadOptions", "StoreOptions"]

#: Shards each reading process asks a caching store to fetch ahead of its reads (see
#: :func:`~fastload.loader.open_dataset`, ``prefetch_shards``).
DEFAULT_PREFETCH_SHARDS = 2

Decode = Callable[[dict[str, Any]], Any] | str | Literal[False] | None


@dataclass(frozen=True)
class ReadOptions:
    """How a dataset's samples are read and prepared (``open_dataset``'s options of that name).

    Derived on construction: :attr:`decoder`, the callable ``decode`` stands for (``None`` for
    ``None``/``False``, keep the bytes; a :class:`~fastload.loader.decode.Decoder` for an image
    mode string), and :attr:`select`, the :class:`~fastload.loader._select.ToTuple` of
    ``fields``.

    Raises:
        InvalidArgumentError: A ``decode`` that is neither callable nor an image mode, a
            ``transform`` that is neither callable nor a mapping of callables, an unknown
            ``on_error``, a bad ``max_open_shards`` or ``prefetch_shards``, a ``filter`` that is
            not callable.
    """

    decode: Decode = None
    transform: Transform | None = None
    fields: Sequence[str] | str | None = None
    on_error: OnError = "raise"
    max_open_shards: int | None = None
    prefetch_shards: int = DEFAULT_PREFETCH_SHARDS
    filter: Callable[[Any], bool] | None = None
    decoder: Callable[[dict[str, Any]], Any] | None = field(init=False, repr=False, compare=False)
    select: ToTuple | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ErrorPolicy(self.on_error)  # validates
        decode = self.decode
        if decode is False:  # webdataset users write decode=False for "keep the bytes"
            decode = None
        if isinstance(decode, str):
            from fastload.loader.images._decode import Decoder

            decode = Decoder(image=decode)  # type: ignore[arg-type]
        if decode is not None and not callable(decode):
            raise InvalidArgumentError(
                "decode must be a callable taking a sample dict, or an image mode for "
                f"fastload.loader.decode.Decoder ('rgb8', 'torch', ...), got {decode!r}"
            )
        transform = self.transform
        if transform is not None and not (callable(transform) or isinstance(transform, Mapping)):
            raise InvalidArgumentError(
                "transform must be a callable or a mapping field name -> callable, got "
                f"{type(transform).__name__}"
            )
        if isinstance(transform, Mapping):
            for name, fn in transform.items():
                if not callable(fn):
                    raise InvalidArgumentError(f"transform[{name!r}] is not callable: {fn!r}")
        if self.filter is not None and not callable(self.filter):
            raise InvalidArgumentError(
                f"filter must be a callable taking a decoded sample, got {self.filter!r}"
            )
        fields = (self.fields,) if isinstance(self.fields, str) else self.fields
        set_ = object.__setattr__
        set_(self, "decoder", decode)
        set_(self, "fields", None if fields is None else tuple(fields))
        set_(self, "select", None if fields is None else ToTuple(*fields))
        if self.max_open_shards is not None:
            set_(
                self,
                "max_open_shards",
                check_int("max_open_shards", self.max_open_shards, minimum=1),
            )
        set_(self, "prefetch_shards", check_int("prefetch_shards", self.prefetch_shards))


@dataclass(frozen=True)
class StoreOptions:
    """Where a dataset's shards are read from: store options and the local cache in front.

    ``store_options`` go to :func:`fastload.open_store` (backend options and its wrappers');
    ``cache_dir``/``cache_size`` put a :class:`~fastload.storage.CachingStore` in front (see
    :func:`~fastload.loader.open_dataset`). ``entry`` names the function they were given to,
    for messages.

    Raises:
        InvalidArgumentError: ``cache_dir`` or ``cache_size`` inside ``store_options``, or a
            ``cache_size`` that is not a size.
    """

    store_options: Mapping[str, Any] | None = None
    cache_dir: str | os.PathLike[str] | None = None
    cache_size: int | str = DEFAULT_CACHE_SIZE
    entry: str = "open_dataset"

    def __post_init__(self) -> None:
        for name in ("cache_dir", "cache_size"):
            if name in (self.store_options or {}):
                raise InvalidArgumentError(
                    f"pass {name} to {self.entry} itself, not in store_options"
                )
        parse_size(self.cache_size, allow_zero=True)  # validates

    def open(self, url: str | os.PathLike[str] | Store, *, cache_local: bool = True) -> Store:
        """The store to read ``url`` through: opened with the store options (a URL), or the
        store itself (refusing store options), with the cache in front when asked for; with
        ``cache_local=False`` not in front of a store whose objects are local files already."""
        if isinstance(url, Store):
            if self.store_options:
                raise InvalidArgumentError(
                    f"store_options apply only when {self.entry} is given a URL, not a store"
                )
            store = url
        else:
            store = open_store(url, **(self.store_options or {}))
        if self.cache_dir is None or (store.has_local_paths and not cache_local):
            return store
        return self.cache(store)

    def cache(self, store: Store) -> Store:
        """``store`` with the cache in front, or ``store`` itself without a ``cache_dir``."""
        if self.cache_dir is None:
            return store
        return wrap_store(store, cache_dir=self.cache_dir, cache_size=self.cache_size)
