"""Per-process resources made on first use: the one way fastload keeps clients, pools and handles.

Stores, readers and loaders pickle by configuration and are used in forked and spawned worker
processes. A socket, thread pool or memory map made in one process must never be used by another:
a forked child that inherits a boto3 client or an LMDB environment and uses it corrupts the
parent's state. :class:`PerProcess` holds such a value and makes it again, once, in each process
that asks for it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["PerProcess", "current_pid"]

T = TypeVar("T")


class _Process:
    """This process: its id, renewed in forked children (``os.getpid()`` is a system call, and
    the loader asks once or more per sample), and the lock that guards the "is this value from
    another process?" check (a lock held by some thread at fork time stays held forever in the
    child, so the child gets a fresh one)."""

    def __init__(self) -> None:
        self.renew()

    def renew(self) -> None:
        """Read the id and make the lock (at import, and in a forked child)."""
        self.pid = os.getpid()
        self.reset_lock = threading.Lock()


_THIS = _Process()


def current_pid() -> int:
    """``os.getpid()`` without the system call (kept up to date across ``os.fork``)."""
    return _THIS.pid


os.register_at_fork(after_in_child=_THIS.renew)


class PerProcess(Generic[T]):
    """A value made by ``factory()`` on first use in each process.

    :meth:`get` makes the value once per process, even when threads race for it. In a forked child
    the parent's value is forgotten, never used and never closed there (closing a socket or an
    environment the parent still uses, from the child, would break the parent). A pickled copy
    carries only the factory and makes its own value where it is used.

    Args:
        factory: Makes the value; called with no arguments, at most once per process unless
            :meth:`clear` is called. Must be picklable if the holder is.
    """

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._lock = threading.Lock()
        self._pid = _THIS.pid
        self._value: T | None = None

    def _this_process(self) -> None:
        if self._pid != _THIS.pid:
            with _THIS.reset_lock:
                if self._pid != _THIS.pid:
                    self._lock = threading.Lock()
                    self._value = None
                    self._pid = _THIS.pid

    def get(self) -> T:
        """This process's value, made now if it has none."""
        self._this_process()
        value = self._value
        if value is not None:
            return value
        with self._lock:
            if self._value is None:
                self._value = self._factory()
            return self._value

    def peek(self) -> T | None:
        """This process's value if it has been made, else ``None`` (nothing is made)."""
        self._this_process()
        return self._value

    def clear(self) -> T | None:
        """Forget this process's value and return it (for the caller to close); the next
        :meth:`get` makes a new one. ``None`` if none had been made in this process."""
        self._this_process()
        with self._lock:
            value, self._value = self._value, None
        return value

    def __getstate__(self) -> dict[str, Any]:
        return {"factory": self._factory}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["factory"])  # type: ignore[misc]

    def __repr__(self) -> str:
        made = "made" if self.peek() is not None else "not made"
        return f"PerProcess({getattr(self._factory, '__qualname__', self._factory)!r}, {made})"
