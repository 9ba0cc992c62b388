"""Loading: PyTorch datasets and a DataLoader that are exactly-once, deterministic and resumable.

* :func:`open_dataset` opens a dataset by its manifest and returns a map-style
  :class:`Dataset` (``ds[i]`` in dataset order); :class:`BatchStream` over it is the iterable
  form (whole collated batches per rank) for a plain ``torch.utils.data.DataLoader``.
* :func:`mix` mixes datasets (or token sources) by weight, exactly in every window of a stated
  size, resumably and elastically.
* :func:`open_tokens` opens a token dataset as packed ``seq_len + 1`` sequences
  (:class:`TokenDataset`, a :class:`TokenSource`); :class:`TokenLoader` batches any token source
  in the main process (exactly once over tokens, O(1) elastic resume).
* :class:`DataLoader` takes PyTorch's DataLoader arguments and adds ``set_epoch``,
  ``state_dict``/``load_state_dict`` (elastic: another number of workers or ranks, same global
  batch) and ``stats``.

The order of an epoch is a pure function of (seed, epoch) (:class:`EpochOrder`); how it is split
into global steps, rank batches and worker tasks is pure arithmetic (:class:`Partition`).
"""

from fastload.loader._batch_meta import BatchMeta
from fastload.loader._collate import default_collate
from fastload.loader._dataset import Dataset
from fastload.loader._dist import Launch, detect_launch, detect_rank_world
from fastload.loader._loader import DataLoader
from fastload.loader._open import open_dataset
from fastload.loader._options import ReadOptions, StoreOptions
from fastload.loader._packed import PackedBytes, pack_bytes
from fastload.loader._select import ToTuple, to_tuple
from fastload.loader._shards import sample_nbytes
from fastload.loader._stats_log import StatsLog, log_stats
from fastload.loader._stream import BatchStream
from fastload.loader.images._normalize import IMAGENET_MEAN, IMAGENET_STD
from fastload.loader.mix._open import mix
from fastload.loader.mix._samples import MixedDataset
from fastload.loader.mix._schedule import MixRoundingWarning
from fastload.loader.mix._tokens import MixedTokens
from fastload.loader.order._cursor import STATE_VERSION, EpochCursor, Resumable
from fastload.loader.order._order import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_WINDOW,
    EpochOrder,
    OrderOptions,
)
from fastload.loader.order._partition import Partition
from fastload.loader.order._quality import OrderQuality, order_quality
from fastload.loader.order._seeds import check_seed, pipeline_seed
from fastload.loader.tokens._dataset import TokenDataset, open_tokens
from fastload.loader.tokens._loader import TokenLoader
from fastload.loader.tokens._source import TokenBatch, TokenSource, WideningTokenSource

__all__ = [
    "EpochCursor",
    "check_seed",
    "pipeline_seed",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "sample_nbytes",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_WINDOW",
    "STATE_VERSION",
    "BatchMeta",
    "BatchStream",
    "DataLoader",
    "Dataset",
    "EpochOrder",
    "OrderOptions",
    "OrderQuality",
    "ReadOptions",
    "Resumable",
    "StatsLog",
    "StoreOptions",
    "Launch",
    "MixRoundingWarning",
    "MixedDataset",
    "MixedTokens",
    "PackedBytes",
    "Partition",
    "ToTuple",
    "TokenBatch",
    "TokenDataset",
    "TokenLoader",
    "TokenSource",
    "WideningTokenSource",
    "default_collate",
    "detect_launch",
    "detect_rank_world",
    "mix",
    "open_dataset",
    "log_stats",
    "open_tokens",
    "order_quality",
    "pack_bytes",
    "to_tuple",
]
