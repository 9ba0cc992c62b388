"""Helpers shared by the parts of :class:`~fastload.testing.store.StoreTests`."""

from __future__ import annotations

import hashlib
import random

import pytest

from fastload.storage import Store

__all__ = ["MiB", "digest", "need_listing", "payload"]

MiB = 1024 * 1024


def payload(size: int, seed: int = 0) -> bytes:
    """Deterministic, non-repeating-looking bytes (so a shifted range cannot match by luck)."""
    return random.Random(seed).randbytes(size)


def digest(parts: list[bytes]) -> str:
    """One hash of a sequence of byte strings, lengths included (so the split counts)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def need_listing(store: Store) -> None:
    """Skip the calling test if ``store`` cannot list."""
    if not store.supports_listing:
        pytest.skip(f"{type(store).__name__} does not support listing (supports_listing)")
