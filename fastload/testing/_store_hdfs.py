"""A stand-in for ``hdfs_native.Client``, so that :class:`StoreTests` runs against the HDFS adapter
in every CI run (no HDFS cluster can run on the CI machines).

It is a stand-in, not an HDFS: it implements only the client calls
:mod:`fastload.storage._hdfs` makes (``read`` with ``len``/``read_range``, ``get_file_info``,
``list_status``, ``create`` with ``write``/``close``, ``rename``, ``delete``), over files in a
local directory, with the semantics the adapter relies on, as ``hdfs-native`` gives them:

* a missing path raises :class:`FileNotFoundError`, reading a directory
  :class:`IsADirectoryError`, a path below a file :class:`NotADirectoryError`;
* ``FileStatus`` has ``path`` (absolute), ``length``, ``isdir`` and ``modification_time`` (ms);
* ``create`` with ``create_parent`` makes the parent directories, and with ``overwrite`` replaces
  a file; ``rename(..., overwrite=True)`` replaces the target atomically, as a NameNode rename;
* ``delete`` of a missing path returns ``False``; a reader keeps reading the file it opened
  after the path is replaced (HDFS readers keep their blocks).

What it does not exercise: the RPC and data-transfer protocols, Kerberos, NameNode failover,
and the connection errors of a real cluster (``tests/storage/test_hdfs.py`` checks those
against a closed port, and the real-cluster conformance class runs when
``FASTLOAD_TEST_HDFS_URL`` is set). The files live on disk rather than in memory so that the
suite's spawned processes share them, as the processes of a real cluster's clients do.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import Any

from fastload.storage._hdfs import HDFSStore

__all__ = ["StandInHDFSClient", "StandInHDFSStore"]


@dataclasses.dataclass(frozen=True)
class StandInFileStatus:
    """The fields of ``hdfs_native.FileStatus`` that the adapter reads."""

    path: str
    length: int
    isdir: bool
    modification_time: int


class _Reader:
    """``hdfs_native.FileReader``'s ``len`` and ``read_range`` over the file opened at ``path``."""

    def __init__(self, path: str) -> None:
        self._fd = -1
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._length = os.fstat(self._fd).st_size

    def __len__(self) -> int:
        return self._length

    def read_range(self, offset: int, length: int) -> bytes:
        return os.pread(self._fd, length, offset)

    def __del__(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)


class _Writer:
    """``hdfs_native.FileWriter``'s ``write`` and ``close``."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "wb")  # noqa: SIM115 - closed by close(), as the real writer

    def write(self, data: bytes) -> int:
        return self._file.write(data)

    def close(self) -> None:
        self._file.close()


class StandInHDFSClient:
    """An in-process ``hdfs_native.Client`` over the directory ``disk_root`` (see the module
    docs): HDFS path ``/a/b`` is the file ``disk_root/a/b``."""

    def __init__(self, disk_root: str) -> None:
        self._disk_root = disk_root

    def _local(self, path: str) -> str:
        if not path.startswith("/"):
            raise ValueError(f"HDFS paths given to the client are absolute, got {path!r}")
        return os.path.join(self._disk_root, path.lstrip("/"))

    def _status(self, path: str, local: str) -> StandInFileStatus:
        st = os.stat(local)
        isdir = os.path.isdir(local)
        return StandInFileStatus(
            path="/" + path.strip("/"),
            length=0 if isdir else st.st_size,
            isdir=isdir,
            modification_time=st.st_mtime_ns // 1_000_000,
        )

    def read(self, path: str) -> _Reader:
        local = self._local(path)
        if os.path.isdir(local):
            raise IsADirectoryError(path)
        return _Reader(local)

    def get_file_info(self, path: str) -> StandInFileStatus:
        return self._status(path, self._local(path))

    def list_status(self, path: str, recursive: bool = False) -> Iterator[StandInFileStatus]:
        local = self._local(path)
        if not os.path.isdir(local):
            yield self._status(path, local)  # a file lists itself; a missing path raises
            return
        for entry in sorted(os.scandir(local), key=lambda e: e.name):
            child = f"{path.rstrip('/')}/{entry.name}"
            yield self._status(child, entry.path)
            if recursive and entry.is_dir():
                yield from self.list_status(child, recursive=True)

    def create(self, path: str, write_options: Any = None) -> _Writer:
        local = self._local(path)
        if write_options is not None and write_options.create_parent:
            os.makedirs(os.path.dirname(local), exist_ok=True)
        if os.path.exists(local) and not (write_options is not None and write_options.overwrite):
            raise FileExistsError(path)
        return _Writer(local)

    def rename(self, src: str, dst: str, overwrite: bool = False) -> None:
        target = self._local(dst)
        if os.path.exists(target) and not overwrite:
            raise FileExistsError(dst)
        os.replace(self._local(src), target)

    def delete(self, path: str, recursive: bool = False) -> bool:
        local = self._local(path)
        if not os.path.lexists(local):
            return False
        if os.path.isdir(local):
            if recursive:
                raise NotImplementedError("the fastload adapter never deletes recursively")
            os.rmdir(local)  # a non-empty directory raises, as in HDFS
        else:
            os.unlink(local)
        return True


class StandInHDFSStore(HDFSStore):
    """:class:`~fastload.storage._hdfs.HDFSStore` talking to a :class:`StandInHDFSClient` over
    ``disk_root`` instead of a cluster: every line of the adapter runs except the making of the
    real client. For tests only.

    Args:
        url: An ``hdfs://`` URL; its host names no server, its path is the store's root.
        disk_root: The local directory holding the stand-in cluster's files.
        **options: :class:`HDFSStore` options (``read_only``, ...).
    """

    def __init__(self, url: str, disk_root: str | os.PathLike[str], **options: Any) -> None:
        super().__init__(url, **options)
        self._disk_root = os.fspath(disk_root)

    def _connect(self) -> StandInHDFSClient:
        return StandInHDFSClient(self._disk_root)

    def __repr__(self) -> str:
        return f"StandInHDFSStore({self.url!r}, disk_root={self._disk_root!r})"
