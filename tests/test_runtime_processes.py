"""litsft/runtime/processes.py: which process is which from the environment torchrun, SLURM and Fabric's launcher
set, the world size checked against --devices x --num_nodes, and stopping spawned ranks."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from litsft.errors import LitsftError
from litsft.runtime import processes

RANK_VARIABLES = ("RANK", "SLURM_PROCID", "NODE_RANK", "LOCAL_RANK", processes.LAUNCHER_PID_ENV)
CLUSTER_VARIABLES = ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_NTASKS",
                     "SLURM_NTASKS_PER_NODE", "SLURM_NNODES", "SLURM_JOB_NAME")  # fmt: skip


@pytest.fixture(autouse=True)
def plain_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in RANK_VARIABLES + CLUSTER_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    ("env", "first"),
    [
        ({}, True),
        ({"RANK": "0"}, True),
        ({"RANK": "3"}, False),
        ({"SLURM_PROCID": "1"}, False),
        ({"RANK": "0", "SLURM_PROCID": "1"}, True),  # torchrun's RANK wins
        ({"NODE_RANK": "1"}, False),
        ({"LOCAL_RANK": "1"}, False),
    ],
)
def test_the_first_process_from_the_environment(
    env: dict, first: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert processes.is_first_process() is first


def test_a_rank_spawned_by_this_launcher_is_told_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not processes.is_spawned_rank()
    monkeypatch.setenv(processes.LAUNCHER_PID_ENV, str(os.getppid()))
    assert processes.is_spawned_rank() and not processes.is_first_process()
    monkeypatch.setenv(processes.LAUNCHER_PID_ENV, str(os.getpid()))  # the launcher itself
    assert not processes.is_spawned_rank()


def test_a_local_run_passes_and_several_nodes_need_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    processes.check_world_size(devices=8, num_nodes=1)
    with pytest.raises(LitsftError, match="--num_nodes 2 needs a process started on every node"):
        processes.check_world_size(devices=1, num_nodes=2)
    monkeypatch.setenv("NODE_RANK", "1")  # set by hand on each node
    processes.check_world_size(devices=1, num_nodes=2)


def test_torchrun_world_size_must_match(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    processes.check_world_size(devices=2, num_nodes=2)
    with pytest.raises(
        LitsftError, match=r"torchrun started 4 processes \(2 per node\) .* pass --devices 2 --num_nodes 2"
    ):
        processes.check_world_size(devices=4, num_nodes=1)


def test_slurm_tasks_must_match(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4", "SLURM_NNODES": "2"}.items():
        monkeypatch.setenv(name, value)
    processes.check_world_size(devices=4, num_nodes=2)
    with pytest.raises(
        LitsftError, match="SLURM runs 4 tasks per node on 2 nodes .* pass --devices 4 --num_nodes 2"
    ):
        processes.check_world_size(devices=8, num_nodes=1)
    monkeypatch.setenv("SLURM_JOB_NAME", "interactive")  # an interactive allocation is not a SLURM launch
    processes.check_world_size(devices=8, num_nodes=1)


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_waiting_for_spawned_ranks_kills_those_still_running_after_the_timeout() -> None:
    quick = subprocess.Popen([sys.executable, "-c", "pass"])
    slow = sleeper()
    start = time.monotonic()
    processes.wait_for([quick, slow], timeout_s=1.0)
    assert time.monotonic() - start < 30
    assert quick.returncode == 0 and slow.returncode == -9


def test_killing_spawned_ranks_stops_them_at_once() -> None:
    ranks = [sleeper(), sleeper()]
    processes.kill(ranks)
    assert [rank.returncode for rank in ranks] == [-9, -9]
