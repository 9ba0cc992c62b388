"""Decoding samples by field extension: images to arrays, labels to ints, JSON, NumPy, text.

:class:`Decoder` is the callable the loader applies to every raw sample
(``{"__key__": str, "__url__": str, field: bytes}``); it returns a new dict with each field decoded by
its extension (the part after the last dot, lower case) and metadata entries copied unchanged:

============================  ==========================================================
extension                     value
============================  ==========================================================
``jpg`` ``jpeg``              image, see ``image=`` (JPEG via simplejpeg/libjpeg-turbo)
``png`` ``webp`` ``bmp`` ...  image, see ``image=`` (via Pillow)
``cls`` ``cls2`` ``label``    ``int``
``json``                      the parsed JSON value
``npy``                       ``numpy.ndarray`` (``allow_pickle=False`` always)
``txt`` ``text``              ``str`` (UTF-8)
``mp`` ``msgpack``            the unpacked msgpack value
``ten`` ``tb``                list of arrays (webdataset's ``tenbin`` layout)
``msg``                       the unpacked msgpack value (msgpack's defaults, as webdataset)
``npz``                       ``dict`` name -> ``numpy.ndarray`` (object arrays refused)
``cbor``                      the CBOR value (needs the ``cbor`` package)
``jsn`` / ``inx``             JSON value / ``int`` (webdataset's spellings)
``pyd`` ``pickle`` ``pkl``    refused with :class:`~fastload.errors.UnsafeDataError` unless
``pth``                       ``allow_pickle=True`` (``pth`` is ``torch.load``, a pickle)
``<name>.gz``                 gunzipped, then decoded as ``<name>`` (``json.gz``)
anything else                 ``bytes`` as stored
============================  ==========================================================

The extensions of the ``webdataset`` ecosystem (``ten``, ``tb``, ``msg``, ``npz``, ``cbor``,
``jsn``, ``inx``, ``pkl``, ``pth`` and ``.gz`` fields) are decoded by fastload's own decoders
(:mod:`fastload.loader.images._wds_codecs`, which also specifies the tenbin layout) to the values
``webdataset.autodecode``'s decoders give for the same bytes, so a sample decodes to what
``wds.WebDataset(...).decode()`` gives (tested against the library); ``webdataset`` itself is not
needed. Pickles stay refused unless ``allow_pickle``.

Image modes (``image=``):

* ``"rgb8"`` (default): ``numpy.ndarray`` of shape ``(H, W, 3)``, ``uint8``, RGB.
* ``"l8"``: ``(H, W, 1)`` ``uint8`` luminance.
* ``"torch"``: ``torch.Tensor`` of shape ``(3, H, W)``, ``uint8``, RGB (a view of the HWC array;
  ``torch.stack`` in collation makes it contiguous).
* ``"pil"``: a loaded ``PIL.Image.Image`` in mode ``RGB``.
* ``"bytes"``: not decoded.
* a **fused transform** such as :class:`~fastload.loader.transforms.ImageTrainTransform` (any
  callable ``(data: bytes, rng: numpy.random.Generator) -> value``): image fields are decoded and
  augmented in one step, decoding only the resolution the crop needs. The generator comes from the
  sample's ``__rng_seed__`` (see :mod:`fastload.loader.transforms`). Because this runs as part of
  decoding, a corrupt image follows the loader's ``on_error`` policy (``skip`` drops and counts
  it), which it would not as a ``transform=``.

JPEG decoder choice, measured on the W1 corpus (500x375 photo-like JPEGs, quality 90, one core of
a shared 2-vCPU EPYC, ``python -m benchmarks.bench_loader --transforms`` and the full run):
simplejpeg decodes 1.3x as many images per second as Pillow (both use libjpeg-turbo; simplejpeg
skips Pillow's tile machinery and writes straight into a NumPy array) and installs as a
self-contained wheel everywhere. PyTurboJPEG needs the system ``libturbojpeg`` library, so it is
not used. JPEGs simplejpeg cannot decode (CMYK, 12-bit, arithmetic coding) fall back to Pillow.

Errors: a field that cannot be decoded raises :class:`~fastload.errors.CorruptDataError` naming
the sample's ``__url__`` (its shard) and ``__key__`` and the field; the loader's ``on_error``
policy decides whether that stops training or skips the sample.

Decoders pickle (they hold only their options), so they work with ``spawn`` and ``forkserver``
DataLoader workers. They hold no mutable state but a small cache of what each distinct set of
field names needs, and are safe to call from several threads.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np
import simplejpeg
from PIL import Image

from fastload.errors import (
    CorruptDataError,
    FormatError,
    InvalidArgumentError,
    MissingDependencyError,
    UnsafeDataError,
)
from fastload.formats import Sample, decode_sample
from fastload.formats.manifest import IMAGE_EXTENSIONS
from fastload.loader.images._wds_codecs import WDS_DECODERS, decode_pickle, decode_pth, gunzip
from fastload.loader.order._sample_rng import rng_for

__all__ = [
    "DECODED_IMAGE_EXTENSIONS",
    "IMAGE_EXTENSIONS",
    "IMAGE_MODES",
    "JPEG_EXTENSIONS",
    "PICKLE_EXTENSIONS",
    "UNDECODED_IMAGE_EXTENSIONS",
    "WEBDATASET_EXTENSIONS",
    "Decoder",
    "ImageMode",
    "decode_image",
    "is_jpeg",
]

ImageMode = Literal["rgb8", "l8", "torch", "pil", "bytes"]
#: The accepted values of ``image=``.
IMAGE_MODES: tuple[str, ...] = ("rgb8", "l8", "torch", "pil", "bytes")
#: Extensions decoded with the JPEG decoder (anything that is JPEG by its magic bytes also is).
JPEG_EXTENSIONS: frozenset[str] = frozenset({"jpg", "jpeg", "jpe", "jfif"})
#: Image extensions whose fields stay bytes: Pillow has no JPEG XL decoder, and AVIF only in
#: some builds, so decoding them would fail where the bytes are still useful.
UNDECODED_IMAGE_EXTENSIONS: frozenset[str] = frozenset({"jxl", "avif"})
#: Extensions decoded as images: :data:`~fastload.formats.manifest.IMAGE_EXTENSIONS` (the one
#: list of image extensions) but for :data:`UNDECODED_IMAGE_EXTENSIONS`.
DECODED_IMAGE_EXTENSIONS: frozenset[str] = IMAGE_EXTENSIONS - UNDECODED_IMAGE_EXTENSIONS

#: The webdataset ecosystem's extensions that fastload's sample codecs do not cover, decoded to
#: what ``webdataset.autodecode``'s decoders give (``npy``, ``mp``, ``json``, ``cls``, ``txt`` ...
#: decode the same way either way).
WEBDATASET_EXTENSIONS: frozenset[str] = frozenset(WDS_DECODERS)
#: Extensions whose decoding unpickles (runs code): refused unless ``allow_pickle=True``.
PICKLE_EXTENSIONS: frozenset[str] = frozenset({"pyd", "pickle", "pkl", "pth"})

_JPEG_MAGIC = b"\xff\xd8\xff"


def is_jpeg(data: bytes) -> bool:
    """True when ``data`` starts with the JPEG SOI marker (``FF D8 FF``)."""
    return data[:3] == _JPEG_MAGIC


def _pil_open(data: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    img.load()  # raises on truncated or damaged data (LOAD_TRUNCATED_IMAGES stays False)
    return img


def _to_rgb_array(img: Image.Image, gray: bool) -> np.ndarray:
    want = "L" if gray else "RGB"
    if img.mode != want:
        img = img.convert(want)
    arr = np.array(img)  # writable; np.asarray of a PIL image is read-only
    return arr[:, :, None] if gray else arr


def decode_image(data: bytes, mode: ImageMode = "rgb8") -> Any:
    """Decode encoded image bytes (JPEG, PNG, WebP, ... anything Pillow reads).

    Args:
        data: The encoded image.
        mode: See the module docstring: ``rgb8`` (HWC uint8 RGB array), ``l8`` (HW1 uint8),
            ``torch`` (CHW uint8 tensor), ``pil`` (RGB PIL image) or ``bytes`` (returned as is).

    Returns:
        The decoded image in the requested form. Arrays are writable and own their memory.

    Raises:
        ValueError, OSError: The bytes are not a decodable image (wrapped into
            :class:`~fastload.errors.CorruptDataError` with the sample's URL and key by
            :class:`Decoder`).
    """
    if mode == "bytes":
        return data
    if mode == "pil":
        img = _pil_open(data)
        return img if img.mode == "RGB" else img.convert("RGB")
    gray = mode == "l8"
    arr: np.ndarray
    if is_jpeg(data):
        try:
            arr = simplejpeg.decode_jpeg(data, colorspace="GRAY" if gray else "RGB")
        except ValueError:
            # CMYK/YCCK, 12-bit or arithmetic-coded JPEGs: Pillow handles (or rejects) them.
            arr = _to_rgb_array(_pil_open(data), gray)
    else:
        arr = _to_rgb_array(_pil_open(data), gray)
    if mode == "torch":
        import torch

        return torch.from_numpy(arr).permute(2, 0, 1)
    return arr


@functools.cache
def _has_cbor() -> bool:
    try:
        import cbor  # noqa: F401
    except ImportError:
        return False
    return True


def _refuse_pickle(ext: str, data: bytes) -> Any:
    raise UnsafeDataError(
        f"field extension {ext!r} is a pickle{' (torch.load)' if ext == 'pth' else ''}, and "
        "unpickling data from a shard can run arbitrary code; pass allow_pickle=True to "
        "Decoder only if you trust the data's origin"
    )


#: A fused decode+augment callable: ``(encoded bytes, generator) -> value``.
ImageFn = Callable[[bytes, np.random.Generator], Any]


def _call_with_rng(fn: ImageFn, rng: np.random.Generator, data: bytes) -> Any:
    try:
        return fn(data, rng)
    except FormatError as exc:
        # decode_sample passes FormatErrors through as they are; a ValueError gets the sample's
        # URL, key and field name added.
        raise ValueError(str(exc)) from exc


class Decoder:
    """Decodes a raw sample's fields by extension; the ``decode=`` callable of the loader.

    Args:
        image: How image fields are returned: ``"rgb8"`` (default), ``"l8"``, ``"torch"``,
            ``"pil"``, ``"bytes"`` (leave encoded), or a fused transform such as
            :class:`~fastload.loader.transforms.ImageTrainTransform` (see the module docstring).
        allow_pickle: Permit ``pyd``/``pickle``/``pkl``/``pth`` fields, which run code when
            decoded. Only for data whose origin you trust. ``npy``/``npz`` fields never unpickle.
        extra: Further decoders by extension (``{"seg": my_fn}``; ``bytes`` → value); they take
            precedence over the built-in ones. Must be picklable (module-level functions) when
            used with spawn/forkserver workers.

    Calling a decoder returns a new dict; the input sample is not modified. Thread-safe.
    Fields ending in ``.gz`` are decompressed and decoded by the rest of their name; they keep
    their name (``json.gz`` holds the parsed JSON), as in webdataset.

    Raises:
        InvalidArgumentError: ``image`` is not one of :data:`IMAGE_MODES`.
    """

    def __init__(
        self,
        image: ImageMode | ImageFn = "rgb8",
        *,
        allow_pickle: bool = False,
        extra: Mapping[str, Callable[[bytes], Any]] | None = None,
    ) -> None:
        if not callable(image) and image not in IMAGE_MODES:
            raise InvalidArgumentError(
                f"Decoder(image={image!r}): image must be one of {', '.join(IMAGE_MODES)} or a "
                "callable (bytes, numpy Generator) -> value such as ImageTrainTransform()"
            )
        self.image: ImageMode | ImageFn = image
        self.allow_pickle = allow_pickle
        self.extra: dict[str, Callable[[bytes], Any]] = {
            k.lower().lstrip("."): v for k, v in (extra or {}).items()
        }
        self._fields = self._build_fields()
        self._gz_fields: dict[tuple[str, ...], tuple[str, ...]] = {}

    def _build_fields(self) -> dict[str, Callable[[bytes], Any]]:
        fields: dict[str, Callable[[bytes], Any]] = dict(WDS_DECODERS)
        # pyd and pickle are fastload codecs (refused the same way)
        for ext, decode in (("pkl", decode_pickle), ("pth", decode_pth)):
            fields[ext] = decode if self.allow_pickle else functools.partial(_refuse_pickle, ext)
        if isinstance(self.image, str) and self.image != "bytes":
            image_fn = functools.partial(decode_image, mode=self.image)
            fields.update(dict.fromkeys(DECODED_IMAGE_EXTENSIONS, image_fn))
        fields.update(self.extra)
        return fields

    def _check_fields(self, keys: tuple[str, ...]) -> tuple[str, ...]:
        """The ``.gz`` fields among a sample's ``keys`` (remembered per distinct key tuple: a
        dataset has few); raises if a field needs a package that is missing."""
        if (
            not _has_cbor()
            and "cbor" not in self.extra
            and any(k.rsplit(".", 1)[-1].lower() == "cbor" for k in keys if k[:2] != "__")
        ):
            raise MissingDependencyError(
                "decoding .cbor fields needs the 'cbor' package (the CBOR decoder webdataset "
                "uses too): pip install cbor (or pass extra={'cbor': bytes} to keep the bytes)"
            )
        gz = tuple(k for k in keys if k.endswith(".gz") and not k.startswith("__"))
        if len(self._gz_fields) < 256:
            self._gz_fields[keys] = gz
        return gz

    def _decode_gz(self, sample: Mapping[str, Any], names: list[str]) -> Sample:
        """Decode ``sample`` whose fields ``names`` end in ``.gz``: each is gunzipped and decoded
        by the rest of its name, under its own name (as webdataset's ``gzfilter`` does)."""
        rest = {k: v for k, v in sample.items() if k not in names}
        out = self(rest)
        meta = {k: v for k, v in sample.items() if k.startswith("__")}
        for name in names:
            try:
                inner = gunzip(bytes(sample[name]))
            except Exception as exc:
                raise CorruptDataError(
                    f"field {name!r} is not valid gzip ({type(exc).__name__}: {exc})",
                    url=str(sample.get("__url__", "")),
                    key=sample.get("__key__"),
                ) from exc
            inner_name = name[: -len(".gz")]  # "json.gz" -> "json"
            out[name] = self({**meta, inner_name: inner})[inner_name]
        return {k: out[k] for k in sample}  # in the sample's order, as webdataset's

    def __call__(self, sample: Mapping[str, Any]) -> Sample:
        """Decode ``sample`` (fields as bytes, metadata such as ``__key__`` copied as is).

        Raises:
            CorruptDataError: A field's bytes are not valid for its extension; the message names
                the shard URL (``__url__``), the sample key and the field.
            UnsafeDataError: A pickle field and ``allow_pickle`` is False.
        """
        keys = tuple(sample)
        gz = self._gz_fields.get(keys)
        if gz is None:
            gz = self._check_fields(keys)
        if gz:
            return self._decode_gz(sample, list(gz))
        fields = self._fields
        if callable(self.image):
            fused = functools.partial(_call_with_rng, self.image, rng_for(sample))
            fields = {
                **self._fields,
                **dict.fromkeys(DECODED_IMAGE_EXTENSIONS, fused),
                **self.extra,
            }
        try:
            return decode_sample(sample, allow_pickle=self.allow_pickle, fields=fields)
        except UnsafeDataError as exc:
            if exc.url or exc.key is not None:
                raise
            raise UnsafeDataError(
                str(exc), url=str(sample.get("__url__", "")), key=sample.get("__key__")
            ) from None

    def __getstate__(self) -> dict[str, Any]:
        return {"image": self.image, "allow_pickle": self.allow_pickle, "extra": self.extra}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.image = state["image"]
        self.allow_pickle = state["allow_pickle"]
        self.extra = state["extra"]
        self._fields = self._build_fields()
        self._gz_fields = {}

    def __repr__(self) -> str:
        extra = f", extra={sorted(self.extra)}" if self.extra else ""
        return f"Decoder(image={self.image!r}, allow_pickle={self.allow_pickle}{extra})"
