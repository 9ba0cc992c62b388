"""fastload: fast, exactly-once, resumable data loading for deep-learning training.

The public surface:

* :func:`open_store` — bytes under keys on local disk, S3/Ceph RGW, HDFS, ... (:mod:`fastload.storage`)
* :func:`convert` — raw corpora into WebDataset, TFRecord or LMDB shards (:mod:`fastload.convert`)
* :func:`open_dataset` and :class:`DataLoader` — exactly-once, resumable PyTorch loading
  (:mod:`fastload.loader`); :func:`mix` mixes datasets by weight
* :func:`open_tokens` and :class:`TokenLoader` — packed token sequences for LLM pretraining
* :mod:`fastload.dali` — NVIDIA DALI pipelines fed by fastload datasets
* :mod:`fastload.errors` — the exception hierarchy

Heavy dependencies (torch, DALI, boto3, pyarrow) are imported on first use, so ``import fastload`` and the
``fastload`` command start quickly.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fastload import errors
from fastload._version import __version__

# Imported eagerly: ``fastload.convert`` must be the function even after the subpackage of the
# same name has been imported (importing a subpackage first sets the parent's attribute to it).
from fastload.convert import convert
from fastload.storage import open_store

if TYPE_CHECKING:
    from fastload import dali
    from fastload.loader import DataLoader, TokenLoader, mix, open_dataset, open_tokens, to_tuple

__all__ = [
    "DataLoader",
    "TokenLoader",
    "__version__",
    "convert",
    "dali",
    "errors",
    "mix",
    "open_dataset",
    "open_store",
    "open_tokens",
    "to_tuple",
]

_LAZY = {
    "open_dataset": ("fastload.loader", "open_dataset"),
    "DataLoader": ("fastload.loader", "DataLoader"),
    "to_tuple": ("fastload.loader", "to_tuple"),
    "mix": ("fastload.loader", "mix"),
    "open_tokens": ("fastload.loader", "open_tokens"),
    "TokenLoader": ("fastload.loader", "TokenLoader"),
    "dali": ("fastload.dali", None),
}


def __getattr__(name: str) -> Any:
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'fastload' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
