"""The process tree of a benchmark child: its CPU time and its memory, from ``/proc`` (Linux).

A loader's cost is that of its whole process tree: the main process (all threads) and its worker
processes. :func:`tree_cpu_seconds` is the CPU clock the loader benchmarks time with;
:func:`tree_memory` is what ``bench_memory`` samples each epoch, and :func:`child_pids` and
:func:`status_kb` are ``bench_soak``'s sampling of the same tree. Standard library only (children
run this in other interpreters too). Re-exported by :mod:`benchmarks._harness`.
"""

from __future__ import annotations

import contextlib
import os
import resource
import time
from typing import Any

__all__ = ["child_pids", "count_fds", "status_kb", "tree_cpu_seconds", "tree_memory"]


def _stat_fields(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (``[0]`` the state, ``[1]`` the
    parent pid, ``[11]``/``[12]`` user/system clock ticks); ``None`` if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def child_pids(pid: int) -> list[int]:
    """Live (not zombie) child processes of ``pid``, from ``/proc/*/stat``."""
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = _stat_fields(entry.name)
            if fields is not None and int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry.name))
    return sorted(out)


def count_fds(pid: int) -> int:
    """Open file descriptors of ``pid`` (0 when it is gone)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError):
        return 0


def tree_cpu_seconds() -> float:
    """CPU seconds used so far by this process (all threads), its live child processes (loader
    workers) and its reaped children. Differences of it are a loader's whole CPU cost, which
    varies much less than wall time on a shared machine (Linux only)."""
    total = time.process_time()
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    total += ru.ru_utime + ru.ru_stime
    tick = os.sysconf("SC_CLK_TCK")
    for pid in child_pids(os.getpid()):
        fields = _stat_fields(pid)
        if fields is not None:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def status_kb(pid: int, name: str, file: str = "status") -> int:
    """A ``kB`` field (``VmRSS``, ``RssAnon``; ``Pss`` with ``file="smaps_rollup"``) of
    ``/proc/<pid>/<file>``; 0 if the process is gone."""
    with (
        contextlib.suppress(FileNotFoundError, ProcessLookupError),
        open(f"/proc/{pid}/{file}", encoding="ascii") as f,
    ):
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    return 0


def tree_memory(pid: int | None = None) -> list[dict[str, Any]]:
    """Memory of ``pid`` (default: this process) and each live child: ``pid``, ``role``
    (``"main"``; ``"worker"`` for a forked child, whose command line is the parent's; else the
    child's program, e.g. multiprocessing's resource tracker), ``rss_kb``, ``anon_kb`` (RssAnon:
    private memory, where a leak shows) and ``pss_kb`` (shared pages divided among the processes
    that map them: the fair share of shared memory and page cache) and ``pss_file_kb`` (the part
    of PSS from mapped files: shards, libraries; it shrinks when other processes on the machine
    map the same files, so ``pss_kb - pss_file_kb`` is the figure that is the loader's own).

    RSS sums double-count pages the processes share (forked copy-on-write pages, shared-memory
    batches); PSS sums do not.
    """
    main = os.getpid() if pid is None else pid

    def cmdline(p: int) -> bytes:
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                return f.read()
        except (FileNotFoundError, ProcessLookupError):
            return b""

    own = cmdline(main)
    out = []
    for p in [main, *child_pids(main)]:
        if p == main:
            role = "main"
        else:
            cmd = cmdline(p)
            role = "worker" if cmd == own else cmd.replace(b"\0", b" ").decode()[:60]
        out.append(
            {
                "pid": p,
                "role": role,
                "rss_kb": status_kb(p, "VmRSS"),
                "anon_kb": status_kb(p, "RssAnon"),
                "pss_kb": status_kb(p, "Pss", "smaps_rollup"),
                "pss_file_kb": status_kb(p, "Pss_File", "smaps_rollup"),
            }
        )
    return out
