"""Fixtures for DALI tests: tiny JPEG datasets in all three formats, on local disk.

Sample ``g`` (global number, manifest order) has key ``s{g:05d}``, label ``cls = g`` (unique, so
labels identify samples) and a small RGB JPEG whose size depends on ``g``.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from fastload.dali import dali_available
from fastload.formats import Manifest, ShardEntry, get_format, write_manifest
from fastload.storage import Store, open_store
from fastload.testing import need

SIZES = (17, 12, 17)  # 46 samples in 3 shards
FORMATS = ("webdataset", "tfrecord", "lmdb")


def require_dali() -> None:
    need("NVIDIA DALI", dali_available(), "pip install nvidia-dali-cuda120 (or 'fastload[dali]')")


def jpeg(g: int) -> bytes:
    """A deterministic smooth RGB JPEG for sample ``g`` (quality 95)."""
    rng = np.random.default_rng([7, g])
    h, w = 40 + (g % 5) * 4, 48 + (g % 3) * 8
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    base = rng.uniform(40, 200, size=3)
    img = base + 30 * np.sin(xx[..., None] / (3 + g % 4) + rng.uniform(0, 6, size=3))
    img += 20 * np.cos(yy[..., None] / 5.0)
    buf = io.BytesIO()
    Image.fromarray(img.clip(0, 255).astype(np.uint8), "RGB").save(buf, "JPEG", quality=95)
    return buf.getvalue()


def write_dataset(store: Store, fmt: str, sizes: Sequence[int] = SIZES) -> int:
    """Write a dataset of ``sizes`` samples per shard into ``store``; returns the sample count."""
    f = get_format(fmt)
    entries = []
    g = 0
    for s, n in enumerate(sizes):
        w = f.writer(store, f"train-{s:06d}.{f.extension}")
        for _ in range(n):
            w.write({"__key__": f"s{g:05d}", "jpg": jpeg(g), "cls": g})
            g += 1
        entries.append(ShardEntry.from_info(w.close()))
    write_manifest(store, Manifest(format=f.name, shards=entries))
    return g


@pytest.fixture(scope="session")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Format name → local dataset root (same samples in each)."""
    root = tmp_path_factory.mktemp("dali-datasets")
    out = {}
    for fmt in FORMATS:
        path = Path(root) / fmt
        write_dataset(open_store(str(path)), fmt)
        out[fmt] = str(path)
    return out


@pytest.fixture(scope="session")
def kit() -> SimpleNamespace:
    """The helpers above, for test modules (conftest is not importable under importlib mode)."""
    return SimpleNamespace(
        SIZES=SIZES, N=sum(SIZES), jpeg=jpeg, write_dataset=write_dataset, require_dali=require_dali
    )


@pytest.fixture(autouse=True)
def _need_dali(request: pytest.FixtureRequest) -> None:
    """Every DALI test needs DALI: skip locally, fail under CI=true (fastload.testing.need)."""
    if request.path.name != "test_missing.py":  # that module tests the absence of DALI
        require_dali()
