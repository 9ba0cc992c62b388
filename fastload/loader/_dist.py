"""Where this process sits in a distributed job: rank, world size, local rank and local size.

Order of precedence (the first that gives a value wins):

1. Explicit arguments (``rank=``, ``world_size=``): never checked against the environment, so they
   are the way out of any launch this module refuses.
2. An initialised ``torch.distributed`` process group (``get_rank()``/``get_world_size()``).
3. The launcher's environment variables (:mod:`fastload.loader._launch`): ``torchrun``'s
   ``RANK``/``WORLD_SIZE``, Horovod's ``HOROVOD_*``, Open MPI's ``OMPI_COMM_WORLD_*``, Hydra's
   ``PMI_*``, SLURM ``srun``'s ``SLURM_PROCID``/``SLURM_STEP_NUM_TASKS``, in that order.
4. No launcher at all: a single process, ``(0, 1)``.

The environment is still read under 1. and 2. for the local rank and local size (the launcher whose
rank and world size are the ones in use gives them), and under 2. a group smaller than the
launched world is refused (each group would read the whole dataset).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from fastload.errors import InvalidArgumentError, LaunchEnvironmentError
from fastload.loader._launch import EnvLaunch, parse_environment

__all__ = ["Launch", "detect_launch", "detect_rank_world"]

#: How to get out of a refused launch, appended to every message.
_REMEDY = (
    "Fix the launch, or pass rank= and world_size= to the loader (DataLoader, TokenLoader, "
    "Dataset.batches, fastload.dali.DALILoader), which override every variable"
)


@dataclasses.dataclass(frozen=True)
class Launch:
    """This process's place in the job, and where it was read from.

    Attributes:
        rank: Global rank, in ``[0, world_size)``.
        world_size: Number of ranks.
        local_rank: Rank among the ranks on this node, or ``None`` when no launcher says (then
            assume nothing; :func:`fastload.dali` uses ``rank`` modulo the GPUs).
        local_world_size: Ranks on this node, or ``None`` when no launcher says.
        source: Where ``rank`` and ``world_size`` came from: ``"arguments"``,
            ``"torch.distributed"``, a launcher (``"torchrun"``, ``"horovodrun"``, ``"Open MPI"``,
            ``"MPICH/PMI"``, ``"SLURM srun"``) or ``"single process"``. When only one of the two
            was passed, the source of the other.
        variables: Every launch variable set in the environment (``{name: value}``).
    """

    rank: int
    world_size: int
    local_rank: int | None = None
    local_world_size: int | None = None
    source: str = "single process"
    variables: Mapping[str, str] = dataclasses.field(default_factory=dict)


def _seen(variables: Mapping[str, str]) -> str:
    if not variables:
        return "no launch variables are set"
    return "launch variables seen: " + ", ".join(f"{k}={v}" for k, v in sorted(variables.items()))


def _refuse(problems: list[str], variables: Mapping[str, str]) -> LaunchEnvironmentError:
    return LaunchEnvironmentError(
        f"cannot tell this process's rank from its environment: {'; '.join(problems)} "
        f"({_seen(variables)}). {_REMEDY}.",
        variables=variables,
    )


def _torch_group() -> tuple[int, int] | None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:  # pragma: no cover - torch is a core dependency
        pass
    return None


def _check_int(name: str, value: object, low: int, high: int | None) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value >= high)
    ):
        where = f"[{low}, {high})" if high is not None else f">= {low}"
        raise InvalidArgumentError(f"{name} must be an int {where}, got {value!r}")
    return value


def detect_launch(
    rank: int | None = None,
    world_size: int | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> Launch:
    """Find this process's rank, world size, local rank and local size (see the module's order).

    Args:
        rank: This process's rank; ``None``: detected.
        world_size: Number of ranks; ``None``: detected.
        environ: The environment to read (default ``os.environ``; tests pass their own).

    Raises:
        LaunchEnvironmentError: The environment shows a multi-process launch whose values are
            missing, not integers, out of range or contradicting each other, or a
            ``torch.distributed`` group smaller than the launched world, and ``rank`` and
            ``world_size`` were not both passed. The message lists the variables seen.
        InvalidArgumentError: ``rank``/``world_size`` of the wrong type or out of range.
    """
    if world_size is not None:
        _check_int("world_size", world_size, 1, None)
    if rank is not None:
        _check_int("rank", rank, 0, world_size)
    launches, problems, variables = parse_environment(environ)
    group = None if rank is not None and world_size is not None else _torch_group()
    env: EnvLaunch | None = None
    if rank is not None and world_size is not None:
        source = "arguments"
    elif group is not None:
        source = "torch.distributed"
        if not problems and launches and launches[0].world_size > group[1]:
            first = launches[0]
            raise LaunchEnvironmentError(
                f"the torch.distributed group has {group[1]} process(es) but {first.launcher} "
                f"started {first.world_size} ({_seen(variables)}): each group would read the "
                f"whole dataset. Initialise one group over every process, or pass rank= and "
                "world_size= (e.g. the data-parallel rank and size)",
                variables=variables,
            )
    elif problems:
        raise _refuse(problems, variables)
    elif launches:
        env = launches[0]
        source = env.launcher
    else:
        source = "single process"
    if group is not None:
        found_rank, found_world = group
    elif env is not None:
        found_rank, found_world = env.rank, env.world_size
    else:
        found_rank, found_world = 0, 1
    r = found_rank if rank is None else rank
    w = found_world if world_size is None else world_size
    if not 0 <= r < w:
        given = "rank" if rank is not None else "world_size"
        raise InvalidArgumentError(
            f"rank must be an int in [0, world_size={w}), got {r!r}: {given} was passed and the "
            f"other came from {source} ({_seen(variables)}); pass both rank= and world_size="
        )
    # The local place: from the launchers that agree with the rank and world in use (srun
    # --mpi=pmi2 sets PMI_RANK/PMI_SIZE, the local rank only in SLURM_LOCALID), never from an
    # environment with problems.
    agree = [x for x in launches if (x.rank, x.world_size) == (r, w)] if not problems else []
    return Launch(
        rank=r,
        world_size=w,
        local_rank=next((x.local_rank for x in agree if x.local_rank is not None), None),
        local_world_size=next(
            (x.local_world_size for x in agree if x.local_world_size is not None), None
        ),
        source=source,
        variables=variables,
    )


def detect_rank_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """Return ``(rank, world_size)`` for this process: :func:`detect_launch`'s, without the rest.

    Raises:
        LaunchEnvironmentError: See :func:`detect_launch`.
        InvalidArgumentError: Invalid arguments (rank outside ``[0, world_size)``).
    """
    launch = detect_launch(rank, world_size)
    return launch.rank, launch.world_size
