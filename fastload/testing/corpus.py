"""Generated sample corpora: deterministic photo-like JPEGs in an image-folder layout.

Used by the README demo (``make demo``), the tests and the benchmarks, so that all of them run on
a realistic corpus without downloading anything. ``make_image(i)`` is a pure function of
``(seed, i)``: each image is a smooth colour field plus oriented texture, a few soft-edged shapes
and sensor-like noise, mostly 500x375 (landscape) or 375x500 (portrait), JPEG quality 90, about
97 KB on average — close to the statistics of a photo dataset such as ImageNet.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

__all__ = ["NUM_CLASSES", "SEED", "make_image", "write_image_folder"]

NUM_CLASSES = 100
SEED = 20240607
QUALITY = 90


def _size(rng: np.random.Generator) -> tuple[int, int]:
    """(width, height): 75 % 500x375, 20 % 375x500, 5 % other sizes between 240 and 640."""
    u = rng.random()
    if u < 0.75:
        return 500, 375
    if u < 0.95:
        return 375, 500
    return int(rng.integers(240, 641)), int(rng.integers(240, 641))


def make_image(
    index: int, seed: int = SEED, *, num_classes: int = NUM_CLASSES, scale: int = 1
) -> tuple[int, bytes]:
    """The class label and JPEG bytes of corpus image ``index`` (pure function of the arguments).

    ``scale`` divides both sides of the image (1 = full size).
    """
    rng = np.random.default_rng([seed, index])
    label = index % num_classes
    w, h = _size(rng)
    w, h = max(16, w // scale), max(16, h // scale)
    # Smooth colour field: a coarse random grid upsampled bicubically; the class shifts the palette.
    base = rng.normal(0.0, 1.0, size=3) * 40.0 + (
        np.array([label * 7, label * 13, label * 29]) % 120
    )
    coarse = (
        rng.random((int(rng.integers(2, 6)), int(rng.integers(2, 6)), 3)) * 150.0 + base
    ).clip(0, 255)
    field = np.asarray(
        Image.fromarray(coarse.astype(np.uint8), "RGB").resize((w, h), Image.Resampling.BICUBIC),
        dtype=np.float32,
    )
    # Oriented texture: a sum of a few sinusoids (fabric, foliage, waves).
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    texture = np.zeros((h, w), np.float32)
    for _ in range(3):
        freq = rng.uniform(0.02, 0.35)
        angle = rng.uniform(0, np.pi)
        phase = rng.uniform(0, 2 * np.pi)
        texture += rng.uniform(3.0, 12.0) * np.sin(
            freq * (np.cos(angle) * xx + np.sin(angle) * yy) + phase
        )
    img = field + texture[..., None] * rng.uniform(0.5, 1.0, size=3).astype(np.float32)
    pil = Image.fromarray(img.clip(0, 255).astype(np.uint8), "RGB")
    # Shapes with soft edges: objects in the scene.
    draw = ImageDraw.Draw(pil)
    for _ in range(int(rng.integers(3, 9))):
        x0, y0 = int(rng.integers(-w // 4, w)), int(rng.integers(-h // 4, h))
        x1, y1 = x0 + int(rng.integers(20, w // 2)), y0 + int(rng.integers(20, h // 2))
        colour = tuple(int(c) for c in rng.integers(0, 256, size=3))
        if rng.random() < 0.5:
            draw.ellipse((x0, y0, x1, y1), fill=colour)
        else:
            draw.rectangle((x0, y0, x1, y1), fill=colour)
    pil = pil.filter(ImageFilter.GaussianBlur(radius=float(rng.uniform(0.4, 1.2))))
    # Sensor-like noise (sets most of the file size, like real photos' fine detail).
    arr = np.asarray(pil, dtype=np.float32)
    sigma = float(rng.uniform(4.0, 36.0))
    noise = rng.standard_normal((h, w, 1), dtype=np.float32) * sigma
    noise = noise + rng.standard_normal((h, w, 3), dtype=np.float32) * (sigma / 3)
    arr = (arr + noise).clip(0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, format="JPEG", quality=QUALITY)
    return label, buf.getvalue()


def _write_range(args: tuple[str, int, int, int, int, int]) -> int:
    root, start, stop, seed, num_classes, scale = args
    total = 0
    for i in range(start, stop):
        path = Path(root) / f"c{i % num_classes:03d}" / f"img{i:07d}.jpg"
        if path.exists():
            total += path.stat().st_size
            continue
        _, data = make_image(i, seed, num_classes=num_classes, scale=scale)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.rename(path)
        total += len(data)
    return total


def write_image_folder(
    root: str | os.PathLike[str],
    count: int,
    *,
    num_classes: int = NUM_CLASSES,
    seed: int = SEED,
    scale: int = 1,
    processes: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Write ``count`` images as ``root/c<class>/img<index>.jpg``; return the bytes written.

    Images already present are kept (a larger corpus is a superset of a smaller one). ``scale``
    divides the image sides (2 gives ~250x188 images, four times faster to make). ``progress``
    is called with the number of images done so far.
    """
    base = Path(root)
    for c in range(min(num_classes, count)):
        (base / f"c{c:03d}").mkdir(parents=True, exist_ok=True)
    step = 50
    jobs = [
        (str(base), s, min(s + step, count), seed, num_classes, scale)
        for s in range(0, count, step)
    ]
    total = 0
    done = 0
    with ProcessPoolExecutor(max_workers=processes or os.cpu_count() or 1) as pool:
        for (_, start, stop, *_rest), nbytes in zip(jobs, pool.map(_write_range, jobs)):
            total += nbytes
            done += stop - start
            if progress is not None:
                progress(done)
    return total
