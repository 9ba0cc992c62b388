"""The manifest loader refuses manifests that lie or point outside the dataset, naming the entry."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fastload.errors import ManifestError, UnsupportedManifestVersionError
from fastload.formats import Manifest, ShardEntry

URL = "file:///data/ds/fastload.json"
SHA = "ab" * 32


def doc(**changes: Any) -> dict[str, Any]:
    shards = [
        {"name": "a-000000.tar", "num_samples": 3, "num_bytes": 10, "sha256": SHA,
         "index": "a-000000.tar.idx"},
        {"name": "sub/a-000001.tar", "num_samples": 2, "num_bytes": 7, "sha256": SHA},
    ]  # fmt: skip
    out: dict[str, Any] = {"fastload_manifest": 1, "format": "webdataset", "shards": shards}
    out.update(changes)
    return out


def with_shard(i: int, **changes: Any) -> dict[str, Any]:
    d = doc()
    d["shards"][i].update(changes)
    return d


def test_valid_manifest_round_trips() -> None:
    manifest = Manifest.from_json(json.dumps(doc()), url=URL)
    assert manifest.shards[1] == ShardEntry("sub/a-000001.tar", 2, 7, SHA, None)
    assert Manifest.from_json(manifest.to_json(), url=URL).to_json() == manifest.to_json()


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (with_shard(1, name="/abs/a.tar"), "shard entry 1: name '/abs/a.tar' is an absolute path"),
        (with_shard(1, name="../x/a.tar"), r"shard entry 1: name '\.\./x/a\.tar' escapes"),
        (with_shard(1, name="a/../../b.tar"), "escapes the dataset root"),
        (with_shard(1, name="a//b.tar"), "empty or '.' path segment"),
        (with_shard(1, name=""), "is empty"),
        (with_shard(1, name=7), "name=7; it must be a string"),
        (with_shard(0, index="/etc/passwd"), "index '/etc/passwd' is an absolute path"),
        (with_shard(0, num_samples=-1), "shard entry 0 has num_samples=-1"),
        (with_shard(0, num_samples=True), "num_samples=True"),
        (with_shard(0, num_samples="3"), "num_samples='3'"),
        (with_shard(0, num_bytes=2.5), "num_bytes=2.5"),
        (with_shard(0, sha256="xyz"), "sha256='xyz'; it must be 64 lower-case hex"),
        (with_shard(1, name="a-000000.tar"), "shard entries 0 and 1 both name 'a-000000.tar'"),
        (with_shard(1, index="a-000000.tar.idx"), "both name 'a-000000.tar.idx'"),
        (doc(num_samples=6), "num_samples=6 but its shards add up to 5"),
        (doc(num_bytes=1), "num_bytes=1 but its shards add up to 17"),
        (doc(format=""), "'format' must be a format name"),
        (doc(shards={}), "no 'shards' list"),
        ({**doc(), "shards": [1]}, "shard entry 0 is not an object"),
        ({**doc(), "shards": [{"name": "a.tar"}]}, "shard entry 0 has no 'num_samples'"),
    ],
)
def test_lying_manifests_are_refused(bad: dict[str, Any], message: str) -> None:
    with pytest.raises(ManifestError, match=message) as ei:
        Manifest.from_json(json.dumps(bad), url=URL)
    assert ei.value.url == URL
    # the remedy names the dataset root, and works (index rebuilds a manifest that is moved aside)
    assert "`fastload index file:///data/ds`" in str(ei.value)


def test_not_json_and_newer_versions() -> None:
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.from_json(b'{"fastload_manifest": 1, "form', url=URL)
    with pytest.raises(UnsupportedManifestVersionError, match="upgrade fastload"):
        Manifest.from_json(json.dumps(doc(fastload_manifest=99)), url=URL)


def test_unknown_format_names_the_manifest() -> None:
    manifest = Manifest.from_json(json.dumps(doc(format="zarrshards")), url=URL)
    with pytest.raises(ManifestError, match="names shard format 'zarrshards'") as ei:
        manifest.resolve_format(url=URL)
    assert "known: " in str(ei.value)  # the registered formats (tests may register more)
    assert "lmdb, tfrecord, webdataset" in str(ei.value)
    assert URL in str(ei.value)
    assert "format=..." not in str(ei.value)  # open_dataset has no such option
