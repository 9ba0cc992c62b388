"""Fixtures for the end-to-end tests: a small generated image corpus (150 JPEGs, ~7 KB each)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

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


def epoch_keys(loader: Any, epoch: int | None = None) -> list[str]:
    """The keys of one epoch of a loader of ``(keys, labels)`` batches (of epoch ``epoch``, set
    first, when given), checking that every label is the class in its key (data intact)."""
    if epoch is not None:
        loader.set_epoch(epoch)
    keys: list[str] = []
    for batch_keys, labels in loader:
        assert [int(c) for c in labels] == [int(k[1:4]) for k in batch_keys]
        keys.extend(batch_keys)
    return keys


def cache_files(cache_dir: Path) -> dict[str, int]:
    """The objects in a node cache (path -> inode: a second download replaces the file, so its
    inode changes)."""
    out = {}
    for dirpath, _, names in os.walk(cache_dir / "objects"):
        for name in names:
            if not name.endswith((".json", ".tmp")):
                path = os.path.join(dirpath, name)
                out[path] = os.stat(path).st_ino
    return out


class Helpers:
    """Helper functions, handed to tests as the ``e2e`` fixture (conftest modules are not
    importable under ``--import-mode=importlib``)."""

    epoch_keys = staticmethod(epoch_keys)
    cache_files = staticmethod(cache_files)


@pytest.fixture(scope="session")
def e2e() -> type[Helpers]:
    """The helpers above."""
    return Helpers
