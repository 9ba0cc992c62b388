"""open_dataset checks what it can before any worker starts: field selections, decode spellings."""

from __future__ import annotations

from pathlib import Path

import pytest

import fastload
from fastload.errors import InvalidArgumentError
from fastload.formats import Manifest, ShardEntry, get_format, write_manifest
from fastload.storage import open_store


def make(root: Path) -> Path:
    store = open_store(root)
    writer = get_format("webdataset").writer(store, "d-000000.tar")
    for i in range(4):
        writer.write({"__key__": f"k{i}", "jpg": b"\xff\xd8" + bytes([i]), "cls": i})
    info = writer.close()
    write_manifest(
        store,
        Manifest(
            format="webdataset",
            shards=[ShardEntry.from_info(info)],
            schema=Manifest.schema_from_fields([info.fields]),
        ),
    )
    return root


def test_unknown_field_is_refused_up_front_with_a_suggestion(tmp_path: Path) -> None:
    root = make(tmp_path)
    with pytest.raises(InvalidArgumentError, match=r"asks for 'jgp'.*did you mean 'jpg'") as ei:
        fastload.open_dataset(root, fields=("jgp", "cls"))
    assert "['cls', 'jpg']" in str(ei.value)
    with pytest.raises(InvalidArgumentError, match="asks for 'png;webp'"):
        fastload.open_dataset(root, fields=("png;webp",))
    # alternatives, metadata and known fields are fine
    ds = fastload.open_dataset(root, shuffle=False, fields=("png;jpg", "cls", "__key__"))
    assert ds[1] == (b"\xff\xd8\x01", b"1", "k1")


def test_fields_made_by_a_transform_are_not_checked(tmp_path: Path) -> None:
    def add_image(sample: dict[str, object]) -> dict[str, object]:
        return {**sample, "image": sample["jpg"]}

    ds = fastload.open_dataset(
        make(tmp_path), shuffle=False, transform=add_image, fields=("image", "cls")
    )
    assert ds[0] == (b"\xff\xd8\x00", b"0")


def test_decode_false_means_no_decoding(tmp_path: Path) -> None:
    ds = fastload.open_dataset(make(tmp_path), shuffle=False, decode=False)
    assert ds.decode is None
    assert ds[2]["jpg"] == b"\xff\xd8\x02"
