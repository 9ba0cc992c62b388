"""The one walk of a source tree: every real directory and file once, symbolic links followed.

Every file-tree source (image folders, file trees, the files of record and shard sources) and
``fastload index`` on a directory list their input through :func:`walk_tree`. On a local store
it walks the directory itself (the store's own listing follows links blindly: a link to an
enclosing directory repeats the tree until the path is too long); on other stores (S3, HDFS,
memory) it is the store's listing, which has no links.

The rules (``fastload/convert/README.md``, *Symbolic links and hard links*):

* The walk is sorted by key, the order :meth:`Store.list` gives (a directory's entries sorted by
  the key they produce, a directory's key with a trailing ``/``), so every result below is a pure
  function of the tree, never of the order ``os.scandir`` returns entries in.
* **What lies inside the root is keyed by its own path.** A link to a directory of the root (on
  a visible path) is not followed: that directory is listed where it is. When the link leads to
  a directory that contains it (``cat/up -> ..``) it is a **loop**, else an **alias**; each is a
  :class:`TreeNote`, not an error (nothing of the tree is lost).
* **Links that lead out of the root** (or to a hidden path) are followed, to files and
  directories: what they reach is keyed by the link's path (``train -> /mnt/big/train`` gives
  ``train/...``). A directory reached again (same device and inode: two links to one
  directory, a bind mount) is walked once, at its first path in sorted order; a later path to it
  is a **repeated** directory (a note, not followed). A link back to a directory being walked is
  a loop.
* **Each real file is one file** (same device and inode: symbolic links and hard links). Its
  paths are all in :attr:`Tree.objects`; :attr:`Tree.duplicate_of` maps all but one to the one
  kept: the path without a symbolic link on it (the file's own path under the root), else the
  first in sorted order. Hard links inside the root: the first in sorted order.
* A link that cannot be followed (its target does not exist, a loop of links, no permission) is
  a **dangling** link: a note that is an item error (the ``on_error`` policy applies).
"""

from __future__ import annotations

import errno
import os
import stat
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from fastload.convert._progress import plural
from fastload.errors import StoreError, StorePermissionError
from fastload.formats.manifest import MANIFEST_NAME
from fastload.storage import ObjectMeta, Store

__all__ = ["Tree", "TreeNote", "visible", "walk_tree"]

#: Objects conversion writes next to a dataset; never treated as input.
_OWN_PREFIXES = ("_fastload",)


def visible(key: str) -> bool:
    """Whether ``key`` is input: no hidden path segment, not the manifest nor our own objects."""
    parts = key.split("/")
    if any(p.startswith(".") for p in parts):
        return False
    return not (
        len(parts) == 1 and (parts[0] == MANIFEST_NAME or parts[0].startswith(_OWN_PREFIXES))
    )


class TreeNote(NamedTuple):
    """A path of the tree that is not listed, and why.

    Attributes:
        item: The path under the root (a link or a directory, without a trailing ``/``).
        reason: What it is and what was done, naming the link and its target.
        kind: ``loop`` (a link back to a directory that contains it), ``alias`` (a link to
            another directory of the root, listed at its own path), ``repeated`` (a second path
            to a directory outside the root walked already) or ``dangling`` (a link that cannot
            be followed).
        brief: A few words for a warning (``cat/up -> ..``).
    """

    item: str
    reason: str
    kind: str
    brief: str

    @property
    def error(self) -> bool:
        """Whether it is an item error (a dangling link: the ``on_error`` policy applies); the
        other kinds are only reported: what they lead to is listed at another path."""
        return self.kind == "dangling"


@dataclass
class Tree:
    """What :func:`walk_tree` found.

    Attributes:
        url: The store's URL (for messages).
        objects: Every visible file path reached, sorted by key, **duplicates included**.
        duplicate_of: For each path in :attr:`objects` that is not the kept path of its file
            (same device and inode), the kept path (see the module docstring).
        notes: Paths not listed (loops, aliases, repeated directories, dangling links), sorted
            by path.
        links: Every symbolic link met: its path under the root → its target as written.
    """

    url: str
    objects: list[ObjectMeta] = field(default_factory=list)
    duplicate_of: dict[str, str] = field(default_factory=dict)
    notes: list[TreeNote] = field(default_factory=list)
    links: dict[str, str] = field(default_factory=dict)

    def unique(self) -> list[ObjectMeta]:
        """:attr:`objects` without the duplicates: each file once, under its first path."""
        if not self.duplicate_of:
            return self.objects
        return [m for m in self.objects if m.key not in self.duplicate_of]

    def via(self, key: str) -> str | None:
        """``"a -> /mnt/x"``: the last symbolic link on the path ``key`` (itself included), or
        ``None`` when the path has none."""
        if not self.links:
            return None
        parts = key.split("/")
        for n in range(len(parts), 0, -1):
            prefix = "/".join(parts[:n])
            if prefix in self.links:
                return f"{prefix} -> {self.links[prefix]}"
        return None

    def duplicate_reason(self, key: str, first: str) -> str:
        """Why path ``key`` is left out as a duplicate of path ``first`` (the same file)."""
        how = self.via(key) or self.via(first)
        if how is not None:
            how = f"through the symbolic link {how}"
        else:
            how = "a hard link: the same device and inode"
        return (
            f"duplicate: the same file as {first!r} ({how}); a file reached by several paths is "
            "converted once, under its own path in the source or else the first in sorted order"
        )

    def warnings(self, shown: int = 3) -> list[str]:
        """What the user should be told about the links of the tree: the directory links not
        followed (loops, aliases, repeated directories) and the dangling links, a few of each."""
        out = []
        kinds = (
            ("loop", "symbolic link loop", "symbolic link loops", "not followed"),
            (
                "alias",
                "symbolic link to a directory of the source",
                "symbolic links to directories of the source",
                "not followed (each directory is converted under its own path)",
            ),
            (
                "repeated",
                "second path to a directory",
                "second paths to directories",
                "not followed (each directory is converted once)",
            ),
            (
                "dangling",
                "symbolic link that cannot be followed",
                "symbolic links that cannot be followed",
                "left out",
            ),
        )
        for kind, one, many, done in kinds:
            notes = [n for n in self.notes if n.kind == kind]
            if notes:
                named = ", ".join(n.brief for n in notes[:shown])
                more = f" and {len(notes) - shown} more" if len(notes) > shown else ""
                out.append(f"{self.url} has {plural(len(notes), one, many)}, {done}: {named}{more}")
        return out


def walk_tree(store: Store) -> Tree:
    """Every visible object of ``store`` (no hidden path segment, not fastload's own objects),
    sorted by key, each real directory once, duplicate paths of a file marked (see the module
    docstring).

    Raises:
        StorePermissionError: A directory of the tree cannot be listed.
        StoreError: Another error of the file system while listing.
    """
    root = store.local_root
    if root is None:
        return Tree(store.url, [m for m in store.list("") if visible(m.key)])
    return _LocalWalk(store, root).run(visible)


class _LocalWalk:
    """The sorted depth-first walk of a local store's root, following links."""

    def __init__(self, store: Store, root: str) -> None:
        self.store, self.root = store, root
        self.tree = Tree(store.url)
        #: (device, inode) of every directory walked → its key ("" for the root)
        self.walked: dict[tuple[int, int], str] = {}
        # (device, inode) of each object, in order: duplicates are found once the walk is done
        self.devices = array("Q")
        self.inodes = array("Q")
        self.real_root = os.path.realpath(root)
        self.real_root_sep = self.real_root.rstrip(os.sep) + os.sep

    def run(self, visible: Callable[[str], bool]) -> Tree:
        root = self.root
        try:
            st = os.stat(root)
        except FileNotFoundError:
            return self.tree  # like Store.list: nothing there
        except OSError as exc:
            raise self._error(exc, "") from exc
        if not stat.S_ISDIR(st.st_mode):
            return self.tree
        self.walked[(st.st_dev, st.st_ino)] = ""
        self._walk(root, "", [(st.st_dev, st.st_ino)], visible)
        self.tree.notes.sort()
        self._find_duplicates()
        return self.tree

    def _error(self, exc: OSError, rel: str) -> StoreError:
        where = self.store.child_url(rel) if rel else self.store.url
        if exc.errno in (errno.EACCES, errno.EPERM):
            return StorePermissionError(
                f"cannot list the directory {where}: {exc.strerror}; check its owner and mode, "
                "or move it out of the source",
                url=where,
            )
        return StoreError(f"cannot list the directory {where}: {exc}", url=where)

    def _entries(self, path: str, rel: str) -> Iterator[tuple[str, os.DirEntry[str], bool]]:
        """``(sort key, entry, is a link)`` of the visible entries of a directory, in key order."""
        try:
            with os.scandir(path) as it:
                entries = [e for e in it if not e.name.startswith(".")]
        except OSError as exc:
            raise self._error(exc, rel.rstrip("/")) from exc
        items = []
        for entry in entries:
            try:
                is_dir = entry.is_dir(follow_symlinks=True)
            except OSError:
                is_dir = False  # a dangling link: found as such below
            items.append((rel + entry.name + ("/" if is_dir else ""), entry, is_dir))
        items.sort(key=lambda t: t[0])
        for sort_key, entry, _ in items:
            yield sort_key, entry, entry.is_symlink()

    def _walk(
        self,
        path: str,
        rel: str,
        ancestors: list[tuple[int, int]],
        visible: Callable[[str], bool],
    ) -> None:
        tree = self.tree
        for sort_key, entry, is_link in self._entries(path, rel):
            key = sort_key.rstrip("/")
            if is_link:
                try:
                    target = os.readlink(entry.path)
                except OSError:
                    target = "?"
                tree.links[key] = target
            try:
                st = entry.stat(follow_symlinks=True)
            except OSError as exc:
                if not is_link:
                    if exc.errno == errno.ENOENT:
                        continue  # removed since it was listed, as Store.list does
                    raise self._error(exc, key) from exc
                reason = _dangling(key, tree.links[key], exc)
                brief = f"{key} -> {tree.links[key]}"
                tree.notes.append(TreeNote(key, reason, "dangling", brief))
                continue
            if stat.S_ISDIR(st.st_mode):
                ident = (st.st_dev, st.st_ino)
                first = self.walked.get(ident)
                inside = self._inside(entry.path) if is_link else None
                if ident in ancestors:
                    brief = f"{key} -> {tree.links.get(key, '?')}"
                    reason = self._loop_reason(key, first or inside or "")
                    tree.notes.append(TreeNote(key, reason, "loop", brief))
                elif inside is not None:
                    brief = f"{key} -> {tree.links[key]} (the directory {inside}/)"
                    tree.notes.append(
                        TreeNote(key, self._alias_reason(key, inside), "alias", brief)
                    )
                elif first is None:
                    self.walked[ident] = key
                    ancestors.append(ident)
                    self._walk(entry.path, sort_key, ancestors, visible)
                    ancestors.pop()
                else:
                    reason = self._repeated_reason(key, first)
                    brief = f"{self.tree.via(key) or key} (the same as {first + '/'})"
                    tree.notes.append(TreeNote(key, reason, "repeated", brief))
            elif visible(key):
                tree.objects.append(
                    ObjectMeta(key, st.st_size, st.st_mtime, f"{st.st_mtime_ns:x}-{st.st_size:x}")
                )
                self.devices.append(st.st_dev)
                self.inodes.append(st.st_ino)

    def _inside(self, path: str) -> str | None:
        """The path under the root of what the link ``path`` leads to, when that is inside the
        root on a visible path (where the walk lists it by itself); else ``None``."""
        real = os.path.realpath(path)
        if real == self.real_root:
            return ""
        if not real.startswith(self.real_root_sep):
            return None
        rel = real[len(self.real_root_sep) :].replace(os.sep, "/")
        return None if any(p.startswith(".") for p in rel.split("/")) else rel

    def _loop_reason(self, key: str, ancestor: str) -> str:
        where = f"the directory {ancestor + '/'!r}" if ancestor else "the root directory"
        return (
            f"symbolic link loop: {key} -> {self.tree.links.get(key, '?')} leads back to {where}, "
            "which contains it; not followed (what it holds is converted under its own path)"
        )

    def _alias_reason(self, key: str, inside: str) -> str:
        return (
            f"symbolic link {key} -> {self.tree.links[key]} leads to the directory "
            f"{inside + '/'!r} of the source; not followed: that directory is converted under "
            "its own path, once"
        )

    def _repeated_reason(self, key: str, first: str) -> str:
        how = self.tree.via(key) or self.tree.via(first)
        return (
            f"the same directory as {first + '/'!r}, reached first in sorted order"
            + (f" (through the symbolic link {how})" if how else "")
            + f"; not followed: its files are listed once, under {first + '/'!r}"
        )

    def _find_duplicates(self) -> None:
        """Fill :attr:`Tree.duplicate_of`: the paths of a file reached before. One pass over
        16 bytes per file once the walk is done (no mapping of every file is kept)."""
        import numpy as np

        n = len(self.inodes)
        if n < 2:
            return
        dev = np.frombuffer(self.devices, dtype=np.uint64)
        ino = np.frombuffer(self.inodes, dtype=np.uint64)
        order = np.lexsort((ino, dev))  # stable: equal files stay in walk order
        sd, si = dev[order], ino[order]
        same = (sd[1:] == sd[:-1]) & (si[1:] == si[:-1])
        if not same.any():
            return
        # Each group of paths to one file keeps the first path without a symbolic link on it
        # (the file's own path under the root), else the first path in sorted order.
        tree = self.tree
        objects = tree.objects
        ends = np.flatnonzero(np.concatenate((~same, [True])))  # last position of each group
        starts = np.concatenate(([0], ends[:-1] + 1))
        several = ends > starts
        for start, end in zip(starts[several].tolist(), ends[several].tolist(), strict=True):
            paths = [objects[int(i)].key for i in order[start : end + 1]]
            kept = next((k for k in paths if tree.via(k) is None), paths[0])
            tree.duplicate_of.update((k, kept) for k in paths if k != kept)


def _dangling(key: str, target: str, exc: OSError) -> str:
    if exc.errno == errno.ENOENT:
        return f"dangling symbolic link {key} -> {target}: its target does not exist"
    if exc.errno == errno.ELOOP:
        return f"symbolic link {key} -> {target} cannot be followed: it is a loop of links"
    return f"symbolic link {key} -> {target} cannot be followed: {exc.strerror}"
