"""The fast path of the fused transforms: a JPEG decoded at the smallest DCT scale a crop allows.

The crop box is chosen from the header (:func:`header_size`) before any pixel is decoded, so
:func:`decode_for_box` can let libjpeg-turbo (through simplejpeg) decode at 1/8, 1/4 or 1/2
scale: 4-64x fewer pixels for large crops of large images.

Quality: the result must stay close to Pillow's bilinear resize of the same box of the full
decode (issue 15's goal: >= 40 dB mean and >= 35 dB minimum PSNR at every scale). Two things
decide that. The box keeps its fractional coordinates in the reduced image (rounding it to whole
reduced pixels shifts the output by up to half a reduced pixel), and a reduced scale is used only
when the reduced box keeps :data:`MIN_DECODED_PER_OUTPUT` decoded pixels per output pixel, so
that the final antialiased resize, not the DCT reduction, sets the output's frequency content.
Measured on the generated corpus (600 random-resized-crop boxes per scale, output sizes spread
over each scale's whole range): with a factor of 1 (the old rule) and whole-pixel boxes the
scales gave 35.5-38.2 dB mean and 23.9 dB minimum; fractional boxes with a factor of 2 give
48.8-49.7 dB mean and 38.2 dB minimum (1.5 gives 37.4 dB minimum, too close to the goal).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import simplejpeg

from fastload.loader.images._decode import is_jpeg
from fastload.loader.images._geometry import CropBox

__all__ = [
    "DCT_SCALES",
    "MIN_DECODED_PER_OUTPUT",
    "ROI_EDGE",
    "decode_at_scale",
    "decode_for_box",
    "decode_region_for_box",
    "dct_scale",
    "header_size",
    "region_decoder_available",
]

#: The DCT scales :func:`dct_scale` chooses from, largest first. Only 1/2, 1/4 and 1/8:
#: libjpeg-turbo has SIMD kernels for those reduced IDCTs; the other M/8 scales run plain C and
#: are slower than a full-size decode (measured on W1).
DCT_SCALES = (1.0, 0.5, 0.25, 0.125)

#: Decoded pixels per output pixel (on both axes) that a reduced DCT scale must keep across the
#: crop box; see the module docstring for the measurement that set it.
MIN_DECODED_PER_OUTPUT = 2.0


def header_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) from a JPEG header, or None when it is not a JPEG simplejpeg can read."""
    if not is_jpeg(data):
        return None
    try:
        h, w, _, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    return int(h), int(w)


def dct_scale(box: CropBox, out_hw: tuple[int, int]) -> float:
    """The smallest of :data:`DCT_SCALES` that keeps >= :data:`MIN_DECODED_PER_OUTPUT` decoded
    pixels per output pixel across ``box`` (a ``(top, left, height, width)`` source box) when it
    is resized to ``out_hw`` ``(height, width)``; 1.0 when no reduced scale does."""
    _, _, ch, cw = box
    need = MIN_DECODED_PER_OUTPUT * max(out_hw[0] / ch, out_hw[1] / cw)  # decoded per source px
    factor = 1.0
    for scale in DCT_SCALES[1:]:
        if scale < need:
            break
        factor = scale
    return factor


def decode_at_scale(
    data: bytes, src_hw: tuple[int, int], box: CropBox, factor: float
) -> tuple[np.ndarray, tuple[float, float, float, float]]:
    """Decode a JPEG at DCT scale ``factor`` (one of :data:`DCT_SCALES`) and map ``box`` onto it.

    Returns the decoded HWC uint8 RGB array (``ceil(side * factor)`` pixels a side) and the box as
    a float ``(left, top, right, bottom)`` in that array's coordinates (what PIL's
    ``resize(box=...)`` takes): source coordinates times ``factor``, fractional where the box
    does not fall on whole reduced pixels. At ``factor`` 1 the box is the source box, whole.

    Raises:
        ValueError: simplejpeg cannot decode the data (CMYK, 12-bit, arithmetic coding, damage).
    """
    top, left, ch, cw = box
    height, width = src_hw
    min_h = min_w = 0
    if factor < 1.0:
        min_h, min_w = math.ceil(height * factor), math.ceil(width * factor)
    arr = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=min_h, min_width=min_w)
    if arr.shape[:2] == (height, width):
        factor = 1.0  # a tiny image simplejpeg could not reduce
    elif arr.shape[:2] != (min_h, min_w):  # not expected from libjpeg-turbo; map by the sizes
        sy, sx = arr.shape[0] / height, arr.shape[1] / width
        return arr, (left * sx, top * sy, (left + cw) * sx, (top + ch) * sy)
    # A reduced pixel i covers source pixels [i / factor, (i + 1) / factor): plain scaling maps
    # the box (a ratio of the rounded-up sizes would stretch it towards the bottom-right).
    return arr, (left * factor, top * factor, (left + cw) * factor, (top + ch) * factor)


#: Rows and columns decoded around a region beyond what the resize reads: libjpeg-turbo's
#: cropped decode leaves the outermost pixel of a region unlike a whole decode's (its fancy
#: upsampling lacks the neighbours there); measured, 1 was enough on 1,000 corpus images.
ROI_EDGE = 2


def region_decoder_available() -> bool:
    """Whether the native region decoder (``fastload.loader.images._jpegroi``, built by setup.py
    against libjpeg-turbo) is importable here; without it whole images are decoded."""
    return _decode_region is not None


def decode_region_for_box(
    data: bytes,
    src_hw: tuple[int, int],
    box: CropBox,
    factor: float,
    context: int,
) -> tuple[np.ndarray, tuple[float, float, float, float]]:
    """Decode, at DCT scale ``factor``, only the part of a JPEG around ``box`` that a resize
    reads: the box (mapped onto the scaled image) plus ``context`` pixels on every side, plus
    :data:`ROI_EDGE`, clipped to the image. Rows below it are never decoded, rows above it only
    entropy-decoded, columns outside it not transformed. The pixels equal a whole decode's at
    the same scale (tested); the box comes back in the region's coordinates (what
    :func:`decode_at_scale` returns for the whole image). Any libjpeg warning (damaged data) is
    an error here; damage in rows below the region is not seen.

    Raises:
        ValueError: The data cannot be decoded this way (damage, CMYK, an unsupported coding);
            the caller decodes the whole image instead, which raises if the data is bad.
    """
    assert _decode_region is not None
    top, left, ch, cw = box
    height, width = src_hw
    denom = round(1.0 / factor)
    sh, sw = -(-height // denom), -(-width // denom)  # libjpeg's scaled size: ceil(side / d)
    f = 1.0 / denom
    t, lft, b, r = top * f, left * f, (top + ch) * f, (left + cw) * f
    pad = context + ROI_EDGE
    y0, x0 = max(0, math.floor(t) - pad), max(0, math.floor(lft) - pad)
    y1, x1 = min(sh, math.ceil(b) + pad), min(sw, math.ceil(r) + pad)
    raw = _decode_region(data, denom, y0, x0, y1 - y0, x1 - x0)
    arr = np.frombuffer(raw, dtype=np.uint8).reshape(y1 - y0, x1 - x0, 3)
    return arr, (lft - x0, t - y0, r - x0, b - y0)


def decode_for_box(
    data: bytes,
    src_hw: tuple[int, int],
    box: CropBox,
    out_hw: tuple[int, int],
    dct_scaling: bool,
    *,
    whole_box_inside: bool = False,
) -> tuple[np.ndarray, tuple[float, float, float, float]]:
    """Decode a JPEG for cropping ``box`` to ``out_hw``: at :func:`dct_scale` when
    ``dct_scaling``, else at full size. Returns the decoded pixels (the region the resize
    reads when the native region decoder is built, else the whole image) and the box in their
    coordinates, as :func:`decode_at_scale` does.

    ``whole_box_inside``: the caller resizes a box on whole pixels reading only pixels inside
    it (torch's kernel); otherwise (Pillow's, or a fractional box) the filter's support around
    the box is decoded too, so the output is the same either way.

    Raises:
        ValueError: simplejpeg cannot decode the data (CMYK, 12-bit, arithmetic coding, damage).
    """
    factor = dct_scale(box, out_hw) if dct_scaling else 1.0
    # Only data that ends with the EOI marker: a truncated file (the usual damage) is then
    # decoded whole, which reports it, although the rows a crop needs may all be there.
    if _decode_region is not None and data[-2:] == b"\xff\xd9":
        if factor == 1.0 and whole_box_inside:
            context = 0
        else:  # Pillow's widest kernel (Lanczos) reads 3 source pixels per output pixel each side
            shrink = max(box[2] * factor / out_hw[0], box[3] * factor / out_hw[1], 1.0)
            context = math.ceil(3 * shrink) + 1
        try:
            return decode_region_for_box(data, src_hw, box, factor, context)
        except ValueError:
            pass  # decoded whole below: it raises for bad data, and copes with CMYK & co.
    return decode_at_scale(data, src_hw, box, factor)


_decode_region: Callable[[bytes, int, int, int, int, int], bytearray] | None
try:
    from fastload.loader.images._jpegroi import decode_region as _decode_region
except ImportError:  # not built (no compiler or libjpeg headers at install): whole decodes
    _decode_region = None
