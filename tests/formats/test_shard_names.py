"""Shard names come from the format registry: ``Format.extension`` and ``source_extensions``."""

from __future__ import annotations

import pytest

from fastload.formats import Format, get_format
from fastload.formats._base import FORMATS
from fastload.formats._names import ShardNames

if "fake" not in FORMATS.names():
    # tests/convert's and tests/loader's conftests register a test format "fake" (as a third
    # party would); when only this directory runs, register a stand-in with the same extension.
    _wds = get_format("webdataset")
    FORMATS.register("fake", Format("fake", "fake", _wds.writer, _wds.reader))


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("x.tar", "webdataset"),
        ("a/b/X.TAR", "webdataset"),
        ("x.tar.gz", "webdataset"),
        ("x.tgz", "webdataset"),
        ("x.tar.bz2", "webdataset"),
        ("x.tbz2", "webdataset"),
        ("x.txz", "webdataset"),
        ("x.tfrecord", "tfrecord"),
        ("x.tfrecords", "tfrecord"),
        ("x.tfrecord.gz", "tfrecord"),
        ("x.tfrecords.zlib", "tfrecord"),
        ("x.tfrecord.zz", "tfrecord"),
        ("x.lmdb", "lmdb"),
        ("x.fake", "fake"),  # the test format of conftest.py, registered like a third party's
        # Not shards: compression without a shard suffix before it, or nothing before the suffix.
        ("x.gz", None),
        ("x.foo.gz", None),
        ("x.tar.gzip", None),
        ("x.tgz.gz", None),
        ("x.tfrecord.bz2", None),
        ("tar.gz", None),
        ("tar", None),
        ("x.tar.idx", None),
        ("x.jpg", None),
    ],
)
def test_format_of_a_name(name: str, expected: str | None) -> None:
    assert ShardNames.from_registry().format_of(name) == expected


def test_extensions_are_those_of_the_registered_formats() -> None:
    extensions = ShardNames.from_registry().extensions()
    assert extensions == sorted(extensions)
    assert {"fake", "lmdb", "tar", "tfrecord"} <= set(extensions)


def test_source_extensions_default_to_the_extension_and_first_format_wins() -> None:
    wds = get_format("webdataset")
    plain = Format("plain", "pln", wds.writer, wds.reader)
    assert plain.source_extensions == ("pln",)
    rival = Format("rival", "tar", wds.writer, wds.reader, source_extensions=("tar", "rvl"))
    names = ShardNames([wds, rival, plain])
    assert names.format_of("x.tar") == "webdataset"
    assert names.format_of("x.rvl") == "rival"
    assert names.format_of("x.pln") == "plain"
    assert names.extensions() == ["pln", "tar"]
