"""Small filesystem helpers shared by layers that publish local files atomically."""

from __future__ import annotations

import os

__all__ = ["fsync_dir", "pid_alive"]


def fsync_dir(path: str) -> None:
    """Flush a directory's entries (a just-renamed file's name) to the device; best effort."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this machine (one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
