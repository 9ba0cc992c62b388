"""The conversion sources by name (:data:`SOURCES`), and how a corpus's type is told.

:func:`open_source` opens a directory, store URL or single file as a :class:`Source`, of the type
asked for or the one :func:`detect_source_type` finds (see ``fastload/convert/README.md``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from fastload._plugins import PluginRegistry
from fastload.convert._progress import plural
from fastload.convert.sources._arrow import (
    ARROW_EXTENSIONS,
    ArrowBackedDataset,
    ArrowSource,
    HuggingFaceSource,
    arrow_files_of,
    hf_dataset_dict_error,
    is_hf_saved_dataset,
)
from fastload.convert.sources._base import (
    Source,
    few,
    file_extension,
    image_depth,
    key_stem,
    list_visible,
)
from fastload.convert.sources._files import FileTreeSource, ImageFolderSource
from fastload.convert.sources._records import JsonlSource, TextSource
from fastload.convert.sources._shards import ShardSource
from fastload.convert.sources._tables import CsvSource, ParquetSource
from fastload.convert.sources._tree import walk_tree
from fastload.errors import InvalidArgumentError, MissingDependencyError, ObjectNotFoundError
from fastload.formats import FORMATS, ShardNames
from fastload.formats.manifest import MANIFEST_NAME
from fastload.storage import ObjectMeta, Store, open_store

__all__ = [
    "IMAGE_FOLDER_STRAYS",
    "IMAGE_FOLDER_STRAY_FRACTION",
    "SOURCES",
    "detect_source_type",
    "open_source",
]

_JSONL_EXT = frozenset({"jsonl", "ndjson"})
_TEXT_EXT = frozenset({"txt"})
_CSV_EXT = frozenset({"csv"})
_PARQUET_EXT = frozenset({"parquet", "pq"})
_RECORD_EXT = _JSONL_EXT | _TEXT_EXT | _CSV_EXT | _PARQUET_EXT | ARROW_EXTENSIONS


SOURCES = PluginRegistry(
    "conversion source",
    "fastload.convert.sources",
    "Pass one of these as source_type=... or --source-type.",
)
SOURCES.register("imagefolder", ImageFolderSource, aliases=("image-folder", "images"))
SOURCES.register("files", FileTreeSource, aliases=("filetree", "file-tree", "tree"))
SOURCES.register("jsonl", JsonlSource, aliases=("json", "ndjson"))
SOURCES.register("text", TextSource, aliases=("txt", "lines"))
# CSV and Parquet are read with pyarrow (``fastload[parquet]``): a missing pyarrow is one
# MissingDependencyError when the source is opened, never an error per file or record.
SOURCES.register("csv", CsvSource, extra="parquet", modules=("pyarrow",))
SOURCES.register("parquet", ParquetSource, extra="parquet", modules=("pyarrow",), aliases=("pq",))
SOURCES.register(
    "arrow", ArrowSource, extra="parquet", modules=("pyarrow",), aliases=("feather", "ipc")
)
SOURCES.register(
    "huggingface",
    HuggingFaceSource,
    extra="parquet",
    modules=("pyarrow",),
    aliases=("hf", "hf-datasets", "datasets"),
)
SOURCES.register("shards", ShardSource, aliases=("webdataset", "wds", "tfrecord", "lmdb"))

_RECORD_TYPES = (
    (_JSONL_EXT, "jsonl"),
    (_TEXT_EXT, "text"),
    (_CSV_EXT, "csv"),
    (_PARQUET_EXT, "parquet"),
    (ARROW_EXTENSIONS, "arrow"),
)


#: How many files that are not images an image folder may hold and still be detected as one:
#: :data:`IMAGE_FOLDER_STRAYS` files, or :data:`IMAGE_FOLDER_STRAY_FRACTION` of its files if that
#: is more (``README.txt``, ``Thumbs.db``, ``labels.csv``, ...; they are left out and named).
IMAGE_FOLDER_STRAYS = 3
IMAGE_FOLDER_STRAY_FRACTION = 0.1


def _not_an_image_folder(names: Sequence[str], depth: int) -> str | None:
    """Why ``names`` do not make an image folder whose images are ``depth`` directories deep, or
    ``None`` if they do (see :func:`detect_source_type`)."""
    images = [n for n in names if image_depth(n) == depth]
    if not images:
        deep = {1: "one directory", 2: "two directories"}.get(depth, f"{depth} directories")
        return f"no image is {deep} deep"
    stems = {key_stem(n) for n in images}
    image_set = set(images)
    others = [n for n in names if n not in image_set]
    paired = [n for n in others if key_stem(n) in stems]
    if paired:
        return (
            f"{plural(len(paired), 'file')} such as {few(paired, 3)} share the name of an image "
            "beside them, which makes samples of several fields"
        )
    allowed = max(IMAGE_FOLDER_STRAYS, int(len(names) * IMAGE_FOLDER_STRAY_FRACTION))
    if len(others) > allowed:
        return (
            f"{len(others)} of its {len(names)} files are not images inside a class directory "
            f"(such as {few(others, 3)}); an image folder may hold at most {allowed} such files"
        )
    return None


def _detect(
    store: Store,
    keys: Sequence[str] | None,
    listing: Sequence[ObjectMeta] | None,
    where: str | None = None,
) -> tuple[str, list[str]]:
    """The source type of a corpus and the warnings that go with the guess (see
    :func:`detect_source_type`). ``where`` names the corpus in warnings (default: its URL)."""
    if keys is None and store.exists(MANIFEST_NAME):
        return "shards", []
    if keys is not None:
        names = list(keys)
    else:
        names = [m.key for m in (listing if listing is not None else list_visible(store))]
    if not names:
        raise InvalidArgumentError(
            f"no input files in {store.url} (empty input; hidden files are ignored)"
        )
    dataset_dict = (
        hf_dataset_dict_error(store, where or store.url)
        if keys is None and "dataset_dict.json" in names
        else None
    )
    if dataset_dict is not None:
        raise dataset_dict
    if keys is None and is_hf_saved_dataset(names):
        return "huggingface", []
    exts = {file_extension(n) for n in names}
    for family, name in _RECORD_TYPES:
        if exts <= family:
            return name, []
    shard_names = [n for n in names if file_extension(n) != "idx"]
    shard_formats = ShardNames.from_registry()
    if shard_names and all(shard_formats.format_of(n) is not None for n in shard_names):
        return "shards", []
    why = _not_an_image_folder(names, 1)
    if why is None:
        return "imagefolder", []
    where = where or store.url
    n_images = sum(image_depth(n) is not None for n in names)
    if 2 * n_images <= len(names):  # not mostly images: a file tree, nothing to say
        return "files", []
    if _not_an_image_folder(names, 2) is None:
        raise _image_folders_inside(where, names)
    if not any(image_depth(n) == 1 for n in names):  # a flat or deeper tree: files, clearly
        return "files", []
    return "files", [
        f"{where} is taken as a file tree (source type files), so its samples get no class "
        f"label: {n_images} of its {plural(len(names), 'file')} "
        f"{'is an image' if n_images == 1 else 'are images'}, but it is not an image folder "
        f"(root/<class>/<image>) because {why}. Pass --source-type imagefolder "
        "(source_type='imagefolder') to convert it as an image folder with a class label per "
        "image (the other files are then left out and named), or --source-type files to keep it "
        "a file tree without this warning"
    ]


def _image_folders_inside(where: str, names: Sequence[str]) -> InvalidArgumentError:
    """The error of a tree whose images are all two directories deep (``root/train/<class>/``,
    ``root/val/<class>/``): image folders one level down, which converting the tree whole would
    mix, without class labels (issue 29)."""
    example = next(n for n in names if image_depth(n) == 2)
    splits = sorted({n.split("/")[0] for n in names if image_depth(n) == 2})
    root = where.rstrip("/")
    each = " and ".join(f"fastload convert {root}/{s} DST/{s}" for s in splits[:2])
    more = f" (and the same for {few(splits[2:])})" if len(splits) > 2 else ""
    return InvalidArgumentError(
        f"{root} holds {plural(len(splits), 'image folder')} one level down ({few(splits)}: its "
        f"images are two directories deep, such as {example}), so its type is ambiguous: "
        "converted whole, it would mix them in one dataset without class labels. Convert each "
        f"one as an image folder, with a class label per image: {each}{more}; or pass "
        "--source-type files (source_type='files') to convert the whole tree as files keyed by "
        "path, without labels"
    )


def detect_source_type(
    store: Store, keys: Sequence[str] | None = None, listing: Sequence[ObjectMeta] | None = None
) -> str:
    """Guess the source type of a corpus (see ``fastload/convert/README.md``).

    Order: a ``fastload.json`` → ``shards``; a Hugging Face ``save_to_disk`` directory
    (``state.json``, ``dataset_info.json``, ``data-*.arrow``) → ``huggingface``; all files JSONL /
    text / CSV / Parquet / Arrow (``.arrow``, ``.feather``, ``.ipc``) → that type;
    all files shards (``.tar``, ``.tfrecord`` also compressed as ``.tfrecord.gz``/``.zz``,
    ``.lmdb``) → ``shards``; images (by extension) exactly one directory deep, with at most
    :data:`IMAGE_FOLDER_STRAYS` other files or :data:`IMAGE_FOLDER_STRAY_FRACTION` of the files
    (whichever is more) and no other file named like an image beside it (``x.jpg`` +
    ``x.json`` is one sample of two fields) → ``imagefolder``; anything else → ``files``.
    :func:`open_source` also warns when a tree of mostly images falls back to ``files``.

    Raises:
        InvalidArgumentError: The corpus is empty, or is a Hugging Face ``DatasetDict`` saved
            with ``save_to_disk`` (the message names the splits), or its images are all two
            directories deep
            (``root/train/<class>/<image>``, ``root/val/...``): image folders one level down,
            which only ``source_type="files"`` converts whole (the message says so).
    """
    return _detect(store, keys, listing)[0]


def open_source(
    src: str | os.PathLike[str] | ArrowBackedDataset,
    *,
    source_type: str | None = None,
    store_options: Mapping[str, Any] | None = None,
) -> Source:
    """Open ``src`` (a directory / prefix URL, or one file) as a :class:`Source`.

    A local path naming a file, or a URL whose last segment has a known record or shard extension,
    is a one-file corpus read from its parent directory. ``src`` may also be a
    ``datasets.Dataset`` backed by arrow files (``cache_files``): those files, in order, are read
    as source type ``arrow`` (an in-memory dataset is refused: save it with ``save_to_disk``).

    Raises:
        InvalidArgumentError: Unknown ``source_type``, empty corpus, a tree of image folders
            one level down without ``source_type`` (see :func:`detect_source_type`), a Hugging
            Face ``DatasetDict`` (directory or object), or a ``datasets.Dataset`` that is not
            its arrow files as they are (held in memory, an indices mapping, columns changed).
        MissingDependencyError: The source type needs an optional package that is not installed
            (CSV and Parquet: pyarrow, ``pip install 'fastload[parquet]'``).
        ObjectNotFoundError: ``src`` does not exist.
    """
    if not isinstance(src, (str, os.PathLike)):
        return _open_dataset_object(src, source_type, store_options)
    text = os.fspath(src)
    options = dict(store_options or {})
    keys: list[str] | None = None
    if "://" not in text:
        if os.path.isfile(text):
            parent, base = os.path.split(os.path.abspath(text))
            store, keys = open_store(parent, **options), [base]
        elif os.path.isdir(text):
            store = open_store(text, **options)
        else:
            raise ObjectNotFoundError(f"conversion source {text!r} does not exist", url=text)
    else:
        base = text.rstrip("/").rsplit("/", 1)[-1]
        one_file = file_extension(base) in _RECORD_EXT or (
            ShardNames.from_registry().format_of(base) is not None
        )
        if not text.endswith("/") and one_file:
            store, keys = open_store(text.rstrip("/").rsplit("/", 1)[0], **options), [base]
            if not store.exists(base):
                raise ObjectNotFoundError(f"conversion source {text} does not exist", url=text)
        else:
            store = open_store(text, **options)
    tree = walk_tree(store) if keys is None else None
    listing = tree.unique() if tree is not None else None
    warnings: list[str] = []
    if source_type:
        name = source_type
    else:
        name, warnings = _detect(store, keys, listing, where=text)
    try:
        cls = SOURCES.load(name)
    except MissingDependencyError as exc:
        exc.add_note(f"(converting {text} as source type {SOURCES.canonical(name)})")
        raise
    canonical = SOURCES.canonical(name)
    hf_dict = hf_dataset_dict_error(store, text) if canonical == "huggingface" else None
    if hf_dict is not None and keys is None:
        raise hf_dict  # asked for a split's type: say where the splits are
    extra: dict[str, Any] = {}
    if cls is ShardSource and canonical == "shards" and name.lower() != canonical:
        # The source type names a format (``--source-type wds``): the shards' format.
        extra["format"] = FORMATS.canonical(name)
    source: Source = cls(store, keys, **extra)
    if tree is not None:
        source.adopt_tree(tree)
    source.warnings.extend(warnings)
    return source


def _open_dataset_object(
    dataset: ArrowBackedDataset, source_type: str | None, store_options: Mapping[str, Any] | None
) -> Source:
    """The source of a ``datasets.Dataset`` object: its arrow cache files, in order."""
    files = getattr(dataset, "cache_files", None)
    if files is None:
        raise InvalidArgumentError(
            f"cannot convert a {type(dataset).__name__}: the source must be a path, a store URL "
            "or a datasets.Dataset backed by arrow files (cache_files)"
        )
    if isinstance(files, Mapping):  # a DatasetDict: {split: [files]}
        raise InvalidArgumentError(
            f"cannot convert a {type(dataset).__name__} of {plural(len(files), 'split')} "
            f"({few([str(s) for s in files])}) as one dataset: pass one split "
            "(dataset['train']), or convert each"
        )
    if source_type and SOURCES.canonical(source_type) not in ("arrow", "huggingface"):
        raise InvalidArgumentError(
            f"a {type(dataset).__name__} object is read as source type arrow, not "
            f"{source_type!r}; leave source_type out"
        )
    root, keys = arrow_files_of(dataset)
    return ArrowSource(open_store(root, **dict(store_options or {})), keys)
