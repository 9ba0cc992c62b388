"""The companion commands of ``convert``: inspect, verify and index a dataset.

* :func:`inspect_dataset` (:mod:`._inspect`) summarises a dataset (manifest, schema, shards, the
  first samples); :func:`write_inspect_json` writes that summary as JSON, streamed.
* :func:`verify_dataset` (:mod:`._verify`) recomputes every shard's checksum, size, sample count
  and index and reports **every** problem, precisely.
* :func:`index_dataset` (:mod:`._index`) builds or rebuilds the DALI-compatible ``<shard>.idx``
  files, and writes a manifest for a directory of third-party shards (WebDataset tars,
  TFRecords, LMDB files).
"""

from fastload.convert.tools._index import IndexResult, index_dataset
from fastload.convert.tools._inspect import inspect_dataset, write_inspect_json
from fastload.convert.tools._verify import VerifyReport, verify_dataset

__all__ = [
    "IndexResult",
    "VerifyReport",
    "index_dataset",
    "inspect_dataset",
    "verify_dataset",
    "write_inspect_json",
]
