"""The fast path of the fused transforms: a JPEG decoded at the smallest DCT scale a crop needs.

The crop box is chosen from the header (:func:`header_size`) before any pixel is decoded, so
:func:`decode_for_box` can let libjpeg-turbo (through simplejpeg) decode at 1/8, 1/4 or 1/2
scale: 4-64x fewer pixels for large crops of large images.
"""

from __future__ import annotations

import math

import numpy as np
import simplejpeg

from fastload.loader._geometry import CropBox
from fastload.loader.decode import is_jpeg

__all__ = ["decode_for_box", "header_size"]


def header_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) from a JPEG header, or None when it is not a JPEG simplejpeg can read."""
    if not is_jpeg(data):
        return None
    try:
        h, w, _, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    return int(h), int(w)


def decode_for_box(
    data: bytes, src_hw: tuple[int, int], box: CropBox, out_hw: tuple[int, int], dct_scaling: bool
) -> tuple[np.ndarray, tuple[float, float, float, float]]:
    """Decode a JPEG at the smallest DCT scale (1/8, 1/4, 1/2, 1) keeping >= ``out_hw`` px across ``box``.

    Returns the decoded HWC uint8 RGB array and the box as a float ``(left, top, right, bottom)``
    in that array's coordinates (what PIL's ``resize(box=...)`` takes).

    Raises:
        ValueError: simplejpeg cannot decode the data (CMYK, 12-bit, arithmetic coding, damage).
    """
    top, left, ch, cw = box
    height, width = src_hw
    min_h = min_w = 0
    if dct_scaling:
        need = max(out_hw[0] / ch, out_hw[1] / cw)  # decoded px per source px
        # Only 1/2, 1/4 and 1/8: libjpeg-turbo has SIMD kernels for those reduced IDCTs; the other
        # M/8 scales run plain C and are slower than a full-size decode (measured on W1).
        factor = 1.0
        while factor > 0.125 and factor / 2 >= need:
            factor /= 2
        if factor < 1.0:
            min_h, min_w = math.ceil(height * factor), math.ceil(width * factor)
    arr = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=min_h, min_width=min_w)
    sy, sx = arr.shape[0] / height, arr.shape[1] / width
    return arr, (left * sx, top * sy, (left + cw) * sx, (top + ch) * sy)
