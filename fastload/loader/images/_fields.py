"""Applying an image transform to a sample dict: which fields are images, and the dispatch.

A transform called on a sample dict transforms every image field (by extension,
:data:`~fastload.loader.decode.DECODED_IMAGE_EXTENSIONS`) or only the one named by ``field=``, copies the
other entries, and returns a new dict (see :mod:`fastload.loader.transforms`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import numpy as np

from fastload.errors import CorruptDataError
from fastload.loader.images._decode import DECODED_IMAGE_EXTENSIONS
from fastload.loader.order._sample_rng import rng_for

__all__ = ["ImageFieldTransform", "is_image_field"]


def is_image_field(name: str) -> bool:
    """True for a sample entry holding an image: not metadata (``__key__``), and an image
    extension after the last dot (``"jpg"``, ``"x.PNG"``)."""
    return not name.startswith("__") and name.rsplit(".", 1)[-1].lower() in DECODED_IMAGE_EXTENSIONS


class ImageFieldTransform(ABC):
    """Base of the image transforms: dispatch a sample dict to its image fields; subclasses
    implement :meth:`apply` and may set ``field``."""

    #: With sample dicts, the one field to transform (``None``: every image field).
    field: str | None = None

    @abstractmethod
    def apply(self, image: Any, rng: np.random.Generator) -> Any:
        """Transform one image, drawing from ``rng``."""

    def __call__(self, x: Any, rng: np.random.Generator | None = None) -> Any:
        """Transform an image, or every image field of a sample dict (see the module docstring).

        Raises:
            CorruptDataError: An encoded image cannot be decoded (the message names the sample's
                ``__url__`` and ``__key__`` when ``x`` is a sample).
        """
        generator = rng_for(x, rng)
        if not isinstance(x, Mapping):
            return self.apply(x, generator)
        url = str(x.get("__url__", ""))
        key = x.get("__key__")
        out = dict(x)
        for name, value in x.items():
            if name.startswith("__"):
                continue
            if self.field is not None:
                if name != self.field:
                    continue
            elif not is_image_field(name):
                continue
            try:
                out[name] = self.apply(value, generator)
            except CorruptDataError as exc:
                raise CorruptDataError(
                    f"field {name!r}: {exc}", url=url, key=None if key is None else str(key)
                ) from exc
        return out
