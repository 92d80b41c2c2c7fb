"""Starting a run: checks before anything is spawned, the out_dir lock, the processes, and the exit code.

Every process of the run passes through `launch`: Fabric's launcher (which becomes rank 0 and spawns the
node's other ranks, which run the same command), or each rank that torchrun or srun started.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

from litsft.cli.validation import check_machine, check_run
from litsft.runtime import processes
from litsft.runtime.preemption import PREEMPTED_EXIT_CODE, PreemptionFlag
from litsft.runtime.run_lock import RunLock
from litsft.runtime.timings import run_timer
from litsft.training.args import RunConfig, step_geometry, with_defaults
from litsft.training.devices import choose_accelerator, default_precision, gpu_count
from litsft.training.recipe import Recipe

if TYPE_CHECKING:
    from lightning.fabric import Fabric


def launch(recipe_name: str, build_recipe: Callable[[], Recipe], run: RunConfig) -> None:
    """Validate the run, take the out_dir lock, start the processes and train `build_recipe()`. Every check
    that can fail fails here, before any process is spawned or anything in out_dir changes; those that need
    only the arguments and files fail before torch is imported, and all of them before Lightning is."""
    run_timer.mark("start-up: Python packages, command line, model found")
    # First: a signal during setup must stop the run at a step, not kill it.
    preemption = PreemptionFlag.install()
    preemption.report = processes.is_first_process()
    check_run(run, recipe_name)
    run_timer.mark("checks before launch: tokenizer, data, out_dir")
    gpus = gpu_count() if run.accelerator != "cpu" else 0  # on the CPU, torch need not be asked
    accelerator = choose_accelerator(run.accelerator, gpus)
    run = with_defaults(dataclasses.replace(run, accelerator=accelerator), default_precision(accelerator))
    check_machine(run, gpus)
    step_geometry(run.train, run.layout.data_replicas)  # after the device count, which they depend on
    # The run has passed every check: only now the model, the engine and Lightning are imported.
    from litsft.training.engine import fit
    from litsft.training.parallel import build_fabric

    recipe = build_recipe()
    run_timer.mark("importing torch, Lightning and the model code")
    if run.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts; ranks inherit it
    spawned = processes.is_spawned_rank()
    if spawned:
        preemption.stopped_exit_code = 0
    with RunLock(run.out_dir) if processes.is_first_process() else nullcontext() as lock:
        fabric = build_fabric(
            run.layout, run.precision, run.fsdp, run.accelerator, run.train.compile, run.train.float8
        )
        if processes.will_spawn(fabric):
            os.environ[processes.LAUNCHER_PID_ENV] = str(os.getpid())
        try:
            preemption.before_exit = functools.partial(stop_at_once, fabric, lock)
            with rendezvous_watch(fabric, run, preemption):
                fabric.launch(fit, recipe, run)
        except SystemExit as stop:
            if stop.code != PREEMPTED_EXIT_CODE:
                processes.kill(processes.spawned_processes(fabric))
                raise
            if spawned:
                # The launcher reports the stop (see PreemptionFlag.stopped_exit_code).
                preemption.ignore_ctrl_c_while_exiting()
                raise SystemExit(0) from None
            processes.wait_for(processes.spawned_processes(fabric), timeout_s=60)
            raise
        except BaseException:
            processes.kill(processes.spawned_processes(fabric))
            raise
        finally:
            if os.environ.get(processes.LAUNCHER_PID_ENV) == str(os.getpid()):
                del os.environ[processes.LAUNCHER_PID_ENV]


def stop_at_once(fabric: Fabric, lock: RunLock | None) -> None:
    """What this process does before it ends without unwinding: stop the ranks it spawned, free out_dir."""
    processes.kill(processes.spawned_processes(fabric))
    if lock is not None:
        lock.release()


def rendezvous_watch(fabric: Fabric, run: RunConfig, preemption: PreemptionFlag) -> AbstractContextManager:
    """Ends this process with one line if the run's processes do not all join in time, or on a signal
    before they do (see litsft.runtime.rendezvous); nothing to watch for a single process."""
    from litsft.runtime.rendezvous import RendezvousWatch

    if run.world_size == 1:
        return nullcontext()
    environment = fabric.strategy.cluster_environment
    node = f" (this is node {fabric.node_rank} of {run.num_nodes})" if run.num_nodes > 1 else ""
    expected = (
        f"waiting for the {run.world_size} processes of --devices {run.devices} x --num_nodes {run.num_nodes} "
        f"to join at {environment.main_address}:{environment.main_port}{node}"
    )
    return RendezvousWatch(preemption, expected)
