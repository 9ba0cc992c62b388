"""What the launcher of this process says about its place in the job: read from the environment.

Every launcher that starts one process per rank tells each process its rank in environment
variables of its own. This module reads them, a pure function of an environment mapping (no
``torch.distributed``, see :mod:`fastload.loader._dist` for the whole order of precedence):

* ``torchrun``: ``RANK``, ``WORLD_SIZE``; local: ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``.
* ``horovodrun`` with Gloo: ``HOROVOD_RANK``, ``HOROVOD_SIZE``; local: ``HOROVOD_LOCAL_RANK``,
  ``HOROVOD_LOCAL_SIZE``.
* Open MPI's ``mpirun`` (also ``horovodrun`` over MPI): ``OMPI_COMM_WORLD_RANK``,
  ``OMPI_COMM_WORLD_SIZE``; local: ``OMPI_COMM_WORLD_LOCAL_RANK``, ``OMPI_COMM_WORLD_LOCAL_SIZE``.
* MPICH and Intel MPI (Hydra), ``srun --mpi=pmi2``: ``PMI_RANK``, ``PMI_SIZE``; local:
  ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``.
* SLURM's ``srun``: ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` (else ``SLURM_NTASKS``); local:
  ``SLURM_LOCALID``, this node's (``SLURM_NODEID``) entry of ``SLURM_STEP_TASKS_PER_NODE``.
  Counted only when ``SLURM_STEP_ID`` (or ``SLURM_STEPID``) is set: the process runs in a job
  step, which only ``srun`` starts.

Precedence among them is the table's order, innermost launcher first: a launcher nested in
another (``srun`` running ``torchrun`` on each node, ``mpirun`` inside an ``sbatch`` script)
starts the processes that train, so its variables describe them; the outer one's describe its own
tasks (a node's agent, the batch script). An ``sbatch`` batch script itself has ``SLURM_PROCID=0``
and ``SLURM_NTASKS`` of the allocation but no step id (measured with Slurm 22.05), and an
``salloc`` shell has ``SLURM_NTASKS`` only: both are one process, so SLURM's variables count only
inside a step.

What is refused (:class:`~fastload.errors.LaunchEnvironmentError`), so that no process of a
multi-process job ever takes rank 0 of 1 and reads the whole dataset: a rank without a world size
or a world size above 1 without a rank; local variables alone that say there are other processes
on the node (``LOCAL_RANK=1`` with no launcher giving a rank; ``LOCAL_RANK=0`` alone is one
process, and ``LOCAL_RANK`` re-exported beside ``mpirun``'s variables is ignored); a value that is
not an integer or is out of range (``rank >= world size``, ``local rank >= local size``,
``local size > world size``); ``PMIX_RANK`` (a PMIx launch) with no launcher giving a world size;
and a launcher of higher precedence whose world is smaller than another's: a nested launcher starts
at least one process in each of the outer one's tasks, so a smaller world means stale variables
(``RANK``/``WORLD_SIZE`` exported by hand in a job started by ``mpirun``), never a nesting.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

__all__ = [
    "LAUNCH_VARIABLES",
    "LAUNCHERS",
    "EnvLaunch",
    "LauncherVars",
    "parse_environment",
    "tasks_per_node",
]


@dataclasses.dataclass(frozen=True)
class LauncherVars:
    """The variables one launcher sets in each process it starts.

    Attributes:
        name: How the launcher is named in messages (``"torchrun"``, ``"Open MPI"``).
        rank: The global rank's variable.
        world_size: The world size's variable(s), first found wins.
        local_rank: The rank among the processes of this node.
        local_world_size: The number of this launcher's processes on this node.
        step: For SLURM: variables of which one must be set for the others to count (a job step).
    """

    name: str
    rank: str
    world_size: tuple[str, ...]
    local_rank: str
    local_world_size: str
    step: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """Every variable of this launcher."""
        return (self.rank, *self.world_size, self.local_rank, self.local_world_size, *self.step)


#: The launchers, highest precedence (innermost) first.
LAUNCHERS: tuple[LauncherVars, ...] = (
    LauncherVars("torchrun", "RANK", ("WORLD_SIZE",), "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    LauncherVars(
        "horovodrun", "HOROVOD_RANK", ("HOROVOD_SIZE",), "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"
    ),
    LauncherVars(
        "Open MPI",
        "OMPI_COMM_WORLD_RANK",
        ("OMPI_COMM_WORLD_SIZE",),
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    LauncherVars("MPICH/PMI", "PMI_RANK", ("PMI_SIZE",), "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    LauncherVars(
        "SLURM srun",
        "SLURM_PROCID",
        ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"),
        "SLURM_LOCALID",
        "SLURM_STEP_TASKS_PER_NODE",
        step=("SLURM_STEP_ID", "SLURM_STEPID"),
    ),
)

#: A PMIx launch (Open MPI, PRRTE, ``srun --mpi=pmix``) names the rank only; it needs a world size
#: from one of the launchers above.
_PMIX_RANK = "PMIX_RANK"
#: Variables reported in messages besides the launchers' own.
_CONTEXT = ("SLURM_NODEID", "SLURM_TASKS_PER_NODE", "SLURM_JOB_ID", _PMIX_RANK)

#: Every variable this module reads, for messages and diagnostics.
LAUNCH_VARIABLES: tuple[str, ...] = tuple(
    dict.fromkeys(name for launcher in LAUNCHERS for name in launcher.names).keys()
) + tuple(name for name in _CONTEXT if not any(name in x.names for x in LAUNCHERS))


@dataclasses.dataclass(frozen=True)
class EnvLaunch:
    """One launcher's complete, consistent account of this process.

    Attributes:
        launcher: The launcher's name (:attr:`LauncherVars.name`).
        rank: Global rank, in ``[0, world_size)``.
        world_size: Number of processes the launcher started.
        local_rank: Rank among its processes on this node, or ``None`` when not set.
        local_world_size: Its processes on this node, or ``None`` when not set (or, for SLURM,
            not readable from ``SLURM_STEP_TASKS_PER_NODE``).
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int | None
    local_world_size: int | None


_ENTRY = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def tasks_per_node(text: str) -> list[int] | None:
    """Expand SLURM's compressed tasks-per-node list (``"2(x3),1"`` → ``[2, 2, 2, 1]``).

    Returns ``None`` when ``text`` is not in that form.
    """
    counts: list[int] = []
    for part in text.split(","):
        match = _ENTRY.match(part.strip())
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts or None


def _get(environ: Mapping[str, str], name: str) -> str | None:
    value = environ.get(name)
    return None if value is None or value.strip() == "" else value.strip()


def _parse_one(
    launcher: LauncherVars,
    environ: Mapping[str, str],
    problems: list[str],
    local_only: list[str],
) -> EnvLaunch | None:
    """This launcher's account, ``None`` when it did not start this process; a problem found is
    appended to ``problems`` (and ``None`` returned); local variables that say there are other
    processes on the node, with no rank or world size, to ``local_only``."""
    if launcher.step and not any(_get(environ, n) is not None for n in launcher.step):
        return None
    present = [n for n in launcher.names if _get(environ, n) is not None]
    if not present:
        return None
    values: dict[str, int] = {}
    for name in present:
        if name in launcher.step or (launcher.step and name == launcher.local_world_size):
            continue  # a step id, SLURM's tasks-per-node list: not plain integers
        text = _get(environ, name)
        try:
            values[name] = int(text or "")
        except ValueError:
            problems.append(f"{name}={text!r} is not an integer")
            return None
    world_name = next((n for n in launcher.world_size if n in values), None)
    rank = values.get(launcher.rank)
    world = values.get(world_name) if world_name is not None else None
    if world is None:
        if rank is None:
            # Local variables alone: often re-exported by hand for one's own code (LOCAL_RANK=
            # $OMPI_COMM_WORLD_LOCAL_RANK); a launch only if they say there are other processes.
            local = (values.get(launcher.local_rank, 0), values.get(launcher.local_world_size, 1))
            if local != (0, 1):
                local_only.append(
                    f"{launcher.name}: {', '.join(present)} set (another process on this "
                    f"node), but neither {launcher.rank} nor {launcher.world_size[0]}"
                )
        else:
            problems.append(
                f"{launcher.name}: {launcher.rank} is set but {launcher.world_size[0]} is not"
            )
        return None
    if world < 1:
        problems.append(f"{launcher.name}: {world_name}={world} is not a positive world size")
        return None
    if rank is None:
        if world != 1:
            problems.append(
                f"{launcher.name}: {world_name}={world} is set but {launcher.rank} is not"
            )
            return None
        rank = 0
    if not 0 <= rank < world:
        problems.append(
            f"{launcher.name}: {launcher.rank}={rank} is outside [0, {world_name}={world})"
        )
        return None
    local_rank = values.get(launcher.local_rank)
    local_world = values.get(launcher.local_world_size) if not launcher.step else None
    if launcher.step:
        local_world = _slurm_local_world(launcher, environ)
    if local_world is not None and not 1 <= local_world <= world:
        problems.append(
            f"{launcher.name}: {launcher.local_world_size} gives {local_world} processes on this "
            f"node, outside [1, {world_name}={world}]"
        )
        return None
    if local_rank is not None and not 0 <= local_rank < (local_world or world):
        bound = (
            f"{launcher.local_world_size}={local_world}" if local_world else f"{world_name}={world}"
        )
        problems.append(
            f"{launcher.name}: {launcher.local_rank}={local_rank} is outside [0, {bound})"
        )
        return None
    return EnvLaunch(launcher.name, rank, world, local_rank, local_world)


def _slurm_local_world(launcher: LauncherVars, environ: Mapping[str, str]) -> int | None:
    """This node's entry of SLURM's tasks per node (``SLURM_NODEID`` picks it), or ``None``."""
    text = _get(environ, launcher.local_world_size) or _get(environ, "SLURM_TASKS_PER_NODE")
    node = _get(environ, "SLURM_NODEID")
    counts = tasks_per_node(text) if text else None
    if counts is None:
        return None
    if node is None:
        return counts[0] if len(counts) == 1 else None
    try:
        index = int(node)
    except ValueError:
        return None
    return counts[index] if 0 <= index < len(counts) else None


def parse_environment(
    environ: Mapping[str, str] | None = None,
) -> tuple[list[EnvLaunch], list[str], dict[str, str]]:
    """Read every launcher's account of this process.

    Args:
        environ: The environment (default ``os.environ``).

    Returns:
        ``(launches, problems, seen)``: the complete and consistent accounts, highest precedence
        first; what is wrong with the environment (empty when nothing is), each a sentence naming
        the variables; and every launch variable set, ``{name: value}`` for messages.
    """
    env = os.environ if environ is None else environ
    seen = {n: env[n] for n in LAUNCH_VARIABLES if _get(env, n) is not None}
    problems: list[str] = []
    local_only: list[str] = []
    launches = [
        launch
        for launcher in LAUNCHERS
        if (launch := _parse_one(launcher, env, problems, local_only)) is not None
    ]
    if not launches:
        problems += local_only  # else the launcher's own account holds
    if problems:
        return launches, problems, seen
    if not launches and _get(env, _PMIX_RANK) is not None:
        problems.append(
            f"{_PMIX_RANK} is set (a PMIx launch: Open MPI, PRRTE, srun --mpi=pmix), but no "
            "launcher variable gives the world size"
        )
    for other in launches[1:]:
        first = launches[0]
        if other.world_size > first.world_size:
            problems.append(
                f"{first.launcher} says {first.world_size} process(es) "
                f"(rank {first.rank}) but {other.launcher} started {other.world_size}: a launcher "
                f"nested in {other.launcher} would start at least one process in each of its "
                f"tasks, so {first.launcher}'s variables are stale (exported by hand or "
                "inherited from another job?)"
            )
    return launches, problems, seen
