"""Fixtures for the end-to-end tests: a small generated image corpus (150 JPEGs, ~7 KB each)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastload.testing.corpus import write_image_folder

#: Images in the corpus; with 10 samples per shard that is 15 shards of ~90 KB.
NUM_IMAGES = 150


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``root/c<class>/img<index>.jpg`` for 150 images at a quarter of the usual size."""
    root = tmp_path_factory.mktemp("e2e-corpus") / "images"
    write_image_folder(root, NUM_IMAGES, scale=4, processes=1)
    return root


@pytest.fixture(scope="session")
def image_keys(image_folder: Path) -> list[str]:
    """The sample keys the converter gives the corpus (``c007/img0000007``), sorted."""
    return sorted(f"{p.parent.name}/{p.stem}" for p in image_folder.glob("*/*.jpg"))
