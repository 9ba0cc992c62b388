"""Rank, world size, local rank and local size from each launcher's variables, and the refusals.

The environments below are what the real launchers set (recorded from Open MPI 4.1's ``mpirun``
and Slurm 22.05's ``sbatch``/``salloc``/``srun`` on this machine; ``torchrun`` and Horovod's Gloo
launcher from their documentation); the real launches run in ``tests/e2e/test_launchers.py``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import fastload
import fastload.loader._dist as dist_module
from fastload.dali._backend import local_rank
from fastload.errors import InvalidArgumentError, LaunchEnvironmentError
from fastload.loader import (
    BatchStream,
    Launch,
    TokenLoader,
    detect_launch,
    detect_rank_world,
    open_tokens,
)
from fastload.loader._launch import LAUNCH_VARIABLES, parse_environment, tasks_per_node
from fastload.storage import LocalStore
from fastload.testing import need
from fastload.testing.tokens import write_token_dataset

# --- what the launchers set (one process's view) -------------------------------------------------

TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
TORCHRUN |= {"GROUP_RANK": "1", "TORCHELASTIC_RUN_ID": "none", "MASTER_PORT": "29500"}
HOROVOD_GLOO = {
    "HOROVOD_RANK": "2",
    "HOROVOD_SIZE": "4",
    "HOROVOD_LOCAL_RANK": "0",
    "HOROVOD_LOCAL_SIZE": "2",
    "HOROVOD_CROSS_RANK": "1",
    "HOROVOD_CROSS_SIZE": "2",
    "HOROVOD_CONTROLLER": "gloo",
}
MPIRUN = {  # mpirun -n 3, process 1
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "3",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
    "OMPI_COMM_WORLD_NODE_RANK": "1",
    "OMPI_UNIVERSE_SIZE": "2",
    "PMIX_RANK": "1",
}
HYDRA = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
SBATCH_SHELL = {  # sbatch -n 4: the batch script itself, one process
    "SLURM_JOB_ID": "2",
    "SLURM_NTASKS": "4",
    "SLURM_NPROCS": "4",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_TASKS_PER_NODE": "4",
    "SLURM_GTIDS": "0",
}
SALLOC_SHELL = {"SLURM_JOB_ID": "3", "SLURM_NTASKS": "4", "SLURM_NPROCS": "4"}
SRUN = {  # srun -n 3, task 2
    "SLURM_JOB_ID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_PROCID": "2",
    "SLURM_LOCALID": "2",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "3",
    "SLURM_NPROCS": "3",
    "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_STEP_TASKS_PER_NODE": "3",
    "SLURM_TASKS_PER_NODE": "3",
}
SRUN_PMI2 = {  # srun -n 2 --mpi=pmi2, task 1 (in an sbatch -n 4 job)
    **SRUN,
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2",
    "PMI_RANK": "1",
    "PMI_SIZE": "2",
    "PMI_FD": "13",
}
SRUN_AGENTS = {  # srun -N 2 --ntasks-per-node 1 (a launcher's agent per node), task 1
    **SRUN,
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "2",
    "SLURM_NPROCS": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "SLURM_TASKS_PER_NODE": "1(x2)",
}


def launch(env: dict[str, str], rank: int | None = None, world: int | None = None) -> Launch:
    return detect_launch(rank, world, environ=env)


def place(found: Launch) -> tuple[int, int, int | None, int | None, str]:
    return (found.rank, found.world_size, found.local_rank, found.local_world_size, found.source)


@pytest.fixture(autouse=True)
def _no_torch_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """No process group unless a test sets one; none of the test runner's own variables."""
    monkeypatch.setattr(dist_module, "_torch_group", lambda: None)
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)


# --- each launcher alone ---------------------------------------------------------------------------


def test_a_plain_process_is_rank_0_of_1() -> None:
    assert place(launch({})) == (0, 1, None, None, "single process")
    assert launch({"PATH": "/usr/bin", "SLURM_CONF": "/etc/slurm.conf"}).variables == {}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (TORCHRUN, (5, 8, 1, 4, "torchrun")),
        (HOROVOD_GLOO, (2, 4, 0, 2, "horovodrun")),
        (MPIRUN, (1, 3, 1, 3, "Open MPI")),
        (HYDRA, (3, 4, 1, 2, "MPICH/PMI")),
        (SRUN, (2, 3, 2, 3, "SLURM srun")),
        ({"RANK": "1", "WORLD_SIZE": "2"}, (1, 2, None, None, "torchrun")),  # set by hand
    ],
    ids=["torchrun", "horovodrun", "mpirun", "hydra", "srun", "rank-world-by-hand"],
)
def test_each_launcher(env: dict[str, str], expected: tuple[Any, ...]) -> None:
    found = launch(env)
    assert place(found) == expected
    assert set(found.variables) <= set(env)
    assert detect_rank_world.__module__ == dist_module.__name__


@pytest.mark.parametrize(
    ("tasks", "node", "local_world"),
    [
        ("2(x3),1", "2", 2),
        ("2(x3),1", "3", 1),
        ("4", None, 4),
        ("2,3", None, None),
        ("x", "0", None),
    ],
)
def test_srun_local_size_from_the_tasks_per_node(
    tasks: str, node: str | None, local_world: int | None
) -> None:
    env = {**SRUN, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_TASKS": "7"}
    env |= {"SLURM_STEP_TASKS_PER_NODE": tasks}
    env.pop("SLURM_NODEID")
    if node is not None:
        env["SLURM_NODEID"] = node
    assert launch(env).local_world_size == local_world


@given(st.lists(st.tuples(st.integers(1, 64), st.integers(1, 5)), min_size=1, max_size=6))
def test_tasks_per_node_expands_slurms_list(runs: list[tuple[int, int]]) -> None:
    text = ",".join(f"{n}(x{k})" if k > 1 else str(n) for n, k in runs)
    assert tasks_per_node(text) == [n for n, k in runs for _ in range(k)]


# --- real nestings: the innermost launcher wins -------------------------------------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (SBATCH_SHELL, (0, 1, None, None, "single process")),  # python in the batch script
        (SALLOC_SHELL, (0, 1, None, None, "single process")),  # python in an salloc shell
        ({**SBATCH_SHELL, **MPIRUN}, (1, 3, 1, 3, "Open MPI")),  # mpirun in an sbatch script
        (  # mpirun's process on a second node: the orted daemons' srun step, 2 tasks
            {**MPIRUN, **SRUN_AGENTS},
            (1, 3, 1, 3, "Open MPI"),
        ),
        (  # srun -N 2 torchrun --nproc-per-node 4: node 1's agent is SLURM task 1
            {**SRUN_AGENTS, **TORCHRUN},
            (5, 8, 1, 4, "torchrun"),
        ),
        ({**SBATCH_SHELL, **HOROVOD_GLOO}, (2, 4, 0, 2, "horovodrun")),
        (SRUN_PMI2, (1, 2, 1, 2, "MPICH/PMI")),  # the same values from both
    ],
    ids=[
        "sbatch",
        "salloc",
        "mpirun-in-sbatch",
        "mpirun-remote-node",
        "srun-torchrun",
        "hvd",
        "pmi2",
    ],
)
def test_nested_launches(env: dict[str, str], expected: tuple[Any, ...]) -> None:
    assert place(launch(env)) == expected


# --- refusals: never (0, 1) for a multi-process launch ------------------------------------------


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"WORLD_SIZE": "4"}, ["WORLD_SIZE=4", "RANK is not"]),
        ({"RANK": "2"}, ["RANK=2", "WORLD_SIZE is not"]),
        ({"LOCAL_RANK": "1"}, ["LOCAL_RANK=1", "neither RANK nor WORLD_SIZE"]),
        ({"HOROVOD_LOCAL_SIZE": "2"}, ["HOROVOD_LOCAL_SIZE=2", "neither HOROVOD_RANK"]),
        ({"HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "0"}, ["HOROVOD_SIZE=2", "HOROVOD_RANK"]),
        ({"OMPI_COMM_WORLD_SIZE": "3"}, ["OMPI_COMM_WORLD_SIZE=3", "OMPI_COMM_WORLD_RANK"]),
        ({"PMI_RANK": "1"}, ["PMI_RANK=1", "PMI_SIZE is not"]),
        ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "3"}, ["SLURM_NTASKS=3", "SLURM_PROCID"]),
        ({"PMIX_RANK": "2"}, ["PMIX_RANK=2", "world size"]),
        ({**MPIRUN, "OMPI_COMM_WORLD_RANK": "3"}, ["OMPI_COMM_WORLD_RANK=3 is outside [0"]),
        ({**MPIRUN, "OMPI_COMM_WORLD_RANK": "one"}, ["OMPI_COMM_WORLD_RANK='one' is not an int"]),
        ({**TORCHRUN, "LOCAL_RANK": "4"}, ["LOCAL_RANK=4 is outside [0, LOCAL_WORLD_SIZE=4)"]),
        ({**TORCHRUN, "LOCAL_WORLD_SIZE": "9"}, ["LOCAL_WORLD_SIZE gives 9", "WORLD_SIZE=8"]),
        ({**SRUN, "SLURM_LOCALID": "3"}, ["SLURM_LOCALID=3 is outside"]),
        ({"WORLD_SIZE": "0", "RANK": "0"}, ["WORLD_SIZE=0 is not a positive"]),
        (  # RANK/WORLD_SIZE exported by hand, then mpirun -n 3: would be 3 copies of the data
            {**MPIRUN, "RANK": "0", "WORLD_SIZE": "1"},
            ["torchrun says 1 process(es)", "Open MPI started 3", "stale"],
        ),
        (  # HOROVOD_* inherited into an srun -n 3 job
            {**SRUN, "HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"},
            ["horovodrun says 2", "SLURM srun started 3"],
        ),
    ],
    ids=lambda x: "-".join(sorted(x)) if isinstance(x, dict) else None,
)
def test_an_incomplete_or_contradicted_launch_is_refused(
    env: dict[str, str], names: list[str]
) -> None:
    with pytest.raises(LaunchEnvironmentError) as info:
        launch(env)
    message = str(info.value)
    for name in names:
        assert name in message
    assert "pass rank= and world_size=" in message
    assert info.value.variables == {k: v for k, v in env.items() if k in LAUNCH_VARIABLES}
    assert isinstance(info.value, InvalidArgumentError)
    assert isinstance(info.value, ValueError)
    # ... and the way out the message names works, whatever the environment says
    assert place(launch(env, 1, 2))[:2] == (1, 2)
    assert launch(env, 1, 2).source == "arguments"


def test_local_variables_alone_for_one_process_or_beside_a_launcher() -> None:
    assert place(launch({"LOCAL_RANK": "0"})) == (0, 1, None, None, "single process")
    # mpirun, and LOCAL_RANK=$OMPI_COMM_WORLD_LOCAL_RANK exported for the training code
    assert place(launch({**MPIRUN, "LOCAL_RANK": "1"})) == (1, 3, 1, 3, "Open MPI")


def test_a_world_of_one_needs_no_rank() -> None:
    assert place(launch({"WORLD_SIZE": "1"})) == (0, 1, None, None, "torchrun")
    assert place(launch({"OMPI_COMM_WORLD_SIZE": "1"}))[:2] == (0, 1)


def test_parse_environment_reports_every_problem() -> None:
    launches, problems, seen = parse_environment({"WORLD_SIZE": "2", "PMI_SIZE": "x", **SRUN})
    assert [x.launcher for x in launches] == ["SLURM srun"]
    assert len(problems) == 2
    assert seen["PMI_SIZE"] == "x"


# --- explicit arguments and torch.distributed ----------------------------------------------------


def test_arguments_win_and_keep_the_launchers_local_rank_when_they_agree() -> None:
    assert place(launch(MPIRUN, 1, 3)) == (1, 3, 1, 3, "arguments")
    assert place(launch(MPIRUN, 0, 2)) == (0, 2, None, None, "arguments")  # not this launch
    assert place(launch(MPIRUN, 2)) == (2, 3, None, None, "Open MPI")  # world from mpirun


def test_one_argument_with_a_refused_environment_still_refuses() -> None:
    with pytest.raises(LaunchEnvironmentError, match="OMPI_COMM_WORLD_SIZE=3"):
        launch({"OMPI_COMM_WORLD_SIZE": "3"}, rank=0)


def test_arguments_are_checked() -> None:
    with pytest.raises(InvalidArgumentError, match=r"rank must be an int in \[0, world_size=3\)"):
        launch(MPIRUN, rank=3)  # world 3 from mpirun
    with pytest.raises(InvalidArgumentError, match="world_size must be an int >= 1"):
        launch({}, 0, 0)
    with pytest.raises(InvalidArgumentError, match="rank must be an int"):
        launch({}, True, 2)  # type: ignore[arg-type]


def test_torch_distributed_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist_module, "_torch_group", lambda: (1, 3))
    assert place(launch(MPIRUN)) == (1, 3, 1, 3, "torch.distributed")  # its local rank
    assert place(launch({})) == (1, 3, None, None, "torch.distributed")
    # a broken environment does not matter when a group says where the process is
    assert place(launch({"WORLD_SIZE": "3"})) == (1, 3, None, None, "torch.distributed")
    # srun -N 2 torchrun: the group is torchrun's
    monkeypatch.setattr(dist_module, "_torch_group", lambda: (5, 8))
    assert place(launch({**SRUN_AGENTS, **TORCHRUN}))[:2] == (5, 8)


def test_a_group_smaller_than_the_launch_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist_module, "_torch_group", lambda: (0, 1))
    with pytest.raises(LaunchEnvironmentError, match=r"group has 1 process.*Open MPI started 3"):
        launch(MPIRUN)
    assert place(launch(MPIRUN, 0, 1))[:2] == (0, 1)


# --- the loaders ---------------------------------------------------------------------------------


def test_the_loaders_take_the_launchers_place(
    fake: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    for name, value in MPIRUN.items():
        monkeypatch.setenv(name, value)
    ds = fake.make_dataset([7, 5])
    loader = fastload.DataLoader(ds, batch_size=2)
    assert (loader.rank, loader.world_size) == (1, 3)
    assert len(loader) == 2  # ceil(12 / 6)
    assert (BatchStream(ds, 2).rank, BatchStream(ds, 2).world_size) == (1, 3)
    mixed = fastload.mix([(ds, 1), (fake.make_dataset([4]), 1)])
    assert fastload.DataLoader(mixed, batch_size=2).world_size == 3
    store = LocalStore(tmp_path)
    write_token_dataset(store, [list(range(1, 40))], block_tokens=16)
    tokens = TokenLoader(open_tokens(str(tmp_path), 4, seed=0), 2)
    assert (tokens.rank, tokens.world_size) == (1, 3)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")  # stale, smaller than mpirun's world
    with pytest.raises(LaunchEnvironmentError, match="stale"):
        fastload.DataLoader(ds, batch_size=2)
    with pytest.raises(LaunchEnvironmentError, match="stale"):
        TokenLoader(open_tokens(str(tmp_path), 4, seed=0), 2)
    assert fastload.DataLoader(ds, batch_size=2, rank=2, world_size=3).rank == 2


def test_dali_picks_the_launchers_local_rank() -> None:
    assert local_rank(launch(MPIRUN)) == 1
    assert local_rank(launch(SRUN)) == 2
    assert local_rank(launch({}, 0, 1)) == 0  # no local rank: rank modulo the GPUs (or 0)


def test_the_dali_loader_takes_the_launchers_place(
    fake: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    from fastload.dali import DALILoader, dali_available

    need("DALI", dali_available(), "pip install 'fastload[dali]'")
    for name, value in SRUN.items():
        monkeypatch.setenv(name, value)
    data = fake.build_format_dataset(str(tmp_path / "ds"), [7, 5], "webdataset")
    loader = DALILoader(data, 2, fields=("bin", "cls"), device="cpu")
    assert (loader.rank, loader.world_size) == (2, 3)
    monkeypatch.delenv("SLURM_PROCID")
    with pytest.raises(LaunchEnvironmentError, match="SLURM_PROCID"):
        DALILoader(data, 2, fields=("bin", "cls"), device="cpu")
