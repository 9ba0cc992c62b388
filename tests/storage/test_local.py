"""LocalStore specifics: the root is a hard boundary, crashes leave nothing visible, errors map."""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

from fastload import open_store
from fastload.errors import (
    InvalidArgumentError,
    InvalidKeyError,
    ObjectNotFoundError,
    ReadOnlyStoreError,
    StoreError,
    StorePermissionError,
)
from fastload.storage import ByteRange, LocalStore


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "root"


@pytest.fixture
def store(root: Path) -> LocalStore:
    return LocalStore(root)


@pytest.mark.parametrize(
    "key", ["../outside", "a/../../outside", "/etc/passwd", "..", "a\x00b", "a//b"]
)
def test_keys_escaping_the_root_are_rejected(store: LocalStore, root: Path, key: str) -> None:
    (root.parent / "outside").write_bytes(b"secret")
    with pytest.raises(InvalidKeyError):
        store.get(key)
    with pytest.raises(InvalidKeyError):
        store.put(key, b"overwritten")
    assert (root.parent / "outside").read_bytes() == b"secret"
    assert sorted(os.listdir(root.parent)) == ["outside"]  # the root was not even created


def test_listing_cannot_escape_the_root(store: LocalStore, root: Path) -> None:
    (root.parent / "outside").write_bytes(b"secret")
    store.put("inside", b"1")
    for prefix in ("../", "../o", "a/../../", "./", "a//"):
        assert store.list_keys(prefix) == []
    with pytest.raises(InvalidKeyError):
        store.list_keys("/etc")


def test_temp_files_are_never_listed(store: LocalStore, root: Path) -> None:
    store.put("dir/done", b"1")
    writer = store.open_writer("dir/pending")
    writer.write(b"partial")
    names = os.listdir(root / "dir")
    assert len(names) == 2
    assert any(n.startswith(".fastload-tmp-") for n in names)
    assert store.list_keys() == ["dir/done"]
    assert not store.exists("dir/pending")
    writer.abort()
    assert os.listdir(root / "dir") == ["done"]


def test_keys_naming_temp_files_are_rejected(store: LocalStore) -> None:
    with pytest.raises(InvalidKeyError, match="reserves"):
        store.put("dir/.fastload-tmp-abc", b"x")
    with pytest.raises(InvalidKeyError, match="reserves"):
        store.get(".fastload-tmp-x/y")
    store.put("dir/not.fastload-tmp-x", b"fine")  # only a segment *starting* with it is reserved
    assert store.list_keys() == ["dir/not.fastload-tmp-x"]


_WRITER_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from fastload.storage import LocalStore
    store = LocalStore(sys.argv[1])
    writer = store.open_writer(sys.argv[2])
    writer.write(b"new" * 400_000)
    print("ready", flush=True)
    while True:
        writer.write(b"more")
        time.sleep(0.01)
    """
)


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_sigkill_during_streamed_write_leaves_nothing_visible(
    store: LocalStore, root: Path
) -> None:
    store.put("shards/old.bin", b"old object")
    for key in ("shards/new.bin", "shards/old.bin"):
        child = subprocess.Popen(
            [sys.executable, "-c", _WRITER_SCRIPT, str(root), key],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "ready"
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(30)
        assert child.returncode == -signal.SIGKILL
    assert store.list_keys() == ["shards/old.bin"]
    assert store.get("shards/old.bin") == b"old object"
    assert not store.exists("shards/new.bin")
    # The killed writers' temporary files stay on disk, invisible to every store operation.
    leftovers = [n for n in os.listdir(root / "shards") if n.startswith(".fastload-tmp-")]
    assert len(leftovers) == 2


def test_read_only_option(root: Path) -> None:
    LocalStore(root).put("k", b"v")
    store = open_store(str(root), read_only=True)
    assert isinstance(store, LocalStore)
    assert not store.supports_writes
    assert store.get("k") == b"v"
    with pytest.raises(ReadOnlyStoreError, match="read-only") as info:
        store.put("k2", b"x")
    assert isinstance(info.value, PermissionError)
    with pytest.raises(ReadOnlyStoreError):
        store.delete("k")
    with pytest.raises(ReadOnlyStoreError):
        store.open_writer("k3")
    assert pickle.loads(pickle.dumps(store)).supports_writes is False
    assert sorted(os.listdir(root)) == ["k"]


def test_file_urls(root: Path, tmp_path: Path) -> None:
    LocalStore(root).put("k", b"v")
    for url in (f"file://{root}", f"file://localhost{root}", str(root), root):
        store = open_store(url)
        assert isinstance(store, LocalStore)
        assert store.root == str(root)
        assert store.url == f"file://{root}"
        assert store.get("k") == b"v"
    spaced = tmp_path / "with space"
    LocalStore(spaced).put("k", b"s")
    assert open_store(f"file://{tmp_path}/with%20space").get("k") == b"s"
    relative = os.path.relpath(root)
    assert open_store(relative).get("k") == b"v"
    with pytest.raises(InvalidArgumentError, match="names host"):
        open_store("file://otherhost/data")
    with pytest.raises(InvalidArgumentError, match="empty local path"):
        open_store("")


def test_key_that_is_both_object_and_directory(store: LocalStore) -> None:
    store.put("a", b"file")
    with pytest.raises(InvalidKeyError, match="both an object and a directory"):
        store.put("a/b", b"x")
    store.put("x/y", b"file")
    with pytest.raises(InvalidKeyError, match="both an object and a directory"):
        store.put("x", b"x")
    with pytest.raises(ObjectNotFoundError):
        store.get("a/b")
    assert store.list_keys() == ["a", "x/y"]


def test_directories_are_not_objects(store: LocalStore) -> None:
    store.put("d/e/f", b"1")
    for key in ("d", "d/e"):
        with pytest.raises(ObjectNotFoundError):
            store.get(key)
        with pytest.raises(ObjectNotFoundError):
            store.get(key, ByteRange(0, 1))
        with pytest.raises(ObjectNotFoundError):
            store.get(key, ByteRange(0, 0))
        with pytest.raises(ObjectNotFoundError):
            store.head(key)
        with pytest.raises(ObjectNotFoundError):
            store.local_path(key)
        with pytest.raises(ObjectNotFoundError):
            store.open_reader(key)


def test_delete_prunes_empty_directories_but_not_the_root(store: LocalStore, root: Path) -> None:
    store.put("a/b/c/obj", b"1")
    store.put("a/keep", b"2")
    store.delete("a/b/c/obj")
    assert not (root / "a" / "b").exists()
    assert (root / "a" / "keep").exists()
    store.delete("a/keep")
    assert root.exists()
    assert os.listdir(root) == []


def test_written_files_respect_the_umask(store: LocalStore, root: Path) -> None:
    old = os.umask(0o027)
    try:
        import fastload.storage._local as local_module

        local_module._UMASK = None  # the store caches the umask
        store.put("m", b"x")
        mode = stat.S_IMODE(os.stat(root / "m").st_mode)
    finally:
        os.umask(old)
        local_module._UMASK = None
    assert mode == 0o640


def test_fsync_off_still_atomic_rename(root: Path) -> None:
    store = LocalStore(root, fsync=False)
    store.put("k", b"v" * 1000)
    assert store.get("k") == b"v" * 1000
    assert pickle.loads(pickle.dumps(store)).get("k") == b"v" * 1000


def test_pickle_is_small_and_holds_no_handles(store: LocalStore) -> None:
    store.put("k", b"v" * 100_000)
    blob = pickle.dumps(store)
    assert len(blob) < 500
    assert pickle.loads(blob).get("k") == b"v" * 100_000


def test_permission_error_mapping_simulated(
    store: LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.put("k", b"v")

    def denied(*args: object, **kwargs: object) -> int:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(StorePermissionError, match="permission denied") as info:
        store.get("k")
    assert isinstance(info.value, PermissionError)
    assert "k" in info.value.url


def test_other_os_errors_name_the_object(
    store: LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.put("k", b"v")

    def broken(*args: object, **kwargs: object) -> bytes:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "pread", broken)
    with pytest.raises(StoreError, match="I/O error") as info:
        store.get("k", ByteRange(0, 1))
    assert info.value.url.endswith("/k")
    assert isinstance(info.value.__cause__, OSError)


def test_short_reads_are_completed(store: LocalStore, monkeypatch: pytest.MonkeyPatch) -> None:
    data = bytes(range(256)) * 40
    store.put("k", data)
    real_pread = os.pread

    def short_pread(fd: int, n: int, offset: int) -> bytes:
        return real_pread(fd, min(n, 1000), offset)  # like a network filesystem

    monkeypatch.setattr(os, "pread", short_pread)
    assert store.get("k") == data
    assert store.get("k", ByteRange(100, 5000)) == data[100:5000]


#: The user a root test process drops to, so that permission bits apply (root ignores them).
NOBODY = 65534


def _in_unprivileged_child(check: Callable[[], None]) -> None:
    """Run ``check`` in a forked child that, when the tests run as root (as in CI), first becomes
    user and group ``nobody``; fail if it raises."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            check()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the check failed in the child (see stderr)"


def test_permission_error_mapping_real() -> None:
    # Not tmp_path: pytest's directories are private to root, and the child may be nobody.
    shared = Path(tempfile.mkdtemp(prefix="fastload-permissions-", dir="/tmp"))
    os.chmod(shared, 0o777)

    def check() -> None:
        root = shared / "root"
        store = LocalStore(root)
        store.put("locked/k", b"v")
        os.chmod(root / "locked", 0)
        try:
            with pytest.raises(StorePermissionError):
                store.get("locked/k")
            with pytest.raises(StorePermissionError):
                store.put("locked/k2", b"x")
        finally:
            os.chmod(root / "locked", 0o755)

    try:
        _in_unprivileged_child(check)
    finally:
        shutil.rmtree(shared)
