"""Streamed planning: the plan of a record source is cut and hashed as its units come, and the
units are enumerated again for writing, so no process holds the units of the whole corpus. The
output must be byte for byte that of a plan that keeps every unit."""

from __future__ import annotations

import hashlib
import importlib
import json
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fastload.convert.sources import ConversionError, JsonlSource, ShardSource, Unit
from fastload.storage import open_store

fc = importlib.import_module("fastload.convert")


def _corpus(root: Path, cv: Any, files: int = 3, records: int = 120) -> Path:
    """``files`` JSONL files of ``records`` records of varying sizes (and a blank line each)."""
    root.mkdir()
    for f in range(files):
        lines: list[Any] = [
            {"i": f * records + i, "pad": "x" * (i * 37 % 300)} for i in range(records)
        ]
        lines.insert(records // 2, "   ")
        cv.write_jsonl(root / f"part-{f}.jsonl", lines)
    return root


@pytest.mark.parametrize("limits", [{"shard_samples": 7}, {"shard_size": 9000}])
def test_streamed_plan_writes_the_bytes_of_a_kept_plan(
    tmp_path: Path, cv: Any, real_fmt: str, limits: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _corpus(tmp_path / "src", cv)
    streamed = {}
    for workers in (1, 2):
        dst = tmp_path / f"streamed{workers}"
        fc.convert(src, dst, format=real_fmt, workers=workers, quiet=True, **limits)
        streamed[workers] = cv.tree_bytes(dst)
    assert streamed[1] == streamed[2]
    assert (
        len([k for k in streamed[1] if k.startswith("shard-")]) >= 10
    )  # more than the queue holds

    # The same conversion with every unit kept from one enumeration, as before streaming.
    monkeypatch.setattr(JsonlSource, "replannable", property(lambda self: False))
    kept = tmp_path / "kept"
    fc.convert(src, kept, format=real_fmt, workers=2, quiet=True, **limits)
    assert cv.tree_bytes(kept) == streamed[1]


def test_plan_hash_is_the_whole_plan_hash(tmp_path: Path, cv: Any) -> None:
    """The streamed hash equals the SHA-256 of the whole plan written out at once (the hash a
    plan stored in a destination's state and manifest had before planning streamed)."""
    src = _corpus(tmp_path / "src", cv, files=2, records=30)
    dst = tmp_path / "out"
    result = fc.convert(src, dst, format="webdataset", workers=1, shard_samples=8, quiet=True)
    created = json.loads((dst / "fastload.json").read_text())["created_by"]
    units = list(JsonlSource(open_store(str(src))).plan_units(lambda item, reason: None))
    sha = hashlib.sha256()
    head = {"source": created["source"], "options": created["options"]}
    sha.update(json.dumps(head, sort_keys=True, separators=(",", ":"), default=str).encode())
    for n in range(0, len(units), 8):
        sha.update(f"\nshard shard-{n // 8:06d}.tar\n".encode())
        for unit in units[n : n + 8]:
            sha.update((json.dumps([unit.ref, unit.size], separators=(",", ":")) + "\n").encode())
    assert result.plan_sha256 == created["plan_sha256"] == sha.hexdigest()


def test_a_source_that_changes_before_its_shards_are_written_is_an_error(
    tmp_path: Path, cv: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _corpus(tmp_path / "src", cv, files=2, records=30)
    original = JsonlSource.plan_units
    calls = []

    def second_pass_differs(self: JsonlSource, report: Any) -> Iterator[Unit]:
        calls.append(1)
        for n, unit in enumerate(original(self, report)):
            if len(calls) > 1 and n == 40:  # the file changed under the conversion
                unit = unit._replace(size=unit.size + 1)
            yield unit

    monkeypatch.setattr(JsonlSource, "plan_units", second_pass_differs)
    dst = tmp_path / "out"
    with pytest.raises(ConversionError, match="source changed while it was converted"):
        fc.convert(src, dst, format="webdataset", workers=1, shard_samples=8, quiet=True)
    assert not (dst / "fastload.json").exists()
    assert not (dst / "shard-000005.tar").exists()  # the shard that differs is never written


def test_planning_holds_one_shard_of_units_not_the_corpus(tmp_path: Path) -> None:
    src = tmp_path / "big.jsonl"
    n = 40_000
    src.write_text("".join(f'{{"text": "record {i}"}}\n' for i in range(n)))
    tracemalloc.start()
    try:
        result = fc.convert(
            src, tmp_path / "out", format="webdataset", shard_samples=500, dry_run=True, quiet=True
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.num_samples == n
    assert result.num_shards == n // 500
    # Keeping every unit takes ~300 bytes a record (12 MB here); a streamed plan keeps none
    # (~1.5 MB is the conversion's own set-up).
    assert peak < 3_000_000, peak


def test_a_streamed_dataset_source_writes_the_bytes_of_a_kept_one(
    tmp_path: Path, cv: Any, image_folder: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, expected = image_folder
    fc.convert(root, tmp_path / "first", format="webdataset", workers=1, quiet=True)
    for name in ("streamed", "kept"):
        if name == "kept":  # every unit kept from one enumeration, as before streaming
            monkeypatch.setattr(ShardSource, "replannable", property(lambda self: False))
        options = {"format": "tfrecord", "shard_samples": 3, "workers": 2, "quiet": True}
        fc.convert(tmp_path / "first", tmp_path / name, **options)
    assert cv.tree_bytes(tmp_path / "streamed") == cv.tree_bytes(tmp_path / "kept")
    created = json.loads((tmp_path / "streamed" / "fastload.json").read_text())["created_by"]
    assert created["source"]["format"] == "webdataset"
    assert cv.read_dataset(tmp_path / "streamed") == expected
