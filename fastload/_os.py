"""The operating-system calls Python's standard library does not offer, in one place.

Four calls, each used where it pays and each a no-op (or ``None``) where the system lacks it:

* :func:`map_read_only`: a file mapped read-only *without keeping a file descriptor* (parsed
  index files: one per shard, thousands per process, must not count against ``RLIMIT_NOFILE``).
  Python >= 3.13 does it with ``mmap.mmap(..., trackfd=False)``; older Pythons call libc's
  ``mmap(2)``/``munmap(2)``.
* :func:`populate`: ``madvise(MADV_POPULATE_WRITE)`` on memory Python did not map (a torch
  shared-memory block): its pages backed in one call instead of a fault per page (Linux >= 5.14).
* :func:`die_with_parent`: ``prctl(PR_SET_PDEATHSIG)``, the kernel kills the calling process
  when its parent dies (Linux).
* :func:`never_free`: one more reference to a Python object that nothing drops, so that it is
  never deallocated, not even at interpreter exit (an object inherited through ``fork`` whose
  destructor would wait on threads that exist only in the parent).

And two uses of the standard library's :mod:`signal`, for commands that must end promptly and
cleanly however often Ctrl-C is pressed: :func:`interrupts_escalate` (the first Ctrl-C raises
``KeyboardInterrupt``, later ones call a function instead of raising again in the middle of the
clean-up) and :func:`interrupts_ignored` (a command that is ending).

**Guarded one way**: libc is looked up once (:func:`_libc`), only on Linux, and every call that
needs it returns ``False``/``None`` where it is missing or fails; nothing here raises. Thread-safe;
safe in forked children (nothing is held per process).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "die_with_parent",
    "interrupts_escalate",
    "interrupts_ignored",
    "map_read_only",
    "never_free",
    "populate",
]

_O_RDONLY = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
_MADV_POPULATE_WRITE = 23  # <linux/mman.h>
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: Whether ``mmap.mmap`` can map without keeping a descriptor (``trackfd``, Python >= 3.13).
_STDLIB_UNTRACKED = sys.version_info >= (3, 13)


@functools.cache
def _libc() -> Any:
    """libc with the argument types of the calls below set, or ``None`` (not Linux, not found)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        libc.prctl.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def map_read_only(path: str | os.PathLike[str]) -> tuple[memoryview, os.stat_result] | None:
    """The file at ``path`` mapped read-only and shared, as a read-only byte view, and its
    ``fstat``; ``None`` when it cannot be opened or mapped, or is empty.

    No descriptor stays open: the mapping alone keeps the file's pages, and it is unmapped when
    the last object over the view (a NumPy array made from it, a slice) is gone.
    """
    try:
        fd = os.open(path, _O_RDONLY)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_size == 0:
            return None
        view = _map_fd(fd, st.st_size)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return None if view is None else (view, st)


def _map_fd(fd: int, size: int) -> memoryview | None:
    if _STDLIB_UNTRACKED:  # pragma: no cover - Python >= 3.13
        return memoryview(
            mmap.mmap(fd, size, access=mmap.ACCESS_READ, trackfd=False)  # type: ignore[call-arg,unused-ignore]
        ).toreadonly()
    libc = _libc()
    if libc is None:
        return None
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        return None
    pages = (ctypes.c_uint8 * size).from_address(addr)
    weakref.finalize(pages, libc.munmap, addr, size)  # after the last view over it
    return memoryview(pages).cast("B").toreadonly()


def populate(address: int, nbytes: int) -> bool:
    """Ask the kernel to back ``nbytes`` of fresh, writable shared memory at ``address`` with
    pages now, in one call (Linux >= 5.14 ``MADV_POPULATE_WRITE``), instead of one page fault
    per 4 KiB page on first write. Whether the kernel did; elsewhere nothing happens and the
    first write faults the pages in as usual."""
    libc = _libc()
    if libc is None or nbytes <= 0:
        return False
    page = mmap.PAGESIZE
    start = address // page * page
    return bool(libc.madvise(start, address + nbytes - start, _MADV_POPULATE_WRITE) == 0)


def die_with_parent(signal_number: int) -> bool:
    """Have the kernel send ``signal_number`` to this process when its parent dies (Linux
    ``PR_SET_PDEATHSIG``); whether that is armed. The caller must still check that the parent
    is alive afterwards: one that died before the call sends nothing."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.prctl(_PR_SET_PDEATHSIG, signal_number, 0, 0, 0) == 0)


def never_free(obj: object) -> None:
    """Take a reference to ``obj`` that is never released: its destructor never runs in this
    process, not even when the interpreter exits (a forked child's copy of an object owning its
    parent's threads, e.g. an ``hdfs_native`` client's Tokio runtime, whose destructor would wait
    for them forever)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


@contextlib.contextmanager
def _sigint_handler(handler: Any, restore: bool = True) -> Iterator[None]:
    """``handler`` for SIGINT meanwhile, then Python's default again (unless not ``restore``).
    Only in the main thread (the only one that can set handlers), and only over Python's default
    handler (one the application set is left alone); otherwise this does nothing."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        if restore:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def interrupts_ignored(keep: bool = False) -> contextlib.AbstractContextManager[None]:
    """SIGINT (Ctrl-C) ignored meanwhile, then its handler restored (``keep``: ignored until the
    process exits; for a command that is ending). Only in the main thread, over Python's default
    handler; otherwise this does nothing."""
    return _sigint_handler(signal.SIG_IGN, restore=not keep)


def interrupts_escalate(on_repeat: Callable[[], None]) -> contextlib.AbstractContextManager[None]:
    """Meanwhile the first SIGINT (Ctrl-C) raises ``KeyboardInterrupt`` as usual, and every later
    one calls ``on_repeat`` instead (in the main thread, between two bytecodes: it must only set
    a flag, never take a lock). So the clean-up that the first one started is not cut short by a
    second ``KeyboardInterrupt``: ``on_repeat`` asks it to hurry. The handler is restored
    afterwards. Only in the main thread, over Python's default handler; otherwise this does
    nothing."""
    seen = False

    def escalate(signum: int, frame: Any) -> None:
        nonlocal seen
        if not seen:
            seen = True
            raise KeyboardInterrupt
        on_repeat()

    return _sigint_handler(escalate)
