"""Decoding by field extension (fastload.loader.decode)."""

from __future__ import annotations

import io
import json
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from fastload.errors import CorruptDataError, InvalidArgumentError, UnsafeDataError
from fastload.loader.decode import Decoder, decode_image


def _gradient(h: int = 48, w: int = 64) -> np.ndarray:
    yy, xx = np.mgrid[0:h, 0:w]
    return np.stack([xx * 255 // w, yy * 255 // h, (xx + yy) * 255 // (h + w)], -1).astype(np.uint8)


def _encode(arr: np.ndarray, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt, **kw)
    return buf.getvalue()


def _sample(**fields: object) -> dict[str, object]:
    return {"__key__": "s1", "__url__": "file:///data/train-000001.tar", **fields}


def test_jpeg_decodes_to_rgb_hwc_uint8_close_to_source() -> None:
    src = _gradient()
    out = Decoder()(_sample(jpg=_encode(src, "JPEG", quality=95)))
    img = out["jpg"]
    assert isinstance(img, np.ndarray)
    assert img.shape == (48, 64, 3)
    assert img.dtype == np.uint8
    assert np.abs(img.astype(int) - src.astype(int)).mean() < 3.0
    # Same pixels as Pillow's decoder (both libjpeg-turbo, same settings).
    ref = np.asarray(Image.open(io.BytesIO(_encode(src, "JPEG", quality=95))).convert("RGB"))
    assert np.abs(img.astype(int) - ref.astype(int)).max() <= 2


def test_png_is_lossless_and_rgba_or_gray_become_rgb() -> None:
    src = _gradient()
    out = Decoder()(_sample(png=_encode(src, "PNG")))
    np.testing.assert_array_equal(out["png"], src)
    gray = src[:, :, 0]
    out = Decoder()(_sample(png=_encode(gray, "PNG")))
    assert out["png"].shape == (48, 64, 3)
    np.testing.assert_array_equal(out["png"][:, :, 1], gray)
    rgba = np.concatenate([src, np.full((48, 64, 1), 255, np.uint8)], -1)
    out = Decoder()(_sample(png=_encode(rgba, "PNG")))
    np.testing.assert_array_equal(out["png"], src)


def test_webp_lossless() -> None:
    src = _gradient()
    out = Decoder()(_sample(webp=_encode(src, "WEBP", lossless=True)))
    np.testing.assert_array_equal(out["webp"], src)


def test_image_modes() -> None:
    src = _gradient()
    data = _encode(src, "PNG")
    t = Decoder(image="torch")(_sample(png=data))["png"]
    assert isinstance(t, torch.Tensor)
    assert t.shape == (3, 48, 64)
    assert t.dtype == torch.uint8
    np.testing.assert_array_equal(t.permute(1, 2, 0).numpy(), src)
    pil = Decoder(image="pil")(_sample(png=data))["png"]
    assert isinstance(pil, Image.Image)
    assert pil.mode == "RGB"
    assert pil.size == (64, 48)
    gray = Decoder(image="l8")(_sample(png=data))["png"]
    assert gray.shape == (48, 64, 1)
    raw = Decoder(image="bytes")(_sample(png=data, cls=b"3"))
    assert raw["png"] == data
    assert raw["cls"] == 3
    with pytest.raises(InvalidArgumentError, match="rgb8"):
        Decoder(image="float")  # type: ignore[arg-type]


def test_dotted_field_names_use_last_extension() -> None:
    src = _gradient()
    out = Decoder()(_sample(**{"seg.png": _encode(src, "PNG"), "left.jpg": _encode(src, "JPEG")}))
    np.testing.assert_array_equal(out["seg.png"], src)
    assert out["left.jpg"].shape == (48, 64, 3)


def test_non_image_fields() -> None:
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    buf = io.BytesIO()
    np.save(buf, arr)
    out = Decoder()(
        _sample(
            cls=b"17",
            json=json.dumps({"a": [1, 2]}).encode(),
            npy=buf.getvalue(),
            txt="héllo".encode(),
            bin=b"\x00\x01",
        )
    )
    assert out["cls"] == 17
    assert out["json"] == {"a": [1, 2]}
    np.testing.assert_array_equal(out["npy"], arr)
    assert out["npy"].dtype == np.float32
    assert out["txt"] == "héllo"
    assert out["bin"] == b"\x00\x01"
    assert out["__key__"] == "s1"
    assert out["__url__"] == "file:///data/train-000001.tar"


def test_object_npy_and_pickle_are_refused_by_default() -> None:
    buf = io.BytesIO()
    np.save(buf, np.array([{"x": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(CorruptDataError, match="npy"):
        Decoder()(_sample(npy=buf.getvalue()))
    with pytest.raises(UnsafeDataError):
        Decoder()(_sample(pyd=pickle.dumps({"x": 1})))
    assert Decoder(allow_pickle=True)(_sample(pyd=pickle.dumps({"x": 1})))["pyd"] == {"x": 1}


@pytest.mark.parametrize("ext", ["jpg", "png", "webp"])
def test_corrupt_image_names_url_key_and_field(ext: str) -> None:
    src = _gradient()
    fmt = {"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}[ext]
    good = _encode(src, fmt)
    for bad in (good[: len(good) // 2], b"not an image at all", good[:2] + b"\x00" * 64):
        with pytest.raises(CorruptDataError) as info:
            Decoder()(_sample(**{ext: bad}))
        msg = str(info.value)
        assert "train-000001.tar" in msg
        assert "'s1'" in msg
        assert ext in msg
        assert info.value.key == "s1"
        assert info.value.url == "file:///data/train-000001.tar"


def test_corrupt_jpeg_direct_raises() -> None:
    good = _encode(_gradient(), "JPEG")
    with pytest.raises((ValueError, OSError)):
        decode_image(good[: len(good) // 3])


def test_cmyk_jpeg_falls_back_to_pillow() -> None:
    src = _gradient()
    buf = io.BytesIO()
    Image.fromarray(src).convert("CMYK").save(buf, format="JPEG", quality=95)
    img = decode_image(buf.getvalue())
    assert img.shape == (48, 64, 3)
    assert np.abs(img.astype(int) - src.astype(int)).mean() < 6.0


def test_extra_decoders_and_pickling() -> None:
    dec = Decoder(image="torch", extra={"seg": bytes.upper})
    clone = pickle.loads(pickle.dumps(dec))
    assert repr(clone) == repr(dec)
    out = clone(_sample(seg=b"abc", png=_encode(_gradient(), "PNG")))
    assert out["seg"] == b"ABC"
    assert out["png"].shape == (3, 48, 64)


def test_input_sample_is_not_modified() -> None:
    sample = _sample(cls=b"1")
    Decoder()(sample)
    assert sample["cls"] == b"1"


def test_fused_transform_as_image_decoder() -> None:
    from fastload.loader.transforms import ImageTrainTransform, sample_rng

    data = _encode(_gradient(120, 160), "JPEG", quality=95)
    tf = ImageTrainTransform(size=32)
    dec = pickle.loads(pickle.dumps(Decoder(image=tf)))
    sample = _sample(jpg=data, cls=b"4")
    sample["__rng_seed__"] = (1, 2, 3)
    out = dec(sample)
    assert out["cls"] == 4
    assert out["jpg"].shape == (3, 32, 32)
    torch.testing.assert_close(out["jpg"], tf(data, sample_rng(1, 2, 3)))
    bad = _sample(jpg=data[:40], cls=b"4")
    with pytest.raises(CorruptDataError) as info:
        dec(bad)
    assert info.value.key == "s1"
    assert "train-000001.tar" in str(info.value)
    assert "'jpg'" in str(info.value)


def test_one_list_of_image_extensions_decoded_but_for_the_ones_pillow_cannot() -> None:
    from fastload.formats.manifest import IMAGE_EXTENSIONS, field_type
    from fastload.loader.decode import DECODED_IMAGE_EXTENSIONS, UNDECODED_IMAGE_EXTENSIONS

    assert DECODED_IMAGE_EXTENSIONS | UNDECODED_IMAGE_EXTENSIONS == IMAGE_EXTENSIONS
    assert not DECODED_IMAGE_EXTENSIONS & UNDECODED_IMAGE_EXTENSIONS
    assert {field_type(f"x.{ext}") for ext in IMAGE_EXTENSIONS} == {"image"}
    jpeg = _encode(_gradient(), "JPEG", quality=95)
    out = Decoder()(_sample(jfif=jpeg, jxl=b"\xff\x0a not decoded"))
    assert isinstance(out["jfif"], np.ndarray)
    assert out["jfif"].shape == (48, 64, 3)
    assert out["jxl"] == b"\xff\x0a not decoded"  # stays bytes: Pillow has no JPEG XL decoder
