"""NVIDIA DALI pipelines fed by fastload datasets: decode and augment on a GPU (or the CPU).

::

    from fastload.dali import DALILoader, ImageAugment

    loader = DALILoader("s3://bucket/imagenet-wds", batch_size=256, cache_dir="/nvme/cache",
                        augment=ImageAugment(size=224), store_options={"endpoint_url": ...})
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for images, labels in loader:  # (B, 3, 224, 224) float32 on the GPU, (B,) int64
            ...

Importing this package does not import DALI; building a loader without DALI installed raises
:class:`~fastload.errors.MissingDependencyError` saying ``pip install 'fastload[dali]'``.
See :mod:`fastload.dali._loader` for the guarantees of each reader mode.
"""

from fastload.dali._augment import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    AugmentFn,
    ImageAugment,
    decoder_device,
)
from fastload.dali._backend import dali_available, gpu_available, require_dali
from fastload.dali._loader import DALILoader
from fastload.dali._native import NativePlan

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "AugmentFn",
    "DALILoader",
    "ImageAugment",
    "NativePlan",
    "dali_available",
    "decoder_device",
    "gpu_available",
    "require_dali",
]
