"""Image transforms for training and evaluation, without torchvision, deterministic and resumable.

Two ways to build an image pipeline:

* **Fused (fast)**: :class:`ImageTrainTransform` and :class:`ImageEvalTransform` take the *encoded
  JPEG bytes* (use ``Decoder(image="bytes")``). They read the image size from the JPEG header,
  choose the crop, and let libjpeg-turbo decode at the smallest DCT scale (1/8, 1/4, 1/2 or 1 —
  the scales its SIMD code accelerates; 3/8..7/8 are slower than a full decode) that still gives
  at least 2 decoded pixels per output pixel across the crop, so large crops of large images
  decode 4-64x fewer pixels, and the output stays within >= 40 dB mean, >= 35 dB minimum PSNR of
  Pillow's bilinear resize of the full decode (see ``_jpeg``). At full scale the crop is a view
  of the decoded buffer, resized by torch's uint8 antialiased-bilinear kernel (the same filter as
  Pillow's, 3-4x faster, and it writes CHW directly); at a reduced scale the crop box falls on
  fractional pixels, which Pillow's kernel resamples exactly. Output is ``uint8`` CHW by default
  (150 KB per 224² sample instead of 600 KB of float32), so moving samples between worker
  processes is cheap; normalization to float runs later on the whole batch
  (``normalize_on="batch"``), in the main process or on the GPU.
* **Composable**: :class:`RandomResizedCrop`, :class:`RandomHorizontalFlip`, :class:`CenterCrop`,
  :class:`Resize` work on decoded ``(H, W, C)`` ``uint8`` arrays (``Decoder(image="rgb8")``);
  :class:`Normalize` turns ``(H, W, C)``/``(C, H, W)`` images or ``(N, C, H, W)`` batches into
  normalized float32 CHW tensors. :class:`Compose` chains them sharing one random generator.

Randomness protocol (for the loader and for users)
---------------------------------------------------
Every random transform's ``__call__`` takes ``(x, rng=None)``:

* ``x`` is an image, or a **sample dict**. For a sample dict the transform is applied to every
  image field (extensions in :data:`~fastload.loader.decode.DECODED_IMAGE_EXTENSIONS`, or only the field
  named by ``field=``), other entries are copied, and a new dict is returned.
* The random generator is, in order of precedence: the ``rng`` argument; for a sample dict,
  :func:`sample_rng` of ``sample["__rng_seed__"]``; otherwise a generator seeded from NumPy's
  global generator (reproducible where the worker seeds it, as fastload's loader does per batch,
  but then the draws depend on the batch a sample falls into).

The loader makes augmentation deterministic and resumable by putting ``"__rng_seed__": (seed,
epoch, index)`` into every raw sample before ``decode``/``transform`` run, where ``index`` is the
sample's global index in the dataset (its position in the dataset's un-shuffled order). The draws
then depend only on (seed, epoch, sample), not on the worker, rank, world size, batch size or on
where training was resumed. ``sample_rng`` builds ``numpy.random.default_rng`` from a
``SeedSequence`` over the three integers, so nearby seeds give independent streams. A user
transform that wants the same guarantee calls ``sample_rng(*sample["__rng_seed__"])``.

Transforms hold only their options: they pickle (spawn/forkserver workers) and are thread-safe.

Where the parts live: crop boxes in ``_geometry``, the reduced-DCT JPEG decode in ``_jpeg``,
the resize kernels in ``_pixels``, the per-sample generators in ``_sample_rng``, the sample-dict
dispatch in ``_image_fields``, :class:`Normalize` in ``_normalize`` and the other transform
classes in ``_image_transforms``; this module is their public face.
"""

from fastload.loader.images._geometry import CropBox, center_crop_box, random_resized_crop_box
from fastload.loader.images._normalize import IMAGENET_MEAN, IMAGENET_STD, Normalize
from fastload.loader.images._pixels import Interpolation
from fastload.loader.images._transforms import (
    CenterCrop,
    Compose,
    ImageEvalTransform,
    ImageTrainTransform,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
)
from fastload.loader.order._sample_rng import RNG_SEED_KEY, rng_for, sample_rng

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "RNG_SEED_KEY",
    "CenterCrop",
    "Compose",
    "CropBox",
    "ImageEvalTransform",
    "ImageTrainTransform",
    "Interpolation",
    "Normalize",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "Resize",
    "center_crop_box",
    "random_resized_crop_box",
    "rng_for",
    "sample_rng",
]
