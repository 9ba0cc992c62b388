"""A corpus of damaged datasets, run through ``fastload verify``, ``fastload convert`` and a
2-worker :class:`fastload.DataLoader` in ``raise`` and ``skip`` modes.

Every case states its exact outcome: the error type and the culprit its message names, which
samples are delivered, how many are counted as skipped, which problem ``verify`` reports and which
samples a conversion of the damaged dataset keeps. The dataset is two shards of eight samples
(``k00`` … ``k15``); each case damages one file of it at the byte level.

The table of cases and outcomes is printed by ``pytest -s tests/reliability/test_damaged_inputs.py
-k table`` (it is also in the closing note of issue 11).
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload.errors import (
    CorruptDataError,
    FastloadError,
    ManifestError,
    ObjectNotFoundError,
    WorkerError,
)
from fastload.formats import Manifest, ShardEntry, get_format, write_manifest
from fastload.formats.webdataset.index import Component, format_index
from fastload.storage import open_store

PER_SHARD = 8
KEYS = [f"k{i:02d}" for i in range(2 * PER_SHARD)]
EXT = {"webdataset": "tar", "tfrecord": "tfrecord", "lmdb": "lmdb"}


def payload(i: int) -> bytes:
    return bytes([65 + i]) * (300 + 37 * i)


def shard_name(fmt: str, s: int) -> str:
    return f"d-{s:06d}.{EXT[fmt]}"


def build(root: Path, fmt: str) -> Path:
    """The intact dataset: two shards of eight samples, indexes, manifest."""
    store = open_store(root)
    entries, fields = [], []
    for s in range(2):
        writer = get_format(fmt).writer(store, shard_name(fmt, s))
        for i in range(s * PER_SHARD, (s + 1) * PER_SHARD):
            writer.write({"__key__": KEYS[i], "bin": payload(i), "cls": i})
        info = writer.close()
        entries.append(ShardEntry.from_info(info))
        fields.append(info.fields)
    write_manifest(
        store,
        Manifest(format=fmt, shards=entries, schema=Manifest.schema_from_fields(fields)),
    )
    return root


# ---- damage --------------------------------------------------------------------------------


def _tar_members(path: Path) -> list[tarfile.TarInfo]:
    with tarfile.open(path) as tar:
        return tar.getmembers()


def _data_offset(path: Path, member: str) -> int:
    return next(m.offset_data for m in _tar_members(path) if m.name == member)


def _rewrite_manifest(root: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    doc = json.loads((root / "fastload.json").read_text())
    edit(doc)
    (root / "fastload.json").write_text(json.dumps(doc))


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def idx_line_replaced(root: Path, fmt: str) -> None:
    """Shard 0's index: the line of sample 3 replaced by the line of sample 2 (count kept)."""
    path = root / (shard_name(fmt, 0) + ".idx")
    lines = _lines(path)
    first = 1 if fmt == "webdataset" else 0  # the WebDataset index has a header line
    lines[first + 3] = lines[first + 2]
    path.write_bytes(b"".join(lines))


def idx_line_dropped(root: Path, fmt: str) -> None:
    """Shard 0's index loses its last line (and a WebDataset index's count says 7)."""
    path = root / (shard_name(fmt, 0) + ".idx")
    lines = _lines(path)[:-1]
    if fmt == "webdataset":
        lines[0] = b"v1.2 7\n"
    path.write_bytes(b"".join(lines))


def idx_garbage(root: Path, fmt: str) -> None:
    (root / (shard_name(fmt, 0) + ".idx")).write_bytes(b"\x00\xffnot an index\n" * 3)


def idx_traversal_name(root: Path, fmt: str) -> None:
    """A WebDataset index that names a member ``../k03.bin`` (DALI's wds2idx would list it)."""
    path = root / (shard_name(fmt, 0) + ".idx")
    lines = _lines(path)
    lines[4] = lines[4].replace(b" k03.bin", b" ../k03.bin")
    path.write_bytes(b"".join(lines))


def shard_truncated(root: Path, fmt: str) -> None:
    """Shard 1 cut in the middle of sample k12's data (position 4 of the shard)."""
    path = root / shard_name(fmt, 1)
    if fmt == "webdataset":
        cut = _data_offset(path, "k12.bin") + 100
    else:
        data = path.read_bytes()
        cut = data.index(payload(12)) + 100
    with open(path, "r+b") as f:
        f.truncate(cut)


def header_checksum_flipped(root: Path, fmt: str) -> None:
    """The tar header of k05.bin (shard 0) gets a wrong byte in its name field."""
    path = root / shard_name(fmt, 0)
    offset = _data_offset(path, "k05.bin") - 512
    with open(path, "r+b") as f:
        f.seek(offset + 90)  # inside the zero-padded name field: only the checksum notices
        f.write(b"\x01")


def payload_flipped(root: Path, fmt: str) -> None:
    """One byte of k05's payload (shard 0) flipped: TFRecord's payload CRC notices."""
    path = root / shard_name(fmt, 0)
    data = bytearray(path.read_bytes())
    data[data.index(payload(5)) + 10] ^= 0xFF
    path.write_bytes(bytes(data))


def length_crc_flipped(root: Path, fmt: str) -> None:
    """The length CRC of k05's record (shard 0) damaged."""
    path = root / shard_name(fmt, 0)
    index = [int(line.split()[0]) for line in _lines(Path(str(path) + ".idx"))]
    data = bytearray(path.read_bytes())
    data[index[5] + 9] ^= 0xFF
    path.write_bytes(bytes(data))


def _hand_made_tar(root: Path, fmt: str, replace: dict[str, list[str]]) -> None:
    """Rewrite shard 0 as a hand-made tar (Python's tarfile), with the members of the samples in
    ``replace`` renamed as listed, and an index listing exactly its members, as DALI's
    ``wds2idx`` would (one line per run of members with the same key)."""
    path = root / shard_name(fmt, 0)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(PER_SHARD):
            key = KEYS[i]
            names = replace.get(key, [f"{key}.bin", f"{key}.cls"])
            for name in names:
                data = payload(i) if ".bin" in name else str(i).encode()
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    path.write_bytes(buf.getvalue())
    lines: list[list[Component]] = []
    last = None
    for m in _tar_members(path):
        _base, ext = m.name.rsplit("/", 1)[-1].split(".", 1)
        key = m.name[: len(m.name) - len(ext) - 1]
        comp = Component(ext, m.offset_data, m.size, m.name)
        if key != last:
            lines.append([comp])
            last = key
        else:
            lines[-1].append(comp)
    Path(str(path) + ".idx").write_bytes(format_index(lines))
    _rewrite_manifest(root, lambda doc: _refresh_entry(doc, root, 0, len(lines)))


def _refresh_entry(doc: dict[str, Any], root: Path, s: int, count: int) -> None:
    import hashlib

    entry = doc["shards"][s]
    data = (root / entry["name"]).read_bytes()
    entry.update(num_bytes=len(data), sha256=hashlib.sha256(data).hexdigest(), num_samples=count)
    doc["num_bytes"] = sum(e["num_bytes"] for e in doc["shards"])
    doc["num_samples"] = sum(e["num_samples"] for e in doc["shards"])
    doc.pop("schema", None)


def member_traversal(root: Path, fmt: str) -> None:
    _hand_made_tar(root, fmt, {"k03": ["../k03.bin", "../k03.cls"]})


def member_absolute(root: Path, fmt: str) -> None:
    _hand_made_tar(root, fmt, {"k03": ["/abs/k03.bin", "/abs/k03.cls"]})


def member_reserved_field(root: Path, fmt: str) -> None:
    _hand_made_tar(root, fmt, {"k03": ["k03.bin", "k03.__key__"]})


def member_duplicate_field(root: Path, fmt: str) -> None:
    _hand_made_tar(root, fmt, {"k03": ["k03.bin", "k03.bin"]})


def manifest_count_exceeds(root: Path, fmt: str) -> None:
    """The manifest claims shard 0 holds 10 samples; it holds 8."""

    def edit(doc: dict[str, Any]) -> None:
        doc["shards"][0]["num_samples"] = 10
        doc["num_samples"] += 2

    _rewrite_manifest(root, edit)


def manifest_count_short(root: Path, fmt: str) -> None:
    """The manifest claims shard 1 holds 6 samples; it holds 8."""

    def edit(doc: dict[str, Any]) -> None:
        doc["shards"][1]["num_samples"] = 6
        doc["num_samples"] -= 2

    _rewrite_manifest(root, edit)


def manifest_absolute_name(root: Path, fmt: str) -> None:
    _rewrite_manifest(root, lambda doc: doc["shards"][1].update(name=str(root / "elsewhere.tar")))


def manifest_escaping_name(root: Path, fmt: str) -> None:
    _rewrite_manifest(root, lambda doc: doc["shards"][1].update(name="../other/d-000001.tar"))


def manifest_duplicate_shard(root: Path, fmt: str) -> None:
    def edit(doc: dict[str, Any]) -> None:
        doc["shards"][1] = dict(doc["shards"][0])
        doc["num_samples"] = sum(e["num_samples"] for e in doc["shards"])
        doc["num_bytes"] = sum(e["num_bytes"] for e in doc["shards"])

    _rewrite_manifest(root, edit)


def manifest_unknown_format(root: Path, fmt: str) -> None:
    _rewrite_manifest(root, lambda doc: doc.update(format="parquet-shards"))


def manifest_negative_count(root: Path, fmt: str) -> None:
    _rewrite_manifest(root, lambda doc: doc["shards"][0].update(num_samples=-1))


def manifest_truncated(root: Path, fmt: str) -> None:
    path = root / "fastload.json"
    path.write_bytes(path.read_bytes()[:150])


def shard_missing(root: Path, fmt: str) -> None:
    (root / shard_name(fmt, 1)).unlink()


# ---- outcomes ------------------------------------------------------------------------------


@dataclass
class Case:
    """A damage and what fastload must do about it.

    ``raises``: the error type a ``raise``-mode epoch (or opening the dataset) gives, and
    ``names``: strings its message must contain (the culprit). ``delivered``: the keys a
    ``skip``-mode epoch delivers, and ``skipped`` the count it reports (``None``: opening the
    dataset fails in every mode). ``verify``: a regular expression that ``fastload verify``'s
    output (exit 1) matches.
    ``converted``: the keys a ``convert --on-error skip`` of the damaged dataset keeps (``None``:
    the conversion fails, as the dataset cannot be opened).
    """

    name: str
    formats: tuple[str, ...]
    damage: Callable[[Path, str], None]
    raises: type[Exception]
    names: tuple[str, ...]
    delivered: list[str] | None
    skipped: int
    verify: str
    converted: list[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def keys_except(*drop: str) -> list[str]:
    return [k for k in KEYS if k not in drop]


S0, S1 = "d-000000", "d-000001"
WDS, TFR, ALL3 = ("webdataset",), ("tfrecord",), ("webdataset", "tfrecord", "lmdb")
CASES = [
    # Indexes: damage is caught before use; the shard itself is intact, so skip keeps it all.
    Case("idx-line-replaced", WDS, idx_line_replaced, CorruptDataError, (S0, ".idx", "line 5"),
         KEYS, 0, "index differs", KEYS),
    Case("idx-line-replaced", TFR, idx_line_replaced, CorruptDataError, (S0, ".idx", "line 4"),
         KEYS, 0, "index differs", KEYS),
    Case("idx-line-dropped", WDS, idx_line_dropped, CorruptDataError,
         (S0, ".idx", "lists 7 samples", "says", "holds 8"), KEYS, 0, "index differs", KEYS),
    Case("idx-line-dropped", TFR, idx_line_dropped, CorruptDataError,
         (S0, ".idx", "covers bytes"), KEYS, 0, "index differs", KEYS),
    Case("idx-garbage", ("webdataset", "tfrecord"), idx_garbage, CorruptDataError, (S0, ".idx"),
         KEYS, 0, "index differs", KEYS),
    Case("idx-traversal-name", WDS, idx_traversal_name, CorruptDataError,
         (S0, ".idx", "../k03.bin", "'..' segment"), KEYS, 0, "index differs", KEYS),
    # Shards: skip exactly the damaged samples and keep the rest.
    Case("shard-truncated", ("webdataset", "tfrecord"), shard_truncated, CorruptDataError,
         (S1, "truncated"), KEYS[:12], 4, "truncated", KEYS[:12]),
    # LMDB loses what is on the pages past the cut: here the one leaf page of shard 1's samples
    Case("shard-truncated", ("lmdb",), shard_truncated, CorruptDataError, (S1, "truncated"),
         KEYS[:8], 8, "truncated", KEYS[:8]),
    Case("tar-header-checksum", WDS, header_checksum_flipped, CorruptDataError,
         (S0, "tar header"), keys_except("k05"), 1, "damaged sample",
         # streaming cannot tell whether the lost member belonged to k04 or k05: both go
         keys_except("k04", "k05")),
    Case("payload-crc", TFR, payload_flipped, CorruptDataError, (S0, "payload CRC", "record 5"),
         keys_except("k05"), 1, "SHA-256", keys_except("k05")),
    Case("length-crc", TFR, length_crc_flipped, CorruptDataError, (S0, "length CRC", "record 5"),
         keys_except("k05"), 1, "SHA-256", KEYS[:5] + KEYS[8:]),
    # Hostile tar members: one validation on every read path.
    Case("member-traversal", WDS, member_traversal, CorruptDataError, (S0, "../k03.bin", "'..'"),
         keys_except("k03"), 1, "damaged sample", keys_except("k03")),
    Case("member-absolute", WDS, member_absolute, CorruptDataError,
         (S0, "/abs/k03.bin", "absolute"), keys_except("k03"), 1, "damaged sample",
         keys_except("k03")),
    Case("member-reserved-field", WDS, member_reserved_field, CorruptDataError,
         (S0, "k03.__key__", "reserved"), keys_except("k03"), 1, "damaged sample",
         keys_except("k03")),
    Case("member-duplicate-field", WDS, member_duplicate_field, CorruptDataError,
         (S0, "'bin'",), keys_except("k03"), 1, "damaged sample", keys_except("k03")),
    # Manifests that lie.
    Case("manifest-count-exceeds", ALL3, manifest_count_exceeds, CorruptDataError,
         (S0, "10"), KEYS, 2,
         "holds 8 samples, the manifest says 10|manifest lists 10 samples for this shard, but "
         "the shard holds 8", KEYS),
    Case("manifest-count-short", ("webdataset", "tfrecord"), manifest_count_short,
         # the manifest is the dataset: what it leaves out is not part of it (a warning says so)
         CorruptDataError, (S1, "6"), KEYS[:14], 0, "holds 8 samples, the manifest says 6",
         KEYS[:14]),
    Case("manifest-absolute-name", WDS, manifest_absolute_name, ManifestError,
         ("fastload.json", "absolute", "fastload index"), None, 0, "absolute"),
    Case("manifest-escaping-name", WDS, manifest_escaping_name, ManifestError,
         ("fastload.json", "'..'"), None, 0, "'..'"),
    Case("manifest-duplicate-shard", WDS, manifest_duplicate_shard, ManifestError,
         ("fastload.json", "both name", S0), None, 0, "both name"),
    Case("manifest-unknown-format", WDS, manifest_unknown_format, ManifestError,
         ("fastload.json", "parquet-shards", "known: "), None, 0, "parquet-shards"),
    Case("manifest-negative-count", WDS, manifest_negative_count, ManifestError,
         ("fastload.json", "num_samples=-1"), None, 0, "num_samples=-1"),
    Case("manifest-truncated", WDS, manifest_truncated, ManifestError,
         ("fastload.json", "not valid JSON"), None, 0, "not valid JSON"),
    # A missing shard is a store error: never skipped, in any mode.
    # (convert --on-error skip lists the missing shard's samples in its skip report, exit 3)
    Case("shard-missing", WDS, shard_missing, ObjectNotFoundError, (S1,), None, 0,
         "shard is missing", KEYS[:8]),
]  # fmt: skip

PARAMS = [
    pytest.param(case, fmt, id=f"{case.name}-{fmt}") for case in CASES for fmt in case.formats
]


def epoch(root: Path, on_error: str) -> tuple[list[str], int]:
    """One epoch through a 2-worker DataLoader: the keys delivered (in order) and the skip count."""
    ds = fastload.open_dataset(root, shuffle=False, on_error=on_error)
    loader = fastload.DataLoader(ds, batch_size=3, num_workers=2)
    keys: list[str] = []
    for batch in loader:
        keys.extend(batch["__key__"])
    return keys, int(loader.stats()["skipped"])


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fastload.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("case", "fmt"), PARAMS)
def test_loader_raise(case: Case, fmt: str, tmp_path: Path) -> None:
    root = build(tmp_path / "ds", fmt)
    case.damage(root, fmt)
    if case.delivered is None and case.raises is ManifestError:  # opening the dataset fails
        with pytest.raises(case.raises) as info:
            epoch(root, "raise")
        message = str(info.value)
    else:  # a worker's error reaches the training loop as a WorkerError naming the original
        with pytest.raises(WorkerError) as info:
            epoch(root, "raise")
        message = str(info.value)
        assert f"{case.raises.__name__}: " in message, message
    for culprit in case.names:
        assert culprit in message, f"{culprit!r} not in {message!r}"
    if case.name.startswith(("shard-", "payload-", "length-")):  # `fastload index` cannot help
        assert "fastload index" not in message, message


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("case", "fmt"), PARAMS)
def test_loader_skip(case: Case, fmt: str, tmp_path: Path) -> None:
    root = build(tmp_path / "ds", fmt)
    case.damage(root, fmt)
    if case.delivered is None:
        with pytest.raises(ManifestError if case.raises is ManifestError else WorkerError):
            epoch(root, "skip")
        return
    keys, skipped = epoch(root, "skip")
    assert keys == case.delivered
    assert skipped == case.skipped


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("case", "fmt"), PARAMS)
def test_verify(case: Case, fmt: str, tmp_path: Path) -> None:
    root = build(tmp_path / "ds", fmt)
    case.damage(root, fmt)
    result = _cli("verify", str(root))
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert re.search(case.verify, out), out
    assert "Traceback" not in out, out


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("case", "fmt"), PARAMS)
def test_convert_skip(case: Case, fmt: str, tmp_path: Path) -> None:
    root = build(tmp_path / "ds", fmt)
    case.damage(root, fmt)
    dst = tmp_path / "out"
    if case.converted is None:
        with pytest.raises(FastloadError):
            fastload.convert(root, dst, format="webdataset", on_error="skip", quiet=True, workers=1)
        assert not (dst / "fastload.json").exists()
        return
    fastload.convert(root, dst, format="webdataset", on_error="skip", quiet=True, workers=1)
    ds = fastload.open_dataset(dst, shuffle=False)
    assert [ds.read_raw(*map(int, ds.locate(i)))["__key__"] for i in range(len(ds))] == (
        case.converted
    )


def test_intact_dataset_baseline(tmp_path: Path) -> None:
    """The undamaged corpus, for every format: all sixteen samples, nothing skipped, verify OK."""
    for fmt in ALL3:
        root = build(tmp_path / fmt, fmt)
        assert epoch(root, "raise") == (KEYS, 0)
        assert _cli("verify", str(root)).returncode == 0
