"""A shard whose write fails on a transient store error is written again from its units.

A streamed write cannot resume where a cut connection left it (an HDFS block pipeline, an
upload), but a shard's bytes depend only on its job: written again, it is the same shard. The
store here is a local directory whose writers fail their commit with the errors a network gives
(or a permission error, which no retry cures) a set number of times per key; the real thing, cut
DataNode connections during a conversion into HDFS, is in ``tests/e2e/test_hdfs.py``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, ClassVar

import pytest

import fastload
from fastload.errors import StoreError, StorePermissionError, TransientStoreError
from fastload.storage import LocalStore, register_store
from fastload.storage._streams import ObjectWriter


class _FailingCommit(ObjectWriter):
    """Takes the writes, then fails the commit with ``error`` (nothing becomes visible)."""

    def __init__(self, inner: ObjectWriter, error: StoreError) -> None:
        super().__init__()
        self._inner, self._error = inner, error

    def _write(self, data: memoryview) -> None:
        self._inner.write(data)

    def _commit(self) -> None:
        self._inner.abort()
        raise self._error

    def _abort(self) -> None:
        self._inner.abort()


class FlakyStore(LocalStore):
    """``flaky:///path``: a local directory whose writer of a key in :attr:`failures` fails
    its commit (that many times, with that error)."""

    failures: ClassVar[dict[str, list[StoreError]]] = {}
    opened: ClassVar[list[str]] = []

    @classmethod
    def from_url(cls, url: str, **options: Any) -> FlakyStore:
        return cls(url.removeprefix("flaky://"), **options)

    def open_writer(self, key: str) -> ObjectWriter:
        FlakyStore.opened.append(key)
        inner = super().open_writer(key)
        errors = FlakyStore.failures.get(key)
        if not errors:
            return inner
        return _FailingCommit(inner, errors.pop(0))


@pytest.fixture
def flaky() -> type[FlakyStore]:
    register_store("flaky", FlakyStore)
    FlakyStore.failures.clear()
    FlakyStore.opened.clear()
    return FlakyStore


def _cut(url: str) -> TransientStoreError:
    return TransientStoreError(f"cannot write {url}: connection reset by peer", url=url)


def _convert(src: Path, dst: str) -> Any:
    return fastload.convert(src, dst, shard_samples=10, workers=1, quiet=True)


def test_a_shard_cut_twice_is_written_again_and_identical(
    tmp_path: Path, cv: Any, flaky: type[FlakyStore], caplog: pytest.LogCaptureFixture
) -> None:
    src = tmp_path / "src"
    cv.make_image_folder(src, classes=2, per_class=15)
    _convert(src, str(tmp_path / "ref"))
    flaky.failures["shard-000001.tar"] = [_cut("a"), _cut("b")]
    with caplog.at_level(logging.WARNING, logger="fastload.convert"):
        result = _convert(src, f"flaky://{tmp_path / 'out'}")
    assert result.num_samples == 30
    assert cv.tree_bytes(tmp_path / "out") == cv.tree_bytes(tmp_path / "ref")
    assert flaky.opened.count("shard-000001.tar") == 3  # two failed attempts, then the shard
    retried = [r.getMessage() for r in caplog.records if "again (attempt" in r.getMessage()]
    assert len(retried) == 2
    assert "shard-000001.tar again (attempt 2 of 4)" in retried[0]


def test_a_shard_that_keeps_failing_stops_the_conversion_and_the_rerun_resumes(
    tmp_path: Path, cv: Any, flaky: type[FlakyStore]
) -> None:
    src = tmp_path / "src"
    cv.make_image_folder(src, classes=2, per_class=15)
    _convert(src, str(tmp_path / "ref"))
    flaky.failures["shard-000001.tar"] = [_cut(str(n)) for n in range(10)]
    dst = f"flaky://{tmp_path / 'out'}"
    with pytest.raises(TransientStoreError) as info:
        _convert(src, dst)
    assert "shard shard-000001.tar was written 4 times" in "".join(info.value.__notes__)
    assert flaky.opened.count("shard-000001.tar") == 4
    assert not (tmp_path / "out" / "shard-000001.tar").exists()  # nothing partial visible
    assert not (tmp_path / "out" / "fastload.json").exists()
    flaky.failures.clear()
    _convert(src, dst)  # the network is back: the same command completes it
    assert cv.tree_bytes(tmp_path / "out") == cv.tree_bytes(tmp_path / "ref")


def test_an_error_no_retry_cures_is_not_retried(
    tmp_path: Path, cv: Any, flaky: type[FlakyStore]
) -> None:
    src = tmp_path / "src"
    cv.make_image_folder(src, classes=2, per_class=15)
    denied = StorePermissionError("cannot write: permission denied", url="x")
    flaky.failures["shard-000000.tar"] = [denied]
    with pytest.raises(StorePermissionError):
        _convert(src, f"flaky://{tmp_path / 'out'}")
    assert flaky.opened.count("shard-000000.tar") == 1
