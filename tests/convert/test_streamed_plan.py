"""Streamed planning: the plan is cut and hashed as the source's units come, and each shard is
written as soon as it is cut, so no process holds the units of the whole corpus and the first
shard is committed while the source is still being enumerated. The output must be byte for byte
that of a plan made whole first (the path a destination holding a version-1 state still takes);
a resumed run must refuse a source that changed under its finished shards."""

from __future__ import annotations

import hashlib
import importlib
import json
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fastload.convert.sources import ConversionError, JsonlSource, ShardSource, Unit
from fastload.errors import DatasetExistsError
from fastload.storage import open_store

fc = importlib.import_module("fastload.convert")
_convert_module = importlib.import_module("fastload.convert._convert")


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


def _v1_state(ref_state: Path, dst: Path, keep: int, plan_sha256: str) -> None:
    """In ``dst``: the state a conversion interrupted before plans streamed left (version 1), made
    from ``ref_state`` (a finished run whose state was kept): its first ``keep`` shards (and
    indexes) with done records naming the whole plan's hash, and ``plan.json`` naming it."""
    state = dst / "_fastload_convert"
    (state / "done").mkdir(parents=True)
    for n in range(keep):
        record_path = ref_state / "_fastload_convert" / "done" / f"shard-{n:06d}.tar.json"
        record = json.loads(record_path.read_text())
        record["plan_sha256"] = plan_sha256
        del record["shard_sha256"]
        (state / "done" / record_path.name).write_text(json.dumps(record))
        for name in (record["info"]["key"], record["info"]["index_key"]):
            (dst / name).write_bytes((ref_state / name).read_bytes())
    doc = {"fastload_convert_plan": 1, "plan_sha256": plan_sha256, "num_shards": 0}
    (state / "plan.json").write_text(json.dumps(doc))


def _run_keeping_state(
    monkeypatch: pytest.MonkeyPatch, src: Path, dst: Path, **options: Any
) -> Any:
    """A conversion that leaves its state objects (plan.json, done records) behind."""
    with monkeypatch.context() as patch:
        patch.setattr(_convert_module, "clear_state", lambda store: None)
        return fc.convert(src, dst, **options)


def test_a_conversion_begun_before_plans_streamed_resumes_byte_identical(
    tmp_path: Path, cv: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A version-1 state (``plan.json`` and done records naming the whole plan's hash): the run
    plans everything first, keeps the shards whose records match, and writes the rest from a
    second enumeration, checked against the plan: today's two-pass path gives the bytes of the
    streamed one."""
    src = _corpus(tmp_path / "src", cv, files=3, records=40)
    options: dict[str, Any] = {"format": "webdataset", "shard_samples": 7, "quiet": True}
    streamed = fc.convert(src, tmp_path / "streamed", workers=2, **options)
    _run_keeping_state(monkeypatch, src, tmp_path / "state", workers=1, **options)
    for workers in (1, 2):
        dst = tmp_path / f"v1-{workers}"
        _v1_state(tmp_path / "state", dst, 5, streamed.plan_sha256)
        result = fc.convert(src, dst, workers=workers, **options)
        assert result.resumed_shards == 5
        assert cv.tree_bytes(dst) == cv.tree_bytes(tmp_path / "streamed")

    other = tmp_path / "v1-other"
    _v1_state(tmp_path / "state", other, 2, "0" * 64)
    with pytest.raises(DatasetExistsError, match="unfinished conversion of a different input"):
        fc.convert(src, other, workers=1, **options)


def test_a_source_that_changes_between_the_passes_of_a_whole_plan_is_an_error(
    tmp_path: Path, cv: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a run plans everything first (a version-1 state), the units enumerated again for
    writing are checked against the plan."""
    src = _corpus(tmp_path / "src", cv, files=2, records=30)
    options: dict[str, Any] = {"format": "webdataset", "shard_samples": 8, "quiet": True}
    _run_keeping_state(monkeypatch, src, tmp_path / "state", workers=1, **options)
    sha = json.loads((tmp_path / "state" / "fastload.json").read_text())["created_by"][
        "plan_sha256"
    ]
    dst = tmp_path / "out"
    _v1_state(tmp_path / "state", dst, 1, sha)
    original = JsonlSource.plan_units
    calls = []

    def second_pass_differs(self: JsonlSource, report: Any) -> Iterator[Unit]:
        calls.append(1)
        for n, unit in enumerate(original(self, report)):
            if len(calls) > 1 and n == 40:  # the file changed under the conversion
                unit = unit._replace(size=unit.size + 1)
            yield unit

    monkeypatch.setattr(JsonlSource, "plan_units", second_pass_differs)
    with pytest.raises(ConversionError, match="source changed while it was converted"):
        fc.convert(src, dst, workers=1, **options)
    assert not (dst / "fastload.json").exists()
    assert not (dst / "shard-000005.tar").exists()  # the shard that differs is never written


@pytest.mark.parametrize("workers", [1, 2])
def test_the_first_shard_is_committed_before_the_source_is_enumerated(
    tmp_path: Path, cv: Any, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """The enumeration stops at the 11th shard's first record until shard 0 is committed (its
    done record is there): a conversion that planned everything first would wait forever (the
    wait gives up after a minute, and the test fails)."""
    src = _corpus(tmp_path / "src", cv, files=3, records=120)
    options: dict[str, Any] = {"format": "webdataset", "shard_samples": 7, "quiet": True}
    fc.convert(src, tmp_path / "ref", workers=workers, **options)
    dst = tmp_path / "out"
    done = dst / "_fastload_convert" / "done" / "shard-000000.tar.json"
    original = JsonlSource.plan_units
    seen: list[tuple[int, bool]] = []

    def waits_for_the_first_shard(self: JsonlSource, report: Any) -> Iterator[Unit]:
        n = 0
        for n, unit in enumerate(original(self, report)):
            if n == 10 * 7:
                deadline = time.monotonic() + 60
                while not done.exists() and time.monotonic() < deadline:
                    time.sleep(0.005)
                seen.append((n, done.exists()))
            yield unit
        seen.append((n + 1, True))

    monkeypatch.setattr(JsonlSource, "plan_units", waits_for_the_first_shard)
    fc.convert(src, dst, workers=workers, **options)
    assert seen == [(70, True), (360, True)]  # committed with 70 of 360 records enumerated
    assert cv.tree_bytes(dst) == cv.tree_bytes(tmp_path / "ref")


_STOP_AT: set[str] = set()


def _stops(sample: dict[str, Any]) -> dict[str, Any]:
    """A map hook that fails on the keys of ``_STOP_AT`` (a run stopped part-way)."""
    if sample["__key__"] in _STOP_AT:
        raise ValueError("stopped here")
    return sample


def _stopped_run(src: Path, dst: Path, options: dict[str, Any]) -> list[str]:
    """Convert ``src`` until line 30 of ``part-2`` (in this process); the shards done."""
    _STOP_AT.add("part-2/000000030")
    try:
        with pytest.raises(ConversionError, match="stopped here"):
            fc.convert(src, dst, **options)
    finally:
        _STOP_AT.clear()
    return sorted(p.name for p in (dst / "_fastload_convert" / "done").iterdir())


def test_a_resumed_run_refuses_a_source_changed_under_its_finished_shards(
    tmp_path: Path, cv: Any
) -> None:
    src = _corpus(tmp_path / "src", cv, files=3, records=40)
    options: dict[str, Any] = {
        "format": "webdataset", "shard_samples": 7, "workers": 1, "quiet": True, "map_fn": _stops
    }  # fmt: skip
    dst = tmp_path / "out"
    done = _stopped_run(src, dst, options)
    assert len(done) == 15  # 105 of 120 records
    before = cv.tree_bytes(dst)

    # Other options: refused at once (plan.json names the source and options).
    with pytest.raises(DatasetExistsError, match="different input or with other options"):
        fc.convert(src, dst, **{**options, "shard_samples": 8})
    # Record 3 of part-1 (in shard 6) changed: refused when the plan reaches shard 6, before a
    # shard is written.
    lines = (src / "part-1.jsonl").read_text().splitlines(keepends=True)
    edited = list(lines)
    edited[3] = edited[3].replace('"pad"', '"pad2"')
    (src / "part-1.jsonl").write_text("".join(edited))
    with pytest.raises(DatasetExistsError, match=r"shard shard-000006\.tar was written from other"):
        fc.convert(src, dst, **options)
    assert cv.tree_bytes(dst) == before
    # A source that lost its last records is refused as well: its 8 shards are those done,
    # and done records remain beyond them.
    (src / "part-2.jsonl").rename(tmp_path / "part-2.jsonl")
    (src / "part-1.jsonl").write_text("".join(lines[:16]))
    with pytest.raises(DatasetExistsError, match=r"shard shard-000008\.tar was written from other"):
        fc.convert(src, dst, **options)
    assert cv.tree_bytes(dst) == before

    # Restored: the run resumes, and gives the bytes of an uninterrupted run.
    (src / "part-1.jsonl").write_text("".join(lines))
    (tmp_path / "part-2.jsonl").rename(src / "part-2.jsonl")
    result = fc.convert(src, dst, **options)
    assert result.resumed_shards == 15
    fc.convert(src, tmp_path / "ref", **options)
    assert cv.tree_bytes(dst) == cv.tree_bytes(tmp_path / "ref")


def test_a_change_past_the_finished_shards_gives_the_conversion_of_the_new_source(
    tmp_path: Path, cv: Any
) -> None:
    """Only the finished shards are checked: records no finished shard holds may change (or be
    added) before the resumed run, which then writes what a fresh run of the new source would."""
    src = _corpus(tmp_path / "src", cv, files=3, records=40)
    options: dict[str, Any] = {
        "format": "webdataset", "shard_samples": 7, "workers": 2, "quiet": True, "map_fn": _stops
    }  # fmt: skip
    dst = tmp_path / "out"
    _stopped_run(src, dst, {**options, "workers": 1})
    with (src / "part-2.jsonl").open("a") as f:
        f.write('{"i": 1000, "pad": "added"}\n')
    result = fc.convert(src, dst, **options)
    assert result.resumed_shards == 15
    assert result.num_samples == 121
    fc.convert(src, tmp_path / "fresh", **options)
    assert cv.tree_bytes(dst) == cv.tree_bytes(tmp_path / "fresh")


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
