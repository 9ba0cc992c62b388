"""Fixtures for the conversion tests: corpora generators and a tiny in-test shard format.

The ``fake`` format (length-prefixed msgpack records, an offsets index) is registered so the
conversion machinery is tested independently of the real formats; every test that matters also
runs against the real ``webdataset``, ``tfrecord`` and ``lmdb`` formats.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import msgpack
import pytest

from fastload.errors import CorruptDataError
from fastload.formats import get_format, read_manifest
from fastload.formats._base import FORMATS, Format, ShardInfo, ShardReader, ShardWriter
from fastload.formats._sample import encode_sample
from fastload.storage import Store, open_store

_MAGIC = b"FAKESHRD"


class FakeWriter(ShardWriter):
    def __init__(self, store: Store, key: str, *, index: bool = True) -> None:
        super().__init__(store, key, index=index)
        self._out = store.open_writer(key)
        self._out.write(_MAGIC)
        self._sha = hashlib.sha256(_MAGIC)
        self._offsets: list[int] = []

    def write(self, sample: Mapping[str, Any]) -> None:
        enc = encode_sample(sample)
        self._count_fields(enc)
        body = msgpack.packb(enc, use_bin_type=True)
        self._offsets.append(self._out.tell())
        data = struct.pack("<Q", len(body)) + body
        self._out.write(data)
        self._sha.update(data)

    @property
    def num_bytes(self) -> int:
        return self._out.tell()

    def close(self) -> ShardInfo:
        size = self._out.tell()
        self._out.commit()
        index_key = None
        if self.write_index:
            index_key = self.key + ".idx"
            self.store.put(index_key, _index_bytes(self._offsets))
        return ShardInfo(
            self.key, self.num_samples, size, self._sha.hexdigest(), index_key, dict(self.fields)
        )

    def abort(self) -> None:
        self._out.abort()


def _index_bytes(offsets: list[int]) -> bytes:
    return "".join(f"{o}\n" for o in offsets).encode()


class FakeReader(ShardReader):
    def __iter__(self) -> Iterator[dict[str, Any]]:
        data = self.store.get(self.key)
        if not data.startswith(_MAGIC):
            raise CorruptDataError("not a fake shard", url=self.url, offset=0)
        pos, i = len(_MAGIC), 0
        while pos < len(data):
            if pos + 8 > len(data):
                raise CorruptDataError("truncated", url=self.url, offset=pos)
            (n,) = struct.unpack_from("<Q", data, pos)
            body = data[pos + 8 : pos + 8 + n]
            if len(body) != n:
                raise CorruptDataError("truncated", url=self.url, offset=pos)
            sample = msgpack.unpackb(body, raw=False)
            sample["__url__"], sample["__index__"] = self.url, i
            yield sample
            pos += 8 + n
            i += 1


def _build_index(store: Store, key: str) -> bytes:
    data = store.get(key)
    pos, offsets = len(_MAGIC), []
    while pos < len(data):
        offsets.append(pos)
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + n
    return _index_bytes(offsets)


FAKE = Format(
    "fake", "fake", FakeWriter, FakeReader, _build_index, lambda head: head.startswith(_MAGIC)
)
FORMATS.register("fake", FAKE)


def real_formats() -> list[str]:
    """The three real formats; one that fails to import fails the tests instead of hiding."""
    names = ["webdataset", "tfrecord", "lmdb"]
    for name in names:
        get_format(name)
    return names


ALL_FORMATS = ["fake", *real_formats()]


def read_dataset(url: str | os.PathLike[str]) -> dict[str, dict[str, bytes]]:
    """Every sample of a dataset, key → fields, read with the format's reader."""
    store = open_store(url)
    manifest = read_manifest(store)
    fmt = get_format(manifest.format)
    out: dict[str, dict[str, bytes]] = {}
    for entry in manifest.shards:
        with fmt.reader(store, entry.name) as reader:
            for sample in reader:
                key = sample["__key__"]
                assert key not in out, f"duplicate key {key}"
                out[key] = {k: bytes(v) for k, v in sample.items() if not k.startswith("__")}
    return out


def ordered_keys(url: str | os.PathLike[str]) -> list[str]:
    store = open_store(url)
    manifest = read_manifest(store)
    fmt = get_format(manifest.format)
    keys = []
    for entry in manifest.shards:
        with fmt.reader(store, entry.name) as reader:
            keys.extend(s["__key__"] for s in reader)
    return keys


def tree_bytes(root: str | os.PathLike[str]) -> dict[str, bytes]:
    """Relative path → bytes of every file under ``root``, the local store's hidden temporary
    files included (a conversion removes those that killed writers left)."""
    out = {}
    base = Path(root)
    for path in sorted(base.rglob("*")):
        if path.is_file():
            out[str(path.relative_to(base))] = path.read_bytes()
    return out


def make_image_folder(
    root: Path, classes: int = 3, per_class: int = 7, seed: int = 0
) -> dict[str, dict[str, bytes]]:
    """``root/<class>/<n>.jpg`` (random bytes; conversion never decodes); returns expected samples."""
    rng = random.Random(seed)
    expected = {}
    names = [f"class{c:02d}" for c in range(classes)]
    for ci, name in enumerate(names):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            data = rng.randbytes(rng.randint(50, 3000))
            ext = "jpeg" if i % 3 == 2 else "jpg"
            (root / name / f"im.{i:03d}.{ext}").write_bytes(data)
            expected[f"{name}/im_{i:03d}"] = {"jpg": data, "cls": str(ci).encode()}
    return expected


@pytest.fixture
def image_folder(tmp_path: Path) -> tuple[Path, dict[str, dict[str, bytes]]]:
    root = tmp_path / "images"
    return root, make_image_folder(root)


def write_jsonl(path: Path, records: list[Any]) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


def kill_hook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str) -> tuple[str, Path]:
    """A ``--map`` hook that SIGKILLs its worker on the sample ``key`` while a marker file exists:
    ``(map spec, marker path)``; the marker does not exist yet."""
    module = f"hooks_kill_{abs(hash((str(tmp_path), key))):x}"
    (tmp_path / f"{module}.py").write_text(
        "import os, signal\n"
        "def kill_once(sample):\n"
        f"    if sample['__key__'] == {key!r} and os.path.exists(\n"
        "        os.environ['FASTLOAD_TEST_KILL_MARKER']\n"
        "    ):\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return sample\n"
    )
    marker = tmp_path / "kill-marker"
    monkeypatch.setenv("FASTLOAD_TEST_KILL_MARKER", str(marker))
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{module}:kill_once", marker


class Helpers:
    """Helper functions, handed to tests as the ``cv`` fixture (conftest modules are not importable
    under ``--import-mode=importlib``)."""

    read_dataset = staticmethod(read_dataset)
    ordered_keys = staticmethod(ordered_keys)
    tree_bytes = staticmethod(tree_bytes)
    make_image_folder = staticmethod(make_image_folder)
    write_jsonl = staticmethod(write_jsonl)
    kill_hook = staticmethod(kill_hook)
    real_formats = staticmethod(real_formats)
    ALL_FORMATS = ALL_FORMATS


@pytest.fixture
def cv() -> type[Helpers]:
    return Helpers


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # ``fmt``: every format, the in-test ``fake`` one included (in-process conversions only: worker
    # processes cannot import a format defined in a conftest). ``real_fmt``: the shipped formats.
    if "fmt" in metafunc.fixturenames:
        metafunc.parametrize("fmt", ALL_FORMATS)
    if "real_fmt" in metafunc.fixturenames:
        metafunc.parametrize("real_fmt", real_formats() or ["webdataset"])
