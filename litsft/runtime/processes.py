"""Which process is which, before and after launch.

Fabric's launcher runs rank 0 itself and spawns the node's other ranks as subprocesses of it (they re-run
the same command); torchrun and SLURM's srun start every rank themselves. This decides who takes the
out_dir lock and who reports errors, checks the launcher's world size against --devices x --num_nodes,
and lets Fabric's launcher wait for or stop the ranks it spawned.
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

from litsft.errors import LitsftError

LAUNCHER_PID_ENV = "LITSFT_LAUNCHER_PID"
"""Set by a launcher that is about to spawn ranks; a process whose parent it names is one of them."""
CLUSTER_ENV = ("TORCHELASTIC_RUN_ID", "SLURM_NTASKS")
"""Lightning detects torchrun only with TORCHELASTIC_RUN_ID set (torch.distributed.is_torchelastic_launched)
and srun only with SLURM_NTASKS set (SLURMEnvironment.detect)."""


def is_spawned_rank() -> bool:
    """Whether this process is a rank that Fabric's launcher spawned (the launcher reports for it)."""
    return os.environ.get(LAUNCHER_PID_ENV) == str(os.getppid())


def is_first_process() -> bool:
    """Whether this process will be global rank 0 (or is the launcher that becomes it)."""
    if is_spawned_rank():
        return False
    for name in ("RANK", "SLURM_PROCID"):
        if name in os.environ:
            return os.environ[name] == "0"
    return os.environ.get("NODE_RANK", "0") == "0" and os.environ.get("LOCAL_RANK", "0") == "0"


def check_world_size(devices: int, num_nodes: int) -> None:
    """torchrun's or SLURM's process count must be --devices x --num_nodes, and several nodes need one of
    them (or NODE_RANK set by hand on each node)."""
    expected = devices * num_nodes
    torchrun = slurm = False
    if any(name in os.environ for name in CLUSTER_ENV):
        # Lightning (seconds to import) only when it could detect one: a local run is checked without it.
        from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

        torchrun, slurm = TorchElasticEnvironment.detect(), SLURMEnvironment.detect()
    if torchrun:
        world = int(os.environ.get("WORLD_SIZE", expected))
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", devices))
        if world != expected or per_node != devices:
            raise LitsftError(
                f"torchrun started {world} processes ({per_node} per node) but --devices {devices} x "
                f"--num_nodes {num_nodes} = {expected}; pass --devices {per_node} --num_nodes "
                f"{max(world // per_node, 1)}"
            )
    elif num_nodes > 1 and not slurm and "NODE_RANK" not in os.environ:
        raise LitsftError(
            f"--num_nodes {num_nodes} needs a process started on every node, and nothing started the others: "
            f"run the command under torchrun (--nnodes {num_nodes} --nproc_per_node {devices}) or srun on "
            "each node, or set NODE_RANK, MASTER_ADDR and MASTER_PORT on each node yourself"
        )
    elif not is_spawned_rank() and slurm:
        per_node = int(os.environ.get("SLURM_NTASKS_PER_NODE", devices))
        nodes = int(os.environ.get("SLURM_NNODES", num_nodes))
        if per_node != devices or nodes != num_nodes:
            raise LitsftError(
                f"SLURM runs {per_node} tasks per node on {nodes} nodes but this run asks for --devices "
                f"{devices} --num_nodes {num_nodes}; pass --devices {per_node} --num_nodes {nodes}, or "
                "change --ntasks-per-node/--nodes"
            )


def spawned_processes(fabric: Any) -> list[subprocess.Popen]:
    """The ranks Fabric's launcher started from this process (empty elsewhere)."""
    launcher = getattr(fabric.strategy, "launcher", None)
    return list(getattr(launcher, "procs", None) or [])


def will_spawn(fabric: Any) -> bool:
    launcher = getattr(fabric.strategy, "launcher", None)
    environment = getattr(launcher, "cluster_environment", None)
    return (
        type(launcher).__name__ == "_SubprocessScriptLauncher"
        and environment is not None
        and not environment.creates_processes_externally
        and getattr(launcher, "num_processes", 1) > 1
    )


def wait_for(processes: list[subprocess.Popen], timeout_s: float) -> None:
    """Wait for spawned ranks to exit; kill those still running after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def kill(processes: list[subprocess.Popen]) -> None:
    """Stop spawned ranks at once: after the launcher failed they wait in a collective that never completes,
    and would otherwise print a second report of the failure."""
    for process in processes:
        if process.poll() is None:
            process.kill()
    for process in processes:
        process.wait()
