"""File sources: samples made of whole files (an image folder, any file tree)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from fastload.convert._progress import plural
from fastload.convert.sources._base import (
    PlanReporter,
    Source,
    Unit,
    few,
    field_from_extension,
    file_extension,
    image_depth,
    key_stem,
    sanitize_key,
)
from fastload.errors import FastloadError, InvalidArgumentError
from fastload.formats import KEY, validate_field_name
from fastload.formats.manifest import IMAGE_EXTENSIONS

__all__ = ["FileTreeSource", "ImageFolderSource"]


class _FileSource(Source):
    """Units are samples made of whole files; ``ref = (key, cls or None, ((field, file key), ...))``."""

    def read_units(
        self, units: Sequence[Unit]
    ) -> Iterator[tuple[Unit, dict[str, Any] | Exception]]:
        for unit in units:
            key, cls, files = unit.ref
            sample: dict[str, Any] = {KEY: key}
            try:
                for field, file_key in files:
                    sample[field] = self.store.get(file_key)
            except (OSError, FastloadError) as exc:
                yield unit, exc
                continue
            if cls is not None:
                sample["cls"] = str(cls).encode("ascii")
            yield unit, sample


class ImageFolderSource(_FileSource):
    """``root/<class>/<image>``: one sample per image, its bytes as they are.

    Fields: the file's extension lower-cased (``jpeg`` → ``jpg``), and ``cls`` = the index of the
    class directory among all class directories (those holding an image) sorted by name. Key:
    ``<class>/<file stem>``, sanitized. The manifest metadata gets ``{"classes": [name, ...]}``
    (index order). Files that are not images (``README.txt``, ``Thumbs.db``, ``labels.csv``,
    anywhere in the tree) are left out, counted in :attr:`Source.ignored` and named in a
    warning. Empty images and images not exactly one directory deep are item errors (skippable).
    A folder holding no image at all (say ``root/<class>/<clip>.wav``) takes every file one
    directory deep as a sample.
    """

    type_name = "imagefolder"

    def plan_units(self, report: PlanReporter) -> list[Unit]:
        entries = self.listing(report)
        has_images = any(image_depth(m.key) == 1 for m in entries)
        candidates = [
            m for m in entries if not has_images or file_extension(m.key) in IMAGE_EXTENSIONS
        ]
        self.ignored = [
            m.key for m in entries if has_images and file_extension(m.key) not in IMAGE_EXTENSIONS
        ]
        if self.ignored:
            self._warn(
                f"left out {plural(len(self.ignored), 'file')} of {self.store.url} that "
                f"{'is not an image' if len(self.ignored) == 1 else 'are not images'}: "
                f"{few(self.ignored)}. An image folder's samples are its images "
                f"(extensions {', '.join(sorted(IMAGE_EXTENSIONS))}); pass --source-type files "
                "(source_type='files') to convert every file instead"
            )
        classes = sorted({m.key.split("/")[0] for m in candidates if m.key.count("/") == 1})
        index = {name: i for i, name in enumerate(classes)}
        self._metadata = {"classes": classes}
        units: list[Unit] = []
        seen: dict[str, str] = {}
        for meta in candidates:
            if meta.key.count("/") != 1:
                report(meta.key, "not inside a class directory (expected root/<class>/<file>)")
                continue
            cls_name = meta.key.split("/")[0]
            ext = file_extension(meta.key)
            if not ext:
                report(meta.key, "has no file extension to name its field")
                continue
            if meta.size == 0:
                report(meta.key, "is an empty file (0 bytes)")
                continue
            key = sanitize_key(key_stem(meta.key))
            if key in seen:
                report(meta.key, f"maps to sample key {key!r}, already taken by {seen[key]!r}")
                continue
            seen[key] = meta.key
            field = field_from_extension(ext)
            units.append(Unit(meta.key, (key, index[cls_name], ((field, meta.key),)), meta.size, 2))
        return units


class FileTreeSource(_FileSource):
    """Any directory tree: files grouped into samples by path without extension.

    ``a/b/x.jpg`` + ``a/b/x.json`` → key ``a/b/x`` with fields ``jpg`` and ``json``. The extension is
    the part after the **last** dot, lower-cased (``jpeg`` → ``jpg``); dots left in the file stem
    become ``_`` in the key. Two files giving the same key and field, files without an
    extension and empty image files are errors (skippable). A sample made of the same files as
    an earlier one (reached through symbolic or hard links) is a duplicate, left out and
    reported; a file shared by samples that differ otherwise stays in each.
    """

    type_name = "files"

    def plan_units(self, report: PlanReporter) -> list[Unit]:
        tree = self.tree()
        same = tree.duplicate_of if tree is not None else {}
        objects = tree.objects if tree is not None else self.listing(report)
        groups: dict[str, dict[str, str]] = {}
        sizes: dict[str, int] = {}
        errors: list[tuple[str, str]] = []
        for meta in objects:
            ext = file_extension(meta.key)
            if not ext:
                errors.append((meta.key, "has no file extension to name its field"))
                continue
            if meta.size == 0 and ext in IMAGE_EXTENSIONS:
                errors.append((meta.key, "is an empty image file (0 bytes)"))
                continue
            field = field_from_extension(ext)
            key = sanitize_key(key_stem(meta.key))
            fields = groups.setdefault(key, {})
            if field in fields:
                taken = f"already taken by {fields[field]!r}"
                errors.append((meta.key, f"maps to sample key {key!r} field {field!r}, {taken}"))
                continue
            try:
                validate_field_name(field)
            except InvalidArgumentError as exc:
                errors.append((meta.key, str(exc)))
                continue
            fields[field] = meta.key
            sizes[key] = sizes.get(key, 0) + meta.size
        # A sample made of the same files as another is a duplicate: the one kept is made of the
        # files' kept paths (their own paths inside the root), else the first in sorted order.
        # A file shared by samples that differ otherwise (a sidecar linked beside several
        # images) stays in each.
        samples = {key: tuple(sorted(fields.items())) for key, fields in groups.items() if fields}
        kept: dict[tuple[tuple[str, str], ...], str] = {}
        if same:
            for key in sorted(samples):
                made_of = tuple((f, same.get(path, path)) for f, path in samples[key])
                if made_of not in kept or not any(path in same for _, path in samples[key]):
                    kept[made_of] = key  # the first, or the one of the files' own paths
        duplicates: dict[str, str] = {}
        units = []
        for key in sorted(samples):
            files = samples[key]
            if same:
                first = kept[tuple((f, same.get(path, path)) for f, path in files)]
                if first != key:
                    theirs = dict(samples[first])
                    duplicates.update((path, theirs[f]) for f, path in files)
                    continue
            units.append(Unit(files[0][1], (key, None, files), sizes[key], len(files)))
        # What the walk left out first, sorted by path (as every source reports it), then the
        # files that make no sample, in sorted order.
        if tree is not None:
            self._report_tree(tree, report, duplicates)
        for item, reason in errors:
            report(item, reason)
        return units
